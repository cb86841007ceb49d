"""The reshard plan, without process groups: every engine shard assembled from the plan's spans of
Megatron shards equals the same slice of the full HF tensor (vLLM's layout written out independently
here, from vLLM's loaders), for training TP 1/2/4 x PP 1/2 and rollout TP 1/2/4, with GQA."""

import itertools

import pytest
import torch

from megatron_bridge import layouts
from megatron_bridge.hf_config import ModelArgs
from megatron_bridge.mappings import layer_offset, owner_stage, param_maps, to_local_name
from megatron_bridge.reshard import plan_reshard


def assemble(tplan, shard, reader_tp: int, out=None) -> torch.Tensor:
    """The test's oracle: one engine tensor built from Megatron shards (`shard(tp, pp, name)`) by
    following its plan's spans, with nothing but narrow/copy (the executor batches the same spans)."""
    if out is None:
        out = torch.zeros(tplan.shape)
    for s in tplan.spans:
        dst = out.narrow(s.axis, s.dst_start, s.length)
        if s.src is None:
            dst.zero_()
        else:
            tp = reader_tp if s.src_tp is None else s.src_tp
            dst.copy_(shard(tp, s.src_pp, s.src).narrow(s.axis, s.src_start, s.length))
    return out


def _args(heads=8, groups=4, vocab=300, tied=True, qkv_bias=False, arch="llama"):
    return ModelArgs(
        arch=arch,
        vocab_size=vocab,
        hidden_size=heads * 8,
        num_layers=2,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=48,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        qkv_bias=qkv_bias,
    )


GQA = _args()  # 8 heads, 4 KV heads, tied, vocab 300 (not a multiple of 64 or 128)
QWEN = _args(tied=False, qkv_bias=True, arch="qwen2", vocab=250)
FEW_KV = _args(heads=8, groups=2)  # rollout TP 4 > 2 KV heads: vLLM replicates each KV head on 2 ranks


def _hf_tensors(args):
    gen = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=gen)
        for m in param_maps(args)
        if m.export
        for name, shape in zip(m.hf, m.hf_shapes)
    }


def _megatron_shards(args, hf, tp, pp):
    """(tp rank, stage, local name) -> that Megatron shard, cut by layouts.megatron_shard."""
    out = {}
    for m in param_maps(args):
        if not m.export:
            continue
        stage = owner_stage(m, args, pp)
        local = to_local_name(m.megatron, layer_offset(args, stage, pp))
        for t in range(tp):
            out[(t, stage, local)] = layouts.megatron_shard(m.transform, [hf[n] for n in m.hf], t, tp, args)
    return out


def _split(x, rank, size, dim=0):
    return x.chunk(size, dim=dim)[rank]


