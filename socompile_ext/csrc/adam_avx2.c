/* AVX2 path (Haswell / Zen 1 and later). Same structure as the AVX-512 file: enabled for this file by the
 * target pragma, called only when the CPU reports AVX2. 16 elements (two vectors) per iteration so the
 * sum of squares lands in the same 16 lanes as every other path; the tail (< 16) is finished by the
 * scalar element function, which performs the identical fp32 arithmetic. */
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,bmi2")
#include <immintrin.h>

#include "adam_internal.h"
#include "adam_int8.h"

#define AI static inline __attribute__((always_inline))

AI __m256 bf16_to_f32_8(const uint16_t *src) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* Same rounding as socx_f32_to_bf16 (RNE, every NaN -> 0xFFFF), 8 lanes packed to 8 x u16 in order. */
AI __m128i f32_to_bf16_8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
    r = _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), r, ordered);
    /* values are <= 0xFFFF, so the unsigned-saturating pack is exact */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* socx_round_bits of elements i .. i+7 (the same integer hash, 8 lanes). */
AI __m256i round_bits8(uint32_t seed, int64_t i) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)i), lane);
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32((int)seed), _mm256_mullo_epi32(idx, _mm256_set1_epi32((int)0x9E3779B9u)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846CA68Bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* Same rounding as socx_f32_to_bf16_sr (the low 16 bits of r added below the kept bits, every NaN -> 0xFFFF). */
AI __m128i f32_to_bf16_sr_8(__m256 x, __m256i r) {
    __m256i u = _mm256_add_epi32(_mm256_castps_si256(x), _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF)));
    __m256i t = _mm256_srli_epi32(u, 16);
    __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
    t = _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), t, ordered);
    return _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

AI __m256 bf16x8_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AI void sq_acc(__m256 g, __m256d *lo, __m256d *hi) {
    __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
    __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
    *lo = _mm256_add_pd(*lo, _mm256_mul_pd(a, a));
    *hi = _mm256_add_pd(*hi, _mm256_mul_pd(b, b));
}

AI void step8(const socx_buffers *b, const socx_consts *c, int64_t i, const int GBF16, const int OUT16,
              const int STREAM, const int MB16, __m256d *acc_lo, __m256d *acc_hi) {
    __m256 g = GBF16 ? bf16_to_f32_8(b->g_bf16 + i) : _mm256_loadu_ps(b->g_f32 + i);
    __m256 p = _mm256_loadu_ps(b->p_in + i);
    __m256 m = MB16 ? bf16_to_f32_8(b->m16_in + i) : _mm256_loadu_ps(b->m_in + i);
    __m256 v = MB16 ? bf16_to_f32_8(b->v16_in + i) : _mm256_loadu_ps(b->v_in + i);
    g = _mm256_mul_ps(g, _mm256_set1_ps(c->gscale));
    sq_acc(g, acc_lo, acc_hi);
    if (c->use_l2) g = _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(c->l2), p));
    p = _mm256_mul_ps(p, _mm256_set1_ps(c->decay));
    __m256 d = _mm256_sub_ps(g, m);
    if (c->lerp_small)
        m = _mm256_add_ps(m, _mm256_mul_ps(_mm256_set1_ps(c->w1), d));
    else
        m = _mm256_sub_ps(g, _mm256_mul_ps(d, _mm256_set1_ps(c->omw1)));
    v = _mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(c->b2)), _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(c->omb2), g), g));
    __m256 den = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(c->bc2s)), _mm256_set1_ps(c->eps));
    p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c->step_size), m), den));
    if (MB16) {
        __m256i r = round_bits8(b->round_seed, i);
        __m128i mh = f32_to_bf16_sr_8(m, r), vh = f32_to_bf16_sr_8(v, _mm256_srli_epi32(r, 16));
        if (STREAM) {
            _mm256_stream_ps(b->p_out + i, p);
            _mm_stream_si128((__m128i *)(b->m16_out + i), mh);
            _mm_stream_si128((__m128i *)(b->v16_out + i), vh);
        } else {
            _mm256_storeu_ps(b->p_out + i, p);
            _mm_storeu_si128((__m128i *)(b->m16_out + i), mh);
            _mm_storeu_si128((__m128i *)(b->v16_out + i), vh);
        }
    } else if (STREAM) {
        _mm256_stream_ps(b->p_out + i, p);
        _mm256_stream_ps(b->m_out + i, m);
        _mm256_stream_ps(b->v_out + i, v);
    } else {
        _mm256_storeu_ps(b->p_out + i, p);
        _mm256_storeu_ps(b->m_out + i, m);
        _mm256_storeu_ps(b->v_out + i, v);
    }
    if (OUT16) {
        __m128i h = f32_to_bf16_8(p);
        if (c->stream_bf16)
            _mm_stream_si128((__m128i *)(b->p_bf16_out + i), h);
        else
            _mm_storeu_si128((__m128i *)(b->p_bf16_out + i), h);
    }
}

