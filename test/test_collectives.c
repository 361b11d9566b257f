/* test_collectives.c - smp's host collectives, object messages, dtypes.

   Every collective x dtype (f32 f64 f16 bf16 i32 i64 u8) x op x group (world,
   MP_GROUP, DP_GROUP) x in place / out of place x sizes 0, 1, 7, 1000 and
   2^20 (for all_gather, reduce_scatter and all_to_all, 2^20 is the larger
   buffer), against a reference this file computes from each rank's input.
   The inputs are small integers (products: +-1 and 2), so every sum, mean
   and product is exact in every dtype and the comparison is exact (a mean
   over 3 ranks, -n 3, is allowed 2 units in the last place). Also: object
   messaging, DLPack, f16/bf16 conversion over all 65536 bit patterns and all
   halfway points, and argument errors. Then the collectives again with MPI
   calls of at most 300 elements (smp__coll_chunk: what a tensor of more
   than 2^31 elements goes through; test_large.c runs one that big), named
   pieces/...

   Runs under mpirun -n 1, 2 and 4 (partitions = 2 when the world is even, so
   MP_GROUP and DP_GROUP differ from the world and from each other).

   Build: mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. -Itest test/test_collectives.c -o build/test_collectives -lm
   Run:   mpirun -n 4 build/test_collectives
*/
#define _POSIX_C_SOURCE 200809L /* fork, waitpid, nanosleep */
#include <dlpack/dlpack.h>
#define SMP_TESTING /* the test hooks and test-only introspection */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "test.h"

#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAXR 64
#define BIG (1 << 20)
static const char *PIECES = ""; /* "pieces/" while smp__coll_chunk is small */

static int W_RANK, W_SIZE, PARTS;

/* ================================================================ reference f16 / bf16
   Written from the formats' definitions with doubles and ldexp, so they share
   nothing with smp's bit manipulation. */
static double ref_f16_decode(uint16_t h) {
    int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, -24);
    else v = ldexp((double)(1024 + m), e - 25);
    return sign ? -v : v;
}

static double ref_bf16_decode(uint16_t h) {
    int sign = h >> 15, e = (h >> 7) & 255, m = h & 127;
    double v;
    if (e == 255) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, -133);
    else v = ldexp((double)(128 + m), e - 134);
    return sign ? -v : v;
}

/* Round a double to the nearest value with `mant_bits` significand bits
   (ties to even), exponent range [emin, emax] of the normal numbers,
   subnormals below; returns the bit pattern. */
static uint16_t ref_encode(double v, int mant_bits, int emin, int emax, int exp_bits) {
    uint16_t sign = signbit(v) ? (uint16_t)0x8000 : 0;
    uint16_t inf = (uint16_t)(((1u << exp_bits) - 1) << mant_bits);
    if (isnan(v)) return (uint16_t)(sign | inf | (1u << (mant_bits - 1)));
    double a = fabs(v);
    if (isinf(a)) return (uint16_t)(sign | inf);
    if (a == 0) return sign;
    int e;
    frexp(a, &e); /* a = f * 2^e, f in [0.5, 1): exponent of a is e - 1 */
    int ue = e - 1;
    if (ue < emin) ue = emin; /* subnormal: fixed scale */
    double q = nearbyint(ldexp(a, mant_bits - ue)); /* significand as an integer, rounded to even */
    if (q >= ldexp(1.0, mant_bits + 1)) { q /= 2; ue++; }
    if (ue > emax) return (uint16_t)(sign | inf);
    uint32_t bits;
    if (q < ldexp(1.0, mant_bits)) bits = (uint32_t)q; /* stayed subnormal */
    else bits = ((uint32_t)(ue - emin + 1) << mant_bits) | ((uint32_t)q - (1u << mant_bits));
    return (uint16_t)(sign | bits);
}
static uint16_t ref_f16_encode(double v) { return ref_encode(v, 10, -14, 15, 5); }
static uint16_t ref_bf16_encode(double v) { return ref_encode(v, 7, -126, 127, 8); }

/* ================================================================ typed element access */
static const smp_dtype DTYPES[] = {SMP_F32, SMP_F64, SMP_F16, SMP_BF16, SMP_I32, SMP_I64, SMP_U8};
#define NDTYPES 7
static const smp_op OPS[] = {SMP_SUM, SMP_AVG, SMP_MIN, SMP_MAX, SMP_PROD};
static const char *OP_NAMES[] = {"sum", "avg", "min", "max", "prod"};
static const smp_group GROUPS[] = {SMP_WORLD, SMP_MP_GROUP, SMP_DP_GROUP};
static const char *GROUP_NAMES[] = {"world", "mp", "dp"};

static bool is_float(smp_dtype dt) { return dt == SMP_F32 || dt == SMP_F64 || dt == SMP_F16 || dt == SMP_BF16; }

static void put(void *buf, smp_dtype dt, size_t i, double v) {
    switch (dt) {
    case SMP_F32: ((float *)buf)[i] = (float)v; break;
    case SMP_F64: ((double *)buf)[i] = v; break;
    case SMP_F16: ((uint16_t *)buf)[i] = ref_f16_encode(v); break;
    case SMP_BF16: ((uint16_t *)buf)[i] = ref_bf16_encode(v); break;
    case SMP_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case SMP_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case SMP_U8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    default: break;
    }
}

static double get(const void *buf, smp_dtype dt, size_t i) {
    switch (dt) {
    case SMP_F32: return ((const float *)buf)[i];
    case SMP_F64: return ((const double *)buf)[i];
    case SMP_F16: return ref_f16_decode(((const uint16_t *)buf)[i]);
    case SMP_BF16: return ref_bf16_decode(((const uint16_t *)buf)[i]);
    case SMP_I32: return ((const int32_t *)buf)[i];
    case SMP_I64: return (double)((const int64_t *)buf)[i];
    case SMP_U8: return ((const uint8_t *)buf)[i];
    default: return NAN;
    }
}

/* ================================================================ inputs and reference
   Rank `wr`'s element i (salt varies per call so results differ between
   calls). Sums of up to 4 of them stay within every dtype's exact range. */
static double val(int wr, size_t i, unsigned salt, smp_dtype dt, smp_op op) {
    if (op == SMP_PROD) {
        double v = (wr + i + salt) % 3 == 0 ? 2 : 1;
        if (dt != SMP_U8 && (wr * 5u + i + salt) % 4 == 0) v = -v;
        return v;
    }
    double v = (double)((wr * 7u + i * 3u + salt) % 13u);
    return dt == SMP_U8 ? v : v - 6;
}

static double combine(smp_op op, double acc, double x) {
    switch (op) {
    case SMP_SUM: case SMP_AVG: return acc + x;
    case SMP_MIN: return x < acc ? x : acc;
    case SMP_MAX: return x > acc ? x : acc;
    case SMP_PROD: return acc * x;
    }
    return NAN;
}

/* The members of this rank's group, computed from the cluster layout
   (a model replica is PARTS adjacent ranks) rather than asked of smp. */
typedef struct members {
    int n, me, wr[MAXR];
} members;

static members group_members(smp_group g) {
    members m;
    m.n = 0;
    m.me = -1;
    int mp = W_RANK % PARTS, dp = W_RANK / PARTS;
    for (int r = 0; r < W_SIZE; r++) {
        bool in = g == SMP_WORLD || (g == SMP_MP_GROUP && r / PARTS == dp) || (g == SMP_DP_GROUP && r % PARTS == mp);
        if (!in) continue;
        if (r == W_RANK) m.me = m.n;
        m.wr[m.n++] = r;
    }
    return m;
}

/* Reference of element i reduced over the group, reading member k's element
   at index (offset + i). */
static double ref_reduce(const members *m, smp_op op, size_t idx, unsigned salt, smp_dtype dt) {
    double acc = val(m->wr[0], idx, salt, dt, op);
    for (int k = 1; k < m->n; k++) acc = combine(op, acc, val(m->wr[k], idx, salt, dt, op));
    if (op == SMP_AVG) acc /= m->n;
    return acc;
}

/* First failure of a group of checks. Loops that call collectives never
   stop early on a failure: the other ranks may not have seen it, and
   would wait in the next collective for a rank that left. */
typedef struct agg {
    int ok;
    char why[400];
} agg;

static void fail(agg *a, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void fail(agg *a, const char *fmt, ...) {
    if (!a->ok) return;
    a->ok = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->why, sizeof a->why, fmt, ap);
    va_end(ap);
}

static bool same(double got, double want) { return got == want || (isnan(got) && isnan(want)); }

/* Every input sequence here repeats with period 156 (the element index enters
   only modulo 13, 3 and 4), and so do the references. A pattern holds two
   periods as typed bytes, so that any run of up to one period starting at
   any phase is contiguous in it: filling and checking 2^20 elements is then
   memcpy and memcmp, and only a mismatching run is looked at element by
   element. */
