/* Projections of a few rows on AMX tiles (a bf16 model's decode steps): y = x W^T for up to
 * AMX_ROWS rows of x against bfloat16 weights packed once into tiles (amx_pack_bf16), streamed from
 * memory once per call. oneDNN's AMX kernels stream them at ~14 GB/s there; this at ~21 (the 30
 * layers' 212 MB of SmolLM2 in 10.1 ms against 15.0 at 32 rows, 8.1 against 13.2 at 16, on 2 AMX
 * Xeon cores). Also the tiles' permission and shape (cpu_amx.h), which cpu_attention.c shares. */
#include "cpu_amx.h"
#include "cpu_vec.h"

#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AMX_ROWS 64 /* rows one call takes (4 tiles of 16) */

#if AMX_BUILT
#include <sys/syscall.h>
#include <unistd.h>

static int granted = 0;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static void ask(void) {
    const char *off = getenv("PDSERVE_AMX_OFF");
    granted = (off == NULL || off[0] != '1') &&
              syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}
int amx_granted(void) {
    pthread_once(&once, ask);
    return granted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

/* A constant in memory: gcc 12 dropped the stores of a local one filled before _tile_loadconfig as
 * dead (the instruction then faulted on palette 1 with no tiles configured). */
static const tile_config_t tiles_16x64 __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

void amx_configure(void) { _tile_loadconfig(&tiles_16x64); }


/* 16 bfloat16 values widened to float32 (each the upper half of one) */
static inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

/* row r of x ([M][K], float32 or bfloat16 when x_bf16) into dst in bfloat16, rounded as f32_to_bf16
 * rounds; zeros past the last row (the tiles read 16 or 32 rows at a time). K a multiple of 16. */
static void x_row_bf16(uint16_t *dst, const void *x, int64_t x_bf16, int64_t r, int64_t M, int64_t K) {
    if (r >= M)
        memset(dst, 0, sizeof(uint16_t) * K);
    else if (x_bf16)
        memcpy(dst, (const uint16_t *)x + r * K, sizeof(uint16_t) * K);
    else
        for (int64_t k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(dst + k), bf16_round16(_mm512_loadu_ps((const float *)x + r * K + k)));
}

/* rows [r0, min(r0 + 16, M)) of a 16 x 16 float32 tile t (row stride 16) into y at column n0, each
 * rounded to bfloat16 (bf16_round16, as f32_to_bf16 rounds): stored so (y_bf16), or widened back to
 * float32. 16 lanes a row: a value at a time, a 32-row x 3,072 tile pass took ~0.1 ms of stores. */
static void put_rows(const float *t, void *y, int y_bf16, int64_t r0, int64_t n0, int64_t M, int64_t N) {
    for (int64_t r = r0; r < r0 + 16 && r < M; r++) {
        const __m256i h = bf16_round16(_mm512_load_ps(t + (r - r0) * 16));
        if (y_bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + r * N + n0), h);
        else
            _mm512_storeu_ps((float *)y + r * N + n0, widen16(h));
    }
}
#endif

/* Whether amx_gemm_bf16 runs here (built for AMX and granted the tiles). */
int amx_gemm_available(void) {
#if AMX_BUILT
    return amx_granted();
#else
    return 0;
#endif
}

/* w [N][K] (bfloat16, row-major) into tiles: [N / 16][K / 32][16 pairs][16 n][2], each 16 x 32 block
 * of W one B tile (1 KiB, contiguous) in AMX's VNNI layout (a pair of K's elements per 32 bits).
 * N and K multiples of 32. */
void amx_pack_bf16(const uint16_t *w, uint16_t *out, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kb = 0; kb < K / 32; kb++) {
            uint16_t *t = out + (nb * (K / 32) + kb) * 512;
            for (int64_t kp = 0; kp < 16; kp++)
                for (int64_t n = 0; n < 16; n++) {
                    t[(kp * 16 + n) * 2] = w[(nb * 16 + n) * K + kb * 32 + 2 * kp];
                    t[(kp * 16 + n) * 2 + 1] = w[(nb * 16 + n) * K + kb * 32 + 2 * kp + 1];
                }
        }
}

