"""rlstack's AVX2 / AVX-512 matmul for the hf engine's linears on CPU (rollout.cpu_matmul).

Why: a decode step multiplies a few rows (SmolLM2's GRPO rollout: ~9 live rows of 16) by every weight,
streaming all of them from memory. On an AVX2-only CPU (AMD EPYC, lscpu flags avx2 fma; one thread)
oneDNN's reordered weights run that at ~7.5 GB/s of weights (SmolLM2's 211 linears at 9 rows: 72 ms),
a third of what one core reads (~24 GB/s) and far from the FMA units' rate. This kernel keeps each
16-column block of a weight contiguous ([N/16][K][16] floats), prefetches 8 KiB ahead in that one
stream, and accumulates up to 6 rows x 16 columns in 12 AVX2 registers (further rows re-read the block
from L2): 46 ms at 9 rows, 28 ms at 4 (oneDNN 52), 67 ms at 16 (90), and at prefill's hundreds of
rows ~80 GFLOP/s (oneDNN ~77). docs/benchmarks.md ("session 24") has the table.

On CPUs with AVX-512 the same packed blocks run on an AVX-512 body (one register is a block's 16
columns, up to 16 rows on each weight load, the same sums in the same order): on AMD Zen 4 (AVX-512 on
256-bit units) the pass takes 21 / 25 / 36 / 54 ms at 1 / 4 / 9 / 16 rows against the AVX2 body's
23 / 25 / 42 / 62 and oneDNN's 41 / 31 / 43 / 60, so `auto` takes this library there too
(`auto_prefers_kernel`); other AVX-512 CPUs keep oneDNN under `auto` (not measured). At 9-14 rows the
AVX-512 body reads two blocks a pass (5-14% faster at 9, 10 and 14 rows; docs/rollout.md). In a process of
several torch threads each call's column blocks (and the decode attention's rows and heads) are split over an
OpenMP team drawn from torch's own pool: the library links the OpenMP runtime torch loaded. The C source below
is compiled once per machine and source version with the system C compiler (`cc -O3 -mavx2 -mfma -fopenmp`,
< 1 s) into the rlstack cache (`$RLSTACK_CACHE_DIR`, else `$XDG_CACHE_HOME/rlstack` or ~/.cache/rlstack);
without a compiler the engine stays on oneDNN and says so once. Values differ from oneDNN's by summation order (~1e-6
relative in fp32). tests/unit/test_cpu_gemm.py checks it against torch at odd shapes, with bias,
threads and padding.
"""

from __future__ import annotations

import ctypes
import functools
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
#include <omp.h>
#include <math.h>
#include <stdlib.h>

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

/* The same kernel on AVX-512 (CPUs that have it, chosen at run time): 16 columns are one register, so
   up to 16 rows share each weight load (16 accumulators of 32) and a decode step's rows (<= 16) stream
   the block once. The per-lane sums run in the same order as the AVX2 kernel's: the same values. */
#define T512 __attribute__((target("avx512f")))
#define DEF_GROUP512(R)                                                                            \
T512 static inline void group512_##R(const float *x, int64_t ldx, const float *p, int64_t K,       \
                                     float *acc, int prefetch) {                                   \
    __m512 a[R];                                                                                   \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();               \
    for (int64_t k = 0; k < K; k++) {                                                              \
        if (prefetch) _mm_prefetch((const char *)(p + k * 16 + PF), _MM_HINT_T0);                  \
        __m512 w = _mm512_loadu_ps(p + k * 16);                                                    \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                       \
            a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, a[r]);                       \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * 16, a[r]);     \
}
DEF_GROUP512(1) DEF_GROUP512(2) DEF_GROUP512(3) DEF_GROUP512(4) DEF_GROUP512(5) DEF_GROUP512(6)
DEF_GROUP512(7) DEF_GROUP512(8) DEF_GROUP512(9) DEF_GROUP512(10) DEF_GROUP512(11) DEF_GROUP512(12)
DEF_GROUP512(13) DEF_GROUP512(14) DEF_GROUP512(15) DEF_GROUP512(16)

