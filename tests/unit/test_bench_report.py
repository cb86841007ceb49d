"""The benchmark suite's pure parts: FLOP counts, figures derived from measurements, the report."""

import copy
import os

import pytest

from benchmarks import analysis, report
from benchmarks.ceilings import combine, model_shapes
from benchmarks.environment import STAMP, ensure_bench_venv
from benchmarks.flops import (
    ModelDims,
    StepShape,
    actor_flops_per_token,
    decode_flops_per_token,
    flops_per_token,
    step_flops,
)
from benchmarks.procs import MemorySampler

# hidden 4, 1 layer, 2 heads of dim 2, 1 KV head, ffn 8, vocab 10:
# qkv 4 -> (2 + 2*1) * 2 = 8 (32), proj 4 -> 4 (16), fc1 4 -> 16 (64), fc2 8 -> 4 (32): 144 per layer;
# LM head 10 x 4 = 40: P = 184; critic P = 144 + 4 = 148.
DIMS = ModelDims(hidden=4, layers=1, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=10)
SHAPE = StepShape(num_prompts=2, samples_per_prompt=2, prompt_len=3, response_len=2)


def test_param_counts():
    assert DIMS.layer_params == 144
    assert DIMS.matmul_params == 184
    assert DIMS.critic_matmul_params == 148
    hf = {
        "hidden_size": 4,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 8,
        "vocab_size": 10,
        "architectures": ["LlamaForCausalLM"],
    }
    from megatron_bridge.hf_config import ModelArgs

    assert ModelDims.from_args(ModelArgs.from_hf_config(hf)) == DIMS


def test_attention_flops_count_causal_pairs():
    # s=3: 6 (query, key) pairs x 2 heads x head_dim 2 x 2 matmuls x 2 FLOPs
    assert DIMS.attention_flops(3) == 4 * 6 * 2 * 2
    assert DIMS.attention_flops(5, past=3) == 4 * (15 - 6) * 2 * 2


def test_grpo_step_flops_by_hand():
    flops = step_flops(DIMS, SHAPE)
    # 4 sequences of 5 tokens: the layers (144) at all 5, the LM head (40) at the 2 response positions
    forward = 4 * (2 * 144 * 5 + 2 * 40 * 2 + 240)
    generation = 2 * (2 * 184 * 3 + 96) + 4 * (2 * 184 * 2 + 144)  # prefill once per prompt, then decode
    assert flops["generation"] == generation == 5920
    assert flops["old_logprob"] == flops["ref_logprob"] == forward == 7360
    assert flops["actor_train"] == 3 * forward
    assert flops["total"] == generation + 5 * forward
    assert "critic_values" not in flops


def test_ppo_step_adds_the_critic_and_skips_what_is_off():
    shape = StepShape(
        num_prompts=2, samples_per_prompt=1, prompt_len=3, response_len=2, ppo_epochs=2, ref_forward=False, critic=True
    )
    flops = step_flops(DIMS, shape)
    critic_fwd = 2 * (2 * 148 * 5 + 240)
    assert "ref_logprob" not in flops
    assert flops["critic_values"] == critic_fwd
    assert flops["critic_train"] == 3 * critic_fwd * 2
    assert flops["actor_train"] == 3 * flops["old_logprob"] * 2


def test_per_token_flops():
    assert flops_per_token(DIMS, 5, 184) == 2 * 184 + 240 / 5
    assert flops_per_token(DIMS, 5, 184, train=True) == 3 * (2 * 184 + 240 / 5)
    assert decode_flops_per_token(DIMS, 4) == 2 * 184 + 4 * 4 * 2 * 2
    assert actor_flops_per_token(DIMS, SHAPE) == 7360 / 20  # 4 sequences x 5 tokens
    assert actor_flops_per_token(DIMS, SHAPE, train=True) == 3 * 7360 / 20


def test_model_shapes_per_rank():
    shapes = model_shapes(DIMS, rows=7, tp=2)
    assert shapes == [(7, 4, 4, 1), (7, 2, 4, 1), (7, 4, 8, 1), (7, 4, 4, 1), (7, 4, 5, 1)]


