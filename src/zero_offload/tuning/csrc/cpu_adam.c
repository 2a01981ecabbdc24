/* The CPU Adam of ZeRO-Offload: one pass over the flat fp32 partition.
 *
 * Per element i, with g read as fp32, fp16 or bf16 and multiplied by grad_scale (1 / loss scale x clip factor):
 *     AdamW:  w *= 1 - lr * weight_decay            Adam (L2):  g += weight_decay * w
 *     m = beta1 * m + (1 - beta1) * g
 *     v = beta2 * v + (1 - beta2) * g * g
 *     w -= (lr / bias_correction1) * m / (sqrt(v) / sqrt(bias_correction2) + eps)
 *     out = w rounded to fp16 or bf16 (nearest even), if an output is given
 *     row_squares[r] = sum of (g * grad_scale)^2 over row r (4096 elements), if asked: the norm without its own pass
 * Each element is read once and written once: 4 (w) + 2..4 (g) + 4 (m) + 4 (v) read, 4 + 4 + 4 + 2 written.
 *
 * Variants: a portable scalar loop, and on x86-64 an AVX2 + FMA + F16C loop (8 floats a step) and an AVX-512
 * loop (16 floats a step; AVX-512F and BW, which every AVX-512 CPU since 2017 has), chosen at run time by what
 * the CPU reports. Per-function target attributes keep the rest of the file portable: no -march=native, so one
 * build runs on any x86-64 and on ARM (scalar only). The scalar loop is the reference the vector loops are
 * tested against; it is compiled with -ffp-contract=off so no FMA sneaks into it.
 *
 * The update moves 28 bytes a parameter (fp32 gradients) and does ~15 flops on them: far below what a core
 * computes in the time memory delivers 28 bytes, so every variant ends at the memory bandwidth. What the vector
 * loops buy is that the arithmetic hides behind the loads; zo_memory_floor below measures that limit.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "cpu_adam.h"

/* Inlined even where the compiler would not: small helpers of the vector loops, and loop bodies specialised by
 * a constant argument. (Without it, GCC 12 compiled the prefetches of fetch_next_block away.) */
#define ZO_INLINE static inline __attribute__((always_inline))

/* Lab 4's stubs call ZO_LAB_NOT_IMPLEMENTED("Lab 4.x: ..."): the update then reports the missing task to
 * Python (zo_adam_update returns -2, zo_missing_lab() names it) instead of silently computing something. */
static const char *missing_lab = NULL;
#define ZO_LAB_NOT_IMPLEMENTED(message) (missing_lab = missing_lab ? missing_lab : (message)) /* the first */
const char *zo_missing_lab(void) { return missing_lab; }

/* ---------------------------------------------------------------------------------------- conversions */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13); /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13); /* normal: rebias 15 -> 127 */
    } else if (mant == 0) {
        bits = sign; /* zero */
    } else {         /* subnormal: value = mant * 2^-24, exact in fp32 */
        float f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static uint16_t float_to_half(float f) { /* round to nearest even, as F16C's vcvtps2ph does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    uint32_t abs = bits & 0x7fffffffu;
    if (abs >= 0x7f800000u) return sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0); /* inf, nan */
    if (abs >= 0x477ff000u) return sign | 0x7c00; /* rounds past 65504: inf */
    if (abs < 0x38800000u) {                       /* below 2^-14: subnormal or zero */
        float scaled;
        memcpy(&scaled, &abs, 4);
        /* In units of 2^-24 (exact: a power of two); nearbyintf rounds to nearest even, as the hardware does. */
        scaled = scaled * 16777216.0f;
        float rounded = nearbyintf(scaled);
        return sign | (uint16_t)rounded;
    }
    uint32_t mant_odd = (abs >> 13) & 1;
    abs += 0xfff + mant_odd; /* round the 13 dropped bits to nearest, ties to even */
    return sign | (uint16_t)(((abs - 0x38000000u) >> 13) & 0x7fff);
}

static float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* keep nan a nan */
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static float load_grad(const void *grad, int dtype, int64_t i) {
    if (dtype == ZO_F16) return half_to_float(((const uint16_t *)grad)[i]);
    if (dtype == ZO_BF16) return bf16_to_float(((const uint16_t *)grad)[i]);
    return ((const float *)grad)[i];
}

static void store_out(void *out, int dtype, int64_t i, float w) {
    if (dtype == ZO_F16) ((uint16_t *)out)[i] = float_to_half(w);
    else if (dtype == ZO_BF16) ((uint16_t *)out)[i] = float_to_bf16(w);
    else ((float *)out)[i] = w;
}

/* ------------------------------------------------------------------------------------------- scalar */
static void adam_scalar(const zo_adam_args *a, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
        float w = a->param[i];
        float g = load_grad(a->grad, a->grad_dtype, i) * a->grad_scale;
        if (a->weight_decay != 0.0f) {
            if (a->adamw) w = w * a->decay;
            else g = g + a->weight_decay * w;
        }
        float m = a->beta1 * a->exp_avg[i] + a->one_minus_beta1 * g;
        float v = a->beta2 * a->exp_avg_sq[i] + a->one_minus_beta2 * (g * g);
        float denom = sqrtf(v) / a->bias_correction2_sqrt + a->eps;
        w = w - a->step_size * (m / denom);
        a->exp_avg[i] = m;
        a->exp_avg_sq[i] = v;
        a->param[i] = w;
        if (a->out != NULL) store_out(a->out, a->out_dtype, i, w);
    }
}

/* The squared norm's share of rows [begin, end) of the gradient, as the update reads it: (g * grad_scale)^2
 * summed in fp32, in order. Every row is summed by one thread in one fixed order, whoever runs it. */
static float squares_scalar(const zo_adam_args *a, int64_t begin, int64_t end) {
    float sum = 0.0f;
    for (int64_t i = begin; i < end; i++) {
        float g = load_grad(a->grad, a->grad_dtype, i) * a->grad_scale;
        sum += g * g;
    }
    return sum;
}

/* ------------------------------------------------------------------------------------- AVX2 + FMA */
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ZO_AVX2 __attribute__((target("avx2,fma,f16c")))

/* The 16-bit copy of the weights (out) goes to the device, not back into this core. A plain store first reads
 * each line it is about to overwrite: 2 bytes a parameter more traffic, an eighth of the int8 step's 16. A
 * streaming store writes the line without reading it. The loops stream where out is 16-bit and element i of it
 * is aligned to the store's `bytes` (torch's buffers are; a slice may not be). Streaming stores are weakly
 * ordered: run_chunk ends with an sfence, so the copy is in memory before another thread reads it. */
static int streams_out(const zo_adam_args *a, int64_t i, int bytes) {
    return a->out != NULL && a->out_dtype != ZO_F32 && (uintptr_t)((uint16_t *)a->out + i) % bytes == 0;
}

/* An int8 block's second pass (encoding its codes) works in L1 and reads no memory, and the hardware prefetcher,
 * which follows the loads, goes quiet with it: memory would idle while it runs. So the loops ask for the next
 * block's bytes themselves, into L2, spread over both passes in proportion to their time: the first pass asks for
 * the weights and gradients (12 of the 16 KB a block reads with fp16 gradients), the second for the codes (4 KB),
 * each encode loop the next block's codes of the moment it encodes. This is element i + ZO_STATE_BLOCK of `array`
 * (elements of `size` bytes): one prefetch a vector, even where it asks for a line already asked for; in L1 the test
 * that would skip it cost more than the prefetch. */
ZO_INLINE void fetch_next_block(const void *array, int64_t i, int size) {
    _mm_prefetch((const char *)array + (i + ZO_STATE_BLOCK) * size, _MM_HINT_T1);
}

ZO_AVX2 static __m256 load8_grad(const void *grad, int dtype, int64_t i) {
    if (dtype == ZO_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)grad + i)));
    if (dtype == ZO_BF16) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)grad + i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    return _mm256_loadu_ps((const float *)grad + i);
}

/* AVX2 has no bf16 instruction: round in integer lanes as float_to_bf16 does, then pack 32 -> 16 bits. */
ZO_AVX2 static __m128i bf16_bits8(__m256 w) {
    __m256i bits = _mm256_castps_si256(w);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)); /* ties go to the even neighbour */
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    __m256i halves = _mm256_blendv_epi8(rounded, quiet, is_nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
}

ZO_AVX2 static void store8_out(void *out, int dtype, int64_t i, __m256 w) {
    if (dtype == ZO_F16) {
        /* BEGIN LAB 4.2: the fp16 weight output with F16C */
        /* Round the 8 floats of w to fp16, nearest even (_mm256_cvtps_ph with _MM_FROUND_TO_NEAREST_INT), and
         * store the 8 halves (16 bytes, maybe unaligned: _mm_storeu_si128) at element i of `out` (uint16_t *). */
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i), _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT));
        /* END LAB 4.2 */
    } else if (dtype == ZO_BF16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i), bf16_bits8(w));
    } else {
        _mm256_storeu_ps((float *)out + i, w);
    }
}

