"""Micro-batches cut to their own longest row: rows sorted by length, cut, and put back in order."""

import torch

from rlstack.workers.batch import Rollout, pack_micro_batches


def _rollout() -> Rollout:
    prompts = [[5, 6, 7], [5, 6], [8, 9, 10, 11], [3]]
    responses = [[1], [2, 2, 2, 2, 2, 2], [4, 4], [9, 9, 9]]
    logprobs = [[-0.5] * len(r) for r in responses]
    return Rollout.build(prompts, responses, logprobs, [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1], 0, 3, "cpu", True)


def test_needed_lengths_end_at_each_rows_last_response_token():
    r = _rollout()  # 4 rows rounded up to 6 (micro-batch 3): two filler rows
    assert r.tokens.shape == (6, 8)
    assert r.needed_lengths().tolist() == [4, 8, 6, 4, 0, 0]


def test_micro_batches_are_sorted_cut_and_restored():
    r = _rollout()
    batch = r.tensors("tokens", "resp_mask")
    mbs = pack_micro_batches(batch, 3, r.needed_lengths())
    assert [mb["tokens"].shape for mb in mbs.batches] == [(3, 8), (3, 4)]  # 8+6+4 | 4+0+0: cut to 4, not 8
    assert mbs.order.tolist() == [1, 2, 0, 3, 4, 5]  # longest first, ties in row order
    for mb, rows in zip(mbs.batches, (mbs.order[:3], mbs.order[3:])):
        width = mb["tokens"].shape[1]
        assert torch.equal(mb["tokens"], batch["tokens"][rows, :width])
        assert torch.equal(mb["resp_mask"], batch["resp_mask"][rows, :width])
    # Per-row outputs come back in the rollout's row order, zero past each cut.
    stats = [{"x": mb["tokens"].float()} for mb in mbs.batches]
    back = mbs.rows(stats, "x")
    assert back.shape == (6, 8)
    needed = r.needed_lengths()
    for row in range(6):
        n = int(needed[row])
        assert torch.equal(back[row, :n], batch["tokens"][row, :n].float())
    assert torch.equal(back[3, 4:], torch.zeros(4))  # cut at its micro-batch's longest (4)


def test_without_lengths_rows_stay_in_order_and_uncut():
    r = _rollout()
    mbs = pack_micro_batches(r.tensors("tokens"), 3, None)
    assert mbs.order.tolist() == list(range(6))
    assert all(mb["tokens"].shape == (3, 8) for mb in mbs.batches)
    assert torch.equal(mbs.rows([{"t": mb["tokens"]} for mb in mbs.batches], "t"), r.tokens)


def test_balanced_micro_batches_hold_near_equal_tokens():
    """balance=True (rows that run packed): rows dealt longest first to the micro-batch with the
    fewest tokens; as many micro-batches as micro_batch_size rows make, every row once."""
    lengths = torch.tensor([139, 139, 139, 134, 111, 108, 105, 102, 100, 99, 98, 96, 92, 88, 88, 79])
    batch = {"tokens": torch.arange(16 * 139).view(16, 139)}
    fixed = pack_micro_batches(batch, 8, lengths)
    balanced = pack_micro_batches(batch, 8, lengths, balance=True)
    assert sorted(balanced.order.tolist()) == list(range(16)) and len(balanced.batches) == 2
    sums = []
    start = 0
    for mb in balanced.batches:
        rows = balanced.order[start : start + mb["tokens"].shape[0]]
        start += len(rows)
        assert mb["tokens"].shape[1] == int(lengths[rows].max()) == int(lengths[rows[0]])  # longest first, cut
        assert torch.equal(mb["tokens"], batch["tokens"][rows, : mb["tokens"].shape[1]])
        sums.append(int(lengths[rows].sum()))
    assert sum(sums) == int(lengths.sum()) and max(sums) - min(sums) <= int(lengths.min())
    # the fixed split puts the 8 longest together: its largest micro-batch holds more tokens
    assert max(sums) < int(lengths[fixed.order[:8]].sum())
