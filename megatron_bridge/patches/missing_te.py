"""Megatron-core without Transformer Engine (any machine, GPU or not): two names it reads undefined.

Registered in `megatron_bridge.patches.registry` (kind "missing TE", applies without TE).
"""

from __future__ import annotations

import functools


# (h) Without Transformer Engine, transformer/moe/moe_utils.py:34 fails to import `te_general_gemm`
#     (inside `try: ... except ImportError: HAVE_TE = False`), and RouterGatingLinearFunction.forward /
#     backward (:1192, :1225, every MoE router call via `router_gating_linear`) read the undefined name:
#     NameError. Defining it as None selects the torch.mm path those functions already have.
def _patch_moe_router_without_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# (m) tensor_parallel/random.py `CheckpointWithoutOutput.__init__(self, fp8=False)` sets
#     `self.fp8 = fp8 is not None`, which is True for the default False, so every output-discarding
#     checkpoint (selective recompute "layernorm" at transformer/transformer_layer.py:577,672,
#     "moe_act" at moe/experts.py:739, "mla_up_proj") takes its FP8 path and reads Transformer
#     Engine's `FP8GlobalStateManager`, which is undefined without TE: NameError at the first
#     forward. Without TE there is no FP8, so the flag is set to False, which is what the caller
#     asked for.
def _patch_output_discarding_checkpoint_without_te() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    if getattr(tp_random, "HAVE_TE", True):
        return
    cls = tp_random.CheckpointWithoutOutput
    if getattr(cls.__init__, "_rlstack_no_fp8", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def init(self, fp8=False):
        original(self, fp8)
        self.fp8 = False

    init._rlstack_no_fp8 = True
    cls.__init__ = init
