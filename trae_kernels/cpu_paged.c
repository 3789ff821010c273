/* Paged KV on the CPU: store new K/V rows into their slots, and one-token-per-row attention
 * over each row's pages, read where they lie (no gathered copy of the context per layer).
 *
 * Built on first use by trae_kernels/cpu_native.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes with raw pointers and element strides; the Python side checks shapes,
 * dtypes and contiguity. float32 and bfloat16 tensors; scores, softmax and the weighted sum
 * accumulate in float32, as the torch reference does. OpenMP binds to the runtime torch
 * already loaded (same soname), so these loops share torch's team instead of adding one.
 *
 * Layouts (element strides; the head dimension D is contiguous everywhere):
 *   query / out   [rows, H, D]             row stride q_rs / out_rs, head stride D
 *   k/v caches    [pages, page, KVH, D]    strides page_s, tok_s, head_s (a layer's view)
 *   block tables  [seqs, tab_s] int64
 *   row_seq[r]    the sequence row r belongs to; row_pos[r] the last position it sees
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_DIM 256   /* head dimension */
#define BLOCK 64      /* keys scored at once before the running softmax is rescaled */
/* Keys ahead of the one being scored whose K and V rows are prefetched (and the first that
 * many before the loop). A row's keys lie on pages scattered through the pool, so the
 * hardware's stream prefetchers do not see them coming: batch-32 decode over 130-token
 * contexts read 8.6 GB/s without, 20.5 with 32 keys ahead and the first ones fetched early
 * (16 ahead: 15.9, 64: 14.8, 128: 11.0 without the early ones; SmolLM2's heads, bf16, 30
 * layers, Zen 5). Pages laid out layer by layer instead read 6.8: the layout is not it. */
#define AHEAD 32
/* The AVX-512 loop's distance, in bytes of the heads it reads a key (so 10 keys of a SmolLM2
 * row's float32 K and V, 32 of one head's): 2, 4, 8 and 16 KB read alike on Zen 5. */
#define AHEAD_BYTES 8192
/* The most bytes of two blocks' K and V rows (the one weighed, the next fetched) a row loop keeps
 * in L2 at once: 96 KB for SmolLM2's float32 heads; 512 KB (float32 rows of 8 KV heads of 128)
 * was 1.03-1.05x slower fetched than not. */
#define NEXT_BLOCK_BYTES (256 << 10)
#define MAX_HEADS 32     /* query heads a row loop takes at once */
#define HEAD_VECTORS 256 /* ... and their 16-lane vectors (AVX-512: q and sums, 16 KB each) */

typedef uint16_t bf16;

/* Where key j's row lies in a cache (in elements, before the head's offset). Pages of a
 * power-of-two size (what the pool makes) take a shift and a mask instead of a 64-bit
 * division, three a key and head in the loops below: 0.97-0.98x the time of a float32 and
 * of a bf16 batch-32 decode's attention (540 keys, SmolLM2's heads, an Intel Xeon). */
static inline int64_t key_offset(const int64_t *table, int64_t j, int64_t page_size,
                                 int64_t page_s, int64_t tok_s) {
    if ((page_size & (page_size - 1)) == 0)
        return table[j >> __builtin_ctzll((unsigned long long)page_size)] * page_s +
               (j & (page_size - 1)) * tok_s;
    return table[j / page_size] * page_s + (j % page_size) * tok_s;
}

/* Ask for key j's K and V rows of head kh (dim elements of size bytes each) into L1. */
static inline void prefetch_key(const void *k_cache, const void *v_cache,
                                const int64_t *table, int64_t j, int64_t page_size,
                                int64_t page_s, int64_t tok_s, int64_t head_s, int64_t kh,
                                int64_t row_bytes, int64_t size) {
    const int64_t at =
        (key_offset(table, j, page_size, page_s, tok_s) + kh * head_s) * size;
    for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch((const char *)k_cache + at + b, 0, 3);
        __builtin_prefetch((const char *)v_cache + at + b, 0, 3);
    }
}
/* key j's rows of the heads a call reads: prefetch_key from its first head over them all */
#define PREFETCH_HEADS(T, j)                                                                 \
    prefetch_key(k_cache, v_cache, table, (j), page_size, page_s, tok_s, head_s, 0, row_bytes, \
                 sizeof(T))
#define PREFETCH_KEY(T, j)                                                                   \
    prefetch_key(k_cache, v_cache, table, (j), page_size, page_s, tok_s, head_s, kh,         \
                 dim * (int64_t)sizeof(T), (int64_t)sizeof(T))

static inline float bf16_to_f32(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 f32_to_bf16(float f) { /* round to nearest even, NaN kept NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#define LOAD_f32(p, i) ((p)[i])
#define LOAD_bf16(p, i) bf16_to_f32((p)[i])
#define STORE_f32(p, i, x) ((p)[i] = (x))
#define STORE_bf16(p, i, x) ((p)[i] = f32_to_bf16(x))

#define DEFINE_STORE(T)                                                                      \
    void store_kv_##T(const T *key, const T *value, int64_t rows, int64_t key_rs,            \
                      int64_t value_rs, T *k_cache, T *v_cache, int64_t page_s,              \
                      int64_t tok_s, int64_t head_s, int64_t page_size, int64_t kv_heads,    \
                      int64_t dim, const int64_t *slots, int nthreads) {                     \
        _Pragma("omp parallel for num_threads(nthreads) if (rows > 8)")                     \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            int64_t slot = slots[r];                                                         \
            if (slot < 0) continue; /* a padding row */                                      \
            int64_t at = (slot / page_size) * page_s + (slot % page_size) * tok_s;           \
            for (int64_t h = 0; h < kv_heads; h++) {                                         \
                memcpy(k_cache + at + h * head_s, key + r * key_rs + h * dim,                \
                       (size_t)dim * sizeof(T));                                             \
                memcpy(v_cache + at + h * head_s, value + r * value_rs + h * dim,            \
                       (size_t)dim * sizeof(T));                                             \
            }                                                                                \
        }                                                                                    \
    }

