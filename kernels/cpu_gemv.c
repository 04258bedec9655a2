/* Linear products of a few rows on CPU, float32: y[rows, out] = x[rows, in] @ w[out, in]^T (+ bias),
 * for 1 to MAX_ROWS rows, the weight in nn.Linear's own row-major layout (no packed copy). Built by
 * cpu_gemv.py (through cpu_build.py) for the target CPU.
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
 * torch.sum (2026-12-07; three runs, medians of 15 calls), the issue-22 model's 32,000-wide head
 * at one row took 0.8-2.3 ms with 4 rows side by side against 0.34-1.04 ms a row at a time; its
 * 28 layer products and head 2.4-3.7 ms against 0.9-1.9 (one row), 2.8-3.3 against 1.6-1.8 (four),
 * 3.1-4.0 against 2.8-3.5 (eight). The bits are the same (the order of each sum is).
 *
 * Each output is summed in one order whatever the row count or thread count (lane-wise over the
 * input in VW-float steps, then across the lanes, then the tail): a row's result does not depend
 * on the rows beside it or on the threads. */
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "cpu_vec.h"

#define MAX_ROWS 8
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

/* ---- Helper threads of our own, for steps whose OpenMP threads sleep between regions ----
 *
 * Under passive OpenMP waits (a server's engine process beside the server and its clients) every
 * region first wakes its sleeping threads (~50 us each), so the engine runs the small steps of a
 * few sequences on one thread (hf_paged/engine/step_threads.py), their products too. Here the
 * caller splits a product into chunks of CHUNK_OUTPUTS output rows that it and the helpers take
 * in turn from one counter: a helper that is asleep delays nothing (the caller takes the chunks it
 * does not), and after each product a helper spins up to SPIN_NS for the next one (a step's
 * products come tens of microseconds apart) before it sleeps, so it wakes once per step, not once
 * per product. Which thread computes an output does not change it (dot_rows sums each output
 * alone), so the bits are those of linear_rows.
 *
 * The counter holds the product's number, its chunk count and the next chunk in one 64-bit word:
 * a helper takes a chunk by compare-and-swap on that word, so it can never take a chunk of one
 * product while reading the sizes of another; the caller returns when every chunk is done. One
 * product at a time in a process: a second caller meanwhile (another thread) runs alone. */

#define POOL_MAX_HELPERS 15
#define CHUNK_OUTPUTS 64
#define SPIN_NS 300000L       /* how long a helper waits for the next product before it sleeps */
#define SPIN_ALONE_NS 20000L  /* of which the first part spinning only; then yielding the core between looks */

#define TICKET(id, chunks, next) (((uint64_t)(id) << 40) | ((uint64_t)(chunks) << 20) | (uint64_t)(next))
#define TICKET_ID(t) ((uint32_t)((t) >> 40))
#define TICKET_CHUNKS(t) ((int)(((t) >> 20) & 0xFFFFF))
#define TICKET_NEXT(t) ((int)((t) & 0xFFFFF))

static struct {
    const float *x, *w, *bias;
    float *y;
    int rows, in, out;
} job;
static _Atomic uint64_t ticket;  /* TICKET(id, chunks, next) of the latest product */
static atomic_int done_chunks, sleepers, started;
static atomic_long helper_chunks;  /* chunks the helpers computed, for the tests */
static pthread_mutex_t caller_lock = PTHREAD_MUTEX_INITIALIZER, sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void run_chunk(int chunk) {
    int o0 = chunk * CHUNK_OUTPUTS, o1 = o0 + CHUNK_OUTPUTS < job.out ? o0 + CHUNK_OUTPUTS : job.out;
    span_rows(job.x, job.w, job.bias, job.y, job.in, job.out, o0, o1, job.rows);
}

