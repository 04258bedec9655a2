/* Paged prefill attention on CPU, float32: the new tokens of each sequence (a whole prompt or a
 * chunk after a past) attend causally over the sequence's blocks where they lie in the pools. Built
 * with cpu_decode.c into one library per layout (cpu_build.py): the macros are compile-time
 * constants.
 *
 *   q       [tokens, KV_HEADS * GROUP, HEAD_DIM]      (contiguous; sequence s owns rows cu_q[s] ..)
 *   k_pool  [blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM]  (contiguous; the new keys already written)
 *   v_pool  like k_pool
 *   tables  [seqs, width] int32, cu_q [seqs + 1] int32, lens [seqs] int32 (context after the
 *           new tokens), sinks [heads] or NULL
 *   out     like q
 *
 * A work item is one tile of TILE_TOK consecutive new tokens of one sequence and one K/V head: its
 * GROUP query heads per token are the rows of one small matrix, so every key and value read from a
 * block serves TILE_TOK * GROUP rows. Per block, CHUNK rows at a time (2 vectors of VW lanes,
 * cpu_vec.h): scores = Q.K^T with the rows in vector lanes (Q packed transposed once per item, each
 * key element broadcast), the causal / window mask only on blocks that cross a row's bounds, an
 * online softmax per row (in base 2, with the inline exp2 of cpu_vec.h), then P.V with the head
 * dimension in vector lanes. Explicit vector types give the compiler the register blocking that
 * plain loops do not get (4x faster measured than the same loops left to the vectorizer); the
 * blocking is sized by REG_VECTORS, the accumulators the target's registers hold. */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_vec.h"

#define PF_HEADS (KV_HEADS * GROUP)
#define PF_KV_STRIDE (KV_HEADS * HEAD_DIM)

#if HEAD_DIM % 4 == 0

#define VR VW /* rows per row vector */
#define VD (HEAD_DIM % VW == 0 ? VW : HEAD_DIM % 8 == 0 ? 8 : 4) /* head-dim lanes per vector */
typedef f32v rowvec;
typedef float dimvec __attribute__((vector_size(VD * 4)));
typedef float dimvec_u __attribute__((vector_size(VD * 4), aligned(4))); /* unaligned loads */

#define TILE_TOK ((64 + GROUP - 1) / GROUP)                       /* new tokens per work item */
#define RV 2                                                      /* row vectors per chunk */
#define CHUNK (RV * VR)                                           /* rows scored together */
#define ROWS ((TILE_TOK * GROUP + CHUNK - 1) / CHUNK * CHUNK)     /* rows of an item, padded */
#define DV (HEAD_DIM / VD)                                        /* vectors per head row */
/* rows per P.V block (a power of two <= CHUNK): PB * DV accumulators, about REG_VECTORS */
#define PB (DV * 16 <= REG_VECTORS ? 16 : DV * 8 <= REG_VECTORS ? 8 : DV * 4 <= REG_VECTORS ? 4 \
            : DV * 2 <= REG_VECTORS ? 2 : 1)
/* keys scored together: TU * RV accumulators, REG_VECTORS */
#define TU_MAX (REG_VECTORS / RV)
#define TU (BLOCK_SIZE % TU_MAX == 0 ? TU_MAX : BLOCK_SIZE % 4 == 0 ? 4 : BLOCK_SIZE % 2 == 0 ? 2 : 1)
#define NEG (-1e30f) /* a masked score (finite: the library is built with -ffast-math) */

typedef struct {
    float m[ROWS], l[ROWS]; /* running maximum and sum of each row */
    int pos[ROWS], lo[ROWS]; /* a row's position and its first visible key */
} row_state;

/* scores[t][j] = q_j . k_t for the CHUNK rows from r0 and the block's keys */
static void chunk_scores(const rowvec (*qt)[ROWS / VR], int r0, const float *restrict kb,
                         rowvec scores[BLOCK_SIZE][RV]) {
    for (int t0 = 0; t0 < BLOCK_SIZE; t0 += TU) {
        rowvec a[TU][RV];
        for (int u = 0; u < TU; u++)
            for (int v = 0; v < RV; v++) a[u][v] = (rowvec){0};
        for (int d = 0; d < HEAD_DIM; d++) {
            rowvec qv[RV];
            for (int v = 0; v < RV; v++) qv[v] = qt[d][r0 / VR + v];
            for (int u = 0; u < TU; u++) {
                float key = kb[(t0 + u) * PF_KV_STRIDE + d];
                for (int v = 0; v < RV; v++) a[u][v] += key * qv[v];
            }
        }
        for (int u = 0; u < TU; u++)
            for (int v = 0; v < RV; v++) scores[t0 + u][v] = a[u][v];
    }
}

