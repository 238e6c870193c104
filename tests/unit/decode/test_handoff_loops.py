"""Prefill and decode rank loops wired in one process: real tiny engines, a fake transfer backend
(real bytes), a fake router link. Token equality with colocated (SWA state included), the
prefill rank's pins and lease, aborts in each phase, and a decode rank prefilling a Generate
itself (--disagg) next to handed-off requests.
"""
from __future__ import annotations

import queue
import threading

import pytest

from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.prefill_decode import (
    PAGES_REGION,
    STATES_REGION,
    Handoff,
    PeerHello,
    Pulled,
    PullFailed,
)
from cluster.protocol.rank_router import RequestError, TokenBatch
from cluster.protocol.router_rank import Abort, Generate, PeerInfo, Peers, Sampling
from decode.rank import DecodeLoop
from prefill.handoff_sender import HandoffSender
from prefill.rank import PrefillLoop
from rank_runtime.peer_link import PeerMessage
from tests.fakes import FakeBackend, FakeClock, FakeWorld
from tests.unit.engine.test_engine_tiny import _engine, _prompts

PREFILL_ID = b"prefill-0-1"
PEERS = Peers([PeerInfo("prefill-0", "prefill", ""), PeerInfo("decode-0", "decode", "tcp://x:1")])


class FakeLink:
    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.stopped = threading.Event()
        self.to_router: list = []
        self.to_peer: list[tuple[bytes, object]] = []

    def send(self, msg) -> None:
        self.to_router.append(msg)

    def send_peer(self, dest: bytes, msg) -> None:
        self.to_peer.append((dest, msg))

    def take_peer(self) -> list:
        out, self.to_peer = self.to_peer, []
        return out


