/* AVX-512 helpers shared by the CPU kernels (cpu_paged.c, cpu_amx.c, cpu_prompt.c): bf16 loads and
 * stores with the scalar f32_to_bf16's rounding, and a vector exp for softmax scores. */
#ifndef TRAE_CPU_VEC_H
#define TRAE_CPU_VEC_H
#include <immintrin.h>

#include "cpu_exp2.h"
#include <stdint.h>

typedef uint16_t bf16;

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 widen16_bf16(__m256i h) { /* 16 bf16 as float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16_bf16(const bf16 *p) {
    return widen16_bf16(_mm256_loadu_si256((const __m256i *)p));
}
static inline void store16_f32(float *p, __m512 x) { _mm512_storeu_ps(p, x); }
/* 32 values of a row as two float32 vectors, for sums kept per value (a weighted sum of V):
 * float32 in order; bf16 as the even values, then the odd ones (a shift, a mask: half the
 * instructions of widening 16 in order). order32_T puts such sums back in row order. */
static inline void load32_f32(const float *p, __m512 *a, __m512 *b) {
    *a = load16_f32(p);
    *b = load16_f32(p + 16);
}
static inline void load32_bf16(const bf16 *p, __m512 *a, __m512 *b) {
    const __m512i pairs = _mm512_loadu_si512(p);
    *a = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    *b = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void order32_f32(__m512 *a, __m512 *b) { (void)a, (void)b; }
static inline void order32_bf16(__m512 *a, __m512 *b) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 first = _mm512_permutex2var_ps(*a, lo, *b);
    *b = _mm512_permutex2var_ps(*a, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), *b);
    *a = first;
}
/* f32_to_bf16's rounding (to nearest even, NaN quieted) of 16 floats, as integers */
static inline __m512 round_bf16_int(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)),
                             _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(r);
}
/* 16 floats as bf16 with f32_to_bf16's bits: on a CPU with AVX512-BF16 by its conversion, one
 * instruction for ~10 (the SiLU-and-product of a 2,048-row SmolLM2 step 1.07 -> 0.83 ms);
 * it flushes float32 subnormals to zero, so a vector holding one takes the integer rounding */
static inline __m256i bf16_of16(__m512 x) {
#if defined(__AVX512BF16__)
    if (__builtin_expect(!_mm512_fpclass_ps_mask(x, 0x20), 1))
        return (__m256i)_mm512_cvtneps_pbh(x);
#endif
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16_int(x)), 16));
}
static inline __m512 round_bf16_16(__m512 x) { /* f32_to_bf16's rounding, kept as float32 */
#if defined(__AVX512BF16__)
    return widen16_bf16(bf16_of16(x));
#else
    return round_bf16_int(x);
#endif
}
static inline void store16_bf16(bf16 *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, bf16_of16(x));
}

/* x[i] lane k <- x[k] lane i: a 16 x 16 block of floats transposed in registers (64 shuffles,
 * where 16 gathers of a column each cost about as much as 40 of them on a Zen 5 EPYC) */
static inline __attribute__((always_inline)) void transpose16(__m512 x[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) { /* pairs of rows interleaved by 32-bit lanes */
        t[i] = _mm512_unpacklo_ps(x[i], x[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(x[i], x[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) /* then by 64-bit lanes: four rows' lanes in each quarter */
        for (int j = 0; j < 2; j++) {
            const __m512d a = _mm512_castps_pd(t[i + j]), b = _mm512_castps_pd(t[i + j + 2]);
            x[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            x[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    for (int i = 0; i < 4; i++) { /* then quarters: rows 0-7's, and rows 8-15's */
        t[i] = _mm512_shuffle_f32x4(x[i], x[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(x[i], x[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(x[i + 8], x[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(x[i + 8], x[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) { /* and halves */
        x[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        x[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Gather and scatter offsets of 16 elements ``stride`` apart: 0, stride, ..., 15 stride */
static inline __m512i strided16(int32_t stride) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_mullo_epi32(lanes, _mm512_set1_epi32(stride));
}

static inline __m512 exp16(__m512 x) { /* x <= 0: a score minus the running maximum */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n); /* 2^x = 2^n * 2^f, f in [-0.5, 0.5] */
    const __m512 p = EXP2_POLY(_mm512_set1_ps, _mm512_fmadd_ps, f);
    return _mm512_scalef_ps(p, n);
}

/* Prompt kernels (cpu_amx.c, cpu_prompt.c): the lanes (queries at positions pos) that may see
 * key k: k <= pos and, with a window, k > pos - window. */
static inline __mmask16 sees(int64_t k, __m512i pos, int64_t window) {
    const __m512i key = _mm512_set1_epi32((int32_t)k);
    __mmask16 m = _mm512_cmple_epi32_mask(key, pos);
    if (window > 0)
        m &= _mm512_cmpgt_epi32_mask(key, _mm512_sub_epi32(pos, _mm512_set1_epi32((int32_t)window)));
    return m;
}
#endif
