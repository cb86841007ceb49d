"""Build the configured rollout engine (`build_engine`); the engine interface itself lives in
`rlstack.rollout.interface` (re-exported here), so the engines import the interface without this
module, which imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from rlstack.errors import UserError
from rlstack.rollout.interface import Generation, RolloutEngine, SamplingParams, check_row_caps

if TYPE_CHECKING:  # keep `import rlstack.rollout.base` free of torch
    import torch

    from megatron_bridge.parallel import ParallelGroups
    from rlstack.config import RolloutConfig

__all__ = ["ENGINES", "Generation", "RolloutEngine", "SamplingParams", "build_engine", "check_row_caps", "rollout_seed"]

ENGINES = ("hf", "vllm")


def build_engine(
    rollout_cfg: RolloutConfig,
    hf_dir: str,
    groups: ParallelGroups,
    eos_token_id: int,
    pad_token_id: int,
    lora_rank: int = 0,
    model_dtype: str = "float32",
) -> RolloutEngine:
    """The configured engine on this rank. vLLM construction is collective: every rank calls this.

    `eos_token_id` ends a response (and is kept in it); a negative value means no token does (benchmarks).
    `lora_rank` > 0: vLLM starts with its LoRA path on (`rlstack.rollout.lora_sync.vllm_lora_rank`).
    `model_dtype`: the actor's (model.dtype), which `rollout.dtype=auto` follows on CPUs with native bf16.
    """
    check_rollout(rollout_cfg, groups.dims.world_size)  # (preflight ran it on the run's ranks already)
    if rollout_cfg.engine == "hf":
        from rlstack.rollout.zero_copy import AliasingHFEngine

        dtype = hf_engine_dtype(getattr(rollout_cfg, "dtype", "auto"), model_dtype, groups.device)
        seed = rollout_seed(rollout_cfg, groups)
        return AliasingHFEngine(hf_dir, rollout_cfg, groups.device, eos_token_id, pad_token_id, seed=seed, dtype=dtype)
    from rlstack.rollout.vllm_engine import VLLMEngine

    seed = rollout_seed(rollout_cfg, groups)
    return VLLMEngine(hf_dir, rollout_cfg, groups, eos_token_id, pad_token_id, seed=seed, lora_rank=lora_rank)


def check_rollout(rollout_cfg: RolloutConfig, engine_ranks: int, split: bool = False) -> None:
    """The rollout settings that need no model, against the `engine_ranks` ranks hosting engines
    (every rank colocated; `split`: the placement.rollout_ranks rollout-only ranks). Preflight runs
    it (rlstack.parallel.check_layout), and so does `build_engine` for tools that skip preflight."""
    from rlstack.rollout.sync_check import check_settings

    r = rollout_cfg
    check_settings(r)
    if r.engine not in ENGINES:
        raise UserError(f"rollout.engine={r.engine!r} is unknown: use one of {', '.join(ENGINES)}")
    if engine_ranks % r.tp and split:
        raise UserError(
            f"rollout.tp={r.tp} does not divide placement.rollout_ranks={engine_ranks}: each rollout engine spans "
            f"rollout.tp rollout ranks; make placement.rollout_ranks a multiple of rollout.tp"
        )
    if engine_ranks % r.tp:
        raise UserError(
            f"rollout.tp={r.tp} must divide the world size {engine_ranks}: "
            f"choose rollout.tp from the divisors of the number of processes"
        )
    if r.engine == "hf" and r.tp != 1:
        raise UserError(
            f"rollout.engine=hf runs one full model per rank: set rollout.tp=1 (got {r.tp}) or use rollout.engine=vllm"
        )
    if getattr(r, "cpu_matmul", "auto") not in ("auto", "onednn", "avx2"):
        raise UserError(f"rollout.cpu_matmul={r.cpu_matmul!r} is unknown: use auto, onednn or avx2")
    if r.top_k == 0 or r.top_k < -1:  # SamplingParams.validate would stop the first rollout
        raise UserError(f"rollout.top_k={r.top_k}: use -1 (off) or a positive count")


def cpu_has_native_bf16(flags: Optional[str] = None) -> bool:
    """Does this CPU multiply bf16 in hardware (lscpu flag avx512_bf16 or amx_bf16)? Elsewhere oneDNN
    emulates bf16 matmuls (AVX-512 without them) or torch falls back to slow loops (AVX2 only)."""
    from megatron_bridge.patches import cpu_matmul

    return cpu_matmul.native_bf16() if flags is None else cpu_matmul.has_native_bf16(flags)


def hf_engine_dtype(setting: str, model_dtype: str, device) -> torch.dtype:
    """The hf engine's dtype for `rollout.dtype` (auto | float32 | bfloat16). auto: bf16 on GPUs (as
    before); on CPUs the actor's dtype where it is bf16 and the CPU has native bf16 (the engine then
    holds views of the actor's bf16 weights and decodes on oneDNN's bf16 kernels), else float32."""
    import torch

    if setting != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[setting]
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if model_dtype == "bfloat16" and cpu_has_native_bf16() else torch.float32


def rollout_seed(rollout_cfg: RolloutConfig, groups: ParallelGroups) -> int:
    """seed + rollout replica index (global rank // rollout TP).

    The trainer splits rollout work over all ranks by replica, so seeding by replica (not by the
    training DP rank) makes the samples independent of the training TP/PP/DP layout; the ranks of
    one vLLM TP group form one replica and sample alike.
    """
    return rollout_cfg.seed + groups.rank // rollout_cfg.tp
