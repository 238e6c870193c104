"""engine/hugepages.py: the KV pool's and the shared weights' memory on 2 MB pages. The buffers
hold what torch.zeros / a plain mapping would, live exactly as long as their last view, a
read-only mapping faults on a write, and where the kernel gives huge pages they get them."""
from __future__ import annotations

import gc
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import hugepages
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
needs_thp = pytest.mark.skipif(not (hugepages.enabled() and _THP.exists() and "[never]" not in _THP.read_text()),
                               reason="no transparent huge pages here")


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        return tuple(int(x) for x in platform.release().split(".")[:2]) >= (major, minor)
    except ValueError:
        return False


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_zeros_is_torch_zeros_and_lives_as_long_as_its_last_view():
    shape = (16, 7, 3, 2, 16, 3, 64)  # a KV pool's shape, 3.9 MB in bf16
    t = hugepages.zeros(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert torch.equal(t, torch.zeros(shape, dtype=torch.bfloat16))
    t[1, 2] = 1.5
    assert t[1, 2].eq(1.5).all() and t.sum().item() == 1.5 * t[1, 2].numel()
    addr = t.data_ptr()
    view = t[5]
    del t
    gc.collect()
    assert _mapped(addr)
    view.fill_(2.0)  # still writable memory
    del view
    gc.collect()
    if hugepages.enabled():
        assert not _mapped(addr)  # unmapped with the last view


def test_small_or_disabled_buffers_are_the_plain_ones(monkeypatch, tmp_path):
    small = hugepages.zeros((10, 4), torch.float32)
    assert torch.equal(small, torch.zeros(10, 4)) and hugepages.huge_bytes(small) == 0
    monkeypatch.setattr(hugepages, "enabled", lambda: False)  # as off Linux or without libc's mmap
    t = hugepages.zeros((4 << 20,), torch.uint8)
    assert torch.equal(t, torch.zeros(4 << 20, dtype=torch.uint8)) and hugepages.huge_bytes(t) == 0
    f = tmp_path / "w.bin"
    f.write_bytes(bytes(4 << 20))
    fd = os.open(f, os.O_RDONLY)
    try:
        assert hugepages.map_readonly(fd, 4 << 20) is None  # the caller maps it as usual
    finally:
        os.close(fd)


@pytest.mark.skipif(not hugepages.enabled(), reason="no libc mmap here")
def test_map_readonly_reads_the_file_and_unmaps_with_its_last_view(tmp_path):
    data = torch.randint(0, 256, ((5 << 20) + 123,), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    f = tmp_path / "w.bin"
    f.write_bytes(data.numpy().tobytes())
    fd = os.open(f, os.O_RDONLY)
    try:
        m = hugepages.map_readonly(fd, data.numel())
    finally:
        os.close(fd)
    w = torch.frombuffer(m, dtype=torch.uint8)
    assert w.data_ptr() % hugepages.HUGE == 0
    assert torch.equal(w, data)
    addr = w.data_ptr()
    view = w[100:]
    del m, w
    gc.collect()
    assert _mapped(addr) and int(view[-1]) == int(data[-1])
    del view
    gc.collect()
    assert not _mapped(addr)


@pytest.mark.skipif(not hugepages.enabled(), reason="no libc mmap here")
def test_a_write_through_map_readonly_faults(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(bytes(3 << 20))
    code = ("import os, sys, torch\nfrom engine import hugepages\n"
            f"fd = os.open({str(f)!r}, os.O_RDONLY)\nw = torch.frombuffer(hugepages.map_readonly(fd, 3 << 20), dtype=torch.uint8)\n"
            "print(int(w.sum()), flush=True)\nw[5] = 1\nprint('wrote', flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.split() == ["0"]  # read it, and the write never happened
    assert f.read_bytes() == bytes(3 << 20)


@needs_thp
def test_anonymous_buffers_get_huge_pages():
    t = hugepages.zeros((16 << 20,), torch.uint8)
    assert hugepages.huge_bytes(t) >= 8 << 20  # most of it (the kernel may lack a few free huge pages)


def test_empty_like_all_lays_tensors_side_by_side_on_huge_pages():
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(960, 576, generator=g).bfloat16(), torch.randn(7, 3, generator=g),  # 1.1 MB, 84 B
          torch.randn(3072, 576, generator=g).bfloat16()[:, :300].contiguous()]  # 1.8 MB: 2.9 MB in all
    vs = hugepages.empty_like_all(ws)
    if not hugepages.enabled():
        assert vs is None
        return
    assert [(v.shape, v.dtype) for v in vs] == [(w.shape, w.dtype) for w in ws]
    assert all(v.is_contiguous() and not v.any() for v in vs)
    assert vs[0].data_ptr() % hugepages.HUGE == 0  # one buffer, each tensor on its own 4 KB
    assert [v.data_ptr() - vs[0].data_ptr() for v in vs] == [0, 1105920, 1110016]
    for v, w in zip(vs, ws):
        v.copy_(w)
    assert all(torch.equal(v, w) for v, w in zip(vs, ws))
    assert hugepages.empty_like_all([torch.ones(100)]) is None  # under 2 MB in all: nothing to gain


def test_a_ranks_private_packed_weights_are_copied_exactly(tiny_model_dir):
    """The model runner moves the packed copies (when they reach 2 MB) into one huge-page buffer,
    keeping their values and their keys."""
    from engine.layers.linear import Linear, small_linear_available
    from engine.model_runner import _packed_to_huge_pages

    if not small_linear_available():
        pytest.skip("no packed copies without the bf16 CPU kernels (an AVX2-only CPU)")
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama_tied_linear")), num_threads=1, kv_cache_gb=0.05,
                                 max_num_batched_tokens=256))
    try:
        mods = [m for m in eng.runner.model.modules() if isinstance(m, Linear) and m._packed is not None]
        assert mods
        before = [(m._packed[0], m._packed[1].clone()) for m in mods]
        for m in mods:  # make them big enough to be moved: the tiny model's are a few KB
            m._packed = (m._packed[0], torch.cat([m._packed[1]] * 64))
        big = [m._packed[1].clone() for m in mods]
        _packed_to_huge_pages(eng.runner.model)
        assert all(m._packed[0] == k for m, (k, _) in zip(mods, before))
        assert all(torch.equal(m._packed[1], b) for m, b in zip(mods, big))
        if hugepages.enabled():
            ptrs = sorted(m._packed[1].data_ptr() for m in mods)
            assert ptrs[0] % hugepages.HUGE == 0 and ptrs[-1] - ptrs[0] < sum(b.numel() * b.element_size() + 4096 for b in big)
    finally:
        eng.close()


@needs_thp
@pytest.mark.skipif(not Path("/dev/shm").is_dir() or not _kernel_at_least(6, 1)
                    or (_SHMEM.exists() and "[deny]" in _SHMEM.read_text()),
                    reason="no tmpfs, or a kernel without MADV_COLLAPSE for it")
def test_a_tmpfs_file_is_mapped_on_huge_pages():
    f = Path("/dev/shm") / f"pdserve-hugepages-test-{os.getpid()}"
    try:
        f.write_bytes(bytes(range(256)) * (32 << 12))  # 8 MB
        fd = os.open(f, os.O_RDONLY)
        try:
            w = torch.frombuffer(hugepages.map_readonly(fd, 8 << 20), dtype=torch.uint8)
        finally:
            os.close(fd)
        assert hugepages.huge_bytes(w) >= 4 << 20
        assert int(w[257]) == 1 and int(w[-1]) == 255
    finally:
        f.unlink(missing_ok=True)


@needs_thp
def test_the_engines_kv_pool_is_on_huge_pages(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama_tied_linear")), num_threads=1, kv_cache_gb=0.05,
                                 max_num_batched_tokens=256))
    try:
        full = eng.runner.pool.full
        assert full.numel() * full.element_size() >= 16 << 20
        # Not faulted in at load (engine/kv_cache.py): serving's first writes fault its pages in,
        # as huge pages.
        full.zero_()
        assert hugepages.huge_bytes(full) >= 8 << 20
    finally:
        eng.close()


def _resident_kb(addr: int) -> int:
    """Rss of the mapping holding `addr` (/proc/self/smaps), in kB."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and head[0] == "Rss:":
                return int(head[1])
    raise AssertionError(f"{addr:#x} is not mapped")


@pytest.mark.skipif(not (hugepages.enabled() and _kernel_at_least(5, 14)), reason="no MADV_POPULATE_WRITE here")
def test_populate_write_faults_in_a_shared_file_mapping_and_keeps_its_bytes(tmp_path):
    # The host cache's pool (hicache/pool.py): a fallocated /dev/shm-like file mapped shared.
    f = tmp_path / "pool.bin"
    with open(f, "wb") as fh:
        fh.truncate(8 << 20)
    raw = torch.from_file(str(f), shared=True, size=8 << 20, dtype=torch.uint8)
    assert _resident_kb(raw.data_ptr()) < 8 << 10
    assert hugepages.populate_write(raw)
    assert _resident_kb(raw.data_ptr()) >= 8 << 10
    assert not raw.any()
    raw[5] = 7
    assert f.read_bytes()[5] == 7
    assert not hugepages.populate_write(raw[1:])  # an unaligned start: the caller touches the pages
