"""rlstack.from_verl: verl main_ppo command lines -> rlstack YAML that rlstack accepts."""

import shlex

import pytest
import yaml

from rlstack import from_verl
from rlstack.config import ConfigError, load_config

# verl's documented GSM8K PPO quickstart (docs/start/quickstart.rst), as a user pastes it; the
# data and model paths are replaced by local ones in the test.
QUICKSTART = r"""PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo \
 data.train_files=$HOME/data/gsm8k/train.parquet \
 data.val_files=$HOME/data/gsm8k/test.parquet \
 data.train_batch_size=256 \
 data.max_prompt_length=512 \
 data.max_response_length=512 \
 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \
 actor_rollout_ref.actor.optim.lr=1e-6 \
 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
 actor_rollout_ref.rollout.name=vllm \
 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
 actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
 critic.optim.lr=1e-5 \
 critic.model.path=Qwen/Qwen2.5-0.5B-Instruct \
 critic.ppo_micro_batch_size_per_gpu=4 \
 algorithm.kl_ctrl.kl_coef=0.001 \
 trainer.logger=console \
 trainer.val_before_train=False \
 trainer.n_gpus_per_node=1 \
 trainer.nnodes=1 \
 trainer.save_freq=10 \
 trainer.test_freq=10 \
 trainer.total_epochs=15 2>&1 | tee verl_demo.log"""


def _gsm8k_rows(n):
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} plus 1?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


@pytest.fixture
def quickstart_files(tmp_path):
    from megatron_bridge.tiny import make_tiny_checkpoint
    from rlstack.data.rows import write_parquet

    model = make_tiny_checkpoint(str(tmp_path / "model"))
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    write_parquet(_gsm8k_rows(600), str(data / "train.parquet"))
    write_parquet(_gsm8k_rows(20), str(data / "test.parquet"))
    command = QUICKSTART.replace("$HOME", str(tmp_path)).replace("Qwen/Qwen2.5-0.5B-Instruct", model)
    return command, model


