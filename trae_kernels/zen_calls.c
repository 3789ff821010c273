/* zentorch's linear, norm and fused add-and-norm, called through its C shims (the functions
 * AOTInductor's generated code calls) instead of torch's dispatcher.
 *
 * Why: zentorch 2.13 registers its ops through torch 2.13's stable ABI, whose conversion of a
 * string argument keeps a heap copy that is never freed (pytorch/pytorch#190493, fixed after
 * 2.13): ~140 bytes a linear call and ~90 a norm through the dispatcher, ~23 kB a SmolLM2
 * decode step (docs/memory.md). The shims take plain C strings, so nothing is converted.
 * Each call wraps the caller's buffers (input, output, weights) as tensor handles that own
 * nothing (torch's C shim, no copy), calls zentorch's op and drops the handles: no handle
 * outlives a call, so no weight is kept alive by one.
 *
 * Built and loaded by trae_kernels/zen_calls.py like cpu_paged.c (no torch headers: the few C
 * functions it calls are bound at run time, by address, from the libraries torch and zentorch
 * already loaded).
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef int32_t (*blob_fn)(void *data, int64_t ndim, const int64_t *sizes,
                           const int64_t *strides, int64_t offset, int32_t dtype,
                           int32_t device_type, int32_t device_index, void **ret);
typedef int32_t (*delete_fn)(void *handle);
typedef int32_t (*linear_out_fn)(void *out, void *x, void *w, void **bias, bool prepacked,
                                 const char *post_op, const char *name);
typedef int32_t (*add_norm_fn)(void *input, void *weight, void *residual, double eps,
                               const char *name);
typedef int32_t (*norm_fn)(void *input, void *weight, double eps, const char *name, void **ret);
typedef int32_t (*data_fn)(void *handle, void **data);

static blob_fn blob;
static delete_fn drop;
static linear_out_fn linear_out;
static add_norm_fn add_norm;
static norm_fn norm;
static data_fn data_of;
static int32_t cpu;

void zen_bind(void *blob_f, void *drop_f, void *data_f, void *linear_f, void *add_norm_f,
              void *norm_f, int32_t cpu_type) {
    blob = (blob_fn)blob_f;
    drop = (delete_fn)drop_f;
    data_of = (data_fn)data_f;
    linear_out = (linear_out_fn)linear_f;
    add_norm = (add_norm_fn)add_norm_f;
    norm = (norm_fn)norm_f;
    cpu = cpu_type;
}

/* A [rows, cols] matrix of row stride ``rs`` (a vector when rows is 0) as a tensor handle. */
static int32_t view(void *data, int64_t rows, int64_t cols, int64_t rs, int32_t dtype,
                    void **handle) {
    const int64_t sizes[2] = {rows, cols}, strides[2] = {rs, 1};
    if (rows == 0) return blob(data, 1, sizes + 1, strides + 1, 0, dtype, cpu, 0, handle);
    return blob(data, 2, sizes, strides, 0, dtype, cpu, 0, handle);
}

/* out [rows, n] = x [rows, k] (row stride x_rs) times the prepacked weight [n, k], plus bias
 * [n] (or NULL). 0 on success, else the first error. */
int32_t zen_linear(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out, int64_t n,
                   int32_t dtype, void *weight, void *bias) {
    void *h[4] = {0, 0, 0, 0}; /* x, out, weight, bias */
    int32_t err = view(x, rows, k, x_rs, dtype, &h[0]);
    if (!err) err = view(out, rows, n, n, dtype, &h[1]);
    if (!err) err = view(weight, n, k, k, dtype, &h[2]);
    if (!err && bias) err = view(bias, 0, n, 1, dtype, &h[3]);
    if (!err) err = linear_out(h[1], h[0], h[2], bias ? &h[3] : 0, true, "none", "z");
    for (int i = 0; i < 4; i++)
        if (h[i]) drop(h[i]);
    return err;
}

/* residual += hidden, then hidden = rms_norm(residual) * weight: [rows, dim] each, packed. */
int32_t zen_add_rms_norm(void *hidden, void *residual, int64_t rows, int64_t dim,
                         int32_t dtype, void *weight, double eps) {
    void *h[3] = {0, 0, 0}; /* hidden, residual, weight */
    int32_t err = view(hidden, rows, dim, dim, dtype, &h[0]);
    if (!err) err = view(residual, rows, dim, dim, dtype, &h[1]);
    if (!err) err = view(weight, 0, dim, 1, dtype, &h[2]);
    if (!err) err = add_norm(h[0], h[2], h[1], eps, "z");
    for (int i = 0; i < 3; i++)
        if (h[i]) drop(h[i]);
    return err;
}

/* out = rms_norm(x) * weight, [rows, dim] each, packed. zentorch's norm has no out-variant:
 * its result is copied into ``out`` (element size ``size``) and dropped. */
int32_t zen_rms_norm(void *x, void *out, int64_t rows, int64_t dim, int32_t dtype,
                     int64_t size, void *weight, double eps) {
    void *h[3] = {0, 0, 0}; /* x, weight, result */
    void *result;
    int32_t err = view(x, rows, dim, dim, dtype, &h[0]);
    if (!err) err = view(weight, 0, dim, 1, dtype, &h[1]);
    if (!err) err = norm(h[0], h[1], eps, "z", &h[2]);
    if (!err) err = data_of(h[2], &result);
    if (!err) memcpy(out, result, (size_t)(rows * dim * size));
    for (int i = 0; i < 3; i++)
        if (h[i]) drop(h[i]);
    return err;
}
