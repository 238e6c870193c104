"""A SoakResult as a markdown report: verdict, outcomes, faults, unexpected errors, memory, pages."""
from __future__ import annotations

from .run import SoakResult

NOT_ERRORS = {  # outcome label -> what it means, in report order
    "ok": "ok (complete and well-formed)",
    "disconnected": "disconnected by the client mid-stream (fault)",
    "aborted": "aborted by the client before the end (fault)",
    "expected_4xx": "invalid request answered 4xx (fault)",
    "backpressure_429": "429: server full",
}


def render(res: SoakResult, title: str) -> str:
    t, cfg, failures = res.tally, res.config, res.failures
    lines = [f"# Soak: {title}", "",
             f"{cfg.minutes:g} min of load at concurrency {cfg.concurrency} (seed {cfg.seed}) against {res.url}; "
             f"load ran {res.load_s:.0f}s, ranks idle {_quiet(res)} after it.", "",
             "**PASS**" if not failures else "**FAIL**", *[f"- {f}" for f in failures], ""]
    ok = t.outcomes["ok"]
    lines += ["## Requests", "", "| outcome | count |", "|---|---:|"]
    lines += [f"| {desc} | {t.outcomes[label]} |" for label, desc in NOT_ERRORS.items()]
    lines += [f"| unexpected | {sum(t.unexpected.values())} |", f"| **total sent** | {t.finished} |",
              f"| answered, as the router counts them | {res.router_counted} |", "",
              f"Served {ok} ok requests: {ok / res.load_s:.2f} req/s, {t.tokens} completion tokens "
              f"({t.tokens / res.load_s:.1f} tok/s, ok requests only).", ""]
    lines += ["## Faults injected", "", "| fault | count |", "|---|---:|"]
    lines += [f"| {kind} | {n} |" for kind, n in sorted(t.faults.items())]
    lines += [f"| **total** | {sum(t.faults.values())} |", ""]
    if t.unexpected:
        lines += ["## Unexpected errors", "", "| class | count | first details |", "|---|---:|---|"]
        lines += [f"| {label} | {n} | {_cell('; '.join(t.details.get(label, [])))} |"
                  for label, n in t.unexpected.most_common()]
        lines.append("")
    lines += _memory(res) + _pages(res)
    return "\n".join(lines) + "\n"


def _quiet(res: SoakResult) -> str:
    return f"{res.quiet_s:.1f}s" if res.quiet_s is not None else f"NOT within {res.config.quiet_timeout_s:.0f}s"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:400]


def _memory(res: SoakResult) -> list[str]:
    first, warm, end = res.samples[0], res.warm_sample, res.samples[-1]
    growth = res.rss_growth()
    out = ["## Memory", "",
           f"RSS in MiB; private = RSS without shared memory (host cache, handoff pool). Growth: private at the "
           f"end minus private at t={warm.t:.0f}s (first sample after the {res.config.warmup:.0f}s warm-up); "
           f"limit {res.config.rss_growth_mb:.0f} MiB.", "",
           "| process | pid | RSS start | RSS end | RSS max | private start | private warm | private end | "
           "private max | growth |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, pid in res.pids.items():
        seen = [s.memory[name] for s in res.samples if name in s.memory]
        if not seen:
            out.append(f"| {name} | {pid} | gone |  |  |  |  |  |  |  |")
            continue

        def at(sample, attr: str, n=name) -> str:
            return f"{getattr(sample.memory[n], attr):.0f}" if n in sample.memory else "gone"
        grew = f"{growth[name]:+.0f}" if name in growth else "?"
        out.append(f"| {name} | {pid} | {at(first, 'rss_mb')} | {at(end, 'rss_mb')} | "
                   f"{max(m.rss_mb for m in seen):.0f} | {at(first, 'private_mb')} | {at(warm, 'private_mb')} | "
                   f"{at(end, 'private_mb')} | {max(m.private_mb for m in seen):.0f} | {grew} |")
    return out + [""]


def _pages(res: SoakResult) -> list[str]:
    first, end = res.samples[0].ranks, res.samples[-1].ranks
    out = ["## KV pages", "",
           "Device KV pages in use (idle: 0) and router-side in-flight requests; host cache pages are a cache "
           "and stay after requests end.", "",
           "| rank | pages start | pages max | pages end | of total | inflight max | host cache pages start / end |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for name in first:
        seen = [s.ranks[name] for s in res.samples if name in s.ranks]
        e = end.get(name, {})
        out.append(f"| {name} | {first[name]['pages_used']} | {max(r['pages_used'] for r in seen)} | "
                   f"{e.get('pages_used', '?')} | {first[name]['pages_total']} | "
                   f"{max(r['inflight'] for r in seen)} | {first[name].get('host_cache_pages')} / "
                   f"{e.get('host_cache_pages', '?')} |")
    if res.busy:
        out.append(f"\nStill busy at the end: {res.busy}")
    return out + [""]
