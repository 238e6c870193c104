"""PD mode end to end: real router, prefill and decode rank processes, KV over NIXL and shm.

Two systems, one per transfer backend, shared by the tests of this module (--disagg always):
  * `pd_nixl`: 1 prefill + 1 decode over NIXL, the prefill rank on 127.0.0.2 and the decode
    rank on 127.0.0.3 (rank-to-rank traffic over TCP, as two hosts would), host prefix cache on;
  * `pd_shm`: 2 prefill + 2 decode over shared memory on loopback, prefix cache off. Its last
    two tests kill decode-1, then prefill-1.
and `pd_local`: 1 prefill + 1 decode with --disagg never (the decode rank prefills every
prompt itself), host prefix cache on.
Greedy outputs are compared token for token with the engine run in this process (the colocated
path: same model, dtype, thread count and chunking; requests go one at a time).
"""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import start_system, stop_system

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
# --max-num-batched-tokens 512: the 700- and 1400-token prompts below take several prefill steps
# (chunked prefill across the handoff; aborts and kills that land between steps).
COMMON = ["--model", MODEL, "--kv-cache-gb", "0.25", "--num-threads", "1", "--max-num-seqs", "16",
          "--max-num-batched-tokens", "512",
          "--handoff-pool-gb", "0.2"]  # ~4.5k tokens in float32 (--dtype auto on a CPU without native bf16)
# Every prompt through a prefill rank and its handoff, which most tests here test (auto would
# prefill short prompts on the decode rank; `pd_local` tests that path).
HANDOFF = [*COMMON, "--disagg", "always"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def pd_nixl(tmp_path_factory):
    system = start_system(tmp_path_factory.mktemp("pd-nixl"),
                          ["--prefill", "1", "--decode", "1", "--transfer", "nixl", "--prefill-host", "127.0.0.2",
                           "--decode-host", "127.0.0.3", "--hicache-size-gb", "0.05", *HANDOFF], timeout=420)
    try:
        yield system
    finally:
        stop_system(system)


@pytest.fixture(scope="module")
def pd_shm(tmp_path_factory):
    system = start_system(tmp_path_factory.mktemp("pd-shm"),
                          ["--prefill", "2", "--decode", "2", "--transfer", "shm",
                           # Prefix cache off, as the module docstring says (the launcher's default is on;
                           # with it, cache-aware routing sends shared-prefix prompts to one rank).
                           "--hicache-size-gb", "0",
                           # Spread by load: the kill tests hold a stream on each decode rank (on a host
                           # with fewer cores than ranks the launcher's default fills one rank first).
                           "--decode-pack", "0", *HANDOFF], timeout=420)
    pids = [r["pid"] for r in system.ranks().values()]
    try:
        yield system
    finally:
        stop_system(system)
    # Killed ranks cannot unlink their handoff pools: the launcher does on the way out.
    assert not [f for pid in pids for f in Path("/dev/shm").glob(f"pdserve-handoff-*-{pid}-*")]


@pytest.fixture(scope="module")
def pd_local(tmp_path_factory):
    system = start_system(tmp_path_factory.mktemp("pd-local"),
                          ["--prefill", "1", "--decode", "1", "--transfer", "shm", "--hicache-size-gb", "0.05",
                           *COMMON, "--disagg", "never"], timeout=420)
    try:
        yield system
    finally:
        stop_system(system)


BOTH = pytest.mark.parametrize("backend", ["nixl", "shm"])  # not a parametrized fixture: keeps test order


def system_for(request, backend: str):
    return request.getfixturevalue(f"pd_{backend}")


@pytest.fixture(scope="module")
def engine():
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=MODEL, kv_cache_gb=0.25, num_threads=1, max_num_seqs=16))


def reference(engine, prompt_ids: list[int], max_tokens: int, **kw):
    from engine.sampling_params import SamplingParams

    return engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))[0]


def client(system) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def prompts(engine) -> list[list[int]]:
    """Short, a few pages with a partial last one, and longer than one prefill chunk (512)."""
    text = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(120))
    ids = engine.tokenizer(text).input_ids
    return [engine.tokenizer("The capital of France is").input_ids, ids[:83], ids[:700]]


