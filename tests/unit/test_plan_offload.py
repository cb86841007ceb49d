"""The memory planner accounts for each offload switch: GPU-resident bytes drop, per phase, by exactly
what rlstack/workers/offload.py moves to the host in that phase (and nothing drops on CPU)."""

import os

import pytest

from rlstack.config import load_config
from rlstack.planner import plan_for_config
from rlstack.planner.build import candidate_changes
from rlstack.planner.items import PHASES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN_7B = os.path.join(ROOT, "rlstack", "planner", "model_configs", "qwen2-7b-instruct.json")
CFG_7B = os.path.join(ROOT, "yaml_configs", "qwen2_7b_gsm8k_8xa100.yaml")


def _plan(*overrides, device="gpu"):
    cfg = load_config(CFG_7B, list(overrides))
    return plan_for_config(cfg, 8, 80, device=device, model_config_file=QWEN_7B, suggest=False)


def _line(plan, role, prefix):
    return next(i for i in plan.items if i.role == role and i.name.startswith(prefix))


# switch -> (role, line prefix, phases in which it stays on the GPU)
CASES = {
    "offload.optimizer": ("actor", "optimizer (", {"update", "step"}),
    "offload.grads": ("actor", "gradients (", {"update", "step"}),
    "offload.params": ("actor", "weights (", {"scoring", "update", "step"}),
    "offload.reference": ("reference", "weights (", {"scoring"}),
}


@pytest.mark.parametrize("switch", sorted(CASES))
def test_each_switch_drops_its_bytes_where_unused(switch):
    base = _plan("algorithm.use_kl_loss=true")
    moved = _plan("algorithm.use_kl_loss=true", f"{switch}=true")
    role, prefix, kept = CASES[switch]
    size = _line(base, role, prefix).at("update" if role != "reference" else "scoring")
    assert size > 0
    line = _line(moved, role, prefix)
    assert f"[{switch}:" in line.name
    for phase in PHASES:
        assert line.at(phase) == (size if phase in kept else 0), (switch, phase)
        # The phase total drops by that line alone, give or take the 5% allocator headroom over it.
        drop = base.total(phase) - moved.total(phase)
        expected = 0 if phase in kept else size
        assert expected <= drop <= 1.06 * expected, (switch, phase, drop, expected)


def test_free_cache_during_update_frees_the_vllm_share_outside_the_rollout():
    base = _plan("rollout.engine=vllm")
    slept = _plan("rollout.engine=vllm", "rollout.free_cache_during_update=true")
    share = _line(base, "rollout", "vLLM share").at("update")
    line = _line(slept, "rollout", "vLLM share")
    assert line.at("rollout") == share and line.at("update") == line.at("scoring") == line.at("step") == 0
    assert base.total("update") - slept.total("update") == share


def test_on_cpu_nothing_drops():
    cfg = load_config(os.path.join(ROOT, "yaml_configs", "smollm2_arith_cpu.yaml"))
    plain = plan_for_config(cfg, 2, 24, device="cpu", suggest=False)
    for key in CASES:
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, True)
    offloaded = plan_for_config(cfg, 2, 24, device="cpu", suggest=False)
    assert [offloaded.total(p) for p in PHASES] == [plain.total(p) for p in PHASES]


def test_offload_is_suggested_on_gpu_only():
    cfg = load_config(CFG_7B, ["rollout.engine=vllm"])
    plan = _plan("rollout.engine=vllm")
    dims = type("Dims", (), {"dp": plan.dp})
    gpu = [next(iter(c)) for c in candidate_changes(cfg, plan.kv, dims, "gpu")]
    assert {"offload.optimizer", "offload.grads", "offload.params", "rollout.free_cache_during_update"} <= set(gpu)
    cpu = [next(iter(c)) for c in candidate_changes(cfg, plan.kv, dims, "cpu")]
    assert not any(k.startswith("offload.") for k in cpu)
