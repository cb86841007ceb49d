"""The host allocator (glibc): a fixed mmap threshold, and handing freed heap pages back.

Tensors on CPU come from glibc's malloc. `parallel.host_mmap_threshold_kb` (docs/memory.md) trades
speed for memory: with a fixed threshold each larger tensor is mapped on its own and unmapped on
free (resident memory follows live tensors; every new page is a fault), with glibc's dynamic one
they come from the heap (reused without faults, but freed pages stay resident and fragment).
`trim_heap` at each phase of a step returns the heap's free pages in both modes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Optional


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
    """`malloc_trim(0)`: give the heap's free pages back to the kernel (True when some were).

    With glibc's dynamic threshold the update's freed activations stay resident until trimmed
    (SmolLM2, one rank: 4.4 GiB between updates untrimmed, 1.9 GiB trimmed); with a fixed threshold
    there is little to give back. It costs milliseconds, and the next phase faults its pages in.
    """
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