def _vllm_expected(args, hf, name, j, k):
    """vLLM TP rank j's parameter, from vLLM's loaders (linear.py, vocab_parallel_embedding.py)."""
    d = args.head_dim
    if ".qkv_proj." in name:
        q, kk, v = (hf[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj"))
        groups = args.num_query_groups
        if k >= groups:
            head = j // (k // groups)  # QKVParallelLinear: shard_rank = tp_rank // num_kv_head_replicas
            kv_rows = slice(head * d, (head + 1) * d)
            return torch.cat([_split(q, j, k), kk[kv_rows], v[kv_rows]])
        return torch.cat([_split(q, j, k), _split(kk, j, k), _split(v, j, k)])
    if ".gate_up_proj." in name:
        gate, up = hf[name.replace("gate_up_proj", "gate_proj")], hf[name.replace("gate_up_proj", "up_proj")]
        return torch.cat([_split(gate, j, k), _split(up, j, k)])
    full = hf[name]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        padded = -(-args.vocab_size // 64) * 64
        per = padded // k
        out = torch.zeros(per, full.shape[1])
        real = full[j * per : min((j + 1) * per, args.vocab_size)]
        out[: real.shape[0]] = real
        return out
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return _split(full, j, k, dim=1)
    return full  # norms


def _loader_rows(args, name, j, k, n):
    """Rows of an HF tensor vLLM TP rank j's loader narrows to (all rows at k=1)."""
    d, groups = args.head_dim, args.num_query_groups
    if k == 1 or "norm" in name or name.endswith(("o_proj.weight", "down_proj.weight")):
        return slice(0, n)
    if ".k_proj." in name or ".v_proj." in name:
        per = max(1, groups // k) * d
        head_block = j // (k // groups) if k >= groups else j
        return slice(head_block * per, (head_block + 1) * per)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        per = -(-args.vocab_size // 64) * 64 // k
        return slice(min(j * per, n), min((j + 1) * per, n))
    return slice(j * n // k, (j + 1) * n // k)


def _loader_cols(name, j, k, n):
    if k > 1 and name.endswith(("o_proj.weight", "down_proj.weight")):
        return slice(j * n // k, (j + 1) * n // k)
    return slice(0, n)


CASES = [(GQA, tp, pp, k) for tp, pp, k in itertools.product((1, 2, 4), (1, 2), (1, 2, 4))]
CASES += [(QWEN, tp, pp, k) for tp, pp, k in itertools.product((1, 2), (1, 2), (1, 2, 4))]
CASES += [(FEW_KV, tp, 1, 4) for tp in (1, 2)]


@pytest.mark.parametrize("args,tp,pp,k", CASES)
@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_plan_assembles_engine_shards(args, tp, pp, k, kind):
    hf = _hf_tensors(args)
    shards = _megatron_shards(args, hf, tp, pp)
    plan = plan_reshard(args, tp, pp, k, kind)
    assert {(s, n): shape for s, n, shape in plan.sources} == {
        (s, n): tuple(v.shape) for (t, s, n), v in shards.items() if t == 0
    }
    for j in range(k):
        names = [tp_.name for tp_ in plan.tensors(j)]
        assert len(names) == len(set(names))
        if kind == "hf":
            assert set(names) == set(hf)  # tied: lm_head is stored once, as the embedding
        for reader_tp in range(tp):  # replicated spans read the reader's own TP rank: any must do
            for t in plan.tensors(j):
                got = assemble(t, lambda tt, s, n: shards[(tt, s, n)], reader_tp, torch.full(t.shape, float("nan")))
                if kind == "vllm":
                    assert t.complete
                    torch.testing.assert_close(got, _vllm_expected(args, hf, t.name, j, k), rtol=0, atol=0)
                    continue
                full = hf[t.name]
                rows = _loader_rows(args, t.name, j, k, full.shape[0])
                cols = _loader_cols(t.name, j, k, full.shape[-1])
                region = (rows, cols) if full.dim() == 2 else (rows,)
                torch.testing.assert_close(got[region], full[region], rtol=0, atol=0)
                assert t.complete == (k == 1 or "norm" in t.name)


def test_vllm_layout_matches_layouts_vllm_shard():
    """The traced plan and the bridge's own vllm_shard agree (one declaration, two users)."""
    args = FEW_KV
    hf = _hf_tensors(args)
    shards = _megatron_shards(args, hf, 2, 1)
    plan = plan_reshard(args, 2, 1, 4, "vllm")
    by_name = {
        m.hf[0].replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj"): m
        for m in param_maps(args)
        if m.export
    }
    for j in range(4):
        for t in plan.tensors(j):
            m = by_name[t.name]
            want = layouts.vllm_shard(m.transform, [hf[n] for n in m.hf], j, 4, args)
            got = assemble(t, lambda tt, s, n: shards[(tt, s, n)], 0)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_plan_moves_only_needed_rows_and_is_cached():
    plan = plan_reshard(GQA, 2, 1, 2, "vllm")
    assert plan is plan_reshard(GQA, 2, 1, 2, "vllm")
    # train TP2 -> rollout TP2: every sharded layer tensor of rollout rank j comes from training rank j
    # only (the vocabulary is padded differently: 128 x TP rows for Megatron, 64 for vLLM)
    for j in range(2):
        for t in plan.tensors(j):
            if "embed_tokens" not in t.name:
                assert {s.src_tp for s in t.spans if s.src is not None} <= {j, None}, t.name
    # a rank's qkv_proj is its q, k and v runs per KV group at most, not one span per row
    qkv = next(t for t in plan.tensors(0) if t.name.endswith("layers.0.self_attn.qkv_proj.weight"))
    assert len(qkv.spans) <= 3 * GQA.num_query_groups


def test_plan_rejects_bad_layouts():
    with pytest.raises(ValueError, match="engine_kind"):
        plan_reshard(GQA, 1, 1, 1, "sglang")
    with pytest.raises(ValueError, match="rollout TP=3"):
        plan_reshard(GQA, 1, 1, 3, "vllm")
