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

#include "cpu_vec.h"

/* h = x (+ residual); residual_out = h; out = h / rms(h) * w, row by row.
 * residual may be NULL (first layer: no residual yet); residual_out may alias residual.
 * x_bf16: x holds bfloat16 (a bf16 model's projection product, widened exactly as it is read);
 * out_bf16: out is bfloat16 (for a bf16 model's next projection, rounded as torch rounds). Either
 * way the same values as the float32 kernel with torch's casts around it, without the casts. */
void rms_norm_f32(const void *x, const float *residual, float *residual_out, const float *w, void *out,
                  int64_t rows, int64_t dim, float eps, int64_t x_bf16, int64_t out_bf16) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        float xw[x_bf16 ? dim : 1], ow[out_bf16 ? dim : 1];
        const float *xr = (const float *)x + r * dim;
        if (x_bf16) {
            const uint16_t *xb = (const uint16_t *)x + r * dim;
            for (int64_t d = 0; d < dim; d++) xw[d] = bf16_to_f32(xb[d]);
            xr = xw;
        }
        float *outr = out_bf16 ? ow : (float *)out + r * dim;
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
        if (out_bf16) {
            uint16_t *ob = (uint16_t *)out + r * dim;
            for (int64_t d = 0; d < dim; d++) ob[d] = f32_to_bf16(ow[d]);
        }
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i]: SwiGLU over a fused [rows, 2n] projection.
 * With AVX-512, 16 lanes at a time through vec_exp16 and a reciprocal refined once (glibc's vector
 * expf and a division took 0.87 ms for 2,048 x 1,536 outputs on 2 AMX Xeon cores, ~8% of a bf16
 * model's prefill step); the tail, and other processors, as written. */
/* (silu_mul16: cpu_vec.h) */

static inline void silu_mul_row(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
#if VEC_W == 16
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
    /* (e^-g capped at e^88: under -ffast-math the division may become a reciprocal and a Newton step,
     * which turn g / inf into NaN; a finite divisor gives silu's ~0 for large negative g) */
    for (; i < n; i++) o[i] = g[i] / (1.0f + expf(fminf(-g[i], 88.0f))) * u[i];
}

void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n);
}


/* The fused qkv projection [T, heads, D] (float32, or bfloat16 when in_bf16: a bf16 model's oneDNN
 * product) into float32 `out`, its first rot_heads heads (the queries' and the keys') rotated by
 * RoPE on interleaved pairs: (x0, x1) -> (x0 c - x1 s, x0 s + x1 c), with (c, s) = rot[t][i] for
 * pair i (model.apply_rope's complex product, in one pass: torch took a copy of the strided q and
 * k, a complex multiply and, for a bf16 product, a widening copy of the whole projection). */
