/* Attention over paged K/V with AMX tiles: bf16 queries, keys and values, float32 scores,
 * softmax and sums.
 *
 * Prompts (prefill_attention_amx). A step's prompt chunks (each the last rows of its sequence, its
 * K/V already stored) attend causally over their sequence's pages where they lie: no gathered
 * copy of the context, no mask tensor, and no score past the causal edge computed.
 *
 * Why: on an Intel Xeon with AMX a 32 x 512-token bf16 prefill of SmolLM2 spent 1.18 of 2.96 s
 * in attention (torch's flash kernel, its keys gathered from the pages and a mask built per
 * step), where its linears (oneDNN on AMX) took 1.20 s for ~27x the multiply-adds.
 *
 * How, per work item (a chunk, a query head, a block of 16 query tokens):
 *   S^T [16 keys x 16 queries] = K rows (one page's 16 tokens, loaded as an AMX tile where
 *   they lie) x Q^T (the 16 queries' dims in pairs, packed once per item);
 *   the softmax runs down the keys, so each query's running maximum and sum are lanes of one
 *   vector: no horizontal reductions. One pass over the keys sums exp(s - ref) and
 *   accumulates O^T [dims x queries] += V^T x P^T in four tiles; a lane's reference maximum
 *   is raised (and its sums rescaled, the tiles stored and loaded back) only when a score
 *   passes it by SLACK, which after the first blocks is rare. V^T is packed once per chunk
 *   and KV head, P^T written in key pairs as the tiles take them.
 * Head size 64 (four O^T tiles) or 128 (two passes, each over 64 output dims, each computing
 * the scores), pages of a multiple of 16 tokens. A sliding window masks
 * keys too far back, as the causal edge does.
 *
 * Decodes (decode_attention_amx, cpu_paged.c's decode_attention_bf16 with the same arguments):
 * one query token per row attends over its pages; the scores of a KV head's query heads come
 * from one tile product per page of 16 keys (the page's K rows as they lie times the heads'
 * Q^T), where the AVX-512 loop reduced a 64-wide dot product per key and head (SmolLM2's
 * heads, 32 rows over 540 keys: its 30 layers took 25 ms from memory). The softmax and the
 * weighted sum of V are the AVX-512 loop's. Head sizes 64 and 128; other shapes go to the
 * function bound as the fallback (decode_attention_bf16).
 *
 * Built by trae_kernels/cpu_native.py like cpu_paged.c; without AMX (and AVX512-BF16) in the
 * build, only amx_init is defined and answers 0.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "cpu_prompt_args.h"
#include "cpu_tiles.h"
#include "cpu_vec.h"

#define MAX_DIM 128  /* head sizes this kernel takes: 64 and 128 */
#define OUT_DIMS 64  /* the output dims four O^T tiles hold: head size 128 takes two passes */
#define TILE 16      /* rows of a tile: queries per item, keys per K tile */
#define KEYS 32      /* keys per step of the loop: two S^T tiles, one P^T tile */
#define SLACK 11.5f  /* how far a score (base 2) may pass its lane's reference maximum (~2,900x) */

typedef void (*decode_fn)(const bf16 *query, int64_t q_rs, const bf16 *k_cache,
                          const bf16 *v_cache, int64_t page_s, int64_t tok_s, int64_t head_s,
                          int64_t page_size, const int64_t *tables, int64_t tab_s,
                          const int64_t *row_seq, const int64_t *row_pos, int64_t rows,
                          int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                          int64_t window, bf16 *out, int64_t out_rs, int nthreads);
static decode_fn fallback;

/* Ask the kernel for the AMX tile state and take the decode kernel for shapes these tiles do
 * not take; 1 where this process may use AMX. */
int amx_init(void *decode_fallback) {
    fallback = (decode_fn)decode_fallback;
    return request_tiles();
}

/* 2^t for the prompt kernel's scores, t <= 0 (2^-150 and below give 0): a degree-4 polynomial
 * fitted to 2^f on [-1/2, 1/2], 2.9e-6 relative, where exp16's degree 6 gives float32's last
 * bits. Its P is rounded to bf16 (2^-9) before the products; the sums and the rescales take
 * the same error, so it cancels in the normalized output. */
