"""Truncated importance sampling on rollout log-probs (TIS; verl's `rollout_is`).

The rollout engine samples from pi_rollout (a stale copy of the actor with `rollout.staleness=1`, or
an engine whose kernels round differently from the trainer's); the PPO ratio is taken against
pi_old (the actor's own forward of the batch). Weighting each token's policy-gradient term by
pi_old / pi_rollout corrects the expectation for that mismatch; truncating the weight at `cap`
bounds its variance (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; verl 0.9.1 `trainer/ppo/rollout_corr_helper.py:compute_rollout_correction_weights`,
whose maths this follows: log ratio clamped to +-20 before exp, weights detached, zero off the mask).

Levels: "token" w_t = min(exp(old_t - rollout_t), cap) per token (biased, low variance);
"sequence" w = min(exp(sum_t (old_t - rollout_t)), cap), one weight per response broadcast over its
tokens (the product of the token ratios: unbiased before truncation, high variance);
"decoupled" AReaL's decoupled PPO objective (Fu et al. 2025, `areal/utils/functional.py`
`ppo_actor_loss_fn` with `proximal_logprobs`): the PPO ratio and its clip are taken against the
proximal policy, which here is pi_old = the trainer's current weights before the update (the actor
recomputes old log-probs in split placement), and each token's term is weighted by the behaviour
ratio pi_old / pi_rollout untruncated, the tokens whose ratio exceeds `cap` dropped (weight 0,
still counted in the loss's token count, as AReaL's `behav_imp_weight_cap`).

Which: "token" (TIS) for an engine that is nearly on-policy (staleness 0-1, kernel mismatch only):
truncation keeps every token with bounded variance. "decoupled" for staleness k >= 2 or partial
rollouts, where a few tokens sampled by much older weights have huge ratios: dropping them keeps
the rest unbiased instead of down-weighting everything past the cap (AReaL's setting). "sequence"
when the reward is a property of the whole response and the responses are short.
"""

from __future__ import annotations

from torch import Tensor

from rlstack.algorithms.masked import apply_mask, as_float_mask
from rlstack.algorithms.names import ROLLOUT_IS_LEVELS as IS_LEVELS  # noqa: F401  (re-exported)

_SAFETY_BOUND = 20.0  # exp(20) ~ 4.9e8: clamping the log ratio keeps exp finite (as verl)


def rollout_is_weights(
    old_logprob: Tensor, rollout_logprob: Tensor, mask: Tensor, level: str, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated IS weights [B, T] (detached, 0 off the mask) and their local sums for metrics.

    Stats (sums, so micro-batches and ranks add up): `is/weight_sum` and `is/clipped_sum` over the
    units the level weights (tokens or sequences), `is/units`, and `is/weight_max`.
    """
    if level not in ("token", "sequence", "decoupled"):
        raise ValueError(f"rollout_is level {level!r} is unknown: use token, sequence or decoupled")
    if not cap > 0:
        raise ValueError(f"rollout_is cap {cap} must be > 0")
    m = as_float_mask(mask, old_logprob)  # [B, T]
    log_ratio = apply_mask(old_logprob.detach() - rollout_logprob.detach(), m)  # [B, T], 0 off the mask
    if level in ("token", "decoupled"):
        raw = log_ratio.clamp(-_SAFETY_BOUND, _SAFETY_BOUND).exp()  # [B, T]
        unit_mask = m  # [B, T]
        kept = raw.clamp(max=cap) if level == "token" else raw * (raw <= cap).to(raw.dtype)  # truncate | drop
        weights = kept * m
        unit_raw = raw
    else:
        seq = log_ratio.sum(-1).clamp(-_SAFETY_BOUND, _SAFETY_BOUND)  # [B]
        unit_raw = seq.exp()  # [B]
        unit_mask = (m.sum(-1) > 0).to(m.dtype)  # [B]: rows with a response
        weights = unit_raw.clamp(max=cap)[:, None] * m  # [B, T]
    unit_w = unit_raw.clamp(max=cap) if level != "decoupled" else unit_raw * (unit_raw <= cap).to(unit_raw.dtype)
    on = unit_mask > 0
    stats = {
        "is/weight_sum": (unit_w * unit_mask).sum(),
        "is/clipped_sum": ((unit_raw > cap).to(m.dtype) * unit_mask).sum(),
        "is/units": unit_mask.sum(),
        "is/weight_max": unit_w[on].max() if bool(on.any()) else unit_w.new_zeros(()),
    }
    return weights.detach(), {k: v.detach() for k, v in stats.items()}


def is_metrics(weight_sum: float, clipped_sum: float, units: float, weight_max: float) -> dict:
    """`is/weight_mean`, `is/weight_max`, `is/clipped_frac` from summed stats (all micro-batches, ranks)."""
    if units <= 0:
        return {}
    return {"is/weight_mean": weight_sum / units, "is/weight_max": weight_max, "is/clipped_frac": clipped_sum / units}
