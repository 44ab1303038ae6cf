/* CPU kernels (float32) for the hot path of small batches, where torch spends more time
 * dispatching than computing. Called through ctypes by pdserve/engine/cpu_kernels.py; OpenMP
 * threads come from the runtime torch already loaded.
 *
 * Paged decode attention: one query token per request.
 *
 * Reads each request's K and V blocks once, straight from the cache, with an online softmax
 * per block (the torch path has to gather the blocks into a new tensor first, then read that
 * copy: three passes over the KV instead of one).
 *
 *   q        [n, H, D]                  query of each request (after RoPE)
 *   k, v     [num_blocks, KVH, BS, D]   the layer's cache
 *   blocks   [sum of blocks per request] each request's block ids, request after request
 *   starts   [n + 1]                    request r owns blocks[starts[r] .. starts[r + 1])
 *   lens     [n]                        context length of request r (its query included)
 *   out      [n, H, D]
 * The H query heads share KVH key/value heads in groups of G = H / KVH.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 64
#define MAX_D 256
#define MAX_BS 64

void paged_decode_f32(const float *q, const float *k, const float *v, const int64_t *blocks,
                      const int64_t *starts, const int64_t *lens, float *out, int64_t n, int64_t H,
                      int64_t KVH, int64_t D, int64_t BS, float scale) {
    const int64_t G = H / KVH;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t h = 0; h < KVH; h++) {
            float acc[MAX_G][MAX_D];
            float m[MAX_G], l[MAX_G], s[MAX_G][MAX_BS];
            const float *qh = q + (r * H + h * G) * D;
            for (int64_t g = 0; g < G; g++) {
                m[g] = -FLT_MAX; /* finite: built with -ffast-math, which assumes no infinities */
                l[g] = 0.0f;
                memset(acc[g], 0, sizeof(float) * D);
            }
            const int64_t len = lens[r];
            for (int64_t i = starts[r]; i < starts[r + 1]; i++) {
                const int64_t first = (i - starts[r]) * BS;
                const int64_t valid = len - first < BS ? len - first : BS;
                const float *kb = k + (blocks[i] * KVH + h) * BS * D;
                const float *vb = v + (blocks[i] * KVH + h) * BS * D;
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = qh + g * D;
                    float block_max = -FLT_MAX;
                    for (int64_t t = 0; t < valid; t++) {
                        const float *kt = kb + t * D;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < D; d++) dot += qg[d] * kt[d];
                        dot *= scale;
                        s[g][t] = dot;
                        block_max = dot > block_max ? dot : block_max;
                    }
                    /* Rescale what was accumulated when this block raises the running max. */
                    if (block_max > m[g]) {
                        const float c = expf(m[g] - block_max);
                        l[g] *= c;
                        for (int64_t d = 0; d < D; d++) acc[g][d] *= c;
                        m[g] = block_max;
                    }
                    float p[MAX_BS];
#pragma omp simd
                    for (int64_t t = 0; t < valid; t++) p[t] = expf(s[g][t] - m[g]);
                    for (int64_t t = 0; t < valid; t++) {
                        const float *vt = vb + t * D;
                        l[g] += p[t];
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) acc[g][d] += p[t] * vt[d];
                    }
                }
            }
            float *oh = out + (r * H + h * G) * D;
            for (int64_t g = 0; g < G; g++) {
                const float inv = 1.0f / l[g];
                for (int64_t d = 0; d < D; d++) oh[g * D + d] = acc[g][d] * inv;
            }
        }
    }
}

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
 * projection); caches: [num_blocks, KVH, BS, D]. */
void write_kv_f32(const float *k, const float *v, float *k_cache, float *v_cache, const int64_t *blocks,
                  const int64_t *offsets, int64_t T, int64_t KVH, int64_t BS, int64_t D, int64_t k_stride,
                  int64_t v_stride) {
#pragma omp parallel for schedule(static) if (T > 64)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t dst = ((blocks[t] * KVH + h) * BS + offsets[t]) * D;
            memcpy(k_cache + dst, k + t * k_stride + h * D, sizeof(float) * D);
            memcpy(v_cache + dst, v + t * v_stride + h * D, sizeof(float) * D);
        }
    }
}
