"""The per-token histogram buckets exactly as prometheus_client's own Histogram does."""
from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pd_server.metrics import _ITL, TokenHistogram


def test_token_histogram_matches_prometheus_histogram():
    reg_a, reg_b = CollectorRegistry(), CollectorRegistry()
    fast = TokenHistogram("x_seconds", "h", buckets=_ITL, registry=reg_a)
    ref = Histogram("x_seconds", "h", buckets=_ITL, registry=reg_b)
    rng = random.Random(0)
    values = [rng.choice(_ITL) for _ in range(200)]  # exactly on the bounds: `le` is inclusive
    values += [rng.uniform(0, 10) for _ in range(2000)] + [0.0, 1e9]
    for v in values:
        fast.observe(v)
        ref.observe(v)
    def samples(reg):  # `_created` is each metric's creation time: the only line allowed to differ
        return [ln for ln in generate_latest(reg).decode().splitlines() if "_created" not in ln]

    assert samples(reg_a) == samples(reg_b)
    assert any('le="0.001"' in ln for ln in samples(reg_a))
