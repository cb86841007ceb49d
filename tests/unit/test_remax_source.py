"""ReMax's greedy baseline (rlstack/step/remax.py) on a one-rank fake inner source: one greedy
generation per prompt, scored like the samples, each sample's baseline its prompt's greedy reward,
and the trainer's remax advantages are the samples' rewards minus it."""

from __future__ import annotations

import types

import pytest

from rlstack import stages
from rlstack.algorithms import compute_advantages, place_at_last_token
from rlstack.rewards.custom import ScoreResult
from rlstack.rollout.interface import Generation
from rlstack.step import StepBatch
from rlstack.step.remax import RemaxBaselineSource
from rlstack.step.scoring import Scores


class _Scoring:
    """The response's first token / 10 (greedy responses answer 10 x prompt index + 3)."""

    def score(self, prompts, gens, over_dp=True):
        values = [x.response_ids[0] / 10 for x in gens]
        return Scores(values, [ScoreResult(v) for v in values])


class _Inner:
    def __init__(self):
        self.prompts = [types.SimpleNamespace(index=i, input_ids=[i + 1]) for i in range(2)]
        self.greedy_calls = []

    def generate(self, prompts, step, greedy):
        self.greedy_calls.append((len(prompts), greedy))
        return [Generation(i, [], [10 * i + 3], [0.0], "stop") for i in range(len(prompts))], float(len(prompts))

    def next_batch(self, step):
        gens = [Generation(i, [i + 1], [r], [-1.0], "stop") for i in range(2) for r in (0, 10)]
        scores = Scores([x.response_ids[0] / 10 for x in gens], [])
        rollout = stages.build_rollout(self.prompts, gens, scores.values, 0, 8, "cpu", on_policy=True)
        return StepBatch(self.prompts, gens, scores, rollout, None, 4.0, {"timing/rollout_s": 0.0}, {})


def test_each_sample_gets_its_prompts_greedy_reward(world_of_one):
    groups = types.SimpleNamespace(dp=world_of_one, dims=types.SimpleNamespace(dp=1), dp_rank=0, device="cpu")
    inner = _Inner()
    batch = RemaxBaselineSource(inner, groups, _Scoring()).next_batch(step=0)
    assert inner.greedy_calls == [(2, True)]  # one greedy generation per prompt
    r = batch.rollout
    assert r.reward_baselines.tolist() == pytest.approx([0.3, 0.3, 1.3, 1.3] + [0.0] * 4)  # fillers 0
    assert batch.metrics["reward/remax_baseline_mean"] == pytest.approx(0.8)
    assert batch.gen_tokens == 6.0
    n = r.num_sequences
    mask = r.resp_mask[:n]
    adv, _ = compute_advantages(
        "remax",
        token_rewards=place_at_last_token(r.scores[:n], mask),
        mask=mask,
        reward_baselines=r.reward_baselines[:n],
    )
    per_sample = [float(adv[i][mask[i].bool()][0]) for i in range(n)]
    assert per_sample == pytest.approx([0.0 - 0.3, 1.0 - 0.3, 0.0 - 1.3, 1.0 - 1.3])
