"""Selective recompute of the dense MLP's SwiGLU product (`model.recompute_modules` "mlp_act").

megatron-core 0.16.1 rebuilds an activation in backward only for MoE experts ("moe_act", grouped
GEMM only). A dense MLP keeps fc1's output [.., 2f] (for SwiGLU's backward) and the product
[.., f] (linear_fc2's input, for its weight gradient). Here the product is made under megatron's
output-discarding checkpoint: its storage is released once linear_fc2 has run and rebuilt from
fc1's output (kept anyway) when fc2's output gradient arrives, exactly as "moe_act" does for
experts (moe/experts.py:739). One SwiGLU forward more per layer in backward; f values per token
and layer less at the peak.

Reached from transformer/mlp.py `MLP.forward` through its module-level `bias_swiglu_impl` (the
path of gated SiLU with `bias_activation_fusion`, which megatron_bridge.models always sets): the
name is wrapped once at start-up (`wrap_swiglu`, registered in `megatron_bridge.patches.registry`,
kind "recompute"), passes every call through unchanged, and acts only inside the forward of an MLP
that `enable` marked, with grad enabled.
"""

from __future__ import annotations

import threading

import torch

_CURRENT = threading.local()  # the marked MLP whose forward is running (None outside)


def enable(model: torch.nn.Module) -> int:
    """Mark every dense MLP of `model` for SwiGLU-product recompute; returns how many were marked."""
    from megatron.core.transformer import mlp as mlp_module
    from megatron.core.transformer.mlp import MLP

    if not getattr(mlp_module.bias_swiglu_impl, "_rlstack_act_recompute", False):
        raise RuntimeError("recompute 'mlp_act' needs megatron_bridge.patches.apply() called once at start-up")
    marked = 0
    for module in model.modules():
        if type(module) is not MLP or getattr(module, "_rlstack_act_recompute", False):
            continue
        if getattr(module.linear_fc2, "is_expert", False):  # MoE experts: their own path (per-token scale)
            continue
        cfg = module.config
        if not (
            cfg.gated_linear_unit and cfg.bias_activation_fusion and cfg.activation_func is torch.nn.functional.silu
        ):
            continue
        module._rlstack_act_recompute = True
        module._rlstack_act_ckpt = None
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave)
        module.linear_fc2.register_forward_hook(_discard_after(module))
        marked += 1
    return marked


def _enter(module, args):
    _CURRENT.mlp = module if torch.is_grad_enabled() else None


def _leave(module, args, output):
    _CURRENT.mlp = None


def _discard_after(mlp):
    def hook(fc2, args, output):
        ckpt, mlp._rlstack_act_ckpt = mlp._rlstack_act_ckpt, None
        if ckpt is not None:
            out = output[0] if isinstance(output, tuple) else output
            ckpt.discard_output_and_register_recompute(out)  # rebuilt when out's gradient arrives

    return hook


def wrap_swiglu() -> None:
    """Wrap megatron's `bias_swiglu_impl` name in transformer/mlp.py (a pass-through unless an MLP is marked)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer import mlp as mlp_module

    original = mlp_module.bias_swiglu_impl
    if getattr(original, "_rlstack_act_recompute", False):
        return

    def bias_swiglu_impl(x, bias, *args, **kwargs):
        owner = getattr(_CURRENT, "mlp", None)
        if owner is None or owner._rlstack_act_ckpt is not None:
            return original(x, bias, *args, **kwargs)
        ckpt = tensor_parallel.CheckpointWithoutOutput()
        out = ckpt.checkpoint(lambda t: original(t, bias, *args, **kwargs), x)
        owner._rlstack_act_ckpt = ckpt
        return out

    bias_swiglu_impl._rlstack_act_recompute = True
    mlp_module.bias_swiglu_impl = bias_swiglu_impl
