"""Publish a directory atomically: build it under a temporary name, then rename.

Several ranks may provision the same cache entry at once; only complete directories are ever
visible under the final name, and a half-written temporary directory is never used.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable

COMPLETE_MARKER = ".complete"


def is_complete(path: str, required: tuple = ()) -> bool:
    """The marker is there, and so is every `required` file (a marked stub is not complete)."""
    return all(os.path.isfile(os.path.join(path, name)) for name in (COMPLETE_MARKER,) + tuple(required))


def build_once(path: str, build: Callable[[str], None], timeout_s: float = 1800.0, required: tuple = ()) -> str:
    """Return `path`, calling `build(tmp_dir)` first if no complete copy exists.

    Concurrent callers race on `os.rename`; the loser discards its copy. A directory without the
    completion marker (an interrupted older layout) is replaced, never read.
    """
    if is_complete(path, required):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    lock = path + ".lock"
    if _try_lock(lock):
        try:
            if not is_complete(path, required):
                _build_and_publish(path, parent, build, required)
        finally:
            os.unlink(lock)
        return path
    return _wait_for(path, lock, build, timeout_s, required)


def _build_and_publish(path: str, parent: str, build: Callable[[str], None], required: tuple = ()) -> None:
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        build(tmp)
        missing = [name for name in required if not os.path.isfile(os.path.join(tmp, name))]
        assert not missing, f"building {path} left out {missing}: not published"
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            f.write(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        if os.path.exists(path):
            shutil.rmtree(path)  # incomplete leftover: never used, replaced
        os.rename(tmp, path)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _try_lock(lock: str) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        # The builder died (killed by torchrun after another rank failed, say): its lock is stale at
        # once when its pid is gone from this host, and in any case after an hour.
        if not _holder_alive(lock) or time.time() - _mtime(lock) > 3600:
            try:
                os.unlink(lock)
            except FileNotFoundError:
                pass
            return _try_lock(lock)
        return False
    os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
    os.close(fd)
    return True


def _holder_alive(lock: str) -> bool:
    """Whether the process named in `lock` ("host pid") still runs; a lock of another host (a shared
    cache directory), or one being written, counts as alive."""
    try:
        with open(lock) as f:
            host, pid = f.read().split()
        pid = int(pid)
    except (OSError, ValueError):
        return True
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except FileNotFoundError:
        return time.time()


def _wait_for(path: str, lock: str, build, timeout_s: float, required: tuple = ()) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if is_complete(path, required):
            return path
        if not os.path.exists(lock):
            return build_once(path, build, timeout_s, required)
        time.sleep(0.5)
    raise TimeoutError(
        f"waited {timeout_s:.0f}s for {path} to be built (lock {lock}): remove the lock if its builder died"
    )


def save_pretrained_here(model, out_dir: str) -> None:
    """`model.save_pretrained(out_dir)` that writes on whichever rank calls it.

    transformers 5.x (`distributed/mixin.py` `should_save_on_this_rank`) silently skips the weights
    and config.json on every torch.distributed rank but 0; a cache entry is built by whichever rank
    wins the lock, so without this a rank-1 build published only the tokenizer files.
    """
    model.should_save_on_this_rank = lambda is_main_process: True  # instance attribute: this call only
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        del model.should_save_on_this_rank
