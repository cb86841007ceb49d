"""The host allocator: tcmalloc where it is installed, else glibc with a fixed mmap threshold.

Tensors on CPU come from the process's malloc. `parallel.host_allocator` (docs/memory.md) picks it:
`tcmalloc` (gperftools' libtcmalloc_minimal, preloaded by re-executing the rank at start) keeps
freed spans and hands them to the next tensor that fits, so neither the update nor the rollout
page-faults every new tensor in: the SmolLM2 demo step took 37.5-38.8 s at a 3.57 GiB peak a rank,
against 43.7-48.4 s at 3.21 GiB with glibc's fixed threshold (the same machine, one after the other).
vLLM's CPU backend asks for the same library. With `glibc`, `parallel.host_mmap_threshold_kb` trades
speed for memory: with a fixed threshold each larger tensor is mapped on its own and unmapped on
free (resident memory follows live tensors; every new page is a fault), with glibc's dynamic one
they come from the heap (reused without faults, but freed pages stay resident and fragment).
`trim_heap` at each phase of a step returns glibc's free heap pages in both modes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from typing import Optional

from rlstack.config import CHOICES
from rlstack.errors import UserError

ALLOCATORS = CHOICES["parallel.host_allocator"]  # the config's own list: auto | tcmalloc | glibc
# The preload is done once: the re-executed rank finds this set and never execs again.
_EXEC_MARK = "RLSTACK_HOST_ALLOCATOR_EXEC"
# A path to the library, where it is not on the loader's search path.
TCMALLOC_ENV = "RLSTACK_TCMALLOC"
_TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")  # gperftools: Debian's libtcmalloc-minimal4 first
INSTALL_HINT = "apt-get install libtcmalloc-minimal4 (or dnf install gperftools-libs)"


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # glibc only (not musl, macOS)
    except (OSError, AttributeError):
        return None
    return libc


def set_mmap_threshold(kb: int) -> bool:
    """Fix glibc's mmap threshold at `kb` KiB (0: leave glibc's default). True when it took effect.

    glibc serves allocations below its threshold from the heap and, by default, raises the threshold
    to the size of each mmap'd block freed (up to 32 MiB): after the first step every activation of a
    micro-batch (a few MiB each) comes from the heap, whose freed pages stay resident (fragmented,
    not trimmed). A fixed threshold (`mallopt(M_MMAP_THRESHOLD)`, which also stops the dynamic
    adjustment) maps each such tensor on its own and unmaps it on free. No effect off glibc.
    """
    libc = _libc()
    if kb <= 0 or libc is None:
        return False
    m_mmap_threshold = -3  # <malloc.h>
    return libc.mallopt(m_mmap_threshold, int(kb) * 1024) == 1


def trim_heap() -> bool:
    """`malloc_trim(0)` at a phase boundary: glibc's free heap pages back to the kernel (True when some were).

    With glibc's dynamic threshold the update's freed activations stay resident until trimmed
    (SmolLM2, one rank: 4.4 GiB between updates untrimmed, 1.9 GiB trimmed); with a fixed threshold
    there is little to give back. It costs milliseconds, and the next phase faults its pages in.
    Under tcmalloc nothing is handed back, on purpose (its background release is off too,
    TCMALLOC_RELEASE_RATE=0): on these VMs a page fault is dear, and releasing tcmalloc's free spans
    at each phase (`MallocExtension_ReleaseFreeMemory`) gave back glibc's step time (SmolLM2 demo
    step 43-46 s vs 37-39 s) for 0.3 GiB less peak per rank (docs/memory.md).
    """
    if loaded_allocator() == "tcmalloc":
        return False
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def find_tcmalloc() -> Optional[str]:
    """The tcmalloc library to preload: $RLSTACK_TCMALLOC, else the loader's libtcmalloc_minimal/libtcmalloc."""
    path = os.environ.get(TCMALLOC_ENV, "")
    if path:
        return path if os.path.isfile(path) else None
    for name in _TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


