"""One decode step of a Llama-family transformers model in ~20 tensor ops a layer (the hf engine, CPU).

A decode step multiplies a few rows by every weight; on CPU the weights' streaming is the floor
(SmolLM2: ~22 ms a step at 24 GB/s). transformers' forward adds ~17 ms of per-module Python and
small ops to it at one row (masks, cache bookkeeping, three q/k/v and two gate/up calls, output
wrappers). `LeanDecoder` runs the same maths on the model's norms and embedding and on the
oneDNN-packed copies of its linears that the hf engine holds during rollout anyway (no further copy),
writing into the engine's reserved KV cache. (Fusing q/k/v and gate/up into one weight each saved
only ~2 ms more at 1-16 rows and would need a second copy.) Llama, Qwen2 (q/k/v biases) and Qwen3
(q/k norms) with full attention and SiLU; other models keep transformers' forward
(`LeanDecoder.supports`). Prefill runs transformers' forward.
tests/unit/test_lean_decode.py checks the logits against transformers' forward step by step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from rlstack.rollout import cpu_gemm

_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm, the same ops in the same order: normalised in fp32, back to
    x's dtype (a no-op for fp32), times the weight."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor: t cos + rotate_half(t) sin."""
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def sdpa(q, k, v, mask, scale, causal: bool = False, gqa: bool = False, dropout: float = 0.0) -> torch.Tensor:
    """F.scaled_dot_product_attention, with bf16 / fp16 CPU inputs multiplied in fp32 and the output cast
    back. torch's CPU flash kernel in bf16 is slow at rollout shapes (SmolLM2's decode step, 9 rows, 130
    keys, AMD EPYC with AVX-512 bf16, one thread: 780 us a layer in bf16, 129 us with the upcast, 96 us
    in fp32); it accumulates in fp32 either way. A float mask is used in fp32 as well."""
    dtype = q.dtype
    low = q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    if low:
        q, k, v = q.float(), k.float(), v.float()
        mask = mask.float() if mask is not None and mask.is_floating_point() else mask
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, is_causal=causal, enable_gqa=gqa
    )
    return out.to(dtype)


@dataclass
class _Layer:
    input_norm: tuple[torch.Tensor, float]
    q: Callable[[torch.Tensor], torch.Tensor]  # [b, h] -> [b, n]: the module's forward
    k: Callable[[torch.Tensor], torch.Tensor]
    v: Callable[[torch.Tensor], torch.Tensor]
    q_norm: Optional[tuple[torch.Tensor, float]]  # Qwen3: per-head RMSNorm of q and k before RoPE
    k_norm: Optional[tuple[torch.Tensor, float]]
    o: Callable[[torch.Tensor], torch.Tensor]
    post_norm: tuple[torch.Tensor, float]
    gate: Callable[[torch.Tensor], torch.Tensor]
    up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]


def _norm(module) -> Optional[tuple[torch.Tensor, float]]:
    return (module.weight, module.variance_epsilon) if module is not None else None


