"""Zero-copy vs copying hf engine next to a Megatron actor: sync bytes, engine bytes, RSS, decode speed.

    python -m benchmarks.zero_copy --hf default --zero-copy 1 --batch 32 --new-tokens 64
    python -m benchmarks.zero_copy --hf default --zero-copy 0 --batch 32 --new-tokens 64

One process (training TP1 x PP1, colocated, float32): builds the actor, the hf engine and the weight
sync, syncs, then generates (temperature 1, eos ignored). Prints one `key=value` line: sync bytes,
aliased bytes, the engine's own weight bytes, RSS after the sync (and its peak), decode tokens/s.
Run each setting in its own process: RSS is per process and the allocator does not give all back.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / (1 << 30)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux


def run(opts) -> dict:
    import torch

    from megatron_bridge import patches
    from megatron_bridge.hf import build_megatron_from_hf, resolve_model_path
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.reshard import WeightSync
    from rlstack.config import RolloutConfig
    from rlstack.rollout.base import SamplingParams, build_engine

    if opts.threads:
        torch.set_num_threads(opts.threads)
    hf_dir = resolve_model_path(opts.hf)
    patches.apply()
    groups = init_distributed(1, 1)
    model, args = build_megatron_from_hf(hf_dir, groups)
    actor_rss = _rss_gib()
    cfg = RolloutConfig(engine="hf", micro_batch_size=opts.batch, zero_copy=bool(opts.zero_copy))
    engine = build_engine(cfg, hf_dir, groups, eos_token_id=-1, pad_token_id=0)
    sync = WeightSync(model, args, groups, engine, zero_copy=bool(opts.zero_copy))
    stats = [sync.sync() for _ in range(3)]
    rss_after_sync = _rss_gib()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, min(args.vocab_size, 20000), (opts.batch, opts.prompt_len), generator=gen).tolist()
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=2))  # warm-up
    engine.metrics()
    rates = []
    for _ in range(opts.repeats):
        engine.generate(prompts, SamplingParams(max_new_tokens=opts.new_tokens))
        rates.append(engine.metrics()["rollout/tokens_per_s"])
    last = stats[-1]
    return {
        "zero_copy": int(opts.zero_copy),
        "sync_bytes": last.bytes,
        "aliased_bytes": last.aliased_bytes,
        "engine_weight_bytes": last.engine_weight_bytes,
        "sync_s": statistics.median(s.seconds for s in stats),
        "actor_rss_gib": round(actor_rss, 3),
        "rss_after_sync_gib": round(rss_after_sync, 3),
        "rss_end_gib": round(_rss_gib(), 3),
        "peak_rss_gib": round(_peak_rss_gib(), 3),
        "tokens_per_s": round(statistics.median(rates), 1),
        "all_tokens_per_s": [round(r, 1) for r in rates],
        "started": time.strftime("%H:%M:%S"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.zero_copy")
    p.add_argument("--hf", default="default", help="HF directory, `default` (SmolLM2) or `tiny`")
    p.add_argument("--zero-copy", type=int, choices=(0, 1), default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    opts = p.parse_args(argv)
    from megatron_bridge.parallel import destroy_distributed

    try:
        print(" ".join(f"{k}={v}" for k, v in run(opts).items()), flush=True)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
