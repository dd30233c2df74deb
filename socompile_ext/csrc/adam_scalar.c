/* Portable scalar path: the reference every vector path must match bit for bit, and the fallback on CPUs
 * without a vector path compiled in. Built with the baseline flags of the target. */
#include "adam_internal.h"
#include "adam_int8.h"

double socx_step_scalar(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    if (b->m8_in) return socx_int8_step(b, c, i0, i1);
    double lanes[16] = {0};
    socx_step_tail(b, c, i0, i0, i1, lanes);
    return socx_reduce16(lanes);
}

double socx_sumsq_scalar(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1) {
    double lanes[16] = {0};
    socx_sumsq_tail(g32, g16, i0, i0, i1, lanes);
    return socx_reduce16(lanes);
}

/* Ceiling pass: same loads and stores as the step, integer moves only. v_out is v XOR (g AND zero), with
 * zero = c->use_l2, which the dispatcher sets to 0 at run time: the compiler cannot drop the gradient load. */
void socx_copy_scalar(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    if (b->m8_in) {  /* int8 moments: their bytes (adam_int8.h) */
        socx_int8_copy(b, c, i0, i1);
        return;
    }
    uint32_t zero = (uint32_t)c->use_l2;
    const uint32_t *p = (const uint32_t *)b->p_in, *m = (const uint32_t *)b->m_in, *v = (const uint32_t *)b->v_in;
    uint32_t *po = (uint32_t *)b->p_out, *mo = (uint32_t *)b->m_out, *vo = (uint32_t *)b->v_out;
    for (int64_t i = i0; i < i1; i++) {
        uint32_t g = b->g_f32 ? ((const uint32_t *)b->g_f32)[i] : (uint32_t)b->g_bf16[i];
        uint32_t pv = p[i];
        po[i] = pv;
        if (b->m16_in) {  /* bf16 moments: the step's 2-byte loads and stores */
            b->m16_out[i] = b->m16_in[i];
            b->v16_out[i] = (uint16_t)(b->v16_in[i] ^ (g & zero));
        } else {
            mo[i] = m[i];
            vo[i] = v[i] ^ (g & zero);
        }
        if (b->p_bf16_out) b->p_bf16_out[i] = (uint16_t)(pv >> 16);
    }
}
