"""rlstack's policy losses, advantage estimators and overlong shaping against verl 0.9.1's own code.

The reference is tests/assets/verl_0_9_1/reference.py: verl's function bodies copied verbatim from
the verl==0.9.1 wheel by extract.py (nothing is downloaded or installed at test time). Random inputs
in verl's layout (responses start at column 0, padding after); losses and gradients within 1e-5.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from rlstack.algorithms import compute_advantages, compute_policy_loss
from rlstack.algorithms.advantage_variants import gdpo, optimal_token_baseline
from rlstack.rewards.overlong import overlong_penalty

_PATH = Path(__file__).parents[1] / "assets" / "verl_0_9_1" / "reference.py"
_spec = importlib.util.spec_from_file_location("verl_0_9_1_reference", _PATH)
verl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verl)

B, T = 8, 7
ATOL = 1e-5


def close(a, b):
    torch.testing.assert_close(torch.as_tensor(a).double(), torch.as_tensor(b).double(), atol=ATOL, rtol=0)


def batch(seed: int):
    """old/new log-probs near each other (some past the clip), advantages, a prefix mask, IS weights."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3  # probabilities e^-3 .. 1
    logprob = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) * 2
    adv[0] = 0.0  # a group whose samples all scored the same: A = 0 takes the "else" branches
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()  # [B, T], verl's response mask
    is_w = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return old, logprob, adv, mask, is_w


def actor_config(**policy_loss):
    params = dict(
        clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, kl_cov_ratio=0.0002, ppo_kl_coef=0.1, dro_beta=None
    )
    params.update(policy_loss)
    return verl.ActorConfig(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        tau_pos=1.0,
        tau_neg=1.05,
        policy_loss=verl.ActorConfig(**params),
        global_batch_info={},
    )


# (rlstack name, verl function, verl policy_loss params, rlstack keyword params, clip_c, agg modes)
LOSSES = [
    ("sapo", "compute_policy_loss_sapo", {}, {"tau_pos": 1.0, "tau_neg": 1.05}, 3.0, ["seq-mean-token-mean"]),
    ("gpg", "compute_policy_loss_gpg", {}, {}, 3.0, ["token-mean", "seq-mean-token-sum"]),
    (
        "clip_cov",
        "compute_policy_loss_clip_cov",
        {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.05, "clip_cov_ub": 3.0},
        {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.05, "clip_cov_ub": 3.0},
        3.0,
        ["token-mean"],
    ),
    (
        "kl_cov",
        "compute_policy_loss_kl_cov",
        {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1},
        {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1},
        3.0,
        ["token-mean", "seq-mean-token-mean"],
    ),
    ("geo_mean", "compute_policy_loss_geo_mean", {}, {}, 3.0, ["token-mean"]),
    ("dro", "compute_policy_loss_dro", {"dro_beta": 0.3}, {"dro_beta": 0.3}, 3.0, ["token-mean", "token-sum"]),
    ("cispo", "compute_policy_loss_cispo", {}, {}, 3.0, ["token-mean", "seq-mean-token-mean"]),
    ("dppo_tv", "compute_policy_loss_dppo_tv", {}, {}, 1.2, ["token-mean"]),
    ("dppo_kl", "compute_policy_loss_dppo_kl", {}, {}, 1.2, ["token-mean"]),
]


CUTTING = ("clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl")


@pytest.mark.parametrize("name,verl_fn,verl_params,params,clip_c,modes", LOSSES, ids=[x[0] for x in LOSSES])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("with_is", [False, True])
def test_policy_loss_matches_verl(name, verl_fn, verl_params, params, clip_c, modes, seed, with_is):
    old, logprob, adv, mask, is_w = batch(seed)
    if name in ("dppo_tv", "dppo_kl"):  # divergence thresholds, not ratio ranges: some tokens leave the region
        low, high = 0.05, 0.08
    else:
        low, high = 0.2, 0.28
    cfg = actor_config(**verl_params)
    cfg.update(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c)
    for mode in modes:
        lp_verl = logprob.clone().requires_grad_(True)
        lp_ours = logprob.clone().requires_grad_(True)
        weights = is_w if with_is else None
        torch.manual_seed(seed)  # clip_cov draws from torch's global generator, as verl
        ref, _ = getattr(verl, verl_fn)(old, lp_verl, adv, mask, mode, cfg, weights)
        torch.manual_seed(seed)
        ours, stats = compute_policy_loss(
            name, old, lp_ours, adv, mask, low, high, clip_c, mode, is_weights=weights, **params
        )
        close(ours, ref)
        ref.backward()
        ours.backward()
        close(lp_ours.grad, lp_verl.grad)
        assert {"clip_frac", "approx_kl"} <= set(stats)
        if name in CUTTING:  # the case exercises the clip / cut / penalty, not only the plain gradient
            assert 0 < stats["clip_frac"] < 1


def test_clip_cov_cuts_tokens_in_the_parity_case():
    """The clip_cov parity case is not vacuous: tokens were cut (and the random pick matters)."""
    old, logprob, adv, mask, _ = batch(0)
    kw = {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.05, "clip_cov_ub": 3.0}
    _, stats = compute_policy_loss("clip_cov", old, logprob, adv, mask, 0.2, 0.28, **kw)
    assert stats["clip_frac"] > 0


# ----------------------------------------------------------------------------- estimators