AI double step_impl(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1, const int GBF16,
                    const int OUT16, const int STREAM, const int MB16) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
    double lanes[16] = {0}, pos[16];
    int64_t i = i0, h = 0;
    const int any_stream = STREAM || (OUT16 && c->stream_bf16);
    if (any_stream) {
        /* scalar elements (regular stores) up to the first 64-byte boundary of the streamed outputs; vector
         * position j then holds logical lane (h + j) % 16, seeded with the head's squares (NOTE in
         * adam_internal.h: every lane still adds its elements in element order) */
        h = socx_stream_head(c, i0, i1);
        if (h > 0) {
            socx_step_tail(b, c, i0, i0, i0 + h, lanes);
            for (int j = 0; j < 16; j++) pos[j] = lanes[(h + j) & 15];
            a0 = _mm256_loadu_pd(pos);
            a1 = _mm256_loadu_pd(pos + 4);
            a2 = _mm256_loadu_pd(pos + 8);
            a3 = _mm256_loadu_pd(pos + 12);
            i += h;
        }
    }
    for (; i + 16 <= i1; i += 16) {
        step8(b, c, i, GBF16, OUT16, STREAM, MB16, &a0, &a1);      /* positions 0-3, 4-7 */
        step8(b, c, i + 8, GBF16, OUT16, STREAM, MB16, &a2, &a3);  /* positions 8-11, 12-15 */
    }
    if (any_stream) _mm_sfence();
    _mm256_storeu_pd(pos, a0);
    _mm256_storeu_pd(pos + 4, a1);
    _mm256_storeu_pd(pos + 8, a2);
    _mm256_storeu_pd(pos + 12, a3);
    for (int j = 0; j < 16; j++) lanes[(h + j) & 15] = pos[j];
    socx_step_tail(b, c, i0, i, i1, lanes);
    return socx_reduce16(lanes);
}

/* ---- int8 moments (format in adam.h): the portable code of adam_int8.h written out in intrinsics, the same
 * fp32 operations in the same order, so the bits are the portable path's (a short last block is finished by
 * the portable code itself). */

/* 16 codes as two vectors of 8 fp32 (signed: int8 codes, else uint8) */
AI void i8_codes_f32(const uint8_t *src, const int SIGNED, __m256 *lo, __m256 *hi) {
    __m128i q = _mm_loadu_si128((const __m128i *)src);
    __m128i h = _mm_srli_si128(q, 8);
    *lo = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q));
    *hi = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h));
}

/* maxima of two sets of 16 non-negative patterns (< 2^31: integer order is fp32 order) as fp32:
 * (max a, max b, max a, max b) */
AI __m128 i8_peaks(__m256i a0, __m256i a1, __m256i b0, __m256i b1) {
    __m256i x = _mm256_max_epi32(a0, a1), y = _mm256_max_epi32(b0, b1);
    __m128i xm = _mm_max_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    __m128i xw = _mm_max_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
    __m128i t = _mm_max_epi32(_mm_unpacklo_epi64(xm, xw), _mm_unpackhi_epi64(xm, xw));  /* a a b b */
    t = _mm_max_epi32(t, _mm_shuffle_epi32(t, 0xB1));                                 /* A A B B */
    return _mm_castsi128_ps(_mm_shuffle_epi32(t, 0x88));                              /* A B A B */
}