static inline __m512 exp2_16(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.582853426e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.590642846e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402409863e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931241930e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The tiles (cpu_tiles.h's configuration): in the prompt kernel 0 S^T, then P^T; 1 K's rows,
 * then V^T's; 2-3 Q^T's halves (loaded once per item); 4-7 O^T. */

typedef struct {
    const bf16 *query, *k_cache, *v_cache;
    int64_t q_rs, page_s, tok_s, head_s, page_size;
    const int64_t *tables;
    int64_t tab_s;
    int64_t heads, kv_heads, dim;
    float scale;
    int64_t window;
    bf16 *out;
    int64_t out_rs;
} Args;

typedef struct {
    int64_t table_row, first_row, rows, ctx, padded; /* padded: ctx rounded up to KEYS */
    bf16 *vt;                                        /* V^T [kv_heads][dim][padded] */
} Chunk;

/* Where token k0's row of KV head kh lies in ``cache`` (the next tokens of its page follow
 * every tok_s elements) */
static inline const bf16 *key_rows(const Args *a, const bf16 *cache, const int64_t *table,
                                   int64_t k0, int64_t kh) {
    return cache + table[k0 / a->page_size] * a->page_s + (k0 % a->page_size) * a->tok_s +
           kh * a->head_s;
}

/* V^T of keys [k0, k0 + KEYS) of one KV head: each pair of dims of 16 keys (one page's) is
 * gathered as 16 dwords, and the two halves of two such gathers split into the dims' rows.
 * Keys past the context are zeros (their P is 0, and 0 times a stale page's NaN would not be). */
static void pack_values(const Args *a, const Chunk *c, int64_t kh, int64_t k0) {
    const int64_t *table = a->tables + c->table_row * a->tab_s;
    bf16 *vt = c->vt + kh * a->dim * c->padded + k0;
    const int32_t *base[2];
    __mmask16 live[2];
    for (int half = 0; half < 2; half++) {
        const int64_t k = k0 + half * TILE, n = c->ctx - k;
        live[half] = n >= TILE ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
        base[half] = (const int32_t *)(n > 0 ? key_rows(a, a->v_cache, table, k, kh) : a->v_cache);
    }
    const __m512i rows = strided16((int32_t)(a->tok_s / 2));
    /* even elements of the two gathers, then the odd ones: dim 2i's and dim 2i+1's rows */
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36,
                                          34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8,
                                          6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    for (int i = 0; i < a->dim / 2; i++) {
        const __m512i lo = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live[0], rows,
                                                       base[0] + i, 4);
        const __m512i hi = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live[1], rows,
                                                       base[1] + i, 4);
        _mm512_storeu_si512(vt + 2 * i * c->padded, _mm512_permutex2var_epi16(lo, even, hi));
        _mm512_storeu_si512(vt + (2 * i + 1) * c->padded, _mm512_permutex2var_epi16(lo, odd, hi));
    }
}

/* S^T for the 16 keys from k0 (one page's) into s [TILE][TILE]: tile 0, the keys' rows loaded
 * into tile 1 where they lie, Q^T's first 64 dims in tiles 2 and 3 (head size 64: loaded once
 * per item; 128: its two halves loaded in turn from qt). */
static inline void scores16(const Args *a, const int64_t *table, int64_t kh, int64_t k0,
                            const uint32_t *qt, float *s) {
    const long stride = (long)(a->tok_s * sizeof(bf16));
    const bf16 *k = key_rows(a, a->k_cache, table, k0, kh);
    _tile_zero(0);
    if (a->dim == 128) {
        _tile_loadd(2, qt, 64);
        _tile_loadd(3, qt + TILE * TILE, 64);
    }
    _tile_loadd(1, k, stride);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(1, k + 32, stride);
    _tile_dpbf16ps(0, 1, 3);
    if (a->dim == 128) {
        _tile_loadd(2, qt + 2 * TILE * TILE, 64);
        _tile_loadd(3, qt + 3 * TILE * TILE, 64);
        _tile_loadd(1, k + 64, stride);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(1, k + 96, stride);
        _tile_dpbf16ps(0, 1, 3);
    }
    _tile_stored(0, s, 64);
}

