"""`tool_agent`: the built-in tool loop (verl's ToolAgentLoop, over token ids).

generate -> parse Hermes tool calls -> run up to `max_parallel_calls` of them concurrently ->
render their results once as ids -> generate again, until the model answers without a call, a
turn limit or the budget. Nothing a tool or a call does stops the run: a malformed call, an
unknown tool, invalid arguments, a raising tool and one past `tool_timeout_s` each become the
tool's response (the error text, which the model sees) and are counted by kind in
`extra["tool_errors"]`. Limits keep verl's names and meaning (rollout.multi_turn.*; 0 = no limit).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Optional

from rlstack.agent.base import AgentContext, AgentLoop, AgentOutput, Transcript
from rlstack.agent.parser import ParsedCall, parse_hermes
from rlstack.agent.tools import Tool
from rlstack.errors import UserError


class _ToolExited(Exception):
    """A tool raised SystemExit or KeyboardInterrupt (its name is the message)."""


ERROR_KINDS = ("malformed", "unknown_tool", "invalid_arguments", "exception", "timeout")
TRUNCATE_SIDES = ("left", "right", "middle")


def truncate_response(text: str, limit: int, side: str) -> str:
    """verl's truncation of a long tool response (characters): `left` keeps the end, `right` the
    start, `middle` both ends."""
    if limit <= 0 or len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class _Session:
    """One trajectory's tool instances and counters."""

    def __init__(self, row: dict):
        self.tools_kwargs = (row.get("extra_info") or {}).get("tools_kwargs") or {}
        self.instances: dict[str, Optional[str]] = {}  # tool name -> instance id
        self.errors: Counter = Counter()
        self.calls = 0
        self.rewards: list[float] = []


class ToolAgentLoop(AgentLoop):
    def __init__(self, tools: list[Tool], multi_turn: Any):
        self.tools = {t.name: t for t in tools}
        self.cfg = multi_turn

    async def run(self, prompt_ids: list[int], ctx: AgentContext) -> AgentOutput:
        session = _Session(ctx.row)
        t = Transcript(prompt_ids)
        assistant_turns = user_turns = 0
        try:
            while True:
                out = await ctx.generate(t.context)
                t.add_generated(out)
                assistant_turns += 1
                finish = self._stop_reason(out, ctx, t, assistant_turns, user_turns)
                if finish:
                    break
                calls = parse_hermes(ctx.tokenizer.decode(out.token_ids, skip_special_tokens=False))
                if not calls:
                    finish = out.finish_reason
                    break
                calls = calls[: self.cfg.max_parallel_calls] if self.cfg.max_parallel_calls > 0 else calls
                results = await asyncio.gather(*(self._call(c, session) for c in calls))
                messages = ctx.renderer.tool_messages(list(zip([c.name or "error" for c in calls], results)))
                inserted = ctx.renderer.after_turn(out.token_ids, messages, [c.as_message_call() for c in calls])
                if len(t) + len(inserted) >= ctx.max_response_tokens:  # no room to answer (verl stops too)
                    finish = "length"
                    break
                t.add_inserted(inserted)
                user_turns += 1
        finally:
            calc = await self._close(session)
        extra = {
            "finish_reason": finish,
            "assistant_turns": assistant_turns,
            "user_turns": user_turns,
            "tool_calls": session.calls,
            "tool_errors": dict(session.errors),
            "tool_rewards": session.rewards,
            "tool_calc_rewards": calc,
        }
        return t.output(num_turns=assistant_turns + user_turns + 1, extra=extra)  # verl's count: + the prompt

    def _stop_reason(self, out, ctx: AgentContext, t: Transcript, assistant_turns: int, user_turns: int) -> str:
        if out.finish_reason == "length" or len(t) >= ctx.max_response_tokens:
            return "length"
        if self.cfg.max_assistant_turns and assistant_turns >= self.cfg.max_assistant_turns:
            return "max_assistant_turns"
        if self.cfg.max_user_turns and user_turns >= self.cfg.max_user_turns:
            return "max_user_turns"
        return ""

    async def _call(self, call: ParsedCall, session: _Session) -> str:
        """The text the model sees for one call: the tool's response (truncated), or the error (whole, as verl)."""
        session.calls += 1
        kind, text = await self._execute(call, session)
        if kind:
            session.errors[kind] += 1
            return f"Error: {text}"
        return truncate_response(text, self.cfg.max_tool_response_length, self.cfg.tool_response_truncate_side)

    async def _execute(self, call: ParsedCall, session: _Session) -> tuple[str, str]:
        """(error kind or "", text)."""
        if call.error:
            return "malformed", call.error
        tool = self.tools.get(call.name)
        if tool is None:
            return "unknown_tool", f"unknown tool '{call.name}'; available tools: {sorted(self.tools)}"
        bad = tool.argument_error(call.arguments)
        if bad:
            return "invalid_arguments", bad
        timeout = self.cfg.tool_timeout_s if self.cfg.tool_timeout_s > 0 else None
        try:
            result = await asyncio.wait_for(self._run_tool(tool, call.arguments, session), timeout)
        except TimeoutError:
            return "timeout", f"tool '{call.name}' did not answer within {self.cfg.tool_timeout_s} s"
        except _ToolExited as e:  # exit() in a tool would end the job, with status 0 for exit(0)
            raise UserError(
                f"tool '{call.name}' ({tool.source}) raised {e}: a tool must return its result, not exit; "
                "fix the tool (rollout.multi_turn.tool_config_path / function_tool_path)"
            ) from None
        except Exception as e:  # a tool's own bug: the model sees it, the run goes on
            return "exception", f"tool '{call.name}' raised {type(e).__name__}: {e}"
        if result.reward is not None:
            session.rewards.append(result.reward)
        return "", result.text

    async def _run_tool(self, tool: Tool, arguments: dict, session: _Session):
        try:
            if tool.name not in session.instances:
                session.instances[tool.name] = None  # reserved: a failing create is not retried
                kwargs = (session.tools_kwargs.get(tool.name) or {}).get("create_kwargs") or {}
                session.instances[tool.name] = await tool.create(kwargs)
            return await tool.execute(session.instances[tool.name], arguments)
        except (SystemExit, KeyboardInterrupt) as e:  # caught here: asyncio would let them end the event loop
            raise _ToolExited(type(e).__name__) from None

    async def _close(self, session: _Session) -> dict[str, float]:
        """calc_reward then release every instance of the trajectory; their failures are counted too."""
        rewards = {}
        for name, instance_id in session.instances.items():
            tool = self.tools[name]
            try:
                reward = await tool.calc_reward(instance_id)
                if reward is not None:
                    rewards[name] = reward
                await tool.release(instance_id)
            except Exception:
                session.errors["exception"] += 1
        return rewards
