"""The built-in tool loop over a scripted engine: every path a tool call can take, the turn limits,
the budget, and the batching of concurrent trajectories into one engine call per turn."""

import time

import pytest

from rlstack.agent.driver import AgentRollout
from rlstack.agent.records import agent_metrics
from rlstack.agent.registry import LoopSet
from rlstack.agent.render import TurnRenderer, apply_template, messages_with_tools
from rlstack.agent.tool_agent import truncate_response
from rlstack.agent.tools import load_tools
from rlstack.config import MultiTurnConfig
from rlstack.rollout.base import SamplingParams
from tests.unit.agent_scripted import ScriptedEngine, call, write_tools


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron_bridge.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    fn_path, yaml_path = write_tools(tmp_path_factory.mktemp("tools"))
    return load_tools(yaml_path, fn_path)


def _rollout(tok, tools, script, budget=400, **limits):
    mt = MultiTurnConfig(**{"max_parallel_calls": 2, "tool_timeout_s": 0.2, "max_tool_response_length": 40, **limits})
    engine = ScriptedEngine(tok, script)
    schemas = [t.schema for t in tools]
    rollout = AgentRollout(
        engine, tok, LoopSet("tool_agent", mt, tools), budget, TurnRenderer(tok, tok.eos_token_id, schemas)
    )
    return engine, rollout, schemas


def _prompt(tok, key, schemas):
    messages, tools_arg = messages_with_tools([{"role": "user", "content": f"[{key}] What is 2 plus 3?"}], schemas, tok)
    return apply_template(tok, messages, tools_arg)


def _run(tok, tools, script, n=1, **kw):
    engine, rollout, schemas = _rollout(tok, tools, script, **kw)
    keys = list(script)
    prompts = [_prompt(tok, k, schemas) for k in keys]
    rows = [{"data_source": "arith", "reward_model": {"ground_truth": "5"}, "extra_info": {}} for _ in keys]
    samples = rollout.generate(prompts, rows, SamplingParams(n=n, max_new_tokens=kw.get("budget", 400)))
    return engine, rollout, {k: samples[i * n : (i + 1) * n] for i, k in enumerate(keys)}


def _inserted_text(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample.response_ids, sample.response_mask) if m == 0])


ANSWER = "The answer is 5. #### 5"
SCRIPT = {
    "par": [call("add", a=2, b=3) + call("add", a=10, b=20) + call("add", a=7, b=7), ANSWER],
    "badjson": ['<tool_call>{"name": "add", "arguments": {"a": 2,}</tool_call>', ANSWER],
    "unknown": [call("nope", a=1), ANSWER],
    "raises": [call("boom", x=1), ANSWER],
    "slow": [call("slow", x=1), ANSWER],
    "badargs": [call("add", a=1) + call("add", a=1, b=2, c=3), ANSWER],
    "plain": [ANSWER],
}


def test_every_tool_call_path_becomes_a_response_and_the_run_goes_on(tok, tools):
    start = time.perf_counter()
    engine, rollout, out = _run(tok, tools, SCRIPT)
    assert time.perf_counter() - start < 5  # the slow tool was cut at tool_timeout_s (0.2 s), not awaited
    (par,) = out["par"]
    text = _inserted_text(tok, par)
    assert "<tool_response>\n5\n</tool_response>" in text and "<tool_response>\n30\n</tool_response>" in text
    assert "14" not in text  # max_parallel_calls=2: the third call is not run
    assert par.extra["tool_calls"] == 2 and par.extra["tool_errors"] == {}
    expected_errors = {
        "badjson": {"malformed": 1},
        "unknown": {"unknown_tool": 1},
        "raises": {"exception": 1},
        "slow": {"timeout": 1},
        "badargs": {"invalid_arguments": 2},
    }
    for key, errors in expected_errors.items():
        (s,) = out[key]
        assert s.extra["tool_errors"] == errors, key
        assert "Error: " in _inserted_text(tok, s), key  # the model sees the error text
        assert s.finish_reason == "stop" and s.num_turns == 4, key  # answered on the next turn
    assert "the tool broke" in _inserted_text(tok, out["raises"][0])
    assert "unknown tool 'nope'" in _inserted_text(tok, out["unknown"][0])
    (plain,) = out["plain"]
    assert plain.num_turns == 2 and 0 not in plain.response_mask and plain.extra["tool_calls"] == 0
    m = agent_metrics([s for group in out.values() for s in group])
    assert m["agent/tool_errors/timeout"] == 1 and m["agent/tool_errors/invalid_arguments"] == 2
    assert m["agent/tool_calls"] == 8 and m["agent/finish_reason/stop"] == 1.0


