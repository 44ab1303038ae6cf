/* CPU kernels (float32) for the hot path of small batches, where torch spends more time
 * dispatching than computing: RMSNorm, SwiGLU, the KV store and the few-rows matmuls (the
 * attention kernels are in cpu_attention.c, linked into the same library). Called through ctypes
 * by pdserve/engine/cpu_kernels.py; OpenMP threads come from the runtime torch already loaded.
 *
 * Cache layout, per layer and KV head: a key block is stored transposed, [D][BS] (so one
 * query's scores against a block are D broadcast-FMAs over BS lanes, with no horizontal
 * sums), a value block as [BS][D]: k is [num_blocks, KVH, D, BS], v is [num_blocks, KVH, BS, D].
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* h = x (+ residual); residual_out = h; out = h / rms(h) * w, row by row.
 * residual may be NULL (first layer: no residual yet); residual_out may alias residual. */
void rms_norm_f32(const float *x, const float *residual, float *residual_out, const float *w, float *out,
                  int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *outr = out + r * dim;
        float *hr = residual_out ? residual_out + r * dim : outr;
        float ss = 0.0f;
        if (residual) {
            const float *rr = residual + r * dim;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < dim; d++) {
                const float h = xr[d] + rr[d];
                hr[d] = h;
                ss += h * h;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < dim; d++) {
                hr[d] = xr[d];
                ss += xr[d] * xr[d];
            }
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) outr[d] = hr[d] * inv * w[d];
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i]: SwiGLU over a fused [rows, 2n] projection. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n;
        const float *u = g + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Store the step's keys and values: token t goes to block blocks[t], slot offsets[t].
 * k, v: [T, KVH, D] with rows k_stride and v_stride floats apart (views into the fused qkv
 * projection); k_cache: [num_blocks, KVH, D, BS] (transposed blocks), v_cache: [num_blocks, KVH, BS, D]. */
void write_kv_f32(const float *k, const float *v, float *k_cache, float *v_cache, const int64_t *blocks,
                  const int64_t *offsets, int64_t T, int64_t KVH, int64_t BS, int64_t D, int64_t k_stride,
                  int64_t v_stride) {
#pragma omp parallel for schedule(static) if (T >= 16) /* a decode step of 16+ requests: 2x on 2 cores */
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t block = (blocks[t] * KVH + h) * BS * D;
            const float *kt = k + t * k_stride + h * D;
            for (int64_t d = 0; d < D; d++) k_cache[block + d * BS + offsets[t]] = kt[d];
            memcpy(v_cache + block + offsets[t] * D, v + t * v_stride + h * D, sizeof(float) * D);
        }
    }
}

/* The two few-rows products, written once for each weight type: W_T is the weight's element
 * type and LOAD(v) widens one weight to float32 (the arithmetic is float32 either way).
 * bfloat16 weights are the upper half of a float32: half the bytes of W to stream. */
