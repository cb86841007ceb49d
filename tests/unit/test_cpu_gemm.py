"""rlstack's AVX2 matmul for the hf engine (rlstack/rollout/cpu_gemm.py, rollout.cpu_matmul) against torch."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from rlstack.errors import UserError
from rlstack.rollout import cpu_gemm, hf_engine

needs_kernel = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or cpu_gemm.library() is None,
    reason="no AVX2 CPU or no C compiler here: rlstack's AVX2 matmul cannot run",
)


def test_pack_layout_is_16_column_blocks_zero_padded():
    if cpu_gemm.library() is None:
        pytest.skip("no C compiler: the kernel library (and its packer) cannot be built")
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)  # N=20: one full block, one of 4 columns
    p = cpu_gemm.pack(w)
    assert p.shape == (2, 3, 16)
    for n in range(20):  # column n of block n // 16 is row n of the weight
        assert torch.equal(p[n // 16, :, n % 16], w[n])
    assert torch.count_nonzero(p[1, :, 4:]) == 0  # past N: zeros
    strided = torch.randn(3, 40)[:, ::2]  # a weight view with row stride 40, column stride 2
    assert torch.equal(cpu_gemm.pack(strided), cpu_gemm.pack(strided.contiguous()))
    # 8 x 8 register transposes over k, a scalar tail (K = 41), rows past N = 37, row stride 50 > K
    w = torch.randn(37, 50)[:, 3:44]
    expected = torch.zeros(48, 41)
    expected[:37] = w
    assert torch.equal(cpu_gemm.pack(w), expected.view(3, 16, 41).transpose(1, 2))


needs_avx512 = pytest.mark.skipif(
    not cpu_gemm.has_avx512() or cpu_gemm.library() is None, reason="no AVX-512 CPU or no C compiler here"
)


@needs_kernel
@pytest.mark.parametrize("avx512", [False, pytest.param(True, marks=needs_avx512)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(16, 8), (50, 33), (192, 576), (7, 1)])
def test_linear_equals_torch(rows, n, k, avx512):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    p = cpu_gemm.pack(w)
    exact = x.double() @ w.double().T  # fp32 sums of k products round at ~k**0.5 ulps of their size
    tol = dict(rtol=1e-5, atol=2e-6 * k**0.5 * float(exact.abs().max()))
    got = cpu_gemm.linear(x, p, b, n, avx512=avx512).double()
    torch.testing.assert_close(got, exact + b.double(), **tol)
    torch.testing.assert_close(cpu_gemm.linear(x, p, None, n, avx512=avx512).double(), exact, **tol)


@needs_kernel
@needs_avx512
def test_avx512_kernel_sums_as_the_avx2_one():
    """Each output sums its k products in the same order on both kernels: the same bits, whatever the
    row group (1-16 rows on a weight load on AVX-512, 1-6 on AVX2) and whether AVX-512 takes two blocks
    a pass (9-14 rows): 4 blocks (two pairs, the last block partial), 3 (a pair and a single one), and 3
    split over 2 threads (a pair never spans two threads' blocks)."""
    gen = torch.Generator().manual_seed(7)
    for n, threads in ((3 * 16 + 5, 1), (40, 1), (40, 2)):
        w, b = torch.randn(n, 97, generator=gen), torch.randn(n, generator=gen)
        p = cpu_gemm.pack(w)
        for rows in [*range(1, 18), 33, 50]:
            x = torch.randn(rows, 97, generator=gen)
            got = cpu_gemm.linear(x, p, b, n, threads=threads, avx512=True)
            assert torch.equal(got, cpu_gemm.linear(x, p, b, n, avx512=False)), (n, threads, rows)


@needs_kernel
def test_linear_leading_dims_strided_input_and_threads():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(100, 24, generator=gen)
    p = cpu_gemm.pack(w)
    x = torch.randn(2, 5, 48, generator=gen)[..., ::2]  # [2, 5, 24], not contiguous
    expected = torch.nn.functional.linear(x, w)
    one = cpu_gemm.linear(x, p, None, 100, threads=1)
    for t in (1, 2, 3, 64):  # 100 columns = 7 blocks: split over an OpenMP team of up to 7 threads
        got = cpu_gemm.linear(x, p, None, 100, threads=t)
        assert got.shape == (2, 5, 100)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, one), t  # each column block summed by one thread: the same bits
    assert cpu_gemm.linear(torch.empty(0, 24), p, None, 100).shape == (0, 100)


