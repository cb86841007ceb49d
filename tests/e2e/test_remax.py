"""ReMax end to end (2 ranks under torchrun, CPU, yaml_configs/tiny_cpu.yaml): the greedy baseline
(rlstack/step/remax.py) reaches the trainer's advantages. With one-token responses, on-policy and
token-mean aggregation the policy-gradient loss is -mean(advantage) = mean(baseline) - mean(reward)."""

import pytest

from tests.e2e.runs import read_metrics, torchrun_train, train_steps

pytestmark = pytest.mark.slow


def test_the_greedy_baseline_reaches_the_advantages(tmp_path):
    out = str(tmp_path / "remax")
    torchrun_train(out, ["trainer.total_steps=3", "data.train_batch_size=8", "algorithm.adv_estimator=remax"])
    rows = train_steps(read_metrics(out))
    assert len(rows) == 3
    for m in rows:
        expected = m["reward/remax_baseline_mean"] - m["reward/mean"]
        assert m["actor/pg_loss"] == pytest.approx(expected, abs=1e-6), m["step"]
    assert any(m["reward/remax_baseline_mean"] != m["reward/mean"] for m in rows)  # not trivially 0 = 0
