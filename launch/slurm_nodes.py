"""Where this node sits in the job: node count, node rank, processes per node, master address/port.

Used by launch/ppo.sh; plain standard library (no rlstack, no torch), so any python3 runs it.

    python launch/slurm_nodes.py layout          # KEY=VALUE lines for ppo.sh; notes on stderr
    python launch/slurm_nodes.py expand LIST     # one host per line, e.g. LIST=gpu[01-04,07]

Under SLURM (SLURM_JOB_ID set) the nodes, this node's rank and the master address come from SLURM's
environment; node lists are expanded here rather than by `scontrol show hostnames`, so the result
does not depend on whether scontrol is installed where the script runs. Outside SLURM the usual
torchrun variables are read: NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT.
A wrong or contradictory environment is a ValueError naming the variable to fix (exit status 2).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Optional

DEFAULT_MASTER_PORT = 29500
# SLURM jobs get a port derived from the job id, so two jobs sharing a node do not collide; the
# range stays below Linux's ephemeral ports (32768+), which the OS hands out to other sockets.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000
CPU_DEFAULT_NPROC = 2

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


# ----------------------------------------------------------------------------- node lists


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact node list -> host names, in SLURM's order.

    `gpu01` -> [gpu01]; `gpu[01-04,07]` -> gpu01..gpu04, gpu07 (zero padding kept);
    `a[1-2],b[3,5-6]` -> a1 a2 b3 b5 b6; `rack[1-2]-n[01-02]` -> rack1-n01 rack1-n02 rack2-n01 ...
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("the SLURM node list is empty: run inside a SLURM allocation or unset SLURM_JOB_ID")
    hosts: list[str] = []
    for item in _split_top_level(text, nodelist):
        hosts += _expand_host(item, nodelist)
    return hosts


def _split_top_level(text: str, original: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"node list {original!r} has nested brackets: pass a list like gpu[01-04,07]")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list {original!r} has an unmatched ']': pass a list like gpu[01-04,07]")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"node list {original!r} has an unclosed '[': pass a list like gpu[01-04,07]")
    items.append(text[start:])
    if any(not item.strip() for item in items):
        raise ValueError(f"node list {original!r} has an empty entry: remove the stray comma")
    return [item.strip() for item in items]


def _expand_host(pattern: str, original: str) -> list[str]:
    """One host pattern (no top-level commas), possibly with several bracket groups."""
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    prefix, suffix = pattern[: match.start()], pattern[match.end() :]
    return [
        prefix + value + rest
        for value in _expand_ranges(match.group(1), original)
        for rest in _expand_host(suffix, original)
    ]


def _expand_ranges(body: str, original: str) -> list[str]:
    """`01-04,07` -> 01 02 03 04 07; the width of the lower bound sets the zero padding."""
    values = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"node list {original!r}: cannot read range {part!r} (expected N or N-M)")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise ValueError(f"node list {original!r}: range {part!r} runs backwards")
        values += [str(n).zfill(len(low_text)) for n in range(low, high + 1)]
    return values


# ----------------------------------------------------------------------------- GPUs


def parse_gpu_count(text: str, variable: str) -> int:
    """SLURM GPU counts: `8`, `a100:8`, `gpu:a100:8`, `a100:4,v100:2` (summed)."""
    total = 0
    bare = re.sub(r"\([^)]*\)", "", text)  # drop `(IDX:0-3)` annotations that scontrol-style values carry
    for part in bare.split(","):
        count = part.strip().rsplit(":", 1)[-1]
        if not count.isdigit():
            raise ValueError(f"{variable}={text!r} is not a GPU count: set NPROC_PER_NODE to the processes per node")
        total += int(count)
    return total


def count_visible_gpus(env: Mapping[str, str]) -> int:
    """GPUs this node can use: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`, else 0.

    Avoids importing torch (seconds) just to count devices.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        # CUDA stops at the first invalid id; "-1" and "NoDevFiles" are the usual ways to hide all.
        return 0 if not entries or entries[0] in ("-1", "NoDevFiles") else len(entries)
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


# ----------------------------------------------------------------------------- layout


@dataclass
class Layout:
    """The torchrun arguments that say where this node sits in the job."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    source: str  # "slurm" or "env"
    notes: list[str] = field(default_factory=list)  # printed to stderr by the CLI

    def shell_lines(self) -> list[str]:
        return [
            f"NNODES={self.nnodes}",
            f"NODE_RANK={self.node_rank}",
            f"NPROC_PER_NODE={self.nproc_per_node}",
            f"MASTER_ADDR={self.master_addr}",
            f"MASTER_PORT={self.master_port}",
            f"LAYOUT_SOURCE={self.source}",
        ]


def layout_from_env(
    env: Mapping[str, str], gpus: Optional[Callable[[], int]] = None, free_port: Optional[Callable[[], int]] = None
) -> Layout:
    """SLURM's environment when SLURM_JOB_ID is set (and RLSTACK_IGNORE_SLURM is not 1), else torchrun's."""
    gpus = gpus or (lambda: count_visible_gpus(env))
    free_port = free_port or _free_port
    in_slurm = bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))
    if in_slurm and env.get("RLSTACK_IGNORE_SLURM", "0") != "1":
        layout = _slurm_layout(env, gpus)
    else:
        layout = _env_layout(env, gpus, free_port)
    if layout.nproc_per_node < 1:
        raise ValueError(f"{layout.nproc_per_node} processes per node: set NPROC_PER_NODE to at least 1")
    return layout


def _env_layout(env: Mapping[str, str], gpus: Callable[[], int], free_port: Callable[[], int]) -> Layout:
    notes = []
    nnodes = _int_env(env, "NNODES", 1, minimum=1)
    node_rank = _int_env(env, "NODE_RANK", 0, minimum=0)
    if node_rank >= nnodes:
        raise ValueError(f"NODE_RANK={node_rank} but NNODES={nnodes}: node ranks run from 0 to NNODES-1")
    nproc = _int_env(env, "NPROC_PER_NODE", None, minimum=1)
    if nproc is None:
        found = gpus()
        nproc = found or CPU_DEFAULT_NPROC
        if not found:
            notes.append(f"no GPU found: starting {nproc} CPU processes (set NPROC_PER_NODE to choose)")
    master_addr = env.get("MASTER_ADDR", "")
    if not master_addr:
        if nnodes > 1:
            raise ValueError(f"NNODES={nnodes} needs MASTER_ADDR: set it to node 0's address on every node")
        master_addr = "127.0.0.1"
    master_port = _int_env(env, "MASTER_PORT", None, minimum=1)
    if master_port is None:
        # One node: any free port, so several single-node runs can share a machine. Several nodes
        # must agree on the port without talking, hence the fixed torchrun default.
        master_port = free_port() if nnodes == 1 else DEFAULT_MASTER_PORT
    return Layout(nnodes, node_rank, nproc, master_addr, master_port, "env", notes)


def _slurm_layout(env: Mapping[str, str], gpus: Callable[[], int]) -> Layout:
    notes: list[str] = []
    hosts, count_var = _slurm_hosts(env)
    nnodes = len(hosts)
    if count_var and env.get(count_var) and _int_env(env, count_var, None, minimum=1) != nnodes:
        raise ValueError(
            f"{count_var}={env[count_var]} but the node list names {nnodes} nodes: "
            f"run ppo.sh through srun with one task per node"
        )
    node_rank = _slurm_node_rank(env, hosts)
    nproc = _slurm_nproc(env, gpus, notes)
    master_addr, master_port = hosts[0], _slurm_port(env)
    if env.get("MASTER_ADDR") and env["MASTER_ADDR"] != master_addr:
        master_addr = env["MASTER_ADDR"]
        notes.append(f"MASTER_ADDR={master_addr} from the environment replaces SLURM's first node {hosts[0]}")
    for var, value in (("NNODES", nnodes), ("NODE_RANK", node_rank)):
        if env.get(var) and env[var] != str(value):
            notes.append(
                f"{var}={env[var]} ignored under SLURM, which says {value} "
                f"(set RLSTACK_IGNORE_SLURM=1 to use the environment instead)"
            )
    return Layout(nnodes, node_rank, nproc, master_addr, master_port, "slurm", notes)


def _slurm_hosts(env: Mapping[str, str]) -> tuple[list[str], str]:
    """The step's node list inside srun, else the job's; and the variable that counts it."""
    for list_var, count_var in (
        ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES"),
        ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES"),
        ("SLURM_NODELIST", "SLURM_NNODES"),
    ):
        if env.get(list_var):
            if count_var == "SLURM_JOB_NUM_NODES" and not env.get(count_var):
                count_var = "SLURM_NNODES"
            return expand_nodelist(env[list_var]), count_var
    raise ValueError(
        "SLURM_JOB_ID is set but no SLURM_JOB_NODELIST: run inside an allocation "
        "(sbatch/srun) or set RLSTACK_IGNORE_SLURM=1"
    )


def _slurm_node_rank(env: Mapping[str, str], hosts: list[str]) -> int:
    # SLURMD_NODENAME names this node exactly; SLURM_NODEID counts within the job's allocation,
    # which differs from the step's list when a step uses a subset of the nodes.
    name = env.get("SLURMD_NODENAME")
    if name:
        if name not in hosts:
            raise ValueError(
                f"this node ({name}) is not in the SLURM node list {hosts}: "
                f"run ppo.sh through srun on the allocated nodes"
            )
        return hosts.index(name)
    node_rank = _int_env(env, "SLURM_NODEID", None, minimum=0)
    if node_rank is None:
        raise ValueError("SLURM gives no SLURM_NODEID: start ppo.sh with srun (one task per node)")
    if node_rank >= len(hosts):
        raise ValueError(
            f"SLURM_NODEID={node_rank} but the node list names {len(hosts)} nodes: "
            f"run ppo.sh through srun with one task per node"
        )
    return node_rank


def _slurm_nproc(env: Mapping[str, str], gpus: Callable[[], int], notes: list[str]) -> int:
    explicit = _int_env(env, "NPROC_PER_NODE", None, minimum=1)
    if explicit is not None:
        notes.append(f"NPROC_PER_NODE={explicit} from the environment (SLURM's GPU count not used)")
        return explicit
    for var in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        if env.get(var):
            return parse_gpu_count(env[var], var)
    found = gpus()
    nproc = found or CPU_DEFAULT_NPROC
    notes.append(
        f"SLURM gives no GPU count (SLURM_GPUS_ON_NODE): starting {nproc} processes per node "
        f"(request GPUs with --gpus-per-node or set NPROC_PER_NODE)"
    )
    return nproc


def _slurm_port(env: Mapping[str, str]) -> int:
    explicit = _int_env(env, "MASTER_PORT", None, minimum=1)
    if explicit is not None:
        return explicit
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job_id!r} is not a number: set MASTER_PORT")
    return SLURM_PORT_BASE + int(job_id) % SLURM_PORT_SPAN


def _int_env(env: Mapping[str, str], name: str, default: Optional[int], minimum: int) -> Optional[int]:
    text = env.get(name, "")
    if text == "":
        return default
    if not text.strip().isdigit() or int(text) < minimum:
        raise ValueError(f"{name}={text!r}: set it to an integer >= {minimum}")
    return int(text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["layout"] and len(argv) == 1:
            layout = layout_from_env(os.environ)
            for note in layout.notes:
                print(f"ppo.sh: {note}", file=sys.stderr)
            print("\n".join(layout.shell_lines()))
            return 0
        if argv[:1] == ["expand"] and len(argv) == 2:
            print("\n".join(expand_nodelist(argv[1])))
            return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("usage: slurm_nodes.py layout | slurm_nodes.py expand NODELIST", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
