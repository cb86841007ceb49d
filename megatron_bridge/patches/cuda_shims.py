"""CUDA shims: the calls megatron-core 0.16.1 makes that raise without a CUDA device, made to work on
the CPU (docs/megatron_core.md). Each changes only calls that would otherwise raise. Registered in
`megatron_bridge.patches.registry` (kind "CUDA shim", applies without CUDA), which says which of
them are process-wide and why; `tests/unit/test_cpu_compat.py` checks each.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch


# (a) `torch.cuda.current_device()` used as a device for buffers:
#     utils.py:631 (GlobalMemoryBuffer), tensor_parallel/mappings.py:91,141,148,181,442,
#     tensor_parallel/layers.py:261,552,597,607,873,899,1197,1218, pipeline_parallel/p2p_communication.py
#     :190-202,313,321, distributed/param_and_grad_buffer.py:783,800,806, models/gpt/gpt_model.py:415,
#     dist_checkpointing/strategies/state_dict_saver.py:252, optimizer/distrib_optimizer.py:791.
#     Without CUDA the call raises, so answering "cpu" changes no working code path.
def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"


# (b) `torch.cuda.synchronize()`: pipeline_parallel/p2p_communication.py:242,398, parallel_state.py:198,
#     dist_checkpointing/strategies/filesystem_async.py:230. CPU ops are synchronous: a no-op is exact.
def _patch_synchronize() -> None:
    torch.cuda.synchronize = lambda device=None: None


# (c) The CUDA RNG tracker (tensor_parallel/random.py): `model_parallel_cuda_manual_seed` is required
#     even with dropout 0 because transformer/dot_product_attention.py forks the tracker. The tracker's
#     get/set/seed of "the CUDA generator" map to the CPU default generator, which is what a CPU op uses.
def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    cuda_ns = _Proxy(torch.cuda, get_rng_state=lambda *a, **k: torch.get_rng_state(), manual_seed=torch.manual_seed)
    mrandom.torch = _Proxy(torch, cuda=cuda_ns)


# (d) Literal `device="cuda"` tensor factories: pipeline_parallel/schedules.py:596,983,2138
#     (total_num_tokens), optimizer/clip_grads.py:90,103,115,174,207, optimizer/optimizer.py:473,481,485,
#     transformer/utils.py:35 (get_default_causal_mask, used when no attention mask is passed),
#     utils.py:1207,1208 (local_multi_tensor_l2_norm/_scale, the grad-norm fallback without Apex/TE).
#     Those modules see a `torch` whose factories put "cuda" tensors on the CPU.
def _patch_cuda_tensor_factories() -> None:
    from megatron.core import utils as core_utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils

    factories = {name: _on_cpu(getattr(torch, name)) for name in ("zeros", "tensor", "empty", "ones")}
    for module in (schedules, clip_grads, optimizer, transformer_utils, core_utils):
        module.torch = _Proxy(torch, **factories)


# (e) `Tensor.type()` compared with 'torch.cuda.FloatTensor' (and Half/BFloat16):
#     optimizer/distrib_optimizer.py:361,420,582 (DistributedOptimizer.__init__ and
#     _build_model_and_main_param_groups), optimizer/optimizer.py:671,690
#     (Float16OptimizerWithFloat16Params.__init__), optimizer/clip_grads.py:167
#     (clip_grad_by_total_norm_fp32, also imported by name into optimizer/optimizer.py:50).
#     Only inside those functions (the "CPU scope"), a CPU tensor's type() answers with the CUDA type name.
#     bf16 (model.dtype=bfloat16) goes through Float16OptimizerWithFloat16Params or the distributed
#     optimizer and needs nothing beyond (d) and (e) (tests/unit/test_cpu_compat.py, bf16 test).
def _patch_cuda_type_checks() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    _wrap_method(distrib_optimizer.DistributedOptimizer, "__init__")
    _wrap_method(distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups")
    _wrap_method(optimizer.Float16OptimizerWithFloat16Params, "__init__")
    wrapped = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped
    optimizer.clip_grad_by_total_norm_fp32 = wrapped


# (f) `tensor.cuda()` on a tensor that is already where it should be:
#     models/common/language_module/language_module.py:244 (setup_embeddings_and_output_layer, tied
#     embeddings at PP > 1, before the first/last-stage all-reduce). Inside that function `.cuda()`
#     keeps a CPU tensor where it is.
def _patch_tensor_cuda_calls() -> None:
    from megatron.core.models.common.language_module import language_module

    torch.Tensor.cuda = _cuda_stays_on_cpu
    _wrap_method(language_module.LanguageModule, "setup_embeddings_and_output_layer")


# (g) The MoE all-to-all token dispatcher's device-to-host side stream:
#     transformer/moe/token_dispatcher.py:445 (`MoEAlltoAllTokenDispatcher.__init__` creates
#     `torch.cuda.Stream()`, which raises without CUDA) and :871-899 (`_maybe_dtoh_and_synchronize`:
#     current_stream, wait_stream, `with torch.cuda.stream(...)`, record_event, event.synchronize).
#     On CPU there is one synchronous stream: the dispatcher's side stream *is* the current stream
#     (so it never calls `record_stream`), entering it does nothing and its events are already done.
#     The same function moves the all-to-all split sizes to the host as numpy arrays
#     (moe_utils.maybe_move_tensor_to_cpu, imported by name into token_dispatcher.py:27) only when
#     they are CUDA tensors; CPU tensors would reach `all_to_all_single(output_split_sizes=tensor)`,
#     which torch refuses (TypeError: it takes a sequence of ints), so on CPU they become numpy too.
def _patch_moe_dtoh_stream() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host

    cuda_ns = _Proxy(
        torch.cuda,
        Stream=lambda *a, **k: _CPU_STREAM,
        current_stream=lambda *a, **k: _CPU_STREAM,
        stream=lambda s: contextlib.nullcontext(),
    )
    token_dispatcher.torch = _Proxy(torch, cuda=cuda_ns)


class _CpuStream:
    """The one (synchronous) CPU stream: waits and events are no-ops."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> _CpuStream:
        return self

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()