/* Two neighbouring blocks at once, for 9-14 rows: each x broadcast feeds both blocks' FMAs and two weight
   streams are in flight. At these rows one block's FMAs and its weight stream take about as long as
   each other on one core (AMD Zen 4: 9 rows x 16 columns of FMAs per 64 bytes of weights, ~26 GB/s
   at the FMA rate, what one core reads), and the single stream overlapped them poorly (docs/rollout.md
   "Two blocks a pass"). Each output sums the same products in the same order: the same bits. */
#define DEF_PAIR512(R)                                                                             \
T512 static inline void pair512_##R(const float *x, int64_t ldx, const float *p, const float *q,   \
                                    int64_t K, float *acc) {                                       \
    __m512 a[R], c[R];                                                                             \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                         \
        a[r] = _mm512_setzero_ps(); c[r] = _mm512_setzero_ps(); }                                  \
    for (int64_t k = 0; k < K; k++) {                                                              \
        _mm_prefetch((const char *)(p + k * 16 + PF), _MM_HINT_T0);                                \
        _mm_prefetch((const char *)(q + k * 16 + PF), _MM_HINT_T0);                                \
        __m512 w = _mm512_loadu_ps(p + k * 16), v = _mm512_loadu_ps(q + k * 16);                   \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                     \
            __m512 xb = _mm512_set1_ps(x[r * ldx + k]);                                            \
            a[r] = _mm512_fmadd_ps(xb, w, a[r]); c[r] = _mm512_fmadd_ps(xb, v, c[r]); }            \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                         \
        _mm512_storeu_ps(acc + r * 32, a[r]); _mm512_storeu_ps(acc + r * 32 + 16, c[r]); }         \
}
DEF_PAIR512(9) DEF_PAIR512(10) DEF_PAIR512(11) DEF_PAIR512(12) DEF_PAIR512(13) DEF_PAIR512(14)
#define PAIR_LO 9
#define PAIR_HI 14

/* run()'s twin on these bodies: a switch, not a table of function pointers, so that each row group's body
   is inlined into it (a shared driver calling through a table measured 5-17% slower at 1-256 rows) */
T512 static void *run512(void *arg) {
    job_t *j = (job_t *)arg;
    float acc[16 * 32];
    for (int64_t b = j->b0; b < j->b1; b++) {
        const float *p = j->P + b * j->K * 16;
        int64_t n0 = b * 16, w = j->N - n0 < 16 ? j->N - n0 : 16;
        if (j->M >= PAIR_LO && j->M <= PAIR_HI && b + 1 < j->b1) { /* blocks b and b + 1 in one pass */
            const float *q = p + j->K * 16;
            switch (j->M) {
                case 9: pair512_9(j->x, j->K, p, q, j->K, acc); break;
                case 10: pair512_10(j->x, j->K, p, q, j->K, acc); break;
                case 11: pair512_11(j->x, j->K, p, q, j->K, acc); break;
                case 12: pair512_12(j->x, j->K, p, q, j->K, acc); break;
                case 13: pair512_13(j->x, j->K, p, q, j->K, acc); break;
                default: pair512_14(j->x, j->K, p, q, j->K, acc); break;
            }
            int64_t w2 = j->N - n0 < 32 ? j->N - n0 : 32; /* block b's 16 columns and block b + 1's */
            for (int64_t r = 0; r < j->M; r++) {
                float *yr = j->y + r * j->N + n0;
                for (int64_t c = 0; c < w2; c++) yr[c] = acc[r * 32 + c] + (j->bias ? j->bias[n0 + c] : 0.0f);
            }
            b++;
            continue;
        }
        for (int64_t m = 0; m < j->M; m += 16) {
            int64_t R = j->M - m < 16 ? j->M - m : 16;
            const float *xm = j->x + m * j->K;
            int pf = m == 0;
            switch (R) {
                case 1: group512_1(xm, j->K, p, j->K, acc, pf); break;
                case 2: group512_2(xm, j->K, p, j->K, acc, pf); break;
                case 3: group512_3(xm, j->K, p, j->K, acc, pf); break;
                case 4: group512_4(xm, j->K, p, j->K, acc, pf); break;
                case 5: group512_5(xm, j->K, p, j->K, acc, pf); break;
                case 6: group512_6(xm, j->K, p, j->K, acc, pf); break;
                case 7: group512_7(xm, j->K, p, j->K, acc, pf); break;
                case 8: group512_8(xm, j->K, p, j->K, acc, pf); break;
                case 9: group512_9(xm, j->K, p, j->K, acc, pf); break;
                case 10: group512_10(xm, j->K, p, j->K, acc, pf); break;
                case 11: group512_11(xm, j->K, p, j->K, acc, pf); break;
                case 12: group512_12(xm, j->K, p, j->K, acc, pf); break;
                case 13: group512_13(xm, j->K, p, j->K, acc, pf); break;
                case 14: group512_14(xm, j->K, p, j->K, acc, pf); break;
                case 15: group512_15(xm, j->K, p, j->K, acc, pf); break;
                default: group512_16(xm, j->K, p, j->K, acc, pf); break;
            }
            for (int64_t r = 0; r < R; r++) {
                float *yr = j->y + (m + r) * j->N + n0;
                for (int64_t c = 0; c < w; c++) yr[c] = acc[r * 16 + c] + (j->bias ? j->bias[n0 + c] : 0.0f);
            }
        }
    }
    return 0;
}

