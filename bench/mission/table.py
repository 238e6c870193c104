"""The mission report: per-run results -> medians per (configuration, load) -> one markdown table.

    rows = aggregate(runs)                  # runs: the run dicts bench/mission/cli.py writes
    text = markdown(summary)                # summary: {"runs": [...], "configs": [...], ...}
    checks = goals(runs)                    # issues 36's and 58's goals for the default 2P2D, where measured
    text = phases_table(rows, runs)         # where a request's time went, from the router's /metrics

A run is one start of one configuration in one repeat: {"config", "repeat", "startup_s" (float
| None), "error", "loads": [{"load": "c8" | "agentx", "client": aiperf_client.Result.to_json()
| None, "server": ServerDelta.to_json() | None, ...}]}. Each (configuration, load) row takes
the median of every metric over the repeats that measured it (requests and errors: their
sum); the start-up time is the configuration's median over its starts. Ratios divide a row's
median by the reference configuration's at the same load (output tok/s: above 1 is more
throughput; TTFT and ITL: below 1 is faster).

The goals section (`goals`) checks issues 36's and 58's goals for the default 2P2D: each goal's ratio of
medians decides it, and beside it the same ratio within each repeat (the configurations of one
repeat run back to back, so a slow phase of the machine moves both sides less), which shows how
far the repeats disagree.

The phases section (`phases_table`) explains the client's numbers from the router's side: each
phase's mean per request (pd_server/metrics.py `phase_durations`; measure.py scrapes /metrics
around the load), the median over the repeats. A PD request's second token waits for the
handoff (stage, admission wait, transfer, first decode), which is spread over its inter-token
gaps: "handoff ms/token" is that part of its mean ITL, "decode ms/token" the rest.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# metric -> (path into a load's dict, table heading, format)
METRICS = {
    "out_tok_s": (("client", "output_tok_s"), "out tok/s", "{:.1f}"),
    "ttft_p50": (("client", "ttft_ms", "p50"), "TTFT p50 ms", "{:.0f}"),
    "ttft_p99": (("client", "ttft_ms", "p99"), "TTFT p99 ms", "{:.0f}"),
    "itl_p50": (("client", "itl_ms", "p50"), "ITL p50 ms", "{:.1f}"),
    "itl_p99": (("client", "itl_ms", "p99"), "ITL p99 ms", "{:.1f}"),
    "prefix_hit": (("server", "prefix_hit_rate"), "prefix hit", "{:.1%}"),
    "host_hit": (("server", "host_hit_rate"), "host-cache hit", "{:.1%}"),
    "l3_hit": (("server", "l3_hit_rate"), "L3 hit", "{:.1%}"),
    "kv_mib": (("server", "kv_mib_per_request"), "KV MiB pulled / request", "{:.1f}"),
}
RATIO_METRICS = ("out_tok_s", "ttft_p50", "itl_p50")
_RATIO_HEAD = {"out_tok_s": "tok/s", "ttft_p50": "TTFT p50", "itl_p50": "ITL p50"}


def _get(d: dict | None, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return None if d is None else float(d)


def median(values: list[float | None]) -> float | None:
    """The median of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def load_order(load: str) -> tuple[int, int]:
    """Synthetic levels by concurrency ("c1" < "c8" < "c32"), then anything else (agentx)."""
    if load.startswith("c") and load[1:].isdigit():
        return 0, int(load[1:])
    return 1, 0


@dataclass
class Row:
    config: str
    load: str
    runs: int = 0  # repeats that produced client numbers for this load
    tries: int = 0  # repeats of the configuration (failed starts included)
    requests: int = 0
    errors: int = 0
    startup_s: float | None = None
    medians: dict[str, float | None] = field(default_factory=dict)


def aggregate(runs: list[dict], configs: list[str] | None = None) -> list[Row]:
    """One Row per (configuration, load) seen in `runs`, configurations in `configs` order
    (else first seen), loads c1 < c8 < ... < agentx."""
    order = list(configs or [])
    for r in runs:
        if r["config"] not in order:
            order.append(r["config"])
    rows = []
    for name in order:
        mine = [r for r in runs if r["config"] == name]
        startup = median([r.get("startup_s") for r in mine])
        loads = sorted({ld["load"] for r in mine for ld in r.get("loads", [])}, key=load_order)
        for load in loads:
            done = [ld for r in mine for ld in r.get("loads", []) if ld["load"] == load and ld.get("client")]
            row = Row(name, load, runs=len(done), tries=len(mine), startup_s=startup,
                      requests=sum(int(ld["client"].get("requests") or 0) for ld in done),
                      errors=sum(int(ld["client"].get("errors") or 0) for ld in done))
            row.medians = {m: median([_get(ld, path) for ld in done]) for m, (path, _, _) in METRICS.items()}
            rows.append(row)
    return rows


def ratio(row: Row, ref: Row | None, metric: str) -> float | None:
    if ref is None or row is ref:
        return None
    a, b = row.medians.get(metric), ref.medians.get(metric)
    return None if a is None or not b else a / b


