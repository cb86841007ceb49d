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

    `prepare_grads` and `get_grad_norm` are side-effect free to repeat for optimizers without a loss
    scaler (fp32, bf16: they copy gradients into the main gradients), so `optimizer.step()` redoes
    them; an fp16 loss scaler's `prepare_grads` unscales in place, and megatron already skips its
    overflowing steps.
    """
    if getattr(optimizer, "grad_scaler", None) is None:
        optimizer.prepare_grads()
        norm = float(optimizer.get_grad_norm())
        if not math.isfinite(norm):
            return False, norm
    ok, norm, _ = optimizer.step()
    if not ok:
        return False, float("nan")
    return True, float(norm if norm is not None else 0.0)


def count_nonfinite(modules) -> int:
    """Parameters (tensors) of `modules` on this rank holding a NaN or an infinity."""
    bad = 0
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                bad += int(not bool(torch.isfinite(p).all()))
    return bad


def first_nonfinite(metrics: dict, keys: tuple) -> str:
    """The first of `keys` whose value in `metrics` is NaN or infinite ('' when all are finite)."""
    for key in keys:
        value = metrics.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            return key
    return ""
