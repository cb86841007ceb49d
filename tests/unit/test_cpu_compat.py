"""Each megatron-core CPU patch (megatron_bridge/patches/: cuda_shims, missing_te, cpu_kernels) does what its
comment says."""

import pytest
import torch

from megatron_bridge import patches
from megatron_bridge.patches import cpu_kernels

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="patches apply only without CUDA")


@pytest.fixture(scope="module", autouse=True)
def patched():
    names = patches.apply()
    assert "current_device" in names and "lean_rope" in names
    assert patches.apply() is names  # once per process


def test_current_device_and_synchronize():
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    torch.cuda.synchronize()  # no-op instead of raising


def test_rng_tracker_maps_to_cpu_generator():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("test-rng", 1234)
    torch.manual_seed(0)
    outside_before = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("test-rng"):
        inside = torch.rand(3)
    outside_after = torch.rand(3)
    assert torch.equal(outside_before, outside_after)  # fork restores the default stream
    torch.manual_seed(1234)
    assert torch.equal(inside, torch.rand(3))  # the tracker stream is the seeded CPU stream
    tracker.reset()


def test_cuda_tensor_factories_land_on_cpu():
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils

    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert clip_grads.torch.tensor([1.0], device="cuda").device.type == "cpu"
    mask = utils.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and mask[0, 1] and not mask[1, 0]


def test_cuda_type_names_only_inside_wrapped_functions():
    from megatron.core.optimizer import clip_grads

    p = torch.nn.Parameter(torch.ones(3))
    assert p.type() == "torch.FloatTensor"
    p.grad = torch.full((3,), 2.0)
    # clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor' (clip_grads.py:167)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((3,), 0.5), atol=1e-5)
    assert p.type() == "torch.FloatTensor"
    assert p.type(torch.float64).dtype == torch.float64


def test_tensor_cuda_only_inside_cpu_scope():
    from megatron_bridge.patches.cuda_shims import _with_cuda_type_names

    t = torch.ones(2)
    assert _with_cuda_type_names(lambda: t.cuda())() is t
    with pytest.raises((AssertionError, RuntimeError)):
        t.cuda()


def test_bf16_float16_optimizer_builds_fp32_main_params_on_cpu():
    """bf16 reaches two CUDA assumptions, both covered by the patches above, nothing new:
    optimizer/optimizer.py:485 (`_scale_one` with device='cuda', MixedPrecisionOptimizer.__init__ when
    bf16 has no grad scaler: patch d) and optimizer.py:671 (param.type() in
    'torch.cuda.BFloat16Tensor' in Float16OptimizerWithFloat16Params.__init__: patch e)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    config = OptimizerConfig(optimizer="adam", lr=0.1, bf16=True, params_dtype=torch.bfloat16)
    opt = Float16OptimizerWithFloat16Params(torch.optim.Adam([p], lr=0.1), config, None, lambda o: None)
    main = opt.optimizer.param_groups[0]["params"][0]
    assert main is p.main_param and main.dtype == torch.float32 and main is not p
    assert opt.get_loss_scale().device.type == "cpu" and opt.get_loss_scale().item() == 1.0
    assert p.type() == "torch.BFloat16Tensor"  # outside the wrapped constructor: the true name


def test_swiglu_kernels_run_eagerly():
    """(i): no torch.compile (and no C++ compiler) for megatron's fused SwiGLU on CPU; same maths."""
    from megatron.core.fusions import fused_bias_swiglu as f

    for name in cpu_kernels._SWIGLU_KERNELS:
        assert not hasattr(getattr(f, name), "_torchdynamo_orig_callable"), name
    x = torch.randn(5, 8, requires_grad=True)
    y = f.bias_swiglu_impl(x, None)
    gate, up = x.detach().chunk(2, -1)
    torch.testing.assert_close(y, torch.nn.functional.silu(gate) * up)


def test_swiglu_backward_equals_autograd_of_the_plain_formula():
    """(i): the one-temporary eager kernels against autograd of silu(y1) * y2 (relative 1e-6), and
    megatron's fused Function (bias and no bias) routes through them."""
    from megatron.core.fusions import fused_bias_swiglu as f

    assert f.swiglu is cpu_kernels.eager_swiglu and f.swiglu_back is cpu_kernels.eager_swiglu_back
    gen = torch.Generator().manual_seed(0)
    y = (torch.randn(64, 2 * 48, generator=gen) * 3).requires_grad_(True)
    g = torch.randn(64, 48, generator=gen)
    gate, up = y.chunk(2, -1)
    (torch.nn.functional.silu(gate) * up * g).sum().backward()
    expected = y.grad.clone()
    for bias in (None, torch.zeros(2 * 48)):
        x = y.detach().clone().requires_grad_(True)
        out = f.bias_swiglu_impl(x, bias)
        (out * g).sum().backward()
        assert float((x.grad - expected).abs().max() / expected.abs().max()) < 1e-6
        assert float((out - torch.nn.functional.silu(gate) * up).abs().max()) < 1e-6