# Issues 36's and 58's goals for the default `--prefill 2 --decode 2`: (load, metric, reference, target,
# higher is better). The reference's row must be in the run for a goal to be checked.
GOAL_CONFIG = "2P2D"
GOALS = (
    ("agentx", "out_tok_s", "colocated-2", 1.0, True),
    ("agentx", "ttft_p50", "colocated-2", 1.1, False),
    ("agentx", "itl_p99", "colocated-2", 0.5, False),
    ("c8", "out_tok_s", "colocated-2", 0.95, True),
    ("c32", "out_tok_s", "colocated-2", 0.95, True),
    ("agentx", "out_tok_s", "vllm", 1.5, True),
    ("agentx", "ttft_p99", "vllm", 0.8, False),
    ("agentx", "itl_p99", "vllm", 0.3, False),
    # Issue 58's, against llama.cpp's own server (scripts/peer_llamacpp.sh).
    ("c1", "itl_p50", "llamacpp", 0.8, False),
    ("c8", "out_tok_s", "llamacpp", 1.8, True),
    ("c32", "out_tok_s", "llamacpp", 1.8, True),
    ("agentx", "out_tok_s", "llamacpp", 1.8, True),
    ("agentx", "ttft_p50", "llamacpp", 0.8, False),
)
NOLEND = "2P2D-nolend"  # where run: the default never worse than it, at any load (tok/s >= 1.0x)
MAX_WARM_START_S = 20.0
_GOAL_HEAD = {"out_tok_s": "tok/s", "ttft_p50": "TTFT p50", "ttft_p99": "TTFT p99", "itl_p50": "ITL p50",
              "itl_p99": "ITL p99"}


@dataclass
class Goal:
    what: str  # "AgentX ITL p99 / colocated-2", "warm start s", ...
    target: str  # ">= 1.00x", "<= 20 s", "0"
    value: float | None  # the ratio of medians (the start time, the error count)
    per_repeat: list[float]  # the same within each repeat that measured both sides
    met: bool | None  # None: not measured


def _value(run: dict, load: str, metric: str) -> float | None:
    for ld in run.get("loads", []):
        if ld["load"] == load and ld.get("client"):
            return _get(ld, METRICS[metric][0])
    return None


def goals(runs: list[dict], aggregated: list[Row] | None = None) -> list[Goal]:
    """Issues 36's and 58's goals for GOAL_CONFIG, those whose rows this run has (`aggregated`: aggregate(runs)
    where the caller has it already)."""
    rows = {(r.config, r.load): r for r in (aggregate(runs) if aggregated is None else aggregated)}
    mine = [r for r in runs if r["config"] == GOAL_CONFIG]
    if not mine:
        return []

    def paired(load: str, metric: str, ref: str) -> list[float]:
        out = []
        for run in mine:
            other = [r for r in runs if r["config"] == ref and r["repeat"] == run["repeat"]]
            a = _value(run, load, metric)
            b = _value(other[0], load, metric) if other else None
            if a is not None and b:
                out.append(a / b)
        return out

    checks = []
    goal_list = list(GOALS) + [(ld, "out_tok_s", NOLEND, 1.0, True) for (c, ld) in rows if c == NOLEND]
    for load, metric, ref, target, higher in goal_list:
        row, ref_row = rows.get((GOAL_CONFIG, load)), rows.get((ref, load))
        if row is None or ref_row is None:
            continue
        v = ratio(row, ref_row, metric)
        name = "AgentX" if load == "agentx" else load
        checks.append(Goal(f"{name} {_GOAL_HEAD[metric]} / {ref}", f"{'>=' if higher else '<='} {target:.2f}x", v,
                           paired(load, metric, ref),
                           None if v is None else (v >= target if higher else v <= target)))
    agentx = rows.get((GOAL_CONFIG, "agentx"))
    if agentx is not None:
        checks.append(Goal("AgentX errors", "0", float(agentx.errors), [], agentx.errors == 0))
    # the first start of a run may build kernels or convert the model: the warm start is the later ones
    warm = len(mine) > 1
    start = median([r.get("startup_s") for r in (mine[1:] if warm else mine)])
    checks.append(Goal("warm start s (starts after the first)" if warm else "start s (one start, maybe cold)",
                       f"<= {MAX_WARM_START_S:.0f} s", start, [], None if start is None else start <= MAX_WARM_START_S))
    return checks


def goals_table(checks: list[Goal]) -> str:
    lines = ["| goal | target | measured | per repeat | met |", "|---|---|---:|---|---|"]
    for g in checks:
        unit = "{:.2f}x" if g.target.endswith("x") else "{:.1f}" if " s" in g.target else "{:.0f}"
        lines.append(f"| {g.what} | {g.target} | {_f(g.value, unit)} | "
                     f"{', '.join(unit.format(x) for x in g.per_repeat) or '-'} | "
                     f"{'-' if g.met is None else 'yes' if g.met else '**no**'} |")
    return "\n".join(lines)


