"""The agent driver inside the colocated step path (rlstack/stages.py, rlstack/step/agent.py).

A two-turn loop (`FILE.py:Class`) on the tiny random Llama with the hf engine, one rank:
`stages.generate` routes through the driver, `stages.build_rollout` trains on exactly
prompt + engine ids + inserted ids with the loss mask 0 exactly on the inserted ids; a loop's
reward replaces the scorer's, the scorer sees `extra_info["agent"]`; the step writes
`trainer.rollout_data_dir/<step>.jsonl` and logs agent/* metrics; a single_turn config without
agent rows keeps the engine's own path.
"""

import json
import os
import textwrap
from types import SimpleNamespace

import pytest

from rlstack import stages
from rlstack.config import RolloutConfig
from rlstack.data.dataset import Prompt
from rlstack.rollout.hf_engine import HFEngine

LOOP = textwrap.dedent(
    """
    from rlstack.agent import AgentLoop, Transcript

    class TwoTurns(AgentLoop):
        async def run(self, prompt_ids, ctx):
            t = Transcript(prompt_ids)
            first = await ctx.generate(t.context, max_new_tokens=5)
            t.add_generated(first)
            t.add_inserted(ctx.renderer.after_turn(first.token_ids, [{"role": "user", "content": "Again."}]))
            t.add_generated(await ctx.generate(t.context, max_new_tokens=5))
            reward = 7.0 if ctx.row["extra_info"].get("own") else None
            return t.output(num_turns=4, reward=reward, extra={"first": first.token_ids, "tool_calls": 1})
    """
)
GROUPS = SimpleNamespace(rank=0, dp_rank=0, dims=SimpleNamespace(world_size=1, dp=1), world=None, dp=None)


def _prompts(tok):
    from rlstack.agent.render import apply_template

    return [
        Prompt(i, apply_template(tok, [{"role": "user", "content": f"Copy {w}"}]), "copy", w, {"own": i == 1})
        for i, w in enumerate(("ab", "cd", "ef"))
    ]


class RecordingScorer:
    custom_fn = None

    def __init__(self):
        self.seen = []

    def score_batch(self, samples):
        self.seen += [s.extra_info for s in samples]
        return [SimpleNamespace(score=0.5, extra={}) for _ in samples]


def test_agent_loop_rollout_trains_engine_and_inserted_ids_with_mask_zero_on_inserted(model_dir, tok, tmp_path):
    from rlstack.step.agent import AgentRouting, step_records
    from rlstack.step.scoring import Scoring

    loop_file = tmp_path / "loop.py"
    loop_file.write_text(LOOP)
    cfg = RolloutConfig(n=2, max_new_tokens=40, micro_batch_size=4, temperature=1.0, agent_loop=f"{loop_file}:TwoTurns")
    engine = HFEngine(
        model_dir, SimpleNamespace(micro_batch_size=32, pack_weights=True), "cpu", tok.eos_token_id, 0, seed=0
    )
    routing = AgentRouting(cfg, engine, tok)
    prompts = _prompts(tok)
    gens, tokens = stages.generate(engine, prompts, cfg, GROUPS, 3, False, agent=routing.for_prompts(prompts))
    assert len(gens) == 6 and [g.prompt_index for g in gens] == [0, 0, 1, 1, 2, 2]
    rollout = stages.build_rollout(prompts, gens, [0.0] * 6, tok.pad_token_id, 2, "cpu", on_policy=True)
    inserted_somewhere = False
    for row, g in enumerate(gens):
        p, r, m = prompts[g.prompt_index].input_ids, g.agent.response_ids, g.agent.response_mask
        first = g.agent.extra["first"]
        assert r[: len(first)] == first and m[: len(first)] == [1] * len(first)
        assert rollout.tokens[row, : len(p) + len(r)].tolist() == p + r  # what the actor trains on
        mask = rollout.resp_mask[row].tolist()
        assert mask[: len(p)] == [0.0] * len(p) and mask[len(p) + len(r) :] == [0.0] * (len(mask) - len(p) - len(r))
        assert mask[len(p) : len(p) + len(r)] == [float(x) for x in m]  # 0 exactly on the inserted ids
        inserted_somewhere |= 0 in m
    assert inserted_somewhere and tokens == sum(len(g.response_ids) for g in gens)

    scorer = RecordingScorer()
    scores = Scoring(scorer, tok, None, GROUPS).score(prompts, gens)
    assert scores.values == [0.5, 0.5, 7.0, 7.0, 0.5, 0.5]  # row 1's loop reward replaces the scorer's
    assert [e["agent"]["first"] for e in scorer.seen] == [g.agent.extra["first"] for g in gens]

    run = SimpleNamespace(trainer=SimpleNamespace(rollout_data_dir=str(tmp_path / "dump")))
    metrics = step_records(run, 3, prompts, gens, scores.values, tok, GROUPS, gens)
    assert metrics["agent/num_turns/mean"] == 4.0 and metrics["agent/tool_calls"] == 6.0
    assert 0 < metrics["agent/inserted_token_share"] < 1
    lines = [json.loads(x) for x in open(os.path.join(run.trainer.rollout_data_dir, "3.jsonl"))]
    assert [x["response_mask"] for x in lines] == [g.response_mask for g in gens]
    assert [x["score"] for x in lines] == scores.values and {x["step"] for x in lines} == {3}


