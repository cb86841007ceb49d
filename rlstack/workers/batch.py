"""Rollout results -> padded training tensors, and the split of rollout work over ranks."""

from __future__ import annotations

import torch

from rlstack import collectives


def make_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, multiple_of: int,
               device) -> dict[str, torch.Tensor]:
    """Right-padded `tokens`/`position_ids`/`resp_mask` [B', S] with B' rounded up to `multiple_of`.

    Right padding keeps every real token at its natural position, so the causal mask alone is
    exact; padding rows (to fill the last micro-batch) have an all-zero mask and change nothing.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    seq_len = max(lengths, default=1)
    # A rank without sequences (fewer prompts than data-parallel ranks) still runs one all-padding
    # micro-batch: it must join the gradient all-reduce, and its zero mask adds nothing.
    rows = max(1, -(-len(lengths) // multiple_of)) * multiple_of
    tokens = torch.full((rows, seq_len), pad_id, dtype=torch.long)
    resp_mask = torch.zeros((rows, seq_len), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        tokens[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        resp_mask[i, len(p): len(p) + len(r)] = 1.0
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(rows, -1).contiguous()
    batch = {"tokens": tokens, "position_ids": position_ids, "resp_mask": resp_mask}
    return {k: v.to(device) for k, v in batch.items()}


def scatter_to_tokens(values: list[float], batch: dict) -> torch.Tensor:
    """Per-sequence values [n] -> [B'] (padding rows get 0)."""
    out = torch.zeros(batch["tokens"].shape[0], dtype=torch.float32, device=batch["tokens"].device)
    out[: len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def split_for_rank(items: list, rank: int, size: int) -> list:
    """Contiguous share `rank` of `size` (sizes differ by at most one)."""
    per, extra = divmod(len(items), size)
    start = rank * per + min(rank, extra)
    return items[start: start + per + (1 if rank < extra else 0)]


def gather_objects(local: list, group, size: int) -> list:
    """Concatenate every rank's list, in rank order, on every rank of `group`."""
    if size == 1:
        return local
    return [item for part in collectives.all_gather_objects(local, group, size) for item in part]