def test_concurrent_trajectories_share_one_engine_call_per_turn(tok, tools):
    engine, rollout, out = _run(tok, tools, SCRIPT, n=3)
    # 7 prompts x 3 samples: turn 1 is one call of 7 distinct prompts with n=3; turn 2 one call of
    # the 18 trajectories that called tools (the 3 "plain" ones had finished)
    assert [c["rows"] for c in engine.calls] == [21, 18]
    assert engine.calls[0]["n"] == 3
    assert rollout.last_stats["agent/engine_calls"] == 2


def test_ids_are_the_engine_ids_and_the_inserted_ids_and_the_mask_marks_exactly_the_inserted(tok, tools):
    engine, rollout, out = _run(tok, tools, {"par": SCRIPT["par"], "raises": SCRIPT["raises"]})
    renderer = TurnRenderer(tok, tok.eos_token_id, [t.schema for t in tools])
    for key, results in (("par", ["5", "30"]), ("raises", None)):
        (s,) = out[key]
        first = engine.answered[tuple(s.prompt_ids)]
        if results is None:
            results = ["Error: tool 'boom' raised RuntimeError: the tool broke"]
        names = ["add", "add"] if key == "par" else ["boom"]
        inserted = renderer.after_turn(first, renderer.tool_messages(list(zip(names, results))))
        second = engine.answered[tuple(s.prompt_ids + first + inserted)]
        assert s.response_ids == first + inserted + second
        assert s.response_mask == [1] * len(first) + [0] * len(inserted) + [1] * len(second)
        assert s.logprobs[len(first) : len(first) + len(inserted)] == [0.0] * len(inserted)
        assert s.logprobs[: len(first)] == [-0.01 * (k + 1) for k in range(len(first))]


def test_long_tool_responses_are_truncated_on_each_side():
    text = "".join(str(i % 10) for i in range(100))
    assert truncate_response(text, 10, "left") == "(truncated)..." + text[-10:]
    assert truncate_response(text, 10, "right") == text[:10] + "...(truncated)"
    assert truncate_response(text, 10, "middle") == text[:5] + "...(truncated)..." + text[-5:]
    assert truncate_response("short", 10, "left") == "short"


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_the_loop_truncates_what_the_model_sees(tok, tools, side):
    engine, rollout, out = _run(tok, tools, {"long": [call("digits", n=20), ANSWER]}, tool_response_truncate_side=side)
    seen = _inserted_text(tok, out["long"][0])
    assert truncate_response("0123456789" * 20, 40, side) in seen
    assert "0123456789" * 5 not in seen  # 50 digits in a row: not cut


def test_turn_limits(tok, tools):
    forever = {"loop": [call("add", a=1, b=1)]}
    _, _, out = _run(tok, tools, forever, max_assistant_turns=2)
    s = out["loop"][0]
    assert s.finish_reason == "max_assistant_turns" and s.extra["assistant_turns"] == 2
    assert s.extra["user_turns"] == 1 and s.num_turns == 4
    _, _, out = _run(tok, tools, forever, max_user_turns=2)
    s = out["loop"][0]
    assert s.finish_reason == "max_user_turns" and s.extra["user_turns"] == 2 and s.extra["assistant_turns"] == 3


