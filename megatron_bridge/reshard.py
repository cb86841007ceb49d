"""Weight sync: the actor's Megatron TP/PP shards -> the rollout engine's TP layout, in place.

plan -> execute -> transport (as megatron-core's resharding is laid out):
- `plan_reshard` (pure data, cached per model and pair of layouts): for every rollout TP rank, each
  engine tensor as `Span`s, runs of rows (or columns) copied from one Megatron TP shard of one
  pipeline stage. The plan is derived by *tracing* `layouts.megatron_shard` / `layouts.vllm_shard`
  on index tensors (each HF row/column numbered), so the layouts are declared once, in layouts.py.
- `WeightSync.sync` moves only the spans each rank's engine needs, bucket by bucket (point-to-point
  inside the rank's model-parallel group, which holds a whole replica), and writes them straight
  into engine parameters (`engine.param_targets()`: the hf engine, vLLM on GPU) or stages them and
  feeds the engine's loader (vLLM on CPU repacks its weights). Everything (names, shapes, dtypes,
  on every rank) is validated before the first engine tensor is written.

Engine layouts (`engine_kind`, the engine's `target_layout` when written in place): "hf" = HF
checkpoint names and shapes (the transformers engine; the vLLM loader, where each rollout TP rank
fills only the rows its loader narrows to); "vllm" = vLLM's parameters (merged `qkv_proj` /
`gate_up_proj`, vocabulary padded to 64 and split over rollout TP). What the sync asks of an engine
is `megatron_bridge.sync_target.SyncTarget`; both syncs share its steps (`_write_engine`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bridge import layouts
from megatron_bridge.errors import InputError
from megatron_bridge.mappings import expert_offset, layer_offset, owner_ep, owner_stage, param_maps, to_local_name
from megatron_bridge.sync_target import TARGET_LAYOUTS as ENGINE_KINDS
from megatron_bridge.sync_target import SyncTarget


@dataclass(frozen=True)
class Span:
    """`length` rows (axis 0) or columns (axis 1) of a Megatron shard copied into an engine tensor."""

    src: Optional[str]  # Megatron parameter name, local to stage `src_pp`; None: zeros (vocab padding)
    src_tp: Optional[int]  # training TP rank that holds it; None: replicated, read the reader's own TP rank
    src_pp: int
    axis: int
    src_start: int
    dst_start: int
    length: int
    src_ep: Optional[int] = None  # routed expert: the training EP rank holding it; None: every EP rank


@dataclass(frozen=True)
class TensorPlan:
    name: str  # engine tensor name (HF names; vLLM parameter names for engine_kind "vllm")
    shape: tuple[int, ...]
    group: int  # index of the Megatron parameter it comes from; buckets never split a group
    spans: tuple[Span, ...]
    complete: bool  # every element is written (False: only the part a TP-sharded loader reads)


@dataclass(frozen=True)
class ReshardPlan:
    train_tp: int
    train_pp: int
    rollout_tp: int
    engine_kind: str
    sources: tuple[tuple[int, str, tuple[int, ...]], ...]  # (stage, local Megatron name, shard shape)
    group_numel: tuple[int, ...]  # elements of each group's full HF tensors (bucket sizing)
    ranks: tuple[tuple[TensorPlan, ...], ...]  # per rollout TP rank

    def tensors(self, rollout_tp_rank: int) -> tuple[TensorPlan, ...]:
        return self.ranks[rollout_tp_rank]


# ---------------------------------------------------------------------- plan (pure)


@functools.lru_cache(maxsize=64)
def plan_reshard(
    args,
    train_tp: int,
    train_pp: int,
    rollout_tp: int,
    engine_kind: str,
    te_spec: bool = False,
    divisible_by: int = 128,
    train_ep: int = 1,
) -> ReshardPlan:
    """Which span of which Megatron shard each rollout TP rank needs, for every engine tensor.

    A MoE's routed experts are split over `train_ep` data-parallel ranks; every rollout rank gets all
    of them (both engines hold whole experts), each span naming the EP rank it comes from.
    """
    if engine_kind not in ENGINE_KINDS:
        raise ValueError(f"engine_kind={engine_kind!r} is unknown: use one of {', '.join(ENGINE_KINDS)}")
    if rollout_tp > 1:
        layouts.vllm_kv_heads(args, rollout_tp)  # raises naming the fix when heads do not divide
    maps = [m for m in param_maps(args, te_spec) if m.export]
    sources, numel, ranks = [], [], [[] for _ in range(rollout_tp)]
    for group, m in enumerate(maps):
        stage = owner_stage(m, args, train_pp)
        ep_rank = owner_ep(m, args, train_ep)
        e_offset = expert_offset(args, ep_rank, train_ep) if ep_rank is not None else 0
        local = to_local_name(m.megatron, layer_offset(args, stage, train_pp), e_offset)
        axis = 1 if m.transform == "row" else 0
        ids = _id_tensors(m.hf_shapes, axis)
        shards = [layouts.megatron_shard(m.transform, ids, t, train_tp, args, divisible_by) for t in range(train_tp)]
        sources.append((stage, local, _real_shape(tuple(shards[0].shape), m.hf_shapes[0], axis)))
        numel.append(sum(_numel(s) for s in m.hf_shapes))
        where = _locate(shards, sum(s[axis] for s in m.hf_shapes))
        replicated = m.transform == "replicate"
        for j in range(rollout_tp):
            for name, dst_ids, shape in _engine_tensors(m, ids, axis, j, rollout_tp, engine_kind, args):
                spans = _spans(dst_ids, where, local, stage, axis, replicated, ep_rank)
                ranks[j].append(TensorPlan(name, shape, group, spans, complete=bool((dst_ids >= 0).all())))
    return ReshardPlan(
        train_tp, train_pp, rollout_tp, engine_kind, tuple(sources), tuple(numel), tuple(tuple(r) for r in ranks)
    )


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _id_tensors(hf_shapes, axis: int) -> list[torch.Tensor]:
    """Each HF tensor reduced to its split axis, numbered 1.. across the group (0 marks padding)."""
    out, base = [], 0
    for shape in hf_shapes:
        n = shape[axis]
        ids = torch.arange(base + 1, base + n + 1, dtype=torch.int64)
        out.append(ids if len(shape) == 1 else ids.view(n, 1) if axis == 0 else ids.view(1, n))
        base += n
    return out


def _real_shape(traced: tuple[int, ...], hf_shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """A traced shape ([n, 1] or [1, n]) with the HF tensor's other dimension put back."""
    if len(hf_shape) == 1:
        return traced
    return (traced[0], hf_shape[1]) if axis == 0 else (hf_shape[0], traced[1])


