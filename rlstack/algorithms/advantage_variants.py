"""Advantage estimators beyond GAE/GRPO/RLOO/REINFORCE++, under verl 0.9.1's names.

- remax: reward-to-go minus a per-prompt baseline reward (ReMax: the greedy response's score).
- opo: score minus the length-weighted group mean (OPO's optimal baseline for outcome rewards).
- grpo_passk: only each group's best sample gets an advantage: best - second best (/ group std).
- gpg: (score - group mean) x batch size / non-zero scores (GPG's alpha), divided by f_norm.
- gdpo: GRPO per reward component, weighted sum, whitened over the batch.
- optimal_token_baseline: reward-to-go minus a per-token baseline weighted by path variance.
Groups of one sample: no baseline (opo, gpg, optimal_token_baseline, as verl); grpo_passk and gdpo
need two (verl's grpo_passk raises too; rlstack's grpo raises where verl's divides by 1).
Behaviour read in verl 0.9.1 `trainer/ppo/core_algos.py`; code written for this project.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rlstack.algorithms.advantage_core import (
    _broadcast,
    _check_same_shape,
    _float_scores,
    _require,
    _sequence_scores,
    grpo,
    register_advantage,
)
from rlstack.algorithms.masked import ReduceFn, apply_mask, as_float_mask, masked_whiten


def _groups(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(inverse [B]: each sample's group 0..G-1, counts [G]) of integer group ids [B]."""
    if group_ids.shape != scores.shape or group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor of shape {tuple(scores.shape)}")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def reward_to_go(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """sum_{s >= t} r_s over the masked tokens, 0 off the mask: [B, T] -> [B, T] (undiscounted)."""
    _check_same_shape(token_rewards=token_rewards, mask=mask)
    return apply_mask(apply_mask(token_rewards, mask).flip(-1).cumsum(-1).flip(-1), mask)


def remax(token_rewards: Tensor, reward_baselines: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): (reward-to-go - baseline [B], reward-to-go), [B, T] each.

    The baseline is the reward of the prompt's greedy response (a second, argmax rollout).
    """
    returns = reward_to_go(token_rewards, mask)  # [B, T]
    return apply_mask(returns - reward_baselines.to(returns.dtype)[:, None], mask), returns


