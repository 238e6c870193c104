"""Load Hugging Face safetensors into our modules, fusing q|k|v and gate|up on the way."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


class WeightLoader:
    """Reads tensors by HF name from every *.safetensors file in a directory."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.dir}")
        self._where: dict[str, Path] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            for name, f in json.loads(index.read_text())["weight_map"].items():
                self._where[name] = self.dir / f
        else:
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    for name in h.keys():
                        self._where[name] = f
        self._handles: dict[Path, object] = {}
        self.quant_s = 0.0  # seconds load_into spent making quant copies (attach_quant)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"checkpoint {self.dir} has no tensor {name!r}")
        f = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f].get_tensor(name)

    def _sources(self, pname: str, prefix: str) -> list[str]:
        m = _LAYER.match(pname)
        if m:
            layer, mod, kind = m.groups()
            if mod in _FUSED:
                return [f"{prefix}layers.{layer}.{src}.{kind}" for src in _FUSED[mod]]
        return [prefix + pname]

    def load_into(self, model: nn.Module, prefix: str = "model.") -> None:
        """Materialise every parameter of `model` (built on meta) from the checkpoint.

        Raises KeyError naming a tensor the checkpoint lacks, ValueError on a shape mismatch.
        """
        dtype, device = model.embed_tokens.weight.dtype, model.device
        tied = model.cfg.tie_word_embeddings or not self.has("lm_head.weight")
        params = [(n, p) for n, p in model.named_parameters() if not (tied and n == "lm_head.weight")]
        from engine.layers.linear import Linear

        embed32 = None  # the tied head's fp32 values, for its quant copy
        for name, param in tqdm(params, desc="loading weights", leave=False, disable=None):
            if name == "lm_head.weight":
                srcs = ["lm_head.weight"]
            else:
                srcs = self._sources(name, prefix)
            tensor = torch.cat([self.get(s) for s in srcs]) if len(srcs) > 1 else self.get(srcs[0])
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{srcs}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
            new = nn.Parameter(tensor.to(device=device, dtype=dtype).contiguous(), requires_grad=False)
            _set_param(model, name, new)
            mod_path, _, leaf = name.rpartition(".")
            if leaf == "weight" and tensor.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float32):
                # a checkpoint dequantized from GGUF: its Q4_1 / Q8_0 blocks, exact, for the decode kernels
                mod = model.get_submodule(mod_path)
                if isinstance(mod, Linear):
                    t0 = time.perf_counter()
                    mod.attach_quant(tensor)
                    self.quant_s += time.perf_counter() - t0
                elif tied and name == "embed_tokens.weight":
                    embed32 = tensor
        if tied:
            model.lm_head.weight = model.embed_tokens.weight
            if embed32 is not None and isinstance(model.lm_head, Linear):
                t0 = time.perf_counter()
                model.lm_head.attach_quant(embed32)
                self.quant_s += time.perf_counter() - t0
        self._handles.clear()


def _set_param(model: nn.Module, name: str, value: nn.Parameter) -> None:
    mod_path, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_path) if mod_path else model
    setattr(mod, leaf, value)
