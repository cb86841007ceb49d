"""Loading agent loops and tools (one-line errors naming the file and the fix), prompt and turn
rendering with the chat template, the config keys, and the per-step records and metrics."""

import json

import pytest

from rlstack.agent import AgentLoop, AgentOutput
from rlstack.agent.driver import AgentSample
from rlstack.agent.records import agent_metrics, reward_extra_info, write_rollout_data
from rlstack.agent.registry import LoopSet, check_loop_name
from rlstack.agent.render import TOOLS_SYSTEM_PROMPT, TurnRenderer, apply_template, messages_with_tools
from rlstack.agent.tools import load_tools
from rlstack.config import ConfigError, load_config
from rlstack.errors import UserError
from tests.unit.agent_scripted import write_tools

QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron_bridge.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _one_line(excinfo):
    text = str(excinfo.value)
    assert "\n" not in text
    return text


# ----------------------------------------------------------------------------- tools


def test_tool_files_load(tmp_path):
    fn_path, yaml_path = write_tools(tmp_path)
    tools = {t.name: t for t in load_tools(yaml_path, fn_path)}
    assert set(tools) == {"counter", "add", "boom", "slow", "digits"}
    add = tools["add"].schema["function"]
    assert add["parameters"]["required"] == ["a", "b"]
    assert add["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first number."}
    assert tools["add"].argument_error({"a": 1, "b": 2}) is None
    assert "missing" in tools["add"].argument_error({"a": 1})
    assert "must be a JSON object" in tools["add"].argument_error([1, 2])


@pytest.mark.parametrize(
    "yaml_text, expected",
    [
        (
            "tools: [{class_name: nowhere_pkg.tools.Tool, tool_schema: {function: {name: x}}}]",
            "cannot import module 'nowhere_pkg.tools'",
        ),
        ("tools: [{class_name: {cls}:NoSuchTool}]", "is not a class"),
        (
            "tools: [{class_name: {cls}:CounterTool, config: {}, tool_schema: {type: function, function: {description: d}}}]",
            "has no function.name",
        ),
        ("tools: [{config: {}}]", "has no class_name"),
        ("nothing: here", "has no `tools:` list"),
        ("tools: [unclosed", "is not valid YAML"),
    ],
)
def test_a_tool_config_that_cannot_load_is_one_line_naming_the_file(tmp_path, yaml_text, expected):
    write_tools(tmp_path)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text.replace("{cls}", str(tmp_path / "counter_tool.py")))
    with pytest.raises(UserError) as e:
        load_tools(str(path))
    assert expected in _one_line(e) and str(path) in str(e.value)


def test_missing_tool_files_and_bad_function_tools(tmp_path):
    with pytest.raises(UserError) as e:
        load_tools(str(tmp_path / "missing.yaml"))
    assert "rollout.multi_turn.tool_config_path" in _one_line(e) and "does not exist" in str(e.value)
    with pytest.raises(UserError) as e:
        load_tools("", str(tmp_path / "missing.py"))
    assert "does not exist" in _one_line(e)
    bad = tmp_path / "nodoc.py"
    bad.write_text("def lookup(key):\n    return key\n")
    with pytest.raises(UserError) as e:
        load_tools("", str(bad))
    assert "lookup()" in _one_line(e) and "docstring" in str(e.value)
    fn_path, yaml_path = write_tools(tmp_path)
    clash = tmp_path / "clash.py"
    clash.write_text('def counter(x: int) -> str:\n    """C.\n\n    Args:\n        x: x.\n    """\n    return ""\n')
    with pytest.raises(UserError) as e:
        load_tools(yaml_path, str(clash))
    assert "declared twice" in _one_line(e)


def test_preflight_checks_the_tools(tmp_path):
    from rlstack.preflight import preflight

    cfg = load_config(
        None,
        [
            "model.path=tiny",
            "data.synthetic=arith",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"rollout.multi_turn.tool_config_path={tmp_path / 'nope.yaml'}",
        ],
    )
    with pytest.raises(UserError) as e:
        preflight(cfg, 1)
    assert "nope.yaml does not exist" in _one_line(e)


# ----------------------------------------------------------------------------- loops


class _Echo(AgentLoop):
    async def run(self, prompt_ids, ctx):
        return AgentOutput([], [], [])


