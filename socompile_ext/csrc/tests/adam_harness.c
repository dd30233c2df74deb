/* Stand-alone C check of the kernels against the scalar path, for the architectures this machine cannot
 * run natively: tests/test_ext_aarch64.py cross-compiles it with the kernel sources for aarch64 and runs it
 * under qemu-aarch64 with SVE on (several vector lengths) and off (NEON).
 *
 * For every usable vector path it compares against the scalar path: p, m, v and the bf16 copy bit for bit
 * (two NaNs count as equal: only NaN-ness is specified across instruction sets), the gradient sum of squares
 * bit for bit for the 16-lane paths and to 1e-12 relative for SVE, the non-finite flag exactly; and results
 * for 1 and 3 threads bit for bit; with fp32 and with bf16 moments (stochastically rounded: the same bits on
 * every path), and with int8 block-quantised moments (adam_int8.h: codes bit for bit, scales as fp32 values).
 * Exit status 0 when everything agrees; prints one line per failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adam.h"
#include "adam_internal.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next32(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float uniform(void) { return (float)(next32() >> 8) / 16777216.0f; }           /* [0, 1) */
static float normalish(void) { return (uniform() + uniform() + uniform() - 1.5f) * 2.0f; }

static int failures = 0;

typedef struct {
    float *p, *m, *v, *g32, *po, *mo, *vo;
    uint16_t *g16, *p16, *m16, *v16;   /* m16, v16: the moments as bf16 (the bf16-moment inputs) */
    uint8_t *m8, *v8;                  /* int8 moments: 20 * ceil(n / 16) bytes each (format in adam.h) */
} bufs;

static size_t i8_bytes(int64_t n) { return (size_t)((n + 15) / 16) * 20; }

static void *alloc64(size_t bytes) {
    void *ptr = NULL;
    if (posix_memalign(&ptr, 64, bytes ? bytes : 64) != 0) abort();
    return ptr;
}

static void alloc_bufs(bufs *b, int64_t n) {
    size_t f = (size_t)n * sizeof(float), h = (size_t)n * sizeof(uint16_t);
    b->p = alloc64(f), b->m = alloc64(f), b->v = alloc64(f), b->g32 = alloc64(f);
    b->po = alloc64(f), b->mo = alloc64(f), b->vo = alloc64(f);
    b->g16 = alloc64(h), b->p16 = alloc64(h), b->m16 = alloc64(h), b->v16 = alloc64(h);
    b->m8 = alloc64(i8_bytes(n)), b->v8 = alloc64(i8_bytes(n));
}

static void free_bufs(bufs *b) {
    free(b->p), free(b->m), free(b->v), free(b->g32), free(b->po), free(b->mo), free(b->vo), free(b->g16), free(b->p16), free(b->m16), free(b->v16);
    free(b->m8), free(b->v8);
}

static void fill(bufs *b, int64_t n, int specials) {
    for (int64_t i = 0; i < n; i++) {
        b->p[i] = normalish();
        b->g32[i] = normalish();
        b->m[i] = normalish() * 0.1f;
        b->v[i] = uniform() * 0.01f;
        b->g16[i] = socx_f32_to_bf16(normalish());
        b->m16[i] = socx_f32_to_bf16(b->m[i]);
        b->v16[i] = socx_f32_to_bf16(b->v[i]);
    }
    /* int8 moments: random codes (0 past n) and scales of the fp32 moments' size */
    for (int64_t j = 0; j < (n + 15) / 16; j++) {
        uint8_t *mb = b->m8 + 20 * j, *vb = b->v8 + 20 * j;
        for (int k = 0; k < 16; k++) {
            int in = 16 * j + k < n;
            mb[k] = in ? (uint8_t)(next32() & 0xFF) : 0;
            vb[k] = in ? (uint8_t)(next32() & 0xFF) : 0;
        }
        float sm = uniform() * 0.1f / 127.0f, sv = uniform() * 0.1f / 255.0f;
        memcpy(mb + 16, &sm, 4), memcpy(vb + 16, &sv, 4);
    }
    if (specials && n > 8) {
        b->g32[n / 3] = NAN, b->g16[n / 3] = 0x7FC1;
        b->g32[n / 2] = INFINITY, b->g16[n / 2] = 0xFF80;
        b->p[1] = INFINITY, b->p[2] = -0.0f, b->p[3] = 3.3895314e38f; /* bf16 overflow to Inf */
        uint32_t nan_payload = 0x7FBFFFFFu;                             /* signalling NaN */
        memcpy(&b->p[4], &nan_payload, 4);
    }
}

