"""`--ray`: the ranks as Ray actors on a real multi-node Ray cluster on this machine (a head node
with no CPUs for ranks, one node offering `pdserve_prefill` and one `pdserve_decode`), 1P1D, the
router in the launcher. Greedy outputs equal a colocated system's; /health names each rank's
node; killing the decode actor's process: Ray restarts it and the new rank rejoins and serves;
stop leaves no actor, rank process or shared memory behind; a killed launcher takes its actors
along; two nodes share a Mooncake L3 tier the launcher starts (a prefix computed on one node is a
hit on the other); a lost node's rank is placed again on a node that joins.
Skipped, with the reason, where Ray is not installed (scripts/setup_ray.sh) or cannot start.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from launcher.supervisor import remove_dead_ranks_shm
from tests.e2e.conftest import MODEL, start_system, stop_system
from test_e2e_kv_store import STORY, chat, metric

pytestmark = pytest.mark.slow

ray_utils = pytest.importorskip("ray.cluster_utils", reason="Ray is not installed (scripts/setup_ray.sh)")

NODE_ARGS = {"object_store_memory": 80 * 2**20, "include_dashboard": False}  # ~ the minimum


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def cluster():
    try:
        c = ray_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **NODE_ARGS})
        prefill = c.add_node(num_cpus=1, resources={"pdserve_prefill": 1}, **NODE_ARGS)
        decode = c.add_node(num_cpus=1, resources={"pdserve_decode": 1}, **NODE_ARGS)
        c.wait_for_nodes()
    except Exception as e:  # noqa: BLE001 - whatever keeps Ray from starting here
        pytest.skip(f"a Ray cluster cannot start on this machine: {type(e).__name__}: {e}")
    try:
        yield c, prefill.node_id, decode.node_id
    finally:
        c.shutdown()


def complete(system, prompt: str, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(system.url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_pd_ranks_on_ray_nodes_serve_restart_and_stop_clean(tmp_path, cluster, colocated_system):
    c, prefill_node, decode_node = cluster
    os.environ["PDSERVE_CLUSTER_SECRET"] = "ray-secret"  # CURVE on every rank socket; actors pass it on
    try:
        system = start_system(tmp_path, ["--ray", c.address, "--prefill", "1", "--decode", "1", "--model", MODEL,
                                         "--num-threads", "1", "--kv-cache-gb", "0.1", "--disagg", "always",
                                         "--restart-backoff-s", "0.5"], timeout=420)
    finally:
        del os.environ["PDSERVE_CLUSTER_SECRET"]
    pids: set[int] = set()
    try:
        ranks = system.ranks()
        assert prefill_node[:8] in ranks["prefill-0"]["node"] and decode_node[:8] in ranks["decode-0"]["node"]
        for prompt in ("The capital of France is", "def fibonacci(n):"):
            r, ref = complete(system, prompt), complete(colocated_system, prompt)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
            assert r.headers["x-pdserve-decode-rank"] == "decode-0"

        rank_pid = ranks["decode-0"]["pid"]
        actor_pid = _ppid(rank_pid)
        pids |= {rank_pid, actor_pid, ranks["prefill-0"]["pid"], _ppid(ranks["prefill-0"]["pid"])}
        os.kill(actor_pid, signal.SIGKILL)  # the actor's process: its rank dies with it
        system.wait_until(lambda: _gone(rank_pid), 10, "the rank died with its actor")
        system.wait_until(lambda: system.ranks()["decode-0"]["state"] == "ready"
                          and system.ranks()["decode-0"]["pid"] != rank_pid, 300, "Ray restarted decode-0")
        new = system.ranks()["decode-0"]
        assert new["restarts"] == 1 and decode_node[:8] in new["node"]
        pids |= {new["pid"], _ppid(new["pid"])}
        r = complete(system, "The capital of France is")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == \
            complete(colocated_system, "The capital of France is").json()["choices"][0]["text"]
    finally:
        stop_system(system)
    deadline = time.monotonic() + 20
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in pids if not _gone(p)] == [], "a rank or actor process outlived the stop"
    assert not [f for p in pids for f in Path("/dev/shm").glob(f"pdserve-*-{p}-*")]
    import ray

    ray.init(address=c.address, log_to_driver=False)
    try:
        assert [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("pdserve-")] == []
        assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    finally:
        ray.shutdown()


def test_a_killed_launcher_takes_its_ray_actors_and_ranks_along(tmp_path, cluster):
    """The actors belong to the launcher: Ray kills them when it dies, and their ranks with them
    (a rank killed so leaves its host-cache file; the next rank started on that node removes it)."""
    c, _, _ = cluster
    system = start_system(tmp_path, ["--ray", c.address, "--colocated", "1", "--model", MODEL, "--num-threads", "1",
                                     "--kv-cache-gb", "0.05"], timeout=420)
    try:
        rank_pid = system.ranks()["colocated-0"]["pid"]
        actor_pid = _ppid(rank_pid)
        os.kill(system.proc.pid, signal.SIGKILL)  # the launcher only: Ray sees the actors' owner die
        system.proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while not (_gone(rank_pid) and _gone(actor_pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(rank_pid) and _gone(actor_pid), "the rank or its actor outlived the launcher by 30 s"
        remove_dead_ranks_shm()  # what the next rank started on this node would do
    finally:
        stop_system(system)


def test_two_nodes_share_the_mooncake_tier_a_prefix_from_one_is_a_hit_on_the_other(tmp_path, cluster,
                                                                                    colocated_system):
    """`--kv-store mooncake` under Ray: the launcher starts the master on its node's IP and the
    ranks of both nodes join it; a prompt computed on one node (private host caches,
    --hicache-scope rank, so only the store can carry it) is a store hit on the other, with the
    text a colocated system gives. The master stops with the system."""
    pytest.importorskip("mooncake.store", reason="run scripts/setup_mooncake.sh")
    import psutil

    c, _, _ = cluster
    system = start_system(tmp_path, ["--ray", c.address, "--colocated", "2", "--routing-policy", "round-robin",
                                     "--model", MODEL, "--num-threads", "1", "--kv-cache-gb", "0.05",
                                     "--hicache-scope", "rank", "--hicache-size-gb", "0.1", "--kv-store", "mooncake",
                                     "--kv-store-size-gb", "0.25"], timeout=420)
    try:
        [master] = [p for p in psutil.Process(system.proc.pid).children() if "mooncake_master" in p.name()]
        ranks = system.ranks()
        assert ranks["colocated-0"]["node"] != ranks["colocated-1"]["node"]
        turn = [{"role": "system", "content": STORY}, {"role": "user", "content": "Name a colour."}]
        first, second = chat(system, turn), chat(system, turn)
        assert first[2] != second[2] and first[1] == 0
        assert second[1] >= 128  # the first node's pages, read from the store
        assert first[0] == second[0] == chat(colocated_system, turn)[0]
        system.wait_until(lambda: metric(system, "pdserve_rank_kv_store_hit_tokens") == second[1], 10,
                          "the ranks' stats to count the store's hit")
    finally:
        stop_system(system)
    master.wait(timeout=10)  # (raises while it runs)


def test_a_lost_node_fails_over_and_its_rank_comes_back_on_a_new_one(tmp_path, cluster):
    """The decode node disappears (its raylet and everything on it killed): the router declares
    its rank dead; once a node offering pdserve_decode joins, Ray places the rank there and it
    rejoins; requests succeed again."""
    c, _, decode_node = cluster
    system = start_system(tmp_path, ["--ray", c.address, "--prefill", "1", "--decode", "1", "--model", MODEL,
                                     "--num-threads", "1", "--kv-cache-gb", "0.05", "--disagg", "always",
                                     "--restart-backoff-s", "0.5"], timeout=420)
    try:
        assert complete(system, "The capital of France is").status_code == 200
        [node] = [n for n in c.list_all_nodes() if n.node_id == decode_node]
        c.remove_node(node)
        system.wait_until(lambda: system.ranks()["decode-0"]["state"] == "dead", 30, "the router saw decode-0 go")
        new = c.add_node(num_cpus=1, resources={"pdserve_decode": 1}, **NODE_ARGS)
        system.wait_until(lambda: system.ranks()["decode-0"]["state"] == "ready", 300, "decode-0 placed again")
        assert new.node_id[:8] in system.ranks()["decode-0"]["node"]
        r = complete(system, "The capital of France is")
        assert r.status_code == 200, r.text
    finally:
        stop_system(system)
