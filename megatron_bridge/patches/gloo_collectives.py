"""megatron's grad reduce-scatter and param all-gather of its DDP buckets, in place, on CPU
(measurements: docs/megatron_core.md "Grad and param buckets on gloo"). Registered in
`megatron_bridge.patches.registry` (kind "gloo collective", applies without CUDA).

Where every member of the group runs on this host, the buckets move through shared memory
(`HostStaging`): a few MiB of staging per rank in /dev/shm, mapped by every member, instead of gloo's
TCP loopback. Elsewhere (ranks on several hosts, no usable /dev/shm, `RLSTACK_HOST_SHM_COLLECTIVES=0`)
the group's own gloo collectives run, in place.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
from typing import Optional

import torch

log = logging.getLogger(__name__)

# Staging a rank keeps in /dev/shm, all chunks and both slots together (bytes); module-level so tests
# can shrink it to exercise many chunks.
STAGE_BYTES = 16 << 20
SHM_DIR = "/dev/shm"
ENV_SWITCH = "RLSTACK_HOST_SHM_COLLECTIVES"  # "0": gloo's collectives even on one host


# (l) distributed/param_and_grad_buffer.py `dist_reduce_scatter_func` / `dist_all_gather_func`
#     (torch's reduce_scatter_tensor / all_gather_into_tensor, bound at :35-36): the distributed
#     optimizer's grad reduce-scatter (`start_grad_sync`, :443) and param all-gather
#     (`start_param_sync`, :285), each bucket's own shard (`shard_buffer`) against the whole bucket.
#     gloo has neither collective in place: each stages a full-bucket copy and the reduce-scatter
#     takes about twice an all-reduce; inside megatron's `_coalescing_manager` torch then queues them
#     as `reduce_scatter_single_coalesced`, slower still (figures: docs/megatron_core.md). On CPU
#     tensors, with the whole group on this host, each rank sums its own shard from the others'
#     staged chunks and copies the others' shards from theirs (`HostStaging`); otherwise the grad
#     bucket is all-reduced in place by gloo (the shard gets the same sum; the other shards, which the
#     optimizer never reads, get it too) and the params are gathered by one broadcast per shard from
#     its owner. Both ways the gathered params are the owners' bits. Asynchronous calls (overlap,
#     which rlstack leaves off) and other layouts keep torch's functions.
def _own_shard(shard: torch.Tensor, whole: torch.Tensor, group) -> bool:
    """Is `shard` this rank's contiguous 1/size view of `whole` (as megatron's shard_buffer makes it)?"""
    size, rank = group.size(), group.rank()
    return (
        shard.is_contiguous()
        and whole.is_contiguous()
        and shard.dtype == whole.dtype
        and shard.numel() * size == whole.numel()
        and shard.data_ptr() == whole.data_ptr() + rank * shard.numel() * shard.element_size()
    )


class HostStaging:
    """Shared-memory staging for the members of one process group, all on this host.

    Each member owns STAGE_BYTES in /dev/shm, as two slots of (size - 1) pieces, and maps every other
    member's. A collective walks the shard in chunks of one piece: every member writes what the others
    need of the chunk into its own slot (one piece for each other member), all meet at a gloo barrier,
    and each reads its pieces from the others' slots. The slots alternate chunk by chunk across calls,
    so a member writes a slot again only after a barrier that every other member reached after reading
    it: one barrier a chunk, none between calls. The files are unlinked once every member has mapped
    them (nothing is left in /dev/shm, even by a killed run).
    """

    def __init__(self, group, slots: list[torch.Tensor]):
        self.group, self.slots = group, slots  # slots[member]: uint8 [2, size - 1, piece bytes]
        self.piece_bytes = slots[group.rank()].shape[-1]
        self.count = 0  # chunks moved so far: the slot of the next chunk

    @staticmethod
    def open(group) -> Optional[HostStaging]:
        """Collective over `group`: the staging, or None (every member agrees) where some member cannot
        map every other member's file (another host, no /dev/shm, no room in it)."""
        import torch.distributed as dist

        size, rank = group.size(), group.rank()
        token = torch.zeros(16, dtype=torch.uint8)
        if rank == 0:
            token.copy_(torch.frombuffer(bytearray(secrets.token_bytes(16)), dtype=torch.uint8))
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([token], opts).wait()
        name = bytes(token.tolist()).hex()
        paths = [os.path.join(SHM_DIR, f"rlstack-buckets-{name}-{m}") for m in range(size)]
        piece = max(64, STAGE_BYTES // (2 * (size - 1)) // 64 * 64)  # a multiple of every element size
        nbytes = 2 * (size - 1) * piece
        ok = _create(paths[rank], nbytes)
        group.barrier().wait()
        slots = []
        if ok:
            try:
                for path in paths:
                    if os.path.getsize(path) != nbytes:
                        raise OSError(f"{path}: {os.path.getsize(path)} bytes, not {nbytes}")
                    t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                    slots.append(t.view(2, size - 1, piece))
            except (OSError, RuntimeError) as e:
                log.debug("host staging: %s", e)
                ok = False
        agreed = torch.tensor([int(ok)], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        group.allreduce([agreed], opts).wait()  # every member has tried every file by now
        with contextlib.suppress(OSError):  # mapped (or given up) by every member: the file can go
            os.unlink(paths[rank])
        return HostStaging(group, slots) if int(agreed) == 1 else None

    def _chunks(self, shard: int, elem: int):
        """(lo, hi, slot) over a shard of `shard` elements of `elem` bytes."""
        step = self.piece_bytes // elem
        for lo in range(0, shard, step):
            sl = self.count % 2
            self.count += 1
            yield lo, min(lo + step, shard), sl

    def _piece(self, member: int, sl: int, j: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        """Piece j of `member`'s slot `sl`, as n elements of dtype."""
        return self.slots[member][sl, j].view(dtype)[:n]

    def reduce_scatter(self, whole: torch.Tensor) -> None:
        """whole [size * shard]: this rank's shard <- the sum over members of their shard, in place.
        The sum runs own value first, then the others in rank order (with two members: a + b, as gloo)."""
        size, rank = self.group.size(), self.group.rank()
        parts = whole.view(size, -1)
        others = [m for m in range(size) if m != rank]
        for lo, hi, sl in self._chunks(parts.size(1), whole.element_size()):
            for j, m in enumerate(others):  # piece j: for the j-th other member
                self._piece(rank, sl, j, whole.dtype, hi - lo).copy_(parts[m, lo:hi])
            self.group.barrier().wait()
            acc = parts[rank, lo:hi]
            for m in others:  # this rank is member m's (rank - 1)-th other when m < rank
                acc.add_(self._piece(m, sl, rank - (m < rank), whole.dtype, hi - lo))

    def all_gather(self, whole: torch.Tensor) -> None:
        """whole [size * shard]: every member's shard <- its owner's, bit for bit, in place."""
        size, rank = self.group.size(), self.group.rank()
        parts = whole.view(size, -1)
        for lo, hi, sl in self._chunks(parts.size(1), whole.element_size()):
            self._piece(rank, sl, 0, whole.dtype, hi - lo).copy_(parts[rank, lo:hi])  # one piece serves all
            self.group.barrier().wait()
            for m in range(size):
                if m != rank:
                    parts[m, lo:hi].copy_(self._piece(m, sl, 0, whole.dtype, hi - lo))


def _create(path: str, nbytes: int) -> bool:
    """This member's staging file (a new one), unless RLSTACK_HOST_SHM_COLLECTIVES=0."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and shm_file(path, nbytes, exclusive=True)


def shm_file(path: str, nbytes: int, exclusive: bool) -> bool:
    """A file of `nbytes` at `path` (under /dev/shm), its blocks allocated now: a full tmpfs answers
    ENOSPC here, not SIGBUS at the first write through a mapping. `exclusive`: a new file (O_EXCL);
    otherwise the host's ranks may open and size one file together (its bytes start as zeros). False,
    logged at debug, where it cannot be made (no such directory, no room). Also used by
    rlstack/rollout/host_cores.py (the host's table of lent cores)."""
    if not os.path.isdir(os.path.dirname(path)):
        return False
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | (os.O_EXCL if exclusive else 0), 0o600)
    except OSError as e:
        log.debug("shared-memory file: %s", e)
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return True
    except OSError as e:
        log.debug("shared-memory file: %s", e)
        return False
    finally:
        os.close(fd)


_STAGING: dict[int, tuple[object, Optional[HostStaging]]] = {}


def host_staging(group) -> Optional[HostStaging]:
    """The group's HostStaging (opened at its first collective), or None where gloo's path runs."""
    entry = _STAGING.get(id(group))
    if entry is None or entry[0] is not group:
        entry = _STAGING[id(group)] = (group, HostStaging.open(group) if group.size() > 1 else None)
    return entry[1]


def _patch_gloo_bucket_collectives() -> None:
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffers

    reduce_scatter, all_gather = buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func
    if getattr(reduce_scatter, "_rlstack_gloo", False):
        return

    @functools.wraps(reduce_scatter)
    def gloo_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op or group is None or input.is_cuda or not _own_shard(output, input, group):
            return reduce_scatter(output, input, op=op, group=group, async_op=async_op)
        staging = host_staging(group) if op == dist.ReduceOp.SUM else None
        if staging is not None:
            staging.reduce_scatter(input)
            return None
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        # The group's own allreduce: `dist.all_reduce` inside a `_coalescing_manager` is only queued,
        # and torch runs the queue as `allreduce_coalesced`, which flattens into a copy.
        group.allreduce([input], opts).wait()
        return None

    @functools.wraps(all_gather)
    def gloo_all_gather(output, input, group=None, async_op=False):
        if async_op or group is None or output.is_cuda or not _own_shard(input, output, group):
            return all_gather(output, input, group=group, async_op=async_op)
        staging = host_staging(group)
        if staging is not None:
            staging.all_gather(output)
            return None
        for member, shard in enumerate(output.view(group.size(), -1)):
            dist.broadcast(shard, group=group, group_src=member)  # not queued by _coalescing_manager
        return None

    gloo_reduce_scatter._rlstack_gloo = gloo_all_gather._rlstack_gloo = True
    buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func = gloo_reduce_scatter, gloo_all_gather
