"""The router's knobs: one frozen dataclass, validated at construction; CLI flags come from it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pd_server.cli_args import opt

RoutingPolicyName = Literal["cache-aware", "affinity", "least-loaded", "round-robin"]


@dataclass(frozen=True)
class RouterConfig:
    host: str = opt("127.0.0.1", "HTTP bind address (0.0.0.0 exposes the server beyond this machine)")
    port: int = opt(8000, "HTTP port")
    served_model_name: str = opt("", "model id in /v1/models and requests (default: the model's short name)")
    rank_addr: str = opt("tcp://127.0.0.1:*", "ZeroMQ address the rank socket binds (* picks a free port)")
    routing_policy: RoutingPolicyName = opt(
        "cache-aware", "how a request picks its (prefill or colocated) rank; pd_server/routing.py describes each")
    max_inflight_per_rank: int = opt(256, "requests one rank may hold (running + queued); past it: 429")
    heartbeat_interval_s: float = opt(0.5, "router pings and rank stats cadence")
    rank_timeout_s: float = opt(3.0, "a rank silent this long is marked dead")
    log_requests: bool = opt(False, "log one line per request (rank choice, tokens, time)")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_inflight_per_rank < 1:
            raise ValueError("max_inflight_per_rank must be >= 1")
        if self.heartbeat_interval_s <= 0 or self.rank_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("need 0 < heartbeat_interval_s < rank_timeout_s")
        if not self.rank_addr.startswith(("tcp://", "ipc://")):
            raise ValueError(f"rank_addr must be tcp:// or ipc://, got {self.rank_addr!r}")
