"""The weight check after the optimizer step (rlstack/workers/finite.py `count_nonfinite`): one
aminmax pass a tensor finds every NaN, +inf and -inf, and counts tensors, not elements."""

import torch

from rlstack.workers.finite import count_nonfinite


def test_count_nonfinite_finds_each_kind_of_bad_value():
    layers = torch.nn.ModuleList([torch.nn.Linear(64, 32) for _ in range(5)])
    empty = torch.nn.Module()
    empty.p = torch.nn.Parameter(torch.zeros(0))  # an empty tensor is finite (aminmax would refuse it)
    assert count_nonfinite([layers, empty]) == 0
    with torch.no_grad():
        layers[0].weight[3, 7] = float("nan")
        layers[1].bias[0] = float("inf")
        layers[2].weight[-1, -1] = -float("inf")
        layers[3].weight[0, :4] = float("nan")  # several in one tensor: still one tensor
        layers[4].weight.mul_(1e30)  # huge but finite (a sum would overflow; min/max do not)
    assert count_nonfinite([layers, empty]) == 4


def _two_steps(hf_dir):
    from megatron_bridge import patches
    from megatron_bridge.parallel import init_distributed
    from rlstack.workers.finite import step_unless_nonfinite
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    patches.apply()
    g = init_distributed(1, 1)
    out = []
    for how in ("megatron", "rlstack"):
        role = MegatronRole(hf_dir, g, torch.float32, optim=OptimSettings(lr=1e-2, clip_grad=0.05))
        before = [p.detach().clone() for p in role.model.parameters()]
        gen = torch.Generator().manual_seed(0)
        for p in role.model.parameters():  # the same gradients in both roles' grad buffers
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        if how == "megatron":
            ok, norm, _ = role.optimizer.step()
        else:
            ok, norm = step_unless_nonfinite(role.optimizer)
        after = [p.detach().clone() for p in role.model.parameters()]
        assert all(not torch.equal(a, b) for a, b in zip(before, after))  # every tensor was updated
        out.append((ok, float(norm), after))
    return out


def test_step_with_the_checked_norm_equals_megatrons_step(tmp_path):
    """The norm is computed once and reused for clipping: bit for bit megatron's own `step()`."""
    from megatron_bridge.tiny import make_tiny_checkpoint
    from tests.dist_utils import run_distributed

    hf_dir = make_tiny_checkpoint(str(tmp_path / "tiny"))
    (ok_a, norm_a, params_a), (ok_b, norm_b, params_b) = run_distributed(_two_steps, 1, hf_dir)[0]
    assert ok_a and ok_b and norm_a == norm_b and norm_a > 0.05  # clipping was active
    assert len(params_a) == len(params_b)
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
