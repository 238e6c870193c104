"""The L3 KV tier: pages and SWA states that outlive a host cache, found by every rank that
shares the store (`--kv-store file:DIR`: the ranks of one host, and the next start on it).

What a store holds: objects named by a page's chain key (hicache.index.page_keys, whose root
is the namespace of model, dtype and page size, so equal names mean equal KV) in hex, plus
".kv" for a page's bytes (one host-pool page, `HostPoolLayout.page_bytes`) or ".swa" for the SWA
rings as of that page's end (`state_bytes`). Objects are written once and never changed.

How the host cache uses it (hicache/cache.py):
  1. Write-through: every page (and state) the host cache stores is queued here; a writer
     thread copies it from the host pool to the store while the host cache keeps it pinned
     (StoreWriter: the engine thread unpins it once written; past `max_pending_bytes` queued,
     new pages skip the store rather than pin the cache full).
  2. Lookup: a prompt's pages past the host cache's hit are probed here; the leading run that
     exists is read into free host pages (indexed as if stored, so the usual load to the
     device follows). A read that fails, or a store that is down, ends the run there: the
     request computes the rest, nothing fails.

FileStore keeps one file an object under DIR/<2 hex>/: written under a temporary name and
renamed (a writer killed mid-write leaves no object that can be read), its size checked before
any read, and trimmed oldest first (by modification time, which reads refresh) to its capacity.
Several processes may share a directory: a race costs a miss, never a wrong page.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)


class KVStore(ABC):
    """An L3 object store of immutable, fixed-size KV objects. Thread-safe: the writer thread
    writes while the engine thread probes and reads."""

    kind: str

    @abstractmethod
    def leading(self, names: Sequence[str]) -> int:
        """How many of `names`, from the first, the store holds without a gap (a store that
        cannot answer says 0)."""

    @abstractmethod
    def read_into(self, name: str, out: memoryview) -> bool:
        """Fill `out` (a writable byte view) with the object; False, `out` undefined, when the
        object is missing, of another size, or unreadable."""

    @abstractmethod
    def write(self, name: str, data: memoryview) -> None:
        """Store the object (raises OSError when it cannot)."""

    def close(self) -> None:
        pass


STORE_SPECS = ("file:DIR (a directory on this host), mooncake (the launcher starts a Mooncake master with the "
               "system) or mooncake://HOST:RPC_PORT?metadata=http://HOST:PORT/metadata (an existing master)")


def parse_store(spec: str) -> tuple[str, str]:
    """`file:DIR` -> ("file", DIR); `mooncake` -> ("mooncake", ""); `mooncake://HOST:PORT[?metadata=URL]`
    -> ("mooncake", spec). Raises ValueError naming what is accepted."""
    kind, sep, where = spec.partition(":")
    if kind == "file" and sep and where:
        return kind, where
    if spec == "mooncake":
        return "mooncake", ""
    if spec.startswith("mooncake://"):
        u = urlsplit(spec)
        if u.hostname and u.port:
            return "mooncake", spec
    raise ValueError(f"kv_store must be {STORE_SPECS}, got {spec!r}")


def open_store(spec: str, capacity_gb: float) -> KVStore:
    """The store `spec` names (parse_store), with `capacity_gb`: FileStore's size (0: derived
    from free space), or the memory this rank gives a Mooncake store (0: 1 GiB)."""
    kind, where = parse_store(spec)
    if kind == "file":
        return FileStore(Path(where), capacity_gb)
    if not where:
        raise ValueError("kv_store mooncake: the launcher starts the master and passes each rank its address")
    from hicache.mooncake_store import MooncakeStore

    u = urlsplit(where)
    metadata = parse_qs(u.query).get("metadata", [f"http://{u.hostname}:{u.port + 1}/metadata"])[0]
    return MooncakeStore(f"{u.hostname}:{u.port}", metadata, local_hostname=_address_towards(u.hostname),
                         global_segment_bytes=int((capacity_gb or 1.0) * 2**30))


def _address_towards(host: str) -> str:
    """This host's address on the route to `host` (loopback for a master on loopback)."""
    import socket

    if host.startswith("127.") or host == "localhost":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # (UDP: no packet is sent)
        return s.getsockname()[0]


class StoreUnavailable(RuntimeError):
    """The launcher cannot provide the store asked for (what is missing is in the message)."""


@contextlib.contextmanager
def store_for_launch(spec: str, log_dir: Path, host: str = "127.0.0.1") -> Iterator[str]:
    """The launcher's side of `spec`, yielding what its ranks get: `mooncake` starts a master
    for as long as the block runs (in the launcher's process group, so a stop of the group ends
    it too), listening on `host` (loopback; under Ray the launcher's node IP, which every node
    reaches), and yields the address the ranks join; any other spec is yielded as it is. Raises
    StoreUnavailable naming what is missing (scripts/setup_mooncake.sh installs it) or a spec
    the ranks could not use."""
    if spec != "mooncake":
        if spec:
            try:
                parse_store(spec)
            except ValueError as e:
                raise StoreUnavailable(str(e)) from None
        yield spec
        return
    import socket

    from hicache.mooncake_store import start_master, stop_master

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
    if not host.startswith("127."):
        log.warning("the Mooncake master listens on %s:%d and %d (its RPC, its metadata): it has no "
                    "authentication, keep the cluster on a private network (docs/deployment.md)", host, *ports)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        proc = start_master(ports[0], ports[1], log_dir / "mooncake-master.log", own_group=False, host=host)
    except RuntimeError as e:
        raise StoreUnavailable(str(e)) from None
    try:
        yield f"mooncake://{host}:{ports[0]}?metadata=http://{host}:{ports[1]}/metadata"
    finally:
        stop_master(proc)


