"""Core attention for megatron's local spec through torch's `F.scaled_dot_product_attention`.

megatron-core 0.16.1's local spec uses the unfused `DotProductAttention`
(transformer/dot_product_attention.py): it repeats K/V to every query head, materialises the
[b, heads, s, s] scores, the fp32 softmax and its mask copies in every layer, and autograd keeps
them for backward. SDPA (causal, `enable_gqa=True`) runs torch's flash kernel on CPU
(`_scaled_dot_product_flash_attention_for_cpu`) and flash / memory-efficient attention on a GPU,
keeping only the output and the log-sum-exp per row. The module is a drop-in for the spec's
`self_attention.submodules.core_attention`: same constructor and forward signature as 0.16.1's
DotProductAttention, same q/k/v layout ([s, b, heads_per_partition, head_dim]) and output
([sq, b, hidden_per_partition]), same softmax scale.

Only what rlstack builds is supported (everything else is a bug in the caller): self attention
with the causal mask megatron's GPTModel gives (rlstack calls `model(tokens, position_ids, None)`
on right-padded rows: a causal mask is exact for every real token) or on rows packed end to end
(`PackedSeqParams`, qkv_format "thd": each row attends causally within itself, rlstack/workers/
packing.py), no dropout, no attention bias, vanilla softmax, no sliding window, no context parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch import Tensor

from megatron_bridge.shared_prefix import shared_prefix_of


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, gqa: bool, mask: Tensor | None = None) -> Tensor:
    """F.scaled_dot_product_attention; bf16 / fp16 on CPU multiplied in fp32 and cast back (autograd
    casts the gradients the same way). torch's CPU flash kernel accumulates in fp32 either way, but its
    bf16 forward + backward is slower than fp32's with the casts (one SmolLM2 row of 141 tokens, 9 query
    and 3 key/value heads, AMD EPYC with AVX-512 bf16, one thread: 2.54 ms in bf16, 2.07 ms upcast,
    1.96 ms in fp32). GPUs keep their bf16 kernels."""
    dtype = q.dtype
    if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        out = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), mask, dropout_p=0.0, is_causal=causal, scale=scale, enable_gqa=gqa
        )
        return out.to(dtype)
    return F.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.0, is_causal=causal, scale=scale, enable_gqa=gqa)


def sdpa_core_attention(query: Tensor, key: Tensor, value: Tensor, scale: float, causal: bool) -> Tensor:
    """Attention of megatron-layout tensors; GQA when key/value have fewer heads than query.

    query [sq, b, nq, d], key/value [sk, b, nkv, d] (nq a multiple of nkv) -> [sq, b, nq * d].
    """
    sq, b, nq, d = query.shape
    # [s, b, n, d] -> [b, n, s, d]: strided views, SDPA's CPU flash kernel and the GPU kernels take them
    q, k, v = (_own_storage(t).permute(1, 2, 0, 3) for t in (query, key, value))
    out = _sdpa(q, k, v, causal, scale, k.size(1) != nq)
    # [b, nq, sq, d] -> [sq, b, nq * d]
    return out.permute(2, 0, 1, 3).reshape(sq, b, nq * d)


def sdpa_packed_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """Attention of rows packed end to end (THD): each row attends causally to itself only.

    query [t, nq, d], key/value [t, nkv, d] (megatron squeezes the batch dim for "thd"),
    cu_seqlens [rows + 1] row boundaries -> [t, nq * d]. One SDPA call per row: a block-diagonal
    mask over the whole pack would cost (t / row length) times the work. Rows sharing a prompt
    (cu_seqlens carries a `SharedPrefix`, megatron_bridge/shared_prefix.py): a suffix segment's
    queries attend to the prompt's keys and values in the pack and causally to their own.
    """
    q, k, v = (_own_storage(x) for x in (query, key, value))
    bounds = cu_seqlens.tolist()
    assert bounds[0] == 0 and bounds[-1] == q.size(0), f"bug: packed rows {bounds} do not cover the pack's {q.size(0)}"
    shared = shared_prefix_of(cu_seqlens)
    out = []
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        qi = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [s, n, d] -> [1, n, s, d]
        plen = shared.prefix_len[i] if shared is not None else 0
        if plen:  # keys and values: the prompt's, then the segment's own
            start = shared.prefix_start[i]
            ki, vi = (torch.cat([x[start : start + plen], x[lo:hi]]).transpose(0, 1).unsqueeze(0) for x in (k, v))
            o = _sdpa(qi, ki, vi, False, scale, ki.size(1) != qi.size(1), shared.mask(plen, hi - lo, q.device))
        else:
            ki, vi = (x[lo:hi].transpose(0, 1).unsqueeze(0) for x in (k, v))
            o = _sdpa(qi, ki, vi, hi - lo > 1, scale, ki.size(1) != qi.size(1))
        out.append(o[0].transpose(0, 1).reshape(hi - lo, -1))  # [s, nq * d]
    return torch.cat(out, dim=0)


def _own_storage(t: Tensor) -> Tensor:
    """`t`, or a compact copy of it when it is a view into a larger tensor.

    megatron splits the fused qkv output into q, k and v views (transformer/attention.py
    `get_query_key_value_tensors`); RoPE makes q and k new tensors, but v stays a view, and SDPA
    keeping v for backward keeps the whole [s, b, (nq + 2 nkv) d] qkv output alive, pre-RoPE q and
    k included, until the layer's backward (SmolLM2: 960 elements a token and layer kept for
    v's 192). A copy of v costs its size once and frees the rest. Without autograd nothing is kept,
    and nothing is copied.
    """
    if t.requires_grad and torch.is_grad_enabled() and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.contiguous() if not t.is_contiguous() else t.clone()
    return t


class SDPADotProductAttention(MegatronModule):
    """megatron DotProductAttention's interface over `F.scaled_dot_product_attention`."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        assert dropout == 0.0, f"SDPA core attention: rlstack trains without attention dropout, got {dropout}"
        assert config.context_parallel_size == 1, "SDPA core attention: no context parallelism"
        assert config.softmax_type == "vanilla", f"SDPA core attention: softmax_type {config.softmax_type}"
        assert config.window_size is None, "SDPA core attention: no sliding-window attention"
        assert attention_type == "self", f"SDPA core attention: self attention only, got {attention_type}"
        assert attn_mask_type in (AttnMaskType.causal, AttnMaskType.no_mask), attn_mask_type
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        tp = pg_collection.tp.size()
        # As DotProductAttention: heads and query groups split over TP (the caller raises
        # num_query_groups to the TP size when K/V heads are replicated).
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        head_dim = divide(projection_size, config.num_attention_heads)
        # DotProductAttention divides the scale by layer_number under apply_query_key_layer_scaling
        # and multiplies the scores by it again inside the softmax: the product is this scale.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        assert attention_bias is None, "SDPA core attention: attention bias is not supported"
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        assert attention_mask is None, "SDPA core attention: only the implicit causal mask (pass None)"
        assert query.size(-2) == self.num_attention_heads_per_partition, (
            query.shape,
            self.num_attention_heads_per_partition,
        )
        assert key.size(-2) == self.num_query_groups_per_partition, (key.shape, self.num_query_groups_per_partition)
        if packed_seq_params is not None:
            p = packed_seq_params
            assert p.qkv_format == "thd", f"SDPA core attention: packed format {p.qkv_format!r}, only 'thd'"
            assert p.cu_seqlens_q_padded is None and p.cu_seqlens_kv_padded is None, "no padded THD rows"
            assert torch.equal(p.cu_seqlens_q, p.cu_seqlens_kv), "SDPA core attention: packed self attention only"
            assert mask_type == AttnMaskType.causal, f"SDPA core attention: packed rows need a causal mask, {mask_type}"
            return sdpa_packed_attention(query, key, value, p.cu_seqlens_q, self.softmax_scale)
        return sdpa_core_attention(query, key, value, self.softmax_scale, _is_causal(mask_type, query, key))


def _is_causal(mask_type, query: Tensor, key: Tensor) -> bool:
    """SDPA's `is_causal` for megatron's mask type, as FusedScaleMaskSoftmax.forward_torch_softmax reads it.

    megatron builds the causal mask only when sq > 1 (and then requires sq == sk); with one query
    (a KV-cache decode step) it attends to every key, as `no_mask` does. SDPA's causal mask is
    aligned top-left, so it must not be asked for when sq != sk.
    """
    if mask_type == AttnMaskType.no_mask or query.size(0) == 1:
        return False
    assert mask_type == AttnMaskType.causal, f"SDPA core attention: mask type {mask_type}"
    assert query.size(0) == key.size(0), "SDPA core attention: causal mask is for self attention (sq == sk)"
    return True
