"""megatron_bridge/patches/lazy_compile.py: megatron-core's first import sets up none of its 38 torch.compile
kernels (1.2 s a rank); a kernel compiles at its first call, once, with its options; the SwiGLU patch still
finds the eager originals."""

from __future__ import annotations

import subprocess
import sys

from megatron_bridge.patches.lazy_compile import lazy
from tests.e2e.runs import ROOT


def test_compile_waits_for_the_first_call_and_happens_once():
    calls = []

    def fake_compile(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    deferred = lazy(fake_compile)

    def f(x):
        return x + 1

    g = deferred(f)
    h = deferred(mode="max-autotune")(f)  # the @torch.compile(...) form
    assert calls == [] and g.__name__ == "f" and g._torchdynamo_orig_callable is f
    assert g(1) == ("compiled", 2) and g(2) == ("compiled", 3)
    assert h(1) == ("compiled", 2)
    assert calls == [("f", {}), ("f", {"mode": "max-autotune"})]


PROBE = """
import sys, torch
real = torch.compile
from megatron_bridge import patches
patches.apply()
from megatron.core import jit
from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu
from megatron_bridge.patches.cpu_kernels import eager_swiglu
assert torch.compile is real, "torch.compile not put back"
assert fused_bias_gelu.bias_gelu._torchdynamo_orig_callable.__module__.endswith("fused_bias_gelu")
assert "torch._inductor.kernel" not in sys.modules, "inductor set up at import"
assert fused_bias_swiglu.swiglu is eager_swiglu
assert not hasattr(fused_bias_swiglu.bias_swiglu, "_torchdynamo_orig_callable"), "SwiGLU variant still compiled"
print("ok")
"""


def test_megatrons_first_import_sets_up_no_compiled_kernel():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