class Pair:
    """A prefill loop and a decode loop on tiny engines, messages moved by `turn()`."""

    def __init__(self, path, clock: FakeClock | None = None, lease_s: float = 10.0, auto: bool = True,
                 pool_gb: float = 0.001, wait_s: float = 120.0) -> None:
        self.clock = clock or FakeClock()
        world = FakeWorld()
        pre, dec = _engine(path), _engine(path)
        self.sender = HandoffSender.for_engine(pre, pool_gb, lease_s, "prefill-0")
        self.sender.clock = self.clock
        self.pre_backend = FakeBackend("pre", world)
        self.sender.register(self.pre_backend)
        self.dec_backend = FakeBackend("dec", world, auto=auto)
        self.dec_backend.register(PAGES_REGION, dec.pool.full, 0)
        if dec.pool.num_slots:
            self.dec_backend.register(STATES_REGION, dec.pool.swa, 0)
        self.prefill, self.decode = PrefillLoop(pre, self.sender), DecodeLoop(dec, self.dec_backend, "decode-0", wait_s)
        self.prefill.link, self.decode.link = FakeLink(), FakeLink()
        self.decode.receiver.clock = self.clock
        for loop in (self.prefill, self.decode):
            loop.link.inbox.put(PEERS)
        self.decode.link.inbox.put(PeerMessage(PREFILL_ID, PeerHello(PROTOCOL_VERSION, "prefill-0", 1, "shm",
                                                                     self.pre_backend.metadata())))
        self.handoffs: list[Handoff] = []

    def generate(self, rid: str, prompt: list[int], **sampling) -> None:
        s = Sampling(**{"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, **sampling})
        self.prefill.link.inbox.put(Generate(rid, prompt, s, 0.0, decode_rank=0))

    def turn(self, deliver: bool = True) -> None:
        self.prefill.run_once()
        for _, msg in self.prefill.link.take_peer():
            self.handoffs.append(msg)
            if deliver:
                self.decode.link.inbox.put(PeerMessage(PREFILL_ID, msg, self.clock()))  # received: on this clock
        self.decode.run_once()
        for _, msg in self.decode.link.take_peer():
            self.prefill.link.inbox.put(PeerMessage(b"decode-0", msg))

    def tokens(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for link in (self.prefill.link, self.decode.link):
            for m in link.to_router:
                if isinstance(m, TokenBatch):
                    for ev in m.events:
                        out.setdefault(ev.request_id, []).extend(ev.token_ids)
        return out

    def finished(self) -> dict:
        return {ev.request_id: ev for link in (self.prefill.link, self.decode.link) for m in link.to_router
                if isinstance(m, TokenBatch) for ev in m.events if ev.finish_reason is not None}

    def errors(self) -> list[RequestError]:
        return [m for link in (self.prefill.link, self.decode.link) for m in link.to_router
                if isinstance(m, RequestError)]

    def idle(self) -> bool:
        return (self.sender.pages_used == 0 and not self.prefill.engine.has_unfinished()
                and self.prefill.engine.pool.used_pages == 0 and not self.sender.taken()
                and self.decode.engine.pool.used_pages == 0 and not self.decode.engine.has_unfinished()
                and self.decode.receiver.num_handoffs == 0)

    def close(self) -> None:
        self.sender.close()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pd_pair_equals_colocated(tiny_model_dir, family):
    """gemma3's tiny config has window 8: prompts of 37 and 12 tokens hand their SWA rings over."""
    from engine.sampling_params import SamplingParams

    path = tiny_model_dir(family)
    prompts = _prompts((37, 12, 5))
    colocated = _engine(path).generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    pair = Pair(path)
    try:
        for i, p in enumerate(prompts):
            pair.generate(f"r{i}", p)
        for _ in range(200):
            pair.turn()
            if len(pair.finished()) == len(prompts) and pair.idle():
                break
        got = pair.tokens()
        assert [got[f"r{i}"] for i in range(len(prompts))] == [o.new_token_ids for o in colocated]
        fin = pair.finished()
        assert all(fin[f"r{i}"].completion_tokens == 10 and fin[f"r{i}"].prompt_tokens == len(p)
                   for i, p in enumerate(prompts))
        t = fin["r0"].times
        assert t.arrived <= t.prefill_start <= t.first_token <= t.handoff_sent <= t.pull_start <= t.pull_end
        assert t.pull_end <= t.first_decode <= t.finished
        assert pair.idle() and pair.sender.released == len(prompts) and not pair.errors()
        assert all(h.swa_state >= 0 for h in pair.handoffs) == (family == "gemma3")
    finally:
        pair.close()


def test_lease_expiry_releases_pins_once_and_fails_the_request(tiny_model_dir):
    pair = Pair(tiny_model_dir("llama"), lease_s=3.0)
    try:
        pair.generate("r0", _prompts((37,))[0])
        for _ in range(20):  # the decode rank never gets the Handoff (lost, or its rank hangs)
            pair.turn(deliver=False)
            if pair.handoffs:
                break
        [h] = pair.handoffs
        assert pair.sender.pages_used == len(h.pages) == 10 and pair.sender.num_handed_off == 1
        pair.clock.advance(2.9)
        pair.turn(deliver=False)
        assert pair.sender.pages_used == 10 and not pair.errors()
        pair.clock.advance(0.2)
        pair.turn(deliver=False)
        [err] = pair.errors()
        assert err.request_id == "r0" and err.status == 504 and "lease" in err.message
        assert pair.sender.pages_used == 0 and pair.sender.released == 1
        # A late answer (or two) must not free the pages again.
        pair.prefill.link.inbox.put(PeerMessage(b"decode-0", Pulled("r0")))
        pair.prefill.link.inbox.put(PeerMessage(b"decode-0", PullFailed("r0", "late")))
        pair.turn(deliver=False)
        assert pair.sender.released == 1 and pair.sender.pool.free_pages == pair.sender.pool.num_pages
    finally:
        pair.close()


def test_a_full_decode_rank_renews_the_lease_and_the_request_completes(tiny_model_dir):
    """The decode rank has no room for four leases: its Renews keep the prefill rank's pins;
    nothing fails; once room appears the request decodes the tokens of an unhindered run."""
    pair = Pair(tiny_model_dir("llama"), lease_s=3.0)
    ref = Pair(tiny_model_dir("llama"))
    try:
        prompt = _prompts((37,))[0]
        for p in (pair, ref):
            p.generate("r0", prompt)
        dec = pair.decode.engine
        reserve, dec.reserve_kv = dec.reserve_kv, lambda n: None  # full
        for _ in range(40):  # 12 s of fake time in 0.3 s turns
            pair.clock.advance(0.3)
            pair.turn()
        assert not pair.errors() and pair.sender.num_handed_off == 1 and pair.sender.pages_used == 10
        assert pair.decode.receiver.num_handoffs == 1
        dec.reserve_kv = reserve
        for p in (pair, ref):
            for _ in range(40):
                p.turn()
                if p.finished() and p.idle():
                    break
        assert pair.tokens()["r0"] == ref.tokens()["r0"] and len(pair.tokens()["r0"]) == 10
        assert pair.idle() and not pair.errors() and pair.sender.released == 1
    finally:
        pair.close()
        ref.close()


def test_abort_while_prefilling_and_while_pulling_frees_both_sides(tiny_model_dir):
    pair = Pair(tiny_model_dir("llama"), auto=False)
    try:
        prompt = _prompts((37,))[0]  # 3 prefill chunks of 16
        pair.generate("a", prompt)
        pair.turn()
        assert pair.sender.pages_used == 10 and pair.prefill.engine.has_unfinished()
        pair.prefill.link.inbox.put(Abort("a"))
        pair.decode.link.inbox.put(Abort("a"))
        pair.turn()
        assert pair.idle() and not pair.handoffs and not pair.errors()

        pair.generate("b", prompt)
        for _ in range(10):
            pair.turn()
            if pair.decode.receiver.pulling:
                break
        assert pair.decode.receiver.pulling and pair.decode.engine.pool.used_pages == 10
        pair.prefill.link.inbox.put(Abort("b"))  # handed off: the prefill rank waits for the answer
        pair.decode.link.inbox.put(Abort("b"))
        pair.turn()
        assert pair.sender.pages_used == 10
        pair.dec_backend.complete()
        pair.turn()
        pair.turn()
        assert pair.idle() and pair.sender.released == 2 and not pair.errors()
        assert pair.tokens()["b"] and "b" not in pair.finished()  # only the first token was streamed
    finally:
        pair.close()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_rank_prefills_a_generate_itself_next_to_handoffs(tiny_model_dir, family):
    """Prompts of 37 and 12 tokens prefilled in chunks of 16 on the decode rank, in the same
    steps as a handed-off request's decodes: the same tokens as colocated."""
    from engine.sampling_params import SamplingParams

    path = tiny_model_dir(family)
    prompts = _prompts((37, 37, 12))
    colocated = _engine(path).generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    pair = Pair(path)
    try:
        s = Sampling(max_tokens=10, temperature=0.0, ignore_eos=True)
        pair.generate("h", prompts[0])  # through the prefill rank
        for _ in range(6):  # until it decodes on the decode rank
            pair.turn()
        assert "h" in pair.decode.engine.seqs
        for i in (1, 2):
            pair.decode.link.inbox.put(Generate(f"l{i}", prompts[i], s, 0.0))
        pair.decode.link.inbox.put(Generate("bad", prompts[2], s, 0.0, decode_rank=0))
        for _ in range(200):
            pair.turn()
            if len(pair.finished()) == 3 and pair.idle():
                break
        got = pair.tokens()
        assert [got["h"], got["l1"], got["l2"]] == [o.new_token_ids for o in colocated]
        fin = pair.finished()
        t = fin["l1"].times
        assert t.arrived <= t.first_token <= t.finished and t.handoff_sent == t.pull_start == 0.0
        assert (fin["l1"].prompt_tokens, fin["l1"].completion_tokens) == (37, 10)
        assert [(e.request_id, e.status) for e in pair.errors()] == [("bad", 500)]
        assert not pair.prefill.engine.seqs and len(pair.handoffs) == 1  # the prefill rank saw only "h"
        # Abort while prefilling there and while decoding: the pages come back at once.
        pair.decode.link.inbox.put(Generate("a", prompts[0], s, 0.0))
        pair.decode.link.inbox.put(Generate("b", prompts[2], s, 0.0))
        pair.turn()
        assert pair.decode.engine.pool.used_pages > 0
        pair.decode.link.inbox.put(Abort("a"))
        for _ in range(4):
            pair.turn()
        assert "b" in pair.decode.engine.seqs and pair.tokens()["b"]
        pair.decode.link.inbox.put(Abort("b"))
        pair.turn()
        assert pair.idle() and "a" not in pair.finished() and "b" not in pair.finished()
    finally:
        pair.close()


def test_full_handoff_pool_holds_prompts_back(tiny_model_dir):
    page_bytes = 3 * 2 * 4 * 2 * 16 * 4  # tiny llama: layers, k/v, page_size, kv heads, head_dim, fp32
    pair = Pair(tiny_model_dir("llama"), pool_gb=12 * page_bytes / 2**30)
    try:
        assert pair.sender.pool.num_pages == 12
        prompt = _prompts((37,))[0]  # 10 pages: the second prompt waits for the first's pins
        pair.generate("a", prompt, max_tokens=3)
        pair.generate("b", prompt, max_tokens=3)
        pair.turn(deliver=False)
        assert [g.request_id for g in pair.prefill._held] == ["b"] and "b" not in pair.prefill.engine.seqs
        for _ in range(10):
            pair.turn(deliver=False)
        assert [g.request_id for g in pair.prefill._held] == ["b"]  # a is handed off, still pinned
        for h in pair.handoffs:
            pair.decode.link.inbox.put(PeerMessage(PREFILL_ID, h, pair.clock()))
        for _ in range(40):
            pair.turn()
            if len(pair.finished()) == 2 and pair.idle():
                break
        assert pair.tokens()["a"] == pair.tokens()["b"] and len(pair.tokens()["b"]) == 3
        assert pair.idle() and not pair.errors()
    finally:
        pair.close()


def test_first_token_leaves_before_the_staging_copy(tiny_model_dir):
    """The step that samples the first token copies nothing into the handoff pool: the token
    is sent first, then the KV is staged, then the Handoff goes out."""
    pair = Pair(tiny_model_dir("llama"))
    order: list[str] = []
    stage, send = pair.sender.stage, pair.prefill.link.send

    def staging(rid: str) -> None:
        order.append("stage")
        stage(rid)

    def sending(msg) -> None:
        if isinstance(msg, TokenBatch):
            order.append("token")
        send(msg)

    pair.sender.stage, pair.prefill.link.send = staging, sending
    try:
        pair.generate("a", _prompts((37,))[0])
        for _ in range(10):
            pair.turn(deliver=False)
            if pair.handoffs:
                break
        assert order == ["token", "stage"] and len(pair.handoffs) == 1
        assert pair.prefill.engine.pool.used_pages == 0 and not pair.sender.taken()
    finally:
        pair.close()


def test_a_step_failing_after_the_kv_was_taken_frees_it_and_fails_the_requests(tiny_model_dir):
    """Two prompts finish prefill in one step; the export of the second raises after the first
    one's device pages were taken: both fail with 500 and every page comes back once."""
    pair = Pair(tiny_model_dir("llama"))
    take = pair.sender.take

    def failing(seq, kv):
        if seq.request_id == "b":
            raise RuntimeError("export failed")
        return take(seq, kv)

    pair.prefill.engine.export_kv = failing
    try:
        a, b = _prompts((6, 6))
        pair.generate("a", a)
        pair.generate("b", b)
        pair.turn(deliver=False)
        assert sorted((e.request_id, e.status) for e in pair.errors()) == [("a", 500), ("b", 500)]
        assert not pair.handoffs and pair.idle() and pair.sender.released == 2
        assert pair.prefill.engine.pool.free_pages == pair.prefill.engine.pool.num_pages
    finally:
        pair.close()