#define PERIOD 156
typedef struct pattern {
    smp_dtype dt;
    double tol; /* relative tolerance; 0: exact */
    double v[PERIOD];
    unsigned char bytes[2 * PERIOD * 8];
} pattern;

static void pattern_set(pattern *p, smp_dtype dt) {
    p->dt = dt;
    p->tol = 0;
    for (size_t i = 0; i < 2 * PERIOD; i++) put(p->bytes, dt, i, p->v[i % PERIOD]);
}

/* buf[i] = sequence element (base + i), i < n */
static void pattern_fill(const pattern *p, void *buf, size_t n, size_t base) {
    size_t es = smp_dtype_size(p->dt);
    for (size_t i = 0; i < n;) {
        size_t phase = (base + i) % PERIOD, len = n - i < PERIOD ? n - i : PERIOD;
        memcpy((char *)buf + i * es, p->bytes + phase * es, len * es);
        i += len;
    }
}

/* Index of the first element of buf[0..n) that differs in value from the
   sequence at (base + i), or -1; *got and *want receive the two values. */
static long pattern_find_mismatch(const pattern *p, const void *buf, size_t n, size_t base, double *got, double *want) {
    size_t es = smp_dtype_size(p->dt);
    for (size_t i = 0; i < n;) {
        size_t phase = (base + i) % PERIOD, len = n - i < PERIOD ? n - i : PERIOD;
        if (memcmp((const char *)buf + i * es, p->bytes + phase * es, len * es) != 0)
            for (size_t k = 0; k < len; k++) {
                double g = get(buf, p->dt, i + k), w = p->v[(phase + k) % PERIOD];
                if (!same(g, w) && !(fabs(g - w) <= p->tol * fabs(w))) { *got = g; *want = w; return (long)(i + k); }
            }
        i += len;
    }
    return -1;
}

/* The inputs of world rank wr as a pattern. */
static void input_pattern(pattern *p, int wr, unsigned salt, smp_dtype dt, smp_op op) {
    for (size_t i = 0; i < PERIOD; i++) p->v[i] = val(wr, i, salt, dt, op);
    pattern_set(p, dt);
}

static size_t SIZES[5];
#define NSIZES 5

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of memory (%zu bytes)\n", n); MPI_Abort(MPI_COMM_WORLD, 2); }
    return p;
}

static bool rejects_avg(smp_dtype dt, smp_op op) { return op == SMP_AVG && !is_float(dt); }

/* Expect the rejection of avg on an integer tensor. */
static void expect_avg_rejected(agg *a, smp_status st, const char *fn) {
    if (st != SMP_ERR_ARG || !strstr(smp_last_error(), "avg"))
        fail(a, "%s with avg on an integer tensor gave %s (%.200s), want SMP_ERR_ARG naming avg", fn,
             smp_status_name(st), smp_last_error());
}

/* The reference of an op over the group's inputs, as a pattern. Every
   result is exact except a mean over a group whose size is not a power of
   two (-n 3): smp may round sum x (1/n) rather than sum / n, so allow two
   units in the last place of the dtype. */
static void reduced_pattern(pattern *p, const members *m, smp_op op, unsigned salt, smp_dtype dt) {
    for (size_t i = 0; i < PERIOD; i++) p->v[i] = ref_reduce(m, op, i, salt, dt);
    pattern_set(p, dt);
    if (op == SMP_AVG && (m->n & (m->n - 1)))
        p->tol = dt == SMP_F64 ? 0x1p-51 : dt == SMP_F32 ? 0x1p-22 : dt == SMP_F16 ? 0x1p-9 : 0x1p-6;
}

/* Checks buf against p; on a mismatch records `what` and the element. */
static void expect_pattern(agg *a, const pattern *p, const void *buf, size_t n, size_t base, const char *what) {
    double got, want;
    long at = a->ok ? pattern_find_mismatch(p, buf, n, base, &got, &want) : -1;
    if (at >= 0) fail(a, "%s: element %ld is %g, want %g", what, at, got, want);
}

static const char *place_name(int inplace) { return inplace ? "inplace" : "outofplace"; }

/* ================================================================ all_reduce */
static void test_all_reduce(smp_dtype dt, smp_op op, int gi) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    agg a = {1, ""};
    size_t es = smp_dtype_size(dt);
    unsigned salt = (unsigned)(dt * 5 + op * 3 + gi);
    static pattern mine, want;
    input_pattern(&mine, W_RANK, salt, dt, op);
    reduced_pattern(&want, &m, op, salt, dt);
    for (int inplace = 0; inplace < 2; inplace++)
        for (int si = 0; si < NSIZES; si++) {
            size_t n = SIZES[si];
            char what[64];
            snprintf(what, sizeof what, "%s n=%zu", place_name(inplace), n);
            void *in = xmalloc(n * es), *out = inplace ? in : xmalloc(n * es);
            pattern_fill(&mine, in, n, 0);
            if (!inplace) memset(out, 0xA5, n * es);
            smp_tensor ti = smp_tensor_1d(in, dt, (int64_t)n), to = smp_tensor_1d(out, dt, (int64_t)n);
            smp_status st = smp_all_reduce(&ti, &to, op, g);
            if (rejects_avg(dt, op)) expect_avg_rejected(&a, st, "smp_all_reduce");
            else if (st != SMP_OK) fail(&a, "%s: %.200s", what, smp_last_error());
            else {
                expect_pattern(&a, &want, out, n, 0, what);
                if (!inplace) expect_pattern(&a, &mine, in, n, 0, "outofplace input changed");
            }
            if (!inplace) free(out);
            free(in);
        }
    char name[128];
    snprintf(name, sizeof name, "%sall_reduce/%s/%s/%s", PIECES, smp_dtype_name(dt), OP_NAMES[op], GROUP_NAMES[gi]);
    MPI_CHECK(a.ok, name, "%s", a.why);
}

/* The same through a persistent handle, made once per buffer and run on two
   inputs in turn: each run must reduce what in holds then. (Not at 2^20
   elements: nothing there differs from 1000 for a handle, and the pieces
   below cover a handle of several requests.) */
static void test_persistent_all_reduce(smp_dtype dt, smp_op op, int gi) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    agg a = {1, ""};
    size_t es = smp_dtype_size(dt);
    static pattern mine[2], want[2];
    for (int k = 0; k < 2; k++) {
        unsigned salt = (unsigned)(dt * 5 + op * 3 + gi + 101 * k);
        input_pattern(&mine[k], W_RANK, salt, dt, op);
        reduced_pattern(&want[k], &m, op, salt, dt);
    }
    for (int inplace = 0; inplace < 2; inplace++)
        for (int si = 0; si < NSIZES && SIZES[si] < BIG; si++) {
            size_t n = SIZES[si];
            void *in = xmalloc(n * es), *out = inplace ? in : xmalloc(n * es);
            smp_tensor ti = smp_tensor_1d(in, dt, (int64_t)n), to = smp_tensor_1d(out, dt, (int64_t)n);
            static char not_a_handle;
            smp_persistent *h = (smp_persistent *)(void *)&not_a_handle; /* a failed call must set it to NULL */
            smp_status st = smp_all_reduce_init(&ti, &to, op, g, &h);
            if (rejects_avg(dt, op)) expect_avg_rejected(&a, st, "smp_all_reduce_init");
            else if (st != SMP_OK)
                fail(&a, "%s n=%zu: smp_all_reduce_init: %.200s", place_name(inplace), n, smp_last_error());
            if (st && h) {
                fail(&a, "a failed smp_all_reduce_init left a handle");
                h = NULL;
            }
            for (int k = 0; k < 2 && a.ok && !st; k++) {
                char what[64];
                snprintf(what, sizeof what, "%s n=%zu run %d", place_name(inplace), n, k);
                pattern_fill(&mine[k], in, n, 0);
                if (!inplace) memset(out, 0xA5, n * es);
                if ((st = smp_persistent_run(h)) != SMP_OK) fail(&a, "%s: %.200s", what, smp_last_error());
                else {
                    expect_pattern(&a, &want[k], out, n, 0, what);
                    if (!inplace) expect_pattern(&a, &mine[k], in, n, 0, "outofplace input changed");
                }
            }
            smp_persistent_free(h);
            if (!inplace) free(out);
            free(in);
        }
    char name[128];
    snprintf(name, sizeof name, "%spersistent_all_reduce/%s/%s/%s", PIECES, smp_dtype_name(dt), OP_NAMES[op],
             GROUP_NAMES[gi]);
    MPI_CHECK(a.ok, name, "%s", a.why);
}

