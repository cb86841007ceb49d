"""Build the configured rollout engine (`build_engine`); the engine interface itself lives in
`rlstack.rollout.interface` (re-exported here), so the engines import the interface without this
module, which imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlstack.errors import UserError
from rlstack.rollout.interface import Generation, RolloutEngine, SamplingParams, check_row_caps

if TYPE_CHECKING:  # keep `import rlstack.rollout.base` free of torch
    from megatron_bridge.parallel import ParallelGroups
    from rlstack.config import RolloutConfig

__all__ = ["ENGINES", "Generation", "RolloutEngine", "SamplingParams", "build_engine", "check_row_caps", "rollout_seed"]

ENGINES = ("hf", "vllm")


def build_engine(
    rollout_cfg: RolloutConfig, hf_dir: str, groups: ParallelGroups, eos_token_id: int, pad_token_id: int
) -> RolloutEngine:
    """The configured engine on this rank. vLLM construction is collective: every rank calls this.

    `eos_token_id` ends a response (and is kept in it); a negative value means no token does (benchmarks).
    """
    from rlstack.rollout.sync_check import check_settings

    check_settings(rollout_cfg)
    if rollout_cfg.engine not in ENGINES:
        raise UserError(f"rollout.engine={rollout_cfg.engine!r} is unknown: use one of {', '.join(ENGINES)}")
    if groups.dims.world_size % rollout_cfg.tp:
        raise UserError(
            f"rollout.tp={rollout_cfg.tp} must divide the world size {groups.dims.world_size}: "
            f"choose rollout.tp from the divisors of the number of processes"
        )
    if rollout_cfg.engine == "hf":
        from rlstack.rollout.zero_copy import AliasingHFEngine

        if rollout_cfg.tp != 1:
            raise UserError(
                f"rollout.engine=hf runs one full model per rank: set rollout.tp=1 "
                f"(got {rollout_cfg.tp}) or use rollout.engine=vllm"
            )
        return AliasingHFEngine(
            hf_dir, rollout_cfg, groups.device, eos_token_id, pad_token_id, seed=rollout_seed(rollout_cfg, groups)
        )
    from rlstack.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(hf_dir, rollout_cfg, groups, eos_token_id, pad_token_id, seed=rollout_seed(rollout_cfg, groups))


def rollout_seed(rollout_cfg: RolloutConfig, groups: ParallelGroups) -> int:
    """seed + rollout replica index (global rank // rollout TP).

    The trainer splits rollout work over all ranks by replica, so seeding by replica (not by the
    training DP rank) makes the samples independent of the training TP/PP/DP layout; the ranks of
    one vLLM TP group form one replica and sample alike.
    """
    return rollout_cfg.seed + groups.rank // rollout_cfg.tp