/* y [M][N] = x [M][K] W^T, W packed by amx_pack_bf16; x float32 (rounded to bfloat16 as torch
 * rounds) or bfloat16 (x_bf16); the products summed in float32 and rounded to bfloat16, as oneDNN's
 * bfloat16 answer is (so a layer's output does not depend on which of the two ran); y that, or it
 * widened to float32 (y_bf16 0). Per 32 columns of W (one thread's share of the N / 32), rows 32 at a time into
 * 2 x 2 accumulator tiles over K / 32 steps: W's tiles come from memory once, the second 32 rows
 * read them again from cache. Returns -1 (y untouched) where it does not run: not built or granted
 * AMX, M over AMX_ROWS, N or K not a multiple of 32, no memory for x's bfloat16 copy; else 0. */
int amx_gemm_bf16(const void *x, int64_t x_bf16, const uint16_t *w, void *y, int64_t y_bf16, int64_t M, int64_t N,
                  int64_t K) {
#if AMX_BUILT
    if (!amx_granted() || M < 1 || M > AMX_ROWS || N % 32 || K % 32) return -1;
    const int64_t M16 = (M + 15) / 16 * 16;
    uint16_t *xs = aligned_alloc(64, sizeof(uint16_t) * M16 * K); /* x in bfloat16, rows padded with zeros */
    if (xs == NULL) return -1;
    for (int64_t r = 0; r < M16; r++) x_row_bf16(xs + r * K, x, x_bf16, r, M, K);
#pragma omp parallel
    {
        amx_configure();
        float t[16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < N / 32; nb++) {
            const uint16_t *b0 = w + 2 * nb * (K / 32) * 512, *b1 = b0 + (K / 32) * 512;
            const int64_t n0 = nb * 32;
            for (int64_t r0 = 0; r0 < M16; r0 += 32) {
                const int two = r0 + 16 < M16;
                amx_products_2x2(xs + r0 * K, xs + (r0 + 16) * K, K * 2, 64, b0, b1, 1024, K / 32, two, 1);
#define PUT(tile, r, n)                                                                                  \
    do {                                                                                                 \
        _tile_stored(tile, t, 64);                                                                       \
        put_rows(t, y, (int)y_bf16, r, n, M, N);                                                         \
    } while (0)
                PUT(0, r0, n0);
                PUT(1, r0, n0 + 16);
                if (two) {
                    PUT(2, r0 + 16, n0);
                    PUT(3, r0 + 16, n0 + 16);
                }
#undef PUT
            }
        }
        _tile_release();
    }
    free(xs);
    return 0;
#else
    (void)x, (void)x_bf16, (void)w, (void)y, (void)y_bf16, (void)M, (void)N, (void)K;
    return -1;
#endif
}

/* rows [r0, min(r0 + 16, M)) of SwiGLU over the 16 x 16 tiles tg (gate) and tu (up) into h's columns
 * [n0, n0 + 16) (h [M][n] bfloat16): each product rounded to bfloat16 and widened, as oneDNN's bf16
 * gate_up would be, then silu_mul_bf16's arithmetic (silu_mul16) and rounding, so the answer equals
 * that kernel's over this file's product, bit for bit. */
#if AMX_BUILT
static void put_swiglu(const float *tg, const float *tu, uint16_t *h, int64_t r0, int64_t n0, int64_t M, int64_t n) {
    for (int64_t r = r0; r < r0 + 16 && r < M; r++) {
        const __m512 g = widen16(bf16_round16(_mm512_load_ps(tg + (r - r0) * 16)));
        const __m512 u = widen16(bf16_round16(_mm512_load_ps(tu + (r - r0) * 16)));
        _mm256_storeu_si256((__m256i *)(h + r * n + n0), bf16_round16(silu_mul16(g, u)));
    }
}
#endif

/* amx_gemm_bf16 for any number of rows (a bf16 model's prefill projections), the same answer: past
 * AMX_ROWS, oneDNN's bf16 matmul left one of the two cores idle at many row counts (SmolLM2's o and down
 * projections at 384-768 rows, its qkv at 768-1,024: no faster on 2 threads than on 1, 2 AMX Xeon cores),
 * and its per-shape kernels need the rows padded to buckets. Each thread takes its own share of W's
 * column blocks (balanced, whatever M) and runs AMX_MC rows of x at a time past each block: the
 * block's tiles come from memory once per AMX_MC rows and from cache for each 32 rows after the first.
 * x in bfloat16 is read in place but for its last M % 32 rows (copied, padded with zeros); float32 x
 * is rounded to bfloat16 first, both threads sharing the rows.
 * swiglu (W a fused [2n][K] gate_up, y [M][n] bfloat16): each block is 16 columns of the gate and the
 * same 16 of the up projection, and SwiGLU is applied as the tiles are stored (put_swiglu): the
 * [M][2n] product is never written (at 2,048 rows 12.6 MB, and silu_mul_bf16 read it back).
 * Returns -1 (y untouched) where it does not run (not built or granted AMX, N or K not a multiple of
 * 32, no memory for the copy); else 0. */
