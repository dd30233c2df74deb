/* AVX-512 path (F + BW + VL + DQ: Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4 and later).
 *
 * Compiled with the baseline flags of the build like every file; the target pragma below enables the
 * instructions for this file only, and the dispatcher calls into it only when the CPU reports them, so
 * one binary runs on any x86-64. 16 fp32 elements per iteration; the tail of a block uses masked loads and
 * stores, so every element goes through the same vector arithmetic. */
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2")
#include <immintrin.h>

#include "adam_internal.h"
#include "adam_int8.h"

#define AI static inline __attribute__((always_inline))

AI __m512 bf16_to_f32_16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Same rounding as socx_f32_to_bf16: RNE via the integer bias, every NaN -> 0xFFFF. */
AI __m256i f32_to_bf16_16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), r);
    return _mm512_cvtepi32_epi16(r);
}

/* socx_round_bits of elements i .. i+15 (the same integer hash, 16 lanes). */
AI __m512i round_bits16(uint32_t seed, int64_t i) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)i), lane);
    __m512i x = _mm512_add_epi32(_mm512_set1_epi32((int)seed), _mm512_mullo_epi32(idx, _mm512_set1_epi32((int)0x9E3779B9u)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* Same rounding as socx_f32_to_bf16_sr: the low 16 bits of r added below the kept bits, every NaN -> 0xFFFF. */
AI __m256i f32_to_bf16_sr_16(__m512 x, __m512i r) {
    __m512i u = _mm512_add_epi32(_mm512_castps_si512(x), _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF)));
    __m512i t = _mm512_srli_epi32(u, 16);
    __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    t = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), t);
    return _mm512_cvtepi32_epi16(t);
}

/* One vector of the step. FULL: all 16 lanes, plain (or streaming) loads/stores; otherwise lanes in k.
 * MB16: bf16 moments (loaded exactly, stored stochastically rounded). */
AI void step16(const socx_buffers *b, const socx_consts *c, int64_t i, __mmask16 k, const int FULL,
               const int GBF16, const int OUT16, const int STREAM, const int MB16, __m512d *acc_lo,
               __m512d *acc_hi) {
    __m512 g, p, m, v;
    if (FULL) {
        g = GBF16 ? bf16_to_f32_16(_mm256_loadu_si256((const __m256i *)(b->g_bf16 + i))) : _mm512_loadu_ps(b->g_f32 + i);
        p = _mm512_loadu_ps(b->p_in + i);
        m = MB16 ? bf16_to_f32_16(_mm256_loadu_si256((const __m256i *)(b->m16_in + i))) : _mm512_loadu_ps(b->m_in + i);
        v = MB16 ? bf16_to_f32_16(_mm256_loadu_si256((const __m256i *)(b->v16_in + i))) : _mm512_loadu_ps(b->v_in + i);
    } else {
        g = GBF16 ? bf16_to_f32_16(_mm256_maskz_loadu_epi16(k, b->g_bf16 + i)) : _mm512_maskz_loadu_ps(k, b->g_f32 + i);
        p = _mm512_maskz_loadu_ps(k, b->p_in + i);
        m = MB16 ? bf16_to_f32_16(_mm256_maskz_loadu_epi16(k, b->m16_in + i)) : _mm512_maskz_loadu_ps(k, b->m_in + i);
        v = MB16 ? bf16_to_f32_16(_mm256_maskz_loadu_epi16(k, b->v16_in + i)) : _mm512_maskz_loadu_ps(k, b->v_in + i);
    }
    g = _mm512_mul_ps(g, _mm512_set1_ps(c->gscale));
    /* squares in double; masked-off lanes hold +0 and add nothing */
    __m512d glo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    __m512d ghi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
    *acc_lo = _mm512_add_pd(*acc_lo, _mm512_mul_pd(glo, glo));
    *acc_hi = _mm512_add_pd(*acc_hi, _mm512_mul_pd(ghi, ghi));

    if (c->use_l2) g = _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(c->l2), p));
    p = _mm512_mul_ps(p, _mm512_set1_ps(c->decay));
    __m512 d = _mm512_sub_ps(g, m);
    if (c->lerp_small)
        m = _mm512_add_ps(m, _mm512_mul_ps(_mm512_set1_ps(c->w1), d));
    else
        m = _mm512_sub_ps(g, _mm512_mul_ps(d, _mm512_set1_ps(c->omw1)));
    v = _mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(c->b2)), _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(c->omb2), g), g));
    __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c->bc2s)), _mm512_set1_ps(c->eps));
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->step_size), m), den));

    if (MB16) {
        __m512i r = round_bits16(b->round_seed, i);
        __m256i mh = f32_to_bf16_sr_16(m, r), vh = f32_to_bf16_sr_16(v, _mm512_srli_epi32(r, 16));
        if (FULL && STREAM) {
            _mm512_stream_ps(b->p_out + i, p);
            _mm256_stream_si256((__m256i *)(b->m16_out + i), mh);
            _mm256_stream_si256((__m256i *)(b->v16_out + i), vh);
        } else if (FULL) {
            _mm512_storeu_ps(b->p_out + i, p);
            _mm256_storeu_si256((__m256i *)(b->m16_out + i), mh);
            _mm256_storeu_si256((__m256i *)(b->v16_out + i), vh);
        } else {
            _mm512_mask_storeu_ps(b->p_out + i, k, p);
            _mm256_mask_storeu_epi16(b->m16_out + i, k, mh);
            _mm256_mask_storeu_epi16(b->v16_out + i, k, vh);
        }
    } else if (FULL && STREAM) {
        _mm512_stream_ps(b->p_out + i, p);
        _mm512_stream_ps(b->m_out + i, m);
        _mm512_stream_ps(b->v_out + i, v);
    } else if (FULL) {
        _mm512_storeu_ps(b->p_out + i, p);
        _mm512_storeu_ps(b->m_out + i, m);
        _mm512_storeu_ps(b->v_out + i, v);
    } else {
        _mm512_mask_storeu_ps(b->p_out + i, k, p);
        _mm512_mask_storeu_ps(b->m_out + i, k, m);
        _mm512_mask_storeu_ps(b->v_out + i, k, v);
    }
    if (OUT16) {
        __m256i h = f32_to_bf16_16(p);
        if (FULL && c->stream_bf16)
            _mm256_stream_si256((__m256i *)(b->p_bf16_out + i), h);
        else if (FULL)
            _mm256_storeu_si256((__m256i *)(b->p_bf16_out + i), h);
        else
            _mm256_mask_storeu_epi16(b->p_bf16_out + i, k, h);
    }
}

