/* Paged attention on CPUs (float32; bfloat16 products where built with -mavx512bf16): prefill
 * chunks and decode batches, read from the cache in place (layout: see cpu_kernels.c) with an
 * online softmax; torch's path gathers the blocks into a new tensor first, then reads that copy
 * (three passes over the KV instead of one). The cache holds float32 or bfloat16 keys and values
 * (kvb below); queries, softmax and outputs are float32 either way. Built into the same library as
 * cpu_kernels.c. */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 256
#define LOG2E 1.4426950408889634f /* bf16 products: scores in base 2 (their softmax through exp2) */

/* Paged prefill attention (float32): a chunk of n queries at positions ctx .. ctx + n - 1 over
 * keys 0 .. ctx + n - 1 read from the cache in place (the chunk's own keys are written there
 * first), causally and, when window > 0, over the last `window` positions only. One task is the
 * G query heads of one KV head at PB consecutive positions, stacked as rows (row r: position
 * p0 + r / G, head r % G), so each key and value read serves G heads. Per step of KC keys: the
 * scores as register tiles (MRS rows by NV vectors of keys: D broadcast-FMAs from the transposed
 * key blocks), an online softmax over each row's own key range, then the values as register
 * tiles (MR rows by 4 vectors of D). GCC vector extensions: 16 lanes with AVX-512, 8 with AVX2.
 *
 *   q        rows q_stride floats apart, [H, D] each (a view into the fused qkv projection)
 *   blocks   the sequence's block ids, covering ctx + n positions
 *   out      rows out_stride elements apart, [H, D] each: float32, or bfloat16 where out_bf16 (each value
 *            rounded as torch rounds float32 to bfloat16)
 *   kv_kind  what k and v (the cache) hold: KV_F32 (0), KV_BF16 (1), KV_I8 (2) or KV_F8 (3; these two
 *            bytes, each (block, head) row its int8 or e4m3 elements then a float32 scale per slot, kv_quant.py)
 *   k_new, v_new  NULL, or (a one-byte cache, bf16 products on AMX tiles) the chunk's own keys and values
 *            as the projection gave them, [n][KVH][D] rows k_new_stride / v_new_stride floats apart:
 *            attended unquantized (the cache's copies of them are for later steps)
 * paged_attention_f32_fits says whether the attention kernels (this and paged_decode_f32) take
 * a shape. paged_prefill_f32 returns -1 when a thread's scratch could not be allocated (out is
 * then incomplete), else 0. */

#include "cpu_vec.h"
#define VW VEC_W
typedef vecf vf;
static inline vf vload(const float *p) { return vecf_load(p); }
static inline void vstore(float *p, vf v) { *(vf *)p = v; }

/* A bfloat16 cache (--kv-cache-dtype bfloat16): each key and value the upper half of a float32,
 * widened as it is loaded (cpu_vec.h), so decode streams half the bytes and the arithmetic stays
 * float32. An int8 or fp8 cache (--kv-cache-dtype int8 or fp8, e4m3; kv_quant.py): each (block, head)
 * row holds the block's one-byte keys or values, then a float32 scale per slot; the integers are widened as they are
 * loaded and each key's scale applied to its scores (scale_columns), each value's to its
 * probabilities (scale_probabilities): a quarter of a float32 cache's bytes, plus the scales.
 * kvb (a constant where the tiles are inlined with one): the cache's kind, KV_F32, KV_BF16, KV_I8 or
 * KV_F8; cache pointers are bytes, kv_at finds element i past one, kv_head a (block, head)'s row. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2, KV_F8 = 3 };
#define KV_BYTES(kvb) ((kvb) >= KV_I8) /* one-byte elements with a scale per slot: int8 or fp8 (e4m3) */
#define KV_SCALE(kvb) ((kvb) == KV_F8 ? 256.0f : 1.0f) /* what the scales are multiplied by (kvload's fp8 / 256) */
static inline vf kvload(const char *p, int64_t i, const int kvb) {
    return kvb == KV_F8   ? vecf_load_e4m3_div256((const uint8_t *)p + i) /* (its scales times 256: KV_SCALE) */
           : kvb == KV_I8 ? vecf_load_i8((const int8_t *)p + i)
           : kvb          ? vecf_load_bf16((const uint16_t *)p + i)
                          : vload((const float *)p + i);
}
static inline const char *kv_at(const void *p, int64_t i, const int kvb) {
    return (const char *)p + i * (KV_BYTES(kvb) ? 1 : kvb ? 2 : 4);
}
static inline const char *kv_head(const void *p, int64_t blk, int64_t h, int64_t KVH, int64_t D, int64_t BS,
                                  const int kvb) {
    const int64_t row = KV_BYTES(kvb) ? D * BS + 4 * BS : D * BS * (kvb ? 2 : 4);
    return (const char *)p + (blk * KVH + h) * row;
}
/* an int8 cache's scales of a (block, head) row, one per slot */
static inline const float *kv_scales(const char *head, int64_t D, int64_t BS) { return (const float *)(head + D * BS); }

#define PB 16                  /* positions per task */
#define MAXG 8                 /* query heads per KV head */
#define ROWS (PB * MAXG)
#define KC 128                 /* keys per softmax step */
#define MRS (VW == 16 ? 4 : 2) /* rows per register tile of the scores */
#define NV 4                   /* key vectors per register tile of the scores */
#define MR (VW == 16 ? 4 : 3)  /* rows per register tile of the values */

int paged_attention_f32_fits(int64_t H, int64_t KVH, int64_t D, int64_t BS) {
    return H % KVH == 0 && H / KVH <= MAXG && H <= ROWS && D <= MAX_D && D % (4 * VW) == 0 && BS % VW == 0 && BS <= KC &&
           KC % BS == 0;
}

/* s[i][u VW ..] = q[i] . key vectors col[u] for mr rows by nv vectors (constants when inlined
 * with them: the tile then lives in registers) */
static inline __attribute__((always_inline)) void score_tile(float *s, const float *q, const char *const *col,
                                                             int64_t D, int64_t BS, const int mr, const int nv,
                                                             const int kvb) {
    vf acc[MRS][NV] = {{0}};
    for (int64_t d = 0; d < D; d++) {
        vf kv[NV];
        for (int u = 0; u < nv; u++) kv[u] = kvload(col[u], d * BS, kvb);
        for (int i = 0; i < mr; i++) {
            const float qd = q[i * D + d];
            for (int u = 0; u < nv; u++) acc[i][u] += kv[u] * qd;
        }
    }
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < nv; u++) vstore(s + i * KC + u * VW, acc[i][u]);
}

/* o[i][c .. c + 4 VW) += sum_j s[i][j] v_j[c ..] for mr rows (a constant when inlined with one) */
static inline __attribute__((always_inline)) void pv_tile(float *o, const float *s,
                                                          const char *const *vblk, int64_t c, int64_t kn,
                                                          int64_t BS, int64_t D, const int mr, const int kvb) {
    vf acc[MR][4];
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < 4; u++) acc[i][u] = vload(o + i * D + c + u * VW);
    for (int64_t j = 0; j < kn; j++) {
        const char *vr = kv_at(vblk[j / BS], (j % BS) * D + c, kvb);
        const vf v0 = kvload(vr, 0, kvb), v1 = kvload(vr, VW, kvb), v2 = kvload(vr, 2 * VW, kvb),
                 v3 = kvload(vr, 3 * VW, kvb);
        for (int i = 0; i < mr; i++) {
            const float p = s[i * KC + j];
            acc[i][0] += v0 * p;
            acc[i][1] += v1 * p;
            acc[i][2] += v2 * p;
            acc[i][3] += v3 * p;
        }
    }
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < 4; u++) vstore(o + i * D + c + u * VW, acc[i][u]);
}

