/* int8 block-quantised Adam moments (socx_buffers m8_in / v8_in / m8_out / v8_out; format in adam.h).
 *
 * Portable C, written so that GCC vectorises it: every block of 16 elements is loaded into small local arrays,
 * computed in 16-element loops with branch-free selects, and stored. Every ISA file includes this header after
 * its target pragma, so each path compiles the same C under its own instructions; the arithmetic is
 * socx_adam_elem's (same fp32 operations in the same order, no FMA under -ffp-contract=off) and the only
 * reductions are the integer maxima below (exact in any order), so every path gives the same bits. The sum of
 * squares goes to lane k = (i - i0) % 16 of the 16 double lanes, which is element k of a quantisation block
 * because a call's blocks start at multiples of 16.
 *
 * The block maxima: |m| and sqrt(v) are >= 0 (their sign bit is cleared), and non-negative fp32 values order
 * as their bit patterns do as integers, with every NaN above +Inf; so an integer max of the patterns is the
 * fp32 max, and a NaN when any element is one (the "NaN-propagating" max of the format).
 *
 * Stores are regular stores on every path (the dispatcher never streams int8 moments), and the copy ceiling
 * below moves the same bytes the same way.
 */
#ifndef SOCX_ADAM_INT8_H
#define SOCX_ADAM_INT8_H

#include "adam_internal.h"

#define SOCX_I8_AI static inline __attribute__((always_inline))

/* Constants of one call, copied out of socx_buffers / socx_consts so that the byte stores (which may alias
 * anything) do not force the compiler to reload them. */
typedef struct {
    const float *p_in, *g32;
    const uint16_t *g16;
    const uint8_t *m8_in, *v8_in;
    float *p_out;
    uint16_t *p16;
    uint8_t *m8_out, *v8_out;
    uint32_t seed;
    float gscale, l2, decay, w1, omw1, b2, omb2, bc2s, step_size, eps;
    int use_l2, lerp_small;
} socx_i8_ctx;