def test_loop_names(tmp_path):
    loop_file = tmp_path / "loops.py"
    loop_file.write_text(
        "from rlstack.agent import AgentLoop, AgentOutput\n"
        "class Mine(AgentLoop):\n    async def run(self, prompt_ids, ctx):\n        return AgentOutput([], [], [])\n"
        "class NotALoop:\n    pass\n"
    )
    check_loop_name("single_turn")
    check_loop_name(f"{loop_file}:Mine")
    for spec, expected in (
        ("multi_turn", "use one of single_turn, tool_agent or FILE.py:ClassName"),
        (f"{tmp_path / 'missing.py'}:Mine", "does not exist"),
        (f"{loop_file}:Other", "has no Other"),
        (f"{loop_file}:NotALoop", "is not an AgentLoop"),
    ):
        with pytest.raises(UserError) as e:
            check_loop_name(spec)
        assert expected in _one_line(e) and "rollout.agent_loop" in str(e.value)
    loops = LoopSet("single_turn")
    assert type(loops.for_row({})).__name__ == "SingleTurnLoop"
    assert type(loops.for_row({"agent_name": "single_turn_agent"})).__name__ == "SingleTurnLoop"  # verl's name
    check_loop_name("single_turn_agent")
    assert type(loops.for_row({"agent_name": f"{loop_file}:Mine"})).__name__ == "Mine"  # verl's per-row column
    with pytest.raises(UserError) as e:
        loops.for_row({"agent_name": "nope"})
    assert "agent_name='nope'" in _one_line(e)


# ----------------------------------------------------------------------------- rendering


def test_a_template_without_tool_support_gets_the_tools_in_the_system_prompt(tok, tmp_path):
    fn_path, _ = write_tools(tmp_path)
    schemas = [t.schema for t in load_tools("", fn_path)]
    messages, tools_arg = messages_with_tools([{"role": "user", "content": "hi"}], schemas, tok)
    assert tools_arg is None and messages[0]["role"] == "system"
    assert messages[0]["content"] == TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(s) for s in schemas))
    with_system, _ = messages_with_tools(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], schemas, tok
    )
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools") and len(with_system) == 2
    text = tok.decode(apply_template(tok, messages))
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "add"' in text


def test_a_template_with_tool_support_gets_them_through_tools(tok):
    import copy

    native = copy.deepcopy(tok)
    native.chat_template = QWEN_LIKE
    schemas = [{"type": "function", "function": {"name": "add", "description": "d", "parameters": {}}}]
    messages, tools_arg = messages_with_tools([{"role": "user", "content": "hi"}], schemas, native)
    assert tools_arg == schemas and messages == [{"role": "user", "content": "hi"}]
    assert "TOOLS:add;" in native.decode(apply_template(native, messages, tools_arg))
    renderer = TurnRenderer(native, native.eos_token_id, schemas)
    msgs = renderer.tool_messages([("add", "5")])
    assert msgs == [{"role": "tool", "name": "add", "content": "5"}]
    assert native.decode(renderer.messages_ids(msgs)) == "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_inserted_turns_close_the_policy_turn_and_end_with_the_generation_prompt(tok):
    r = TurnRenderer(tok, tok.eos_token_id)
    user = [{"role": "user", "content": "That is not right, try again."}]
    body = tok.encode(
        "\n<|im_start|>user\nThat is not right, try again.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    generated = tok.encode("It is 4.", add_special_tokens=False)
    assert r.turn_tail == tok.encode("\n", add_special_tokens=False)
    assert r.after_turn(generated + [tok.eos_token_id], user) == body  # eos generated: only the tail
    assert r.after_turn(generated, user) == [tok.eos_token_id] + body  # stopped at its cap: eos inserted too
    # exactly what the template renders for the whole conversation
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "It is 4."}] + user
    prompt = apply_template(tok, chat[:1])
    full = apply_template(tok, chat)
    assert full == prompt + generated + [tok.eos_token_id] + r.after_turn(generated + [tok.eos_token_id], user)


# ----------------------------------------------------------------------------- config, records, metrics


def test_config_keys():
    cfg = load_config(None, ["data.synthetic=arith"])
    assert cfg.rollout.agent_loop == "single_turn" and cfg.trainer.rollout_data_dir == ""
    mt = cfg.rollout.multi_turn
    assert (mt.format, mt.max_parallel_calls, mt.max_tool_response_length, mt.tool_response_truncate_side) == (
        "hermes",
        1,
        256,
        "middle",
    )
    for override, expected in (
        ("rollout.multi_turn.tool_response_truncate_side=top", "choose one of 'left', 'right', 'middle'"),
        ("rollout.multi_turn.max_parallel_calls=0", "at least 1"),
        ("rollout.multi_turn.tool_timeout_s=-1", ">= 0"),
        ("rollout.multi_turn.kv_cache_mb=-1", ">= 0 (MB"),
        ("rollout.multi_turn.format=json", "'hermes'"),
    ):
        with pytest.raises(ConfigError) as e:
            load_config(None, ["data.synthetic=arith", override])
        assert expected in str(e.value) and override.split("=")[0] in str(e.value)


