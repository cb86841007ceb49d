"""from_verl: verl 0.9.1's LoRA keys (FSDP spelling and Megatron-Bridge's `lora.*`) -> model.lora / critic.lora."""

from __future__ import annotations

import pytest
import yaml

from rlstack import from_verl
from rlstack.config import ConfigError, load_config

M = "actor_rollout_ref.model."


def _values(t, prefix):
    return {k: v for k, v in t.values.items() if k.startswith(prefix)}


def test_fsdp_keys_with_hf_module_names():
    t = from_verl.translate(
        {M + "lora_rank": 16, M + "lora_alpha": 32, M + "target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"]}
    )
    assert _values(t, "model.lora") == {
        "model.lora.rank": 16,
        "model.lora.alpha": 32.0,
        "model.lora.target_modules": ["linear_qkv", "linear_fc2"],
    }
    assert t.sources["model.lora.rank"] == f"verl {M}lora_rank=16"
    assert not [u for u in t.unsupported if "lora" in u[0] or "proj" in u[0]]


def test_partial_fused_targets_and_unknown_names_are_unsupported():
    t = from_verl.translate({M + "lora_rank": 8, M + "target_modules": ["q_proj", "v_proj", "lm_head"]})
    assert t.values["model.lora.target_modules"] == ["linear_qkv"]
    reasons = dict(t.unsupported)
    assert reasons[f"{M}target_modules: q_proj, v_proj"].startswith("rlstack adapts the fused linear_qkv")
    assert f"{M}target_modules: lm_head" in reasons


def test_megatron_lora_section_wins_and_brings_verl_defaults():
    t = from_verl.translate(
        {
            M + "lora_rank": 4,
            M + "lora.rank": 32,
            M + "lora.dropout": 0.05,
            M + "lora.target_modules": ["linear_qkv", "linear_proj"],
            M + "lora.lora_A_init_method": "kaiming",
            "critic.model.lora.rank": 8,
            "critic.model.lora.alpha": 8,
        }
    )
    assert _values(t, "model.lora") == {
        "model.lora.rank": 32,
        "model.lora.alpha": 32.0,  # verl's megatron default, written out
        "model.lora.dropout": 0.05,
        "model.lora.target_modules": ["linear_qkv", "linear_proj"],
        "model.lora.init": "kaiming",
    }
    assert t.sources["model.lora.alpha"] == f"verl's default {M}lora.alpha=32"
    assert _values(t, "critic.lora") == {"critic.lora.rank": 8, "critic.lora.alpha": 8.0}


def test_settings_rlstack_cannot_reproduce():
    t = from_verl.translate({M + "lora.rank": 8, M + "lora.type": "dora", M + "lora.lora_B_init_method": "xavier"})
    items = [item for item, _ in t.unsupported]
    assert f"{M}lora.type=dora" in items and f"{M}lora.lora_B_init_method=xavier" in items


def test_translated_yaml_loads(tmp_path):
    t = from_verl.translate({M + "lora_rank": 8, M + "target_modules": "all-linear", "data.train_batch_size": 4})
    path = tmp_path / "lora.yaml"
    path.write_text(from_verl.to_yaml_text(t))
    raw = yaml.safe_load(path.read_text())
    assert raw["model"]["lora"] == {"rank": 8, "target_modules": "all-linear"}
    cfg = load_config(str(path), ["data.synthetic=arith"])
    assert cfg.model.lora.rank == 8 and cfg.model.lora.target_modules == ["all-linear"]


@pytest.mark.parametrize(
    "key, name", [(M + "lora_rank=8", "model.lora.rank"), (M + "lora.alpha=8", "model.lora.alpha")]
)
def test_config_hint_names_the_lora_key(key, name):
    with pytest.raises(ConfigError, match=f"rlstack's is {name}"):
        load_config(None, ["data.synthetic=arith", key])
