/* Internal pieces shared by the per-ISA kernel files and the dispatcher.
 *
 * NOTE: one arithmetic, every path. Each ISA file performs the same fp32 operations in the same order
 * as socx_adam_elem below (no FMA: the build uses -ffp-contract=off, and the vector code spells out
 * mul then add). So scalar, AVX2, AVX-512, NEON and SVE give bitwise-identical p, m, v and bf16 output,
 * and tails can be finished with the scalar element function without changing any result.
 *
 * NOTE: sum of squares lanes. The gradient's sum of squares is accumulated in double in 16 lanes:
 * element i of a block [i0, i1) goes to lane (i - i0) % 16, and the 16 lanes are combined with the
 * fixed tree of socx_reduce16. AVX-512 (2 x 8 doubles), AVX2 (4 x 4), NEON (8 x 2) and scalar (16)
 * map onto those lanes exactly, so their sums are bitwise identical too. SVE's lane count depends on the
 * vector length, so its sum can differ in the last bits (it is still deterministic for one machine).
 * The dispatcher cuts the tensor into fixed SOCX_BLOCK-element blocks independent of the thread count
 * and adds the block sums in order, which makes the result independent of the number of threads.
 */
#ifndef SOCX_ADAM_INTERNAL_H
#define SOCX_ADAM_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "adam.h"

/* Elements per block: 16384 fp32 = 64 KiB per stream, large enough that the per-block call and the
 * block-sum bookkeeping cost nothing, small enough that two threads still split small buckets. A
 * multiple of 16 keeps every block start 64-byte aligned relative to the tensor start. */
#define SOCX_BLOCK 16384

/* fp32 constants of one step, derived once per call from socx_hparams the way torch derives them:
 * Python-double scalar math, then rounded to fp32 where it meets an fp32 tensor. */
typedef struct {
    float gscale;     /* grad_scale */
    float l2;         /* weight_decay, used only when use_l2 (Adam) */
    float decay;      /* 1 - lr*weight_decay for AdamW, 1 for Adam */
    float w1;         /* lerp weight 1 - beta1 */
    float omw1;       /* 1 - w1 in fp32, for torch's large-weight lerp form */
    float b2;         /* beta2 */
    float omb2;       /* 1 - beta2 */
    float bc2s;       /* sqrt(1 - beta2^step) */
    float step_size;  /* lr / (1 - beta1^step) */
    float eps;
    int use_l2;       /* Adam with weight_decay != 0 */
    int lerp_small;   /* torch's lerp: weight < 0.5 -> m + w*(g-m); otherwise g - (g-m)*(1-w) */
    int stream;       /* non-temporal stores for p/m/v outputs (no read-for-ownership): see make_consts */
    int stream_bf16;  /* same for the bf16 parameter copy */
    int align_r;      /* when streaming: element i's outputs are 64-byte aligned iff (i + align_r) % 16 == 0
                       * (every streamed output shares this residue; vector paths peel the block's head
                       * up to that boundary with regular stores) */
    int64_t prefetch; /* AVX-512: software prefetch distance in elements for the input streams, 0 = off */
} socx_consts;

/* Elements before the first streaming-aligned element of a block starting at i0 (0..15). */
static inline int64_t socx_stream_head(const socx_consts *c, int64_t i0, int64_t i1) {
    int64_t h = (16 - ((i0 + c->align_r) & 15)) & 15;
    return h < i1 - i0 ? h : i1 - i0;
}