/* 16 int32 (in range) -> 16 bytes in order; SIGNED: int8 saturation, else uint8 */
AI __m128i i8_pack16(__m256i lo, __m256i hi, const int SIGNED) {
    __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
    __m128i a = _mm256_castsi256_si128(w), b = _mm256_extracti128_si256(w, 1);
    return SIGNED ? _mm_packs_epi16(a, b) : _mm_packus_epi16(a, b);
}

AI void i8_step8(const socx_i8_ctx *x, int64_t i, __m256 mq, __m256 wq, const int GBF16, __m256 *pn, __m256 *mn,
                 __m256 *vn, __m256 *wn, __m256 *gs) {
    __m256 g = GBF16 ? bf16_to_f32_8(x->g16 + i) : _mm256_loadu_ps(x->g32 + i);
    __m256 p = _mm256_loadu_ps(x->p_in + i);
    __m256 m = mq, v = _mm256_mul_ps(wq, wq);
    g = _mm256_mul_ps(g, _mm256_set1_ps(x->gscale));
    *gs = g;
    if (x->use_l2) g = _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(x->l2), p));
    p = _mm256_mul_ps(p, _mm256_set1_ps(x->decay));
    __m256 d = _mm256_sub_ps(g, m);
    if (x->lerp_small)
        m = _mm256_add_ps(m, _mm256_mul_ps(_mm256_set1_ps(x->w1), d));
    else
        m = _mm256_sub_ps(g, _mm256_mul_ps(d, _mm256_set1_ps(x->omw1)));
    v = _mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(x->b2)),
                      _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(x->omb2), g), g));
    __m256 w = _mm256_sqrt_ps(v);
    __m256 den = _mm256_add_ps(_mm256_div_ps(w, _mm256_set1_ps(x->bc2s)), _mm256_set1_ps(x->eps));
    *pn = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(x->step_size), m), den));
    *mn = m;
    *vn = v;
    *wn = w;
}

/* A block's new fp32 moments (and sqrt(v)), between its step and its encoding. */
typedef struct {
    __m256 m0, m1, v0, v1, w0, w1;
} i8_moments;

/* The step of block [i, i + 16): its loads, the arithmetic, the parameter stores and the squares. Its moments
 * are encoded by i8_encode_avx2 after the next block's step (the encoding's chain of block maximum, division
 * and codes then overlaps that step; measured ~4% faster in cache). In place still works: a block's encoding
 * writes only its own moment bytes, after all of its loads. */
AI i8_moments i8_step_avx2(const socx_i8_ctx *x, int64_t i, const int GBF16, const int OUT16, __m256d acc[4]) {
    const int64_t j = 20 * (i >> 4);
    const uint8_t *mb = x->m8_in + j, *vb = x->v8_in + j;
    float sm, sv;
    memcpy(&sm, mb + 16, 4);
    memcpy(&sv, vb + 16, 4);
    __m256 m0, m1, w0, w1;
    i8_codes_f32(mb, 1, &m0, &m1);
    i8_codes_f32(vb, 0, &w0, &w1);
    m0 = _mm256_mul_ps(m0, _mm256_set1_ps(sm));
    m1 = _mm256_mul_ps(m1, _mm256_set1_ps(sm));
    w0 = _mm256_mul_ps(w0, _mm256_set1_ps(sv));
    w1 = _mm256_mul_ps(w1, _mm256_set1_ps(sv));
    __m256 p0, p1, v0, v1, g0, g1;
    i8_step8(x, i, m0, w0, GBF16, &p0, &m0, &v0, &w0, &g0);
    i8_step8(x, i + 8, m1, w1, GBF16, &p1, &m1, &v1, &w1, &g1);
    sq_acc(g0, &acc[0], &acc[1]);
    sq_acc(g1, &acc[2], &acc[3]);
    _mm256_storeu_ps(x->p_out + i, p0);
    _mm256_storeu_ps(x->p_out + i + 8, p1);
    if (OUT16) {
        _mm_storeu_si128((__m128i *)(x->p16 + i), f32_to_bf16_8(p0));
        _mm_storeu_si128((__m128i *)(x->p16 + i + 8), f32_to_bf16_8(p1));
    }
    i8_moments r = {m0, m1, v0, v1, w0, w1};
    return r;
}

