"""Sharded training checkpoints through megatron dist_checkpointing: save, publish, find, resume.

One checkpoint is a directory `<checkpoint.dir>/step_00000006/`:
  actor/, critic/      megatron dist checkpoints (model + optimizer); each rank writes only its shards
  rank_00000.pt, ...   per-rank RNG states (python, numpy, torch, megatron's RNG tracker)
  trainer_state.json   step, the stateful parts' state dicts (loop progress, data sampler, KL
                       controller, LR schedules), layout, model shapes (rank 0)
  config.yaml          the resolved experiment config
  hf_source/<role>/    config and tokenizer files of the role's starting HF checkpoint (for export)
  COMPLETE.json        the completion marker, written last: every other file of the checkpoint with its size

Publication is atomic: everything is written under `step_N.tmp`; once every rank is done, rank 0
writes the marker, renames the directory to `step_N`, then points `latest` at it. A directory
whose marker is missing, unreadable or contradicted by the files (a truncated shard, a file it does
not list) is never loaded; `resume=auto` skips it, saying why, and takes the newest complete one.

Changing TP/PP/DP between save and resume works: dist checkpointing reshards model and optimizer
tensors on load. RNG streams are restored only at the same layout (they are per rank).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Optional, Protocol

from megatron_bridge.patches import optimizer_state
from rlstack.errors import UserError

log = logging.getLogger("rlstack")

MARKER = "COMPLETE.json"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
HF_SOURCE = "hf_source"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# The distributed optimizer's `fully_reshardable` format stores every optimizer tensor in the shape
# of its parameter, so it reshards across TP/PP/DP like the weights. (Its default in megatron-core
# 0.16.1, `fully_sharded_model_space`, raises "ShardedTensor.flattened_range is not supported";
# `dp_reshardable` reshards over DP only: megatron/core/optimizer/distrib_optimizer.py.)
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _optim_metadata(device) -> dict:
    # Its default exchange all-gathers through `.cuda()` tensors (NCCL); on CPU use its gloo
    # variant, which gathers on DP rank 0 (distrib_optimizer.py sharded_param_state_fully_reshardable).
    return dict(OPTIM_METADATA, distrib_optim_fully_reshardable_mem_efficient=device.type != "cuda")


class CheckpointError(UserError):
    """A checkpoint that must not be loaded; the message says which one, why, and what to do."""


# ----------------------------------------------------------------------------- on-disk format


def checkpoint_root(cfg) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.trainer.output_dir, "checkpoints")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Published checkpoint directories under `root`, newest first (complete or not)."""
    if not os.path.isdir(root):
        return []
    found = [
        (int(m.group(1)), os.path.join(root, name))
        for name in os.listdir(root)
        if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(root, name))
    ]
    return sorted(found, reverse=True)


def checkpoint_files(path: str) -> dict[str, int]:
    """Every file under `path` but the completion marker: relative path -> size in bytes."""
    files = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            files[os.path.relpath(full, path)] = os.path.getsize(full)
    files.pop(MARKER, None)
    return files


