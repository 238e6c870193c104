"""HostPool: shared-memory layout, mapping from another process, unlink, free-list accounting."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hicache.pool import HostPool, HostPoolLayout, default_shm_name


def layout(**kw) -> HostPoolLayout:
    base = dict(name=default_shm_name(), dtype="bfloat16", num_pages=5, page_shape=(2, 2, 4, 2, 8),
                num_states=3, state_shape=(3, 2, 8, 2, 8))
    base.update(kw)
    return HostPoolLayout(**base)


def test_layout_matches_one_engine_page_and_is_contiguous_per_page():
    lay = layout()
    pool = HostPool.create(lay)
    try:
        assert pool.pages.shape == (5, 2, 2, 4, 2, 8) and pool.pages.dtype == torch.bfloat16
        assert pool.states.shape == (3, 3, 2, 8, 2, 8)
        assert lay.page_bytes == 2 * 2 * 4 * 2 * 8 * 2 and pool.pages[1].is_contiguous()
        assert pool.pages.stride(0) * 2 == lay.page_bytes
        assert lay.states_offset % 4096 == 0 and lay.states_offset >= 5 * lay.page_bytes
        assert lay.path.stat().st_size == lay.total_bytes
        # pages and states do not overlap
        pool.pages.fill_(1)
        assert pool.states.abs().sum() == 0
    finally:
        pool.close()


def test_another_process_maps_the_pool_by_name_and_close_unlinks():
    lay = layout(dtype="float32")
    pool = HostPool.create(lay)
    pool.pages[3].copy_(torch.arange(pool.pages[3].numel(), dtype=torch.float32).view_as(pool.pages[3]))
    pool.states[2].fill_(7.0)
    code = (
        "import sys, torch; from hicache.pool import HostPool, HostPoolLayout;"
        f"lay = HostPoolLayout(**{lay.__dict__!r});"
        "p = HostPool.attach(lay);"
        "print(int(p.pages[3].sum()), int(p.states[2].sum())); p.pages[0].fill_(5.0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    n = pool.pages[3].numel()
    assert out.stdout.split() == [str(n * (n - 1) // 2), str(7 * pool.states[2].numel())]
    assert bool((pool.pages[0] == 5.0).all())  # the other process's writes are visible here
    with pytest.raises(FileExistsError):
        HostPool.create(lay)
    pool.close()
    assert not lay.path.exists()
    pool.close()  # idempotent
    assert pool.pages[3].sum() > 0  # the mapping outlives the name
    with pytest.raises(FileNotFoundError):
        HostPool.attach(lay)


def test_unlinked_when_collected():
    lay = layout()
    pool = HostPool.create(lay)
    assert lay.path.exists()
    del pool
    assert not lay.path.exists()


def test_free_lists_account_back_to_full():
    pool = HostPool.create(layout())
    try:
        pages = [pool.alloc_page() for _ in range(5)]
        assert sorted(pages) == [0, 1, 2, 3, 4] and pool.alloc_page() is None and pool.free_pages == 0
        states = [pool.alloc_state() for _ in range(3)]
        assert pool.alloc_state() is None
        for p in pages:
            pool.free_page(p)
        for s in states:
            pool.free_state(s)
        assert pool.free_pages == 5 and pool.free_states == 3
    finally:
        pool.close()


def test_bad_names_rejected():
    with pytest.raises(ValueError):
        layout(name="a/b")
    with pytest.raises(ValueError):
        layout(name="")
