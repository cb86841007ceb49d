"""megatron-core's `jit_fuser` compiling at a kernel's first call instead of at import.

megatron-core 0.16.1's `core/jit.py` sets `jit_fuser = torch.compile` when megatron is imported, and 16
modules decorate their fused kernels with it at import (38 functions: bias GELU / GeGLU / SwiGLU,
cross entropy, MoE helpers). Each `torch.compile(fn)` sets up inductor's backend there and then,
whether the kernel is ever called or not: importing megatron-core took 1.55-1.59 s with it and
0.33-0.35 s without (torch and transformers already imported; AMD EPYC, AVX2, one core), in every
rank of every run. rlstack calls few of those kernels, and none on CPU (patches.cpu_kernels gives
the SwiGLU ones eager code).

`lazy_torch_compile()` is the import of megatron-core with `torch.compile` replaced by a decorator that
calls the real `torch.compile(fn, **options)` at the kernel's first call and uses its result from then
on. torch.compile itself compiles at the first call too, so what runs is unchanged; only the set-up
moves. `torch.compile` is put back when the import returns.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator


def lazy(compile_fn: Callable) -> Callable:
    """A stand-in for `compile_fn` (torch.compile) that defers it to the decorated function's first call."""

    def decorator(fn=None, **options):
        if fn is None:  # @torch.compile(mode=...) form
            return lambda f: decorator(f, **options)
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn, **options)
            return compiled(*args, **kwargs)

        # what torch.compile's result carries: code that unwraps a compiled kernel (patches.cpu_kernels
        # giving the SwiGLU variants their eager originals back) finds the original the same way
        call._torchdynamo_orig_callable = fn
        return call

    return decorator


@contextlib.contextmanager
def lazy_torch_compile() -> Iterator[None]:
    """Inside: `torch.compile` defers to first call (for megatron-core's first import; a no-op once
    megatron-core is imported)."""
    import torch

    if "megatron.core" in sys.modules:
        yield
        return
    real = torch.compile
    torch.compile = lazy(real)
    try:
        yield
    finally:
        torch.compile = real