def completion(system, prompt_ids, max_tokens: int, **extra) -> dict:
    r = httpx.post(system.url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                         "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return {"body": r.json(), "headers": r.headers}


def idle(system) -> bool:
    return all(r["pages_used"] == 0 and r["handoff_pages_used"] == 0 and r["handoffs"] == 0
               and r["inflight"] == 0 and r["running"] == 0 and r["waiting"] == 0
               for r in system.ranks().values() if r["state"] == "ready")


def log_of(system, rank: str) -> str:
    return (system.log_dir / f"rank-{rank}.log").read_text(errors="replace")


def test_nixl_ranks_talk_over_tcp_between_two_addresses(pd_nixl):
    status, body = pd_nixl.health()
    assert status == 200 and [(r["name"], r["state"]) for r in body["ranks"]] == \
        [("prefill-0", "ready"), ("decode-0", "ready")]
    dec, pre = log_of(pd_nixl, "decode-0"), log_of(pd_nixl, "prefill-0")
    assert "peer socket tcp://127.0.0.3:" in dec and "connecting to decode-0 at tcp://127.0.0.3:" in pre
    assert "transfer: NIXL" in dec and "transfer: NIXL" in pre
    assert "prefill peer prefill-0 connected" in dec


@BOTH
def test_greedy_equals_colocated(request, backend, engine):
    pd = system_for(request, backend)
    for ids in prompts(engine):
        ref = reference(engine, ids, 10)
        got = completion(pd, ids, 10)
        choice, usage = got["body"]["choices"][0], got["body"]["usage"]
        assert choice["token_ids"] == ref.new_token_ids, len(ids)
        assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
        assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == len(ref.new_token_ids)
        assert got["headers"]["x-pdserve-rank"].startswith("prefill-")
        assert got["headers"]["x-pdserve-decode-rank"].startswith("decode-")
    pd.wait_until(lambda: idle(pd), 5, "both ranks idle")  # stats lag up to a heartbeat


def test_chat_stream_equals_nonstream_equals_engine(pd_nixl, engine):
    ids = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    ref = reference(engine, ids, 12)
    with client(pd_nixl) as c:
        kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
        full = c.chat.completions.create(**kw)
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert full.choices[0].model_extra["token_ids"] == ref.new_token_ids
    assert full.choices[0].message.content == ref.text
    token_chunks = [ch for ch in chunks if ch.choices and ch.choices[0].model_extra.get("token_ids")]
    assert len(token_chunks) == len(ref.new_token_ids)  # first from the prefill rank, the rest from decode
    assert [t for ch in token_chunks for t in ch.choices[0].model_extra["token_ids"]] == ref.new_token_ids
    usage = chunks[-1].usage  # the second run may hit the prefix cache of the first
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(ref.new_token_ids)) == \
        (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_prefix_cache_hit_on_the_prefill_rank(pd_nixl, engine):
    text = " ".join(f"step {i}: add {i * 7 % 11} apples;" for i in range(60))  # not sent before
    ids = engine.tokenizer(text).input_ids[:300]
    ref = reference(engine, ids, 8)
    first = completion(pd_nixl, ids, 8)["body"]
    again = completion(pd_nixl, ids, 8)["body"]
    for body in (first, again):
        assert body["choices"][0]["token_ids"] == ref.new_token_ids
        assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 8
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16


def test_seeded_sampling_continues_exactly(pd_shm, engine):
    from engine.sampling_params import SamplingParams

    ids = prompts(engine)[1]
    ref = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.9, seed=77))[0]
    got = completion(pd_shm, ids, 8, temperature=0.9, seed=77)["body"]
    assert got["choices"][0]["token_ids"] == ref.new_token_ids


def test_request_that_ends_at_its_first_token_never_reaches_decode(pd_nixl, engine):
    ids = prompts(engine)[1]
    got = completion(pd_nixl, ids, 1)["body"]
    assert got["choices"][0]["token_ids"] == reference(engine, ids, 1).new_token_ids
    assert got["choices"][0]["finish_reason"] == "length" and got["usage"]["completion_tokens"] == 1
    pd_nixl.wait_until(lambda: idle(pd_nixl), 5, "both ranks idle")


def test_phase_metrics(pd_nixl):
    text = httpx.get(pd_nixl.url + "/metrics").text
    for phase in ("queue", "prefill", "stage", "admission_wait", "transfer", "first_decode", "decode"):
        line = next(ln for ln in text.splitlines() if ln.startswith(f'pdserve_phase_seconds_count{{phase="{phase}"}}'))
        assert float(line.split()[-1]) > 0, phase
    line = next(ln for ln in text.splitlines() if ln.startswith('pdserve_rank_transfer_bytes{rank="decode-0"}'))
    assert float(line.split()[-1]) > 0


