"""Every patch megatron_bridge makes to megatron-core (and the torch names it reads), in one table.

Each `Patch` says what kind it is, when it applies, what it rebinds (`targets`: "module:attribute"),
where megatron-core 0.16.1 relies on it (`call_sites`: a function and a line of its source), and,
for the few that change torch for the whole process, why they are not scoped to megatron's modules.
`megatron_bridge.patches.apply()` applies the start-up ones whose condition holds, once;
tests/unit/test_patches.py checks every call site against the installed megatron-core.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

KINDS = (
    "CUDA shim",  # a call that raises without CUDA, made to work on the CPU
    "missing TE",  # a name megatron reads undefined when Transformer Engine is absent
    "faster CPU kernel",  # the same maths as megatron's eager kernel, with fewer temporaries
    "gloo collective",  # a collective gloo runs badly, replaced by an in-place one
    "optimizer state",  # torch Adam state megatron's distributed optimizer does not expect
    "default group",  # the default process group as megatron sees it (split placement)
    "recompute",  # rlstack's extra selective recompute ("mlp_act") on megatron's MLP
    "warning filter",  # megatron's own warnings that no setting can change
    "checkpoint process",  # a helper process megatron's checkpoint writer starts
    "shared prefix",  # rows packed with their prompt once (model.prefix_sharing), as RoPE reads them
)


class Applies(enum.Enum):
    ALWAYS = "always"
    CPU = "no CUDA device"
    NO_TE = "no Transformer Engine"
    NO_TE_OR_APEX = "neither Transformer Engine nor Apex"
    SPLIT_PLACEMENT = "split placement (applied by init_split_distributed, scoped)"


@dataclass(frozen=True)
class Environment:
    """What the conditions are decided on."""

    cuda: bool  # a CUDA device is present
    te: bool  # Transformer Engine imports (megatron's own HAVE_TE)
    te_or_apex: bool  # megatron's distributed optimizer found TE or Apex (its HAVE_APEX_OR_TE)

    @classmethod
    def detect(cls) -> Environment:
        import torch
        from megatron.core.optimizer import distrib_optimizer
        from megatron.core.tensor_parallel import random as tp_random

        return cls(
            cuda=torch.cuda.is_available(),
            te=bool(getattr(tp_random, "HAVE_TE", False)),
            te_or_apex=bool(distrib_optimizer.HAVE_APEX_OR_TE),
        )

    def holds(self, applies: Applies) -> bool:
        return {
            Applies.ALWAYS: True,
            Applies.CPU: not self.cuda,
            Applies.NO_TE: not self.te,
            Applies.NO_TE_OR_APEX: not self.te_or_apex,
            Applies.SPLIT_PLACEMENT: False,  # never at start-up
        }[applies]


@dataclass(frozen=True)
class CallSite:
    """Where megatron-core relies on what the patch changes: `module` under megatron.core, a
    function or method `qualname` in it, and a piece of that function's 0.16.1 source."""

    module: str
    qualname: str
    source: str


@dataclass(frozen=True)
class Patch:
    name: str
    kind: str  # one of KINDS
    applies: Applies
    apply: Optional[Callable[[], None]]  # None: applied where it is needed (Applies.SPLIT_PLACEMENT)
    targets: tuple[str, ...]  # "module:attribute.path" the patch rebinds
    call_sites: tuple[CallSite, ...]
    process_wide: str = ""  # why it changes torch for every caller, not megatron's modules only


def _site(module: str, qualname: str, source: str) -> CallSite:
    return CallSite(module, qualname, source)


def _lazy(module: str, function: str) -> Callable[[], None]:
    def run() -> None:
        import importlib

        getattr(importlib.import_module(f"megatron_bridge.patches.{module}"), function)()

    run.__qualname__ = f"{module}.{function}"
    return run


