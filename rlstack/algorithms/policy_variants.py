"""Policy losses beyond PPO's clip, registered under verl 0.9.1's names (POLICY_LOSSES).

Every loss takes the call convention of `losses.policy_loss` (old_logprob, logprob, advantages, mask,
clip_low, clip_high, clip_c, agg_mode, global counts, is_weights) and its own parameters as
keyword-only arguments named and defaulted as verl names and defaults them
(`names.POLICY_LOSS_PARAMS`). Stats always hold `clip_frac` and `approx_kl` (the actor logs them).
Inputs are zeroed off the mask first (selected, so NaN/-inf at padding reach neither loss nor grad).
Behaviour read in verl 0.9.1 `trainer/ppo/core_algos.py`; code written for this project.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor

from rlstack.algorithms import names
from rlstack.algorithms.masked import apply_mask, as_float_mask, masked_mean
from rlstack.algorithms.policy_core import POLICY_LOSSES, _on_mask, agg_loss, register_policy_loss


def _ratio(logprob: Tensor, old_logprob: Tensor) -> tuple[Tensor, Tensor]:
    """(log ratio clamped to [-20, 20] as verl's PPO losses, ratio), both [B, T]."""
    log_ratio = (logprob - old_logprob).clamp(min=-20.0, max=20.0)
    return log_ratio, torch.exp(log_ratio)


def _finish(loss_mat, mask, agg_mode, counts, is_weights, stats):
    if is_weights is not None:  # algorithm.rollout_is (rollout_is.py)
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, mask, agg_mode, *counts)
    return loss, {k: v.detach() for k, v in stats.items()}


@register_policy_loss("sapo")
def sapo_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: Optional[float] = None,
    agg_mode: str = "seq-mean-token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a smooth sigmoid gate instead of the hard clip.

    Per token: loss = -A * (4 / tau) * sigmoid(tau * (ratio - 1)), tau = tau_pos where A > 0 else
    tau_neg. The gate's slope is 1 at ratio 1 and fades away from it. Always aggregated
    seq-mean-token-mean, whatever agg_mode says (as verl). No clip: clip_frac is 0.
    """
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    log_ratio, ratio = _ratio(logprob, old_logprob)  # [B, T]
    pos = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    neg = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)
    tau = torch.where(advantages > 0, pos, neg)  # [B, T]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    stats = {"clip_frac": ratio.new_zeros(()), "approx_kl": masked_mean(-log_ratio, mask)}
    counts = (global_num_tokens, global_num_seqs, loss_scale_factor)
    return _finish(-gate * advantages, mask, "seq-mean-token-mean", counts, is_weights, stats)


@register_policy_loss("gpg")
def gpg_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: Optional[float] = None,
    agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025, arXiv:2504.02546): plain policy gradient, loss = -A * logprob per token.

    No ratio and no clip (old_logprob only feeds approx_kl); pairs with `adv_estimator: gpg`.
    """
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    stats = {"clip_frac": logprob.new_zeros(()), "approx_kl": masked_mean(old_logprob - logprob, mask)}
    counts = (global_num_tokens, global_num_seqs, loss_scale_factor)
    return _finish(-logprob * advantages, mask, agg_mode, counts, is_weights, stats)


