"""End-to-end on CPU: GRPO with a learned reward model (a tiny random `LlamaForSequenceClassification`).

Alone (a data source no rule scores) GRPO climbs the RM's score: any fixed function of the response
can be climbed. Beside a rule (the `copy` task) the reward is exactly rule + weight x rm.
"""

import json

import pytest

from tests.e2e.runs import read_metrics, torchrun_train, train_steps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_rm(tiny_cache):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_reward_model

    return ensure_tiny_reward_model(TinySpec(seed=3), cache_dir=tiny_cache)


def _chat_file(path) -> str:
    """The copy task's prompts under a data source no rule scorer knows: the RM alone rewards them."""
    from rlstack.data.synthetic import make_rows

    rows = make_rows("copy", 256, 0, "train", 20)
    path.write_text("".join(json.dumps(dict(r, data_source="chat")) + "\n" for r in rows))
    return str(path)


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_grpo_raises_the_reward_model_score(tmp_path, tiny_rm):
    out = str(tmp_path / "rm")
    data = _chat_file(tmp_path / "chat.jsonl")
    torchrun_train(out, ["trainer.total_steps=20", f"reward_model.path={tiny_rm}", f"data.train_files=[{data}]"])
    rows = train_steps(read_metrics(out))
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(r["reward/rule_mean"] == 0.0 for r in rows)  # no rule applies: the RM alone
    assert all(abs(r["reward/mean"] - r["reward/rm_mean"]) < 1e-5 for r in rows)  # weight 1
    first, last = _mean(rows[:3], "reward/rm_mean"), _mean(rows[-3:], "reward/rm_mean")
    assert last > first + 0.5 * rows[0]["reward/rm_std"], (first, last)
    assert all(r["throughput/rm_tok_s"] > 0 for r in rows)


def test_rule_and_reward_model_mix_as_configured(tmp_path, tiny_rm):
    out = str(tmp_path / "mix")
    weight = 0.25
    torchrun_train(out, ["trainer.total_steps=3", f"reward_model.path={tiny_rm}", f"reward_model.weight={weight}"])
    rows = train_steps(read_metrics(out))
    assert len(rows) == 3
    assert any(r["reward/rule_mean"] > 0 for r in rows)  # the copy rule pays some samples
    for r in rows:
        assert abs(r["reward/rm_mean"]) > 1e-3  # the RM contributes visibly
        expected = r["reward/rule_mean"] + weight * r["reward/rm_mean"]
        assert abs(r["reward/mean"] - expected) < 1e-5, (r["reward/mean"], expected)


@pytest.fixture(scope="module")
def other_tokenizer_rm(tmp_path_factory):
    """A reward model whose tokenizer (vocabulary 280, another chat template) is not the actor's."""
    from megatron_bridge import tiny

    out = str(tmp_path_factory.mktemp("other_rm"))
    mp = pytest.MonkeyPatch()
    mp.setattr(tiny, "TOKENIZER_VOCAB", 280)
    mp.setattr(tiny, "CHAT_TEMPLATE", "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    try:
        return tiny.make_tiny_reward_model(out, tiny.TinySpec(seed=4), score_scale=10.0)
    finally:
        mp.undo()


def test_reward_model_with_another_tokenizer_retokenises(tmp_path, other_tokenizer_rm):
    out = str(tmp_path / "other")
    data = _chat_file(tmp_path / "chat.jsonl")
    overrides = ["trainer.total_steps=3", f"reward_model.path={other_tokenizer_rm}", f"data.train_files=[{data}]"]
    proc = torchrun_train(out, overrides)
    assert (
        "re-tokenising prompt + response with the reward model's tokenizer and chat template"
        in proc.stdout + proc.stderr
    )
    rows = train_steps(read_metrics(out))
    assert len(rows) == 3 and all(r["reward/rm_std"] > 0 for r in rows)
