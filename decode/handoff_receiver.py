"""The decode rank's side of the KV handoff: admit, pull, commit, answer.

A handed-off request on a decode rank:
  1. Queued: the Handoff arrived (from a prefill rank that said PeerHello and was added to the
     transfer backend). FIFO; the KV waits, pinned, in the prefill rank's handoff pool. While
     this rank holds the handoff (queued or pulling) it sends the prefill rank a Renew every
     third of the lease, so a full rank keeps the pins for as long as it waits for room
     (between steps in `progress()`, and between a step's layers in `renew_due()`: a step can
     outlast a lease). A Handoff that arrived mid-step behind a message that must wait for the
     step's end (a PeerHello, Peers) is renewed while it waits too (`renew_waiting()`), and its
     lease counts from the last such Renew once it is taken.
  2. Pulling: the engine had room (reserve_kv: device pages, an SWA slot, a sequence place);
     the prompt's leading pages this rank's host cache holds (prompts it prefilled itself,
     pages read from the L3 store, or with step 3's keeping earlier turns) are loaded from it
     into the reserved pages; two reads run on the backend's thread, the prompt's other pages
     into the rest of the reserved pages and the SWA rings (one window per sliding layer,
     never more) into the reserved slot, while the rank keeps decoding other sequences.
     `progress()` polls them between steps.
  3. Committed: both reads done -> with --decode-keep-prompts the prompt's complete pages go
     to the host cache (a later turn pulls only what they lack; off by default: it cost 2P2D's
     TTFT p50 1.35x in docs/results/kv-reuse.md), engine.add_prefilled() (decoding starts next
     step) and Pulled to the prefill rank. A failed read -> pages back, PullFailed to the prefill rank,
     RequestError to the router.
A Handoff from a socket identity that never said PeerHello is answered PullFailed and
otherwise ignored (it must not fail or touch the request it names); one from a peer that was
refused or left (a late Handoff of a dead prefill rank) fails its request at the router.
Failure paths, every one answering the prefill rank exactly once per Handoff it sent:
  - abort while queued: dropped, PullFailed("aborted"); while pulling: the read finishes,
    then pages back and Pulled; before the Handoff arrived: remembered (`_tombstones`), the
    Handoff is refused on arrival;
  - no room within `wait_s` (--handoff-wait-s) of arrival: PullFailed, RequestError 503 (the
    rank is overloaded; nothing was read);
  - no read may start once the lease this rank last renewed (less a margin for the read and
    the network) has run out, which only happens after this thread stalled for most of a
    lease (the prefill rank then releases the pins and fails the request itself): PullFailed,
    RequestError 503, nothing read;
  - the prefill rank leaves the router's Peers: its peer is removed from the backend (reads
    in flight then fail) and its queued handoffs fail with RequestError 500.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.prefill_decode import (PAGES_REGION, STATES_REGION, Handoff, PeerHello, PeerReject,
                                               PeerWelcome, PrefillTimes, Pulled, PullFailed, Renew)
from cluster.protocol.rank_router import RequestError
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

TOMBSTONE_S = 60.0  # how long an abort that came before its Handoff is remembered
RENEWS_PER_LEASE = 3  # Renew a held handoff every lease_s / this


def lease_margin(lease_s: float) -> float:
    """How long before the prefill rank's lease runs out this rank stops starting reads (time
    for the read itself and for messages in flight)."""
    return min(1.0, lease_s / 4)


@dataclass
class Committed:
    """A request that started decoding, with what its phase times need."""

    request_id: str
    prefill: PrefillTimes
    pull_start: float  # wall clock
    pull_end: float


@dataclass
class _Incoming:
    sender: bytes
    handoff: Handoff
    wait_end: float  # monotonic: no room by then -> 503
    lease_end: float = 0.0  # monotonic: no read starts after this (the last renewal's lease, less a margin)
    renew_at: float = 0.0  # monotonic: the next Renew is due
    res: object = None  # engine KVReservation, once pulling
    handles: list = field(default_factory=list)
    pull_start: float = 0.0
    reused_pages: int = 0  # leading prompt pages loaded from this rank's host cache, not pulled
    aborted: bool = False
    start_after: float = 0.0  # monotonic: no read starts before this (fault injection only)


class HandoffReceiver:
    """Not thread-safe: the rank's engine thread owns it (and the engine and the backend).

    `send_peer(sender, msg)` answers a prefill rank, `send_router(msg)` fails a request.
    `clock` is monotonic seconds, `wall` the wall clock (tests pass fakes).
    """

    def __init__(self, engine, backend, name: str, wait_s: float,
                 send_peer: Callable[[bytes, msgspec.Struct], None],
                 send_router: Callable[[msgspec.Struct], None],
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 delay_pull_s: float = 0.0, keep_prompts: bool = False) -> None:
        self.engine, self.backend, self.name = engine, backend, name
        self.keep_prompts = keep_prompts  # --decode-keep-prompts: step 3 stores every pulled prompt
        self.wait_s = wait_s
        self.delay_pull_s = delay_pull_s  # fault injection (rank_runtime/faults.py): hold each read back
        self.send_peer, self.send_router = send_peer, send_router
        self.clock, self.wall = clock, wall
        self.peers: dict[bytes, str] = {}  # sender identity -> prefill rank name (a backend peer id)
        self.queue: deque[_Incoming] = deque()
        self.pulling: dict[str, _Incoming] = {}
        self._tombstones: dict[str, float] = {}  # request id -> monotonic expiry
        self._former: dict[bytes, str] = {}  # identities of peers refused or gone -> name (their handoffs fail)
        self._waiting: dict[str, float] = {}  # request id -> monotonic: last Renew while its Handoff waited
        self.transfer_bytes = 0
        self.transfer_seconds = 0.0
        self.pulled_tokens = 0  # prompt tokens whose KV came from a prefill rank, since start
        self.reused_tokens = 0  # prompt tokens whose KV this rank's host cache already held

    @property
    def num_handoffs(self) -> int:
        return len(self.queue) + len(self.pulling)

    def holds(self, rid: str) -> bool:
        return rid in self.pulling or any(i.handoff.request_id == rid for i in self.queue)

    # ---- messages --------------------------------------------------------------------------
    def on_peer_hello(self, sender: bytes, hello: PeerHello) -> None:
        reason = None
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = f"protocol version mismatch: prefill speaks {hello.protocol_version}, decode {PROTOCOL_VERSION}"
        elif hello.transfer_kind != self.backend.kind:
            reason = (f"{hello.name} uses the {hello.transfer_kind} transfer backend, {self.name} uses "
                      f"{self.backend.kind}: start every PD rank with the same --transfer")
        else:
            for ident, name in list(self.peers.items()):
                if name == hello.name:  # the same rank reconnected (new socket): start over
                    self._drop_peer(ident, f"{name} reconnected")
            try:
                self.backend.add_peer(hello.name, hello.transfer_metadata)
            except (ValueError, RuntimeError) as e:
                reason = f"cannot reach {hello.name}'s handoff pool: {e}"
        if reason is not None:
            log.error("refusing prefill peer %s: %s", hello.name, reason)
            self._former[sender] = hello.name
            self.send_peer(sender, PeerReject(self.name, reason))
            return
        self.peers[sender] = hello.name
        log.info("prefill peer %s connected (pid %d, %s)", hello.name, hello.pid, hello.transfer_kind)
        self.send_peer(sender, PeerWelcome(self.name))

    def on_handoff(self, sender: bytes, h: Handoff, received: float | None = None) -> None:
        """`received`: when the IO thread took it off the socket (monotonic); the lease estimate
        starts there, not when this thread, maybe busy with a long step, got to it."""
        rid = h.request_id
        renewed = self._waiting.pop(rid, None)  # renewed while it waited: its lease restarted then
        if renewed is not None:
            received = renewed if received is None else max(received, renewed)
        if sender not in self.peers and sender not in self._former:
            # NOTE: never act on it beyond answering: it could name another rank's request.
            log.error("dropping handoff %s from %r: its PeerHello was refused or never arrived", rid, sender)
            self.send_peer(sender, PullFailed(rid, "this rank did not accept your PeerHello"))
            return
        if self._tombstones.pop(rid, None) is not None:
            self.send_peer(sender, PullFailed(rid, "aborted before the handoff arrived"))
            return
        problem = None
        if sender not in self.peers:  # sent before its rank left the router's Peers: fail it there
            problem = f"prefill rank {self._former[sender]} was refused or left before this handoff arrived"
        elif self.holds(rid) or rid in self.engine.seqs:
            problem = "request id already on this decode rank"
        elif len(h.pages) != self.engine.pool.pages_for(len(h.prompt_ids)) or \
                (h.swa_state >= 0) != bool(self.engine.pool.swa_layers):
            problem = "handoff does not match this rank's KV layout (page size or model differ)"
        if problem is not None:
            self._fail(_Incoming(sender, h, 0.0), 500, problem)
            return
        now = self.clock()
        t0 = now if received is None else min(now, received)
        self.queue.append(_Incoming(sender, h, t0 + self.wait_s, t0 + h.lease_s - lease_margin(h.lease_s),
                                    t0 + h.lease_s / RENEWS_PER_LEASE, start_after=now + self.delay_pull_s))

    def on_abort(self, rid: str) -> bool:
        """Abort a handoff this rank holds (True), else remember it in case the Handoff is still
        on its way (False: the caller aborts in the engine)."""
        inc = self.pulling.get(rid)
        if inc is not None:
            inc.aborted = True  # the read cannot be interrupted; progress() cleans up after it
            return True
        for inc in self.queue:
            if inc.handoff.request_id == rid:
                self.queue.remove(inc)
                self.send_peer(inc.sender, PullFailed(rid, "aborted"))
                return True
        if rid not in self.engine.seqs:
            self._tombstones[rid] = self.clock() + TOMBSTONE_S
        return False

    def drop_all(self, why: str) -> None:
        """The router is gone: answer every queued handoff PullFailed; reads in flight finish
        and are released (as aborted). Nothing goes to the router."""
        self._waiting.clear()
        while self.queue:
            inc = self.queue.popleft()
            self.send_peer(inc.sender, PullFailed(inc.handoff.request_id, why))
        for inc in self.pulling.values():
            inc.aborted = True

    def on_live_prefill(self, names: set[str]) -> None:
        """The router's Peers: drop prefill ranks that are gone, failing what came from them."""
        for ident, name in list(self.peers.items()):
            if name not in names:
                self._drop_peer(ident, f"prefill rank {name} died before its KV was pulled")

    def _drop_peer(self, ident: bytes, why: str) -> None:
        name = self._former[ident] = self.peers.pop(ident)
        self.backend.remove_peer(name)  # reads in flight from it now poll "failed"
        for inc in [i for i in self.queue if i.sender == ident]:
            self.queue.remove(inc)
            self._fail(inc, 500, why, answer_peer=False)
        log.warning("prefill peer %s removed: %s", name, why)

    # ---- between steps ---------------------------------------------------------------------
    def progress(self) -> list[Committed]:
        """Poll reads, commit finished ones, renew leases, start new reads while there is room."""
        done = self._poll()
        now = self.clock()
        for rid, exp in list(self._tombstones.items()):
            if exp <= now:
                del self._tombstones[rid]
        self._expire(now)
        self._renew(now)
        self._start_queued(now)
        return done + self._poll()  # tiny reads finish inside read()

    def start_queued(self) -> None:
        """Within a step (between its layers): start the reads there is room for now, so that a
        read runs beside the step and its request joins the next step (progress() at this step's
        end commits it) instead of the one after. Reserving the pages mid-step is what the step's
        end would do: a step allocates pages when it is scheduled, none while it runs. As in
        progress(), handoffs whose lease this rank let run out fail first."""
        if self.queue:
            now = self.clock()
            self._expire(now)
            self._start_queued(now)

    def _expire(self, now: float) -> None:
        for inc in [i for i in self.queue if now > i.lease_end]:  # this thread stalled past the lease
            self.queue.remove(inc)  # (the prefill rank may have released the pins already)
            self._fail(inc, 503, f"decode rank {self.name} stalled past the {inc.handoff.lease_s:.1f}s "
                                 "handoff lease; the KV was not read")

    def _start_queued(self, now: float) -> None:
        """Start reads from the queue's head while the engine has room (FCFS); fail the handoffs
        that waited for room longer than wait_s."""
        while self.queue:
            inc = self.queue[0]
            if now > inc.wait_end:
                self.queue.popleft()
                self._fail(inc, 503, f"decode rank {self.name} had no room for this request's KV within "
                                     f"{self.wait_s:.1f}s; the system is overloaded, retry later")
                continue
            if now < inc.start_after:
                break
            res = self.engine.reserve_kv(len(inc.handoff.prompt_ids))
            if res is None:
                break  # FCFS: the head waits for room, the KV waits in the prefill's pool
            self.queue.popleft()
            self._start(inc, res)

    def renew_due(self) -> None:
        """Within a step (between its layers): send the Renews that are due. A step can outlast a
        lease (a decode rank prefilling prompts the router placed on it, in float32 on a shared
        core: 10-20 s for a 2048-token step), and the handoffs held meanwhile would otherwise run
        out as if this rank had stalled. One whose lease this rank already counts as gone stays
        gone (progress() fails it)."""
        if self.queue or self.pulling:
            self._renew(self.clock(), live_only=True)

    def renew_waiting(self, waiting: list[tuple[bytes, Handoff, float | None]]) -> None:
        """Within a step: renew the Handoffs (sender, handoff, when received) that arrived
        during it but wait for its end behind a message that must be taken first (a PeerHello,
        Peers): without it a step longer than the lease after a membership change failed them.
        The Renew goes back to the sender and names only what it handed off (the prefill rank
        extends a lease only for the rank it handed to), so an unknown sender gains nothing;
        whatever the waiting messages decide at the step's end still holds. One whose lease is
        already gone is left to fail when it is taken."""
        now = self.clock()
        due: dict[bytes, list[str]] = {}
        for sender, h, received in waiting:
            last = self._waiting.get(h.request_id, now if received is None else received)
            if last + h.lease_s / RENEWS_PER_LEASE <= now < last + h.lease_s - lease_margin(h.lease_s):
                self._waiting[h.request_id] = now
                due.setdefault(sender, []).append(h.request_id)
        for sender, rids in due.items():
            self.send_peer(sender, Renew(rids))

    def _renew(self, now: float, live_only: bool = False) -> None:
        """Renew every held handoff whose Renew is due, one message per prefill rank. Renewing
        early is harmless (the prefill rank's lease only moves forward from its clock).
        `live_only`: not those whose lease_end has passed."""
        due: dict[bytes, list[_Incoming]] = {}
        for inc in (*self.queue, *self.pulling.values()):
            if now >= inc.renew_at and inc.sender in self.peers and not (live_only and now > inc.lease_end):
                due.setdefault(inc.sender, []).append(inc)
        for sender, incs in due.items():
            for inc in incs:
                lease = inc.handoff.lease_s
                inc.renew_at, inc.lease_end = now + lease / RENEWS_PER_LEASE, now + lease - lease_margin(lease)
            self.send_peer(sender, Renew([inc.handoff.request_id for inc in incs]))

    def _start(self, inc: _Incoming, res) -> None:
        h, peer = inc.handoff, self.peers[inc.sender]
        inc.res, inc.pull_start = res, self.wall()
        self.pulling[h.request_id] = inc
        try:
            n = inc.reused_pages = self._reuse(h, res)
            if n < len(h.pages):
                inc.handles.append(self.backend.read(peer, PAGES_REGION, h.pages[n:], PAGES_REGION, res.pages[n:]))
            if h.swa_state >= 0:
                inc.handles.append(self.backend.read(peer, STATES_REGION, [h.swa_state], STATES_REGION,
                                                     [res.swa_slot]))
        except (KeyError, ValueError, RuntimeError) as e:  # the peer vanished, or a bad page id
            log.error("cannot start the pull of %s from %s: %s", h.request_id, peer, e)
            inc.handles.append(None)

    def _reuse(self, h: Handoff, res) -> int:
        """Load the prompt's leading pages this rank's host cache holds into the reserved pages;
        returns how many (the read skips them; never the last). Pages only: the rings come too."""
        hc = getattr(self.engine, "hicache", None)
        if hc is None:
            return 0
        hit = hc.lookup(h.prompt_ids, need_state=False, salt=h.sampling.cache_salt)
        n = len(hit.path)
        if not n:
            hc.release(hit)
            return 0
        hc.load(hit, self.engine.pool, res.pages[:n], None)
        return n

    def _keep(self, h: Handoff, res) -> None:
        """The prompt's complete pages, just pulled, into the host cache (those it lacks)."""
        hc = getattr(self.engine, "hicache", None)
        if hc is None or not self.keep_prompts:
            return
        try:
            hc.store(h.prompt_ids, self.engine.pool, res.pages, None, h.sampling.cache_salt)
        except Exception:  # noqa: BLE001 - a later turn pulls them again; this request goes on
            log.exception("storing the pages of %s in the host cache failed", h.request_id)

    def _poll(self) -> list[Committed]:
        out = []
        for rid, inc in list(self.pulling.items()):
            states = [self.backend.poll(hd) if hd is not None else "failed" for hd in inc.handles]
            if "pending" in states:
                continue
            del self.pulling[rid]
            for hd in inc.handles:
                if hd is not None:
                    self.backend.release(hd)
            ok = all(s == "done" for s in states)
            end = self.wall()
            if ok:
                self.transfer_bytes += sum(hd.nbytes for hd in inc.handles)
                self.transfer_seconds += end - inc.pull_start
            if inc.aborted:
                self.engine.release_kv(inc.res)
                self.send_peer(inc.sender, Pulled(rid) if ok else PullFailed(rid, "aborted"))
            elif not ok:
                self.engine.release_kv(inc.res)
                self._fail(inc, 500, f"KV transfer from {self.peers.get(inc.sender, 'a prefill rank')} failed")
            else:
                self.send_peer(inc.sender, Pulled(rid))
                reused = min(inc.reused_pages * self.engine.pool.page_size, len(inc.handoff.prompt_ids))
                self.reused_tokens += reused
                self.pulled_tokens += len(inc.handoff.prompt_ids) - reused
                self._keep(inc.handoff, inc.res)
                if self._commit(inc):
                    out.append(Committed(rid, inc.handoff.times, inc.pull_start, end))
        return out

    def _commit(self, inc: _Incoming) -> bool:
        h = inc.handoff
        try:
            params = SamplingParams(**msgspec.structs.asdict(h.sampling))
            self.engine.add_prefilled(h.request_id, h.prompt_ids, [h.first_token], params, inc.res,
                                      h.cached_tokens)
        except ValueError as e:  # add_prefilled released the reservation
            self.send_router(RequestError(h.request_id, 400, str(e)))
            return False
        return True

    def _fail(self, inc: _Incoming, status: int, message: str, answer_peer: bool = True) -> None:
        rid = inc.handoff.request_id
        log.warning("handoff %s failed: %s", rid, message)
        if answer_peer:
            self.send_peer(inc.sender, PullFailed(rid, message))
        self.send_router(RequestError(rid, status, message))
