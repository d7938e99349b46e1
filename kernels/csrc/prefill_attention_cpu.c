/* Causal attention of one sequence's prefill chunk over the paged KV cache, for the CPU (float32):
 *
 *     out[i, h] = sum_{j <= p_i} softmax_j(q[i, h] . k[j, g] * scale) v[j, g],   g = h / (H / Hkv)
 *
 * for the chunk's n queries at positions p_i = L - n + i of a context of L keys, key j read from
 * flat cache slot slots[j] (the chunk's own keys already written there). Flash-style: each work
 * item is one KV head's group of query heads and a block of BQ queries; it walks the key blocks of BK keys the block can
 * see, keeping each query's running maximum, sum and output (online softmax), so no score
 * matrix is ever held. A key block is transposed once into [D, BK] and then serves the group's
 * BQ queries of every head: a query's BK scores are D multiply-adds of whole vectors (its d-th value broadcast
 * against the block's d-th row), and its output takes BK multiply-adds of the values' rows.
 * torch's fused CPU kernel ran SmolLM2's 2,000-token prompts at about a third of the machine's
 * multiply-add rate; this keeps both operands of every multiply-add in L1.
 *
 * e^x by the vector polynomial of vector_exp.h. Heads of 64 or 128 floats with AVX-512; the caller
 * uses torch elsewhere. No -ffast-math: NaN propagates.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vector_exp.h"

#define BQ 32
#define BK 64

int loramux_prefill_attention_supported(int64_t dim) {
#if defined(__AVX512F__)
    return dim == 64 || dim == 128;
#else
    (void)dim;
    return 0;
#endif
}

#if defined(__AVX512F__)

/* One work item for heads of CHUNKS * 16 floats: the `group` query heads sharing KV head
 * `kv_head`, queries [first_query, first_query + BQ). Their rows are r = h * BQ + i. */