void rope_qkv_f32(const void *qkv, int64_t in_bf16, const float *rot, float *out, int64_t T, int64_t rot_heads,
                  int64_t heads, int64_t D) {
#pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        const float *rt = rot + t * D; /* D / 2 pairs (c, s) */
        float row[heads * D];
        const float *src = (const float *)qkv + t * heads * D;
        if (in_bf16) {
            const uint16_t *b = (const uint16_t *)qkv + t * heads * D;
#pragma omp simd
            for (int64_t i = 0; i < heads * D; i++) row[i] = bf16_to_f32(b[i]);
            src = row;
        }
        float *dst = out + t * heads * D;
        for (int64_t h = 0; h < rot_heads; h++) {
            const float *x = src + h * D;
            float *y = dst + h * D;
#pragma omp simd
            for (int64_t i = 0; i < D / 2; i++) {
                const float x0 = x[2 * i], x1 = x[2 * i + 1], c = rt[2 * i], sn = rt[2 * i + 1];
                y[2 * i] = x0 * c - x1 * sn;
                y[2 * i + 1] = x0 * sn + x1 * c;
            }
        }
        memcpy(dst + rot_heads * D, src + rot_heads * D, sizeof(float) * (heads - rot_heads) * D);
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


/* a row of D float32 into bfloat16, as f32_to_bf16 rounds */
static inline void round_row_bf16(uint16_t *dst, const float *src, int64_t D) {
    int64_t d = 0;
#if VEC_W == 16
    for (; d + 16 <= D; d += 16) _mm256_storeu_si256((__m256i *)(dst + d), bf16_round16(_mm512_loadu_ps(src + d)));
#endif
    for (; d < D; d++) dst[d] = f32_to_bf16(src[d]);
}

static inline void write_kv_bf16_token(const float *k, const float *v, uint16_t *k_cache, uint16_t *v_cache,
                                       const int64_t *blocks, const int64_t *offsets, int64_t t, int64_t KVH,
                                       int64_t BS, int64_t D, int64_t k_stride, int64_t v_stride) {
    for (int64_t h = 0; h < KVH; h++) {
        const int64_t block = (blocks[t] * KVH + h) * BS * D;
        const float *kt = k + t * k_stride + h * D, *vt = v + t * v_stride + h * D;
        uint16_t *vc = v_cache + block + offsets[t] * D;
        for (int64_t d = 0; d < D; d++) k_cache[block + d * BS + offsets[t]] = f32_to_bf16(kt[d]);
        round_row_bf16(vc, vt, D);
    }
}

/* write_kv_f32 into a bfloat16 cache (--kv-cache-dtype bfloat16), each value rounded once (as
 * f32_to_bf16 rounds). With AVX-512, 16 tokens at a time where they fill 16 consecutive slots of one
 * block (a prefill chunk's tokens, but at a block's edges): each key dimension of the 16 gathered,
 * rounded and stored as one 32-byte row of the block's [D][BS] keys, the values 16 lanes at a time
 * (before: a scalar rounding and a scattered 2-byte store per key element, 18-21 ms of a 2,048-token
 * prefill's ~485 on 2 AMX Xeon cores). Other tokens one at a time. */
void write_kv_bf16(const float *k, const float *v, uint16_t *k_cache, uint16_t *v_cache, const int64_t *blocks,
                   const int64_t *offsets, int64_t T, int64_t KVH, int64_t BS, int64_t D, int64_t k_stride,
                   int64_t v_stride) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t g = 0; g < (T + 15) / 16; g++) {
        const int64_t t0 = g * 16, t1 = t0 + 16 < T ? t0 + 16 : T;
#if VEC_W == 16
        int run = t1 - t0 == 16 && 16 * k_stride < INT32_MAX;
        for (int64_t t = t0 + 1; run && t < t1; t++) run = blocks[t] == blocks[t0] && offsets[t] == offsets[t0] + (t - t0);
        if (run) {
            const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                    _mm512_set1_epi32((int)k_stride));
            for (int64_t h = 0; h < KVH; h++) {
                const int64_t block = (blocks[t0] * KVH + h) * BS * D;
                const float *kt = k + t0 * k_stride + h * D;
                for (int64_t d = 0; d < D; d++)
                    _mm256_storeu_si256((__m256i *)(k_cache + block + d * BS + offsets[t0]),
                                        bf16_round16(_mm512_i32gather_ps(rows, kt + d, 4)));
                for (int64_t t = t0; t < t1; t++)
                    round_row_bf16(v_cache + block + offsets[t] * D, v + t * v_stride + h * D, D);
            }
            continue;
        }
#endif
        for (int64_t t = t0; t < t1; t++)
            write_kv_bf16_token(k, v, k_cache, v_cache, blocks, offsets, t, KVH, BS, D, k_stride, v_stride);
    }
}

/* float32 (|x| <= 448) to fp8 e4m3 (e4m3fn: no infinities), rounded to nearest even as torch rounds:
 * a normal keeps its exponent (bias 7 for 127) and its top 3 mantissa bits, a carry going into the
 * exponent; below 2^-6 a subnormal, x 2^9 rounded (8 being the smallest normal). */
static inline uint8_t f32_to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    float a;
    memcpy(&a, &u, sizeof a);
    const uint32_t r = a < 0.015625f ? (uint32_t)rintf(a * 512.0f)
                                     : ((u + 0x7ffffu + ((u >> 20) & 1u)) >> 20) - (120u << 3);
    return sign | (uint8_t)r;
}

/* A row of D float32 quantized as kv_quant.quantize quantizes it with torch's ops, bit for bit: scale =
 * max(absmax, 1e-8) / qmax (127 for int8, 448 for fp8 e4m3), each value x / scale, then int8: rounded to
 * nearest even and clamped to +-127; fp8: clamped to +-448 and rounded to e4m3. The bytes to dst, step
 * apart (a key's dims go down its block's [D][BS] column). Compiled without reciprocal math: x / scale a
 * division, as torch's is, not x times a rounded 1 / scale. Returns the scale. */
