"""The byte model (benchmarks/bytes.py) and the roofline against hand counts on a tiny model."""

import copy
import dataclasses

import pytest

from benchmarks import analysis, report
from benchmarks.bytes import (
    Layout,
    activation_elems,
    kv_token_bytes,
    phase_flops,
    roofline,
    step_bytes,
    trained_params,
)
from benchmarks.flops import ModelDims, StepShape, step_flops
from tests.unit.test_bench_report import _results

# hidden 4, 1 layer, 2 heads of dim 2, 1 KV head, ffn 8, vocab 10 (test_bench_report's model):
# matmul params P = 144 (layer) + 40 (LM head) = 184; trained N (tied) = 40 (embedding) + 144 + 2 x 4
# (norms) + 4 (final norm) = 196.
DIMS = ModelDims(hidden=4, layers=1, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=10)
# 2 prompts x 2 samples, 3 prompt + 2 response tokens: 4 sequences, 20 tokens, 8 of them responses.
SHAPE = StepShape(num_prompts=2, samples_per_prompt=2, prompt_len=3, response_len=2)
# 2 DP ranks, 1 sequence a micro-batch (2 micro-batches a rank), 2 rows decoded at once (1 batch a rank), fp32.
LAYOUT = Layout(dp=2, micro_batch_size=1, decode_rows=2, param_bytes=4, distributed_optimizer=True)


def test_per_token_counts():
    assert trained_params(DIMS, tied=True) == 196
    assert trained_params(DIMS, tied=False) == 236  # + the LM head's own 10 x 4
    # qkv out (2 + 2) x 2 = 8, attention out 2 x 2 = 4: 6 x 4 (residual) + 2 x 8 + 2 x 4 + 4 x 8 = 80
    assert activation_elems(DIMS) == 80
    assert activation_elems(DIMS, tp=2) == 80 + 6 * 4  # every TP rank holds the whole residual stream
    assert kv_token_bytes(DIMS, LAYOUT) == 2 * 1 * 1 * 2 * 4  # K and V, 1 layer, 1 KV head of dim 2, fp32


def test_grpo_step_bytes_by_hand():
    b = step_bytes(DIMS, SHAPE, LAYOUT)
    w = 2 * 184 * 4  # one pass of both DP replicas over the matmul weights: 1472 bytes
    act = 80 * 4  # activation bytes per token (fp32): 320
    # prefill: weights once (one batch a rank); 6 prompt tokens' activations and their K, V (16 bytes each)
    assert b["prefill"] == w + 6 * act + 6 * 16 == 3488
    # decode: 2 steps (mean response) x weights; K/V read over (4+5) positions x 4 sequences and written
    # for 8 tokens; 8 tokens' activations; fp32 logits of 10 written and read for sampling
    assert b["decode"] == 2 * w + (4 * 9 + 8) * 16 + 8 * act + 8 * 2 * 10 * 4 == 6848
    # a log-prob forward: weights per micro-batch (2), 20 tokens of activations, 8 scored rows of logits x 2
    forward = 2 * w + 20 * act + 8 * 2 * 40
    assert b["old_logprob"] == b["ref_logprob"] == forward == 9984
    # training: weights twice a micro-batch; the fp32 grad buffer written once, then read + written (3
    # passes of 196 x 4 bytes on each of 2 ranks); activations 3x; logits 6x
    assert b["actor_train"] == 2 * 2 * w + 3 * 2 * 196 * 4 + 3 * 20 * act + 8 * 6 * 40 == 31712
    # Adam over each parameter once (sharded over DP): 28 bytes; both ranks zero their grad buffer: 2 x 4
    assert b["actor_optimizer"] == 196 * (28 + 2 * 4) == 7056
    # ring reduce-scatter (fp32 grads) and all-gather (fp32 params) at DP2: 2 x (2 - 1) x 196 x 4 each
    assert b["actor_grad_collective"] == b["actor_param_collective"] == 1568
    assert b["weight_sync"] == 0  # the engine holds the actor's tensors
    assert b["total"] == 3488 + 6848 + 2 * 9984 + 31712 + 7056 + 2 * 1568
    assert "critic_train" not in b


