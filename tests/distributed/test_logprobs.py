"""The chunked, recomputing log-prob/entropy function equals the plain autograd one it replaced.

`reference_logprobs` below is the implementation rlstack used before (full fp32 [tokens, V/tp]
copies, megatron's autograd all-reduce); it stays here only as the oracle. Values and gradients
w.r.t. the logits (of logprob and entropy, with random upstream gradients) must agree within 1e-6,
at TP1 and TP2 (two spawned gloo ranks), with vocab padding (real < shard) and targets both in and
out of each rank's shard, several row chunks, and a temperature.
"""

import pytest
import torch

from tests.dist_utils import run_distributed

VOCAB, PADDED = 50, 64  # 14 padded columns: at TP2 the second shard [32, 64) has 18 real columns
B, S = 3, 7


def reference_logprobs(logits, targets, vocab_size, tp_group, tp_rank, tp_size, with_entropy=False):
    """rlstack's log-probs before the chunked function (the oracle; not product code)."""

    def reduce(x):
        if tp_size == 1:
            return x
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(x, group=tp_group)

    def all_reduce_max(x):
        if tp_size == 1:
            return x
        x = x.clone()
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        return x

    logits = logits.float()
    shard = logits.shape[-1]
    start = tp_rank * shard
    real = max(0, min(shard, vocab_size - start))
    if real < shard:
        pad = torch.zeros(shard, dtype=torch.bool)
        pad[real:] = True
        logits = logits.masked_fill(pad, float("-inf"))
    row_max = all_reduce_max(logits.detach().max(dim=-1).values)
    shifted = logits - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce(exp.sum(dim=-1))
    local_t = targets - start
    in_shard = (local_t >= 0) & (local_t < real)
    picked = shifted.gather(-1, local_t.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce(torch.where(in_shard, picked, torch.zeros_like(picked)))
    log_z = sum_exp.log()
    logprob = picked - log_z
    if not with_entropy:
        return logprob
    p_times_s = torch.where(exp > 0, exp * shifted, torch.zeros_like(exp)).sum(dim=-1)
    return logprob, log_z - reduce(p_times_s) / sum_exp


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(B, S, PADDED, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, VOCAB, (B, S), generator=gen)
    targets[0, :4] = torch.tensor([0, 31, 32, VOCAB - 1])  # shard edges
    g_lp, g_ent = torch.randn(B, S, generator=gen), torch.randn(B, S, generator=gen)
    return logits, targets, g_lp, g_ent


def _both(shard, targets, g_lp, g_ent, group, rank, size, with_entropy, temperature, chunk_elems):
    """(values, grad) of the new and the reference function on this rank's logits shard."""
    from rlstack.workers.logprobs import vocab_parallel_logprobs

    out = {}
    for name in ("new", "ref"):
        x = shard.clone().requires_grad_(True)
        if name == "new":
            res = vocab_parallel_logprobs(
                x, targets, VOCAB, group, rank, size, with_entropy, temperature, chunk_elems=chunk_elems
            )
        else:
            scaled = x.float() / temperature if temperature != 1.0 else x
            res = reference_logprobs(scaled, targets, VOCAB, group, rank, size, with_entropy)
        res = res if with_entropy else (res,)
        loss = (res[0] * g_lp).sum() + ((res[1] * g_ent).sum() if with_entropy else 0.0)
        loss.backward()
        out[name] = ([r.detach() for r in res], x.grad)
    return out


def _max_diffs(out) -> list[float]:
    (new_vals, new_grad), (ref_vals, ref_grad) = out["new"], out["ref"]
    diffs = [float((a - b).abs().max()) for a, b in zip(new_vals, ref_vals)]
    return diffs + [float((new_grad.float() - ref_grad.float()).abs().max())]


CASES = [  # (with_entropy, temperature, chunk_elems): chunks of 1, 3 and all rows
    (True, 1.0, 50),
    (True, 0.7, 150),
    (False, 1.0, 10**9),
    (False, 1.3, 50),
]


@pytest.mark.parametrize("with_entropy,temperature,chunk_elems", CASES)
def test_tp1_equals_reference(with_entropy, temperature, chunk_elems):
    logits, targets, g_lp, g_ent = _inputs()
    out = _both(logits, targets, g_lp, g_ent, None, 0, 1, with_entropy, temperature, chunk_elems)
    assert max(_max_diffs(out)) < 1e-6, _max_diffs(out)
    assert float(out["new"][1][..., VOCAB:].abs().max()) == 0.0  # padded columns get no gradient


def test_bf16_logits_gradient_in_bf16():
    logits, targets, g_lp, g_ent = _inputs(torch.bfloat16)
    out = _both(logits, targets, g_lp, g_ent, None, 0, 1, True, 1.0, 100)
    assert out["new"][1].dtype == torch.bfloat16
    values, grad = _max_diffs(out)[:2], _max_diffs(out)[2]
    assert max(values) < 1e-5 and grad < 1e-2, _max_diffs(out)  # fp32 maths, the gradient rounded to bf16


def _tp2_worker(cases):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logits, targets, g_lp, g_ent = _inputs()
    shard = logits[..., rank * (PADDED // 2) : (rank + 1) * (PADDED // 2)].contiguous()
    # each rank its own upstream gradients: the backward of an all-reduced sum is the identity per rank
    g_lp, g_ent = g_lp * (1 + rank), g_ent * (1 - 2 * rank)
    results = []
    for with_entropy, temperature, chunk_elems in cases:
        out = _both(shard, targets, g_lp, g_ent, dist.group.WORLD, rank, 2, with_entropy, temperature, chunk_elems)
        results.append(_max_diffs(out))
    return results


def _assert_tp2_close(worker) -> None:
    per_rank = run_distributed(worker, 2, CASES, timeout=120)
    for rank, results in enumerate(per_rank):
        for case, diffs in zip(CASES, results):
            assert max(diffs) < 1e-6, (rank, case, diffs)


def test_tp2_equals_reference():
    _assert_tp2_close(_tp2_worker)


def test_matches_log_softmax():
    """Against torch.log_softmax over the real columns (the oracle could share a mistake)."""
    from rlstack.workers.logprobs import vocab_parallel_logprobs

    logits, targets, _, _ = _inputs()
    full_lp, full_ent = vocab_parallel_logprobs(logits, targets, VOCAB, None, 0, 1, with_entropy=True)
    expected = torch.log_softmax(logits[..., :VOCAB], -1)
    assert torch.allclose(full_lp, expected.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-5)
    assert torch.allclose(full_ent, -(expected.exp() * expected).sum(-1), atol=1e-5)


def test_planner_counts_the_same_chunk():
    from rlstack.planner.memory import FUSED_CHUNK_ELEMS as PLANNED_FUSED
    from rlstack.planner.memory import LOGPROB_CHUNK_ELEMS
    from rlstack.workers.logprobs import CHUNK_ELEMS, FUSED_CHUNK_ELEMS

    assert LOGPROB_CHUNK_ELEMS == CHUNK_ELEMS and PLANNED_FUSED == FUSED_CHUNK_ELEMS


# ------------------------------------------------------------------ fused output layer

HIDDEN = 16
# the fused backward's two kernels: rows over the whole vocab shard (GPUs, torch's CPU matmul) and the
# transposed vocab slices of float32 on oneDNN, here 8 vocab rows a slice (several slices a shard,
# targets in each)
KERNELS = ("row_chunks", "vocab_slices")


def _use_kernel(kernel: str) -> None:
    from megatron_bridge.patches import cpu_matmul
    from rlstack.workers import logprobs

    cpu_matmul.set_mode("onednn" if kernel == "vocab_slices" else "torch")
    logprobs._VOCAB_SLICE = 8 if kernel == "vocab_slices" else 4096
    assert cpu_matmul.onednn_available() == (kernel == "vocab_slices")  # torch built with oneDNN


@pytest.fixture(params=KERNELS)
def kernel(request):
    from megatron_bridge.patches import cpu_matmul
    from rlstack.workers import logprobs

    mode, vocab_slice = cpu_matmul.mode(), logprobs._VOCAB_SLICE
    _use_kernel(request.param)
    yield request.param
    cpu_matmul.set_mode(mode)
    logprobs._VOCAB_SLICE = vocab_slice


def _fused_inputs():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, S, HIDDEN, generator=gen) * 0.5
    weight = torch.randn(PADDED, HIDDEN, generator=gen) * 0.5  # [padded V, h]; rows >= VOCAB are padding
    logits, targets, g_lp, g_ent = _inputs()
    return hidden, weight, targets, g_lp, g_ent


def _fused_and_unfused(hidden, weight, targets, g_lp, g_ent, group, rank, size, with_entropy, temperature, chunk):
    """Relative differences of (values, grad hidden, grad weight) between the fused function and the
    unfused one on hidden @ weight.T, and the fused weight gradient."""
    from rlstack.workers.logprobs import fused_output_logprobs, vocab_parallel_logprobs

    out = {}
    for name in ("fused", "unfused"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        args = (targets, VOCAB, group, rank, size, with_entropy, temperature)
        if name == "fused":
            res = fused_output_logprobs(h, w, *args, chunk_elems=chunk)
        else:
            res = vocab_parallel_logprobs(h @ w.t(), *args, chunk_elems=chunk)
        res = res if with_entropy else (res,)
        loss = (res[0] * g_lp).sum() + ((res[1] * g_ent).sum() if with_entropy else 0.0)
        loss.backward()
        out[name] = [r.detach() for r in res] + [h.grad, w.grad]
    # relative to the largest magnitude: the two orders of fp32 rounding differ by a few ulps
    diffs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(out["fused"], out["unfused"])]
    return diffs, out["fused"][-1]


@pytest.mark.parametrize("with_entropy,temperature,chunk_elems", CASES)
def test_fused_output_tp1_equals_unfused(with_entropy, temperature, chunk_elems, kernel):
    hidden, weight, targets, g_lp, g_ent = _fused_inputs()
    diffs, w_grad = _fused_and_unfused(
        hidden, weight, targets, g_lp, g_ent, None, 0, 1, with_entropy, temperature, chunk_elems
    )
    assert max(diffs) < 1e-6, diffs
    assert float(w_grad[VOCAB:].abs().max()) == 0.0  # padded vocab rows get no gradient
    assert float(w_grad[:VOCAB].abs().max()) > 0.1


def _fused_tp2_worker(cases):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hidden, weight, targets, g_lp, g_ent = _fused_inputs()
    shard = weight[rank * (PADDED // 2) : (rank + 1) * (PADDED // 2)].contiguous()
    g_lp, g_ent = g_lp * (1 + rank), g_ent * (1 - 2 * rank)
    results = []
    for case in cases:
        diffs = []
        for kernel in KERNELS:  # each diff the larger of the two kernels'
            _use_kernel(kernel)
            got = _fused_and_unfused(hidden, shard, targets, g_lp, g_ent, dist.group.WORLD, rank, 2, *case)[0]
            diffs = [max(a, b) for a, b in zip(diffs, got)] if diffs else got
        results.append(diffs)
    return results


def test_fused_output_tp2_equals_unfused():
    _assert_tp2_close(_fused_tp2_worker)


def _float64_oracle(hidden, weight, targets, g_lp, g_ent):
    """[logprob, entropy, d/d hidden, d/d weight] of torch.log_softmax over the real vocab at temperature
    0.7, in float64 (the upstream gradients g_lp, g_ent)."""
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    log_p = torch.log_softmax((h64 @ w64.t())[..., :VOCAB] / 0.7, -1)
    lp64, ent64 = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    grads64 = torch.autograd.grad((lp64 * g_lp).sum() + (ent64 * g_ent).sum(), (h64, w64))
    return [lp64, ent64, *grads64]


def test_fused_output_matches_log_softmax_in_float64(kernel):
    """Values and gradients against torch.log_softmax in float64 (relative 1e-6: fp32's own rounding)."""
    from rlstack.workers.logprobs import fused_output_logprobs

    hidden, weight, targets, g_lp, g_ent = _fused_inputs()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fused_output_logprobs(h, w, targets, VOCAB, None, 0, 1, True, 0.7, chunk_elems=100)
    grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w))
    for got, want in zip([lp, ent, *grads], _float64_oracle(hidden, weight, targets, g_lp, g_ent)):
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6


def test_fused_output_with_a_frozen_weight_gives_hidden_its_gradient_only(kernel, monkeypatch):
    """A frozen head (LoRA's base, the reference): hidden's gradient as with a trained weight, none for
    the weight, and no weight-shaped gradient buffer made."""
    from rlstack.workers import logprobs

    hidden, weight, targets, g_lp, g_ent = _fused_inputs()
    grads = {}
    for frozen in (False, True):
        made = []
        real_zeros = torch.zeros

        def zeros(*size, _made=made, **kw):
            _made.append(tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size)
            return real_zeros(*size, **kw)

        monkeypatch.setattr(torch, "zeros", zeros)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(not frozen)
        lp, ent = logprobs.fused_output_logprobs(h, w, targets, VOCAB, None, 0, 1, True, 0.7, chunk_elems=100)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        monkeypatch.setattr(torch, "zeros", real_zeros)
        grads[frozen] = (h.grad, w.grad, tuple(weight.shape) in made)
    assert torch.equal(grads[True][0], grads[False][0])
    assert grads[True][1] is None and grads[False][1] is not None
    assert grads[False][2] and not grads[True][2]  # the [V, h] buffer: only for a trained weight


def test_fused_output_in_bf16_within_bf16_rounding(kernel):
    """bf16 weights and hidden states (CPU: the vocab slices whichever kernel fp32 would take; the row
    chunks on GPUs): values and gradients against float64 within bf16's rounding."""
    from rlstack.workers.logprobs import fused_output_logprobs

    hidden, weight, targets, g_lp, g_ent = _fused_inputs()
    h, w = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    lp, ent = fused_output_logprobs(h, w, targets, VOCAB, None, 0, 1, True, 0.7, chunk_elems=100)
    grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w))
    assert grads[0].dtype == grads[1].dtype == torch.bfloat16
    for got, want in zip([lp, ent, *grads], _float64_oracle(h.detach(), w.detach(), targets, g_lp, g_ent)):
        assert float((got.double() - want).abs().max() / want.abs().max()) < 2e-2


