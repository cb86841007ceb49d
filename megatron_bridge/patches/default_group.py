"""The default process group on a training rank of a split placement (kind "default group").

Both are scoped, not applied at start-up: `WorldSeenAs` only for the duration of megatron's
`initialize_model_parallel`, and `set_default_group` from `init_split_distributed` until
`destroy_distributed` restores the world's group. Registered in `megatron_bridge.patches.registry`.
"""

from __future__ import annotations


class WorldSeenAs:
    """Within the block, `torch.distributed.get_world_size()` (no group) answers `size`."""

    def __init__(self, size: int):
        self.size = size

    def __enter__(self):
        import torch.distributed as dist

        self.original = dist.get_world_size
        dist.get_world_size = lambda group=None: self.size if group is None else self.original(group)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.get_world_size = self.original
        return False


# megatron-core calls collectives on the default group in places that take no group argument
# (dist_checkpointing's metadata exchange and barriers, e.g. `torch.distributed.all_gather_object`
# in dist_checkpointing/validation.py and strategies/torch.py with process_group=None). On a
# training rank of a split placement the default group is therefore the training ranks' group:
# their global ranks equal their ranks in it, so megatron sees exactly a world of N - K. Traffic
# to the rollout ranks names `SplitPlacement.full` explicitly. No group is created after the swap.
_ORIGINAL_DEFAULT = None


def set_default_group(group) -> None:
    from torch.distributed import distributed_c10d as c10d

    global _ORIGINAL_DEFAULT
    if _ORIGINAL_DEFAULT is None:
        _ORIGINAL_DEFAULT = c10d._world.default_pg
    c10d._world.default_pg = group


def restore_default_group() -> None:
    from torch.distributed import distributed_c10d as c10d

    global _ORIGINAL_DEFAULT
    if _ORIGINAL_DEFAULT is not None:
        c10d._world.default_pg = _ORIGINAL_DEFAULT
        _ORIGINAL_DEFAULT = None