def write_marker(path: str, step: int) -> dict:
    """List every file under `path` with its size in the completion marker (written last)."""
    files = checkpoint_files(path)
    marker = {"step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return marker


def verify_checkpoint(path: str) -> dict:
    """The marker of a complete checkpoint; CheckpointError naming the problem otherwise."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist: pass a step_N directory, auto or never")
    marker_path = os.path.join(path, MARKER)
    if not os.path.isfile(marker_path):
        raise CheckpointError(
            f"checkpoint {path} has no completion marker {MARKER}: its save never finished "
            "(interrupted run?), so it is not loaded; resume from another one or delete it"
        )
    try:
        with open(marker_path) as f:
            marker = json.load(f)
        files, step = marker["files"], int(marker["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {path} has an unreadable completion marker ({e}): it is not loaded; "
            "resume from another one or delete it"
        )
    for rel, size in sorted(files.items()):
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(
                f"checkpoint {path} is incomplete: {rel} is missing: it is not loaded; "
                "resume from another one or delete it"
            )
        actual = os.path.getsize(full)
        if actual != size:
            raise CheckpointError(
                f"checkpoint {path} is truncated: {rel} has {actual} bytes, the completion "
                f"marker records {size}: it is not loaded; resume from another one or delete it"
            )
    _refuse_unlisted(path, files)
    marker["step"] = step
    return marker


def _refuse_unlisted(path: str, listed: dict) -> None:
    """A file the marker does not list means the marker was written before the save finished (an
    early marker lists no shards): the list, not just each listed file, must match what is there."""
    unlisted = sorted(set(checkpoint_files(path)) - set(listed))
    if unlisted:
        shown = ", ".join(unlisted[:3]) + (f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else "")
        raise CheckpointError(
            f"checkpoint {path} holds files its completion marker {MARKER} does not list ({shown}): "
            "the marker does not describe this checkpoint, so it is not loaded; resume from another one "
            "or delete it"
        )


def find_latest(root: str) -> Optional[str]:
    """Newest complete checkpoint under `root`, warning about each newer one it skips; None if none exist."""
    refused = []
    for _, path in list_checkpoints(root):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            log.warning("checkpoint.resume=auto skips a checkpoint: %s", e)
            refused.append(str(e))
            continue
        if refused:
            log.warning("checkpoint.resume=auto falls back to %s, the newest complete checkpoint", path)
        return path
    if refused:
        raise CheckpointError(
            f"no complete checkpoint in {root} ({len(refused)} refused: {refused[0]}): "
            "delete the broken ones or set checkpoint.resume=never to start afresh"
        )
    return None


def resolve_resume(cfg) -> Optional[str]:
    """The checkpoint directory that `checkpoint.resume` selects, or None (start at step 0)."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        return find_latest(checkpoint_root(cfg))
    return resolve_path(mode, "checkpoint.resume")


def resolve_path(path: str, what: str) -> str:
    """`path` if it is a complete checkpoint, else the newest complete one in the checkpoints folder `path`.

    `path` may also be the `latest` pointer file (it names the newest checkpoint in its folder).
    """
    if os.path.basename(path.rstrip("/")) == LATEST and os.path.isfile(path):
        with open(path) as f:
            path = os.path.join(os.path.dirname(path), f.read().strip())
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{what}={path}: no such directory: pass a checkpoint directory "
            "(.../checkpoints/step_N) or a checkpoints folder"
        )
    if not os.path.exists(os.path.join(path, MARKER)) and list_checkpoints(path):
        found = find_latest(path)
        assert found is not None  # find_latest raises when every checkpoint is refused
        return found
    verify_checkpoint(path)
    return path


def truncate_metrics(path: str, last_step: int) -> int:
    """Drop lines of `metrics.jsonl` past `last_step` (and a torn last line), in place. Returns lines dropped.

    In place, not by replacing the file: the run's JsonlTracker already holds it open for append.
    """
    if not os.path.isfile(path):
        return 0
    with open(path, "r+", encoding="utf-8") as f:
        lines = f.readlines()
        kept = [line for line in lines if _metrics_step(line) is not None and _metrics_step(line) <= last_step]
        f.seek(0)
        f.writelines(kept)
        f.truncate()
    return len(lines) - len(kept)


def _metrics_step(line: str) -> Optional[int]:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


# ----------------------------------------------------------------------------- one model role


def _role_sharded_state(role, with_optimizer: bool, is_loading: bool) -> dict:
    # GPTModel.sharded_state_dict covers the critic's ValueHead too: megatron's default for a
    # plain submodule (transformer/utils.py sharded_state_dict_default) makes TP-replicated tensors.
    model_sd = _saved_model_state(role.module, role.module.sharded_state_dict())
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = role.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=_optim_metadata(role.groups.device)
        )
    return state


