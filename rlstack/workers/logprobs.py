"""Log-probs and entropy from vocabulary-parallel logits, ignoring Megatron's vocab padding.

Megatron pads the vocabulary to a multiple of 128 x TP; the padded rows are not tokens, so their
logits are masked to -inf before the softmax (they would otherwise add mass to the partition
function). Reductions over the TP group go through megatron's autograd-aware all-reduce.
"""

from __future__ import annotations

import torch


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    tp_group,
    tp_rank: int,
    tp_size: int,
    with_entropy: bool = False,
):
    """logits [B, S, V/tp] (this rank's vocab slice), targets [B, S] -> logprob [B, S] (+ entropy [B, S]).

    logprob[b, t] = log p(targets[b, t] | logits[b, t]); entropy of the same distribution.
    """
    logits = logits.float()
    shard = logits.shape[-1]
    start = tp_rank * shard
    real = max(0, min(shard, vocab_size - start))  # real (unpadded) columns in this shard
    if real < shard:
        pad = torch.zeros(shard, dtype=torch.bool, device=logits.device)
        pad[real:] = True
        logits = logits.masked_fill(pad, float("-inf"))
    row_max = logits.detach().max(dim=-1).values  # [B, S]; softmax is shift-invariant: no grad needed
    row_max = _all_reduce(row_max, tp_group, tp_size, op="max")
    shifted = logits - row_max.unsqueeze(-1)  # [B, S, V/tp]
    exp = shifted.exp()
    sum_exp = _reduce(exp.sum(dim=-1), tp_group, tp_size)  # [B, S]
    local_t = targets - start
    in_shard = (local_t >= 0) & (local_t < real)
    picked = shifted.gather(-1, local_t.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    picked = _reduce(torch.where(in_shard, picked, torch.zeros_like(picked)), tp_group, tp_size)
    log_z = sum_exp.log()
    logprob = picked - log_z
    if not with_entropy:
        return logprob
    p_times_s = torch.where(exp > 0, exp * shifted, torch.zeros_like(exp)).sum(dim=-1)
    entropy = log_z - _reduce(p_times_s, tp_group, tp_size) / sum_exp
    return logprob, entropy


def _reduce(x: torch.Tensor, group, size: int) -> torch.Tensor:
    if size == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def _all_reduce(x: torch.Tensor, group, size: int, op: str) -> torch.Tensor:
    if size == 1:
        return x
    from rlstack import collectives

    return collectives.all_reduce_(x.clone(), group, x.device, op=op)  # x is on the model's device


def shift_targets(tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, S] -> targets [B, S]: position t predicts token t+1 (last position predicts pad 0)."""
    return torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)


def align_to_tokens(per_position: torch.Tensor) -> torch.Tensor:
    """[B, S] values computed at position t (about token t+1) -> [B, S] indexed by token t; t=0 gets 0."""
    return torch.cat([torch.zeros_like(per_position[:, :1]), per_position[:, :-1]], dim=1)
