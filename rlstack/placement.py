"""Split placement: the last K ranks only roll out, the first N - K train (docs/placement.md).

Both sides run one protocol, driven by training rank 0 over the whole world
(`SplitPlacement.full`, through rlstack.collectives):

    request  broadcast a `RolloutRequest` (prompt token ids, sampling step, weights version);
             if it asks for a sync, the actor's shards travel to the engines (SplitWeightSync)
    receive  every rank all-gathers; the first rank of each rollout replica contributes its
             replica's `Generation`s, the training ranks nothing

A rollout rank (`serve`) loops: take a request, sync, generate, hand the batch over, wait for the
next request. The trainer (`RolloutClient`) decides when to request and when to receive: with
`rollout.staleness=0` it requests batch t with weights t and waits for it; with `staleness=1` it
requests batch t+1 with weights t right before training on batch t and receives it after the
update, so generation and training overlap and every batch is one step stale (the first is not).

A request with `stream=True` is handed over micro-batch by micro-batch (`stream_rounds` all-gathers),
so the training ranks score each part as it arrives (rlstack.step.split.SplitSource._stream).

vLLM engines run in a child process of each rollout rank (rlstack.rollout.vllm_subprocess: in-process
vLLM would build its groups collectively over every rank of the run's world); the weights reach them
through the same SplitWeightSync plan, fed to the engine's loader.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from rlstack import collectives

log = logging.getLogger("rlstack")


@dataclass
class RolloutRequest:
    kind: str  # "generate" | "receive" (hand over the oldest queued batch) | "stop"
    # rollout.partial also: "weights" (a sync only) | "snapshot" (hand over the queue's state) | "restore"
    prompts: list = field(default_factory=list)  # token ids of each prompt
    seed_step: int = 0  # sampling seed of this step (stages.sampling_params)
    version: int = 0  # the trainer step whose weights the batch is generated with
    greedy: bool = False
    sync: bool = True  # push the actor's current weights first
    stream: bool = False  # hand each generation micro-batch over as it finishes (`stream_rounds` all-gathers)
    max_new_tokens: int = 0  # > 0: this cap instead of rollout.max_new_tokens (the verify_sync probe)
    queue: bool = False  # keep the batch on the rollout ranks until a "receive" request (rollout.staleness)
    # "restore" (rollout.partial, on resume): each replica's queued in-flight batches, as "snapshot" gave them
    inflight: list = field(default_factory=list)
    resume: bool = False  # "stop": the training ranks stopped to be resumed (the rollout ranks exit 75 too)


@dataclass
class RolloutBatch:
    """One request's generations (prompt_index into the request's prompts) and the rollout side's timings."""

    gens: list  # rlstack.rollout.base.Generation, prompt order
    version: int  # trainer step of the weights that generated it
    generate_s: float  # rollout ranks busy generating
    wait_weights_s: float  # rollout ranks idle from handing over the last batch until the weights arrived
    tokens: float
    stop: str = ""  # a rollout rank's stop signal ("SIGUSR1 on rollout rank 1"): the training ranks stop too

    def to_state(self) -> dict:
        """JSON-safe (checkpoint trainer_state.json; floats round-trip exactly through repr)."""
        return dict(dataclasses.asdict(self))

    @classmethod
    def from_state(cls, state: dict) -> RolloutBatch:
        from rlstack.rollout.base import Generation

        return cls(**{**state, "gens": [Generation(**g) for g in state["gens"]]})


@dataclass
class _Prompt:
    input_ids: list  # what stages.generate reads of a prompt


# ---------------------------------------------------------------------- training side


