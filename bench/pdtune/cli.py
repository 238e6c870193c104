"""pd_tune: pick the prefill/decode split with the highest goodput under TTFT and ITL SLOs.

    scripts/pd_tune.py measure  --model smollm2-135m-instruct --out costs.json [grid flags]
    scripts/pd_tune.py simulate --costs costs.json --workload DIR --ranks 4 --ttft-ms 2000 --itl-ms 200
    scripts/pd_tune.py sweep    --workload DIR --ranks 2 --ttft-ms 2000 --itl-ms 200 [--duration 120]
                                [--compare-sim costs.json]

measure: this machine's cost curves (bench/pdtune/measure.py), once (this 2-core machine's, 1
thread: pd_server/costs/smollm2-135m-instruct-cpu2.json in bf16, -cpu2-float32.json on an AVX2-only CPU). simulate: every split of
--ranks (colocated R, xPyD for x + y = R, and xPyD+cond: the router's --disagg auto, the decode
rank prefilling a request itself when its rule says so; plain xPyD is --disagg always) replayed in
the simulator (bench/pdtune/sim.py), any rank count and --cores (to plan past this machine).
sweep: every split started for real and replayed with aiperf (scripts/agentx_compare.sh),
per-request records read back. Both print the
table they decided from, the phase breakdown and the recommendation. A workload is a weka_trace
directory (--workload) or synthetic (--isl/--osl/--requests).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from bench.pdtune.report import phase_table, recommend, summarize, table


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.replace(",", " ").split()]


def _add_workload(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("workload: a weka_trace directory, or synthetic")
    g.add_argument("--workload", help="directory of weka_trace *.json files (aiperf --custom-dataset-type weka_trace)")
    g.add_argument("--isl", type=int, default=512, help="synthetic: prompt tokens")
    g.add_argument("--osl", type=int, default=128, help="synthetic: output tokens")
    g.add_argument("--requests", type=int, default=64, help="synthetic: request count")
    g.add_argument("--concurrency", type=int, default=4, help="sessions (conversations) in flight at once")
    g.add_argument("--duration", type=float, default=None,
                   help="seconds: sessions repeat and no request starts after it (sweep: aiperf "
                        "--benchmark-duration); default: every session once (simulate)")
    g.add_argument("--trajectory-start", default="0,1",
                   help="traces: the first --concurrency sessions entered at a random t* in LO,HI of their recorded "
                        "duration, the calls before it an unreported warm-up (aiperf's AgentX scenario sets 0,1); "
                        "'none': from the start")
    g.add_argument("--seed", type=int, default=42, help="simulate: the t* draws")
    ap.add_argument("--ranks", type=int, required=True, help="rank budget R: colocated R and every xPyD, x+y=R")
    ap.add_argument("--ttft-ms", type=float, required=True, help="SLO: time to first token")
    ap.add_argument("--itl-ms", type=float, required=True, help="SLO: mean inter-token latency of a request")
    ap.add_argument("--splits", help="only these, e.g. 'colocated-2,1P1D,1P1D+cond' (default: all of --ranks; "
                                     "simulate adds each xPyD+cond)")
    ap.add_argument("--json", dest="json_out", help="also write the aggregates here")


def _workload(args):
    from bench.pdtune.workload import load_trace_dir, synthetic

    if args.workload:
        return load_trace_dir(args.workload)
    return synthetic(args.isl, args.osl, args.requests)


def _splits(args, cond: bool = False):
    """--splits, else every split of --ranks (with `cond`, each xPyD's xPyD+cond too)."""
    from bench.pdtune.split import Split, splits

    if args.splits:
        chosen = [Split.parse(s) for s in args.splits.split(",")]
        if any(s.ranks != args.ranks for s in chosen):
            raise SystemExit("every --splits entry must use --ranks ranks")
        return chosen
    return splits(args.ranks, cond)


def simulate_rows(args, costs_path: str, names: list[str] | None = None) -> dict[str, dict]:
    """Simulated aggregates per split name (all of args.ranks, xPyD+cond included, or `names`)."""
    from bench.pdtune.costs import CostCurves
    from bench.pdtune.sim import simulate
    from bench.pdtune.split import Limits, Split

    curves = CostCurves.load(costs_path)
    sessions = _workload(args)
    limits = Limits(args.max_num_batched_tokens, args.max_num_seqs)
    start = None
    if args.workload and args.trajectory_start.lower() != "none":
        lo, hi = (float(v) for v in args.trajectory_start.split(","))
        start = (lo, hi)
    rows = {}
    for sp in ([Split.parse(n) for n in names] if names else _splits(args, cond=True)):
        res = simulate(sp, curves.for_ranks(sp.ranks, args.cores, shared=True), sessions, args.concurrency, limits,
                       args.duration, start, args.seed, (args.cores or curves.cores) - args.client_cores)
        rows[sp.name] = summarize(res, args.ttft_ms, args.itl_ms)
    return rows


def _print_decision(rows: dict[str, dict], args, kind: str, predicted=None) -> None:
    print(f"\n## {kind}: {args.ranks} ranks, concurrency {args.concurrency}, workload "
          f"{args.workload or f'synthetic {args.isl} in / {args.osl} out x {args.requests}'}\n")
    print(table(rows, args.ttft_ms, args.itl_ms, predicted))
    print("\nPhase means (ms):\n")
    print(phase_table(rows))
    best = recommend(rows)
    if rows[best]["goodput_rps"] > 0:
        print(f"\nRecommendation: {best} (goodput {rows[best]['goodput_rps']:.3f} req/s meeting TTFT <= "
              f"{args.ttft_ms:g} ms and ITL <= {args.itl_ms:g} ms)")
    else:
        print(f"\nNo split meets TTFT <= {args.ttft_ms:g} ms and ITL <= {args.itl_ms:g} ms for any request; "
              f"the highest throughput: {best} ({rows[best]['throughput_rps']:.3f} req/s). Relax the SLOs "
              "or add ranks/cores.")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"kind": kind, "rows": rows, "predicted": predicted, "recommendation": best}, f, indent=1)