/* S^T for keys [k0, k0 + KEYS) into s [KEYS][TILE]; keys at or past the context are masked
 * by every query, so their rows are left as they are. */
static inline void scores(const Args *a, const Chunk *c, const int64_t *table, int64_t kh,
                          int64_t k0, const uint32_t *qt, float *s) {
    scores16(a, table, kh, k0, qt, s);
    if (k0 + TILE < c->ctx) scores16(a, table, kh, k0 + TILE, qt, s + TILE * TILE);
}

/* Output dims [d0, d0 + OUT_DIMS) of 16 query tokens of head h (block qb of chunk c) */
static void attend_block(const Args *a, const Chunk *c, int64_t h, int64_t qb, int64_t d0) {
    const int64_t group = a->heads / a->kv_heads, kh = h / group;
    const int64_t first = qb * TILE, n = c->rows - first < TILE ? c->rows - first : TILE;
    const int64_t pos0 = c->ctx - c->rows + first, top = pos0 + n - 1;
    const int64_t *table = a->tables + c->table_row * a->tab_s;
    uint32_t qt[MAX_DIM / 2 * TILE] __attribute__((aligned(64)));
    float s2[2][KEYS * TILE] __attribute__((aligned(64))); /* this block's S^T, and the next's */
    uint16_t p[KEYS * TILE] __attribute__((aligned(64)));
    float o[OUT_DIMS * TILE] __attribute__((aligned(64)));
    /* Q^T in dim pairs: qt[half][r][i] = query i's dims (32 half + 2r, +1); rows past the
     * chunk repeat its last query (computed, never stored) */
    int32_t lane[TILE], at[TILE];
    for (int i = 0; i < TILE; i++) {
        lane[i] = (int32_t)(i < n ? i : n - 1);
        at[i] = (int32_t)(lane[i] * a->q_rs / 2);
    }
    const __m512i index = _mm512_loadu_si512(at);
    const int32_t *q =
        (const int32_t *)(a->query + (c->first_row + first) * a->q_rs + h * a->dim);
    for (int r = 0; r < a->dim / 2; r++)
        _mm512_store_si512(qt + r * TILE, _mm512_i32gather_epi32(index, q + r, 4));
    if (a->dim == 64) {
        _tile_loadd(2, qt, 64);
        _tile_loadd(3, qt + TILE * TILE, 64);
    }
    const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32((int32_t)pos0), _mm512_loadu_si512(lane));
    int64_t lo = 0;
    if (a->window > 0 && pos0 - a->window + 1 > 0) lo = (pos0 - a->window + 1) / KEYS * KEYS;
    /* scores in base 2: exp(scale s - m) = 2^(scale log2(e) s - m log2(e)), one FMA a score */
    const __m512 scale = _mm512_set1_ps(a->scale * 1.44269504088896341f);
    /* keys every lane sees without a mask: [whole_lo, pos0] */
    const int64_t whole_lo = a->window > 0 ? top - a->window + 1 : 0;

    /* permutes a pair of key rows, converted side by side, into the tiles' pairs */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    /* each lane's reference maximum: 2^(s - ref) runs up to 2^SLACK before the sums are
     * rescaled to a higher one, so O^T stays in its tiles for all but the first blocks */
    __m512 ref = _mm512_set1_ps(-__builtin_inff()), total = _mm512_setzero_ps();
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const bf16 *vt = c->vt + (kh * a->dim + d0) * c->padded;
    const long vt_stride = (long)(c->padded * sizeof(bf16));
    __mmask16 seen[KEYS];
    /* each block's scores are computed a block ahead: the tiles' chain for block j + 1 runs
     * while the vector unit takes block j's softmax. With the base-2 exponent, 4 x 512 tokens
     * of SmolLM2's heads a layer took 0.88x the time (a window of 100: 0.93x; head size 128,
     * 16 heads over 8: 0.92x), alternating in one process on an Intel Xeon with AMX. */
    scores(a, c, table, kh, lo, qt, s2[0]);
    for (int64_t k0 = lo, step = 0; k0 <= top; k0 += KEYS, step++) {
        const float *s = s2[step & 1];
        if (k0 + KEYS <= top) scores(a, c, table, kh, k0 + KEYS, qt, s2[(step + 1) & 1]);
        const int whole = k0 >= whole_lo && k0 + KEYS - 1 <= pos0;
        __m512 most = _mm512_set1_ps(-__builtin_inff());
        for (int j = 0; j < KEYS; j++) {
            seen[j] = whole ? 0xffff : sees(k0 + j, pos, a->window);
            most = _mm512_mask_max_ps(most, seen[j], most, _mm512_load_ps(s + j * TILE));
        }
        most = _mm512_mul_ps(most, scale);
        const __mmask16 over =
            _mm512_cmp_ps_mask(most, _mm512_add_ps(ref, _mm512_set1_ps(SLACK)), _CMP_GT_OQ);
        if (over) {
            const __m512 raised = _mm512_mask_mov_ps(ref, over, most);
            const __m512 alpha = _mm512_mask_blend_ps(over, _mm512_set1_ps(1.0f),
                                                      exp2_16(_mm512_sub_ps(ref, raised)));
            total = _mm512_mul_ps(total, alpha);
            if (k0 != lo) { /* O^T's tiles out, rescaled lane by lane, and back */
                _tile_stored(4, o, 64);
                _tile_stored(5, o + 16 * TILE, 64);
                _tile_stored(6, o + 32 * TILE, 64);
                _tile_stored(7, o + 48 * TILE, 64);
                for (int d = 0; d < OUT_DIMS; d++)
                    _mm512_store_ps(o + d * TILE, _mm512_mul_ps(_mm512_load_ps(o + d * TILE), alpha));
                _tile_loadd(4, o, 64);
                _tile_loadd(5, o + 16 * TILE, 64);
                _tile_loadd(6, o + 32 * TILE, 64);
                _tile_loadd(7, o + 48 * TILE, 64);
            }
            ref = raised;
        }
        for (int j = 0; j < KEYS; j += 2) {
            __m512 e[2];
            for (int u = 0; u < 2; u++) {
                const __m512 x = _mm512_load_ps(s + (j + u) * TILE);
                const __m512 t = _mm512_fmsub_ps(x, scale, ref);
                e[u] = _mm512_maskz_mov_ps(seen[j + u], exp2_16(t));
                total = _mm512_add_ps(total, e[u]);
            }
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]);
            _mm512_store_si512(p + j * TILE, _mm512_permutexvar_epi16(pairs, both));
        }
        _tile_loadd(0, p, 64);
        _tile_loadd(1, vt + k0, vt_stride);
        _tile_dpbf16ps(4, 1, 0);
        _tile_loadd(1, vt + 16 * c->padded + k0, vt_stride);
        _tile_dpbf16ps(5, 1, 0);
        _tile_loadd(1, vt + 32 * c->padded + k0, vt_stride);
        _tile_dpbf16ps(6, 1, 0);
        _tile_loadd(1, vt + 48 * c->padded + k0, vt_stride);
        _tile_dpbf16ps(7, 1, 0);
    }
    _tile_stored(4, o, 64);
    _tile_stored(5, o + 16 * TILE, 64);
    _tile_stored(6, o + 32 * TILE, 64);
    _tile_stored(7, o + 48 * TILE, 64);
    float inv[TILE] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
    const __m512i column = strided16(TILE);
    for (int64_t i = 0; i < n; i++) {
        bf16 *row = a->out + (c->first_row + first + i) * a->out_rs + h * a->dim + d0;
        const __m512 norm = _mm512_set1_ps(inv[i]);
        for (int d = 0; d < OUT_DIMS; d += 16) {
            const __m512 x = _mm512_i32gather_ps(column, o + d * TILE + i, 4);
            store16_bf16(row + d, _mm512_mul_ps(x, norm));
        }
    }
}

