"""Selective recompute (model.recompute_modules) keeps what the memory planner says it keeps.

One rank builds the tiny Llama with each setting, runs one training micro-batch through megatron's
schedule and, at the end of the forward (inside the loss function, before backward), adds up the
bytes of every storage autograd has saved so far. A storage that an output-discarding checkpoint
has released (selective "layernorm", patches.missing_te (m)) counts 0 bytes then, as it holds none. The
differences from no recompute must equal the planner's (rlstack/planner/memory.py
`layer_activation_bytes` x layers), plus the norms' per-row rstd, which the planner leaves out.
Parameters (which autograd saves too) are resident anyway and not counted.
"""

import pytest
import torch

from tests.dist_utils import run_distributed

BATCH, SEQ = 4, 24


def _saved_bytes_at_end_of_forward(hf_dir: str, settings: list) -> list[int]:
    from megatron_bridge.parallel import init_distributed
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    g = init_distributed(1, 1)
    gen = torch.Generator().manual_seed(0)
    results = []
    for recompute in settings:
        role = MegatronRole(hf_dir, g, torch.float32, optim=OptimSettings(optimizer="sgd", lr=0.1), recompute=recompute)
        micro = {
            "tokens": torch.randint(0, role.args.vocab_size, (BATCH, SEQ), generator=gen),
            "position_ids": torch.arange(SEQ).expand(BATCH, -1).contiguous(),
        }
        params = {p.untyped_storage().data_ptr() for p in role.module.parameters()}  # resident anyway
        saved: list[torch.Tensor] = []
        at_end: list[int] = []

        def pack(t):
            saved.append(t)
            return t

        def loss_fn(mb, logits):
            # storages by their address now (a discarded one's memory may since hold a new tensor)
            live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
            at_end.append(sum(n for ptr, n in live.items() if ptr not in params))
            return logits.float().mean(), {}

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            role.run([micro], loss_fn, forward_only=False)
        results.append(at_end[0])
    return results


@pytest.mark.parametrize(
    "modules", [("layernorm",), ("mlp",), ("layernorm", "mlp"), ("mlp_act",), ("layernorm", "mlp_act")]
)
def test_saved_activations_shrink_as_planned(tiny_llama, modules):
    from megatron_bridge.hf import read_model_args
    from rlstack.planner import memory as m
    from rlstack.planner.shapes import shape_of

    none, selective = run_distributed(_saved_bytes_at_end_of_forward, 1, tiny_llama, [False, modules])[0]
    args = read_model_args(tiny_llama)
    shape, mb = shape_of(args, tp=1), m.Tokens(batch=BATCH, seq_len=SEQ)
    # fp32 on CPU: megatron_bridge's LeanRMSNorm and SDPA core attention (the planner's lean_norm, fused)
    layer = m.layer_activation_bytes(shape, 1, mb, 4, fused_attention=True, lean_norm=True)
    kept = m.layer_activation_bytes(shape, 1, mb, 4, fused_attention=True, lean_norm=True, selective=modules)
    assert kept < layer
    planned = args.num_layers * (layer - kept)
    # the planner leaves out per-row scalars: each norm's rstd [tokens, 1] (fp32), two norms a layer
    rstd = args.num_layers * 2 * BATCH * SEQ * 4 if "layernorm" in modules else 0
    assert none - selective == planned + rstd
