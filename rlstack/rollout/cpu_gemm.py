"""rlstack's AVX2 matmul for the hf engine's linears on CPUs whose widest vector unit is AVX2 (rollout.cpu_matmul).

Why: a decode step multiplies a few rows (SmolLM2's GRPO rollout: ~9 live rows of 16) by every weight,
streaming all of them from memory. On an AVX2-only CPU (AMD EPYC, lscpu flags avx2 fma; one thread)
oneDNN's reordered weights run that at ~7.5 GB/s of weights (SmolLM2's 211 linears at 9 rows: 72 ms),
a third of what one core reads (~24 GB/s) and far from the FMA units' rate. This kernel keeps each
16-column block of a weight contiguous ([N/16][K][16] floats), prefetches 8 KiB ahead in that one
stream, and accumulates up to 6 rows x 16 columns in 12 AVX2 registers (further rows re-read the block
from L2): 46 ms at 9 rows, 28 ms at 4 (oneDNN 52), 67 ms at 16 (90), and at prefill's hundreds of
rows ~80 GFLOP/s (oneDNN ~77). docs/benchmarks.md ("session 24") has the table.

On AVX-512 CPUs oneDNN's own kernels are kept (they reach ~140 GFLOP/s at 16 rows there; this
kernel uses half the vector width). The C source below is compiled once per machine and source
version with the system C compiler (`cc -O3 -mavx2 -mfma`, < 1 s) into the rlstack cache
(`$RLSTACK_CACHE_DIR`, else `$XDG_CACHE_HOME/rlstack` or ~/.cache/rlstack); without a compiler the
engine stays on oneDNN and says so once. Values differ from oneDNN's by summation order (~1e-6
relative in fp32). tests/unit/test_cpu_gemm.py checks it against torch at odd shapes, with bias,
threads and padding.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from typing import Optional

import torch

from rlstack.errors import UserError

log = logging.getLogger(__name__)

BLOCK = 16  # output columns per packed block: two AVX2 registers
MODES = ("auto", "onednn", "avx2")

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <pthread.h>

#define PF 2048 /* floats ahead (8 KiB) in the weight stream */

#define DEF_GROUP(R)                                                                              \
static inline void group_##R(const float *x, int64_t ldx, const float *p, int64_t K, float *acc, \
                             int prefetch) {                                                      \
    __m256 a0[R], a1[R];                                                                          \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                         \
        a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }                               \
    for (int64_t k = 0; k < K; k++) {                                                             \
        if (prefetch) _mm_prefetch((const char *)(p + k * 16 + PF), _MM_HINT_T0);                 \
        __m256 w0 = _mm256_loadu_ps(p + k * 16), w1 = _mm256_loadu_ps(p + k * 16 + 8);            \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                     \
            __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                                     \
            a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]); a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);       \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                         \
        _mm256_storeu_ps(acc + r * 16, a0[r]); _mm256_storeu_ps(acc + r * 16 + 8, a1[r]); }       \
}
DEF_GROUP(1) DEF_GROUP(2) DEF_GROUP(3) DEF_GROUP(4) DEF_GROUP(5) DEF_GROUP(6)

typedef struct { const float *x, *P, *bias; float *y; int64_t M, K, N, b0, b1; } job_t;

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    float acc[6 * 16];
    for (int64_t b = j->b0; b < j->b1; b++) {
        const float *p = j->P + b * j->K * 16;
        int64_t n0 = b * 16, w = j->N - n0 < 16 ? j->N - n0 : 16;
        for (int64_t m = 0; m < j->M; m += 6) {
            int64_t R = j->M - m < 6 ? j->M - m : 6;
            const float *xm = j->x + m * j->K;
            int pf = m == 0; /* the first row group streams the block from memory */
            switch (R) {
                case 1: group_1(xm, j->K, p, j->K, acc, pf); break;
                case 2: group_2(xm, j->K, p, j->K, acc, pf); break;
                case 3: group_3(xm, j->K, p, j->K, acc, pf); break;
                case 4: group_4(xm, j->K, p, j->K, acc, pf); break;
                case 5: group_5(xm, j->K, p, j->K, acc, pf); break;
                default: group_6(xm, j->K, p, j->K, acc, pf); break;
            }
            for (int64_t r = 0; r < R; r++) {
                float *yr = j->y + (m + r) * j->N + n0;
                for (int64_t c = 0; c < w; c++) yr[c] = acc[r * 16 + c] + (j->bias ? j->bias[n0 + c] : 0.0f);
            }
        }
    }
    return 0;
}

/* W [N, K] (row stride ldw) -> P [ceil(N/16)][K][16], zeros past N; 64 columns of 16 rows at a time (4 KiB) */
void rl_pack(const float *W, int64_t N, int64_t K, int64_t ldw, float *P) {
    int64_t blocks = (N + 15) / 16;
    for (int64_t b = 0; b < blocks; b++) {
        float *pb = P + b * K * 16;
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            int64_t k1 = k0 + 64 < K ? k0 + 64 : K;
            for (int c = 0; c < 16; c++) {
                int64_t n = b * 16 + c;
                if (n < N) {
                    const float *w = W + n * ldw;
                    for (int64_t k = k0; k < k1; k++) pb[k * 16 + c] = w[k];
                } else {
                    for (int64_t k = k0; k < k1; k++) pb[k * 16 + c] = 0.0f;
                }
            }
        }
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias[N]); P: W packed [ceil(N/16)][K][16], zero past N; threads >= 1 */
int rl_linear(const float *x, int64_t M, int64_t K, const float *P, const float *bias, int64_t N, float *y,
              int threads) {
    int64_t blocks = (N + 15) / 16;
    if (threads > blocks) threads = (int)blocks;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    job_t jobs[64];
    pthread_t tid[64];
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){x, P, bias, y, M, K, N, blocks * t / threads, blocks * (t + 1) / threads};
    }
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tid[t], 0, run, &jobs[t]) != 0) break;
        started = t;
    }
    run(&jobs[0]);
    for (int t = started + 1; t < threads; t++) run(&jobs[t]); /* any thread that did not start */
    for (int t = 1; t <= started; t++) pthread_join(tid[t], 0);
    return 0;
}
"""

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False
_warned = False


