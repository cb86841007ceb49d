"""DAPO's overlong shaping inside the step's scoring (rlstack/step/scoring.py): the penalty is in the
training scores the advantages are computed from, validation keeps the task scores, and the
penalty is logged apart from the task reward."""

from __future__ import annotations

import pytest
import torch

from rlstack import stages
from rlstack.algorithms import compute_advantages, place_at_last_token
from rlstack.config import OverlongBufferConfig
from rlstack.data.dataset import Prompt
from rlstack.rewards.custom import ScoreResult
from rlstack.rollout.interface import Generation
from rlstack.step.scoring import Scoring


class _Scorer:
    """Every response scores 1.0 (the task reward), whatever its length."""

    custom_fn = None

    def score_batch(self, samples):
        return [ScoreResult(1.0) for _ in samples]


class _Tokenizer:
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Groups:
    def __init__(self, group):
        self.dp, self.device = group, torch.device("cpu")


def _batch(lengths):
    """One prompt; a response of each length (max_new_tokens 8)."""
    prompts = [Prompt(0, [5, 6], "copy", "1")]
    gens = [Generation(0, [5, 6], [7] * n, [-0.5] * n, "length") for n in lengths]
    return prompts, gens


def test_the_penalty_reaches_the_advantages_and_is_logged_apart(world_of_one):
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    scoring = Scoring(_Scorer(), _Tokenizer(), None, _Groups(world_of_one), overlong=(cfg, 8))
    prompts, gens = _batch([4, 6, 8, 2])  # buffer starts past 8 - 4 = 4 tokens: 0, -0.5, -1, 0
    scores = scoring.score(prompts, gens)
    assert scores.values == [1.0, 0.5, 0.0, 1.0]
    assert [r.score for r in scores.results] == [1.0] * 4  # the task scores stay apart
    rollout = stages.build_rollout(prompts, gens, scores.values, 0, 4, "cpu", on_policy=True)
    assert rollout.scores.tolist() == [1.0, 0.5, 0.0, 1.0]
    n = rollout.num_sequences
    token_rewards = place_at_last_token(rollout.scores[:n], rollout.resp_mask[:n])
    adv, _ = compute_advantages(
        "grpo",
        token_rewards=token_rewards,
        mask=rollout.resp_mask[:n],
        group_ids=rollout.group_ids[:n],
        gamma=1.0,
        lam=1.0,
    )
    per_sample = [float(adv[i][rollout.resp_mask[i].bool()][0]) for i in range(n)]
    # the task reward alone is constant: without the penalty every advantage would be 0
    assert per_sample[0] > 0 and per_sample[2] < per_sample[1] < 0 and per_sample[3] == per_sample[0]
    m = scoring.metrics(scores, over_dp=True)
    assert m["reward/overlong_penalty"] == pytest.approx(-1.5 / 4)
    assert m["reward/overlong_frac"] == pytest.approx(0.5)


def test_validation_keeps_the_task_scores(world_of_one):
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    scoring = Scoring(_Scorer(), _Tokenizer(), None, _Groups(world_of_one), overlong=(cfg, 8))
    prompts, gens = _batch([8, 8])
    scores = scoring.score(prompts, gens, over_dp=False)
    assert scores.values == [1.0, 1.0] and scores.penalties == []
    assert "reward/overlong_penalty" not in scoring.metrics(scores, over_dp=False)


def test_off_leaves_scores_alone(world_of_one):
    scoring = Scoring(_Scorer(), _Tokenizer(), None, _Groups(world_of_one), overlong=(OverlongBufferConfig(), 8))
    prompts, gens = _batch([8, 2])
    scores = scoring.score(prompts, gens)
    assert scores.values == [1.0, 1.0]
    assert scoring.metrics(scores, over_dp=True) == {}
