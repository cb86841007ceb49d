"""Cores lent between the ranks of one host while some wait for the others' rollout (CPU, hf engine).

Colocated ranks generate their shares at once, each on its own threads, and meet when all are done
(`stages.generate` gathers the generations). The rollout lasts as long as the longest row on any rank,
so a rank whose rows end early sits in that gather while its cores idle: SmolLM2's GRPO step
(8 prompts x 4 samples, 2 ranks x 1 thread, AMD EPYC) waited 0.05-1.2 s there, a third of the rollout
in the worst step. A waiting rank now says so in a small shared-memory table of its host (the threads
it lends), and a rank still decoding takes those threads for its next decode steps
(`torch.set_num_threads`), giving them back before it joins the gather. The waiting rank is blocked in
gloo (no spinning), so the cores are free. A decode pass over SmolLM2's weights with 4 rows: 20.2 ms
on one thread, 14.5 ms on two (docs/rollout.md).

Only where it is safe and useful: CPU ranks, the hf engine (vLLM's CPU backend runs its own threads),
colocated placement, torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE naming the host's ranks.
`RLSTACK_LEND_CORES=0` turns it off; runs that must repeat bit for bit do so, since a lent thread
changes oneDNN's rounding at moments set by timing (docs/reliability.md "Exact resume and lent cores").
A rank takes no more than the cores (its affinity) leave beside the busy ranks' own threads, so a host
whose ranks already fill or outnumber its cores lends nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
from typing import Optional

import torch

from megatron_bridge.patches.gloo_collectives import shm_file

log = logging.getLogger(__name__)

ENV_SWITCH = "RLSTACK_LEND_CORES"
SHM_DIR = "/dev/shm"


class HostCores:
    """The host's table: row i holds local rank i's own threads and whether it is waiting (lending them).

    A rank takes at most what the host's cores leave beside the busy ranks' own threads: where ranks
    already outnumber the cores (tests: 4 ranks on 2 cores), nothing is taken."""

    def __init__(self, table: torch.Tensor, local_rank: int):
        self.table, self.local_rank = table, local_rank  # int32 [local world, 2], shared by the host's ranks
        self.own = torch.get_num_threads()
        self.using = self.own
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.others = torch.ones(table.shape[0], dtype=torch.bool)
        self.others[local_rank] = False
        table[local_rank, 0] = self.own

    @staticmethod
    def open(world_group, rank: int, device) -> Optional[HostCores]:
        """Collective over the world: the host's table, or None where lending does not apply.

        Every rank must call it (it broadcasts a name and meets at a barrier), whatever it returns."""
        from rlstack import collectives

        local_rank, local_world = int(os.environ.get("LOCAL_RANK", -1)), int(os.environ.get("LOCAL_WORLD_SIZE", 0))
        name = collectives.broadcast_object(secrets.token_hex(8) if rank == 0 else None, 0, world_group, device)
        wanted = os.environ.get(ENV_SWITCH, "1") != "0" and 0 <= local_rank < local_world and local_world > 1
        path = os.path.join(SHM_DIR, f"rlstack-cores-{name}-{socket.gethostname()}")
        table = None
        # the host's ranks open and size one file; its zeros say nobody waits yet
        if wanted and shm_file(path, 8 * local_world, exclusive=False):
            try:
                table = torch.from_file(path, shared=True, size=2 * local_world, dtype=torch.int32)
                table = table.view(local_world, 2)
            except RuntimeError as e:
                log.debug("lending cores: %s", e)
        cores = HostCores(table, local_rank) if table is not None else None  # writes its own threads
        collectives.barrier(world_group, device)  # every rank of the host has mapped the file, filled its row
        with contextlib.suppress(OSError):
            os.unlink(path)
        return cores

    @contextlib.contextmanager
    def waiting(self):
        """This rank's threads lent to the host while the body runs (a wait on the other ranks)."""
        self.table[self.local_rank, 1] = 1
        try:
            yield
        finally:
            self.table[self.local_rank, 1] = 0

    def take(self) -> None:
        """Between decode steps: this rank's threads plus what the host's waiting ranks lend now, within
        the cores the busy ranks leave."""
        own, waiting = self.table[:, 0], self.table[:, 1].bool()
        lent = int(own[self.others & waiting].sum())
        busy = int(own[self.others & ~waiting].sum())
        want = max(self.own, min(self.own + lent, self.cores - busy))
        if want != self.using:
            torch.set_num_threads(want)
            self.using = want

    def give_back(self) -> None:
        """At the end of a generate: this rank's own threads again."""
        if self.using != self.own:
            torch.set_num_threads(self.own)
            self.using = self.own