def test_combine_takes_worker_medians_and_machine_totals():
    def worker(train, decode, memcpy):
        return {
            "train": {"flops_per_s": train, "shapes": []},
            "decode": {"flops_per_s": decode, "shapes": []},
            "memcpy_bytes_per_s": memcpy,
        }

    out = combine([worker(10, 4, 100), worker(14, 6, 300), worker(12, 5, 200)], procs=3, threads=1)
    assert out["train_flops_per_s"] == 12 and out["train_flops_per_s_total"] == 36
    assert out["decode_flops_per_s"] == 5 and out["memcpy_bytes_per_s_total"] == 600


def _step(step_s, **extra):
    row = {
        "timing/step_s": step_s,
        "timing/sync_s": 1.0,
        "timing/rollout_s": 4.0,
        "timing/score_s": 2.0,
        "timing/update_s": 3.0,
        "throughput/rollout_tok_s": 0.5,
        "throughput/actor_tok_s": 5.0,
        "sync/seconds": 1.0,
        "sync/bytes": 1000,
        "response/length_mean": 2.0,
        "rollout/decode_steps": 63,
        "rollout/decode_rows_mean": 6.5,
        "rollout/decode_live_share": 0.8,
    }
    return {**row, **extra}


def _results() -> dict:
    return {
        "config": "c.yaml",
        "config_name": "c",
        "date": "2026-01-01",
        "command": "benchmarks/run.py --config c.yaml",
        "setup": {
            "prompts": 2,
            "n": 2,
            "warmup_steps": 1,
            "algorithm": "grpo",
            "engine": "hf",
            "model_name": "m",
            "max_new_tokens": 2,
            "dtype": "float32",
            "nproc": 2,
            "layout": "tp1 pp1 dp2",
            "threads_per_rank": 1,
            "steps": 3,
            "reps": 2,
            "warmup_reps": 1,
            "device": "cpu",
        },
        "model": {"dims": {"hidden": 4, "layers": 1, "heads": 2, "kv_heads": 1, "head_dim": 2, "ffn": 8, "vocab": 10}},
        "trainer": {
            "steps": [
                {"step": 0, "val/accuracy": 0.5},
                _step(100.0),
                _step(10.0),
                _step(12.0, **{"sync/seconds": 3.0}),
            ],
            "memory": {"per_rank_rss_gib": [2.0, 2.0], "sum_rss_gib": 4.0, "sum_pss_gib": 3.0},
        },
        "stages": {
            "prompt_len_mean": 3.0,
            "rollout": {"hf": {"tok_s": [8.0, 10.0, 9.0]}, "vllm": {"skipped": "vllm is not installed"}},
            "actor_fwd": {"tok_s": [20.0, 20.0]},
            "critic_fwd": {"tok_s": [30.0, 30.0]},
        },
        "ceilings": {
            "train_flops_per_s": 500.0,
            "train_flops_per_s_total": 1000.0,
            "decode_flops_per_s": 250.0,
            "decode_flops_per_s_total": 500.0,
            "memcpy_bytes_per_s": 100.0,
            "memcpy_bytes_per_s_total": 200.0,
            "procs": 2,
            "threads_per_proc": 1,
        },
        "trl": {
            "trl_version": "1.16.0",
            "prompts": 2,
            "generations": 2,
            "peak_rss_gib": 10.0,
            "steps": [
                {"step_s": 50.0},
                {"step_s": 20.0, "trl/completions/mean_length": 2.0},
                {"step_s": 24.0, "trl/completions/mean_length": 2.0},
            ],
        },
        "machine": {"cpu": "test cpu", "logical cores": 2},
        "versions": {"torch": "x"},
    }


