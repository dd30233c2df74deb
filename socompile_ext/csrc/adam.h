/* socompile_ext: CPU Adam/AdamW kernels, public C interface.
 *
 * One pass over the parameters does the whole optimizer step: it reads p, g, m, v and writes p, m, v
 * (and optionally a bf16 copy of p), and on the way it sums the squares of the (scaled) gradient and
 * notices non-finite values, which the speculation-then-validation runtime needs per bucket.
 *
 * Everything here is plain C11 so the same kernels build for x86-64 and aarch64 and can be tested
 * under qemu without Python (csrc/tests/adam_harness.c, run by tests/test_ext_aarch64.py).
 */
#ifndef SOCX_ADAM_H
#define SOCX_ADAM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Instruction-set paths, lowest first. A path is usable when the CPU reports it at run time. */
enum socx_isa {
    SOCX_ISA_SCALAR = 0,
    SOCX_ISA_AVX2 = 1,
    SOCX_ISA_AVX512 = 2,
    SOCX_ISA_NEON = 3,
    SOCX_ISA_SVE = 4,
    SOCX_ISA_COUNT = 5
};

/* Hyper-parameters as the caller gives them (Python floats are doubles). The kernel turns them into
 * fp32 constants exactly as torch does when it applies a Python scalar to an fp32 tensor. */
typedef struct {
    int64_t step;          /* 1-based step count; bias correction is computed from it at each call */
    double lr, beta1, beta2, eps, weight_decay;
    int decoupled;         /* 1: AdamW (p *= 1 - lr*wd); 0: Adam (g += wd*p) */
    double grad_scale;     /* gradient multiplier applied before anything else (clip coefficient) */
} socx_hparams;

/* Buffers of one step. Inputs are read; outputs are written. An output may equal its input (in-place
 * step) or be a different buffer (ping-pong: the inputs are then left untouched). Partial overlap is
 * the caller's bug (the Python layer rejects it). */
typedef struct {
    int64_t n;
    const float *p_in, *m_in, *v_in;
    float *p_out, *m_out, *v_out;
    const float *g_f32;      /* exactly one of g_f32 / g_bf16 is non-NULL */
    const uint16_t *g_bf16;
    uint16_t *p_bf16_out;    /* optional: bf16 copy of the updated parameter, RNE rounded */
    /* bf16 moments: m16_in, v16_in, m16_out, v16_out all given and m_in, v_in, m_out, v_out NULL (or the
     * reverse: fp32 moments). Computed in fp32 as always; stored stochastically rounded to bf16 with the
     * random bits socx_round_bits(round_seed, element index) (adam_internal.h), so any path, thread count
     * and block split gives the same bits. */
    const uint16_t *m16_in, *v16_in;
    uint16_t *m16_out, *v16_out;
    uint32_t round_seed;     /* shared by bf16 and int8 moments */
    /* int8 moments: m8_in, v8_in, m8_out, v8_out all given and the fp32 and bf16 moment pointers NULL. One
     * uint8 buffer per moment, 20 * ceil(n / 16) bytes: block j (elements 16j .. 16j+15 of the call) is the
     * bytes [20j, 20j + 20), 16 one-byte codes then the block's fp32 scale (native byte order). exp_avg's codes
     * are int8 (m = code * scale), exp_avg_sq's uint8 (w = code * scale, v = w * w); a short last block's codes
     * past n are 0. The step decodes a block, computes in fp32 as always, and encodes it with stochastic
     * rounding: scale_m = max|m| / 127, code = sign(m) trunc(min(|m| * ((1 / max|m|) * 127), 127) + u);
     * scale_v = max w / 255 (w = sqrt(v)), code = trunc(min(w * ((1 / max w) * 255), 255) + u'), at least 1 where
     * v > 0; u, u' the low and high 16 bits of socx_round_bits(round_seed, i) / 65536
     * (socompile/runtime/int8_moments.py is the reference). A call starts at a block boundary; in place or
     * ping-pong as the other formats. */
    const uint8_t *m8_in, *v8_in;
    uint8_t *m8_out, *v8_out;
} socx_buffers;

/* Result of a pass over a gradient: sum of squares (in double) and whether anything was non-finite. */
typedef struct {
    double sumsq;
    int nonfinite;
} socx_stats;

/* The Adam/AdamW step. Returns the gradient statistics of the scaled gradient. Thread-count
 * independent: parameters, state and the returned sum are bitwise identical for any thread count. */
