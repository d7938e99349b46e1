/* The decoder layers of a decode-only step in one call, for the CPU (float32 activations).
 *
 * Each of T tokens is one sequence's new token: row t of x is its embedding, its position's RoPE
 * rows are cos[t], sin[t], its key and value go to flat cache slot slots[t], and it attends to
 * the lens[t] tokens its block table tables[t] maps (itself included). For every layer:
 *
 *     h = rmsnorm(x) * w_in                              (float32, as transformers' Llama)
 *     q, k, v = h @ Wq^T, h @ Wk^T, h @ Wv^T (+ biases);  q, k rotated (RoPE: x cos + rot(x) sin)
 *     cache[slots[t]] = k, v
 *     a = softmax(q . K^T * scale) V                      per head, over the sequence's keys
 *     x = x + a @ Wo^T
 *     h = rmsnorm(x) * w_post
 *     x = x + (silu(h @ Wg^T) * (h @ Wu^T)) @ Wd^T
 *
 * which is what engine/model/llama.py computes for such a step (its torch ops in another order
 * of summation). The projections are packed (quant_rows.h: int4, int8) or float32 rows (kind
 * 32). A step through torch makes about 20 op calls a layer, each a few microseconds of dispatch
 * around a few of arithmetic at batch 1; here a step is one call: one OpenMP parallel region
 * whose threads split each projection's output rows, and each attention's (token, head) pairs,
 * meeting at a barrier between the stages.
 *
 * At one token a packed row is de-quantized in registers as it is multiplied (dot_packed_row:
 * the same single rounding of scale * q + min as the definition's); with more, each row is de-quantized once into
 * the thread's buffer and multiplied by every token's input. No -ffast-math: NaN propagates.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_rows.h"
#include "vector_exp.h"

typedef struct {
    int64_t kind; /* 4, 8 (packed, quant_rows.h) or 32 (float32 rows) */
    int64_t group;
    int64_t n, k;           /* W is [n, k] */
    const void *q;          /* the packed values, or the float32 rows */
    const float *scales;    /* [n, k / group] (packed kinds) */
    const float *mins;      /* [n, k / group] (int4) */
    const float *bias;      /* [n] or NULL */
} loramux_weight;

/* The projections in the LoRA slices' order (loramux.engine.model.llama.LORA_TARGETS). */
enum { Q, K, V, O, GATE, UP, DOWN, MODULES };

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    loramux_weight q, k, v, o, gate, up, down;
    float *k_cache, *v_cache; /* [blocks, block_size, kv_heads, head_dim] */
    /* The adapter pool's rows of each module (engine/memory/arena.py): A [rows, in] and
     * B [rows, out], rows *_stride floats apart; NULL without a pool. */
    const float *lora_a[MODULES], *lora_b[MODULES];
    int64_t a_stride[MODULES], b_stride[MODULES];
} loramux_layer;

/* A step's adapters, one per token: its first pool row (-1: none) and, per module, its rank
 * and scaling (loramux.kernels.lora's definition: out += c * (x A^T) B). */
typedef struct {
    const int64_t *first_row; /* [T] */
    const int32_t *ranks;     /* [T, MODULES] */
    const float *scales;      /* [T, MODULES] */
    int64_t max_rank;
} loramux_step_lora;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, block_size;
    float eps, scale;
    const loramux_layer *layer;
} loramux_decoder;

/* Stores or (residual) adds a dot product and the row's bias into an output. */
static inline void put(float *out, float dot, float bias, int residual) {
    *out = residual ? *out + (dot + bias) : dot + bias;
}

/* Row n of W as floats: its float32 row, or de-quantized into `into` (k floats). */
static inline const float *row_of(const loramux_weight *w, int64_t n, float *into) {
    if (w->kind == 32) return (const float *)w->q + n * w->k;
    dequantize_row((int)w->kind, w->q, w->scales, w->mins, n, w->k, w->group, into);
    return into;
}

/* y[t * y_stride + n] (+)= x[t] . W[n] + bias[n] for rows [first, end) of W and T tokens;
 * residual: add to y instead of storing. buffer: k floats of the calling thread. (Four rows
 * against four tokens at a time, each load serving four sums, measured slower at batch 4 to 16:
 * their rows and inputs outgrow L1.) */