#define DEFINE_DECODE(T)                                                                     \
    void decode_attention_##T(const T *query, int64_t q_rs, const T *k_cache,               \
                              const T *v_cache, int64_t page_s, int64_t tok_s,              \
                              int64_t head_s, int64_t page_size, const int64_t *tables,     \
                              int64_t tab_s, const int64_t *row_seq, const int64_t *row_pos, \
                              int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,    \
                              float scale, int64_t window, T *out, int64_t out_rs,           \
                              int nthreads) {                                                \
        const int64_t group = heads / kv_heads;                                              \
        /* an item: a row with all its KV heads where rows keep every thread busy (a page's \
         * rows hold every head side by side: one core then streams it in), else one head; \
         * cpu_amx.c's decode kernel splits its rows by this rule too */                    \
        const int64_t per_item = rows >= 4 * (int64_t)nthreads ? kv_heads : 1;              \
        _Pragma("omp parallel for schedule(dynamic) num_threads(nthreads)")                 \
        for (int64_t item = 0; item < rows * kv_heads / per_item; item++) {                 \
        ROW_ITEM(T)                                                                          \
        for (int64_t at = item * per_item; at < (item + 1) * per_item; at++) {               \
            const int64_t r = at / kv_heads, kh = at % kv_heads;                             \
            const int64_t seq = row_seq[r], pos = row_pos[r];                                \
            const int64_t lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;  \
            const int64_t *table = tables + seq * tab_s;                                     \
            VECTOR_ITEM(T)                                                                   \
            float q[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM];                            \
            float best[MAX_GROUP], total[MAX_GROUP], score[MAX_GROUP][BLOCK];                \
            for (int64_t g = 0; g < group; g++) {                                            \
                const T *qp = query + r * q_rs + (kh * group + g) * dim;                     \
                for (int64_t d = 0; d < dim; d++) {                                          \
                    q[g][d] = LOAD_##T(qp, d) * scale;                                       \
                    acc[g][d] = 0.0f;                                                        \
                }                                                                            \
                best[g] = -INFINITY;                                                         \
                total[g] = 0.0f;                                                             \
            }                                                                                \
            for (int64_t ja = lo; ja <= pos && ja < lo + AHEAD; ja++)                        \
                PREFETCH_KEY(T, ja); /* the first keys */                                    \
            for (int64_t j0 = lo; j0 <= pos; j0 += BLOCK) {                                  \
                const int64_t n = (pos - j0 + 1 < BLOCK) ? pos - j0 + 1 : BLOCK;             \
                for (int64_t jj = 0; jj < n; jj++) {                                         \
                    const int64_t j = j0 + jj;                                               \
                    const T *kp = k_cache + key_offset(table, j, page_size, page_s, tok_s) + \
                                  kh * head_s;                                               \
                    if (j + AHEAD <= pos) PREFETCH_KEY(T, j + AHEAD);                        \
                    for (int64_t g = 0; g < group; g++) {                                    \
                        float s = 0.0f;                                                      \
                        _Pragma("omp simd reduction(+ : s)")                                 \
                        for (int64_t d = 0; d < dim; d++) s += q[g][d] * LOAD_##T(kp, d);    \
                        score[g][jj] = s;                                                    \
                    }                                                                        \
                }                                                                            \
                for (int64_t g = 0; g < group; g++) {                                        \
                    float top = best[g];                                                     \
                    for (int64_t jj = 0; jj < n; jj++)                                       \
                        top = score[g][jj] > top ? score[g][jj] : top;                       \
                    const float rescale = expf(best[g] - top); /* 0 on the first block */    \
                    float sum = 0.0f;                                                        \
                    _Pragma("omp simd reduction(+ : sum)")                                   \
                    for (int64_t jj = 0; jj < n; jj++) {                                     \
                        score[g][jj] = expf(score[g][jj] - top);                             \
                        sum += score[g][jj];                                                 \
                    }                                                                        \
                    total[g] = total[g] * rescale + sum;                                     \
                    best[g] = top;                                                           \
                    if (rescale != 1.0f)                                                     \
                        for (int64_t d = 0; d < dim; d++) acc[g][d] *= rescale;              \
                }                                                                            \
                for (int64_t jj = 0; jj < n; jj++) {                                         \
                    const int64_t j = j0 + jj;                                               \
                    const T *vp = v_cache + key_offset(table, j, page_size, page_s, tok_s) + \
                                  kh * head_s;                                               \
                    float v[MAX_DIM];                                                        \
                    for (int64_t d = 0; d < dim; d++) v[d] = LOAD_##T(vp, d);                \
                    for (int64_t g = 0; g < group; g++) {                                    \
                        const float p = score[g][jj];                                        \
                        _Pragma("omp simd")                                                  \
                        for (int64_t d = 0; d < dim; d++) acc[g][d] += p * v[d];             \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            for (int64_t g = 0; g < group; g++) {                                            \
                T *op = out + r * out_rs + (kh * group + g) * dim;                           \
                const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;                  \
                for (int64_t d = 0; d < dim; d++) STORE_##T(op, d, acc[g][d] * inv);         \
            }                                                                                \
        }                                                                                    \
        }                                                                                    \
    }

typedef float f32;

#ifdef __AVX512F__
/* The same attention with AVX-512 registers (heads512 below): bf16 widened by a shift where it
 * is loaded, 16 keys' dot products summed at once, exp a vector polynomial (relative error
 * ~1e-7), and the sums in registers for the usual head sizes (64, 128: the dimension is a
 * compile-time constant there). */
#include "cpu_vec.h"

/* Lane i of the result: the sum of s[i]'s 16 lanes, by a tree of shuffles: 30 shuffles and 15
 * additions for 16 sums, where a reduction a vector takes 64 and 48 (and a store a score). */
static inline __attribute__((always_inline)) __m512 sum16x16(const __m512 s[16]) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++) /* in each 128-bit quarter: a0+a2 b0+b2 a1+a3 b1+b3 */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]),
                             _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* in each quarter: four vectors' sums over the quarter */
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* quarters 0+1 and 2+3 of y0..y3, then the two halves: vector 4i+k's sum in lane 4i+k */
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                                    _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88),
                                    _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
}

/* One head's online-softmax step over a block of n scores (64-byte aligned): the scores become
 * e^(score - running maximum), the head's maximum and sum move on, and the factor its weighted
 * sums so far must be scaled by is returned (1 where the maximum held; 0 on the first block).
 * A NaN score is passed over by the maximum, as the scalar comparison did. */
static inline float softmax_block16(float *score, int64_t n, float *best, float *total) {
    __m512 vtop = _mm512_set1_ps(*best);
    for (int64_t jj = 0; jj < n; jj += 16) {
        const __mmask16 m = n - jj >= 16 ? 0xffff : (__mmask16)((1u << (n - jj)) - 1);
        vtop = _mm512_mask_max_ps(vtop, m, _mm512_maskz_loadu_ps(m, score + jj), vtop);
    }
    const float top = _mm512_reduce_max_ps(vtop); /* exact: a maximum does not round */
    const float rescale = expf(*best - top);
    vtop = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t jj = 0; jj < n; jj += 16) {
        const __mmask16 m = n - jj >= 16 ? 0xffff : (__mmask16)((1u << (n - jj)) - 1);
        __m512 x = _mm512_maskz_loadu_ps(m, score + jj);
        x = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(x, vtop)));
        _mm512_mask_storeu_ps(score + jj, m, x);
        sum = _mm512_add_ps(sum, x);
    }
    *total = *total * rescale + _mm512_reduce_add_ps(sum);
    *best = top;
    return rescale;
}

/* acc[g] += the n V rows at v + at[j], weighted by p[g][j], for g < heads (1-3: one load of a
 * V row serves them all, each head's sums an independent chain of multiply-adds). Meanwhile the
 * rows at fetch_k + fetch_at[j] and fetch_v + fetch_at[j] (either may be NULL), j < fetch_n,
 * are asked into L2: the next block's keys, fetched while this one is weighed (heads512). */
