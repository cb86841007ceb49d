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


class Scoring:
    """Rule / custom reward, and the reward model when there is one."""

    def __init__(self, scorer, tokenizer, reward_model, groups: ParallelGroups):
        self.scorer, self.tokenizer, self.reward_model, self.groups = scorer, tokenizer, reward_model, groups

    def score(self, prompts: list, gens: list, over_dp: bool = True) -> Scores:
        """Each generation's reward. `over_dp`: the DP ranks hold different samples (training), so
        the reward model's normalisation and metrics reduce over them."""
        if self.reward_model is None:
            results = stages.score(self.scorer, self.tokenizer, prompts, gens)
            return Scores([r.score for r in results], results)
        out = self.reward_model.rewards(self.scorer, self.tokenizer, prompts, gens, over_dp=over_dp)
        return Scores(out.scores, out.results, out.metrics)

    def metrics(self, scores: Scores, over_dp: bool) -> dict:
        """`reward_extra/<key>` (custom reward function's numeric extras) and the reward model's reward/rm_*."""
        return {**self._extra_metrics(scores, over_dp), **scores.rm_metrics}

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

    def fill(self, rollout: Rollout) -> None:
        """Old log-probs (off policy), reference log-probs, values: each unless already filled."""
        from rlstack.workers.actor import compute_logprobs

        mbs, temperature = self.micro_batch_size, self.temperature
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
