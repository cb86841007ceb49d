"""Run a benchmark subprocess while sampling the resident memory of its ranks.

For a launcher (torchrun), the ranks are the launcher's direct children; each rank's figure includes
its own children (a vLLM engine-core process, say). For a single process, the process is the rank.
RSS counts shared pages (libraries, memory-mapped checkpoints) once per process, so the sum over
ranks is an upper bound of what the ranks hold together; PSS (proportional share) is sampled too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import psutil

GIB = 1024**3


@dataclass
class MemoryPeaks:
    per_rank_rss_gib: list[float] = field(default_factory=list)  # each rank's own peak, rank order (by pid)
    sum_rss_gib: float = 0.0  # peak of the sum over ranks at one sampling instant
    sum_pss_gib: float = 0.0  # the same with PSS (0 where the kernel does not report it)
    samples: int = 0
    pss_samples: int = 0  # samples that read PSS too (rate-limited: MemorySampler.pss_duty)

    def as_dict(self) -> dict:
        return {
            "per_rank_rss_gib": self.per_rank_rss_gib,
            "sum_rss_gib": self.sum_rss_gib,
            "sum_pss_gib": self.sum_pss_gib,
            "samples": self.samples,
            "pss_samples": self.pss_samples,
        }


def _tree_memory(proc: psutil.Process, with_pss: bool) -> tuple[int, int]:
    rss = pss = 0
    try:
        tree = [proc] + proc.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0, 0  # the rank exited (the run is ending): it holds nothing now
    for p in tree:
        try:
            if with_pss:
                info = p.memory_full_info()
                rss, pss = rss + info.rss, pss + getattr(info, "pss", 0)
            else:
                rss += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # exited between listing and reading: it holds nothing now
    return rss, pss


class MemorySampler(threading.Thread):
    """Samples the ranks of `pid` every `interval_s` until stop(); PSS at most every `pss_every`-th sample
    and no more than `pss_duty` of the time: PSS reads smaps_rollup, which walks each rank's page tables
    under its memory-map lock (~60 ms a 3 GB rank, measured), time taken from the ranks it measures on a
    small machine. RSS (statm, ~0.05 ms) is read on every sample."""

    def __init__(
        self,
        pid: int,
        launcher: bool,
        interval_s: float = 0.5,
        with_pss: bool = True,
        pss_every: int = 4,
        pss_duty: float = 0.01,
    ):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.launcher, self.interval_s, self.with_pss, self.pss_every = launcher, interval_s, with_pss, pss_every
        self.pss_duty = pss_duty
        self._stop_event = threading.Event()
        self._rank_peak: dict[int, int] = {}
        self._pss_next = 0.0  # monotonic time before which no PSS is read
        self.peaks = MemoryPeaks()

    def _ranks(self) -> list[psutil.Process]:
        try:
            return self.root.children() if self.launcher else [self.root]
        except psutil.NoSuchProcess:
            return []

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval_s)

    def sample(self) -> None:
        total_rss = total_pss = 0
        now = time.monotonic()
        with_pss = self.with_pss and self.peaks.samples % self.pss_every == 0 and now >= self._pss_next
        for rank in self._ranks():
            rss, pss = _tree_memory(rank, with_pss)
            self._rank_peak[rank.pid] = max(self._rank_peak.get(rank.pid, 0), rss)
            total_rss, total_pss = total_rss + rss, total_pss + pss
        if with_pss:  # the next PSS read waits so that reading stays under pss_duty of the time
            self._pss_next = now + (time.monotonic() - now) / self.pss_duty
            self.peaks.pss_samples += 1
        p = self.peaks
        p.sum_rss_gib = max(p.sum_rss_gib, total_rss / GIB)
        p.sum_pss_gib = max(p.sum_pss_gib, total_pss / GIB)
        p.per_rank_rss_gib = [self._rank_peak[pid] / GIB for pid in sorted(self._rank_peak)]
        p.samples += 1

    def stop(self) -> MemoryPeaks:
        self._stop_event.set()
        self.join()
        return self.peaks


@dataclass
class RunResult:
    returncode: int
    wall_s: float
    memory: MemoryPeaks
    log_path: str
    timed_out: bool = False


def run_sampled(
    cmd: list[str],
    log_path: str,
    launcher: bool,
    timeout_s: float,
    env: dict | None = None,
    cwd: str | None = None,
    echo: Optional[Callable[[str], bool]] = None,
) -> RunResult:
    """Run cmd with its output in log_path (lines passing `echo` also on the console), sampling memory.

    The command runs in its own session, so at timeout its whole process group is ended.
    """
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    t0 = time.perf_counter()
    killed = threading.Event()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        sampler = MemorySampler(proc.pid, launcher)
        sampler.start()
        timer = threading.Timer(timeout_s, _kill_group, args=(proc.pid, killed))
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()  # the log can be followed while the part runs
                if echo is not None and echo(line):
                    print("    " + line.rstrip()[:200], flush=True)
            proc.wait()
        finally:
            timer.cancel()
            memory = sampler.stop()
    return RunResult(proc.returncode, time.perf_counter() - t0, memory, log_path, killed.is_set())


def _kill_group(pid: int, killed: threading.Event) -> None:
    """End the process group started for this run (its own session: nothing else is in it)."""
    killed.set()
    try:
        os.killpg(pid, signal.SIGTERM)
        time.sleep(10)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""