def test_derive_excludes_warmup_and_computes_fractions():
    f = analysis.derive(_results())
    assert f["timing/step_s"] == {"median": 11.0, "min": 10.0, "max": 12.0, "n": 2}
    assert f["timing/other_s"]["min"] == 0.0 and f["timing/other_s"]["max"] == 2.0
    # floor: generation at the decode ceiling, every other pass at the training ceiling
    floor_s = 5920 / 500 + (42720 - 5920) / 1000  # generation + 5 actor forwards of 7360
    assert f["floor/seconds"] == pytest.approx(floor_s)
    assert f["fraction/step_floor"]["median"] == pytest.approx(floor_s / 11)
    assert f["fraction/step_floor"]["min"] == pytest.approx(floor_s / 12)
    assert f["fraction/mfu"]["median"] == pytest.approx(42720 / 11 / 1000)
    decode_ceiling = 500 / decode_flops_per_token(DIMS, 3 + 1)
    assert f["ceiling/decode_tok_s"] == pytest.approx(decode_ceiling)
    assert f["fraction/rollout_hf"]["median"] == pytest.approx(9 / decode_ceiling)
    assert "fraction/rollout_vllm" not in f
    assert f["fraction/actor_fwd"]["median"] == pytest.approx(20 * 7360 / 20 / 1000)
    assert f["fraction/actor_train"]["median"] == pytest.approx(5 * 3 * 7360 / 20 / 1000)
    # sync: 1000 bytes in 1 s and 3 s at memcpy 100 B/s -> 10 s of memcpy; 0.1x and 0.3x that time
    assert f["sync/memcpy_multiple"]["median"] == pytest.approx(0.2)
    assert f["fraction/sync_memcpy"]["max"] == pytest.approx(10.0)


def test_trl_ratios_and_targets():
    f = analysis.derive(_results())
    assert f["trl/step_s"]["median"] == 22.0
    assert f["ratio/step_time"] == pytest.approx(11 / 22)
    assert f["trl/gen_tok_s"]["median"] == pytest.approx((8 / 20 + 8 / 24) / 2)
    assert f["ratio/peak_memory"] == pytest.approx(0.4)
    t = f["targets"]
    assert t["step_time_vs_trl"]["met"] is True
    assert t["step_time_vs_trl_every_cpu"]["value"] == pytest.approx(0.5) and t["step_time_vs_trl_every_cpu"]["met"]
    assert t["peak_memory_vs_trl"]["met"] is True
    assert t["rollout_decode_fraction"]["met"] is False
    assert t["sync_bytes"]["value"] == 1000 and t["sync_bytes"]["met"] is False  # tp1 engine, tp1 actor: agree
    assert t["rank_memory_vs_state"]["met"] is None  # no parameter count in this run


def test_target_bounds_are_issue_15s():
    bounds = {k: (op, b) for k, (op, b, _) in analysis.TARGETS.items()}
    assert bounds == {
        "peak_memory_vs_trl": ("<=", 0.7),
        "rank_memory_vs_state": ("<=", 1.3),
        "step_time_vs_trl": ("<=", 0.6),
        "step_time_vs_trl_every_cpu": ("<=", 0.5),  # issue 40's
        "rollout_decode_fraction": (">=", 0.6),
        "step_floor_fraction": (">=", 0.7),
        "step_roofline_fraction": (">=", 0.8),  # issue 40's
        "sync_bytes": ("<=", 0),
    }


def test_rank_memory_against_its_training_state():
    results = _results()
    results["model"]["params"] = 2**28  # fp32: 4 (params) + 4 (grads) + 8 (Adam) bytes each = 4 GiB
    results["setup"].update(tp=1, pp=1, dp=2, distributed_optimizer=False)
    f = analysis.derive(results)
    assert f["mem/state_gib_per_rank"] == pytest.approx(4.0)
    assert f["ratio/rank_memory_vs_state"] == pytest.approx(2.0 / 4.0)  # the larger rank, 2 GiB
    results["setup"]["distributed_optimizer"] = True  # Adam sharded over DP=2: 4 + 4 + 4 bytes
    f = analysis.derive(results)
    assert f["mem/state_gib_per_rank"] == pytest.approx(3.0)
    assert f["targets"]["rank_memory_vs_state"]["met"] is True
    results["setup"].update(tp=2, dtype="bfloat16", distributed_optimizer=False)  # 2 + 4 + 8 + 4 master
    assert analysis.derive(results)["mem/state_gib_per_rank"] == pytest.approx(18 / 16 * 4 / 2)


