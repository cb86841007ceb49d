"""Observability (issue 10): logging, trackers, resource monitor, progress bars, plot command."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlstack.observability import logging as rlog
from rlstack.observability.logging import format_step_line, print_rank0, setup_logging
from rlstack.observability.monitor import ResourceMonitor, memory_limit_bytes, peak_rss_gib
from rlstack.observability.progress import progress
from rlstack.observability.trackers import JsonlTracker, build_trackers

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def clean_logger():
    """setup_logging configures the process-wide "rlstack" logger: undo it after each test."""
    yield
    log = logging.getLogger(rlog.LOGGER_NAME)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.propagate = True
    log.setLevel(logging.NOTSET)
    rlog._state["rank"] = None


def run_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ----------------------------------------------------------------------------- logging


def test_step_line_has_fixed_order_and_skips_missing_keys():
    metrics = {
        "mem/rss_gib": 3.21,
        "actor/loss": -0.013,
        "reward/mean": 0.4123,
        "actor/kl": 0.0012,
        "critic/loss": 0.21,
        "timing/step_s": 4.14,
        "throughput/rollout_tok_s": 812.4,
        "actor/entropy": 1.0,
    }
    assert format_step_line(3, metrics) == (
        "step 3 | reward 0.412 | kl 0.0012 | loss -0.013 | vf_loss 0.21 | step_s 4.1 | rss 3.2G"
    )
    assert format_step_line(3, metrics, total_steps=40, eta_s=3725).startswith("step 3/40 | reward 0.412")
    assert format_step_line(3, metrics, total_steps=40, eta_s=3725).endswith(" | vf_loss 0.21 | rss 3.2G | eta 1:02:05")
    assert format_step_line(7, {"actor/kl": 0.5}) == "step 7 | kl 0.5"


def test_a_full_step_line_fits_the_console_under_torchruns_prefix():
    """PPO with validation on a GPU at step 200/200: the line stays within 100 columns (120 with the
    `[default0]:` prefix and the time), leaving out the length, the step time, the RSS and the validation accuracy first (metrics.jsonl has
    them all; seen: a PPO line of 123 columns)."""
    metrics = {
        "reward/mean": 0.004,
        "actor/kl": 0.0514,
        "actor/loss": -4.79e-05,
        "critic/loss": 31.4,
        "val/accuracy": 0.125,
        "response/length_mean": 100.0,
        "timing/step_s": 10.8,
        "mem/rss_gib": 10.0,
        "mem/gpu_peak_gib": 70.1,
    }
    line = format_step_line(200, metrics, total_steps=200, eta_s=36003)
    assert len(line) <= 100, (len(line), line)
    assert line == "step 200/200 | reward 0.004 | kl 0.0514 | loss -4.79e-05 | vf_loss 31.4 | gpu 70.1G | eta 10:00:03"
    short = format_step_line(2, {"reward/mean": 0.5, "response/length_mean": 3.0}, total_steps=6, eta_s=3)
    assert short == "step 2/6 | reward 0.500 | len 3.0 | eta 0:00:03"  # nothing left out when it fits


def test_rank0_logs_to_console_and_file_other_ranks_to_file_only(tmp_path, capsys):
    log = setup_logging(str(tmp_path), rank=0)
    log.info("entering rollout")
    logging.getLogger("rlstack.monitor").warning("memory high")
    out, err = capsys.readouterr()
    assert " entering rollout" in out and "INFO" not in out and "memory high" not in out
    assert "WARNING memory high" in err
    text = (tmp_path / "logs" / "rank0.log").read_text()
    assert "rank0 INFO rlstack: entering rollout" in text
    assert "rank0 WARNING rlstack.monitor: memory high" in text

    log = setup_logging(str(tmp_path), rank=1)  # a second call replaces the handlers
    log.info("rank one speaks")
    print_rank0("only rank 0 prints this")
    out, err = capsys.readouterr()
    assert out == "" and err == ""
    assert "rank1 INFO rlstack: rank one speaks" in (tmp_path / "logs" / "rank1.log").read_text()
    assert "rank one speaks" not in (tmp_path / "logs" / "rank0.log").read_text()


def test_level_filters_and_bad_level_is_a_user_error(tmp_path, capsys):
    log = setup_logging(None, rank=0, level="WARNING")
    log.info("hidden")
    print_rank0("shown")
    assert capsys.readouterr().out == "shown\n"
    assert not (tmp_path / "logs").exists()
    with pytest.raises(ValueError, match="use DEBUG, INFO, WARNING or ERROR"):
        setup_logging(None, rank=0, level="LOUD")


GUARD_SCRIPT = """
    from rlstack.config import load_config
    from rlstack.observability.logging import setup_logging, user_error_guard
    log = setup_logging("run", rank={rank})
    def main():
        log.info("parsing config")
        {body}
    user_error_guard(main, rank={rank}, log=log)