def test_layout_changes_by_hand():
    # bf16, plain optimizer at DP2, the engine in another layout, no old/ref forward
    layout = Layout(dp=2, micro_batch_size=2, decode_rows=2, param_bytes=2, distributed_optimizer=False)
    shape = StepShape(2, 2, 3, 2, ref_forward=False, old_logprob_forward=False)
    b = step_bytes(DIMS, shape, dataclasses.replace(layout, layouts_agree=False))
    # each replica reads its bf16 parameters and writes the fp32 engine's copy (the hf engine on CPU)
    assert b["weight_sync"] == 2 * 196 * (2 + 4)
    assert b["prefill"] == step_bytes(DIMS, shape, LAYOUT)["prefill"]  # the engine decodes in fp32 all the same
    assert "old_logprob" not in b and "ref_logprob" not in b
    # one micro-batch a rank: weights twice (bf16), grad buffer written once (fp32)
    assert b["actor_train"] == 2 * (2 * 184 * 2) + 1 * 2 * 196 * 4 + 3 * 20 * 80 * 2 + 8 * 6 * 40
    # every DP rank runs Adam on all parameters with an fp32 master copy (30 bytes), then zeroes its grads
    assert b["actor_optimizer"] == 196 * (2 * 30 + 2 * 4)
    assert b["actor_grad_collective"] == 2 * 1568  # all-reduce: reduce-scatter + all-gather of the grads
    assert b["actor_param_collective"] == 0
    assert step_bytes(DIMS, shape, Layout(dp=1))["actor_grad_collective"] == 0  # DP1: nothing to reduce


def test_ppo_adds_the_critic():
    shape = StepShape(2, 1, 3, 2, ref_forward=False, critic=True)
    b = step_bytes(DIMS, shape, LAYOUT)
    critic_p = 144 + 4  # layers + value head: the critic's matmul params
    # 2 sequences over 2 ranks: 1 micro-batch a rank; 10 tokens; no logits
    assert b["critic_values"] == 2 * critic_p * 4 + 10 * 80 * 4
    assert b["critic_optimizer"] == (196 + 4) * (28 + 2 * 4)  # embedding, layers, norms, value head


def test_shared_prompts_count_each_prompt_once_by_hand():
    from benchmarks.flops import actor_forward_flops

    shared = dataclasses.replace(SHAPE, shared_prompts=True)
    assert shared.model_tokens == 2 * 3 + 4 * 2 == 14 and SHAPE.model_tokens == SHAPE.train_tokens == 20
    # unshared: 4 rows x (2 x 144 x 5 + attention over 5: 4 x 15 pairs x 2 heads x 2) + the head at 8 responses
    assert actor_forward_flops(DIMS, SHAPE) == 4 * (2 * 144 * 5 + 240) + 8 * 2 * 40 == 7360
    # shared: 14 tokens through the layers; attention: 2 prompts over 3 (6 pairs) and 4 answers' 9 pairs
    assert actor_forward_flops(DIMS, shared) == 2 * 144 * 14 + 8 * 2 * 40 + 2 * 96 + 4 * 144 == 5440
    assert step_flops(DIMS, shared)["actor_train"] == 3 * 5440
    assert phase_flops(DIMS, shared)["prefill"] == phase_flops(DIMS, SHAPE)["prefill"]  # generation unchanged
    b, plain = step_bytes(DIMS, shared, LAYOUT), step_bytes(DIMS, SHAPE, LAYOUT)
    w, act = 2 * 184 * 4, 80 * 4
    assert b["old_logprob"] == 2 * w + 14 * act + 8 * 2 * 40 == 8064 < plain["old_logprob"]
    assert b["actor_train"] == plain["actor_train"] - 3 * 6 * act
    assert b["decode"] == plain["decode"]
    # one sample a prompt: nothing shared
    single = StepShape(2, 1, 3, 2, shared_prompts=True)
    assert single.model_tokens == single.train_tokens


def test_phase_flops_split_generation_and_sum_to_the_flop_model():
    flops = phase_flops(DIMS, SHAPE)
    # prefill: 2 prompts x (2 x 184 x 3 + attention over 3: 96); decode: 4 x (2 x 184 x 2 + 144)
    assert flops["prefill"] == 2400 and flops["decode"] == 3520
    whole = step_flops(DIMS, SHAPE)
    assert flops["prefill"] + flops["decode"] == whole["generation"]
    assert sum(flops.values()) == whole["total"]


def test_roofline_takes_the_larger_floor():
    flops = {"prefill": 100.0, "actor_train": 100.0}
    nbytes = {"prefill": 10.0, "actor_train": 1500.0, "actor_optimizer": 50.0, "weight_sync": 0.0, "total": 1560.0}
    r = roofline(flops, nbytes, train_flops_s=10.0, decode_flops_s=5.0, read_bytes_s=100.0)
    assert r["prefill"] == {
        "flops": 100.0,
        "bytes": 10.0,
        "flop_s": 20.0,  # generation at the decode ceiling
        "byte_s": 0.1,
        "floor_s": 20.0,
        "bound": "compute",
    }
    assert (r["actor_train"]["flop_s"], r["actor_train"]["floor_s"], r["actor_train"]["bound"]) == (
        10.0,
        15.0,
        "memory",
    )
    assert r["actor_optimizer"]["floor_s"] == 0.5 and r["actor_optimizer"]["bound"] == "memory"
    assert r["weight_sync"]["bound"] == "-" and "total" not in r


