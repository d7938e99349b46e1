/* LoRA for the CPU, read straight from the adapter pool: each adapter's rows once, no padding.
 *
 * One call applies a projection group (q/k/v, gate/up, or one module: S slices sharing the input
 * x). For segments k of tokens [start_k, end_k) using the adapter whose rows start at f_k, with
 * rank r_ks and scaling c_ks in slice s:
 *
 *     h[t, s R + j]   = x[t, :] . A_s[f_k + j, :]                      j < r_ks   (shrink)
 *     out_s[t, :]    += c_ks * sum_j h[t, s R + j] * B_s[f_k + j, :]              (expand)
 *
 * which is loramux.kernels.lora's reference definition (A_s [rows, in] and B_s [rows, out_s] are
 * the pool's views: one row per rank-row, all slices of a row at fixed offsets of it, so a row's
 * slices sit side by side and are read as one run).
 *
 * Why not torch: a decode step gives each adapter one or two tokens, so its cost is reading the
 * adapters' rows from memory. Batched matmuls need the adapters copied into stacks padded to the
 * widest rank (a mix of ranks 8 and 16 reads a third more than the rows hold) and a dozen small
 * ops a layer; here each row is read once, in two parallel loops: over (segment, rank row) for
 * the shrink, every slice's A row staying in L1 while the segment's tokens take their dot
 * products, two tokens at a time (two independent sums); then over (segment, slice, block of
 * output columns) for the expand, the block of B rows reused for each token.
 *
 * A token reads only its own adapter's rows, so an adapter whose weights are not finite touches
 * only its own tokens' outputs. Build without -ffast-math: NaN and inf must propagate as IEEE says.
 * OpenMP: the runtime torch already loaded (libgomp.so.1), so torch's thread count applies.
 */
#include <stdint.h>
#include <stdlib.h>

#define COLUMN_BLOCK 1024 /* at most this many floats of output per expand work item */

/* The columns of one expand item of an output of `dim` floats: the fewest blocks of at most
 * COLUMN_BLOCK, of equal width (a multiple of 16 floats, a cache line) but for the last. */
static int64_t block_width(int64_t dim) {
    const int64_t blocks = (dim + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
    const int64_t width = (dim + blocks - 1) / blocks;
    return (width + 15) / 16 * 16;
}

static void shrink_row(const float *x, int64_t x_stride, int64_t in_dim, const float *a_row,
                       int64_t start, int64_t end, float *h, int64_t h_stride) {
    int64_t t = start;
    for (; t + 1 < end; t += 2) {
        const float *x0 = x + t * x_stride, *x1 = x0 + x_stride;
        float dot0 = 0.0f, dot1 = 0.0f;
#pragma omp simd reduction(+ : dot0, dot1)
        for (int64_t i = 0; i < in_dim; i++) {
            dot0 += x0[i] * a_row[i];
            dot1 += x1[i] * a_row[i];
        }
        h[t * h_stride] = dot0;
        h[(t + 1) * h_stride] = dot1;
    }
    if (t < end) {
        const float *x_row = x + t * x_stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < in_dim; i++) dot += x_row[i] * a_row[i];
        h[t * h_stride] = dot;
    }
}

/* Returns 0, or -1 when the work lists could not be allocated (nothing written then). */
int loramux_lora_f32(const float *x, int64_t x_stride, int64_t in_dim, /* [T, in] */
                     int64_t num_slices,
                     float *const *outs, const int64_t *out_strides, /* per slice [T, out_s] */
                     const int64_t *out_dims,
                     const float *const *a_slices, int64_t a_stride, /* per slice A_s [R, in] */
                     const float *const *b_slices, int64_t b_stride, /* per slice B_s [R, out_s] */
                     const int64_t *segments, int64_t num_segments, /* [k, 3]: start, end, f */
                     const int64_t *ranks, const float *scales,     /* [k, S] */
                     float *h, int64_t h_stride, int64_t rank_width) /* [T, >= S R], R */
{
    const int64_t S = num_slices;
    int64_t shrink_items = 0, expand_items = 0;
    for (int64_t k = 0; k < num_segments; k++) {
        int64_t widest = 0;
        for (int64_t s = 0; s < S; s++) {
            const int64_t rank = ranks[k * S + s];
            widest = rank > widest ? rank : widest;
            if (rank > 0) expand_items += (out_dims[s] + block_width(out_dims[s]) - 1) / block_width(out_dims[s]);
        }
        shrink_items += widest;
    }
    /* Work lists: shrink item i is (segment, rank row j); expand item i is (segment, slice,
     * first column). */
    int64_t *lists = malloc(sizeof(int64_t) * (size_t)(2 * shrink_items + 3 * expand_items + 1));
    if (lists == NULL) return -1;
    int64_t *shrink = lists, *expand = lists + 2 * shrink_items;
    for (int64_t k = 0, i = 0, e = 0; k < num_segments; k++) {
        int64_t widest = 0;
        for (int64_t s = 0; s < S; s++) {
            const int64_t rank = ranks[k * S + s];
            widest = rank > widest ? rank : widest;
            for (int64_t c = 0; rank > 0 && c < out_dims[s]; c += block_width(out_dims[s]), e++)
                expand[3 * e] = k, expand[3 * e + 1] = s, expand[3 * e + 2] = c;
        }
        for (int64_t j = 0; j < widest; j++, i++) shrink[2 * i] = k, shrink[2 * i + 1] = j;
    }

#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < shrink_items; item++) {
            const int64_t k = shrink[2 * item], j = shrink[2 * item + 1];
            const int64_t *seg = segments + 3 * k;
            const int64_t row = (seg[2] + j) * a_stride;
            for (int64_t s = 0; s < S; s++)
                if (j < ranks[k * S + s])
                    shrink_row(x, x_stride, in_dim, a_slices[s] + row, seg[0], seg[1],
                               h + s * rank_width + j, h_stride);
        }
        /* the implicit barrier: every h is written before any expand reads it */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < expand_items; item++) {
            const int64_t k = expand[3 * item], s = expand[3 * item + 1], c0 = expand[3 * item + 2];
            const int64_t *seg = segments + 3 * k;
            const int64_t rank = ranks[k * S + s];
            const float scale = scales[k * S + s];
            const int64_t left = out_dims[s] - c0;
            const int64_t full = block_width(out_dims[s]), width = left < full ? left : full;
            const float *b_block = b_slices[s] + seg[2] * b_stride + c0;
            for (int64_t t = seg[0]; t < seg[1]; t++) {
                float acc[COLUMN_BLOCK] = {0.0f};
                const float *h_row = h + t * h_stride + s * rank_width;
                for (int64_t j = 0; j < rank; j++) {
                    const float hj = h_row[j];
                    const float *b_row = b_block + j * b_stride;
#pragma omp simd
                    for (int64_t c = 0; c < width; c++) acc[c] += hj * b_row[c];
                }
                float *out_row = outs[s] + t * out_strides[s] + c0;
#pragma omp simd
                for (int64_t c = 0; c < width; c++) out_row[c] += scale * acc[c];
            }
        }
    }
    free(lists);
    return 0;
}