MC = "megatron.core."
PATCHES: tuple[Patch, ...] = (
    # ------------------------------------------------------------------ CUDA shims (cuda_shims.py)
    Patch(
        "current_device",
        "CUDA shim",
        Applies.CPU,
        _lazy("cuda_shims", "_patch_current_device"),
        ("torch.cuda:current_device",),
        (
            _site("utils", "GlobalMemoryBuffer.get_tensor", "device=torch.cuda.current_device()"),
            _site("tensor_parallel.layers", "ColumnParallelLinear.__init__", "torch.cuda.current_device()"),
            _site("distributed.param_and_grad_buffer", "_ParamAndGradBuffer.__init__", "torch.cuda.current_device()"),
            _site("models.gpt.gpt_model", "GPTModel._preprocess", "torch.cuda.current_device()"),
        ),
        process_wide="called from ~40 megatron-core modules, several imported only later (dist_checkpointing, "
        "inference); without CUDA the original raises, so answering 'cpu' changes no call that worked",
    ),
    Patch(
        "synchronize",
        "CUDA shim",
        Applies.CPU,
        _lazy("cuda_shims", "_patch_synchronize"),
        ("torch.cuda:synchronize",),
        (
            _site("pipeline_parallel.p2p_communication", "P2PCommunicator._communicate", "torch.cuda.synchronize()"),
            _site("parallel_state", "update_pg_timeout", "torch.cuda.synchronize"),
        ),
        process_wide="called from several megatron-core modules; without CUDA the original raises, and CPU ops "
        "are synchronous, so a no-op is exact for every caller",
    ),
    Patch(
        "rng_tracker",
        "CUDA shim",
        Applies.CPU,
        _lazy("cuda_shims", "_patch_rng_tracker"),
        (
            "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
            "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
            "megatron.core.tensor_parallel.random:torch",
        ),
        (
            _site("tensor_parallel.random", "CudaRNGStatesTracker.add", "torch.cuda.get_rng_state"),
            _site("tensor_parallel.random", "CudaRNGStatesTracker.fork", "_get_cuda_rng_state"),
        ),
    ),
    Patch(
        "cuda_tensor_factories",
        "CUDA shim",
        Applies.CPU,
        _lazy("cuda_shims", "_patch_cuda_tensor_factories"),
        tuple(
            f"{MC}{m}:torch"
            for m in ("pipeline_parallel.schedules", "optimizer.clip_grads", "optimizer.optimizer", "transformer.utils")
        )
        + (f"{MC}utils:torch",),
        (
            _site("pipeline_parallel.schedules", "forward_backward_no_pipelining", 'device="cuda"'),
            _site("optimizer.clip_grads", "get_grad_norm_fp32", "device='cuda'"),
            _site("optimizer.optimizer", "MixedPrecisionOptimizer.__init__", "device='cuda'"),
            _site("transformer.utils", "get_default_causal_mask", 'device="cuda"'),
            _site("utils", "local_multi_tensor_l2_norm", 'device="cuda"'),
        ),
    ),
    Patch(
        "cuda_type_checks",
        "CUDA shim",
        Applies.CPU,
        _lazy("cuda_shims", "_patch_cuda_type_checks"),
        (
            "torch:Tensor.type",
            f"{MC}optimizer.distrib_optimizer:DistributedOptimizer.__init__",
            f"{MC}optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
            f"{MC}optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
            f"{MC}optimizer.clip_grads:clip_grad_by_total_norm_fp32",
            f"{MC}optimizer.optimizer:clip_grad_by_total_norm_fp32",
        ),
        (
            _site(
                "optimizer.distrib_optimizer",
                "DistributedOptimizer._build_model_and_main_param_groups",
                "torch.cuda.FloatTensor",
            ),
            _site("optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__", "torch.cuda.FloatTensor"),
            _site("optimizer.clip_grads", "clip_grad_by_total_norm_fp32", "torch.cuda.FloatTensor"),
        ),
        process_wide="`Tensor.type` is a method of torch's Tensor class, so the replacement is seen by every "
        "caller, but it answers as torch does except inside the megatron functions it wraps (the CUDA type "
        "name only there, for CPU tensors)",
    ),
    Patch(
        "tensor_cuda_calls",
        "CUDA shim",
        Applies.CPU,
        _lazy("cuda_shims", "_patch_tensor_cuda_calls"),
        (
            "torch:Tensor.cuda",
            "torch:Tensor.type",
            f"{MC}models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
        ),
        (
            _site(
                "models.common.language_module.language_module",
                "LanguageModule.setup_embeddings_and_output_layer",
                ".cuda()",
            ),
        ),
        process_wide="`Tensor.cuda` is a method of torch's Tensor class, so the replacement is seen by every "
        "caller, but it acts as torch's except inside the wrapped megatron function (keeps a CPU tensor there)",
    ),
    Patch(
        "moe_dtoh_stream",
        "CUDA shim",
        Applies.CPU,
        _lazy("cuda_shims", "_patch_moe_dtoh_stream"),
        (
            f"{MC}transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
            f"{MC}transformer.moe.token_dispatcher:torch",
        ),
        (
            _site("transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.__init__", "torch.cuda.Stream()"),
            _site(
                "transformer.moe.token_dispatcher",
                "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
                "maybe_move_tensor_to_cpu",
            ),
        ),
    ),
    # ------------------------------------------------------------------ missing TE (missing_te.py)
    Patch(
        "moe_router_without_te",
        "missing TE",
        Applies.NO_TE,
        _lazy("missing_te", "_patch_moe_router_without_te"),
        (f"{MC}transformer.moe.moe_utils:te_general_gemm",),
        (
            _site("transformer.moe.moe_utils", "RouterGatingLinearFunction.forward", "te_general_gemm"),
            _site("transformer.moe.moe_utils", "RouterGatingLinearFunction.backward", "te_general_gemm"),
        ),
    ),
    Patch(
        "output_discarding_checkpoint_without_te",
        "missing TE",
        Applies.NO_TE,
        _lazy("missing_te", "_patch_output_discarding_checkpoint_without_te"),
        (f"{MC}tensor_parallel.random:CheckpointWithoutOutput.__init__",),
        (_site("tensor_parallel.random", "CheckpointWithoutOutput.__init__", "self.fp8 = fp8 is not None"),),
    ),
    # ------------------------------------------------------------------ faster CPU kernels (cpu_kernels.py)
    Patch(
        "eager_swiglu",
        "faster CPU kernel",
        Applies.CPU,
        _lazy("cpu_kernels", "_patch_eager_swiglu"),
        tuple(
            f"{MC}fusions.fused_bias_swiglu:{name}"
            for name in (
                "swiglu",
                "swiglu_back",
                "bias_swiglu",
                "bias_swiglu_back",
                "weighted_swiglu",
                "weighted_swiglu_back",
            )
        ),
        (
            _site("fusions.fused_bias_swiglu", "bias_swiglu", "swiglu(y)"),
            _site("fusions.fused_bias_swiglu", "SwiGLUFunction.backward", "swiglu_back(grad_output, input)"),
        ),
    ),
    Patch(
        "lean_rmsnorm",
        "faster CPU kernel",
        Applies.CPU,
        _lazy("cpu_kernels", "_patch_lean_rmsnorm"),
        (f"{MC}transformer.torch_norm:WrappedTorchNorm.__new__",),
        (_site("transformer.torch_norm", "WrappedTorchNorm.__new__", "torch.nn.RMSNorm"),),
    ),
    Patch(
        "lean_rope",
        "faster CPU kernel",
        Applies.CPU,
        _lazy("cpu_kernels", "_patch_lean_rope"),
        (f"{MC}models.common.embeddings.rope_utils:_apply_rotary_pos_emb_bshd",),
        (
            _site(
                "models.common.embeddings.rope_utils",
                "_apply_rotary_pos_emb_bshd",
                "_rotate_half(t, rotary_interleaved)",
            ),
            _site("models.common.embeddings.rope_utils", "apply_rotary_pos_emb", "_apply_rotary_pos_emb_bshd("),
        ),
    ),
    Patch(
        "onednn_linears",
        "faster CPU kernel",
        Applies.CPU,
        _lazy("cpu_matmul", "_patch_onednn_linears"),
        (
            f"{MC}tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication",
            f"{MC}tensor_parallel.layers:LinearWithFrozenWeight",
        ),
        (
            _site(
                "tensor_parallel.layers",
                "linear_with_grad_accumulation_and_async_allreduce",
                "LinearWithGradAccumulationAndAsyncCommunication.apply(*args)",
            ),
            _site("tensor_parallel.layers", "linear_with_frozen_weight", "LinearWithFrozenWeight.apply(*args)"),
            _site(
                "tensor_parallel.layers",
                "LinearWithGradAccumulationAndAsyncCommunication.forward",
                "torch.matmul(total_input, weight.t())",
            ),
        ),
    ),
    # ------------------------------------------------------------------ gloo collectives (gloo_collectives.py)
    Patch(
        "gloo_bucket_collectives",
        "gloo collective",
        Applies.CPU,
        _lazy("gloo_collectives", "_patch_gloo_bucket_collectives"),
        (
            f"{MC}distributed.param_and_grad_buffer:dist_reduce_scatter_func",
            f"{MC}distributed.param_and_grad_buffer:dist_all_gather_func",
        ),
        (
            _site(
                "distributed.param_and_grad_buffer",
                "_ParamAndGradBucketGroup.start_grad_sync",
                "dist_reduce_scatter_func(",
            ),
            _site(
                "distributed.param_and_grad_buffer",
                "_ParamAndGradBucketGroup.start_param_sync",
                "dist_all_gather_func(",
            ),
        ),
    ),
    # ------------------------------------------------------------------ optimizer state (optimizer_state.py)
    Patch(
        "torch_adam_step_on_load",
        "optimizer state",
        Applies.NO_TE_OR_APEX,
        _lazy("optimizer_state", "patch_torch_adam_step_on_load"),
        (f"{MC}optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",),
        (
            _site(
                "optimizer.distrib_optimizer",
                "DistributedOptimizer._set_main_param_and_optimizer_states",
                "tensors[key]",
            ),
            _site("optimizer.distrib_optimizer", "DistributedOptimizer.state_dict", "len(steps) == 1"),
        ),
    ),
    Patch(
        "inplace_multi_tensor_scale",
        "faster CPU kernel",
        Applies.NO_TE_OR_APEX,
        _lazy("optimizer_state", "patch_inplace_multi_tensor_scale"),
        (f"{MC}optimizer.clip_grads:multi_tensor_scale_impl", f"{MC}optimizer.optimizer:multi_tensor_scale_impl"),
        (
            _site(
                "optimizer.clip_grads",
                "clip_grad_by_total_norm_fp32",
                "multi_tensor_scale_impl, dummy_overflow_buf, [grads, grads], clip_coeff",
            ),
            _site(
                "optimizer.optimizer",
                "_multi_tensor_copy_this_to_that",
                "multi_tensor_applier(multi_tensor_scale_impl, overflow_buf, [this, that], 1.0)",
            ),
        ),
    ),
    # ------------------------------------------------------------------ default group (default_group.py)
    Patch(
        "split_placement_default_group",
        "default group",
        Applies.SPLIT_PLACEMENT,
        None,
        ("torch.distributed:get_world_size", "torch.distributed.distributed_c10d:_world.default_pg"),
        (
            _site("parallel_state", "initialize_model_parallel", "torch.distributed.get_world_size()"),
            _site("dist_checkpointing.validation", "determine_global_metadata", "all_gather_object"),
        ),
        process_wide="the default process group is the process's: on a training rank of a split placement it "
        "is the training ranks' group from init_split_distributed until destroy_distributed (megatron's "
        "collectives without a group argument must not reach the rollout ranks); get_world_size is seen as "
        "the training world only inside initialize_model_parallel",
    ),
    # ------------------------------------------------------------------ recompute (act_recompute.py)
    Patch(
        "mlp_act_recompute",
        "recompute",
        Applies.ALWAYS,
        _lazy("act_recompute", "wrap_swiglu"),
        (f"{MC}transformer.mlp:bias_swiglu_impl",),
        (_site("transformer.mlp", "MLP.forward", "bias_swiglu_impl("),),
    ),
    # ------------------------------------------------------------------ checkpoint process (checkpoint_writer.py)
    Patch(
        "forked_write_results_queue",
        "checkpoint process",
        Applies.ALWAYS,
        _lazy("checkpoint_writer", "patch_write_results_queue"),
        (f"{MC}dist_checkpointing.strategies.filesystem_async:_get_write_results_queue",),
        (
            _site(
                "dist_checkpointing.strategies.filesystem_async",
                "FileSystemWriterAsync.prepare_write_data",
                "self.results_queue = _get_write_results_queue()",
            ),
        ),
    ),
    # ------------------------------------------------------------------ shared prefix (shared_prefix.py)
    Patch(
        "shared_prefix_rope",
        "shared prefix",
        Applies.NO_TE,  # rows share a prompt only under the SDPA core attention (no Transformer Engine)
        _lazy("shared_prefix", "patch_shared_prefix_rope"),
        (f"{MC}models.common.embeddings.rope_utils:_apply_rotary_pos_emb_thd",),
        (
            _site("models.common.embeddings.rope_utils", "apply_rotary_pos_emb", "_apply_rotary_pos_emb_thd("),
            _site(
                "models.common.embeddings.rope_utils",
                "_get_thd_freqs_on_this_cp_rank",
                "freqs[offset : offset + x.size(0)]",
            ),
            _site("transformer.attention", "Attention.forward", "cu_seqlens=cu_seqlens_q"),
        ),
    ),
    # ------------------------------------------------------------------ warning filters (quiet_warnings.py)
    Patch(
        "quiet_dependency_warnings",
        "warning filter",
        Applies.ALWAYS,
        _lazy("quiet_warnings", "quiet_dependency_warnings"),
        ("warnings:filters",),
        (
            _site("optimizer.optimizer", "_zero_grad_group_helper", "hasattr(param, grad_attr)"),
            _site(
                "distributed.param_and_grad_buffer",
                "_ParamAndGradBucketGroup.start_grad_sync",
                "dist_reduce_scatter_func(",
            ),
        ),
        process_wide="Python's warning filters belong to the process; each matches its one message only",
    ),
)


def at_start_up(env: Environment) -> tuple[Patch, ...]:
    """The patches `apply()` applies on a machine like `env`, in registry order."""
    return tuple(p for p in PATCHES if p.apply is not None and env.holds(p.applies))