/* Masks, turns the scores into weights (online softmax) and adds weights . V to the rows' sums */
static void chunk_update(float p[BLOCK_SIZE][CHUNK], int r0, int key0, int keys, row_state *st,
                         const float *restrict vb, dimvec (*acc)[DV]) {
    int rl = r0 + CHUNK - 1;
    if (key0 + BLOCK_SIZE - 1 > st->pos[r0] || key0 < st->lo[rl])
        for (int t = 0; t < BLOCK_SIZE; t++)
            for (int j = 0; j < CHUNK; j++)
                p[t][j] = key0 + t > st->pos[r0 + j] || key0 + t < st->lo[r0 + j] ? NEG : p[t][j];
    float mx[CHUNK], alpha[CHUNK], sum[CHUNK];
    for (int j = 0; j < CHUNK; j++) mx[j] = st->m[r0 + j];
    for (int t = 0; t < BLOCK_SIZE; t++)
        for (int j = 0; j < CHUNK; j++) mx[j] = p[t][j] > mx[j] ? p[t][j] : mx[j];
    rowvec (*pv)[RV] = (rowvec (*)[RV])p, mxv[RV], sumv[RV];
    for (int v = 0; v < RV; v++) {
        rowvec old = *(const f32v_u *)(st->m + r0 + v * VR);
        mxv[v] = *(const f32v_u *)(mx + v * VR);
        *(f32v_u *)(alpha + v * VR) = exp2_nonpos(old - mxv[v]);
        *(f32v_u *)(st->m + r0 + v * VR) = mxv[v];
        sumv[v] = (rowvec){0};
    }
    for (int t = 0; t < BLOCK_SIZE; t++)
        for (int v = 0; v < RV; v++) { /* masked: weight 0, even for a row that has seen no key yet */
            rowvec e = exp2_nonpos(pv[t][v] - mxv[v]);
            pv[t][v] = select_lanes(pv[t][v] > 0.5f * NEG, e, (rowvec){0});
            sumv[v] += pv[t][v];
        }
    for (int v = 0; v < RV; v++) *(f32v_u *)(sum + v * VR) = sumv[v];
    for (int j = 0; j < CHUNK; j++) st->l[r0 + j] = st->l[r0 + j] * alpha[j] + sum[j];
    for (int p0 = 0; p0 < CHUNK; p0 += PB) {
        dimvec a[PB][DV];
        for (int j = 0; j < PB; j++)
            for (int v = 0; v < DV; v++) a[j][v] = acc[r0 + p0 + j][v] * alpha[p0 + j];
        for (int t = 0; t < keys; t++) { /* keys past the last row's position are never read */
            dimvec value[DV];
            for (int v = 0; v < DV; v++) value[v] = *(const dimvec_u *)(vb + t * PF_KV_STRIDE + v * VD);
            for (int j = 0; j < PB; j++) {
                float w = p[t][p0 + j];
                for (int v = 0; v < DV; v++) a[j][v] += w * value[v];
            }
        }
        for (int j = 0; j < PB; j++)
            for (int v = 0; v < DV; v++) acc[r0 + p0 + j][v] = a[j][v];
    }
}

