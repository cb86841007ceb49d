"""The step's reductions over ranks, and the metric names they write (docs/observability.md).

Every function takes what it reduces and the process groups, and returns `{name: float}`. Kept
beside their own computations: the reward model's reward/rm_* (rlstack.workers.reward_model), the
weight sync's sync/* (megatron_bridge.reshard.SyncStats), the custom reward's reward_extra/*
(rlstack.step.scoring), the phases' mem/* (rlstack.observability.monitor).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rlstack import collectives

if TYPE_CHECKING:
    from megatron_bridge.parallel import ParallelGroups
    from rlstack.workers.batch import Rollout

log = logging.getLogger("rlstack")

# The engine's counters a step logs (rank 0's; docs/rollout.md).
ENGINE_METRICS = (
    "rollout/packed_weight_bytes",
    "rollout/decode_steps",
    "rollout/decode_rows_mean",
    "rollout/decode_live_share",
    "rollout/prefill_tokens",
    "rollout/kv_reused_tokens",
)
# Step metrics that must stay finite; a non-finite one stops the run (or, for gradient norms
# with trainer.on_nonfinite=skip, the update was skipped and the run goes on).
FINITE_LOSSES = ("actor/loss", "actor/pg_loss", "actor/kl", "actor/entropy", "critic/loss")
FINITE_NORMS = ("actor/grad_norm", "critic/grad_norm")


def engine_metrics(engine) -> dict:
    """This rank's engine since its last `metrics()` call: weight bytes held beyond its synced tensors
    while generating (hf: packed copies), and how full its decode steps ran (hf)."""
    counters = engine.metrics() or {}
    return {k: v for k, v in counters.items() if k in ENGINE_METRICS}


def engine_agreement(rollout: Rollout, groups: ParallelGroups) -> dict:
    """How far the rollout engine's log-probs are from the actor's: a stale or wrong sync shows here."""
    mask = rollout.resp_mask
    diff = (rollout.rollout_logprob - rollout.old_logprob).abs() * mask
    local_max = diff.max().item() if mask.any() else 0.0
    g = groups
    total, count = collectives.sum_floats([float(diff.sum()), float(mask.sum())], g.dp, g.device)
    diff_max = collectives.max_floats([local_max], g.world, g.device)[0]
    return {"actor/rollout_diff": total / max(count, 1.0), "actor/rollout_diff_max": diff_max}


def is_metrics(stats: list[dict], groups: ParallelGroups, rollout_is: str) -> dict:
    """is/weight_mean, is/weight_max, is/clipped_frac of algorithm.rollout_is over the step's updates."""
    from rlstack.algorithms import is_metrics as from_sums

    if rollout_is == "none":
        return {}
    g, keys = groups, ("is/weight_sum", "is/clipped_sum", "is/units")
    local = [sum(float(s[k]) for s in stats if k in s) for k in keys]
    local.append(1.0 if any("is/units" in s for s in stats) else 0.0)  # holds stats (last stage)
    total = collectives.sum_floats(local, g.world, g.device)
    if total[-1] == 0:
        return {}
    per_dp = [v / (total[-1] / g.dims.dp) for v in total[:3]]  # TP ranks of the last stage hold copies
    local_max = max((float(s["is/weight_max"]) for s in stats if "is/weight_max" in s), default=0.0)
    return from_sums(*per_dp, collectives.max_floats([local_max], g.world, g.device)[0])


def train_throughput(rollout: Rollout, epochs: int, actor_s: float, critic_s: float, groups: ParallelGroups) -> dict:
    """Tokens (prompt + response, all DP ranks) trained per second, per role (critic_s 0: no critic)."""
    g = groups
    tokens = collectives.sum_floats([float(rollout.num_tokens) * epochs], g.dp, g.device)[0]
    out = {"timing/actor_update_s": actor_s}
    if actor_s > 0:
        out["throughput/actor_tok_s"] = tokens / actor_s
    if critic_s > 0:
        out["throughput/critic_tok_s"] = tokens / critic_s
        out["timing/critic_update_s"] = critic_s
    return out


def grad_norms(actor_norms: list[float], critic_norms: list[float]) -> dict:
    """actor/grad_norm, critic/grad_norm: the mean over the step's optimizer steps (none: left out)."""
    out = {}
    for key, norms in (("actor/grad_norm", actor_norms), ("critic/grad_norm", critic_norms)):
        if norms:
            out[key] = sum(norms) / len(norms)
    return out


def loss_counts(mini: Rollout, groups: ParallelGroups, scale_factor: float) -> dict:
    """The mini-batch's token and sequence counts over all DP ranks (the losses' global normalisers).

    `scale_factor`: the constant length of seq-mean-token-sum-norm (Dr.GRPO); other modes ignore it."""
    g, mask = groups, mini.resp_mask
    tokens, seqs = collectives.sum_floats([float(mask.sum()), float((mask.sum(-1) > 0).sum())], g.dp, g.device)
    return {"global_num_tokens": tokens, "global_num_seqs": seqs, "loss_scale_factor": scale_factor}


def rollout_metrics(scores: list[float], gens: list, gen_tokens: float, rollout_s: float, groups) -> dict:
    """reward/mean, reward/std, response/length_mean over the DP ranks; the rollout's tokens per second."""
    g = groups
    local = [sum(scores), len(scores), sum(len(x.response_ids) for x in gens)]
    total, count, length = collectives.sum_floats(local, g.dp, g.device)
    sq = collectives.sum_floats([sum((s - total / count) ** 2 for s in scores)], g.dp, g.device)[0]
    return {
        "reward/mean": total / count,
        "reward/std": (sq / count) ** 0.5,
        "response/length_mean": length / count,
        "throughput/rollout_tok_s": gen_tokens / max(rollout_s, 1e-9),
    }


def check_finite(metrics: dict, step: int, skip: bool, modules: list, groups: ParallelGroups) -> None:
    """Stop a diverged run before anything of 1-based `step` is saved; with `skip`
    (trainer.on_nonfinite=skip) a non-finite loss or norm marks the skipped update instead."""
    from rlstack.workers.finite import DivergenceError, count_nonfinite, first_nonfinite

    bad_weights = collectives.sum_floats([float(count_nonfinite(modules))], groups.world, groups.device)[0]
    if bad_weights:
        raise DivergenceError(
            f"training diverged at step {step}: {int(bad_weights)} weight tensor(s) hold NaN/inf "
            f"after the optimizer step (nothing is saved from this step): lower "
            f"algorithm.actor_lr/critic_lr or algorithm.clip_grad"
        )
    key = first_nonfinite(metrics, FINITE_NORMS) or first_nonfinite(metrics, FINITE_LOSSES)
    if key and skip:
        log.warning(
            "step %d: %s is %s: the update was skipped, weights unchanged (trainer.on_nonfinite=skip)",
            step,
            key,
            metrics[key],
        )
        metrics["trainer/skipped_update"] = 1.0
        return
    if key:
        raise DivergenceError(
            f"training diverged at step {step}: {key} is {metrics[key]} (the optimizer step "
            f"was skipped; nothing is saved from this step): lower algorithm.actor_lr/critic_lr "
            f"or algorithm.clip_grad, or set trainer.on_nonfinite=skip to skip such updates"
        )


# ----------------------------------------------------------------------------- the update's loss statistics

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
