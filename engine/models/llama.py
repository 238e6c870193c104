"""Llama family: Llama (incl. llama3/linear rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Projections are fused at load (q|k|v into one matrix, gate|up into one) so a
layer is four matmuls. Weight names follow Hugging Face checkpoints.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVPool
from engine.layers.attention import PagedAttention
from engine.layers.linear import GatedLinear, Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import apply_rotary
from engine.models.base import DecoderLM
from native import paged_attention, prefill_attention, rms_norm
from native.activation import fused_act_available
from native.linear import amx_gemm_rows, gemm_rows, small_linear_available
from native.rotary import fused_rotary_available


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
        self.gate_up_proj = GatedLinear(hidden, 2 * inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.gelu = act != "silu"  # config.py admits silu and gelu_pytorch_tanh only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_act(x, self.gelu))


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


def plain_layers(model: DecoderLM, linear_ok) -> bool:
    """What a step plan needs of every layer: a LlamaDecoderLayer with RMSNorms, no q/k norm, no
    sliding window, and `linear_ok(lin)` for each of its four linears."""
    for layer in model.layers:
        a = layer.self_attn
        if (not isinstance(layer, LlamaDecoderLayer) or a.q_norm is not None or a.attn.sliding
                or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm):
            return False
        if not all(linear_ok(lin) for lin in (a.qkv_proj, a.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)):
            return False
    return True


def plan_weights(model: DecoderLM) -> list[tuple[dict, str, torch.Tensor, int]]:
    """Every weight (and q|k|v bias) a step plan holds, as (owner's parameter dict, name, tensor,
    version): weights_current() then takes a dict look-up per weight, not nn.Module.__getattr__."""
    out = []
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        for mod in (layer.input_layernorm, layer.post_attention_layernorm, a.qkv_proj, a.o_proj,
                    mlp.gate_up_proj, mlp.down_proj):
            out.append((mod._parameters, "weight", mod.weight, mod.weight._version))
        if a.qkv_proj.bias is not None:
            out.append((a.qkv_proj._parameters, "bias", a.qkv_proj.bias, a.qkv_proj.bias._version))
    return out


def weights_current(weights: list[tuple[dict, str, torch.Tensor, int]]) -> bool:
    """No weight of plan_weights()' list was replaced or changed in place since."""
    return all(params.get(name) is w and w._version == v for params, name, w, v in weights)


