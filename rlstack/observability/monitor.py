"""Resource monitor: host memory (process RSS, system use) and, with CUDA, device memory per rank.

Every rank calls `sample()` once per step: it returns the numbers for the trackers, writes one
file-only line to the rank's log, and logs a WARNING the first time usage passes the configured
fraction (again only after usage has dropped below it and crossed once more).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import psutil

from rlstack.errors import UserError
from rlstack.observability.logging import FILE_ONLY, LOGGER_NAME

GIB = 1024**3
FIX_HOST = "lower rollout.micro_batch_size or algorithm.micro_batch_size, or set model.gradient_checkpointing=true"
FIX_GPU = "lower rollout.gpu_memory_utilization or the micro batch sizes"


# The high-water marks (bytes) before their last reset by `PhaseMemory`: the kernel's RSS mark
# (folded into peak_rss_gib) and torch's CUDA peak, so lifetime peaks survive the per-phase resets.
_PEAK_BEFORE_RESET = 0
_GPU_PEAK_BEFORE_RESET = 0


def gpu_peak_bytes(device: int) -> int:
    """Peak CUDA bytes allocated by torch over the process's life (across PhaseMemory's resets)."""
    import torch

    return max(torch.cuda.max_memory_allocated(device), _GPU_PEAK_BEFORE_RESET)


def _host_peak_bytes() -> int:
    """VmHWM of this process (bytes): the RSS high-water mark since start or the last reset."""
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM:")).split()[1]) * 1024


def _reset_host_peak() -> bool:
    """Restart the kernel's RSS high-water mark at the current RSS (Linux clear_refs 5); False where unsupported."""
    global _PEAK_BEFORE_RESET
    try:
        peak = _host_peak_bytes()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except (OSError, StopIteration):
        return False
    _PEAK_BEFORE_RESET = max(_PEAK_BEFORE_RESET, peak)
    return True


class PhaseMemory:
    """Peak memory of each phase of a step on this rank (`mem/peak_gib/<phase>`).

    CUDA: torch's peak allocated bytes, reset at each phase; host: the kernel's RSS high-water
    mark (VmHWM), reset at each phase through /proc/self/clear_refs (where that is not writable
    the host figures are left out). A phase entered twice in a step reports the larger peak.
    """

    def __init__(self):
        self._phase: Optional[str] = None
        self._peaks: dict[str, float] = {}
        self._cuda = _cuda_available()
        self._host = sys.platform.startswith("linux") and _reset_host_peak()

    def start(self) -> None:
        """A new step: earlier phases (validation, checkpoints) are not part of it."""
        self._phase, self._peaks = None, {}

    def enter(self, phase: str) -> None:
        self._close()
        self._phase = phase
        if self._cuda:
            import torch

            global _GPU_PEAK_BEFORE_RESET
            _GPU_PEAK_BEFORE_RESET = gpu_peak_bytes(torch.cuda.current_device())
            torch.cuda.reset_peak_memory_stats()
        if self._host:
            _reset_host_peak()

    def metrics(self) -> dict[str, float]:
        """This step's phase peaks (GiB); the open phase is closed."""
        self._close()
        self._phase = None
        return dict(self._peaks)

    def _close(self) -> None:
        if self._phase is None:
            return
        figures = {}
        if self._host:
            figures["mem/peak_gib/" + self._phase] = _host_peak_bytes() / GIB
        if self._cuda:
            import torch

            figures["mem/gpu_peak_gib/" + self._phase] = (
                torch.cuda.max_memory_allocated(torch.cuda.current_device()) / GIB
            )
        for key, value in figures.items():
            self._peaks[key] = max(value, self._peaks.get(key, 0.0))


def peak_rss_gib(include_children: bool = False) -> float:
    """This process's peak RSS in GiB: the kernel's high-water mark, so peaks between samples count.

    include_children adds getrusage(RUSAGE_CHILDREN).ru_maxrss: the peak of the largest child that
    has *exited and been waited for* (a max, not a sum). Live children, such as vLLM's engine-core
    process, are not in it: sample() reports them as `mem/children_rss_gib`.
    """
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, _PEAK_BEFORE_RESET)
    if include_children:
        peak += resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale
    return peak / GIB


def memory_limit_bytes() -> int:
    """Physical memory, or the cgroup limit when lower (containers, SLURM jobs)."""
    limits = [psutil.virtual_memory().total]
    for path in _cgroup_limit_files():
        value = _read_limit(path)
        if value is not None and value > 0:
            limits.append(value)
    return min(limits)


