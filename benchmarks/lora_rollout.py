"""hf engine with LoRA: adapters applied at run time vs merged weights for the adapted linears only.

    python -m benchmarks.lora_rollout --shape tiny
    python -m benchmarks.lora_rollout --shape smollm2-135m --repeats 3

One process, one actor (megatron, world of one, LoRA on all four linears with B random) and one hf
engine that aliases the actor's frozen base (zero copy, q/k/v as grouped views, as in a TP1 run).
Each repeat runs every variant on the same engine, in a rotated order, so the machine's load hits
them alike: `none` (the base alone, the ceiling), `adapters` (rollout.lora_sync=adapters: W x +
scale B (A x) per adapted linear) and `merged` (rollout.lora_sync=merged: (W + scale B A) x from the
engine's own weight). Each variant: one sync (timed) then one generate of --batch prompts x
--new-tokens sampled tokens (eos off: fixed lengths), after one untimed round of each. Prints tokens
per wall second and per CPU second of this process (one thread: the CPU time is the work done, less
disturbed by other processes on a shared machine) per repeat, and the median ratio to `adapters`;
on a shared machine the ratios are the figures, not the absolute rates.

`smollm2-135m`: SmolLM2-135M's layer shapes (hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536,
tied embeddings) with random weights and the tiny tokenizer's vocabulary (so the LM head is a smaller
share of a step than in SmolLM2's 49152-row head; it is the same in every variant).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types

import torch

SHAPES = {
    "tiny": dict(hidden_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256),
    "smollm2-135m": dict(
        hidden_size=576,
        num_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        max_position_embeddings=2048,
    ),
}
VARIANTS = ("none", "adapters", "merged")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora_rollout")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="vllm: its LoRA path vs merged weights")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="prompts per generate call (= rows: n=1)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a run's rank has cores / ranks)")
    p.add_argument("--cache", default=None, help="where the random checkpoint is built (default: the tiny cache)")
    return p


def _clear_lora(engine) -> None:
    """The engine's linears back to the base alone (the `none` variant)."""
    from rlstack.rollout.hf_engine import _install_lora

    for mod in engine.model.modules():
        if mod.__dict__.pop("lora_delta", None) is not None or mod.__dict__.pop("lora_merged", None) is not None:
            _install_lora(mod)


def _parts(opts):
    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.lora import LoraSpec, adapters, add_lora_
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.reshard import WeightSync
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint
    from rlstack.config import RolloutConfig
    from rlstack.rollout.base import build_engine
    from rlstack.rollout.lora_sync import LoraWeightSync

    hf_dir = ensure_tiny_checkpoint(TinySpec(arch="llama", tie_word_embeddings=True, **SHAPES[opts.shape]), opts.cache)
    groups = init_distributed(1, 1, backend="gloo")
    model, args = build_megatron_from_hf(hf_dir, groups, dtype=torch.float32)
    spec = LoraSpec(rank=opts.rank, alpha=2.0 * opts.rank)
    add_lora_(model, spec, None)  # TP1: the adapters whole
    role = types.SimpleNamespace(module=model.eval(), args=args, lora=spec)  # what LoraWeightSync reads
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B = 0 would make every variant the base model's function
        for _, adapter in adapters(role.module):
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=gen) * 0.02)
    if opts.engine == "vllm":
        return (role, *_vllm_parts(opts, hf_dir, groups, role))
    cfg = RolloutConfig(engine="hf", micro_batch_size=opts.batch, max_new_tokens=opts.new_tokens)
    engine = build_engine(cfg, hf_dir, groups, eos_token_id=-1, pad_token_id=0)
    base = WeightSync(role.module, role.args, groups, engine, zero_copy=True)
    syncs = {
        "adapters": LoraWeightSync(base, role, groups, engine),
        "merged": LoraWeightSync(base, role, groups, engine, merged=True),
    }
    return role, engine, base, syncs


class _VllmVariant:
    """vLLM: `adapters` = its LoRA path (a LoRARequest per sync), `merged` = the whole model merged
    through its loader with no LoRARequest (rollout.lora_sync=merged). `prepare` (untimed) undoes
    the other variant: merged weights are replaced by the base before the adapters run again."""

    def __init__(self, variant: str, engine, base, sync):
        self.variant, self.engine, self.base, self._sync = variant, engine, base, sync

    def prepare(self) -> None:
        if self.variant == "merged":
            self.engine._lora_request = None
        elif self.engine._lora_request is None:
            self.base.sync()  # the base back in place of the merged weights

    def sync(self):
        return self._sync.sync()


