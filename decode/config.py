"""A rank process's own knobs (the engine's are engine.config.EngineConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from pd_server.cli_args import opt
from pd_server.protocol import ROLES, Role


@dataclass(frozen=True)
class RankConfig:
    role: Role = opt("colocated", "what this rank does")
    index: int = opt(0, "rank index within its role (names the rank: colocated-0)")
    router_addr: str = opt("", "ZeroMQ address of the router's rank socket, e.g. tcp://127.0.0.1:5555")
    router_timeout_s: float = opt(5.0, "exit when the router has been silent this long (it pings every 0.5 s)")
    connect_timeout_s: float = opt(60.0, "exit when no router welcomes this rank within this long")
    hello_interval_s: float = opt(2.0, "repeat Hello this often until the router answers")
    warmup: bool = opt(True, "run one tiny request before saying Hello (kernel builds, first-step costs)")

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.index < 0:
            raise ValueError("index must be >= 0")
        if not self.router_addr:
            raise ValueError("router_addr is required (the router prints it at start)")
        if self.router_timeout_s <= 0 or self.connect_timeout_s <= 0 or self.hello_interval_s <= 0:
            raise ValueError("timeouts and intervals must be > 0")

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"
