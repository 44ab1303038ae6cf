/* Projections of a few rows on AMX tiles (a bf16 model's decode steps): y = x W^T for up to
 * AMX_ROWS rows of x against bfloat16 weights packed once into tiles (amx_pack_bf16), streamed from
 * memory once per call. oneDNN's AMX kernels stream them at ~14 GB/s there; this at ~21 (the 30
 * layers' 212 MB of SmolLM2 in 10.1 ms against 15.0 at 32 rows, 8.1 against 13.2 at 16, on 2 AMX
 * Xeon cores). Also the tiles' permission and shape (cpu_amx.h), which cpu_attention.c shares. */
#include "cpu_amx.h"
#include "cpu_vec.h"

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


/* rows [r0, min(r0 + 16, M)) of a 16 x 16 float32 tile t (row stride 16) into y at column n0, each
 * rounded to bfloat16: stored so (y_bf16), or widened back to float32 */
static void put_rows(const float *t, void *y, int y_bf16, int64_t r0, int64_t n0, int64_t M, int64_t N) {
    for (int64_t r = r0; r < r0 + 16 && r < M; r++)
        for (int j = 0; j < 16; j++) {
            const uint16_t h = f32_to_bf16(t[(r - r0) * 16 + j]);
            if (y_bf16) {
                ((uint16_t *)y)[r * N + n0 + j] = h;
            } else {
                const uint32_t u = (uint32_t)h << 16;
                memcpy((float *)y + r * N + n0 + j, &u, sizeof u);
            }
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
    for (int64_t r = 0; r < M; r++)
        if (x_bf16)
            memcpy(xs + r * K, (const uint16_t *)x + r * K, sizeof(uint16_t) * K);
        else
            for (int64_t k = 0; k < K; k++) xs[r * K + k] = f32_to_bf16(((const float *)x)[r * K + k]);
    memset(xs + M * K, 0, sizeof(uint16_t) * (M16 - M) * K);
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
