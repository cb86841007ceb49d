"""GPTModel builders for the actor (LM head), the critic (scalar value head) and the reference.

Single-device model code: parallelism comes from Megatron's parallel layers, configured by the
TransformerConfig; nothing here calls torch.distributed. Llama (2, 3.x with `llama3` RoPE scaling),
Qwen2, Qwen3 dense and Qwen3-MoE families (RMSNorm, SwiGLU or routed experts, RoPE with its theta, GQA, optional QKV bias,
Qwen3's per-head q/k RMSNorm and explicit head_dim, tied or untied embeddings).
"""

from __future__ import annotations

import logging
import math
from typing import Union

import torch
import torch.nn.functional as F

from megatron_bridge.hf_config import SUPPORTED_ARCHITECTURES, ModelArgs  # noqa: F401 (re-exported)

log = logging.getLogger("megatron_bridge")

_SPEC_LOGGED = False

# False: no recompute; True: full; a tuple of megatron's selective recompute modules ("layernorm", ...),
# and rlstack's ACT_RECOMPUTE (megatron_bridge/patches/act_recompute.py)
Recompute = Union[bool, tuple]
ACT_RECOMPUTE = "mlp_act"


def transformer_config(
    args: ModelArgs,
    tp: int,
    pp: int,
    dtype: torch.dtype = torch.float32,
    recompute: Recompute = False,
    init_weights: bool = False,
    ep: int = 1,
):
    """Megatron's TransformerConfig of `args` at TP x PP (x EP). `recompute`: False (none), True
    (full recompute, uniform, one layer per checkpoint) or selective recompute's module names."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        **moe_config(args, ep, tp),
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        # Qwen3: also makes finalize_model_grads sum q/k norm grads over TP (each rank sees its own heads)
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=init_weights,
        gradient_accumulation_fusion=False,
        # SwiGLU through megatron's bias_swiglu_impl (fusions/fused_bias_swiglu.py, bias None with
        # add_bias_linear=False): an autograd Function that saves only fc1's output [.., 2f] and
        # recomputes silu in backward, where the unfused glu keeps silu(gate) [.., f] beside it. Its
        # kernels go through megatron's jit_fuser (torch.compile; inductor builds C++ with gcc on
        # CPU, a few seconds once per process and shape class); fp32 and bf16 equal to the eager glu
        # within rounding (tests/unit/test_sdpa_attention.py).
        bias_activation_fusion=True,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # megatron 0.16's default "full" is deprecated in its own __post_init__ (a warning every
        # build); [] is what it converts "full" to.
        cuda_graph_scope=[],
        **recompute_settings(recompute),
    )


def recompute_settings(recompute: Recompute) -> dict:
    """TransformerConfig's recompute fields for `recompute` (see transformer_config)."""
    if recompute is True:
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    modules = [m for m in recompute or () if m != ACT_RECOMPUTE]  # megatron's own (ACT_RECOMPUTE: build_stage)
    if modules:
        if "layernorm" in modules and torch.cuda.is_available() and _have_transformer_engine():
            log.warning(
                "model.recompute_modules: 'layernorm' rebuilds nothing with Transformer Engine's layer spec "
                "(its norms are fused into the following linear, which keeps their output)"
            )
        return dict(recompute_granularity="selective", recompute_modules=modules)
    return dict(recompute_granularity=None)


def moe_config(args: ModelArgs, ep: int, tp: int = 1) -> dict:
    """TransformerConfig's MoE fields for a Qwen3-MoE (empty for a dense model).

    Routing equals transformers' Qwen3MoeTopKRouter: softmax over all experts, top-k, renormalised
    when norm_topk_prob. Renormalised top-k of a softmax is the softmax of the top-k logits, which
    is megatron's default order (moe_utils.topk_routing_with_score_function, use_pre_softmax=False);
    without renormalisation megatron takes softmax first (moe_router_pre_softmax=True). The router
    logits are computed in the parameters' dtype and the softmax in fp32, as transformers does
    (moe_router_dtype stays None: in 0.16.1 its fp32 gating path needs Transformer Engine,
    moe_utils.router_gating_linear reads an undefined te_general_gemm without it). No token dropping (capacity None), no
    shared expert. The load-balancing loss is megatron's switch-style `aux_loss` with the HF
    checkpoint's router_aux_loss_coef, times TP: without sequence parallelism every TP rank routes
    the same tokens, and megatron's aux loss (router.py `_apply_aux_loss`) sums the expert token
    counts and the token total over the TP group but not the probabilities, so each rank's loss is
    1/TP of the batch's, and the replicated router's gradient is not summed over TP (its
    `sequence_parallel` attribute is off). Scaling the coefficient by TP gives every rank the
    gradient of the full loss (one SGD step at TP2 equals one rank's: tests/distributed/
    test_models_moe.py); the tracker's sum over TP then reports the unscaled loss.
    """
    moe = args.moe
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_pre_softmax=not moe.norm_topk,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe.aux_loss_coeff * tp,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
    )


