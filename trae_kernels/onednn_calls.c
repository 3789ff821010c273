/* torch's oneDNN linear on a prepacked weight (mkldnn::_linear_pointwise, what PackedLinear
 * runs) called through torch's own C shim, the function AOTInductor's generated code calls.
 *
 * Why: the native layer loop (zen_layers.c) needs a C entry for every kernel of a layer. On
 * Intel CPUs the linears are oneDNN's (AMX or AVX512-BF16 brgemm kernels), which have no C
 * API of their own in torch: the shim takes tensor handles. The input is wrapped as a handle
 * that owns nothing (no copy); the weight is a handle the caller holds for the weight's life
 * (an opaque mkldnn tensor cannot be wrapped from its address); the op allocates its output,
 * which is copied into the caller's buffer and dropped, so the loop's buffers stay fixed.
 *
 * Built and loaded by trae_kernels/onednn_calls.py like cpu_paged.c (no torch headers: the C
 * functions it calls are bound at run time, by address, from the libtorch torch loaded).
 *
 * Decode rows on AMX (bf16, at most 32 rows) skip the op: a call through torch costs ~21 us
 * whatever the shape (dispatch, ideep's tensors, the primitive cache's key, the output's
 * allocation and copy), 121 calls a SmolLM2 step, while the other thread waits. These rows
 * are multiplied here on tiles from oneDNN's packed buffer, read as [n / 32][k / 2][32][2]
 * (pairs of k for 32 columns, what its AMX kernels read), k in the same order, for the same
 * bits.
 *
 * Float32 rows (at most 64 with AVX-512; any count with AVX2 and FMA only) skip it too where
 * oneDNN laid the weight out as [n / 64][k][64] (panels of 64 columns): oneDNN's float32
 * kernels at these rows reached ~170 GFLOP/s on a step's linears streamed from memory, where a
 * panel multiplied by 6-7 rows at a time, the next panel fetched meanwhile, reaches ~230. oneDNN
 * sums k in blocks (512 or 1024 by shape and rows, each summed on its own, then added in order).
 *
 * Neither layout nor order is a promise of oneDNN's, so both paths prove themselves: the first
 * call at each row count of a weight is answered by the op, this file's product runs beside it
 * (float32: with each k block oneDNN is known to use), and that row count stays here only where
 * the bits are the op's; else it keeps the op. Counts past 64 (prompt rows, AVX2 builds) share
 * one proof, made at the first such call: a prompt's row count seldom repeats, and a proof at
 * each would run both products every time. The proof settles the layout; that oneDNN keeps
 * its k blocks at other large counts was checked at 65-2,048 rows on SmolLM2's shapes (its
 * float32 kernels on that EPYC sum k in blocks of 1,024 from 2 rows), and each row's sums here
 * do not depend on how many rows come with it.
 *
 * AVX2 builds also multiply bf16 models' linears on CPUs without bf16 matmuls (no AVX512-BF16 or
 * AMX: oneDNN's bf16 matmul is its reference kernel there) from bf16 panels of our own, with the
 * same passes (onednn_bf16_panels): no op and no proof, since the product is defined as the
 * float32 one of the widened values, which the tests check against the float32 op.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <omp.h>
#define PANELS_F32 1 /* this build multiplies float32 panels itself */
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "cpu_tiles.h"
#include "cpu_vec.h"
#endif

#define F32_ROWS 64 /* float32 row counts proven one at a time */
#define F32_SLOTS (F32_ROWS + 2) /* ``found``: a slot a row count to F32_ROWS, one for more */
#if defined(__AVX512F__)
#define F32_MOST F32_ROWS /* float32 rows the panel path takes */
#else
#define F32_MOST INT32_MAX /* AVX2: prompt rows too (see panels_f32) */
#endif

/* A packed weight as the layer loop holds it: torch's handle; its buffer where this file may
 * read it itself (bf16 on tiles, float32 panels; else NULL); and what the first call at each
 * row count found (every count past F32_ROWS shares the last slot): 0 not yet called, -1 the
 * op (nothing here gave its bits), else how this file gives them (float32: oneDNN's k block;
 * bf16: 1) */
typedef struct {
    void *handle;
    const void *blocked;
    int16_t found[F32_SLOTS];
} Weight;

typedef int32_t (*blob_fn)(void *data, int64_t ndim, const int64_t *sizes,
                           const int64_t *strides, int64_t offset, int32_t dtype,
                           int32_t device_type, int32_t device_index, void **ret);