/* store8_out, or a streaming store where `streams` (streams_out): the narrow loops' rounded copy. */
ZO_AVX2 ZO_INLINE void put8_out(void *out, int dtype, int64_t i, __m256 w, int streams) {
    if (!streams) {
        store8_out(out, dtype, i, w);
        return;
    }
    __m128i bits = dtype == ZO_F16 ? _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT) : bf16_bits8(w);
    _mm_stream_si128((__m128i *)((uint16_t *)out + i), bits);
}

ZO_AVX2 static void adam_avx2(const zo_adam_args *a, int64_t begin, int64_t end) {
    const __m256 beta1 = _mm256_set1_ps(a->beta1), beta2 = _mm256_set1_ps(a->beta2);
    const __m256 one_minus_beta1 = _mm256_set1_ps(a->one_minus_beta1);
    const __m256 one_minus_beta2 = _mm256_set1_ps(a->one_minus_beta2);
    const __m256 scale = _mm256_set1_ps(a->grad_scale), eps = _mm256_set1_ps(a->eps);
    const __m256 step_size = _mm256_set1_ps(a->step_size);
    const __m256 bc2_sqrt = _mm256_set1_ps(a->bias_correction2_sqrt);
    const __m256 wd = _mm256_set1_ps(a->weight_decay), decay = _mm256_set1_ps(a->decay);
    const int decays = a->weight_decay != 0.0f;
    int64_t i = begin;
    /* BEGIN LAB 4.1: the AVX2 FMA loop in fp32 */
    /* While 8 elements remain: load w, m, v (_mm256_loadu_ps: pointers need not be aligned) and g
     * (load8_grad, times `scale`); apply the weight decay as the scalar loop does; then
     * m = beta1 * m + (1 - beta1) * g and v = beta2 * v + (1 - beta2) * g * g with _mm256_fmadd_ps,
     * w -= step_size * m / (sqrt(v) / bc2_sqrt + eps) with _mm256_fnmadd_ps; store m, v, w back, and the
     * rounded copy with store8_out when a->out is not NULL. Advance i by 8; leave i at the first element
     * the loop did not do. */
    for (; i + 8 <= end; i += 8) {
        __m256 w = _mm256_loadu_ps(a->param + i);
        __m256 g = _mm256_mul_ps(load8_grad(a->grad, a->grad_dtype, i), scale);
        if (decays) {
            if (a->adamw) w = _mm256_mul_ps(w, decay);
            else g = _mm256_fmadd_ps(wd, w, g);
        }
        __m256 m = _mm256_fmadd_ps(beta1, _mm256_loadu_ps(a->exp_avg + i), _mm256_mul_ps(one_minus_beta1, g));
        __m256 v = _mm256_fmadd_ps(beta2, _mm256_loadu_ps(a->exp_avg_sq + i),
                                   _mm256_mul_ps(one_minus_beta2, _mm256_mul_ps(g, g)));
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
        w = _mm256_fnmadd_ps(step_size, _mm256_div_ps(m, denom), w);
        _mm256_storeu_ps(a->exp_avg + i, m);
        _mm256_storeu_ps(a->exp_avg_sq + i, v);
        _mm256_storeu_ps(a->param + i, w);
        if (a->out != NULL) store8_out(a->out, a->out_dtype, i, w);
    }
    /* END LAB 4.1 */
    /* BEGIN LAB 4.3: the scalar tail */
    /* The loop above stops when fewer than 8 elements are left: update elements i .. end - 1 with the
     * scalar loop (adam_scalar takes a begin and an end), so that any length works. */
    adam_scalar(a, i, end);
    /* END LAB 4.3 */
}

/* Four accumulators of 8 lanes, so that consecutive FMAs do not wait for each other; added up in a fixed order. */
ZO_AVX2 static float squares_avx2(const zo_adam_args *a, int64_t begin, int64_t end) {
    const __m256 scale = _mm256_set1_ps(a->grad_scale);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t i = begin;
    for (; i + 32 <= end; i += 32) {
        __m256 g0 = _mm256_mul_ps(load8_grad(a->grad, a->grad_dtype, i), scale);
        __m256 g1 = _mm256_mul_ps(load8_grad(a->grad, a->grad_dtype, i + 8), scale);
        __m256 g2 = _mm256_mul_ps(load8_grad(a->grad, a->grad_dtype, i + 16), scale);
        __m256 g3 = _mm256_mul_ps(load8_grad(a->grad, a->grad_dtype, i + 24), scale);
        acc0 = _mm256_fmadd_ps(g0, g0, acc0);
        acc1 = _mm256_fmadd_ps(g1, g1, acc1);
        acc2 = _mm256_fmadd_ps(g2, g2, acc2);
        acc3 = _mm256_fmadd_ps(g3, g3, acc3);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    for (int k = 0; k < 8; k++) sum += lanes[k];
    return sum + squares_scalar(a, i, end);
}

/* The same loop on 16 floats. AVX-512F has the fp16 conversions at this width, and AVX-512BW the byte packs
 * that narrow the int8 codes (encode_avx512). bf16 is rounded in integer lanes as on AVX2, 16 at a time, with
 * a mask for the NaNs and vpmovdw to narrow 32 -> 16 bits. (The AVX512_BF16 instruction would do it in one,
 * but it flushes subnormals to zero: not the scalar loop's answer.) */
#define ZO_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))

ZO_AVX512 static __m512 load16_grad(const void *grad, int dtype, int64_t i) {
    if (dtype == ZO_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)grad + i)));
    if (dtype == ZO_BF16) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)grad + i)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    return _mm512_loadu_ps((const float *)grad + i);
}

/* 16 floats rounded to fp16 or bf16 (dtype), nearest even. */
ZO_AVX512 static __m256i half_bits16(int dtype, __m512 w) {
    if (dtype == ZO_F16) return _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT);
    __m512i bits = _mm512_castps_si512(w), high = _mm512_srli_epi32(bits, 16);
    __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    __mmask16 is_nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    __m512i halves = _mm512_mask_or_epi32(rounded, is_nan, high, _mm512_set1_epi32(0x40)); /* quiet NaN */
    return _mm512_cvtepi32_epi16(halves);
}

ZO_AVX512 static void store16_out(void *out, int dtype, int64_t i, __m512 w) {
    if (dtype == ZO_F32) _mm512_storeu_ps((float *)out + i, w);
    else _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), half_bits16(dtype, w));
}

/* store16_out, or a streaming store where `streams` (streams_out). */
ZO_AVX512 ZO_INLINE void put16_out(void *out, int dtype, int64_t i, __m512 w, int streams) {
    if (streams) _mm256_stream_si256((__m256i *)((uint16_t *)out + i), half_bits16(dtype, w));
    else store16_out(out, dtype, i, w);
}

