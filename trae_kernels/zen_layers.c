/* A bf16 decoder's layer stack in one call: the flat forward's per-layer kernels (zentorch's
 * linears and norms, our rotation, K/V store, paged attention and SiLU-and-multiply), in the
 * flat forward's order, on the same buffers, from C instead of Python.
 *
 * Why: a SmolLM2 decode step calls ~300 kernels, and each call from Python costs 6-10 us of
 * wrapper, ctypes and tensor allocation besides the glue between them: ~3 ms of a 21 ms
 * batch-1 step and of a 44 ms batch-32 step were Python (bf16, Zen 4, docs/performance.md).
 * The kernels and their arguments are the ones the Python loop passes, so the results are
 * the same bits (tests/test_native_layers.py compares them).
 *
 * Built and loaded by trae_kernels/zen_layers.py; every kernel is bound at run time by address
 * from the libraries trae_kernels/zen_calls.py and cpu_native.py already loaded. Rows that do
 * not attend (the copy row of a padded one-row step) get the attending row's output.
 */
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

typedef int32_t (*linear_fn)(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out,
                             int64_t n, int32_t dtype, void *weight, void *bias);
typedef int32_t (*add_norm_fn)(void *hidden, void *residual, int64_t rows, int64_t dim,
                               int32_t dtype, void *weight, double eps);
typedef int32_t (*norm_fn)(void *x, void *out, int64_t rows, int64_t dim, int32_t dtype,
                           int64_t size, void *weight, double eps);
typedef void (*rotate_fn)(const bf16 *x, int64_t tokens, int64_t x_rs, int64_t heads,
                          int64_t dim, const bf16 *cos, const bf16 *ssin, int64_t cs_rs,
                          bf16 *out, int threads);
typedef void (*store_fn)(const bf16 *key, const bf16 *value, int64_t rows, int64_t key_rs,
                         int64_t value_rs, bf16 *k_cache, bf16 *v_cache, int64_t page_s,
                         int64_t tok_s, int64_t head_s, int64_t page_size, int64_t kv_heads,
                         int64_t dim, const int64_t *slots, int nthreads);
typedef void (*attend_fn)(const bf16 *query, int64_t q_rs, const bf16 *k_cache,
                          const bf16 *v_cache, int64_t page_s, int64_t tok_s, int64_t head_s,
                          int64_t page_size, const int64_t *tables, int64_t tab_s,
                          const int64_t *row_seq, const int64_t *row_pos, int64_t rows,
                          int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                          int64_t window, bf16 *out, int64_t out_rs, int nthreads);
typedef void (*silu_fn)(const bf16 *gu, int64_t rows, int64_t gu_rs, int64_t n, bf16 *out,
                        int64_t out_rs, int threads);
typedef void (*mul_fn)(bf16 *x, int64_t rows, const bf16 *w, int64_t width);

static linear_fn linear;
static add_norm_fn add_norm;
static norm_fn norm;
static rotate_fn rotate;
static store_fn store;
static attend_fn attend;
static silu_fn silu_mul;
static mul_fn mul_rows;

void layers_bind(void *linear_f, void *add_norm_f, void *norm_f, void *rotate_f,
                 void *store_f, void *attend_f, void *silu_f, void *mul_f) {
    linear = (linear_fn)linear_f;
    add_norm = (add_norm_fn)add_norm_f;
    norm = (norm_fn)norm_f;
    rotate = (rotate_fn)rotate_f;
    store = (store_fn)store_f;
    attend = (attend_fn)attend_f;
    silu_mul = (silu_fn)silu_f;
    mul_rows = (mul_fn)mul_f;
}

/* One step's shapes and buffers (trae_kernels/zen_layers.py's ``Step`` mirrors it). */
typedef struct {
    int64_t rows, attn_rows; /* rows of the step; rows that store K/V and attend */
    int64_t hidden, heads, kv_heads, dim, inter;
    int64_t head_norms;      /* Qwen3: RMSNorm over each q and k head before rotary */
    int64_t dtype, threads;
    double eps;
    double scale;
    void *x0;                /* the first layer's input (the embedding's norm) */
    void *out;               /* [rows, hidden]: each sublayer's output, then its norm */
    void *residual;          /* [rows, hidden] */
    void *qkv, *normed, *rotated, *attn, *gate_up, *act; /* scratch */
    void *cos, *ssin;
    int64_t cs_rs;
    void *slots, *tables;
    int64_t tab_s;
    void *row_seq, *row_pos;
    int64_t page_s, tok_s, head_s, page_size;
} Step;

/* One layer's weights and caches (``Layer`` in zen_layers.py). Biases may be NULL. */
typedef struct {
    void *in_norm, *post_norm;
    void *qkv_w, *qkv_b, *o_w, *o_b, *gate_up_w, *gate_up_b, *down_w, *down_b;
    void *k_cache, *v_cache;
    void *head_w, *head_ones; /* Qwen3: q's and k's norm weights side by side; ones */
    int64_t window;           /* 0: none */
} Layer;