def _ppo_terms(logprob, old_logprob, advantages, clip_low, clip_high):
    """PPO's unclipped and clipped per-token losses [B, T] and the log ratio."""
    log_ratio, ratio = _ratio(logprob, old_logprob)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return unclipped, clipped, log_ratio


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: Optional[float] = None,
    agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
    *,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: Optional[torch.Generator] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, arXiv:2505.22617): PPO, plus the gradient of a few tokens whose
    covariance (A - mean A) * (logp - mean logp) lies in (clip_cov_lb, clip_cov_ub) is cut.

    max(1, int(clip_cov_ratio x masked tokens)) such tokens (those PPO already clipped excluded) are
    picked AT RANDOM with torch.randperm on `generator` (None: torch's global CPU generator, which
    rlstack's checkpoints save and restore per rank, so a resumed run picks the same tokens).
    Stats: clip_frac = share of cut tokens (verl's pg_clipfrac).
    """
    if clip_cov_ratio <= 0:
        raise ValueError(
            f"clip_cov_ratio={clip_cov_ratio} must be > 0: set algorithm.policy_loss_params.clip_cov_ratio"
        )
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    present = as_float_mask(mask, logprob) != 0  # [B, T]
    unclipped, clipped, log_ratio = _ppo_terms(logprob, old_logprob, advantages, clip_low, clip_high)
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, mask)) * (logprob - masked_mean(logprob, mask))  # [B, T]
        eligible = present & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        candidates = torch.nonzero(eligible)  # [n, 2], row-major as verl
        num_cut = max(int(clip_cov_ratio * present.sum().item()), 1)
        keep = torch.ones_like(logprob)  # [B, T]
        if len(candidates):  # no draw otherwise (as verl: the generator's stream stays the same)
            pick = torch.randperm(len(candidates), generator=generator)[:num_cut].to(candidates.device)
            keep[candidates[pick, 0], candidates[pick, 1]] = 0.0
    stats = {"clip_frac": masked_mean((keep == 0).to(logprob.dtype), mask), "approx_kl": masked_mean(-log_ratio, mask)}
    counts = (global_num_tokens, global_num_seqs, loss_scale_factor)
    return _finish(torch.maximum(unclipped, clipped) * keep, mask, agg_mode, counts, is_weights, stats)


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: Optional[float] = None,
    agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617): the unclipped policy gradient -A * ratio, plus
    ppo_kl_coef * |log ratio| on the max(1, int(kl_cov_ratio x masked tokens)) tokens of largest
    covariance (A - mean A) * (logp - mean logp). Deterministic (top-k, no random pick). No clip.
    Stats: clip_frac = share of penalised tokens.
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio={kl_cov_ratio} must be > 0: set algorithm.policy_loss_params.kl_cov_ratio")
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    present = as_float_mask(mask, logprob) != 0  # [B, T]
    log_ratio, ratio = logprob - old_logprob, torch.exp(logprob - old_logprob)  # verl: no clamp here
    loss_mat = -advantages * ratio  # [B, T]
    penalised = torch.zeros_like(present)
    flat = torch.nonzero(present.reshape(-1)).squeeze(-1)  # [n] flat indices of masked tokens
    if flat.numel():
        with torch.no_grad():
            adv, logp = advantages.reshape(-1)[flat], logprob.reshape(-1)[flat]  # [n]
            cov = (adv - adv.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(flat.numel() * kl_cov_ratio))).indices
            penalised.view(-1)[flat[top]] = True
        loss_mat = torch.where(penalised, loss_mat + ppo_kl_coef * log_ratio.abs(), loss_mat)
    stats = {"clip_frac": masked_mean(penalised.to(logprob.dtype), mask), "approx_kl": masked_mean(-log_ratio, mask)}
    counts = (global_num_tokens, global_num_seqs, loss_scale_factor)
    return _finish(loss_mat, mask, agg_mode, counts, is_weights, stats)


@register_policy_loss("geo_mean")
def geo_mean_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: Optional[float] = None,
    agg_mode: str = "seq-mean-token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of the token ratios per sequence.

    Token log-ratios are clipped to [-clip_low, clip_high] in log space, pessimistically (the clip
    only binds in the direction the advantage pushes); ratio_i = exp(mean_t clipped log-ratio);
    loss = mean over sequences of -mean_t(A) * ratio_i (sequence-level advantages: GRPO's). agg_mode
    is not read (verl: a plain mean over sequences; here over global_num_seqs, so the loss does not
    depend on the micro-batch split). IS weights enter as their per-sequence geometric mean.
    Stats: clip_frac (clipped tokens with A > 0), clip_frac_lower (A < 0).
    """
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    m = as_float_mask(mask, logprob)  # [B, T]
    log_ratio = logprob - old_logprob  # [B, T]; verl: no clamp here
    sign = torch.sign(advantages)
    log_ratio_clamped = log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)  # [B, T]
    length = m.sum(-1) + 1e-8  # [B]
    ratio = torch.exp(apply_mask(pessimistic, m).sum(-1) / length)  # [B]
    seq_adv = apply_mask(advantages, m).sum(-1) / length  # [B]
    seq_loss = -seq_adv * ratio  # [B]
    if is_weights is not None:
        seq_loss = seq_loss * torch.exp(apply_mask(torch.log(is_weights + 1e-10), m).sum(-1) / length)
    num_seqs = global_num_seqs if global_num_seqs is not None else (m.sum(-1) > 0).sum().clamp(min=1)
    clipped = (log_ratio != log_ratio_clamped).to(logprob.dtype)
    stats = {
        "clip_frac": masked_mean(clipped * (advantages > 0), mask),
        "clip_frac_lower": masked_mean(clipped * (advantages < 0), mask),
        "approx_kl": masked_mean(-log_ratio, mask),
    }
    return seq_loss.sum() / num_seqs, {k: v.detach() for k, v in stats.items()}


@register_policy_loss("cispo")
def cispo_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: Optional[float] = None,
    agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax 2025, arXiv:2506.13585): clip the importance weight, not the update.

    loss = -sg[clip(ratio, 1 - clip_low, 1 + clip_high)] * A * logprob: every token keeps a gradient
    (PPO's clip zeroes the gradient of clipped tokens), only its weight is bounded.
    Stats: clip_frac = share of tokens whose ratio was clipped.
    """
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    log_ratio, ratio = _ratio(logprob, old_logprob)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()  # [B, T]
    stats = {
        "clip_frac": masked_mean((ratio != weight).to(ratio.dtype), mask),
        "approx_kl": masked_mean(-log_ratio, mask),
    }
    counts = (global_num_tokens, global_num_seqs, loss_scale_factor)
    return _finish(-weight * advantages * logprob, mask, agg_mode, counts, is_weights, stats)


def _dppo(old_logprob, logprob, advantages, mask, trust, clip_c, agg_mode, counts, is_weights):
    """DPPO's loss given the trust-region mask [B, T] (1: the token keeps its gradient)."""
    log_ratio, ratio = _ratio(logprob, old_logprob)
    truncated = ratio.clamp(max=clip_c).detach()  # truncated importance sampling, no gradient
    trust = trust.detach().to(ratio.dtype)
    stats = {
        "clip_frac": masked_mean(1.0 - trust, mask),
        "truncated_frac": masked_mean((ratio > clip_c).to(ratio.dtype) * trust, mask),
        "approx_kl": masked_mean(-log_ratio, mask),
    }
    return _finish(-advantages * truncated * logprob * trust, mask, agg_mode, counts, is_weights, stats)


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: Optional[float] = 20.0,
    agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (arXiv:2602.04879): a trust region on the probability itself, not the ratio.

    A token keeps its gradient unless p - p_old > clip_high (A > 0) or p - p_old < -clip_low (A <= 0):
    clip_low/high are total-variation thresholds here, not ratio ranges. loss = -A * sg[min(ratio,
    clip_c)] * logprob on the kept tokens (truncated IS instead of dual clip; the paper advises a
    large clip_c). Stats: clip_frac (tokens outside the region), truncated_frac.
    """
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    delta = torch.exp(logprob) - torch.exp(old_logprob)  # [B, T]
    trust = torch.where(advantages > 0, delta <= clip_high, delta >= -clip_low)
    counts = (global_num_tokens, global_num_seqs, loss_scale_factor)
    return _dppo(old_logprob, logprob, advantages, mask, trust, _cap(clip_c), agg_mode, counts, is_weights)


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: Optional[float] = 20.0,
    agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (arXiv:2602.04879): as dppo_tv with the KL of the two Bernoulli(p) laws.

    kl = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)); a token with
    A > 0 keeps its gradient when kl <= clip_high or p <= p_old, with A <= 0 when kl <= clip_low or
    p >= p_old (moving against the advantage is never cut).
    """
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    p, p_old = torch.exp(logprob), torch.exp(old_logprob)  # [B, T]
    kl = p_old * (old_logprob - logprob) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    trust = torch.where(advantages > 0, (kl <= clip_high) | (p <= p_old), (kl <= clip_low) | (p >= p_old))
    counts = (global_num_tokens, global_num_seqs, loss_scale_factor)
    return _dppo(old_logprob, logprob, advantages, mask, trust, _cap(clip_c), agg_mode, counts, is_weights)


def _cap(clip_c: Optional[float]) -> float:
    if clip_c is None or clip_c <= 0:
        raise ValueError(f"DPPO truncates the ratio at clip_c={clip_c}: set algorithm.clip_ratio_c > 0 (e.g. 20)")
    return clip_c


@register_policy_loss("dro")
def dro_policy_loss(
    old_logprob: Tensor,
    logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: Optional[float] = None,
    agg_mode: str = "token-mean",
    global_num_tokens: Optional[float] = None,
    global_num_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
    *,
    dro_beta: Optional[float] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO (Richemond et al. 2024, arXiv:2405.19107): policy gradient with a quadratic trust term.

    loss = -(A * logprob - dro_beta / 2 * (logprob - old_logprob)^2) per token: instead of a clip,
    the log ratio is pulled back to 0 with strength dro_beta (required, > 0; verl has no default).
    """
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(f"dro needs dro_beta > 0 (got {dro_beta}): set algorithm.policy_loss_params.dro_beta")
    old_logprob, logprob, advantages = _on_mask(mask, old_logprob, logprob, advantages)
    log_ratio = logprob - old_logprob
    loss_mat = -(logprob * advantages - 0.5 * dro_beta * log_ratio.square())
    stats = {"clip_frac": logprob.new_zeros(()), "approx_kl": masked_mean(-log_ratio, mask)}
    counts = (global_num_tokens, global_num_seqs, loss_scale_factor)
    return _finish(loss_mat, mask, agg_mode, counts, is_weights, stats)


def _check_params() -> None:
    """Each registered loss takes exactly the keyword parameters names.POLICY_LOSS_PARAMS lists."""
    for name, fn in POLICY_LOSSES.items():
        taken = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.name != "generator"
        ]
        assert tuple(taken) == names.POLICY_LOSS_PARAMS.get(name, ()), (
            f"policy loss {name} takes {taken}: edit rlstack/algorithms/names.py POLICY_LOSS_PARAMS"
        )


_check_params()  # the whole table is checked by losses.py, which imports this module last
