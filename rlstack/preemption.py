"""Stopping to be resumed: signals, time limits and watchdogs (docs/reliability.md).

A stop signal (`trainer.stop_signals`) sets a flag; the loop finishes the step in flight, every
rank agrees on stopping (one all-reduce of the flag per step), the last complete step is saved,
and the run exits with RESUME_EXIT. A step that cannot finish within `trainer.stop_grace_s` is
abandoned (the previous checkpoint stays). A second stop signal unwinds at once (`finally` runs).
`trainer.max_wall_minutes` and a SLURM job's end time set the same flag before the limit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

log = logging.getLogger("rlstack")

# EX_TEMPFAIL (sysexits.h): "try again later". The run saved its last complete step and stopped on
# a signal or a time limit; launch/ppo.sh requeues a SLURM job on it (RLSTACK_REQUEUE=1).
RESUME_EXIT = 75
# A generation that did not finish within rollout.timeout_s (a hung or dead engine).
ENGINE_EXIT = 4
# Written by rank 0 next to metrics.jsonl once the stop's checkpoint is published: launch/ppo.sh
# reads it (torchrun's own status says nothing about why its ranks exited).
STOPPED_FILE = "stopped_to_resume.json"


class _State:
    signum = 0  # the first stop signal received (0: none)
    reason = ""  # "SIGTERM", "time limit", ...
    received_at = 0.0
    grace_timer: Optional[threading.Timer] = None
    grace_s = 0.0
    step = 0  # the step in flight (1-based), for messages from watchdogs
    last_saved = 0  # the newest complete checkpoint's step, for the abandon message
    armed = False
    trains = False  # a training rank (knows last_saved); a rollout-only rank does not
    deadline = None  # epoch seconds of the time limit in force (Deadline), for the stopped file


_state = _State()


def signal_numbers(names: list[str]) -> list[int]:
    """`trainer.stop_signals` names (SIGTERM, TERM, 15) as signal numbers; UserError names the key."""
    from rlstack.errors import UserError

    out = []
    for name in names:
        text = str(name).strip().upper()
        try:
            num = (
                int(text) if text.isdigit() else int(getattr(signal, text if text.startswith("SIG") else "SIG" + text))
            )
        except (AttributeError, TypeError, ValueError):
            raise UserError(f"trainer.stop_signals: unknown signal {name!r} (use e.g. SIGTERM, SIGINT, SIGUSR1)")
        if num in (signal.SIGKILL, signal.SIGSTOP):
            raise UserError(f"trainer.stop_signals: {name} cannot be caught: remove it")
        out.append(num)
    return out


def arm(signals: list[str], grace_s: float, last_saved: int = 0, trains: bool = True) -> None:
    """Stop signals set the flag from here on (the training loop, or a rollout-only rank's serving
    loop: `trains=False`); before this they unwind."""
    _state.grace_s, _state.last_saved, _state.armed = clamp_grace(float(grace_s)), int(last_saved), True
    _state.trains = trains
    for num in signal_numbers(signals):
        signal.signal(num, _on_signal)


# torchrun, given SIGTERM/SIGINT/SIGHUP/SIGQUIT, forwards it to its workers and SIGKILLs them this many
# seconds later (torch 2.13: `--shutdown-timeout`, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30;
# torch/distributed/launcher/api.py). The step in flight and the save must fit in it.
TORCHRUN_KILL_DELAY_S = 30.0
SAVE_MARGIN_S = 10.0  # of torchrun's delay, kept for the save and the exit after the step


def torchrun_kill_delay() -> Optional[float]:
    """Seconds between torchrun forwarding a signal and its SIGKILL, when this rank runs under a
    torchrun that may get the signal itself; None otherwise. launch/ppo.sh sends the first signal to
    the ranks only (RLSTACK_SIGNALS_TO_RANKS=1), so torchrun's delay does not apply there."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("RLSTACK_SIGNALS_TO_RANKS") == "1":
        return None
    value = _parent_flag("--shutdown-timeout") or _parent_flag("--shutdown_timeout")
    for var in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        value = value or os.environ.get(var, "")
    try:
        return float(value) if value else TORCHRUN_KILL_DELAY_S
    except ValueError:
        return TORCHRUN_KILL_DELAY_S