static void project_rows(const loramux_weight *w, int64_t first, int64_t end, const float *x,
                         int64_t x_stride, int64_t tokens, float *y, int64_t y_stride,
                         int residual, float *buffer) {
    const int64_t k = w->k;
    for (int64_t n = first; n < end; n++) {
        const float b = w->bias != NULL ? w->bias[n] : 0.0f;
        if (tokens == 1 && w->kind != 32) {
            const float dot = dot_packed_row((int)w->kind, w->q, w->scales, w->mins, n, k, w->group,
                                             x, buffer);
            put(y + n, dot, b, residual);
            continue;
        }
        const float *row = row_of(w, n, buffer);
        int64_t t = 0;
        for (; t + 4 <= tokens; t += 4) {
            float dots[4];
            dot4(x + t * x_stride, x_stride, row, k, dots);
            for (int i = 0; i < 4; i++) put(y + (t + i) * y_stride + n, dots[i], b, residual);
        }
        for (; t < tokens; t++) put(y + t * y_stride + n, dot1(x + t * x_stride, row, k), b, residual);
    }
}

/* A thread's share [first, end) of `count` items, split as evenly as the items allow. */
static void share_of(int64_t count, int64_t *first, int64_t *end) {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    *first = count * me / threads;
    *end = count * (me + 1) / threads;
}

/* Several weights of one input side by side (q, k, v; gate, up): each thread takes its share of
 * their output rows together, so none waits on a small one. outs[i] column offset offsets[i]. */
static void project_group(const loramux_weight *const *weights, int count, const float *x,
                          int64_t x_stride, int64_t tokens, float *y, int64_t y_stride,
                          const int64_t *offsets, float *buffer) {
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += weights[i]->n;
    int64_t first, end;
    share_of(total, &first, &end);
    int64_t base = 0;
    for (int i = 0; i < count; i++) {
        const int64_t lo = first > base ? first - base : 0;
        const int64_t hi = end - base < weights[i]->n ? end - base : weights[i]->n;
        if (lo < hi)
            project_rows(weights[i], lo, hi, x, x_stride, tokens, y + offsets[i], y_stride, 0,
                         buffer);
        base += weights[i]->n;
    }
}

/* LoRA's shrink for the modules `mods` of one input: h[t, i, j] = x[t] . A_mods[i][f_t + j] for
 * j below the token's rank there. Work items are (token, module, rank row); no barrier. */
static void lora_shrink(const loramux_layer *layer, const loramux_step_lora *lora, const int *mods,
                        int count, const float *x, int64_t x_stride, int64_t in_dim,
                        int64_t tokens, float *h) {
    const int64_t rank_width = lora->max_rank;
#pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < tokens * count * rank_width; item++) {
        const int64_t t = item / (count * rank_width), i = item / rank_width % count;
        const int64_t j = item % rank_width, mod = mods[i];
        if (lora->first_row[t] < 0 || j >= lora->ranks[t * MODULES + mod]) continue;
        const float *a_row = layer->lora_a[mod] + (lora->first_row[t] + j) * layer->a_stride[mod];
        const float *x_row = x + t * x_stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < in_dim; c++) dot += x_row[c] * a_row[c];
        h[(t * count + i) * rank_width + j] = dot;
    }
}

/* LoRA's expand, after the shrink's barrier: out_i[t] += c * (h[t, i] B_mods[i][f_t ...]) over
 * this thread's share of the modules' output columns (outputs y_i at column offsets[i]).
 * acc: the thread's buffer, at least the widest output's floats. */
static void lora_expand(const loramux_layer *layer, const loramux_step_lora *lora, const int *mods,
                        const int64_t *widths, int count, const float *h, int64_t tokens,
                        float *y, int64_t y_stride, const int64_t *offsets, float *acc) {
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += widths[i];
    int64_t first, end;
    share_of(total, &first, &end);
    const int64_t rank_width = lora->max_rank;
    for (int i = 0, base = 0; i < count; base += widths[i], i++) {
        const int64_t lo = first > base ? first - base : 0;
        const int64_t hi = end - base < widths[i] ? end - base : widths[i];
        const int mod = mods[i];
        for (int64_t t = 0; t < tokens && lo < hi; t++) {
            const int64_t rank = lora->first_row[t] < 0 ? 0 : lora->ranks[t * MODULES + mod];
            if (rank == 0) continue;
            for (int64_t c = lo; c < hi; c++) acc[c - lo] = 0.0f;
            for (int64_t j = 0; j < rank; j++) {
                const float hj = h[(t * count + i) * rank_width + j];
                const float *b_row = layer->lora_b[mod] + (lora->first_row[t] + j) * layer->b_stride[mod];
#pragma omp simd
                for (int64_t c = lo; c < hi; c++) acc[c - lo] += hj * b_row[c];
            }
            const float scale = lora->scales[t * MODULES + mod];
            float *out = y + t * y_stride + offsets[i];
#pragma omp simd
            for (int64_t c = lo; c < hi; c++) out[c] += scale * acc[c - lo];
        }
    }
}

