"""Reductions over response masks, shared by advantages, KL and losses.

A mask is a `[B, T]` bool or float tensor: 1 on response tokens that count, 0 on prompt, padding
and everything after the end of the response. Float masks may hold weights other than 0/1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

# Reduces a small statistics tensor over data-parallel ranks (e.g. an in-place all_reduce SUM
# wrapped by the trainer). Algorithms stay free of torch.distributed: the trainer passes this in.
ReduceFn = Callable[[Tensor], Tensor]


def as_float_mask(mask: Tensor, like: Tensor) -> Tensor:
    """Mask in `like`'s dtype and device, checked against `like`'s shape."""
    if mask.shape != like.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} != tensor shape {tuple(like.shape)}: "
            "pass the [B, T] response mask of the same batch"
        )
    return mask.to(device=like.device, dtype=like.dtype)


def apply_mask(x: Tensor, mask: Tensor) -> Tensor:
    """x * mask on masked entries and exactly 0 elsewhere, [B, T] -> [B, T].

    Selected with torch.where, not multiplied: a NaN or -inf at a padded position (a log-prob of a
    pad token, a value past the response) times 0 is NaN, which would poison every sum over it.
    """
    m = as_float_mask(mask, x)
    return torch.where(m != 0, x * m, torch.zeros_like(x))


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    xm = apply_mask(x, mask)
    return xm.sum() if dim is None else xm.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of `x` over masked entries (over `dim` only, when given); 0 where nothing is masked."""
    m = as_float_mask(mask, x)
    xm = apply_mask(x, mask)
    num = xm.sum() if dim is None else xm.sum(dim)
    den = m.sum() if dim is None else m.sum(dim)
    # An empty mask has num == 0: the clamp turns 0/0 into 0 instead of nan.
    return num / den.clamp(min=1e-8)


def whiten_stats(x: Tensor, mask: Tensor) -> Tensor:
    """[3] = (sum, sum of squares, count) of masked `x`; sums over ranks combine exactly."""
    m = as_float_mask(mask, x)
    xm = apply_mask(x, mask)
    return torch.stack([xm.sum(), (apply_mask(x, m != 0) * xm).sum(), m.sum()])


def masked_whiten(
    x: Tensor, mask: Tensor, reduce_fn: Optional[ReduceFn] = None, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """(x - mean) / std over masked entries, 0 outside the mask.

    Variance is unbiased (count - 1), as in verl's `masked_whiten`. With `reduce_fn` (a sum over
    data-parallel ranks) the mean and std are those of the whole global batch, so the result does
    not depend on how the batch is spread over ranks.
    """
    stats = whiten_stats(x.detach().double(), mask)  # [3]; float64: sum-of-squares cancels badly
    if reduce_fn is not None:
        stats = reduce_fn(stats)
    total, total_sq, count = stats.unbind()
    if count.item() < 2:
        raise ValueError(
            f"cannot whiten over {count.item():g} masked tokens: the batch needs at "
            "least 2 response tokens (check the response mask)"
        )
    mean = total / count
    var = (total_sq / count - mean * mean).clamp(min=0.0) * count / (count - 1)
    out = (x - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + eps)
    if not shift_mean:
        out = out + mean.to(x.dtype)
    return apply_mask(out, mask)


def mask_counts(mask: Tensor) -> tuple[float, int]:
    """(num_tokens, num_seqs) of a mask: what the trainer sums over micro-batches and ranks.

    num_tokens is the mask's sum (a whole number for 0/1 masks). A sequence counts when it has at
    least one masked token, so padding rows (all-zero masks) added to even out micro-batches
    change nothing. Pass the global sums to `agg_loss`.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask has shape {tuple(mask.shape)}: pass the [B, T] response mask")
    m = mask.to(torch.float64)  # [B, T]
    return m.sum().item(), int((m.sum(-1) > 0).sum().item())
