"""Prefill ranks (PD mode): run prompts, hand their KV pages to a decode rank.

    rank.py            the engine thread's PrefillLoop and `python -m prefill.rank` (life cycle there)
    handoff_sender.py  the handoff pool (shared memory, registered with the transfer backend):
                       reserve -> stage -> hand off -> release exactly once (Pulled, PullFailed, lease)
Built on rank_runtime/ (loop, router link, peer sockets, start-up); never imports decode/. Its
messages to decode ranks are in cluster/protocol/prefill_decode.py.
"""