def layer_spec(qk_layernorm: bool = False, num_experts: int | None = None):
    """TE spec on a GPU with Transformer Engine, else megatron's local (pure torch) spec.

    `qk_layernorm` (Qwen3) puts an RMSNorm of hidden size head_dim on q and k, applied per head
    before RoPE as transformers' Qwen3Attention does (megatron transformer/attention.py
    `SelfAttention.get_query_key_value_tensors`).
    """
    global _SPEC_LOGGED
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    use_te = torch.cuda.is_available() and _have_transformer_engine()
    if not _SPEC_LOGGED:
        log.info("megatron layer spec: %s", "transformer-engine" if use_te else "local (torch)")
        _SPEC_LOGGED = True
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_layernorm)
    # MoE: SequentialMLP of local experts (mlp.experts.local_experts.{i}.linear_fc1/fc2), router mlp.router
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=qk_layernorm
    )
    # The local spec's DotProductAttention materialises [b, heads, s, s] scores and an fp32 softmax per
    # layer (kept for backward); SDPA keeps neither (sdpa_attention.py). It is also the GPU path when
    # Transformer Engine is missing: flash / memory-efficient attention there.
    from megatron_bridge.sdpa_attention import SDPADotProductAttention

    spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    return spec


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_gpt(
    args: ModelArgs, config, pre_process: bool, post_process: bool, padded_vocab: int, value_head: bool = False
):
    """One pipeline stage of a GPTModel; `value_head` swaps the LM head for a scalar head."""
    from megatron.core.models.gpt import GPTModel

    tie = args.tie_word_embeddings and not value_head
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args.qk_layernorm, args.moe.num_experts if args.moe else None),
        vocab_size=padded_vocab,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=tie,
        position_embedding_type="rope",
        rotary_base=int(args.rope_theta),
    )
    if args.rope_scaling is not None:
        set_rope_inv_freq_(model, args)
    if value_head and post_process:
        model.output_layer = ValueHead(args.hidden_size, config.params_dtype)
    if config.bf16 or config.fp16:
        # Megatron's mixed-precision path casts the whole module (Float16Module in
        # transformer/module.py: `module.bfloat16()`): the local spec's torch RMSNorm is built in fp32
        # whatever params_dtype says (transformer/torch_norm.py), TE's norms follow params_dtype.
        # The optimizer then keeps fp32 main params and grads (Float16OptimizerWithFloat16Params or
        # the distributed optimizer). Inputs are integer tokens and callers upcast outputs
        # (`.float()` in the log-prob and value code), so the wrapper's casts are not needed.
        model.to(config.params_dtype)
    mark_tensor_parallel_(model)
    if args.moe is not None:
        mark_experts_(model)
        if config.tensor_model_parallel_size > 1:
            allow_moe_tp_without_sp_(model, config.tensor_model_parallel_size)
    return model


class _NoTensorParallel:
    def size(self) -> int:
        return 1


