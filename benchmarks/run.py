"""Benchmark one config: the real trainer, stage micro-benchmarks, machine ceilings, TRL side by side.

    .venv/bin/python benchmarks/run.py --config yaml_configs/smollm2_arith_cpu.yaml   # = make bench

1. trainer: `torchrun -m rlstack.train --config CONFIG --profile trainer.total_steps=K`, its
   metrics.jsonl read back (the first step is warm-up), the RSS of every rank sampled meanwhile;
2. stages: rollout tokens/s per engine (hf, vllm where installed), actor and critic forward
   tokens/s, on the same layout and batch (benchmarks/stages.py under torchrun);
3. ceilings: matmul FLOP/s at the model's training and decode shapes, memcpy bytes/s, measured with
   the trainer's ranks x threads (benchmarks/ceilings.py);
4. agent: a multi-turn rollout's tokens/s against a single-turn one making the same policy tokens,
   and its share of time waiting on tools (benchmarks/agent.py, one process with every thread);
5. TRL: GRPOTrainer on the same model, task, batch and lengths, in `.venv-bench` (created here
   when missing; the comparison is skipped with a clear line when it cannot be installed).
`--bf16` runs both sides in bf16 mixed precision instead (results <config>-bf16-<date>; READMEs untouched).
Writes benchmarks/results/<config>-<date>.{md,json,png}; on CPU also the table in benchmarks/README.md
(and in README.md between the bench markers, where present). docs/benchmarks.md explains each figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import environment, report  # noqa: E402
from benchmarks.analysis import derive  # noqa: E402
from benchmarks.procs import run_sampled, tail  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="experiment YAML (yaml_configs/*.yaml)")
    p.add_argument("--rerender", default="", help="re-render the table/chart of a results .json; runs nothing")
    p.add_argument("overrides", nargs="*", help="section.key=value, passed to the trainer and the stages")
    p.add_argument("--nproc", type=int, default=0, help="ranks (default: GPUs present, else 2)")
    p.add_argument("--steps", type=int, default=3, help="trainer steps; the first --warmup-steps are warm-up")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=1,
        help="leading steps left out of every figure, rlstack's and TRL's alike (default 1). A CPU rank's heap "
        "grows over its first ~20 steps (page faults, docs/benchmarks.md 'The heap's warm-up'): --steps 26 "
        "--warmup-steps 20 measures the 6 steps after it",
    )
    p.add_argument(
        "--settings",
        default="no_ref,ref,one_process,unshared",
        help="comma list, each run by rlstack and TRL alike: no_ref (no reference model: rlstack "
        "use_kl_loss=false, TRL beta=0), ref (a reference model: use_kl_loss=true, TRL beta = kl_loss_coef), "
        "one_process (no_ref with rlstack as one process using every thread, TRL's layout; TRL's no_ref "
        "run is its pair), unshared (no_ref with model.prefix_sharing=false: each sample's prompt run in "
        "its own rows, TRL's FLOPs; TRL's no_ref run is its pair), config (the config as it is; the only one for configs TRL cannot run)",
    )
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="add a `lora` setting: rlstack with model.lora.rank=RANK (adapters only trained, the reference "
        "free, the sync moving adapter bytes) and a reference KL; its TRL pair is TRL's `ref` run (full training)",
    )
    p.add_argument("--reps", type=int, default=3, help="timed repetitions of each micro-benchmark")
    p.add_argument("--engines", default="hf,vllm", help="rollout engines to micro-benchmark")
    p.add_argument("--trl-steps", type=int, default=3, help="TRL steps; the first is warm-up")
    p.add_argument(
        "--trl-allocator",
        choices=("same", "glibc"),
        default="same",
        help="TRL's host allocator: the trainer's (same; tcmalloc preloaded where rlstack uses it) or glibc",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="both sides in bf16 mixed precision (rlstack model.dtype=bfloat16, TRL bf16): results as "
        "<config>-bf16-<date>, ceilings in bf16, the README tables (fp32 comparison rows) left as they are",
    )
    p.add_argument(
        "--skip",
        default="",
        help="comma list of parts to skip: trainer,stages,ceilings,agent (both rows),agent_long,trl",
    )
    p.add_argument(
        "--reuse",
        default="",
        help="results .json of an earlier run of the same config: the parts "
        "named in --skip are taken from it (noted in the table)",
    )
    p.add_argument("--bench-venv", default=os.path.join(ROOT, ".venv-bench"), help="TRL's environment")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--work-dir", default=os.path.join(ROOT, "outputs", "bench"), help="logs and run outputs")
    p.add_argument("--timeout-min", type=float, default=60, help="limit for each part")
    return p.parse_args(argv)


BF16_SUFFIX = "-bf16"


def with_precision(args) -> list[str]:
    """The trainer's overrides, with `model.dtype=bfloat16` for --bf16 (TRL follows setup["dtype"])."""
    if not args.bf16:
        return list(args.overrides)
    if any(o.startswith("model.dtype=") for o in args.overrides):
        raise SystemExit("benchmarks/run.py: --bf16 sets model.dtype=bfloat16; drop the model.dtype override")
    # the sync check off: the fp32 engine against the bf16 actor differs by bf16 rounding (SmolLM2: 4.1e-2 on
    # the greedy probe, 0.50 on a sampled low-probability token), not by the fp32 tolerance it holds to
    return [*args.overrides, "model.dtype=bfloat16", "rollout.verify_sync=0"]


