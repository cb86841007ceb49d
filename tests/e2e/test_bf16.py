"""bf16 mixed precision end to end on CPU: yaml_configs/tiny_cpu.yaml as PPO with model.dtype=bfloat16.

The actor, critic and reference hold bf16 weights (fp32 main params in the optimizer).
- With an fp32 engine (`rollout.dtype=float32`, what `auto` picks on CPUs without native bf16) the
  weights reach it through the weight sync, cast: rewards rise and the critic learns, every logged
  metric finite; engine vs actor log-prob agreement is logged each step and within the bf16 bound;
  a checkpoint of step 20 resumed in a fresh run repeats steps 21-24 exactly (same machine, layout).
- With a bf16 engine (`rollout.dtype=bfloat16`, `auto` on CPUs with avx512_bf16 / amx_bf16) the engine's
  weights are views of the actor's bf16 ones: 0 bytes synced, and the same agreement bound.
This CPU may lack native bf16 (it is emulated, slower): the runs stay tiny.
"""

import math
import os

import pytest

from benchmarks.device_check import BF16_LOGPROB_ATOL
from tests.e2e.runs import read_metrics, torchrun_train, train_steps

pytestmark = pytest.mark.slow
BF16 = ["model.dtype=bfloat16", "algorithm.name=ppo", "algorithm.actor_lr=3e-3", "algorithm.critic_lr=3e-3"]
FP32_ENGINE = ["rollout.dtype=float32"]
VOLATILE = ("timing/", "throughput/", "mem/", "sync/seconds")
# One token's worst |engine - actor| log-prob: bf16 logits carry ~3 significant digits, so a logit of
# magnitude ~10 is off by ~0.04; the mean over tokens (BF16_LOGPROB_ATOL) is far smaller.
BF16_LOGPROB_MAX = 0.15


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_bf16_ppo_learns_and_resumes_exactly(tmp_path):
    out = str(tmp_path / "bf16")
    torchrun_train(
        out, ["trainer.total_steps=40", "checkpoint.save_every=20", "checkpoint.keep_last=0", *BF16, *FP32_ENGINE]
    )
    rows = train_steps(read_metrics(out))
    assert [r["step"] for r in rows] == list(range(1, 41))
    bad = [(r["step"], k) for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
    assert not bad, bad
    first, last = _mean(rows[:5], "reward/mean"), _mean(rows[-10:], "reward/mean")
    assert last > first + 0.05 and last > 2 * first, (first, last)
    assert rows[-1]["critic/loss"] < rows[0]["critic/loss"]
    diffs = [r["actor/rollout_diff"] for r in rows]
    worst = max(r["actor/rollout_diff_max"] for r in rows)
    assert max(diffs) < BF16_LOGPROB_ATOL and worst < BF16_LOGPROB_MAX, (max(diffs), worst)
    assert worst > 1e-6  # a bf16 actor against the fp32 engine: the agreement is measured, not trivially 0

    step20 = os.path.join(out, "checkpoints", "step_00000020")
    resumed_dir = str(tmp_path / "resumed")
    proc = torchrun_train(
        resumed_dir,
        ["trainer.total_steps=24", "checkpoint.save_every=0", f"checkpoint.resume={step20}", *BF16, *FP32_ENGINE],
    )
    assert f"resumed from {step20} at step 20" in proc.stdout + proc.stderr
    resumed = {r["step"]: r for r in train_steps(read_metrics(resumed_dir))}
    assert sorted(resumed) == [21, 22, 23, 24]
    for step in (21, 22, 23, 24):
        expected = {k: v for k, v in rows[step - 1].items() if not k.startswith(VOLATILE)}
        got = {k: v for k, v in resumed[step].items() if not k.startswith(VOLATILE)}
        assert got == expected, step


def test_bf16_engine_holds_views_of_the_actor(tmp_path):
    out = str(tmp_path / "bf16_engine")
    torchrun_train(out, ["trainer.total_steps=3", *BF16, "rollout.dtype=bfloat16"])
    rows = train_steps(read_metrics(out))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sync/bytes"] == 0 for r in rows)  # zero copy: the engine reads the actor's bf16 tensors
    bad = [(r["step"], k) for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
    assert not bad, bad
    diffs = [r["actor/rollout_diff"] for r in rows]
    worst = max(r["actor/rollout_diff_max"] for r in rows)
    assert max(diffs) < BF16_LOGPROB_ATOL and worst < BF16_LOGPROB_MAX, (max(diffs), worst)
