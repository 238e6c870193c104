"""The per-token histogram buckets exactly as prometheus_client's own Histogram does; the
prefill-placement counter's exposition."""
from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pd_server.metrics import _ITL, RouterMetrics, TokenHistogram


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


def test_token_histogram_batches_and_repeated_collections_match_prometheus_histogram():
    reg_a, reg_b = CollectorRegistry(), CollectorRegistry()
    fast = TokenHistogram("x_seconds", "h", buckets=_ITL, registry=reg_a)
    ref = Histogram("x_seconds", "h", buckets=_ITL, registry=reg_b)
    rng = random.Random(1)

    def samples(reg):
        return [ln for ln in generate_latest(reg).decode().splitlines() if "_created" not in ln]

    def split(lines):  # the sum is added batch by batch: equal up to float rounding order
        rest = [ln for ln in lines if not ln.startswith("x_seconds_sum")]
        return rest, float(next(ln for ln in lines if ln.startswith("x_seconds_sum")).split()[1])

    for _ in range(3):  # observations between collections add up; a collection loses none
        batch = [rng.uniform(0, 0.2) for _ in range(500)] + [rng.choice(_ITL)]
        fast.observe_all(batch)
        for v in batch:
            ref.observe(v)
        for _ in range(2):
            (a, sa), (b, sb) = split(samples(reg_a)), split(samples(reg_b))
            assert a == b and abs(sa - sb) < 1e-9 * sb


def test_prefill_placement_counter_by_where():
    m = RouterMetrics()
    m.prefill_placement.labels("decode").inc()
    m.prefill_placement.labels("decode").inc()
    m.prefill_placement.labels("prefill").inc()
    lines = m.render().decode().splitlines()
    assert 'pdserve_prefill_placement_total{where="decode"} 2.0' in lines
    assert 'pdserve_prefill_placement_total{where="prefill"} 1.0' in lines
