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
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import GatedMLP, LlamaAttention
from engine.models.weights import WeightLoader


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = LlamaAttention(cfg, layer_id, rotary, norm_cls=GemmaRMSNorm)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), fb, pool))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = {t: RotaryEmbedding(r, cfg.head_dim, cfg.max_position, dtype, device)
                       for t, r in cfg.rope.items()}
        with torch.device("meta"):  # materialised by load_weights
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, self.rotary[cfg.layer_types[i]])
                                        for i in range(cfg.num_layers))
            self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to(dtype)
        self.requires_grad_(False)
        self.device = device
        # HF multiplies by sqrt(hidden) rounded to the activation dtype.
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype)

    def forward(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Returns hidden states [S, hidden] of the tokens at fb.logits_indices."""
        x = self.embed_tokens(fb.input_ids) * self.embed_scale.to(self.device)
        for layer in self.layers:
            x = layer(x, fb, pool)
        return self.norm(x[fb.logits_indices])

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()

    def load_weights(self, loader: WeightLoader) -> None:
        loader.load_into(self)
