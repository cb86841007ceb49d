"""Nothing a user saved is lost (issue 32), through real runs of launch/ppo.sh on the tiny config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.e2e.runs import ROOT, read_metrics, train_steps
from tests.fault.checks import finish, last_line, launch, metrics_lines, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.fault]
SAVE = ["checkpoint.save_every=1", "checkpoint.keep_last=2"]


def _tree(path):
    """Every file's bytes, less the logs a run appends to."""
    found = {}
    for dirpath, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if d not in ("logs", "torchrun_logs")]
        for name in names:
            full = os.path.join(dirpath, name)
            found[os.path.relpath(full, path)] = open(full, "rb").read()
    return found


def _validate(out, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "rlstack.train", "--config", "yaml_configs/tiny_cpu.yaml", "--validate-only"]
        + ["--world-size", "2", f"trainer.output_dir={out}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_overwrite_with_a_run_time_failure_keeps_the_earlier_run_whole(tmp_path):
    out = str(tmp_path / "run")
    first = launch(out, ["trainer.total_steps=2", *SAVE])
    text = finish(first)
    assert first.returncode == 0, text[-3000:]
    before = _tree(out)
    assert "checkpoints/step_00000002/.complete" in before or any(k.startswith("checkpoints/step_") for k in before)

    reward = tmp_path / "raises.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    1 / 0\n")
    again = launch(out, ["trainer.total_steps=2", "trainer.overwrite=true", f"data.reward_fn_file={reward}", *SAVE])
    text = finish(again)
    assert again.returncode == 2, text[-3000:]
    assert "ZeroDivisionError" in last_line(text)
    assert "Root Cause" not in text and "ChildFailedError" not in text  # no torchrun failure box
    assert "put back as it was" in text
    assert _tree(out) == before  # checkpoints, metrics, config.yaml: byte for byte

    # A resume into that run with a different actor model is refused before anything is written.
    other = _validate(out, "checkpoint.resume=auto", "trainer.total_steps=4", "model.tiny.hidden_size=64")
    assert other.returncode == 2, other.stdout + other.stderr
    assert "different actor model" in other.stderr.strip().splitlines()[-1]
    done = _validate(out, "checkpoint.resume=auto", "trainer.total_steps=2")
    assert done.returncode == 2 and "already complete" in done.stderr, done.stderr


def test_a_second_run_is_refused_and_ranks_die_with_their_launcher(tmp_path):
    out = str(tmp_path / "run")
    proc = launch(out, ["trainer.total_steps=400"])
    try:
        wait_for(lambda: metrics_lines(out) >= 2, what="two steps")
        second = launch(out, ["trainer.total_steps=400"])
        text = finish(second)
        assert second.returncode == 2, text[-3000:]
        line = last_line(text)
        assert "in use by a live run" in line and "PID " in line and "since " in line, line
        assert text.strip().splitlines()[-1] == line

        torchrun = next(
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if "torch.distributed.run" in " ".join(c.cmdline())
        )
        ranks = torchrun.children(recursive=True)
        assert len(ranks) >= 2
        torchrun.send_signal(signal.SIGKILL)  # the launcher alone, as the OOM killer would
        time.sleep(15)
        alive = [r.pid for r in ranks if r.is_running() and r.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], f"ranks {alive} outlived their launcher"
    finally:
        finish(proc, timeout=60)
    steps = [r["step"] for r in train_steps(read_metrics(out))]
    assert steps == list(range(1, len(steps) + 1)), steps  # every step once: the second run wrote nothing
