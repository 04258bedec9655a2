/* Paged decode attention on CPU, float32: one query token per sequence, read straight from the
 * block pools (no gathered copy). Built by cpu_decode.py for one layout at a time: the macros
 * below are compile-time constants, so the compiler unrolls and vectorizes the head loops.
 *
 *   q       [seqs, KV_HEADS * GROUP, HEAD_DIM]        (contiguous)
 *   k_pool  [blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM]  (contiguous)
 *   v_pool  like k_pool
 *   tables  [seqs, width] int32, lens [seqs] int32, sinks [heads] or NULL
 *   out     like q
 *
 * Each work item is one sequence (all its K/V heads, so every byte of a block is used while it is
 * in cache) or, when there are too few sequences to keep the threads busy, one (sequence, K/V
 * head). Softmax runs online, one block at a time: a running maximum and sum per query head. */
#include <math.h>
#include <stdint.h>

#define HEADS (KV_HEADS * GROUP)

static void attend(const float *restrict q, const float *restrict k_pool, const float *restrict v_pool,
                   const int32_t *restrict table, int len, int window, const float *restrict sinks,
                   float *restrict out, int h0, int h1, float scale) {
    float qs[HEADS][HEAD_DIM], acc[HEADS][HEAD_DIM], run_max[HEADS], run_sum[HEADS];
    float p[GROUP][BLOCK_SIZE] __attribute__((aligned(64)));
    for (int h = h0 * GROUP; h < h1 * GROUP; h++) {
        for (int d = 0; d < HEAD_DIM; d++) qs[h][d] = q[h * HEAD_DIM + d] * scale;
        for (int d = 0; d < HEAD_DIM; d++) acc[h][d] = 0.f;
        /* a sink is one more logit whose value vector is zero: it starts the running sum */
        run_max[h] = sinks ? sinks[h] : -1e30f;
        run_sum[h] = sinks ? 1.f : 0.f;
    }
    int first = (window > 0 && len > window) ? len - window : 0;
    for (int b = first / BLOCK_SIZE; b * BLOCK_SIZE < len; b++) {
        int64_t block = table[b];
        int t0 = b * BLOCK_SIZE < first ? first - b * BLOCK_SIZE : 0;
        int t1 = len - b * BLOCK_SIZE < BLOCK_SIZE ? len - b * BLOCK_SIZE : BLOCK_SIZE;
        const float *kb = k_pool + block * (BLOCK_SIZE * KV_HEADS * HEAD_DIM);
        const float *vb = v_pool + block * (BLOCK_SIZE * KV_HEADS * HEAD_DIM);
        for (int kvh = h0; kvh < h1; kvh++) {
            float (*qh)[HEAD_DIM] = qs + kvh * GROUP;
            float (*ah)[HEAD_DIM] = acc + kvh * GROUP;
            float *mh = run_max + kvh * GROUP, *sh = run_sum + kvh * GROUP;
            for (int t = t0; t < t1; t++) {
                const float *k = kb + (t * KV_HEADS + kvh) * HEAD_DIM;
                for (int g = 0; g < GROUP; g++) {
                    float s = 0.f;
                    for (int d = 0; d < HEAD_DIM; d++) s += qh[g][d] * k[d];
                    p[g][t] = s;
                }
            }
            for (int g = 0; g < GROUP; g++) {
                float m = mh[g];
                for (int t = t0; t < t1; t++) m = p[g][t] > m ? p[g][t] : m;
                float rescale = expf(mh[g] - m), sum = 0.f;
                for (int t = t0; t < t1; t++) {
                    float e = expf(p[g][t] - m);
                    p[g][t] = e;
                    sum += e;
                }
                sh[g] = sh[g] * rescale + sum;
                mh[g] = m;
                for (int d = 0; d < HEAD_DIM; d++) ah[g][d] *= rescale;
            }
            for (int t = t0; t < t1; t++) {
                const float *v = vb + (t * KV_HEADS + kvh) * HEAD_DIM;
                for (int g = 0; g < GROUP; g++) {
                    float w = p[g][t];
                    for (int d = 0; d < HEAD_DIM; d++) ah[g][d] += w * v[d];
                }
            }
        }
    }
    for (int h = h0 * GROUP; h < h1 * GROUP; h++) {
        float inv = 1.f / run_sum[h];
        for (int d = 0; d < HEAD_DIM; d++) out[h * HEAD_DIM + d] = acc[h][d] * inv;
    }
}

/* Returns 0; s + 1 when sequence s has a length its table cannot hold, -(s + 1) when its table
 * names a block outside the pool: checked before anything is read, whatever the tables hold. */
int paged_decode(const float *q, const float *k_pool, const float *v_pool, const int32_t *tables,
                 const int32_t *lens, const float *sinks, float *out, int seqs, int width, int num_blocks,
                 int window, float scale, int threads) {
    for (int s = 0; s < seqs; s++) {
        int len = lens[s];
        if (len < 1 || len > width * BLOCK_SIZE) return s + 1;
        int first = (window > 0 && len > window) ? len - window : 0;
        for (int b = first / BLOCK_SIZE; b * BLOCK_SIZE < len; b++) {
            int32_t block = tables[(int64_t)s * width + b];
            if (block < 0 || block >= num_blocks) return -(s + 1);
        }
    }
    int split = seqs < 2 * threads ? KV_HEADS : 1; /* work items per sequence */
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int item = 0; item < seqs * split; item++) {
        int s = item / split, h0 = split == 1 ? 0 : item % split, h1 = split == 1 ? KV_HEADS : h0 + 1;
        attend(q + (int64_t)s * HEADS * HEAD_DIM, k_pool, v_pool, tables + (int64_t)s * width, lens[s], window,
               sinks, out + (int64_t)s * HEADS * HEAD_DIM, h0, h1, scale);
    }
    return 0;
}
