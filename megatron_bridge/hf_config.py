"""The one reader of HF `config.json` files (torch-free): parse, check, say what to fix.

Every caller that needs a model's shape (the bridge's builders, the trainer's layout checks, the
memory planner) reads it here, so a corrupt or incomplete file is one line naming the file and
the missing key, never a `KeyError` traceback deep in a builder.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.errors import InputError

CONFIG_NAME = "config.json"
# Keys every supported decoder needs; the rest have defaults (see ModelArgs).
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def read_hf_config(hf_dir: str) -> dict:
    """The parsed, checked config.json of `hf_dir`; InputError naming the file and the fix otherwise."""
    path = os.path.join(hf_dir, CONFIG_NAME)
    if not os.path.isfile(path):
        raise InputError(f"{hf_dir} has no {CONFIG_NAME}: pass an HF checkpoint directory saved with save_pretrained")
    return read_config_file(path)


def read_config_file(path: str) -> dict:
    """A config.json file, parsed and checked (required keys, positive sizes)."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise InputError(f"model config {path} not found: pass the model's config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(
            f"model config {path} is not valid JSON ({e}): re-save the model or restore the file"
        ) from None
    if not isinstance(config, dict):
        raise InputError(f"model config {path} must hold a JSON object: re-save the model")
    return config


def check_hf_config(config: dict, source: str) -> None:
    missing = [k for k in REQUIRED_KEYS if config.get(k) is None]
    if missing:
        raise InputError(
            f"model config {source} lacks {', '.join(repr(k) for k in missing)}: it is incomplete; "
            "re-save the model with save_pretrained"
        )
    for key in REQUIRED_KEYS + ("num_key_value_heads",):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"model config {source} has {key}={value!r}: it must be a positive integer")


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# RoPE scaling types the builders and both rollout engines implement ("default" = none).
SUPPORTED_ROPE_SCALING = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x RoPE scaling, with the checkpoint's own values (Llama 3.1: 8, 1, 4, 8192; 3.2: 32, ...)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class MoeArgs:
    """Routed experts (Qwen3-MoE): softmax over all experts, top-k, renormalised when `norm_topk`."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # each expert's intermediate size (HF moe_intermediate_size)
    norm_topk: bool
    aux_loss_coeff: float  # HF router_aux_loss_coef: weight of the load-balancing loss


@dataclass(frozen=True)
class ModelArgs:
    """What the builders need from an HF config (plain numbers; no transformers import)."""

    arch: str  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: Optional[RopeScaling] = None  # None: plain RoPE
    qk_layernorm: bool = False  # Qwen3: RMSNorm over each q and k head (weights [head_dim])
    moe: Optional[MoeArgs] = None  # Qwen3-MoE: routed experts in every layer; None: dense MLP

    @classmethod
    def from_hf_config(cls, hf: Any, source: str = "config.json") -> ModelArgs:
        """From a transformers config object or its dict (config.json); `source` names it in errors."""
        get = (lambda k, d=None: hf.get(k, d)) if isinstance(hf, dict) else (lambda k, d=None: getattr(hf, k, d))
        archs = get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise InputError(
                f"unsupported architecture {archs or get('model_type')}: rlstack supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama, Qwen2, Qwen3 dense and Qwen3-MoE families)"
            )
        if isinstance(hf, dict):
            check_hf_config(hf, source)
        rope_scaling = _check_rope_scaling(get("rope_scaling"), get("rope_parameters"), source)
        if arch in ("qwen2", "qwen3", "qwen3_moe") and get("use_sliding_window", False):
            raise InputError(
                f"model config {source} has use_sliding_window=true: sliding-window attention is not "
                "supported; set it to false (full attention)"
            )
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        moe = _moe_args(get, source) if arch == "qwen3_moe" else None
        return cls(
            arch=arch,
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            num_layers=get("num_hidden_layers"),
            num_attention_heads=heads,
            num_query_groups=get("num_key_value_heads") or heads,
            ffn_hidden_size=get("intermediate_size"),
            head_dim=get("head_dim") or hidden // heads,
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(get),
            max_position_embeddings=get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(get("attention_bias", False)),
            rope_scaling=rope_scaling,
            qk_layernorm=arch in ("qwen3", "qwen3_moe"),
            moe=moe,
        )

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron's padding: a multiple of divisible_by x TP, so every TP rank holds equal rows."""
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)


