"""Megatron-layout LoRA adapters -> PEFT's names and files, and merged HF weights. Pure (no process group).

Input: the adapters in TP1 megatron layout under global names, as `megatron_bridge.lora.adapter_state`
returns them (`decoder.layers.{i}.self_attention.linear_qkv.lora.A` [r, H], `.lora.B` [q + 2kv, r]
fused per query group; `mlp.linear_fc1.lora.B` [2F, r] = [gate; up]).

The HF module names come from the bridge's declaration of the base weight (`<linear>.weight` ->
its HF tensors and transform, megatron_bridge/mappings.py), so every architecture the bridge maps
is covered. A fused linear has one A; PEFT's q/k/v (gate/up) modules each get that same `lora_A` and
their own slice of B (`qkv_split` / `gate_up_split`): B_q A x, B_k A x, B_v A x are exactly the rows
of B A x, so the PEFT model computes what the megatron one does.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megatron_bridge.layouts import gate_up_split, qkv_split
from megatron_bridge.mappings import megatron_to_hf_names

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> the transformers model


def _split_b(b: torch.Tensor, transform: str, args) -> tuple[torch.Tensor, ...]:
    if transform == "qkv":
        return qkv_split(b, args.num_query_groups, args.num_attention_heads // args.num_query_groups)
    if transform == "gate_up":
        return gate_up_split(b)
    return (b,)


def hf_adapters(adapters: dict[str, torch.Tensor], args) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Megatron-layout adapters -> {HF module name (`model.layers.0.self_attn.q_proj`): (A [r, in], B [out, r])}."""
    maps = megatron_to_hf_names(args)
    out = {}
    for name, a in adapters.items():
        if not name.endswith(".lora.A"):
            continue
        linear = name[: -len(".lora.A")]
        m = maps[linear + ".weight"]
        b_parts = _split_b(adapters[linear + ".lora.B"], m.transform, args)
        assert len(b_parts) == len(m.hf), f"bug: {linear} has {len(m.hf)} HF tensors"
        for hf_name, b in zip(m.hf, b_parts):
            out[hf_name.removesuffix(".weight")] = (a.contiguous(), b.contiguous())
    return out


def peft_state_dict(adapters: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """The tensors of `adapter_model.safetensors`, under PEFT's saved names (no adapter name)."""
    return peft_module_state(hf_adapters(adapters, args))


def peft_module_state(modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`peft_state_dict` of adapters already under HF module names (`hf_adapters`' output)."""
    state = {}
    for module, (a, b) in modules.items():
        state[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.clone()  # a copy each: PEFT's modules own theirs
        state[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
    return state


def peft_config(adapters: dict[str, torch.Tensor], args, alpha: float, dropout: float, base_model: str) -> dict:
    """`adapter_config.json`: LoRA on the HF modules the adapters cover (scale alpha / r, as ours)."""
    return peft_module_config(hf_adapters(adapters, args), alpha, dropout, base_model)


def peft_module_config(modules: dict, alpha: float, dropout: float = 0.0, base_model: str = "") -> dict:
    """`peft_config` of adapters already under HF module names."""
    rank = next(iter(modules.values()))[0].shape[0]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_adapter(
    out: str, adapters: dict[str, torch.Tensor], args, alpha: float, dropout: float = 0.0, base_model: str = ""
) -> str:
    """Write `out/adapter_config.json` and `out/adapter_model.safetensors`; returns `out`."""
    return write_peft_modules(out, hf_adapters(adapters, args), alpha, dropout, base_model)


def write_peft_modules(
    out: str,
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
    alpha: float,
    dropout: float = 0.0,
    base_model: str = "",
) -> str:
    """`write_peft_adapter` for adapters under HF module names (the weight sync's form: vLLM's LoRA path)."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in peft_module_state(modules).items()}
    save_file(state, os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_module_config(modules, alpha, dropout, base_model), f, indent=2)
    return out


def merged_hf_state(
    hf_state: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], args, scale: float
) -> dict[str, torch.Tensor]:
    """HF state dict with W + scale * B @ A on every adapted weight (computed in fp32, cast back)."""
    merged = dict(hf_state)
    for module, (a, b) in hf_adapters(adapters, args).items():
        key = module + ".weight"
        w = hf_state[key]
        merged[key] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return merged


def read_peft_adapter(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, tensors) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    return config, load_file(os.path.join(path, ADAPTER_WEIGHTS))


def base_model_of(config: dict) -> Optional[str]:
    return config.get("base_model_name_or_path") or None
