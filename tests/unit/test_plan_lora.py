"""The memory plan with LoRA: adapters counted per TP rank, the frozen base without gradients or
Adam state, the optimizer over the adapters only (sharded by DP), and no reference weights."""

from __future__ import annotations

import json

import pytest

from rlstack.config import load_config
from rlstack.planner import memory as m
from rlstack.planner import plan_for_config
from tests.unit.test_plan import CFG_7B, QWEN_7B, S


def test_adapter_params_by_hand():
    # rank 2 on S (h 8, q 8, kv 4, f 16): qkv A 2x8 + B 16x2; proj A 2x8 + B 8x2; fc1 A 2x8 + B 32x2;
    # fc2 A 2x16 + B 8x2
    assert m.lora_layer_params(S, tp=1, rank=2) == 48 + 32 + 80 + 48
    # TP2: the split halves (column: B, row: A), the replicated stays whole
    assert m.lora_layer_params(S, tp=2, rank=2) == (16 + 16) + (8 + 16) + (16 + 32) + (16 + 16)
    assert m.lora_layer_params(S, tp=1, rank=2, targets=("linear_qkv",)) == 48
    assert m.stage_lora_params(S, tp=1, pp=2, rank=2) == 208  # one of two layers
    assert m.stage_lora_params(S, tp=1, pp=1, rank=0) == 0


def _item(plan, role, prefix):
    found = [i for i in plan.items if i.role == role and i.name.startswith(prefix)]
    return found[0] if found else None


def test_plan_counts_adapters_frozen_base_and_no_reference():
    full = plan_for_config(load_config(CFG_7B), 8, 80, model_config_file=QWEN_7B, suggest=False)
    cfg = load_config(CFG_7B, ["model.lora.rank=16"])
    lora = plan_for_config(cfg, 8, 80, model_config_file=QWEN_7B, suggest=False)
    assert cfg.algorithm.use_kl_loss and _item(full, "reference", "weights") is not None
    assert _item(lora, "reference", "weights") is None  # the actor with its adapters off
    assert any("adapters off" in n for n in lora.notes)

    adapters = m.stage_lora_params(_shape(lora), lora.tp, lora.pp, 16)
    assert adapters > 0
    assert _item(lora, "actor", "weights").at("update") == _item(full, "actor", "weights").at("update")  # base kept
    assert _item(lora, "actor", "LoRA adapters").at("update") == adapters * 2  # bf16
    assert _item(lora, "actor", "gradients").at("update") == adapters * 4
    # fp32 main params + m + v of the adapters, 1/dp each with the distributed optimizer
    assert _item(lora, "actor", "optimizer").at("update") == m.optimizer_bytes(adapters, True, lora.dp, True)
    ratio = _item(lora, "actor", "optimizer").at("update") / _item(full, "actor", "optimizer").at("update")
    base = _item(full, "actor", "weights").at("update") // 2
    assert ratio == pytest.approx(adapters / base, rel=1e-3)
    assert lora.peak_bytes < full.peak_bytes


def _shape(plan):
    from rlstack.planner.shapes import model_args, shape_of

    with open(QWEN_7B) as f:
        hf = json.load(f)
    return shape_of(model_args(hf, QWEN_7B), plan.tp)


def test_hf_engine_merged_lora_weights_are_counted():
    """rollout.lora_sync=merged: the hf engine holds W + scale B A of every adapted linear (fp32 on CPU)."""
    from rlstack.planner.items import _merged_lora_items
    from tests.unit.test_preflight import TINY

    # S (h 8, q 8, kv 4, f 16, 2 layers): qkv 16x8 + proj 8x8 + fc1 32x8 + fc2 8x16 per layer
    assert m.lora_merged_params(S) == (128 + 64 + 256 + 128) * S.num_layers
    assert m.lora_merged_params(S, ("linear_qkv",)) == 128 * S.num_layers
    cfg = load_config(TINY, ["model.lora.rank=2", "rollout.lora_sync=merged"])
    (item,) = _merged_lora_items(cfg, S, "cpu")
    assert item.at("rollout") == item.at("update") == m.lora_merged_params(S) * 4
    assert _merged_lora_items(load_config(TINY, ["model.lora.rank=2", "rollout.lora_sync=adapters"]), S, "cpu") == []
    merged_vllm = ["model.lora.rank=2", "rollout.lora_sync=merged", "rollout.engine=vllm"]
    assert _merged_lora_items(load_config(TINY, merged_vllm), S, "cpu") == []  # vLLM's own copy is the merged one
