/* Prompt attention over paged K/V in float32 with AVX-512: a step's prompt chunks (each the
 * last rows of its sequence, its K/V already stored) attend causally over their pages where
 * they lie, as the AMX kernel does for bf16 (cpu_amx.c).
 *
 * Why: torch's flash kernel took 4.0 of a 17 s float32 prefill of 32 x 512 tokens (SmolLM2,
 * Intel Xeon): its keys gathered from the pages and a mask built per step, and every score
 * of a 512-token chunk's square computed (its key blocks are 512 long), where the causal half
 * suffices.
 *
 * How, per work item (a chunk, a query head, 32 query tokens: two vectors, one per lane):
 *   S^T [keys x 32 queries]: each key's scores are two vectors, the sum over dims of the key's
 *   value (broadcast once for both) times the queries' values of that dim (Q^T, packed once
 *   per item); the softmax runs down the keys (each lane's running maximum and sum are vector
 *   lanes); O^T [dims x 32 queries] += V's value (broadcast once for both) times P^T, kept in
 *   memory by dims and rescaled when a lane's maximum grows (online softmax, blocks of 32 keys).
 *   Items of 16 queries loaded a key's value per multiply-add; two vectors halve the loads:
 *   0.66x the time for 4 x 512 tokens a layer (SmolLM2's heads), the same bits where there
 *   is no window (a block past the first vector's last query adds only masked zeros to it).
 * Head size 64 or 128. Built by trae_kernels/cpu_native.py like cpu_paged.c (AVX-512 builds;
 * an AVX2 twin below, float32 only). AVX-512 builds take bf16 queries and pages too (``bf``),
 * each output rounded to bf16 once (prefill_attention_bf16). With AVX512-BF16 (Zen 4 and 5)
 * both products run on vdpbf16ps, two products a lane an instruction, as torch's flash kernel
 * runs them on bf16 matmuls: scores by pairs of dims, and P rounded to bf16 for its product
 * with V by pairs of keys (the softmax's sums stay float32); 4 x 512 tokens a layer of
 * SmolLM2's heads took 2.0 against 3.7 ms, and a 32 x 512-token bf16 prefill 4.45 against
 * 4.75 s, its errors against the float32 oracle those of torch's kernel. Without it each
 * value is widened exactly where it is loaded, the rest as float32's.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_prompt_args.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
typedef struct {
    const void *query, *k_cache, *v_cache; /* float32, or bf16 (AVX-512 builds) */
    int64_t q_rs, page_s, tok_s, head_s, page_size;
    const int64_t *tables;
    int64_t tab_s;
    int64_t heads, kv_heads;
    float scale;
    int64_t window;
    void *out;
    int64_t out_rs;
    int64_t esize; /* bytes a value */
} Args;

/* The rows of keys [k0, k0 + n) of KV head kh where they lie, walking the pages (one division
 * a block, not one a key: the page size is not a constant here) */
static inline void rows_of(const Args *a, const void *cache, const int64_t *table, int64_t k0,
                           int64_t n, int64_t kh, const char **row) {
    const int64_t e = a->esize;
    int64_t page = k0 / a->page_size, at = k0 % a->page_size;
    const char *base = (const char *)cache + (table[page] * a->page_s + kh * a->head_s) * e;
    for (int64_t j = 0; j < n; j++) {
        row[j] = base + at * a->tok_s * e;
        if (++at == a->page_size && j + 1 < n) {
            at = 0;
            base = (const char *)cache + (table[++page] * a->page_s + kh * a->head_s) * e;
        }
    }
}
#endif

#ifdef __AVX512F__
#include "cpu_vec.h"

#define LANES 16  /* query tokens per vector */
#define QUERIES 32 /* query tokens per item: two vectors */
#define KEYS 32   /* keys per softmax block */
#define GROUP 8   /* keys whose scores are summed at once (accumulators in registers) */
#define MAX_DIM 128

/* S^T rows of n keys (their K rows) into s0[j] and s1[j] (the item's two vectors of queries;
 * n <= KEYS), GROUP keys at a time: each key's value loaded once serves both. */
/* value d of a row of float32 (bf == 0) or bf16 (widened exactly), in every lane */
static inline __attribute__((always_inline)) __m512 bcast(const char *row, int d, const int bf) {
    if (bf)
        return _mm512_castsi512_ps(_mm512_set1_epi32((int32_t)((const uint16_t *)row)[d] << 16));
    return _mm512_set1_ps(((const float *)row)[d]);
}

