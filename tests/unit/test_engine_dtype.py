"""`rollout.dtype`: which dtype the hf engine runs in (rlstack.rollout.base.hf_engine_dtype)."""

import pytest
import torch

from rlstack.rollout import base


@pytest.mark.parametrize(
    "flags,native",
    [
        ("fpu avx2 fma avx512f avx512_bf16 avx512_vnni", True),  # AMD EPYC (Zen 4/5)
        ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile", True),  # Intel with AMX
        ("avx2 fma avx512f avx512bw avx512_vnni", False),  # AVX-512 without bf16: oneDNN emulates it
        ("avx2 fma", False),  # AVX2 only
        ("", False),
    ],
)
def test_native_bf16_from_cpu_flags(flags, native):
    assert base.cpu_has_native_bf16(flags) is native


def test_engine_dtype(monkeypatch):
    monkeypatch.setattr(base, "cpu_has_native_bf16", lambda flags=None: True)
    assert base.hf_engine_dtype("auto", "bfloat16", "cpu") == torch.bfloat16  # follows a bf16 actor
    assert base.hf_engine_dtype("auto", "float32", "cpu") == torch.float32
    assert base.hf_engine_dtype("float32", "bfloat16", "cpu") == torch.float32  # pinned
    monkeypatch.setattr(base, "cpu_has_native_bf16", lambda flags=None: False)
    assert base.hf_engine_dtype("auto", "bfloat16", "cpu") == torch.float32  # emulated bf16: fp32 is faster
    assert base.hf_engine_dtype("bfloat16", "float32", "cpu") == torch.bfloat16  # asked for: honoured
    assert base.hf_engine_dtype("auto", "float32", "cuda") == torch.bfloat16  # GPUs as before


def test_config_refuses_an_unknown_engine_dtype():
    from rlstack.config import load_config
    from rlstack.errors import UserError

    with pytest.raises(UserError, match="rollout.dtype"):
        load_config("yaml_configs/tiny_cpu.yaml", ["rollout.dtype=float16"])
