"""verl's config keys and what rlstack calls them: the tables `python -m rlstack.from_verl`
translates with, and the one look-up config.py's "unknown key" hint needs (`rlstack_name_for`).

Pure data with no rlstack import, so config.py can use it without importing the translator (which
imports config.py). Written against verl 0.9.1's `verl/trainer/config/_generated_ppo_trainer.yaml`.
"""

from __future__ import annotations

from typing import Optional

ACTOR = "actor_rollout_ref.actor."
ROLLOUT = "actor_rollout_ref.rollout."
REF = "actor_rollout_ref.ref."
MODEL = "actor_rollout_ref.model."

# verl key -> rlstack key, for settings with the same meaning and unit.
DIRECT: dict[str, str] = {
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "data.train_batch_size": "data.train_batch_size",
    "data.val_batch_size": "data.val_batch_size",
    "data.max_prompt_length": "data.max_prompt_length",
    "data.max_response_length": "rollout.max_new_tokens",
    "data.prompt_key": "data.prompt_key",
    "data.shuffle": "data.shuffle",
    "data.seed": "data.seed",
    MODEL + "path": "model.path",
    MODEL + "enable_gradient_checkpointing": "model.gradient_checkpointing",
    MODEL + "use_fused_kernels": "model.fused_output_logprobs",
    MODEL + "use_remove_padding": "model.remove_padding",
    "trainer.balance_batch": "trainer.balance_batch",
    ACTOR + "optim.lr": "algorithm.actor_lr",
    ACTOR + "optim.weight_decay": "algorithm.weight_decay",
    ACTOR + "optim.clip_grad": "algorithm.clip_grad",
    ACTOR + "grad_clip": "algorithm.clip_grad",
    ACTOR + "optim.lr_warmup_steps": "algorithm.actor_lr_warmup_steps",
    ACTOR + "optim.lr_warmup_steps_ratio": "algorithm.lr_warmup_ratio",
    ACTOR + "optim.min_lr_ratio": "algorithm.min_lr_ratio",
    ACTOR + "clip_ratio_low": "algorithm.clip_ratio_low",
    ACTOR + "clip_ratio_high": "algorithm.clip_ratio_high",
    ACTOR + "clip_ratio_c": "algorithm.clip_ratio_c",
    ACTOR + "entropy_coeff": "algorithm.entropy_coeff",
    ACTOR + "use_kl_loss": "algorithm.use_kl_loss",
    ACTOR + "kl_loss_coef": "algorithm.kl_loss_coef",
    ACTOR + "kl_loss_type": "algorithm.kl_loss_type",
    ACTOR + "ppo_epochs": "algorithm.ppo_epochs",
    ACTOR + "loss_agg_mode": "algorithm.loss_agg_mode",
    ACTOR + "loss_scale_factor": "algorithm.loss_scale_factor",
    ACTOR + "policy_loss.loss_mode": "algorithm.policy_loss",
    ACTOR + "megatron.tensor_model_parallel_size": "parallel.tp",
    ACTOR + "megatron.pipeline_model_parallel_size": "parallel.pp",
    ACTOR + "megatron.use_distributed_optimizer": "parallel.use_distributed_optimizer",
    ROLLOUT + "n": "rollout.n",
    ROLLOUT + "temperature": "rollout.temperature",
    ROLLOUT + "top_p": "rollout.top_p",
    ROLLOUT + "top_k": "rollout.top_k",
    ROLLOUT + "response_length": "rollout.max_new_tokens",
    ROLLOUT + "tensor_model_parallel_size": "rollout.tp",
    ROLLOUT + "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    ROLLOUT + "max_num_seqs": "rollout.max_num_seqs",
    ROLLOUT + "max_model_len": "rollout.max_model_len",
    ROLLOUT + "enforce_eager": "rollout.enforce_eager",
    ROLLOUT + "seed": "rollout.seed",
    "critic.optim.lr": "algorithm.critic_lr",
    "critic.optim.lr_warmup_steps": "algorithm.critic_lr_warmup_steps",
    "critic.cliprange_value": "algorithm.value_clip",
    "critic.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "algorithm.gamma": "algorithm.gamma",
    "algorithm.lam": "algorithm.lam",
    "algorithm.use_kl_in_reward": "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty": "algorithm.kl_penalty",
    "algorithm.kl_ctrl.type": "algorithm.kl_ctrl",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_horizon",
    "trainer.project_name": "logging.project",
    "trainer.experiment_name": "logging.run_name",
    "trainer.val_before_train": "trainer.val_before_train",
    "trainer.default_local_dir": "checkpoint.dir",
    "trainer.max_actor_ckpt_to_keep": "checkpoint.keep_last",
    "trainer.critic_warmup": "algorithm.critic_warmup_steps",
    "trainer.seed": "trainer.seed",
}
for _prefix in ("", "reward."):  # verl 0.9.1 reads reward.custom_reward_function; older: top level
    DIRECT[_prefix + "custom_reward_function.path"] = "data.reward_fn_file"
    DIRECT[_prefix + "custom_reward_function.name"] = "data.reward_fn_name"
    DIRECT[_prefix + "custom_reward_function.reward_kwargs"] = "data.reward_kwargs"