static inline __attribute__((always_inline)) void scores(const char *const *rows, int64_t n,
                                                         const __m512 *qt0, const __m512 *qt1,
                                                         const int dim, const int bf, __m512 *s0,
                                                         __m512 *s1) {
    for (int64_t j = 0; j < n; j += GROUP) {
        const char *k[GROUP];
        __m512 acc0[GROUP], acc1[GROUP];
        for (int i = 0; i < GROUP; i++) {
            k[i] = rows[j + i < n ? j + i : n - 1];
            acc0[i] = acc1[i] = _mm512_setzero_ps();
        }
        for (int d = 0; d < dim; d++) {
            const __m512 q0 = qt0[d], q1 = qt1[d];
            for (int i = 0; i < GROUP; i++) {
                const __m512 kd = bcast(k[i], d, bf);
                acc0[i] = _mm512_fmadd_ps(kd, q0, acc0[i]);
                acc1[i] = _mm512_fmadd_ps(kd, q1, acc1[i]);
            }
        }
        for (int i = 0; i < GROUP; i++) {
            s0[j + i] = acc0[i];
            s1[j + i] = acc1[i];
        }
    }
}

#ifdef __AVX512BF16__
#define PAIRS 1 /* bf16 products by pairs: scores by dims, the weighing by keys */
/* S^T of bf16 K rows, as scores() but two dims a multiply-add: vdpbf16ps adds both products
 * of a lane's pair (exact, bf16 times bf16) to its float32 sum, the odd dim's then the even's,
 * where scores() widened each value through a general register and took one dim an
 * instruction; qp0/qp1 hold the queries' dims in pairs (Q^T of 32-bit words), unscaled, and
 * each score is scaled once. */
static inline __attribute__((always_inline)) void scores_pairs(const char *const *rows, int64_t n,
                                                               const __m512i *qp0,
                                                               const __m512i *qp1, const int dim,
                                                               __m512 scale, __m512 *s0,
                                                               __m512 *s1) {
    for (int64_t j = 0; j < n; j += GROUP) {
        const int32_t *k[GROUP];
        __m512 acc0[GROUP], acc1[GROUP];
        for (int i = 0; i < GROUP; i++) {
            k[i] = (const int32_t *)rows[j + i < n ? j + i : n - 1];
            acc0[i] = acc1[i] = _mm512_setzero_ps();
        }
        for (int p = 0; p < dim / 2; p++) {
            const __m512bh q0 = (__m512bh)qp0[p], q1 = (__m512bh)qp1[p];
            for (int i = 0; i < GROUP; i++) {
                const __m512bh kp = (__m512bh)_mm512_set1_epi32(k[i][p]);
                acc0[i] = _mm512_dpbf16_ps(acc0[i], kp, q0);
                acc1[i] = _mm512_dpbf16_ps(acc1[i], kp, q1);
            }
        }
        for (int i = 0; i < GROUP; i++) {
            s0[j + i] = _mm512_mul_ps(acc0[i], scale);
            s1[j + i] = _mm512_mul_ps(acc1[i], scale);
        }
    }
}

/* The block's V rows as pairs of keys (key 2m's value of a dim in the low half of a 32-bit
 * word, key 2m + 1's in the high: vp[m][d]) and each vector's P^T as the same pairs, rounded
 * to bf16 as torch's flash kernel rounds P for its bf16 product with V (the softmax's sums
 * stay float32). An odd last key pairs with a copy of itself whose P is 0. */