/* A one-byte cache's prefill: the chunk's own keys and values as the projection gave them (float32
 * rows [n][KVH][D], k_stride and v_stride floats apart), for positions ctx .. ctx + n - 1, so the chunk
 * attends to them unquantized, as the torch path and vLLM's attend to a chunk's own; NULL k: none. */
typedef struct {
    const float *k, *v;
    int64_t k_stride, v_stride, ctx, n;
} raw_kv_t;

/* bfloat16 products (a bf16-quantized model's prefill, on processors with bf16 dot products):
 * the scores and the values computed with vdpbf16ps, which multiplies pairs of bfloat16 and adds
 * both products to a float32 lane, at twice the FMA rate; the softmax, the outputs and the cache
 * stay float32. Each step's keys and values are rounded into pair-interleaved scratch once and
 * serve every row of the task; queries once per task; probabilities once per step and row.
 * A 32-bit lane holds a pair: the first element in its low half, the second in its high half. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_PRODUCTS 1
typedef struct {
    uint32_t *q; /* [ROWS][MAX_D / 2]: row r's query, dims (2i, 2i + 1) in lane i */
    uint32_t *k; /* [MAX_D / 2][KC]: key j's dims (2i, 2i + 1) at [i][j] */
    uint32_t *v; /* [KC / 2][MAX_D]: keys (2i, 2i + 1)'s values of dim d at [i][d] */
    uint32_t *p; /* [ROWS][KC / 2]: row r's probabilities of keys (2i, 2i + 1) */
    int amx;     /* the products on AMX tiles (amx_products below), this thread's tiles configured; then: */
    const uint32_t *pk, *pv; /* the call's keys and values as pairs, every KV head's (pack_kv_pairs) */
    int64_t head_u32;        /* one KV head's share of each */
} pairs_t;
#define PAIRS_U32 (ROWS * MAX_D / 2 + MAX_D / 2 * KC + KC / 2 * MAX_D + ROWS * KC / 2)

/* The same two products on AMX tiles (processors with amx_tile and amx_bf16, built with -mamx-tile
 * -mamx-bf16): one tdpbf16ps multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16
 * float32, 16 times the work of a vdpbf16ps. The queries and probabilities are A, from the pair
 * scratch above (a row's pairs in a row); the keys and values B, in AMX's VNNI layout (a pair of
 * rows interleaved), rounded once per call for every task (pack_kv_pairs: with the products on
 * tiles, each task rounding the keys it reads was most of its time). Rows are taken 16 at a time:
 * the rows past a task's last (up to the next 16) compute from stale scratch and are never read.
 * Tiles: 0-3 the 2 x 2 accumulators, 4-5 A, 6-7 B, each 16 rows of 64 bytes. Linux lends a process
 * the tiles' state only on request (amx_products). */
#include "cpu_amx.h"
#if AMX_BUILT
#define AMX_PRODUCTS 1
static int amx_products(void) { return amx_granted(); }

/* s[r][j] for rows (padded to 16) by ncols x 16 keys: the queries' pairs (A) by the keys' (B, kp:
 * the step's first key in pack_kv_pairs' layout) */
static void scores_amx(float *s, const pairs_t *bf, const uint32_t *kp, int64_t ncols, int64_t rows, int64_t D) {
    const int64_t rows16 = (rows + 15) / 16 * 16, qs = MAX_D / 2 * 4, ss = KC * 4;
    for (int64_t r0 = 0; r0 < rows16; r0 += 32) {
        const int two_r = r0 + 16 < rows16;
        for (int64_t u = 0; u < ncols; u += 2) {
            const int two_u = u + 1 < ncols;
            amx_products_2x2(bf->q + r0 * (MAX_D / 2), bf->q + (r0 + 16) * (MAX_D / 2), qs, 64, kp + u * (D / 2) * 16,
                             kp + (u + 1) * (D / 2) * 16, 1024, D / 32, two_r, two_u);
            _tile_stored(0, s + r0 * KC + u * 16, ss);
            if (two_u) _tile_stored(1, s + r0 * KC + (u + 1) * 16, ss);
            if (two_r) {
                _tile_stored(2, s + (r0 + 16) * KC + u * 16, ss);
                if (two_u) _tile_stored(3, s + (r0 + 16) * KC + (u + 1) * 16, ss);
            }
        }
    }
}

/* o[r][0 .. D) += the probabilities' pairs (A) by the values' (B, vp: the step's first pair in
 * pack_kv_pairs' layout), over pairs rounded up to 16 (the values past the step's are the next
 * keys' or zeros, their probabilities zero) */
static void values_amx(float *o, const pairs_t *bf, const uint32_t *vp, int64_t pairs, int64_t rows, int64_t D) {
    const int64_t rows16 = (rows + 15) / 16 * 16, pairs16 = (pairs + 15) / 16 * 16;
    const int64_t ps = KC / 2 * 4, vs = D * 4, os = D * 4;
    for (int64_t r0 = 0; r0 < rows16; r0 += 32) {
        const int two_r = r0 + 16 < rows16;
        for (int64_t c = 0; c < D; c += 32) {
            _tile_loadd(0, o + r0 * D + c, os);
            _tile_loadd(1, o + r0 * D + c + 16, os);
            if (two_r) {
                _tile_loadd(2, o + (r0 + 16) * D + c, os);
                _tile_loadd(3, o + (r0 + 16) * D + c + 16, os);
            }
            for (int64_t kb = 0; kb < pairs16 / 16; kb++) {
                _tile_loadd(4, bf->p + r0 * (KC / 2) + kb * 16, ps);
                _tile_loadd(6, vp + kb * 16 * D + c, vs);
                _tile_loadd(7, vp + kb * 16 * D + c + 16, vs);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two_r) {
                    _tile_loadd(5, bf->p + (r0 + 16) * (KC / 2) + kb * 16, ps);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, o + r0 * D + c, os);
            _tile_stored(1, o + r0 * D + c + 16, os);
            if (two_r) {
                _tile_stored(2, o + (r0 + 16) * D + c, os);
                _tile_stored(3, o + (r0 + 16) * D + c + 16, os);
            }
        }
    }
}
#else
#define AMX_PRODUCTS 0
static int amx_products(void) { return 0; }
#endif

static const float zeros[MAX_D];

