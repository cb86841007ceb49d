"""End-to-end on CPU with `rollout.zero_copy=true`: the engine reads the actor's tensors, and learns."""

import pytest

from tests.e2e.runs import read_metrics, torchrun_train, train_steps

pytestmark = pytest.mark.slow


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_tiny_reward_rises_with_zero_copy(tmp_path):
    out = str(tmp_path / "zero_copy")
    torchrun_train(out, ["trainer.total_steps=40", "rollout.zero_copy=true", "rollout.verify_sync=10"])
    rows = train_steps(read_metrics(out))
    assert [r["step"] for r in rows] == list(range(1, 41))
    first, last = _mean(rows[:5], "reward/mean"), _mean(rows[-10:], "reward/mean")
    assert last > first + 0.05 and last > 2 * first, (first, last)
    for r in rows:  # every tensor is a view of the actor's (TP1 x PP1, float32 on both sides)
        assert r["sync/bytes"] == 0 and r["sync/engine_weight_bytes"] == 0, r
        assert r["sync/aliased_bytes"] > 0, r
        # rollout.pack_weights (default): oneDNN copies of the linear weights, held while generating only
        assert 0 < r["rollout/packed_weight_bytes"] < r["sync/aliased_bytes"], r
    assert all(r["sync/verify_max_diff"] <= 1e-3 for r in rows if "sync/verify_max_diff" in r)
    assert sum("sync/verify_max_diff" in r for r in rows) == 4
    # the engine samples from the actor's current weights
    assert max(r["actor/rollout_diff_max"] for r in rows) < 1e-4
