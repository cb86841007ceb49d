"""Adam's state allocated before the first step (megatron_bridge.patches.optimizer_state.allocate_adam_state)."""

import types

import pytest
import torch

from megatron_bridge.patches.optimizer_state import allocate_adam_state


@pytest.mark.parametrize("fused", [False, True])
def test_eager_state_steps_bit_identical_to_torch_lazy_state(fused):
    torch.manual_seed(0)
    init = [torch.randn(7, 5), torch.randn(5)]
    grads = [[torch.randn_like(p) for p in init] for _ in range(3)]

    def run(eager):
        params = [torch.nn.Parameter(p.clone()) for p in init]
        inner = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)
        wrapped = types.SimpleNamespace(optimizer=inner)  # megatron's optimizer holds torch's as .optimizer
        if eager:
            assert allocate_adam_state(wrapped) == 2 * sum(p.numel() * 4 for p in params)
            state = inner.state[params[0]]
            assert state["exp_avg"].abs().sum() == 0 and float(state["step"]) == 0.0
            assert allocate_adam_state(wrapped) == 0  # parameters with state keep it
        for g in grads:
            for p, gp in zip(params, g):
                p.grad = gp.clone()
            inner.step()
        return params, inner.state[params[0]]

    lazy, lazy_state = run(False)
    eager, eager_state = run(True)
    for a, b in zip(lazy, eager):
        assert torch.equal(a, b)
    assert eager_state["step"].dtype == lazy_state["step"].dtype
    assert eager_state["step"].device == lazy_state["step"].device
    assert torch.equal(eager_state["exp_avg_sq"], lazy_state["exp_avg_sq"])
