"""Weight sync of a LoRA actor (docs/lora.md): the frozen base once, then the adapters only.

The base weights never change under LoRA, so `LoraWeightSync` runs the full `WeightSync` once (with
`rollout.zero_copy` the hf engine then aliases the actor's frozen base: 0 bytes) and afterwards only
when that aliasing broke (offload rebinds the actor's parameters). Each sync then gathers the
adapters in TP1 megatron layout (`megatron_bridge.lora.adapter_state`, collective over TP and PP),
names them for HF (`lora_export.hf_adapters`) and hands them to the engine's `set_adapters`
(rlstack/rollout/hf_engine.py, vllm_engine.py). `sync/bytes` counts the bytes the engine receives.

`rollout.lora_sync` picks how the adapters reach the engine (`lora_sync_mode`):
- hf, `adapters`: each adapted linear adds `scale * B (A x)` to its output beside the aliased base;
  `sync/bytes` is the adapter bytes. `merged`: the engine keeps `W + scale B A` for the adapted
  linears only, in weights of its own (the aliased base is not written); `sync/bytes` is the merged
  weights' bytes. `auto` = `HF_DEFAULT` = merged, the faster one in benchmarks/lora_rollout.py
  (1.28x the rollout tokens per CPU second at SmolLM2-135M shapes, docs/lora.md).
- vllm, `adapters` (`auto`): vLLM's own LoRA path: the engine starts with `enable_lora` and each
  sync loads the adapters as a new `LoRARequest` (VLLMEngine.set_adapters); the base is loaded once.
  `merged` (`MergedLoraSync`): the sync's source tensors for the adapted linears are
  `merged_weight(layer)` (W + scale B A of the rank's shard; W untouched), and the whole model moves
  through the engine's loader as without LoRA.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

log = logging.getLogger("rlstack")

LORA_SYNCS = ("auto", "adapters", "merged")
# hf engine's rollout.lora_sync=auto, by benchmarks/lora_rollout.py (docs/lora.md "hf engine: adapters or merged")
HF_DEFAULT = "merged"


def lora_sync_mode(rollout_cfg) -> str:
    """`rollout.lora_sync` resolved for the engine: `adapters` or `merged`."""
    mode = getattr(rollout_cfg, "lora_sync", "auto")
    if mode not in LORA_SYNCS:
        raise ValueError(f"rollout.lora_sync={mode!r} is unknown: use one of {', '.join(LORA_SYNCS)}")
    if mode != "auto":
        return mode
    return HF_DEFAULT if rollout_cfg.engine == "hf" else "adapters"


def vllm_lora_rank(cfg) -> int:
    """The LoRA rank vLLM starts with (0: its LoRA path off): model.lora.rank with vLLM's adapter path."""
    r = cfg.rollout
    if cfg.model.lora.rank <= 0 or r.engine != "vllm" or lora_sync_mode(r) != "adapters":
        return 0
    return cfg.model.lora.rank


class LoraWeightSync:
    """`sync()` -> SyncStats, as `megatron_bridge.reshard.WeightSync` (which it wraps for the base)."""

    def __init__(self, base_sync, role, groups, engine, merged: bool = False):
        from megatron_bridge.mappings import layer_offset

        if not hasattr(engine, "set_adapters"):
            raise ValueError(
                f"model.lora with rollout engine {type(engine).__name__}: it takes no adapters; use rollout.engine=hf"
            )
        self.base, self.role, self.groups, self.engine = base_sync, role, groups, engine
        self.offset = layer_offset(role.args, groups.pp_rank, groups.dims.pp)
        self.scale = role.lora.scale
        self.merged = merged  # hf engine, rollout.lora_sync=merged: W + scale B A for the adapted linears only
        self._base_stats = None
        self.last = None
        if groups.rank == 0:
            base = "aliased (zero-copy)" if getattr(base_sync, "aliased", None) else "once-copied"
            if merged:
                how = f"keeps merged weights W + scale * B A for the adapted linears only (its {base} base unwritten)"
            elif type(engine).__name__ == "VLLMEngine":
                how = f"loads them through vLLM's LoRA path (a LoRARequest per version; its {base} base)"
                if not getattr(engine, "on_gpu", True):  # measured in docs/lora.md (benchmarks/lora_rollout.py)
                    how += "; on CPU rollout.lora_sync=merged generated 1.76x faster (SmolLM2-135M shapes)"
            else:
                how = f"applies the adapters itself (scale * B A x beside its {base} base)"
            moved = "the adapted linears' merged weights" if merged else "the adapters only"
            log.info("LoRA weight sync (rollout.lora_sync): the engine %s; each sync moves %s", how, moved)

    def _base_current(self) -> bool:
        """The frozen base is in the engine: synced once, and (zero copy) the views still hold."""
        if self._base_stats is None:
            return False
        zero_copy = getattr(self.base, "_zero_copy", False)
        return not zero_copy or self.base._aliases_hold()

    def sync(self):
        from megatron_bridge.lora import adapter_state
        from megatron_bridge.lora_export import hf_adapters
        from megatron_bridge.reshard import SyncStats

        start = time.perf_counter()
        base: Optional[SyncStats] = None
        if not self._base_current():
            base = self._base_stats = self.base.sync()
        g = self.groups
        state = adapter_state(self.role.module, g.tp, g.pp, self.offset)
        modules = hf_adapters(state, self.role.args)
        if self.merged:
            written = self.engine.set_adapters(modules, self.scale, merged=True)
        else:
            written = self.engine.set_adapters(modules, self.scale)
        stats = SyncStats()
        adapter_bytes = sum(t.numel() * t.element_size() for ab in modules.values() for t in ab)
        stats.bytes = written if isinstance(written, int) else adapter_bytes
        if base is not None:  # the base moved this time (the first sync, or the aliases were renewed)
            stats.bytes += base.bytes
            stats.bytes_received = base.bytes_received
            stats.peak_extra_bytes = base.peak_extra_bytes
        stats.aliased_bytes = self._base_stats.aliased_bytes
        stats.engine_weight_bytes = self._base_stats.engine_weight_bytes
        stats.seconds = time.perf_counter() - start
        self.last = stats
        return stats


class MergedLoraSync:
    """The full weight sync with each adapted linear's source replaced by its merged weight (engines
    that take no adapters: vLLM). Moves every weight each sync, as a full fine-tuning run does."""

    def __init__(self, base_sync, role, groups):
        self.base, self.role = base_sync, role
        self.last = None
        if groups.rank == 0:
            log.info(
                "LoRA weight sync: the engine takes no adapters (%s): each sync loads merged weights "
                "W + scale * B A for the adapted layers, the whole model through its loader",
                type(base_sync.engine).__name__,
            )

    def sync(self):
        import torch

        from megatron_bridge.lora import adapters, merged_weight

        params = self.base.params
        saved = {}
        with torch.no_grad():
            for name, _ in adapters(self.role.module):
                key = name + ".weight"
                saved[key] = params[key]
                params[key] = merged_weight(self.role.module.get_submodule(name))
        try:
            self.last = self.base.sync()
        finally:
            params.update(saved)  # the frozen base stays the source of everything else
        return self.last