#define DEFINE_WEIGH(T)                                                                      \
    static inline __attribute__((always_inline)) void weigh_##T(                             \
        const T *v, const int64_t *at, int64_t n, const float *const *p, __m512 *const *acc, \
        const int nd, const int heads, const char *fetch_k, const char *fetch_v,            \
        const int64_t *fetch_at, int64_t fetch_n, int64_t row_bytes) {                       \
        __m512 a[3][MAX_DIM / 16];                                                           \
        for (int g = 0; g < heads; g++)                                                      \
            for (int c = 0; c < nd; c++) a[g][c] = acc[g][c];                                \
        for (int64_t jj = 0; jj < n; jj++) {                                                 \
            const T *vp = v + at[jj];                                                        \
            if (jj < fetch_n) {                                                              \
                const int64_t o = fetch_at[jj] * (int64_t)sizeof(T);                         \
                for (int64_t b = 0; b < row_bytes; b += 64) {                                \
                    if (fetch_k) _mm_prefetch(fetch_k + o + b, _MM_HINT_T1);                 \
                    if (fetch_v) _mm_prefetch(fetch_v + o + b, _MM_HINT_T1);                 \
                }                                                                            \
            }                                                                                \
            __m512 x[MAX_DIM / 16];                                                          \
            if (nd % 2 == 0) /* load32_T's order, restored at the end */                     \
                for (int c = 0; c < nd; c += 2) load32_##T(vp + 16 * c, &x[c], &x[c + 1]);   \
            else                                                                             \
                for (int c = 0; c < nd; c++) x[c] = load16_##T(vp + 16 * c);                 \
            for (int g = 0; g < heads; g++) {                                                \
                const __m512 w = _mm512_set1_ps(p[g][jj]);                                   \
                for (int c = 0; c < nd; c++) a[g][c] = _mm512_fmadd_ps(w, x[c], a[g][c]);    \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < heads; g++)                                                      \
            for (int c = 0; c < nd; c++) acc[g][c] = a[g][c];                                \
    }

/* Scores, softmax and weighted sums of nkv KV heads from kh0 (one, or a row's every head where
 * rows keep every thread busy) a block of keys at a time. A key's K and V rows of all heads lie
 * side by side in a page, so a row's heads together read each line once, front to back; one
 * head at a time over all keys left two thirds of every line fetched to a later pass (a Zen 5
 * EPYC's batch-32 decode over 540-key contexts read 25 GB/s so, against a 75 GB/s stream).
 * A head's arithmetic is the same whichever way it is called: a row's outputs do not depend
 * on what else is in the batch.
 *
 * Fetching only a few keys ahead of the scores left the memory idle while a block's V rows were
 * weighed: the step's time was its reads' plus most of its arithmetic's (SmolLM2's batch-32
 * float32 decode over 540 keys: 25.5 ms, against 17.5 for the reads alone and 7.5 for the
 * arithmetic from cache). So the weighing also asks the next block's rows into L2
 * (``fetch_next``, where both blocks' rows fit NEXT_BLOCK_BYTES): 0.85x the time there, bf16
 * 0.94x; 0.85-0.98x with 128-wide heads (16/8, 12/4 and 32/8 heads), the same bits (Zen 5,
 * both builds alternating). For head sizes the loop does not unroll it was 1.2x slower (bf16,
 * 80-wide heads), and for items of one head (fewer rows than 4 a thread: batch 1 over 540 keys)
 * 1.07-1.10x: only whole rows of the unrolled sizes fetch. */
#define DEFINE_HEADS512(T)                                                                   \
    static inline __attribute__((always_inline)) void heads512_##T(                          \
        const T *query, int64_t q_rs, const T *k_cache, const T *v_cache, int64_t page_s,    \
        int64_t tok_s, int64_t head_s, int64_t page_size, const int64_t *table, int64_t r,   \
        int64_t kh0, int64_t nkv, int64_t lo, int64_t pos, int64_t group, const int nd,      \
        float scale, T *out, int64_t out_rs, int64_t dim, const int fetch_next) {            \
        const int64_t nh = nkv * group, row_bytes = nkv * dim * (int64_t)sizeof(T);         \
        int64_t ahead = AHEAD_BYTES / row_bytes;                                             \
        ahead = ahead < 4 ? 4 : ahead > 64 ? 64 : ahead;                                     \
        const int fetch = fetch_next && 2 * BLOCK * row_bytes <= NEXT_BLOCK_BYTES;           \
        const int take = nd <= 4 ? 3 : 2; /* 3 x 4 or 2 x 8 sums, and a V row: registers */ \
        const int64_t head_bytes = dim * (int64_t)sizeof(T);                                 \
        __m512 q[HEAD_VECTORS], acc[HEAD_VECTORS];                                           \
        float best[MAX_HEADS], total[MAX_HEADS];                                             \
        float score[MAX_HEADS][BLOCK] __attribute__((aligned(64)));                          \
        int64_t at[BLOCK]; /* where each key of the block lies, in K and V alike */             \
        __m512 prod[MAX_HEADS][16]; /* a head's products with 16 keys, before their sums */   \
        const __m512 vscale = _mm512_set1_ps(scale);                                         \
        const T *qr = query + r * q_rs + kh0 * group * dim;                                  \
        for (int64_t h = 0; h < nh; h++) {                                                   \
            for (int c = 0; c < nd; c++) {                                                   \
                q[h * nd + c] = _mm512_mul_ps(load16_##T(qr + h * dim + 16 * c), vscale);    \
                acc[h * nd + c] = _mm512_setzero_ps();                                       \
            }                                                                                \
            best[h] = -INFINITY;                                                             \
            total[h] = 0.0f;                                                                 \
        }                                                                                    \
        k_cache += kh0 * head_s;                                                             \
        v_cache += kh0 * head_s;                                                             \
        for (int64_t ja = lo; ja <= pos && ja < lo + ahead; ja++)                            \
            PREFETCH_HEADS(T, ja); /* the first keys */                                      \
        for (int64_t j0 = lo; j0 <= pos; j0 += BLOCK) {                                      \
            const int64_t n = (pos - j0 + 1 < BLOCK) ? pos - j0 + 1 : BLOCK;                 \
            for (int64_t jb = 0; jb < n; jb += 16) {                                         \
                /* key by key (each key's rows front to back, as fetched), every head's     \
                 * products kept; then 16 keys' sums a head at once by sum16x16 */           \
                const int64_t m = n - jb < 16 ? n - jb : 16;                                 \
                for (int64_t i = 0; i < 16; i++) {                                           \
                    const int64_t j = j0 + jb + (i < m ? i : 0); /* past the end: unused */  \
                    const int64_t o = key_offset(table, j, page_size, page_s, tok_s);        \
                    at[jb + i] = o;                                                          \
                    if (i < m && j + ahead <= pos) PREFETCH_HEADS(T, j + ahead);             \
                    for (int64_t kh = 0, h = 0; kh < nkv; kh++) {                            \
                        const T *kp = k_cache + o + kh * head_s;                             \
                        __m512 k[MAX_DIM / 16];                                              \
                        for (int c = 0; c < nd; c++) k[c] = load16_##T(kp + 16 * c);         \
                        for (int64_t g = 0; g < group; g++, h++) {                           \
                            __m512 x = _mm512_mul_ps(q[h * nd], k[0]);                       \
                            for (int c = 1; c < nd; c++)                                     \
                                x = _mm512_fmadd_ps(q[h * nd + c], k[c], x);                 \
                            prod[h][i] = x;                                                  \
                        }                                                                    \
                    }                                                                        \
                }                                                                            \
                for (int64_t h = 0; h < nh; h++)                                             \
                    _mm512_store_ps(&score[h][jb], sum16x16(prod[h]));                       \
            }                                                                                \
            for (int64_t h = 0; h < nh; h++) { /* each head's softmax step */                \
                const float rescale = softmax_block16(score[h], n, &best[h], &total[h]);     \
                const __m512 vr = _mm512_set1_ps(rescale);                                   \
                for (int c = 0; c < nd; c++) acc[h * nd + c] = _mm512_mul_ps(acc[h * nd + c], vr); \
            }                                                                                \
            /* the weighted sums of the block's V rows (fetched with its keys: from cache), \
             * up to three heads of a group at once, meanwhile the next block's K and V rows  \
             * asked into L2 (where both blocks fit it) */                                 \
            int64_t next_at[BLOCK];                                                          \
            int64_t next_n = pos - (j0 + BLOCK) + 1 < BLOCK ? pos - (j0 + BLOCK) + 1 : BLOCK; \
            if (!fetch) next_n = 0;                                                          \
            for (int64_t i = 0; i < next_n; i++)                                             \
                next_at[i] = key_offset(table, j0 + BLOCK + i, page_size, page_s, tok_s);    \
            for (int64_t kh = 0; kh < nkv; kh++)                                             \
                for (int64_t g = 0; g < group; g += take) {                                  \
                    const int64_t h = kh * group + g;                                        \
                    const int heads = group - g < take ? (int)(group - g) : take;            \
                    const int64_t h1 = h + (heads > 1), h2 = h + 2 * (heads > 2);           \
                    const float *p[3] = {score[h], score[h1], score[h2]};                    \
                    __m512 *sums[3] = {acc + h * nd, acc + h1 * nd, acc + h2 * nd};          \
                    /* the head's K rows with its first call, V rows with its last */        \
                    const char *next_k = g == 0 ? (const char *)(k_cache + kh * head_s) : 0; \
                    const char *next_v =                                                     \
                        g + take >= group ? (const char *)(v_cache + kh * head_s) : 0;       \
                    const T *v = v_cache + kh * head_s;                                      \
                    if (heads == 3) /* (constant counts: the sums stay in registers) */      \
                        weigh_##T(v, at, n, p, sums, nd, 3, next_k, next_v, next_at, next_n,  \
                                  head_bytes);                                               \
                    else if (heads == 2)                                                     \
                        weigh_##T(v, at, n, p, sums, nd, 2, next_k, next_v, next_at, next_n,  \
                                  head_bytes);                                               \
                    else                                                                     \
                        weigh_##T(v, at, n, p, sums, nd, 1, next_k, next_v, next_at, next_n,  \
                                  head_bytes);                                               \
                }                                                                            \
        }                                                                                    \
        T *o = out + r * out_rs + kh0 * group * dim;                                         \
        for (int64_t h = 0; h < nh; h++) {                                                   \
            const __m512 inv = _mm512_set1_ps(total[h] > 0.0f ? 1.0f / total[h] : 0.0f);     \
            __m512 *a = acc + h * nd;                                                        \
            if (nd % 2 == 0)                                                                 \
                for (int c = 0; c < nd; c += 2) order32_##T(&a[c], &a[c + 1]);               \
            for (int c = 0; c < nd; c++) store16_##T(o + h * dim + 16 * c, _mm512_mul_ps(a[c], inv)); \
        }                                                                                    \
    }
