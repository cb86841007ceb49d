"""Parallel dims and process groups, over megatron-core's `parallel_state`.

`ParallelDims` validates early (before any process group exists) and `init_distributed` builds the
groups once and returns them in a `ParallelGroups` that callers pass on; library code never fetches
groups from `parallel_state` itself. NCCL (with gloo beside it) on CUDA, gloo on CPU. Both start
functions require `megatron_bridge.patches.apply()` to have run (the caller's start-up does it,
explicitly). The config-level checks (`check_layout(cfg)`) live in rlstack.parallel.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.errors import InputError
from megatron_bridge.patches.default_group import WorldSeenAs, restore_default_group, set_default_group


@dataclass(frozen=True)
class ParallelDims:
    tp: int
    pp: int
    dp: int
    world_size: int
    ep: int = 1  # expert parallel: experts split over groups of `ep` data-parallel ranks (inside DP)

    @classmethod
    def resolve(cls, tp: int, pp: int, dp: int, world_size: int, ep: int = 1) -> ParallelDims:
        """Fill dp=-1 from the world size; raise ValueError naming the number to change."""
        if tp < 1 or pp < 1:
            raise InputError(f"parallel.tp={tp} and parallel.pp={pp} must be at least 1")
        if world_size % (tp * pp) != 0:
            raise InputError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {tp}*{pp}: "
                f"change parallel.tp/parallel.pp or the number of processes (nproc_per_node x nnodes)"
            )
        if dp == -1:
            dp = world_size // (tp * pp)
        if tp * pp * dp != world_size:
            raise InputError(
                f"parallel.tp * parallel.pp * parallel.dp = {tp}*{pp}*{dp} = {tp * pp * dp} but the world "
                f"size is {world_size}: set parallel.dp={world_size // (tp * pp)} (or -1) or launch "
                f"{tp * pp * dp} processes"
            )
        _check_ep(ep, dp, tp, pp)
        return cls(tp=tp, pp=pp, dp=dp, world_size=world_size, ep=ep)

    def check_model(self, shape) -> None:
        """`shape`: a megatron_bridge.hf_config.ModelArgs (num_layers, num_attention_heads, num_query_groups)."""
        if shape.num_attention_heads % self.tp:
            raise InputError(
                f"parallel.tp={self.tp} does not divide the model's {shape.num_attention_heads} attention "
                f"heads: choose parallel.tp from {_divisors(shape.num_attention_heads, shape.num_query_groups)}"
            )
        if shape.num_query_groups % self.tp:
            raise InputError(
                f"parallel.tp={self.tp} does not divide the model's {shape.num_query_groups} key/value heads "
                f"(query groups): choose parallel.tp from "
                f"{_divisors(shape.num_attention_heads, shape.num_query_groups)}"
            )
        moe = getattr(shape, "moe", None)
        if self.ep > 1 and moe is None:
            raise InputError(f"parallel.ep={self.ep} needs a MoE model (this one is dense): set parallel.ep=1")
        if moe is not None and moe.num_experts % self.ep:
            raise InputError(
                f"parallel.ep={self.ep} does not divide the model's {moe.num_experts} experts: choose "
                f"parallel.ep from {_divisors(moe.num_experts, self.dp)}"
            )
        if shape.num_layers % self.pp:
            raise InputError(
                f"parallel.pp={self.pp} does not divide the model's {shape.num_layers} layers: choose "
                f"parallel.pp from {_divisors(shape.num_layers)}"
            )


def _check_ep(ep: int, dp: int, tp: int, pp: int) -> None:
    """EP lives inside data parallelism, as megatron lays it out.

    parallel_state.initialize_model_parallel builds the expert ranks with expert TP = TP (the
    default expert_tensor_parallel_size) and requires world % (TP x EP x PP) == 0 (RuntimeError
    otherwise); with world = TP x PP x DP that is: EP divides DP. Each EP group is `ep` consecutive
    data-parallel ranks (order tp-cp-ep-dp-pp), which share attention weights and split the experts.
    """
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise InputError(f"parallel.ep={ep!r} must be a positive integer (1: no expert parallelism)")
    if dp % ep:
        raise InputError(
            f"parallel.ep={ep} must divide the data-parallel size {dp} (world = tp {tp} x pp {pp} x dp {dp}; "
            f"megatron splits experts over data-parallel ranks): choose parallel.ep from {_divisors(dp)}"
        )


def _divisors(*numbers: int) -> list[int]:
    return [d for d in range(1, min(numbers) + 1) if all(n % d == 0 for n in numbers)]


@dataclass
class ParallelGroups:
    """Process groups built once at start-up and passed to workers and to the bridge."""

    dims: ParallelDims
    rank: int
    local_rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp: Any  # ProcessGroup
    pp: Any
    dp: Any
    mp: Any  # model parallel (tp x pp)
    embd: Optional[Any]  # first and last pipeline stage (tied embeddings); None at PP=1
    world: Any
    device: Any  # torch.device
    ep_rank: int = 0
    ep: Optional[Any] = None  # expert-parallel group (ranks holding different experts); None at EP=1
    # The ranks that together hold one whole model: TP x PP, times EP for a MoE (megatron's expert
    # tensor-model-pipeline group); the weight sync's peers.
    replica: Optional[Any] = None

    @property
    def replica_group(self):
        return self.replica if self.replica is not None else self.mp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1


def pick_backend(requested: str) -> str:
    import torch

    if requested != "auto":
        if requested == "nccl" and not torch.cuda.is_available():
            raise InputError("parallel.backend=nccl needs CUDA: use parallel.backend=gloo (or auto) on CPU")
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def process_group_backend(backend: str) -> str:
    """What `init_process_group` gets: with NCCL, gloo beside it for CPU tensors.

    NCCL alone refuses a CPU tensor (`No backend type associated with device type cpu`). rlstack's
    own reductions put their tensors on `groups.device` (rlstack.collectives); the gloo half keeps
    any CPU collective (an object gather, a library's CPU scalar) working. Sub-groups created
    later with `new_group(backend=None)`, as megatron's parallel_state does, inherit both.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def start_world(backend: str, timeout_minutes: int, world_size: int, rank: int) -> None:
    """The default process group (env:// as torchrun sets it, or a world of one on a free port)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    _default_rendezvous_env()
    dist.init_process_group(
        backend=process_group_backend(backend),
        timeout=datetime.timedelta(minutes=timeout_minutes),
        world_size=world_size,
        rank=rank,
        store=_restart_store(world_size, timeout_minutes),
    )


def _restart_store(world_size: int, timeout_minutes: float):
    """After a torchrun restart, the agent's TCPStore still holds the dead attempt's keys (torch adds
    no per-attempt prefix for workers): gloo would read the dead ranks' addresses and fail in
    connectFullMesh ("Connection refused"). Each attempt gets its own prefix; None on the first."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0:
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )
    return dist.PrefixStore(f"rlstack/attempt_{attempt}/", store)