def _parent_flag(flag: str) -> str:
    """The value of torchrun's `flag` (its command line: the agent is this rank's parent)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return ""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return ""


def clamp_grace(grace_s: float) -> float:
    """trainer.stop_grace_s, under raw torchrun at most its kill delay less SAVE_MARGIN_S (said in the
    log): a step abandoned in time exits 75 with the last checkpoint intact, where torchrun's SIGKILL
    would cut the step (or the save, whose atomic publish then holds) with an unexplained status."""
    delay = torchrun_kill_delay()
    if delay is None:
        return grace_s
    limit = max(delay - SAVE_MARGIN_S, delay / 2)
    if grace_s <= 0 or grace_s > limit:
        log.info(
            "under torchrun, which SIGKILLs its workers %g s after forwarding a stop signal: "
            "trainer.stop_grace_s=%g is clamped to %g s (launch/ppo.sh sends the signal to the ranks "
            "only and keeps the full grace)",
            delay,
            grace_s,
            limit,
        )
        return limit
    return grace_s


def disarm(signals: list[str]) -> None:
    """After the loop: a stop signal unwinds again (teardown, validation after training)."""
    _state.armed = False
    _cancel_grace()
    for num in signal_numbers(signals):
        signal.signal(num, unwind)


def unwind(signum, frame) -> None:
    """SIGTERM outside the loop (or a second stop signal) unwinds like Ctrl-C, so `finally` blocks run."""
    raise SystemExit(128 + signum)


# Under torchrun one stop can reach a rank several times within a second: srun and scancel signal every
# process of the job step (ppo.sh, torchrun and the ranks), and ppo.sh and torchrun each forward it.
DUPLICATE_S = 2.0


def _on_signal(signum, frame) -> None:
    name = signal.Signals(signum).name
    if _duplicate(signum):
        log.warning(
            "%s again %.1f s after the first: the same stop (forwarded by the launcher, or srun/scancel "
            "signalling every process); a %s more than %g s later stops at once",
            name,
            time.time() - _state.received_at,
            name,
            DUPLICATE_S,
        )
        return
    if _state.signum or not _state.armed:  # a second signal: stop now (an atomic publish holds)
        log.warning("%s again: stopping now, without waiting for step %d", name, _state.step)
        raise SystemExit(128 + signum)
    _state.signum, _state.reason, _state.received_at = signum, name, time.time()
    log.warning(
        "%s received in step %d: finishing it, then saving and stopping (trainer.stop_grace_s=%g)",
        name,
        _state.step,
        _state.grace_s,
    )
    _start_grace()


def _duplicate(signum: int) -> bool:
    return (
        _state.armed
        and _state.signum == signum
        and "TORCHELASTIC_RUN_ID" in os.environ
        and time.time() - _state.received_at < DUPLICATE_S
    )


def _start_grace() -> None:
    if _state.grace_s > 0 and _state.armed and _state.grace_timer is None:
        _state.grace_timer = threading.Timer(_state.grace_s, _abandon)
        _state.grace_timer.daemon = True
        _state.grace_timer.start()


def request_stop(reason: str) -> None:
    """A time limit asks for the same stop as a signal (no grace timer: the step has finished)."""
    if not _state.signum:
        _state.signum, _state.reason, _state.received_at = -1, reason, time.time()


def remote_stop(reason: str) -> None:
    """A rollout-only rank's stop signal, heard by the training ranks in its hand-over: the same stop
    as a signal of their own, trainer.stop_grace_s counted from now."""
    if not _state.signum:
        request_stop(reason)
        log.warning(
            "%s: finishing step %d, then saving and stopping (trainer.stop_grace_s=%g)",
            reason,
            _state.step,
            _state.grace_s,
        )
        _start_grace()


def handed_over() -> None:
    """A rollout-only rank told the training ranks of its stop signal: the grace is theirs to keep
    (their timer; a save may outlast this rank's) and it waits for their "stop"."""
    _cancel_grace()


def _abandon() -> None:
    """The step could not finish within stop_grace_s: exit without saving it (from a thread, since the
    main thread may be inside a collective that Python cannot interrupt)."""
    rank = os.environ.get("RANK", "0")
    line = (
        f"step {_state.step} abandoned: not finished {_state.grace_s:g} s after {_state.reason} "
        f"(trainer.stop_grace_s); nothing of it is saved, {_kept()} stays "
        f"and a resumed run repeats step {_state.step}"
    )
    log.error(line)
    if rank == "0":
        sys.stderr.write(f"error: {line}\n")
    _flush_logs()
    os._exit(RESUME_EXIT)


def _cancel_grace() -> None:
    if _state.grace_timer is not None:
        _state.grace_timer.cancel()
        _state.grace_timer = None


def begin_step(step: int) -> None:
    _state.step = step


def saved(step: int) -> None:
    _state.last_saved = step


def stop_requested() -> bool:
    return bool(_state.signum)


def reason() -> str:
    return _state.reason


def agree(groups) -> bool:
    """Collective, once a step: does any rank want to stop? (a signal may reach one rank only)."""
    import torch.distributed as dist

    from rlstack import collectives

    stop = bool(_state.signum)
    if dist.is_initialized() and groups.world is not None:
        stop = collectives.max_floats([float(stop)], groups.world, groups.device)[0] > 0
    if stop:
        _cancel_grace()  # the step finished: the save is not abandoned (a second signal still stops)
        if not _state.signum:
            _state.signum, _state.reason = -1, "another rank's stop signal"
    return stop


def reset() -> None:
    """Tests: forget a stop."""
    _cancel_grace()
    _state.signum, _state.reason, _state.step, _state.last_saved = 0, "", 0, 0
    _state.trains = False


def write_stopped(output_dir: str, step: int, checkpoint: Optional[str]) -> None:
    """Rank 0, after the stop's checkpoint is published: what launch/ppo.sh reads."""
    path = os.path.join(output_dir, STOPPED_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "step": step,
                "reason": _state.reason,
                "checkpoint": checkpoint,
                "time": time.time(),
                "deadline": _state.deadline,
            },
            f,
        )
    os.replace(tmp, path)


