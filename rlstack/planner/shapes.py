"""The model's shape from its config.json alone (no weights), as `megatron_bridge.hf_config.ModelArgs`.

`model.path: default` uses the embedded SmolLM2-135M-Instruct's config.json (the numbers in
docs/bridge.md), `tiny` the config's `model.tiny` shape, anything
else `<model.path>/config.json`, or what `--model-config` names: a config.json file, or a hub-style
model name whose config.json ships in rlstack/planner/model_configs/ (`Qwen/Qwen2-7B-Instruct`), so a
GPU config can be checked and planned on any machine. There is no silent fallback: a missing
config.json is a user error that names both fixes.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron_bridge.hf_config import read_config_file
from rlstack.errors import UserError
from rlstack.planner.memory import Shape

# config.json of SmolLM2-135M-Instruct (the embedded default), the fields ModelArgs reads.
SMOLLM2_135M_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
}


def tiny_hf_config(tiny) -> dict:
    """The config.json `megatron_bridge.tiny` writes for a `model.tiny` section (300-token vocabulary)."""
    from megatron_bridge.tiny import TOKENIZER_VOCAB, TinySpec

    archs = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    arch = {**archs, "qwen3_moe": "Qwen3MoeForCausalLM"}[tiny.arch]
    extra = {}
    if tiny.arch in ("qwen3", "qwen3_moe"):  # as tiny.py
        extra["head_dim"] = getattr(tiny, "head_dim", None) or tiny.hidden_size // tiny.num_attention_heads
    if tiny.arch == "qwen3_moe":  # tiny.py's defaults for unset MoE fields
        extra["num_experts"] = getattr(tiny, "num_experts", None) or 4
        extra["num_experts_per_tok"] = getattr(tiny, "num_experts_per_tok", None) or 2
        extra["moe_intermediate_size"] = getattr(tiny, "moe_intermediate_size", None) or tiny.intermediate_size // 2
    return {
        **extra,
        "architectures": [arch],
        "hidden_size": tiny.hidden_size,
        "intermediate_size": tiny.intermediate_size,
        "num_hidden_layers": tiny.num_layers,
        "num_attention_heads": tiny.num_attention_heads,
        "num_key_value_heads": tiny.num_key_value_heads,
        "vocab_size": TOKENIZER_VOCAB,
        "tie_word_embeddings": tiny.tie_word_embeddings,
        "max_position_embeddings": TinySpec.max_position_embeddings,
    }


SHIPPED_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs")


def shipped_model_names() -> list[str]:
    """The hub-style names whose config.json ships with rlstack (`qwen2-7b-instruct`, ...)."""
    return sorted(name[: -len(".json")] for name in os.listdir(SHIPPED_CONFIGS) if name.endswith(".json"))


def resolve_model_config(name_or_file: str) -> str:
    """`--model-config`: a config.json file as given, else a hub-style name (`Qwen/Qwen2-7B-Instruct`,
    case-insensitive, organisation optional) whose config ships in rlstack/planner/model_configs/."""
    path = os.path.expanduser(name_or_file)
    if os.path.isfile(path):
        return path
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return os.path.join(path, "config.json")
    shipped = os.path.join(SHIPPED_CONFIGS, name_or_file.rstrip("/").rsplit("/", 1)[-1].lower() + ".json")
    if not name_or_file.endswith(".json") and os.path.isfile(shipped):
        return shipped
    raise UserError(
        f"--model-config {name_or_file}: no such file, and no shipped config of that name: pass a model's "
        f"config.json or one of {', '.join(shipped_model_names())} (rlstack/planner/model_configs/)"
    )


def hf_config_for(model_cfg, model_config_file: Optional[str] = None) -> tuple[dict, str]:
    """(config.json as a dict, where it came from) for the configured model (or `--model-config`'s)."""
    if model_config_file:
        path = resolve_model_config(model_config_file)
        return read_config_file(path), path
    if model_cfg.path == "tiny":
        return tiny_hf_config(model_cfg.tiny), "model.tiny"
    if model_cfg.path == "default":
        from megatron_bridge.default_model import default_model_dir

        cached = os.path.join(default_model_dir(model_cfg.cache_dir), "config.json")
        if os.path.isfile(cached):
            return read_config_file(cached), cached
        return dict(SMOLLM2_135M_CONFIG), "embedded SmolLM2-135M-Instruct config"
    path = os.path.join(_local_dir(model_cfg.path), "config.json")
    if not os.path.isfile(path):
        raise UserError(
            f"model.path={model_cfg.path}: no config.json there; set model.path=<HF directory> "
            f"or pass --model-config FILE|NAME (a config.json, or one of {', '.join(shipped_model_names())})"
        )
    return read_config_file(path), path


def model_config_present(model_cfg) -> bool:
    """`default` and `tiny` always have a shape; an HF directory needs its config.json."""
    return model_cfg.path in ("default", "tiny") or os.path.isfile(
        os.path.join(_local_dir(model_cfg.path), "config.json")
    )


def _local_dir(path: str) -> str:
    """A hub id cached locally -> its snapshot (megatron_bridge.hub_cache); anything else as is
    (preflight's check_model_dir reports a hub id that is not cached)."""
    from megatron_bridge import hub_cache
    from megatron_bridge.errors import InputError

    if hub_cache.looks_like_hub_id(path):
        try:
            return hub_cache.resolve_hub_id(path)
        except InputError:
            return path
    return path


def model_args(hf: dict, source: str):
    """ModelArgs from a config.json dict (InputError naming `source` when it is incomplete or unsupported)."""
    from megatron_bridge.hf_config import ModelArgs

    return ModelArgs.from_hf_config(hf, source)


def shape_of(args, tp: int, ep: int = 1) -> Shape:
    moe = getattr(args, "moe", None)
    return Shape(
        num_experts=moe.num_experts if moe else 0,
        expert_ffn_hidden_size=moe.ffn_hidden_size if moe else 0,
        moe_topk=moe.topk if moe else 0,
        ep=ep,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        padded_vocab_size=args.padded_vocab_size(tp),  # as the bridge pads it
        tie_word_embeddings=args.tie_word_embeddings,
        qkv_bias=args.qkv_bias,
    )
