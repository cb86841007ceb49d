"""Stage micro-benchmarks under torchrun, on the same layout, model and batch as the trainer.

Per rollout engine (hf, and vllm where it is installed): generate this step's prompts x n samples,
one warm-up then `reps` timed repetitions (barrier before and after each, so a repetition lasts as
long as the slowest rank). Then, on the batch the first engine generated: the actor's forward
(log-probs, as the trainer's old/ref log-prob passes) and the critic's forward (values).
Rank 0 writes one JSON file. Tokens are counted over all ranks as the trainer counts them: generated
tokens for rollout, prompt + response tokens (no padding) for forwards.

    torchrun --nproc_per_node=2 benchmarks/stages.py --config CFG --json out.json [key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--engines", default="hf,vllm", help="engines to time; ones not installed are skipped")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--skip-forward", action="store_true", help="rollout only")
    p.add_argument("--json", required=True)
    return p.parse_args(argv)


def _barrier(g) -> None:
    from rlstack import collectives

    collectives.barrier(g.world, g.device)  # on a GPU, after this rank's queued kernels


def timed(fn, g, reps: int, warmup: int) -> tuple[list[float], object]:
    """Seconds of each timed repetition (slowest rank), and the last result of fn."""
    out, seconds = None, []
    for i in range(warmup + reps):
        _barrier(g)
        t0 = time.perf_counter()
        out = fn()
        _barrier(g)
        if i >= warmup:
            seconds.append(time.perf_counter() - t0)
    return seconds, out


def engine_available(kind: str) -> bool:
    return kind == "hf" or importlib.util.find_spec(kind) is not None


def bench_engine(kind: str, cfg, hf_dir: str, g, tokenizer, prompts: list, args) -> tuple[dict, list]:
    """Rollout tokens/s of one engine, through the trainer's rollout stage (rlstack.stages.generate).

    Returns the figures and every generation, in prompt order.
    """
    from rlstack import stages
    from rlstack.rollout.base import build_engine

    r = cfg.rollout
    t0 = time.perf_counter()
    engine = build_engine(
        dataclasses.replace(r, engine=kind), hf_dir, g, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    start_s = time.perf_counter() - t0
    mine = stages.replica_share(len(prompts), r, g)
    counts = []

    def run():  # the trainer's own rollout stage (step 0's sampling seed)
        gens, tokens = stages.generate(engine, prompts, r, g, step=0, greedy=False)
        counts.append(tokens)
        return gens

    seconds, rows = timed(run, g, args.reps, args.warmup)
    tokens = counts[args.warmup :]
    engine.close()  # vLLM's close leaves the training world alone (rlstack.rollout.vllm_engine)
    return {
        "start_s": start_s,
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": [t / s for t, s in zip(tokens, seconds)],
        "decode_rows_per_rank": min(r.micro_batch_size, len(mine) * r.n),
    }, rows


def bench_forwards(cfg, hf_dir: str, g, tokenizer, prompts: list, rows: list, args) -> dict:
    """Actor log-prob forward and critic value forward over this DP rank's share of the generations."""
    import torch

    from rlstack import collectives, stages
    from rlstack.build import DTYPES
    from rlstack.workers.actor import compute_logprobs
    from rlstack.workers.critic import Critic
    from rlstack.workers.megatron_role import MegatronRole

    mbs = cfg.algorithm.micro_batch_size
    mine, rows = stages.dp_share(prompts, rows, g)  # this data-parallel rank's share, as the trainer takes it
    batch = stages.build_rollout(mine, rows, [0.0] * len(rows), tokenizer.pad_token_id, mbs, g.device, on_policy=True)
    tokens = collectives.sum_floats([float(batch.num_tokens)], g.dp, g.device)[0]
    dtype = DTYPES[cfg.model.dtype]
    out = {
        "tokens": tokens,
        "padded_seq_len": int(batch.tokens.shape[1]),
        "train_rows_per_rank": mbs * int(batch.tokens.shape[1]),
    }
    # the trainer's reference role (rlstack/build.py): fused output log-probs, packed rows
    role = MegatronRole(hf_dir, g, dtype, fused_output=cfg.model.fused_output_logprobs)
    role.remove_padding = cfg.model.remove_padding
    role.share_prefixes(cfg.model.prefix_sharing)  # a prompt's samples run it once, as in the trainer
    seconds, _ = timed(lambda role=role: compute_logprobs(role, batch, mbs), g, args.reps, args.warmup)
    out["actor_fwd"] = {"seconds": seconds, "tok_s": [tokens / s for s in seconds]}
    del role
    critic = Critic(MegatronRole(cfg.model.critic_path or hf_dir, g, dtype, value_head=True), cfg.algorithm)
    critic.role.remove_padding = cfg.model.remove_padding
    critic.role.share_prefixes(cfg.model.prefix_sharing)
    seconds, _ = timed(lambda critic=critic: critic.compute_values(batch, mbs), g, args.reps, args.warmup)
    out["critic_fwd"] = {"seconds": seconds, "tok_s": [tokens / s for s in seconds]}
    del critic
    if g.device.type == "cuda":
        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated(g.device) / 2**30
    return out


