"""Shared prompts (model.prefix_sharing): the rows of a micro-batch that begin with the same prompt pack
it once (rlstack/workers/packing.py), RoPE rotates each answer from its row position (patch
shared_prefix_rope) and attention lets it see the prompt (megatron_bridge/sdpa_attention.py). The actor's
log-probs, the critic's values, both losses and one SGD step of each equal those of every row packed on
its own, at TP1 and TP2 on gloo ranks with the tiny Llama (tied head) and the tiny Qwen2 (untied head,
q/k/v biases); and the model saw each prompt once: T = the prompts once plus every row's own tokens."""

import pytest
import torch

from tests.dist_utils import run_distributed

# (prompt id, prompt length, response length): prompts 0 and 1 sampled 3 times, 2 and 3 once
ROWS = [(0, 5, 3), (1, 3, 9), (0, 5, 7), (2, 4, 2), (1, 3, 1), (0, 5, 4), (3, 6, 5), (1, 3, 6)]


def _rollout(vocab: int):
    from rlstack.workers.batch import Rollout

    gen = torch.Generator().manual_seed(5)
    prompts = {pid: torch.randint(1, vocab, (p,), generator=gen).tolist() for pid, p, _ in ROWS}
    responses = [torch.randint(1, vocab, (r,), generator=gen).tolist() for _, _, r in ROWS]
    logprobs = [[-1.0] * len(r) for r in responses]
    ids = [pid for pid, _, _ in ROWS]
    rollout = Rollout.build([prompts[i] for i in ids], responses, logprobs, [0.0] * 8, ids, 0, 2, "cpu", True)
    rollout.advantages = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    rollout.old_values = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    rollout.returns = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    return rollout


def _run(hf_dir: str, groups, shared: bool):
    from rlstack.config import AlgorithmConfig
    from rlstack.workers import packing
    from rlstack.workers.actor import Actor, compute_logprobs
    from rlstack.workers.critic import Critic
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    sgd = OptimSettings(optimizer="sgd", lr=0.5, clip_grad=0.0)
    actor_role = MegatronRole(hf_dir, groups, torch.float32, optim=sgd, fused_output=True)
    critic_role = MegatronRole(hf_dir, groups, torch.float32, value_head=True, optim=sgd)
    for role in (actor_role, critic_role):
        role.remove_padding = True
        assert role.share_prefixes(shared) == shared, "sharing is not available under the SDPA attention"
    seen = []  # packed tokens of every forward
    real_of = packing.PackedRows.of

    def logged(*args, **kwargs):
        p = real_of(*args, **kwargs)
        seen.append(p.tokens)
        return p

    packing.PackedRows.of = logged
    try:
        rollout = _rollout(actor_role.args.vocab_size)
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
    return _run(hf_dir, groups, True), _run(hf_dir, groups, False)


@pytest.mark.parametrize("tp", [1, 2])
def test_shared_prompts_equal_rows_on_their_own(tiny_llama, tiny_qwen2, tp):
    for hf_dir in (tiny_llama, tiny_qwen2) if tp == 1 else (tiny_llama,):
        for shared, alone in run_distributed(_both, tp, hf_dir, tp):
            needed = shared["needed"]
            assert needed == [p + r for _, p, r in ROWS]
            # each pass (log-probs, values, two updates) packs every prompt once in 2 micro-batches
            prompts_once = sum(r for _, _, r in ROWS) + sum({pid: p for pid, p, _ in ROWS}.values())
            assert len(shared["seen"]) == 8 and len(alone["seen"]) == 8
            for k in range(0, 8, 2):
                assert sum(shared["seen"][k : k + 2]) == prompts_once < sum(alone["seen"][k : k + 2]) == sum(needed)
            torch.testing.assert_close(shared["logprob"], alone["logprob"], atol=1e-5, rtol=0)
            torch.testing.assert_close(shared["values"], alone["values"], atol=1e-5, rtol=0)
            assert abs(shared["loss"] - alone["loss"]) < 1e-5
            assert abs(shared["critic_loss"] - alone["critic_loss"]) < 1e-5
            for name in ("actor", "critic"):
                torch.testing.assert_close(shared["weights"][name], alone["weights"][name], atol=1e-6, rtol=0)
