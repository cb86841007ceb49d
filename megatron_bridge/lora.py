"""LoRA adapters on megatron-core 0.16.1's tensor-parallel linears (local spec), any TP x PP layout.

`add_lora_(model, spec, tp_group, layer_offset)` freezes every base weight and gives each targeted
linear a `lora` submodule with `A` [r, in] and `B` [out, r]; the layer then computes
`W x + scale * B A dropout(x)` with `scale = alpha / r` (PEFT's `lora_alpha / r`). The adapters
are parameters of the GPTModel, so megatron DDP and the (distributed) optimizer built afterwards
hold gradient buffers and Adam state for the adapters only (both skip `requires_grad=False`
parameters: distributed_data_parallel.py `__init__`, optimizer/__init__.py `_get_param_groups`).

How each layout computes TP1's function (the adapter term is added inside the layer's
`_forward_impl`, i.e. to the rank's partial output, so megatron's own output handling applies):
- column-parallel (`linear_qkv`, `linear_fc1`): A replicated, B split like the weight's output
  rows, in megatron's fused layout (QKV: whole query groups per rank, the TP1 rows cut in TP
  chunks; SwiGLU fc1: [gate_r; up_r]). h = x A^T is the same on every rank; its gradient is
  all-reduced over TP in backward (each rank's B_r sees only its rows), which makes A's gradient
  and x's adapter gradient whole, as megatron's `allreduce_dgrad` does for the base weight.
- row-parallel (`linear_proj`, `linear_fc2`): A split like the input (columns), B replicated. Each
  rank adds B (x_r A_r^T) to its partial output and megatron's all-reduce sums them. B's
  gradient from one rank is g^T (x_r A_r^T), a partial sum: it is all-reduced over TP in backward.
Sequence parallelism and MoE experts are refused (`check_lora_model`).

The adapters' layout-free form ("megatron layout" below) is TP1's: `A` [r, in], `B` [out, r] under
the global megatron name, e.g. `decoder.layers.3.self_attention.linear_qkv.lora.B` [(q + 2 kv), r]
with QKV fused per query group. `adapter_state` gathers it, `load_adapter_state_` shards it back.
"""

from __future__ import annotations

import contextlib
import math
import types
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ALL_LINEAR = "all-linear"
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
INITS = ("xavier", "kaiming", "gaussian")  # A's init; B starts at zero (the adapter is off at step 0)


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how (a plain copy of the `model.lora` config section)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = TARGETS
    init: str = "xavier"
    seed: int = 0  # A's init: one generator per (seed, global parameter name), so every layout agrees

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def resolve_targets(value: Union[str, list, tuple]) -> tuple[str, ...]:
    """`all-linear` or a list of megatron module names -> the names, in TARGETS order; ValueError otherwise."""
    names = [value] if isinstance(value, str) else list(value)
    if ALL_LINEAR in names:
        return TARGETS
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise ValueError(f"unknown LoRA target module(s) {unknown or names}: use {ALL_LINEAR!r} or some of {TARGETS}")
    return tuple(t for t in TARGETS if t in names)


class _ReduceGradOverTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over TP (megatron's
    `copy_to_tensor_model_parallel_region` would do, but in 0.16.1 it reduces `grad.contiguous()` and
    returns `grad`, so a non-contiguous gradient would come back unreduced)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LoraAdapter(torch.nn.Module):
    """One linear's adapter shard: `A` [r, in_r], `B` [out_r, r] (which of them is split: `parallel`)."""

    def __init__(self, parallel: str, transform: str, a_shape, b_shape, spec: LoraSpec, tp_group, dtype):
        super().__init__()
        assert parallel in ("column", "row")
        self.parallel, self.transform, self.scale = parallel, transform, spec.scale
        self.tp_group = tp_group if tp_group is not None and tp_group.size() > 1 else None
        self.A = torch.nn.Parameter(torch.zeros(a_shape, dtype=dtype))
        self.B = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype))
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout > 0 else torch.nn.Identity()
        self.enabled = True  # False: the base model's function (adapters_disabled, merged weights)
        _mark_tensor_parallel(self)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A dropout(x) for this rank's shard: x [s, b, in_r] -> [s, b, out_r]."""
        h = F.linear(self._dropped(x), self.A)  # [s, b, r]
        b = self.B
        if self.tp_group is not None:
            if self.parallel == "column":
                h = _ReduceGradOverTP.apply(h, self.tp_group)  # each rank's B_r sees its rows only
            else:
                b = _ReduceGradOverTP.apply(b, self.tp_group)  # each rank saw its input columns only
        if h.device.type == "cpu":  # scaled in place: no second [tokens, out] tensor (fresh pages on CPU)
            return _AdapterUp.apply(h, b).mul_(self.scale)
        return F.linear(h, b) * self.scale

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.dropout, torch.nn.Identity) or not self.training:
            return x
        if self.parallel == "row":  # a split input: a mask per rank, from megatron's TP-parallel RNG
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)  # replicated input: the default generator, the same on every TP rank

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A in the base weight's shard layout [out_r, in_r]."""
        return (self.B @ self.A) * self.scale


