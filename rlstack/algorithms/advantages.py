"""Advantage estimators: GAE (with a critic), group baselines (GRPO, Dr.GRPO, RLOO), REINFORCE++.

Every estimator is registered by name in `ADVANTAGE_ESTIMATORS`; the trainer calls
`compute_advantages(name, ...)`, which returns what the PPO update should use:
- gae: advantages whitened over the masked tokens of the batch (as verl does), and raw returns
  (advantages + values) as the critic's regression target.
- grpo / drgrpo / rloo: group-relative advantages, broadcast over the response; returns = advantages
  (there is no critic to train).
- reinforce_plus_plus: discounted returns-to-go of the token rewards, whitened over the batch
  (Hu 2025, arXiv:2501.03262); returns are the raw returns-to-go.
- reinforce_plus_plus_baseline: sequence score minus its group mean (0 for a group of one), broadcast
  over the response, then whitened over the batch; returns = advantages.
More of verl's estimators (remax, opo, grpo_passk, gpg, gdpo, optimal_token_baseline) live in
advantage_variants.py and register into the same table.
Catalogue modelled on verl's trainer/ppo/core_algos.py; code written for this project.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rlstack.algorithms import names
from rlstack.algorithms.advantage_core import (  # noqa: F401 (re-exported: this module's API)
    ADVANTAGE_ESTIMATORS,
    AdvantageFn,
    _broadcast,
    _check_same_shape,
    _float_dtype,
    _float_scores,
    _require,
    _sequence_scores,
    group_stats,
    grpo,
    register_advantage,
)
from rlstack.algorithms.masked import ReduceFn, apply_mask, as_float_mask, masked_whiten

# ----------------------------------------------------------------------------- GAE


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the masked tokens of each row.

    Unmasked positions are skipped: their rewards and values are ignored, so the value after the
    last response token is 0 (the episode ends there) whatever the critic wrote past the mask.
    Returns raw (not whitened) advantages and returns = advantages + values, both 0 off the mask.
    For the PPO update use `masked_whiten(advantages, mask)` (what `compute_advantages` does).
    """
    _check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    present = as_float_mask(mask, values) != 0  # [B, T]
    next_value = torch.zeros_like(values[:, 0])  # [B]
    last_gae = torch.zeros_like(values[:, 0])  # [B]
    advantages = torch.zeros_like(values)  # [B, T]
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]  # [B]
        gae_t = delta + gamma * lam * last_gae  # [B]
        advantages[:, t] = gae_t
        # Off the mask, carry the later step's value and advantage through unchanged (selected,
        # not blended: a NaN value at a padded position must not leak into earlier tokens).
        next_value = torch.where(present[:, t], values[:, t], next_value)
        last_gae = torch.where(present[:, t], gae_t, last_gae)
    returns = apply_mask(advantages + values, mask)  # [B, T]
    return apply_mask(advantages, mask), returns


# ----------------------------------------------------------------------------- REINFORCE++


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Returns-to-go G_t = r_t + gamma * G_{t+1} over the masked tokens of each row: [B, T] -> [B, T].

    Unmasked positions are skipped (their rewards ignored, the later return carried through), so
    G is 0 off the mask and a gap inside a response does not cut the sum.
    """
    _check_same_shape(token_rewards=token_rewards, mask=mask)
    present = as_float_mask(mask, token_rewards) != 0  # [B, T]
    running = torch.zeros_like(token_rewards[:, 0])  # [B]
    returns = torch.zeros_like(token_rewards)  # [B, T]
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(present[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(present[:, t], running, torch.zeros_like(running))
    return returns


def reinforce_plus_plus(
    token_rewards: Tensor, mask: Tensor, gamma: float = 1.0, reduce_fn: Optional[ReduceFn] = None
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (no critic, no group baseline): (whitened returns-to-go, returns-to-go).

    The whitening over the whole batch (all data-parallel ranks through reduce_fn) is the baseline.
    """
    returns = discounted_returns(token_rewards, mask, gamma)  # [B, T]
    return masked_whiten(returns, mask, reduce_fn=reduce_fn), returns


def reinforce_plus_plus_baseline(
    scores: Tensor, group_ids: Tensor, mask: Tensor, reduce_fn: Optional[ReduceFn] = None
) -> Tensor:
    """REINFORCE++ with the group mean as baseline: whiten(score - group mean) over the batch.

    A prompt with a single sample has baseline 0 (as verl), so rollout.n = 1 works.
    """
    scores = _float_scores(scores, mask)
    if group_ids.shape != scores.shape or group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor of shape {tuple(scores.shape)}")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    size = counts.to(scores.dtype)  # [G]
    mean = torch.zeros_like(size).index_add_(0, inverse, scores) / size  # [G]
    baseline = torch.where(size > 1, mean, torch.zeros_like(mean))[inverse]  # [B]
    return masked_whiten(_broadcast(scores - baseline, mask), mask, reduce_fn=reduce_fn)


# ----------------------------------------------------------------------------- group baselines


