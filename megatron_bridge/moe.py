"""The MoE router's load-balancing loss as step metrics (megatron-core 0.16.1's aux-loss tracker).

Each router in training mode adds `coeff x aux_loss` to the objective (through
`MoEAuxLossAutoScaler`, so the gradient carries it without the caller's loss) and records the
unweighted `aux_loss` per layer, summed over micro-batches, in the process-global tracker
(transformer/moe/router.py `attach_and_log_load_balancing_loss` -> moe_utils.save_to_aux_losses_tracker
under "load_balancing_loss"). `reduce_aux_losses_tracker_across_ranks` sums it over pipeline stages
(each holds its own layers) and the router's TP group and averages it over data parallelism, so every
rank ends with the same per-layer values.
"""

from __future__ import annotations

from dataclasses import dataclass

TRACKER_NAME = "load_balancing_loss"


@dataclass(frozen=True)
class AuxLoss:
    load_balancing: float  # unweighted switch loss, mean over layers and micro-batches (1.0: balanced top-k)
    weighted: float  # what the objective gains: coeff x sum over layers, per micro-batch


def clear_aux_losses() -> None:
    """Forget what earlier forwards (another role's training, a previous step) recorded."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def collect_aux_losses(num_micro_batches: int, coeff: float) -> AuxLoss:
    """Collective over the world (megatron's groups): the step's aux loss, the same on every rank.

    Every rank must call it after the same training step; the tracker is cleared afterwards.
    """
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import (
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    # A rank whose stage trained no MoE layer has no entry; all ranks must join the reductions.
    flag = torch.tensor([float(TRACKER_NAME in tracker)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() == 0:
        clear_aux_losses()
        return AuxLoss(0.0, 0.0)
    reduce_aux_losses_tracker_across_ranks([TRACKER_NAME])
    values = tracker[TRACKER_NAME]["values"].float() / max(num_micro_batches, 1)  # [layers]
    clear_aux_losses()
    return AuxLoss(load_balancing=float(values.mean()), weighted=float(coeff * values.sum()))