#endif


#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The AVX-512 loop's twin for CPUs with AVX2 and FMA only (an EPYC of the Zen 3 generation,
 * older Xeons): 8 lanes, exp as the same polynomial with 2^n built in the exponent bits, and
 * the softmax's tail (fewer than 8 scores) in scalar expf. Measured on such an EPYC, SmolLM2
 * fp32 decode at batch 32: the portable loop's attention was 27% of the step. */
#include "cpu_vec2.h"
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline void store8_f32(float *p, __m256 x) { _mm256_storeu_ps(p, x); }

/* One head's online-softmax step over a block of n scores (32-byte aligned): the scores become
 * e^(score - running maximum), the head's maximum and sum move on, and the factor its weighted
 * sums so far must be scaled by is returned (1 where the maximum held; 0 on the first block). */
static inline float softmax_block8(float *score, int64_t n, float *best, float *total) {
    const float top = block_max8(score, n, *best);
    const float rescale = expf(*best - top);
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    int64_t jj = 0;
    for (; jj + 8 <= n; jj += 8) {
        const __m256 x = exp8(_mm256_sub_ps(_mm256_load_ps(score + jj), vtop));
        _mm256_store_ps(score + jj, x);
        vsum = _mm256_add_ps(vsum, x);
    }
    float sum = hsum8(vsum);
    for (; jj < n; jj++) {
        score[jj] = expf(score[jj] - top);
        sum += score[jj];
    }
    *total = *total * rescale + sum;
    *best = top;
    return rescale;
}

