"""End-to-end on CPU: a tiny Qwen3 (q/k norms, head_dim 64 with hidden 128 / 4 heads, untied) learns with GRPO."""

import pytest

from tests.e2e.runs import read_metrics, torchrun_train, train_steps

pytestmark = pytest.mark.slow


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_tiny_qwen3_grpo_reward_rises(tmp_path, tiny_cache):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

    spec = TinySpec(arch="qwen3", head_dim=64, tie_word_embeddings=False)
    hf_dir = ensure_tiny_checkpoint(spec, cache_dir=tiny_cache)
    out = str(tmp_path / "qwen3")
    # TP2: the q/k norm weights are replicated, their gradients summed over TP (config.qk_layernorm)
    torchrun_train(out, [f"model.path={hf_dir}", "parallel.tp=2", "trainer.total_steps=30"])
    rows = train_steps(read_metrics(out))
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = _mean(rows[:5], "reward/mean"), _mean(rows[-10:], "reward/mean")
    assert last > first + 0.05 and last > 2 * first, (first, last)
    # the rollout engine samples from the actor's current weights (the q/k norms are synced too)
    assert max(r["actor/rollout_diff_max"] for r in rows) < 1e-4
