/* Run-time ISA selection and the OpenMP driver around the per-ISA block kernels.
 *
 * Built with the target's baseline flags only: this file must run on any CPU of the architecture, and it
 * calls a vector path only after the CPU (and the OS, for the AVX state) reported that path usable.
 *
 * Work split: the tensor is cut into SOCX_BLOCK-element blocks; thread t of T takes the contiguous block
 * range [nb*t/T, nb*(t+1)/T) (static, contiguous: each thread streams one region, which suits hardware
 * prefetchers and first-touch NUMA placement). Every block's gradient sum of squares is stored and the
 * sums are added in block order afterwards, so results do not depend on the thread count.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1UL << 1)
#endif
#ifndef HWCAP_SVE
#define HWCAP_SVE (1UL << 22)
#endif
#endif

#include "adam_internal.h"

/* Store choice. Outputs that are separate buffers (ping-pong state, the bf16 copy) get non-temporal stores
 * when the call is too large for its outputs to stay in the last-level cache: a regular store to a line
 * that is not in cache first reads it (read-for-ownership), which makes a ping-pong step move 40 bytes per
 * parameter instead of 28, while a streaming store writes the line without reading it. When the call's
 * data fit in the cache, regular stores win (the lines are there, and whoever consumes the outputs next
 * finds them there; streaming stores would push them out to memory). Threshold: the call's footprint (28 B
 * per element) above half the last-level cache, and at least 128K elements; measured crossover on the
 * 32 MB-L3 machine of docs/kernel.md: between 512K and 1M elements. */
#define SOCX_STREAM_MIN_FLOOR (1 << 17)
#define SOCX_BYTES_PER_ELEM 28

static int g_store_policy = SOCX_STORES_AUTO;
static int64_t g_prefetch = 0;
void socx_set_prefetch(int64_t elems) { g_prefetch = elems > 0 ? (elems + 15) / 16 * 16 : 0; }
int64_t socx_get_prefetch(void) { return g_prefetch; }
static int64_t g_stream_min = 0;  /* 0: not yet computed */

/* Size in bytes of the largest cache level Linux reports for cpu0 (sysfs; 0 when unknown). */
static int64_t llc_bytes(void) {
    int64_t best = 0;
    for (int idx = 0; idx < 8; idx++) {
        char path[96];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", idx);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        long long v = 0;
        char unit = 0;
        if (fscanf(f, "%lld%c", &v, &unit) >= 1) {
            int64_t b = (int64_t)v * (unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : 1);
            if (b > best) best = b;
        }
        fclose(f);
    }
    return best;
}

static int64_t default_stream_min(void) {
    int64_t llc = llc_bytes();
    if (llc <= 0) llc = 32 << 20;  /* unknown: assume a 32 MB last-level cache */
    int64_t n = llc / 2 / SOCX_BYTES_PER_ELEM;
    return n > SOCX_STREAM_MIN_FLOOR ? n : SOCX_STREAM_MIN_FLOOR;
}

void socx_set_store_policy(int policy) {
    g_store_policy = (policy == SOCX_STORES_REGULAR || policy == SOCX_STORES_STREAMING) ? policy : SOCX_STORES_AUTO;
}
int socx_get_store_policy(void) { return g_store_policy; }
void socx_set_stream_threshold(int64_t n) { g_stream_min = n > 0 ? n : default_stream_min(); }
int64_t socx_stream_threshold(void) {
    if (g_stream_min <= 0) g_stream_min = default_stream_min();  /* idempotent: a race is harmless */
    return g_stream_min;
}

typedef struct {
    socx_step_fn step;
    socx_sumsq_fn sumsq;
    socx_copy_fn copy;
} socx_table;