def cmd_measure(args) -> None:
    from bench.pdtune.measure import measure

    # SIGTERM unwinds like Ctrl-C, so the host cache's shared memory is unlinked.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    curves = measure(args.model, args.threads, args.new, args.cached, args.batch, args.ctx, args.pages, args.reps)
    curves.save(args.out)
    print(f"wrote {args.out}")


def cmd_simulate(args) -> None:
    from bench.pdtune.costs import CostCurves

    curves = CostCurves.load(args.costs)
    cores = args.cores or curves.cores
    print(f"cost curves: {args.costs} ({curves.model}, measured on {curves.cores} cores); planning on {cores} cores, "
          f"{max(1, cores // args.ranks)} thread(s) per rank")
    _print_decision(simulate_rows(args, args.costs), args, "simulated")


def cmd_sweep(args) -> None:
    from bench.pdtune.sweep import run_sweep

    rows = run_sweep(args)
    predicted = simulate_rows(args, args.compare_sim, list(rows)) if args.compare_sim else None
    _print_decision(rows, args, "measured", predicted)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pd_tune.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("measure", help="measure this machine's cost curves into a JSON file")
    m.add_argument("--model", default="smollm2-135m-instruct")
    m.add_argument("--out", required=True)
    m.add_argument("--threads", type=_ints, default=[1, 2], help="torch thread counts (a rank gets cores // ranks)")
    m.add_argument("--new", type=_ints, default=[32, 256, 1024], help="prefill: new tokens per step")
    m.add_argument("--cached", type=_ints, default=[0, 1024, 4096], help="prefill: cached prefix tokens (x16)")
    m.add_argument("--batch", type=_ints, default=[1, 8, 32], help="decode: rows per step")
    m.add_argument("--ctx", type=_ints, default=[128, 1024, 4096], help="decode: context tokens per row")
    m.add_argument("--pages", type=_ints, default=[1, 16, 64, 256], help="transfer: KV pages per read")
    m.add_argument("--reps", type=int, default=3)
    m.set_defaults(fn=cmd_measure)

    for name, fn, help_ in (("simulate", cmd_simulate, "simulate every split from cost curves"),
                            ("sweep", cmd_sweep, "measure every split with aiperf")):
        p = sub.add_parser(name, help=help_)
        _add_workload(p)
        p.add_argument("--cores", type=int, default=0,
                       help="cores the R ranks share (default: the measuring machine's); threads = cores // R")
        p.add_argument("--client-cores", type=float, default=0.0,
                       help="simulation: cores the router and a client on the same machine take from the ranks "
                            "(calibrate with sweep --compare-sim); the ranks computing at each moment share the rest")
        p.add_argument("--max-num-batched-tokens", type=int, default=512, help="engine step token budget")
        p.add_argument("--max-num-seqs", type=int, default=64, help="engine running sequences at most")
        p.set_defaults(fn=fn)
    sub.choices["simulate"].add_argument("--costs", required=True, help="JSON from `measure`")
    sw = sub.choices["sweep"]
    sw.add_argument("--compare-sim", metavar="COSTS", help="print the simulator's prediction next to each number")
    sw.add_argument("--out", help="run directory (default: a new temp dir)")
    sw.add_argument("--from-run", metavar="DIR", nargs="+",
                    help="read finished agentx_compare runs instead of running (configurations merged, later wins)")
    sw.add_argument("--compare-args", default="", help="extra flags passed to scripts/agentx_compare.sh")
    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