class RolloutClient:
    """The training ranks' end of the protocol (every training rank calls each method together)."""

    def __init__(self, placement, weight_sync, device, cfg_rollout=None):
        self.placement, self.weight_sync, self.device = placement, weight_sync, device
        self.cfg_rollout = cfg_rollout  # RolloutConfig (stream rounds)
        self.last_stream = None

    def request(self, req: RolloutRequest):
        """Send `req`; with `req.sync` the weights go too. Returns the sync's SyncStats or None."""
        collectives.broadcast_object(req, 0, self.placement.full, self.device)
        return self.weight_sync.sync() if req.sync else None

    def receive_queued(self) -> tuple[RolloutBatch, float]:
        """The oldest batch the rollout ranks queued (`RolloutRequest.queue`) and the seconds waited."""
        t0 = time.perf_counter()
        collectives.broadcast_object(RolloutRequest("receive", sync=False), 0, self.placement.full, self.device)
        batch, _ = self.receive()
        return batch, time.perf_counter() - t0

    def receive_parts(self) -> tuple[list, float]:
        """What each rollout replica handed over for the last request (replica order), and the seconds waited."""
        t0 = time.perf_counter()
        parts = collectives.all_gather_objects(None, self.placement.full, self.placement.world_size)
        return [p for p in parts if p is not None], time.perf_counter() - t0

    def receive(self) -> tuple[RolloutBatch, float]:
        """The batch of the last request and the seconds this rank waited for it."""
        t0 = time.perf_counter()
        parts = collectives.all_gather_objects(None, self.placement.full, self.placement.world_size)
        waited = time.perf_counter() - t0
        mine = [p for p in parts if p is not None]
        assert mine, "no rollout replica reported a batch"
        stop = next((p.stop for p in mine if p.stop), "")
        if stop:  # a stop signal reached a rollout rank: stop after this step, as for a training rank's
            from rlstack import preemption

            preemption.remote_stop(stop)
        gens = [g for p in mine for g in p.gens]
        return dataclasses.replace(mine[0], gens=gens, tokens=sum(p.tokens for p in mine), stop=""), waited

    def generate(self, prompts: list, step: int, version: int, greedy: bool, sync: bool = True):
        """Synchronous: current weights (unless `sync` is False), then `prompts` (objects with `.input_ids`)
        generated. Returns (RolloutBatch, seconds waited for it, the sync's SyncStats or None)."""
        ids = [list(p.input_ids) for p in prompts]
        sync = self.request(RolloutRequest("generate", ids, step, version, greedy, sync=sync))
        batch, waited = self.receive()
        return batch, waited, sync

    def stream(self, req: RolloutRequest):
        """Send `req` (stream=True) and yield each round's generations as they arrive, in prompt order.

        After the last round `self.last_stream` holds (RolloutBatch of the rollout side's totals,
        gens empty; the sync's SyncStats; seconds waited in all).
        """
        req = dataclasses.replace(req, stream=True)
        sync = self.request(req)
        waited, meta = 0.0, None
        for _ in range(stream_rounds(len(req.prompts), self.cfg_rollout, self.placement.num_rollout)):
            batch, w = self.receive()
            waited += w
            meta = batch
            yield batch.gens
        self.last_stream = (dataclasses.replace(meta, gens=[]), sync, waited)

    def stop(self) -> None:
        from rlstack import preemption

        req = RolloutRequest("stop", sync=False, resume=preemption.stop_requested())
        collectives.broadcast_object(req, 0, self.placement.full, self.device)
        if req.resume:  # wait for the rollout ranks to close their engines (see serve)
            collectives.all_gather_objects(None, self.placement.full, self.placement.world_size)


# ---------------------------------------------------------------------- rollout side


def rollout_side_groups(placement, device):
    """A ParallelGroups view of the rollout ranks alone, as stages.generate and build_engine read it."""
    from megatron_bridge.parallel import ParallelDims, ParallelGroups

    k, rank = placement.num_rollout, placement.rank - placement.num_train
    return ParallelGroups(
        dims=ParallelDims(tp=1, pp=1, dp=k, world_size=k),
        rank=rank,
        local_rank=rank,
        tp_rank=0,
        pp_rank=0,
        dp_rank=rank,
        tp=None,
        pp=None,
        dp=placement.rollout,
        mp=None,
        embd=None,
        world=placement.rollout,
        device=device,
    )


@dataclass
class RolloutSide:
    """What a rollout-only rank holds for the whole run."""

    cfg: Any  # ExperimentConfig
    placement: Any  # megatron_bridge.parallel.SplitPlacement
    groups: Any  # rollout_side_groups(...)
    engine: Any
    weight_sync: Any  # megatron_bridge.reshard.SplitWeightSync (receiving end)


