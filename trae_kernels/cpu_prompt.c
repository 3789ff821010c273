/* Prompt attention over paged K/V in float32 with AVX-512: a step's prompt chunks (each the
 * last rows of its sequence, its K/V already stored) attend causally over their pages where
 * they lie, as the AMX kernel does for bf16 (cpu_amx.c).
 *
 * Why: torch's flash kernel took 4.0 of a 17 s float32 prefill of 32 x 512 tokens (SmolLM2,
 * Intel Xeon): its keys gathered from the pages and a mask built per step, and every score
 * of a 512-token chunk's square computed (its key blocks are 512 long), where the causal half
 * suffices.
 *
 * How, per work item (a chunk, a query head, 16 query tokens, one per vector lane):
 *   S^T [keys x 16 queries]: each key's scores are a vector, the sum over dims of the key's
 *   value (broadcast) times the queries' values of that dim (Q^T, packed once per item);
 *   the softmax runs down the keys (each lane's running maximum and sum are vector lanes);
 *   O^T [dims x 16 queries] += V's value (broadcast) times P^T, kept in memory by dims and
 *   rescaled when a lane's maximum grows (online softmax, blocks of 32 keys).
 * Head size 64 or 128. Built by trae_kernels/cpu_native.py like cpu_paged.c (AVX-512 builds).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include "cpu_vec.h"

#define LANES 16  /* query tokens per item */
#define KEYS 32   /* keys per softmax block */
#define GROUP 8   /* keys whose scores are summed at once (accumulators in registers) */
#define MAX_DIM 128

typedef struct {
    const float *query, *k_cache, *v_cache;
    int64_t q_rs, page_s, tok_s, head_s, page_size;
    const int64_t *tables;
    int64_t tab_s;
    int64_t heads, kv_heads;
    float scale;
    int64_t window;
    float *out;
    int64_t out_rs;
} Args;

static inline const float *row_of(const Args *a, const float *cache, const int64_t *table,
                                  int64_t k, int64_t kh) {
    return cache + table[k / a->page_size] * a->page_s + (k % a->page_size) * a->tok_s +
           kh * a->head_s;
}

/* S^T rows of keys [k0, k0 + n) into s[j] (n <= KEYS), GROUP keys at a time. */
static inline __attribute__((always_inline)) void scores(const Args *a, const int64_t *table,
                                                         int64_t kh, int64_t k0, int64_t n,
                                                         const __m512 *qt, const int dim,
                                                         __m512 *s) {
    for (int64_t j = 0; j < n; j += GROUP) {
        const float *k[GROUP];
        __m512 acc[GROUP];
        for (int i = 0; i < GROUP; i++) {
            k[i] = row_of(a, a->k_cache, table, k0 + (j + i < n ? j + i : n - 1), kh);
            acc[i] = _mm512_setzero_ps();
        }
        for (int d = 0; d < dim; d++) {
            const __m512 q = qt[d];
            for (int i = 0; i < GROUP; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(k[i][d]), q, acc[i]);
        }
        for (int i = 0; i < GROUP; i++) s[j + i] = acc[i];
    }
}

