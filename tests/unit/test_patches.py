"""megatron_bridge/patches: every registered call site is in the installed megatron-core, each patch
applies exactly when its condition holds, applying is one explicit call (importing changes nothing),
and start-up stops on a megatron-core version the patches were not written for."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest

from megatron_bridge import patches
from megatron_bridge.patches import registry, version
from megatron_bridge.patches.registry import KINDS, PATCHES, Applies, Environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _function_source(module: str, qualname: str) -> str:
    """The source text of `qualname` in megatron.core.<module>, read from the installed file (not from
    the live object, which a patch may have replaced)."""
    path = importlib.util.find_spec(f"megatron.core.{module}").origin
    text = open(path).read()
    node = ast.parse(text)
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
            ),
            None,
        )
        assert node is not None, f"megatron.core.{module} has no {qualname} ({path})"
    return ast.get_source_segment(text, node)


def test_registry_is_complete_and_named():
    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names))
    for p in PATCHES:
        assert p.kind in KINDS, p
        assert p.targets and p.call_sites, p.name
        assert (p.apply is None) == (p.applies is Applies.SPLIT_PLACEMENT), p.name
    # the patches that change torch for every caller say why
    for target in ("torch.cuda:current_device", "torch.cuda:synchronize", "torch:Tensor.type", "torch:Tensor.cuda"):
        owners = [p for p in PATCHES if target in p.targets]
        assert owners and all(p.process_wide for p in owners), target


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_every_call_site_is_in_the_installed_megatron_core(patch):
    for site in patch.call_sites:
        source = _function_source(site.module, site.qualname)
        assert site.source in source, (
            f"{patch.name}: megatron.core.{site.module}.{site.qualname} no longer holds {site.source!r}"
        )


CPU = Environment(cuda=False, te=False, te_or_apex=False)
GPU_BARE = Environment(cuda=True, te=False, te_or_apex=False)
GPU_TE = Environment(cuda=True, te=True, te_or_apex=True)
ALWAYS = {"mlp_act_recompute", "quiet_dependency_warnings", "forked_write_results_queue"}
NO_TE = {
    "moe_router_without_te",
    "output_discarding_checkpoint_without_te",
    "torch_adam_step_on_load",
    "inplace_multi_tensor_scale",
    "shared_prefix_rope",
}
CPU_ONLY = {
    "current_device",
    "synchronize",
    "rng_tracker",
    "cuda_tensor_factories",
    "cuda_type_checks",
    "tensor_cuda_calls",
    "moe_dtoh_stream",
    "eager_swiglu",
    "lean_rmsnorm",
    "lean_rope",
    "onednn_linears",
    "gloo_bucket_collectives",
}


@pytest.mark.parametrize(
    "env, expected",
    [(CPU, ALWAYS | NO_TE | CPU_ONLY), (GPU_BARE, ALWAYS | NO_TE), (GPU_TE, ALWAYS)],
    ids=["cpu", "gpu-without-te", "gpu-with-te"],
)
def test_start_up_patches_follow_their_conditions(env, expected):
    assert {p.name for p in registry.at_start_up(env)} == expected
    assert "split_placement_default_group" not in expected  # scoped: init_split_distributed's own


# Run in a fresh interpreter: snapshot what every registered target holds, import every module of
# megatron_bridge (nothing may change), apply as on a GPU with TE (only the "always" patches may
# change), then as on this CPU machine (every applied patch changes a target of its own).
APPLY_SCRIPT = r"""
import importlib, json, pkgutil, sys, warnings
import torch
from megatron_bridge.patches import registry

MISSING = object()  # a name the patch creates (te_general_gemm) is missing before, not None

def resolve(target):
    owner, attr = target.split(":")
    obj = importlib.import_module(owner)
    for part in attr.split("."):
        obj = vars(obj).get(part, getattr(obj, part, MISSING)) if isinstance(obj, type) else getattr(obj, part, MISSING)
    return obj

def snapshot():
    out = {}
    for p in registry.PATCHES:
        for t in p.targets:
            value = resolve(t)
            out[t] = repr(list(value)) if isinstance(value, list) else id(value)
    return out

for p in registry.PATCHES:  # import megatron's patched modules first
    for t in p.targets:
        resolve(t)
before = snapshot()
import megatron_bridge
for m in pkgutil.walk_packages(megatron_bridge.__path__, "megatron_bridge."):
    importlib.import_module(m.name)
