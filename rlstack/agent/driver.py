"""Run many trajectories at once over one rollout engine (hf or vLLM).

Every trajectory is an asyncio task running its loop. `ctx.generate` calls are collected by
`EngineBatcher`, which sends them to the engine as ONE batched `generate` once every live
trajectory is waiting on it (or has finished): turn by turn across the live trajectories. Each
request carries its own cap (what is left of its budget, or less); the engines take one cap per
prompt (`max_new_tokens=[...]`), so a turn is one call whatever the caps. Identical contexts (the
n samples of a prompt at their first turn) go to the engine once with `n`, as the single-turn
rollout does: the engine prefills them once, and `single_turn` through this driver samples exactly
what `engine.generate(prompts, params)` samples. For the rollout's length the hf engine keeps each
trajectory's KV between its turns (`HFEngine.keep_turn_kv`, rollout.multi_turn.kv_cache_mb): a turn
prefills only the ids inserted since the last one.

Why wait for every live trajectory instead of flushing on a timer: the batches, and so the
samples, are then a function of the step alone (the trajectories' order, not the tools' timing),
which keeps resume exact. The tools of one turn run concurrently across all trajectories.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from rlstack.agent.base import AgentContext, AgentOutput, TurnOutput
from rlstack.errors import UserError


@dataclass
class AgentSample:
    """One finished trajectory, as the trainer takes it."""

    prompt_ids: list[int]
    response_ids: list[int]  # the engine's ids and the inserted ids, in order
    response_mask: list[int]  # 1: the policy generated it; 0: the loop inserted it
    logprobs: list[float]  # one per response id (0.0 where the mask is 0)
    num_turns: int
    finish_reason: str  # stop | length | max_assistant_turns | max_user_turns | a loop's own
    reward: Optional[float]  # the loop's score (replaces the reward function), or None
    extra: dict[str, Any] = field(default_factory=dict)  # -> reward function's extra_info["agent"]


@dataclass
class _Request:
    index: int
    token_ids: list[int]
    cap: int
    future: asyncio.Future


class EngineBatcher:
    """Collects the live trajectories' generate requests; one engine call per turn."""

    def __init__(self, engine, sampling):
        self.engine = engine
        self.sampling = sampling
        self.live = 0
        self.pending: list[_Request] = []
        self.failed = False
        self.rows_per_call: list[int] = []  # requests answered by each engine call
        self.engine_seconds = 0.0

    async def generate(self, index: int, token_ids: list[int], cap: int) -> TurnOutput:
        future = asyncio.get_running_loop().create_future()
        self.pending.append(_Request(index, token_ids, cap, future))
        self._maybe_flush()
        return await future

    def finished(self) -> None:
        self.live -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        waiting = {r.index for r in self.pending}
        if self.pending and not self.failed and len(waiting) >= self.live:
            self._flush()

    def _flush(self) -> None:
        requests, self.pending = sorted(self.pending, key=lambda r: r.index), []
        start = time.perf_counter()
        try:
            outputs = self._call_engine(requests)
        except BaseException as e:
            self.failed = True
            for r in requests:
                r.future.set_exception(e)
            return
        finally:
            self.engine_seconds += time.perf_counter() - start
        self.rows_per_call.append(len(requests))
        for r, out in zip(requests, outputs):
            if not r.future.done():
                r.future.set_result(out)

    def _call_engine(self, requests: list[_Request]) -> list[TurnOutput]:
        """One engine.generate for all requests, in request order."""
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((tuple(r.token_ids), r.cap), []).append(i)
        sizes = {len(g) for g in groups.values()}
        n = sizes.pop() if len(sizes) == 1 else 1  # identical contexts as n samples of one prompt
        order = [i for g in groups.values() for i in g] if n > 1 else list(range(len(requests)))
        heads = [requests[g[0]] for g in groups.values()] if n > 1 else requests
        caps = [r.cap for r in heads]
        params = dataclasses.replace(self.sampling, n=n, max_new_tokens=max(caps))
        kwargs = {} if len(set(caps)) == 1 else {"max_new_tokens": caps}
        gens = self.engine.generate([r.token_ids for r in heads], params, **kwargs)
        assert len(gens) == len(requests), (len(gens), len(requests))
        outputs: list[Optional[TurnOutput]] = [None] * len(requests)
        for i, g in zip(order, gens):
            outputs[i] = TurnOutput(list(g.response_ids), list(g.logprobs), g.finish_reason)
        return outputs


