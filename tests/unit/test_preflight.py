"""--validate-only checks everything a run needs (the run calls the same `preflight`): each mistake
is one line naming the file or key and the fix; nothing starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_bridge.errors import InputError as UserError  # the base of every user-error type
from rlstack.config import load_config, timeout_minutes
from rlstack.preflight import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yaml_configs", "tiny_cpu.yaml")


def _check(tmp_path, *overrides):
    cfg = load_config(TINY, [f"trainer.output_dir={tmp_path / 'out'}", *overrides])
    return preflight(cfg, world_size=2)


def _validate(*args):
    """The CLI as a user runs it; returns (exit code, the lines it printed)."""
    proc = subprocess.run(
        [sys.executable, "-m", "rlstack.train", "--validate-only", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        # an empty hub cache: a hub id must not resolve to whatever this machine has cached
        env=dict(os.environ, HF_HUB_CACHE=os.path.join(ROOT, "tests", "assets", "no-hub-cache")),
    )
    return proc.returncode, [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def _model_dir(tmp_path, config=None, files=("tokenizer.json", "model.safetensors")):
    path = tmp_path / "model"
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for name in files:
        (path / name).write_text("x")
    return str(path)


FULL = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
}


def test_a_good_config_passes(tmp_path):
    found = _check(tmp_path)
    assert found.dims.dp == 2 and found.data_sources == ["copy"] and found.resume_from == ""


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.train_files=[/nonexistent/train.parquet]", "data file /nonexistent/train.parquet does not exist"),
        ("model.path=/nonexistent/model", "model.path=/nonexistent/model does not exist"),
        ("model.path=Qwen/Qwen3-0.6B", "rlstack never downloads models"),
        ("data.reward_fn_file=/nonexistent/reward.py", "reward file /nonexistent/reward.py does not exist"),
        ("rollout.temperature=0", "for greedy decoding set rollout.top_k=1"),
        ("rollout.top_p=1.5", "'rollout.top_p' is 1.5: it must be in (0, 1]"),
        ("algorithm.actor_lr=0", "'algorithm.actor_lr' is 0.0: it must be > 0"),
        ("algorithm.critic_lr=-1", "'algorithm.critic_lr' is -1.0: it must be > 0"),
    ],
)
def test_what_a_run_needs_is_checked_before_it_starts(tmp_path, override, message):
    code, lines = _validate("--config", TINY, f"trainer.output_dir={tmp_path / 'out'}", override)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and message in lines[0], lines


def test_bad_data_file_rows_are_named(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"data_source": "copy", "prompt": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(UserError, match=r"train\.jsonl row 0.*reward_model"):
        _check(tmp_path, f"data.train_files=[{data}]")


def test_reward_function_must_exist(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(UserError, match="has no function 'compute_score'"):
        _check(tmp_path, f"data.reward_fn_file={reward}")


def test_model_directory_needs_a_sound_config_and_tokenizer(tmp_path):
    with pytest.raises(UserError, match=r"config\.json is not valid JSON"):
        _check(tmp_path, f"model.path={_model_dir(tmp_path, '{not json')}")


@pytest.mark.parametrize(
    "config,files,message",
    [
        (
            {k: v for k, v in FULL.items() if k != "num_attention_heads"},
            ("tokenizer.json", "model.safetensors"),
            "lacks 'num_attention_heads': it is incomplete",
        ),
        (FULL, ("model.safetensors",), "has no tokenizer files"),
        (FULL, ("tokenizer.json",), "has no model.safetensors"),
        (None, ("tokenizer.json",), "has no config.json"),
    ],
)
def test_incomplete_model_directory(tmp_path, config, files, message):
    with pytest.raises(UserError, match=message):
        _check(tmp_path, f"model.path={_model_dir(tmp_path, config, files)}")


def test_output_dir_under_a_file(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    code, lines = _validate("--config", TINY, f"trainer.output_dir={blocker}/run")
    assert code == 2 and lines == [
        f"error: trainer.output_dir={blocker}/run: {blocker} is a file, so the "
        "directory cannot be created there: choose another trainer.output_dir"
    ]


def test_config_that_is_a_directory_or_binary(tmp_path):
    assert _validate("--config", str(tmp_path))[1] == [
        f"error: config file {tmp_path} is a directory: pass a YAML file to --config (e.g. yaml_configs/X.yaml)"
    ]
    binary = tmp_path / "x.yaml"
    binary.write_bytes(bytes(range(256)))
    assert _validate("--config", str(binary))[1] == [
        f"error: config file {binary} is not a text file: pass a YAML file to --config"
    ]


def test_earlier_metrics_without_checkpoints_are_not_appended_to(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(UserError, match="holds an earlier run .*metrics.jsonl.*trainer.overwrite=true"):
        _check(tmp_path)
    assert _check(tmp_path, "trainer.overwrite=true").resume_from == ""


def test_did_you_mean_says_when_the_key_has_no_effect():
    with pytest.raises(UserError) as e:
        load_config(TINY, ["algorithm.kl_coeff=0.1"])
    assert str(e.value) == (
        "unknown config key 'algorithm.kl_coeff': did you mean 'algorithm.kl_coef'? (note: "
        "algorithm.kl_coef has no effect while algorithm.use_kl_in_reward=false; this config "
        "uses algorithm.kl_loss_coef (the KL loss; use_kl_loss))"
    )
    with pytest.raises(UserError) as e:
        load_config(TINY, ["algorithm.use_kl_in_reward=true", "algorithm.kl_coeff=0.1"])
    assert "note:" not in str(e.value)


def test_collective_timeout_is_minutes_not_half_an_hour_on_cpu():
    cfg = load_config(TINY)
    assert timeout_minutes(cfg, on_gpu=False) == 10 and timeout_minutes(cfg, on_gpu=True) == 30
    assert timeout_minutes(load_config(TINY, ["parallel.timeout_minutes=0.5"]), on_gpu=False) == 0.5


def test_export_refuses_a_non_empty_directory_without_force(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    proc = subprocess.run(
        [sys.executable, "-m", "rlstack.export", "--ckpt", str(tmp_path / "nothing"), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --out {out} is not empty: choose a new directory, or pass --force to write into it"
    )
    assert (out / "config.json").read_text() == "{}"


def test_latest_pointer_file_is_a_valid_ckpt_argument(tmp_path):
    from rlstack.checkpoint import LATEST, resolve_path, write_marker

    root = tmp_path / "checkpoints"
    for step in (1, 2):
        path = root / f"step_{step:08d}"
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))
        write_marker(str(path), step)
    (root / LATEST).write_text("step_00000001\n")
    assert resolve_path(str(root / LATEST), "--ckpt") == str(root / "step_00000001")
    assert resolve_path(str(root), "--ckpt") == str(root / "step_00000002")
