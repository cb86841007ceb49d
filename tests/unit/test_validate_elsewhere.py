"""A GPU config checked on any machine: `--validate-only --model-config` (a config.json or a shipped
model name) plans for the GPUs the config targets and exits 1 when it does not fit; a model
directory or data file that is not here is a warning. Every shipped GPU config, on this CPU box."""

import glob
import os
import re

import pytest
import yaml

from rlstack import plan, train
from rlstack.planner.shapes import resolve_model_config, shipped_model_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "yaml_configs", "qwen*.yaml")))
# the model each config names, as a hub name (its model.path is a directory on the cluster)
MODELS = {
    "qwen2_0p5b_gsm8k_1gpu.yaml": "Qwen/Qwen2-0.5B-Instruct",
    "qwen2_7b_gsm8k_8xa100.yaml": "Qwen/Qwen2-7B-Instruct",
    "qwen2_7b_gsm8k_4node.yaml": "Qwen/Qwen2-7B-Instruct",
    "qwen3_8b_8xa100.yaml": "Qwen/Qwen3-8B",
    "qwen3_30b_a3b_multinode.yaml": "Qwen/Qwen3-30B-A3B",
}
WORLD = {"1gpu": 1, "8xa100": 8, "4node": 32, "multinode": 32}  # the launch each file's name and header give


def _world(path):
    return next(n for tag, n in WORLD.items() if tag in os.path.basename(path))


def test_every_gpu_config_has_a_model():
    assert [os.path.basename(p) for p in GPU_CONFIGS] == sorted(MODELS)  # a new GPU config needs a row here


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=os.path.basename)
def test_validate_only_with_a_model_config_on_this_machine(path, capfd, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the configs' relative data and output paths: not here
    with open(path) as f:
        raw = yaml.safe_load(f)
    target = raw["parallel"]["gpu_memory_gib"]
    assert not os.path.exists(raw["model"]["path"])  # a cluster path
    args = ["--config", path, "--validate-only", "--world-size", str(_world(path))]
    assert train.main([*args, "--model-config", MODELS[os.path.basename(path)]]) == 0
    out, warned = capfd.readouterr()
    assert "config ok" in out
    assert f"of {target:.2f} GiB" in out  # planned for the config's GPU, not this machine's memory
    assert f"model.path={raw['model']['path']} is not on this machine" in warned
    assert "data.train_files" in warned and "is not on this machine" in warned
    # a smaller GPU than the config's does not fit: exit 1
    assert train.main([*args, "--model-config", MODELS[os.path.basename(path)], "--gpu-memory-gib", "8"]) == 1
    assert "does not fit" in capfd.readouterr().out
    # without --model-config the missing model stays an error (exit 2) that names the flag
    with pytest.raises(SystemExit) as stop:
        train.main(args)
    assert stop.value.code == 2 and "--model-config FILE|NAME" in capfd.readouterr().err


def test_plan_uses_the_configs_gpu_and_a_shipped_name():
    path = os.path.join(ROOT, "yaml_configs", "qwen2_7b_gsm8k_8xa100.yaml")
    assert plan.main(["--config", path, "--world-size", "8", "--model-config", "Qwen/Qwen2-7B-Instruct"]) == 0
    assert plan.main(["--config", path, "--world-size", "8", "--model-config", "qwen2-7b-instruct", "--json"]) == 0
    tiny = os.path.join(ROOT, "yaml_configs", "tiny_cpu.yaml")
    assert plan.main(["--config", tiny, "--world-size", "2"]) == 2  # no target GPU named anywhere
    assert (
        plan.main(
            ["--config", path, "--world-size", "8", "--model-config", "Qwen/Qwen2-7B-Instruct", "--device", "cpu"]
        )
        == 2
    )  # a CPU rank's memory is not the config's GPU


def test_model_config_names_and_files(tmp_path):
    shipped = resolve_model_config("Qwen/Qwen3-8B")
    assert os.path.basename(shipped) == "qwen3-8b.json" and "qwen3-8b" in shipped_model_names()
    mine = tmp_path / "config.json"
    mine.write_text("{}")
    assert resolve_model_config(str(mine)) == str(mine) and resolve_model_config(str(tmp_path)) == str(mine)
    from rlstack.errors import UserError

    with pytest.raises(UserError, match="qwen2-7b-instruct"):  # the message lists what ships
        resolve_model_config("Qwen/Qwen9-1T")


def test_model_config_is_for_validate_only():
    path = os.path.join(ROOT, "yaml_configs", "tiny_cpu.yaml")
    with pytest.raises(SystemExit) as stop:
        train.main(["--config", path, "--model-config", "Qwen/Qwen3-8B"])
    assert stop.value.code == 2


TABLE_ROW = re.compile(r"^\| `(qwen\S+\.yaml)`[^|]*\| (\d+) \| \**([\d.]+) GiB")


@pytest.mark.parametrize("doc", ["README.md", "docs/planner.md"])
def test_the_docs_gpu_config_tables_are_the_planners(doc):
    """README's and docs/planner.md's peak per GPU of each shipped GPU config: the planner's figure."""
    from rlstack.config import load_config
    from rlstack.planner import plan_for_config

    with open(os.path.join(ROOT, doc)) as f:
        rows = [m.groups() for m in map(TABLE_ROW.match, f) if m]
    assert sorted(name for name, _, _ in rows) == sorted(MODELS)  # every shipped GPU config, once
    for name, world, quoted in rows:
        cfg = load_config(os.path.join(ROOT, "yaml_configs", name))
        plan = plan_for_config(cfg, int(world), cfg.parallel.gpu_memory_gib, model_config_file=MODELS[name])
        assert abs(plan.peak_bytes / 1024**3 - float(quoted)) < 0.05, (doc, name, plan.peak_bytes / 1024**3, quoted)