class LeanDecoder:
    """A model's decode step (`step`) over the linears' forwards of one generate() call."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        config = model.config
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        return (
            getattr(config, "model_type", None) in _MODEL_TYPES
            and getattr(config, "hidden_act", None) == "silu"
            and all(t == "full_attention" for t in layer_types)
            and not getattr(config, "use_sliding_window", False)
        )

    def __init__(self, model: torch.nn.Module, fast_attention: bool = False):
        """Built inside the hf engine's `_packed_linears` block: each linear's `forward` is then its
        packed one (a zero-copy `GroupedLinear` keeps its own), called without nn.Module's __call__.
        `fast_attention`: attention over the KV cache on rlstack's AVX2 kernel (cpu_gemm.decode_attention;
        the engine sets it where its linears run on that library, rollout.cpu_matmul), SDPA otherwise."""
        self.fast_attention = fast_attention
        inner = model.model
        lin = lambda m: m.forward  # noqa: E731
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.final_norm = _norm(inner.norm)
        self.head = lin(model.lm_head)
        first = inner.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.heads, self.kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self.layers = [
            _Layer(
                input_norm=_norm(layer.input_layernorm),
                q=lin(layer.self_attn.q_proj),
                k=lin(layer.self_attn.k_proj),
                v=lin(layer.self_attn.v_proj),
                q_norm=_norm(getattr(layer.self_attn, "q_norm", None)),
                k_norm=_norm(getattr(layer.self_attn, "k_norm", None)),
                o=lin(layer.self_attn.o_proj),
                post_norm=_norm(layer.post_attention_layernorm),
                gate=lin(layer.mlp.gate_proj),
                up=lin(layer.mlp.up_proj),
                down=lin(layer.mlp.down_proj),
            )
            for layer in inner.layers
        ]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """tokens [b], positions [b] (RoPE), mask [b, n] (1 = attend; n = cached + 1) -> logits [b, V]."""
        b, d = tokens.shape[0], self.head_dim
        x = F.embedding(tokens, self.embed)  # [b, h]
        cos, sin = self.rotary(x, positions.unsqueeze(-1))  # [b, 1, d] each
        # The additive mask SDPA would build from a bool one in every layer, built once: [b, 1, 1, n].
        attend = (
            torch.zeros(mask.shape, dtype=x.dtype, device=x.device)
            .masked_fill_(mask == 0, float("-inf"))
            .view(b, 1, 1, -1)
        )
        gqa = self.heads != self.kv_heads
        if self.fast_attention and x.dtype == torch.float32 and d % 8 == 0 and d <= 1024:
            return self._fast_step(x, cos, sin, attend, cache)
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, *layer.input_norm)
            q, k = layer.q(h).view(b, self.heads, d), layer.k(h).view(b, self.kv_heads, d)
            if layer.q_norm is not None:
                q, k = _rms_norm(q, *layer.q_norm), _rms_norm(k, *layer.k_norm)
            q = _rotate(q, cos, sin).view(b, self.heads, 1, d)
            k = _rotate(k, cos, sin).view(b, self.kv_heads, 1, d)
            keys, values = cache.layers[i].update(k, layer.v(h).view(b, self.kv_heads, 1, d))  # [b, G, n, d] each
            out = sdpa(q, keys, values, attend, self.scaling, gqa=gqa)
            x = x + layer.o(out.reshape(b, self.heads * d))  # out [b, H, 1, d]
            h = _rms_norm(x, *layer.post_norm)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        return self.head(_rms_norm(x, *self.final_norm))  # [b, V]

    def _fast_step(self, x, cos, sin, attend, cache) -> torch.Tensor:
        """`step` on rlstack's AVX2 library (fp32): the same maths, the norms, RoPE, SiLU x up, the residual
        adds and the attention each one C call (cpu_gemm), the linears their packed forwards."""
        b, d = x.shape[0], self.head_dim
        cos, sin = cos.reshape(b, d).contiguous(), sin.reshape(b, d).contiguous()
        mask = attend.view(b, -1)  # [b, n]
        h = cpu_gemm.rms_norm(x, *self.layers[0].input_norm)
        for i, layer in enumerate(self.layers):
            q, k = layer.q(h).view(b, self.heads, d), layer.k(h).view(b, self.kv_heads, d)
            if layer.q_norm is not None:
                q, k = cpu_gemm.rms_norm(q, *layer.q_norm), cpu_gemm.rms_norm(k, *layer.k_norm)
            cpu_gemm.rope_(q, cos, sin)
            cpu_gemm.rope_(k, cos, sin)
            keys, values = cache.layers[i].update(
                k.view(b, self.kv_heads, 1, d), layer.v(h).view(b, self.kv_heads, 1, d)
            )  # [b, G, n, d] each
            if cpu_gemm.attention_applies(q, keys, values):  # the reserved cache's layout (any cache's in practice)
                out = cpu_gemm.decode_attention(q, keys, values, mask, self.scaling)  # [b, H, d]
            else:
                gqa = self.heads != self.kv_heads
                out = sdpa(q.view(b, self.heads, 1, d), keys, values, attend, self.scaling, gqa=gqa)
            h = cpu_gemm.add_rms_norm_(x, layer.o(out.view(b, self.heads * d)), *layer.post_norm)
            up = layer.up(h)
            x.add_(layer.down(cpu_gemm.silu_mul_(layer.gate(h), up)))
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            h = cpu_gemm.rms_norm(x, *following)
        return self.head(h)  # [b, V]
