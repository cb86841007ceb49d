"""Faster eager CPU kernels for megatron-core's SwiGLU, RMSNorm and RoPE: the same maths in fewer
temporaries (measurements: docs/megatron_core.md). Registered in `megatron_bridge.patches.registry`
(kind "faster CPU kernel", applies without CUDA).
"""

from __future__ import annotations

import functools

import torch

# (i) fusions/fused_bias_swiglu.py decorates swiglu / swiglu_back (and the bias and weighted
#     variants) with `megatron.core.jit.jit_fuser`, which is `torch.compile` on torch >= 2.2: on CPU
#     inductor builds C++ with the system g++ at the first call of every process (and needs a
#     compiler on every node). Their autograd Functions (SwiGLUFunction,
#     WeightedSwiGLUFunction, reached from transformer/mlp.py and moe/experts.py with
#     bias_activation_fusion) save only fc1's output whichever way the kernels run. The bias and
#     weighted variants get their eager originals back; `swiglu` and `swiglu_back` (which the bias
#     variants call by their module-level names) get the eager kernels below: the same maths with
#     one temporary instead of ~11 (each a fresh, page-faulted [tokens, ffn] tensor at the fixed
#     mmap threshold; timings in docs/megatron_core.md; equal within 1e-6 relative,
#     tests/unit/test_cpu_compat.py).
_SWIGLU_KERNELS = (
    "bias_swiglu",
    "bias_swiglu_back",
    "weighted_swiglu",
    "weighted_swiglu_back",
)


def eager_swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(y1) * y2 for y = [y1, y2] along the last dimension."""
    y1, y2 = torch.chunk(y, 2, -1)
    return torch.nn.functional.silu(y1).mul_(y2)


def eager_swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d/dy of sum(g * silu(y1) * y2) = [g y2 silu'(y1), g silu(y1)], silu' = sig + silu (1 - sig)."""
    y1, y2 = torch.chunk(y, 2, -1)
    out = torch.empty_like(y)
    d1, d2 = torch.chunk(out, 2, -1)  # views of out's two halves
    sig = torch.sigmoid(y1)
    torch.mul(y1, sig, out=d2)  # silu(y1)
    torch.mul(d2, sig, out=d1)
    d1.neg_().add_(d2).add_(sig)  # sig + silu - silu sig
    d1.mul_(y2).mul_(g)
    d2.mul_(g)
    return out


def _patch_eager_swiglu() -> None:
    from megatron.core.fusions import fused_bias_swiglu

    for name in _SWIGLU_KERNELS:
        kernel = getattr(fused_bias_swiglu, name)
        setattr(fused_bias_swiglu, name, getattr(kernel, "_torchdynamo_orig_callable", kernel))
    fused_bias_swiglu.swiglu = eager_swiglu
    fused_bias_swiglu.swiglu_back = eager_swiglu_back


# (j) transformer/torch_norm.py `WrappedTorchNorm` (the local spec's norm, LNImpl in
#     models/gpt/gpt_layer_specs.py: every layer's two norms, the final one and Qwen3's q/k norms)
#     returns `torch.nn.RMSNorm`. On CPU its `F.rms_norm` is torch's composite decomposition (even
#     `aten::_fused_rms_norm` decomposes there): pow, mean, rsqrt and two muls, each a fresh
#     [tokens, h] tensor, and autograd keeps the input, rstd and the normalised input x * rstd.
#     `LeanRMSNorm` (fp32, elementwise affine) computes the same forward in the same order (bit
#     for bit) and keeps only the input and rstd; its backward makes one [tokens, h] tensor: one
#     [tokens, h] activation less per norm (timings in docs/megatron_core.md).
class _LeanRMSNormFunction(torch.autograd.Function):
    """y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))  # [.., 1]
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # dx = r (g w) - x r^3 <g w, x> / h;  dw = sum over rows of r (g x)
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        x2, g2, r = x.reshape(-1, h), grad.reshape(-1, h), rstd.reshape(-1)  # [N, h], [N, h], [N]
        gx = torch.mul(g2, x2)  # g x: the one [N, h] tensor, reused for dx below
        grad_weight = r @ gx  # [h]
        dot = gx @ weight  # [N] = <g w, x>
        coef = dot.mul_(r).mul_(r).mul_(r).div_(h).unsqueeze(-1)  # [N, 1]
        torch.mul(g2, weight, out=gx).mul_(r.unsqueeze(-1)).addcmul_(x2, coef, value=-1)
        return gx.view(x.shape), grad_weight, None


class LeanRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm with `_LeanRMSNormFunction` for fp32 inputs with a weight (else the original)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.is_cuda:
            return super().forward(x)
        assert tuple(self.normalized_shape) == (x.shape[-1],), (self.normalized_shape, x.shape)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _LeanRMSNormFunction.apply(x, weight, eps)


def _patch_lean_rmsnorm() -> None:
    from megatron.core.transformer import torch_norm

    wrapped = torch_norm.WrappedTorchNorm
    original = wrapped.__new__

    def new(cls, *args, **kwargs):
        norm = original(cls, *args, **kwargs)
        if type(norm) is torch.nn.RMSNorm:
            norm.__class__ = LeanRMSNorm  # same parameters and state dict, another forward
        return norm

    wrapped.__new__ = staticmethod(new)


# (k) models/common/embeddings/rope_utils.py `_apply_rotary_pos_emb_bshd` (the unfused RoPE of
#     `apply_rotary_pos_emb`, reached from transformer/attention.py for q and k in every layer)
#     makes six [s, b, heads, d] tensors per call (t * cos, the rotated half's negation and cat,
#     its product with sin, the sum, and a final cat with an empty pass-through part), and as many
#     again in backward. `_LeanRope` writes t * cos into one new tensor and adds the rotated half's
#     product in place, forward and backward (the rotation's transpose): same maths, rounded in
#     another order (within 1e-6 relative). Interleaved, MLA and partial rotary keep the original.
class _LeanRope(torch.autograd.Function):
    """out = t cos + rotate_half(t) sin, rotate_half([t1, t2]) = [-t2, t1]; cos, sin carry no grad."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_into(torch.mul(t, cos), t, sin, transpose=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_into(torch.mul(grad, cos), grad, sin, transpose=True), None, None


def _rotate_into(out: torch.Tensor, t: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """out += rotate_half(t) * sin (transpose: rotate_half's transpose, [t1, t2] -> [t2, -t1])."""
    half = t.shape[-1] // 2
    t1, t2, s1, s2 = t[..., :half], t[..., half:], sin[..., :half], sin[..., half:]
    if transpose:  # d/dt1 = g1 c1 + g2 s2, d/dt2 = g2 c2 - g1 s1
        out[..., :half].addcmul_(t2, s2)
        out[..., half:].addcmul_(t1, s1, value=-1)
    else:  # out1 = t1 c1 - t2 s1, out2 = t2 c2 + t1 s2
        out[..., :half].addcmul_(t2, s1, value=-1)
        out[..., half:].addcmul_(t1, s2)
    return out


def _patch_lean_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd

    @functools.wraps(original)
    def bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if rotary_interleaved or multi_latent_attention or t.dtype != torch.float32 or t.shape[-1] != freqs.shape[-1]:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos = (torch.cos(freqs) * mscale).to(t.dtype)  # as the original: [s, 1, 1, d]
        sin = (torch.sin(freqs) * mscale).to(t.dtype)
        return _LeanRope.apply(t, cos, sin)

    bshd._rlstack_lean = True
    rope_utils._apply_rotary_pos_emb_bshd = bshd
