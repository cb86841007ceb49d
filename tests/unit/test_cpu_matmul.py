"""float32 CPU linears on oneDNN (megatron_bridge/patches/cpu_matmul.py, `parallel.cpu_matmul`): megatron's
two linear autograd Functions give F.linear's output and gradients (to float32 rounding), on the
oneDNN kernel when the mode asks for it and on megatron's own code otherwise; "auto" picks by vendor."""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import layers

from megatron_bridge.patches import cpu_matmul

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.fixture
def mode():
    cpu_matmul._patch_onednn_linears()  # as patches.apply() does on a machine without CUDA
    before = cpu_matmul.mode()
    yield cpu_matmul.set_mode
    cpu_matmul.set_mode(before)


def _ops(fn) -> set:
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.function_events}


def test_auto_picks_onednn_off_intel_only():
    assert cpu_matmul.auto_uses_onednn("AuthenticAMD", "x86_64")
    assert cpu_matmul.auto_uses_onednn("HygonGenuine", "x86_64")
    assert not cpu_matmul.auto_uses_onednn("GenuineIntel", "x86_64")
    assert not cpu_matmul.auto_uses_onednn("AuthenticAMD", "aarch64")
    assert not cpu_matmul.auto_uses_onednn("", "x86_64")
    with pytest.raises(ValueError, match="onednn"):
        cpu_matmul.set_mode("mkl")


@pytest.mark.parametrize("bias", [False, True])
def test_trained_linear_matches_f_linear_on_onednn(mode, bias):
    mode("onednn")
    torch.manual_seed(0)
    x = torch.randn(7, 3, 48, requires_grad=True)  # [s, b, h] as megatron's layers pass it
    w = torch.randn(80, 48, requires_grad=True)
    b = torch.randn(80, requires_grad=True) if bias else None
    g = torch.randn(7, 3, 80)

    def run():
        y = layers.linear_with_grad_accumulation_and_async_allreduce(x, w, b, False, False, False, tp_group=object())
        y.backward(g)
        return y

    ops = _ops(run)
    assert "mkldnn::_linear_pointwise" in ops and "aten::mm" not in ops and "aten::matmul" not in ops, ops
    got = (run().detach(), x.grad.clone(), w.grad.clone(), b.grad.clone() if bias else None)
    x.grad = w.grad = None
    if bias:
        b.grad = None
    ref = torch.nn.functional.linear(x, w, b)
    ref.backward(g)
    torch.testing.assert_close(got[0], ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1] / 2, x.grad, rtol=1e-5, atol=1e-5)  # run() ran twice: grads summed
    torch.testing.assert_close(got[2] / 2, w.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(got[3] / 2, b.grad, rtol=1e-5, atol=1e-5)


def test_frozen_linear_and_the_torch_mode(mode):
    torch.manual_seed(1)
    x = torch.randn(5, 2, 32, requires_grad=True)
    w = torch.randn(24, 32)  # frozen: the reference policy, LoRA's base
    g = torch.randn(5, 2, 24)
    ref = torch.nn.functional.linear(x, w)
    (ref_grad,) = torch.autograd.grad(ref, x, g)
    for kind, op in (("onednn", "mkldnn::_linear_pointwise"), ("torch", "aten::matmul")):
        mode(kind)
        box = {}

        def run():
            box["y"] = layers.linear_with_frozen_weight(x, w, None, False, False, False, tp_group=object())
            (box["dx"],) = torch.autograd.grad(box["y"], x, g)

        assert op in _ops(run), kind
        torch.testing.assert_close(box["y"], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(box["dx"], ref_grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(box["y"], torch.matmul(x, w.t()))  # torch mode: megatron's own code, bit for bit


def test_bfloat16_keeps_megatron_code_where_the_cpu_multiplies_bf16(mode, monkeypatch):
    mode("onednn")
    monkeypatch.setattr(cpu_matmul, "native_bf16", lambda: True)
    x, w = torch.randn(4, 1, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    assert not cpu_matmul.handles(x, w)
    y = layers.linear_with_frozen_weight(x, w, None, False, False, False, tp_group=object())
    assert torch.equal(y, torch.matmul(x, w.t()))


@pytest.mark.parametrize("kind", ["onednn", "auto"])
def test_bfloat16_is_multiplied_in_float32_where_the_cpu_does_not(mode, monkeypatch, kind):
    """No avx512_bf16 / amx_bf16: bf16 operands cast up, multiplied in float32, the results bf16."""
    mode(kind)
    monkeypatch.setattr(cpu_matmul, "native_bf16", lambda: False)
    assert cpu_matmul.has_native_bf16("fma avx2 avx512f avx512_bf16") and cpu_matmul.has_native_bf16("amx_bf16 avx2")
    assert not cpu_matmul.has_native_bf16("fma avx2 avx512f avx512_vnni")
    torch.manual_seed(2)
    x = torch.randn(6, 2, 48, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(40, 48, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(6, 2, 40, dtype=torch.bfloat16)
    assert cpu_matmul.upcasts(x, w) and cpu_matmul.handles(x, w)

    def run():
        y = layers.linear_with_grad_accumulation_and_async_allreduce(x, w, None, False, False, False, tp_group=object())
        y.backward(g)
        return y

    ops = _ops(run)
    assert "aten::matmul" not in ops and ({"mkldnn::_linear_pointwise", "aten::linear"} & ops), ops
    y = run().detach()
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    xf, wf, gf = x.detach().float(), w.detach().float(), g.float()  # bf16 products are exact in float32
    torch.testing.assert_close(y.float(), xf @ wf.t(), rtol=0.01, atol=0.01)
    torch.testing.assert_close(x.grad.float() / 2, gf @ wf, rtol=0.01, atol=0.1)  # run() twice: summed
    torch.testing.assert_close(w.grad.float() / 2, gf.reshape(-1, 40).t() @ xf.reshape(-1, 48), rtol=0.01, atol=0.1)
    mode("torch")  # torch's own kernels, bf16 as they are
    assert not cpu_matmul.upcasts(x, w)


def test_empty_operands_fall_back(mode):
    """An MoE expert that gets no tokens: oneDNN has no primitive for a zero-size matmul."""
    mode("onednn")
    x = torch.zeros(0, 1, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    y = layers.linear_with_grad_accumulation_and_async_allreduce(x, w, None, False, False, False, tp_group=object())
    y.backward(torch.zeros(0, 1, 8))
    assert y.shape == (0, 1, 8) and x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))
