"""Logging in one place: the "rlstack" logger, a rank-0 print helper, the per-step line, user errors.

Levels: INFO for stage entries and step lines, WARNING for resource warnings, ERROR for
unrecoverable errors. Rank 0 writes to the console and to `<output_dir>/logs/rank0.log`; every other
rank writes only to its own `logs/rank{r}.log`, so N ranks never print N copies of a line.
Loggers named "rlstack.*" (e.g. "rlstack.monitor") go through the same handlers.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Optional, TypeVar

from rlstack.errors import UserError

LOGGER_NAME = "rlstack"
BRIDGE_LOGGER_NAME = "megatron_bridge"
CONSOLE_FORMAT = "%(asctime)s %(levelname)s %(message)s"  # WARNING and above; INFO lines carry no level word
CONSOLE_INFO_FORMAT = "%(asctime)s %(message)s"
FILE_FORMAT = "%(asctime)s rank%(rank)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
# Records carrying extra={FILE_ONLY: True} (tracebacks of user errors) skip the console.
FILE_ONLY = "rlstack_file_only"

# (metric key, label, format spec): the per-step line's fixed order; missing keys are skipped.
STEP_LINE_FIELDS = (  # (metric, label, format, unit): the line stays within STEP_LINE_WIDTH
    ("reward/mean", "reward", ".3f", ""),
    ("actor/kl", "kl", ".3g", ""),
    ("actor/loss", "loss", ".3g", ""),
    ("critic/loss", "vf_loss", ".3g", ""),
    ("val/accuracy", "val_acc", ".3f", ""),
    ("response/length_mean", "len", ".1f", ""),
    ("timing/step_s", "step_s", ".1f", ""),
    ("mem/rss_gib", "rss", ".1f", "G"),
    ("mem/gpu_peak_gib", "gpu", ".1f", "G"),
)

_state = {"rank": None}
T = TypeVar("T")


def current_rank() -> int:
    """The rank given to setup_logging, else torchrun's RANK, else 0."""
    if _state["rank"] is not None:
        return _state["rank"]
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class _LevelFormatter(logging.Formatter):
    """`12:00:01 step 3/40 | ...` for INFO, `12:00:01 WARNING ...` above it: the stage and step lines stay
    short under torchrun's `[default0]:` prefix."""

    def __init__(self, datefmt: str):
        super().__init__(CONSOLE_FORMAT, datefmt)
        self.info = logging.Formatter(CONSOLE_INFO_FORMAT, datefmt)

    def format(self, record: logging.LogRecord) -> str:
        return self.info.format(record) if record.levelno <= logging.INFO else super().format(record)


class _ConsoleHandler(logging.Handler):
    """INFO to stdout, WARNING and above to stderr, through tqdm.write so bars stay intact.

    The streams are looked up at emit time so redirected sys.stdout/sys.stderr are honoured.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, FILE_ONLY, False):
            return
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            _write_console(self.format(record), stream)
        except Exception:
            self.handleError(record)


def _write_console(text: str, stream) -> None:
    from tqdm import tqdm  # tqdm.write clears active bars, writes, then redraws them

    tqdm.write(text, file=stream)
    stream.flush()


def setup_logging(output_dir: Optional[str], rank: int, level: str = "INFO") -> logging.Logger:
    """Configure the "rlstack" logger for this rank; safe to call again (replaces its handlers).

    output_dir None: console only (rank 0), no files.
    """
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise UserError(f"logging level {level!r} is unknown: use DEBUG, INFO, WARNING or ERROR")
    log = logging.getLogger(LOGGER_NAME)
    # The bridge logs under its own name (it never imports rlstack); its records share our handlers.
    loggers = (log, logging.getLogger(BRIDGE_LOGGER_NAME))
    for logger in loggers:
        for handler in list(logger.handlers):
            if getattr(handler, "_rlstack", False):
                logger.removeHandler(handler)
                handler.close()
        logger.setLevel(level)
        # Our handlers are the only output: a library calling logging.basicConfig() on the root
        # logger must not duplicate every line.
        logger.propagate = False
    _state["rank"] = rank
    handlers = []
    if rank == 0:
        console = _ConsoleHandler()
        console.setFormatter(_LevelFormatter(DATE_FORMAT))
        handlers.append(console)
    if output_dir is not None:
        log_dir = os.path.join(output_dir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        file_handler = logging.FileHandler(os.path.join(log_dir, f"rank{rank}.log"))
        file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
        handlers.append(file_handler)
    for logger in loggers:
        for handler in handlers:
            _add(logger, handler, rank)
    return log


def _add(log: logging.Logger, handler: logging.Handler, rank: int) -> None:
    handler._rlstack = True
    handler.addFilter(_RankFilter(rank))
    log.addHandler(handler)


def log_file_path(log: Optional[logging.Logger] = None) -> Optional[str]:
    """Path of this rank's log file (looked up on `log` and its parents), or None if there is none."""
    node = log or logging.getLogger(LOGGER_NAME)
    while node is not None:
        for handler in node.handlers:
            if getattr(handler, "_rlstack", False) and isinstance(handler, logging.FileHandler):
                return handler.baseFilename
        node = node.parent if node.propagate else None
    return None