class _AdapterUp(torch.autograd.Function):
    """h @ B^T (h [..., r], B [out, r]) with B's gradient computed as (h^T g)^T. Autograd's linear gives it
    as g^T h, whose transposed [tokens, out] operand takes MKL's slow path on CPU: SmolLM2's gate/up B
    (807 tokens, rank 8, out 3072) 6.3 ms vs 0.63 ms, one thread, AMD EPYC. Same products, summed by
    another kernel (fp32 rounding differs in the last bits). CPU only; GPUs keep autograd's linear."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, b)
        return F.linear(h, b)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        h, b = ctx.saved_tensors
        grad_h = g.matmul(b) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            h2, g2 = h.reshape(-1, h.shape[-1]), g.reshape(-1, g.shape[-1])
            grad_b = torch.mm(h2.t(), g2).t().contiguous()  # [out, r]
        return grad_h, grad_b


def _mark_tensor_parallel(adapter: LoraAdapter) -> None:
    """The split one carries megatron's TP attributes: the grad norm then counts it on every TP rank
    and the replicated one once (megatron `param_is_not_tensor_parallel_duplicate`)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if adapter.parallel == "column":
        set_tensor_model_parallel_attributes(adapter.B, True, 0, 1)
    else:
        set_tensor_model_parallel_attributes(adapter.A, True, 1, 1)


def _lora_forward_impl(layer, input, weight, *args, **kwargs):
    """The layer's class `_forward_impl` (base matmul, frozen-weight path) plus the adapter term."""
    output = type(layer)._forward_impl(layer, input, weight, *args, **kwargs)
    if not layer.lora.enabled:
        return output
    return output + layer.lora.delta(input)


def _lora_sharded_state_dict(layer, prefix: str = "", sharded_offsets=(), metadata=None):
    """The layer's class `sharded_state_dict` (dist checkpointing), with the split adapter sharded
    over TP as its weight is. megatron-core 0.16.1's Column/RowParallelLinear.sharded_state_dict
    (tensor_parallel/layers.py) TP-shards only `weight` / `bias` and saves every other tensor as
    TP-replicated, which would keep one rank's shard of B (column) or A (row). The SwiGLU fc1's B
    gets the [gate; up] factory MLP.sharded_state_dict applies to fc1's weight (transformer/mlp.py)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state = type(layer).sharded_state_dict(layer, prefix, sharded_offsets, metadata)
    adapter = layer.lora
    key, axis = ("lora.B", 0) if adapter.parallel == "column" else ("lora.A", 1)
    split = make_sharded_tensors_for_checkpoint(
        {key: getattr(adapter, key[-1])},
        prefix,
        {key: axis},
        sharded_offsets,
        tp_group=layer.tp_group,
        dp_cp_group=metadata["dp_cp_group"],
    )
    if adapter.transform == "gate_up":
        singleton = (metadata or {}).get("singleton_local_shards", False)
        split = {k: apply_swiglu_sharded_factory(v, sharded_offsets, singleton) for k, v in split.items()}
    state.update(split)
    return state


# ---------------------------------------------------------------- attaching


def target_of(name: str) -> Optional[str]:
    """`decoder.layers.0.mlp.linear_fc1` -> `linear_fc1`; None for anything LoRA does not adapt."""
    last = name.rsplit(".", 1)[-1]
    return last if last in TARGETS and ".experts." not in name else None


def check_lora_model(model, spec: LoraSpec) -> None:
    """What the adapters cannot handle, as one-line ValueErrors naming why."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    config = model.config
    if config.sequence_parallel:
        raise ValueError("LoRA with sequence parallelism is not supported: the adapters assume whole sequences")
    if getattr(config, "num_moe_experts", None):
        raise ValueError("LoRA on MoE models is not supported (routed experts under EP have no adapters yet)")
    for name, module in model.named_modules():
        if target_of(name) and not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            raise ValueError(
                f"LoRA needs megatron's local-spec linears; {name} is {type(module).__name__} "
                "(Transformer Engine spec): run without Transformer Engine"
            )


def _transform(target: str, config) -> str:
    if target == "linear_qkv":
        return "qkv"
    if target == "linear_fc1":
        return "gate_up" if config.gated_linear_unit else "column"
    return "row"