def _locate(shards: list[torch.Tensor], num_ids: int) -> tuple[torch.Tensor, torch.Tensor]:
    """id -> (TP rank, position along the split axis) of the shard holding it."""
    tp_of = torch.full((num_ids + 1,), -1, dtype=torch.int64)
    pos_of = torch.full((num_ids + 1,), -1, dtype=torch.int64)
    for t, shard in enumerate(shards):
        flat = shard.reshape(-1)
        real = flat > 0
        tp_of[flat[real]] = t
        pos_of[flat[real]] = torch.arange(flat.numel())[real]
    assert bool((tp_of[1:] >= 0).all()), "a Megatron layout dropped part of an HF tensor"
    return tp_of, pos_of


def _engine_tensors(m, ids, axis: int, j: int, k: int, engine_kind: str, args):
    """(name, ids along the split axis, shape) of rollout rank j's tensors for one Megatron parameter.

    ids: > 0 the HF element to copy, 0 zero padding, -1 not read by this rank's loader.
    """
    if engine_kind == "vllm":
        shard = layouts.vllm_shard(m.transform, ids, j, k, args)
        yield _vllm_name(m), shard.reshape(-1), _real_shape(tuple(shard.shape), m.hf_shapes[0], axis)
        return
    pieces = layouts.vllm_pieces(m.transform, [tuple(t.shape) for t in ids], j, k, args)
    for name, full, piece, shape in zip(m.hf, ids, pieces, m.hf_shapes):
        flat = full.reshape(-1)
        if piece.dim is not None and (piece.start, piece.stop) != (0, flat.numel()):
            needed = torch.full_like(flat, -1)
            needed[piece.start : piece.stop] = flat[piece.start : piece.stop]
            flat = needed
        yield name, flat, tuple(shape)


def _vllm_name(m) -> str:
    """vLLM merges q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (vllm/model_executor/models/llama.py)."""
    if m.transform == "qkv":
        return m.hf[0].replace(".q_proj.", ".qkv_proj.")
    if m.transform == "gate_up":
        return m.hf[0].replace(".gate_proj.", ".gate_up_proj.")
    return m.hf[0]


def _spans(
    dst_ids: torch.Tensor, where, src: str, stage: int, axis: int, replicated: bool, ep_rank: Optional[int] = None
) -> tuple[Span, ...]:
    """Runs of consecutive destination positions fed by consecutive positions of one shard."""
    tp_of, pos_of = where
    n = dst_ids.numel()
    data = dst_ids > 0
    kind = torch.where(data, 1, torch.where(dst_ids == 0, 0, -1))  # [n]
    safe = dst_ids.clamp(min=0)
    tp = torch.where(data, tp_of[safe], -2)
    pos = torch.where(data, pos_of[safe], 0)
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = (kind[1:] != kind[:-1]) | (tp[1:] != tp[:-1]) | (data[1:] & (pos[1:] != pos[:-1] + 1))
    starts = brk.nonzero().squeeze(-1).tolist()
    spans = []
    for a, b in zip(starts, starts[1:] + [n]):
        if kind[a] == 1:
            tp_src = None if replicated else int(tp[a])
            spans.append(Span(src, tp_src, stage, axis, int(pos[a]), a, b - a, src_ep=ep_rank))
        elif kind[a] == 0:
            spans.append(Span(None, None, stage, axis, 0, a, b - a))
    return tuple(spans)


# ---------------------------------------------------------------------- zero copy (colocated, pure)