def _saved_model_state(module, model_sd: dict) -> dict:
    """What a role's checkpoint holds of its model: everything, or with LoRA (docs/lora.md) the
    adapters and any other trainable tensor (a critic's value head) only. The frozen base is not
    rewritten each save: it is rebuilt from the HF checkpoint when the run (or export) starts."""
    from megatron_bridge.lora import has_lora

    if not has_lora(module):
        return model_sd
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if ".lora." in k or k in trainable}


def _load_model_state(module, loaded: dict) -> None:
    """load_state_dict of a saved model state; with LoRA only the frozen base may be missing."""
    from megatron_bridge.lora import has_lora

    if not has_lora(module):
        module.load_state_dict(loaded, strict=True)
        return
    missing, unexpected = module.load_state_dict(loaded, strict=False)
    absent = [k for k in missing if ".lora." in k or k in {n for n, p in module.named_parameters() if p.requires_grad}]
    if absent or unexpected:
        raise CheckpointError(f"LoRA checkpoint does not match the model: missing {absent}, unexpected {unexpected}")


def lora_record(role, source: str) -> Optional[dict]:
    """trainer_state.json's `lora` entry of a role: its LoraSpec and the HF base it adapts (export reads it)."""
    spec = getattr(role, "lora", None)
    return None if spec is None else {**asdict(spec), "target_modules": list(spec.target_modules), "base": source}


def save_role(role, path: str, groups, with_optimizer: bool) -> None:
    """Collective over the world: each rank writes only the shards it is the main replica of."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    state = _role_sharded_state(role, with_optimizer and role.optimizer is not None, is_loading=False)
    # Spread the writing of DP-replicated tensors over the DP ranks instead of DP rank 0 alone.
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), groups.dp)
    dist_checkpointing.save(state, path, sharded_strategy=strategy)


def load_role(role, path: str, with_optimizer: bool) -> None:
    """Collective: load (and reshard) weights and, if asked, optimizer state into `role` in place."""
    from megatron.core import dist_checkpointing

    with_optimizer = with_optimizer and role.optimizer is not None
    if with_optimizer:
        optimizer_state.allocate_distributed_optimizer_state(role.optimizer)
    state = _role_sharded_state(role, with_optimizer, is_loading=True)
    loaded = dist_checkpointing.load(state, path)
    _load_model_state(role.module, loaded["model"])
    if with_optimizer:
        role.optimizer.load_state_dict(loaded["optimizer"])
        optimizer_state.unshare_adam_steps(role.optimizer)
    elif role.optimizer is not None:
        role.optimizer.reload_model_params()  # main (fp32) copies follow the loaded weights


def load_model_weights(module, path: str) -> None:
    """Weights only (no optimizer) of one role's dist checkpoint into a bare GPTModel stage, resharded."""
    from megatron.core import dist_checkpointing

    # Same nesting as at save time; the returned dict also holds the optimizer's common part.
    loaded = dist_checkpointing.load({"model": _saved_model_state(module, module.sharded_state_dict())}, path)
    _load_model_state(module, loaded["model"])


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class CheckpointParts:
    """What a checkpoint holds, handed in by its owner (the checkpointer never reaches into a trainer).

    roles: Megatron roles by sub-directory (sharded model + optimizer through dist checkpointing);
    states: small `Stateful` parts by name (JSON state dicts in trainer_state.json); the one named
    "trainer" carries {"step": N}; sources: each role's starting HF directory (export needs its
    config and tokenizer).
    """

    roles: dict
    states: dict
    sources: dict

    @property
    def step(self) -> int:
        return int(self.states["trainer"].state_dict()["step"])


# ----------------------------------------------------------------------------- per-rank RNG


def rng_state() -> dict:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank_{rank:05d}.pt")


def _layout(groups) -> dict:
    d = groups.dims
    layout = {"tp": d.tp, "pp": d.pp, "dp": d.dp, "world_size": d.world_size}
    return {**layout, "ep": d.ep} if d.ep > 1 else layout  # EP only for a MoE: older layouts compare equal