/* Qwen3's head norms as flat_forward._head_norms runs them: the q and k heads copied packed,
 * normalized without weight, then multiplied by their weights (rounded once more). */
static int32_t head_norms(const Step *s, const Layer *l) {
    const int64_t heads = s->heads + s->kv_heads, n_qkv = (heads + s->kv_heads) * s->dim;
    const int64_t width = heads * s->dim;
    bf16 *packed = (bf16 *)s->rotated, *normed = (bf16 *)s->normed;
    for (int64_t r = 0; r < s->rows; r++)
        memcpy(packed + r * width, (bf16 *)s->qkv + r * n_qkv, (size_t)width * sizeof(bf16));
    int32_t err = norm(packed, normed, s->rows * heads, s->dim, (int32_t)s->dtype,
                       sizeof(bf16), l->head_ones, s->eps);
    if (err) return err;
    mul_rows(normed, s->rows, (const bf16 *)l->head_w, width);
    return 0;
}

static int32_t attention(const Step *s, const Layer *l) {
    const int64_t qk_heads = s->heads + s->kv_heads, d = s->dim;
    const int64_t n_qkv = (qk_heads + s->kv_heads) * d, qk_rs = qk_heads * d;
    const int th = (int)s->threads;
    const bf16 *qk = (const bf16 *)s->qkv;
    int64_t qk_in_rs = n_qkv;
    if (s->head_norms) {
        int32_t err = head_norms(s, l);
        if (err) return err;
        qk = (const bf16 *)s->normed;
        qk_in_rs = qk_rs;
    }
    bf16 *rot = (bf16 *)s->rotated; /* [rows, heads + kv_heads, dim]: q's heads, then k's */
    rotate(qk, s->rows, qk_in_rs, qk_heads, d, (const bf16 *)s->cos, (const bf16 *)s->ssin,
           s->cs_rs, rot, th);
    const bf16 *value = (const bf16 *)s->qkv + qk_heads * d;
    store(rot + s->heads * d, value, s->attn_rows, qk_rs, n_qkv, (bf16 *)l->k_cache,
          (bf16 *)l->v_cache, s->page_s, s->tok_s, s->head_s, s->page_size, s->kv_heads, d,
          (const int64_t *)s->slots, th);
    const int64_t q_size = s->heads * d;
    bf16 *out = (bf16 *)s->attn;
    attend(rot, qk_rs, (const bf16 *)l->k_cache, (const bf16 *)l->v_cache, s->page_s,
           s->tok_s, s->head_s, s->page_size, (const int64_t *)s->tables, s->tab_s,
           (const int64_t *)s->row_seq, (const int64_t *)s->row_pos, s->attn_rows, s->heads,
           s->kv_heads, d, (float)s->scale, l->window, out, q_size, th);
    for (int64_t r = s->attn_rows; r < s->rows; r++) /* copy rows: the attending row's output */
        memcpy(out + r * q_size, out, (size_t)q_size * sizeof(bf16));
    return 0;
}

/* Every layer of ``layers`` over the step; the last layer's MLP output is left in ``out`` and
 * the residual stream in ``residual``, as the Python loop leaves ``hidden`` and ``residual``.
 * 0 on success, else the first kernel error (the step's buffers are then partly written). */
int32_t decoder_layers_bf16(const Step *s, const Layer *layers, int64_t n_layers) {
    const int32_t dt = (int32_t)s->dtype;
    const int64_t t = s->rows, h = s->hidden, q_size = s->heads * s->dim;
    const int64_t n_qkv = (s->heads + 2 * s->kv_heads) * s->dim;
    int32_t err = 0;
    for (int64_t i = 0; i < n_layers && !err; i++) {
        const Layer *l = layers + i;
        void *x = s->x0;
        if (i) {
            err = add_norm(s->out, s->residual, t, h, dt, l->in_norm, s->eps);
            x = s->out;
        }
        if (!err) err = linear(x, t, h, h, s->qkv, n_qkv, dt, l->qkv_w, l->qkv_b);
        if (!err) err = attention(s, l);
        if (!err) err = linear(s->attn, t, q_size, q_size, s->out, h, dt, l->o_w, l->o_b);
        if (!err) err = add_norm(s->out, s->residual, t, h, dt, l->post_norm, s->eps);
        if (!err)
            err = linear(s->out, t, h, h, s->gate_up, 2 * s->inter, dt, l->gate_up_w,
                         l->gate_up_b);
        if (!err)
            silu_mul((const bf16 *)s->gate_up, t, 2 * s->inter, s->inter, (bf16 *)s->act,
                     s->inter, (int)s->threads);
        if (!err)
            err = linear(s->act, t, s->inter, s->inter, s->out, h, dt, l->down_w, l->down_b);
    }
    return err;
}
