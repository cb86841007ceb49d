"""PackedRows (rlstack/workers/packing.py): the rows' kept tokens end to end, megatron's THD
boundaries, and the way back to [b, S] rows (zeros past each row's length, gradients only to the
kept tokens); packed attention equals attention row by row, in value and gradient."""

import torch

from rlstack.workers.packing import PackedRows


def test_pack_and_unpack_round_trip():
    tokens = torch.arange(4 * 10).view(4, 10)  # [b, S]
    lengths = torch.tensor([3, 10, 0, 5])  # a row that needs nothing keeps one token
    p = PackedRows.of(lengths, 10, "cpu")
    kept = [0, 1, 2] + list(range(10, 20)) + [20] + [30, 31, 32, 33, 34]
    assert p.tokens == len(kept) == 19
    assert p.pack(tokens).tolist() == [kept]  # [1, T]
    assert p.params.qkv_format == "thd"
    assert p.params.cu_seqlens_q.tolist() == p.params.cu_seqlens_kv.tolist() == [0, 3, 13, 14, 19]
    assert p.params.max_seqlen_q == p.params.max_seqlen_kv == 10
    y = torch.randn(1, 19, 2, requires_grad=True)
    out = p.unpack(y)  # [4, 10, 2]
    assert out.shape == (4, 10, 2)
    flat = out.reshape(-1, 2)
    torch.testing.assert_close(flat[torch.tensor(kept)], y[0], rtol=0, atol=0)
    mask = torch.ones(40, dtype=torch.bool)
    mask[torch.tensor(kept)] = False
    assert (flat[mask] == 0).all()
    (out * torch.arange(80.0).view(4, 10, 2)).sum().backward()
    torch.testing.assert_close(y.grad[0], torch.arange(80.0).view(40, 2)[torch.tensor(kept)], rtol=0, atol=0)


def test_packed_attention_equals_rows():
    from megatron_bridge.sdpa_attention import sdpa_core_attention, sdpa_packed_attention

    gen = torch.Generator().manual_seed(0)
    lengths, heads, groups, dim = [5, 1, 9, 3], 6, 2, 8
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    q, k, v = (torch.randn(18, n, dim, generator=gen) for n in (heads, groups, groups))
    out = sdpa_packed_attention(q, k, v, cu, 0.3)  # [t, heads * dim]
    for lo, n in zip(cu[:-1].tolist(), lengths):
        rows = slice(lo, lo + n)  # one row alone, as [s, b=1, n, d]
        ref = sdpa_core_attention(q[rows, None], k[rows, None], v[rows, None], 0.3, causal=n > 1)[:, 0]
        torch.testing.assert_close(out[rows], ref, rtol=0, atol=1e-6)


def test_packed_attention_gradients_equal_rows():
    """The CPU row-by-row kernel's backward gives SDPA's gradients (with GQA and a one-token row)."""
    from megatron_bridge.sdpa_attention import sdpa_packed_attention

    gen = torch.Generator().manual_seed(1)
    lengths, cu = [4, 1, 7], torch.tensor([0, 4, 5, 12], dtype=torch.int32)
    leaves = [torch.randn(12, n, 8, generator=gen, requires_grad=True) for n in (6, 2, 2)]
    upstream = torch.randn(12, 48, generator=gen)
    (sdpa_packed_attention(*leaves, cu, 0.3) * upstream).sum().backward()
    refs = [x.detach().clone().requires_grad_(True) for x in leaves]
    for lo, n in zip(cu[:-1].tolist(), lengths):
        q, k, v = (x[lo : lo + n].transpose(0, 1)[None] for x in refs)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=n > 1, scale=0.3, enable_gqa=True)
        (o[0].transpose(0, 1).reshape(n, -1) * upstream[lo : lo + n]).sum().backward()
    for x, ref in zip(leaves, refs):
        torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=1e-6)
