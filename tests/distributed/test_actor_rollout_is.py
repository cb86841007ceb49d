"""`Actor.update` with `algorithm.rollout_is=token` weights each token by min(exp(old - rollout), cap).

The engine's log-probs are set to the actor's own minus a known per-token delta, so every weight is
known before the update: min(exp(delta), cap). On one gloo rank with the tiny Llama, for the
on-policy update (old log-probs from the update's own forward) and the off-policy one (old log-probs
given): the logged `is/weight_mean`, `is/weight_max` and `is/clipped_frac` equal those of the known
weights, and the SGD step equals the step without IS on advantages multiplied by the same weights
(at ratio 1 the PPO gradient is linear in the advantage), and differs from the unweighted step.
A weight taken against the wrong log-prob (`rollout_is_weights(old, old, ...)`: every weight 1)
fails every check.
"""

import math

import torch

from tests.dist_utils import run_distributed

CAP = 2.0
LR = 0.5


def _rollout(vocab: int, on_policy: bool):
    from rlstack.workers.batch import Rollout

    gen = torch.Generator().manual_seed(5)
    lens = [(4, 3), (2, 9), (6, 5), (3, 12), (5, 2), (4, 7)]  # (prompt, response)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for p, _ in lens]
    responses = [torch.randint(1, vocab, (r,), generator=gen).tolist() for _, r in lens]
    logprobs = [[0.0] * len(r) for r in responses]  # replaced below, once the actor's are known
    rollout = Rollout.build(prompts, responses, logprobs, [0.0] * 6, [0] * 6, 0, 2, "cpu", on_policy=on_policy)
    rollout.advantages = torch.randn(rollout.resp_mask.shape, generator=gen) * rollout.resp_mask
    # delta = old - rollout per token, in [-0.6, 1.2): weights from 0.55 to 3.3, ln 2 ~ 0.69 truncates some
    delta = (torch.rand(rollout.resp_mask.shape, generator=gen) * 1.8 - 0.6) * rollout.resp_mask
    return rollout, delta


def _step(hf_dir, groups, on_policy: bool, rollout_is: str, advantage_scale=None):
    """One SGD step of a fresh actor -> (flat weights after it, its stats, the known delta)."""
    from rlstack.config import AlgorithmConfig
    from rlstack.workers.actor import Actor, compute_logprobs
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    role = MegatronRole(hf_dir, groups, torch.float32, optim=OptimSettings(optimizer="sgd", lr=LR, clip_grad=0.0))
    rollout, delta = _rollout(role.args.vocab_size, on_policy)
    old = compute_logprobs(role, rollout, 2)  # [B, S] the actor's own log-probs, 0 off the response
    rollout.rollout_logprob = (old - delta) * rollout.resp_mask
    if not on_policy:
        rollout.old_logprob = old
    if advantage_scale is not None:
        rollout.advantages = rollout.advantages * advantage_scale(delta)
    counts = {"global_num_tokens": float(rollout.resp_mask.sum()), "global_num_seqs": 6.0}
    algo = AlgorithmConfig(use_kl_loss=False, rollout_is=rollout_is, rollout_is_cap=CAP)
    stats = Actor(role, algo).update(rollout, counts, 2).stats
    weights = torch.cat([p.detach().flatten() for p in role.module.parameters()])
    return {"weights": weights, "stats": stats, "delta": delta, "mask": rollout.resp_mask > 0}


def _known_weights(delta):
    return delta.exp().clamp(max=CAP)


def _runs(hf_dir):
    from megatron_bridge.parallel import init_distributed

    groups = init_distributed(1, 1)
    out = {}
    for on_policy in (True, False):
        out[on_policy] = {
            "is": _step(hf_dir, groups, on_policy, "token"),
            "scaled": _step(hf_dir, groups, on_policy, "none", advantage_scale=_known_weights),
            "plain": _step(hf_dir, groups, on_policy, "none"),
        }
    return out


def _logged(stats):
    """The step's is/* metrics as the trainer logs them (sums over micro-batches, then is_metrics)."""
    from rlstack.algorithms import is_metrics

    sums = [sum(float(s[k]) for s in stats) for k in ("is/weight_sum", "is/clipped_sum", "is/units")]
    return is_metrics(*sums, max(float(s["is/weight_max"]) for s in stats))


def test_token_is_weights_are_logged_and_scale_the_gradient(tiny_llama):
    out = run_distributed(_runs, 1, tiny_llama)[0]
    for on_policy, runs in out.items():
        weighted = runs["is"]
        delta, mask = weighted["delta"], weighted["mask"]
        known = _known_weights(delta)[mask]  # [n] the weight of every response token
        assert known.min() < 0.7 and (known == CAP).any(), "the deltas must spread below 1 and past the cap"
        logged = _logged(weighted["stats"])
        expected = {
            "is/weight_mean": float(known.mean()),
            "is/weight_max": CAP,
            "is/clipped_frac": float((delta[mask] > math.log(CAP)).float().mean()),
        }
        for key, value in expected.items():
            assert abs(logged[key] - value) < 1e-4, f"on_policy={on_policy}: {key} {logged[key]} != {value}"
        # The gradient scales by the weights: IS on A == no IS on A * w, != no IS on A.
        step = weighted["weights"]
        torch.testing.assert_close(step, runs["scaled"]["weights"], atol=1e-6, rtol=0)
        moved = (step - runs["plain"]["weights"]).abs().max().item()
        assert moved > 1e-4, f"on_policy={on_policy}: the IS step equals the unweighted step ({moved:.1e})"