__attribute__((optimize("no-reciprocal-math"))) static float quantize_row(uint8_t *dst, int64_t step,
                                                                         const float *x, int64_t D, int fp8) {
    float amax = 0.0f, q[D];
    for (int64_t d = 0; d < D; d++) {
        const float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    const float qmax = fp8 ? 448.0f : 127.0f, scale = (amax > 1e-8f ? amax : 1e-8f) / qmax;
    for (int64_t d = 0; d < D; d++) {
        const float r = fp8 ? x[d] / scale : rintf(x[d] / scale);
        q[d] = r > qmax ? qmax : r < -qmax ? -qmax : r;
    }
    if (fp8)
        for (int64_t d = 0; d < D; d++) dst[d * step] = f32_to_e4m3(q[d]);
    else
        for (int64_t d = 0; d < D; d++) dst[d * step] = (uint8_t)(int8_t)q[d];
    return scale;
}

/* write_kv_f32 into an int8 or fp8 cache (--kv-cache-dtype int8 or fp8; kv_quant.py's layout: each
 * (block, head) row of bytes holds the block's one-byte elements, keys transposed [D][BS] and values
 * [BS][D], then a float32 scale per slot): each token's key and value of each head quantized with a
 * scale of its own. */
static void write_kv_bytes(const float *k, const float *v, uint8_t *k_cache, uint8_t *v_cache, const int64_t *blocks,
                           const int64_t *offsets, int64_t T, int64_t KVH, int64_t BS, int64_t D, int64_t k_stride,
                           int64_t v_stride, int fp8) {
    const int64_t row = D * BS + 4 * BS;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < KVH; h++) {
            uint8_t *kr = k_cache + (blocks[t] * KVH + h) * row, *vr = v_cache + (blocks[t] * KVH + h) * row;
            ((float *)(kr + D * BS))[offsets[t]] = quantize_row(kr + offsets[t], BS, k + t * k_stride + h * D, D, fp8);
            ((float *)(vr + D * BS))[offsets[t]] =
                quantize_row(vr + offsets[t] * D, 1, v + t * v_stride + h * D, D, fp8);
        }
}
void write_kv_i8(const float *k, const float *v, uint8_t *k_cache, uint8_t *v_cache, const int64_t *blocks,
                 const int64_t *offsets, int64_t T, int64_t KVH, int64_t BS, int64_t D, int64_t k_stride,
                 int64_t v_stride) {
    write_kv_bytes(k, v, k_cache, v_cache, blocks, offsets, T, KVH, BS, D, k_stride, v_stride, 0);
}
void write_kv_f8(const float *k, const float *v, uint8_t *k_cache, uint8_t *v_cache, const int64_t *blocks,
                 const int64_t *offsets, int64_t T, int64_t KVH, int64_t BS, int64_t D, int64_t k_stride,
                 int64_t v_stride) {
    write_kv_bytes(k, v, k_cache, v_cache, blocks, offsets, T, KVH, BS, D, k_stride, v_stride, 1);
}

/* The two few-rows products, written once for each weight type: W_T is the weight's element
 * type and LOAD(v) widens one weight to float32 (the arithmetic is float32 either way).
 * bfloat16 weights are the upper half of a float32: half the bytes of W to stream. */
static inline float f32_to_f32(float v) { return v; }


/* silu_mul_f32 on a bfloat16 [rows, 2n] product (oneDNN's, a bf16 model's gate_up), the result
 * rounded to bfloat16 for the down projection: each row widened, multiplied as silu_mul_f32 does and
 * rounded as torch rounds, so it equals silu_mul_f32 of the widened product cast to bfloat16, bit for
 * bit, without the two float32 tensors between (on 2 AMX Xeon cores, 12 ms of a 512-token prefill's
 * ~210 ms went to those casts). */

void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *src = gate_up + r * 2 * n;
#if VEC_W == 16
        if (n % 16 == 0) { /* widened, multiplied and rounded 16 lanes at a time, as below */
            for (int64_t i = 0; i < n; i += 16)
                _mm256_storeu_si256((__m256i *)(out + r * n + i),
                                    bf16_round16(silu_mul16(vecf_load_bf16(src + i), vecf_load_bf16(src + n + i))));
            continue;
        }
#endif
        float row[2 * n], o[n];
        for (int64_t i = 0; i < 2 * n; i++) row[i] = bf16_to_f32(src[i]);
        silu_mul_row(row, row + n, o, n);
        uint16_t *dst = out + r * n;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(o[i]);
    }
}

/* y[m, n] = x[m, k] @ w[n, k]^T for a few rows (m small: decode batches, speculative
 * verification): a register tile of 4 rows of w by up to 4 rows of x, w's 4 rows read once from
 * memory and again from L1 for each further 4 rows of x, while the tile 2 ahead is prefetched.
 * Streaming a model's weights (SmolLM2's 30 layers, 424 MB, 2 cores of a Xeon), 8 rows took 21 ms
 * this way against 29 with one row of w at a time and no prefetch, and 32 through oneDNN (padded
 * to 16 rows, its smallest bucket: model.Linear.padded_rows). One row (single-request decode)
 * goes this way too: 16 ms, bfloat16 weights 10 ms, where a gemv of its own took 16 and 14.5. */
