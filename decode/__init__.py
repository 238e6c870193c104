"""Rank processes: an engine driven by the router over ZeroMQ.

    rank.py              the engine thread: RankLoop (colocated) and DecodeLoop (PD decode), main
    handoff_receiver.py  decode role: queue Handoffs, pull their KV when there is room, commit
    rank_link.py         the IO thread: DEALER to the router, Hello/Welcome, heartbeats, exit rules
    peer_link.py         PD ranks' rank-to-rank sockets, driven by the IO thread
    fake_rank.py         a stand-in rank that emits tokens as fast as it can (benchmarks, router tests)
    config.py            RankConfig, HandoffConfig (CLI flags generated from them)
The prefill role (prefill/) reuses the link, the peer sockets and RankLoop.
"""