# ----------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Saves every `checkpoint.save_every` steps (and at the last step) and resumes a run."""

    def __init__(self, cfg, groups):
        self.cfg, self.groups = cfg, groups
        self.root = checkpoint_root(cfg)
        self.last_save = {}  # seconds, bytes, path of the latest save (benchmarks read it)
        self.last_load = {}

    # -------------------------------------------------------------- save

    def maybe_save(self, parts: CheckpointParts) -> Optional[str]:
        every, step = self.cfg.checkpoint.save_every, parts.step
        if every <= 0:
            return None
        if step % every == 0 or step == self.cfg.trainer.total_steps:
            return self.save(parts)
        return None

    def save(self, parts: CheckpointParts) -> str:
        """Collective: write step_N.tmp on every rank, then publish it (rank 0). Returns the path."""
        import torch

        g, t0 = self.groups, time.perf_counter()
        step, roles = parts.step, parts.roles
        final = step_dir(self.root, step)
        tmp = final + ".tmp"
        if g.rank == 0:
            self._prepare(tmp, list(roles))
        self._barrier()
        full = None  # a full disk (ENOSPC/EDQUOT) while writing: every rank stops with one line
        try:
            _fault_full_disk(step, tmp)
            for name, role in roles.items():
                save_role(role, os.path.join(tmp, name), g, self.cfg.checkpoint.save_optimizer)
            torch.save(rng_state(), _rank_file(tmp, g.rank))
            if g.rank == 0:
                self._write_rank0_files(tmp, parts)
        except OSError as e:
            if not _is_full(e):
                raise
            full = e
        if self._any(full is not None):  # every rank's files are on disk before the marker lists them
            self._give_up(tmp, step, full)
        if g.rank == 0:
            try:
                marker = write_marker(tmp, step)
                self._publish(tmp, final)
            except OSError as e:
                if not _is_full(e):
                    raise
                self._give_up(tmp, step, e, collective=False)
            size = sum(marker["files"].values())
            self.last_save = {"seconds": time.perf_counter() - t0, "bytes": size, "path": final}
            log.info(
                "checkpoint step %d saved to %s in %.2f s (%.1f MiB)",
                step,
                final,
                self.last_save["seconds"],
                size / 2**20,
            )
        self._barrier()  # published before any rank goes on
        return final

    def _any(self, flag: bool) -> bool:
        """Collective (it is also the barrier after the writes): did any rank fail?"""
        import torch.distributed as dist

        from rlstack import collectives

        if not dist.is_initialized():
            return flag
        return collectives.max_floats([float(flag)], self.groups.world, self.groups.device)[0] > 0

    def _give_up(self, tmp: str, step: int, error, collective: bool = True):
        """The disk filled during the save of `step`: remove step_N.tmp (rank 0), leave `latest` on the
        previous checkpoint, and raise one line naming the directory and the space needed."""
        if self.groups.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            latest_tmp = os.path.join(self.root, LATEST + ".tmp")
            if os.path.exists(latest_tmp):
                os.remove(latest_tmp)
        if collective:
            self._barrier()
        raise CheckpointSpaceError(self.root, step, error)

    def _prepare(self, tmp: str, role_names: list[str]) -> None:
        os.makedirs(self.root, exist_ok=True)
        for name in os.listdir(self.root):  # leftovers of saves that were interrupted
            if name.endswith(".tmp") and os.path.isdir(os.path.join(self.root, name)):
                shutil.rmtree(os.path.join(self.root, name))
        for name in role_names:  # dist_checkpointing.save expects its directory to exist
            os.makedirs(os.path.join(tmp, name))

    def _write_rank0_files(self, tmp: str, parts: CheckpointParts) -> None:
        from rlstack.config import to_yaml

        roles = parts.roles
        state = {
            "step": parts.step,
            "states": {name: part.state_dict() for name, part in parts.states.items()},
            "layout": _layout(self.groups),
            "roles": sorted(roles),
            "save_optimizer": bool(self.cfg.checkpoint.save_optimizer),
            "model_args": {name: asdict(role.args) for name, role in roles.items()},
            "value_head": {name: name == "critic" for name in roles},
            "lora": {name: lora_record(role, parts.sources[name]) for name, role in roles.items()},
        }
        with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
            json.dump(state, f, indent=1)
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(to_yaml(self.cfg))
        from megatron_bridge.hf import copy_side_files

        sources = parts.sources
        for name in roles:  # config + tokenizer (no weights): what export needs besides the shards
            os.makedirs(os.path.join(tmp, HF_SOURCE, name))
            copy_side_files(sources[name], os.path.join(tmp, HF_SOURCE, name))

    def _publish(self, tmp: str, final: str) -> None:
        replaced = None
        if os.path.exists(final):  # a re-run of this step after a resume from an older checkpoint:
            replaced = final + ".replaced"  # kept until the new one is in place
            os.rename(final, replaced)
        os.rename(tmp, final)
        latest_tmp = os.path.join(self.root, LATEST + ".tmp")
        with open(latest_tmp, "w") as f:
            f.write(os.path.basename(final) + "\n")
        os.replace(latest_tmp, os.path.join(self.root, LATEST))
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        self._prune(final)

    def _prune(self, latest: str) -> None:
        """Keep `latest` (the checkpoint just published) and the newest keep_last - 1 others; never
        `latest` itself, even when newer-numbered checkpoints of an abandoned branch exist."""
        keep = self.cfg.checkpoint.keep_last
        if keep <= 0:
            return
        complete = [path for _, path in list_checkpoints(self.root) if os.path.isfile(os.path.join(path, MARKER))]
        others = [path for path in complete if os.path.abspath(path) != os.path.abspath(latest)]
        for path in others[keep - 1 :]:
            shutil.rmtree(path, ignore_errors=True)
            log.info("checkpoint.keep_last=%d: removed %s", keep, path)

    # -------------------------------------------------------------- resume

    def resume(self, parts: CheckpointParts) -> int:
        """Collective: load the checkpoint `checkpoint.resume` selects into `parts`. Returns the step (0: none)."""
        g, t0 = self.groups, time.perf_counter()
        path = self._resolve_on_rank0()
        if path is None:
            log.info(
                "no checkpoint to resume from (checkpoint.resume=%s): starting at step 0", self.cfg.checkpoint.resume
            )
            return 0
        with open(os.path.join(path, TRAINER_STATE)) as f:
            state = json.load(f)
        roles = parts.roles
        _check_compatible(path, state, roles)
        if not state["save_optimizer"]:
            log.warning(
                "checkpoint %s holds no optimizer state (checkpoint.save_optimizer=false): "
                "Adam moments restart from zero",
                path,
            )
        for name, role in roles.items():
            load_role(role, os.path.join(path, name), state["save_optimizer"])
        for name, part in parts.states.items():
            if name in state["states"]:
                part.load_state_dict(state["states"][name])
            else:  # e.g. an LR schedule switched on after the save
                log.warning("checkpoint %s holds no state for %s: it starts afresh", path, name)
        step = int(state["step"])
        self._restore_rng(path, state["layout"])
        if g.rank == 0:
            from rlstack.observability.trackers import METRICS_FILE

            dropped = truncate_metrics(os.path.join(self.cfg.trainer.output_dir, METRICS_FILE), step)
            if dropped:
                log.info("resume: dropped %d metrics.jsonl lines past step %d", dropped, step)
        self._barrier()
        self.last_load = {"seconds": time.perf_counter() - t0, "path": path, "step": step}
        if g.rank == 0:
            self.last_load["dropped"] = dropped  # steps this run repeats (logged as trainer/steps_repeated)
        log.info("resumed from %s at step %d in %.2f s", path, step, self.last_load["seconds"])
        return step

    def _resolve_on_rank0(self) -> Optional[str]:
        """Rank 0 picks (and verifies) the checkpoint; every rank gets the same answer or the same error."""
        from rlstack import collectives

        answer = [None, None]
        if self.groups.rank == 0:
            try:
                answer[0] = resolve_resume(self.cfg)
            except CheckpointError as e:
                answer[1] = str(e)
        answer = collectives.broadcast_object(answer, 0, self.groups.world, self.groups.device)
        if answer[1] is not None:
            raise CheckpointError(answer[1])
        return answer[0]

    def _restore_rng(self, path: str, saved_layout: dict) -> None:
        import torch

        if saved_layout != _layout(self.groups):
            log.warning(
                "resume at a new layout (%s -> %s): per-rank RNG states are not restored; they keep "
                "this run's trainer.seed streams",
                saved_layout,
                _layout(self.groups),
            )
            return
        set_rng_state(torch.load(_rank_file(path, self.groups.rank), weights_only=False))

    def _barrier(self) -> None:
        from rlstack import collectives

        collectives.barrier(self.groups.world, self.groups.device)


