"""The run: process groups, trainer, trackers, checkpoints, validation; teardown in `finally`."""

from __future__ import annotations

import logging
import os
import random
import time

log = logging.getLogger("rlstack")


def run_training(cfg, dry_run: bool = False, profile: bool = False, config_yaml: str = "", overwrite=None) -> int:
    """Every rank's run, colocated or split: a rollout-only rank serves its engine, the others train.
    `overwrite` (rank 0: rlstack.run_dir's guard) sets an earlier run aside once the run starts and
    is told when the first checkpoint is saved; None on other ranks."""
    import torch

    from megatron_bridge import patches
    from megatron_bridge.parallel import destroy_distributed
    from megatron_bridge.patches import cpu_matmul
    from rlstack import host_memory

    # the one start-up call that checks megatron-core's version and patches it (megatron_bridge/patches)
    patches.apply(cfg.parallel.allow_untested_megatron, "parallel.allow_untested_megatron=true")
    cpu_matmul.set_mode(cfg.parallel.cpu_matmul)  # float32 CPU linears: oneDNN or torch's MKL
    _set_threads(cfg.parallel.threads_per_rank)
    host_memory.configure_allocator(cfg.parallel.host_mmap_threshold_kb)
    groups, placement = _init_distributed(cfg)
    _seed_all(cfg.trainer.seed)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True)
    health = placement.health if placement is not None else _health_group(cfg)
    rank = placement.rank if placement is not None else groups.rank
    trainer = trackers = None
    ok = stopped = False
    try:
        if placement is not None and placement.is_rollout:
            _serve_rollout(cfg, placement)
            from rlstack import preemption

            stopped = preemption.stop_requested()  # told by the training ranks, which stopped to be resumed
        else:
            trainer, trackers = _start(cfg, groups, overwrite, placement)
            _seed_all(cfg.trainer.seed)  # vLLM in-process reseeds torch's global RNG when it starts
            stopped = _loop(cfg, trainer, trackers, groups, dry_run, profile, config_yaml, overwrite)
        ok = True
    except Exception as e:
        if _is_collective_timeout(e):
            raise _stalled_ranks_error(e, health, cfg, rank) from e
        raise
    finally:
        if trackers is not None:
            trackers.close()
        if trainer is not None:
            trainer.source.close(ok)  # the engine, or the rollout ranks' serving loop (only when ok)
        destroy_distributed()
    if stopped:
        from rlstack import preemption

        preemption.linger(rank)  # under torchrun rank 0 exits first (its teardown is not cut)
        return preemption.exit_status()  # 75: stopped to be resumed (0 under torchrun's restarts)
    return 0


def _init_distributed(cfg):
    """(ParallelGroups of the training ranks or None on a rollout rank, SplitPlacement or None)."""
    from megatron_bridge.parallel import init_distributed, init_split_distributed

    p = cfg.parallel
    if cfg.placement.rollout_ranks > 0:
        return init_split_distributed(
            p.tp, p.pp, p.dp, cfg.placement.rollout_ranks, p.backend, _timeout(cfg), seed=cfg.trainer.seed
        )
    return init_distributed(p.tp, p.pp, p.dp, p.backend, _timeout(cfg), seed=cfg.trainer.seed, ep=p.ep), None


def _serve_rollout(cfg, placement) -> None:
    """A rollout-only rank (split placement, rlstack/placement.py): serve requests until told to stop."""
    from megatron_bridge.parallel import rollout_device
    from rlstack.observability.logging import setup_logging
    from rlstack.placement import run_rollout_rank

    setup_logging(cfg.trainer.output_dir, placement.rank, cfg.logging.level)
    run_rollout_rank(cfg, placement, rollout_device(cfg.parallel.backend, int(os.environ.get("LOCAL_RANK", "0"))))


def _health_group(cfg):
    """A gloo group of every rank, used only to find which ranks stopped answering after a timeout."""
    import datetime

    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=_timeout(cfg)))


def _is_collective_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text)


def _stalled_ranks_error(e: BaseException, health, cfg, rank: int):
    """A collective timed out: ask every rank to check in, so the message names the missing ones."""
    from rlstack import collectives
    from rlstack.errors import UserError

    missing = collectives.missing_ranks(health, timeout_s=20)
    who = f"rank(s) {missing}" if missing else "some rank(s)"
    return UserError(
        f"{who} did not answer for {_timeout(cfg):g} minutes (parallel.timeout_minutes): stalled "
        f"(stopped, hung or swapping) or dead; see {cfg.trainer.output_dir}/logs for their last lines "
        f"(this rank {rank}: {str(e).splitlines()[0][:160]}); complete checkpoints on disk are kept"
    )


