"""The memory planner: hand-computed byte counts for a tiny shape, and the CLI's verdicts.

Tiny shape: hidden 8, ffn 16, 2 layers, 2 heads of dim 4, 1 KV group, vocab 100 padded to 128, tied.
"""

import json
import os

import pytest

from rlstack.config import load_config
from rlstack.plan import main
from rlstack.planner import format_plan, plan_for_config, plan_for_validate
from rlstack.planner import memory as m

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.path.join(ROOT, "rlstack", "planner", "model_configs")
QWEN_0P5B = os.path.join(ASSETS, "qwen2-0.5b-instruct.json")
QWEN_7B = os.path.join(ASSETS, "qwen2-7b-instruct.json")
CFG_0P5B = os.path.join(ROOT, "yaml_configs", "qwen2_0p5b_gsm8k_1gpu.yaml")
CFG_7B = os.path.join(ROOT, "yaml_configs", "qwen2_7b_gsm8k_8xa100.yaml")

S = m.Shape(
    hidden_size=8,
    ffn_hidden_size=16,
    num_layers=2,
    num_attention_heads=2,
    num_query_groups=1,
    head_dim=4,
    vocab_size=100,
    padded_vocab_size=128,
    tie_word_embeddings=True,
    qkv_bias=False,
)
PARAMS = 2216  # 2 layers x 592 + embedding 128 x 8 + final norm 8


def test_layer_params_by_hand():
    # qkv 8 x (8 + 2*4) = 128, proj 8 x 8 = 64, SwiGLU 3 x 8 x 16 = 384, two norms 16
    assert m.layer_params(S, tp=1) == 128 + 64 + 384 + 16
    assert m.layer_params(S, tp=2) == (128 + 64 + 384) // 2 + 16  # norms are replicated


def test_stage_params_embedding_placement():
    assert m.stage_params(S, tp=1, pp=1, stage=0) == PARAMS
    untied = m.Shape(**{**S.__dict__, "tie_word_embeddings": False})
    assert m.stage_params(untied, tp=1, pp=1, stage=0) == PARAMS + 128 * 8
    assert m.stage_params(S, tp=1, pp=2, stage=0) == 592 + 1024
    assert m.stage_params(S, tp=1, pp=2, stage=1) == 592 + 8 + 1024  # tied copy on the last stage
    assert m.stage_params(S, tp=1, pp=1, stage=0, value_head=True) == PARAMS + 8


def test_weights_grads_adam_and_dp_sharding():
    assert m.weight_bytes(PARAMS, 2) == 4432
    assert m.grad_bytes(PARAMS) == 8864  # fp32 grad buffer
    assert m.optimizer_bytes(PARAMS, mixed_precision=True, dp=4, distributed=False) == PARAMS * 12
    assert m.optimizer_bytes(PARAMS, mixed_precision=True, dp=4, distributed=True) == 554 * 12
    assert m.optimizer_bytes(PARAMS, mixed_precision=False, dp=1, distributed=False) == PARAMS * 8
    assert m.adam_step_temp_bytes(PARAMS, dp=4, distributed=True) == 554 * 4


def test_activations_with_and_without_recompute():
    mb = m.Tokens(batch=2, seq_len=4)  # 8 tokens, bf16
    # fused attention, per token: (4h + 2q + 2kv + 3f (fused SwiGLU)) x 2 bytes + 2h x 2
    # = (32 + 24 + 48) x 2 + 32 = 240
    assert m.layer_activation_bytes(S, 1, mb, 2, fused_attention=True) == 240 * 8
    # LeanRMSNorm (fp32 on CPU) keeps no normalised copy: 2h x 2 bytes less per token
    assert m.layer_activation_bytes(S, 1, mb, 2, fused_attention=True, lean_norm=True) == (240 - 32) * 8
    # unfused: k, v repeated to every head (kv = q = 8): 256 per token, + softmax 2 x 2 x 4 x 4 x (4 + 2)
    assert m.layer_activation_bytes(S, 1, mb, 2, fused_attention=False) == 256 * 8 + 384
    hidden = 8 * 8 * 2  # one [s, b, h] in bf16
    full = m.training_activation_bytes(S, 1, 1, mb, 2, True, recompute=False, in_flight=1)
    assert full == 2 * 1920 + 3 * hidden
    recompute = m.training_activation_bytes(S, 1, 1, mb, 2, True, recompute=True, in_flight=1)
    assert recompute == 2 * hidden + 1920 + 3 * hidden
    assert m.training_activation_bytes(S, 1, 1, mb, 2, True, recompute=False, in_flight=2) == 2 * full


