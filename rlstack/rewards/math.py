"""MATH (Hendrycks et al.) answers in `\\boxed{...}`, scored exactly as verl 0.9.1 scores them.

verl's `verl/utils/reward_score/math_reward.py` (itself lm-evaluation-harness's hendrycks_math
normalisation) is what `default_compute_score` uses for data_source `lighteval/MATH`,
`DigitalLearningGmbH/MATH-lighteval` and `HuggingFaceH4/MATH-500`. This module re-implements that
behaviour, quirks included, so scores compare with verl runs:
- the answer is the last `\\boxed{...}` (braces balanced) or, when the text holds `\\boxed ` (with a
  space), what follows the last `\\boxed ` up to the next `$`; a `\\fbox{...}` is found but never
  unboxed (verl asserts a `\\boxed{` prefix and scores 0);
- answer and ground truth are normalised by `normalize` (spaces, `\\left`/`\\right`, `tfrac`/`dfrac`,
  degrees, `\\$`, a right-hand `\\text{ unit}`, `\\%`, leading `.`, a short `k = ` prefix,
  `\\sqrt3`, `\\frac12`, `0.5`, `a/b`) and compared as strings;
- where the normalisation fails (two `\\text{ ` units, a bare `\\sqrt` or `\\frac` at the end),
  the raw strings are compared instead, as verl's `is_equiv` does.
Checked against verl's module on random strings (see docs/data.md).
"""

from __future__ import annotations

from typing import Any, Optional

SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


class _NotNormalisable(ValueError):
    """The inputs where verl's normalisation raises (and is_equiv falls back to raw equality)."""


def last_boxed(text: str) -> Optional[str]:
    """The last `\\boxed{...}` / `\\fbox{...}` with its braces balanced, `\\boxed <text>`, or None."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None  # never closed


def unbox(boxed: str) -> Optional[str]:
    """`\\boxed{x}` -> x, `\\boxed x` -> x; None for anything else (a `\\fbox`, an unclosed box)."""
    if "\\boxed " in boxed:
        return boxed[len("\\boxed ") :] if boxed.startswith("\\boxed ") else None
    if boxed.startswith("\\boxed{") and boxed.endswith("}") and len(boxed) > len("\\boxed{"):
        return boxed[len("\\boxed{") : -1]
    return None


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the last boxed answer equals the ground truth after normalisation, else 0.0."""
    try:
        boxed = last_boxed(solution_str)
    except (AttributeError, TypeError):
        return 0.0  # not a string: verl catches the error and scores 0
    answer = unbox(boxed) if boxed is not None else None
    return 1.0 if answer is not None and is_equiv(answer, ground_truth) else 0.0


def is_equiv(a: Any, b: Any) -> bool:
    if a is None and b is None:
        return True
    if a is None or b is None:
        return False
    try:
        return normalize(a) == normalize(b)
    except Exception:  # _NotNormalisable, or a ground truth that is not a string
        return a == b


# Order matters: each step sees the previous one's output (e.g. `\\\\` is folded before `\\\\%`).
_REPLACEMENTS_BEFORE_UNITS = (
    ("\n", ""),
    ("\\!", ""),
    ("\\\\", "\\"),
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\$", ""),
)
_REPLACEMENTS_AFTER_UNITS = (("\\\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0."))


def normalize(s: str) -> str:
    """verl's (lm-eval's hendrycks_math) strip_string; raises _NotNormalisable where that raises."""
    for old, new in _REPLACEMENTS_BEFORE_UNITS:
        s = s.replace(old, new)
    s = _drop_right_units(s)
    for old, new in _REPLACEMENTS_AFTER_UNITS:
        s = s.replace(old, new)
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]  # "x = 3" -> " 3"
    s = _brace_sqrt(s).replace(" ", "")
    s = _brace_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def _drop_right_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise _NotNormalisable("more than one \\text{ unit")
    return parts[0]


def _brace_sqrt(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`."""
    if "\\sqrt" not in s:
        return s
    parts = s.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        if not part:
            raise _NotNormalisable("\\sqrt without an argument")
        out += "\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:]
    return out


def _brace_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`; unchanged if one is too short."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if not part:
            raise _NotNormalisable("\\frac without arguments")
        if part[0] == "{":
            out += part
        elif len(part) < 2:
            return s
        elif part[1] != "{":
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            out += "{" + part[0] + "}" + part[1:]
    return out


def _slash_to_frac(s: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are integers written plainly."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}" if s == f"{a}/{b}" else s
