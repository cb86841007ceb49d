"""verl's config keys and what rlstack calls them: the tables `python -m rlstack.from_verl`
translates with, and the one look-up config.py's "unknown key" hint needs (`rlstack_name_for`).

Pure data with no rlstack import, so config.py can use it without importing the translator (which
imports config.py). Written against verl 0.9.1's `verl/trainer/config/_generated_ppo_trainer.yaml`.
"""

from __future__ import annotations

from typing import Any, Optional

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
    # DAPO's dynamic sampling (the metric is translated below)
    "algorithm.filter_groups.enable": "algorithm.filter_groups.enable",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.filter_groups.max_num_gen_batches",
    "algorithm.gdpo_reward_keys": "algorithm.gdpo_reward_keys",
    "algorithm.gdpo_reward_weights": "algorithm.gdpo_reward_weights",
    ACTOR + "tau_pos": "algorithm.policy_loss_params.tau_pos",
    ACTOR + "tau_neg": "algorithm.policy_loss_params.tau_neg",
}
for _param in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta"):
    DIRECT[ACTOR + "policy_loss." + _param] = "algorithm.policy_loss_params." + _param
# DAPO's overlong buffer, under the names verl's versions and recipes have used
OVERLONG_PREFIXES = (
    "reward_model.overlong_buffer.",
    "custom_reward_function.overlong_buffer.",
    "reward_model.reward_kwargs.overlong_buffer_cfg.",
    "reward.reward_kwargs.overlong_buffer_cfg.",
)
for _prefix in OVERLONG_PREFIXES:
    for _leaf in ("enable", "len", "penalty_factor"):
        DIRECT[_prefix + _leaf] = "reward.overlong_buffer." + _leaf
for _prefix in ("", "reward."):  # verl 0.9.1 reads reward.custom_reward_function; older: top level
    DIRECT[_prefix + "custom_reward_function.path"] = "data.reward_fn_file"
    DIRECT[_prefix + "custom_reward_function.name"] = "data.reward_fn_name"
    DIRECT[_prefix + "custom_reward_function.reward_kwargs"] = "data.reward_kwargs"

