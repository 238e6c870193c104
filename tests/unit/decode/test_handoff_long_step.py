"""A decode rank's step longer than a handoff lease (prompts the router placed on it, in
float32 on a shared core): between the step's layers the rank takes the Handoffs that arrived
and renews what it holds (decode/rank.py DecodeLoop.between_layers). The Pair of
test_handoff_loops.py: real tiny engines, a fake transfer backend and router link."""
from __future__ import annotations

from cluster.protocol.prefill_decode import Renew
from cluster.protocol.router_rank import Abort
from rank_runtime.peer_link import PeerMessage
from tests.unit.decode.test_handoff_loops import PEERS, PREFILL_ID, Pair
from tests.unit.engine.test_engine_tiny import _prompts


def _run_out(*pairs: Pair) -> None:
    """Turn each pair until its requests finish and it holds nothing (40 turns at most)."""
    for p in pairs:
        for _ in range(40):
            p.turn()
            if p.finished() and p.idle():
                break


def test_a_step_longer_than_the_lease_takes_handoffs_and_renews_them_between_its_layers(tiny_model_dir):
    """A decode rank's step can outlast a lease (prompts the router placed on it, in float32 on
    a shared core). Between its layers it takes the Handoffs that arrived and renews what it
    holds, so nothing fails; every other message waits for the step's end, in order, and so
    does a Handoff behind one that is not a Generate or an Abort."""
    pair = Pair(tiny_model_dir("llama"), lease_s=3.0)
    ref = Pair(tiny_model_dir("llama"))
    try:
        prompt = _prompts((37,))[0]
        for p in (pair, ref):
            for rid in "ab":
                p.generate(rid, prompt)
        ref.generate("c", prompt)
        for _ in range(20):
            pair.turn(deliver=False)
            if len(pair.handoffs) == 2:
                break
        ha, hb = pair.handoffs
        dec = pair.decode
        dec.link.inbox.put(PeerMessage(PREFILL_ID, ha, pair.clock()))
        dec.link.inbox.put(Abort("nobody"))
        dec.link.inbox.put(PeerMessage(PREFILL_ID, hb, pair.clock()))
        dec.between_layers()  # "a" and "b" join the queue; the Abort waits
        assert dec.receiver.holds("a") and dec.receiver.holds("b") and dec.deferred == [Abort("nobody")]
        for _ in range(40):  # one step of 12 s (four leases), a layer each 0.3 s
            pair.clock.advance(0.3)
            dec.between_layers()
        for dest, msg in dec.link.take_peer():  # the Renews reach the prefill rank after the step
            pair.prefill.link.inbox.put(PeerMessage(b"decode-0", msg))
        pair.generate("c", prompt)
        for _ in range(20):
            pair.turn(deliver=False)
            if len(pair.handoffs) == 3:
                break
        hc = pair.handoffs[2]
        dec.link.inbox.put(PEERS)
        dec.link.inbox.put(PeerMessage(PREFILL_ID, hc, pair.clock()))  # behind Peers: waits
        dec.between_layers()
        assert dec.deferred == [PEERS, PeerMessage(PREFILL_ID, hc, pair.clock())] and not dec.receiver.holds("c")
        _run_out(pair, ref)
        assert not pair.errors() and pair.sender.released == 3 and not dec.deferred
        assert pair.tokens() == ref.tokens() and len(pair.tokens()["a"]) == 10
    finally:
        pair.close()
        ref.close()


def test_a_handoff_waiting_behind_peers_through_a_long_step_is_renewed_and_pulled(tiny_model_dir):
    """A Handoff that arrives mid-step behind a Peers (a membership change) waits for the step's
    end; through a step of four leases the rank renews it as it waits, so the prefill rank keeps
    the KV and the rank's own lease count starts from the last Renew: nothing fails, and the
    tokens equal those of a pair that took the handoff at once."""
    pair = Pair(tiny_model_dir("llama"), lease_s=3.0)
    ref = Pair(tiny_model_dir("llama"))
    try:
        prompt = _prompts((37,))[0]
        for p in (pair, ref):
            p.generate("a", prompt)
        for _ in range(20):
            pair.turn(deliver=False)
            if pair.handoffs:
                break
        dec, (ha,) = pair.decode, pair.handoffs
        waiting = PeerMessage(PREFILL_ID, ha, pair.clock())
        dec.link.inbox.put(PEERS)
        dec.link.inbox.put(waiting)
        for _ in range(40):  # one step of 12 s, a layer each 0.3 s
            dec.between_layers()
            pair.clock.advance(0.3)
        assert dec.deferred == [PEERS, waiting] and not dec.receiver.holds("a")
        renews = [msg for dest, msg in dec.link.take_peer()]
        assert len(renews) >= 4 and all(m == Renew(["a"]) for m in renews)
        for msg in renews:  # they reach the prefill rank as they are sent
            pair.prefill.link.inbox.put(PeerMessage(b"decode-0", msg))
            pair.prefill.run_once()
        _run_out(pair, ref)
        assert not pair.errors() and pair.sender.released == 1 and not dec.deferred
        assert pair.tokens() == ref.tokens() and len(pair.tokens()["a"]) == 10
    finally:
        pair.close()
        ref.close()


def test_a_handoff_taken_between_layers_starts_its_read_and_joins_the_next_step(tiny_model_dir):
    """A Handoff that arrives while the decode rank steps starts its read between the step's
    layers (reads complete only when the fake backend is told, here: during the step), so the
    step's end commits it and the next step already decodes it; the tokens are those of a pair
    that took the handoff between steps."""
    pair = Pair(tiny_model_dir("llama"), auto=False)
    ref = Pair(tiny_model_dir("llama"))
    try:
        prompt = _prompts((37,))[0]
        for p in (pair, ref):
            p.generate("a", prompt)
        for _ in range(20):  # "a" handed off and decoding
            pair.turn()
            pair.dec_backend.complete()
            if pair.decode.engine.has_unfinished():
                break
        pair.generate("b", prompt)
        for _ in range(20):
            pair.turn(deliver=False)
            pair.dec_backend.complete()
            if len(pair.handoffs) == 2:
                break
        dec, hb = pair.decode, pair.handoffs[1]
        reads = len(pair.dec_backend.reads)
        dec.link.inbox.put(PeerMessage(PREFILL_ID, hb, pair.clock()))
        dec.between_layers()  # within a step of "a"
        assert "b" in dec.receiver.pulling and len(pair.dec_backend.reads) == reads + 1
        pair.dec_backend.complete()  # the read ends before the step does
        before = len(pair.tokens().get("b", []))
        dec.run_once()  # the step's end commits "b"; this step decodes it
        assert len(pair.tokens()["b"]) == before + 1
        ref.generate("b", prompt)
        for p in (pair, ref):
            for _ in range(60):
                p.turn()
                p.dec_backend.complete()
                if len(p.finished()) == 2 and p.idle():
                    break
        assert not pair.errors() and pair.tokens() == ref.tokens() and len(pair.tokens()["b"]) == 10
    finally:
        pair.close()
        ref.close()
