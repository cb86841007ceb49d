"""Construction of a run's parts, apart from the classes that run them.

`build_parts(cfg, groups, placement)` assembles what a `rlstack.trainer.Trainer` runs on (data,
scorer, Megatron roles, reward model, rollout engine and weight sync, or the split-placement
client); `step_parts` turns those into the step's parts (phases, scoring, score forwards, rollout
source). A test hands the trainer its own `TrainerParts` (a fake engine, no weight sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_bridge.parallel import ParallelGroups
from rlstack.config import ExperimentConfig, adv_estimator
from rlstack.workers.actor import Actor
from rlstack.workers.critic import Critic
from rlstack.workers.megatron_role import MegatronRole, OptimSettings, lora_spec, warmup_steps

if TYPE_CHECKING:
    from megatron_bridge.reshard import SplitWeightSync, WeightSync
    from rlstack.algorithms.kl import KLController
    from rlstack.data.dataset import PromptDataset
    from rlstack.data.sampler import PromptSampler
    from rlstack.placement import RolloutClient
    from rlstack.rewards import RewardScorer
    from rlstack.rollout.base import RolloutEngine
    from rlstack.step import RolloutSource
    from rlstack.step.phases import Phases
    from rlstack.step.scoring import ScoreForwards, Scoring
    from rlstack.workers.reward_model import RewardModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainerParts:
    """Everything a Trainer runs on, built by `build_parts` (or by a test)."""

    hf_dir: str
    tokenizer: Any  # a transformers tokenizer
    train_set: PromptDataset
    val_set: Optional[PromptDataset]
    sampler: PromptSampler
    scorer: RewardScorer
    actor: Actor
    ref: Optional[MegatronRole]
    critic: Optional[Critic]
    engine: Optional[RolloutEngine]  # None with split placement (the engines live on the rollout ranks)
    weight_sync: Optional[WeightSync | SplitWeightSync]  # anything whose sync() returns a SyncStats
    kl_ctrl: KLController
    reward_model: Optional[RewardModel] = None  # None: reward_model.path empty
    split: Optional[RolloutClient] = None  # split placement, else None


@dataclass
class StepParts:
    """The parts of the step a Trainer drives (`step_parts`)."""

    phases: Phases
    scoring: Scoring
    forwards: ScoreForwards
    source: RolloutSource


def build_parts(cfg: ExperimentConfig, groups: ParallelGroups, placement=None) -> TrainerParts:
    """Data, scorer, roles, rollout engine and weight sync for `cfg`, on `groups`.

    `placement` (megatron_bridge.parallel.SplitPlacement): split placement; the engines live on the
    rollout ranks, reached through a RolloutClient, and the weight sync sends to them.
    """
    from megatron_bridge.reshard import WeightSync
    from rlstack import stages
    from rlstack.algorithms import build_kl_controller
    from rlstack.rewards import RewardScorer
    from rlstack.rollout.base import build_engine
    from rlstack.workers.reward_model import build_reward_model

    data = stages.build_data(cfg, groups)
    scorer = RewardScorer.from_config(cfg.data)
    if not cfg.reward_model.path:  # with a reward model, sources without a rule get the RM's score alone
        scorer.check_sources(data.train_set.data_sources())
        if data.val_set is not None:
            scorer.check_sources(data.val_set.data_sources())
    actor, ref, critic = build_roles(cfg, groups, data.hf_dir)
    reward_model = build_reward_model(cfg, groups, data.tokenizer, DTYPES[cfg.model.dtype])
    split = None
    if placement is not None:
        engine, (weight_sync, split) = None, _split_parts(cfg, groups, placement, actor)
    else:
        tok = data.tokenizer
        from rlstack.rollout.lora_sync import vllm_lora_rank

        lora_rank = vllm_lora_rank(cfg)  # > 0: vLLM starts with its LoRA path (rollout.lora_sync)
        engine = build_engine(
            cfg.rollout, data.hf_dir, groups, tok.eos_token_id, tok.pad_token_id, lora_rank, cfg.model.dtype
        )
        if cfg.rollout.engine == "hf" and groups.device.type == "cpu":
            from rlstack.rollout.host_cores import HostCores

            engine.cores = HostCores.open(groups.world, groups.rank, groups.device)  # collective: every rank calls it
        weight_sync = WeightSync(
            actor.role.module,
            actor.role.args,
            groups,
            engine,
            bucket_mb=cfg.rollout.sync_bucket_mb,
            zero_copy=cfg.rollout.zero_copy,
        )
        if actor.role.lora is not None:  # the frozen base once, then the adapters only
            from rlstack.rollout.lora_sync import LoraWeightSync, MergedLoraSync, lora_sync_mode

            mode = lora_sync_mode(cfg.rollout)  # rollout.lora_sync
            if cfg.rollout.engine == "hf" or mode == "adapters":
                merged = mode == "merged"  # hf: merged weights for the adapted linears only
                weight_sync = LoraWeightSync(weight_sync, actor.role, groups, engine, merged=merged)
            else:  # vLLM, merged: the whole model through its loader
                weight_sync = MergedLoraSync(weight_sync, actor.role, groups)
    a = cfg.algorithm
    kl_ctrl = build_kl_controller(a.kl_ctrl, a.kl_coef, a.kl_target, a.kl_horizon)
    return TrainerParts(
        data.hf_dir,
        data.tokenizer,
        data.train_set,
        data.val_set,
        data.sampler,
        scorer,
        actor,
        ref,
        critic,
        engine,
        weight_sync,
        kl_ctrl,
        reward_model,
        split,
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
    seed = cfg.trainer.seed
    actor_lora = lora_spec(cfg.model.lora, seed)  # None: full fine-tuning
    actor = Actor(
        MegatronRole(
            hf_dir, groups, dtype, optim=actor_optim, recompute=recompute, fused_output=fused, lora=actor_lora
        ),
        a,
        temperature=cfg.rollout.temperature,
    )
    # With LoRA the reference is free: the actor with its adapters off (ScoreForwards), no second copy.
    wants_ref = (a.use_kl_loss or a.use_kl_in_reward) and actor_lora is None
    ref = MegatronRole(hf_dir, groups, dtype, fused_output=fused) if wants_ref else None
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
                value_head_seed=seed,
                lora=lora_spec(cfg.critic.lora, seed),
            ),
            a,
        )
    shared = []
    for role in (actor.role, ref, critic.role if critic else None):
        if role is not None:
            role.max_tokens_per_micro_batch = a.max_tokens_per_micro_batch
            role.remove_padding = cfg.model.remove_padding
            shared.append(role.share_prefixes(cfg.model.prefix_sharing))
    if cfg.model.prefix_sharing and cfg.model.remove_padding and cfg.rollout.n > 1 and groups.rank == 0:
        import logging

        log = logging.getLogger("rlstack")
        if all(shared):
            log.info("update: each prompt runs once for its %d samples (model.prefix_sharing)", cfg.rollout.n)
        else:  # the rows still train, each with its own prompt
            log.info("model.prefix_sharing: off here (needs the SDPA core attention without Transformer Engine, pp=1)")
    return actor, ref, critic


def step_parts(cfg: ExperimentConfig, groups: ParallelGroups, parts: TrainerParts) -> StepParts:
    """Phases, scoring, score forwards and the rollout source (split placement: parts.split set) of `parts`."""
    from rlstack.step.colocated import ColocatedSource
    from rlstack.step.phases import Phases
    from rlstack.step.scoring import ScoreForwards, Scoring
    from rlstack.step.split import SplitSource
    from rlstack.workers.offload import Offloader

    critic_role = parts.critic.role if parts.critic is not None else None
    # offload: states to host in the phases that do not use them
    phases = Phases(Offloader.from_config(cfg, parts.actor.role, critic_role, parts.ref, parts.engine))
    overlong = (cfg.reward.overlong_buffer, cfg.rollout.max_new_tokens)  # DAPO's overlong shaping (training)
    scoring = Scoring(parts.scorer, parts.tokenizer, parts.reward_model, groups, overlong)
    mbs, temperature = cfg.algorithm.micro_batch_size, cfg.rollout.temperature
    forwards = ScoreForwards(parts.actor, parts.ref, parts.critic, mbs, temperature, phases.offload)
    a = cfg.algorithm
    forwards.ref_from_actor = parts.actor.role.lora is not None and (a.use_kl_loss or a.use_kl_in_reward)
    forwards.sum_pi_squared = adv_estimator(cfg) == "optimal_token_baseline"
    data = (parts.train_set, parts.sampler, parts.tokenizer, scoring)
    if parts.split is not None:
        source = SplitSource(cfg, groups, parts.split, *data, forwards)
    else:
        source = ColocatedSource(cfg, groups, parts.engine, parts.weight_sync, parts.actor, *data, phases)
    if cfg.algorithm.filter_groups.enable:  # DAPO dynamic sampling: more rounds until enough groups vary
        from rlstack.step.dynamic import DynamicSamplingSource  # split: staleness 0 only (preflight)

        source = DynamicSamplingSource(source, cfg)
    if adv_estimator(cfg) == "remax":  # one greedy generation per prompt: ReMax's baseline
        from rlstack.step.remax import RemaxBaselineSource

        source = RemaxBaselineSource(source, groups, scoring)
    return StepParts(phases, scoring, forwards, source)
