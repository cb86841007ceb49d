"""Train/rollout agreement after a weight sync, for the command line: `engine_check` is the
`--engine hf|vllm --rollout-tp K` entry of `python -m rlstack.verify` (see `add_engine_args`).

`verify_engine`, which the trainer calls after a sync (`rollout.verify_sync`), lives in
`rlstack.rollout.sync_check` (the training path imports no command-line module); re-exported here.
"""

from __future__ import annotations

import logging
import sys
import zlib

import torch

from rlstack.rollout.sync_check import verify_engine

log = logging.getLogger("rlstack")

__all__ = ["add_engine_args", "engine_check", "perturb_weights", "verify_engine"]


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
