/* Matmuls of up to a few hundred rows in integer dot products (AVX-512 VNNI), as llama.cpp
 * multiplies its 4- and 8-bit blocks: each row of x is split once per call into two int8 parts per
 * 32 inputs (qdot_quantize_rows: x = dx (q + l / 254), ~15 bits), the weights' small integers are
 * multiplied by both with vpdpbusd (64 byte products an instruction), so no weight is widened to
 * float, and the scales are applied once per block of 32 products. Used by quant/formats'
 * Int4Linear and Int8Linear and the Q8_0 output head (quant/gguf_native.GGUFLinear); against the
 * dequantised weight's float product the results differ by x's rounding (relative ~1e-5).
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
 * AVX2 without VNNI: the same tiles through vpmaddubsw (see there). Without AVX2 the gemms return 1
 * and qdot_available() 0: the callers keep their other kernels.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32    /* inputs a block */
#define TILE 16  /* output rows a tile */
#define Q4_TILE_BYTES (8 * 32 + 2 * TILE * 2)
#define Q8_TILE_BYTES (8 * 64 + TILE * 2)

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

/* A decode step reads every layer's weights once, from memory: the model does not stay in cache
 * (SmolLM2's int4 layers and Q8_0 head are 92 MiB). Each block asks for the bytes PF_AHEAD further
 * on, so loads past a page boundary, where the hardware's stream prefetch starts over, find them on
 * their way (a thread's tiles are contiguous; past its last one the requests are harmless), and each
 * thread first asks for its first PF_AHEAD bytes. Into every cache level (PF_HINT 3: the
 * non-temporal hint, 0, was 2-3x slower); 2 KiB measured best of 0.5-4 KiB on a Xeon, native and
 * AVX2 (README, Quantization). -DPF_AHEAD=0 builds without. */
#ifndef PF_AHEAD
#define PF_AHEAD 2048
#endif
#ifndef PF_HINT
#define PF_HINT 3
#endif
static inline __attribute__((always_inline)) void prefetch_range(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, PF_HINT);
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
        _Pragma("omp parallel") {                                                                   \
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();                   \
        const int64_t t0 = n / TILE * id / threads, t1 = n / TILE * (id + 1) / threads;             \
        if (t0 < t1) /* the first PF_AHEAD bytes: what the blocks' own requests do not cover */     \
            prefetch_range(w + t0 * nb * (TILE_BYTES), PF_AHEAD);                                   \
        for (int64_t t = t0; t < t1; t++) {                                                         \
            const uint8_t *tile = w + t * nb * (TILE_BYTES);                                       \
            int64_t r0 = 0;                                                                         \
            for (; r0 + MR <= m; r0 += MR)                                                          \
                PASS(tile, nb, qx + 2 * r0 * k, k, dx + r0 * nb, EXTRA + r0 * nb * PER, y + r0 * ldy + t * TILE, ldy, MR); \
            switch (m - r0) { /* (MR - 1 rows at most) */                                         \
            case 3: PASS(tile, nb, qx + 2 * r0 * k, k, dx + r0 * nb, EXTRA + r0 * nb * PER, y + r0 * ldy + t * TILE, ldy, 3 % MR); break; \
            case 2: PASS(tile, nb, qx + 2 * r0 * k, k, dx + r0 * nb, EXTRA + r0 * nb * PER, y + r0 * ldy + t * TILE, ldy, 2 % MR); break; \
            case 1: PASS(tile, nb, qx + 2 * r0 * k, k, dx + r0 * nb, EXTRA + r0 * nb * PER, y + r0 * ldy + t * TILE, ldy, 1); break; \
            }                                                                                       \
        }                                                                                           \
        }                                                                                           \
        free(scratch);                                                                              \
        return 0;                                                                                   \
    }



#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#define QDOT_KINDS 3 /* 4- and 8-bit */
#define MR 4         /* rows of x per pass over a tile */

/* One step: the 64 weight bytes w (four inputs of the tile's 16 rows) times those inputs of the MRC
 * rows of x, both parts: s += w . q, l += w . l (x's rows in qx as [row][2][k], from input at). */
