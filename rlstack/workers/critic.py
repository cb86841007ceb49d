"""Critic: a GPTModel with a scalar value head; values and the clipped value-loss update."""

from __future__ import annotations

import torch

from rlstack.algorithms import value_loss
from rlstack.config import AlgorithmConfig
from rlstack.workers.batch import Rollout
from rlstack.workers.logprobs import align_to_tokens
from rlstack.workers.megatron_role import MegatronRole, UpdateResult


def _values(output: torch.Tensor) -> torch.Tensor:
    """[b, S, 1] value-head output at each position -> token-aligned values [b, S] (V before token t)."""
    return align_to_tokens(output.squeeze(-1).float())


class Critic:
    def __init__(self, role: MegatronRole, algo: AlgorithmConfig):
        self.role = role
        self.algo = algo

    def compute_values(self, rollout: Rollout, micro_batch_size: int) -> torch.Tensor:
        def loss_fn(mb, output):
            return torch.zeros((), device=output.device), {"values": _values(output)}

        inputs = rollout.tensors("tokens", "position_ids", "resp_mask")  # resp_mask: where prompts end (prefix_sharing)
        mbs = self.role.micro_batches(inputs, micro_batch_size, rollout.needed_lengths())
        stats = self.role.run(mbs.batches, loss_fn, forward_only=True)
        out = mbs.rows(stats, "values") if self.role.groups.is_last_stage else None
        return self.role.broadcast_from_last_stage(out, rollout.tokens.shape, torch.float32)

    def update(self, mini: Rollout, counts: dict, micro_batch_size: int, forward_only: bool = False) -> UpdateResult:
        a = self.algo

        def loss_fn(mb, output):
            values = _values(output)
            loss, stats = value_loss(
                values, mb["old_values"], mb["returns"], mb["resp_mask"], a.value_clip, a.loss_agg_mode, **counts
            )
            ntok = mb["resp_mask"].sum()
            return loss * scale, {
                "critic/loss": loss.detach(),
                "critic/clipfrac_sum": stats["clip_frac"] * ntok,
                "critic/tokens": ntok,
            }

        fields = mini.tensors("tokens", "position_ids", "resp_mask", "old_values", "returns")
        mbs = self.role.micro_batches(fields, micro_batch_size, mini.needed_lengths()).batches
        scale = self.role.loss_scale(len(mbs))
        if forward_only:
            return UpdateResult(self.role.run(mbs, loss_fn, forward_only=True), 0.0)
        stats, grad_norm = self.role.train_step(mbs, loss_fn)
        return UpdateResult(stats, grad_norm)