def test_lean_rmsnorm_is_megatrons_norm_and_matches_float64():
    """(j): WrappedTorchNorm builds LeanRMSNorm (same state dict); its forward is torch's fp32 rms_norm
    bit for bit, its gradients match float64 autograd within 1e-6 relative; other dtypes fall back."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=48, num_attention_heads=4, normalization="RMSNorm")
    norm = WrappedTorchNorm(config=config, hidden_size=48, eps=1e-5)
    assert type(norm) is cpu_kernels.LeanRMSNorm and isinstance(norm, torch.nn.RMSNorm)
    assert list(norm.state_dict()) == ["weight"]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=gen))
    x = (torch.randn(5, 7, 48, generator=gen) * 3).requires_grad_(True)
    g = torch.randn(5, 7, 48, generator=gen)
    y = norm(x)
    assert y.grad_fn.name().endswith("_LeanRMSNormFunctionBackward")
    assert torch.equal(y, torch.nn.functional.rms_norm(x, [48], norm.weight, 1e-5))
    y.backward(g)
    x64, w64 = x.detach().double().requires_grad_(True), norm.weight.detach().double().requires_grad_(True)
    torch.nn.functional.rms_norm(x64, [48], w64, 1e-5).backward(g.double())
    for got, want in ((x.grad, x64.grad), (norm.weight.grad, w64.grad)):
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6
    assert "Lean" not in norm(x.detach().double()).grad_fn.name()  # not fp32: torch's own forward


def test_lean_rope_matches_megatrons_rope_in_float64():
    """(k): megatron's unfused RoPE routes fp32 through _LeanRope; value and gradient equal the original
    formula run in float64 within 1e-6 relative, on a strided q view as attention passes it."""
    from megatron.core.models.common.embeddings import rope_utils

    rope = rope_utils._apply_rotary_pos_emb_bshd
    assert getattr(rope, "_rlstack_lean", False)
    original = rope.__wrapped__
    gen = torch.Generator().manual_seed(0)
    freqs = torch.randn(11, 1, 1, 16, generator=gen)
    mixed = torch.randn(11, 3, 4, 2 * 16, generator=gen)
    q = mixed[..., :16].requires_grad_(False)  # a strided view, as split from the fused qkv
    q = q.detach().requires_grad_(True)
    g = torch.randn(11, 3, 4, 16, generator=gen)
    out = rope(q, freqs, mscale=0.7)
    assert out.grad_fn.name().endswith("_LeanRopeBackward")
    out.backward(g)
    q64 = q.detach().double().requires_grad_(True)
    want = original(q64, freqs.double(), mscale=0.7)
    want.backward(g.double())
    assert float((out.double() - want).abs().max() / want.abs().max()) < 1e-6
    assert float((q.grad.double() - q64.grad).abs().max() / q64.grad.abs().max()) < 1e-6
    interleaved = rope(q.detach(), freqs, rotary_interleaved=True)  # not the lean path: the original's
    assert torch.equal(interleaved, original(q.detach(), freqs, rotary_interleaved=True))


def test_output_discarding_checkpoint_runs_without_transformer_engine():
    """(m): megatron's CheckpointWithoutOutput() took its FP8 path by default and read TE's names."""
    from megatron.core.tensor_parallel import random as tp_random

    if tp_random.HAVE_TE:
        pytest.skip("Transformer Engine installed: megatron's own path")
    ckpt = tp_random.CheckpointWithoutOutput()
    assert ckpt.fp8 is False
    x = torch.randn(5, 3, requires_grad=True)
    y = ckpt.checkpoint(torch.nn.functional.silu, x)  # computed without grad, input saved
    out = (y * 2.0).sum()
    ckpt.discard_output_and_register_recompute(out)
    assert y.untyped_storage().nbytes() == 0  # released until backward rebuilds it
    out.backward()
    assert torch.allclose(x.grad, 2.0 * torch.func.grad(lambda t: torch.nn.functional.silu(t).sum())(x.detach()))