def _moe_args(get, source: str) -> MoeArgs:
    """Qwen3-MoE's router and experts; layouts the bridge does not build are refused by key.

    transformers 5 writes the expert count as `num_local_experts` (Qwen3MoeConfig maps `num_experts`
    to it); older files carry `num_experts`.
    """
    experts = get("num_experts") or get("num_local_experts")
    topk = get("num_experts_per_tok")
    ffn = get("moe_intermediate_size")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", topk), ("moe_intermediate_size", ffn)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"model config {source} has {key}={value!r}: a Qwen3-MoE needs a positive integer")
    if topk > experts:
        raise InputError(
            f"model config {source} has num_experts_per_tok={topk} > num_experts={experts}: lower num_experts_per_tok"
        )
    # Every layer routed: megatron's local spec builds one MoE layer kind for all layers here.
    if get("decoder_sparse_step", 1) != 1 or get("mlp_only_layers"):
        raise InputError(
            f"model config {source} has decoder_sparse_step={get('decoder_sparse_step', 1)} / mlp_only_layers="
            f"{get('mlp_only_layers')}: only all-MoE layers are supported; set decoder_sparse_step=1 and "
            "mlp_only_layers=[] (as Qwen3-30B-A3B and Qwen3-235B-A22B have)"
        )
    if get("shared_expert_intermediate_size"):
        raise InputError(f"model config {source} has a shared expert: Qwen3-MoE has none; use a Qwen3-MoE checkpoint")
    coeff = get("router_aux_loss_coef", 0.001)
    if not isinstance(coeff, (int, float)) or isinstance(coeff, bool) or coeff < 0:
        raise InputError(f"model config {source} has router_aux_loss_coef={coeff!r}: it must be a number >= 0")
    return MoeArgs(
        num_experts=experts,
        topk=topk,
        ffn_hidden_size=ffn,
        norm_topk=bool(get("norm_topk_prob", True)),
        aux_loss_coeff=float(coeff),
    )


def _rope_theta(get) -> float:
    params = get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(get("rope_theta", 10000.0))


def _check_rope_scaling(scaling: Optional[dict], params: Optional[dict], source: str) -> Optional[RopeScaling]:
    """The checkpoint's RoPE scaling (`rope_scaling`, or transformers 5's `rope_parameters`), checked.

    None for plain RoPE; a RopeScaling for `llama3`; InputError listing the supported types otherwise.
    """
    spec: dict = {}
    for s in (scaling, params):  # rope_parameters (newer) wins over the legacy rope_scaling
        if isinstance(s, dict):
            spec = {**spec, **s}
    kind = spec.get("rope_type") or spec.get("type") or "default"
    if kind not in SUPPORTED_ROPE_SCALING:
        raise InputError(
            f"model config {source}: rope scaling {kind!r} is not supported: supported types are "
            f"{', '.join(SUPPORTED_ROPE_SCALING)} (use a checkpoint with one of them)"
        )
    if kind == "default":
        return None
    missing = [k for k in LLAMA3_ROPE_KEYS if spec.get(k) is None]
    if missing:
        raise InputError(
            f"model config {source}: llama3 rope scaling lacks {', '.join(missing)}: add them to its "
            "rope_scaling (Llama 3.1 uses factor 8, low_freq_factor 1, high_freq_factor 4, "
            "original_max_position_embeddings 8192)"
        )
    values = {k: spec[k] for k in LLAMA3_ROPE_KEYS}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values.values()):
        raise InputError(f"model config {source}: llama3 rope scaling values {values} must be positive numbers")
    if values["high_freq_factor"] <= values["low_freq_factor"]:
        raise InputError(
            f"model config {source}: llama3 rope scaling needs high_freq_factor > low_freq_factor, got {values}"
        )
    return RopeScaling(
        factor=float(values["factor"]),
        low_freq_factor=float(values["low_freq_factor"]),
        high_freq_factor=float(values["high_freq_factor"]),
        original_max_position_embeddings=int(values["original_max_position_embeddings"]),
    )