/* lane i = (a[i], b[i]), rounded to bfloat16 */
static inline __m512i pair_lanes_f(__m512 a, __m512 b) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}
static inline __m512i pair_lanes(const float *a, const float *b) {
    return pair_lanes_f(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
}
/* 16 one-byte elements of an int8 or fp8 cache widened, times their scales */
static inline __m512 byte_scaled(const char *p, __m512 scale, const int kvb) {
    return _mm512_mul_ps((__m512)kvload(p, 0, kvb), scale);
}

/* lane i = (a[i], b[i]) of the cache's keys or values (bfloat16 already: no rounding) */
static inline __m512i pair_lanes_kv(const char *a, const char *b, const int kvb) {
    if (!kvb) return pair_lanes((const float *)a, (const float *)b);
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)a));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* out[i] = (x[2i], x[2i + 1]) for n floats (n a multiple of 32), rounded to bfloat16 */
static inline void adjacent_pairs(uint32_t *out, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i += 32)
        _mm512_storeu_si512(out + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16),
                                                                      _mm512_loadu_ps(x + i)));
}

static inline __attribute__((always_inline)) void score_tile_bf16(float *s, const uint32_t *q, const uint32_t *k,
                                                                  int64_t D, const int mr, const int nv) {
    __m512 acc[MRS][NV];
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < nv; u++) acc[i][u] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < D / 2; dp++) {
        __m512i kv[NV];
        for (int u = 0; u < nv; u++) kv[u] = _mm512_loadu_si512(k + dp * KC + u * 16);
        for (int i = 0; i < mr; i++) {
            const __m512i qb = _mm512_set1_epi32((int)q[i * (MAX_D / 2) + dp]);
            for (int u = 0; u < nv; u++) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], (__m512bh)kv[u], (__m512bh)qb);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < nv; u++) _mm512_storeu_ps(s + i * KC + u * 16, acc[i][u]);
}

/* s[r][j] for the step's keys (col: as attend_keys has them), through the pair scratch */
static void scores_bf16(float *s, const pairs_t *bf, const char *const *col, int64_t ncols, int64_t rows,
                        int64_t D, int64_t BS, const int kvb, int64_t k0, int64_t h) {
    for (int64_t u = 0; u < ncols; u++)
        for (int64_t dp = 0; dp < D / 2; dp++)
            _mm512_storeu_si512(bf->k + dp * KC + u * 16, pair_lanes_kv(kv_at(col[u], 2 * dp * BS, kvb),
                                                                         kv_at(col[u], (2 * dp + 1) * BS, kvb), kvb));
    for (int64_t u0 = 0; u0 < ncols; u0 += NV) {
        const int64_t nv = ncols - u0 < NV ? ncols - u0 : NV;
        for (int64_t r0 = 0; r0 < rows; r0 += MRS) {
            const int64_t mr = rows - r0 < MRS ? rows - r0 : MRS;
            float *sr = s + r0 * KC + u0 * 16;
            const uint32_t *qr = bf->q + r0 * (MAX_D / 2), *kr = bf->k + u0 * 16;
            if (nv == NV && mr == MRS)
                score_tile_bf16(sr, qr, kr, D, MRS, NV);
            else
                score_tile_bf16(sr, qr, kr, D, mr, nv);
        }
    }
}

static inline __attribute__((always_inline)) void pv_tile_bf16(float *o, const uint32_t *p, const uint32_t *v,
                                                               int64_t c, int64_t pairs, int64_t D, const int mr) {
    __m512 acc[MR][4];
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < 4; u++) acc[i][u] = _mm512_loadu_ps(o + i * D + c + u * 16);
    for (int64_t jp = 0; jp < pairs; jp++) {
        __m512i vv[4];
        for (int u = 0; u < 4; u++) vv[u] = _mm512_loadu_si512(v + jp * MAX_D + c + u * 16);
        for (int i = 0; i < mr; i++) {
            const __m512i pb = _mm512_set1_epi32((int)p[i * (KC / 2) + jp]);
            for (int u = 0; u < 4; u++) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], (__m512bh)vv[u], (__m512bh)pb);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(o + i * D + c + u * 16, acc[i][u]);
}

/* o[r] += sum_j s[r][j] value(k0 + j) through the pair scratch (an odd last key pairs with zeros:
 * the slot after it may be unwritten) */
static void values_bf16(float *o, const float *s, const pairs_t *bf, const char *const *vblk, int64_t kn,
                        int64_t rows, int64_t D, int64_t BS, const int kvb, int64_t k0, int64_t h) {
    const int64_t pairs = (kn + 1) / 2;
    for (int64_t jp = 0; jp < pairs; jp++) {
        const int64_t j = 2 * jp;
        const char *a = kv_at(vblk[j / BS], (j % BS) * D, kvb);
        const char *b = j + 1 < kn ? kv_at(vblk[(j + 1) / BS], ((j + 1) % BS) * D, kvb) : (const char *)zeros;
        for (int64_t c = 0; c < D; c += 16)
            _mm512_storeu_si512(bf->v + jp * MAX_D + c, pair_lanes_kv(kv_at(a, c, kvb), kv_at(b, c, kvb), kvb));
    }
    for (int64_t r = 0; r < rows; r++) adjacent_pairs(bf->p + r * (KC / 2), s + r * KC, KC);
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        const int64_t mr = rows - r0 < MR ? rows - r0 : MR;
        for (int64_t c = 0; c < D; c += 64) {
            if (mr == MR)
                pv_tile_bf16(o + r0 * D, bf->p + r0 * (KC / 2), bf->v, c, pairs, D, MR);
            else
                pv_tile_bf16(o + r0 * D, bf->p + r0 * (KC / 2), bf->v, c, pairs, D, mr);
        }
    }
}


#if AMX_PRODUCTS
/* The call's keys and values, every KV head's, as the AMX products read them (B tiles): keys as
 * [key / 16][D / 2][16] (the dims (2i, 2i + 1) of 16 keys in a row), values as [key / 2][D] (keys
 * (2j, 2j + 1)'s values of dim d), a head's share head_u32 apart, up to nkeys_kc keys (a multiple of
 * 16 that a step's tiles never read past). Values past the last key are zeros (their probabilities
 * are zero, and 0 x a stale NaN is not); keys past it are whatever the cache block holds (their
 * scores are masked). Shared by the team: an omp for over KV heads and 16 keys. */
