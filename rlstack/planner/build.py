"""An experiment config -> the per-GPU plan of its most loaded pipeline stage, and what would fit."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional

from rlstack.errors import UserError
from rlstack.planner import memory as m
from rlstack.planner.items import GIB, KV_HEADROOM, PHASES, Item, KvReport, Setting, peak_of, phase_total, stage_items
from rlstack.planner.shapes import hf_config_for, model_args, shape_of


@dataclass
class Plan:
    config_path: str
    model_source: str
    arch: str
    num_params: int
    tp: int
    pp: int
    dp: int
    world_size: int
    device: str  # gpu | cpu
    dtype: str
    budget_bytes: int
    stage: int  # the most loaded pipeline stage, which the plan describes
    items: list[Item]
    kv: KvReport
    recompute: bool
    other_recompute_peak: int  # the peak with model.gradient_checkpointing flipped
    suggestion: list[str] = field(default_factory=list)  # overrides that would fit (when it does not)
    suggestion_peak: int = 0
    offload_peak: int = 0  # the peak with every offload switch on (offload.*, rollout.free_cache_during_update)
    notes: list[str] = field(default_factory=list)

    def total(self, phase: str) -> int:
        return phase_total(self.items, phase)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.total)

    @property
    def peak_bytes(self) -> int:
        return self.total(self.peak_phase)

    def allocator_peak(self) -> int:
        """The peak torch's allocator sees (`torch.cuda.max_memory_allocated`): no CUDA context, NCCL
        buffers or fragmentation allowance, which live outside its count."""
        counted = [i for i in self.items if i.role != "runtime" or i.name.startswith("attention scores")]
        return peak_of(counted)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes and self.kv.available_bytes >= 0


# ----------------------------------------------------------------------------- entry points


def plan_for_config(
    cfg,
    world_size: int,
    gpu_memory_gib: float,
    device: str = "gpu",
    model_config_file: Optional[str] = None,
    config_path: str = "",
    fused_attention: Optional[bool] = None,
    suggest: bool = True,
) -> Plan:
    """The memory plan of `cfg` on `world_size` devices of `gpu_memory_gib` GiB each."""
    if device not in ("gpu", "cpu"):
        raise UserError(f"--device {device!r}: use gpu or cpu")
    if gpu_memory_gib <= 0:
        raise UserError(f"--gpu-memory-gib {gpu_memory_gib}: give the memory of one GPU in GiB, e.g. 80")
    hf, source = hf_config_for(cfg.model, model_config_file)
    args = model_args(hf, source)
    dims = _dims(cfg, world_size, args)
    shape = shape_of(args, dims.tp, dims.ep)
    if fused_attention is None:  # SDPA core attention (megatron_bridge/sdpa_attention.py) or TE's
        fused_attention = True
    setting = derive_setting(cfg, dims, args.max_position_embeddings, fused_attention, device)
    budget = int(gpu_memory_gib * GIB)
    stage, items, kv = _most_loaded_stage(cfg, dims, shape, setting, device, budget)
    plan = Plan(
        config_path=config_path,
        model_source=source,
        arch=args.arch,
        num_params=m.total_params(shape),
        tp=dims.tp,
        pp=dims.pp,
        dp=dims.dp,
        world_size=dims.world_size,
        device=device,
        dtype=cfg.model.dtype,
        budget_bytes=budget,
        stage=stage,
        items=items,
        kv=kv,
        recompute=cfg.model.gradient_checkpointing,
        other_recompute_peak=0,
    )
    flipped = _with(cfg, {"model.gradient_checkpointing": not cfg.model.gradient_checkpointing})
    plan.other_recompute_peak = _peak(flipped, dims, shape, args, device, budget, fused_attention)
    plan.offload_peak = _peak(_with(cfg, offload_changes(cfg)), dims, shape, args, device, budget, fused_attention)
    plan.notes = _notes(cfg, plan)
    if suggest and not plan.fits:
        plan.suggestion, plan.suggestion_peak = suggest_fix(cfg, dims, shape, args, device, budget, fused_attention)
    return plan


def _dims(cfg, world_size: int, args):
    from megatron_bridge.parallel import ParallelDims

    p = cfg.parallel
    try:
        dims = ParallelDims.resolve(p.tp, p.pp, p.dp, world_size, ep=p.ep)
        dims.check_model(args)
    except ValueError as e:
        raise UserError(str(e))
    if cfg.rollout.engine == "vllm" and world_size % cfg.rollout.tp:
        raise UserError(
            f"rollout.tp={cfg.rollout.tp} does not divide the world size {world_size}: "
            f"choose rollout.tp from the divisors of {world_size}"
        )
    return dims


def derive_setting(cfg, dims, max_position_embeddings: int, fused_attention: bool, device: str = "gpu") -> Setting:
    a, r, d = cfg.algorithm, cfg.rollout, cfg.data
    param_bytes = 4 if cfg.model.dtype == "float32" else 2
    seq_len = d.max_prompt_length + r.max_new_tokens
    local_seqs = math.ceil(d.train_batch_size / dims.dp) * r.n
    local_mini = local_seqs if a.mini_batch_size <= 0 else max(a.micro_batch_size, a.mini_batch_size // dims.dp)
    num_micro = max(1, math.ceil(local_mini / a.micro_batch_size))
    replicas = dims.world_size // (r.tp if r.engine == "vllm" else 1)
    per_replica = math.ceil(d.train_batch_size / replicas) * r.n
    at_once = min(r.max_num_seqs, per_replica) if r.engine == "vllm" else min(r.micro_batch_size, per_replica)
    return Setting(
        param_bytes=param_bytes,
        mixed_precision=param_bytes == 2,
        seq_len=seq_len,
        train_mb=m.Tokens(_train_rows(a, local_seqs, seq_len), seq_len),
        in_flight=min(num_micro, dims.pp),
        rollout_seqs=max(1, at_once),
        max_model_len=r.max_model_len or min(max_position_embeddings, seq_len),
        fused_attention=fused_attention,
        fused_output=getattr(cfg.model, "fused_output_logprobs", False),
        lean_norm=device == "cpu" and param_bytes == 4,
        has_critic=a.name == "ppo",
        has_reference=a.use_kl_loss or a.use_kl_in_reward,
        # optimal_token_baseline runs the old-log-prob forward on policy too (its sum_pi_squared)
        needs_old_logprob=not (a.ppo_epochs == 1 and a.mini_batch_size <= 0 and not a.use_kl_in_reward)
        or a.adv_estimator == "optimal_token_baseline",
    )


def _train_rows(a, local_seqs: int, seq_len: int) -> int:
    """Rows of the largest training micro-batch at the longest length: micro_batch_size, or with a
    token budget (algorithm.max_tokens_per_micro_batch) enough full-length rows to cover it (its
    token count bounds the activations whatever the rows' lengths)."""
    rows = math.ceil(a.max_tokens_per_micro_batch / seq_len) if a.max_tokens_per_micro_batch else a.micro_batch_size
    return max(1, min(rows, local_seqs))


def _most_loaded_stage(cfg, dims, shape, setting, device, budget):
    """Plan the first and the last pipeline stage; keep the one with the higher peak."""
    best = None
    for stage in sorted({0, dims.pp - 1}):
        items, kv = stage_items(cfg, dims, shape, setting, device, budget, stage)
        peak = peak_of(items)
        if best is None or peak > best[0]:
            best = (peak, stage, items, kv)
    return best[1], best[2], best[3]


def _peak(cfg, dims, shape, args, device, budget, fused_attention) -> int:
    setting = derive_setting(cfg, dims, args.max_position_embeddings, fused_attention, device)
    _, items, _ = _most_loaded_stage(cfg, dims, shape, setting, device, budget)
    return peak_of(items)


# ----------------------------------------------------------------------------- what would fit


def candidate_changes(cfg, plan_kv: KvReport, dims, device: str = "gpu") -> list[dict]:
    """Changes in order of cost: free ones first (vLLM share, distributed optimizer), then time."""
    out = []
    r = cfg.rollout
    if plan_kv.recommended_share is not None and plan_kv.recommended_share < r.gpu_memory_utilization:
        out.append({"rollout.gpu_memory_utilization": plan_kv.recommended_share})
    if dims.dp > 1 and not cfg.parallel.use_distributed_optimizer:
        out.append({"parallel.use_distributed_optimizer": True})
    modules = list(cfg.model.recompute_modules)
    if device == "cpu" and not cfg.model.gradient_checkpointing and "layernorm" not in modules:
        # the norms' outputs rebuilt in backward: two norms a layer, next to no time (not on GPUs, where
        # Transformer Engine's layer spec fuses the norms into the linears and this rebuilds nothing)
        modules = modules + ["layernorm"]
        out.append({"model.recompute_modules": modules})
    if not cfg.model.gradient_checkpointing and not {"mlp", "mlp_act"} & set(modules):
        # the SwiGLU product rebuilt from fc1's output: one SwiGLU a layer (SmolLM2 on CPU: within noise)
        modules = modules + ["mlp_act"]
        out.append({"model.recompute_modules": modules})
    mbs = cfg.algorithm.micro_batch_size
    while mbs > 1:
        mbs //= 2
        out.append({"algorithm.micro_batch_size": mbs})
    if not cfg.model.gradient_checkpointing:
        out.append({"model.gradient_checkpointing": True, "model.recompute_modules": []})  # full takes all
    if device == "gpu":  # offload trades host<->GPU copies each step for memory; on CPU it saves nothing
        out += [{key: True} for key in offload_changes(cfg)]
    return out


def offload_changes(cfg) -> dict:
    """Every offload switch on (rlstack/workers/offload.py); the KV cache one with vLLM only."""
    keys = ["offload.optimizer", "offload.grads", "offload.reference", "offload.params"]
    if cfg.rollout.engine == "vllm":
        keys.append("rollout.free_cache_during_update")
    return {key: True for key in keys}


def suggest_fix(cfg, dims, shape, args, device, budget, fused_attention) -> tuple[list[str], int]:
    """The shortest prefix of `candidate_changes` that fits, as key=value overrides ([] if none)."""
    setting = derive_setting(cfg, dims, args.max_position_embeddings, fused_attention, device)
    _, _, kv = _most_loaded_stage(cfg, dims, shape, setting, device, budget)
    applied, current = {}, cfg
    for change in candidate_changes(cfg, kv, dims, device):
        # A smaller micro-batch replaces the previous one; recompute is tried with the smallest.
        applied.update(change)
        current = _with(cfg, applied)
        peak = _peak(current, dims, shape, args, device, budget, fused_attention)
        if peak <= budget:
            return [f"{k}={_fmt(v)}" for k, v in applied.items()], peak
    return [], 0


def _fmt(value) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _with(cfg, overrides: dict):
    new = copy.deepcopy(cfg)
    for key, value in overrides.items():
        node = new
        *parents, last = key.split(".")
        for part in parents:
            node = getattr(node, part)
        setattr(node, last, value)
    return new


def _notes(cfg, plan: Plan) -> list[str]:
    notes = []
    lora = getattr(getattr(cfg.model, "lora", None), "rank", 0)
    if lora > 0 and (cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        notes.append(
            f"LoRA (rank {lora}): the reference is the actor with its adapters off, no second copy of the weights"
        )
    kv = plan.kv
    if kv.recommended_share is not None:
        if kv.available_bytes < 0:
            notes.append(
                f"the vLLM share {cfg.rollout.gpu_memory_utilization:g} does not hold its own weights: "
                f"set rollout.gpu_memory_utilization={kv.recommended_share}"
            )
        elif kv.available_bytes < kv.need_bytes:
            notes.append(
                f"the vLLM share leaves {kv.available_bytes / GIB:.1f} GiB for a {kv.need_bytes / GIB:.1f} GiB "
                f"KV need: vLLM will run fewer sequences at once; rollout.gpu_memory_utilization="
                f"{kv.recommended_share} holds them all"
            )
        elif kv.available_bytes > 2 * KV_HEADROOM * kv.need_bytes:
            notes.append(
                f"the vLLM share leaves {kv.available_bytes / kv.need_bytes:.1f}x the KV need: "
                f"rollout.gpu_memory_utilization={kv.recommended_share} is enough"
            )
    return notes
