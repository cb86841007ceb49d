"""The parts of one training step around `rlstack.trainer.Trainer.train_step` (docs/architecture.md).

    source.next_batch(step) -> StepBatch   rollout + scoring, in the source's own way
    trainer: score forwards, advantages, PPO epochs, metrics        (rlstack/trainer.py)
    source.after_update(step) -> dict      whatever the source does once the weights moved

A *rollout source* (`RolloutSource`) is where a step's scored batch comes from. Two exist:
`colocated.ColocatedSource` (every rank syncs its own engine, generates, scores) and
`split.SplitSource` (rollout-only ranks generate; the training ranks request, receive, score,
optionally one step ahead). The trainer never asks which one it has.

The protocol, and how the next kinds of rollout plug into it without a copy of the step:

- `next_batch(step)`: the weights the batch is sampled with are the source's business (the
  colocated source syncs its engine first, so a resumed run's engine gets the checkpoint's
  weights; the split source sends them with its request). It returns this data-parallel rank's
  share as a `StepBatch`: the prompts, the generations, their `Scores` (rlstack.step.scoring), the
  padded `Rollout` (score forwards may already be filled, e.g. streamed per micro-batch), the
  weight sync's `SyncStats`, the tokens generated over all ranks, and the source's own metrics
  and `timing/*`. An *agent loop* source (multi-turn: tool calls inside one response) returns the
  same `StepBatch`; a per-token policy mask (tool output tokens not trained) rides on each
  `Generation` and the `Rollout`'s response mask. *DAPO dynamic sampling* is a source that wraps
  another: it asks the inner source for more rounds of prompts until enough groups with non-zero
  reward variance are kept, then returns their concatenation.
- `after_update(step) -> dict`: called once the update stepped the weights; returns metrics for
  the step (a key already in the step's metrics is replaced). The split source with
  `rollout.staleness=1` receives the batch generated during the update here; an asynchronous
  source with staleness k > 1 publishes the new weights to its engines here and keeps up to k
  requests in flight. The colocated source returns the ranks to their resident "idle" phase.
- `generate(prompts, step, greedy) -> (gens, tokens)`: every rank's generations for `prompts`
  with the current weights (validation).
- `state_dict()` / `load_state_dict(state)`: what a checkpoint must hold to resume exactly (the
  split source's batch generated ahead); merged into the trainer's own state.
- `close(ok)`: release the engine or the rollout ranks at the end of the run (`ok` False after an
  error: then no collective with peers that may not answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from megatron_bridge.reshard import SyncStats
    from rlstack.rollout.base import Generation
    from rlstack.step.scoring import Scores
    from rlstack.workers.batch import Rollout


@dataclass
class StepBatch:
    """One step's scored batch, this data-parallel rank's share (what a source hands the trainer)."""

    prompts: list  # rlstack.data.dataset.Prompt of this rank's share
    gens: list[Generation]  # prompt_index into `prompts`
    scores: Scores
    rollout: Rollout  # the padded training batch of `gens`
    sync: SyncStats  # the weight sync this batch's weights came with
    gen_tokens: float  # tokens generated for the whole batch (all ranks)
    timings: dict = field(default_factory=dict)  # timing/* of the source's phases (timing/rollout_s at least)
    metrics: dict = field(default_factory=dict)  # the source's own metrics (engine counters, staleness)


class RolloutSource(Protocol):
    """Where a step's scored batch comes from (module docstring)."""

    def next_batch(self, step: int) -> StepBatch: ...

    def after_update(self, step: int) -> dict: ...

    def generate(self, prompts: list, step: int, greedy: bool) -> tuple[list, float]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self, ok: bool) -> None: ...
