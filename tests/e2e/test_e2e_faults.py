"""Faults on real started systems: hung ranks, ranks that never load, the supervisor, a router
or launcher that dies under its ranks, backpressure (kills inside the KV-transfer window:
test_e2e_faults_pd.py).

Stand-in ranks (rank_runtime/fake_rank.py) where the router's behaviour is the point, real ranks
(the embedded model, 1 thread, small KV) where pages, shared memory and transfers are.
Kills of a decode rank while it streams and of a prefill rank while it prefills are in
test_e2e_pd.py; fault windows are widened with $PDSERVE_FAULT (rank_runtime/faults.py).
Every wait is bounded; "fast" means within 10 s on a loaded machine (timeout 3 s + heartbeats).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ROOT, free_port, start_system, stop_system

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
FAKE = ["--fake-ranks", "--fake-step-ms", "20", "--model", MODEL]
REAL = ["--model", MODEL, "--num-threads", "1", "--max-num-seqs", "8"]
FAST_S = 10.0


def stream_until_end(system, body: dict, on_first=None, timeout: float = 60) -> tuple[str, dict]:
    """Stream a completion to its end; `on_first(headers)` runs after the first token. Returns
    (the whole SSE text, response headers)."""
    with httpx.stream("POST", system.url + "/v1/completions", timeout=timeout,
                      json={"model": MODEL, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        out = [next(lines)]
        if on_first is not None:
            on_first(r.headers)
        out += list(lines)
    return "\n".join(out), dict(r.headers)


def sse_text(sse: str) -> tuple[str, int]:
    """(the completion text, the number of content events) of a streamed completion; asserts no
    error event came."""
    assert '"error"' not in sse, sse
    chunks = [json.loads(ln[6:]) for ln in sse.splitlines() if ln.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert sse.rstrip().endswith("data: [DONE]")
    return "".join(texts), len(texts)


def complete(system, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(system.url + "/v1/completions", timeout=timeout,
                      json={"model": MODEL, "temperature": 0, **body})


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie child of the launcher counts as gone once it exited.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def shm_of(pid: int) -> list[Path]:
    return [*Path("/dev/shm").glob(f"pdserve-*-{pid}-*")]


def idle(system) -> bool:
    return all(r["pages_used"] == 0 and r["handoff_pages_used"] == 0 and r["handoffs"] == 0
               and r["inflight"] == 0 and r["running"] == 0 and r["waiting"] == 0
               for r in system.ranks().values() if r["state"] == "ready")


# ---- stand-in ranks --------------------------------------------------------------------------------
@pytest.fixture
def fake2(tmp_path):
    system = start_system(tmp_path, [*FAKE, "--colocated", "2", "--routing-policy", "round-robin",
                                     "--max-migrations", "0"], timeout=120)
    try:
        yield system
    finally:
        stop_system(system)


def test_hung_rank_moves_its_stream_to_the_other_rank(tmp_path):
    """Default migration: a rank stopped mid-stream is declared dead and its request goes on
    on the other rank from the tokens delivered: no error, every token once, health degraded."""
    system = start_system(tmp_path, [*FAKE, "--colocated", "2", "--routing-policy", "round-robin"], timeout=120)
    stopped = {}

    def stop_it(headers):
        stopped.update(name=headers["x-pdserve-rank"])
        stopped["pid"] = system.ranks()[stopped["name"]]["pid"]
        os.kill(stopped["pid"], signal.SIGSTOP)

    try:
        text, _ = stream_until_end(system, {"prompt": "hi", "max_tokens": 200}, on_first=stop_it)
        _, n = sse_text(text)
        assert n == 200
        status, body = system.health()
        assert status == 200 and body["status"] == "degraded" and body["down"] == [stopped["name"]]
        metrics = httpx.get(system.url + "/metrics").text
        assert 'pdserve_migrations_total{cause="silent",role="colocated"} 1.0' in metrics
    finally:
        if stopped:
            os.kill(stopped["pid"], signal.SIGCONT)
        stop_system(system)


def test_hung_rank_fails_its_stream_fast_and_is_told_to_exit_when_it_wakes(fake2):
    """--max-migrations 0: the stream of a hung rank fails fast instead."""
    stopped = {}

    def stop_it(headers):
        name = headers["x-pdserve-rank"]
        stopped.update(name=name, pid=fake2.ranks()[name]["pid"], t=time.monotonic())
        os.kill(stopped["pid"], signal.SIGSTOP)

    try:
        text, _ = stream_until_end(fake2, {"prompt": "hi", "max_tokens": 5000}, on_first=stop_it)
        took = time.monotonic() - stopped["t"]
        assert '"error"' in text and f"rank {stopped['name']} died" in text and "silent" in text
        assert text.rstrip().endswith("data: [DONE]") and took < FAST_S
        status, body = fake2.health()
        hung = {r["name"]: r for r in body["ranks"]}[stopped["name"]]
        assert status == 200 and hung["state"] == "dead" and "silent" in hung["error"]
        for _ in range(2):  # the other rank serves
            r = complete(fake2, {"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.headers["x-pdserve-rank"] != stopped["name"]
    finally:
        if stopped:
            os.kill(stopped["pid"], signal.SIGCONT)
    # Woken up, it speaks with stale state: the router answers Shutdown and it exits.
    fake2.wait_until(lambda: pid_gone(stopped["pid"]), FAST_S, "the woken rank to exit")
    log = (fake2.log_dir / f"rank-{stopped['name']}.log").read_text()
    assert "router asked to shut down: unknown or dead rank" in log
    assert fake2.ranks()[stopped["name"]]["state"] == "dead"  # it did not rejoin
    fake2.wait_until(lambda: idle(fake2), FAST_S, "the survivor idle")


def test_rank_that_never_becomes_ready_is_marked_dead_and_the_rest_serve(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_FAULT", "colocated-1:hang_before_hello")
    t0 = time.monotonic()
    system = start_system(tmp_path, [*FAKE, "--colocated", "2", "--rank-start-timeout-s", "4"], timeout=60)
    try:
        assert time.monotonic() - t0 >= 4  # /health said loading until the timeout
        ranks = system.ranks()
        assert ranks["colocated-0"]["state"] == "ready"
        assert ranks["colocated-1"]["state"] == "dead" and "did not become ready" in ranks["colocated-1"]["error"]
        r = complete(system, {"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.headers["x-pdserve-rank"] == "colocated-0"
        assert "never saying Hello" in (system.log_dir / "rank-colocated-1.log").read_text()
    finally:
        stop_system(system)


def test_supervisor_restarts_a_killed_rank_until_its_limit(tmp_path):
    system = start_system(tmp_path, [*FAKE, "--colocated", "2", "--routing-policy", "round-robin", "--supervise",
                                     "--max-restarts", "1", "--restart-backoff-s", "0.5"], timeout=120)
    try:
        old = system.ranks()["colocated-0"]["pid"]
        os.kill(old, signal.SIGKILL)
        system.wait_until(lambda: (r := system.ranks()["colocated-0"])["state"] == "ready" and r["pid"] != old,
                          30, "colocated-0 restarted")
        assert system.ranks()["colocated-0"]["restarts"] == 1 and system.health()[0] == 200
        served = {complete(system, {"prompt": "hi", "max_tokens": 3}).headers["x-pdserve-rank"] for _ in range(4)}
        assert served == {"colocated-0", "colocated-1"}  # round-robin reaches the restarted rank
        again = system.ranks()["colocated-0"]["pid"]
        os.kill(again, signal.SIGKILL)  # its one restart is used up
        system.wait_until(lambda: system.ranks()["colocated-0"]["state"] == "dead", FAST_S, "colocated-0 dead")
        time.sleep(2)
        assert system.ranks()["colocated-0"]["state"] == "dead" and system.ranks()["colocated-0"]["pid"] == again
        assert complete(system, {"prompt": "hi", "max_tokens": 3}).headers["x-pdserve-rank"] == "colocated-1"
    finally:
        stop_system(system)


def _router_only(tmp: Path, rank_addr: str, extra=()) -> subprocess.Popen:
    port = free_port()
    log = open(tmp / f"router-{port}.log", "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen([sys.executable, "-m", "launcher.launch", "--colocated", "0", "--model", MODEL,
                             "--port", str(port), "--rank-addr", rank_addr, *extra], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / f"router-{port}.log").read_text()
        try:
            httpx.get(proc.url + "/health", timeout=2)  # type: ignore[attr-defined]
            return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    raise AssertionError("router did not come up")


def _health(proc) -> dict:
    return httpx.get(proc.url + "/health", timeout=5).json()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_router_restart_under_standalone_ranks_leaves_nothing_behind(tmp_path):
    """colocated-0 runs with --rejoin (re-registers with the new router), colocated-1 without (exits)."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    routers, ranks = [_router_only(tmp_path, addr)], []
    try:
        for i, extra in ((0, ["--rejoin"]), (1, [])):
            with open(tmp_path / f"rank-{i}.log", "wb") as log:
                ranks.append(subprocess.Popen([sys.executable, "-m", "rank_runtime.fake_rank", "--router-addr", addr,
                                               "--index", str(i), *extra], cwd=ROOT, stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while [r["state"] for r in _health(routers[0])["ranks"]] != ["ready", "ready"]:
            assert time.monotonic() < deadline, _health(routers[0])
            time.sleep(0.2)
        routers[0].kill()  # kill -9: no Shutdown reaches the ranks
        routers[0].wait(timeout=10)
        routers.append(_router_only(tmp_path, addr))
        t0 = time.monotonic()
        ranks[1].wait(timeout=15)  # exits cleanly (stale frames answered by Shutdown, or the router silent)
        assert ranks[1].returncode in (0, 4) and time.monotonic() - t0 < 15
        log = (tmp_path / "rank-1.log").read_text()
        assert "router asked to shut down" in log or "router silent" in log
        deadline = time.monotonic() + 20
        while [(r["name"], r["state"], r["pid"]) for r in _health(routers[1])["ranks"]] != \
                [("colocated-0", "ready", ranks[0].pid)]:
            assert time.monotonic() < deadline, _health(routers[1])
            time.sleep(0.2)
        r = httpx.post(routers[1].url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.headers["x-pdserve-rank"] == "colocated-0"
        assert "saying Hello again" in (tmp_path / "rank-0.log").read_text()
        ranks[0].terminate()
        assert ranks[0].wait(timeout=10) == 0
    finally:
        for p in ranks + routers:
            _kill(p)


def test_cluster_secret_admits_only_ranks_that_hold_it(tmp_path):
    system = start_system(tmp_path, [*FAKE, "--colocated", "1", "--cluster-secret", "s3cret"], timeout=120)
    try:
        addr = system.health()[1]["rank_addr"]
        for i, secret in ((5, "wrong"), (6, "")):
            env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_SECRET"}
            out = subprocess.run([sys.executable, "-m", "rank_runtime.fake_rank", "--router-addr", addr, "--index", str(i),
                                  "--cluster-secret", secret], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 3 and "refused this rank" in out.stderr and "cluster secret" in out.stderr
        assert list(system.ranks()) == ["colocated-0"]  # nobody joined
        assert "failed the handshake" in (tmp_path / "router.log").read_text()
        r = complete(system, {"prompt": "hi", "max_tokens": 3})  # the launcher's rank got the secret
        assert r.status_code == 200
    finally:
        stop_system(system)


def test_without_a_given_secret_the_launcher_makes_one_and_a_local_process_cannot_join(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_SECRET"}
    system = start_system(tmp_path, [*FAKE, "--colocated", "1"], timeout=120)
    try:
        addr = system.health()[1]["rank_addr"]
        out = subprocess.run([sys.executable, "-m", "rank_runtime.fake_rank", "--router-addr", addr, "--index", "5"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 3 and "cluster secret" in out.stderr, out.stderr[-2000:]
        assert list(system.ranks()) == ["colocated-0"]
        assert "(CURVE, cluster secret)" in (tmp_path / "router.log").read_text()
        assert complete(system, {"prompt": "hi", "max_tokens": 3}).status_code == 200
    finally:
        stop_system(system)


def test_killed_launcher_takes_its_ranks_and_their_shared_memory_along(tmp_path):
    system = start_system(tmp_path, [*REAL, "--colocated", "1", "--kv-cache-gb", "0.05", "--hicache-size-gb", "0.02"],
                          timeout=300)
    try:
        pid = system.ranks()["colocated-0"]["pid"]
        # The host's one cache, named by the launcher's pid (hicache/host_plan.py); the last rank removes it.
        host_cache = [*Path("/dev/shm").glob(f"pdserve-hostcache-{system.proc.pid}-*")]
        assert len(host_cache) == 2, "the host cache (pool and index) should live in /dev/shm"
        os.kill(system.proc.pid, signal.SIGKILL)  # the launcher only, not its group
        system.proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while not pid_gone(pid):
            assert time.monotonic() < deadline, "the rank outlived its launcher by 15 s"
            time.sleep(0.2)
        assert not shm_of(pid) and not any(p.exists() for p in host_cache)
    finally:
        stop_system(system)


# ---- backpressure ------------------------------------------------------------------------------------
def test_full_queues_and_pools_answer_429_or_503_and_never_lose_a_request(tmp_path):
    # Decode KV of ~28 pages (~450 tokens) for requests of ~11 pages each, a handoff pool of ~3
    # prompts, a host cache that evicts, and room for 3 requests per rank at the router.
    system = start_system(tmp_path, [*REAL, "--prefill", "1", "--decode", "1", "--transfer", "shm",
                                     "--kv-cache-gb", "0.01", "--handoff-pool-gb", "0.01", "--hicache-size-gb", "0.005",
                                     "--max-inflight-per-rank", "3", "--handoff-lease-s", "20", "--disagg", "always"],
                          timeout=300)
    results: list[tuple[int, dict]] = []

    def one(i: int) -> None:
        words = " ".join(f"w{i}x{j}" for j in range(25))  # ~120 tokens; distinct: the host cache evicts
        r = complete(system, {"prompt": words, "max_tokens": 40, "ignore_eos": True}, timeout=150)
        results.append((r.status_code, r.json()))

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=160)
        assert not any(t.is_alive() for t in threads), "a request hung"
        codes = sorted(c for c, _ in results)
        assert len(results) == 10 and set(codes) <= {200, 429, 503}, results
        assert 429 in codes and 200 in codes, codes
        for code, body in results:
            if code == 200:
                assert body["usage"]["completion_tokens"] == 40 and body["choices"][0]["finish_reason"] == "length"
            else:
                assert body["error"]["message"] and body["error"]["type"]
        assert all(r["state"] == "ready" for r in system.ranks().values())  # nothing crashed
        system.wait_until(lambda: idle(system), FAST_S, "both ranks idle")
        r = complete(system, {"prompt": "The capital of France is", "max_tokens": 4})
        assert r.status_code == 200
    finally:
        stop_system(system)


def test_a_full_decode_rank_keeps_its_handoffs_for_longer_than_the_lease(tmp_path):
    """One sequence at a time on the decode rank and a 1.5 s lease: the later requests wait for
    room several leases long, their KV pinned on the prefill rank by the decode rank's Renews;
    every one completes (no 503 or 504) and the pins come back."""
    lease_s = 1.5
    # The last request waits for three others to decode: 3 x 160 steps, ~5 s at 10 ms a step (bf16
    # with AMX, one thread; 48 tokens each made only 2.4 s there), ~12 s at 25 ms (fp32 on Zen 3).
    n_tokens = 160
    system = start_system(tmp_path, ["--model", MODEL, "--num-threads", "1", "--max-num-seqs", "1",
                                     "--prefill", "1", "--decode", "1", "--transfer", "shm", "--kv-cache-gb", "0.05",
                                     "--handoff-lease-s", str(lease_s), "--disagg", "always"], timeout=300)
    results: dict[int, tuple[int, dict, float]] = {}

    def one(i: int) -> None:
        t0 = time.monotonic()
        r = complete(system, {"prompt": f"Request {i}: tell me about the sea.", "max_tokens": n_tokens,
                              "ignore_eos": True}, timeout=150)
        results[i] = (r.status_code, r.json(), time.monotonic() - t0)

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=160)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert [c for c, _, _ in results.values()] == [200] * 4, results
        assert all(b["usage"]["completion_tokens"] == n_tokens for _, b, _ in results.values())
        # The premise: some request waited (for the decode rank's one place) for more than a lease.
        assert max(s for _, _, s in results.values()) > 2 * lease_s, results
        system.wait_until(lambda: idle(system), FAST_S, "both ranks idle")
    finally:
        stop_system(system)
