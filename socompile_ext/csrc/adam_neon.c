/* NEON (Advanced SIMD) path: every AArch64 CPU has it; used where SVE is absent. 16 elements (four
 * 4-lane vectors) per iteration so the sum of squares fills the same 16 lanes as the x86 paths (8 x 2
 * doubles); the tail is finished by the scalar element function (identical fp32 arithmetic).
 * No non-temporal store intrinsic exists for NEON; Arm cores detect whole-line writes and skip the
 * read-for-ownership on their own ("write streaming"), so ping-pong does not pay the extra read. */
#if defined(__aarch64__)
#include <arm_neon.h>

#include "adam_internal.h"
#include "adam_int8.h"

#define AI static inline __attribute__((always_inline))

AI float32x4_t bf16_to_f32_4(const uint16_t *src) {
    return vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vld1_u16(src)), 16));
}

/* Same rounding as socx_f32_to_bf16: RNE via the integer bias, every NaN -> 0xFFFF. */
AI uint16x4_t f32_to_bf16_4(float32x4_t x) {
    uint32x4_t u = vreinterpretq_u32_f32(x);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb), 16);
    uint32x4_t ordered = vceqq_f32(x, x);
    r = vbslq_u32(ordered, r, vdupq_n_u32(0xFFFF));
    return vmovn_u32(r);
}

/* socx_round_bits of elements i .. i+3 (the same integer hash, 4 lanes). */
AI uint32x4_t round_bits4(uint32_t seed, int64_t i) {
    const uint32_t lanes[4] = {0, 1, 2, 3};
    uint32x4_t idx = vaddq_u32(vdupq_n_u32((uint32_t)i), vld1q_u32(lanes));
    uint32x4_t x = vaddq_u32(vdupq_n_u32(seed), vmulq_u32(idx, vdupq_n_u32(0x9E3779B9u)));
    x = veorq_u32(x, vshrq_n_u32(x, 16));
    x = vmulq_u32(x, vdupq_n_u32(0x7FEB352Du));
    x = veorq_u32(x, vshrq_n_u32(x, 15));
    x = vmulq_u32(x, vdupq_n_u32(0x846CA68Bu));
    return veorq_u32(x, vshrq_n_u32(x, 16));
}

/* Same rounding as socx_f32_to_bf16_sr (the low 16 bits of r added below the kept bits, every NaN -> 0xFFFF). */
AI uint16x4_t f32_to_bf16_sr_4(float32x4_t x, uint32x4_t r) {
    uint32x4_t t = vshrq_n_u32(vaddq_u32(vreinterpretq_u32_f32(x), vandq_u32(r, vdupq_n_u32(0xFFFF))), 16);
    t = vbslq_u32(vceqq_f32(x, x), t, vdupq_n_u32(0xFFFF));
    return vmovn_u32(t);
}

AI void sq_acc(float32x4_t g, float64x2_t *lo, float64x2_t *hi) {
    float64x2_t a = vcvt_f64_f32(vget_low_f32(g));
    float64x2_t b = vcvt_high_f64_f32(g);
    *lo = vaddq_f64(*lo, vmulq_f64(a, a));
    *hi = vaddq_f64(*hi, vmulq_f64(b, b));
}

AI void step4(const socx_buffers *b, const socx_consts *c, int64_t i, const int GBF16, const int OUT16,
              const int MB16, float64x2_t *acc_lo, float64x2_t *acc_hi) {
    float32x4_t g = GBF16 ? bf16_to_f32_4(b->g_bf16 + i) : vld1q_f32(b->g_f32 + i);
    float32x4_t p = vld1q_f32(b->p_in + i);
    float32x4_t m = MB16 ? bf16_to_f32_4(b->m16_in + i) : vld1q_f32(b->m_in + i);
    float32x4_t v = MB16 ? bf16_to_f32_4(b->v16_in + i) : vld1q_f32(b->v_in + i);
    g = vmulq_f32(g, vdupq_n_f32(c->gscale));
    sq_acc(g, acc_lo, acc_hi);
    if (c->use_l2) g = vaddq_f32(g, vmulq_f32(vdupq_n_f32(c->l2), p));
    p = vmulq_f32(p, vdupq_n_f32(c->decay));
    float32x4_t d = vsubq_f32(g, m);
    if (c->lerp_small)
        m = vaddq_f32(m, vmulq_f32(vdupq_n_f32(c->w1), d));
    else
        m = vsubq_f32(g, vmulq_f32(d, vdupq_n_f32(c->omw1)));
    v = vaddq_f32(vmulq_f32(v, vdupq_n_f32(c->b2)), vmulq_f32(vmulq_f32(vdupq_n_f32(c->omb2), g), g));
    float32x4_t den = vaddq_f32(vdivq_f32(vsqrtq_f32(v), vdupq_n_f32(c->bc2s)), vdupq_n_f32(c->eps));
    p = vsubq_f32(p, vdivq_f32(vmulq_f32(vdupq_n_f32(c->step_size), m), den));
    vst1q_f32(b->p_out + i, p);
    if (MB16) {
        uint32x4_t r = round_bits4(b->round_seed, i);
        vst1_u16(b->m16_out + i, f32_to_bf16_sr_4(m, r));
        vst1_u16(b->v16_out + i, f32_to_bf16_sr_4(v, vshrq_n_u32(r, 16)));
    } else {
        vst1q_f32(b->m_out + i, m);
        vst1q_f32(b->v_out + i, v);
    }
    if (OUT16) vst1_u16(b->p_bf16_out + i, f32_to_bf16_4(p));
}

