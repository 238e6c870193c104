"""The L3 tier on Mooncake Store (hicache/mooncake_store.py) against a real mooncake_master on
loopback ports: bytes round-trip exactly; leading counts the leading run; a miss or a buffer of
another size reads False; another client (rank) reads what one wrote; with the master killed every
call fails within seconds, no hang. Skipped where mooncake.store cannot be imported or its master
cannot start (scripts/setup_mooncake.sh sets both up)."""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import time

import pytest
import torch

from hicache.mooncake_store import MooncakeStore, start_master, stop_master
from hicache.store import bytes_view

try:
    import mooncake.store  # noqa: F401
except ImportError as e:  # the package, or libibverbs under it, is missing
    pytest.skip(f"mooncake.store cannot be imported ({e}); run scripts/setup_mooncake.sh",
                allow_module_level=True)

NUMEL = 16 * 2**10  # float32: a 64 KiB page


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master(log_dir, ports=None):
    """A mooncake_master on free loopback ports (or `ports` again): (process, (rpc, http))."""
    ports = ports or (free_port(), free_port())
    try:
        return start_master(*ports, log_dir / "master.log"), ports
    except RuntimeError as e:
        pytest.skip(f"mooncake_master cannot start: {e}")


def client(ports) -> MooncakeStore:
    return MooncakeStore(f"127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}/metadata", "127.0.0.1",
                         global_segment_bytes=32 * 2**20, local_buffer_bytes=16 * 2**20)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two clients (two ranks) of one master; both closed, then the master stopped."""
    proc, ports = master(tmp_path_factory.mktemp("mooncake"))
    clients = []
    try:
        clients += [client(ports), client(ports)]
        yield clients
    finally:
        for c in clients:
            c.close()
        stop_master(proc)


def name(i: int, salt: str) -> str:  # "<32 hex>.kv", as hicache names a page
    return hashlib.blake2b(f"{salt}{i}".encode(), digest_size=16).hexdigest() + ".kv"


def page(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def test_write_then_read_into_round_trips_bytes(stores):
    a, _ = stores
    src = page(1)
    a.write(name(0, "rt"), bytes_view(src))
    a.write(name(0, "rt"), bytes_view(src))  # an existing object is not an error
    dst = torch.empty_like(src)
    assert a.read_into(name(0, "rt"), bytes_view(dst))
    assert torch.equal(src, dst)


def test_leading_counts_the_leading_run(stores):
    a, _ = stores
    for i in (0, 1, 2, 4):
        a.write(name(i, "run"), bytes_view(page(i)))
    assert a.leading([name(i, "run") for i in range(5)]) == 3
    assert a.leading([name(i, "run") for i in (3, 0)]) == 0
    assert a.leading([]) == 0


def test_a_miss_or_another_size_reads_false(stores):
    a, _ = stores
    a.write(name(0, "size"), bytes_view(page(0)))
    assert not a.read_into(name(1, "size"), bytes_view(torch.empty(NUMEL)))
    assert not a.read_into(name(0, "size"), bytes_view(torch.empty(NUMEL // 2)))
    assert not a.read_into(name(0, "size"), bytes_view(torch.empty(NUMEL * 2)))


def test_another_client_reads_what_one_wrote(stores):
    a, b = stores
    a.write(name(0, "peer"), bytes_view(page(7)))
    b.write(name(1, "peer"), bytes_view(page(8)))
    assert b.leading([name(0, "peer"), name(1, "peer")]) == 2
    dst = torch.empty(NUMEL)
    assert b.read_into(name(0, "peer"), bytes_view(dst)) and torch.equal(dst, page(7))
    assert a.read_into(name(1, "peer"), bytes_view(dst)) and torch.equal(dst, page(8))


def test_a_dead_master_fails_every_call_fast(tmp_path):
    proc, ports = master(tmp_path)
    store = None
    try:
        store = client(ports)
        store.write(name(0, "dead"), bytes_view(page(0)))
        os.killpg(proc.pid, signal.SIGKILL)  # a crash, not a shutdown
        proc.wait()
        t0 = time.monotonic()
        assert store.leading([name(0, "dead")]) == 0
        assert not store.read_into(name(0, "dead"), bytes_view(torch.empty(NUMEL)))
        with pytest.raises(OSError):
            store.write(name(1, "dead"), bytes_view(page(1)))
        assert time.monotonic() - t0 < 6.0
        t1 = time.monotonic()  # now known down: no call reaches Mooncake
        assert store.leading([name(0, "dead")]) == 0
        assert not store.read_into(name(0, "dead"), bytes_view(torch.empty(NUMEL)))
        assert time.monotonic() - t1 < 0.5
        proc, _ = master(tmp_path, ports)  # back, so that close() takes 2 s rather than 10-17 s
    finally:
        if store is not None:
            store.close()
        stop_master(proc)
