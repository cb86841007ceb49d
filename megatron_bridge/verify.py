"""Check the bridge: the same batch through transformers and through the Megatron model at TP x PP.

    torchrun --nproc_per_node=W -m megatron_bridge.verify --hf DIR|default|tiny --tp N --pp M [--ep E] [--tol 1e-4]

Prints `max_abs_logit_diff=<value>` (largest |HF - Megatron| over the real tokens and the real
vocabulary, float32) on rank 0; every rank exits 1 when a difference exceeds `--tol`.
With `--reward-model` (a 1-label `*ForSequenceClassification`, e.g. a reward model) it prints
`max_abs_score_diff` (transformers' pooled score vs the Megatron scalar head at the same token) and
`max_abs_token_score_diff` (the head at every real token).

Each comparison is one entry of `run_checks`; applications add their own through `extra_checks`
(`python -m rlstack.verify ... --engine hf|vllm --rollout-tp K` adds the rollout engine's, after a
weight sync: engines belong to rlstack, which the bridge never imports).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bridge.errors import InputError
from megatron_bridge.forward import megatron_logits, megatron_scores

PROMPTS = (
    "The capital of France is",
    "What is 12 plus 30? Give the final answer after ####.",
    "<|im_start|>user\nTom has 3 apples. He buys 4 more. How many does he have now?<|im_end|>\n",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] right-padded
    lengths: torch.Tensor  # [B] real tokens per row


def build_parser(prog: str = "python -m megatron_bridge.verify") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="HF checkpoint directory, `default` (SmolLM2) or `tiny`")
    p.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="Megatron pipeline parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE; must divide the data-parallel size)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest allowed |logit difference| (float32)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per prompt (longer prompts are cut)")
    p.add_argument("--cache-dir", default=None, help="where `default`/`tiny` checkpoints are provisioned")
    p.add_argument(
        "--reward-model",
        action="store_true",
        help="--hf is a 1-label *ForSequenceClassification: compare its scores (value head) instead of logits",
    )
    return p


# ---------------------------------------------------------------- inputs and references


def make_batch(hf_dir: str, vocab_size: int, seq_len: int) -> Batch:
    """Fixed prompts through the checkpoint's own tokenizer (fast or SentencePiece), right-padded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"][:seq_len] for p in PROMPTS]
    if max(max(r) for r in rows) >= vocab_size:
        raise InputError(
            f"the tokenizer in {hf_dir} yields ids >= vocab_size={vocab_size}: tokenizer and "
            f"config.json do not belong together"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r)
    return Batch(input_ids=input_ids, lengths=torch.tensor([len(r) for r in rows]))


def padding_mask(batch: Batch) -> torch.Tensor:
    positions = torch.arange(batch.input_ids.shape[1])
    return (positions[None, :] < batch.lengths[:, None]).long()  # [B, S]


def hf_logits(hf_dir: str, batch: Batch, device="cpu") -> torch.Tensor:
    """transformers' float32 logits [B, S, vocab] for the batch (padding masked), on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        out = model(input_ids=batch.input_ids.to(device), attention_mask=padding_mask(batch).to(device))
    return out.logits.float().cpu()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor) -> float:
    """Largest |a - b| over real tokens only ([B, S, V] each; padding positions ignored)."""
    mask = torch.arange(a.shape[1])[None, :] < lengths[:, None]  # [B, S]
    return (a.float() - b.float()).abs()[mask].max().item()


# ---------------------------------------------------------------- reward models (sequence classifiers)


@dataclass
class HFScores:
    pooled: torch.Tensor  # [B] transformers' `logits` (its score at the last non-pad token)
    per_token: torch.Tensor  # [B, S] the `score` head at every position (a forward hook)
    index: torch.Tensor  # [B] the position transformers pooled at


def hf_seq_cls_scores(hf_dir: str, batch: Batch, device="cpu") -> HFScores:
    """transformers' own `AutoModelForSequenceClassification` scores of the batch (float32, CPU)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    seen = {}
    hook = model.score.register_forward_hook(lambda _m, _i, out: seen.update(per_token=out))
    with torch.no_grad():
        out = model(input_ids=batch.input_ids.to(device), attention_mask=padding_mask(batch).to(device))
    hook.remove()
    return HFScores(
        pooled=out.logits[:, 0].float().cpu(),
        per_token=seen["per_token"][..., 0].float().cpu(),
        index=hf_pool_index(batch.input_ids, model.config.pad_token_id),
    )


def hf_pool_index(input_ids: torch.Tensor, pad_id: Optional[int]) -> torch.Tensor:
    """[B, S] -> [B]: where transformers' ForSequenceClassification reads (rightmost non-pad token)."""
    if pad_id is None:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - 1, dtype=torch.long)
    positions = torch.arange(input_ids.shape[1])
    return (positions * (input_ids != pad_id)).argmax(-1)


