"""The pure parts of benchmarks/device_check.py (what gpu_check.sh decides pass/fail with)."""

from benchmarks.device_check import _layout, _plan_peak_gib, compare_steps


def test_resume_comparison_exact_and_tolerant():
    expected = {3: {"step": 3, "actor/loss": 0.5, "actor/pg_loss": 1e-7, "timing/step_s": 1.0}}
    same = [{"step": 3, "actor/loss": 0.5, "actor/pg_loss": 1e-7, "timing/step_s": 9.0}]  # timings ignored
    assert compare_steps(expected, same, 0.0, 0.0) == (0.0, "", [])
    off = [{"step": 3, "actor/loss": 0.5 + 1e-9, "actor/pg_loss": 3e-7}]
    worst, where, outside = compare_steps(expected, off, 0.0, 0.0)
    assert outside == ["actor/loss@3", "actor/pg_loss@3"] and where == "actor/pg_loss at step 3"
    assert abs(worst - 2.0) < 1e-9
    assert compare_steps(expected, off, 5e-2, 1e-5)[2] == []  # the GPU tolerance admits both


def test_plan_peak_and_layout_parsing():
    assert _plan_peak_gib('log line\n{"peak_gib": 0.66, "fits": true}') == 0.66
    assert _plan_peak_gib("error: no plan") is None
    assert _layout(["model.path=x", "parallel.tp=2"]) == (2, 1)


def test_cpu_mode_turns_core_lending_off_by_its_real_switch():
    """The CPU check compares resumed steps exactly, which holds only without lent cores (timing moves the
    thread count, and with it the rounding); its constant must name host_cores' switch."""
    from benchmarks.device_check import LEND_CORES_ENV
    from rlstack.rollout.host_cores import ENV_SWITCH

    assert LEND_CORES_ENV == ENV_SWITCH
