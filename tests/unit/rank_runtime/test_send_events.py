"""A step's token events leave as one TokenBatch, but each carrying prompt logprobs (up to
protocol.MAX_PROMPT_LOGPROB_ENTRIES entries) in a frame of its own, under the frame limit."""
from __future__ import annotations

from types import SimpleNamespace

import msgspec

from cluster.protocol import MAX_FRAME_BYTES, MAX_PROMPT_LOGPROB_ENTRIES
from cluster.protocol.rank_router import PromptLogprobs, TokenBatch, TokenEvent
from rank_runtime.loop import RankLoop


def test_prompt_logprob_events_travel_in_frames_of_their_own():
    sent = []
    fake = SimpleNamespace(link=SimpleNamespace(send=sent.append))
    plp = PromptLogprobs([-1.5], [3], [[7]], [[-0.25]])
    events = [TokenEvent("a", [1], "x"), TokenEvent("b", [2], "y", prompt_logprobs=plp), TokenEvent("c", [3], "z"),
              TokenEvent("d", [4], "w", prompt_logprobs=plp)]
    RankLoop.send_events(fake, events, 1.0)
    assert [[e.request_id for e in b.events] for b in sent] == [["b"], ["d"], ["a", "c"]]
    sent.clear()
    RankLoop.send_events(fake, events[:1], 1.0)
    assert [[e.request_id for e in b.events] for b in sent] == [["a"]]


def test_the_largest_prompt_logprobs_fit_a_frame():
    """MAX_PROMPT_LOGPROB_ENTRIES entries at k = 20, with ids and logprobs as wide as msgpack writes them."""
    k = 20
    n = MAX_PROMPT_LOGPROB_ENTRIES // (k + 1)
    plp = PromptLogprobs([-1.234567] * n, [2**31 - 1] * n, [[2**31 - 1] * k] * n, [[-1.234567] * k] * n)
    frame = msgspec.msgpack.encode(TokenBatch([TokenEvent("r" * 64, [1], "x", prompt_logprobs=plp)], 1.0))
    assert len(frame) < MAX_FRAME_BYTES
