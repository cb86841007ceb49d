"""Pure tensor functions for PPO/GRPO: advantages, KL, losses, KL controllers.

No torch.distributed and no megatron here: cross-rank quantities come in as arguments (global
counts, a `reduce_fn`), so every function is testable on one process. Variants are registered by
name (`ADVANTAGE_ESTIMATORS`, `KL_ESTIMATORS`, `LOSS_AGG_MODES`) to match the config's choices.
"""

from rlstack.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    gae,
    group_stats,
    grpo,
    place_at_last_token,
    register_advantage,
    rloo,
)
from rlstack.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_estimate,
    register_kl,
)
from rlstack.algorithms.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    entropy_from_logits,
    kl_loss,
    policy_loss,
    register_agg,
    value_loss,
)
from rlstack.algorithms.masked import (
    mask_counts,
    masked_mean,
    masked_sum,
    masked_whiten,
    whiten_stats,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGG_MODES",
    "AdaptiveKLController", "FixedKLController", "KLController",
    "agg_loss", "apply_kl_penalty", "build_kl_controller", "compute_advantages",
    "entropy_from_logits", "gae", "group_stats", "grpo", "kl_estimate", "kl_loss", "mask_counts",
    "masked_mean", "masked_sum", "masked_whiten", "place_at_last_token", "policy_loss",
    "register_advantage", "register_agg", "register_kl", "rloo", "value_loss", "whiten_stats",
]