static inline __attribute__((always_inline)) void dot_step(__m512i *s, __m512i *l, __m512i w, const int8_t *qx,
                                                          int64_t k, int64_t at, const int MRC) {
    for (int r = 0; r < MRC; r++) {
        int32_t four[2];
        memcpy(&four[0], qx + 2 * r * k + at, 4);
        memcpy(&four[1], qx + (2 * r + 1) * k + at, 4);
        s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(four[0]));
        l[r] = _mm512_dpbusd_epi32(l[r], w, _mm512_set1_epi32(four[1]));
    }
}

static inline __attribute__((always_inline)) void q4_pass(const uint8_t *tile, int64_t nb, const int8_t *qx, int64_t k,
                                                         const float *dx, const float *xs, float *y, int64_t ldy,
                                                         const int MRC) {
    const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0), low = _mm512_set1_epi8(0x0F);
    const __m512 rest = _mm512_set1_ps(1.0f / 254.0f);
    __m512 acc[MR];
    for (int r = 0; r < MRC; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = tile + b * Q4_TILE_BYTES;
        if (PF_AHEAD) prefetch_range(p + PF_AHEAD, Q4_TILE_BYTES);
        __m512i s[MR], l[MR];
        for (int r = 0; r < MRC; r++) s[r] = l[r] = _mm512_setzero_si512();
        for (int st = 0; st < 8; st++) {
            __m512i w = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 32 * st)));
            w = _mm512_and_si512(_mm512_srlv_epi64(w, shift), low);
            dot_step(s, l, w, qx, k, b * QK + 4 * st, MRC);
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
        if (PF_AHEAD) prefetch_range(p + PF_AHEAD, Q8_TILE_BYTES);
        __m512i s[MR], l[MR];
        for (int r = 0; r < MRC; r++) { /* less the +128 of every weight */
            s[r] = _mm512_set1_epi32(-128 * qs[2 * (r * nb + b)]);
            l[r] = _mm512_set1_epi32(-128 * qs[2 * (r * nb + b) + 1]);
        }
        for (int st = 0; st < 8; st++) {
            const __m512i w = _mm512_loadu_si512((const void *)(p + 64 * st));
            dot_step(s, l, w, qx, k, b * QK + 4 * st, MRC);
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

DEFINE_GEMM(qdot_gemm_q4, q4_pass, Q4_TILE_BYTES, xs, 1)
DEFINE_GEMM(qdot_gemm_q8, q8_pass, Q8_TILE_BYTES, qs, 2)

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 has no byte dot product with a 32-bit sum: vpmaddubsw adds pairs of (unsigned x signed) byte
 * products into 16 bits. 4-bit: 15 * 127 * 2 a pair at most, so eight steps still fit and vpmaddwd
 * sums them once a block. 8-bit: the weights made signed again (xor 0x80), |w| times x with w's
 * sign (llama.cpp's trick: 127 * 127 * 2 fits), vpmaddwd every step. A tile's 16 rows are two
 * 8-lane halves (4-bit: the low nibbles, rows 0-7, and the high; 8-bit: the step's two 32 bytes). */
#include <immintrin.h>

#define QDOT_KINDS 3 /* 4- and 8-bit */
#define MR 2         /* rows of x per pass (16 registers) */

static inline __attribute__((always_inline)) void q4_pass(const uint8_t *tile, int64_t nb, const int8_t *qx, int64_t k,
                                                         const float *dx, const float *xs, float *y, int64_t ldy,
                                                         const int MRC) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256 rest = _mm256_set1_ps(1.0f / 254.0f);
    __m256 acc[MR][2];
    for (int r = 0; r < MRC; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = tile + b * Q4_TILE_BYTES;
        if (PF_AHEAD) prefetch_range(p + PF_AHEAD, Q4_TILE_BYTES);
        __m256i s[MR][2], l[MR][2];
        for (int r = 0; r < MRC; r++) s[r][0] = s[r][1] = l[r][0] = l[r][1] = _mm256_setzero_si256();
        for (int st = 0; st < 8; st++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(p + 32 * st));
            const __m256i w0 = _mm256_and_si256(packed, low), w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            for (int r = 0; r < MRC; r++) {
                int32_t four[2];
                memcpy(&four[0], qx + 2 * r * k + b * QK + 4 * st, 4);
                memcpy(&four[1], qx + (2 * r + 1) * k + b * QK + 4 * st, 4);
                const __m256i xh = _mm256_set1_epi32(four[0]), xl = _mm256_set1_epi32(four[1]);
                s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(w0, xh));
                s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(w1, xh));
                l[r][0] = _mm256_add_epi16(l[r][0], _mm256_maddubs_epi16(w0, xl));
                l[r][1] = _mm256_add_epi16(l[r][1], _mm256_maddubs_epi16(w1, xl));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256 + 16 * h))),
                         mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 288 + 16 * h)));
            for (int r = 0; r < MRC; r++) {
                const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(l[r][h], ones)), rest,
                                                   _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h], ones)));
                acc[r][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[r * nb + b]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < MRC; r++) {
        _mm256_storeu_ps(y + r * ldy, acc[r][0]);
        _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    }
}

