"""The experiment config's parallel checks, before any process group exists.

The layout types and process groups themselves (`ParallelDims`, `ParallelGroups`,
`init_distributed`) belong to the bridge (megatron_bridge.parallel); this module ties them to the
config tree: the model's shape (from its config.json alone) and the batch size must fit the layout.
"""

from __future__ import annotations

from megatron_bridge.parallel import ParallelDims
from rlstack.errors import UserError


def model_args_from_config(model_cfg, model_config_file=None):
    """The configured model's ModelArgs from its config.json alone (or `--model-config`'s); None when
    model.path does not exist yet and no model config is given."""
    from rlstack.planner.shapes import hf_config_for, model_args, model_config_present

    if not model_config_file and not model_config_present(model_cfg):
        return None
    hf, source = hf_config_for(model_cfg, model_config_file)
    return model_args(hf, source)


def check_layout(cfg, world_size: int, model_config_file=None) -> ParallelDims:
    """Static parallel checks of an experiment config (no process group, no model load).

    With split placement the training layout is checked against the training ranks alone
    (world - placement.rollout_ranks): the returned dims are the training ranks' own.
    """
    from rlstack.rollout.base import check_rollout

    p, k = cfg.parallel, cfg.placement.rollout_ranks
    check_placement(cfg, world_size)
    check_rollout(cfg.rollout, k or world_size, split=k > 0)  # against the ranks that host engines
    dims = ParallelDims.resolve(p.tp, p.pp, p.dp, world_size - cfg.placement.rollout_ranks, ep=p.ep)
    args = model_args_from_config(cfg.model, model_config_file)
    if args is not None:
        dims.check_model(args)
    if cfg.data.train_batch_size % dims.dp:
        raise UserError(
            f"data.train_batch_size={cfg.data.train_batch_size} does not divide over {dims.dp} "
            f"data-parallel ranks: make it a multiple of {dims.dp}"
        )
    return dims


# ---------------------------------------------------------------------- split placement


def check_placement(cfg, world_size: int) -> None:
    """placement.rollout_ranks=K and rollout.staleness against the world: one line naming the fix."""
    k, r = cfg.placement.rollout_ranks, cfg.rollout
    if r.partial and (k == 0 or r.engine != "hf"):
        raise UserError(
            f"rollout.partial=true with placement.rollout_ranks={k} rollout.engine={r.engine}: partial rollouts "
            "interrupt the batches queued on rollout-only ranks, with the hf engine only (vLLM's in-flight "
            "requests are not interrupted yet); set placement.rollout_ranks=K > 0 and rollout.engine=hf, "
            "or rollout.partial=false"
        )
    if k == 0:
        if r.staleness:
            raise UserError(
                f"rollout.staleness={r.staleness} needs rollout ranks of their own: set placement.rollout_ranks=K > 0 "
                "(colocated roles take turns on the same ranks, nothing runs ahead)"
            )
        return
    if k >= world_size:
        raise UserError(
            f"placement.rollout_ranks={k} leaves no training rank in a world of {world_size}: "
            f"choose placement.rollout_ranks from 1 to {world_size - 1}"
        )
    p, train = cfg.parallel, world_size - k
    if train % (p.tp * p.pp):
        fits = [n for n in range(1, world_size) if (world_size - n) % (p.tp * p.pp) == 0]
        raise UserError(
            f"placement.rollout_ranks={k} leaves {train} training ranks, not divisible by parallel.tp * "
            f"parallel.pp = {p.tp}*{p.pp}: choose placement.rollout_ranks from {fits} or change parallel.tp/pp"
        )
    if p.ep > 1:
        raise UserError(
            f"placement.rollout_ranks > 0 with parallel.ep={p.ep} is not supported yet: set parallel.ep=1 "
            "or placement.rollout_ranks=0 (expert parallelism runs colocated)"
        )
