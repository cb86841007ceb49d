"""PPO losses and their aggregation over tokens and sequences.

Layout independence: the trainer splits a mini-batch into micro-batches and data-parallel ranks.
It computes `mask_counts` of every micro-batch, sums them over the mini-batch (all micro-batches,
all DP ranks) and passes the sums as `global_num_tokens` / `global_num_seqs`. Each micro-batch
loss is then that micro-batch's share of the full mini-batch loss, and the sum over micro-batches
and ranks equals the loss of the whole mini-batch computed at once, whatever the split. (Megatron's
schedule divides each micro-batch loss by the number of micro-batches and DDP averages gradients
over DP ranks: the trainer undoes both scalings; see docs/algorithms.md.)
Without global counts, `agg_loss` normalises over the tensors it is given (a plain mean).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rlstack.algorithms import names
from rlstack.algorithms.kl import kl_estimate
from rlstack.algorithms.masked import apply_mask, as_float_mask, masked_mean
from rlstack.algorithms.policy_core import (  # noqa: F401 (re-exported: this module's API)
    _AGG_COUNT,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AggFn,
    PolicyLossFn,
    _counts,
    _on_mask,
    _seq_mean_token_mean,
    _seq_mean_token_sum,
    _seq_mean_token_sum_norm,
    _token_mean,
    _token_sum,
    agg_loss,
    register_agg,
    register_policy_loss,
)


@register_policy_loss("vanilla")
def policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: Optional[float] = 3.0,
    agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with separate low/high clip ratios and dual clip (Ye et al. 2020).

    ratio = exp(logprob - old_logprob); per token: max(-A * ratio, -A * clip(ratio, 1 - clip_low,
    1 + clip_high)); for A < 0 that is further capped at -A * clip_c, so a huge ratio on a bad
    token cannot make the loss unbounded. clip_c=None turns the dual clip off.
    Stats (detached local masked means): clip_frac, approx_kl (k1 of old vs new), dual_clip_frac.
    """
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(
            f"dual-clip bound clip_c={clip_c} must be > 1: set algorithm.clip_ratio_c above 1 (3.0 is usual)"
        )
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    # Clamped before exp as in verl: a stale old_logprob must not overflow the ratio.
    log_ratio = (logprob - old_logprob).clamp(min=-20.0, max=20.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio  # [B, T]
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]
    stats = {
        "clip_frac": masked_mean((loss_clipped > loss_unclipped).to(ratio.dtype), mask),
        "approx_kl": masked_mean(-log_ratio, mask),
    }
    loss_mat = loss_ppo
    if clip_c is not None:
        loss_cap = -advantages * clip_c  # [B, T]
        negative = advantages < 0
        loss_mat = torch.where(negative, torch.minimum(loss_ppo, loss_cap), loss_ppo)
        dual = (loss_ppo > loss_cap) & negative
        stats["dual_clip_frac"] = masked_mean(dual.to(ratio.dtype), mask)
    else:
        stats["dual_clip_frac"] = ratio.new_zeros(())
    if is_weights is not None:  # algorithm.rollout_is: truncated IS weights [B, T] (rollout_is.py)
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, mask, agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
    return loss, {k: v.detach() for k, v in stats.items()}


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: Optional[float] = None,
    agg_mode: str = "seq-mean-token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): one importance ratio per sequence, clipped.

    s_i = exp(mean over the response of (logprob - old_logprob)), the geometric mean of the token
    ratios. Per token the ratio is sg[s_i] * p_t / sg[p_t]: its value is s_i, its gradient that of
    s_i * log p_t, so every token of a sequence shares one clip decision. The log-ratio is capped at
    10 before exp (as verl). The clip ranges are sequence-level and much tighter than PPO's (the
    paper: 3e-4 / 4e-4). clip_c (dual clip) is not part of GSPO and is ignored. Stats as
    policy_loss; approx_kl is token-level.
    """
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    m = as_float_mask(mask, logprob)  # [B, T]
    token_log_ratio = logprob - old_logprob  # [B, T], 0 off the mask
    seq_log_ratio = apply_mask(token_log_ratio, m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [B]
    log_ratio = (logprob - logprob.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio  # [B, T]
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    stats = {
        "clip_frac": masked_mean((loss_clipped > loss_unclipped).to(ratio.dtype), mask),
        "approx_kl": masked_mean(-token_log_ratio, mask),
        "dual_clip_frac": ratio.new_zeros(()),
    }
    if is_weights is not None:  # algorithm.rollout_is (rollout_is.py)
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, mask, agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
    return loss, {k: v.detach() for k, v in stats.items()}


# Registers sapo, gpg, clip_cov, ... (it needs the above) and checks the table against names.py.
from rlstack.algorithms import policy_variants  # noqa: E402,F401

names.check_registered("policy loss", POLICY_LOSSES, names.POLICY_LOSSES)


def compute_policy_loss(name: str, *args, **kwargs) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss registered as `name` (algorithm.policy_loss): policy_loss's arguments, plus the
    loss's own keyword parameters (names.POLICY_LOSS_PARAMS: tau_pos, clip_cov_ratio, dro_beta, ...)."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}: choose one of {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name](*args, **kwargs)


# ----------------------------------------------------------------------------- critic


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: Optional[float] = 0.2,
    agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 * max((v - R)^2, (clip(v, v_old - clip, v_old + clip) - R)^2), aggregated.

    clip=None turns the value clip off. Stats: clip_frac (share of tokens where v - v_old was
    clipped AND the clipped term is the larger), values_mean (both detached local masked means).
    A token counts as clipped from the clamp of v - v_old itself: v_old + clamp(v - v_old) can
    differ from v in the last bit when nothing was clipped, which would count it by rounding.
    """
    if clip is not None and clip <= 0:
        raise ValueError(f"value clip {clip} must be > 0: set algorithm.value_clip > 0")
    values, old_values, returns = _on_mask(mask, values, old_values, returns)
    loss_unclipped = (values - returns) ** 2  # [B, T]
    if clip is None:
        loss_mat, clip_frac = loss_unclipped, values.new_zeros(())
    else:
        delta = values - old_values  # [B, T]
        delta_clipped = delta.clamp(-clip, clip)
        was_clipped = delta_clipped != delta
        values_clipped = torch.where(was_clipped, old_values + delta_clipped, values)  # exactly v if not
        loss_clipped = (values_clipped - returns) ** 2
        loss_mat = torch.maximum(loss_unclipped, loss_clipped)
        clip_frac = masked_mean((was_clipped & (loss_clipped > loss_unclipped)).to(values.dtype), mask)
    loss = 0.5 * agg_loss(loss_mat, mask, agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
    stats = {"clip_frac": clip_frac, "values_mean": masked_mean(values, mask)}
    return loss, {k: v.detach() for k, v in stats.items()}


# ----------------------------------------------------------------------------- KL and entropy


def kl_loss(
    logprob: Tensor,
    ref_logprob: Tensor,
    mask: Tensor,
    kind: str = "k3",
    agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL(policy || reference) as a loss term (GRPO style); stats: kl (detached local mean)."""
    logprob, ref_logprob = _on_mask(mask, logprob, ref_logprob)
    kl = kl_estimate(logprob, ref_logprob, kind)  # [B, T]
    loss = agg_loss(kl, mask, agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
    return loss, {"kl": masked_mean(kl, mask).detach()}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: [B, T, V] -> [B, T].

    Needs the full vocabulary: logits sharded over tensor-parallel ranks need a vocab-parallel
    version (all-reduce of the max, sum-exp and sum p*logit over the TP group).
    """
    log_z = torch.logsumexp(logits, dim=-1)  # [B, T]
    probs = torch.softmax(logits, dim=-1)  # [B, T, V]
    return log_z - (probs * logits).sum(-1)


__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "agg_loss",
    "compute_policy_loss",
    "entropy_from_logits",
    "gspo_policy_loss",
    "kl_loss",
    "masked_mean",
    "policy_loss",
    "register_agg",
    "register_policy_loss",
    "value_loss",
]