static const socx_table k_tables[SOCX_ISA_COUNT] = {
    [SOCX_ISA_SCALAR] = {socx_step_scalar, socx_sumsq_scalar, socx_copy_scalar},
#if defined(__x86_64__) || defined(_M_X64)
    [SOCX_ISA_AVX2] = {socx_step_avx2, socx_sumsq_avx2, socx_copy_avx2},
    [SOCX_ISA_AVX512] = {socx_step_avx512, socx_sumsq_avx512, socx_copy_avx512},
#endif
#if defined(__aarch64__)
    [SOCX_ISA_NEON] = {socx_step_neon, socx_sumsq_neon, socx_copy_neon},
#endif
#if SOCX_HAVE_SVE
    [SOCX_ISA_SVE] = {socx_step_sve, socx_sumsq_sve, socx_copy_sve},
#endif
};

static const char *const k_names[SOCX_ISA_COUNT] = {"scalar", "avx2", "avx512", "neon", "sve"};

static int g_isa = -1;     /* selected path; -1 until first use */
static int g_threads = 0;  /* 0: OpenMP's default at the time of the call */

const char *socx_isa_name(int isa) {
    return (isa >= 0 && isa < SOCX_ISA_COUNT) ? k_names[isa] : "unknown";
}

int socx_isa_compiled(int isa) { return isa >= 0 && isa < SOCX_ISA_COUNT && k_tables[isa].step != NULL; }

int socx_isa_available(int isa) {
    if (isa < 0 || isa >= SOCX_ISA_COUNT || k_tables[isa].step == NULL) return 0;
    switch (isa) {
    case SOCX_ISA_SCALAR:
        return 1;
#if defined(__x86_64__) || defined(_M_X64)
    /* __builtin_cpu_supports also checks that the OS saves the wide register state (XGETBV) */
    case SOCX_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case SOCX_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
#if defined(__aarch64__) && defined(__linux__)
    case SOCX_ISA_NEON:
        return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
    case SOCX_ISA_SVE:
        return (getauxval(AT_HWCAP) & HWCAP_SVE) != 0;
#endif
    default:
        return 0;
    }
}

static int best_isa(void) {
    static const int order[] = {SOCX_ISA_AVX512, SOCX_ISA_SVE, SOCX_ISA_AVX2, SOCX_ISA_NEON, SOCX_ISA_SCALAR};
    for (unsigned k = 0; k < sizeof order / sizeof order[0]; k++)
        if (socx_isa_available(order[k])) return order[k];
    return SOCX_ISA_SCALAR;
}

int socx_current_isa(void) {
    if (g_isa < 0) g_isa = best_isa();  /* idempotent, so a race between first callers is harmless */
    return g_isa;
}

int socx_force_isa(int isa) {
    if (!socx_isa_available(isa)) return -1;
    g_isa = isa;
    return 0;
}

void socx_set_num_threads(int n) { g_threads = n > 0 ? n : 0; }

