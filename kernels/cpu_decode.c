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
 * head). Softmax runs online, a block (or VW keys, on the fast path) at a time: a running maximum
 * and sum per query head. */
#include <math.h>
#include <stdint.h>

#include "cpu_vec.h"

#define HEADS (KV_HEADS * GROUP)

#if HEAD_DIM % VW == 0 && BLOCK_SIZE % VW == 0
/* Head dims and blocks of multiples of VW (16 lanes with AVX-512, else 8; cpu_vec.h): keys VW at a
 * time, all their K/V heads together. Each key's products with a query head are summed across the
 * head dimension in vector lanes, then the VW keys' partial sums are folded together (a transposing
 * tree of shuffles) into one vector of VW scores, keys in lanes, so no dot product ends in a
 * horizontal sum of its own and the softmax runs on whole vectors (in base 2, for the inline exp2
 * of cpu_vec.h). The weighted values of the same keys follow at once, accumulated in registers: keys and values stream from memory
 * together, a few rows at a time, which keeps the hardware prefetcher ahead (a version that scored
 * 128 keys before weighing their values was 1.3x slower with the pools in DRAM). A running maximum
 * that grows rescales the sums so far. Keys past the sequence's length in its last VW are read
 * (inside its last block) and weigh 0; values past it are never read.
 * On 2 cores, 32 sequences of ~1,050 tokens, blocks of 16 (ms per call, these / the plain loops
 * below; 16 lanes): in cache 0.31 / 0.47, pools in DRAM in table order 0.51 / 0.71, scattered
 * 1.30 / 1.53 (an earlier VM, before the prefetch below). */
#define DVW (HEAD_DIM / VW)
/* The keys and values of the next VW keys are prefetched while these are read (through the block
 * table where they start the next block), so the reads stream from memory at about the speed the
 * arithmetic takes them: the hardware prefetcher neither reads a block table nor crosses a 4 KiB
 * page (a block of 16 here is a page of its own), so without this every block started cold,
 * consecutive in the pool or not. On 2 cores (an AMD EPYC with AVX-512, 2026-12-07), 32 sequences
 * of 1,100 tokens, 4 layers' pools in DRAM, ms per layer with / without, blocks of 16: in table
 * order 0.42 / 0.82, prompts in order with their decode blocks interleaved 0.45 / 0.80, random
 * 0.84 / 0.98; in cache 0.31 / 0.40; blocks of 32: 0.43 / 0.76, 0.44 / 0.81, 0.91 / 0.95.
 * Prefetching further ahead (2 or 3 steps, or a whole block at a block's start) gained less. (An
 * earlier session measured whole-block prefetches slower, on another VM, written with
 * __builtin_prefetch in a loop: possibly dropped by the vectorizer, see PREFETCH_LINE.) */
static inline void prefetch_next_keys(const float *k_pool, const float *v_pool, const int32_t *table, int key0,
                                      int len, int h0, int h1) {
    int next = key0 + VW; /* VW divides BLOCK_SIZE: the next VW keys lie in one block */
    if (next >= len) return;
    int64_t at = (int64_t)table[next / BLOCK_SIZE] * (BLOCK_SIZE * KV_HEADS * HEAD_DIM)
                 + (next % BLOCK_SIZE) * KV_HEADS * HEAD_DIM + h0 * HEAD_DIM;
    for (int u = 0; u < VW; u++)
        for (int f = 0; f < (h1 - h0) * HEAD_DIM; f += 16) { /* a cache line: 16 floats */
            PREFETCH_LINE(k_pool + at + u * KV_HEADS * HEAD_DIM + f);
            PREFETCH_LINE(v_pool + at + u * KV_HEADS * HEAD_DIM + f);
        }
}

/* lane u of the result = the sum of p[u]'s lanes: each level adds the two halves of every partial
 * sum, packing two keys' halves into one vector, until one lane per key is left */
static inline f32v fold_keys(f32v p[VW]) {
#if VW == 16
    const i32v l1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i32v l1b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i32v l2a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const i32v l2b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const i32v l3a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const i32v l3b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const i32v l4a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const i32v l4b = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    f32v a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: key 2i's halves added, 8-15: key 2i + 1's */
        a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], l1a) + __builtin_shuffle(p[2 * i], p[2 * i + 1], l1b);
    for (int i = 0; i < 4; i++) /* 4 lanes per key: keys 4i .. 4i + 3 */
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], l2a) + __builtin_shuffle(a[2 * i], a[2 * i + 1], l2b);
    for (int i = 0; i < 2; i++) /* 2 lanes per key: keys 8i .. 8i + 7 */
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], l3a) + __builtin_shuffle(b[2 * i], b[2 * i + 1], l3b);
    return __builtin_shuffle(c[0], c[1], l4a) + __builtin_shuffle(c[0], c[1], l4b);
#else /* 8 lanes: shuffles that AVX2 does in one or two instructions (within 128-bit halves after the
       * first level), which leave key j in lane rev(j), rev reversing j's 3 bits; the keys enter in
       * that order (rev is its own inverse), so they leave in theirs */
    const i32v l1a = {0, 1, 2, 3, 8, 9, 10, 11}, l1b = {4, 5, 6, 7, 12, 13, 14, 15};
    const i32v l2a = {0, 1, 8, 9, 4, 5, 12, 13}, l2b = {2, 3, 10, 11, 6, 7, 14, 15};
    const i32v l3a = {0, 8, 2, 10, 4, 12, 6, 14}, l3b = {1, 9, 3, 11, 5, 13, 7, 15};
    static const int rev[8] = {0, 4, 2, 6, 1, 5, 3, 7};
    f32v a[4], b[2];
    for (int i = 0; i < 4; i++) /* lanes 0-3: the halves of key rev(2i) added, 4-7: key rev(2i + 1)'s */
        a[i] = __builtin_shuffle(p[rev[2 * i]], p[rev[2 * i + 1]], l1a)
               + __builtin_shuffle(p[rev[2 * i]], p[rev[2 * i + 1]], l1b);
    for (int i = 0; i < 2; i++) /* 2 lanes per key */
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], l2a) + __builtin_shuffle(a[2 * i], a[2 * i + 1], l2b);
    return __builtin_shuffle(b[0], b[1], l3a) + __builtin_shuffle(b[0], b[1], l3b);