ZO_AVX512 static void adam_avx512(const zo_adam_args *a, int64_t begin, int64_t end) {
    const __m512 beta1 = _mm512_set1_ps(a->beta1), beta2 = _mm512_set1_ps(a->beta2);
    const __m512 one_minus_beta1 = _mm512_set1_ps(a->one_minus_beta1);
    const __m512 one_minus_beta2 = _mm512_set1_ps(a->one_minus_beta2);
    const __m512 scale = _mm512_set1_ps(a->grad_scale), eps = _mm512_set1_ps(a->eps);
    const __m512 step_size = _mm512_set1_ps(a->step_size);
    const __m512 bc2_sqrt = _mm512_set1_ps(a->bias_correction2_sqrt);
    const __m512 wd = _mm512_set1_ps(a->weight_decay), decay = _mm512_set1_ps(a->decay);
    const int decays = a->weight_decay != 0.0f, streams = streams_out(a, begin, 32);
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        __m512 w = _mm512_loadu_ps(a->param + i);
        __m512 g = _mm512_mul_ps(load16_grad(a->grad, a->grad_dtype, i), scale);
        if (decays) {
            if (a->adamw) w = _mm512_mul_ps(w, decay);
            else g = _mm512_fmadd_ps(wd, w, g);
        }
        __m512 m = _mm512_fmadd_ps(beta1, _mm512_loadu_ps(a->exp_avg + i), _mm512_mul_ps(one_minus_beta1, g));
        __m512 v = _mm512_fmadd_ps(beta2, _mm512_loadu_ps(a->exp_avg_sq + i),
                                   _mm512_mul_ps(one_minus_beta2, _mm512_mul_ps(g, g)));
        __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2_sqrt), eps);
        w = _mm512_fnmadd_ps(step_size, _mm512_div_ps(m, denom), w);
        _mm512_storeu_ps(a->exp_avg + i, m);
        _mm512_storeu_ps(a->exp_avg_sq + i, v);
        _mm512_storeu_ps(a->param + i, w);
        if (a->out != NULL) put16_out(a->out, a->out_dtype, i, w, streams);
    }
    adam_avx2(a, i, end); /* up to 15 left: 8 at a time, then the scalar tail */
}

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
static int cpu_has_avx512(void) {
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
#else
static void adam_avx2(const zo_adam_args *a, int64_t begin, int64_t end) { adam_scalar(a, begin, end); }
static float squares_avx2(const zo_adam_args *a, int64_t begin, int64_t end) { return squares_scalar(a, begin, end); }
static void adam_avx512(const zo_adam_args *a, int64_t begin, int64_t end) { adam_scalar(a, begin, end); }
static int cpu_has_avx2(void) { return 0; }
static int cpu_has_avx512(void) { return 0; }
#endif

/* ---------------------------------------------------------------------- moments stored in bf16 or 8 bits */
/* A narrow state is never updated where it lies: each element's m and v are decoded to fp32, updated in fp32,
 * and encoded again. Memory sees only the narrow bytes, so a step moves 20 bytes a parameter with bf16 moments
 * and about 16 with int8, against fp32's 28: the narrow loops are worth having only if they stay as close to
 * memory as the fp32 loop does. That sets their shape: one pass, and as little arithmetic as the codes allow.
 *
 * bf16 is a cut-off fp32: decoding is a shift, encoding the rounding store8_out does. Both fit in registers,
 * so the vector loops decode, update and encode 8 (16) elements at a time in one pass, with no scratch.
 *
 * int8 codes are linear in m (signed, 127 a side) and in sqrt(v) (unsigned, 0..255), not in v: sqrt(v) is on
 * the scale of |m|, so both codes cover the same 1:127 (1:255) range of gradient sizes, where codes of v itself
 * would round every v below 1/510 of the block's largest to zero, and with it the update's denominator to eps.
 * A dynamic (logarithmic) map would reach further down, at the price of a table look-up per element. Each
 * block of ZO_STATE_BLOCK elements (counted from element 0) has one scale per moment: the largest value itself,
 * not largest / 127, which loses bits in a denormal block. A code is x x (127 / largest), rounded to nearest
 * even: one division a block; where 127 / largest is too large for fp32 (a block below ~1e-36), x / largest x
 * 127 instead. The new scale is the block's new largest value, known only once the whole block is updated, so
 * an int8 block takes two passes: the first decodes, updates the weights (read and written once, as in fp32)
 * and keeps the new m and sqrt(v) in a scratch of 2 x 8 KB while it tracks their largest; the second codes the
 * scratch. The scratch stays in the L1 cache: memory still sees each byte once. But the second pass reads no
 * memory, so both passes ask for the next block's bytes ahead of time (fetch_next_block).
 *
 * The scalar loop (narrow_scalar) does all this block by block through fp32 scratch, in the simplest order:
 * it does tuning/state_precision.py's operations bit for bit, and the vector loops are tested against that
 * within one bf16 ulp or one int8 code. */

/* One update of elements [begin, end), by one of the variants. */
typedef void (*zo_kernel)(const zo_adam_args *, int64_t, int64_t);

static const float ZO_M_STEP = 1.0f / 127.0f, ZO_V_STEP = 1.0f / 255.0f; /* a code's share of the scale */

static void from_bf16_scalar(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

static void to_bf16_scalar(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* codes (int8_t when is_signed, else uint8_t codes of sqrt v) -> fp32 m (v), as code x step x scale in that
 * order: the top code's product 127 x (1 / 127) (255 x (1 / 255)) is exactly 1 in fp32, so it decodes to the
 * scale itself, and a block decoded and encoded again keeps its scale and codes bit for bit (a checkpoint
 * loaded into another layout does that). code x (step x scale) would drift by an ulp. */
static void dequantize_scalar(const void *codes, int is_signed, float scale, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (is_signed) {
            dst[i] = (float)((const int8_t *)codes)[i] * ZO_M_STEP * scale;
        } else {
            float root = (float)((const uint8_t *)codes)[i] * ZO_V_STEP * scale;
            dst[i] = root * root;
        }
    }
}

/* Largest |x|; a NaN is passed over (the comparison is false), as the vector max below does. Eight running
 * maxima, not one: each max would wait for the one before it. A max is exact, so the order changes nothing. */
static float absmax_scalar(const float *x, int64_t n) {
    float lanes[8] = {0}, largest = 0.0f;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) lanes[k] = fabsf(x[i + k]) > lanes[k] ? fabsf(x[i + k]) : lanes[k];
    for (; i < n; i++) largest = fabsf(x[i]) > largest ? fabsf(x[i]) : largest;
    for (int k = 0; k < 8; k++) largest = lanes[k] > largest ? lanes[k] : largest;
    return largest;
}

/* One code: x x times (top / scale), or x / scale x top where times is infinite, rounded to nearest even.
 * Adding and taking away 1.5 x 2^23 rounds to nearest even any |r| < 2^22 (here |r| <= 255), inline, where
 * nearbyintf would be a library call per element. The clamp only matters for a NaN (the comparison is false:
 * `low`, as the vector max gives), which no code can stand for, and keeps the conversion defined. */
static float code_of(float x, float scale, float times, float low, float top) {
    float r = isinf(times) ? x / scale * top : x * times;
    r = (r + 12582912.0f) - 12582912.0f;
    r = r > low ? r : low;
    return r < top ? r : top;
}

static void codes_scalar(const float *src, int is_signed, float scale, void *codes, int64_t begin, int64_t n) {
    const float times = (is_signed ? 127.0f : 255.0f) / scale;
    for (int64_t i = begin; i < n; i++) {
        if (is_signed) ((int8_t *)codes)[i] = (int8_t)code_of(src[i], scale, times, -127.0f, 127.0f);
        else ((uint8_t *)codes)[i] = (uint8_t)code_of(src[i], scale, times, 0.0f, 255.0f);
    }
}

static void zero_codes(void *codes, int64_t n) {
    for (int64_t i = 0; i < n; i++) ((uint8_t *)codes)[i] = 0;
}

/* fp32 m (v) -> codes; returns the new scale. Takes sqrt of v in place: the scratch is dead afterwards. */
static float quantize_scalar(float *src, int is_signed, void *codes, int64_t n) {
    if (!is_signed)
        for (int64_t i = 0; i < n; i++) src[i] = sqrtf(src[i]);
    float scale = absmax_scalar(src, n);
    if (scale == 0.0f) { /* a block of zeros: every code 0, and no 0 / 0 */
        zero_codes(codes, n);
        return 0.0f;
    }
    codes_scalar(src, is_signed, scale, codes, 0, n);
    return scale;
}

/* adam_scalar on elements [first, first + n), with their moments in the fp32 scratch m and v. */
static void adam_in_scratch(const zo_adam_args *a, int64_t first, int64_t n, float *m, float *v) {
    const int64_t grad_size = a->grad_dtype == ZO_F32 ? 4 : 2, out_size = a->out_dtype == ZO_F32 ? 4 : 2;
    zo_adam_args block = *a; /* the same update, pointed at the elements and at the scratch */
    block.row_squares = NULL;
    block.exp_avg = m;
    block.exp_avg_sq = v;
    block.state_dtype = ZO_STATE_F32;
    block.param = a->param + first;
    block.grad = (const char *)a->grad + first * grad_size;
    block.out = a->out != NULL ? (char *)a->out + first * out_size : NULL;
    block.n = n;
    adam_scalar(&block, 0, n);
}

/* The reference: block by block, decode into fp32 scratch on the stack, update there, encode. Any begin: the
 * vector loops hand it the few elements after their last full vector. */
static void narrow_scalar(const zo_adam_args *a, int64_t begin, int64_t end) {
    float m[ZO_STATE_BLOCK], v[ZO_STATE_BLOCK];
    const int int8 = a->state_dtype == ZO_STATE_INT8;
    for (int64_t first = begin; first < end;) {
        int64_t index = first / ZO_STATE_BLOCK, last = (index + 1) * ZO_STATE_BLOCK;
        last = last < end ? last : end;
        int64_t n = last - first;
        if (int8) {
            dequantize_scalar((const int8_t *)a->exp_avg_packed + first, 1, a->exp_avg_scale[index], m, n);
            dequantize_scalar((const uint8_t *)a->exp_avg_sq_packed + first, 0, a->exp_avg_sq_scale[index], v, n);
        } else {
            from_bf16_scalar((const uint16_t *)a->exp_avg_packed + first, m, n);
            from_bf16_scalar((const uint16_t *)a->exp_avg_sq_packed + first, v, n);
        }
        adam_in_scratch(a, first, n, m, v);
        if (int8) {
            a->exp_avg_scale[index] = quantize_scalar(m, 1, (int8_t *)a->exp_avg_packed + first, n);
            a->exp_avg_sq_scale[index] = quantize_scalar(v, 0, (uint8_t *)a->exp_avg_sq_packed + first, n);
        } else {
            to_bf16_scalar(m, (uint16_t *)a->exp_avg_packed + first, n);
            to_bf16_scalar(v, (uint16_t *)a->exp_avg_sq_packed + first, n);
        }
        first = last;
    }
}

/* The units an int8 block's first pass keeps the new moments in (int8_pass8): m / m_unit and sqrt(v) / root_unit,
 * with the update's two constants in the same units. The scratch and its largest values are in those units; a
 * code, a ratio to the largest, does not depend on them, and the block's scale is its largest value times the
 * unit (in the block loop). */
typedef struct {
    float m_unit, root_unit;
    float step, eps; /* step_size x sqrt(bc2) and eps x sqrt(bc2), the update's, divided as the units ask */
} zo_units;

/* Units of 1: the moments themselves. The bf16 loops, and the int8 blocks the scalar loop does whole. */
static zo_units plain_units(const zo_adam_args *a) {
    return (zo_units){1.0f, 1.0f, a->step_size * a->bias_correction2_sqrt, a->eps * a->bias_correction2_sqrt};
}

static inline int zero_or_normal(float x) { return x == 0.0f || isnormal(x); }

/* The elements [k, n) of the int8 block at `first` that no vector took: decoded, updated and put in the
 * scratch as the vector loops do (m, and sqrt of v, in `units`), their largest folded into *m_max and
 * *root_max. Units of 1 leave the scalar loop's own values. */
static void int8_tail_scalar(const zo_adam_args *a, const zo_units *units, int64_t first, int64_t k, int64_t n,
                             float *m, float *root, float *m_max, float *root_max) {
    if (k >= n) return;
    const int64_t index = first / ZO_STATE_BLOCK;
    dequantize_scalar((const int8_t *)a->exp_avg_packed + first + k, 1, a->exp_avg_scale[index], m + k, n - k);
    dequantize_scalar((const uint8_t *)a->exp_avg_sq_packed + first + k, 0, a->exp_avg_sq_scale[index], root + k,
                      n - k);
    adam_in_scratch(a, first + k, n - k, m + k, root + k); /* root holds v until the loop below */
    for (int64_t j = k; j < n; j++) {
        m[j] = m[j] / units->m_unit;
        root[j] = sqrtf(root[j]) / units->root_unit;
    }
    float largest = absmax_scalar(m + k, n - k), root_largest = absmax_scalar(root + k, n - k);
    *m_max = largest > *m_max ? largest : *m_max;
    *root_max = root_largest > *root_max ? root_largest : *root_max;
}

/* The vector loops' weights of the new gradient in m and v. Where it is safe they take grad_scale s in,
 * (1 - beta1) s and (1 - beta2) s^2, and the gradient is not scaled first: one multiply a vector fewer.
 * Safe means: no L2 decay (it adds wd x w to the scaled gradient); fp16 gradients, whose squares stay finite
 * (65504^2) where a bf16 or fp32 gradient's square might not before scaling; and both weights normal fp32
 * numbers. Returns whether it folded; otherwise the weights are 1 - beta1 and 1 - beta2. */
static int gradient_weights(const zo_adam_args *a, float *m_weight, float *v_weight) {
    const double s = a->grad_scale;
    *m_weight = (float)(a->one_minus_beta1 * s);
    *v_weight = (float)(a->one_minus_beta2 * s * s);
    const int l2 = a->weight_decay != 0.0f && !a->adamw;
    if (!l2 && a->grad_dtype == ZO_F16 && isnormal(*m_weight) && isnormal(*v_weight)) return 1;
    *m_weight = a->one_minus_beta1;
    *v_weight = a->one_minus_beta2;
    return 0;
}

/* The int8 blocks' units: the gradient's weights, m_weight for m and sqrt(v_weight) for sqrt(v). In them,
 * m_weight x g + beta1 x m is g + (beta1 / m_weight) x m, and v_weight x g^2 + beta2 x v is g^2 + beta2 x v /
 * v_weight: the weights leave the loop for the block's constants (int8_decode_constants), two multiplies a
 * vector fewer. The update is unchanged: step x m / (sqrt(v) + eps) is (step x m_unit / root_unit) x m' /
 * (root' + eps / root_unit). A weight of 0 (a beta of 1) makes every block's constants infinite or NaN, and
 * int8_decode_constants then hands each block to the scalar loop. */
static zo_units int8_units(const zo_adam_args *a) {
    float m_weight, v_weight;
    gradient_weights(a, &m_weight, &v_weight);
    const zo_units plain = plain_units(a);
    const float root_weight = sqrtf(v_weight);
    return (zo_units){m_weight, root_weight, plain.step * (m_weight / root_weight), plain.eps / root_weight};
}

/* The constants an int8 block's vector first pass multiplies its codes by (int8_pass8), in the block's units:
 * beta1 x step x scale / m_unit for m, sqrt(beta2) x step x scale / root_unit for sqrt(v). Returns whether the
 * vector loops may use them:
 *  - both 0 or normal. A subnormal one has lost bits (a thousandth of itself where the moments are ~1e-40), so
 *    such a block goes to the scalar loop, whose decode rounds each product on its own, as the encode leaves it
 *    a block where 127 / scale overflows;
 *  - the old moments at most 2^120 in these units (m, and sqrt(v) squared), where fp32 ends at 2^128. The new
 *    ones add g and g^2, which stay finite wherever the reference's do; a block of moments so large that the
 *    units would push them past fp32 goes to the scalar loop instead. */
typedef struct {
    float m_factor, root_step;
} zo_block_decode;

static inline int int8_decode_constants(const zo_adam_args *a, int64_t index, const zo_units *units,
                                        zo_block_decode *decode) {
    const float m_factor = a->beta1 * (ZO_M_STEP * a->exp_avg_scale[index]) / units->m_unit;
    const float root_step = sqrtf(a->beta2) * (ZO_V_STEP * a->exp_avg_sq_scale[index]) / units->root_unit;
    *decode = (zo_block_decode){m_factor, root_step};
    return zero_or_normal(m_factor) && zero_or_normal(root_step) && m_factor * 127.0f <= 0x1p120f &&
           root_step * 255.0f <= 0x1p60f;
}

#if defined(__x86_64__) || defined(_M_X64)
/* adam_avx2's arithmetic on 8 elements, for the loops that load and store the moments in another format, with
 * fewer operations a vector. Once the moments are narrow, memory waits on these loops' arithmetic, above all on
 * a single core, and a vector division costs as much as the rest of the update on some CPUs (a Zen 3 core does
 * one in ~5 cycles). So the loops share two pieces and do the moments themselves:
 *  - gradient8: the gradient as the moments take it. Its weights may hold grad_scale (gradient_weights).
 *  - step8: step_size x m / (sqrt(v) / sqrt(bc2) + eps) is computed as step x m / (sqrt(v) + eps), with
 *    step = step_size x sqrt(bc2) and eps x sqrt(bc2) once a step (zo_units): one division and one addition.
 *    The quotient may differ by an ulp from the scalar loop's, which moves w by ~1e-7 of its step.
 *  - the bf16 loop's m and v are then adam_avx2's operations (so are their codes, unless the weights hold
 *    grad_scale); int8_pass8 folds its decode and the weights into the block's constants instead. */
typedef struct {
    __m256 beta1, beta2, m_weight, v_weight, scale, eps, step, wd, decay;
    int scales_gradient, decays, adamw;
} zo_hyper8;

ZO_AVX2 static zo_hyper8 hyper8(const zo_adam_args *a, const zo_units *units) {
    float m_weight, v_weight;
    const int folded = gradient_weights(a, &m_weight, &v_weight);
    return (zo_hyper8){_mm256_set1_ps(a->beta1),
                       _mm256_set1_ps(a->beta2),
                       _mm256_set1_ps(m_weight),
                       _mm256_set1_ps(v_weight),
                       _mm256_set1_ps(a->grad_scale),
                       _mm256_set1_ps(units->eps),
                       _mm256_set1_ps(units->step),
                       _mm256_set1_ps(a->weight_decay),
                       _mm256_set1_ps(a->decay),
                       !folded,
                       a->weight_decay != 0.0f,
                       a->adamw};
}

/* The gradient as the moments take it (scaled unless the weights hold the scale, plus L2 decay); AdamW decays
 * *w instead. */
ZO_AVX2 static inline __m256 gradient8(const zo_hyper8 *h, __m256 g, __m256 *w) {
    if (h->scales_gradient) g = _mm256_mul_ps(g, h->scale);
    if (h->decays) {
        if (h->adamw) *w = _mm256_mul_ps(*w, h->decay);
        else g = _mm256_fmadd_ps(h->wd, *w, g);
    }
    return g;
}

/* The new weights from m and root = sqrt(v), in the units the hyper's step and eps are in. */
ZO_AVX2 static inline __m256 step8(const zo_hyper8 *h, __m256 w, __m256 m, __m256 root) {
    return _mm256_fnmadd_ps(h->step, _mm256_div_ps(m, _mm256_add_ps(root, h->eps)), w);
}

/* bf16 moments in one pass: load8_grad and store8_out read and write bf16 whatever the array holds. */
ZO_AVX2 static void bf16_avx2(const zo_adam_args *a, int64_t begin, int64_t end) {
    const zo_units units = plain_units(a);
    const zo_hyper8 h = hyper8(a, &units);
    /* In locals: the stores through float pointers could otherwise alias *a, and every field be read again */
    float *param = a->param;
    const void *grad = a->grad;
    void *out = a->out;
    const int grad_dtype = a->grad_dtype, out_dtype = a->out_dtype;
    uint16_t *m16 = (uint16_t *)a->exp_avg_packed, *v16 = (uint16_t *)a->exp_avg_sq_packed;
    const int streams = streams_out(a, begin, 16);
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 w = _mm256_loadu_ps(param + i);
        __m256 g = gradient8(&h, load8_grad(grad, grad_dtype, i), &w);
        __m256 m = _mm256_fmadd_ps(h.beta1, load8_grad(m16, ZO_BF16, i), _mm256_mul_ps(h.m_weight, g));
        __m256 v = _mm256_fmadd_ps(h.beta2, load8_grad(v16, ZO_BF16, i),
                                   _mm256_mul_ps(h.v_weight, _mm256_mul_ps(g, g)));
        w = step8(&h, w, m, _mm256_sqrt_ps(v));
        store8_out(m16, ZO_BF16, i, m);
        store8_out(v16, ZO_BF16, i, v);
        _mm256_storeu_ps(param + i, w);
        if (out != NULL) put8_out(out, out_dtype, i, w, streams);
    }
    narrow_scalar(a, i, end); /* fewer than 8 left */
}

