"""DAPO dynamic sampling (rlstack/step/dynamic.py): the group filter on hand cases, and the source
around a fake inner source (rounds drawn from the sampler, seeds per round, the batch built)."""

from __future__ import annotations

import types

import pytest
import torch

from rlstack.config import ExperimentConfig
from rlstack.data.sampler import PromptSampler
from rlstack.errors import UserError
from rlstack.rewards.custom import ScoreResult
from rlstack.rollout.interface import Generation
from rlstack.step import StepBatch
from rlstack.step.dynamic import ROUND_SEED_STRIDE, DynamicSamplingSource, Group, GroupFilter, sample_metric
from rlstack.step.scoring import Scores


def _group(name: str, scores: list[float], penalties: list[float] | None = None) -> Group:
    pen = penalties or [0.0] * len(scores)
    return Group(
        name, [None] * len(scores), [s + p for s, p in zip(scores, pen)], [ScoreResult(s) for s in scores], pen
    )


def _names(groups):
    return [g.prompt for g in groups]


def test_constant_groups_are_dropped_and_refilled_in_round_order():
    f = GroupFilter(target=3, metric="score", max_rounds=0, on_cap="stop")
    f.add_round([_group("a", [0, 0]), _group("b", [0, 1]), _group("c", [1, 1])])
    assert (_names(f.kept), _names(f.dropped), f.full) == (["b"], ["a", "c"], False)
    f.add_round([_group("d", [0.5, 0.5]), _group("e", [1, 0]), _group("f", [0, 0])])
    assert not f.full
    f.add_round([_group("g", [0, 0.25]), _group("h", [1, 0])])
    assert f.full and _names(f.batch(step=0)) == ["b", "e", "g"]  # "h" is surplus, discarded
    assert f.metrics() == {
        "dapo/groups_generated": 8.0,
        "dapo/groups_kept": 3.0,
        "dapo/groups_dropped": 4.0,
        "dapo/groups_surplus": 1.0,
        "dapo/gen_rounds": 3.0,
        "dapo/topped_up": 0.0,
    }


def test_a_group_of_one_is_kept_as_verl():
    f = GroupFilter(target=1, metric="score", max_rounds=0, on_cap="stop")
    f.add_round([_group("a", [0])])
    assert f.full


def test_cap_stop_says_what_to_change():
    f = GroupFilter(target=2, metric="acc", max_rounds=2, on_cap="stop")
    f.add_round([_group("a", [0, 0]), _group("b", [1, 0])])
    assert not f.capped
    f.add_round([_group("c", [0, 0]), _group("d", [1, 1])])
    assert f.capped and not f.full
    with pytest.raises(UserError, match="step 5: dynamic sampling kept 1 of data.train_batch_size=2 groups") as e:
        f.batch(step=4)
    assert "max_num_gen_batches=2 rounds (3 groups had a constant acc)" in str(e.value)
    assert "algorithm.filter_groups.on_cap=train" in str(e.value) and "\n" not in str(e.value)


def test_cap_train_tops_up_with_the_earliest_dropped_groups():
    f = GroupFilter(target=3, metric="score", max_rounds=2, on_cap="train")
    f.add_round([_group("a", [0, 0]), _group("b", [1, 0]), _group("c", [1, 1])])
    f.add_round([_group("d", [0, 0]), _group("e", [0, 0]), _group("f", [0, 0])])
    assert f.capped and _names(f.batch(step=0)) == ["b", "a", "c"]
    assert f.metrics()["dapo/topped_up"] == 2.0 and f.metrics()["dapo/groups_kept"] == 1.0


def test_zero_means_no_cap():
    f = GroupFilter(target=5, metric="score", max_rounds=0, on_cap="stop")
    for _ in range(50):
        f.add_round([_group("a", [0, 0])])
    assert not f.capped


def test_the_three_metrics():
    # the task scores are constant (1, 1); the overlong penalty makes the trained reward vary
    g = _group("a", [1.0, 1.0], penalties=[0.0, -0.5])
    for metric, kept in (("score", False), ("acc", False), ("seq_reward", True)):
        f = GroupFilter(target=1, metric=metric, max_rounds=0, on_cap="stop")
        f.add_round([g])
        assert f.full == kept, metric
    # acc: score >= 1 (0.3 and 0.6 are both wrong), unless the reward function returns an acc extra
    assert sample_metric("acc", 0.3, ScoreResult(0.3)) == sample_metric("acc", 0.6, ScoreResult(0.6)) == 0.0
    assert sample_metric("acc", 1.0, ScoreResult(1.0)) == 1.0
    assert sample_metric("acc", 0.2, ScoreResult(0.2, {"acc": True})) == 1.0
    assert sample_metric("score", -0.5, ScoreResult(1.0)) == 1.0


