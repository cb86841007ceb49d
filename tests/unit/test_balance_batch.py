"""trainer.balance_batch: each DP rank's prompts chosen so the ranks hold about equal tokens, with
each prompt's samples together and the contiguous split's prompt counts (rlstack/stages.py)."""

from types import SimpleNamespace

from rlstack.rollout.base import Generation
from rlstack.stages import balanced_share, dp_share
from rlstack.workers.batch import split_for_rank


def test_balanced_share_equalises_tokens_with_the_same_counts():
    tokens = [500, 120, 130, 480, 90, 300, 310, 100, 95]  # contiguous halves: 1230 | 995 (+ one more)
    shares = [balanced_share(tokens, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(9))
    assert [len(s) for s in shares] == [len(split_for_rank(tokens, r, 2)) for r in range(2)] == [5, 4]
    loads = [sum(tokens[i] for i in s) for s in shares]
    contiguous = [sum(tokens[i] for i in split_for_rank(list(range(9)), r, 2)) for r in range(2)]
    assert max(loads) - min(loads) < max(contiguous) - min(contiguous)
    assert max(loads) - min(loads) <= max(tokens)  # greedy's bound
    assert all(s == sorted(s) for s in shares)


def _gen(prompt_index: int, prompt_len: int, response_len: int) -> Generation:
    return Generation(prompt_index, [1] * prompt_len, [2] * response_len, [-1.0] * response_len, "stop")


def test_dp_share_keeps_groups_together_and_reindexes():
    prompts = ["p0", "p1", "p2", "p3"]
    # 2 samples a prompt; prompts 0 and 1 are long, 2 and 3 short: contiguous would give rank 0 both long ones
    gens = [_gen(p, 10, r) for p, r in ((0, 50), (0, 40), (1, 45), (1, 49), (2, 5), (2, 6), (3, 4), (3, 8))]
    for rank in range(2):
        groups = SimpleNamespace(dp_rank=rank, dims=SimpleNamespace(dp=2))
        mine, mine_gens = dp_share(prompts, gens, groups, balance=True)
        assert len(mine) == 2 and len(mine_gens) == 4
        assert {p for p in mine} in ({"p0", "p2"}, {"p0", "p3"}, {"p1", "p2"}, {"p1", "p3"})
        for g in mine_gens:  # re-indexed into this rank's prompts; the samples of a prompt together
            assert 0 <= g.prompt_index < 2
            original = next(x for x in gens if x.response_ids == g.response_ids)  # lengths are unique
            assert prompts[original.prompt_index] == mine[g.prompt_index]
        contiguous, _ = dp_share(prompts, gens, groups)
        assert contiguous == prompts[2 * rank : 2 * rank + 2]


def test_shared_prompts_count_once_in_the_balance():
    # A: a 100-token prompt with two 1-token answers; B and C: 1-token prompts with long answers; D: short
    prompts = ["A", "B", "C", "D"]
    spec = {0: (100, (1, 1)), 1: (1, (60, 60)), 2: (1, (50, 50)), 3: (1, (1, 1))}
    gens = [_gen(p, plen, r) for p, (plen, rs) in spec.items() for r in rs]
    rank0 = SimpleNamespace(dp_rank=0, dims=SimpleNamespace(dp=2))
    # per row, A costs 202 tokens and pairs with D; run once, A costs 102: the long answers are split instead
    assert dp_share(prompts, gens, rank0, balance=True)[0] == ["A", "D"]
    assert dp_share(prompts, gens, rank0, balance=True, shared=True)[0] == ["B", "D"]
