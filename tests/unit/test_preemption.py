"""rlstack.preemption without processes: signal names, time limits, SLURM's end time, the flag."""

from __future__ import annotations

import os
import signal

import pytest

from rlstack import preemption
from rlstack.errors import UserError


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_JOB_END_TIME", "RLSTACK_IGNORE_SLURM", "RLSTACK_STOP_SLACK_S"):
        monkeypatch.delenv(var, raising=False)
    preemption.reset()
    yield
    preemption.reset()


def test_signal_names_and_numbers():
    assert preemption.signal_numbers(["SIGTERM", "usr1", "2"]) == [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT]
    with pytest.raises(UserError, match="trainer.stop_signals: unknown signal 'SIGNOPE'"):
        preemption.signal_numbers(["SIGNOPE"])
    with pytest.raises(UserError, match="SIGKILL cannot be caught"):
        preemption.signal_numbers(["SIGKILL"])


def test_a_first_signal_sets_the_flag_a_second_unwinds():
    old = signal.getsignal(signal.SIGUSR1)
    try:
        preemption.arm(["SIGUSR1"], grace_s=0)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.stop_requested() and preemption.reason() == "SIGUSR1"
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert e.value.code == 128 + signal.SIGUSR1
    finally:
        preemption.disarm(["SIGUSR1"])
        signal.signal(signal.SIGUSR1, old)


def test_max_wall_minutes_stops_when_a_step_and_a_save_no_longer_fit():
    d = preemption.Deadline(max_wall_minutes=10, start=1000.0)
    assert d.end == 1600.0 and d.what == "trainer.max_wall_minutes=10"
    # margin = 1.5 x (step + save) + 30 s slack
    assert not d.reached(now=1500.0, step_s=20.0, save_s=10.0)  # 1500 + 45 + 30 < 1600
    assert d.reached(now=1530.0, step_s=20.0, save_s=10.0)
    assert not preemption.Deadline(0, start=0.0).reached(now=1e12, step_s=1, save_s=1)


def test_slurm_end_time_from_the_environment_wins_when_earlier(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_END_TIME", "1300")
    d = preemption.Deadline(max_wall_minutes=10, start=1000.0)
    assert d.end == 1300.0 and d.what == "the SLURM job's time limit"
    monkeypatch.setenv("RLSTACK_IGNORE_SLURM", "1")
    assert preemption.Deadline(max_wall_minutes=10, start=1000.0).end == 1600.0


def test_slurm_end_time_from_squeue(monkeypatch, tmp_path):
    squeue = tmp_path / "squeue"
    squeue.write_text('#!/usr/bin/env bash\n[[ "$*" == "-h -j 7 -o %e" ]] && echo 2030-01-02T03:04:05\n')
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    import datetime

    expected = datetime.datetime(2030, 1, 2, 3, 4, 5).timestamp()
    assert preemption.slurm_end_time() == expected
    squeue.write_text("#!/usr/bin/env bash\necho N/A\n")
    assert preemption.slurm_end_time() is None


def test_exit_status_under_torchrun_restarts(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    assert preemption.exit_status() == 75
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")  # a non-zero exit would restart the ranks
    assert preemption.exit_status() == 0


def test_a_step_past_stop_grace_s_is_abandoned_with_the_resume_status(tmp_path):
    import subprocess
    import sys

    script = (
        "import os, signal, time\n"
        "from rlstack import preemption\n"
        "preemption.arm(['SIGUSR1'], grace_s=0.5, last_saved=4)\n"
        "preemption.begin_step(5)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(30)  # a step that does not finish\n"
        "raise SystemExit(0)\n"
    )
    env = dict(os.environ, RANK="0")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == preemption.RESUME_EXIT, proc.stderr
    assert (
        "error: step 5 abandoned: not finished 0.5 s after SIGUSR1 (trainer.stop_grace_s); nothing of it is "
        "saved, the checkpoint of step 4 stays and a resumed run repeats step 5"
    ) in proc.stderr
