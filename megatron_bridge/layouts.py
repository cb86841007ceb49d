"""Pure tensor layouts: Megatron TP shards and vLLM TP shards of HF tensors (no process groups).

Each transform is written once as two steps, so a loader can read only the bytes a rank owns:
  `*_pieces(...)`  which rows/columns of each HF tensor a TP rank owns (a `Piece` per HF tensor);
  `*_pack(...)`    how the owned pieces become that rank's parameter (fuse, pad).
`megatron_shard` / `vllm_shard` compose the two on full tensors; `megatron_unshard` inverts
`megatron_shard` from all TP ranks' shards.

Layouts (megatron-core 0.16.1, vLLM 0.32):
- Megatron fused QKV, per TP rank: [groups_r, heads_per_group + 2, head_dim, ...] flattened to rows:
  each query group's q heads, then its k head, then its v head (`qkv_megatron`).
- vLLM `QKVParallelLinear`, per TP rank: [q_r; k_r; v_r] (`qkv_vllm`); when TP exceeds the KV heads,
  each KV head is replicated on TP / num_kv_heads ranks (model_executor/layers/linear.py,
  QKVParallelLinear.__init__ and weight_loader: shard_rank = tp_rank // num_kv_head_replicas).
- SwiGLU fc1 / vLLM `MergedColumnParallelLinear` gate_up_proj, per TP rank: [gate_r; up_r].
- Vocabulary: Megatron pads to a multiple of make_vocab_size_divisible_by x TP; vLLM's
  VocabParallelEmbedding pads to a multiple of 64 (DEFAULT_VOCAB_PADDING_SIZE) and splits the padded
  rows evenly. Padded rows are zeros; export drops them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron_bridge.errors import InputError
from megatron_bridge.mappings import TRANSFORMS

VLLM_VOCAB_PADDING = 64  # vllm/model_executor/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclass(frozen=True)
class Piece:
    """Rows (dim 0) or columns (dim 1) [start, stop) of one HF tensor; `dim=None`: the whole tensor."""

    dim: Optional[int]
    start: int = 0
    stop: int = 0

    def take(self, full: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return full
        return full.narrow(self.dim, self.start, self.stop - self.start)


WHOLE = Piece(None)


def _check_transform(transform: str) -> None:
    if transform not in TRANSFORMS:
        raise ValueError(f"unknown transform {transform!r}: expected one of {', '.join(TRANSFORMS)}")


def _split(size: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    if size % tp_size:
        raise InputError(f"{what} of size {size} does not divide by TP={tp_size}: choose a TP that divides it")
    chunk = size // tp_size
    return tp_rank * chunk, (tp_rank + 1) * chunk


def _as_list(tensors: Tensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


# ---------------------------------------------------------------- vocabulary padding (both engines)


def vocab_rows(vocab_size: int, padded_vocab: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Real (unpadded) vocabulary rows [start, stop) held by a rank; may be empty on the last ranks."""
    start, stop = _split(padded_vocab, tp_rank, tp_size, "padded vocabulary")
    return min(start, vocab_size), min(stop, vocab_size)


