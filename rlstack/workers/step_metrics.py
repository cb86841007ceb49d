"""Turn per-micro-batch loss stats (last pipeline stage only) into step metrics on every rank."""

from __future__ import annotations

from megatron_bridge.parallel import ParallelGroups
from rlstack import collectives

# `<prefix>/<name>_sum` are token sums, divided by `<prefix>/tokens`; plain losses are already
# normalised by the global counts, so their sum over micro-batches and DP ranks is the mini-batch loss.
_TOKEN_SUMS = ("entropy", "clipfrac", "kl", "approx_kl", "rollout_diff")
_LOSSES = ("loss", "pg_loss", "moe_aux_loss", "moe_load_balancing_loss")  # moe_*: MoE actors only


def reduce_stats(stats: list[dict], groups: ParallelGroups, num_updates: int, prefix: str) -> dict:
    keys = [f"{prefix}/{k}" for k in _LOSSES] + [f"{prefix}/{k}_sum" for k in _TOKEN_SUMS] + [f"{prefix}/tokens"]
    local = [sum(float(s[key]) for s in stats if key in s) for key in keys]
    local.append(1.0 if stats else 0.0)  # does this rank hold stats (last stage)?
    total = collectives.sum_floats(local, groups.world, groups.device)
    holders = total[-1]
    if holders == 0:
        return {}
    # every TP rank of the last stage holds the same stats: sum over DP only
    per_dp = [v / (holders / groups.dims.dp) for v in total]
    out = {}
    for j, key in enumerate(keys[: len(_LOSSES)]):
        if key.startswith(f"{prefix}/moe_") and per_dp[j] == 0.0:
            continue  # a dense model has no router loss (a MoE's is always > 0)
        out[key] = per_dp[j] / max(num_updates, 1)
    tokens = per_dp[len(keys) - 1]
    for j, name in enumerate(_TOKEN_SUMS):
        value = per_dp[len(_LOSSES) + j]
        if tokens > 0 and value != 0.0:
            out[f"{prefix}/{name}"] = value / tokens
    out.update(_max_stats(stats, groups, prefix))
    return {k: v for k, v in out.items() if not (k.endswith("pg_loss") and prefix == "critic")}


def _max_stats(stats: list[dict], groups: ParallelGroups, prefix: str) -> dict:
    """`<prefix>/<name>_max` stats: the maximum over micro-batches and ranks."""
    key = f"{prefix}/rollout_diff_max"
    local = max((float(s[key]) for s in stats if key in s), default=-1.0)
    value = collectives.max_floats([local], groups.world, groups.device)[0]
    return {key: value} if value >= 0 else {}
