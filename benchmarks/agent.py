"""The agent row of `make bench` (issue 35): a multi-turn rollout's generated tokens/s against a
single-turn rollout producing the same number of policy tokens (goal: at least 80% of it), and the
share of the multi-turn rollout's wall time spent waiting on tools.

    python -m benchmarks.agent --hf tiny --batch 32 --turns 4 --turn-tokens 16 --json out.json

Both rollouts sample the same random prompts on one engine (eos ignored: every turn makes exactly
--turn-tokens tokens, so both make batch x turns x turn-tokens policy tokens):
- single-turn: `engine.generate(prompts, max_new_tokens=turns * turn_tokens)`, the plain path;
- multi-turn: the agent driver (rlstack.agent.driver.AgentRollout, what the trainer runs) with a
  loop of `turns` policy turns; after each but the last it calls a tool that waits --tool-s seconds
  (asyncio.sleep: an I/O-bound tool; the tools of a turn run concurrently across trajectories) and
  inserts --tool-ids ids (mask 0), which the next turn prefills.
tokens/s = policy tokens / the rollout call's wall time. `ratio` = multi / single; `engine_ratio`
the same on the seconds inside the engine only (what the multi-turn path costs the engine: one call
per turn, each prefilling the ids inserted since the last; the hf engine keeps each trajectory's KV
between its turns, rollout.multi_turn.kv_cache_mb); `cpu_ratio` the same on this process's CPU
seconds (all threads; less sensitive to other processes loading the machine, blind to the tool
waits); `tool_share` = the union of the tool waits / the multi-turn wall time; `prefill_ratio` =
context tokens the multi-turn rollout prefills (the hf engine's count; vLLM: every turn's whole
context, before its prefix cache) / the single-turn one's (the prompts): the engine work it adds
whatever the machine's load. Repetitions alternate the two (load drift on a shared machine hits
both); medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agent")
    p.add_argument("--hf", default="tiny", help="HF directory, `default` (SmolLM2) or `tiny`")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument("--batch", type=int, default=32, help="trajectories (prompts) per rollout")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--turns", type=int, default=4, help="policy turns per trajectory (turns - 1 tool calls)")
    p.add_argument("--turn-tokens", type=int, default=16, help="tokens the policy generates per turn")
    p.add_argument("--tool-ids", type=int, default=16, help="ids a tool response inserts")
    p.add_argument("--tool-s", type=float, default=0.02, help="seconds each tool call waits")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: all cores")
    p.add_argument("--json", default="", help="write the figures and every repetition here")
    return p


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: the wall time some tool was being waited on."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def tool_loop(turns: int, turn_tokens: int, tool_ids: list[int], tool_s: float, waits: list, contexts: list):
    """An AgentLoop: `turns` policy turns of `turn_tokens`, a tool call between each two; each
    turn's context length goes to `contexts` (what the engine is sent)."""
    from rlstack.agent import AgentLoop, Transcript

    class ToolTurns(AgentLoop):
        async def run(self, prompt_ids, ctx):
            t = Transcript(prompt_ids)
            for turn in range(turns):
                contexts.append(len(t.context))
                t.add_generated(await ctx.generate(t.context, max_new_tokens=turn_tokens))
                if turn + 1 < turns:
                    start = time.perf_counter()
                    await asyncio.sleep(tool_s)  # the tool: I/O-bound, awaited as tool_agent awaits tools
                    waits.append((start, time.perf_counter()))
                    t.add_inserted(tool_ids)
            return t.output(num_turns=2 * turns, extra={"tool_calls": turns - 1})

    return ToolTurns()


