"""Start a whole system in one process group: the router here, its ranks as child processes.

    python -m launcher.launch --colocated 2 [--model NAME|PATH] [--port 8000] [router flags] [engine flags]
    python -m launcher.launch --prefill 1 --decode 1 [--transfer auto|nixl|shm] [handoff flags] ...

  1. Resolve the model once here (GGUF conversion, if any, happens before ranks start).
  2. Bind the rank socket (tcp://127.0.0.1:<free port> by default) and start each rank
     (`python -m rank_runtime.colocated`, `decode.rank`, `prefill.rank`) pointed at it, logs
     in --run-dir; then load the tokenizer (while the ranks load). CPU threads are divided among
     the ranks (--num-threads 0 -> cores // ranks). PD mode (--prefill N --decode M): the handoff
     flags go to every PD rank, --prefill-host/--decode-host become their --host (their
     rank-to-rank address); the router introduces them (Peers). The ranks share one host KV
     cache (hicache/host_plan.py; --hicache-scope rank: 0.25 GiB a rank), with --kv-store an
     L3 tier behind it (hicache/store.py; `mooncake`: a master started here, under --ray on this
     node's IP, so the ranks of every node share it).
  3. Serve HTTP (uvicorn) until SIGINT/SIGTERM; /health turns 200 once every rank said Hello.
     The supervisor (supervisor.py) watches the rank processes: removes the shared memory of
     dead ones and, with --supervise, restarts them (--max-restarts, --restart-backoff-s).
     A rank without Hello --rank-start-timeout-s after its start is marked dead.
     Rank sockets run ZeroMQ CURVE and admit only ranks holding the secret (cluster/auth.py):
     --cluster-secret, $PDSERVE_CLUSTER_SECRET, else a random one per start. --colocated 0
     (no PD ranks): the router alone, ranks started by hand join it (no secret unless given).
  4. On the way out: Shutdown to every rank, wait a few seconds, then SIGTERM/SIGKILL any
     that remain. Ranks also exit by themselves when the router goes silent (5 s), so a
     killed launcher leaves nothing running.
With --ray ADDRESS|auto the ranks are Ray actors on the cluster's nodes (ray_ranks.py); the router stays here.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
from secrets import token_urlsafe
from dataclasses import dataclass, fields, replace
from pathlib import Path

from cluster import settings
from cluster.auth import SECRET_ENV
from cluster.cli_args import add_dataclass_args, from_args, opt
from hicache.host_plan import plan_host_cache, remove_host_cache
from hicache.store import StoreUnavailable, store_for_launch
from pd_server.config import RouterConfig
from rank_runtime.config import HandoffConfig
from rank_runtime.core_board import board_path, create_board, home_cpus, host_cpus, remove_stale_launcher_paths

log = logging.getLogger("launcher.launch")
EXIT_USAGE = 2
HOST_CACHE_GB = 0.25  # a rank's host cache (~11k smollm2 tokens in bf16; float32: doubled, _pools_for_dtype)


@dataclass(frozen=True)
class LaunchConfig:
    colocated: int = opt(1, "colocated ranks to start (each prefills and decodes); 0 with no PD ranks: "
                            "router only, ranks started by hand join at --rank-addr")
    prefill: int = opt(0, "prefill ranks (PD mode, with --decode; then --colocated is ignored)")
    decode: int = opt(0, "decode ranks (PD mode, with --prefill)")
    prefill_host: str = opt("127.0.0.1", "PD: the prefill ranks' --host (address they connect to decode ranks from)")
    decode_host: str = opt("127.0.0.1", "PD: the decode ranks' --host (address their peer socket binds)")
    run_dir: str = opt("", "directory for rank logs (default: ranks log to this process's stderr)")
    fake_ranks: bool = opt(False, "start stand-in ranks (rank_runtime/fake_rank.py, no model) for router benchmarks/tests")
    fake_step_ms: float = opt(0.0, "with --fake-ranks: pause between their steps (0: as fast as they can)")
    rank_shutdown_s: float = opt(5.0, "how long ranks get to exit on shutdown before SIGKILL")
    rank_start_timeout_s: float = opt(900.0, "a rank that has not said Hello this long after it started is "
                                             "marked dead in /health (0: wait forever)")
    supervise: bool = opt(False, "restart a rank that died (exited, hung, or never became ready)")
    max_restarts: int = opt(3, "with --supervise: restarts per rank name, then it stays dead")
    restart_backoff_s: float = opt(1.0, "with --supervise: wait before a restart, doubled per restart of that rank")
    cluster_secret: str = opt("", "shared secret every rank must prove (ZeroMQ CURVE on rank sockets); default "
                                  "$PDSERVE_CLUSTER_SECRET, else a random one when this launcher starts the ranks; "
                                  "passed to the ranks in their environment")
    lend_cores: bool = opt(True, "steps of at most 1024 rows (decode batches, prefill chunks; float32 on AVX2: "
                                 "decode steps of at most 16 rows) run on the torch threads of this host's "
                                 "idle ranks too (a lone prompt prefills on every core); the kernels give "
                                 "their rows the same bits at any thread count")
    lend_idle_cores: bool = opt(False, "every step, larger ones too, runs on the threads of this host's idle "
                                       "ranks. Off by default: steps above 1024 rows use oneDNN's GEMM, which "
                                       "rounds differently at another thread count, so outputs then depend on "
                                       "timing in their last bits (greedy text can differ)")
    pin_cores: bool = opt(True, "where the ranks' threads fit this host's cores (ranks x threads <= cores of the "
                                "launcher's cpuset), pin each rank to disjoint cores; a rank borrowing idle "
                                "ranks' cores runs on the whole cpuset meanwhile. With more ranks than cores "
                                "nothing is pinned")
    prefill_nice: int = opt(0, "PD mode: prefill ranks run this much nicer than decode ranks (0-19), so where "
                               "they share cores the OS runs decode steps first (inter-token latency) and "
                               "prompts on what is left")
    share_weights: bool = opt(True, "CPU ranks map one read-only copy of the weights (and the linear kernel's "
                                    "packed copies) from a file on tmpfs instead of each holding its own "
                                    "(engine/shared_weights.py)")
    ray: str = opt("", "place the ranks on a Ray cluster (its address, or auto: the one `ray start` runs on this "
                       "host) as actors; the router stays here. Ray restarts a dead rank (--max-restarts, "
                       "--restart-backoff-s). Needs scripts/setup_ray.sh; docs/deployment.md")
    ray_placement: str = opt("spread", "with --ray: spread the ranks over the nodes or pack them onto as few as "
                                       "fit (nodes started with --resources '{\"pdserve_prefill\": 1}' or "
                                       "pdserve_decode take only that role's ranks)")

    def __post_init__(self) -> None:
        if min(self.colocated, self.prefill, self.decode) < 0:
            raise ValueError("rank counts must be >= 0")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("PD mode needs both --prefill N and --decode M (N, M >= 1)")
        if self.pd and self.fake_ranks:
            raise ValueError("--fake-ranks runs colocated stand-ins only")
        if self.rank_start_timeout_s < 0 or self.max_restarts < 0 or self.restart_backoff_s < 0:
            raise ValueError("rank_start_timeout_s, max_restarts and restart_backoff_s must be >= 0")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError(f"prefill_nice must be in 0..19, got {self.prefill_nice}")
        if self.prefill_nice and not self.pd:
            raise ValueError("--prefill-nice needs PD mode (--prefill N --decode M)")
        if self.ray_placement not in ("spread", "pack"):
            raise ValueError(f"ray_placement must be spread or pack, got {self.ray_placement!r}")
        if self.ray and not self.num_ranks:
            raise ValueError("--ray places ranks: give --colocated N or --prefill N --decode M")

    @property
    def pd(self) -> bool:
        return self.prefill > 0

    @property
    def roles(self) -> list[tuple[str, int]]:
        """(role, count) of the ranks to start."""
        return [("prefill", self.prefill), ("decode", self.decode)] if self.pd else [("colocated", self.colocated)]

    @property
    def num_ranks(self) -> int:
        return sum(n for _, n in self.roles)


def rank_command(engine_cfg, launch: LaunchConfig, role: str, index: int, router_addr: str,
                 handoff: HandoffConfig | None = None, core_board: str = "", cpus: list[int] | None = None) -> list[str]:
    """The command line of rank `role`-`index`. `cpus`: the launcher's cpuset, to pin the rank to
    its share of (with --pin-cores, where every rank's threads fit)."""
    module = "rank_runtime.fake_rank" if launch.fake_ranks else \
        {"prefill": "prefill.rank", "decode": "decode.rank", "colocated": "rank_runtime.colocated"}[role]
    cmd = [sys.executable, "-m", module, "--role", role, "--index", str(index), "--router-addr", router_addr]
    slot = index + (launch.prefill if role == "decode" else 0)  # prefill (or colocated) ranks, then decode ranks
    if core_board and not launch.fake_ranks:
        cmd += ["--core-board", core_board, "--core-slot", str(slot)]
        if launch.lend_idle_cores:
            cmd += ["--lend-all"]
    if cpus and launch.pin_cores and not launch.fake_ranks and engine_cfg.device == "cpu":
        home = home_cpus(slot, max(1, engine_cfg.num_threads), cpus, launch.num_ranks)
        if home:
            cmd += ["--cpus", ",".join(map(str, home))]
    if role == "prefill" and launch.prefill_nice:  # PD only, so never fake ranks
        cmd += ["--nice", str(launch.prefill_nice)]
    if role in ("prefill", "decode"):
        cmd += ["--host", launch.prefill_host if role == "prefill" else launch.decode_host]
        for f in fields(HandoffConfig):  # (a bool as --x / --no-x)
            v, flag = getattr(handoff or HandoffConfig(), f.name), "--" + f.name.replace("_", "-")
            cmd += [flag if v else "--no-" + flag[2:]] if isinstance(v, bool) else [flag, str(v)]
    for f in fields(engine_cfg):  # only what differs from the engine's defaults
        value = getattr(engine_cfg, f.name)
        if f.name == "hicache_shm_name" and value and engine_cfg.hicache_scope == "rank":
            value = f"{value}-{role}-{index}"  # one host cache file per rank
        if value != f.default:
            cmd += ["--" + f.name.replace("_", "-"), str(value)]
    if launch.fake_ranks:
        cmd += ["--step-ms", str(launch.fake_step_ms)]
    return cmd


def make_weights_dir() -> Path:
    """This launcher's directory for the ranks' shared weights (engine/shared_weights.py), on tmpfs
    where there is one; those of launchers that are gone are removed first."""
    from engine.shared_weights import PREFIX
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    remove_stale_launcher_paths(shm, PREFIX)
    return settings.private_dir(shm / f"{PREFIX}{os.getpid()}")  # (0700; another user's is refused)


def shared_weights_config(engine_cfg, launch: LaunchConfig):
    """(the ranks' engine config, this launcher's weights directory or None): with share_weights and
    2+ CPU ranks a new one of this launcher's (removed at its stop) unless --shared-weights-dir names one."""
    if not launch.share_weights:
        return replace(engine_cfg, shared_weights_dir=""), None
    if engine_cfg.shared_weights_dir or launch.num_ranks < 2 or engine_cfg.device != "cpu" or launch.fake_ranks:
        return engine_cfg, None
    d = make_weights_dir()
    return replace(engine_cfg, shared_weights_dir=str(d)), d


def disagg_costs_for_dtype(cfg: RouterConfig, launch: LaunchConfig, engine_cfg) -> RouterConfig:
    """PD with --disagg auto and no --disagg-costs: the repository's curves measured in the ranks' dtype
    (float32 without native bf16: Zen 3's prefills 2.4-3.0x bf16's, decode steps 1.4-1.9x), else as found."""
    if not launch.pd or cfg.disagg != "auto" or cfg.disagg_costs:
        return cfg
    from engine.model_cache import served_name
    from pd_server.disagg_costs import find_costs

    found = find_costs(served_name(engine_cfg.model), dtype=engine_cfg.dtype)
    return cfg if found.source == "builtin" else replace(cfg, disagg_costs=found.source)


DECODE_PACK = 8  # --decode-pack auto where the ranks share cores (docs/results/mission.md run 9)


def decode_pack_for_host(cfg: RouterConfig, launch: LaunchConfig, threads: int, cores: int) -> RouterConfig:
    """--decode-pack auto (-1): DECODE_PACK where this launcher starts several decode ranks and its ranks'
    threads outnumber the cores (decode ranks time-share cores: two small batches cost more than one larger
    one and buy no parallelism), else 0 (spread by load); a set value stays."""
    if cfg.decode_pack >= 0:
        return cfg
    shared = launch.pd and launch.decode > 1 and not launch.ray and launch.num_ranks * max(1, threads) > cores
    return replace(cfg, decode_pack=DECODE_PACK if shared else 0)


async def serve(cfg: RouterConfig, engine_cfg, launch: LaunchConfig, model_dir: Path, model_name: str,
                handoff: HandoffConfig | None = None) -> None:
    """Run the router and its ranks until a signal; `model_dir` is the resolved checkpoint
    (engine/model_cache.py), `model_name` the served id."""
    import uvicorn

    from pd_server.app import build_app
    from pd_server.dispatcher import Dispatcher
    from pd_server.http_protocol import connection_limit, header_timeout_protocol
    from pd_server.metrics import RouterMetrics
    from pd_server.prompts import ChatRenderer
    from pd_server.ranks import RankRegistry
    from pd_server.routing import make_policy
    from pd_server.serving import ServerContext
    from launcher.supervisor import Supervisor

    from engine.model_cache import served_name

    cfg = disagg_costs_for_dtype(cfg, launch, engine_cfg)
    registry, metrics = RankRegistry(served_name(engine_cfg.model)), RouterMetrics()
    dispatcher = Dispatcher(cfg, registry, make_policy(cfg.routing_policy), metrics,
                            secret=launch.cluster_secret)
    addr = dispatcher.bind()
    log.info("rank socket at %s%s", addr, " (CURVE, cluster secret)" if launch.cluster_secret else "")
    board = ""
    if (launch.lend_cores or launch.lend_idle_cores) and launch.num_ranks > 1 and engine_cfg.device == "cpu":
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        board = str(create_board(board_path(shm, os.getpid()), launch.num_ranks, engine_cfg.num_threads,
                                 len(host_cpus())))
    engine_cfg, weights_dir = shared_weights_config(engine_cfg, launch)
    cpus = host_cpus()

    def command(role: str, i: int) -> list[str]:
        return rank_command(engine_cfg, launch, role, i, addr, handoff, board, cpus)

    if launch.ray:
        from launcher.ray_ranks import RayRanks

        try:
            sup = RayRanks(registry, command, launch.roles, engine_cfg.num_threads,
                           1.0 if engine_cfg.device.startswith("cuda") else 0.0, launch.max_restarts,
                           launch.restart_backoff_s, launch.rank_start_timeout_s, launch.ray_placement, launch.run_dir,
                           {SECRET_ENV: launch.cluster_secret} if launch.cluster_secret else {})
        except RuntimeError as e:
            log.error("%s", e)
            await dispatcher.close()
            raise SystemExit(1) from e
    else:
        sup = Supervisor(registry, command, launch.run_dir, launch.max_restarts if launch.supervise else 0,
                         launch.restart_backoff_s, launch.rank_start_timeout_s)
    for role, count in launch.roles:
        for i in range(count):
            sup.start(role, i)
    if not launch.num_ranks:
        log.info("router only: ranks join by connecting to %s", addr)
    from transformers import AutoTokenizer

    # After the ranks started: they load meanwhile (their Hellos wait in the socket).
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except BaseException:
        sup.reap(0.0)  # the ranks started: stop them before giving up
        raise
    ctx = ServerContext(cfg, model_name, frozenset({model_name, engine_cfg.model}), tokenizer,
                        ChatRenderer(tokenizer), registry, dispatcher, metrics)
    server = uvicorn.Server(uvicorn.Config(build_app(ctx), host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False, lifespan="off", timeout_graceful_shutdown=2,
                                           timeout_keep_alive=cfg.keep_alive_s,
                                           http=header_timeout_protocol(cfg.header_timeout_s,
                                                                        connection_limit(cfg.max_connections))))
    # uvicorn captures SIGINT/SIGTERM while serving and re-raises them afterwards: make that a no-op
    # so the cleanup below always runs.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    dispatcher.start()
    watch = asyncio.create_task(sup.run(), name="supervisor")
    log.info("serving %s on http://%s:%d with %d rank(s)", model_name, cfg.host, cfg.port, launch.num_ranks)
    # Everything loaded so far (tokenizer, app, modules) lives as long as the router: keep it out
    # of the cyclic GC's generations, whose full passes otherwise rescan it while tokens stream.
    gc.freeze()
    try:
        await server.serve()
    finally:
        watch.cancel()
        sup.stopping()  # the ranks' exits on Shutdown are not deaths to restart
        await dispatcher.close()
        await asyncio.to_thread(sup.reap, launch.rank_shutdown_s)
        if board:
            Path(board).unlink(missing_ok=True)
        if weights_dir is not None:
            shutil.rmtree(weights_dir, ignore_errors=True)
        remove_host_cache(engine_cfg.hicache_shm_name)
        log.info("stopped")


def _pools_for_dtype(engine_cfg, handoff: HandoffConfig, argv: list[str], num_ranks: int):
    """The host cache's and the handoff pool's default sizes hold as many tokens in float32 (the
    dtype --dtype auto picks without native bf16) as in bf16: twice the GiB. Sizes given stay as
    given. One host cache for the host (the default scope): hicache/host_plan.py sizes and names it."""
    scale = {"float32": 2.0}.get(engine_cfg.dtype, 1.0)

    def given(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in argv)

    if scale != 1.0 and not given("--hicache-size-gb"):
        engine_cfg = replace(engine_cfg, hicache_size_gb=engine_cfg.hicache_size_gb * scale)
    engine_cfg = plan_host_cache(engine_cfg, num_ranks, given)
    if scale != 1.0 and not given("--handoff-pool-gb"):
        handoff = replace(handoff, handoff_pool_gb=handoff.handoff_pool_gb * scale)
    return engine_cfg, handoff


def main(argv: list[str] | None = None) -> int:
    from engine.config import EngineConfig, add_cli_args, from_cli_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(ap, LaunchConfig)
    add_dataclass_args(ap, RouterConfig)
    add_dataclass_args(ap, HandoffConfig)
    add_cli_args(ap, EngineConfig)
    ap.set_defaults(hicache_size_gb=HOST_CACHE_GB, hicache_scope="host")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    try:
        launch, cfg = from_args(args, LaunchConfig), from_args(args, RouterConfig)
        engine_cfg, handoff = from_cli_args(args, EngineConfig), from_args(args, HandoffConfig)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    store_host = "127.0.0.1"  # --kv-store mooncake: where the master listens
    if launch.ray:
        try:
            from launcher.ray_ranks import configs_for_ray

            cfg, launch, engine_cfg, store_host = configs_for_ray(cfg, launch, engine_cfg)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
    # No secret given and the ranks are this launcher's: one of this start's (CURVE on every rank socket).
    secret = launch.cluster_secret or settings.cluster_secret() or (token_urlsafe(32) if launch.num_ranks else "")
    launch = replace(launch, cluster_secret=secret)
    if launch.cluster_secret:
        os.environ[SECRET_ENV] = launch.cluster_secret  # the ranks' environment, not their argv
    elif not cfg.rank_addr.startswith(("ipc://", "tcp://127.")):
        log.warning("rank socket %s is reachable beyond this host and no --cluster-secret is set: anyone who "
                    "reaches it can join as a rank", cfg.rank_addr)
    if launch.pd:
        log.info("PD mode: %d prefill + %d decode rank(s), transfer %s, handoff lease %.1fs", launch.prefill,
                 launch.decode, handoff.transfer, handoff.handoff_lease_s)
    if engine_cfg.num_threads == 0:
        engine_cfg = replace(engine_cfg, num_threads=max(1, len(host_cpus()) // max(1, launch.num_ranks)))
    cfg = decode_pack_for_host(cfg, launch, engine_cfg.num_threads, len(host_cpus()))
    log.info("%d rank(s), %d torch thread(s) each, %s%s", launch.num_ranks, engine_cfg.num_threads, engine_cfg.dtype,
             f"; decode ranks filled {cfg.decode_pack} requests at a time (--decode-pack)" if cfg.decode_pack else "")
    engine_cfg, handoff = _pools_for_dtype(engine_cfg, handoff, argv if argv is not None else sys.argv[1:],
                                           0 if launch.fake_ranks else launch.num_ranks)
    from engine.model_cache import cached_model_dir, served_name

    model_dir = cached_model_dir(engine_cfg.model)  # converts a GGUF once, before any rank starts
    model_name = cfg.served_model_name or served_name(engine_cfg.model)
    try:  # --kv-store mooncake: a master for this system (every node's ranks join it), stopped with it
        with store_for_launch(engine_cfg.kv_store, Path(launch.run_dir or tempfile.gettempdir()), store_host) as kv:
            asyncio.run(serve(cfg, replace(engine_cfg, kv_store=kv), launch, model_dir, model_name, handoff))
    except StoreUnavailable as e:
        print(f"error: --kv-store {engine_cfg.kv_store}: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
