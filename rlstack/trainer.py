"""The PPO/GRPO loop: sync -> rollout -> score -> advantages -> update -> record.

Every rank runs the same program (SPMD). Each rank hosts its shard of the actor, critic and
reference on the megatron TP/PP/DP groups, and a full rollout engine. Rollout work is split over
all ranks and gathered inside each model-parallel group, so TP/PP peers train on the same batch.

`build_trainer(cfg, groups)` assembles the parts (data, scorer, roles, engine, weight sync) and
hands them to `Trainer`, which holds no construction logic: a test can give it a fake engine.

With split placement (`placement.rollout_ranks=K`, docs/placement.md) the trainer runs on the
first N - K ranks only and takes its batches from the rollout ranks (`_split_train_step`):
synchronously and streamed into scoring, or one step ahead (`rollout.staleness=1`).

Left out on purpose: colocated, no rollout/training overlap (the roles take turns on the same ranks);
no sequence packing (right padding keeps positions natural, so megatron's causal mask is exact);
no dynamic batch sizing (micro-batches are fixed row counts); the reference is a full frozen copy.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_bridge.parallel import ParallelGroups
from rlstack import collectives, host_memory, stages
from rlstack.algorithms import build_kl_controller, compute_advantages, place_at_last_token
from rlstack.algorithms.kl import apply_kl_penalty
from rlstack.config import ExperimentConfig, adv_estimator
from rlstack.observability.monitor import PhaseMemory
from rlstack.rollout import sync_check
from rlstack.workers.actor import Actor, compute_logprobs
from rlstack.workers.batch import Rollout, gather_objects, pad_rows
from rlstack.workers.critic import Critic
from rlstack.workers.megatron_role import MegatronRole, OptimSettings, warmup_steps
from rlstack.workers.step_metrics import reduce_stats

log = logging.getLogger("rlstack")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The engine's counters a step logs (rank 0's; docs/rollout.md).
_ENGINE_METRICS = (
    "rollout/packed_weight_bytes",
    "rollout/decode_steps",
    "rollout/decode_rows_mean",
    "rollout/decode_live_share",
)


@dataclass
class TrainerParts:
    """Everything a Trainer runs on, built by `build_trainer` (or by a test)."""

    hf_dir: str
    tokenizer: Any
    train_set: Any  # rlstack.data.dataset.PromptDataset
    val_set: Any  # or None
    sampler: Any  # rlstack.data.sampler.PromptSampler
    scorer: Any  # rlstack.rewards.RewardScorer
    actor: Actor
    ref: Optional[MegatronRole]
    critic: Optional[Critic]
    engine: Any  # rlstack.rollout.base.RolloutEngine
    weight_sync: Any  # megatron_bridge.reshard.WeightSync (sync() -> SyncStats)
    kl_ctrl: Any
    reward_model: Any = None  # rlstack.workers.reward_model.RewardModel, or None (reward_model.path empty)
    split: Any = None  # rlstack.placement.RolloutClient with split placement (engine None), else None


def build_trainer(cfg: ExperimentConfig, groups: ParallelGroups, placement=None) -> Trainer:
    """Data, scorer, roles, rollout engine and weight sync for `cfg`, on `groups`.

    `placement` (megatron_bridge.parallel.SplitPlacement): split placement; the engines live on the
    rollout ranks, reached through a RolloutClient, and the weight sync sends to them.
    """
    from megatron_bridge.reshard import WeightSync
    from rlstack.rewards import RewardScorer
    from rlstack.rollout.base import build_engine
    from rlstack.workers.reward_model import build_reward_model

    hf_dir, tokenizer, train_set, val_set, sampler = stages.build_data(cfg, groups)
    scorer = RewardScorer.from_config(cfg.data)
    if not cfg.reward_model.path:  # with a reward model, sources without a rule get the RM's score alone
        scorer.check_sources(train_set.data_sources())
        if val_set is not None:
            scorer.check_sources(val_set.data_sources())
    actor, ref, critic = build_roles(cfg, groups, hf_dir)
    reward_model = build_reward_model(cfg, groups, tokenizer, DTYPES[cfg.model.dtype])
    split = None
    if placement is not None:
        engine, weight_sync, split = None, *_split_parts(cfg, groups, placement, actor)
    else:
        engine = build_engine(cfg.rollout, hf_dir, groups, tokenizer.eos_token_id, tokenizer.pad_token_id)
        weight_sync = WeightSync(
            actor.role.module,
            actor.role.args,
            groups,
            engine,
            bucket_mb=cfg.rollout.sync_bucket_mb,
            zero_copy=cfg.rollout.zero_copy,
        )
    a = cfg.algorithm
    kl_ctrl = build_kl_controller(a.kl_ctrl, a.kl_coef, a.kl_target, a.kl_horizon)
    return Trainer(
        cfg,
        groups,
        TrainerParts(
            hf_dir,
            tokenizer,
            train_set,
            val_set,
            sampler,
            scorer,
            actor,
            ref,
            critic,
            engine,
            weight_sync,
            kl_ctrl,
            reward_model,
            split,
        ),
    )


def _split_parts(cfg: ExperimentConfig, groups: ParallelGroups, placement, actor: Actor):
    """(sending weight sync, RolloutClient) of a training rank in split placement."""
    from megatron_bridge.reshard import SplitWeightSync
    from rlstack.placement import RolloutClient, split_layout

    position = (groups.dp_rank, groups.tp_rank, groups.pp_rank)
    sync = SplitWeightSync(
        actor.role.module,
        None,
        actor.role.args,
        placement,
        split_layout(cfg, placement),
        position,
        cfg.rollout.tp,
        cfg.rollout.sync_bucket_mb,
    )
    return sync, RolloutClient(placement, sync, groups.device, cfg.rollout)


def build_roles(cfg: ExperimentConfig, groups: ParallelGroups, hf_dir: str):
    """(actor, reference or None, critic or None) Megatron roles of `cfg` on `groups`."""
    a = cfg.algorithm
    dtype = DTYPES[cfg.model.dtype]
    total = cfg.trainer.total_steps
    optim = dict(
        weight_decay=a.weight_decay,
        clip_grad=a.clip_grad,
        adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        lr_schedule=a.lr_schedule,
        total_steps=total,
        min_lr_ratio=a.min_lr_ratio,
    )
    actor_optim = OptimSettings(
        lr=a.actor_lr, lr_warmup_steps=warmup_steps(a.actor_lr_warmup_steps, a.lr_warmup_ratio, total), **optim
    )
    critic_optim = OptimSettings(
        lr=a.critic_lr, lr_warmup_steps=warmup_steps(a.critic_lr_warmup_steps, a.lr_warmup_ratio, total), **optim
    )
    # full recompute, megatron's selective modules, or none (config.py checks they are not both set)
    recompute = cfg.model.gradient_checkpointing or tuple(cfg.model.recompute_modules)
    fused = cfg.model.fused_output_logprobs
    actor = Actor(
        MegatronRole(hf_dir, groups, dtype, optim=actor_optim, recompute=recompute, fused_output=fused),
        a,
        temperature=cfg.rollout.temperature,
    )
    ref = MegatronRole(hf_dir, groups, dtype, fused_output=fused) if (a.use_kl_loss or a.use_kl_in_reward) else None
    critic = None
    if a.name == "ppo":
        critic = Critic(
            MegatronRole(
                cfg.model.critic_path or hf_dir,
                groups,
                dtype,
                value_head=True,
                recompute=recompute,
                optim=critic_optim,
                value_head_seed=cfg.trainer.seed,
            ),
            a,
        )
    for role in (actor.role, ref, critic.role if critic else None):
        if role is not None:
            role.max_tokens_per_micro_batch = a.max_tokens_per_micro_batch
            role.remove_padding = cfg.model.remove_padding
    return actor, ref, critic


class Trainer:
    def __init__(self, cfg: ExperimentConfig, groups: ParallelGroups, parts: TrainerParts):
        self.cfg, self.groups = cfg, groups
        self.hf_dir, self.tokenizer = parts.hf_dir, parts.tokenizer
        self.train_set, self.val_set, self.sampler = parts.train_set, parts.val_set, parts.sampler
        self.scorer = parts.scorer
        self.actor, self.ref, self.critic = parts.actor, parts.ref, parts.critic
        self.engine, self.weight_sync, self.kl_ctrl = parts.engine, parts.weight_sync, parts.kl_ctrl
        self.reward_model = parts.reward_model
        self.split = parts.split
        self.pending = None  # split, rollout.staleness=1: (prompt indices, RolloutBatch) of the next step
        self.step = 0
        self._reward_results: list = []
        self._rm_metrics: dict = {}  # reward/rm_* of the last scoring (with a reward model)
        # --- offload (rlstack.workers.offload): states to host in the phases that do not use them
        from rlstack.workers.offload import Offloader

        critic_role = self.critic.role if self.critic is not None else None
        self.offload = Offloader.from_config(cfg, self.actor.role, critic_role, self.ref, self.engine)
        self.phase_memory = PhaseMemory()  # mem/peak_gib/<phase>: this rank's peak in each phase of a step

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The loop's own progress (the engine's sampling seed follows from the step: nothing else to save)."""
        if self.split is None:
            return {"step": self.step}
        from rlstack.placement import pending_state

        # split, staleness 1: the batch generated ahead (with the previous weights) is saved, so a
        # resumed run trains on exactly the batch the uninterrupted one would have
        return {"step": self.step, "pending": pending_state(self.pending)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        if self.split is not None:
            from rlstack.placement import pending_from_state

            self.pending = pending_from_state(state.get("pending"))

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
        self.phase_memory.start()
        if self.split is not None:
            return self._split_train_step(dry_run)
        cfg, g = self.cfg, self.groups
        timings, t_step = {}, time.perf_counter()
        t0 = time.perf_counter()
        self._enter("sync")  # offload: actor weights in, engine weights awake
        sync_stats = self.weight_sync.sync()
        timings["timing/sync_s"] = time.perf_counter() - t0
        # rollout.verify_sync: stale engine weights stop the run
        sync_check.after_sync(
            cfg.rollout,
            self.step,
            sync_stats,
            self.actor.role,
            g,
            self.engine,
            sync_check.probe_prompts(self.train_set),
        )

        self._enter("rollout")  # offload: after the sync, before generation
        t0 = time.perf_counter()
        global_prompts = [self.train_set[i] for i in self.sampler.next_global_batch()]
        self.engine.metrics()  # its counters from here on: this rollout's (the sync check, validation generate too)
        gens, gen_tokens = self.generate(global_prompts, greedy=False)
        engine_metrics = self._engine_metrics()
        prompts, gens = stages.dp_share(global_prompts, gens, g, cfg.trainer.balance_batch)
        timings["timing/rollout_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        scores = self._rewards(prompts, gens)
        rollout = stages.build_rollout(
            prompts,
            gens,
            scores,
            self.tokenizer.pad_token_id,
            cfg.algorithm.micro_batch_size,
            g.device,
            on_policy=self._on_policy(),
        )
        timings["timing/score_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        metrics = self._update(rollout, forward_only=dry_run)
        sync_check.check_rollout_diff(cfg.rollout, self.step, metrics)
        timings["timing/update_s"] = time.perf_counter() - t0
        self._enter("idle")  # offload: everything resident for checkpoints (vLLM stays asleep)
        timings["timing/step_s"] = time.perf_counter() - t_step

        metrics.update(timings)
        metrics.update(sync_stats.as_metrics())
        metrics.update(self._rollout_metrics(scores, gens, gen_tokens, timings))
        metrics.update(engine_metrics)
        return self._finish_step(metrics)

    def _finish_step(self, metrics: dict) -> dict:
        """What every step ends with (colocated or split): reward and phase-memory metrics, the
        divergence check, then the step count."""
        metrics.update(self._reward_extra_metrics(over_dp=True))
        metrics.update(self._rm_metrics)
        self._check_finite(metrics)
        metrics.update(self.phase_memory.metrics())
        self.step += 1
        return metrics

    def _enter(self, phase: str) -> None:
        """A phase of the step begins: offload moves states for it, freed host heap pages go back to
        the kernel (rlstack/host_memory.py), the meter starts its peak."""
        self.offload.enter(phase)
        host_memory.trim_heap()
        self.phase_memory.enter(phase)

    def _engine_metrics(self) -> dict:
        """This rank's engine since its last `metrics()` call: weight bytes held beyond its synced tensors
        while generating (hf: packed copies), and how full its decode steps ran (hf)."""
        engine_metrics = self.engine.metrics() or {}
        return {k: v for k, v in engine_metrics.items() if k in _ENGINE_METRICS}

    def _split_train_step(self, dry_run: bool) -> dict:
        """Split placement (rlstack/placement.py): the batch comes from the rollout ranks.

        staleness 0: request batch t with weights t, wait, train. staleness 1: batch t was generated
        during step t-1 with weights t-1 (`self.pending`); request batch t+1 with weights t, train
        on batch t meanwhile, then receive batch t+1 (kept for the next step and in checkpoints).
        """
        from rlstack.placement import RolloutRequest

        cfg, g, client = self.cfg, self.groups, self.split
        timings, t_step = {"timing/trainer_wait_rollout": 0.0}, time.perf_counter()
        t0 = time.perf_counter()
        sync_stats = streamed = None
        if self.pending is None and self.reward_model is None:  # score each micro-batch as it arrives
            indices = self.sampler.next_global_batch()
            batch, sync_stats, waited, streamed = self._stream_batch(indices)
            self.pending = (indices, batch)
            timings["timing/trainer_wait_rollout"] += waited
        elif self.pending is None:  # a reward model normalises over the whole batch: no streaming
            indices = self.sampler.next_global_batch()
            prompts = [self.train_set[i] for i in indices]
            batch, waited, sync_stats = client.generate(prompts, self.step, self.step, greedy=False)
            self.pending = (indices, batch)
            timings["timing/trainer_wait_rollout"] += waited
        indices, batch = self.pending
        self.pending = None
        ahead = cfg.rollout.staleness == 1 and self.step + 1 < cfg.trainer.total_steps
        if ahead:  # batch t+1 is generated with these weights while this step trains
            next_indices = self.sampler.next_global_batch()
            ids = [list(self.train_set[i].input_ids) for i in next_indices]
            sync_stats = client.request(RolloutRequest("generate", ids, self.step + 1, self.step))
        timings["timing/rollout_s"] = batch.generate_s  # the rollout ranks' busy time for this batch
        if streamed is not None:
            prompts, gens, scores, rollout, timings["timing/score_s"] = streamed
            timings["timing/sync_s"] = sync_stats.seconds
        else:
            timings["timing/sync_s"] = time.perf_counter() - t0 - timings["timing/trainer_wait_rollout"]
            prompts, gens = stages.dp_share(
                [self.train_set[i] for i in indices], batch.gens, g, cfg.trainer.balance_batch
            )
            t0 = time.perf_counter()
            scores = self._rewards(prompts, gens)
            rollout = self._build_rollout(prompts, gens, scores)
            timings["timing/score_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics = self._update(rollout, forward_only=dry_run)
        timings["timing/update_s"] = time.perf_counter() - t0
        if ahead:
            next_batch, waited = client.receive()
            self.pending = (next_indices, next_batch)
            timings["timing/trainer_wait_rollout"] += waited
        timings["timing/step_s"] = time.perf_counter() - t_step
        metrics.update(timings)
        if sync_stats is None:  # staleness 1, last step: nothing generated ahead, no weights sent
            from megatron_bridge.reshard import SyncStats

            sync_stats = SyncStats()
        metrics.update(sync_stats.as_metrics())
        metrics.update(
            {
                "rollout/staleness": float(self.step - batch.version),
                "timing/rollout_wait_weights": batch.wait_weights_s,
            }
        )
        metrics.update(self._rollout_metrics(scores, gens, batch.tokens, timings))
        return self._finish_step(metrics)

    def _build_rollout(self, prompts: list, gens: list, scores: list) -> Rollout:
        a, pad = self.cfg.algorithm, self.tokenizer.pad_token_id
        return stages.build_rollout(prompts, gens, scores, pad, a.micro_batch_size, self.groups.device, on_policy=False)

    def _stream_batch(self, indices: list):
        """Split placement, synchronous batch: rewards, old/reference log-probs and values of each
        rollout micro-batch while the rollout ranks generate the next one.

        Returns (RolloutBatch, SyncStats, seconds waited, (prompts, gens, scores, Rollout, score seconds)).
        Every row's forwards are those of the whole-batch path (right padding: a row's positions do
        not depend on the batch's width).
        """
        from rlstack.placement import RolloutRequest
        from rlstack.workers.batch import split_for_rank

        g = self.groups
        global_prompts = [self.train_set[i] for i in indices]
        share = split_for_rank(list(range(len(indices))), g.dp_rank, g.dims.dp)
        first, in_share = (share[0] if share else 0), set(share)
        prompts = [global_prompts[i] for i in share]
        req = RolloutRequest("generate", [list(p.input_ids) for p in global_prompts], self.step, self.step)
        every, parts, results, busy = [], [], [], 0.0
        for chunk in self.split.stream(req):
            t0 = time.perf_counter()
            every += chunk
            mine = [
                dataclasses.replace(x, prompt_index=x.prompt_index - first) for x in chunk if x.prompt_index in in_share
            ]
            if mine:
                scores = self._rewards(prompts, mine)
                results += self._reward_results
                part = self._build_rollout(prompts, mine, scores)
                self._score_forwards(part)
                parts.append((mine, scores, part))
            busy += time.perf_counter() - t0
        t0 = time.perf_counter()
        meta, sync, waited = self.split.last_stream
        rows = sorted(
            ((x, sc) for mine, scores, _ in parts for x, sc in zip(mine, scores)), key=lambda r: r[0].prompt_index
        )
        gens, scores = [x for x, _ in rows], [sc for _, sc in rows]
        rollout = self._build_rollout(prompts, gens, scores)
        _fill_from_parts(rollout, gens, parts)
        self._reward_results = results
        batch = dataclasses.replace(meta, gens=sorted(every, key=lambda x: x.prompt_index))
        return batch, sync, waited, (prompts, gens, scores, rollout, busy + time.perf_counter() - t0)

    def _score_forwards(self, rollout: Rollout) -> None:
        """The scoring forwards of `_update` (old and reference log-probs, values) on `rollout`."""
        mbs, temperature = self.cfg.algorithm.micro_batch_size, self.cfg.rollout.temperature
        rollout.old_logprob = compute_logprobs(self.actor.role, rollout, mbs, temperature)
        if self.ref is not None:
            rollout.ref_logprob = compute_logprobs(self.ref, rollout, mbs, temperature)
        if self.critic is not None:
            rollout.old_values = self.critic.compute_values(rollout, mbs)

    def generate(self, prompts: list, greedy: bool):
        """Every rank's generations for `prompts` (the same list on every rank): `stages.generate`."""
        if self.split is not None:  # the rollout ranks generate, with the current weights
            batch, _, _ = self.split.generate(prompts, self.step, self.step, greedy)
            return batch.gens, batch.tokens
        return stages.generate(
            self.engine,
            prompts,
            self.cfg.rollout,
            self.groups,
            self.step,
            greedy,
            show_progress=self.cfg.logging.progress,
        )

    def _update(self, rollout: Rollout, forward_only: bool) -> dict:
        """Log-probs, values, advantages, then the PPO epochs over mini-batches."""
        a, g = self.cfg.algorithm, self.groups
        mbs = a.micro_batch_size
        metrics = {}
        # (split placement streams these per rollout micro-batch: already filled then)
        self._enter("scoring")  # offload: weights in; grads and optimizer stay out
        if not rollout.on_policy:
            if rollout.old_logprob is None:
                rollout.old_logprob = compute_logprobs(self.actor.role, rollout, mbs, self.cfg.rollout.temperature)
            metrics.update(self._engine_agreement(rollout))
        if self.ref is not None and rollout.ref_logprob is None:
            with self.offload.reference():  # offload: the reference's weights in for its forward only
                rollout.ref_logprob = compute_logprobs(self.ref, rollout, mbs, self.cfg.rollout.temperature)
        if self.critic is not None and rollout.old_values is None:
            rollout.old_values = self.critic.compute_values(rollout, mbs)
        metrics.update(self._advantages(rollout))
        self._enter("update")  # offload: grads and optimizer state back
        minis = rollout.mini_batches(a.mini_batch_size, g.dims.dp, mbs)
        actor_stats, critic_stats, grad_norms, critic_norms = [], [], [], []
        train_actor = self.step >= a.critic_warmup_steps
        actor_s = critic_s = 0.0
        for _ in range(a.ppo_epochs):
            for mini in minis:
                counts = self._counts(mini)
                t0 = time.perf_counter()
                if self.critic is not None:
                    out = self.critic.update(mini, counts, mbs, forward_only=forward_only)
                    critic_stats += out["stats"]
                    critic_norms.append(out["grad_norm"])
                t1 = time.perf_counter()
                if train_actor:
                    out = self.actor.update(mini, counts, mbs, forward_only=forward_only)
                    actor_stats += out["stats"]
                    grad_norms.append(out["grad_norm"])
                actor_s += time.perf_counter() - t1
                critic_s += t1 - t0
        metrics.update(self._train_throughput(rollout, actor_s, critic_s))
        metrics.update(reduce_stats(actor_stats, g, len(minis) * a.ppo_epochs, "actor"))
        metrics.update(reduce_stats(critic_stats, g, len(minis) * a.ppo_epochs, "critic"))
        metrics.update(self._is_metrics(actor_stats))
        for key, norms in (("actor/grad_norm", grad_norms), ("critic/grad_norm", critic_norms)):
            if norms and not forward_only:
                metrics[key] = sum(norms) / len(norms)
        if not forward_only:  # the lr schedules count trainer steps (as verl's); the actor's only when it trained
            if train_actor:
                metrics["actor/lr"] = self.actor.role.lr_schedule.lr
                self.actor.role.lr_schedule.step()
            if self.critic is not None:
                metrics["critic/lr"] = self.critic.role.lr_schedule.lr
                self.critic.role.lr_schedule.step()
        return metrics

    # Step metrics that must stay finite; a non-finite one stops the run (or, for gradient norms
    # with trainer.on_nonfinite=skip, the update was skipped and the run goes on).
    _FINITE_LOSSES = ("actor/loss", "actor/pg_loss", "actor/kl", "actor/entropy", "critic/loss")
    _FINITE_NORMS = ("actor/grad_norm", "critic/grad_norm")

    def _check_finite(self, metrics: dict) -> None:
        from rlstack.workers.finite import DivergenceError, count_nonfinite, first_nonfinite

        step, skip = self.step + 1, self.cfg.trainer.on_nonfinite == "skip"
        modules = [self.actor.role.module] + ([self.critic.role.module] if self.critic is not None else [])
        bad_weights = collectives.sum_floats([float(count_nonfinite(modules))], self.groups.world, self.groups.device)[
            0
        ]
        if bad_weights:
            raise DivergenceError(
                f"training diverged at step {step}: {int(bad_weights)} weight tensor(s) hold NaN/inf "
                f"after the optimizer step (nothing is saved from this step): lower "
                f"algorithm.actor_lr/critic_lr or algorithm.clip_grad"
            )
        norm = first_nonfinite(metrics, self._FINITE_NORMS)
        loss = first_nonfinite(metrics, self._FINITE_LOSSES)
        if (norm or loss) and skip:
            log.warning(
                "step %d: %s is %s: the update was skipped, weights unchanged (trainer.on_nonfinite=skip)",
                step,
                norm or loss,
                metrics[norm or loss],
            )
            metrics["trainer/skipped_update"] = 1.0
            return
        if norm or loss:
            key = norm or loss
            raise DivergenceError(
                f"training diverged at step {step}: {key} is {metrics[key]} (the optimizer step "
                f"was skipped; nothing is saved from this step): lower algorithm.actor_lr/critic_lr "
                f"or algorithm.clip_grad, or set trainer.on_nonfinite=skip to skip such updates"
            )

    def _on_policy(self) -> bool:
        """One epoch over one mini-batch: the policy that sampled is the one being updated."""
        a = self.cfg.algorithm
        return a.ppo_epochs == 1 and a.mini_batch_size <= 0 and not a.use_kl_in_reward

    def _engine_agreement(self, rollout: Rollout) -> dict:
        """How far the rollout engine's log-probs are from the actor's: a stale or wrong sync shows here."""
        mask = rollout.resp_mask
        diff = (rollout.rollout_logprob - rollout.old_logprob).abs() * mask
        local_max = diff.max().item() if mask.any() else 0.0
        g = self.groups
        total, count = collectives.sum_floats([float(diff.sum()), float(mask.sum())], g.dp, g.device)
        diff_max = collectives.max_floats([local_max], g.world, g.device)[0]
        return {"actor/rollout_diff": total / max(count, 1.0), "actor/rollout_diff_max": diff_max}

    def _is_metrics(self, stats: list[dict]) -> dict:
        """is/weight_mean, is/weight_max, is/clipped_frac of algorithm.rollout_is over the step's updates."""
        from rlstack.algorithms import is_metrics

        if self.cfg.algorithm.rollout_is == "none":
            return {}
        g, keys = self.groups, ("is/weight_sum", "is/clipped_sum", "is/units")
        local = [sum(float(s[k]) for s in stats if k in s) for k in keys]
        local.append(1.0 if any("is/units" in s for s in stats) else 0.0)  # holds stats (last stage)
        total = collectives.sum_floats(local, g.world, g.device)
        if total[-1] == 0:
            return {}
        per_dp = [v / (total[-1] / g.dims.dp) for v in total[:3]]  # TP ranks of the last stage hold copies
        local_max = max((float(s["is/weight_max"]) for s in stats if "is/weight_max" in s), default=0.0)
        return is_metrics(*per_dp, collectives.max_floats([local_max], g.world, g.device)[0])

    def _train_throughput(self, rollout: Rollout, actor_s: float, critic_s: float) -> dict:
        """Tokens (prompt + response, all DP ranks) trained per second, per role."""
        g = self.groups
        local = float(rollout.num_tokens) * self.cfg.algorithm.ppo_epochs
        tokens = collectives.sum_floats([local], g.dp, g.device)[0]
        out = {"timing/actor_update_s": actor_s}
        if actor_s > 0:
            out["throughput/actor_tok_s"] = tokens / actor_s
        if self.critic is not None and critic_s > 0:
            out["throughput/critic_tok_s"] = tokens / critic_s
            out["timing/critic_update_s"] = critic_s
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

    def _counts(self, mini: Rollout) -> dict:
        """The mini-batch's token and sequence counts over all DP ranks (the losses' global normalisers)."""
        g, mask = self.groups, mini.resp_mask
        tokens, seqs = collectives.sum_floats([float(mask.sum()), float((mask.sum(-1) > 0).sum())], g.dp, g.device)
        # loss_scale_factor: the constant length of seq-mean-token-sum-norm (Dr.GRPO); other modes ignore it.
        scale_factor = float(self.cfg.algorithm.loss_scale_factor or self.cfg.rollout.max_new_tokens)
        return {"global_num_tokens": tokens, "global_num_seqs": seqs, "loss_scale_factor": scale_factor}

    def _rollout_metrics(self, scores: list, gens: list, gen_tokens: float, timings: dict) -> dict:
        g = self.groups
        local = [sum(scores), len(scores), sum(len(x.response_ids) for x in gens)]
        total, count, length = collectives.sum_floats(local, g.dp, g.device)
        sq = collectives.sum_floats([sum((s - total / count) ** 2 for s in scores)], g.dp, g.device)[0]
        rollout_s = max(timings["timing/rollout_s"], 1e-9)
        return {
            "reward/mean": total / count,
            "reward/std": (sq / count) ** 0.5,
            "response/length_mean": length / count,
            "throughput/rollout_tok_s": gen_tokens / rollout_s,
        }

    # ------------------------------------------------------------------ validation

    def validate(self) -> dict:
        if self.val_set is None or len(self.val_set) == 0:
            return {}
        from rlstack.data.dataset import val_accuracy

        self._enter("rollout")  # offload: the engine generates; "idle" again below for checkpoints

        prompts = [self.val_set[i] for i in range(len(self.val_set))]
        gens, size = [], self.cfg.data.val_batch_size  # prompts generated at once (bounds engine memory)
        for start in range(0, len(prompts), size):
            chunk, _ = self.generate(prompts[start : start + size], greedy=True)
            gens += [dataclasses.replace(g, prompt_index=g.prompt_index + start) for g in chunk]
        scores = self._rewards(prompts, gens, over_dp=False)
        metrics = val_accuracy(scores, [prompts[x.prompt_index].data_source for x in gens])
        # every rank scored every validation response: no reduction over ranks
        metrics.update({"val/" + k: v for k, v in self._reward_extra_metrics(over_dp=False).items()})
        metrics.update({"val/" + k: v for k, v in self._rm_metrics.items()})
        self._enter("idle")  # offload
        return metrics

    def _rewards(self, prompts: list, gens: list, over_dp: bool = True) -> list[float]:
        """Rule (or custom) score of each generated response, plus weight x the reward model's score when
        there is one; the results are kept for the extras metrics. `over_dp`: the DP ranks hold
        different samples (training), so RM normalisation and metrics reduce over them."""
        if self.reward_model is None:
            self._reward_results = stages.score(self.scorer, self.tokenizer, prompts, gens)
            return [r.score for r in self._reward_results]
        out = self.reward_model.rewards(self.scorer, self.tokenizer, prompts, gens, over_dp=over_dp)
        self._reward_results, self._rm_metrics = out.results, out.metrics
        return out.scores

    def _reward_extra_metrics(self, over_dp: bool) -> dict:
        """`reward_extra/<key>`: means of the custom reward function's numeric extra dict keys (and
        the share of calls past data.reward_timeout_s) over the last scored samples. Ranks may see
        different keys, so (sum, count) pairs are all-gathered rather than all-reduced."""
        from rlstack.rewards import extras_sums, merge_extras_sums

        if self.scorer.custom_fn is None:
            return {}
        local = extras_sums(self._reward_results)
        g = self.groups
        parts = gather_objects([local], g.dp, g.dims.dp) if over_dp else [local]
        return merge_extras_sums(parts)


def _fill_from_parts(rollout: Rollout, gens: list, parts: list) -> None:
    """Copy each streamed part's per-row forwards into the whole batch's rows (`gens` order).

    A part's tensors are [b, S_part] with S_part <= S: columns past S_part are padding (zero).
    """
    row_of = {id(x): r for r, x in enumerate(gens)}
    for name in ("old_logprob", "ref_logprob", "old_values"):
        if not parts or getattr(parts[0][2], name) is None:
            continue
        like = getattr(parts[0][2], name)
        full = torch.zeros(rollout.tokens.shape, dtype=like.dtype, device=like.device)  # [B', S]
        for mine, _, part in parts:
            values = getattr(part, name)  # [b, S_part]
            for k, x in enumerate(mine):
                full[row_of[id(x)], : values.shape[1]] = values[k]
        setattr(rollout, name, full)