class AgentRollout:
    """The rollout of agent samples: prompts (+ rows) -> AgentSamples, through `loops` on `engine`.

    Keeps one event loop for the run (tools may hold loop-bound resources between steps)."""

    def __init__(self, engine, tokenizer, loops, max_response_tokens: int, renderer=None, kv_cache_mb: int = 2048):
        self.engine = engine
        self.kv_cache_bytes = kv_cache_mb << 20  # rollout.multi_turn.kv_cache_mb
        self.tokenizer = tokenizer
        self.loops = loops  # rlstack.agent.registry.LoopSet
        self.max_response_tokens = max_response_tokens
        self.renderer = renderer  # rlstack.agent.render.TurnRenderer
        self._loop = asyncio.new_event_loop()
        self.last_stats: dict[str, float] = {}

    def generate(self, prompts: list[list[int]], rows: list[dict], params) -> list[AgentSample]:
        """`params.n` samples per prompt, prompt-major (as RolloutEngine.generate orders them)."""
        assert len(prompts) == len(rows), (len(prompts), len(rows))
        items = [(p, r) for p, r in zip(prompts, rows) for _ in range(params.n)]
        sampling = dataclasses.replace(params, n=1)
        batcher = EngineBatcher(self.engine, sampling)
        start = time.perf_counter()
        with self._keep_turn_kv():
            samples = self._loop.run_until_complete(self._run_all(items, batcher, sampling))
        seconds = time.perf_counter() - start
        self.last_stats = {
            "agent/engine_calls": len(batcher.rows_per_call),
            "agent/rows_per_engine_call": sum(batcher.rows_per_call) / max(1, len(batcher.rows_per_call)),
            "agent/seconds": seconds,
            "agent/engine_share": batcher.engine_seconds / seconds if seconds > 0 else 0.0,
        }
        return samples

    def _keep_turn_kv(self):
        """The engine keeps each trajectory's KV between its turns for this rollout (hf engine:
        `HFEngine.keep_turn_kv`); an engine without it (vLLM: its own prefix caching) re-prefills."""
        keep = getattr(self.engine, "keep_turn_kv", None)
        return keep(self.kv_cache_bytes) if keep is not None else contextlib.nullcontext()

    def close(self) -> None:
        """End the run's event loop (the engine is the caller's)."""
        if not self._loop.is_closed():
            self._loop.close()

    async def _run_all(self, items, batcher: EngineBatcher, sampling) -> list[AgentSample]:
        batcher.live = len(items)
        tasks = [asyncio.ensure_future(self._one(i, p, r, batcher, sampling)) for i, (p, r) in enumerate(items)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            batcher.failed = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, index: int, prompt_ids: list[int], row: dict, batcher: EngineBatcher, sampling):
        loop = self.loops.for_row(row)
        ctx = AgentContext(
            batcher, index, prompt_ids, row, sampling, self.max_response_tokens, self.tokenizer, self.renderer
        )
        try:
            out = await loop.run(list(prompt_ids), ctx)
        except BaseException as e:
            batcher.failed = True  # the rollout stops: no more engine calls for the others
            if isinstance(e, (SystemExit, KeyboardInterrupt)):  # would end the job silently (exit(0): status 0)
                raise UserError(
                    f"agent loop {type(loop).__name__} raised {type(e).__name__} (sample {index}): a loop must "
                    "return an AgentOutput, not exit; fix the loop (rollout.agent_loop)"
                ) from None
            if isinstance(e, Exception) and not isinstance(e, UserError):
                e.add_note(f"in agent loop {type(loop).__name__} (sample {index}): a bug in the loop")
            raise
        finally:
            batcher.finished()
        return finish_sample(prompt_ids, out, ctx, type(loop).__name__)


def finish_sample(prompt_ids: list[int], out: AgentOutput, ctx: AgentContext, loop_name: str) -> AgentSample:
    """Check a loop's output and cut it to the budget (finish_reason "length" when cut)."""
    if not isinstance(out, AgentOutput):
        raise UserError(f"agent loop {loop_name}.run returned {type(out).__name__}: return an AgentOutput")
    n = len(out.response_ids)
    if len(out.response_mask) != n or len(out.logprobs) != n:
        raise UserError(
            f"agent loop {loop_name}: AgentOutput has {n} response_ids, {len(out.response_mask)} response_mask "
            f"and {len(out.logprobs)} logprobs: give one mask value and one log-prob per response id"
        )
    if any(m not in (0, 1) for m in out.response_mask):
        raise UserError(f"agent loop {loop_name}: response_mask holds values other than 0 and 1")
    extra = dict(out.extra)
    finish = str(extra.get("finish_reason") or ctx.last_finish_reason)
    budget = ctx.max_response_tokens
    ids, mask, logprobs = list(out.response_ids), list(out.response_mask), [float(x) for x in out.logprobs]
    if n > budget:
        ids, mask, logprobs, finish = ids[:budget], mask[:budget], logprobs[:budget], "length"
    extra["finish_reason"] = finish
    reward = None if out.reward is None else float(out.reward)
    return AgentSample(list(prompt_ids), ids, mask, logprobs, int(out.num_turns), finish, reward, extra)
