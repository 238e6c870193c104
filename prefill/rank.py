"""A prefill rank (PD mode): runs prompts only, hands their KV to the decode rank the router named.

    python -m prefill.rank --index 0 --router-addr tcp://127.0.0.1:5555 [--host H] [--transfer auto]
                           [--handoff-lease-s 10] [--handoff-pool-gb 0.25] [engine flags]

Request life cycle on a prefill rank:
  1. Generate (with decode_rank) arrives through the router link; it waits in `_held` until
     the handoff pool has room for all its pages (backpressure: a pool full of KV that decode
     ranks have not pulled yet holds new prompts back), then HandoffSender.reserve() takes them.
  2. engine.add_request(prefill_only=True): chunked, batched prefill with the other prompts,
     prefix hits from the host cache when it is on.
  3. The step that samples the first token runs the engine's export_kv hook, which only takes
     the prompt's device pages and SWA slot out of the sequence (HandoffSender.take): that
     step does no more work than a colocated rank's.
  4. The first token goes to the router at once (TokenEvent without finish_reason: the
     client's first token waits for neither the staging copy nor the transfer). Then the
     taken device pages (the partial last one too) and SWA rings are copied into the
     reserved pages and freed (HandoffSender.stage), and the Handoff goes to the decode
     rank; the lease starts. Both happen before the engine's next step. A request that ends
     at its first token (eos, max_tokens=1, a stop string) finishes here instead and never
     reaches a decode rank.
  5. Pulled / PullFailed from the decode rank releases the pins; its Renew (every third of
     the lease while it holds the handoff, e.g. queued on a full rank) extends the lease.
     Without any of them within the lease, the pins are released anyway and the request
     fails at the router (RequestError 504: the decode rank died or went silent). A decode rank leaving the router's Peers, or refusing our PeerHello, fails and
     releases its handoffs at once. Every release happens exactly once (handoff_sender.py).
  6. Abort: held -> dropped; prefilling -> engine.abort and release; handed off -> nothing
     here (the decode rank answers the Handoff with PullFailed or Pulled).
The prefill rank keeps prefilling other prompts while decode ranks read from its pool: a read
never involves this process's threads (NIXL's progress thread, or the shm file).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque

import msgspec

from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.prefill_decode import (Handoff, PeerHello, PeerReject, PeerWelcome, PrefillTimes,
                                               Pulled, PullFailed, Renew)
from cluster.protocol.rank_router import RequestError
from cluster.protocol.router_rank import Abort, Generate, Peers
from prefill.handoff_sender import HandoffSender
from rank_runtime.loading import make_transfer
from rank_runtime.loop import RankLoop
from rank_runtime.peer_link import PeerMessage, PeerSockets
from rank_runtime.router_link import RankLink
from rank_runtime.serve import hello_for, serve, start_role

log = logging.getLogger("prefill.rank")


class PrefillLoop(RankLoop):
    def __init__(self, engine, sender: HandoffSender) -> None:
        self.sender = sender
        engine.export_kv = sender.take
        self._held: deque[Generate] = deque()  # waiting for handoff-pool room
        self._gen: dict[str, Generate] = {}  # in the engine: what the Handoff needs
        self._started: dict[str, float] = {}  # request id -> prefill start (wall clock)
        self._live_decode: set[str] = set()
        self._rejected: dict[str, str] = {}  # decode rank name -> why it refused us
        self._t_step = time.time()
        super().__init__(engine)

    def extra_stats(self) -> dict:
        return {"handoff_pages_used": self.sender.pages_used, "handoffs": self.sender.num_handed_off}

    # ---- messages ---------------------------------------------------------------------------
    def on_message(self, msg) -> None:
        if isinstance(msg, Generate):
            self._on_generate(msg)
        elif isinstance(msg, Abort):
            self._on_abort(msg.request_id)
        elif isinstance(msg, Peers):
            self._on_peers(msg)
        elif isinstance(msg, PeerMessage):
            self._on_peer(msg.sender.decode(), msg.msg)

    def _on_generate(self, msg: Generate) -> None:
        rid = msg.request_id
        if msg.decode_rank < 0:
            self.link.send(RequestError(rid, 500, "a prefill rank needs Generate.decode_rank (PD mode)"))
        elif not self.sender.fits_ever(len(msg.prompt_ids)):
            self.link.send(RequestError(rid, 400, f"prompt of {len(msg.prompt_ids)} tokens does not fit this "
                                                  "prefill rank's handoff pool; raise --handoff-pool-gb"))
        else:
            self.arrived[rid] = time.time()
            self._held.append(msg)
            self._admit_held()

    def _admit_held(self) -> None:
        needs_state = bool(self.engine.pool.swa_layers)
        while self._held:
            msg = self._held[0]
            rid = msg.request_id
            try:
                if not self.sender.reserve(rid, len(msg.prompt_ids), needs_state):
                    return
            except ValueError as e:
                self._held.popleft()
                self.link.send(RequestError(rid, 400, str(e)))
                continue
            self._held.popleft()
            from engine.sampling_params import SamplingParams

            try:
                params = SamplingParams(**msgspec.structs.asdict(msg.sampling))
                self.engine.add_request(rid, msg.prompt_ids, params, prefill_only=True)
            except ValueError as e:
                self.sender.release(rid, "invalid request")
                self.forget(rid)
                self.link.send(RequestError(rid, 400, str(e)))
                continue
            self._gen[rid] = msg

    def _on_abort(self, rid: str) -> None:
        for msg in self._held:
            if msg.request_id == rid:
                self._held.remove(msg)
                self.forget(rid)
                return
        if self.engine.abort(rid) is not None:
            self.sender.release(rid, "aborted while prefilling")
            self.forget(rid)
        # Handed off: the decode rank answers the Handoff (PullFailed or Pulled); the lease covers silence.

    def drop_all(self, why: str) -> None:
        rids = [m.request_id for m in self._held] + list(self.engine.seqs)
        for rid in rids:
            self._on_abort(rid)  # handed-off KV stays pinned until Pulled/PullFailed or its lease
        log.warning("dropped %d request(s): %s", len(rids), why)

    def _on_peers(self, msg: Peers) -> None:
        self._live_decode = {p.name for p in msg.peers if p.role == "decode"}
        for name in list(self._rejected):
            if name not in self._live_decode:
                del self._rejected[name]
        for rid in list(self.sender.entries):
            if self.sender.is_handed_off(rid) and self.sender.entries[rid].peer.decode() not in self._live_decode:
                self.sender.release(rid, "decode rank gone")  # the router failed the request already
        for rid, g in list(self._gen.items()):
            if f"decode-{g.decode_rank}" not in self._live_decode:
                self._on_abort(rid)
        for g in list(self._held):
            if f"decode-{g.decode_rank}" not in self._live_decode:
                self._on_abort(g.request_id)

    def _on_peer(self, name: str, msg) -> None:
        if isinstance(msg, Renew):
            self.sender.renew(msg.request_ids, name.encode())
        elif isinstance(msg, (Pulled, PullFailed)):
            if not self.sender.release(msg.request_id, "pulled" if isinstance(msg, Pulled) else msg.reason) \
                    and isinstance(msg, Pulled):
                log.warning("%s pulled %s after its lease ran out", name, msg.request_id)
        elif isinstance(msg, PeerWelcome):
            log.info("decode peer %s accepted this rank", msg.name)
        elif isinstance(msg, PeerReject):
            log.error("decode peer %s refused this rank: %s", msg.name, msg.reason)
            self._rejected[msg.name] = msg.reason
            for rid in self.sender.handed_to(msg.name.encode()):
                self.sender.release(rid, "peer refused")
                self.link.send(RequestError(rid, 500, f"{msg.name} refused this prefill rank: {msg.reason}"))

    # ---- between steps ------------------------------------------------------------------------
    def between_steps(self) -> None:
        self._admit_held()
        for rid in self.sender.expired():
            self.sender.release(rid, "lease expired")
            self.link.send(RequestError(rid, 504, f"the decode rank did not pull this request's KV within the "
                                                  f"{self.sender.lease_s:.1f}s lease"))
        self._t_step = time.time()

    def on_outputs(self, outs) -> None:
        for rid in self.arrived.keys() - self._started.keys():
            seq = self.engine.seqs.get(rid)
            if seq is None or seq.num_computed > 0:
                self._started[rid] = self._t_step
        if not outs:
            return
        events, handoffs = [], []
        now = time.time()
        for o in outs:
            rid = o.request_id
            if o.finished and o.finish_reason is None and o.kv_export is not None:
                handoffs.append((o, self.phase_times(rid, now), self._gen.pop(rid)))
                events.append(msgspec.structs.replace(self.token_event(o), times=None))  # _event forgets rid
            else:
                if o.finished:
                    self.sender.release(rid, "finished at its first token")
                    self._gen.pop(rid, None)
                events.append(self.token_event(o))
        self.send_events(events, now)
        for o, t, g in handoffs:
            self._hand_off(o, t, g)
        self.yield_after_first(events)

    def _hand_off(self, o, t, g: Generate) -> None:
        rid = o.request_id
        peer = f"decode-{g.decode_rank}"
        if peer in self._rejected or peer not in self._live_decode:
            self.sender.release(rid, "no decode peer")
            why = self._rejected.get(peer, "it is not live")
            self.link.send(RequestError(rid, 500, f"cannot hand off to {peer}: {why}"))
            return
        staged = o.kv_export
        self.sender.stage(rid)  # the first token is out: now copy the KV into the handoff pool
        times = PrefillTimes(t.arrived, t.prefill_start, t.first_token, time.time())
        self.link.send_peer(peer.encode(), Handoff(rid, g.prompt_ids, o.new_token_ids[0], g.sampling,
                                                   o.cached_tokens, staged.pages, staged.state,
                                                   self.sender.lease_s, times))
        self.sender.hand_off(rid, peer.encode())

    def phase_times(self, rid: str, now: float):
        t = super().phase_times(rid, now)
        return msgspec.structs.replace(t, prefill_start=self._started.get(rid, t.arrived))

    def forget(self, rid: str) -> None:
        super().forget(rid)
        self._started.pop(rid, None)
        self._gen.pop(rid, None)

    def fail_all(self, message: str) -> None:
        for rid in list(self.engine.seqs):
            self.sender.release(rid, "engine failure")
        for rid in self.sender.taken():  # the failed step took its KV, then lost its output
            self.sender.release(rid, "engine failure")
            self.forget(rid)
            self.link.send(RequestError(rid, 500, message))
        super().fail_all(message)


def main(argv: list[str] | None = None) -> int:
    cfg, handoff, engine_cfg, engine = start_role(argv, __doc__, "prefill", "prefill.rank")
    sender = HandoffSender.for_engine(engine, handoff.handoff_pool_gb, handoff.handoff_lease_s, cfg.name)
    backend = make_transfer(handoff, cfg)
    sender.register(backend)
    peer_hello = PeerHello(PROTOCOL_VERSION, cfg.name, os.getpid(), backend.kind, backend.metadata())
    peers = PeerSockets("prefill", cfg.name, cfg.host, peer_hello, secret=cfg.secret)
    loop = PrefillLoop(engine, sender)
    link = RankLink(cfg, hello_for(cfg, engine_cfg, engine), loop.stats, peers)
    return serve(cfg, engine, loop, link, closers=(backend.close, sender.close))


if __name__ == "__main__":
    sys.exit(main())
