"""Decode ranks (PD mode): pull each prompt's KV from a prefill rank, then decode in continuous batches.

    rank.py              DecodeLoop (the engine thread's decode role) and `python -m decode.rank`
    handoff_receiver.py  queue Handoffs, renew their leases, pull their KV when there is room, commit
Built on rank_runtime/ (loop, router link, peer sockets, start-up); never imports prefill/.
"""