/* An int8 block's first pass, 8 at a time from element k of the block at `first` while 8 remain: decode, update,
 * write w (and out) for good, and m and sqrt(v) into the scratch, in the block's units (zo_units), tracking the
 * largest of each, while the next block's bytes are fetched. Returns the first element it did not do.
 * The decode and the gradient's weights are folded into the block's constants (`decode`, from
 * int8_decode_constants in the caller), multiplied once a block: in units of the weights, m is
 * (beta1 x step x scale / m_unit) x code + g, inside one FMA, and v is r x r + g x g with r = code x (sqrt(beta2)
 * x step x scale / root_unit). Decoding as dequantize_scalar does, then weighing, takes seven multiplies a vector
 * before those FMAs (two for m, three for v, two for the weights), the fold one: this loop's arithmetic is what
 * memory waits on. The moments may then differ from the scalar loop's by an ulp or two, far below a code; the
 * tests allow the vector loops one code. A block decoded and encoded without an update (a checkpoint changing
 * layout) goes through dequantize_scalar, whose order keeps it bit for bit. */
ZO_AVX2 ZO_INLINE int64_t int8_pass8(const zo_adam_args *a, const zo_hyper8 *hyper, const zo_block_decode *decode,
                                     int64_t first, int64_t k, int64_t n, float *m_new, float *root_new, float *m_max,
                                     float *root_max, const int grad_dtype) {
    const zo_hyper8 h = *hyper;
    /* In locals: the stores through float pointers could otherwise alias *a, and every field be read again */
    float *param = a->param;
    const void *grad = a->grad;
    void *out = a->out;
    const int out_dtype = a->out_dtype;
    const int8_t *m_codes = (const int8_t *)a->exp_avg_packed + first;
    const uint8_t *v_codes = (const uint8_t *)a->exp_avg_sq_packed + first;
    const __m256 m_factor = _mm256_set1_ps(decode->m_factor), root_step = _mm256_set1_ps(decode->root_step);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const int grad_size = grad_dtype == ZO_F32 ? 4 : 2, streams = streams_out(a, first + k, 16);
    __m256 m_top = _mm256_setzero_ps(), root_top = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        const int64_t i = first + k;
        fetch_next_block(param, i, 4);
        fetch_next_block(grad, i, grad_size);
        __m256 m_code = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(m_codes + k))));
        __m256 v_code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(v_codes + k))));
        __m256 r = _mm256_mul_ps(v_code, root_step); /* r x r = beta2 x v / v_weight */
        __m256 w = _mm256_loadu_ps(param + i);
        __m256 g = gradient8(&h, load8_grad(grad, grad_dtype, i), &w);
        __m256 m = _mm256_fmadd_ps(m_factor, m_code, g);
        __m256 root = _mm256_sqrt_ps(_mm256_fmadd_ps(r, r, _mm256_mul_ps(g, g)));
        w = step8(&h, w, m, root);
        _mm256_storeu_ps(m_new + k, m);
        _mm256_storeu_ps(root_new + k, root);
        /* max_ps gives its second operand when one is a NaN: a NaN is passed over, as absmax_scalar does */
        m_top = _mm256_max_ps(_mm256_and_ps(m, magnitude), m_top);
        root_top = _mm256_max_ps(root, root_top); /* a root is >= 0 */
        _mm256_storeu_ps(param + i, w);
        if (out != NULL) put8_out(out, out_dtype, i, w, streams);
    }
    float m_lanes[8], root_lanes[8];
    _mm256_storeu_ps(m_lanes, m_top);
    _mm256_storeu_ps(root_lanes, root_top);
    for (int j = 0; j < 8; j++) {
        *m_max = m_lanes[j] > *m_max ? m_lanes[j] : *m_max;
        *root_max = root_lanes[j] > *root_max ? root_lanes[j] : *root_max;
    }
    return k;
}

