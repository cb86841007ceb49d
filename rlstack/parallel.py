"""The experiment config's parallel checks, before any process group exists.

The layout types and process groups themselves (`ParallelDims`, `ParallelGroups`,
`init_distributed`) belong to the bridge (megatron_bridge.parallel); this module ties them to the
config tree: the model's shape (from its config.json alone) and the batch size must fit the layout.
"""

from __future__ import annotations

from megatron_bridge.parallel import ParallelDims
from rlstack.errors import UserError


def model_args_from_config(model_cfg):
    """The configured model's ModelArgs from its config.json alone; None when model.path does not exist yet."""
    from rlstack.planner.shapes import hf_config_for, model_args, model_config_present

    if not model_config_present(model_cfg):
        return None
    hf, source = hf_config_for(model_cfg)
    return model_args(hf, source)


def check_layout(cfg, world_size: int) -> ParallelDims:
    """Static parallel checks of an experiment config (no process group, no model load)."""
    p = cfg.parallel
    dims = ParallelDims.resolve(p.tp, p.pp, p.dp, world_size, ep=p.ep)
    args = model_args_from_config(cfg.model)
    if args is not None:
        dims.check_model(args)
    if cfg.data.train_batch_size % dims.dp:
        raise UserError(
            f"data.train_batch_size={cfg.data.train_batch_size} does not divide over {dims.dp} "
            f"data-parallel ranks: make it a multiple of {dims.dp}"
        )
    return dims
