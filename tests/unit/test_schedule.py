"""Learning-rate schedules: megatron-core's OptimizerParamScheduler as rlstack drives it (LRSchedule).

Values at chosen steps are computed by hand here; verl's schedule (zero-indexed LambdaLR, cosine
with num_cycles 0.5) gives the same numbers, written out in `_verl_lr` from its definition.
"""

import math

import pytest
import torch

from rlstack.workers.megatron_role import LRSchedule, OptimSettings, warmup_steps

LR = 1e-3


def _optimizer(min_lr: float):
    """A torch optimizer with parameter groups shaped like megatron's (max_lr, min_lr, wd_mult)."""
    w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD(
        [
            {"params": [w], "max_lr": LR, "min_lr": min_lr, "wd_mult": 1.0},
            {"params": [b], "max_lr": LR, "min_lr": min_lr, "wd_mult": 0.0},
        ],
        lr=LR,
    )


def _schedule(style="constant", warmup=0, total=10, min_ratio=0.0, weight_decay=0.1):
    settings = OptimSettings(
        lr=LR,
        weight_decay=weight_decay,
        lr_schedule=style,
        lr_warmup_steps=warmup,
        total_steps=total,
        min_lr_ratio=min_ratio,
    )
    min_lr = LR * min_ratio if style == "cosine" else LR
    opt = _optimizer(min_lr)
    return LRSchedule(opt, settings), opt


def _lrs(schedule, steps):
    out = []
    for _ in range(steps):
        out.append(schedule.lr)
        schedule.step()
    return out


def _verl_lr(k, warmup, total, min_ratio, style):
    """verl 0.9.1's get_{constant,cosine}_schedule_with_warmup at 0-indexed step k, x LR."""
    if k < warmup:
        return LR * k / max(1, warmup)
    if style == "constant":
        return LR
    progress = (k - warmup) / max(1, total - warmup)
    return LR * max(min_ratio, min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def test_constant_without_warmup_is_the_old_constant_lr():
    schedule, opt = _schedule()
    assert _lrs(schedule, 5) == [LR] * 5
    assert all(g["lr"] == LR for g in opt.param_groups)


def test_warmup_then_constant_by_hand():
    schedule, _ = _schedule("constant", warmup=4, total=10)
    # step k trains with LR * k / 4 until k = 4, then LR
    assert _lrs(schedule, 7) == pytest.approx([0.0, LR / 4, LR / 2, 3 * LR / 4, LR, LR, LR])


def test_warmup_then_cosine_to_min_by_hand():
    schedule, opt = _schedule("cosine", warmup=2, total=10, min_ratio=0.1)
    lrs = _lrs(schedule, 12)
    min_lr = 0.1 * LR
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(LR / 2) and lrs[2] == pytest.approx(LR)
    # halfway through the decay (k = 6 of 2..10): min + (max - min) * 0.5 * (1 + cos(pi/2))
    assert lrs[6] == pytest.approx(min_lr + (LR - min_lr) * 0.5)
    assert lrs[4] == pytest.approx(min_lr + (LR - min_lr) * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[10] == pytest.approx(min_lr) and lrs[11] == pytest.approx(min_lr)  # stays at min
    assert opt.param_groups[1]["lr"] == opt.param_groups[0]["lr"]  # every group follows


@pytest.mark.parametrize(
    "style, warmup, total, min_ratio",
    [
        ("constant", 3, 10, 0.0),
        ("cosine", 0, 8, 0.0),
        ("cosine", 3, 12, 0.2),
        ("cosine", 5, 6, 0.5),
    ],
)
def test_same_values_as_verl(style, warmup, total, min_ratio):
    schedule, _ = _schedule(style, warmup, total, min_ratio)
    assert _lrs(schedule, total) == pytest.approx(
        [_verl_lr(k, warmup, total, min_ratio, style) for k in range(total)], abs=1e-12
    )


def test_weight_decay_is_kept_per_group():
    schedule, opt = _schedule("cosine", warmup=2, total=5)
    for _ in range(3):
        schedule.step()
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # wd_mult 0: biases, norms


def test_warmup_as_long_as_the_run():
    schedule, _ = _schedule("cosine", warmup=4, total=4)
    assert _lrs(schedule, 5) == pytest.approx([0.0, LR / 4, LR / 2, 3 * LR / 4, LR])


def test_warmup_steps_or_ratio():
    assert warmup_steps(5, 0.5, 100) == 5  # explicit steps win
    assert warmup_steps(0, 0.1, 105) == 10  # int(ratio x total), as verl
    assert warmup_steps(0, 0.0, 100) == 0


def test_state_dict_restores_the_position():
    schedule, _ = _schedule("cosine", warmup=2, total=10, min_ratio=0.1)
    for _ in range(5):
        schedule.step()
    state = schedule.state_dict()
    assert state["num_steps"] == 5
    fresh, _ = _schedule("cosine", warmup=2, total=10, min_ratio=0.1)
    assert fresh.lr == 0.0
    fresh.load_state_dict(state)
    assert fresh.num_steps == 5 and fresh.lr == pytest.approx(schedule.lr)
    assert _lrs(fresh, 3) == pytest.approx(_lrs(schedule, 3))


def test_unknown_style():
    with pytest.raises(ValueError, match="constant or cosine"):
        _schedule("linear")


def test_config_keys():
    from rlstack.config import ConfigError, load_config

    cfg = load_config(
        None,
        [
            "data.synthetic=arith",
            "algorithm.lr_schedule=cosine",
            "algorithm.actor_lr_warmup_steps=3",
            "algorithm.min_lr_ratio=0.1",
        ],
    )
    assert cfg.algorithm.lr_schedule == "cosine" and cfg.algorithm.actor_lr_warmup_steps == 3
    for bad, match in (
        ("algorithm.lr_schedule=linear", "choose one of"),
        ("algorithm.min_lr_ratio=1.5", r"\[0, 1\]"),
        ("algorithm.actor_lr_warmup_steps=50", "exceed trainer.total_steps"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, ["data.synthetic=arith", bad])


def _role_lrs(hf_dir):
    from megatron_bridge import patches
    from megatron_bridge.parallel import init_distributed
    from rlstack.workers.megatron_role import MegatronRole

    patches.apply()
    g = init_distributed(1, 1)
    role = MegatronRole(
        hf_dir,
        g,
        torch.float32,
        optim=OptimSettings(lr=LR, lr_schedule="cosine", lr_warmup_steps=2, total_steps=6, min_lr_ratio=0.5),
    )
    lrs = []
    for _ in range(7):
        lrs.append(sorted({grp["lr"] for grp in role.optimizer.param_groups}))
        role.lr_schedule.step()
    return lrs, role.lr_schedule.state_dict()


def test_megatron_role_schedule_on_real_optimizer(tmp_path):
    """The real megatron optimizer's groups carry max_lr / min_lr from the role's settings."""
    from megatron_bridge.tiny import make_tiny_checkpoint
    from tests.dist_utils import run_distributed

    hf_dir = make_tiny_checkpoint(str(tmp_path / "tiny"))
    lrs, state = run_distributed(_role_lrs, 1, hf_dir)[0]
    expected = [_verl_lr(k, 2, 6, 0.5, "cosine") for k in range(7)]
    expected[6] = 0.5 * LR  # past total_steps: min_lr
    assert [group_lrs for group_lrs in lrs] == [[pytest.approx(e)] for e in expected]
    assert state["num_steps"] == 7