def _sample(mask, turns, finish, errors=None, calls=0):
    return AgentSample(
        [1, 2],
        list(range(len(mask))),
        mask,
        [0.0] * len(mask),
        turns,
        finish,
        None,
        {"tool_calls": calls, "tool_errors": errors or {}, "tool_rewards": [0.5] if calls else []},
    )


def test_agent_metrics_and_rollout_data(tmp_path):
    samples = [
        _sample([1, 1, 0, 0, 1, 1], 4, "stop", {"timeout": 1}, calls=1),
        _sample([1, 1], 2, "stop"),
        _sample([1, 0, 0, 0, 1, 1, 1, 1], 6, "length", {"timeout": 1, "malformed": 2}, calls=3),
    ]
    m = agent_metrics(samples)
    assert m["agent/num_turns/mean"] == 4 and m["agent/num_turns/max"] == 6
    assert m["agent/tool_calls"] == 4 and m["agent/tool_errors"] == 4
    assert m["agent/tool_errors/timeout"] == 2 and m["agent/tool_errors/malformed"] == 2
    assert m["agent/inserted_token_share"] == 5 / 16
    assert m["agent/finish_reason/stop"] == 2 / 3 and m["agent/finish_reason/length"] == 1 / 3
    path = write_rollout_data(str(tmp_path / "rollouts"), 7, samples, ["in"] * 3, ["a", "b", "c"], [1.0, 0.0, 0.5])
    assert path.endswith("rollouts/7.jsonl")
    lines = [json.loads(x) for x in open(path)]
    assert [x["output"] for x in lines] == ["a", "b", "c"] and lines[2]["score"] == 0.5 and lines[0]["step"] == 7
    assert lines[2]["response_mask"] == [1, 0, 0, 0, 1, 1, 1, 1] and lines[2]["finish_reason"] == "length"
    assert set(lines[0]) == {
        "input",
        "output",
        "score",
        "step",
        "prompt_ids",
        "response_ids",
        "response_mask",
        "num_turns",
        "finish_reason",
    }
    assert reward_extra_info({"index": 3}, samples[0])["agent"]["tool_calls"] == 1


def test_the_prompt_dataset_renders_the_tools_and_keeps_agent_name(tok, tmp_path):
    from rlstack.data.dataset import PromptDataset

    fn_path, _ = write_tools(tmp_path)
    schemas = [t.schema for t in load_tools("", fn_path)]
    rows = [
        {"data_source": "arith", "prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "1"}},
        {
            "data_source": "arith",
            "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"ground_truth": "1"},
            "agent_name": "tool_agent",
        },
    ]
    plain, with_tools = PromptDataset(rows, tok, 4096), PromptDataset(rows, tok, 4096, tools=schemas)
    assert "<tools>" not in tok.decode(plain[0].input_ids)
    assert tok.decode(with_tools[0].input_ids).startswith("<|im_start|>system\n# Tools")
    assert [p.agent_name for p in with_tools] == ["", "tool_agent"]
    assert with_tools[0].messages == plain[0].messages  # the chat itself (a reward model re-templates it)


def test_validation_console_line_stays_lean():
    """The console's validation line (rlstack/loop.py) shows the scores and the turn count; the agent's
    other val/agent/* metrics go to the trackers only (lean logs: no line over 120 columns)."""
    from rlstack.loop import _fmt

    samples = [
        _sample([1, 1, 0, 0, 1, 1], 4, "stop", {"timeout": 1, "malformed": 1}, calls=1),
        _sample([1, 0, 1], 2, "length", calls=2),
    ]
    metrics = {"val/accuracy": 0.5, **agent_metrics(samples, prefix="val/agent/")}
    assert len(" ".join(f"{k}={v:.4f}" for k, v in metrics.items())) > 120  # what the line printed before
    line = "12:00:00 validation before training: " + _fmt(metrics)
    assert line.endswith(f"val/accuracy=0.5000 val/agent/num_turns/mean=3.0000 (+{len(metrics) - 2} more logged)")
    assert len(line) <= 120, line
    assert _fmt({"val/accuracy": 1.0}) == "val/accuracy=1.0000"  # a single-turn run's line is unchanged
