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
    resp_mask: torch.Tensor  # [B', S] 1 on response tokens the policy generated (agent loops: not inserted ones)
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
    reward_baselines: Optional[torch.Tensor] = None  # [B'] remax: the prompt's greedy reward (rlstack/step/remax.py)
    sum_pi_squared: Optional[torch.Tensor] = None  # [B', S] optimal_token_baseline: sum_v p_v^2 (old-log-prob forward)
    reward_components: Optional[torch.Tensor] = None  # [K, B'] gdpo: algorithm.gdpo_reward_keys' values (0 on fillers)

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
        "sum_pi_squared",
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
        loss_masks: Optional[list] = None,
    ) -> Rollout:
        """Padded tensors from per-sample lists (prompt ids, response ids, engine log-probs, score, group).

        `loss_masks[i]` (agent loops; None or a None entry: all ones) is ANDed into row i's response
        mask: a token a loop inserted (0) is in the sequence, but no loss, KL, advantage, value loss
        or engine-agreement metric reads it, and the score sits on the last policy token."""
        t = make_batch(prompt_ids, response_ids, pad_id, micro_batch_size, device)
        rows = t["tokens"].shape[0]
        for row, (p, m) in enumerate(zip(prompt_ids, loss_masks or [])):
            if m is not None:
                t["resp_mask"][row, len(p) : len(p) + len(m)] *= torch.tensor(m, dtype=torch.float32, device=device)
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

    def needed_lengths(self) -> torch.Tensor:
        """[B'] one past each row's last response token: the prefix a forward must see (0: no response).

        The log-prob of token t reads the logits at t - 1 and the value of t the hidden state at
        t - 1, so nothing past a row's last response token is read (filler rows need nothing).
        """
        positions = torch.arange(1, self.tokens.shape[1] + 1, device=self.resp_mask.device)  # [S]
        return ((self.resp_mask > 0) * positions).amax(dim=1)  # [B']

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


@dataclass
class MicroBatches:
    """A mini-batch's micro-batches, each cut to its own longest row, and the way back to its rows.

    `order[i]` is the mini-batch row behind the i-th micro-batch row (micro-batches in sequence).
    """

    batches: list[dict[str, torch.Tensor]]
    order: torch.Tensor  # [B] long
    seq_len: int  # S of the mini-batch

    def rows(self, stats: list[dict], key: str) -> torch.Tensor:
        """Per-row outputs `stats[i][key]` [b, s_i] -> [B, S] in the mini-batch's row order (0 past each cut)."""
        parts = [s[key] for s in stats]
        out = torch.zeros((len(self.order), self.seq_len), dtype=parts[0].dtype, device=parts[0].device)
        start = 0
        for part in parts:
            rows = self.order[start : start + part.shape[0]].to(out.device)
            out[rows, : part.shape[1]] = part
            start += part.shape[0]
        return out


