"""Building agent rollouts from the config: what the trainer and preflight call.

- `check_agent_config(cfg)` (preflight): the loop name and the tools load, one line each otherwise.
- `prompt_tool_schemas(rollout_cfg)`: the tool schemas prompts are rendered with (the dataset's
  `tools`), [] when no tool is configured.
- `build_agent_rollout(rollout_cfg, engine, tokenizer, eos_token_id)`: the `AgentRollout` whose
  `generate(prompts, rows, params)` replaces `engine.generate(prompts, params)`.
"""

from __future__ import annotations

from typing import Any

from rlstack.agent.driver import AgentRollout
from rlstack.agent.registry import LoopSet, check_loop_name
from rlstack.agent.render import TurnRenderer
from rlstack.agent.tools import check_tools, load_tools


def uses_agent_loops(rollout_cfg) -> bool:
    """Whether samples go through the agent driver (rows may still pick loops by agent_name)."""
    return rollout_cfg.agent_loop != "single_turn" or bool(_tool_paths(rollout_cfg))


def check_agent_config(cfg) -> None:
    """Preflight: rollout.agent_loop names a loop that loads; the configured tools load."""
    check_loop_name(cfg.rollout.agent_loop)
    check_tools(cfg.rollout.multi_turn)


def _tool_paths(rollout_cfg) -> list[str]:
    mt = rollout_cfg.multi_turn
    return [p for p in (mt.tool_config_path, mt.function_tool_path) if p]


def prompt_tool_schemas(rollout_cfg, tools: Any = None) -> list[dict]:
    if tools is None:
        tools = load_tools(rollout_cfg.multi_turn.tool_config_path, rollout_cfg.multi_turn.function_tool_path)
    return [t.schema for t in tools]


def build_agent_rollout(rollout_cfg, engine, tokenizer, eos_token_id: int) -> AgentRollout:
    mt = rollout_cfg.multi_turn
    tools = load_tools(mt.tool_config_path, mt.function_tool_path)
    loops = LoopSet(rollout_cfg.agent_loop, mt, tools)
    renderer = TurnRenderer(tokenizer, eos_token_id, [t.schema for t in tools])
    return AgentRollout(engine, tokenizer, loops, rollout_cfg.max_new_tokens, renderer)