/* ================================================================ reduce */
static void test_reduce(smp_dtype dt, smp_op op, int gi) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    agg a = {1, ""};
    size_t es = smp_dtype_size(dt);
    static pattern mine, want;
    for (int root = 0; root < m.n; root += (m.n > 1 ? m.n - 1 : 1)) /* first and last member */
        for (int inplace = 0; inplace < 2; inplace++) {
            unsigned salt = (unsigned)(dt * 5 + op * 3 + gi + root * 11);
            input_pattern(&mine, W_RANK, salt, dt, op);
            reduced_pattern(&want, &m, op, salt, dt);
            for (int si = 0; si < NSIZES; si++) {
                size_t n = SIZES[si];
                char what[64];
                snprintf(what, sizeof what, "root %d %s n=%zu", root, place_name(inplace), n);
                bool is_root = m.me == root;
                void *in = xmalloc(n * es), *out = NULL;
                pattern_fill(&mine, in, n, 0);
                if (is_root) {
                    out = inplace ? in : xmalloc(n * es);
                    if (!inplace) memset(out, 0xA5, n * es);
                }
                smp_tensor ti = smp_tensor_1d(in, dt, (int64_t)n), to = smp_tensor_1d(out, dt, (int64_t)n);
                smp_status st = smp_reduce(&ti, is_root ? &to : NULL, op, root, g);
                if (rejects_avg(dt, op)) expect_avg_rejected(&a, st, "smp_reduce");
                else if (st != SMP_OK) fail(&a, "%s: %.200s", what, smp_last_error());
                else {
                    if (is_root) expect_pattern(&a, &want, out, n, 0, what);
                    if (!is_root || !inplace) expect_pattern(&a, &mine, in, n, 0, "input changed");
                }
                if (out && out != in) free(out);
                free(in);
            }
        }
    char name[128];
    snprintf(name, sizeof name, "%sreduce/%s/%s/%s", PIECES, smp_dtype_name(dt), OP_NAMES[op], GROUP_NAMES[gi]);
    MPI_CHECK(a.ok, name, "%s", a.why);
}

/* ================================================================ broadcast */
static void test_broadcast(smp_dtype dt, int gi) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    agg a = {1, ""};
    size_t es = smp_dtype_size(dt);
    static pattern theirs;
    for (int root = 0; root < m.n; root += (m.n > 1 ? m.n - 1 : 1)) {
        unsigned salt = (unsigned)(dt + gi * 7 + root);
        input_pattern(&theirs, m.wr[root], salt, dt, SMP_SUM);
        for (int si = 0; si < NSIZES; si++) {
            size_t n = SIZES[si];
            void *buf = xmalloc(n * es);
            if (m.me == root) pattern_fill(&theirs, buf, n, 0);
            else memset(buf, 0xA5, n * es);
            int64_t shape[2] = {(int64_t)(n % 2 ? 1 : 2), (int64_t)(n % 2 ? n : n / 2)}; /* a 2-d tensor */
            smp_tensor t = smp_tensor_make(buf, dt, 2, shape);
            smp_status st = smp_broadcast(&t, root, g);
            char what[64];
            snprintf(what, sizeof what, "root %d n=%zu", root, n);
            if (st != SMP_OK) fail(&a, "%s: %.200s", what, smp_last_error());
            expect_pattern(&a, &theirs, buf, n, 0, what);
            free(buf);
        }
    }
    char name[128];
    snprintf(name, sizeof name, "%sbroadcast/%s/%s", PIECES, smp_dtype_name(dt), GROUP_NAMES[gi]);
    MPI_CHECK(a.ok, name, "%s", a.why);
}

/* ================================================================ all_gather */
static void test_all_gather(smp_dtype dt, int gi) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    agg a = {1, ""};
    size_t es = smp_dtype_size(dt);
    unsigned salt = (unsigned)(dt * 3 + gi);
    static pattern each[MAXR];
    for (int k = 0; k < m.n; k++) input_pattern(&each[k], m.wr[k], salt, dt, SMP_SUM);
    for (int inplace = 0; inplace < 2; inplace++)
        for (int si = 0; si < NSIZES; si++) {
            size_t n = SIZES[si] == BIG ? BIG / (size_t)m.n : SIZES[si]; /* n per member */
            void *out = xmalloc(n * es * (size_t)m.n);
            memset(out, 0xA5, n * es * (size_t)m.n);
            void *in = inplace ? (char *)out + (size_t)m.me * n * es : xmalloc(n * es);
            pattern_fill(&each[m.me], in, n, 0);
            int64_t oshape[2] = {(int64_t)m.n, (int64_t)n};
            smp_tensor ti = smp_tensor_1d(in, dt, (int64_t)n), to = smp_tensor_make(out, dt, 2, oshape);
            smp_status st = smp_all_gather(&ti, &to, g);
            if (st != SMP_OK) fail(&a, "%s n=%zu: %.200s", place_name(inplace), n, smp_last_error());
            for (int k = 0; k < m.n && a.ok; k++) {
                char what[64];
                snprintf(what, sizeof what, "%s n=%zu block %d", place_name(inplace), n, k);
                expect_pattern(&a, &each[k], (char *)out + (size_t)k * n * es, n, 0, what);
            }
            if (!inplace) expect_pattern(&a, &each[m.me], in, n, 0, "outofplace input changed");
            if (!inplace) free(in);
            free(out);
        }
    char name[128];
    snprintf(name, sizeof name, "%sall_gather/%s/%s", PIECES, smp_dtype_name(dt), GROUP_NAMES[gi]);
    MPI_CHECK(a.ok, name, "%s", a.why);
}

/* ================================================================ reduce_scatter */
static void test_reduce_scatter(smp_dtype dt, smp_op op, int gi) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    agg a = {1, ""};
    size_t es = smp_dtype_size(dt);
    unsigned salt = (unsigned)(dt * 5 + op * 3 + gi + 1);
    static pattern mine, want;
    input_pattern(&mine, W_RANK, salt, dt, op);
    reduced_pattern(&want, &m, op, salt, dt);
    for (int inplace = 0; inplace < 2; inplace++)
        for (int si = 0; si < NSIZES; si++) {
            size_t n = SIZES[si] == BIG ? BIG / (size_t)m.n : SIZES[si]; /* n per member */
            size_t total = n * (size_t)m.n;
            void *in = xmalloc(total * es);
            pattern_fill(&mine, in, total, 0);
            void *out = inplace ? (char *)in + (size_t)m.me * n * es : xmalloc(n * es);
            if (!inplace) memset(out, 0xA5, n * es);
            smp_tensor ti = smp_tensor_1d(in, dt, (int64_t)total), to = smp_tensor_1d(out, dt, (int64_t)n);
            smp_status st = smp_reduce_scatter(&ti, &to, op, g);
            char what[64];
            snprintf(what, sizeof what, "%s n=%zu", place_name(inplace), n);
            if (rejects_avg(dt, op)) expect_avg_rejected(&a, st, "smp_reduce_scatter");
            else if (st != SMP_OK) fail(&a, "%s: %.200s", what, smp_last_error());
            else {
                /* this member's block is the reduction of everyone's block me */
                expect_pattern(&a, &want, out, n, (size_t)m.me * n, what);
                if (!inplace) expect_pattern(&a, &mine, in, total, 0, "outofplace input changed");
            }
            if (!inplace) free(out);
            free(in);
        }
    char name[128];
    snprintf(name, sizeof name, "%sreduce_scatter/%s/%s/%s", PIECES, smp_dtype_name(dt), OP_NAMES[op], GROUP_NAMES[gi]);
    MPI_CHECK(a.ok, name, "%s", a.why);
}

/* ================================================================ all_to_all_single */
/* What member `from` (world rank) sends to group member `to`: element i of
   that block. Period 13 in i. */
static double a2a_val(int from_wr, int to, size_t i, unsigned salt, smp_dtype dt) {
    double v = (double)((from_wr * 5u + (unsigned)to * 11u + i * 3u + salt) % 13u);
    return dt == SMP_U8 ? v : v - 6;
}
static void a2a_pattern(pattern *p, int from_wr, int to, unsigned salt, smp_dtype dt) {
    for (size_t i = 0; i < PERIOD; i++) p->v[i] = a2a_val(from_wr, to, i, salt, dt);
    pattern_set(p, dt);
}

/* Rows that group member `from` sends to member `to` with unequal splits:
   0, 1 or 2 times `scale` (some pairs send nothing). */
static int64_t a2a_rows(int from, int to, int64_t scale) { return (int64_t)((from + 2 * to + 1) % 3) * scale; }

