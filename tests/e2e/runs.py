"""Helpers for end-to-end runs: torchrun the trainer on a config, read its metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun_train(
    out_dir: str,
    overrides: list[str],
    nproc: int = 2,
    config: str = "yaml_configs/tiny_cpu.yaml",
    extra_args: tuple = (),
    timeout: float = 600,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    from tests.dist_utils import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        "-m",
        "rlstack.train",
        "--config",
        config,
        f"trainer.output_dir={out_dir}",
        *overrides,
        *extra_args,
    ]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_steps(metrics: list[dict]) -> list[dict]:
    """Rows of training steps (validation-only rows have no reward/mean)."""
    return [m for m in metrics if "reward/mean" in m]


# Metrics that depend on the maths only (not on time or memory): what layouts and resumes must reproduce.
NUMERIC_KEYS = (
    "reward/mean",
    "reward/std",
    "response/length_mean",
    "actor/loss",
    "actor/pg_loss",
    "actor/kl",
    "actor/entropy",
    "critic/loss",
)