class CheckpointSpaceError(OSError):
    """No room for a checkpoint; `resource_line` is the one line the run stops with (exit 3)."""

    def __init__(self, root: str, step: int, error: Optional[OSError]):
        import errno

        code = getattr(error, "errno", None) or errno.ENOSPC
        super().__init__(code, os.strerror(code), root)
        previous = _newest_complete(root)
        size = sum(checkpoint_files(previous).values()) if previous else 0
        free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
        need = f"about {size / 2**20:.1f} MiB free (the size of {os.path.basename(previous)})" if previous else "room"
        kept = (
            f"{os.path.basename(previous)} stays intact and `latest` names it"
            if previous
            else "no checkpoint was saved"
        )
        what = "disk quota exceeded" if code == errno.EDQUOT else "no space left on the device"
        self.resource_line = (
            f"{what} saving the checkpoint of step {step} in {root}: it needs {need}, "
            f"{free / 2**20:.1f} MiB are free there; {kept}, the unfinished step_{step:08d}.tmp was removed. "
            "Free space or point checkpoint.dir at a file system with room, then resume (checkpoint.resume=auto)"
        )


def _newest_complete(root: str) -> Optional[str]:
    for _, path in list_checkpoints(root):
        if os.path.isfile(os.path.join(path, MARKER)):
            return path
    return None


