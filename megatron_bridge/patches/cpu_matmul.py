"""float32 CPU matmuls of megatron's linear layers on oneDNN where torch's own (MKL) is slow.

torch multiplies float32 CPU matrices with MKL's sgemm. On AMD CPUs MKL takes its generic code path:
at SmolLM2's training shapes (936 x 576 x 1536, one thread, AMD EPYC with AVX-512) F.linear reaches
~112 GFLOP/s and oneDNN's `mkldnn::_linear_pointwise` on the same float32 tensors ~248, forward,
input gradient and weight gradient alike (docs/megatron_core.md "float32 matmuls on oneDNN"). The
same maths, summed in another order: results differ in the last bits (~1e-7 relative).

(n) tensor_parallel/layers.py `LinearWithGradAccumulationAndAsyncCommunication` and
    `LinearWithFrozenWeight` (every ColumnParallelLinear / RowParallelLinear calls them through
    `linear_with_grad_accumulation_and_async_allreduce` / `linear_with_frozen_weight`, which read
    the module-level names at call time) become subclasses whose forward and backward run their three
    matmuls through `linear` below when the kernel applies (CPU float32, no sequence parallelism, no
    gradient-accumulation fusion, no deferred weight gradients); otherwise megatron's own code runs.

bf16 on CPUs without a bf16 multiply (no lscpu flag avx512_bf16 / amx_bf16): torch's bf16 CPU linear
is emulated there, 5-9x slower than the same operands cast to float32, multiplied and the result cast
back (AMD EPYC, AVX2 only, one thread: 7-14 GFLOP/s against 59-65 at tiny_cpu's and SmolLM2's
shapes). `linear` does that cast (`upcasts`); the products of bf16 numbers are exact in float32 and
both sum in float32, so it is the same maths as the emulated kernel, summed in another order. CPUs
with the flags keep torch's bf16 kernels.

The kernel is chosen per process by `set_mode` (rlstack: `parallel.cpu_matmul`): "auto" (oneDNN on
x86 CPUs that are not Intel's, where MKL is the slow one; torch's MKL on Intel's), "onednn" or
"torch". Each rank of a job decides the same way, and a resumed run like the run it resumes.
"""

from __future__ import annotations

import functools
import logging
import platform
from typing import Optional

import torch

log = logging.getLogger(__name__)
MODES = ("auto", "onednn", "torch")
_mode = "auto"


def set_mode(mode: str) -> None:
    """The kernel of float32 CPU linears for this process: auto | onednn | torch."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"cpu matmul mode {mode!r}: use one of {', '.join(MODES)}")
    _mode = mode
    onednn_available.cache_clear()


def mode() -> str:
    return _mode


def cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("vendor_id", "model name"); "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...); "" where there is none."""
    return cpuinfo("vendor_id")


def auto_uses_onednn(vendor: str, machine: str) -> bool:
    """ "auto": oneDNN on x86-64 CPUs that are not Intel's (MKL's generic path there), else torch."""
    return machine.lower() in ("x86_64", "amd64") and vendor not in ("", "GenuineIntel")


@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    """Does this process run float32 CPU linears on oneDNN (mode, and torch built with it)?"""
    if _mode == "torch" or not torch.backends.mkldnn.is_available():
        return False
    return _mode == "onednn" or auto_uses_onednn(cpu_vendor(), platform.machine())


def kernel_name() -> str:
    """ "onednn" or "torch": what a float32 CPU linear of this process runs on."""
    return "onednn" if onednn_available() else "torch"


def applies(*tensors: Optional[torch.Tensor]) -> bool:
    """Float32 CPU operands that this process multiplies on oneDNN."""
    return onednn_available() and all(
        t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in tensors
    )


def has_native_bf16(flags: str) -> bool:
    """Do these /proc/cpuinfo flags include a bf16 multiply (avx512_bf16 or amx_bf16)?"""
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """Does this CPU multiply bf16 in hardware? Elsewhere oneDNN emulates it (AVX-512 without the
    flags) or torch falls back to slow loops (AVX2 only)."""
    return has_native_bf16(cpuinfo("flags"))