class LlamaDecodePlan:
    """A step of a Llama-family model as one flat loop over the CPU kernels.

    A step is about twelve kernel calls a layer. Through the modules each call also pays
    Python's module calls, wrappers and the checks that pick a kernel (docs/kernels.md has what
    that cost a step). The plan makes those choices once, when it is built
    (like a captured CUDA graph), and then calls the same kernels on the same tensors in the same
    order as LlamaDecoderLayer.forward and DecoderLM.forward do for the step, so the bits are the
    same (tests/unit/engine/test_decode_plan.py): decode entries, prefill chunks (with or without
    earlier context) or both; the linears of a step of more than `max_rows` tokens take torch's
    GEMM, as the modules' do. Prefill chunks take it only where the prefill attention kernel
    runs. Built only where every layer takes those kernels: bf16 on the CPU, no q/k norm, no
    sliding-window layer, head dim a multiple of 32 (at most 512). A weight replaced or changed
    in place after the build makes the model rebuild it.
    """

    def __init__(self, model: DecoderLM) -> None:
        self.layers = []
        self.weights = plan_weights(model)
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            gu = mlp.gate_up_proj
            gu_gemm = gu.gemm_weight()  # the AMX GEMM's copy: gated layout where _gemm_gated
            self.layers.append((
                layer.input_layernorm.weight, layer.input_layernorm.eps,
                a.qkv_proj.weight, a.qkv_proj.bias, a.qkv_proj.packed_weight(), a.qkv_proj.gemm_weight(),
                a.o_proj.weight, a.o_proj.packed_weight(), a.o_proj.gemm_weight(), layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.eps, gu.weight, gu.packed_weight(),
                None if gu._gemm_gated else gu_gemm, gu_gemm if gu._gemm_gated else None,
                mlp.down_proj.weight, mlp.down_proj.packed_weight(), mlp.down_proj.gemm_weight(), mlp.gelu,
                a.attn.layer_id, a.attn.scale, a.layer_type, gu.gated(),
                a.qkv_proj.quant_weight(), a.o_proj.quant_weight(), gu.quant_weight(), mlp.down_proj.quant_weight()))
        self.h, self.kvh, self.d = model.layers[0].self_attn.h, model.layers[0].self_attn.kvh, model.cfg.head_dim
        self.max_rows = gemm_rows()  # Linear's kernel takes batches up to this; larger ones take torch's GEMM
        self.gated_amx_rows = amx_gemm_rows() or sys.maxsize  # from here a gated copy runs fused on the AMX GEMM
        # prefill chunks take the plan where the modules' attention takes the kernel for them
        self.prefills = self.d <= 256 and prefill_attention.prefill_attention_available()

    def takes(self, fb: ForwardBatch) -> bool:
        """Whether this step runs on the plan (else through the modules)."""
        return not fb.prefills or self.prefills

    @classmethod
    def build(cls, model: DecoderLM) -> LlamaDecodePlan | None:
        """The plan, or None where some layer would take another path than these kernels (float32
        models: llama_plan_f32.py's plan, for their decode steps)."""
        cfg = model.cfg
        if model.device.type == "cpu" and model.embed_tokens.weight.dtype == torch.float32:
            from engine.models.llama_plan_f32 import LlamaDecodePlanF32  # decode steps of float32 models

            return LlamaDecodePlanF32.build(model)
        if (model.device.type != "cpu" or model.embed_tokens.weight.dtype != torch.bfloat16 or not model.layers
                or cfg.head_dim % 32 or cfg.head_dim > 512 or not small_linear_available()
                or not fused_rotary_available() or not fused_act_available() or not rms_norm.available()):
            return None
        if any(r.cos.dtype != torch.bfloat16 for r in model.rotary.values()):
            return None
        if not plain_layers(model, lambda lin: lin.weight.dtype == torch.bfloat16 and lin.weight.is_contiguous()):
            return None
        paged_attention._load_ops()
        return cls(model)

    def current(self) -> bool:
        """No weight the plan holds was replaced or changed in place since it was built."""
        return weights_current(self.weights)

    def run(self, model: DecoderLM, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """DecoderLM.forward for a step that takes(): hidden states of fb.logits_indices' rows."""
        ops = torch.ops.pdserve
        rms, linear, rotary = ops.rms_norm.default, ops.small_linear.default, ops.rotary.default
        attend, act = ops.paged_decode_attention.default, ops.act_and_mul.default
        gated, write = ops.small_linear_gated.default, ops.write_kv.default
        gated_amx = ops.small_linear_gated_amx.default
        x = model.embed(fb.input_ids)
        t = x.shape[0]
        fb.rope = {k: r.tables(fb.positions) for k, r in model.rotary.items()}
        tables = {k: (c.reshape(t, -1), s.reshape(t, -1)) for k, (c, s) in fb.rope.items()}
        h, kvh, d = self.h, self.kvh, self.d
        qk, hook = (h + kvh) * d, model.between_layers
        wp, wo, pages, ctx = fb.write_page, fb.write_off, fb.dec_pages, fb.dec_ctx
        prefills = fb.prefills
        # as DecoderLM.forward: past its attention the last layer runs only the sampled rows
        # (a one-layer model cuts after it)
        idx, last = fb.logits_indices, len(self.layers) - 1
        cut = idx.shape[0] != t  # else idx is every row in order (increasing indices)
        big = t > self.max_rows  # the modules' linears take torch's GEMM (F.linear) for the step's rows
        residual = None
        k = x.shape[1]
        for i, (in_w, in_eps, qkv_w, qkv_b, qkv_p, qkv_g, o_w, o_p, o_g, post_w, post_eps, gu_w, gu_p, gu_g, gu_gated,
                down_w, down_p, down_g, gelu, layer_id, scale, layer_type, fused, qkv_q, o_q, gu_q,
                down_q) in enumerate(self.layers):
            if residual is None:
                n, residual = rms(x, None, in_w, in_eps, False)[0], x
            else:
                n, residual = rms(x, residual, in_w, in_eps, False)
            qkv = F.linear(n, qkv_w, qkv_b) if big else linear(n, qkv_w, qkv_b, qkv_p, qkv_g, qkv_q)
            cos, sin = tables[layer_type]
            rotated = rotary(qkv[:, :qk].view(t, h + kvh, d), cos, sin)
            cache = pool.full[:, pool.layer_index[layer_id]]
            kk, vv = rotated[:, h:], qkv[:, qk:].view(t, kvh, d)
            write(cache, wp, wo, kk, vv)
            if not prefills:
                o = attend(rotated[:, :h].contiguous(), cache, pages, ctx, scale)
            else:
                o = self._attend(rotated[:, :h], kk, vv, cache, fb, scale)
            rows = t
            if i == last and i and cut:
                o, residual = o[idx], residual[idx]
                rows = o.shape[0]
                big = rows > self.max_rows
            o = o.reshape(rows, h * d)
            n, residual = rms(F.linear(o, o_w) if big else linear(o, o_w, None, o_p, o_g, o_q), residual, post_w,
                              post_eps, False)
            if big:
                a = act(F.linear(n, gu_w), gelu)
            elif fused:
                a = gated(n, gu_p, k, gelu)
            elif rows >= self.gated_amx_rows and gu_gated is not None:
                a = gated_amx(n, gu_w, gu_gated, gelu)
            else:
                a = act(linear(n, gu_w, None, gu_p, gu_g, gu_q), gelu)
            x = F.linear(a, down_w) if big else linear(a, down_w, None, down_p, down_g, down_q)
            if hook is not None:
                hook()
        if not last and cut:
            x, residual = x[idx], residual[idx]
        return model.norm.add_norm(x, residual)[0]

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, fb: ForwardBatch,
                scale: float) -> torch.Tensor:
        """PagedAttention.forward's kernels for a step with prefill chunks (the K/V written)."""
        ops = torch.ops.pdserve
        prefill = ops.prefill_attention.default
        b, prefills = fb.num_decode, fb.prefills
        if not b and len(prefills) == 1 and prefills[0].length == q.shape[0]:  # one chunk alone
            p = prefills[0]
            if not p.has_context:
                return prefill(q, k, v, scale, 0)
            return prefill(q, *(cache[p.pages, j].flatten(0, 1)[:p.ctx] for j in (0, 1)), scale, 0)
        out = torch.empty_like(q)
        if b:
            out[:b] = ops.paged_decode_attention.default(q[:b].contiguous(), cache, fb.dec_pages, fb.dec_ctx, scale)
        for p in prefills:
            s, n = p.start, p.length
            if not p.has_context:
                kk, vv = k[s:s + n], v[s:s + n]
            else:
                kk, vv = (cache[p.pages, j].flatten(0, 1)[:p.ctx] for j in (0, 1))
            out[s:s + n] = prefill(q[s:s + n], kk, vv, scale, 0)
        return out


class LlamaForCausalLM(DecoderLM):
    layer_cls = LlamaDecoderLayer
    norm_cls = RMSNorm
    decode_plan_cls = LlamaDecodePlan