#define PREFILL_ITEM(CHUNKS)                                                                      \
    static void prefill_item_##CHUNKS(                                                            \
        const float *q, int64_t q_stride, int64_t n, int64_t group, int64_t kv_head,             \
        int64_t kv_heads, const float *k_cache, const float *v_cache, const int64_t *slots,      \
        int64_t context, float scale, float *out, int64_t out_stride, int64_t first_query,      \
        float *keys_t, float *running) {                                                          \
        const int64_t dim = CHUNKS * 16, rows = n - first_query < BQ ? n - first_query : BQ;     \
        const int64_t start = context - n; /* position of query 0 */                            \
        const int64_t width = group * BQ;                                                         \
        float *top = running, *total = running + width, *acc = running + 2 * width;              \
        for (int64_t r = 0; r < width; r++) {                                                     \
            top[r] = -INFINITY, total[r] = 0.0f;                                                 \
            for (int64_t d = 0; d < dim; d++) acc[r * dim + d] = 0.0f;                           \
        }                                                                                         \
        const int64_t last_key = start + first_query + rows; /* keys [0, last_key) seen */       \
        for (int64_t j0 = 0; j0 < last_key; j0 += BK) {                                           \
            const int64_t keys = last_key - j0 < BK ? last_key - j0 : BK;                       \
            /* the block's keys transposed: keys_t[d * BK + j] (padding keys zero) */             \
            for (int64_t j = 0; j < BK; j++) {                                                    \
                if (j >= keys) {                                                                  \
                    for (int64_t d = 0; d < dim; d++) keys_t[d * BK + j] = 0.0f;                 \
                    continue;                                                                     \
                }                                                                                 \
                const float *key = k_cache + (slots[j0 + j] * kv_heads + kv_head) * dim;         \
                for (int64_t d = 0; d < dim; d++) keys_t[d * BK + j] = key[d];                   \
            }                                                                                     \
            for (int64_t r = 0; r < group * rows; r++) {                                          \
                const int64_t h = r / rows, i = r % rows, row = h * BQ + i;                      \
                const int64_t position = start + first_query + i;                                 \
                if (position < j0) continue; /* this query sees none of the block */            \
                const float *qi = q + (first_query + i) * q_stride + (kv_head * group + h) * dim; \
                __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;                       \
                for (int64_t d = 0; d < dim; d++) {                                               \
                    const __m512 qd = _mm512_set1_ps(qi[d]);                                      \
                    const float *krow = keys_t + d * BK;                                          \
                    s0 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(krow), s0);                          \
                    s1 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(krow + 16), s1);                     \
                    s2 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(krow + 32), s2);                     \
                    s3 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(krow + 48), s3);                     \
                }                                                                                 \
                __m512 s[4] = {s0, s1, s2, s3};                                                   \
                const int64_t visible = position - j0 + 1 < keys ? position - j0 + 1 : keys;     \
                const __m512 scales = _mm512_set1_ps(scale);                                      \
                float block_top = -INFINITY;                                                      \
                for (int c = 0; c < 4; c++) {                                                     \
                    const int64_t left = visible - 16 * c;                                        \
                    const __mmask16 live = left >= 16 ? 0xFFFF                                    \
                                         : left <= 0 ? 0                                          \
                                                     : (__mmask16)((1u << left) - 1);             \
                    s[c] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live, s[c], scales);     \
                    if (live) {                                                                   \
                        const float m = _mm512_mask_reduce_max_ps(live, s[c]);                    \
                        block_top = m > block_top ? m : block_top;                                \
                    }                                                                             \
                }                                                                                 \
                const float new_top = block_top > top[row] ? block_top : top[row];               \
                const float keep = top[row] == -INFINITY ? 0.0f : expf(top[row] - new_top);      \
                const __m512 tops = _mm512_set1_ps(new_top);                                      \
                float block_total = 0.0f, weights[BK];                                            \
                for (int c = 0; c < 4; c++) {                                                     \
                    s[c] = exp16(_mm512_sub_ps(s[c], tops));                            \
                    block_total += _mm512_reduce_add_ps(s[c]);                                    \
                    _mm512_storeu_ps(weights + 16 * c, s[c]);                                     \
                }                                                                                 \
                total[row] = total[row] * keep + block_total;                                     \
                top[row] = new_top;                                                               \
                __m512 o[CHUNKS];                                                                 \
                const __m512 keeps = _mm512_set1_ps(keep);                                        \
                for (int c = 0; c < CHUNKS; c++)                                                  \
                    o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + row * dim + 16 * c), keeps);       \
                for (int64_t j = 0; j < visible; j++) {                                           \
                    const float *value = v_cache + (slots[j0 + j] * kv_heads + kv_head) * dim;   \
                    const __m512 w = _mm512_set1_ps(weights[j]);                                  \
                    for (int c = 0; c < CHUNKS; c++)                                              \
                        o[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 16 * c), o[c]);         \
                }                                                                                 \
                for (int c = 0; c < CHUNKS; c++)                                                  \
                    _mm512_storeu_ps(acc + row * dim + 16 * c, o[c]);                             \
            }                                                                                     \
        }                                                                                         \
        for (int64_t r = 0; r < group * rows; r++) {                                              \
            const int64_t h = r / rows, i = r % rows, row = h * BQ + i;                          \
            float *dst = out + (first_query + i) * out_stride + (kv_head * group + h) * dim;     \
            for (int64_t d = 0; d < dim; d++) dst[d] = acc[row * dim + d] / total[row];          \
        }                                                                                         \
    }
PREFILL_ITEM(4)
PREFILL_ITEM(8)
#endif

/* q [n, heads, dim] rows q_stride apart; out likewise. Returns 0; 1 when the head size is not
 * one this build takes, 2 when its buffers could not be allocated (nothing written then). */
int loramux_prefill_attention_f32(const float *q, int64_t q_stride, int64_t n, int64_t heads,
                                  int64_t kv_heads, int64_t dim, const float *k_cache,
                                  const float *v_cache, const int64_t *slots, int64_t context,
                                  float scale, float *out, int64_t out_stride) {
    if (!loramux_prefill_attention_supported(dim)) return 1;
#if defined(__AVX512F__)
    const int64_t blocks = (n + BQ - 1) / BQ, group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel
    {
        float *keys_t = aligned_alloc(64, sizeof(float) * dim * BK);
        float *running = aligned_alloc(64, sizeof(float) * group * BQ * (2 + dim));
        if (keys_t == NULL || running == NULL) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp barrier
        if (!failed) {
            /* the last query blocks see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < kv_heads * blocks; item++) {
                const int64_t block = blocks - 1 - item / kv_heads, kv_head = item % kv_heads;
                if (dim == 64)
                    prefill_item_4(q, q_stride, n, group, kv_head, kv_heads, k_cache, v_cache,
                                   slots, context, scale, out, out_stride, block * BQ, keys_t,
                                   running);
                else
                    prefill_item_8(q, q_stride, n, group, kv_head, kv_heads, k_cache, v_cache,
                                   slots, context, scale, out, out_stride, block * BQ, keys_t,
                                   running);
            }
        }
        free(keys_t);
        free(running);
    }
    return failed;
#else
    return 1;
#endif
}
