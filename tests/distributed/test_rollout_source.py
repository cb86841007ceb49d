"""Trainer.train_step over a rollout source of a test's own (rlstack/step/__init__.py's protocol):
a source that wraps the colocated one sees every hook called once per step, its metrics and
state reach the step's metrics and the checkpoint, and the step's numbers are the wrapped source's."""

from __future__ import annotations

from tests.dist_utils import run_distributed
from tests.distributed.test_trainer_step import _trainer


class _Wrapping:
    """A RolloutSource over another one, as DAPO's dynamic sampling or an agent loop would sit."""

    def __init__(self, inner):
        self.inner, self.calls, self.rounds = inner, [], 0

    def next_batch(self, step):
        self.calls.append(("next_batch", step))
        self.rounds += 1
        return self.inner.next_batch(step)

    def after_update(self, step):
        self.calls.append(("after_update", step))
        return {**self.inner.after_update(step), "rollout/rounds": float(self.rounds)}

    def generate(self, prompts, step, greedy):
        return self.inner.generate(prompts, step, greedy)

    def state_dict(self):
        return {**self.inner.state_dict(), "rounds": self.rounds}

    def load_state_dict(self, state):
        self.rounds = state["rounds"]
        self.inner.load_state_dict(state)

    def close(self, ok):
        self.calls.append(("close", ok))
        self.inner.close(ok)


def _steps(out_dir, cache, wrap):
    overrides = ["data.train_batch_size=2", "algorithm.micro_batch_size=8", "rollout.n=4", "rollout.max_new_tokens=4"]
    _, trainer = _trainer(overrides, out_dir, cache)
    if wrap:
        trainer.source = _Wrapping(trainer.source)
    metrics = [trainer.train_step() for _ in range(2)]
    state = trainer.state_dict()
    trainer.source.close(True)
    calls = trainer.source.calls if wrap else []
    return [{k: v for k, v in m.items() if k.startswith(("reward/", "actor/", "rollout/rounds"))} for m in metrics], (
        state,
        calls,
    )


def _both(out_dir, cache):
    plain, _ = _steps(out_dir + "/plain", cache, wrap=False)
    wrapped, (state, calls) = _steps(out_dir + "/wrapped", cache, wrap=True)
    return plain, wrapped, state, calls


def test_train_step_drives_any_rollout_source(tmp_path, tiny_cache):
    plain, wrapped, state, calls = run_distributed(_both, 1, str(tmp_path), tiny_cache, timeout=240)[0]
    assert calls == [("next_batch", 0), ("after_update", 0), ("next_batch", 1), ("after_update", 1), ("close", True)]
    assert [m.pop("rollout/rounds") for m in wrapped] == [1.0, 2.0]  # the source's own metric reaches the step
    assert state == {"step": 2, "rounds": 2}  # and its state the checkpoint's trainer state
    for a, b in zip(plain, wrapped):  # the same step on the same batches: the same numbers
        assert a == b
