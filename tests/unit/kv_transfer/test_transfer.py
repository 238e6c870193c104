"""KV transfer backends between two real processes: exact bytes, error cases, a dead peer.

A spawned owner process registers a strided page-major pool (pages at twice their size apart,
not at offset 0) filled from a seeded generator and sends its metadata over a Pipe; this
process reads a random subset of pages into shuffled local pages and checks every byte.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest
import torch

from kv_transfer import make_backend
from kv_transfer.base import (
    METADATA_VERSION,
    NixlMetadata,
    ShmMetadata,
    TransferBackend,
    TransferHandle,
    decode_metadata,
    encode_metadata,
)
from kv_transfer.shm_backend import ShmBackend, find_shm_file, shm_tensor, unlink_shm

ROOT = Path(__file__).resolve().parents[3]
OWNER_PAGES = 64
LOCAL_PAGES = 48
PAGE_SHAPE = (2, 3, 64)  # [k/v, kv_heads, head_dim] in int16: 768 bytes a page
PAGE_BYTES = 2 * 3 * 64 * 2
SWA_BYTES = 256  # a second owner region with another page size
SEED = 1234


def expected_pages() -> torch.Tensor:
    """[OWNER_PAGES, PAGE_BYTES] uint8: what the owner writes into its region."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (OWNER_PAGES, PAGE_BYTES), dtype=torch.uint8, generator=gen)


def _owner(kind: str, conn: Connection, shm_name: str) -> None:
    """Owner process: register pools, publish metadata, serve until told to stop (or EOF)."""
    from kv_transfer.nixl_backend import NixlBackend

    backend: TransferBackend = NixlBackend(f"owner-{os.getpid()}") if kind == "nixl" else ShmBackend()
    shape = (OWNER_PAGES, 2, *PAGE_SHAPE)
    if kind == "shm":
        base = shm_tensor(shm_name, shape, torch.int16)
    else:
        base = torch.zeros(shape, dtype=torch.int16)
    region = base[:, 1]  # [pages, *PAGE_SHAPE]: page i at base + (2i + 1) * PAGE_BYTES
    region.view(OWNER_PAGES, -1).view(torch.uint8).copy_(expected_pages())
    swa = torch.zeros(4, SWA_BYTES, dtype=torch.uint8) if kind == "nixl" else \
        shm_tensor(shm_name + "-swa", (4, SWA_BYTES), torch.uint8)
    backend.register("host", region, PAGE_BYTES)
    backend.register("swa", swa, SWA_BYTES)
    conn.send_bytes(backend.metadata())
    try:
        conn.recv_bytes()
    except EOFError:
        pass
    backend.close()


class Owner:
    def __init__(self, kind: str) -> None:
        self.shm_name = f"pdserve-test-{os.getpid()}-{kind}-{time.monotonic_ns()}"
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owner, args=(kind, child, self.shm_name), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120):
            self.stop()
            raise TimeoutError("owner process did not publish its metadata")
        self.metadata = self.conn.recv_bytes()

    def stop(self) -> None:
        try:
            self.conn.send_bytes(b"stop")
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        unlink_shm(self.shm_name)
        unlink_shm(self.shm_name + "-swa")


def make_reader(kind: str) -> TransferBackend:
    """Reads of up to 4 pages run inline (when the read thread is idle), bigger ones on it."""
    if kind == "shm":
        return ShmBackend(sync_bytes=4 * PAGE_BYTES)
    from kv_transfer.nixl_backend import NixlBackend

    try:
        # as a decode rank: it only reads, so no progress thread (the owner keeps its own)
        return NixlBackend(f"reader-{os.getpid()}-{time.monotonic_ns()}", progress_thread=False,
                           sync_bytes=4 * PAGE_BYTES)
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"NIXL cannot start here: {e}")


def wait(backend: TransferBackend, handle: TransferHandle, timeout: float = 20.0) -> str:
    """Poll as a rank loop does, until the read is over."""
    deadline = time.monotonic() + timeout
    while (status := backend.poll(handle)) == "pending":
        assert time.monotonic() < deadline, "read did not finish"
        time.sleep(0.001)
    return status


@pytest.fixture(scope="module", params=["nixl", "shm"])
def pair(request) -> Iterator[tuple[TransferBackend, torch.Tensor, bytes]]:
    """(reader backend with peer "prefill0" added, its local region "kv", the owner's metadata)."""
    reader = make_reader(request.param)
    local = torch.full((LOCAL_PAGES, *PAGE_SHAPE), -1, dtype=torch.int16)
    reader.register("kv", local, PAGE_BYTES)
    owner = Owner(request.param)
    try:
        reader.add_peer("prefill0", owner.metadata)
        yield reader, local, owner.metadata
    finally:
        reader.close()
        owner.stop()


