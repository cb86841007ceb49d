"""rlstack.algorithms against values computed by hand, plus property tests."""

import math

import pytest
import torch

from rlstack import config
from rlstack.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    build_kl_controller,
    compute_advantages,
    compute_policy_loss,
    entropy_from_logits,
    gae,
    grpo,
    gspo_policy_loss,
    kl_estimate,
    kl_loss,
    mask_counts,
    masked_mean,
    masked_whiten,
    place_at_last_token,
    policy_loss,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
    value_loss,
    whiten_stats,
)

T = torch.tensor


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0
    )


# ----------------------------------------------------------------------------- registries


def test_registries_match_config_choices():
    assert set(ADVANTAGE_ESTIMATORS) == set(config.CHOICES["algorithm.adv_estimator"]) - {""}
    assert set(KL_ESTIMATORS) == set(config.CHOICES["algorithm.kl_loss_type"])
    assert set(KL_ESTIMATORS) == set(config.CHOICES["algorithm.kl_penalty"])
    assert set(LOSS_AGG_MODES) == set(config.CHOICES["algorithm.loss_agg_mode"])
    assert set(POLICY_LOSSES) == set(config.CHOICES["algorithm.policy_loss"])


def test_config_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, rlstack.config, rlstack.algorithms.names; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- masked helpers


def test_masked_mean_and_counts():
    close(masked_mean(T([[1.0, 2.0, 3.0]]), T([[1, 0, 1]])), 2.0)
    close(masked_mean(T([[1.0, 2.0], [5.0, 7.0]]), T([[1, 1], [0, 1]]), dim=-1), [1.5, 7.0])
    close(masked_mean(T([[1.0, 2.0]]), T([[0, 0]])), 0.0)  # empty mask: 0, not nan
    assert mask_counts(T([[1, 1, 0], [0, 0, 0], [1, 0, 0]])) == (3.0, 2)
    with pytest.raises(ValueError, match="mask shape"):
        masked_mean(T([[1.0, 2.0]]), T([[1, 1, 1]]))


def test_masked_whiten_by_hand_and_global_stats():
    # masked x = 1, 2, 3: mean 2, unbiased variance ((1 + 0 + 1) / 2) = 1 -> -1, 0, 1
    x, mask = T([[1.0, 2.0, 3.0, 100.0]]), T([[1, 1, 1, 0]])
    close(masked_whiten(x, mask), [[-1.0, 0.0, 1.0, 0.0]])
    close(masked_whiten(x, mask, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]])
    # Two "ranks" each whiten their half with the summed stats == whitening the whole batch.
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(6, 5, generator=g), torch.rand(6, 5, generator=g) > 0.3
    total = whiten_stats(x[:3].double(), mask[:3]) + whiten_stats(x[3:].double(), mask[3:])
    halves = (slice(0, 3), slice(3, 6))
    parts = [masked_whiten(x[s], mask[s], reduce_fn=lambda _: total) for s in halves]
    close(torch.cat(parts), masked_whiten(x, mask))
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(T([[1.0, 2.0]]), T([[1, 0]]))


# ----------------------------------------------------------------------------- GAE


def test_gae_by_hand():
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72), rewards 0, 0, 1, values 0.5, 0.6, 0.7:
    # t=2: delta = 1 - 0.7 = 0.3                          A2 = 0.3
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03                 A1 = 0.03 + 0.72 * 0.3 = 0.246
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04                 A0 = 0.04 + 0.72 * 0.246 = 0.21712
    # returns = A + V = 0.71712, 0.846, 1.0
    adv, ret = gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), torch.ones(1, 3), 0.9, 0.8)
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_ignores_rewards_and_values_off_the_mask():
    # A padding token with garbage reward/value after the end: same numbers, zeros on padding.
    rewards, values = T([[0.0, 0.0, 1.0, 5.0]]), T([[0.5, 0.6, 0.7, 100.0]])
    adv, ret = gae(rewards, values, T([[1, 1, 1, 0]]), 0.9, 0.8)
    close(adv, [[0.21712, 0.246, 0.3, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0, 0.0]])
    # A masked hole (e.g. a tool-output turn) is skipped: t=2 as above (A2 = 0.3); t=0 sees
    # next value 0.7: delta = 0.9 * 0.7 - 0.5 = 0.13, A0 = 0.13 + 0.72 * 0.3 = 0.346.
    adv, ret = gae(T([[0.0, 9.0, 1.0]]), T([[0.5, 99.0, 0.7]]), T([[1, 0, 1]]), 0.9, 0.8)
    close(adv, [[0.346, 0.0, 0.3]])
    close(ret, [[0.846, 0.0, 1.0]])