"""


def test_user_error_prints_one_line_on_rank0_and_traceback_to_file(tmp_path):
    body = 'load_config(None, ["data.synthetic=arith", "trainer.totl_steps=3"])'
    proc = run_python(GUARD_SCRIPT.format(rank=0, body=body), tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: unknown config key 'trainer.totl_steps': did you mean 'trainer.total_steps'?"
    ]
    assert proc.stdout.splitlines()[-1].endswith(" parsing config")
    text = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "ERROR rlstack: user error: unknown config key" in text
    assert "Traceback (most recent call last)" in text and "ConfigError" in text


def test_user_error_on_another_rank_alone_is_said_once_after_rank_0s_chance(tmp_path):
    """Rank 0 says a shared mistake and torchrun stops the others in their wait; a rank still alive
    after it found the mistake alone (its own data shard, a lock read mid-write) and says it."""
    body = 'load_config(None, ["data.synthetic=arith", "trainer.totl_steps=3"])'
    proc = run_python(GUARD_SCRIPT.format(rank=1, body=body), tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: rank 1: unknown config key 'trainer.totl_steps': did you mean 'trainer.total_steps'?"
    ]
    assert "Traceback (most recent call last)" in (tmp_path / "run" / "logs" / "rank1.log").read_text()


def test_other_errors_keep_their_traceback_and_exit_1(tmp_path):
    proc = run_python(GUARD_SCRIPT.format(rank=0, body='raise RuntimeError("bug here")'), tmp_path)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "RuntimeError: bug here" in proc.stderr
    text = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "ERROR rlstack: internal error (bug): RuntimeError: bug here" in text
    assert proc.stderr.count("Traceback (most recent call last)") == 1 and "this is a bug in rlstack" in proc.stderr


def test_user_error_guard_returns_the_result_and_finds_the_file_from_a_child_logger(tmp_path):
    assert rlog.user_error_guard(lambda: 41 + 1, rank=0) == 42
    assert rlog.log_file_path() is None
    setup_logging(str(tmp_path), rank=2)
    assert rlog.log_file_path(logging.getLogger("rlstack.train")) == str(tmp_path / "logs" / "rank2.log")


# ----------------------------------------------------------------------------- trackers


def test_jsonl_lines_are_flushed_and_parseable(tmp_path):
    import numpy as np
    import torch

    path = tmp_path / "sub" / "metrics.jsonl"
    tracker = JsonlTracker(str(path))
    tracker.log({"reward/mean": torch.tensor(0.5), "actor/kl": np.float32(0.25), "note": "x"}, step=1)
    tracker.log({"actor/loss": float("nan"), "step": 99}, step=2)
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # before close: flushed
    assert rows == [{"step": 1, "reward/mean": 0.5, "actor/kl": 0.25, "note": "x"}, {"step": 2, "actor/loss": None}]
    with pytest.raises(TypeError, match="'bad' is list"):
        tracker.log({"bad": [1, 2]}, step=3)
    tracker.close()


def test_build_trackers_writes_jsonl_tensorboard_and_console(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    setup_logging(str(tmp_path), rank=0)
    trackers = build_trackers(["console", "tensorboard"], str(tmp_path), rank=0)
    for step in (1, 2):
        trackers.log({"reward/mean": 0.1 * step, "actor/kl": 0.01}, step=step)
    trackers.close()
    assert capsys.readouterr().out.splitlines()[-1].endswith("step 2 | reward 0.200 | kl 0.01")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = acc.Scalars("reward/mean")
    assert [e.step for e in scalars] == [1, 2]
    assert [e.value for e in scalars] == pytest.approx([0.1, 0.2])


def test_other_ranks_get_a_noop_tracker_and_jsonl_is_always_on(tmp_path):
    quiet = build_trackers(["console", "jsonl", "tensorboard"], str(tmp_path / "r1"), rank=1)
    quiet.log({"reward/mean": 1.0}, step=1)
    quiet.close()
    assert not (tmp_path / "r1").exists()
    loud = build_trackers([], str(tmp_path / "r0"), rank=0)
    loud.log({"reward/mean": 1.0}, step=1)
    loud.close()
    assert json.loads((tmp_path / "r0" / "metrics.jsonl").read_text()) == {"step": 1, "reward/mean": 1.0}
    with pytest.raises(ValueError, match="unknown tracker 'neptune'"):
        build_trackers(["neptune"], str(tmp_path), rank=0)


def test_wandb_missing_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ValueError, match="pip install wandb"):
        build_trackers(["wandb"], str(tmp_path), rank=0)


def test_wandb_tracker_forwards_metrics(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    class FakeWandb:
        @staticmethod
        def init(**kwargs):
            calls.append(("init", kwargs))
            return Run()

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    trackers = build_trackers(["wandb"], str(tmp_path), rank=0, config_dict={"a": 1}, run_name="r")
    trackers.log({"reward/mean": 0.5}, step=4)
    trackers.close()
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert calls[0] == (
        "init",
        {"project": "rlstack", "name": "r", "config": {"a": 1}, "dir": str(tmp_path), "id": run_id, "resume": "allow"},
    )
    assert calls[1:] == [("log", {"reward/mean": 0.5}, 4), ("finish",)]


def _fake_wandb(monkeypatch, calls):
    class Run:
        def __init__(self, run_id):
            self.id = run_id

        def log(self, metrics, step):
            calls.append(("log", self.id, step))

        def finish(self):
            calls.append(("finish", self.id))

    class FakeWandb:
        @staticmethod
        def init(**kwargs):
            calls.append(("init", kwargs["id"], kwargs["resume"]))
            return Run(kwargs["id"])

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)


def test_wandb_resumes_the_same_run_after_a_restart(tmp_path, monkeypatch):
    calls = []
    _fake_wandb(monkeypatch, calls)
    first = build_trackers(["wandb"], str(tmp_path), rank=0)
    first.log({"reward/mean": 0.1}, step=1)
    first.close()  # the run is killed or ends; a restart builds the trackers again
    second = build_trackers(["wandb"], str(tmp_path), rank=0)
    second.log({"reward/mean": 0.2}, step=2)
    second.close()
    run_id = calls[0][1]
    assert calls == [
        ("init", run_id, "allow"),
        ("log", run_id, 1),
        ("finish", run_id),
        ("init", run_id, "allow"),
        ("log", run_id, 2),
        ("finish", run_id),
    ]
    assert second.trackers[1].resumed and not first.trackers[1].resumed
    other = build_trackers(["wandb"], str(tmp_path / "elsewhere"), rank=0)  # another directory: another run
    assert other.trackers[1].run_id != run_id
    fresh = build_trackers(["wandb"], str(tmp_path), rank=0, resume=False)  # asked for a new run
    assert fresh.trackers[1].run_id != run_id
    assert (tmp_path / "wandb_run_id").read_text().strip() == fresh.trackers[1].run_id


def test_wandb_offline_mode_resumes(tmp_path, monkeypatch):
    """With the real wandb in offline mode (skipped where wandb is not installed)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = build_trackers(["wandb"], str(tmp_path), rank=0)
    first.log({"reward/mean": 0.1}, step=1)
    first.close()
    second = build_trackers(["wandb"], str(tmp_path), rank=0)
    assert second.trackers[1].run_id == first.trackers[1].run_id
    second.close()