#define GW VEC_W
typedef vecf gvec;
#define GEMM_PREFETCH_TILES 2

static inline gvec load_f32(const float *p) { return vecf_load(p); }

static inline float hsum(gvec v) {
#if GW == 16
    typedef float h8 __attribute__((vector_size(32)));
    typedef float h4 __attribute__((vector_size(16)));
    h8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    h4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif GW == 8
    typedef float h4 __attribute__((vector_size(16)));
    h4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
    gvec b = v;
#endif
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* One tile: rows i..i+3 of w (wi) by MR rows of x from row r (xr); prefetch: the first pass over
 * these rows of w (later passes find them in L1). */
#define GEMM_TILE(W_T, VLOAD, SLOAD, MR)                                                               \
    do {                                                                                               \
        gvec acc[4][MR];                                                                               \
        for (int a = 0; a < 4; a++)                                                                    \
            for (int b = 0; b < MR; b++) acc[a][b] = (gvec){0};                                        \
        int64_t j = 0;                                                                                 \
        for (; j + GW <= k; j += GW) {                                                                 \
            if (prefetch) {                                                                            \
                const W_T *ahead = wi + GEMM_PREFETCH_TILES * 4 * k + j;                               \
                for (int a = 0; a < 4; a++) __builtin_prefetch(ahead + a * k);                         \
            }                                                                                          \
            const gvec w0 = VLOAD(wi + j), w1 = VLOAD(wi + k + j), w2 = VLOAD(wi + 2 * k + j),          \
                       w3 = VLOAD(wi + 3 * k + j);                                                     \
            for (int b = 0; b < MR; b++) {                                                             \
                const gvec xv = load_f32(xr + b * k + j);                                              \
                acc[0][b] += w0 * xv;                                                                  \
                acc[1][b] += w1 * xv;                                                                  \
                acc[2][b] += w2 * xv;                                                                  \
                acc[3][b] += w3 * xv;                                                                  \
            }                                                                                          \
        }                                                                                              \
        for (int b = 0; b < MR; b++)                                                                   \
            for (int a = 0; a < 4; a++) {                                                              \
                float sum = hsum(acc[a][b]);                                                           \
                for (int64_t t = j; t < k; t++) sum += SLOAD(wi[a * k + t]) * xr[b * k + t];           \
                y[(r + b) * n + i + a] = sum;                                                          \
            }                                                                                          \
    } while (0)

#define DEFINE_GEMM_ROWS(NAME, W_T, VLOAD, SLOAD)                                                       \
    void NAME(const W_T *restrict w, const float *restrict x, float *restrict y, int64_t n, int64_t k,  \
              int64_t m) {                                                                             \
        _Pragma("omp parallel for schedule(static)") for (int64_t tile = 0; tile < n / 4; tile++) {    \
            const int64_t i = tile * 4;                                                                \
            const W_T *wi = w + i * k;                                                                 \
            int64_t r = 0;                                                                             \
            for (; r + 4 <= m; r += 4) {                                                               \
                const float *xr = x + r * k;                                                           \
                const int prefetch = r == 0;                                                           \
                GEMM_TILE(W_T, VLOAD, SLOAD, 4);                                                       \
            }                                                                                          \
            const float *xr = x + r * k;                                                               \
            const int prefetch = r == 0;                                                               \
            if (m - r == 3)                                                                            \
                GEMM_TILE(W_T, VLOAD, SLOAD, 3);                                                       \
            else if (m - r == 2)                                                                       \
                GEMM_TILE(W_T, VLOAD, SLOAD, 2);                                                       \
            else if (m - r == 1)                                                                       \
                GEMM_TILE(W_T, VLOAD, SLOAD, 1);                                                       \
        }                                                                                              \
        for (int64_t i = n / 4 * 4; i < n; i++) /* the last rows of w, fewer than a tile */             \
            for (int64_t r = 0; r < m; r++) {                                                          \
                float sum = 0.0f;                                                                      \
                for (int64_t t = 0; t < k; t++) sum += SLOAD(w[i * k + t]) * x[r * k + t];              \
                y[r * n + i] = sum;                                                                    \
            }                                                                                          \
    }

DEFINE_GEMM_ROWS(gemm_rows_f32, float, load_f32, f32_to_f32)
DEFINE_GEMM_ROWS(gemm_rows_bf16_f32, uint16_t, vecf_load_bf16, bf16_to_f32)
