"""The router's view of every rank: who it is, whether it lives, how loaded it is.

Pure bookkeeping, no sockets (dispatcher.py does the IO), so it is unit-tested directly.
A rank's states:
    loading --Hello accepted--> ready --silent past the timeout / process gone / Goodbye--> dead
    loading --no Hello within its start timeout / process gone--> dead
Expected ranks (the ones the launcher started) are listed from the start as `loading`;
a rank may also join later by saying Hello (started by hand). Dead is final for the process
(its ZeroMQ identity): one that speaks again after being declared dead (a hung rank that wakes
up) is told to shut down, and its Hello is refused, since its requests failed. A new identity
may take a dead name as a fresh rank: a new process, or one that rejoined (--rejoin) on a new
socket, when started by hand; when the launcher started it, only the launcher's supervisor
(`expect` again).
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

from cluster.protocol import PROTOCOL_VERSION, ROLES
from cluster.protocol.rank_router import Hello, RankStats
from cluster.protocol.router_rank import Reject, Welcome
from pd_server.cache_index import RankCacheIndex

LOADING, READY, DEAD = "loading", "ready", "dead"
PD_ROLES = frozenset({"prefill", "decode"})


@dataclass
class Rank:
    role: str
    index: int
    pid: int | None = None
    state: str = LOADING
    identity: bytes | None = None  # ZeroMQ routing id, known after Hello
    hello: Hello | None = None
    stats: RankStats | None = None
    last_seen: float = 0.0  # monotonic time of the last frame from the rank
    inflight: set[str] = field(default_factory=set)  # request ids the rank holds (sub-request ids)
    dead_reason: str = ""
    process: subprocess.Popen | None = field(default=None, repr=False)  # when the launcher started it
    routed: int = 0  # requests sent to it, ever
    cache: RankCacheIndex | None = None  # what its host cache holds (with one; a decode rank's: its own prefills)
    ready_by: float = 0.0  # monotonic deadline for its Hello (launcher-started ranks); 0: none
    restarts: int = 0  # processes started under this name before this one (the launcher's supervisor)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def live(self) -> bool:
        return self.state == READY

    def describe(self, now: float) -> dict:
        """One /health entry."""
        s = self.stats
        return {
            "name": self.name, "role": self.role, "index": self.index, "pid": self.pid, "state": self.state,
            "node": self.hello.node if self.hello else "",
            "inflight": len(self.inflight), "routed": self.routed, "restarts": self.restarts,
            "running": s.running if s else 0, "waiting": s.waiting if s else 0,
            "pages_used": s.pages_used if s else 0, "pages_total": s.pages_total if s else 0,
            "handoffs": s.handoffs if s else 0, "handoff_pages_used": s.handoff_pages_used if s else 0,
            "host_cache_pages": len(self.cache.pages) if self.cache else None,  # as the router's index has it
            "last_seen_s": round(now - self.last_seen, 3) if self.last_seen else None,
            **({"error": self.dead_reason} if self.dead_reason else {}),
        }


def hello_problem(h: Hello) -> str:
    """What is wrong with a Hello's fields the router later divides or indexes by ("" : nothing)."""
    if h.role not in ROLES or not 0 <= h.index < 2**16:
        return f"role {h.role!r} / index {h.index}"
    if h.page_size < 1 or h.page_size & (h.page_size - 1) or h.page_size > 2**16:
        return f"page_size {h.page_size}"
    if h.max_model_len < 2 or h.vocab_size < 1 or h.pages_total < 0:
        return f"max_model_len {h.max_model_len}, vocab_size {h.vocab_size}, pages_total {h.pages_total}"
    if len(h.cache_root) not in (0, 16):
        return f"cache_root of {len(h.cache_root)} bytes"
    return ""