def _seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _start(cfg, groups, overwrite, placement=None):
    from rlstack import host_memory
    from rlstack.observability.logging import setup_logging
    from rlstack.observability.trackers import build_trackers
    from rlstack.trainer import build_trainer

    out = cfg.trainer.output_dir
    setup_logging(out, groups.rank, cfg.logging.level)
    if groups.rank == 0:
        os.makedirs(out, exist_ok=True)
        if overwrite is not None:
            overwrite.begin()  # trainer.overwrite=true: set aside, not deleted (rlstack/run_dir.py)
    log.info(
        "layout tp=%d pp=%d dp=%d world=%d backend=%s",
        groups.dims.tp,
        groups.dims.pp,
        groups.dims.dp,
        groups.dims.world_size,
        "nccl" if groups.device.type == "cuda" else f"gloo, float32 matmuls on {_cpu_matmul_kernel()}",
    )
    log.info(host_memory.describe_allocator(cfg.parallel.host_allocator, cfg.parallel.host_mmap_threshold_kb))
    trainer = build_trainer(cfg, groups, placement)
    from rlstack.config import to_dict

    trackers = build_trackers(
        cfg.logging.trackers,
        out,
        groups.rank,
        config_dict=to_dict(cfg),
        project=cfg.logging.project,
        run_name=cfg.logging.run_name,
        resume=cfg.checkpoint.resume != "never",
        total_steps=cfg.trainer.total_steps,
    )  # W&B/MLflow continue the same run
    return trainer, trackers


def _loop(cfg, trainer, trackers, groups, dry_run: bool, profile: bool, config_yaml: str = "", overwrite=None) -> bool:
    """Train to trainer.total_steps; True when it stopped early to be resumed (rlstack/preemption.py)."""
    from rlstack import preemption
    from rlstack.observability.monitor import ResourceMonitor

    checkpointer = _checkpointer(cfg, groups, dry_run)
    if checkpointer is not None:
        checkpointer.resume(trainer.checkpoint_parts())
    restart = _restart_metrics(checkpointer, trainer.step)
    if groups.rank == 0 and config_yaml:  # after the resume checks: a refused run leaves the saved config as it was
        _write_config(cfg.trainer.output_dir, config_yaml)
    monitor = ResourceMonitor(warn_fraction=cfg.logging.memory_warn_fraction, logger=log)
    before = _checksum(trainer) if dry_run else None
    val_first = None
    if cfg.trainer.val_before_train and trainer.step == 0:
        val_first = trainer.validate()
        log.info("validation before training: %s", _fmt(val_first))
        trackers.log(dict(val_first), step=0)
    deadline = preemption.Deadline(cfg.trainer.max_wall_minutes, time.time())
    preemption.arm(cfg.trainer.stop_signals, cfg.trainer.stop_grace_s, last_saved=trainer.step)
    try:
        while trainer.step < cfg.trainer.total_steps:
            preemption.begin_step(trainer.step + 1)
            t0 = time.perf_counter()
            metrics = trainer.train_step(dry_run=dry_run)
            step_s = time.perf_counter() - t0
            metrics.update(monitor.sample())
            metrics.update(restart)
            restart = {}
            step = trainer.step
            if cfg.trainer.val_every and step % cfg.trainer.val_every == 0:
                metrics.update(trainer.validate())
            trackers.log(metrics, step=step)
            if profile:
                log.info(_profile_line(metrics))
            if checkpointer is not None and checkpointer.maybe_save(trainer.checkpoint_parts()):
                preemption.saved(step)
                if overwrite is not None:
                    overwrite.saved()
            save_s = checkpointer.last_save.get("seconds", 0.0) if checkpointer is not None else 0.0
            if deadline.reached(time.time(), step_s, save_s) and step < cfg.trainer.total_steps:
                preemption.request_stop(f"the time limit ({deadline.what})")
            if preemption.agree(groups):
                if step < cfg.trainer.total_steps:
                    _stop_to_resume(cfg, trainer, groups, checkpointer, dry_run, overwrite)
                    return True
    finally:
        preemption.disarm(cfg.trainer.stop_signals)
    if cfg.trainer.val_after_train:
        val_last = trainer.validate()
        log.info("validation after training: %s", _fmt(val_last))
        if val_first:
            log.info(
                "val/accuracy before=%.3f after=%.3f",
                val_first.get("val/accuracy", float("nan")),
                val_last.get("val/accuracy", float("nan")),
            )
        trackers.log(dict(val_last), step=trainer.step)
    if dry_run:
        after = _checksum(trainer)
        if after != before:
            raise AssertionError(f"--dry-run changed parameters: checksum {before} -> {after}")
        log.info("dry run: parameter checksum unchanged (%s)", after)
    return False