def test_selective_recompute_drops_what_it_rebuilds():
    mb = m.Tokens(batch=2, seq_len=4)  # 8 tokens, bf16; per token without recompute: 240 (above)
    # "layernorm": the norms' outputs (2h) and torch RMSNorm's normalised copies (2h) are rebuilt
    assert m.layer_activation_bytes(S, 1, mb, 2, True, selective=("layernorm",)) == (240 - 64) * 8
    assert m.layer_activation_bytes(S, 1, mb, 2, True, lean_norm=True, selective=("layernorm",)) == (240 - 64) * 8
    # "mlp": fc1's output and the product (3f)
    assert m.layer_activation_bytes(S, 1, mb, 2, True, selective=("mlp",)) == (240 - 96) * 8
    # "mlp_act": the SwiGLU product (f) only
    assert m.layer_activation_bytes(S, 1, mb, 2, True, selective=("mlp_act",)) == (240 - 32) * 8
    # "core_attn": nothing more with fused attention; the softmax without
    assert m.layer_activation_bytes(S, 1, mb, 2, True, selective=("core_attn",)) == 240 * 8
    assert m.layer_activation_bytes(S, 1, mb, 2, False, selective=("core_attn",)) == 256 * 8
    # every layer keeps the rest; one layer's rebuilt part is alive during its backward
    hidden = 8 * 8 * 2
    sel = m.training_activation_bytes(S, 1, 1, mb, 2, True, False, 1, selective=("mlp",))
    assert sel == 2 * 144 * 8 + 96 * 8 + 3 * hidden


def test_logprob_temporaries_and_kv_cache():
    mb = m.Tokens(batch=2, seq_len=4)
    # 8 x 128 logits: bf16 logits + their bf16 gradient, two fp32 chunks (here the whole micro-batch),
    # 32 bytes of per-row stats; the temperature is applied per chunk (no full-size copy)
    assert m.logprob_train_bytes(S, 1, mb, 2, temperature=1.0) == 1024 * (2 + 2 + 8) + 8 * 32
    assert m.logprob_train_bytes(S, 1, mb, 2, temperature=0.5) == 1024 * (2 + 2 + 8) + 8 * 32
    assert m.logprob_forward_bytes(S, 1, mb, 4, temperature=1.0) == 1024 * (4 + 8) + 8 * 32
    # K and V, 2 layers, 1 KV head of dim 4, bf16: 32 bytes per token
    assert m.kv_bytes_per_token(S, rollout_tp=1, kv_bytes=2) == 32
    assert m.kv_cache_bytes(S, 1, 2, num_seqs=3, max_model_len=10) == 960
    assert m.kv_bytes_per_token(S, rollout_tp=2, kv_bytes=2) == 32  # 1 KV head is replicated, not split


def test_fused_output_logprob_temporaries():
    mb = m.Tokens(batch=2, seq_len=4)
    # no logits: two fp32 [chunk, V] buffers (here the whole 8 x 128), with grad the head's fp32
    # weight-gradient accumulator 128 x 8 and the hidden states' gradient 8 x 8 fp32
    assert m.fused_logprob_bytes(S, 1, mb, train=False) == 1024 * 8 + 8 * 32
    assert m.fused_logprob_bytes(S, 1, mb, train=True) == 1024 * 8 + 128 * 8 * 4 + 8 * (32 + 32)
    # fp32 weights: the head's gradient goes into megatron's grad buffer, no accumulator of its own
    assert m.fused_logprob_bytes(S, 1, mb, train=True, head_grad_in_buffer=True) == 1024 * 8 + 8 * (32 + 32)
    cfg = load_config(CFG_7B)
    fused = plan_for_config(cfg, 8, 80, model_config_file=QWEN_7B)
    cfg.model.fused_output_logprobs = False
    unfused = plan_for_config(cfg, 8, 80, model_config_file=QWEN_7B)
    # 4 x 1536 bf16 logits [6144, 152064 / TP4] and their gradient: 0.87 GiB, against 0.65 fused
    saved = (unfused.peak_bytes - fused.peak_bytes) / 2**30
    assert 0.2 < saved < 0.3, saved