def pad_rows(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[r, ...] -> [num_rows, ...] with zero rows appended (padded vocabulary entries)."""
    assert rows.shape[0] <= num_rows
    if rows.shape[0] == num_rows:
        return rows
    pad = rows.new_zeros((num_rows - rows.shape[0], *rows.shape[1:]))
    return torch.cat([rows, pad], dim=0)


def unpad_rows(padded: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return padded[:vocab_size]


def vllm_padded_vocab(vocab_size: int, pad_to: int = VLLM_VOCAB_PADDING) -> int:
    return (vocab_size + pad_to - 1) // pad_to * pad_to


# ---------------------------------------------------------------- QKV and gate/up (whole model)


def qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """HF q [heads*d, ...], k/v [groups*d, ...] -> Megatron fused rows [(heads + 2*groups)*d, ...]."""
    rest = q.shape[1:]
    q_g = q.reshape(num_query_groups, -1, *rest)  # [groups, heads_per_group*d, ...]
    k_g = k.reshape(num_query_groups, -1, *rest)  # [groups, d, ...]
    v_g = v.reshape(num_query_groups, -1, *rest)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *rest)


def qkv_split(qkv: torch.Tensor, num_query_groups: int, heads_per_group: int) -> tuple[torch.Tensor, ...]:
    """Inverse of `qkv_fuse`: fused rows [(heads + 2*groups)*d, ...] -> (q, k, v)."""
    rest = qkv.shape[1:]
    fused = qkv.reshape(num_query_groups, heads_per_group + 2, -1, *rest)  # [groups, hpg+2, d, ...]
    q = fused[:, :heads_per_group].reshape(-1, *rest)
    k = fused[:, heads_per_group].reshape(-1, *rest)
    v = fused[:, heads_per_group + 1].reshape(-1, *rest)
    return q, k, v


def gate_up_fuse(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)  # [2*ffn_r, H]


def gate_up_split(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fused.chunk(2, dim=0)
    return gate, up


# ---------------------------------------------------------------- Megatron TP


def megatron_pieces(
    transform: str, hf_shapes: Sequence[Sequence[int]], tp_rank: int, tp_size: int, args, divisible_by: int = 128
) -> list[Piece]:
    """Which part of each HF tensor Megatron TP rank `tp_rank` owns."""
    _check_transform(transform)
    if transform == "replicate":
        return [WHOLE]
    if transform == "row":
        return [Piece(1, *_split(hf_shapes[0][1], tp_rank, tp_size, "row-parallel input dim"))]
    if transform == "vocab":
        padded = args.padded_vocab_size(tp_size, divisible_by)
        return [Piece(0, *vocab_rows(args.vocab_size, padded, tp_rank, tp_size))]
    if transform == "qkv":
        _check_heads(args, tp_size)
        return _grouped_rows(hf_shapes, args, tp_rank, tp_size)
    # column and gate_up: every HF tensor split by rows
    return [Piece(0, *_split(s[0], tp_rank, tp_size, "column-parallel output dim")) for s in hf_shapes]


def _check_heads(args, tp_size: int) -> None:
    if args.num_attention_heads % tp_size or args.num_query_groups % tp_size:
        raise InputError(
            f"TP={tp_size} must divide the {args.num_attention_heads} attention heads and "
            f"{args.num_query_groups} query groups: choose a TP that divides both"
        )


def _grouped_rows(hf_shapes, args, tp_rank: int, tp_size: int) -> list[Piece]:
    q_rows, kv_rows = hf_shapes[0][0], hf_shapes[1][0]
    return [
        Piece(0, *_split(q_rows, tp_rank, tp_size, "q heads")),
        Piece(0, *_split(kv_rows, tp_rank, tp_size, "k heads")),
        Piece(0, *_split(kv_rows, tp_rank, tp_size, "v heads")),
    ]


def megatron_pack(
    transform: str, parts: Sequence[torch.Tensor], tp_size: int, args, divisible_by: int = 128
) -> torch.Tensor:
    """A TP rank's Megatron parameter from its owned pieces (in HF tensor order)."""
    _check_transform(transform)
    if transform == "vocab":
        return pad_rows(parts[0], args.padded_vocab_size(tp_size, divisible_by) // tp_size)
    if transform == "qkv":
        return qkv_fuse(*parts, num_query_groups=args.num_query_groups // tp_size)
    if transform == "gate_up":
        return gate_up_fuse(*parts)
    return parts[0]


def megatron_shard(
    transform: str, full: Tensors, tp_rank: int, tp_size: int, args, divisible_by: int = 128
) -> torch.Tensor:
    """Full HF tensor(s) of one rule -> Megatron TP rank `tp_rank`'s parameter."""
    tensors = _as_list(full)
    pieces = megatron_pieces(transform, [t.shape for t in tensors], tp_rank, tp_size, args, divisible_by)
    return megatron_pack(transform, [p.take(t) for p, t in zip(pieces, tensors)], tp_size, args, divisible_by)


def megatron_unshard(transform: str, shards: Sequence[torch.Tensor], args) -> tuple[torch.Tensor, ...]:
    """All TP ranks' parameters (rank order) -> the full HF tensor(s) of the rule, in HF order."""
    _check_transform(transform)
    if transform == "replicate":
        return (shards[0],)
    if transform == "row":
        return (torch.cat(list(shards), dim=1),)
    if transform == "column":
        return (torch.cat(list(shards), dim=0),)
    if transform == "vocab":
        return (unpad_rows(torch.cat(list(shards), dim=0), args.vocab_size),)
    if transform == "gate_up":
        gates, ups = zip(*(gate_up_split(s) for s in shards))
        return torch.cat(gates, dim=0), torch.cat(ups, dim=0)
    groups_r = args.num_query_groups // len(shards)
    heads_per_group = args.num_attention_heads // args.num_query_groups
    parts = [qkv_split(s, groups_r, heads_per_group) for s in shards]
    return tuple(torch.cat([p[i] for p in parts], dim=0) for i in range(3))


# ---------------------------------------------------------------- vLLM TP


def vllm_kv_heads(args, tp_size: int) -> tuple[int, int]:
    """(KV heads per rank, ranks sharing each KV head), as QKVParallelLinear.__init__ computes them."""
    groups = args.num_query_groups
    if args.num_attention_heads % tp_size:
        raise InputError(f"rollout TP={tp_size} must divide the {args.num_attention_heads} attention heads")
    if tp_size >= groups:
        if tp_size % groups:
            raise InputError(f"rollout TP={tp_size} must be a multiple of the {groups} KV heads when larger")
        return 1, tp_size // groups
    if groups % tp_size:
        raise InputError(f"rollout TP={tp_size} must divide the {groups} KV heads")
    return groups // tp_size, 1


def vllm_pieces(
    transform: str,
    hf_shapes: Sequence[Sequence[int]],
    tp_rank: int,
    tp_size: int,
    args,
    pad_to: int = VLLM_VOCAB_PADDING,
) -> list[Piece]:
    """Which part of each HF tensor vLLM TP rank `tp_rank` loads."""
    _check_transform(transform)
    if transform == "vocab":
        padded = vllm_padded_vocab(args.vocab_size, pad_to)
        return [Piece(0, *vocab_rows(args.vocab_size, padded, tp_rank, tp_size))]
    if transform == "qkv":
        kv_per_rank, replicas = vllm_kv_heads(args, tp_size)
        q = Piece(0, *_split(hf_shapes[0][0], tp_rank, tp_size, "q heads"))
        kv_rows = kv_per_rank * args.head_dim
        kv_start = (tp_rank // replicas) * kv_rows
        return [q, Piece(0, kv_start, kv_start + kv_rows), Piece(0, kv_start, kv_start + kv_rows)]
    return megatron_pieces(transform, hf_shapes, tp_rank, tp_size, args)


def vllm_pack(
    transform: str, parts: Sequence[torch.Tensor], tp_size: int, args, pad_to: int = VLLM_VOCAB_PADDING
) -> torch.Tensor:
    """A vLLM TP rank's parameter from its owned pieces (in HF tensor order)."""
    _check_transform(transform)
    if transform == "vocab":
        return pad_rows(parts[0], vllm_padded_vocab(args.vocab_size, pad_to) // tp_size)
    if transform == "qkv":
        return torch.cat(list(parts), dim=0)  # [q_r; k_r; v_r]
    if transform == "gate_up":
        return gate_up_fuse(*parts)
    return parts[0]


def vllm_shard(
    transform: str, full: Tensors, tp_rank: int, tp_size: int, args, pad_to: int = VLLM_VOCAB_PADDING
) -> torch.Tensor:
    """Full HF tensor(s) of one rule -> vLLM TP rank `tp_rank`'s parameter (qkv_proj, gate_up_proj, ...)."""
    tensors = _as_list(full)
    pieces = vllm_pieces(transform, [t.shape for t in tensors], tp_rank, tp_size, args, pad_to)
    return vllm_pack(transform, [p.take(t) for p, t in zip(pieces, tensors)], tp_size, args, pad_to)
