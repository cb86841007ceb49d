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
group in forward.

`with_sum_pi_squared` (optimal_token_baseline): sum_v p_v^2 per row as well, from the exp(s) chunks
the softmax already holds (sum exp(s)^2 / (sum exp(s))^2, both sums all-reduced over TP with the
others): no extra [tokens, V/tp] tensor and no extra collective. Forward-only: no gradient. Backward needs no communication: as with megatron's
`reduce_from_tensor_model_parallel_region`, the gradient of an all-reduced sum is the identity on
each rank, so each rank's logits slice gets its own rows' softmax gradient from its own upstream
gradients.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_bridge.patches import cpu_matmul

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
    with_sum_pi_squared: bool = False,
):
    """logits [B, S, V/tp] (this rank's vocab slice, any float dtype), targets [B, S] -> logprob [B, S]
    (+ entropy [B, S]) (+ sum_pi_squared [B, S]), all fp32.

    logprob[b, t] = log p(targets[b, t]) under softmax(logits[b, t] / temperature); entropy of the
    same distribution; sum_pi_squared = sum over the vocabulary of p^2 (no gradient). Gradients flow
    to `logits` (their dtype).
    """
    shard = logits.shape[-1]
    start, real, chunk = _shard_layout(shard, tp_rank, vocab_size, chunk_elems, temperature)
    logprob, entropy, sum_sq = _VocabParallelLogprob.apply(
        logits.reshape(-1, shard),  # a view: megatron's output is contiguous
        targets.reshape(-1),
        start,
        real,
        float(temperature),
        chunk,
        with_entropy,
        _Reducer(tp_group, tp_size),
        with_sum_pi_squared,
    )
    return _shaped(logprob, entropy, sum_sq, logits.shape[:-1], with_entropy, with_sum_pi_squared)