class _FakeMlflow:
    """Records calls the way the mlflow module would see them."""

    def __init__(self):
        self.calls, self.runs = [], 0

    def set_tracking_uri(self, uri):
        self.calls.append(("uri", uri))

    def set_experiment(self, name):
        self.calls.append(("experiment", name))

    def start_run(self, run_id=None, run_name=None):
        import types

        if run_id is None:
            self.runs += 1
            run_id = f"run{self.runs}"
        self.calls.append(("start", run_id, run_name))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id))

    def log_params(self, params):
        self.calls.append(("params", params))

    def log_metrics(self, metrics, step):
        self.calls.append(("metrics", metrics, step))

    def end_run(self):
        self.calls.append(("end",))


def test_mlflow_tracker_logs_and_resumes(tmp_path, monkeypatch):
    fake = _FakeMlflow()
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = build_trackers(
        ["mlflow"],
        str(tmp_path),
        rank=0,
        config_dict={"algorithm": {"lr": 1e-6}, "x": "y" * 900},
        project="proj",
        run_name="r",
    )
    first.log({"reward/mean": 0.5, "note": "text", "flag": True}, step=3)
    first.close()
    second = build_trackers(["mlflow"], str(tmp_path), rank=0, project="proj")
    second.close()
    uri = "file:" + str(tmp_path / "mlruns")
    assert fake.calls == [
        ("uri", uri),
        ("experiment", "proj"),
        ("start", "run1", "r"),
        ("params", {"algorithm.lr": "1e-06", "x": "y" * 500}),
        ("metrics", {"reward/mean": 0.5, "flag": 1.0}, 3),
        ("end",),
        ("uri", uri),
        ("experiment", "proj"),
        ("start", "run1", None),
        ("end",),  # the same run again
    ]
    assert (tmp_path / "mlflow_run_id").read_text().strip() == "run1"