#define AMX_MC 256
static int many_rows(const void *x, int64_t x_bf16, const uint16_t *w, void *y, int64_t y_bf16, int64_t M, int64_t N,
                     int64_t K, int swiglu) {
#if AMX_BUILT
    if (!amx_granted() || M < 1 || N % 32 || K % 32) return -1;
    const int64_t M32 = (M + 31) / 32 * 32, full = x_bf16 ? M / 32 * 32 : 0; /* rows read in place */
    uint16_t *xs = aligned_alloc(64, sizeof(uint16_t) * ((M32 - full) * K + 32)); /* (+32: never size 0) */
    if (xs == NULL) return -1;
    const int64_t tiles_k = (K / 32) * 512, n = N / 2; /* a 16-column block's tiles; swiglu's h width */
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = full; r < M32; r++) x_row_bf16(xs + (r - full) * K, x, x_bf16, r, M, K);
        amx_configure();
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num(), units = swiglu ? n / 16 : N / 32;
        const int64_t u0 = units * me / nt, u1 = units * (me + 1) / nt;
        float t[16 * 16] __attribute__((aligned(64))), t2[16 * 16] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M32; m0 += AMX_MC) {
            const int64_t m1 = m0 + AMX_MC < M32 ? m0 + AMX_MC : M32;
            for (int64_t u = u0; u < u1; u++) {
                /* the unit's two 16-column B blocks: gate and up (swiglu), else two neighbours */
                const uint16_t *b0 = w + (swiglu ? u : 2 * u) * tiles_k;
                const uint16_t *b1 = swiglu ? w + (n / 16 + u) * tiles_k : b0 + tiles_k;
                for (int64_t r0 = m0; r0 < m1; r0 += 32) {
                    const uint16_t *a = r0 < full ? (const uint16_t *)x + r0 * K : xs + (r0 - full) * K;
                    amx_products_2x2(a, a + 16 * K, K * 2, 64, b0, b1, 1024, K / 32, 1, 1);
                    if (swiglu) {
                        _tile_stored(0, t, 64);
                        _tile_stored(1, t2, 64);
                        put_swiglu(t, t2, y, r0, u * 16, M, n);
                        _tile_stored(2, t, 64);
                        _tile_stored(3, t2, 64);
                        put_swiglu(t, t2, y, r0 + 16, u * 16, M, n);
                        continue;
                    }
                    _tile_stored(0, t, 64);
                    put_rows(t, y, (int)y_bf16, r0, u * 32, M, N);
                    _tile_stored(1, t, 64);
                    put_rows(t, y, (int)y_bf16, r0, u * 32 + 16, M, N);
                    _tile_stored(2, t, 64);
                    put_rows(t, y, (int)y_bf16, r0 + 16, u * 32, M, N);
                    _tile_stored(3, t, 64);
                    put_rows(t, y, (int)y_bf16, r0 + 16, u * 32 + 16, M, N);
                }
            }
        }
        _tile_release();
    }
    free(xs);
    return 0;
#else
    (void)x, (void)x_bf16, (void)w, (void)y, (void)y_bf16, (void)M, (void)N, (void)K, (void)swiglu;
    return -1;
#endif
}

int amx_gemm_bf16_many(const void *x, int64_t x_bf16, const uint16_t *w, void *y, int64_t y_bf16, int64_t M,
                       int64_t N, int64_t K) {
    return many_rows(x, x_bf16, w, y, y_bf16, M, N, K, 0);
}

/* h [M][N / 2] bfloat16 = SwiGLU(x W^T) for a fused gate_up W [N][K] packed by amx_pack_bf16, any M
 * (see many_rows): equal, bit for bit, to silu_mul_bf16 over amx_gemm_bf16_many's bfloat16 product. */
int amx_swiglu_bf16(const void *x, int64_t x_bf16, const uint16_t *w, uint16_t *h, int64_t M, int64_t N, int64_t K) {
    return many_rows(x, x_bf16, w, h, 1, M, N, K, 1);
}
