"""DAPO dynamic sampling end to end (2 ranks under torchrun, CPU, yaml_configs/tiny_cpu.yaml).

The reward (tests/assets/dapo_half_constant_reward.py) makes every prompt with an even answer digit
a constant group: those are dropped and more rounds of prompts refill the batch (dapo/* metrics).
Overlong shaping is on too (one-token responses with a one-token buffer: each loses 0.5, logged
apart as reward/overlong_penalty). In split placement, a run SIGKILLed during step 4 and resumed from step 3 logs
steps 4-5 with exactly the metrics of the uninterrupted run: the extra rounds advanced the
checkpointed prompt sampler, and each round's sampling seed follows from (step, round).
Both placements: colocated, and split with staleness 0 (rank 0 trains, rank 1 rolls out; each extra
round is one more request to the rollout rank).
"""

import pytest

from tests.e2e.runs import kill_during_step_4, metrics_by_step, torchrun_train

DAPO = [
    "trainer.total_steps=5",
    "data.train_batch_size=8",
    "data.reward_fn_file=tests/assets/dapo_half_constant_reward.py",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
    "algorithm.filter_groups.max_num_gen_batches=8",
    "reward.overlong_buffer.enable=true",
    "reward.overlong_buffer.len=1",
    "reward.overlong_buffer.penalty_factor=0.5",
]
VOLATILE = ("timing/", "throughput/", "mem/", "sync/seconds", "sync/peak")
pytestmark = pytest.mark.slow


SPLIT = ["placement.rollout_ranks=1", "rollout.staleness=0", "logging.progress=false"]


@pytest.mark.parametrize("layout", [[], SPLIT], ids=["colocated", "split"])
def test_constant_groups_are_refilled_and_a_killed_run_resumes_exactly(tmp_path, layout):
    dapo = [*DAPO, *layout]
    reference = str(tmp_path / "reference")
    torchrun_train(reference, [*dapo, "checkpoint.save_every=0", "checkpoint.resume=never"], timeout=300)
    expected = metrics_by_step(reference, VOLATILE)
    assert sorted(expected) == [1, 2, 3, 4, 5]
    for step, m in expected.items():
        assert m["dapo/groups_kept"] == 8.0, step  # a full batch of varying groups every step
        assert m["dapo/groups_generated"] == 8.0 * m["dapo/gen_rounds"], step
        dropped_or_surplus = m["dapo/groups_dropped"] + m["dapo/groups_surplus"]
        assert m["dapo/groups_generated"] == m["dapo/groups_kept"] + dropped_or_surplus, step
        assert m["reward/overlong_penalty"] == -0.5 and m["reward/overlong_frac"] == 1.0, step
    assert sum(m["dapo/groups_dropped"] for m in expected.values()) > 0
    assert max(m["dapo/gen_rounds"] for m in expected.values()) > 1  # refilled by further rounds
    if not layout:  # suite time: the kill and resume once, in split placement (the seeds of its rounds
        return  # cross a process boundary there); colocated exact resume is tests/e2e/test_resume.py's

    run = str(tmp_path / "run")
    kill_during_step_4(run, [*dapo, "checkpoint.save_every=1"])
    proc = torchrun_train(run, [*dapo, "checkpoint.save_every=1", "checkpoint.resume=auto"], timeout=300)
    assert "at step 3" in proc.stdout + proc.stderr
    resumed = metrics_by_step(run, VOLATILE)
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    for step in (1, 2, 3, 4, 5):  # 1-3 were logged by the killed run, 4-5 after the resume
        assert resumed[step] == expected[step], f"step {step} differs from the uninterrupted run"