static int same_f32(float a, float b) {
    uint32_t x, y;
    memcpy(&x, &a, 4), memcpy(&y, &b, 4);
    return x == y || (a != a && b != b);
}
static int same_bf16(uint16_t a, uint16_t b) {
    return a == b || (((a & 0x7F80) == 0x7F80 && (a & 0x7F)) && ((b & 0x7F80) == 0x7F80 && (b & 0x7F)));
}

typedef struct {
    float *p, *m, *v;
    uint16_t *p16, *m16, *v16;
    uint8_t *m8, *v8;
    socx_stats st, gs;
} result;

/* mfmt: 0 fp32 moments, 1 bf16, 2 int8 */
static result run(const bufs *in, int64_t n, int gbf16, int out16, int pingpong, int mfmt, const socx_hparams *h) {
    const int mb16 = mfmt == 1;
    const size_t qb = i8_bytes(n);
    result r;
    size_t f = (size_t)n * sizeof(float);
    r.p = alloc64(f), r.m = alloc64(f), r.v = alloc64(f), r.p16 = alloc64((size_t)n * 2 + 2);
    r.m16 = alloc64((size_t)n * 2 + 2), r.v16 = alloc64((size_t)n * 2 + 2);
    memset(r.m, 0, f), memset(r.v, 0, f), memset(r.m16, 0, (size_t)n * 2), memset(r.v16, 0, (size_t)n * 2);
    r.m8 = alloc64(qb), r.v8 = alloc64(qb);
    memset(r.m8, 0, qb), memset(r.v8, 0, qb);
    socx_buffers b;
    memset(&b, 0, sizeof b);
    b.n = n;
    b.g_f32 = gbf16 ? NULL : in->g32;
    b.g_bf16 = gbf16 ? in->g16 : NULL;
    b.p_bf16_out = out16 ? r.p16 : NULL;
    if (mfmt == 2) {  /* int8 moments, with a seed of their own */
        b.round_seed = 0xBADC0DEu;
        if (pingpong) {
            b.p_in = in->p, b.m8_in = in->m8, b.v8_in = in->v8;
        } else {
            memcpy(r.p, in->p, f), memcpy(r.m8, in->m8, qb), memcpy(r.v8, in->v8, qb);
            b.p_in = r.p, b.m8_in = r.m8, b.v8_in = r.v8;
        }
        b.p_out = r.p, b.m8_out = r.m8, b.v8_out = r.v8;
    } else if (mb16) {  /* bf16 moments, stochastically rounded with a seed of their own */
        size_t hb = (size_t)n * 2;
        b.round_seed = 0xC0FFEEu;
        if (pingpong) {
            b.p_in = in->p, b.m16_in = in->m16, b.v16_in = in->v16;
        } else {
            memcpy(r.p, in->p, f), memcpy(r.m16, in->m16, hb), memcpy(r.v16, in->v16, hb);
            b.p_in = r.p, b.m16_in = r.m16, b.v16_in = r.v16;
        }
        b.p_out = r.p, b.m16_out = r.m16, b.v16_out = r.v16;
    } else if (pingpong) {
        b.p_in = in->p, b.m_in = in->m, b.v_in = in->v;
        b.p_out = r.p, b.m_out = r.m, b.v_out = r.v;
    } else {
        memcpy(r.p, in->p, f), memcpy(r.m, in->m, f), memcpy(r.v, in->v, f);
        b.p_in = r.p, b.m_in = r.m, b.v_in = r.v;
        b.p_out = r.p, b.m_out = r.m, b.v_out = r.v;
    }
    r.st = socx_adam_step(&b, h);
    r.gs = socx_grad_stats(b.g_f32, b.g_bf16, n);
    return r;
}

static void release(result *r) {
    free(r->p), free(r->m), free(r->v), free(r->p16), free(r->m16), free(r->v16), free(r->m8), free(r->v8);
}

/* int8 moment buffers: codes bit for bit, scales as fp32 values (two NaNs equal) */
static int same_i8(const uint8_t *a, const uint8_t *b, int64_t n) {
    for (int64_t j = 0; j < (n + 15) / 16; j++) {
        float x, y;
        memcpy(&x, a + 20 * j + 16, 4), memcpy(&y, b + 20 * j + 16, 4);
        if (memcmp(a + 20 * j, b + 20 * j, 16) != 0 || !same_f32(x, y)) return 0;
    }
    return 1;
}