static void pack_kv_pairs(uint32_t *pk, uint32_t *pv, int64_t head_u32, int64_t nkeys, int64_t nkeys_kc,
                          const void *k, const void *v, const int64_t *blocks, int64_t KVH, int64_t D, int64_t BS,
                          const int kvb, const raw_kv_t *raw) {
#pragma omp for schedule(static) collapse(2)
    for (int64_t h = 0; h < KVH; h++)
        for (int64_t u = 0; u < nkeys_kc / 16; u++) {
            const int64_t key = u * 16;
            uint32_t *ku = pk + h * head_u32 + key * (D / 2), *vu = pv + h * head_u32 + key / 2 * D;
            if (key >= nkeys) {
                memset(ku, 0, sizeof(uint32_t) * 16 * (D / 2));
                memset(vu, 0, sizeof(uint32_t) * 8 * D);
                continue;
            }
            const char *khead = kv_head(k, blocks[key / BS], h, KVH, D, BS, kvb);
            const char *col = kv_at(khead, key % BS, kvb); /* (one block) */
            if (KV_BYTES(kvb)) { /* widened, times each key's scale, rounded to bfloat16 */
                const __m512 ks = _mm512_mul_ps(_mm512_loadu_ps(kv_scales(khead, D, BS) + key % BS),
                                                _mm512_set1_ps(KV_SCALE(kvb)));
                for (int64_t dp = 0; dp < D / 2; dp++)
                    _mm512_storeu_si512(ku + dp * 16, pair_lanes_f(byte_scaled(col + 2 * dp * BS, ks, kvb),
                                                                   byte_scaled(col + (2 * dp + 1) * BS, ks, kvb)));
            } else
                for (int64_t dp = 0; dp < D / 2; dp++)
                    _mm512_storeu_si512(ku + dp * 16, pair_lanes_kv(kv_at(col, 2 * dp * BS, kvb),
                                                                    kv_at(col, (2 * dp + 1) * BS, kvb), kvb));
            if (raw != NULL) /* the chunk's own keys, unquantized (rounded to bfloat16 as pair_lanes rounds) */
                for (int64_t j = key > raw->ctx ? key : raw->ctx; j < key + 16 && j < nkeys; j++) {
                    const float *kr = raw->k + (j - raw->ctx) * raw->k_stride + h * D;
                    for (int64_t dp = 0; dp < D / 2; dp++)
                        ku[dp * 16 + (j - key)] = (uint32_t)f32_to_bf16(kr[2 * dp]) |
                                                  (uint32_t)f32_to_bf16(kr[2 * dp + 1]) << 16;
                }
            for (int64_t jp = 0; jp < 8; jp++) {
                const char *row[2];
                float sc[2] = {0.0f, 0.0f};
                const float *fresh[2] = {NULL, NULL}; /* (raw: the chunk's own values) */
                for (int e = 0; e < 2; e++) {
                    const int64_t j = key + 2 * jp + e;
                    if (j >= nkeys) {
                        row[e] = (const char *)zeros;
                        continue;
                    }
                    if (raw != NULL && j >= raw->ctx) fresh[e] = raw->v + (j - raw->ctx) * raw->v_stride + h * D;
                    const char *vhead = kv_head(v, blocks[j / BS], h, KVH, D, BS, kvb);
                    row[e] = kv_at(vhead, (j % BS) * D, kvb);
                    if (KV_BYTES(kvb)) sc[e] = kv_scales(vhead, D, BS)[j % BS] * KV_SCALE(kvb);
                }
                if (KV_BYTES(kvb)) /* (a row past the last key: zeros, times a zero scale) */
                    for (int64_t c = 0; c < D; c += 16) {
                        __m512 half[2];
                        for (int e = 0; e < 2; e++)
                            half[e] = fresh[e] != NULL ? _mm512_loadu_ps(fresh[e] + c)
                                                       : byte_scaled(row[e] + c, _mm512_set1_ps(sc[e]), kvb);
                        _mm512_storeu_si512(vu + jp * D + c, pair_lanes_f(half[0], half[1]));
                    }
                else
                    for (int64_t c = 0; c < D; c += 16)
                        _mm512_storeu_si512(vu + jp * D + c,
                                            pair_lanes_kv(kv_at(row[0], c, kvb), kv_at(row[1], c, kvb), kvb));
            }
        }
}
#endif
#else
#define BF16_PRODUCTS 0
#define AMX_PRODUCTS 0
static int amx_products(void) { return 0; }
typedef struct {
    uint32_t *q;
} pairs_t;
#define PAIRS_U32 0
#endif

/* s[r][j] = qs[r] . key vector col[j / VW] for rows by ncols vectors of keys: MRS rows by NV
 * vectors per tile (kvb a constant: see kvload) */
static inline __attribute__((always_inline)) void score_tiles(float *s, const float *qs, const char *const *col,
                                                              int64_t ncols, int64_t rows, int64_t D, int64_t BS,
                                                              const int kvb) {
    for (int64_t u0 = 0; u0 < ncols; u0 += NV) {
        const int64_t nv = ncols - u0 < NV ? ncols - u0 : NV;
        for (int64_t r0 = 0; r0 < rows; r0 += MRS) {
            const int64_t mr = rows - r0 < MRS ? rows - r0 : MRS;
            float *sr = s + r0 * KC + u0 * VW;
            const float *qr = qs + r0 * D;
            if (nv == NV && mr == MRS)
                score_tile(sr, qr, col + u0, D, BS, MRS, NV, kvb);
            else if (nv == NV && mr == 3) /* decode of three query heads per KV head (GQA 3:1) */
                score_tile(sr, qr, col + u0, D, BS, 3, NV, kvb);
            else
                score_tile(sr, qr, col + u0, D, BS, mr, nv, kvb);
        }
    }
}

/* o[r] += sum_j s[r][j] value(j) over kn values: MR rows by 4 vectors of D per tile, over all the
 * step's keys before the tile goes back to memory */
static inline __attribute__((always_inline)) void value_tiles(float *o, const float *s, const char *const *vblk,
                                                              int64_t kn, int64_t rows, int64_t D, int64_t BS,
                                                              const int kvb) {
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        const int64_t mr = rows - r0 < MR ? rows - r0 : MR;
        for (int64_t c = 0; c < D; c += 4 * VW) {
            if (mr == MR)
                pv_tile(o + r0 * D, s + r0 * KC, vblk, c, kn, BS, D, MR, kvb);
            else if (mr == 3)
                pv_tile(o + r0 * D, s + r0 * KC, vblk, c, kn, BS, D, 3, kvb);
            else
                pv_tile(o + r0 * D, s + r0 * KC, vblk, c, kn, BS, D, mr, kvb);
        }
    }
}

/* An int8 cache: the scores of each vector of keys times those keys' scales (sc[u]: ncols vectors'
 * worth), and the probabilities of keys [0, kn) times their values' scales (vblk: the step's (block,
 * head) rows), whole vectors: lanes past kn (a block's unwritten slots, whose scales may be anything)
 * are never read after. */
static inline void scale_columns(float *s, const float *const *sc, int64_t ncols, int64_t rows, float mult) {
    for (int64_t u = 0; u < ncols; u++) {
        const vf f = vload(sc[u]) * mult;
        for (int64_t r = 0; r < rows; r++) vstore(s + r * KC + u * VW, vload(s + r * KC + u * VW) * f);
    }
}
static inline void scale_probabilities(float *s, const char *const *vblk, int64_t kn, int64_t rows, int64_t D,
                                       int64_t BS, float mult) {
    for (int64_t j0 = 0; j0 < kn; j0 += VW) {
        const vf f = vload(kv_scales(vblk[j0 / BS], D, BS) + j0 % BS) * mult;
        for (int64_t r = 0; r < rows; r++) vstore(s + r * KC + j0, vload(s + r * KC + j0) * f);
    }
}