/* word indices: i and 32 + i (two rows' dims 0-15, then 16-31); i and 16 + i (two halves) */
static const int16_t EVEN_ODD_LO[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                        37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                        11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const int16_t EVEN_ODD_HI[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                        53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                        27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
static const int16_t LANE_PAIRS[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                       21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

static inline __attribute__((always_inline)) void v_pairs(const char *const *v, int64_t nk,
                                                          const int dim, int32_t *vp) {
    const __m512i lo = _mm512_loadu_si512(EVEN_ODD_LO), hi = _mm512_loadu_si512(EVEN_ODD_HI);
    for (int64_t m = 0; 2 * m < nk; m++) {
        const bf16 *a = (const bf16 *)v[2 * m];
        const bf16 *b = (const bf16 *)v[2 * m + 1 < nk ? 2 * m + 1 : 2 * m];
        for (int d0 = 0; d0 < dim; d0 += 32) {
            const __m512i x = _mm512_loadu_si512(a + d0), y = _mm512_loadu_si512(b + d0);
            _mm512_storeu_si512(vp + m * MAX_DIM + d0, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_storeu_si512(vp + m * MAX_DIM + d0 + 16, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

static inline __attribute__((always_inline)) void p_pairs(const __m512 *s, int64_t nk,
                                                          __m512i *pp) {
    const __m512i order = _mm512_loadu_si512(LANE_PAIRS);
    for (int64_t m = 0; 2 * m < nk; m++) {
        const __m512 odd = 2 * m + 1 < nk ? s[2 * m + 1] : _mm512_setzero_ps();
        pp[m] = _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(odd, s[2 * m]));
    }
}

/* O^T's 8 dims from d0 of both vectors += V times P^T over the block's key pairs */
static inline __attribute__((always_inline)) void weigh_pairs(const int32_t *vp,
                                                              const __m512i *pp0,
                                                              const __m512i *pp1, int64_t pairs,
                                                              int first_too, int d0, __m512 *acc0,
                                                              __m512 *acc1) {
    for (int64_t m = 0; m < pairs; m++) {
        const __m512bh p0 = (__m512bh)pp0[m], p1 = (__m512bh)pp1[m];
        for (int i = 0; i < 8; i++) {
            const __m512bh vd = (__m512bh)_mm512_set1_epi32(vp[m * MAX_DIM + d0 + i]);
            if (first_too) acc0[i] = _mm512_dpbf16_ps(acc0[i], vd, p0);
            acc1[i] = _mm512_dpbf16_ps(acc1[i], vd, p1);
        }
    }
}
#else
#define PAIRS 0
#endif

/* One vector of queries' online softmax over a block of scores (s becomes P^T): returns the
 * factor its sums so far are rescaled by (1 where its maximum did not grow: *grew is 0 where
 * no lane's did). */
static inline __attribute__((always_inline)) __m512 softmax_block(__m512 *s, int64_t nk,
                                                                  int64_t k0, int whole,
                                                                  __m512i pos, int64_t window,
                                                                  __m512 *best, __m512 *total,
                                                                  __mmask16 *grew_out) {
    __mmask16 seen[KEYS];
    __m512 most = *best;
    for (int64_t j = 0; j < nk; j++) {
        seen[j] = whole ? 0xffff : sees(k0 + j, pos, window);
        most = _mm512_mask_max_ps(most, seen[j], most, s[j]);
    }
    /* lanes whose maximum grew rescale what they summed (exp(-inf) = 0 on the first) */
    const __mmask16 grew = _mm512_cmp_ps_mask(most, *best, _CMP_GT_OQ);
    *grew_out = grew;
    __m512 alpha = _mm512_set1_ps(1.0f);
    if (grew) {
        alpha = _mm512_mask_blend_ps(grew, alpha, exp16(_mm512_sub_ps(*best, most)));
        *total = _mm512_mul_ps(*total, alpha);
        *best = most;
    }
    for (int64_t j = 0; j < nk; j++) {
        s[j] = _mm512_maskz_mov_ps(seen[j], exp16(_mm512_sub_ps(s[j], *best)));
        *total = _mm512_add_ps(*total, s[j]);
    }
    return alpha;
}

static inline __attribute__((always_inline)) void attend_lanes(const Args *a, int64_t table_row,
                                                               int64_t first_row, int64_t rows,
                                                               int64_t ctx, int64_t h,
                                                               int64_t qb, const int dim,
                                                               const int bf) {
    const int64_t group = a->heads / a->kv_heads, kh = h / group;
    const int64_t first = qb * QUERIES, n = rows - first < QUERIES ? rows - first : QUERIES;
    const int64_t pos0 = ctx - rows + first, top = pos0 + n - 1;
    const int64_t *table = a->tables + table_row * a->tab_s;
    __m512 qt0[MAX_DIM], qt1[MAX_DIM], o0[MAX_DIM], o1[MAX_DIM], s0[KEYS], s1[KEYS];
    __m512i qp0[MAX_DIM / 2], qp1[MAX_DIM / 2];
#if PAIRS
    int32_t vp[KEYS / 2 * MAX_DIM]; /* a block's V rows as pairs of keys, with P^T's pairs */
    __m512i pp0[KEYS / 2], pp1[KEYS / 2];
#endif
    int32_t lane[QUERIES];
    for (int i = 0; i < QUERIES; i++)
        lane[i] = (int32_t)(i < n ? i : n - 1); /* lanes past the chunk repeat its last query */
    const int64_t q_at = (first_row + first) * a->q_rs + h * dim;
    const __m512 scale = _mm512_set1_ps(a->scale);
    const int pairs = bf && PAIRS;
    for (int d = 0; d < dim; d++) o0[d] = o1[d] = _mm512_setzero_ps();
    for (int half = 0; pairs && half < 2; half++) { /* Q^T of pairs: 16 rows, 16 pairs a time */
        __m512i *qp = half ? qp1 : qp0;
        for (int p0 = 0; p0 < dim / 2; p0 += 16) {
            __m512 x[16];
            for (int i = 0; i < LANES; i++) {
                const bf16 *row = (const bf16 *)a->query + q_at + lane[half * LANES + i] * a->q_rs;
                x[i] = _mm512_loadu_ps((const float *)row + p0);
            }
            transpose16(x); /* 32-bit words: the pair's bits move as one */
            for (int k = 0; k < 16; k++) qp[p0 + k] = _mm512_castps_si512(x[k]);
        }
    }
    for (int half = 0; !pairs && half < 2; half++) { /* Q^T: 16 queries' rows, 16 at a time */
        __m512 *qt = half ? qt1 : qt0;
        for (int d0 = 0; d0 < dim; d0 += 16) {
            __m512 x[16];
            for (int i = 0; i < LANES; i++) {
                const int64_t at = q_at + lane[half * LANES + i] * a->q_rs + d0;
                x[i] = bf ? load16_bf16((const bf16 *)a->query + at)
                          : load16_f32((const float *)a->query + at);
            }
            transpose16(x);
            for (int k = 0; k < 16; k++) qt[d0 + k] = _mm512_mul_ps(x[k], scale);
        }
    }
    const __m512i base = _mm512_set1_epi32((int32_t)pos0);
    const __m512i pos_0 = _mm512_add_epi32(base, _mm512_loadu_si512(lane));
    const __m512i pos_1 = _mm512_add_epi32(base, _mm512_loadu_si512(lane + LANES));
    const int64_t last0 = pos0 + (n < LANES ? n : LANES) - 1; /* the first vector's last query */
    int64_t lo = 0;
    if (a->window > 0 && pos0 - a->window + 1 > 0) lo = pos0 - a->window + 1;
    const int64_t whole_lo = a->window > 0 ? top - a->window + 1 : 0;
    __m512 best0 = _mm512_set1_ps(-__builtin_inff()), total0 = _mm512_setzero_ps();
    __m512 best1 = best0, total1 = total0;
    for (int64_t k0 = lo; k0 <= top; k0 += KEYS) {
        const int64_t nk = top - k0 + 1 < KEYS ? top - k0 + 1 : KEYS;
        const char *kr[KEYS], *v[KEYS];
        rows_of(a, a->k_cache, table, k0, nk, kh, kr);
        rows_of(a, a->v_cache, table, k0, nk, kh, v);
#if PAIRS
        if (pairs)
            scores_pairs(kr, nk, qp0, qp1, dim, scale, s0, s1);
        else
#endif
            scores(kr, nk, qt0, qt1, dim, bf, s0, s1);
        const int whole = k0 >= whole_lo && k0 + nk - 1 <= pos0;
        /* the first vector sees no key past its last query: blocks past it add nothing to it
         * (all its lanes masked: P^T zeros), as the blocks a 16-query item never reached */
        const int first_too = k0 <= last0;
        __mmask16 grew0 = 0, grew1;
        const __m512 alpha0 = first_too ? softmax_block(s0, nk, k0, whole, pos_0, a->window,
                                                        &best0, &total0, &grew0)
                                        : _mm512_set1_ps(1.0f);
        const __m512 alpha1 =
            softmax_block(s1, nk, k0, whole, pos_1, a->window, &best1, &total1, &grew1);
#if PAIRS
        if (pairs) {
            v_pairs(v, nk, dim, vp);
            if (first_too) p_pairs(s0, nk, pp0);
            p_pairs(s1, nk, pp1);
        }
#endif
        for (int d0 = 0; d0 < dim; d0 += 8) { /* 8 dims of both vectors in registers */
            __m512 acc0[8], acc1[8];
            for (int i = 0; i < 8; i++) { /* rescaled where a maximum grew (x 1 is x) */
                acc0[i] = grew0 ? _mm512_mul_ps(o0[d0 + i], alpha0) : o0[d0 + i];
                acc1[i] = grew1 ? _mm512_mul_ps(o1[d0 + i], alpha1) : o1[d0 + i];
            }
#if PAIRS
            if (pairs)
                weigh_pairs(vp, pp0, pp1, (nk + 1) / 2, first_too, d0, acc0, acc1);
            else
#endif
            if (first_too)
                for (int64_t j = 0; j < nk; j++)
                    for (int i = 0; i < 8; i++) {
                        const __m512 vd = bcast(v[j], d0 + i, bf);
                        acc0[i] = _mm512_fmadd_ps(vd, s0[j], acc0[i]);
                        acc1[i] = _mm512_fmadd_ps(vd, s1[j], acc1[i]);
                    }
            else
                for (int64_t j = 0; j < nk; j++)
                    for (int i = 0; i < 8; i++)
                        acc1[i] = _mm512_fmadd_ps(bcast(v[j], d0 + i, bf), s1[j], acc1[i]);
            for (int i = 0; i < 8; i++) {
                o0[d0 + i] = acc0[i];
                o1[d0 + i] = acc1[i];
            }
        }
    }
    for (int half = 0; half < 2; half++) { /* O^T back to rows: 16 queries' values at a time */
        const __m512 *o = half ? o1 : o0;
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), half ? total1 : total0);
        for (int d0 = 0; d0 < dim; d0 += 16) {
            __m512 x[16];
            for (int k = 0; k < 16; k++) x[k] = _mm512_mul_ps(o[d0 + k], inv);
            transpose16(x);
            for (int64_t i = 0; i < LANES && half * LANES + i < n; i++) {
                const int64_t row = (first_row + first + half * LANES + i) * a->out_rs + h * dim;
                if (bf)
                    store16_bf16((bf16 *)a->out + row + d0, x[i]); /* rounded once, as torch */
                else
                    _mm512_storeu_ps((float *)a->out + row + d0, x[i]);
            }
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include "cpu_vec2.h"
/* The same kernel with AVX2 and FMA only (an EPYC of the Zen 3 generation), where torch's
 * flash kernel took 6.6 of a 43 s float32 run of 32 x 512 prompts (SmolLM2, 64 new tokens):
 * 8 lanes, so an item is 16 queries (two vectors), a key's scores summed 6 keys at a time and
 * the weighted sum 6 dims at a time (sixteen 8-lane registers); the masks are vectors; the
 * exp is the AVX2 decode kernel's polynomial. */
#include <immintrin.h>

#define LANES 8    /* query tokens per vector */
#define QUERIES 16 /* query tokens per item: two vectors */
#define KEYS 48    /* keys per softmax block */
/* keys whose scores are summed at once: 6 keys by 2 vectors are 12 independent sums, enough to
 * keep both FMA pipes busy through their latency where 4 (8 sums) left them waiting: 30 layers
 * of 4 x 512-token chunks took 0.85x the time (blocks of 24, 36 or 48 keys alike; 30: 0.92x) */
#define GROUP 6
#define MAX_DIM 128

/* lanes (queries at positions pos) that see key k: k <= pos, and within the window */
static inline __m256 sees(int64_t k, __m256i pos, int64_t window) {
    const __m256i key = _mm256_set1_epi32((int32_t)k);
    __m256i m = _mm256_cmpgt_epi32(_mm256_add_epi32(pos, _mm256_set1_epi32(1)), key);
    if (window > 0)
        m = _mm256_and_si256(
            m, _mm256_cmpgt_epi32(key, _mm256_sub_epi32(pos, _mm256_set1_epi32((int32_t)window))));
    return _mm256_castsi256_ps(m);
}

static inline __attribute__((always_inline)) void scores(const char *const *rows, int64_t n,
                                                         const __m256 *qt0, const __m256 *qt1,
                                                         const int dim, __m256 *s0, __m256 *s1) {
    for (int64_t j = 0; j < n; j += GROUP) {
        const float *k[GROUP];
        __m256 acc0[GROUP], acc1[GROUP];
        for (int i = 0; i < GROUP; i++) {
            k[i] = (const float *)rows[j + i < n ? j + i : n - 1];
            acc0[i] = acc1[i] = _mm256_setzero_ps();
        }
        for (int d = 0; d < dim; d++) {
            const __m256 q0 = qt0[d], q1 = qt1[d];
            for (int i = 0; i < GROUP; i++) {
                const __m256 kd = _mm256_broadcast_ss(k[i] + d);
                acc0[i] = _mm256_fmadd_ps(kd, q0, acc0[i]);
                acc1[i] = _mm256_fmadd_ps(kd, q1, acc1[i]);
            }
        }
        for (int i = 0; i < GROUP; i++) {
            s0[j + i] = acc0[i];
            s1[j + i] = acc1[i];
        }
    }
}

/* One vector of queries' online softmax over a block of scores (s becomes P^T): the factor
 * its sums so far are rescaled by; *grew_out is 0 where no lane's maximum grew. */
static inline __attribute__((always_inline)) __m256 softmax_block(__m256 *s, int64_t nk,
                                                                  int64_t k0, int whole,
                                                                  __m256i pos, int64_t window,
                                                                  __m256 *best, __m256 *total,
                                                                  int *grew_out) {
    __m256 seen[KEYS];
    const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    __m256 most = *best;
    for (int64_t j = 0; j < nk; j++) {
        seen[j] = whole ? all : sees(k0 + j, pos, window);
        most = _mm256_blendv_ps(most, _mm256_max_ps(most, s[j]), seen[j]);
    }
    const __m256 grew = _mm256_cmp_ps(most, *best, _CMP_GT_OQ);
    *grew_out = _mm256_movemask_ps(grew);
    __m256 alpha = _mm256_set1_ps(1.0f);
    if (*grew_out) {
        alpha = _mm256_blendv_ps(alpha, exp8(_mm256_sub_ps(*best, most)), grew);
        *total = _mm256_mul_ps(*total, alpha);
        *best = most;
    }
    for (int64_t j = 0; j < nk; j++) {
        s[j] = _mm256_and_ps(seen[j], exp8(_mm256_sub_ps(s[j], *best)));
        *total = _mm256_add_ps(*total, s[j]);
    }
    return alpha;
}

/* O^T's dims [d0, d0 + n) += V's values times P^T over a block of keys, after the rescale; n is
 * 6 or 4 (a constant once inlined). perf showed the 4-dim loop this replaced load-bound: gcc
 * folded each key's two P vectors into every multiply-add, 12 loads for 8 of them, and 8 sums
 * left both FMA pipes waiting through their latency. P now stays in registers and 6 dims are
 * 12 sums: 30 layers of 4 x 512-token chunks took 0.80-0.84x the time, the same bits. */
static inline __attribute__((always_inline)) void weigh(const char *const *v_, const __m256 *s0,
                                                        const __m256 *s1, int64_t nk,
                                                        int first_too, int d0, const int n,
                                                        int grew0, __m256 alpha0, int grew1,
                                                        __m256 alpha1, __m256 *o0, __m256 *o1) {
    const float *const *v = (const float *const *)v_;
    __m256 acc0[6], acc1[6];
    for (int i = 0; i < n; i++) {
        acc0[i] = grew0 ? _mm256_mul_ps(o0[d0 + i], alpha0) : o0[d0 + i];
        acc1[i] = grew1 ? _mm256_mul_ps(o1[d0 + i], alpha1) : o1[d0 + i];
    }
    if (first_too)
        for (int64_t j = 0; j < nk; j++) {
            __m256 p0 = s0[j], p1 = s1[j];
            __asm__("" : "+x"(p0), "+x"(p1)); /* kept in registers, not folded into each FMA */
            for (int i = 0; i < n; i++) {
                const __m256 vd = _mm256_broadcast_ss(v[j] + d0 + i);
                acc0[i] = _mm256_fmadd_ps(vd, p0, acc0[i]);
                acc1[i] = _mm256_fmadd_ps(vd, p1, acc1[i]);
            }
        }
    else
        for (int64_t j = 0; j < nk; j++) {
            __m256 p1 = s1[j];
            __asm__("" : "+x"(p1));
            for (int i = 0; i < n; i++)
                acc1[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(v[j] + d0 + i), p1, acc1[i]);
        }
    for (int i = 0; i < n; i++) {
        o0[d0 + i] = acc0[i];
        o1[d0 + i] = acc1[i];
    }
}

static inline __attribute__((always_inline)) void attend_lanes(const Args *a, int64_t table_row,
                                                               int64_t first_row, int64_t rows,
                                                               int64_t ctx, int64_t h,
                                                               int64_t qb, const int dim) {
    const int64_t group = a->heads / a->kv_heads, kh = h / group;
    const int64_t first = qb * QUERIES, n = rows - first < QUERIES ? rows - first : QUERIES;
    const int64_t pos0 = ctx - rows + first, top = pos0 + n - 1;
    const int64_t *table = a->tables + table_row * a->tab_s;
    __m256 qt0[MAX_DIM], qt1[MAX_DIM], o0[MAX_DIM], o1[MAX_DIM], s0[KEYS], s1[KEYS];
    int32_t lane[QUERIES];
    for (int i = 0; i < QUERIES; i++)
        lane[i] = (int32_t)(i < n ? i : n - 1); /* lanes past the chunk repeat its last query */
    const float *q = (const float *)a->query + (first_row + first) * a->q_rs + h * dim;
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (int half = 0; half < 2; half++) { /* Q^T: 8 queries' rows, 8 values at a time */
        __m256 *qt = half ? qt1 : qt0;
        for (int d0 = 0; d0 < dim; d0 += 8) {
            __m256 x[8];
            for (int i = 0; i < LANES; i++)
                x[i] = _mm256_loadu_ps(q + lane[half * LANES + i] * a->q_rs + d0);
            transpose8(x);
            for (int k = 0; k < 8; k++) {
                qt[d0 + k] = _mm256_mul_ps(x[k], scale);
                o0[d0 + k] = o1[d0 + k] = _mm256_setzero_ps();
            }
        }
    }
    const __m256i base = _mm256_set1_epi32((int32_t)pos0);
    const __m256i pos_0 = _mm256_add_epi32(base, _mm256_loadu_si256((const __m256i *)lane));
    const __m256i pos_1 =
        _mm256_add_epi32(base, _mm256_loadu_si256((const __m256i *)(lane + LANES)));
    const int64_t last0 = pos0 + (n < LANES ? n : LANES) - 1; /* the first vector's last query */
    int64_t lo = 0;
    if (a->window > 0 && pos0 - a->window + 1 > 0) lo = pos0 - a->window + 1;
    const int64_t whole_lo = a->window > 0 ? top - a->window + 1 : 0;
    __m256 best0 = _mm256_set1_ps(-__builtin_inff()), total0 = _mm256_setzero_ps();
    __m256 best1 = best0, total1 = total0;
    for (int64_t k0 = lo; k0 <= top; k0 += KEYS) {
        const int64_t nk = top - k0 + 1 < KEYS ? top - k0 + 1 : KEYS;
        const char *kr[KEYS], *v[KEYS];
        rows_of(a, a->k_cache, table, k0, nk, kh, kr);
        rows_of(a, a->v_cache, table, k0, nk, kh, v);
        scores(kr, nk, qt0, qt1, dim, s0, s1);
        const int whole = k0 >= whole_lo && k0 + nk - 1 <= pos0;
        const int first_too = k0 <= last0; /* blocks past the first vector add nothing to it */
        int grew0 = 0, grew1;
        const __m256 alpha0 = first_too ? softmax_block(s0, nk, k0, whole, pos_0, a->window,
                                                        &best0, &total0, &grew0)
                                        : _mm256_set1_ps(1.0f);
        const __m256 alpha1 =
            softmax_block(s1, nk, k0, whole, pos_1, a->window, &best1, &total1, &grew1);
        const int sixes = (dim / 6) & ~1; /* 6-dim groups, the rest (a multiple of 4) by 4 */
        for (int g = 0; g < sixes; g++)
            weigh(v, s0, s1, nk, first_too, 6 * g, 6, grew0, alpha0, grew1, alpha1, o0, o1);
        for (int d0 = 6 * sixes; d0 < dim; d0 += 4)
            weigh(v, s0, s1, nk, first_too, d0, 4, grew0, alpha0, grew1, alpha1, o0, o1);
    }
    for (int half = 0; half < 2; half++) { /* O^T back to rows: 8 queries' values at a time */
        const __m256 *o = half ? o1 : o0;
        const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), half ? total1 : total0);
        for (int d0 = 0; d0 < dim; d0 += 8) {
            __m256 x[8];
            for (int k = 0; k < 8; k++) x[k] = _mm256_mul_ps(o[d0 + k], inv);
            transpose8(x);
            for (int64_t i = 0; i < LANES && half * LANES + i < n; i++) {
                const int64_t row = (first_row + first + half * LANES + i) * a->out_rs + h * dim;
                _mm256_storeu_ps((float *)a->out + row + d0, x[i]);
            }
        }
    }
}

#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#ifdef __AVX512F__
#define ATTEND(a, t, f, r, c, h, qb, dim, bf) attend_lanes(a, t, f, r, c, h, qb, dim, bf)
#else /* AVX2 builds: float32 only */
#define ATTEND(a, t, f, r, c, h, qb, dim, bf) attend_lanes(a, t, f, r, c, h, qb, dim)
#endif

/* Every chunk's rows of ``out`` (chunk c: rows first_row[c] .. + rows[c], the last rows of a
 * context of ctx[c] tokens whose pages are tables row table_row[c]). 0 on success, 1 where
 * the shapes are not this kernel's (nothing written). */
static int prefill(const Args *a, const int64_t *table_row, const int64_t *first_row,
                   const int64_t *rows, const int64_t *ctx, int64_t chunks, int64_t dim,
                   int nthreads) {
    const int bf = a->esize == 2; /* bf16 values (AVX-512 builds), else float32 */
    if ((dim != 64 && dim != 128) || a->kv_heads <= 0 || a->heads % a->kv_heads) return 1;
    int64_t *start = malloc((size_t)(chunks + 1) * sizeof(int64_t)); /* items before chunk c */
    if (!start) return 1;
    start[0] = 0;
    for (int64_t c = 0; c < chunks; c++)
        start[c + 1] = start[c] + a->heads * ((rows[c] + QUERIES - 1) / QUERIES);
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t item = 0; item < start[chunks]; item++) {
        int64_t c = 0;
        while (item >= start[c + 1]) c++;
        const int64_t blocks = (rows[c] + QUERIES - 1) / QUERIES, rest = item - start[c];
        const int64_t h = rest / blocks, qb = blocks - 1 - rest % blocks; /* longest first */
        const int64_t t = table_row[c], f = first_row[c], r = rows[c], n = ctx[c];
        if (dim == 64 && bf)
            ATTEND(a, t, f, r, n, h, qb, 64, 1);
        else if (dim == 64)
            ATTEND(a, t, f, r, n, h, qb, 64, 0);
        else if (bf)
            ATTEND(a, t, f, r, n, h, qb, 128, 1);
        else
            ATTEND(a, t, f, r, n, h, qb, 128, 0);
    }
    free(start);
    return 0;
}

/* prefill's entry for values of type T */
#define DEFINE_PROMPT_ENTRY(T)                                                               \
    int prefill_attention_##T(PROMPT_ARGS(T)) {                                              \
        const Args a = {query,  k_cache, v_cache,  q_rs,  page_s, tok_s, head_s, page_size,   \
                        tables, tab_s,   heads,    kv_heads, scale, window, out, out_rs,      \
                        sizeof(T)};                                                           \
        return prefill(&a, table_row, first_row, rows, ctx, chunks, dim, nthreads);         \
    }
typedef float f32;
DEFINE_PROMPT_ENTRY(f32)
#ifdef __AVX512F__
/* The same over bf16 queries and pages: values widened exactly, scores, softmax and sums in
 * float32, each output rounded to bf16 once. For AMD CPUs with AVX512-BF16 and no AMX (Zen 4
 * and 5), whose bf16 chunks ran zentorch's SDPA over K/V gathered from the pages. */
DEFINE_PROMPT_ENTRY(bf16)
#endif
#endif
