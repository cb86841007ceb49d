"""Rows packed with a shared prompt: what megatron's RoPE and the SDPA core attention read.

rlstack packs the n samples of one prompt with the prompt once (rlstack/workers/packing.py,
model.prefix_sharing): the first row keeps its whole row, each other row only its suffix. megatron
hands `PackedSeqParams.cu_seqlens_q` unchanged to RoPE (`apply_rotary_pos_emb` ->
`_apply_rotary_pos_emb_thd`) and to the core attention, so the layout rides on that tensor as the
attribute `SHARED_ATTR`:

- RoPE (patch `shared_prefix_rope`, megatron_bridge/patches/shared_prefix.py): each packed token
  rotated by its position in its row (`positions`), not by its offset in its segment: a suffix
  starting after a p-token prompt starts at position p.
- attention (megatron_bridge/sdpa_attention.py): a suffix segment's queries see the prompt's keys
  and values (`prefix_start`, `prefix_len` in the pack) and causally their own; a segment with no
  prefix is a row on its own, as without sharing.
Without the attribute both behave as megatron's THD path: each segment a row starting at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

SHARED_ATTR = "rlstack_shared_prefix"


@dataclass
class SharedPrefix:
    """Per packed segment the pack offset and length of the prompt it attends to besides itself
    (length 0: a row on its own), and every packed token's position in its row."""

    prefix_start: list[int]
    prefix_len: list[int]
    positions: torch.Tensor  # [T] long
    _masks: dict = field(default_factory=dict, repr=False)  # (prefix, own, device) -> suffix_mask

    def mask(self, prefix: int, own: int, device) -> torch.Tensor:
        """`suffix_mask(prefix, own)`, built once per micro-batch for all its layers."""
        key = (prefix, own, str(device))
        if key not in self._masks:
            self._masks[key] = suffix_mask(prefix, own, device)
        return self._masks[key]


def shared_prefix_of(cu_seqlens) -> Optional[SharedPrefix]:
    """The `SharedPrefix` a packed micro-batch's cu_seqlens carries, or None."""
    return getattr(cu_seqlens, SHARED_ATTR, None)


def suffix_mask(prefix: int, own: int, device) -> torch.Tensor:
    """[own, prefix + own] bool: every prompt key, and the segment's own keys causally."""
    mask = torch.ones(own, prefix + own, dtype=torch.bool, device=device)
    mask[:, prefix:] = torch.ones(own, own, dtype=torch.bool, device=device).tril_()
    return mask