def _shard_layout(shard: int, tp_rank: int, vocab_size: int, chunk_elems: int, temperature: float):
    """(first vocab id of this rank's shard, its real (unpadded) columns, rows per chunk)."""
    assert temperature > 0, "temperature must be positive (config checks it)"
    start = tp_rank * shard
    real = max(0, min(shard, vocab_size - start))
    return start, real, max(1, chunk_elems // max(real, 1))


def _shaped(logprob, entropy, sum_sq, lead, with_entropy: bool, with_sum_sq: bool = False):
    """[N] results back to the input's leading shape: logprob, or the tuple (logprob, entropy if
    asked for, sum_pi_squared if asked for)."""
    out = (logprob,) + ((entropy,) if with_entropy else ()) + ((sum_sq,) if with_sum_sq else ())
    out = tuple(x.view(lead) for x in out)
    return out if len(out) > 1 else out[0]


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
    def forward(ctx, logits, targets, start, real, temperature, chunk, with_entropy, reduce, with_sum_sq=False):
        # logits [N, V/tp], targets [N]
        n = logits.shape[0]
        local_t = targets - start
        in_shard = (local_t >= 0) & (local_t < real)  # [N]
        row_max = _row_max(logits, real, temperature)  # [N] fp32; softmax is shift-invariant
        row_max = reduce.max_(row_max)
        # sums[0] = sum exp(s), sums[1] = s at the target (this shard's share), sums[2] = sum exp(s) x s,
        # sums[3] = sum exp(s)^2 (with_sum_sq)
        sums = torch.zeros(4 if with_sum_sq else 3, n, dtype=torch.float32, device=logits.device)
        picked = logits.gather(-1, local_t.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        sums[1] = torch.where(in_shard, picked.float() / temperature - row_max, 0.0)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            s = _shifted(logits, lo, hi, real, temperature, row_max)  # [c, real] fp32
            exp = s.exp()  # [c, real]
            sums[0, lo:hi] = exp.sum(-1)
            if with_sum_sq:  # before entropy's in-place product; a row reduction, no [c, real] temporary
                sums[3, lo:hi] = torch.linalg.vector_norm(exp, dim=-1).square()
            if with_entropy:
                sums[2, lo:hi] = exp.mul_(s).sum(-1)
            del s, exp
        sums = reduce.sum_(sums)
        log_z = sums[0].log()  # [N]
        logprob = sums[1] - log_z
        entropy = log_z - sums[2] / sums[0] if with_entropy else None
        ctx.save_for_backward(logits, local_t, in_shard, row_max, log_z, entropy)
        ctx.meta = (real, temperature, chunk)
        return _outputs(ctx, logprob, entropy, sums[3] / sums[0].square() if with_sum_sq else None)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, _grad_sum_sq):
        # d logprob / d x_j = 1[j = t] - p_j;  d H / d x_j = -p_j (log p_j + H)
        logits, local_t, in_shard, row_max, log_z, entropy = ctx.saved_tensors
        real, temperature, chunk = ctx.meta
        n = logits.shape[0]
        grad = torch.zeros_like(logits)  # [N, V/tp]: padded columns get no gradient
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            log_p = _shifted(logits, lo, hi, real, temperature, row_max).sub_(log_z[lo:hi].unsqueeze(-1))
            p = log_p.exp()  # [c, real]
            args = (local_t, in_shard, entropy, grad_logprob, grad_entropy, temperature)
            grad[lo:hi, :real] = _logits_grad(log_p, p, lo, hi, *args)
            del log_p, p
        return grad, None, None, None, None, None, None, None, None


def _outputs(ctx, logprob: torch.Tensor, entropy, sum_sq):
    """The autograd functions' three outputs: zeros for what was not asked for; sum_pi_squared
    (a baseline's input, read under no_grad) takes no gradient."""
    sum_sq = torch.zeros_like(logprob) if sum_sq is None else sum_sq
    ctx.mark_non_differentiable(sum_sq)
    return logprob, (entropy if entropy is not None else torch.zeros_like(logprob)), sum_sq


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


# ------------------------------------------------------------------ fused output layer
#
# With `model.fused_output_logprobs` the LM head's matmul moves in here: hidden states [N, h] and the
# output weight [V/tp, h] go in, log-probs (and entropy) come out, and logits exist one chunk of
# rows at a time: in forward for the softmax statistics, in backward recomputed for the gradients
# of the hidden states and the weight. No [N, V/tp] tensor is ever alive (the logits, megatron's
# transposed copy of them, their gradient), at the price of one more chunked matmul in backward.

FUSED_CHUNK_ELEMS = 8 * 2**20  # fp32 elements of one [chunk, V/tp] logits buffer (32 MiB)


def fused_output_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    tp_group,
    tp_rank: int,
    tp_size: int,
    with_entropy: bool = False,
    temperature: float = 1.0,
    chunk_elems: int = FUSED_CHUNK_ELEMS,
    main_grad: Optional[torch.Tensor] = None,
    with_sum_pi_squared: bool = False,
):
    """hidden [B, S, h] (the LM head's input, already in the TP region), weight [V/tp, h] (this rank's
    vocab rows), targets [B, S] -> logprob [B, S] (+ entropy [B, S]) (+ sum_pi_squared [B, S]), fp32:
    the same numbers as `vocab_parallel_logprobs(hidden @ weight.T, ...)`. Gradients flow to `hidden` and `weight`.

    `main_grad` (fp32, weight's shape: megatron DDP's grad buffer of the weight): backward adds the
    weight's gradient into it chunk by chunk and gives autograd none, instead of a new [V/tp, h] fp32
    tensor that the DDP hook adds there (SmolLM2: 113 MB alive at the top of backward, when every
    activation still is).
    """
    start, real, chunk = _shard_layout(weight.shape[0], tp_rank, vocab_size, chunk_elems, temperature)
    logprob, entropy, sum_sq = _FusedOutputLogprob.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        start,
        real,
        float(temperature),
        chunk,
        with_entropy,
        _Reducer(tp_group, tp_size),
        main_grad,
        with_sum_pi_squared,
    )
    return _shaped(logprob, entropy, sum_sq, hidden.shape[:-1], with_entropy, with_sum_pi_squared)


