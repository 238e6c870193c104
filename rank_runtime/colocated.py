"""A colocated rank: one engine that prefills and decodes every request the router sends it.

    python -m rank_runtime.colocated --index 0 --router-addr tcp://127.0.0.1:5555 [--host H] [engine flags]

The request life cycle is RankLoop's (loop.py); start-up and exit are serve.py's.
"""
from __future__ import annotations

import sys

from rank_runtime.loop import RankLoop
from rank_runtime.router_link import RankLink
from rank_runtime.serve import hello_for, serve, start_role


def main(argv: list[str] | None = None) -> int:
    cfg, _, engine_cfg, engine = start_role(argv, __doc__, "colocated", "rank_runtime.colocated")
    loop = RankLoop(engine)
    return serve(cfg, engine, loop, RankLink(cfg, hello_for(cfg, engine_cfg, engine), loop.stats))


if __name__ == "__main__":
    sys.exit(main())