int socx_get_num_threads(void) {
    if (g_threads > 0) return g_threads;
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static const socx_table *table(void) { return &k_tables[socx_current_isa()]; }

/* Residue r such that p + i is 64-byte aligned iff (i + r) % 16 == 0, for an array of esize-byte elements
 * (esize 4: 64-byte vectors of 16 floats; esize 2: 32-byte vectors of 16 bf16), or -1 when no element of the
 * array is so aligned (an address that is not a multiple of the element size). */
static int stream_residue(const void *p, unsigned esize) {
    uintptr_t a = (uintptr_t)p;
    if (a % esize) return -1;
    return (int)((a / esize) & 15u);
}

/* Which outputs get non-temporal stores (see the store choice above and socx_set_store_policy); call_n is
 * the number of elements the whole call touches (a multi-tensor call: all its tensors). Streamed outputs
 * must share one alignment residue, since the vector loop peels one head per block. */
static void store_choice(const socx_buffers *b, int64_t call_n, socx_consts *c) {
    c->stream = c->stream_bf16 = 0;
    c->align_r = 0;
    int isa = socx_current_isa();
    /* scalar has no streaming store; NEON relies on the core's write-streaming detection */
    if (g_store_policy == SOCX_STORES_REGULAR || isa == SOCX_ISA_SCALAR || isa == SOCX_ISA_NEON) return;
    /* int8 moments: regular stores only, in the step and the ceiling alike (adam_int8.h) */
    if (b->m8_in) return;
    const int always = g_store_policy == SOCX_STORES_STREAMING;
    const int big = always || call_n >= socx_stream_threshold();
    const int m16 = b->m16_in != NULL;   /* bf16 moments: 2-byte outputs, 32-byte aligned per 16 elements */
    const void *mo = m16 ? (const void *)b->m16_out : (const void *)b->m_out;
    const void *vo = m16 ? (const void *)b->v16_out : (const void *)b->v_out;
    const void *mi = m16 ? (const void *)b->m16_in : (const void *)b->m_in;
    const void *vi = m16 ? (const void *)b->v16_in : (const void *)b->v_in;
    const int separate = b->p_out != b->p_in && mo != mi && vo != vi;
    if (isa == SOCX_ISA_SVE) {  /* STNT1 has no alignment requirement */
        c->stream = big && (separate || always);
        c->stream_bf16 = big && b->p_bf16_out != NULL;
        return;
    }
    const unsigned msize = m16 ? 2 : 4;
    int rp = stream_residue(b->p_out, 4), rm = stream_residue(mo, msize), rv = stream_residue(vo, msize);
    c->stream = big && (separate || always) && rp >= 0 && rp == rm && rp == rv;
    if (c->stream) c->align_r = rp;
    if (big && b->p_bf16_out != NULL) {
        int rb = stream_residue(b->p_bf16_out, 2);
        /* with both streamed, the bf16 copy must share the state's residue; else the state wins (12 B vs 2 B) */
        c->stream_bf16 = rb >= 0 && (!c->stream || rb == rp);
        if (c->stream_bf16 && !c->stream) c->align_r = rb;
    }
}

int socx_stream_choice(const socx_buffers *b, int64_t call_n) {
    socx_consts c;
    store_choice(b, call_n > 0 ? call_n : b->n, &c);
    return (c.stream ? 1 : 0) | (c.stream_bf16 ? 2 : 0);
}

/* fp32 constants exactly as torch forms them: the scalar math in double (Python floats), rounded to fp32
 * where it meets an fp32 tensor. */
static void make_consts(const socx_buffers *b, int64_t call_n, const socx_hparams *h, socx_consts *c) {
    double bc1 = 1.0 - pow(h->beta1, (double)h->step);
    double bc2 = 1.0 - pow(h->beta2, (double)h->step);
    double w1 = 1.0 - h->beta1;
    c->gscale = (float)h->grad_scale;
    c->use_l2 = !h->decoupled && h->weight_decay != 0.0;
    c->l2 = (float)h->weight_decay;
    c->decay = h->decoupled ? (float)(1.0 - h->lr * h->weight_decay) : 1.0f;
    c->w1 = (float)w1;
    c->omw1 = 1.0f - c->w1;
    c->lerp_small = fabs(w1) < 0.5;
    c->b2 = (float)h->beta2;
    c->omb2 = (float)(1.0 - h->beta2);
    c->bc2s = (float)sqrt(bc2);
    c->step_size = (float)(h->lr / bc1);
    c->eps = (float)h->eps;
    store_choice(b, call_n, c);
    c->prefetch = g_prefetch;
}

static int threads_for(int64_t nblocks) {
    int nt = socx_get_num_threads();
    if ((int64_t)nt > nblocks) nt = (int)nblocks;
    return nt < 1 ? 1 : nt;
}

#define PARTIALS_ON_STACK 256

/* Block scheduling. Dynamic (default): threads claim chunks of consecutive blocks from a shared counter, so
 * a thread that loses its core to another process for a while (a shared machine, or torch's own threads
 * next to the kernel) does not leave the others waiting at the end; each chunk is still a contiguous
 * stretch of every stream (up to 16 blocks = 1 MiB of fp32 per stream) for the prefetchers. Static: thread
 * t takes the contiguous block range [nb*t/T, nb*(t+1)/T) (first-touch NUMA placement follows it). Either
 * way every block's sum of squares lands in its own slot and the slots are added in block order, so no
 * result depends on the schedule or the thread count. */
static int g_dynamic = 1;
void socx_set_dynamic_schedule(int on) { g_dynamic = on != 0; }
int socx_get_dynamic_schedule(void) { return g_dynamic; }

static int64_t chunk_blocks(int64_t nblocks, int nt) {
    int64_t ch = nblocks / ((int64_t)nt * 8);
    return ch < 1 ? 1 : (ch > 16 ? 16 : ch);
}

static inline double block_fn(const socx_table *t, int kind, const socx_buffers *b, const socx_consts *c,
                              const float *g32, const uint16_t *g16, int64_t i0, int64_t i1) {
    if (kind == 0) return t->step(b, c, i0, i1);
    if (kind == 1) return t->sumsq(g32, g16, i0, i1);
    t->copy(b, c, i0, i1);
    return 0.0;
}

/* One step (kind 0), sum-of-squares pass (kind 1) or ceiling copy (kind 2) over `count` tensors in a single parallel region:
 * the tensors' blocks are numbered one after the other (tensor j's blocks start at first[j]); one fork and
 * one join for the whole list. Returns the in-order block sums per tensor in sums[j] (added in block order). */
static void run_blocks_multi(int kind, int count, const socx_buffers *bs, const socx_consts *cs, const float *g32,
                             const uint16_t *g16, const int64_t *ns, const int64_t *first, int64_t nblocks,
                             double *sums) {
    const socx_table *t = table();
    double stack_part[PARTIALS_ON_STACK];
    double *part = nblocks <= PARTIALS_ON_STACK ? stack_part : (double *)malloc((size_t)nblocks * sizeof(double));
    if (!part) {  /* out of memory for the partials: one thread, same order, same result */
        for (int j = 0; j < count; j++) {
            double total = 0.0;
            for (int64_t i0 = 0; i0 < ns[j]; i0 += SOCX_BLOCK) {
                int64_t i1 = i0 + SOCX_BLOCK < ns[j] ? i0 + SOCX_BLOCK : ns[j];
                total += block_fn(t, kind, bs + j, cs + j, g32, g16, i0, i1);
            }
            sums[j] = total;
        }
        return;
    }
    const int nt = threads_for(nblocks);
    const int64_t ch = chunk_blocks(nblocks, nt), nchunks = (nblocks + ch - 1) / ch;
    const int dyn = g_dynamic;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
        int j = 0;  /* the tensor of the current block (a cursor: a thread's blocks come in increasing order) */
#define SOCX_DO_BLOCK(k)                                                                                       \
    do {                                                                                                       \
        while (j > 0 && (k) < first[j]) j--;                                                                   \
        while (j + 1 < count && (k) >= first[j + 1]) j++;                                                      \
        int64_t i0 = ((k) - first[j]) * SOCX_BLOCK, i1 = i0 + SOCX_BLOCK < ns[j] ? i0 + SOCX_BLOCK : ns[j];    \
        part[k] = block_fn(t, kind, bs + j, cs + j, g32, g16, i0, i1);                                          \
    } while (0)
        if (dyn) {
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1) nowait
#endif
            for (int64_t q = 0; q < nchunks; q++) {
                int64_t kb = (q + 1) * ch < nblocks ? (q + 1) * ch : nblocks;
                for (int64_t k = q * ch; k < kb; k++) SOCX_DO_BLOCK(k);
            }
        } else {
#ifdef _OPENMP
            int tid = omp_get_thread_num(), T = omp_get_num_threads();
#else
            int tid = 0, T = 1;
#endif
            for (int64_t k = nblocks * tid / T; k < nblocks * (tid + 1) / T; k++) SOCX_DO_BLOCK(k);
        }
#undef SOCX_DO_BLOCK
    }
    for (int j = 0; j < count; j++) {
        double total = 0.0;
        int64_t kend = j + 1 < count ? first[j + 1] : nblocks;
        for (int64_t k = first[j]; k < kend; k++) total += part[k];
        sums[j] = total;
    }
    if (part != stack_part) free(part);
}

