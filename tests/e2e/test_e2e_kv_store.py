"""The L3 tier on real processes (`--kv-store file:DIR`): a prefix one rank computed is a hit on
another rank of the host (round-robin routing sends each turn to the other rank, whose private
host cache, --hicache-scope rank, never saw it), and after a restart over the same directory; the
greedy text is the same whichever tier served the prefix, and /metrics counts the store's hits
and bytes. In PD mode with private caches a decode rank keeps every handed-off prompt's pages
(--decode-keep-prompts), so the next turn's handoff reads only what it lacks
(pdserve_handoff_reused_tokens), with the colocated text. (One cache per host: test_e2e_host_cache.py.)
"""
from __future__ import annotations

import re

import httpx
import pytest
from conftest import MODEL, start_system, stop_system

pytestmark = pytest.mark.slow

COMMON = ["--model", MODEL, "--kv-cache-gb", "0.25", "--num-threads", "1", "--max-num-seqs", "8",
          "--hicache-size-gb", "0.25"]
STORY = ("You are a careful assistant. Answer in one short sentence. " * 12).strip()


def chat(system, messages: list[dict]) -> tuple[str, int, str]:
    r = httpx.post(system.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return body["choices"][0]["message"]["content"], cached, r.headers["x-pdserve-rank"]


def metric(system, name: str) -> float:
    """The sum of a metric's samples; `name{label="v"` sums those with that label only."""
    text = httpx.get(system.url + "/metrics").text
    name, _, label = name.partition("{")
    return sum(float(v) for labels, v in re.findall(rf"^{name}{{([^}}]*)}} ([0-9.e+]+)$", text, re.M)
               if label in labels)


def test_a_prefix_is_a_hit_on_another_rank_and_after_a_restart(tmp_path, monkeypatch):
    store = f"file:{tmp_path / 'kv'}"
    turn1 = [{"role": "system", "content": STORY}, {"role": "user", "content": "Name a colour."}]
    system = start_system(tmp_path / "a", ["--colocated", "2", "--routing-policy", "round-robin",
                                           "--hicache-scope", "rank", "--kv-store", store, *COMMON], timeout=420)
    try:
        answer1, cached1, rank1 = chat(system, turn1)
        turn2 = turn1 + [{"role": "assistant", "content": answer1}, {"role": "user", "content": "And another?"}]
        answer2, cached2, rank2 = chat(system, turn2)
        assert rank2 != rank1 and cached1 == 0
        assert cached2 >= 128  # the first turn's pages, from the store: rank2's host cache never saw them
        system.wait_until(lambda: metric(system, "pdserve_rank_kv_store_hit_tokens") == cached2, 10,
                          "the ranks' stats to count the store's hit")  # (stats come every 0.5 s)
        assert metric(system, "pdserve_rank_kv_store_bytes") > 0
        assert metric(system, "pdserve_rank_kv_store_seconds") > 0  # the store's latency (reads and writes)
    finally:
        stop_system(system)
    system = start_system(tmp_path / "b", ["--colocated", "1", "--kv-store", store, *COMMON], timeout=420)
    try:
        again, cached, _ = chat(system, turn2)  # the next start: its host cache is empty
        assert again == answer2 and cached >= cached2
        system.wait_until(lambda: metric(system, "pdserve_rank_kv_store_hit_tokens") == cached, 10,
                          "the rank's stats to count the store's hit")
        assert metric(system, 'pdserve_rank_kv_store_prefetches{outcome="in_time"') >= 1
    finally:
        stop_system(system)
    # A store that hangs (each read 60 s): the request stops waiting for it at its deadline and
    # computes the prompt, same text; nothing waits on the store again for it.
    monkeypatch.setenv("PDSERVE_FAULT", "colocated-0:slow_kv_store:60")
    system = start_system(tmp_path / "c", ["--colocated", "1", "--kv-store", store, *COMMON], timeout=420)
    try:
        again, cached, _ = chat(system, turn2)
        assert again == answer2 and cached == 0
        system.wait_until(lambda: metric(system, 'pdserve_rank_kv_store_prefetches{outcome="late"') == 1, 10,
                          "the late read-ahead counted")
    finally:
        stop_system(system)


def test_a_decode_rank_reads_only_what_it_lacks_with_the_colocated_text(tmp_path):
    turn1 = [{"role": "system", "content": STORY}, {"role": "user", "content": "Name a colour."}]
    colocated = start_system(tmp_path / "c", ["--colocated", "1", *COMMON], timeout=420)
    try:
        answer1, _, _ = chat(colocated, turn1)
        turn2 = turn1 + [{"role": "assistant", "content": answer1}, {"role": "user", "content": "And another?"}]
        answer2, _, _ = chat(colocated, turn2)
    finally:
        stop_system(colocated)
    pd = start_system(tmp_path / "pd", ["--prefill", "1", "--decode", "1", "--transfer", "shm", "--disagg", "always",
                                        "--handoff-pool-gb", "0.2", "--decode-keep-prompts", "--hicache-scope", "rank",
                                        *COMMON], timeout=420)
    try:
        assert chat(pd, turn1)[0] == answer1
        pd.wait_until(lambda: metric(pd, "pdserve_handoff_pulled_tokens_total") > 0, 10, "the first pull counted")
        pulled1 = metric(pd, "pdserve_handoff_pulled_tokens_total")
        assert metric(pd, "pdserve_handoff_reused_tokens_total") == 0
        assert chat(pd, turn2)[0] == answer2
        reused = pd.wait_until(lambda: metric(pd, "pdserve_handoff_reused_tokens_total"), 10,
                               "the second turn's reuse counted")
        assert reused >= pulled1 // 16 * 16 - 16  # the first prompt's complete pages, not read again
        pulled2 = metric(pd, "pdserve_handoff_pulled_tokens_total") - pulled1
        assert pulled2 < reused  # the second turn read only its new pages
    finally:
        stop_system(pd)


def test_mooncake_serves_what_the_host_cache_lost_and_its_death_fails_nothing(tmp_path):
    """`--kv-store mooncake`: the launcher starts a master; a prompt the (small) host cache has
    evicted comes back from the store with the same greedy text; with the master killed, every
    request still succeeds (the store is skipped)."""
    import psutil

    pytest.importorskip("mooncake.store", reason="run scripts/setup_mooncake.sh")
    system = start_system(tmp_path / "m", ["--colocated", "1", "--kv-store", "mooncake", "--kv-store-size-gb", "0.5",
                                           *COMMON[:-2], "--hicache-size-gb", "0.06"], timeout=420)
    try:
        master = [p for p in psutil.Process(system.proc.pid).children() if "mooncake_master" in p.name()]
        assert len(master) == 1
        # five prompts of ~55 pages: more than the 0.06 GB host cache holds in bf16 (~160) or float32 (~80)
        prompts = [[{"role": "user", "content": f"Topic {i}: " + STORY[i:] * 6}] for i in range(5)]
        first = [chat(system, p) for p in prompts]
        again, cached, _ = chat(system, prompts[0])
        assert again == first[0][0] and cached >= 256
        system.wait_until(lambda: metric(system, "pdserve_rank_kv_store_hit_tokens") >= 256, 10,
                          "the store's hit counted")
        master[0].kill()  # (a zombie until the launcher reaps it at its stop)
        system.wait_until(lambda: master[0].status() == psutil.STATUS_ZOMBIE, 10, "the master to die")
        for p in prompts[1:3] + [[{"role": "user", "content": "A new question?"}]]:
            chat(system, p)  # 200s: the store is down, the ranks compute
        assert system.health()[0] == 200
    finally:
        stop_system(system)
