"""Per-request results (simulated or measured), their aggregates, goodput, and the tables.

Goodput: requests per second that met both SLOs (TTFT <= ttft_ms and ITL <= itl_ms; a
one-token request has no ITL and is judged on TTFT alone), over the run's span (first
request sent to last request finished). ITL is a request's mean gap between tokens after
the first, (e2e - ttft) / (output tokens - 1), as aiperf computes inter_token_latency.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

TTFT_PHASES = ("queue", "prefill_wait", "prefill")
ITL_PHASES = ("stage", "admission_wait", "transfer", "first_decode", "prefill_stall", "decode")


@dataclass
class RequestResult:
    start_s: float
    ttft_s: float
    e2e_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase, when known
    itl_measured_s: float | None = None  # the client's own ITL (aiperf's), preferred when given

    @property
    def end_s(self) -> float:
        return self.start_s + self.e2e_s

    @property
    def itl_s(self) -> float | None:
        if self.itl_measured_s is not None:
            return self.itl_measured_s
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets(self, ttft_ms: float, itl_ms: float) -> bool:
        itl = self.itl_s
        return self.ttft_s * 1e3 <= ttft_ms and (itl is None or itl * 1e3 <= itl_ms)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan when empty."""
    if not values:
        return math.nan
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def span_s(results: list[RequestResult]) -> float:
    if not results:
        return 0.0
    return max(r.end_s for r in results) - min(r.start_s for r in results)


def goodput(results: list[RequestResult], ttft_ms: float, itl_ms: float) -> float:
    span = span_s(results)
    return sum(r.meets(ttft_ms, itl_ms) for r in results) / span if span > 0 else 0.0


def summarize(results: list[RequestResult], ttft_ms: float, itl_ms: float, errors: int = 0) -> dict:
    """Aggregates (ms, per second) and the phase means (ms) of one configuration's run."""
    span = span_s(results)
    ttft = [r.ttft_s * 1e3 for r in results]
    itl = [r.itl_s * 1e3 for r in results if r.itl_s is not None]
    e2e = [r.e2e_s * 1e3 for r in results]
    out = {"requests": len(results), "errors": errors, "span_s": span,
           "goodput_rps": goodput(results, ttft_ms, itl_ms),
           "slo_met": sum(r.meets(ttft_ms, itl_ms) for r in results),
           "throughput_rps": len(results) / span if span > 0 else 0.0,
           "output_tps": sum(r.output_tokens for r in results) / span if span > 0 else 0.0,
           "cached_frac": (sum(r.cached_tokens for r in results) / max(1, sum(r.input_tokens for r in results)))}
    for name, vals in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_ms", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(vals, q)
    phases: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.phases.items():
            phases.setdefault(k, []).append(v * 1e3)
    out["phases_ms"] = {k: sum(v) / len(v) for k, v in phases.items()}
    return out


def dominant(phases_ms: dict[str, float]) -> tuple[str, str]:
    """(the phase with the largest mean among those before the first token, and among those
    after it) or '-' when the run has no phase data."""
    def top(names):
        have = {k: phases_ms[k] for k in names if k in phases_ms}
        return max(have, key=have.get) if have else "-"
    return top(TTFT_PHASES), top(ITL_PHASES)


def _f(v: float, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def table(rows: dict[str, dict], ttft_ms: float, itl_ms: float, predicted: dict[str, dict] | None = None) -> str:
    """Markdown table, one row per configuration (name -> summarize() output). With
    `predicted` (the simulator's, same keys) the goodput, TTFT p50 and ITL p50 cells show
    `measured / predicted (error: (measured - predicted) / predicted)`."""
    head = ["config", "requests", "SLO met", "goodput req/s", "req/s", "out tok/s", "TTFT p50", "TTFT p90",
            "TTFT p99", "ITL p50", "ITL p90", "ITL p99", "E2E p50", "E2E p99", "cached %", "TTFT phase",
            "ITL phase"]
    lines = [f"SLO: TTFT <= {ttft_ms:g} ms, ITL <= {itl_ms:g} ms (latencies in ms)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in rows.items():
        p = (predicted or {}).get(name)

        def cell(key, digits=1):
            if p is None:
                return _f(s[key], digits)
            err = f"{(s[key] - p[key]) / p[key] * 100:+.0f}%" if p[key] else "n/a"
            return f"{_f(s[key], digits)} / {_f(p[key], digits)} ({err})"
        ph_ttft, ph_itl = dominant(s["phases_ms"])
        lines.append("| " + " | ".join([
            name, str(s["requests"]), str(s["slo_met"]), cell("goodput_rps", 3), _f(s["throughput_rps"], 3),
            _f(s["output_tps"]), cell("ttft_ms_p50"), _f(s["ttft_ms_p90"]), _f(s["ttft_ms_p99"]), cell("itl_ms_p50"),
            _f(s["itl_ms_p90"]), _f(s["itl_ms_p99"]), _f(s["e2e_ms_p50"]), _f(s["e2e_ms_p99"]),
            _f(100 * s["cached_frac"], 0), ph_ttft, ph_itl]) + " |")
    return "\n".join(lines)


def phase_table(rows: dict[str, dict]) -> str:
    """Mean ms per phase and configuration, with the dominant phase of TTFT and of ITL."""
    names = [k for k in TTFT_PHASES + ITL_PHASES if any(k in s["phases_ms"] for s in rows.values())]
    if not names:
        return "(no phase data)"
    lines = ["| config | " + " | ".join(names) + " | dominates TTFT | dominates ITL |",
             "|" + "---|" * (len(names) + 3)]
    for name, s in rows.items():
        ph = s["phases_ms"]
        lines.append(f"| {name} | " + " | ".join(_f(ph.get(k)) for k in names) + " | "
                     + " | ".join(dominant(ph)) + " |")
    return "\n".join(lines)


def recommend(rows: dict[str, dict]) -> str:
    """The configuration with the highest goodput; ties (all zero: nothing meets the SLOs) go to
    the higher request throughput, then the lower TTFT p90, then the name."""
    return min(rows, key=lambda n: (-rows[n]["goodput_rps"], -rows[n]["throughput_rps"], rows[n]["ttft_ms_p90"], n))
