"""Forward-only passes of a Megatron model on every rank of its replica: full-vocabulary logits and
a scalar head's scores (megatron's forward-only schedule; TP-gathered, PP-broadcast).

Used by the bridge's checks (megatron_bridge.verify) and by rlstack's engine check after a weight
sync (rlstack.rollout.sync_check), which is why it is not part of the verify command-line module.
"""

from __future__ import annotations

import torch


def _forward_only(model, input_ids: torch.Tensor, groups, micro_batch_size: int) -> list:
    """Megatron's forward-only schedule over `input_ids` [B, S] in micro-batches: the last stage's
    outputs per micro-batch (an empty list on other stages)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq_len = input_ids.shape[1]
    micro = list(input_ids.to(groups.device).split(micro_batch_size))

    def step(data_iterator, model):
        tokens = next(data_iterator)  # [b, S]
        position_ids = torch.arange(seq_len, device=tokens.device).expand_as(tokens)
        return model(tokens, position_ids, attention_mask=None), _keep_logits

    model.eval()
    with torch.no_grad():
        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(micro),
            model=[model],
            num_microbatches=len(micro),
            seq_length=seq_len,
            micro_batch_size=micro_batch_size,
            forward_only=True,
            collect_non_loss_data=True,
        )


def megatron_logits(model, input_ids: torch.Tensor, groups, vocab_size: int, micro_batch_size: int = 1) -> torch.Tensor:
    """Full-vocabulary logits [B, S, vocab] on every rank of the model replica.

    Runs megatron's forward-only schedule (pipelined over micro-batches at PP > 1), gathers the last
    stage's vocabulary shards over TP, drops padded vocabulary columns and broadcasts over PP.
    """
    import torch.distributed as dist

    batch_size, seq_len = input_ids.shape
    outputs = _forward_only(model, input_ids, groups, micro_batch_size)
    if groups.is_last_stage:
        logits = _gather_vocab(torch.cat(outputs, dim=0), groups)[..., :vocab_size].contiguous()
    else:
        logits = torch.empty(batch_size, seq_len, vocab_size, device=groups.device)
    if groups.dims.pp > 1:
        dist.broadcast(logits, src=dist.get_global_rank(groups.pp, groups.dims.pp - 1), group=groups.pp)
    return logits.float().cpu()


def _keep_logits(output_tensor, non_loss_data=True):
    return output_tensor  # [b, S, V/tp]


def _gather_vocab(local: torch.Tensor, groups) -> torch.Tensor:
    import torch.distributed as dist

    if groups.dims.tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(groups.dims.tp)]
    dist.all_gather(parts, local.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1)  # [B, S, padded V]


def megatron_scores(model, input_ids: torch.Tensor, groups, micro_batch_size: int = 1) -> torch.Tensor:
    """The scalar head's output [B, S] on every rank of the replica (replicated over TP; PP-broadcast)."""
    import torch.distributed as dist

    batch_size, seq_len = input_ids.shape
    outputs = _forward_only(model, input_ids, groups, micro_batch_size)
    if groups.is_last_stage:
        scores = torch.cat(outputs, dim=0)[..., 0].float().contiguous()  # [B, S, 1] -> [B, S]
    else:
        scores = torch.empty(batch_size, seq_len, device=groups.device)
    if groups.dims.pp > 1:
        dist.broadcast(scores, src=dist.get_global_rank(groups.pp, groups.dims.pp - 1), group=groups.pp)
    return scores.cpu()
