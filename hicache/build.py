"""HostCache.for_engine's parts: the pool's layout from the engine's budget, the key namespace,
the L3 store, and a private pool and index or the host's shared ones (shared_index.py)."""
from __future__ import annotations

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVPool
from hicache.index import PrefixIndex, namespace_key
from hicache.pool import HostPool, HostPoolLayout, default_shm_name
from hicache.shared_index import attach_or_create
from hicache.store import open_store
from native.page_copy import copy_pages


def build_parts(cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int):
    """(pool, index, store or None) for an engine; hicache_size_gb covers pages and states.

    Raises ValueError when the budget cannot hold the state slots plus one page.
    """
    ps, dtype = cfg.page_size, cfg.torch_dtype
    page_bytes = KVPool.bytes_per_page(model_cfg, ps, dtype)
    state_bytes = KVPool.bytes_per_slot(model_cfg, dtype)
    num_states = cfg.hicache_state_slots if model_cfg.swa_layers else 0
    left = int(cfg.hicache_size_gb * 2**30) - num_states * state_bytes
    if page_bytes:
        num_pages = max(left, 0) // page_bytes
    else:  # no full-attention layer: pages are keys only; enough for every state's chain
        num_pages = max(num_states, 1) * -(-max_model_len // ps)
    if num_pages < 1 or left < 0:
        raise ValueError(
            f"hicache_size_gb={cfg.hicache_size_gb} cannot hold {num_states} SWA states of "
            f"{state_bytes / 2**20:.1f} MiB plus one page of {page_bytes} bytes; "
            f"raise hicache_size_gb or lower hicache_state_slots")
    kvh, hd = model_cfg.num_kv_heads, model_cfg.head_dim
    layout = HostPoolLayout(
        name=cfg.hicache_shm_name or default_shm_name(), dtype=str(dtype).removeprefix("torch."),
        num_pages=num_pages, page_shape=(len(model_cfg.full_layers), 2, ps, kvh, hd),
        num_states=num_states,
        state_shape=(len(model_cfg.swa_layers), 2, model_cfg.sliding_window or 0, kvh, hd))
    root = namespace_key(cfg.model, layout.dtype, ps)
    store = None
    if cfg.kv_store:
        # Pages outlive this process there: name them by what their bits are a function of
        # (the checkpoint's bytes, dtype, code, CPU kernels), so a changed checkpoint at the
        # same path or another build never reads them. (Hello.cache_root carries the root.)
        from engine.model_cache import cached_model_dir
        from engine.shared_weights import weights_identity
    
        root = namespace_key(f"{cfg.model}|{weights_identity(cached_model_dir(cfg.model), cfg.dtype)}",
                             layout.dtype, ps)
        store = open_store(cfg.kv_store, cfg.kv_store_size_gb)
    pin_cuda = cfg.torch_device.type == "cuda"
    if cfg.hicache_scope == "host":  # every rank of the host maps one pool and index
        if not cfg.hicache_shm_name:
            raise ValueError("hicache_scope=host needs a hicache_shm_name the host's ranks share")
        pool, index = attach_or_create(layout, root, ps, pin_cuda=pin_cuda)
    else:
        pool, index = HostPool.create(layout, pin_cuda=pin_cuda), PrefixIndex(root, ps)
    copy_pages(pool.pages, pool.pages, [], [])  # build/load the kernel now, not in a request's TTFT
    return pool, index, store
