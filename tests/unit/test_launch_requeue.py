"""launch/ppo.sh's side of stopping to be resumed: a warning signal goes to the ranks, a stopped run
exits 75, and under (a faked) SLURM with RLSTACK_REQUEUE=1 the job is requeued with scontrol."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.unit.test_launch import ROOT, _env, _finish, _free_port, _run_launcher, config  # noqa: F401

FAKE_STOP = """\
import json, os, signal, sys, time
if "--validate-only" in sys.argv:
    sys.exit(0)
rank = int(os.environ["RANK"])
out = os.environ["FAKE_OUT"]
def stop(signum, frame):
    if rank == 0:  # what rlstack.loop writes once the stop's checkpoint is published
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "stopped_to_resume.json"), "w") as f:
            json.dump({"step": 3, "reason": signal.Signals(signum).name}, f)
    sys.exit(75)
signal.signal(signal.SIGUSR1, stop)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(os.environ["FAKE_FLAGS"], f"ready{rank}"), "w").close()
time.sleep(120)
sys.exit(0)
"""


@pytest.fixture
def fake_stop(tmp_path):
    work = tmp_path / "work"
    (work / "rlstack").mkdir(parents=True)
    (work / "rlstack" / "__init__.py").write_text(f"__path__.append({os.path.join(ROOT, 'rlstack')!r})\n")
    (work / "rlstack" / "train.py").write_text(FAKE_STOP)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\necho "$@" >> "$SCONTROL_LOG"\n')
    (bin_dir / "scontrol").chmod(0o755)
    (tmp_path / "flags").mkdir()
    return str(work), str(bin_dir)


def _slurm_env(tmp_path, bin_dir, **extra):
    return _env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SCONTROL_LOG=str(tmp_path / "scontrol_log"),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node01",
        SLURM_NODEID="0",
        NPROC_PER_NODE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RLSTACK_VALIDATE="config",
        FAKE_OUT=str(tmp_path / "out"),
        FAKE_FLAGS=str(tmp_path / "flags"),
        OMP_NUM_THREADS="1",
        **extra,
    )


def _signal_when_ready(proc, tmp_path, signum):
    deadline = time.time() + 120
    while not all((tmp_path / "flags" / f"ready{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.time() < deadline, "the fake ranks never started"
        time.sleep(0.05)
    os.kill(proc.pid, signum)


@pytest.mark.parametrize("requeue", ["1", "0"])
def test_usr1_to_the_launcher_stops_to_resume_and_requeues(config, tmp_path, fake_stop, requeue):  # noqa: F811
    work, bin_dir = fake_stop
    env = _slurm_env(tmp_path, bin_dir, RLSTACK_REQUEUE=requeue)
    proc, timeout = _run_launcher([config], env, work)
    _signal_when_ready(proc, tmp_path, signal.SIGUSR1)  # SLURM's --signal=B:USR1@N warning
    rc, out, err = _finish(proc, timeout)
    assert rc == 75, err
    assert "stopped to be resumed" in err and '"reason": "SIGUSR1"' in err, err  # the ranks got USR1 itself
    log = tmp_path / "scontrol_log"
    if requeue == "1":
        assert log.read_text().split() == ["requeue", "4242"]
        assert "requeued SLURM job 4242" in err.strip().splitlines()[-1]
    else:
        assert not log.exists()


def test_no_requeue_outside_slurm(config, tmp_path, fake_stop):  # noqa: F811
    work, bin_dir = fake_stop
    env = _slurm_env(tmp_path, bin_dir, RLSTACK_REQUEUE="1", RLSTACK_IGNORE_SLURM="1")
    proc, timeout = _run_launcher([config], env, work)
    _signal_when_ready(proc, tmp_path, signal.SIGTERM)
    rc, out, err = _finish(proc, timeout)
    assert rc == 75, err
    assert not (tmp_path / "scontrol_log").exists()


def test_max_restarts_reaches_torchrun(config, tmp_path, fake_stop):  # noqa: F811
    import subprocess

    env = _env(RLSTACK_VALIDATE="config", NPROC_PER_NODE="2")
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "launch", "ppo.sh"), config, "--max-restarts", "3", "--print-cmd"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--max-restarts=3" in result.stdout.split()


def test_usr1_to_every_process_of_the_step_leaves_torchrun_alive(config, tmp_path, fake_stop):  # noqa: F811
    """srun and `scancel --signal=USR1` signal every process of the job step, torchrun and the console
    pipeline included; torchrun's default action for USR1 is to die (taking every rank with it): ppo.sh
    starts it with USR1 ignored, and the pipeline with TERM, INT and USR1 ignored. (The fake ranks get
    theirs from ppo.sh: they are not built to take two.)"""
    import psutil

    work, bin_dir = fake_stop
    proc, timeout = _run_launcher([config], _slurm_env(tmp_path, bin_dir), work)
    _signal_when_ready(proc, tmp_path, 0)  # the ranks are up (signal 0: nothing sent)
    for child in psutil.Process(proc.pid).children(recursive=True):
        if "rlstack.train" not in " ".join(child.cmdline()):  # torchrun, tee, grep
            child.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGUSR1)
    rc, out, err = _finish(proc, timeout)
    assert rc == 75, err
    launcher_log = (tmp_path / "out" / "torchrun_logs" / "node0" / "launcher.log").read_text()
    assert "exitcode  : 75" in launcher_log, err[-3000:]  # torchrun lived to report its ranks' exits