def test_mlflow_missing_is_a_user_error(tmp_path, monkeypatch):
    from rlstack.errors import UserError

    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(UserError, match="pip install mlflow"):
        build_trackers(["mlflow"], str(tmp_path), rank=0)


def test_mlflow_real_file_store(tmp_path, monkeypatch):
    """The real mlflow, when installed: metrics land in the local store and a restart continues."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = build_trackers(["mlflow"], str(tmp_path), rank=0, config_dict={"a": 1})
    first.log({"reward/mean": 0.5}, step=1)
    first.close()
    second = build_trackers(["mlflow"], str(tmp_path), rank=0)
    second.log({"reward/mean": 0.7}, step=2)
    second.close()
    run_id = second.trackers[1].run_id
    assert run_id == first.trackers[1].run_id
    history = mlflow.tracking.MlflowClient().get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.7)]


# ----------------------------------------------------------------------------- monitor


def test_monitor_warns_once_per_crossing(caplog):
    monitor = ResourceMonitor(warn_fraction=1e-6)
    with caplog.at_level(logging.INFO, logger="rlstack"):
        first = monitor.sample()
        monitor.sample()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].name == "rlstack.monitor"
    assert "past logging.memory_warn_fraction=1e-06" in warnings[0].getMessage()
    assert "micro_batch_size" in warnings[0].getMessage()
    assert {"mem/rss_gib", "mem/rss_peak_gib", "mem/system_used_frac"} <= set(first)
    assert 0 < first["mem/rss_gib"] <= first["mem/rss_peak_gib"] + 1e-3
    assert 0 < first["mem/system_used_frac"] < 1

    caplog.clear()
    monitor.warn_fraction = 1.0  # usage drops below: re-armed, silent
    with caplog.at_level(logging.INFO, logger="rlstack"):
        monitor.sample()
        monitor.warn_fraction = 1e-6  # crosses again: warns again
        monitor.sample()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_monitor_uses_total_bytes_and_counts_children(caplog):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        monitor = ResourceMonitor(warn_fraction=0.999, total_bytes=1)  # any RSS passes 1 byte
        with caplog.at_level(logging.WARNING, logger="rlstack"):
            metrics = monitor.sample()
    finally:
        child.kill()
        child.wait()
    assert metrics["mem/children_rss_gib"] > 0
    assert len(caplog.records) == 1 and "of 0.0 GiB" in caplog.records[0].getMessage()


def test_monitor_sample_goes_to_the_rank_file_not_the_console(tmp_path, capsys):
    setup_logging(str(tmp_path), rank=0)
    ResourceMonitor(warn_fraction=1.0).sample()
    out, err = capsys.readouterr()
    assert "mem/rss_gib" not in out + err
    assert "INFO rlstack.monitor: mem/rss_gib" in (tmp_path / "logs" / "rank0.log").read_text()


def test_memory_helpers():
    import psutil

    assert 0 < memory_limit_bytes() <= psutil.virtual_memory().total
    rss_gib = psutil.Process().memory_info().rss / 1024**3
    assert peak_rss_gib() >= rss_gib * 0.99
    assert peak_rss_gib(include_children=True) >= peak_rss_gib()
    with pytest.raises(ValueError, match="memory_warn_fraction"):
        ResourceMonitor(warn_fraction=0.0)


# ----------------------------------------------------------------------------- progress


def test_progress_bar_only_on_rank0_when_enabled(capsys, monkeypatch):
    import rlstack.observability.progress as progress_module

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(progress_module, "PROGRESS_DELAY_S", 0.0)
    assert list(progress([1, 2, 3], "rollout", rank=0)) == [1, 2, 3]
    assert "rollout" in capsys.readouterr().err
    assert list(progress([1, 2, 3], "rollout", rank=1)) == [1, 2, 3]
    with progress(5, "validation", enabled=False, rank=0) as bar:
        bar.update(5)
        bar.set_postfix(acc=0.5)
    assert capsys.readouterr() == ("", "")
    with progress(4, "validation", rank=0) as bar:
        bar.update(4)
        assert bar.n == 4 and bar.total == 4
    assert "validation" in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    with progress(4, "validation", rank=0) as bar:  # not a terminal (torchrun's --tee, a file): no bar
        bar.update(4)
    assert capsys.readouterr() == ("", "")


def test_progress_bar_on_a_terminal_only_past_its_delay(capsys, monkeypatch):
    import rlstack.observability.progress as progress_module

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with progress(4, "validation", rank=0) as bar:  # a stage shorter than the delay shows nothing
        bar.update(4)
    assert "validation" not in capsys.readouterr().err
    monkeypatch.setattr(progress_module, "PROGRESS_DELAY_S", 0.0)
    with progress(4, "validation", rank=0) as bar:
        bar.update(4)
    assert "validation" in capsys.readouterr().err


# ----------------------------------------------------------------------------- plot


def write_metrics(run_dir: Path, rows: list[dict], tail: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail
    (run_dir / "metrics.jsonl").write_text(text)


def test_read_metrics_keeps_last_row_per_step_and_tolerates_a_cut_last_line(tmp_path):
    from rlstack.plot import read_metrics

    write_metrics(tmp_path, [{"step": 2, "a": 1}, {"step": 1, "a": 0}, {"step": 2, "a": 5}], tail='{"step": 3, "a"')
    assert read_metrics(str(tmp_path / "metrics.jsonl")) == [{"step": 1, "a": 0}, {"step": 2, "a": 5}]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_metrics(str(tmp_path / "metrics.jsonl"))


def test_plot_writes_pngs_from_metrics(tmp_path, capsys):
    from rlstack.plot import main

    rows = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "reward/std": 0.05,
            "actor/kl": 0.001 * s,
            "actor/loss": -0.01,
            "critic/loss": 0.2 / s,
            "throughput/rollout_tok_s": 800.0 + s,
            "timing/step_s": 4.0,
            "val/accuracy": 0.5 if s % 2 == 0 else None,
        }
        for s in range(1, 7)
    ]
    rows[2]["val/accuracy/gsm8k"] = 0.3
    write_metrics(tmp_path / "run", rows)
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "png")]) == 0
    names = {"reward", "kl", "losses", "val_accuracy", "throughput", "timing"}
    assert sorted(capsys.readouterr().out.split()) == sorted(str(tmp_path / "png" / f"{n}.png") for n in names)
    for name in names:
        data = (tmp_path / "png" / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_plot_without_metrics_is_one_line_error(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "rlstack.plot", str(tmp_path / "nothing")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: {tmp_path / 'nothing' / 'metrics.jsonl'} not found: pass the run's trainer.output_dir, "
        "which holds metrics.jsonl"
    ]


# ----------------------------------------------------------------------------- all together


def test_tiny_run_writes_metrics_events_and_charts(tmp_path, capsys):
    from rlstack.plot import plot_run

    run = tmp_path / "run"
    log = setup_logging(str(run), rank=0)
    trackers = build_trackers(["console", "jsonl", "tensorboard"], str(run), rank=0)
    monitor = ResourceMonitor(warn_fraction=0.85)
    for step in range(1, 4):
        log.info(f"step {step}: rollout")
        tokens = sum(1 for _ in progress(range(8), "rollout", rank=0))
        metrics = {
            "reward/mean": step / 4,
            "actor/kl": 0.001 * step,
            "actor/loss": -0.01,
            "throughput/rollout_tok_s": float(tokens),
            **monitor.sample(),
        }
        trackers.log(metrics, step)
    trackers.close()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["mem/rss_gib"] > 0 for r in rows)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    step_lines = [ln for ln in capsys.readouterr().out.splitlines() if " step " in ln and "|" in ln]
    assert len(step_lines) == 3 and " rss " in step_lines[-1]
    written = plot_run(str(run))
    assert {Path(p).name for p in written} == {"reward.png", "kl.png", "losses.png", "throughput.png"}


def test_monitor_gpu_path_with_a_stubbed_cuda(monkeypatch, caplog):
    """No GPU here: stub torch.cuda's memory queries to check the GPU keys and warning."""
    import torch

    from rlstack.observability import monitor as mon

    gib = 1024**3
    monkeypatch.setattr(mon, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (10 * gib, 100 * gib))  # (free, total)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 40 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 35 * gib)
    monitor = ResourceMonitor(warn_fraction=0.85, total_bytes=10**15)  # host check stays quiet
    with caplog.at_level(logging.WARNING, logger="rlstack"):
        metrics = monitor.sample()
    assert metrics["mem/gpu_alloc_gib"] == 30 and metrics["mem/gpu_peak_gib"] == 35
    assert metrics["mem/gpu_reserved_gib"] == 40 and metrics["mem/gpu_used_frac"] == pytest.approx(0.9)
    gpu_warnings = [r.getMessage() for r in caplog.records if "GPU 0" in r.getMessage()]
    assert gpu_warnings == [
        "memory: GPU 0 memory 90% used (90.0 of 100.0 GiB; this rank: allocated 30.0 GiB, "
        "reserved 40.0 GiB), past logging.memory_warn_fraction=0.85: "
        "lower rollout.gpu_memory_utilization or the micro batch sizes"
    ]


