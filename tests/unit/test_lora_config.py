"""model.lora / critic.lora: the typed keys, and each mistake as one line naming the key and the fix
(config checks without a model; preflight's `check_lora` against the model's config.json)."""

from __future__ import annotations

import pytest

from megatron_bridge.errors import InputError as UserError
from rlstack.config import ConfigError, load_config
from rlstack.preflight import check_lora, lora_layer_dims
from tests.unit.test_preflight import FULL, TINY, _model_dir


def _cfg(*overrides):
    return load_config(TINY, list(overrides))


def test_defaults_are_off_and_keys_are_typed():
    cfg = _cfg()
    assert cfg.model.lora.rank == 0 and cfg.critic.lora.rank == 0
    cfg = _cfg("model.lora.rank=8", "model.lora.alpha=32", "model.lora.target_modules=[linear_qkv,linear_fc2]")
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (8, 32.0)
    assert cfg.model.lora.target_modules == ["linear_qkv", "linear_fc2"]
    assert _cfg("model.lora.target_modules=all-linear").model.lora.target_modules == ["all-linear"]
    assert _cfg("critic.lora.init=kaiming").critic.lora.init == "kaiming"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.lora.rank=-1", "'model.lora.rank' is -1: use 0 (LoRA off) or a positive rank"),
        ("model.lora.target_modules=[q_proj]", "'model.lora.target_modules' has unknown module 'q_proj'"),
        ("critic.lora.dropout=1.5", "'critic.lora.dropout' is 1.5: use a value in [0, 1)"),
        ("model.lora.alpha=0", "'model.lora.alpha' is 0.0: use a positive value"),
        ("model.lora.init=zeros", "'model.lora.init' is 'zeros': choose one of 'xavier', 'kaiming', 'gaussian'"),
    ],
)
def test_config_mistakes_name_the_key(override, message):
    section = override.split(".lora.")[0]
    extra = [f"{section}.lora.rank=4"] if "rank" not in override else []
    with pytest.raises(ConfigError) as e:
        _cfg(*extra, override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_rank_larger_than_a_layer_is_refused_naming_it(tmp_path):
    model = _model_dir(tmp_path, FULL)
    dims = lora_layer_dims(_args(model))
    assert dims["linear_qkv"] == (128, 128 + 2 * 64) and dims["linear_fc2"] == (256, 128)
    check_lora(_cfg(f"model.path={model}", "model.lora.rank=128"))  # fits every layer
    with pytest.raises(UserError, match=r"model.lora.rank=129 is larger than linear_qkv's dimensions \(256 x 128\)"):
        check_lora(_cfg(f"model.path={model}", "model.lora.rank=129"))
    with pytest.raises(
        UserError, match=r"critic.lora.rank=200 is larger than linear_fc2's .*set critic.lora.rank <= 128"
    ):
        check_lora(
            _cfg(
                f"model.path={model}",
                "algorithm.name=ppo",
                "critic.lora.rank=200",
                "critic.lora.target_modules=[linear_fc2]",
            )
        )


def _args(model):
    from megatron_bridge.hf_config import ModelArgs, read_hf_config

    return ModelArgs.from_hf_config(read_hf_config(model))


def test_settings_lora_cannot_combine_with(tmp_path):
    with pytest.raises(UserError, match="critic.lora.rank=4 but algorithm.name=grpo has no critic"):
        check_lora(_cfg("algorithm.name=grpo", "critic.lora.rank=4"))
    with pytest.raises(UserError, match="offload.reference=true with model.lora.*set offload.reference=false"):
        check_lora(_cfg("model.lora.rank=4", "offload.reference=true"))
    with pytest.raises(UserError, match="placement.rollout_ranks=1: the split sync does not send adapters"):
        check_lora(_cfg("model.lora.rank=4", "placement.rollout_ranks=1"))
    moe = dict(
        FULL,
        architectures=["Qwen3MoeForCausalLM"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        head_dim=32,
    )
    model = _model_dir(tmp_path, moe)
    with pytest.raises(UserError, match="model.lora.rank=4 with a MoE model: LoRA on routed experts"):
        check_lora(_cfg(f"model.path={model}", "model.lora.rank=4"))


def test_config_section_becomes_the_role_spec():
    from megatron_bridge.lora import TARGETS
    from rlstack.workers.megatron_role import lora_spec

    assert lora_spec(_cfg().model.lora) is None
    spec = lora_spec(_cfg("model.lora.rank=8", "model.lora.alpha=4").model.lora, seed=3)
    assert (spec.rank, spec.scale, spec.target_modules, spec.seed) == (8, 0.5, TARGETS, 3)
    spec = lora_spec(_cfg("critic.lora.rank=2", "critic.lora.target_modules=[linear_fc2,linear_qkv]").critic.lora)
    assert spec.target_modules == ("linear_qkv", "linear_fc2")


def test_resume_refuses_other_lora_settings():
    from types import SimpleNamespace

    from rlstack.checkpoint import CheckpointError, _check_lora_compatible, lora_record
    from rlstack.config import LoraConfig
    from rlstack.workers.megatron_role import lora_spec

    role = SimpleNamespace(lora=lora_spec(LoraConfig(rank=8), seed=1))
    record = lora_record(role, "/base")
    assert record["rank"] == 8 and record["base"] == "/base" and record["target_modules"][0] == "linear_qkv"
    assert lora_record(SimpleNamespace(lora=None), "/base") is None
    _check_lora_compatible("ck", "actor", record, lora_record(role, "/elsewhere"))  # the base may move
    other = lora_record(SimpleNamespace(lora=lora_spec(LoraConfig(rank=4), seed=1)), "/base")
    with pytest.raises(CheckpointError, match="holds the actor with LoRA .*'rank': 8.*same model.lora settings"):
        _check_lora_compatible("ck", "actor", record, other)
    with pytest.raises(CheckpointError, match="LoRA {'rank': 0}, this run has .*critic.lora"):
        _check_lora_compatible("ck", "critic", None, record)


def test_rollout_lora_sync_per_engine_and_vllm_rank():
    """rollout.lora_sync: auto = hf's measured default / vLLM's own LoRA path; vLLM's max_lora_rank
    is the smallest rank it accepts; above 512 its LoRA path is refused at preflight (merged is not)."""
    from rlstack.rollout.lora_sync import HF_DEFAULT, lora_sync_mode, vllm_lora_rank
    from rlstack.rollout.vllm_engine import vllm_max_lora_rank

    assert lora_sync_mode(_cfg().rollout) == HF_DEFAULT
    assert lora_sync_mode(_cfg("rollout.engine=vllm").rollout) == "adapters"
    assert lora_sync_mode(_cfg("rollout.engine=vllm", "rollout.lora_sync=merged").rollout) == "merged"
    assert lora_sync_mode(_cfg("rollout.lora_sync=merged").rollout) == "merged"
    with pytest.raises(ConfigError, match="rollout.lora_sync"):
        _cfg("rollout.lora_sync=both")
    # vLLM starts with enable_lora only for LoRA with its adapter path
    assert vllm_lora_rank(_cfg("rollout.engine=vllm", "model.lora.rank=4")) == 4
    assert vllm_lora_rank(_cfg("rollout.engine=vllm")) == 0
    assert vllm_lora_rank(_cfg("rollout.engine=vllm", "model.lora.rank=4", "rollout.lora_sync=merged")) == 0
    assert vllm_lora_rank(_cfg("model.lora.rank=4")) == 0  # hf
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(
        UserError, match=r"model.lora.rank=600 is above vLLM's largest LoRA rank 512: set rollout.lora_sync=merged"
    ):
        check_lora(_cfg("rollout.engine=vllm", "model.lora.rank=600"))
    with pytest.raises(UserError, match="is larger than"):  # merged: not vLLM's limit, the layer's
        check_lora(_cfg("rollout.engine=vllm", "model.lora.rank=600", "rollout.lora_sync=merged"))
