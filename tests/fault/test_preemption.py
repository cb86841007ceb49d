"""Stopping to be resumed (rlstack/preemption.py): a stop signal to the launcher or to one rank, a
time limit, torchrun's restarts. Each run saves its last complete step, exits 75, and the resumed
run's metrics equal an uninterrupted run's exactly (one machine computes both)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from rlstack.preemption import RESUME_EXIT, STOPPED_FILE
from tests.e2e.runs import NUMERIC_KEYS, read_metrics, train_steps
from tests.fault.checks import assert_checkpoints_sound, finish, launch, metrics_lines, rank_process, wait_for

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
    return _numeric(out)


def _numeric(out: str) -> dict[int, dict]:
    rows = {}
    for row in train_steps(read_metrics(out)):
        assert row["step"] not in rows, f"step {row['step']} logged twice"
        rows[row["step"]] = {k: row[k] for k in NUMERIC_KEYS if k in row}
    return rows


def _stop_then_resume(out: str, reference: dict, send) -> tuple[int, str]:
    """Start a run, call send(proc) once step 2 is logged, check the stop, resume, compare. -> stop step, log."""
    proc = launch(out, RUN)
    try:
        wait_for(lambda: metrics_lines(out) >= 2, timeout=240, what="two steps", poll=0.02)
        send(proc)
    finally:
        text = finish(proc)
    assert proc.returncode == RESUME_EXIT, text[-3000:]
    with open(os.path.join(out, STOPPED_FILE)) as f:
        stopped = json.load(f)
    step = stopped["step"]
    assert 2 <= step < STEPS, stopped
    assert assert_checkpoints_sound(os.path.join(out, "checkpoints")) == [step]  # save_every=1000: the stop's
    assert f"after step {step} of {STEPS}: checkpoint saved to" in text, text[-3000:]
    assert "stopped to be resumed" in text and "exit 75" in text
    first = _numeric(out)
    assert sorted(first) == list(range(1, step + 1))

    again = launch(out, RUN)
    text2 = finish(again)
    assert again.returncode == 0, text2[-3000:]
    assert f"at step {step}" in text2
    resumed = _numeric(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # every step once
    assert {s: resumed[s] for s in range(step + 1, STEPS + 1)} == {s: reference[s] for s in range(step + 1, STEPS + 1)}
    return step, text


def test_sigterm_to_the_launcher_saves_the_step_and_exits_75(tmp_path, reference):
    step, text = _stop_then_resume(str(tmp_path / "term"), reference, lambda p: os.kill(p.pid, signal.SIGTERM))
    assert "stopped by SIGTERM" in text


def test_sigusr1_to_one_rank_stops_every_rank(tmp_path, reference):
    step, text = _stop_then_resume(
        str(tmp_path / "usr1"), reference, lambda p: rank_process(p.pid, 1).send_signal(signal.SIGUSR1)
    )
    assert "stopped by another rank's stop signal" in text  # rank 0's line: the signal reached rank 1 only