def test_the_budget_bounds_all_turns_and_caps_each_call(tok, tools):
    forever = {"a": [call("add", a=1, b=1)], "b": [call("add", a=22, b=1) + "and a longer reply here"]}
    engine, _, out = _run(tok, tools, forever, budget=150)
    for s in (out["a"][0], out["b"][0]):
        assert len(s.response_ids) <= 150 and s.finish_reason == "length"
    # each call was capped by what its trajectory had left; later turns differ per row (one call, a cap each)
    assert engine.calls[0]["caps"] == [150, 150]
    assert any(c["listed"] and len(set(c["caps"])) == 2 for c in engine.calls)
    for c in engine.calls:
        assert all(1 <= cap <= 150 for cap in c["caps"])


def test_class_tools_lifecycle_step_rewards_and_calc_reward_reach_extra(tok, tools, tmp_path):
    import sys

    script = {"count": [call("counter", step=2), call("counter", step=3), ANSWER]}
    engine, rollout, schemas = _rollout(tok, tools, script)
    prompt = _prompt(tok, "count", schemas)
    row = {"data_source": "arith", "extra_info": {"tools_kwargs": {"counter": {"create_kwargs": {"start": 10}}}}}
    (s,) = rollout.generate([prompt], [row], SamplingParams(max_new_tokens=400))
    assert s.extra["tool_rewards"] == [0.5, 0.5]  # execute's step rewards
    assert s.extra["tool_calc_rewards"] == {"counter": 15.0}  # calc_reward at the trajectory's end
    assert "count=12" in _inserted_text(tok, s) and "count=15" in _inserted_text(tok, s)
    counter = next(t for t in tools if t.name == "counter")
    events = sys.modules[type(counter.obj).__module__].EVENTS
    assert [e[0] for e in events[-2:]] == ["create", "release"]  # one instance per trajectory
    assert events[-2][2] == {"start": 10}


def test_a_failing_loop_stops_the_rollout_with_its_name_and_leaves_no_trajectory_waiting(tok, tools):
    from rlstack.agent import AgentLoop

    class Fails(AgentLoop):
        async def run(self, prompt_ids, ctx):
            await ctx.generate(prompt_ids)
            if ctx.index == 1:
                raise KeyError("no such field")
            await ctx.generate(prompt_ids + [5])  # the others wait for a second turn
            raise AssertionError("never reached: the rollout stopped")

    engine, rollout, schemas = _rollout(tok, tools, {"a": [ANSWER], "b": [ANSWER], "c": [ANSWER]})
    loops = LoopSet("single_turn")
    loops.register("x", Fails())
    rollout.loops = loops
    prompts = [_prompt(tok, k, schemas) for k in "abc"]
    with pytest.raises(KeyError) as e:
        rollout.generate(prompts, [{"agent_name": "x"}] * 3, SamplingParams(max_new_tokens=50))
    assert any("in agent loop Fails (sample 1)" in note for note in e.value.__notes__)
    assert len(engine.calls) == 1  # the second turn never reached the engine
    assert not [t for t in __import__("asyncio").all_tasks(rollout._loop) if not t.done()]
    rollout.close()


