"""What every rank process shares, whatever its role: the engine thread's loop (loop.py), the
router link (router_link.py), the rank-to-rank sockets (peer_link.py), start-up and exit
(serve.py, loading.py), the rank's flags (config.py), core lending (core_board.py), test-only
fault injection (faults.py), the colocated role (colocated.py) and the stand-in rank
(fake_rank.py). The PD roles build on it: decode/ and prefill/, neither importing the other.
"""
