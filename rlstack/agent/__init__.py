"""Agent rollouts: multi-turn generation with tools, token in and token out (docs/agents.md).

Public API: `from rlstack.agent import AgentLoop, AgentOutput`. The trainer's entry points are in
`rlstack.agent.setup` (building the rollout from the config) and `rlstack.agent.records` (the
per-step jsonl dump and metrics).
"""

from rlstack.agent.base import AgentContext, AgentLoop, AgentOutput, Transcript, TurnOutput

__all__ = ["AgentContext", "AgentLoop", "AgentOutput", "Transcript", "TurnOutput"]