def test_read_random_pages_exact(pair) -> None:
    reader, local, _ = pair
    rng = np.random.default_rng(0)
    before = local.view(LOCAL_PAGES, -1).view(torch.uint8).clone()
    # a scattered subset plus a run adjacent on both sides (NIXL merges those)
    src = np.concatenate([rng.choice(np.arange(20, OWNER_PAGES), 23, replace=False), np.arange(5, 13)])
    dst = np.concatenate([rng.permutation(np.arange(10, LOCAL_PAGES))[:23], np.arange(0, 8)])
    handle = reader.read("prefill0", "host", src.tolist(), "kv", dst.tolist())
    assert (handle.num_pages, handle.nbytes) == (31, 31 * PAGE_BYTES)
    assert wait(reader, handle) == "done"
    reader.release(handle)
    reader.release(handle)  # idempotent
    got = local.view(LOCAL_PAGES, -1).view(torch.uint8)
    want = before.clone()
    want[torch.from_numpy(dst)] = expected_pages()[torch.from_numpy(src)]
    assert torch.equal(got, want)  # read pages exact, every other local page untouched
    with pytest.raises(KeyError):
        reader.poll(handle)


def test_many_reads_in_flight(pair) -> None:
    reader, local, _ = pair
    # a big read on the read thread, then small ones: inline, or queued behind it while it runs
    big = reader.read("prefill0", "host", list(range(32)), "kv", list(range(16, 48)))
    handles = [reader.read("prefill0", "host", [OWNER_PAGES - 1 - i], "kv", [i]) for i in range(16)]
    empty = reader.read("prefill0", "host", [], "kv", [])
    assert [reader.wait(h, timeout=20) for h in [big, *handles, empty]] == ["done"] * 18
    for h in [big, *handles, empty]:
        reader.release(h)
    got = local.view(LOCAL_PAGES, -1).view(torch.uint8)
    assert torch.equal(got[:16], expected_pages().flip(0)[:16])
    assert torch.equal(got[16:], expected_pages()[:32])


def test_bad_reads_raise(pair) -> None:
    reader, _, _ = pair
    with pytest.raises(ValueError, match="page size mismatch"):
        reader.read("prefill0", "swa", [0], "kv", [0])
    with pytest.raises(ValueError, match="out of range"):
        reader.read("prefill0", "host", [OWNER_PAGES], "kv", [0])
    with pytest.raises(ValueError, match="out of range"):
        reader.read("prefill0", "host", [0], "kv", [-1])
    with pytest.raises(ValueError, match="repeats"):
        reader.read("prefill0", "host", [0, 1], "kv", [3, 3])
    with pytest.raises(ValueError, match="local pages"):
        reader.read("prefill0", "host", [0, 1], "kv", [3])
    with pytest.raises(KeyError, match="unknown peer"):
        reader.read("nobody", "host", [0], "kv", [0])
    with pytest.raises(KeyError, match="no region"):
        reader.read("prefill0", "nope", [0], "kv", [0])
    with pytest.raises(KeyError, match="no local region"):
        reader.read("prefill0", "host", [0], "nope", [0])


def test_page_ids_as_arrays_tensors_and_lists_the_caller_may_reuse(pair) -> None:
    reader, local, _ = pair
    src, dst = [40, 41, 42, 43, 44, 45], [30, 31, 32, 33, 34, 35]  # 6 pages: on the read thread
    h = reader.read("prefill0", "host", src, "kv", dst)
    src[:], dst[:] = [0] * 6, [0] * 6  # the read keeps its own copy of the ids
    small = reader.read("prefill0", "host", np.array([50], dtype=np.int32), "kv", torch.tensor([36]))
    assert [wait(reader, x) for x in (h, small)] == ["done", "done"]
    for x in (h, small):
        reader.release(x)
    got = local.view(LOCAL_PAGES, -1).view(torch.uint8)
    assert torch.equal(got[30:37], expected_pages()[[40, 41, 42, 43, 44, 45, 50]])
    for bad in ([1.0], [True], ["1"], np.array([1.5]), torch.tensor([[1]])):
        with pytest.raises(ValueError, match="flat list of integers"):
            reader.read("prefill0", "host", bad, "kv", [0])