def build_rollout_side(cfg, placement, device) -> RolloutSide:
    """The engine and the receiving end of the weight sync on a rollout-only rank."""
    from megatron_bridge.hf import read_model_args, resolve_model_path
    from megatron_bridge.reshard import SplitWeightSync
    from rlstack import stages
    from rlstack.rollout.base import build_engine

    groups = rollout_side_groups(placement, device)
    hf_dir = resolve_model_path(cfg.model.path, tiny_spec=cfg.model.tiny, cache_dir=cfg.model.cache_dir)
    tokenizer = stages.load_tokenizer(hf_dir)
    if cfg.rollout.engine == "vllm":  # in a child process: vLLM's groups over these ranks only
        from rlstack.rollout.vllm_subprocess import build_split_vllm

        engine = build_split_vllm(
            cfg.rollout, hf_dir, groups, placement, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
    else:
        engine = build_engine(cfg.rollout, hf_dir, groups, tokenizer.eos_token_id, tokenizer.pad_token_id)
    layout = split_layout(cfg, placement)
    sync = SplitWeightSync(
        None, engine, read_model_args(hf_dir), placement, layout, None, cfg.rollout.tp, cfg.rollout.sync_bucket_mb
    )
    return RolloutSide(cfg, placement, groups, engine, sync)


def split_layout(cfg, placement) -> tuple[int, int, int]:
    """(tp, pp, dp) of the training ranks."""
    p = cfg.parallel
    return p.tp, p.pp, placement.num_train // (p.tp * p.pp)


def serve(side: RolloutSide) -> int:
    """A rollout rank's loop: request -> sync -> generate -> hand over, until "stop". Returns requests served."""
    from rlstack import preemption, stages
    from rlstack.rollout.partial import PartialQueue

    pl, cfg, served = side.placement, side.cfg, 0
    reports = side.groups.rank % cfg.rollout.tp == 0  # a replica's first rank reports for it (rollout.partial)
    idle_since = time.perf_counter()
    queued: list = []  # batches generated ahead (RolloutRequest.queue), oldest first: at most rollout.staleness
    partial = PartialQueue(cfg.rollout, side.groups, side.engine) if cfg.rollout.partial else None
    while True:
        req = collectives.broadcast_object(None, 0, pl.full, side.groups.device)
        if req.kind == "stop":
            if req.resume:  # the training ranks saved and stopped to be resumed: exit 75 with them
                preemption.request_stop("the training ranks' stop")
                # Close the engine before they exit: torchrun SIGTERMs every other rank as soon as one
                # exits non-zero (75), which would cut a vLLM child's shutdown (exit 143).
                side.engine.close()
                collectives.all_gather_objects(None, pl.full, pl.world_size)
            else:  # the run is complete (a signal in its last step changes nothing): exit 0 with them
                preemption.reset()
            return served
        if req.kind in ("receive", "snapshot"):
            if partial is None:
                part = queued.pop(0)
            else:  # each replica hands over its own share
                part = RolloutBatch(*partial.finish_oldest()) if req.kind == "receive" else partial.state()
                part = part if reports else None
            if req.kind == "receive":
                part = _flagged(part, pl)
            collectives.all_gather_objects(part, pl.full, pl.world_size)
            continue
        if req.kind == "restore":
            partial.restore(req.inflight)
            continue
        preemption.begin_step(req.seed_step + 1)  # the 1-based step this batch is for (engine errors name it)
        if req.sync:
            side.weight_sync.sync()
            if partial is not None:  # the batches in flight go on under the new weights
                partial.weights(req.version)
        waited = time.perf_counter() - idle_since
        if req.kind == "weights":
            continue
        if req.queue and partial is not None:
            partial.request(req.prompts, req.seed_step, req.version, waited)
            idle_since = time.perf_counter()
            served += 1
            continue
        if req.stream:
            _serve_stream(side, req, waited)
            idle_since = time.perf_counter()
            served += 1
            continue
        t0 = time.perf_counter()
        rollout_cfg = cfg.rollout
        if req.max_new_tokens > 0:
            rollout_cfg = dataclasses.replace(rollout_cfg, max_new_tokens=req.max_new_tokens)
        gens, tokens = stages.generate(
            side.engine, [_Prompt(ids) for ids in req.prompts], rollout_cfg, side.groups, req.seed_step, req.greedy
        )
        busy = time.perf_counter() - t0
        first = side.groups.rank == 0  # stages.generate gathered every replica's share on every rollout rank
        part = RolloutBatch(_versioned(gens, req.version), req.version, busy, waited, tokens) if first else None
        if req.queue:
            assert len(queued) < max(1, cfg.rollout.staleness), "more batches ahead than rollout.staleness"
            queued.append(part)
        else:
            collectives.all_gather_objects(_flagged(part, pl), pl.full, pl.world_size)
        idle_since = time.perf_counter()
        served += 1


def _flagged(part: Optional[RolloutBatch], pl) -> Optional[RolloutBatch]:
    """A hand-over carries this rollout rank's stop signal, if one came (`trainer.stop_signals`): the
    training ranks then stop after the step in flight. A rank that hands over nothing sends an empty batch."""
    from rlstack import preemption

    if not preemption.stop_requested():
        return part
    if part is None:
        part = RolloutBatch([], 0, 0.0, 0.0, 0.0)
    preemption.handed_over()
    return dataclasses.replace(part, stop=f"{preemption.reason()} on rollout rank {pl.rank}")


def _versioned(gens: list, version: int) -> list:
    """Each response token tagged with the weights version that produced it."""
    return [dataclasses.replace(g, versions=[version] * len(g.response_ids)) for g in gens]


def _chunk_prompts(cfg) -> int:
    """Prompts per engine call while streaming (as stages._chunks: one hf micro-batch of sequences)."""
    return max(1, cfg.micro_batch_size // cfg.n)


def stream_rounds(num_prompts: int, cfg, num_rollout: int) -> int:
    """Hand-overs of one streamed request: micro-batches of the largest replica share (both sides agree)."""
    replicas = num_rollout // cfg.tp
    largest = -(-num_prompts // replicas)
    return max(1, -(-largest // _chunk_prompts(cfg)))


def _serve_stream(side: RolloutSide, req: RolloutRequest, waited: float) -> None:
    """Generate the replica's share micro-batch by micro-batch; after each, every rank all-gathers it.

    The engine calls and their order are those of stages.generate (same sampling seeds and samples).
    """
    from rlstack import stages

    cfg, g, pl = side.cfg.rollout, side.groups, side.placement
    mine = stages.replica_share(len(req.prompts), cfg, g)
    params = stages.sampling_params(cfg, req.seed_step, req.greedy)
    size, busy, tokens = _chunk_prompts(cfg), 0.0, 0.0
    for r in range(stream_rounds(len(req.prompts), cfg, pl.num_rollout)):
        chunk = mine[r * size : (r + 1) * size]
        t0 = time.perf_counter()
        local = side.engine.generate([req.prompts[i] for i in chunk], params) if chunk else []
        busy += time.perf_counter() - t0
        gens = _versioned([dataclasses.replace(x, prompt_index=chunk[x.prompt_index]) for x in local], req.version)
        tokens += sum(len(x.response_ids) for x in gens)
        first = g.rank % cfg.tp == 0  # the replica's first rank reports for the replica
        part = RolloutBatch(gens, req.version, busy, waited, tokens) if first else None
        collectives.all_gather_objects(_flagged(part, pl), pl.full, pl.world_size)


def run_rollout_rank(cfg, placement, device) -> None:
    from rlstack import preemption

    side = build_rollout_side(cfg, placement, device)
    # trainer.stop_signals on this rank too: the next hand-over tells the training ranks (`_flagged`)
    preemption.arm(cfg.trainer.stop_signals, cfg.trainer.stop_grace_s, trains=False)
    try:
        served = serve(side)
        log.info("rollout rank %d: served %d requests", placement.rank, served)
    finally:
        preemption.disarm(cfg.trainer.stop_signals)
        side.engine.close()


def staleness_of(batch: RolloutBatch, step: int) -> int:
    return step - batch.version


def pending_state(pending: Optional[tuple[list, RolloutBatch]]) -> Optional[dict]:
    if pending is None:
        return None
    indices, batch = pending
    return {"indices": list(indices), "batch": batch.to_state()}


def pending_from_state(state: Optional[dict]) -> Optional[tuple[list, RolloutBatch]]:
    if not state:
        return None
    return list(state["indices"]), RolloutBatch.from_state(state["batch"])
