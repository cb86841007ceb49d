"""Collectives are NCCL-safe by construction (rlstack/collectives.py, megatron_bridge/parallel.py).

- No code under rlstack/ or benchmarks/ calls a raw torch.distributed collective outside
  rlstack/collectives.py (an AST scan, so no GPU is needed to catch a CPU tensor sent over NCCL).
- With CUDA present, the default group gets gloo beside NCCL.
- The helpers compute the right numbers on a real gloo group (a world of one).
"""

from __future__ import annotations

import ast
import os

import pytest
import torch

from tests.e2e.runs import ROOT

ALLOWED = {os.path.join("rlstack", "collectives.py")}
SCANNED = ("rlstack", "benchmarks")
# torch.distributed functions that move data or synchronise ranks
RAW = {
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_coalesced",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "send_object_list",
    "recv_object_list",
}


def _dist_aliases(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to torch.distributed, and raw collectives imported by name from it (alias -> name)."""
    modules, functions = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d") and a.name in RAW:
                    functions[a.asname or a.name] = a.name
    return modules, functions


def _is_torch_distributed(node: ast.AST, modules: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in modules
    return (
        isinstance(node, ast.Attribute)
        and node.attr in ("distributed", "distributed_c10d")
        and (
            isinstance(node.value, ast.Name) and node.value.id == "torch" or _is_torch_distributed(node.value, modules)
        )
    )


def raw_collective_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of every raw torch.distributed collective called in `source`."""
    tree = ast.parse(source)
    modules, functions = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in RAW and _is_torch_distributed(f.value, modules):
            found.append((node.lineno, f.attr))
        elif isinstance(f, ast.Name) and f.id in functions:
            found.append((node.lineno, functions[f.id]))
        elif isinstance(f, ast.Attribute) and f.attr == "P2POp" and _is_torch_distributed(f.value, modules):
            found.append((node.lineno, "P2POp"))
    return found


def _python_files():
    for top in SCANNED:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT), path


def test_no_raw_collectives_outside_the_collectives_module():
    offenders = []
    for rel, path in _python_files():
        if rel in ALLOWED:
            continue
        with open(path) as f:
            offenders += [f"{rel}:{line} dist.{name}" for line, name in raw_collective_calls(f.read())]
    assert not offenders, (
        "raw torch.distributed collectives outside rlstack/collectives.py (NCCL refuses "
        "CPU tensors; use rlstack.collectives): " + ", ".join(offenders)
    )


@pytest.mark.parametrize(
    "source,expected",
    [
        ("import torch.distributed as dist\ndist.all_reduce(t)\n", [(2, "all_reduce")]),
        ("import torch\ntorch.distributed.broadcast(t, 0)\n", [(2, "broadcast")]),
        ("from torch import distributed as d\nd.barrier()\n", [(2, "barrier")]),
        ("from torch.distributed import all_gather_object as ag\nag(p, x)\n", [(2, "all_gather_object")]),
        ("import torch.distributed as dist\nx = dist.get_rank()\ndist.is_initialized()\n", []),
        ("def all_reduce(t): pass\nall_reduce(t)\n", []),
    ],
)
def test_scanner_sees_every_spelling(source, expected):
    """The scan itself can fail: each way of spelling a raw call is caught, non-collectives are not."""
    assert raw_collective_calls(source) == expected


def test_nccl_default_group_has_gloo_beside_it(monkeypatch):
    import torch.distributed as dist

    from megatron_bridge import parallel

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setenv("MASTER_PORT", "29999")
    backend = parallel.pick_backend("auto")
    assert backend == "nccl"
    parallel.start_world(backend, timeout_minutes=1, world_size=2, rank=1)
    assert seen["backend"] == "cpu:gloo,cuda:nccl"
    assert (seen["world_size"], seen["rank"]) == (2, 1)


def test_gloo_stays_gloo_without_cuda(monkeypatch):
    from megatron_bridge import parallel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parallel.pick_backend("auto") == "gloo"
    assert parallel.process_group_backend("gloo") == "gloo"


def test_helpers_on_a_gloo_group(world_of_one):
    from rlstack import collectives

    g, cpu = world_of_one, torch.device("cpu")
    assert collectives.sum_floats([1.5, 2], g, cpu) == [1.5, 2.0]
    assert collectives.max_floats([-1.0], g, cpu) == [-1.0]
    t = torch.tensor([3.0, 4.0])
    assert collectives.all_reduce_(t, g, cpu) is t and t.tolist() == [3.0, 4.0]
    assert collectives.sum_over(g, cpu)(torch.ones(2)).tolist() == [1.0, 1.0]
    assert collectives.broadcast_(torch.tensor([7]), 0, g, cpu).tolist() == [7]
    assert collectives.broadcast_object({"a": 1}, 0, g, cpu) == {"a": 1}
    assert collectives.all_gather_objects([1], g, 1) == [[1]]
    assert collectives.src_of_last(g) == 0
    collectives.barrier(g, cpu)
