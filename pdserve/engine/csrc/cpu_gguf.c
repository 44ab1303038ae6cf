/* Few-rows matmuls straight from a GGUF file's quantized blocks (quant/gguf_native.py):
 * y[r, i] = sum_j W[i, j] x[r, j] for r < m (decode: one row per request), W's row i a run of
 * 32-weight blocks as the file stores them, read once per call and used for every row of x.
 *
 *   Q8_0: d (f16) | 32 x int8                     w = d * q
 *   Q4_0: d (f16) | 16 bytes: w[t] low nibble, w[t+16] high      w = d * (q - 8)
 *   Q4_1: d (f16) | m (f16) | 16 bytes, as Q4_0                   w = d * q + m
 *
 * Each block's 32 weights are expanded to float once (gguf_native's dequantisation, up to the
 * rounding of a fused d * q + m) and multiplied into 32-lane accumulators per row of x, summed
 * across lanes once per output; x stays float32 (not quantised to int8 as llama.cpp does), so the
 * result is the float path's on the dequantised weight up to summation order. Threads split W's
 * rows. y has row stride ldy, so a fused projection's segments (each its own type) write their
 * columns of one output. Where cpu_qdot.c can take a segment (AVX2 or AVX-512 VNNI, rows a multiple
 * of 16) GGUFLinear moves it there instead: these kernels serve the rest. */
#include <stdint.h>
#include <string.h>

#define QK 32  /* weights a block */
#define MR 4   /* rows of x per pass over a block row */

#if defined(__F16C__)
#include <immintrin.h>
static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h); /* one instruction (vcvtph2ps) */
}
#else
static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, em = h & 0x7fff, bits;
    float f;
    if (em >= 0x7c00) { /* inf / nan */
        bits = sign | 0x7f800000 | ((em & 0x3ff) << 13);
    } else if (em >= 0x0400) { /* normal: exponent rebiased from 15 to 127 */
        bits = sign | ((em << 13) + 0x38000000);
    } else { /* zero or subnormal: em * 2^-24 exactly */
        f = (float)em * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* expand(blk, w): a block's 32 weights as float, in VW-lane vectors w[0 .. 32 / VW). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
typedef __m512 vec;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VZERO() _mm512_setzero_ps()
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUM(v) _mm512_reduce_add_ps(v)
static inline void expand_q8_0(const uint8_t *blk, vec *w) {
    const __m512 d = _mm512_set1_ps(f16_to_f32(blk));
    const __m128i *q = (const __m128i *)(blk + 2);
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
}
static inline void nibbles(const uint8_t *q, __m512 *lo, __m512 *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(15);
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}
static inline void expand_q4_0(const uint8_t *blk, vec *w) {
    const float d = f16_to_f32(blk);
    const __m512 vd = _mm512_set1_ps(d), off = _mm512_set1_ps(-8.0f * d);
    nibbles(blk + 2, &w[0], &w[1]);
    w[0] = _mm512_fmadd_ps(w[0], vd, off);
    w[1] = _mm512_fmadd_ps(w[1], vd, off);
}
static inline void expand_q4_1(const uint8_t *blk, vec *w) {
    const __m512 d = _mm512_set1_ps(f16_to_f32(blk)), mn = _mm512_set1_ps(f16_to_f32(blk + 2));
    nibbles(blk + 4, &w[0], &w[1]);
    w[0] = _mm512_fmadd_ps(w[0], d, mn);
    w[1] = _mm512_fmadd_ps(w[1], d, mn);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
typedef __m256 vec;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VZERO() _mm256_setzero_ps()
#define VADD(a, b) _mm256_add_ps(a, b)
static inline float VSUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline __m256 bytes8(__m128i b) { /* the low 8 bytes of b, unsigned, as float */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}
static inline void expand_q8_0(const uint8_t *blk, vec *w) {
    const __m256 d = _mm256_set1_ps(f16_to_f32(blk));
    for (int j = 0; j < 4; j++)
        w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * j)))), d);
}
static inline void nibbles(const uint8_t *q, __m256 *w) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    w[0] = bytes8(lo);
    w[1] = bytes8(_mm_unpackhi_epi64(lo, lo));
    w[2] = bytes8(hi);
    w[3] = bytes8(_mm_unpackhi_epi64(hi, hi));
}
static inline void expand_q4_0(const uint8_t *blk, vec *w) {
    const float d = f16_to_f32(blk);
    const __m256 vd = _mm256_set1_ps(d), off = _mm256_set1_ps(-8.0f * d);
    nibbles(blk + 2, w);
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(w[j], vd, off);
}
static inline void expand_q4_1(const uint8_t *blk, vec *w) {
    const __m256 d = _mm256_set1_ps(f16_to_f32(blk)), mn = _mm256_set1_ps(f16_to_f32(blk + 2));
    nibbles(blk + 4, w);
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(w[j], d, mn);
}
#else /* portable: one "vector" of 32 lanes the compiler vectorises as it can */
#define VW 32
typedef struct { float v[32]; } vec;
static inline vec VLOAD(const float *p) { vec r; memcpy(r.v, p, sizeof r.v); return r; }
static inline vec VFMA(vec a, vec b, vec c) { for (int t = 0; t < 32; t++) c.v[t] += a.v[t] * b.v[t]; return c; }
static inline vec VZERO(void) { vec r; memset(&r, 0, sizeof r); return r; }
static inline vec VADD(vec a, vec b) { for (int t = 0; t < 32; t++) a.v[t] += b.v[t]; return a; }
static inline float VSUM(vec a) { float s = 0.0f; for (int t = 0; t < 32; t++) s += a.v[t]; return s; }
static inline void expand_q8_0(const uint8_t *blk, vec *w) {
    const float d = f16_to_f32(blk);
    for (int t = 0; t < QK; t++) w->v[t] = d * (float)((const int8_t *)(blk + 2))[t];
}
static inline void expand_q4_0(const uint8_t *blk, vec *w) {
    const float d = f16_to_f32(blk);
    for (int t = 0; t < QK / 2; t++) {
        w->v[t] = d * (float)((int)(blk[2 + t] & 15) - 8);
        w->v[t + QK / 2] = d * (float)((int)(blk[2 + t] >> 4) - 8);
    }
}
static inline void expand_q4_1(const uint8_t *blk, vec *w) {
    const float d = f16_to_f32(blk), mn = f16_to_f32(blk + 2);
    for (int t = 0; t < QK / 2; t++) {
        w->v[t] = d * (float)(blk[4 + t] & 15) + mn;
        w->v[t + QK / 2] = d * (float)(blk[4 + t] >> 4) + mn;
    }
}
#endif