def opo(scores: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """OPO (Hao et al. 2025, arXiv:2505.23585): score - sum(len x score) / sum(len) over the group.

    The length-weighted mean is the variance-minimising baseline for a sequence-level reward when
    the gradient's norm grows with the length. A group of one has baseline 0. [B] -> [B, T].
    """
    scores = _float_scores(scores, mask)
    inverse, counts = _groups(scores, group_ids)
    length = mask.to(device=scores.device, dtype=scores.dtype).sum(-1)  # [B]
    num = scores.new_zeros(len(counts)).index_add_(0, inverse, length * scores)  # [G]
    den = scores.new_zeros(len(counts)).index_add_(0, inverse, length)
    baseline = torch.where(counts > 1, num / den, torch.zeros_like(num))[inverse]  # [B]
    return _broadcast(scores - baseline, mask)


def grpo_passk(scores: Tensor, group_ids: Tensor, mask: Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Pass@k training (Chen et al. 2025, arXiv:2503.19595): per group only the best sample (the
    first best, torch.topk's pick on ties) gets best - second best, / (unbiased group std + eps)
    with norm_by_std; every other sample 0. A group needs two samples. [B] -> [B, T]."""
    scores = _float_scores(scores, mask)
    inverse, counts = _groups(scores, group_ids)
    if bool((counts < 2).any()):
        raise ValueError("grpo_passk needs at least 2 samples per group: set rollout.n >= 2")
    adv = torch.zeros_like(scores)  # [B]
    for g in range(len(counts)):
        rows = torch.nonzero(inverse == g).squeeze(-1)  # batch order, as verl
        top, where = torch.topk(scores[rows], 2)
        value = top[0] - top[1]
        if norm_by_std:
            value = value / (scores[rows].std() + eps)
        adv[rows[where[0]]] = value
    return _broadcast(adv, mask)


def gpg(
    scores: Tensor, group_ids: Tensor, mask: Tensor, f_norm: float = 1.0, reduce_fn: Optional[ReduceFn] = None
) -> Tensor:
    """GPG (Chu et al. 2025, arXiv:2504.02546): alpha x (score - group mean) / f_norm, [B] -> [B, T].

    alpha = batch size / number of non-zero scores (at least 1): it scales up the gradient when few
    samples were rewarded. With reduce_fn (a SUM over data-parallel ranks) both counts are those of
    the global batch, as verl computes them. A group of one has mean 0.
    """
    scores = _float_scores(scores, mask)
    inverse, counts = _groups(scores, group_ids)
    sums = scores.new_zeros(len(counts)).index_add_(0, inverse, scores)  # [G]
    mean = torch.where(counts > 1, sums / counts.to(scores.dtype), torch.zeros_like(sums))[inverse]  # [B]
    batch = torch.tensor([len(scores), int((scores != 0).sum())], dtype=torch.float64, device=scores.device)  # [2]
    if reduce_fn is not None:
        batch = reduce_fn(batch)
    alpha = (batch[0] / batch[1].clamp(min=1)).to(scores.dtype)
    return _broadcast(alpha * (scores - mean) / f_norm, mask)


def gdpo(
    components: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    weights: Optional[Tensor] = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    reduce_fn: Optional[ReduceFn] = None,
) -> Tensor:
    """GDPO (arXiv:2601.05242): whiten(sum_k w_k grpo(component_k)) over the batch: [K, B] -> [B, T].

    Each reward component (format, accuracy, ...) is normalised within its group on its own, so a
    component with a large spread cannot drown out the others; weights default to 1. The whitening
    uses global statistics with reduce_fn (a SUM over data-parallel ranks).
    """
    if components.dim() != 2:
        raise ValueError(f"components has shape {tuple(components.shape)}: pass [K, B] (one row per reward key)")
    k = components.shape[0]
    w = torch.ones(k) if weights is None else torch.as_tensor(weights, dtype=torch.float32).reshape(-1)
    if w.shape != (k,):
        raise ValueError(f"{len(w)} weights for {k} reward components: pass one weight per key")
    total = sum(float(w[i]) * grpo(components[i], group_ids, mask, norm_by_std, eps) for i in range(k))  # [B, T]
    return masked_whiten(total, mask, reduce_fn=reduce_fn)


def optimal_token_baseline(
    token_rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    old_logprob: Tensor,
    sum_pi_squared: Tensor,
    is_weights: Optional[Tensor] = None,
    handle_zero_tail: bool = True,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """Optimal token baseline (verl's OTB): (reward-to-go G_t - B_t, G_t), [B, T] each.

    B_t = sum_i G_t W_t / sum_i W_t over the group's samples i at response position t, with
    W_t = sum_{j <= t} (1 - 2 pi_j + sum_v pi_v^2) (x is_weights^2): a per-token baseline that
    weights the samples whose path so far had high gradient variance. `sum_pi_squared` [B, T] is
    sum over the vocabulary of softmax^2 at each token (the actor's forward must provide it).
    handle_zero_tail: the single longest sample of a group gets baseline 0 past the second longest.
    Positions are response positions (the k-th response token of each sample), so the samples of
    a group must start their responses at the same column (one prompt: they do).
    """
    _check_same_shape(token_rewards=token_rewards, mask=mask, old_logprob=old_logprob, sum_pi_squared=sum_pi_squared)
    m = as_float_mask(mask, token_rewards)  # [B, T]
    returns = reward_to_go(token_rewards, mask)  # [B, T]
    w = 1 - 2 * torch.exp(old_logprob) + sum_pi_squared  # [B, T]
    if is_weights is not None:
        w = w * is_weights**2
    w_cum = apply_mask(w, m).cumsum(-1)  # [B, T]
    inverse, counts = _groups(token_rewards[:, 0], group_ids)
    num = returns.new_zeros((len(counts), m.shape[1])).index_add_(0, inverse, returns * w_cum * m)  # [G, T]
    den = torch.zeros_like(num).index_add_(0, inverse, w_cum * m) + eps  # [G, T]
    baseline = torch.where((counts > 1)[:, None], num / den, torch.zeros_like(num))[inverse]  # [B, T]
    if handle_zero_tail:
        baseline = baseline * ~_zero_tail(m, inverse, counts)
    return apply_mask(returns - baseline, m), returns


def _zero_tail(m: Tensor, inverse: Tensor, counts: Tensor) -> Tensor:
    """[B, T] True at response positions of a group's unique longest sample past the second longest."""
    length = m.sum(-1)  # [B]
    position = m.cumsum(-1) - 1  # [B, T] index of each token within its response
    tail = torch.zeros_like(m, dtype=torch.bool)
    for g in torch.nonzero(counts > 1).squeeze(-1).tolist():
        rows = torch.nonzero(inverse == g).squeeze(-1)
        ordered = torch.sort(length[rows]).values
        longest = torch.nonzero(length[rows] == ordered[-1]).squeeze(-1)
        if longest.numel() == 1 and ordered[-1] > ordered[-2]:
            row = rows[longest[0]]
            tail[row] = position[row] >= ordered[-2]
    return tail


# ----------------------------------------------------------------------------- registry


@register_advantage("remax")
def _remax_estimator(*, token_rewards, mask, reward_baselines=None, **_):
    _require("remax", token_rewards=token_rewards, reward_baselines=reward_baselines)
    return remax(token_rewards, reward_baselines, mask)


@register_advantage("opo")
def _opo_estimator(*, mask, group_ids, **inputs):
    adv = opo(_sequence_scores("opo", mask=mask, group_ids=group_ids, **inputs), group_ids, mask)
    return adv, adv


@register_advantage("grpo_passk")
def _passk_estimator(*, mask, group_ids, norm_adv_by_std=True, **inputs):
    scores = _sequence_scores("grpo_passk", mask=mask, group_ids=group_ids, **inputs)
    adv = grpo_passk(scores, group_ids, mask, norm_by_std=norm_adv_by_std)
    return adv, adv


@register_advantage("gpg")
def _gpg_estimator(*, mask, group_ids, reduce_fn, **inputs):
    adv = gpg(_sequence_scores("gpg", mask=mask, group_ids=group_ids, **inputs), group_ids, mask, reduce_fn=reduce_fn)
    return adv, adv


@register_advantage("gdpo")
def _gdpo_estimator(*, mask, group_ids, reduce_fn, reward_components=None, reward_weights=None, **inputs):
    """Without reward_components [K, B]: one component, the sequence score (verl's fallback)."""
    if reward_components is None:
        reward_components = _sequence_scores("gdpo", mask=mask, group_ids=group_ids, **inputs)[None]
    _require("gdpo", group_ids=group_ids)
    adv = gdpo(reward_components, group_ids, mask, reward_weights, norm_by_std=True, reduce_fn=reduce_fn)
    return adv, adv


@register_advantage("optimal_token_baseline")
def _otb_estimator(*, token_rewards, mask, group_ids, old_logprob=None, sum_pi_squared=None, is_weights=None, **_):
    _require(
        "optimal_token_baseline",
        token_rewards=token_rewards,
        group_ids=group_ids,
        old_logprob=old_logprob,
        sum_pi_squared=sum_pi_squared,
    )
    return optimal_token_baseline(token_rewards, mask, group_ids, old_logprob, sum_pi_squared, is_weights)
