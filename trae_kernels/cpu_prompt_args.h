/* The arguments every prompt-attention kernel takes (cpu_prompt.c's float32 and bf16 ones,
 * cpu_amx.c's), in the order cpu_prompt.py's ARGTYPES declares them: the queries (row stride
 * q_rs), the K and V pages (strides of a page, a token and a head, tokens a page), the block
 * tables, each chunk's table row, first output row, rows and context length, the heads, the
 * head size, the scale, the window (0: none), the output (row stride out_rs), the threads. */
#pragma once
#include <stdint.h>

#define PROMPT_ARGS(T)                                                                       \
    const T *query, int64_t q_rs, const T *k_cache, const T *v_cache, int64_t page_s,         \
        int64_t tok_s, int64_t head_s, int64_t page_size, const int64_t *tables, int64_t tab_s, \
        const int64_t *table_row, const int64_t *first_row, const int64_t *rows,             \
        const int64_t *ctx, int64_t chunks, int64_t heads, int64_t kv_heads, int64_t dim,    \
        float scale, int64_t window, T *out, int64_t out_rs, int nthreads
