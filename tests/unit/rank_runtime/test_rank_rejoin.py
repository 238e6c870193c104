"""A rank that lost its router (--rejoin): RouterLost drops every request on the prefill and the
decode loop, in every phase, frees their pages and tells the old router nothing."""
from __future__ import annotations

from rank_runtime.router_link import RouterLost
from tests.unit.decode.test_handoff_loops import Pair
from tests.unit.engine.test_engine_tiny import _prompts


def test_router_lost_drops_requests_in_every_phase_and_frees_their_pages(tiny_model_dir):
    pair = Pair(tiny_model_dir("llama"), auto=False)
    try:
        prompt = _prompts((37,))[0]
        pair.generate("pulling", prompt)
        for _ in range(10):
            pair.turn()
            if pair.decode.receiver.pulling:
                break
        assert pair.decode.receiver.pulling
        pair.generate("prefilling", prompt)
        pair.turn()
        assert "prefilling" in pair.prefill.engine.seqs and pair.sender.pages_used == 20
        before = len(pair.prefill.link.to_router) + len(pair.decode.link.to_router)
        for loop in (pair.prefill, pair.decode):
            loop.link.inbox.put(RouterLost("router gone"))
        pair.turn()
        assert not pair.prefill.engine.has_unfinished() and pair.sender.pages_used == 10  # "pulling" stays pinned
        pair.dec_backend.complete()  # the read in flight ends; released as aborted, Pulled to the prefill rank
        pair.turn()
        pair.turn()
        assert pair.idle() and pair.sender.released == 2
        sent = (pair.prefill.link.to_router + pair.decode.link.to_router)[before:]
        assert not [m for m in sent if type(m).__name__ in ("RequestError", "TokenBatch")]  # nothing for the old router
    finally:
        pair.close()
