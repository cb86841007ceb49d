"""The phases of a step (sync, rollout, scoring, update, idle) as every part of the step enters them."""

from __future__ import annotations

from rlstack import host_memory
from rlstack.observability.monitor import PhaseMemory


class Phases:
    """Entering a phase: offload (rlstack.workers.offload) moves states for it, freed host heap
    pages go back to the kernel (rlstack/host_memory.py), the meter starts the phase's peak
    (`mem/peak_gib/<phase>`)."""

    def __init__(self, offload):
        self.offload = offload
        self.memory = PhaseMemory()

    def start(self) -> None:
        """A new step (earlier phases, validation and checkpoints, are not part of it)."""
        self.memory.start()

    def enter(self, phase: str) -> None:
        self.offload.enter(phase)
        host_memory.trim_heap()
        self.memory.enter(phase)

    def metrics(self) -> dict:
        return self.memory.metrics()
