"""SDPA core attention (megatron_bridge/sdpa_attention.py) against megatron's unfused DotProductAttention.

One process, no torch.distributed: both modules get a stand-in TP group whose size() is what the
test asks for (only `size()` is read at construction), and megatron's global memory buffer, which
DotProductAttention's baddbmm writes into.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_bridge import patches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _megatron_globals():
    """DotProductAttention forks the model-parallel RNG state around its (p=0) dropout and writes its
    scores into megatron's global memory buffer; both are set up by initialize_model_parallel and
    model_parallel_cuda_manual_seed in a real run. Removed again afterwards."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME as NAME

    patches.apply()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    added_rng = NAME not in tracker.get_states()
    if added_rng:
        tracker.add(NAME, 1234)
    added_buffer = parallel_state._GLOBAL_MEMORY_BUFFER is None
    if added_buffer:
        parallel_state._set_global_memory_buffer()
    yield
    if added_rng:
        tracker.states_.pop(NAME)
        tracker.seeds_.discard(1234)
    if added_buffer:
        parallel_state._GLOBAL_MEMORY_BUFFER = None


def _config(dtype: torch.dtype, heads: int = 9, groups: int = 3, head_dim: int = 64, dropout: float = 0.0):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=dropout,
        hidden_dropout=0.0,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
    )


def _modules(config, tp: int):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_bridge.sdpa_attention import SDPADotProductAttention

    pg = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: tp))
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(**args, pg_collection=pg), SDPADotProductAttention(**args, pg_collection=pg)