def test_sync_bytes_target_only_where_layouts_agree():
    results = _results()
    results["setup"].update(tp=1, rollout_tp=2)
    assert analysis.derive(results)["targets"]["sync_bytes"]["value"] is None
    results["trainer"]["steps"] = [{**r, "sync/bytes": 0} for r in results["trainer"]["steps"]]
    results["setup"]["rollout_tp"] = 1
    assert analysis.derive(results)["targets"]["sync_bytes"]["met"] is True


def _two_settings() -> dict:
    results = _results()
    ref_trainer = copy.deepcopy(results["trainer"])
    ref_trainer["steps"] = [ref_trainer["steps"][0]] + [_step(s) for s in (100.0, 18.0, 20.0)]
    ref_trainer["memory"] = {"per_rank_rss_gib": [3.0, 3.0], "sum_rss_gib": 6.0}
    ref_trl = copy.deepcopy(results["trl"])
    ref_trl["steps"] = [{"step_s": 60.0}, {"step_s": 30.0}, {"step_s": 30.0}]
    results["primary_setting"] = "no_ref"
    results["settings"] = {
        "no_ref": {"label": "no reference", "reference": False, "trainer": results["trainer"], "trl": results["trl"]},
        "ref": {"label": "with reference", "reference": True, "trainer": ref_trainer, "trl": ref_trl},
    }
    return results


def test_each_setting_is_compared_with_its_own_trl_run():
    results = _two_settings()
    f = analysis.derive(results)
    assert f["settings"]["no_ref"]["ratio/step_time"] == pytest.approx(11 / 22)
    assert f["settings"]["ref"]["ratio/step_time"] == pytest.approx(19 / 30)
    assert f["settings"]["ref"]["ratio/peak_memory"] == pytest.approx(0.6)
    # the floor counts the reference forward only where a reference is loaded
    assert "ref_logprob" in f["settings"]["ref"]["floor/flops"]
    assert "ref_logprob" not in f["settings"]["no_ref"]["floor/flops"]
    text = report.render_markdown(results, f)
    assert "| step time | no reference | 11 s | 22 s | 0.50x |" in text
    assert "| step time | with reference | 19 s | 30 s | 0.63x |" in text
    assert "| target | bound | measured (no_ref) | met | measured (ref) | met |" in text
    assert "| GRPO step time / TRL's | <= 0.6 | 0.5 | yes | 0.633 | no |" in text
    assert "Both sides:" in text and "gradient checkpointing off (TRL: off)" in text


def test_settings_pair_rlstack_and_trl_on_the_same_kl():
    from types import SimpleNamespace as NS

    from benchmarks.run import settings_of

    cfg = NS(
        algorithm=NS(name="grpo", kl_loss_coef=0.002, use_kl_loss=False, use_kl_in_reward=False),
        data=NS(synthetic="arith"),
    )
    st = settings_of(NS(settings="no_ref,ref"), cfg)
    assert st["no_ref"]["overrides"] == ["algorithm.use_kl_loss=false"] and st["no_ref"]["beta"] == 0.0
    assert st["ref"]["overrides"] == ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.002"]
    assert st["ref"]["beta"] == 0.002 and st["ref"]["reference"] is True
    cfg.algorithm.name = "ppo"  # TRL runs GRPO only: the config alone, nothing to pair
    assert list(settings_of(NS(settings="no_ref,ref"), cfg)) == ["config"]


def test_failed_and_skipped_parts_leave_gaps_not_errors():
    results = _results()
    results["trainer"] = {"error": "trainer exit code 1 (log x)", "memory": {}}
    results["trl"] = {"skipped": "cannot install TRL"}
    results["ceilings"] = {"error": "ceilings timed out"}
    f = analysis.derive(results)
    assert "timing/step_s" not in f and "ratio/step_time" not in f
    assert all(t["met"] is None for t in f["targets"].values())
    text = report.render_markdown(results, f)
    assert "TRL comparison skipped: cannot install TRL" in text
    assert "Ceilings not measured: ceilings timed out" in text


