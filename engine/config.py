"""Model and engine configuration: one frozen dataclass each, validated at construction."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cluster.cli_args import add_dataclass_args, from_args, opt

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """What the runner needs from an HF config.json, in one flat, checked form."""

    family: str  # "llama" | "gemma3"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # per layer: "full_attention" | "sliding_attention"
    rope: dict  # layer type -> RopeConfig
    sliding_window: int | None
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    attn_scale: float = 0.0  # softmax scale; 0 -> head_dim ** -0.5
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError("layer_types must name every layer")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need sliding_window")

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding_attention")

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        gen = {}
        if (path / "generation_config.json").exists():
            gen = json.loads((path / "generation_config.json").read_text())
        return cls.from_hf_dict(cfg, gen)

    @classmethod
    def from_hf_dict(cls, cfg: dict, gen: dict | None = None) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                       "mistral": "MistralForCausalLM"}.get(cfg.get("model_type", ""), "?")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHS)}")
        family = SUPPORTED_ARCHS[arch]
        n_layers = cfg["num_hidden_layers"]
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        sliding = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if family == "gemma3":
            if layer_types is None:
                pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
                layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                               for i in range(n_layers)]
        else:
            use_sliding = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
            if layer_types is None:
                kind = "sliding_attention" if (sliding and use_sliding) else "full_attention"
                layer_types = [kind] * n_layers
            if arch.startswith("Qwen") and not use_sliding:
                layer_types = ["full_attention"] * n_layers
        rope = _parse_rope(cfg, family, set(layer_types))
        eos = (gen or {}).get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                raise ValueError(f"config asks for {key}={cfg[key]}, which this runner does not implement")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation {act!r}")
        scale = (cfg["query_pre_attn_scalar"] ** -0.5) if family == "gemma3" else 0.0
        return cls(
            family=family, architecture=arch, vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_layers=n_layers, num_heads=n_heads, num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", family == "gemma3"),
            layer_types=tuple(layer_types), rope=rope,
            sliding_window=sliding if "sliding_attention" in layer_types else None,
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias")),
            qk_norm=family == "gemma3" or arch == "Qwen3ForCausalLM",
            hidden_act=act, attn_scale=scale, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
        )


def _one_rope(params: dict | None, theta_default: float) -> RopeConfig:
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(params.get("rope_theta", theta_default))
    if kind == "default":
        return RopeConfig(theta)
    if kind == "linear":
        return RopeConfig(theta, "linear", float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(theta, "llama3", float(params["factor"]), float(params.get("low_freq_factor", 1.0)),
                          float(params.get("high_freq_factor", 4.0)),
                          int(params.get("original_max_position_embeddings", 8192)))
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def _parse_rope(cfg: dict, family: str, types: set[str]) -> dict:
    """Per layer type RopeConfig; handles transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters)."""
    params = cfg.get("rope_parameters")
    base = float(cfg.get("rope_theta", 10000.0))
    if params and all(k in ("full_attention", "sliding_attention") for k in params):
        return {t: _one_rope(params.get(t), base) for t in types}
    if params:
        return {t: _one_rope(params, base) for t in types}
    out = {t: _one_rope(cfg.get("rope_scaling"), base) for t in types}
    if family == "gemma3" and "sliding_attention" in types:
        out["sliding_attention"] = RopeConfig(float(cfg.get("rope_local_base_freq", 10000.0)))
    return out


# torch is imported lazily: the router imports this module and needs no torch.
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
          "float16": "float16", "fp16": "float16"}


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16): the kernels in csrc/
    and oneDNN's bf16 GEMMs run there. Without (AVX2-only or plain AVX-512 CPUs) torch's bf16 ops
    convert every element and run far slower than fp32: SmolLM2 on one core of an AMD EPYC
    without AVX-512, a 512-token prefill 13.1 s in bf16 against 2.4 s in fp32, a decode step of
    8 rows 719 against 182 ms."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> str:
    """The canonical dtype name; "auto" is bfloat16 on CUDA and on CPUs with native bf16
    (cpu_has_bf16), float32 on other CPUs."""
    if dtype == "auto":
        return "bfloat16" if device != "cpu" or cpu_has_bf16() else "float32"
    return DTYPES[dtype]


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs; one CLI flag per field, with its help (cluster/cli_args.py)."""

    model: str = opt("smollm2-135m-instruct", "an embedded model's name, a Hugging Face checkpoint directory or a "
                     ".gguf file")
    dtype: str = opt("auto", "auto, bfloat16, float32 or float16 (CUDA); auto: bfloat16 on CUDA and on CPUs that "
                     "compute in it natively (AVX512-BF16, AMX), float32 on others")
    device: str = opt("cpu", "cpu, cuda or cuda:N")
    page_size: int = opt(16, "tokens per KV page (a power of two)")
    kv_cache_gb: float = opt(1.0, "GiB for the full-attention KV pages of running sequences")
    max_num_seqs: int = opt(64, "running sequences at most")
    # vLLM's online-serving default.
    max_num_batched_tokens: int = opt(2048, "tokens a step computes at most (chunked prefill): a longer prompt is "
                                      "prefilled in chunks, each step also running the decodes")
    prefill_pack_tokens: int = opt(256, "a step takes further prompts only up to this many prompt tokens in all "
                                   "(its first prompt chunk may take the whole budget): prompts are prefilled one "
                                   "after another, each first token sooner; 0: prompts fill the budget")
    max_model_len: int = opt(0, "longest sequence; 0: the model's, capped by the KV pool")
    num_threads: int = opt(0, "torch intra-op threads; 0: torch's default (the launcher: cores / ranks)")
    # Off by default in the engine: its size must be planned against host RAM and the ranks per
    # host (the launcher does: hicache/host_plan.py).
    hicache_size_gb: float = opt(0.0, "host KV cache: GiB of shared memory for prefix pages and SWA states "
                                 "(hicache/); 0: none")
    hicache_state_slots: int = opt(16, "SWA states the host cache holds (hybrid models only), out of its size")
    hicache_shm_name: str = opt("", "the host cache's file under /dev/shm; empty: pdserve-hicache-<pid>-<random>")
    hicache_scope: Literal["rank", "host"] = opt("rank", "rank: a private host cache; host: the ranks naming the "
                                                 "same --hicache-shm-name share one pool and prefix index, "
                                                 "--hicache-size-gb being the host's")
    kv_store: str = opt("", "the L3 tier behind the host cache (hicache/store.py): file:DIR keeps every stored page "
                        "in DIR (the ranks of a host, and the next start, share it); mooncake: a Mooncake Store "
                        "the launcher starts; mooncake://HOST:PORT?metadata=URL: an existing one; empty: none")
    kv_store_size_gb: float = opt(0.0, "file: the store's capacity (0: a quarter of its disk's free space, at most "
                                  "64); mooncake: the memory each rank lends the store (0: 1 GiB)")
    shared_weights_dir: str = opt("", "tmpfs directory where the ranks of one host map one read-only copy of the "
                                  "weights (engine/shared_weights.py); empty: a private copy (the launcher sets it)")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))  # canonical name
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.kv_cache_gb <= 0:
            raise ValueError("kv_cache_gb must be > 0")
        if self.prefill_pack_tokens < 0:
            raise ValueError(f"prefill_pack_tokens must be >= 0, got {self.prefill_pack_tokens}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.hicache_size_gb < 0 or self.hicache_state_slots < 0:
            raise ValueError("hicache_size_gb and hicache_state_slots must be >= 0")
        if self.kv_store and not ((self.kv_store.startswith("file:") and len(self.kv_store) > 5)
                                  or self.kv_store == "mooncake" or self.kv_store.startswith("mooncake://")):
            raise ValueError(f"kv_store must be file:DIR, mooncake or mooncake://HOST:PORT, got {self.kv_store!r}")
        if self.kv_store_size_gb < 0:
            raise ValueError("kv_store_size_gb must be >= 0")
        if self.hicache_scope not in ("rank", "host"):
            raise ValueError(f"hicache_scope must be rank or host, got {self.hicache_scope!r}")
        if "/" in self.hicache_shm_name:
            raise ValueError(f"hicache_shm_name must be a plain file name, got {self.hicache_shm_name!r}")

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, DTYPES[self.dtype])

    @property
    def torch_device(self):
        import torch
        return torch.device(self.device)


def add_cli_args(parser, cls=EngineConfig, prefix: str = "") -> None:
    """One `--flag` per field, with its help, type and choices (cluster/cli_args.py)."""
    add_dataclass_args(parser, cls, prefix)


def from_cli_args(args, cls=EngineConfig, prefix: str = ""):
    return from_args(args, cls, prefix)