typedef int32_t (*delete_fn)(void *handle);
typedef int32_t (*data_fn)(void *handle, void **data);
typedef int32_t (*pointwise_fn)(void *x, void *weight, void **bias, const char *attr,
                                const double **scalars, int64_t n_scalars,
                                const char **algorithm, void **ret);

static blob_fn blob;
static delete_fn drop;
static data_fn data_of;
static pointwise_fn pointwise;
static int32_t cpu;
static int32_t codes[2];   /* torch's shim codes of float32 and bfloat16 */
static const int64_t sizes_of[2] = {4, 2};

void onednn_bind(void *blob_f, void *drop_f, void *data_f, void *pointwise_f, int32_t cpu_type,
                 int32_t f32_code, int32_t bf16_code) {
    blob = (blob_fn)blob_f;
    drop = (delete_fn)drop_f;
    data_of = (data_fn)data_f;
    pointwise = (pointwise_fn)pointwise_f;
    cpu = cpu_type;
    codes[0] = f32_code;
    codes[1] = bf16_code;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ROWS 32    /* rows the tile path takes: two tiles of 16 */
#define MAX_K 4096 /* the widest input it takes (its padded copy of the rows is on the stack) */
/* Bytes of the packed weight fetched into L2 ahead of the tiles' loads. The weight streams
 * from memory in order, but at 32 rows the products between loads leave the hardware's
 * prefetchers behind: a step's 121 SmolLM2 linears (the lm_head included) took 10.9 ms
 * without, 8.7 with 8 KB ahead (4 KB: 8.9, 32 KB: 8.9; into L1: 9.1); at 16 and 1 rows
 * 0.96x and 1.0x the time. Alternating in one process, an Intel Xeon with AMX. */
#define TILE_AHEAD 8192
static int amx; /* 1 once the OS granted the tile state */

/* Rows [0, rows) of 16 columns from ``at`` of sums ``s`` (16 x 16 float32), plus bias, rounded
 * once (as oneDNN adds its bias before rounding) */
static inline void put(const float *s, int64_t rows, const bf16 *bias, int64_t at, int64_t n,
                       bf16 *out) {
    const __m512 b = bias ? load16_bf16(bias + at) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        __m512 v = _mm512_load_ps(s + r * 16);
        if (bias) v = _mm512_add_ps(v, b);
        store16_bf16(out + r * n + at, v);
    }
}

/* out [rows, n] (bf16) = x [rows, k] times the weight's pairs, plus bias (bf16, or NULL), a
 * block of 32 columns (one sequential stretch of the packed weight) at a time: tiles 0-1 and
 * 5-6 the sums of rows 0-15 and 16-31 by columns 0-15 and 16-31, 2-3 their x, 4 and 7 the
 * columns' pairs (a 128-byte row holds both halves' pairs) */