def _is_full(e: OSError) -> bool:
    import errno

    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def _fault_full_disk(step: int, tmp: str) -> None:
    """tests/fault: RLSTACK_FAULT_ENOSPC_STEP=K fails the save of step K as a full file system would."""
    import errno

    if os.environ.get("RLSTACK_FAULT_ENOSPC_STEP") == str(step):
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, "partial.bin"), "wb") as f:
            f.write(b"\0" * 4096)  # something half-written, as a real full disk leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)


def _check_compatible(path: str, state: dict, roles: dict) -> None:
    if sorted(roles) != state["roles"]:
        raise CheckpointError(
            f"checkpoint {path} holds roles {state['roles']}, this run trains {sorted(roles)}: "
            "resume with the same algorithm.name (ppo has a critic, grpo none) or "
            "set checkpoint.resume=never"
        )
    for name, role in roles.items():
        _check_lora_compatible(path, name, (state.get("lora") or {}).get(name), lora_record(role, ""))
        saved = state["model_args"][name]
        now = asdict(role.args)
        diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if diff:
            raise CheckpointError(
                f"checkpoint {path} holds a different {name} model ({diff}, as saved vs now): "
                "resume with the same model.path or set checkpoint.resume=never"
            )


def _check_lora_compatible(path: str, name: str, saved: Optional[dict], now: Optional[dict]) -> None:
    keys = ("rank", "alpha", "target_modules")
    was, is_ = ({k: r[k] for k in keys} if r else {"rank": 0} for r in (saved, now))
    if was != is_:
        key = "model.lora" if name == "actor" else f"{name}.lora"
        raise CheckpointError(
            f"checkpoint {path} holds the {name} with LoRA {was}, this run has {is_}: "
            f"resume with the same {key} settings or set checkpoint.resume=never"
        )
