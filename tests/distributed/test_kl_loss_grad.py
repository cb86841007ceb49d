"""The KL loss term (`algorithm.use_kl_loss`) moves the actor, not only the logged loss.

On one gloo rank with the tiny Llama and a reference whose log-probs differ from the actor's, one
SGD step of `Actor.update`: `kl_loss_coef=0.5` and `0.0` give different weights; with zero
advantages (the KL term alone) the step lowers the KL to the reference and one at coefficient 1.0
moves the weights twice as far as one at 0.5. A KL term cut from the graph (`kl.detach()` in the
actor loss: the logged loss still right) fails each check.
"""

import torch

from tests.dist_utils import run_distributed

LR = 0.05  # small enough that one step lowers the KL (0.04 -> 0.011); 0.5 overshoots


def _rollout(vocab: int):
    from rlstack.workers.batch import Rollout

    gen = torch.Generator().manual_seed(11)
    lens = [(4, 6), (2, 9), (6, 5), (3, 12)]  # (prompt, response)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for p, _ in lens]
    responses = [torch.randint(1, vocab, (r,), generator=gen).tolist() for _, r in lens]
    logprobs = [[-1.0] * len(r) for r in responses]
    rollout = Rollout.build(prompts, responses, logprobs, [0.0] * 4, [0] * 4, 0, 2, "cpu", on_policy=True)
    advantages = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    ref_shift = (torch.rand(rollout.resp_mask.shape, generator=gen) - 0.5) * rollout.resp_mask  # [-0.5, 0.5)
    return rollout, advantages, ref_shift


def _kl(logprob, ref, mask):
    """k3 KL(actor || reference), the mean over response tokens (the estimator the loss uses)."""
    from rlstack.algorithms.kl import kl_estimate

    return float((kl_estimate(logprob, ref, "k3") * mask).sum() / mask.sum())


def _step(hf_dir, groups, coef: float, with_advantages: bool, lr: float):
    """One SGD step of a fresh actor -> its weights before and after, and the KL before and after."""
    from rlstack.config import AlgorithmConfig
    from rlstack.workers.actor import Actor, compute_logprobs
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    role = MegatronRole(hf_dir, groups, torch.float32, optim=OptimSettings(optimizer="sgd", lr=lr, clip_grad=0.0))
    rollout, advantages, ref_shift = _rollout(role.args.vocab_size)
    before = torch.cat([p.detach().flatten() for p in role.module.parameters()])
    actor_lp = compute_logprobs(role, rollout, 2)
    rollout.ref_logprob = (actor_lp + ref_shift) * rollout.resp_mask  # a reference that differs from the actor
    rollout.advantages = advantages if with_advantages else torch.zeros_like(advantages)
    counts = {"global_num_tokens": float(rollout.resp_mask.sum()), "global_num_seqs": 4.0}
    algo = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=coef, kl_loss_type="k3")
    stats = Actor(role, algo).update(rollout, counts, 2).stats
    after = torch.cat([p.detach().flatten() for p in role.module.parameters()])
    mask = rollout.resp_mask
    return {
        "move": after - before,
        "kl_before": _kl(actor_lp, rollout.ref_logprob, mask),
        "kl_after": _kl(compute_logprobs(role, rollout, 2), rollout.ref_logprob, mask),
        "kl_logged": sum(float(s["actor/kl_sum"]) for s in stats) / sum(float(s["actor/tokens"]) for s in stats),
    }


def _runs(hf_dir, lr=LR):
    from megatron_bridge.parallel import init_distributed

    groups = init_distributed(1, 1)
    return {
        "pg_kl": _step(hf_dir, groups, 0.5, True, lr),
        "pg": _step(hf_dir, groups, 0.0, True, lr),
        "kl_half": _step(hf_dir, groups, 0.5, False, lr),
        "kl_one": _step(hf_dir, groups, 1.0, False, lr),
    }


def test_kl_loss_coef_changes_the_update(tiny_llama):
    out = run_distributed(_runs, 1, tiny_llama)[0]
    pg_kl, pg, half, one = out["pg_kl"], out["pg"], out["kl_half"], out["kl_one"]
    assert pg_kl["kl_before"] > 0.02, "the reference must differ from the actor, or the KL has no gradient"
    assert abs(pg_kl["kl_logged"] - pg_kl["kl_before"]) < 1e-5  # the logged KL is the one the step starts from
    diff = (pg_kl["move"] - pg["move"]).abs().max().item()
    assert diff > 1e-4, f"kl_loss_coef=0.5 and 0.0 give the same update (max weight difference {diff:.1e})"
    # The KL term alone: the step goes towards the reference, and its length follows the coefficient.
    assert half["move"].abs().max() > 1e-4, "a KL-only step moved nothing"
    assert half["kl_after"] < half["kl_before"] - 1e-4, (half["kl_before"], half["kl_after"])
    torch.testing.assert_close(one["move"], 2 * half["move"], atol=1e-6, rtol=1e-4)
