"""examples/: the reward file scores as its docstring says, the shipped parquet files are what
make_data.py writes, and the walkthrough's config validates (README: "Your own data and reward")."""

import importlib.util
import os
import sys

import pyarrow.parquet as pq

from rlstack.config import load_config
from rlstack.preflight import preflight
from rlstack.rewards.custom import load_custom_reward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def test_the_example_reward():
    fn = load_custom_reward(os.path.join(EXAMPLES, "reward.py"))
    score = lambda text, truth="5", **kw: fn(data_source="letter_count", solution_str=text, ground_truth=truth, **kw)  # noqa: E731
    assert score("It has 5 letters.") == {"score": 1.0, "answered": 1.0}
    assert score("Maybe 4, no: 5") == {"score": 1.0, "answered": 1.0}  # the last number is the answer
    assert score("5 letters? No, 6.") == {"score": 0.1, "answered": 1.0}
    assert score("6", partial_credit=0.0) == {"score": 0.0, "answered": 1.0}  # data.reward_kwargs
    assert score("five") == {"score": 0.0, "answered": 0.0}


def test_the_shipped_parquet_is_what_make_data_writes(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_data", os.path.join(EXAMPLES, "make_data.py"))
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    monkeypatch.setattr(sys, "argv", ["make_data.py", "--out", str(tmp_path)])
    make_data.main()
    for split in ("train", "val"):
        shipped = pq.read_table(os.path.join(EXAMPLES, "data", f"{split}.parquet")).to_pylist()
        assert shipped == pq.read_table(tmp_path / f"{split}.parquet").to_pylist()
        assert shipped and all(row["data_source"] == "letter_count" for row in shipped)


def test_the_walkthrough_config_validates(tmp_path, monkeypatch):
    """The checks of --validate-only (preflight): data rows, the reward file and function, the layout."""
    monkeypatch.chdir(ROOT)  # the config's paths are relative to the checkout, as in the README
    cfg = load_config("examples/grpo_own_data.yaml", ["model.path=tiny", f"trainer.output_dir={tmp_path / 'out'}"])
    assert preflight(cfg, 2).data_sources == ["letter_count"]
