"""Declarative HF <-> Megatron name maps for the Llama, Qwen2, Qwen3 and Qwen3-MoE families.

One declaration per architecture: a tuple of `Rule(hf names, megatron name, transform)` with a
`{layer}` placeholder for per-layer tensors. Both directions (`megatron_to_hf_names`,
`hf_to_megatron_names`) and the expected HF shapes are derived from it; the transforms themselves
(how a Megatron TP shard is cut out of the HF tensors and put back) live in `layouts.py`.

Megatron names here use GLOBAL layer indices; a pipeline stage names its layers from 0, so
`to_global_name` / `to_local_name` translate with the stage's layer offset.

Transforms: `replicate` (norms), `column` (split dim 0 over TP), `row` (split dim 1), `vocab`
(column with vocabulary padding), `qkv` (fuse q, k, v per query group), `gate_up` (fuse SwiGLU gate
and up per TP rank). Tied embeddings are the `tied` condition: the last pipeline stage's own
`output_layer.weight` (present when PP > 1) receives the input embedding, and export takes the
embedding from the first stage only, so HF stores the tied weight once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megatron_bridge.errors import InputError

TRANSFORMS = ("replicate", "column", "row", "vocab", "qkv", "gate_up")
SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe")

_LAYER = "decoder.layers.{layer}."
_HF_LAYER = "model.layers.{layer}."


@dataclass(frozen=True)
class Rule:
    """One layout change. `shapes` are symbolic HF shapes: V vocab, H hidden, F ffn, Q q rows
    (heads x head_dim), KV k/v rows (query groups x head_dim), D head_dim, E experts, M an expert's
    ffn. `{expert}` in the names: one rule per expert (global expert index on both sides)."""

    hf: tuple[str, ...]
    megatron: str
    transform: str
    shapes: tuple[tuple[str, ...], ...]
    megatron_te: Optional[str] = None  # name under the Transformer Engine spec (fused norms)
    when: Optional[str] = None  # tied | untied | qkv_bias: rule applies only then
    export: bool = True  # False: a copy of a tensor exported through another rule


LLAMA = (
    Rule(("model.embed_tokens.weight",), "embedding.word_embeddings.weight", "vocab", (("V", "H"),)),
    Rule(
        (_HF_LAYER + "input_layernorm.weight",),
        _LAYER + "input_layernorm.weight",
        "replicate",
        (("H",),),
        megatron_te=_LAYER + "self_attention.linear_qkv.layer_norm_weight",
    ),
    Rule(
        tuple(_HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
        _LAYER + "self_attention.linear_qkv.weight",
        "qkv",
        (("Q", "H"), ("KV", "H"), ("KV", "H")),
    ),
    Rule((_HF_LAYER + "self_attn.o_proj.weight",), _LAYER + "self_attention.linear_proj.weight", "row", (("H", "Q"),)),
    Rule(
        (_HF_LAYER + "post_attention_layernorm.weight",),
        _LAYER + "pre_mlp_layernorm.weight",
        "replicate",
        (("H",),),
        megatron_te=_LAYER + "mlp.linear_fc1.layer_norm_weight",
    ),
    Rule(
        (_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"),
        _LAYER + "mlp.linear_fc1.weight",
        "gate_up",
        (("F", "H"), ("F", "H")),
    ),
    Rule((_HF_LAYER + "mlp.down_proj.weight",), _LAYER + "mlp.linear_fc2.weight", "row", (("H", "F"),)),
    Rule(("model.norm.weight",), "decoder.final_layernorm.weight", "replicate", (("H",),)),
    Rule(("lm_head.weight",), "output_layer.weight", "vocab", (("V", "H"),), when="untied"),
    Rule(("model.embed_tokens.weight",), "output_layer.weight", "vocab", (("V", "H"),), when="tied", export=False),
)
QKV_BIAS = (
    Rule(
        tuple(_HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
        _LAYER + "self_attention.linear_qkv.bias",
        "qkv",
        (("Q",), ("KV",), ("KV",)),
        when="qkv_bias",
    ),
)
# Qwen3: one RMSNorm weight [head_dim] shared by every q head, one by every k head (transformers'
# Qwen3Attention q_norm / k_norm); megatron's qk_layernorm modules (hidden size = head_dim), the
# same on every TP rank.
QK_NORM = (
    Rule(
        (_HF_LAYER + "self_attn.q_norm.weight",),
        _LAYER + "self_attention.q_layernorm.weight",
        "replicate",
        (("D",),),
        when="qk_layernorm",
    ),
    Rule(
        (_HF_LAYER + "self_attn.k_norm.weight",),
        _LAYER + "self_attention.k_layernorm.weight",
        "replicate",
        (("D",),),
        when="qk_layernorm",
    ),
)
# Qwen3-MoE: the dense MLP replaced by a router (transformers' Qwen3MoeTopKRouter `mlp.gate`,
# [experts, hidden], megatron's TopKRouter `mlp.router`, replicated over TP) and routed experts
# (checkpoint names `mlp.experts.{e}.{gate,up,down}_proj`, as save_pretrained writes them even though
# transformers 5 fuses them in memory; megatron's local-spec SequentialMLP
# `mlp.experts.local_experts.{i}.linear_fc1/fc2`, i local to the EP rank: global e = ep_rank x
# experts/EP + i). Expert TP = attention TP (megatron's default expert_tensor_parallel_size), so each
# expert's fc1/fc2 are split over TP as a dense MLP's are.
_EXPERT = _LAYER + "mlp.experts.local_experts.{expert}."
_HF_EXPERT = _HF_LAYER + "mlp.experts.{expert}."
MOE_MLP = (
    Rule(
        (_HF_LAYER + "post_attention_layernorm.weight",),
        _LAYER + "pre_mlp_layernorm.weight",
        "replicate",
        (("H",),),
    ),
    Rule((_HF_LAYER + "mlp.gate.weight",), _LAYER + "mlp.router.weight", "replicate", (("E", "H"),)),
    Rule(
        (_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"),
        _EXPERT + "linear_fc1.weight",
        "gate_up",
        (("M", "H"), ("M", "H")),
    ),
    Rule((_HF_EXPERT + "down_proj.weight",), _EXPERT + "linear_fc2.weight", "row", (("H", "M"),)),
)
_DENSE_MLP = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
LLAMA_ATTENTION = tuple(r for r in LLAMA if not r.megatron.endswith(_DENSE_MLP))
# Qwen2 is Llama plus QKV bias; Llama checkpoints with attention_bias=True also carry o_proj.bias,
# which no rule consumes, so the loader rejects them by name (Megatron's Llama has no such bias).
# Qwen3 is Llama plus q/k norms (no QKV bias unless attention_bias=True).
DECLARATIONS = {
    "llama": LLAMA + QKV_BIAS,
    "qwen2": LLAMA + QKV_BIAS,
    "qwen3": LLAMA + QKV_BIAS + QK_NORM,
    "qwen3_moe": LLAMA_ATTENTION + QKV_BIAS + QK_NORM + MOE_MLP,
}
# HF keys that carry no weights of their own and may appear in checkpoints.
IGNORED_HF = (re.compile(r".*rotary_emb\.inv_freq$"),)


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter (global layer index) and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    transform: str
    hf_shapes: tuple[tuple[int, ...], ...]
    layer: Optional[int]  # global layer index; None for embedding, final norm, output layer
    export: bool = True
    expert: Optional[int] = None  # global expert index of a routed expert's weight; None otherwise


def declaration(arch: str) -> tuple[Rule, ...]:
    if arch not in DECLARATIONS:
        raise InputError(f"unsupported architecture {arch!r}: the bridge supports {', '.join(SUPPORTED)}")
    return DECLARATIONS[arch]


def _applies(rule: Rule, args) -> bool:
    return {
        None: True,
        "tied": args.tie_word_embeddings,
        "untied": not args.tie_word_embeddings,
        "qkv_bias": args.qkv_bias,
        "qk_layernorm": getattr(args, "qk_layernorm", False),
    }[rule.when]


def _dims(args) -> dict[str, int]:
    moe = getattr(args, "moe", None)
    return {
        "E": moe.num_experts if moe else 0,
        "M": moe.ffn_hidden_size if moe else 0,
        "V": args.vocab_size,
        "H": args.hidden_size,
        "F": args.ffn_hidden_size,
        "Q": args.num_attention_heads * args.head_dim,
        "KV": args.num_query_groups * args.head_dim,
        "D": args.head_dim,
    }


def param_maps(args, te_spec: bool = False) -> list[ParamMap]:
    """Every Megatron parameter of the whole model, in order: embedding, layers 0..L-1, final norm, output."""
    dims = _dims(args)
    rules = [r for r in declaration(args.arch) if _applies(r, args)]
    out = []
    for layer in [None, *range(args.num_layers)]:
        for rule in rules:
            if ("{layer}" in rule.megatron) != (layer is not None):
                continue
            name = rule.megatron_te if te_spec and rule.megatron_te else rule.megatron
            experts = range(dims["E"]) if "{expert}" in rule.megatron else [None]
            for expert in experts:
                out.append(
                    ParamMap(
                        megatron=name.format(layer=layer, expert=expert),
                        hf=tuple(h.format(layer=layer, expert=expert) for h in rule.hf),
                        transform=rule.transform,
                        hf_shapes=tuple(tuple(dims[d] for d in shape) for shape in rule.shapes),
                        layer=layer,
                        export=rule.export,
                        expert=expert,
                    )
                )
    # embedding first, then layers, then the last stage's tensors (final norm, output layer)
    first = [m for m in out if m.megatron.startswith("embedding.")]
    last = [m for m in out if m.layer is None and not m.megatron.startswith("embedding.")]
    return first + [m for m in out if m.layer is not None] + last


def megatron_to_hf_names(args, te_spec: bool = False) -> dict[str, ParamMap]:
    """Megatron name (global layer index) -> its ParamMap (HF names, transform, HF shapes)."""
    return {m.megatron: m for m in param_maps(args, te_spec)}


def hf_to_megatron_names(args, te_spec: bool = False) -> dict[str, list[tuple[ParamMap, int]]]:
    """HF name -> every (ParamMap, position of this HF tensor in ParamMap.hf) that reads it.

    A tied embedding feeds two Megatron parameters (the embedding and, at PP > 1, the last stage's
    output layer), hence a list.
    """
    out: dict[str, list[tuple[ParamMap, int]]] = {}
    for m in param_maps(args, te_spec):
        for i, name in enumerate(m.hf):
            out.setdefault(name, []).append((m, i))
    return out


def is_ignored_hf(name: str) -> bool:
    return any(p.match(name) for p in IGNORED_HF)


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def layer_offset(args, pp_rank: int, pp_size: int) -> int:
    """Global index of a stage's first layer (megatron splits layers evenly over PP stages)."""
    assert args.num_layers % pp_size == 0, "ParallelDims.check_model validates this first"
    return pp_rank * (args.num_layers // pp_size)


_EXPERT_RE = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def to_global_name(local_name: str, offset: int, expert_offset: int = 0) -> str:
    name = _LAYER_RE.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local_name)
    return _EXPERT_RE.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + expert_offset}.", name)


