"""Split placement weight sync on 3 gloo ranks: training ranks 0-1 (TP2 or PP2) -> rollout rank 2.

The rollout rank's hf engine is wiped to NaN and the Megatron weights are perturbed before the sync
(`verify_sync.perturb_weights`), so only a sync that writes every engine tensor from the current
shards makes the engine's greedy log-probs agree with the actor's forward of the same tokens.
"""

import pytest

from tests.dist_utils import run_distributed

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [30, 31]]
TOL = 1e-4


def _split_sync(hf_dir, tp, pp):
    import torch

    from megatron_bridge.hf import build_megatron_from_hf, read_model_args
    from megatron_bridge.parallel import destroy_distributed, init_split_distributed
    from megatron_bridge.reshard import SplitWeightSync
    from megatron_bridge.verify import megatron_logits
    from rlstack import collectives
    from rlstack.config import RolloutConfig
    from rlstack.placement import rollout_side_groups
    from rlstack.rollout.base import SamplingParams, build_engine
    from rlstack.rollout.verify_sync import perturb_weights

    groups, placement = init_split_distributed(tp, pp, -1, 1, "gloo", 2)
    cpu = torch.device("cpu")
    layout = (tp, pp, placement.num_train // (tp * pp))
    try:
        if placement.is_rollout:
            rgroups = rollout_side_groups(placement, cpu)
            engine = build_engine(RolloutConfig(engine="hf", micro_batch_size=8), hf_dir, rgroups, 2, 2)
            with torch.no_grad():
                for t in engine.param_targets().values():
                    t.fill_(float("nan"))
            sync = SplitWeightSync(None, engine, read_model_args(hf_dir), placement, layout, None, 1, bucket_mb=0.25)
            stats = sync.sync()
            gens = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=8))
            rows = [(g.prompt_ids, g.response_ids, g.logprobs) for g in gens]
            collectives.broadcast_object(rows, placement.rank, placement.full, cpu)
            return {"stats": stats.as_metrics(), "buckets": len(sync.buckets)}
        model, args = build_megatron_from_hf(hf_dir, groups)
        perturb_weights(model, args, groups)
        sync = SplitWeightSync(
            model, None, args, placement, layout, (groups.dp_rank, groups.tp_rank, groups.pp_rank), 1, bucket_mb=0.25
        )
        sync.sync()
        rows = collectives.broadcast_object(None, placement.num_train, placement.full, cpu)
        width = max(len(p) + len(r) for p, r, _ in rows)
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)
        for b, (p, r, _) in enumerate(rows):
            input_ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        logprobs = torch.log_softmax(megatron_logits(model, input_ids, groups, args.vocab_size), dim=-1)
        worst = 0.0
        for b, (p, r, lp) in enumerate(rows):
            steps = torch.arange(len(p) - 1, len(p) - 1 + len(r))
            actor = logprobs[b, steps, torch.tensor(r)].double()
            worst = max(worst, float((actor - torch.tensor(lp, dtype=torch.float64)).abs().max()))
        return {"diff": worst}
    finally:
        destroy_distributed()


@pytest.mark.parametrize("ckpt,tp,pp", [("tiny_qwen2", 2, 1), ("tiny_llama", 1, 2)])
def test_split_sync_training_layout_to_rollout_rank(request, ckpt, tp, pp):
    hf_dir = request.getfixturevalue(ckpt)
    results = run_distributed(_split_sync, 3, hf_dir, tp, pp)
    trainers, rollout = results[:2], results[2]
    for r in trainers:
        assert r["diff"] <= TOL, r  # NaN (a tensor left unwritten) fails too
    assert rollout["buckets"] > 2 and rollout["stats"]["sync/bytes"] > 0