def alias_view(t: TensorPlan, source: torch.Tensor) -> Optional[torch.Tensor]:
    """A view of `source` (the rank's own Megatron shard) holding engine tensor `t`, or None.

    Possible when the spans are rows of one shard in equal runs at a constant stride: one run is the
    engine tensor itself (`t.shape`); several (q, k or v rows inside Megatron's per-group fused QKV)
    give a grouped view [runs, run_rows, *rest] that the engine uses through a grouped projection.
    A span of columns must be the whole shard (row-parallel weights at TP1).
    """
    spans = t.spans
    if not t.complete or not spans or any(s.src is None or s.src != spans[0].src for s in spans):
        return None
    if not source.is_contiguous():
        return None
    if spans[0].axis == 1:
        whole = len(spans) == 1 and spans[0].src_start == 0 and tuple(source.shape) == t.shape
        return source if whole else None
    run, rest = spans[0].length, tuple(source.shape[1:])
    starts = [s.src_start for s in spans]
    gap = starts[1] - starts[0] if len(starts) > 1 else run
    regular = all(s.length == run for s in spans) and all(b - a == gap for a, b in zip(starts, starts[1:]))
    if not regular or gap < run or tuple(t.shape[1:]) != rest or len(spans) * run != t.shape[0]:
        return None
    row = 1
    for d in rest:
        row *= d
    inner = tuple(source.stride()[1:])
    offset = source.storage_offset() + starts[0] * row
    if len(spans) == 1:
        return source.as_strided(t.shape, (row, *inner), offset)
    return source.as_strided((len(spans), run, *rest), (gap * row, row, *inner), offset)


# ---------------------------------------------------------------------- execute


@dataclass
class SyncStats:
    seconds: float = 0.0
    bytes: int = 0  # bytes written into the engine from Megatron shards (local copies + received)
    bytes_received: int = 0  # the part that came from other ranks
    aliased_bytes: int = 0  # engine tensors that are views of the actor's own parameters (zero copy)
    engine_weight_bytes: Optional[int] = None  # the engine's parameter storages not shared with the actor
    peak_extra_bytes: int = 0  # transport buffers + staged engine tensors, at their largest
    verify_max_diff: Optional[float] = None  # engine vs actor log-probs on a probe after this sync, if checked

    def as_metrics(self) -> dict:
        out = {
            "sync/seconds": self.seconds,
            "sync/bytes": self.bytes,
            "sync/bytes_received": self.bytes_received,
            "sync/peak_extra_bytes": self.peak_extra_bytes,
            "sync/aliased_bytes": self.aliased_bytes,
        }
        if self.engine_weight_bytes is not None:
            out["sync/engine_weight_bytes"] = self.engine_weight_bytes
        if self.verify_max_diff is not None:
            out["sync/verify_max_diff"] = self.verify_max_diff
        return out


@dataclass
class _Bucket:
    tensors: list  # indices into this rank's plan tensors
    local: list  # (tensor index, Span): copies from this rank's own shards, and zero fills
    reads: dict  # source rank -> [(tensor index, Span, element offset in the source's message / outbox)]
    sends: dict  # p2p: reader rank -> [span key], in the reader's plan order
    outbox: dict  # shm: span key -> element offset; each span published once, read by every reader


def unwrap_params(model) -> dict[str, torch.Tensor]:
    """The named parameters of `model` under megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return dict(model.named_parameters())


def plan_layout(engine: SyncTarget) -> str:
    """The layout the plan writes in: the engine's own where it is written in place, else the
    loader's HF names."""
    return engine.target_layout if engine.param_targets() is not None else "hf"


def span_numel(src_shapes: dict, key) -> int:
    """Elements of span `key` = (Megatron name, stage, axis, start, length) of a source of that shape."""
    name, stage, axis, _, length = key
    shape = src_shapes[(stage, name)]
    return length * (1 if len(shape) == 1 else shape[1 - axis])


def bucket_of_groups(group_numel, elem: int, bucket_bytes: int) -> list[int]:
    """The bucket index of each parameter group: groups in order, a new bucket once `bucket_bytes` is full."""
    of_group, size, index = [], 0, 0
    for numel in group_numel:  # same on every rank: derived from the model config only
        if size and size + numel * elem > bucket_bytes:
            index, size = index + 1, 0
        of_group.append(index)
        size += numel * elem
    return of_group


def _write_engine(engine: SyncTarget, tensors, buckets, fill, targets, dtype, device) -> None:
    """Every engine tensor of `tensors` written, bucket by bucket: in place into `targets` (then
    `engine.weights_updated()`), or (targets None) staged one bucket at a time and fed to the
    engine's loader, which pulls them (ranks advance together).

    `fill(index, bucket, target, staged_bytes)` writes the bucket's spans through `target(i)`, the
    engine tensor of `tensors[i]`; `bucket.tensors` lists the indices a bucket holds.
    """
    if targets is not None:
        for index, b in enumerate(buckets):
            fill(index, b, lambda i: targets[tensors[i].name], 0)
        engine.weights_updated()
        return

    def staged():
        for index, b in enumerate(buckets):
            # Rows a TP-sharded loader never reads (TensorPlan.complete False) stay uninitialised.
            out = {i: torch.empty(tensors[i].shape, dtype=dtype, device=device) for i in b.tensors}
            fill(index, b, out.__getitem__, sum(t.numel() * t.element_size() for t in out.values()))
            for i in b.tensors:
                yield tensors[i].name, out.pop(i)

    engine.load_weights(staged())


