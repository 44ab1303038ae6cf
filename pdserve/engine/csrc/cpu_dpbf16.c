/* Projections of a few rows with bfloat16 dot products (vdpbf16ps: processors with avx512_bf16 and no AMX
 * tiles, such as AMD's Zen 4): y = x W^T for a bf16 model's decode steps, past the rows the widening
 * few-rows kernel takes (cpu_kernels.c) and up to where oneDNN's bf16 matmul overtakes (measured per
 * machine, cpu_measured.dp_rows_for). oneDNN's kernels read the weights at ~17 GB/s at 8 rows on 2 Zen 4
 * cores, where the memory gives ~29; this streams them once per call.
 *
 * W is packed as amx_pack_bf16 packs it for AMX's B tiles (cpu_amx.c): a 16-column block of W is K / 2
 * vectors of 64 bytes in a row, vector p holding the 16 columns' elements 2p and 2p + 1 (a pair per
 * 32-bit lane), which is what vdpbf16ps multiplies by a row of x's pair p broadcast to every lane:
 *
 *      block nb:  [ pair 0: n0 (k0 k1) n1 (k0 k1) ... n15 (k0 k1) ][ pair 1: n0 (k2 k3) ... ] ...
 *      x row r:   [ (k0 k1) (k2 k3) ... ]  -> lane j of acc[r] += x[r][2p] W[n0 + j][2p] + x[r][2p+1] W[n0 + j][2p+1]
 *
 * so no lane sum is left at the end: each accumulator is 16 outputs. One unit of work is two blocks (32
 * columns) by up to DP_MR rows at a time (2 DP_MR accumulators); each thread takes its own share of the
 * units, and a unit's W comes from memory once per call, from cache for each DP_MR rows after the first.
 * The answer is as amx_gemm_bf16's (and oneDNN's): x rounded to bfloat16 as torch rounds, the products
 * summed in float32, the sums rounded to bfloat16, stored so or widened. */
#include "cpu_vec.h"

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__)
#define DP_BUILT 1
#include <immintrin.h>
#define DP_MR 12 /* rows of x a pass over a unit takes (24 accumulators of 32) */

/* rows [r0, r0 + mr) of x (pairs: K / 2 a row) by the unit at b0 (two blocks, b1 = b0 + K / 2 vectors)
 * into y's columns [n0, n0 + 32) */
static inline __attribute__((always_inline)) void dp_tile(const uint32_t *xp, const uint16_t *b0, int64_t pairs,
                                                          void *y, int y_bf16, int64_t r0, int64_t n0, int64_t N,
                                                          const int mr) {
    __m512 acc[DP_MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const uint16_t *b1 = b0 + pairs * 32;
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + p * 32), w1 = (__m512bh)_mm512_loadu_si512(b1 + p * 32);
        for (int i = 0; i < mr; i++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[(r0 + i) * pairs + p]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < 2; u++) {
            const __m256i h = bf16_round16(acc[i][u]);
            const int64_t at = (r0 + i) * N + n0 + 16 * u;
            if (y_bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), h);
            else
                _mm512_storeu_ps((float *)y + at, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
}

/* rows [r0, r0 + mr) for mr in 1 .. DP_MR, each its own instance (the accumulators in registers) */
static void dp_rows(const uint32_t *xp, const uint16_t *b0, int64_t pairs, void *y, int y_bf16, int64_t r0,
                    int64_t n0, int64_t N, int mr) {
    switch (mr) {
#define CASE(m)                                                   \
    case m:                                                       \
        dp_tile(xp, b0, pairs, y, y_bf16, r0, n0, N, m);          \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
    }
}
#else
#define DP_BUILT 0
#endif

/* Whether dp_gemm_bf16 runs here: built with bf16 dot products, and PDSERVE_DP_OFF=1 not in the environment
 * (which, as PDSERVE_AMX_OFF does for the tiles, leaves those rows to the widening kernel and oneDNN). */
int dp_gemm_available(void) {
    const char *off = getenv("PDSERVE_DP_OFF");
    return DP_BUILT && (off == NULL || off[0] != '1');
}

/* y [M][N] = x [M][K] W^T, W packed by amx_pack_bf16; x float32 (rounded to bfloat16 as torch rounds)
 * or bfloat16 (x_bf16, read in place); y bfloat16 (y_bf16) or those values widened to float32. Returns
 * -1 (y untouched) where it does not run: not built with bf16 dot products, N or K not a multiple of 32,
 * no memory for x's bfloat16 copy; else 0. */
int dp_gemm_bf16(const void *x, int64_t x_bf16, const uint16_t *w, void *y, int64_t y_bf16, int64_t M, int64_t N,
                 int64_t K) {
#if DP_BUILT
    if (M < 1 || N % 32 || K % 32) return -1;
    uint16_t *xs = NULL;
    if (!x_bf16) {
        xs = aligned_alloc(64, sizeof(uint16_t) * M * K);
        if (xs == NULL) return -1;
        for (int64_t i = 0; i < M * K; i += 16)
            _mm256_storeu_si256((__m256i *)(xs + i), bf16_round16(_mm512_loadu_ps((const float *)x + i)));
    }
    const uint32_t *xp = (const uint32_t *)(x_bf16 ? x : xs);
    const int64_t pairs = K / 2, units = N / 32;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        for (int64_t u = units * me / nt; u < units * (me + 1) / nt; u++)
            for (int64_t r0 = 0; r0 < M; r0 += DP_MR)
                dp_rows(xp, w + u * 2 * pairs * 32, pairs, y, (int)y_bf16, r0, u * 32, N,
                        (int)(M - r0 < DP_MR ? M - r0 : DP_MR));
    }
    free(xs);
    return 0;
#else
    (void)x, (void)x_bf16, (void)w, (void)y, (void)y_bf16, (void)M, (void)N, (void)K;
    return -1;
#endif
}