_ORIGINAL_CUDA = torch.Tensor.cuda


def _cuda_stays_on_cpu(self, *args, **kwargs):
    if _CUDA_TYPE_DEPTH > 0:
        return self
    return _ORIGINAL_CUDA(self, *args, **kwargs)


class _Proxy(types.ModuleType):
    """A stand-in module: the given attributes, everything else from `base`."""

    def __init__(self, base, **overrides):
        super().__init__(getattr(base, "__name__", "proxy"))
        self._base = base
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._base, name)


def _on_cpu(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


_CUDA_TYPE_DEPTH = 0


def _cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
    base_type = torch._C.TensorBase.type
    if dtype is None and _CUDA_TYPE_DEPTH > 0 and not self.is_cuda:
        return base_type(self).replace("torch.", "torch.cuda.", 1)
    if dtype is None:
        return base_type(self)
    return base_type(self, dtype, non_blocking, **kwargs)


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        global _CUDA_TYPE_DEPTH
        _CUDA_TYPE_DEPTH += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _CUDA_TYPE_DEPTH -= 1

    return call


def _wrap_method(cls, name: str) -> None:
    torch.Tensor.type = _cuda_named_type  # answers normally unless inside a wrapped function
    raw = cls.__dict__[name]
    if isinstance(raw, staticmethod):
        setattr(cls, name, staticmethod(_with_cuda_type_names(raw.__func__)))
    elif isinstance(raw, classmethod):
        setattr(cls, name, classmethod(_with_cuda_type_names(raw.__func__)))
    else:
        setattr(cls, name, _with_cuda_type_names(raw))
