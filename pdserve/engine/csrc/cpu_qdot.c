/* Few-rows matmuls in integer dot products (AVX-512 VNNI), as llama.cpp multiplies its 4- and
 * 8-bit blocks: each row of x is rounded to int8 once per call, one scale per 32 inputs
 * (qdot_quantize_rows), and the weights' small integers are multiplied by those with vpdpbusd
 * (64 byte products a instruction), so no weight is widened to float. The scales are applied once
 * per block of 32 products. Used by quant/formats.Int4Linear and the Q8_0 output head
 * (quant/gguf_native.GGUFLinear) for decode steps; x's rounding to 8 bits is the only change to the
 * numbers against the dequantised weight (relative error ~ 2^-8 per block of x).
 *
 * Weights are laid out in tiles of 16 output rows (one per int32 lane), block by block; per tile
 * and block of 32 inputs:
 *   4-bit: 8 steps x 32 bytes: byte 4j+i of step s holds q[row j][4s+i] (low nibble) and
 *          q[row j+8][4s+i] (high nibble), j < 8, i < 4; then 16 float16 d and 16 float16 m:
 *          w = d * q + m, q in 0..15 (4.625 bits a weight, as tinygemm's int4 or a Q4_1 file)
 *   8-bit: 8 steps x 64 bytes: byte 4j+i of step s holds q[row j][4s+i] + 128, j < 16; then 16
 *          float16 d: w = d * q, q in -127..127 (Q8_0's 8.5 bits)
 * (qdot.py packs both from plain integers.) A step is four inputs of every row of the tile: one
 * vpdpbusd per row of x adds them into its 16 lanes. Threads split the tiles; y has row stride ldy.
 * Without VNNI the gemms return 1 and qdot_available() 0: the callers keep their other kernels.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32    /* inputs a block */
#define TILE 16  /* output rows a tile */
#define MR 4     /* rows of x per pass over a tile */

/* x [m, k] float32 -> per row and block b, in two int8 parts: x = dx[b] * (qx + lx / 254) up to
 * dx / 508, qx = rint(x / dx) with dx[b] = max|x| / 127 (llama.cpp's Q8 activations) and lx the
 * rounded rest (|x - dx qx| <= dx / 2). So x keeps ~15 bits (one int8 alone lost weight-only int4's
 * accuracy: perplexity 20.01 -> 20.24 on SmolLM2), for a second vpdpbusd a step. xs[b] = the block's
 * float sum (the 4-bit m term); qs, ls = the int8 sums (the 8-bit offset). qx and lx: [m, 2, k]. */
static __attribute__((unused)) void qdot_quantize_rows(const float *restrict x, int8_t *restrict qx, float *restrict dx,
                                                      float *restrict xs, int32_t *restrict qs, int64_t m, int64_t k) {
    const int64_t nb = k / QK;
    _Pragma("omp parallel for schedule(static) if (m > 16)") for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * k + b * QK;
            float amax = 0.0f, sum = 0.0f;
            for (int t = 0; t < QK; t++) {
                amax = fmaxf(amax, fabsf(xb[t]));
                sum += xb[t];
            }
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t hsum = 0, lsum = 0;
            int8_t *hi = qx + 2 * r * k + b * QK, *lo = hi + k;
            for (int t = 0; t < QK; t++) {
                const float scaled = xb[t] * inv, h = rintf(scaled);
                hi[t] = (int8_t)h;
                lo[t] = (int8_t)rintf((scaled - h) * 254.0f);
                hsum += hi[t];
                lsum += lo[t];
            }
            dx[r * nb + b] = d;
            xs[r * nb + b] = sum;
            qs[2 * (r * nb + b)] = hsum;
            qs[2 * (r * nb + b) + 1] = lsum;
        }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

int qdot_available(void) { return 1; }

#define Q4_TILE_BYTES (8 * 32 + 2 * TILE * 2)
#define Q8_TILE_BYTES (8 * 64 + TILE * 2)

