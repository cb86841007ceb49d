"""Publish a directory atomically: build it under a temporary name, then rename.

Several ranks may provision the same cache entry at once; only complete directories are ever
visible under the final name, and a half-written temporary directory is never used. One builder at
a time holds `<path>.lock` through `filelock` (an OS lock on an open file, flock on Linux): the
kernel releases it when its holder exits or is killed, so a lock left by a dead process is free at
once and a live builder's lock is never taken over, however long it builds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable

import filelock

COMPLETE_MARKER = ".complete"


def is_complete(path: str, required: tuple = ()) -> bool:
    """The marker is there, and so is every `required` file (a marked stub is not complete)."""
    return all(os.path.isfile(os.path.join(path, name)) for name in (COMPLETE_MARKER,) + tuple(required))


def build_once(path: str, build: Callable[[str], None], timeout_s: float = 1800.0, required: tuple = ()) -> str:
    """Return `path`, calling `build(tmp_dir)` first if no complete copy exists.

    The lock's holder builds and publishes; the others wait for the lock, then find the copy
    complete. A directory without the completion marker (an interrupted older layout) is replaced,
    never read.
    """
    if is_complete(path, required):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    lock = path + ".lock"
    try:
        with filelock.FileLock(lock, timeout=timeout_s):
            if not is_complete(path, required):  # another rank published it while this one waited
                _build_and_publish(path, parent, build, required)
    except filelock.Timeout:
        raise TimeoutError(
            f"waited {timeout_s:.0f}s for {path} to be built: a live process holds {lock} "
            "(another run building the same cache entry); let it finish or stop it"
        ) from None
    return path


def _build_and_publish(path: str, parent: str, build: Callable[[str], None], required: tuple = ()) -> None:
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        build(tmp)
        missing = [name for name in required if not os.path.isfile(os.path.join(tmp, name))]
        assert not missing, f"building {path} left out {missing}: not published"
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            f.write(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        if os.path.exists(path):
            shutil.rmtree(path)  # incomplete leftover (we hold the lock: nobody else publishes): replaced
        os.rename(tmp, path)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


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