static double run_blocks(int kind, const socx_buffers *b, const socx_consts *c, const float *g32,
                         const uint16_t *g16, int64_t n) {
    int64_t first = 0, nblocks = (n + SOCX_BLOCK - 1) / SOCX_BLOCK;
    double sum;
    run_blocks_multi(kind, 1, b, c, g32, g16, &n, &first, nblocks, &sum);
    return sum;
}

socx_stats socx_adam_step(const socx_buffers *b, const socx_hparams *h) {
    socx_stats st = {0.0, 0};
    if (b->n <= 0) return st;
    socx_consts c;
    make_consts(b, b->n, h, &c);
    st.sumsq = run_blocks(0, b, &c, NULL, NULL, b->n);
    /* A sum of squares of fp32 values cannot overflow a double (2^63 * FLT_MAX^2 < DBL_MAX), so it is
     * non-finite exactly when some scaled gradient element is Inf or NaN. */
    st.nonfinite = !isfinite(st.sumsq);
    return st;
}

#define MULTI_ON_STACK 64

socx_stats socx_adam_step_multi(const socx_buffers *bs, int count, const socx_hparams *h, double *sumsq) {
    socx_stats st = {0.0, 0};
    if (count <= 0) return st;
    socx_consts cs_stack[MULTI_ON_STACK];
    int64_t ns_stack[MULTI_ON_STACK], first_stack[MULTI_ON_STACK];
    double sums_stack[MULTI_ON_STACK];
    int heap = count > MULTI_ON_STACK;
    socx_consts *cs = heap ? (socx_consts *)malloc((size_t)count * sizeof *cs) : cs_stack;
    int64_t *ns = heap ? (int64_t *)malloc((size_t)count * sizeof *ns) : ns_stack;
    int64_t *first = heap ? (int64_t *)malloc((size_t)count * sizeof *first) : first_stack;
    double *sums = heap ? (double *)malloc((size_t)count * sizeof *sums) : sums_stack;
    if (!cs || !ns || !first || !sums) {  /* one tensor at a time: the same results */
        for (int j = 0; j < count; j++) {
            socx_stats s = socx_adam_step(&bs[j], h);
            if (sumsq) sumsq[j] = s.sumsq;
            st.sumsq += s.sumsq;
        }
    } else {
        int64_t nblocks = 0, call_n = 0;
        for (int j = 0; j < count; j++) call_n += bs[j].n > 0 ? bs[j].n : 0;
        for (int j = 0; j < count; j++) {
            make_consts(&bs[j], call_n, h, &cs[j]);
            ns[j] = bs[j].n > 0 ? bs[j].n : 0;
            first[j] = nblocks;
            nblocks += (ns[j] + SOCX_BLOCK - 1) / SOCX_BLOCK;
        }
        if (nblocks > 0) run_blocks_multi(0, count, bs, cs, NULL, NULL, ns, first, nblocks, sums);
        for (int j = 0; j < count; j++) {
            double s = ns[j] > 0 ? sums[j] : 0.0;
            if (sumsq) sumsq[j] = s;
            st.sumsq += s;  /* tensor order: equal to adding the single-tensor calls' sums in order */
        }
    }
    if (heap) {
        free(cs);
        free(ns);
        free(first);
        free(sums);
    }
    st.nonfinite = !isfinite(st.sumsq);
    return st;
}

