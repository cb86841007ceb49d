"""Stopping to be resumed (rlstack/preemption.py): a stop signal to the launcher or to one rank, a
time limit, torchrun's restarts. Each run saves its last complete step, exits 75, and the resumed
run's metrics equal an uninterrupted run's exactly (one machine computes both)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from rlstack.preemption import ENGINE_EXIT, RESUME_EXIT, STOPPED_FILE
from tests.e2e.runs import read_metrics, train_steps
from tests.fault.checks import (
    assert_checkpoints_sound,
    finish,
    last_line,
    launch,
    launch_torchrun,
    metrics_lines,
    numeric_by_step,
    rank_process,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.fault]
STEPS = 8
RUN = [f"trainer.total_steps={STEPS}", "checkpoint.save_every=1000", "checkpoint.keep_last=0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run's numeric metrics by step."""
    out = str(tmp_path_factory.mktemp("ref") / "run")
    proc = launch(out, RUN)
    text = finish(proc)
    assert proc.returncode == 0, text[-3000:]
    return numeric_by_step(out)


def _stop_then_resume(out: str, reference: dict, send, start=launch, status=RESUME_EXIT) -> tuple[int, str]:
    """Start a run, call send(proc) once step 2 is logged, check the stop, resume, compare. -> stop step, log."""
    proc = start(out, RUN)
    try:
        wait_for(lambda: metrics_lines(out) >= 2, timeout=240, what="two steps", poll=0.02)
        send(proc)
    finally:
        text = finish(proc)
    assert proc.returncode == status, text[-3000:]
    with open(os.path.join(out, STOPPED_FILE)) as f:
        stopped = json.load(f)
    step = stopped["step"]
    assert 2 <= step < STEPS, stopped
    assert assert_checkpoints_sound(os.path.join(out, "checkpoints")) == [step]  # save_every=1000: the stop's
    assert f"after step {step} of {STEPS}: checkpoint saved to" in text, text[-3000:]
    assert "stopped to be resumed" in text and "exit 75" in text
    first = numeric_by_step(out)
    assert sorted(first) == list(range(1, step + 1))

    again = launch(out, RUN)
    text2 = finish(again)
    assert again.returncode == 0, text2[-3000:]
    assert f"at step {step}" in text2
    resumed = numeric_by_step(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # every step once
    assert {s: resumed[s] for s in range(step + 1, STEPS + 1)} == {s: reference[s] for s in range(step + 1, STEPS + 1)}
    return step, text


@pytest.mark.parametrize("launcher", ["ppo.sh", "torchrun"])
def test_sigterm_to_the_launcher_saves_the_step_and_exits_75(tmp_path, reference, launcher):
    """launch/ppo.sh sends the signal to the ranks only; raw torchrun forwards it and SIGKILLs its workers
    30 s later, so there the ranks clamp trainer.stop_grace_s (said in the log) and exit 75 in time;
    torchrun itself then exits 1 (any worker's non-zero exit), the checkpoint and the resume as with ppo.sh."""
    start, status = (launch, RESUME_EXIT) if launcher == "ppo.sh" else (launch_torchrun, 1)
    term = lambda p: os.kill(p.pid, signal.SIGTERM)  # noqa: E731
    step, text = _stop_then_resume(str(tmp_path / "term"), reference, term, start, status)
    assert "stopped by SIGTERM" in text
    clamped = "trainer.stop_grace_s=600 is clamped to 20 s" in text
    assert clamped == (launcher == "torchrun"), text[-3000:]


def test_sigusr1_to_one_rank_stops_every_rank(tmp_path, reference):
    step, text = _stop_then_resume(
        str(tmp_path / "usr1"), reference, lambda p: rank_process(p.pid, 1).send_signal(signal.SIGUSR1)
    )
    assert "stopped by another rank's stop signal" in text  # rank 0's line: the signal reached rank 1 only


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    out = str(tmp_path / "full")
    root = os.path.join(out, "checkpoints")
    monkeypatch.setenv("RLSTACK_FAULT_ENOSPC_STEP", "3")  # the save of step 3 fails as a full disk would
    proc = launch(out, ["trainer.total_steps=6", "checkpoint.save_every=1", "checkpoint.keep_last=0"])
    text = finish(proc)
    assert proc.returncode == 3, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
    assert errors[0] == last_line(text)
    assert errors[0].startswith(f"error: no space left on the device saving the checkpoint of step 3 in {root}: ")
    assert "it needs about " in errors[0] and "MiB free (the size of step_00000002)" in errors[0], errors[0]
    assert "step_00000002 stays intact and `latest` names it" in errors[0], errors[0]
    assert assert_checkpoints_sound(root) == [2, 1]
    assert open(os.path.join(root, "latest")).read().strip() == "step_00000002"
    assert not [n for n in os.listdir(root) if n.endswith(".tmp")], os.listdir(root)


def test_a_hung_rollout_engine_stops_the_run_and_the_resume_repeats_the_step(tmp_path, monkeypatch, reference):
    out = str(tmp_path / "hang")
    save = ["checkpoint.save_every=1", "checkpoint.keep_last=0"]
    monkeypatch.setenv("RLSTACK_FAULT_ROLLOUT_HANG_STEP", "3")
    proc = launch(out, [*RUN, *save, "rollout.timeout_s=10"])
    text = finish(proc)
    assert proc.returncode == ENGINE_EXIT, text[-3000:]
    line = last_line(text)
    assert "rollout engine hf on rank " in line and "did not finish step 3's generation" in line, line
    assert "rollout.timeout_s=10" in line and "the checkpoint of step 2 stays" in line, line
    assert assert_checkpoints_sound(os.path.join(out, "checkpoints")) == [2, 1]  # nothing of step 3
    assert sorted(numeric_by_step(out)) == [1, 2]

    monkeypatch.delenv("RLSTACK_FAULT_ROLLOUT_HANG_STEP")
    again = launch(out, [*RUN, *save, "rollout.timeout_s=10"])
    text = finish(again)
    assert again.returncode == 0, text[-3000:]
    resumed = numeric_by_step(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert {s: resumed[s] for s in range(3, STEPS + 1)} == {s: reference[s] for s in range(3, STEPS + 1)}


def test_max_wall_minutes_saves_and_stops_in_time(tmp_path):
    out = str(tmp_path / "wall")
    # 45 s: the margin is 1.5 x (step + last save) + 30 s of slack, which also covers the first save
    proc = launch(out, ["trainer.total_steps=200", "checkpoint.save_every=1000", "trainer.max_wall_minutes=0.75"])
    text = finish(proc)
    assert proc.returncode == RESUME_EXIT, text[-3000:]
    with open(os.path.join(out, STOPPED_FILE)) as f:
        stopped = json.load(f)
    assert stopped["reason"] == "the time limit (trainer.max_wall_minutes=0.75)", stopped
    assert stopped["time"] <= stopped["deadline"], stopped  # saved and published before the limit
    step = stopped["step"]
    assert 1 <= step < 200
    assert assert_checkpoints_sound(os.path.join(out, "checkpoints")) == [step]
    assert sorted(numeric_by_step(out)) == list(range(1, step + 1))


def test_a_killed_rank_restarts_from_the_checkpoint_with_max_restarts(tmp_path):
    out = str(tmp_path / "restart")
    proc = launch(out, ["--max-restarts", "1", "trainer.total_steps=6", "checkpoint.save_every=2"])
    try:
        wait_for(lambda: metrics_lines(out) >= 3, timeout=240, what="three steps", poll=0.02)
        rank_process(proc.pid, 1).send_signal(signal.SIGKILL)
    finally:
        text = finish(proc)
    assert proc.returncode == 0, text[-3000:]
    rows = train_steps(read_metrics(out))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], [r["step"] for r in rows]  # every step once
    restarted = [r for r in rows if "trainer/restarts" in r]
    assert len(restarted) == 1 and restarted[0]["trainer/restarts"] == 1.0, restarted
    assert restarted[0]["step"] in (3, 5) and restarted[0]["trainer/steps_repeated"] >= 1.0, restarted
    assert assert_checkpoints_sound(os.path.join(out, "checkpoints")) == [6, 4]