def _missing(engine: SyncTarget, names) -> str:
    return f"the engine ({type(engine).__name__}) has no tensor {names[:4]}"


class WeightSync:
    """Writes the actor's current weights into `engine` on every rank. All ranks call `sync()` together.

    The schedule (which spans each rank sends and reads, bucket by bucket) is computed once here.
    Transport: "shm" (ranks of one host: each rank publishes the spans others need into its own
    shared-memory outbox, two slots alternating, one barrier per bucket; a remote byte is copied
    twice, a local one once) or "p2p" (torch.distributed isend/irecv: NCCL on GPUs, across hosts).

    `zero_copy`: where the engine needs exactly the rank's own shards (a model-parallel group of one:
    training TP1 x PP1, colocated) and dtype and device agree, the engine's tensors become views of
    the actor's parameters (`engine.alias_weights`); the sync then moves 0 bytes for them and copies
    only the rest. Each sync re-checks that the views still point at the actor's storage (a
    parameter rebound by a checkpoint load or offload is aliased again).
    """

    def __init__(
        self,
        model,
        args,
        groups,
        engine,
        bucket_mb: float = 64,
        divisible_by: int = 128,
        transport: str = "auto",
        zero_copy: bool = False,
    ):
        if bucket_mb <= 0:
            raise InputError(f"rollout.sync_bucket_mb={bucket_mb} must be positive")
        if transport not in ("auto", "shm", "p2p"):
            raise InputError(f"transport={transport!r} is unknown: use auto, shm or p2p")
        self.groups, self.engine = groups, engine
        self.params = unwrap_params(model)
        te_spec = any(n.endswith("layer_norm_weight") for n in self.params)
        self.direct = engine.param_targets() is not None
        self.ep = groups.dims.ep
        layout = plan_layout(engine)
        self.plan = plan_reshard(
            args, groups.dims.tp, groups.dims.pp, engine.tp_size, layout, te_spec, divisible_by, train_ep=self.ep
        )
        self.mine = self.plan.tensors(engine.tp_rank)
        self.src_shapes = {(stage, name): shape for stage, name, shape in self.plan.sources}
        some = next(iter(self.params.values()))
        self.dtype, self.device = some.dtype, some.device
        peers = _gather_layout(groups, engine)
        # My replica: the model-parallel group, times the EP group that splits a MoE's experts
        # (EP ranks are data-parallel ranks dp // ep alike; megatron_bridge.parallel._check_ep).
        members = sorted(r for r, p in peers.items() if p[0] // self.ep == peers[groups.rank][0] // self.ep)
        one_host = len({peers[r][4] for r in members}) == 1
        if transport == "shm" and not (one_host and self.device.type == "cpu"):
            raise InputError("transport=shm needs CPU tensors and a model-parallel group on one host: use p2p")
        # A group of one (training TP1 x PP1) copies locally only: no transport at all.
        self.shm = len(members) > 1 and (
            transport == "shm" or (transport == "auto" and one_host and self.device.type == "cpu")
        )
        self.aliased: dict[str, str] = {}  # engine tensor name -> Megatron parameter it is a view of
        self._zero_copy = zero_copy and members == [groups.rank] and self.direct
        if self._zero_copy:
            self.aliased = self._alias()
        self._schedule_args = (peers, members, int(bucket_mb * (1 << 20)))
        self.buckets, slot_numel = self._schedule(*self._schedule_args)
        self.boxes, self.slot_numel = _open_outboxes(groups, members, slot_numel, self.dtype) if self.shm else ({}, {})
        self.last: Optional[SyncStats] = None

    def _schedule(self, peers: dict, members: list[int], bucket_bytes: int):
        """Every route of this model-parallel group: (bucket, reader, tensor, span) -> source rank."""
        me, table = self.groups.rank, {(dp, tp, pp): r for r, (dp, tp, pp, _, _) in peers.items()}
        elem = torch.empty((), dtype=self.dtype).element_size()
        of_group = bucket_of_groups(self.plan.group_numel, elem, bucket_bytes)
        buckets = [_Bucket([], [], {}, {}, {}) for _ in range(of_group[-1] + 1 if of_group else 1)]
        used = {}  # (bucket, source, reader or None) -> elements so far in that message / outbox
        outboxes = {}  # (bucket, source) -> {span key: offset}
        for reader in members:
            dp, tp, _, j, _ = peers[reader]
            for i, t in enumerate(self.plan.tensors(j)):
                if reader == me and t.name in self.aliased:
                    continue  # a view of the actor's own parameter: nothing to move
                b = of_group[t.group]
                if reader == me:
                    buckets[b].tensors.append(i)
                for s in t.spans:
                    src_dp = dp if s.src_ep is None else dp // self.ep * self.ep + s.src_ep
                    q = reader if s.src is None else table[(src_dp, tp if s.src_tp is None else s.src_tp, s.src_pp)]
                    if q == reader:
                        if reader == me:
                            buckets[b].local.append((i, s))
                        continue
                    key = (s.src, s.src_pp, s.axis, s.src_start, s.length)
                    if self.shm:
                        box = outboxes.setdefault((b, q), {})
                        if key not in box:
                            box[key] = used.get((b, q, None), 0)
                            used[(b, q, None)] = box[key] + self._numel(key)
                        offset = box[key]
                    else:
                        offset = used.get((b, q, reader), 0)
                        used[(b, q, reader)] = offset + self._numel(key)
                    if reader == me:
                        buckets[b].reads.setdefault(q, []).append((i, s, offset))
                    if q == me and not self.shm:
                        buckets[b].sends.setdefault(reader, []).append(key)
        for b, bucket in enumerate(buckets):
            bucket.outbox = outboxes.get((b, me), {})
        slot_numel = {
            q: max([n for (_, src, r), n in used.items() if src == q and r is None], default=1) for q in members
        }
        return buckets, slot_numel

    def _numel(self, key) -> int:
        return span_numel(self.src_shapes, key)

    def _span(self, key) -> torch.Tensor:
        name, _, axis, start, length = key
        return self.params[name].narrow(axis, start, length)

    # ------------------------------------------------------------------ zero copy

    def _views(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Engine tensor name -> (Megatron name, view of it) where the engine can alias the actor."""
        targets = self.engine.param_targets()
        out = {}
        for t in self.mine:
            source = self.params.get(t.spans[0].src) if t.spans else None
            dst = targets.get(t.name)
            if source is None or dst is None or (source.dtype, source.device) != (dst.dtype, dst.device):
                continue
            view = alias_view(t, source.detach())
            if view is not None:
                out[t.name] = (t.spans[0].src, view)
        return out

    def _alias(self) -> dict[str, str]:
        views = self._views()
        done = self.engine.alias_weights({name: view for name, (_, view) in views.items()})
        return {name: views[name][0] for name in sorted(done)}

    def _aliases_hold(self) -> bool:
        """Every aliased engine tensor still is the view the actor's current storage gives."""
        views, targets = self._views(), self.engine.param_targets()
        for name in self.aliased:
            if name not in views or name not in targets:
                return False
            a, b = views[name][1], targets[name]
            if (a.data_ptr(), a.shape, a.stride()) != (b.data_ptr(), b.shape, b.stride()):
                return False
        return True

    def _resident(self, stats: SyncStats, targets: dict[str, torch.Tensor]) -> None:
        """Aliased bytes, and the bytes of engine storages the actor does not share (unique storages)."""
        actor = {p.untyped_storage().data_ptr() for p in self.params.values()}
        own = {}
        for name, t in targets.items():
            storage = t.untyped_storage()
            if storage.data_ptr() in actor:
                if name in self.aliased:
                    stats.aliased_bytes += t.numel() * t.element_size()
            else:
                own[storage.data_ptr()] = storage.nbytes()
        stats.engine_weight_bytes = sum(own.values())

    # ------------------------------------------------------------------ sync

    def sync(self) -> SyncStats:
        start = time.perf_counter()
        if self._zero_copy and not self._aliases_hold():
            self.aliased = self._alias()
            self.buckets, _ = self._schedule(*self._schedule_args)
        targets = self._validate()
        stats = SyncStats()

        def fill(index, b, target, staged_bytes):
            self._run_bucket(index, b, target, stats, staged_bytes=staged_bytes)

        with torch.no_grad():
            _write_engine(self.engine, self.mine, self.buckets, fill, targets, self.dtype, self.device)
            if targets is not None:
                self._resident(stats, targets)
        stats.seconds = time.perf_counter() - start
        self.last = stats
        return stats

    def _run_bucket(
        self, index: int, b: _Bucket, target: Callable[[int], torch.Tensor], stats: SyncStats, staged_bytes: int
    ) -> None:
        elem = torch.empty((), dtype=self.dtype).element_size()
        if self.shm:
            inboxes, wait = self._publish(index, b)
            buffers = 2 * self.slot_numel[self.groups.rank] * elem
        else:
            inboxes, wait = self._exchange(b)
            buffers = sum(t.numel() * elem for t in inboxes.values()) + sum(
                self._numel(k) * elem for ks in b.sends.values() for k in ks
            )
        for i, s in b.local:  # overlaps the transfers
            dst = target(i).narrow(s.axis, s.dst_start, s.length)
            if s.src is None:
                dst.zero_()
            else:
                dst.copy_(self.params[s.src].narrow(s.axis, s.src_start, s.length))
                stats.bytes += dst.numel() * elem
        wait()
        for q, items in b.reads.items():
            for i, s, offset in items:
                dst = target(i).narrow(s.axis, s.dst_start, s.length)
                dst.copy_(inboxes[q][offset : offset + dst.numel()].view(dst.shape))
                stats.bytes += dst.numel() * elem
                stats.bytes_received += dst.numel() * elem
        stats.peak_extra_bytes = max(stats.peak_extra_bytes, buffers + staged_bytes)

    def _publish(self, index: int, b: _Bucket):
        """shm: copy the spans others read into my outbox slot; the barrier makes every slot readable."""
        import torch.distributed as dist

        slot = index % 2  # slot reuse two buckets later is safe: everyone passed the barrier in between
        mine = self.boxes[self.groups.rank]
        base = slot * self.slot_numel[self.groups.rank]
        for key, offset in b.outbox.items():
            src = self._span(key)
            mine[base + offset : base + offset + src.numel()].view(src.shape).copy_(src)
        inboxes = {q: self.boxes[q][slot * self.slot_numel[q] : (slot + 1) * self.slot_numel[q]] for q in b.reads}
        return inboxes, lambda: dist.barrier(group=self.groups.replica_group)

    def _exchange(self, b: _Bucket):
        """p2p: one packed message per (sender, reader) pair and bucket."""
        import torch.distributed as dist

        sends = {r: self._pack(keys) for r, keys in b.sends.items()}
        recvs = _receive_buffers(b.reads, self._numel, self.dtype, self.device)
        ops = [dist.P2POp(dist.isend, buf, r) for r, buf in sends.items()]
        ops += [dist.P2POp(dist.irecv, buf, q) for q, buf in recvs.items()]
        requests = dist.batch_isend_irecv(ops) if ops else []
        return recvs, lambda: [req.wait() for req in requests]

    def _pack(self, keys: list) -> torch.Tensor:
        buf = torch.empty(sum(self._numel(k) for k in keys), dtype=self.dtype, device=self.device)
        offset = 0
        for key in keys:
            src = self._span(key)
            buf[offset : offset + src.numel()].view(src.shape).copy_(src)
            offset += src.numel()
        return buf

    # ------------------------------------------------------------------ validation

    def _validate(self) -> Optional[dict[str, torch.Tensor]]:
        """Check every name and shape on every rank before any engine tensor is written."""
        import torch.distributed as dist

        problems = self._source_problems()
        targets = expert_views(self.engine.param_targets()) if self.direct else None
        if targets is not None:
            have = {n: tuple(t.shape) for n, t in targets.items()}
        else:  # a loader's checkpoint names (vLLM on CPU); fused expert names from a transformers model split
            have = expert_shapes(self.engine.expected_shapes())
        have = {n: s for n, s in have.items() if n not in self.aliased}  # aliased: grouped views, not written
        want = {t.name: t.shape for t in self.mine if t.name not in self.aliased}
        missing, stale = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if missing:
            problems.append(_missing(self.engine, missing))
        if stale:
            problems.append(f"engine tensors {stale[:4]} have no Megatron source and would stay stale")
        problems += [
            f"{n}: engine shape {list(have[n])}, Megatron layout gives {list(want[n])}"
            for n in sorted(set(want) & set(have))
            if have[n] != want[n]
        ]
        failed = torch.tensor([len(problems)], dtype=torch.int64, device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.groups.world)
        if problems:
            raise ValueError("weight sync aborted, nothing written: " + "; ".join(problems[:6]))
        if failed.item():
            raise ValueError("weight sync aborted, nothing written: another rank failed validation (see its error)")
        return targets

    def _source_problems(self) -> list[str]:
        problems = []
        for stage, name, shape in self.plan.sources:
            if stage != self.groups.pp_rank:
                continue
            p = self.params.get(name)
            if p is None:
                problems.append(f"Megatron parameter {name} is missing on pipeline stage {stage}")
            elif tuple(p.shape) != shape:
                problems.append(f"{name}: Megatron shard shape {list(p.shape)}, the plan expects {list(shape)}")
            elif p.dtype != self.dtype:
                problems.append(f"{name}: dtype {p.dtype}, other parameters {self.dtype}")
        return problems


# Engines keep a MoE layer's experts fused in one tensor: transformers 5's Qwen3MoeExperts
# `gate_up_proj` [E, 2M, H] (per expert [gate; up]) and `down_proj` [E, H, M], vLLM's FusedMoE
# `w13_weight` [E, 2M/tp, H] ([w1 = gate; w3 = up] per TP rank) and `w2_weight` [E, H, M/tp]. The plan
# names one tensor per expert (checkpoint names; vLLM's merged gate_up_proj); these are views into
# the fused tensors, so the sync writes them in place.
_FUSED_EXPERTS = {
    "gate_up_proj": (("gate_proj.weight", 0, 2), ("up_proj.weight", 1, 2)),  # transformers: halves of dim 1
    "down_proj": (("down_proj.weight", 0, 1),),
    "w13_weight": (("gate_up_proj.weight", 0, 1),),  # vLLM: already [gate_r; up_r] per expert
    "w2_weight": (("down_proj.weight", 0, 1),),
}


def expert_views(targets: Optional[dict[str, torch.Tensor]]) -> Optional[dict[str, torch.Tensor]]:
    """An engine's targets with each fused [E, ...] expert tensor replaced by per-expert views."""
    if targets is None:
        return None
    out = {}
    for name, t in targets.items():
        prefix, _, leaf = name.rpartition(".")
        parts = _FUSED_EXPERTS.get(leaf) if prefix.endswith("mlp.experts") and t.dim() == 3 else None
        if parts is None:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            for suffix, index, count in parts:
                rows = t.shape[1] // count
                out[f"{prefix}.{e}.{suffix}"] = t[e].narrow(0, index * rows, rows)
    return out


def expert_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`expert_views` on shapes alone: each fused [E, ...] expert shape -> one shape per expert."""
    out = {}
    for name, shape in shapes.items():
        prefix, _, leaf = name.rpartition(".")
        parts = _FUSED_EXPERTS.get(leaf) if prefix.endswith("mlp.experts") and len(shape) == 3 else None
        if parts is None:
            out[name] = tuple(shape)
            continue
        for e in range(shape[0]):
            for suffix, _, count in parts:
                out[f"{prefix}.{e}.{suffix}"] = (shape[1] // count, shape[2])
    return out


def _gather_layout(groups, engine) -> dict:
    """Global rank -> (dp rank, TP rank, PP rank, rollout TP rank, host), gathered once over the world."""
    import socket

    import torch.distributed as dist

    mine = (
        groups.rank,
        groups.dp_rank,
        groups.tp_rank,
        groups.pp_rank,
        engine.tp_rank,
        socket.gethostname(),
        engine.tp_size,
    )
    every = [None] * groups.dims.world_size
    dist.all_gather_object(every, mine, group=groups.world)
    sizes = {e[6] for e in every}
    if len(sizes) != 1:
        raise ValueError(f"rollout engines disagree on rollout TP size {sorted(sizes)}: build them from one config")
    return {e[0]: e[1:6] for e in every}


def _open_outboxes(groups, members: list[int], slot_numel: dict, dtype: torch.dtype):
    """Each rank's two-slot outbox in /dev/shm, mapped by every rank of its model-parallel group.

    The files are unlinked as soon as all ranks have mapped them: the mappings outlive the names,
    and nothing is left behind in /dev/shm when a process dies later.
    """
    import os
    import uuid

    import torch.distributed as dist

    token = [uuid.uuid4().hex if groups.rank == members[0] else None]
    dist.broadcast_object_list(token, src=members[0], group=groups.replica_group)
    path = lambda r: f"/dev/shm/rlstack-sync-{token[0]}-{r}"  # noqa: E731
    boxes = {
        groups.rank: torch.from_file(path(groups.rank), shared=True, size=2 * slot_numel[groups.rank], dtype=dtype)
    }
    boxes[groups.rank].zero_()  # fault the pages in now, not during the first sync
    dist.barrier(group=groups.replica_group)
    page = 4096 // boxes[groups.rank].element_size()
    for r in members:
        if r != groups.rank:
            boxes[r] = torch.from_file(path(r), shared=True, size=2 * slot_numel[r], dtype=dtype)
            boxes[r][::page].sum()  # map every page of the peer's outbox into this process once
    dist.barrier(group=groups.replica_group)
    os.unlink(path(groups.rank))
    return boxes, slot_numel


def _receive_buffers(reads: dict, numel, dtype, device) -> dict:
    """One packed receive buffer per source rank: the spans it sends, in order (p2p transports)."""
    return {
        q: torch.empty(
            sum(numel((s.src, s.src_pp, s.axis, s.src_start, s.length)) for _, s, _ in items),
            dtype=dtype,
            device=device,
        )
        for q, items in reads.items()
    }


# ---------------------------------------------------------------------- split placement transport
#
# With split placement (megatron_bridge.parallel.SplitPlacement) the engines live on rollout-only
# ranks: the same plan (training TP/PP -> rollout TP) is executed across the two sides. Rollout rank
# R (replica i, rollout TP rank j) reads every span of plan.tensors(j) from the training rank of DP
# replica i % dp that holds it (replicas spread the sending), one packed message per (sender, reader)
# and bucket, point-to-point over the default group. Only the spans a reader's tensors need travel.


@dataclass
class _SplitBucket:
    sends: dict  # reader rank -> [span key] (on a training rank)
    reads: dict  # source rank -> [(tensor index, Span, element offset)] (on a rollout rank)
    zeros: list  # (tensor index, Span): vocabulary padding, filled locally
    tensors: list  # this rollout rank's tensor indices in the bucket


class SplitWeightSync:
    """Training ranks -> rollout-only ranks. Every rank of the world calls `sync()` together.

    `model`: the actor module on a training rank (None on a rollout rank); `engine`: the rollout
    engine on a rollout rank (None on a training rank); `layout`: (train tp, pp, dp); `position`: this
    training rank's (dp, tp, pp) rank (None on a rollout rank); `rollout_tp`: ranks per engine.
    """

    def __init__(
        self, model, engine, args, placement, layout, position, rollout_tp: int, bucket_mb: float = 64, dtype=None
    ):
        if bucket_mb <= 0:
            raise InputError(f"rollout.sync_bucket_mb={bucket_mb} must be positive")
        self.placement, self.engine = placement, engine
        self.train_tp, self.train_pp, self.train_dp = layout
        self.rollout_tp = rollout_tp
        self.params = unwrap_params(model) if model is not None else {}
        te_spec = any(n.endswith("layer_norm_weight") for n in self.params)
        written_in = "hf" if engine is None else plan_layout(engine)
        self.plan = plan_reshard(args, self.train_tp, self.train_pp, rollout_tp, written_in, te_spec)
        self.src_shapes = {(stage, name): shape for stage, name, shape in self.plan.sources}
        self.dtype = dtype or (next(iter(self.params.values())).dtype if self.params else torch.float32)
        self.device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        trainers = _gather_split_layout(placement, layout, position)
        self.buckets, self.total_bytes = self._schedule(trainers, int(bucket_mb * (1 << 20)))
        self.last: Optional[SyncStats] = None

    def _schedule(self, trainers: dict, bucket_bytes: int):
        """trainers: (dp, tp, pp) -> global rank. Routes of every rollout rank, kept for this rank."""
        pl, me = self.placement, self.placement.rank
        elem = torch.empty((), dtype=self.dtype).element_size()
        of_group = bucket_of_groups(self.plan.group_numel, elem, bucket_bytes)
        buckets = [_SplitBucket({}, {}, [], []) for _ in range(of_group[-1] + 1 if of_group else 1)]
        used, total = {}, 0
        for reader in pl.rollout_ranks:
            replica, j = divmod(reader - pl.num_train, self.rollout_tp)
            dp = replica % self.train_dp
            for i, t in enumerate(self.plan.tensors(j)):
                b = buckets[of_group[t.group]]
                if reader == me:
                    b.tensors.append(i)
                for s in t.spans:
                    if s.src is None:
                        if reader == me:
                            b.zeros.append((i, s))
                        continue
                    q = trainers[(dp, 0 if s.src_tp is None else s.src_tp, s.src_pp)]
                    key = (s.src, s.src_pp, s.axis, s.src_start, s.length)
                    offset = used.get((of_group[t.group], q, reader), 0)
                    used[(of_group[t.group], q, reader)] = offset + self._numel(key)
                    total += self._numel(key) * elem
                    if reader == me:
                        b.reads.setdefault(q, []).append((i, s, offset))
                    if q == me:
                        b.sends.setdefault(reader, []).append(key)
        return buckets, total

    def _numel(self, key) -> int:
        return span_numel(self.src_shapes, key)

    def sync(self) -> SyncStats:
        """Send (training rank) or receive and write (rollout rank) every bucket; stats of the whole sync."""
        start = time.perf_counter()
        stats = SyncStats(bytes=self.total_bytes, bytes_received=self.total_bytes)
        with torch.no_grad():
            if self.engine is None:
                for b in self.buckets:
                    self._send(b, stats)
            else:
                self._receive_all(stats)
        stats.seconds = time.perf_counter() - start
        self.last = stats
        return stats

    def _send(self, b: _SplitBucket, stats: SyncStats) -> None:
        import torch.distributed as dist

        bufs = {}
        for reader, keys in b.sends.items():
            buf = torch.empty(sum(self._numel(k) for k in keys), dtype=self.dtype, device=self.device)
            offset = 0
            for name, _, axis, start, length in keys:
                src = self.params[name].narrow(axis, start, length)
                buf[offset : offset + src.numel()].view(src.shape).copy_(src)
                offset += src.numel()
            bufs[reader] = buf
        stats.peak_extra_bytes = max(stats.peak_extra_bytes, sum(t.numel() * t.element_size() for t in bufs.values()))
        for req in [dist.isend(buf, reader, group=self.placement.full) for reader, buf in bufs.items()]:
            req.wait()

    def _receive_all(self, stats: SyncStats) -> None:
        assert (self.placement.rank - self.placement.num_train) % self.rollout_tp == self.engine.tp_rank
        mine = self.plan.tensors(self.engine.tp_rank)
        targets = self.engine.param_targets()
        if targets is not None:
            missing = sorted({t.name for t in mine} - set(targets))
            if missing:
                raise ValueError(f"weight sync: {_missing(self.engine, missing)}")

        def fill(index, b, target, staged_bytes):
            self._receive(b, target, stats)

        _write_engine(self.engine, mine, self.buckets, fill, targets, self.dtype, self.device)

    def _receive(self, b: _SplitBucket, target: Callable[[int], torch.Tensor], stats: SyncStats) -> None:
        import torch.distributed as dist

        recvs = _receive_buffers(b.reads, self._numel, self.dtype, self.device)
        stats.peak_extra_bytes = max(stats.peak_extra_bytes, sum(t.numel() * t.element_size() for t in recvs.values()))
        requests = [dist.irecv(buf, q, group=self.placement.full) for q, buf in recvs.items()]
        for i, s in b.zeros:
            target(i).narrow(s.axis, s.dst_start, s.length).zero_()
        for req in requests:
            req.wait()
        for q, items in b.reads.items():
            for i, s, offset in items:
                dst = target(i).narrow(s.axis, s.dst_start, s.length)
                dst.copy_(recvs[q][offset : offset + dst.numel()].view(dst.shape))


def _gather_split_layout(placement, layout, position) -> dict:
    """(dp, tp, pp) -> global rank of every training rank, gathered once over the whole world."""
    import torch.distributed as dist

    every = [None] * placement.world_size
    dist.all_gather_object(every, (placement.rank, position), group=placement.full)
    table = {pos: rank for rank, pos in every if pos is not None}
    tp, pp, dp = layout
    assert len(table) == tp * pp * dp == placement.num_train, (table, layout)
    return table
