"""One host cache per host (the launcher's default, hicache/shared_index.py) on real processes:
with round-robin routing every turn lands on another rank, yet the second turn of each
conversation is a hit; in PD mode the decode ranks find the prompt's pages the prefill rank wrote
to the host cache and pull only the rest (pdserve_handoff_reused_tokens); the greedy text equals
colocated mode's, and the launcher's stop removes the cache's files. A request's cache_salt keeps
its pages to its own salt.
"""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import MODEL, start_system, stop_system
from test_e2e_kv_store import STORY, chat, metric

pytestmark = pytest.mark.slow

COMMON = ["--model", MODEL, "--kv-cache-gb", "0.25", "--num-threads", "1", "--max-num-seqs", "8",
          "--hicache-size-gb", "0.3", "--routing-policy", "round-robin"]


def conversations() -> list[list[dict]]:
    return [[{"role": "system", "content": STORY}, {"role": "user", "content": q}]
            for q in ("Name a colour.", "Name a fruit.")]


def two_turns(system) -> list[tuple[str, int, str, int]]:
    """(answer1, cached1, answer2, cached2) for each conversation, the turns interleaved."""
    convs, out = conversations(), []
    first = [chat(system, c) for c in convs]
    for conv, (a1, c1, _) in zip(convs, first):
        a2, c2, _ = chat(system, conv + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Another?"}])
        out.append((a1, c1, a2, c2))
    return out


def host_cache_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("pdserve-hostcache-*")}


def test_every_rank_of_the_host_hits_what_any_computed_and_decode_pulls_only_the_rest(tmp_path):
    before = host_cache_files()
    colocated = start_system(tmp_path / "c", ["--colocated", "2", *COMMON], timeout=420)
    try:
        assert len(host_cache_files() - before) == 2  # the pool and its index
        ref = two_turns(colocated)
        for a1, c1, a2, c2 in ref:
            assert c2 >= 128, "the other rank served the second turn from the first rank's pages"
        # A tenant's cache_salt: the unsalted pages are no hit for it, its own pages are, same text.
        conv = conversations()[0]
        for expect_hit in (False, True):
            r = httpx.post(colocated.url + "/v1/chat/completions", timeout=120, json={
                "model": MODEL, "messages": conv, "max_tokens": 16, "temperature": 0, "cache_salt": "tenant-b"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == ref[0][0]
            assert (r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128) == expect_hit
        r = httpx.post(colocated.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": conv, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    finally:
        stop_system(colocated)
    assert host_cache_files() == before
    pd = start_system(tmp_path / "pd", ["--prefill", "2", "--decode", "2", "--disagg", "always",
                                        "--handoff-pool-gb", "0.2", *COMMON], timeout=420)
    try:
        got = two_turns(pd)
        assert [(g[0], g[2]) for g in got] == [(r[0], r[2]) for r in ref], "PD text equals colocated"
        # The system prompt's pages: the second conversation hits them on the other prefill rank.
        assert got[1][1] >= 128 and all(g[3] >= 128 for g in got)
        pd.wait_until(lambda: metric(pd, "pdserve_handoff_reused_tokens_total") >= 4 * 128, 10,
                      "the decode ranks' reuse of the prefill ranks' pages counted")
        pulled = metric(pd, "pdserve_handoff_pulled_tokens_total")
        assert 0 < pulled <= 4 * 16, f"each handoff pulled only its last page ({pulled} tokens in all)"
    finally:
        stop_system(pd)
