"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476) as a rollout source around another.

With `algorithm.filter_groups.enable`, a step generates rounds of `data.train_batch_size` prompts
until `data.train_batch_size` groups (a prompt's `rollout.n` samples) are kept: a group is kept
when its metric is not constant over its samples (a constant group has zero group-relative
advantage: no signal) or it has one sample, as verl's `ray_trainer` (recipe/dapo). Metrics
(`algorithm.filter_groups.metric`, per sample):
    acc         the reward function's `acc` extra when it returns one (as verl), else score >= 1
                (as val/accuracy)
    score       the task score (rule or custom reward, before the reward model and any penalty)
    seq_reward  the reward trained on: score (+ reward-model term) + the overlong penalty
Rounds stop at `max_num_gen_batches` (0: no limit); short of groups there, `on_cap` says what the
step does: `stop` (verl's behaviour: a UserError naming the fix) or `train` (the kept groups,
topped up with the earliest dropped ones to a full batch: a constant group has zero GRPO/RLOO
advantage, so it adds no gradient, and the batch keeps the size the mini-batches expect).
Kept groups past the batch are discarded (verl truncates the same way).

How it sits on the inner (colocated) source: round 0 is the inner source's own `next_batch`
(weight sync, rollout, this DP rank's share scored); the later rounds draw the next prompts from
the same sampler (so the sampler's checkpointed position includes them and a resumed run draws the
same rounds), generate through the inner source's `generate` with a seed of their own (round k of
step s samples with the seed of step s + k x ROUND_SEED_STRIDE), and score this rank's share the
same way. Each round's groups are all-gathered over DP, so every rank makes the same choice; the
chosen batch is then split over the DP ranks by `stages.dp_share`, which keeps each group whole
on one rank (the group statistics of GRPO need all n samples there).

Split placement is refused at preflight: its source requests one batch a step ahead (staleness 1)
and streams scoring as the batch arrives, neither of which has a place for further rounds.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from rlstack import stages
from rlstack.errors import UserError
from rlstack.step import StepBatch
from rlstack.step.scoring import Scores

ROUND_SEED_STRIDE = 1_000_003  # round k of step s samples as "step" s + k * stride (no collision with a real step)


@dataclass
class Group:
    """One prompt's samples, scored (what a round yields and the filter keeps or drops)."""

    prompt: Any  # rlstack.data.dataset.Prompt
    gens: list  # its Generations (prompt_index: any; re-indexed when the batch is built)
    values: list[float]  # the training reward of each (Scores.values)
    results: list  # ScoreResult of each
    penalties: list[float]  # overlong penalty of each ([] when off)


def sample_metric(metric: str, value: float, result) -> float:
    """One sample's value of `algorithm.filter_groups.metric` (module docstring)."""
    if metric == "seq_reward":
        return float(value)
    if metric == "score":
        return float(result.score)
    if metric == "acc":
        acc = result.extras.get("acc") if result.extras else None
        return float(acc) if isinstance(acc, (int, float, bool)) else float(result.score >= 1.0)
    raise ValueError(f"algorithm.filter_groups.metric={metric!r}: use acc, score or seq_reward")


def keeps(group: Group, metric: str) -> bool:
    """verl's rule: kept when the metric varies over the group's samples, or there is one sample."""
    vals = [sample_metric(metric, v, r) for v, r in zip(group.values, group.results)]
    return len(vals) == 1 or max(vals) > min(vals)


class GroupFilter:
    """The kept and dropped groups of one step, over its generation rounds (pure Python)."""

    def __init__(self, target: int, metric: str, max_rounds: int, on_cap: str):
        self.target, self.metric, self.max_rounds, self.on_cap = target, metric, max_rounds, on_cap
        self.kept: list[Group] = []
        self.dropped: list[Group] = []
        self.rounds = 0

    def add_round(self, groups: list[Group]) -> None:
        """One round's groups, in their global order."""
        self.rounds += 1
        for group in groups:
            (self.kept if keeps(group, self.metric) else self.dropped).append(group)

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target

    @property
    def capped(self) -> bool:
        """No further round allowed (max_num_gen_batches reached; 0: never)."""
        return 0 < self.max_rounds <= self.rounds

    def batch(self, step: int) -> list[Group]:
        """The step's `target` groups: the first kept ones in round order; short at the cap, per `on_cap`."""
        if self.full:
            return self.kept[: self.target]
        if self.on_cap == "train":
            return self.kept + self.dropped[: self.target - len(self.kept)]
        raise UserError(
            f"step {step + 1}: dynamic sampling kept {len(self.kept)} of data.train_batch_size={self.target} "
            f"groups after algorithm.filter_groups.max_num_gen_batches={self.max_rounds} rounds "
            f"({len(self.dropped)} groups had a constant {self.metric}): the prompts are too easy or too hard; "
            "raise max_num_gen_batches (0: no limit) or set algorithm.filter_groups.on_cap=train"
        )

    def metrics(self) -> dict:
        generated = len(self.kept) + len(self.dropped)
        used = min(len(self.kept), self.target)
        return {
            "dapo/groups_generated": float(generated),
            "dapo/groups_kept": float(used),  # kept groups trained on
            "dapo/groups_dropped": float(len(self.dropped)),  # constant groups
            "dapo/groups_surplus": float(len(self.kept) - used),  # kept past the batch, discarded
            "dapo/gen_rounds": float(self.rounds),
            "dapo/topped_up": float(self.target - used),  # on_cap=train: dropped groups trained on
        }


@dataclass
class _Round:
    """One round on this DP rank: its share's prompts, generations, scores; the tokens generated."""

    prompts: list
    gens: list
    scores: Scores
    tokens: float
    timings: dict = field(default_factory=dict)


class DynamicSamplingSource:
    """`RolloutSource` (rlstack/step/__init__.py) adding DAPO's generation rounds to `inner`
    (a `ColocatedSource`: its sampler, train set, scoring, groups and `generate` are used)."""

    def __init__(self, inner, cfg):
        self.inner, self.cfg = inner, cfg
        f = cfg.algorithm.filter_groups
        self.metric, self.max_rounds, self.on_cap = f.metric, f.max_num_gen_batches, f.on_cap

    def next_batch(self, step: int) -> StepBatch:
        g = self.inner.groups
        first = self.inner.next_batch(step)  # weight sync, round 0's rollout and scores
        rounds = [_Round(first.prompts, first.gens, first.scores, first.gen_tokens, first.timings)]
        filt = GroupFilter(self.cfg.data.train_batch_size, self.metric, self.max_rounds, self.on_cap)
        filt.add_round(self._gather(rounds[0]))
        while not filt.full and not filt.capped:
            rounds.append(self._round(step, filt.rounds))
            filt.add_round(self._gather(rounds[-1]))
        chosen = filt.batch(step)
        prompts, gens, scores = self._share(chosen, shaped=bool(first.scores.penalties))
        t0 = time.perf_counter()
        pad, mbs = self.inner.tokenizer.pad_token_id, self.cfg.algorithm.micro_batch_size
        rollout = stages.build_rollout(prompts, gens, scores.values, pad, mbs, g.device, on_policy=self.inner.on_policy)
        timings = dict(first.timings)
        for key in ("timing/rollout_s", "timing/score_s"):
            timings[key] = sum(r.timings.get(key, 0.0) for r in rounds)
        timings["timing/score_s"] += time.perf_counter() - t0
        metrics = {**first.metrics, **filt.metrics()}
        scores.rm_metrics = first.scores.rm_metrics  # round 0's reward-model statistics
        tokens = sum(r.tokens for r in rounds)
        return StepBatch(prompts, gens, scores, rollout, first.sync, tokens, timings, metrics)

    def _round(self, step: int, k: int) -> _Round:
        """Round k > 0: the sampler's next prompts, generated with round k's seed, this rank's share scored."""
        inner, g = self.inner, self.inner.groups
        t0 = time.perf_counter()
        global_prompts = [inner.train_set[i] for i in inner.sampler.next_global_batch()]
        gens, tokens = inner.generate(global_prompts, step + k * ROUND_SEED_STRIDE, greedy=False)
        prompts, gens = stages.dp_share(
            global_prompts, gens, g, self.cfg.trainer.balance_batch, stages.shares_prompts(self.cfg)
        )
        t1 = time.perf_counter()
        scores = inner.scoring.score(prompts, gens)
        timings = {"timing/rollout_s": t1 - t0, "timing/score_s": time.perf_counter() - t1}
        return _Round(prompts, gens, scores, tokens, timings)

    def _gather(self, r: _Round) -> list[Group]:
        """Every DP rank's groups of round `r`, in rank order (the same list on every rank)."""
        from rlstack.workers.batch import gather_objects

        g = self.inner.groups
        mine = [Group(p, [], [], [], []) for p in r.prompts]
        pen = r.scores.penalties or [0.0] * len(r.gens)
        for x, v, res, p in zip(r.gens, r.scores.values, r.scores.results, pen):
            grp = mine[x.prompt_index]
            grp.gens.append(x)
            grp.values.append(v)
            grp.results.append(res)
            grp.penalties.append(p)
        return gather_objects(mine, g.dp, g.dims.dp)

    def _share(self, chosen: list[Group], shaped: bool) -> tuple[list, list, Scores]:
        """This DP rank's groups of the chosen batch (whole groups: `stages.dp_share`), re-indexed;
        `shaped`: the scores carry overlong penalties."""
        g = self.inner.groups
        gens, values, results, penalties = [], [], [], []
        for i, grp in enumerate(chosen):
            gens += [dataclasses.replace(x, prompt_index=i) for x in grp.gens]
            values += grp.values
            results += grp.results
            penalties += grp.penalties
        # dp_share on the groups' positions: which groups are this rank's (whole, balanced as configured)
        share, mine = stages.dp_share(
            list(range(len(chosen))), gens, g, self.cfg.trainer.balance_batch, stages.shares_prompts(self.cfg)
        )
        in_share = set(share)
        rows = [r for r, x in enumerate(gens) if x.prompt_index in in_share]  # dp_share keeps this order
        penalties = [penalties[r] for r in rows] if shaped else []
        scores = Scores([values[r] for r in rows], [results[r] for r in rows], penalties=penalties)
        return [chosen[i].prompt for i in share], mine, scores

    # the rest is the inner source's
    def after_update(self, step: int) -> dict:
        return self.inner.after_update(step)

    def generate(self, prompts: list, step: int, greedy: bool):
        return self.inner.generate(prompts, step, greedy)

    def state_dict(self) -> dict:
        return self.inner.state_dict()  # the sampler (extra rounds included) is checkpointed on its own

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def close(self, ok: bool) -> None:
        self.inner.close(ok)
