/* Linear products of a few rows on CPU, float32: y[rows, out] = x[rows, in] @ w[out, in]^T (+ bias),
 * for 1 to MAX_ROWS rows, the weight in nn.Linear's own row-major layout (no packed copy). Built by
 * cpu_gemv.py (through cpu_build.py) for the target CPU.
 *
 * Why: a decode step of a few sequences is bound by reading the weights, and the LM head of the
 * step just before has pushed them out of cache. MKL's sgemm read them at ~10 GB/s there (28 layer
 * products of the issue-22 model after its 32,000-wide head: ~1 ms on 2 cores, on one thread
 * whatever the thread count), oneDNN's packed head at ~47 GB/s. This loop streams each thread's
 * share of the weight rows once, OT rows side by side, prefetching PREFETCH_ROWS rows ahead (the
 * hardware prefetcher stops at 4 KiB pages), and multiplies each loaded weight vector with every
 * row of x (held in registers, so a product of 8 rows reads the weight once, as one of 1 row does).
 *
 * Each output is summed in one order whatever the row count, tile or thread count (lane-wise over
 * the input in VW-float steps, then across the lanes, then the tail): a row's result does not
 * depend on the rows beside it or on the threads. */
#include <omp.h>
#include <stdint.h>

#include "cpu_vec.h"

#define MAX_ROWS 8
/* 8 weight rows ahead: measured against 0, 4, 16 and 32 on the 2-core EPYC. Near the end this prefetches
 * past the weight, which is harmless: a prefetch never faults. */
#define PREFETCH_ROWS 8

/* output rows side by side per tile: OT x rows accumulators stay within the registers (32 with
 * AVX-512, 16 with AVX2) beside the weight and x vectors */
#if VW == 16
#define OT_FOR(R) ((R) <= 4 ? 4 : 2)
#else
#define OT_FOR(R) ((R) <= 2 ? 4 : (R) <= 4 ? 2 : 1)
#endif

static inline float lane_sum(f32v v) {
    float s = 0.f;
    for (int l = 0; l < VW; l++) s += v[l];
    return s;
}

/* outputs o .. o + OT - 1 of the R rows; R and OT are constants once inlined */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, const float *bias, float *y,
                                                       int in, int out, int o, const int R, const int OT) {
    f32v acc[4][MAX_ROWS];
    for (int t = 0; t < OT; t++)
        for (int r = 0; r < R; r++) acc[t][r] = splat(0.f);
    const float *wt = w + (int64_t)o * in;
    int i = 0;
    for (; i + VW <= in; i += VW) {
        for (int t = 0; t < OT; t++) PREFETCH_LINE(wt + (int64_t)(t + PREFETCH_ROWS) * in + i);
        f32v xv[MAX_ROWS];
        for (int r = 0; r < R; r++) xv[r] = *(const f32v_u *)(x + (int64_t)r * in + i);
        for (int t = 0; t < OT; t++) {
            f32v wv = *(const f32v_u *)(wt + (int64_t)t * in + i);
            for (int r = 0; r < R; r++) acc[t][r] += wv * xv[r];
        }
    }
    for (int t = 0; t < OT; t++)
        for (int r = 0; r < R; r++) {
            float s = lane_sum(acc[t][r]);
            for (int j = i; j < in; j++) s += wt[(int64_t)t * in + j] * x[(int64_t)r * in + j];
            y[(int64_t)r * out + o + t] = bias ? s + bias[o + t] : s;
        }
}

static inline __attribute__((always_inline)) void span(const float *x, const float *w, const float *bias, float *y,
                                                       int in, int out, int o0, int o1, const int R) {
    int o = o0;
    for (; o + OT_FOR(R) <= o1; o += OT_FOR(R)) tile(x, w, bias, y, in, out, o, R, OT_FOR(R));
    for (; o < o1; o++) tile(x, w, bias, y, in, out, o, R, 1);
}

static void span_rows(const float *x, const float *w, const float *bias, float *y, int in, int out, int o0, int o1,
                      int rows) {
    switch (rows) {
#define ROWS(R) case R: span(x, w, bias, y, in, out, o0, o1, R); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
}

int max_rows(void) { return MAX_ROWS; }

/* x [rows, in], w [out, in], bias [out] or NULL, y [rows, out], all contiguous; each thread takes a
 * contiguous share of the output rows (in fours). Returns 1 (nothing written) for rows outside
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
        int64_t n = omp_get_num_threads(), t = omp_get_thread_num(), fours = (out + 3) / 4;
        int o0 = (int)(fours * t / n) * 4, o1 = (int)(fours * (t + 1) / n) * 4;
        if (o1 > out) o1 = out;
        if (o0 < o1) span_rows(x, w, bias, y, in, out, o0, o1, rows);
    }
    return 0;
}
