"""The router's rank socket: send work, route token events back, watch that ranks live.

Life of a request here:
  1. submit() picks a rank (routing.pick_rank), records one Pending per sub-request (n
     choices x prompts, all on that rank) and sends one Generate each. PD mode (prefill ranks
     exist): a decode rank by load (routing.pick_decode_rank; by the policy with --disagg
     never), then placement.Placer picks a prefill rank, whose Generate names the decode rank,
     or has the decode rank prefill it (decode_rank -1, booked as a colocated request).
  2. The receive loop decodes each TokenBatch and puts (choice index, TokenEvent) on the
     request's inbox (request_state.Inbox); the last event of a sub-request (finish_reason
     set) retires it. A streaming request's inbox holds its events until the round (every
     frame already queued) is decoded, then hands them to the stream in one go, which writes
     them without a task wake-up (sse_response.py). Inter-token gaps reach the histogram
     after that.
     PD: the first token comes from the prefill rank, the rest from the decode rank, over two
     paths: events are put in order by their token offset (a decode event that overtakes the
     first token waits for it). Once the first token is in, the prefill rank is done with the
     request as far as the router is concerned; the decode rank holds it until the end.
  3. A rank holding it dies: migration.Migrator moves it to a live rank, which resumes it from
     the tokens delivered so far (--max-migrations). A RequestError, or a death it cannot move,
     puts a Failure on the queue instead (and Abort goes to the other rank holding it).
  4. Handle.close() (the handler's finally: done, failed or client gone) sends Abort for
     whatever has not finished, to every rank holding it, so they free their pages at once.
PD ranks learn each other from `Peers` (every live prefill and decode rank with its peer
address), sent after each one's Welcome and to all of them whenever one joins or dies.
Everything runs on the event loop thread; the socket is a zmq.asyncio ROUTER whose sends
never block (no high-water mark; ROUTER_MANDATORY turns a vanished peer into an error).
Frames are size-bounded, and with a cluster secret the socket runs CURVE (cluster/auth.py):
a peer without the secret never gets a frame through. A frame from an identity that never
said an accepted Hello, or from a rank declared dead, is answered with Shutdown and otherwise
ignored; a Hello from a process declared dead is refused.
"""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from cluster.auth import handshake_failure, secure_server, start_authenticator
from cluster.protocol.codec import Codec
from cluster.protocol.rank_router import CacheEvents, Goodbye, Hello, RankStats, RequestError, TokenBatch, TokenEvent
from cluster.protocol.router_rank import Abort, Generate, PeerInfo, Peers, Ping, Reject, Sampling, Shutdown
from pd_server import fanout
from pd_server.config import RouterConfig
from pd_server.metrics import RouterMetrics, phase_durations
from pd_server.migration import Migrator
from pd_server.placement import Placer
from pd_server.ranks import DEAD, PD_ROLES, Rank, RankRegistry, version_mismatch
from pd_server.request_state import Failure, Handle, Inbox, Pending
from pd_server.routing import RouteRequest, RoutingPolicy, expected_hit_tokens, pick_decode_rank, pick_rank

log = logging.getLogger("pd_server.dispatcher")


