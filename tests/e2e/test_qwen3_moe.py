"""End-to-end on CPU: a tiny Qwen3-MoE learns with GRPO at EP2, and its EP2 checkpoint resumes at EP1.

The fixture is tests/distributed/test_models_moe.py's (4 experts top-2, head_dim 32 with hidden 96).
EP2 on 2 ranks: each rank holds 2 of the 4 experts of every layer, tokens go to their experts by
all-to-all, and the hf rollout engine on each rank receives all 4 after every step.
"""

import os

import pytest

from tests.e2e.runs import read_metrics, torchrun_train, train_steps

pytestmark = pytest.mark.slow
STEPS = 30


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_tiny_qwen3_moe_grpo_learns_at_ep2_and_resumes_at_ep1(tmp_path, tiny_cache):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint
    from tests.distributed.test_models_moe import MOE

    hf_dir = ensure_tiny_checkpoint(TinySpec(**MOE), cache_dir=tiny_cache)
    out = str(tmp_path / "ep2")
    common = [f"model.path={hf_dir}", "checkpoint.keep_last=0"]
    torchrun_train(out, [*common, "parallel.ep=2", f"trainer.total_steps={STEPS}", f"checkpoint.save_every={STEPS}"])
    rows = train_steps(read_metrics(out))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first, last = _mean(rows[:5], "reward/mean"), _mean(rows[-10:], "reward/mean")
    assert last > first + 0.05 and last > 2 * first, (first, last)
    # every expert reaches the engine: it samples from the actor's current weights
    assert max(r["actor/rollout_diff_max"] for r in rows) < 1e-4
    # the router's load-balancing loss is reported each step (HF router_aux_loss_coef 0.001)
    assert all(r["actor/moe_load_balancing_loss"] > 0 for r in rows)
    assert all(abs(r["actor/moe_aux_loss"] - 0.001 * 2 * r["actor/moe_load_balancing_loss"]) < 1e-9 for r in rows)

    ckpt = os.path.join(out, "checkpoints", f"step_{STEPS:08d}")
    resumed_dir = str(tmp_path / "ep1")
    proc = torchrun_train(
        resumed_dir,
        [
            *common,
            "parallel.ep=1",
            f"trainer.total_steps={STEPS + 2}",
            "checkpoint.save_every=0",
            f"checkpoint.resume={ckpt}",
        ],
    )
    assert f"resumed from {ckpt} at step {STEPS}" in proc.stdout + proc.stderr
    resumed = train_steps(read_metrics(resumed_dir))
    assert [r["step"] for r in resumed] == [STEPS + 1, STEPS + 2]
    # each rank now holds all 4 experts, read from the two EP ranks' shards: the engine agrees with
    # the actor, and the policy is the trained one, not the random start
    assert max(r["actor/rollout_diff_max"] for r in resumed) < 1e-4
    assert _mean(resumed, "reward/mean") > 2 * first, (_mean(resumed, "reward/mean"), first)
