"""GSM8K answer extraction and scoring, call-compatible with verl's `reward_score/gsm8k.py`.

`strict` takes the number after the last `####`; `flexible` takes the last number anywhere. Unlike
verl, answers are compared as numbers ("18.0" == "18", "1,000" == "1000", "$18" == "18"), a
number's trailing sentence period is not part of it, a minus sign glued to a word or digit
("7-5") is an operator rather than a sign, and the whole response is searched (verl looks only
at its last 300 characters).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional

METHODS = ("strict", "flexible")
# An optional sign (only where it cannot be a binary minus: not after a word character, a dot or
# a closing bracket), an optional "$", digits with optional thousands commas, optional decimals.
_NUMBER = r"(?:(?<![\w.)\]])-)?\$?\d(?:[\d,]*\d)?(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
# "#### 18", "####18", "#### $1,080.50", "#### -3", "#### -$3", "#### $-3".
_STRICT_RE = re.compile(r"####\s*\$?\s*(-?\s*\$?\d(?:[\d,]*\d)?(?:\.\d+)?)")


def extract_answer(text: str, method: str = "strict") -> Optional[str]:
    """The answer string in `text` (commas, "$" and spaces removed), or None when there is none."""
    if method not in METHODS:
        raise ValueError(f"gsm8k method {method!r} is unknown: use 'strict' or 'flexible'")
    if method == "strict":
        found = _STRICT_RE.findall(text)
    else:
        found = _NUMBER_RE.findall(text)
    if not found:
        return None
    return _clean(found[-1])


def first_number(text: str) -> Optional[str]:
    """The first number in `text`, cleaned like extract_answer; None when there is none."""
    match = _NUMBER_RE.search(text)
    return _clean(match.group(0)) if match else None


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").replace(" ", "")


def to_number(text) -> Optional[Decimal]:
    """A cleaned answer or ground truth as an exact Decimal; None when it is not a number."""
    if text is None:
        return None
    try:
        value = Decimal(_clean(str(text)).strip())
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def same_number(answer, ground_truth) -> bool:
    """Numeric equality of two answer strings; False when either is not a number."""
    a, b = to_number(answer), to_number(ground_truth)
    return a is not None and b is not None and a == b


def compute_score(solution_str: str, ground_truth: str, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's gsm8k.compute_score: `score` if right, `format_score` if an answer was found, else 0."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if same_number(answer, ground_truth) else float(format_score)