/* out[t] = rmsnorm(x[t]) * weight, as transformers' LlamaRMSNorm in float32. */
static void rms_norm(const float *x, const float *weight, int64_t tokens, int64_t size, float eps,
                     float *out) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = x + t * size;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < size; i++) squares += row[i] * row[i];
        const float inverse = 1.0f / sqrtf(squares / (float)size + eps);
        for (int64_t i = 0; i < size; i++) out[t * size + i] = weight[i] * (row[i] * inverse);
    }
}

/* RoPE of one head in place: x * cos + rotate_half(x) * sin (cos, sin: head_dim floats). */
static void rotate(float *x, const float *cos, const float *sin, int64_t dim, float *scratch) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) scratch[i] = -x[i + half];
    for (int64_t i = half; i < dim; i++) scratch[i] = x[i - half];
    for (int64_t i = 0; i < dim; i++) {
        const float straight = x[i] * cos[i], turned = scratch[i] * sin[i];
        x[i] = straight + turned;
    }
}

/* A flat cache slot's first float for kv head `head`. */
static inline int64_t slot_offset(const loramux_decoder *m, int64_t slot, int64_t head) {
    return (slot * m->kv_heads + head) * m->head_dim;
}

/* One head of one token: softmax(q . K^T * scale) V over its sequence's `len` keys. The keys
 * of a block's positions are kv_heads * head_dim floats apart. */
static void attend_head_generic(const loramux_decoder *m, const loramux_layer *layer,
                                const float *q, int64_t kv_head, const int32_t *table,
                                int64_t len, float *scores, float *out) {
    const int64_t dim = m->head_dim, block = m->block_size;
    float top = -INFINITY;
    for (int64_t p = 0; p < len; p++) {
        const int64_t slot = (int64_t)table[p / block] * block + p % block;
        const float *key = layer->k_cache + slot_offset(m, slot, kv_head);
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < dim; i++) dot += q[i] * key[i];
        scores[p] = dot * m->scale;
        top = scores[p] > top ? scores[p] : top;
    }
    float total = 0.0f;
    for (int64_t p = 0; p < len; p++) {
        scores[p] = expf(scores[p] - top);
        total += scores[p];
    }
    for (int64_t i = 0; i < dim; i++) out[i] = 0.0f;
    for (int64_t p = 0; p < len; p++) {
        const int64_t slot = (int64_t)table[p / block] * block + p % block;
        const float *value = layer->v_cache + slot_offset(m, slot, kv_head);
        const float weight = scores[p] / total;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) out[i] += weight * value[i];
    }
}

#if defined(__AVX512F__)

/* The same for a head of CHUNKS * 16 floats, the query and the output held in registers, the
 * keys and values read block by block. A NaN score propagates: max keeps the NaN out of `top`
 * but the NaN's own e^x is NaN, and so is the total. */
#define ATTEND_FIXED(CHUNKS)                                                                      \
    static void attend_head_##CHUNKS(const loramux_decoder *m, const loramux_layer *layer,       \
                                     const float *q, int64_t kv_head, const int32_t *table,       \
                                     int64_t len, float *scores, float *out) {                    \
        const int64_t block = m->block_size, stride = m->kv_heads * m->head_dim;                 \
        __m512 query[CHUNKS], acc[CHUNKS];                                                        \
        for (int c = 0; c < CHUNKS; c++) query[c] = _mm512_loadu_ps(q + 16 * c);                 \
        float top = -INFINITY;                                                                    \
        for (int64_t first = 0; first < len; first += block) {                                    \
            const float *key = layer->k_cache + ((int64_t)table[first / block] * block * m->kv_heads + kv_head) * m->head_dim; \
            const int64_t count = len - first < block ? len - first : block;                     \
            for (int64_t i = 0; i < count; i++, key += stride) {                                  \
                __m512 dot = _mm512_mul_ps(query[0], _mm512_loadu_ps(key));                       \
                for (int c = 1; c < CHUNKS; c++)                                                  \
                    dot = _mm512_fmadd_ps(query[c], _mm512_loadu_ps(key + 16 * c), dot);          \
                const float score = _mm512_reduce_add_ps(dot) * m->scale;                         \
                scores[first + i] = score;                                                        \
                top = score > top ? score : top;                                                  \
            }                                                                                     \
        }                                                                                         \
        __m512 totals = _mm512_setzero_ps();                                                      \
        const __m512 tops = _mm512_set1_ps(top);                                                  \
        int64_t p = 0;                                                                            \
        for (; p + 16 <= len; p += 16) {                                                          \
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + p), tops));   \
            _mm512_storeu_ps(scores + p, e);                                                      \
            totals = _mm512_add_ps(totals, e);                                                    \
        }                                                                                         \
        if (p < len) {                                                                            \
            const __mmask16 rest = (__mmask16)((1u << (len - p)) - 1);                            \
            const __m512 e = exp16(                                                     \
                _mm512_sub_ps(_mm512_maskz_loadu_ps(rest, scores + p), tops));                    \
            _mm512_mask_storeu_ps(scores + p, rest, e);                                           \
            totals = _mm512_add_ps(totals, _mm512_maskz_mov_ps(rest, e));                         \
        }                                                                                         \
        const float total = _mm512_reduce_add_ps(totals);                                         \
        for (int c = 0; c < CHUNKS; c++) acc[c] = _mm512_setzero_ps();                            \
        for (int64_t first = 0; first < len; first += block) {                                    \
            const float *value = layer->v_cache + ((int64_t)table[first / block] * block * m->kv_heads + kv_head) * m->head_dim; \
            const int64_t count = len - first < block ? len - first : block;                     \
            for (int64_t i = 0; i < count; i++, value += stride) {                                \
                const __m512 weight = _mm512_set1_ps(scores[first + i] / total);                  \
                for (int c = 0; c < CHUNKS; c++)                                                  \
                    acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + 16 * c), acc[c]);    \
            }                                                                                     \
        }                                                                                         \
        for (int c = 0; c < CHUNKS; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);                 \
    }
