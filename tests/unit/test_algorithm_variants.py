"""verl 0.9.1's extra policy losses and advantage estimators against values computed by hand."""

import math

import pytest
import torch

from rlstack.algorithms import compute_advantages, compute_policy_loss
from rlstack.algorithms.advantage_variants import gdpo, gpg, grpo_passk, opo, optimal_token_baseline, remax
from rlstack.algorithms.names import POLICY_LOSS_PARAMS, loss_params
from rlstack.config import PolicyLossParams

T = torch.tensor
LN = math.log


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


def loss(name, old, new, adv, mask=None, low=0.2, high=0.28, clip_c=3.0, mode="token-mean", **params):
    old, new, adv = T([old], dtype=torch.float64), T([new], dtype=torch.float64), T([adv], dtype=torch.float64)
    mask = torch.ones_like(old) if mask is None else T([mask], dtype=torch.float64)
    new.requires_grad_(True)
    value, stats = compute_policy_loss(name, old, new, adv, mask, low, high, clip_c, mode, **params)
    value.backward()
    return value.item(), stats, new.grad[0]


# ----------------------------------------------------------------------------- losses


def test_sapo_by_hand():
    # ratios 2 and 1; A = 1 (tau_pos = 1), A = -1 (tau_neg = 2):
    # gate_1 = 4 sigmoid(1 * (2 - 1)) / 1 = 4 * 0.7310586 = 2.9242344 -> loss -2.9242344
    # gate_2 = 4 sigmoid(0) / 2 = 1 -> loss -1 * -1 = 1;  seq-mean-token-mean: (-2.9242344 + 1) / 2
    value, stats, _ = loss("sapo", [0.0, 0.0], [LN(2), 0.0], [1.0, -1.0], tau_pos=1.0, tau_neg=2.0)
    close(value, -0.9621172)
    assert stats["clip_frac"] == 0
    # always seq-mean-token-mean (as verl): a token-sum request changes nothing
    close(loss("sapo", [0.0, 0.0], [LN(2), 0.0], [1.0, -1.0], mode="token-sum", tau_pos=1.0, tau_neg=2.0)[0], value)


def test_gpg_loss_by_hand():
    # -A * logp: -(2 * -1) = 2, -(1 * -0.5) = 0.5 -> token-mean 1.25; d/dlogp = -A / 2
    value, _, grad = loss("gpg", [-5.0, -5.0], [-1.0, -0.5], [2.0, 1.0])
    close(value, 1.25)
    close(grad, [-1.0, -0.5])


def test_cispo_by_hand_keeps_the_gradient_of_clipped_tokens():
    # ratios 1.5, 0.5, 1 clipped to [0.8, 1.28]: weights 1.28, 0.8, 1 (no gradient through them)
    # losses: -1.28 * 1 * ln 1.5 = -0.5189953; -0.8 * 1 * ln 0.5 = 0.5545177; -1 * -1 * 0 = 0 -> mean / 3
    value, stats, grad = loss("cispo", [0.0, 0.0, 0.0], [LN(1.5), LN(0.5), 0.0], [1.0, 1.0, -1.0])
    close(value, 0.0355224 / 3)
    close(stats["clip_frac"], 2 / 3)
    close(grad, [-1.28 / 3, -0.8 / 3, 1 / 3])  # PPO's clip would give the first token no gradient


def test_dro_by_hand():
    # beta 0.5: -(logp A - 0.25 (logp - old)^2): -(-1 - 0.25) = 1.25; -(2 - 0.25 * 4) = -1 -> mean 0.125
    value, _, _ = loss("dro", [0.0, 0.0], [-1.0, -2.0], [1.0, -1.0], dro_beta=0.5)
    close(value, 0.125)
    with pytest.raises(ValueError, match="dro_beta"):
        loss("dro", [0.0], [-1.0], [1.0])


