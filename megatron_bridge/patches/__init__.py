"""Every change megatron_bridge makes to megatron-core, applied by one explicit call at start-up.

    from megatron_bridge import patches
    patches.apply()  # once per process, before init_distributed (which refuses to start otherwise)

`apply` checks the installed megatron-core against the versions the patches were written for
(version.py: one-line UnsupportedMegatronError, or a warning with `allow_untested_megatron=True`),
then applies the start-up patches of the registry (registry.py) whose condition holds on this
machine: CUDA shims, faster CPU kernels and gloo collectives without CUDA; the missing-TE fixes
without Transformer Engine; the optimizer-state fix without TE or Apex; the "mlp_act" recompute
hook and the warning filters always. One module per concern; importing any of them (or this
package) changes nothing. docs/megatron_core.md has the facts and timings behind each.
"""

from __future__ import annotations

from typing import Optional

_APPLIED: Optional[tuple[str, ...]] = None  # names of the patches applied in this process


def apply(allow_untested_megatron: bool = False, setting: str = "allow_untested_megatron=True", env=None):
    """Check megatron-core's version and apply the start-up patches whose condition holds, once per
    process; returns their names. `setting`: how the caller's user allows an untested version (for
    the message). `env`: a registry.Environment (default: detected)."""
    global _APPLIED
    if _APPLIED is not None:
        return _APPLIED
    from megatron_bridge.patches.registry import Environment, at_start_up
    from megatron_bridge.patches.version import check_megatron_version

    check_megatron_version(allow_untested_megatron, setting)
    chosen = at_start_up(env if env is not None else Environment.detect())
    for patch in chosen:
        patch.apply()
    _APPLIED = tuple(p.name for p in chosen)
    return _APPLIED


def applied() -> Optional[tuple[str, ...]]:
    """Names of the patches `apply` applied in this process; None before it ran."""
    return _APPLIED


def require_applied() -> None:
    """Raise unless `apply` ran in this process (init_distributed calls this)."""
    if _APPLIED is None:
        raise RuntimeError(
            "megatron-core patches are not applied: call megatron_bridge.patches.apply() once at start-up, "
            "before init_distributed (rlstack.loop.run_training does)"
        )