def updates_readme(setup: dict, out_dir: str) -> bool:
    """The READMEs carry the fp32 comparison of a CPU run into the default folder; a --bf16 row stays in its file."""
    default_dir = os.path.abspath(out_dir) == os.path.join(ROOT, "benchmarks", "results")
    return setup["device"] == "cpu" and default_dir and not setup.get("bf16_row")


def echo_line(line: str) -> bool:
    return any(w in line for w in ("| step_s ", "profile:", "Traceback", "Error", "error:"))


def torchrun_cmd(nproc: int) -> list[str]:
    # `python -m torch.distributed.run` is torchrun without relying on the script being on PATH.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def settings_of(args, cfg) -> dict:
    """name -> what rlstack and TRL each run under it (overrides, TRL's beta, whether a reference is loaded)."""
    a = cfg.algorithm
    coef = a.kl_loss_coef
    known = {
        "no_ref": {
            "label": "no reference model (rlstack use_kl_loss=false, TRL beta=0)",
            "overrides": ["algorithm.use_kl_loss=false"],
            "beta": 0.0,
            "reference": a.use_kl_in_reward,
        },
        "ref": {
            "label": f"reference model (rlstack use_kl_loss=true kl_loss_coef={coef:g}, TRL beta={coef:g})",
            "overrides": ["algorithm.use_kl_loss=true", f"algorithm.kl_loss_coef={coef!r}"],
            "beta": coef,
            "reference": True,
        },
        "one_process": {
            "label": "no reference model, rlstack as 1 process x all threads (TRL's process layout)",
            "overrides": ["algorithm.use_kl_loss=false"],
            "beta": 0.0,
            "reference": a.use_kl_in_reward,
            "nproc": 1,
            "trl_from": "no_ref",  # the same work on TRL's side: its no_ref run (run it here if absent)
        },
        "unshared": {
            "label": "no reference model, every row's prompt in its own forward and backward "
            "(rlstack model.prefix_sharing=false: TRL's FLOPs; TRL: its no_ref run)",
            "overrides": ["algorithm.use_kl_loss=false", "model.prefix_sharing=false"],
            "beta": 0.0,
            "reference": a.use_kl_in_reward,
            "prefix_sharing": False,
            "trl_from": "no_ref",
        },
        "config": {
            "label": "as configured",
            "overrides": [],
            "beta": coef if a.use_kl_loss else 0.0,
            "reference": a.use_kl_loss or a.use_kl_in_reward,
        },
    }
    if getattr(args, "lora", 0) > 0:
        known["lora"] = {
            "label": f"LoRA rank {args.lora} (rlstack model.lora.rank={args.lora}, use_kl_loss=true with the "
            f"actor's adapters off as the reference; TRL: its ref run, full training)",
            "overrides": [
                f"model.lora.rank={args.lora}",
                "algorithm.use_kl_loss=true",
                f"algorithm.kl_loss_coef={coef!r}",
            ],
            "beta": coef,
            "reference": False,  # the reference is the actor with its adapters off: no second model
            "trl_from": "ref",
        }
    names = [n for n in args.settings.split(",") if n]
    if "lora" in known and "lora" not in names:
        names.append("lora")
    if a.name != "grpo" or not cfg.data.synthetic:  # TRL runs GRPO on synthetic tasks only: nothing to pair
        names = ["config"]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"benchmarks/run.py: --settings {args.settings!r}: use a comma list of {', '.join(known)}")
    return {n: known[n] for n in names}


