"""Which prompts each data-parallel rank takes at each step: deterministic, resumable, torch-free.

One global order per epoch (a seeded permutation, or 0..N-1 without shuffle); each step takes the
next `batch_size` prompts of it and rank r keeps the r-th of `dp_size` equal contiguous slices.
A batch never spans two epochs: the last `N % batch_size` prompts of an epoch's order are skipped
(like a DataLoader with drop_last=True), so no batch holds a prompt twice; the next epoch's
permutation differs, so skipped prompts are seen in other epochs. The state is (epoch, position):
a sampler loaded from `state_dict()` continues with exactly the batches the original would give.
"""

from __future__ import annotations

import numpy as np

from rlstack.errors import UserError


class PromptSampler:
    def __init__(
        self, num_items: int, batch_size: int, seed: int = 0, shuffle: bool = True, dp_rank: int = 0, dp_size: int = 1
    ):
        if batch_size < 1 or batch_size % dp_size != 0:
            raise UserError(
                f"data.train_batch_size={batch_size} must be a positive multiple of the "
                f"data-parallel size {dp_size}: set data.train_batch_size to a multiple of {dp_size}"
            )
        if num_items < batch_size:
            raise UserError(
                f"the dataset has {num_items} prompts, fewer than data.train_batch_size="
                f"{batch_size}: lower data.train_batch_size or add prompts"
            )
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        self.num_items, self.batch_size, self.seed, self.shuffle = num_items, batch_size, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.position = 0, 0  # position: offset of the next batch in the epoch's order
        self._order = self._epoch_order(0)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_items // self.batch_size

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_items)
        # SeedSequence((seed, epoch)): independent streams, unlike seed + epoch (seed 0 epoch 1
        # would repeat seed 1 epoch 0).
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_items)

    def next_global_batch(self) -> list[int]:
        """All ranks' prompt indices of the next step, in rank order."""
        if self.position + self.batch_size > self.num_items:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        batch = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [int(i) for i in batch]

    def next_batch(self) -> list[int]:
        """This data-parallel rank's prompt indices of the next step (batch_size / dp_size of them)."""
        per_rank = self.batch_size // self.dp_size
        start = self.dp_rank * per_rank
        return self.next_global_batch()[start : start + per_rank]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_items": self.num_items,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; the batch size and DP size may differ, the data and seed may not."""
        for key in ("num_items", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise UserError(
                    f"the checkpoint's data sampler had {key}={state[key]!r}, this run has "
                    f"{getattr(self, key)!r}: resume with the same data and data.seed/shuffle, "
                    "or start a fresh run (checkpoint.resume=never)"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


def val_batches(num_items: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[list[int]]:
    """This rank's share of every validation batch, in order, covering each prompt exactly once.

    Every rank gets the same number of batches (so per-batch collectives line up); a rank's share of
    the last batch may be smaller, or empty. Shares are contiguous: rank r takes the r-th slice of
    each global batch, split as evenly as possible.
    """
    if batch_size < 1:
        raise UserError(f"data.val_batch_size={batch_size}: set it to at least 1")
    assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
    batches = []
    for start in range(0, num_items, batch_size):
        stop = min(start + batch_size, num_items)
        bounds = np.linspace(start, stop, dp_size + 1).round().astype(int)
        batches.append(list(range(int(bounds[dp_rank]), int(bounds[dp_rank + 1]))))
    return batches