/* Sum-of-squares lanes when the vector loop is shifted by h elements (a streaming head): vector position j
 * then holds logical lane (h + j) % 16 (see the NOTE in adam_internal.h). The head's squares, already in
 * logical lanes, seed the accumulators so every lane still adds its elements in element order. */
AI void lanes_to_positions(const double *logical, int64_t h, __m512d *lo, __m512d *hi) {
    double pos[16];
    for (int j = 0; j < 16; j++) pos[j] = logical[(h + j) & 15];
    *lo = _mm512_loadu_pd(pos);
    *hi = _mm512_loadu_pd(pos + 8);
}

AI void positions_to_lanes(__m512d lo, __m512d hi, int64_t h, double *logical) {
    double pos[16];
    _mm512_storeu_pd(pos, lo);
    _mm512_storeu_pd(pos + 8, hi);
    for (int j = 0; j < 16; j++) logical[(h + j) & 15] = pos[j];
}

AI double step_impl(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1, const int GBF16,
                    const int OUT16, const int STREAM, const int MB16) {
    __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
    double lanes[16];
    int64_t i = i0, h = 0;
    const int any_stream = STREAM || (OUT16 && c->stream_bf16);
    if (any_stream) {
        /* regular (masked) stores up to the first 64-byte boundary of the streamed outputs */
        h = socx_stream_head(c, i0, i1);
        if (h > 0) {
            step16(b, c, i, (__mmask16)((1u << h) - 1u), 0, GBF16, OUT16, STREAM, MB16, &acc_lo, &acc_hi);
            _mm512_storeu_pd(lanes, acc_lo);
            _mm512_storeu_pd(lanes + 8, acc_hi);
            lanes_to_positions(lanes, h, &acc_lo, &acc_hi);
            i += h;
        }
    }
    const int64_t pf = c->prefetch;
    for (; i + 16 <= i1; i += 16) {
        if (pf) {  /* software prefetch of the input streams, pf elements ahead (off by default) */
            _mm_prefetch((const char *)(b->p_in + i + pf), _MM_HINT_T0);
            _mm_prefetch(MB16 ? (const char *)(b->m16_in + i + pf) : (const char *)(b->m_in + i + pf), _MM_HINT_T0);
            _mm_prefetch(MB16 ? (const char *)(b->v16_in + i + pf) : (const char *)(b->v_in + i + pf), _MM_HINT_T0);
            _mm_prefetch(GBF16 ? (const char *)(b->g_bf16 + i + pf) : (const char *)(b->g_f32 + i + pf), _MM_HINT_T0);
        }
        step16(b, c, i, 0xFFFF, 1, GBF16, OUT16, STREAM, MB16, &acc_lo, &acc_hi);
    }
    if (i < i1) {
        __mmask16 k = (__mmask16)((1u << (i1 - i)) - 1u);
        step16(b, c, i, k, 0, GBF16, OUT16, STREAM, MB16, &acc_lo, &acc_hi);
    }
    if (any_stream) _mm_sfence();
    if (h > 0) {
        positions_to_lanes(acc_lo, acc_hi, h, lanes);
    } else {
        _mm512_storeu_pd(lanes, acc_lo);
        _mm512_storeu_pd(lanes + 8, acc_hi);
    }
    return socx_reduce16(lanes);
}

