"""Cutting micro-batches to their own longest row, or filling them up to a token budget
(algorithm.max_tokens_per_micro_batch), changes no result: the actor's log-probs, the critic's values
and one training step equal the uncut ones (rows in order, padded to the batch's longest), on one
gloo rank with the tiny Llama."""

import torch

from tests.dist_utils import run_distributed


def _rollout(vocab: int):
    from rlstack.workers.batch import Rollout

    gen = torch.Generator().manual_seed(3)
    lens = [(4, 1), (2, 9), (6, 3), (3, 12), (5, 2), (4, 7), (2, 2), (6, 10)]  # (prompt, response)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for p, _ in lens]
    responses = [torch.randint(1, vocab, (r,), generator=gen).tolist() for _, r in lens]
    logprobs = [[-1.0] * len(r) for r in responses]
    rollout = Rollout.build(prompts, responses, logprobs, [0.0] * 8, [0] * 8, 0, 2, "cpu", on_policy=True)
    rollout.advantages = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    rollout.old_values = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    rollout.returns = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    return rollout


def _run(hf_dir: str, groups, cut: bool, max_tokens: int = 0):
    from rlstack.config import AlgorithmConfig
    from rlstack.workers.actor import Actor, compute_logprobs
    from rlstack.workers.batch import pack_micro_batches
    from rlstack.workers.critic import Critic
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    sgd = OptimSettings(optimizer="sgd", lr=0.5, clip_grad=0.0)
    actor_role = MegatronRole(hf_dir, groups, torch.float32, optim=sgd)
    critic_role = MegatronRole(hf_dir, groups, torch.float32, value_head=True, optim=sgd)
    shapes = []
    for role in (actor_role, critic_role):
        role.max_tokens_per_micro_batch = max_tokens
        if not cut:  # the layout before: rows in order, every micro-batch padded to the batch's longest
            role.micro_batches = lambda batch, size, lengths: pack_micro_batches(batch, size, None)
        real = role.micro_batches

        def logged(batch, size, lengths, real=real):
            mbs = real(batch, size, lengths)
            shapes.append([tuple(mb["tokens"].shape) for mb in mbs.batches])
            return mbs

        role.micro_batches = logged
    rollout = _rollout(actor_role.args.vocab_size)
    mask = rollout.resp_mask > 0
    logprob = compute_logprobs(actor_role, rollout, 2)[mask]
    values = Critic(critic_role, AlgorithmConfig()).compute_values(rollout, 2)[mask]
    counts = {"global_num_tokens": float(rollout.resp_mask.sum()), "global_num_seqs": 8.0}
    out = Actor(actor_role, AlgorithmConfig(use_kl_loss=False)).update(rollout, counts, 2)
    Critic(critic_role, AlgorithmConfig()).update(rollout, counts, 2)
    weights = {
        name: torch.cat([p.detach().flatten() for p in role.module.parameters()])
        for name, role in (("actor", actor_role), ("critic", critic_role))
    }
    loss = sum(float(s["actor/pg_loss"]) for s in out["stats"])
    return {"logprob": logprob, "values": values, "weights": weights, "loss": loss, "shapes": shapes}


def _both(hf_dir: str):
    from megatron_bridge.parallel import init_distributed

    groups = init_distributed(1, 1)
    return _run(hf_dir, groups, cut=True), _run(hf_dir, groups, cut=False), _run(hf_dir, groups, True, 40)


def test_cut_micro_batches_equal_uncut(tiny_llama):
    cut, uncut, budget = run_distributed(_both, 1, tiny_llama)[0]
    # The cut layout really is smaller: 8 rows of at most 16 tokens in micro-batches of 2.
    assert all(shape == (2, 16) for shapes in uncut["shapes"] for shape in shapes)
    assert sum(r * s for r, s in cut["shapes"][0]) < sum(r * s for r, s in uncut["shapes"][0])
    torch.testing.assert_close(cut["logprob"], uncut["logprob"], atol=1e-5, rtol=0)
    torch.testing.assert_close(cut["values"], uncut["values"], atol=1e-5, rtol=0)
    assert abs(cut["loss"] - uncut["loss"]) < 1e-5
    for name in ("actor", "critic"):
        torch.testing.assert_close(cut["weights"][name], uncut["weights"][name], atol=1e-6, rtol=0)
    # A 40-slot budget: rows of 16, 15, 11, 11, 9, 7, 5, 4 tokens -> 2 x 16, 3 x 11, 3 x 7 (a count
    # of micro-batches of its own: the loss scale follows it).
    assert budget["shapes"][0] == [(2, 16), (3, 11), (3, 7)]
    torch.testing.assert_close(budget["logprob"], uncut["logprob"], atol=1e-5, rtol=0)
    torch.testing.assert_close(budget["values"], uncut["values"], atol=1e-5, rtol=0)
    assert abs(budget["loss"] - uncut["loss"]) < 1e-5
    for name in ("actor", "critic"):
        torch.testing.assert_close(budget["weights"][name], uncut["weights"][name], atol=1e-6, rtol=0)
