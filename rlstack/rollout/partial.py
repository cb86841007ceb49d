"""Partial rollouts (`rollout.partial`, docs/placement.md "Partial rollouts").

In split placement with `rollout.staleness=k` the rollout ranks keep up to k batches queued. With
partial rollouts a queued batch is not generated to the end when it is requested: each weights
version the rollout ranks receive generates at most `chunk` more tokens of every unfinished sample
(`advance`). A weight update therefore interrupts the batches in flight: their unfinished samples
keep their tokens, log-probs and the versions that produced them, and continue under the new
weights (the partial response is prefilled again, under the new weights, as slime's
--partial-rollout and verl's partial_rollout do). When the trainer takes the batch (`finish`), what
is left is generated with the newest weights the rollout ranks hold.

The interrupts fall at the trainer's weight pushes, not at wall-clock moments: which token a
version produces is then a function of the run's configuration alone, so an in-flight batch saved
with a checkpoint (`InFlight.to_state`) and restored resumes exactly.

Sampling seeds: every engine call of a batch takes `seed(step, call)`, a value no other call of the
batch uses (the hf engine reseeds on a new value), so the samples do not depend on which calls came
before in the process (a resumed rollout rank has made none).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from rlstack.rollout.interface import Generation, SamplingParams


def chunk_tokens(cfg) -> int:
    """Tokens per sample per weights version: rollout.partial_chunk_tokens, or by default the share
    that lets a batch finish within the k versions it sees while queued (ceil(max_new_tokens / k))."""
    if cfg.partial_chunk_tokens > 0:
        return cfg.partial_chunk_tokens
    return max(1, math.ceil(cfg.max_new_tokens / max(1, cfg.staleness)))


@dataclass
class InFlight:
    """One queued batch on a rollout replica: its share of the request's samples, some unfinished."""

    prompts: list  # token ids of the replica's prompts (request order)
    prompt_index: list  # each prompt's index into the request's prompts
    seed_step: int  # the request's sampling step
    version: int  # the weights version the batch was requested with
    gens: list = field(default_factory=list)  # Generation per sample, prompt-major, `versions` per token
    calls: int = 0  # engine calls made for the batch (the next call's seed)
    generate_s: float = 0.0  # seconds generating it so far
    wait_weights_s: float = 0.0  # the rollout ranks' idle time before its request

    def unfinished(self, max_new_tokens: int) -> list[int]:
        """Indices of the samples that may still grow (stopped by a chunk's cap, not by eos or the limit)."""
        return [
            i for i, g in enumerate(self.gens) if g.finish_reason == "length" and len(g.response_ids) < max_new_tokens
        ]

    def to_state(self) -> dict:
        """JSON-safe (trainer_state.json; floats round-trip exactly through repr)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> InFlight:
        return cls(**{**state, "gens": [Generation(**g) for g in state["gens"]]})


def seed(params: SamplingParams, call: int) -> int:
    """The sampling seed of a batch's call-th engine call (call 0 is the synchronous path's seed + 1).
    stages.SEED_STRIDE apart per step, so calls of different batches do not collide below that many."""
    return params.seed + 1 + call


def start(engine, batch: InFlight, params: SamplingParams, chunk: int, version: int) -> None:
    """The first `chunk` tokens of each of the batch's n samples per prompt, under `version`."""
    if not batch.prompts:
        return
    call = dataclasses.replace(params, seed=seed(params, 0), max_new_tokens=min(chunk, params.max_new_tokens))
    batch.gens = [
        dataclasses.replace(
            g, prompt_index=batch.prompt_index[g.prompt_index], versions=[version] * len(g.response_ids)
        )
        for g in engine.generate(batch.prompts, call)
    ]
    batch.calls = 1


def advance(engine, batch: InFlight, params: SamplingParams, chunk: int, version: int) -> int:
    """Up to `chunk` more tokens (0: to the end) of every unfinished sample, under weights `version`:
    the partial response is the prompt of the continuation, its new tokens carry `version`. Returns the
    number of samples continued."""
    todo = batch.unfinished(params.max_new_tokens)
    if not todo:
        return 0
    rows = [batch.gens[i] for i in todo]
    left = [params.max_new_tokens - len(g.response_ids) for g in rows]
    caps = [min(chunk, n) if chunk > 0 else n for n in left]
    call = dataclasses.replace(params, n=1, seed=seed(params, batch.calls), max_new_tokens=max(caps))
    more = engine.generate([g.prompt_ids + g.response_ids for g in rows], call, max_new_tokens=caps)
    batch.calls += 1
    for i, g, m in zip(todo, rows, more):
        batch.gens[i] = dataclasses.replace(
            g,
            response_ids=g.response_ids + m.response_ids,
            logprobs=g.logprobs + m.logprobs,
            versions=g.versions + [version] * len(m.response_ids),
            finish_reason=m.finish_reason,
        )
    return len(todo)