def test_dppo_tv_by_hand():
    # p_old 0.5, 0.5, 0.5, 0.1 -> p 0.8, 0.6, 0.2, 0.5; A = 1, 1, -1, -1; TV thresholds 0.2:
    # delta p = 0.3 (A > 0, > 0.2: cut), 0.1 (kept), -0.3 (A < 0, < -0.2: cut), 0.4 (A < 0: kept)
    # kept: -1 * 1.2 * ln 0.6 = 0.6129908;  -(-1) * min(5, 3) * ln 0.5 = -2.0794415 -> sum / 4
    old, new = [LN(0.5), LN(0.5), LN(0.5), LN(0.1)], [LN(0.8), LN(0.6), LN(0.2), LN(0.5)]
    value, stats, _ = loss("dppo_tv", old, new, [1.0, 1.0, -1.0, -1.0], low=0.2, high=0.2, clip_c=3.0)
    close(value, (0.6129908 - 2.0794415) / 4)
    close(stats["clip_frac"], 0.5)
    close(stats["truncated_frac"], 0.25)


def test_dppo_kl_by_hand():
    # p_old 0.5: KL(Bern(0.5) || Bern(0.8)) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.2231436 (same for 0.2);
    # KL to Bern(0.6) = 0.5 ln(0.5/0.6) + 0.5 ln(0.5/0.4) = 0.0204110. Thresholds 0.05:
    # A=1,p=0.8: cut; A=1,p=0.6: kept; A=-1,p=0.8: kept (moves against A); A=-1,p=0.2: cut
    # kept: -1 * 1.2 * ln 0.6 = 0.6129908; -(-1) * 1.6 * ln 0.8 = -0.3570297 -> sum / 4
    old = [LN(0.5)] * 4
    new = [LN(0.8), LN(0.6), LN(0.8), LN(0.2)]
    value, stats, _ = loss("dppo_kl", old, new, [1.0, 1.0, -1.0, -1.0], low=0.05, high=0.05, clip_c=3.0)
    close(value, (0.6129908 - 0.3570297) / 4)
    close(stats["clip_frac"], 0.5)


