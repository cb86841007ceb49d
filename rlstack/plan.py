"""Memory plan of an experiment before any GPU hour is spent (reads only the model's config.json).

    python -m rlstack.plan --config yaml_configs/X.yaml [key=value ...] --world-size N [--gpu-memory-gib G]
                           [--model-config FILE|NAME] [--device gpu|cpu] [--unfused-attention] [--json]

Prints each role's bytes per phase (rollout, scoring, update, optimizer step) on the most loaded GPU
and the peak as `N GiB of G GiB`. Exit 0 when it fits, 1 when it does not (naming the overrides that
would fit), 2 on a user error (one line). `--device cpu` plans host memory per rank of a CPU run.
"""

from __future__ import annotations

import argparse
import json
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A bad flag is a user error: one line, not argparse's usage block."""
        from rlstack.errors import UserError

        raise UserError(f"{message} (python -m rlstack.plan --help lists the flags)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(
        prog="python -m rlstack.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="experiment YAML (yaml_configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--world-size", type=int, required=True, help="number of GPUs (ranks)")
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=0.0,
        help="memory of one GPU (or CPU rank) in GiB; default: the config's parallel.gpu_memory_gib",
    )
    parser.add_argument(
        "--model-config",
        default=None,
        help="the model's config.json, or a shipped model name (Qwen/Qwen2-7B-Instruct), when model.path is absent here",
    )
    parser.add_argument("--device", default="gpu", choices=("gpu", "cpu"), help="plan GPU memory or CPU host memory")
    parser.add_argument(
        "--unfused-attention",
        action="store_true",
        help="plan megatron's unfused DotProductAttention (attention scores kept); rlstack's specs never use it "
        "(SDPA core attention without Transformer Engine, TE's fused attention with it)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from rlstack.errors import USER_ERRORS

    try:
        args = parse_args(argv)
        plan = _plan(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from rlstack.planner import format_plan, plan_to_dict

    print(json.dumps(plan_to_dict(plan), indent=1) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


def _plan(args):
    from rlstack.config import ConfigError, load_config
    from rlstack.errors import UserError
    from rlstack.planner import plan_for_config

    if args.world_size < 1:
        raise UserError(f"--world-size {args.world_size}: give the number of GPUs, at least 1")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        raise UserError(str(e))
    memory = args.gpu_memory_gib or (cfg.parallel.gpu_memory_gib if args.device == "gpu" else 0)
    if not memory and args.device == "cpu":
        raise UserError("--device cpu: pass --gpu-memory-gib G, the host memory of one CPU rank in GiB")
    if not memory:
        raise UserError(
            f"{args.config} names no target GPU (parallel.gpu_memory_gib): pass --gpu-memory-gib G, e.g. 80"
        )
    return plan_for_config(
        cfg,
        args.world_size,
        memory,
        device=args.device,
        model_config_file=args.model_config,
        config_path=args.config,
        fused_attention=False if args.unfused_attention else None,
    )


if __name__ == "__main__":
    sys.exit(main())