def run(args) -> dict:
    import torch

    from megatron_bridge import patches
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.patches import cpu_matmul
    from rlstack.config import load_config
    from rlstack.stages import build_data

    cfg = load_config(args.config, args.overrides)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = cfg.parallel.threads_per_rank or max(1, (os.cpu_count() or 1) // local_ranks)  # as the trainer
    torch.set_num_threads(threads)  # before any vLLM engine: its CPU worker freezes the thread count
    p = cfg.parallel
    patches.apply(p.allow_untested_megatron, "parallel.allow_untested_megatron=true")
    cpu_matmul.set_mode(p.cpu_matmul)  # the trainer's float32 CPU matmul kernel (rlstack/loop.py)
    g = init_distributed(p.tp, p.pp, p.dp, p.backend, _timeout(cfg), seed=cfg.trainer.seed, ep=p.ep)
    data = build_data(cfg, g)  # the trainer's own data setup
    hf_dir, tokenizer, train_set, sampler = data.hf_dir, data.tokenizer, data.train_set, data.sampler
    prompts = [train_set[i] for i in sampler.next_global_batch()]  # every rank: the whole step
    lengths = [len(train_set[i].input_ids) for i in range(len(train_set))]
    result = {
        "threads_per_rank": threads,
        "world_size": g.dims.world_size,
        "rollout": {},
        "prompt_len_mean": statistics.fmean(lengths),
        "prompts": len(prompts),
    }
    rows = None
    for kind in [k for k in args.engines.split(",") if k]:
        if not engine_available(kind):
            result["rollout"][kind] = {"skipped": f"{kind} is not installed"}
            continue
        result["rollout"][kind], gens = bench_engine(kind, cfg, hf_dir, g, tokenizer, prompts, args)
        if rows is None:
            rows = gens
            result["response_len_mean"] = statistics.fmean(len(x.response_ids) for x in gens) if gens else 0.0
    if rows and not args.skip_forward:
        result.update(bench_forwards(cfg, hf_dir, g, tokenizer, prompts, rows, args))
    return result


def _timeout(cfg) -> float:
    import torch

    from rlstack.config import timeout_minutes

    return timeout_minutes(cfg, on_gpu=torch.cuda.is_available())


def main(argv=None) -> int:
    args = parse_args(argv)
    from rlstack.config import load_config
    from rlstack.host_memory import configure_allocator, exec_with_allocator

    cfg = load_config(args.config, args.overrides)
    exec_with_allocator(cfg.parallel.host_allocator)  # the trainer's allocator (rlstack/train.py)
    configure_allocator(cfg.parallel.host_mmap_threshold_kb)
    from megatron_bridge.parallel import destroy_distributed

    try:
        result = run(args)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
