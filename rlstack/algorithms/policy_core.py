"""The shared parts of the policy losses: aggregation modes (token-mean, seq-mean-...), the
policy-loss registry and the masking helper. `losses.py` (vanilla, gspo) and `policy_variants.py`
(verl's other losses) both register here, so neither imports the other's module at load time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from rlstack.algorithms import names
from rlstack.algorithms.masked import apply_mask, as_float_mask

AggFn = Callable[[Tensor, Tensor, Any, Any, Any], Tensor]
LOSS_AGG_MODES: dict[str, AggFn] = {}
# Which global count each mode divides by ("tokens", "seqs" or "none").
_AGG_COUNT: dict[str, str] = {}


def register_agg(name: str, count: str) -> Callable[[AggFn], AggFn]:
    assert count in ("tokens", "seqs", "none")

    def wrap(fn: AggFn) -> AggFn:
        assert name not in LOSS_AGG_MODES, f"loss aggregation {name} registered twice"
        LOSS_AGG_MODES[name], _AGG_COUNT[name] = fn, count
        return fn

    return wrap


# Each mode gets the loss already masked (0 off the mask, selected with torch.where), the float
# mask, the counts it divides by and the constant of seq-mean-token-sum-norm.


@register_agg("token-mean", count="tokens")
def _token_mean(xm: Tensor, m: Tensor, num_tokens, num_seqs, scale_factor) -> Tensor:
    return xm.sum() / num_tokens


@register_agg("token-sum", count="none")
def _token_sum(xm: Tensor, m: Tensor, num_tokens, num_seqs, scale_factor) -> Tensor:
    return xm.sum()  # no normalisation: the loss grows with the batch and the lengths


@register_agg("seq-mean-token-sum", count="seqs")
def _seq_mean_token_sum(xm: Tensor, m: Tensor, num_tokens, num_seqs, scale_factor) -> Tensor:
    return xm.sum(-1).sum() / num_seqs  # [B] -> scalar


@register_agg("seq-mean-token-mean", count="seqs")
def _seq_mean_token_mean(xm: Tensor, m: Tensor, num_tokens, num_seqs, scale_factor) -> Tensor:
    seq_mean = xm.sum(-1) / m.sum(-1).clamp(min=1e-8)  # [B]; empty rows give 0
    return seq_mean.sum() / num_seqs


@register_agg("seq-mean-token-sum-norm", count="seqs")
def _seq_mean_token_sum_norm(xm: Tensor, m: Tensor, num_tokens, num_seqs, scale_factor) -> Tensor:
    # Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): token sums divided by one constant (the
    # generation budget), so a long response is not down-weighted per token as token means do.
    if scale_factor is None or scale_factor <= 0:
        raise ValueError(
            "seq-mean-token-sum-norm divides by a constant length: pass "
            "loss_scale_factor (algorithm.loss_scale_factor or rollout.max_new_tokens)"
        )
    return xm.sum(-1).sum() / num_seqs / scale_factor


names.check_registered("loss aggregation", LOSS_AGG_MODES, names.LOSS_AGG_MODES)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
) -> Tensor:
    """Scalar loss from a per-token loss [B, T].

    token-mean: sum over masked tokens / number of tokens.
    token-sum: sum over masked tokens.
    seq-mean-token-sum: sum over sequences of their token sums / number of sequences.
    seq-mean-token-mean: sum over sequences of their token means / number of sequences.
    seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (a constant length).
    The counts are the global ones when given (see the module doc), else those of `mask`.
    Positions off the mask are dropped with torch.where: a NaN or inf there changes nothing.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}: choose one of {', '.join(LOSS_AGG_MODES)}")
    m = as_float_mask(mask, loss_mat)  # [B, T]
    num_tokens, num_seqs = _counts(mode, m, global_num_tokens, global_num_seqs)
    return LOSS_AGG_MODES[mode](apply_mask(loss_mat, m), m, num_tokens, num_seqs, loss_scale_factor)


def _counts(mode: str, m: Tensor, global_num_tokens, global_num_seqs):
    if _AGG_COUNT[mode] == "none":
        return global_num_tokens, global_num_seqs
    needed = "global_num_tokens" if _AGG_COUNT[mode] == "tokens" else "global_num_seqs"
    given = {"global_num_tokens": global_num_tokens, "global_num_seqs": global_num_seqs}
    if given[needed] is None:
        if any(v is not None for v in given.values()):
            raise ValueError(
                f"{mode} divides by {needed}, which is missing: pass the global "
                "counts of both kinds (sums of mask_counts over the mini-batch)"
            )
        # Local mean; an empty micro-batch has a zero numerator, so the clamp just avoids 0/0.
        return m.sum().clamp(min=1e-8), (m.sum(-1) > 0).sum().clamp(min=1)
    if given[needed] <= 0:
        raise ValueError(f"{needed} is {given[needed]}: pass the positive count of the mini-batch")
    return global_num_tokens, global_num_seqs


def _on_mask(mask: Tensor, *tensors: Tensor) -> list[Tensor]:
    """Each tensor with 0 off the mask (selected, so NaN/-inf there reach neither loss nor grad)."""
    present = as_float_mask(mask, tensors[0]) != 0
    return [torch.where(present, t, torch.zeros_like(t)) for t in tensors]


# ----------------------------------------------------------------------------- policy

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        assert name not in POLICY_LOSSES, f"policy loss {name} registered twice"
        POLICY_LOSSES[name] = fn
        return fn

    return wrap
