"""Rewards: rule scorers registered by name, and custom functions with verl's signature.

Pure Python (no torch). The trainer builds one `RewardScorer.from_config(cfg.data)` and calls
`score_batch(samples)` (-> `ScoreResult`s: score + the custom function's extra keys) or
`score(...)` (-> float) per response.

Which function scores a sample: the custom function when `data.reward_fn_file` is set (for every
data_source, as verl's custom_reward_function); else the built-in named by `data.reward_scorer`
when set (for every data_source); else the built-in registered under the sample's data_source.
`openai/gsm8k` and verl's MATH sources are scored exactly as verl 0.9.1 scores them
(rlstack.rewards.gsm8k, rlstack.rewards.math).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from rlstack.errors import UserError
from rlstack.rewards import math, rules
from rlstack.rewards.custom import (
    BATCHED_SIGNATURE,
    SIGNATURE,
    RewardTimeout,
    ScoreResult,
    as_result,
    call_with_timeout,
    extras_metrics,
    extras_sums,
    load_custom_reward,
    merge_extras_sums,
    where,
)

log = logging.getLogger("rlstack.rewards")

# name (a data_source, or a value of data.reward_scorer) -> fn(solution_str, ground_truth, extra_info=None)
SCORERS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": rules.gsm8k_verl_strict,  # verl's data_source for GSM8K; verl's exact score
    "gsm8k": rules.gsm8k_verl_strict,
    "gsm8k_flexible": rules.gsm8k_verl_flexible,  # verl's flexible mode, exactly
    "gsm8k_lenient": rules.gsm8k_lenient_strict,  # rlstack's numeric reading: NOT verl's numbers
    "gsm8k_lenient_flexible": rules.gsm8k_lenient_flexible,
    # verl's math_reward for its MATH sources, exactly
    # (verl scores data_source "math" with math_dapo, which is not ported: no alias here)
    **{source: rules.math_verl for source in math.SOURCES},
    "arith": rules.arith,  # flexible by default, see rules.arith
    "copy": rules.copy,
}


@dataclass
class Sample:
    """What a reward function sees of one response; `row` is the prompt's row in its data file."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Optional[dict] = None
    row: Optional[int] = None