/* int8_pass8 with the gradient's dtype a constant in each copy of the loop: checked once a block, where a
 * check every vector cost ~4% of the step (measured in L1). */
ZO_AVX2 static int64_t int8_pass_avx2(const zo_adam_args *a, const zo_hyper8 *hyper, const zo_block_decode *decode,
                                      int64_t first, int64_t k, int64_t n, float *m, float *root, float *m_max,
                                      float *root_max) {
    if (a->grad_dtype == ZO_F16) return int8_pass8(a, hyper, decode, first, k, n, m, root, m_max, root_max, ZO_F16);
    if (a->grad_dtype == ZO_BF16) return int8_pass8(a, hyper, decode, first, k, n, m, root, m_max, root_max, ZO_BF16);
    return int8_pass8(a, hyper, decode, first, k, n, m, root, m_max, root_max, ZO_F32);
}

/* The second pass: codes of src[0, n) against `scale`, its largest |x|; returns the scale. The elements after
 * the last full vector, and all of a block so small that 127 / scale overflows, go to codes_scalar, which
 * rounds alike: every variant codes a given block of fp32 moments alike. */
ZO_AVX2 static float encode_avx2(const float *src, int is_signed, float scale, void *codes, int64_t n) {
    if (scale == 0.0f) { /* a block of zeros: every code 0, and no 0 / 0 */
        zero_codes(codes, n);
        return 0.0f;
    }
    const float times = (is_signed ? 127.0f : 255.0f) / scale;
    const __m256 by = _mm256_set1_ps(times), top = _mm256_set1_ps(is_signed ? 127.0f : 255.0f);
    const __m256 low = _mm256_set1_ps(is_signed ? -127.0f : 0.0f);
    /* 32 at a time, as encode_avx512 does 64 (see there): after the packs, 32-bit lane 4h + t holds codes
     * 4h .. 4h + 3 of vector t, h the 128-bit half; the permute puts it at 2t + h */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t i = 0;
    for (; !isinf(times) && i + 32 <= n; i += 32) {
        __m256i q[4];
        fetch_next_block(codes, i, 1); /* the next block's codes of this moment */
        for (int t = 0; t < 4; t++) q[t] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8 * t), by));
        __m256i bytes;
        if (is_signed) {
            bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            bytes = _mm256_max_epi8(bytes, _mm256_set1_epi8(-127)); /* a NaN's -128 -> -127 */
        } else {
            bytes = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
        }
        _mm256_storeu_si256((__m256i *)((uint8_t *)codes + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    for (; !isinf(times) && i + 8 <= n; i += 8) {
        __m256 r = _mm256_mul_ps(_mm256_loadu_ps(src + i), by);
        /* clamped first (a NaN becomes `low`), then converted: cvtps rounds to nearest even, as code_of does */
        __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, low), top));
        __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        __m128i q16 = is_signed ? _mm_packs_epi32(lo, hi) : _mm_packus_epi32(lo, hi);
        __m128i q8 = is_signed ? _mm_packs_epi16(q16, q16) : _mm_packus_epi16(q16, q16);
        _mm_storel_epi64((__m128i *)((uint8_t *)codes + i), q8);
    }
    codes_scalar(src, is_signed, scale, codes, i, n);
    return scale;
}

