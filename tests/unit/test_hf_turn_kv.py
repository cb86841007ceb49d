"""The hf engine's turn cache (`HFEngine.keep_turn_kv`, rollout.multi_turn.kv_cache_mb): an agent's
next turn reuses the KV its earlier turns left and prefills only the new ids, and generates what a
whole-context prefill generates (the same tokens greedy, the same log-probs to float rounding)."""

import contextlib
from types import SimpleNamespace

import torch

from rlstack.rollout.base import SamplingParams
from rlstack.rollout.hf_engine import HFEngine, TurnKV


def _kv(n: int, heads: int = 2, dim: int = 4, layers: int = 2):
    return [(torch.full((heads, n, dim), float(i)), torch.full((heads, n, dim), -float(i))) for i in range(layers)]


def test_the_longest_kept_prefix_is_found_leaves_a_token_to_prefill_and_leaves_the_cache():
    kv = TurnKV(budget_bytes=1 << 20)
    assert kv.put([1, 2, 3], _kv(3)) and kv.put([1, 2, 3, 4, 5], _kv(5)) and kv.put([9, 9], _kv(2))
    assert not kv.put([1, 2, 3], _kv(3))  # the same ids twice: kept once
    assert kv.used == 4 * (2 * 2 * 2 * 4) * (3 + 5 + 2)  # fp32 bytes: layers x (K, V) x heads x dim x tokens
    found = kv.take([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5], [7, 1, 2, 3, 4], [9, 9, 1]])
    # longest prefix [1..5]; [1..5] itself leaves nothing to prefill -> its longest shorter one [1, 2, 3];
    # no prefix at the start -> None; [9, 9] matches
    assert [f.length if f is not None else None for f in found] == [5, 3, None, 2]
    assert found[0].layers[1][0].shape == (2, 5, 4)
    assert kv.entries == {} and kv.lengths == {} and kv.used == 0  # every entry found left the cache
    assert kv.take([[1, 2, 3, 4]]) == [None]


def test_rows_over_the_budget_are_not_kept():
    one = 4 * (2 * 2 * 2 * 4) * 2  # bytes of _kv(2): fp32, layers x (K, V) x heads x dim x tokens
    kv = TurnKV(budget_bytes=one + 1)
    assert kv.put([1, 2], _kv(2))
    assert not kv.put([3, 4], _kv(2))  # no room left: this row re-prefills
    assert [f is not None for f in kv.take([[1, 2, 5], [3, 4, 5]])] == [True, False]
    assert kv.put([3, 4], _kv(2))  # room again once a kept row is taken


def _engine(model_dir, mbs=32):
    cfg = SimpleNamespace(micro_batch_size=mbs, pack_weights=True)
    return HFEngine(model_dir, cfg, "cpu", eos_token_id=-1, pad_token_id=0, seed=0)


PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65], [1, 70], [1, 80, 81, 82], [1, 90, 91]]
CAPS = [2, 2, 9, 5, 9, 3]  # rows stop at different steps: the batch drops finished rows mid-turn
INSERTED = [[7, 8, 9], [10], [11, 12, 13, 14], [15, 16], [17, 18, 19, 20, 21], [22]]


def _two_turns(engine, keep: bool):
    greedy = SamplingParams(greedy=True, max_new_tokens=9)
    with engine.keep_turn_kv(1 << 30) if keep else contextlib.nullcontext():
        first = engine.generate(PROMPTS, greedy, max_new_tokens=CAPS)
        engine.metrics()
        contexts = [p + g.response_ids + ins for p, g, ins in zip(PROMPTS, first, INSERTED)]
        contexts.append([1, 33, 34, 35])  # a context with no history: prefilled whole beside the others
        second = engine.generate(contexts, greedy, max_new_tokens=[6] * len(contexts))
        return first, contexts, second, engine.metrics()


def test_a_turn_on_kept_kv_generates_what_a_whole_prefill_generates_and_prefills_only_the_new_ids(model_dir):
    first_ref, contexts, second_ref, plain = _two_turns(_engine(model_dir), keep=False)
    first, contexts_kept, second, kept = _two_turns(_engine(model_dir), keep=True)
    assert [g.response_ids for g in first] == [g.response_ids for g in first_ref]
    assert contexts_kept == contexts
    for g, r in zip(second, second_ref):
        assert g.response_ids == r.response_ids and g.finish_reason == r.finish_reason
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), rtol=1e-5, atol=1e-5)
    # each continued row reuses its context and all its response but the last token (never fed)
    reused = sum(len(p) + len(g.response_ids) - 1 for p, g in zip(PROMPTS, first))
    assert kept["rollout/kv_reused_tokens"] == reused and plain["rollout/kv_reused_tokens"] == 0
    assert plain["rollout/prefill_tokens"] == sum(len(c) for c in contexts)
    assert kept["rollout/prefill_tokens"] == sum(len(c) for c in contexts) - reused


def test_kept_kv_across_micro_batches_and_without_room_changes_nothing_but_the_prefill(model_dir):
    _, _, second_ref, _ = _two_turns(_engine(model_dir), keep=False)
    # micro-batches of 2 rows: each turn's rows meet other rows than at the last turn
    _, _, second, stats = _two_turns(_engine(model_dir, mbs=2), keep=True)
    assert stats["rollout/kv_reused_tokens"] > 0
    for g, r in zip(second, second_ref):
        assert g.response_ids == r.response_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), rtol=1e-5, atol=1e-5)
    engine = _engine(model_dir)
    with engine.keep_turn_kv(0):  # rollout.multi_turn.kv_cache_mb=0: off
        assert engine._turn_kv is None
    assert engine._turn_kv is None and engine._held_pack is None
