"""megatron_bridge/patches/checkpoint_writer.py (p): the results queue of megatron's checkpoint writer is served
by a forked process that the kernel kills with its rank; megatron's own (a spawned Manager) outlived a
SIGKILLed rank, ~280 MB re-parented to init."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.e2e.runs import ROOT

RANK = """
import os, sys, time
from megatron_bridge import patches
patches.apply()
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron_bridge.patches import checkpoint_writer
queue = filesystem_async._get_write_results_queue()  # as FileSystemWriterAsync.prepare_write_data calls it
assert filesystem_async._get_write_results_queue() is queue  # one per process
queue.put("result"); assert queue.get() == "result"
print(checkpoint_writer._manager._process.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, waiting for its reaper
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_queues_process_dies_with_a_killed_rank():
    rank = subprocess.Popen([sys.executable, "-c", RANK], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        server = int(rank.stdout.readline())
        assert _alive(server)
        with open(f"/proc/{server}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == rank.pid  # forked by the rank itself
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server), "the checkpoint writer's queue process outlived its rank"
    finally:
        rank.kill()
