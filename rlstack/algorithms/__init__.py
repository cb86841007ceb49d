"""Pure tensor functions for PPO/GRPO: advantages, KL, losses, KL controllers.

No torch.distributed and no megatron here: cross-rank quantities come in as arguments (global
counts, a `reduce_fn`), so every function is testable on one process. Variants are registered by
name (`ADVANTAGE_ESTIMATORS`, `KL_ESTIMATORS`, `LOSS_AGG_MODES`, `POLICY_LOSSES`); their names are
listed torch-free in `rlstack.algorithms.names`, which the config's choices come from.

Importing this package imports no torch: each name below loads its module on first use.
"""

import importlib

_EXPORTS = {
    "advantages": (
        "ADVANTAGE_ESTIMATORS",
        "compute_advantages",
        "gae",
        "group_stats",
        "grpo",
        "place_at_last_token",
        "register_advantage",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "rloo",
    ),
    "kl": (
        "KL_ESTIMATORS",
        "AdaptiveKLController",
        "FixedKLController",
        "KLController",
        "apply_kl_penalty",
        "build_kl_controller",
        "kl_estimate",
        "register_kl",
    ),
    "losses": (
        "LOSS_AGG_MODES",
        "POLICY_LOSSES",
        "agg_loss",
        "compute_policy_loss",
        "entropy_from_logits",
        "gspo_policy_loss",
        "kl_loss",
        "policy_loss",
        "register_agg",
        "register_policy_loss",
        "value_loss",
    ),
    "advantage_variants": ("gdpo", "gpg", "grpo_passk", "opo", "optimal_token_baseline", "remax", "reward_to_go"),
    "policy_variants": (
        "cispo_policy_loss",
        "clip_cov_policy_loss",
        "dppo_kl_policy_loss",
        "dppo_tv_policy_loss",
        "dro_policy_loss",
        "geo_mean_policy_loss",
        "gpg_policy_loss",
        "kl_cov_policy_loss",
        "sapo_policy_loss",
    ),
    "rollout_is": ("IS_LEVELS", "is_metrics", "rollout_is_weights"),
    "masked": ("mask_counts", "masked_mean", "masked_sum", "masked_whiten", "whiten_stats"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'rlstack.algorithms' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rlstack.algorithms.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value
