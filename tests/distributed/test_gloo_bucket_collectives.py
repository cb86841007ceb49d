"""megatron_bridge.patches.gloo_collectives (l): megatron's bucket reduce-scatter and all-gather on CPU, in place.

megatron's distributed optimizer reduce-scatters each grad bucket into this rank's shard and
all-gathers the param bucket from every rank's shard, both inside `_coalescing_manager`. On CPU the
patched functions must give the same shard sums and the same gathered bits as torch's collectives,
without the full-bucket copy gloo stages for them: through shared memory where the whole group is
on this host, through gloo in place where some member cannot map the others' staging.
"""

import os
import resource

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patch applies only without CUDA")

WORLD = 3
SHARD = 4_000_000  # fp32 elements a rank: a 48 MB bucket


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _bucket_collectives(shm_on_every_rank: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed import _coalescing_manager

    from megatron_bridge import patches
    from megatron_bridge.patches import gloo_collectives

    dist.init_process_group("gloo")
    patches.apply()
    from megatron.core.distributed import param_and_grad_buffer as buffers

    # 256 KiB pieces: the 4M-element shard moves in 62 chunks, the last one partial
    gloo_collectives.STAGE_BYTES = 1 << 20
    if not shm_on_every_rank and dist.get_rank() == 1:
        gloo_collectives.SHM_DIR = "/nonexistent"  # as a member on another host: nobody may use the staging
    group = dist.new_group(list(range(WORLD)))  # a ProcessGroup, as megatron passes
    rank, size = group.rank(), group.size()
    reduce_scatter, all_gather = buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func
    out = {
        "patched": bool(getattr(reduce_scatter, "_rlstack_gloo", False) and getattr(all_gather, "_rlstack_gloo", False))
    }

    # Grads: integer-valued floats, so any summation order gives the exact sum.
    gen = torch.Generator().manual_seed(rank)
    grads = torch.randint(-1000, 1000, (size * SHARD,), generator=gen).float()  # [size * SHARD]
    expected = sum(
        torch.randint(-1000, 1000, (size * SHARD,), generator=torch.Generator().manual_seed(r)).float()
        for r in range(size)
    )
    torch_way = grads.clone()
    before = _peak_mb()
    with _coalescing_manager(group, async_ops=False):  # as start_grad_sync calls it
        reduce_scatter(grads.view(size, -1)[rank], grads, op=dist.ReduceOp.SUM, group=group, async_op=False)
    out["grad_peak_growth_mb"] = _peak_mb() - before
    out["grad_shard_exact"] = torch.equal(grads.view(size, -1)[rank], expected.view(size, -1)[rank])
    torch_shard = torch.empty(SHARD)
    reduce_scatter.__wrapped__(torch_shard, torch_way, op=dist.ReduceOp.SUM, group=group)
    out["grad_as_torch"] = torch.equal(grads.view(size, -1)[rank], torch_shard)

    # Params: this rank's shard holds its values (with a -0.0 and a NaN), the others garbage.
    params = torch.full((size * SHARD,), float("inf"))
    mine = torch.randn(SHARD, generator=gen)
    mine[0], mine[1] = -0.0, float("nan")
    params.view(size, -1)[rank] = mine
    before = _peak_mb()
    with _coalescing_manager(group, async_ops=False):  # as start_param_sync calls it
        all_gather(params, params.view(size, -1)[rank], group=group, async_op=False)
    out["param_peak_growth_mb"] = _peak_mb() - before
    reference = torch.empty(size * SHARD)
    all_gather.__wrapped__(reference, mine, group=group)
    out["params_bitwise"] = torch.equal(params.view(torch.int32), reference.view(torch.int32))

    # Not this rank's own view of the bucket: torch's function, same result.
    separate = torch.empty(SHARD)
    grads2 = torch.ones(size * SHARD)
    reduce_scatter(separate, grads2, op=dist.ReduceOp.SUM, group=group)
    out["fallback_sum"] = bool((separate == size).all())
    out["host_staging"] = gloo_collectives.host_staging(group) is not None
    # a second round through the same staging (the slots alternate across calls)
    grads3 = torch.full((size * SHARD,), float(rank + 1))
    with _coalescing_manager(group, async_ops=False):
        reduce_scatter(grads3.view(size, -1)[rank], grads3, op=dist.ReduceOp.SUM, group=group, async_op=False)
    out["second_sum"] = bool((grads3.view(size, -1)[rank] == size * (size + 1) / 2).all())
    dist.barrier()
    out["left_in_shm"] = [n for n in os.listdir("/dev/shm") if n.startswith("rlstack-buckets-")]
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("shm_on_every_rank", [True, False], ids=["shared-memory", "gloo"])
def test_bucket_collectives_in_place_equal_torchs(shm_on_every_rank):
    for rank, r in enumerate(run_distributed(_bucket_collectives, WORLD, shm_on_every_rank)):
        assert r["patched"], rank
        assert r["host_staging"] == shm_on_every_rank, (rank, r)  # all members agree on the path
        assert r["second_sum"] and r["left_in_shm"] == [], (rank, r)
        assert r["grad_shard_exact"] and r["grad_as_torch"], (rank, r)
        assert r["params_bitwise"], (rank, r)
        assert r["fallback_sum"], (rank, r)
        bucket_mb = WORLD * SHARD * 4 / 2**20
        # No staging copy of the bucket (gloo's own collectives grow the peak by the whole bucket).
        assert r["grad_peak_growth_mb"] < 0.25 * bucket_mb, (rank, r)
        assert r["param_peak_growth_mb"] < 0.25 * bucket_mb, (rank, r)
