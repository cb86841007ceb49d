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
from rlstack.errors import UserError


def uses_agent_loops(rollout_cfg) -> bool:
    """Whether samples go through the agent driver (rows may still pick loops by agent_name)."""
    return rollout_cfg.agent_loop != "single_turn" or bool(_tool_paths(rollout_cfg))


def check_agent_config(cfg) -> None:
    """Preflight: rollout.agent_loop names a loop that loads; the configured tools load."""
    check_loop_name(cfg.rollout.agent_loop)
    check_tools(cfg.rollout.multi_turn)
    if uses_agent_loops(cfg.rollout) and cfg.placement.rollout_ranks > 0:
        raise UserError(
            f"rollout.agent_loop={cfg.rollout.agent_loop!r} (or rollout.multi_turn tools) with "
            f"placement.rollout_ranks={cfg.placement.rollout_ranks}: the split placement's rollout ranks do not "
            "run agent loops yet (no agent driver on the rollout-only ranks, no response_mask in its hand-off): "
            "set placement.rollout_ranks=0 (colocated)"
        )


def check_agent_rows(cfg, *datasets) -> None:
    """Rows naming a loop (`agent_name`) need the colocated placement too (the data is only known once built)."""
    if cfg.placement.rollout_ranks <= 0:
        return
    for dataset in datasets:
        named = sorted({p.agent_name for p in (dataset.prompts if dataset is not None else []) if p.agent_name})
        if named:
            raise UserError(
                f"data rows name agent loops (agent_name: {', '.join(named)}) with placement.rollout_ranks="
                f"{cfg.placement.rollout_ranks}: the split placement's rollout ranks do not run agent loops yet: "
                "set placement.rollout_ranks=0 (colocated) or drop the agent_name column"
            )


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
    return AgentRollout(engine, tokenizer, loops, rollout_cfg.max_new_tokens, renderer, mt.kv_cache_mb)
