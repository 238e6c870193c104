"""bench/bench_kv_reuse.py's workload and reuse ceiling: sessions grow turn by turn from a shared
agent prompt, and the ceiling counts exactly the whole pages an earlier prompt shared; a server
that never answers cannot hold the replay past its grace."""
from __future__ import annotations

import asyncio

import httpx

import bench.bench_kv_reuse as kv
from bench.bench_kv_reuse import PAGE, Ceiling, Workload


def test_sessions_extend_their_last_turn_and_share_their_agents_prompt():
    w = Workload(sessions=8, turns=5, system_tokens=64, turn_tokens=40, output_tokens=8, max_prompt=10_000)
    a, b, c = w.session_prompts(0), w.session_prompts(4), w.session_prompts(1)
    assert len(a) == 5 and all(later[:len(earlier)] == earlier for earlier, later in zip(a, a[1:]))
    assert a[0][:64] == b[0][:64] != c[0][:64]  # sessions 0 and 4 are the same agent type, 1 another
    assert a == Workload(sessions=8, turns=5, system_tokens=64, turn_tokens=40, output_tokens=8,
                         max_prompt=10_000).session_prompts(0)  # the same for every configuration
    assert all(len(p) <= 200 for p in Workload(turns=50, max_prompt=200, system_tokens=64).session_prompts(0)[:-1])


def test_ceiling_counts_whole_shared_pages_and_leaves_a_token():
    c = Ceiling()
    first = list(range(5 * PAGE + 3))
    assert c.add(first) == 0
    assert c.add(first) == 5 * PAGE  # a repeat: every whole page, at least one token left
    longer = first[:5 * PAGE] + [7] * (2 * PAGE)
    assert c.add(longer) == 5 * PAGE
    assert c.add(longer[:5 * PAGE]) == 4 * PAGE  # exactly 5 pages: the last token is computed
    assert c.add([9] + first) == 0


def test_a_server_that_never_answers_ends_the_replay_after_its_grace(monkeypatch):
    async def hang(request):
        await asyncio.sleep(3600)

    monkeypatch.setattr(kv, "END_GRACE_S", 0.2)
    w = Workload(sessions=2, alive=2, concurrency=2, duration_s=0.1, think_s=0.0, system_tokens=16, turn_tokens=8)
    sent, wall = asyncio.run(kv.replay("http://test", "m", w, transport=httpx.MockTransport(hang)))
    assert wall < 5 and len(sent) == 2 and all(s.error.startswith("unfinished") for s in sent)