static inline float f32_to_f32(float v) { return v; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* y[n] = W[n, k] x[k] for one row of activations (single-request decode): each thread streams
 * its share of W's rows front to back, four rows at a time sharing the loads of x. Reading W
 * is the whole cost; this keeps the hardware prefetchers on long sequential runs. */
#define DEFINE_GEMV(NAME, W_T, LOAD)                                                                  \
    void NAME(const W_T *restrict w, const float *restrict x, float *restrict y, int64_t n, int64_t k) { \
        _Pragma("omp parallel for schedule(static)") for (int64_t i = 0; i < n; i += 4) {              \
            if (n - i >= 4) {                                                                         \
                const W_T *w0 = w + i * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;                  \
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;                                     \
                _Pragma("omp simd reduction(+ : a0, a1, a2, a3)") for (int64_t j = 0; j < k; j++) {    \
                    const float xj = x[j];                                                            \
                    a0 += LOAD(w0[j]) * xj;                                                           \
                    a1 += LOAD(w1[j]) * xj;                                                           \
                    a2 += LOAD(w2[j]) * xj;                                                           \
                    a3 += LOAD(w3[j]) * xj;                                                           \
                }                                                                                     \
                y[i] = a0;                                                                            \
                y[i + 1] = a1;                                                                        \
                y[i + 2] = a2;                                                                        \
                y[i + 3] = a3;                                                                        \
            } else {                                                                                  \
                for (int64_t r = i; r < n; r++) {                                                     \
                    const W_T *wr = w + r * k;                                                        \
                    float a = 0.0f;                                                                   \
                    _Pragma("omp simd reduction(+ : a)") for (int64_t j = 0; j < k; j++) a +=         \
                        LOAD(wr[j]) * x[j];                                                           \
                    y[r] = a;                                                                         \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

/* y[m, n] = x[m, k] @ w[n, k]^T for a few rows (m small: speculative verification, small
 * batches): each row of w is read once from memory and used for every row of x, four at a time. */
#define DEFINE_GEMM_ROWS(NAME, W_T, LOAD)                                                             \
    void NAME(const W_T *restrict w, const float *restrict x, float *restrict y, int64_t n, int64_t k, \
              int64_t m) {                                                                            \
        _Pragma("omp parallel for schedule(static)") for (int64_t i = 0; i < n; i++) {                 \
            const W_T *wi = w + i * k;                                                                \
            int64_t r = 0;                                                                            \
            for (; r + 4 <= m; r += 4) {                                                              \
                const float *x0 = x + r * k, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k;                \
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;                                     \
                _Pragma("omp simd reduction(+ : a0, a1, a2, a3)") for (int64_t j = 0; j < k; j++) {    \
                    const float wj = LOAD(wi[j]);                                                     \
                    a0 += wj * x0[j];                                                                 \
                    a1 += wj * x1[j];                                                                 \
                    a2 += wj * x2[j];                                                                 \
                    a3 += wj * x3[j];                                                                 \
                }                                                                                     \
                y[r * n + i] = a0;                                                                    \
                y[(r + 1) * n + i] = a1;                                                              \
                y[(r + 2) * n + i] = a2;                                                              \
                y[(r + 3) * n + i] = a3;                                                              \
            }                                                                                         \
            if (m - r == 3) { /* the rest in one more pass over wi, not one per row */                \
                const float *x0 = x + r * k, *x1 = x0 + k, *x2 = x1 + k;                              \
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f;                                                \
                _Pragma("omp simd reduction(+ : a0, a1, a2)") for (int64_t j = 0; j < k; j++) {        \
                    const float wj = LOAD(wi[j]);                                                     \
                    a0 += wj * x0[j];                                                                 \
                    a1 += wj * x1[j];                                                                 \
                    a2 += wj * x2[j];                                                                 \
                }                                                                                     \
                y[r * n + i] = a0;                                                                    \
                y[(r + 1) * n + i] = a1;                                                              \
                y[(r + 2) * n + i] = a2;                                                              \
            } else if (m - r == 2) {                                                                  \
                const float *x0 = x + r * k, *x1 = x0 + k;                                            \
                float a0 = 0.0f, a1 = 0.0f;                                                           \
                _Pragma("omp simd reduction(+ : a0, a1)") for (int64_t j = 0; j < k; j++) {            \
                    const float wj = LOAD(wi[j]);                                                     \
                    a0 += wj * x0[j];                                                                 \
                    a1 += wj * x1[j];                                                                 \
                }                                                                                     \
                y[r * n + i] = a0;                                                                    \
                y[(r + 1) * n + i] = a1;                                                              \
            } else if (m - r == 1) {                                                                  \
                const float *xr = x + r * k;                                                          \
                float a = 0.0f;                                                                       \
                _Pragma("omp simd reduction(+ : a)") for (int64_t j = 0; j < k; j++) a +=             \
                    LOAD(wi[j]) * xr[j];                                                              \
                y[r * n + i] = a;                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

DEFINE_GEMV(gemv_f32, float, f32_to_f32)
DEFINE_GEMV(gemv_bf16_f32, uint16_t, bf16_to_f32)
DEFINE_GEMM_ROWS(gemm_rows_f32, float, f32_to_f32)
DEFINE_GEMM_ROWS(gemm_rows_bf16_f32, uint16_t, bf16_to_f32)
