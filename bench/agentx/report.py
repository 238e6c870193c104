"""The comparison report: summary.json, report.md and PNG plots in one directory.

    write(out_dir, summary)   # summary: the dict described in bench/agentx/compare.py
    python -m bench.agentx.report DIR   # re-render report.md and the plots from DIR/summary.json

report.md: one row per configuration (TTFT, ITL, E2E at p50/p90/p99 in ms; output and input
tokens/s; requests/s; the server's prefix hit rate; requests and errors), then the phase
breakdown (mean ms per request of each phase, and which phase dominates TTFT and ITL).
Plots (matplotlib, Agg): ttft.png and itl.png (per-request distributions as CDFs, one line a
configuration), throughput.png (output tokens/s and requests/s per configuration).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.agentx import aiperf_client
from bench.agentx.server_metrics import ITL_PHASES, TTFT_PHASES


def _f(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _lat(d: dict | None, key: str) -> list[str]:
    d = (d or {}).get(key) or {}
    return [_f(d.get(p)) for p in aiperf_client.PERCENTILES]


def markdown(summary: dict) -> str:
    lines = [f"# AgentX replay: {summary['model']}, rank budget {summary['ranks']}", "",
             f"traces `{summary['trace_dir']}`, concurrency {summary['concurrency']}, "
             f"{summary['duration_s']:.0f} s profiled per configuration, {summary['cpus']} CPUs, "
             f"{summary['created']}", "",
             "Latencies in ms (aiperf, profiled requests). Prefix hit: share of prompt tokens the server "
             "served from its prefix caches (router /metrics, warm-up requests included). Throughputs: the "
             "successful profiled requests' tokens over their span, first request to last response.", "",
             "| config | TTFT p50 | p90 | p99 | ITL p50 | p90 | p99 | E2E p50 | p90 | p99 | out tok/s | in tok/s "
             "| req/s | prefix hit | requests | errors |",
             "|---|" + "---:|" * 15]
    for e in summary["configs"]:
        c, s = e.get("client") or {}, e.get("server") or {}
        hit = s.get("prefix_hit_rate")
        row = [e["name"], *_lat(c, "ttft_ms"), *_lat(c, "itl_ms"), *_lat(c, "e2e_ms"),
               _f(c.get("output_tok_s"), "{:.1f}"), _f(c.get("input_tok_s"), "{:.0f}"),
               _f(c.get("request_throughput"), "{:.3f}"), _f(None if hit is None else hit * 100, "{:.1f}%"),
               _f(c.get("requests")), _f(c.get("errors"))]
        lines.append("| " + " | ".join(row) + " |")
    failed = [e for e in summary["configs"] if not e["ok"]]
    for e in failed:
        lines.append(f"\n**{e['name']} failed**: {e['error']}")
    phases = [p for p in (*TTFT_PHASES, *ITL_PHASES)
              if any(p in ((e.get("server") or {}).get("phase_mean_ms") or {}) for e in summary["configs"])]
    lines += ["", "## Phase breakdown (server, mean ms per request)", "",
              "TTFT = queue + prefill_wait + prefill; the time after the first token (stage + admission_wait + "
              "transfer + first_decode + decode) spread over the output tokens is the ITL.", "",
              "| config | " + " | ".join(phases) + " | TTFT dominated by | ITL dominated by |",
              "|---|" + "---:|" * len(phases) + "---|---|"]
    for e in summary["configs"]:
        s = e.get("server") or {}
        means = s.get("phase_mean_ms") or {}
        per_tok = s.get("itl_phase_ms_per_token") or {}
        ttft = (f"{s['ttft_dominant_phase']} ({s['ttft_dominant_share'] * 100:.0f}%)"
                if s.get("ttft_dominant_phase") else "-")
        itl = "-"
        if s.get("itl_dominant_phase"):
            p = s["itl_dominant_phase"]
            itl = f"{p} ({s['itl_dominant_share'] * 100:.0f}%, {per_tok.get(p, 0):.1f} ms/token)"
        lines.append("| " + " | ".join([e["name"], *(_f(means.get(p), "{:.1f}") for p in phases), ttft, itl]) + " |")
    lines += ["", "Plots: `ttft.png`, `itl.png` (per-request CDFs), `throughput.png`. Per-request data: each "
              "configuration's `records` in summary.json.", ""]
    return "\n".join(lines)


def plots(out_dir: Path, summary: dict) -> list[Path]:
    """TTFT and ITL CDFs per configuration, throughput per configuration. Returns the files."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for metric, label, fname in (("time_to_first_token", "TTFT (ms)", "ttft.png"),
                                 ("inter_token_latency", "mean ITL per request (ms)", "itl.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for e in summary["configs"]:
            values = sorted(aiperf_client.record_values(Path(e["artifact_dir"]), metric))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=f"{e['name']} (n={len(values)})")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("share of requests")
        ax.set_title(f"{label.split(' (')[0]} distribution, {summary['model']}, concurrency {summary['concurrency']}")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        written.append(out_dir / fname)

    names = [e["name"] for e in summary["configs"]]
    panels = (("output_tok_s", "output tokens/s"), ("input_tok_s", "input tokens/s"),
              ("request_throughput", "requests/s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(10, 3.8))
    for ax, (key, label) in zip(axes, panels):
        ax.bar(names, [((e.get("client") or {}).get(key) or 0.0) for e in summary["configs"]],
               color=[f"C{i}" for i in range(len(names))])
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Throughput by configuration, {summary['model']}, rank budget {summary['ranks']}")
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=110)
    plt.close(fig)
    written.append(out_dir / "throughput.png")
    return written


def write(out_dir: Path, summary: dict) -> None:
    """summary.json, report.md and the plots into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out_dir / "report.md").write_text(markdown(summary))
    plots(out_dir, summary)


if __name__ == "__main__":
    d = Path(sys.argv[1])
    write(d, json.loads((d / "summary.json").read_text()))
    print((d / "report.md").read_text())
