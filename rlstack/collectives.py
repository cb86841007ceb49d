"""Every cross-rank reduction, broadcast and gather in rlstack goes through this module.

Why one module: NCCL refuses CPU tensors (`No backend type associated with device type cpu`), and
most metric code naturally builds CPU tensors (`torch.tensor([loss, tokens])`). Here every tensor
that crosses a group is first put on `device` (the rank's `ParallelGroups.device`: its GPU under
NCCL, the CPU under gloo) and results come back as Python floats or on the caller's device. On CUDA
the default group is also created as `cpu:gloo,cuda:nccl` (`megatron_bridge.parallel.process_group_backend`), so a
CPU tensor that slipped through would still have a path, but nothing here relies on that.

`tests/unit/test_collectives.py` fails when code under rlstack/ or benchmarks/ calls a raw
`torch.distributed` collective anywhere else. (megatron_bridge, a separate library, moves model
tensors that already live on the model's device.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def sum_floats(values: Sequence[float], group, device) -> list[float]:
    """Element-wise sum of a list of Python numbers over `group` (float64 on the wire)."""
    return _reduce_floats(values, group, device, "sum")


def max_floats(values: Sequence[float], group, device) -> list[float]:
    """Element-wise maximum of a list of Python numbers over `group`."""
    return _reduce_floats(values, group, device, "max")


def _reduce_floats(values: Sequence[float], group, device, op: str) -> list[float]:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)  # [n]
    dist.all_reduce(t, op=_OPS[op], group=group)
    return t.tolist()


def all_reduce_(tensor: torch.Tensor, group, device, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of `tensor`; it travels on `device` and is copied back if it lives elsewhere."""
    moved = tensor if tensor.device == torch.device(device) else tensor.to(device)
    dist.all_reduce(moved, op=_OPS[op], group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def sum_over(group, device):
    """A `reduce_fn(t) -> t` summing tensors over `group` (what the pure algorithm code is handed)."""
    return lambda t: all_reduce_(t, group, device)


def broadcast_(tensor: torch.Tensor, src: int, group, device) -> torch.Tensor:
    """In-place broadcast from global rank `src` (same travel rule as `all_reduce_`)."""
    moved = tensor if tensor.device == torch.device(device) else tensor.to(device)
    dist.broadcast(moved, src=src, group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def broadcast_object(obj: Any, src: int, group, device) -> Any:
    """A picklable object from global rank `src` on every rank of `group`."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=_object_device(device))
    return box[0]


def all_gather_objects(obj: Any, group, size: int) -> list:
    """Every rank's object, in group-rank order, on every rank of `group` (size 1: no communication)."""
    if size == 1:
        return [obj]
    parts: list = [None] * size
    # all_gather_object takes no device argument: torch pickles onto the current CUDA device under
    # NCCL, which `parallel.init_distributed` set to this rank's GPU.
    dist.all_gather_object(parts, obj, group=group)
    return parts


def barrier(group, device) -> None:
    """Wait for every rank of `group` (and, on a GPU, for this rank's queued kernels first)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group)


def src_of_last(group) -> int:
    """Global rank of the last member of `group` (e.g. the last pipeline stage)."""
    return dist.get_process_group_ranks(group)[-1]


def _object_device(device) -> Optional[torch.device]:
    device = torch.device(device)
    return device if device.type == "cuda" else None


def missing_ranks(group, timeout_s: float) -> str:
    """After a collective timed out: which ranks of `group` do not check in within `timeout_s`.

    gloo's `monitored_barrier` makes rank 0 wait for every other rank and name the ones that never
    arrive ("Ranks 1 failed to pass monitoredBarrier"); other ranks learn only that it failed. Returns
    the names ("1" or "1, 3"), or "" when every rank arrived or this rank cannot tell. `group` must be a
    gloo group (it is made for this at start-up).
    """
    import datetime
    import re

    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        found = re.findall(r"[Rr]anks? ([\d, ]+) failed to pass", str(e))
        return found[0].strip().rstrip(",") if found else ""
    return ""
