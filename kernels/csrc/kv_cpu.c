/* Reading an 8-bit paged KV cache on the CPU: whole blocks gathered and de-quantized in one pass.
 *
 * A block of loramux.kernels.kv_quant's cache is block_bytes contiguous bytes: `vectors` (block
 * size x KV heads) vectors of head_dim 8-bit values, then one float32 scale per vector. For each
 * listed block i, out[i] (vectors x head_dim floats) is
 *
 *     out[i][v][d] = value(q[v][d]) * scales[v]
 *
 * with value() the int8 number, or for fp8 e4m3 the float in `fp8_values` (256 entries, made by
 * torch's own conversion, NaN bytes as 0). One float32 multiply of exact operands: the same bits
 * as kv_quant.dequantize_kv. The torch path reads the bytes, converts and multiplies in three
 * passes over the context; this is one, reading a byte and writing a float per value.
 *
 * Blocks are independent: OpenMP splits them over torch's threads above PARALLEL_MIN_VALUES.
 * No -ffast-math (the flags are native_build.py's).
 */
#include <stdint.h>

/* Values below which a call runs on one thread (a short context: waking the pool costs more
 * than it saves). Not higher: torch's pool sleeps while a call runs on one thread, and waking it
 * for the torch ops around each call cost more than the read itself (SmolLM2, 4 x 1,000-token
 * contexts on 2 cores: 100 ms a decode step at 2M values, 70 at this, float32 KV 67). */
#define PARALLEL_MIN_VALUES (1L << 15)

void loramux_gather_dequantize_kv(int fp8, const float *fp8_values, const uint8_t *raw,
                                  int64_t block_bytes, const int64_t *blocks, int64_t count,
                                  int64_t vectors, int64_t head_dim, float *out) {
    const int64_t data_bytes = vectors * head_dim;
#pragma omp parallel for schedule(static) if (count * data_bytes >= PARALLEL_MIN_VALUES)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *block = raw + blocks[i] * block_bytes;
        const float *scales = (const float *)(block + data_bytes);
        float *dst = out + i * data_bytes;
        for (int64_t v = 0; v < vectors; v++) {
            const float scale = scales[v];
            const uint8_t *q = block + v * head_dim;
            float *o = dst + v * head_dim;
            if (fp8) {
                for (int64_t d = 0; d < head_dim; d++) o[d] = fp8_values[q[d]] * scale;
            } else {
                const int8_t *signed_q = (const int8_t *)q;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) o[d] = (float)signed_q[d] * scale;
            }
        }
    }
}
