"""A two-turn agent loop: a wrong first answer gets a feedback turn, and the episode is scored at its end.

Used by yaml_configs/smollm2_arith_feedback_cpu.yaml (`rollout.agent_loop:
examples/agents/feedback.py:FeedbackLoop`). The policy answers; the loop checks that answer with
the row's built-in scorer (rlstack.rewards.SCORERS[data_source], e.g. `arith`); if it is wrong and
budget is left, the loop appends a user turn "That is not right, try again." (rendered once with
the chat template, as ids: mask 0) and the policy answers again. `reward` stays None: the reward
function scores the whole response, whose last answer is the second one (the `arith` scorer reads
the last number). `extra` (-> the reward function's extra_info["agent"]) says what happened.
"""

from rlstack.agent import AgentLoop, AgentOutput, Transcript
from rlstack.rewards import SCORERS

FEEDBACK = "That is not right, try again."


class FeedbackLoop(AgentLoop):
    async def run(self, prompt_ids, ctx) -> AgentOutput:
        t = Transcript(prompt_ids)
        first = await ctx.generate(t.context)
        t.add_generated(first)
        scorer = SCORERS.get(ctx.row.get("data_source"))
        if scorer is None or first.finish_reason == "length":
            return t.output(num_turns=2, extra={"first_correct": None, "feedback": False})
        text = ctx.tokenizer.decode(first.token_ids, skip_special_tokens=True)
        correct = scorer(text, ctx.row["reward_model"]["ground_truth"]) >= 1.0
        if correct:
            return t.output(num_turns=2, extra={"first_correct": True, "feedback": False})
        inserted = ctx.renderer.after_turn(first.token_ids, [{"role": "user", "content": FEEDBACK}])
        if len(t) + len(inserted) >= ctx.max_response_tokens:  # no room left for a second answer
            return t.output(num_turns=2, extra={"first_correct": False, "feedback": False, "finish_reason": "length"})
        t.add_inserted(inserted)
        second = await ctx.generate(t.context)
        t.add_generated(second)
        return t.output(num_turns=4, extra={"first_correct": False, "feedback": True})
