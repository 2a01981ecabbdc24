/* The SIMD primer's example (course/04a-simd-primer.md): y = a * x + y over n floats, eight at a time with
 * AVX2 + FMA, the remainder one at a time; then eight floats rounded to fp16 and back with F16C.
 *
 *     cc -O2 -o simd_primer course/examples/simd_primer.c && ./simd_primer
 *
 * No -march flag: the vector function carries its own target attribute, and main asks the CPU at run time
 * whether it has AVX2, FMA and F16C before calling it. -DPRIMER_BROKEN_TAIL leaves the scalar tail out, to
 * see what that mistake looks like. */
#include <stdio.h>
#include <stdlib.h>

/* The reference: one element at a time. */
static void saxpy_scalar(float a, const float *x, float *y, long begin, long end) {
    for (long i = begin; i < end; i++) y[i] = a * x[i] + y[i];
}

#if defined(__x86_64__)
#include <immintrin.h>
#define PRIMER_AVX2 __attribute__((target("avx2,fma,f16c")))

PRIMER_AVX2 static void saxpy_avx2(float a, const float *x, float *y, long n) {
    const __m256 av = _mm256_set1_ps(a); /* a in all eight lanes */
    long i = 0;
    for (; i + 8 <= n; i += 8) {          /* only while eight elements are left */
        __m256 xv = _mm256_loadu_ps(x + i); /* loadu: x + i need not be 32-byte aligned */
        __m256 yv = _mm256_loadu_ps(y + i);
        yv = _mm256_fmadd_ps(av, xv, yv);   /* a * x + y, rounded once */
        _mm256_storeu_ps(y + i, yv);
    }
#ifndef PRIMER_BROKEN_TAIL
    saxpy_scalar(a, x, y, i, n); /* the tail: the n % 8 elements the loop did not reach */
#endif
}

PRIMER_AVX2 static void fp16_round_trip(const float *in, unsigned short *half, float *back) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in), _MM_FROUND_TO_NEAREST_INT); /* 8 floats -> 8 halves */
    _mm_storeu_si128((__m128i *)half, h);                                       /* 16 bytes */
    _mm256_storeu_ps(back, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)half)));
}

int main(void) {
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) {
        printf("this CPU has no AVX2/FMA/F16C: nothing to run\n");
        return 0;
    }
    const long lengths[] = {0, 1, 7, 8, 9, 1003};
    int failures = 0;
    for (unsigned k = 0; k < sizeof lengths / sizeof lengths[0]; k++) {
        long n = lengths[k];
        float *x = malloc((n + 1) * sizeof(float)), *y = malloc((n + 1) * sizeof(float));
        float *want = malloc((n + 1) * sizeof(float));
        for (long i = 0; i < n; i++) {
            x[i] = (float)(i % 13) - 6.0f;
            y[i] = want[i] = 0.25f * (float)(i % 7);
        }
        saxpy_scalar(1.5f, x, want, 0, n);
        saxpy_avx2(1.5f, x, y, n);
        long bad = -1;
        /* a * x + y is exact here (small integers and quarters), so FMA's single rounding changes nothing */
        for (long i = 0; i < n && bad < 0; i++)
            if (y[i] != want[i]) bad = i;
        if (bad < 0) {
            printf("saxpy n=%ld: OK\n", n);
        } else {
            printf("saxpy n=%ld: element %ld is %g, want %g\n", n, bad, y[bad], want[bad]);
            failures++;
        }
        free(x), free(y), free(want);
    }
    /* Ties: 1 + 2^-11 is halfway between 1 and the next half (1 + 2^-10), 1 + 3 * 2^-11 halfway between the
     * next two; both go to the neighbour with an even last bit. */
    const float in[8] = {0.1f, 1.0f / 3.0f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, 65504.0f, 70000.0f, 1e-8f, -2.5f};
    unsigned short half[8];
    float back[8];
    fp16_round_trip(in, half, back);
    for (int i = 0; i < 8; i++) printf("fp16: %-12.9g -> 0x%04x -> %.9g\n", in[i], half[i], back[i]);
    return failures ? 1 : 0;
}
#else
int main(void) {
    printf("not an x86-64 CPU: AVX2 and F16C are x86 instructions (on ARM the same ideas are called NEON/SVE)\n");
    return 0;
}
#endif
