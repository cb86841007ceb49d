"""Rows that share a prompt (model.prefix_sharing): which rows share (packing.prompt_groups), how they are
dealt into micro-batches (whole, balanced on the tokens they run), and the packed layout by hand
(PackedRows.of with prefix rows: segments, RoPE positions, the gather back to [b, S] and its gradient)."""

import torch

from megatron_bridge.shared_prefix import shared_prefix_of, suffix_mask
from rlstack.workers.batch import pack_micro_batches
from rlstack.workers.packing import PackedRows, prompt_groups


def _rows(spec, S=8):
    """spec: (prompt tokens, response length) per row -> tokens, resp_mask, position_ids, lengths."""
    B = len(spec)
    tokens = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S)
    for i, (prompt, r) in enumerate(spec):
        p = len(prompt)
        tokens[i, :p] = torch.tensor(prompt)
        tokens[i, p : p + r] = 90 + i
        mask[i, p : p + r] = 1
    lengths = torch.tensor([len(p) + r for p, r in spec])
    return tokens, mask, torch.arange(S).expand(B, S).clone(), lengths


def test_rows_share_only_an_equal_prompt_with_tokens_past_it():
    spec = [([1, 2, 3], 2), ([1, 2], 3), ([1, 2, 3], 4), ([4, 5], 1), ([1, 2, 3], 1), ([4, 5], 0), ([4, 5], 2)]
    tokens, mask, pos, lengths = _rows(spec)
    pos[6] = torch.arange(8) + 1  # positions not 0, 1, ...: RoPE could not rotate its suffix from its row
    groups = prompt_groups(tokens, mask, pos, lengths)
    # [1, 2] is a prefix of [1, 2, 3] but another prompt; row 5 has no response token; row 6 shifted
    assert groups == [([0, 2, 4], 3), ([1], 0), ([3], 0), ([5], 0), ([6], 0)]


def test_units_are_dealt_whole_and_balanced_on_the_tokens_they_run():
    spec = [([1, 2, 3, 4], 2), ([5, 6], 1), ([1, 2, 3, 4], 3), ([5, 6], 4), ([7], 5), ([1, 2, 3, 4], 1)]
    tokens, mask, pos, lengths = _rows(spec, S=10)
    units = prompt_groups(tokens, mask, pos, lengths)
    assert units == [([0, 2, 5], 4), ([1, 3], 2), ([4], 0)]
    mbs = pack_micro_batches({"tokens": tokens}, 3, lengths, balance=True, units=units)
    # unit costs: 4 + 2 + 3 + 1 = 10, 2 + 1 + 4 = 7, 6: the largest first, each to the lightest micro-batch
    assert [b["tokens"].shape for b in mbs.batches] == [(3, 7), (3, 6)]
    assert mbs.order.tolist() == [2, 0, 5, 3, 1, 4]  # each unit longest row first (its prompt's holder)
    # a long prompt with short answers (A) costs its prompt once: dealt by row tokens, A (33) would pair with
    # D and B (24) with C; by the tokens run, B (23) goes first, A (13) joins C (10), D joins B
    a, b = list(range(1, 11)), [20]
    spec = [(a, 1), (b, 11), (a, 1), ([30, 31], 8), (b, 11), (a, 1), ([40], 8)]
    tokens, mask, pos, lengths = _rows(spec, S=12)
    units = prompt_groups(tokens, mask, pos, lengths)
    assert units == [([0, 2, 5], 10), ([1, 4], 1), ([3], 0), ([6], 0)]
    mbs = pack_micro_batches({"tokens": tokens}, 4, lengths, balance=True, units=units)
    assert [sorted(rows) for rows in mbs.order.split([3, 4])] == [[1, 4, 6], [0, 2, 3, 5]]


def test_a_token_budget_takes_units_whole_and_cuts_one_only_where_it_ends():
    spec = [([1, 2, 3, 4], 2), ([5, 6], 1), ([1, 2, 3, 4], 3), ([5, 6], 4), ([7], 5), ([1, 2, 3, 4], 1)]
    tokens, mask, pos, lengths = _rows(spec, S=10)  # lengths 6, 3, 7, 6, 6, 5
    units = prompt_groups(tokens, mask, pos, lengths)
    # 21 slots: the first unit's 3 rows (3 x 7), then rows 3, 4 (2 x 6) and row 1 (3 x 6 = 18)
    mbs = pack_micro_batches({"tokens": tokens}, 3, lengths, max_tokens=21, units=units)
    assert [b["tokens"].shape for b in mbs.batches] == [(3, 7), (3, 6)]
    assert mbs.order.tolist() == [2, 0, 5, 3, 1, 4]
    # 14 slots: 2 rows of 7; the first unit is cut after its second row, its third row leads the next
    mbs = pack_micro_batches({"tokens": tokens}, 3, lengths, max_tokens=14, units=units)
    assert [b["tokens"].shape[0] for b in mbs.batches] == [2, 2, 2]
    assert mbs.order.tolist() == [2, 0, 5, 3, 1, 4]
    without = pack_micro_batches({"tokens": tokens}, 3, lengths, max_tokens=14)
    assert without.order.tolist() == [2, 0, 3, 4, 5, 1]  # longest first: the unit's rows apart


def test_packed_layout_by_hand():
    # rows (length): 0 (6), 1 (5) sharing row 0's first 3 tokens, 2 (2) on its own, 3 (4) sharing 3 of row 0
    lengths, S = torch.tensor([6, 5, 2, 4]), 6
    packed = PackedRows.of(lengths, S, "cpu", torch.tensor([-1, 0, -1, 0]), torch.tensor([0, 3, 0, 3]))
    assert packed.params.cu_seqlens_q.tolist() == [0, 6, 8, 10, 11]  # segments 6, 2, 2, 1
    assert packed.params.max_seqlen_q == 6
    assert packed.index.tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 12, 13, 21]
    shared = shared_prefix_of(packed.params.cu_seqlens_q)
    assert shared.prefix_start == [0, 0, 0, 0] and shared.prefix_len == [0, 3, 0, 3]
    assert shared.positions.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 0, 1, 3]
    y = torch.arange(11.0, requires_grad=True)
    rows = packed.unpack(y.view(1, 11, 1)).squeeze(-1)
    assert rows.tolist() == [
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 6, 7, 0],  # the prompt's outputs, then its own; 0 past its length
        [8, 9, 0, 0, 0, 0],
        [0, 1, 2, 10, 0, 0],
    ]
    rows.sum().backward()
    assert y.grad.tolist() == [3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1]  # the shared prompt gets every row's gradient
    assert suffix_mask(2, 3, "cpu").tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    plain = PackedRows.of(lengths, S, "cpu")
    assert plain.gather is None and shared_prefix_of(plain.params.cu_seqlens_q) is None
