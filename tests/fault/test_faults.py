"""Fault injection: each fault ends the run with the right exit code and message, and every
checkpoint left on disk still loads and holds finite weights (nothing saved is lost or poisoned)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.e2e.runs import read_metrics, train_steps
from tests.fault.checks import (
    assert_checkpoints_sound,
    finish,
    last_line,
    launch,
    metrics_lines,
    rank_process,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.fault]
SAVE = ["checkpoint.save_every=1", "checkpoint.keep_last=2"]


def _ckpts(out):
    return os.path.join(out, "checkpoints")


def test_diverging_learning_rate_stops_before_saving_nan(tmp_path):
    out = str(tmp_path / "div")
    text = finish(launch(out, ["algorithm.actor_lr=1e30", "trainer.total_steps=8", *SAVE]))
    line = last_line(text)
    assert line.startswith("error: training diverged at step "), text[-3000:]
    assert "actor/grad_norm is nan" in line and "trainer.on_nonfinite=skip" in line
    failed_step = int(line.split("step ")[1].split(":")[0])
    steps = assert_checkpoints_sound(_ckpts(out))
    assert steps and max(steps) == failed_step - 1  # the last finite step is kept, nothing after it


def test_diverging_learning_rate_with_skip_runs_on(tmp_path):
    out = str(tmp_path / "skip")
    proc = launch(out, ["algorithm.actor_lr=1e30", "trainer.total_steps=5", "trainer.on_nonfinite=skip", *SAVE])
    text = finish(proc)
    assert proc.returncode == 0, text[-3000:]
    assert "the update was skipped, weights unchanged (trainer.on_nonfinite=skip)" in text
    rows = train_steps(read_metrics(out))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert any(r.get("trainer/skipped_update") for r in rows)
    assert assert_checkpoints_sound(_ckpts(out)) == [5, 4]


def test_nan_reward_names_source_row_and_function(tmp_path):
    reward = tmp_path / "bad_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n"
    )
    out = str(tmp_path / "nan")
    proc = launch(out, [f"data.reward_fn_file={reward}", "trainer.total_steps=3", *SAVE])
    text = finish(proc)
    assert proc.returncode == 2, text[-3000:]
    line = last_line(text)
    assert line.startswith("error: ") and "nan" in line.lower(), line
    assert "compute_score" in line and "copy" in line and "row" in line, line
    assert assert_checkpoints_sound(_ckpts(out)) == []


def test_rerun_into_a_used_directory_destroys_nothing(tmp_path):
    out = str(tmp_path / "used")
    first = launch(out, ["trainer.total_steps=3", *SAVE])
    text = finish(first)
    assert first.returncode == 0, text[-3000:]
    before = {name: os.path.getmtime(os.path.join(_ckpts(out), name)) for name in os.listdir(_ckpts(out))}
    metrics_before = open(os.path.join(out, "metrics.jsonl")).read()

    again = launch(out, ["trainer.total_steps=3", "checkpoint.resume=never", *SAVE])
    text = finish(again)
    assert again.returncode == 2, text[-3000:]
    assert text.strip().splitlines() == [last_line(text)]  # one line, before anything starts
    assert "holds an earlier run" in text and "trainer.overwrite=true" in text, text
    assert {n: os.path.getmtime(os.path.join(_ckpts(out), n)) for n in os.listdir(_ckpts(out))} == before
    assert open(os.path.join(out, "metrics.jsonl")).read() == metrics_before
    assert assert_checkpoints_sound(_ckpts(out)) == [3, 2]

    done = launch(out, ["trainer.total_steps=3", *SAVE])  # resume=auto at total_steps: says so
    text = finish(done)
    assert done.returncode == 2 and "already reached step 3" in last_line(text), text[-2000:]

    fresh = launch(out, ["trainer.total_steps=2", "trainer.overwrite=true", *SAVE])
    text = finish(fresh)
    assert fresh.returncode == 0, text[-3000:]
    assert [r["step"] for r in train_steps(read_metrics(out))] == [1, 2]  # a clean history
    assert assert_checkpoints_sound(_ckpts(out)) == [2, 1]


def test_sigkill_of_one_rank_keeps_every_checkpoint_sound(tmp_path):
    out = str(tmp_path / "kill")
    proc = launch(out, ["trainer.total_steps=200", *SAVE])
    try:
        wait_for(lambda: metrics_lines(out) >= 3, what="three steps")
        rank_process(proc.pid, 1).send_signal(signal.SIGKILL)
    finally:
        text = finish(proc)
    assert proc.returncode != 0
    assert "rank 1" in text, text[-2000:]
    assert len(assert_checkpoints_sound(_ckpts(out))) >= 2


def test_sigterm_during_a_save_publishes_nothing_half_written(tmp_path):
    out = str(tmp_path / "term")
    proc = launch(out, ["trainer.total_steps=200", *SAVE])
    try:

        def saving():
            root = _ckpts(out)
            return os.path.isdir(root) and any(
                n.endswith(".tmp") and n.startswith("step_00000003") for n in os.listdir(root)
            )

        wait_for(saving, what="the third save to start", poll=0.01)
        # The first SIGTERM asks for a graceful stop (the launcher forwards it to the ranks); the second
        # stops at once, through torchrun, in the middle of the save.
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        text = finish(proc)
    # 143: the save was cut short; 75: it was published before the second signal landed
    assert proc.returncode in (128 + signal.SIGTERM, 75), text[-2000:]
    assert "stopped by SIGTERM" in text or "stopped to be resumed" in text
    steps = assert_checkpoints_sound(_ckpts(out))
    assert steps and max(steps) <= 3 and 2 in steps
    with open(os.path.join(_ckpts(out), f"step_{steps[0]:08d}", "trainer_state.json")) as f:
        assert json.load(f)["step"] == steps[0]


def test_stalled_rank_is_named(tmp_path):
    out = str(tmp_path / "stall")
    proc = launch(out, ["trainer.total_steps=200", "parallel.timeout_minutes=0.25"])
    victim = None
    try:
        wait_for(lambda: metrics_lines(out) >= 2, what="two steps")
        first, victim = rank_process(proc.pid, 0), rank_process(proc.pid, 1)
        victim.send_signal(signal.SIGSTOP)
        # Rank 0 names the silent rank and exits. A stopped process cannot take torchrun's SIGTERM
        # (torchrun would wait 30 s for it before its SIGKILL): the test kills it once rank 0 is gone.
        first.wait(timeout=240)
        victim.kill()
        text = finish(proc, timeout=240)
    finally:
        if victim is not None:
            try:
                victim.send_signal(signal.SIGCONT)
                victim.kill()
            except Exception:
                pass
        if proc.poll() is None:
            finish(proc, timeout=5)
    assert proc.returncode != 0
    assert "rank(s) 1 did not answer for 0.25 minutes (parallel.timeout_minutes)" in text, text[-3000:]