#define DEFINE_ITEM256(T)                                                                    \
    static inline __attribute__((always_inline)) void item256_##T(                           \
        const T *query, int64_t q_rs, const T *k_cache, const T *v_cache, int64_t page_s,    \
        int64_t tok_s, int64_t head_s, int64_t page_size, const int64_t *table, int64_t r,   \
        int64_t kh, int64_t lo, int64_t pos, int64_t group, const int nd, float scale,       \
        T *out, int64_t out_rs, int64_t dim) {                                               \
        __m256 q[MAX_GROUP][MAX_DIM / 8], acc[MAX_GROUP][MAX_DIM / 8];                       \
        float best[MAX_GROUP], total[MAX_GROUP];                                             \
        float score[MAX_GROUP][BLOCK] __attribute__((aligned(32)));                          \
        const __m256 vscale = _mm256_set1_ps(scale);                                         \
        for (int64_t g = 0; g < group; g++) {                                                \
            const T *qp = query + r * q_rs + (kh * group + g) * dim;                         \
            for (int c = 0; c < nd; c++) {                                                   \
                q[g][c] = _mm256_mul_ps(load8_##T(qp + 8 * c), vscale);                      \
                acc[g][c] = _mm256_setzero_ps();                                             \
            }                                                                                \
            best[g] = -INFINITY;                                                             \
            total[g] = 0.0f;                                                                 \
        }                                                                                    \
        for (int64_t ja = lo; ja <= pos && ja < lo + AHEAD; ja++)                            \
            PREFETCH_KEY(T, ja); /* the first keys */                                        \
        for (int64_t j0 = lo; j0 <= pos; j0 += BLOCK) {                                      \
            const int64_t n = (pos - j0 + 1 < BLOCK) ? pos - j0 + 1 : BLOCK;                 \
            for (int64_t jj = 0; jj < n; jj++) {                                             \
                const int64_t j = j0 + jj;                                                   \
                const T *kp = k_cache + key_offset(table, j, page_size, page_s, tok_s) +     \
                              kh * head_s;                                                   \
                if (j + AHEAD <= pos) PREFETCH_KEY(T, j + AHEAD);                            \
                __m256 k[MAX_DIM / 8];                                                       \
                for (int c = 0; c < nd; c++) k[c] = load8_##T(kp + 8 * c);                   \
                for (int64_t g = 0; g < group; g++) {                                        \
                    __m256 s = _mm256_mul_ps(q[g][0], k[0]);                                 \
                    for (int c = 1; c < nd; c++) s = _mm256_fmadd_ps(q[g][c], k[c], s);      \
                    score[g][jj] = hsum8(s);                                                 \
                }                                                                            \
            }                                                                                \
            for (int64_t g = 0; g < group; g++) {                                            \
                const float rescale = softmax_block8(score[g], n, &best[g], &total[g]);      \
                if (rescale != 1.0f) {                                                       \
                    const __m256 vr = _mm256_set1_ps(rescale);                               \
                    for (int c = 0; c < nd; c++) acc[g][c] = _mm256_mul_ps(acc[g][c], vr);   \
                }                                                                            \
            }                                                                                \
            for (int64_t jj = 0; jj < n; jj++) {                                             \
                const int64_t j = j0 + jj;                                                   \
                const T *vp = v_cache + key_offset(table, j, page_size, page_s, tok_s) +     \
                              kh * head_s;                                                   \
                __m256 v[MAX_DIM / 8];                                                       \
                for (int c = 0; c < nd; c++) v[c] = load8_##T(vp + 8 * c);                   \
                for (int64_t g = 0; g < group; g++) {                                        \
                    const __m256 p = _mm256_set1_ps(score[g][jj]);                           \
                    for (int c = 0; c < nd; c++) acc[g][c] = _mm256_fmadd_ps(p, v[c], acc[g][c]); \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int64_t g = 0; g < group; g++) {                                                \
            T *op = out + r * out_rs + (kh * group + g) * dim;                               \
            const __m256 inv = _mm256_set1_ps(total[g] > 0.0f ? 1.0f / total[g] : 0.0f);     \
            for (int c = 0; c < nd; c++) store8_##T(op + 8 * c, _mm256_mul_ps(acc[g][c], inv)); \
        }                                                                                    \
    }

/* A row's every KV head at once (8 lanes): a key's K and V rows for all heads lie side by side
 * in its page, so one pass streams them in order where a pass a head would read a third of
 * each row's lines, three times over. Each head's sums are those of item256 (same order, same
 * bits); only which head goes first changes. */
#define ROW_AHEAD 8 /* keys whose whole K and V rows are fetched ahead */
#define DEFINE_ROW256(T)                                                                     \
    static inline __attribute__((always_inline)) void row256_##T(                            \
        const T *query, int64_t q_rs, const T *k_cache, const T *v_cache, int64_t page_s,    \
        int64_t tok_s, int64_t head_s, int64_t page_size, const int64_t *table, int64_t r,   \
        int64_t kv_heads, int64_t lo, int64_t pos, int64_t group, const int nd, float scale, \
        T *out, int64_t out_rs, int64_t dim) {                                               \
        const int64_t nh = kv_heads * group, row_bytes = kv_heads * dim * (int64_t)sizeof(T); \
        __m256 q[HEAD_VECTORS], acc[HEAD_VECTORS];                                             \
        float best[MAX_HEADS], total[MAX_HEADS];                                             \
        float score[MAX_HEADS][BLOCK] __attribute__((aligned(32)));                          \
        const __m256 vscale = _mm256_set1_ps(scale);                                         \
        for (int64_t h = 0; h < nh; h++) {                                                   \
            const T *qp = query + r * q_rs + h * dim;                                        \
            for (int c = 0; c < nd; c++) {                                                   \
                q[h * nd + c] = _mm256_mul_ps(load8_##T(qp + 8 * c), vscale);                \
                acc[h * nd + c] = _mm256_setzero_ps();                                       \
            }                                                                                \
            best[h] = -INFINITY;                                                             \
            total[h] = 0.0f;                                                                 \
        }                                                                                    \
        for (int64_t ja = lo; ja <= pos && ja < lo + ROW_AHEAD; ja++)                        \
            PREFETCH_HEADS(T, ja);                                                             \
        for (int64_t j0 = lo; j0 <= pos; j0 += BLOCK) {                                      \
            const int64_t n = (pos - j0 + 1 < BLOCK) ? pos - j0 + 1 : BLOCK;                 \
            for (int64_t jj = 0; jj < n; jj++) {                                             \
                const int64_t j = j0 + jj;                                                   \
                const T *kr = k_cache + key_offset(table, j, page_size, page_s, tok_s);      \
                if (j + ROW_AHEAD <= pos)                                                    \
                    PREFETCH_HEADS(T, j + ROW_AHEAD);                                        \
                for (int64_t kh = 0; kh < kv_heads; kh++) {                                  \
                    const T *kp = kr + kh * head_s;                                          \
                    __m256 k[MAX_DIM / 8];                                                   \
                    for (int c = 0; c < nd; c++) k[c] = load8_##T(kp + 8 * c);               \
                    for (int64_t g = 0; g < group; g++) {                                    \
                        const __m256 *qh = q + (kh * group + g) * nd;                        \
                        __m256 s = _mm256_mul_ps(qh[0], k[0]);                               \
                        for (int c = 1; c < nd; c++) s = _mm256_fmadd_ps(qh[c], k[c], s);    \
                        score[kh * group + g][jj] = hsum8(s);                                \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            for (int64_t h = 0; h < nh; h++) {                                               \
                const float rescale = softmax_block8(score[h], n, &best[h], &total[h]);      \
                if (rescale != 1.0f) {                                                       \
                    const __m256 vr = _mm256_set1_ps(rescale);                               \
                    for (int c = 0; c < nd; c++)                                             \
                        acc[h * nd + c] = _mm256_mul_ps(acc[h * nd + c], vr);                \
                }                                                                            \
            }                                                                                \
            /* the block's V rows came in with its keys' fetches: a head at a time from cache, \
             * its sums in registers */                                                      \
            const T *vrow[BLOCK];                                                            \
            for (int64_t jj = 0; jj < n; jj++)                                               \
                vrow[jj] = v_cache + key_offset(table, j0 + jj, page_size, page_s, tok_s);   \
            for (int64_t h = 0; h < nh; h++) {                                               \
                const int64_t off = (h / group) * head_s;                                    \
                __m256 a[MAX_DIM / 8];                                                       \
                for (int c = 0; c < nd; c++) a[c] = acc[h * nd + c];                         \
                for (int64_t jj = 0; jj < n; jj++) {                                         \
                    const __m256 p = _mm256_set1_ps(score[h][jj]);                           \
                    const T *vp = vrow[jj] + off;                                            \
                    for (int c = 0; c < nd; c++)                                             \
                        a[c] = _mm256_fmadd_ps(p, load8_##T(vp + 8 * c), a[c]);              \
                }                                                                            \
                for (int c = 0; c < nd; c++) acc[h * nd + c] = a[c];                         \
            }                                                                                \
        }                                                                                    \
        for (int64_t h = 0; h < nh; h++) {                                                   \
            T *op = out + r * out_rs + h * dim;                                              \
            const __m256 inv = _mm256_set1_ps(total[h] > 0.0f ? 1.0f / total[h] : 0.0f);     \
            for (int c = 0; c < nd; c++)                                                     \
                store8_##T(op + 8 * c, _mm256_mul_ps(acc[h * nd + c], inv));                 \
        }                                                                                    \
    }
#endif

#ifdef __AVX512F__
DEFINE_WEIGH(f32)
DEFINE_WEIGH(bf16)
DEFINE_HEADS512(f32)
DEFINE_HEADS512(bf16)
/* an item's heads a whole row at once where they fit heads512's arrays, else one at a time;
 * the common head sizes as constants, so the register arrays unroll (and, items of whole rows,
 * the next block is fetched) */
#define ROW_ITEM(T)                                                                          \
    if (dim % 16 == 0) {                                                                     \
        const int64_t r = item * per_item / kv_heads, kh0 = item * per_item % kv_heads;      \
        const int64_t seq = row_seq[r], pos = row_pos[r];                                    \
        const int64_t lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;      \
        const int64_t *table = tables + seq * tab_s;                                         \
        const int64_t span =                                                                 \
            per_item * group <= MAX_HEADS && per_item * group * (dim / 16) <= HEAD_VECTORS   \
                ? per_item : 1;                                                              \
        const int whole = span == kv_heads; /* a call takes a row's every head */            \
        for (int64_t kh = kh0; kh < kh0 + per_item; kh += span) switch (dim) {               \
            case 64:                                                                         \
                heads512_##T(query, q_rs, k_cache, v_cache, page_s, tok_s, head_s,          \
                             page_size, table, r, kh, span, lo, pos, group, 4, scale, out,   \
                             out_rs, 64, whole);                                             \
                break;                                                                       \
            case 128:                                                                        \
                heads512_##T(query, q_rs, k_cache, v_cache, page_s, tok_s, head_s,          \
                             page_size, table, r, kh, span, lo, pos, group, 8, scale, out,   \
                             out_rs, 128, whole);                                            \
                break;                                                                       \
            default:                                                                         \
                heads512_##T(query, q_rs, k_cache, v_cache, page_s, tok_s, head_s,          \
                             page_size, table, r, kh, span, lo, pos, group, (int)(dim / 16), \
                             scale, out, out_rs, dim, 0);                                    \
            }                                                                                \
        continue;                                                                            \
    }
#define VECTOR_ITEM(T)
#elif defined(__AVX2__) && defined(__FMA__)
DEFINE_ITEM256(f32)
DEFINE_ITEM256(bf16)
DEFINE_ROW256(f32)
DEFINE_ROW256(bf16)
/* a whole row (all its KV heads) in one pass where its heads fit row256's arrays */
#define ROW_ITEM(T)                                                                          \
    if (per_item > 1 && heads <= MAX_HEADS && dim % 8 == 0 && heads * (dim / 8) <= HEAD_VECTORS) { \
        const int64_t r = item, seq = row_seq[r], pos = row_pos[r];                          \
        const int64_t lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;      \
        const int64_t *table = tables + seq * tab_s;                                         \
        if (dim == 64)                                                                       \
            row256_##T(query, q_rs, k_cache, v_cache, page_s, tok_s, head_s, page_size,     \
                       table, r, kv_heads, lo, pos, group, 8, scale, out, out_rs, 64);       \
        else                                                                                 \
            row256_##T(query, q_rs, k_cache, v_cache, page_s, tok_s, head_s, page_size,     \
                       table, r, kv_heads, lo, pos, group, (int)(dim / 8), scale, out,       \
                       out_rs, dim);                                                         \
        continue;                                                                            \
    }
#define VECTOR_ITEM(T)                                                                       \
    if (dim % 8 == 0) {                                                                      \
        switch (dim) {                                                                       \
        case 64:                                                                             \
            item256_##T(query, q_rs, k_cache, v_cache, page_s, tok_s, head_s, page_size,     \
                        table, r, kh, lo, pos, group, 8, scale, out, out_rs, 64);            \
            break;                                                                           \
        case 128:                                                                            \
            item256_##T(query, q_rs, k_cache, v_cache, page_s, tok_s, head_s, page_size,     \
                        table, r, kh, lo, pos, group, 16, scale, out, out_rs, 128);          \
            break;                                                                           \
        default:                                                                             \
            item256_##T(query, q_rs, k_cache, v_cache, page_s, tok_s, head_s, page_size,     \
                        table, r, kh, lo, pos, group, (int)(dim / 8), scale, out, out_rs,    \
                        dim);                                                                \
        }                                                                                    \
        continue;                                                                            \
    }
