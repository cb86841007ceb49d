"""Actor and reference: log-probs over megatron's schedule, and the PPO policy update.

Token layout (all [B, S] tensors): `tokens` right-padded prompt+response; `resp_mask[b, t]` = 1 where
token t is a response token; `logprob[b, t]` = log p(tokens[b, t] | tokens[b, <t]).
"""

from __future__ import annotations

import functools

import torch

from rlstack.algorithms import agg_loss, compute_policy_loss, kl_loss, rollout_is_weights
from rlstack.algorithms.names import loss_params
from rlstack.config import AlgorithmConfig
from rlstack.workers.batch import Rollout
from rlstack.workers.logprobs import align_to_tokens, fused_output_logprobs, shift_targets, vocab_parallel_logprobs
from rlstack.workers.megatron_role import MegatronRole, UpdateResult


def token_logprobs(
    role: MegatronRole,
    mb: dict,
    logits: torch.Tensor,
    with_entropy: bool = False,
    temperature: float = 1.0,
    with_sum_pi_squared: bool = False,
):
    """logits [b, S, V/tp] of a micro-batch (with `role.fused_output`: the LM head's input [b, S, h])
    -> token-aligned logprob [b, S] (+ entropy [b, S]) (+ sum_pi_squared [b, S]: sum_v p_v^2 of the
    distribution token t was drawn from, for optimal_token_baseline).

    Log-probs are of the distribution the rollout sampled from (logits / temperature), as in verl,
    so the importance ratio compares like with like. When the micro-batch carries `resp_mask`, only
    the positions that score a response token are computed (`read_positions`); the others are 0.
    """
    g = role.groups
    # The temperature is applied inside, chunk by chunk: `logits.float() / T` here would be a full
    # fp32 [b, S, V/tp] copy (and the autograd graph would keep it).
    if role.fused_output:  # the LM head's matmul happens inside, chunk by chunk
        main_grad = role.output_main_grad() if torch.is_grad_enabled() else None
        fn = functools.partial(fused_output_logprobs, weight=role.output_weight(), main_grad=main_grad)
    else:
        fn = vocab_parallel_logprobs
    targets = shift_targets(mb["tokens"])  # [b, S]
    rows = read_positions(mb["resp_mask"]) if "resp_mask" in mb else None
    if rows is not None:  # [n, h or V/tp] and [n]: the rows whose log-prob is read
        lead = targets.shape
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, rows)
        targets = targets.reshape(-1).index_select(0, rows)
    out = fn(
        logits,
        targets=targets,
        vocab_size=role.args.vocab_size,
        tp_group=g.tp,
        tp_rank=g.tp_rank,
        tp_size=g.dims.tp,
        with_entropy=with_entropy,
        temperature=temperature,
        with_sum_pi_squared=with_sum_pi_squared,
    )
    out = out if isinstance(out, tuple) else (out,)
    if rows is not None:
        out = tuple(_scatter_rows(x, rows, lead) for x in out)
    out = tuple(align_to_tokens(x) for x in out)
    return out if len(out) > 1 else out[0]


def read_positions(resp_mask: torch.Tensor) -> torch.Tensor:
    """resp_mask [b, S] -> flat indices [n] of the positions t whose log-prob is read: t scores token t+1,
    a response token. The LM head (6 x hidden x vocab FLOPs a position with its backward, a quarter of
    SmolLM2's) then runs on the response, not on the prompt and padding, as TRL's `logits_to_keep`.
    Never empty (one unread position keeps the output attached to the graph)."""
    rows = (shift_targets(resp_mask) > 0).reshape(-1).nonzero().squeeze(-1)
    return rows if rows.numel() else rows.new_zeros(1)


def _scatter_rows(values: torch.Tensor, rows: torch.Tensor, shape) -> torch.Tensor:
    """values [n] at flat positions `rows` of a zero [b, S] tensor (differentiable in values)."""
    full = values.new_zeros(shape.numel())
    return full.index_copy(0, rows, values).view(shape)


def compute_logprobs(
    role: MegatronRole,
    rollout: Rollout,
    micro_batch_size: int,
    temperature: float = 1.0,
    with_sum_pi_squared: bool = False,
):
    """Forward-only log-probs [B, S] of `rollout`'s tokens, on every pipeline stage; with
    `with_sum_pi_squared`, (log-probs, sum_pi_squared [B, S]) from the same forward."""
    keys = ("logprob", "sum_pi_squared") if with_sum_pi_squared else ("logprob",)

    def loss_fn(mb, logits):
        out = token_logprobs(role, mb, logits, temperature=temperature, with_sum_pi_squared=with_sum_pi_squared)
        return torch.zeros((), device=logits.device), dict(zip(keys, out if with_sum_pi_squared else (out,)))

    mbs = role.micro_batches(
        rollout.tensors("tokens", "position_ids", "resp_mask"), micro_batch_size, rollout.needed_lengths()
    )
    stats = role.run(mbs.batches, loss_fn, forward_only=True)
    outs = tuple(
        role.broadcast_from_last_stage(
            mbs.rows(stats, key) if role.groups.is_last_stage else None, rollout.tokens.shape, torch.float32
        )
        for key in keys
    )
    return outs if with_sum_pi_squared else outs[0]