def test_distributed_optimizer_shards_optimizer_state_by_dp():
    cfg = load_config(CFG_7B)
    sharded = plan_for_config(cfg, 8, 80, model_config_file=QWEN_7B)
    cfg.parallel.use_distributed_optimizer = False
    full = plan_for_config(cfg, 8, 80, model_config_file=QWEN_7B)

    def optimizer(plan):
        return next(i for i in plan.items if i.role == "actor" and i.name.startswith("optimizer (")).at("update")

    assert full.dp == 2
    assert optimizer(full) == pytest.approx(2 * optimizer(sharded), rel=1e-6)


def test_cli_exit_1_names_the_change_that_fits(capsys):
    rc = main(
        [
            "--config",
            CFG_0P5B,
            "--world-size",
            "1",
            "--gpu-memory-gib",
            "40",
            "--model-config",
            QWEN_0P5B,
            "rollout.gpu_memory_utilization=0.5",
            "algorithm.micro_batch_size=4",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert "of 40.00 GiB" in out and "does not fit" in out
    verdict = next(line for line in out.splitlines() if line.startswith("peak ") and " GiB of " in line)
    assert "rollout.gpu_memory_utilization=0.17" in verdict and "would fit" in verdict


def test_cli_names_offload_when_nothing_else_fits(capsys):
    rc = main(["--config", CFG_0P5B, "--world-size", "1", "--gpu-memory-gib", "16", "--model-config", QWEN_0P5B])
    out = capsys.readouterr().out
    assert rc == 1 and "offload" in out and "add GPUs" in out


def test_cli_exit_0_when_it_fits(capsys):
    rc = main(["--config", CFG_0P5B, "--world-size", "1", "--gpu-memory-gib", "80", "--model-config", QWEN_0P5B])
    assert rc == 0
    assert ": fits" in capsys.readouterr().out


def test_cli_json_parses(capsys):
    rc = main(["--config", CFG_7B, "--world-size", "8", "--gpu-memory-gib", "80", "--model-config", QWEN_7B, "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == (0 if plan["fits"] else 1)
    assert plan["layout"] == {"world_size": 8, "tp": 4, "pp": 1, "dp": 2, "stage": 0}
    assert plan["peak_bytes"] == max(plan["phase_bytes"].values())
    assert 0 < plan["allocator_peak_bytes"] < plan["peak_bytes"]  # no CUDA context / NCCL / fragmentation
    assert plan["kv_cache"]["per_token_bytes"] == 2 * 28 * 1 * 128 * 2


def test_missing_model_config_is_one_line(capsys):
    rc = main(
        ["--config", CFG_0P5B, "--world-size", "1", "--gpu-memory-gib", "80", "model.path=/nonexistent/Qwen2-0.5B"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1
    assert "/nonexistent/Qwen2-0.5B" in err and "--model-config" in err


def test_bad_layout_is_a_user_error(capsys):
    rc = main(["--config", CFG_7B, "--world-size", "6", "--gpu-memory-gib", "80", "--model-config", QWEN_7B])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "world size 6" in err


def test_tiny_cpu_plan_uses_the_tiny_shape():
    cfg = load_config(os.path.join(ROOT, "yaml_configs", "tiny_cpu.yaml"))
    plan = plan_for_config(cfg, 2, 24, device="cpu")
    assert plan.model_source == "model.tiny"
    tiny = cfg.model.tiny
    shape = m.Shape(
        tiny.hidden_size,
        tiny.intermediate_size,
        tiny.num_layers,
        tiny.num_attention_heads,
        tiny.num_key_value_heads,
        tiny.hidden_size // tiny.num_attention_heads,
        300,
        384,
        True,
        False,
    )
    weights = next(i for i in plan.items if i.role == "actor" and i.name.startswith("weights"))
    assert weights.at("rollout") == m.stage_params(shape, 1, 1, 0) * 4
    assert plan.fits


def test_validate_only_plan_needs_the_model_directory():
    cfg = load_config(CFG_0P5B, ["model.path=/nonexistent/Qwen2-0.5B"])
    assert plan_for_validate(cfg, world_size=1, gpu_memory_gib=40) is None
    tiny = load_config(os.path.join(ROOT, "yaml_configs", "tiny_cpu.yaml"))
    text = format_plan(plan_for_validate(tiny, world_size=2, gpu_memory_gib=40))
    assert "GiB of 40.00 GiB" in text and "model.tiny" in text


def test_bad_flag_is_one_line(capsys):
    rc = main(["--config", CFG_0P5B, "--world-size", "one", "--gpu-memory-gib", "80"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--world-size" in err


@pytest.mark.parametrize(
    "name,world,gib,fixture",
    [
        ("qwen2_0p5b_gsm8k_1gpu.yaml", 1, 40, QWEN_0P5B),
        ("qwen2_7b_gsm8k_8xa100.yaml", 8, 80, QWEN_7B),
        ("qwen2_7b_gsm8k_4node.yaml", 32, 80, QWEN_7B),
    ],
)
def test_shipped_gpu_configs_fit_with_the_planned_vllm_share(name, world, gib, fixture):
    cfg = load_config(os.path.join(ROOT, "yaml_configs", name))
    plan = plan_for_config(cfg, world, gib, model_config_file=fixture)
    assert plan.fits, format_plan(plan)
    assert plan.kv.need_bytes <= plan.kv.available_bytes <= 1.5 * plan.kv.need_bytes


def test_a_vllm_share_far_above_the_kv_need_is_reported():
    cfg = load_config(CFG_7B, ["rollout.gpu_memory_utilization=0.3"])
    plan = plan_for_config(cfg, 8, 80, model_config_file=QWEN_7B)
    assert plan.kv.available_bytes > 3 * plan.kv.need_bytes  # the "~3x its KV need"
    assert any("rollout.gpu_memory_utilization=0.13" in note for note in plan.notes)


def test_token_budget_sizes_the_training_micro_batch():
    from megatron_bridge.parallel import ParallelDims
    from rlstack.config import load_config
    from rlstack.planner.build import derive_setting

    cfg = load_config("yaml_configs/smollm2_arith_cpu.yaml", ["algorithm.max_tokens_per_micro_batch=1024"])
    dims = ParallelDims.resolve(1, 1, -1, 2)
    setting = derive_setting(cfg, dims, 8192, fused_attention=False)
    assert setting.train_mb.batch == 4 and setting.train_mb.seq_len == 256  # 1024 tokens of 256-token rows


def test_selective_recompute_in_the_plan_and_its_suggestions():
    from rlstack.planner.build import candidate_changes

    def update_activations(*overrides):
        cfg = load_config(CFG_7B, list(overrides))
        plan = plan_for_config(cfg, 8, 80, device="gpu", model_config_file=QWEN_7B, suggest=False)
        line = next(i for i in plan.items if i.role == "actor" and i.name.startswith("activations"))
        return line.name, line.at("update")

    name, none = update_activations()
    sel_name, sel = update_activations("model.recompute_modules=[layernorm,mlp]")
    full_name, full = update_activations("model.gradient_checkpointing=true")
    assert "no recompute" in name and "recompute layernorm+mlp" in sel_name
    assert full < sel < none
    cfg = load_config(CFG_7B, [])
    plan = plan_for_config(cfg, 8, 80, device="gpu", model_config_file=QWEN_7B, suggest=False)
    dims = type("Dims", (), {"dp": plan.dp})
    changes = candidate_changes(cfg, plan.kv, dims, "cpu")
    keys = [next(iter(c)) for c in changes]
    # on CPU the norms first (next to free), then the SwiGLU product, before any smaller micro-batch;
    # full recompute clears the list
    assert changes[keys.index("model.recompute_modules")] == {"model.recompute_modules": ["layernorm"]}
    assert {"model.recompute_modules": ["layernorm", "mlp_act"]} in changes
    assert len(keys) - keys[::-1].index("model.recompute_modules") - 1 < keys.index("algorithm.micro_batch_size")
    assert {"model.gradient_checkpointing": True, "model.recompute_modules": []} in changes
    # on GPUs TE's layer spec fuses the norms into the linears: only the product is suggested there
    gpu = candidate_changes(cfg, plan.kv, dims, "gpu")
    assert [c for c in gpu if next(iter(c)) == "model.recompute_modules"] == [{"model.recompute_modules": ["mlp_act"]}]


@pytest.mark.parametrize("device, memory", [("cpu", 24), ("gpu", 80), ("gpu", 8)])
def test_the_plan_fits_100_columns_and_its_summary_one_line(device, memory):
    """The table and every line of the plan stay within 100 columns (issue 34: it was 164 wide);
    the one-line summary a launch prints names the peak, of what, and the verdict."""
    from rlstack.planner import summarize_plan

    cfg = load_config(CFG_7B)
    plan = plan_for_config(cfg, 8, memory, device=device, model_config_file=QWEN_7B)
    lines = format_plan(plan).splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    summary = summarize_plan(plan)
    assert "\n" not in summary and summary.startswith("memory plan: peak ")
    assert summary.endswith(": fits") == plan.fits
