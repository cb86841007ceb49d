"""Scoring: each response's reward, and the forward passes that score a batch before the update.

`Scoring.score` runs the rule or custom reward (rlstack.rewards) and, when configured, the reward
model (rlstack.workers.reward_model), and returns everything it computed as `Scores`; nothing is
kept between calls. `ScoreForwards.fill` runs the forward-only passes of the scoring phase: the
actor's old log-probs, the reference's log-probs, the critic's values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from rlstack import stages

if TYPE_CHECKING:
    from megatron_bridge.parallel import ParallelGroups
    from rlstack.workers.actor import Actor
    from rlstack.workers.batch import Rollout
    from rlstack.workers.critic import Critic
    from rlstack.workers.megatron_role import MegatronRole


@dataclass
class Scores:
    """What scoring computed for a list of generations (same order)."""

    values: list[float]  # the reward of each generation (rule/custom, plus weight x RM score)
    results: list = field(default_factory=list)  # rlstack.rewards.ScoreResult of each (reward_extra/*)
    rm_metrics: dict = field(default_factory=dict)  # reward/rm_* with a reward model, else empty
    penalties: list = field(default_factory=list)  # the overlong penalty in each value (training; else empty)


class Scoring:
    """Rule / custom reward, the reward model when there is one, and DAPO's overlong shaping of
    training rewards (`overlong`: (config.OverlongBufferConfig, rollout.max_new_tokens), or None)."""

    def __init__(self, scorer, tokenizer, reward_model, groups: ParallelGroups, overlong=None):
        self.scorer, self.tokenizer, self.reward_model, self.groups = scorer, tokenizer, reward_model, groups
        self.overlong = overlong

    def score(self, prompts: list, gens: list, over_dp: bool = True) -> Scores:
        """Each generation's reward. `over_dp`: the DP ranks hold different samples (training), so
        the reward model's normalisation and metrics reduce over them, and the overlong penalty is
        added (validation, over_dp False, keeps the task scores)."""
        if self.reward_model is None:
            results = stages.score(self.scorer, self.tokenizer, prompts, gens)
            scores = Scores(stages.agent_rewards(gens, [r.score for r in results]), results)
        else:
            out = self.reward_model.rewards(self.scorer, self.tokenizer, prompts, gens, over_dp=over_dp)
            scores = Scores(stages.agent_rewards(gens, out.scores), out.results, out.metrics)
        if over_dp and self._overlong_on():
            from rlstack.rewards.overlong import shape_scores

            cfg, max_length = self.overlong
            lengths = [len(x.response_ids) for x in gens]  # eos included, as verl's valid_response_length
            scores.values, scores.penalties = shape_scores(scores.values, lengths, cfg, max_length)
        return scores

    def metrics(self, scores: Scores, over_dp: bool) -> dict:
        """`reward_extra/<key>` (custom reward function's numeric extras), the reward model's reward/rm_*,
        and (training) reward/overlong_penalty and reward/overlong_frac, apart from the task reward."""
        return {**self._extra_metrics(scores, over_dp), **scores.rm_metrics, **self._overlong_metrics(scores, over_dp)}

    def _overlong_on(self) -> bool:
        return self.overlong is not None and self.overlong[0].enable

    def _overlong_metrics(self, scores: Scores, over_dp: bool) -> dict:
        """The mean penalty (included in reward/mean) and the share penalised, over every DP rank's batch."""
        if not over_dp or not self._overlong_on():
            return {}
        from rlstack import collectives
        from rlstack.rewards.overlong import overlong_metrics, overlong_sums

        g = self.groups
        return overlong_metrics(collectives.sum_floats(overlong_sums(scores.penalties), g.dp, g.device))

    def _extra_metrics(self, scores: Scores, over_dp: bool) -> dict:
        """Means of the custom reward function's numeric extra dict keys (and the share of calls past
        data.reward_timeout_s). Ranks may see different keys, so (sum, count) pairs are
        all-gathered rather than all-reduced."""
        from rlstack.rewards import extras_sums, merge_extras_sums
        from rlstack.workers.batch import gather_objects

        if self.scorer.custom_fn is None:
            return {}
        local = extras_sums(scores.results)
        g = self.groups
        parts = gather_objects([local], g.dp, g.dims.dp) if over_dp else [local]
        return merge_extras_sums(parts)


def reward_components(results: list, keys: list, rows: int, device=None):
    """gdpo: [K, rows] float32, row i the values of `keys` in results[i] (a ScoreResult: "score" is
    its score, any other key one of the reward function's extra dict keys; a timed-out call 0);
    filler rows past len(results) get 0. A key missing from a result is the user's error
    (algorithm.gdpo_reward_keys): one line naming the key and the keys the function returned."""
    import torch

    from rlstack.errors import UserError

    out = torch.zeros(len(keys), rows, dtype=torch.float32)
    for i, result in enumerate(results):
        for k, key in enumerate(keys):
            if result.timed_out:  # scored 0 past data.reward_timeout_s: every component 0
                continue
            value = result.score if key == "score" else result.extras.get(key)
            if getattr(value, "shape", None) == () and hasattr(value, "item"):
                value = value.item()  # numpy / torch scalars
            if not isinstance(value, (int, float)):  # bool counts (an `acc` of True is 1.0, as verl)
                raise UserError(
                    f"algorithm.gdpo_reward_keys names {key!r}, but the reward function returned "
                    f"{'no ' + repr(key) if value is None else repr(key) + '=' + repr(value)} for a sample "
                    f"(its keys: {sorted(['score', *map(str, result.extras)])}): return a number under every key listed"
                )
            out[k, i] = float(value)
    return out.to(device) if device is not None else out


@dataclass
class ScoreForwards:
    """The scoring phase's forward passes over a batch (offload brings the reference in for its own)."""

    actor: Actor
    ref: Optional[MegatronRole]
    critic: Optional[Critic]
    micro_batch_size: int
    temperature: float
    offload: Any  # rlstack.workers.offload.Offloader
    ref_from_actor: bool = False  # LoRA: the reference is the actor with its adapters off (no ref role)
    sum_pi_squared: bool = False  # optimal_token_baseline: the old-log-prob forward also gives sum_v p_v^2

    def fill(self, rollout: Rollout) -> None:
        """Old log-probs (off policy), reference log-probs, values: each unless already filled."""
        from rlstack.workers.actor import compute_logprobs

        mbs, temperature = self.micro_batch_size, self.temperature
        if self.sum_pi_squared and rollout.sum_pi_squared is None:
            # One forward gives both (verl's old-log-prob pass does the same, on policy too: the
            # update's own forward comes after the advantages it needs). On policy the update still
            # takes its own detached log-probs as the old ones.
            old, rollout.sum_pi_squared = compute_logprobs(
                self.actor.role, rollout, mbs, temperature, with_sum_pi_squared=True
            )
            if rollout.old_logprob is None:
                rollout.old_logprob = old
        if not rollout.on_policy and rollout.old_logprob is None:
            rollout.old_logprob = compute_logprobs(self.actor.role, rollout, mbs, temperature)
        if self.ref is not None and rollout.ref_logprob is None:
            with self.offload.reference():  # offload: the reference's weights in for its forward only
                rollout.ref_logprob = compute_logprobs(self.ref, rollout, mbs, temperature)
        if self.ref_from_actor and rollout.ref_logprob is None:
            from megatron_bridge.lora import adapters_disabled

            with adapters_disabled(self.actor.role.module):
                rollout.ref_logprob = compute_logprobs(self.actor.role, rollout, mbs, temperature)
        if self.critic is not None and rollout.old_values is None:
            rollout.old_values = self.critic.compute_values(rollout, mbs)
