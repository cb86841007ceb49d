"""Log-probs and entropy from vocabulary-parallel logits, ignoring Megatron's vocab padding.

Megatron pads the vocabulary to a multiple of 128 x TP; the padded columns are not tokens, so they
are left out of the softmax (they would otherwise add mass to the partition function).

Memory: the logits of one micro-batch are [tokens, V/tp] (49k columns for SmolLM2, 152k for Qwen).
A plain autograd graph of log-softmax + entropy keeps several fp32 copies of that shape (upcast,
shifted, exp, exp x shifted) and its backward as many again. `_VocabParallelLogprob` instead walks
the rows in chunks holding two fp32 [chunk, V/tp] temporaries, saves only the logits it was given
(already alive as the model's output) plus three fp32 numbers per row (max, log Z, entropy), and
recomputes the softmax in backward. docs/benchmarks.md ("where the memory goes") has the figures.

TP > 1: the row max, sum of exp, the target's logit and sum p x s are all-reduced over the TP
group in forward. Backward needs no communication: as with megatron's
`reduce_from_tensor_model_parallel_region`, the gradient of an all-reduced sum is the identity on
each rank, so each rank's logits slice gets its own rows' softmax gradient from its own upstream
gradients.
"""

from __future__ import annotations

import torch

CHUNK_ELEMS = 4 * 2**20  # fp32 elements of one [chunk, V/tp] temporary (16 MiB)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    tp_group,
    tp_rank: int,
    tp_size: int,
    with_entropy: bool = False,
    temperature: float = 1.0,
    chunk_elems: int = CHUNK_ELEMS,
):
    """logits [B, S, V/tp] (this rank's vocab slice, any float dtype), targets [B, S] -> logprob [B, S]
    (+ entropy [B, S]), both fp32.

    logprob[b, t] = log p(targets[b, t]) under softmax(logits[b, t] / temperature); entropy of the
    same distribution. Gradients flow to `logits` (their dtype).
    """
    assert temperature > 0, "temperature must be positive (config checks it)"
    shard = logits.shape[-1]
    start = tp_rank * shard
    real = max(0, min(shard, vocab_size - start))  # real (unpadded) columns in this shard
    chunk = max(1, chunk_elems // max(real, 1))
    reduce = _Reducer(tp_group, tp_size)
    lead = logits.shape[:-1]
    logprob, entropy = _VocabParallelLogprob.apply(
        logits.reshape(-1, shard),  # a view: megatron's output is contiguous
        targets.reshape(-1),
        start,
        real,
        float(temperature),
        chunk,
        with_entropy,
        reduce,
    )
    if not with_entropy:
        return logprob.view(lead)
    return logprob.view(lead), entropy.view(lead)


class _Reducer:
    """The TP group's two forward reductions (a no-op at TP 1)."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def max_(self, x: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(x, "max")

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(x, "sum")

    def _all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        if self.size == 1:
            return x
        from rlstack import collectives

        return collectives.all_reduce_(x, self.group, x.device, op=op)  # x is on the model's device


class _VocabParallelLogprob(torch.autograd.Function):
    """x = logits / T (this rank's columns); logprob = x_t - logsumexp(x); entropy = logZ - sum p x s."""

    @staticmethod
    def forward(ctx, logits, targets, start, real, temperature, chunk, with_entropy, reduce):
        # logits [N, V/tp], targets [N]
        n = logits.shape[0]
        local_t = targets - start
        in_shard = (local_t >= 0) & (local_t < real)  # [N]
        row_max = _row_max(logits, real, temperature)  # [N] fp32; softmax is shift-invariant
        row_max = reduce.max_(row_max)
        # sums[0] = sum exp(s), sums[1] = s at the target (this shard's share), sums[2] = sum exp(s) x s
        sums = torch.zeros(3, n, dtype=torch.float32, device=logits.device)
        picked = logits.gather(-1, local_t.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        sums[1] = torch.where(in_shard, picked.float() / temperature - row_max, 0.0)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            s = _shifted(logits, lo, hi, real, temperature, row_max)  # [c, real] fp32
            exp = s.exp()  # [c, real]
            sums[0, lo:hi] = exp.sum(-1)
            if with_entropy:
                sums[2, lo:hi] = exp.mul_(s).sum(-1)
            del s, exp
        sums = reduce.sum_(sums)
        log_z = sums[0].log()  # [N]
        logprob = sums[1] - log_z
        entropy = log_z - sums[2] / sums[0] if with_entropy else None
        ctx.save_for_backward(logits, local_t, in_shard, row_max, log_z, entropy)
        ctx.meta = (real, temperature, chunk)
        if entropy is None:
            return logprob, torch.zeros_like(logprob)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        # d logprob / d x_j = 1[j = t] - p_j;  d H / d x_j = -p_j (log p_j + H)
        logits, local_t, in_shard, row_max, log_z, entropy = ctx.saved_tensors
        real, temperature, chunk = ctx.meta
        n = logits.shape[0]
        grad = torch.zeros_like(logits)  # [N, V/tp]: padded columns get no gradient
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            g_lp = grad_logprob[lo:hi].unsqueeze(-1)  # [c, 1]
            log_p = _shifted(logits, lo, hi, real, temperature, row_max).sub_(log_z[lo:hi].unsqueeze(-1))
            p = log_p.exp()  # [c, real]
            if entropy is None:
                coef = p.mul_(g_lp)  # [c, real]: p_j g_lp
            else:
                g_h = grad_entropy[lo:hi].unsqueeze(-1)
                coef = log_p.add_(entropy[lo:hi].unsqueeze(-1)).mul_(g_h).add_(g_lp).mul_(p)
            coef.neg_()
            rows = torch.arange(hi - lo, device=logits.device)
            hit = in_shard[lo:hi]
            coef[rows[hit], local_t[lo:hi][hit]] += grad_logprob[lo:hi][hit]
            grad[lo:hi, :real] = coef.div_(temperature)
            del log_p, p, coef
        return grad, None, None, None, None, None, None, None


def _row_max(logits: torch.Tensor, real: int, temperature: float) -> torch.Tensor:
    """[N, V/tp] -> [N] fp32 max over the real columns of logits / T, without an fp32 copy.

    Division by T > 0 is monotonic, so max(x) / T == max(x / T) in floating point too.
    """
    if real == 0:
        return torch.full(logits.shape[:1], float("-inf"), dtype=torch.float32, device=logits.device)
    return logits[:, :real].amax(dim=-1).float() / temperature


def _shifted(logits, lo: int, hi: int, real: int, temperature: float, row_max: torch.Tensor) -> torch.Tensor:
    """Rows [lo, hi) of logits / T - row max, real columns only: the one fp32 copy [c, real]."""
    s = logits[lo:hi, :real].to(torch.float32, copy=True)
    if temperature != 1.0:
        s.div_(temperature)
    return s.sub_(row_max[lo:hi].unsqueeze(-1))


def shift_targets(tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, S] -> targets [B, S]: position t predicts token t+1 (last position predicts pad 0)."""
    return torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)


def align_to_tokens(per_position: torch.Tensor) -> torch.Tensor:
    """[B, S] values computed at position t (about token t+1) -> [B, S] indexed by token t; t=0 gets 0."""
    return torch.cat([torch.zeros_like(per_position[:, :1]), per_position[:, :-1]], dim=1)