class Dispatcher:
    def __init__(self, cfg: RouterConfig, registry: RankRegistry, policy: RoutingPolicy,
                 metrics: RouterMetrics, secret: str = "") -> None:
        """`secret`: the cluster secret ranks must prove (cluster/auth.py); "" admits any rank."""
        self.cfg = cfg
        self.secret = secret
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.pending: dict[str, Pending] = {}
        self.address = ""
        self._codec = Codec()
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._held: list[Inbox] = []  # inboxes holding events until this receive round ends
        self._auth = None  # ZAP handler thread, with a secret
        self.placer = Placer(cfg, registry, policy, self.pending)  # --disagg (placement.py)
        self.migrator = Migrator(cfg, registry, policy, metrics, self._send)  # --max-migrations

    def bind(self) -> str:
        """Bind the rank socket (before ranks start); returns the resolved address."""
        s = self._sock
        secure_server(s, self.secret)
        if self.secret:
            self._auth = start_authenticator(zmq.Context.shadow(self._ctx.underlying), self.secret)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(self.cfg.rank_addr)
        self.address = s.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    def start(self) -> None:
        """Start the receive and heartbeat loops on the running event loop; load the native SSE sender."""
        fanout.load()
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._recv_loop(), name="rank-recv"),
                       asyncio.create_task(self._heartbeat_loop(), name="rank-heartbeat"),
                       asyncio.create_task(self._handshake_log(), name="rank-handshakes")]

    async def close(self, reason: str = "router shutting down") -> None:
        for rank in self.registry.live():
            self._send(rank, Shutdown(reason))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close(linger=200)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ---- requests ------------------------------------------------------------------------
    @property
    def pd_mode(self) -> bool:
        """Prefill ranks serve prompts (and decode ranks the rest) once any prefill rank is known."""
        return any(r.role == "prefill" for r in self.registry.ranks.values())

    def submit(self, request_id: str, work: list[tuple[list[int], Sampling]], route: RouteRequest,
               arrival: float) -> Handle:
        """Send every (prompt ids, sampling) as one sub-request to one rank (PD: one prefill
        and one decode rank, or the decode rank alone as --disagg places it). Raises APIError
        503 (no live rank) or 429 (all full); sends nothing then."""
        cap = self.cfg.max_inflight_per_rank
        placement, est = None, [0.0] * len(work)
        if self.pd_mode:
            if self.cfg.disagg == "never":  # decode ranks serve as colocated ones: routed by the policy
                decode = pick_rank(self.registry, self.policy, route, "decode", cap)
            else:
                decode = pick_decode_rank(self.registry, route, cap, self.cfg.decode_pack)
            rank, placement, est = self.placer.place(decode, route, work, cap)
            if placement.local:
                rank, decode = decode, None  # booked as a colocated request on the decode rank
            self.metrics.prefill_placement.labels(placement.where).inc()
        else:
            decode, rank = None, pick_rank(self.registry, self.policy, route, "colocated", cap)
        handle = Handle(self, [f"{request_id}-{i}" for i in range(len(work))], rank, decode)
        now = time.time()
        for i, (sid, (prompt, sampling)) in enumerate(zip(handle.sub_ids, work)):
            msg = Generate(sid, prompt, sampling, now, decode.index if decode else -1)
            p = self.pending[sid] = Pending(msg, handle.queue, i, rank, arrival, decode, prefill_s=est[i])
            for r in p.ranks():
                r.inflight.add(sid)
            self._send(rank, msg)
        rank.routed += 1
        if decode is not None:
            decode.routed += 1
        if self.cfg.log_requests:
            log.info("%s -> %s by %s (%d sequence(s), %d prompt tokens, expected hit %d tokens)%s", request_id,
                     "+".join(r.name for r in (rank, decode) if r), self.policy.name, len(work), len(work[0][0]),
                     expected_hit_tokens(rank, work[0][0], work[0][1].cache_salt),
                     f", prefill on {placement.describe()}" if placement else "")
        elif placement is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("%s prefill on %s", request_id, placement.describe())
        return handle

    def abort(self, sub_id: str) -> None:
        p = self.pending.pop(sub_id, None)
        if p is not None:
            self._abort_on_ranks(sub_id, p)

    def _abort_on_ranks(self, sub_id: str, p: Pending) -> None:
        for r in p.ranks():
            r.inflight.discard(sub_id)
            if r.live:
                self._send(r, Abort(sub_id))

    def _send(self, rank: Rank, msg: msgspec.Struct) -> None:
        if rank.identity is None:
            return
        try:
            self._sock.send_multipart([rank.identity, self._codec.encode(msg)], flags=zmq.DONTWAIT).result()
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer's connection is gone
            self._rank_died(rank, f"{rank.name} unreachable ({e})")

    # ---- receive -----------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        sock = self._sock
        while True:
            frames = await sock.recv_multipart()
            self._on_frames(frames)
            for _ in range(256):  # drain what is already queued without a wake-up each
                try:
                    frames = sock.recv_multipart(flags=zmq.DONTWAIT).result()
                except zmq.Again:
                    break
                self._on_frames(frames)

    async def _handshake_log(self) -> None:
        """Log connections refused at the handshake (no or another cluster secret)."""
        mon = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())
                reason = handshake_failure(event["event"], "server")
                if reason:
                    log.warning("rank socket: %s", reason)
        finally:
            self._sock.disable_monitor()
            mon.close(linger=0)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:  # [identity, frame]: ranks send one frame per message
            log.error("dropping a %d-part message from %r", len(frames), frames[0])
            return
        try:
            self._on_frame(frames[0], frames[1])
        except Exception:  # noqa: BLE001 - one bad frame must not stop the loop
            log.exception("error handling a frame from %r", frames[0])

    def _on_frame(self, identity: bytes, frame: bytes) -> None:
        rank = self.registry.by_identity(identity)
        try:
            msg = self._codec.decode_from_rank(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            version = self._codec.probe_hello_version(frame)
            if version is not None:
                reason = version_mismatch(version)
                log.warning("refusing rank %r: %s", identity, reason)
                self._reply(identity, Reject(reason))
            else:
                log.error("undecodable frame from %r: %s", identity, e)
            return
        now = time.monotonic()
        if isinstance(msg, Hello):
            same = self.registry.ranks.get(f"{msg.role}-{msg.index}")
            if rank is None and same is not None and same.live and same.pid == msg.pid and same.process is None:
                # The same process on a new socket (it rejoined after losing this router's connection):
                # it dropped every request, so they fail now rather than at the silence timeout.
                self._rank_died(same, f"{same.name} (pid {same.pid}) rejoined on a new connection")
            reply = self.registry.on_hello(identity, msg, now, self.cfg.heartbeat_interval_s)
            if isinstance(reply, Reject):
                log.warning("refusing rank %s-%d (pid %d): %s", msg.role, msg.index, msg.pid, reply.reason)
            elif rank is None:
                log.info("rank %s ready (pid %d, max_model_len %d)", reply.rank_name, msg.pid, msg.max_model_len)
            self._reply(identity, reply)
            if not isinstance(reply, Reject) and rank is None and msg.role in PD_ROLES:
                self._broadcast_peers()
            return
        if rank is None or not rank.live:
            self._reply(identity, Shutdown("unknown or dead rank: its requests were failed"))
            return
        rank.last_seen = now
        if isinstance(msg, TokenBatch):
            self._on_tokens(msg.events, rank)
        elif isinstance(msg, RankStats):
            self._on_stats(rank, msg)
        elif isinstance(msg, CacheEvents):
            if rank.cache is not None:
                rank.cache.apply(msg.updates)
        elif isinstance(msg, RequestError):
            # A 5xx for a request whose other rank died (a decode rank that could not pull the
            # KV of a dead prefill rank) moves it, as that rank's death would have.
            p = self.pending.get(msg.request_id)
            if p is not None and rank not in p.ranks():  # moved away from it (a late lease on a prefill rank)
                log.info("ignoring %s's error for %s (moved to %s)", rank.name, msg.request_id, p.rank.name)
                return
            dead = next((r for r in p.ranks() if not r.live), None) if p and msg.status >= 500 else None
            if dead is None or not self.migrator.move(msg.request_id, p, dead, dead.dead_reason):
                self._fail(msg.request_id, Failure(msg.status, msg.message))
        elif isinstance(msg, Goodbye):
            self._rank_died(rank, f"{rank.name} left: {msg.reason}")

    def _reply(self, identity: bytes, msg: msgspec.Struct) -> None:
        try:
            self._sock.send_multipart([identity, self._codec.encode(msg)], flags=zmq.DONTWAIT).result()
        except zmq.ZMQError:
            pass

    def _on_tokens(self, events: list[TokenEvent], rank: Rank | None = None) -> None:
        now = time.perf_counter()
        itl: list[float] = []
        for ev in events:
            p = self.pending.get(ev.request_id)
            if p is None or (rank is not None and rank is not p.rank and rank is not p.decode):
                continue  # aborted (the rank had not heard yet), or from a rank that does not hold it
            offset = ev.completion_tokens - len(ev.token_ids)
            if offset > p.received and p.decode is not None:
                p.early[offset] = ev  # overtook the prefill rank's first token
                continue
            self._deliver(p, ev, now, itl)
            while p.received in p.early and ev.request_id in self.pending:
                self._deliver(p, p.early.pop(p.received), now, itl)
        if itl and self._loop is not None:
            # NOTE: after the streams this batch woke and the flush (call_soon is FIFO), so no
            # token waits on the histogram's per-sample locks.
            self._loop.call_soon(self._observe_itl, itl)
        elif itl:  # not started (tests drive frames by hand)
            self._observe_itl(itl)

    def _flush_held(self) -> None:
        """End of a receive round: every inbox holding events hands them to its stream at once."""
        held, self._held = self._held, []
        fanout.BATCH.begin(len(held))
        try:
            for inbox in held:
                inbox.flush()
        finally:
            fanout.BATCH.send()  # the eager streams' bodies: the rest sent, all waited for

    def _observe_itl(self, samples: list[float]) -> None:
        self.metrics.itl.observe_all(samples)

    def _deliver(self, p: Pending, ev: TokenEvent, now: float, itl: list[float]) -> None:
        """Put one event on its request's inbox; inter-token gaps go to `itl` (observed later)."""
        if p.last:
            itl.append(now - p.last)
        else:
            self.metrics.ttft.observe(now - p.arrival)
            if p.decode is not None:  # the prefill rank is done with it (the Handoff is out)
                p.rank.inflight.discard(ev.request_id)
        p.last = now
        p.received += len(ev.token_ids)
        p.tokens += ev.token_ids
        if ev.finish_reason is not None:
            del self.pending[ev.request_id]
            for r in p.ranks():
                r.inflight.discard(ev.request_id)
            self._on_finished(p, ev, now)
        if p.queue.hold((p.index, ev)):
            if not self._held:  # the first this round: flush once the receive loop yields
                asyncio.get_running_loop().call_soon(self._flush_held)
            self._held.append(p.queue)

    def _on_finished(self, p: Pending, ev: TokenEvent, now: float) -> None:
        m = self.metrics
        m.e2e.observe(now - p.arrival)
        if self.cfg.log_requests:
            log.info("%s done on %s: %s, %d+%d tokens (%d cached), %.3fs", ev.request_id,
                     "+".join(r.name for r in p.ranks()),
                     ev.finish_reason, ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, now - p.arrival)
        m.prompt_tokens.inc(ev.prompt_tokens)
        m.cached_tokens.inc(ev.cached_tokens)
        m.completion_tokens.inc(ev.completion_tokens)
        t = ev.times
        if t is None:
            return
        phases = phase_durations(p.msg.sent_at, t)
        for name, seconds in phases.items():
            m.phase.labels(name).observe(seconds)
        if self.cfg.log_requests:
            log.info("%s phases: %s", ev.request_id, " ".join(f"{k}={v * 1000:.1f}ms" for k, v in phases.items()))

    def _on_stats(self, rank: Rank, s: RankStats) -> None:
        last, rank.stats = rank.stats, s
        m, name = self.metrics, rank.name
        m.observe_kv_reuse(name, rank.role, last, s)
        m.rank_queue.labels(name).set(s.waiting)
        m.rank_running.labels(name).set(s.running)
        m.rank_pages.labels(name).set(s.pages_used)
        m.rank_pages_total.labels(name).set(s.pages_total)
        m.rank_host_lookup.labels(name).set(s.host_cache_lookup_tokens)
        m.rank_host_hits.labels(name).set(s.host_cache_hit_tokens)
        if rank.role in PD_ROLES:
            m.rank_handoffs.labels(name).set(s.handoffs)
            m.rank_handoff_pages.labels(name).set(s.handoff_pages_used)
            m.rank_transfer_bytes.labels(name).set(s.transfer_bytes)
            m.rank_transfer_seconds.labels(name).set(s.transfer_seconds)

    def _fail(self, sub_id: str, failure: Failure) -> None:
        """Fail a sub-request; every live rank still holding it gets Abort (idempotent there)."""
        p = self.pending.pop(sub_id, None)
        if p is not None:
            self._abort_on_ranks(sub_id, p)
            p.queue.put_nowait((p.index, failure))

    # ---- liveness --------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            now = time.monotonic()
            for rank, reason in self.registry.find_dead(now, self.cfg.rank_timeout_s):
                self._rank_died(rank, reason)
            ping = Ping(time.time())
            for rank in self.registry.live():
                self._send(rank, ping)
            for rank in self.registry.ranks.values():
                self.metrics.rank_up.labels(rank.name, rank.role).set(1 if rank.live else 0)
                self.metrics.rank_inflight.labels(rank.name).set(len(rank.inflight))
            await asyncio.sleep(self.cfg.heartbeat_interval_s)

    def _rank_died(self, rank: Rank, reason: str) -> None:
        if rank.state == DEAD:
            return
        lost = self.registry.mark_dead(rank, reason)
        log.error("rank %s is dead: %s; moving or failing its %d requests", rank.name, reason, len(lost))
        for sid in lost:
            p = self.pending.get(sid)
            if p is not None and not self.migrator.move(sid, p, rank, reason):
                self._fail(sid, Failure(500, f"rank {rank.name} died while serving this request ({reason})"))
        if rank.role in PD_ROLES:
            self._broadcast_peers()

    def _broadcast_peers(self) -> None:
        """Tell every live PD rank who the live PD ranks are (and where decode ranks listen)."""
        live = [r for r in self.registry.live() if r.role in PD_ROLES]
        msg = Peers([PeerInfo(r.name, r.role, r.hello.peer_addr if r.hello else "") for r in live])
        for r in live:
            self._send(r, msg)
