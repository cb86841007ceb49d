"""Rewards: rule scorers registered by `data_source`, and custom functions with verl's signature.

Pure Python (no torch). `RewardScorer.score(...)` is what the reward worker calls per response.
"""

from __future__ import annotations

from rlstack.errors import UserError
from typing import Callable, Iterable, Optional

from rlstack.rewards import rules
from rlstack.rewards.custom import SIGNATURE, as_score, load_custom_reward

# data_source -> fn(solution_str, ground_truth, extra_info=None) -> float
SCORERS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": rules.gsm8k_strict,  # verl's name for GSM8K rows; strict as in verl
    "gsm8k": rules.gsm8k_strict,
    "arith": rules.arith,  # flexible by default, see rules.arith
    "copy": rules.copy,
}


class RewardScorer:
    """Scores responses: the custom function when one is set (for every data_source), else SCORERS."""

    def __init__(self, custom_file: str = "", custom_name: str = "compute_score"):
        self.custom_name = custom_name
        self.custom_fn: Optional[Callable] = None
        if custom_file:
            self.custom_fn = load_custom_reward(custom_file, custom_name)

    def score(self, data_source: str, solution_str: str, ground_truth: str,
              extra_info: Optional[dict] = None) -> float:
        if self.custom_fn is not None:
            value = self.custom_fn(data_source=data_source, solution_str=solution_str,
                                   ground_truth=ground_truth, extra_info=extra_info)
            return as_score(value, self.custom_name)
        return self._rule(data_source)(solution_str, ground_truth, extra_info)

    def check_sources(self, data_sources: Iterable[str]) -> None:
        """Raise before training when some data_source would have no scorer."""
        if self.custom_fn is None:
            for source in sorted(set(data_sources)):
                self._rule(source)

    @staticmethod
    def _rule(data_source: str) -> Callable[..., float]:
        fn = SCORERS.get(data_source)
        if fn is None:
            raise UserError(f"no reward scorer for data_source {data_source!r} (built in: "
                             f"{', '.join(sorted(SCORERS))}): set data.reward_fn_file to a Python file "
                             f"defining {SIGNATURE}")
        return fn