def cache_dir() -> str:
    base = os.environ.get("RLSTACK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "rlstack"
    )
    return os.path.join(base, "kernels")


def cpu_is_avx2_only() -> bool:
    """torch's dispatch level is AVX2: the CPU has AVX2 and FMA and no AVX-512 (lscpu: avx2 fma)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def _build() -> Optional[ctypes.CDLL]:
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    folder = cache_dir()
    path = os.path.join(folder, f"rl_linear_avx2_{digest}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # ranks build at once: each its own, then rename
            src, out = os.path.join(tmp, "rl_linear.c"), os.path.join(tmp, "rl_linear.so")
            with open(src, "w") as f:
                f.write(_SOURCE)
            cc = os.environ.get("CC", "cc")
            cmd = [cc, "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-pthread", "-o", out, src]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise OSError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:300]}")
            os.replace(out, path)
    lib = ctypes.CDLL(path)
    lib.rl_linear.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rl_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.rl_pack.restype = None
    lib.rl_pack.argtypes = [ptr, i64, i64, i64, ptr]
    return lib


def library() -> Optional[ctypes.CDLL]:
    """The compiled kernel, built on first use; None where it cannot be (no compiler, not x86)."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as err:
                _lib = None
                log.debug("rlstack's AVX2 matmul unavailable: %s", err)
        return _lib


def use_kernel(mode: str, dtype: torch.dtype) -> bool:
    """Whether the hf engine's packed linears run here (rollout.cpu_matmul): `avx2` wherever the CPU has
    AVX2 (an error where it cannot be built), `auto` on AVX2-only CPUs in fp32, `onednn` never."""
    global _warned
    if mode == "onednn" or dtype != torch.float32:
        return False
    if mode == "auto" and not cpu_is_avx2_only():
        return False
    if mode == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise UserError(
            f"rollout.cpu_matmul=avx2: this CPU has no AVX2 (torch: {torch.backends.cpu.get_cpu_capability()}); "
            "set rollout.cpu_matmul=auto"
        )
    if library() is not None:
        return True
    if mode == "avx2":
        raise UserError(
            "rollout.cpu_matmul=avx2: no C compiler built the kernel (install gcc, or set CC); "
            "or set rollout.cpu_matmul=auto"
        )
    if not _warned:
        _warned = True
        log.warning(
            "rollout: no C compiler (cc) for rlstack's AVX2 matmul: decode runs on oneDNN, ~1.5x slower on this "
            "AVX2-only CPU (rollout.cpu_matmul, docs/benchmarks.md)"
        )
    return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (fp32) -> [ceil(N/16), K, 16]: each 16-column block contiguous, zeros past N."""
    n, k = weight.shape
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty((-(-n // BLOCK), k, BLOCK), dtype=torch.float32)
    library().rl_pack(weight.data_ptr(), n, k, weight.stride(0), out.data_ptr())
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """x [..., K] fp32 -> x W^T + bias [..., N], W given packed (`pack`). Threads: torch's."""
    lib = library()
    k = packed.shape[1]
    rows = x.reshape(-1, k)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    y = torch.empty((rows.shape[0], out_features), dtype=torch.float32)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # held here: the kernel reads it through a raw pointer
    if rows.shape[0]:
        lib.rl_linear(
            rows.data_ptr(),
            rows.shape[0],
            k,
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out_features,
            y.data_ptr(),
            torch.get_num_threads(),
        )
    return y.view(*x.shape[:-1], out_features)
