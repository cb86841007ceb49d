"""Padding removal (model.remove_padding): a micro-batch's rows packed end to end (megatron's THD
format, rlstack/workers/packing.py) give the padded layout's results. The actor's log-probs (fused
LM head; an unfused head stays padded), the critic's values, the losses and one SGD step of each equal those of
[b, S] right-padded micro-batches, at TP1 and TP2 on gloo ranks with the tiny Llama (tied head) and
the tiny Qwen2 (untied head, q/k/v biases); and the model really saw one [1, T] row per micro-batch,
T the sum of its rows' needed lengths."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.test_micro_batch_cut import _rollout


def _run(hf_dir: str, groups, packed: bool, fused: bool, shared: bool = False, make_rollout=_rollout):
    """log-probs, values, both losses and weights after one SGD step of actor and critic (shared: rows that
    share a prompt pack it once, model.prefix_sharing; test_prefix_sharing.py), and what was packed."""
    from rlstack.config import AlgorithmConfig
    from rlstack.workers import packing
    from rlstack.workers.actor import Actor, compute_logprobs
    from rlstack.workers.critic import Critic
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    sgd = OptimSettings(optimizer="sgd", lr=0.5, clip_grad=0.0)
    actor_role = MegatronRole(hf_dir, groups, torch.float32, optim=sgd, fused_output=fused)
    critic_role = MegatronRole(hf_dir, groups, torch.float32, value_head=True, optim=sgd)
    for role in (actor_role, critic_role):
        role.remove_padding = packed
        assert role.share_prefixes(shared) == shared, "rows cannot share prompts under this attention"
    seen = []  # (rows, S, T) of every packed forward
    real_of = packing.PackedRows.of

    def logged(lengths, seq_len, device, *shared):
        p = real_of(lengths, seq_len, device, *shared)
        seen.append((p.rows, seq_len, p.tokens, int(lengths.clamp(min=1).sum())))
        return p

    packing.PackedRows.of = logged
    try:
        rollout = make_rollout(actor_role.args.vocab_size)
        mask = rollout.resp_mask > 0
        logprob = compute_logprobs(actor_role, rollout, 4)[mask]
        values = Critic(critic_role, AlgorithmConfig()).compute_values(rollout, 4)[mask]
        counts = {"global_num_tokens": float(rollout.resp_mask.sum()), "global_num_seqs": 8.0}
        out = Actor(actor_role, AlgorithmConfig(use_kl_loss=False, entropy_coeff=0.01)).update(rollout, counts, 4)
        critic_out = Critic(critic_role, AlgorithmConfig()).update(rollout, counts, 4)
    finally:
        packing.PackedRows.of = real_of
    weights = {
        name: torch.cat([p.detach().flatten() for p in role.module.parameters()])
        for name, role in (("actor", actor_role), ("critic", critic_role))
    }
    return {
        "logprob": logprob,
        "values": values,
        "weights": weights,
        "loss": sum(float(s["actor/loss"]) for s in out.stats),
        "critic_loss": sum(float(s["critic/loss"]) for s in critic_out.stats),
        "seen": seen,
        "needed": rollout.needed_lengths().tolist(),
    }


def _both(hf_dir: str, tp: int):
    from megatron_bridge.parallel import init_distributed

    groups = init_distributed(tp, 1)
    return {fused: (_run(hf_dir, groups, True, fused), _run(hf_dir, groups, False, fused)) for fused in (True, False)}


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_rows_equal_padded(tiny_llama, tiny_qwen2, tp):
    for hf_dir in (tiny_llama, tiny_qwen2):
        for rank_out in run_distributed(_both, tp, hf_dir, tp):
            for fused, (packed, padded) in rank_out.items():
                assert padded["seen"] == [], "the padded run packed"
                # 4 passes (log-probs, values, actor update, critic update) of 2 micro-batches (8 rows by 4);
                # an unfused actor stays padded (unpacking would copy its [b, S, V] logits)
                assert len(packed["seen"]) == (8 if fused else 4), packed["seen"]
                for rows, seq_len, tokens, needed in packed["seen"]:
                    assert tokens == needed < rows * seq_len  # one [1, T] row: T = the rows' needed lengths
                assert sum(x[2] for x in packed["seen"][:2]) == sum(max(1, n) for n in packed["needed"])
                assert_same_results(packed, padded)


def assert_same_results(a: dict, b: dict) -> None:
    """Two `_run`s agree: log-probs and values (1e-5), both losses, weights after the SGD step (1e-6)."""
    torch.testing.assert_close(a["logprob"], b["logprob"], atol=1e-5, rtol=0)
    torch.testing.assert_close(a["values"], b["values"], atol=1e-5, rtol=0)
    assert abs(a["loss"] - b["loss"]) < 1e-5
    assert abs(a["critic_loss"] - b["critic_loss"]) < 1e-5
    for name in ("actor", "critic"):
        torch.testing.assert_close(a["weights"][name], b["weights"][name], atol=1e-6, rtol=0)