class _FusedOutputLogprob(torch.autograd.Function):
    """x = hidden @ W[:real].T / T per chunk of rows. Each shard shifts by its own row max m; the
    shards' sums are rescaled to the global max M once, after the last chunk (one max and one sum
    all-reduce at TP > 1, as `_VocabParallelLogprob`)."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        start,
        real,
        temperature,
        chunk,
        with_entropy,
        reduce,
        main_grad,
        with_sum_sq=False,
    ):
        n = hidden.shape[0]
        w = weight[:real]  # [real, h] view: the padded vocab rows are not tokens
        local_t = targets - start
        in_shard = (local_t >= 0) & (local_t < real)
        local_t = local_t.clamp(0, max(real - 1, 0))
        # stats[0] = row max m, [1] = sum exp(x - m), [2] = x_target - m (0 off shard), [3] = sum exp(x - m)(x - m),
        # [4] = sum exp(x - m)^2 (with_sum_sq)
        stats = torch.zeros(5 if with_sum_sq else 4, n, dtype=torch.float32, device=hidden.device)
        stats[0] = float("-inf")
        buf, ebuf = _logits_buffer(min(chunk, n), real, hidden, 0), _logits_buffer(min(chunk, n), real, hidden, 1)
        for lo in range(0, n if real else 0, chunk):
            hi = min(n, lo + chunk)
            x = _chunk_logits(hidden[lo:hi], w, buf, temperature)  # [c, real] fp32
            m = x.amax(dim=-1)  # [c]
            x.sub_(m.unsqueeze(-1))
            e = _exp_into(x, ebuf[: hi - lo])
            stats[0, lo:hi] = m
            stats[1, lo:hi] = e.sum(-1)
            stats[2, lo:hi] = torch.where(in_shard[lo:hi], x.gather(-1, local_t[lo:hi].unsqueeze(-1)).squeeze(-1), 0.0)
            if with_sum_sq:  # before entropy's in-place product on e
                stats[4, lo:hi] = torch.linalg.vector_norm(e, dim=-1).square()
            if with_entropy:
                stats[3, lo:hi] = e.mul_(x).sum(-1)
        del buf, ebuf
        row_max = reduce.max_(stats[0].clone())  # M [N]
        scale = torch.where(torch.isfinite(stats[0]), (stats[0] - row_max).exp(), 0.0)  # e^(m - M)
        shift = torch.where(torch.isfinite(stats[0]), stats[0] - row_max, 0.0)  # m - M
        rows = [
            stats[1] * scale,  # sum exp(x - M)
            torch.where(in_shard, stats[2] + shift, 0.0),  # x_target - M
            (stats[3] + shift * stats[1]) * scale,  # sum exp(x - M)(x - M)
        ]
        if with_sum_sq:
            rows.append(stats[4] * scale.square())  # sum exp(x - M)^2
        sums = reduce.sum_(torch.stack(rows))
        log_z = sums[0].log()  # log sum exp(x - M)
        logprob = sums[1] - log_z
        entropy = log_z - sums[2] / sums[0] if with_entropy else None
        ctx.save_for_backward(hidden, weight, local_t, in_shard, row_max, log_z, entropy)
        ctx.meta = (real, temperature, chunk)
        ctx.main_grad = main_grad
        return _outputs(ctx, logprob, entropy, sums[3] / sums[0].square() if with_sum_sq else None)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, _grad_sum_sq):
        # d logprob / d x_j = 1[j = t] - p_j;  d H / d x_j = -p_j (log p_j + H);  x = hidden @ w.T / T
        hidden, weight, local_t, in_shard, row_max, log_z, entropy = ctx.saved_tensors
        real, temperature, chunk = ctx.meta
        w = weight[:real]
        # fp32 accumulation over chunks (a bf16 weight's gradient is rounded once, at the end), into
        # the DDP grad buffer itself when given
        # A frozen head (LoRA's base, the reference): no weight gradient at all (it was a [V, h] fp32 zeros
        # and a matmul per micro-batch, thrown away: SmolLM2 with LoRA, ~0.2 s of page faults each on these VMs)
        grad_weight = ctx.main_grad if ctx.needs_input_grad[1] else None
        if grad_weight is None and ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        into = grad_weight[:real] if grad_weight is not None else None
        args = (hidden, w, local_t, in_shard, row_max, log_z, entropy, grad_logprob, grad_entropy, temperature, into)
        if hidden.device.type == "cpu" and weight.dtype == torch.bfloat16:  # bf16: oneDNN's, or cast up (cpu_matmul)
            grad_hidden = _grad_by_vocab_slices(*args, chunk * max(real, 1), cpu_matmul.linear)
        elif weight.dtype == torch.float32 and cpu_matmul.applies(hidden, weight):
            grad_hidden = _grad_by_vocab_slices(*args, chunk * max(real, 1), cpu_matmul.linear)
        else:
            grad_hidden = _grad_by_row_chunks(*args, chunk)
        grad_w = None if ctx.main_grad is not None or grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_w, None, None, None, None, None, None, None, None, None


def _logits_grad(log_p, p, lo, hi, local_t, in_shard, entropy, grad_logprob, grad_entropy, temperature):
    """d loss / d logits of rows lo:hi [c, real], in place of `log_p` / `p` (both [c, real], scaled logits'
    log-softmax and its exp): -p_j (g_lp + g_H (log p_j + H)) / T, plus g_lp / T at the row's target
    where it lies in this vocab shard."""
    g_lp = grad_logprob[lo:hi].unsqueeze(-1)  # [c, 1]
    if entropy is None:
        coef = p.mul_(g_lp)  # p_j g_lp
    else:
        g_h = grad_entropy[lo:hi].unsqueeze(-1)
        coef = log_p.add_(entropy[lo:hi].unsqueeze(-1)).mul_(g_h).add_(g_lp).mul_(p)
    coef.neg_()
    rows = torch.arange(hi - lo, device=p.device)
    hit = in_shard[lo:hi]
    coef[rows[hit], local_t[lo:hi][hit]] += grad_logprob[lo:hi][hit]
    return coef.div_(temperature)


def _grad_by_row_chunks(
    hidden, w, local_t, in_shard, row_max, log_z, entropy, grad_logprob, grad_entropy, temperature, grad_weight, chunk
):
    """The backward of `_FusedOutputLogprob` in chunks of rows over the whole vocab shard: grad_hidden
    returned, the weight's gradient added into grad_weight ([real, h] fp32; None: a frozen weight). GPUs
    and torch's kernel."""
    n, real = hidden.shape[0], w.shape[0]
    grad_hidden = torch.zeros_like(hidden)
    buf, pbuf = _logits_buffer(min(chunk, n), real, hidden, 0), _logits_buffer(min(chunk, n), real, hidden, 1)
    h_w = hidden if hidden.dtype == w.dtype else hidden.to(w.dtype)
    for lo in range(0, n if real else 0, chunk):
        hi = min(n, lo + chunk)
        log_p = _chunk_logits(hidden[lo:hi], w, buf, temperature)
        log_p.sub_((row_max[lo:hi] + log_z[lo:hi]).unsqueeze(-1))
        p = _exp_into(log_p, pbuf[: hi - lo])  # [c, real]
        coef = _logits_grad(log_p, p, lo, hi, local_t, in_shard, entropy, grad_logprob, grad_entropy, temperature)
        if w.dtype == torch.float32:
            grad_hidden[lo:hi] = cpu_matmul.linear(coef, w.t())
            if grad_weight is not None:
                grad_weight.addmm_(coef.t(), h_w[lo:hi])
        else:
            coef_w = coef.to(w.dtype)
            grad_hidden[lo:hi] = coef_w @ w
            if grad_weight is not None:
                grad_weight += (coef_w.t() @ h_w[lo:hi]).float()
        del log_p, p, coef
    return grad_hidden


