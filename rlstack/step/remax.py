"""ReMax's baseline (Li et al. 2023, arXiv:2310.10505) as a rollout source around another.

With `algorithm.adv_estimator=remax`, each step's prompts also get one greedy generation
(`generate(..., greedy=True)` of the inner source: the same engine and weights as the samples),
scored the same way as the samples (the task reward, the reward model's term and the overlong
penalty: `Scoring.score` of a training batch). Each sample's baseline is its prompt's greedy reward,
set as `Rollout.reward_baselines` [B'] for `compute_advantages("remax", reward_baselines=...)` in
the trainer. The greedy prompts are this step's prompts of every DP rank, gathered (`generate`
splits one global list over the rollout replicas); each rank keeps its own prompts' responses.
Metric: `reward/remax_baseline_mean` (the mean baseline over the batch's samples).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from rlstack.step import StepBatch


class RemaxBaselineSource:
    """`RolloutSource` (rlstack/step/__init__.py) adding the greedy baseline to `inner`'s batches."""

    def __init__(self, inner, groups, scoring):
        self.inner, self.groups, self.scoring = inner, groups, scoring

    def next_batch(self, step: int) -> StepBatch:
        from rlstack import collectives
        from rlstack.workers.batch import gather_objects

        batch = self.inner.next_batch(step)
        g = self.groups
        t0 = time.perf_counter()
        counts = [int(c) for c in gather_objects([len(batch.prompts)], g.dp, g.dims.dp)]
        everyone = gather_objects(list(batch.prompts), g.dp, g.dims.dp)  # rank order
        first = sum(counts[: g.dp_rank])
        greedy, tokens = self.inner.generate(everyone, step, greedy=True)
        mine = [
            dataclasses.replace(x, prompt_index=x.prompt_index - first)
            for x in greedy
            if first <= x.prompt_index < first + len(batch.prompts)
        ]
        scored = self.scoring.score(batch.prompts, mine)  # a training batch: shaped as the samples
        baseline = {x.prompt_index: v for x, v in zip(mine, scored.values)}
        values = [baseline[x.prompt_index] for x in batch.gens]
        rows = batch.rollout.scores.shape[0]
        base = torch.zeros(rows, dtype=torch.float32, device=batch.rollout.scores.device)  # [B'] fillers 0
        base[: len(values)] = torch.tensor(values, dtype=torch.float32)
        batch.rollout.reward_baselines = base
        sums = collectives.sum_floats([sum(values), len(values)], g.dp, g.device)
        batch.metrics["reward/remax_baseline_mean"] = sums[0] / max(sums[1], 1.0)
        batch.timings["timing/remax_baseline_s"] = time.perf_counter() - t0
        batch.gen_tokens += tokens
        return batch

    def after_update(self, step: int) -> dict:
        return self.inner.after_update(step)

    def generate(self, prompts: list, step: int, greedy: bool):
        return self.inner.generate(prompts, step, greedy)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def close(self, ok: bool) -> None:
        self.inner.close(ok)
