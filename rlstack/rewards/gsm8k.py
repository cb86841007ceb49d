"""GSM8K answer extraction and scoring: verl's exact reading, and rlstack's lenient one.

`compute_score` / `verl_extract_solution` give verl 0.9.1's score (`verl/utils/reward_score/
gsm8k.py`) on every input, so validation accuracies compare with published verl runs. What verl's
reading does, and so what this one does (pinned in tests/unit/test_rewards.py):
- only the last 300 characters of the response are searched (a `#### n` earlier is not seen);
- strict: the last `#### ` followed by ONE space and a run of ASCII digits, dots and commas (an
  optional leading `-`); `####18` and `#### $18` find nothing; commas are removed, the rest is kept
  as written, so `#### 18.` answers "18." and `#### 18.0` answers "18.0", neither equal to "18";
- flexible: the last such run anywhere (not "."), commas kept ("1,000" != "1000");
- the answer is compared to the ground truth as a string (`==`), no number parsing;
- full-width digits ("１８") are not digits for `[0-9]`.
This is a re-implementation from that behaviour, not a copy of verl's code.

The lenient reading (`lenient_extract_answer`, `lenient_score`; scorers `gsm8k_lenient` and
`gsm8k_lenient_flexible`) compares numbers by value ("18.0" == "18", "1,000" == "1000", "$18" ==
"18"), drops a sentence period after a number, treats a minus glued to a word or digit ("7-5") as
an operator and searches the whole response. It scores higher than verl on the same responses:
choose it knowingly (`data.reward_scorer=gsm8k_lenient`), never to compare with verl numbers.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Optional

METHODS = ("strict", "flexible")

# ----------------------------------------------------------------------------- verl's reading

VERL_CLIP_CHARS = 300  # verl searches only the response's tail (a regex speed-up there)
_VERL_STRICT_RE = re.compile(r"#### (-?[0-9.,]+)")
_VERL_RUN_RE = re.compile(r"-?[0-9.,]+")


def verl_extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    """The answer verl's gsm8k scorer reads in `solution_str`, or None (see the module doc)."""
    _check_method(method)
    tail = solution_str[-VERL_CLIP_CHARS:]
    if method == "strict":
        found = _VERL_STRICT_RE.findall(tail)
        return found[-1].replace(",", "") if found else None
    runs = _VERL_RUN_RE.findall(tail)
    if not runs:
        return None
    for run in reversed(runs):
        if run != ".":
            return run
    return runs[0]  # every run is ".": verl's loop ends on the first one, which it then returns


def compute_score(
    solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """verl's gsm8k.compute_score: `score` if the answer == ground_truth, `format_score` if an
    answer was found but differs, else 0 (as a float, as verl's default_compute_score returns)."""
    answer = verl_extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)


# ----------------------------------------------------------------------------- lenient reading

# An optional sign (only where it cannot be a binary minus: not after a word character, a dot or
# a closing bracket), an optional "$", digits with optional thousands commas, optional decimals.
_NUMBER = r"(?:(?<![\w.)\]])-)?\$?\d(?:[\d,]*\d)?(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
# "#### 18", "####18", "#### $1,080.50", "#### -3", "#### -$3", "#### $-3".
_STRICT_RE = re.compile(r"####\s*\$?\s*(-?\s*\$?\d(?:[\d,]*\d)?(?:\.\d+)?)")


def lenient_extract_answer(text: str, method: str = "strict") -> Optional[str]:
    """The answer string in `text` (commas, "$" and spaces removed), or None when there is none."""
    _check_method(method)
    found = _STRICT_RE.findall(text) if method == "strict" else _NUMBER_RE.findall(text)
    if not found:
        return None
    return _clean(found[-1])


def lenient_score(
    solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """Like compute_score, with the lenient reading and a numeric comparison."""
    answer = lenient_extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if same_number(answer, ground_truth) else float(format_score)


def first_number(text: str) -> Optional[str]:
    """The first number in `text`, cleaned like lenient_extract_answer; None when there is none."""
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


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"gsm8k method {method!r} is unknown: use 'strict' or 'flexible'")
