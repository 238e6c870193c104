"""Start a whole system in one process group: the router here, its ranks as child processes.

    python -m pd_server.launch --colocated 2 [--model NAME|PATH] [--port 8000] [--host 127.0.0.1]
                               [router flags] [engine flags, forwarded to every rank]
    python -m pd_server.launch --prefill 1 --decode 1 [--transfer auto|nixl|shm] [--handoff-lease-s 10]
                               [--handoff-pool-gb 0.25] [--prefill-host IP] [--decode-host IP] ...

  1. Resolve the model once here (GGUF conversion, if any, happens before ranks start) and
     load its tokenizer.
  2. Bind the rank socket (tcp://127.0.0.1:<free port> by default) and start each rank
     (`python -m decode.rank --role colocated|decode`, `python -m prefill.rank`) pointed at
     it, its logs in --run-dir when given. CPU threads are divided among the ranks (engine
     --num-threads 0 -> cores // ranks, at least 1). PD mode (--prefill N --decode M, no
     colocated ranks): the handoff flags go to every PD rank, --prefill-host/--decode-host
     become their --host (their rank-to-rank address); the router introduces them (Peers).
     Every rank gets a host KV cache of --hicache-size-gb GiB (0.25 by default here; 0 turns
     it off): prefix hits across requests, and what cache-aware routing routes by.
  3. Serve HTTP (uvicorn) until SIGINT/SIGTERM; /health turns 200 once every rank said Hello.
  4. On the way out: Shutdown to every rank, wait a few seconds, then SIGTERM/SIGKILL any
     that remain. Ranks also exit by themselves when the router goes silent.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

from decode.config import HandoffConfig
from pd_server.cli_args import add_dataclass_args, from_args, opt
from pd_server.config import RouterConfig

log = logging.getLogger("pd_server.launch")
EXIT_USAGE = 2
# GiB of shared memory per rank for its host KV cache (the engine's default is off). 0.25 GiB is
# ~11k tokens of smollm2-135m in bf16; 2 ranks + router fit a 24 GiB box with plenty to spare.
HOST_CACHE_GB = 0.25


@dataclass(frozen=True)
class LaunchConfig:
    colocated: int = opt(1, "colocated ranks to start (each prefills and decodes)")
    prefill: int = opt(0, "prefill ranks (PD mode, with --decode; then --colocated is ignored)")
    decode: int = opt(0, "decode ranks (PD mode, with --prefill)")
    prefill_host: str = opt("127.0.0.1", "PD: the prefill ranks' --host (address they connect to decode ranks from)")
    decode_host: str = opt("127.0.0.1", "PD: the decode ranks' --host (address their peer socket binds)")
    run_dir: str = opt("", "directory for rank logs (default: ranks log to this process's stderr)")
    fake_ranks: bool = opt(False, "start stand-in ranks (decode/fake_rank.py, no model) for router benchmarks/tests")
    fake_step_ms: float = opt(0.0, "with --fake-ranks: pause between their steps (0: as fast as they can)")
    rank_shutdown_s: float = opt(5.0, "how long ranks get to exit on shutdown before SIGKILL")

    def __post_init__(self) -> None:
        if min(self.colocated, self.prefill, self.decode) < 0:
            raise ValueError("rank counts must be >= 0")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("PD mode needs both --prefill N and --decode M (N, M >= 1)")
        if self.pd and self.fake_ranks:
            raise ValueError("--fake-ranks runs colocated stand-ins only")

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
                 handoff: HandoffConfig | None = None) -> list[str]:
    module = {"prefill": "prefill.rank"}.get(role, "decode.fake_rank" if launch.fake_ranks else "decode.rank")
    cmd = [sys.executable, "-m", module, "--role", role, "--index", str(index), "--router-addr", router_addr]
    if role in ("prefill", "decode"):
        cmd += ["--host", launch.prefill_host if role == "prefill" else launch.decode_host]
        for f in fields(HandoffConfig):
            cmd += ["--" + f.name.replace("_", "-"), str(getattr(handoff or HandoffConfig(), f.name))]
    for f in fields(engine_cfg):  # only what differs from the engine's defaults
        value = getattr(engine_cfg, f.name)
        if f.name == "hicache_shm_name" and value:
            value = f"{value}-{role}-{index}"  # one host cache file per rank
        if value != f.default:
            cmd += ["--" + f.name.replace("_", "-"), str(value)]
    if launch.fake_ranks:
        cmd += ["--step-ms", str(launch.fake_step_ms)]
    return cmd


def spawn_ranks(engine_cfg, launch: LaunchConfig, router_addr: str, registry,
                handoff: HandoffConfig | None = None) -> list[subprocess.Popen]:
    procs = []
    if launch.run_dir:
        Path(launch.run_dir).mkdir(parents=True, exist_ok=True)
    for role, count in launch.roles:
        for i in range(count):
            log_file = None
            if launch.run_dir:
                log_file = open(Path(launch.run_dir) / f"rank-{role}-{i}.log", "ab")  # noqa: SIM115 - child owns it
            cmd = rank_command(engine_cfg, launch, role, i, router_addr, handoff)
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file,
                                    stderr=subprocess.STDOUT if log_file else None)
            if log_file:
                log_file.close()
            registry.expect(role, i, proc)
            procs.append(proc)
            log.info("started %s-%d (pid %d)", role, i, proc.pid)
    return procs


def reap(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Wait for ranks to exit; SIGTERM then SIGKILL the ones that do not; then remove the
    shared-memory files of ranks that could not (killed ranks leave them behind)."""
    for sig, wait in ((None, grace_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            break
        for p in alive:
            if sig is not None:
                p.send_signal(sig)
        for p in alive:
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
    remove_rank_shm([p.pid for p in procs if p.poll() is not None])


def remove_rank_shm(pids: list[int], shm_dir: Path = Path("/dev/shm")) -> list[Path]:
    """Unlink the files a rank names with its pid (handoff pools `pdserve-handoff-<rank>-<pid>-*`,
    default host caches `pdserve-hicache-<pid>-*`) for ranks that exited. Returns what it removed."""
    removed = []
    for pid in pids:
        for pattern in (f"pdserve-handoff-*-{pid}-*", f"pdserve-hicache-{pid}-*"):
            for f in shm_dir.glob(pattern):
                f.unlink(missing_ok=True)
                removed.append(f)
    if removed:
        log.info("removed %d shared-memory file(s) left by exited ranks", len(removed))
    return removed


async def serve(cfg: RouterConfig, engine_cfg, launch: LaunchConfig, tokenizer, model_name: str,
                handoff: HandoffConfig | None = None) -> None:
    """Run the router and its ranks until a signal; `model_name` is the served id."""
    import uvicorn

    from pd_server.app import build_app
    from pd_server.dispatcher import Dispatcher
    from pd_server.metrics import RouterMetrics
    from pd_server.prompts import ChatRenderer
    from pd_server.ranks import RankRegistry
    from pd_server.routing import make_policy
    from pd_server.serving import ServerContext

    from engine.model_cache import served_name

    registry, metrics = RankRegistry(served_name(engine_cfg.model)), RouterMetrics()
    dispatcher = Dispatcher(cfg, registry, make_policy(cfg.routing_policy), metrics)
    addr = dispatcher.bind()
    log.info("rank socket at %s", addr)
    procs = spawn_ranks(engine_cfg, launch, addr, registry, handoff)
    ctx = ServerContext(cfg, model_name, frozenset({model_name, engine_cfg.model}), tokenizer,
                        ChatRenderer(tokenizer), registry, dispatcher, metrics)
    server = uvicorn.Server(uvicorn.Config(build_app(ctx), host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False, lifespan="off", timeout_graceful_shutdown=2))
    # uvicorn captures SIGINT/SIGTERM while serving and re-raises them afterwards: make that a no-op
    # so the cleanup below always runs.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    dispatcher.start()
    log.info("serving %s on http://%s:%d with %d rank(s)", model_name, cfg.host, cfg.port, launch.num_ranks)
    try:
        await server.serve()
    finally:
        await dispatcher.close()
        await asyncio.to_thread(reap, procs, launch.rank_shutdown_s)
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    from engine.config import EngineConfig, add_cli_args, from_cli_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(ap, LaunchConfig)
    add_dataclass_args(ap, RouterConfig)
    add_dataclass_args(ap, HandoffConfig)
    add_cli_args(ap, EngineConfig)
    ap.set_defaults(hicache_size_gb=HOST_CACHE_GB)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    try:
        launch, cfg = from_args(args, LaunchConfig), from_args(args, RouterConfig)
        engine_cfg, handoff = from_cli_args(args, EngineConfig), from_args(args, HandoffConfig)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if launch.num_ranks < 1:
        print("error: start at least one rank (--colocated N, or --prefill N --decode M)", file=sys.stderr)
        return EXIT_USAGE
    if launch.pd:
        log.info("PD mode: %d prefill + %d decode rank(s), transfer %s, handoff lease %.1fs", launch.prefill,
                 launch.decode, handoff.transfer, handoff.handoff_lease_s)
    if engine_cfg.num_threads == 0:
        engine_cfg = replace(engine_cfg, num_threads=max(1, (os.cpu_count() or 1) // launch.num_ranks))
    log.info("%d rank(s), %d torch thread(s) each", launch.num_ranks, engine_cfg.num_threads)

    from transformers import AutoTokenizer

    from engine.model_cache import cached_model_dir, served_name

    model_dir = cached_model_dir(engine_cfg.model)  # converts a GGUF once, before any rank starts
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model_name = cfg.served_model_name or served_name(engine_cfg.model)
    asyncio.run(serve(cfg, engine_cfg, launch, tokenizer, model_name, handoff))
    return 0


if __name__ == "__main__":
    sys.exit(main())
