/* e^x sixteen at a time for the CPU's native ops (AVX-512 builds only; the callers keep a
 * scalar path): x = n ln 2 + r, |r| <= ln 2 / 2 (ln 2 in two parts, so n ln 2 is exact), e^r by
 * its Taylor polynomial to r^7 (within an ulp or two of the correctly rounded value, as torch's
 * own vectorized exp is), scaled by 2^n; below float's range 0, above it infinity, NaN kept. */
#ifndef LORAMUX_VECTOR_EXP_H
#define LORAMUX_VECTOR_EXP_H
#if defined(__AVX512F__)
#include <immintrin.h>
#include <math.h>

static inline __m512 exp16(__m512 x) {
    const __m512 low = _mm512_set1_ps(-87.3f), high = _mm512_set1_ps(88.7f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
    const __mmask16 over = _mm512_cmp_ps_mask(x, high, _CMP_GT_OQ);
    const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, low), high);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), clamped);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 poly = _mm512_set1_ps(1.0f / 5040.0f);
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 720.0f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 120.0f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 24.0f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 6.0f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(0.5f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
    __m512 result = _mm512_scalef_ps(poly, n);
    result = _mm512_mask_mov_ps(result, under, _mm512_setzero_ps());
    result = _mm512_mask_mov_ps(result, over, _mm512_set1_ps(INFINITY));
    /* a NaN compared false both ways and was clamped: give it back */
    return _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}
#endif

#endif
