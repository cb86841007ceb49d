"""Warnings megatron-core 0.16.1 raises from its own code on every run, that no config can change
(kind "warning filter"; docs/megatron_core.md "Warnings silenced by rlstack").

- The distributed optimizer's `hasattr(param, "main_grad")`-style probe of a non-leaf tensor's
  `.grad` (optimizer/optimizer.py `_zero_grad_group_helper`): torch's UserWarning "The .grad
  attribute of a Tensor that is not a leaf Tensor is being accessed".
- torch 2.13's FutureWarning that `torch.distributed.reduce_scatter_tensor` /
  `all_gather_into_tensor` are deprecated: megatron's param and grad buffers bind them by name
  (distributed/param_and_grad_buffer.py `dist_reduce_scatter_func`, `dist_all_gather_func`).

Process-wide: Python's warning filters belong to the process. Each filter matches its one message
only, so every other warning still shows.
"""

from __future__ import annotations

import warnings

NON_LEAF_GRAD = r"The \.grad attribute of a Tensor that is not a leaf"
DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"


def quiet_dependency_warnings() -> None:
    warnings.filterwarnings("ignore", message=NON_LEAF_GRAD, category=UserWarning)
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES)
