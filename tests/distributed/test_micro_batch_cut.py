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
    loss = sum(float(s["actor/pg_loss"]) for s in out.stats)
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


def _response_only(hf_dir: str):
    """The actor with log-probs at response positions only (the default) and at every position."""
    from megatron_bridge.parallel import init_distributed
    from rlstack.config import AlgorithmConfig
    from rlstack.workers import actor as actor_mod
    from rlstack.workers import logprobs as logprobs_mod
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    groups = init_distributed(1, 1)
    every_position = actor_mod.read_positions
    rows_seen = []
    for name in ("fused_output_logprobs", "vocab_parallel_logprobs"):  # record the rows each computes
        real = getattr(logprobs_mod, name)

        def logged(x, *a, real=real, **k):
            rows_seen.append(x.reshape(-1, x.shape[-1]).shape[0])
            return real(x, *a, **k)

        setattr(actor_mod, name, logged)
    out = {}
    for fused in (True, False):
        for only_response in (True, False):
            actor_mod.read_positions = every_position if only_response else (lambda mask: torch.arange(mask.numel()))
            sgd = OptimSettings(optimizer="sgd", lr=0.5, clip_grad=0.0)
            role = MegatronRole(hf_dir, groups, torch.float32, optim=sgd, fused_output=fused)
            rollout = _rollout(role.args.vocab_size)
            rows_seen.clear()
            logprob = actor_mod.compute_logprobs(role, rollout, 2, temperature=0.7)
            rows = sum(rows_seen)
            counts = {"global_num_tokens": float(rollout.resp_mask.sum()), "global_num_seqs": 8.0}
            actor = actor_mod.Actor(role, AlgorithmConfig(use_kl_loss=False, entropy_coeff=0.01), temperature=0.7)
            stats = actor.update(rollout, counts, 2).stats
            out[fused, only_response] = {
                "logprob": logprob,
                "mask": rollout.resp_mask > 0,
                "rows": rows,
                "slots": int(rollout.tokens.numel()),
                "loss": sum(float(s["actor/loss"]) for s in stats),
                "entropy": sum(float(s["actor/entropy_sum"]) for s in stats),
                "weights": torch.cat([p.detach().flatten() for p in role.module.parameters()]),
            }
    return out


def test_logprobs_only_at_response_positions(tiny_llama):
    """The LM head and the log-softmax run only where a response token is scored (fused head and
    model logits alike): the same log-probs, loss, entropy and SGD step as at every position."""
    out = run_distributed(_response_only, 1, tiny_llama)[0]
    for fused in (True, False):
        some, every = out[fused, True], out[fused, False]
        mask = some["mask"]
        assert some["rows"] == int(mask.sum()) < every["rows"] <= every["slots"], (fused, some["rows"], every["rows"])
        assert (some["logprob"][~mask] == 0).all()
        torch.testing.assert_close(some["logprob"][mask], every["logprob"][mask], atol=1e-6, rtol=0)
        assert abs(some["loss"] - every["loss"]) < 1e-6 and abs(some["entropy"] - every["entropy"]) < 1e-4
        torch.testing.assert_close(some["weights"], every["weights"], atol=1e-6, rtol=0)
