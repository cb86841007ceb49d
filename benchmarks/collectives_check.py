"""Every rlstack.collectives helper on every group of the real process-group setup, checked.

    torchrun --nproc_per_node=N benchmarks/collectives_check.py [--tp T --pp P]

Under NCCL (a GPU) the default group is `cpu:gloo,cuda:nccl` (megatron_bridge.parallel): this checks the
helpers move CUDA tensors, that a CPU tensor still reduces over the gloo half, and that an object
broadcast and gather work. On CPU the same script runs on gloo. Prints one `collectives: ok` line
(or raises, naming the helper and group).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check(groups) -> list[str]:
    import torch

    from rlstack import collectives

    g = groups
    done = []
    for name, group, size in (
        ("world", g.world, g.dims.world_size),
        ("dp", g.dp, g.dims.dp),
        ("tp", g.tp, g.dims.tp),
        ("pp", g.pp, g.dims.pp),
    ):
        total = collectives.sum_floats([1.0, float(g.rank)], group, g.device)
        assert total[0] == size, (name, total)
        top = collectives.max_floats([float(g.rank)], group, g.device)[0]
        assert top == float(collectives.src_of_last(group)), (name, top)
        cpu = torch.ones(3)  # a CPU tensor: the gloo half of the default group carries it under NCCL
        assert collectives.all_reduce_(cpu, group, g.device).tolist() == [size] * 3, name
        on_device = torch.full((2,), 2.0, device=g.device)
        assert collectives.sum_over(group, g.device)(on_device).tolist() == [2.0 * size] * 2, name
        src = collectives.src_of_last(group)
        t = torch.full((2,), float(g.rank), device=g.device)
        assert collectives.broadcast_(t, src, group, g.device).tolist() == [float(src)] * 2, name
        assert collectives.broadcast_object({"from": g.rank}, src, group, g.device) == {"from": src}, name
        assert len(collectives.all_gather_objects(g.rank, group, size)) == size, name
        collectives.barrier(group, g.device)
        done.append(f"{name}({size})")
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    args = p.parse_args(argv)
    import torch.distributed as dist

    from megatron_bridge import patches
    from megatron_bridge.parallel import destroy_distributed, init_distributed, process_group_backend

    patches.apply()
    groups = init_distributed(args.tp, args.pp)
    try:
        done = check(groups)
        if groups.rank == 0:
            backend = dist.get_backend_config() if hasattr(dist, "get_backend_config") else dist.get_backend()
            print(
                f"collectives: ok on {', '.join(done)} | device {groups.device} | default group backend "
                f"{backend} (asked {process_group_backend('nccl' if groups.device.type == 'cuda' else 'gloo')})",
                flush=True,
            )
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
