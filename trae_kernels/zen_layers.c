/* A bf16 or float32 decoder's layer stack in one call: the flat forward's per-layer kernels
 * (zentorch's or oneDNN's linears, zentorch's add-and-norm, our head norms, rotation, K/V
 * store, paged attention and SiLU-and-multiply), in the flat forward's order, on the same
 * buffers, from C instead of Python.
 *
 * Why: a SmolLM2 decode step calls ~300 kernels, and each call from Python costs 6-10 us of
 * wrapper, ctypes and tensor allocation besides the glue between them: ~3 ms of a 21 ms
 * batch-1 step and of a 44 ms batch-32 step were Python (bf16, Zen 4, docs/performance.md).
 * The kernels and their arguments are the ones the Python loop passes, so the results are
 * the same bits (tests/test_native_layers.py compares them).
 *
 * Built and loaded by trae_kernels/zen_layers.py; every kernel is bound at run time by address
 * from the libraries trae_kernels/zen_calls.py, onednn_calls.py and cpu_native.py already loaded. Rows that do
 * not attend (the copy row of a padded one-row step) get the attending row's output.
 */
#include <stdint.h>
#include <string.h>

/* The pointwise and paged kernels of one element type (cpu_paged.c's _bf16 or _f32 set); their
 * element pointers are typed there, void here. */
typedef int32_t (*linear_fn)(void *x, int64_t rows, int64_t k, int64_t x_rs, void *out,
                             int64_t n, int32_t dtype, void *weight, void *bias);
typedef int32_t (*add_norm_fn)(void *hidden, void *residual, int64_t rows, int64_t dim,
                               int32_t dtype, void *weight, double eps);
typedef void (*rotate_fn)(const void *x, int64_t tokens, int64_t x_rs, int64_t heads,
                          int64_t dim, const void *cos, const void *ssin, int64_t cs_rs,
                          void *out, int threads);
typedef void (*store_fn)(const void *key, const void *value, int64_t rows, int64_t key_rs,
                         int64_t value_rs, void *k_cache, void *v_cache, int64_t page_s,
                         int64_t tok_s, int64_t head_s, int64_t page_size, int64_t kv_heads,
                         int64_t dim, const int64_t *slots, int nthreads);
typedef void (*attend_fn)(const void *query, int64_t q_rs, const void *k_cache,
                          const void *v_cache, int64_t page_s, int64_t tok_s, int64_t head_s,
                          int64_t page_size, const int64_t *tables, int64_t tab_s,
                          const int64_t *row_seq, const int64_t *row_pos, int64_t rows,
                          int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                          int64_t window, void *out, int64_t out_rs, int nthreads);
typedef void (*silu_fn)(const void *gu, int64_t rows, int64_t gu_rs, int64_t n, void *out,
                        int64_t out_rs, int threads);
typedef void (*head_norms_fn)(const void *x, int64_t tokens, int64_t x_rs, int64_t heads,
                              int64_t dim, const void *w, double eps, void *out, int threads);

typedef struct {
    rotate_fn rotate;
    store_fn store;
    attend_fn attend;
    silu_fn silu_mul;
    head_norms_fn head_norms;
} Kernels;

enum { KINDS = 2 }; /* Step.kind: 0 bf16, 1 float32 (zen_layers.py's KINDS) */
enum { LIBRARIES = 3 }; /* Step.library: zentorch, oneDNN, bf16 panels (zen_layers.py's) */

static linear_fn linears[LIBRARIES];
static add_norm_fn add_norm;
static Kernels kernels[KINDS];

/* zentorch's fused add-and-norm, which takes every dtype (a code per call) */
void layers_bind(void *add_norm_f) { add_norm = (add_norm_fn)add_norm_f; }

/* One library's linear: its weights are what that library's caller takes (zentorch's packed
 * data, a oneDNN weight's tensor handle, our bf16 panels' data); 0 on success */
int32_t layers_bind_linear(int64_t library, void *linear_f) {
    if (library < 0 || library >= LIBRARIES) return -1;
    linears[library] = (linear_fn)linear_f;
    return 0;
}

/* One element type's kernels; 0 on success */
int32_t layers_bind_kind(int64_t kind, void *rotate_f, void *store_f, void *attend_f,
                         void *silu_f, void *head_norms_f) {
    if (kind < 0 || kind >= KINDS) return -1;
    kernels[kind] = (Kernels){(rotate_fn)rotate_f, (store_fn)store_f, (attend_fn)attend_f,
                              (silu_fn)silu_f, (head_norms_fn)head_norms_f};
    return 0;
}

