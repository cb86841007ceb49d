"""Rule scorers for the built-in tasks, registered by name in `rlstack.rewards.SCORERS`.

Each scorer is `fn(solution_str, ground_truth, extra_info=None) -> float`.
"""

from __future__ import annotations

from typing import Optional

from rlstack.rewards import gsm8k, math


def gsm8k_verl_strict(solution_str: str, ground_truth, extra_info: Optional[dict] = None) -> float:
    """verl's default for `openai/gsm8k`: 1.0 when the `#### n` answer equals the ground truth."""
    return gsm8k.compute_score(solution_str, ground_truth, method="strict")


def gsm8k_verl_flexible(solution_str: str, ground_truth, extra_info: Optional[dict] = None) -> float:
    """verl's flexible mode: the last number-like run of the response's last 300 characters."""
    return gsm8k.compute_score(solution_str, ground_truth, method="flexible")


def gsm8k_lenient_strict(solution_str: str, ground_truth, extra_info: Optional[dict] = None) -> float:
    """rlstack's lenient `#### n` reading, compared as numbers (see rlstack.rewards.gsm8k)."""
    return gsm8k.lenient_score(solution_str, ground_truth, method="strict")


def gsm8k_lenient_flexible(solution_str: str, ground_truth, extra_info: Optional[dict] = None) -> float:
    """rlstack's lenient last-number reading, compared as numbers."""
    return gsm8k.lenient_score(solution_str, ground_truth, method="flexible")


def math_verl(solution_str: str, ground_truth, extra_info: Optional[dict] = None) -> float:
    """verl's default for the MATH sources: the last boxed answer, normalised (rlstack.rewards.math)."""
    return math.compute_score(solution_str, ground_truth)


def arith(solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> float:
    """1.0 when the `#### n` answer or the last number is right: flexible on purpose.

    An untrained SmolLM2-135M-Instruct almost never writes `#### n` (0 of 192 samples in
    the project's measurements (docs/)), so strict-only scoring gives no learning signal; the last number gives ~12%.
    """
    for method in ("strict", "flexible"):
        if gsm8k.same_number(gsm8k.lenient_extract_answer(solution_str, method), ground_truth):
            return 1.0
    return 0.0


def copy(solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> float:
    """1.0 when the FIRST number in the response equals the digit to copy."""
    return 1.0 if gsm8k.same_number(gsm8k.first_number(solution_str), ground_truth) else 0.0