after_import = snapshot()
from megatron_bridge import patches
gpu = patches.apply(env=registry.Environment(cuda=True, te=True, te_or_apex=True))
after_gpu = snapshot()
patches._APPLIED = None  # a second start-up in this throwaway process: the CPU patches on top
cpu = patches.apply()
after_cpu = snapshot()
changed = lambda a, b: sorted(t for t in a if a[t] != b[t])
print(json.dumps({
    "import_changed": changed(before, after_import),
    "gpu": list(gpu), "gpu_changed": changed(after_import, after_gpu),
    "cpu": list(cpu), "cpu_changed": changed(after_gpu, after_cpu),
    "cuda": torch.cuda.is_available(),
}))
"""


def test_importing_changes_nothing_and_apply_changes_each_patch_target():
    proc = subprocess.run(
        [sys.executable, "-c", APPLY_SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["import_changed"] == [], out["import_changed"]
    by_name = {p.name: p for p in PATCHES}
    assert set(out["gpu"]) == ALWAYS
    assert set(out["gpu_changed"]) == {t for n in ALWAYS for t in by_name[n].targets}
    if out["cuda"]:
        pytest.skip("the CPU half needs a machine without CUDA")
    assert set(out["cpu"]) == ALWAYS | NO_TE | CPU_ONLY
    for name in set(out["cpu"]) - ALWAYS:  # each applied patch rebinds at least one of its own targets
        assert set(by_name[name].targets) & set(out["cpu_changed"]), name
    assert set(out["cpu_changed"]) <= {t for n in out["cpu"] for t in by_name[n].targets}  # nothing else


def test_init_distributed_refuses_without_the_start_up_call(monkeypatch):
    from megatron_bridge.parallel import init_distributed

    monkeypatch.setattr(patches, "_APPLIED", None)
    with pytest.raises(RuntimeError, match=r"megatron_bridge\.patches\.apply\(\)"):
        init_distributed(1, 1)


# ---------------------------------------------------------------------- the version gate


def test_version_gate_names_the_supported_versions(monkeypatch, caplog):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(version.UnsupportedMegatronError) as err:
        version.check_megatron_version()
    message = str(err.value)
    assert "\n" not in message and "0.17.0" in message and "0.16.1" in message, message
    with caplog.at_level(logging.WARNING, logger="megatron_bridge"):
        assert version.check_megatron_version(allow_untested=True) == "0.17.0"
    assert "0.17.0" in caplog.text and "untested" in caplog.text
    monkeypatch.setattr(megatron.core, "__version__", version.SUPPORTED_MEGATRON[0])
    assert version.check_megatron_version() == version.SUPPORTED_MEGATRON[0]


class _Started(Exception):
    """Start-up went past the patches."""


def _start_training(monkeypatch, overrides: list[str]):
    import megatron.core

    from rlstack import loop
    from rlstack.config import load_config

    monkeypatch.setattr(megatron.core, "__version__", "0.15.0")
    monkeypatch.setattr(patches, "_APPLIED", None)  # a fresh process's start-up
    monkeypatch.setattr(registry, "at_start_up", lambda env: ())  # this test process keeps its patches as they are

    def started(*args, **kwargs):
        raise _Started()

    monkeypatch.setattr(loop, "_set_threads", started)  # the next start-up step, before any group
    return loop.run_training(load_config(None, ["data.synthetic=arith", *overrides]))


def test_start_up_stops_on_another_megatron_core(monkeypatch):
    from megatron_bridge.errors import InputError

    with pytest.raises(InputError) as err:
        _start_training(monkeypatch, [])
    message = str(err.value)
    assert "\n" not in message, message
    assert "megatron-core 0.15.0" in message and "0.16.1" in message
    assert "parallel.allow_untested_megatron=true" in message


def test_start_up_warns_with_allow_untested_megatron(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_bridge"), pytest.raises(_Started):
        _start_training(monkeypatch, ["parallel.allow_untested_megatron=true"])
    assert "megatron-core 0.15.0" in caplog.text and "parallel.allow_untested_megatron=true" in caplog.text


def test_inplace_multi_tensor_scale_gives_megatrons_bits():
    import torch
    from megatron.core.utils import local_multi_tensor_scale

    from megatron_bridge.patches.optimizer_state import inplace_multi_tensor_scale

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for n in (7, 1000, 4096)]
    for scale, dtype in ((0.3712, torch.float32), (0.3712, torch.bfloat16), (1.0, torch.bfloat16)):
        theirs = [torch.empty(g.shape, dtype=dtype) for g in grads]
        ours = [torch.empty(g.shape, dtype=dtype) for g in grads]
        local_multi_tensor_scale(0, None, [grads, theirs], scale)
        inplace_multi_tensor_scale(0, None, [grads, ours], scale)
        assert all(
            torch.equal(
                a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            )
            for a, b in zip(theirs, ours)
        ), (scale, dtype)
    # in place (the clipping: src is dst), as megatron's out of place
    expected = [g * 0.25 for g in grads]
    inplace_multi_tensor_scale(0, None, [grads, grads], 0.25)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