/* The encoding of block [i, i + 16) from its new moments. */
AI void i8_encode_avx2(const socx_i8_ctx *x, int64_t i, i8_moments t) {
    const int64_t j = 20 * (i >> 4);
    const __m256 m0 = t.m0, m1 = t.m1, v0 = t.v0, v1 = t.v1, w0 = t.w0, w1 = t.w1;
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i am0 = _mm256_and_si256(_mm256_castps_si256(m0), abs_mask);
    __m256i am1 = _mm256_and_si256(_mm256_castps_si256(m1), abs_mask);
    __m256i aw0 = _mm256_and_si256(_mm256_castps_si256(w0), abs_mask);
    __m256i aw1 = _mm256_and_si256(_mm256_castps_si256(w1), abs_mask);
    /* the block's four divisions in one vector: (peak_m / 127, peak_v / 255, 1 / peak_m, 1 / peak_v), then
     * inv = peak > 0 ? (1 / peak) * top : 0 in lanes 2, 3 */
    const __m128 pk = i8_peaks(am0, am1, aw0, aw1);  /* pm pw pm pw */
    const __m128 top = _mm_setr_ps(127.0f, 255.0f, 127.0f, 255.0f);
    const __m128 q = _mm_div_ps(_mm_blend_ps(pk, _mm_set1_ps(1.0f), 0xC), _mm_blend_ps(top, pk, 0xC));
    const __m128 inv = _mm_and_ps(_mm_mul_ps(q, top), _mm_cmpgt_ps(pk, _mm_setzero_ps()));
    const float scale_m = _mm_cvtss_f32(q), scale_v = _mm_cvtss_f32(_mm_shuffle_ps(q, q, 1));
    const float inv_m = _mm_cvtss_f32(_mm_shuffle_ps(inv, inv, 2));
    const float inv_v = _mm_cvtss_f32(_mm_shuffle_ps(inv, inv, 3));
    const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
    const __m256 r16 = _mm256_set1_ps(1.0f / 65536.0f), zero = _mm256_setzero_ps();
    __m256i r0 = round_bits8(x->seed, i), r1 = round_bits8(x->seed, i + 8);
    __m256 um0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(r0, lo16)), r16);
    __m256 um1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(r1, lo16)), r16);
    __m256 uv0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r0, 16)), r16);
    __m256 uv1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r1, 16)), r16);
    /* min_ps(y, top) is y < top ? y : top (NaN -> top), the portable select */
    const __m256 im = _mm256_set1_ps(inv_m), t127 = _mm256_set1_ps(127.0f);
#define I8_Y(a, inv, top, u) _mm256_add_ps(_mm256_min_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), inv), top), u)
    __m256i q0 = _mm256_cvttps_epi32(I8_Y(am0, im, t127, um0)), q1 = _mm256_cvttps_epi32(I8_Y(am1, im, t127, um1));
    __m256i n0 = _mm256_castps_si256(_mm256_cmp_ps(m0, zero, _CMP_LT_OQ));
    __m256i n1 = _mm256_castps_si256(_mm256_cmp_ps(m1, zero, _CMP_LT_OQ));
    q0 = _mm256_sub_epi32(_mm256_xor_si256(q0, n0), n0);  /* -q where m < 0 */
    q1 = _mm256_sub_epi32(_mm256_xor_si256(q1, n1), n1);
    const __m256 iv = _mm256_set1_ps(inv_v), t255 = _mm256_set1_ps(255.0f);
    __m256i s0 = _mm256_cvttps_epi32(I8_Y(aw0, iv, t255, uv0)), s1 = _mm256_cvttps_epi32(I8_Y(aw1, iv, t255, uv1));