def test_geo_mean_by_hand():
    # two sequences of two tokens, log-ratio clip [-0.2, 0.28]:
    # A = +1, log ratios 0.5, -0.1 -> min(lr, clip(lr)) = 0.28, -0.1 -> mean 0.09 -> loss -exp(0.09) = -1.0941743
    # A = -1, log ratios -0.5, 0.1 -> -min(-lr, -clip(lr)) = -0.2, 0.1 -> mean -0.05 -> loss +exp(-0.05) = 0.9512294
    old = T([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    new = T([[0.5, -0.1], [-0.5, 0.1]], dtype=torch.float64)
    adv = T([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    value, stats = compute_policy_loss("geo_mean", old, new, adv, torch.ones(2, 2), 0.2, 0.28)
    close(value, (-1.0941743 + 0.9512294) / 2)
    close(stats["clip_frac"], 0.25)  # the clipped token with A > 0
    close(stats["clip_frac_lower"], 0.25)


# A = 2, 0, 0, -2 (mean 0); logp = 0, -1, -1, -1.5 (mean -0.875): covariance 1.75, 0, 0, 1.25
COV_ADV, COV_LOGP = [2.0, 0.0, 0.0, -2.0], [0.0, -1.0, -1.0, -1.5]


def test_clip_cov_by_hand():
    # window (1, 1.5): only the last token (1.25); int(0.0002 * 4) = 0 -> at least 1 is cut.
    # ratio 1 everywhere: losses -A = -2, 0, 0, 2 with the last cut -> mean -0.5
    value, stats, grad = loss("clip_cov", COV_LOGP, COV_LOGP, COV_ADV, clip_cov_ub=1.5)
    close(value, -0.5)
    close(stats["clip_frac"], 0.25)
    close(grad, [-0.5, 0.0, 0.0, 0.0])  # the cut token has no gradient


def test_clip_cov_random_pick_follows_the_generator():
    """Two candidates (1.75 and 1.25 in (1, 5)), one cut: which one is the generator's draw."""
    picks = set()
    for seed in range(8):
        runs = [
            loss("clip_cov", COV_LOGP, COV_LOGP, COV_ADV, generator=torch.Generator().manual_seed(seed))[2]
            for _ in range(2)
        ]
        close(runs[0], runs[1])  # same seed, same pick: a resumed run repeats it
        picks.add(tuple((runs[0][[0, 3]] == 0).tolist()))  # cut: no gradient (tokens 1, 2 have A = 0)
    assert picks == {(True, False), (False, True)}
    # generator=None draws from torch's global CPU generator, whose state checkpoints save per rank
    state = torch.get_rng_state()
    first = loss("clip_cov", COV_LOGP, COV_LOGP, COV_ADV)[2]
    torch.set_rng_state(state)  # what a resume does (rlstack/checkpoint.py set_rng_state)
    close(loss("clip_cov", COV_LOGP, COV_LOGP, COV_ADV)[2], first)


def test_kl_cov_by_hand():
    # kl_cov_ratio 0.25 of 4 tokens -> the 1 of largest covariance (the first, 1.75) gets
    # + 0.1 |log ratio|; its log ratio 0.1: -2 exp(0.1) + 0.01 = -2.2003418; the rest -A * 1: 0, 0, 2
    old = [x - d for x, d in zip(COV_LOGP, [0.1, 0.0, 0.0, 0.0])]
    value, stats, _ = loss("kl_cov", old, COV_LOGP, COV_ADV, kl_cov_ratio=0.25)
    close(value, (-2.2003418 + 2.0) / 4)
    close(stats["clip_frac"], 0.25)


def test_loss_params_come_from_the_config_by_name():
    p = PolicyLossParams(tau_pos=2.0, dro_beta=0.3)
    assert loss_params("sapo", p) == {"tau_pos": 2.0, "tau_neg": 1.05}
    assert loss_params("dro", p) == {"dro_beta": 0.3}
    assert loss_params("vanilla", p) == {} and loss_params("cispo", p) == {}
    assert all(hasattr(p, k) for keys in POLICY_LOSS_PARAMS.values() for k in keys)


# ----------------------------------------------------------------------------- estimators


def test_remax_by_hand():
    # rewards-to-go: row 0 (1 at the end) -> 1, 1, 1; row 1 (2 at t=1, t=2 padding) -> 2, 2, 0
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = remax(rewards, T([0.5, 1.0]), mask)
    close(ret, [[1, 1, 1], [2, 2, 0]])
    close(adv, [[0.5, 0.5, 0.5], [1, 1, 0]])
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantages("remax", token_rewards=rewards, mask=mask)


def test_opo_by_hand():
    # group 0: scores 1, 0, 1 with lengths 1, 2, 3: baseline (1 + 0 + 3) / 6 = 2/3; group 1: one sample, baseline 0
    mask = T([[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]])
    adv = opo(T([1.0, 0.0, 1.0, 5.0]), T([0, 0, 0, 1]), mask)
    close(adv[:, 0], [1 / 3, -2 / 3, 1 / 3, 5.0])
    close(adv, adv[:, :1] * mask)


def test_grpo_passk_by_hand():
    # scores 1, 0, 0.5, 0: best 1, second 0.5 -> 0.5 on the best only; unbiased std: mean 0.375,
    # squares 0.390625 + 0.140625 + 0.015625 + 0.140625 = 0.6875 / 3 -> std 0.4787136
    scores, groups, mask = T([1.0, 0.0, 0.5, 0.0]), T([0, 0, 0, 0]), torch.ones(4, 2)
    close(grpo_passk(scores, groups, mask)[:, 0], [0.5 / (0.4787136 + 1e-6), 0, 0, 0])
    close(grpo_passk(scores, groups, mask, norm_by_std=False)[:, 0], [0.5, 0, 0, 0])
    close(grpo_passk(T([1.0, 1.0, 0.0, 0.0]), groups, mask), torch.zeros(4, 2))  # two best: no edge
    with pytest.raises(ValueError, match="at least 2"):
        grpo_passk(T([1.0, 0.0, 1.0]), T([0, 0, 1]), torch.ones(3, 2))


def test_gpg_estimator_by_hand():
    # 4 of 6 scores non-zero: alpha = 6 / 4 = 1.5; group means 0.5 and 3
    scores, groups, mask = T([1.0, 0.0, 0.0, 1.0, 2.0, 4.0]), T([7, 7, 7, 7, 3, 3]), torch.ones(6, 2)
    close(gpg(scores, groups, mask)[:, 0], [0.75, -0.75, -0.75, 0.75, -1.5, 1.5])
    # over two data-parallel ranks, the other holding 2 zero scores: alpha = 8 / 4 = 2
    other = torch.tensor([2.0, 0.0], dtype=torch.float64)
    close(gpg(scores, groups, mask, reduce_fn=lambda t: t + other)[:, 0], [1, -1, -1, 1, -2, 2])


def test_gdpo_by_hand():
    # components [format, acc] per group of 2: group z-scores (+-1, or 0 when equal), weights 1 and 0.5:
    # format 1, 0 | 1, 1 -> +1, -1 | 0, 0;  acc 0, 1 | 2, 0 -> -1, +1 | +1, -1
    # sum: 0.5, -0.5, 0.5, -0.5 -> whitened (mean 0, unbiased std 0.57735): +-0.866025
    components = T([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 2.0, 0.0]])
    adv = gdpo(components, T([0, 0, 1, 1]), torch.ones(4, 1), weights=[1.0, 0.5])
    close(adv[:, 0], [0.866025, -0.866025, 0.866025, -0.866025])
    with pytest.raises(ValueError, match="one weight per key"):
        gdpo(components, T([0, 0, 1, 1]), torch.ones(4, 1), weights=[1.0])


def test_optimal_token_baseline_by_hand():
    # one group: sample 0 (2 tokens, reward 1), sample 1 (1 token, reward 0); pi = 0.5, sum pi^2 = 0.5:
    # w = 1 - 2 * 0.5 + 0.5 = 0.5 per token; W = cumulative: [0.5, 1.0] and [0.5, -]
    # returns: [1, 1] and [0, -]. t=0: B = (1 * 0.5 + 0 * 0.5) / 1.0 = 0.5; t=1: B = 1 * 1.0 / 1.0 = 1
    # zero tail: sample 0 is the only longest -> its baseline past length 1 is 0
    rewards, mask = T([[0.0, 1.0], [0.0, 0.0]]), T([[1, 1], [1, 0]])
    old, sum_sq = torch.full((2, 2), LN(0.5)), torch.full((2, 2), 0.5)
    adv, ret = optimal_token_baseline(rewards, mask, T([0, 0]), old, sum_sq)
    close(ret, [[1, 1], [0, 0]])
    close(adv, [[0.5, 1.0], [-0.5, 0.0]])
    adv, _ = optimal_token_baseline(rewards, mask, T([0, 0]), old, sum_sq, handle_zero_tail=False)
    close(adv, [[0.5, 0.0], [-0.5, 0.0]])
    # responses after a prompt (rlstack's [B, S] layout): the same numbers, shifted
    pad = torch.zeros(2, 2)
    shifted, _ = optimal_token_baseline(
        torch.cat([pad, rewards], 1), torch.cat([pad, mask], 1), T([0, 0]), torch.cat([pad, old], 1),
        torch.cat([pad, sum_sq], 1)
    )  # fmt: skip
    close(shifted[:, 2:], [[0.5, 1.0], [-0.5, 0.0]])
    close(shifted[:, :2], torch.zeros(2, 2))


def test_new_estimators_through_compute_advantages():
    scores, groups, mask = T([1.0, 0.0, 0.5, 0.0]), T([0, 0, 0, 0]), torch.ones(4, 2)
    for name, expected in (
        ("opo", [0.625, -0.375, 0.125, -0.375]),  # equal lengths: the plain mean 0.375
        ("grpo_passk", [0.5 / (0.4787136 + 1e-6), 0, 0, 0]),
        ("gpg", [0.625 * 2, -0.375 * 2, 0.125 * 2, -0.375 * 2]),  # alpha = 4 / 2
    ):
        adv, ret = compute_advantages(name, scores=scores, group_ids=groups, mask=mask)
        close(adv[:, 0], expected)
        close(ret, adv)


def test_variant_modules_can_be_imported_first():
    """The registry checks pass whichever module is imported first (fresh copies, then put back)."""
    import importlib
    import sys

    import rlstack.algorithms as package

    names = ("advantage_core", "advantages", "advantage_variants", "policy_core", "losses", "policy_variants")
    saved = {n: sys.modules.pop(f"rlstack.algorithms.{n}") for n in names}
    try:
        importlib.import_module("rlstack.algorithms.advantage_variants")  # its own six, no error
        fresh = importlib.import_module("rlstack.algorithms.advantages")  # then the table is checked whole
        assert len(fresh.ADVANTAGE_ESTIMATORS) == 12
        importlib.import_module("rlstack.algorithms.policy_variants")
        fresh = importlib.import_module("rlstack.algorithms.losses")
        assert len(fresh.POLICY_LOSSES) == 11
    finally:
        for n, module in saved.items():
            sys.modules[f"rlstack.algorithms.{n}"] = module
            setattr(package, n, module)