static void test_all_to_all(smp_dtype dt, int gi, bool equal) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    agg a = {1, ""};
    size_t es = smp_dtype_size(dt);
    const int64_t cols = equal ? 1 : 3;
    unsigned salt = (unsigned)(dt * 7 + gi + (equal ? 0 : 3));
    static pattern to_them[MAXR], from_them[MAXR];
    for (int k = 0; k < m.n; k++) {
        a2a_pattern(&to_them[k], W_RANK, k, salt, dt);
        a2a_pattern(&from_them[k], m.wr[k], m.me, salt, dt);
    }
    for (int inplace = 0; inplace < 2; inplace++)
        for (int si = 0; si < NSIZES; si++) {
            /* equal: n rows to each member; unequal: 0..2 x scale rows of 3 */
            int64_t scale = (int64_t)(SIZES[si] == BIG ? BIG / (size_t)m.n : SIZES[si]);
            if (!equal && SIZES[si] == BIG) scale = BIG / (3 * 2 * m.n);
            int64_t send_rows[MAXR], recv_rows[MAXR], in_total = 0, out_total = 0;
            for (int k = 0; k < m.n; k++) {
                send_rows[k] = equal ? scale : a2a_rows(m.me, k, scale);
                recv_rows[k] = equal ? scale : a2a_rows(k, m.me, scale);
                in_total += send_rows[k];
                out_total += recv_rows[k];
            }
            size_t in_elems = (size_t)(in_total * cols), out_elems = (size_t)(out_total * cols);
            size_t cap = in_elems > out_elems ? in_elems : out_elems;
            void *in = xmalloc((inplace ? cap : in_elems) * es);
            void *out = inplace ? in : xmalloc(out_elems * es);
            size_t at = 0;
            for (int k = 0; k < m.n; k++) {
                pattern_fill(&to_them[k], (char *)in + at * es, (size_t)(send_rows[k] * cols), 0);
                at += (size_t)(send_rows[k] * cols);
            }
            if (!inplace) memset(out, 0xA5, out_elems * es);
            int64_t ishape[2] = {in_total, cols}, oshape[2] = {out_total, cols};
            smp_tensor ti = smp_tensor_make(in, dt, equal ? 1 : 2, ishape),
                       to = smp_tensor_make(out, dt, equal ? 1 : 2, oshape);
            smp_status st = equal ? smp_all_to_all_single(&ti, &to, NULL, NULL, g)
                                  : smp_all_to_all_single(&ti, &to, recv_rows, send_rows, g);
            if (st != SMP_OK) fail(&a, "%s rows=%lld: %.200s", place_name(inplace), (long long)scale, smp_last_error());
            at = 0;
            for (int k = 0; k < m.n && a.ok; k++) {
                char what[80];
                snprintf(what, sizeof what, "%s rows=%lld block from member %d", place_name(inplace), (long long)scale,
                         k);
                expect_pattern(&a, &from_them[k], (char *)out + at * es, (size_t)(recv_rows[k] * cols), 0, what);
                at += (size_t)(recv_rows[k] * cols);
            }
            at = 0;
            for (int k = 0; k < m.n && a.ok && !inplace; k++) {
                expect_pattern(&a, &to_them[k], (char *)in + at * es, (size_t)(send_rows[k] * cols), 0,
                               "outofplace input changed");
                at += (size_t)(send_rows[k] * cols);
            }
            if (!inplace) free(out);
            free(in);
        }
    char name[128];
    snprintf(name, sizeof name, "all_to_all_single/%s/%s/%s", equal ? "equal" : "unequal", smp_dtype_name(dt),
             GROUP_NAMES[gi]);
    MPI_CHECK(a.ok, name, "%s", a.why);
}

/* ================================================================ barrier */
static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The group's member 0 arrives 300 ms late; nobody may leave before it came. */
static void test_barrier(int gi) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    if (m.me == 0) sleep_ms(300);
    smp_status st = smp_barrier(g);
    double waited = MPI_Wtime() - t0;
    char name[64];
    snprintf(name, sizeof name, "barrier/%s", GROUP_NAMES[gi]);
    MPI_CHECK(st == SMP_OK && (m.me == 0 || waited > 0.25), name,
              "group rank %d left the barrier after %.3f s, while member 0 came after 0.3 s (%.200s)", m.me, waited,
              st == SMP_OK ? "smp_barrier returned SMP_OK" : smp_last_error());
}

/* ================================================================ object messaging */
static unsigned char msg_byte(int from_wr, int to_wr, size_t len, size_t i) {
    return (unsigned char)(from_wr * 31 + to_wr * 17 + len * 3 + i * 7 + 1);
}

static void test_send_recv(smp_group rt, int gi) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    agg a = {1, ""};
    char name[96];
    snprintf(name, sizeof name, "objects/send_recv/%s", GROUP_NAMES[gi]);
    if (m.n == 1) {
        char b = 0;
        smp_status st = smp_send(&b, 1, 0, rt);
        if (st != SMP_ERR_ARG || !strstr(smp_last_error(), "this rank"))
            fail(&a, "sending to itself gave %s (%.200s)", smp_status_name(st), smp_last_error());
        MPI_CHECK(a.ok, name, "%s", a.why);
        return;
    }
    int to = (m.me + 1) % m.n, from = (m.me + m.n - 1) % m.n;
    static const size_t lens[] = {0, 13, 1 << 20};
    for (int li = 0; li < 3; li++) {
        size_t len = lens[li];
        unsigned char *buf = (unsigned char *)xmalloc(len);
        for (size_t i = 0; i < len; i++) buf[i] = msg_byte(W_RANK, m.wr[to], len, i);
        void *got = NULL;
        size_t got_len = 7;
        smp_status s1, s2;
        /* a large send completes only once received: half send first */
        if (m.me % 2 == 0) {
            s1 = smp_send(buf, len, to, rt);
            s2 = smp_recv_from(from, rt, &got, &got_len);
        } else {
            s2 = smp_recv_from(from, rt, &got, &got_len);
            s1 = smp_send(buf, len, to, rt);
        }
        if (s1 != SMP_OK || s2 != SMP_OK)
            fail(&a, "len %zu: send %s, recv %s (%.200s)", len, smp_status_name(s1), smp_status_name(s2),
                 smp_last_error());
        else if (got_len != len) fail(&a, "len %zu: received %zu bytes", len, got_len);
        else if (!got || ((char *)got)[len] != 0) fail(&a, "len %zu: received buffer is not NUL-terminated", len);
        else
            for (size_t i = 0; i < len && a.ok; i++)
                if (((unsigned char *)got)[i] != msg_byte(m.wr[from], W_RANK, len, i))
                    fail(&a, "len %zu: byte %zu differs", len, i);
        smp_free(got);
        free(buf);
    }
    /* a send that fails on the sender: the receiver gets its error instead
       of waiting for the timeout, and the next message pairs as before */
    {
        void *got = NULL;
        size_t got_len = 0;
        smp_status s1 = smp_send(NULL, 5, to, rt), s2 = smp_recv_from(from, rt, &got, &got_len);
        if (s1 != SMP_ERR_ARG) fail(&a, "a send of NULL gave %s", smp_status_name(s1));
        else if (s2 != SMP_ERR_REMOTE || !strstr(smp_last_error(), "failed its smp_send to this rank") ||
                 !strstr(smp_last_error(), "buffer is NULL"))
            fail(&a, "the receive of a failed send gave %s (%.200s)", smp_status_name(s2), smp_last_error());
        const char next[] = "next";
        if (m.me % 2 == 0) {
            s1 = smp_send(next, sizeof next, to, rt);
            s2 = smp_recv_from(from, rt, &got, &got_len);
        } else {
            s2 = smp_recv_from(from, rt, &got, &got_len);
            s1 = smp_send(next, sizeof next, to, rt);
        }
        if (s1 || s2 || got_len != sizeof next || strcmp((const char *)got, next))
            fail(&a, "the message after a failed send: send %s, recv %s, %zu bytes", smp_status_name(s1),
                 smp_status_name(s2), got_len);
        smp_free(got);
    }
    /* outside the group, and itself */
    char b = 0;
    smp_status st = smp_send(&b, 1, m.n, rt);
    if (st != SMP_ERR_ARG || !strstr(smp_last_error(), "outside"))
        fail(&a, "send to member %d of %d gave %s (%.200s)", m.n, m.n, smp_status_name(st), smp_last_error());
    void *p = NULL;
    size_t pl = 0;
    st = smp_recv_from(-1, rt, &p, &pl);
    if (st != SMP_ERR_ARG || !strstr(smp_last_error(), "outside"))
        fail(&a, "recv from -1 gave %s (%.200s)", smp_status_name(st), smp_last_error());
    st = smp_send(&b, 1, m.me, rt);
    if (st != SMP_ERR_ARG || !strstr(smp_last_error(), "this rank"))
        fail(&a, "send to itself gave %s (%.200s)", smp_status_name(st), smp_last_error());
    MPI_CHECK(a.ok, name, "%s", a.why);
}

