"""The hf engine's decode-loop pieces against transformers' own: the GQA attention and the reserved KV cache."""

from __future__ import annotations

import collections

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from rlstack.rollout import hf_engine, lean_decode


def _models():
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=96,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,  # grouped-query attention: transformers copies K/V to 6 heads under a mask
        head_dim=32,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    ref = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    hf_engine._register_attention()
    ours = LlamaForCausalLM._from_config(cfg, attn_implementation=hf_engine._ATTENTION).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _batch():
    ids = torch.randint(3, 97, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: the masked path, where transformers repeats K/V
    mask[1, :1] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _decode(model, cache, steps=4):
    """Prefill then `steps` greedy decode steps; the logits of each."""
    ids, mask, pos = _batch()
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]
        nxt = pos[:, -1] + 1
        for _ in range(steps):
            out.append(logits)
            tok = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = model(
                input_ids=tok, attention_mask=mask, position_ids=nxt.unsqueeze(-1), past_key_values=cache
            ).logits[:, -1]
            nxt = nxt + 1
    return torch.stack(out)


def test_gqa_attention_and_reserved_cache_equal_transformers_bit_for_bit():
    ref, ours = _models()
    expected = _decode(ref, DynamicCache(config=ref.config))
    got = _decode(ours, hf_engine._reserved_cache(ours.config, capacity=7 + 4))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_bf16_attention_in_fp32_matches_transformers_within_bf16_rounding():
    """bf16 on CPU: the engine's attention multiplies in fp32 (lean_decode.sdpa; torch's bf16 CPU kernel
    is ~6x slower at decode shapes), transformers' in bf16; both accumulate in fp32, so the logits of a
    prefill and four decode steps agree to bf16's rounding of the attention outputs."""
    ref, ours = _models()
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    expected = _decode(ref, DynamicCache(config=ref.config)).float()
    got = _decode(ours, hf_engine._reserved_cache(ours.config, capacity=7 + 4)).float()
    assert float((got - expected).abs().max()) <= 1e-2 * float(expected.abs().max())  # AMD EPYC: equal
    q, k, v = (torch.randn(3, h, 5, 32).to(torch.bfloat16) for h in (6, 2, 2))
    out = lean_decode.sdpa(q, k, v, None, 0.2, causal=True, gqa=True)
    assert out.dtype == torch.bfloat16
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), scale=0.2, is_causal=True, enable_gqa=True
    )
    assert torch.equal(out, exact.to(torch.bfloat16))


def test_reserved_cache_grows_past_its_reserve_and_selects_rows():
    ref, ours = _models()
    expected = _decode(ref, DynamicCache(config=ref.config), steps=6)
    got = _decode(ours, hf_engine._reserved_cache(ours.config, capacity=8))  # 7 + 6 > 8: grows
    torch.testing.assert_close(got, expected[:4], rtol=0, atol=0)
    cache = hf_engine._reserved_cache(ours.config, capacity=16)
    k = torch.arange(3 * 2 * 5 * 32, dtype=torch.float32).view(3, 2, 5, 32)
    cache.layers[0].update(k, -k)
    cache.batch_select_indices(torch.tensor([2, 2, 0]))  # repeats: the prefill expansion to n samples
    torch.testing.assert_close(cache.layers[0].keys, k[[2, 2, 0]])
    torch.testing.assert_close(cache.layers[0].values, -k[[2, 2, 0]])
    assert cache.get_seq_length() == 5


def test_distinct_prompts_map_each_row_to_its_prompt():
    rows = [(4, [1, 2]), (4, [1, 2]), (1, [3]), (4, [1, 2]), (1, [3])]
    unique, row_of = hf_engine.HFEngine._distinct_prompts(rows)
    assert unique == [[1, 2], [3]]
    assert row_of.tolist() == [0, 0, 1, 0, 1]