def allow_moe_tp_without_sp_(model, tp: int) -> None:
    """Train a MoE at TP > 1 without sequence parallelism.

    megatron-core 0.16.1's MoELayer.forward (transformer/moe/moe_layer.py:379) raises in training when
    TP > 1 and sequence_parallel is off ("performance may degrade"): a performance guard, not a
    correctness one. rlstack keeps sequence parallelism off (its value head and log-prob code take
    whole sequences); the all-to-all dispatcher then gathers each TP rank's (identical) tokens over
    the TP x EP group and reduce-scatters the TP-split expert outputs back, which is exact (logits at
    TP2 equal transformers'). `attn_tp_group` is read only by that guard, so the layer gets a
    stand-in of size 1 for it. The experts, though, see each token once per TP rank, so their weight
    gradients come out TP times too large (measured: exactly 2x at TP2); a gradient hook divides
    them by TP before megatron's DDP accumulates them, and one training step at TP2 then equals one
    rank's (tests/distributed/test_models_moe.py).
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            module.attn_tp_group = _NoTensorParallel()
            for p in module.experts.parameters():
                p.register_hook(lambda grad: grad / tp)


def mark_experts_(model) -> None:
    """Expert weights are `allreduce=False` at every EP, as megatron marks them only at EP > 1.

    megatron's experts set `allreduce = not expert_parallel` (transformer/moe/experts.py), and DDP and
    get_megatron_optimizer split parameters on it: expert ones reduce over the expert data-parallel
    group and get their own optimizer, so at EP > 1 the optimizer is a ChainedOptimizer (dense,
    experts) whose dist-checkpoint keys are `chained_0.*` / `chained_1.*`, while at EP1 it would be
    a single optimizer with plain keys: a checkpoint saved at EP2 could not resume at EP1. Marking
    them at EP1 too (where the expert data-parallel group *is* the data-parallel group, so the
    gradients are the same) keeps one optimizer layout for every EP.
    """
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            p.allreduce = False


def rope_inv_freq(args) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2], with `llama3` scaling when the config has it.

    The formula of transformers' `_compute_llama3_parameters` (modeling_rope_utils.py) with the
    checkpoint's factor, low/high frequency factors and original max positions: wavelengths shorter
    than original / high_freq_factor keep their frequency, longer than original / low_freq_factor
    are divided by factor, those between are interpolated.
    """
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]
    rs = args.rope_scaling
    if rs is None:
        return inv_freq
    old_len = rs.original_max_position_embeddings
    low_freq_wavelen = old_len / rs.low_freq_factor
    high_freq_wavelen = old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def set_rope_inv_freq_(model, args) -> None:
    """Replace the rotary module's frequencies with the checkpoint's `llama3` scaling.

    megatron-core 0.16.1's `RotaryEmbedding(rope_scaling=True, rope_scaling_factor=f)`
    (models/common/embeddings/rotary_pos_embedding.py `_apply_scaling`) takes only the factor and
    fixes low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192 (Llama 3.1),
    so any other checkpoint (Llama 3.2's factor 32 with its own values, fine-tunes) would be wrong.
    `inv_freq` is a plain attribute read at each forward (`get_freqs_non_repeated`); `forward` is
    lru-cached per sequence length, so the cache is cleared too. Every pipeline stage has its own.
    """
    rotary = model.rotary_pos_emb
    inv_freq = rope_inv_freq(args).to(rotary.inv_freq.device)
    assert rotary.inv_freq.shape == inv_freq.shape, (rotary.inv_freq.shape, inv_freq.shape)
    rotary.inv_freq = inv_freq
    cache_clear = getattr(type(rotary).forward, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def mark_tensor_parallel_(model) -> None:
    """Give TP-split weights megatron's `tensor_model_parallel` attributes.

    Megatron's layers set them while initialising (tensor_parallel/layers.py
    `_initialize_affine_weight_*`); with `perform_initialization=False` (weights come from the
    bridge) they are missing, and the gradient norm (hence clipping) would count only TP rank 0's
    shards (optimizer/clip_grads.py via `param_is_not_tensor_parallel_duplicate`).
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            params = [module.weight, getattr(module, "bias", None)]  # column bias is split too
            dim = 0
        elif isinstance(module, RowParallelLinear):
            params, dim = [module.weight], 1  # a row-parallel bias is replicated
        else:
            continue
        for p in params:
            if isinstance(p, torch.nn.Parameter) and not getattr(p, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(p, True, dim, 1)


class ValueHead(torch.nn.Module):
    """hidden -> 1 scalar per token, replicated on every TP rank.

    Its input (after the final norm) is the same on every TP rank, so its gradients are too; no
    TP reduction is needed. It answers GPTModel's output-layer call signature.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.weight.sequence_parallel = False

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):  # [S, B, H]
        return F.linear(hidden_states, self.weight), None  # [S, B, 1]


def init_value_head_(head: ValueHead, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = torch.randn(head.weight.shape, generator=gen) / math.sqrt(head.weight.shape[1])
        head.weight.copy_(w.to(head.weight.dtype))


def build_stage(
    args: ModelArgs, groups, dtype: torch.dtype = torch.float32, recompute: Recompute = False, value_head: bool = False
):
    """This rank's pipeline stage of the model at `groups`' TP x PP, weights not loaded."""
    tp, pp, ep = groups.dims.tp, groups.dims.pp, groups.dims.ep
    config = transformer_config(args, tp, pp, dtype=dtype, recompute=recompute, ep=ep)
    model = build_gpt(
        args,
        config,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        padded_vocab=args.padded_vocab_size(tp),
        value_head=value_head,
    )
    if recompute is not True and recompute and ACT_RECOMPUTE in recompute and "mlp" not in recompute:
        from megatron_bridge.patches import act_recompute

        act_recompute.enable(model)
    return model
