"""The few patches megatron-core 0.16.1 needs to run on CPU + gloo, and to run there at speed.

Megatron-Core assumes CUDA in several ways (docs/megatron_core.md). Each patch below is applied only when no CUDA
device is present and names its call sites (paths under `megatron/core/`, version 0.16.1). (a)-(h) change
only calls that would otherwise raise (h, and m below, also apply on a GPU without Transformer Engine); (i)-(k) replace
eager CPU kernels (SwiGLU, RMSNorm, RoPE) with the same maths in fewer temporaries; (l) replaces gloo's
reduce-scatter and all-gather of megatron's grad and param buffers with in-place collectives; (m) lets
megatron's output-discarding checkpoint (selective recompute) run without Transformer Engine. `apply()` is idempotent;
`tests/unit/test_cpu_compat.py` checks each patch, and the distributed tests check the results against
single-rank references.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types

import torch

log = logging.getLogger("megatron_bridge")
_APPLIED = False


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    """Patch megatron-core for CPU when CUDA is absent. Returns True if patches are active."""
    global _APPLIED
    if _APPLIED:
        return True
    _patch_moe_router_without_te()  # any machine without Transformer Engine, GPU or not
    _patch_output_discarding_checkpoint_without_te()  # likewise
    if not needed():
        return False
    _patch_current_device()
    _patch_synchronize()
    _patch_rng_tracker()
    _patch_cuda_tensor_factories()
    _patch_cuda_type_checks()
    _patch_tensor_cuda_calls()
    _patch_moe_dtoh_stream()
    _patch_eager_swiglu()
    _patch_lean_rmsnorm()
    _patch_lean_rope()
    _patch_gloo_bucket_collectives()
    _APPLIED = True
    log.debug("megatron-core CPU patches applied")
    return True


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


# (h) Without Transformer Engine, transformer/moe/moe_utils.py:34 fails to import `te_general_gemm`
#     (inside `try: ... except ImportError: HAVE_TE = False`), and RouterGatingLinearFunction.forward /
#     backward (:1192, :1225, every MoE router call via `router_gating_linear`) read the undefined name:
#     NameError. Defining it as None selects the torch.mm path those functions already have.
def _patch_moe_router_without_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# (m) tensor_parallel/random.py `CheckpointWithoutOutput.__init__(self, fp8=False)` sets
#     `self.fp8 = fp8 is not None`, which is True for the default False, so every output-discarding
#     checkpoint (selective recompute "layernorm" at transformer/transformer_layer.py:577,672,
#     "moe_act" at moe/experts.py:739, "mla_up_proj") takes its FP8 path and reads Transformer
#     Engine's `FP8GlobalStateManager`, which is undefined without TE: NameError at the first
#     forward. Without TE there is no FP8, so the flag is set to False, which is what the caller
#     asked for.
def _patch_output_discarding_checkpoint_without_te() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    if getattr(tp_random, "HAVE_TE", True):
        return
    cls = tp_random.CheckpointWithoutOutput
    if getattr(cls.__init__, "_rlstack_no_fp8", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def init(self, fp8=False):
        original(self, fp8)
        self.fp8 = False

    init._rlstack_no_fp8 = True
    cls.__init__ = init


# (i) fusions/fused_bias_swiglu.py decorates swiglu / swiglu_back (and the bias and weighted
#     variants) with `megatron.core.jit.jit_fuser`, which is `torch.compile` on torch >= 2.2: on CPU
#     inductor builds C++ with the system g++ at the first call of every process (up to ~10 s each,
#     and a compiler needed on every node). Their autograd Functions (SwiGLUFunction,
#     WeightedSwiGLUFunction, reached from transformer/mlp.py and moe/experts.py with
#     bias_activation_fusion) save only fc1's output whichever way the kernels run. The bias and
#     weighted variants get their eager originals back; `swiglu` and `swiglu_back` (which the bias
#     variants call by their module-level names) get the eager kernels below: the same maths with
#     one temporary instead of ~11 (each a fresh, page-faulted [tokens, ffn] tensor at the fixed
#     mmap threshold): backward 48.6 -> 14.9 ms at 1128 x 1536, forward 8.5 -> 5.9 ms
#     (docs/megatron_core.md; equal within 1e-6 relative, tests/unit/test_cpu_compat.py).
_SWIGLU_KERNELS = (
    "bias_swiglu",
    "bias_swiglu_back",
    "weighted_swiglu",
    "weighted_swiglu_back",
)


def eager_swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(y1) * y2 for y = [y1, y2] along the last dimension."""
    y1, y2 = torch.chunk(y, 2, -1)
    return torch.nn.functional.silu(y1).mul_(y2)