def groups_and_scores(seed: int, discrete: bool = False):
    g = torch.Generator().manual_seed(seed)
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])  # groups of 3, 3 and 2
    group_ids = group_ids[torch.randperm(B, generator=g)]
    if discrete:  # ties and zeros, as accuracy rewards give
        scores = torch.randint(0, 3, (B,), generator=g).double() / 2
    else:
        scores = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    token_rewards = torch.zeros(B, T, dtype=torch.float64)
    token_rewards[torch.arange(B), lengths - 1] = scores  # the score on the last response token
    return group_ids, scores, mask, token_rewards


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outcome_estimators_match_verl(seed):
    ids, scores, mask, rewards = groups_and_scores(seed, discrete=seed == 2)
    index = ids.numpy()
    algo = verl.AlgoConfig(norm_adv_by_std_in_grpo=True)
    cases = {
        "opo": verl.compute_opo_outcome_advantage(rewards, mask, index, config=algo),
        "gpg": verl.compute_gpg_outcome_advantage(rewards.clone(), mask, index, config=algo),
        "grpo_passk": verl.compute_grpo_passk_outcome_advantage(rewards, mask, index, config=algo),
        "gdpo": verl.compute_gdpo_outcome_advantage(rewards, mask, index),
    }
    for name, (ref_adv, ref_ret) in cases.items():
        adv, ret = compute_advantages(name, token_rewards=rewards, group_ids=ids, mask=mask)
        close(adv, ref_adv)
        close(ret, ref_ret)
    algo_raw = verl.AlgoConfig(norm_adv_by_std_in_grpo=False)
    ref_raw, _ = verl.compute_grpo_passk_outcome_advantage(rewards, mask, index, config=algo_raw)
    adv_raw, _ = compute_advantages(
        "grpo_passk", token_rewards=rewards, group_ids=ids, mask=mask, norm_adv_by_std=False
    )
    close(adv_raw, ref_raw)


def test_opo_and_gpg_singletons_match_verl():
    """A group of one sample: no baseline, as verl."""
    _, scores, mask, rewards = groups_and_scores(3)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])  # group 3 holds one sample
    for name, fn in (("opo", verl.compute_opo_outcome_advantage), ("gpg", verl.compute_gpg_outcome_advantage)):
        ref, _ = fn(rewards.clone(), mask, ids.numpy(), config=verl.AlgoConfig())
        close(compute_advantages(name, token_rewards=rewards, group_ids=ids, mask=mask)[0], ref)


def test_remax_matches_verl():
    _, scores, mask, rewards = groups_and_scores(4)
    rewards = rewards + torch.rand(B, T, dtype=torch.float64) * mask  # also per-token rewards
    baselines = torch.randn(B, dtype=torch.float64)
    ref_adv, ref_ret = verl.compute_remax_outcome_advantage(rewards, baselines, mask)
    adv, ret = compute_advantages("remax", token_rewards=rewards, reward_baselines=baselines, mask=mask)
    close(adv, ref_adv)
    close(ret, ref_ret)


@pytest.mark.parametrize("seed", [5, 6])
def test_gdpo_components_match_verl(seed):
    ids, _, mask, rewards = groups_and_scores(seed)
    g = torch.Generator().manual_seed(seed)
    parts = {"format": torch.randint(0, 2, (B,), generator=g).float(), "acc": torch.rand(B, generator=g)}
    prompt_len = 3
    attention = torch.cat([torch.ones(B, prompt_len), mask], dim=1).long()  # verl: int64
    algo = verl.AlgoConfig(gdpo_reward_keys=["format", "acc"], gdpo_reward_weights=[1.0, 0.5])
    ref, _ = verl.compute_gdpo_outcome_advantage(
        rewards,
        mask,
        ids.numpy(),
        config=algo,
        non_tensor_batch={k: v.numpy() for k, v in parts.items()},
        batch={"prompts": torch.zeros(B, prompt_len), "attention_mask": attention},
    )
    ours = gdpo(torch.stack([parts["format"], parts["acc"]]).double(), ids, mask, weights=[1.0, 0.5])
    close(ours, ref)


@pytest.mark.parametrize("seed", [7, 8])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
def test_optimal_token_baseline_matches_verl(seed, zero_tail, with_is):
    ids, _, mask, rewards = groups_and_scores(seed)
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    sum_pi_sq = torch.rand(B, T, generator=g, dtype=torch.float64)
    is_w = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5 if with_is else None
    ref_adv, ref_ret = verl.compute_optimal_token_baseline_advantage(
        rewards, mask, ids.numpy(), old, sum_pi_sq, is_w, handle_zero_tail=zero_tail
    )
    adv, ret = optimal_token_baseline(rewards, mask, ids, old, sum_pi_sq, is_w, handle_zero_tail=zero_tail)
    close(adv, ref_adv)
    close(ret, ref_ret)


# ----------------------------------------------------------------------------- overlong shaping


@pytest.mark.parametrize("max_len,buffer,factor", [(20, 4, 1.0), (64, 16, 0.5), (8, 8, 2.0)])
def test_overlong_penalty_matches_verls_dapo_manager(max_len, buffer, factor):
    manager = verl.ActorConfig(
        overlong_buffer_cfg=verl.ActorConfig(len=buffer, penalty_factor=factor), max_resp_len=max_len
    )
    for length in range(0, max_len + 4):
        reward, penalty = verl.dapo_overlong_reward(manager, torch.tensor(length), reward=0.75)
        assert abs(overlong_penalty(length, max_len, buffer, factor) - float(penalty)) < 1e-6
