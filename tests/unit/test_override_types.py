"""Overrides and config files read against the key's type: a str key keeps the text as written,
numbers and booleans parse as YAML reads them, and a reading that changes a value's meaning
(octal, base 60, a date) is refused for a non-str key, naming the key."""

import pytest

from rlstack.config import ConfigError, load_config

BASE = ["data.synthetic=arith"]


@pytest.mark.parametrize("text", ["010", "2024-12-06", "yes", "1e-3", "1.0e-3", "1:30", "0x10", "off", "null-ish"])
def test_a_str_key_keeps_the_text_as_written(text):
    cfg = load_config(None, BASE + [f"logging.run_name={text}"])
    assert cfg.logging.run_name == text


def test_an_optional_str_key_and_a_str_list_keep_the_text():
    cfg = load_config(None, BASE + ["model.critic_path=010", "logging.trackers=[console,jsonl]"])
    assert cfg.model.critic_path == "010"
    cfg = load_config(None, ["data.train_files=[2024-12-06.parquet,010]"])
    assert cfg.data.train_files == ["2024-12-06.parquet", "010"]
    cfg = load_config(None, ["data.train_files=2024-12-06"])  # one path where a list is expected
    assert cfg.data.train_files == ["2024-12-06"]


@pytest.mark.parametrize(
    ("text", "value"), [("1e-3", 1e-3), ("1.0e-3", 1e-3), ("5", 5.0), ("0x10", 16.0), ("0.5", 0.5), ("+2", 2.0)]
)
def test_numbers_for_a_float_key_parse_as_before(text, value):
    assert load_config(None, BASE + [f"algorithm.actor_lr={text}"]).algorithm.actor_lr == value


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("010", "leading zero as octal (8); write 10"),
        ("2024-12-06", "reads as a date"),
        ("yes", "'yes', which YAML reads as True"),
        ("1:30", "base 60 (90)"),
    ],
)
def test_a_float_key_refuses_a_reading_that_changes_meaning(text, says):
    with pytest.raises(ConfigError, match="'algorithm.actor_lr'") as e:
        load_config(None, BASE + [f"algorithm.actor_lr={text}"])
    assert says in str(e.value)


@pytest.mark.parametrize("text", ["010", "2024-12-06", "yes", "1e-3"])
def test_an_int_key_refuses_them_too(text):
    with pytest.raises(ConfigError, match="'trainer.total_steps'"):
        load_config(None, BASE + [f"trainer.total_steps={text}"])


def test_booleans_and_lists_parse_as_before():
    cfg = load_config(None, BASE + ["data.shuffle=no", "model.recompute_modules=[layernorm]"])
    assert cfg.data.shuffle is False and cfg.model.recompute_modules == ["layernorm"]
    cfg = load_config(None, BASE + ["data.shuffle=on", "trainer.total_steps=0x10", "trainer.total_steps=12"])
    assert cfg.data.shuffle is True and cfg.trainer.total_steps == 12


def test_free_form_mappings_keep_yaml_values():
    cfg = load_config(None, BASE + ["data.reward_kwargs={scale: 2, strict: yes, tag: 010}"])
    assert cfg.data.reward_kwargs == {"scale": 2, "strict": True, "tag": 8}  # no type to read them against


def test_a_config_file_reads_the_same_way(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  synthetic: arith\nlogging:\n  run_name: 010\n  project: 2024-12-06\n")
    cfg = load_config(str(path))
    assert cfg.logging.run_name == "010" and cfg.logging.project == "2024-12-06"
    path.write_text("data:\n  synthetic: arith\ntrainer:\n  total_steps: 010\n")
    with pytest.raises(ConfigError, match="'trainer.total_steps' is 010: YAML reads a leading zero as octal"):
        load_config(str(path))
    path.write_text("data:\n  synthetic: arith\nlogging:\n  run_name: '010'\n")  # quoted: a string anyway
    assert load_config(str(path)).logging.run_name == "010"
