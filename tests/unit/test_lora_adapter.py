"""megatron_bridge.lora's pure parts: the adapter term, dropout only in training, and the TP shard
layouts of A and B (fused QKV by whole query groups, SwiGLU fc1 as [gate_r; up_r])."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_bridge.layouts import gate_up_fuse, gate_up_split
from megatron_bridge.lora import LoraAdapter, LoraSpec, shard_a, shard_b, unshard_a, unshard_b


def _adapter(parallel="column", transform="qkv", dropout=0.0, a_shape=(2, 8), b_shape=(6, 2)):
    spec = LoraSpec(rank=2, alpha=4.0, dropout=dropout)
    adapter = LoraAdapter(parallel, transform, a_shape, b_shape, spec, None, torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        adapter.A.copy_(torch.randn(a_shape, generator=gen))
        adapter.B.copy_(torch.randn(b_shape, generator=gen))
    return adapter


def test_delta_is_scaled_b_a_x_and_dropout_only_while_training():
    adapter = _adapter(dropout=0.5)
    x = torch.randn(3, 1, 8)  # [s, b, in]
    expected = 2.0 * (x @ adapter.A.T @ adapter.B.T)  # alpha / rank = 2
    adapter.eval()
    torch.testing.assert_close(adapter.delta(x), expected)
    torch.testing.assert_close(adapter.delta_weight(), 2.0 * adapter.B @ adapter.A)
    adapter.train()
    torch.manual_seed(5)
    got = adapter.delta(x)
    torch.manual_seed(5)
    torch.testing.assert_close(got, 2.0 * (F.dropout(x, 0.5) @ adapter.A.T @ adapter.B.T))
    assert not torch.allclose(got, expected)


def test_column_b_shards_follow_megatrons_fused_layouts():
    tp, r = 2, 2
    qkv = _adapter(transform="qkv", b_shape=(12, r))
    full_b = torch.arange(12 * r, dtype=torch.float32).reshape(12, r)
    shards = [shard_b(full_b, qkv, i, tp) for i in range(tp)]
    assert torch.equal(shards[1], full_b[6:])  # whole query groups per rank: a contiguous chunk
    assert torch.equal(unshard_b(shards, qkv), full_b)
    fc1 = _adapter(transform="gate_up", b_shape=(8, r))
    gate, up = torch.randn(4, r), torch.randn(4, r)
    shards = [shard_b(gate_up_fuse(gate, up), fc1, i, tp) for i in range(tp)]
    assert torch.equal(shards[0], gate_up_fuse(gate[:2], up[:2]))  # [gate_0; up_0]
    assert all(torch.equal(a, b) for a, b in zip(gate_up_split(unshard_b(shards, fc1)), (gate, up)))
    full_a = torch.randn(r, 8)
    assert torch.equal(shard_a(full_a, qkv, 1, tp), full_a)  # replicated


def test_row_a_split_by_input_columns_b_replicated():
    row = _adapter(parallel="row", transform="row", a_shape=(2, 4), b_shape=(8, 2))
    full_a, full_b = torch.randn(2, 8), torch.randn(8, 2)
    shards = [shard_a(full_a, row, i, 2) for i in range(2)]
    assert torch.equal(shards[1], full_a[:, 4:])
    assert torch.equal(unshard_a(shards, row), full_a)
    assert torch.equal(shard_b(full_b, row, 1, 2), full_b)


def test_adapter_up_gradients_equal_autograd_linear():
    """`_AdapterUp` (CPU: B's gradient as (h^T g)^T) against autograd's F.linear, 3-D input as megatron's."""
    from megatron_bridge.lora import _AdapterUp

    gen = torch.Generator().manual_seed(3)
    h0, b0 = torch.randn(7, 2, 8, generator=gen), torch.randn(40, 8, generator=gen)
    g = torch.randn(7, 2, 40, generator=gen)
    out = {}
    for name in ("ours", "autograd"):
        h, b = h0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        y = _AdapterUp.apply(h, b) if name == "ours" else torch.nn.functional.linear(h, b)
        y.backward(g)
        out[name] = (y.detach(), h.grad, b.grad)
    assert torch.equal(out["ours"][0], out["autograd"][0])
    for got, want in zip(out["ours"][1:], out["autograd"][1:]):
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