def init_distributed(
    tp: int, pp: int, dp: int = -1, backend: str = "auto", timeout_minutes: int = 30, seed: int = 0, ep: int = 1
) -> ParallelGroups:
    """Start torch.distributed (env:// as torchrun sets it, or a world of one) and megatron groups."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_bridge import patches

    patches.require_applied()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.resolve(tp, pp, dp, world_size, ep=ep)
    backend = pick_backend(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    start_world(backend, timeout_minutes, world_size, int(os.environ.get("RANK", "0")))
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        distributed_timeout_minutes=timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return _collect_groups(dims, local_rank, backend)


def _default_rendezvous_env() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect_groups(dims: ParallelDims, local_rank: int, backend: str) -> ParallelGroups:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    # EP ranks are consecutive data-parallel ranks (the bridge's export and weight sync rely on it)
    assert dims.ep == 1 or ps.get_expert_model_parallel_rank() == ps.get_data_parallel_rank() % dims.ep
    return ParallelGroups(
        dims=dims,
        rank=dist.get_rank(),
        local_rank=local_rank,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        mp=ps.get_model_parallel_group(),
        embd=ps.get_embedding_group() if dims.pp > 1 else None,
        world=dist.group.WORLD,
        device=device,
        ep_rank=ps.get_expert_model_parallel_rank() if dims.ep > 1 else 0,
        ep=ps.get_expert_model_parallel_group() if dims.ep > 1 else None,
        replica=ps.get_expert_tensor_model_pipeline_parallel_group() if dims.ep > 1 else None,
    )


def destroy_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    restore_default_group()  # split placement: the world's own group again (patches.default_group)
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------- split placement
#
# The last K ranks host only rollout engines; the first N - K ranks host the Megatron roles on their
# own TP/PP/DP groups. Because the training ranks are 0..N-K-1, their global ranks are their ranks in
# a world of N - K, so megatron-core 0.16.1's `parallel_state.initialize_model_parallel` builds the
# right groups when it sees a world of N - K: it reads the world size once
# (`world_size = torch.distributed.get_world_size()`, megatron/core/parallel_state.py:736) and builds
# every rank list from it. `torch.distributed.new_group` is collective over the default group (gloo
# and NCCL wait in a store barrier for every rank unless use_local_synchronization), so the rollout
# ranks make the same calls: they belong to none of the groups and get GroupMember.NON_GROUP_MEMBER.


@dataclass
class SplitPlacement:
    """Which ranks train and which only roll out; the groups that span each side."""

    world_size: int
    num_rollout: int
    rank: int
    train: Any  # ProcessGroup of the training ranks (a non-member handle on rollout ranks)
    rollout: Any  # ProcessGroup of the rollout ranks (a non-member handle on training ranks)
    full: Any  # every rank (batches and weights cross here): the world's own group
    health: Any = None  # a gloo group of every rank (naming stalled ranks after a timeout)

    @property
    def num_train(self) -> int:
        return self.world_size - self.num_rollout

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.num_train

    @property
    def train_ranks(self) -> list[int]:
        return list(range(self.num_train))

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(self.num_train, self.world_size))


def init_split_distributed(
    tp: int,
    pp: int,
    dp: int,
    rollout_ranks: int,
    backend: str = "auto",
    timeout_minutes: int = 30,
    seed: int = 0,
) -> tuple[Optional[ParallelGroups], SplitPlacement]:
    """Start torch.distributed, megatron groups over the first N - K ranks, and the two side groups.

    Returns (the training rank's ParallelGroups, whose `world` is the training ranks' group; None on
    a rollout rank) and the SplitPlacement. Every rank calls this together.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_bridge import patches

    patches.require_applied()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 < rollout_ranks < world_size:
        raise InputError(
            f"placement.rollout_ranks={rollout_ranks} must leave training ranks in a world of {world_size}: "
            f"choose it from 1 to {world_size - 1}"
        )
    num_train = world_size - rollout_ranks
    dims = ParallelDims.resolve(tp, pp, dp, num_train)
    backend = pick_backend(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    start_world(backend, timeout_minutes, world_size, int(os.environ.get("RANK", "0")))
    with WorldSeenAs(num_train):
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, distributed_timeout_minutes=timeout_minutes
        )
    timeout = datetime.timedelta(minutes=timeout_minutes)
    train = dist.new_group(list(range(num_train)), timeout=timeout)
    rollout = dist.new_group(list(range(num_train, world_size)), timeout=timeout)
    health = dist.new_group(backend="gloo", timeout=timeout)
    rank = dist.get_rank()
    placement = SplitPlacement(world_size, rollout_ranks, rank, train, rollout, dist.group.WORLD, health)
    if placement.is_rollout:
        return None, placement
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    groups = _collect_groups(dims, local_rank, backend)
    groups.world = train  # every "all ranks" reduction of the trainer spans the training ranks only
    set_default_group(train)
    return groups, placement


def rollout_device(backend: str, local_rank: int):
    """The device a rollout-only rank computes on (its GPU under NCCL, else the CPU)."""
    import torch

    return torch.device("cuda", local_rank) if pick_backend(backend) == "nccl" else torch.device("cpu")