def to_local_name(global_name: str, offset: int, expert_offset: int = 0) -> str:
    name = _LAYER_RE.sub(lambda m: f"decoder.layers.{int(m.group(1)) - offset}.", global_name)
    return _EXPERT_RE.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) - expert_offset}.", name)


def experts_per_rank(args, ep_size: int) -> int:
    """Local experts of each EP rank (megatron: num_moe_experts // expert_model_parallel_size)."""
    moe = getattr(args, "moe", None)
    if moe is None:
        return 0
    assert moe.num_experts % ep_size == 0, "ParallelDims.check_model validates this first"
    return moe.num_experts // ep_size


def expert_offset(args, ep_rank: int, ep_size: int) -> int:
    """Global index of an EP rank's first local expert (MoELayer: ep_rank x num_local_experts)."""
    return ep_rank * experts_per_rank(args, ep_size)


def owner_ep(m: ParamMap, args, ep_size: int) -> Optional[int]:
    """The EP rank holding a routed expert's weight; None for weights every EP rank holds."""
    if m.expert is None:
        return None
    return m.expert // experts_per_rank(args, ep_size)


def owner_stage(m: ParamMap, args, pp_size: int) -> int:
    """The pipeline stage that holds `m` (the canonical copy: the embedding lives on stage 0)."""
    if m.layer is not None:
        return m.layer // (args.num_layers // pp_size)
    return 0 if m.megatron.startswith("embedding.") else pp_size - 1


