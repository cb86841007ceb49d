"""Every config value check that needs no loaded model runs in preflight (what --validate-only runs):
a table of bad values, each set on a loaded tree behind the loader's back, -> the key in the error."""

from __future__ import annotations

import os

import pytest

from megatron_bridge.errors import InputError as UserError  # the base of every user-error type
from rlstack.config import load_config
from rlstack.preflight import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yaml_configs", "tiny_cpu.yaml")

# (key = bad value, world size, the key the one-line error must name); other settings as needed
BAD = [
    # rollout settings once found only when the engine was built (after the models loaded)
    ({"rollout.verify_sync": -1}, 2, "rollout.verify_sync"),
    ({"rollout.verify_sync_tol": 0.0}, 2, "rollout.verify_sync_tol"),
    ({"rollout.tp": 2}, 2, "rollout.tp"),  # the hf engine runs one full model per rank
    ({"rollout.engine": "vllm", "rollout.tp": 3}, 2, "rollout.tp"),  # colocated: divides the world
    ({"rollout.tp": 2, "placement.rollout_ranks": 1}, 4, "rollout.tp"),  # split: divides the rollout ranks
    ({"rollout.top_k": 0}, 2, "rollout.top_k"),
    ({"rollout.engine": "sglang"}, 2, "rollout.engine"),
    # data: once found when the datasets and the sampler were built
    ({"data.synthetic_train_size": 0}, 2, "data.synthetic_train_size"),
    ({"data.synthetic_train_size": 8}, 2, "data.train_batch_size"),
    ({"data.train_batch_size": 3}, 2, "data.train_batch_size"),
    # the config tree's own checks (rlstack.config.check_values), run again by preflight
    ({"rollout.top_p": 0.0}, 2, "rollout.top_p"),
    ({"rollout.temperature": 0.0}, 2, "rollout.temperature"),
    ({"rollout.n": 0}, 2, "rollout.n"),
    ({"rollout.sync_bucket_mb": 0}, 2, "rollout.sync_bucket_mb"),
    ({"rollout.free_cache_during_update": True}, 2, "rollout.free_cache_during_update"),
    ({"algorithm.clip_ratio_c": 1.0}, 2, "algorithm.clip_ratio_c"),
    ({"algorithm.max_tokens_per_micro_batch": -1}, 2, "algorithm.max_tokens_per_micro_batch"),
    ({"algorithm.name": "dpo"}, 2, "algorithm.name"),
    ({"model.recompute_modules": ["attn"]}, 2, "model.recompute_modules"),
    ({"logging.trackers": ["neptune"]}, 2, "logging.trackers"),
    ({"reward_model.clip": -1.0}, 2, "reward_model.clip"),
    ({"data.reward_scorer": "nope"}, 2, "data.reward_scorer"),
    # the layout against the world
    ({"parallel.tp": 3}, 2, "parallel.tp"),
    ({"placement.rollout_ranks": 2}, 2, "placement.rollout_ranks"),
    ({"rollout.staleness": 1}, 2, "placement.rollout_ranks"),
]


def _set(cfg, key: str, value) -> None:
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)


@pytest.mark.parametrize("values, world, key", BAD, ids=[",".join(v) for v, _, _ in BAD])
def test_preflight_names_the_key_of_a_bad_value(tmp_path, values, world, key):
    cfg = load_config(TINY, [f"trainer.output_dir={tmp_path / 'out'}"])
    preflight(cfg, world_size=world)  # the tree as loaded passes
    for k, v in values.items():
        _set(cfg, k, v)
    with pytest.raises(UserError) as e:
        preflight(cfg, world_size=world)
    message = str(e.value)
    assert key in message and "\n" not in message, message