class RankRegistry:
    def __init__(self, model: str) -> None:
        self.model = model  # served name every rank must report
        self.ranks: dict[str, Rank] = {}  # by name, in the order they became known
        self._by_identity: dict[bytes, Rank] = {}
        self._shared_caches: dict[str, RankCacheIndex] = {}  # Hello.cache_group -> its one picture

    def expect(self, role: str, index: int, process: subprocess.Popen | None = None,
               ready_by: float = 0.0) -> Rank:
        """Register a rank the launcher started; it shows as loading until its Hello, and is
        found dead when no Hello came by `ready_by` (monotonic; 0: waits forever). A name
        already known (a restart) gets a fresh entry: the old process's identity stays mapped
        to the old, dead entry, so what it still sends is refused."""
        old = self.ranks.get(f"{role}-{index}")
        rank = Rank(role, index, pid=process.pid if process else None, process=process, ready_by=ready_by,
                    restarts=old.restarts + 1 if old is not None else 0)
        self.ranks[rank.name] = rank
        return rank

    def by_identity(self, identity: bytes) -> Rank | None:
        return self._by_identity.get(identity)

    def on_hello(self, identity: bytes, hello: Hello, now: float, heartbeat_s: float) -> Welcome | Reject:
        """Admit or refuse a rank. Mutates the registry only when admitting."""
        if hello.protocol_version != PROTOCOL_VERSION:
            return Reject(version_mismatch(hello.protocol_version))
        if hello.model != self.model:
            return Reject(f"rank serves model {hello.model!r}, this router serves {self.model!r}")
        bad = hello_problem(hello)
        if bad:
            return Reject(f"malformed Hello: {bad}")
        name = f"{hello.role}-{hello.index}"
        known = self._by_identity.get(identity)
        if known is not None and known.state == DEAD:  # a hung process woke up after its restart
            return Reject(f"this process was declared dead as {name} ({known.dead_reason}); exit")
        rank = self.ranks.get(name)
        if rank is not None and rank.state == DEAD and rank.process is None:  # started by hand, again
            rank = self.ranks[name] = Rank(hello.role, hello.index, restarts=rank.restarts + 1)
        if rank is not None and rank.state == DEAD:
            return Reject(f"{name} was declared dead ({rank.dead_reason}); start it under a new index")
        if rank is not None and rank.identity not in (None, identity):
            return Reject(f"another process already serves as {name} (pid {rank.pid})")
        if rank is None:
            rank = self.ranks[name] = Rank(hello.role, hello.index)
        rank.pid, rank.identity, rank.hello = hello.pid, identity, hello
        if hello.cache_root and rank.cache is None:  # a repeated Hello keeps it
            rank.cache = self._shared_caches.get(hello.cache_group) or RankCacheIndex(
                hello.cache_root, hello.page_size, hello.cache_needs_state)
            if hello.cache_group:  # one host cache: one picture for all its ranks
                self._shared_caches[hello.cache_group] = rank.cache
        rank.state, rank.last_seen = READY, now
        self._by_identity[identity] = rank
        return Welcome(PROTOCOL_VERSION, name, heartbeat_s)

    def live(self, role: str | None = None) -> list[Rank]:
        return [r for r in self.ranks.values() if r.live and (role is None or r.role == role)]

    def mark_dead(self, rank: Rank, reason: str) -> set[str]:
        """Declare a rank dead (its cache index dropped); returns the request ids it held (the
        caller fails them)."""
        if rank.state == DEAD:
            return set()
        rank.state, rank.dead_reason, rank.cache = DEAD, reason, None
        lost, rank.inflight = rank.inflight, set()
        return lost

    def find_dead(self, now: float, timeout_s: float) -> list[tuple[Rank, str]]:
        """Ranks that just died: process exited (launcher-started ranks) or silent past timeout_s.
        Reaps exited child processes. Does not mark them: the caller does, failing their requests."""
        out = []
        for rank in self.ranks.values():
            if rank.state == DEAD:
                continue
            code = rank.process.poll() if rank.process is not None else None
            if code is not None:
                out.append((rank, f"{rank.name} (pid {rank.pid}) exited with code {code}"))
            elif rank.state == READY and now - rank.last_seen > timeout_s:
                out.append((rank, f"{rank.name} (pid {rank.pid}) silent for {now - rank.last_seen:.1f}s"))
            elif rank.state == LOADING and rank.ready_by and now > rank.ready_by:
                out.append((rank, f"{rank.name} (pid {rank.pid}) did not become ready within its start timeout "
                                  "(still loading; see its log)"))
        return out

    @property
    def status(self) -> str:
        """loading: an expected rank has not said Hello yet (requests still go to live ranks);
        ok: every rank is up; degraded: some rank is dead or restarting but a live colocated or
        decode rank can serve (in PD mode a decode rank prefills itself when no prefill rank
        lives); unavailable: none can."""
        ranks = self.ranks.values()
        if any(r.state == LOADING and not r.restarts for r in ranks):
            return "loading"
        if not any(r.state == READY and r.role in ("colocated", "decode") for r in ranks):
            return "loading" if any(r.state == LOADING for r in ranks) else "unavailable"
        return "ok" if all(r.state == READY for r in ranks) else "degraded"

    @property
    def max_model_len(self) -> int:
        """The context every live rank accepts (0 with none)."""
        lens = [r.hello.max_model_len for r in self.live() if r.hello]
        return min(lens) if lens else 0


def version_mismatch(rank_version: int) -> str:
    return (f"protocol version mismatch: rank speaks {rank_version}, router speaks {PROTOCOL_VERSION}; "
            "start the rank and the router from the same checkout")