def run_trainer(args, setup: dict, env: dict, name: str = "", overrides: tuple = (), nproc: int = 0) -> dict:
    """The trainer on `nproc` ranks (default: the setup's), the machine's threads split evenly over them."""
    out = os.path.join(args.work_dir, setup["config_name"], "trainer" + (f"-{name}" if name else ""))
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends: start clean
    if nproc and nproc != setup["nproc"]:
        threads = setup["nproc"] * setup["threads_per_rank"] // nproc
        env = {**env, "OMP_NUM_THREADS": str(threads)}
        overrides = (*overrides, f"parallel.threads_per_rank={threads}")
    cmd = torchrun_cmd(nproc or setup["nproc"]) + [
        "-m",
        "rlstack.train",
        "--config",
        args.config,
        "--profile",
        f"trainer.total_steps={args.steps}",
        f"trainer.output_dir={out}",
        "trainer.val_before_train=false",
        "trainer.val_after_train=false",
        "trainer.val_every=0",
        "checkpoint.save_every=0",
        "checkpoint.resume=never",
        *args.overrides,
        *overrides,
    ]
    r = run_sampled(
        cmd,
        os.path.join(out, "bench.log"),
        launcher=True,
        timeout_s=args.timeout_min * 60,
        env=env,
        cwd=ROOT,
        echo=echo_line,
    )
    result = {"memory": r.memory.as_dict(), "wall_s": r.wall_s, "log": r.log_path, "command": " ".join(cmd)}
    path = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(path):  # a run that dies late keeps its finished steps (each line is flushed)
        with open(path) as f:
            result["steps"] = [json.loads(line) for line in f if line.strip()]
    if r.returncode != 0:
        done = len([s for s in result.get("steps", []) if "timing/step_s" in s])
        result["error"] = f"{_failure('trainer', r)} after {done} of {args.steps} steps"
    return result


def run_stages(args, setup: dict, env: dict) -> dict:
    out = os.path.join(args.work_dir, setup["config_name"], "stages")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "stages.json")
    cmd = torchrun_cmd(setup["nproc"]) + [
        os.path.join(ROOT, "benchmarks", "stages.py"),
        "--config",
        args.config,
        "--json",
        path,
        "--engines",
        args.engines,
        "--reps",
        str(args.reps),
        "--warmup",
        "1",
        f"trainer.output_dir={out}",
        *args.overrides,
    ]
    if os.path.isfile(path):
        os.remove(path)
    r = run_sampled(
        cmd,
        os.path.join(out, "bench.log"),
        launcher=True,
        timeout_s=args.timeout_min * 60,
        env=env,
        cwd=ROOT,
        echo=echo_line,
    )
    if r.returncode != 0 or not os.path.isfile(path):
        return {"error": _failure("stage micro-benchmarks", r)}
    with open(path) as f:
        return {**json.load(f), "memory": r.memory.as_dict()}