def eager_swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d/dy of sum(g * silu(y1) * y2) = [g y2 silu'(y1), g silu(y1)], silu' = sig + silu (1 - sig)."""
    y1, y2 = torch.chunk(y, 2, -1)
    out = torch.empty_like(y)
    d1, d2 = torch.chunk(out, 2, -1)  # views of out's two halves
    sig = torch.sigmoid(y1)
    torch.mul(y1, sig, out=d2)  # silu(y1)
    torch.mul(d2, sig, out=d1)
    d1.neg_().add_(d2).add_(sig)  # sig + silu - silu sig
    d1.mul_(y2).mul_(g)
    d2.mul_(g)
    return out


def _patch_eager_swiglu() -> None:
    from megatron.core.fusions import fused_bias_swiglu

    for name in _SWIGLU_KERNELS:
        kernel = getattr(fused_bias_swiglu, name)
        setattr(fused_bias_swiglu, name, getattr(kernel, "_torchdynamo_orig_callable", kernel))
    fused_bias_swiglu.swiglu = eager_swiglu
    fused_bias_swiglu.swiglu_back = eager_swiglu_back


# (j) transformer/torch_norm.py `WrappedTorchNorm` (the local spec's norm, LNImpl in
#     models/gpt/gpt_layer_specs.py: every layer's two norms, the final one and Qwen3's q/k norms)
#     returns `torch.nn.RMSNorm`. On CPU its `F.rms_norm` is torch's composite decomposition (even
#     `aten::_fused_rms_norm` decomposes there): pow, mean, rsqrt and two muls, each a fresh
#     [tokens, h] tensor, and autograd keeps the input, rstd and the normalised input x * rstd.
#     `LeanRMSNorm` (fp32, elementwise affine) computes the same forward in the same order (bit
#     for bit) and keeps only the input and rstd; its backward makes one [tokens, h] tensor. SmolLM2
#     at 1128 x 576: forward + backward 5.5 -> 1.5 ms, and one [tokens, h] activation less per norm.
class _LeanRMSNormFunction(torch.autograd.Function):
    """y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))  # [.., 1]
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # dx = r (g w) - x r^3 <g w, x> / h;  dw = sum over rows of r (g x)
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        x2, g2, r = x.reshape(-1, h), grad.reshape(-1, h), rstd.reshape(-1)  # [N, h], [N, h], [N]
        gx = torch.mul(g2, x2)  # g x: the one [N, h] tensor, reused for dx below
        grad_weight = r @ gx  # [h]
        dot = gx @ weight  # [N] = <g w, x>
        coef = dot.mul_(r).mul_(r).mul_(r).div_(h).unsqueeze(-1)  # [N, 1]
        torch.mul(g2, weight, out=gx).mul_(r.unsqueeze(-1)).addcmul_(x2, coef, value=-1)
        return gx.view(x.shape), grad_weight, None


class LeanRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm with `_LeanRMSNormFunction` for fp32 inputs with a weight (else the original)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.is_cuda:
            return super().forward(x)
        assert tuple(self.normalized_shape) == (x.shape[-1],), (self.normalized_shape, x.shape)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _LeanRMSNormFunction.apply(x, weight, eps)


def _patch_lean_rmsnorm() -> None:
    from megatron.core.transformer import torch_norm

    wrapped = torch_norm.WrappedTorchNorm
    original = wrapped.__new__

    def new(cls, *args, **kwargs):
        norm = original(cls, *args, **kwargs)
        if type(norm) is torch.nn.RMSNorm:
            norm.__class__ = LeanRMSNorm  # same parameters and state dict, another forward
        return norm

    wrapped.__new__ = staticmethod(new)