class RewardScorer:
    """Scores responses with a custom function (verl's signature) or a built-in scorer."""

    def __init__(
        self,
        custom_file: str = "",
        custom_name: str = "compute_score",
        reward_kwargs: Optional[dict] = None,
        timeout_s: float = 0.0,
        batched: bool = False,
        builtin: str = "",
    ):
        self.custom_file, self.custom_name = custom_file, custom_name
        self.reward_kwargs = dict(reward_kwargs or {})
        self.timeout_s = float(timeout_s)
        self.batched = bool(batched)
        self.custom_fn: Optional[Callable] = None
        if custom_file:
            self.custom_fn = load_custom_reward(custom_file, custom_name, batched=self.batched)
        elif self.batched:
            raise UserError(
                "data.reward_fn_batched=true needs data.reward_fn_file: set the file of "
                f"a {BATCHED_SIGNATURE} function, or set data.reward_fn_batched=false"
            )
        if builtin and builtin not in SCORERS:
            raise UserError(
                f"data.reward_scorer={builtin!r} is not a built-in scorer: choose one of {', '.join(sorted(SCORERS))}"
            )
        self.builtin = builtin

    @classmethod
    def from_config(cls, data) -> RewardScorer:
        """From rlstack.config.DataConfig (reward_fn_file, _name, _batched, reward_kwargs, ...)."""
        return cls(
            data.reward_fn_file,
            data.reward_fn_name,
            reward_kwargs=data.reward_kwargs,
            timeout_s=data.reward_timeout_s,
            batched=data.reward_fn_batched,
            builtin=data.reward_scorer,
        )

    # ------------------------------------------------------------------ scoring

    def score(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: Optional[dict] = None,
        row: Optional[int] = None,
    ) -> float:
        """The score of one response (a float)."""
        return self.score_batch([Sample(data_source, solution_str, ground_truth, extra_info, row)])[0].score

    def score_batch(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        """One ScoreResult per sample, in order (one call when the custom function is batched)."""
        if self.custom_fn is None:
            return [self._builtin(s) for s in samples]
        if self.batched:
            return self._custom_batched(list(samples))
        return [self._custom_one(s) for s in samples]

    def _builtin(self, s: Sample) -> ScoreResult:
        name = self.builtin or s.data_source
        fn = self._rule(name)
        return as_result(
            fn(s.solution_str, s.ground_truth, copy.deepcopy(s.extra_info)),
            f"{fn.__name__} (built-in)",
            where(s.data_source, s.row),
        )

    def _custom_one(self, s: Sample) -> ScoreResult:
        kwargs = dict(
            data_source=s.data_source,
            solution_str=s.solution_str,
            ground_truth=s.ground_truth,
            extra_info=copy.deepcopy(s.extra_info),  # its own copy: a function that edits it changes nothing else
            **self.reward_kwargs,
        )
        value = self._call(kwargs, self.timeout_s, where(s.data_source, s.row))
        if value is _TIMED_OUT:
            return ScoreResult(0.0, timed_out=True)
        return as_result(value, self._fn_name, where(s.data_source, s.row))

    def _custom_batched(self, samples: list[Sample]) -> list[ScoreResult]:
        if not samples:
            return []
        kwargs = dict(
            data_sources=[s.data_source for s in samples],
            solution_strs=[s.solution_str for s in samples],
            ground_truths=[s.ground_truth for s in samples],
            extra_infos=[copy.deepcopy(s.extra_info) for s in samples],
            **self.reward_kwargs,
        )
        rows = ", ".join(str(s.row) for s in samples[:4]) + (", ..." if len(samples) > 4 else "")
        batch_where = f"a batch of {len(samples)} samples (data_source {samples[0].data_source!r}, rows {rows})"
        # A batched call covers many samples: its limit is the per-sample limit times their number.
        value = self._call(kwargs, self.timeout_s * len(samples), batch_where)
        if value is _TIMED_OUT:
            return [ScoreResult(0.0, timed_out=True) for _ in samples]
        try:
            values = list(value)
        except TypeError:
            values = None
        if values is None or len(values) != len(samples):
            got = f"{len(values)} results" if values is not None else repr(value)[:80]
            raise UserError(
                f"batched reward function {self._fn_name} returned {got} for {batch_where}: "
                f"return a list of {len(samples)} numbers or dicts with a 'score' key"
            )
        return [as_result(v, self._fn_name, where(s.data_source, s.row)) for v, s in zip(values, samples)]

    def _call(self, kwargs: dict, timeout_s: float, where_text: str) -> Any:
        try:
            return call_with_timeout(self.custom_fn, timeout_s, kwargs)
        except RewardTimeout:
            log.warning(
                "reward function %s ran past %gs for %s: score 0.0 (raise data.reward_timeout_s if this is expected)",
                self._fn_name,
                timeout_s,
                where_text,
            )
            return _TIMED_OUT
        except (SystemExit, KeyboardInterrupt) as e:  # not Exceptions: would end the job, status 0 for exit(0)
            raise UserError(
                f"reward function {self._fn_name} raised {type(e).__name__}"
                f"{f'({e.code!r})' if isinstance(e, SystemExit) else ''} for {where_text}: a reward function "
                "must return a score, not exit; fix the function"
            ) from None
        except Exception as e:
            first_line = (str(e).splitlines() or [""])[0]
            raise UserError(
                f"reward function {self._fn_name} raised {type(e).__name__}: {first_line} "
                f"for {where_text}: fix the function"
            ) from e

    @property
    def _fn_name(self) -> str:
        return f"{self.custom_name} in {self.custom_file}"

    # ------------------------------------------------------------------ checks

    def check_sources(self, data_sources: Iterable[str]) -> None:
        """Raise before training when some data_source would have no scorer."""
        if self.custom_fn is None and not self.builtin:
            for source in sorted(set(data_sources)):
                self._rule(source)

    @staticmethod
    def _rule(name: str) -> Callable[..., float]:
        fn = SCORERS.get(name)
        if fn is None:
            raise UserError(
                f"no reward scorer for data_source {name!r} (built in: "
                f"{', '.join(sorted(SCORERS))}): set data.reward_fn_file to a Python file "
                f"defining {SIGNATURE}, or data.reward_scorer to a built-in"
            )
        return fn


_TIMED_OUT = object()

__all__ = [
    "SCORERS",
    "RewardScorer",
    "Sample",
    "ScoreResult",
    "extras_metrics",
    "extras_sums",
    "merge_extras_sums",
    "load_custom_reward",
    "SIGNATURE",
    "BATCHED_SIGNATURE",
]