static void test_broadcast_bytes(int gi) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    agg a = {1, ""};
    for (int root = 0; root < m.n; root++)
        for (int big = 0; big < 3; big++) {
            size_t len = big == 0 ? 0 : big == 1 ? (size_t)(100 * root + 3) : (size_t)(1 << 20) + (size_t)root;
            void *buf = NULL;
            size_t n = 999;
            if (m.me == root) {
                buf = xmalloc(len);
                for (size_t i = 0; i < len; i++) ((unsigned char *)buf)[i] = msg_byte(m.wr[root], -1, len, i);
                n = len;
            }
            smp_status st = smp_broadcast_bytes(&buf, &n, root, g);
            if (st != SMP_OK) fail(&a, "root %d len %zu: %.200s", root, len, smp_last_error());
            else if (n != len) fail(&a, "root %d: got %zu bytes, want %zu", root, n, len);
            else
                for (size_t i = 0; i < len && a.ok; i++)
                    if (((unsigned char *)buf)[i] != msg_byte(m.wr[root], -1, len, i))
                        fail(&a, "root %d len %zu: byte %zu differs", root, len, i);
            if (m.me == root) free(buf);
            else smp_free(buf);
        }
    void *buf = NULL;
    size_t n = 0;
    smp_status st = smp_broadcast_bytes(&buf, &n, m.n, g);
    if (st != SMP_ERR_ARG || !strstr(smp_last_error(), "root"))
        fail(&a, "root %d of %d gave %s (%.200s)", m.n, m.n, smp_status_name(st), smp_last_error());
    char name[96];
    snprintf(name, sizeof name, "objects/broadcast_bytes/%s", GROUP_NAMES[gi]);
    MPI_CHECK(a.ok, name, "%s", a.why);
}

static void test_allgather_bytes(int gi) {
    smp_group g = GROUPS[gi];
    members m = group_members(g);
    agg a = {1, ""};
    for (int round = 0; round < 2; round++) {
        /* member k contributes k*37 bytes (member 0: none); round 1 adds one large one */
        size_t lens_of[MAXR];
        for (int k = 0; k < m.n; k++) lens_of[k] = (size_t)k * 37 + (round && k == m.n - 1 ? (size_t)(1 << 20) : 0);
        size_t mine = lens_of[m.me];
        unsigned char *buf = (unsigned char *)xmalloc(mine);
        for (size_t i = 0; i < mine; i++) buf[i] = msg_byte(W_RANK, -2, mine, i);
        void *out = NULL;
        size_t lens[MAXR];
        smp_status st = smp_all_gather_bytes(mine ? buf : NULL, mine, g, &out, lens);
        if (st != SMP_OK) fail(&a, "round %d: %.200s", round, smp_last_error());
        else {
            size_t at = 0;
            for (int k = 0; k < m.n && a.ok; k++) {
                if (lens[k] != lens_of[k]) {
                    fail(&a, "round %d: lens[%d] = %zu, want %zu", round, k, lens[k], lens_of[k]);
                    break;
                }
                for (size_t i = 0; i < lens[k] && a.ok; i++)
                    if (((unsigned char *)out)[at + i] != msg_byte(m.wr[k], -2, lens[k], i))
                        fail(&a, "round %d: member %d byte %zu differs", round, k, i);
                at += lens[k];
            }
        }
        smp_free(out);
        free(buf);
    }
    char name[96];
    snprintf(name, sizeof name, "objects/allgather_bytes/%s", GROUP_NAMES[gi]);
    MPI_CHECK(a.ok, name, "%s", a.why);
}

/* ================================================================ DLPack */
static void test_dlpack(void) {
    agg a = {1, ""};
    static const struct { smp_dtype dt; uint8_t code, bits; } map[] = {
        {SMP_F32, kDLFloat, 32}, {SMP_F64, kDLFloat, 64}, {SMP_F16, kDLFloat, 16}, {SMP_BF16, kDLBfloat, 16},
        {SMP_I32, kDLInt, 32},   {SMP_I64, kDLInt, 64},   {SMP_U8, kDLUInt, 8}};
    static char storage[4096];
    for (int d = 0; d < 7; d++)
        for (int ndim = 0; ndim <= 3; ndim++) {
            int64_t shape[3] = {2, 3, 5};
            smp_tensor t = smp_tensor_make(storage, map[d].dt, ndim, shape), back;
            int64_t dl_shape[SMP_MAX_DIMS];
            DLTensor dl = smp_tensor_to_dlpack(&t, dl_shape);
            if (dl.data != storage || dl.ndim != ndim || dl.dtype.code != map[d].code || dl.dtype.bits != map[d].bits ||
                dl.dtype.lanes != 1 || dl.device.device_type != kDLCPU || dl.byte_offset != 0 || dl.strides != NULL ||
                dl.shape != dl_shape)
                fail(&a, "to_dlpack %s ndim %d: data %s, code %d bits %d lanes %d device %d", smp_dtype_name(map[d].dt),
                     ndim, dl.data == storage ? "shared" : "copied", dl.dtype.code, dl.dtype.bits, dl.dtype.lanes,
                     (int)dl.device.device_type);
            for (int i = 0; i < ndim; i++)
                if (dl.shape[i] != shape[i]) fail(&a, "to_dlpack: shape[%d] = %lld", i, (long long)dl.shape[i]);
            smp_status st = smp_tensor_from_dlpack(&dl, &back);
            if (st != SMP_OK || back.data != storage || back.dtype != map[d].dt || back.ndim != ndim ||
                back.device != SMP_HOST || !smp_tensor_same_shape(&back, &t))
                fail(&a, "round trip %s ndim %d: %s, dtype %s ndim %d device %d", smp_dtype_name(map[d].dt), ndim,
                     smp_status_name(st), smp_dtype_name(back.dtype), back.ndim, back.device);
        }
    /* a DLTensor made by someone else: byte offset, explicit compact strides,
       CUDA device, and the ones smp must refuse */
    int64_t shape[2] = {4, 6}, strides[2] = {6, 1}, bad_strides[2] = {1, 4};
    DLTensor dl;
    memset(&dl, 0, sizeof dl);
    dl.data = storage;
    dl.byte_offset = 64;
    dl.ndim = 2;
    dl.shape = shape;
    dl.strides = strides;
    dl.dtype.code = kDLFloat;
    dl.dtype.bits = 32;
    dl.dtype.lanes = 1;
    dl.device.device_type = kDLCPU;
    smp_tensor t;
    smp_status st = smp_tensor_from_dlpack(&dl, &t);
    if (st != SMP_OK || t.data != storage + 64 || t.dtype != SMP_F32 || t.shape[0] != 4 || t.shape[1] != 6)
        fail(&a, "byte_offset 64 + compact strides: %s (%.200s), data offset %td", smp_status_name(st),
             smp_last_error(), (char *)t.data - storage);
    dl.device.device_type = kDLCUDA;
    dl.device.device_id = 3;
    st = smp_tensor_from_dlpack(&dl, &t);
    if (st != SMP_OK || t.device != SMP_CUDA(3))
        fail(&a, "CUDA device 3: %s, device %d", smp_status_name(st), t.device);
    int64_t cuda_shape[SMP_MAX_DIMS];
    DLTensor cuda_back = smp_tensor_to_dlpack(&t, cuda_shape);
    if (cuda_back.device.device_type != kDLCUDA || cuda_back.device.device_id != 3)
        fail(&a, "CUDA device 3 back to DLPack: type %d, id %d", (int)cuda_back.device.device_type,
             (int)cuda_back.device.device_id);
    dl.device.device_type = kDLCPU;
    dl.strides = bad_strides;
    st = smp_tensor_from_dlpack(&dl, &t);
    if (st != SMP_ERR_ARG || !strstr(smp_last_error(), "contiguous"))
        fail(&a, "transposed strides gave %s (%.200s)", smp_status_name(st), smp_last_error());
    dl.strides = strides;
    dl.dtype.lanes = 4;
    st = smp_tensor_from_dlpack(&dl, &t);
    if (st != SMP_ERR_ARG || !strstr(smp_last_error(), "lanes"))
        fail(&a, "4 lanes gave %s (%.200s)", smp_status_name(st), smp_last_error());
    dl.dtype.lanes = 1;
    dl.dtype.bits = 8; /* float8: no smp dtype */
    st = smp_tensor_from_dlpack(&dl, &t);
    if (st != SMP_ERR_ARG) fail(&a, "float8 gave %s (%.200s)", smp_status_name(st), smp_last_error());
    dl.dtype.bits = 32;
    dl.device.device_type = kDLOpenCL;
    st = smp_tensor_from_dlpack(&dl, &t);
    if (st != SMP_ERR_ARG || !strstr(smp_last_error(), "device"))
        fail(&a, "OpenCL device gave %s (%.200s)", smp_status_name(st), smp_last_error());
    MPI_CHECK(a.ok, "dlpack/round_trip_and_refusals", "%s", a.why);
}