def test_packed_linears_follow_the_weights_and_undo_themselves():
    _, model = _models()
    ids, mask, pos = _batch()

    def logits():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits

    plain = logits()
    with hf_engine._packed_linears(model, rows=3) as weights:
        packed = logits()
    assert set(weights) == {m for m in model.modules() if isinstance(m, torch.nn.Linear)}  # one copy each
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)  # another kernel: rounding only
    torch.testing.assert_close(logits(), plain, rtol=0, atol=0)  # F.linear again after the block
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)  # a weight sync writes in place
    changed = logits()
    with hf_engine._packed_linears(model, rows=3):
        torch.testing.assert_close(logits(), changed, rtol=1e-5, atol=1e-5)  # packed from the new weights


def test_pack_weights_false_holds_no_copy():
    _, model = _models()
    with hf_engine._packed_linears(model, rows=3, enabled=False) as weights:
        assert weights == {}
        assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_compaction_keeps_at_least_min_decode_rows():
    keep = torch.tensor([False, True, False, False, False, True, False, False])
    rows = hf_engine.HFEngine._rows_to_keep(keep)
    assert len(rows) == hf_engine._MIN_DECODE_ROWS and set(rows.tolist()) >= {1, 5}  # both live rows
    assert rows.tolist() == sorted(rows.tolist())  # batch order kept
    assert hf_engine.HFEngine._rows_to_keep(torch.tensor([True, False])).tolist() == [0, 1]  # never past the batch
    live = torch.tensor([True] * 6 + [False] * 2)
    assert hf_engine.HFEngine._rows_to_keep(live).tolist() == list(range(6))  # enough live rows: only those


def _engine(tmp_path, eos: int):
    from types import SimpleNamespace

    _, model = _models()
    model.save_pretrained(tmp_path)
    cfg = SimpleNamespace(micro_batch_size=8, pack_weights=True)
    return hf_engine.HFEngine(str(tmp_path), cfg, "cpu", eos_token_id=eos, pad_token_id=0)


def test_decode_metrics_count_the_rows_each_step_carried(tmp_path, monkeypatch):
    from rlstack.rollout.base import SamplingParams

    prompts = [[5 + i, 17, 30 + 3 * i, 41, 60 - i] for i in range(6)]  # 6 rows, greedy: one answer each
    params = SamplingParams(greedy=True, max_new_tokens=12)
    engine = _engine(tmp_path / "never", eos=-1)  # no token stops a row: every step carries all 6
    free = engine.generate(prompts, params)
    m = engine.metrics()
    assert m["rollout/decode_steps"] == 11  # the first token of each row comes from the prefill
    assert m["rollout/decode_rows_mean"] == 6 and m["rollout/decode_live_share"] == 1.0

    # As EOS, the token most rows emit: each such row stops at its first one, the others run to the end.
    counts = collections.Counter(t for g in free for t in set(g.response_ids))
    eos = max(sorted(counts), key=counts.get)
    engine = _engine(tmp_path / "stops", eos=eos)
    carried = []  # rows of each decode forward, seen from outside the engine's counters
    step = lean_decode.LeanDecoder.step
    monkeypatch.setattr(
        lean_decode.LeanDecoder, "step", lambda self, t, *a: carried.append(len(t)) or step(self, t, *a)
    )
    gens = engine.generate(prompts, params)
    lengths = [len(g.response_ids) for g in gens]
    # each row ends at its first EOS or runs to the end (not compared with `free` token by token: the
    # compacted batch's matmuls round differently, and a near-tie could flip a greedy pick on another CPU)
    assert all(
        g.response_ids.index(eos) + 1 == len(g.response_ids) if eos in g.response_ids else len(g.response_ids) == 12
        for g in gens
    )
    assert 1 < counts[eos] < 6 and min(lengths) < max(lengths), lengths  # rows of different lengths
    m = engine.metrics()
    assert m["rollout/decode_steps"] == len(carried) == max(lengths) - 1
    assert m["rollout/decode_rows_mean"] == sum(carried) / len(carried) < 6  # stopped rows left the batch
    live = sum(lengths) - len(lengths)  # decoded rows that were still generating
    assert m["rollout/decode_live_share"] == live / sum(carried) < 1.0  # a stopped row kept to _MIN_DECODE_ROWS
    assert engine.metrics()["rollout/decode_steps"] == 0  # read once: the counters start again
