"""A colocated rank: one engine that prefills and decodes every request the router sends it.

    python -m rank_runtime.colocated --index 0 --router-addr tcp://127.0.0.1:5555 [--host H] [engine flags]

The request life cycle is RankLoop's (loop.py); start-up and exit are serve.py's.
"""
from __future__ import annotations

import logging
import sys
import time

from rank_runtime.loading import load_engine
from rank_runtime.loop import RankLoop
from rank_runtime.router_link import RankLink
from rank_runtime.serve import hello_for, parse_rank_args, serve

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    cfg, _, engine_cfg = parse_rank_args(argv, __doc__, "colocated")
    if cfg.role != "colocated":
        print(f"error: rank_runtime.colocated runs --role colocated, not {cfg.role!r} (decode.rank, prefill.rank)",
              file=sys.stderr)
        return 2
    t0 = time.monotonic()
    engine = load_engine(engine_cfg, cfg.warmup)
    log.info("engine ready in %.1fs (model %s, max_model_len %d, %d KV pages)", time.monotonic() - t0,
             engine_cfg.model, engine.max_model_len, engine.pool.num_pages)
    loop = RankLoop(engine)
    return serve(cfg, engine, loop, RankLink(cfg, hello_for(cfg, engine_cfg, engine), loop.stats))


if __name__ == "__main__":
    sys.exit(main())