def _vllm_parts(opts, hf_dir, groups, role):
    from megatron_bridge.reshard import WeightSync
    from rlstack.config import RolloutConfig
    from rlstack.rollout.base import build_engine
    from rlstack.rollout.lora_sync import LoraWeightSync, MergedLoraSync

    cfg = RolloutConfig(
        engine="vllm",
        max_num_seqs=opts.batch,
        max_model_len=opts.prompt_len + opts.new_tokens,
        max_new_tokens=opts.new_tokens,
    )
    engine = build_engine(cfg, hf_dir, groups, eos_token_id=-1, pad_token_id=0, lora_rank=opts.rank)
    base = WeightSync(role.module, role.args, groups, engine, zero_copy=False)
    syncs = {
        "adapters": _VllmVariant("adapters", engine, base, LoraWeightSync(base, role, groups, engine)),
        "merged": _VllmVariant("merged", engine, base, MergedLoraSync(base, role, groups)),
    }
    return engine, base, syncs


def _round(variant: str, engine, syncs, prompts, params) -> tuple[float, float, float]:
    """One variant: its sync, then a generate. (sync seconds, tokens per wall second, per CPU second)."""
    if hasattr(syncs.get(variant), "prepare"):
        syncs[variant].prepare()
    start = time.perf_counter()
    if variant == "none":
        _clear_lora(engine)
    else:
        syncs[variant].sync()
    sync_s = time.perf_counter() - start
    wall, cpu = time.perf_counter(), time.process_time()
    gens = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    engine.metrics()
    tokens = sum(len(g.response_ids) for g in gens)
    return sync_s, tokens / wall, tokens / cpu


def run(opts) -> dict[str, dict[str, list[float]]]:
    from rlstack.rollout.interface import SamplingParams

    torch.set_num_threads(opts.threads)
    role, engine, base, syncs = _parts(opts)
    base.sync()
    vocab = role.args.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (opts.batch, opts.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=opts.new_tokens, n=1, seed=1)
    variants = VARIANTS if opts.engine == "hf" else VARIANTS[1:]  # vLLM: no `none` (merged costs the same)
    for variant in variants:  # warm-up at full size: first-call kernels, the merged weights' allocation
        _round(variant, engine, syncs, prompts, params)
    out = {k: {v: [] for v in variants} for k in ("sync_s", "wall", "cpu")}
    for rep in range(opts.repeats):
        k = rep % len(variants)
        order = variants[k:] + variants[:k]  # rotate: no variant always first
        for variant in order:
            for key, value in zip(("sync_s", "wall", "cpu"), _round(variant, engine, syncs, prompts, params)):
                out[key][variant].append(value)
        line = " ".join(f"{v}={out['wall'][v][-1]:.1f}/{out['cpu'][v][-1]:.1f}" for v in variants)
        print(f"repeat={rep} tokens per wall / CPU second: {line}", flush=True)
    for v in variants:
        wall = [r / a for r, a in zip(out["wall"][v], out["wall"]["adapters"])]
        cpu = [r / a for r, a in zip(out["cpu"][v], out["cpu"]["adapters"])]
        print(
            f"engine={opts.engine} shape={opts.shape} rank={opts.rank} batch={opts.batch} new_tokens={opts.new_tokens} variant={v} "
            f"tokens_per_s_median={statistics.median(out['wall'][v]):.1f} "
            f"tokens_per_cpu_s_median={statistics.median(out['cpu'][v]):.1f} "
            f"wall_ratio_to_adapters={statistics.median(wall):.3f} {[round(x, 3) for x in wall]} "
            f"cpu_ratio_to_adapters={statistics.median(cpu):.3f} {[round(x, 3) for x in cpu]} "
            f"sync_s_median={statistics.median(out['sync_s'][v]):.4f}",
            flush=True,
        )
    return out


def main(argv=None) -> int:
    from megatron_bridge import patches
    from megatron_bridge.parallel import destroy_distributed

    opts = _parser().parse_args(argv)
    patches.apply()
    try:
        run(opts)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
