/* Linear products of a few rows on CPU, float32: y[rows, out] = x[rows, in] @ w[out, in]^T (+ bias),
 * for 1 to MAX_ROWS rows (16 with AVX-512, 8 with AVX2), the weight in nn.Linear's own row-major
 * layout (no packed copy). Built by cpu_gemv.py (through cpu_build.py) for the target CPU.
 *
 * Why: a decode step of a few sequences is bound by reading the weights, and the LM head of the
 * step just before has pushed them out of cache. MKL's sgemm read them at ~10 GB/s there (28 layer
 * products of the issue-22 model after its 32,000-wide head: ~1 ms on 2 cores, on one thread
 * whatever the thread count), oneDNN's packed head at ~47 GB/s. This loop streams each thread's
 * share of the weight rows once, front to back, prefetching PREFETCH_FLOATS ahead (the hardware
 * prefetcher stops at 4 KiB pages), and multiplies each loaded weight vector with every row of x
 * (so a product of 8 rows reads the weight once, as one of 1 row does).
 *
 * One weight row at a time, not several side by side (an earlier version read 4 rows in step,
 * sharing each x load among them): 4 interleaved streams, each 1 KiB long for a 256-wide weight,
 * kept the prefetchers from running ahead. On a 2-core EPYC whose memory streamed ~31 GB/s to
 * torch.sum (2026-12-07; two runs, medians of 15 calls), the issue-22 model's 32,000-wide head
 * at one row took 0.8-2.3 ms with 4 rows side by side against 0.34-1.04 ms a row at a time; its
 * 28 layer products and head 2.4-3.7 ms against 0.9-1.9 (one row), 2.8-3.3 against 1.6-1.8 (four),
 * 3.1-4.0 against 2.8-3.5 (eight). The bits are the same (the order of each sum is).
 *
 * Each output is summed in one order whatever the row count or thread count (lane-wise over the
 * input in VW-float steps, then across the lanes, then the tail): a row's result does not depend
 * on the rows beside it or on the threads. */
#include <omp.h>
#include <stdint.h>

#include "cpu_vec.h"

/* one accumulator vector per row: 16 rows' stay in AVX-512's 32 registers beside the operands, 8 in
 * AVX2's 16. At 12 and 16 rows the 28 layer products of the issue-22 model took 1.11 and 1.48 ms
 * against sgemm's 1.49 and 1.84 (AVX-512 EPYC, 2026-12-07, after the head evicted them). */
#if VW == 16
#define MAX_ROWS 16
#else
#define MAX_ROWS 8
#endif
/* 8 KiB ahead: measured against 4 and 16 KiB on the 2-core EPYC above. Near the
 * end this prefetches past the weight, which is harmless: a prefetch never faults. */
#define PREFETCH_FLOATS 2048

static inline float lane_sum(f32v v) {
    float s = 0.f;
    for (int l = 0; l < VW; l++) s += v[l];
    return s;
}

/* output o of the R rows (R a constant once inlined): its weight row is read front to back, so each
 * thread reads one stream through its share of the weight, which the hardware prefetcher follows */
static inline __attribute__((always_inline)) void dot_rows(const float *x, const float *w, const float *bias,
                                                           float *y, int in, int out, int o, const int R) {
    f32v acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = splat(0.f);
    const float *wr = w + (int64_t)o * in;
    int i = 0;
    for (; i + VW <= in; i += VW) {
        PREFETCH_LINE(wr + PREFETCH_FLOATS + i);
        f32v wv = *(const f32v_u *)(wr + i);
        for (int r = 0; r < R; r++) acc[r] += wv * *(const f32v_u *)(x + (int64_t)r * in + i);
    }
    for (int r = 0; r < R; r++) {
        float s = lane_sum(acc[r]);
        for (int j = i; j < in; j++) s += wr[j] * x[(int64_t)r * in + j];
        y[(int64_t)r * out + o] = bias ? s + bias[o] : s;
    }
}

static inline __attribute__((always_inline)) void span(const float *x, const float *w, const float *bias, float *y,
                                                       int in, int out, int o0, int o1, const int R) {
    for (int o = o0; o < o1; o++) dot_rows(x, w, bias, y, in, out, o, R);
}

static void span_rows(const float *x, const float *w, const float *bias, float *y, int in, int out, int o0, int o1,
                      int rows) {
    switch (rows) {
#define ROWS(R) case R: span(x, w, bias, y, in, out, o0, o1, R); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#if MAX_ROWS == 16
        ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#endif
#undef ROWS
    }
}

int max_rows(void) { return MAX_ROWS; }

/* x [rows, in], w [out, in], bias [out] or NULL, y [rows, out], all contiguous; each thread takes a
 * contiguous share of the output rows. Returns 1 (nothing written) for rows outside
 * 1 .. MAX_ROWS. */
int linear_rows(const float *x, const float *w, const float *bias, float *y, int rows, int in, int out,
                int threads) {
    if (rows < 1 || rows > MAX_ROWS) return 1;
    if (threads <= 1) {
        span_rows(x, w, bias, y, in, out, 0, out, rows);
        return 0;
    }
    #pragma omp parallel num_threads(threads)
    {
        int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
        int o0 = (int)(out * t / n), o1 = (int)(out * (t + 1) / n);
        if (o0 < o1) span_rows(x, w, bias, y, in, out, o0, o1, rows);
    }
    return 0;
}