def test_bad_peers_and_regions_raise(pair) -> None:
    reader, local, _ = pair
    with pytest.raises(ValueError, match="already added"):
        reader.add_peer("prefill0", reader.metadata())
    with pytest.raises(ValueError, match="not valid"):
        reader.add_peer("junk", b"\x00garbage")
    if reader.kind == "nixl":
        fake: NixlMetadata | ShmMetadata = ShmMetadata(METADATA_VERSION, "boot", 1, [])
    else:
        fake = NixlMetadata(METADATA_VERSION, "agent", b"", [])
    with pytest.raises(ValueError, match="same --transfer"):
        reader.add_peer("other-kind", encode_metadata(fake))
    with pytest.raises(ValueError, match="already registered"):
        reader.register("kv", local, PAGE_BYTES)
    with pytest.raises(ValueError, match="page_bytes"):
        reader.register("kv2", local, PAGE_BYTES // 2)
    with pytest.raises(ValueError, match="contiguous"):
        reader.register("kv2", local.transpose(1, 2), PAGE_BYTES)
    reader.remove_peer("never-added")  # no-op


def test_remove_peer_then_add_again(pair) -> None:
    reader, _, metadata = pair
    handle = reader.read("prefill0", "host", list(range(20)), "kv", list(range(20)))
    reader.remove_peer("prefill0")
    assert wait(reader, handle) in ("done", "failed")  # failed unless it finished before
    reader.release(handle)
    with pytest.raises(KeyError, match="unknown peer"):
        reader.read("prefill0", "host", [0], "kv", [0])
    reader.add_peer("prefill0", metadata)
    handle = reader.read("prefill0", "host", [7], "kv", [40])
    assert wait(reader, handle) == "done"
    reader.release(handle)


def test_metadata_version_is_checked() -> None:
    data = encode_metadata(ShmMetadata(METADATA_VERSION + 1, "boot", 1, []))
    with pytest.raises(ValueError, match="version"):
        decode_metadata(data, ShmMetadata)


def test_shm_tensor_is_found_in_proc_maps() -> None:
    name = f"pdserve-test-{os.getpid()}-maps"
    try:
        t = shm_tensor(name, (8, 1024), torch.uint8)
        assert find_shm_file(t[3].data_ptr(), 1024) == (f"/dev/shm/{name}", 3 * 1024)
        assert find_shm_file(torch.zeros(8, 1024).data_ptr(), 1024) is None
        with pytest.raises(FileExistsError):
            shm_tensor(name, (8, 1024), torch.uint8)
        assert torch.equal(shm_tensor(name, (8, 1024), torch.uint8, create=False), t)
    finally:
        unlink_shm(name)


def test_shm_peer_cannot_read_private_region() -> None:
    owner, reader = ShmBackend(), ShmBackend()
    try:
        owner.register("host", torch.zeros(4, 64, dtype=torch.uint8), 64)
        reader.register("kv", torch.zeros(4, 64, dtype=torch.uint8), 64)
        reader.add_peer("p", owner.metadata())
        with pytest.raises(ValueError, match="not in shared memory"):
            reader.read("p", "host", [0], "kv", [0])
    finally:
        owner.close()
        reader.close()


def test_nixl_read_from_dead_peer_fails() -> None:
    reader = make_reader("nixl")
    owner = Owner("nixl")
    try:
        reader.register("kv", torch.zeros(LOCAL_PAGES, *PAGE_SHAPE, dtype=torch.int16), PAGE_BYTES)
        reader.add_peer("prefill0", owner.metadata)
        assert wait(reader, reader.read("prefill0", "host", [1, 2], "kv", [0, 1])) == "done"
        owner.proc.kill()
        owner.proc.join()
        handle = reader.read("prefill0", "host", [3], "kv", [2])
        assert wait(reader, handle) == "failed"
        reader.release(handle)
        reader.remove_peer("prefill0")
        with pytest.raises(KeyError, match="unknown peer"):
            reader.read("prefill0", "host", [3], "kv", [2])
    finally:
        reader.close()
        owner.stop()


def test_make_backend_choices() -> None:
    with pytest.raises(ValueError, match="unknown transfer backend"):
        make_backend("rdma", "x")  # type: ignore[arg-type]
    shm = make_backend("shm", "x")
    assert isinstance(shm, ShmBackend)
    shm.close()
    auto = make_backend("auto", f"auto-{os.getpid()}", serves_peers=False)
    try:
        assert auto.kind in ("nixl", "shm")
    finally:
        auto.close()


def test_a_process_that_made_a_nixl_agent_exits_cleanly() -> None:
    """A process that made (and closed) a NIXL agent exits 0. Where Debian's rdma-core is
    installed, UCX's IB modules used to load a second libnl-route whose destructor segfaulted at
    exit: every rank, and this test suite's own interpreter after its summary, exited 139
    (nixl_backend._skip_ucx_ib_without_rdma). Checked in a child process, so a crash at exit
    fails here, by name."""
    import subprocess
    import sys

    pytest.importorskip("nixl_cu12", reason="NIXL is not installed")
    code = ("from kv_transfer.nixl_backend import NixlBackend\n"
            "b = NixlBackend('exit-check', progress_thread=False)\nb.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr.decode(errors="replace")[-2000:])