def _cgroup_limit_files() -> list[str]:
    files = ["/sys/fs/cgroup/memory/memory.limit_in_bytes"]  # cgroup v1; "unlimited" is huge
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return files
    for line in lines:
        if line.startswith("0::"):  # cgroup v2: every ancestor's memory.max also binds
            parts = [p for p in line[3:].strip().split("/") if p]
            for i in range(len(parts), -1, -1):
                files.append(os.path.join("/sys/fs/cgroup", *parts[:i], "memory.max"))
    return files


def _read_limit(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class ResourceMonitor:
    """Samples memory each step and warns once per crossing of `warn_fraction`.

    Host check: max((process RSS + live children RSS) / total_bytes, system used fraction): a node
    runs out when the system is full, even if this rank's own share is small.
    GPU check (CUDA only): device-wide used / total from cudaMemGetInfo, which includes the rollout
    engine's preallocated share (rollout.gpu_memory_utilization) and other processes on the GPU.
    """

    def __init__(
        self,
        warn_fraction: float = 0.85,
        logger: Optional[logging.Logger] = None,
        total_bytes: Optional[int] = None,
        log_samples: bool = True,
    ):
        if not 0.0 < warn_fraction <= 1.0:
            raise UserError(f"logging.memory_warn_fraction is {warn_fraction}: use a fraction in (0, 1]")
        self.warn_fraction = warn_fraction
        self.logger = logger or logging.getLogger(LOGGER_NAME + ".monitor")
        self.total_bytes = total_bytes or memory_limit_bytes()
        self.log_samples = log_samples
        self._process = psutil.Process()
        self._peak_rss = 0
        self._above: dict[str, bool] = {}
        self._cuda = _cuda_available()

    def sample(self) -> dict[str, float]:
        metrics = self._host_sample()
        if self._cuda:
            metrics.update(self._gpu_sample())
        if self.log_samples:
            line = " | ".join(f"{k} {v:.3g}" for k, v in metrics.items())
            self.logger.info(line, extra={FILE_ONLY: True})  # every rank's file, never the console
        return metrics

    def _host_sample(self) -> dict[str, float]:
        rss = self._process.memory_info().rss
        children = self._children_rss()
        self._peak_rss = max(self._peak_rss, rss)
        vm = psutil.virtual_memory()
        system_frac = (vm.total - vm.available) / vm.total
        metrics = {
            "mem/rss_gib": rss / GIB,
            "mem/rss_peak_gib": max(peak_rss_gib(), self._peak_rss / GIB),
            "mem/system_used_frac": system_frac,
        }
        if children:
            metrics["mem/children_rss_gib"] = children / GIB
        process_frac = (rss + children) / self.total_bytes
        self._check(
            "host",
            max(process_frac, system_frac),
            FIX_HOST,
            f"host memory {max(process_frac, system_frac):.0%} used (this rank: RSS "
            f"{(rss + children) / GIB:.1f} GiB of {self.total_bytes / GIB:.1f} GiB; "
            f"system {system_frac:.0%} used)",
        )
        return metrics

    def _children_rss(self) -> int:
        total = 0
        for child in self._process.children(recursive=True):
            try:
                total += child.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass  # a child that exited between listing and reading holds no memory
        return total

    def _gpu_sample(self) -> dict[str, float]:
        import torch

        device = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        used_frac = (total - free) / total
        self._check(
            "gpu",
            used_frac,
            FIX_GPU,
            f"GPU {device} memory {used_frac:.0%} used ({(total - free) / GIB:.1f} of "
            f"{total / GIB:.1f} GiB; this rank: allocated {allocated / GIB:.1f} GiB, "
            f"reserved {reserved / GIB:.1f} GiB)",
        )
        return {
            "mem/gpu_alloc_gib": allocated / GIB,
            "mem/gpu_peak_gib": gpu_peak_bytes(device) / GIB,
            "mem/gpu_reserved_gib": reserved / GIB,
            "mem/gpu_used_frac": used_frac,
        }

    def _check(self, name: str, fraction: float, fix: str, detail: str) -> None:
        above = fraction > self.warn_fraction
        if above and not self._above.get(name, False):
            self.logger.warning(f"memory: {detail}, past logging.memory_warn_fraction={self.warn_fraction}: {fix}")
        self._above[name] = above
