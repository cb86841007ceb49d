"""DAPO's overlong reward shaping (Yu et al. 2025, arXiv:2503.14476, "soft overlong punishment").

A response of L tokens (eos included, as verl counts `valid_response_length`) with L_max =
rollout.max_new_tokens and a buffer of `len` tokens gets
    penalty = min(-(L - (L_max - len)) / len * penalty_factor, 0)
added to its score: 0 up to L_max - len, then linear down to -penalty_factor at L_max. As verl's
DAPO reward manager (verl 0.9.1 `workers/reward_manager/dapo.py`), the line is not capped past
L_max (the engines stop at L_max, so no response gets there). Pure Python.

Where it runs: `rlstack.step.scoring.Scoring.score` shapes the training scores (over_dp; validation
keeps the task scores) with `shape_scores` and keeps each response's penalty in `Scores.penalties`;
`Scoring.metrics` logs `overlong_metrics` of their sums over the DP ranks. `OverlongShaping` is the
same as a stateful object (sums over the calls of a step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def overlong_penalty(length: int, max_length: int, buffer_len: int, penalty_factor: float) -> float:
    """The (<= 0) penalty of a response of `length` tokens; see the module doc."""
    if buffer_len < 1 or buffer_len > max_length:
        raise ValueError(
            f"overlong buffer len {buffer_len} must lie in [1, {max_length}] (rollout.max_new_tokens): "
            "set reward.overlong_buffer.len"
        )
    exceed = length - (max_length - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


def shape_scores(scores: Sequence[float], lengths: Sequence[int], cfg, max_length: int) -> tuple[list, list]:
    """(scores + penalties, penalties) per response; `cfg` is config.OverlongBufferConfig.

    Off (cfg.enable false): the scores unchanged and zero penalties.
    """
    if len(scores) != len(lengths):
        raise ValueError(f"{len(scores)} scores for {len(lengths)} response lengths: pass one length per response")
    if not cfg.enable:
        return list(scores), [0.0] * len(scores)
    penalties = [overlong_penalty(n, max_length, cfg.len, cfg.penalty_factor) for n in lengths]
    return [s + p for s, p in zip(scores, penalties)], penalties


def overlong_sums(penalties: Sequence[float]) -> list[float]:
    """[sum of penalties, responses penalised, responses]: sums over data-parallel ranks combine."""
    return [float(sum(penalties)), float(sum(p < 0 for p in penalties)), float(len(penalties))]


def overlong_metrics(sums: Sequence[float]) -> dict:
    """reward/overlong_penalty (mean penalty, <= 0; reward/mean includes it) and reward/overlong_frac."""
    total, penalised, count = sums
    count = max(count, 1.0)
    return {"reward/overlong_penalty": total / count, "reward/overlong_frac": penalised / count}


class OverlongShaping:
    """Shapes each training batch's scores and keeps the step's penalty sums until `metrics`."""

    def __init__(self, cfg, max_length: int):
        self.cfg, self.max_length = cfg, max_length
        self._sums = [0.0, 0.0, 0.0]

    def __call__(self, scores: Sequence[float], lengths: Sequence[int]) -> list:
        shaped, penalties = shape_scores(scores, lengths, self.cfg, self.max_length)
        self._sums = [a + b for a, b in zip(self._sums, overlong_sums(penalties))]
        return shaped

    def metrics(self, reduce: Callable[[list], list]) -> dict:
        """The step's metrics ({} when off); `reduce` sums the 3 floats over data-parallel ranks."""
        sums, self._sums = self._sums, [0.0, 0.0, 0.0]
        return overlong_metrics(reduce(sums)) if self.cfg.enable else {}