def test_use_kernel_modes(monkeypatch):
    assert not cpu_gemm.use_kernel("onednn", torch.float32)
    assert not cpu_gemm.use_kernel("auto", torch.bfloat16)  # bf16 engines keep oneDNN's bf16 kernels
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu_gemm, "cpu_vendor_family", lambda: ("GenuineIntel", 6))
    assert not cpu_gemm.use_kernel("auto", torch.float32)  # oneDNN's AVX-512 kernels are kept
    monkeypatch.setattr(cpu_gemm, "cpu_vendor_family", lambda: ("AuthenticAMD", 26))
    assert not cpu_gemm.use_kernel("auto", torch.float32)  # Zen 5: full-width AVX-512, not measured
    monkeypatch.setattr(cpu_gemm, "cpu_vendor_family", lambda: ("AuthenticAMD", 25))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert cpu_gemm.use_kernel("auto", torch.float32) == (cpu_gemm.library() is not None)  # Zen 4
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # several threads a process: torch's OpenMP pool
    assert cpu_gemm.use_kernel("auto", torch.float32) == (cpu_gemm.library() is not None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(UserError, match=r"rollout.cpu_matmul=avx2: this CPU has no AVX2"):
        cpu_gemm.use_kernel("avx2", torch.float32)


def test_cpu_vendor_family_reads_the_first_cpu(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\n"
        "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n"
    )
    assert cpu_gemm.cpu_vendor_family(str(info)) == ("AuthenticAMD", 25)
    assert cpu_gemm.cpu_vendor_family(str(tmp_path / "missing")) == ("", 0)


def test_no_compiler_falls_back_to_onednn_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_gemm, "_lib", None)
    monkeypatch.setattr(cpu_gemm, "_tried", False)
    monkeypatch.setattr(cpu_gemm, "_warned", False)
    monkeypatch.setenv("RLSTACK_CACHE_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with caplog.at_level(logging.WARNING, logger=cpu_gemm.__name__):
        assert not cpu_gemm.use_kernel("auto", torch.float32)
        assert not cpu_gemm.use_kernel("auto", torch.float32)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rollout.cpu_matmul" in warnings[0].getMessage()
    with pytest.raises(UserError, match="no C compiler built the kernel"):
        cpu_gemm.use_kernel("avx2", torch.float32)


def test_unknown_mode_is_one_line_naming_the_key():
    from rlstack.config import RolloutConfig
    from rlstack.rollout.base import check_rollout

    with pytest.raises(UserError, match=r"rollout.cpu_matmul='fast' is unknown: use auto, onednn or avx2"):
        check_rollout(RolloutConfig(cpu_matmul="fast"), 1)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=101, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg).eval()


@needs_kernel
def test_packed_linears_on_either_kernel_give_the_model_logits():
    model = _model()
    ids = torch.randint(3, 101, (3, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for kernel in ("avx2", "onednn"):
            with hf_engine._packed_linears(model, rows=3, kernel=kernel) as packed:
                assert packed.kernel == kernel  # what the engine's decode step follows (fast attention)
                shapes = {tuple(p.shape) for p in packed.values()}
                if kernel == "avx2":  # our [blocks, K, 16] layout, not oneDNN's
                    assert (7, 48, 16) in shapes  # the 101-token LM head: 7 blocks of 16
                got = model(input_ids=ids).logits
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))


@needs_kernel
@pytest.mark.parametrize(
    "b,heads,groups,n,d", [(3, 6, 2, 13, 32), (2, 4, 4, 8, 64), (1, 9, 3, 130, 64), (2, 2, 1, 5, 128)]
)
def test_decode_attention_equals_sdpa(b, heads, groups, n, d):
    gen = torch.Generator().manual_seed(n * d + heads)
    cap = n + 7  # the reserved cache: views of the first n of `cap` slots
    kc, vc = torch.randn(b, groups, cap, d, generator=gen), torch.randn(b, groups, cap, d, generator=gen)
    keys, values = kc[:, :, :n], vc[:, :, :n]
    q = torch.randn(b, heads, d, generator=gen) * 2
    mask = torch.zeros(b, n)
    mask[0, : n // 2] = float("-inf")  # left padding of a short row
    assert cpu_gemm.attention_applies(q, keys, values)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.view(b, heads, 1, d), keys, values, attn_mask=mask.view(b, 1, 1, n), scale=d**-0.5, enable_gqa=True
    ).view(b, heads, d)
    got = cpu_gemm.decode_attention(q, keys, values, mask, d**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # (row, head) pairs shared by two threads: each pair's sums as on one
        assert torch.equal(cpu_gemm.decode_attention(q, keys, values, mask, d**-0.5), got)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_kernel_threads_are_torchs_openmp_pool():
    """The library's OpenMP team comes from the libgomp torch loaded (one soname, one runtime in the
    process): a second runtime's threads would spin beside torch's on the same cores."""
    cpu_gemm.library()
    runtime = cpu_gemm.openmp_runtime()
    assert os.path.realpath(runtime).startswith(os.path.dirname(os.path.realpath(torch.__file__))), runtime


def test_openmp_runtime_is_the_one_mapped(tmp_path):
    lib = tmp_path / "torch.libs" / "libgomp-a34b3233.so.1.0.0"  # a wheel's renamed libgomp
    lib.parent.mkdir()
    lib.write_bytes(b"")
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        f"7f02-7f03 r-xp 00000000 08:01 2 {lib}\n"
        "7f04-7f05 rw-p 00000000 00:00 0 [heap]\n"
    )
    assert cpu_gemm.openmp_runtime(str(maps)) == str(lib)
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert cpu_gemm.openmp_runtime(str(maps)) == ""
    assert cpu_gemm.openmp_runtime(str(tmp_path / "absent")) == ""


def test_decode_attention_applies_only_to_its_layouts():
    q, kv = torch.randn(1, 2, 8), torch.randn(1, 1, 4, 8)
    assert cpu_gemm.attention_applies(q, kv, kv)
    assert not cpu_gemm.attention_applies(q[..., :6], kv[..., :6], kv[..., :6])  # head size not a multiple of 8
    assert not cpu_gemm.attention_applies(q.bfloat16(), kv.bfloat16(), kv.bfloat16())
    assert not cpu_gemm.attention_applies(q, kv, kv.transpose(2, 3).contiguous().transpose(2, 3))  # other strides
