"""Placement comparison: colocated vs split (placement.rollout_ranks=1, rollout.staleness 0, 1 and 2,
and 2 with partial rollouts).

Runs the real trainer (torchrun, `--nproc` ranks) once per placement on the same config and reads
each run's metrics.jsonl. Per placement and step (the first step, which warms up, is dropped):
step time, and each stage's busy and idle seconds:

- colocated: every rank takes turns; the rollout engine is busy for `timing/rollout_s` and idle
  for the rest of the step, the trainer busy for the rest (sync, score, update) and idle while
  generating.
- split: the rollout rank is busy for `timing/rollout_s` (generation on the rollout rank) and idle
  for the rest of the step; the training ranks idle for `timing/trainer_wait_rollout` and are busy
  for the rest.

    python benchmarks/placement.py --config yaml_configs/smollm2_arith_cpu.yaml --out benchmarks/results \
        trainer.total_steps=4 data.train_batch_size=4 rollout.max_new_tokens=32

Smallest run (proves the script works; ~5 min on 2 loaded cores):

    python benchmarks/placement.py --config yaml_configs/tiny_cpu.yaml --out /tmp/placement \
        trainer.total_steps=4 rollout.max_new_tokens=4

`--only NAME` (repeatable) runs a subset of the placements.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEMENTS = {
    "colocated": [],
    "split K=1 staleness 0": ["placement.rollout_ranks=1", "rollout.staleness=0"],
    "split K=1 staleness 1": ["placement.rollout_ranks=1", "rollout.staleness=1", "algorithm.rollout_is=token"],
    "split K=1 staleness 2": ["placement.rollout_ranks=1", "rollout.staleness=2", "algorithm.rollout_is=token"],
    "split K=1 staleness 2 partial": [
        "placement.rollout_ranks=1",
        "rollout.staleness=2",
        "algorithm.rollout_is=token",
        "rollout.partial=true",
    ],
}
# Keys the benchmark itself sets: a config's own verify_sync (colocated only) and validation stay out.
FIXED = ["rollout.verify_sync=0", "trainer.val_before_train=false", "trainer.val_after_train=false"]
FIXED += ["trainer.overwrite=true", "logging.progress=false", "logging.trackers=[jsonl]", "checkpoint.save_every=0"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--work", default="outputs/bench_placement")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--only", action="append", choices=sorted(PLACEMENTS), help="run only these placements")
    return p.parse_args(argv)


def run_one(name: str, extra: list[str], opts) -> tuple[list[dict], float]:
    out_dir = os.path.join(opts.work, name.replace(" ", "_").replace("=", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={opts.nproc}", "-m", "rlstack.train"]
    cmd += ["--config", opts.config, f"trainer.output_dir={out_dir}", *FIXED, *opts.overrides, *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=opts.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "reward/mean" in r], wall


def stage_times(rows: list[dict], split: bool) -> dict:
    """Mean seconds per step (steps after the first): step, rollout busy/idle, trainer busy/idle."""
    rows = rows[1:] if len(rows) > 1 else rows
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    step, rollout = mean("timing/step_s"), mean("timing/rollout_s")
    trainer_idle = mean("timing/trainer_wait_rollout") if split else rollout
    return {
        "steps": len(rows),
        "step_s": step,
        "rollout_busy_s": rollout,
        "rollout_idle_s": max(step - rollout, 0.0),
        "trainer_busy_s": step - trainer_idle,
        "trainer_idle_s": trainer_idle,
        "update_s": mean("timing/update_s"),
        "score_s": mean("timing/score_s"),
        "sync_s": mean("timing/sync_s"),
        "sync_bytes": mean("sync/bytes"),
        "staleness": mean("rollout/staleness"),
        "token_staleness": mean("rollout/token_staleness_mean"),
        "reward_mean": mean("reward/mean"),
    }


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def markdown(results: dict, opts, machine: str) -> str:
    head = "| placement | step s | rollout busy | rollout idle | trainer busy | trainer idle | update s | sync s | token age |"
    lines = [
        f"# Placement comparison ({os.path.basename(opts.config)}, {opts.nproc} ranks)",
        "",
        f"Machine: {machine}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; overrides: "
        f"{' '.join(opts.overrides) or '-'}. Mean seconds per step, first step dropped.",
        "",
        head,
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        t = r["stages"]
        lines.append(
            f"| {name} | {t['step_s']:.2f} | {t['rollout_busy_s']:.2f} | {t['rollout_idle_s']:.2f} | "
            f"{t['trainer_busy_s']:.2f} | {t['trainer_idle_s']:.2f} | {t['update_s']:.2f} | {t['sync_s']:.3f} | "
            f"{t['token_staleness']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    opts = parse_args(argv)
    machine = cpu_model()
    results = {}
    for name, extra in PLACEMENTS.items():
        if opts.only and name not in opts.only:
            continue
        rows, wall = run_one(name, extra, opts)
        results[name] = {"stages": stage_times(rows, split=bool(extra)), "wall_s": wall}
        print(name, json.dumps(results[name]["stages"]), flush=True)
    os.makedirs(opts.out, exist_ok=True)
    stem = os.path.join(opts.out, f"placement-{time.strftime('%Y-%m-%d')}")
    with open(stem + ".json", "w") as f:
        json.dump(
            {"machine": machine, "config": opts.config, "overrides": opts.overrides, "results": results}, f, indent=1
        )
    with open(stem + ".md", "w") as f:
        f.write(markdown(results, opts, machine))
    print(markdown(results, opts, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