/* ================================================================ f16 / bf16 */
static void test_half_conversions(void) {
    agg f16 = {1, ""}, bf16 = {1, ""}, f16h = {1, ""}, bf16h = {1, ""}, rnd = {1, ""};
    for (uint32_t h = 0; h < 65536; h++) {
        /* decode matches the definition, and encoding it again gives the same bits */
        float f = smp_f16_to_f32((uint16_t)h);
        double want = ref_f16_decode((uint16_t)h);
        if (isnan(want) ? !isnan(f) : ((double)f != want || !signbit(f) != !signbit(want)))
            fail(&f16, "smp_f16_to_f32(0x%04x) = %.9g, want %.9g", h, (double)f, want);
        uint16_t back = smp_f32_to_f16(f);
        if (isnan(want) ? ((back & 0x7c00) != 0x7c00 || !(back & 0x3ff)) : back != h)
            fail(&f16, "smp_f32_to_f16(smp_f16_to_f32(0x%04x)) = 0x%04x", h, back);

        float g = smp_bf16_to_f32((uint16_t)h);
        want = ref_bf16_decode((uint16_t)h);
        if (isnan(want) ? !isnan(g) : ((double)g != want || !signbit(g) != !signbit(want)))
            fail(&bf16, "smp_bf16_to_f32(0x%04x) = %.9g, want %.9g", h, (double)g, want);
        back = smp_f32_to_bf16(g);
        if (isnan(want) ? ((back & 0x7f80) != 0x7f80 || !(back & 0x7f)) : back != h)
            fail(&bf16, "smp_f32_to_bf16(smp_bf16_to_f32(0x%04x)) = 0x%04x", h, back);
    }
    /* every point halfway between two neighbouring halves rounds to the even
       one, and a hair either side rounds to the nearer one; both signs */
    for (uint32_t h = 0; h < 0x7c00; h++) {
        double lo = ref_f16_decode((uint16_t)h), hi = h + 1 < 0x7c00 ? ref_f16_decode((uint16_t)(h + 1)) : 65536.0;
        float mid = (float)((lo + hi) / 2); /* exact: 12 significant bits */
        uint16_t even = (uint16_t)(h % 2 ? h + 1 : h);
        for (int s = 0; s < 2; s++) {
            uint16_t sg = s ? 0x8000 : 0;
            float m = s ? -mid : mid;
            uint16_t got = smp_f32_to_f16(m);
            if (got != (even | sg))
                fail(&f16h, "smp_f32_to_f16(%.9g) = 0x%04x, want 0x%04x (ties to even)", (double)m, got, even | sg);
            got = smp_f32_to_f16(nextafterf(m, 0));
            if (got != (h | sg))
                fail(&f16h, "smp_f32_to_f16(%.9g, just below a tie) = 0x%04x, want 0x%04x", (double)nextafterf(m, 0),
                     got, h | sg);
            got = smp_f32_to_f16(nextafterf(m, s ? -INFINITY : INFINITY));
            if (got != ((h + 1) | sg))
                fail(&f16h, "smp_f32_to_f16(just above a tie %.9g) = 0x%04x, want 0x%04x", (double)m, got,
                     (h + 1) | sg);
        }
    }
    for (uint32_t h = 0; h < 0x7f80; h++) {
        uint32_t mid_bits = (h << 16) | 0x8000; /* halfway to the next bf16, exact in f32 */
        float mid;
        memcpy(&mid, &mid_bits, 4);
        uint16_t even = (uint16_t)(h % 2 ? h + 1 : h);
        for (int s = 0; s < 2; s++) {
            uint16_t sg = s ? 0x8000 : 0;
            float m = s ? -mid : mid;
            uint16_t got = smp_f32_to_bf16(m);
            if (got != (even | sg))
                fail(&bf16h, "smp_f32_to_bf16(%.9g) = 0x%04x, want 0x%04x (ties to even)", (double)m, got, even | sg);
            got = smp_f32_to_bf16(nextafterf(m, 0));
            if (got != (h | sg))
                fail(&bf16h, "smp_f32_to_bf16(just below a tie %.9g) = 0x%04x, want 0x%04x", (double)m, got, h | sg);
            got = smp_f32_to_bf16(nextafterf(m, s ? -INFINITY : INFINITY));
            if (got != ((h + 1) | sg))
                fail(&bf16h, "smp_f32_to_bf16(just above a tie %.9g) = 0x%04x, want 0x%04x", (double)m, got,
                     (h + 1) | sg);
        }
    }
    /* arbitrary f32 bit patterns (f32 subnormals, huge values, NaNs) against
       the reference encoder */
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (int k = 0; k < 1000000 && rnd.ok; k++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t bits = (uint32_t)(s >> 32);
        float f;
        memcpy(&f, &bits, 4);
        uint16_t a = smp_f32_to_f16(f), wa = ref_f16_encode(f);
        uint16_t b = smp_f32_to_bf16(f), wb = ref_bf16_encode(f);
        if (isnan(f)) {
            if ((a & 0x7c00) != 0x7c00 || !(a & 0x3ff) || (b & 0x7f80) != 0x7f80 || !(b & 0x7f))
                fail(&rnd, "NaN 0x%08x became f16 0x%04x / bf16 0x%04x", bits, a, b);
        } else if (a != wa || b != wb)
            fail(&rnd, "f32 0x%08x (%.9g): f16 0x%04x want 0x%04x, bf16 0x%04x want 0x%04x", bits, (double)f, a, wa, b,
                 wb);
    }
    MPI_CHECK(f16.ok, "dtype/f16/all_65536_round_trip", "%s", f16.why);
    MPI_CHECK(bf16.ok, "dtype/bf16/all_65536_round_trip", "%s", bf16.why);
    MPI_CHECK(f16h.ok, "dtype/f16/halfway_ties_to_even", "%s", f16h.why);
    MPI_CHECK(bf16h.ok, "dtype/bf16/halfway_ties_to_even", "%s", bf16h.why);
    MPI_CHECK(rnd.ok, "dtype/f32_to_half/random_bit_patterns", "%s", rnd.why);
}

/* ================================================================ argument errors */
/* st must be `want` and the message must contain every one of the words. */
static void expect_error(const char *name, smp_status st, smp_status want, const char *w1, const char *w2) {
    const char *msg = smp_last_error();
    bool ok = st == want && (!w1 || strstr(msg, w1)) && (!w2 || strstr(msg, w2));
    MPI_CHECK(ok, name, "gave %s: \"%.250s\", want %s naming %s%s%s", smp_status_name(st), msg, smp_status_name(want),
              w1 ? w1 : "", w2 ? " and " : "", w2 ? w2 : "");
}

/* Runs fn in a child process so that a crash is a failed check, not a dead
   test. The child makes no MPI calls of its own. Returns the child's status
   or -signal. */
static int in_child(smp_status (*fn)(void)) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL); /* die quietly: UCX's handler would print a backtrace */
        signal(SIGBUS, SIG_DFL);
        _exit((int)fn());
    }
    if (pid < 0) return -1000;
    int ws = 0;
    waitpid(pid, &ws, 0);
    if (WIFSIGNALED(ws)) return -WTERMSIG(ws);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -999;
}
static smp_status null_all_gather_in(void) {
    float x[4];
    smp_tensor o = smp_tensor_1d(x, SMP_F32, 4);
    return smp_all_gather(NULL, &o, SMP_WORLD);
}
static smp_status null_reduce_scatter_out(void) {
    float x[64];
    smp_tensor i = smp_tensor_1d(x, SMP_F32, 64);
    return smp_reduce_scatter(&i, NULL, SMP_SUM, SMP_WORLD);
}
static smp_status null_all_reduce_out(void) {
    float x[4];
    smp_tensor i = smp_tensor_1d(x, SMP_F32, 4);
    return smp_all_reduce(&i, NULL, SMP_SUM, SMP_WORLD);
}
static smp_status null_all_to_all_in(void) {
    float x[4];
    smp_tensor o = smp_tensor_1d(x, SMP_F32, 4);
    return smp_all_to_all_single(NULL, &o, NULL, NULL, SMP_WORLD);
}

static smp_status null_reduce_out_on_root(void) {
    float x[4];
    smp_tensor i = smp_tensor_1d(x, SMP_F32, 4);
    return smp_reduce(&i, NULL, SMP_SUM, smp_group_rank(SMP_WORLD), SMP_WORLD);
}

