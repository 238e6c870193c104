"""Scheduler decisions: token budget, chunking, FCFS admission, preemption order, page accounting."""
from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.kv_cache import KVPool
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status

CFG = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 16,
                                "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                "num_key_value_heads": 1})
P = SamplingParams(max_tokens=4)


def _sched(num_pages=16, max_seqs=4, budget=8) -> Scheduler:
    return Scheduler(KVPool(CFG, 4, num_pages, max_seqs, torch.float32, torch.device("cpu")), max_seqs, budget)


def _run(sched: Scheduler, out) -> None:
    """Pretend the step computed what was scheduled (and sampled a token where a prompt completed)."""
    for seq, n in out.scheduled:
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(1)


def test_budget_chunks_prefill_and_decodes_come_first():
    s = _sched(budget=8)
    a, b = Sequence("a", [1] * 6, P), Sequence("b", [1] * 10, P)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 6), ("b", 2)]
    _run(s, out)
    out = s.schedule()  # a decodes (1 token, first), b continues its prompt
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 7)]


def test_fcfs_admission_stops_at_first_that_does_not_fit():
    s = _sched(num_pages=4, budget=64)
    big, small = Sequence("big", [1] * 20, P), Sequence("small", [1] * 2, P)
    s.add(Sequence("first", [1] * 9, P))  # 3 pages
    s.add(big)  # needs 5 pages: does not fit
    s.add(small)  # would fit, but FCFS keeps it behind `big`
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["first"]
    assert list(s.waiting) == [big, small] and s.pool.used_pages == 3


def test_preemption_takes_newest_and_frees_its_pages():
    s = _sched(num_pages=4, budget=64)
    old, new = Sequence("old", [1] * 8, P), Sequence("new", [1] * 8, P)
    s.add(old)
    s.add(new)
    _run(s, s.schedule())  # both admitted: 2 pages each, pool full
    assert s.pool.free_pages == 0
    out = s.schedule()  # old needs a 3rd page for its 9th token -> preempt `new`
    assert out.preempted == [new] and new.status is Status.WAITING and new.num_computed == 0
    assert [q.request_id for q, _ in out.scheduled] == ["old"] and s.waiting[0] is new
    s.finish(old)
    assert s.pool.used_pages == 0


def test_max_num_seqs_caps_running():
    s = _sched(max_seqs=2, budget=64)
    for i in range(3):
        s.add(Sequence(f"r{i}", [1, 2], P))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_prompts_one_after_another_past_pack_tokens():
    """The first prompt chunk takes what the budget allows; further prompts join the step only up
    to pack_tokens prompt tokens in all (short ones still share a step); decodes ride along."""
    s = _sched(num_pages=32, budget=16)
    s.pack_tokens = 4
    a, b, c = Sequence("a", [1] * 6, P), Sequence("b", [1] * 10, P), Sequence("c", [1] * 2, P)
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 6)] and list(s.waiting) == [b, c]
    _run(s, out)
    out = s.schedule()  # a's decode row is no prompt token: b gets its whole prompt; c waits
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 10)] and list(s.waiting) == [c]
    s = _sched(num_pages=32, budget=16)
    s.pack_tokens = 8
    for name, n in (("x", 2), ("y", 3), ("z", 5)):
        s.add(Sequence(name, [1] * n, P))
    out = s.schedule()  # 2 + 3, then z's first 3 tokens: 8 in all
    assert [(q.request_id, n) for q, n in out.scheduled] == [("x", 2), ("y", 3), ("z", 3)]