def test_quickstart_translates_and_validates(quickstart_files, tmp_path, capsys):
    command, model = quickstart_files
    out = tmp_path / "ppo.yaml"
    tokens = shlex.split(command.replace("\\\n", " "))
    assert from_verl.main(["--out", str(out), *tokens]) == 0
    text = out.read_text()
    cfg = load_config(str(out))
    a = cfg.algorithm
    assert a.name == "ppo" and a.adv_estimator == "gae"  # critic.model.path: PPO with a critic
    assert cfg.model.path == model and cfg.model.critic_path is None  # same weights as the actor
    assert cfg.data.train_batch_size == 256 and cfg.rollout.n == 1  # verl's default n
    assert a.mini_batch_size == 64  # 64 prompts x n=1 sequences
    assert a.micro_batch_size == 4
    assert cfg.rollout.max_new_tokens == 512 and cfg.data.max_prompt_length == 512
    assert cfg.rollout.engine == "vllm" and cfg.rollout.gpu_memory_utilization == 0.4
    assert a.actor_lr == 1e-6 and a.critic_lr == 1e-5 and a.kl_coef == 0.001
    assert a.use_kl_loss is False and a.weight_decay == 0.01 and a.value_clip == 0.5  # verl defaults
    assert cfg.logging.trackers == ["console", "jsonl"]
    assert cfg.trainer.val_before_train is False and cfg.trainer.val_every == 10
    assert cfg.checkpoint.save_every == 10
    assert cfg.trainer.total_steps == 15 * (600 // 256)  # epochs x batches of the drop-last loader
    # a comment per translated key, naming the verl setting
    assert "mini_batch_size: 64  # verl actor_rollout_ref.actor.ppo_mini_batch_size=64 prompts x rollout.n=1" in text
    assert "max_new_tokens: 512  # verl data.max_response_length=512" in text
    assert "use_kl_loss: false  # verl's default actor_rollout_ref.actor.use_kl_loss=false" in text
    # the rollout log-prob micro-batch of 8 cannot be kept apart: listed, not silently dropped
    assert "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8" in text
    from rlstack import train

    assert train.main(["--config", str(out), "--validate-only", "--world-size", "1"]) == 0
    assert "config ok" in capsys.readouterr().out


def test_batch_units_for_grpo():
    t = from_verl.translate(
        from_verl.parse_command_line(
            [
                "algorithm.adv_estimator=grpo",
                "data.train_batch_size=128",
                "actor_rollout_ref.rollout.n=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=32",
                "actor_rollout_ref.actor.ppo_micro_batch_size=64",
                "trainer.n_gpus_per_node=8",
                "trainer.nnodes=2",
                "actor_rollout_ref.actor.use_kl_loss=True",
                "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
                "actor_rollout_ref.actor.clip_ratio=0.28",
                "trainer.total_training_steps=100",
            ]
        )
    )
    v = t.values
    assert v["algorithm.name"] == "grpo" and v["algorithm.adv_estimator"] == "grpo"
    assert v["algorithm.mini_batch_size"] == 32 * 8  # prompts -> sequences
    assert v["algorithm.micro_batch_size"] == 64 // 16  # verl's global micro-batch over 16 GPUs
    assert v["algorithm.kl_loss_type"] == "low_var_kl" and v["algorithm.use_kl_loss"] is True
    assert v["algorithm.clip_ratio_low"] == v["algorithm.clip_ratio_high"] == 0.28
    assert "algorithm.value_clip" not in v  # no critic
    assert t.world_size == 16 and v["trainer.total_steps"] == 100


def test_whole_batch_mini_batch_and_drgrpo():
    t = from_verl.translate(
        {
            "algorithm.adv_estimator": "grpo",
            "algorithm.norm_adv_by_std_in_grpo": False,
            "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm",
            "data.train_batch_size": 64,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
            "actor_rollout_ref.rollout.n": 4,
            "trainer.total_training_steps": 3,
        }
    )
    assert t.values["algorithm.adv_estimator"] == "drgrpo"
    assert t.values["algorithm.loss_agg_mode"] == "seq-mean-token-sum-norm"
    assert t.values["algorithm.mini_batch_size"] == 0  # one optimizer step per batch


def test_unsupported_and_ignored_keys_are_listed(capsys, tmp_path):
    out = tmp_path / "x.yaml"
    code = from_verl.main(
        [
            "--out",
            str(out),
            "--strict",
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            "trainer.logger=[console,swanlab]",
            "data.truncation=left",
            "trainer.total_training_steps=2",
        ]
    )
    assert code == 1  # --strict: something is unsupported
    text = out.read_text()
    err = capsys.readouterr().err
    for item in (
        "trainer.logger=swanlab",
        "data.truncation=left",
    ):
        assert f"UNSUPPORTED {item}" in err
        assert item in text.split("# UNSUPPORTED")[1]
    assert "actor_rollout_ref.actor.fsdp_config.param_offload=true: FSDP setting" in text
    assert "UNSUPPORTED actor_rollout_ref.actor.fsdp_config" not in err
    yaml.safe_load(text)  # still a valid YAML file


def test_dynamic_batch_size_becomes_a_token_budget():
    t = from_verl.translate(
        {
            "actor_rollout_ref.actor.use_dynamic_bsz": True,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096,
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": True,
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 8192,
        }
    )
    assert t.values["algorithm.max_tokens_per_micro_batch"] == 4096
    assert "use_dynamic_bsz=true" in t.sources["algorithm.max_tokens_per_micro_batch"]
    assert any(
        item.startswith("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192") for item, _ in t.ignored
    )
    assert not any("dynamic_bsz" in item or "max_token_len" in item for item, _ in t.unsupported)
    default = from_verl.translate({"actor_rollout_ref.actor.use_dynamic_bsz": True})
    assert default.values["algorithm.max_tokens_per_micro_batch"] == 16384  # verl's default budget
    off = from_verl.translate({"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096})
    assert "algorithm.max_tokens_per_micro_batch" not in off.values  # the budget without the flag is unused


def test_megatron_recompute_overrides():
    tc = "actor_rollout_ref.actor.megatron.override_transformer_config."
    sel = from_verl.translate({tc + "recompute_granularity": "selective", tc + "recompute_modules": ["layernorm", "x"]})
    assert sel.values["model.recompute_modules"] == ["layernorm"]
    assert [item for item, _ in sel.unsupported if "recompute" in item] == ["recompute_modules: x"]
    default = from_verl.translate({tc + "recompute_granularity": "selective"})
    assert default.values["model.recompute_modules"] == ["core_attn"]  # megatron's default list
    full = from_verl.translate({tc + "recompute_granularity": "full", tc + "recompute_method": "uniform"})
    assert full.values["model.gradient_checkpointing"] is True
    assert not any("recompute" in item for item, _ in full.unsupported)
    blocks = from_verl.translate({tc + "recompute_granularity": "full", tc + "recompute_num_layers": 4})
    assert "model.gradient_checkpointing" not in blocks.values
    assert any("recompute_num_layers=4" in item for item, _ in blocks.unsupported)


def test_total_epochs_without_readable_files_is_unsupported():
    t = from_verl.translate({"data.train_files": "/nowhere/train.parquet", "trainer.total_epochs": 2})
    assert "trainer.total_steps" not in t.values
    assert any(item.startswith("trainer.total_epochs=2") for item, _ in t.unsupported)


def test_command_line_parsing():
    parsed = from_verl.parse_command_line(
        shlex.split(
            "FOO=1 python3 -m verl.trainer.main_ppo +data.seed=3 trainer.logger=['console','wandb'] "
            "critic.model.path=null data.val_files=[a.parquet,b.parquet] 2>&1 | tee log"
        )
    )
    assert parsed == {
        "data.seed": 3,
        "trainer.logger": ["console", "wandb"],
        "critic.model.path": None,
        "data.val_files": ["a.parquet", "b.parquet"],
    }


@pytest.mark.parametrize(
    "override, names",
    [
        ("data.max_response_length=512", "rollout.max_new_tokens"),
        ("trainer.logger=[console]", "logging.trackers"),
        ("actor_rollout_ref.actor.optim.lr=1e-6", "algorithm.actor_lr"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=64", "algorithm.mini_batch_size (sequences"),
        ("algorithm.kl_ctrl.kl_coef=0.01", "algorithm.kl_coef"),
        ("critic.model.path=/m", "model.critic_path"),
    ],
)
def test_config_hint_knows_verl_names(override, names):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.synthetic=arith", override])
    message = str(info.value)
    assert f"that is verl's name; rlstack's is {names}" in message and "rlstack.from_verl" in message


def test_verl_kl_value_names_are_accepted():
    cfg = load_config(None, ["data.synthetic=arith", "algorithm.kl_loss_type=low_var_kl", "algorithm.kl_penalty=kl"])
    assert cfg.algorithm.kl_loss_type == "low_var_kl"


def test_fused_kernels_flag_maps_to_the_fused_lm_head():
    from rlstack import from_verl

    on = from_verl.translate({"actor_rollout_ref.model.use_fused_kernels": True})
    off = from_verl.translate({"actor_rollout_ref.model.use_fused_kernels": False})
    assert on.values["model.fused_output_logprobs"] is True
    assert off.values["model.fused_output_logprobs"] is False


# verl's DAPO recipe (recipe/dapo/run_dapo_qwen2.5_32b.sh, the algorithm's keys), with the overlong
# buffer under the reward_kwargs names verl 0.9.1's dapo manager reads
DAPO = [
    "algorithm.adv_estimator=grpo",
    "algorithm.kl_ctrl.kl_coef=0.0",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.kl_loss_coef=0.0",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.rollout.n=16",
    "algorithm.filter_groups.enable=True",
    "algorithm.filter_groups.max_num_gen_batches=10",
    "algorithm.filter_groups.metric=acc",
    "algorithm.filter_groups.max_inflight_gen_batches=1",
    "data.max_response_length=20480",
    "data.gen_batch_size=1536",
    "actor_rollout_ref.actor.use_token_level_loss=True",
    "reward_model.reward_manager=dapo",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
    "+reward_model.reward_kwargs.max_resp_len=20480",
    "trainer.total_training_steps=3",
]


def test_dapo_recipe_translates_and_validates(tmp_path):
    t = from_verl.translate(from_verl.parse_command_line(DAPO))
    v = t.values
    assert (v["algorithm.clip_ratio_low"], v["algorithm.clip_ratio_high"]) == (0.2, 0.28)
    assert v["algorithm.loss_agg_mode"] == "token-mean" and v["algorithm.use_kl_loss"] is False
    assert (v["algorithm.filter_groups.enable"], v["algorithm.filter_groups.metric"]) == (True, "acc")
    assert v["algorithm.filter_groups.max_num_gen_batches"] == 10
    assert (v["reward.overlong_buffer.enable"], v["reward.overlong_buffer.len"]) == (True, 4096)
    assert v["reward.overlong_buffer.penalty_factor"] == 1.0 and v["rollout.max_new_tokens"] == 20480
    ignored = " ".join(item for item, _ in t.ignored)
    for key in ("reward_model.reward_manager=dapo", "overlong_buffer_cfg.log", "max_resp_len=20480", "max_inflight"):
        assert key in ignored
    assert [item for item, _ in t.unsupported] == ["data.gen_batch_size=1536"]
    out = tmp_path / "dapo.yaml"
    out.write_text(from_verl.to_yaml_text(t))
    cfg = load_config(str(out), ["data.synthetic=arith"])
    assert cfg.reward.overlong_buffer.len == 4096 and cfg.algorithm.filter_groups.enable


@pytest.mark.parametrize(
    "prefix",
    [
        "reward_model.overlong_buffer.",
        "custom_reward_function.overlong_buffer.",
        "reward.reward_kwargs.overlong_buffer_cfg.",
    ],
)
def test_overlong_buffer_under_each_verl_name(prefix):
    keys = {prefix + "enable": True, prefix + "len": 512, prefix + "penalty_factor": 0.5}
    t = from_verl.translate({**keys, "trainer.total_training_steps": 3})
    assert t.values["reward.overlong_buffer.len"] == 512 and t.values["reward.overlong_buffer.penalty_factor"] == 0.5
    assert not t.unsupported


def test_policy_losses_and_their_parameters_translate(tmp_path):
    loss = "actor_rollout_ref.actor.policy_loss."
    t = from_verl.translate(
        {
            loss + "loss_mode": "clip_cov",
            loss + "clip_cov_ratio": 0.001,
            loss + "clip_cov_ub": 4.0,
            "actor_rollout_ref.actor.tau_neg": 1.2,
            "algorithm.adv_estimator": "gpg",
            "actor_rollout_ref.rollout.n": 4,
            "trainer.total_training_steps": 3,
        }
    )
    v = t.values
    assert v["algorithm.policy_loss"] == "clip_cov" and v["algorithm.adv_estimator"] == "gpg"
    assert v["algorithm.policy_loss_params.clip_cov_ratio"] == 0.001
    assert v["algorithm.policy_loss_params.clip_cov_ub"] == 4.0
    assert v["algorithm.policy_loss_params.tau_neg"] == 1.2
    out = tmp_path / "x.yaml"
    out.write_text(from_verl.to_yaml_text(t))
    load_config(str(out), ["data.synthetic=arith"])
    # cispo (refused before these losses existed) now validates
    cispo = from_verl.translate({loss + "loss_mode": "cispo", "trainer.total_training_steps": 3})
    out.write_text(from_verl.to_yaml_text(cispo))
    assert load_config(str(out), ["data.synthetic=arith"]).algorithm.policy_loss == "cispo"


def test_unknown_loss_modes_are_named_and_otb_gdpo_keys_translate():
    t = from_verl.translate(
        {
            "actor_rollout_ref.actor.policy_loss.loss_mode": "bypass_mode",
            "algorithm.adv_estimator": "optimal_token_baseline",
            "actor_rollout_ref.actor.calculate_sum_pi_squared": True,
            "trainer.total_training_steps": 3,
        }
    )
    assert "algorithm.policy_loss" not in t.values
    reasons = dict(t.unsupported)
    assert "rlstack's losses" in reasons["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"]
    assert not any("optimal_token_baseline" in k or "sum_pi_squared" in k for k in reasons)  # runnable now
    assert t.values["algorithm.adv_estimator"] == "optimal_token_baseline"
    gdpo = from_verl.translate(
        {
            "algorithm.adv_estimator": "gdpo",
            "algorithm.gdpo_reward_keys": ["format", "acc"],
            "algorithm.gdpo_reward_weights": [1.0, 0.5],
            "actor_rollout_ref.rollout.n": 4,
            "trainer.total_training_steps": 3,
        }
    )
    assert gdpo.values["algorithm.gdpo_reward_keys"] == ["format", "acc"]
    assert gdpo.values["algorithm.gdpo_reward_weights"] == [1.0, 0.5]
    assert not gdpo.unsupported
    metric = from_verl.translate({"algorithm.filter_groups.metric": "reward", "trainer.total_training_steps": 3})
    assert metric.values["algorithm.filter_groups.metric"] == "seq_reward"


def test_multi_turn_tool_keys_and_the_rollout_dump_translate():
    mt = "actor_rollout_ref.rollout.multi_turn."
    t = from_verl.translate(
        {
            mt + "enable": True,
            mt + "tool_config_path": "tools.yaml",
            mt + "function_tool_path": None,
            mt + "max_assistant_turns": None,
            mt + "max_user_turns": 3,
            mt + "max_parallel_calls": 2,
            mt + "tool_response_truncate_side": "left",
            "actor_rollout_ref.rollout.agent.default_agent_loop": "tool_agent",
            "trainer.rollout_data_dir": "dumps",
        }
    )
    v = t.values
    assert v["rollout.multi_turn.tool_config_path"] == "tools.yaml" and v["rollout.multi_turn.function_tool_path"] == ""
    assert v["rollout.multi_turn.max_assistant_turns"] == 0 and v["rollout.multi_turn.max_user_turns"] == 3
    assert (
        v["rollout.multi_turn.max_parallel_calls"] == 2
        and v["rollout.multi_turn.tool_response_truncate_side"] == "left"
    )
    assert v["rollout.agent_loop"] == "tool_agent" and v["trainer.rollout_data_dir"] == "dumps"
    assert any(item.startswith(mt + "enable") for item, _ in t.ignored)
    assert not [item for item, _ in t.unsupported if "multi_turn" in item or "agent" in item]
    custom = from_verl.translate({"actor_rollout_ref.rollout.agent.default_agent_loop": "react_agent"})
    assert any("react_agent" in item for item, _ in custom.unsupported) and "rollout.agent_loop" not in custom.values
    assert from_verl.rlstack_name_for(mt + "max_user_turns") == "rollout.multi_turn.max_user_turns"


def test_fully_async_keys_map_to_split_placement_and_staleness():
    """verl's fully-async recipe: the rollout GPUs become placement.rollout_ranks (on top of the
    trainer's), staleness_threshold x trigger_parameter_sync_step bound the sample age as
    rollout.staleness, and partial_rollout is rollout.partial."""
    t = from_verl.translate(
        {
            "trainer.n_gpus_per_node": 4,
            "rollout.n_gpus_per_node": 2,
            "rollout.nnodes": 1,
            "async_training.staleness_threshold": 0.5,
            "async_training.trigger_parameter_sync_step": 2,
            "async_training.partial_rollout": True,
        }
    )
    assert t.values["placement.rollout_ranks"] == 2 and t.world_size == 6
    assert t.values["rollout.staleness"] == 2  # ceil(1.5 x 2) - 1
    assert t.values["rollout.partial"] is True and not [k for k, _ in t.unsupported if k.startswith("async")]
    sync = from_verl.translate({"async_training.staleness_threshold": 0, "async_training.partial_rollout": False})
    assert sync.values["rollout.staleness"] == 0 and sync.values["rollout.partial"] is False
    assert not [k for k, _ in sync.unsupported if k.startswith("async_training.")]
