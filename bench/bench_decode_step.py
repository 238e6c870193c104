"""Decode step time with and without the linear layers' quant copies, same run.

    .venv/bin/python bench/bench_decode_step.py [--model smollm2-135m-instruct] [--batches 1 4 16]
        [--ctx 540] [--threads 1] [--rounds 2]

Where the checkpoint is a GGUF model's, decode batches read each weight's block-quantized copy
(Q4_1 / Q8_0 blocks, exact) and rebuild the weights in registers: the bf16 kernels of
native/linear.py (AMX, AVX512-BF16), or native/quant_linear.py's fp32 kernel where the model
computes in float32 (CPUs without AVX512-BF16); the other side makes no quant copies and reads
the bf16 (or fp32) weights. Each side
runs in its own subprocess (its own load, its own caches), the two alternating which goes first
for --rounds rounds: on a shared VM the machine's speed drifts within minutes. A side adds B
requests of --ctx random prompt tokens, steps the engine until they finish (40 new tokens each),
and reports the median of its last 30 steps (decode only). The table gives each side's median
over the rounds and the median of the per-round ratios (quant / bf16). The two sides' greedy
tokens are compared too (bf16: they must be the same, the copies rebuild the same values and sum
them in the same order; fp32: the kernel's order is not torch's, so a near tie may differ).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def run_side(model: str, batches: list[int], ctx: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from engine.config import EngineConfig
    from engine.layers.linear import Linear
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=model, num_threads=threads, kv_cache_gb=1.0, max_num_seqs=64,
                                 max_num_batched_tokens=2048))
    mods = [m for m in eng.runner.model.modules() if isinstance(m, Linear)]
    res: dict = {"quant_layers": sum(m.quant_weight() is not None for m in mods), "layers": len(mods)}
    g = torch.Generator().manual_seed(7)
    for b in batches:
        for i in range(b):
            eng.add_request(f"b{b}-{i}", torch.randint(100, 30000, (ctx,), generator=g).tolist(),
                            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        times, tokens = [], {}
        while eng.has_unfinished():
            t = time.perf_counter()
            outs = eng.step()
            times.append(time.perf_counter() - t)
            for o in outs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        res[f"step_ms_{b}"] = statistics.median(times[-30:]) * 1e3
        res[f"tokens_{b}"] = [tokens[k] for k in sorted(tokens)]
    eng.close()
    return res


def _child(quant: bool, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--ctx", str(args.ctx),
           "--threads", str(args.threads), "--batches", *map(str, args.batches), *([] if quant else ["--no-quant"])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--ctx", type=int, default=540)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-quant", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.no_quant:  # the layers make no quant copy (the loader's attach_quant finds none)
            import engine.layers.linear as layers
            layers.pack_quant_weight = layers.pack_quant_f32 = lambda *a, **k: None
        print(json.dumps(run_side(args.model, args.batches, args.ctx, args.threads)))
        return
    got = []
    for r in range(max(1, args.rounds)):
        order = (True, False) if r % 2 == 0 else (False, True)
        got.append({q: _child(q, args) for q in order})
    q0 = got[0][True]
    print(f"### {args.model}: decode step, {args.threads} thread(s), {args.ctx}-token contexts, "
          f"{len(got)} round(s); {q0['quant_layers']} of {q0['layers']} linear layers have a quant copy\n")
    print("| batch | quant copies ms | bf16 weights ms | quant / bf16 | same tokens |")
    print("|---:|---:|---:|---:|---|")
    for b in args.batches:
        k = f"step_ms_{b}"
        q = statistics.median(g[True][k] for g in got)
        w = statistics.median(g[False][k] for g in got)
        ratio = statistics.median(g[True][k] / g[False][k] for g in got)
        same = all(g[True][f"tokens_{b}"] == g[False][f"tokens_{b}"] for g in got)
        print(f"| {b} | {q:.1f} | {w:.1f} | {ratio:.2f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
