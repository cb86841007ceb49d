"""A short run prints lean logs (issue 34): rlstack's stage lines and one line per step with `k/N`
and an ETA; no third-party noise, no progress-bar fragments, nothing wider than 120 columns.
The checks ride on other runs (suite time): the hf run is tests/e2e/test_launch_e2e.py's one-node run,
the vLLM run is the reference run of tests/e2e/test_vllm_training.py's resume test."""

from __future__ import annotations

import re

# What a run printed before (issue 34's count: 22 of 63 lines were these).
KNOWN_NOISE = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "OMP_NUM_THREADS",
    "Loading weights",
    "Loading safetensors",
    "it/s]",
    "batch/s]",
    "warnings.warn",
    "WARNING 12-",  # vLLM's own log format
    "Failed to load weights",
    "Triton not available",
    "NUMA binding",
    "ChildFailedError",
    "Root Cause",
)


def check_lean(text: str, max_lines: int, steps: int = 3) -> None:
    step_line = re.compile(rf"\d\d:\d\d:\d\d step (\d+)/{steps} \| .*?(\| eta \d+:\d\d:\d\d)?$")
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) <= max_lines, "\n".join(lines)
    for noise in KNOWN_NOISE:
        assert noise not in text, f"{noise!r} in the console:\n{text}"
    wide = [line for line in lines if len(line) > 120]
    assert not wide, wide
    seen = [(int(m.group(1)), bool(m.group(2))) for line in lines if (m := step_line.search(line))]
    expected = [(k, k < steps) for k in range(1, steps + 1)]
    assert seen == expected, "\n".join(lines)  # the last step needs no ETA
    assert any(line.startswith("memory plan: peak ") and line.endswith(": fits") for line in lines), lines
