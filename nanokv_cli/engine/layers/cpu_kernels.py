"""Small C kernels for the float32 CPU path, built on first use with the system C compiler.

Two reasons to leave PyTorch here:

* Paged decode attention. The torch path gathers every decoding sequence's K/V out of the paged
  cache into a contiguous buffer, then runs SDPA, whose CPU kernel is slow for 1-token queries:
  at batch 64 (SmolLM2 shapes, contexts ~450) gather + SDPA took ~11 ms per layer, this kernel
  ~4.5 ms. It reads K and V where they lie, through the block table, in two passes (scores for
  8 keys at a time, softmax, probability-weighted sum of V rows), accumulating in float32.
* Per-op overhead. A single sequence's decode step is ~30 layers of tiny tensors, where each
  torch op costs microseconds of dispatch: RMSNorm alone ran as ~10 ops (F.rms_norm decomposes
  on CPU). Fused here: residual add + RMSNorm, rotary embedding in place, the K/V cache store,
  and silu(gate) * up - one call each instead of 3-11 ops.

The kernels are vectorised with AVX2/FMA where the CPU has them (plain C elsewhere) and run
on torch's OpenMP thread pool (the library links the same libgomp). They are compiled with
``-ffp-contract=off`` so that element-wise results round as torch's separate ops do; the
attention and the norm's sum of squares differ from torch's only in summation order.

The library is built once per source version and CPU into nanokv's cache directory (~1 s).
Without a compiler, or with ``NANOKV_CPU_KERNELS=0``, ``available()`` is False and every caller
stays on its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* exp(x) for x <= 88, Cephes-style 2^n * p(r) in plain arithmetic, so the loops around it
   vectorise; relative error ~1e-7; below -87 it returns ~exp(-87). */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f;
}

/* exp(x) for any float x: saturates outside [-87, 88]. */
static inline float exp_any(float x) { return exp_clamped(x > 88.0f ? 88.0f : x); }

/* Row r of a [outer, inner, dim] view with rows of dim contiguous: outer stride given. */
#define ROW(base, r, inner, outer_stride, dim) \
    ((base) + ((r) / (inner)) * (outer_stride) + ((r) % (inner)) * (dim))

/* RMSNorm over rows of dim, optionally after a residual add:
   with residual: residual[r] += x[r], out[r] = norm(residual[r]) * w; else out[r] = norm(x[r]) * w.
   Rows are addressed as [outer, inner, dim] (inner = heads for per-head norms, else 1);
   out may be x. Sum of squares in float32, as torch's mean. */
void rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t residual_stride,
                  const float *w, int64_t rows, int64_t inner, int64_t dim, float eps,
                  float *out, int64_t out_stride, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = ROW(x, r, inner, x_stride, dim);
        float *orow = ROW(out, r, inner, out_stride, dim);
        const float *src = xr;
        if (residual != NULL) {
            float *res = ROW(residual, r, inner, residual_stride, dim);
            #pragma omp simd
            for (int64_t d = 0; d < dim; d++) res[d] = xr[d] + res[d];
            src = res;
        }
        float squares = 0.0f;
        #pragma omp simd reduction(+:squares)
        for (int64_t d = 0; d < dim; d++) squares += src[d] * src[d];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++) orow[d] = w[d] * (src[d] * inv);
    }
}

/* Rotary embedding in place on x [n, heads, dim] (token stride x_stride, heads contiguous),
   half-split layout: table[pos] = [cos duplicated | sin with the first half negated]. */
void rotary_f32(float *x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim,
                const float *table, const int64_t *positions, int threads) {
    const int64_t half = dim / 2;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && n * heads * dim >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const float *cs = table + positions[i] * 2 * dim, *sn = cs + dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + i * x_stride + h * dim;
            #pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float x1 = v[d], x2 = v[d + half];
                v[d] = x1 * cs[d] + x2 * sn[d];
                v[d + half] = x2 * cs[d + half] + x1 * sn[d + half];
            }
        }
    }
}

/* k_cache[slots[i]] = k[i], v_cache[slots[i]] = v[i]; rows of `row` floats, token strides given. */
void store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                  const int64_t *slots, int64_t n, int64_t row, float *k_cache, float *v_cache) {
    for (int64_t i = 0; i < n; i++) {
        memcpy(k_cache + slots[i] * row, k + i * k_stride, sizeof(float) * row);
        memcpy(v_cache + slots[i] * row, v + i * v_stride, sizeof(float) * row);
    }
}

/* out[i] = silu(x[i, :inter]) * x[i, inter:], x [n, 2 * inter] contiguous, out [n, inter]. */
void silu_mul_f32(const float *x, int64_t n, int64_t inter, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && n * inter >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const float *gate = x + i * 2 * inter, *up = gate + inter;
        float *o = out + i * inter;
        #pragma omp simd
        for (int64_t d = 0; d < inter; d++) o[d] = gate[d] / (1.0f + exp_any(-gate[d])) * up[d];
    }
}

/* scores[t] = scale * (q . k_t), k_t = k + t * stride, t < m */
static void key_scores(const float *q, const float *k, int64_t stride, int64_t m, int64_t dim,
                       float scale, float *scores) {
    int64_t t = 0;
#ifdef __AVX2__
    if (dim % 8 == 0) {
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; t + 8 <= m; t += 8) {
            const float *k0 = k + t * stride;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + stride + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * stride + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * stride + d), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 4 * stride + d), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 5 * stride + d), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 6 * stride + d), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 7 * stride + d), a7);
            }
            /* Horizontal sums of the eight accumulators, as one vector of eight scores. */
            const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
            const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                              _mm256_permute2f128_ps(h0, h1, 0x31));
            _mm256_storeu_ps(scores + t, _mm256_mul_ps(sums, vscale));
        }
    }
#endif
    for (; t < m; t++) {
        const float *kt = k + t * stride;
        float s = 0.0f;
        for (int64_t d = 0; d < dim; d++) s += q[d] * kt[d];
        scores[t] = s * scale;
    }
}

/* acc[d] += sum_t p[t] * v_t[d], v_t = v + t * stride, t < m */
static void weighted_values(const float *p, const float *v, int64_t stride, int64_t m,
                            int64_t dim, float *acc) {
    int64_t d0 = 0;
#ifdef __AVX2__
    for (; d0 + 64 <= dim; d0 += 64) {
        float *a = acc + d0;
        __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8);
        __m256 a2 = _mm256_loadu_ps(a + 16), a3 = _mm256_loadu_ps(a + 24);
        __m256 a4 = _mm256_loadu_ps(a + 32), a5 = _mm256_loadu_ps(a + 40);
        __m256 a6 = _mm256_loadu_ps(a + 48), a7 = _mm256_loadu_ps(a + 56);
        for (int64_t t = 0; t < m; t++) {
            const float *vt = v + t * stride + d0;
            const __m256 pt = _mm256_set1_ps(p[t]);
            a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt), a0);
            a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8), a1);
            a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 16), a2);
            a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 24), a3);
            a4 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 32), a4);
            a5 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 40), a5);
            a6 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 48), a6);
            a7 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 56), a7);
        }
        _mm256_storeu_ps(a, a0); _mm256_storeu_ps(a + 8, a1);
        _mm256_storeu_ps(a + 16, a2); _mm256_storeu_ps(a + 24, a3);
        _mm256_storeu_ps(a + 32, a4); _mm256_storeu_ps(a + 40, a5);
        _mm256_storeu_ps(a + 48, a6); _mm256_storeu_ps(a + 56, a7);
    }
#endif
    for (int64_t t = 0; t < m; t++) {
        const float *vt = v + t * stride;
        const float pt = p[t];
        for (int64_t d = d0; d < dim; d++) acc[d] += pt * vt[d];
    }
}

/* One query token per sequence: q [n, heads, dim] (token stride q_stride), caches
   [num_blocks, block_size, kv_heads, dim], block_tables [n, width], out [n, heads, dim]
   (token stride out_stride). Sequence i attends to its first context_lens[i] positions. */
int paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache,
                     const float *v_cache, const int64_t *block_tables,
                     const int64_t *context_lens, int64_t n, int64_t width, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                     float *out, int64_t out_stride, int threads) {
    const int64_t group = heads / kv_heads, slot = kv_heads * dim;
    int64_t max_len = 0;
    for (int64_t i = 0; i < n; i++) max_len = context_lens[i] > max_len ? context_lens[i] : max_len;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1 && n * heads > 1)
    {
        float *scores = malloc(sizeof(float) * (max_len + 8));
        if (scores == NULL) {
            failed = 1;
        } else {
            #pragma omp for schedule(dynamic, 4)
            for (int64_t item = 0; item < n * heads; item++) {
                const int64_t i = item / heads, head = item % heads, h = head / group;
                const int64_t len = context_lens[i];
                const int64_t *table = block_tables + i * width;
                const float *qi = q + i * q_stride + head * dim;
                float *oi = out + i * out_stride + head * dim;
                for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                    const int64_t m = len - t0 < block_size ? len - t0 : block_size;
                    const float *k = k_cache + (table[t0 / block_size] * block_size * kv_heads + h) * dim;
                    key_scores(qi, k, slot, m, dim, scale, scores + t0);
                }
                float top = -INFINITY, total = 0.0f;
                for (int64_t t = 0; t < len; t++) top = scores[t] > top ? scores[t] : top;
                #pragma omp simd reduction(+:total)
                for (int64_t t = 0; t < len; t++) {
                    scores[t] = exp_clamped(scores[t] - top);
                    total += scores[t];
                }
                memset(oi, 0, sizeof(float) * dim);
                for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                    const int64_t m = len - t0 < block_size ? len - t0 : block_size;
                    const float *v = v_cache + (table[t0 / block_size] * block_size * kv_heads + h) * dim;
                    weighted_values(scores + t0, v, slot, m, dim, oi);
                }
                const float inv = 1.0f / total;
                for (int64_t d = 0; d < dim; d++) oi[d] *= inv;
            }
            free(scores);
        }
    }
    return failed;
}
"""