# verl keys translated by code below (units, several keys at once); their rlstack key for the hint.
SPECIAL: dict[str, str] = {
    ACTOR + "ppo_mini_batch_size": "algorithm.mini_batch_size (sequences: verl's prompts x rollout.n)",
    ACTOR + "ppo_micro_batch_size_per_gpu": "algorithm.micro_batch_size",
    ACTOR + "ppo_micro_batch_size": "algorithm.micro_batch_size (per rank: verl's global size / GPUs)",
    ACTOR + "clip_ratio": "algorithm.clip_ratio_low and algorithm.clip_ratio_high",
    ACTOR + "optim.lr_scheduler_type": "algorithm.lr_schedule",
    ACTOR + "optim.warmup_style": "algorithm.lr_schedule",
    "critic.model.path": "model.critic_path (and algorithm.name=ppo)",
    "critic.ppo_micro_batch_size_per_gpu": "algorithm.micro_batch_size",
    "critic.ppo_mini_batch_size": "algorithm.mini_batch_size",
    "critic.ppo_epochs": "algorithm.ppo_epochs",
    "critic.grad_clip": "algorithm.clip_grad",
    "critic.optim.clip_grad": "algorithm.clip_grad",
    "critic.optim.weight_decay": "algorithm.weight_decay",
    "critic.optim.lr_warmup_steps_ratio": "algorithm.lr_warmup_ratio",
    "critic.loss_agg_mode": "algorithm.loss_agg_mode",
    ROLLOUT + "name": "rollout.engine",
    ROLLOUT + "log_prob_micro_batch_size_per_gpu": "algorithm.micro_batch_size",
    REF + "log_prob_micro_batch_size_per_gpu": "algorithm.micro_batch_size",
    "algorithm.adv_estimator": "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.adv_estimator=drgrpo when false",
    "data.truncation": "data.truncation",
    "data.filter_overlong_prompts": "data.truncation=drop",
    "trainer.logger": "logging.trackers",
    "trainer.total_epochs": "trainer.total_steps (epochs x rows // data.train_batch_size)",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.test_freq": "trainer.val_every",
    "trainer.save_freq": "checkpoint.save_every",
    "trainer.resume_mode": "checkpoint.resume",
    "trainer.resume_from_path": "checkpoint.resume",
    "trainer.n_gpus_per_node": "the launch: torchrun --nproc_per_node",
    "trainer.nnodes": "the launch: torchrun --nnodes",
    "reward.reward_manager.name": "data.reward_fn_batched (batch)",
    "reward_model.reward_manager": "data.reward_fn_batched (batch)",
    "reward_model.enable": "reward_model.path (an HF *ForSequenceClassification dir, num_labels=1)",
}

# verl keys with no effect on what rlstack computes: accepted and listed, not translated.
IGNORED_PREFIXES: dict[str, str] = {
    ACTOR + "fsdp_config.": "FSDP setting; rlstack shards with megatron (parallel.*)",
    REF + "fsdp_config.": "FSDP setting; rlstack shards with megatron (parallel.*)",
    "critic.model.fsdp_config.": "FSDP setting; rlstack shards with megatron (parallel.*)",
    "critic.fsdp_config.": "FSDP setting; rlstack shards with megatron (parallel.*)",
    ACTOR + "strategy": "rlstack always trains with megatron-core",
    "critic.strategy": "rlstack always trains with megatron-core",
    MODEL + "trust_remote_code": "rlstack loads llama/qwen2 layouts through megatron_bridge",
    "critic.model.use_remove_padding": "the critic follows model.remove_padding (the actor's setting)",
    "critic.model.trust_remote_code": "rlstack loads llama/qwen2 layouts through megatron_bridge",
    "critic.model.tokenizer_path": "the critic uses the actor's tokenizer",
    ROLLOUT + "free_cache_engine": "rlstack's engine keeps its cache between steps",
    ROLLOUT + "load_format": "weights are synced in place by megatron_bridge",
    ROLLOUT + "enable_chunked_prefill": "vLLM scheduling detail",
    ROLLOUT + "prompt_length": "set from data.max_prompt_length",
    ROLLOUT + "mode": "rlstack's rollout is colocated and synchronous",
    ROLLOUT + "dtype": "set by model.dtype",
    ROLLOUT + "val_kwargs.": "rlstack validates greedily (temperature 0, one sample)",
    ACTOR + "shuffle": "mini-batches are taken in order",
    ACTOR + "ulysses_sequence_parallel_size": "no sequence parallelism in rlstack",
    ACTOR + "optim.total_training_steps": "taken from trainer.total_steps",
    "actor_rollout_ref.hybrid_engine": "rlstack is always colocated (hybrid)",
    "trainer.default_hdfs_dir": "no HDFS copy",
    "trainer.device": "the device follows parallel.backend",
    "trainer.log_val_generations": "not logged",
    "trainer.use_legacy_worker_impl": "verl implementation detail",
    "trainer.max_critic_ckpt_to_keep": "checkpoint.keep_last covers actor and critic",
    "trainer.del_local_ckpt_after_load": "checkpoints are kept",
    "data.return_raw_chat": "rlstack applies the chat template itself",
    "data.return_raw_input_ids": "rlstack applies the chat template itself",
    "data.reward_fn_key": "the scorer is chosen by data_source (or data.reward_scorer)",
    "data.dataloader_num_workers": "rows are loaded up front",
    "ray_kwargs.": "no Ray in rlstack",
    "ray_init.": "no Ray in rlstack",
    "global_profiler.": "see --profile",
}


def _ignored_reason(key: str) -> Optional[str]:
    for prefix, reason in IGNORED_PREFIXES.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return reason
    return None


def rlstack_name_for(verl_key: str) -> Optional[str]:
    """rlstack's key for a verl key (for config's "did you mean"), or None when verl has no such key."""
    if verl_key in DIRECT:
        return DIRECT[verl_key]
    if verl_key in SPECIAL:
        return SPECIAL[verl_key]
    reason = _ignored_reason(verl_key)
    return f"nothing: {reason}" if reason else None
