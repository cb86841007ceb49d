"""Rollout results -> padded training tensors (`Rollout`), and the split of rollout work over ranks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from rlstack import collectives


def make_batch(
    prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, multiple_of: int, device
) -> dict[str, torch.Tensor]:
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
        resp_mask[i, len(p) : len(p) + len(r)] = 1.0
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(rows, -1).contiguous()
    batch = {"tokens": tokens, "position_ids": position_ids, "resp_mask": resp_mask}
    return {k: v.to(device) for k, v in batch.items()}


def split_for_rank(items: list, rank: int, size: int) -> list:
    """Contiguous share `rank` of `size` (sizes differ by at most one)."""
    per, extra = divmod(len(items), size)
    start = rank * per + min(rank, extra)
    return items[start : start + per + (1 if rank < extra else 0)]


def gather_objects(local: list, group, size: int) -> list:
    """Concatenate every rank's list, in rank order, on every rank of `group`."""
    if size == 1:
        return local
    return [item for part in collectives.all_gather_objects(local, group, size) for item in part]


@dataclass
class Rollout:
    """One step's samples on this data-parallel rank, from generation to update.

    Per-row tensors are [B', S] (or [B']) with B' = `num_sequences` rounded up to the micro-batch
    size: rows past `num_sequences` only fill the last micro-batch (all-zero mask, score 0,
    group id -1). The scoring stage fills `old_logprob` (None when `on_policy`: the update's own
    forward gives it), `ref_logprob` (with a reference), `old_values` (with a critic), then the
    advantage stage `advantages` and `returns`.
    """

    tokens: torch.Tensor  # [B', S] right-padded prompt + response
    position_ids: torch.Tensor  # [B', S]
    resp_mask: torch.Tensor  # [B', S] 1 on response tokens
    scores: torch.Tensor  # [B'] sequence rewards
    group_ids: torch.Tensor  # [B'] prompt index of each sample (its GRPO group); -1 on filler rows
    rollout_logprob: torch.Tensor  # [B', S] the engine's log-probs of the sampled tokens
    num_sequences: int  # real rows
    num_tokens: int  # prompt + response tokens of the real rows
    on_policy: bool  # one epoch over one mini-batch: the policy that sampled is the one updated
    old_logprob: Optional[torch.Tensor] = None  # [B', S]
    ref_logprob: Optional[torch.Tensor] = None  # [B', S]
    old_values: Optional[torch.Tensor] = None  # [B', S]
    advantages: Optional[torch.Tensor] = None  # [B', S]
    returns: Optional[torch.Tensor] = None  # [B', S]

    _ROW_FIELDS = (
        "tokens",
        "position_ids",
        "resp_mask",
        "scores",
        "group_ids",
        "rollout_logprob",
        "old_logprob",
        "ref_logprob",
        "old_values",
        "advantages",
        "returns",
    )

    @classmethod
    def build(
        cls,
        prompt_ids: list,
        response_ids: list,
        logprobs: list,
        scores: list,
        group_ids: list,
        pad_id: int,
        micro_batch_size: int,
        device,
        on_policy: bool,
    ) -> Rollout:
        """Padded tensors from per-sample lists (prompt ids, response ids, engine log-probs, score, group)."""
        t = make_batch(prompt_ids, response_ids, pad_id, micro_batch_size, device)
        rows = t["tokens"].shape[0]
        rollout_lp = torch.zeros_like(t["resp_mask"])
        for row, (p, r, lps) in enumerate(zip(prompt_ids, response_ids, logprobs)):
            rollout_lp[row, len(p) : len(p) + len(r)] = torch.tensor(lps, dtype=torch.float32)
        score_t = torch.zeros(rows, dtype=torch.float32, device=device)
        score_t[: len(scores)] = torch.tensor(scores, dtype=torch.float32)
        groups = torch.tensor(list(group_ids) + [-1] * (rows - len(group_ids)), dtype=torch.long, device=device)
        return cls(
            tokens=t["tokens"],
            position_ids=t["position_ids"],
            resp_mask=t["resp_mask"],
            scores=score_t,
            group_ids=groups,
            rollout_logprob=rollout_lp,
            num_sequences=len(prompt_ids),
            num_tokens=sum(len(p) + len(r) for p, r in zip(prompt_ids, response_ids)),
            on_policy=on_policy,
        )

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    def tensors(self, *names: str) -> dict[str, torch.Tensor]:
        """The named per-row tensors that are set (all of them when no name is given)."""
        return {k: getattr(self, k) for k in (names or self._ROW_FIELDS) if getattr(self, k) is not None}

    def rows_slice(self, start: int, stop: int) -> Rollout:
        """Rows [start, stop) as a Rollout (a mini-batch); counts are of its real rows."""
        sliced = {k: v[start:stop] for k, v in self.tensors().items()}
        real = max(0, min(stop, self.num_sequences) - start)
        return dataclasses.replace(self, **sliced, num_sequences=real)

    def mini_batches(self, mini_batch_size: int, dp: int, micro_batch_size: int) -> list[Rollout]:
        """This rank's mini-batches: global `mini_batch_size` / dp rows each, a multiple of the micro-batch."""
        size = self.rows
        local = (
            size
            if mini_batch_size <= 0
            else max(micro_batch_size, (mini_batch_size // dp) // micro_batch_size * micro_batch_size)
        )
        return [self.rows_slice(i, i + local) for i in range(0, size, local)]


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` [n, ...] zero-padded to `rows` rows (the filler rows of the last micro-batch)."""
    if x.shape[0] == rows:
        return x
    pad = torch.zeros((rows - x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=0)
