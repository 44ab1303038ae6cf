/* AMX tiles (processors with amx_tile and amx_bf16; built with -mamx-tile -mamx-bf16 where the ISA is
 * amx): whether this process may use them, and the one tile shape the kernels use. cpu_amx.c. */
#ifndef PDSERVE_CPU_AMX_H
#define PDSERVE_CPU_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_BUILT 1
#include <immintrin.h>
/* Whether the tiles are this process's: asked of Linux once (ARCH_REQ_XCOMP_PERM for XTILEDATA);
 * PDSERVE_AMX_OFF=1 in the environment answers no (the kernels then take their other paths). */
int amx_granted(void);
/* This thread's tiles: all 8 as 16 rows of 64 bytes (oneDNN loads its own shapes before it uses them). */
void amx_configure(void);
#else
#define AMX_BUILT 0
#endif
#endif