ZO_AVX2 static void int8_avx2(const zo_adam_args *a, int64_t begin, int64_t end) {
    float m[ZO_STATE_BLOCK], root[ZO_STATE_BLOCK]; /* the new moments of one block: 16 KB, in L1 */
    const zo_units plain = plain_units(a), units = int8_units(a);
    const zo_hyper8 h = hyper8(a, &units);
    /* Thread chunks start on a block (run_threads), so each block is coded whole by one thread. */
    for (int64_t first = begin; first < end; first += ZO_STATE_BLOCK) {
        const int64_t index = first / ZO_STATE_BLOCK, n = end - first < ZO_STATE_BLOCK ? end - first : ZO_STATE_BLOCK;
        float m_max = 0.0f, root_max = 0.0f;
        zo_block_decode decode;
        const int vector = int8_decode_constants(a, index, &units, &decode);
        const zo_units *kept = vector ? &units : &plain; /* the units of the scratch */
        int64_t k = vector ? int8_pass_avx2(a, &h, &decode, first, 0, n, m, root, &m_max, &root_max) : 0;
        int8_tail_scalar(a, kept, first, k, n, m, root, &m_max, &root_max);
        const float m_scale = encode_avx2(m, 1, m_max, (int8_t *)a->exp_avg_packed + first, n);
        const float root_scale = encode_avx2(root, 0, root_max, (uint8_t *)a->exp_avg_sq_packed + first, n);
        a->exp_avg_scale[index] = m_scale * kept->m_unit;
        a->exp_avg_sq_scale[index] = root_scale * kept->root_unit;
    }
}

static void narrow_avx2(const zo_adam_args *a, int64_t begin, int64_t end) {
    if (a->state_dtype == ZO_STATE_INT8) int8_avx2(a, begin, end);
    else bf16_avx2(a, begin, end);
}

/* The same loops on 16 floats; what is left after the last 16 goes to the 8-wide loops, then to the scalar
 * ones, as adam_avx512 leaves it to adam_avx2. */
typedef struct {
    __m512 beta1, beta2, m_weight, v_weight, scale, eps, step, wd, decay;
    int scales_gradient, decays, adamw;
} zo_hyper16;

ZO_AVX512 static zo_hyper16 hyper16(const zo_adam_args *a, const zo_units *units) {
    float m_weight, v_weight;
    const int folded = gradient_weights(a, &m_weight, &v_weight);
    return (zo_hyper16){_mm512_set1_ps(a->beta1),
                        _mm512_set1_ps(a->beta2),
                        _mm512_set1_ps(m_weight),
                        _mm512_set1_ps(v_weight),
                        _mm512_set1_ps(a->grad_scale),
                        _mm512_set1_ps(units->eps),
                        _mm512_set1_ps(units->step),
                        _mm512_set1_ps(a->weight_decay),
                        _mm512_set1_ps(a->decay),
                        !folded,
                        a->weight_decay != 0.0f,
                        a->adamw};
}

ZO_AVX512 static inline __m512 gradient16(const zo_hyper16 *h, __m512 g, __m512 *w) {
    if (h->scales_gradient) g = _mm512_mul_ps(g, h->scale);
    if (h->decays) {
        if (h->adamw) *w = _mm512_mul_ps(*w, h->decay);
        else g = _mm512_fmadd_ps(h->wd, *w, g);
    }
    return g;
}

ZO_AVX512 static inline __m512 step16(const zo_hyper16 *h, __m512 w, __m512 m, __m512 root) {
    return _mm512_fnmadd_ps(h->step, _mm512_div_ps(m, _mm512_add_ps(root, h->eps)), w);
}

ZO_AVX512 static void bf16_avx512(const zo_adam_args *a, int64_t begin, int64_t end) {
    const zo_units units = plain_units(a);
    const zo_hyper16 h = hyper16(a, &units);
    /* In locals: the stores through float pointers could otherwise alias *a, and every field be read again */
    float *param = a->param;
    const void *grad = a->grad;
    void *out = a->out;
    const int grad_dtype = a->grad_dtype, out_dtype = a->out_dtype;
    uint16_t *m16 = (uint16_t *)a->exp_avg_packed, *v16 = (uint16_t *)a->exp_avg_sq_packed;
    const int streams = streams_out(a, begin, 32);
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        __m512 w = _mm512_loadu_ps(param + i);
        __m512 g = gradient16(&h, load16_grad(grad, grad_dtype, i), &w);
        __m512 m = _mm512_fmadd_ps(h.beta1, load16_grad(m16, ZO_BF16, i), _mm512_mul_ps(h.m_weight, g));
        __m512 v = _mm512_fmadd_ps(h.beta2, load16_grad(v16, ZO_BF16, i),
                                   _mm512_mul_ps(h.v_weight, _mm512_mul_ps(g, g)));
        w = step16(&h, w, m, _mm512_sqrt_ps(v));
        store16_out(m16, ZO_BF16, i, m);
        store16_out(v16, ZO_BF16, i, v);
        _mm512_storeu_ps(param + i, w);
        if (out != NULL) put16_out(out, out_dtype, i, w, streams);
    }
    bf16_avx2(a, i, end);
}

ZO_AVX512 ZO_INLINE int64_t int8_pass16(const zo_adam_args *a, const zo_hyper16 *hyper,
                                        const zo_block_decode *decode, int64_t first, int64_t k, int64_t n,
                                        float *m_new, float *root_new, float *m_max, float *root_max,
                                        const int grad_dtype) {
    const zo_hyper16 h = *hyper;
    /* In locals: the stores through float pointers could otherwise alias *a, and every field be read again */
    float *param = a->param;
    const void *grad = a->grad;
    void *out = a->out;
    const int out_dtype = a->out_dtype;
    const int8_t *m_codes = (const int8_t *)a->exp_avg_packed + first;
    const uint8_t *v_codes = (const uint8_t *)a->exp_avg_sq_packed + first;
    const __m512 m_factor = _mm512_set1_ps(decode->m_factor), root_step = _mm512_set1_ps(decode->root_step);
    const int grad_size = grad_dtype == ZO_F32 ? 4 : 2, streams = streams_out(a, first + k, 32);
    __m512 m_top = _mm512_setzero_ps(), root_top = _mm512_setzero_ps();
    for (; k + 16 <= n; k += 16) {
        const int64_t i = first + k;
        fetch_next_block(param, i, 4);
        fetch_next_block(grad, i, grad_size);
        __m512 m_code = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(m_codes + k))));
        __m512 v_code = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(v_codes + k))));
        __m512 r = _mm512_mul_ps(v_code, root_step); /* r x r = beta2 x v / v_weight */
        __m512 w = _mm512_loadu_ps(param + i);
        __m512 g = gradient16(&h, load16_grad(grad, grad_dtype, i), &w);
        __m512 m = _mm512_fmadd_ps(m_factor, m_code, g);
        __m512 root = _mm512_sqrt_ps(_mm512_fmadd_ps(r, r, _mm512_mul_ps(g, g)));
        w = step16(&h, w, m, root);
        _mm512_storeu_ps(m_new + k, m);
        _mm512_storeu_ps(root_new + k, root);
        m_top = _mm512_max_ps(_mm512_abs_ps(m), m_top); /* a NaN is passed over, as in the AVX2 loop */
        root_top = _mm512_max_ps(root, root_top); /* a root is >= 0 */
        _mm512_storeu_ps(param + i, w);
        if (out != NULL) put16_out(out, out_dtype, i, w, streams);
    }
    float m_lanes[16], root_lanes[16];
    _mm512_storeu_ps(m_lanes, m_top);
    _mm512_storeu_ps(root_lanes, root_top);
    for (int j = 0; j < 16; j++) {
        *m_max = m_lanes[j] > *m_max ? m_lanes[j] : *m_max;
        *root_max = root_lanes[j] > *root_max ? root_lanes[j] : *root_max;
    }
    return k;
}

/* int8_pass16 with the gradient's dtype a constant in each copy of the loop: checked once a block, where a
 * check every vector cost ~4% of the step (measured in L1). */
ZO_AVX512 static int64_t int8_pass_avx512(const zo_adam_args *a, const zo_hyper16 *hyper,
                                          const zo_block_decode *decode, int64_t first, int64_t k, int64_t n,
                                          float *m, float *root, float *m_max, float *root_max) {
    if (a->grad_dtype == ZO_F16) return int8_pass16(a, hyper, decode, first, k, n, m, root, m_max, root_max, ZO_F16);
    if (a->grad_dtype == ZO_BF16) return int8_pass16(a, hyper, decode, first, k, n, m, root, m_max, root_max, ZO_BF16);
    return int8_pass16(a, hyper, decode, first, k, n, m, root, m_max, root_max, ZO_F32);
}

