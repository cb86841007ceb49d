"""from_verl never misleads: settings rlstack has are translated, a key that is not verl's says so
and names verl's, an ignored key names the one that wins, and the emitted file validates whenever
no key is UNSUPPORTED (tests/unit/conftest.py checks every translation of the from_verl tests)."""

import pytest

from rlstack import from_verl

A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
REF = "actor_rollout_ref.ref."
MODEL = {"actor_rollout_ref.model.path": "Qwen/Qwen2.5-7B-Instruct"}  # not here: the layout is checked alone
GRPO = {**MODEL, "algorithm.adv_estimator": "grpo", R + "n": 4, "trainer.total_training_steps": 3}


def _translate(**extra):
    return from_verl.translate({**GRPO, **{k.replace("__", "."): v for k, v in extra.items()}})


def _ignored(t, key):
    return [why for item, why in t.ignored if item.startswith(key + "=")]


def _unsupported(t, key):
    return [why for item, why in t.unsupported if item.startswith(key + "=")]


def test_megatron_offload_switches_become_offload_keys():
    t = from_verl.translate(
        {
            **GRPO,
            A + "megatron.param_offload": True,
            A + "megatron.optimizer_offload": True,
            REF + "megatron.param_offload": True,
        }
    )
    v = t.values
    assert v["offload.params"] is True and v["offload.optimizer"] is True and v["offload.reference"] is True
    assert "offload.grads" not in v
    assert "megatron.param_offload=true" in t.sources["offload.params"]
    assert not t.unsupported and not t.ignored


def test_reference_layout_equal_to_the_actors_is_accepted():
    t = from_verl.translate(
        {
            **GRPO,
            "trainer.n_gpus_per_node": 8,
            A + "megatron.tensor_model_parallel_size": 2,
            A + "megatron.pipeline_model_parallel_size": 2,
            REF + "megatron.tensor_model_parallel_size": 2,
            REF + "megatron.pipeline_model_parallel_size": 2,
        }
    )
    assert t.values["parallel.tp"] == 2 and t.values["parallel.pp"] == 2
    assert not t.unsupported and not t.ignored


def test_a_differing_reference_layout_is_dropped_saying_why():
    t = from_verl.translate(
        {**GRPO, A + "megatron.tensor_model_parallel_size": 2, REF + "megatron.tensor_model_parallel_size": 4}
    )
    (why,) = _ignored(t, REF + "megatron.tensor_model_parallel_size")
    assert "the actor's parallel.tp=2" in why and "wins" in why
    assert not t.unsupported


@pytest.mark.parametrize(("engine", "translated"), [("vllm", True), ("hf", False)])
def test_free_cache_engine(engine, translated):
    t = from_verl.translate({**GRPO, R + "name": engine, R + "free_cache_engine": True})
    if translated:
        assert t.values["rollout.free_cache_during_update"] is True
        assert "free_cache_engine=true" in t.sources["rollout.free_cache_during_update"]
    else:
        assert "rollout.free_cache_during_update" not in t.values  # the config refuses it without vllm
        (why,) = _ignored(t, R + "free_cache_engine")
        assert "hf engine frees its cache" in why
    assert not t.unsupported


def test_the_global_micro_batch_beside_the_per_gpu_one_is_named():
    t = from_verl.translate({**GRPO, A + "ppo_micro_batch_size_per_gpu": 4, A + "ppo_micro_batch_size": 64})
    assert t.values["algorithm.micro_batch_size"] == 4
    (why,) = _ignored(t, A + "ppo_micro_batch_size")
    assert f"{A}ppo_micro_batch_size_per_gpu=4 wins" in why


def test_dynamic_batch_size_with_pipeline_stages_keeps_the_file_valid():
    t = from_verl.translate(
        {
            **GRPO,
            "trainer.n_gpus_per_node": 2,
            A + "megatron.pipeline_model_parallel_size": 2,
            A + "use_dynamic_bsz": True,
            A + "ppo_max_token_len_per_gpu": 4096,
        }
    )
    assert "algorithm.max_tokens_per_micro_batch" not in t.values  # the config needs pp=1 for it
    (why,) = _ignored(t, A + "use_dynamic_bsz")
    assert "need parallel.pp=1" in why and "pp=2" in why
    assert not t.unsupported  # so the conftest hook validates the emitted file


def test_a_key_that_is_not_verls_says_so_and_names_verls():
    t = _translate(trainer__max_steps=100)
    (why,) = _unsupported(t, "trainer.max_steps")
    assert why == "not a verl key; verl's is trainer.total_training_steps (rlstack: trainer.total_steps)"
    typo = _translate(**{A + "optim__lrr": 1e-6})
    (why,) = _unsupported(typo, A + "optim.lrr")
    assert why.startswith(f"not a verl key; verl's is {A}optim.lr (rlstack: algorithm.actor_lr)")


def test_a_verl_key_rlstack_lacks_is_not_called_foreign():
    t = _translate(**{"trainer.val_only": True, A + "megatron.override_ddp_config.bucket_size": 5})
    assert _unsupported(t, "trainer.val_only") == ["no rlstack equivalent"]
    assert all("not a verl key" not in why for _, why in t.unsupported)


def test_two_keys_for_one_setting_name_the_winner():
    t = _translate(**{"data.max_response_length": 256, R + "response_length": 128})
    assert t.values["rollout.max_new_tokens"] == 128
    (why,) = _ignored(t, "data.max_response_length")
    assert why == f"{R}response_length=128 sets rollout.max_new_tokens too, and wins"
    clip = _translate(**{A + "clip_ratio": 0.2, A + "clip_ratio_low": 0.2, A + "clip_ratio_high": 0.28})
    assert clip.values["algorithm.clip_ratio_high"] == 0.28
    (why,) = _ignored(clip, A + "clip_ratio")
    assert "clip_ratio_low and clip_ratio_high are both given, and win" in why
    same = _translate(**{"data.max_response_length": 128, R + "response_length": 128})
    assert not same.ignored  # equal values: nothing lost


def test_every_translation_is_validated(request):
    """The hook itself: an emitted file that does not validate fails the test that made it."""
    import copy

    from rlstack.config import ConfigError
    from tests.unit.conftest import validate_translation

    bad = copy.deepcopy(_translate())  # a copy: the hook validates the translation itself
    bad.set("algorithm.max_tokens_per_micro_batch", 64, "a budget below one sequence")
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        validate_translation(bad, request.getfixturevalue("tmp_path"))


@pytest.mark.parametrize("text", ["010", "2024-12-06", "yes", "off", "1:30"])
def test_values_are_read_as_hydra_reads_them(text, tmp_path):
    from rlstack.config import load_config

    parsed = from_verl.parse_command_line([f"trainer.experiment_name={text}", "actor_rollout_ref.actor.optim.lr=1e-6"])
    assert parsed == {"trainer.experiment_name": text, "actor_rollout_ref.actor.optim.lr": 1e-6}
    path = tmp_path / "run.yaml"
    path.write_text(from_verl.to_yaml_text(from_verl.translate({**GRPO, **parsed})))
    assert load_config(str(path)).logging.run_name == text