def test_phase_memory_reports_each_phases_own_peak():
    import torch

    from rlstack.observability.monitor import PhaseMemory, peak_rss_gib

    meter = PhaseMemory()
    meter.start()
    meter.enter("update")
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del big
    meter.enter("idle")  # the 64 MiB went back to the OS (large blocks are mmapped): not in this phase
    out = meter.metrics()
    assert set(out) == {"mem/peak_gib/update", "mem/peak_gib/idle"}
    assert out["mem/peak_gib/update"] - out["mem/peak_gib/idle"] > 50 / 1024
    assert peak_rss_gib() >= out["mem/peak_gib/update"] - 1e-6  # the lifetime peak survives the resets
    meter.start()
    assert meter.metrics() == {}  # a new step starts empty


def test_gguf_conversion_bar_is_off_when_progress_bars_are_and_restored_after():
    """transformers' GGUF loader draws a raw tqdm bar that the progress-bar switch misses (the default
    model's first conversion printed it in `make demo` and `make bench`)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from megatron_bridge.default_model import _gguf_bar_quiet

    bar = gguf_utils.tqdm
    was_enabled = hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.disable_progress_bar()
        with _gguf_bar_quiet():
            assert gguf_utils.tqdm(range(3)).disable is True
        assert gguf_utils.tqdm is bar
        hf_logging.enable_progress_bar()  # logging.verbose=true: the bar stays
        with _gguf_bar_quiet():
            assert gguf_utils.tqdm is bar
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
