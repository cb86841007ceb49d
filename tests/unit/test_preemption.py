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


@pytest.mark.parametrize(
    "env, grace, expected",
    [
        ({}, 600.0, 600.0),  # not under torchrun
        ({"TORCHELASTIC_RUN_ID": "x"}, 600.0, 20.0),  # raw torchrun: SIGKILL 30 s after forwarding, 10 s kept
        ({"TORCHELASTIC_RUN_ID": "x"}, 0.0, 20.0),  # 0 (wait forever) cannot hold either
        ({"TORCHELASTIC_RUN_ID": "x"}, 15.0, 15.0),  # already fits
        ({"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"}, 600.0, 90.0),
        ({"TORCHELASTIC_RUN_ID": "x", "PET_SHUTDOWN_TIMEOUT": "12"}, 600.0, 6.0),  # half, when 10 s is most of it
        ({"TORCHELASTIC_RUN_ID": "x", "RLSTACK_SIGNALS_TO_RANKS": "1"}, 600.0, 600.0),  # launch/ppo.sh
    ],
)
def test_stop_grace_is_clamped_below_torchruns_kill_delay(monkeypatch, env, grace, expected):
    for var in (
        "TORCHELASTIC_RUN_ID",
        "RLSTACK_SIGNALS_TO_RANKS",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
        "PET_SHUTDOWN_TIMEOUT",
    ):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert preemption.clamp_grace(grace) == expected


def test_torchruns_own_shutdown_timeout_flag_is_read_from_its_command_line(monkeypatch, tmp_path):
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(
        b"\0".join([b"python", b"-m", b"torch.distributed.run", b"--shutdown-timeout", b"300", b"-m", b"rlstack.train"])
    )
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: real_open(cmdline if str(path).endswith("/cmdline") else path, *a, **k)
    )
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.delenv("RLSTACK_SIGNALS_TO_RANKS", raising=False)
    assert preemption.torchrun_kill_delay() == 300.0
    assert preemption.clamp_grace(600.0) == 290.0


def test_an_engine_line_names_the_engine_the_rank_the_step_and_what_stays(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    preemption.begin_step(3)
    line = preemption.engine_line("vllm", "lost its vLLM process (pid 7, killed by SIGKILL) during step 3's generate")
    assert line == (
        "rollout engine vllm on rank 1 lost its vLLM process (pid 7, killed by SIGKILL) during step 3's generate: "
        "stopped; nothing of step 3 is saved, the last checkpoint stays and a resumed run repeats step 3"
    )  # a rollout-only rank does not know which checkpoint the training ranks saved
    old = signal.getsignal(signal.SIGUSR1)
    try:
        preemption.arm(["SIGUSR1"], grace_s=0, last_saved=2)  # a training rank
        assert "the checkpoint of step 2 stays" in preemption.engine_line("hf", "did not finish")
    finally:
        preemption.disarm(["SIGUSR1"])
        signal.signal(signal.SIGUSR1, old)


def test_a_rollout_ranks_stop_signal_travels_in_its_hand_over_and_stops_the_training_ranks(monkeypatch):
    from rlstack import collectives, placement

    old = signal.getsignal(signal.SIGUSR1)
    pl = type("Pl", (), {"rank": 1, "full": None, "world_size": 2})()
    batch = placement.RolloutBatch([], 3, 1.0, 0.0, 4.0)
    try:
        preemption.arm(["SIGUSR1"], grace_s=0, trains=False)
        assert placement._flagged(batch, pl) is batch and placement._flagged(None, pl) is None  # no signal yet
        os.kill(os.getpid(), signal.SIGUSR1)
        flagged = placement._flagged(batch, pl)
        assert flagged.stop == "SIGUSR1 on rollout rank 1" and flagged.version == 3
        assert placement._flagged(None, pl).stop == "SIGUSR1 on rollout rank 1"  # a rank that hands over nothing
    finally:
        preemption.disarm(["SIGUSR1"])
        signal.signal(signal.SIGUSR1, old)
    preemption.reset()  # the training rank's side
    monkeypatch.setattr(collectives, "all_gather_objects", lambda obj, group, n: [None, flagged])
    client = placement.RolloutClient(pl, None, None)
    got, _ = client.receive()
    assert got.stop == "" and got.version == 3
    assert preemption.stop_requested() and preemption.reason() == "SIGUSR1 on rollout rank 1"


def test_other_ranks_linger_after_a_stop_so_rank_0_exits_first_and_every_rank_reports_75():
    import subprocess
    import sys
    import time

    script = "from rlstack import preemption\nprint('ready', flush=True)\npreemption.linger(1)\nraise SystemExit(9)\n"
    env = dict(os.environ, TORCHELASTIC_RUN_ID="x", TORCHELASTIC_MAX_RESTARTS="0")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    time.sleep(1.0)  # torchrun, once rank 0 exited 75, SIGTERMs the lingering rank
    assert proc.poll() is None, "rank 1 did not wait for rank 0"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == preemption.RESUME_EXIT
    env.pop("TORCHELASTIC_RUN_ID")  # not under torchrun: nothing to wait for
    assert subprocess.run([sys.executable, "-c", script], env=env, timeout=30).returncode == 9


def test_the_same_signal_again_within_seconds_under_torchrun_is_the_same_stop(monkeypatch):
    """srun/scancel signal every process of the step and ppo.sh and torchrun forward it too: a rank gets
    one stop several times within a second. Outside torchrun a second signal stops at once (above)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RLSTACK_SIGNALS_TO_RANKS", "1")  # no clamp message
    old = signal.getsignal(signal.SIGTERM)
    try:
        preemption.arm(["SIGTERM", "SIGUSR1"], grace_s=0)
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.stop_requested() and preemption.reason() == "SIGTERM"
        with pytest.raises(SystemExit):  # another signal is not a duplicate
            os.kill(os.getpid(), signal.SIGUSR1)
        preemption._state.received_at -= preemption.DUPLICATE_S  # later: a deliberate second signal
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGTERM)
        assert e.value.code == 128 + signal.SIGTERM
    finally:
        preemption.disarm(["SIGTERM", "SIGUSR1"])
        signal.signal(signal.SIGTERM, old)
