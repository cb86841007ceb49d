"""KL estimators between the policy and the reference, in-reward KL penalty, KL controllers.

Estimators follow Schulman's "Approximating KL divergence" (k1, k2, k3) as verl's `kl_penalty`,
registered under verl's names too (kl = k1, mse = k2, low_var_kl = k3, abs) and with verl's "+"
straight-through variants (the value of the estimate, the gradient of k2). verl's `full` (KL over the
whole vocabulary) is not offered: it needs full logits, and verl 0.9.1 itself raises
NotImplementedError for it.
Controllers: fixed, and the adaptive one of Ziegler et al. 2019 (arXiv:1909.08593).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlstack.algorithms import names
from rlstack.algorithms.masked import apply_mask, masked_mean

KLFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: dict[str, KLFn] = {}


def register_kl(name: str) -> Callable[[KLFn], KLFn]:
    def wrap(fn: KLFn) -> KLFn:
        assert name not in KL_ESTIMATORS, f"KL estimator {name} registered twice"
        KL_ESTIMATORS[name] = fn
        return fn

    return wrap


@register_kl("k1")
def _k1(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return logprob - ref_logprob  # unbiased, high variance, can be negative


@register_kl("k2")
def _k2(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return 0.5 * (logprob - ref_logprob) ** 2


@register_kl("k3")
def _k3(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    # exp(r) - r - 1 with r = ref - logp: unbiased and >= 0. Clamps as in verl's low_var_kl: r
    # first (exp overflows past ~88 in fp32), then the estimate, so one bad token cannot dominate.
    log_ratio = (ref_logprob - logprob).clamp(min=-20.0, max=20.0)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(min=-10.0, max=10.0)


@register_kl("kl")
def _kl(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return _k1(logprob, ref_logprob)


@register_kl("mse")
def _mse(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return _k2(logprob, ref_logprob)


@register_kl("low_var_kl")
def _low_var_kl(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return _k3(logprob, ref_logprob)


@register_kl("abs")
def _abs(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return (logprob - ref_logprob).abs()


def _straight_through(base: KLFn) -> KLFn:
    """Forward: base's estimate; backward: k2's gradient, (logp - ref) d logp (unbiased for KL)."""

    def estimate(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
        k2 = _k2(logprob, ref_logprob)
        return k2 - k2.detach() + base(logprob, ref_logprob).detach()

    return estimate


for _name in ("k1", "k3", "kl", "low_var_kl", "abs"):
    register_kl(_name + "+")(_straight_through(KL_ESTIMATORS[_name]))
names.check_registered("KL estimator", KL_ESTIMATORS, names.KL_ESTIMATORS)


def kl_estimate(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token KL(policy || reference) estimate, [B, T] -> [B, T]."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}: choose one of {', '.join(sorted(KL_ESTIMATORS))}")
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            f"logprob {tuple(logprob.shape)} and ref_logprob "
            f"{tuple(ref_logprob.shape)} differ: pass log-probs of the same tokens"
        )
    return KL_ESTIMATORS[kind](logprob, ref_logprob)


def apply_kl_penalty(
    token_scores: Tensor, logprob: Tensor, ref_logprob: Tensor, mask: Tensor, coef: float, kind: str = "k1"
) -> tuple[Tensor, Tensor]:
    """token_rewards = token_scores - coef * KL on masked tokens; also the batch's mean KL.

    kl_mean (a 0-dim tensor) is the mean over sequences of each sequence's masked mean KL (as
    verl), the value to feed the KL controller's `update`.
    """
    kl = apply_mask(kl_estimate(logprob, ref_logprob, kind), mask)  # [B, T]
    token_rewards = token_scores - coef * kl  # [B, T]
    kl_mean = masked_mean(kl, mask, dim=-1).mean()
    return token_rewards, kl_mean


# ----------------------------------------------------------------------------- controllers


class KLController:
    """Holds the in-reward KL coefficient `value`; subclasses decide how `update` moves it."""

    kind = ""

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"KL coefficient {coef} is negative: set algorithm.kl_coef >= 0")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(
                f"checkpoint holds a {state.get('kind')!r} KL controller, this run "
                f"uses {self.kind!r}: set algorithm.kl_ctrl={state.get('kind')}"
            )
        self.value = float(state["value"])


class FixedKLController(KLController):
    """A constant coefficient."""

    kind = "fixed"

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController(KLController):
    """Moves the coefficient so that the measured KL approaches `target` (Ziegler et al.).

    value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon, where n_steps is the
    number of samples (verl passes the batch size) seen since the last update.
    """

    kind = "adaptive"

    def __init__(self, init_coef: float, target: float, horizon: int):
        super().__init__(init_coef)
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs target > 0 and horizon > 0 (got {target}, "
                f"{horizon}): set algorithm.kl_target and algorithm.kl_horizon"
            )
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(kind: str, coef: float, target: float = 0.1, horizon: int = 10000) -> KLController:
    """Controller from the config's algorithm.kl_ctrl / kl_coef / kl_target / kl_horizon."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(f"unknown KL controller {kind!r}: set algorithm.kl_ctrl to fixed or adaptive")
