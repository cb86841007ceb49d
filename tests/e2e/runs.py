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


def metrics_by_step(out_dir: str, volatile: tuple[str, ...]) -> dict[int, dict]:
    """metrics.jsonl as {step: metrics without the `volatile` prefixes}; a step logged twice fails."""
    rows = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            assert row["step"] not in rows, f"step {row['step']} logged twice"
            rows[row["step"]] = {k: v for k, v in row.items() if not k.startswith(volatile)}
    return rows


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


def kill_during_step_4(out_dir: str, overrides: list[str], config: str = "yaml_configs/tiny_cpu.yaml") -> None:
    """Start a 2-rank run; once checkpoint 3 is published (step 4 then starts), SIGKILL every process of it."""
    import time

    from tests.dist_utils import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "rlstack.train",
        "--config",
        config,
        f"trainer.output_dir={out_dir}",
        *overrides,
    ]
    latest = os.path.join(out_dir, "checkpoints", "latest")
    with open(out_dir + ".killed.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.time() + 240
            while _read(latest) != "step_00000003":
                assert proc.poll() is None, f"the run ended before step 3 (exit {proc.returncode})"
                assert time.time() < deadline, "no checkpoint of step 3 within 240 s"
                time.sleep(0.02)
            time.sleep(0.1)  # inside step 4 (a tiny step takes ~0.3 s plus its save)
        finally:
            kill_tree(proc.pid)
            proc.wait()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def kill_tree(pid: int) -> None:
    """SIGKILL the process groups of torchrun and of every worker (torchrun starts each worker in a
    new session, so killing torchrun's own group would leave the ranks running)."""
    import signal

    import psutil

    tree = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    for group in {os.getpgid(p.pid) for p in tree if p.is_running()}:
        os.killpg(group, signal.SIGKILL)
    _wait_dead(tree[1:])  # the ranks gone (their lock released) before a resume starts


def _wait_dead(procs, timeout: float = 30.0) -> None:
    """Until every process has exited (a zombie counts: its files are closed; PID 1 may never reap it)."""
    import time

    import psutil

    deadline = time.time() + timeout
    for p in procs:
        while time.time() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