static void tile_rows(const bf16 *x, int64_t rows, int64_t k, int64_t x_rs, int64_t n,
                      const Weight *w, const bf16 *bias, bf16 *out) {
    const int64_t used = rows > 16 ? ROWS : 16;
    bf16 a[used * k] __attribute__((aligned(64))); /* the rows, padded with zeros */
    memset(a + rows * k, 0, (size_t)((used - rows) * k) * sizeof(bf16));
    for (int64_t r = 0; r < rows; r++) memcpy(a + r * k, x + r * x_rs, (size_t)k * 2);
    const int64_t blocks = n / 32, two = rows > 16;
    const char *end = (const char *)w->blocked + n * k * (int64_t)sizeof(bf16);
#pragma omp parallel num_threads(omp_get_max_threads())
    {
        configure_tiles();
        float sums[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const bf16 *cols = (const bf16 *)w->blocked + b * (k / 2) * 64;
            _tile_zero(0);
            _tile_zero(1);
            if (two) {
                _tile_zero(5);
                _tile_zero(6);
            }
            for (int64_t j = 0; j < k; j += 32) {
                const char *ahead = (const char *)(cols + (j / 2) * 64) + TILE_AHEAD;
                for (int q = 0; q < 2048; q += 64) /* this step's 2 KB, TILE_AHEAD further on */
                    if (ahead + q < end) _mm_prefetch(ahead + q, _MM_HINT_T1);
                _tile_loadd(4, cols + (j / 2) * 64, 128);
                _tile_loadd(7, cols + (j / 2) * 64 + 32, 128);
                _tile_loadd(2, a + j, k * 2);
                _tile_dpbf16ps(0, 2, 4);
                _tile_dpbf16ps(1, 2, 7);
                if (two) {
                    _tile_loadd(3, a + 16 * k + j, k * 2);
                    _tile_dpbf16ps(5, 3, 4);
                    _tile_dpbf16ps(6, 3, 7);
                }
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            put(sums[0], rows < 16 ? rows : 16, bias, b * 32, n, out);
            put(sums[1], rows < 16 ? rows : 16, bias, b * 32 + 16, n, out);
            if (two) {
                _tile_stored(5, sums[2], 64);
                _tile_stored(6, sums[3], 64);
                put(sums[2], rows - 16, bias, b * 32, n, out + 16 * n);
                put(sums[3], rows - 16, bias, b * 32 + 16, n, out + 16 * n);
            }
        }
        _tile_release();
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* 1 where decode rows may take the tile path (the CPU has AMX and the OS grants its state) */
static int32_t tiles_granted(void) {
    if (!amx) amx = request_tiles();
    return amx;
}
#endif

#if defined(PANELS_F32)
/* Where part ``i`` of ``total`` spread evenly over ``parts`` starts (the first total % parts
 * parts one longer: 32 rows in 6 blocks are 6, 6, 5, 5, 5, 5); part i is [start(i), start(i+1)) */
static inline int64_t part_start(int64_t i, int64_t total, int64_t parts) {
    const int64_t even = total / parts, extra = total % parts;
    return i * even + (i < extra ? i : extra);
}
#endif

#if defined(__AVX512F__)
#define PANEL 64 /* columns of a float32 panel: four vectors */
/* Rows a pass over a panel takes: 28 sums and the panel's 4 vectors fill the 32 registers (the
 * rows' values are broadcast from memory). bench/panels.py, 30 layers of SmolLM2's linears,
 * Zen 5: 7 against 6 rows a pass 0.94-0.98x the time at 32 rows, level or faster at 1-64 (fewer
 * passes over each panel from L2; 8 rows spill: 1.15x). */
#define ROW_BLOCK 7
#define AHEAD 48 /* k a first pass fetches ahead of itself (12 KB) */

/* out rows [0, R) x one panel's 64 columns = x rows times the panel, k in blocks of ``kb``
 * summed on their own and then added in order (oneDNN's order), plus bias. The first pass over
 * a panel (``first``) reads it from memory and fetches ahead of itself; later passes read it
 * from L2 and fetch ``fetch_n`` lines of the next panel from ``fetch`` meanwhile, ``per`` a k. */
#define PANEL_ROWS(R)                                                                              \
    static void panel_##R(const float *x, int64_t x_rs, const float *panel, int64_t k,            \
                          int64_t kb, const float *bias, float *out, int64_t n, int first,         \
                          const char *fetch, int64_t fetch_n, int64_t per) {                       \
        __m512 sum[R][4], total[R][4];                                                             \
        for (int64_t j0 = 0; j0 < k; j0 += kb) {                                                   \
            for (int r = 0; r < R; r++)                                                            \
                for (int v = 0; v < 4; v++) sum[r][v] = _mm512_setzero_ps();                      \
            const int64_t j1 = j0 + kb < k ? j0 + kb : k;                                          \
            _Pragma("GCC unroll 4") for (int64_t j = j0; j < j1; j++) {                            \
                const float *b = panel + j * PANEL;                                                \
                if (first && j + AHEAD < k)                                                        \
                    for (int q = 0; q < 4; q++)                                                    \
                        _mm_prefetch((const char *)(b + AHEAD * PANEL) + q * 64, _MM_HINT_T0);     \
                for (int64_t q = j * per; q < fetch_n && q < (j + 1) * per; q++)                   \
                    _mm_prefetch(fetch + q * 64, _MM_HINT_T1);                                     \
                const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);                \
                const __m512 b2 = _mm512_loadu_ps(b + 32), b3 = _mm512_loadu_ps(b + 48);           \
                for (int r = 0; r < R; r++) {                                                      \
                    const __m512 a = _mm512_set1_ps(x[r * x_rs + j]);                              \
                    sum[r][0] = _mm512_fmadd_ps(a, b0, sum[r][0]);                                 \
                    sum[r][1] = _mm512_fmadd_ps(a, b1, sum[r][1]);                                 \
                    sum[r][2] = _mm512_fmadd_ps(a, b2, sum[r][2]);                                 \
                    sum[r][3] = _mm512_fmadd_ps(a, b3, sum[r][3]);                                 \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < R; r++)                                                            \
                for (int v = 0; v < 4; v++)                                                        \
                    total[r][v] = j0 ? _mm512_add_ps(total[r][v], sum[r][v]) : sum[r][v];          \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int v = 0; v < 4; v++) {                                                          \
                __m512 t = total[r][v];                                                            \
                if (bias) t = _mm512_add_ps(t, _mm512_loadu_ps(bias + v * 16));                   \
                _mm512_storeu_ps(out + r * n + v * 16, t);                                         \
            }                                                                                      \
    }
PANEL_ROWS(1)
PANEL_ROWS(2)
PANEL_ROWS(3)
PANEL_ROWS(4)
PANEL_ROWS(5)
PANEL_ROWS(6)
PANEL_ROWS(7)
typedef void (*panel_fn)(const float *, int64_t, const float *, int64_t, int64_t, const float *,
                         float *, int64_t, int, const char *, int64_t, int64_t);
static const panel_fn panel_rows[ROW_BLOCK + 1] = {0,       panel_1, panel_2, panel_3,
                                                   panel_4, panel_5, panel_6, panel_7};

/* out [rows, n] (float32) = x [rows, k] times the panels, k in blocks of kb, plus bias: items
 * of (panel, block of at most ROW_BLOCK rows), panel by panel, split between the threads in
 * order */
static int32_t panels_f32(const float *x, int64_t rows, int64_t k, int64_t x_rs,
                          const float *w, int64_t n, int64_t kb, const float *bias, float *out) {
    const int64_t panels = n / PANEL, row_blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t lines = k * PANEL * 4 / 64; /* cache lines of a panel */
    /* rows split evenly (part_start): a pass of few rows loads as much as any */
#pragma omp parallel for schedule(static) num_threads(omp_get_max_threads())
    for (int64_t item = 0; item < panels * row_blocks; item++) {
        const int64_t p = item / row_blocks, rb = item % row_blocks;
        const int64_t r0 = part_start(rb, rows, row_blocks);
        const int64_t r = part_start(rb + 1, rows, row_blocks) - r0;
        const char *fetch = 0;
        int64_t fetch_n = 0, per = 1;
        if (rb > 0 && p + 1 < panels) { /* this pass's share of the next panel */
            const int64_t share = (lines + row_blocks - 2) / (row_blocks - 1);
            const int64_t from = (rb - 1) * share, to = from + share < lines ? from + share : lines;
            fetch = (const char *)(w + (p + 1) * k * PANEL) + from * 64;
            fetch_n = to > from ? to - from : 0;
            per = (share + k - 1) / k;
        }
        panel_rows[r](x + r0 * x_rs, x_rs, w + p * k * PANEL, k, kb, bias ? bias + p * PANEL : 0,
                      out + r0 * n + p * PANEL, n, rb == 0, fetch, fetch_n, per);
    }
    return 0;
}
#elif defined(PANELS_F32)
/* The same panels with AVX2 and FMA only (an EPYC of the Zen 3 generation), where oneDNN lays a
 * float32 weight out alike (AB16b64a: [n / 64][k][64]) and sums k in blocks of 1,024. Sixteen
 * 8-lane registers hold fewer sums, so a pass takes R rows by V of a panel's eight vectors (6
 * rows by 2: 12 sums, 2 loads of the panel and 6 broadcasts a k): a strip of 8 V columns.
 * On that EPYC a SmolLM2 step's 121 linears took 21.3 against oneDNN's 26.4 ms at 1 row, 49.5
 * against 57.8 at 16 and 80.8 against 82.6 at 32. Unrolling the k loop by 4 took that from ~120.
 *
 * Two things beyond the AVX-512 build's order: the rows are first copied k-major by blocks
 * (xp[j * R + r]), so a k step broadcasts from one pointer where six row pointers each cost an
 * add (gcc kept one a row); and the work goes strip by strip (every row block over one strip,
 * then the next), the first pass fetching the first line of its strip's k steps only. A panel
 * at a time, the first pass fetching all four lines of each k into L1, left most of them to be
 * evicted before their pass. 30 layers of SmolLM2's linears and its lm_head at 32 rows, the
 * two alternating in one process, the same bits: 0.87-0.95x the time on the host's slow
 * minutes, ~1.0x on its fast ones, 0.91-0.94x from L3 (one layer); whole runs of 32 x 100 a
 * median 0.98x (0.96-1.04x across four A/B runs), 16 x 100 0.96x, batch 1 1.00-1.04x (two
 * processes of the same code differed by 2%).
 *
 * The same passes take prompt rows (any count here), in chunks of rows whose copy is at most
 * CHUNK_BYTES (a decode step's rows are one chunk): a copy of all 2,048 rows of a chunked
 * prompt (12 MB at k = 1,536) was mmapped and faulted in afresh at every call, 37x the page
 * faults of a prefill and slower than the op in the engine. SmolLM2's four linears of 30
 * layers at 2,048 rows, fresh inputs, alternating with oneDNN's op in one process: 0.92x its
 * time with 2 MB chunks (unchunked 0.91-0.94x, 256 KB 0.95-1.0x, 128 KB 0.99x); in the engine
 * the linears of 16 x 512 prefills 0.92x, the prefills 0.93x. */
#define PANEL 64
#define ROW_BLOCK 6
#define AHEAD 32 /* k a first pass fetches ahead of itself (8 KB) */
#define CHUNK_BYTES (2 << 20) /* the most of the rows copied and multiplied at a time */

#include "cpu_vec2.h" /* load8_bf16 (widened exactly), store8_bf16 (rounded to nearest even) */
/* 8 weights of a panel as float32: load8_float's or load8_bf16's */
static inline __m256 load8_float(const float *b) { return _mm256_loadu_ps(b); }
static inline float widen_bf16(bf16 h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* k steps of R packed rows (xp) by V vectors of a strip (b, weights of type T), summed into
 * ``sum``; PREFETCH runs once a step (j the step) */
#define STEPS(R, V, T, NAME, PREFETCH)                                                             \
    static inline __attribute__((always_inline)) void steps_##R##_##V##_##T##_##NAME(             \
        const float *xp, const T *b, int64_t n_steps, const char *fetch, __m256 sum[R][V]) {       \
        (void)fetch;                                                                               \
        _Pragma("GCC unroll 4") for (int64_t j = 0; j < n_steps; j++) {                           \
            PREFETCH;                                                                              \
            __m256 w[V];                                                                           \
            for (int v = 0; v < V; v++) w[v] = load8_##T(b + j * PANEL + 8 * v);                  \
            for (int r = 0; r < R; r++) {                                                          \
                const __m256 a = _mm256_broadcast_ss(xp + j * R + r);                              \
                for (int v = 0; v < V; v++) sum[r][v] = _mm256_fmadd_ps(a, w[v], sum[r][v]);       \
            }                                                                                      \
        }                                                                                          \
    }
/* out rows [0, R) x a strip = the packed rows times the strip, k in blocks of ``kb`` summed on
 * their own and then added in order (oneDNN's order), plus bias. The first pass over a strip
 * reads it from memory and fetches its own k steps AHEAD on; a later one reads it from L2 and
 * fetches the k steps [f_from, f_to) of the next strip (``fetch``) meanwhile: a line a step,
 * the hardware's prefetcher taking the rest of a wider strip (one row's 4 lines: 0.92-0.97x
 * the time of fetching all 4). */
#define PASS(R, V, T)                                                                              \
    STEPS(R, V, T, ahead, _mm_prefetch(fetch + j * PANEL * sizeof(T), _MM_HINT_T0))                \
    STEPS(R, V, T, next, _mm_prefetch(fetch + j * PANEL * sizeof(T), _MM_HINT_T1))                 \
    STEPS(R, V, T, none, )                                                                         \
    static void pass_##R##_##V##_##T(const float *xp, const void *strip_of, int64_t k, int64_t kb, \
                                     const float *bias, void *out, int64_t n, int out_bf16,        \
                                     int first, const char *fetch, int64_t f_from, int64_t f_to) { \
        const T *strip = strip_of;                                                                 \
        __m256 sum[R][V], total[R][V];                                                             \
        if (first) {                                                                               \
            fetch = (const char *)(strip + AHEAD * PANEL); /* past the end too: a hint */          \
            f_from = 0;                                                                            \
            f_to = k;                                                                              \
        }                                                                                          \
        for (int64_t j0 = 0; j0 < k; j0 += kb) {                                                   \
            for (int r = 0; r < R; r++)                                                            \
                for (int v = 0; v < V; v++) sum[r][v] = _mm256_setzero_ps();                      \
            const int64_t j1 = j0 + kb < k ? j0 + kb : k;                                          \
            const int64_t a = f_from < j0 ? j0 : f_from > j1 ? j1 : f_from;                        \
            const int64_t b = f_to < a ? a : f_to > j1 ? j1 : f_to;                                \
            steps_##R##_##V##_##T##_none(xp + j0 * R, strip + j0 * PANEL, a - j0, 0, sum);         \
            if (first)                                                                             \
                steps_##R##_##V##_##T##_ahead(xp + a * R, strip + a * PANEL, b - a,                \
                                              fetch + a * PANEL * sizeof(T), sum);                 \
            else                                                                                   \
                steps_##R##_##V##_##T##_next(xp + a * R, strip + a * PANEL, b - a,                 \
                                             fetch + a * PANEL * sizeof(T), sum);                  \
            steps_##R##_##V##_##T##_none(xp + b * R, strip + b * PANEL, j1 - b, 0, sum);           \
            for (int r = 0; r < R; r++)                                                            \
                for (int v = 0; v < V; v++)                                                        \
                    total[r][v] = j0 ? _mm256_add_ps(total[r][v], sum[r][v]) : sum[r][v];          \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int v = 0; v < V; v++) {                                                          \
                __m256 t = total[r][v];                                                            \
                if (bias) t = _mm256_add_ps(t, _mm256_loadu_ps(bias + v * 8));                     \
                if (out_bf16)                                                                      \
                    store8_bf16((bf16 *)out + r * n + v * 8, t);                                   \
                else                                                                               \
                    _mm256_storeu_ps((float *)out + r * n + v * 8, t);                             \
            }                                                                                      \
    }