def _stream(system, body: dict):
    """An open streaming completion: (response context, line iterator)."""
    cm = httpx.stream("POST", system.url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "temperature": 0, "stream": True, **body})
    r = cm.__enter__()
    assert r.status_code == 200
    return cm, r


@BOTH
def test_abort_while_decoding_frees_both_ranks(request, backend):
    pd = system_for(request, backend)
    cm, r = _stream(pd, {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True})
    try:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]
        assert sum(ln.startswith("data: ") for ln in got) >= 3
        assert not idle(pd)
    finally:
        cm.__exit__(None, None, None)
    pd.wait_until(lambda: idle(pd), 20, "both ranks idle after a disconnect while decoding")


@BOTH
def test_abort_while_prefilling_frees_both_ranks(request, backend, engine):
    pd = system_for(request, backend)
    # ~2800 tokens: a second or more of prefill even with AMX (~1400 took under the 0.5 s
    # between two rank stats there, so "running" was never seen). The leading token keeps it
    # out of the host prefix cache (an earlier test prefills the same text; a hit would end
    # prefill at once). The router's inflight count is exact (a PD prefill rank holds a request
    # until its first token); the rank's own running count is sampled every 0.5 s.
    ids = [4242] + prompts(engine)[2] * 4
    cm, r = _stream(pd, {"prompt": ids, "max_tokens": 50})
    try:
        pd.wait_until(lambda: any(x["role"] == "prefill" and (x["running"] or x["inflight"])
                                  for x in pd.ranks().values()), 20, "the prompt to be prefilling")
    finally:
        cm.__exit__(None, None, None)
    pd.wait_until(lambda: idle(pd), 30, "both ranks idle after a disconnect while prefilling")


def _long_streams(system, n: int, max_tokens: int = 2000, **extra) -> list:
    """n concurrent long streams (body i: `extra` plus seed i); returns [(decode rank, prefill
    rank, cm, line iterator, first data line, body)] once each has its first token."""
    out = []
    for i in range(n):
        body = {"prompt": f"Story number {i}:", "max_tokens": max_tokens, "ignore_eos": True, "seed": i, **extra}
        cm, r = _stream(system, body)
        lines = r.iter_lines()
        out.append([r.headers["x-pdserve-decode-rank"], r.headers["x-pdserve-rank"], cm, lines, None, body])
    for s in out:
        s[4] = next(ln for ln in s[3] if ln.startswith("data: "))
    return out


def _text(lines: list[str]) -> str:
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_killed_decode_rank_moves_its_requests_and_the_rest_serve(pd_shm, engine):
    """Kills decode-1 (pd_shm's second to last test): its stream goes on on decode-0 from the
    tokens it had streamed (migration.py), to its last token, with no error; seeded sampling
    at temperature 1 gives the text of an uninterrupted run."""
    streams = _long_streams(pd_shm, 2, max_tokens=80, temperature=1.0)
    assert sorted(s[0] for s in streams) == ["decode-0", "decode-1"]
    os.kill(pd_shm.ranks()["decode-1"]["pid"], signal.SIGKILL)
    texts = []
    try:
        for dec, _, _, lines, first, body in streams:
            rest = list(lines)
            assert not any('"error"' in ln for ln in rest), rest[-3:]
            assert any('"finish_reason":"length"' in ln for ln in rest), rest[-3:]
            texts.append((_text([first, *rest]), body))
    finally:
        for s in streams:
            s[2].__exit__(None, None, None)
    for text, body in texts:  # uninterrupted, on the survivor
        r = httpx.post(pd_shm.url + "/v1/completions", timeout=120, json={"model": MODEL, **body})
        assert r.json()["choices"][0]["text"] == text
    assert 'pdserve_migrations_total{cause="exited",role="decode"} 1.0' in httpx.get(pd_shm.url + "/metrics").text
    assert pd_shm.ranks()["decode-1"]["state"] == "dead"
    ids = prompts(engine)[0]
    for _ in range(2):
        got = completion(pd_shm, ids, 6)
        assert got["headers"]["x-pdserve-decode-rank"] == "decode-0"
        assert got["body"]["choices"][0]["token_ids"] == reference(engine, ids, 6).new_token_ids
    pd_shm.wait_until(lambda: idle(pd_shm), 20, "survivors idle")


