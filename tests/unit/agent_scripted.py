"""A scripted rollout engine and tool files for the agent tests (no model: fixed replies)."""

from __future__ import annotations

import re
import textwrap

from rlstack.rollout.base import Generation

MARKER = re.compile(r"\[(\w+)\]")


class ScriptedEngine:
    """Replies by script: the prompt's `[key]` marker picks a list of replies, the number of
    assistant turns already in the context picks the reply. A reply ending in "..." gets no eos.
    Records every call (rows, n, caps) and every (context -> reply ids) it answered."""

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tok = tokenizer
        self.eos = tokenizer.eos_token_id
        self.script = script
        self.calls: list[dict] = []
        self.answered: dict[tuple, list[int]] = {}

    def reply_ids(self, context: list[int]) -> list[int]:
        text = self.tok.decode(context)
        replies = self.script[MARKER.search(text).group(1)]
        reply = replies[min(text.count("<|im_start|>assistant") - 1, len(replies) - 1)]
        ids = self.tok.encode(reply, add_special_tokens=False)
        return ids if reply.endswith("...") else ids + [self.eos]

    def generate(self, prompts, params, max_new_tokens=None):
        caps = max_new_tokens or [params.max_new_tokens] * len(prompts)
        self.calls.append(
            {"rows": len(prompts) * params.n, "n": params.n, "caps": list(caps), "listed": max_new_tokens is not None}
        )
        gens = []
        for i, prompt in enumerate(prompts):
            full = self.reply_ids(prompt)
            cut = full[: caps[i]]
            self.answered[tuple(prompt)] = cut
            for _ in range(params.n):
                logprobs = [-0.01 * (k + 1) for k in range(len(cut))]
                gens.append(
                    Generation(
                        i,
                        list(prompt),
                        list(cut),
                        logprobs,
                        "stop" if cut == full and cut[-1] == self.eos else "length",
                    )
                )
        return gens


FUNCTION_TOOLS = textwrap.dedent(
    '''
    import asyncio


    def add(a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return str(a + b)


    def boom(x: int) -> str:
        """A tool that always fails.

        Args:
            x: Anything.
        """
        raise RuntimeError("the tool broke")


    async def slow(x: int) -> str:
        """A tool that never answers in time.

        Args:
            x: Anything.
        """
        await asyncio.sleep(30)
        return "late"


    def digits(n: int) -> str:
        """n repetitions of 0123456789.

        Args:
            n: How many.
        """
        return "0123456789" * n
    '''
)

CLASS_TOOL = textwrap.dedent(
    '''
    EVENTS = []


    class CounterTool:
        """verl's BaseTool shape, duck-typed: create / execute / calc_reward / release."""

        def __init__(self, config, tool_schema):
            self.config = config
            self.tool_schema = tool_schema
            self.name = tool_schema.function.name  # verl's BaseTool reads it this way
            self.counts = {}

        async def create(self, instance_id=None, create_kwargs=None, **kwargs):
            instance_id = f"i{len(self.counts)}"
            self.counts[instance_id] = (create_kwargs or {}).get("start", 0)
            EVENTS.append(("create", instance_id, create_kwargs))
            return instance_id, None

        async def execute(self, instance_id, parameters, **kwargs):
            self.counts[instance_id] += parameters.get("step", 1)
            return f"count={self.counts[instance_id]}", self.config["step_reward"], {}

        async def calc_reward(self, instance_id, **kwargs):
            return float(self.counts[instance_id])

        async def release(self, instance_id, **kwargs):
            EVENTS.append(("release", instance_id, None))
    '''
)

TOOL_YAML = textwrap.dedent(
    """
    tools:
      - class_name: {path}:CounterTool
        config: {{type: native, step_reward: 0.5}}
        tool_schema:
          type: function
          function:
            name: counter
            description: Count up.
            parameters:
              type: object
              properties:
                step: {{type: integer, description: how much}}
              required: []
    """
)


def write_tools(tmp_path):
    """(function tool file, tool yaml) in tmp_path."""
    fn_path = tmp_path / "fn_tools.py"
    fn_path.write_text(FUNCTION_TOOLS)
    cls_path = tmp_path / "counter_tool.py"
    cls_path.write_text(CLASS_TOOL)
    yaml_path = tmp_path / "tools.yaml"
    yaml_path.write_text(TOOL_YAML.format(path=cls_path))
    return str(fn_path), str(yaml_path)


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