static void test_argument_errors(void) {
    members w = group_members(SMP_WORLD);
    float f[64] = {0};
    double d[64] = {0};
    int32_t iv[64] = {0};
    smp_tensor tf = smp_tensor_1d(f, SMP_F32, 8), td = smp_tensor_1d(d, SMP_F64, 8), tf7 = smp_tensor_1d(f, SMP_F32, 7);
    smp_tensor ti = smp_tensor_1d(iv, SMP_I32, 8);

    expect_error("errors/all_reduce/dtype_mismatch", smp_all_reduce(&tf, &td, SMP_SUM, SMP_WORLD), SMP_ERR_ARG, "f32",
                 "f64");
    {
        /* a persistent all-reduce checks what MPI needs alike on every member: an error on all of them */
        smp_persistent *h = NULL;
        expect_error("errors/persistent/null_handle", smp_persistent_run(NULL), SMP_ERR_ARG, "NULL",
                     "smp_all_reduce_init");
        expect_error("errors/persistent/null_out", smp_all_reduce_init(&tf, &tf, SMP_SUM, SMP_WORLD, NULL), SMP_ERR_ARG,
                     "NULL", NULL);
        expect_error("errors/persistent/one_rank_bad",
                     smp_all_reduce_init(&tf, W_RANK == 0 ? &td : &tf, SMP_SUM, SMP_WORLD, &h), SMP_ERR_ARG, "f64",
                     NULL);
        MPI_CHECK(!h, "errors/persistent/one_rank_bad_no_handle", "a handle came back from a failed call");
        if (w.n > 1) {
            expect_error("errors/persistent/counts_differ",
                         smp_all_reduce_init(W_RANK == 0 ? &tf7 : &tf, W_RANK == 0 ? &tf7 : &tf, SMP_SUM, SMP_WORLD, &h),
                         SMP_ERR_ARG, "from 7 to 8 elements", "same count");
            expect_error("errors/persistent/dtypes_differ",
                         smp_all_reduce_init(W_RANK == 0 ? &td : &tf, W_RANK == 0 ? &td : &tf, SMP_SUM, SMP_WORLD, &h),
                         SMP_ERR_ARG, "same dtype", NULL);
            expect_error("errors/persistent/ops_differ",
                         smp_all_reduce_init(&tf, &tf, W_RANK == 0 ? SMP_MAX : SMP_SUM, SMP_WORLD, &h), SMP_ERR_ARG,
                         "same op", "(sum and max)");
            MPI_CHECK(!h, "errors/persistent/mismatch_no_handle", "a handle came back from a failed call");
        }
        /* and nothing was left half made: a good handle works after those */
        for (int i = 0; i < 8; i++) f[i] = (float)(W_RANK + i);
        smp_status st = smp_all_reduce_init(&tf, &tf, SMP_SUM, SMP_WORLD, &h);
        if (!st) st = smp_persistent_run(h);
        bool ok = st == SMP_OK;
        for (int i = 0; i < 8 && ok; i++) ok = f[i] == (float)(w.n * (w.n - 1) / 2 + w.n * i);
        MPI_CHECK(ok, "errors/persistent/works_after_errors", "%s: %.200s", smp_status_name(st), smp_last_error());
        smp_persistent_free(h);
    }
    expect_error("errors/all_reduce/element_count", smp_all_reduce(&tf, &tf7, SMP_SUM, SMP_WORLD), SMP_ERR_ARG,
                 "elements", NULL);
    expect_error("errors/all_reduce/avg_on_i32", smp_all_reduce(&ti, &ti, SMP_AVG, SMP_WORLD), SMP_ERR_ARG, "avg",
                 "i32");
    expect_error("errors/all_reduce/unknown_op", smp_all_reduce(&tf, &tf, (smp_op)9, SMP_WORLD), SMP_ERR_ARG, "op",
                 NULL);
    expect_error("errors/all_reduce/bad_group", smp_all_reduce(&tf, &tf, SMP_SUM, (smp_group)7), SMP_ERR_ARG, "group",
                 NULL);
    expect_error("errors/all_reduce/negative_group", smp_all_reduce(&tf, &tf, SMP_SUM, (smp_group)-1), SMP_ERR_ARG,
                 "group", NULL);
    {
        smp_tensor bad = tf;
        bad.dtype = (smp_dtype)42;
        expect_error("errors/all_reduce/invalid_dtype", smp_all_reduce(&bad, &bad, SMP_SUM, SMP_WORLD), SMP_ERR_ARG,
                     "dtype", NULL);
        bad = tf;
        bad.shape[0] = -3;
        expect_error("errors/all_reduce/negative_dim", smp_all_reduce(&bad, &bad, SMP_SUM, SMP_WORLD), SMP_ERR_ARG,
                     "negative", NULL);
        bad = tf;
        bad.data = NULL;
        expect_error("errors/all_reduce/no_data", smp_all_reduce(&bad, &bad, SMP_SUM, SMP_WORLD), SMP_ERR_ARG, "data",
                     NULL);
        bad = tf;
        bad.device = SMP_CUDA(0);
        expect_error("errors/all_reduce/cuda_without_backend", smp_all_reduce(&bad, &bad, SMP_SUM, SMP_WORLD),
                     SMP_ERR_ARG, "smp_all_reduce: in is on CUDA device 0", "no device backend");
        bad.device = -1;
        expect_error("errors/all_reduce/negative_device", smp_all_reduce(&bad, &bad, SMP_SUM, SMP_WORLD), SMP_ERR_ARG,
                     "smp_all_reduce: in has device -1", "SMP_HOST");
        smp_tensor host = tf;
        bad.device = SMP_CUDA(1);
        expect_error("errors/all_reduce/out_on_cuda_without_backend", smp_all_reduce(&host, &bad, SMP_SUM, SMP_WORLD),
                     SMP_ERR_ARG, "smp_all_reduce: out", "device");
        /* a zero-initialised tensor is in host memory (zero is the default everywhere) */
        float one = 1;
        smp_tensor zeroed = {.data = &one, .dtype = SMP_F32, .ndim = 1, .shape = {1}};
        smp_status st = smp_all_reduce(&zeroed, &zeroed, SMP_SUM, SMP_WORLD);
        MPI_CHECK(st == SMP_OK && one == (float)w.n, "errors/all_reduce/zero_initialised_tensor_is_host",
                  "gave %s (%.200s), sum %g", smp_status_name(st), smp_last_error(), (double)one);
    }
    expect_error("errors/broadcast/root_too_big", smp_broadcast(&tf, w.n, SMP_WORLD), SMP_ERR_ARG, "root", NULL);
    expect_error("errors/broadcast/root_negative", smp_broadcast(&tf, -1, SMP_WORLD), SMP_ERR_ARG, "root", NULL);
    expect_error("errors/reduce/root_too_big", smp_reduce(&tf, &tf, SMP_SUM, w.n, SMP_WORLD), SMP_ERR_ARG, "root",
                 NULL);
    expect_error("errors/reduce/dtype_mismatch_on_root", smp_reduce(&tf, &td, SMP_SUM, w.me, SMP_WORLD), SMP_ERR_ARG,
                 "f32", "f64");
    {
        /* every rank passes the same bad count, so every rank returns */
        smp_tensor out = smp_tensor_1d(f, SMP_F32, 9);
        expect_error("errors/all_gather/element_count", smp_all_gather(&tf, &out, SMP_WORLD), SMP_ERR_ARG, "elements",
                     NULL);
        expect_error("errors/reduce_scatter/element_count", smp_reduce_scatter(&out, &tf7, SMP_SUM, SMP_WORLD),
                     SMP_ERR_ARG, "elements", NULL);
        expect_error("errors/all_gather/dtype_mismatch", smp_all_gather(&tf, &td, SMP_WORLD), SMP_ERR_ARG, "f32",
                     "f64");
    }
    {
        int64_t splits[MAXR];
        for (int k = 0; k < w.n; k++) splits[k] = 1;
        splits[0] = 2; /* adds up to n+1 rows, the tensors have n */
        smp_tensor a = smp_tensor_1d(f, SMP_F32, w.n), b = smp_tensor_1d(f + 32, SMP_F32, w.n);
        expect_error("errors/all_to_all/splits_do_not_add_up", smp_all_to_all_single(&a, &b, splits, splits, SMP_WORLD),
                     SMP_ERR_ARG, "splits", NULL);
        splits[0] = -1;
        expect_error("errors/all_to_all/negative_split", smp_all_to_all_single(&a, &b, splits, splits, SMP_WORLD),
                     SMP_ERR_ARG, "negative", NULL);
        if (w.n > 1) {
            smp_tensor c = smp_tensor_1d(f, SMP_F32, w.n + 1), e = smp_tensor_1d(f + 32, SMP_F32, w.n + 1);
            expect_error("errors/all_to_all/dim0_not_divisible", smp_all_to_all_single(&c, &e, NULL, NULL, SMP_WORLD),
                         SMP_ERR_ARG, "divide", NULL);
        }
        smp_tensor r2 = smp_tensor_2d(f, SMP_F32, w.n, 2), r3 = smp_tensor_2d(f + 32, SMP_F32, w.n, 3);
        expect_error("errors/all_to_all/row_width", smp_all_to_all_single(&r2, &r3, NULL, NULL, SMP_WORLD), SMP_ERR_ARG,
                     "rows", NULL);
    }
    expect_error("errors/barrier/bad_group", smp_barrier((smp_group)17), SMP_ERR_ARG, "group", NULL);
    {
        void *out = NULL;
        size_t lens[MAXR];
        expect_error("errors/allgather_bytes/bad_group", smp_all_gather_bytes(f, 4, (smp_group)17, &out, lens),
                     SMP_ERR_ARG, "group", NULL);
        expect_error("errors/send/bad_group", smp_send(f, 4, 0, (smp_group)9), SMP_ERR_ARG, "unknown group 9", NULL);
    }
    /* NULL tensors must be refused, not dereferenced (run in a child) */
    {
        struct { const char *name; smp_status (*fn)(void); } cases[] = {
            {"errors/all_gather/null_in", null_all_gather_in},
            {"errors/reduce_scatter/null_out", null_reduce_scatter_out},
            {"errors/all_reduce/null_out", null_all_reduce_out},
            {"errors/all_to_all/null_in", null_all_to_all_in},
            {"errors/reduce/null_out_on_root", null_reduce_out_on_root},
        };
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            int rc = in_child(cases[c].fn);
            MPI_CHECK(rc == SMP_ERR_ARG, cases[c].name, "%s",
                      rc < 0 ? "crashed (signal) instead of returning SMP_ERR_ARG"
                             : "returned a status other than SMP_ERR_ARG");
        }
    }
}