def upcasts(*tensors: Optional[torch.Tensor]) -> bool:
    """bf16 CPU operands that `linear` multiplies in float32 (a CPU without a bf16 multiply; not in
    mode "torch", which keeps torch's own kernels)."""
    return (
        _mode != "torch"
        and all(t is None or (t.device.type == "cpu" and t.dtype == torch.bfloat16) for t in tensors)
        and not native_bf16()
    )


def handles(*tensors: Optional[torch.Tensor]) -> bool:
    """Does `linear` run these operands on a kernel of its own (oneDNN float32, or bf16 cast up)?"""
    return applies(*tensors) or upcasts(*tensors)


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., k] @ w.T (+ bias): w [n, k], any strides (a transposed view included). No autograd:
    call it where gradients are not recorded (an autograd Function's forward / backward, no_grad).
    bf16 operands on a CPU without a bf16 multiply: multiplied in float32, the result in bf16."""
    if upcasts(x, w, bias):
        b = None if bias is None else bias.float()
        return linear(x.float(), w.float(), b).to(x.dtype)
    if applies(x, w, bias) and x.numel() and w.numel():  # oneDNN refuses empty operands (an MoE expert with no tokens)
        try:
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        except RuntimeError as e:  # a shape or layout oneDNN has no primitive for: torch's kernel, same maths
            log.debug("oneDNN linear %s x %s refused (%s): torch's kernel instead", tuple(x.shape), tuple(w.shape), e)
    return torch.nn.functional.linear(x, w, bias)


def _patch_onednn_linears() -> None:
    from megatron.core.tensor_parallel import layers

    grad_base, frozen_base = layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight
    if getattr(grad_base, "_rlstack_onednn", False):
        return

    class OneDNNLinear(grad_base):
        """megatron's linear with a trained weight; its matmuls on oneDNN where `applies`."""

        _rlstack_onednn = True

        @staticmethod
        def forward(ctx, input, weight, bias, gaf, allreduce_dgrad, sp, grad_output_buffer, deferral, tp_group):
            ctx.rl_onednn = handles(input, weight, bias) and not (sp or gaf or grad_output_buffer is not None)
            if not ctx.rl_onednn:
                return grad_base.forward(
                    ctx, input, weight, bias, gaf, allreduce_dgrad, sp, grad_output_buffer, deferral, tp_group
                )
            ctx.save_for_backward(input, weight)
            ctx.use_bias, ctx.allreduce_dgrad, ctx.tp_group = bias is not None, allreduce_dgrad, tp_group
            return linear(input, weight, bias)

        @staticmethod
        def backward(ctx, grad_output):
            if not ctx.rl_onednn:
                return grad_base.backward(ctx, grad_output)
            input, weight = ctx.saved_tensors
            grad_input = linear(grad_output, weight.t())  # g @ W
            handle = None
            if ctx.allreduce_dgrad:  # as megatron: the all-reduce runs while the weight gradient is computed
                handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
            g2 = grad_output.reshape(-1, grad_output.shape[-1])  # [tokens, n]
            x2 = input.reshape(-1, input.shape[-1])  # [tokens, k]
            grad_weight = linear(g2.t(), x2.t())  # g^T @ x: [n, k]
            grad_bias = g2.sum(dim=0) if ctx.use_bias else None
            if handle is not None:
                handle.wait()
            return grad_input, grad_weight, grad_bias, None, None, None, None, None, None

    class OneDNNFrozenLinear(frozen_base):
        """megatron's linear with a frozen weight (reference, LoRA's base); oneDNN where `applies`."""

        _rlstack_onednn = True

        @staticmethod
        def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
            ctx.rl_onednn = handles(input, weight, bias)
            if not ctx.rl_onednn:
                return frozen_base.forward(ctx, input, weight, bias, allreduce_dgrad, tp_group)
            ctx.save_for_backward(weight)
            ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
            return linear(input, weight, bias)

        @staticmethod
        def backward(ctx, grad_output):
            if not ctx.rl_onednn:
                return frozen_base.backward(ctx, grad_output)
            (weight,) = ctx.saved_tensors
            grad_input = linear(grad_output, weight.t())
            if ctx.allreduce_dgrad:
                torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
            return grad_input, None, None, None, None

    layers.LinearWithGradAccumulationAndAsyncCommunication = OneDNNLinear
    layers.LinearWithFrozenWeight = OneDNNFrozenLinear