static inline __attribute__((always_inline)) void attend_lanes(const Args *a, int64_t table_row,
                                                               int64_t first_row, int64_t rows,
                                                               int64_t ctx, int64_t h,
                                                               int64_t qb, const int dim) {
    const int64_t group = a->heads / a->kv_heads, kh = h / group;
    const int64_t first = qb * LANES, n = rows - first < LANES ? rows - first : LANES;
    const int64_t pos0 = ctx - rows + first, top = pos0 + n - 1;
    const int64_t *table = a->tables + table_row * a->tab_s;
    __m512 qt[MAX_DIM], o[MAX_DIM], s[KEYS];
    int32_t lane[LANES], at[LANES];
    for (int i = 0; i < LANES; i++) {
        lane[i] = (int32_t)(i < n ? i : n - 1); /* lanes past the chunk repeat its last query */
        at[i] = (int32_t)(lane[i] * a->q_rs);
    }
    const __m512i index = _mm512_loadu_si512(at);
    const float *q = a->query + (first_row + first) * a->q_rs + h * dim;
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int d = 0; d < dim; d++) {
        qt[d] = _mm512_mul_ps(_mm512_i32gather_ps(index, q + d, 4), scale);
        o[d] = _mm512_setzero_ps();
    }
    const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32((int32_t)pos0), _mm512_loadu_si512(lane));
    int64_t lo = 0;
    if (a->window > 0 && pos0 - a->window + 1 > 0) lo = pos0 - a->window + 1;
    const int64_t whole_lo = a->window > 0 ? top - a->window + 1 : 0;
    __m512 best = _mm512_set1_ps(-__builtin_inff()), total = _mm512_setzero_ps();
    for (int64_t k0 = lo; k0 <= top; k0 += KEYS) {
        const int64_t nk = top - k0 + 1 < KEYS ? top - k0 + 1 : KEYS;
        scores(a, table, kh, k0, nk, qt, dim, s);
        const int whole = k0 >= whole_lo && k0 + nk - 1 <= pos0;
        __mmask16 seen[KEYS];
        __m512 most = best;
        for (int64_t j = 0; j < nk; j++) {
            seen[j] = whole ? 0xffff : sees(k0 + j, pos, a->window);
            most = _mm512_mask_max_ps(most, seen[j], most, s[j]);
        }
        /* lanes whose maximum grew rescale what they summed (exp(-inf) = 0 on the first) */
        const __mmask16 grew = _mm512_cmp_ps_mask(most, best, _CMP_GT_OQ);
        if (grew) {
            const __m512 alpha = _mm512_mask_blend_ps(
                grew, _mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(best, most)));
            total = _mm512_mul_ps(total, alpha);
            for (int d = 0; d < dim; d++) o[d] = _mm512_mul_ps(o[d], alpha);
            best = most;
        }
        const float *v[KEYS];
        for (int64_t j = 0; j < nk; j++) { /* s becomes P^T */
            s[j] = _mm512_maskz_mov_ps(seen[j], exp16(_mm512_sub_ps(s[j], best)));
            total = _mm512_add_ps(total, s[j]);
            v[j] = row_of(a, a->v_cache, table, k0 + j, kh);
        }
        for (int d0 = 0; d0 < dim; d0 += 16) { /* 16 dims' sums in registers over the block */
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = o[d0 + i];
            for (int64_t j = 0; j < nk; j++)
                for (int i = 0; i < 16; i++)
                    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(v[j][d0 + i]), s[j], acc[i]);
            for (int i = 0; i < 16; i++) o[d0 + i] = acc[i];
        }
    }
    float lanes_of[MAX_DIM][LANES] __attribute__((aligned(64)));
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), total);
    for (int d = 0; d < dim; d++) _mm512_store_ps(lanes_of[d], _mm512_mul_ps(o[d], inv));
    for (int64_t i = 0; i < n; i++) {
        float *row = a->out + (first_row + first + i) * a->out_rs + h * dim;
        for (int d = 0; d < dim; d++) row[d] = lanes_of[d][i];
    }
}

/* Every chunk's rows of ``out`` (chunk c: rows first_row[c] .. + rows[c], the last rows of a
 * context of ctx[c] tokens whose pages are tables row table_row[c]). 0 on success, 1 where
 * the shapes are not this kernel's (nothing written). */
int prefill_attention_f32(const float *query, int64_t q_rs, const float *k_cache,
                          const float *v_cache, int64_t page_s, int64_t tok_s, int64_t head_s,
                          int64_t page_size, const int64_t *tables, int64_t tab_s,
                          const int64_t *table_row, const int64_t *first_row,
                          const int64_t *rows, const int64_t *ctx, int64_t chunks,
                          int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                          int64_t window, float *out, int64_t out_rs, int nthreads) {
    if ((dim != 64 && dim != 128) || kv_heads <= 0 || heads % kv_heads) return 1;
    int64_t *start = malloc((size_t)(chunks + 1) * sizeof(int64_t)); /* items before chunk c */
    if (!start) return 1;
    start[0] = 0;
    for (int64_t c = 0; c < chunks; c++)
        start[c + 1] = start[c] + heads * ((rows[c] + LANES - 1) / LANES);
    const Args a = {query, k_cache, v_cache, q_rs, page_s, tok_s, head_s, page_size, tables,
                    tab_s, heads, kv_heads, scale, window, out, out_rs};
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t item = 0; item < start[chunks]; item++) {
        int64_t c = 0;
        while (item >= start[c + 1]) c++;
        const int64_t blocks = (rows[c] + LANES - 1) / LANES, rest = item - start[c];
        const int64_t h = rest / blocks, qb = blocks - 1 - rest % blocks; /* longest first */
        if (dim == 64)
            attend_lanes(&a, table_row[c], first_row[c], rows[c], ctx[c], h, qb, 64);
        else
            attend_lanes(&a, table_row[c], first_row[c], rows[c], ctx[c], h, qb, 128);
    }
    free(start);
    return 0;
}
#endif
