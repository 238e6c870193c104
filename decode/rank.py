"""A decode rank (PD mode): decodes requests whose prompt KV it pulls from prefill ranks.

    python -m decode.rank --index 0 --router-addr tcp://127.0.0.1:5555 [--host H] [--transfer auto]
                          [--handoff-wait-s 120] [engine flags]

Requests arrive as Handoffs from prefill ranks: handoff_receiver.py queues them, pulls their KV
when the engine has room and commits them (its docstring has the steps); then they run as on
a colocated rank (rank_runtime/loop.py, steps 3-6), the prefill rank's phase times and the
pull's carried into the last event. A Generate (decode_rank -1: the router's --disagg placed the
prompt here) runs steps 1-6 as on a colocated rank, its chunks in the same steps as the
handed-off decodes. Start-up and exit: rank_runtime/serve.py.
"""
from __future__ import annotations

import logging
import queue
import sys

from cluster.protocol.prefill_decode import PAGES_REGION, STATES_REGION, Handoff, PeerHello
from cluster.protocol.rank_router import PhaseTimes, RequestError
from cluster.protocol.router_rank import Abort, Generate, Peers
from decode.handoff_receiver import HandoffReceiver
from rank_runtime.faults import faults_for
from rank_runtime.loading import make_transfer
from rank_runtime.loop import IDLE_WAIT_S, RankLoop
from rank_runtime.peer_link import PeerMessage, PeerSockets
from rank_runtime.router_link import RankLink
from rank_runtime.serve import hello_for, serve, start_role

log = logging.getLogger("decode.rank")

PULL_POLL_S = 0.001  # inbox wait while only transfers are in flight


class DecodeLoop(RankLoop):
    """Decode rank: requests arrive as Handoffs, their KV pulled by a HandoffReceiver, or as a
    Generate the rank prefills itself (conditional disaggregation, pd_server/disagg.py)."""

    def __init__(self, engine, backend, name: str, wait_s: float, delay_pull_s: float = 0.0,
                 keep_prompts: bool = False) -> None:
        self.receiver = HandoffReceiver(engine, backend, name, wait_s,
                                        send_peer=lambda dest, msg: self.link.send_peer(dest, msg),
                                        send_router=lambda msg: self.link.send(msg), delay_pull_s=delay_pull_s,
                                        keep_prompts=keep_prompts)
        self._pd: dict = {}  # request id -> handoff_receiver.Committed
        super().__init__(engine)

    def extra_stats(self) -> dict:
        r = self.receiver
        return {"handoffs": r.num_handoffs, "transfer_bytes": r.transfer_bytes,
                "transfer_seconds": r.transfer_seconds, "handoff_pulled_tokens": r.pulled_tokens,
                "handoff_reused_tokens": r.reused_tokens}

    def wait_s(self) -> float:
        if self.engine.has_unfinished():
            return 0.0
        return PULL_POLL_S if self.receiver.num_handoffs else IDLE_WAIT_S

    def on_message(self, msg) -> None:
        r = self.receiver
        if isinstance(msg, PeerMessage):
            if isinstance(msg.msg, Handoff):
                r.on_handoff(msg.sender, msg.msg, msg.received)
            elif isinstance(msg.msg, PeerHello):
                r.on_peer_hello(msg.sender, msg.msg)
        elif isinstance(msg, Abort):
            if not r.on_abort(msg.request_id):
                self.abort(msg.request_id)
        elif isinstance(msg, Peers):
            r.on_live_prefill({p.name for p in msg.peers if p.role == "prefill"})
        elif isinstance(msg, Generate):
            if msg.decode_rank >= 0:
                self.link.send(RequestError(msg.request_id, 500, "a decode rank prefills a Generate itself: it "
                                                                 "hands nothing off (decode_rank must be -1)"))
            elif r.holds(msg.request_id):
                self.link.send(RequestError(msg.request_id, 500, "request id already on this decode rank"))
            else:
                self.admit_generate(msg)

    def drop_all(self, why: str) -> None:
        self.receiver.drop_all(why)
        super().drop_all(why)

    def between_layers(self) -> None:
        """Within a step: Handoffs that arrived meanwhile join the receiver's queue and their
        reads start where there is room (the read runs beside the step, and the request joins
        the next step: a PD request's second token comes a step sooner), and the leases due are
        renewed, so a step longer than a lease (several prompts the router placed here, in
        float32 on a shared core) fails no handoff. Every other message waits for the step's
        end, in order, and so does a Handoff behind one that is not a Generate or an Abort (a
        PeerHello, Peers or RouterLost may change what it means); such a Handoff is renewed
        while it waits (HandoffReceiver.renew_waiting)."""
        super().between_layers()
        inbox = None if self.link is None else self.link.inbox
        while inbox is not None and not inbox.empty():  # (no exception raised a layer when empty)
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                break
            if (isinstance(msg, PeerMessage) and isinstance(msg.msg, Handoff)
                    and all(isinstance(m, (Generate, Abort)) for m in self.deferred)):
                self.receiver.on_handoff(msg.sender, msg.msg, msg.received)
            else:
                self.deferred.append(msg)
        self.receiver.renew_due()
        if self.deferred:  # (this runs between every two layers: nothing to do is the common case)
            self.receiver.renew_waiting([(m.sender, m.msg, m.received) for m in self.deferred
                                         if isinstance(m, PeerMessage) and isinstance(m.msg, Handoff)])
        self.receiver.start_queued()

    def between_steps(self) -> None:
        for c in self.receiver.progress():
            self._pd[c.request_id] = c

    def phase_times(self, rid: str, now: float) -> PhaseTimes:
        c = self._pd.get(rid)
        if c is None:
            return super().phase_times(rid, now)
        p = c.prefill
        return PhaseTimes(p.arrived, p.first_token, now, p.prefill_start, p.handoff_sent, c.pull_start,
                          c.pull_end, self.first_token_at.get(rid, now))

    def forget(self, rid: str) -> None:
        super().forget(rid)
        self._pd.pop(rid, None)


def main(argv: list[str] | None = None) -> int:
    cfg, handoff, engine_cfg, engine = start_role(argv, __doc__, "decode", "decode.rank")
    backend = make_transfer(handoff, cfg)
    pool = engine.pool
    backend.register(PAGES_REGION, pool.full, pool.full[0].numel() * pool.full.element_size())
    if pool.num_slots:
        backend.register(STATES_REGION, pool.swa, pool.swa[0].numel() * pool.swa.element_size())
    peers = PeerSockets("decode", cfg.name, cfg.host, secret=cfg.secret)
    loop = DecodeLoop(engine, backend, cfg.name, handoff.handoff_wait_s, faults_for(cfg.name).delay_pull_s,
                      handoff.decode_keep_prompts)
    link = RankLink(cfg, hello_for(cfg, engine_cfg, engine, peers.addr), loop.stats, peers)
    log.info("decode rank: peer socket %s, transfer %s", peers.addr, backend.kind)
    return serve(cfg, engine, loop, link, closers=(backend.close,))


if __name__ == "__main__":
    sys.exit(main())