/* exp of 8 floats (Cephes' expf polynomial, ~1-2 ulp over the softmax's range [-88, 0]); exactly 0 at -inf */
static inline __m256 exp8(__m256 x) {
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

/* 8 dot products q . k_i (i < 8), keys at stride sn, D a multiple of 8 -> one vector of 8 scores */
static inline __m256 dots8(const float *q, const float *k, int64_t sn, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        __m256 qc = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + sn + d), a1);
        a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 2 * sn + d), a2);
        a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 3 * sn + d), a3);
        a4 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 4 * sn + d), a4);
        a5 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 5 * sn + d), a5);
        a6 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 6 * sn + d), a6);
        a7 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 7 * sn + d), a7);
    }
    __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3), t2 = _mm256_hadd_ps(a4, a5),
           t3 = _mm256_hadd_ps(a6, a7);
    t0 = _mm256_hadd_ps(t0, t1);
    t1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

static inline float dot1(const float *q, const float *k, int64_t D) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* One (row, head) of a decode step's attention into o [D]; s: scratch of n + 8 floats */
static void attend_one(const float *qh, const float *kg, const float *vg, int64_t sn, const float *mb, int64_t n,
                       int64_t D, float scale, float *s, float *o) {
    __m256 sc = _mm256_set1_ps(scale);
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 x = _mm256_fmadd_ps(dots8(qh, kg + j * sn, sn, D), sc, _mm256_loadu_ps(mb + j));
        _mm256_storeu_ps(s + j, x);
        top8 = _mm256_max_ps(top8, x);
    }
    float lanes[8], top;
    _mm256_storeu_ps(lanes, top8);
    top = lanes[0];
    for (int i = 1; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    for (; j < n; j++) {
        s[j] = dot1(qh, kg + j * sn, D) * scale + mb[j];
        top = s[j] > top ? s[j] : top;
    }
    for (j = n; j < ((n + 7) & ~(int64_t)7); j++) s[j] = -INFINITY; /* pad to a vector: exp -> 0 */
    if (top == -INFINITY) { for (int64_t d = 0; d < D; d++) o[d] = 0.0f; return; }
    __m256 t = _mm256_set1_ps(top), sum8 = _mm256_setzero_ps();
    for (j = 0; j < n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), t));
        _mm256_storeu_ps(s + j, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    _mm256_storeu_ps(lanes, sum8);
    float total = 0.0f;
    for (int i = 0; i < 8; i++) total += lanes[i];
    __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int64_t d0 = 0; d0 < D; d0 += 64) { /* 8 accumulators of 8 at a time */
        int64_t w = D - d0 < 64 ? D - d0 : 64;
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
        for (j = 0; j < n; j++) {
            if (s[j] == 0.0f) continue;
            __m256 p = _mm256_set1_ps(s[j]);
            const float *vj = vg + j * sn + d0;
            for (int c = 0; c < w / 8; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * c), acc[c]);
        }
        for (int c = 0; c < w / 8; c++) _mm256_storeu_ps(o + d0 + 8 * c, _mm256_mul_ps(acc[c], inv));
    }
}