def print_rank0(msg: str) -> None:
    """print() on rank 0 only (bar-safe); other ranks stay silent."""
    if current_rank() == 0:
        _write_console(str(msg), sys.stdout)


# The step line's width: under torchrun's `[default0]:` prefix (11) and the time (9) a console line
# stays within 120 columns; fields that do not fit are left out, in this order (metrics.jsonl has them).
STEP_LINE_WIDTH = 100
STEP_LINE_DROP_ORDER = ("len", "step_s", "rss", "val_acc", "gpu")


def format_step_line(step: int, metrics: dict, total_steps: int = 0, eta_s: Optional[float] = None) -> str:
    """One fixed-format line: `step 3/40 | reward 0.412 | kl 0.0012 | ... | rss 3.2G | eta 0:01:05`,
    at most STEP_LINE_WIDTH columns."""
    head = f"step {step}/{total_steps}" if total_steps else f"step {step}"
    fields = [
        (label, f"{label} {float(metrics[key]):{spec}}{unit}")
        for key, label, spec, unit in STEP_LINE_FIELDS
        if key in metrics and metrics[key] is not None
    ]
    tail = [f"eta {format_duration(eta_s)}"] if eta_s is not None else []
    line = " | ".join([head, *(text for _, text in fields), *tail])
    for label in STEP_LINE_DROP_ORDER:
        if len(line) <= STEP_LINE_WIDTH:
            break
        fields = [(name, text) for name, text in fields if name != label]
        line = " | ".join([head, *(text for _, text in fields), *tail])
    return line


def format_duration(seconds: float) -> str:
    """`0:01:05`, `3:20:00`, `2d 04:00:00` past a day."""
    seconds = max(0, int(round(seconds)))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    text = f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


BUG_REPORT = "this is a bug in rlstack, not a mistake in your input: please report it with the traceback above"


def user_error_guard(
    fn: Callable[[], T], rank: int, log: Optional[logging.Logger] = None, other_rank_exit_delay_s: float = 2.0
) -> T:
    """Run fn(); tell a user's mistake (one line, exit 2) from a bug (its traceback once, exit 1).

    A user error (`rlstack.errors.UserError` / the bridge's `InputError`): rank 0 prints
    `error: <message>` to stderr; another rank prints `error: rank N: <message>` only if it is still
    alive after the delay below (the mistake was found on that rank alone); every rank writes the traceback to its
    log file. When the error was raised from the user's own code (a reward function that raised:
    `raise UserError(...) from e`), rank 0 shows that code's traceback once above the line.
    Anything else is a bug: rank 0 prints the traceback and says it is a bug; other ranks print one
    line pointing at their log; every rank writes the traceback to its log file; exit status 1.

    Other ranks wait `other_rank_exit_delay_s` before exiting: torchrun SIGTERMs the survivors as
    soon as one rank exits, and a config error hits every rank at once, so without the wait rank 1
    can exit first and get rank 0 killed before it prints the line.
    """
    from rlstack.errors import RESOURCE_EXIT, USER_ERRORS, resource_message

    log = log or logging.getLogger(LOGGER_NAME)
    try:
        return fn()
    except USER_ERRORS as e:
        if log_file_path(log) is not None:
            log.error("user error: %s", e, exc_info=True, extra={FILE_ONLY: True})
        if rank == 0:
            if e.__cause__ is not None and not isinstance(e.__cause__, USER_ERRORS):
                _write_console(_traceback_text(e.__cause__), sys.stderr)
            _write_console(f"error: {e}", sys.stderr)
        else:  # rank 0 prints the same line and exits first, and torchrun stops this rank in the wait;
            time.sleep(other_rank_exit_delay_s)  # still here: the mistake was this rank's alone, say it
            _write_console(f"error: rank {rank}: {e}", sys.stderr)
        raise SystemExit(2) from None
    except Exception as e:
        where = log_file_path(log)
        resource = resource_message(e)
        if resource:  # ran out of memory or disk: a resource error, not a bug
            if where is not None:
                log.error("resource error: %s", resource, exc_info=True, extra={FILE_ONLY: True})
            _write_console(f"error: {resource}" if rank == 0 else f"error: rank {rank}: {resource}", sys.stderr)
            if rank != 0:  # a full disk hits every rank at once: let rank 0's line reach the console
                time.sleep(other_rank_exit_delay_s)
            raise SystemExit(RESOURCE_EXIT) from None
        if where is not None:
            log.error("internal error (bug): %s: %s", type(e).__name__, e, exc_info=True, extra={FILE_ONLY: True})
        if rank == 0:
            _write_console(_traceback_text(e) + f"error: {type(e).__name__}: {e}\nerror: {BUG_REPORT}", sys.stderr)
        else:
            _write_console(
                f"error: rank {rank}: {type(e).__name__}: {e} ({BUG_REPORT.split(':')[0]}; "
                f"traceback in {where or 'this rank stderr'})",
                sys.stderr,
            )
        raise SystemExit(1) from None


def _traceback_text(e: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(type(e), e, e.__traceback__))