def test_killed_prefill_rank_moves_its_requests_and_the_rest_serve(pd_shm, engine):
    """Kills prefill-1 (pd_shm's last test) while it prefills: its request moves to a decode
    rank, which prefills it itself; both requests answer with the greedy tokens."""
    ids = prompts(engine)[2] * 4  # ~2800 tokens: over a second of prefill even with AMX
    results: list[httpx.Response] = []

    def run(i: int) -> None:
        results.append(httpx.post(pd_shm.url + "/v1/completions", timeout=120,
                                  json={"model": MODEL, "prompt": [7 + i] + ids, "max_tokens": 2, "temperature": 0,
                                        "return_token_ids": True}))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    # The router's inflight count is exact: a PD prefill rank holds a request until its first
    # token. (The ranks' own running counts are sampled every 0.5 s, so one can still say 1
    # after the rank has handed its request off.) One request on each prefill rank, then the kill.
    pd_shm.wait_until(lambda: [x["inflight"] for x in pd_shm.ranks().values() if x["role"] == "prefill"] == [1, 1],
                      30, "one request on each prefill rank")
    os.kill(pd_shm.ranks()["prefill-1"]["pid"], signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    assert sorted(r.status_code for r in results) == [200, 200], [r.text for r in results]
    for r in results:
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == reference(engine, choice["prompt_token_ids"], 2).new_token_ids
    moved = [ln for ln in httpx.get(pd_shm.url + "/metrics").text.splitlines()
             if ln.startswith("pdserve_migrations_total{") and 'role="prefill"' in ln]
    assert moved == ['pdserve_migrations_total{cause="exited",role="prefill"} 1.0'], moved
    got = completion(pd_shm, prompts(engine)[0], 4)
    assert got["headers"]["x-pdserve-rank"] == "prefill-0"
    pd_shm.wait_until(lambda: idle(pd_shm), 20, "survivors idle")


def test_local_prefill_on_the_decode_rank_equals_colocated(pd_local, engine):
    """--disagg never: the decode rank prefills (the 700-token prompt in chunks of 512) and
    decodes; greedy output equals the engine's (the colocated path, which the tests above hold
    the prefill-rank path to), n > 1, streaming, its own host cache, aborts, the books."""
    for ids in prompts(engine):
        ref = reference(engine, ids, 10)
        got = completion(pd_local, ids, 10)
        choice, usage = got["body"]["choices"][0], got["body"]["usage"]
        assert choice["token_ids"] == ref.new_token_ids, len(ids)
        assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
        assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == len(ref.new_token_ids)
        assert got["headers"]["x-pdserve-rank"] == got["headers"]["x-pdserve-decode-rank"] == "decode-0"
    ids = prompts(engine)[1]
    body = completion(pd_local, ids, 6, n=2)["body"]
    assert [c["token_ids"] for c in body["choices"]] == [reference(engine, ids, 6).new_token_ids] * 2
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (len(ids), 12)
    chat = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    with client(pd_local) as c:
        chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                stream=True, extra_body={"return_token_ids": True}))
    assert [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra.get("token_ids") or []] == \
        reference(engine, chat, 12).new_token_ids
    # The decode rank's host cache: a repeated prompt hits it, and the router indexes it.
    text = " ".join(f"row {i}: {i * 5 % 13} pears;" for i in range(60))  # not sent before
    ids = engine.tokenizer(text).input_ids[:300]
    first, again = completion(pd_local, ids, 4)["body"], completion(pd_local, ids, 4)["body"]
    ref = reference(engine, ids, 4).new_token_ids
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"] == ref
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16
    assert pd_local.ranks()["decode-0"]["host_cache_pages"] > 0
    # A disconnect while decoding aborts on the decode rank and frees its pages.
    cm, r = _stream(pd_local, {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True})
    try:
        lines = r.iter_lines()
        assert sum(next(lines).startswith("data: ") for _ in range(8)) >= 3
        assert r.headers["x-pdserve-rank"] == "decode-0"
    finally:
        cm.__exit__(None, None, None)
    pd_local.wait_until(lambda: idle(pd_local), 20, "both ranks idle after a disconnect while decoding")
    ranks = pd_local.ranks()
    assert ranks["prefill-0"]["routed"] == 0 and ranks["decode-0"]["routed"] == 8
    metrics = httpx.get(pd_local.url + "/metrics").text.splitlines()
    assert 'pdserve_prefill_placement_total{where="decode"} 8.0' in metrics
    assert not any(ln.startswith('pdserve_prefill_placement_total{where="prefill"}') for ln in metrics)
