"""`bash benchmarks/gpu_check.sh --cpu` passes: the GPU check script runs (at tiny shapes) before a GPU is lent.

The same script and checks as on a GPU (benchmarks/device_check.py): collectives, bf16 PPO with actor,
critic and reference, weight sync and log-prob parity, dist-checkpoint save and exact resume, the
planner when present, step time and tokens/s. ~1 min on 2 quiet cores.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.runs import ROOT

pytestmark = pytest.mark.slow


def test_gpu_check_cpu_mode_passes(tmp_path):
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        OUT=str(tmp_path / "out"),
        RLSTACK_GPU_WORK=str(tmp_path / "work"),
        RLSTACK_GPU_MODEL=str(tmp_path / "model"),
    )
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert "device_check (cpu): all checks passed" in text and "gpu_check --cpu passed" in text
    with open(tmp_path / "out" / "check" / "device_check.json") as f:
        report = json.load(f)
    checks = report["checks"]
    for name in ("collectives", "train", "metrics", "weight_sync_parity", "checkpoint", "speed", "planner"):
        assert checks[name]["ok"], (name, checks[name])
    assert checks["checkpoint"]["max_rel_diff"] == 0.0  # same machine and layout: the resume is exact
    assert checks["weight_sync_parity"]["rollout_diff"] > 0.0  # bf16 actor vs fp32 engine: measured, not 0
    assert checks["speed"]["step_s"] > 0 and checks["speed"]["rollout_tok_s"] > 0
    if os.path.isfile(os.path.join(ROOT, "rlstack", "plan.py")):
        assert checks["planner"]["predicted_gib"] > 0 and checks["planner"]["measured_gib"] > 0, checks["planner"]
    else:
        assert "planner: not present" in text