/* Take and compute chunks of product `id` while it has some left; returns how many this thread took. */
static long take_chunks(uint32_t id) {
    long taken = 0;
    uint64_t t = atomic_load_explicit(&ticket, memory_order_acquire);
    while (TICKET_ID(t) == id && TICKET_NEXT(t) < TICKET_CHUNKS(t)) {
        if (atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel, memory_order_acquire)) {
            run_chunk(TICKET_NEXT(t));
            atomic_fetch_add_explicit(&done_chunks, 1, memory_order_release);
            taken++;
            t = atomic_load_explicit(&ticket, memory_order_acquire);
        }
    }
    return taken;
}

static void *helper_main(void *unused) {
    (void)unused;
    uint32_t seen = TICKET_ID(atomic_load(&ticket));
    for (;;) {
        long since = now_ns();
        for (long spins = 0; TICKET_ID(atomic_load_explicit(&ticket, memory_order_acquire)) == seen; spins++) {
            cpu_relax();
            if (spins % 64 == 0) {
                long waited = now_ns() - since;
                if (waited > SPIN_NS) {
                    pthread_mutex_lock(&sleep_lock);
                    atomic_fetch_add(&sleepers, 1);  /* seq_cst: the caller's store of the ticket and its
                                                        look at sleepers cannot both miss this */
                    while (TICKET_ID(atomic_load(&ticket)) == seen) pthread_cond_wait(&wake, &sleep_lock);
                    atomic_fetch_sub(&sleepers, 1);
                    pthread_mutex_unlock(&sleep_lock);
                } else if (waited > SPIN_ALONE_NS) {
                    sched_yield();  /* the server's threads may want this core */
                }
            }
        }
        seen = TICKET_ID(atomic_load_explicit(&ticket, memory_order_acquire));
        long taken = take_chunks(seen);
        if (taken) atomic_fetch_add_explicit(&helper_chunks, taken, memory_order_relaxed);
    }
    return NULL;
}

static void forget_helpers(void) { atomic_store(&started, 0); }  /* a forked child has none of them */

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_helpers); }

/* Start helpers until `helpers` run (at most POOL_MAX_HELPERS); called with caller_lock held. */
static void start_helpers(int helpers) {
    pthread_once(&fork_once, register_fork_handler);
    if (helpers > POOL_MAX_HELPERS) helpers = POOL_MAX_HELPERS;
    while (atomic_load(&started) < helpers) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, helper_main, NULL);
        pthread_attr_destroy(&attr);
        if (failed) break;  /* fewer helpers: the caller takes more chunks */
        atomic_fetch_add(&started, 1);
    }
}

/* linear_rows with `helpers` helper threads of this file's own beside the calling thread (0: the
 * caller alone), for callers whose OpenMP threads wait passively. Returns 1 (nothing written) for
 * rows outside 1 .. MAX_ROWS. */
int linear_rows_pooled(const float *x, const float *w, const float *bias, float *y, int rows, int in, int out,
                       int helpers) {
    if (rows < 1 || rows > MAX_ROWS) return 1;
    int chunks = (out + CHUNK_OUTPUTS - 1) / CHUNK_OUTPUTS;
    if (helpers < 1 || chunks < 2 || chunks > 0xFFFFF || pthread_mutex_trylock(&caller_lock)) {
        span_rows(x, w, bias, y, in, out, 0, out, rows);
        return 0;
    }
    start_helpers(helpers);
    job.x = x, job.w = w, job.bias = bias, job.y = y, job.rows = rows, job.in = in, job.out = out;
    atomic_store_explicit(&done_chunks, 0, memory_order_relaxed);
    uint32_t id = (TICKET_ID(atomic_load(&ticket)) + 1) & 0xFFFFFF;
    atomic_store(&ticket, TICKET(id, chunks, 0));  /* seq_cst: publishes job, then the look at sleepers */
    if (atomic_load(&sleepers)) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    take_chunks(id);
    while (atomic_load_explicit(&done_chunks, memory_order_acquire) < chunks) cpu_relax();
    pthread_mutex_unlock(&caller_lock);
    return 0;
}

/* Chunks the helpers have computed in this process (what the tests watch). */
long pool_helper_chunks(void) { return atomic_load(&helper_chunks); }
