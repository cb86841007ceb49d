"""Metric trackers behind one small interface: `log(metrics, step)` and `close()`.

Rank 0 writes; the other ranks get a no-op tracker. `metrics.jsonl` is always written, because
`python -m rlstack.plot` and resumed runs read it. TensorBoard and Weights & Biases are imported
only when asked for.
"""

from __future__ import annotations

from rlstack.errors import UserError
import json
import logging
import math
import os
from typing import Any, Optional

from rlstack.observability.logging import LOGGER_NAME, format_step_line

TRACKER_NAMES = ("console", "jsonl", "tensorboard", "wandb")
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class Tracker:
    """The interface, and the no-op tracker."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def scalar_metrics(metrics: dict) -> dict[str, Any]:
    """Plain Python scalars: tensors/numpy values via .item(); strings kept; None dropped."""
    out = {}
    for key, value in metrics.items():
        if value is None:
            continue
        if hasattr(value, "item"):
            value = value.item()  # a 0-d tensor or numpy scalar; a bigger tensor raises here
        if not isinstance(value, (bool, int, float, str)):
            raise TypeError(f"metric {key!r} is {type(value).__name__}: log a number")
        out[key] = value
    return out


class ConsoleTracker(Tracker):
    """The fixed-format step line at INFO on the "rlstack" logger (console + rank-0 log file)."""

    def __init__(self, logger: Optional[logging.Logger] = None):
        self.logger = logger or logging.getLogger(LOGGER_NAME)

    def log(self, metrics: dict, step: int) -> None:
        self.logger.info(format_step_line(step, scalar_metrics(metrics)))


class JsonlTracker(Tracker):
    """Appends `{"step": n, ...}` per call, flushed, so a killed run keeps every complete line.

    Appending (not truncating) lets a resumed run continue the file; steps re-run after a resume
    appear twice and readers keep the last. NaN/inf are written as null to keep the file strict JSON.
    """

    def __init__(self, path: str):
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": int(step)}
        for key, value in scalar_metrics(metrics).items():
            if key != "step":
                row[key] = None if isinstance(value, float) and not math.isfinite(value) else value
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardTracker(Tracker):
    """One scalar series per numeric metric (torch.utils.tensorboard, flushed every step)."""

    def __init__(self, logdir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = logdir
        self._writer = SummaryWriter(log_dir=logdir)

    def log(self, metrics: dict, step: int) -> None:
        for key, value in scalar_metrics(metrics).items():
            if isinstance(value, (int, float)) and key != "step":
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    """Weights & Biases run; only when installed and listed in logging.trackers."""

    def __init__(self, project: str, run_name: str = "", config_dict: Optional[dict] = None,
                 output_dir: Optional[str] = None):
        try:
            import wandb
        except ImportError:
            raise UserError("logging.trackers lists 'wandb' but wandb is not installed: "
                             "pip install wandb, or remove wandb from logging.trackers") from None
        self._run = wandb.init(project=project, name=run_name or None, config=config_dict,
                               dir=output_dir)

    def log(self, metrics: dict, step: int) -> None:
        self._run.log(scalar_metrics(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MultiTracker(Tracker):
    """Fans out to several trackers; with none it is the no-op tracker."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)

    def log(self, metrics: dict, step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def build_trackers(names: list[str], output_dir: str, rank: int, config_dict: Optional[dict] = None,
                   project: str = "rlstack", run_name: str = "") -> MultiTracker:
    """Trackers named in logging.trackers (jsonl always on) on rank 0; a no-op elsewhere."""
    unknown = [n for n in names if n not in TRACKER_NAMES]
    if unknown:
        raise UserError(f"logging.trackers has unknown tracker {unknown[0]!r}: "
                         f"use {', '.join(TRACKER_NAMES)}")
    if rank != 0:
        return MultiTracker([])
    trackers: list[Tracker] = []
    try:
        trackers.append(JsonlTracker(os.path.join(output_dir, METRICS_FILE)))
        if "console" in names:
            trackers.append(ConsoleTracker())
        if "tensorboard" in names:
            trackers.append(TensorBoardTracker(os.path.join(output_dir, TENSORBOARD_DIR)))
        if "wandb" in names:
            trackers.append(WandbTracker(project, run_name, config_dict, output_dir))
    except BaseException:
        MultiTracker(trackers).close()  # e.g. wandb missing: do not leak the open files
        raise
    return MultiTracker(trackers)
