"""Train/rollout agreement after a weight sync: engine log-probs vs the Megatron actor's.

`verify_engine` is what the trainer calls after a sync (`rollout.verify_sync`); `engine_check` is the
`--engine hf|vllm --rollout-tp K` entry of `python -m rlstack.verify` (see `add_engine_args`).
"""

from __future__ import annotations

import logging
import sys
import zlib

import torch

log = logging.getLogger("rlstack")


def verify_engine(model, args, groups, engine, prompts: list[list[int]], tol: float, max_new_tokens: int = 16) -> float:
    """Largest |engine log-prob - actor log-prob| over the engine's greedy responses to `prompts`,
    reduced over every rank (all ranks call this together and get the same value).

    Greedy decoding leaves the engine's sampling generator untouched, so verification does not change
    later rollouts. The actor runs the model-parallel group's sequences as one batch, so its TP/PP
    ranks see identical inputs whatever each rank's engine produced.
    """
    import torch.distributed as dist

    from megatron_bridge.verify import megatron_logits
    from rlstack import collectives
    from rlstack.rollout.base import SamplingParams

    gens = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=max_new_tokens))
    every = collectives.all_gather_objects(
        [g.prompt_ids + g.response_ids for g in gens], groups.mp, dist.get_world_size(groups.mp)
    )
    rows = [r for member in every for r in member]
    offset = sum(len(m) for m in every[: dist.get_group_rank(groups.mp, groups.rank)])
    input_ids = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.long)  # [B, S] right-padded
    for b, r in enumerate(rows):
        input_ids[b, : len(r)] = torch.tensor(r)
    was_training = model.training
    logprobs = torch.log_softmax(megatron_logits(model, input_ids, groups, args.vocab_size), dim=-1)  # [B, S, V]
    model.train(was_training)
    worst = torch.zeros((), dtype=torch.float64)
    for k, g in enumerate(gens):
        start = len(g.prompt_ids) - 1  # position t predicts token t + 1
        steps = torch.arange(start, start + len(g.response_ids))
        actor = logprobs[offset + k, steps, torch.tensor(g.response_ids)]  # [R]
        worst = torch.maximum(worst, (actor.double() - torch.tensor(g.logprobs, dtype=torch.float64)).abs().max())
    value = collectives.max_floats([float(worst)], groups.world, groups.device)[0]
    if not value <= tol:
        log.warning(
            "rollout engine and actor disagree after the weight sync: max |logprob diff| %.3e > %.1e", value, tol
        )
    return value


def perturb_weights(model, args, groups, scale: float = 0.5, seed: int = 0) -> int:
    """Add seeded noise to every Megatron parameter in place, so the actor no longer equals any checkpoint.

    An engine that starts from the HF checkpoint agrees with an unperturbed actor before any sync;
    after this, only a sync that wrote every tensor (the tied LM head included) makes them agree.
    Noise is `scale` x the tensor's std (0.1 absolute for constant tensors such as norm weights),
    seeded by the parameter's name and, for TP-sharded tensors, the TP rank: replicated tensors get
    the same noise on every TP rank, and a tied output layer on the last pipeline stage gets the
    embedding's noise (it is the same HF tensor). Returns the number of elements changed.
    """
    while hasattr(model, "module"):  # megatron DDP / Float16Module wrappers
        model = model.module
    changed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = name
            if args.tie_word_embeddings and name.endswith("output_layer.weight"):
                key = "embedding.word_embeddings.weight"
            sharded = bool(getattr(p, "tensor_model_parallel", False))
            gen = torch.Generator().manual_seed(
                seed * 1_000_003 + zlib.crc32(key.encode()) + (groups.tp_rank * 7919 if sharded else 0)
            )
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype)
            std = float(p.float().std()) if p.numel() > 1 else 0.0
            p.add_(noise * (scale * std if std > 0 else 0.1))
            changed += p.numel()
    return changed


def add_engine_args(parser) -> None:
    """The verify CLI's rollout-engine flags."""
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default=None,
        help="also sync the Megatron weights into this rollout engine and compare log-probs",
    )
    parser.add_argument("--rollout-tp", type=int, default=1, help="rollout engine tensor parallel size")
    parser.add_argument("--sync-bucket-mb", type=int, default=64, help="weight-sync bucket size")


def engine_check(opts, hf_dir: str, groups, model, args, prompts: list[list[int]]) -> dict[str, float]:
    """{"max_abs_logprob_diff": value} after building `opts.engine` and syncing `model` into it.

    The engine starts from the HF checkpoint, so the Megatron weights are perturbed first
    (`perturb_weights`): only a working sync can make the engine agree with the actor. The hf
    engine's tensors are also wiped to NaN (a tensor the sync misses stays NaN); vLLM on CPU takes
    weights through its loader only, so there the perturbation is the whole proof.
    """
    from megatron_bridge.hf import read_hf_config
    from megatron_bridge.reshard import WeightSync
    from rlstack.config import RolloutConfig
    from rlstack.rollout.base import build_engine

    eos = read_hf_config(hf_dir).get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else eos
    cfg = RolloutConfig(
        engine=opts.engine,
        tp=opts.rollout_tp,
        max_num_seqs=max(8, len(prompts)),
        micro_batch_size=len(prompts),
        sync_bucket_mb=opts.sync_bucket_mb,
    )
    engine = build_engine(cfg, hf_dir, groups, eos_token_id=eos, pad_token_id=eos)
    perturb_weights(model, args, groups)
    targets = engine.param_targets()
    if targets is not None:
        with torch.no_grad():
            for t in targets.values():
                t.fill_(float("nan"))
    stats = WeightSync(model, args, groups, engine, bucket_mb=opts.sync_bucket_mb).sync()
    assert stats.bytes > 0, "the weight sync moved no bytes"
    if groups.rank == 0:
        print(
            f"sync seconds={stats.seconds:.3f} bytes={stats.bytes} received={stats.bytes_received} "
            f"peak_extra_bytes={stats.peak_extra_bytes}",
            file=sys.stderr,
            flush=True,
        )
    return {"max_abs_logprob_diff": verify_engine(model, args, groups, engine, prompts, opts.tol)}
