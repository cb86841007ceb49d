"""The rollout rank's end of split placement's vLLM child (rlstack/rollout/vllm_subprocess.py) when the
child is killed or hangs, without vLLM: a stand-in child that never answers. The rank must stop the
run in one line naming the engine, the rank and the step (rlstack.preemption.engine_failed, exit 4)."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

import pytest

from rlstack import preemption
from rlstack.rollout import vllm_subprocess
from rlstack.rollout.interface import SamplingParams


class _Stopped(Exception):
    pass


def _silent_child(conn) -> None:
    while True:
        conn.recv()  # takes every request, answers none (a hung engine)


@pytest.fixture
def engine(monkeypatch):
    """A SubprocessVLLMEngine over a forked stand-in child; engine_failed raises instead of os._exit."""
    monkeypatch.setenv("RANK", "1")
    for var in ("RLSTACK_FAULT_VLLM_KILL_STEP", "RLSTACK_FAULT_ROLLOUT_HANG_STEP", "RLSTACK_FAULT_RANK"):
        monkeypatch.delenv(var, raising=False)
    lines = []

    def failed(engine_name, what):
        lines.append(preemption.engine_line(engine_name, what))
        raise _Stopped(lines[-1])

    monkeypatch.setattr(preemption, "engine_failed", failed)
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_silent_child, args=(child,), daemon=True)
    proc.start()
    child.close()
    eng = object.__new__(vllm_subprocess.SubprocessVLLMEngine)
    eng._conn, eng._proc, eng._port, eng._closed, eng._running, eng.timeout_s = parent, proc, 0, False, True, 0.0
    preemption.reset()
    preemption.begin_step(3)
    yield eng, proc, lines
    if proc.is_alive():
        proc.kill()
    proc.join()
    preemption.reset()


def test_a_killed_child_stops_the_run_naming_engine_rank_and_step(engine):
    eng, proc, lines = engine
    proc.kill()
    proc.join()
    with pytest.raises(_Stopped):
        eng.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    assert lines == [
        f"rollout engine vllm on rank 1 lost its vLLM process (pid {proc.pid}, killed by SIGKILL) during step 3's "
        "generate: stopped; nothing of step 3 is saved, the last checkpoint stays and a resumed run repeats step 3"
    ]


def test_a_child_killed_during_the_weight_sync_is_named_too(engine):
    eng, proc, lines = engine
    proc.kill()
    proc.join()
    import torch

    with pytest.raises((_Stopped, BrokenPipeError)):
        eng.load_weights(iter([("w", torch.zeros(4))]))
    assert len(lines) == 1 and "killed by SIGKILL) during step 3's weight sync" in lines[0], lines


def test_a_generation_past_rollout_timeout_s_kills_the_child_and_stops_the_run(engine):
    eng, proc, lines = engine
    eng.timeout_s = 0.5
    t0 = time.monotonic()
    with pytest.raises(_Stopped):
        eng.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    assert 0.5 <= time.monotonic() - t0 < 5
    assert lines == [
        "rollout engine vllm on rank 1 did not finish step 3's generation within rollout.timeout_s=0.5 (hung or "
        "dead): stopped; nothing of step 3 is saved, the last checkpoint stays and a resumed run repeats step 3"
    ]
    proc.join(timeout=5)
    assert proc.exitcode == -signal.SIGKILL  # no hung child left behind


def test_the_kill_fault_hook_fires_in_its_step_on_its_rank(engine, monkeypatch):
    eng, proc, lines = engine
    monkeypatch.setenv("RLSTACK_FAULT_VLLM_KILL_STEP", "3")
    monkeypatch.setenv("RLSTACK_FAULT_RANK", "0")  # another rank: nothing happens here
    eng.timeout_s = 0.3
    with pytest.raises(_Stopped):
        eng.generate([[1]], SamplingParams(max_new_tokens=1))
    assert "did not finish" in lines[-1]  # the stand-in never answers: the timeout, not the kill
    monkeypatch.setenv("RLSTACK_FAULT_RANK", "1")
    assert preemption.fault_step("VLLM_KILL_STEP")
    preemption.begin_step(4)
    assert not preemption.fault_step("VLLM_KILL_STEP")