def pack_micro_batches(
    batch: dict[str, torch.Tensor],
    micro_batch_size: int,
    lengths: Optional[torch.Tensor],
    max_tokens: int = 0,
    balance: bool = False,
    units: Optional[list[tuple[list[int], int]]] = None,
) -> MicroBatches:
    """[B, S] tensors -> micro-batches, longest rows first, each cut to its longest row.

    Rows are sorted by `lengths` (the prefix each row needs, `Rollout.needed_lengths`) so rows of
    similar length share a micro-batch: padding to the batch's longest row was ~25-35% of the
    trained tokens of a GRPO step (short and long answers to the same prompt). A micro-batch holds
    `micro_batch_size` rows, or with `max_tokens` > 0 as many rows as fit in `max_tokens` token
    slots (rows x its longest row; rows that need nothing are left out, but one micro-batch always
    runs: every rank joins the gradient all-reduce). Gradients are summed over a mini-batch's
    micro-batches, so their composition changes nothing but float summation order.
    `lengths=None` keeps rows in order and uncut (pipeline parallelism sends one
    [micro_batch, S] shape between stages for every micro-batch). `balance` (rows that run packed,
    without padding: model.remove_padding) deals the rows, longest first, into as many micro-batches
    as `micro_batch_size` rows make, each to the one holding the fewest tokens so far: micro-batches
    of near-equal tokens (rows per micro-batch may differ), so the largest, which sets the
    activation peak, is as small as it can be. `units` (rows sharing a prompt, packing.prompt_groups:
    [(rows, prompt length)]) are dealt whole with `balance`, each costing its prompt once, its rows
    longest first; under `max_tokens` they are taken unit after unit, cut only where the budget ends.
    """
    first = next(iter(batch.values()))
    size, seq_len = first.shape[:2]
    if lengths is None:
        assert size % micro_batch_size == 0, f"batch {size} is not a multiple of micro batch {micro_batch_size}"
        groups = [torch.arange(i, i + micro_batch_size) for i in range(0, size, micro_batch_size)]
        cuts = [seq_len] * len(groups)
    else:
        lengths = lengths.cpu()
        order = torch.sort(lengths, descending=True, stable=True).indices  # [B]
        if max_tokens > 0:  # rows sharing a prompt stay together where the budget lets them
            groups = _token_budget_groups(order if units is None else _unit_order(units, lengths), lengths, max_tokens)
        else:
            groups = None
        if groups is None and balance and units is not None:
            groups = _balanced_units(units, lengths, -(-size // micro_batch_size))
        if groups is None and balance:
            groups = _balanced_groups(order, lengths, -(-size // micro_batch_size))
        if groups is None:
            assert size % micro_batch_size == 0, f"batch {size} is not a multiple of micro batch {micro_batch_size}"
            groups = list(order.split(micro_batch_size))
        cuts = [max(1, int(lengths[rows].max())) for rows in groups]
    batches = [
        {k: v[:, :cut].index_select(0, rows.to(first.device)) for k, v in batch.items()}
        for rows, cut in zip(groups, cuts)
    ]
    return MicroBatches(batches=batches, order=torch.cat(groups), seq_len=seq_len)


def _balanced_groups(order: torch.Tensor, lengths: torch.Tensor, count: int) -> list[torch.Tensor]:
    """Rows in `order` (longest first) dealt into `count` groups, each to the group with the fewest
    tokens (greedy longest-processing-time); each group stays longest first, empty groups are dropped."""
    groups: list[list[int]] = [[] for _ in range(count)]
    tokens = [0] * count
    for r in order.tolist():
        g = min(range(count), key=lambda i: (tokens[i], len(groups[i])))
        groups[g].append(r)
        tokens[g] += max(1, int(lengths[r]))
    return [torch.tensor(g) for g in groups if g]


def _balanced_units(units: list, lengths: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`_balanced_groups` over units of rows that share a prompt: a unit's tokens are its prompt once
    and each row's suffix; units dealt largest first, whole, its rows longest first."""
    costs = []
    for rows, p in units:
        costs.append(p + sum(max(1, int(lengths[r])) - p for r in rows))
    groups: list[list[int]] = [[] for _ in range(count)]
    tokens = [0] * count
    for u in sorted(range(len(units)), key=lambda u: -costs[u]):  # stable: ties keep the units' order
        g = min(range(count), key=lambda i: (tokens[i], len(groups[i])))
        rows = sorted(units[u][0], key=lambda r: -int(lengths[r]))
        groups[g].extend(rows)
        tokens[g] += costs[u]
    return [torch.tensor(g) for g in groups if g]


def _token_budget_groups(order: torch.Tensor, lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Rows in `order` -> consecutive groups of at most `max_tokens` slots (rows x the group's longest row)."""
    rows = [int(r) for r in order if lengths[r] > 0] or [int(order[0])]
    groups, current, longest = [], [], 0
    for r in rows:
        n = max(1, int(lengths[r]))
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            groups.append(torch.tensor(current))
            current, longest = [], 0
        current.append(r)
        longest = max(longest, n)
    groups.append(torch.tensor(current))
    return groups


def _unit_order(units: list, lengths: torch.Tensor) -> torch.Tensor:
    """The rows of `units` (rows sharing a prompt) unit after unit, the unit with the longest row first,
    each unit's rows longest first: a token budget then cuts a unit only where it must."""
    key = lambda r: -int(lengths[r])  # noqa: E731
    ranked = sorted(units, key=lambda u: min(key(r) for r in u[0]))  # stable: ties keep the units' order
    return torch.tensor([r for rows, _ in ranked for r in sorted(rows, key=key)])


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` [n, ...] zero-padded to `rows` rows (the filler rows of the last micro-batch)."""
    if x.shape[0] == rows:
        return x
    pad = torch.zeros((rows - x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=0)
