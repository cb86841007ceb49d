"""The rollout engine interface: generate from token ids, take weights, report metrics.

Engines (`hf_engine.HFEngine`, `vllm_engine.VLLMEngine`) live one per rank for the whole run; the
weight-sync bridge (`megatron_bridge.reshard.WeightSync`) writes the actor's weights into them
before every rollout, either in place through `param_targets()` or through `load_weights()`.

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
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # keep `import rlstack.rollout.interface` free of torch
    import torch


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


def check_row_caps(caps: Optional[list[int]], num_prompts: int, params: SamplingParams) -> list[int]:
    """Per-prompt max_new_tokens (an engine's optional `max_new_tokens` list), or params' for every prompt."""
    if caps is None:
        return [params.max_new_tokens] * num_prompts
    if len(caps) != num_prompts or any(int(c) < 1 for c in caps):
        raise ValueError(f"max_new_tokens needs one cap >= 1 per prompt ({num_prompts}), got {caps}")
    return [int(c) for c in caps]


@dataclass
class Generation:
    prompt_index: int  # index into the `prompts` list given to `generate`
    prompt_ids: list[int]
    response_ids: list[int]  # ends at and includes eos when finish_reason == "stop"
    logprobs: list[float]  # one per response token, of softmax(logits / temperature) (module docstring)
    finish_reason: str  # "stop" (eos) | "length" (max_new_tokens)
    # agent loops (rlstack.agent): 1 where the policy generated response token i, 0 where the loop
    # inserted it (only mask-1 tokens train); None: every response token is the policy's
    response_mask: Optional[list[int]] = None
    agent: Optional[Any] = None  # the rlstack.agent.driver.AgentSample behind it (reward, extra, turns)
    # split placement: the trainer step whose weights produced each response token (None: not tracked)
    versions: Optional[list[int]] = None


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
        """n samples per prompt, ordered prompt-major: [p0s0, p0s1, ..., p1s0, ...].

        The hf and vLLM engines also take `max_new_tokens=[cap per prompt]` (agent turns of one
        batched call, each capped by what is left of its trajectory's budget); `params.max_new_tokens`
        is then ignored. Engines without it are only called with one cap (rlstack.agent.driver)."""

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