def run_ceilings(args, setup: dict, stages: dict, env: dict) -> dict:
    out = os.path.join(args.work_dir, setup["config_name"], "ceilings")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "ceilings.json")
    train_rows = stages.get("train_rows_per_rank") or setup["micro_batch_size"] * (
        setup["max_prompt_length"] + setup["max_new_tokens"]
    )
    hf = stages.get("rollout", {}).get("hf", {})
    decode_rows = hf.get("decode_rows_per_rank") or setup["decode_rows_per_rank"]
    on_gpu = setup["device"] == "cuda"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "ceilings.py"),
        "--hf-dir",
        setup["hf_dir"],
        "--train-rows",
        str(train_rows),
        "--decode-rows",
        str(decode_rows),
        "--tp",
        str(setup["tp"]),
        "--pp",
        str(setup["pp"]),
        "--procs",
        str(setup["nproc"]),
        "--threads",
        str(setup["threads_per_rank"]),
        "--dtype",
        setup["dtype"],
        "--device",
        "cuda" if on_gpu else "cpu",
        "--memcpy-mib",
        "2048" if on_gpu else "256",
        "--json",
        path,
    ]
    r = run_sampled(
        cmd, os.path.join(out, "bench.log"), launcher=False, timeout_s=args.timeout_min * 60, env=env, cwd=ROOT
    )
    if r.returncode != 0 or not os.path.isfile(path):
        return {"error": _failure("ceilings", r)}
    with open(path) as f:
        return json.load(f)


def preload_allocator(env: dict, setup: dict) -> None:
    """The trainer's host allocator (tcmalloc) preloaded in a benchmark process's `env`."""
    env["LD_PRELOAD"] = f"{setup['host_allocator_lib']} {env.get('LD_PRELOAD', '')}".strip()


AGENT_TURNS = 4  # policy turns of the agent row's trajectories (3 tool calls between them)
# The second agent row's tokens a turn (agent_long): an agent's turn of a few sentences, with the same
# 16-id tool responses; the first row's short turns (the config's response split in 4) make the
# tool ids' own prefill half as many tokens as the policy's.
AGENT_LONG_TURN_TOKENS = 64