/* encode_avx2 on 64 floats at a time: four vectors of codes in 32-bit lanes are narrowed by two saturating packs
 * (32 -> 16 -> 8 bits, which needs AVX-512BW) and one permute that undoes the packs' interleaving of the 128-bit lanes,
 * where vpmovsdb (two micro-ops on common x86 cores) would narrow each vector on its own. The saturation also stands
 * for the clamp to the top code: a code past it would need |x| > scale. What is left of the clamp is a NaN's: cvtps
 * turns it into INT32_MIN, which the unsigned packs saturate to 0 (code_of's `low`) but the signed ones to -128, so
 * m's 64 codes then take one byte max against -127. */
ZO_AVX512 static float encode_avx512(const float *src, int is_signed, float scale, void *codes, int64_t n) {
    if (scale == 0.0f) {
        zero_codes(codes, n);
        return 0.0f;
    }
    const float times = (is_signed ? 127.0f : 255.0f) / scale;
    const __m512 by = _mm512_set1_ps(times);
    const __m512i lowest = _mm512_set1_epi8(-127);
    /* after the packs, 32-bit lane 4j + t holds codes 4j .. 4j + 3 of vector t: put it at 4t + j */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    int64_t i = 0;
    for (; !isinf(times) && i + 64 <= n; i += 64) {
        __m512i q[4];
        fetch_next_block(codes, i, 1); /* the next block's codes of this moment */
        for (int t = 0; t < 4; t++) /* cvtps rounds to nearest even, as code_of does */
            q[t] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + i + 16 * t), by));
        __m512i bytes;
        if (is_signed) {
            bytes = _mm512_packs_epi16(_mm512_packs_epi32(q[0], q[1]), _mm512_packs_epi32(q[2], q[3]));
            bytes = _mm512_max_epi8(bytes, lowest); /* a NaN's -128 -> -127 */
        } else {
            bytes = _mm512_packus_epi16(_mm512_packus_epi32(q[0], q[1]), _mm512_packus_epi32(q[2], q[3]));
        }
        _mm512_storeu_si512((uint8_t *)codes + i, _mm512_permutexvar_epi32(order, bytes));
    }
    codes_scalar(src, is_signed, scale, codes, i, n); /* the last < 64, or a block where times overflows */
    return scale;
}

ZO_AVX512 static void int8_avx512(const zo_adam_args *a, int64_t begin, int64_t end) {
    float m[ZO_STATE_BLOCK], root[ZO_STATE_BLOCK];
    const zo_units plain = plain_units(a), units = int8_units(a);
    const zo_hyper16 h = hyper16(a, &units);
    const zo_hyper8 h8 = hyper8(a, &units);
    for (int64_t first = begin; first < end; first += ZO_STATE_BLOCK) {
        const int64_t index = first / ZO_STATE_BLOCK, n = end - first < ZO_STATE_BLOCK ? end - first : ZO_STATE_BLOCK;
        float m_max = 0.0f, root_max = 0.0f;
        zo_block_decode decode;
        const int vector = int8_decode_constants(a, index, &units, &decode);
        const zo_units *kept = vector ? &units : &plain;
        int64_t k = 0;
        if (vector) {
            k = int8_pass_avx512(a, &h, &decode, first, 0, n, m, root, &m_max, &root_max);
            k = int8_pass_avx2(a, &h8, &decode, first, k, n, m, root, &m_max, &root_max);
        }
        int8_tail_scalar(a, kept, first, k, n, m, root, &m_max, &root_max);
        const float m_scale = encode_avx512(m, 1, m_max, (int8_t *)a->exp_avg_packed + first, n);
        const float root_scale = encode_avx512(root, 0, root_max, (uint8_t *)a->exp_avg_sq_packed + first, n);
        a->exp_avg_scale[index] = m_scale * kept->m_unit;
        a->exp_avg_sq_scale[index] = root_scale * kept->root_unit;
    }
}

/* The AVX-512 narrow loops are tested against the scalar loop as the AVX2 ones are (on an Intel Xeon with
 * AVX-512). Whether they are faster is the CPU's affair: "variant": "fastest" measures each precision itself. */
static void narrow_avx512(const zo_adam_args *a, int64_t begin, int64_t end) {
    if (a->state_dtype == ZO_STATE_INT8) int8_avx512(a, begin, end);
    else bf16_avx512(a, begin, end);
}
#else
static void narrow_avx2(const zo_adam_args *a, int64_t begin, int64_t end) { narrow_scalar(a, begin, end); }
static void narrow_avx512(const zo_adam_args *a, int64_t begin, int64_t end) { narrow_scalar(a, begin, end); }
#endif

/* ----------------------------------------------------------------------------------- dispatch, threads */
typedef float (*zo_squares)(const zo_adam_args *, int64_t, int64_t);
enum { ZO_MIN_PER_THREAD = 1 << 16 };

int zo_cpu_variants(void) {
    return (1 << ZO_SCALAR) | (cpu_has_avx2() ? 1 << ZO_AVX2_FMA : 0) | (cpu_has_avx512() ? 1 << ZO_AVX512F : 0);
}

typedef struct {
    const zo_adam_args *args;
    zo_kernel kernel;
    zo_squares squares; /* NULL: no row squares wanted */
    int64_t begin, end;
} zo_chunk;

/* After a loop's streaming stores (streams_out, and the memory floor's): they are weakly ordered, and the sfence
 * makes them visible before the thread reports its chunk done. Elsewhere nothing streams. */
static void drain_streams(void) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_sfence();
#endif
}

static void *run_chunk(void *p) {
    zo_chunk *c = (zo_chunk *)p;
    const zo_adam_args *a = c->args;
    if (c->squares == NULL) {
        c->kernel(a, c->begin, c->end);
    } else {
        /* Row by row: its update, then its squares, which find the row's gradient (16 KB of fp32) still in the
         * L1 cache. The other way round the squares would wait for memory alone, with no other stream in flight. */
        for (int64_t row = c->begin; row < c->end; row += ZO_NORM_ROW) {
            int64_t end = row + ZO_NORM_ROW < c->end ? row + ZO_NORM_ROW : c->end;
            c->kernel(a, row, end);
            a->row_squares[row / ZO_NORM_ROW] = c->squares(a, row, end);
        }
    }
    drain_streams();
    return NULL;
}

/* Split [0, n) over `threads` threads, the calling thread included. */
static void run_threads(const zo_adam_args *a, zo_kernel kernel, zo_squares squares, int threads) {
    if (threads > ZO_MAX_THREADS) threads = ZO_MAX_THREADS;
    /* Starting a thread costs tens of microseconds, as much as updating ~32K elements: small tensors (a bias,
     * a layer norm) run on the calling thread alone, and each thread gets at least ZO_MIN_PER_THREAD. */
    if ((int64_t)threads * ZO_MIN_PER_THREAD > a->n) threads = (int)(a->n / ZO_MIN_PER_THREAD);
    /* Chunks are whole multiples of 64 elements (256 bytes of fp32): no two threads share a cache line. With
     * row squares, whole rows: each row is then summed by one thread, and the sums do not depend on threads.
     * With narrow moments, whole blocks: an int8 block is coded by one thread, and neither state's results
     * depend on threads (a row is two blocks). */
    int64_t align = squares != NULL ? ZO_NORM_ROW : a->state_dtype != ZO_STATE_F32 ? ZO_STATE_BLOCK : 64;
    int64_t per = ((a->n + threads - 1) / (threads > 0 ? threads : 1) + align - 1) / align * align;
    if (threads <= 1 || per >= a->n) {
        zo_chunk whole = {a, kernel, squares, 0, a->n};
        run_chunk(&whole);
        return;
    }
    pthread_t ids[ZO_MAX_THREADS];
    int running[ZO_MAX_THREADS] = {0};
    zo_chunk chunks[ZO_MAX_THREADS];
    int started = 0;
    for (int t = 0; t < threads && (int64_t)t * per < a->n; t++) {
        int64_t end = (int64_t)(t + 1) * per < a->n ? (int64_t)(t + 1) * per : a->n;
        chunks[t] = (zo_chunk){a, kernel, squares, (int64_t)t * per, end};
        if (t == 0) continue; /* the calling thread takes the first chunk itself */
        running[t] = pthread_create(&ids[t], NULL, run_chunk, &chunks[t]) == 0;
        if (!running[t]) run_chunk(&chunks[t]); /* no thread to be had: do it here, the result is the same */
        started = t + 1;
    }
    run_chunk(&chunks[0]);
    for (int t = 1; t < started; t++)
        if (running[t]) pthread_join(ids[t], NULL);
}