/* Every chunk's rows of ``out`` (chunk c: rows first_row[c] .. + rows[c], the last rows of a
 * context of ctx[c] tokens whose pages are tables row table_row[c]). 0 on success, 1 where
 * the shapes are not this kernel's (nothing written), 2 where scratch memory ran out. */
int prefill_attention_amx(PROMPT_ARGS(bf16)) {
    if ((dim != 64 && dim != 128) || page_size % TILE || heads % kv_heads || q_rs % 2) return 1;
    const int64_t passes = dim / OUT_DIMS; /* over the output dims, the scores each time */
    Chunk *cs = malloc((size_t)chunks * sizeof(Chunk));
    int64_t *start = malloc((size_t)(chunks + 1) * sizeof(int64_t)); /* items before chunk c */
    if (!cs || !start) {
        free(cs);
        free(start);
        return 1;
    }
    size_t scratch = 0;
    start[0] = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t padded = (ctx[c] + KEYS - 1) / KEYS * KEYS;
        cs[c] = (Chunk){table_row[c], first_row[c], rows[c], ctx[c], padded, 0};
        scratch += (size_t)(kv_heads * dim * padded);
        start[c + 1] = start[c] + passes * heads * ((rows[c] + TILE - 1) / TILE);
    }
    bf16 *vt = aligned_alloc(64, (scratch * sizeof(bf16) + 63) / 64 * 64);
    if (!vt) {
        free(cs);
        free(start);
        return 2;
    }
    int64_t packs = 0;
    for (int64_t c = 0, used = 0; c < chunks; c++) {
        cs[c].vt = vt + used;
        used += kv_heads * dim * cs[c].padded;
        packs += kv_heads * (cs[c].padded / KEYS);
    }
    const Args a = {query, k_cache, v_cache, q_rs, page_s, tok_s, head_s, page_size, tables,
                    tab_s, heads, kv_heads, dim, scale, window, out, out_rs};
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < packs; item++) {
            int64_t c = 0, rest = item;
            while (rest >= kv_heads * (cs[c].padded / KEYS)) rest -= kv_heads * (cs[c++].padded / KEYS);
            pack_values(&a, cs + c, rest / (cs[c].padded / KEYS), rest % (cs[c].padded / KEYS) * KEYS);
        }
        configure_tiles();
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < start[chunks]; item++) {
            int64_t c = 0;
            while (item >= start[c + 1]) c++;
            const int64_t blocks = (cs[c].rows + TILE - 1) / TILE, rest = item - start[c];
            const int64_t h = rest / (blocks * passes), more = rest % (blocks * passes);
            /* the last query blocks first: they see the most keys */
            attend_block(&a, cs + c, h, blocks - 1 - more / passes, more % passes * OUT_DIMS);
        }
        _tile_release();
    }
    free(vt);
    free(cs);
    free(start);
    return 0;
}
#define AHEAD 32      /* keys whose K and V rows are prefetched ahead (cpu_paged.c's AHEAD) */
/* Keys scored before the running softmax is rescaled: each block pays for its maxima, sums
 * and prefetches once, which at SmolLM2's shapes (3 query heads per KV head, head size 64)
 * cost as much as the products; 192 against 64 keys took 0.85x the time from cache and
 * 0.90x from memory (batch 32, 544 keys, 30 layers), and the same where memory bounds it
 * (head size 128, 8 KV heads). A multiple of 48 and of 32: three pages or two per pass. */