/* One decode step's attention: q [B, H, D] contiguous; k, v [B, G, n, D] at strides (sb, sg, sn, 1);
   mask [B, n] additive (0 or -inf); query head h reads key/value head h / (H / G); D a multiple of 8.
   -> out [B, H, D]. The softmax subtracts the row's largest score, as SDPA's does. threads > 1 share the
   (row, head) pairs in an OpenMP team (each pair's sums as on one thread: the same values). */
void rl_decode_attention(const float *q, const float *k, const float *v, int64_t sb, int64_t sg, int64_t sn,
                         const float *mask, int64_t B, int64_t H, int64_t G, int64_t n, int64_t D, float scale,
                         float *out, int threads) {
    int64_t rep = H / G, pairs = B * H;
    if (threads > pairs) threads = (int)pairs;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float stack[2048];
        float *s = n + 8 <= 2048 ? stack : (float *)malloc(sizeof(float) * (n + 8));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < pairs; i++) {
            int64_t b = i / H, h = i % H;
            attend_one(q + i * D, k + b * sb + (h / rep) * sg, v + b * sb + (h / rep) * sg, sn, mask + b * n, n, D,
                       scale, s, out + i * D);
        }
        if (s != stack) free(s);
    }
}

/* The decode step's small passes, one call each instead of 4-8 torch ops (~10 us apiece at decode's rows). */