#define NV (QK / VW) /* vectors a block */

/* MRC (a constant after inlining) rows of x against output row i of W. */
#define DEFINE_PASS(TYPE, BLOCK_BYTES)                                                            \
    static inline __attribute__((always_inline)) void pass_##TYPE(                              \
        const uint8_t *row, int64_t nb, const float *x, int64_t k, float *y, int64_t ldy, const int MRC) { \
        vec acc[MR][NV];                                                                          \
        for (int r = 0; r < MRC; r++)                                                             \
            for (int j = 0; j < NV; j++) acc[r][j] = VZERO();                                     \
        for (int64_t b = 0; b < nb; b++) {                                                        \
            vec w[NV];                                                                            \
            expand_##TYPE(row + b * (BLOCK_BYTES), w);                                            \
            for (int r = 0; r < MRC; r++)                                                         \
                for (int j = 0; j < NV; j++) acc[r][j] = VFMA(w[j], VLOAD(x + r * k + b * QK + j * VW), acc[r][j]); \
        }                                                                                         \
        for (int r = 0; r < MRC; r++) {                                                           \
            vec s = acc[r][0];                                                                    \
            for (int j = 1; j < NV; j++) s = VADD(s, acc[r][j]);                        \
            y[r * ldy] = VSUM(s);                                                                 \
        }                                                                                         \
    }                                                                                             \
    void gguf_gemm_##TYPE(const uint8_t *restrict blocks, const float *restrict x, float *restrict y, \
                          int64_t n, int64_t k, int64_t m, int64_t ldy) {                         \
        const int64_t nb = k / QK, row_bytes = nb * (BLOCK_BYTES);                                \
        _Pragma("omp parallel for schedule(static)") for (int64_t i = 0; i < n; i++) {            \
            const uint8_t *row = blocks + i * row_bytes;                                          \
            int64_t r0 = 0;                                                                       \
            for (; r0 + MR <= m; r0 += MR) pass_##TYPE(row, nb, x + r0 * k, k, y + r0 * ldy + i, ldy, MR); \
            switch (m - r0) {                                                                     \
            case 3: pass_##TYPE(row, nb, x + r0 * k, k, y + r0 * ldy + i, ldy, 3); break;        \
            case 2: pass_##TYPE(row, nb, x + r0 * k, k, y + r0 * ldy + i, ldy, 2); break;        \
            case 1: pass_##TYPE(row, nb, x + r0 * k, k, y + r0 * ldy + i, ldy, 1); break;        \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_PASS(q8_0, 34)
DEFINE_PASS(q4_0, 18)
DEFINE_PASS(q4_1, 20)
