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
 * allocation and copy), 121 calls a SmolLM2 step, while the other thread waits. Where
 * onednn_calls.py found oneDNN's packed weight laid out as [n / 32][k / 2][32][2] (pairs of
 * k for 32 columns, what its AMX kernels read), these rows are multiplied here on tiles from
 * that buffer, k in the same order, for the same bits.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <omp.h>

#include "cpu_tiles.h"
#include "cpu_vec.h"
#endif

/* A packed weight as the layer loop holds it: torch's handle, and its buffer where its layout
 * is the one the tile path reads (else NULL) */
typedef struct {
    void *handle;
    const uint16_t *pairs;
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
#pragma omp parallel num_threads(omp_get_max_threads())
    {
        configure_tiles();
        float sums[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const bf16 *cols = w->pairs + b * (k / 2) * 64;
            _tile_zero(0);
            _tile_zero(1);
            if (two) {
                _tile_zero(5);
                _tile_zero(6);
            }
            for (int64_t j = 0; j < k; j += 32) {
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

/* 1 where decode rows may take the tile path (the CPU has AMX and the OS grants its state) */
int32_t onednn_tiles(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (!amx) amx = request_tiles();
    return amx;
#else
    return 0;
#endif
}

/* out [rows, n] = x [rows, k] (row stride x_rs) times the packed weight ``w`` (a ``Weight``),
 * plus bias [n] (a plain vector, or NULL). 0 on success, else the first error. */
int32_t onednn_linear(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out, int64_t n,
                      int32_t dtype, void *w, void *bias) {
    const Weight *weight = (const Weight *)w;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx && weight->pairs && dtype == codes[1] && rows <= ROWS && k <= MAX_K) {
        tile_rows(x, rows, k, x_rs, n, weight, bias, out);
        return 0;
    }
#endif
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
