"""The word embedding's gradient added straight into megatron DDP's fp32 grad buffer (`main_grad`).

megatron's `VocabParallelEmbedding` looks tokens up with `F.embedding`, whose backward builds a dense
[vocab, hidden] gradient (zeros, then the looked-up rows added), which DDP's hook then adds into
`main_grad`: two passes over the whole table per micro-batch for the few hundred rows a batch uses
(SmolLM2: 113 MB zeroed and 113 MB read and added, twice a step at 2 micro-batches; on the VMs of
docs/benchmarks.md the zeroed table was often fresh memory, ~40 ms of page faults each).
`EmbeddingGradIntoMainGrad` (a `with` block around a training forward/backward, as the fused LM head's
`_DeferredLMHead`) makes the lookup an autograd Function whose backward sums each used row's
gradients with `F.embedding`'s own backward kernel over the used rows and adds them to those rows of
`main_grad`:
the same fp32 numbers, and in bf16 (megatron's bf16 weights, an fp32 buffer) the same bf16 row sums
(tests/unit/test_embedding_grad.py compares bit for bit; in bf16 the dense table was 56 MB of bf16
zeros plus its fp32 add, ~0.3-0.6 s of a SmolLM2 step on these VMs). The weight's `.grad`
stays None, as the fused LM head leaves it: megatron reduces the grads after backward here
(`overlap_grad_reduce=False`), so no bucket waits for the embedding's hook.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class LookupIntoMainGrad(torch.autograd.Function):
    """F.embedding(ids, weight) forward; backward adds the rows' gradient into `main_grad` [V, h]."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.main_grad = main_grad
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        flat = ids.reshape(-1)
        g = grad.reshape(flat.numel(), -1)
        used, slot = torch.unique(flat, return_inverse=True)  # [U] rows this batch looked up, [N] -> [U]
        # F.embedding's own dense backward over the used rows only (ids relabelled 0..U-1 in the same
        # order): each row's sum exactly as there, in the gradient's dtype (bf16 included)
        rows = torch.ops.aten.embedding_dense_backward(g, slot, used.numel(), -1, False)  # [U, h]
        ctx.main_grad.index_add_(0, used, rows.to(ctx.main_grad.dtype))  # main_grad[u] + rows[u], as DDP's add_
        return None, None, None


def applies(embedding: torch.nn.Module) -> Optional[torch.Tensor]:
    """The embedding weight's `main_grad` when the direct path applies: fp32 or bf16 weight, an fp32 buffer
    of the weight's shape, megatron's plain lookup (not its deterministic-mode indexing, no sequence
    parallelism); else None (megatron's own forward runs)."""
    weight = getattr(embedding, "weight", None)
    grad = getattr(weight, "main_grad", None)
    if weight is None or grad is None or not weight.requires_grad:
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16) or grad.dtype != torch.float32 or grad.shape != weight.shape:
        return None
    if getattr(embedding, "deterministic_mode", False) or getattr(embedding, "reduce_scatter_embeddings", False):
        return None
    return grad


class EmbeddingGradIntoMainGrad:
    """Within `with`: megatron's `VocabParallelEmbedding` (`embedding`) looks up through
    `LookupIntoMainGrad` (its forward otherwise megatron 0.16.1's, TP masking included)."""

    def __init__(self, embedding: torch.nn.Module):
        self.embedding = embedding
        self.main_grad: Optional[torch.Tensor] = None

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        e = self.embedding
        masked_input, input_mask = input_, None
        if e.tp_group.size() > 1:
            input_mask = (input_ < e.vocab_start_index) | (input_ >= e.vocab_end_index)
            masked_input = input_.clone() - e.vocab_start_index
            masked_input[input_mask] = 0
        output_parallel = LookupIntoMainGrad.apply(masked_input, e.weight, self.main_grad)
        if input_mask is not None:
            output_parallel[input_mask, :] = 0.0
        return reduce_from_tensor_model_parallel_region(output_parallel, group=e.tp_group)

    def __enter__(self):
        self.main_grad = applies(self.embedding)
        if self.main_grad is not None:
            self.embedding.forward = self.forward  # an instance attribute: nn.Module.__call__ finds it first
        return self

    def __exit__(self, *exc):
        if self.main_grad is not None:
            del self.embedding.forward  # the class's VocabParallelEmbedding.forward again
            self.main_grad = None
        return False