#if VW == 16
/* lanes j0 + i within [a, b) */
static inline __mmask16 lanes_within(int64_t j0, int64_t a, int64_t b) {
    const int64_t lo = a - j0 < 0 ? 0 : a - j0 > 16 ? 16 : a - j0, hi = b - j0 < 0 ? 0 : b - j0 > 16 ? 16 : b - j0;
    return (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}
#endif

#if AMX_PRODUCTS
/* attend_keys's softmax step when the products run on AMX tiles: each row's probabilities go straight
 * into the pair scratch values_amx reads (bf->p), rounded to bfloat16 as they are computed, rather than
 * written as float32 and rounded into pairs in a second pass; the scores in base 2 (prefill_task scales the
 * queries by log2 e too), so 2^x through vec_exp2_16_bf16 (its error a 26th of that rounding); each row's
 * rescale factor 2^(m_old - m_new) 16 rows at a time rather than a scalar expf per row. Rows, ranges, m, l
 * and o as attend_keys has them; a row that takes every key of the step computes no lane masks (their
 * scalar work cost as much as the lanes' arithmetic). 2 AMX Xeon cores, SmolLM2's heads, a bfloat16
 * cache: a 512-token chunk 0.67 -> 0.44-0.46 ms, 2,048 tokens 8.75 -> 4.7-4.9 ms. */
static void softmax_pairs_amx(const float *s, uint32_t *p, float *o, float *m, float *l, const int64_t *first,
                              const int64_t *last, int64_t rows, int64_t k0, int64_t kn, int64_t D) {
    float mx[ROWS + 16], c[ROWS + 16];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t a = first[r] - k0 < 0 ? 0 : first[r] - k0, b = last[r] - k0 + 1 > kn ? kn : last[r] - k0 + 1;
        __m512 vmx = _mm512_set1_ps(m[r]);
        const float *sr = s + r * KC;
        if (a == 0 && b == KC) { /* (a row with every key of the step: no masks, a tree of maxima) */
            __m512 v[KC / 16];
            for (int u = 0; u < KC / 16; u++) v[u] = _mm512_loadu_ps(sr + u * 16);
            for (int w = KC / 32; w > 0; w /= 2)
                for (int u = 0; u < w; u++) v[u] = _mm512_max_ps(v[u], v[u + w]);
            vmx = _mm512_max_ps(vmx, v[0]);
        } else
            for (int64_t j0 = a & ~(int64_t)15; j0 < b; j0 += 16)
                vmx = _mm512_mask_max_ps(vmx, lanes_within(j0, a, b), vmx, _mm512_loadu_ps(sr + j0));
        mx[r] = _mm512_reduce_max_ps(vmx);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const __mmask16 in = lanes_within(r0, 0, rows);
        const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, m + r0), _mm512_maskz_loadu_ps(in, mx + r0));
        _mm512_storeu_ps(c + r0, vec_exp2_16_bf16(in, d));
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t a = first[r] - k0 < 0 ? 0 : first[r] - k0, b = last[r] - k0 + 1 > kn ? kn : last[r] - k0 + 1;
        uint32_t *pr = p + r * (KC / 2);
        if (a >= b) { /* (no keys of this row in the step: nothing changes but its probabilities, zeros) */
            for (int64_t j = 0; j < KC / 2; j += 16) _mm512_storeu_si512(pr + j, _mm512_setzero_si512());
            continue;
        }
        const float *sr = s + r * KC;
        const __m512 vm = _mm512_set1_ps(mx[r]);
        __m512 vsum = _mm512_setzero_ps();
        const int full = a == 0 && b == KC; /* (no masks to compute: the lanes' arithmetic alone) */
        for (int64_t j0 = 0; j0 < KC; j0 += 32) {
            const __mmask16 w0 = full ? 0xffff : lanes_within(j0, a, b), w1 = full ? 0xffff : lanes_within(j0 + 16, a, b);
            if (!(w0 | w1)) {
                _mm512_storeu_si512(pr + j0 / 2, _mm512_setzero_si512());
                continue;
            }
            /* (lanes outside [a, b) zero before the exp, so every value stays finite, and after it) */
            const __m512 e0 = vec_exp2_16_bf16(w0, _mm512_maskz_sub_ps(w0, _mm512_loadu_ps(sr + j0), vm));
            const __m512 e1 = w1 ? vec_exp2_16_bf16(w1, _mm512_maskz_sub_ps(w1, _mm512_loadu_ps(sr + j0 + 16), vm))
                                 : _mm512_setzero_ps();
            vsum = _mm512_add_ps(vsum, _mm512_add_ps(e0, e1));
            _mm512_storeu_si512(pr + j0 / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        l[r] = l[r] * c[r] + _mm512_reduce_add_ps(vsum);
        m[r] = mx[r];
        if (c[r] != 1.0f) {
            const __m512 vc = _mm512_set1_ps(c[r]);
            for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(vc, _mm512_loadu_ps(o + r * D + d)));
        }
    }
}
#endif

/* One step of an online softmax: rows of query heads of KV head h (queries scaled, in qs;
 * row r's running max m[r], sum l[r] and unnormalised output o[r]) over keys [k0, k0 + kn) of
 * the sequence, each row within its own range [first[r], last[r]]. blocks[key / BS - b0] holds
 * key's block (b0 > 0: a table that starts past the blocks nobody sees). s: scratch, KC per row.
 * bf: NULL, or the bfloat16 products' scratch (its q filled: the rows' queries as pairs). kvb:
 * whether the cache (k, v) holds bfloat16. */