int zo_adam_update(const zo_adam_args *a, int variant, int threads) {
    missing_lab = NULL; /* this update's own report: an earlier call's stub does not stick */
    if (variant == ZO_AUTO) variant = cpu_has_avx512() ? ZO_AVX512F : cpu_has_avx2() ? ZO_AVX2_FMA : ZO_SCALAR;
    if (variant < 0 || variant > ZO_AVX512F || !(zo_cpu_variants() & (1 << variant))) return -1;
    if (a->state_dtype < ZO_STATE_F32 || a->state_dtype > ZO_STATE_INT8) return -3;
    zo_kernel kernels[] = {adam_scalar, adam_avx2, adam_avx512};
    zo_kernel narrow[] = {narrow_scalar, narrow_avx2, narrow_avx512};
    zo_squares squares[] = {squares_scalar, squares_avx2, squares_avx2}; /* 8 lanes keep up with memory */
    zo_kernel kernel = a->state_dtype == ZO_STATE_F32 ? kernels[variant] : narrow[variant];
    run_threads(a, kernel, a->row_squares != NULL ? squares[variant] : NULL, threads);
    return missing_lab ? -2 : 0;
}

/* ------------------------------------------------------------------------------------ the memory floor */
/* The bytes of one Adam pass with no arithmetic: read w, g, m, v and write w, m, v (and the 16-bit output when
 * there is one), each element once, in the same order, chunks and threads as the update. An update cannot beat
 * this time on this machine by much; bench reports each Adam as a fraction of it. The values it leaves are
 * meaningless: use scratch buffers.
 *
 * To be a floor it must itself run at memory speed, so it does not care what the bytes are: each array is a
 * run of bytes, read and written back plus one (w, m, v, in place), read (g, when nothing is written from it)
 * or copied (g into the output: same width), 32 bytes at a time where the CPU has AVX2. With `nontemporal`
 * the stores are streaming stores (_mm256_stream_si256): they go to memory without first reading the line
 * into the cache, which saves the output's read (an array only written is otherwise read too) and can free
 * the cache for the loads. Whichever of the two is faster on this CPU is its floor. */
enum { ZO_IN_PLACE, ZO_READ, ZO_COPY };
typedef struct {
    uint8_t *bytes;     /* the array (ZO_READ: only read) */
    const uint8_t *src; /* ZO_COPY: where its bytes come from */
    int size, kind;     /* bytes an element */
} zo_floor_array;

/* The arrays of a's pass, as one precision's update moves them; returns how many. */
static int floor_arrays(const zo_adam_args *a, zo_floor_array *arrays) {
    const int grad_size = a->grad_dtype == ZO_F32 ? 4 : 2;
    const int moment_size = a->state_dtype == ZO_STATE_F32 ? 4 : a->state_dtype == ZO_STATE_BF16 ? 2 : 1;
    void *m = a->state_dtype == ZO_STATE_F32 ? (void *)a->exp_avg : a->exp_avg_packed;
    void *v = a->state_dtype == ZO_STATE_F32 ? (void *)a->exp_avg_sq : a->exp_avg_sq_packed;
    int count = 0;
    arrays[count++] = (zo_floor_array){(uint8_t *)a->param, NULL, 4, ZO_IN_PLACE};
    arrays[count++] = (zo_floor_array){(uint8_t *)m, NULL, moment_size, ZO_IN_PLACE};
    arrays[count++] = (zo_floor_array){(uint8_t *)v, NULL, moment_size, ZO_IN_PLACE};
    if (a->out != NULL) arrays[count++] = (zo_floor_array){(uint8_t *)a->out, a->grad, grad_size, ZO_COPY};
    else arrays[count++] = (zo_floor_array){(uint8_t *)a->grad, NULL, grad_size, ZO_READ};
    return count;
}

/* Bytes [begin, end) of one array, the portable way; returns the xor of what ZO_READ read. */
static uint8_t floor_bytes_scalar(const zo_floor_array *x, int64_t begin, int64_t end) {
    uint8_t seen = 0;
    for (int64_t i = begin; i < end; i++) {
        if (x->kind == ZO_IN_PLACE) x->bytes[i] += 1;
        else if (x->kind == ZO_COPY) x->bytes[i] = x->src[i];
        else seen ^= x->bytes[i];
    }
    return seen;
}

/* Tells the compiler that `seen` is used, so that the reads it folds are not left out (no store, no race). */
static inline void keep(uint8_t seen) { __asm__ volatile("" : : "r"(seen)); }

static void floor_scales(const zo_adam_args *a, int64_t begin, int64_t end) {
    if (a->state_dtype != ZO_STATE_INT8) return;
    for (int64_t b = begin / ZO_STATE_BLOCK; b * ZO_STATE_BLOCK < end; b++) { /* chunks start on a block */
        a->exp_avg_scale[b] += 1.0f;
        a->exp_avg_sq_scale[b] += 1.0f;
    }
}

static void floor_scalar(const zo_adam_args *a, int64_t begin, int64_t end) {
    zo_floor_array arrays[4];
    int count = floor_arrays(a, arrays);
    uint8_t seen = 0;
    for (int64_t i = begin; i < end; i += 64) { /* 64 elements of every array, then the next 64 */
        int64_t stop = i + 64 < end ? i + 64 : end;
        for (int j = 0; j < count; j++)
            seen ^= floor_bytes_scalar(&arrays[j], i * arrays[j].size, stop * arrays[j].size);
    }
    keep(seen);
    floor_scales(a, begin, end);
}

#if defined(__x86_64__) || defined(_M_X64)
ZO_AVX2 static void floor_avx2(const zo_adam_args *a, int64_t begin, int64_t end, int nontemporal) {
    zo_floor_array arrays[4];
    int count = floor_arrays(a, arrays);
    const __m256i one = _mm256_set1_epi8(1);
    __m256i seen = _mm256_setzero_si256();
    int stream[4];
    for (int j = 0; j < count; j++) /* a streaming store needs 32-byte alignment: else a plain one */
        stream[j] = nontemporal && arrays[j].kind == ZO_COPY && ((uintptr_t)(arrays[j].bytes + begin * arrays[j].size) % 32 == 0);
    int64_t i = begin;
    for (; i + 64 <= end; i += 64) { /* 64 elements: 64 to 256 bytes of each array, a multiple of 32 */
        for (int j = 0; j < count; j++) {
            const zo_floor_array *x = &arrays[j];
            for (int64_t k = i * x->size; k < (i + 64) * x->size; k += 32) {
                __m256i *at = (__m256i *)(x->bytes + k);
                __m256i value = x->kind == ZO_COPY ? _mm256_loadu_si256((const __m256i *)(x->src + k))
                                                   : _mm256_loadu_si256(at);
                if (x->kind == ZO_READ) {
                    seen = _mm256_xor_si256(seen, value);
                    continue;
                }
                if (x->kind == ZO_IN_PLACE) value = _mm256_add_epi8(value, one);
                if (stream[j]) _mm256_stream_si256(at, value);
                else _mm256_storeu_si256(at, value);
            }
        }
    }
    uint8_t lanes[32], folded = 0;
    _mm256_storeu_si256((__m256i *)lanes, seen);
    for (int j = 0; j < 32; j++) folded ^= lanes[j];
    for (int j = 0; j < count; j++)
        folded ^= floor_bytes_scalar(&arrays[j], i * arrays[j].size, end * arrays[j].size);
    keep(folded);
    floor_scales(a, begin, end);
}

static void floor_plain(const zo_adam_args *a, int64_t begin, int64_t end) { floor_avx2(a, begin, end, 0); }
static void floor_streaming(const zo_adam_args *a, int64_t begin, int64_t end) { floor_avx2(a, begin, end, 1); }
#else
static void floor_plain(const zo_adam_args *a, int64_t begin, int64_t end) { floor_scalar(a, begin, end); }
static void floor_streaming(const zo_adam_args *a, int64_t begin, int64_t end) { floor_scalar(a, begin, end); }
#endif

int zo_memory_floor(const zo_adam_args *a, int threads, int nontemporal) {
    int narrow = a->grad_dtype != ZO_F32;
    if (narrow != (a->out != NULL) || (a->out != NULL && a->out_dtype == ZO_F32)) return -1;
    /* Narrow moments: defined for the offload update's 16-bit gradients in and weights out only. */
    if (a->state_dtype < ZO_STATE_F32 || a->state_dtype > ZO_STATE_INT8) return -1;
    if (a->state_dtype != ZO_STATE_F32 && !narrow) return -1;
    if (nontemporal && !cpu_has_avx2()) return -2; /* streaming stores: only the AVX2 loop has them */
    run_threads(a, !cpu_has_avx2() ? floor_scalar : nontemporal ? floor_streaming : floor_plain, NULL, threads);
    return 0;
}
