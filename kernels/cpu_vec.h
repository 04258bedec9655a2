/* What the C reads (cpu_decode.c, cpu_prefill.c) share: 16-lane float vectors (GCC/Clang vector
 * extensions, so one source builds for AVX-512, AVX2 or anything else the compiler targets), a
 * lane-wise select, and an inline exp2.
 *
 * Why an inline exp2 rather than expf: the vectorizer turns expf into calls to the vector math
 * library, and around each call the compiler spills every live vector register (the calling
 * convention saves none); on 2 cores that cost the prefill read 15% of its time. The reads keep
 * their scores in base 2 instead (log2(e) folded into the query scale), so 2^x is all they need. */
#ifndef HF_PAGED_CPU_VEC_H
#define HF_PAGED_CPU_VEC_H

#include <stdint.h>

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16_u __attribute__((vector_size(64), aligned(4))); /* unaligned loads and stores */
typedef int32_t i32x16 __attribute__((vector_size(64)));

#define LOG2E 1.4426950408889634f

/* mask ? a : b, lane by lane (mask lanes are all ones or all zeros, as comparisons give) */
static inline f32x16 select16(i32x16 mask, f32x16 a, f32x16 b) {
    return (f32x16)(((i32x16)a & mask) | ((i32x16)b & ~mask));
}

static inline f32x16 splat16(float x) { return (f32x16){0} + x; }

/* 2^y, lane by lane, for y <= 0; exactly 0 below -126 (no denormals). The exponent comes from the
 * integer nearest y, 2^f for the rest (|f| <= 1/2) from its Taylor polynomial of degree 7, whose
 * error (< 4e-9 relative) is below float rounding. */
static inline f32x16 exp2_nonpos(f32x16 y) {
    i32x16 under = y < -126.f;
    y = select16(under, splat16(-126.f), y);
    i32x16 n = __builtin_convertvector(y - 0.5f, i32x16); /* truncation: ceil(y - 1/2) for y <= 0 */
    f32x16 f = y - __builtin_convertvector(n, f32x16);
    f32x16 r = splat16(1.5252733804059840e-5f); /* ln(2)^k / k!, k = 7 .. 0 */
    r = r * f + 1.5403530393381608e-4f;
    r = r * f + 1.3333558146428443e-3f;
    r = r * f + 9.6181291076284772e-3f;
    r = r * f + 5.5504108664821580e-2f;
    r = r * f + 2.4022650695910071e-1f;
    r = r * f + 6.9314718055994531e-1f;
    r = r * f + 1.f;
    return (f32x16)(((i32x16)r + (n << 23)) & ~under);
}

#endif
