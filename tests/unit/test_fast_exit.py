"""megatron_bridge/fast_exit.py: a program ended by `run_main` skips only the interpreter's teardown. Its exit
status is main's, non-daemon threads finish, atexit handlers run, and what it printed or logged is flushed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.runs import ROOT

PROGRAM = """
import atexit, logging, sys, threading, time
from megatron_bridge.fast_exit import run_main

out = sys.argv[1]
def late_write():  # an asynchronous save still writing when main returns
    time.sleep(0.3)
    open(out + "/thread", "w").write("done")
threading.Thread(target=late_write).start()
atexit.register(lambda: open(out + "/atexit", "w").write("ran"))
log = logging.getLogger("t")
log.addHandler(logging.FileHandler(out + "/log"))
log.warning("logged")
sys.stdout.write("no newline, still buffered")
run_main(lambda: {result})
"""


@pytest.mark.parametrize(
    "result,status,stderr",
    [("3", 3, ""), ("None", 0, ""), ("sys.exit(2)", 2, ""), ("sys.exit('error: a message')", 1, "error: a message")],
)
def test_run_main_exits_with_mains_status_after_threads_atexit_and_flushes(tmp_path, result, status, stderr):
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(result=result), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},  # stdout buffered, as in a job
    )
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "no newline, still buffered"
    assert proc.stderr.strip() == stderr
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "log").read_text() == "logged\n"