#define BLOCK 192
#define MAX_GROUP 16  /* query heads per KV head: the columns of a Q^T tile */

typedef struct {
    const bf16 *query, *k_cache, *v_cache;
    int64_t q_rs, page_s, tok_s, head_s, page_size;
    const int64_t *tables;
    int64_t tab_s;
    int64_t group;
    float scale;
    int64_t window;
    bf16 *out;
    int64_t out_rs;
} DecodeArgs;

static inline const bf16 *row_at(const DecodeArgs *a, const bf16 *cache, const int64_t *table,
                                 int64_t k, int64_t kh) {
    return cache + table[k / a->page_size] * a->page_s + (k % a->page_size) * a->tok_s +
           kh * a->head_s;
}

/* Prefetch the K and V rows of the 16 keys from k0 (one page's) of KV head kh */
static inline void prefetch_page(const DecodeArgs *a, const int64_t *table, int64_t k0,
                                 int64_t kh, int nd) {
    const char *kr = (const char *)row_at(a, a->k_cache, table, k0, kh);
    const char *vr = (const char *)row_at(a, a->v_cache, table, k0, kh);
    const int64_t step = a->tok_s * (int64_t)sizeof(bf16);
    for (int t = 0; t < TILE; t++)
        for (int b = 0; b < nd * 32; b += 64) {
            __builtin_prefetch(kr + t * step + b, 0, 3);
            __builtin_prefetch(vr + t * step + b, 0, 3);
        }
}