static inline void attend_keys(const float *qs, float *o, float *m, float *l, const int64_t *first,
                               const int64_t *last, int64_t rows, float *s, const void *k, const void *v,
                               const int64_t *blocks, int64_t b0, int64_t k0, int64_t kn, int64_t h, int64_t KVH,
                               int64_t D, int64_t BS, const pairs_t *bf, int kvb) {
    const int64_t ncols = ((kn + BS - 1) / BS) * BS / VW;
#if AMX_PRODUCTS
    if (bf != NULL && bf->amx) { /* (the packed pairs: no block pointers to look up) */
        scores_amx(s, bf, bf->pk + h * bf->head_u32 + k0 * (D / 2), ncols, rows, D);
        softmax_pairs_amx(s, bf->p, o, m, l, first, last, rows, k0, kn, D);
        values_amx(o, bf, bf->pv + h * bf->head_u32 + k0 / 2 * D, (kn + 1) / 2, rows, D);
        return;
    }
#endif
    /* scores: the key vectors come from the step's cache blocks ([D][BS] each) */
    const char *col[KC / VW];
    const float *ksc[KC / VW]; /* (an int8 cache: the vectors' keys' scales) */
    for (int64_t u = 0; u < ncols; u++) {
        const int64_t key = k0 + u * VW;
        const char *head = kv_head(k, blocks[key / BS - b0], h, KVH, D, BS, kvb);
        col[u] = kv_at(head, key % BS, kvb);
        ksc[u] = kv_scales(head, D, BS) + key % BS;
    }
#if BF16_PRODUCTS
    if (bf != NULL)
        scores_bf16(s, bf, col, ncols, rows, D, BS, kvb, k0, h);
    else
#endif
    if (KV_BYTES(kvb)) {
        if (kvb == KV_F8)
            score_tiles(s, qs, col, ncols, rows, D, BS, KV_F8);
        else
            score_tiles(s, qs, col, ncols, rows, D, BS, KV_I8);
        scale_columns(s, ksc, ncols, rows, KV_SCALE(kvb));
    } else if (kvb)
        score_tiles(s, qs, col, ncols, rows, D, BS, KV_BF16);
    else
        score_tiles(s, qs, col, ncols, rows, D, BS, KV_F32);
    /* online softmax over this step's keys, row by row, within each row's range */
    for (int64_t r = 0; r < rows; r++) {
        int64_t a = first[r] - k0, b = last[r] - k0 + 1;
        a = a < 0 ? 0 : a;
        b = b > kn ? kn : b;
        float *sr = s + r * KC;
        if (a >= b) {
            memset(sr, 0, sizeof(float) * KC);
            continue;
        }
#if VW == 16
        /* 16 keys at a time, those outside [a, b) masked off (the scratch there may be stale): the
         * max, then e^(s - max) through vec_exp16 and its sum. glibc's vector expf and its scalar
         * tails took ~15% of a bf16 model's 512-token prefill attention on AMX tiles (perf). */
        __m512 vmx = _mm512_set1_ps(m[r]);
        for (int64_t j0 = a & ~(int64_t)15; j0 < b; j0 += 16)
            vmx = _mm512_mask_max_ps(vmx, lanes_within(j0, a, b), vmx, _mm512_loadu_ps(sr + j0));
        const float mx = _mm512_reduce_max_ps(vmx);
        const __m512 vm = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < KC; j0 += 16) {
            const __mmask16 within = lanes_within(j0, a, b);
            if (!within) { /* (past a causal row's last key, past the step's keys: zeros, no exp) */
                _mm512_storeu_ps(sr + j0, _mm512_setzero_ps());
                continue;
            }
            /* (bf16 products: scores in base 2 and probabilities rounded to bfloat16, vec_exp2_16_bf16 is
             * enough; lanes outside [a, b) are zero before the exp, so every value stays finite) */
            const __m512 x = _mm512_maskz_sub_ps(within, _mm512_loadu_ps(sr + j0), vm);
            const __m512 e = bf != NULL ? vec_exp2_16_bf16(within, x) : _mm512_maskz_mov_ps(within, vec_exp16(x));
            _mm512_storeu_ps(sr + j0, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        const float sum = _mm512_reduce_add_ps(vsum);
#else
        float mx = m[r];
        for (int64_t j = a; j < b; j++) mx = sr[j] > mx ? sr[j] : mx;
        float sum = 0.0f;
        for (int64_t j = 0; j < a; j++) sr[j] = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = a; j < b; j++) {
            sr[j] = expf(sr[j] - mx);
            sum += sr[j];
        }
        for (int64_t j = b; j < KC; j++) sr[j] = 0.0f;
#endif
        const float c = bf != NULL ? exp2f(m[r] - mx) : expf(m[r] - mx);
        l[r] = l[r] * c + sum;
        m[r] = mx;
        if (c != 1.0f)
            for (int64_t d = 0; d < D; d++) o[r * D + d] *= c;
    }
    const char *vblk[KC]; /* the step's value blocks */
    for (int64_t j0 = 0; j0 < kn; j0 += BS) vblk[j0 / BS] = kv_head(v, blocks[(k0 + j0) / BS - b0], h, KVH, D, BS, kvb);
#if BF16_PRODUCTS
    if (bf != NULL) {
        values_bf16(o, s, bf, vblk, kn, rows, D, BS, kvb, k0, h);
        return;
    }
#endif
    if (KV_BYTES(kvb)) {
        scale_probabilities(s, vblk, kn, rows, D, BS, KV_SCALE(kvb));
        if (kvb == KV_F8)
            value_tiles(o, s, vblk, kn, rows, D, BS, KV_F8);
        else
            value_tiles(o, s, vblk, kn, rows, D, BS, KV_I8);
    } else if (kvb)
        value_tiles(o, s, vblk, kn, rows, D, BS, KV_BF16);
    else
        value_tiles(o, s, vblk, kn, rows, D, BS, KV_F32);
}

/* A row's start: its query scaled into qs, its output zeroed; and its end: the output normalised. */
static inline void start_row(float *qs, float *o, const float *q, int64_t D, float scale) {
    for (int64_t d = 0; d < D; d++) qs[d] = q[d] * scale;
    memset(o, 0, sizeof(float) * D);
}
static inline void finish_row(float *dst, const float *o, float l, int64_t D) {
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
}
/* The same values rounded to bfloat16 as torch rounds them (f32_to_bf16): the output a bf16 o projection
 * reads, written at half the bytes and with no rounding pass of its own (paged_prefill_f32's out_bf16). */
static inline void finish_row_bf16(uint16_t *dst, const float *o, float l, int64_t D) {
    const float inv = 1.0f / l;
    int64_t d = 0;
#if VW == 16
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; d + 16 <= D; d += 16)
        _mm256_storeu_si256((__m256i *)(dst + d), bf16_round16(_mm512_mul_ps(_mm512_loadu_ps(o + d), vinv)));
#endif
    for (; d < D; d++) dst[d] = f32_to_bf16(o[d] * inv);
}

/* A thread's scratch: the task's queries (scaled) and outputs, row r at r * D; its scores, row r
 * at r * KC; with bf16, the pairs after them. Allocated once per thread (with room for the pairs)
 * and kept until the thread ends (the key's destructor frees it). Before, it was allocated and
 * freed on every call (320 KiB per thread, 544 with the pairs) for each layer of a step, and
 * glibc's malloc took ~5% of the engine thread's samples in a 32-request decode run (perf).
 * Decode steps, bf16 weights and cache, two runs each (benchmarks/decode_steps.py --prompt 256):
 * 4 requests 22.3-22.5 -> 21.2 ms, 16: 38.0-39.5 -> 35.0-37.5; 32 within the runs' noise.
 * NULL when it cannot be allocated. */
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void make_scratch_key(void) { pthread_key_create(&scratch_key, free); }

static float *alloc_scratch(pairs_t *pairs) {
    const size_t floats = ROWS * (2 * MAX_D + KC);
    pthread_once(&scratch_once, make_scratch_key);
    float *qs = pthread_getspecific(scratch_key);
    if (qs == NULL) {
        qs = aligned_alloc(64, sizeof(float) * floats + sizeof(uint32_t) * PAIRS_U32);
        if (qs == NULL || pthread_setspecific(scratch_key, qs) != 0) {
            free(qs);
            return NULL;
        }
    }
    pairs->q = (uint32_t *)(qs + floats);
#if BF16_PRODUCTS
    pairs->k = pairs->q + ROWS * MAX_D / 2;
    pairs->v = pairs->k + MAX_D / 2 * KC;
    pairs->p = pairs->v + KC / 2 * MAX_D;
    pairs->amx = 0;
#endif
    return qs;
}

/* One task: KV head h, positions [pb * ppt, pb * ppt + ppt) of the chunk. */
static void prefill_task(const float *q, const void *k, const void *v, const int64_t *blocks, void *out,
                         float *qs, int64_t n, int64_t ctx, int64_t window, int64_t H, int64_t KVH, int64_t D,
                         int64_t BS, int64_t q_stride, int64_t out_stride, float scale, int64_t pb, int64_t ppt,
                         int64_t h, const pairs_t *bf, int kvb, int out_bf16) {
    const int64_t G = H / KVH;
    float *o = qs + ROWS * MAX_D, *s = o + ROWS * MAX_D;

    const int64_t p0 = pb * ppt, p1 = p0 + ppt < n ? p0 + ppt : n;
    const int64_t rows = (p1 - p0) * G;
    float m[ROWS], l[ROWS];
    int64_t last[ROWS], first[ROWS]; /* each row's key range [first, last] (absolute) */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = p0 + r / G, g = r % G;
        start_row(qs + r * D, o + r * D, q + pos * q_stride + (h * G + g) * D, D, bf != NULL ? scale * LOG2E : scale);
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
        last[r] = ctx + pos;
        first[r] = window > 0 && ctx + pos - window + 1 > 0 ? ctx + pos - window + 1 : 0;
    }