# rlstack keys that several verl keys translate onto on purpose: verl's old and new names for one
# setting, the critic's copy of a setting rlstack keeps once for both roles, verl's combined
# clip_ratio, every pass's micro-batch size. Any other two verl keys landing on one rlstack key is
# a mapping error (tests/unit/test_from_verl_keys.py gives each verl key alone and checks).
SHARED_TARGETS: dict[str, frozenset[str]] = {
    "rollout.max_new_tokens": frozenset({"data.max_response_length", ROLLOUT + "response_length"}),
    "model.gradient_checkpointing": frozenset(
        {MODEL + "enable_gradient_checkpointing", "critic.model.enable_gradient_checkpointing"}
    ),
    "algorithm.clip_grad": frozenset({ACTOR + "optim.clip_grad", ACTOR + "grad_clip", "critic.grad_clip"}),
    "algorithm.clip_ratio_low": frozenset({ACTOR + "clip_ratio", ACTOR + "clip_ratio_low"}),
    "algorithm.clip_ratio_high": frozenset({ACTOR + "clip_ratio", ACTOR + "clip_ratio_high"}),
    "algorithm.weight_decay": frozenset({ACTOR + "optim.weight_decay", "critic.optim.weight_decay"}),
    "algorithm.lr_warmup_ratio": frozenset(
        {ACTOR + "optim.lr_warmup_steps_ratio", "critic.optim.lr_warmup_steps_ratio"}
    ),
    "algorithm.lr_schedule": frozenset({ACTOR + "optim.lr_scheduler_type", ACTOR + "optim.warmup_style"}),
    "algorithm.ppo_epochs": frozenset({ACTOR + "ppo_epochs", "critic.ppo_epochs"}),
    "algorithm.loss_agg_mode": frozenset(
        {ACTOR + "loss_agg_mode", "critic.loss_agg_mode", ACTOR + "use_token_level_loss"}
    ),
    "algorithm.micro_batch_size": frozenset(
        {
            ACTOR + "ppo_micro_batch_size",
            ACTOR + "ppo_micro_batch_size_per_gpu",
            "critic.ppo_micro_batch_size_per_gpu",
            ROLLOUT + "log_prob_micro_batch_size_per_gpu",
            REF + "log_prob_micro_batch_size_per_gpu",
        }
    ),
    "data.reward_fn_batched": frozenset({"reward.reward_manager.name", "reward_model.reward_manager"}),
    "algorithm.name": frozenset({"algorithm.adv_estimator", "critic.model.path"}),  # ppo when a critic is named
    # LoRA: verl's FSDP spelling (model.lora_rank) and its megatron one (model.lora.rank)
    **{
        f"{target}.{leaf}": frozenset({f"{prefix}{fsdp}", f"{prefix}lora.{leaf}"})
        for prefix, target in (("actor_rollout_ref.model.", "model.lora"), ("critic.model.", "critic.lora"))
        for leaf, fsdp in (("rank", "lora_rank"),)  # alpha and targets count only beside a rank
    },
    **{
        target: frozenset({key, "reward." + key})
        for key, target in DIRECT.items()
        if key.startswith("custom_reward_function.") and not target.startswith("reward.overlong_buffer.")
    },
    # the overlong buffer under every spelling verl's versions and recipes used (OVERLONG_PREFIXES)
    **{
        target: frozenset(key for key, t in DIRECT.items() if t == target)
        for target in set(DIRECT.values())
        if target.startswith("reward.overlong_buffer.")
    },
}

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
    MODEL + "lora_rank": "model.lora.rank",
    MODEL + "lora_alpha": "model.lora.alpha",
    MODEL
    + "target_modules": "model.lora.target_modules (megatron names: linear_qkv, linear_proj, linear_fc1, linear_fc2)",
    MODEL + "lora.rank": "model.lora.rank",
    MODEL + "lora.alpha": "model.lora.alpha",
    MODEL + "lora.dropout": "model.lora.dropout",
    MODEL + "lora.target_modules": "model.lora.target_modules",
    MODEL + "lora.lora_A_init_method": "model.lora.init",
    "critic.model.lora_rank": "critic.lora.rank",
    "critic.model.lora_alpha": "critic.lora.alpha",
    "critic.model.target_modules": "critic.lora.target_modules",
    "critic.model.lora.rank": "critic.lora.rank",
    "critic.model.lora.alpha": "critic.lora.alpha",
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
    "algorithm.filter_groups.metric": "algorithm.filter_groups.metric",
    "reward_model.reward_kwargs.max_resp_len": "rollout.max_new_tokens (the overlong buffer's maximum)",
    "reward.reward_kwargs.max_resp_len": "rollout.max_new_tokens (the overlong buffer's maximum)",
    ACTOR + "use_token_level_loss": "algorithm.loss_agg_mode=token-mean",
    "data.gen_batch_size": "algorithm.filter_groups (prompts per generation round: not a setting yet)",
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
    ROLLOUT + "load_format": "weights are synced in place by megatron_bridge",
    ROLLOUT + "enable_chunked_prefill": "vLLM scheduling detail",
    ROLLOUT + "enable_prefix_caching": (
        "always on: vLLM's own prefix cache (32-token KV blocks on CPU); the hf engine keeps agent turns' KV "
        "(rollout.multi_turn.kv_cache_mb)"
    ),
    ROLLOUT + "prompt_length": "set from data.max_prompt_length",
    ROLLOUT + "mode": "rlstack's rollout is colocated and synchronous",
    ROLLOUT + "dtype": "set by model.dtype",
    ROLLOUT + "val_kwargs.": "rlstack validates greedily (temperature 0, one sample)",
    ACTOR + "shuffle": "mini-batches are taken in order",
    ACTOR + "calculate_sum_pi_squared": (
        "rlstack's old-log-prob forward computes sum_pi_squared whenever algorithm.adv_estimator=optimal_token_baseline"
    ),
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
    ROLLOUT
    + "multi_turn.enable": "rlstack runs multi-turn whenever rollout.agent_loop (or a row's agent_name) says so",
    ROLLOUT + "multi_turn.use_inference_chat_template": "rlstack trains on the ids the policy generated",
    ROLLOUT + "multi_turn.tokenization_sanity_check_mode": "inserted turns are rendered as ids once (docs/agents.md)",
    ROLLOUT + "agent.num_workers": "one asyncio driver per rank runs every trajectory",
    "ray_kwargs.": "no Ray in rlstack",
    "ray_init.": "no Ray in rlstack",
    "global_profiler.": "see --profile",
    "algorithm.filter_groups.max_inflight_gen_batches": "verl's scheduling of generation rounds",
    **{p + "log": "rlstack always logs reward/overlong_penalty and reward/overlong_frac" for p in OVERLONG_PREFIXES},
}

