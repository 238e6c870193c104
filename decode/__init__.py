"""Rank processes: an engine driven by the router over ZeroMQ.

    rank.py       the engine thread: admit Generate, step, send TokenBatch (life cycle there)
    rank_link.py  the IO thread: DEALER to the router, Hello/Welcome, heartbeats, exit rules
    fake_rank.py  a stand-in rank that emits tokens as fast as it can (benchmarks, router tests)
    config.py     RankConfig (CLI flags generated from it)
Today a rank runs colocated (prefill and decode in one engine). The decode-only role
(import the prefill rank's KV, then decode) lands here with the prefill/decode issue.
"""
