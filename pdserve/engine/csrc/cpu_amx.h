/* AMX tiles (processors with amx_tile and amx_bf16; built with -mamx-tile -mamx-bf16 where the ISA is
 * amx): whether this process may use them, and the one tile shape the kernels use. cpu_amx.c. */
#ifndef PDSERVE_CPU_AMX_H
#define PDSERVE_CPU_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_BUILT 1
#include <immintrin.h>
#include <stdint.h>
/* Whether the tiles are this process's: asked of Linux once (ARCH_REQ_XCOMP_PERM for XTILEDATA);
 * PDSERVE_AMX_OFF=1 in the environment answers no (the kernels then take their other paths). */
int amx_granted(void);
/* This thread's tiles: all 8 as 16 rows of 64 bytes (oneDNN loads its own shapes before it uses them). */
void amx_configure(void);

/* Tiles 0-3, zeroed, then += the 2 x 2 products of A tiles a0 (16 rows) and a1 (the next 16, when
 * two_a) by B tiles b0 and b1 (when two_b), over `steps` steps along K (32 bfloat16 a step): A's
 * rows a_stride bytes apart, B's 64, each step a_step and b_step bytes further on. Tiles 4-5 hold A,
 * 6-7 B. The caller stores 0-3 (0: a0 b0, 1: a0 b1, 2: a1 b0, 3: a1 b1). */
static inline void amx_products_2x2(const void *a0, const void *a1, int64_t a_stride, int64_t a_step, const void *b0,
                                    const void *b1, int64_t b_step, int64_t steps, int two_a, int two_b) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < steps; i++) {
        _tile_loadd(4, (const char *)a0 + i * a_step, a_stride);
        _tile_loadd(6, (const char *)b0 + i * b_step, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_b) {
            _tile_loadd(7, (const char *)b1 + i * b_step, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_a) {
            _tile_loadd(5, (const char *)a1 + i * a_step, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two_b) _tile_dpbf16ps(3, 5, 7);
        }
    }
}
#else
#define AMX_BUILT 0
#endif
#endif
