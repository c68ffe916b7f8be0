#include "common.h"

/* ---------------------------------------------------------------------------------------------
   A whole decode step of a Llama/Qwen2/Qwen3 decoder in one call: few rows, one token each.
   In torch a batch-1 step is ~300 small ops whose dispatch costs more than their arithmetic;
   here it is the weight reads plus a few microseconds per layer. A decode step holds no prompt
   rows, so its packed layers round their inputs as their format says (exact_inputs = 0).
   ------------------------------------------------------------------------------------------ */

typedef struct {
    Linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm; /* Qwen3's per-head norms, or NULL */
    void *k_cache, *v_cache;      /* [num_blocks, block_size, kv_heads, head_dim] */
} DecoderLayer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const float *rope; /* [max_position, 2, head_dim], as rotary_f32 reads it */
    const float *final_norm;
    const DecoderLayer *layers;
    int64_t cache_half; /* the caches hold float16 */
} Decoder;

/* hidden [n, hidden]: the tokens' embeddings in, the final normed hidden states out. Token i
   is at positions[i], its K/V go to slots[i], and it attends to context_lens[i] positions
   through block_tables[i] (row width `width`). Returns nonzero if out of memory. */
int decode_step_f32(const Decoder *m, float *hidden, int64_t n, const int64_t *positions,
                    const int64_t *slots, const int64_t *block_tables, int64_t width,
                    const int64_t *context_lens, int threads) {
    const int64_t h = m->hidden, hd = m->head_dim, q_size = m->heads * hd;
    const int64_t kv_size = m->kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    const int64_t inter = m->intermediate;
    const int64_t floats = n * (2 * h + qkv_size + q_size + 3 * inter);
    float *residual = malloc(sizeof(float) * (size_t)floats);
    if (residual == NULL) return 1;
    float *normed = residual + n * h, *qkv = normed + n * h, *attn = qkv + n * qkv_size;
    float *gate_up = attn + n * q_size, *act = gate_up + n * 2 * inter;
    int failed = 0;
    for (int64_t l = 0; l < m->num_layers && !failed; l++) {
        const DecoderLayer *layer = m->layers + l;
        if (l == 0) {
            memcpy(residual, hidden, sizeof(float) * (size_t)(n * h));
            rms_norm_f32(hidden, h, NULL, 0, layer->input_norm, n, 1, h, m->eps, normed, h, threads);
        } else {
            rms_norm_f32(hidden, h, residual, h, layer->input_norm, n, 1, h, m->eps, normed, h, threads);
        }
        failed |= linear_f32(&layer->qkv, normed, h, n, qkv, qkv_size, 0, threads);
        if (layer->q_norm != NULL) {
            rms_norm_f32(qkv, qkv_size, NULL, 0, layer->q_norm, n * m->heads, m->heads, hd, m->eps,
                         qkv, qkv_size, threads);
            rms_norm_f32(qkv + q_size, qkv_size, NULL, 0, layer->k_norm, n * m->kv_heads,
                         m->kv_heads, hd, m->eps, qkv + q_size, qkv_size, threads);
        }
        rotary_f32(qkv, qkv_size, n, m->heads + m->kv_heads, hd, m->rope, positions, threads);
        store_kv_f32(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, slots, n, kv_size,
                     layer->k_cache, layer->v_cache, (int)m->cache_half);
        failed |= paged_decode_f32(qkv, qkv_size, layer->k_cache, layer->v_cache, block_tables,
                                   context_lens, n, width, m->heads, m->kv_heads, hd,
                                   m->block_size, m->scale, attn, q_size, (int)m->cache_half,
                                   threads);
        failed |= linear_f32(&layer->o, attn, q_size, n, hidden, h, 0, threads);
        rms_norm_f32(hidden, h, residual, h, layer->post_norm, n, 1, h, m->eps, normed, h, threads);
        failed |= linear_f32(&layer->gate_up, normed, h, n, gate_up, 2 * inter, 0, threads);
        silu_mul_f32(gate_up, n, inter, act, threads);
        failed |= linear_f32(&layer->down, act, inter, n, hidden, h, 0, threads);
    }
    rms_norm_f32(hidden, h, residual, h, m->final_norm, n, 1, h, m->eps, hidden, h, threads);
    free(residual);
    return failed;
}