# ----------------------------------------------------------------------------- the source


class _Scoring:
    """Prompt p's sample j scores 1 when p is odd and j == 0, else 0: even prompts are constant groups."""

    def score(self, prompts, gens, over_dp=True):
        values = [float(prompts[x.prompt_index].index % 2 == 1 and x.response_ids[0] == 0) for x in gens]
        return Scores(values, [ScoreResult(v) for v in values])


class _Inner:
    """A one-rank colocated source: prompts from the sampler, n=2 samples per prompt."""

    def __init__(self, sampler):
        p = lambda i: types.SimpleNamespace(index=i, input_ids=[i])  # noqa: E731
        self.train_set = [p(i) for i in range(12)]
        self.sampler, self.scoring, self.seeds = sampler, _Scoring(), []
        dims = types.SimpleNamespace(dp=1)
        self.groups = types.SimpleNamespace(dims=dims, dp_rank=0, dp=None, device=torch.device("cpu"))
        self.tokenizer, self.on_policy = types.SimpleNamespace(pad_token_id=0), True

    def generate(self, prompts, step, greedy):
        self.seeds.append(step)
        gens = [
            Generation(i, list(p.input_ids), [j, 7], [-1.0, -1.0], "length")
            for i, p in enumerate(prompts)
            for j in range(2)
        ]
        return gens, float(2 * len(gens))

    def next_batch(self, step):
        prompts = [self.train_set[i] for i in self.sampler.next_global_batch()]
        gens, tokens = self.generate(prompts, step, False)
        scores = self.scoring.score(prompts, gens)
        return StepBatch(prompts, gens, scores, None, "sync", tokens, {"timing/rollout_s": 1.0}, {"engine/x": 1.0})


def test_the_source_draws_rounds_from_the_sampler_until_enough_groups_vary():
    cfg = ExperimentConfig()
    cfg.data.train_batch_size, cfg.algorithm.micro_batch_size = 4, 4
    cfg.algorithm.filter_groups.enable, cfg.algorithm.filter_groups.metric = True, "score"
    sampler = PromptSampler(12, 4, shuffle=False)
    inner = _Inner(sampler)
    batch = DynamicSamplingSource(inner, cfg).next_batch(step=3)
    # rounds of prompts 0-3, 4-7: the odd ones (2 a round) vary; 2 rounds give 4 kept groups
    assert [p.index for p in batch.prompts] == [1, 3, 5, 7]
    assert inner.seeds == [3, 3 + ROUND_SEED_STRIDE]
    assert sampler.position == 8  # the extra round advanced the sampler (checkpointed with it)
    assert [x.prompt_index for x in batch.gens] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [x.prompt_ids[0] for x in batch.gens] == [1, 1, 3, 3, 5, 5, 7, 7]
    assert batch.scores.values == [1.0, 0.0] * 4
    assert batch.rollout.scores.tolist() == [1.0, 0.0] * 4 and batch.rollout.num_sequences == 8
    assert batch.gen_tokens == 32.0 and batch.metrics["engine/x"] == 1.0
    assert (batch.metrics["dapo/gen_rounds"], batch.metrics["dapo/groups_dropped"]) == (2.0, 4.0)


@pytest.mark.parametrize("balance", [False, True])
def test_the_chosen_groups_are_dealt_whole_to_the_dp_ranks(balance):
    """Two DP ranks (no collective needed for the deal): every group's samples land on one rank,
    together with their scores, and the ranks together hold the batch once."""
    cfg = ExperimentConfig()
    cfg.trainer.balance_batch = balance
    chosen = []
    for p in range(4):  # group p: 3 samples, responses of p + 1 tokens (balance deals by tokens)
        prompt = types.SimpleNamespace(index=10 + p, input_ids=[p])
        gens = [Generation(99, [p], [j] * (p + 1), [0.0] * (p + 1), "length") for j in range(3)]
        values = [10.0 * p + j for j in range(3)]
        chosen.append(Group(prompt, gens, values, [ScoreResult(v) for v in values], [0.0] * 3))
    seen = []
    for rank in range(2):
        inner = _Inner(PromptSampler(12, 4))
        inner.groups.dims.dp, inner.groups.dp_rank = 2, rank
        prompts, gens, scores = DynamicSamplingSource(inner, cfg)._share(chosen, shaped=False)
        assert len(prompts) == 2 and len(gens) == 6 and scores.penalties == []
        for x, v in zip(gens, scores.values):
            p = prompts[x.prompt_index].index - 10  # the sample sits with its own prompt and score
            assert x.prompt_ids == [p] and len(x.response_ids) == p + 1 and int(v // 10) == p
        seen += [p.index for p in prompts]
    assert sorted(seen) == [10, 11, 12, 13]
