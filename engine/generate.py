"""Command-line demo: generate from a prompt with the engine (no server).

    python -m engine.generate "prompt" [--model NAME|PATH] [--max-tokens N] [--temperature T] [--chat]
"""
from __future__ import annotations

import argparse
import sys
import time

from engine.config import EngineConfig, add_cli_args, from_cli_args
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_cli_args(ap, EngineConfig)
    args = ap.parse_args(argv)
    if args.hicache_size_gb > 0:  # a rank builds one (rank_runtime/loading.py); one prompt never hits it
        ap.error("--hicache-size-gb: this demo runs without a host cache")
    eng = LLMEngine(from_cli_args(args, EngineConfig))
    tok = eng.tokenizer
    if args.chat and tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    else:
        ids = tok(args.prompt).input_ids
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    eng.add_request("cli", ids, params)
    t0, n = time.perf_counter(), 0
    while eng.has_unfinished():
        for out in eng.step():
            n += len(out.new_token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.2f}s, {n / dt:.1f} tok/s, prompt {len(ids)} tokens]", file=sys.stderr)


if __name__ == "__main__":
    main()
