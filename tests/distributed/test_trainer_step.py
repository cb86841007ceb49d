"""The trainer's step on spawned gloo ranks: batch sizes at every micro-batch boundary, the loss's
terms, and both roles actually stepping. (The e2e tier runs whole jobs; these call `train_step`.)"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed

CONFIG = "yaml_configs/tiny_cpu.yaml"


def _trainer(overrides: list[str], out_dir: str, cache: str):
    from rlstack.config import load_config
    from rlstack.trainer import build_trainer

    cfg = load_config(
        CONFIG, [f"trainer.output_dir={out_dir}", f"model.cache_dir={cache}", "logging.progress=false", *overrides]
    )
    return cfg, build_trainer(cfg, _groups(cfg))


_GROUPS = {}


def _groups(cfg):
    from megatron_bridge.parallel import init_distributed

    if "g" not in _GROUPS:
        p = cfg.parallel
        _GROUPS["g"] = init_distributed(p.tp, p.pp, p.dp, "gloo", 5, seed=cfg.trainer.seed)
    return _GROUPS["g"]


def _flat(role):
    import torch

    return torch.cat([p.detach().float().flatten().cpu() for p in role.module.parameters()])


def _batch_sizes(out_dir, cache):
    """One step per (prompts, micro-batch) pair: 16 samples a prompt, two data-parallel ranks."""
    import math

    cases = [
        ("fewer rows than one micro-batch", ["data.train_batch_size=4"]),  # 32 rows a rank, micro-batch 128
        ("one prompt a rank", ["data.train_batch_size=2", "algorithm.micro_batch_size=32"]),  # 16 rows
        ("not a multiple", ["data.train_batch_size=6", "algorithm.micro_batch_size=32"]),  # 48 rows a rank
        ("exactly one micro-batch", ["data.train_batch_size=4", "algorithm.micro_batch_size=32"]),
        ("ppo, fewer rows than one micro-batch", ["data.train_batch_size=2", "algorithm.name=ppo"]),
        # token-budget micro-batches: each DP rank runs its own number of them
        (
            "ppo, token budget",
            ["data.train_batch_size=6", "algorithm.name=ppo", "algorithm.max_tokens_per_micro_batch=64"],
        ),
    ]
    out = {}
    for name, overrides in cases:
        _, trainer = _trainer(overrides, out_dir, cache)
        metrics = trainer.train_step()
        assert all(math.isfinite(v) for k, v in metrics.items() if isinstance(v, float)), (name, metrics)
        out[name] = metrics["reward/mean"]
        trainer.engine.close()
    return out


def test_any_batch_size_trains(tmp_path, tiny_cache):
    results = run_distributed(_batch_sizes, 2, str(tmp_path), tiny_cache, timeout=300)
    assert results[0] == results[1]  # every rank reports the same step metrics
    assert len(results[0]) == 6


def _decode_metrics(out_dir, cache):
    """Two steps whose sync check generates a probe batch (greedy, 5 decode steps) before each rollout."""
    overrides = ["rollout.max_new_tokens=6", "rollout.verify_sync=1", "data.train_batch_size=4"]
    _, trainer = _trainer(overrides, out_dir, cache)
    steps = [trainer.train_step() for _ in range(2)]
    trainer.engine.close()
    return [{k: v for k, v in m.items() if k.startswith("rollout/decode")} for m in steps]


def test_decode_metrics_are_the_rollouts_own(tmp_path, tiny_cache):
    """The step logs how full its rollout's decode steps ran (hf engine), not the probe's or validation's."""
    for metrics in run_distributed(_decode_metrics, 2, str(tmp_path), tiny_cache, timeout=300):
        for m in metrics:  # 4 prompts x 16 samples over 2 ranks: 32 rows a rank, one generate() each
            assert 1 <= m["rollout/decode_steps"] <= 5, m  # at most max_new_tokens - 1: the probe's are not in it
            assert 0 < m["rollout/decode_live_share"] <= 1 and 1 <= m["rollout/decode_rows_mean"] <= 32, m


def _ppo_step(out_dir, cache):
    """One PPO step: (actor changed, critic changed, loss terms of the step)."""
    import torch

    cfg, trainer = _trainer(["algorithm.name=ppo", "algorithm.kl_loss_coef=0.5", "trainer.seed=3"], out_dir, cache)
    # A reference that differs from the actor, so the KL term is not 0 at the first step.
    with torch.no_grad():
        for p in trainer.ref.module.parameters():
            p.add_(0.01 * torch.randn_like(p))
    actor0, critic0 = _flat(trainer.actor.role), _flat(trainer.critic.role)
    m = trainer.train_step()
    a_delta = (_flat(trainer.actor.role) - actor0).abs().max().item()
    c_delta = (_flat(trainer.critic.role) - critic0).abs().max().item()
    return (
        a_delta,
        c_delta,
        {k: v for k, v in m.items() if k.startswith(("actor/", "mem/"))},
        cfg.algorithm.kl_loss_coef,
    )


