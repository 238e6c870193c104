"""Measure this machine's cost curves once (`pd_tune.py measure`): the engine in-process.

  prefill(new, cached): one LLMEngine with a host cache; for cached > 0 the prefix is run
      first (stored by write-through), then prefix + `new` fresh tokens is timed: admission
      loads the hit, the step computes `new` tokens and samples the first token. The step
      budget (max_num_batched_tokens) is max(new), so every timed prompt is one step.
  decode(batch, ctx): `batch` sequences enter through reserve_kv/add_prefilled (the KV pages
      hold zeros: decode cost does not depend on their values, and no prefill is spent on
      setting them up), then single engine steps are timed.
  transfer(bytes): ShmBackend reads of n random pages of the model's page size between two
      backends of this process (the same mapped-file copy a decode rank does);
  stage(bytes): the prefill rank's copy of n device pages into a handoff pool (index copy).
Each point is the median of `reps` timings after one warm-up; thread counts via
torch.set_num_threads. The machine may be shared: the medians carry its load (noted in meta).
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import torch

from bench.pdtune.costs import CostCurves, Curve1, Grid2


def _median_s(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _log(msg: str) -> None:
    print(f"[measure] {msg}", file=sys.stderr, flush=True)


class _EngineProbe:
    def __init__(self, model: str, max_new: int, max_batch: int, max_ctx: int) -> None:
        from engine.config import EngineConfig, ModelConfig
        from engine.kv_cache import KVPool
        from engine.llm_engine import LLMEngine
        from engine.model_cache import cached_model_dir
        from engine.sampling_params import SamplingParams
        from hicache.cache import HostCache

        # float32: the wider of the dtypes `--dtype auto` picks (CPUs without AVX512-BF16 compute in it)
        page = KVPool.bytes_per_page(ModelConfig.from_hf_dir(cached_model_dir(model)), 16, torch.float32)
        need = (max_batch * -(-max_ctx // 16) + 64) * page  # the decode grid's pages, and some
        self.cfg = EngineConfig(model=model, kv_cache_gb=max(0.25, need / 2**30),
                                max_num_seqs=max_batch + 2, max_num_batched_tokens=max_new,
                                hicache_size_gb=0.5, hicache_shm_name=f"pdtune-measure-{os.getpid()}")
        self.eng = LLMEngine(self.cfg, host_cache=HostCache.for_engine)
        self.one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self.many = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
        self.rng = random.Random(0)
        self.vocab = min(self.eng.model_cfg.vocab_size, 30000)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]

    def prefill_s(self, new: int, cached: int, reps: int) -> float:
        prefix = self.tokens(cached)
        if cached:
            self.eng.generate([prefix], self.one)

        def run() -> None:
            out = self.eng.generate([prefix + self.tokens(new)], self.one)[0]
            if out.cached_tokens != cached:
                raise RuntimeError(f"expected a {cached}-token host-cache hit, got {out.cached_tokens}")
        return _median_s(run, reps)

    def decode_s(self, batch: int, ctx: int, reps: int) -> float:
        eng = self.eng
        ids = []
        for i in range(batch):
            res = eng.reserve_kv(ctx)
            if res is None:
                raise RuntimeError(f"no room for {batch} x {ctx} tokens; raise kv_cache_gb")
            rid = f"dec-{uuid.uuid4().hex[:8]}-{i}"
            eng.add_prefilled(rid, self.tokens(ctx), [self.tokens(1)[0]], self.many, res)
            ids.append(rid)
        try:
            return _median_s(eng.step, reps)
        finally:
            for rid in ids:
                eng.abort(rid)

    def close(self) -> None:
        self.eng.close()


def _transfer_curves(page_bytes: int, pages: list[int], reps: int) -> tuple[Curve1, Curve1]:
    import numpy as np

    from kv_transfer.shm_backend import ShmBackend, shm_tensor, unlink_shm

    n_pool = max(pages) * 2
    name = f"pdtune-measure-xfer-{os.getpid()}"
    owner, reader = ShmBackend(), ShmBackend()
    try:
        src = shm_tensor(name, (n_pool, page_bytes), torch.uint8)
        src.random_(0, 256)
        dst = torch.zeros(n_pool, page_bytes, dtype=torch.uint8)
        owner.register("pool", src, page_bytes)
        reader.register("pool", dst, page_bytes)
        reader.add_peer("owner", owner.metadata())
        rng = np.random.default_rng(0)
        xfer, stage = [], []
        for n in pages:
            a = rng.choice(n_pool, n, replace=False).tolist()
            b = rng.choice(n_pool, n, replace=False).tolist()

            def read() -> None:
                h = reader.read("owner", "pool", a, "pool", b)
                status = reader.wait(h)
                reader.release(h)
                if status != "done":
                    raise RuntimeError(f"shm read {status}")
            ia, ib = torch.tensor(a), torch.tensor(b)
            xfer.append(_median_s(read, reps))
            stage.append(_median_s(lambda: src.index_copy_(0, ia, dst.index_select(0, ib)), reps))
        xs = [float(n * page_bytes) for n in pages]
        return Curve1(xs, xfer), Curve1(xs, stage)
    finally:
        reader.close()
        owner.close()
        unlink_shm(name)


def _grid(xs: list[int], ys: list[int], fn: Callable[[int, int], float], label: str) -> Grid2:
    rows = []
    for x in xs:
        rows.append([fn(x, y) for y in ys])
        _log(f"{label} {x}/{ys}: " + " ".join(f"{v * 1e3:.1f}" for v in rows[-1]) + " ms")
    return Grid2([float(v) for v in xs], [float(v) for v in ys], rows)


def measure(model: str, threads: list[int], new: list[int], cached: list[int], batch: list[int],
            ctx: list[int], pages: list[int], reps: int) -> CostCurves:
    """Run every grid (see the module docstring) and return the curves."""
    from engine.kv_cache import KVPool

    if any(c % 16 for c in cached):
        raise ValueError("cached token counts must be multiples of the page size (16)")
    probe = _EngineProbe(model, max(new), max(batch), max(ctx) + 64)
    try:
        mc = probe.eng.model_cfg
        page_bytes = KVPool.bytes_per_page(mc, probe.cfg.page_size, probe.cfg.torch_dtype)
        prefill, decode = {}, {}
        for t in threads:
            torch.set_num_threads(t)
            prefill[t] = _grid(new, cached, lambda n, c: probe.prefill_s(n, c, reps), f"threads {t}: prefill new/cached")
            decode[t] = _grid(batch, ctx, lambda b, c: probe.decode_s(b, c, reps), f"threads {t}: decode batch/ctx")
    finally:
        probe.close()
    torch.set_num_threads(1)
    xfer, stage = _transfer_curves(page_bytes, pages, reps)
    _log("transfer: " + ", ".join(f"{x / 2**20:.1f} MiB {y * 1e3:.2f} ms" for x, y in zip(xfer.xs, xfer.ys)))
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = -1.0
    meta = {"transfer_backend": "shm", "reps": reps, "load_avg_1m_at_end": load,
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "page_bytes": page_bytes,
            "dtype": probe.cfg.dtype,  # the router picks the curves of the dtype its ranks compute in
            "note": "hybrid (SWA) models: the SWA state bytes are not in kv_bytes_per_token"}
    return CostCurves(model, os.cpu_count() or 1, page_bytes / probe.cfg.page_size, prefill, decode, xfer, stage, meta)
