"""The names each algorithm registry holds, importable without torch.

rlstack.config builds its CHOICES from these tuples, so a config validates on a machine without
torch; each registry module checks at import that it registered exactly these names (and
tests/unit/test_algorithms.py checks it too), so the two cannot drift apart.
"""

ADVANTAGE_ESTIMATORS = (
    "gae",
    "grpo",
    "drgrpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    # advantage_variants.py (verl 0.9.1's names)
    "remax",
    "opo",
    "grpo_passk",
    "gpg",
    "gdpo",
    "optimal_token_baseline",
)
# verl's names beside Schulman's: kl = k1, mse = k2, low_var_kl = k3, abs = |log ratio|. A "+" suffix
# keeps the estimate's value and takes the gradient of k2 (verl's straight-through variants).
KL_ESTIMATORS = ("k1", "k2", "k3", "kl", "mse", "low_var_kl", "abs", "k1+", "k3+", "kl+", "low_var_kl+", "abs+")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = (
    "vanilla",
    "gspo",
    # policy_variants.py (verl 0.9.1's names)
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "cispo",
    "dppo_tv",
    "dppo_kl",
    "dro",
)
# Each loss's own keyword parameters (verl's names; values in algorithm.policy_loss_params). A loss
# not listed takes none. policy_variants.py checks at import that its functions take exactly these.
POLICY_LOSS_PARAMS = {
    "sapo": ("tau_pos", "tau_neg"),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
    "dro": ("dro_beta",),
}
# Losses that aggregate their own way whatever algorithm.loss_agg_mode says (as verl does): per
# sequence, a token mean, then a mean over sequences.
SEQUENCE_MEAN_LOSSES = ("sapo", "geo_mean")
# algorithm.rollout_is: truncated importance sampling on rollout log-probs (rollout_is.py); none: off
# decoupled: AReaL's decoupled PPO behaviour weight (token level, tokens above the cap dropped)
ROLLOUT_IS_LEVELS = ("none", "token", "sequence", "decoupled")
# Estimators whose baseline is the other samples of the prompt: they need rollout.n >= 2.
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "opo", "grpo_passk", "gpg", "gdpo", "optimal_token_baseline")


def check_registered(kind: str, registered, expected) -> None:
    """Assert a registry holds exactly the names listed here (a bug if not: edit both)."""
    assert sorted(registered) == sorted(expected), (  # the order follows which module loaded first
        f"{kind} registry {tuple(registered)} != rlstack/algorithms/names.py {tuple(expected)}"
    )


def loss_params(name: str, params) -> dict:
    """The keyword arguments of policy loss `name` read from `params` (algorithm.policy_loss_params)."""
    return {key: getattr(params, key) for key in POLICY_LOSS_PARAMS.get(name, ())}
