/* AVX2 and FMA helpers shared by the CPU kernels' 8-lane builds (cpu_paged.c, cpu_prompt.c,
 * onednn_calls.c), for CPUs without AVX-512: bf16 loads, roundings and stores, a horizontal
 * sum and the softmax's vector exp. */
#ifndef TRAE_CPU_VEC2_H
#define TRAE_CPU_VEC2_H
#include <immintrin.h>

#include "cpu_exp2.h"
#include <stdint.h>

typedef uint16_t bf16;

/* 8 bf16 as float32, exactly (a bf16's bits are a float32's top half) */
static inline __m256 load8_bf16(const bf16 *p) {
    const __m128i half = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
/* 8 float32 rounded to bf16 as cpu_vec.h's round_bf16_int rounds 16 (to nearest, ties to
 * even; a NaN quieted, its payload kept), as float32 bits */
static inline __m256i round8_bf16_int(__m256 x) {
    const __m256i u = _mm256_castps_si256(x), top = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), top);
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, top), _mm256_set1_epi32(0x00400000));
    return _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
/* round8_bf16_int kept as float32: a bf16 step's rounding between two float32 operations */
static inline __m256 round8_bf16(__m256 x) { return _mm256_castsi256_ps(round8_bf16_int(x)); }
static inline void store8_bf16(bf16 *p, __m256 x) {
    const __m256i r = _mm256_srli_epi32(round8_bf16_int(x), 16);
    const __m256i pairs = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(pairs));
}

/* x[i] lane k <- x[k] lane i: an 8 x 8 block of floats transposed in registers (24 shuffles,
 * in place of 8 gathers of a column) */
static inline __attribute__((always_inline)) void transpose8(__m256 x[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) { /* pairs of rows interleaved by 32-bit lanes */
        t[i] = _mm256_unpacklo_ps(x[i], x[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(x[i], x[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) /* four rows' lanes j and j + 4 */
        for (int j = 0; j < 2; j++) {
            u[i + 2 * j] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0x44);
            u[i + 2 * j + 1] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0xee);
        }
    for (int i = 0; i < 4; i++) { /* the two halves: rows 0-3's and rows 4-7's */
        x[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        x[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* The largest of x[0..n) and start (x aligned to 32 bytes), as the scalar loop ``t = x > t ? x :
 * t`` finds it (NaNs passed over alike). gcc kept that loop's t in memory, a store and a reload
 * a key: a fifth of a decode step's attention. */
static inline float block_max8(const float *x, int64_t n, float start) {
    __m256 m = _mm256_set1_ps(start);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_load_ps(x + i), m);
    __m128 h = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    h = _mm_max_ps(_mm_movehl_ps(h, h), h);
    h = _mm_max_ss(_mm_movehdup_ps(h), h);
    float top = _mm_cvtss_f32(h);
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}
static inline __m256 exp8(__m256 x) { /* x <= 0: a score minus the running maximum */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n); /* 2^x = 2^n * 2^f, f in [-0.5, 0.5] */
    const __m256 p = EXP2_POLY(_mm256_set1_ps, _mm256_fmadd_ps, f);
    /* n >= -126 after the clamp: 2^n is a normal float made from its exponent bits */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif
