"""rlstack's rollout engines implement the bridge's weight-sync contract (megatron_bridge.sync_target),
and the bridge asks an engine only what that contract declares (never what kind it is)."""

from __future__ import annotations

import ast
import inspect
import os

import pytest

from megatron_bridge import reshard
from megatron_bridge.sync_target import TARGET_LAYOUTS, SyncTarget

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What the protocol declares (typing.get_protocol_members is Python 3.13+)
MEMBERS = {n for n in vars(SyncTarget) if not n.startswith("_")} | set(SyncTarget.__annotations__)


def _engines():
    from rlstack.rollout.hf_engine import HFEngine
    from rlstack.rollout.vllm_engine import VLLMEngine
    from rlstack.rollout.zero_copy import AliasingHFEngine

    return [HFEngine, AliasingHFEngine, VLLMEngine]


def test_protocol_declares_what_the_sync_needs():
    assert MEMBERS == {
        "tp_size",
        "tp_rank",
        "target_layout",
        "param_targets",
        "load_weights",
        "expected_shapes",
        "weights_updated",
        "alias_weights",
    }


@pytest.mark.parametrize("cls", _engines(), ids=lambda c: c.__name__)
def test_engines_implement_the_sync_target(cls):
    missing = sorted(m for m in MEMBERS if not hasattr(cls, m))
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert cls.target_layout in TARGET_LAYOUTS
    for name in ("param_targets", "load_weights", "expected_shapes", "weights_updated", "alias_weights"):
        declared = inspect.signature(getattr(SyncTarget, name)).parameters
        got = inspect.signature(getattr(cls, name)).parameters
        assert list(got) == list(declared), (cls.__name__, name, list(got))


def test_the_bridge_reads_only_declared_engine_attributes():
    """Every `engine.<attr>` / `self.engine.<attr>` in megatron_bridge/reshard.py is a SyncTarget member."""
    tree = ast.parse(inspect.getsource(reshard))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "engine") or (
                isinstance(base, ast.Attribute) and base.attr == "engine"
            ):
                used.add(node.attr)
    assert used and used <= MEMBERS, sorted(used - MEMBERS)
