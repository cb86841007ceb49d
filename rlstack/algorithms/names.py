"""The names each algorithm registry holds, importable without torch.

rlstack.config builds its CHOICES from these tuples, so a config validates on a machine without
torch; each registry module checks at import that it registered exactly these names (and
tests/unit/test_algorithms.py checks it too), so the two cannot drift apart.
"""

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
# verl's names beside Schulman's: kl = k1, mse = k2, low_var_kl = k3, abs = |log ratio|. A "+" suffix
# keeps the estimate's value and takes the gradient of k2 (verl's straight-through variants).
KL_ESTIMATORS = ("k1", "k2", "k3", "kl", "mse", "low_var_kl", "abs", "k1+", "k3+", "kl+", "low_var_kl+", "abs+")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("vanilla", "gspo")
# algorithm.rollout_is: truncated importance sampling on rollout log-probs (rollout_is.py); none: off
ROLLOUT_IS_LEVELS = ("none", "token", "sequence")
# Estimators whose baseline is the other samples of the prompt: they need rollout.n >= 2.
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo")


def check_registered(kind: str, registered, expected) -> None:
    """Assert a registry holds exactly the names listed here (a bug if not: edit both)."""
    assert tuple(registered) == tuple(expected), (
        f"{kind} registry {tuple(registered)} != rlstack/algorithms/names.py {tuple(expected)}"
    )