PHASES = ("queue", "prefill", "stage", "admission_wait", "transfer", "first_decode")
HANDOFF = ("stage", "admission_wait", "transfer", "first_decode")


def phases_table(rows: list[Row], runs: list[dict]) -> str:
    """Per (configuration, load) whose server reported phases: the median over its repeats of each
    phase's mean ms, and of the handoff's and the decode's ms a token of the mean ITL. "" if none."""
    lines = []
    for row in rows:
        servers = [ld.get("server") or {} for r in runs if r["config"] == row.config
                   for ld in r.get("loads", []) if ld["load"] == row.load and ld.get("client")]
        means = [s.get("phase_mean_ms") or {} for s in servers]
        per_token = [s.get("itl_phase_ms_per_token") or {} for s in servers]
        if not any(means):
            continue
        cells = [median([m.get(p) for m in means]) for p in PHASES]
        handoff = median([sum(t[p] for p in HANDOFF if p in t) if any(p in t for p in HANDOFF) else None
                          for t in per_token])
        cells += [handoff, median([t.get("decode") for t in per_token])]
        lines.append(f"| {row.config} | {row.load} | " + " | ".join(_f(c, "{:.1f}") for c in cells) + " |")
    if not lines:
        return ""
    head = ["config", "load", *(p.replace("_", " ") for p in PHASES), "handoff ms/token", "decode ms/token"]
    return "\n".join(["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2), *lines])


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: list[Row], refs: list[str]) -> str:
    """The markdown table; a ratio column group per name in `refs` that has rows."""
    by_key = {(r.config, r.load): r for r in rows}
    refs = [ref for ref in refs if any(r.config == ref for r in rows)]
    head = ["config", "load", "start s", *(h for _, h, _ in METRICS.values()), "requests", "errors", "runs"]
    head += [f"{_RATIO_HEAD[m]} / {ref}" for ref in refs for m in RATIO_METRICS]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        cells = [r.config, r.load, _f(r.startup_s, "{:.1f}"),
                 *(_f(r.medians.get(m), fmt) for m, (_, _, fmt) in METRICS.items()),
                 str(r.requests), str(r.errors), f"{r.runs}/{r.tries}"]
        for ref in refs:
            cells += [_f(ratio(r, by_key.get((ref, r.load)), m), "{:.2f}x") for m in RATIO_METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(summary: dict) -> str:
    """report.md: the settings, the table, then every failure and skipped configuration."""
    runs = summary.get("runs", [])
    rows = aggregate(runs, summary.get("configs"))
    s = summary.get("settings", {})
    lines = [f"# Mission benchmark: {summary.get('model', '?')}", "",
             f"{summary.get('created', '')}, {summary.get('cpus', '?')} CPUs, {s.get('repeats', 1)} repeat(s), "
             f"configurations interleaved per repeat. Synthetic: aiperf, {s.get('isl', '?')} in / "
             f"{s.get('osl', '?')} out (ignore_eos), levels {s.get('levels', '-')}; AgentX replay: "
             f"`{s.get('trace_dir', '-')}`, concurrency {s.get('agentx_concurrency', '-')}, "
             f"{s.get('agentx_duration_s', '-')} s profiled.", "",
             "Medians over the repeats (requests and errors: summed; runs: repeats with numbers / "
             "starts). start s: seconds from the start command to /health ready. Prefix hit: share "
             "of prompt tokens served from the server's prefix caches (its /metrics around the "
             "load; '-' where it exposes none); by tier: of the tokens the ranks looked up in their host "
             "caches, those the host cache held and those read from the L3 store; KV MiB pulled: what "
             "decode ranks read from prefill ranks per request. X / REF: this row's median over REF's at the same "
             "load (tok/s above 1 and TTFT/ITL below 1 are better).", "",
             table(rows, summary.get("ratio_to", [])), ""]
    checks = goals(runs, rows)
    if checks:
        lines += [f"Issues 36's and 58's goals for {GOAL_CONFIG} (the default): measured is the ratio of medians, per "
                  "repeat the same ratio within each repeat (configurations of a repeat run back to back); "
                  "the warm start is the median over the starts after the first.", "",
                  goals_table(checks), ""]
    phases = phases_table(rows, runs)
    if phases:
        lines += ["Where a request's time went, from the router's `pdserve_phase_seconds` around each load: mean ms "
                  "a request in each phase, median over the repeats (queue: router to rank; prefill: to the first "
                  "token; PD only: stage, admission wait, transfer and first decode, the handoff before the decode "
                  "rank's first token). Handoff and decode ms/token: their shares of the mean ITL.", "",
                  phases, ""]
    for r in runs:
        if r.get("error"):
            lines.append(f"- **{r['config']} repeat {r['repeat']}**: {r['error'].splitlines()[0]}")
        for ld in r.get("loads", []):
            if ld.get("error"):
                lines.append(f"- {r['config']} repeat {r['repeat']} {ld['load']}: {ld['error']}")
    for name, why in (summary.get("skipped") or {}).items():
        lines.append(f"- {name} skipped: {why}")
    return "\n".join(lines).rstrip() + "\n"