def add_lora_(model, spec: LoraSpec, tp_group, layer_offset: int = 0, trainable: tuple[str, ...] = ()) -> list[str]:
    """Freeze every parameter of `model` (a GPTModel stage) but the submodules named in `trainable`
    (a critic's value head: `output_layer`) and add adapters to the targeted linears, initialised
    layout-free (`init_full_adapter`); returns the local names of the adapted linears.
    Call before megatron DDP wraps the model. `layer_offset`: this stage's first global layer."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    check_lora_model(model, spec)
    if spec.init not in INITS:
        raise ValueError(f"LoRA init {spec.init!r} is unknown: use one of {INITS}")
    model.requires_grad_(False)
    for name in trainable:
        if hasattr(model, name):  # a pipeline stage without it has nothing to keep
            getattr(model, name).requires_grad_(True)
    adapted = []
    for name, layer in list(model.named_modules()):
        target = target_of(name)
        if target not in spec.target_modules:
            continue
        column = isinstance(layer, ColumnParallelLinear)
        weight = layer.weight  # [out_r, in_r]
        out_r, in_r = weight.shape
        a_shape = (spec.rank, in_r)
        b_shape = (out_r, spec.rank)
        parallel = "column" if column else "row"
        layer.lora = LoraAdapter(
            parallel, _transform(target, model.config), a_shape, b_shape, spec, tp_group, weight.dtype
        )
        layer._forward_impl = types.MethodType(_lora_forward_impl, layer)
        layer.sharded_state_dict = types.MethodType(_lora_sharded_state_dict, layer)
        adapted.append(name)
    init_adapters_(model, spec, tp_group, layer_offset)
    return adapted


def adapters(model) -> Iterator[tuple[str, LoraAdapter]]:
    """(local linear name, adapter) of every adapted linear of `model`, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, LoraAdapter):
            yield name.rsplit(".", 1)[0], module


def has_lora(model) -> bool:
    return next(adapters(model), None) is not None


@contextlib.contextmanager
def adapters_disabled(model):
    """Within `with`: the base model's function (LoRA's reference policy: the actor without adapters)."""
    states = [(a, a.enabled) for _, a in adapters(model)]
    for a, _ in states:
        a.enabled = False
    try:
        yield model
    finally:
        for a, enabled in states:
            a.enabled = enabled


# ---------------------------------------------------------------- layout-free (TP1) form


