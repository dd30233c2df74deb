/* SVE path (Neoverse V1/V2 e.g. Graviton3, Grace; A64FX). Vector-length agnostic: one vector of
 * svcntw() elements per iteration, the block tail handled by the loop predicate, so every element goes
 * through the same vector arithmetic. Enabled for this file by the target pragma and called only when
 * the kernel reports HWCAP_SVE. Non-temporal stores (STNT1) for ping-pong outputs, as on x86.
 *
 * The parameters, moments and bf16 output are bitwise identical to the other paths. The sum of squares
 * uses even/odd double lanes whose number depends on the vector length, so it may differ from the
 * 16-lane paths in the last bits (csrc/tests/adam_harness.c checks it to 1e-12 relative). */
#include "adam_internal.h"
#include "adam_int8.h"

#if SOCX_HAVE_SVE
#pragma GCC target("+sve")
#include <arm_sve.h>

#define AI static inline __attribute__((always_inline))

/* zero-extending 16->32 load; inactive lanes read as 0 */
AI svfloat32_t bf16_to_f32(svbool_t pg, const uint16_t *src) {
    return svreinterpret_f32_u32(svlsl_n_u32_x(pg, svld1uh_u32(pg, src), 16));
}

/* Same rounding as socx_f32_to_bf16: RNE via the integer bias, every NaN -> 0xFFFF (32-bit lanes). */
AI svuint32_t f32_to_bf16(svbool_t pg, svfloat32_t x) {
    svuint32_t u = svreinterpret_u32_f32(x);
    svuint32_t lsb = svand_n_u32_x(pg, svlsr_n_u32_x(pg, u, 16), 1);
    svuint32_t r = svlsr_n_u32_x(pg, svadd_u32_x(pg, svadd_n_u32_x(pg, u, 0x7FFF), lsb), 16);
    return svsel_u32(svcmpuo_f32(pg, x, x), svdup_n_u32(0xFFFF), r);
}

/* socx_round_bits of the lanes' elements i, i+1, ... (the same integer hash) */
AI svuint32_t round_bits(svbool_t pg, uint32_t seed, int64_t i) {
    svuint32_t idx = svindex_u32((uint32_t)i, 1);
    svuint32_t x = svadd_n_u32_x(pg, svmul_n_u32_x(pg, idx, 0x9E3779B9u), seed);
    x = sveor_u32_x(pg, x, svlsr_n_u32_x(pg, x, 16));
    x = svmul_n_u32_x(pg, x, 0x7FEB352Du);
    x = sveor_u32_x(pg, x, svlsr_n_u32_x(pg, x, 15));
    x = svmul_n_u32_x(pg, x, 0x846CA68Bu);
    return sveor_u32_x(pg, x, svlsr_n_u32_x(pg, x, 16));
}

/* Same rounding as socx_f32_to_bf16_sr (the low 16 bits of r added below the kept bits, every NaN -> 0xFFFF). */
AI svuint32_t f32_to_bf16_sr(svbool_t pg, svfloat32_t x, svuint32_t r) {
    svuint32_t t = svlsr_n_u32_x(pg, svadd_u32_x(pg, svreinterpret_u32_f32(x), svand_n_u32_x(pg, r, 0xFFFF)), 16);
    return svsel_u32(svcmpuo_f32(pg, x, x), svdup_n_u32(0xFFFF), t);
}

/* squares of all lanes of g (inactive lanes must be +0) into the even/odd double accumulators */
AI void sq_acc(svfloat32_t g, svfloat64_t *ev, svfloat64_t *od) {
    const svbool_t all = svptrue_b64();
    svfloat64_t e = svcvt_f64_f32_x(all, g);  /* the even-numbered 32-bit lanes */
    svfloat64_t o = svcvt_f64_f32_x(all, svreinterpret_f32_u64(svlsr_n_u64_x(all, svreinterpret_u64_f32(g), 32)));
    *ev = svadd_f64_x(all, *ev, svmul_f64_x(all, e, e));
    *od = svadd_f64_x(all, *od, svmul_f64_x(all, o, o));
}

AI double finish(svfloat64_t ev, svfloat64_t od) {
    const svbool_t all = svptrue_b64();
    return svadda_f64(all, svadda_f64(all, 0.0, ev), od);  /* strictly ordered: deterministic */
}