#else
#define VECTOR_ITEM(T)
#endif
#ifndef ROW_ITEM
#define ROW_ITEM(T)
#endif
DEFINE_STORE(f32)
DEFINE_STORE(bf16)
DEFINE_DECODE(f32)
DEFINE_DECODE(bf16)

int limits(int64_t *max_group, int64_t *max_dim) {
    *max_group = MAX_GROUP;
    *max_dim = MAX_DIM;
    return 1;
}

#ifdef __AVX512F__
/* The pointwise steps of a decoder layer (below, one body for both vector widths). bf16 rounds
 * where torch rounds (the file is built with -ffp-contract=off, so a product and a sum stay two
 * roundings): SiLU of the gate rounded to bf16, then its product with the up projection; the
 * rotation's x * cos rounded, then + swapped x * signed sin. torch ran each as two or three
 * kernels with a tensor between them (27 + 26 us a layer at 32 rows of SmolLM2, bf16, Zen 4). */
static inline __m512 exp16_full(__m512 x) { /* any x: e^x, overflowing to inf, 0 below -87 */
    __m512 big = _mm512_set1_ps(88.7f);
    __mmask16 over = _mm512_cmp_ps_mask(x, big, _CMP_GT_OQ);
    __m512 e = exp16(_mm512_min_ps(x, big));
    return _mm512_mask_mov_ps(e, over, _mm512_set1_ps(__builtin_inff()));
}

/* e^x to about an ulp for any x, for float32's SiLU: exp16's 2^(x log2 e) loses the low bits
 * of x log2 e when |x| is large (3e-6 relative at x = -80), which bf16 rounds away and float32
 * would keep. Cody-Waite: x = n ln2 + r, ln2 in two parts, then e^r by Taylor to degree 7. */
static inline __m512 exp16_f32(__m512 x) {
    __m512 big = _mm512_set1_ps(88.7f);
    __mmask16 over = _mm512_cmp_ps_mask(x, big, _CMP_GT_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, big), _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512 e = _mm512_scalef_ps(p, n);
    return _mm512_mask_mov_ps(e, over, _mm512_set1_ps(__builtin_inff()));
}

/* The vector layer of the pointwise steps: 16 lanes. bf16's SiLU takes exp16_full (its
 * rounding hides exp16's last bits), float32's exp16_f32 (about an ulp). */
