"""Agent rollouts in the step (docs/agents.md): when the agent driver generates, and what a step logs.

The agent loop is one more way a source's rollout is produced, not a step of its own: the colocated
source hands `stages.generate` an `AgentRollout` (built once, over the source's engine) whenever
`rollout.agent_loop`/the tools say so or a prompt carries `agent_name`; otherwise the plain engine
path runs (single_turn samples are the same either way: tests/unit/test_agent_hf.py).
"""

from __future__ import annotations

from typing import Any, Optional

from rlstack.workers.batch import gather_objects


class AgentRouting:
    """Whether a list of prompts goes through the agent driver, and the driver (built on first use)."""

    def __init__(self, rollout_cfg, engine, tokenizer):
        from rlstack.agent.setup import uses_agent_loops

        self.rollout_cfg, self.engine, self.tokenizer = rollout_cfg, engine, tokenizer
        self.configured = uses_agent_loops(rollout_cfg)
        self.driver: Optional[Any] = None  # rlstack.agent.driver.AgentRollout

    def for_prompts(self, prompts: list):
        """The driver when these prompts need it (the config's loop or tools, or a row's agent_name), else None."""
        if not (self.configured or any(getattr(p, "agent_name", "") for p in prompts)):
            return None
        if self.driver is None:
            from rlstack.agent.setup import build_agent_rollout

            eos = self.tokenizer.eos_token_id
            self.driver = build_agent_rollout(self.rollout_cfg, self.engine, self.tokenizer, eos)
        return self.driver

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()


def step_records(cfg, step: int, prompts: list, gens: list, scores: list, tokenizer, groups, global_gens: list) -> dict:
    """The step's agent metrics over `global_gens` (every rank's samples: the same on every rank,
    no reduction) and, with `trainer.rollout_data_dir`, DIR/<step>.jsonl of this DP rank's scored
    share (`gens`, `scores`) gathered over the DP ranks and written by global rank 0 (one file per step)."""
    from rlstack.agent.records import agent_metrics

    samples = [g.agent for g in global_gens if getattr(g, "agent", None) is not None]
    metrics = agent_metrics(samples) if samples else {}
    if cfg.trainer.rollout_data_dir:
        write_step_file(cfg.trainer.rollout_data_dir, step, prompts, gens, scores, tokenizer, groups)
    return metrics


def val_records(gens: list) -> dict:
    """Validation's agent metrics: the step's `agent/*` over the greedy validation samples, under
    `val/` (`val/agent/num_turns/mean`, `val/agent/finish_reason/stop`, ...). Every rank generated
    every validation sample (Trainer.validate): no reduction. {} when no sample went through a loop."""
    from rlstack.agent.records import agent_metrics

    samples = [g.agent for g in gens if getattr(g, "agent", None) is not None]
    return agent_metrics(samples, prefix="val/agent/") if samples else {}


def write_step_file(directory: str, step: int, prompts: list, gens: list, scores: list, tokenizer, groups) -> None:
    """DIR/<step>.jsonl of every DP rank's samples (rank 0 writes; all DP ranks join the gather)."""
    from rlstack.agent.records import write_rollout_data

    local = [
        (_as_sample(g), tokenizer.decode(prompts[g.prompt_index].input_ids), tokenizer.decode(g.response_ids), float(s))
        for g, s in zip(gens, scores)
    ]
    everything = gather_objects(local, groups.dp, groups.dims.dp)
    if groups.rank == 0:
        samples, inputs, outputs, values = (list(x) for x in zip(*everything)) if everything else ([], [], [], [])
        write_rollout_data(directory, step, samples, inputs, outputs, values)


def _as_sample(gen):
    """An AgentSample for the rollout file; a plain generation is one policy turn (mask all 1)."""
    from rlstack.agent.driver import AgentSample

    if getattr(gen, "agent", None) is not None:
        return gen.agent
    ids = list(gen.response_ids)
    return AgentSample(list(gen.prompt_ids), ids, [1] * len(ids), list(gen.logprobs), 1, gen.finish_reason, None)
