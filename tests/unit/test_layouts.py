"""Megatron and vLLM TP layouts of HF tensors (pure torch; vLLM's own loaders where installed)."""

import contextlib
from unittest import mock

import pytest
import torch

from megatron_bridge import layouts
from megatron_bridge.mappings import (
    TRANSFORMS,
    hf_to_megatron_names,
    megatron_to_hf_names,
    param_maps,
    to_global_name,
    to_local_name,
)
from megatron_bridge.models import ModelArgs

# GQA: 8 heads in 4 query groups; vocab 300 is not a multiple of 128 or 64.
ARGS = ModelArgs(
    arch="qwen2",
    vocab_size=300,
    hidden_size=16,
    num_layers=4,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=24,
    head_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    qkv_bias=True,
)


def _hf_tensors(transform, args=ARGS, bias=False):
    gen = torch.Generator().manual_seed(0)
    H, F, V = args.hidden_size, args.ffn_hidden_size, args.vocab_size
    Q, KV = args.num_attention_heads * args.head_dim, args.num_query_groups * args.head_dim
    tail = () if bias else (H,)
    shapes = {
        "replicate": [(H,)],
        "column": [(F, H)],
        "row": [(H, F)],
        "vocab": [(V, H)],
        "qkv": [(Q, *tail), (KV, *tail), (KV, *tail)],
        "gate_up": [(F, H), (F, H)],
    }[transform]
    return [torch.randn(s, generator=gen) for s in shapes]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_megatron_shard_then_unshard_is_identity(transform, tp):
    full = _hf_tensors(transform)
    shards = [layouts.megatron_shard(transform, full, r, tp, ARGS) for r in range(tp)]
    assert len({s.shape for s in shards}) == 1
    back = layouts.megatron_unshard(transform, shards, ARGS)
    assert len(back) == len(full)
    for a, b in zip(back, full):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_bias_shard_then_unshard_is_identity(tp):
    full = _hf_tensors("qkv", bias=True)
    shards = [layouts.megatron_shard("qkv", full, r, tp, ARGS) for r in range(tp)]
    assert shards[0].shape == ((8 + 2 * 4) * 4 // tp,)
    for a, b in zip(layouts.megatron_unshard("qkv", shards, ARGS), full):
        assert torch.equal(a, b)


def test_megatron_qkv_is_grouped_q_heads_then_k_then_v():
    # Label every row with (tensor, head): q heads 0..7, k heads 0..3, v heads 0..3, head_dim 4.
    d, H = ARGS.head_dim, ARGS.hidden_size
    q = torch.arange(8).repeat_interleave(d)[:, None].expand(-1, H).float()
    k = 100 + torch.arange(4).repeat_interleave(d)[:, None].expand(-1, H).float()
    v = 200 + torch.arange(4).repeat_interleave(d)[:, None].expand(-1, H).float()
    shard = layouts.megatron_shard("qkv", [q, k, v], tp_rank=1, tp_size=2, args=ARGS)  # groups 2, 3
    heads = shard[::d, 0].tolist()  # one label per head_dim block
    assert heads == [4, 5, 102, 202, 6, 7, 103, 203]


def test_megatron_gate_up_holds_its_gate_half_then_its_up_half():
    gate, up = torch.arange(24.0)[:, None].expand(-1, 16), 100 + torch.arange(24.0)[:, None].expand(-1, 16)
    shard = layouts.megatron_shard("gate_up", [gate, up], tp_rank=1, tp_size=2, args=ARGS)
    assert shard[:, 0].tolist() == list(range(12, 24)) + [100 + i for i in range(12, 24)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_megatron_vocab_pads_with_zero_rows(tp):
    (emb,) = _hf_tensors("vocab")
    padded = ARGS.padded_vocab_size(tp)
    shards = [layouts.megatron_shard("vocab", emb, r, tp, ARGS) for r in range(tp)]
    assert all(s.shape == (padded // tp, ARGS.hidden_size) for s in shards)
    joined = torch.cat(shards)
    assert torch.equal(joined[:300], emb) and not joined[300:].any()


def test_megatron_tp_must_divide_query_groups():
    with pytest.raises(ValueError, match="TP=8 must divide"):
        layouts.megatron_shard("qkv", _hf_tensors("qkv"), 0, 8, ARGS)


def test_unknown_transform_is_named():
    with pytest.raises(ValueError, match="unknown transform 'diag'"):
        layouts.megatron_shard("diag", torch.zeros(2), 0, 1, ARGS)


# ---------------------------------------------------------------- mappings


def test_both_directions_come_from_one_declaration():
    forward = megatron_to_hf_names(ARGS)
    backward = hf_to_megatron_names(ARGS)
    for name, m in forward.items():
        for i, hf in enumerate(m.hf):
            assert (m, i) in backward[hf]
    assert forward["decoder.layers.3.self_attention.linear_qkv.bias"].hf == tuple(
        f"model.layers.3.self_attn.{p}_proj.bias" for p in "qkv"
    )
    assert forward["output_layer.weight"].hf == ("lm_head.weight",)
    assert len(backward) == 2 + 4 * 12 + 1  # embed, lm_head, 12 per layer (incl. 3 biases), final norm


def test_tied_embedding_feeds_the_output_layer_but_is_exported_once():
    tied = ModelArgs(**{**ARGS.__dict__, "tie_word_embeddings": True, "arch": "llama", "qkv_bias": False})
    maps = megatron_to_hf_names(tied)
    assert maps["output_layer.weight"].hf == ("model.embed_tokens.weight",)
    exported = [h for m in param_maps(tied) if m.export for h in m.hf]
    assert exported.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in exported
    assert not any("bias" in h for h in exported)


def test_te_spec_uses_fused_norm_names():
    maps = megatron_to_hf_names(ARGS, te_spec=True)
    assert maps["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"].hf == (
        "model.layers.0.input_layernorm.weight",
    )
    assert maps["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"].hf == (
        "model.layers.0.post_attention_layernorm.weight",
    )


def test_local_and_global_layer_names():
    assert to_global_name("decoder.layers.1.mlp.linear_fc1.weight", 2) == "decoder.layers.3.mlp.linear_fc1.weight"
    assert to_local_name("decoder.layers.3.mlp.linear_fc1.weight", 2) == "decoder.layers.1.mlp.linear_fc1.weight"
    assert to_global_name("embedding.word_embeddings.weight", 2) == "embedding.word_embeddings.weight"


# ---------------------------------------------------------------- vLLM layouts


def test_vllm_qkv_replicates_kv_heads_past_their_count():
    # tp 8 > 4 KV heads: ranks 2r and 2r+1 share KV head r.
    q, k, v = _hf_tensors("qkv")
    d = ARGS.head_dim
    for rank in range(8):
        shard = layouts.vllm_shard("qkv", [q, k, v], rank, 8, ARGS)
        kv = rank // 2
        expected = torch.cat([q[rank * d : (rank + 1) * d], k[kv * d : (kv + 1) * d], v[kv * d : (kv + 1) * d]])
        assert torch.equal(shard, expected)


def test_vllm_vocab_pads_to_64_then_splits():
    (emb,) = _hf_tensors("vocab")
    shards = [layouts.vllm_shard("vocab", emb, r, 4, ARGS) for r in range(4)]
    assert all(s.shape == (320 // 4, 16) for s in shards)  # 300 -> 320
    joined = torch.cat(shards)
    assert torch.equal(joined[:300], emb) and not joined[300:].any()


@contextlib.contextmanager
def _vllm_tp(rank, size):
    """Make vLLM's layers believe they run on TP rank `rank` of `size` (no process group)."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab
    import vllm.model_executor.parameter as parameter

    with contextlib.ExitStack() as stack:
        for module in (linear, vocab, parameter):
            stack.enter_context(mock.patch.object(module, "get_tensor_model_parallel_rank", lambda: rank))
            stack.enter_context(mock.patch.object(module, "get_tensor_model_parallel_world_size", lambda: size))
        yield


def _load(param, hf_tensors, shard_ids=(None,)):
    param.data.fill_(float("nan"))
    for tensor, shard_id in zip(hf_tensors, shard_ids):
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)
    return param.data


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_vllm_shards_equal_vllms_own_weight_loaders(tp):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    H, F, V, d = ARGS.hidden_size, ARGS.ffn_hidden_size, ARGS.vocab_size, ARGS.head_dim
    for rank in range(tp):
        with _vllm_tp(rank, tp):
            qkv = QKVParallelLinear(H, d, ARGS.num_attention_heads, ARGS.num_query_groups, bias=True)
            layers = {
                "qkv": (qkv.weight, _hf_tensors("qkv"), ("q", "k", "v")),
                "gate_up": (MergedColumnParallelLinear(H, [F, F], bias=False).weight, _hf_tensors("gate_up"), (0, 1)),
                "row": (RowParallelLinear(F, H, bias=False).weight, _hf_tensors("row"), (None,)),
                "column": (ColumnParallelLinear(H, F, bias=False).weight, _hf_tensors("column"), (None,)),
                "vocab": (VocabParallelEmbedding(V, H).weight, _hf_tensors("vocab"), (None,)),
            }
            lm_head = ParallelLMHead(V, H).weight
            for transform, (param, hf, ids) in layers.items():
                expected = _load(param, hf, ids)
                assert torch.equal(layouts.vllm_shard(transform, hf, rank, tp, ARGS), expected), transform
            bias = _hf_tensors("qkv", bias=True)
            assert torch.equal(layouts.vllm_shard("qkv", bias, rank, tp, ARGS), _load(qkv.bias, bias, ("q", "k", "v")))
            emb = _hf_tensors("vocab")
            assert torch.equal(layouts.vllm_shard("vocab", emb, rank, tp, ARGS), _load(lm_head, emb))