AI double step_impl(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1, const int GBF16,
                    const int OUT16, const int STREAM, const int MB16) {
    svfloat64_t ev = svdup_n_f64(0.0), od = svdup_n_f64(0.0);
    const svfloat32_t gscale = svdup_n_f32(c->gscale), l2 = svdup_n_f32(c->l2), decay = svdup_n_f32(c->decay),
                      w1 = svdup_n_f32(c->w1), omw1 = svdup_n_f32(c->omw1), b2 = svdup_n_f32(c->b2),
                      omb2 = svdup_n_f32(c->omb2), bc2s = svdup_n_f32(c->bc2s), ss = svdup_n_f32(c->step_size),
                      eps = svdup_n_f32(c->eps);
    for (int64_t i = i0; i < i1; i += (int64_t)svcntw()) {
        svbool_t pg = svwhilelt_b32_s64(i, i1);
        svfloat32_t g = GBF16 ? bf16_to_f32(pg, b->g_bf16 + i) : svld1_f32(pg, b->g_f32 + i);
        svfloat32_t p = svld1_f32(pg, b->p_in + i);
        svfloat32_t m = MB16 ? bf16_to_f32(pg, b->m16_in + i) : svld1_f32(pg, b->m_in + i);
        svfloat32_t v = MB16 ? bf16_to_f32(pg, b->v16_in + i) : svld1_f32(pg, b->v_in + i);
        g = svmul_f32_z(pg, g, gscale);
        sq_acc(g, &ev, &od);
        if (c->use_l2) g = svadd_f32_x(pg, g, svmul_f32_x(pg, l2, p));
        p = svmul_f32_x(pg, p, decay);
        svfloat32_t d = svsub_f32_x(pg, g, m);
        if (c->lerp_small)
            m = svadd_f32_x(pg, m, svmul_f32_x(pg, w1, d));
        else
            m = svsub_f32_x(pg, g, svmul_f32_x(pg, d, omw1));
        v = svadd_f32_x(pg, svmul_f32_x(pg, v, b2), svmul_f32_x(pg, svmul_f32_x(pg, omb2, g), g));
        svfloat32_t den = svadd_f32_x(pg, svdiv_f32_x(pg, svsqrt_f32_x(pg, v), bc2s), eps);
        p = svsub_f32_x(pg, p, svdiv_f32_x(pg, svmul_f32_x(pg, ss, m), den));
        if (MB16) {  /* no narrowing non-temporal store in SVE: the 2-byte moments use regular ones */
            svuint32_t r = round_bits(pg, b->round_seed, i);
            if (STREAM)
                svstnt1_f32(pg, b->p_out + i, p);
            else
                svst1_f32(pg, b->p_out + i, p);
            svst1h_u32(pg, b->m16_out + i, f32_to_bf16_sr(pg, m, r));
            svst1h_u32(pg, b->v16_out + i, f32_to_bf16_sr(pg, v, svlsr_n_u32_x(pg, r, 16)));
        } else if (STREAM) {
            svstnt1_f32(pg, b->p_out + i, p);
            svstnt1_f32(pg, b->m_out + i, m);
            svstnt1_f32(pg, b->v_out + i, v);
        } else {
            svst1_f32(pg, b->p_out + i, p);
            svst1_f32(pg, b->m_out + i, m);
            svst1_f32(pg, b->v_out + i, v);
        }
        if (OUT16) svst1h_u32(pg, b->p_bf16_out + i, f32_to_bf16(pg, p));
    }
    return finish(ev, od);
}

double socx_step_sve(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    SOCX_DISPATCH_STEP(step_impl);
}

double socx_sumsq_sve(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1) {
    svfloat64_t ev = svdup_n_f64(0.0), od = svdup_n_f64(0.0);
    for (int64_t i = i0; i < i1; i += (int64_t)svcntw()) {
        svbool_t pg = svwhilelt_b32_s64(i, i1);
        svfloat32_t g = g32 ? svld1_f32(pg, g32 + i) : bf16_to_f32(pg, g16 + i);
        sq_acc(svsel_f32(pg, g, svdup_n_f32(0.0f)), &ev, &od);
    }
    return finish(ev, od);
}

void socx_copy_sve(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    if (b->m8_in) {  /* int8 moments: their bytes (adam_int8.h) */
        socx_int8_copy(b, c, i0, i1);
        return;
    }
    const svuint32_t zero = svdup_n_u32((uint32_t)c->use_l2);
    if (b->m16_in) {  /* bf16 moments: the step's 2-byte loads and stores */
        for (int64_t i = i0; i < i1; i += (int64_t)svcntw()) {
            svbool_t pg = svwhilelt_b32_s64(i, i1);
            svuint32_t g = b->g_f32 ? svld1_u32(pg, (const uint32_t *)b->g_f32 + i) : svld1uh_u32(pg, b->g_bf16 + i);
            svuint32_t p = svld1_u32(pg, (const uint32_t *)b->p_in + i);
            if (c->stream)
                svstnt1_u32(pg, (uint32_t *)b->p_out + i, p);
            else
                svst1_u32(pg, (uint32_t *)b->p_out + i, p);
            svst1h_u32(pg, b->m16_out + i, svld1uh_u32(pg, b->m16_in + i));
            svst1h_u32(pg, b->v16_out + i, sveor_u32_x(pg, svld1uh_u32(pg, b->v16_in + i), svand_u32_x(pg, g, zero)));
            if (b->p_bf16_out) svst1h_u32(pg, b->p_bf16_out + i, svlsr_n_u32_x(pg, p, 16));
        }
        return;
    }
    for (int64_t i = i0; i < i1; i += (int64_t)svcntw()) {
        svbool_t pg = svwhilelt_b32_s64(i, i1);
        svuint32_t g = b->g_f32 ? svld1_u32(pg, (const uint32_t *)b->g_f32 + i) : svld1uh_u32(pg, b->g_bf16 + i);
        svuint32_t p = svld1_u32(pg, (const uint32_t *)b->p_in + i);
        svuint32_t m = svld1_u32(pg, (const uint32_t *)b->m_in + i);
        svuint32_t v = sveor_u32_x(pg, svld1_u32(pg, (const uint32_t *)b->v_in + i), svand_u32_x(pg, g, zero));
        if (c->stream) {
            svstnt1_u32(pg, (uint32_t *)b->p_out + i, p);
            svstnt1_u32(pg, (uint32_t *)b->m_out + i, m);
            svstnt1_u32(pg, (uint32_t *)b->v_out + i, v);
        } else {
            svst1_u32(pg, (uint32_t *)b->p_out + i, p);
            svst1_u32(pg, (uint32_t *)b->m_out + i, m);
            svst1_u32(pg, (uint32_t *)b->v_out + i, v);
        }
        if (b->p_bf16_out) svst1h_u32(pg, b->p_bf16_out + i, svlsr_n_u32_x(pg, p, 16));
    }
}
#endif
