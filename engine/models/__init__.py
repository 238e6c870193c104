"""Model families, one a file. `build_model` picks the class from the config's family."""
from __future__ import annotations

import torch

from engine.config import ModelConfig


def model_class(cfg: ModelConfig):
    if cfg.family == "llama":
        from engine.models.llama import LlamaForCausalLM
        return LlamaForCausalLM
    if cfg.family == "gemma3":
        from engine.models.gemma3 import Gemma3ForCausalLM
        return Gemma3ForCausalLM
    raise ValueError(f"no model class for family {cfg.family!r}")


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    return model_class(cfg)(cfg, dtype, device)
