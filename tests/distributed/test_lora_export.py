"""PEFT export of megatron LoRA adapters: the adapter directory, loaded with `peft` on the base HF
model, and the merged HF model each give the megatron actor's logits (fp32, <= 1e-5).

The actor trains its adapters for one step at TP2 (B random first, so A moves too); the adapters
are gathered in megatron layout (`adapter_state`) and exported on the test's own process.
"""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.test_lora_layouts import ALPHA, RANK, _loss_step, _offset, _random_adapters, _role
from tests.distributed.test_megatron_parallel import _batch

TOL = 1e-5
SEQ_LEN = 24


def _trained_actor(hf_dir, input_ids):
    from megatron_bridge.lora import adapter_state, load_adapter_state_
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.verify import megatron_logits

    g = init_distributed(2, 1)
    role = _role(hf_dir, g)
    off = _offset(role)
    load_adapter_state_(role.module, _random_adapters(adapter_state(role.module, g.tp, g.pp, off)), g.tp, off)
    _loss_step(role, _batch(role.args.vocab_size))
    assert role.optimizer.step()[0]
    role.model.eval()
    logits = megatron_logits(role.module, input_ids, g, role.args.vocab_size)
    return {"adapters": adapter_state(role.module, g.tp, g.pp, off), "logits": logits}


def _hf_logits(model, batch):
    from megatron_bridge.verify import padding_mask

    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=padding_mask(batch)).logits.float()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_peft_adapter_and_merged_model_give_the_actors_logits(request, fixture, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_bridge.hf import read_model_args
    from megatron_bridge.verify import make_batch, max_abs_diff
    from rlstack.export import export_merged, export_peft_adapter

    hf_dir = request.getfixturevalue(fixture)
    batch = make_batch(hf_dir, read_model_args(hf_dir).vocab_size, seq_len=SEQ_LEN)
    actor = run_distributed(_trained_actor, 2, hf_dir, batch.input_ids)[0]
    assert all(v.abs().max() > 0 for v in actor["adapters"].values())

    adapter_dir = export_peft_adapter(actor["adapters"], hf_dir, str(tmp_path / "adapter"), ALPHA)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    base_logits = _hf_logits(base, batch)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= set(
        peft_model.peft_config["default"].target_modules
    )
    peft_diff = max_abs_diff(_hf_logits(peft_model, batch), actor["logits"], batch.lengths)
    assert max_abs_diff(base_logits, actor["logits"], batch.lengths) > 1e-3  # the adapters matter

    merged_dir = export_merged(actor["adapters"], hf_dir, str(tmp_path / "merged"), ALPHA / RANK)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    merged_diff = max_abs_diff(_hf_logits(merged, batch), actor["logits"], batch.lengths)
    print(f"{fixture}: max |logit diff| PEFT {peft_diff:.1e}, merged {merged_diff:.1e}")
    assert peft_diff <= TOL and merged_diff <= TOL, (peft_diff, merged_diff)
