"""The PPO/GRPO step: a scored batch from a rollout source -> advantages -> update -> metrics.

Every rank runs the same program (SPMD). Each training rank hosts its shard of the actor, critic
and reference on the megatron TP/PP/DP groups. `Trainer.train_step` is the only step:

    source.next_batch(step)      sync, rollout, scoring: rlstack/step/colocated.py or step/split.py
    forwards.fill(rollout)       old / reference log-probs, values (rlstack/step/scoring.py)
    _advantages(rollout)         KL-in-reward, the configured estimator (rlstack/algorithms)
    _update(rollout)             PPO epochs over mini-batches (rlstack/workers/actor.py, critic.py)
    source.after_update(step)    the split source's batch generated ahead; idle phase
    metrics                      reductions and names in rlstack/step/metrics.py

Where the batch comes from is the rollout source's business (rlstack/step/__init__.py has the
protocol): colocated (an engine on every rank, synced in place) or split placement (rollout-only
ranks, optionally one step ahead). Construction lives in rlstack/build.py: a test gives the
trainer its own parts (a fake engine). docs/architecture.md draws one step.

Left out on purpose: rollout/training overlap when colocated (the roles take turns on the same
ranks; split placement is the overlap); the reference is a full frozen copy (no LoRA-style
shared base); no dynamic sampling or multi-turn rollouts yet (each would be a rollout source, not
a second step); one update per batch (no replay buffer).
"""

from __future__ import annotations

import dataclasses
import time

from megatron_bridge.parallel import ParallelGroups
from rlstack import collectives
from rlstack.algorithms import compute_advantages, place_at_last_token, rollout_is_weights
from rlstack.algorithms.kl import apply_kl_penalty
from rlstack.build import TrainerParts, build_parts, step_parts
from rlstack.config import ExperimentConfig, adv_estimator
from rlstack.rollout import sync_check
from rlstack.step import StepBatch
from rlstack.step import agent as agent_step
from rlstack.step import metrics as step_metrics
from rlstack.workers.batch import Rollout, pad_rows

__all__ = ["Trainer", "TrainerParts", "build_trainer"]


def build_trainer(cfg: ExperimentConfig, groups: ParallelGroups, placement=None) -> Trainer:
    """The trainer of `cfg` on `groups` (rlstack.build.build_parts has the construction)."""
    return Trainer(cfg, groups, build_parts(cfg, groups, placement))