socx_stats socx_adam_step(const socx_buffers *b, const socx_hparams *h);

/* The same step over `count` tensors with one set of hyper-parameters (one parameter group), in one
 * parallel region: one fork/join for the whole list and the blocks of all tensors shared out among the
 * threads. Each tensor's results are exactly those of socx_adam_step on it; sumsq (may be NULL) receives
 * each tensor's sum of squares, and the returned sum adds them in tensor order. */
socx_stats socx_adam_step_multi(const socx_buffers *bs, int count, const socx_hparams *h, double *sumsq);

/* Block scheduling among the threads: 1 (default) dynamic chunks of blocks, 0 static contiguous ranges.
 * Results do not depend on it (for measurements). */
void socx_set_dynamic_schedule(int on);
int socx_get_dynamic_schedule(void);

/* Algebraic inverse of socx_adam_step on (p, m, v) in place, given the same gradient, hparams and step.
 * Computed in double; v clamped at >= 0. Not bitwise: see docs/kernel.md. Returns 0, or -1 when the
 * step cannot be inverted (beta1 == 0, beta2 == 0, or a decoupled decay factor of 0), -2 for bf16 moments
 * or int8 moments (stochastically rounded: no inverse exists; their exact rollback is ping-pong). */
int socx_adam_rollback(const socx_buffers *b, const socx_hparams *h);

/* Sum of squares and non-finite flag of a gradient (one of g_f32 / g_bf16 non-NULL). */
socx_stats socx_grad_stats(const float *g_f32, const uint16_t *g_bf16, int64_t n);

/* Memory-traffic ceiling: reads p, g, m, v and writes p_out, m_out, v_out (and p_bf16_out when given)
 * with the same store policy as the step, and no floating-point arithmetic (bf16 and int8 moments: their
 * bytes). For benchmarks only. */
void socx_copy_ceiling(const socx_buffers *b);
void socx_copy_ceiling_multi(const socx_buffers *bs, int count);  /* one parallel region, like the step's */

/* Store policy for the outputs of the step and of the copy ceiling.
 * SOCX_STORES_AUTO (default): non-temporal (streaming) stores for outputs that are separate buffers
 *   (ping-pong state, the bf16 parameter copy) when the call touches at least socx_stream_threshold()
 *   elements (default: half the last-level cache at 28 B per element, at least 128K), regular stores
 *   otherwise. A regular store to a line that is not in cache first reads the line (read-for-ownership).
 * SOCX_STORES_REGULAR: never stream. SOCX_STORES_STREAMING: stream every output at any size, in-place
 *   outputs included (for measurements). The policy changes no value, only how the bytes reach memory.
 * int8 moments use regular stores under every policy (their step and ceiling). */
enum socx_store_policy { SOCX_STORES_AUTO = 0, SOCX_STORES_REGULAR = 1, SOCX_STORES_STREAMING = 2 };
void socx_set_store_policy(int policy);
int socx_get_store_policy(void);
void socx_set_stream_threshold(int64_t n);  /* elements; <= 0 restores the default */
int64_t socx_stream_threshold(void);

/* The store choice a step (or ceiling pass) over these buffers would make now on the current ISA path, in a
 * call that touches call_n elements in all (<= 0: b->n, a single-tensor call; a multi-tensor call decides
 * from all its elements):
 * bit 0: p/m/v outputs streamed; bit 1: bf16 parameter copy streamed. The unaligned head of every block
 * (up to the first 64-byte boundary of the outputs) and its tail always use regular stores. */
int socx_stream_choice(const socx_buffers *b, int64_t call_n);

/* AVX-512 path: software prefetch of the four input streams this many elements ahead (0, the default: off;
 * for measurements). */
void socx_set_prefetch(int64_t elems);
int64_t socx_get_prefetch(void);

/* Threads used by the kernels (default: OpenMP's max threads at first use). */
void socx_set_num_threads(int n);
int socx_get_num_threads(void);

/* ISA selection: the best available path is chosen at first use; socx_force_isa picks another usable
 * one (returns -1 if that path is not usable on this CPU or not compiled in). */
int socx_isa_compiled(int isa);   /* built into this binary (x86 paths on x86, Arm paths on aarch64) */
int socx_isa_available(int isa);  /* compiled and usable on this CPU */
int socx_current_isa(void);
int socx_force_isa(int isa);
const char *socx_isa_name(int isa);

#ifdef __cplusplus
}
#endif
#endif