# verl defaults that differ from rlstack's: written out so the run keeps verl's meaning.
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    ACTOR + "use_kl_loss": False,
    ACTOR + "optim.weight_decay": 0.01,
    ACTOR + "ppo_mini_batch_size": 256,
    ROLLOUT + "n": 1,
    "algorithm.adv_estimator": "gae",
    "critic.cliprange_value": 0.5,
    "trainer.val_before_train": True,
    "trainer.logger": ["console", "wandb"],
    "trainer.total_epochs": 30,
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 1,
}

ESTIMATORS = {
    "gae": "gae",
    "grpo": "grpo",
    "grpo_vectorized": "grpo",
    "rloo": "rloo",
    "rloo_vectorized": "rloo",
    "reinforce_plus_plus": "reinforce_plus_plus",
    "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
    "opo": "opo",
    "grpo_passk": "grpo_passk",
    "gpg": "gpg",
    "gdpo": "gdpo",
    "remax": "remax",
    "optimal_token_baseline": "optimal_token_baseline",
}
# Estimators rlstack registers but whose inputs its trainer does not produce yet (preflight refuses them).
# None today: optimal_token_baseline's sum_pi_squared comes from the old-log-prob forward.
ESTIMATORS_NOT_RUNNABLE: dict[str, str] = {}
FILTER_METRICS = {"acc": "acc", "score": "score", "seq_reward": "seq_reward", "reward": "seq_reward"}
TRACKERS = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "file": "jsonl"}
ENGINES = {"vllm": "vllm", "hf": "hf"}
SCHEDULES = {"constant": "constant", "cosine": "cosine"}


MULTI_TURN = ROLLOUT + "multi_turn."
# verl's multi_turn keys -> rollout.multi_turn.*; verl's null (no path, no limit) -> "" / 0
AGENT_KEYS: dict[str, tuple[str, Any]] = {
    **{
        MULTI_TURN + k: ("rollout.multi_turn." + k, null)
        for k, null in (
            ("tool_config_path", ""),
            ("function_tool_path", ""),
            ("format", "hermes"),
            ("max_assistant_turns", 0),
            ("max_user_turns", 0),
            ("max_parallel_calls", 1),
            ("max_tool_response_length", 256),
            ("tool_response_truncate_side", "middle"),
        )
    },
    "trainer.rollout_data_dir": ("trainer.rollout_data_dir", ""),
}
AGENT_LOOPS = {"single_turn_agent": "single_turn", "tool_agent": "tool_agent"}  # verl's registered names


def _ignored_reason(key: str) -> Optional[str]:
    for prefix, reason in IGNORED_PREFIXES.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return reason
    return None


# ----------------------------------------------------------------------------- hints


def rlstack_name_for(verl_key: str) -> Optional[str]:
    """rlstack's key for a verl key (for config's "did you mean"), or None when verl has no such key."""
    if verl_key in DIRECT:
        return DIRECT[verl_key]
    if verl_key in AGENT_KEYS:
        return AGENT_KEYS[verl_key][0]
    if verl_key in SPECIAL:
        return SPECIAL[verl_key]
    reason = _ignored_reason(verl_key)
    return f"nothing: {reason}" if reason else None