def _stop_to_resume(cfg, trainer, groups, checkpointer, dry_run: bool, overwrite) -> None:
    """Every rank agreed to stop after `trainer.step`: save it (unless just saved) and say so."""
    from rlstack import preemption
    from rlstack.checkpoint import Checkpointer, step_dir

    step, path = trainer.step, None
    if not dry_run:
        checkpointer = checkpointer or Checkpointer(cfg, groups)
        path = checkpointer.last_save.get("path")
        if path != step_dir(checkpointer.root, step):
            path = checkpointer.save(trainer.checkpoint_parts())
            if overwrite is not None:
                overwrite.saved()
    if groups.rank == 0:
        preemption.write_stopped(cfg.trainer.output_dir, step, path)
    log.warning(
        "stopped by %s after step %d of %d: %s; exit %d (stopped to be resumed): run again with "
        "checkpoint.resume=auto to continue at step %d",
        preemption.reason(),
        step,
        cfg.trainer.total_steps,
        f"checkpoint saved to {path}" if path else "nothing saved (--dry-run)",
        preemption.RESUME_EXIT,
        step + 1,
    )


def _restart_metrics(checkpointer, step: int) -> dict:
    """Under torchrun's elastic restarts: which restart this is, and the steps redone since the last save."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    repeated = checkpointer.last_load.get("dropped", 0) if checkpointer is not None else 0
    if not restarts and not repeated:
        return {}
    log.warning(
        "%s: resumed at step %d, repeating %d step(s) done since that checkpoint",
        f"torchrun restart {restarts}" if restarts else "resume",
        step,
        repeated,
    )
    return {"trainer/restarts": float(restarts), "trainer/steps_repeated": float(repeated)}


def _write_config(out: str, config_yaml: str) -> None:
    tmp = os.path.join(out, "config.yaml.tmp")
    with open(tmp, "w") as f:
        f.write(config_yaml)
    os.replace(tmp, os.path.join(out, "config.yaml"))


def _checkpointer(cfg, groups, dry_run: bool):
    if dry_run or (cfg.checkpoint.save_every <= 0 and cfg.checkpoint.resume == "never"):
        return None
    from rlstack.checkpoint import Checkpointer

    return Checkpointer(cfg, groups)


def _checksum(trainer) -> str:
    """Sum of every trainable parameter on this rank (actor and critic), for --dry-run."""
    import torch

    total = torch.zeros((), dtype=torch.float64)
    roles = [trainer.actor.role] + ([trainer.critic.role] if trainer.critic is not None else [])
    for role in roles:
        for p in role.module.parameters():
            total += p.detach().double().abs().sum().cpu()
    return f"{total.item():.10e}"


def _profile_line(m: dict) -> str:
    return "profile: rollout {:.1f} tok/s | actor {:.1f} tok/s | critic {} tok/s | step {:.2f} s".format(
        m.get("throughput/rollout_tok_s", 0.0),
        m.get("throughput/actor_tok_s", 0.0),
        f"{m['throughput/critic_tok_s']:.1f}" if "throughput/critic_tok_s" in m else "-",
        m.get("timing/step_s", 0.0),
    )


# The console's validation line (lean logs): the scores and the agent's turn count; every other val/*
# metric (an agent loop's ~40 val/agent/* ones) goes to the trackers (metrics.jsonl) only.
_VAL_CONSOLE_AGENT = ("val/agent/num_turns/mean",)


def _fmt(metrics: dict) -> str:
    shown = {k: v for k, v in metrics.items() if not k.startswith("val/agent/") or k in _VAL_CONSOLE_AGENT}
    text = " ".join(f"{k}={v:.4f}" for k, v in sorted(shown.items()))
    if len(shown) < len(metrics):
        text += f" (+{len(metrics) - len(shown)} more logged)"
    return text


def _cpu_matmul_kernel() -> str:
    from megatron_bridge.patches import cpu_matmul

    return "oneDNN" if cpu_matmul.onednn_available() else "MKL"


def _set_threads(threads_per_rank: int) -> None:
    import torch

    if threads_per_rank <= 0:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads_per_rank = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads_per_rank)


def _timeout(cfg) -> float:
    import torch

    from rlstack.config import timeout_minutes

    return timeout_minutes(cfg, on_gpu=torch.cuda.is_available())