# Tried in order: the first that compiles wins. -march=native is safe because the library is
# cached per CPU (see _library_path); without OpenMP the kernels run on one thread.
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3", "-march=native"],
    ["-O3"],
)
# No FMA contraction (element-wise results round as torch's separate ops do); no errno or
# trap semantics, which only block vectorisation (neither changes a result).
_COMMON_FLAGS = ["-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
_ENV_SWITCH = "NANOKV_CPU_KERNELS"

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "paged_decode_f32": (
        [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _ptr]
        + [_i64, _int],
        _int,
    ),
    "rms_norm_f32": (
        [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _f32, _ptr, _i64, _int],
        None,
    ),
    "rotary_f32": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _int], None),
    "store_kv_f32": ([_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "silu_mul_f32": ([_ptr, _i64, _i64, _ptr, _int], None),
}


def available() -> bool:
    """Whether the kernels can run here (built, or buildable now)."""
    return _library() is not None


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Decode attention of q [n, heads, dim] over the paged caches, written into ``out``.

    ``k_cache``/``v_cache``: one layer's contiguous [num_blocks, block_size, kv_heads, dim];
    ``block_tables``: contiguous int64 [n, width]; ``context_lens``: int64 [n], each >= 1 and
    covered by its table row. ``q`` and ``out``: [n, heads, dim] with heads and dim contiguous
    (row slices are fine).
    """
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    failed = _library().paged_decode_f32(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        n,
        block_tables.shape[1],
        heads,
        kv_heads,
        dim,
        block_size,
        scale,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its score buffer")
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of x's rows (last dim); with ``residual``, of ``x + residual``, stored in residual.

    x, residual and out are [n, dim] or [n, heads, dim] with the last two dims packed (token
    rows may be strided); ``out`` defaults to a new contiguous tensor and may be ``x``.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype)
    dim = x.shape[-1]
    inner = x.shape[1] if x.dim() == 3 else 1
    _library().rms_norm_f32(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(),
        x.shape[0] * inner,
        inner,
        dim,
        eps,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out


def rotary_(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, dim] (heads and dim packed) in place; ``table`` [positions, 2, dim]
    holds cos duplicated and sin with its first half negated; ``positions`` int64 [n]."""
    n, heads, dim = x.shape
    _library().rotary_f32(
        x.data_ptr(),
        x.stride(0),
        n,
        heads,
        dim,
        table.data_ptr(),
        positions.data_ptr(),
        torch.get_num_threads(),
    )
    return x


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """k_cache/v_cache slot ``slots[i]`` = k[i]/v[i]; k, v [n, kv_heads, dim] with heads and
    dim packed (token rows may be strided); caches contiguous."""
    n, kv_heads, dim = k.shape
    _library().store_kv_f32(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        slots.data_ptr(),
        n,
        kv_heads * dim,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
    )


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :h]) * x[:, h:] for a contiguous [n, 2h] x."""
    n, width = x.shape
    out = torch.empty(n, width // 2, dtype=x.dtype)
    _library().silu_mul_f32(x.data_ptr(), n, width // 2, out.data_ptr(), torch.get_num_threads())
    return out


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        return None
    try:
        path = _library_path()
        if not path.is_file():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None  # no compiler or no writable cache: the torch paths serve
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def _library_path() -> Path:
    from ..loader import default_cache_dir

    # One build per source version and CPU: -march=native code must not meet another CPU.
    identity = "\n".join(
        [_SOURCE, platform.machine(), _cpu_flags(), repr(_FLAG_SETS + (_COMMON_FLAGS,))]
    )
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"cpu_kernels-{key}.so"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build(path: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        source = Path(tmp) / "cpu_kernels.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / path.name
        for flags in _FLAG_SETS:
            command = [compiler, *flags, *_COMMON_FLAGS, "-o", str(built), str(source), "-lm"]
            if subprocess.run(command, capture_output=True, timeout=120).returncode == 0:
                os.replace(built, path)  # atomic: a concurrent build just wins or loses
                return
    raise RuntimeError("the C compiler rejected nanokv's CPU kernels")