/* One work item: tokens first_pos .. first_pos + ntok - 1 of a sequence, K/V head kvh */
static void attend_tile(const float *restrict q, const float *restrict k_pool, const float *restrict v_pool,
                        const int32_t *restrict table, int first_pos, int ntok, int kvh, int window,
                        const float *restrict sinks, float scale, float *restrict out) {
    rowvec qt[HEAD_DIM][ROWS / VR];
    float scale2 = scale * LOG2E; /* scores in base 2 (cpu_vec.h) */
    dimvec acc[ROWS][DV];
    row_state st;
    for (int r = 0; r < ROWS; r++) { /* rows past ntok * GROUP are padding: computed, never written */
        int i = r / GROUP, h = kvh * GROUP + r % GROUP, live = i < ntok;
        st.pos[r] = first_pos + (live ? i : ntok - 1);
        st.lo[r] = window > 0 && st.pos[r] >= window ? st.pos[r] - window + 1 : 0;
        st.m[r] = sinks ? sinks[h] * LOG2E : NEG; /* a sink is one more logit whose value is zero */
        st.l[r] = sinks ? 1.f : 0.f;
        for (int d = 0; d < HEAD_DIM; d++)
            ((float *)qt[d])[r] = live ? q[(int64_t)i * PF_HEADS * HEAD_DIM + h * HEAD_DIM + d] * scale2 : 0.f;
        for (int v = 0; v < DV; v++) acc[r][v] = (dimvec){0};
    }
    int rows = ntok * GROUP, last = st.pos[rows - 1];
    for (int b = st.lo[0] / BLOCK_SIZE; b * BLOCK_SIZE <= last; b++) {
        int key0 = b * BLOCK_SIZE;
        int64_t base = (int64_t)table[b] * BLOCK_SIZE * PF_KV_STRIDE + kvh * HEAD_DIM;
        for (int r0 = 0; r0 < rows; r0 += CHUNK) {
            int top = st.pos[r0 + CHUNK - 1]; /* the chunk's last position (padding repeats the tile's) */
            if (top < key0 || st.lo[r0] > key0 + BLOCK_SIZE - 1)
                continue; /* every key of the block is outside every row's view */
            rowvec scores[BLOCK_SIZE][RV];
            chunk_scores(qt, r0, k_pool + base, scores);
            int keys = top - key0 + 1 < BLOCK_SIZE ? top - key0 + 1 : BLOCK_SIZE;
            chunk_update((float (*)[CHUNK])scores, r0, key0, keys, &st, v_pool + base, acc);
        }
    }
    for (int r = 0; r < rows; r++) {
        float *o = out + (int64_t)(r / GROUP) * PF_HEADS * HEAD_DIM + (kvh * GROUP + r % GROUP) * HEAD_DIM;
        float inv = 1.f / st.l[r];
        for (int v = 0; v < DV; v++) *(dimvec_u *)(o + v * VD) = acc[r][v] * inv;
    }
}

typedef struct {
    int seq, tile, cost;
} work_item;

static int by_cost_descending(const void *a, const void *b) {
    return ((const work_item *)b)->cost - ((const work_item *)a)->cost;
}

#endif /* HEAD_DIM % 4 == 0 */

/* Returns 0; s + 1 when sequence s has more new tokens than context or a context its table cannot
 * hold, -(s + 1) when its table names a block outside the pool among those it reads; INT32_MIN when
 * this layout has no prefill read (HEAD_DIM not a multiple of 4). Checked before anything is read. */
int paged_prefill(const float *q, const float *k_pool, const float *v_pool, const int32_t *tables,
                  const int32_t *cu_q, const int32_t *lens, const float *sinks, float *out, int seqs, int width,
                  int num_blocks, int window, float scale, int threads) {
#if HEAD_DIM % 4 == 0
    int total = 0;
    for (int s = 0; s < seqs; s++) {
        int n = cu_q[s + 1] - cu_q[s], len = lens[s];
        if (n < 0 || len < n || len > width * BLOCK_SIZE) return s + 1;
        if (n == 0) continue;
        int first = window > 0 && len - n >= window ? len - n - window + 1 : 0;
        for (int b = first / BLOCK_SIZE; b * BLOCK_SIZE < len; b++) {
            int32_t block = tables[(int64_t)s * width + b];
            if (block < 0 || block >= num_blocks) return -(s + 1);
        }
        total += (n + TILE_TOK - 1) / TILE_TOK;
    }
    if (total == 0) return 0;
    work_item *items = malloc(sizeof(work_item) * total);
    if (items == NULL) return INT32_MIN + 1;
    int count = 0;
    for (int s = 0; s < seqs; s++) {
        int n = cu_q[s + 1] - cu_q[s];
        for (int tile = 0; tile * TILE_TOK < n; tile++) {
            int top = lens[s] - n + (tile + 1) * TILE_TOK; /* keys the tile's last row sees */
            items[count++] = (work_item){s, tile, window > 0 && top > window ? window : top};
        }
    }
    qsort(items, total, sizeof(work_item), by_cost_descending); /* longest first: dynamic scheduling balances */
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int item = 0; item < total * KV_HEADS; item++) {
        work_item w = items[item / KV_HEADS];
        int n = cu_q[w.seq + 1] - cu_q[w.seq], tok0 = w.tile * TILE_TOK;
        int64_t row = cu_q[w.seq] + tok0;
        attend_tile(q + row * PF_HEADS * HEAD_DIM, k_pool, v_pool, tables + (int64_t)w.seq * width,
                    lens[w.seq] - n + tok0, n - tok0 < TILE_TOK ? n - tok0 : TILE_TOK, item % KV_HEADS, window,
                    sinks, scale, out + row * PF_HEADS * HEAD_DIM);
    }
    free(items);
    return 0;
#else
    return INT32_MIN;
#endif
}
