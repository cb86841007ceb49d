"""A two-turn feedback loop for the tiny `copy` task (tests/e2e/test_agent_run.py).

The policy answers in one token; a wrong answer gets a user turn "No. Try again." (rendered once
with the chat template, as ids: mask 0) and one more token. The loop scores the episode itself
(`reward`, which replaces the reward function): 1.0 right at once, 0.5 right after the feedback,
else 0.0; `extra` says which.
"""

from rlstack.agent import AgentLoop, Transcript
from rlstack.rewards import SCORERS

FEEDBACK = "No. Try again."


class CopyFeedback(AgentLoop):
    async def run(self, prompt_ids, ctx):
        t = Transcript(prompt_ids)
        score = SCORERS[ctx.row["data_source"]]
        truth = ctx.row["reward_model"]["ground_truth"]
        first = await ctx.generate(t.context, max_new_tokens=1)
        t.add_generated(first)
        if score(ctx.tokenizer.decode(first.token_ids, skip_special_tokens=True), truth) >= 1.0:
            return t.output(num_turns=2, reward=1.0, extra={"first_correct": 1.0})
        t.add_inserted(ctx.renderer.after_turn(first.token_ids, [{"role": "user", "content": FEEDBACK}]))
        second = await ctx.generate(t.context, max_new_tokens=1)
        t.add_generated(second)
        right = score(ctx.tokenizer.decode(second.token_ids, skip_special_tokens=True), truth) >= 1.0
        return t.output(num_turns=4, reward=0.5 if right else 0.0, extra={"first_correct": 0.0})
