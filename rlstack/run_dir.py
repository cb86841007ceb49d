"""The output directory's safety: one live run per directory, and an overwrite that can be undone.

- `RunLock`: rank 0 holds an exclusive `flock` on `<output_dir>/.rlstack.lock` for the run's life.
  The kernel (or the file server's lease, on NFSv4/Lustre/GPFS) releases it when the holder dies,
  however it dies (crash, SIGKILL, lost node), so a stale lock is taken over by the next run
  without a person and without a race. The file records the holder (host, PID, start time) so a
  refused run names it.
- `Overwrite`: `trainer.overwrite=true` sets the earlier run aside (renames, same file system)
  instead of deleting it. The new run `commit()`s once it has saved its first checkpoint (or
  finished, saving none): only then is the earlier run removed. A run that fails before that
  `restore()`s it exactly as it was; a run killed before that (SIGKILL) leaves a record that the
  next run in the directory restores from (`recover`).

Torch-free; docs/reliability.md lists each case with its test.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from typing import Optional

from rlstack.errors import UserError

log = logging.getLogger("rlstack")

LOCK_FILE = ".rlstack.lock"
RECORD_FILE = ".rlstack-overwrite.json"
ASIDE_SUFFIX = ".rlstack-previous"


# ----------------------------------------------------------------------------- the lock


def holder(out: str) -> Optional[dict]:
    """The live run holding `out`'s lock ({host, pid, since}), or None when it is free (probe only)."""
    path = os.path.join(out, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return _read_holder(path)
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def describe(info: dict) -> str:
    since = info.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return f"host {info.get('host', '?')}, PID {info.get('pid', '?')}, since {when}"


def is_this_job(info: dict) -> bool:
    """The lock is held by this process, or by rank 0 of this torchrun job (the other ranks' preflight)."""
    if info.get("host") == socket.gethostname() and info.get("pid") == os.getpid():
        return True
    job = _job_id()
    return bool(job) and info.get("job") == job


def _job_id() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    master = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    return f"{run_id}@{master}" if run_id or master != ":" else ""


def refuse_live(out: str, info: dict) -> UserError:
    return UserError(
        f"trainer.output_dir={out} is in use by a live run ({describe(info)}): wait for it to end, "
        "stop it, or choose another trainer.output_dir"
    )


class RunLock:
    """An exclusive lock on the output directory, held by one process for the run's life."""

    def __init__(self, out: str):
        self.out = out
        self.path = os.path.join(out, LOCK_FILE)
        self.fd: Optional[int] = None

    def acquire(self) -> None:
        """Take the lock or raise a UserError naming the live holder. Safe against racing starts."""
        os.makedirs(self.out, exist_ok=True)
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise refuse_live(self.out, _read_holder(self.path)) from None
                raise UserError(
                    f"trainer.output_dir={self.out}: cannot lock {self.path} ({e.strerror}): put the "
                    "output directory on a file system with file locks (flock)"
                ) from None
            # The holder before us may have removed the file after we opened it: lock the file on disk.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                self._write_holder()
                return
            os.close(fd)
        raise UserError(f"trainer.output_dir={self.out}: the lock file keeps changing: another run is starting there")

    def _write_holder(self) -> None:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "job": _job_id()}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(info).encode(), 0)
        os.fsync(self.fd)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: a starter that opened it re-checks the inode
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


# ----------------------------------------------------------------------------- overwrite


def _earlier_paths(cfg) -> list[str]:
    """What trainer.overwrite=true replaces: the checkpoints, the metrics, the saved config."""
    from rlstack.checkpoint import checkpoint_root
    from rlstack.observability.trackers import METRICS_FILE

    out = cfg.trainer.output_dir
    paths = [checkpoint_root(cfg), os.path.join(out, METRICS_FILE), os.path.join(out, "config.yaml")]
    if getattr(cfg.trainer, "rollout_data_dir", ""):
        paths.append(cfg.trainer.rollout_data_dir)
    return paths


