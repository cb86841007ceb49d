"""Zero-copy weights for the hf engine: its parameters become views of the actor's Megatron tensors.

`megatron_bridge.reshard.WeightSync(zero_copy=True)` derives, from the reshard plan, a view of the
rank's own Megatron shard for every HF tensor whose rows sit there in a regular pattern
(`reshard.alias_view`), and hands them to `AliasingHFEngine.alias_weights`:
- plain views (the HF tensor itself: embeddings / tied LM head, norms, o_proj = linear_proj,
  down_proj = linear_fc2, gate_proj / up_proj = the two halves of linear_fc1) replace the HF
  parameter; every module that shared it (a tied lm_head) gets the view too;
- grouped views ([groups, rows, H]: q, k or v rows inside Megatron's fused QKV, which is laid out per
  query group [groups, (q_per_group + 2) * head_dim, H], megatron_bridge/layouts.py) replace the
  nn.Linear with `GroupedLinear`, one batched matmul over the groups, whose output row order
  (group-major) is HF's q / k / v row order.
The HF model's own copies are dropped (freed), so the engine holds no second copy of those weights,
and the sync skips them: the optimizer's in-place updates are what the engine reads next rollout.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from rlstack.rollout.hf_engine import HFEngine


class GroupedLinear(nn.Module):
    """y = x W^T + b with W given as a grouped view [G, R, H] (and b as [G, R]); output [..., G*R].

    A 2-D weight / 1-D bias (not aliased) works too, so a module keeps working whichever of its
    tensors are views.
    """

    grouped_linear = True  # the hf engine packs it for rollout as it packs nn.Linear (`_packed_linears`)

    def __init__(self, weight: nn.Parameter, bias):
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, hidden = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, hidden)  # [N, H]
        w, b = self.weight, self.bias
        if w.dim() == 2:
            y = nn.functional.linear(flat, w)  # [N, G*R]
        else:
            # One GEMM per group: each w[g] is a contiguous [R, H] block (no weight copy); a batched
            # matmul over the strided groups was 2x slower for prefill-sized N (broadcast x copied).
            per_bias = b is not None and b.dim() == 2
            parts = [nn.functional.linear(flat, w[g], b[g] if per_bias else None) for g in range(w.shape[0])]
            y = torch.cat(parts, dim=-1)  # [N, G*R], group-major = HF row order
            b = None if per_bias else b
        if b is not None:
            y = y + (b if b.dim() == 1 else b.reshape(-1))
        return y.view(*lead, y.shape[-1])


class AliasingHFEngine(HFEngine):
    """The hf engine that can take views of the actor's tensors instead of its own copies."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hf_shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}

    def alias_weights(self, views: Mapping[str, torch.Tensor]) -> set[str]:
        """Make each named parameter the given view (plain or grouped); returns the names aliased."""
        done = set()
        for name, view in views.items():
            shape = self._hf_shapes.get(name)
            if shape is None:
                continue
            path, attr = name.rsplit(".", 1)
            module = self.model.get_submodule(path)
            if tuple(view.shape) == shape:
                self._replace(module, attr, view)
            elif _is_grouping(tuple(view.shape), shape) and isinstance(module, (nn.Linear, GroupedLinear)):
                if isinstance(module, nn.Linear):
                    module = self._to_grouped(path, module)
                self._replace(module, attr, view)
            else:
                continue
            done.add(name)
        self.weights_updated()
        return done

    def _replace(self, module: nn.Module, attr: str, view: torch.Tensor) -> None:
        """Set `module.attr` to the view, and every other module attribute that held the same
        parameter (tied embeddings) as well."""
        old = getattr(module, attr)
        new = nn.Parameter(view, requires_grad=False)  # shares the view's storage and strides
        for _, m in self.model.named_modules(remove_duplicate=False):
            for a, p in list(m._parameters.items()):
                if p is old:
                    setattr(m, a, new)

    def _to_grouped(self, path: str, linear: nn.Linear) -> GroupedLinear:
        parent_path, child = path.rsplit(".", 1)
        grouped = GroupedLinear(linear.weight, linear.bias)
        setattr(self.model.get_submodule(parent_path), child, grouped)
        return grouped


def _is_grouping(view_shape: tuple[int, ...], hf_shape: tuple[int, ...]) -> bool:
    """[G, R, *rest] regroups HF [G*R, *rest]."""
    return (
        len(view_shape) == len(hf_shape) + 1
        and view_shape[0] * view_shape[1] == hf_shape[0]
        and view_shape[2:] == hf_shape[1:]
    )
