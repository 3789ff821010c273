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
 */
#include <stdint.h>
#include <string.h>

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

/* out [rows, n] = x [rows, k] (row stride x_rs) times the packed weight behind the handle
 * ``weight``, plus bias [n] (a plain vector, or NULL). 0 on success, else the first error. */
int32_t onednn_linear(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out, int64_t n,
                      int32_t dtype, void *weight, void *bias) {
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
    if (!err) err = pointwise(hx, weight, bias ? &hb : 0, "none", 0, 0, &algorithm, &ret);
    if (!err) err = data_of(ret, &data);
    if (!err) memcpy(out, data, (size_t)(rows * n * elem));
    if (ret) drop(ret);
    if (hb) drop(hb);
    if (hx) drop(hx);
    return err;
}