double socx_step_avx512(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    SOCX_DISPATCH_STEP(step_impl);
}

double socx_sumsq_avx512(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1) {
    __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
    for (int64_t i = i0; i < i1; i += 16) {
        __mmask16 k = (i + 16 <= i1) ? (__mmask16)0xFFFF : (__mmask16)((1u << (i1 - i)) - 1u);
        __m512 g = g32 ? _mm512_maskz_loadu_ps(k, g32 + i) : bf16_to_f32_16(_mm256_maskz_loadu_epi16(k, g16 + i));
        __m512d glo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
        __m512d ghi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
        acc_lo = _mm512_add_pd(acc_lo, _mm512_mul_pd(glo, glo));
        acc_hi = _mm512_add_pd(acc_hi, _mm512_mul_pd(ghi, ghi));
    }
    double lanes[16];
    _mm512_storeu_pd(lanes, acc_lo);
    _mm512_storeu_pd(lanes + 8, acc_hi);
    return socx_reduce16(lanes);
}

/* Ceiling: the step's loads and stores, integer moves only (v_out = v ^ (g & zero), zero known only at run
 * time so the gradient stream is really read). */
void socx_copy_avx512(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    if (b->m8_in) {  /* int8 moments: their bytes (adam_int8.h) */
        socx_int8_copy(b, c, i0, i1);
        return;
    }
    const __m512i zero = _mm512_set1_epi32(c->use_l2);
    const int any_stream = c->stream || (b->p_bf16_out && c->stream_bf16);
    /* with streaming, the first vector covers only the head up to the 64-byte boundary (regular stores) */
    int64_t i = i0, step = any_stream ? socx_stream_head(c, i0, i1) : 16;
    if (step == 0) step = 16;
    const int64_t pf = c->prefetch;
    for (; i < i1; i += step, step = 16) {
        const int64_t len = step < i1 - i ? step : i1 - i;
        if (pf) {
            _mm_prefetch((const char *)(b->p_in + i + pf), _MM_HINT_T0);
            _mm_prefetch(b->m16_in ? (const char *)(b->m16_in + i + pf) : (const char *)(b->m_in + i + pf), _MM_HINT_T0);
            _mm_prefetch(b->v16_in ? (const char *)(b->v16_in + i + pf) : (const char *)(b->v_in + i + pf), _MM_HINT_T0);
            _mm_prefetch(b->g_f32 ? (const char *)(b->g_f32 + i + pf) : (const char *)(b->g_bf16 + i + pf), _MM_HINT_T0);
        }
        const int full = len == 16;
        __mmask16 k = full ? (__mmask16)0xFFFF : (__mmask16)((1u << len) - 1u);
        __m512i g = b->g_f32 ? _mm512_maskz_loadu_epi32(k, b->g_f32 + i)
                             : _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, b->g_bf16 + i));
        __m512i p = _mm512_maskz_loadu_epi32(k, b->p_in + i);
        if (b->m16_in) {  /* bf16 moments: the step's 2-byte loads and stores */
            __m256i m = _mm256_maskz_loadu_epi16(k, b->m16_in + i);
            __m256i v = _mm256_xor_si256(_mm256_maskz_loadu_epi16(k, b->v16_in + i),
                                         _mm512_cvtepi32_epi16(_mm512_and_si512(g, zero)));
            if (full && c->stream) {
                _mm512_stream_si512((__m512i *)(b->p_out + i), p);
                _mm256_stream_si256((__m256i *)(b->m16_out + i), m);
                _mm256_stream_si256((__m256i *)(b->v16_out + i), v);
            } else {
                _mm512_mask_storeu_epi32(b->p_out + i, k, p);
                _mm256_mask_storeu_epi16(b->m16_out + i, k, m);
                _mm256_mask_storeu_epi16(b->v16_out + i, k, v);
            }
        } else {
            __m512i m = _mm512_maskz_loadu_epi32(k, b->m_in + i);
            __m512i v = _mm512_xor_si512(_mm512_maskz_loadu_epi32(k, b->v_in + i), _mm512_and_si512(g, zero));
            if (full && c->stream) {
                _mm512_stream_si512((__m512i *)(b->p_out + i), p);
                _mm512_stream_si512((__m512i *)(b->m_out + i), m);
                _mm512_stream_si512((__m512i *)(b->v_out + i), v);
            } else {
                _mm512_mask_storeu_epi32(b->p_out + i, k, p);
                _mm512_mask_storeu_epi32(b->m_out + i, k, m);
                _mm512_mask_storeu_epi32(b->v_out + i, k, v);
            }
        }
        if (b->p_bf16_out) {
            __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(p, 16));
            if (full && c->stream_bf16)
                _mm256_stream_si256((__m256i *)(b->p_bf16_out + i), h);
            else
                _mm256_mask_storeu_epi16(b->p_bf16_out + i, k, h);
        }
    }
    if (any_stream) _mm_sfence();
}
#endif