def test_exp_floor_changes_nothing_where_exp_underflows(monkeypatch, kernel):
    """Logits ~100 apart (most exp() underflow; targets far below the row max): raising exp's
    inputs to -87 (a fast path of torch's exp) gives the values and gradients of the plain exp."""
    from rlstack.workers import logprobs

    hidden, weight, targets, g_lp, g_ent = _fused_inputs()
    hidden = hidden * 12.0  # x - max down to ~-115; targets up to ~63 below their row's max

    def run():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = logprobs.fused_output_logprobs(h, w, targets, VOCAB, None, 0, 1, True, 0.7, chunk_elems=100)
        return [lp, ent, *torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w))]

    clamped = run()
    monkeypatch.setattr(logprobs, "_EXP_FLOOR", float("-inf"))
    plain = run()
    for got, want in zip(clamped, plain):
        assert float((got - want).abs().max() / want.abs().max()) < 1e-7


def test_fused_output_adds_weight_gradient_into_main_grad(kernel):
    """With `main_grad` (megatron DDP's grad buffer), backward adds the weight's gradient into it and
    hands autograd none: the buffer gains what `weight.grad` would have been; hidden's gradient and
    the values are unchanged."""
    from rlstack.workers.logprobs import fused_output_logprobs

    hidden, weight, targets, g_lp, g_ent = _fused_inputs()
    already = torch.randn(weight.shape, generator=torch.Generator().manual_seed(9))  # earlier micro-batches
    out = {}
    for into_buffer in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        buf = already.clone() if into_buffer else None
        lp, ent = fused_output_logprobs(h, w, targets, VOCAB, None, 0, 1, True, 0.7, chunk_elems=100, main_grad=buf)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        out[into_buffer] = (lp.detach(), h.grad, w.grad, buf)
    (lp0, h0, w0, _), (lp1, h1, w1, buf) = out[False], out[True]
    assert w1 is None and float(w0.abs().max()) > 0.1
    assert torch.equal(lp0, lp1) and torch.equal(h0, h1)
    torch.testing.assert_close(buf - already, w0, atol=1e-6, rtol=1e-6)
