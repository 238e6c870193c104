"""The router's knobs: one frozen dataclass, validated at construction; CLI flags come from it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cluster.cli_args import opt
from pd_server.disagg import MODES as DISAGG_MODES
from pd_server.disagg import DisaggMode

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
    # ---- PD mode: where a prompt is prefilled (disagg.py) ----
    disagg: DisaggMode = opt("auto", "PD mode: always = every prompt through a prefill rank (KV handed off); "
                                     "never = the decode rank prefills every prompt itself; auto = per request, "
                                     "from cost curves and queue depths (pd_server/disagg.py)")
    disagg_costs: str = opt("", "cost curves (pd_tune.py measure JSON) for --disagg auto (default: "
                                "pd_server/costs/ for the served model, else built-in)")
    decode_pack: int = opt(-1, "PD mode: a decode rank takes new requests until it holds this many before "
                               "an idle decode rank gets one (fewer, larger decode batches: a step reads every "
                               "weight once, so where ranks share cores one step of 8 rows costs less than two "
                               "of 4); 0: spread by load; -1 (auto): the launcher sets 8 where it starts "
                               "several decode ranks and its ranks' threads outnumber this host's cores, "
                               "else 0")
    # ---- access and request limits (security.py, limits.py) ----
    # NOTE: repr=False keeps the key out of every log line and traceback that prints the config.
    api_key: str = field(default="", repr=False, metadata={"help": (
        "require 'Authorization: Bearer <key>' on every /v1/* route (empty: $PDSERVE_API_KEY, "
        "if set; /health and /metrics stay open); several keys separated by commas are several tenants: "
        "one key never reads another's stored Responses")})
    cache_salt_from_key: bool = opt(False, "fold each request's API key (its tenant) into its cache_salt, so one "
                                           "key's prompts are never a prefix-cache hit for another's")
    cache_usage_details: bool = opt(True, "report usage's cached_tokens and the x-pdserve-rank headers; "
                                          "--no-cache-usage-details hides them (cached_tokens, exact to the "
                                          "page, tells a client what others' prompts the cache holds)")
    max_body_bytes: int = opt(16 * 2**20, "largest request body; past it: 413, before the body is read")
    body_timeout_s: float = opt(30.0, "a request body must arrive in full within this many seconds of its "
                                      "headers; else 408 (slowloris)")
    header_timeout_s: float = opt(10.0, "a connection must deliver a request's headers within this many seconds "
                                        "of opening (or of its previous response); else 408 and close")
    max_connections: int = opt(0, "open client connections at most; one past it closes the oldest idle keep-alive "
                                  "connection, else is answered 503 (0: the open-file limit, raised to its hard "
                                  "limit, less 512)")
    max_messages: int = opt(2048, "messages per chat request; past it: 400")
    max_tokens_limit: int = opt(32768, "largest max_tokens / max_completion_tokens a request may ask for, and "
                                       "the default for one that asks for none (the context length also "
                                       "bounds it); past it: 400")
    max_n: int = opt(16, "choices per request (n); past it: 400")
    max_stop: int = opt(16, "stop strings per request; past it: 400")
    max_stop_chars: int = opt(512, "characters in one stop string; past it: 400")
    max_tools: int = opt(128, "tools per chat request; past it: 400")
    max_tool_schema_bytes: int = opt(32768, "JSON size of one tool's definition or of a response_format "
                                            "schema; past it: 400")
    max_migrations: int = opt(2, "times one request may move from a dead rank to a live one, resuming from the "
                                 "tokens it streamed (0: a dead rank's requests fail)")
    keep_alive_s: float = opt(75.0, "an idle client connection stays open this many seconds (HTTP keep-alive; "
                                    "uvicorn's own default, 5 s, closes connections agents reuse after a pause)")
    grammar_timeout_s: float = opt(10.0, "a structured-output request's grammar (response_format json_schema, "
                                         "tool_choice required or named) must compile within this many "
                                         "seconds; else 400")
    max_prompts: int = opt(128, "prompts in one /v1/completions request; past it: 400")
    # ---- stored Responses (response_store.py) ----
    responses_max_count: int = opt(10000, "Responses API: responses kept for previous_response_id and GET "
                                          "(least recently used out first; 0 stores none)")
    responses_max_mb: float = opt(256.0, "Responses API: MiB of stored responses and their input items at most")
    responses_ttl_s: float = opt(3600.0, "Responses API: a stored response expires this many seconds after it "
                                         "was stored")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_inflight_per_rank < 1:
            raise ValueError("max_inflight_per_rank must be >= 1")
        if self.heartbeat_interval_s <= 0 or self.rank_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("need 0 < heartbeat_interval_s < rank_timeout_s")
        if not self.rank_addr.startswith(("tcp://", "ipc://")):
            raise ValueError(f"rank_addr must be tcp:// or ipc://, got {self.rank_addr!r}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.max_connections < 0:
            raise ValueError(f"max_connections must be >= 0, got {self.max_connections}")
        if self.decode_pack < -1:
            raise ValueError(f"decode_pack must be >= -1, got {self.decode_pack}")
        if self.disagg not in DISAGG_MODES:
            raise ValueError(f"disagg must be one of {DISAGG_MODES}, got {self.disagg!r}")
        if self.responses_max_count < 0 or self.responses_max_mb < 0:
            raise ValueError("responses_max_count and responses_max_mb must be >= 0")
        for name in ("body_timeout_s", "header_timeout_s", "grammar_timeout_s", "keep_alive_s", "responses_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_body_bytes", "max_messages", "max_tokens_limit", "max_n", "max_stop", "max_stop_chars",
                     "max_tools", "max_tool_schema_bytes", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
