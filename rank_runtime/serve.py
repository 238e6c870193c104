"""Starting a rank process: its command line, its Hello, and the loop that runs it until it must exit.

Each role's main (rank_runtime/colocated.py, decode/rank.py, prefill/rank.py) parses its flags
with parse_rank_args, loads its engine (loading.py), builds its RankLoop and RankLink and
calls serve(). The process exits when the router rejects it, asks it to, or goes silent
(router_link.py), and on SIGTERM/SIGINT: nothing is left behind by a dead router. With
--rejoin it drops every request instead when the router goes away (RouterLost) and joins the
next router as a fresh rank.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from cluster import settings
from cluster.cli_args import add_dataclass_args, from_args
from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.rank_router import Hello
from rank_runtime.config import HandoffConfig, RankConfig
from rank_runtime.faults import FAULT_ENV, apply_engine_faults, faults_for
from rank_runtime.loop import RankLoop
from rank_runtime.router_link import RankLink

log = logging.getLogger(__name__)


def hello_for(cfg: RankConfig, engine_cfg, engine, peer_addr: str = "") -> Hello:
    from engine.model_cache import served_name

    hc = engine.hicache  # a decode rank's holds the prompts it prefilled itself (--disagg)
    return Hello(PROTOCOL_VERSION, cfg.role, cfg.index, os.getpid(), served_name(engine_cfg.model),
                 engine.max_model_len, engine.model_cfg.vocab_size, engine_cfg.page_size, engine.pool.num_pages,
                 peer_addr, hc.index.root if hc else b"", hc.has_swa if hc else False, node_name(),
                 f"{node_name()}|{engine_cfg.hicache_shm_name}" if hc is not None and hc.shared else "")


def node_name() -> str:
    """This rank's host for /health: $PDSERVE_NODE (set by a Ray actor: host, IP, node id), else the hostname."""
    import socket

    return settings.node() or socket.gethostname()


def parse_rank_args(argv, description: str, default_role: str):
    """(RankConfig, HandoffConfig, EngineConfig) from the command line; sets up logging."""
    from engine.config import EngineConfig, add_cli_args, from_cli_args

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(ap, RankConfig)
    add_dataclass_args(ap, HandoffConfig)
    add_cli_args(ap, EngineConfig)
    ap.set_defaults(role=default_role)
    args = ap.parse_args(argv)
    cfg = from_args(args, RankConfig)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {cfg.name} %(levelname)s %(name)s: %(message)s")
    return cfg, from_args(args, HandoffConfig), from_cli_args(args, EngineConfig)


def start_role(argv, description: str, role: str, module: str):
    """A role main's start: its flags (refusing another --role, SystemExit 2) and its loaded
    engine. Returns (RankConfig, HandoffConfig, EngineConfig, engine)."""
    import time

    from rank_runtime.loading import load_engine

    cfg, handoff, engine_cfg = parse_rank_args(argv, description, role)
    if cfg.role != role:
        print(f"error: {module} runs --role {role}, not {cfg.role!r} (rank_runtime.colocated, decode.rank, "
              "prefill.rank)", file=sys.stderr)
        raise SystemExit(2)
    t0 = time.monotonic()
    engine = load_engine(engine_cfg, cfg.warmup)
    log.info("engine ready in %.1fs (model %s, max_model_len %d, %d KV pages)", time.monotonic() - t0,
             engine_cfg.model, engine.max_model_len, engine.pool.num_pages)
    return cfg, handoff, engine_cfg, engine


def serve(cfg: RankConfig, engine, loop: RankLoop, link: RankLink, closers=()) -> int:
    """Run `loop` on this thread with `link` on its IO thread until the rank must exit."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: link.stop(f"signal {signal.Signals(signum).name}"))
    apply_engine_faults(engine, faults_for(cfg.name))
    if faults_for(cfg.name).hang_before_hello:
        log.warning("fault injected (%s): never saying Hello", FAULT_ENV)
        while not link.stopped.wait(0.2):
            pass
    from rank_runtime.core_board import host_cpus, pin_threads

    host = host_cpus()  # the launcher's cpuset, before this rank narrows to its own cores
    if cfg.cpu_list:
        pin_threads(cfg.cpu_list)
        log.info("pinned to cpu(s) %s of %s", cfg.cpus, ",".join(map(str, host)))
    if cfg.nice:
        from rank_runtime.core_board import renice_threads

        log.info("niceness raised by %d on %d thread(s)", cfg.nice, renice_threads(cfg.nice))
    if cfg.core_board:
        import torch

        from rank_runtime.core_board import CoreBoard

        # Steps borrow where their bits do not depend on the thread count (the engine says which).
        loop.board = CoreBoard(cfg.core_board, cfg.core_slot, torch.get_num_threads(), lend_all=cfg.lend_all,
                               invariant_rows=None if engine is None else engine.invariant_rows(),
                               home=cfg.cpu_list, host=host)
        closers = (*closers, loop.board.close)
        log.info("core board %s slot %d: %d own thread(s), up to %d on cores no other rank holds, for %s",
                 cfg.core_board, cfg.core_slot, loop.board.own, loop.board.max,
                 "every step" if cfg.lend_all or loop.board.invariant_rows == sys.maxsize
                 else f"steps of at most {loop.board.invariant_rows} rows"
                 + (" of decode rows only" if engine is not None and engine.invariant_steps()[1] else ""))
    if engine is not None:
        engine.runner.model.between_layers = loop.between_layers
        if settings.step_log_dir() is not None:
            from rank_runtime.step_log import StepLog

            loop.step_log = StepLog(settings.step_log_dir(), cfg.role, cfg.index)
            closers = (*closers, loop.step_log.close)
            log.info("step log: %s", loop.step_log.path)
    link.start()
    try:
        loop.run(link)
    finally:
        link.close()
        for close in (*closers, getattr(engine, "close", None)):  # engine: the host cache's shm
            if close is not None:
                close()
        log.info("exiting: %s", link.stop_reason)
    return link.exit_code
