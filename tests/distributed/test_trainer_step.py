"""The trainer's step on spawned gloo ranks: batch sizes at every micro-batch boundary, the loss's
terms, and both roles actually stepping. (The e2e tier runs whole jobs; these call `train_step`.)"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed

CONFIG = "yaml_configs/tiny_cpu.yaml"


def _trainer(overrides: list[str], out_dir: str, cache: str):
    from rlstack.config import load_config
    from rlstack.trainer import Trainer

    cfg = load_config(CONFIG, [f"trainer.output_dir={out_dir}", f"model.cache_dir={cache}",
                               "logging.progress=false", *overrides])
    return cfg, Trainer(cfg, _groups(cfg))


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
    assert len(results[0]) == 5


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
    return a_delta, c_delta, {k: m[k] for k in ("actor/loss", "actor/pg_loss", "actor/kl")}, cfg.algorithm.kl_loss_coef


def test_ppo_step_moves_both_roles_and_loss_has_its_kl_term(tmp_path, tiny_cache):
    a_delta, c_delta, m, coef = run_distributed(_ppo_step, 1, str(tmp_path), tiny_cache, timeout=240)[0]
    assert a_delta > 1e-6, "the actor did not step"
    assert c_delta > 1e-6, "the critic did not step"
    assert m["actor/kl"] > 1e-4
    # Machine-independent: the logged loss is the policy loss plus the weighted KL loss.
    assert m["actor/loss"] == pytest.approx(m["actor/pg_loss"] + coef * m["actor/kl"], rel=1e-5, abs=1e-9)
