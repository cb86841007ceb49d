"""Colocated rollout source: every rank syncs its own engine, generates its share, scores it."""

from __future__ import annotations

import time

from rlstack import stages
from rlstack.rollout import sync_check
from rlstack.step import StepBatch
from rlstack.step.metrics import engine_metrics


class ColocatedSource:
    """`RolloutSource` (rlstack/step/__init__.py) over an engine on every rank.

    A step: sync (the actor's weights into the engine, `rollout.verify_sync` probe when due),
    rollout (the global batch split over the rollout replicas, gathered), this DP rank's share
    scored and padded.
    """

    def __init__(self, cfg, groups, engine, weight_sync, actor, train_set, sampler, tokenizer, scoring, phases):
        self.cfg, self.groups = cfg, groups
        self.engine, self.weight_sync, self.actor = engine, weight_sync, actor
        self.train_set, self.sampler, self.tokenizer = train_set, sampler, tokenizer
        self.scoring, self.phases = scoring, phases
        from rlstack.step.agent import AgentRouting

        self.agent = AgentRouting(cfg.rollout, engine, tokenizer)  # multi-turn rollouts (rlstack/step/agent.py)
        a = cfg.algorithm
        # one epoch over one mini-batch: the policy that sampled is the one being updated
        self.on_policy = a.ppo_epochs == 1 and a.mini_batch_size <= 0 and not a.use_kl_in_reward

    def next_batch(self, step: int) -> StepBatch:
        cfg, g, timings = self.cfg, self.groups, {}
        t0 = time.perf_counter()
        self.phases.enter("sync")  # offload: actor weights in, engine weights awake
        sync = self.weight_sync.sync()
        timings["timing/sync_s"] = time.perf_counter() - t0
        probe = sync_check.probe_prompts(self.train_set)
        sync_check.after_sync(cfg.rollout, step, sync, self.actor.role, g, self.engine, probe)

        self.phases.enter("rollout")  # offload: after the sync, before generation
        t0 = time.perf_counter()
        global_prompts = [self.train_set[i] for i in self.sampler.next_global_batch()]
        self.engine.metrics()  # its counters from here on: this rollout's (the sync check, validation generate too)
        gens, gen_tokens = self.generate(global_prompts, step, greedy=False)
        counters = engine_metrics(self.engine)
        global_gens = gens
        prompts, gens = stages.dp_share(global_prompts, gens, g, cfg.trainer.balance_batch, stages.shares_prompts(cfg))
        timings["timing/rollout_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        scores = self.scoring.score(prompts, gens)
        pad, mbs = self.tokenizer.pad_token_id, cfg.algorithm.micro_batch_size
        rollout = stages.build_rollout(prompts, gens, scores.values, pad, mbs, g.device, on_policy=self.on_policy)
        timings["timing/score_s"] = time.perf_counter() - t0
        # the file and its "step" are the logged (1-based) step, as verl's global_steps
        counters.update(self._agent_records(step + 1, global_gens, prompts, gens, scores.values))
        return StepBatch(prompts, gens, scores, rollout, sync, gen_tokens, timings, counters)

    def _agent_records(self, step: int, global_gens: list, prompts: list, gens: list, scores: list) -> dict:
        """agent/* metrics and trainer.rollout_data_dir's DIR/<step>.jsonl (rlstack/step/agent.py)."""
        from rlstack.step.agent import step_records

        metrics = step_records(self.cfg, step, prompts, gens, scores, self.tokenizer, self.groups, global_gens)
        if self.agent.driver is not None and any(getattr(g, "agent", None) for g in global_gens):
            metrics.update(self.agent.driver.last_stats)
        return metrics

    def after_update(self, step: int) -> dict:
        self.phases.enter("idle")  # offload: everything resident for checkpoints (vLLM stays asleep)
        return {}

    def generate(self, prompts: list, step: int, greedy: bool):
        """Every rank's generations for `prompts` (the same list on every rank): `stages.generate`."""
        show = self.cfg.logging.progress
        agent = self.agent.for_prompts(prompts)  # None: the engine's own single-turn path
        return stages.generate(
            self.engine, prompts, self.cfg.rollout, self.groups, step, greedy, show_progress=show, agent=agent
        )

    def state_dict(self) -> dict:
        return {}  # the engine's sampling seed follows from the step

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self, ok: bool) -> None:
        self.agent.close()
        self.engine.close()
