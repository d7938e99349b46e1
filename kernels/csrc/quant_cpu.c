/* Weight-only quantized linear layers for the CPU: y = x @ W^T (+ bias) with W kept packed.
 *
 * W [N, K] is stored in groups of G consecutive inputs of one output row n (g = k / G):
 *
 *     int8:  W[n, k] = scales[n, g] * q[n, k]                 q int8
 *     int4:  W[n, k] = scales[n, g] * q[n, k] + mins[n, g]    q in 0..15, two per byte: in each
 *            chunk of 32 inputs, byte j < 16 holds input j (low nibble) and input j + 16 (high)
 *
 * which is loramux.kernels.quant_linear's definition. Each work item de-quantizes one output row
 * into a float buffer (K floats: L1-resident for the layers of the models we serve), exactly as
 * the definition computes it (scale * q is exact in float32, so one rounding, with or without a
 * fused multiply-add), then takes its dot product with every token's x. A decode step has one to
 * a few tokens, so its cost is reading W: 1 byte (int8) or half a byte (int4) per weight instead
 * of float32's 4. Steps with many tokens (prefill) use loramux_dequantize_rows instead: tiles of
 * W de-quantized here and multiplied by the BLAS, whose blocking beats these dot products there.
 *
 * Rows are independent: OpenMP splits them over torch's threads (libgomp, already loaded by
 * torch). No -ffast-math: a NaN in x propagates as IEEE says.
 */
#include <stdlib.h>

#include "quant_rows.h"

/* Multiply-adds below which a call runs on one thread: waking the pool's other threads costs
 * more than a decoder layer's projections save (measured in loramux serve on 2 cores, where
 * they also take the core the server's event loop needs: batch-1 decode 21 tok/s parallel,
 * 31 on one thread). An LM head (49152 x 576) still splits. */
#define PARALLEL_MIN_WORK (1L << 22)

/* kind: 8 or 4. x [T, K] rows x_stride apart; y [T, N] rows y_stride apart; bias [N] or NULL.
 * Returns 0, or 1 when the row buffers could not be allocated. */
int loramux_quant_linear_f32(int kind, const float *x, int64_t x_stride, int64_t tokens,
                             int64_t k_dim, const void *q, const float *scales, const float *mins,
                             int64_t group, int64_t n_dim, const float *bias, float *y,
                             int64_t y_stride) {
    int failed = 0;
#pragma omp parallel if (n_dim * k_dim * tokens >= PARALLEL_MIN_WORK)
    {
        float *w = aligned_alloc(64, ((k_dim * sizeof(float) + 63) / 64) * 64);
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t n = 0; n < n_dim; n++) {
                const float b = bias != NULL ? bias[n] : 0.0f;
                if (tokens == 1) {  /* de-quantized in registers (an LM head's decode step) */
                    y[n] = dot_packed_row(kind, q, scales, mins, n, k_dim, group, x, w) + b;
                    continue;
                }
                dequantize_row(kind, q, scales, mins, n, k_dim, group, w);
                int64_t t = 0;
                for (; t + 4 <= tokens; t += 4) {
                    float dots[4];
                    dot4(x + t * x_stride, x_stride, w, k_dim, dots);
                    for (int i = 0; i < 4; i++) y[(t + i) * y_stride + n] = dots[i] + b;
                }
                for (; t < tokens; t++) y[t * y_stride + n] = dot1(x + t * x_stride, w, k_dim) + b;
            }
        }
        free(w);
    }
    return failed;
}

/* W[first : first + rows] de-quantized into out [rows, K] (rows out_stride apart). */
void loramux_dequantize_rows(int kind, const void *q, const float *scales, const float *mins,
                             int64_t k_dim, int64_t group, int64_t first, int64_t rows, float *out,
                             int64_t out_stride) {
#pragma omp parallel for schedule(static) if (rows * k_dim >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; r++)
        dequantize_row(kind, q, scales, mins, first + r, k_dim, group, out + r * out_stride);
}