#if BF16_PRODUCTS
    if (bf != NULL)
        for (int64_t r = 0; r < rows; r++) adjacent_pairs(bf->q + r * (MAX_D / 2), qs + r * D, D);
#endif
    const int64_t kbegin = (first[0] / BS) * BS, kend = ctx + p1;
    for (int64_t k0 = kbegin; k0 < kend; k0 += KC)
        attend_keys(qs, o, m, l, first, last, rows, s, k, v, blocks, 0, k0, kend - k0 < KC ? kend - k0 : KC, h,
                    KVH, D, BS, bf, kvb);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = p0 + r / G, g = r % G;
        const int64_t at = pos * out_stride + (h * G + g) * D;
        if (out_bf16)
            finish_row_bf16((uint16_t *)out + at, o + r * D, l[r], D);
        else
            finish_row((float *)out + at, o + r * D, l[r], D);
    }
}

/* Ask for the cache lines of one attend_keys call (KV head h, keys [k0, k0 + kn)) ahead of it: a decode
 * task's blocks lie anywhere in the cache, 1-4 KiB of a head's keys or values each, too short a run for
 * the hardware's prefetcher, so without it each step waited on memory (a decode step of 48 requests
 * at ~520 tokens read the bfloat16 cache at ~17 GB/s, twice that from cache). Into L2 (prefetcht1), not
 * L1: a call's 32 KiB asked into L1 (prefetcht0) were no faster than none on 2 Zen 4 cores, into L2 60
 * requests at 640 tokens went 16.1 -> 19.2 GB/s over a bfloat16 cache (13.9 -> 16.9 int8, 19.9 -> 22.3
 * float32; each build in one process, interleaved). */
static inline void prefetch_step(const void *k, const void *v, const int64_t *blocks, int64_t b0, int64_t k0, int64_t kn,
                                 int64_t h, int64_t KVH, int64_t D, int64_t BS, const int kvb) {
    const int64_t bytes = KV_BYTES(kvb) ? D * BS + 4 * BS : D * BS * (kvb ? 2 : 4);
    for (int64_t j0 = 0; j0 < kn; j0 += BS) {
        const int64_t blk = blocks[(k0 + j0) / BS - b0];
        const char *kh = kv_head(k, blk, h, KVH, D, BS, kvb), *vh = kv_head(v, blk, h, KVH, D, BS, kvb);
        for (int64_t c = 0; c < bytes; c += 64) {
            __builtin_prefetch(kh + c, 0, 2);
            __builtin_prefetch(vh + c, 0, 2);
        }
    }
}

/* Decode: one query of a request, KV heads [h0, h1), over its whole context (or its last
 * `window` positions: then its table starts at the window's first block). Per step of KC keys,
 * every head in turn, so the step's blocks are read while they are still in cache. */
static void decode_task(const float *q, const void *k, const void *v, const int64_t *blocks, int64_t len,
                        int64_t window, float *out, float *qs, int64_t h0, int64_t h1, int64_t G, int64_t KVH,
                        int64_t D, int64_t BS, float scale, int kvb) {
    float *o = qs + ROWS * MAX_D, *s = o + ROWS * MAX_D;
    const int64_t rows = (h1 - h0) * G, lo = window > 0 && len > window ? len - window : 0;
    float m[ROWS], l[ROWS];
    int64_t last[ROWS], first[ROWS];
    for (int64_t r = 0; r < rows; r++) {
        start_row(qs + r * D, o + r * D, q + h0 * G * D + r * D, D, scale);
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
        first[r] = lo;
        last[r] = len - 1;
    }
    const int64_t b0 = lo / BS;
    for (int64_t k0 = b0 * BS; k0 < len; k0 += KC)
        for (int64_t h = h0; h < h1; h++) {
            const int64_t r = (h - h0) * G;
            if (h + 1 < h1)
                prefetch_step(k, v, blocks, b0, k0, len - k0 < KC ? len - k0 : KC, h + 1, KVH, D, BS, kvb);
            else if (k0 + KC < len)
                prefetch_step(k, v, blocks, b0, k0 + KC, len - k0 - KC < KC ? len - k0 - KC : KC, h0, KVH, D, BS, kvb);
            attend_keys(qs + r * D, o + r * D, m + r, l + r, first + r, last + r, G, s, k, v, blocks, b0, k0,
                        len - k0 < KC ? len - k0 : KC, h, KVH, D, BS, NULL, kvb);
        }
    for (int64_t r = 0; r < rows; r++) finish_row(out + h0 * G * D + r * D, o + r * D, l[r], D);
}

/* Paged decode attention: one query token per request, the same tiles as the prefill (the G
 * query heads of a KV head are the rows), so the shapes paged_attention_f32_fits takes.
 *
 *   q        [n, H, D]                  query of each request (after RoPE)
 *   blocks   each request's block ids, request after request (with window > 0: from the block
 *            holding its first visible position, as attention.windowed leaves them)
 *   starts   [n + 1]                    request r owns blocks[starts[r] .. starts[r + 1])
 *   lens     [n]                        context length of request r (its query included)
 *   out      [n, H, D]
 *   kv_kind  what k and v (the cache) hold, as paged_prefill_f32 has it
 * Returns -1 when a thread's scratch could not be allocated (out is then incomplete), else 0. */
int paged_decode_f32(const float *q, const void *k, const void *v, const int64_t *blocks, const int64_t *starts,
                     const int64_t *lens, float *out, int64_t n, int64_t window, int64_t H, int64_t KVH, int64_t D,
                     int64_t BS, float scale, int64_t kv_kind) {
    const int64_t G = H / KVH;
    /* One task per request when there are enough of them (each step's blocks, all heads, read
     * while in cache); with fewer requests than threads, each request's heads are split. */
    const int64_t threads = omp_get_max_threads();
    int64_t splits = n >= threads ? 1 : (threads + n - 1) / n;
    splits = splits > KVH ? KVH : splits;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        pairs_t unused;
        float *qs = alloc_scratch(&unused);
        failed = qs == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n * splits; task++) {
            const int64_t r = task / splits, part = task % splits;
            if (qs != NULL)
                decode_task(q + r * H * D, k, v, blocks + starts[r], lens[r], window, out + r * H * D, qs,
                            part * KVH / splits, (part + 1) * KVH / splits, G, KVH, D, BS, scale, (int)kv_kind);
        }
    }
    return failed ? -1 : 0;
}

/* A one-byte cache's keys and values for a prefill chunk without AMX tiles: positions [0, ctx) dequantized
 * and the chunk's own [ctx, ctx + n) as the projection gave them (raw), into fk and fv, float32 blocks in the
 * cache's layout (local block b holding positions b BS ..), zeros past the last position. The chunk then
 * attends to its own keys unquantized, as the torch path and vLLM do (and as pack_kv_pairs has it on AMX
 * tiles); the copy is ~1/n of the attention's work. */