#define VW 16
typedef __m512 vfloat;
#define V_LOAD_f32(p) load16_f32(p)
#define V_LOAD_bf16(p) load16_bf16(p)
#define V_STORE_f32(p, x) store16_f32(p, x)
#define V_STORE_bf16(p, x) store16_bf16(p, x)
#define V_ROUND_f32(x) (x)
#define V_ROUND_bf16(x) round_bf16_16(x)
#define V_EXP_f32(x) exp16_f32(x)
#define V_EXP_bf16(x) exp16_full(x)
#define V_HSUM(x) _mm512_reduce_add_ps(x)
#define V_HMAX(x) _mm512_reduce_max_ps(x)
#define V_NAN_LANES(x) ((unsigned)_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q))
#define V_EQ_LANES(x, y) ((unsigned)_mm512_cmp_ps_mask(x, y, _CMP_EQ_OQ))
#define V_SET1 _mm512_set1_ps
#define V_ZERO _mm512_setzero_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MUL _mm512_mul_ps
#define V_DIV _mm512_div_ps
#define V_MAX _mm512_max_ps
#define V_FMADD _mm512_fmadd_ps
#elif defined(__AVX2__) && defined(__FMA__)
/* The pointwise steps with AVX2 and FMA only (an EPYC of the Zen 3 generation): the AVX-512
 * kernels' arithmetic on 8 lanes, the same values but for the order of a sum of squares. */

/* exp16_f32 on 8 lanes: Cody-Waite and Taylor alike; 2^n (n from -150 to 128) as the product
 * of two powers made from exponent bits, which rounds once, where scalef rounds */
static inline __m256 exp8_f32(__m256 x) {
    const __m256 big = _mm256_set1_ps(88.7f);
    const __m256 over = _mm256_cmp_ps(x, big, _CMP_GT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, big), _mm256_set1_ps(-104.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 b = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    const __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, a), b);
    return _mm256_blendv_ps(e, _mm256_set1_ps(__builtin_inff()), over);
}

static inline float hmax8(__m256 x) { /* exact: a maximum does not round */
    float lanes[8], most = -__builtin_inff();
    _mm256_storeu_ps(lanes, x);
    for (int l = 0; l < 8; l++) most = lanes[l] > most ? lanes[l] : most;
    return most;
}

/* The vector layer of the pointwise steps: 8 lanes; both dtypes' SiLU take exp8_f32 (about an
 * ulp), which bf16's rounding hides as the AVX-512 build's softmax exp does there. */
#define VW 8
typedef __m256 vfloat;
#define V_LOAD_f32(p) load8_f32(p)
#define V_LOAD_bf16(p) load8_bf16(p)
#define V_STORE_f32(p, x) store8_f32(p, x)
#define V_STORE_bf16(p, x) store8_bf16(p, x)
#define V_ROUND_f32(x) (x)
#define V_ROUND_bf16(x) round8_bf16(x)
#define V_EXP_f32(x) exp8_f32(x)
#define V_EXP_bf16(x) exp8_f32(x)
#define V_HSUM(x) hsum8(x)
#define V_HMAX(x) hmax8(x)
#define V_NAN_LANES(x) ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)))
#define V_EQ_LANES(x, y) ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x, y, _CMP_EQ_OQ)))
#define V_SET1 _mm256_set1_ps
#define V_ZERO _mm256_setzero_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MUL _mm256_mul_ps
#define V_DIV _mm256_div_ps
#define V_MAX _mm256_max_ps
#define V_FMADD _mm256_fmadd_ps
#endif

#ifdef VW
#define ROUND_f32(x) (x)
#define ROUND_bf16(x) bf16_to_f32(f32_to_bf16(x))

/* RMSNorm of a row as transformers' LlamaRMSNorm (and Qwen3RMSNorm, over a head) computes it:
 * the sum of squares in float32, in our order, x * rsqrt(mean + eps) rounded to the dtype, then
 * times the weight, rounded again. */
#define DEFINE_NORM_ROW(T)                                                                         \
    static inline void norm_row_##T(const T *x, T *out, int64_t dim, const T *w, float eps) {      \
        vfloat sq = V_ZERO();                                                                      \
        int64_t i = 0;                                                                             \
        for (; i + VW <= dim; i += VW) {                                                           \
            const vfloat v = V_LOAD_##T(x + i);                                                    \
            sq = V_FMADD(v, v, sq);                                                                \
        }                                                                                          \
        float sum = V_HSUM(sq);                                                                    \
        for (; i < dim; i++) sum += LOAD_##T(x, i) * LOAD_##T(x, i);                               \
        const float inv = 1.0f / __builtin_sqrtf(sum / (float)dim + eps);                          \
        const vfloat vinv = V_SET1(inv);                                                           \
        for (i = 0; i + VW <= dim; i += VW) {                                                      \
            const vfloat y = V_ROUND_##T(V_MUL(V_LOAD_##T(x + i), vinv));                          \
            V_STORE_##T(out + i, V_MUL(y, V_LOAD_##T(w + i)));                                     \
        }                                                                                          \
        for (; i < dim; i++) STORE_##T(out, i, ROUND_##T(LOAD_##T(x, i) * inv) * LOAD_##T(w, i));  \
    }
DEFINE_NORM_ROW(f32)
DEFINE_NORM_ROW(bf16)

/* silu_mul_T: out[r, i] = silu(gate) * up, gate = gu[r, i], up = gu[r, n + i] (bf16: the SiLU
 * rounded, then the product); rotate_T: out[t, h] = x * cos + swapped(x) * ssin, x = x_[t * x_rs
 * + h * dim], cos and ssin [t * cs_rs], out packed [t, heads, dim] (bf16: x * cos rounded);
 * head_norms_T: Qwen3's RMSNorm over each q and k head (x read in place from the fused q/k/v
 * output; w [heads, dim], q's weight for each query head, then k's), one pass where a copy, a
 * norm and a product were three. n and dim multiples of 2 * VW. */