def _tp(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return tp_group.rank(), tp_group.size()


def shard_a(full: torch.Tensor, adapter: LoraAdapter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP1 A [r, in] -> this rank's: replicated (column) or its input columns (row)."""
    if adapter.parallel == "column":
        return full
    return full.chunk(tp_size, dim=1)[tp_rank]


def shard_b(full: torch.Tensor, adapter: LoraAdapter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP1 B [out, r] -> this rank's rows in megatron's layout (fused QKV: whole query groups are
    contiguous, so a plain chunk; SwiGLU fc1 [gate; up] -> [gate_r; up_r]); replicated for row."""
    if adapter.parallel == "row":
        return full
    if adapter.transform == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=0)[tp_rank]


def unshard_a(shards: list[torch.Tensor], adapter: LoraAdapter) -> torch.Tensor:
    return shards[0] if adapter.parallel == "column" else torch.cat(shards, dim=1)


def unshard_b(shards: list[torch.Tensor], adapter: LoraAdapter) -> torch.Tensor:
    if adapter.parallel == "row":
        return shards[0]
    if adapter.transform == "gate_up":
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=0)


def global_name(local_name: str, layer_offset: int) -> str:
    """`decoder.layers.{i}.` of a pipeline stage -> the global layer index."""
    from megatron_bridge.mappings import to_global_name

    return to_global_name(local_name, layer_offset)


def init_full_adapter(name: str, a_shape, b_shape, spec: LoraSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """TP1 (A, B) of the linear with global name `name`: A by `spec.init` from a generator seeded by
    (seed, name), so every TP x PP layout starts from the same adapters; B zero."""
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(a_shape)
    if spec.init == "xavier":
        torch.nn.init.xavier_uniform_(a, generator=gen)
    elif spec.init == "kaiming":  # PEFT's default: nn.Linear's kaiming_uniform(a=sqrt(5))
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
    else:  # PEFT's "gaussian"
        torch.nn.init.normal_(a, std=1.0 / a_shape[0], generator=gen)
    return a, torch.zeros(b_shape)


def _full_shapes(adapter: LoraAdapter, tp_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    r, in_r = adapter.A.shape
    out_r = adapter.B.shape[0]
    if adapter.parallel == "column":
        return (r, in_r), (out_r * tp_size, r)
    return (r, in_r * tp_size), (out_r, r)


def init_adapters_(model, spec: LoraSpec, tp_group, layer_offset: int = 0) -> None:
    tp_rank, tp_size = _tp(tp_group)
    with torch.no_grad():
        for name, adapter in adapters(model):
            a_shape, b_shape = _full_shapes(adapter, tp_size)
            if spec.rank > min(a_shape[1], b_shape[0]):
                raise ValueError(
                    f"LoRA rank {spec.rank} is larger than {name}'s dimensions {b_shape[0]} x {a_shape[1]}: "
                    "lower model.lora.rank"
                )
            a, b = init_full_adapter(global_name(name, layer_offset), a_shape, b_shape, spec)
            adapter.A.copy_(shard_a(a, adapter, tp_rank, tp_size))
            adapter.B.copy_(shard_b(b, adapter, tp_rank, tp_size))


def load_adapter_state_(model, state: dict[str, torch.Tensor], tp_group, layer_offset: int = 0) -> None:
    """Write TP1-layout adapters (global names `<linear>.lora.A` / `.lora.B`, as `adapter_state`
    returns) into this rank's shards. Every adapter of the stage must be in `state`."""
    tp_rank, tp_size = _tp(tp_group)
    with torch.no_grad():
        for name, adapter in adapters(model):
            key = global_name(name, layer_offset) + ".lora."
            adapter.A.copy_(shard_a(state[key + "A"], adapter, tp_rank, tp_size))
            adapter.B.copy_(shard_b(state[key + "B"], adapter, tp_rank, tp_size))


def _gather_tp(t: torch.Tensor, tp_group) -> list[torch.Tensor]:
    if tp_group is None or tp_group.size() == 1:
        return [t.detach().clone()]
    parts = [torch.empty_like(t) for _ in range(tp_group.size())]
    dist.all_gather(parts, t.detach().contiguous(), group=tp_group)
    return parts


def adapter_state(model, tp_group, pp_group=None, layer_offset: int = 0, grads: bool = False) -> dict:
    """This model replica's adapters in TP1 layout under global names (`<linear>.lora.A` [r, in],
    `.lora.B` [out, r]), on every rank of the replica: collective over its TP and PP groups.
    `grads=True`: the same for the adapters' gradients (megatron DDP's `main_grad`, else `.grad`)."""
    state = {}
    for name, adapter in adapters(model):
        key = global_name(name, layer_offset) + ".lora."
        a, b = (_grad_of(p) for p in (adapter.A, adapter.B)) if grads else (adapter.A, adapter.B)
        state[key + "A"] = unshard_a(_gather_tp(a, tp_group), adapter)
        state[key + "B"] = unshard_b(_gather_tp(b, tp_group), adapter)
    if pp_group is not None and pp_group.size() > 1:
        stages = [None] * pp_group.size()
        dist.all_gather_object(stages, state, group=pp_group)
        state = {k: v for stage in stages for k, v in stage.items()}
    return dict(sorted(state.items(), key=lambda kv: _layer_sort_key(kv[0])))


def _grad_of(p: torch.Tensor) -> torch.Tensor:
    grad = getattr(p, "main_grad", None)
    grad = p.grad if grad is None else grad
    return torch.zeros_like(p) if grad is None else grad.to(p.dtype)


def _layer_sort_key(name: str):
    parts = name.split(".")
    return [int(p) if p.isdigit() else 0 for p in parts], name


# ---------------------------------------------------------------- merging


def merged_weight(layer) -> torch.Tensor:
    """W + scale * B @ A for this rank's shard of the linear's weight, [out_r, in_r]; W untouched."""
    return layer.weight.detach() + layer.lora.delta_weight().detach().to(layer.weight.dtype)


def merge_(model) -> None:
    """Add every adapter into its base weight shard in place and switch the adapters off (the model
    computes the same function). `unmerge_` undoes it up to rounding: keep the base bit-exact by
    syncing `merged_weight` instead where that matters."""
    with torch.no_grad():
        for name, adapter in adapters(model):
            if adapter.enabled:
                layer = model.get_submodule(name)
                layer.weight.add_(adapter.delta_weight().to(layer.weight.dtype))
                adapter.enabled = False


def unmerge_(model) -> None:
    with torch.no_grad():
        for name, adapter in adapters(model):
            if not adapter.enabled:
                layer = model.get_submodule(name)
                layer.weight.sub_(adapter.delta_weight().to(layer.weight.dtype))
                adapter.enabled = True


def count_adapter_params(model) -> int:
    """Adapter parameters on this rank (shards)."""
    return sum(a.A.numel() + a.B.numel() for _, a in adapters(model))
