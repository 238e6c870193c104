"""The float32 step plan: a decode step of a Llama-family model as one flat loop over the kernels.

On CPUs without AVX512-BF16 (`--dtype auto` = float32 there) a decode step's linears read their
block-quantized copies (native/quant_linear.py), and the norms and the decode attention run the
same C++ kernels as in bf16; rotary and the gated activation stay torch's formulas. Through the
modules each of the ~12 calls a layer also pays Python's module calls, wrappers and the checks
that pick a kernel (Zen 4 at `--dtype float32`, one thread: the ops take ~16 ms of a ~22.5 ms
one-row step; the plan: 1 row ~2.5 ms and 4 rows ~4 ms less, docs/kernels.md). This plan makes
those choices once at build and then calls the same ops on the same
tensors in the same order as LlamaDecoderLayer.forward and DecoderLM.forward do for such a step,
so the bits are the same (tests/unit/engine/test_decode_plan.py).

It takes steps of decode rows only, at most QUANT_F32_ROWS of them (what the quant-copy kernel
takes; larger steps and every step with a prompt chunk go through the modules: torch's GEMM and
attention). Built only where every layer takes those kernels: float32 on the CPU, every linear
with a quant copy, no q/k norm, no sliding-window layer, head dim a multiple of 32 (at most 512).
A weight replaced or changed in place after the build makes the model rebuild it.
"""
from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVPool
from engine.layers.norm import RMSNorm
from engine.models.llama import plain_layers, plan_weights, weights_current
from native import paged_attention, rms_norm
from native.activation import act_and_mul_torch
from native.quant_linear import QUANT_F32_ROWS, quant_f32_available


class LlamaDecodePlanF32:
    """See the module docstring. Same interface as LlamaDecodePlan: build / current / takes / run."""

    def __init__(self, model) -> None:
        self.layers = []
        self.weights = plan_weights(model)
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight, layer.input_layernorm.eps, a.qkv_proj.quant_weight(), a.qkv_proj.bias,
                a.o_proj.quant_weight(), layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                mlp.gate_up_proj.quant_weight(), mlp.down_proj.quant_weight(), mlp.gelu, a.attn.layer_id, a.attn.scale,
                a.layer_type))
        self.h, self.kvh, self.d = model.layers[0].self_attn.h, model.layers[0].self_attn.kvh, model.cfg.head_dim

    @classmethod
    def build(cls, model) -> LlamaDecodePlanF32 | None:
        """The plan, or None where some layer would take another path than these kernels."""
        cfg = model.cfg
        if (model.device.type != "cpu" or model.embed_tokens.weight.dtype != torch.float32 or not model.layers
                or cfg.head_dim % 32 or cfg.head_dim > 512 or not quant_f32_available() or not rms_norm.available()
                or type(model.norm) is not RMSNorm):
            return None
        if not plain_layers(model, lambda lin: lin.weight.dtype == torch.float32 and lin.quant_weight() is not None):
            return None
        paged_attention._load_ops()
        return cls(model)

    def current(self) -> bool:
        """No weight the plan holds was replaced or changed in place since it was built."""
        return weights_current(self.weights)

    @staticmethod
    def takes(fb: ForwardBatch) -> bool:
        """Decode rows only, as many as the quant-copy kernel takes (else through the modules)."""
        return not fb.prefills and fb.num_tokens <= QUANT_F32_ROWS

    def run(self, model, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """DecoderLM.forward for a step that takes(): hidden states of every row (each is sampled)."""
        ops = torch.ops.pdserve
        rms, linear = ops.rms_norm.default, ops.quant_linear_f32.default
        attend, write = ops.paged_decode_attention.default, ops.write_kv.default
        x = model.embed(fb.input_ids)
        t = x.shape[0]
        fb.rope = {k: r.tables(fb.positions) for k, r in model.rotary.items()}
        h, kvh, d = self.h, self.kvh, self.d
        qk, half, hook = (h + kvh) * d, d // 2, model.between_layers
        wp, wo, pages, ctx = fb.write_page, fb.write_off, fb.dec_pages, fb.dec_ctx
        idx, last = fb.logits_indices, len(self.layers) - 1
        residual = None
        for i, (in_w, in_eps, qkv_q, qkv_b, o_q, post_w, post_eps, gu_q, down_q, gelu, layer_id, scale,
                layer_type) in enumerate(self.layers):
            if residual is None:
                n, residual = rms(x, None, in_w, in_eps, False)[0], x
            else:
                n, residual = rms(x, residual, in_w, in_eps, False)
            qkv = linear(n, qkv_q, qkv_b)
            cos, sin = fb.rope[layer_type]
            x4 = qkv[:, :qk].view(t, h + kvh, d)  # apply_rotary's torch formula, as in float32 there
            rotated = x4 * cos + torch.cat((-x4[..., half:], x4[..., :half]), dim=-1) * sin
            cache = pool.full[:, pool.layer_index[layer_id]]
            write(cache, wp, wo, rotated[:, h:], qkv[:, qk:].view(t, kvh, d))
            o = attend(rotated[:, :h].contiguous(), cache, pages, ctx, scale)
            if i == last and i:  # DecoderLM.forward passes the sampled rows (every row, in order) to the last layer
                o, residual = o[idx], residual[idx]
            n, residual = rms(linear(o.reshape(o.shape[0], h * d), o_q, None), residual, post_w, post_eps, False)
            x = linear(act_and_mul_torch(linear(n, gu_q, None), gelu), down_q, None)
            if hook is not None:
                hook()
        if not last:  # a one-layer model: DecoderLM.forward cuts after it
            x, residual = x[idx], residual[idx]
        return model.norm.add_norm(x, residual)[0]