# (k) models/common/embeddings/rope_utils.py `_apply_rotary_pos_emb_bshd` (the unfused RoPE of
#     `apply_rotary_pos_emb`, reached from transformer/attention.py for q and k in every layer)
#     makes six [s, b, heads, d] tensors per call (t * cos, the rotated half's negation and cat,
#     its product with sin, the sum, and a final cat with an empty pass-through part), and as many
#     again in backward. `_LeanRope` writes t * cos into one new tensor and adds the rotated half's
#     product in place, forward and backward (the rotation's transpose): same maths, rounded in
#     another order (within 1e-6 relative). Interleaved, MLA and partial rotary keep the original.
class _LeanRope(torch.autograd.Function):
    """out = t cos + rotate_half(t) sin, rotate_half([t1, t2]) = [-t2, t1]; cos, sin carry no grad."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_into(torch.mul(t, cos), t, sin, transpose=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_into(torch.mul(grad, cos), grad, sin, transpose=True), None, None


def _rotate_into(out: torch.Tensor, t: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """out += rotate_half(t) * sin (transpose: rotate_half's transpose, [t1, t2] -> [t2, -t1])."""
    half = t.shape[-1] // 2
    t1, t2, s1, s2 = t[..., :half], t[..., half:], sin[..., :half], sin[..., half:]
    if transpose:  # d/dt1 = g1 c1 + g2 s2, d/dt2 = g2 c2 - g1 s1
        out[..., :half].addcmul_(t2, s2)
        out[..., half:].addcmul_(t1, s1, value=-1)
    else:  # out1 = t1 c1 - t2 s1, out2 = t2 c2 + t1 s2
        out[..., :half].addcmul_(t2, s1, value=-1)
        out[..., half:].addcmul_(t1, s2)
    return out


def _patch_lean_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd

    @functools.wraps(original)
    def bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if rotary_interleaved or multi_latent_attention or t.dtype != torch.float32 or t.shape[-1] != freqs.shape[-1]:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos = (torch.cos(freqs) * mscale).to(t.dtype)  # as the original: [s, 1, 1, d]
        sin = (torch.sin(freqs) * mscale).to(t.dtype)
        return _LeanRope.apply(t, cos, sin)

    bshd._rlstack_lean = True
    rope_utils._apply_rotary_pos_emb_bshd = bshd


# (l) distributed/param_and_grad_buffer.py `dist_reduce_scatter_func` / `dist_all_gather_func`
#     (torch's reduce_scatter_tensor / all_gather_into_tensor, bound at :35-36): the distributed
#     optimizer's grad reduce-scatter (`start_grad_sync`, :443) and param all-gather
#     (`start_param_sync`, :285), each bucket's own shard (`shard_buffer`) against the whole bucket.
#     gloo has neither collective in place: each stages a full-bucket copy (SmolLM2 fp32, 2 ranks:
#     +0.50 GiB a rank at that moment) and the reduce-scatter takes twice an all-reduce (0.60-0.76 s
#     against 0.30-0.40). Inside megatron's `_coalescing_manager` torch then queues them as
#     `reduce_scatter_single_coalesced`, which took 1.9-2.1 s a step (docs/megatron_core.md). On CPU
#     tensors the grad bucket is all-reduced in place instead (the shard gets the same sum; the other
#     shards, which the optimizer never reads, get it too) and the params are gathered by one
#     broadcast per shard from its owner (bit for bit, no staging). Asynchronous calls (overlap,
#     which rlstack leaves off) and other layouts keep torch's functions.
def _own_shard(shard: torch.Tensor, whole: torch.Tensor, group) -> bool:
    """Is `shard` this rank's contiguous 1/size view of `whole` (as megatron's shard_buffer makes it)?"""
    size, rank = group.size(), group.rank()
    return (
        shard.is_contiguous()
        and whole.is_contiguous()
        and shard.dtype == whole.dtype
        and shard.numel() * size == whole.numel()
        and shard.data_ptr() == whole.data_ptr() + rank * shard.numel() * shard.element_size()
    )


def _patch_gloo_bucket_collectives() -> None:
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffers

    reduce_scatter, all_gather = buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func
    if getattr(reduce_scatter, "_rlstack_gloo", False):
        return

    @functools.wraps(reduce_scatter)
    def gloo_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op or group is None or input.is_cuda or not _own_shard(output, input, group):
            return reduce_scatter(output, input, op=op, group=group, async_op=async_op)
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        # The group's own allreduce: `dist.all_reduce` inside a `_coalescing_manager` is only queued,
        # and torch runs the queue as `allreduce_coalesced`, which flattens into a copy.
        group.allreduce([input], opts).wait()
        return None

    @functools.wraps(all_gather)
    def gloo_all_gather(output, input, group=None, async_op=False):
        if async_op or group is None or output.is_cuda or not _own_shard(input, output, group):
            return all_gather(output, input, group=group, async_op=async_op)
        for member, shard in enumerate(output.view(group.size(), -1)):
            dist.broadcast(shard, group=group, group_src=member)  # not queued by _coalescing_manager
        return None

    gloo_reduce_scatter._rlstack_gloo = gloo_all_gather._rlstack_gloo = True
    buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func = gloo_reduce_scatter, gloo_all_gather


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
