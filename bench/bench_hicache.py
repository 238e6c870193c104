"""Host KV cache benchmark: copy throughput, lookup cost, and multi-turn TTFT with the cache on and off.

    .venv/bin/python bench/bench_hicache.py [--model smollm2-135m-instruct] [--dtype bfloat16]
        [--convs 10 --turns 8 --context 2000 --turn-tokens 200] [--skip-multi-turn]

1. Store (device pool -> host pool) and load (host -> device) of 1, 16 and 256
   engine-shaped pages at scattered page ids, through `copy_pages` and through
   HostCache.store / lookup + load (hashing and index included), next to libc memcpy
   (ctypes.memmove) of the same number of bytes between two contiguous buffers.
   The "device" pool is a CPU tensor here unless --device cuda.
2. Lookup cost per page for a 32k-token prompt whose chain is fully stored (hash +
   index walk + pin/unpin), and hashing alone.
3. Multi-turn: --convs conversations x --turns turns, each turn adding --turn-tokens
   random tokens (the model's --out-tokens answer included) to a --context-token
   start; conversations interleave turn by turn. Each turn is prefilled once with
   `prefix_cache=False` and once with the cache on, same engine and weights; TTFT =
   add_request -> first token, one request at a time. Medians over conversations.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVPool
from engine.model_cache import cached_model_dir
from hicache.cache import HostCache
from hicache.index import PrefixIndex, namespace_key, page_keys
from native.page_copy import copy_pages

PAGE_COUNTS = (1, 16, 256)


def _time(fn, reps: int) -> float:
    fn()  # warm (first touch of shared memory, kernel load)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_copy(args, model_cfg: ModelConfig) -> str:
    dtype = EngineConfig(dtype=args.dtype).torch_dtype
    num_pages = 2 * max(PAGE_COUNTS) + 8
    page_bytes = KVPool.bytes_per_page(model_cfg, args.page_size, dtype)
    cfg = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, page_size=args.page_size,
                       hicache_size_gb=(num_pages * page_bytes + 2**20) / 2**30, hicache_state_slots=0)
    cache = HostCache.for_engine(cfg, model_cfg, max_model_len=1 << 20)
    kv = KVPool(model_cfg, args.page_size, num_pages, 1, dtype, torch.device(args.device))
    kv.full.normal_()
    g = torch.Generator().manual_seed(0)
    rows = [f"### copy throughput, {args.model} {args.dtype}, page = {page_bytes / 2**10:.0f} KiB "
            f"(device = {args.device}; copy_pages threads: {args.copy_threads or 'default'}, "
            f"HostCache: default; torch threads {torch.get_num_threads()})", "",
            "| pages | MiB | memcpy GB/s | copy_pages store GB/s (% memcpy) | copy_pages load GB/s (% memcpy) "
            "| HostCache.store GB/s | HostCache.lookup+load GB/s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in PAGE_COUNTS:
        nbytes = n * page_bytes
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(1), b.fill_(2)
        reps = max(5, 2000 // n)
        t_mem = _time(lambda: ctypes.memmove(b.data_ptr(), a.data_ptr(), nbytes), reps)
        dev = torch.randperm(num_pages, generator=g)[:n].tolist()
        host = torch.randperm(cache.pool.num_pages, generator=g)[:n].tolist()

        def sync():
            if kv.full.is_cuda:
                torch.cuda.synchronize()

        th = args.copy_threads
        t_store = _time(lambda: (copy_pages(kv.full, cache.pool.pages, dev, host, th), sync()), reps)
        t_load = _time(lambda: (copy_pages(cache.pool.pages, kv.full, host, dev, th), sync()), reps)
        # Through the cache (hashing, index and counters included): a fresh chain each rep
        # into an emptied cache (emptying is not timed), then a lookup + load of it.
        ts_store, ts_load = [], []
        for _ in range(reps + 1):
            while (node := cache.index.evict_page()) is not None:
                cache.pool.free_page(node.page)
            prompt = torch.randint(0, 30000, (n * args.page_size + 1,), generator=g).tolist()
            t = time.perf_counter()
            assert cache.store(prompt[:-1], kv, dev, None) == n
            ts_store.append(time.perf_counter() - t)
            t = time.perf_counter()
            cache.load(cache.lookup(prompt), kv, dev, None)
            ts_load.append(time.perf_counter() - t)
        t_cstore, t_cload = statistics.median(ts_store[1:]), statistics.median(ts_load[1:])
        gbs = lambda t: nbytes / t / 1e9  # noqa: E731
        rows.append(f"| {n} | {nbytes / 2**20:.2f} | {gbs(t_mem):.1f} | {gbs(t_store):.1f} "
                    f"({100 * t_mem / t_store:.0f}%) | {gbs(t_load):.1f} ({100 * t_mem / t_load:.0f}%) | "
                    f"{gbs(t_cstore):.1f} | {gbs(t_cload):.1f} |")
    cache.close()
    return "\n".join(rows)


def bench_lookup(args) -> str:
    ps, n_tokens = args.page_size, 32768
    root = namespace_key(args.model, args.dtype, ps)
    tokens = torch.randint(0, 30000, (n_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    index = PrefixIndex(root, ps)
    parent = None
    for i, key in enumerate(page_keys(tokens, ps, root)):
        parent = index.insert(parent, key, i)
    pages = n_tokens // ps

    def lookup():
        path = index.lookup(tokens, need_state=False)
        index.pin(path)
        index.unpin(path)
        assert len(path) == pages - 1

    t_lookup = _time(lookup, 20)
    t_hash = _time(lambda: page_keys(tokens, ps, root), 20)
    miss = [t + 1 for t in tokens]
    t_miss = _time(lambda: index.lookup(miss, need_state=False), 200)
    return "\n".join([
        f"### lookup, {n_tokens}-token prompt ({pages} pages of {ps}), chain fully stored", "",
        "| what | total ms | us / page |", "|---|---:|---:|",
        f"| lookup + pin + unpin (hit on {pages - 1} pages) | {1e3 * t_lookup:.2f} | {1e6 * t_lookup / pages:.2f} |",
        f"| hashing alone (page_keys) | {1e3 * t_hash:.2f} | {1e6 * t_hash / pages:.2f} |",
        f"| miss at the first page | {1e3 * t_miss:.3f} | - |"])


def bench_multi_turn(args) -> str:
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, page_size=args.page_size,
                                 kv_cache_gb=1.0, max_num_batched_tokens=args.budget,
                                 hicache_size_gb=args.hicache_gb, hicache_state_slots=4 * args.convs),
                    host_cache=HostCache.for_engine)
    vocab = min(eng.model_cfg.vocab_size, 30000)
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(100, vocab, (n,), generator=g).tolist()  # noqa: E731
    on = SamplingParams(max_tokens=args.out_tokens, temperature=0, ignore_eos=True)
    off = SamplingParams(max_tokens=args.out_tokens, temperature=0, ignore_eos=True, prefix_cache=False)

    def ttft(rid, prompt, params):
        t = time.perf_counter()
        eng.add_request(rid, prompt, params)
        first, toks = None, []
        while eng.has_unfinished():
            for o in eng.step():
                toks += o.new_token_ids
                if first is None:
                    first = time.perf_counter() - t
                cached = o.cached_tokens
        return first, toks, cached

    ttft("warm", rand(64), off)
    convs = [rand(args.context) for _ in range(args.convs)]
    rows = [f"### multi-turn TTFT, {args.model} {args.dtype}: {args.convs} conversations x {args.turns} turns, "
            f"+{args.turn_tokens} tokens a turn from {args.context}; budget {args.budget} tokens/step", "",
            "| turn | context tokens | TTFT off ms | TTFT on ms | on / off | cached tokens % |",
            "|---:|---:|---:|---:|---:|---:|"]
    ratios = []
    for turn in range(args.turns):
        t_off, t_on, hit, ctx = [], [], [], []
        for i in range(args.convs):
            prompt = convs[i]
            a, _, _ = ttft(f"off-{turn}-{i}", prompt, off)
            b, out, cached = ttft(f"on-{turn}-{i}", prompt, on)
            t_off.append(a), t_on.append(b), hit.append(cached / len(prompt)), ctx.append(len(prompt))
            convs[i] = prompt + out + rand(args.turn_tokens - len(out))
        r = statistics.median(t_on) / statistics.median(t_off)
        if turn:
            ratios.append(r)
        rows.append(f"| {turn + 1} | {statistics.mean(ctx):.0f} | {1e3 * statistics.median(t_off):.0f} | "
                    f"{1e3 * statistics.median(t_on):.0f} | {r:.2f} | {100 * statistics.mean(hit):.0f}% |")
    s = eng.stats()["hicache"]
    rows += ["", f"turns 2..{args.turns}: TTFT on/off median ratio {statistics.median(ratios):.2f}; "
             f"hit rate {s['hit_rate']:.2f}, token hit rate {s['token_hit_rate']:.2f}; "
             f"pages {s['pages_used']}/{s['pages_total']}, states {s['states_used']}/{s['states_total']}, "
             f"evicted {s['evicted_pages']} pages; "
             f"d2h {s['bytes_d2h'] / 2**20:.0f} MiB in {1e3 * s['seconds_d2h']:.0f} ms, "
             f"h2d {s['bytes_h2d'] / 2**20:.0f} MiB in {1e3 * s['seconds_h2d']:.0f} ms"]
    eng.close()
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--convs", type=int, default=10)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--turn-tokens", type=int, default=200)
    ap.add_argument("--out-tokens", type=int, default=8)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--hicache-gb", type=float, default=2.0)
    ap.add_argument("--copy-threads", type=int, default=None, help="copy_pages num_threads (default: its own)")
    ap.add_argument("--skip-multi-turn", action="store_true")
    args = ap.parse_args()
    model_cfg = ModelConfig.from_hf_dir(cached_model_dir(args.model))
    print(bench_copy(args, model_cfg), "\n", flush=True)
    print(bench_lookup(args), "\n", flush=True)
    if not args.skip_multi_turn:
        print(bench_multi_turn(args), flush=True)


if __name__ == "__main__":
    main()