typedef double (*socx_step_fn)(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
typedef double (*socx_sumsq_fn)(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1);
typedef void (*socx_copy_fn)(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);

/* The SVE file needs arm_sve.h under a target pragma: GCC 10 or newer (older aarch64 compilers get NEON only). */
#if defined(__aarch64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define SOCX_HAVE_SVE 1
#else
#define SOCX_HAVE_SVE 0
#endif

/* Per-ISA entry points (each file defines its three; files for the other architecture define none). */
double socx_step_scalar(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
double socx_sumsq_scalar(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1);
void socx_copy_scalar(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
#if defined(__x86_64__) || defined(_M_X64)
double socx_step_avx2(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
double socx_sumsq_avx2(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1);
void socx_copy_avx2(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
double socx_step_avx512(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
double socx_sumsq_avx512(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1);
void socx_copy_avx512(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
#endif
#if defined(__aarch64__)
double socx_step_neon(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
double socx_sumsq_neon(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1);
void socx_copy_neon(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
#endif
#if SOCX_HAVE_SVE
double socx_step_sve(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
double socx_sumsq_sve(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1);
void socx_copy_sve(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1);
#endif

/* ---- scalar helpers (used by every path for tails, and as the reference) ---- */

static inline float socx_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's vectorised fp32->bf16 conversion does (the one torch uses on AVX2 and
 * AVX-512 machines): every NaN becomes 0xFFFF, so a NaN stays a NaN (a plain rounding add could carry a
 * NaN's payload into the sign bit and produce -0); overflow rounds to +-Inf. */
static inline uint16_t socx_f32_to_bf16(float f) {
    uint32_t u;
    if (f != f) return 0xFFFFu;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Stochastic rounding of the bf16 moments. A moment's update is often far below bf16's resolution (v * beta2
 * with beta2 = 0.999 changes v by 0.1%, an eighth of an ulp of 8 mantissa bits): rounded to nearest it would
 * never decay. Adding 16 uniform random bits below the kept ones before truncating rounds up with probability
 * equal to the dropped fraction, so each stored moment equals its fp32 value in expectation. The bits come from
 * a fixed integer hash of (seed, element index): every path, thread count and block split draws the same
 * bits, and an eager reference can reproduce them. Low 16 bits round m, high 16 bits round v. */
static inline uint32_t socx_round_bits(uint32_t seed, int64_t i) {
    uint32_t x = seed + (uint32_t)i * 0x9E3779B9u;   /* golden-ratio step: neighbouring elements spread out */
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

/* fp32 -> bf16 rounded up with probability (dropped bits) / 2^16 given 16 random bits r; every NaN -> 0xFFFF
 * (as socx_f32_to_bf16); a finite value next to the largest may round to Inf, as it may at nearest. */
static inline uint16_t socx_f32_to_bf16_sr(float f, uint32_t r) {
    uint32_t u;
    if (f != f) return 0xFFFFu;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + (r & 0xFFFFu)) >> 16);
}

static inline float socx_load_grad(const socx_buffers *b, int64_t i) {
    return b->g_f32 ? b->g_f32[i] : socx_bf16_to_f32(b->g_bf16[i]);
}

/* One element of the step: the reference arithmetic every vector path reproduces. Returns the scaled
 * gradient so the caller can add its square to the right lane. */
static inline float socx_adam_elem(const socx_buffers *b, const socx_consts *c, int64_t i) {
    float g = socx_load_grad(b, i) * c->gscale;
    float gs = g;
    const int m16 = b->m16_in != NULL;
    float p = b->p_in[i];
    float m = m16 ? socx_bf16_to_f32(b->m16_in[i]) : b->m_in[i];
    float v = m16 ? socx_bf16_to_f32(b->v16_in[i]) : b->v_in[i];
    if (c->use_l2) g = g + c->l2 * p;
    p = p * c->decay;
    float d = g - m;
    m = c->lerp_small ? m + c->w1 * d : g - d * c->omw1;
    v = v * c->b2 + (c->omb2 * g) * g;
    float den = sqrtf(v) / c->bc2s + c->eps;
    p = p - (c->step_size * m) / den;
    b->p_out[i] = p;
    if (m16) {
        uint32_t r = socx_round_bits(b->round_seed, i);
        b->m16_out[i] = socx_f32_to_bf16_sr(m, r);
        b->v16_out[i] = socx_f32_to_bf16_sr(v, r >> 16);
    } else {
        b->m_out[i] = m;
        b->v_out[i] = v;
    }
    if (b->p_bf16_out) b->p_bf16_out[i] = socx_f32_to_bf16(p);
    return gs;
}

/* A path's socx_step_<isa>: one call of its step_impl(b, c, i0, i1, GBF16, OUT16, STREAM, MB16) with the call's
 * flags (bf16 gradients, bf16 copy out, streaming stores, bf16 moments) as constants, so the compiler builds one
 * loop per combination with no per-element branches on them. */
#define SOCX_STEP_CASE(IMPL, MB)                                                                                 \
    do {                                                                                                         \
        if (!gb && !o16) return st ? IMPL(b, c, i0, i1, 0, 0, 1, MB) : IMPL(b, c, i0, i1, 0, 0, 0, MB);          \
        if (!gb && o16) return st ? IMPL(b, c, i0, i1, 0, 1, 1, MB) : IMPL(b, c, i0, i1, 0, 1, 0, MB);           \
        if (gb && !o16) return st ? IMPL(b, c, i0, i1, 1, 0, 1, MB) : IMPL(b, c, i0, i1, 1, 0, 0, MB);           \
        return st ? IMPL(b, c, i0, i1, 1, 1, 1, MB) : IMPL(b, c, i0, i1, 1, 1, 0, MB);                          \
    } while (0)
#define SOCX_DISPATCH_STEP(IMPL)                                                                                 \
    do {                                                                                                         \
        const int gb = b->g_bf16 != NULL, o16 = b->p_bf16_out != NULL, st = c->stream;                          \
        if (b->m8_in) return socx_int8_step(b, c, i0, i1); /* adam_int8.h */                                    \
        if (b->m16_in) SOCX_STEP_CASE(IMPL, 1);                                                                  \
        SOCX_STEP_CASE(IMPL, 0);                                                                                 \
    } while (0)

/* The fixed combination of the 16 sum-of-squares lanes (see the NOTE at the top). */
static inline double socx_reduce16(const double l[16]) {
    double t[8], u[4];
    for (int j = 0; j < 8; j++) t[j] = l[j] + l[j + 8];
    for (int j = 0; j < 4; j++) u[j] = t[j] + t[j + 4];
    double w0 = u[0] + u[2], w1 = u[1] + u[3];
    return w0 + w1;
}

/* Tail of a block for paths that finish with scalar code: elements [i, i1) of the block starting at i0. */
static inline void socx_step_tail(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i,
                                  int64_t i1, double lanes[16]) {
    for (; i < i1; i++) {
        double g = (double)socx_adam_elem(b, c, i);
        lanes[(i - i0) & 15] += g * g;
    }
}

static inline void socx_sumsq_tail(const float *g32, const uint16_t *g16, int64_t i0, int64_t i, int64_t i1,
                                   double lanes[16]) {
    for (; i < i1; i++) {
        double g = g32 ? (double)g32[i] : (double)socx_bf16_to_f32(g16[i]);
        lanes[(i - i0) & 15] += g * g;
    }
}

#endif
