"""Leave a finished command-line program without Python's final teardown (rlstack.train and the CLIs).

Python's exit after a training run spends ~1.4 s a process freeing its ~4000 modules and torch's,
oneDNN's and gloo's static state, after the run's last line is written (tiny_cpu, 2 ranks, AMD EPYC:
a one-step run 12.3 -> 10.4 s end to end; the test suite launches a few hundred such processes).
`exit_now` keeps every step of an exit that can matter and skips that one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn


def run_main(main: Callable[[], object]) -> NoReturn:
    """`sys.exit(main())`, ending through `exit_now`; an exception other than SystemExit unwinds as usual."""
    try:
        status = main()
    except SystemExit as e:
        status = e.code
    exit_now(status)


def exit_now(code) -> NoReturn:
    """Leave the process with `code` (an int, None for 0, or a message for 1) as Python's exit would, less
    its final teardown: wait for non-daemon threads (an asynchronous save still writing), run the atexit
    handlers (multiprocessing's children, temporary directories), close the log files, flush stdout and
    stderr, then `os._exit`. What is skipped is the interpreter freeing its ~4000 modules and torch's,
    oneDNN's and gloo's static state: ~1.4 s of every rank's exit, spent after the run's last line
    (tiny_cpu, 2 ranks, AMD EPYC: a one-step run 12.3 -> 10.4 s end to end). Every file rlstack writes is
    closed before this: the trackers and the checkpointer close theirs when the run ends."""
    import atexit
    import logging
    import threading

    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
                pass
        os._exit(code)
