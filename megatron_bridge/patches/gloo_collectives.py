"""megatron's grad reduce-scatter and param all-gather of its DDP buckets, in place on gloo
(measurements: docs/megatron_core.md "Grad and param buckets on gloo"). Registered in
`megatron_bridge.patches.registry` (kind "gloo collective", applies without CUDA).
"""

from __future__ import annotations

import functools

import torch


# (l) distributed/param_and_grad_buffer.py `dist_reduce_scatter_func` / `dist_all_gather_func`
#     (torch's reduce_scatter_tensor / all_gather_into_tensor, bound at :35-36): the distributed
#     optimizer's grad reduce-scatter (`start_grad_sync`, :443) and param all-gather
#     (`start_param_sync`, :285), each bucket's own shard (`shard_buffer`) against the whole bucket.
#     gloo has neither collective in place: each stages a full-bucket copy and the reduce-scatter
#     takes about twice an all-reduce; inside megatron's `_coalescing_manager` torch then queues them
#     as `reduce_scatter_single_coalesced`, slower still (figures: docs/megatron_core.md). On CPU
#     tensors the grad bucket is all-reduced in place instead (the shard gets the same sum; the other
#     shards, which the optimizer never reads, get it too) and the params are gathered by one
#     broadcast per shard from its owner (bit for bit, no staging). Asynchronous calls (overlap,
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
        for member, shard in enumerate(output.view(group.size(), -1)):
            dist.broadcast(shard, group=group, group_src=member)  # not queued by _coalescing_manager
        return None

    gloo_reduce_scatter._rlstack_gloo = gloo_all_gather._rlstack_gloo = True
    buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func = gloo_reduce_scatter, gloo_all_gather