# What the policy loss reads of a mini-batch (the critic's fields stay out of its micro-batches).
ACTOR_FIELDS = ("tokens", "position_ids", "resp_mask", "advantages", "rollout_logprob", "old_logprob", "ref_logprob")


class Actor:
    def __init__(self, role: MegatronRole, algo: AlgorithmConfig, temperature: float = 1.0):
        self.role = role
        self.algo = algo
        self.temperature = temperature

    def update(self, mini: Rollout, counts: dict, micro_batch_size: int, forward_only: bool = False) -> UpdateResult:
        """One optimizer step on a mini-batch (or, with forward_only, the same maths with no step).

        `counts` are the mini-batch's global token/sequence counts (all DP ranks); each micro-batch
        loss is scaled by `MegatronRole.loss_scale` so the gradient is that of the globally
        normalised loss, independent of the parallel layout and of how rows form micro-batches.
        """
        a = self.algo
        # On-policy (one epoch, one mini-batch) the update's own forward gives the old log-probs:
        # no separate forward pass, and the engine's log-probs are checked against it here.
        on_policy = mini.on_policy
        assert on_policy or mini.old_logprob is not None, "off-policy updates need old_logprob"

        def loss_fn(mb, logits):
            logprob, entropy = token_logprobs(self.role, mb, logits, with_entropy=True, temperature=self.temperature)
            mask = mb["resp_mask"]
            old = logprob.detach() if on_policy else mb["old_logprob"]
            is_w, is_stats = None, {}
            if a.rollout_is != "none":  # truncated IS on the engine's log-probs (algorithms/rollout_is.py)
                is_w, is_stats = rollout_is_weights(old, mb["rollout_logprob"], mask, a.rollout_is, a.rollout_is_cap)
            pg, pg_stats = compute_policy_loss(
                a.policy_loss,
                old,
                logprob,
                mb["advantages"],
                mask,
                a.clip_ratio_low,
                a.clip_ratio_high,
                a.clip_ratio_c,
                a.loss_agg_mode,
                **counts,
                is_weights=is_w,
                **loss_params(a.policy_loss, a.policy_loss_params),  # tau_pos, clip_cov_ratio, dro_beta, ...
            )
            loss = pg
            ntok = mask.sum()
            stats = {
                "actor/pg_loss": pg.detach(),
                "actor/entropy_sum": (entropy.detach() * mask).sum(),
                "actor/clipfrac_sum": pg_stats["clip_frac"] * ntok,
                "actor/tokens": ntok,
                "actor/approx_kl_sum": pg_stats["approx_kl"] * ntok,
                **is_stats,
            }
            if on_policy:
                diff = (logprob.detach() - mb["rollout_logprob"]).abs() * mask
                stats["actor/rollout_diff_sum"] = diff.sum()
                stats["actor/rollout_diff_max"] = diff.max()
            if a.use_kl_loss and "ref_logprob" in mb:
                kl, kl_stats = kl_loss(logprob, mb["ref_logprob"], mask, a.kl_loss_type, a.loss_agg_mode, **counts)
                loss = loss + a.kl_loss_coef * kl
                stats["actor/kl_sum"] = kl_stats["kl"] * ntok
            if a.entropy_coeff:
                loss = loss - a.entropy_coeff * agg_loss(entropy, mask, a.loss_agg_mode, **counts)
            stats["actor/loss"] = loss.detach()
            return loss * scale, stats

        mbs = self.role.micro_batches(mini.tensors(*ACTOR_FIELDS), micro_batch_size, mini.needed_lengths()).batches
        scale = self.role.loss_scale(len(mbs))
        if forward_only:
            return UpdateResult(self.role.run(mbs, loss_fn, forward_only=True), 0.0)
        moe = self.role.args.moe
        if moe is not None:
            from megatron_bridge.moe import clear_aux_losses

            clear_aux_losses()  # the critic's routers (a MoE critic trained just before) share the tracker
        stats, grad_norm = self.role.train_step(mbs, loss_fn)
        if moe is not None:
            stats = stats + _moe_stats(stats, len(mbs), moe.aux_loss_coeff, self.role.groups.dims.dp)
        return UpdateResult(stats, grad_norm)


def _moe_stats(stats: list, num_micro: int, coeff: float, dp: int) -> list:
    """The router load-balancing loss as one more stats entry (collective: every rank calls it).

    reduce_stats sums plain losses over micro-batches and DP ranks of the stats holders (the last
    stage), so each holder adds its DP share of the (already DP-averaged) value.
    """
    from megatron_bridge.moe import collect_aux_losses

    aux = collect_aux_losses(num_micro, coeff)
    if not stats:  # not the last pipeline stage: no loss stats here
        return []
    return [{"actor/moe_aux_loss": aux.weighted / dp, "actor/moe_load_balancing_loss": aux.load_balancing / dp}]