ATTEND_FIXED(4)
ATTEND_FIXED(8)
#endif

static void attend_head(const loramux_decoder *m, const loramux_layer *layer, const float *q,
                        int64_t kv_head, const int32_t *table, int64_t len, float *scores,
                        float *out) {
#if defined(__AVX512F__)
    if (m->head_dim == 64) return attend_head_4(m, layer, q, kv_head, table, len, scores, out);
    if (m->head_dim == 128) return attend_head_8(m, layer, q, kv_head, table, len, scores, out);
#endif
    attend_head_generic(m, layer, q, kv_head, table, len, scores, out);
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* Adds the residual: x[t] += y[t] over this thread's share of the columns. */
static void add_rows(float *x, const float *y, int64_t tokens, int64_t size) {
    int64_t first, end;
    share_of(size, &first, &end);
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t c = first; c < end; c++) x[t * size + c] += y[t * size + c];
}

/* x += W in (+ the module's LoRA deltas) for a projection back to the hidden size (o_proj,
 * down_proj), inside the parallel region (its barriers are the region's). Without adapters the
 * products add into x directly; with, they go to `projected` first and take their deltas before
 * the residual adds them, as the eager forward rounds. */
static void add_projection(const loramux_layer *layer, int module, const loramux_weight *w,
                           const float *in, int64_t in_stride, int64_t in_dim, int64_t tokens,
                           const loramux_step_lora *lora, float *x, int64_t hidden,
                           float *projected, float *shrunk, float *buffer) {
    int64_t first, end;
    share_of(hidden, &first, &end);
    if (lora == NULL) {
        project_rows(w, first, end, in, in_stride, tokens, x, hidden, 1, buffer);
        return;
    }
    const int mods[1] = {module};
    const int64_t widths[1] = {hidden}, offsets[1] = {0};
    project_rows(w, first, end, in, in_stride, tokens, projected, hidden, 0, buffer);
    lora_shrink(layer, lora, mods, 1, in, in_stride, in_dim, tokens, shrunk);
#pragma omp barrier
    lora_expand(layer, lora, mods, widths, 1, shrunk, tokens, projected, hidden, offsets, buffer);
#pragma omp barrier
    add_rows(x, projected, tokens, hidden);
}

/* x [T, hidden]: the tokens' embeddings in, the last layer's output out (before the final norm).
 * lora: the step's adapters, or NULL. With adapters, o_proj's and down_proj's outputs take their
 * deltas before the residual adds them (as the eager forward rounds); without, the projections
 * add into x directly. Returns 0, or 1 when the work buffers could not be allocated (x is then
 * undefined). */
