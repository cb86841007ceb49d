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
}


@dataclass(frozen=True)
class ModelArgs:
    """What the builders need from an HF config (plain numbers; no transformers import)."""

    arch: str  # llama | qwen2
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

    @classmethod
    def from_hf_config(cls, hf: Any, source: str = "config.json") -> ModelArgs:
        """From a transformers config object or its dict (config.json); `source` names it in errors."""
        get = (lambda k, d=None: hf.get(k, d)) if isinstance(hf, dict) else (lambda k, d=None: getattr(hf, k, d))
        archs = get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise InputError(
                f"unsupported architecture {archs or get('model_type')}: rlstack supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama and Qwen2 families)"
            )
        if isinstance(hf, dict):
            check_hf_config(hf, source)
        _check_rope_scaling(get("rope_scaling"), get("rope_parameters"))
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
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
        )

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron's padding: a multiple of divisible_by x TP, so every TP rank holds equal rows."""
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)


def _rope_theta(get) -> float:
    params = get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(get("rope_theta", 10000.0))


def _check_rope_scaling(scaling: Optional[dict], params: Optional[dict]) -> None:
    kind = None
    for source in (scaling, params):
        if isinstance(source, dict):
            kind = source.get("rope_type") or source.get("type") or kind
    if kind not in (None, "default"):
        raise InputError(f"rope scaling {kind!r} is not supported yet: use a model without rope_scaling")