#undef I8_Y
    /* a code of 0 where v > 0 becomes 1 (s - (-1)) */
    __m256i z0 = _mm256_and_si256(_mm256_cmpeq_epi32(s0, _mm256_setzero_si256()),
                                  _mm256_castps_si256(_mm256_cmp_ps(v0, zero, _CMP_GT_OQ)));
    __m256i z1 = _mm256_and_si256(_mm256_cmpeq_epi32(s1, _mm256_setzero_si256()),
                                  _mm256_castps_si256(_mm256_cmp_ps(v1, zero, _CMP_GT_OQ)));
    s0 = _mm256_sub_epi32(s0, z0);
    s1 = _mm256_sub_epi32(s1, z1);
    uint8_t *mo = x->m8_out + j, *vo = x->v8_out + j;
    _mm_storeu_si128((__m128i *)mo, i8_pack16(q0, q1, 1));
    memcpy(mo + 16, &scale_m, 4);
    _mm_storeu_si128((__m128i *)vo, i8_pack16(s0, s1, 0));
    memcpy(vo + 16, &scale_v, 4);
}

AI double i8_step_impl(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1, const int GBF16,
                       const int OUT16) {
    socx_i8_ctx x = {b->p_in, b->g_f32, b->g_bf16, b->m8_in, b->v8_in, b->p_out, b->p_bf16_out, b->m8_out,
                     b->v8_out, b->round_seed, c->gscale, c->l2, c->decay, c->w1, c->omw1, c->b2, c->omb2,
                     c->bc2s, c->step_size, c->eps, c->use_l2, c->lerp_small};
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    int64_t i = i0;
    if (i + 16 <= i1) {
        i8_moments prev = i8_step_avx2(&x, i, GBF16, OUT16, acc);
        for (i += 16; i + 16 <= i1; i += 16) {
            i8_moments next = i8_step_avx2(&x, i, GBF16, OUT16, acc);
            i8_encode_avx2(&x, i - 16, prev);
            prev = next;
        }
        i8_encode_avx2(&x, i - 16, prev);
    }
    double lanes[16];
    for (int k = 0; k < 4; k++) _mm256_storeu_pd(lanes + 4 * k, acc[k]);
    if (i < i1) socx_i8_block(&x, i, (int)(i1 - i), 0, GBF16, OUT16, lanes);
    return socx_reduce16(lanes);
}

double socx_step_avx2(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    if (b->m8_in) {
        const int gb = b->g_bf16 != NULL, o16 = b->p_bf16_out != NULL;
        if (!gb && !o16) return i8_step_impl(b, c, i0, i1, 0, 0);
        if (!gb && o16) return i8_step_impl(b, c, i0, i1, 0, 1);
        if (gb && !o16) return i8_step_impl(b, c, i0, i1, 1, 0);
        return i8_step_impl(b, c, i0, i1, 1, 1);
    }
    SOCX_DISPATCH_STEP(step_impl);
}

double socx_sumsq_avx2(const float *g32, const uint16_t *g16, int64_t i0, int64_t i1) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16) {
        __m256 x = g32 ? _mm256_loadu_ps(g32 + i) : bf16_to_f32_8(g16 + i);
        __m256 y = g32 ? _mm256_loadu_ps(g32 + i + 8) : bf16_to_f32_8(g16 + i + 8);
        sq_acc(x, &a0, &a1);
        sq_acc(y, &a2, &a3);
    }
    double lanes[16];
    _mm256_storeu_pd(lanes, a0);
    _mm256_storeu_pd(lanes + 4, a1);
    _mm256_storeu_pd(lanes + 8, a2);
    _mm256_storeu_pd(lanes + 12, a3);
    socx_sumsq_tail(g32, g16, i0, i, i1, lanes);
    return socx_reduce16(lanes);
}