static inline __attribute__((always_inline)) void q8_pass(const uint8_t *tile, int64_t nb, const int8_t *qx, int64_t k,
                                                         const float *dx, const int32_t *qs, float *y, int64_t ldy,
                                                         const int MRC) {
    (void)qs; /* (the +128 is undone on the weights) */
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const __m256 rest = _mm256_set1_ps(1.0f / 254.0f);
    __m256 acc[MR][2];
    for (int r = 0; r < MRC; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = tile + b * Q8_TILE_BYTES;
        if (PF_AHEAD) prefetch_range(p + PF_AHEAD, Q8_TILE_BYTES);
        __m256i s[MR][2], l[MR][2];
        for (int r = 0; r < MRC; r++) s[r][0] = s[r][1] = l[r][0] = l[r][1] = _mm256_setzero_si256();
        for (int st = 0; st < 8; st++)
            for (int h = 0; h < 2; h++) {
                const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 64 * st + 32 * h)), flip);
                const __m256i wa = _mm256_abs_epi8(w);
                for (int r = 0; r < MRC; r++) {
                    int32_t four[2];
                    memcpy(&four[0], qx + 2 * r * k + b * QK + 4 * st, 4);
                    memcpy(&four[1], qx + (2 * r + 1) * k + b * QK + 4 * st, 4);
                    const __m256i xh = _mm256_sign_epi8(_mm256_set1_epi32(four[0]), w),
                                  xl = _mm256_sign_epi8(_mm256_set1_epi32(four[1]), w);
                    s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xh), ones));
                    l[r][h] = _mm256_add_epi32(l[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xl), ones));
                }
            }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 512 + 16 * h)));
            for (int r = 0; r < MRC; r++) {
                const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l[r][h]), rest, _mm256_cvtepi32_ps(s[r][h]));
                acc[r][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < MRC; r++) {
        _mm256_storeu_ps(y + r * ldy, acc[r][0]);
        _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    }
}

DEFINE_GEMM(qdot_gemm_q4, q4_pass, Q4_TILE_BYTES, xs, 1)
DEFINE_GEMM(qdot_gemm_q8, q8_pass, Q8_TILE_BYTES, qs, 2)

#else /* no AVX2 */

#define QDOT_KINDS 0
int qdot_gemm_q4(const uint8_t *w, const float *x, float *y, int64_t n, int64_t k, int64_t m, int64_t ldy) {
    (void)w, (void)x, (void)y, (void)n, (void)k, (void)m, (void)ldy;
    return 1;
}
int qdot_gemm_q8(const uint8_t *w, const float *x, float *y, int64_t n, int64_t k, int64_t m, int64_t ldy) {
    (void)w, (void)x, (void)y, (void)n, (void)k, (void)m, (void)ldy;
    return 1;
}

#endif

/* Which weights these kernels multiply here: 1 for 4-bit, 2 for 8-bit (bits of the answer; both
 * wherever there are kernels, kept apart for a build that has one). */
int qdot_available(void) { return QDOT_KINDS; }
