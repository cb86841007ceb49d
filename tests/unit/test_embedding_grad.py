"""The word embedding's gradient added straight into main_grad (rlstack/workers/embedding_grad.py)."""

import pytest
import torch
import torch.nn.functional as F

from rlstack.workers.embedding_grad import EmbeddingGradIntoMainGrad, LookupIntoMainGrad, applies


def _dense_reference(ids, weight, grad_out, main_grad):
    """megatron's path: F.embedding's dense backward, then DDP's main_grad.add_(grad)."""
    w = weight.detach().clone().requires_grad_(True)
    F.embedding(ids, w).backward(grad_out)
    return main_grad.clone().add_(w.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_into_main_grad_is_bit_identical_to_the_dense_backward(dtype):
    """fp32, and bf16 weights with an fp32 buffer (megatron's mixed precision: the rows summed in bf16)."""
    torch.manual_seed(0)
    vocab, hidden = 97, 24
    weight = torch.randn(vocab, hidden).to(dtype).requires_grad_(True)
    ids = torch.randint(0, 20, (3, 41))  # many repeats: each used row sums several gradients
    ids[0, :5] = 96
    grad_out = (torch.randn(3, 41, hidden) * 1e-3).to(dtype)
    main_grad = torch.randn(vocab, hidden)  # the LM head (tied) has already added into it
    expected = _dense_reference(ids, weight, grad_out, main_grad)

    got = main_grad.clone()
    out = LookupIntoMainGrad.apply(ids, weight, got)
    assert torch.equal(out, F.embedding(ids, weight))
    out.backward(grad_out)
    assert weight.grad is None  # nothing for DDP's hook: the buffer holds it
    assert torch.equal(got, expected)


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


class _FakeEmbedding(torch.nn.Module):
    """The attributes of megatron's VocabParallelEmbedding the block reads (TP 1)."""

    def __init__(self, vocab, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden))
        self.weight.main_grad = torch.zeros(vocab, hidden)
        self.tp_group = _Group(1)
        self.deterministic_mode = False
        self.reduce_scatter_embeddings = False

    def forward(self, input_):
        return F.embedding(input_, self.weight)


def test_block_swaps_the_lookup_only_inside_and_only_where_it_applies(monkeypatch):
    import megatron.core.tensor_parallel.mappings as mappings

    monkeypatch.setattr(mappings, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)
    torch.manual_seed(1)
    emb = _FakeEmbedding(50, 8)
    ids = torch.randint(0, 50, (2, 9))
    with EmbeddingGradIntoMainGrad(emb):
        emb(ids).square().sum().backward()
    assert emb.weight.grad is None and emb.weight.main_grad.abs().sum() > 0
    expected = torch.zeros(50, 8).index_add_(0, ids.reshape(-1), 2 * F.embedding(ids, emb.weight).reshape(-1, 8))
    assert torch.equal(emb.weight.main_grad, expected)
    assert "forward" not in emb.__dict__  # megatron's own forward again after the block

    emb.deterministic_mode = True  # megatron indexes weight[ids] there: its own path
    assert applies(emb) is None
    emb.deterministic_mode = False
    emb.weight.requires_grad_(False)  # a frozen embedding (reference, LoRA's base)
    assert applies(emb) is None
    with EmbeddingGradIntoMainGrad(emb):
        assert "forward" not in emb.__dict__
