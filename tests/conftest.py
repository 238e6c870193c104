"""Shared fixtures: tiny randomly initialised checkpoints of each family, and the embedded models."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from cluster import settings

# scripts/gpu_check.sh runs the parity tests on CUDA through this.
TEST_DEVICE = settings.device_under_test()

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            initializer_range=0.2, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0)


def _tiny_config(family: str):
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(**TINY, rope_parameters={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 10000.0})
    if family == "llama_tied_linear":
        return tf.LlamaConfig(**{**TINY, "tie_word_embeddings": True},
                              rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    if family == "qwen2":
        return tf.Qwen2Config(**TINY)
    if family == "qwen3":
        return tf.Qwen3Config(**TINY)
    if family == "mistral":
        return tf.MistralConfig(**TINY, sliding_window=8)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**{**TINY, "num_hidden_layers": 4, "tie_word_embeddings": True},
                                   sliding_window=8, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention",
                                                "sliding_attention", "full_attention"])
    raise KeyError(family)


TINY_FAMILIES = ["llama", "llama_tied_linear", "qwen2", "qwen3", "mistral", "gemma3"]


def _tokenizer_source() -> Path:
    from engine.model_cache import cached_model_dir

    return cached_model_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: family name -> directory with a random tiny HF checkpoint + a tokenizer."""
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family in made:
            return made[family]
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_tiny_config(family), dtype=torch.float32)
        out = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(str(out))
        src = _tokenizer_source()
        for f in src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, out / f.name)
        made[family] = out
        return out

    return make