#define DEFINE_POINTWISE(T)                                                                        \
    void silu_mul_##T(const T *gu, int64_t rows, int64_t gu_rs, int64_t n, T *out, int64_t out_rs, \
                      int threads) {                                                               \
        const vfloat one = V_SET1(1.0f);                                                           \
        _Pragma("omp parallel for num_threads(threads) if (rows * n >= 32768) schedule(static)")   \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *g = gu + r * gu_rs, *u = g + n;                                               \
            T *o = out + r * out_rs;                                                               \
            for (int64_t i = 0; i < n; i += VW) {                                                  \
                const vfloat x = V_LOAD_##T(g + i);                                                \
                const vfloat den = V_ADD(one, V_EXP_##T(V_SUB(V_ZERO(), x)));                      \
                const vfloat s = V_ROUND_##T(V_DIV(x, den));                                       \
                V_STORE_##T(o + i, V_MUL(s, V_LOAD_##T(u + i)));                                   \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    void rotate_##T(const T *x_, int64_t tokens, int64_t x_rs, int64_t heads, int64_t dim,         \
                    const T *cos_, const T *ssin_, int64_t cs_rs, T *out, int threads) {           \
        const int64_t half = dim / 2;                                                              \
        _Pragma("omp parallel for num_threads(threads) if (tokens * heads * dim >= 32768) schedule(static)") \
        for (int64_t t = 0; t < tokens; t++) {                                                     \
            const T *c = cos_ + t * cs_rs, *s = ssin_ + t * cs_rs;                                 \
            for (int64_t h = 0; h < heads; h++) {                                                  \
                const T *x = x_ + t * x_rs + h * dim;                                              \
                T *o = out + (t * heads + h) * dim;                                                \
                for (int64_t i = 0; i < dim; i += VW) {                                            \
                    const int64_t j = i < half ? i + half : i - half;                              \
                    const vfloat a = V_ROUND_##T(V_MUL(V_LOAD_##T(x + i), V_LOAD_##T(c + i)));     \
                    const vfloat b = V_MUL(V_LOAD_##T(x + j), V_LOAD_##T(s + i));                  \
                    V_STORE_##T(o + i, V_ADD(a, b));                                               \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    void head_norms_##T(const T *x_, int64_t tokens, int64_t x_rs, int64_t heads, int64_t dim,     \
                        const T *w, double eps, T *out, int threads) {                             \
        _Pragma("omp parallel for num_threads(threads) if (tokens * heads * dim >= 32768) schedule(static)") \
        for (int64_t t = 0; t < tokens; t++)                                                       \
            for (int64_t h = 0; h < heads; h++)                                                    \
                norm_row_##T(x_ + t * x_rs + h * dim, out + (t * heads + h) * dim, dim,            \
                             w + h * dim, (float)eps);                                             \
    }
DEFINE_POINTWISE(f32)
DEFINE_POINTWISE(bf16)

/* Greedy picks: out[r] = torch.argmax(x[r]) for float32 or bf16 rows of n values (row stride
 * rs): the first index of the row's maximum, or of its first NaN (torch counts NaN above
 * everything). torch's argmax walked a [32, 49152] batch of logits in 1.6 ms here (a scalar
 * reduction); this is a max pass and a find pass over each row, both vector. */
#define DEFINE_ARGMAX(T)                                                                           \
    void argmax_rows_##T(const T *x, int64_t rows, int64_t rs, int64_t n, int64_t *out,            \
                         int threads) {                                                            \
        _Pragma("omp parallel for num_threads(threads) if (rows * n >= 65536) schedule(static)")   \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *row = x + r * rs;                                                             \
            vfloat top = V_SET1(-__builtin_inff());                                                \
            unsigned nan = 0;                                                                      \
            int64_t i = 0;                                                                         \
            for (; i + VW <= n && !nan; i += VW) {                                                 \
                const vfloat v = V_LOAD_##T(row + i);                                              \
                nan = V_NAN_LANES(v);                                                              \
                top = V_MAX(top, v);                                                               \
            }                                                                                      \
            float most = V_HMAX(top);                                                              \
            int64_t at = -1;                                                                       \
            if (nan) {                                                                             \
                at = i - VW + __builtin_ctz(nan);                                                  \
            } else {                                                                               \
                for (int64_t j = i; j < n; j++) {                                                  \
                    const float v = LOAD_##T(row, j);                                              \
                    if (v != v) {                                                                  \
                        at = j;                                                                    \
                        break;                                                                     \
                    }                                                                              \
                    most = v > most ? v : most;                                                    \
                }                                                                                  \
            }                                                                                      \
            if (at < 0) {                                                                          \
                const vfloat m = V_SET1(most);                                                     \
                for (i = 0; i + VW <= n; i += VW) {                                                \
                    const unsigned hit = V_EQ_LANES(V_LOAD_##T(row + i), m);                       \
                    if (hit) {                                                                     \
                        at = i + __builtin_ctz(hit);                                               \
                        break;                                                                     \
                    }                                                                              \
                }                                                                                  \
                for (int64_t j = i; at < 0 && j < n; j++)                                          \
                    if (LOAD_##T(row, j) == most) at = j;                                          \
            }                                                                                      \
            out[r] = at < 0 ? 0 : at;                                                              \
        }                                                                                          \
    }
DEFINE_ARGMAX(f32)
DEFINE_ARGMAX(bf16)
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* RMSNorm rows for AVX2 builds, where zentorch's fused add-and-norm took 2.95 against torch's
 * add and norm 0.53 ms at 2,048 rows of 576 and 0.068 against 0.046 at 32 (an EPYC of the Zen 3
 * generation). ``add_rms_norm_T``: residual += hidden first (bf16: the sum rounded), the norm
 * into hidden; ``rms_norm_T``: x's norm into out. The native layer loop binds add_rms_norm
 * through ``add_rms_norm_call`` (zentorch's signature) on these builds. For a bf16 model on a
 * CPU without bf16 matmuls torch's composite RMSNorm took ~40 us a call at 1 row of 576 (61
 * calls a SmolLM2 step). AVX-512 builds take zentorch's norms. */
#define DEFINE_ROW_NORMS(T)                                                                        \
    void add_rms_norm_##T(T *hidden, T *residual, int64_t rows, int64_t dim, const T *w,           \
                          double eps, int threads) {                                               \
        _Pragma("omp parallel for num_threads(threads) if (rows * dim >= 32768) schedule(static)") \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            T *h = hidden + r * dim, *res = residual + r * dim;                                    \
            int64_t i = 0;                                                                         \
            for (; i + VW <= dim; i += VW)                                                         \
                V_STORE_##T(res + i, V_ADD(V_LOAD_##T(res + i), V_LOAD_##T(h + i)));               \
            for (; i < dim; i++) STORE_##T(res, i, LOAD_##T(res, i) + LOAD_##T(h, i));             \
            norm_row_##T(res, h, dim, w, (float)eps);                                              \
        }                                                                                          \
    }                                                                                              \
    void rms_norm_##T(const T *x, T *out, int64_t rows, int64_t dim, const T *w, double eps,       \
                      int threads) {                                                               \
        _Pragma("omp parallel for num_threads(threads) if (rows * dim >= 32768) schedule(static)") \
        for (int64_t r = 0; r < rows; r++)                                                         \
            norm_row_##T(x + r * dim, out + r * dim, dim, w, (float)eps);                          \
    }
DEFINE_ROW_NORMS(f32)
DEFINE_ROW_NORMS(bf16)

#include <omp.h>
static int32_t norm_codes[2] = {-1, -1}; /* torch's shim codes of float32 and bf16 (norms_bind) */
void norms_bind(int32_t f32_code, int32_t bf16_code) {
    norm_codes[0] = f32_code;
    norm_codes[1] = bf16_code;
}

/* add_rms_norm_f32 or _bf16 with zentorch's add-and-norm signature (the native loop's); -1 for
 * another dtype */
int32_t add_rms_norm_call(void *hidden, void *residual, int64_t rows, int64_t dim,
                          int32_t dtype, void *weight, double eps) {
    if (dtype == norm_codes[0])
        add_rms_norm_f32(hidden, residual, rows, dim, weight, eps, omp_get_max_threads());
    else if (dtype == norm_codes[1])
        add_rms_norm_bf16(hidden, residual, rows, dim, weight, eps, omp_get_max_threads());
    else
        return -1;
    return 0;
}
#endif
