"""Agent rollouts on a real (tiny, random) transformers model with the hf engine: per-prompt caps,
and a two-turn loop whose trained ids and log-probs are exactly what the model generated in context."""

from types import SimpleNamespace

import pytest
import torch

from rlstack.agent import AgentLoop, Transcript
from rlstack.agent.driver import AgentRollout
from rlstack.agent.registry import LoopSet
from rlstack.agent.render import TurnRenderer, apply_template
from rlstack.rollout.base import SamplingParams
from rlstack.rollout.hf_engine import HFEngine


def _engine(model_dir, eos, seed=0):
    cfg = SimpleNamespace(micro_batch_size=32, pack_weights=True)
    return HFEngine(model_dir, cfg, "cpu", eos_token_id=eos, pad_token_id=0, seed=seed)


PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65]]


def test_one_cap_per_prompt_is_the_uniform_run_when_equal_and_cuts_rows_when_not(model_dir):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=7, seed=3)
    plain = _engine(model_dir, eos=-1).generate(PROMPTS, params)
    listed = _engine(model_dir, eos=-1).generate(PROMPTS, params, max_new_tokens=[7, 7, 7])
    assert [(g.response_ids, g.logprobs, g.finish_reason) for g in listed] == [
        (g.response_ids, g.logprobs, g.finish_reason) for g in plain
    ]  # equal caps: bit for bit today's call
    greedy = SamplingParams(greedy=True, max_new_tokens=7)
    full = _engine(model_dir, eos=-1).generate(PROMPTS, greedy)
    capped = _engine(model_dir, eos=-1).generate(PROMPTS, greedy, max_new_tokens=[3, 7, 5])
    for g, f, cap in zip(capped, full, [3, 7, 5]):
        assert len(g.response_ids) == cap and g.finish_reason == "length"
        assert g.response_ids == f.response_ids[:cap]
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(f.logprobs[:cap]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one cap >= 1 per prompt"):
        _engine(model_dir, eos=-1).generate(PROMPTS, greedy, max_new_tokens=[3, 0, 5])


class TwoTurns(AgentLoop):
    """Answer in at most 6 tokens, get a fixed user turn, answer again."""

    async def run(self, prompt_ids, ctx):
        t = Transcript(prompt_ids)
        first = await ctx.generate(t.context, max_new_tokens=6)
        t.add_generated(first)
        t.add_inserted(ctx.renderer.after_turn(first.token_ids, [{"role": "user", "content": "Try again."}]))
        t.add_generated(await ctx.generate(t.context))
        return t.output(num_turns=4, extra={"first": first.token_ids})


def test_a_two_turn_loop_trains_on_exactly_the_ids_and_log_probs_the_model_generated(model_dir, tok, monkeypatch):
    import rlstack.agent.registry as registry

    monkeypatch.setattr(registry, "load_loop_class", lambda spec, where="": TwoTurns)
    engine = _engine(model_dir, eos=tok.eos_token_id, seed=1)
    calls = []
    generate = engine.generate
    monkeypatch.setattr(
        engine, "generate", lambda p, params, **kw: calls.append(len(p) * params.n) or generate(p, params, **kw)
    )
    renderer = TurnRenderer(tok, tok.eos_token_id)
    rollout = AgentRollout(engine, tok, LoopSet("test.py:TwoTurns"), 60, renderer)
    prompts = [apply_template(tok, [{"role": "user", "content": f"What is {a} plus 2?"}]) for a in (3, 14, 25)]
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=60, seed=5)
    samples = rollout.generate(prompts, [{}] * 3, params)
    assert calls == [6, 6]  # two turns, each one batched call over the six trajectories
    assert engine.metrics()["rollout/kv_reused_tokens"] > 0  # the second turn ran on the first's KV
    model = engine.model
    for s in samples:
        first = s.extra["first"]
        inserted = renderer.after_turn(first, [{"role": "user", "content": "Try again."}])
        second = s.response_ids[len(first) + len(inserted) :]
        assert len(first) > 0 and len(second) > 0
        assert s.response_ids == first + inserted + second and len(s.response_ids) <= 60
        assert s.response_mask == [1] * len(first) + [0] * len(inserted) + [1] * len(second)
        # the log-probs the engine gave are the model's, teacher-forced on the full trained sequence
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1] / params.temperature
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        mask = torch.tensor(s.response_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(s.logprobs)[mask], ref[mask], rtol=1e-4, atol=1e-4)


def test_single_turn_through_the_driver_samples_exactly_what_the_engine_samples(model_dir, tok):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=2)
    direct = _engine(model_dir, eos=tok.eos_token_id).generate(PROMPTS, params)
    rollout = AgentRollout(_engine(model_dir, eos=tok.eos_token_id), tok, LoopSet("single_turn"), 8)
    samples = rollout.generate(PROMPTS, [{}] * 3, params)
    assert [(s.response_ids, s.logprobs, s.finish_reason) for s in samples] == [
        (g.response_ids, g.logprobs, g.finish_reason) for g in direct
    ]
    assert all(s.response_mask == [1] * len(s.response_ids) and s.num_turns == 2 for s in samples)
