/* The float vector the C kernels compute with (cpu_attention.c, cpu_kernels.c), for the ISA they are
 * built for: VEC_W lanes (16 with AVX-512, 8 with AVX2, else 4), and its loads, bfloat16 included. */
#ifndef PDSERVE_CPU_VEC_H
#define PDSERVE_CPU_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC_W 16
#elif defined(__AVX2__)
#define VEC_W 8
#else
#define VEC_W 4
#endif
#if VEC_W == 16 || VEC_W == 8
#include <immintrin.h>
#endif

/* float32 <-> bfloat16, one value: widening exactly (bfloat16 is a float32's upper half); rounding to
 * nearest even as torch rounds, NaN to a quiet NaN (in integers: -ffast-math may drop a float
 * comparison with NaN). Shared by cpu_kernels.c and cpu_amx.c. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Through the vector type itself (aligned(4): unaligned access is allowed; gcc lets a vector alias
 * its element type): a memcpy of 32 bytes became two 16-byte halves through the stack with AVX2. */
typedef float vecf __attribute__((vector_size(VEC_W * 4), aligned(4)));
static inline vecf vecf_load(const float *p) { return *(const vecf *)p; }

/* VEC_W bfloat16 values widened to float32 (each the upper half of a float32): a zero-extending load
 * and a shift. In intrinsics: gcc split __builtin_convertvector's 16 lanes into halves, extracts and
 * inserts. Measured on 2 Zen 4 cores: the decode attention of 16 requests at 520 tokens over a
 * bfloat16 cache, 30 layers, 12.4 -> 10.8 ms (a float32 cache: 16.6); SmolLM2's 30 layers of bf16
 * projections at one row (the few-rows matmul), 10.7 -> 9.7 ms, ~22 GB/s of weights. */
static inline vecf vecf_load_bf16(const uint16_t *p) {
#if VEC_W == 16
    return (vecf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif VEC_W == 8
    return (vecf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    vecf out;
    for (int i = 0; i < VEC_W; i++) {
        const uint32_t u = (uint32_t)p[i] << 16;
        memcpy(&out[i], &u, sizeof u);
    }
    return out;
#endif
}

/* VEC_W int8 values widened to float32 (an int8 KV cache's, kv_quant.py: each token's scale applied
 * after, to its scores or probabilities): a sign-extending load and a conversion. */
static inline vecf vecf_load_i8(const int8_t *p) {
#if VEC_W == 16
    return (vecf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif VEC_W == 8
    return (vecf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vecf out;
    for (int i = 0; i < VEC_W; i++) out[i] = (float)p[i];
    return out;
#endif
}

/* VEC_W fp8 e4m3 values (an fp8 KV cache's) widened to float32 / 256: each byte's sign, exponent and
 * mantissa moved into a float16's (whose exponent bias is 8 more) by one shift up and an arithmetic one
 * down (the sign copied into bit 14, then cleared), then the float16 widened; the caller folds the 2^8
 * into the token's scale. e4m3's subnormals land on float16's, its NaN (never written: the cache's
 * values are clamped to +-448) on a finite value. */
static inline vecf vecf_load_e4m3_div256(const uint8_t *p) {
#if VEC_W == 16
    const __m256i b = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8);
    return (vecf)_mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(b, 1), _mm256_set1_epi16((short)0xbf80)));
#elif VEC_W == 8
    const __m128i b = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8);
    return (vecf)_mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(b, 1), _mm_set1_epi16((short)0xbf80)));
#else
    vecf out;
    for (int i = 0; i < VEC_W; i++) {
        const int e = (p[i] >> 3) & 15, m = p[i] & 7;
        const float a = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        out[i] = (p[i] & 0x80 ? -a : a) / 256.0f;
    }
    return out;
#endif
}

#if VEC_W == 16
/* 16 lanes of float32 -> bfloat16 as f32_to_bf16 rounds them (NaN to 0x7fc0); cpu_kernels.c, cpu_amx.c */
static inline __m256i bf16_round16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

/* e^x for 16 lanes: 2^k e^r with k = round(x log2 e) and r = x - k ln 2 (ln 2 split in two), e^r by
 * its Taylor polynomial to r^7 (|r| <= ln 2 / 2: relative error ~1e-8, below float32's ulp), scaled
 * by 2^k in one vscalefps; x clamped to [-104, 88.7], so the answer stays finite (a NaN x stays NaN:
 * min and max hand back their second operand when it is NaN). In glibc's vector expf's place in
 * SwiGLU (cpu_kernels.c) and the attention's softmax (cpu_attention.c). */
static inline __m512 vec_exp16(__m512 x) {
    const __m512 t = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(88.7f), x));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), t);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

/* g / (1 + e^-g) * u for 16 lanes (SwiGLU: cpu_kernels.c, and cpu_amx.c's fused gate_up): the
 * reciprocal from vrcp14ps (14 bits) and one Newton step */
static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), vec_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    __m512 y = _mm512_rcp14_ps(d);
    y = _mm512_mul_ps(y, _mm512_fnmadd_ps(d, y, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(_mm512_mul_ps(g, y), u);
}

/* 2^y for y <= 0 where the answer is rounded to bfloat16 after (an attention's probabilities with
 * bf16 products, its scores in base 2), zero in the lanes off `keep`: 2^floor(y) 2^f, 2^f on [0, 1) by
 * a degree-3 polynomial fitted for the least largest relative error (7.5e-5, a 26th of bfloat16's
 * rounding), 2^floor(y) and the zeroing in one vscalefps. 8 operations a vector with the softmax's
 * subtraction and sum, against 13 through vec_exp16. */
static inline __m512 vec_exp2_16_bf16(__mmask16 keep, __m512 y) {
    const __m512 fl = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, fl);
    __m512 p = _mm512_set1_ps(0.07802451401948929f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2260671705007553f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6958335638046265f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999251961708069f));
    return _mm512_maskz_scalef_ps(keep, p, fl);
}
#endif
#endif