def reward_model_checks(hf_dir: str, groups, batch: Batch, reference: Optional[HFScores]) -> dict[str, float]:
    """{max |score diff| at the pooled position, over every real token} vs transformers (rank 0)."""
    from megatron_bridge.hf import build_megatron_from_hf

    model, _ = build_megatron_from_hf(hf_dir, groups, value_head=True)
    scores = megatron_scores(model, batch.input_ids, groups)  # [B, S]
    if groups.rank != 0:
        return {}
    pooled = scores.gather(1, reference.index[:, None])[:, 0]
    mask = padding_mask(batch).bool()
    return {
        "max_abs_score_diff": (pooled - reference.pooled).abs().max().item(),
        "max_abs_token_score_diff": (scores - reference.per_token).abs()[mask].max().item(),
    }


# ---------------------------------------------------------------- the command

# An extra check an application adds (rlstack.verify adds the rollout engine's):
# fn(opts, hf_dir, groups, model, args, prompts) -> {name: max difference} (valid on rank 0).
ExtraCheck = Callable[..., dict]


def run_checks(
    opts, hf_dir: str, groups, batch: Batch, reference, extra_checks: Sequence[ExtraCheck] = ()
) -> dict[str, float]:
    """{check name: max |logit difference| vs transformers}, valid on global rank 0.

    `reference` is transformers' logits on rank 0 (None elsewhere); `extra_checks` run on the same model.
    """
    from megatron_bridge.hf import build_megatron_from_hf

    start = time.time()
    model, args = build_megatron_from_hf(hf_dir, groups)
    _log(groups, f"megatron model built and loaded in {time.time() - start:.1f}s")
    logits = megatron_logits(model, batch.input_ids, groups, args.vocab_size)
    results = {"max_abs_logit_diff": max_abs_diff(logits, reference, batch.lengths)} if groups.rank == 0 else {}
    prompts = [row[:n].tolist() for row, n in zip(batch.input_ids, batch.lengths)]
    for check in extra_checks:
        extra = check(opts, hf_dir, groups, model, args, prompts)
        if groups.rank == 0:
            results.update(extra)
    return results


def main(argv=None, parser: Optional[argparse.ArgumentParser] = None, extra_checks: Sequence[ExtraCheck] = ()) -> int:
    parser = parser or build_parser()
    opts = parser.parse_args(argv)
    from megatron_bridge import patches
    from megatron_bridge.hf import check_layout, read_model_args, resolve_model_path
    from megatron_bridge.parallel import ParallelDims, destroy_distributed, init_distributed
    from megatron_bridge.patches import cpu_matmul

    try:  # user mistakes surface before any process group starts: one line naming the fix
        patches.apply()
        # the conversion is checked, not the kernels: megatron's float32 CPU matmuls on torch's own kernel,
        # as the HF reference's (oneDNN's rounding, up to ~1.2e-4 on SmolLM2's logits, is not a layout error)
        cpu_matmul.set_mode("torch")
        hf_dir = resolve_model_path(opts.hf, cache_dir=opts.cache_dir)
        args = read_model_args(hf_dir)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_layout(args, ParallelDims.resolve(opts.tp, opts.pp, -1, world, ep=opts.ep))
    except InputError as e:
        parser.error(str(e))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    groups = init_distributed(opts.tp, opts.pp, ep=opts.ep)
    try:
        batch = make_batch(hf_dir, args.vocab_size, opts.seq_len)
        if opts.reward_model:
            reference = hf_seq_cls_scores(hf_dir, batch, groups.device) if groups.rank == 0 else None
            results = reward_model_checks(hf_dir, groups, batch, reference)
        else:
            reference = hf_logits(hf_dir, batch, groups.device) if groups.rank == 0 else None
            results = run_checks(opts, hf_dir, groups, batch, reference, extra_checks)
        failed = _report(results, opts.tol, groups)
    finally:
        destroy_distributed()
    return 1 if failed else 0


def _report(results: dict[str, float], tol: float, groups) -> bool:
    """Rank 0 prints; the verdict is shared so every rank exits with the same code."""
    import torch.distributed as dist

    if groups.rank == 0:
        for name, value in results.items():
            print(f"{name}={value:.3e}", flush=True)
        print(f"peak_rss_mib_rank0={_peak_rss_mib():.0f}", flush=True)
    # `not v <= tol` also fails NaN
    verdict = torch.tensor(
        [float(groups.rank == 0 and any(not v <= tol for v in results.values()))], device=groups.device
    )
    dist.all_reduce(verdict, group=groups.world)
    return verdict.item() > 0


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _log(groups, message: str) -> None:
    if groups.rank == 0:
        print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    from megatron_bridge.fast_exit import run_main

    run_main(main)
