"""Rollout and weight-sync measurements (the figures in docs/rollout.md).

    python -m benchmarks.rollout generate --hf default --engine hf --batch 32 --new-tokens 64
    torchrun --nproc_per_node=2 -m benchmarks.rollout sync --hf default --tp 1 --pp 2 --engine hf

`generate` prints `tokens_per_s=<v>` (sampled at temperature 1, eos ignored so every row makes
`--new-tokens` tokens); `sync` prints, per rank, the median sync seconds, bytes written into the
engine, bytes received, peak extra bytes, and `memcpy_floor_s`: one `copy_` of the same number of
bytes on this machine (the lower bound of any sync that writes them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rollout")
    p.add_argument("what", choices=("generate", "sync"))
    p.add_argument("--hf", default="default", help="HF directory, `default` (SmolLM2) or `tiny`")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument("--batch", type=int, default=32, help="prompts per generate call")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp", type=int, default=1, help="training TP (sync)")
    p.add_argument("--pp", type=int, default=1, help="training PP (sync)")
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: cores / local ranks")
    return p


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(10, min(vocab, 20000), (batch, length), generator=gen).tolist()


def _set_threads(opts) -> None:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(opts.threads or max(1, (os.cpu_count() or 1) // local))


def bench_generate(opts, hf_dir: str, groups) -> None:
    from megatron_bridge.hf import read_model_args
    from rlstack.config import RolloutConfig
    from rlstack.rollout.base import SamplingParams, build_engine

    args = read_model_args(hf_dir)
    cfg = RolloutConfig(
        engine=opts.engine,
        tp=opts.rollout_tp,
        micro_batch_size=opts.batch,
        max_num_seqs=opts.batch,
        max_model_len=opts.prompt_len + opts.new_tokens,
    )
    start = time.perf_counter()
    # eos = -1: no token ends a row, so every row generates exactly --new-tokens tokens
    engine = build_engine(cfg, hf_dir, groups, eos_token_id=-1, pad_token_id=0)
    print(f"engine={opts.engine} start_s={time.perf_counter() - start:.1f}", flush=True)
    prompts = _prompts(opts.batch, opts.prompt_len, args.vocab_size)
    params = SamplingParams(max_new_tokens=opts.new_tokens)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=2))  # warm-up (first-call kernels)
    engine.metrics()
    rates = []
    for _ in range(opts.repeats):
        engine.generate(prompts, params)
        rates.append(engine.metrics()["rollout/tokens_per_s"])
    print(
        f"engine={opts.engine} batch={opts.batch} new_tokens={opts.new_tokens} "
        f"tokens_per_s={statistics.median(rates):.1f} all={[round(r, 1) for r in rates]}",
        flush=True,
    )


def memcpy_seconds(num_bytes: int, repeats: int = 5) -> float:
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return min(times)


def bench_sync(opts, hf_dir: str, groups) -> None:
    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.reshard import WeightSync
    from rlstack.config import RolloutConfig
    from rlstack.rollout.base import build_engine

    model, args = build_megatron_from_hf(hf_dir, groups)
    cfg = RolloutConfig(engine=opts.engine, tp=opts.rollout_tp, max_num_seqs=8, max_model_len=128)
    engine = build_engine(cfg, hf_dir, groups, eos_token_id=0, pad_token_id=0)
    start = time.perf_counter()
    sync = WeightSync(model, args, groups, engine, bucket_mb=opts.bucket_mb)
    plan_s = time.perf_counter() - start
    runs = [sync.sync() for _ in range(opts.repeats)]
    seconds = statistics.median(r.seconds for r in runs)
    last = runs[-1]
    floor = memcpy_seconds(last.bytes)
    loader = ""
    if engine.param_targets() is None:  # the engine's own loader time for ready tensors (vLLM CPU repacks)
        ready = {name: torch.zeros(shape) for name, shape in engine.expected_shapes().items()}
        start = time.perf_counter()
        engine.load_weights(iter(ready.items()))
        loader = f" loader_only_s={time.perf_counter() - start:.3f}"
        sync.sync()
    print(
        f"rank={groups.rank} train=TP{groups.dims.tp}xPP{groups.dims.pp} engine={opts.engine} "
        f"rollout_tp={opts.rollout_tp} plan_s={plan_s:.3f} sync_s={seconds:.3f} "
        f"all={[round(r.seconds, 3) for r in runs]} bytes={last.bytes} received={last.bytes_received} "
        f"peak_extra_bytes={last.peak_extra_bytes} memcpy_floor_s={floor:.3f} "
        f"ratio={seconds / floor:.1f}{loader}",
        flush=True,
    )


def main(argv=None) -> int:
    opts = _parser().parse_args(argv)
    from megatron_bridge import patches
    from megatron_bridge.hf import resolve_model_path
    from megatron_bridge.parallel import destroy_distributed, init_distributed

    _set_threads(opts)
    hf_dir = resolve_model_path(opts.hf)
    patches.apply()
    groups = init_distributed(opts.tp, opts.pp)
    try:
        (bench_generate if opts.what == "generate" else bench_sync)(opts, hf_dir, groups)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