#define PASSES(T)                                                                                  \
    PASS(1, 8, T)                                                                                  \
    PASS(2, 4, T)                                                                                  \
    PASS(3, 4, T)                                                                                  \
    PASS(3, 2, T)                                                                                  \
    PASS(4, 2, T)                                                                                  \
    PASS(5, 2, T)                                                                                  \
    PASS(6, 2, T)                                                                                  \
    /* [rows][vectors / 2]: the pass of a block of that many rows over a strip of 8 x vectors    \
     * columns (a block of 3 beside blocks of 4 takes the strip of 2 vectors theirs do) */        \
    static const pass_fn passes_##T[ROW_BLOCK + 1][5] = {                                          \
        {0},                        {0, 0, 0, 0, pass_1_8_##T}, {0, 0, pass_2_4_##T},              \
        {0, pass_3_2_##T, pass_3_4_##T}, {0, pass_4_2_##T},     {0, pass_5_2_##T},                 \
        {0, pass_6_2_##T}};
typedef void (*pass_fn)(const float *, const void *, int64_t, int64_t, const float *, void *,
                        int64_t, int, int, const char *, int64_t, int64_t);
PASSES(float)
PASSES(bf16)
static const int strip_columns[ROW_BLOCK + 1] = {0, 64, 32, 32, 16, 16, 16};

/* A weight's panels [n / 64][k][64]: float32 ones oneDNN packed, or bf16 ones of ours */
typedef struct {
    const void *at;
    size_t elem;                  /* bytes a weight */
    const pass_fn (*passes)[5];   /* passes_float or passes_bf16 */
} Panels;

/* One chunk of rows (``rows`` of x into ``out``, both bf16 where ``bf16_io``) inside
 * panels_f32's parallel region: copied k-major by blocks into ``copy`` (widened to float32),
 * then every row block over one strip before the next strip */
static void chunk_f32(const void *x, int64_t rows, int64_t k, int64_t x_rs, Panels w,
                      int64_t n, int64_t kb, const float *bias, void *out, int bf16_io,
                      float *copy) {
    const int64_t panels = n / PANEL, row_blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    const int cols = strip_columns[part_start(1, rows, row_blocks)]; /* the largest block's */
    const int64_t strips = PANEL / cols, items = panels * strips;
    const float *const xp = copy ? copy : x; /* one float32 row is k-major already */
    const size_t out_elem = bf16_io ? sizeof(bf16) : sizeof(float);
    const char *const at = w.at;
    /* a later pass's share of the next strip's k steps */
    const int64_t share = row_blocks > 1 ? (k + row_blocks - 2) / (row_blocks - 1) : 0;
    if (copy) {
#pragma omp for schedule(static)
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            const int64_t r0 = part_start(rb, rows, row_blocks);
            const int64_t r = part_start(rb + 1, rows, row_blocks) - r0;
            float *dst = copy + r0 * k;
            if (bf16_io) {
                const bf16 *from = (const bf16 *)x + r0 * x_rs;
                for (int64_t j = 0; j < k; j++)
                    for (int64_t i = 0; i < r; i++) dst[j * r + i] = widen_bf16(from[i * x_rs + j]);
            } else {
                const float *from = (const float *)x + r0 * x_rs;
                for (int64_t j = 0; j < k; j++)
                    for (int64_t i = 0; i < r; i++) dst[j * r + i] = from[i * x_rs + j];
            }
        }
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t p = item / strips, c = (item % strips) * cols;
        const char *next = item + 1 < items ? at + (((item + 1) / strips) * k * PANEL +
                                                    ((item + 1) % strips) * cols) * w.elem
                                            : 0;
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            const int64_t r0 = part_start(rb, rows, row_blocks);
            const int64_t r = part_start(rb + 1, rows, row_blocks) - r0;
            const int64_t from = rb > 0 ? (rb - 1) * share : 0;
            const int64_t to = next && rb > 0 ? (from + share < k ? from + share : k) : 0;
            w.passes[r][cols / 16](xp + r0 * k, at + (p * k * PANEL + c) * w.elem, k, kb,
                                   bias ? bias + p * PANEL + c : 0,
                                   (char *)out + (r0 * n + p * PANEL + c) * out_elem, n, bf16_io,
                                   rb == 0, next, from, to);
        }
    }
}

static int32_t panels_f32(const void *x, int64_t rows, int64_t k, int64_t x_rs, Panels w,
                          int64_t n, int64_t kb, const float *bias, void *out, int bf16_io) {
    /* chunks of at most ``most`` rows, spread evenly: a decode step's rows are one */
    const int64_t fit = CHUNK_BYTES / (k * (int64_t)sizeof(float));
    const int64_t most = fit > ROW_BLOCK ? fit : ROW_BLOCK;
    const int64_t chunks = (rows + most - 1) / most;
    const int copied = rows > 1 || bf16_io, elem = bf16_io ? sizeof(bf16) : sizeof(float);
    float *const copy =
        copied ? malloc((size_t)(part_start(1, rows, chunks) * k) * sizeof(float)) : 0;
    if (copied && !copy) return 1; /* the op answers */
#pragma omp parallel num_threads(omp_get_max_threads())
    for (int64_t c = 0; c < chunks; c++) { /* the barriers of chunk_f32's loops keep them apart */
        const int64_t c0 = part_start(c, rows, chunks);
        const int64_t c_rows = part_start(c + 1, rows, chunks) - c0;
        chunk_f32((const char *)x + c0 * x_rs * elem, c_rows, k, x_rs, w, n, kb, bias,
                  (char *)out + c0 * n * elem, bf16_io, c_rows > 1 || bf16_io ? copy : 0);
    }
    free(copy);
    return 0;
}

/* bf16 rows times bf16 panels of ours, [n / 64][k][64] (n a multiple of 64), into bf16 out
 * [rows, n]: a bf16 model's linear on a CPU without bf16 matmuls (fast_linear.py's widened
 * weights), its weights held at half float32's size and read at half its bandwidth. Rows and
 * weights are widened exactly, summed in float32 in the order of the float32 panels with k
 * blocks of BF16_KB (oneDNN's on the AVX2 EPYC), the bias (float32, or NULL) added and the
 * sum rounded to bf16 once: what the float32 op gives from the widened rows and weights there,
 * rounded as torch rounds. 0 when done, 1 when there was no memory for the copy of the rows. */
#define BF16_KB 1024
int32_t onednn_bf16_panels(const uint16_t *x, int64_t rows, int64_t k, int64_t x_rs,
                           const uint16_t *w, int64_t n, const float *bias, uint16_t *out) {
    if (rows < 1 || n % PANEL) return -1;
    const Panels panels = {w, sizeof(bf16), passes_bf16};
    return panels_f32(x, rows, k, x_rs, panels, n, BF16_KB, bias, out, 1);
}

/* onednn_bf16_panels with onednn_linear's signature, for the native layer loop (zen_layers.c):
 * ``w`` the panels' data, ``bias`` float32 or NULL; ``dtype`` is bf16's (the loop's step). */
int32_t onednn_bf16_panels_linear(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out,
                                  int64_t n, int32_t dtype, void *w, void *bias) {
    if (dtype != codes[1]) return -1;
    return onednn_bf16_panels(x, rows, k, x_rs, w, n, bias, out);
}
#endif

/* The op: out [rows, n] = x [rows, k] (row stride x_rs) times the packed weight, plus bias */
static int32_t call_op(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out, int64_t n,
                       int32_t dtype, const Weight *weight, void *bias) {
    int64_t elem = 0;
    for (int i = 0; i < 2; i++)
        if (codes[i] == dtype) elem = sizes_of[i];
    if (!elem) return -1;
    const int64_t sizes[2] = {rows, k}, strides[2] = {x_rs, 1};
    const int64_t b_sizes[1] = {n}, b_strides[1] = {1};
    void *hx = 0, *hb = 0, *ret = 0, *data = 0;
    const char *algorithm = "";
    int32_t err = blob(x, 2, sizes, strides, 0, dtype, cpu, 0, &hx);
    if (!err && bias) err = blob(bias, 1, b_sizes, b_strides, 0, dtype, cpu, 0, &hb);
    if (!err) err = pointwise(hx, weight->handle, bias ? &hb : 0, "none", 0, 0, &algorithm, &ret);
    if (!err) err = data_of(ret, &data);
    if (!err) memcpy(out, data, (size_t)(rows * n * elem));
    if (ret) drop(ret);
    if (hb) drop(hb);
    if (hx) drop(hx);
    return err;
}

#if defined(PANELS_F32)
/* This file's own product of the rows into ``out``, ``how`` as own_rows found it; 0 when
 * done, else it could not (no memory for its copy of the rows) and the op must answer */
typedef int32_t (*own_fn)(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out, int64_t n,
                       const Weight *w, void *bias, int16_t how);

/* The rows by ``run`` where the first call at this row count found a way (``ways``, tried in
 * order) that gives the op's bits; on that first call the op answers, and each way is run
 * beside it and compared. 0 when answered, 1 when the op must run, else the op's error. */
static int32_t own_rows(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out, int64_t n,
                        int32_t dtype, size_t elem, Weight *weight, void *bias, own_fn run,
                        const int16_t *ways, int n_ways) {
    int16_t *found = weight->found + (rows <= F32_ROWS ? rows : F32_SLOTS - 1);
    if (*found < 0) return 1;
    if (*found > 0) return run(x, rows, k, x_rs, out, n, weight, bias, *found) ? 1 : 0;
    const int32_t err = call_op(x, rows, k, x_rs, out, n, dtype, weight, bias);
    if (err) return err;
    void *mine = malloc((size_t)(rows * n) * elem);
    *found = -1;
    for (int i = 0; mine && i < n_ways && *found < 0; i++) {
        if (run(x, rows, k, x_rs, mine, n, weight, bias, ways[i])) {
            *found = 0; /* unanswered: asked again on a later call */
            break;
        }
        if (!memcmp(mine, out, (size_t)(rows * n) * elem)) *found = ways[i];
    }
    free(mine);
    return 0;
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
static int32_t tiles_run(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out, int64_t n,
                         const Weight *w, void *bias, int16_t how) {
    (void)how;
    tile_rows(x, rows, k, x_rs, n, w, bias, out);
    return 0;
}
static const int16_t TILE_WAYS[1] = {1};
#endif

#if defined(PANELS_F32)
static int32_t panels_run(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out, int64_t n,
                          const Weight *w, void *bias, int16_t k_block) {
#if defined(__AVX512F__)
    return panels_f32(x, rows, k, x_rs, w->blocked, n, k_block, bias, out);
#else
    const Panels panels = {w->blocked, sizeof(float), passes_float};
    return panels_f32(x, rows, k, x_rs, panels, n, k_block, bias, out, 0);
#endif
}
/* oneDNN's k blocks: on an Intel Xeon with AMX 512, or 1,024 from 2 rows where k > 1,024; on
 * an AVX2-only EPYC 1,024. A whole k in one sum last (32,767: past any k a weight here has). */
static const int16_t K_BLOCKS[3] = {512, 1024, 32767};
#endif

/* ``found``'s length in this build (onednn_calls.py's ``Weight`` must agree) */
int64_t onednn_found_slots(void) { return F32_SLOTS; }

/* The most rows this file multiplies itself in ``dtype`` (where the weight's layout allows); 0:
 * none in this build or on this CPU */
int64_t onednn_own_rows(int32_t dtype) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (dtype == codes[1] && tiles_granted()) return ROWS;
#endif
#if defined(PANELS_F32)
    if (dtype == codes[0]) return F32_MOST;
#endif
    (void)dtype;
    return 0;
}

/* out [rows, n] = x [rows, k] (row stride x_rs) times the packed weight ``w`` (a ``Weight``),
 * plus bias [n] (a plain vector, or NULL). 0 on success, else the first error. */
int32_t onednn_linear(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out, int64_t n,
                      int32_t dtype, void *w, void *bias) {
    Weight *weight = (Weight *)w;
    int32_t done = 1;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx && weight->blocked && dtype == codes[1] && rows >= 1 && rows <= ROWS && k <= MAX_K)
        done = own_rows(x, rows, k, x_rs, out, n, dtype, sizes_of[1], weight, bias, tiles_run,
                        TILE_WAYS, sizeof TILE_WAYS / sizeof *TILE_WAYS);
#endif
#if defined(PANELS_F32)
    if (weight->blocked && dtype == codes[0] && rows >= 1 && rows <= F32_MOST)
        done = own_rows(x, rows, k, x_rs, out, n, dtype, sizes_of[0], weight, bias, panels_run,
                        K_BLOCKS, sizeof K_BLOCKS / sizeof *K_BLOCKS);
#endif
    if (done != 1) return done;
    return call_op(x, rows, k, x_rs, out, n, dtype, weight, bias);
}