static inline __attribute__((always_inline)) void q4_pass(const uint8_t *tile, int64_t nb, const int8_t *qx, int64_t k,
                                                         const float *dx, const float *xs, float *y, int64_t ldy,
                                                         const int MRC) {
    const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0), low = _mm512_set1_epi8(0x0F);
    const __m512 rest = _mm512_set1_ps(1.0f / 254.0f);
    __m512 acc[MR];
    for (int r = 0; r < MRC; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = tile + b * Q4_TILE_BYTES;
        __m512i s[MR], l[MR];
        for (int r = 0; r < MRC; r++) s[r] = l[r] = _mm512_setzero_si512();
        for (int st = 0; st < 8; st++) {
            __m512i w = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 32 * st)));
            w = _mm512_and_si512(_mm512_srlv_epi64(w, shift), low);
            for (int r = 0; r < MRC; r++) {
                int32_t four[2];
                memcpy(&four[0], qx + 2 * r * k + b * QK + 4 * st, 4);
                memcpy(&four[1], qx + (2 * r + 1) * k + b * QK + 4 * st, 4);
                s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(four[0]));
                l[r] = _mm512_dpbusd_epi32(l[r], w, _mm512_set1_epi32(four[1]));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256))),
                     mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256 + 32)));
        for (int r = 0; r < MRC; r++) {
            const int64_t nbr = r * nb + b;
            const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l[r]), rest, _mm512_cvtepi32_ps(s[r]));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx[nbr])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[nbr]), acc[r]);
        }
    }
    for (int r = 0; r < MRC; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

static inline __attribute__((always_inline)) void q8_pass(const uint8_t *tile, int64_t nb, const int8_t *qx, int64_t k,
                                                         const float *dx, const int32_t *qs, float *y, int64_t ldy,
                                                         const int MRC) {
    __m512 acc[MR];
    for (int r = 0; r < MRC; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = tile + b * Q8_TILE_BYTES;
        __m512i s[MR], l[MR];
        for (int r = 0; r < MRC; r++) { /* less the +128 of every weight */
            s[r] = _mm512_set1_epi32(-128 * qs[2 * (r * nb + b)]);
            l[r] = _mm512_set1_epi32(-128 * qs[2 * (r * nb + b) + 1]);
        }
        for (int st = 0; st < 8; st++) {
            const __m512i w = _mm512_loadu_si512((const void *)(p + 64 * st));
            for (int r = 0; r < MRC; r++) {
                int32_t four[2];
                memcpy(&four[0], qx + 2 * r * k + b * QK + 4 * st, 4);
                memcpy(&four[1], qx + (2 * r + 1) * k + b * QK + 4 * st, 4);
                s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(four[0]));
                l[r] = _mm512_dpbusd_epi32(l[r], w, _mm512_set1_epi32(four[1]));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 512))),
                     rest = _mm512_set1_ps(1.0f / 254.0f);
        for (int r = 0; r < MRC; r++) {
            const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l[r]), rest, _mm512_cvtepi32_ps(s[r]));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
        }
    }
    for (int r = 0; r < MRC; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* y[r, i] = sum_j W[i, j] x[r, j] for float32 x [m, k], rounded here by qdot_quantize_rows;
 * n a multiple of 16, k of 32. Returns 1 when its scratch could not be allocated. */
#define DEFINE_GEMM(NAME, PASS, TILE_BYTES, EXTRA, PER) /* PER: EXTRA's values a block */                                                  \
    int NAME(const uint8_t *restrict w, const float *restrict x, float *restrict y, int64_t n, int64_t k,     \
             int64_t m, int64_t ldy) {                                                              \
        const int64_t nb = k / QK;                                                                  \
        char *scratch = malloc((size_t)(2 * m * k + 4 * m * nb * 4));                               \
        if (scratch == NULL) return 1;                                                              \
        int8_t *qx = (int8_t *)scratch;                                                             \
        float *dx = (float *)(scratch + 2 * m * k), *xs = dx + m * nb;                              \
        int32_t *qs = (int32_t *)(xs + m * nb);                                                     \
        qdot_quantize_rows(x, qx, dx, xs, qs, m, k);                                                \
        _Pragma("omp parallel for schedule(static)") for (int64_t t = 0; t < n / TILE; t++) {       \
            const uint8_t *tile = w + t * nb * (TILE_BYTES);                                       \
            int64_t r0 = 0;                                                                         \
            for (; r0 + MR <= m; r0 += MR)                                                          \
                PASS(tile, nb, qx + 2 * r0 * k, k, dx + r0 * nb, EXTRA + r0 * nb * PER, y + r0 * ldy + t * TILE, ldy, MR); \
            switch (m - r0) {                                                                       \
            case 3: PASS(tile, nb, qx + 2 * r0 * k, k, dx + r0 * nb, EXTRA + r0 * nb * PER, y + r0 * ldy + t * TILE, ldy, 3); break; \
            case 2: PASS(tile, nb, qx + 2 * r0 * k, k, dx + r0 * nb, EXTRA + r0 * nb * PER, y + r0 * ldy + t * TILE, ldy, 2); break; \
            case 1: PASS(tile, nb, qx + 2 * r0 * k, k, dx + r0 * nb, EXTRA + r0 * nb * PER, y + r0 * ldy + t * TILE, ldy, 1); break; \
            }                                                                                       \
        }                                                                                           \
        free(scratch);                                                                              \
        return 0;                                                                                   \
    }

DEFINE_GEMM(qdot_gemm_q4, q4_pass, Q4_TILE_BYTES, xs, 1)
DEFINE_GEMM(qdot_gemm_q8, q8_pass, Q8_TILE_BYTES, qs, 2)

#else /* no VNNI */

int qdot_available(void) { return 0; }
int qdot_gemm_q4(const uint8_t *w, const float *x, float *y, int64_t n, int64_t k, int64_t m, int64_t ldy) {
    (void)w, (void)x, (void)y, (void)n, (void)k, (void)m, (void)ldy;
    return 1;
}
int qdot_gemm_q8(const uint8_t *w, const float *x, float *y, int64_t n, int64_t k, int64_t m, int64_t ldy) {
    (void)w, (void)x, (void)y, (void)n, (void)k, (void)m, (void)ldy;
    return 1;
}

#endif
