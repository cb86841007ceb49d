"""Bytes a PPO/GRPO step must move at least, per phase, and its roofline floor (pure Python: no torch).

The FLOP model (benchmarks/flops.py) gives each phase's arithmetic; this one gives the memory
traffic the same work cannot do without, so a phase's floor is the larger of the two times at the
machine's ceilings (a roofline): matmul FLOP/s, and the memory read rate (ceilings.py `read_rate`:
a sum over a 256 MiB tensor). Every byte read or written counts once at the read rate; a write is
never cheaper than a read (memcpy: 2 x 12.2 GB/s of traffic against 28.4 GB/s of reads on the AMD
EPYC of docs/benchmarks.md), so this stays a floor.

Conventions (docs/benchmarks.md, "Byte floor", has the derivation and SmolLM2's numbers):
- Counts are over all ranks together (as the FLOPs), so the time is bytes / (per-rank read rate x
  ranks). Weights are split over TP x PP and replicated over DP: one pass of every DP replica over
  its weights moves dp x W, W = P x e (P the matmul parameters of flops.py, LM head included: the
  head's weight is streamed even when tied; e = 4 bytes fp32, 2 bf16).
- A forward streams every weight once per micro-batch (a decode step is a forward of one token per
  row); the backward reads them once more (the input gradient) and adds the weight gradients into
  megatron's fp32 grad buffer: the first micro-batch of an optimizer step writes it, every later one
  reads and writes it.
- Activations: every tensor passed between two kernels of a layer (matmuls, attention) is written
  once and read once by each consumer; elementwise work (norms, RoPE, SwiGLU, residual adds) is taken
  as fused into the kernels beside it. Per token and layer, in elements: qkv out (q + 2 kv heads x
  head_dim) 2x, attention out (heads x head_dim) 2x, gate/up out (2 ffn) 2x, and the residual stream
  (hidden) 6x: the layer's input read by QKV and by the attention residual, the mid-layer sum written
  and read by gate/up and by the MLP residual, the output written. With TP each rank holds the full
  hidden stream and a 1/tp share of the rest. The backward moves twice the forward's tensors (each
  read again for a weight gradient, its gradient written and read), as its FLOPs are twice.
- The LM head's logits (fp32, `vocab` per scored position: response positions only, as the FLOP
  model) are such a tensor: forward written and read (2), training backward adds the softmax's read,
  the logits' gradient written and read by the head's two matmuls (4): 6 per trained position.
  Sampling writes and reads each generated token's logits (2).
- The rollout engine holds its weights, KV cache and activations in its own dtype (the hf engine:
  fp32 on CPU, bf16 on GPU), whatever the actor's.
- KV cache in decode: each new token writes its K and V (2 x layers x kv_heads x head_dim x e) and
  reads those of every earlier position of its sequence, counted by the FLOP model's causal pairs;
  a prompt's prefill writes its K and V once per prompt.
- Decode steps: a batch of `decode_rows` rows per DP rank decodes for the mean response length (the
  floor: a real batch runs to its longest row), each step streaming the weights once; the prefill
  streams them once per batch.
- Optimizer (Adam, once per optimizer step, over each parameter once: megatron's distributed
  optimizer shards it over DP; without it every DP rank updates all of them): fp32 param read and
  written (8), fp32 grad read (4), m and v read and written (16): 28 bytes a parameter; in bf16 the
  fp32 master copy takes the param's place and the bf16 weight is written (+2): 30. Then the grad
  buffer zeroed for the next step (4 a parameter, every DP rank).
- DP collectives: a reduce-scatter or all-gather of a B-byte buffer sends and receives (dp-1)/dp of
  it on each rank (a ring), each byte read by its sender and written by its receiver: 2 (dp-1) B
  over the dp ranks. Grads (fp32) are reduce-scattered and the updated params (dtype e)
  all-gathered with the distributed optimizer; without it the grads are all-reduced (both halves).
- Weight sync: 0 where the engine's layout and dtype are the actor's (its tensors are views);
  elsewhere each DP replica reads every parameter once and writes the engine's copy once:
  dp x N x (e + the engine's e).
- N (trained parameters) counts what the optimizer holds: embedding (and an untied LM head), the
  linears, the norms (`trained_params`); the critic's replaces the LM head with a hidden x 1 value head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.flops import (
    ModelDims,
    StepShape,
    _causal_pairs,
    actor_forward_flops,
    decode_flops,
    forward_flops,
    prefill_flops,
)

FP32 = 4
LOGIT_BYTES = FP32  # the log-softmax and sampling run on fp32 logits on both sides
ADAM_BYTES = {4: 28, 2: 30}  # per parameter, by the model's element size (see the module docstring)
GRAD_BYTES = FP32  # megatron's grad buffer is fp32 in both dtypes


@dataclass(frozen=True)
class Layout:
    """Where a step's work runs and in what dtype: what sets the bytes it must move."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch_size: int = 1  # sequences per training / log-prob micro-batch, per DP rank
    decode_rows: int = 1  # sequences the engine decodes at once, per DP rank
    param_bytes: int = FP32  # the model's element size: 4 fp32, 2 bf16
    engine_param_bytes: int = FP32  # the rollout engine's (the hf engine: fp32 on CPU, bf16 on GPU)
    distributed_optimizer: bool = True
    tied_embeddings: bool = True
    layouts_agree: bool = True  # the engine holds the actor's own tensors (same split, same dtype): no sync bytes

    @classmethod
    def from_setup(cls, setup: dict, model: dict) -> Layout:
        """From benchmarks/run.py's setup and model_info (missing keys: one rank, fp32, no sharing)."""
        tp, pp = setup.get("tp", 1), setup.get("pp", 1)
        param_bytes = FP32 if setup.get("dtype", "float32") == "float32" else 2
        engine_bytes = FP32 if setup.get("device", "cpu") == "cpu" else 2  # rlstack/rollout/hf_engine.py
        return cls(
            dp=setup.get("dp", max(1, setup.get("nproc", 1) // (tp * pp))),
            tp=tp,
            pp=pp,
            micro_batch_size=setup.get("micro_batch_size", 1),
            decode_rows=setup.get("decode_rows_per_rank", 1),
            param_bytes=param_bytes,
            engine_param_bytes=engine_bytes,
            distributed_optimizer=setup.get("distributed_optimizer", False),
            tied_embeddings=model.get("tied_embeddings", True),
            layouts_agree=setup.get("rollout_tp", 1) == tp and pp == 1 and engine_bytes == param_bytes,
        )


def trained_params(dims: ModelDims, tied: bool) -> int:
    """N: the embedding (+ an untied LM head), per layer the linears and 2 RMSNorms, the final norm.

    Biases (Qwen2's QKV bias) are left out: < 0.1% of a layer.
    """
    embed = dims.vocab * dims.hidden
    return embed * (1 if tied else 2) + dims.layers * (dims.layer_params + 2 * dims.hidden) + dims.hidden


def critic_params(dims: ModelDims) -> int:
    """The critic: the embedding, the layers and norms, and a hidden x 1 value head (no LM head)."""
    return trained_params(dims, tied=True) + dims.hidden


def weight_bytes(params: int, layout: Layout, elem: int = 0) -> float:
    """One pass of every DP replica over `params` weights of `elem` bytes (default: the model's)."""
    return float(layout.dp * params * (elem or layout.param_bytes))


def activation_elems(dims: ModelDims, tp: int = 1) -> float:
    """Elements a forward writes and reads between a layer's kernels, per token, all layers, all TP ranks."""
    qkv = (dims.heads + 2 * dims.kv_heads) * dims.head_dim
    attn = dims.heads * dims.head_dim
    return float(dims.layers * (6 * dims.hidden * tp + 2 * qkv + 2 * attn + 4 * dims.ffn))


def kv_token_bytes(dims: ModelDims, layout: Layout) -> float:
    """K and V of one position in the rollout engine, all layers (split over TP ranks: the sum is the model's)."""
    return float(2 * dims.layers * dims.kv_heads * dims.head_dim * layout.engine_param_bytes)


def micro_batches(shape: StepShape, layout: Layout) -> int:
    """Micro-batches per DP rank (the sequences split evenly over DP)."""
    return math.ceil(shape.num_sequences / layout.dp / max(layout.micro_batch_size, 1))


def decode_batches(shape: StepShape, layout: Layout) -> int:
    return math.ceil(shape.num_sequences / layout.dp / max(layout.decode_rows, 1))


def prefill_bytes(dims: ModelDims, shape: StepShape, layout: Layout) -> float:
    tokens = shape.num_prompts * shape.prompt_len  # once per prompt, as the FLOP floor
    e = layout.engine_param_bytes
    acts = tokens * activation_elems(dims, layout.tp) * e
    weights = decode_batches(shape, layout) * weight_bytes(dims.matmul_params, layout, e)
    return weights + acts + tokens * kv_token_bytes(dims, layout)


def decode_bytes(dims: ModelDims, shape: StepShape, layout: Layout) -> float:
    steps = decode_batches(shape, layout) * shape.response_len
    tokens = shape.response_tokens
    kv_reads = shape.num_sequences * (_causal_pairs(shape.seq_len) - _causal_pairs(shape.prompt_len))
    kv = (kv_reads + tokens) * kv_token_bytes(dims, layout)  # each token reads its context, writes itself
    e = layout.engine_param_bytes
    acts = tokens * activation_elems(dims, layout.tp) * e
    logits = tokens * 2 * dims.vocab * LOGIT_BYTES
    return steps * weight_bytes(dims.matmul_params, layout, e) + kv + acts + logits


def forward_bytes(dims: ModelDims, shape: StepShape, layout: Layout, params: int, logits: bool) -> float:
    """One forward over every sequence: weights per micro-batch, activations, (log-prob) logits."""
    out = micro_batches(shape, layout) * weight_bytes(params, layout)
    out += shape.model_tokens * activation_elems(dims, layout.tp) * layout.param_bytes
    if logits:
        out += shape.response_tokens * 2 * dims.vocab * LOGIT_BYTES
    return out


def train_bytes(dims: ModelDims, shape: StepShape, layout: Layout, params: int, grads: int, logits: bool) -> float:
    """Forward + backward over every sequence, once per PPO epoch: `params` streamed (twice a
    micro-batch), `grads` trained parameters' fp32 gradients accumulated, activations 3x a forward's."""
    m = micro_batches(shape, layout)
    weights = 2 * m * weight_bytes(params, layout)
    grad_buffer = (2 * m - 1) * layout.dp * grads * GRAD_BYTES
    acts = 3 * shape.model_tokens * activation_elems(dims, layout.tp) * layout.param_bytes
    head = shape.response_tokens * 6 * dims.vocab * LOGIT_BYTES if logits else 0.0
    return shape.ppo_epochs * (weights + grad_buffer + acts + head)


def optimizer_bytes(params: int, layout: Layout, steps: int) -> float:
    """Adam over every parameter once per step (once per DP rank without the distributed optimizer),
    then the grad buffer zeroed on every DP rank."""
    updates = 1 if layout.distributed_optimizer else layout.dp
    return steps * params * (updates * ADAM_BYTES[layout.param_bytes] + layout.dp * GRAD_BYTES)


def grad_collective_bytes(params: int, layout: Layout, steps: int) -> float:
    """Reduce-scatter of the fp32 grads (distributed optimizer), else an all-reduce (twice that)."""
    halves = 1 if layout.distributed_optimizer else 2
    return steps * halves * 2 * (layout.dp - 1) * params * GRAD_BYTES


def param_collective_bytes(params: int, layout: Layout, steps: int) -> float:
    """All-gather of the updated params after a distributed optimizer's step (none without it)."""
    if not layout.distributed_optimizer:
        return 0.0
    return steps * 2 * (layout.dp - 1) * params * layout.param_bytes


def sync_bytes(params: int, layout: Layout) -> float:
    """0 where the engine holds the actor's tensors; else each replica reads its params once and writes
    the engine's copy once (in the engine's dtype)."""
    if layout.layouts_agree:
        return 0.0
    return float(layout.dp * params * (layout.param_bytes + layout.engine_param_bytes))


def step_bytes(dims: ModelDims, shape: StepShape, layout: Layout) -> dict[str, float]:
    """Bytes of each phase of one step over all ranks, and their total ("total")."""
    n = trained_params(dims, layout.tied_embeddings)
    steps = shape.ppo_epochs  # one optimizer step per epoch: the whole batch is one mini-batch
    out = {
        "weight_sync": sync_bytes(n, layout),
        "prefill": prefill_bytes(dims, shape, layout),
        "decode": decode_bytes(dims, shape, layout),
    }
    actor_fwd = forward_bytes(dims, shape, layout, dims.matmul_params, logits=True)
    if shape.old_logprob_forward:
        out["old_logprob"] = actor_fwd
    if shape.ref_forward:
        out["ref_logprob"] = actor_fwd
    if shape.critic:
        out["critic_values"] = forward_bytes(dims, shape, layout, dims.critic_matmul_params, logits=False)
    out["actor_train"] = train_bytes(dims, shape, layout, dims.matmul_params, n, logits=True)
    out["actor_optimizer"] = optimizer_bytes(n, layout, steps)
    out["actor_grad_collective"] = grad_collective_bytes(n, layout, steps)
    out["actor_param_collective"] = param_collective_bytes(n, layout, steps)
    if shape.critic:
        nc = critic_params(dims)
        out["critic_train"] = train_bytes(dims, shape, layout, dims.critic_matmul_params, nc, logits=False)
        out["critic_optimizer"] = optimizer_bytes(nc, layout, steps)
        out["critic_grad_collective"] = grad_collective_bytes(nc, layout, steps)
        out["critic_param_collective"] = param_collective_bytes(nc, layout, steps)
    out["total"] = sum(out.values())
    return out


def phase_flops(dims: ModelDims, shape: StepShape) -> dict[str, float]:
    """The FLOP model's passes by the phases of `step_bytes` (the optimizer, collectives and sync do no
    matmul: 0). Same numbers as flops.step_flops, with generation split into prefill and decode."""
    actor_fwd = actor_forward_flops(dims, shape)
    out = {"prefill": prefill_flops(dims, shape), "decode": decode_flops(dims, shape)}
    if shape.old_logprob_forward:
        out["old_logprob"] = actor_fwd
    if shape.ref_forward:
        out["ref_logprob"] = actor_fwd
    out["actor_train"] = 3.0 * actor_fwd * shape.ppo_epochs
    if shape.critic:
        critic_fwd = forward_flops(dims, shape, dims.critic_matmul_params)
        out["critic_values"] = critic_fwd
        out["critic_train"] = 3.0 * critic_fwd * shape.ppo_epochs
    return out


GENERATION_PHASES = ("prefill", "decode")


def roofline(
    flops: dict[str, float], nbytes: dict[str, float], train_flops_s: float, decode_flops_s: float, read_bytes_s: float
) -> dict[str, dict]:
    """Per phase: FLOPs, bytes, the time of each at its ceiling, the floor (the larger) and what bounds it.

    Rates are the machine's (all ranks): generation's FLOPs at the decode ceiling, every other
    phase's at the training matmul ceiling (as the FLOP floor of analysis.py), bytes at the read rate.
    """
    out = {}
    for phase, b in nbytes.items():
        if phase == "total":
            continue
        f = flops.get(phase, 0.0)
        flop_s = f / (decode_flops_s if phase in GENERATION_PHASES else train_flops_s)
        byte_s = b / read_bytes_s
        out[phase] = {
            "flops": f,
            "bytes": b,
            "flop_s": flop_s,
            "byte_s": byte_s,
            "floor_s": max(flop_s, byte_s),
            "bound": "-" if max(flop_s, byte_s) == 0 else ("compute" if flop_s >= byte_s else "memory"),
        }
    return out