def test_the_feedback_example_answers_a_wrong_first_answer_with_a_feedback_turn(tok, tools, monkeypatch):
    import os

    from rlstack.agent.setup import check_agent_config
    from rlstack.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.chdir(root)  # the example configs name their files relative to the repository
    for name in ("smollm2_arith_feedback_cpu.yaml", "smollm2_arith_tools_cpu.yaml"):
        check_agent_config(load_config(os.path.join("yaml_configs", name)))
    script = {"wrong": ["It is 4. #### 4", "Sorry, it is 5. #### 5"], "right": ["It is 5. #### 5"]}
    engine, rollout, schemas = _rollout(tok, [], script)
    loops = LoopSet("examples/agents/feedback.py:FeedbackLoop")
    rollout.loops = loops
    prompts = [_prompt(tok, k, []) for k in script]
    rows = [{"data_source": "arith", "reward_model": {"ground_truth": "5"}, "extra_info": {}}] * 2
    wrong, right = rollout.generate(prompts, rows, SamplingParams(max_new_tokens=400))
    assert right.num_turns == 2 and right.extra["first_correct"] is True and 0 not in right.response_mask
    assert wrong.num_turns == 4 and wrong.extra == {"first_correct": False, "feedback": True, "finish_reason": "stop"}
    assert (
        _inserted_text(tok, wrong)
        == "\n<|im_start|>user\nThat is not right, try again.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(wrong.response_ids).endswith("Sorry, it is 5. #### 5<|im_end|>")  # the last answer is scored
    assert [c["rows"] for c in engine.calls] == [2, 1]


def test_a_loop_output_is_cut_to_the_budget_and_checked(tok, tools):
    from rlstack.agent import AgentLoop, AgentOutput
    from rlstack.errors import UserError

    class Overlong(AgentLoop):
        async def run(self, prompt_ids, ctx):
            out = await ctx.generate(prompt_ids)
            pad = [7] * 100
            return AgentOutput(out.token_ids + pad, [1] * len(out.token_ids) + [0] * 100, out.logprobs + [0.0] * 100)

    class Uneven(AgentLoop):
        async def run(self, prompt_ids, ctx):
            return AgentOutput([1, 2, 3], [1, 1], [0.0, 0.0, 0.0])

    engine, rollout, schemas = _rollout(tok, tools, {"a": [ANSWER]}, budget=40)
    rollout.loops = LoopSet("single_turn")
    rollout.loops.register("long", Overlong())
    rollout.loops.register("uneven", Uneven())
    prompt = _prompt(tok, "a", schemas)
    (s,) = rollout.generate([prompt], [{"agent_name": "long"}], SamplingParams(max_new_tokens=40))
    assert len(s.response_ids) == len(s.response_mask) == len(s.logprobs) == 40 and s.finish_reason == "length"
    with pytest.raises(UserError, match="Uneven: AgentOutput has 3 response_ids, 2 response_mask"):
        rollout.generate([prompt], [{"agent_name": "uneven"}], SamplingParams(max_new_tokens=40))


def test_a_loop_or_tool_that_exits_is_a_user_error_naming_it(tok, tools, tmp_path):
    """sys.exit(0) inside user code would end the job with status 0 and nothing saved (issue 32)."""
    from rlstack.agent import AgentLoop
    from rlstack.agent.tools import load_tools
    from rlstack.errors import UserError

    class Exits(AgentLoop):
        async def run(self, prompt_ids, ctx):
            raise SystemExit(0)

    engine, rollout, schemas = _rollout(tok, tools, {"a": [ANSWER]})
    loops = LoopSet("single_turn")
    loops.register("x", Exits())
    rollout.loops = loops
    with pytest.raises(UserError, match="agent loop Exits raised SystemExit"):
        rollout.generate([_prompt(tok, "a", schemas)], [{"agent_name": "x"}], SamplingParams(max_new_tokens=50))
    rollout.close()

    quits = tmp_path / "quits.py"
    quits.write_text(
        'def quit_now(x: int) -> str:\n    """Stop.\n\n    Args:\n        x: any\n    """\n    raise SystemExit(0)\n'
    )
    exiting = load_tools("", str(quits))
    engine, rollout, schemas = _rollout(tok, exiting, {"q": [call("quit_now", x=1), ANSWER]})
    with pytest.raises(UserError, match="tool 'quit_now'.*raised SystemExit"):
        rollout.generate([_prompt(tok, "q", schemas)], [{}], SamplingParams(max_new_tokens=200))
    rollout.close()