def test_gae_entry_whitens_advantages_and_keeps_raw_returns():
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = T([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4, [1] * 5 + [0]])
    raw, raw_ret = gae(rewards, values, mask, 1.0, 0.95)
    adv, ret = compute_advantages("gae", token_rewards=rewards, values=values, mask=mask, gamma=1.0, lam=0.95)
    close(adv, masked_whiten(raw, mask))
    close(ret, raw_ret)
    close(masked_mean(adv, mask), 0.0)
    with pytest.raises(ValueError, match="need values"):
        compute_advantages("gae", token_rewards=rewards, mask=mask)


# ----------------------------------------------------------------------------- group baselines


SCORES = T([1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
GROUPS = T([7, 7, 7, 7, 3, 3])


def test_grpo_drgrpo_rloo_by_hand():
    mask = torch.ones(6, 2)
    mask[0, 1] = 0
    # group 7 = 1, 0, 0, 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.866025
    # group 3 = 2, 4: mean 3, std sqrt(2 / 1) = 1.414214 -> -+0.707107
    expected = T([0.866025, -0.866025, -0.866025, 0.866025, -0.707107, 0.707107])
    adv = grpo(SCORES, GROUPS, mask)
    close(adv, expected[:, None] * mask)
    assert adv[0, 1] == 0.0
    close(grpo(SCORES, GROUPS, mask, norm_by_std=False)[:, 0], [0.5, -0.5, -0.5, 0.5, -1.0, 1.0])
    # RLOO: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3; 2 - 4 = -2; 4 - 2 = 2
    close(rloo(SCORES, GROUPS, mask)[:, 0], [2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0])


def test_registered_grpo_normalises_by_group_std():
    """What the trainer calls: `compute_advantages("grpo")` divides by the group's std (hand values)."""
    mask = torch.ones(6, 2)
    expected = T([0.866025, -0.866025, -0.866025, 0.866025, -0.707107, 0.707107])
    adv, returns = compute_advantages("grpo", scores=SCORES, group_ids=GROUPS, mask=mask)
    close(adv, expected[:, None] * mask)
    close(returns, adv)
    adv_dr, _ = compute_advantages("drgrpo", scores=SCORES, group_ids=GROUPS, mask=mask)
    close(adv_dr[:, 0], [0.5, -0.5, -0.5, 0.5, -1.0, 1.0])


def test_grpo_zero_mean_unit_std_per_group():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(24, generator=g)
    groups = torch.arange(6).repeat_interleave(4)[torch.randperm(24, generator=g)]
    mask = torch.ones(24, 3)
    for name in ("grpo", "drgrpo", "rloo"):
        adv, ret = compute_advantages(name, scores=scores, group_ids=groups, mask=mask)
        assert torch.equal(adv, ret)
        for gid in range(6):
            close(adv[groups == gid, 0].sum(), 0.0)
            if name == "grpo":
                close(adv[groups == gid, 0].std(), 1.0, atol=1e-4)
    same = compute_advantages("grpo", scores=torch.ones(4), group_ids=T([0, 0, 1, 1]), mask=torch.ones(4, 2))[0]
    assert torch.equal(same, torch.zeros(4, 2))  # equal scores: no signal, not nan


def test_group_estimators_read_token_rewards_summed_over_mask():
    mask = T([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    token_rewards = T([[0.5, 0.5, 9.0], [0.0, 9.0, 9.0], [1.0, 0.5, 0.5], [-1.0, 9.0, 9.0]])
    groups = T([0, 0, 1, 1])
    from_tokens = compute_advantages("grpo", token_rewards=token_rewards, group_ids=groups, mask=mask)
    from_scores = compute_advantages("grpo", scores=T([1.0, 0.0, 2.0, -1.0]), group_ids=groups, mask=mask)
    close(from_tokens[0], from_scores[0])
    with pytest.raises(ValueError, match="exactly one"):
        compute_advantages("rloo", scores=T([1.0, 0, 2, -1]), token_rewards=token_rewards, group_ids=groups, mask=mask)


def test_group_and_name_errors():
    with pytest.raises(ValueError, match="single sample"):
        grpo(T([1.0, 2.0, 3.0]), T([0, 0, 1]), torch.ones(3, 2))
    with pytest.raises(ValueError, match="integer"):
        grpo(T([1.0, 2.0]), T([0.0, 0.0]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("ppo", scores=SCORES, group_ids=GROUPS, mask=torch.ones(6, 2))


def test_place_at_last_token():
    out = place_at_last_token(T([3.0, 5.0, 7.0]), T([[1, 1, 0], [1, 0, 0], [1, 1, 1]]))
    close(out, [[0.0, 3.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 7.0]])
    with pytest.raises(ValueError, match="empty"):
        place_at_last_token(T([3.0]), T([[0, 0]]))


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    # p = 0.5, ref = 0.25: k1 = ln 2 = 0.693147; k2 = 0.5 * ln(2)^2 = 0.240227;
    # k3 with r = ln(ref/p) = -ln 2: e^r - r - 1 = 0.5 + 0.693147 - 1 = 0.193147
    logp, ref = T([[math.log(0.5)]]), T([[math.log(0.25)]])
    close(kl_estimate(logp, ref, "k1"), [[0.693147]])
    close(kl_estimate(logp, ref, "k2"), [[0.240227]])
    close(kl_estimate(logp, ref, "k3"), [[0.193147]])
    # k3 is clamped to [-10, 10] (and stays finite) far from the reference
    assert kl_estimate(T([[0.0]]), T([[300.0]]), "k3").item() == 10.0
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")


def test_apply_kl_penalty_by_hand():
    # k1 = logp - ref = [[0.1, 0.2, (masked)], [0.4, (masked), (masked)]], coef 0.5
    # rewards: [[0 - 0.05, 0 - 0.1, 1 - 0], [2 - 0.2, 0, 0]]
    # kl_mean: mean over rows of per-row masked means = (0.15 + 0.4) / 2 = 0.275
    ref = torch.zeros(2, 3)
    logp = T([[0.1, 0.2, 0.7], [0.4, 0.9, 0.9]])
    scores = T([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    rewards, kl_mean = apply_kl_penalty(scores, logp, ref, T([[1, 1, 0], [1, 0, 0]]), coef=0.5)
    close(rewards, [[-0.05, -0.1, 1.0], [1.8, 0.0, 0.0]])
    close(kl_mean, 0.275)


def test_kl_controllers():
    fixed = build_kl_controller("fixed", 0.1)
    fixed.update(current_kl=5.0, n_steps=100)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.1
    # KL above target: value *= 1 + clip(0.2/0.1 - 1, -0.2, 0.2) * 10 / 100 = 1.02
    ada = build_kl_controller("adaptive", 0.1, target=0.1, horizon=100)
    assert isinstance(ada, AdaptiveKLController)
    ada.update(current_kl=0.2, n_steps=10)
    close(ada.value, 0.102, atol=1e-12)
    # KL below target: error clip(0.5 - 1) = -0.2 -> value *= 0.98
    ada.update(current_kl=0.05, n_steps=10)
    close(ada.value, 0.102 * 0.98, atol=1e-12)
    resumed = AdaptiveKLController(0.1, 0.1, 100)
    resumed.load_state_dict(ada.state_dict())
    assert resumed.value == ada.value
    with pytest.raises(ValueError, match="kl_ctrl=adaptive"):
        fixed.load_state_dict(ada.state_dict())
    with pytest.raises(ValueError, match="kl_horizon"):
        build_kl_controller("adaptive", 0.1, target=0.1, horizon=0)
    with pytest.raises(ValueError, match="fixed or adaptive"):
        build_kl_controller("pid", 0.1)


def test_kl_loss_by_hand():
    logp, ref, mask = T([[0.1, 0.3, 5.0]]), torch.zeros(1, 3), T([[1, 1, 0]])
    loss, stats = kl_loss(logp, ref, mask, kind="k1")
    close(loss, 0.2)
    close(stats["kl"], 0.2)
    loss, _ = kl_loss(logp, ref, mask, kind="k2", agg_mode="seq-mean-token-sum")
    close(loss, 0.5 * (0.01 + 0.09))


# ----------------------------------------------------------------------------- aggregation


def test_agg_loss_by_hand():
    loss_mat, mask = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), T([[1, 1, 0], [1, 0, 0]])
    close(agg_loss(loss_mat, mask, "token-mean"), 7 / 3)  # (1 + 2 + 4) / 3
    close(agg_loss(loss_mat, mask, "seq-mean-token-sum"), 3.5)  # (3 + 4) / 2
    close(agg_loss(loss_mat, mask, "seq-mean-token-mean"), 2.75)  # (1.5 + 4) / 2
    # An all-padding row neither adds loss nor counts as a sequence.
    padded = (torch.cat([loss_mat, torch.ones(1, 3)]), torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)]))
    close(agg_loss(*padded, "seq-mean-token-mean"), 2.75)
    with pytest.raises(ValueError, match="global_num_seqs"):
        agg_loss(loss_mat, mask, "seq-mean-token-sum", global_num_tokens=3)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        agg_loss(loss_mat, mask, "mean")


@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
def test_agg_loss_split_invariance(mode):
    g = torch.Generator().manual_seed(3)
    num_seqs, seq_len = 12, 7
    loss_mat = torch.randn(num_seqs, seq_len, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, seq_len + 1, (num_seqs,), generator=g)
    lengths[5] = 0  # one padding row
    mask = torch.arange(seq_len)[None, :] < lengths[:, None]  # [B, T] bool
    full = agg_loss(loss_mat, mask, mode, loss_scale_factor=7)
    # 2 ranks take shuffled shares, each cut into 3 micro-batches of uneven size.
    order = torch.randperm(num_seqs, generator=g)
    splits = [order[0:1], order[1:4], order[4:6], order[6:9], order[9:11], order[11:12]]
    counts = [mask_counts(mask[idx]) for idx in splits]
    num_tokens, num_seqs_global = sum(c[0] for c in counts), sum(c[1] for c in counts)
    parts = [
        agg_loss(
            loss_mat[idx],
            mask[idx],
            mode,
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs_global,
            loss_scale_factor=7,
        )
        for idx in splits
    ]
    torch.testing.assert_close(sum(parts), full, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- policy loss


def _policy_inputs():
    # ratios 1.5, 0.5, 1.1, 5.0, 0.5 with advantages 1, 1, -1, -1, -1; clip range [0.8, 1.3]
    ratios = T([[1.5, 0.5, 1.1, 5.0, 0.5]])
    logprob = ratios.log().requires_grad_()
    return torch.zeros(1, 5), logprob, T([[1.0, 1.0, -1.0, -1.0, -1.0]]), torch.ones(1, 5)


def test_policy_loss_clip_and_dual_clip_by_hand():
    old, logprob, adv, mask = _policy_inputs()
    # per token: max(-A r, -A clip(r, 0.8, 1.3)), capped at -A * 3 for A < 0
    # 0: max(-1.5, -1.3) = -1.3 (clipped)   1: max(-0.5, -0.8) = -0.5
    # 2: max(1.1, 1.1) = 1.1                3: max(5, 1.3) = 5 -> min(5, 3) = 3 (dual clip)
    # 4: max(0.5, 0.8) = 0.8 (clipped from below)
    # token-mean = (-1.3 - 0.5 + 1.1 + 3 + 0.8) / 5 = 0.62
    loss, stats = policy_loss(old, logprob, adv, mask, clip_low=0.2, clip_high=0.3, clip_c=3.0)
    close(loss, 0.62)
    close(stats["clip_frac"], 2 / 5)
    close(stats["dual_clip_frac"], 1 / 5)
    close(stats["approx_kl"], -math.log(1.5 * 0.5 * 1.1 * 5.0 * 0.5) / 5)
    # Gradient only through unclipped tokens: d/dlogp (-A r) / 5 = -A r / 5
    loss.backward()
    close(logprob.grad, [[0.0, -0.1, 1.1 / 5, 0.0, 0.0]])


def test_policy_loss_without_dual_clip_and_errors():
    old, logprob, adv, mask = _policy_inputs()
    loss, stats = policy_loss(old, logprob, adv, mask, 0.2, 0.3, clip_c=None)
    close(loss, (-1.3 - 0.5 + 1.1 + 5.0 + 0.8) / 5)
    close(stats["dual_clip_frac"], 0.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(old, logprob, adv, mask, 0.2, 0.3, clip_c=1.0)


def test_policy_loss_on_policy_gradient():
    # On-policy first step (logprob == old): ratio 1, loss = -mean(A), gradient -A / N.
    old = T([[-1.0, -2.0, -3.0]])
    logprob = old.clone().requires_grad_()
    adv, mask = T([[0.5, -1.0, 2.0]]), T([[1, 1, 0]])
    loss, stats = policy_loss(old, logprob, adv, mask, 0.2, 0.2, 3.0, agg_mode="seq-mean-token-sum")
    close(loss, -(0.5 - 1.0))
    loss.backward()
    close(logprob.grad, [[-0.5, 1.0, 0.0]])
    close(stats["clip_frac"], 0.0)
    close(stats["approx_kl"], 0.0)


# ----------------------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    # token 0: (1 - 2)^2 = 1; clipped v = 0.5 + clamp(0.5, +-0.2) = 0.7 -> (0.7 - 2)^2 = 1.69
    # token 1: v = v_old = 2 -> 1 and 1 -> 1
    # token 2: (3 - 2.5)^2 = 0.25; clipped v = 2.2 -> 0.09 -> 0.25 (clip not binding)
    # 0.5 * (1.69 + 1 + 0.25) / 3 = 0.49
    values, old, returns = T([[1.0, 2.0, 3.0]]), T([[0.5, 2.0, 2.0]]), T([[2.0, 1.0, 2.5]])
    loss, stats = value_loss(values, old, returns, torch.ones(1, 3), clip=0.2)
    close(loss, 0.49)
    close(stats["clip_frac"], 1 / 3)
    close(stats["values_mean"], 2.0)
    loss, _ = value_loss(values, old, returns, torch.ones(1, 3), clip=None)
    close(loss, 0.5 * (1 + 1 + 0.25) / 3)
    with pytest.raises(ValueError, match="value_clip"):
        value_loss(values, old, returns, torch.ones(1, 3), clip=0.0)


# ----------------------------------------------------------------------------- entropy


def test_entropy_from_logits_by_hand():
    # uniform over 4: ln 4; p = (0.5, 0.25, 0.25, ~0): 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2
    logits = torch.stack([torch.zeros(4), T([0.5, 0.25, 0.25, 1e-30]).log()])[None]  # [1, 2, 4]
    ent = entropy_from_logits(logits)
    assert ent.shape == (1, 2)
    close(ent, [[math.log(4), 1.5 * math.log(2)]])
    # Invariant to a constant shift of the logits.
    close(entropy_from_logits(logits + 7.0), ent)


# ----------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_by_hand():
    # one reward at each row's last token (plus a -0.1 in-reward KL at token 0 of row 0), gamma 0.5
    rewards = T([[-0.1, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, returns = reinforce_plus_plus(rewards, mask, gamma=0.5)
    # row 0: G2 = 1, G1 = 0 + 0.5, G0 = -0.1 + 0.25 = 0.15; row 1: G1 = 2, G0 = 1, G2 (off mask) = 0
    close(returns, [[0.15, 0.5, 1.0], [1.0, 2.0, 0.0]])
    g = torch.tensor([0.15, 0.5, 1.0, 1.0, 2.0])
    close(adv, [[*((g[:3] - g.mean()) / g.std()).tolist()], [*((g[3:] - g.mean()) / g.std()).tolist(), 0.0]], atol=1e-4)
    adv, _ = compute_advantages("reinforce_plus_plus", mask=mask, token_rewards=rewards, gamma=0.5)
    close(adv[0, 0], ((0.15 - g.mean()) / g.std()).item(), atol=1e-4)


def test_reinforce_plus_plus_skips_gaps_in_the_mask():
    returns = reinforce_plus_plus(T([[1.0, 5.0, 1.0]]), T([[1, 0, 1]]), gamma=1.0)[1]
    close(returns, [[2.0, 0.0, 1.0]])  # the masked-out 5.0 is ignored, the later return carried past


def test_reinforce_plus_plus_baseline_by_hand():
    scores = T([1.0, 0.0, 0.0, 3.0, 5.0])
    group_ids = T([0, 0, 0, 1, 2])  # groups {1, 0, 0}, {3} alone, {5} alone
    mask = T([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    adv = reinforce_plus_plus_baseline(scores, group_ids, mask)
    # minus group mean (1/3) for group 0, baseline 0 for the single samples: 2/3, -1/3, -1/3, 3, 5
    centred = [2 / 3, -1 / 3, -1 / 3, 3.0, 5.0]
    tokens = torch.tensor([c for c, n in zip(centred, [2, 1, 2, 2, 1]) for _ in range(n)])
    mean, std = tokens.mean(), tokens.std()  # whitened over the 8 masked tokens (unbiased std)
    expected = [[(c - mean) / std if j < n else 0.0 for j in range(2)] for c, n in zip(centred, [2, 1, 2, 2, 1])]
    close(adv, expected, atol=1e-4)
    adv2, ret2 = compute_advantages("reinforce_plus_plus_baseline", mask=mask, scores=scores, group_ids=group_ids)
    close(adv2, adv)
    close(ret2, adv)


# ----------------------------------------------------------------------------- Dr.GRPO, token-sum


def test_drgrpo_no_std_and_seq_mean_token_sum_norm():
    scores, group_ids = T([1.0, 0.0, 0.0, 0.0]), T([0, 0, 0, 0])
    mask = T([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv, _ = compute_advantages("drgrpo", mask=mask, scores=scores, group_ids=group_ids)
    close(adv[:, 0], [0.75, -0.25, -0.25, -0.25])  # score - mean, no division by std
    loss_mat = torch.ones(4, 4)
    # token sums 3, 1, 2, 4 -> mean over 4 sequences 2.5 -> / constant 8 = 0.3125 (length-free)
    close(agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=8), 2.5 / 8)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(loss_mat, mask, "seq-mean-token-sum-norm")


def test_token_sum_aggregation():
    loss_mat = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1, 1, 0], [0, 1, 1]])
    close(agg_loss(loss_mat, mask, "token-sum"), 1 + 2 + 5 + 6)
    close(agg_loss(loss_mat, mask, "token-sum", global_num_tokens=100, global_num_seqs=9), 14.0)


# ----------------------------------------------------------------------------- KL names


def test_verl_kl_names_by_hand():
    logp, ref = T([[-1.0, -2.0]]), T([[-1.5, -1.0]])
    d = logp - ref  # [0.5, -1.0]
    close(kl_estimate(logp, ref, "kl"), d)
    close(kl_estimate(logp, ref, "mse"), 0.5 * d**2)
    close(kl_estimate(logp, ref, "abs"), [[0.5, 1.0]])
    r = -d  # ref - logp
    close(kl_estimate(logp, ref, "low_var_kl"), torch.exp(r) - r - 1)
    close(kl_estimate(logp, ref, "low_var_kl"), kl_estimate(logp, ref, "k3"))


@pytest.mark.parametrize("name", ["k1+", "k3+", "low_var_kl+", "kl+", "abs+"])
def test_straight_through_kl_has_k2_gradient(name):
    logp = T([[-1.0, -2.0, -0.3]]).requires_grad_()
    ref = T([[-1.5, -1.0, -0.3]])
    value = kl_estimate(logp, ref, name)
    close(value, kl_estimate(logp.detach(), ref, name.rstrip("+")))  # the base estimate's value
    value.sum().backward()
    close(logp.grad, (logp - ref).detach())  # d/dlogp of 0.5 (logp - ref)^2


# ----------------------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_and_clip_by_hand():
    # row 0: token log-ratios 0.2, -0.1, 0.5 -> mean 0.2 -> s = e^0.2 = 1.2214 for all its tokens
    # row 1: log-ratios 0.0, 0.02 (third token padded) -> s = e^0.01 = 1.01005
    old = torch.zeros(2, 3)
    logprob = T([[0.2, -0.1, 0.5], [0.0, 0.02, 7.0]]).requires_grad_()
    adv = T([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    loss, stats = gspo_policy_loss(old, logprob, adv, mask, clip_low=0.05, clip_high=0.1, agg_mode="token-mean")
    s1 = math.exp(0.01)  # row 0 ratio exp(0.2) clips at 1.1
    # row 0, A = 1: max(-s0, -clip(s0) = -1.1) = -1.1, clipped; row 1, A = -1: max(s1, clip(s1)) = s1
    close(loss, (3 * -1.1 + 2 * s1) / 5)
    close(stats["clip_frac"], 3 / 5)
    loss.backward()
    # clipped tokens get no gradient; row 1's tokens each get d/dlogp of s1 * logp_t / 5 = s1 / 5
    close(logprob.grad, [[0.0, 0.0, 0.0], [s1 / 5, s1 / 5, 0.0]])
    loss2, _ = compute_policy_loss("gspo", old, logprob, adv, mask, 0.05, 0.1, None, "token-mean")
    close(loss2, loss)


def test_gspo_differs_from_token_level_ppo():
    # token ratios e^0.5 and e^-0.5 cancel at sequence level: GSPO clips nothing, PPO clips one
    old, logprob = torch.zeros(1, 2), T([[0.5, -0.5]])
    adv, mask = T([[1.0, 1.0]]), torch.ones(1, 2)
    _, g_stats = gspo_policy_loss(old, logprob, adv, mask, 0.2, 0.2)
    _, p_stats = policy_loss(old, logprob, adv, mask, 0.2, 0.2)
    close(g_stats["clip_frac"], 0.0)
    close(p_stats["clip_frac"], 0.5)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'"):
        compute_policy_loss("ppo2", old, logprob, adv, mask, 0.2, 0.2)


# ----------------------------------------------------------------------------- bugs found against verl


def test_value_clip_fraction_counts_only_clipped_tokens():
    # v - old = -0.136 is inside the clip 0.2, but old + (v - old) != v in float32 for these
    # values, so comparing the two squared errors counted one of tokens 0/1 as clipped by rounding.
    o, v = 0.07688700407743454, -0.05941878259181976
    old = T([[o, o, 0.0]])
    values = T([[v, v, 0.5]])  # tokens 0, 1 inside the clip; token 2 clipped (0.5 > 0.2)
    assert (old + (values - old).clamp(-0.2, 0.2))[0, 0] != values[0, 0]  # the rounding
    returns = T([[v - 0.01, v + 0.01, 100.0]])  # near v (so 1 ulp shows), on both sides of it
    _, stats = value_loss(values, old, returns, torch.ones(1, 3), clip=0.2)
    close(stats["clip_frac"], 1 / 3)


def test_nan_and_inf_at_padded_positions_do_not_reach_losses_or_grads():
    mask = T([[1, 1, 0], [1, 0, 0]])
    bad = float("nan")
    logprob = T([[-1.0, -2.0, bad], [-0.5, -math.inf, bad]]).requires_grad_()
    old = T([[-1.1, -2.0, -math.inf], [-0.4, bad, 0.0]])
    ref = T([[-1.0, -2.5, bad], [-0.5, bad, -math.inf]])
    adv = T([[1.0, -1.0, bad], [0.5, math.inf, bad]])
    for mode in sorted(LOSS_AGG_MODES):
        pg, pg_stats = policy_loss(old, logprob, adv, mask, 0.2, 0.2, 3.0, mode, loss_scale_factor=3)
        kl, _ = kl_loss(logprob, ref, mask, "k3", mode, loss_scale_factor=3)
        gs, _ = gspo_policy_loss(old, logprob, adv, mask, 0.2, 0.2, None, mode, loss_scale_factor=3)
        for value in (pg, kl, gs, *pg_stats.values()):
            assert torch.isfinite(value).all(), mode
        logprob.grad = None
        (pg + kl + gs).backward()
        assert torch.isfinite(logprob.grad).all(), mode
        assert (logprob.grad[mask == 0] == 0).all()
    values = T([[1.0, 2.0, bad], [0.5, math.inf, bad]]).requires_grad_()
    vl, v_stats = value_loss(values, T([[1.0, 2.1, bad], [0.4, bad, 0.0]]), T([[1.0, 1.0, bad], [1.0, 1.0, bad]]), mask)
    vl.backward()
    assert torch.isfinite(vl) and torch.isfinite(values.grad).all()
    assert all(torch.isfinite(v) for v in v_stats.values())
    close(agg_loss(T([[1.0, bad, -math.inf]]), T([[1, 0, 0]]), "token-mean"), 1.0)
    close(masked_mean(T([[2.0, bad]]), T([[1, 0]])), 2.0)
    adv_gae, ret = gae(T([[0.0, 1.0, bad]]), T([[0.5, 0.2, bad]]), T([[1, 1, 0]]), 1.0, 1.0)
    assert torch.isfinite(adv_gae).all() and torch.isfinite(ret).all()
