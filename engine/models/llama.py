"""Llama family: Llama (incl. llama3/linear rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Projections are fused at load (q|k|v into one matrix, gate|up into one) so a
layer is four matmuls. Weight names follow Hugging Face checkpoints.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVPool
from engine.layers.activation import act_and_mul
from engine.layers.attention import PagedAttention
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import apply_rotary
from engine.models.base import DecoderLM


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, norm_cls=RMSNorm) -> None:
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = norm_cls(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm_cls(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.layer_type = cfg.layer_types[layer_id]
        self.attn = PagedAttention(layer_id, self.layer_type == "sliding_attention", cfg.scale)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, pool: KVPool, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's K/V goes to the cache; the output has only `rows` (default: all)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2*KVH) * D]
        cos, sin = fb.rope[self.layer_type]
        qk, v = qkv.split([(self.h + self.kvh) * self.d, self.kvh * self.d], dim=-1)
        v = v.view(t, self.kvh, self.d)
        if self.q_norm is None:  # rotate q and k in one go: [T, H + KVH, D]
            q, k = apply_rotary(qk.view(t, self.h + self.kvh, self.d), cos, sin).split([self.h, self.kvh], dim=1)
        else:
            q, k = qk.split([self.h * self.d, self.kvh * self.d], dim=-1)
            q = apply_rotary(self.q_norm(q.view(t, self.h, self.d)), cos, sin)
            k = apply_rotary(self.k_norm(k.view(t, self.kvh, self.d)), cos, sin)
        o = self.attn(q, k, v, fb, pool)  # [T, H, D]
        if rows is not None:
            o = o[rows]
        return self.o_proj(o.reshape(o.shape[0], self.h * self.d))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.gelu = act != "silu"  # config.py admits silu and gelu_pytorch_tanh only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.gelu))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
                pool: KVPool, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual stream before it); their sum is HF's layer output.
        With `rows`, only those tokens past the attention (every token's K/V is still cached)."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        a = self.self_attn(h, fb, pool, rows)
        h, residual = self.post_attention_layernorm.add_norm(a, residual if rows is None else residual[rows])
        return self.mlp(h), residual


class LlamaForCausalLM(DecoderLM):
    layer_cls = LlamaDecoderLayer
    norm_cls = RMSNorm