socx_stats socx_grad_stats(const float *g32, const uint16_t *g16, int64_t n) {
    socx_stats st = {0.0, 0};
    if (n <= 0) return st;
    st.sumsq = run_blocks(1, NULL, NULL, g32, g16, n);
    st.nonfinite = !isfinite(st.sumsq);
    return st;
}

/* The ceiling goes through the same blocks, schedule and store choice as the step (one parallel region for
 * the whole list), so the two differ only in the arithmetic. */
void socx_copy_ceiling_multi(const socx_buffers *bs, int count) {
    if (count <= 0) return;
    socx_hparams h = {1, 0.0, 0.9, 0.999, 1e-8, 0.0, 1, 1.0};
    socx_consts *cs = (socx_consts *)malloc((size_t)count * sizeof *cs);
    int64_t *ns = (int64_t *)malloc((size_t)count * sizeof *ns), *first = (int64_t *)malloc((size_t)count * sizeof *first);
    double *sums = (double *)malloc((size_t)count * sizeof *sums);
    if (cs && ns && first && sums) {
        int64_t nblocks = 0, call_n = 0;
        for (int j = 0; j < count; j++) call_n += bs[j].n > 0 ? bs[j].n : 0;
        for (int j = 0; j < count; j++) {
            make_consts(&bs[j], call_n, &h, &cs[j]);
            cs[j].use_l2 = 0;  /* read by the copy kernels as the run-time zero mask */
            ns[j] = bs[j].n > 0 ? bs[j].n : 0;
            first[j] = nblocks;
            nblocks += (ns[j] + SOCX_BLOCK - 1) / SOCX_BLOCK;
        }
        if (nblocks > 0) run_blocks_multi(2, count, bs, cs, NULL, NULL, ns, first, nblocks, sums);
    }
    free(cs);
    free(ns);
    free(first);
    free(sums);
}