def run_agent(args, setup: dict, env: dict, turn_tokens: int = 0, part: str = "agent") -> dict:
    """The agent row (benchmarks/agent.py): the config's engine, decode rows per rank and response
    length split over AGENT_TURNS turns (or `turn_tokens` a turn), in one process with every thread
    of the trainer's ranks."""
    out = os.path.join(args.work_dir, setup["config_name"], part)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "agent.json")
    if os.path.isfile(path):
        os.remove(path)
    threads = setup["nproc"] * setup["threads_per_rank"]
    agent_env = {**env, "OMP_NUM_THREADS": str(threads)}
    if setup.get("host_allocator_lib"):  # the trainer's host allocator (its ranks run the rollout on it)
        preload_allocator(agent_env, setup)
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "agent.py"),
        "--hf",
        setup["hf_dir"],
        "--engine",
        setup["engine"],
        "--batch",
        str(setup["decode_rows_per_rank"]),
        "--prompt-len",
        str(min(64, setup["max_prompt_length"])),
        "--turns",
        str(AGENT_TURNS),
        "--turn-tokens",
        str(turn_tokens or max(1, setup["max_new_tokens"] // AGENT_TURNS)),
        "--repeats",
        str(args.reps),
        "--threads",
        str(threads),
        "--json",
        path,
    ]
    r = run_sampled(
        cmd,
        os.path.join(out, "bench.log"),
        launcher=False,
        timeout_s=args.timeout_min * 60,
        env=agent_env,
        cwd=ROOT,
        echo=lambda line: line.startswith("agent ") or "Error" in line,
    )
    if r.returncode != 0 or not os.path.isfile(path):
        return {"error": _failure("agent rollout", r)}
    with open(path) as f:
        return json.load(f)


def run_trl(args, setup: dict, cfg, name: str = "", beta: float = 0.0) -> dict:
    python, reason = environment.ensure_bench_venv(args.bench_venv)
    if python is None:
        print(f"TRL comparison skipped: {reason}", flush=True)
        return {"skipped": reason}
    if cfg.algorithm.name != "grpo" or not cfg.data.synthetic:
        reason = "the TRL comparison runs GRPO on a synthetic task: this config is not one"
        print(f"TRL comparison skipped: {reason}", flush=True)
        return {"skipped": reason}
    out = os.path.join(args.work_dir, setup["config_name"], "trl" + (f"-{name}" if name else ""))
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    path = os.path.join(out, "trl.json")
    a, d = cfg.algorithm, cfg.data
    cmd = [
        python,
        os.path.join(ROOT, "benchmarks", "trl_grpo.py"),
        "--hf-dir",
        setup["hf_dir"],
        "--task",
        d.synthetic,
        "--train-size",
        str(d.synthetic_train_size),
        "--max-operand",
        str(d.synthetic_max_operand),
        "--data-seed",
        str(d.seed),
        "--prompts",
        str(d.train_batch_size),
        "--generations",
        str(cfg.rollout.n),
        "--max-new-tokens",
        str(cfg.rollout.max_new_tokens),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--temperature",
        str(cfg.rollout.temperature),
        "--beta",
        str(beta),
        "--lr",
        str(a.actor_lr),
        "--steps",
        str(args.trl_steps),
        "--dtype",
        setup["dtype"],
        "--threads",
        str(setup["nproc"] * setup["threads_per_rank"]),
        "--output-dir",
        out,
        "--json",
        path,
    ]
    if cfg.model.gradient_checkpointing:  # the same activation recompute on both sides (TRL defaults to on)
        cmd.append("--gradient-checkpointing")
    env = {**os.environ, "OMP_NUM_THREADS": str(setup["nproc"] * setup["threads_per_rank"]), "PYTHONUNBUFFERED": "1"}
    allocator = "glibc"
    if args.trl_allocator == "same" and setup.get("host_allocator_lib"):  # the same allocator on both sides
        preload_allocator(env, setup)
        allocator = setup["host_allocator"]
    r = run_sampled(
        cmd,
        os.path.join(out, "bench.log"),
        launcher=False,
        timeout_s=args.timeout_min * 60,
        env=env,
        cwd=ROOT,
        echo=lambda line: "'step_time'" in line or "Error" in line,
    )
    if r.returncode != 0 or not os.path.isfile(path):
        return {"error": _failure("TRL", r)}
    with open(path) as f:
        return {**json.load(f), "memory": r.memory.as_dict(), "host_allocator": allocator}


def _failure(part: str, r) -> str:
    what = f"timed out after {r.wall_s:.0f} s" if r.timed_out else f"exit code {r.returncode}"
    print(f"{part} failed ({what}); log {r.log_path}:\n{tail(r.log_path)}", flush=True)
    return f"{part} {what} (log {os.path.relpath(r.log_path, ROOT)})"


def _load_reuse(path: str, config_name: str) -> dict:
    if not path:
        return {}
    with open(path) as f:
        earlier = json.load(f)["results"]
    if earlier["config_name"] != config_name:
        raise SystemExit(f"--reuse {path} holds a run of {earlier['config_name']}, not {config_name}")
    return earlier


def check_warmup(args) -> None:
    """--warmup-steps leaves at least one measured step on each side that runs (TRL unless --skip trl)."""
    sides = [("--steps", args.steps)]
    if "trl" not in set(filter(None, args.skip.split(","))):
        sides.append(("--trl-steps", args.trl_steps))
    short = [f"{flag} {n}" for flag, n in sides if n <= args.warmup_steps]
    if args.warmup_steps < 1 or short:
        raise SystemExit(
            f"benchmarks/run.py: --warmup-steps {args.warmup_steps} must be >= 1 and leave a measured step "
            f"({', '.join(short) or 'below 1'}): raise the step counts or lower --warmup-steps"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rerender:
        with open(args.rerender) as f:
            return publish(json.load(f)["results"], args.out_dir)
    if not args.config:
        raise SystemExit("benchmarks/run.py: --config is required (or --rerender RESULTS.json)")
    check_warmup(args)
    from rlstack.config import load_config
    from rlstack.observability.quiet import quiet_third_party

    quiet_third_party()  # the default model's first conversion prints no progress bars (the trainer's own runs quiet too)

    args.overrides = with_precision(args)
    cfg = load_config(args.config, args.overrides)
    setup = environment.describe_setup(args, cfg)
    if args.bf16:  # its own results name: never mistaken for (or written over) the fp32 comparison
        setup.update(config_name=setup["config_name"] + BF16_SUFFIX, bf16_row=True)
    skip = set(filter(None, args.skip.split(",")))
    load_at_start = os.getloadavg()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(setup["threads_per_rank"]),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }  # logs and progress lines as they happen
    results = {
        "config": args.config,
        "config_name": setup["config_name"],
        "date": datetime.date.today().isoformat(),
        "command": " ".join(
            [
                os.path.relpath(sys.argv[0], ROOT) if sys.argv else "benchmarks/run.py",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "setup": setup,
        "model": environment.model_info(setup["hf_dir"]),
    }
    settings = settings_of(args, cfg)
    first = next(iter(settings))
    setup["reference"] = settings[first]["reference"]
    results["primary_setting"] = first
    reused = _load_reuse(args.reuse, setup["config_name"])

    def run_part(part: str, fn, name: str = "") -> dict:
        if part in skip or (part == "agent_long" and "agent" in skip):  # --skip agent: both agent rows
            earlier = reused.get("settings", {}).get(name, {}).get(part) if name else None
            if earlier is None and (not name or name == first):  # an earlier run without settings: its own
                earlier = reused.get(part)
            if earlier is not None:
                results.setdefault("reused", {"from": args.reuse, "parts": []})
                results["reused"]["parts"].append(f"{part} ({name})" if name else part)
                return earlier
            return {"skipped": "--skip " + part}
        print(f"== {part}" + (f" ({name})" if name else ""), flush=True)
        return fn()

    for i, (name, st) in enumerate(settings.items()):
        st["trainer"] = run_part(
            "trainer",
            lambda st=st, name=name: run_trainer(args, setup, env, name, st["overrides"], st.get("nproc", 0)),
            name,
        )
        if i == 0:  # the micro-benchmarks and ceilings do not depend on the KL setting: once
            results["stages"] = run_part("stages", lambda: run_stages(args, setup, env))
            results["ceilings"] = run_part(
                "ceilings", lambda: run_ceilings(args, setup, results.get("stages", {}), env)
            )
            results["agent"] = run_part("agent", lambda: run_agent(args, setup, env))
            results["agent_long"] = run_part(
                "agent_long", lambda: run_agent(args, setup, env, AGENT_LONG_TURN_TOKENS, "agent_long")
            )
        pair = settings.get(st.get("trl_from", ""), {}).get("trl")
        if pair is not None:  # the same work on TRL's side was run under another setting's name
            st["trl"] = pair
            continue
        st["trl"] = run_part("trl", lambda st=st, name=name: run_trl(args, setup, cfg, name, st["beta"]), name)
    results["trainer"], results["trl"] = settings[first]["trainer"], settings[first]["trl"]
    results["settings"] = settings
    results["machine"] = environment.machine(load_at_start)
    results["versions"] = environment.versions(results)
    return publish(results, args.out_dir)


def free_stem(stem: str) -> str:
    """`stem`, or `stem-2`, `stem-3`, ...: a repeated run on the same day never overwrites saved results."""
    taken = lambda c: any(os.path.exists(c + ext) for ext in (".md", ".json", ".png"))  # noqa: E731
    n, candidate = 1, stem
    while taken(candidate):
        n += 1
        candidate = f"{stem}-{n}"
    return candidate


def publish(results: dict, out_dir: str) -> int:
    figures = derive(results)
    os.makedirs(out_dir, exist_ok=True)
    stem = free_stem(os.path.join(out_dir, f"{results['config_name']}-{results['date']}"))
    text = report.render_markdown(results, figures)
    with open(stem + ".md", "w") as f:
        f.write(text)
    report.write_json(results, figures, stem + ".json")
    try:
        report.write_chart(results, figures, stem + ".png")
    except Exception as e:  # a chart is a convenience: the table and JSON are already written
        print(f"chart not written: {type(e).__name__}: {e}", flush=True)
    if updates_readme(results["setup"], out_dir):  # the READMEs link into the default folder
        for readme, rel in (("benchmarks/README.md", "results"), ("README.md", "benchmarks/results")):
            report.update_readme(
                os.path.join(ROOT, readme), report.readme_section(results, figures, rel, os.path.basename(stem))
            )
    print(text, flush=True)
    print(f"wrote {stem}.md, .json, .png", flush=True)
    parts = [results.get(k, {}) for k in ("stages", "ceilings", "agent", "agent_long")]
    for st in results.get("settings", {}).values():
        parts += [st.get("trainer", {}), st.get("trl", {})]
    failed = [p for p in parts if "error" in p] or [k for k in ("trainer", "trl") if "error" in results.get(k, {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
