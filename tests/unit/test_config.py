"""Config tree: YAML round trip, overrides, and every error message with its fix."""

import subprocess
import sys

import pytest
import yaml

from megatron_bridge.hf_config import ModelArgs
from megatron_bridge.parallel import ParallelDims
from rlstack.config import ConfigError, ExperimentConfig, from_dict, load_config, to_dict, to_yaml
from rlstack.parallel import check_layout
from rlstack.planner.shapes import SMOLLM2_135M_CONFIG


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_round_trip(tmp_path):
    cfg = load_config("yaml_configs/tiny_cpu.yaml", ["rollout.n=3", "data.train_files=[a.parquet,b.parquet]"])
    again = from_dict(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg
    assert cfg.rollout.n == 3 and cfg.data.train_files == ["a.parquet", "b.parquet"]


def test_overrides_are_typed():
    cfg = load_config(
        "yaml_configs/tiny_cpu.yaml",
        [
            "algorithm.actor_lr=1e-6",
            "trainer.total_steps=7",
            "logging.trackers=[console,tensorboard]",
            "model.cache_dir=null",
        ],
    )
    assert cfg.algorithm.actor_lr == 1e-6 and isinstance(cfg.algorithm.actor_lr, float)
    assert cfg.trainer.total_steps == 7
    assert cfg.logging.trackers == ["console", "tensorboard"]
    assert cfg.model.cache_dir is None


def test_single_path_becomes_list():
    cfg = load_config("yaml_configs/tiny_cpu.yaml", ["data.train_files=x.parquet"])
    assert cfg.data.train_files == ["x.parquet"]


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.tempreature=1", "did you mean 'rollout.temperature'"),
        ("algoritm.name=ppo", "did you mean 'algorithm"),
        ("trainer.total_steps=abc", "'trainer.total_steps' expects int"),
        ("rollout.temperature=hot", "'rollout.temperature' expects float"),
        ("algorithm.use_kl_loss=3", "expects bool"),
        ("rollout.engine=sglang", "choose one of 'hf', 'vllm'"),
        ("logging.trackers=[console,neptune]", "unknown tracker 'neptune'"),
        ("trainer.total_steps=0", "must be at least 1"),
        ("rollout.n", "is not key=value"),
        ("rollout=3", "must be a section"),
        ("model.recompute_modules=[layernorm,attn]", "'model.recompute_modules' has unknown module 'attn'"),
    ],
)
def test_override_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config("yaml_configs/tiny_cpu.yaml", [override])


def test_selective_and_full_recompute_are_one_choice():
    cfg = load_config("yaml_configs/tiny_cpu.yaml", ["model.recompute_modules=[layernorm,mlp]"])
    assert cfg.model.recompute_modules == ["layernorm", "mlp"]
    with pytest.raises(ConfigError, match="'mlp' rebuilds the whole MLP, keep one"):
        load_config("yaml_configs/tiny_cpu.yaml", ["model.recompute_modules=[mlp,mlp_act]"])
    with pytest.raises(ConfigError, match="set one of them"):
        load_config(
            "yaml_configs/tiny_cpu.yaml", ["model.recompute_modules=[mlp]", "model.gradient_checkpointing=true"]
        )


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="line [23] is not valid YAML"):
        load_config(_write(tmp_path, "model:\n  path: [unclosed\n"))
    with pytest.raises(ConfigError, match="no training data"):
        load_config(_write(tmp_path, "model: {path: tiny}\n"))
    with pytest.raises(ConfigError, match="need groups: set rollout.n >= 2"):
        load_config(_write(tmp_path, "data: {synthetic: copy}\nrollout: {n: 1}\n"))


def test_parallel_sizes_name_the_fix():
    with pytest.raises(ValueError, match="not divisible by parallel.tp \\* parallel.pp"):
        ParallelDims.resolve(2, 2, -1, 6)
    with pytest.raises(ValueError, match="set parallel.dp=2"):
        ParallelDims.resolve(1, 1, 4, 2)
    dims = ParallelDims.resolve(2, 1, -1, 4)
    assert dims.dp == 2
    shape = ModelArgs.from_hf_config(SMOLLM2_135M_CONFIG)
    with pytest.raises(
        ValueError, match=r"does not divide the model's 9 attention heads: choose parallel.tp from \[1, 3\]"
    ):
        ParallelDims.resolve(2, 1, -1, 2).check_model(shape)
    with pytest.raises(ValueError, match=r"parallel.pp=4 does not divide the model's 30 layers"):
        ParallelDims.resolve(1, 4, -1, 4).check_model(shape)
    with pytest.raises(ValueError, match="key/value heads"):
        ParallelDims.resolve(4, 1, -1, 4).check_model(
            ModelArgs.from_hf_config(
                dict(SMOLLM2_135M_CONFIG, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
            )
        )


def test_check_layout_batch_divides_dp():
    cfg = load_config("yaml_configs/tiny_cpu.yaml", ["data.train_batch_size=3"])
    with pytest.raises(ValueError, match="make it a multiple of 2"):
        check_layout(cfg, 2)


def test_defaults_are_a_valid_tree():
    assert isinstance(to_dict(ExperimentConfig()), dict)


def test_validate_only_cli_one_line_error():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlstack.train",
            "--config",
            "yaml_configs/tiny_cpu.yaml",
            "rollout.tempreature=1",
            "--validate-only",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == ["error: unknown config key 'rollout.tempreature': did you mean 'rollout.temperature'?"]


def test_import_rlstack_is_light():
    code = (
        "import sys, rlstack, rlstack.config, rlstack.parallel; "
        "bad = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_host_mmap_threshold_is_set_and_range_checked():
    import platform

    from rlstack.host_memory import set_mmap_threshold, trim_heap

    assert set_mmap_threshold(0) is False  # 0 leaves glibc's default alone
    if platform.libc_ver()[0] == "glibc":
        assert set_mmap_threshold(256) is True
    with pytest.raises(ConfigError, match="host_mmap_threshold_kb"):
        load_config(None, ["parallel.host_mmap_threshold_kb=65536"])
    assert trim_heap() in (True, False)  # callable everywhere; what it frees is checked below


TRIM_PROBE = """
import os
from rlstack.host_memory import trim_heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blocks = [bytearray(100_000) for _ in range(3000)]  # 300 MB from the heap (below the mmap threshold)
keep = blocks[::10]  # every 10th stays: the freed ones are holes the heap cannot shrink past
del blocks
before = rss()
assert trim_heap()
print((before - rss()) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_heap_gives_freed_pages_back():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, check=True)
    assert float(out.stdout) > 200, out.stdout  # of the 270 MB of holes


def test_token_budget_needs_room_for_the_longest_row_and_no_pipeline():
    base = "yaml_configs/tiny_cpu.yaml"
    cfg = load_config(base, ["algorithm.max_tokens_per_micro_batch=4096"])
    assert cfg.algorithm.max_tokens_per_micro_batch == 4096
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    with pytest.raises(ConfigError, match=f"set it to at least {longest}"):
        load_config(base, [f"algorithm.max_tokens_per_micro_batch={longest - 1}"])
    with pytest.raises(ConfigError, match="needs parallel.pp=1"):
        load_config(base, ["algorithm.max_tokens_per_micro_batch=4096", "parallel.pp=2"])
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_config(base, ["algorithm.max_tokens_per_micro_batch=-1"])
