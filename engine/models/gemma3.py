"""Gemma 3 text: interleaved sliding-window/global layers, each type with its own rope theta,
q/k norm, sandwich norms around attention and MLP, scaled embeddings, gelu-tanh,
softmax scale query_pre_attn_scalar ** -0.5. Norms scale by (1 + weight).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVPool
from engine.layers.norm import GemmaRMSNorm
from engine.models.base import DecoderLM
from engine.models.llama import GatedMLP, LlamaAttention


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = LlamaAttention(cfg, layer_id, norm_cls=GemmaRMSNorm)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
                pool: KVPool, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (post-norm MLP output, residual stream before it); see LlamaDecoderLayer."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, fb, pool, rows))
        if rows is not None:
            residual = residual[rows]
        h, residual = self.pre_feedforward_layernorm.add_norm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(DecoderLM):
    layer_cls = Gemma3DecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        # HF multiplies by sqrt(hidden) rounded to the activation dtype.
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device=device)
