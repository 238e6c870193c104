"""Engine benchmark: prefill and decode throughput next to HF transformers `generate`, same run.

    .venv/bin/python bench/bench_engine.py [--models smollm2-135m-instruct gemma-3-270m] [--dtype bfloat16]
        [--reps 3] [--rounds 1]

Each side runs in its own subprocess (so peak RSS is its own) on the same cached
weights and dtype. Prompts are random token ids of fixed length (no padding
for HF batches). Decode tok/s = (tokens after the first) / (time after the
first token); prefill tok/s = prompt tokens / time to the first token. Medians
over --reps runs. With --rounds N both sides run N times, alternating which goes first, and
the ratio column is the median of the N per-round ratios: on a shared VM the machine's speed
drifts by tens of percent within minutes, which one side-after-the-other run reads as a
speed-up or a slow-down. Prints one markdown table per model.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

PREFILL_LENS = (512, 2048)
DECODE_BATCHES = (1, 8, 32, 64)
HF_BATCHES = (1, 8)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 30000), (n, length), generator=g).tolist()


def run_engine(model: str, dtype: str, new_tokens: int, reps: int, device: str = "cpu") -> dict:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_gb=1.0, max_num_seqs=64,
                                 max_num_batched_tokens=2048, device=device))
    vocab = eng.model_cfg.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    res: dict = {}
    eng.generate(_prompts(1, 64, vocab, 0), one)  # warm-up
    for length in PREFILL_LENS:
        ts = []
        for r in range(reps):
            p = _prompts(1, length, vocab, r + 1)
            t = time.perf_counter()
            eng.generate(p, one)
            ts.append(time.perf_counter() - t)
        res[f"prefill_{length}"] = length / statistics.median(ts)
    for b in DECODE_BATCHES:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        rates = []
        for r in range(reps):
            prompts = _prompts(b, 32, vocab, 100 + r)
            for i, p in enumerate(prompts):
                eng.add_request(f"b{b}-{r}-{i}", p, params)
            produced, t0 = 0, None
            while eng.has_unfinished():
                outs = eng.step()
                if t0 is None and outs:
                    t0 = time.perf_counter()  # every row has its first token
                    continue
                produced += sum(len(o.new_token_ids) for o in outs)
            rates.append(produced / (time.perf_counter() - t0))
        res[f"decode_{b}"] = statistics.median(rates)
    res["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def run_hf(model: str, dtype: str, new_tokens: int, reps: int, device: str = "cpu") -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model_cache import cached_model_dir

    tdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    hf = AutoModelForCausalLM.from_pretrained(str(cached_model_dir(model)), dtype=tdtype).eval().to(device)
    vocab = hf.config.vocab_size
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(prompts, n):
        x = torch.tensor(prompts, device=device)
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, **kw)
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    res: dict = {}
    gen(_prompts(1, 64, vocab, 0), 2)
    for length in PREFILL_LENS:
        ts = [gen(_prompts(1, length, vocab, r + 1), 1) for r in range(reps)]
        res[f"prefill_{length}"] = length / statistics.median(ts)
    for b in HF_BATCHES:
        rates = []
        for r in range(reps):
            prompts = _prompts(b, 32, vocab, 100 + r)
            first = gen(prompts, 1)
            full = gen(prompts, new_tokens)
            rates.append(b * (new_tokens - 1) / max(full - first, 1e-9))
        res[f"decode_{b}"] = statistics.median(rates)
    res["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def _child(side: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--models", args.models[0], "--dtype", args.dtype,
           "--new-tokens", str(args.new_tokens), "--reps", str(args.reps), "--device", args.device]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _rounds(sub, rounds: int) -> tuple[dict, dict, dict]:
    """Both sides `rounds` times, alternating which goes first (the machine's speed drifts on a
    shared VM): medians per side, and the median of each round's pdserve / HF ratio."""
    got = []
    for r in range(rounds):
        order = ("engine", "hf") if r % 2 == 0 else ("hf", "engine")
        got.append({side: _child(side, sub) for side in order})
    ours = {k: statistics.median(g["engine"][k] for g in got) for k in got[0]["engine"]}
    hf = {k: statistics.median(g["hf"][k] for g in got) for k in got[0]["hf"]}
    ratio = {k: statistics.median(g["engine"][k] / g["hf"][k] for g in got) for k in hf if k in ours}
    return ours, hf, ratio


def _table(model: str, dtype: str, ours: dict, hf: dict, ratio: dict, rounds: int) -> str:
    rows = [f"### {model} ({dtype}, {rounds} round(s))", "",
            "| metric | pdserve | HF transformers | ratio |", "|---|---:|---:|---:|"]
    for length in PREFILL_LENS:
        k = f"prefill_{length}"
        rows.append(f"| prefill tok/s, prompt {length} | {ours[k]:.0f} | {hf[k]:.0f} | {ratio[k]:.2f}x |")
    for b in DECODE_BATCHES:
        k = f"decode_{b}"
        h = hf.get(k)
        rows.append(f"| decode tok/s, batch {b} | {ours[k]:.1f} | {h:.1f} | {ratio[k]:.2f}x |" if h else
                    f"| decode tok/s, batch {b} | {ours[k]:.1f} | - | - |")
    for b in (1, 8):
        rows.append(f"| TPOT ms, batch {b} | {1000 * b / ours[f'decode_{b}']:.1f} | "
                    f"{1000 * b / hf[f'decode_{b}']:.1f} | |")
    rows.append(f"| batch 32 aggregate / own batch 1 | {ours['decode_32'] / ours['decode_1']:.1f}x | | |")
    rows.append(f"| peak RSS MB | {ours['rss_mb']:.0f} | {hf['rss_mb']:.0f} | |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run both sides this many times, alternating which goes first; the ratio "
                         "column is the median of the per-round ratios")
    ap.add_argument("--child", choices=["engine", "hf"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = run_engine if args.child == "engine" else run_hf
        print(json.dumps(fn(args.models[0], args.dtype, args.new_tokens, args.reps, args.device)))
        return
    for model in args.models:
        sub = argparse.Namespace(**{**vars(args), "models": [model]})
        ours, hf, ratio = _rounds(sub, max(1, args.rounds))
        print(_table(model, args.dtype, ours, hf, ratio, max(1, args.rounds)), "\n", flush=True)


if __name__ == "__main__":
    main()
