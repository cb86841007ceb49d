"""The hf engine's lean decode step against transformers' forward, on Llama, Qwen2 and Qwen3 shapes."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rlstack.rollout import cpu_gemm, hf_engine
from rlstack.rollout.lean_decode import LeanDecoder

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="packed linears need oneDNN")

_SHAPE = dict(
    vocab_size=97,
    hidden_size=96,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=64,
)


def _model(kind: str):
    config, cls = {
        "llama": (LlamaConfig(**_SHAPE, attention_bias=True, tie_word_embeddings=True), LlamaForCausalLM),
        "qwen2": (Qwen2Config(**_SHAPE, tie_word_embeddings=False), Qwen2ForCausalLM),  # q/k/v biases
        "qwen3": (Qwen3Config(**_SHAPE), Qwen3ForCausalLM),  # q/k norms
    }[kind]
    torch.manual_seed(0)
    hf_engine._register_attention()
    model = cls._from_config(config, attn_implementation=hf_engine._ATTENTION).eval()
    with torch.no_grad():  # biases and norm weights away from their 0 / 1 initial values
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


_AVX2 = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or cpu_gemm.library() is None,
    reason="no AVX2 CPU or no C compiler: rlstack's decode attention cannot run",
)


@pytest.mark.parametrize(
    "kind,dtype,fast",
    [
        ("llama", torch.float32, False),
        ("qwen2", torch.float32, False),
        ("qwen3", torch.float32, False),
        ("qwen3", torch.bfloat16, False),
        pytest.param("llama", torch.float32, True, marks=_AVX2),
        pytest.param("qwen3", torch.float32, True, marks=_AVX2),
    ],
)
def test_lean_steps_equal_transformers_forward(kind, dtype, fast):
    """Logits and K/V of five decode steps; bf16 (rollout.dtype, Qwen3's q/k norms and the other norms'
    casts) on oneDNN's bf16 kernels where torch has them, else on F.linear. `fast`: the attention on
    rlstack's AVX2 kernel (cpu_gemm.decode_attention) instead of SDPA: the same maths, rounded otherwise."""
    model = _model(kind).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 0.0  # bf16: the same kernels in the same order, exactly
    tol = 1e-5 if fast else tol
    assert LeanDecoder.supports(model)
    ids = torch.randint(3, 97, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), hf_engine._packed_linears(model, rows=3):
        lean = LeanDecoder(model, fast_attention=fast)
        calls = []
        if fast:  # the kernel really runs (and not SDPA) in every layer of every step
            real = cpu_gemm.decode_attention
            lean_attention = lambda *a: calls.append(1) or real(*a)  # noqa: E731
        caches = [hf_engine._reserved_cache(model.config, capacity=12) for _ in range(2)]
        logits = [
            model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=c).logits[:, -1] for c in caches
        ]
        nxt = pos[:, -1] + 1
        for step in range(5):
            tok = logits[0].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            expected = model(
                input_ids=tok.unsqueeze(-1),
                attention_mask=mask,
                position_ids=nxt.unsqueeze(-1),
                past_key_values=caches[0],
            ).logits[:, -1]
            if fast:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(cpu_gemm, "decode_attention", lean_attention)
                    got = lean.step(tok, nxt, mask, caches[1])
            else:
                got = lean.step(tok, nxt, mask, caches[1])
            torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
            logits, nxt = [expected, got], nxt + 1
        assert len(calls) == (5 * model.config.num_hidden_layers if fast else 0)
        for a, b in zip(caches[0].layers, caches[1].layers):  # the same K/V written to the cache
            torch.testing.assert_close(b.keys, a.keys, rtol=tol, atol=tol)
            torch.testing.assert_close(b.values, a.values, rtol=tol, atol=tol)


def test_other_models_keep_transformers_forward():
    torch.manual_seed(0)
    gelu = LlamaForCausalLM._from_config(LlamaConfig(**_SHAPE, hidden_act="gelu"))
    assert not LeanDecoder.supports(gelu)  # another activation
    windowed = MistralForCausalLM._from_config(MistralConfig(**_SHAPE, sliding_window=4))
    assert not LeanDecoder.supports(windowed)  # another model type (sliding-window attention)