int loramux_decode_layers(const loramux_decoder *m, int64_t tokens, float *x, const float *cos,
                          const float *sin, const int64_t *slots, const int32_t *tables,
                          int64_t table_stride, const int32_t *lens,
                          const loramux_step_lora *lora, int threads) {
    const int64_t hidden = m->hidden, dim = m->head_dim;
    const int64_t q_size = m->heads * dim, kv_size = m->kv_heads * dim;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = m->inter;
    int64_t longest = 1, widest = hidden > inter ? hidden : inter;
    for (int64_t t = 0; t < tokens; t++) longest = lens[t] > longest ? lens[t] : longest;
    if (q_size > widest) widest = q_size;
    const int64_t lora_floats = lora == NULL ? 0 : tokens * 3 * lora->max_rank;
    /* h [T, hidden], qkv [T, q + 2 kv], attended [T, q], mlp [T, 2 inter], projected [T, hidden],
     * shrunk [T, 3, R] */
    float *shared = malloc(sizeof(float) *
                           (tokens * (2 * hidden + qkv_size + q_size + 2 * inter) + lora_floats));
    if (shared == NULL) return 1;
    float *h = shared, *qkv = h + tokens * hidden, *attended = qkv + tokens * qkv_size;
    float *mlp = attended + tokens * q_size, *projected = mlp + tokens * 2 * inter;
    float *shrunk = projected + tokens * hidden;
    static const int qkv_mods[3] = {Q, K, V}, gate_up_mods[2] = {GATE, UP};
    const int64_t qkv_offsets[3] = {0, q_size, q_size + kv_size}, gate_up_offsets[2] = {0, inter};
    const int64_t qkv_widths[3] = {q_size, kv_size, kv_size}, gate_up_widths[2] = {inter, inter};
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buffer = aligned_alloc(64, ((widest * sizeof(float) + 63) / 64) * 64);
        float *scores = malloc(sizeof(float) * (longest + 2 * dim));
        if (buffer == NULL || scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        for (int64_t l = 0; l < m->layers && !failed; l++) {
            const loramux_layer *layer = &m->layer[l];
#pragma omp single
            rms_norm(x, layer->input_norm, tokens, hidden, m->eps, h);
            {
                const loramux_weight *qkv_weights[3] = {&layer->q, &layer->k, &layer->v};
                project_group(qkv_weights, 3, h, hidden, tokens, qkv, qkv_size, qkv_offsets,
                              buffer);
            }
            if (lora != NULL) {
                lora_shrink(layer, lora, qkv_mods, 3, h, hidden, hidden, tokens, shrunk);
#pragma omp barrier
                lora_expand(layer, lora, qkv_mods, qkv_widths, 3, shrunk, tokens, qkv, qkv_size,
                            qkv_offsets, buffer);
            }
#pragma omp barrier
            /* Keys rotated and written with the values before any token attends. */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < tokens * m->kv_heads; item++) {
                const int64_t t = item / m->kv_heads, head = item % m->kv_heads;
                float *key = qkv + t * qkv_size + q_size + head * dim;
                const float *value = key + kv_size;
                rotate(key, cos + t * dim, sin + t * dim, dim, scores);
                const int64_t at = slot_offset(m, slots[t], head);
                memcpy(layer->k_cache + at, key, sizeof(float) * dim);
                memcpy(layer->v_cache + at, value, sizeof(float) * dim);
            }
#pragma omp for schedule(static)
            for (int64_t item = 0; item < tokens * m->heads; item++) {
                const int64_t t = item / m->heads, head = item % m->heads;
                float *query = qkv + t * qkv_size + head * dim;
                rotate(query, cos + t * dim, sin + t * dim, dim, scores);
                attend_head(m, layer, query, head / (m->heads / m->kv_heads),
                            tables + t * table_stride, lens[t], scores,
                            attended + t * q_size + head * dim);
            }
            add_projection(layer, O, &layer->o, attended, q_size, q_size, tokens, lora, x, hidden,
                           projected, shrunk, buffer);
#pragma omp barrier
#pragma omp single
            rms_norm(x, layer->post_norm, tokens, hidden, m->eps, h);
            {
                const loramux_weight *gate_up[2] = {&layer->gate, &layer->up};
                project_group(gate_up, 2, h, hidden, tokens, mlp, 2 * inter, gate_up_offsets,
                              buffer);
            }
            if (lora != NULL) {
                lora_shrink(layer, lora, gate_up_mods, 2, h, hidden, hidden, tokens, shrunk);
#pragma omp barrier
                lora_expand(layer, lora, gate_up_mods, gate_up_widths, 2, shrunk, tokens, mlp,
                            2 * inter, gate_up_offsets, buffer);
            }
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t item = 0; item < tokens * inter; item++) {
                const int64_t t = item / inter, i = item % inter;
                float *gate = mlp + t * 2 * inter;
                gate[i] = silu(gate[i]) * gate[inter + i];
            }
            add_projection(layer, DOWN, &layer->down, mlp, 2 * inter, inter, tokens, lora, x,
                           hidden, projected, shrunk, buffer);
#pragma omp barrier
        }
        free(buffer);
        free(scores);
    }
    free(shared);
    return failed;
}
