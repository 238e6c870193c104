"""Prefill ranks (PD mode): run prompts, hand their KV pages to a decode rank.

    rank.py            the engine thread's PrefillLoop and `python -m prefill.rank` (life cycle there)
    handoff_sender.py  the handoff pool (shared memory, registered with the transfer backend):
                       reserve -> stage -> hand off -> release exactly once (Pulled, PullFailed, lease)
A prefill rank reuses the decode package's router link (decode/rank_link.py), peer sockets
(decode/peer_link.py) and RankLoop; its messages to decode ranks are in
pd_server/protocol/prefill_decode.py.
"""
