"""The Qwen3-8B and Qwen3-30B-A3B configs: they validate (config checks, layout against the published
config.json shapes, batch splits) and the memory planner's figures quoted in their headers hold."""

import json
import os
import re

import pytest

from megatron_bridge.hf_config import ModelArgs
from megatron_bridge.parallel import ParallelDims
from rlstack.config import check_values, load_config
from rlstack.planner.build import plan_for_config
from rlstack.planner.memory import GIB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.path.join(ROOT, "rlstack", "planner", "model_configs")
# config -> (model config.json, world size, GPU GiB)
CONFIGS = {
    "qwen3_8b_8xa100.yaml": ("qwen3-8b.json", 8, 80),
    "qwen3_30b_a3b_multinode.yaml": ("qwen3-30b-a3b.json", 32, 80),
}


def _load(name):
    return load_config(os.path.join(ROOT, "yaml_configs", name))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_validates_for_its_model_and_world(name):
    model_file, world, _ = CONFIGS[name]
    cfg = _load(name)
    check_values(cfg)
    with open(os.path.join(ASSETS, model_file)) as f:
        args = ModelArgs.from_hf_config(json.load(f), model_file)
    p = cfg.parallel
    dims = ParallelDims.resolve(p.tp, p.pp, p.dp, world, ep=p.ep)
    dims.check_model(args)
    assert world % cfg.rollout.tp == 0 and 8 % p.tp == 0  # TP groups inside a node of 8 GPUs
    assert cfg.data.train_batch_size % dims.dp == 0
    if args.moe is not None:
        assert p.ep > 1 and p.tp * p.ep <= 8  # EP groups (all-to-all) inside a node too


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_planner_figures_in_the_header_hold(name):
    model_file, world, gib = CONFIGS[name]
    plan = plan_for_config(_load(name), world, gib, model_config_file=os.path.join(ASSETS, model_file))
    assert plan.fits
    with open(os.path.join(ROOT, "yaml_configs", name)) as f:
        header = f.read().split("\nmodel:")[0]
    quoted = float(re.search(r"peak ([\d.]+) GiB of 80", header).group(1))
    assert abs(plan.peak_bytes / GIB - quoted) < 0.01, (plan.peak_bytes / GIB, quoted)
    assert abs(plan.other_recompute_peak / GIB - quoted) > 1  # the header's other figure is the flipped one


def test_moe_parameters_and_ep():
    """Qwen3-30B-A3B: 30.5B parameters; EP2 holds half the experts per rank, the router on every rank."""
    from rlstack.planner import memory as m
    from rlstack.planner.shapes import shape_of

    with open(os.path.join(ASSETS, "qwen3-30b-a3b.json")) as f:
        args = ModelArgs.from_hf_config(json.load(f))
    assert abs(m.total_params(shape_of(args, 1)) / 1e9 - 30.53) < 0.01
    one, two = shape_of(args, 1, ep=1), shape_of(args, 1, ep=2)
    experts = 128 * 3 * 2048 * 768
    assert m.layer_params(one, 1) - m.layer_params(two, 1) == experts // 2
    assert m.stage_expert_params(two, 1, 1) == 48 * experts // 2
    assert m.total_params(two) == m.total_params(one)  # the engine holds every expert