void socx_copy_ceiling(const socx_buffers *b) { socx_copy_ceiling_multi(b, 1); }

/* The inverse runs in double on the fp32 constants the step actually used, so what it undoes is the
 * step's own arithmetic; only the roundings of the step are lost (see docs/kernel.md for the bound). */
int socx_adam_rollback(const socx_buffers *b, const socx_hparams *h) {
    if (b->m16_in || b->m8_in) return -2;   /* stochastically rounded moments cannot be inverted: ping-pong only */
    if (h->beta1 == 0.0 || h->beta2 == 0.0) return -1;
    if (b->n <= 0) return 0;
    socx_consts c;
    make_consts(b, b->n, h, &c);
    if (c.decay == 0.0f || c.omw1 == 0.0f || c.w1 == 1.0f) return -1;
    const double gscale = c.gscale, l2 = c.l2, decay = c.decay, w1 = c.w1, omw1 = c.omw1, b2 = c.b2,
                 omb2 = c.omb2, bc2s = c.bc2s, ss = c.step_size, eps = c.eps;
    const int use_l2 = c.use_l2, small = c.lerp_small;
    const int64_t n = b->n;
    const int nt = threads_for((n + SOCX_BLOCK - 1) / SOCX_BLOCK);
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
    for (int64_t i = 0; i < n; i++) {
        /* the scaled gradient exactly as the step formed it (an fp32 product) */
        double g = (double)(socx_load_grad(b, i) * (float)gscale);
        double p1 = b->p_in[i], m1 = b->m_in[i], v1 = b->v_in[i];
        double den = sqrt(v1) / bc2s + eps;
        double p0 = (p1 + ss * m1 / den) / decay;
        if (use_l2) g += l2 * p0;
        /* forward: small weight m1 = m0 + w1 (g - m0); otherwise m1 = g - (g - m0)(1 - w1) */
        double m0 = small ? (m1 - w1 * g) / (1.0 - w1) : g - (g - m1) / omw1;
        double v0 = (v1 - omb2 * g * g) / b2;
        if (v0 < 0.0) v0 = 0.0;
        b->p_out[i] = (float)p0;
        b->m_out[i] = (float)m0;
        b->v_out[i] = (float)v0;
    }
    return 0;
}