def exit_status() -> int:
    """RESUME_EXIT, or 0 under torchrun with elastic restarts (a non-zero exit would restart the ranks;
    launch/ppo.sh reads STOPPED_FILE and exits RESUME_EXIT itself)."""
    return 0 if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 else RESUME_EXIT


LINGER_S = 15.0  # how long a rank other than 0 waits for rank 0 to exit first after a stop to be resumed


def linger(rank: int) -> None:
    """After a stop to be resumed, under torchrun: let rank 0 exit first. torchrun SIGTERMs every
    other rank as soon as one exits non-zero (75), and rank 0 still tears down (trackers, the run
    directory's lock, an overwrite's clean-up). Other ranks wait up to LINGER_S; torchrun's SIGTERM
    (or SIGINT) then ends them with the same status, so every rank reports 75."""
    if rank == 0 or "TORCHELASTIC_RUN_ID" not in os.environ or exit_status() != RESUME_EXIT:
        return
    _flush_logs()

    def done(signum, frame):
        os._exit(RESUME_EXIT)

    for num in (signal.SIGTERM, signal.SIGINT):
        signal.signal(num, done)
    time.sleep(LINGER_S)


def _flush_logs() -> None:
    for handler in logging.getLogger("rlstack").handlers:
        try:
            handler.flush()
        except Exception:
            pass
    sys.stderr.flush()


# ----------------------------------------------------------------------------- time limits


class Deadline:
    """When to stop for a time limit: the earlier of start + trainer.max_wall_minutes and a SLURM
    job's end time; stop once the next step and a save would not fit (margin: last step's time +
    last save's time, x1.5, + 30 s slack for the exit)."""

    def __init__(self, max_wall_minutes: float, start: float, slurm: bool = True):
        ends = []
        if max_wall_minutes > 0:
            ends.append((start + 60.0 * max_wall_minutes, f"trainer.max_wall_minutes={max_wall_minutes:g}"))
        end = slurm_end_time() if slurm else None
        if end is not None:
            ends.append((end, "the SLURM job's time limit"))
        self.end, self.what = min(ends) if ends else (None, "")
        _state.deadline = self.end
        if self.end is not None:
            log.info("time limit: saving and stopping before %s (%s)", time.ctime(self.end), self.what)
        self.slack_s = float(os.environ.get("RLSTACK_STOP_SLACK_S", "30"))

    def reached(self, now: float, step_s: float, save_s: float) -> bool:
        if self.end is None:
            return False
        return now + 1.5 * (step_s + save_s) + self.slack_s >= self.end


