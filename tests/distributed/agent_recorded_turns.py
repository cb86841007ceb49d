"""A two-turn loop that records each turn as it happened (tests/distributed/test_agent_layouts.py).

`extra["turns"]` is `[[1, ids the engine returned], [0, ids the loop inserted], [1, ...]]`, taken
from `ctx.generate`'s result and the renderer's ids before they reach the Transcript: the test
rebuilds the trained ids and the loss mask from it, independently of the trainer's path.
"""

from rlstack.agent import AgentLoop, Transcript


class RecordedTurns(AgentLoop):
    async def run(self, prompt_ids, ctx):
        t = Transcript(prompt_ids)
        turns = []
        first = await ctx.generate(t.context, max_new_tokens=3)
        turns.append([1, list(first.token_ids)])
        t.add_generated(first)
        inserted = ctx.renderer.after_turn(first.token_ids, [{"role": "user", "content": "Again."}])
        turns.append([0, list(inserted)])
        t.add_inserted(inserted)
        second = await ctx.generate(t.context, max_new_tokens=3)
        turns.append([1, list(second.token_ids)])
        t.add_generated(second)
        return t.output(num_turns=4, extra={"turns": turns})
