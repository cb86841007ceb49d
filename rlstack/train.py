"""Entry point: parse -> init distributed -> build -> loop -> teardown.

torchrun --nproc_per_node=2 -m rlstack.train --config yaml_configs/tiny_cpu.yaml key=value ...
python -m rlstack.train --config FILE --validate-only     # any machine, nothing started
python -m rlstack.train --config FILE --validate-only --world-size 8 --model-config Qwen/Qwen2-7B-Instruct
    # a GPU config on any machine: the model's shape from a config.json (or a shipped one), planned for
    # the config's GPUs (parallel.gpu_memory_gib, or --gpu-memory-gib); model and data absent here are warnings
"""

from __future__ import annotations

import argparse
import os


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rlstack.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="experiment YAML (yaml_configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--dry-run", action="store_true", help="full flow, no parameter changed")
    parser.add_argument("--profile", action="store_true", help="per-stage throughput lines")
    parser.add_argument("--validate-only", action="store_true", help="check the config and exit")
    parser.add_argument("--world-size", type=int, default=0, help="with --validate-only: world size to check")
    parser.add_argument(
        "--plan-summary", action="store_true", help="with --validate-only: the memory plan in one line (launch/ppo.sh)"
    )
    parser.add_argument(
        "--model-config",
        default=None,
        help="with --validate-only: the model's config.json, or a shipped model name (Qwen/Qwen2-7B-Instruct), "
        "for a config whose model.path is on another machine",
    )
    parser.add_argument(
        "--gpu-memory-gib", type=float, default=0.0, help="with --validate-only: plan for GPUs of this many GiB"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from rlstack.observability.logging import setup_logging, user_error_guard

    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if not args.validate_only:
        _die_with_launcher()
        _stop_on_sigterm()
    log = setup_logging(None, rank)
    return user_error_guard(lambda: _run(args, rank), rank, log)


def _run(args, rank: int) -> int:
    from rlstack.config import load_config, to_yaml
    from rlstack.preflight import preflight

    cfg = load_config(args.config, args.overrides)
    if (args.model_config or args.gpu_memory_gib) and not args.validate_only:
        from rlstack.errors import UserError

        raise UserError("--model-config and --gpu-memory-gib check a config for another machine: add --validate-only")
    if not args.validate_only and __name__ == "__main__":  # the program itself, before torch and threads exist:
        from rlstack.host_memory import exec_with_allocator  # the rank restarts itself on tcmalloc

        exec_with_allocator(cfg.parallel.host_allocator)  # (before the import below: 1.7 s not spent twice)
    from rlstack.observability.quiet import quiet_third_party

    quiet_third_party(cfg.logging.verbose)  # before megatron, transformers and vLLM are imported
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "0")) or _default_world(cfg)
    if args.validate_only:
        return _validate_only(args, cfg, world_size)
    from rlstack.run_dir import guarded_start

    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        # torchrun restarted the ranks after one died: the same run, resumed from its latest
        # checkpoint (the first attempt did any overwrite; this one must not set that run aside)
        cfg.trainer.overwrite, cfg.checkpoint.resume = False, "auto"
    with guarded_start(cfg, rank) as overwrite:
        found = preflight(cfg, world_size)  # the same checks, and messages, as --validate-only
        _remember_plan(cfg, found.dims.world_size)
        if cfg.trainer.overwrite:
            cfg.checkpoint.resume = "never"  # the earlier run is set aside (and removed once this one saves)
        from rlstack.loop import run_training

        return run_training(
            cfg, dry_run=args.dry_run, profile=args.profile, config_yaml=to_yaml(cfg), overwrite=overwrite
        )


def _validate_only(args, cfg, world_size: int) -> int:
    from rlstack.preflight import preflight

    found = preflight(cfg, world_size, model_config_file=args.model_config)
    dims = found.dims
    resume = f", resumes from {found.resume_from}" if found.resume_from else ""
    if cfg.placement.rollout_ranks:  # split placement: dims are the training ranks' own
        resume += f"; + {cfg.placement.rollout_ranks} rollout-only rank(s), staleness {cfg.rollout.staleness}"
    print(
        f"config ok: {args.config} (tp={dims.tp} pp={dims.pp} dp={dims.dp} world={dims.world_size}; "
        f"data sources {', '.join(found.data_sources) or '-'}{resume})"
    )
    from rlstack.planner import format_plan, plan_for_validate, summarize_plan

    plan = plan_for_validate(
        cfg, dims.world_size, args.gpu_memory_gib, config_path=args.config, model_config_file=args.model_config
    )
    if plan is not None:  # the model's config.json is here: the memory plan for this machine
        print(summarize_plan(plan) if args.plan_summary else format_plan(plan))
        if not plan.fits:
            return 1  # the planner's verdict is the exit status
    return 0


def _remember_plan(cfg, world_size: int) -> None:
    """The plan's one-line summary, for an out-of-memory error to name what was planned."""
    from rlstack.errors import remember_plan
    from rlstack.planner import plan_for_validate, summarize_plan

    try:
        plan = plan_for_validate(cfg, world_size)
    except Exception:  # the plan is a hint here; preflight has checked the config
        return
    if plan is not None:
        remember_plan(summarize_plan(plan))


def _die_with_launcher() -> None:
    """Under torchrun each rank runs in a session of its own: if the launcher is SIGKILLed (OOM
    killer, kill -9) the ranks would train on, re-parented to init, and write into a directory the
    user restarts a job in. The kernel kills this rank when its parent dies (PR_SET_PDEATHSIG)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return
    from megatron_bridge.patches.checkpoint_writer import die_with_parent

    launcher = os.getppid()
    if launcher == 1:  # the launcher is already gone
        os._exit(137)
    die_with_parent(launcher)


def _stop_on_sigterm() -> None:
    """SIGTERM (torchrun stopping its ranks, a scheduler) unwinds like Ctrl-C, so `finally` blocks run:
    the output directory's lock is released and an earlier run set aside by overwrite is put back."""
    import signal

    from rlstack.preemption import unwind

    # The training loop turns trainer.stop_signals into a graceful stop (rlstack/preemption.py).
    signal.signal(signal.SIGTERM, unwind)


def _default_world(cfg) -> int:
    p = cfg.parallel
    return p.tp * p.pp * max(p.dp, 1)


if __name__ == "__main__":
    from megatron_bridge.fast_exit import run_main

    run_main(main)
