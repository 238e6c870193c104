"""The decoder-only skeleton both families share: embed -> layers -> final norm -> lm_head."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVPool
from engine.layers.linear import Linear
from engine.layers.rotary import RotaryEmbedding
from engine.models.weights import WeightLoader


class DecoderLM(nn.Module):
    """Subclasses set `layer_cls`, `norm_cls` and may scale embeddings (`embed_scale`).

    Built on the meta device; `load_weights` materialises every parameter. Rotary
    tables (one per layer type) are computed, not loaded.
    """

    layer_cls: type[nn.Module]
    norm_cls: type[nn.Module]
    # A class whose build(model) returns a plan for steps of decode entries only (plan.run(model,
    # fb, pool) returns what forward would, bit for bit, for steps of up to plan.max_rows rows), or
    # None where the model takes other paths.
    decode_plan_cls = None
    use_decode_plan = True  # False: every step through the modules (tests compare the two)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.device = device
        self.rotary = {t: RotaryEmbedding(r, cfg.head_dim, cfg.max_position, dtype, device)
                       for t, r in cfg.rope.items()}
        with torch.device("meta"):
            # NOTE: given its weight, nn.Embedding skips its random init, whose normal_ on meta
            # tensors imports torch._dynamo (1.6-3.8 s of a rank's start-up on this VM).
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                             _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
            self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
            self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to(dtype)
        self.requires_grad_(False)
        self.embed_scale: torch.Tensor | None = None
        # Called between layers when set (a rank's core board: a step on lent threads hands
        # them back as soon as their owner has work, not only at the next step).
        self.between_layers: Callable[[], object] | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def decode_plan(self):
        """The model's decode plan (built on first use, rebuilt after a weight changed), or None."""
        plan = self.__dict__.get("_decode_plan", False)
        if plan is False or (plan is not None and not plan.current()):
            plan = self.__dict__["_decode_plan"] = self.decode_plan_cls.build(self)
        return plan

    def forward(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Returns hidden states [S, hidden] of the tokens at fb.logits_indices, followed by those
        at fb.prompt_indices where a step has them ([S + E, hidden])."""
        extra = fb.prompt_indices
        if self.use_decode_plan and self.decode_plan_cls is not None and fb.num_tokens and extra is None:
            plan = self.decode_plan()
            if plan is not None and plan.takes(fb):
                return plan.run(self, fb, pool)
        x = self.embed(fb.input_ids)
        fb.rope = {t: r.tables(fb.positions) for t, r in self.rotary.items()}
        residual = None  # layers return (output, residual stream); the next input norm adds them
        hook = self.between_layers
        last, cut = len(self.layers) - 1, False
        for i, layer in enumerate(self.layers):
            if i == last and residual is not None:
                # past its attention the last layer runs only the tokens whose logits are sampled
                # (on the CPU kernels their bits are unchanged: each gives a row the same result in any batch)
                x, residual = self._last_layer(layer, x, residual, fb, pool)
                cut = True
            else:
                x, residual = layer(x, residual, fb, pool)
            if hook is not None:
                hook()
        if not cut:  # a one-layer model
            idx = fb.logits_indices if extra is None else torch.cat([fb.logits_indices, extra])
            x, residual = x[idx], residual[idx] if residual is not None else None
        return self.norm.add_norm(x, residual)[0]

    def _last_layer(self, layer, x, residual, fb: ForwardBatch, pool: KVPool):
        """The last layer for the sampled rows, then (a step with prompt logprobs) for the prompt
        rows: a second pass, so the sampled rows' linears see the batch they would without them
        (a GEMM's bits can depend on its row count). Its attention writes the same keys again. A
        sliding last layer (its ring is written at the end of the first pass) takes both sets in
        one pass."""
        extra = fb.prompt_indices
        if extra is None:
            return layer(x, residual, fb, pool, fb.logits_indices)
        if self.cfg.layer_types[-1] == "sliding_attention":
            return layer(x, residual, fb, pool, torch.cat([fb.logits_indices, extra]))
        xs, rs = layer(x, residual, fb, pool, fb.logits_indices)
        xe, re = layer(x, residual, fb, pool, extra)
        return torch.cat([xs, xe]), torch.cat([rs, re])

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()

    def load_weights(self, loader: WeightLoader, phases: dict[str, float] | None = None) -> None:
        """Materialise the parameters from `loader`, then make the kernel's packed copies. Adds the
        seconds spent to `phases` (where given): "weights" (read and cast), "quant" (the exact
        block-quantized copies, made while loading), "pack" (the packed copies)."""
        t0 = time.perf_counter()
        loader.load_into(self)
        t1 = time.perf_counter()
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.prepare()  # the kernel's packed weight copies, made before the first step
        if phases is not None:
            for name, s in (("weights", t1 - t0 - loader.quant_s), ("quant", loader.quant_s),
                            ("pack", time.perf_counter() - t1)):
                phases[name] = phases.get(name, 0.0) + s
