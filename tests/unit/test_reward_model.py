"""The reward model's CPU-side logic: tokenizer paths, score maths, the mix, and bad checkpoints."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from rlstack.data.dataset import Prompt
from rlstack.rollout.base import Generation
from rlstack.workers.reward_model import (
    mix,
    normalize_and_clip,
    pad_batch,
    rm_inputs,
    rule_applies,
    same_tokenizer,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def actor_tok(tmp_path_factory):
    from megatron_bridge.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer(str(tmp_path_factory.mktemp("actor_tok")))


@pytest.fixture(scope="module")
def other_tok(tmp_path_factory):
    """A reward model's tokenizer that differs: another vocabulary and another chat template."""
    from megatron_bridge import tiny

    mp = pytest.MonkeyPatch()
    mp.setattr(tiny, "TOKENIZER_VOCAB", 280)
    mp.setattr(tiny, "CHAT_TEMPLATE", OTHER_TEMPLATE)
    try:
        return tiny.make_tiny_tokenizer(str(tmp_path_factory.mktemp("rm_tok")))
    finally:
        mp.undo()


def _sample(tok, content="Copy: 7", answer="7"):
    messages = [{"role": "user", "content": content}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = Prompt(index=0, input_ids=list(ids), data_source="chat", ground_truth=answer, messages=messages)
    response = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return [prompt], [Generation(0, list(ids), response, [0.0] * len(response), "stop")]


def test_same_tokenizer_scores_the_rollout_tokens(actor_tok):
    prompts, gens = _sample(actor_tok)
    assert same_tokenizer(actor_tok, actor_tok)
    inputs = rm_inputs(prompts, gens, actor_tok, actor_tok, shared=True)
    assert inputs.ids == [prompts[0].input_ids + gens[0].response_ids]
    assert inputs.last == [len(inputs.ids[0]) - 1]  # the response's last token (its eos)


def test_tokenizer_mismatch_retokenises_with_the_rm_chat_template(actor_tok, other_tok):
    prompts, gens = _sample(actor_tok)
    assert not same_tokenizer(actor_tok, other_tok)
    inputs = rm_inputs(prompts, gens, actor_tok, other_tok, shared=False)
    expected = "[user] Copy: 7\n[assistant] 7\n"  # the RM's template; the actor's eos is dropped
    assert other_tok.decode(inputs.ids[0]) == expected
    assert inputs.ids[0] == other_tok(expected, add_special_tokens=False)["input_ids"]
    assert inputs.last == [len(inputs.ids[0]) - 1]


def test_tokenizer_mismatch_without_template_encodes_the_text(actor_tok, other_tok):
    prompts, gens = _sample(actor_tok)
    other_tok.chat_template = None
    try:
        inputs = rm_inputs(prompts, gens, actor_tok, other_tok, shared=False)
    finally:
        other_tok.chat_template = OTHER_TEMPLATE
    text = actor_tok.decode(prompts[0].input_ids, skip_special_tokens=False) + "7"
    assert inputs.ids[0] == other_tok(text)["input_ids"]


def test_pad_batch_rounds_rows_up_and_keeps_last_positions():
    from rlstack.workers.reward_model import RMInputs

    batch = pad_batch(RMInputs(ids=[[5, 6, 7], [8]], last=[2, 0]), pad_id=1, multiple_of=4, device="cpu")
    assert batch["tokens"].tolist() == [[5, 6, 7], [8, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert batch["last"].tolist() == [2, 0, 0, 0]
    assert batch["position_ids"].shape == (4, 3)


def test_normalize_and_clip():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    z = normalize_and_clip(x, normalize=True, clip=0.0)
    assert abs(z.mean().item()) < 1e-6 and abs(z.std(unbiased=False).item() - 1.0) < 1e-4
    # over two DP ranks holding the same samples the statistics are the same
    twice = normalize_and_clip(x, normalize=True, clip=0.0, reduce_fn=lambda t: 2 * t)
    assert torch.allclose(z, twice, atol=1e-6)
    assert normalize_and_clip(x, normalize=False, clip=2.5).tolist() == [1.0, 2.0, 2.5, 2.5]
    assert normalize_and_clip(-x, normalize=False, clip=0.0).tolist() == (-x).tolist()


def test_mix_is_rule_plus_weighted_rm_or_rm_alone():
    assert mix([1.0, None, 0.0], [0.5, 2.0, -1.0], weight=0.5) == [1.25, 1.0, -0.5]


def test_rule_applies_by_source_custom_file_or_builtin():
    from rlstack.rewards import RewardScorer

    assert rule_applies(RewardScorer(), "copy") and not rule_applies(RewardScorer(), "chat")
    assert rule_applies(RewardScorer(builtin="copy"), "chat")


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_reward_model

    return ensure_tiny_reward_model(TinySpec(seed=3), cache_dir=str(tmp_path_factory.mktemp("rm")))


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return str(dst)


def test_bad_reward_model_checkpoints_name_the_fix(tiny_rm, tiny_llama, tmp_path):
    from rlstack.errors import USER_ERRORS
    from rlstack.preflight import check_reward_model_dir

    check_reward_model_dir(tiny_rm)  # the good one passes
    two = _edited(tiny_rm, tmp_path / "two", id2label={"0": "A", "1": "B"}, label2id={"A": 0, "B": 1})
    mistral = _edited(tiny_rm, tmp_path / "mistral", architectures=["MistralForSequenceClassification"])
    cases = [
        (tiny_llama, "LlamaForCausalLM, not a reward model: pass a \\*ForSequenceClassification"),
        (two, "num_labels=2, a reward model needs one scalar: use a checkpoint saved with num_labels=1"),
        (mistral, "MistralForSequenceClassification.*is not a supported reward model: use a Llama"),
    ]
    for path, message in cases:
        with pytest.raises(USER_ERRORS, match=message) as info:
            check_reward_model_dir(path)
        assert "\n" not in str(info.value) and "reward_model.path" in str(info.value)


def test_validate_only_refuses_a_causal_lm_as_reward_model(tiny_llama):
    cmd = [sys.executable, "-m", "rlstack.train", "--config", "yaml_configs/tiny_cpu.yaml"]
    cmd += [f"reward_model.path={tiny_llama}", "--validate-only", "--world-size", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "not a reward model" in lines[0], lines


def test_validate_only_accepts_a_reward_model_for_a_source_without_rule(tiny_rm, tmp_path):
    from rlstack.data.synthetic import make_rows

    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(json.dumps(dict(r, data_source="chat")) + "\n" for r in make_rows("copy", 4, 0, "train", 9))
    )
    base = [
        sys.executable,
        "-m",
        "rlstack.train",
        "--config",
        "yaml_configs/tiny_cpu.yaml",
        f"data.train_files=[{data}]",
    ]
    base.append(f"trainer.output_dir={tmp_path / 'out'}")
    flags = ["--validate-only", "--world-size", "1"]
    without = subprocess.run(base + flags, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert without.returncode == 2 and "no reward scorer for data_source 'chat'" in without.stdout + without.stderr
    ok = subprocess.run(
        base + [f"reward_model.path={tiny_rm}"] + flags, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_memory_plan_counts_the_reward_model(tiny_rm):
    from rlstack.config import load_config
    from rlstack.planner.build import plan_for_config

    cfg = load_config(os.path.join(ROOT, "yaml_configs/tiny_cpu.yaml"))
    without = plan_for_config(cfg, 2, 24, device="cpu", suggest=False)
    cfg.reward_model.path = tiny_rm
    plan = plan_for_config(cfg, 2, 24, device="cpu", suggest=False)
    rm = [i for i in plan.items if i.role == "reward"]
    assert [i.name.split(" (")[0] for i in rm] == ["model weights", "model activations"]
    assert not any(i.role == "reward" for i in without.items)
    assert plan.peak_bytes > without.peak_bytes
