"""megatron_bridge.atomic.build_once on filelock: a cache entry is built by one process and published
whole, also when two ranks race past a lock that a killed builder left behind."""

import multiprocessing as mp
import os
import signal
import time

import filelock

from megatron_bridge.atomic import COMPLETE_MARKER, build_once, is_complete


def _build(tmp: str) -> None:
    """A slow build that records each time it runs (O_APPEND: one whole line per build)."""
    counter = os.environ["BUILD_COUNTER"]
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.2)  # long enough for the other rank to arrive while this one builds
    with open(os.path.join(tmp, "weights.bin"), "w") as f:
        f.write("w")


def _rank(path: str, barrier, results) -> None:
    barrier.wait()
    out = build_once(path, _build, timeout_s=30, required=("weights.bin",))
    results.put((out, sorted(os.listdir(out))))


def _die_holding_the_lock(path: str) -> None:
    """A builder killed mid-build: it holds the lock and has written half a temporary directory."""
    lock = filelock.FileLock(path + ".lock")
    lock.acquire()
    os.makedirs(path, exist_ok=True)  # an interrupted, unmarked copy under the final name
    with open(os.path.join(path, "weights.bin.part"), "w") as f:
        f.write("half")
    os.kill(os.getpid(), signal.SIGKILL)


def test_two_ranks_racing_a_stale_lock_build_once(tmp_path, monkeypatch):
    path = str(tmp_path / "cache" / "model")
    os.makedirs(os.path.dirname(path))
    counter = tmp_path / "builds"
    monkeypatch.setenv("BUILD_COUNTER", str(counter))
    ctx = mp.get_context("fork")
    dead = ctx.Process(target=_die_holding_the_lock, args=(path,))
    dead.start()
    dead.join(10)
    assert dead.exitcode == -signal.SIGKILL and os.path.exists(path + ".lock")  # the stale lock
    assert not is_complete(path)
    barrier, results = ctx.Barrier(2), ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(path, barrier, results)) for _ in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(30)
    assert [p.exitcode for p in ranks] == [0, 0]
    got = [results.get(timeout=5) for _ in ranks]
    assert counter.read_text().count("\n") == 1  # one rank built; the other waited and found it done
    assert all(out == path and files == [COMPLETE_MARKER, "weights.bin"] for out, files in got)  # the leftover is gone
    assert is_complete(path, ("weights.bin",))
    # a later caller with the lock file still there uses the published copy, building nothing
    assert build_once(path, _build, timeout_s=5) == path
    assert counter.read_text().count("\n") == 1


def test_a_live_holder_is_waited_for_not_taken_over(tmp_path, monkeypatch):
    path = str(tmp_path / "model")
    monkeypatch.setenv("BUILD_COUNTER", str(tmp_path / "builds"))
    with filelock.FileLock(path + ".lock"):  # held by a live process: this one, in another lock object
        ctx = mp.get_context("fork")
        waiter = ctx.Process(target=build_once, args=(path, _build), kwargs={"timeout_s": 0.5})
        waiter.start()
        waiter.join(10)
    assert waiter.exitcode != 0  # it timed out (TimeoutError) rather than building beside the holder
    assert not os.path.exists(tmp_path / "builds")