def measure(opts, hf_dir: str, groups) -> dict:
    import torch

    from megatron_bridge.hf import read_model_args
    from rlstack.agent.driver import AgentRollout
    from rlstack.agent.registry import LoopSet
    from rlstack.config import RolloutConfig
    from rlstack.rollout.base import SamplingParams, build_engine

    vocab = read_model_args(hf_dir).vocab_size
    policy_per_row = opts.turns * opts.turn_tokens
    budget = policy_per_row + (opts.turns - 1) * opts.tool_ids
    cfg = RolloutConfig(
        engine=opts.engine,
        micro_batch_size=opts.batch,
        max_num_seqs=opts.batch,
        max_model_len=opts.prompt_len + budget,
    )
    engine = build_engine(cfg, hf_dir, groups, eos_token_id=-1, pad_token_id=0)  # eos -1: no row ends early
    gen = torch.Generator().manual_seed(0)
    hi = min(vocab, 20000)
    prompts = torch.randint(10, hi, (opts.batch, opts.prompt_len), generator=gen).tolist()
    tool_ids = torch.randint(10, hi, (opts.tool_ids,), generator=gen).tolist()
    waits: list = []
    contexts: list = []
    loops = LoopSet("single_turn")
    loops.register("tools", tool_loop(opts.turns, opts.turn_tokens, tool_ids, opts.tool_s, waits, contexts))
    driver = AgentRollout(engine, None, loops, budget)
    rows = [{"agent_name": "tools"}] * opts.batch
    params = SamplingParams(max_new_tokens=policy_per_row)
    engine.generate(prompts, params)  # warm-up of both paths at full size (first-call kernels, allocator)
    engine.metrics()  # resets the engine's counters
    driver.generate(prompts, rows, params)
    prefilled = engine.metrics().get("rollout/prefill_tokens")
    # tokens prefilled, multi / single: the engine's count (hf: the turn cache's reuse left out), else
    # the turns' whole contexts (what vLLM is sent; its prefix cache may skip some)
    prefill_ratio = (prefilled if prefilled is not None else sum(contexts)) / (opts.batch * opts.prompt_len)

    tokens = opts.batch * policy_per_row
    runs = []
    for _ in range(opts.repeats):
        start, cpu = time.perf_counter(), time.process_time()
        single = engine.generate(prompts, params)
        single_s, single_cpu = time.perf_counter() - start, time.process_time() - cpu
        assert sum(len(g.response_ids) for g in single) == tokens, "a single-turn row ended early"
        waits.clear()
        start, cpu = time.perf_counter(), time.process_time()
        samples = driver.generate(prompts, rows, params)
        multi_s, multi_cpu = time.perf_counter() - start, time.process_time() - cpu
        assert sum(sum(s.response_mask) for s in samples) == tokens, "a multi-turn row ended early"
        stats = driver.last_stats
        engine_s = stats["agent/engine_share"] * stats["agent/seconds"]
        runs.append(
            {
                "single_tok_s": tokens / single_s,
                "multi_tok_s": tokens / multi_s,
                "ratio": single_s / multi_s,
                "engine_ratio": single_s / engine_s,
                "cpu_ratio": single_cpu / multi_cpu,
                "tool_share": union_seconds(waits) / multi_s,
                "engine_calls": stats["agent/engine_calls"],
                "rows_per_engine_call": stats["agent/rows_per_engine_call"],
            }
        )
    driver.close()
    engine.close()
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out.update(
        runs=runs,
        policy_tokens=tokens,
        prefill_ratio=prefill_ratio,
        engine=opts.engine,
        batch=opts.batch,
        prompt_len=opts.prompt_len,
        turns=opts.turns,
        turn_tokens=opts.turn_tokens,
        tool_ids=opts.tool_ids,
        tool_s=opts.tool_s,
    )
    return out


def main(argv=None) -> int:
    opts = _parser().parse_args(argv)
    import torch

    from megatron_bridge import patches
    from megatron_bridge.hf import resolve_model_path
    from megatron_bridge.parallel import destroy_distributed, init_distributed

    torch.set_num_threads(opts.threads or os.cpu_count() or 1)
    hf_dir = resolve_model_path(opts.hf)
    patches.apply()
    groups = init_distributed(1, 1)
    try:
        out = measure(opts, hf_dir, groups)
    finally:
        destroy_distributed()
    print(
        f"agent engine={out['engine']} batch={out['batch']} turns={out['turns']}x{out['turn_tokens']} "
        f"tool_ids={out['tool_ids']} tool_s={out['tool_s']} single_tok_s={out['single_tok_s']:.1f} "
        f"multi_tok_s={out['multi_tok_s']:.1f} ratio={out['ratio']:.3f} engine_ratio={out['engine_ratio']:.3f} "
        f"cpu_ratio={out['cpu_ratio']:.3f} "
        f"tool_share={out['tool_share']:.3f} prefill_ratio={out['prefill_ratio']:.2f} all_ratios={[round(r['ratio'], 3) for r in out['runs']]}",
        flush=True,
    )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
