/* The interface of cpu_adam.c; cffi reads this file as its declarations (lines starting with # are skipped). */
#ifndef ZO_CPU_ADAM_H
#define ZO_CPU_ADAM_H
#include <stdint.h>

enum { ZO_F32 = 0, ZO_F16 = 1, ZO_BF16 = 2 };                    /* gradient and output dtypes */
enum { ZO_AUTO = -1, ZO_SCALAR = 0, ZO_AVX2_FMA = 1, ZO_AVX512F = 2 }; /* kernel variants */
enum { ZO_MAX_THREADS = 64 };
enum { ZO_NORM_ROW = 4096 }; /* elements per row of the squared gradient norm (row_squares) */
enum { ZO_STATE_F32 = 0, ZO_STATE_BF16 = 1, ZO_STATE_INT8 = 2 }; /* how m and v are stored (state_dtype) */
enum { ZO_STATE_BLOCK = 2048 }; /* int8 moments: elements per block, one scale each, blocks from element 0 */

typedef struct {
    float *param;          /* fp32 master weights, updated in place */
    const void *grad;      /* gradients: fp32, fp16 or bf16 (grad_dtype) */
    float *exp_avg;        /* Adam's m, fp32, in place */
    float *exp_avg_sq;     /* Adam's v, fp32, in place */
    void *out;             /* NULL, or where the rounded weights go (out_dtype) */
    int64_t n;
    int grad_dtype, out_dtype, adamw;
    /* Derived in double precision by the caller: 1 - 0.999 rounded in fp32 arithmetic is off by 1.3e-5. */
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
    float step_size;          /* lr / (1 - beta1^t) */
    float bias_correction2_sqrt; /* sqrt(1 - beta2^t) */
    float decay;              /* AdamW: 1 - lr * weight_decay */
    float grad_scale;         /* 1 / loss scale x clip factor */
    /* NULL, or one float per row of ZO_NORM_ROW elements: the sum of (g * grad_scale)^2 over the row, summed
     * in the same pass as the update, in fp32 and in a fixed order (so it does not depend on threads). */
    float *row_squares;
    /* ZO_STATE_F32: the moments are exp_avg and exp_avg_sq above, and the four pointers below are unused.
     * Otherwise exp_avg and exp_avg_sq are NULL and the moments are stored narrow: ZO_STATE_BF16, m and v as
     * bf16 (uint16_t); ZO_STATE_INT8, m as int8_t codes and v as uint8_t codes of sqrt(v), one byte each, and
     * per block of ZO_STATE_BLOCK elements one fp32 scale each: the block's largest |m| (sqrt v), the value
     * that code 127 (255) stands for. The update replaces codes and scales with the new moments'. */
    int state_dtype;
    void *exp_avg_packed, *exp_avg_sq_packed;
    float *exp_avg_scale, *exp_avg_sq_scale;
} zo_adam_args;

int zo_cpu_variants(void);                                      /* bit v set: variant v runs here */
/* 0; -1 variant unsupported; -2 a lab stub ran; -3 unknown state_dtype */
int zo_adam_update(const zo_adam_args *args, int variant, int threads);
const char *zo_missing_lab(void);                               /* NULL, or the lab task a stub left out */
/* 0; -1 unsupported dtypes or states (see .c); -2 nontemporal asked for where the CPU lacks AVX2 */
int zo_memory_floor(const zo_adam_args *args, int threads, int nontemporal);
#endif
