"""copy_pages against the plain-torch reference, plus the layouts and ids it must reject.

The first test in a fresh cache builds the kernel (~15 s on 2 cores); later runs load it.
"""
from __future__ import annotations

import pytest
import torch

from native.loader import check_compiler
from native.page_copy import copy_pages, torch_copy_pages

KiB = 1024
MiB = 1024 * KiB
ROW = 64  # elements per row of a page: pools are [num_pages, rows, ROW]


def make_pool(num_pages: int, page_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A pool of random bytes viewed as `dtype`: [num_pages, rows, ROW], or [num_pages, numel] if ROW does not divide a page."""
    raw = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8)
    pool = raw.view(dtype)
    return pool.view(num_pages, -1, ROW) if pool.shape[1] % ROW == 0 else pool


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bytes, not values: random bits include NaNs, which never compare equal.
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.cpu().contiguous().view(torch.uint8).reshape(-1)

    return torch.equal(raw(a), raw(b))


def index_pair(kind: str, n: int, src_pages: int, dst_pages: int, gen: torch.Generator):
    if kind == "permutation":
        return (torch.randperm(src_pages, generator=gen)[:n], torch.randperm(dst_pages, generator=gen)[:n])
    if kind == "runs":  # a few runs of consecutive ids on both sides, plus a stray page
        s0, d0 = (src_pages - n) // 2, dst_pages - n
        src = list(range(s0, s0 + n - 1)) + [0]
        dst = list(range(d0, d0 + n - 1)) + [0]
        return torch.tensor(src), torch.tensor(dst)
    assert kind == "reversed"
    return torch.arange(n - 1, -1, -1), torch.arange(n)


def check_against_reference(src, dst, src_idx, dst_idx, **kw) -> None:
    expected = dst.clone()
    torch_copy_pages(src.clone(), expected, src_idx, dst_idx)
    copy_pages(src, dst, src_idx, dst_idx, **kw)
    assert same_bytes(dst, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize(
    "page_bytes,src_pages,dst_pages,n",
    [(1 * KiB, 400, 350, 300), (64 * KiB, 48, 64, 40), (1 * MiB, 1, 2, 1), (2 * MiB, 5, 6, 3)],
)
@pytest.mark.parametrize("kind", ["permutation", "runs", "reversed"])
def test_matches_reference(dtype, page_bytes, src_pages, dst_pages, n, kind):
    gen = torch.Generator().manual_seed(page_bytes + n)
    src = make_pool(src_pages, page_bytes, dtype)
    dst = make_pool(dst_pages, page_bytes, dtype)
    src_idx, dst_idx = index_pair(kind, n, src_pages, dst_pages, gen)
    check_against_reference(src, dst, src_idx, dst_idx, num_threads=4)


@pytest.fixture
def set_torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [1, 2, 3, 16])
def test_thread_counts_split_pages(num_threads, set_torch_threads):
    # 7 pages of 600 KiB in one run: thread shares cut through pages. The kernel
    # uses at most torch's intra-op thread count, so raise it for the test.
    set_torch_threads(num_threads)
    src = make_pool(9, 600 * KiB, torch.float32)
    dst = make_pool(9, 600 * KiB, torch.float32)
    check_against_reference(src, dst, list(range(1, 8)), list(range(2, 9)), num_threads=num_threads)


def test_same_pool_disjoint_pages():
    pool = make_pool(64, 4 * KiB, torch.bfloat16)
    expected = pool.clone()
    torch_copy_pages(pool.clone(), expected, range(0, 20), range(40, 60))
    copy_pages(pool, pool, list(range(0, 20)), list(range(40, 60)))
    assert same_bytes(pool, expected)


def test_page_slices_and_strided_pages():
    big = make_pool(40, 8 * KiB, torch.float32)
    other = make_pool(40, 8 * KiB, torch.float32)
    # pool[2:10] is dense; pool[::3] has pages 3 pages apart (no run merging).
    for src, dst in [(big[2:10], other[20:30]), (big[::3], other[1::3]), (big[::3], other[:14])]:
        idx = list(range(min(len(src), len(dst))))
        check_against_reference(src, dst, idx, idx[::-1], num_threads=2)
    # The views wrote through to the pools they slice.
    expected = big[2:10].clone()
    assert not same_bytes(other[20:28], expected)
    copy_pages(big[2:10], other[20:30], range(8), range(8))
    assert same_bytes(other[20:28], expected)


def test_layer_views_copy_one_layer_of_each_page():
    # [pages, layers, rows, ROW][:, layer] is a pool of contiguous per-layer pages.
    src = make_pool(12, 16 * KiB, torch.bfloat16).view(12, 4, -1, ROW)
    dst = make_pool(10, 16 * KiB, torch.bfloat16).view(10, 4, -1, ROW)
    untouched = dst[:, [0, 2, 3]].clone()
    check_against_reference(src[:, 1], dst[:, 1], [0, 1, 2, 11], [9, 3, 4, 5])
    assert same_bytes(dst[:, [0, 2, 3]], untouched)


def test_shape_may_differ_when_bytes_match():
    src = make_pool(8, 4 * KiB, torch.int32)
    dst = torch.zeros(8, 2, 512, dtype=torch.float32)  # same 4 KiB pages, other shape
    copy_pages(src, dst, [1, 2], [5, 0])
    assert same_bytes(dst[5], src[1]) and same_bytes(dst[0], src[2])


def test_index_forms_and_empty_copy():
    src = make_pool(8, 1 * KiB, torch.uint8)
    dst = make_pool(8, 1 * KiB, torch.uint8)
    check_against_reference(src, dst, torch.tensor([3, 4], dtype=torch.int32), (0, 7))
    before = dst.clone()
    copy_pages(src, dst, [], [])
    assert same_bytes(dst, before)


def test_copies_through_shared_memory_pool(tmp_path):
    # The host pool as the engine maps it: a file-backed shared mapping.
    path = tmp_path / "pool.bin"
    page_bytes, pages = 16 * KiB, 32
    path.write_bytes(bytes(page_bytes * pages))
    host = torch.from_file(str(path), shared=True, size=page_bytes * pages, dtype=torch.uint8)
    host = host.view(torch.bfloat16).view(pages, -1, ROW)
    device_like = make_pool(pages, page_bytes, torch.bfloat16)
    copy_pages(device_like, host, list(range(pages)), list(range(pages)))
    reread = torch.from_file(str(path), shared=False, size=page_bytes * pages, dtype=torch.uint8)
    assert same_bytes(reread, device_like)


def pools(page_bytes=1 * KiB, dtype=torch.float32, pages=8):
    return make_pool(pages, page_bytes, dtype), make_pool(pages, page_bytes, dtype)


@pytest.mark.parametrize(
    "make_args,message",
    [
        (lambda: (*pools(), [8], [0]), "out of range"),
        (lambda: (*pools(), [0], [-1]), "out of range"),
        (lambda: (*pools(), [0, 1], [2]), "differ in length"),
        (lambda: (*pools(), [0, 1], [3, 3]), "repeats page 3"),
        (lambda: (*pools(), torch.tensor([0.0]), [1]), "must be int64"),
        (lambda: (*pools(), torch.zeros(1, 1, dtype=torch.int64), [1]), "must be 1-D"),
        (lambda: (pools()[0], make_pool(8, 2 * KiB, torch.float32), [0], [0]), "pages differ in size"),
        (lambda: (pools()[0], make_pool(8, 1 * KiB, torch.bfloat16).view(8, -1, 2 * ROW), [0], [0]),
         "element sizes differ"),
        # [pages, 2, layers, ...][:, :, layer]: each page's K and V halves are apart.
        (lambda: (*(p.view(8, 2, 2, ROW)[:, :, 1] for p in pools()), [0], [0]), "not contiguous"),
        (lambda: (pools()[0].transpose(1, 2), pools()[1].transpose(1, 2), [0], [0]), "not contiguous"),
        (lambda: (torch.zeros(()), torch.zeros(()), [0], [0]), "page dim"),
        (lambda: (torch.zeros(4, 8).expand(4, 4, 8), torch.zeros(4, 4, 8), [0], [0]), "pages overlap"),
    ],
)
def test_rejects_bad_arguments(make_args, message):
    src, dst, src_idx, dst_idx = make_args()
    with pytest.raises(RuntimeError, match=message):
        copy_pages(src, dst, src_idx, dst_idx)


def test_rejects_overlapping_src_and_dst_pages():
    pool = make_pool(16, 1 * KiB, torch.float32)
    with pytest.raises(RuntimeError, match="dst page 5 overlaps a src page"):
        copy_pages(pool, pool, [4, 5], [5, 6])
    # Two views of one storage whose pages straddle each other.
    flat = torch.zeros(16 * 256)
    a, b = flat[:10 * 256].view(10, 256), flat[128:128 + 10 * 256].view(10, 256)
    with pytest.raises(RuntimeError, match="overlaps a src page"):
        copy_pages(a, b, [3], [2])


def test_rejects_bad_thread_count_and_device():
    src, dst = pools()
    with pytest.raises(RuntimeError, match="num_threads must be >= 1"):
        copy_pages(src, dst, [0], [0], num_threads=0)
    with pytest.raises(RuntimeError, match="Meta"):  # no kernel for this device
        copy_pages(src.to("meta"), dst, [0], [0])


def test_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with pytest.raises(RuntimeError, match="no-such-c\\+\\+-compiler"):
        check_compiler("native.page_copy")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
# 1027-byte pages are not 16-byte aligned: they take the kernel's byte loop.
@pytest.mark.parametrize("page_bytes,n", [(1027, 300), (64 * KiB, 40), (2 * MiB, 3)])
def test_cuda_matches_reference(direction, page_bytes, n):
    def pool(on_device: bool, pages: int) -> torch.Tensor:
        p = make_pool(pages, page_bytes, torch.uint8)
        return p.cuda() if on_device else p.pin_memory()

    src = pool(direction != "h2d", n + 7)
    dst = pool(direction != "d2h", n + 5)
    src_idx = torch.randperm(n + 7)[:n]
    dst_idx = torch.randperm(n + 5)[:n]
    expected = dst.cpu().clone()
    torch_copy_pages(src.cpu(), expected, src_idx, dst_idx)
    copy_pages(src, dst, src_idx, dst_idx)
    torch.cuda.synchronize()
    assert same_bytes(dst, expected)


@cuda
def test_cuda_rejects_unpinned_host_pool():
    with pytest.raises(RuntimeError, match="pin_memory"):
        copy_pages(make_pool(4, 1 * KiB, torch.uint8).cuda(), make_pool(4, 1 * KiB, torch.uint8), [0], [1])