def rloo(scores: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """score minus the mean of the other samples of its group (leave-one-out): [B] -> [B, T]."""
    scores = _float_scores(scores, mask)
    mean, _, size = group_stats(scores, group_ids)  # [B] each
    # s_i - (sum - s_i) / (n - 1) == (s_i - mean) * n / (n - 1)
    adv = (scores - mean) * size / (size - 1)
    return _broadcast(adv, mask)


def place_at_last_token(scores: Tensor, mask: Tensor) -> Tensor:
    """Sequence scores [B] -> token scores [B, T], the score on each row's last masked token."""
    if scores.dim() != 1 or mask.dim() != 2 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores {tuple(scores.shape)} and mask {tuple(mask.shape)} must be [B] and [B, T]")
    present = mask > 0  # [B, T]
    if not bool(present.any(-1).all()):
        raise ValueError("a row of the response mask is empty: every response needs a token")
    last = mask.shape[1] - 1 - present.flip(-1).int().argmax(-1)  # [B]
    out = torch.zeros(mask.shape, dtype=_float_dtype(scores), device=scores.device)  # [B, T]
    out[torch.arange(mask.shape[0], device=mask.device), last] = scores.to(out.dtype)
    return out


# ----------------------------------------------------------------------------- registry


@register_advantage("gae")
def _gae_estimator(*, token_rewards, values, mask, gamma, lam, reduce_fn, **_):
    _require("gae", token_rewards=token_rewards, values=values)
    advantages, returns = gae(token_rewards, values, mask, gamma, lam)
    return masked_whiten(advantages, mask, reduce_fn=reduce_fn), returns


@register_advantage("grpo")
def _grpo_estimator(*, mask, group_ids, **inputs):
    adv = grpo(_sequence_scores("grpo", mask=mask, group_ids=group_ids, **inputs), group_ids, mask)
    return adv, adv


@register_advantage("drgrpo")
def _drgrpo_estimator(*, mask, group_ids, **inputs):
    scores = _sequence_scores("drgrpo", mask=mask, group_ids=group_ids, **inputs)
    adv = grpo(scores, group_ids, mask, norm_by_std=False)
    return adv, adv


@register_advantage("rloo")
def _rloo_estimator(*, mask, group_ids, **inputs):
    adv = rloo(_sequence_scores("rloo", mask=mask, group_ids=group_ids, **inputs), group_ids, mask)
    return adv, adv


@register_advantage("reinforce_plus_plus")
def _rfpp_estimator(*, token_rewards, mask, gamma, reduce_fn, **_):
    _require("reinforce_plus_plus", token_rewards=token_rewards)
    return reinforce_plus_plus(token_rewards, mask, gamma, reduce_fn=reduce_fn)


@register_advantage("reinforce_plus_plus_baseline")
def _rfpp_baseline_estimator(*, mask, group_ids, reduce_fn, **inputs):
    scores = _sequence_scores("reinforce_plus_plus_baseline", mask=mask, group_ids=group_ids, **inputs)
    adv = reinforce_plus_plus_baseline(scores, group_ids, mask, reduce_fn=reduce_fn)
    return adv, adv


def compute_advantages(
    name: str,
    *,
    mask: Tensor,
    token_rewards: Optional[Tensor] = None,
    values: Optional[Tensor] = None,
    scores: Optional[Tensor] = None,
    group_ids: Optional[Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reduce_fn: Optional[ReduceFn] = None,
    reward_baselines: Optional[Tensor] = None,
    old_logprob: Optional[Tensor] = None,
    sum_pi_squared: Optional[Tensor] = None,
    is_weights: Optional[Tensor] = None,
    reward_components: Optional[Tensor] = None,
    reward_weights: Optional[list] = None,
    norm_adv_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """(advantages [B, T], returns [B, T]) of the estimator `name`, ready for the PPO update.

    gae reads token_rewards and values (and reduce_fn: a SUM over data-parallel ranks, so the
    whitening uses global statistics). grpo/drgrpo/rloo/opo/grpo_passk/gpg/gdpo read group_ids and
    one of: scores [B], or token_rewards [B, T] summed over the mask (use that form when the rewards
    carry a KL penalty). remax reads token_rewards and reward_baselines [B] (the greedy response's
    reward); optimal_token_baseline token_rewards, group_ids, old_logprob and sum_pi_squared [B, T]
    (and is_weights); gdpo reward_components [K, B] and reward_weights [K] when given; grpo_passk
    norm_adv_by_std. Inputs an estimator does not read are ignored.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}: choose one of {', '.join(sorted(ADVANTAGE_ESTIMATORS))}"
        )
    return ADVANTAGE_ESTIMATORS[name](
        token_rewards=token_rewards,
        values=values,
        scores=scores,
        group_ids=group_ids,
        mask=mask,
        gamma=gamma,
        lam=lam,
        reduce_fn=reduce_fn,
        reward_baselines=reward_baselines,
        old_logprob=old_logprob,
        sum_pi_squared=sum_pi_squared,
        is_weights=is_weights,
        reward_components=reward_components,
        reward_weights=reward_weights,
        norm_adv_by_std=norm_adv_by_std,
    )


# ----------------------------------------------------------------------------- helpers


# Registers remax, opo, grpo_passk, gpg, gdpo, optimal_token_baseline (it uses the helpers above) and
# then checks the table against names.py: it is the last of the two modules to finish loading.
from rlstack.algorithms import advantage_variants  # noqa: E402,F401

names.check_registered("advantage estimator", ADVANTAGE_ESTIMATORS, names.ADVANTAGE_ESTIMATORS)