class Trainer:
    def __init__(self, cfg: ExperimentConfig, groups: ParallelGroups, parts: TrainerParts):
        self.cfg, self.groups = cfg, groups
        self.hf_dir, self.tokenizer = parts.hf_dir, parts.tokenizer
        self.train_set, self.val_set, self.sampler = parts.train_set, parts.val_set, parts.sampler
        self.scorer, self.kl_ctrl = parts.scorer, parts.kl_ctrl
        self.actor, self.ref, self.critic = parts.actor, parts.ref, parts.critic
        self.engine, self.weight_sync = parts.engine, parts.weight_sync
        step = step_parts(cfg, groups, parts)
        self.phases, self.scoring, self.forwards, self.source = step.phases, step.scoring, step.forwards, step.source
        self.step = 0

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The loop's progress and the source's (the colocated engine's sampling seed follows from the step)."""
        return {"step": self.step, **self.source.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.source.load_state_dict(state)

    def checkpoint_parts(self):
        """What a checkpoint of this run holds (rlstack.checkpoint.CheckpointParts).

        The frozen reference is rebuilt from HF at start, so it is not saved.
        """
        from rlstack.checkpoint import CheckpointParts

        roles = {"actor": self.actor.role}
        if self.critic is not None:
            roles["critic"] = self.critic.role
        states = {"trainer": self, "sampler": self.sampler, "kl_ctrl": self.kl_ctrl}
        for name, role in roles.items():
            if role.lr_schedule is not None:
                states[f"{name}_lr_schedule"] = role.lr_schedule
        sources = {"actor": self.hf_dir, "critic": self.cfg.model.critic_path or self.hf_dir}
        return CheckpointParts(roles, states, {name: sources[name] for name in roles})

    # ------------------------------------------------------------------ one step

    def train_step(self, dry_run: bool = False) -> dict:
        """One step on the source's next batch; returns the step's metrics (`dry_run`: no optimizer step)."""
        self.phases.start()
        t_step = time.perf_counter()
        batch = self.source.next_batch(self.step)
        if self.cfg.algorithm.gdpo_reward_keys and adv_estimator(self.cfg) == "gdpo":  # the keys' values, per row
            from rlstack.step.scoring import reward_components

            keys, r = self.cfg.algorithm.gdpo_reward_keys, batch.rollout
            r.reward_components = reward_components(batch.scores.results, keys, r.rows, r.scores.device)
        t0 = time.perf_counter()
        metrics = self._forwards_and_advantages(batch.rollout)
        metrics.update(self._update(batch.rollout, forward_only=dry_run))
        sync_check.check_rollout_diff(self.cfg.rollout, self.step, metrics)
        metrics.update(batch.timings)
        metrics["timing/update_s"] = time.perf_counter() - t0
        metrics.update(self.source.after_update(self.step))
        metrics["timing/step_s"] = time.perf_counter() - t_step
        metrics.update(self._batch_metrics(batch))
        metrics.update(self.scoring.metrics(batch.scores, over_dp=True))
        modules = [self.actor.role.module] + ([self.critic.role.module] if self.critic is not None else [])
        skip = self.cfg.trainer.on_nonfinite == "skip"
        step_metrics.check_finite(metrics, self.step + 1, skip, modules, self.groups)
        metrics.update(self.phases.metrics())
        self.step += 1
        return metrics

    def _batch_metrics(self, batch: StepBatch) -> dict:
        """The weight sync's, the source's, and the rollout's reward / length / throughput metrics."""
        rollout_s = batch.timings["timing/rollout_s"]
        out = {**batch.sync.as_metrics(), **batch.metrics}
        out.update(
            step_metrics.rollout_metrics(batch.scores.values, batch.gens, batch.gen_tokens, rollout_s, self.groups)
        )
        return out

    def _forwards_and_advantages(self, rollout: Rollout) -> dict:
        """The scoring phase: old / reference log-probs and values (`ScoreForwards`; the split source
        may have filled them while streaming), the engine's agreement with the actor, advantages."""
        self.phases.enter("scoring")  # offload: weights in; grads and optimizer stay out
        self.forwards.fill(rollout)
        metrics = {} if rollout.on_policy else step_metrics.engine_agreement(rollout, self.groups)
        metrics.update(self._advantages(rollout))
        return metrics

    def _update(self, rollout: Rollout, forward_only: bool) -> dict:
        """The PPO epochs over mini-batches (critic, then actor); the update's metrics."""
        a, g = self.cfg.algorithm, self.groups
        metrics = {}
        self.phases.enter("update")  # offload: grads and optimizer state back
        minis = rollout.mini_batches(a.mini_batch_size, g.dims.dp, a.micro_batch_size)
        train_actor = self.step >= a.critic_warmup_steps
        scale_factor = float(a.loss_scale_factor or self.cfg.rollout.max_new_tokens)  # Dr.GRPO's constant length
        actor_stats, critic_stats, actor_norms, critic_norms, actor_s, critic_s = [], [], [], [], 0.0, 0.0
        for _ in range(a.ppo_epochs):
            for mini in minis:
                counts = step_metrics.loss_counts(mini, g, scale_factor)
                if self.critic is not None:
                    t0 = time.perf_counter()
                    out = self.critic.update(mini, counts, a.micro_batch_size, forward_only=forward_only)
                    critic_stats, critic_s = critic_stats + out.stats, critic_s + time.perf_counter() - t0
                    critic_norms.append(out.grad_norm)
                t0 = time.perf_counter()
                if train_actor:
                    out = self.actor.update(mini, counts, a.micro_batch_size, forward_only=forward_only)
                    actor_stats += out.stats
                    actor_norms.append(out.grad_norm)
                actor_s += time.perf_counter() - t0
        metrics.update(step_metrics.train_throughput(rollout, a.ppo_epochs, actor_s, critic_s, g))
        metrics.update(step_metrics.reduce_stats(actor_stats, g, len(minis) * a.ppo_epochs, "actor"))
        metrics.update(step_metrics.reduce_stats(critic_stats, g, len(minis) * a.ppo_epochs, "critic"))
        metrics.update(step_metrics.is_metrics(actor_stats, g, a.rollout_is))
        if not forward_only:
            metrics.update(step_metrics.grad_norms(actor_norms, critic_norms))
            metrics.update(self._step_lr_schedules(train_actor))
        return metrics

    def _step_lr_schedules(self, train_actor: bool) -> dict:
        """The lr schedules count trainer steps (as verl's); the actor's only when it trained."""
        out = {}
        if train_actor:
            out["actor/lr"] = self.actor.role.lr_schedule.lr
            self.actor.role.lr_schedule.step()
        if self.critic is not None:
            out["critic/lr"] = self.critic.role.lr_schedule.lr
            self.critic.role.lr_schedule.step()
        return out

    def _advantages(self, rollout: Rollout) -> dict:
        """Fills `rollout.advantages` and `.returns`; the filler rows past num_sequences get zeros."""
        a, g = self.cfg.algorithm, self.groups
        n = rollout.num_sequences  # rows past n only fill the last micro-batch: no response, no reward
        mask = rollout.resp_mask[:n]
        token_rewards = place_at_last_token(rollout.scores[:n], mask)  # [n, S]
        metrics = {}
        if a.use_kl_in_reward:
            token_rewards, kl_mean = apply_kl_penalty(
                token_rewards, rollout.old_logprob[:n], rollout.ref_logprob[:n], mask, self.kl_ctrl.value, a.kl_penalty
            )
            kl_mean = collectives.sum_floats([float(kl_mean)], g.dp, g.device)[0] / g.dims.dp
            self.kl_ctrl.update(kl_mean, n_steps=self.cfg.data.train_batch_size)
            metrics.update({"actor/reward_kl": kl_mean, "actor/kl_coef": self.kl_ctrl.value})
        estimator = adv_estimator(self.cfg)
        inputs = dict(token_rewards=token_rewards)
        if estimator == "gae":
            inputs["values"] = rollout.old_values[:n]
        if estimator == "remax":  # the greedy responses' rewards (rlstack/step/remax.py)
            inputs["reward_baselines"] = rollout.reward_baselines[:n]
        if estimator == "gdpo" and rollout.reward_components is not None:  # algorithm.gdpo_reward_keys
            inputs.update(
                reward_components=rollout.reward_components[:, :n], reward_weights=a.gdpo_reward_weights or None
            )
        if estimator == "optimal_token_baseline":  # ScoreForwards.fill's old-log-prob forward gave both
            inputs.update(old_logprob=rollout.old_logprob[:n], sum_pi_squared=rollout.sum_pi_squared[:n])
            if a.rollout_is != "none":  # verl scales W_t by the IS weight squared
                inputs["is_weights"] = rollout_is_weights(
                    rollout.old_logprob[:n], rollout.rollout_logprob[:n], mask, a.rollout_is, a.rollout_is_cap
                )[0]
        adv, returns = compute_advantages(
            estimator,
            mask=mask,
            group_ids=rollout.group_ids[:n],
            gamma=a.gamma,
            lam=a.lam,
            reduce_fn=collectives.sum_over(g.dp, g.device),
            **inputs,
        )
        rollout.advantages = pad_rows(adv.detach(), rollout.rows)
        rollout.returns = pad_rows(returns.detach(), rollout.rows)
        return metrics

    # ------------------------------------------------------------------ validation

    def validate(self) -> dict:
        """Greedy generations of the whole validation set, scored on every rank: val/* metrics."""
        if self.val_set is None or len(self.val_set) == 0:
            return {}
        from rlstack.data.dataset import val_accuracy

        self.phases.enter("rollout")  # offload: the engine generates; "idle" again below for checkpoints
        prompts = [self.val_set[i] for i in range(len(self.val_set))]
        gens, size = [], self.cfg.data.val_batch_size  # prompts generated at once (bounds engine memory)
        for start in range(0, len(prompts), size):
            chunk, _ = self.source.generate(prompts[start : start + size], self.step, greedy=True)
            gens += [dataclasses.replace(g, prompt_index=g.prompt_index + start) for g in chunk]
        scores = self.scoring.score(prompts, gens, over_dp=False)
        metrics = val_accuracy(scores.values, [prompts[x.prompt_index].data_source for x in gens])
        # every rank scored every validation response: no reduction over ranks
        metrics.update({"val/" + k: v for k, v in self.scoring.metrics(scores, over_dp=False).items()})
        metrics.update(agent_step.val_records(gens))  # val/agent/* (multi-turn validation: docs/agents.md)
        self.phases.enter("idle")  # offload
        return metrics
