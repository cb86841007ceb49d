"""What every fault test asserts about the disk after the fault: nothing saved is lost or poisoned."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

from rlstack.checkpoint import LATEST, MARKER, list_checkpoints, verify_checkpoint
from tests.e2e.runs import ROOT

PPO_SH = os.path.join(ROOT, "launch", "ppo.sh")


def launch(out: str, overrides: list[str], nproc: int = 2, **popen) -> subprocess.Popen:
    from tests.dist_utils import free_port

    env = dict(
        os.environ,
        RLSTACK_IGNORE_SLURM="1",
        OMP_NUM_THREADS="1",
        NPROC_PER_NODE=str(nproc),
        MASTER_PORT=str(free_port()),
    )
    return subprocess.Popen(
        [
            "bash",
            PPO_SH,
            "yaml_configs/tiny_cpu.yaml",
            f"trainer.output_dir={out}",
            "logging.progress=false",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


def launch_torchrun(out: str, overrides: list[str], nproc: int = 2) -> subprocess.Popen:
    """The same run under raw `python -m torch.distributed.run` (no launch/ppo.sh), its own session."""
    import sys

    from tests.dist_utils import free_port

    env = dict(os.environ, RLSTACK_IGNORE_SLURM="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("RLSTACK_SIGNALS_TO_RANKS", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    cmd += ["-m", "rlstack.train", "--config", "yaml_configs/tiny_cpu.yaml", f"trainer.output_dir={out}"]
    cmd += ["logging.progress=false", *overrides]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        text, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return text


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def rank_process(launcher_pid: int, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "rlstack.train" in " ".join(child.cmdline()):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise LookupError(f"no rank {rank} process under {launcher_pid}")


def wait_for(predicate, timeout: float = 300, what: str = "condition", poll: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out waiting for {what}")


def metrics_lines(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def assert_checkpoints_sound(root: str) -> list[int]:
    """Every complete checkpoint under `root` verifies, loads (DCP) and holds finite tensors; `latest`
    names a complete one. Returns the complete steps, newest first."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    complete = []
    for step, path in list_checkpoints(root):
        if not os.path.isfile(os.path.join(path, MARKER)):
            continue  # never published as complete: never loaded (the loader refuses it)
        verify_checkpoint(path)
        for role in ("actor", "critic"):
            if not os.path.isdir(os.path.join(path, role)):
                continue
            flat = os.path.join(path, f"{role}.check.pt")
            dcp_to_torch_save(os.path.join(path, role), flat)
            state = torch.load(flat, weights_only=False)
            os.remove(flat)
            tensors = list(_tensors(state))
            assert tensors, f"{path}/{role} holds no tensors"
            bad = [name for name, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]
            assert not bad, f"{path}/{role} holds non-finite tensors: {bad[:5]}"
        complete.append(step)
    latest = os.path.join(root, LATEST)
    if complete:
        with open(latest) as f:
            target = os.path.join(root, f.read().strip())
        assert os.path.isfile(os.path.join(target, MARKER)), f"latest points at {target}, which is not complete"
    return complete


def _tensors(state, prefix=""):
    import torch

    if isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}{key}.")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _tensors(value, f"{prefix}{i}.")
    elif torch.is_tensor(state):
        yield prefix.rstrip("."), state


def numeric_by_step(out: str) -> dict[int, dict]:
    """The run's numeric metrics by step (tests.e2e.runs.NUMERIC_KEYS); a step logged twice fails."""
    from tests.e2e.runs import NUMERIC_KEYS, read_metrics, train_steps

    rows = {}
    for row in train_steps(read_metrics(out)):
        assert row["step"] not in rows, f"step {row['step']} logged twice"
        rows[row["step"]] = {k: row[k] for k in NUMERIC_KEYS if k in row}
    return rows