void socx_copy_avx2(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
    if (b->m8_in) {  /* int8 moments: their bytes, regular stores (as the step) */
        const __m256i zi = _mm256_set1_epi32(c->use_l2);
        int64_t i = i0;
        for (; i + 16 <= i1; i += 16) {
            const int64_t j = 20 * (i >> 4);
            __m256i g0 = b->g_f32 ? _mm256_loadu_si256((const __m256i *)(b->g_f32 + i))
                                  : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b->g_bf16 + i)));
            __m256i g1 = b->g_f32 ? _mm256_loadu_si256((const __m256i *)(b->g_f32 + i + 8))
                                  : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b->g_bf16 + i + 8)));
            __m256i p0 = _mm256_loadu_si256((const __m256i *)(b->p_in + i));
            __m256i p1 = _mm256_loadu_si256((const __m256i *)(b->p_in + i + 8));
            __m256i gz = _mm256_and_si256(_mm256_or_si256(g0, g1), zi);
            __m128i mc = _mm_loadu_si128((const __m128i *)(b->m8_in + j));
            __m128i vc = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(b->v8_in + j)),
                                       _mm_or_si128(_mm256_castsi256_si128(gz), _mm256_extracti128_si256(gz, 1)));
            uint32_t ms, vs;
            memcpy(&ms, b->m8_in + j + 16, 4);
            memcpy(&vs, b->v8_in + j + 16, 4);
            _mm256_storeu_si256((__m256i *)(b->p_out + i), p0);
            _mm256_storeu_si256((__m256i *)(b->p_out + i + 8), p1);
            _mm_storeu_si128((__m128i *)(b->m8_out + j), mc);
            memcpy(b->m8_out + j + 16, &ms, 4);
            _mm_storeu_si128((__m128i *)(b->v8_out + j), vc);
            memcpy(b->v8_out + j + 16, &vs, 4);
            if (b->p_bf16_out) {
                __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_srli_epi32(p0, 16),
                                                                          _mm256_srli_epi32(p1, 16)), 0xD8);
                _mm256_storeu_si256((__m256i *)(b->p_bf16_out + i), h);
            }
        }
        if (i < i1) socx_int8_copy(b, c, i, i1);
        return;
    }
    const __m256i zero = _mm256_set1_epi32(c->use_l2);
    const int any_stream = c->stream || (b->p_bf16_out && c->stream_bf16);
    int64_t i = i0;
    if (any_stream) {  /* regular stores up to the first 64-byte boundary of the streamed outputs */
        int64_t h = socx_stream_head(c, i0, i1);
        if (h > 0) socx_copy_scalar(b, c, i0, i0 + h);
        i += h;
    }
    for (; i + 8 <= i1; i += 8) {
        __m256i g = b->g_f32 ? _mm256_loadu_si256((const __m256i *)(b->g_f32 + i))
                             : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b->g_bf16 + i)));
        __m256i p = _mm256_loadu_si256((const __m256i *)(b->p_in + i));
        if (b->m16_in) {  /* bf16 moments: the step's 2-byte loads and stores */
            __m256i gz = _mm256_and_si256(g, zero);
            __m128i m = _mm_loadu_si128((const __m128i *)(b->m16_in + i));
            __m128i v = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(b->v16_in + i)),
                                      _mm_packus_epi32(_mm256_castsi256_si128(gz), _mm256_extracti128_si256(gz, 1)));
            if (c->stream) {
                _mm256_stream_si256((__m256i *)(b->p_out + i), p);
                _mm_stream_si128((__m128i *)(b->m16_out + i), m);
                _mm_stream_si128((__m128i *)(b->v16_out + i), v);
            } else {
                _mm256_storeu_si256((__m256i *)(b->p_out + i), p);
                _mm_storeu_si128((__m128i *)(b->m16_out + i), m);
                _mm_storeu_si128((__m128i *)(b->v16_out + i), v);
            }
        } else {
            __m256i m = _mm256_loadu_si256((const __m256i *)(b->m_in + i));
            __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b->v_in + i)), _mm256_and_si256(g, zero));
            if (c->stream) {
                _mm256_stream_si256((__m256i *)(b->p_out + i), p);
                _mm256_stream_si256((__m256i *)(b->m_out + i), m);
                _mm256_stream_si256((__m256i *)(b->v_out + i), v);
            } else {
                _mm256_storeu_si256((__m256i *)(b->p_out + i), p);
                _mm256_storeu_si256((__m256i *)(b->m_out + i), m);
                _mm256_storeu_si256((__m256i *)(b->v_out + i), v);
            }
        }
        if (b->p_bf16_out) {
            __m256i h = _mm256_srli_epi32(p, 16);
            __m128i h8 = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            if (c->stream_bf16)
                _mm_stream_si128((__m128i *)(b->p_bf16_out + i), h8);
            else
                _mm_storeu_si128((__m128i *)(b->p_bf16_out + i), h8);
        }
    }
    if (any_stream) _mm_sfence();
    if (i < i1) socx_copy_scalar(b, c, i, i1);
}
#endif
