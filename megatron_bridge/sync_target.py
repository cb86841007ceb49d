"""What the weight sync writes into: the contract a rollout engine implements (`SyncTarget`).

The bridge never imports the application that owns the engines (rlstack's `HFEngine`,
`VLLMEngine` implement this protocol); it asks an engine only what is declared here, never what
kind of engine it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Optional, Protocol

if TYPE_CHECKING:
    import torch

# Names and shapes an engine's in-place targets are given in (megatron_bridge.reshard.plan_reshard):
# "hf" = the HF checkpoint's; "vllm" = vLLM's parameters (merged qkv_proj / gate_up_proj, vocabulary
# padded to 64 and split over rollout TP). A loader (`load_weights`) always takes HF names.
TARGET_LAYOUTS = ("hf", "vllm")


class SyncTarget(Protocol):
    """A rollout engine as the weight sync sees it.

    tp_size / tp_rank: its rollout tensor-parallel position (which shard of each tensor it holds).
    target_layout: the names and shapes of `param_targets()` (one of TARGET_LAYOUTS).
    """

    tp_size: int
    tp_rank: int
    target_layout: str

    def param_targets(self) -> Optional[dict[str, torch.Tensor]]:
        """Engine tensors the sync may overwrite in place (named in `target_layout`), or None: use the loader."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors through the engine's own loader (consumed lazily, in order)."""

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor `load_weights` expects (to validate a sync up front)."""

    def weights_updated(self) -> None:
        """Called after every in-place write: drop caches derived from the old weights."""

    def alias_weights(self, views: Mapping[str, torch.Tensor]) -> set[str]:
        """Make the named engine tensors these views of the actor's parameters (zero copy); returns
        the names it aliased (the sync skips them). An engine that cannot alias returns an empty set."""