static void dequantize_context(float *fk, float *fv, const void *k, const void *v, const int64_t *blocks,
                               int64_t nblk, int64_t KVH, int64_t D, int64_t BS, const raw_kv_t *raw, const int kvb) {
    const int64_t end = raw->ctx + raw->n;
#pragma omp for schedule(static) collapse(2)
    for (int64_t b = 0; b < nblk; b++)
        for (int64_t h = 0; h < KVH; h++) {
            float *kd = fk + (b * KVH + h) * D * BS, *vd = fv + (b * KVH + h) * BS * D;
            const int64_t p0 = b * BS;
            if (p0 < raw->ctx) { /* (cached positions in the block: the whole block, its later slots overwritten) */
                const char *kh = kv_head(k, blocks[b], h, KVH, D, BS, kvb), *vh = kv_head(v, blocks[b], h, KVH, D, BS, kvb);
                const float *ks = kv_scales(kh, D, BS), *vs = kv_scales(vh, D, BS);
                for (int64_t d = 0; d < D; d++)
                    for (int64_t j = 0; j < BS; j += VW) {
                        vf sc;
                        for (int i = 0; i < VW; i++) sc[i] = ks[j + i] * KV_SCALE(kvb);
                        vstore(kd + d * BS + j, kvload(kh, d * BS + j, kvb) * sc);
                    }
                for (int64_t j = 0; j < BS; j++)
                    for (int64_t d = 0; d < D; d += VW)
                        vstore(vd + j * D + d, kvload(vh, j * D + d, kvb) * (vs[j] * KV_SCALE(kvb)));
            }
            for (int64_t j = 0; j < BS; j++) {
                const int64_t pos = p0 + j;
                if (pos < raw->ctx) continue;
                const float *kr = pos < end ? raw->k + (pos - raw->ctx) * raw->k_stride + h * D : NULL;
                const float *vr = pos < end ? raw->v + (pos - raw->ctx) * raw->v_stride + h * D : NULL;
                for (int64_t d = 0; d < D; d++) {
                    kd[d * BS + j] = kr != NULL ? kr[d] : 0.0f;
                    vd[j * D + d] = vr != NULL ? vr[d] : 0.0f;
                }
            }
        }
}

/* How paged_prefill_f32 multiplies in bfloat16: 0 it cannot (built without bf16 dot products), 1
 * with AVX-512 bf16 dot products, 2 on AMX tiles (built for them and granted by the kernel). */
int paged_prefill_bf16_products(void) { return BF16_PRODUCTS ? 1 + (AMX_PRODUCTS && amx_products()) : 0; }

int paged_prefill_f32(const float *q, const void *k, const void *v, const int64_t *blocks, void *out,
                       int64_t n, int64_t ctx, int64_t window, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                       int64_t q_stride, int64_t out_stride, float scale, int64_t bf16_products, int64_t kv_kind,
                       int64_t out_bf16, const float *k_new, const float *v_new, int64_t k_new_stride,
                       int64_t v_new_stride) {
    int bf16 = BF16_PRODUCTS && bf16_products;
    /* on AMX tiles: the keys and values as pairs, once for the call (pack_kv_pairs), and tasks of as
     * many positions as the rows take (fewer tasks: each rounds its queries and probabilities) */
    uint32_t *pk = NULL, *pv = NULL;
    /* (a step's tiles read up to KC keys past its first, which a windowed task's steps start at a
     * block, not a multiple of KC: room for KC more keys) */
    const int64_t nkeys = ctx + n, nkeys_kc = (nkeys + KC - 1) / KC * KC + KC, head_u32 = nkeys_kc * D / 2;
#if AMX_PRODUCTS
    if (bf16 && amx_products()) {
        pk = aligned_alloc(64, sizeof(uint32_t) * KVH * head_u32);
        pv = aligned_alloc(64, sizeof(uint32_t) * KVH * head_u32);
        if (pk == NULL || pv == NULL) { /* (then the vdpbf16ps products) */
            free(pk);
            free(pv);
            pk = pv = NULL;
        }
    }
#endif
    const int amx = pk != NULL;
    /* a one-byte cache without the tiles: its context dequantized and the chunk's own keys and values raw, in a
     * float32 copy of the blocks the call reads instead (dequantize_context); without memory for it, or without
     * the raw keys, the bytes read in place (a chunk's own keys then quantized) with float32 products */
    float *fk = NULL, *fv = NULL;
    int64_t *fblocks = NULL;
    const int64_t nblk = (ctx + n + BS - 1) / BS;
    if (KV_BYTES(kv_kind) && !amx && k_new != NULL && v_new != NULL) {
        fk = aligned_alloc(64, sizeof(float) * nblk * KVH * D * BS);
        fv = aligned_alloc(64, sizeof(float) * nblk * KVH * D * BS);
        fblocks = malloc(sizeof(int64_t) * nblk);
        if (fk == NULL || fv == NULL || fblocks == NULL) {
            free(fk), free(fv), free(fblocks);
            fk = fv = NULL, fblocks = NULL;
        }
    }
    const raw_kv_t raw = {k_new, v_new, k_new_stride, v_new_stride, ctx, n};
    if (fk != NULL) {
#pragma omp parallel
        dequantize_context(fk, fv, k, v, blocks, nblk, KVH, D, BS, &raw, (int)kv_kind);
        for (int64_t b = 0; b < nblk; b++) fblocks[b] = b;
        k = fk, v = fv, blocks = fblocks, kv_kind = KV_F32;
    }
    if (KV_BYTES(kv_kind) && !amx) bf16 = 0; /* (a one-byte cache's bf16 products: on AMX tiles only, pack_kv_pairs) */
    const int64_t ppt = amx ? ROWS / (H / KVH) : PB;
    const int64_t pblocks = (n + ppt - 1) / ppt; /* tasks run last positions first: the most keys, so the
                                                   * dynamic schedule ends balanced */
    const int64_t tasks = pblocks * KVH;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        pairs_t pairs, *bf = bf16 ? &pairs : NULL;
        float *qs = alloc_scratch(&pairs);
        failed = qs == NULL;
#if AMX_PRODUCTS
        if (amx) { /* the tiles' shapes, on each thread (oneDNN loads its own) */
            pack_kv_pairs(pk, pv, head_u32, nkeys, nkeys_kc, k, v, blocks, KVH, D, BS, (int)kv_kind,
                          KV_BYTES(kv_kind) && k_new != NULL && v_new != NULL ? &raw : NULL);
            amx_configure();
            pairs.amx = 1;
            pairs.pk = pk;
            pairs.pv = pv;
            pairs.head_u32 = head_u32;
        }
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (qs != NULL) prefill_task(q, k, v, blocks, out, qs, n, ctx, window, H, KVH, D, BS, q_stride,
                                         out_stride, scale, pblocks - 1 - task / KVH, ppt, task % KVH, bf,
                                         (int)kv_kind, out_bf16 != 0);
        }
#if AMX_PRODUCTS
        if (amx) _tile_release();
#endif
    }
    free(pk);
    free(pv);
    free(fk), free(fv), free(fblocks);
    return failed ? -1 : 0;
}
