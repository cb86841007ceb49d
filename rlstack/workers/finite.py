"""Non-finite guards around the optimizer step: a diverging run stops (or skips) loudly.

megatron-core's fp32 optimizer reports every step as successful, even when the gradients hold NaN
(optimizer.py `FP32Optimizer.step`: "Always return successful since there is no overflow"); its
gradient clipping then multiplies by NaN and Adam writes NaN weights. So the gradient norm is
checked here before the step, and the weights after it.
"""

from __future__ import annotations

import math

import torch

from rlstack.errors import UserError


class DivergenceError(UserError):
    """Training produced a non-finite loss, gradient norm or weight; the message names step and quantity."""


def step_unless_nonfinite(optimizer) -> tuple[bool, float]:
    """(stepped, grad norm): the optimizer step, skipped when the global gradient norm is not finite.

    Without a loss scaler (fp32, bf16) the norm is computed once (`prepare_grads`, `get_grad_norm`),
    checked, and then used for the clipping and the step as megatron-core 0.16.1's `step` does
    (optimizer.py `ChainedOptimizer.step` / `MegatronOptimizer.step`: the same functions on the same
    gradients, so the same numbers) instead of calling `step()`, which prepared the gradients and
    computed the norm a second time (two more passes over the gradient shard a step). An fp16 loss
    scaler's `prepare_grads` unscales in place, and megatron already skips its overflowing steps.
    """
    if getattr(optimizer, "grad_scaler", None) is None:
        optimizer.prepare_grads()
        norm = optimizer.get_grad_norm()
        if not math.isfinite(float(norm)):
            return False, float(norm)
        return _clip_and_step(optimizer, norm)
    ok, norm, _ = optimizer.step()
    if not ok:
        return False, float("nan")
    return True, float(norm if norm is not None else 0.0)


def _clip_and_step(optimizer, norm) -> tuple[bool, float]:
    """The rest of megatron's `step` after the norm: clip each optimizer's parameters by it, step."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    chained = hasattr(optimizer, "chained_optimizers")
    clipped = False
    for opt in optimizer.chained_optimizers if chained else [optimizer]:
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            clip_grad_by_total_norm_fp32(params, opt.config.clip_grad, norm, decoupled)
            clipped = True
    ok = optimizer.step_with_ready_grads()
    # megatron returns the norm from a ChainedOptimizer always, from a single one only when it clipped
    return bool(ok), float(norm) if chained or clipped else 0.0


def count_nonfinite(modules) -> int:
    """Parameters (tensors) of `modules` on this rank holding a NaN or an infinity."""
    bad = 0
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                if not p.numel():
                    continue
                # min and max propagate NaN and hold any infinity: one pass and no [p] temporaries
                # (isfinite(p).all() made four: eq, abs, ne, and; ~0.2 s a step for SmolLM2's 538 MB)
                lo, hi = torch.aminmax(p.detach())
                bad += int(not (math.isfinite(float(lo)) and math.isfinite(float(hi))))
    return bad


def first_nonfinite(metrics: dict, keys: tuple) -> str:
    """The first of `keys` whose value in `metrics` is NaN or infinite ('' when all are finite)."""
    for key in keys:
        value = metrics.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            return key
    return ""