def test_ppo_step_moves_both_roles_and_loss_has_its_kl_term(tmp_path, tiny_cache):
    a_delta, c_delta, m, coef = run_distributed(_ppo_step, 1, str(tmp_path), tiny_cache, timeout=240)[0]
    assert a_delta > 1e-6, "the actor did not step"
    assert c_delta > 1e-6, "the critic did not step"
    assert m["actor/kl"] > 1e-4
    # Machine-independent: the logged loss is the policy loss plus the weighted KL loss.
    assert m["actor/loss"] == pytest.approx(m["actor/pg_loss"] + coef * m["actor/kl"], rel=1e-5, abs=1e-9)
    # Each phase of the step reports this rank's peak memory (the update holds activations).
    phases = {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith("mem/peak_gib/")}
    assert set(phases) == {"sync", "rollout", "scoring", "update", "idle"}
    assert all(v > 0.1 for v in phases.values()) and phases["update"] > phases["idle"]


# ----------------------------------------------------------------------------- injected parts, fake engine


class _ScriptedEngine:
    """A rollout engine whose j-th sample of every prompt is the digit j, with log-prob -1."""

    kind, tp_size, tp_rank = "fake", 1, 0

    def __init__(self, digit_ids: list[int]):
        self.digit_ids, self.calls = digit_ids, 0

    def generate(self, prompts, params):
        from rlstack.rollout.base import Generation

        self.calls += 1
        return [
            Generation(
                prompt_index=i,
                prompt_ids=list(p),
                response_ids=[self.digit_ids[j]],
                logprobs=[-1.0],
                finish_reason="length",
            )
            for i, p in enumerate(prompts)
            for j in range(params.n)
        ]

    def metrics(self):  # RolloutEngine.metrics: counters since the last call (none kept here)
        return {}

    def close(self):
        pass


class _NoSync:
    def sync(self):
        from megatron_bridge.reshard import SyncStats

        return SyncStats(bytes=1)


def _one_step_with_fake_engine(out_dir, cache):
    """Trainer(cfg, groups, parts) with tiny real roles and a scripted engine: one train_step."""
    import dataclasses

    from rlstack.trainer import Trainer

    cfg, real = _trainer(["data.train_batch_size=2", "algorithm.micro_batch_size=8", "rollout.n=10"], out_dir, cache)
    real.engine.close()
    engine = _ScriptedEngine([real.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)])
    parts = dataclasses.replace(_parts_of(real), engine=engine, weight_sync=_NoSync())
    trainer = Trainer(cfg, real.groups, parts)
    before = _flat(trainer.actor.role)
    metrics = trainer.train_step()
    return {
        "calls": engine.calls,
        "step": trainer.step,
        "reward": metrics["reward/mean"],
        "length": metrics["response/length_mean"],
        "moved": (_flat(trainer.actor.role) - before).abs().max().item(),
        "rollout_diff": metrics.get("actor/rollout_diff_max"),
        "state": trainer.checkpoint_parts().step,
    }


def _parts_of(trainer):
    from rlstack.trainer import TrainerParts

    return TrainerParts(
        trainer.hf_dir,
        trainer.tokenizer,
        trainer.train_set,
        trainer.val_set,
        trainer.sampler,
        trainer.scorer,
        trainer.actor,
        trainer.ref,
        trainer.critic,
        trainer.engine,
        trainer.weight_sync,
        trainer.kl_ctrl,
    )


def test_train_step_runs_on_injected_parts_with_a_fake_engine(tmp_path, tiny_cache):
    out = run_distributed(_one_step_with_fake_engine, 1, str(tmp_path), tiny_cache, timeout=240)[0]
    assert out["calls"] == 1 and out["step"] == 1 and out["state"] == 1
    assert out["length"] == 1.0  # every response is the one scripted token
    # The copy task's answer is the digit shown: exactly one of the ten scripted samples of a prompt is right.
    assert out["reward"] == 0.1, out
    assert out["moved"] > 0  # the actor stepped on the scripted samples
    assert out["rollout_diff"] > 0.1  # the scripted -1.0 log-probs are not the actor's: the check sees it


# ----------------------------------------------------------------------------- cache entries built by any rank


def _build_on_rank1(cache):
    """With torch.distributed up, only rank 1 builds the tiny checkpoint (rank 0 waits for it)."""
    import os

    import torch.distributed as dist

    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        ensure_tiny_checkpoint(TinySpec(seed=123), cache_dir=cache)
    dist.barrier()
    path = ensure_tiny_checkpoint(TinySpec(seed=123), cache_dir=cache)
    return sorted(os.listdir(path))


def test_a_cache_entry_built_on_rank_1_is_complete(tmp_path):
    # transformers 5 writes save_pretrained's weights on torch.distributed rank 0 only: a rank-1 build
    # once published the tokenizer files alone (megatron_bridge.atomic.save_pretrained_here).
    files = run_distributed(_build_on_rank1, 2, str(tmp_path / "cache"), timeout=180)
    assert files[0] == files[1]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files[0]), files[0]