def _qkv(s: int, b: int, heads: int, groups: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = [(s, b, heads, head_dim), (s, b, groups, head_dim), (s, b, groups, head_dim)]
    return [torch.randn(*sh, generator=gen).to(DEVICE, dtype).requires_grad_() for sh in shapes]


def _run(module, q, k, v, grad_out):
    # Fresh leaves per module: the same values, separate gradients.
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, None)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize(
    "dtype, tp, atol, rtol_of_max",
    [
        (torch.float32, 1, 1e-5, 0.0),  # measured max error 1.9e-6 (AVX-512)
        # TP3: this rank's 3 query heads over its 1 K/V group
        (torch.float32, 3, 1e-5, 0.0),
        # megatron rounds the softmax to bf16 before P @ V, the flash kernel keeps it in fp32: measured
        # at most one bf16 ulp of the largest entry (0.0625 at 9.2, 0.7%)
        (torch.bfloat16, 1, 0.0, 1.5e-2),
    ],
)
def test_sdpa_equals_dot_product_attention(dtype, tp, atol, rtol_of_max):
    s, b, heads, groups, head_dim = 37, 3, 9, 3, 64
    ref, sdpa = _modules(_config(dtype, heads, groups, head_dim), tp)
    q, k, v = _qkv(s, b, heads // tp, groups // tp, head_dim, dtype)
    grad_out = torch.randn(s, b, heads // tp * head_dim, generator=torch.Generator().manual_seed(1))
    grad_out = grad_out.to(DEVICE, dtype)
    expected = _run(ref, q, k, v, grad_out)
    got = _run(sdpa, q, k, v, grad_out)
    assert got[0].shape == (s, b, heads // tp * head_dim)
    for name, e, g in zip(("out", "dq", "dk", "dv"), expected, got):
        assert g.dtype == e.dtype == dtype, name
        err = (g.float() - e.float()).abs().max().item()
        bound = atol + rtol_of_max * e.float().abs().max().item()
        assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


def test_causal_mask_matters():
    """A future token changes nothing before it (the test above would also catch a dropped is_causal)."""
    _, sdpa = _modules(_config(torch.float32), 1)
    q, k, v = (t.detach() for t in _qkv(12, 2, 9, 3, 64, torch.float32))
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 1.0
    v2[-1] -= 1.0
    a, b = sdpa(q, k, v, None), sdpa(q, k2, v2, None)
    assert torch.equal(a[:-1], b[:-1])
    assert not torch.equal(a[-1], b[-1])


def test_refuses_what_rlstack_never_passes():
    _, sdpa = _modules(_config(torch.float32), 1)
    q, k, v = (t.detach() for t in _qkv(5, 1, 9, 3, 64, torch.float32))
    with pytest.raises(AssertionError, match="causal mask"):
        sdpa(q, k, v, torch.zeros(1, 1, 5, 5, dtype=torch.bool, device=DEVICE))
    from megatron.core.packed_seq_params import PackedSeqParams

    with pytest.raises(AssertionError, match="packed format"):  # only THD packing (rlstack/workers/packing.py)
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(AssertionError, match="bias"):
        sdpa(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(AssertionError, match="dropout"):
        _modules(_config(torch.float32, dropout=0.1), 1)


def test_layer_spec_uses_sdpa_for_dense_and_moe():
    from megatron_bridge.models import _have_transformer_engine, layer_spec
    from megatron_bridge.sdpa_attention import SDPADotProductAttention

    if torch.cuda.is_available() and _have_transformer_engine():
        pytest.skip("the TE spec has its own fused attention")
    for spec in (layer_spec(), layer_spec(qk_layernorm=True), layer_spec(num_experts=4)):
        assert spec.submodules.self_attention.submodules.core_attention is SDPADotProductAttention


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)])
def test_fused_swiglu_equals_eager_glu(dtype, atol):
    """transformer_config() turns on bias_activation_fusion: megatron's MLP then calls bias_swiglu_impl
    (bias None: add_bias_linear=False); its kernels run eagerly on CPU (patches.cpu_kernels (i)), compiled on GPU."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    from megatron_bridge.hf_config import ModelArgs
    from megatron_bridge.models import transformer_config

    args = ModelArgs("llama", 64, 96, 1, 3, 1, 48, 32, 1e-5, 1e4, 64, True, False)
    config = transformer_config(args, tp=1, pp=1, dtype=dtype)
    assert config.bias_activation_fusion and config.gated_linear_unit and not config.add_bias_linear
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 3, 2 * 48, generator=gen).to(DEVICE, dtype)  # [s, b, 2f]: fc1's [gate; up]
    grad = torch.randn(7, 3, 48, generator=gen).to(DEVICE, dtype)
    outs = []
    for fused in (True, False):
        xi = x.clone().requires_grad_()
        if fused:
            y = bias_swiglu_impl(xi, None)
        else:
            gate, up = torch.chunk(xi, 2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
        y.backward(grad)
        outs.append((y.detach().float(), xi.grad.float()))
    (y_f, g_f), (y_e, g_e) = outs
    assert y_f.shape == (7, 3, 48)
    # bf16: megatron's kernel rounds at other points than silu(gate) * up here: 1-2 ulps
    assert (y_f - y_e).abs().max().item() <= atol
    assert (g_f - g_e).abs().max().item() <= atol


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)])
def test_fused_weighted_swiglu_equals_eager(dtype, atol):
    """MoE: SequentialMLP passes each token's routing probability, megatron's MLP then takes
    weighted_bias_swiglu_impl; the unfused path multiplied glu(x) by the fp32 probabilities."""
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 2 * 48, generator=gen).to(DEVICE, dtype)  # [tokens of one expert, 2f]
    probs = torch.rand(11, 1, generator=gen).to(DEVICE)  # fp32, as the router's softmax
    grad = torch.randn(11, 48, generator=gen).to(DEVICE, dtype)
    outs = []
    for fused in (True, False):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        if fused:
            y = weighted_bias_swiglu_impl(xi, None, pi)
        else:
            gate, up = torch.chunk(xi, 2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up * pi).to(dtype)
        y.backward(grad)
        outs.append([t.float() for t in (y.detach(), xi.grad, pi.grad)])
    for name, f, e in zip(("out", "dx", "dprobs"), *outs):
        bound = atol * max(1.0, e.abs().max().item())
        assert (f - e).abs().max().item() <= bound, name


def test_views_of_the_fused_qkv_output_are_not_kept():
    """megatron hands core attention q, k, v as views of one fused qkv output; what SDPA keeps for
    backward must not keep that whole tensor alive (v is copied out of it), and values are unchanged."""
    from megatron_bridge.sdpa_attention import sdpa_core_attention

    gen = torch.Generator().manual_seed(0)
    mixed = torch.randn(37, 3, 3, (3 + 2) * 64, generator=gen).to(DEVICE).requires_grad_()  # [s, b, g, (q/g + 2) d]
    q, k, v = torch.split(mixed, [3 * 64, 64, 64], dim=-1)
    q = q.reshape(37, 3, 9, 64) * 1.0  # RoPE's output is a new tensor; v stays a view
    k = k * 1.0
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sdpa_core_attention(q, k, v, 0.125, True)
    assert mixed.untyped_storage().data_ptr() not in saved
    qr, kr, vr = (t.detach().permute(1, 2, 0, 3) for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=0.125, enable_gqa=True)
    assert torch.equal(out.detach(), want.permute(2, 0, 1, 3).reshape(37, 3, 9 * 64))
    out.sum().backward()
    assert mixed.grad is not None and mixed.grad.abs().sum() > 0
