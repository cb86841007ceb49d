"""Zero-copy weights (`rollout.zero_copy`): the hf engine's tensors are views of the actor's.

At training TP1 x PP1 every HF tensor's rows sit in the rank's own Megatron parameters, so the sync
moves 0 bytes and the engine owns no weight storage; the engine still agrees with the actor after
the weights change (perturbation, an optimizer step), and `rollout.verify_sync` still stops an
engine whose views went stale. Tied (tiny_llama) and untied with QKV bias (tiny_qwen2).
"""

import pytest

from tests.dist_utils import run_distributed

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [30, 31]]
TOL = 1e-4


def _engine_and_sync(hf_dir, groups, model, args, zero_copy: bool):
    from megatron_bridge.reshard import WeightSync
    from rlstack.config import RolloutConfig
    from rlstack.rollout.base import build_engine

    cfg = RolloutConfig(engine="hf", micro_batch_size=8, zero_copy=zero_copy)
    engine = build_engine(cfg, hf_dir, groups, eos_token_id=2, pad_token_id=2)
    return engine, WeightSync(model, args, groups, engine, bucket_mb=0.25, zero_copy=zero_copy)


def _actor(hf_dir):
    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.parallel import init_distributed

    groups = init_distributed(1, 1)
    model, args = build_megatron_from_hf(hf_dir, groups)
    return groups, model, args


def _sgd_step(model):
    import torch

    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]] * 2)
    model.train()
    logits = model(tokens, torch.arange(8).expand_as(tokens), None)  # [B, S, V]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=2.0).step()
    model.eval()


def _zero_copy_follows(hf_dir):
    from rlstack.rollout.base import SamplingParams
    from rlstack.rollout.verify_sync import perturb_weights, verify_engine

    groups, model, args = _actor(hf_dir)
    engine, sync = _engine_and_sync(hf_dir, groups, model, args, zero_copy=True)
    copying, copy_sync = _engine_and_sync(hf_dir, groups, model, args, zero_copy=False)
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    perturb_weights(model, args, groups)
    first = sync.sync().as_metrics()
    after_perturb = verify_engine(model, args, groups, engine, PROMPTS, tol=TOL)
    before = engine.generate(PROMPTS, greedy)
    _sgd_step(model)
    second = sync.sync().as_metrics()
    after_step = verify_engine(model, args, groups, engine, PROMPTS, tol=TOL)
    after = engine.generate(PROMPTS, greedy)
    copied = copy_sync.sync().as_metrics()
    reference = copying.generate(PROMPTS, greedy)
    return {
        "first": first,
        "second": second,
        "copied": copied,
        "after_perturb": after_perturb,
        "after_step": after_step,
        "aliased": sorted(sync.aliased),
        "changed": any(
            a.response_ids != b.response_ids or abs(a.logprobs[0] - b.logprobs[0]) > 1e-3 for a, b in zip(after, before)
        ),
        "same_as_copy": [a.response_ids == r.response_ids for a, r in zip(after, reference)],
        "logprob_diff": max(abs(x - y) for a, r in zip(after, reference) for x, y in zip(a.logprobs, r.logprobs)),
    }


@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_qwen2"])  # tied; untied with QKV bias
def test_zero_copy_sync_moves_nothing_and_follows_the_actor(request, ckpt):
    hf_dir = request.getfixturevalue(ckpt)
    (r,) = run_distributed(_zero_copy_follows, 1, hf_dir, timeout=120)
    for stats in (r["first"], r["second"]):
        assert stats["sync/bytes"] == 0, stats
        assert stats["sync/engine_weight_bytes"] == 0, stats
        assert stats["sync/aliased_bytes"] > 0, stats
    assert any(n.endswith("q_proj.weight") for n in r["aliased"]), r["aliased"]
    assert r["after_perturb"] <= TOL and r["after_step"] <= TOL, r
    assert r["changed"], "the optimizer step did not change the engine's output: the test proves nothing"
    assert all(r["same_as_copy"]) and r["logprob_diff"] <= TOL, r
    # the copying engine owns a full copy and moves every byte of it
    assert r["copied"]["sync/bytes"] == r["copied"]["sync/engine_weight_bytes"] > 0, r["copied"]
    assert r["copied"]["sync/aliased_bytes"] == 0


def _stale_views_caught(hf_dir):
    from types import SimpleNamespace as NS

    import torch

    from rlstack.config import RolloutConfig
    from rlstack.rollout import sync_check
    from rlstack.rollout.verify_sync import perturb_weights, verify_engine

    groups, model, args = _actor(hf_dir)
    engine, sync = _engine_and_sync(hf_dir, groups, model, args, zero_copy=True)
    cfg = RolloutConfig(engine="hf", verify_sync=1, max_new_tokens=8, zero_copy=True)
    role, probe = NS(module=model, args=args), sync_check.probe_prompts([NS(input_ids=p) for p in PROMPTS])

    def rebind():  # what a checkpoint load or an offload round trip may do: new storage, same values
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()

    out = {}
    rebind()
    perturb_weights(model, args, groups)
    stats = sync.sync()  # notices the views point at the old storage and aliases again
    sync_check.after_sync(cfg, 0, stats, role, groups, engine, probe)
    out["realiased"] = stats.as_metrics()
    sync._aliases_hold = lambda: True  # plant the bug: the re-check is skipped
    rebind()
    perturb_weights(model, args, groups, seed=1)
    try:
        sync_check.after_sync(cfg, 4, sync.sync(), role, groups, engine, probe)
    except sync_check.SyncDivergenceError as err:
        out["planted"] = str(err)
    out["planted_probe"] = verify_engine(model, args, groups, engine, PROMPTS, tol=1e9)
    return out


def test_verify_sync_stops_stale_views(tiny_qwen2):
    """Actor parameters moved to new storage: the sync re-aliases; skipping that is caught by the probe."""
    (r,) = run_distributed(_stale_views_caught, 1, tiny_qwen2, timeout=120)
    stats = r["realiased"]
    assert stats["sync/bytes"] == 0 and stats["sync/engine_weight_bytes"] == 0, stats
    assert stats["sync/verify_max_diff"] <= TOL, stats
    # stale views read no actor storage (aliased bytes 0), and the probe disagrees too
    assert r.get("planted", "").startswith("step 5: rollout engine and actor disagree (the weight sync moved"), r
    assert r["planted_probe"] > 100 * TOL, r