# Vocab rows of one slice in `_grad_by_vocab_slices`: its [slice, rows] fp32 block (5.6 MB at 340 rows)
# stays in the last-level cache through the elementwise passes between the matmuls (AMD EPYC, one
# thread, SmolLM2 at 340 rows: the three matmuls 233 / 240 / 215 GFLOP/s at 4096, the whole backward
# 264 ms at 4096 vs 282 at 24576 rows a slice).
_VOCAB_SLICE = 4096


def _grad_by_vocab_slices(
    hidden,
    w,
    local_t,
    in_shard,
    row_max,
    log_z,
    entropy,
    grad_logprob,
    grad_entropy,
    temperature,
    grad_weight,
    elems,
    linear=cpu_matmul.linear,
):
    """`_grad_by_row_chunks` for CPUs (float32 on oneDNN, megatron_bridge/patches/cpu_matmul.py; bf16;
    grad_weight None for a frozen weight):
    the logits transposed, one [vocab slice, rows] block at a time, so that every matmul is one oneDNN
    runs at full rate without a transposed copy of a [rows, vocab] tensor: logits^T = w_s @ h^T, the
    weight's gradient w_s += coef^T @ h (the rows are the contraction: 340 of them instead of a 170-row
    chunk, and no MKL addmm_, which reaches half of oneDNN's rate on AMD CPUs; in bf16 no [V, h]
    product cast to fp32 per chunk), the hidden states' gradient summed over slices (coef @ w_s) in
    fp32. Same maths as the row chunks, summed in another order. `linear(x, w)` = x @ w.T."""
    n, real = hidden.shape[0], w.shape[0]
    low = w.dtype != torch.float32  # bf16: logits and products in bf16, softmax maths and sums in fp32
    h_mm = hidden.to(w.dtype)
    grad_hidden = torch.empty_like(hidden)
    # a block of at most elems / 2: three are alive at once (log_p, p, oneDNN's contiguous coef^T), within
    # the two [chunk, vocab] buffers of the row chunks that the planner counts
    rows = max(1, min(n, elems // 2 // max(1, min(real, _VOCAB_SLICE))))
    vc = max(1, min(real, _VOCAB_SLICE, elems // 2 // rows))
    shift = row_max + log_z  # log_p = x / T - shift
    inv_t = 1.0 / temperature
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        h_blk = h_mm[lo:hi]
        g_lp = grad_logprob[lo:hi] * inv_t
        if entropy is None:  # coef = -p g_lp / T (+ g_lp / T at the target)
            scale, offset = g_lp.neg(), None
        else:  # coef = p ((log_p + H)(-g_H) - g_lp) / T = p (log_p a + b) (+ g_lp / T at the target)
            g_h = grad_entropy[lo:hi] * inv_t
            scale, offset = g_h.neg(), (entropy[lo:hi] * g_h).add_(g_lp).neg_()
        t_blk, hit = local_t[lo:hi], in_shard[lo:hi]
        acc = None
        for v0 in range(0, real, vc):
            v1 = min(real, v0 + vc)
            log_p = linear(w[v0:v1], h_blk)  # [slice, rows]
            log_p = log_p.float() if low else log_p
            if temperature != 1.0:
                log_p.div_(temperature)
            log_p.sub_(shift[lo:hi])
            if offset is None:
                coef = _exp_into(log_p, log_p).mul_(scale)
            else:
                p = torch.clamp(log_p, min=_EXP_FLOOR).exp_()
                coef = log_p.mul_(scale).add_(offset).mul_(p)
                del p
            cols = (hit & (t_blk >= v0) & (t_blk < v1)).nonzero().squeeze(-1)
            coef[t_blk[cols] - v0, cols] += g_lp[cols]
            coef = coef.to(w.dtype) if low else coef
            if grad_weight is not None:
                grad_weight[v0:v1].add_(linear(coef, h_blk.t()))  # [slice, h], into fp32
            part = linear(coef.t(), w[v0:v1].t())  # [rows, h]
            acc = part.float() if acc is None else acc.add_(part)
            del log_p, coef, part
        grad_hidden[lo:hi] = acc if acc is not None else 0.0
    return grad_hidden


# exp(x) of x below this is 0 next to a row's largest term (1 for x - max, >= 1/V for log p); torch's
# vectorised exp takes a slow path for inputs where it underflows (AMD EPYC, AVX-512, one thread, a
# 170 x 49152 chunk of SmolLM2 log-probs: 38 ms, 9 ms with the clamp). exp(-87) = 1.6e-38 is still a
# normal float, so no denormals either.
_EXP_FLOOR = -87.0


def _exp_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """exp(max(x, _EXP_FLOOR)) into out (x unchanged)."""
    return torch.clamp(x, min=_EXP_FLOOR, out=out).exp_()


# CPU: the chunk buffers are kept between calls (two slots, each grown to the largest chunk seen). A fresh
# [chunk, vocab] buffer per call was fresh memory as often as not: on the VMs of docs/benchmarks.md a page
# first touched costs ~30 us (the host backs it anew), SmolLM2's 33 MB buffer 0.1-0.4 s then. GPUs keep
# torch's caching allocator. Safe because no call runs inside another and none returns a view of them.
_SCRATCH: dict[int, torch.Tensor] = {}


def _logits_buffer(rows: int, real: int, like: torch.Tensor, slot: int) -> torch.Tensor:
    """One fp32 [rows, real] buffer that every chunk's logits are written into (no new pages per chunk);
    on CPU the same memory at every call (`_SCRATCH[slot]`)."""
    if like.device.type != "cpu":
        return torch.empty((rows, real), dtype=torch.float32, device=like.device)
    if slot not in _SCRATCH or _SCRATCH[slot].numel() < rows * real:
        _SCRATCH.pop(slot, None)  # the smaller one freed before the larger is made
        _SCRATCH[slot] = torch.empty(rows * real, dtype=torch.float32)
    return _SCRATCH[slot][: rows * real].view(rows, real)


def _chunk_logits(hidden: torch.Tensor, w: torch.Tensor, buf: torch.Tensor, temperature: float) -> torch.Tensor:
    """hidden [c, h] @ w.T [h, real] / T into buf's first c rows, fp32 (the model's dtype for the matmul).

    On oneDNN (fp32 on CPU, megatron_bridge/patches/cpu_matmul.py), whose result is always a new tensor,
    by slices of `_VOCAB_SLICE` vocab rows copied into buf: a whole [c, real] result (33 MB at 170 rows
    of SmolLM2) was fresh memory at most calls, and its page faults cost more than the matmul (AMD EPYC
    VM: 120-310 ms instead of 46 at 170 rows); a [c, 4096] slice is the same small block each time."""
    out = buf[: hidden.shape[0]]
    if w.dtype == torch.bfloat16 and cpu_matmul.upcasts(w):  # bf16 cast up a slice at a time, not all of w
        hidden = hidden.to(w.dtype)
    if cpu_matmul.handles(hidden, w):
        for v0 in range(0, w.shape[0], _VOCAB_SLICE):
            out[:, v0 : v0 + _VOCAB_SLICE] = cpu_matmul.linear(hidden, w[v0 : v0 + _VOCAB_SLICE])
    elif w.dtype == torch.float32 and hidden.dtype == torch.float32:
        torch.mm(hidden, w.t(), out=out)
    else:
        out.copy_(hidden.to(w.dtype) @ w.t())
    if temperature != 1.0:
        out.div_(temperature)
    return out
