"""Padding removal: a micro-batch's rows packed end to end into one sequence (megatron's THD format).

A micro-batch is [b, S] right-padded rows cut to its longest row; every row shorter than that costs
the model's whole forward and backward on its padding. GRPO answers to one prompt range from a few
tokens to the length limit, so even with rows sorted by length (`pack_micro_batches`) ~10-15% of the
trained tokens were padding (SmolLM2 demo). Packed, the model sees [1, T] with T the sum of the
rows' needed lengths (`Rollout.needed_lengths`), and megatron's `PackedSeqParams` (qkv_format
"thd", `cu_seqlens`) makes RoPE restart at each row (`_apply_rotary_pos_emb_thd`) and attention stay
inside it (megatron_bridge/sdpa_attention.py on CPU and without Transformer Engine; TE's own THD
kernels with it). The output is scattered back to [b, S, ...] (0 past each row's length), so the
losses read the same layout as without packing (verl: `use_remove_padding`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Key of a micro-batch's per-row needed lengths [b] (MegatronRole.micro_batches adds it when packing).
SEQ_LENS = "seq_lens"


@dataclass
class PackedRows:
    """Where a micro-batch's kept tokens sit: flat indices into [b, S] and megatron's THD parameters."""

    index: torch.Tensor  # [T] long: row * S + position of each kept token, row after row
    rows: int
    seq_len: int
    params: object  # megatron.core.packed_seq_params.PackedSeqParams

    @classmethod
    def of(cls, lengths: torch.Tensor, seq_len: int, device) -> PackedRows:
        """lengths [b]: tokens each row keeps (at least one: a row that needs nothing keeps its first)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        lens = lengths.detach().to("cpu", torch.long).clamp(1, seq_len)  # [b]
        keep = torch.arange(seq_len)[None, :] < lens[:, None]  # [b, S]
        index = keep.reshape(-1).nonzero().squeeze(-1).to(device)  # [T]
        cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        cu = cu.to(device)
        longest = int(lens.max())
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        return cls(index=index, rows=lens.numel(), seq_len=seq_len, params=params)

    @property
    def tokens(self) -> int:
        """T: the model's sequence length, the rows' kept tokens."""
        return self.index.numel()

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[b, S] -> [1, T]: the kept tokens of every row, end to end."""
        return x.reshape(-1).index_select(0, self.index).unsqueeze(0)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """The model's [1, T, ...] output -> [b, S, ...], zeros past each row's length (differentiable)."""
        y = y.squeeze(0)  # [T, ...]
        out = y.new_zeros((self.rows * self.seq_len,) + tuple(y.shape[1:]))
        return out.index_copy(0, self.index, y).view(self.rows, self.seq_len, *y.shape[1:])