@functools.lru_cache(maxsize=1)
def loaded_allocator() -> str:
    """ "tcmalloc" when this process runs on tcmalloc (mapped, hence preloaded), else "glibc"."""
    try:
        with open("/proc/self/maps") as f:
            return "tcmalloc" if "libtcmalloc" in f.read() else "glibc"
    except OSError:
        return "glibc"


def wanted_allocator(choice: str, gpu_host: Optional[bool] = None) -> tuple[str, Optional[str]]:
    """(allocator, library path or None) for `parallel.host_allocator`; UserError when it cannot be had.

    `auto` takes tcmalloc on hosts without NVIDIA GPUs when the library is installed (the CPU path,
    where activations live in host memory), glibc otherwise: GPU runs keep their tensors on the GPU
    and have not been measured with tcmalloc.
    """
    if choice not in ALLOCATORS:
        raise UserError(f"parallel.host_allocator={choice!r}: use one of {', '.join(ALLOCATORS)}")
    if choice == "glibc":
        return "glibc", None
    path = find_tcmalloc()
    if choice == "tcmalloc" and path is None:
        where = f"${TCMALLOC_ENV}={os.environ[TCMALLOC_ENV]} is not a file" if os.environ.get(TCMALLOC_ENV) else ""
        raise UserError(
            f"parallel.host_allocator=tcmalloc: {where or 'no libtcmalloc on this machine'}; "
            f"install it ({INSTALL_HINT}), point ${TCMALLOC_ENV} at it, or set parallel.host_allocator=glibc"
        )
    if gpu_host is None:
        gpu_host = os.path.exists("/dev/nvidiactl")
    if path is None or (choice == "auto" and gpu_host):
        return "glibc", None
    return "tcmalloc", path


def exec_with_allocator(choice: str) -> None:
    """Re-execute this process with tcmalloc preloaded when `choice` wants it and it is not loaded.

    Called at the very start of a rank (before torch, threads or process groups exist): exec keeps the
    pid, so torchrun still watches the same child. Runs at most once (the environment marks it).
    """
    allocator, path = wanted_allocator(choice)
    if allocator != "tcmalloc" or loaded_allocator() == "tcmalloc" or os.environ.get(_EXEC_MARK):
        return
    preload = os.environ.get("LD_PRELOAD", "")
    env = {**os.environ, _EXEC_MARK: "1", "LD_PRELOAD": f"{path} {preload}".strip()}
    env.setdefault("TCMALLOC_RELEASE_RATE", "0")  # freed spans stay for reuse (trim_heap: why)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def configure_allocator(mmap_threshold_kb: int) -> None:
    """At a rank's start: glibc gets its fixed mmap threshold; tcmalloc needs nothing."""
    if loaded_allocator() == "glibc":
        set_mmap_threshold(mmap_threshold_kb)


def describe_allocator(choice: str, mmap_threshold_kb: int) -> str:
    """One line for the run's log: the allocator this process runs on, and why where it is not tcmalloc."""
    if loaded_allocator() == "tcmalloc":
        return "host allocator: tcmalloc (freed memory kept for reuse; parallel.host_mmap_threshold_kb unused)"
    threshold = "glibc's dynamic mmap threshold"
    if mmap_threshold_kb > 0 and _libc() is not None:
        threshold = f"mmap threshold {mmap_threshold_kb} KiB"
    why = ""
    if choice != "glibc" and wanted_allocator(choice)[0] == "tcmalloc":
        why = "; tcmalloc was preloaded but is not mapped (LD_PRELOAD ignored?)"
    elif choice == "auto" and find_tcmalloc() is None:
        why = f"; tcmalloc not installed ({INSTALL_HINT}: a faster update on CPU, docs/memory.md)"
    return f"host allocator: glibc, {threshold}{why}"
