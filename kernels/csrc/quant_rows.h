/* The row de-quantization and dot products shared by the CPU's quantized ops (quant_cpu.c) and
 * the native decode forward (decode_cpu.c); quant_cpu.c's comment gives the packed layout. */
#ifndef LORAMUX_QUANT_ROWS_H
#define LORAMUX_QUANT_ROWS_H
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define INT4_CHUNK 32

static void dequantize_row_int8(const int8_t *q, const float *scales, int64_t k_dim, int64_t group,
                                float *w) {
    for (int64_t start = 0; start < k_dim; start += group) {
        const float scale = scales[start / group];
#pragma omp simd
        for (int64_t k = start; k < start + group; k++) w[k] = scale * (float)q[k];
    }
}

/* One chunk of 32 int4 values: w[j] = scale * q_j + min (scale * q_j is exact: one rounding). */
static inline void dequantize_chunk_int4(const uint8_t *bytes, float scale, float min, float *w) {
#if defined(__AVX512F__)
    const __m128i packed = _mm_loadu_si128((const __m128i *)bytes);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(packed, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    const __m512 s = _mm512_set1_ps(scale), m = _mm512_set1_ps(min);
    _mm512_storeu_ps(w, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), m));
    _mm512_storeu_ps(w + 16,
                     _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), m));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m128i packed = _mm_loadu_si128((const __m128i *)bytes);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i halves[2] = {_mm_and_si128(packed, mask),
                               _mm_and_si128(_mm_srli_epi16(packed, 4), mask)};
    const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(min);
    for (int h = 0; h < 2; h++) {
        const __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(halves[h]));
        const __m256 second = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(halves[h], 8)));
        _mm256_storeu_ps(w + 16 * h, _mm256_fmadd_ps(s, first, m));
        _mm256_storeu_ps(w + 16 * h + 8, _mm256_fmadd_ps(s, second, m));
    }
#else
    for (int j = 0; j < INT4_CHUNK / 2; j++) {
        w[j] = scale * (float)(bytes[j] & 0x0F) + min;
        w[j + INT4_CHUNK / 2] = scale * (float)(bytes[j] >> 4) + min;
    }
#endif
}

static void dequantize_row_int4(const uint8_t *q, const float *scales, const float *mins,
                                int64_t k_dim, int64_t group, float *w) {
    /* group by group: a 64-bit divide a chunk for its group cost more than the chunk */
    for (int64_t g = 0, start = 0; start < k_dim; g++)
        for (const int64_t end = start + group; start < end; start += INT4_CHUNK)
            dequantize_chunk_int4(q + start / 2, scales[g], mins[g], w + start);
}

static void dequantize_row(int kind, const void *q, const float *scales, const float *mins,
                           int64_t n, int64_t k_dim, int64_t group, float *w) {
    const int64_t groups = k_dim / group;
    if (kind == 8)
        dequantize_row_int8((const int8_t *)q + n * k_dim, scales + n * groups, k_dim, group, w);
    else
        dequantize_row_int4((const uint8_t *)q + n * (k_dim / 2), scales + n * groups,
                            mins + n * groups, k_dim, group, w);
}

/* x . w over k_dim floats. AVX-512: four partial sums, so the adds' latency overlaps. */
static inline float dot1(const float *x, const float *w, int64_t k_dim) {
    int64_t k = 0;
    float dot = 0.0f;
#if defined(__AVX512F__)
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (; k + 64 <= k_dim; k += 64)
        for (int a = 0; a < 4; a++)
            acc[a] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16 * a), _mm512_loadu_ps(w + k + 16 * a),
                                     acc[a]);
    for (; k + 16 <= k_dim; k += 16)
        acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), acc[0]);
    dot = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]),
                                             _mm512_add_ps(acc[2], acc[3])));
#endif
#pragma omp simd reduction(+ : dot)
    for (int64_t i = k; i < k_dim; i++) dot += x[i] * w[i];
    return dot;
}

