/* What the C kernels (cpu_decode.c, cpu_prefill.c, cpu_gemv.c) share: float vectors of VW lanes (GCC/Clang
 * vector extensions), a lane-wise select, a prefetch, and an inline exp2.
 *
 * VW follows the registers the compiler targets: 16 lanes (512 bits) with AVX-512, whose 32 vector
 * registers the reads' register blocking is sized for, else 8. Vectors wider than the registers
 * cost far more than two instructions each: built for AVX2 with 16 lanes, the prefill read took
 * 38x and the decode read 12x as long as with 8 (an AMD EPYC built with -march=x86-64-v3, 2 cores):
 * every accumulator block spilled, and the 16-lane shuffles of the decode fold cross registers.
 * The reads size their blocking by VW (REG_VECTORS: accumulators that stay in registers).
 *
 * Why an inline exp2 rather than expf: the vectorizer turns expf into calls to the vector math
 * library, and around each call the compiler spills every live vector register (the calling
 * convention saves none); on 2 cores that cost the prefill read 15% of its time. The reads keep
 * their scores in base 2 instead (log2(e) folded into the query scale), so 2^x is all they need. */
#ifndef HF_PAGED_CPU_VEC_H
#define HF_PAGED_CPU_VEC_H

#include <stdint.h>

#if defined(__AVX512F__)
#define VW 16
#define REG_VECTORS 16 /* of 32 registers: the rest hold operands */
#else
#define VW 8
#define REG_VECTORS 8 /* AVX2 has 16 registers (a vector of 8 floats fills one) */
#endif

typedef float f32v __attribute__((vector_size(VW * 4)));
typedef float f32v_u __attribute__((vector_size(VW * 4), aligned(4))); /* unaligned loads and stores */
typedef int32_t i32v __attribute__((vector_size(VW * 4)));

#define LOG2E 1.4426950408889634f

#if defined(__x86_64__) || defined(__i386__)
/* Prefetches a cache line with an instruction of its own: GCC's vectorizer drops __builtin_prefetch
 * from the loops it vectorizes (0 prefetches in the object, seen with objdump) */
#define PREFETCH_LINE(p) __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(p)))
#else
#define PREFETCH_LINE(p) __builtin_prefetch((p), 0, 3)
#endif

/* mask ? a : b, lane by lane (mask lanes are all ones or all zeros, as comparisons give) */
static inline f32v select_lanes(i32v mask, f32v a, f32v b) {
    return (f32v)(((i32v)a & mask) | ((i32v)b & ~mask));
}

static inline f32v splat(float x) { return (f32v){0} + x; }

/* 2^y, lane by lane, for y <= 0; exactly 0 below -126 (no denormals). The exponent comes from the
 * integer nearest y, 2^f for the rest (|f| <= 1/2) from its Taylor polynomial of degree 7, whose
 * error (< 4e-9 relative) is below float rounding. */
static inline f32v exp2_nonpos(f32v y) {
    i32v under = y < -126.f;
    y = select_lanes(under, splat(-126.f), y);
    i32v n = __builtin_convertvector(y - 0.5f, i32v); /* truncation: ceil(y - 1/2) for y <= 0 */
    f32v f = y - __builtin_convertvector(n, f32v);
    f32v r = splat(1.5252733804059840e-5f); /* ln(2)^k / k!, k = 7 .. 0 */
    r = r * f + 1.5403530393381608e-4f;
    r = r * f + 1.3333558146428443e-3f;
    r = r * f + 9.6181291076284772e-3f;
    r = r * f + 5.5504108664821580e-2f;
    r = r * f + 2.4022650695910071e-1f;
    r = r * f + 6.9314718055994531e-1f;
    r = r * f + 1.f;
    return (f32v)(((i32v)r + (n << 23)) & ~under);
}

#endif