#endif
}

static float hmax(f32v x) {
    float m = x[0];
    for (int i = 1; i < VW; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static void attend(const float *restrict q, const float *restrict k_pool, const float *restrict v_pool,
                   const int32_t *restrict table, int len, int window, const float *restrict sinks,
                   float *restrict out, int h0, int h1, float scale) {
    f32v qs[HEADS][DVW], acc[HEADS][DVW], sums[HEADS], w[HEADS];
    float run_max[HEADS];
    int hl = h0 * GROUP, hh = h1 * GROUP; /* the query heads this item reads for */
    for (int h = hl; h < hh; h++) {
        for (int v = 0; v < DVW; v++) {
            qs[h][v] = *(const f32v_u *)(q + h * HEAD_DIM + VW * v) * (scale * LOG2E);
            acc[h][v] = (f32v){0};
        }
        /* a sink is one more logit whose value vector is zero: it starts the running sum */
        run_max[h] = sinks ? sinks[h] * LOG2E : -1e30f;
        sums[h] = (f32v){sinks ? 1.f : 0.f};
    }
    f32v lane;
    for (int i = 0; i < VW; i++) lane[i] = (float)i;
    int first = (window > 0 && len > window) ? len - window : 0;
    for (int key0 = first / VW * VW; key0 < len; key0 += VW) { /* VW keys (all their K/V heads) at a time */
        int64_t at = (int64_t)table[key0 / BLOCK_SIZE] * (BLOCK_SIZE * KV_HEADS * HEAD_DIM)
                     + (key0 % BLOCK_SIZE) * KV_HEADS * HEAD_DIM;
        const float *kb = k_pool + at, *vb = v_pool + at;
        prefetch_next_keys(k_pool, v_pool, table, key0, len, h0, h1);
        f32v t = lane + (float)key0;
        i32v live = (t >= (float)first) & (t < (float)len); /* keys outside the view: never weighed */
        for (int h = hl; h < hh; h++) {
            f32v part[VW];
            for (int u = 0; u < VW; u++) {
                const float *k = kb + (u * KV_HEADS + h / GROUP) * HEAD_DIM;
                f32v dot = qs[h][0] * *(const f32v_u *)k;
                for (int v = 1; v < DVW; v++) dot += qs[h][v] * *(const f32v_u *)(k + VW * v);
                part[u] = dot;
            }
            f32v scores = select_lanes(live, fold_keys(part), splat(-1e30f));
            float m = hmax(scores);
            if (m > run_max[h]) { /* a new maximum: rescale what was summed so far */
                float rescale = exp2_nonpos(splat(run_max[h] - m))[0];
                for (int v = 0; v < DVW; v++) acc[h][v] *= rescale;
                sums[h] *= rescale;
                run_max[h] = m;
            }
            w[h] = exp2_nonpos(scores - run_max[h]);
            sums[h] += w[h];
        }
        int lo = first > key0 ? first - key0 : 0, hi = len - key0 < VW ? len - key0 : VW;
        for (int kvh = h0; kvh < h1; kvh++) { /* weights . values */
            f32v a[GROUP][DVW];
            for (int g = 0; g < GROUP; g++)
                for (int v = 0; v < DVW; v++) a[g][v] = acc[kvh * GROUP + g][v];
            for (int u = lo; u < hi; u++) {
                const float *vr = vb + (u * KV_HEADS + kvh) * HEAD_DIM;
                for (int g = 0; g < GROUP; g++) {
                    float wt = w[kvh * GROUP + g][u];
                    for (int v = 0; v < DVW; v++) a[g][v] += wt * *(const f32v_u *)(vr + VW * v);
                }
            }
            for (int g = 0; g < GROUP; g++)
                for (int v = 0; v < DVW; v++) acc[kvh * GROUP + g][v] = a[g][v];
        }
    }
    for (int h = hl; h < hh; h++) {
        float total = 0.f;
        for (int i = 0; i < VW; i++) total += sums[h][i];
        for (int v = 0; v < DVW; v++) *(f32v_u *)(out + h * HEAD_DIM + VW * v) = acc[h][v] * (1.f / total);
    }
}
#else /* other layouts: plain loops, left to the vectorizer */

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
        if ((b + 1) * BLOCK_SIZE < len) { /* the next block's rows of these heads (see prefetch_next_keys) */
            int64_t next = (int64_t)table[b + 1] * (BLOCK_SIZE * KV_HEADS * HEAD_DIM) + h0 * HEAD_DIM;
            for (int t = 0; t < BLOCK_SIZE; t++)
                for (int f = 0; f < (h1 - h0) * HEAD_DIM; f += 16) {
                    PREFETCH_LINE(k_pool + next + t * KV_HEADS * HEAD_DIM + f);
                    PREFETCH_LINE(v_pool + next + t * KV_HEADS * HEAD_DIM + f);
                }
        }
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
#endif

/* The float lanes of this build's vectors (cpu_vec.h): 16 for AVX-512, else 8 */
int vector_lanes(void) { return VW; }

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
