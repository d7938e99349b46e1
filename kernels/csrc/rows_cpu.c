/* Row-wise float32 ops of a long step (a prefill chunk) for the CPU, one pass each where torch
 * makes several over memory that no longer fits in cache (SmolLM2's 2,000-token prompt: its
 * [2000, 1536] MLP activations are 12 MB, and RMSNorm, SiLU and the products were a sixth of
 * the step):
 *
 *     rms_norm:  out[t] = weight * (x[t] * (1 / sqrt(mean(x[t]^2) + eps)))   (transformers' Llama)
 *     silu_mul:  out[t] = silu(gate[t]) * up[t],  silu(g) = g / (1 + e^-g)
 *     rope:      x[t, h] = x[t, h] cos[t] + rotate_half(x[t, h]) sin[t], in place
 *
 * Rows are split over torch's OpenMP threads. e^x is computed sixteen at a time (AVX-512: a
 * degree-7 polynomial after range reduction, within an ulp or two of the correctly rounded
 * value, as torch's own vectorized exp is), elsewhere by expf. No -ffast-math: NaN propagates.
 */
#include <math.h>
#include <stdint.h>

#include "vector_exp.h"

/* Rows below which a call stays on one thread (a decode step's few rows). */
#define PARALLEL_MIN_ROWS 16

void loramux_rms_norm_f32(const float *x, int64_t x_stride, int64_t rows, int64_t size,
                          const float *weight, float eps, float *out, int64_t out_stride) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        const float *row = x + t * x_stride;
        float *dst = out + t * out_stride;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < size; i++) squares += row[i] * row[i];
        const float inverse = 1.0f / sqrtf(squares / (float)size + eps);
#pragma omp simd
        for (int64_t i = 0; i < size; i++) dst[i] = weight[i] * (row[i] * inverse);
    }
}


void loramux_silu_mul_f32(const float *gate, int64_t gate_stride, const float *up,
                          int64_t up_stride, int64_t rows, int64_t size, float *out,
                          int64_t out_stride) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate + t * gate_stride, *u = up + t * up_stride;
        float *dst = out + t * out_stride;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= size; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < size; i++) dst[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}

/* RoPE in place on x [rows, heads, dim] (row t's heads x_stride apart, each head's dim floats
 * contiguous, heads head_stride apart): x = x cos[t] + rotate_half(x) sin[t], where
 * rotate_half(x) = (-x[dim/2:], x[:dim/2]); the two products and their sum rounded apart, as
 * torch's three ops round them (no contraction: -std=c11). */
void loramux_rope_f32(float *x, int64_t x_stride, int64_t head_stride, int64_t rows,
                      int64_t heads, int64_t dim, const float *cos, const float *sin,
                      int64_t table_stride) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * table_stride, *s = sin + t * table_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * x_stride + h * head_stride;
            float first[256];
            if (half > 256) continue; /* the caller checks dim <= 512 */
            for (int64_t i = 0; i < half; i++) first[i] = v[i];
            for (int64_t i = 0; i < half; i++) {
                const float straight = v[i] * c[i], turned = -v[i + half] * s[i];
                v[i] = straight + turned;
            }
            for (int64_t i = half; i < dim; i++) {
                const float straight = v[i] * c[i], turned = first[i - half] * s[i];
                v[i] = straight + turned;
            }
        }
    }
}
