"""A rank process's own knobs (the engine's are engine.config.EngineConfig)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cluster import settings
from cluster.cli_args import opt
from cluster.protocol import ROLES, Role

TransferKind = Literal["auto", "nixl", "shm"]


@dataclass(frozen=True)
class RankConfig:
    role: Role = opt("colocated", "what this rank does")
    index: int = opt(0, "rank index within its role (names the rank: colocated-0)")
    router_addr: str = opt("", "ZeroMQ address of the router's rank socket, e.g. tcp://127.0.0.1:5555")
    host: str = opt("127.0.0.1", "this rank's address for rank-to-rank sockets (decode ranks bind "
                                 "tcp://HOST:*, prefill ranks connect from it); another host's IP across hosts")
    router_timeout_s: float = opt(5.0, "exit when the router has been silent this long (it pings every 0.5 s)")
    connect_timeout_s: float = opt(60.0, "exit when no router welcomes this rank within this long")
    hello_interval_s: float = opt(2.0, "repeat Hello this often until the router answers")
    warmup: bool = opt(True, "run one tiny request before saying Hello (kernel builds, first-step costs)")
    rejoin: bool = opt(False, "when the router goes away (connection closed, or silent), drop every request "
                              "and say Hello again (a restarted router takes the rank back) instead of exiting; "
                              "for ranks started by hand")
    cluster_secret: str = opt("", "shared secret of the cluster (ZeroMQ CURVE on rank sockets); default "
                                  "$PDSERVE_CLUSTER_SECRET, which keeps it out of `ps`")
    core_board: str = opt("", "shared-memory file where this host's ranks mark themselves busy or idle; a "
                              "rank then runs steps of at most 1024 rows on the threads of idle ranks too "
                              "(the launcher creates it; see rank_runtime/core_board.py)")
    core_slot: int = opt(0, "this rank's slot on --core-board")
    cpus: str = opt("", "pin every thread of this rank to these cpus (comma-separated; the launcher gives ranks "
                        "disjoint cores where their threads fit the host); while it borrows idle ranks' cores "
                        "its threads may run on the whole cpuset it started with")
    lend_all: bool = opt(False, "with --core-board: larger steps borrow idle ranks' threads too (oneDNN's "
                                "GEMM: their bits then depend on the thread count)")
    nice: int = opt(0, "once loaded, raise the niceness of every thread of this rank by this much (0-19): the OS "
                       "then gives its cores to the ranks at a lower niceness first when they share them")

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.index < 0:
            raise ValueError("index must be >= 0")
        if not self.router_addr:
            raise ValueError("router_addr is required (the router prints it at start)")
        if not self.host or ":" in self.host or "/" in self.host:
            raise ValueError(f"host must be a plain IPv4 address or host name, got {self.host!r}")
        if self.cpus and not all(c.strip().isdigit() for c in self.cpus.split(",")):
            raise ValueError(f"cpus must be a comma-separated list of cpu numbers, got {self.cpus!r}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be in 0..19, got {self.nice}")
        if self.router_timeout_s <= 0 or self.connect_timeout_s <= 0 or self.hello_interval_s <= 0:
            raise ValueError("timeouts and intervals must be > 0")

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def cpu_list(self) -> list[int]:
        return [int(c) for c in self.cpus.split(",")] if self.cpus else []

    @property
    def secret(self) -> str:
        """The cluster secret in force: the flag, else the environment ("": none)."""
        return self.cluster_secret or settings.cluster_secret()


@dataclass(frozen=True)
class HandoffConfig:
    """PD mode (prefill and decode ranks): how the KV moves between them."""

    transfer: TransferKind = opt("auto", "KV transfer backend: nixl (UCX), shm (same host), auto (nixl if it "
                                         "starts, else shm); every PD rank must use the same")
    handoff_lease_s: float = opt(10.0, "prefill: a handed-off request's pinned KV is released after this long "
                                       "without Pulled/PullFailed or a Renew from the decode rank (and the "
                                       "request fails); decode: renews every third of it while it holds a "
                                       "handoff, and starts no read later than this minus a margin after the "
                                       "handoff arrived or its last Renew")
    handoff_wait_s: float = opt(120.0, "decode: a handed-off request waits at most this long for room on the "
                                       "rank (its prefill rank's lease renewed meanwhile), then fails with 503")
    decode_keep_prompts: bool = opt(False, "decode: keep every handed-off prompt's complete pages in the host "
                                           "cache, so a later turn's handoff pulls only what it lacks (0.57x the KV "
                                           "moved, but 1.35x 2P2D's TTFT p50 in docs/results/kv-reuse.md: off)")
    handoff_pool_gb: float = opt(0.25, "prefill: GiB of shared memory for KV waiting to be pulled (pages and "
                                       "SWA states of requests in prefill or handed off); a full pool holds "
                                       "new prompts back")

    def __post_init__(self) -> None:
        if self.transfer not in ("auto", "nixl", "shm"):
            raise ValueError(f"transfer must be auto, nixl or shm, got {self.transfer!r}")
        if self.handoff_lease_s <= 0 or self.handoff_pool_gb <= 0 or self.handoff_wait_s <= 0:
            raise ValueError("handoff_lease_s, handoff_wait_s and handoff_pool_gb must be > 0")
