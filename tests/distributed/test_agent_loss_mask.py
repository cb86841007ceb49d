"""Only the policy's tokens train (issue 35): the agent samples' response_mask is the Rollout's loss mask.

On one gloo rank with the tiny Llama:
- the ids the actor trains on are the engine's ids and the loop's inserted ids, in order, and the
  loss mask (`Rollout.resp_mask`) is 0 exactly on the inserted ids (a two-turn loop through
  `stages.generate` with the agent driver over the hf engine, then `stages.build_rollout`);
- one SGD step of `Actor.update` (policy loss, entropy bonus, KL loss, off-policy ratio): perturbing
  the inserted tokens' advantages, old / reference / engine log-probs moves the weights exactly as
  before; perturbing one policy token's advantage moves them differently;
- one SGD step of `Critic.update`: perturbing the inserted tokens' returns and old values moves
  the critic exactly as before; one policy token's return moves it differently;
- GAE's advantages and returns on the policy tokens ignore the values and rewards at inserted
  tokens; `actor/rollout_diff_max` ignores engine log-probs at inserted tokens.
TP1 only (the Rollout is built the same way on every TP/PP rank of a DP rank).
"""

import torch

from tests.dist_utils import run_distributed

# (prompt, response, mask): inserted runs (0) inside and at the end of the responses
LAYOUT = [
    (4, [1, 1, 1, 0, 0, 0, 1, 1]),
    (2, [1, 1, 1, 1, 1, 1, 1, 1, 1]),
    (6, [1, 0, 0, 1, 1]),
    (3, [1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0]),
]


def _rollout(vocab: int):
    from rlstack.workers.batch import Rollout

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for p, _ in LAYOUT]
    responses = [torch.randint(1, vocab, (len(m),), generator=gen).tolist() for _, m in LAYOUT]
    logprobs = [[-1.0 if b else 0.0 for b in m] for _, m in LAYOUT]
    masks = [m for _, m in LAYOUT]
    rollout = Rollout.build(prompts, responses, logprobs, [0.0] * 4, [0] * 4, 0, 2, "cpu", False, loss_masks=masks)
    inserted = torch.zeros_like(rollout.resp_mask)
    for row, (p, m) in enumerate(LAYOUT):
        inserted[row, p : p + len(m)] = torch.tensor([1.0 - b for b in m])
    return rollout, inserted, gen


def _move(hf_dir, groups, perturb: str):
    """One SGD step of a fresh actor on the rollout, with one field perturbed: the weights' move."""
    from rlstack.config import AlgorithmConfig
    from rlstack.workers.actor import Actor, compute_logprobs
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    torch.manual_seed(0)
    role = MegatronRole(hf_dir, groups, torch.float32, optim=OptimSettings(optimizer="sgd", lr=0.05, clip_grad=0.0))
    rollout, inserted, gen = _rollout(role.args.vocab_size)
    lp = compute_logprobs(role, rollout, 2)
    shift = (torch.rand(lp.shape, generator=gen) - 0.5) * 0.2
    rollout.old_logprob = lp + shift  # off policy: the ratio and the clip are exercised
    rollout.rollout_logprob = lp - shift
    rollout.ref_logprob = lp + 0.3 * shift
    rollout.advantages = torch.randn(lp.shape, generator=gen) * rollout.resp_mask
    noise = torch.randn(lp.shape, generator=gen) * 3.0 * inserted  # only where the loop inserted
    if perturb == "inserted":
        for name in ("advantages", "old_logprob", "ref_logprob", "rollout_logprob"):
            setattr(rollout, name, getattr(rollout, name) + noise)
    elif perturb == "policy":
        rollout.advantages[0, 4] += 1.0  # row 0's first response token (a policy token)
    before = torch.cat([p.detach().flatten() for p in role.module.parameters()])
    counts = {"global_num_tokens": float(rollout.resp_mask.sum()), "global_num_seqs": 4.0}
    algo = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.5, entropy_coeff=0.01, rollout_is="token")
    Actor(role, algo).update(rollout, counts, 2)
    return torch.cat([p.detach().flatten() for p in role.module.parameters()]) - before


def _gradients(hf_dir):
    from megatron_bridge.parallel import init_distributed

    groups = init_distributed(1, 1)
    return {k: _move(hf_dir, groups, k) for k in ("base", "inserted", "policy")}