def mask_older(gens: list, older_than: int) -> tuple[list, float]:
    """Tokens of a sample more than `older_than` weight versions older than its last token out of the
    loss (their `response_mask` 0; rollout.partial_mask_older_than). 0 is slime's
    --mask-offpolicy-in-partial-rollout: only the part generated under the weights that finished the
    sample trains. A sample never loses its last token (every row keeps one), and one generated under
    one version loses nothing (its staleness is bounded by rollout.staleness and corrected by
    algorithm.rollout_is). Returns the generations and the masked share of response tokens (0.0 with
    older_than < 0)."""
    total = sum(len(g.response_ids) for g in gens)
    if older_than < 0 or total == 0:
        return gens, 0.0
    out, masked = [], 0
    for g in gens:
        if not g.versions:
            out.append(g)
            continue
        newest = max(g.versions)
        keep = [int(newest - v <= older_than) for v in g.versions]
        mask = [a & b for a, b in zip(keep, g.response_mask or [1] * len(keep))]
        masked += len(keep) - sum(keep)
        out.append(dataclasses.replace(g, response_mask=mask) if 0 in keep else g)
    return out, masked / total


def interrupted_share(gens: list) -> float:
    """Share of samples whose tokens come from more than one weights version (interrupted by an update)."""
    if not gens:
        return 0.0
    return sum(1 for g in gens if g.versions and len(set(g.versions)) > 1) / len(gens)


class PartialQueue:
    """A rollout rank's queued batches with `rollout.partial` (rlstack.placement.serve drives it)."""

    def __init__(self, cfg, groups, engine):
        self.cfg, self.groups, self.engine = cfg, groups, engine  # RolloutConfig, rollout-side groups
        self.batches: list[InFlight] = []  # oldest first, at most rollout.staleness
        self.version = None  # the weights version the engine holds (None: not synced since start/restore)

    def _params(self, batch: InFlight) -> SamplingParams:
        from rlstack import stages

        return stages.sampling_params(self.cfg, batch.seed_step, greedy=False)

    def _timed(self, batch: InFlight, fn, *args) -> None:
        import time

        t0 = time.perf_counter()
        fn(*args)
        batch.generate_s += time.perf_counter() - t0

    def weights(self, version: int) -> None:
        """New weights arrived: every queued batch's unfinished samples go on under them, one chunk each
        (the interrupt: the tokens so far keep their versions)."""
        if version == self.version:
            return
        self.version = version
        for b in self.batches:
            self._timed(b, advance, self.engine, b, self._params(b), chunk_tokens(self.cfg), version)

    def request(self, prompts: list, seed_step: int, version: int, waited: float) -> None:
        """A queued request: this replica's share started with the weights held (one chunk)."""
        from rlstack import stages

        assert len(self.batches) < max(1, self.cfg.staleness), "more batches ahead than rollout.staleness"
        mine = stages.replica_share(len(prompts), self.cfg, self.groups)
        params = stages.sampling_params(self.cfg, seed_step, greedy=False)
        held = version if self.version is None else self.version
        b = InFlight([list(prompts[i]) for i in mine], mine, seed_step, version, wait_weights_s=waited)
        self._timed(b, start, self.engine, b, params, chunk_tokens(self.cfg), held)
        self.batches.append(b)

    def finish_oldest(self) -> tuple:
        """The oldest batch completed under the weights held (what is left of every sample), as the
        fields of this replica's part of a RolloutBatch: (gens, version, generate_s, wait_weights_s, tokens)."""
        b = self.batches.pop(0)
        self._timed(b, advance, self.engine, b, self._params(b), 0, self.version)
        tokens = float(sum(len(g.response_ids) for g in b.gens))
        return b.gens, b.version, b.generate_s, b.wait_weights_s, tokens

    def state(self) -> list:
        return [b.to_state() for b in self.batches]

    def restore(self, parts: list) -> None:
        """The queue saved with a checkpoint (`parts[replica]`: that replica's `state()`)."""
        replica = self.groups.rank // self.cfg.tp
        self.batches = [InFlight.from_state(s) for s in parts[replica]]
        self.version = None
