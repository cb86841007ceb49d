"""Overlong reward shaping at its boundary lengths, and the config/preflight of the new losses,
estimators, overlong buffer and dynamic-sampling keys (one-line errors naming the key)."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from rlstack.config import ConfigError, OverlongBufferConfig, load_config
from rlstack.errors import UserError
from rlstack.preflight import check_algorithm_params
from rlstack.rewards.overlong import OverlongShaping, overlong_metrics, overlong_penalty, overlong_sums, shape_scores

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ----------------------------------------------------------------------------- overlong shaping


def test_overlong_penalty_at_the_boundaries():
    # max 20 tokens, buffer 4: no penalty up to 16; then -1/4 a token; -1 at 20; past 20 the line
    # goes on (verl's manager does not cap it; the engines never get there)
    assert overlong_penalty(15, 20, 4, 1.0) == 0.0
    assert overlong_penalty(16, 20, 4, 1.0) == 0.0  # the buffer's start
    assert overlong_penalty(17, 20, 4, 1.0) == -0.25
    assert overlong_penalty(20, 20, 4, 1.0) == -1.0  # the maximum: -penalty_factor
    assert overlong_penalty(22, 20, 4, 1.0) == -1.5  # beyond
    assert overlong_penalty(20, 20, 4, 0.5) == -0.5
    assert overlong_penalty(0, 8, 8, 2.0) == 0.0 and overlong_penalty(8, 8, 8, 2.0) == -2.0  # buffer = max
    with pytest.raises(ValueError, match="reward.overlong_buffer.len"):
        overlong_penalty(5, 20, 0, 1.0)


def test_shape_scores_and_metrics():
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    shaped, penalties = shape_scores([1.0, 1.0, 0.0], [10, 18, 20], cfg, 20)
    assert penalties == [0.0, -0.5, -1.0]
    assert shaped == [1.0, 0.5, -1.0]
    # two data-parallel ranks' sums add up: (-1.5 + -0.25) / 4 responses, 3 of 4 penalised
    sums = [a + b for a, b in zip(overlong_sums(penalties), overlong_sums([-0.25]))]
    assert overlong_metrics(sums) == {"reward/overlong_penalty": -1.75 / 4, "reward/overlong_frac": 0.75}
    off = OverlongBufferConfig(enable=False, len=4)
    assert shape_scores([1.0, 0.0], [20, 20], off, 20) == ([1.0, 0.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="one length per response"):
        shape_scores([1.0], [3, 4], cfg, 20)


def test_the_trainer_side_shaper_sums_a_step_over_calls():
    shaper = OverlongShaping(OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0), 20)
    assert shaper([1.0, 1.0], [18, 10]) == [0.5, 1.0]  # one streamed part
    assert shaper([0.0], [20]) == [-1.0]  # the next part of the same step
    other_rank = [-0.25, 1.0, 1.0]
    metrics = shaper.metrics(lambda v: [a + b for a, b in zip(v, other_rank)])
    assert metrics == {"reward/overlong_penalty": -1.75 / 4, "reward/overlong_frac": 0.75}
    assert shaper.metrics(lambda v: v) == {"reward/overlong_penalty": 0.0, "reward/overlong_frac": 0.0}  # reset
    off = OverlongShaping(OverlongBufferConfig(), 20)
    assert off([1.0], [20]) == [1.0] and off.metrics(lambda v: v) == {}


# ----------------------------------------------------------------------------- config and preflight


def cfg_of(*overrides):
    return load_config(None, ["data.synthetic=arith", *overrides])


def test_every_new_loss_and_estimator_name_validates():
    for name in ("sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl"):
        check_algorithm_params(cfg_of(f"algorithm.policy_loss={name}"))
    check_algorithm_params(cfg_of("algorithm.policy_loss=dro", "algorithm.policy_loss_params.dro_beta=0.1"))
    for name in ("opo", "grpo_passk", "gpg", "gdpo", "optimal_token_baseline"):
        check_algorithm_params(cfg_of(f"algorithm.adv_estimator={name}"))
    # gdpo keys: "score" alone needs no custom function; other keys need one (the file is checked elsewhere)
    check_algorithm_params(cfg_of("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[score]"))
    check_algorithm_params(
        cfg_of("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc]", "data.reward_fn_file=r.py")
    )
    with pytest.raises(ConfigError, match="choose one of"):
        cfg_of("algorithm.policy_loss=ppo2")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["algorithm.policy_loss=dro"], "algorithm.policy_loss_params.dro_beta is None with policy_loss=dro"),
        (
            ["algorithm.policy_loss=sapo", "algorithm.policy_loss_params.tau_neg=0"],
            "algorithm.policy_loss_params.tau_neg is 0.0 with policy_loss=sapo: it must be > 0",
        ),
        (
            ["algorithm.policy_loss=clip_cov", "algorithm.policy_loss_params.clip_cov_ratio=1.5"],
            "clip_cov_ratio is 1.5 .* in \\(0, 1\\]",
        ),
        (
            ["algorithm.policy_loss=clip_cov", "algorithm.policy_loss_params.clip_cov_lb=6"],
            "clip_cov_lb=6.0 must be below clip_cov_ub=5.0",
        ),
        (
            ["algorithm.policy_loss=kl_cov", "algorithm.policy_loss_params.ppo_kl_coef=-1"],
            "ppo_kl_coef is -1.0 .* >= 0",
        ),
        (
            ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,format]"],
            "built-in rules return only 'score': set data.reward_fn_file",
        ),
        (["algorithm.gdpo_reward_weights=[1.0]"], "1 weights for 0 gdpo_reward_keys"),
        (["reward.overlong_buffer.enable=true"], "reward.overlong_buffer.len is 0: it must lie in \\[1, "),
        (
            ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=65"],
            "rollout.max_new_tokens=64",
        ),
        (
            [
                "reward.overlong_buffer.enable=true",
                "reward.overlong_buffer.len=8",
                "reward.overlong_buffer.penalty_factor=-1",
            ],
            "penalty_factor is -1.0",
        ),
        (["algorithm.filter_groups.max_num_gen_batches=-1"], "max_num_gen_batches is -1"),
        (
            ["algorithm.filter_groups.enable=true", "placement.rollout_ranks=1", "rollout.staleness=1"],
            "rollout.staleness=1: the next steps' prompts are already drawn .* set rollout.staleness=0",
        ),
    ],
)
def test_one_line_errors(overrides, message):
    with pytest.raises(UserError, match=message) as info:
        check_algorithm_params(cfg_of(*overrides))
    assert "\n" not in str(info.value)


def test_warnings_for_settings_without_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="rlstack.preflight"):
        check_algorithm_params(cfg_of("algorithm.policy_loss=cispo", "algorithm.policy_loss_params.tau_pos=2"))
        check_algorithm_params(cfg_of("algorithm.policy_loss=sapo"))  # loss_agg_mode token-mean is not read
        check_algorithm_params(
            cfg_of(
                "algorithm.filter_groups.enable=true",
                "reward.overlong_buffer.enable=true",
                "reward.overlong_buffer.len=8",
            )
        )
    text = caplog.text
    assert "tau_pos has no effect with policy_loss=cispo" in text
    assert "policy_loss=sapo aggregates seq-mean-token-mean" in text
    # overlong shaping (rlstack/step/scoring.py) and dynamic sampling (rlstack/step/dynamic.py) are live
    assert "reward.overlong_buffer" not in text and "filter_groups" not in text


def test_filter_groups_keys_are_accepted():
    cfg = cfg_of(
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10",
    )
    check_algorithm_params(cfg)
    assert (cfg.algorithm.filter_groups.enable, cfg.algorithm.filter_groups.metric) == (True, "acc")
    with pytest.raises(ConfigError, match="'algorithm.filter_groups.metric' is 'reward'"):
        cfg_of("algorithm.filter_groups.metric=reward")
    assert cfg.algorithm.filter_groups.on_cap == "stop"  # verl's behaviour at the cap
    assert cfg_of("algorithm.filter_groups.on_cap=train").algorithm.filter_groups.on_cap == "train"
    with pytest.raises(ConfigError, match="on_cap"):
        cfg_of("algorithm.filter_groups.on_cap=skip")


def test_the_dapo_recipe_config_validates():
    cfg = load_config(os.path.join(ROOT, "yaml_configs", "dapo_smollm2_cpu.yaml"))
    check_algorithm_params(cfg)
    a = cfg.algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert not a.use_kl_loss and not a.use_kl_in_reward
    assert cfg.reward.overlong_buffer.enable and a.filter_groups.enable


def test_plan_counts_the_old_logprob_forward_of_optimal_token_baseline():
    """On policy (one epoch, one mini-batch) grpo skips the old-log-prob forward; OTB runs it."""
    from rlstack.planner.build import derive_setting

    dims = SimpleNamespace(tp=1, pp=1, dp=1, ep=1, cp=1, world_size=1)
    on_policy = ["algorithm.ppo_epochs=1", "algorithm.mini_batch_size=0", "algorithm.use_kl_in_reward=false"]
    grpo = derive_setting(cfg_of(*on_policy), dims, 2048, fused_attention=True)
    otb = derive_setting(cfg_of(*on_policy, "algorithm.adv_estimator=optimal_token_baseline"), dims, 2048, True)
    assert not grpo.needs_old_logprob and otb.needs_old_logprob