class Overwrite:
    """trainer.overwrite=true: the earlier run set aside until the new one proves itself."""

    def __init__(self, out: str, moves: list[tuple[str, str]]):
        self.out = out
        self.moves = moves  # (original, set-aside) pairs
        self.record = os.path.join(out, RECORD_FILE)

    @classmethod
    def begin(cls, cfg) -> Overwrite:
        out = cfg.trainer.output_dir
        moves = [(p, p + ASIDE_SUFFIX) for p in _earlier_paths(cfg) if os.path.lexists(p)]
        self = cls(out, moves)
        if not moves:
            return self
        self._write_record("pending")
        for original, aside in moves:
            if os.path.lexists(aside):
                _remove(aside)
            os.rename(original, aside)
        log.info(
            "trainer.overwrite=true: the earlier run is set aside (%s); it is removed once this run "
            "saves its first checkpoint, and put back if this run fails before that",
            ", ".join(os.path.basename(a) for _, a in moves),
        )
        return self

    def _write_record(self, state: str) -> None:
        tmp = self.record + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"state": state, "moves": self.moves}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.record)

    def commit(self) -> None:
        """The new run saved a checkpoint (or finished): the earlier run can go."""
        if not self.moves:
            return
        self._write_record("committed")
        for _, aside in self.moves:
            _remove(aside)
        os.remove(self.record)
        log.info("trainer.overwrite=true: the earlier run's set-aside files are removed")
        self.moves = []

    def restore(self, why: str) -> None:
        """The new run failed before proving itself: put the earlier run back exactly as it was."""
        if not self.moves:
            return
        for original, aside in self.moves:
            if os.path.lexists(aside):
                if os.path.lexists(original):
                    _remove(original)  # what the failed run wrote
                os.rename(aside, original)
        os.remove(self.record)
        log.warning("trainer.overwrite=true: %s; the earlier run in %s is put back as it was", why, self.out)
        self.moves = []


def recover(out: str) -> None:
    """A run killed mid-overwrite left a record: finish its commit, or put the earlier run back."""
    path = os.path.join(out, RECORD_FILE)
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        log.warning("%s is unreadable: left as it is (the set-aside *%s files are kept)", path, ASIDE_SUFFIX)
        return
    pending = Overwrite(out, [tuple(m) for m in record["moves"]])
    if record.get("state") == "committed":
        pending.commit()
    else:
        pending.restore("an earlier overwrite run stopped before its first checkpoint")


@contextlib.contextmanager
def guarded_start(cfg, rank: int):
    """The run's life on rank 0: lock the output directory, finish or undo an overwrite a killed run
    left, set the earlier run aside (trainer.overwrite=true), and put it back if this run fails
    before it proves itself; a run refused before its start leaves nothing in the directory.
    Other ranks pass through (yield None)."""
    if rank != 0:
        yield None
        return
    out = cfg.trainer.output_dir
    existed = os.path.isdir(out)
    lock = RunLock(out)
    try:
        lock.acquire()
    except BaseException:
        _remove_if_new(out, existed)
        raise
    overwrite = None
    try:
        recover(out)
        overwrite = _Deferred(cfg)
        yield overwrite
        overwrite.finish()
    except BaseException as e:
        if overwrite is not None:
            overwrite.fail(f"this run stopped before its first checkpoint ({type(e).__name__})")
        raise
    finally:
        lock.release()
        _remove_if_new(out, existed)


class _Deferred:
    """The overwrite of this run, begun by the loop once every check passed (`begin`)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.pending: Optional[Overwrite] = None

    def begin(self) -> None:
        if self.cfg.trainer.overwrite and self.pending is None:
            self.pending = Overwrite.begin(self.cfg)

    def saved(self) -> None:
        """A checkpoint of this run is published: the earlier run can go."""
        if self.pending is not None:
            self.pending.commit()

    def finish(self) -> None:
        self.saved()

    def fail(self, why: str) -> None:
        if self.pending is not None:
            self.pending.restore(why)


def _remove_if_new(out: str, existed: bool) -> None:
    """A run refused before it started leaves no directory it created (nothing but the lock was written)."""
    if not existed and os.path.isdir(out) and not os.listdir(out):
        os.rmdir(out)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
