/* Greedy picks of float32 logits rows on CPU: each row's first maximum, or -1 for a row that holds a NaN
 * or +inf, or nothing finite at all (every entry -inf): rows the engine fails rather than picks from.
 * Built into the few-row library with cpu_gemv.c (cpu_build.py); called by cpu_argmax.py.
 *
 * Why: a decode step of one sequence spent ~0.15 ms in the eight small torch ops that find a row's
 * non-finite values and its argmax (chunk maxima, their max, a host sync, the argmax inside the
 * first chunk holding the max): each one's dispatch, on caches the step's weights had just
 * flushed. Here a row is two passes over its 128 KB (32,000 entries), in cache after the first.
 *
 * Everything compares float bits as integers, so the answer does not depend on -ffast-math (which
 * the library is built with and which lets the compiler assume there are no NaNs or infinities):
 * key() maps a float's bits to an int32 ordered as the floats are, -0.0 just below +0.0, the NaNs
 * beyond the infinities (positive ones above +inf, negative ones below -inf). The first pass takes
 * the keys' max and min, which tell the bad rows; the second finds the first entry equal to the max
 * as floats are equal (+0.0 and -0.0 alike): torch.argmax's first maximum. */
#include <omp.h>
#include <stdint.h>

#define KEY_POS_INF ((int32_t)0x7f800000)
#define KEY_NEG_INF ((int32_t)0x807fffff) /* key(-inf) */
#define CHUNK 64                          /* the second pass tests this many entries at once */

static inline int32_t key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }

/* the first maximum of one row of n entries (its bits), or -1 (see above) */
static int64_t pick(const int32_t *bits, int64_t n) {
    int32_t hi = INT32_MIN, lo = INT32_MAX;
    for (int64_t i = 0; i < n; i++) {
        int32_t k = key(bits[i]);
        hi = k > hi ? k : hi;
        lo = k < lo ? k : lo;
    }
    if (n == 0 || hi >= KEY_POS_INF || hi == KEY_NEG_INF || lo < KEY_NEG_INF) return -1;
    int32_t target = hi >= 0 ? hi : hi ^ 0x7fffffff; /* the max's own bits */
    int32_t mask = (target & 0x7fffffff) ? -1 : 0x7fffffff; /* a zero max: either sign matches */
    target &= mask;
    for (int64_t c = 0; c < n; c += CHUNK) {
        int64_t end = c + CHUNK < n ? c + CHUNK : n;
        int found = 0;
        for (int64_t i = c; i < end; i++) found |= (bits[i] & mask) == target;
        if (found)
            for (int64_t i = c; i < end; i++)
                if ((bits[i] & mask) == target) return i;
    }
    return -1; /* not reached: the max is one of the entries */
}

/* logits [rows, vocab] contiguous; picks[rows]. Rows are split among the threads. */
void greedy_rows(const float *logits, int64_t *picks, int rows, int64_t vocab, int threads) {
    const int32_t *bits = (const int32_t *)logits;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int r = 0; r < rows; r++) picks[r] = pick(bits + (int64_t)r * vocab, vocab);
}
