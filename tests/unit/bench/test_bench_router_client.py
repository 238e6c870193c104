"""bench/bench_router.py's load clients read what a writer streams: every token counted, one
latency per token once past the steady mark, stamps parsed across reads (the C++ client and the
Python one, against the floor writer: no router, no rank)."""
from __future__ import annotations

import shutil

import pytest

from bench import bench_router


@pytest.mark.parametrize("client", ["c", "epoll"])
def test_clients_count_every_token_of_the_floor_writer(client):
    if client == "c" and shutil.which("c++") is None:
        pytest.skip("no c++ to build bench/stream_client.cpp")
    fn = bench_router.run_streams_c if client == "c" else bench_router.run_streams
    lat = bench_router.floor_reference(fn, streams=3, steps=6, step_ms=5.0, warmup_s=0.0)
    assert len(lat) == 3 * 6
    assert all(0.0 <= x < 5.0 for x in lat)


def test_c_client_skips_tokens_before_the_steady_mark():
    if shutil.which("c++") is None:
        pytest.skip("no c++ to build bench/stream_client.cpp")
    # steady 1 h from now: every token is counted, none is timed
    lat = bench_router.floor_reference(bench_router.run_streams_c, streams=2, steps=4, step_ms=5.0, warmup_s=3600.0)
    assert lat == []