/* The dot products of four tokens' x with one w: each w load serves four sums. */
static inline void dot4(const float *x, int64_t x_stride, const float *w, int64_t k_dim,
                        float *dots) {
    int64_t k = 0;
    float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
    const float *x0 = x, *x1 = x + x_stride, *x2 = x + 2 * x_stride, *x3 = x + 3 * x_stride;
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
           a3 = _mm512_setzero_ps();
    for (; k + 16 <= k_dim; k += 16) {
        const __m512 wk = _mm512_loadu_ps(w + k);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k), wk, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x1 + k), wk, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x2 + k), wk, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x3 + k), wk, a3);
    }
    d0 = _mm512_reduce_add_ps(a0), d1 = _mm512_reduce_add_ps(a1);
    d2 = _mm512_reduce_add_ps(a2), d3 = _mm512_reduce_add_ps(a3);
#endif
#pragma omp simd reduction(+ : d0, d1, d2, d3)
    for (int64_t i = k; i < k_dim; i++) {
        d0 += x0[i] * w[i];
        d1 += x1[i] * w[i];
        d2 += x2[i] * w[i];
        d3 += x3[i] * w[i];
    }
    dots[0] = d0, dots[1] = d1, dots[2] = d2, dots[3] = d3;
}

/* x . W[n] for a packed row, de-quantized in registers as it is multiplied: each weight is the
 * definition's (scale * q + min rounded once; int8: scale * q), never stored. buffer: k floats,
 * used only where the registers cannot do it (no AVX-512; int8 scales for fewer than 16 inputs):
 * the row is de-quantized there, then dot1.
 *
 * int4: a group's sixteen possible weights sit in one register (lut[q] = scale * q + min), and
 * each 4-bit value picks its weight with a permute, which reads the low 4 bits of each lane: a
 * byte widened to a lane gives input j in its low nibble and, shifted right by 4, input j + 16. */
static inline float dot_packed_row(int kind, const void *q, const float *scales, const float *mins,
                                   int64_t n, int64_t k_dim, int64_t group, const float *x,
                                   float *buffer) {
    const int64_t groups = k_dim / group;
#if defined(__AVX512F__)
    if (kind == 8 && group % 16 != 0) {  /* a scale per fewer than 16 inputs: de-quantize */
        dequantize_row(kind, q, scales, mins, n, k_dim, group, buffer);
        return dot1(x, buffer, k_dim);
    }
    scales += n * groups;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    (void)buffer;
    if (kind == 4) {
        const uint8_t *row = (const uint8_t *)q + n * (k_dim / 2);
        mins += n * groups;
        const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        /* group by group: no division in the loop (a 64-bit divide a chunk cost more than
         * the chunk's own work) */
        for (int64_t g = 0, start = 0; g < groups; g++) {
            const __m512 lut = _mm512_fmadd_ps(_mm512_set1_ps(scales[g]), iota,
                                               _mm512_set1_ps(mins[g]));
            for (const int64_t end = start + group; start < end; start += INT4_CHUNK) {
                const __m512i bytes =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + start / 2)));
                const __m512 low = _mm512_permutexvar_ps(bytes, lut);
                const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), lut);
                if ((start / INT4_CHUNK) & 1) {
                    acc2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + start), low, acc2);
                    acc3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + start + 16), high, acc3);
                } else {
                    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + start), low, acc0);
                    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + start + 16), high, acc1);
                }
            }
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1),
                                                  _mm512_add_ps(acc2, acc3)));
    }
    const int8_t *row = (const int8_t *)q + n * k_dim;
    int64_t k = 0;
    for (int64_t g = 0; g < groups && k + group <= k_dim; g++) {
        const __m512 scale = _mm512_set1_ps(scales[g]);
        for (const int64_t end = k + group; k < end; k += 16) {
            const __m512 values = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k))));
            const __m512 weights = _mm512_mul_ps(scale, values);
            if ((k / 16) & 1)
                acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), weights, acc1);
            else
                acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), weights, acc0);
        }
    }
    float dot = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    for (; k < k_dim; k++) dot += x[k] * (scales[k / group] * (float)row[k]);
    return dot;
#else
    (void)groups;
    dequantize_row(kind, q, scales, mins, n, k_dim, group, buffer);
    return dot1(x, buffer, k_dim);
#endif
}

#endif
