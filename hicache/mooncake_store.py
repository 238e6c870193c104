"""The L3 KV tier on Mooncake Store (the distributed KV store SGLang HiCache and vLLM use): the
same objects as FileStore (hicache/store.py: "<32 hex>.kv" pages, "<32 hex>.swa" states, written
once, never changed), shared by every rank of every host that reaches one `mooncake_master`.

How: each MooncakeStore is a Mooncake client. It contributes `global_segment_bytes` of its own
memory to the store (the master places each object in some client's segment, and evicts objects
once the store is 90% full), and moves bytes with Mooncake's transfer engine (TCP here):
  - leading: one batch_is_exist RPC to the master for all names;
  - read_into: get_into straight into the caller's view (zero-copy; over TCP any memory will do,
    other protocols need the region registered first with `register`, else get() and a copy);
  - write: put_from straight from the caller's view (put() and a copy for a read-only view).
An object lives in the segment of the client that the master chose: when that client closes or
dies, its objects go with it: on a death, leading() still counts them until the master's
client_ttl (10 s) lapses, and read_into() of one returns False (measured: 1 ms to 1 s).

Failure behaviour (measured with 0.3.13.post1, master on loopback):
  - Every call first asks the client's health_check (no RPC; it turns "master unreachable" within
    about 1 s of the master's death, from the client's own 1 s ping), and after a master RPC error
    the store counts as down for `retry_s`: while down, leading() says 0, read_into() False and
    write() raises OSError at once, with no call into Mooncake.
  - Why: with the master gone, every master RPC blocks about 4.3 s (the RPC pool's 3 reconnects
    1 s apart; MC_RPC_CONNECT_TIMEOUT_MS does not shorten it), so only a call made in the second
    before the ping notices can pay that, once. A stalled master (SIGSTOP) costs `rpc_timeout_s`
    a call (MC_RPC_TIMEOUT_MS, -901 RPC_TIMEOUT). When the master comes back, the client remounts
    its segment within about 1 s and calls resume (the store starts empty).
  - A master that does not accept connections fails the constructor at once (ConnectionError):
    Mooncake's setup() would retry it 20 times, about 90 s, holding the GIL.
  - close() (Mooncake's teardown, which holds the GIL) takes about 2 s with the master up and
    10-17 s with it gone; the same teardown runs at garbage collection or interpreter exit if
    close() is skipped, so there is no cheaper way out.

Addresses: the client advertises `local_hostname` (MC_TCP_BIND_ADDRESS) so peers and the master
reach it there; note Mooncake still *listens* on every interface for its transfer-engine sockets
(INADDR_ANY in transfer_metadata_plugin.cpp and tcp_transport), and the master's built-in HTTP
metadata server ignores --http_metadata_server_host (binds 0.0.0.0, http_metadata_server.cpp).
Use a firewall, or the separate `mooncake_http_metadata_server --host`, where that matters.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from hicache.store import KVStore

log = logging.getLogger(__name__)

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that this module tells apart.
OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS, RPC_FAIL, RPC_TIMEOUT = -704, -705, -900, -901
_CODES = {-1: "INTERNAL_ERROR", -200: "NO_AVAILABLE_HANDLE (store full)", -600: "INVALID_PARAMS",
          OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
          -800: "TRANSFER_FAIL", RPC_FAIL: "RPC_FAIL", RPC_TIMEOUT: "RPC_TIMEOUT"}
_SETUP_HINT = "scripts/setup_mooncake.sh installs it"


def _code(rc: int) -> str:
    return f"{rc} {_CODES.get(rc, '')}".strip()


def _address(view: memoryview) -> int:
    """The address of a writable, contiguous view's first byte (raises TypeError/ValueError)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class MooncakeStore(KVStore):
    """A Mooncake Store client as the L3 tier. Raises ImportError when the `mooncake` package
    cannot be imported, ConnectionError when the master or metadata server does not answer."""

    kind = "mooncake"

    def __init__(self, master: str, metadata_server: str, local_hostname: str = "127.0.0.1",
                 global_segment_bytes: int = 2**30, local_buffer_bytes: int = 16 * 2**20,
                 protocol: str = "tcp", rdma_devices: str = "", rpc_timeout_s: float = 1.0,
                 retry_s: float = 5.0) -> None:
        """`master` "HOST:RPC_PORT"; `metadata_server` "http://HOST:PORT/metadata" (or
        "P2PHANDSHAKE"); `global_segment_bytes` of this process's memory join the store;
        `local_buffer_bytes` stage the copying paths (get/put)."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(f"mooncake.store cannot be imported ({e}); {_SETUP_HINT}") from e
        # NOTE: Mooncake reads these when a client is set up, from the process environment: they
        # are process-wide, and the last MooncakeStore built sets them for the next one.
        os.environ["MC_RPC_TIMEOUT_MS"] = str(int(rpc_timeout_s * 1000))
        os.environ["MC_RPC_CONNECT_TIMEOUT_MS"] = str(int(rpc_timeout_s * 1000))
        os.environ["MC_TCP_BIND_ADDRESS"] = local_hostname  # advertised, not bound: see module doc
        self.master = master
        self.protocol = protocol
        self.retry_s = retry_s
        self._down_until = 0.0
        self._regions: list[tuple[int, int, memoryview]] = []  # (address, bytes, view kept alive)
        # setup() itself retries an absent master 20 times (~90 s, GIL held): look first.
        where = urlsplit(metadata_server)
        for host, port in [master.rsplit(":", 1)] + ([(where.hostname, where.port or 80)]
                                                      if where.scheme == "http" else []):
            if not _port_open(host, int(port), rpc_timeout_s):
                raise ConnectionError(f"mooncake store: nothing accepts connections at {host}:{port} "
                                      f"(master {master}, metadata {metadata_server})")
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata_server, global_segment_bytes,
                               local_buffer_bytes, protocol, rdma_devices, master)
        if rc != 0:
            raise ConnectionError(f"mooncake store setup failed ({rc}): master {master}, "
                                  f"metadata {metadata_server}")

    def _up(self) -> bool:
        if time.monotonic() < self._down_until:
            return False
        return self._store is not None and self._store.health_check() == 0

    def _failed(self, rc: int) -> None:
        if rc in (RPC_FAIL, RPC_TIMEOUT):  # the master: spare the next calls its 1-4 s
            self._down_until = time.monotonic() + self.retry_s

    def _zero_copy(self, addr: int, n: int) -> bool:
        if self.protocol == "tcp":  # the TCP transport reads and writes any local memory
            return True
        return any(a <= addr and addr + n <= a + size for a, size, _ in self._regions)

    def register(self, view: memoryview) -> None:
        """Register a long-lived region (the host pool) for zero-copy transfers on protocols
        that need it (RDMA); kept until close(). Raises OSError when Mooncake refuses."""
        view = memoryview(view).cast("B")
        addr = _address(view)
        rc = self._store.register_buffer(addr, view.nbytes)
        if rc != 0:
            raise OSError(f"mooncake register_buffer of {view.nbytes} bytes failed: {_code(rc)}")
        self._regions.append((addr, view.nbytes, view))

    def leading(self, names: Sequence[str]) -> int:
        if not names or not self._up():
            return 0
        try:
            found = self._store.batch_is_exist(list(names))
        except Exception:  # noqa: BLE001 - a store that cannot answer says 0
            log.exception("mooncake batch_is_exist failed")
            return 0
        for i, rc in enumerate(found):
            if rc != 1:
                self._failed(rc)
                return i
        return len(found)

    def read_into(self, name: str, out: memoryview) -> bool:
        if not self._up():
            return False
        try:
            view = memoryview(out).cast("B")
            n = view.nbytes
            addr = _address(view)
            if self._zero_copy(addr, n):
                rc = self._store.get_into(name, addr, n)  # bytes read, or an error code < 0
                if rc < 0:
                    self._failed(rc)
                return rc == n  # an object smaller than `out` reads as its own size
            data = self._store.get(name)  # b"" when missing or on error
            if len(data) != n:
                return False
            view[:] = data
            return True
        except Exception:  # noqa: BLE001 - unreadable is a miss
            log.exception("mooncake read of %s failed", name)
            return False

    def write(self, name: str, data: memoryview) -> None:
        if not self._up():
            raise OSError(f"mooncake store at {self.master} is unreachable")
        view = memoryview(data).cast("B")
        try:
            addr = None if view.readonly else _address(view)
        except (TypeError, ValueError):
            addr = None
        if addr is not None and self._zero_copy(addr, view.nbytes):
            rc = self._store.put_from(name, addr, view.nbytes)
        else:
            rc = self._store.put(name, view)
        if rc in (0, OBJECT_ALREADY_EXISTS):  # objects never change: the one there is this one
            return
        self._failed(rc)
        raise OSError(f"mooncake put of {name} ({view.nbytes} bytes) failed: {_code(rc)}")

    def close(self) -> None:
        """Unregister regions and leave the store (this client's objects go with it). Blocks:
        about 2 s, 10-17 s with the master gone (see the module doc)."""
        store, self._store = self._store, None
        if store is None:
            return
        for addr, _, _ in self._regions:
            store.unregister_buffer(addr)
        self._regions.clear()
        store.close()


def _port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            return True
    except OSError:
        return False


def start_master(rpc_port: int, http_port: int, log_path: str | Path,
                 timeout_s: float = 15.0, own_group: bool = True, host: str = "127.0.0.1") -> subprocess.Popen:
    """Start the venv's `mooncake_master`: its RPC on `host`:`rpc_port` (loopback unless the
    ranks are on other hosts), its HTTP metadata server on `http_port` (URL
    http://HOST:PORT/metadata; see the module doc for its bind), its metrics on an ephemeral
    loopback port; output appended to `log_path`. The
    process leads its own process group (stop_master ends it), or, `own_group` False, stays in
    the caller's (the launcher's: a stop of the system's group ends it too). Returns once both ports accept
    connections. Raises RuntimeError naming what is missing (the binary, libibverbs/librdmacm)
    or a port that is taken, or with the log's tail when it exits or is not up in `timeout_s`."""
    exe = Path(sys.executable).parent / "mooncake_master"
    if not exe.is_file():
        raise RuntimeError(f"{exe} is missing (PyPI mooncake-transfer-engine-non-cuda); {_SETUP_HINT}")
    for lib in ("libibverbs.so.1", "librdmacm.so.1"):
        try:
            ctypes.CDLL(lib)
        except OSError as e:
            raise RuntimeError(f"mooncake_master needs {lib} even for TCP ({e}): Debian's libibverbs1 "
                               f"and librdmacm1; {_SETUP_HINT}") from e
    for port in (rpc_port, http_port):
        if _port_open(host, port):
            raise RuntimeError(f"port {host}:{port} is taken: another mooncake_master, or anything")
    cmd = [str(exe), f"--rpc_address={host}", f"--rpc_port={rpc_port}",
           "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
           f"--http_metadata_server_port={http_port}", "--metrics_host=127.0.0.1",
           "--metrics_port=0", "--enable_metric_reporting=false", "--logtostderr=true"]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=own_group)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited ({proc.returncode}): {_tail(log_path)}")
        if _port_open(host, rpc_port) and _port_open(host, http_port):
            if proc.poll() is None:
                return proc
            continue  # it exited: the check above says how
        if time.monotonic() > deadline:
            stop_master(proc)
            raise RuntimeError(f"mooncake_master not up in {timeout_s:.0f} s: {_tail(log_path)}")
        time.sleep(0.1)


def stop_master(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """End the master (its process group when it leads one): SIGTERM, then SIGKILL after
    `timeout_s`. Idempotent."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass


def _tail(path: str | Path, n: int = 800) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:].strip()
    except OSError:
        return "(no log)"