def test_single_turn_without_agent_rows_keeps_the_engine_path(model_dir, tok):
    from rlstack.step.agent import AgentRouting

    routing = AgentRouting(RolloutConfig(), None, tok)
    prompts = _prompts(tok)
    assert routing.for_prompts(prompts) is None and routing.driver is None
    prompts[2].agent_name = "single_turn"  # a row naming its loop goes through the driver
    assert routing.for_prompts(prompts) is not None


def test_agent_loops_with_split_placement_are_refused_at_preflight_in_one_line():
    from rlstack.agent.setup import check_agent_config
    from rlstack.config import PlacementConfig
    from rlstack.errors import UserError

    cfg = SimpleNamespace(rollout=RolloutConfig(agent_loop="tool_agent"), placement=PlacementConfig(rollout_ranks=1))
    with pytest.raises(UserError, match=r"placement.rollout_ranks=1.*set placement.rollout_ranks=0") as e:
        check_agent_config(cfg)
    assert "\n" not in str(e.value)
    check_agent_config(SimpleNamespace(rollout=RolloutConfig(), placement=PlacementConfig(rollout_ranks=1)))
    check_agent_config(SimpleNamespace(rollout=RolloutConfig(agent_loop="tool_agent"), placement=PlacementConfig()))


def test_rows_naming_loops_with_split_placement_are_refused(tok):
    from rlstack.agent.setup import check_agent_rows
    from rlstack.config import PlacementConfig
    from rlstack.errors import UserError

    prompts = _prompts(tok)
    data = SimpleNamespace(prompts=prompts)
    split = SimpleNamespace(placement=PlacementConfig(rollout_ranks=1))
    check_agent_rows(split, data, None)  # no row names a loop
    prompts[1].agent_name = "tool_agent"
    with pytest.raises(UserError, match=r"agent_name: tool_agent\) with placement.rollout_ranks=1"):
        check_agent_rows(split, None, data)
    check_agent_rows(SimpleNamespace(placement=PlacementConfig()), data)


def _validating_trainer(prompts, gens_for):
    """A Trainer with only what `validate` reads: the validation set in chunks of 2, a source whose
    greedy generate gives `gens_for(chunk)`, a scorer of 1.0 for every response."""
    from rlstack.trainer import Trainer

    class Source:
        def generate(self, chunk, step, greedy):
            assert greedy, "validation generates greedily"
            return gens_for(chunk), 0

    class Scorer:
        def score(self, prompts, gens, over_dp=True):
            return SimpleNamespace(values=[1.0] * len(gens))

        def metrics(self, scores, over_dp):
            return {}

    trainer = Trainer.__new__(Trainer)
    trainer.cfg = SimpleNamespace(data=SimpleNamespace(val_batch_size=2))
    trainer.val_set, trainer.source, trainer.scoring, trainer.step = prompts, Source(), Scorer(), 3
    trainer.phases = SimpleNamespace(enter=lambda phase: None)
    return trainer


def test_validation_logs_the_agent_metrics_under_val(tok):
    """Greedy multi-turn validation logs the step's agent/* metrics as val/agent/*: turns, tool calls
    and errors, stop reasons (over every validation sample, both chunks)."""
    from rlstack.agent.driver import AgentSample
    from rlstack.rollout.interface import Generation
    from rlstack.step.agent import step_records

    pool = [
        AgentSample([1], [5, 6, 7, 8], [1, 0, 0, 1], [-1.0, 0.0, 0.0, -1.0], 4, "stop", None, {"tool_calls": 2}),
        AgentSample([1], [5, 6], [1, 1], [-1.0, -1.0], 2, "length", None, {"tool_errors": {"timeout": 1}}),
        AgentSample([1], [5, 6, 7], [1, 0, 1], [-1.0, 0.0, -1.0], 6, "max_assistant_turns", None, {"tool_calls": 1}),
    ]
    made = []

    def agent_gens(chunk):
        out = []
        for i, _ in enumerate(chunk):
            s = pool[len(made)]
            out.append(Generation(i, s.prompt_ids, s.response_ids, s.logprobs, s.finish_reason, s.response_mask, s))
            made.append(out[-1])
        return out

    prompts = _prompts(tok)
    metrics = _validating_trainer(prompts, agent_gens).validate()
    assert len(made) == 3 and metrics["val/accuracy"] == 1.0
    assert metrics["val/agent/num_turns/mean"] == 4.0 and metrics["val/agent/num_turns/max"] == 6.0
    assert metrics["val/agent/tool_calls"] == 3.0 and metrics["val/agent/tool_errors/timeout"] == 1.0
    assert metrics["val/agent/finish_reason/stop"] == pytest.approx(1 / 3)
    assert metrics["val/agent/inserted_token_share"] == pytest.approx(3 / 9)
    training = step_records(
        SimpleNamespace(trainer=SimpleNamespace(rollout_data_dir="")), 1, [], [], [], tok, GROUPS, made
    )
    assert {k: v for k, v in metrics.items() if k.startswith("val/agent/")} == {
        "val/" + k: v for k, v in training.items()
    }

    def plain_gens(chunk):
        return [Generation(i, [1], [5], [-1.0], "stop") for i, _ in enumerate(chunk)]

    plain = _validating_trainer(prompts, plain_gens).validate()
    assert "val/accuracy" in plain and not any(k.startswith("val/agent/") for k in plain)  # single-turn: none
