"""Every YAML file in yaml_configs/ parses and validates against the config tree; the GPU configs'
layouts are valid for their models and world sizes, and their batches split evenly."""

import glob
import json
import os

import pytest

from megatron_bridge.hf_config import ModelArgs
from megatron_bridge.parallel import ParallelDims
from rlstack.config import adv_estimator, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(ROOT, "yaml_configs")
ALL_CONFIGS = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.yaml")))


# Shapes from the models' HF config.json (vocab before Megatron's padding).
def _args(name):
    with open(os.path.join(ROOT, "rlstack", "planner", "model_configs", name)) as f:
        return ModelArgs.from_hf_config(json.load(f), name)


QWEN2_0P5B = _args("qwen2-0.5b-instruct.json")
QWEN2_7B = _args("qwen2-7b-instruct.json")

# config file -> (model shape, world size it is written for)
GPU_CONFIGS = {
    "qwen2_0p5b_gsm8k_1gpu.yaml": (QWEN2_0P5B, 1),
    "qwen2_7b_gsm8k_8xa100.yaml": (QWEN2_7B, 8),
    "qwen2_7b_gsm8k_4node.yaml": (QWEN2_7B, 32),
}


def test_config_dir_holds_the_gpu_configs():
    names = {os.path.basename(p) for p in ALL_CONFIGS}
    assert set(GPU_CONFIGS) <= names


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=os.path.basename)
def test_every_yaml_config_loads(path):
    cfg = load_config(path)
    assert cfg.trainer.output_dir
    assert cfg.data.train_files or cfg.data.synthetic


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_layout_fits_model_and_world(name):
    shape, world_size = GPU_CONFIGS[name]
    cfg = load_config(os.path.join(CONFIG_DIR, name))
    p = cfg.parallel
    dims = ParallelDims.resolve(p.tp, p.pp, p.dp, world_size)
    dims.check_model(shape)
    # The rollout engine's tensor parallelism has the same divisibility rules, and its replicas
    # must tile the world.
    assert world_size % cfg.rollout.tp == 0
    assert shape.num_query_groups % cfg.rollout.tp == 0
    assert shape.num_attention_heads % cfg.rollout.tp == 0
    # TP groups must not span nodes (8 GPUs per node).
    assert p.tp <= 8


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_batches_split_evenly(name):
    shape, world_size = GPU_CONFIGS[name]
    cfg = load_config(os.path.join(CONFIG_DIR, name))
    dims = ParallelDims.resolve(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, world_size)
    a, d = cfg.algorithm, cfg.data
    sequences = d.train_batch_size * cfg.rollout.n
    assert d.train_batch_size % dims.dp == 0  # prompts per data-parallel rank
    assert sequences % a.mini_batch_size == 0  # whole optimizer steps per PPO epoch
    assert a.mini_batch_size % dims.dp == 0
    assert (a.mini_batch_size // dims.dp) % a.micro_batch_size == 0  # whole micro-batches per rank


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs_run_the_gsm8k_benchmark_setting(name):
    cfg = load_config(os.path.join(CONFIG_DIR, name))
    assert cfg.rollout.engine == "vllm"
    assert cfg.model.dtype == "bfloat16"
    assert cfg.data.max_prompt_length == 1024
    assert cfg.rollout.max_new_tokens == 512
    assert cfg.rollout.tp == cfg.parallel.tp  # the weight sync keeps each rank's shard
    assert cfg.data.train_files == ["data/gsm8k/train.parquet"]
    if adv_estimator(cfg) in ("grpo", "drgrpo", "rloo"):
        assert cfg.rollout.n >= 2


def test_4node_config_scales_the_8gpu_one_weakly():
    one = load_config(os.path.join(CONFIG_DIR, "qwen2_7b_gsm8k_8xa100.yaml"))
    four = load_config(os.path.join(CONFIG_DIR, "qwen2_7b_gsm8k_4node.yaml"))
    # Same per-rank work, 4x the data-parallel ranks: prompts and mini-batches scale by 4.
    assert four.data.train_batch_size == 4 * one.data.train_batch_size
    assert four.algorithm.mini_batch_size == 4 * one.algorithm.mini_batch_size
    assert four.algorithm.micro_batch_size == one.algorithm.micro_batch_size
    assert (four.parallel.tp, four.parallel.pp) == (one.parallel.tp, one.parallel.pp)
