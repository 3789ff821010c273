/* AVX2 and FMA helpers shared by the CPU kernels' 8-lane builds (cpu_paged.c, cpu_prompt.c),
 * for CPUs without AVX-512: a horizontal sum and the softmax's vector exp. */
#ifndef TRAE_CPU_VEC2_H
#define TRAE_CPU_VEC2_H
#include <immintrin.h>

#include "cpu_exp2.h"
#include <stdint.h>

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
