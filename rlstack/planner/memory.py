"""Pure byte counts: parameters per pipeline stage, training state, activations, log-prob temps, KV cache.

Every function takes plain numbers and returns bytes (or a parameter count). The formulas follow
what rlstack's code paths allocate (megatron local/TE layer specs, megatron DDP with fp32 gradient
buffers, megatron's optimizer over torch Adam, `workers/logprobs.py`'s chunked log-probs); Megatron-LM's
`megatron/training/theoretical_memory_usage.py` (Korthikanti et al. 2022, Table 2) is the reference
for the training side. Shape comments use t = tensor parallel size.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder-only transformer that memory depends on."""

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int  # megatron's padding for this TP (a multiple of 128 x TP)
    tie_word_embeddings: bool
    qkv_bias: bool
    # MoE (Qwen3-MoE): routed experts replace the dense MLP in every layer; 0 experts: dense
    num_experts: int = 0
    expert_ffn_hidden_size: int = 0
    moe_topk: int = 0
    ep: int = 1  # expert parallel size of the layout (each EP rank holds num_experts / ep experts)

    @property
    def active_ffn(self) -> int:
        """The MLP width one token goes through: top-k experts' for a MoE (activations scale with it)."""
        return self.moe_topk * self.expert_ffn_hidden_size if self.num_experts else self.ffn_hidden_size

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.head_dim


# ----------------------------------------------------------------------------- parameters


def layer_params(s: Shape, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank (norms are replicated, the rest split)."""
    qkv = s.hidden_size * (s.q_size + 2 * s.kv_size)  # fused linear_qkv [(q + 2kv)/t, h]
    qkv_bias = (s.q_size + 2 * s.kv_size) if s.qkv_bias else 0  # column-parallel bias: split too
    proj = s.q_size * s.hidden_size  # linear_proj [h, q/t]
    norms = 2 * s.hidden_size
    if s.num_experts:
        # this EP rank's experts, each a SwiGLU split over TP (expert TP = TP), and the router
        # [E, h], replicated on every rank
        experts = (s.num_experts // s.ep) * 3 * s.hidden_size * s.expert_ffn_hidden_size
        return (qkv + qkv_bias + proj + experts) // tp + norms + s.num_experts * s.hidden_size
    mlp = 3 * s.hidden_size * s.ffn_hidden_size  # SwiGLU: fc1 [2f/t, h] + fc2 [h, f/t]
    return (qkv + qkv_bias + proj + mlp) // tp + norms


def stage_params(s: Shape, tp: int, pp: int, stage: int, value_head: bool = False) -> int:
    """Parameters held by pipeline stage `stage` on one TP rank.

    The first stage holds the word embedding, the last the final norm and the output layer: an
    untied LM head, a second copy of a tied embedding when PP > 1 (megatron keeps one on the last
    stage and all-reduces its gradient), or the critic's scalar value head.
    """
    assert s.num_layers % pp == 0, "layers must divide by PP (ParallelDims.check_model)"
    embedding = s.padded_vocab_size * s.hidden_size // tp
    params = layer_params(s, tp) * (s.num_layers // pp)
    if stage == 0:
        params += embedding
    if stage == pp - 1:
        params += s.hidden_size  # final norm
        if value_head:
            params += s.hidden_size
        elif not s.tie_word_embeddings or pp > 1:
            params += embedding
    return params


def stage_expert_params(s: Shape, tp: int, pp: int) -> int:
    """The routed-expert part of `stage_params` (0 for a dense model).

    Its gradients are reduced, and a distributed optimizer shards its state, over the expert
    data-parallel group (dp / ep ranks), not over all of DP (megatron's expert_data_parallel_group).
    """
    if not s.num_experts:
        return 0
    per_layer = (s.num_experts // s.ep) * 3 * s.hidden_size * s.expert_ffn_hidden_size // tp
    return per_layer * (s.num_layers // pp)


def total_params(s: Shape) -> int:
    """The model's parameter count (unpadded vocabulary, tied embedding counted once, every expert)."""
    s = dataclasses.replace(s, ep=1)
    embedding = s.vocab_size * s.hidden_size
    head = 0 if s.tie_word_embeddings else embedding
    return layer_params(s, 1) * s.num_layers + embedding + head + s.hidden_size


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def lora_layer_params(s: Shape, tp: int, rank: int, targets=LORA_TARGETS) -> int:
    """LoRA adapter parameters of one dense layer on one TP rank (megatron_bridge/lora.py):
    column-parallel (qkv, fc1) A [r, in] replicated + B [out/t, r]; row-parallel (proj, fc2)
    A [r, in/t] + B [out, r] replicated."""
    h, f = s.hidden_size, s.ffn_hidden_size
    qkv_out = s.q_size + 2 * s.kv_size
    per_target = {
        "linear_qkv": rank * h + qkv_out * rank // tp,
        "linear_proj": rank * s.q_size // tp + h * rank,
        "linear_fc1": rank * h + 2 * f * rank // tp,  # SwiGLU [gate; up]
        "linear_fc2": rank * f // tp + h * rank,
    }
    return sum(per_target[t] for t in targets)


def lora_merged_params(s: Shape, targets=LORA_TARGETS) -> int:
    """The weights of the adapted linears, whole: what the hf engine holds merged (W + scale B A) with
    rollout.lora_sync=merged (rlstack/rollout/hf_engine.py `_set_merged`)."""
    h, f = s.hidden_size, s.ffn_hidden_size
    per_target = {
        "linear_qkv": h * (s.q_size + 2 * s.kv_size),
        "linear_proj": s.q_size * h,
        "linear_fc1": 2 * f * h,
        "linear_fc2": f * h,
    }
    return sum(per_target[t] for t in targets) * s.num_layers


def stage_lora_params(s: Shape, tp: int, pp: int, rank: int, targets=LORA_TARGETS) -> int:
    """The adapters of one pipeline stage on one TP rank (0 when rank is 0)."""
    if rank <= 0:
        return 0
    return lora_layer_params(s, tp, rank, targets) * (s.num_layers // pp)


# ----------------------------------------------------------------------------- training state


def weight_bytes(params: int, param_bytes: int) -> int:
    return params * param_bytes


def grad_bytes(params: int) -> int:
    """megatron DDP's gradient buffer: fp32 (`grad_reduce_in_fp32=True`), the full stage on every rank.

    The distributed optimizer reduce-scatters inside this buffer; it does not shrink it.
    """
    return params * 4


def optimizer_bytes(params: int, mixed_precision: bool, dp: int, distributed: bool) -> int:
    """Adam's two fp32 moments, plus fp32 main params when the model is bf16/fp16.

    With the distributed optimizer (ZeRO-1) each DP rank keeps 1/dp of this state.
    """
    per_param = 8 + (4 if mixed_precision else 0)
    shard = math.ceil(params / dp) if distributed else params
    return shard * per_param


def adam_step_temp_bytes(params: int, dp: int, distributed: bool) -> int:
    """torch's foreach Adam (megatron's fallback without Apex/TE) allocates sqrt(v): one fp32 copy.

    Fused Adam (Apex or TE, on GPU clusters) needs none; counting it keeps the plan an upper bound.
    """
    return (math.ceil(params / dp) if distributed else params) * 4


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Tokens:
    """One micro-batch: `batch` sequences of `seq_len` tokens (prompt + response, padded)."""

    batch: int
    seq_len: int

    @property
    def count(self) -> int:
        return self.batch * self.seq_len


def layer_activation_bytes(
    s: Shape,
    tp: int,
    mb: Tokens,
    act_bytes: int,
    fused_attention: bool,
    lean_norm: bool = False,
    selective: tuple = (),
) -> int:
    """Tensors one layer saves for backward, for one micro-batch (no sequence parallel).

    Per token: two RMSNorms (input and normalised output kept: 2h each), the qkv and fc1 linear
    inputs are those outputs; q, k, v and the attention context (unfused attention repeats k and v
    to every head for GQA: q_size each); the fused SwiGLU (bias_activation_fusion) keeps fc1's
    output (2f) and the product fed to fc2 (f), recomputing silu in backward. Unfused attention
    (megatron's DotProductAttention) also keeps the fp32 softmax [b, heads/t, s, s] (plus its cast
    to bf16/fp16); fused attention (rlstack's SDPA core attention in the local spec, TE's on a GPU
    with Transformer Engine) keeps only its output and a log-sum-exp per row. torch's RMSNorm also
    keeps its normalised input (h per norm); `lean_norm` (megatron_bridge.patches.cpu_kernels' LeanRMSNorm,
    fp32 on CPU) keeps only the input and rstd.

    `selective` (model.recompute_modules, megatron's selective recompute) drops what each module
    rebuilds in backward: "layernorm" the two norms' outputs and intermediates (their inputs stay,
    as the checkpoint's), "mlp" / "moe" the dense / MoE MLP's tensors (its input stays: the norm's
    output), "mlp_act" (rlstack's) the dense MLP's SwiGLU product, "core_attn" the unfused attention's softmax (fused attention keeps nothing more than
    the checkpoint's inputs q, k, v and the output, which the output projection saves anyway).
    """
    kv = s.kv_size if fused_attention else s.q_size
    norms = 2 * s.hidden_size if "layernorm" in selective else 4 * s.hidden_size
    if not lean_norm and "layernorm" not in selective:
        norms += 2 * s.hidden_size  # the norms' normalised intermediates (torch RMSNorm)
    mlp = 3 * s.active_ffn // tp
    if s.num_experts:  # MoE: each token's top-k copies permuted to its experts and back (2 x k x h)
        mlp += 2 * s.moe_topk * s.hidden_size
    if ("moe" if s.num_experts else "mlp") in selective:
        mlp = 0
    elif "mlp_act" in selective and not s.num_experts:
        mlp -= s.active_ffn // tp  # the SwiGLU product, rebuilt from fc1's output
    per_token = (norms + (2 * s.q_size + 2 * kv) // tp + mlp) * act_bytes
    total = per_token * mb.count
    if not fused_attention and "core_attn" not in selective:
        total += attention_scores_bytes(s, tp, mb, act_bytes)
    return total


def attention_scores_bytes(s: Shape, tp: int, mb: Tokens, act_bytes: int) -> int:
    """Unfused attention's softmax [b, heads/t, s, s]: fp32 (attention_softmax_in_fp32) + a cast copy."""
    elems = mb.batch * (s.num_attention_heads // tp) * mb.seq_len**2
    return elems * (4 + (act_bytes if act_bytes != 4 else 0))


def training_activation_bytes(
    s: Shape,
    tp: int,
    pp: int,
    mb: Tokens,
    act_bytes: int,
    fused_attention: bool,
    recompute: bool,
    in_flight: int,
    lean_norm: bool = False,
    selective: tuple = (),
) -> int:
    """Activations a pipeline stage holds at the peak of backward.

    Without recompute every layer's saved tensors stay until its backward. With megatron's full
    uniform recompute (1 layer per checkpoint) only each layer's input [s, b, h] stays, and one
    layer's tensors are rebuilt at a time; with selective recompute (`selective`) each layer keeps
    the rest, and the recomputed part of one layer is rebuilt at a time. 1F1B keeps `in_flight`
    (min(micro-batches, pp)) micro-batches alive on the first stage. The embedding output and final
    norm add a few [s, b, h].
    """
    layers = s.num_layers // pp
    one_layer = layer_activation_bytes(s, tp, mb, act_bytes, fused_attention, lean_norm)
    hidden = mb.count * s.hidden_size * act_bytes  # one [s, b, h]
    if recompute:
        per_micro_batch = layers * hidden + one_layer
    elif selective:
        kept = layer_activation_bytes(s, tp, mb, act_bytes, fused_attention, lean_norm, selective)
        per_micro_batch = layers * kept + (one_layer - kept)
    else:
        per_micro_batch = layers * one_layer
    return in_flight * (per_micro_batch + 3 * hidden)


def forward_only_bytes(s: Shape, tp: int, mb: Tokens, act_bytes: int, fused_attention: bool) -> int:
    """Scoring forward (no_grad): nothing is saved; one layer's working set is alive at a time."""
    return layer_activation_bytes(s, tp, mb, act_bytes, fused_attention)


def scores_buffer_bytes(s: Shape, tp: int, mb: Tokens, act_bytes: int, fused_attention: bool) -> int:
    """Unfused attention writes q.k^T into megatron's global memory buffer [b*heads/t, s, s], kept for reuse."""
    if fused_attention:
        return 0
    return mb.batch * (s.num_attention_heads // tp) * mb.seq_len**2 * act_bytes


# ----------------------------------------------------------------------------- log-probs


def logits_elems(s: Shape, tp: int, mb: Tokens) -> int:
    """Elements of one micro-batch's vocab-parallel logits [b, s, V/t] (every position, padded vocab)."""
    return mb.count * (s.padded_vocab_size // tp)


# workers/logprobs.py CHUNK_ELEMS (this module stays torch-free; tests/distributed/test_logprobs.py checks they agree)
LOGPROB_CHUNK_ELEMS = 4 * 2**20
LOGPROB_ROW_BYTES = 4 * 8  # per token: max, log Z, entropy, the reduced sums, targets (int64) ...


def logprob_chunk_bytes(s: Shape, tp: int, mb: Tokens) -> int:
    """The two fp32 [chunk, V/t] temporaries of one row chunk (one row at least, the micro-batch at most)."""
    return 2 * 4 * min(logits_elems(s, tp, mb), max(LOGPROB_CHUNK_ELEMS, s.padded_vocab_size // tp))


def logprob_train_bytes(s: Shape, tp: int, mb: Tokens, act_bytes: int, temperature: float) -> int:
    """Peak of `vocab_parallel_logprobs(..., with_entropy=True)` with grad (the actor's update).

    The chunked function saves the logits it is given (act dtype; the model's output, kept for the
    backward) and writes their gradient (same dtype); the softmax lives in two fp32 chunk
    temporaries at a time, forward and backward, whatever the temperature (applied per chunk).
    Measured: docs/benchmarks.md "where the memory goes".
    """
    del temperature  # applied inside each chunk: no full-size copy
    return logits_elems(s, tp, mb) * 2 * act_bytes + logprob_chunk_bytes(s, tp, mb) + mb.count * LOGPROB_ROW_BYTES


def logprob_forward_bytes(s: Shape, tp: int, mb: Tokens, act_bytes: int, temperature: float) -> int:
    """Peak of a forward-only log-prob (reference / old log-probs): the logits and one chunk's temporaries."""
    del temperature
    return logits_elems(s, tp, mb) * act_bytes + logprob_chunk_bytes(s, tp, mb) + mb.count * LOGPROB_ROW_BYTES


# workers/logprobs.py FUSED_CHUNK_ELEMS (checked equal in tests/distributed/test_logprobs.py)
FUSED_CHUNK_ELEMS = 8 * 2**20


def fused_logprob_bytes(s: Shape, tp: int, mb: Tokens, train: bool, head_grad_in_buffer: bool = False) -> int:
    """Peak of `fused_output_logprobs` on one micro-batch (model.fused_output_logprobs).

    Two fp32 [chunk, V/t] buffers that every row chunk's logits are written into, forward and
    backward; with grad, the hidden states' gradient and the LM head's fp32 weight-gradient
    accumulator [V/t, h] (what megatron's output layer would have produced as its weight's `.grad`),
    unless the gradient goes straight into megatron's grad buffer (`head_grad_in_buffer`: fp32
    weights, `MegatronRole.output_main_grad`), counted with the gradients already.
    No logits of the whole micro-batch exist.
    """
    buffers = 2 * 4 * min(logits_elems(s, tp, mb), max(FUSED_CHUNK_ELEMS, s.padded_vocab_size // tp))
    if not train:
        return buffers + mb.count * LOGPROB_ROW_BYTES
    head_grad = 0 if head_grad_in_buffer else 4 * (s.padded_vocab_size // tp) * s.hidden_size
    return buffers + head_grad + mb.count * (LOGPROB_ROW_BYTES + 4 * s.hidden_size)


def value_head_bytes(mb: Tokens) -> int:
    """The critic's values [b, s] and their fp32 loss temporaries: a handful of [b, s] tensors."""
    return mb.count * 4 * 8


# ----------------------------------------------------------------------------- rollout


def kv_bytes_per_token(s: Shape, rollout_tp: int, kv_bytes: int) -> int:
    """K and V of every layer for one token on one rollout rank (vLLM replicates KV heads below TP)."""
    kv_heads = max(1, s.num_query_groups // rollout_tp)
    return 2 * s.num_layers * kv_heads * s.head_dim * kv_bytes


def kv_cache_bytes(s: Shape, rollout_tp: int, kv_bytes: int, num_seqs: int, max_model_len: int) -> int:
    """KV cache for `num_seqs` sequences of `max_model_len` tokens, all resident at once."""
    return kv_bytes_per_token(s, rollout_tp, kv_bytes) * num_seqs * max_model_len


def prefill_bytes(s: Shape, batch: int, prompt_len: int, act_bytes: int) -> int:
    """A transformers prefill (no_grad): one layer's working set, with the [b, heads, s, s] scores."""
    tokens = batch * prompt_len
    per_token = (4 * s.hidden_size + 3 * s.active_ffn + s.q_size + 2 * s.kv_size) * act_bytes
    scores = batch * s.num_attention_heads * prompt_len**2 * 4
    return tokens * per_token + scores


def vllm_profile_bytes(s: Shape, rollout_tp: int, max_num_seqs: int, max_batched_tokens: int, act_bytes: int) -> int:
    """vLLM's own activation peak inside its share: a prefill chunk's MLP and the sampler's fp32 logits."""
    prefill = max_batched_tokens * (2 * s.hidden_size + 3 * s.active_ffn // rollout_tp) * act_bytes
    sampler = max_num_seqs * (s.padded_vocab_size // rollout_tp) * 4 * 2
    return prefill + sampler
