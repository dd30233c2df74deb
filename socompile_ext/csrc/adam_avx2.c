/* AVX2 path (Haswell / Zen 1 and later). Same structure as the AVX-512 file: enabled for this file by the
 * target pragma, called only when the CPU reports AVX2. 16 elements (two vectors) per iteration so the
 * sum of squares lands in the same 16 lanes as every other path; the tail (< 16) is finished by the
 * scalar element function, which performs the identical fp32 arithmetic. */
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,bmi2")
#include <immintrin.h>

#include "adam_internal.h"

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

double socx_step_avx2(const socx_buffers *b, const socx_consts *c, int64_t i0, int64_t i1) {
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