AI double step_impl(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1, const int GBF16,
                    const int OUT16, const int MB16) {
    float64x2_t acc[8];
    for (int k = 0; k < 8; k++) acc[k] = vdupq_n_f64(0.0);
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16)
        for (int q = 0; q < 4; q++) step4(b, c, i + 4 * q, GBF16, OUT16, MB16, &acc[2 * q], &acc[2 * q + 1]);
    double lanes[16];
    for (int k = 0; k < 8; k++) vst1q_f64(lanes + 2 * k, acc[k]);
    socx_step_tail(b, c, i0, i, i1, lanes);
    return socx_reduce16(lanes);
}

double socx_step_neon(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    if (b->m8_in) return socx_int8_step(b, c, i0, i1);  /* adam_int8.h */
    const int gb = b->g_bf16 != NULL, o16 = b->p_bf16_out != NULL, mb = b->m16_in != NULL;
    if (mb) {
        if (!gb && !o16) return step_impl(b, c, i0, i1, 0, 0, 1);
        if (!gb && o16) return step_impl(b, c, i0, i1, 0, 1, 1);
        if (gb && !o16) return step_impl(b, c, i0, i1, 1, 0, 1);
        return step_impl(b, c, i0, i1, 1, 1, 1);
    }
    if (!gb && !o16) return step_impl(b, c, i0, i1, 0, 0, 0);
    if (!gb && o16) return step_impl(b, c, i0, i1, 0, 1, 0);
    if (gb && !o16) return step_impl(b, c, i0, i1, 1, 0, 0);
    return step_impl(b, c, i0, i1, 1, 1, 0);
}

double socx_sumsq_neon(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1) {
    float64x2_t acc[8];
    for (int k = 0; k < 8; k++) acc[k] = vdupq_n_f64(0.0);
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16)
        for (int q = 0; q < 4; q++) {
            float32x4_t g = g32 ? vld1q_f32(g32 + i + 4 * q) : bf16_to_f32_4(g16 + i + 4 * q);
            sq_acc(g, &acc[2 * q], &acc[2 * q + 1]);
        }
    double lanes[16];
    for (int k = 0; k < 8; k++) vst1q_f64(lanes + 2 * k, acc[k]);
    socx_sumsq_tail(g32, g16, i0, i, i1, lanes);
    return socx_reduce16(lanes);
}

void socx_copy_neon(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    if (b->m8_in) {  /* int8 moments: their bytes (adam_int8.h) */
        socx_int8_copy(b, c, i0, i1);
        return;
    }
    const uint32x4_t zero = vdupq_n_u32((uint32_t)c->use_l2);
    int64_t i = i0;
    for (; i + 4 <= i1; i += 4) {
        uint32x4_t g = b->g_f32 ? vld1q_u32((const uint32_t *)b->g_f32 + i) : vmovl_u16(vld1_u16(b->g_bf16 + i));
        uint32x4_t p = vld1q_u32((const uint32_t *)b->p_in + i);
        vst1q_u32((uint32_t *)b->p_out + i, p);
        if (b->m16_in) {  /* bf16 moments: the step's 2-byte loads and stores */
            vst1_u16(b->m16_out + i, vld1_u16(b->m16_in + i));
            vst1_u16(b->v16_out + i, veor_u16(vld1_u16(b->v16_in + i), vmovn_u32(vandq_u32(g, zero))));
        } else {
            vst1q_u32((uint32_t *)b->m_out + i, vld1q_u32((const uint32_t *)b->m_in + i));
            vst1q_u32((uint32_t *)b->v_out + i, veorq_u32(vld1q_u32((const uint32_t *)b->v_in + i), vandq_u32(g, zero)));
        }
        if (b->p_bf16_out) vst1_u16(b->p_bf16_out + i, vshrn_n_u32(p, 16));
    }
    if (i < i1) socx_copy_scalar(b, c, i, i1);
}
#endif