def _roofline_results() -> dict:
    results = _results()
    results["setup"].update(dp=2, tp=1, pp=1, micro_batch_size=1, decode_rows_per_rank=2, distributed_optimizer=True)
    results["ceilings"]["read_bytes_per_s"] = 500.0  # x 2 workers: 1000 B/s
    results["trainer"]["steps"] = [{**r, "timing/actor_update_s": 2.0} for r in results["trainer"]["steps"]]
    return results


def test_derived_roofline_and_the_measured_times_against_it():
    f = analysis.derive(_roofline_results())
    phases = f["roofline/phases"]
    # rates: decode 500 FLOP/s, training 1000 FLOP/s, read 1000 B/s; bytes of test_grpo_step_bytes_by_hand
    assert phases["prefill"]["floor_s"] == pytest.approx(2400 / 500)  # compute: 4.8 s > 3.488 s
    assert phases["decode"]["floor_s"] == pytest.approx(3520 / 500)  # compute: 7.04 s > 6.848 s
    assert phases["ref_logprob"]["bound"] == "memory"  # 9.984 s of bytes > 7.36 s of FLOPs
    assert phases["actor_train"]["floor_s"] == pytest.approx(31.712)  # memory > 22.08 s
    floor = 4.8 + 7.04 + 2 * 9.984 + 31.712 + 7.056 + 2 * 1.568
    assert f["roofline/seconds"] == pytest.approx(floor)
    assert f["roofline/step_flop_s"] == pytest.approx(f["floor/seconds"])  # the FLOP column is today's floor
    assert f["fraction/step_roofline"]["median"] == pytest.approx(floor / 11)
    assert f["fraction/step_roofline"]["min"] == pytest.approx(floor / 12)
    assert f["roofline/rollout_s"] == pytest.approx(4.8 + 7.04)
    assert f["fraction/rollout_roofline"]["median"] == pytest.approx((4.8 + 7.04) / 4.0)
    # the update outside the actor's training (3 - 2 s) against the two log-prob forwards
    assert f["fraction/update_forwards_roofline"]["median"] == pytest.approx(2 * 9.984 / 1.0)
    assert f["roofline/actor_update_s"] == pytest.approx(31.712 + 7.056 + 2 * 1.568)
    assert f["roofline/update_s"] == pytest.approx(floor - 4.8 - 7.04)
    assert "fraction/sync_roofline" not in f  # a floor of 0 has no share
    assert f["targets"]["step_roofline_fraction"]["met"] is True
    # the actor-forward micro-bench (20 tok/s over 20 tokens: 1 s a forward) against one forward's floor,
    # 9.984 s of bytes > 7.36 s of FLOPs
    assert f["roofline/actor_fwd_s"] == pytest.approx(9.984)
    assert f["fraction/actor_fwd_roofline"]["median"] == pytest.approx(9.984 / 1.0)
    text = report.render_markdown(_roofline_results(), f)
    assert "| actor_optimizer | 0 FLOP | 7.06 kB | 0 s | 7.06 s | 7.06 s | memory |" in text
    assert "| rollout (prefill + decode) | 4 s | 11.8 s | 11.8 s |" in text
    assert f"roofline floor {report.fmt_num(floor, 's')}" in text


def test_no_read_rate_no_roofline():
    results = copy.deepcopy(_roofline_results())
    del results["ceilings"]["read_bytes_per_s"]
    f = analysis.derive(results)
    assert "roofline/seconds" not in f and "fraction/step_roofline" not in f and "floor/seconds" in f
    assert "Roofline not computed" in report.render_markdown(results, f)


def test_layout_from_the_bench_setup():
    setup = {"nproc": 4, "tp": 2, "pp": 1, "rollout_tp": 1, "dtype": "bfloat16", "micro_batch_size": 8}
    layout = Layout.from_setup({**setup, "decode_rows_per_rank": 16}, {"tied_embeddings": False})
    assert (layout.dp, layout.tp, layout.param_bytes, layout.micro_batch_size, layout.decode_rows) == (2, 2, 2, 8, 16)
    assert not layout.layouts_agree and not layout.tied_embeddings and not layout.distributed_optimizer
    assert layout.engine_param_bytes == 4  # the hf engine on CPU runs fp32
    gpu = Layout.from_setup({"nproc": 1, "dtype": "bfloat16", "device": "cuda"}, {})
    assert gpu.layouts_agree and gpu.engine_param_bytes == 2
    assert not Layout.from_setup({"nproc": 1, "dtype": "float32", "device": "cuda"}, {}).layouts_agree