/* The scores of 16 keys (one page's rows, from k0) in tile ``acc`` through tile ``rows``:
 * their K rows times the heads' Q^T (tiles 2 .. 2 + nd / 2). Tile numbers are immediates. */
#define PAGE_SCORES(acc, rows, k, stride, nd)                                                \
    do {                                                                                     \
        _tile_zero(acc);                                                                     \
        _tile_loadd(rows, (k), stride);                                                      \
        _tile_dpbf16ps(acc, rows, 2);                                                        \
        _tile_loadd(rows, (k) + 32, stride);                                                 \
        _tile_dpbf16ps(acc, rows, 3);                                                        \
        if ((nd) == 8) {                                                                     \
            _tile_loadd(rows, (k) + 64, stride);                                             \
            _tile_dpbf16ps(acc, rows, 4);                                                    \
            _tile_loadd(rows, (k) + 96, stride);                                             \
            _tile_dpbf16ps(acc, rows, 5);                                                    \
        }                                                                                    \
    } while (0)

/* Each head's scaled scores of the 16 keys of a stored S^T tile into score[g][at ..] */
static inline __attribute__((always_inline)) void spread(const float *s, float scale, int G,
                                                         float (*score)[BLOCK], int64_t at) {
    const __m512i column = strided16(TILE);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int g = 0; g < G; g++)
        _mm512_storeu_ps(score[g] + at, _mm512_mul_ps(_mm512_i32gather_ps(column, s + g, 4), vscale));
}

/* Scores of keys [k0, k0 + n) (k0 a multiple of 16) into score[g][0 .. n), pages side by side
 * in pairs of tiles (0-1, 6-7, and 4-5 where head size 64 leaves Q^T only 2-3) so that one
 * page's loads and products overlap another's: tiles are not renamed, so a pair is a chain.
 * The third page took 0.96x the time of two from cache, 0.98x from memory (batch 32, 544
 * keys, SmolLM2's heads). */
static inline __attribute__((always_inline)) void block_scores(
    const DecodeArgs *a, const int64_t *table, int64_t k0, int64_t n, int64_t kh, const int nd,
    const int G, float (*score)[BLOCK]) {
    const long stride = (long)(a->tok_s * sizeof(bf16));
    const int pages = nd == 4 ? 3 : 2;
    float s[3][TILE * TILE] __attribute__((aligned(64)));
    for (int64_t at = 0; at < n; at += pages * TILE) {
        const int second = at + TILE < n, third = pages == 3 && at + 2 * TILE < n;
        PAGE_SCORES(0, 1, row_at(a, a->k_cache, table, k0 + at, kh), stride, nd);
        if (second) PAGE_SCORES(6, 7, row_at(a, a->k_cache, table, k0 + at + TILE, kh), stride, nd);
        if (third) PAGE_SCORES(4, 5, row_at(a, a->k_cache, table, k0 + at + 2 * TILE, kh), stride, nd);
        _tile_stored(0, s[0], 64);
        if (second) _tile_stored(6, s[1], 64);
        if (third) _tile_stored(4, s[2], 64);
        spread(s[0], a->scale, G, score, at);
        if (second) spread(s[1], a->scale, G, score, at + TILE);
        if (third) spread(s[2], a->scale, G, score, at + 2 * TILE);
    }
}

