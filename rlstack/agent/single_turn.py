"""`single_turn`: one generation per prompt (today's rollout, as a loop)."""

from __future__ import annotations

from rlstack.agent.base import AgentContext, AgentLoop, AgentOutput


class SingleTurnLoop(AgentLoop):
    async def run(self, prompt_ids: list[int], ctx: AgentContext) -> AgentOutput:
        out = await ctx.generate(prompt_ids)
        return AgentOutput(out.token_ids, [1] * len(out.token_ids), out.logprobs, num_turns=2)  # verl: prompt + reply