# ---------------------------------------------------------------- sequence-classification head

# Reward models (and critics exported with `--critic-format seq-cls`) are HF
# `*ForSequenceClassification` checkpoints: the decoder body under the usual `model.*` names, no
# `lm_head`, and `score.weight` [num_labels=1, H] (no bias), which becomes the Megatron scalar head
# (models.ValueHead, the last stage's `output_layer.weight`, replicated over TP).
SEQ_CLS_ARCHITECTURES = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
}
SCORE_HF, SCORE_MEGATRON = "score.weight", "output_layer.weight"


def is_seq_cls_config(config: dict) -> bool:
    """Does config.json describe a `*ForSequenceClassification` checkpoint (of any architecture)?"""
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def num_labels(config: dict) -> int:
    """transformers saves id2label (num_labels is derived from it); older files carry num_labels."""
    if isinstance(config.get("id2label"), dict):
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def seq_cls_body_config(config: dict, source: str) -> dict:
    """The config of a 1-label sequence classifier's decoder body, as its `*ForCausalLM` would read.

    InputError naming the fix for another architecture or label count. The body has no LM head,
    so it is read as tied (no `lm_head.weight` rule); `score.weight` is loaded by `score_head_map`.
    """
    archs = [str(a) for a in config.get("architectures") or []]
    arch = next((a for a in archs if a in SEQ_CLS_ARCHITECTURES), None)
    if arch is None:
        raise InputError(
            f"{source}: architecture {archs or config.get('model_type')} is not a supported reward model: "
            f"use a {' or '.join(SEQ_CLS_ARCHITECTURES)} checkpoint (num_labels=1)"
        )
    labels = num_labels(config)
    if labels != 1:
        raise InputError(
            f"{source}: {arch} has num_labels={labels}, a reward model needs one scalar: "
            "use a checkpoint saved with num_labels=1"
        )
    return dict(config, architectures=[SEQ_CLS_ARCHITECTURES[arch]], tie_word_embeddings=True)


def score_head_map(args) -> ParamMap:
    """`score.weight` [1, H] <-> the scalar head, owned by the last pipeline stage."""
    return ParamMap(SCORE_MEGATRON, (SCORE_HF,), "replicate", ((1, args.hidden_size),), layer=None, export=False)
