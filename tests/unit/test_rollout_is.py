"""Truncated importance sampling on rollout log-probs (rlstack/algorithms/rollout_is.py), against hand-computed values."""

import math

import pytest
import torch

from rlstack.algorithms import is_metrics, policy_loss, rollout_is_weights

# two responses: row 0 has 3 response tokens, row 1 has 2 (then padding)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -7.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.2, float("nan")]])  # a NaN off the mask must not leak
# old - rollout: row 0: 0.5, -1.0, 0.0; row 1: 1.0, 0.2


def test_token_level_weights_are_truncated_ratios():
    w, stats = rollout_is_weights(OLD, ROLLOUT, MASK, "token", cap=2.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [2.0, math.exp(0.2), 0.0]])  # e^1 = 2.72 -> 2
    torch.testing.assert_close(w, expected)
    assert stats["is/units"].item() == 5
    assert stats["is/clipped_sum"].item() == 1  # only e^1.0 passed the cap
    total = math.exp(0.5) + math.exp(-1.0) + 1.0 + 2.0 + math.exp(0.2)
    assert stats["is/weight_sum"].item() == pytest.approx(total, rel=1e-6)
    assert stats["is/weight_max"].item() == pytest.approx(2.0)
    assert not w.requires_grad


def test_sequence_level_weight_is_the_truncated_product():
    w, stats = rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", cap=1.5)
    row0 = math.exp(0.5 - 1.0 + 0.0)  # 0.607, under the cap
    row1 = min(math.exp(1.0 + 0.2), 1.5)  # 3.32 -> 1.5
    expected = torch.tensor([[row0, row0, row0], [row1, row1, 0.0]])
    torch.testing.assert_close(w, expected)
    assert stats["is/units"].item() == 2  # sequences, not tokens
    assert stats["is/clipped_sum"].item() == 1
    assert stats["is/weight_sum"].item() == pytest.approx(row0 + row1, rel=1e-6)


def test_equal_policies_give_weight_one():
    w, stats = rollout_is_weights(OLD, OLD.clone(), MASK, "token", cap=2.0)
    torch.testing.assert_close(w, MASK)
    assert is_metrics(*(stats[k].item() for k in ("is/weight_sum", "is/clipped_sum", "is/units", "is/weight_max"))) == {
        "is/weight_mean": 1.0,
        "is/weight_max": 1.0,
        "is/clipped_frac": 0.0,
    }


def test_policy_loss_scales_each_token_by_its_weight():
    # on-policy ratio 1, no clipping: per-token loss = -A * w; token-mean over the 5 tokens
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    logprob = OLD.clone().requires_grad_(True)
    w, _ = rollout_is_weights(OLD, ROLLOUT, MASK, "token", cap=2.0)
    loss, _ = policy_loss(OLD, logprob, adv, MASK, 0.2, 0.2, 3.0, "token-mean", is_weights=w)
    expected = -(math.exp(0.5) + math.exp(-1.0) + 1.0 - 2.0 - math.exp(0.2)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    plain, _ = policy_loss(OLD, logprob, adv, MASK, 0.2, 0.2, 3.0, "token-mean")
    assert plain.item() == pytest.approx(-(3 - 2) / 5, rel=1e-6)


def test_bad_level_and_cap_raise():
    with pytest.raises(ValueError, match="token, sequence or decoupled"):
        rollout_is_weights(OLD, ROLLOUT, MASK, "none", cap=2.0)
    with pytest.raises(ValueError, match="cap"):
        rollout_is_weights(OLD, ROLLOUT, MASK, "token", cap=0.0)


def test_decoupled_level_drops_tokens_past_the_cap_instead_of_truncating():
    """AReaL's decoupled PPO behaviour weight: pi_prox / pi_behav per token, untruncated below the cap,
    0 above it (the token leaves the loss), each token its own behaviour log-prob."""
    w, stats = rollout_is_weights(OLD, ROLLOUT, MASK, "decoupled", cap=2.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [0.0, math.exp(0.2), 0.0]])  # e^1 = 2.72 dropped
    torch.testing.assert_close(w, expected)
    assert stats["is/units"].item() == 5 and stats["is/clipped_sum"].item() == 1
    total = math.exp(0.5) + math.exp(-1.0) + 1.0 + math.exp(0.2)
    assert stats["is/weight_sum"].item() == pytest.approx(total, rel=1e-6)
    assert stats["is/weight_max"].item() == pytest.approx(math.exp(0.5))