def test_inserted_tokens_move_no_weight_and_policy_tokens_do(tiny_llama):
    out = run_distributed(_gradients, 1, tiny_llama)[0]
    assert out["base"].abs().max() > 0
    assert torch.equal(out["inserted"], out["base"]), "a perturbation on inserted tokens changed the update"
    assert (out["policy"] - out["base"]).abs().max() > 1e-6, "a policy token's advantage must move the weights"


def _critic_move(hf_dir, groups, perturb: str):
    """One SGD step of a fresh critic (clipped value loss) with one field perturbed: the weights' move."""
    from rlstack.config import AlgorithmConfig
    from rlstack.workers.critic import Critic
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    torch.manual_seed(0)
    sgd = OptimSettings(optimizer="sgd", lr=0.05, clip_grad=0.0)
    role = MegatronRole(hf_dir, groups, torch.float32, value_head=True, optim=sgd)
    rollout, inserted, gen = _rollout(role.args.vocab_size)
    critic = Critic(role, AlgorithmConfig(value_clip=0.2))
    rollout.old_values = critic.compute_values(rollout, 2)
    rollout.returns = rollout.old_values + torch.randn(rollout.old_values.shape, generator=gen) * rollout.resp_mask
    noise = torch.randn(rollout.old_values.shape, generator=gen) * 3.0 * inserted
    if perturb == "inserted":
        rollout.returns = rollout.returns + noise
        rollout.old_values = rollout.old_values + noise
    elif perturb == "policy":
        rollout.returns[0, 4] += 1.0
    before = torch.cat([p.detach().flatten() for p in role.module.parameters()])
    counts = {"global_num_tokens": float(rollout.resp_mask.sum()), "global_num_seqs": 4.0}
    critic.update(rollout, counts, 2)
    return torch.cat([p.detach().flatten() for p in role.module.parameters()]) - before


def _critic_runs(hf_dir):
    from megatron_bridge.parallel import init_distributed

    groups = init_distributed(1, 1)
    return {k: _critic_move(hf_dir, groups, k) for k in ("base", "inserted", "policy")}


def test_value_loss_ignores_inserted_tokens(tiny_llama):
    out = run_distributed(_critic_runs, 1, tiny_llama)[0]
    assert out["base"].abs().max() > 0
    assert torch.equal(out["inserted"], out["base"]), "a return or value on inserted tokens changed the critic"
    assert (out["policy"] - out["base"]).abs().max() > 1e-6, "a policy token's return must move the critic"


def test_mask_zero_exactly_on_inserted_and_gae_and_agreement_ignore_them():
    from rlstack.algorithms.advantages import compute_advantages, place_at_last_token

    rollout, inserted, gen = _rollout(100)
    response = torch.zeros_like(inserted)
    for row, (p, m) in enumerate(LAYOUT):
        response[row, p : p + len(m)] = 1.0
    assert torch.equal(rollout.resp_mask, response * (1 - inserted))
    mask = rollout.resp_mask
    rewards = place_at_last_token(torch.tensor([1.0, -1.0, 0.5, 2.0]), mask)
    assert torch.equal(rewards.nonzero()[:, 1], torch.tensor([11, 10, 10, 12]))  # the last policy tokens
    values = torch.randn(mask.shape, generator=gen)
    kw = dict(mask=mask, group_ids=torch.zeros(4, dtype=torch.long), gamma=0.9, lam=0.8)
    adv, ret = compute_advantages("gae", token_rewards=rewards, values=values, **kw)
    noisy = values + torch.randn(mask.shape, generator=gen) * inserted
    adv2, ret2 = compute_advantages("gae", token_rewards=rewards + inserted, values=noisy, **kw)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert torch.equal(adv * (1 - mask), torch.zeros_like(adv))


def _agreement():
    from megatron_bridge.parallel import init_distributed
    from rlstack.step.metrics import engine_agreement

    groups = init_distributed(1, 1)
    rollout, inserted, gen = _rollout(100)
    rollout.old_logprob = rollout.rollout_logprob + 1e-3 * rollout.resp_mask
    clean = engine_agreement(rollout, groups)
    rollout.rollout_logprob = rollout.rollout_logprob + 5.0 * inserted
    return clean, engine_agreement(rollout, groups)


def test_rollout_diff_is_measured_on_policy_tokens_only():
    clean, noisy = run_distributed(_agreement, 1)[0]
    assert abs(clean["actor/rollout_diff_max"] - 1e-3) < 1e-6
    assert noisy == clean
