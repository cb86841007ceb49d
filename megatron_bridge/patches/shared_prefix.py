"""Patch (q) `shared_prefix_rope`: megatron's THD RoPE with rows that share a prompt.

megatron-core 0.16.1 `models/common/embeddings/rope_utils.py` `_apply_rotary_pos_emb_thd` rotates
each packed segment by positions 0, 1, ... of its own (`freqs[:seqlen]`, cp size 1). A suffix
segment of a row sharing its prompt (megatron_bridge/shared_prefix.py) starts at its row's
position p instead: when cu_seqlens carries a `SharedPrefix`, the packed frequencies are
`freqs[positions]`, applied as megatron's own THD path applies its packed ones
(`_apply_rotary_pos_emb_bshd` on [T, 1, heads, d]). Other calls go to the original.
"""

from __future__ import annotations

import functools


def patch_shared_prefix_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_bridge.shared_prefix import shared_prefix_of

    original = rope_utils._apply_rotary_pos_emb_thd

    @functools.wraps(original)
    def thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, cp_group=None):
        shared = shared_prefix_of(cu_seqlens)
        if shared is None:
            return original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        assert cp_group is None or cp_group.size() == 1, "shared prompts: no context parallelism"
        packed = freqs.index_select(0, shared.positions.to(freqs.device))  # [T, 1, 1, d]
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            packed,
            rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention,
            mscale=mscale,
        ).squeeze(1)

    thd._rlstack_shared_prefix = True
    rope_utils._apply_rotary_pos_emb_thd = thd
