"""The checks `benchmarks/gpu_check.sh` runs, the same on a GPU and (with `--cpu`) on CPU at tiny shapes.

    python benchmarks/device_check.py --mode gpu --config C --nproc N --out-dir D [key=value ...]

1. collectives: every rlstack.collectives helper on every group (NCCL + gloo on a GPU, gloo on CPU);
2. train: bf16 PPO steps (actor, critic and reference; the norms recomputed in backward), a dist
   checkpoint saved mid-run; each step's
   weight sync into the rollout engine ran (sync/bytes > 0) and the engine's log-probs agree with
   the actor's (the parity check) within the bf16 tolerance; every metric is finite;
3. resume: a fresh run loads that checkpoint and repeats the first run's later steps (exactly on
   CPU, with the ranks' core lending off; within `--resume-rtol`/`--resume-atol` on a GPU, whose
   kernels are not bit-deterministic);
4. planner: `python -m rlstack.plan` for the same config, its peak against the measured one, when
   that module exists (else `planner: not present`);
5. speed: step time and tokens/s of the training steps after the first.
Writes device_check.json into the output folder and prints one line per check; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Engine vs actor log-prob agreement in bf16 (the same bound tests/e2e/test_bf16.py asserts): a
# token's mean |difference| stays well under it when both sides hold the same weights; a stale or
# misplaced sync gives differences of order 1.
BF16_LOGPROB_ATOL = 5e-2
# The training run's settings, for the planner too: PPO (actor, critic, reference) in bf16, and the
# norms' selective recompute (megatron's output-discarding checkpoint, which needs patches.missing_te (m)
# without Transformer Engine, on a GPU as on CPU)
TRAIN_SETTINGS = ("algorithm.name=ppo", "model.dtype=bfloat16", "model.recompute_modules=[layernorm]")
VOLATILE = ("timing/", "throughput/", "mem/", "sync/seconds", "time/")
LEND_CORES_ENV = "RLSTACK_LEND_CORES"  # rlstack.rollout.host_cores.ENV_SWITCH (not imported: no torch here)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--steps", type=int, default=4, help="training steps; a checkpoint is saved half way")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank (CPU)")
    p.add_argument("--gpu-memory-gib", type=float, default=0.0, help="for the planner (0: read from the device)")
    p.add_argument("--resume-rtol", type=float, default=0.0, help="0 (and atol 0): the resumed steps match exactly")
    p.add_argument("--resume-atol", type=float, default=0.0)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--timeout-min", type=float, default=10)
    return p.parse_args(argv)


class Checks:
    """Collects PASS/FAIL lines and the figures behind them."""

    def __init__(self, t0: float):
        self.t0, self.results, self.failed = t0, {}, []

    def record(self, name: str, ok: bool, detail: str, **figures) -> bool:
        status = "ok" if ok else "FAILED"
        print(f"[device_check +{time.time() - self.t0:.0f}s] {name}: {status} | {detail}", flush=True)
        self.results[name] = {"ok": ok, "detail": detail, **figures}
        if not ok:
            self.failed.append(name)
        return ok


def _run(cmd: list[str], log_path: str, env: dict, timeout_s: float) -> tuple[int, str]:
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(log_path, errors="replace") as f:
        text = f.read()
    if rc != 0:
        print(f"--- {log_path} (exit {rc}), last lines:\n" + "\n".join(text.splitlines()[-25:]), flush=True)
    return rc, text


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def check_collectives(args, checks: Checks, env: dict) -> None:
    tp, pp = _layout(args.overrides)
    rc, text = _run(
        torchrun(args.nproc) + ["benchmarks/collectives_check.py", "--tp", str(tp), "--pp", str(pp)],
        os.path.join(args.out_dir, "collectives.log"),
        env,
        args.timeout_min * 60,
    )
    line = next((ln for ln in text.splitlines() if ln.startswith("collectives: ok")), "")
    checks.record("collectives", rc == 0 and bool(line), line.removeprefix("collectives: ok on ") or f"exit {rc}")


def _layout(overrides: list[str]) -> tuple[int, int]:
    kv = dict(o.split("=", 1) for o in overrides if "=" in o)
    return int(kv.get("parallel.tp", 1)), int(kv.get("parallel.pp", 1))


def train(args, out: str, env: dict, extra: list[str], log_name: str) -> tuple[int, list[dict], str]:
    cmd = torchrun(args.nproc) + [
        "-m",
        "rlstack.train",
        "--config",
        args.config,
        "--profile",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.val_after_train=false",
        "trainer.val_every=0",
        *TRAIN_SETTINGS,
        *args.overrides,
        *extra,
    ]
    rc, text = _run(cmd, os.path.join(args.out_dir, log_name), env, args.timeout_min * 60)
    path = os.path.join(out, "metrics.jsonl")
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return rc, [r for r in rows if "reward/mean" in r], text


def check_training(args, checks: Checks, rows: list[dict], rc: int) -> None:
    steps = [r["step"] for r in rows]
    if not checks.record(
        "train", rc == 0 and steps == list(range(1, args.steps + 1)), f"bf16 PPO steps {steps} (exit {rc})"
    ):
        return
    bad = sorted({k for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)})
    roles = [k for k in ("actor/loss", "critic/loss") if k not in rows[-1]]
    reference = any(k in r for r in rows for k in ("actor/kl", "actor/reward_kl"))
    checks.record(
        "metrics",
        not bad and not roles and reference,
        f"non-finite {bad or 'none'}; missing {roles or 'none'}; reference KL {'present' if reference else 'MISSING'}",
    )
    # rollout.zero_copy: an engine that aliases the actor's tensors moves 0 bytes by design
    synced = all(r.get("sync/bytes", 0) + r.get("sync/aliased_bytes", 0) > 0 for r in rows)
    diff = max(r["actor/rollout_diff"] for r in rows)
    diff_max = max(r["actor/rollout_diff_max"] for r in rows)
    checks.record(
        "weight_sync_parity",
        synced and diff <= BF16_LOGPROB_ATOL,
        f"sync every step {synced}; engine vs actor |logprob diff| mean {diff:.2e} (bound "
        f"{BF16_LOGPROB_ATOL:g}), max {diff_max:.2e}",
        rollout_diff=diff,
        rollout_diff_max=diff_max,
    )


def check_resume(args, checks: Checks, first: list[dict], env: dict) -> None:
    saved_at = args.steps // 2
    ckpt = os.path.join(args.out_dir, "train", "checkpoints", f"step_{saved_at:08d}")
    if not os.path.isfile(os.path.join(ckpt, "COMPLETE.json")):
        checks.record("checkpoint", False, f"no complete checkpoint {ckpt}")
        return
    rc, rows, text = train(
        args,
        os.path.join(args.out_dir, "resume"),
        env,
        ["checkpoint.save_every=0", f"checkpoint.resume={ckpt}"],
        "resume.log",
    )
    loaded = f"resumed from {ckpt} at step {saved_at}" in text
    expected = {r["step"]: r for r in first if r["step"] > saved_at}
    worst, where, outside = compare_steps(expected, rows, args.resume_rtol, args.resume_atol)
    steps_ok = sorted(r["step"] for r in rows) == sorted(expected)
    checks.record(
        "checkpoint",
        rc == 0 and loaded and steps_ok and not outside,
        f"dist checkpoint of step {saved_at} saved and loaded: {loaded}; steps {[r['step'] for r in rows]} "
        f"repeat the first run's with max relative difference {worst:.2e}"
        f"{' (' + where + ')' if where else ''}; outside rtol {args.resume_rtol:g} / atol "
        f"{args.resume_atol:g}: {outside or 'none'}",
        max_rel_diff=worst,
    )


def compare_steps(expected: dict[int, dict], rows: list[dict], rtol: float, atol: float):
    """(largest relative difference, where, keys outside atol + rtol*|expected|) over non-volatile metrics."""
    worst, where, outside = 0.0, "", []
    for r in rows:
        for key, value in r.items():
            ref = expected.get(r["step"], {}).get(key)
            if key.startswith(VOLATILE) or not isinstance(value, float) or not isinstance(ref, float):
                continue
            rel = abs(value - ref) / max(abs(ref), 1e-12)
            if rel > worst:
                worst, where = rel, f"{key} at step {r['step']}"
            # atol: the policy-gradient loss cancels to ~1e-7, where any kernel difference shows
            if abs(value - ref) > atol + rtol * abs(ref):
                outside.append(f"{key}@{r['step']}")
    return worst, where, outside


def measured_peak_gib(rows: list[dict], mode: str) -> float:
    key = "mem/gpu_peak_gib" if mode == "gpu" else "mem/rss_peak_gib"  # per rank (rank 0's process)
    return max((r.get(key, 0.0) for r in rows), default=0.0)


def check_planner(args, checks: Checks, rows: list[dict], env: dict) -> None:
    # this checkout's file, not whatever `rlstack` an installed environment would import
    if not os.path.isfile(os.path.join(ROOT, "rlstack", "plan.py")):
        print("planner: not present", flush=True)
        checks.results["planner"] = {"ok": True, "detail": "not present"}
        return
    memory = args.gpu_memory_gib or _device_memory_gib(args.mode, args.nproc)
    cmd = [
        sys.executable,
        "-m",
        "rlstack.plan",
        "--config",
        args.config,
        *TRAIN_SETTINGS,
        *args.overrides,
        "--world-size",
        str(args.nproc),
        "--gpu-memory-gib",
        f"{memory:.1f}",
        "--device",
        args.mode,
        "--json",
    ]
    # no --unfused-attention: without Transformer Engine the local spec runs rlstack's SDPA core
    # attention (megatron_bridge/sdpa_attention.py), which keeps no attention scores either
    rc, text = _run(cmd, os.path.join(args.out_dir, "plan.log"), env, 300)
    measured = measured_peak_gib(rows, args.mode)
    predicted = _plan_peak_gib(text)
    # exit 1 = "does not fit" (a verdict, not a failure of the check); anything else is a crash
    ok = rc in (0, 1) and predicted is not None
    ratio = f", predicted/measured {predicted / measured:.2f}" if ok and measured > 0 else ""
    checks.record(
        "planner",
        ok,
        f"predicted peak {predicted} GiB per device, measured {measured:.2f} GiB{ratio} (plan exit {rc})",
        predicted_gib=predicted,
        measured_gib=measured,
    )


def _plan_peak_gib(text: str):
    start = text.find("{")
    try:
        plan = json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        return None
    for key in ("peak_gib", "peak_per_gpu_gib", "peak"):
        if isinstance(plan.get(key), (int, float)):
            return float(plan[key])
    return None


def _device_memory_gib(mode: str, nproc: int) -> float:
    """One GPU's memory, or on CPU the host's memory shared by the ranks."""
    if mode == "gpu":
        import torch

        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / nproc


def report_speed(checks: Checks, rows: list[dict]) -> None:
    timed = rows[1:] or rows  # the first step includes warm-up (allocations, first sync)
    mean = lambda key: sum(r.get(key, 0.0) for r in timed) / len(timed)  # noqa: E731
    figures = {
        "step_s": mean("timing/step_s"),
        "rollout_tok_s": mean("throughput/rollout_tok_s"),
        "actor_tok_s": mean("throughput/actor_tok_s"),
        "critic_tok_s": mean("throughput/critic_tok_s"),
    }
    checks.record(
        "speed",
        figures["step_s"] > 0,
        f"step {figures['step_s']:.3f} s | rollout {figures['rollout_tok_s']:.0f} tok/s | actor update "
        f"{figures['actor_tok_s']:.0f} tok/s | critic update {figures['critic_tok_s']:.0f} tok/s "
        f"(mean of steps 2-{len(rows)})",
        **figures,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    checks = Checks(time.time())
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    if args.mode == "cpu":
        # Cores lent between the ranks (rlstack/rollout/host_cores.py) change a rank's thread count in
        # mid-rollout at moments set by timing, and with it the engine's rounding: the exact comparison
        # of the resumed steps holds with the lending off (docs/reliability.md "Exact resume and lent cores").
        env[LEND_CORES_ENV] = "0"
    check_collectives(args, checks, env)
    rc, rows, _ = train(
        args,
        os.path.join(args.out_dir, "train"),
        env,
        [f"checkpoint.save_every={args.steps // 2}", "checkpoint.keep_last=0", "checkpoint.resume=never"],
        "train.log",
    )
    check_training(args, checks, rows, rc)
    if rows:
        check_resume(args, checks, rows, env)
        check_planner(args, checks, rows, env)
        report_speed(checks, rows)
    with open(os.path.join(args.out_dir, "device_check.json"), "w") as f:
        json.dump(
            {
                "mode": args.mode,
                "config": args.config,
                "overrides": args.overrides,
                "nproc": args.nproc,
                "checks": checks.results,
                "failed": checks.failed,
            },
            f,
            indent=2,
        )
    print(
        f"device_check ({args.mode}): {'all checks passed' if not checks.failed else 'FAILED: ' + ', '.join(checks.failed)}",
        flush=True,
    )
    return 1 if checks.failed else 0


if __name__ == "__main__":
    from megatron_bridge.fast_exit import run_main

    run_main(main)