def test_markdown_holds_every_figure():
    results = _results()
    f = analysis.derive(results)
    text = report.render_markdown(results, f)
    assert "| **PPO/GRPO step time** | 11 s | 10–12 (n=2) |" in text
    assert "| step time | as configured | 11 s | 22 s | 0.50x |" in text
    assert "rollout tokens/s, vllm engine | skipped | vllm is not installed" in text
    assert "| peak memory, all processes (RSS) | as configured | 4.00 GiB | 10.00 GiB | 0.40x |" in text
    assert "| GRPO step time / TRL's | <= 0.6 | 0.5 | yes |" in text
    assert "- cpu: test cpu" in text
    assert "| &nbsp;&nbsp;decode steps of the rollout (rank 0) | 63 |" in text
    assert "| &nbsp;&nbsp;rows a decode step carried, mean (rank 0); share still generating | 6.5 |" in text
    assert "| 80.0% (80.0%–80.0%) |" in text


def test_number_formats():
    assert report.fmt_num(72.4e9, "FLOP/s") == "72.4 GFLOP/s"
    assert report.fmt_num(0.5, "s") == "0.5 s"
    assert report.fmt_num(None) == "-"
    assert report.fmt_pct(0.256) == "25.6%"


def test_update_readme_replaces_only_between_markers(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(f"head\n{report.README_START}\nold\n{report.README_END}\ntail\n")
    assert report.update_readme(str(path), "new table")
    assert path.read_text() == f"head\n{report.README_START}\nnew table\n{report.README_END}\ntail\n"
    other = tmp_path / "OTHER.md"
    other.write_text("no markers\n")
    assert not report.update_readme(str(other), "x")
    assert other.read_text() == "no markers\n"


def test_readme_section_links_the_full_run():
    results = _results()
    text = report.readme_section(results, analysis.derive(copy.deepcopy(results)), "benchmarks/results")
    assert "(benchmarks/results/c-2026-01-01.md)" in text
    assert "on test cpu (2 cores), 2026-01-01" in text
    results["machine"]["cpu flags (vector, matrix)"] = "avx2 fma avx512f amx_bf16"
    text = report.readme_section(results, analysis.derive(copy.deepcopy(results)), "benchmarks/results")
    assert "on test cpu (2 cores, flags avx2 fma avx512f amx_bf16), 2026-01-01" in text
    assert "| step time | as configured | 11 s | 22 s | 0.50x |" in text


def test_memory_sampler_reads_this_process():
    sampler = MemorySampler(os.getpid(), launcher=False, with_pss=False)
    sampler.sample()
    peaks = sampler.peaks
    assert peaks.samples == 1 and len(peaks.per_rank_rss_gib) == 1
    assert 0 < peaks.per_rank_rss_gib[0] == peaks.sum_rss_gib


def test_bench_venv_is_not_reinstalled_when_stamped(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    (tmp_path / STAMP).write_text("stamped")
    python, reason = ensure_bench_venv(str(tmp_path))
    assert python == str(tmp_path / "bin" / "python") and reason == ""


def test_a_trainer_that_died_late_keeps_its_finished_steps():
    results = _results()
    results["trainer"]["error"] = "trainer exit code -9 (log x) after 3 of 4 steps"
    f = analysis.derive(results)
    assert f["timing/step_s"]["median"] == 11.0
    text = report.render_markdown(results, f)
    assert "- trainer: trainer exit code -9 (log x) after 3 of 4 steps" in text


def test_ceilings_measure_every_shape_of_a_small_model(monkeypatch):
    from benchmarks import ceilings

    monkeypatch.setattr(ceilings, "MIN_BLOCK_S", 0.001)  # the path, not the precision, is under test
    monkeypatch.setattr(ceilings, "BLOCKS", 2)
    out = ceilings.measure(
        DIMS, train_rows=16, decode_rows=2, tp=1, pp=1, dtype_name="float32", device_name="cpu", memcpy_mib=1
    )
    assert [(s["m"], s["k"], s["n"]) for s in out["train"]["shapes"]] == [
        (m, k, n) for m, k, n, _ in model_shapes(DIMS, 16)
    ]
    assert out["train"]["flops_per_s"] > 0 and out["decode"]["flops_per_s"] > 0 and out["memcpy_bytes_per_s"] > 0


def test_decode_ceiling_streams_every_weight_and_keeps_the_fastest_kernel(monkeypatch):
    import torch

    from benchmarks import ceilings

    monkeypatch.setattr(ceilings, "MIN_BLOCK_S", 0.001)
    monkeypatch.setattr(ceilings, "BLOCKS", 2)
    out = ceilings.measure(
        DIMS, train_rows=16, decode_rows=2, tp=1, pp=1, dtype_name="float32", device_name="cpu", memcpy_mib=1
    )
    d = out["decode"]
    assert d["weight_bytes"] == 4 * DIMS.matmul_params  # every layer's own weights, the LM head once
    assert d["flops_per_s"] == max(d["by_kernel"].values()) and "linear" in d["by_kernel"]
    # rlstack's AVX2 kernel, where it runs, is one of the decode ceiling's kernels (the hf engine decodes on
    # it) and none of the training ceiling's (no backward)
    assert ("avx2" in d["by_kernel"]) == ceilings._avx2_applies(torch.float32, torch.device("cpu"))
    assert "avx2" not in out["train"]["by_kernel"]
    assert out["decode_hot"]["flops_per_s"] > 0 and out["read_bytes_per_s"] > 0
    c = combine([out, out], procs=2, threads=1)
    assert c["decode_weight_bytes"] == d["weight_bytes"] and c["decode_flops_per_s_total"] == 2 * d["flops_per_s"]


def test_one_process_setting_has_its_own_layout_and_state():
    """rlstack as one process with every thread (TRL's layout): DP1, so each rank holds all of Adam."""
    from types import SimpleNamespace as NS

    from benchmarks.run import settings_of

    cfg = NS(
        algorithm=NS(name="grpo", kl_loss_coef=0.002, use_kl_loss=False, use_kl_in_reward=False),
        data=NS(synthetic="arith"),
    )
    st = settings_of(NS(settings="no_ref,one_process"), cfg)
    assert st["one_process"]["nproc"] == 1 and st["one_process"]["trl_from"] == "no_ref"
    assert st["one_process"]["overrides"] == st["no_ref"]["overrides"]
    results = _two_settings()
    results["model"]["params"] = 2**28
    results["setup"].update(tp=1, pp=1, dp=2, distributed_optimizer=True)
    one = copy.deepcopy(results["settings"]["no_ref"])
    one.update(label="one process", nproc=1)
    one["trainer"]["memory"] = {"per_rank_rss_gib": [5.0], "sum_rss_gib": 5.0}
    results["settings"]["one_process"] = one
    view = analysis.setting_results(results, "one_process")
    assert (view["setup"]["nproc"], view["setup"]["dp"], view["setup"]["threads_per_rank"]) == (1, 1, 2)
    f = analysis.derive(results)
    assert f["settings"]["one_process"]["mem/state_gib_per_rank"] == pytest.approx(4.0)  # 4 + 4 + 8 bytes
    assert f["settings"]["no_ref"]["mem/state_gib_per_rank"] == pytest.approx(3.0)  # Adam over DP2
    text = report.render_markdown(results, f)
    assert "(rlstack: 2 ranks x 1; one_process: 1 x 2; TRL:" in text


def test_a_repeated_run_never_overwrites_saved_results(tmp_path):
    from benchmarks.run import free_stem

    stem = str(tmp_path / "cfg-2026-12-01")
    assert free_stem(stem) == stem
    (tmp_path / "cfg-2026-12-01.json").write_text("{}")
    assert free_stem(stem) == stem + "-2"
    (tmp_path / "cfg-2026-12-01-2.md").write_text("")
    assert free_stem(stem) == stem + "-3"


def test_bf16_row_is_said_and_kept_out_of_the_readme_tables():
    from benchmarks.run import ROOT, parse_args, updates_readme, with_precision

    assert with_precision(parse_args(["--config", "c.yaml", "a.b=1"])) == ["a.b=1"]  # fp32 stays the default
    assert with_precision(parse_args(["--config", "c.yaml", "--bf16", "a.b=1"])) == [
        "a.b=1",
        "model.dtype=bfloat16",
        "rollout.verify_sync=0",
    ]
    with pytest.raises(SystemExit, match="drop the model.dtype override"):
        with_precision(parse_args(["--config", "c.yaml", "--bf16", "model.dtype=float32"]))
    results_dir = os.path.join(ROOT, "benchmarks", "results")
    assert updates_readme({"device": "cpu"}, results_dir)
    assert not updates_readme({"device": "cpu", "bf16_row": True}, results_dir)
    assert not updates_readme({"device": "cpu"}, "/tmp/elsewhere")
    results = _results()
    assert "Precision:" not in report.render_markdown(results, analysis.derive(results))
    results["setup"]["dtype"] = "bfloat16"
    text = report.render_markdown(results, analysis.derive(results))
    assert "Both sides: m, bfloat16," in text and "Precision: bfloat16 mixed precision on both sides" in text


def test_machine_names_the_cpu_flags_that_set_its_matmul_rate():
    from benchmarks.environment import VECTOR_FLAGS, _cpu_flags

    flags = _cpu_flags()
    assert flags in ("-", "unknown") or set(flags.split()) <= set(VECTOR_FLAGS)


def test_lora_setting_renders_beside_full_training():
    """benchmarks/run.py --lora RANK: a `lora` setting (TRL's pair: its ref run) with step time, peak
    memory and sync bytes in the table beside the full-training settings."""
    from types import SimpleNamespace as NS

    from benchmarks.run import settings_of

    cfg = NS(
        algorithm=NS(name="grpo", kl_loss_coef=0.002, use_kl_loss=False, use_kl_in_reward=False),
        data=NS(synthetic="arith"),
    )
    st = settings_of(NS(settings="no_ref,ref", lora=8), cfg)
    assert list(st) == ["no_ref", "ref", "lora"]
    assert st["lora"]["overrides"][0] == "model.lora.rank=8" and st["lora"]["trl_from"] == "ref"
    assert st["lora"]["reference"] is False  # the reference is the actor with its adapters off
    results = _two_settings()
    lora = copy.deepcopy(results["settings"]["ref"])
    lora["trainer"]["steps"] = [_step(s, **{"sync/bytes": 131072}) for s in (100.0, 14.0, 16.0, 15.0)]
    lora["trainer"]["memory"] = {"per_rank_rss_gib": [2.0, 2.0], "sum_rss_gib": 4.0}
    lora.update(label=st["lora"]["label"], reference=False)
    results["settings"]["lora"] = lora
    text = report.render_markdown(results, analysis.derive(results))
    label = st["lora"]["label"]
    assert f"| step time | {label} | 15 s | 30 s | 0.50x |" in text
    assert f"| peak memory, all processes (RSS) | {label} | 4.00 GiB |" in text
    assert f"| weight sync bytes (rank 0) | {label} | 131 kB | - |" in text
    assert "| weight sync bytes (rank 0) | with reference | 1 kB | - |" in text


def test_warmup_steps_leave_steps_out_on_both_sides_and_must_leave_one():
    from benchmarks.run import check_warmup, parse_args

    results = _results()
    results["setup"]["warmup_steps"] = 2  # the heap's warm-up: rlstack's 100 s and 10 s, TRL's 50 s and 20 s out
    f = analysis.derive(results)
    assert f["timing/step_s"] == {"median": 12.0, "min": 12.0, "max": 12.0, "n": 1}
    assert f["trl/step_s"]["median"] == 24.0
    check_warmup(parse_args(["--config", "c.yaml", "--steps", "26", "--trl-steps", "26", "--warmup-steps", "20"]))
    check_warmup(parse_args(["--config", "c.yaml", "--steps", "26", "--warmup-steps", "20", "--skip", "trl"]))
    with pytest.raises(SystemExit, match="--trl-steps 3"):  # TRL runs: its steps must outlast the warm-up too
        check_warmup(parse_args(["--config", "c.yaml", "--steps", "26", "--warmup-steps", "20"]))
    with pytest.raises(SystemExit, match="--steps 3"):
        check_warmup(parse_args(["--config", "c.yaml", "--warmup-steps", "3", "--skip", "trl"]))