/* One step's shapes and buffers (trae_kernels/zen_layers.py's ``Step`` mirrors it). */
typedef struct {
    int64_t rows, attn_rows; /* rows of the step; rows that store K/V and attend */
    int64_t hidden, heads, kv_heads, dim, inter;
    int64_t head_norms;      /* Qwen3: RMSNorm over each q and k head before rotary */
    int64_t dtype, threads;  /* torch's shim code of the dtype; OpenMP threads */
    int64_t kind, elem;      /* ``kernels`` entry; bytes per element */
    int64_t library;         /* ``linears`` entry */
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
    void *head_w;             /* Qwen3: q's and k's norm weights side by side */
    int64_t window;           /* 0: none */
} Layer;

#define AT(p, i) ((char *)(p) + (i) * s->elem) /* element i of a buffer of the step's type */

/* Qwen3's head norms as flat_forward._head_norms runs them: every q and k head normalized and
 * weighted, from the fused q/k/v output into ``normed`` (packed). */
static void head_norms(const Step *s, const Layer *l, const Kernels *k) {
    const int64_t heads = s->heads + s->kv_heads, n_qkv = (heads + s->kv_heads) * s->dim;
    k->head_norms(s->qkv, s->rows, n_qkv, heads, s->dim, l->head_w, s->eps, s->normed,
                  (int)s->threads);
}

static int32_t attention(const Step *s, const Layer *l, const Kernels *k) {
    const int64_t qk_heads = s->heads + s->kv_heads, d = s->dim;
    const int64_t n_qkv = (qk_heads + s->kv_heads) * d, qk_rs = qk_heads * d;
    const int th = (int)s->threads;
    const void *qk = s->qkv;
    int64_t qk_in_rs = n_qkv;
    if (s->head_norms) {
        head_norms(s, l, k);
        qk = s->normed;
        qk_in_rs = qk_rs;
    }
    void *rot = s->rotated; /* [rows, heads + kv_heads, dim]: q's heads, then k's */
    k->rotate(qk, s->rows, qk_in_rs, qk_heads, d, s->cos, s->ssin, s->cs_rs, rot, th);
    k->store(AT(rot, s->heads * d), AT(s->qkv, qk_heads * d), s->attn_rows, qk_rs, n_qkv,
             l->k_cache, l->v_cache, s->page_s, s->tok_s, s->head_s, s->page_size, s->kv_heads,
             d, (const int64_t *)s->slots, th);
    const int64_t q_size = s->heads * d;
    k->attend(rot, qk_rs, l->k_cache, l->v_cache, s->page_s, s->tok_s, s->head_s, s->page_size,
              (const int64_t *)s->tables, s->tab_s, (const int64_t *)s->row_seq,
              (const int64_t *)s->row_pos, s->attn_rows, s->heads, s->kv_heads, d,
              (float)s->scale, l->window, s->attn, q_size, th);
    for (int64_t r = s->attn_rows; r < s->rows; r++) /* copy rows: the attending row's output */
        memcpy(AT(s->attn, r * q_size), s->attn, (size_t)(q_size * s->elem));
    return 0;
}

/* Every layer of ``layers`` over the step; the last layer's MLP output is left in ``out`` and
 * the residual stream in ``residual``, as the Python loop leaves ``hidden`` and ``residual``.
 * 0 on success, else the first kernel error (the step's buffers are then partly written). */
int32_t decoder_layers(const Step *s, const Layer *layers, int64_t n_layers) {
    if (s->kind < 0 || s->kind >= KINDS || !kernels[s->kind].rotate) return -1;
    if (s->library < 0 || s->library >= LIBRARIES || !linears[s->library]) return -1;
    const Kernels *k = kernels + s->kind;
    const linear_fn linear = linears[s->library];
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
        if (!err) err = attention(s, l, k);
        if (!err) err = linear(s->attn, t, q_size, q_size, s->out, h, dt, l->o_w, l->o_b);
        if (!err) err = add_norm(s->out, s->residual, t, h, dt, l->post_norm, s->eps);
        if (!err)
            err = linear(s->out, t, h, h, s->gate_up, 2 * s->inter, dt, l->gate_up_w,
                         l->gate_up_b);
        if (!err)
            k->silu_mul(s->gate_up, t, 2 * s->inter, s->inter, s->act, s->inter,
                        (int)s->threads);
        if (!err)
            err = linear(s->act, t, s->inter, s->inter, s->out, h, dt, l->down_w, l->down_b);
    }
    return err;
}