/* One row's query heads of KV head kh: ``nd`` = dim / 16 (4 or 8) and ``G`` the heads per KV
 * head, compile-time constants where the caller names them (the accumulators then stay in
 * registers). */
static inline __attribute__((always_inline)) void decode_item(const DecodeArgs *a, int64_t r,
                                                                int64_t seq, int64_t pos,
                                                                int64_t kh, const int nd,
                                                                const int G) {
    const int64_t dim = nd * 16;
    const int64_t lo = (a->window > 0 && pos - a->window + 1 > 0) ? pos - a->window + 1 : 0;
    const int64_t *table = a->tables + seq * a->tab_s;
    /* Q^T in dim pairs, a column per query head: qt[half][pair][g] */
    uint32_t qt[4 * TILE * TILE] __attribute__((aligned(64)));
    memset(qt, 0, sizeof qt);
    for (int g = 0; g < G; g++) {
        const uint32_t *q = (const uint32_t *)(a->query + r * a->q_rs + (kh * G + g) * dim);
        for (int i = 0; i < dim / 2; i++) qt[i * TILE + g] = q[i];
    }
    _tile_loadd(2, qt, 64);
    _tile_loadd(3, qt + TILE * TILE, 64);
    if (nd == 8) {
        _tile_loadd(4, qt + 2 * TILE * TILE, 64);
        _tile_loadd(5, qt + 3 * TILE * TILE, 64);
    }
    __m512 acc[MAX_GROUP][8];
    float best[MAX_GROUP], total[MAX_GROUP], score[MAX_GROUP][BLOCK] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < nd; c++) acc[g][c] = _mm512_setzero_ps();
        best[g] = -__builtin_inff();
        total[g] = 0.0f;
    }
    const int64_t start = lo / TILE * TILE; /* pages' rows start on multiples of 16 */
    for (int64_t k = start; k <= pos && k < start + AHEAD; k += TILE) prefetch_page(a, table, k, kh, nd);
    for (int64_t j0 = start; j0 <= pos; j0 += BLOCK) {
        const int64_t n = pos - j0 + 1 < BLOCK ? pos - j0 + 1 : BLOCK;
        const int64_t first = lo > j0 ? lo - j0 : 0; /* keys before the window: not attended */
        for (int64_t k = j0 + AHEAD; k <= pos && k < j0 + AHEAD + BLOCK; k += TILE)
            prefetch_page(a, table, k, kh, nd);
        block_scores(a, table, j0, n, kh, nd, G, score);
        for (int g = 0; g < G; g++) {
            __m512 top = _mm512_set1_ps(best[g]);
            for (int64_t jj = first; jj < n; jj += 16) {
                const __mmask16 m = n - jj >= 16 ? 0xffff : (__mmask16)((1u << (n - jj)) - 1);
                top = _mm512_mask_max_ps(top, m, top, _mm512_loadu_ps(&score[g][jj]));
            }
            const float most = _mm512_reduce_max_ps(top);
            const float rescale = __builtin_expf(best[g] - most); /* 0 on the first block */
            const __m512 vtop = _mm512_set1_ps(most);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t jj = first; jj < n; jj += 16) {
                const __mmask16 m = n - jj >= 16 ? 0xffff : (__mmask16)((1u << (n - jj)) - 1);
                __m512 x = _mm512_maskz_loadu_ps(m, &score[g][jj]);
                x = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(x, vtop)));
                _mm512_mask_storeu_ps(&score[g][jj], m, x);
                sum = _mm512_add_ps(sum, x);
            }
            total[g] = total[g] * rescale + _mm512_reduce_add_ps(sum);
            best[g] = most;
            if (rescale != 1.0f) {
                const __m512 vr = _mm512_set1_ps(rescale);
                for (int c = 0; c < nd; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], vr);
            }
        }
        const bf16 *page = 0;
        for (int64_t jj = first; jj < n; jj++) {
            if (jj == first || jj % TILE == 0)
                page = row_at(a, a->v_cache, table, j0 + jj / TILE * TILE, kh);
            const bf16 *vp = page + (jj % TILE) * a->tok_s;
            /* the even dims, then the odd ones (load32_bf16), put back in order at the end:
             * the same bits, 0.95x the time from cache */
            __m512 v[8];
            for (int c = 0; c < nd; c += 2) load32_bf16(vp + 16 * c, &v[c], &v[c + 1]);
            for (int g = 0; g < G; g++) {
                const __m512 p = _mm512_set1_ps(score[g][jj]);
                for (int c = 0; c < nd; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        bf16 *op = a->out + r * a->out_rs + (kh * G + g) * dim;
        const __m512 inv = _mm512_set1_ps(total[g] > 0.0f ? 1.0f / total[g] : 0.0f);
        for (int c = 0; c < nd; c += 2) order32_bf16(&acc[g][c], &acc[g][c + 1]);
        for (int c = 0; c < nd; c++) store16_bf16(op + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    }
}

/* decode_item with the common head counts per KV head as constants */
#define ITEM(nd)                                                                             \
    switch (a.group) {                                                                       \
    case 1: decode_item(&a, r, row_seq[r], row_pos[r], kh, nd, 1); break;                    \
    case 2: decode_item(&a, r, row_seq[r], row_pos[r], kh, nd, 2); break;                    \
    case 3: decode_item(&a, r, row_seq[r], row_pos[r], kh, nd, 3); break;                    \
    case 4: decode_item(&a, r, row_seq[r], row_pos[r], kh, nd, 4); break;                    \
    case 8: decode_item(&a, r, row_seq[r], row_pos[r], kh, nd, 8); break;                    \
    default: decode_item(&a, r, row_seq[r], row_pos[r], kh, nd, (int)a.group);              \
    }

void decode_attention_amx(const bf16 *query, int64_t q_rs, const bf16 *k_cache,
                          const bf16 *v_cache, int64_t page_s, int64_t tok_s, int64_t head_s,
                          int64_t page_size, const int64_t *tables, int64_t tab_s,
                          const int64_t *row_seq, const int64_t *row_pos, int64_t rows,
                          int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                          int64_t window, bf16 *out, int64_t out_rs, int nthreads) {
    const int64_t group = kv_heads > 0 && heads % kv_heads == 0 ? heads / kv_heads : 0;
    if ((dim != 64 && dim != 128) || page_size % TILE || !group || group > MAX_GROUP) {
        fallback(query, q_rs, k_cache, v_cache, page_s, tok_s, head_s, page_size, tables, tab_s,
                 row_seq, row_pos, rows, heads, kv_heads, dim, scale, window, out, out_rs,
                 nthreads);
        return;
    }
    const DecodeArgs a = {query, k_cache, v_cache, q_rs, page_s, tok_s, head_s, page_size,
                          tables, tab_s, group, scale, window, out, out_rs};
    /* an item: a row with all its KV heads, or one head of few rows (cpu_paged.c's rule) */
    const int64_t per_item = rows >= 4 * (int64_t)nthreads ? kv_heads : 1;
#pragma omp parallel num_threads(nthreads) if (rows * kv_heads > 1)
    {
        configure_tiles();
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < rows * kv_heads / per_item; item++) {
            for (int64_t at = item * per_item; at < (item + 1) * per_item; at++) {
                const int64_t r = at / kv_heads, kh = at % kv_heads;
                if (dim == 64) {
                    ITEM(4)
                } else {
                    ITEM(8)
                }
            }
        }
        _tile_release();
    }
}
#else
int amx_init(void *decode_fallback) {
    (void)decode_fallback;
    return 0;
}
#endif
