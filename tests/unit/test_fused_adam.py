"""megatron_role._fused_adam_on_cpu: the torch Adam megatron builds runs torch's fused CPU kernel, same update."""

import types

import torch

from rlstack.workers.megatron_role import _fused_adam_on_cpu


def _three_steps(fused: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.randn(300, 7, generator=gen).requires_grad_(True),
        torch.randn(11, generator=gen).requires_grad_(True),
    ]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    wrapper = types.SimpleNamespace(optimizer=opt)  # megatron's FP32Optimizer / DistributedOptimizer hold `.optimizer`
    if fused:
        _fused_adam_on_cpu(wrapper)
        assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    for step in range(3):
        for p in params:
            p.grad = torch.sin(p.detach() * (step + 1))
        opt.step()
    return [p.detach() for p in params]


def test_fused_adam_equals_the_loop_within_rounding():
    for got, want in zip(_three_steps(True), _three_steps(False)):
        assert float((got - want).abs().max() / want.abs().max()) < 1e-6


def test_other_optimizers_are_left_alone():
    sgd = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)
    _fused_adam_on_cpu(types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=sgd)]))
    assert sgd.param_groups[0].get("fused") in (None, False)
