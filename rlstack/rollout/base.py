"""The rollout engine interface: generate from token ids, take weights, report metrics.

Engines (`hf_engine.HFEngine`, `vllm_engine.VLLMEngine`) live one per rank for the whole run; the
weight-sync bridge (`megatron_bridge.reshard.WeightSync`) writes the actor's weights into them
before every rollout, either in place through `param_targets()` or through `load_weights()`
(the contract: `megatron_bridge.sync_target.SyncTarget`).

Log-prob convention: `Generation.logprobs[i]` is log p(response_ids[i]) under the temperature-scaled
distribution softmax(logits / temperature) that was sampled from (temperature 1 for greedy), as in
verl; the actor recomputes exactly that (`workers/actor.py`). The hf engine takes it before top-k /
top-p filtering. vLLM (`logprobs_mode="processed_logprobs"`) takes it after filtering, renormalised
over the kept tokens: the two agree unless top-k or top-p is active.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from rlstack.errors import UserError

if TYPE_CHECKING:  # keep `import rlstack.rollout.base` free of torch
    import torch

    from megatron_bridge.parallel import ParallelGroups
    from rlstack.config import RolloutConfig

ENGINES = ("hf", "vllm")


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 64
    greedy: bool = False  # argmax decoding; temperature/top-p/top-k are ignored
    seed: int = 0  # added to the engine's base seed; a new value reseeds the engine's sampler

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling n={self.n} must be at least 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0: use greedy=True for argmax decoding")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or a positive count")


@dataclass
class Generation:
    prompt_index: int  # index into the `prompts` list given to `generate`
    prompt_ids: list[int]
    response_ids: list[int]  # ends at and includes eos when finish_reason == "stop"
    logprobs: list[float]  # one per response token, of softmax(logits / temperature) (module docstring)
    finish_reason: str  # "stop" (eos) | "length" (max_new_tokens)


class RolloutEngine(ABC):
    """One rollout engine per rank. `tp_size`/`tp_rank` are its rollout tensor-parallel position.

    It implements the bridge's `megatron_bridge.sync_target.SyncTarget` (what the weight sync writes
    into: `param_targets`, `load_weights`, `expected_shapes`, `weights_updated`, `alias_weights`,
    `target_layout`), plus generation and its counters."""

    target_layout: str  # megatron_bridge.sync_target.SyncTarget: names of param_targets(); each engine sets it
    tp_size: int = 1
    tp_rank: int = 0

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """n samples per prompt, ordered prompt-major: [p0s0, p0s1, ..., p1s0, ...]."""

    @abstractmethod
    def param_targets(self) -> Optional[dict[str, torch.Tensor]]:
        """Engine tensors the bridge may overwrite in place (names in the engine's layout), or None."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors through the engine's own loader (consumed lazily, in order)."""

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor `load_weights` expects (to validate a sync up front)."""
        targets = self.param_targets()
        assert targets is not None, f"{type(self).__name__} must override expected_shapes()"
        return {name: tuple(t.shape) for name, t in targets.items()}

    def weights_updated(self) -> None:
        """Called after every in-place write: drop caches derived from the old weights."""

    def alias_weights(self, views: dict[str, torch.Tensor]) -> set[str]:
        """Zero copy (`rollout.zero_copy`): make the named engine tensors these views of the actor's
        parameters (same name as in `param_targets`; a grouped view [G, R, ...] stands for [G*R, ...]).
        Returns the names it aliased; the weight sync skips them. Default: none. Aliased tensors are
        the actor's own storage: nothing may write into them through the engine (`load_weights`)."""
        return set()

    @abstractmethod
    def metrics(self) -> dict:
        """Counters since the last call: rollout/tokens, rollout/seconds, rollout/tokens_per_s, ..."""

    def close(self) -> None:
        """Release the engine (kept for the whole run; see the vLLM engine's shutdown note)."""


def build_engine(
    rollout_cfg: RolloutConfig, hf_dir: str, groups: ParallelGroups, eos_token_id: int, pad_token_id: int
) -> RolloutEngine:
    """The configured engine on this rank. vLLM construction is collective: every rank calls this.

    `eos_token_id` ends a response (and is kept in it); a negative value means no token does (benchmarks).
    """
    check_rollout(rollout_cfg, groups.dims.world_size)  # (preflight ran it on the run's ranks already)
    if rollout_cfg.engine == "hf":
        from rlstack.rollout.zero_copy import AliasingHFEngine

        return AliasingHFEngine(
            hf_dir, rollout_cfg, groups.device, eos_token_id, pad_token_id, seed=rollout_seed(rollout_cfg, groups)
        )
    from rlstack.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(hf_dir, rollout_cfg, groups, eos_token_id, pad_token_id, seed=rollout_seed(rollout_cfg, groups))


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
    if r.top_k == 0 or r.top_k < -1:  # SamplingParams.validate would stop the first rollout
        raise UserError(f"rollout.top_k={r.top_k}: use -1 (off) or a positive count")


def rollout_seed(rollout_cfg: RolloutConfig, groups: ParallelGroups) -> int:
    """seed + rollout replica index (global rank // rollout TP).

    The trainer splits rollout work over all ranks by replica, so seeding by replica (not by the
    training DP rank) makes the samples independent of the training TP/PP/DP layout; the ranks of
    one vLLM TP group form one replica and sample alike.
    """
    return rollout_cfg.seed + groups.rank // rollout_cfg.tp