class FileStore(KVStore):
    kind = "file"
    TRIM_TO = 0.9  # a trim removes objects until the store is this full

    def __init__(self, root: Path, capacity_gb: float = 0.0) -> None:
        root = root.expanduser().resolve()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = root.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise ValueError(f"kv store directory {root} must be owned by this user and not group/world-writable")
        self.root = root
        if capacity_gb <= 0:  # a quarter of the free space, at most 64 GiB
            capacity_gb = min(shutil.disk_usage(root).free / 4 / 2**30, 64.0)
        self.capacity = int(capacity_gb * 2**30)
        self._lock = threading.Lock()
        self._bytes = self._scan_bytes()

    def _path(self, name: str) -> Path:
        return self.root / name[:2] / name

    def _scan_bytes(self) -> int:
        total = 0
        for sub in self.root.iterdir():
            if sub.is_dir():
                for e in os.scandir(sub):
                    try:
                        total += e.stat().st_size
                    except OSError:
                        pass
        return total

    def leading(self, names: Sequence[str]) -> int:
        for i, name in enumerate(names):
            if not self._path(name).is_file():
                return i
        return len(names)

    def read_into(self, name: str, out: memoryview) -> bool:
        path = self._path(name)
        try:
            with open(path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != out.nbytes:
                    return False
                got = f.readinto(out)
            os.utime(path)  # recently used: trimmed last
        except OSError:
            return False
        return got == out.nbytes

    def write(self, name: str, data: memoryview) -> None:
        path = self._path(name)
        if path.exists():
            return
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{name}.{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb", buffering=0) as f:
                view = memoryview(data).cast("B")
                while view:
                    view = view[f.write(view):]
            os.replace(tmp, path)  # atomic: readers see the whole object or none
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._bytes += data.nbytes
            over = self._bytes > self.capacity
        if over:
            self.trim()

    def trim(self) -> None:
        """Remove the least recently used objects (and stale temporaries) until the store is at
        most TRIM_TO of its capacity; counts what the directory really holds (other processes
        write to it too)."""
        entries, total, now = [], 0, time.time()
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for e in os.scandir(sub):
                try:
                    st = e.stat()
                except OSError:
                    continue
                if e.name.endswith(".tmp"):
                    if now - st.st_mtime > 300:  # a writer that died mid-write
                        Path(e.path).unlink(missing_ok=True)
                    continue
                entries.append((st.st_mtime, st.st_size, e.path))
                total += st.st_size
        entries.sort()
        goal = int(self.capacity * self.TRIM_TO)
        for _, size, path in entries:
            if total <= goal:
                break
            try:
                os.unlink(path)
                total -= size
            except OSError:
                pass
        with self._lock:
            self._bytes = total


class StoreWriter:
    """Write-through to a KVStore on one background thread.

    `submit(name, view, token)` queues a write of `view` (memory the caller keeps unchanged
    until the write is done: a pinned host page); `done()` (engine thread) returns the tokens of
    finished writes, failed ones included, so the caller can unpin. Refuses (returns False)
    past `max_pending_bytes` queued.
    """

    def __init__(self, store: KVStore, max_pending_bytes: int = 256 * 2**20) -> None:
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.written_bytes = 0
        self.write_seconds = 0.0  # time in store.write, since start
        self.errors = 0
        self._queue: collections.deque = collections.deque()
        self._done: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-store-writer", daemon=True)
        self._thread.start()

    def submit(self, name: str, view: memoryview, token: object) -> bool:
        with self._cv:
            if self._stop or self.pending_bytes + view.nbytes > self.max_pending_bytes:
                return False
            self.pending_bytes += view.nbytes
            self._queue.append((name, view, token))
            self._cv.notify()
        return True

    def done(self) -> list:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                name, view, token = self._queue.popleft()
            t0 = time.perf_counter()
            try:
                self.store.write(name, view)
                self.written_bytes += view.nbytes
            except Exception:  # noqa: BLE001 - the store misses this object; nothing else changes
                self.errors += 1
                if self.errors <= 3:
                    log.exception("kv store write of %s failed", name)
            self.write_seconds += time.perf_counter() - t0
            self._done.append(token)  # (before pending_bytes drops: a waiter that sees 0 finds every token)
            with self._cv:
                self.pending_bytes -= view.nbytes

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued (up to `timeout_s`), then stop the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout_s)


def bytes_view(tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bf16 included)."""
    import ctypes

    n = tensor.numel() * tensor.element_size()
    buf = (ctypes.c_char * n).from_address(tensor.data_ptr())
    buf.tensor = tensor  # the view keeps the memory alive
    return memoryview(buf).cast("B")