SOCX_I8_AI float socx_i8_bits_f(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

SOCX_I8_AI uint32_t socx_i8_f_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* One quantisation block: elements [q0, q0 + len) of the call, 1 <= len <= 16 (FULL: len == 16, a constant).
 * Adds the scaled gradient's squares to lanes[0 .. len). */
SOCX_I8_AI void socx_i8_block(const socx_i8_ctx *x, int64_t q0, int len, const int FULL, const int GBF16,
                              const int OUT16, double lanes[16]) {
    float g[16], p[16], m[16], v[16], w[16], um[16], uv[16];
    uint32_t am[16], aw[16];
    uint8_t cm[16], cv[16];
    const int64_t j = q0 >> 4;  /* q0 is a multiple of 16 */
    const uint8_t *mb = x->m8_in + 20 * j, *vb = x->v8_in + 20 * j;
    float sm, sv;
    memcpy(&sm, mb + 16, 4);
    memcpy(&sv, vb + 16, 4);
    if (FULL) len = 16;
    /* decode (the whole block before anything is written: in place works) and load */
    for (int k = 0; k < 16; k++) {
        float gk = 0.0f, pk = 0.0f;
        if (FULL || k < len) {
            gk = GBF16 ? socx_bf16_to_f32(x->g16[q0 + k]) : x->g32[q0 + k];
            pk = x->p_in[q0 + k];
        }
        g[k] = gk;
        p[k] = pk;
        m[k] = (float)(int8_t)mb[k] * sm;
        float wd = (float)vb[k] * sv;
        v[k] = wd * wd;
    }
    /* the step: socx_adam_elem's arithmetic */
    for (int k = 0; k < 16; k++) {
        float gk = g[k] * x->gscale;
        float gs = gk;
        float pk = p[k];
        if (x->use_l2) gk = gk + x->l2 * pk;
        pk = pk * x->decay;
        float d = gk - m[k];
        float mk = x->lerp_small ? m[k] + x->w1 * d : gk - d * x->omw1;
        float vk = v[k] * x->b2 + (x->omb2 * gk) * gk;
        float wk = sqrtf(vk);
        float den = wk / x->bc2s + x->eps;
        pk = pk - (x->step_size * mk) / den;
        g[k] = gs;
        p[k] = pk;
        m[k] = mk;
        v[k] = vk;
        w[k] = wk;
    }
    for (int k = 0; k < 16; k++) lanes[k] += (double)g[k] * (double)g[k];
    if (!FULL) {  /* padding counts as m = 0, v = 0 (and its squares as +0, which leave the lanes as they are) */
        for (int k = len; k < 16; k++) m[k] = v[k] = w[k] = 0.0f;
    }
    /* stores of p (and the bf16 copy): same rounding as socx_f32_to_bf16, branch-free */
    if (FULL) {
        for (int k = 0; k < 16; k++) x->p_out[q0 + k] = p[k];
        if (OUT16)
            for (int k = 0; k < 16; k++) {
                uint32_t u = socx_i8_f_bits(p[k]);
                uint32_t h = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
                x->p16[q0 + k] = (uint16_t)(p[k] != p[k] ? 0xFFFFu : h);
            }
    } else {
        for (int k = 0; k < len; k++) x->p_out[q0 + k] = p[k];
        if (OUT16)
            for (int k = 0; k < len; k++) x->p16[q0 + k] = socx_f32_to_bf16(p[k]);
    }
    /* encode: random bits, block maxima, scales, codes */
    for (int k = 0; k < 16; k++) {
        uint32_t r = socx_round_bits(x->seed, q0 + k);
        um[k] = (float)(int32_t)(r & 0xFFFFu) * (1.0f / 65536.0f);
        uv[k] = (float)(int32_t)(r >> 16) * (1.0f / 65536.0f);
        am[k] = socx_i8_f_bits(m[k]) & 0x7FFFFFFFu;
        aw[k] = socx_i8_f_bits(w[k]) & 0x7FFFFFFFu;
    }
    uint32_t pm = 0, pw = 0;
    for (int k = 0; k < 16; k++) {
        pm = am[k] > pm ? am[k] : pm;
        pw = aw[k] > pw ? aw[k] : pw;
    }
    const float peak_m = socx_i8_bits_f(pm), peak_v = socx_i8_bits_f(pw);
    const float scale_m = peak_m / 127.0f, scale_v = peak_v / 255.0f;
    /* the reference's `top / peak` is torch's scalar-over-tensor division, reciprocal(peak) * top: two roundings */
    const float inv_m = peak_m > 0.0f ? (1.0f / peak_m) * 127.0f : 0.0f;
    const float inv_v = peak_v > 0.0f ? (1.0f / peak_v) * 255.0f : 0.0f;
    for (int k = 0; k < 16; k++) {
        float y = socx_i8_bits_f(am[k]) * inv_m;
        y = y < 127.0f ? y : 127.0f;
        int32_t q = (int32_t)(y + um[k]);
        q = m[k] < 0.0f ? -q : q;
        cm[k] = (uint8_t)q;
        float z = socx_i8_bits_f(aw[k]) * inv_v;
        z = z < 255.0f ? z : 255.0f;
        int32_t s = (int32_t)(z + uv[k]);
        s = (s == 0 && v[k] > 0.0f) ? 1 : s;
        cv[k] = (uint8_t)s;
    }
    if (!FULL)
        for (int k = len; k < 16; k++) cm[k] = cv[k] = 0;
    uint8_t *mo = x->m8_out + 20 * j, *vo = x->v8_out + 20 * j;
    memcpy(mo, cm, 16);
    memcpy(mo + 16, &scale_m, 4);
    memcpy(vo, cv, 16);
    memcpy(vo + 16, &scale_v, 4);
}

SOCX_I8_AI double socx_i8_step_impl(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1,
                                    const int GBF16, const int OUT16) {
    socx_i8_ctx x = {b->p_in, b->g_f32, b->g_bf16, b->m8_in, b->v8_in, b->p_out, b->p_bf16_out, b->m8_out,
                     b->v8_out, b->round_seed, c->gscale, c->l2, c->decay, c->w1, c->omw1, c->b2, c->omb2,
                     c->bc2s, c->step_size, c->eps, c->use_l2, c->lerp_small};
    double lanes[16] = {0};
    int64_t q = i0;
    for (; q + 16 <= i1; q += 16) socx_i8_block(&x, q, 16, 1, GBF16, OUT16, lanes);
    if (q < i1) socx_i8_block(&x, q, (int)(i1 - q), 0, GBF16, OUT16, lanes);
    return socx_reduce16(lanes);
}

/* The int8 step of one dispatcher block [i0, i1) (i0 a multiple of 16), for a path's socx_step_<isa>. */
SOCX_I8_AI double socx_int8_step(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    const int gb = b->g_bf16 != NULL, o16 = b->p_bf16_out != NULL;
    if (!gb && !o16) return socx_i8_step_impl(b, c, i0, i1, 0, 0);
    if (!gb && o16) return socx_i8_step_impl(b, c, i0, i1, 0, 1);
    if (gb && !o16) return socx_i8_step_impl(b, c, i0, i1, 1, 0);
    return socx_i8_step_impl(b, c, i0, i1, 1, 1);
}

/* Ceiling with int8 moments: reads p, g and both moment buffers, writes p, both moment buffers (and the bf16
 * copy), regular stores, integer moves only; v's codes are XORed with (g AND zero), zero = c->use_l2 = 0 at run
 * time, so the gradient is really read. */
SOCX_I8_AI void socx_int8_copy(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    const uint32_t zero = (uint32_t)c->use_l2;
    const uint32_t *p = (const uint32_t *)b->p_in, *g32 = (const uint32_t *)b->g_f32;
    const uint16_t *g16 = b->g_bf16;
    uint32_t *po = (uint32_t *)b->p_out;
    uint16_t *p16 = b->p_bf16_out;
    const uint8_t *mi = b->m8_in, *vi = b->v8_in;
    uint8_t *mo = b->m8_out, *vo = b->v8_out;
    for (int64_t q = i0; q < i1; q += 16) {
        const int len = i1 - q < 16 ? (int)(i1 - q) : 16;
        const int64_t j = 20 * (q >> 4);
        uint8_t cm[20], cv[20];
        memcpy(cm, mi + j, 20);
        memcpy(cv, vi + j, 20);
        if (len == 16) {
            uint32_t pl[16];
            uint8_t gz[16];
            for (int k = 0; k < 16; k++) {
                pl[k] = p[q + k];
                gz[k] = (uint8_t)((g32 ? g32[q + k] : (uint32_t)g16[q + k]) & zero);
            }
            for (int k = 0; k < 16; k++) cv[k] ^= gz[k];
            memcpy(po + q, pl, sizeof pl);
            if (p16)
                for (int k = 0; k < 16; k++) p16[q + k] = (uint16_t)(pl[k] >> 16);
        } else {
            for (int k = 0; k < len; k++) {
                uint32_t pk = p[q + k];
                cv[k] ^= (uint8_t)((g32 ? g32[q + k] : (uint32_t)g16[q + k]) & zero);
                po[q + k] = pk;
                if (p16) p16[q + k] = (uint16_t)(pk >> 16);
            }
        }
        memcpy(mo + j, cm, 20);
        memcpy(vo + j, cv, 20);
    }
}

#endif
