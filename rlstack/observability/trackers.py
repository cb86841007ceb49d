"""Metric trackers behind one small interface: `log(metrics, step)` and `close()`.

Rank 0 writes; the other ranks get a no-op tracker. `metrics.jsonl` is always written, because
`python -m rlstack.plot` and resumed runs read it. TensorBoard, Weights & Biases and MLflow are
imported only when asked for.

W&B and MLflow continue the same run after a restart: the run id is stored in the output directory
(`wandb_run_id`, `mlflow_run_id`) when the run starts and read back by the next start there (pass
resume=False, or delete the file, for a new run in the same directory).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from typing import Any, Optional

from rlstack.errors import UserError
from rlstack.observability.logging import LOGGER_NAME, format_step_line

TRACKER_NAMES = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
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
    """The fixed-format step line at INFO on the "rlstack" logger (console + rank-0 log file):
    `step k/N`, the step's figures, and an ETA from the wall time between the last step lines
    (validation and checkpoint saves included, as the user's clock sees them)."""

    ETA_WINDOW = 10  # steps the ETA averages over

    def __init__(self, logger: Optional[logging.Logger] = None, total_steps: int = 0, clock=time.monotonic):
        self.logger = logger or logging.getLogger(LOGGER_NAME)
        self.total_steps = total_steps
        self.clock = clock
        self.seen: list[tuple[int, float]] = []  # (step, time) of the recent step lines

    def log(self, metrics: dict, step: int) -> None:
        metrics = scalar_metrics(metrics)
        if not any(not k.startswith("val/") for k in metrics):  # validation alone: no step line change
            self.logger.info(format_step_line(step, metrics, self.total_steps))
            return
        self.logger.info(format_step_line(step, metrics, self.total_steps, self._eta(step, metrics)))

    def _eta(self, step: int, metrics: dict) -> Optional[float]:
        now = self.clock()
        self.seen = (self.seen + [(step, now)])[-(self.ETA_WINDOW + 1) :]
        if not self.total_steps or step >= self.total_steps:
            return None  # the last step's line needs no ETA
        (first_step, first_t), (last_step, last_t) = self.seen[0], self.seen[-1]
        if last_step > first_step:
            per_step = (last_t - first_t) / (last_step - first_step)
        else:  # the first line of this process: its own step time
            per_step = float(metrics.get("timing/step_s") or 0.0)
            if per_step <= 0:
                return None
        return per_step * (self.total_steps - step)


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


def _read_run_id(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _write_run_id(path: str, run_id: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(run_id + "\n")
    os.replace(tmp, path)  # atomic: a kill never leaves half an id


class WandbTracker(Tracker):
    """Weights & Biases run; only when installed and listed in logging.trackers.

    The run id lives in `<output_dir>/wandb_run_id`: a restarted run in the same directory calls
    `wandb.init(id=<that id>, resume="allow")` and its steps continue the same W&B run.
    """

    ID_FILE = "wandb_run_id"

    def __init__(
        self,
        project: str,
        run_name: str = "",
        config_dict: Optional[dict] = None,
        output_dir: Optional[str] = None,
        resume: bool = True,
    ):
        wandb = _import_tracker("wandb")
        id_path = os.path.join(output_dir or ".", self.ID_FILE)
        run_id = _read_run_id(id_path) if resume else None
        self.resumed = run_id is not None
        if run_id is None:
            run_id = uuid.uuid4().hex[:16]  # W&B ids: letters and digits, <= 64 characters
        _write_run_id(id_path, run_id)
        self.run_id = run_id
        self._run = wandb.init(
            project=project, name=run_name or None, config=config_dict, dir=output_dir, id=run_id, resume="allow"
        )

    def log(self, metrics: dict, step: int) -> None:
        self._run.log(scalar_metrics(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def _import_tracker(name: str):
    """The tracker's package, or one line saying how to install it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise UserError(
            f"logging.trackers lists '{name}' but {name} is not installed: pip install {name}, "
            f"or remove {name} from logging.trackers"
        ) from None


class MlflowTracker(Tracker):
    """An MLflow run (only when mlflow is installed): numeric metrics per step, the config as params.

    Tracking URI: MLFLOW_TRACKING_URI when set, else `<output_dir>/mlruns` (a local file store).
    Experiment: logging.project. The run id lives in `<output_dir>/mlflow_run_id`; a restart
    continues that run (`mlflow.start_run(run_id=...)`).
    """

    ID_FILE = "mlflow_run_id"
    MAX_PARAM_CHARS = 500  # MLflow rejects longer parameter values

    def __init__(
        self,
        project: str,
        run_name: str = "",
        config_dict: Optional[dict] = None,
        output_dir: Optional[str] = None,
        resume: bool = True,
    ):
        mlflow = _import_tracker("mlflow")
        self._mlflow = mlflow
        out = output_dir or "."
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri("file:" + os.path.abspath(os.path.join(out, "mlruns")))
        mlflow.set_experiment(project)
        id_path = os.path.join(out, self.ID_FILE)
        run_id = _read_run_id(id_path) if resume else None
        self.resumed = run_id is not None
        if self.resumed:
            self._run = mlflow.start_run(run_id=run_id)
        else:
            self._run = mlflow.start_run(run_name=run_name or None)
            if config_dict:
                mlflow.log_params(_flat_params(config_dict, self.MAX_PARAM_CHARS))
        self.run_id = self._run.info.run_id
        _write_run_id(id_path, self.run_id)

    def log(self, metrics: dict, step: int) -> None:
        numeric = {
            k: float(v) for k, v in scalar_metrics(metrics).items() if isinstance(v, (bool, int, float)) and k != "step"
        }
        if numeric:
            self._mlflow.log_metrics(numeric, step=int(step))

    def close(self) -> None:
        self._mlflow.end_run()


def _flat_params(tree: dict, max_chars: int, prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}, values as strings cut to max_chars."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat_params(value, max_chars, name + "."))
        else:
            out[name] = str(value)[:max_chars]
    return out


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


def build_trackers(
    names: list[str],
    output_dir: str,
    rank: int,
    config_dict: Optional[dict] = None,
    project: str = "rlstack",
    run_name: str = "",
    resume: bool = True,
    total_steps: int = 0,
) -> MultiTracker:
    """Trackers named in logging.trackers (jsonl always on) on rank 0; a no-op elsewhere.

    resume: W&B and MLflow continue the run whose id is stored in output_dir (False: a new run).
    """
    unknown = [n for n in names if n not in TRACKER_NAMES]
    if unknown:
        raise UserError(f"logging.trackers has unknown tracker {unknown[0]!r}: use {', '.join(TRACKER_NAMES)}")
    if rank != 0:
        return MultiTracker([])
    trackers: list[Tracker] = []
    try:
        trackers.append(JsonlTracker(os.path.join(output_dir, METRICS_FILE)))
        if "console" in names:
            trackers.append(ConsoleTracker(total_steps=total_steps))
        if "tensorboard" in names:
            trackers.append(TensorBoardTracker(os.path.join(output_dir, TENSORBOARD_DIR)))
        if "wandb" in names:
            trackers.append(WandbTracker(project, run_name, config_dict, output_dir, resume=resume))
        if "mlflow" in names:
            trackers.append(MlflowTracker(project, run_name, config_dict, output_dir, resume=resume))
    except BaseException:
        MultiTracker(trackers).close()  # e.g. wandb missing: do not leak the open files
        raise
    return MultiTracker(trackers)