static inline float sum_squares(const float *x, int64_t n) {
    __m256 a = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { __m256 v = _mm256_loadu_ps(x + i); a = _mm256_fmadd_ps(v, v, a); }
    float lanes[8], s = 0.0f;
    _mm256_storeu_ps(lanes, a);
    for (int j = 0; j < 8; j++) s += lanes[j];
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static inline void scale_by(const float *x, const float *w, float r, int64_t n, float *out) {
    __m256 rv = _mm256_set1_ps(r);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
    for (; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), rows of n (transformers' RMSNorm in fp32) */
void rl_rms_norm(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float inv = 1.0f / sqrtf(sum_squares(x + r * n, n) / (float)n + eps);
        scale_by(x + r * n, w, inv, n, out + r * n);
    }
}

/* x += y (the residual), then out = rms_norm(x) */
void rl_add_rms_norm(float *x, const float *y, const float *w, int64_t rows, int64_t n, float eps, float *out) {
    for (int64_t i = 0; i < rows * n; i++) x[i] += y[i];
    rl_rms_norm(x, w, rows, n, eps, out);
}

/* t [B, R, d] in place: t cos + rotate_half(t) sin, cos and sin [B, d] (transformers' apply_rotary_pos_emb) */
void rl_rope(float *t, int64_t B, int64_t R, int64_t d, const float *cos, const float *sin) {
    int64_t half = d / 2;
    float tmp[1024];
    for (int64_t b = 0; b < B; b++) {
        const float *c = cos + b * d, *s = sin + b * d;
        for (int64_t r = 0; r < R; r++) {
            float *v = t + (b * R + r) * d;
            for (int64_t i = 0; i < d; i++) tmp[i] = v[i];
            for (int64_t i = 0; i < half; i++) v[i] = tmp[i] * c[i] + (-tmp[i + half]) * s[i];
            for (int64_t i = half; i < d; i++) v[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
        }
    }
}

/* g = silu(g) * u = g / (1 + exp(-g)) * u, n values */
void rl_silu_mul(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = exp8(_mm256_sub_ps(zero, x));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* columns of 8 rows x 8 floats: r[i] = row i (8 consecutive k) -> t[j] = element j of each row */
static inline void transpose8(const __m256 r[8], __m256 t[8]) {
    __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 b0 = _mm256_shuffle_ps(a0, a2, _MM_SHUFFLE(1, 0, 1, 0)), b1 = _mm256_shuffle_ps(a0, a2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 b2 = _mm256_shuffle_ps(a1, a3, _MM_SHUFFLE(1, 0, 1, 0)), b3 = _mm256_shuffle_ps(a1, a3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 b4 = _mm256_shuffle_ps(a4, a6, _MM_SHUFFLE(1, 0, 1, 0)), b5 = _mm256_shuffle_ps(a4, a6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 b6 = _mm256_shuffle_ps(a5, a7, _MM_SHUFFLE(1, 0, 1, 0)), b7 = _mm256_shuffle_ps(a5, a7, _MM_SHUFFLE(3, 2, 3, 2));
    t[0] = _mm256_permute2f128_ps(b0, b4, 0x20); t[1] = _mm256_permute2f128_ps(b1, b5, 0x20);
    t[2] = _mm256_permute2f128_ps(b2, b6, 0x20); t[3] = _mm256_permute2f128_ps(b3, b7, 0x20);
    t[4] = _mm256_permute2f128_ps(b0, b4, 0x31); t[5] = _mm256_permute2f128_ps(b1, b5, 0x31);
    t[6] = _mm256_permute2f128_ps(b2, b6, 0x31); t[7] = _mm256_permute2f128_ps(b3, b7, 0x31);
}

/* W [N, K] (row stride ldw) -> P [ceil(N/16)][K][16], zeros past N: 16 rows x 8 k at a time, two 8 x 8
   transposes in registers (a weight packs at ~memcpy speed: SmolLM2's 538 MB 0.22 -> ~0.08 s) */
void rl_pack(const float *W, int64_t N, int64_t K, int64_t ldw, float *P) {
    int64_t blocks = (N + 15) / 16;
    for (int64_t b = 0; b < blocks; b++) {
        float *pb = P + b * K * 16;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 r[16], t[8], u[8];
            for (int c = 0; c < 16; c++) {
                int64_t n = b * 16 + c;
                r[c] = n < N ? _mm256_loadu_ps(W + n * ldw + k) : _mm256_setzero_ps();
            }
            transpose8(r, t);
            transpose8(r + 8, u);
            for (int j = 0; j < 8; j++) {
                _mm256_storeu_ps(pb + (k + j) * 16, t[j]);
                _mm256_storeu_ps(pb + (k + j) * 16 + 8, u[j]);
            }
        }
        for (; k < K; k++)
            for (int c = 0; c < 16; c++) {
                int64_t n = b * 16 + c;
                pb[k * 16 + c] = n < N ? W[n * ldw + k] : 0.0f;
            }
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias[N]); P: W packed [ceil(N/16)][K][16], zero past N; threads >= 1 split the
   column blocks in an OpenMP team (the process's one libgomp: torch's pool, whose threads spin between its own
   regions, so no thread is started per call); avx512: the AVX-512 kernel (the caller checks the CPU has it) */
int rl_linear(const float *x, int64_t M, int64_t K, const float *P, const float *bias, int64_t N, float *y,
              int threads, int avx512) {
    void *(*body)(void *) = avx512 ? run512 : run;
    int64_t blocks = (N + 15) / 16;
    if (threads > blocks) threads = (int)blocks;
    if (threads <= 1) {
        job_t one = {x, P, bias, y, M, K, N, 0, blocks};
        body(&one);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        job_t part = {x, P, bias, y, M, K, N, blocks * t / n, blocks * (t + 1) / n};
        body(&part);
    }
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


@functools.cache  # read once a process: every generate() asks (auto_prefers_kernel)
def cpu_vendor_family(path: str = "/proc/cpuinfo") -> tuple[str, int]:
    """(vendor_id, cpu family) of the first CPU in /proc/cpuinfo; ("", 0) where it cannot be read."""
    vendor, family = "", 0
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "cpu family" and not family:
                    family = int(value.strip() or 0)
                if vendor and family:
                    break
    except (OSError, ValueError):
        pass
    return vendor, family


def auto_prefers_kernel() -> bool:
    """Where `rollout.cpu_matmul=auto` takes this library over oneDNN (measured, docs/rollout.md): AVX2-only
    CPUs, and AMD Zen 4 (family 25 with AVX-512: its AVX-512 runs on 256-bit units, so oneDNN's AVX-512
    kernels are no wider; the rollout 4.0-4.6 s here against 5.2-5.5 on oneDNN, 16 rows x 64 tokens).
    Other AVX-512 CPUs (Intel, Zen 5's full-width units) keep oneDNN: not measured with this kernel."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX2":
        return True
    return capability == "AVX512" and cpu_vendor_family() == ("AuthenticAMD", 25)


def openmp_runtime(maps: str = "/proc/self/maps") -> str:
    """The OpenMP runtime torch loaded into this process (its libgomp, or an Intel / LLVM libomp that
    answers the same GOMP_* calls): the library links against that file, so its threads are torch's pool.
    "" where none is mapped (the system's libgomp is linked then)."""
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return ""
    names = ("libgomp", "libiomp5", "libomp")
    found = sorted(p for p in paths if os.path.basename(p).startswith(names) and ".so" in os.path.basename(p))
    found = [p for p in found if os.path.isfile(p)]
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))  # torch's own first: other wheels bring theirs
    found.sort(key=lambda p: not os.path.realpath(p).startswith(torch_dir))
    return found[0] if found else ""


def _build() -> Optional[ctypes.CDLL]:
    runtime = openmp_runtime()
    digest = hashlib.sha256((_SOURCE + runtime).encode()).hexdigest()[:16]
    folder = cache_dir()
    path = os.path.join(folder, f"rl_linear_avx2_{digest}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # ranks build at once: each its own, then rename
            src, obj, out = (os.path.join(tmp, "rl_linear" + ext) for ext in (".c", ".o", ".so"))
            with open(src, "w") as f:
                f.write(_SOURCE)
            cc = os.environ.get("CC", "cc")
            # compiled with OpenMP, linked against the runtime torch loaded (by its path: its soname may
            # not be the system's), so that one pool of threads serves torch's regions and this library's
            steps = [[cc, "-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-c", "-o", obj, src]]
            link = [runtime] if runtime else ["-fopenmp"]
            steps.append([cc, "-shared", "-o", out, obj, *link, "-lm", "-pthread"])
            for cmd in steps:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    raise OSError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:300]}")
            os.replace(out, path)
    lib = ctypes.CDLL(path)
    lib.rl_linear.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rl_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.rl_decode_attention.restype = None
    lib.rl_decode_attention.argtypes = (
        [ptr, ptr, ptr, i64, i64, i64, ptr] + [i64] * 5 + [ctypes.c_float, ptr, ctypes.c_int]
    )
    flt = ctypes.c_float
    lib.rl_rms_norm.restype = lib.rl_add_rms_norm.restype = lib.rl_rope.restype = lib.rl_silu_mul.restype = None
    lib.rl_rms_norm.argtypes = [ptr, ptr, i64, i64, flt, ptr]
    lib.rl_add_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, flt, ptr]
    lib.rl_rope.argtypes = [ptr, i64, i64, i64, ptr, ptr]
    lib.rl_silu_mul.argtypes = [ptr, ptr, i64]
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
    AVX2 (an error where it cannot be built), `auto` where `auto_prefers_kernel` (AVX2-only CPUs, AMD
    Zen 4) in fp32, `onednn` never. A process of several torch threads splits each call's column blocks
    over torch's own OpenMP pool (`linear`; measured on an AVX2-only Zen 3, 1 process x 2 threads: the
    trainer's rollout 9.8-12.0 s a step on oneDNN, 6.0-8.2 s here, docs/rollout.md). Session 24's split
    over threads started per call, beside torch's spinning pool, was slower than oneDNN (9.7-12.4 s
    against 7.1-7.4), so `auto` kept such processes on oneDNN until the team came from torch's pool."""
    global _warned
    if mode == "onednn" or dtype != torch.float32:
        return False
    if mode == "auto" and not auto_prefers_kernel():
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
            "rollout: no C compiler (cc) for rlstack's AVX2 matmul: decode runs on oneDNN, ~1.3-1.5x slower on this "
            "CPU (rollout.cpu_matmul, docs/benchmarks.md)"
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


@functools.cache  # once a process: `linear` asks at every call
def has_avx512() -> bool:
    """torch's dispatch level is AVX-512 (the CPU has avx512f): `linear` runs its AVX-512 kernel."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_features: int,
    threads: Optional[int] = None,
    avx512: Optional[bool] = None,
) -> torch.Tensor:
    """x [..., K] fp32 -> x W^T + bias [..., N], W given packed (`pack`). `threads` (default: torch's, read
    at each call: lent host cores change it) > 1 splits the column blocks over an OpenMP team of torch's own
    pool. `avx512` (default: where the CPU has it) runs the AVX-512 kernel: up to 16 rows on each weight
    load, the same sums."""
    lib = library()
    if threads is None:
        threads = torch.get_num_threads()
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
            threads,
            int(has_avx512() if avx512 is None else avx512),
        )
    return y.view(*x.shape[:-1], out_features)


def attention_applies(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """`decode_attention` takes these: fp32, head size a multiple of 8, keys and values in one layout with
    unit stride along the head dimension."""
    return (
        q.dtype == keys.dtype == values.dtype == torch.float32
        and q.shape[-1] % 8 == 0
        and keys.stride(-1) == 1
        and values.stride() == keys.stride()
    )


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode step's attention: q [B, H, D], keys and values [B, G, n, D] (the reserved cache's views;
    `attention_applies`), mask [B, n] additive (0 / -inf) -> [B, H, D]; query head h reads key/value head
    h // (H / G). SDPA's maths in fp32 (the largest score subtracted before exp; exp by Cephes' polynomial,
    ~1-2 ulp); ~2-3x faster than torch's flash kernel at decode shapes (one query a row)."""
    b, h, d = q.shape
    g, n = keys.shape[1], keys.shape[2]
    if not q.is_contiguous():
        q = q.contiguous()
    if not mask.is_contiguous():
        mask = mask.contiguous()
    out = torch.empty((b, h, d), dtype=torch.float32)
    sb, sg, sn, _ = keys.stride()
    library().rl_decode_attention(
        q.data_ptr(), keys.data_ptr(), values.data_ptr(), sb, sg, sn, mask.data_ptr(), b, h, g, n, d, scale,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


# The decode step's small passes (LeanDecoder with fast_attention): fp32, contiguous tensors.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm over the last dimension (fp32): weight * (x / sqrt(mean(x^2) + eps))."""
    n, x = x.shape[-1], x.contiguous()
    out = torch.empty_like(x)
    library().rl_rms_norm(x.data_ptr(), weight.data_ptr(), x.numel() // n, n, eps, out.data_ptr())
    return out


def add_rms_norm_(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += y in place (the residual stream), then returns rms_norm(x)."""
    n, y = x.shape[-1], y.contiguous()
    assert x.is_contiguous(), "add_rms_norm_ adds into x through its pointer"
    out = torch.empty_like(x)
    library().rl_add_rms_norm(x.data_ptr(), y.data_ptr(), weight.data_ptr(), x.numel() // n, n, eps, out.data_ptr())
    return out


def rope_(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [B, R, d] in place: t cos + rotate_half(t) sin with cos and sin [B, d] (d <= 1024, even)."""
    b, r, d = t.shape
    assert t.is_contiguous() and cos.is_contiguous() and sin.is_contiguous(), "rope_ works through pointers"
    library().rl_rope(t.data_ptr(), b, r, d, cos.data_ptr(), sin.data_ptr())
    return t


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate = silu(gate) * up in place."""
    assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape, "silu_mul_ works through pointers"
    library().rl_silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel())
    return gate
