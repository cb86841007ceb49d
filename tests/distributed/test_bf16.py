"""bf16 on CPU takes megatron's mixed-precision path, as on a GPU.

bf16 parameters everywhere (the local spec's torch RMSNorm included, which megatron builds in fp32),
fp32 main parameters and fp32 gradients in the optimizer (Float16OptimizerWithFloat16Params, or the
distributed optimizer), and an optimizer step that moves the bf16 weights. The e2e learning and
resume checks are in tests/e2e/test_bf16.py.
"""

import pytest
import torch

from tests.dist_utils import run_distributed


def _bf16_step(hf_dir: str, tp: int, use_dist_opt: bool) -> dict:
    from megatron_bridge.parallel import init_distributed
    from rlstack.workers.actor import token_logprobs
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings, split_micro_batches

    g = init_distributed(tp, 1)
    role = MegatronRole(hf_dir, g, torch.bfloat16, optim=OptimSettings(lr=1e-2, use_distributed_optimizer=use_dist_opt))
    before = {n: p.detach().clone() for n, p in role.module.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, role.args.vocab_size, (4, 16), generator=gen)
    batch = {
        "tokens": tokens,
        "position_ids": torch.arange(16).expand(4, -1).contiguous(),
        "resp_mask": torch.ones(4, 16),
    }

    def loss_fn(mb, logits):
        lp = token_logprobs(role, mb, logits)  # fp32 log-probs from bf16 logits
        loss = -(lp * mb["resp_mask"]).mean()
        return loss, {"loss": loss.detach(), "lp_dtype": str(lp.dtype)}

    stats, grad_norm = role.train_step(split_micro_batches(batch, 2), loss_fn)
    opts = getattr(role.optimizer, "chained_optimizers", None) or [role.optimizer]
    main = [p for o in opts for group in o.optimizer.param_groups for p in group["params"]]
    return {
        "param_dtypes": sorted({str(p.dtype) for p in role.module.parameters()}),
        "main_dtypes": sorted({str(p.dtype) for p in main}),
        "grad_dtypes": sorted({str(p.main_grad.dtype) for p in role.module.parameters()}),
        "optimizers": sorted({type(o).__name__ for o in opts}),
        "moved": max(
            (p.detach().float() - before[n].float()).abs().max().item() for n, p in role.module.named_parameters()
        ),
        "grad_norm": grad_norm,
        "loss": float(stats[0]["loss"]),
        "lp_dtype": stats[0]["lp_dtype"],
    }


@pytest.mark.parametrize(
    "tp,use_dist_opt,optimizer",
    [
        (1, False, "Float16OptimizerWithFloat16Params"),
        (2, True, "DistributedOptimizer"),
    ],
)
def test_bf16_mixed_precision_path(tiny_llama, tp, use_dist_opt, optimizer):
    r = run_distributed(_bf16_step, tp, tiny_llama, tp, use_dist_opt)[0]
    assert r["param_dtypes"] == ["torch.bfloat16"], r  # norms too: the first sync needs one dtype
    assert r["main_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"], r
    assert r["optimizers"] == [optimizer], r
    assert r["lp_dtype"] == "torch.float32"
    assert torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() and r["grad_norm"] > 0
    assert r["moved"] > 1e-3  # the fp32 main params' update reaches the bf16 weights