def slurm_end_time() -> Optional[float]:
    """The job's end (epoch seconds) from SLURM_JOB_END_TIME, else `squeue -h -j $SLURM_JOB_ID -o %e`."""
    if os.environ.get("RLSTACK_IGNORE_SLURM") == "1" or not os.environ.get("SLURM_JOB_ID"):
        return None
    value = os.environ.get("SLURM_JOB_END_TIME", "")
    if value.strip().isdigit():
        return float(value)
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%e"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return _parse_slurm_time(out)


def _parse_slurm_time(text: str) -> Optional[float]:
    import datetime

    text = text.strip().splitlines()[0] if text.strip() else ""
    if not text or text in ("N/A", "NONE", "Unknown"):
        return None
    if text.isdigit():
        return float(text)
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()  # local time, as squeue prints
    except ValueError:
        return None


# ----------------------------------------------------------------------------- watchdogs


class Watchdog:
    """Exit the process when a block does not finish within timeout_s (0: off). A thread, since a hung
    engine may sit in C code that no Python exception can interrupt; nothing of the step is saved."""

    def __init__(self, timeout_s: float, message):
        self.timeout_s, self.message = float(timeout_s), message
        self._timer = None

    def __enter__(self):
        if self.timeout_s > 0:
            self._timer = threading.Timer(self.timeout_s, self._fire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc):
        if self._timer is not None:
            self._timer.cancel()
        return False

    def _fire(self) -> None:
        line = self.message()
        log.error(line)
        sys.stderr.write(f"error: {line}\n")
        _flush_logs()
        os._exit(ENGINE_EXIT)


def rollout_watchdog(timeout_s: float, engine: str) -> Watchdog:
    return Watchdog(timeout_s, lambda: engine_line(engine, _timeout_what(timeout_s)))


def _timeout_what(timeout_s: float) -> str:
    return f"did not finish step {_state.step}'s generation within rollout.timeout_s={timeout_s:g} (hung or dead)"


def engine_line(engine: str, what: str) -> str:
    """The one line of a hung or dead rollout engine: engine, rank, step, what is kept."""
    rank = os.environ.get("RANK", "0")
    return (
        f"rollout engine {engine} on rank {rank} {what}: stopped; nothing of step {_state.step} is saved, "
        f"{_kept()} stays and a resumed run repeats step {_state.step}"
    )


def _kept() -> str:
    # a rollout-only rank does not see the training ranks' saves
    return f"the checkpoint of step {_state.last_saved}" if _state.trains else "the last checkpoint"


def engine_failed(engine: str, what: str) -> None:
    """A rollout engine died (its process killed) or hung past rollout.timeout_s: say so in one line
    and exit ENGINE_EXIT at once. os._exit: the other ranks wait in collectives for this one's part,
    and a bug's traceback (exit 1) would bury which engine failed."""
    line = engine_line(engine, what)
    log.error(line)
    sys.stderr.write(f"error: {line}\n")
    _flush_logs()
    os._exit(ENGINE_EXIT)


def engine_timed_out(engine: str, timeout_s: float) -> None:
    engine_failed(engine, _timeout_what(timeout_s))


def fault_hook(name: str) -> Optional[str]:
    """Test hooks (tests/fault): RLSTACK_FAULT_<NAME>, e.g. RLSTACK_FAULT_ROLLOUT_HANG_STEP=3."""
    return os.environ.get(f"RLSTACK_FAULT_{name}")


def current_step() -> int:
    return _state.step


def fault_step(name: str) -> bool:
    """Whether the test hook RLSTACK_FAULT_<name>=K fires in this step on this rank (RLSTACK_FAULT_RANK=R,
    default every rank)."""
    step, rank = fault_hook(name), fault_hook("RANK")
    return bool(step) and int(step) == _state.step and rank in (None, os.environ.get("RANK", "0"))


def fault_hang() -> None:
    """tests/fault: RLSTACK_FAULT_ROLLOUT_HANG_STEP=K makes step K's generation hang, as a stuck engine would."""
    if fault_step("ROLLOUT_HANG_STEP"):
        time.sleep(3600)
