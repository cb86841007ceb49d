"""megatron-core 0.16.1 distributed-optimizer workarounds for torch Adam (no TE/Apex).

Without Transformer Engine or Apex, megatron's DistributedOptimizer wraps `torch.optim.AdamW`,
whose per-parameter `step` state its checkpoint code does not expect. Each function cites its call
site; all are exercised by tests/distributed/test_checkpoint.py (resume into a fresh optimizer,
then a bit-identical next step). They apply on GPUs without TE/Apex too. `patch_torch_adam_step_on_load`
is registered in `megatron_bridge.patches.registry` (kind "optimizer state") and applied at start-up;
the other two are steps a checkpointer calls around a load (rlstack/checkpoint.py).
`allocate_adam_state` is a step a trained role takes when its optimizer is built on CPU
(rlstack/workers/megatron_role.py; tests/unit/test_adam_state.py).
"""

from __future__ import annotations


def allocate_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam state, which load then overwrites.

    megatron-core 0.16.1 `DistributedOptimizer.state_dict()` reads Adam's `step` from the torch
    optimizer's per-parameter state when TE/Apex are absent (distrib_optimizer.py, `assert
    len(steps) == 1`): a torch Adam that never stepped has none. One zero-gradient step allocates it.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def allocate_adam_state(optimizer) -> int:
    """Give torch Adam(W) its per-parameter state now, as its first `step()` would: zeros, step 0.

    torch allocates `exp_avg` / `exp_avg_sq` lazily inside the first `step()`, after that step's
    activations were freed, so the second step's activations need that much memory anew (SmolLM2, dp 2:
    538 MB a rank). On the VMs of docs/benchmarks.md fresh memory costs ~30 us a page (the host backs it
    anew): ~3 s of the second step. Allocated before the first step, the first step's peak already holds
    it. The same tensors torch's `Adam._init_group` makes (dtype and device of `step` included), only
    for parameters without state, so the steps compute the same numbers. Returns the bytes allocated.
    """
    import torch
    from torch.optim.optimizer import _get_scalar_dtype

    allocated = 0
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if len(state) or p.numel() == 0:
                    continue
                fused_or_capturable = group["capturable"] or group["fused"]
                state["step"] = (
                    torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device)
                    if fused_or_capturable
                    else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
                )
                keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
                for key in keys:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    allocated += p.numel() * p.element_size()
    return allocated


def unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam `step` tensor again.

    megatron-core 0.16.1 `DistributedOptimizer.load_state_dict` (torch Adam, no TE/Apex) puts one
    `step` tensor object into every parameter's state; torch Adam increments each in place, so
    the shared counter would advance once per parameter per step and bias-correct wrongly.
    """
    seen = set()
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for state in opt.optimizer.state.values():
            step = state.get("step")
            if step is None or not hasattr(step, "clone"):
                continue
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(state["step"]))


def patch_torch_adam_step_on_load() -> None:
    """Let the distributed optimizer load `fully_reshardable` state into torch Adam (no TE/Apex).

    megatron-core 0.16.1 `DistributedOptimizer._set_main_param_and_optimizer_states` copies every key
    of a parameter's Adam state, which for torch Adam includes `step`; `load_parameter_state_from_
    fully_reshardable` supplies no `step` (load_state_dict already set it from param_groups), so the
    load dies with KeyError 'step'. Copy the keys supplied instead; `step` stays as already loaded.
    """
    from megatron.core.optimizer import distrib_optimizer as dopt

    cls = dopt.DistributedOptimizer
    if dopt.HAVE_APEX_OR_TE or getattr(cls, "_rlstack_step_patch", False):
        return
    original = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        assert set(tensors) == set(dst) - {"step"}, (sorted(tensors), sorted(dst))
        for key, value in tensors.items():
            dst[key].copy_(value)

    cls._set_main_param_and_optimizer_states = set_states
    cls._rlstack_step_patch = True


# (o) optimizer/clip_grads.py `multi_tensor_scale_impl` (bound at :43 to megatron.core.utils'
#     `local_multi_tensor_scale` without TE / Apex) and optimizer/optimizer.py's (:37): the gradient
#     clipping (`clip_grad_by_total_norm_fp32`, :176: every gradient times the clip coefficient, in
#     place) and `_multi_tensor_copy_this_to_that` (:90: bf16 main params into the model's, scale 1).
#     The fallback writes `dst.copy_(src * scale)`: a temporary the size of each tensor. On CPU a large
#     one is fresh memory at most steps (SmolLM2's embedding shard, 113 MB: ~28k page faults, 0.4-0.6 s
#     of a step on the VMs of docs/benchmarks.md, on the rank holding it while the others wait for it at
#     the param all-gather). The same products, written straight into dst (torch.mul's `out`, which
#     computes in the inputs' dtype and casts as the copy did; `copy_` at scale 1, where x * 1 == x).
def inplace_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale) -> None:
    import torch

    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        if scale == 1.0:
            dst.copy_(src)
        else:
            torch.mul(src, scale, out=dst)


def patch_inplace_multi_tensor_scale() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = inplace_multi_tensor_scale
