"""Which loop makes each sample: `rollout.agent_loop`, or a row's `agent_name` (verl's column).

A name is a built-in (`single_turn`, `tool_agent`) or `FILE.py:ClassName`, a user's `AgentLoop`
subclass built with no arguments. Every mistake is one line naming the fix (`check_loop_name`,
which preflight can call, raises the same ones).
"""

from __future__ import annotations

from typing import Any, Optional

from rlstack.agent.base import AgentLoop
from rlstack.errors import UserError

BUILTIN_LOOPS = ("single_turn", "tool_agent")
ALIASES = {"single_turn_agent": "single_turn"}  # verl's name, as verl datasets write it in agent_name


def load_loop_class(spec: str, where: str = "rollout.agent_loop") -> type:
    """`FILE.py:ClassName` -> the class, checked to be an AgentLoop subclass."""
    from rlstack.agent.tools import import_file

    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise UserError(f"{where}={spec!r} is not a loop: use one of {', '.join(BUILTIN_LOOPS)} or FILE.py:ClassName")
    module = import_file(path, f"{where}={spec}")
    cls = getattr(module, name, None)
    if cls is None:
        raise UserError(f"{where}={spec}: {path} has no {name}: fix the class name after the colon")
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise UserError(
            f"{where}={spec}: {name} is not an AgentLoop: subclass rlstack.agent.AgentLoop and implement async run()"
        )
    return cls


def check_loop_name(spec: str, where: str = "rollout.agent_loop") -> None:
    if ALIASES.get(spec, spec) not in BUILTIN_LOOPS:
        load_loop_class(spec, where)


class LoopSet:
    """One instance per loop name, built on first use; `for_row` picks a row's loop."""

    def __init__(self, default: str, multi_turn: Any = None, tools: Optional[list] = None):
        self.default = default
        self.multi_turn = multi_turn
        self.tools = tools
        self._loops: dict[str, AgentLoop] = {}
        check_loop_name(default)

    def register(self, name: str, loop: AgentLoop) -> None:
        """Use `loop` for rows whose agent_name is `name` (a loop built in code, e.g. in tests)."""
        self._loops[name] = loop

    def for_row(self, row: dict) -> AgentLoop:
        name = row.get("agent_name") or self.default
        name = ALIASES.get(name, name)
        if name not in self._loops:
            self._loops[name] = self._build(name, "agent_name" if row.get("agent_name") else "rollout.agent_loop")
        return self._loops[name]

    def _build(self, name: str, where: str) -> AgentLoop:
        if name == "single_turn":
            from rlstack.agent.single_turn import SingleTurnLoop

            return SingleTurnLoop()
        if name == "tool_agent":
            from rlstack.agent.tool_agent import ToolAgentLoop
            from rlstack.agent.tools import load_tools

            if self.tools is None:
                mt = self.multi_turn
                self.tools = load_tools(mt.tool_config_path, mt.function_tool_path) if mt is not None else []
            return ToolAgentLoop(self.tools, self.multi_turn)
        try:
            return load_loop_class(name, where)()
        except UserError:
            raise
        except Exception as e:
            raise UserError(
                f"{where}={name}: building the loop raised {type(e).__name__}: {e}: fix its __init__"
            ) from e
