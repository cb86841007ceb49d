"""What every advantage estimator shares: the registry, GRPO's group statistics and the input
checks. `advantages.py` and `advantage_variants.py` both build on it, so neither imports the
other's module at load time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from rlstack.algorithms.masked import apply_mask

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def wrap(fn: AdvantageFn) -> AdvantageFn:
        assert name not in ADVANTAGE_ESTIMATORS, f"advantage estimator {name} registered twice"
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return wrap


def grpo(scores: Tensor, group_ids: Tensor, mask: Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """(score - group mean) / (group std + eps), broadcast over each response: [B] -> [B, T].

    std is unbiased (as torch.std and verl). norm_by_std=False is Dr.GRPO (score - group mean).
    """
    scores = _float_scores(scores, mask)
    mean, std, _ = group_stats(scores, group_ids)  # [B] each
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return _broadcast(adv, mask)


def group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, unbiased group std, group size), each [B]."""
    if group_ids.shape != scores.shape or group_ids.is_floating_point():
        raise ValueError(
            f"group_ids must be an integer tensor of shape {tuple(scores.shape)}: "
            "one id per sample, shared by the samples of one prompt"
        )
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        raise ValueError(
            "a group holds a single sample, which has no baseline: keep all "
            "rollout.n >= 2 samples of a prompt together on one rank"
        )
    size = counts.to(scores.dtype)  # [G]
    mean = torch.zeros_like(size).index_add_(0, inverse, scores) / size  # [G]
    sq_dev = (scores - mean[inverse]) ** 2  # [B]
    var = torch.zeros_like(size).index_add_(0, inverse, sq_dev) / (size - 1)  # [G]
    return mean[inverse], var.sqrt()[inverse], size[inverse]


# ----------------------------------------------------------------------------- helpers


def _sequence_scores(name: str, *, token_rewards, scores, mask, group_ids, **_) -> Tensor:
    _require(name, group_ids=group_ids)
    if (scores is None) == (token_rewards is None):
        raise ValueError(
            f"{name} advantages need exactly one of scores [B] or token_rewards "
            "[B, T]: pass token_rewards when they carry a KL penalty, else scores"
        )
    if scores is not None:
        return scores
    _check_same_shape(token_rewards=token_rewards, mask=mask)
    return apply_mask(token_rewards, mask).sum(-1)  # [B]


def _float_scores(scores: Tensor, mask: Tensor) -> Tensor:
    if scores.dim() != 1 or mask.dim() != 2 or scores.shape[0] != mask.shape[0]:
        raise ValueError(
            f"scores {tuple(scores.shape)} and mask {tuple(mask.shape)} must be [B] and [B, T] with the same B"
        )
    return scores.to(_float_dtype(scores))


def _broadcast(adv: Tensor, mask: Tensor) -> Tensor:
    return apply_mask(adv[:, None].expand(mask.shape), mask.to(device=adv.device))  # [B] -> [B, T]


def _float_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


def _require(name: str, **inputs: Optional[Tensor]) -> None:
    missing = [k for k, v in inputs.items() if v is None]
    if missing:
        raise ValueError(f"{name} advantages need {', '.join(missing)}: pass them to compute_advantages")


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected equal [B, T] shapes, got {shapes}: pass per-token tensors of one batch")