/* Calls made before smp_init (and after smp_finalize) are refused. */
static void test_not_running(const char *when) {
    float f[4] = {0};
    smp_tensor t = smp_tensor_1d(f, SMP_F32, 4);
    void *p = NULL;
    size_t n = 0, lens[MAXR];
    char name[96];
#define NOT_RUNNING(label, call)                                                                        \
    snprintf(name, sizeof name, "errors/%s/%s", when, label);                                          \
    expect_error(name, call, SMP_ERR_STATE, "before smp_init", NULL);
    NOT_RUNNING("all_reduce", smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD));
    smp_persistent *h = NULL;
    NOT_RUNNING("all_reduce_init", smp_all_reduce_init(&t, &t, SMP_SUM, SMP_WORLD, &h));
    NOT_RUNNING("broadcast", smp_broadcast(&t, 0, SMP_WORLD));
    NOT_RUNNING("reduce", smp_reduce(&t, &t, SMP_SUM, 0, SMP_WORLD));
    NOT_RUNNING("all_gather", smp_all_gather(&t, &t, SMP_WORLD));
    NOT_RUNNING("reduce_scatter", smp_reduce_scatter(&t, &t, SMP_SUM, SMP_WORLD));
    NOT_RUNNING("all_to_all_single", smp_all_to_all_single(&t, &t, NULL, NULL, SMP_WORLD));
    NOT_RUNNING("barrier", smp_barrier(SMP_WORLD));
    NOT_RUNNING("send", smp_send(f, 4, 0, SMP_WORLD));
    NOT_RUNNING("recv_from", smp_recv_from(0, SMP_WORLD, &p, &n));
    NOT_RUNNING("broadcast_bytes", smp_broadcast_bytes(&p, &n, 0, SMP_WORLD));
    NOT_RUNNING("allgather_bytes", smp_all_gather_bytes(f, 4, SMP_WORLD, &p, lens));
#undef NOT_RUNNING
}

/* ================================================================ main */
int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &W_RANK);
    MPI_Comm_size(MPI_COMM_WORLD, &W_SIZE);
    (void)test_report;
    (void)test_skip;
    if (W_SIZE > MAXR) {
        if (W_RANK == 0) printf("SKIP: collectives: more than %d ranks\n", MAXR);
        MPI_Finalize();
        return 0;
    }
    PARTS = W_SIZE % 2 == 0 ? 2 : 1;
    SIZES[0] = 0; SIZES[1] = 1; SIZES[2] = 7; SIZES[3] = 1000; SIZES[4] = BIG;
    double t0 = MPI_Wtime();

    test_not_running("before_init");
    test_half_conversions();

    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.partitions = PARTS;
    if (W_SIZE / PARTS > 1) cfg.ddp = SMP_ON;
    if (!getenv("SMP_TIMEOUT")) cfg.timeout = 60; /* a collective that hangs ends the test with a message */
    int64_t mem_at_start = smp_memory().current_bytes;
    smp_status st = smp_init(&cfg);
    MPI_CHECK(st == SMP_OK, "collectives/init", "smp_init: %.300s", smp_last_error());
    if (st != SMP_OK) { MPI_Finalize(); return 1; }
    int64_t mem_before = smp_memory().current_bytes;

    for (int gi = 0; gi < 3; gi++)
        for (int d = 0; d < NDTYPES; d++)
            for (int o = 0; o < 5; o++) {
                test_all_reduce(DTYPES[d], OPS[o], gi);
                /* a handle's path is the same for every dtype of a kind: a float, a half (smp's own MPI ops)
                   and an integer (no avg) stand for them (at 4 ranks every collective costs milliseconds) */
                if (DTYPES[d] == SMP_F32 || DTYPES[d] == SMP_BF16 || DTYPES[d] == SMP_I32)
                    test_persistent_all_reduce(DTYPES[d], OPS[o], gi);
            }
    for (int gi = 0; gi < 3; gi++)
        for (int d = 0; d < NDTYPES; d++)
            for (int o = 0; o < 5; o++) test_reduce(DTYPES[d], OPS[o], gi);
    for (int gi = 0; gi < 3; gi++)
        for (int d = 0; d < NDTYPES; d++)
            for (int o = 0; o < 5; o++) test_reduce_scatter(DTYPES[d], OPS[o], gi);
    for (int gi = 0; gi < 3; gi++)
        for (int d = 0; d < NDTYPES; d++) {
            test_broadcast(DTYPES[d], gi);
            test_all_gather(DTYPES[d], gi);
            test_all_to_all(DTYPES[d], gi, true);
            test_all_to_all(DTYPES[d], gi, false);
        }
    for (int gi = 0; gi < 3; gi++) test_barrier(gi);

    /* in pieces of 300 elements: sizes 0, 1 and 7 fit one, 1000 is four
       (the last short), 3001 per member eleven; each dtype width, every op */
    PIECES = "pieces/";
    smp__coll_chunk = 300;
    SIZES[4] = 3001;
    static const smp_dtype PIECE_DTYPES[] = {SMP_F32, SMP_F64, SMP_F16, SMP_U8};
    for (int gi = 0; gi < 3; gi++)
        for (int d = 0; d < 4; d++) {
            for (int o = 0; o < 5; o++) {
                test_all_reduce(PIECE_DTYPES[d], OPS[o], gi);
                if (PIECE_DTYPES[d] == SMP_F64 || PIECE_DTYPES[d] == SMP_U8) /* 8 and 1 bytes a piece's element */
                    test_persistent_all_reduce(PIECE_DTYPES[d], OPS[o], gi);
                test_reduce(PIECE_DTYPES[d], OPS[o], gi);
                test_reduce_scatter(PIECE_DTYPES[d], OPS[o], gi);
            }
            test_broadcast(PIECE_DTYPES[d], gi);
            test_all_gather(PIECE_DTYPES[d], gi);
        }
    smp__coll_chunk = INT_MAX;
    SIZES[4] = BIG;
    PIECES = "";

    static const smp_group RT[] = {SMP_WORLD, SMP_MP_GROUP, SMP_DP_GROUP};
    for (int gi = 0; gi < 3; gi++) {
        test_send_recv(RT[gi], gi);
        test_broadcast_bytes(gi);
        test_allgather_bytes(gi);
    }
    test_dlpack();
    test_argument_errors();

    /* small all-reduces keep staging buffers for their persistent requests
       (at most 8 per group, each at most 2 x 8 KiB) until smp_finalize */
    int64_t held = smp_memory().current_bytes - mem_before;
    MPI_CHECK(held >= 0 && held <= 3 * 8 * 2 * (8 << 10), "collectives/scratch_held_is_bounded",
              "%lld bytes held between calls", (long long)held);
    /* a handle still alive at smp_finalize loses its MPI side: a run is an
       error, and freeing it after is still right */
    float late_data[4] = {0};
    smp_tensor late_t = smp_tensor_1d(late_data, SMP_F32, 4);
    smp_persistent *late = NULL;
    st = smp_all_reduce_init(&late_t, &late_t, SMP_SUM, SMP_WORLD, &late);
    smp_finalize();
    if (!st) st = smp_persistent_run(late);
    MPI_CHECK(st == SMP_ERR_STATE && strstr(smp_last_error(), "smp_finalize released"),
              "collectives/persistent_after_finalize", "gave %s: %.200s", smp_status_name(st), smp_last_error());
    smp_persistent_free(late);
    int64_t leaked = smp_memory().current_bytes - mem_at_start;
    MPI_CHECK(leaked == 0, "collectives/no_leaked_scratch",
              "%lld bytes allocated through smp were not given back by smp_finalize", (long long)leaked);
    test_not_running("after_finalize");
    if (W_RANK == 0) fprintf(stderr, "test_collectives: %.1f s on %d ranks\n", MPI_Wtime() - t0, W_SIZE);
    int failed = test_exit_code();
    MPI_Finalize();
    return failed;
}