static void compare(const char *what, const result *a, const result *ref, int64_t n, int out16, int exact_sum) {
    for (int64_t i = 0; i < n; i++) {
        if (!same_f32(a->p[i], ref->p[i]) || !same_f32(a->m[i], ref->m[i]) || !same_f32(a->v[i], ref->v[i]) ||
            (out16 && !same_bf16(a->p16[i], ref->p16[i])) || !same_bf16(a->m16[i], ref->m16[i]) ||
            !same_bf16(a->v16[i], ref->v16[i])) {
            printf("FAIL %s: element %lld of %lld differs (p %a vs %a, m %a vs %a, v %a vs %a)\n", what, (long long)i,
                   (long long)n, a->p[i], ref->p[i], a->m[i], ref->m[i], a->v[i], ref->v[i]);
            failures++;
            return;
        }
    }
    if (!same_i8(a->m8, ref->m8, n) || !same_i8(a->v8, ref->v8, n)) {
        printf("FAIL %s: int8 moments differ\n", what);
        failures++;
        return;
    }
    for (int k = 0; k < 2; k++) {
        const socx_stats *x = k ? &a->gs : &a->st, *y = k ? &ref->gs : &ref->st;
        int ok = x->nonfinite == y->nonfinite;
        if (ok && !y->nonfinite)
            ok = exact_sum ? x->sumsq == y->sumsq : fabs(x->sumsq - y->sumsq) <= 1e-12 * fabs(y->sumsq);
        if (!ok) {
            printf("FAIL %s: %s (%.17g, %d) vs scalar (%.17g, %d)\n", what, k ? "grad_stats" : "step stats", x->sumsq,
                   x->nonfinite, y->sumsq, y->nonfinite);
            failures++;
        }
    }
}

int main(void) {
    static const int64_t sizes[] = {0, 1, 3, 4, 5, 15, 16, 17, 31, 33, 257, 1000, SOCX_BLOCK + 5, 3 * SOCX_BLOCK + 17,
                                    (1 << 17) + 21 /* streaming stores */};
    const int nsizes = (int)(sizeof sizes / sizeof sizes[0]);
    /* the default streaming threshold follows the host's last-level cache; pin it so the largest size streams */
    socx_set_stream_threshold(1 << 17);
    int paths[SOCX_ISA_COUNT], npaths = 0;
    for (int isa = 1; isa < SOCX_ISA_COUNT; isa++)
        if (socx_isa_available(isa)) paths[npaths++] = isa;
    printf("usable paths:");
    for (int k = 0; k < npaths; k++) printf(" %s", socx_isa_name(paths[k]));
    printf(" (best: %s)\n", socx_isa_name(socx_current_isa()));
#if SOCX_HAVE_SVE
    if (socx_isa_available(SOCX_ISA_SVE)) {
        /* report the vector length the kernel sees */
        extern int harness_sve_bits(void);
        printf("sve vector length: %d bits\n", harness_sve_bits());
    }
#endif
    int checks = 0;
    for (int s = 0; s < nsizes; s++) {
        int64_t n = sizes[s];
        int big = n > 100000;
        bufs in;
        alloc_bufs(&in, n);
        fill(&in, n, s % 2);
        for (int combo = 0; combo < 96; combo++) {
            int gbf16 = combo & 1, out16 = (combo >> 1) & 1, pingpong = (combo >> 2) & 1, decoupled = (combo >> 3) & 1,
                big_lerp = (combo >> 4) & 1, mfmt = combo >> 5;
            /* keep qemu time modest for the large size */
            if (big && (combo & 31) != 3 && (combo & 31) != 4 && (combo & 31) != 7) continue;
            socx_hparams h = {7, 1e-3, big_lerp ? 0.3 : 0.9, 0.999, 1e-8, 0.1, decoupled, 0.75};
            socx_force_isa(SOCX_ISA_SCALAR);
            socx_set_num_threads(1);
            result ref = run(&in, n, gbf16, out16, pingpong, mfmt, &h);
            for (int k = 0; k < npaths; k++) {
                for (int threads = 1; threads <= 3; threads += 2) {
                    char what[160];
                    snprintf(what, sizeof what,
                             "%s threads=%d n=%lld gbf16=%d out16=%d pingpong=%d decoupled=%d beta1=%g moments=%d",
                             socx_isa_name(paths[k]), threads, (long long)n, gbf16, out16, pingpong, decoupled, h.beta1,
                             mfmt);
                    socx_force_isa(paths[k]);
                    socx_set_num_threads(threads);
                    result r = run(&in, n, gbf16, out16, pingpong, mfmt, &h);
                    compare(what, &r, &ref, n, out16, paths[k] != SOCX_ISA_SVE);
                    release(&r);
                    checks++;
                }
            }
            release(&ref);
        }
        free_bufs(&in);
    }
    printf("%d comparisons, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}

#if SOCX_HAVE_SVE
#pragma GCC target("+sve")
#include <arm_sve.h>
int harness_sve_bits(void) { return (int)svcntb() * 8; }
#endif
