/* test_autopart.c - the auto-partitioner: exact optimum, tie-break, edges, errors.
   Single process; no MPI_Init needed.
   Build (from the repository root): mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. test/test_autopart.c -o
   build/test_autopart -lm */
#define SMP_TESTING /* the test hooks and test-only introspection */
#define SMP_IMPLEMENTATION
#include "../smp.h"
#include "test.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ helpers */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_unit(void) { return (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0); }
static int rng_int(int lo, int hi) { return lo + (int)(rng_next() % (uint64_t)(hi - lo + 1)); }

/* One cost drawn from one of several shapes, ties and zeros included. */
static double draw_cost(int kind) {
    switch (kind) {
    case 0: return (double)rng_int(0, 5);                         /* small integers: many ties */
    case 1: return rng_unit();                                    /* uniform */
    case 2: return pow(10.0, -8.0 + 16.0 * rng_unit());           /* sixteen decades */
    case 3: return rng_int(0, 9) == 0 ? 50.0 * rng_unit() : 1.0;  /* equal, now and then a big one */
    default: return 0.1 * rng_int(0, 7);                          /* decimals that do not add exactly */
    }
}

/* Stage cost as the library defines it: added left to right. */
static double sum_range(const double *c, int b, int e) {
    double s = 0.0;
    for (int i = b; i < e; i++) s += c[i];
    return s;
}

/* Contiguous, non-empty, 0..k-1 in order. */
static int valid_assignment(const int *stage, int n, int k) {
    if (n < 1 || stage[0] != 0 || stage[n - 1] != k - 1) return 0;
    for (int i = 1; i < n; i++)
        if (stage[i] != stage[i - 1] && stage[i] != stage[i - 1] + 1) return 0;
    return 1;
}

static double assignment_max(const double *c, const int *stage, int n) {
    double worst = 0.0;
    int b = 0;
    for (int i = 1; i <= n; i++) {
        if (i == n || stage[i] != stage[b]) {
            double s = sum_range(c, b, i);
            if (s > worst) worst = s;
            b = i;
        }
    }
    return worst;
}

/* Brute force: every boundary vector in lexicographic order; keeps the first
   with the smallest largest stage. */
typedef struct brute {
    const double *c;
    int n, k;
    int bound[70], best_bound[70];
    double best;
} brute;

static void brute_rec(brute *b, int level) {
    if (level == b->k) {
        double worst = 0.0;
        for (int s = 0; s < b->k; s++) {
            double v = sum_range(b->c, b->bound[s], b->bound[s + 1]);
            if (v > worst) worst = v;
        }
        if (worst < b->best) {
            b->best = worst;
            memcpy(b->best_bound, b->bound, sizeof b->bound);
        }
        return;
    }
    /* bound[level] is the start of stage `level`; leave a call per later stage */
    for (int e = b->bound[level - 1] + 1; e <= b->n - (b->k - level); e++) {
        b->bound[level] = e;
        brute_rec(b, level + 1);
    }
}

static double brute_force(const double *c, int n, int k, int *stage) {
    brute b;
    memset(&b, 0, sizeof b);
    b.c = c;
    b.n = n;
    b.k = k;
    b.best = INFINITY;
    b.bound[0] = 0;
    b.bound[k] = n;
    brute_rec(&b, 1);
    for (int s = 0; s < k; s++)
        for (int i = b.best_bound[s]; i < b.best_bound[s + 1]; i++) stage[i] = s;
    return b.best;
}

/* Exact DP over all stage sums, O(k n^2), for medium sizes. */
static double dp_optimum(const double *c, int n, int k) {
    double *prev = malloc((size_t)(n + 1) * sizeof *prev), *cur = malloc((size_t)(n + 1) * sizeof *cur);
    double r;
    for (int j = 0; j <= n; j++) prev[j] = j == 0 ? 0.0 : INFINITY;
    for (int s = 1; s <= k; s++) {
        for (int j = 0; j <= n; j++) cur[j] = INFINITY;
        for (int i = s - 1; i < n; i++) {
            double sum = 0.0;
            if (prev[i] == INFINITY) continue;
            for (int j = i + 1; j <= n; j++) {
                double v;
                sum += c[j - 1];
                v = prev[i] > sum ? prev[i] : sum;
                if (v < cur[j]) cur[j] = v;
            }
        }
        memcpy(prev, cur, (size_t)(n + 1) * sizeof *prev);
    }
    r = prev[n];
    free(prev);
    free(cur);
    return r;
}

/* Independent greedy: fewest stages within cap (n + 1 when a call exceeds it). */
static int greedy_stages(const double *c, int n, double cap) {
    int stages = 0, i = 0;
    while (i < n) {
        double s = 0.0;
        int first = i;
        while (i < n && s + c[i] <= cap) s += c[i++];
        if (i == first) return n + 1;
        stages++;
    }
    return stages;
}

static int close_rel(double a, double b) {
    double scale = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
    return fabs(a - b) <= 1e-12 * scale || a == b;
}

/* The test's own combined cost, written from the documented formula. */
static void combined_costs(const smp_call_cost *calls, int n, double w, double f, double *out) {
    double tt = 0.0, tm = 0.0;
    for (int i = 0; i < n; i++) {
        tt += calls[i].time;
        tm += calls[i].param_bytes * (2.0 + f) + calls[i].activation_bytes;
    }
    for (int i = 0; i < n; i++) {
        double m = calls[i].param_bytes * (2.0 + f) + calls[i].activation_bytes;
        out[i] = (1.0 - w) * (tt > 0.0 ? calls[i].time / tt : 0.0) + w * (tm > 0.0 ? m / tm : 0.0);
    }
}

static void show(char *buf, size_t cap, const int *v, int n) {
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < n && used + 8 < cap; i++) used += (size_t)snprintf(buf + used, cap - used, "%d ", v[i]);
}

/* ------------------------------------------------------------ brute-force comparisons */
static void test_core_vs_brute(void) {
    int trials = 3000, bad = 0;
    char why[512] = "";
    for (int t = 0; t < trials; t++) {
        double c[12], got = -1.0, want;
        int n = rng_int(1, 12), k = rng_int(1, n < 5 ? n : 5), kind = rng_int(0, 4);
        int stage[12], ref[12];
        smp_status st;
        for (int i = 0; i < n; i++) c[i] = draw_cost(kind);
        want = brute_force(c, n, k, ref);
        st = smp_partition_min_max(c, n, k, stage, &got);
        if (st != SMP_OK || !valid_assignment(stage, n, k) || got != want || assignment_max(c, stage, n) != got ||
            memcmp(stage, ref, (size_t)n * sizeof *stage) != 0) {
            if (!bad++) {
                char a[128], r[128];
                show(a, sizeof a, stage, n);
                show(r, sizeof r, ref, n);
                snprintf(why, sizeof why, "trial %d n=%d k=%d: status %d max %.17g (brute %.17g) split [%s] brute [%s]",
                         t, n, k, (int)st, got, want, a, r);
            }
        }
    }
    CHECK(bad == 0, "autopart: core equals brute force exactly, split and tie-break (3000 vectors)",
          "%d bad; first: %s", bad, why);
}

static void test_auto_vs_brute(double w, const char *name) {
    int trials = 1000, bad = 0;
    char why[512] = "";
    for (int t = 0; t < trials; t++) {
        smp_call_cost calls[12];
        double c[12], got = -1.0, want, f = (double[]){0.0, 2.0, 6.0}[rng_int(0, 2)];
        int n = rng_int(1, 12), k = rng_int(1, n < 5 ? n : 5), kind = rng_int(0, 4);
        int stage[12], ref[12];
        smp_status st;
        for (int i = 0; i < n; i++) {
            calls[i].time = draw_cost(kind);
            calls[i].param_bytes = draw_cost(rng_int(0, 4)) * 1e6;
            calls[i].activation_bytes = draw_cost(rng_int(0, 4)) * 1e5;
        }
        combined_costs(calls, n, w, f, c);
        want = brute_force(c, n, k, ref);
        st = smp_auto_partition(calls, n, k, w, f, stage, &got);
        if (st != SMP_OK || !valid_assignment(stage, n, k) || !close_rel(got, want) ||
            !close_rel(assignment_max(c, stage, n), want)) {
            if (!bad++)
                snprintf(why, sizeof why, "trial %d n=%d k=%d f=%g: status %d max %.17g, brute %.17g", t, n, k, f,
                         (int)st, got, want);
        }
    }
    CHECK(bad == 0, name, "%d bad; first: %s", bad, why);
}

static void test_core_vs_dp(void) {
    int bad = 0;
    char why[256] = "";
    for (int t = 0; t < 40; t++) {
        int n = rng_int(30, 300), k = rng_int(2, n < 64 ? n : 64), kind = rng_int(0, 4);
        double *c = malloc((size_t)n * sizeof *c), got = -1.0, want;
        int *stage = malloc((size_t)n * sizeof *stage);
        for (int i = 0; i < n; i++) c[i] = draw_cost(kind);
        want = dp_optimum(c, n, k);
        if (smp_partition_min_max(c, n, k, stage, &got) != SMP_OK || got != want || !valid_assignment(stage, n, k) ||
            assignment_max(c, stage, n) != got) {
            if (!bad++) snprintf(why, sizeof why, "trial %d n=%d k=%d: %.17g vs DP %.17g", t, n, k, got, want);
        }
        free(c);
        free(stage);
    }
    CHECK(bad == 0, "autopart: core equals an O(k n^2) DP for n up to 300, k up to 64", "%d bad; first: %s", bad, why);
}

/* Large inputs: the split is valid, achieves the reported maximum, and no
   smaller cap admits k stages (the next double down needs more). */
static void test_large(void) {
    static const int sizes[][2] = {{4000, 64}, {5000, 8}, {3000, 2}, {4096, 4096}, {2000, 1999}};
    int bad = 0;
    char why[256] = "";
    for (size_t t = 0; t < sizeof sizes / sizeof sizes[0]; t++) {
        int n = sizes[t][0], k = sizes[t][1];
        double *c = malloc((size_t)n * sizeof *c), got = -1.0;
        int *stage = malloc((size_t)n * sizeof *stage);
        for (int i = 0; i < n; i++) c[i] = draw_cost((int)t % 5);
        if (smp_partition_min_max(c, n, k, stage, &got) != SMP_OK || !valid_assignment(stage, n, k) ||
            assignment_max(c, stage, n) != got || (got > 0.0 && greedy_stages(c, n, nextafter(got, 0.0)) <= k)) {
            if (!bad++) snprintf(why, sizeof why, "n=%d k=%d: max %.17g", n, k, got);
        }
        free(c);
        free(stage);
    }
    CHECK(bad == 0, "autopart: large inputs (n up to 5000, k up to 4096) optimal and valid", "%d bad; first: %s", bad,
          why);
}

/* ------------------------------------------------------------ edge cases */
static int same(const int *a, const int *b, int n) { return memcmp(a, b, (size_t)n * sizeof *a) == 0; }

static void test_edges(void) {
    {
        double c[5] = {3, 1, 4, 1, 5}, m = -1;
        int s[5], want[5] = {0, 1, 2, 3, 4};
        smp_status st = smp_partition_min_max(c, 5, 5, s, &m);
        CHECK(st == SMP_OK && same(s, want, 5) && m == 5.0, "autopart: n == k puts one call per stage",
              "status %d max %g", (int)st, m);
    }
    {
        double c[4] = {0.1, 0.2, 0.3, 0.4}, m = -1;
        int s[4], want[4] = {0, 0, 0, 0};
        smp_status st = smp_partition_min_max(c, 4, 1, s, &m);
        CHECK(st == SMP_OK && same(s, want, 4) && m == sum_range(c, 0, 4),
              "autopart: k == 1 is one stage of everything", "status %d max %.17g", (int)st, m);
    }
    {
        double c[6] = {0, 0, 0, 0, 0, 0}, m = -1;
        int s[6], want[6] = {0, 1, 2, 2, 2, 2};
        smp_status st = smp_partition_min_max(c, 6, 3, s, &m);
        CHECK(st == SMP_OK && same(s, want, 6) && m == 0.0,
              "autopart: all-zero costs give max 0 and the earliest boundaries", "status %d max %g", (int)st, m);
    }
    {
        double c[5] = {1, 1, 1e6, 1, 1}, m = -1;
        int s[5], want[5] = {0, 0, 1, 2, 2};
        smp_status st = smp_partition_min_max(c, 5, 3, s, &m);
        CHECK(st == SMP_OK && same(s, want, 5) && m == 1e6, "autopart: one huge call gets a stage of its own",
              "status %d max %g", (int)st, m);
    }
    {
        /* 1 + 1e18 rounds to 1e18: the optimum is a stage that absorbs small calls */
        double c[5] = {1, 1, 1e18, 1, 1}, m = -1;
        int s[5], ref[5];
        double want = brute_force(c, 5, 2, ref);
        smp_status st = smp_partition_min_max(c, 5, 2, s, &m);
        CHECK(st == SMP_OK && same(s, ref, 5) && m == want && m == 1e18,
              "autopart: rounding-absorbed calls match brute force", "status %d max %.17g", (int)st, m);
    }
    {
        /* equal costs: earlier stages lighter (lexicographically smallest boundaries) */
        double c[10] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, m = -1;
        int s[10], want[10] = {0, 1, 1, 1, 2, 2, 2, 3, 3, 3};
        smp_status st = smp_partition_min_max(c, 10, 4, s, &m);
        CHECK(st == SMP_OK && same(s, want, 10) && m == 3.0, "autopart: tie-break keeps the first stages lightest",
              "status %d max %g", (int)st, m);
    }
    {
        double c[3] = {2, 5, 1};
        int s[3], want[3] = {0, 1, 1};
        smp_status st = smp_partition_min_max(c, 3, 2, s, NULL);
        CHECK(st == SMP_OK && same(s, want, 3), "autopart: max_stage_cost may be NULL", "status %d", (int)st);
    }
    {
        /* f = 6: memory = p * 8 + a -> {4, 2, 2}, total 8 */
        smp_call_cost calls[3] = {{0, 0.5, 0}, {0, 0, 2}, {0, 0.25, 0}};
        int s[3], want[3] = {0, 1, 1};
        double m = -1;
        smp_status st = smp_auto_partition(calls, 3, 2, 1.0, 6.0, s, &m);
        CHECK(st == SMP_OK && same(s, want, 3) && m == 0.5,
              "autopart: memory = param_bytes * (2 + optimizer_state_factor) + activation_bytes", "status %d max %g",
              (int)st, m);
    }
    {
        /* time [1,0,0,1], memory [0,1,1,0]: speed, memory and an even mix split differently */
        smp_call_cost calls[4] = {{1, 0, 0}, {0, 0, 1}, {0, 0, 1}, {1, 0, 0}};
        int s0[4], s1[4], sh[4], w0[4] = {0, 1, 1, 1}, w1[4] = {0, 0, 1, 1}, wh[4] = {0, 0, 1, 1};
        double m0 = -1, m1 = -1, mh = -1;
        smp_status a = smp_auto_partition(calls, 4, 2, 0.0, 2.0, s0, &m0);
        smp_status b = smp_auto_partition(calls, 4, 2, 1.0, 2.0, s1, &m1);
        smp_status c = smp_auto_partition(calls, 4, 2, 0.5, 2.0, sh, &mh);
        CHECK(a == SMP_OK && b == SMP_OK && c == SMP_OK && same(s0, w0, 4) && same(s1, w1, 4) && same(sh, wh, 4) &&
                  m0 == 0.5 && m1 == 0.5 && mh == 0.5,
              "autopart: memory_weight 0, 1 and 0.5 weigh time and memory", "maxima %g %g %g", m0, m1, mh);
    }
    {
        /* nothing measured: totals of 0 contribute 0, any split is optimal */
        smp_call_cost calls[4] = {{0, 0, 0}, {0, 0, 0}, {0, 0, 0}, {0, 0, 0}};
        int s[4], want[4] = {0, 1, 1, 1};
        double m = -1;
        smp_status st = smp_auto_partition(calls, 4, 2, 0.5, 2.0, s, &m);
        CHECK(st == SMP_OK && same(s, want, 4) && m == 0.0, "autopart: zero totals contribute nothing",
              "status %d max %g", (int)st, m);
    }
    {
        /* one call that dominates time: it sits alone, max = its share */
        smp_call_cost calls[5] = {{1, 1, 1}, {1, 1, 1}, {1e9, 1, 1}, {1, 1, 1}, {1, 1, 1}};
        int s[5], want[5] = {0, 0, 1, 2, 2};
        double m = -1;
        smp_status st = smp_auto_partition(calls, 5, 3, 0.0, 2.0, s, &m);
        CHECK(st == SMP_OK && same(s, want, 5) && close_rel(m, 1e9 / (1e9 + 4)),
              "autopart: one huge call (auto) gets a stage of its own", "status %d max %.17g", (int)st, m);
    }
}

/* ------------------------------------------------------------ errors */
static int untouched(const int *s, int n) {
    for (int i = 0; i < n; i++)
        if (s[i] != -7) return 0;
    return 1;
}

static void test_errors(void) {
    double c[4] = {1, 2, 3, 4}, m;
    smp_call_cost calls[4] = {{1, 1, 1}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}};
    int s[4];
    char msg[2048];
    struct {
        int n, k;
        const char *name;
    } shape[] = {{3, 4, "k > n"}, {4, 0, "k == 0"}, {4, -1, "k < 0"}, {0, 1, "n == 0"}, {-2, 1, "n < 0"}};
    for (size_t i = 0; i < sizeof shape / sizeof shape[0]; i++) {
        char name[128];
        smp_status a, b;
        for (int j = 0; j < 4; j++) s[j] = -7;
        m = -7;
        a = smp_partition_min_max(c, shape[i].n, shape[i].k, s, &m);
        b = smp_auto_partition(calls, shape[i].n, shape[i].k, 0.5, 2.0, s, &m);
        snprintf(name, sizeof name, "autopart: %s is SMP_ERR_ARG and leaves the outputs alone", shape[i].name);
        CHECK(a == SMP_ERR_ARG && b == SMP_ERR_ARG && untouched(s, 4) && m == -7, name, "statuses %d %d", (int)a,
              (int)b);
    }
    smp_partition_min_max(c, 3, 4, s, &m);
    CHECK(strstr(smp_last_error(), "3 traced calls into 4 stages") != NULL, "autopart: k > n message names both counts",
          "got '%s'", smp_last_error());
    smp_error(SMP_OK, "-");
    smp_auto_partition(calls, 3, 4, 0.5, 2.0, s, &m);
    CHECK(strstr(smp_last_error(), "3 traced calls into 4 stages") != NULL,
          "autopart: the message reaches smp_last_error()", "got '%s'", smp_last_error());

    {
        double bad_values[3] = {-1.0, NAN, INFINITY};
        int ok = 1;
        for (int v = 0; v < 3; v++) {
            double cc[4] = {1, 2, 3, 4};
            cc[2] = bad_values[v];
            for (int j = 0; j < 4; j++) s[j] = -7;
            ok &= smp_partition_min_max(cc, 4, 2, s, &m) == SMP_ERR_ARG && untouched(s, 4);
        }
        {
            double cc[4] = {1, 2, -3, 4};
            smp_partition_min_max(cc, 4, 2, s, &m);
            snprintf(msg, sizeof msg, "%s", smp_last_error());
        }
        CHECK(ok && strstr(msg, "call 2") != NULL, "autopart: negative, NaN and infinite costs are rejected",
              "ok %d, message '%s'", ok, msg);
    }
    {
        int ok = 1;
        ok &= smp_partition_min_max(NULL, 4, 2, s, &m) == SMP_ERR_ARG;
        ok &= smp_partition_min_max(c, 4, 2, NULL, &m) == SMP_ERR_ARG;
        ok &= smp_auto_partition(NULL, 4, 2, 0.0, 2.0, s, &m) == SMP_ERR_ARG;
        ok &= smp_auto_partition(calls, 4, 2, 0.0, 2.0, NULL, &m) == SMP_ERR_ARG;
        CHECK(ok, "autopart: NULL arrays are SMP_ERR_ARG", "a NULL array was accepted");
    }
    {
        double ws[3] = {-0.1, 1.5, NAN}, fs[2] = {-1.0, INFINITY};
        int ok = 1;
        for (int i = 0; i < 3; i++) ok &= smp_auto_partition(calls, 4, 2, ws[i], 2.0, s, &m) == SMP_ERR_ARG;
        for (int i = 0; i < 2; i++) ok &= smp_auto_partition(calls, 4, 2, 0.5, fs[i], s, &m) == SMP_ERR_ARG;
        smp_auto_partition(calls, 4, 2, 1.5, 2.0, s, &m);
        snprintf(msg, sizeof msg, "%s", smp_last_error());
        CHECK(ok && strstr(msg, "memory_weight") != NULL,
              "autopart: memory_weight outside [0, 1] and a bad optimizer_state_factor are rejected",
              "ok %d, message '%s'", ok, msg);
    }
    {
        smp_call_cost bad[2] = {{1, 1, 1}, {1, -5, 1}}, huge[2] = {{1e308, 0, 0}, {1e308, 0, 0}};
        smp_status a = smp_auto_partition(bad, 2, 2, 0.5, 2.0, s, &m), b;
        snprintf(msg, sizeof msg, "%s", smp_last_error());
        b = smp_auto_partition(huge, 2, 2, 0.0, 2.0, s, &m);
        CHECK(a == SMP_ERR_ARG && b == SMP_ERR_ARG && strstr(msg, "param_bytes") != NULL,
              "autopart: a negative field and an overflowing total are rejected", "statuses %d %d, message '%s'",
              (int)a, (int)b, msg);
    }
}

/* ------------------------------------------------------------ several stages per partition
   The model's partitioning with more stages than partitions (virtual stages, zero_bubble_v's V): of all
   contiguous splits into k stages, stage c on partition part_of[c], the one with the least
   m x (costliest partition's sum) + (P - 1) x (costliest stage); sums added as the library adds them (each
   stage left to right, a partition's stages in stage order). */
static double balance_estimate(const double *c, int n, const int *stage, const int *part_of, int P, int m) {
    double load[8] = {0}, smax = 0.0, lmax = 0.0;
    for (int b = 0, i = 1; i <= n; i++)
        if (i == n || stage[i] != stage[b]) {
            double s = sum_range(c, b, i);
            load[part_of[stage[b]]] += s;
            smax = s > smax ? s : smax;
            b = i;
        }
    for (int q = 0; q < P; q++) lmax = load[q] > lmax ? load[q] : lmax;
    return m * lmax + (P - 1.0) * smax;
}

/* every split of n calls into k stages (n <= 12): the least estimate */
static double balance_brute(const double *c, int n, int k, const int *part_of, int P, int m) {
    double best = INFINITY;
    int stage[12];
    for (unsigned cuts = 0; cuts < 1u << (n - 1); cuts++) { /* bit i: a stage ends after call i */
        if (__builtin_popcount(cuts) != k - 1) continue;
        for (int i = 0, st = 0; i < n; i++) {
            stage[i] = st;
            if (cuts >> i & 1) st++;
        }
        double e = balance_estimate(c, n, stage, part_of, P, m);
        best = e < best ? e : best;
    }
    return best;
}

static void test_balance_partitions(void) {
    /* gpt.c's default model as the partitioner sees it: wte, wpe, 6 equal blocks, ln_f, the tied head; in a V on
       2 partitions the stage-optimal split 2,1,1,2 blocks leaves 4 blocks on partition 0 */
    {
        smp_call_cost calls[10];
        memset(calls, 0, sizeof calls);
        double t[10] = {0.01, 0.05, 7, 7, 7, 7, 7, 7, 0.17, 0.21};
        for (int i = 0; i < 10; i++) calls[i].time = t[i];
        int vee[4] = {0, 1, 1, 0}, stage[10], blocks[2] = {0, 0};
        smp_status st = smp_auto_partition(calls, 10, 4, 0.0, 2.0, stage, NULL);
        int before[2] = {0, 0};
        for (int i = 2; i < 8 && !st; i++) before[vee[stage[i]]]++;
        if (!st) st = smp__part_balance_partitions(calls, 10, 4, vee, 2, 8, 0.0, stage);
        for (int i = 2; i < 8 && !st; i++) blocks[vee[stage[i]]]++;
        int want[10] = {0, 0, 0, 0, 1, 2, 2, 3, 3, 3}; /* 2,1,2,1 blocks: 3 on each partition, no stage of 3 */
        CHECK(st == SMP_OK && before[0] != before[1] && blocks[0] == 3 && blocks[1] == 3 && same(stage, want, 10),
              "autopart: zero_bubble_v on 2 partitions puts 3 of gpt's 6 blocks on each (the stage optimum: 2 and 4)",
              "status %d, blocks before %d/%d, after %d/%d, stages %d %d %d %d %d %d %d %d %d %d", (int)st, before[0],
              before[1], blocks[0], blocks[1], stage[0], stage[1], stage[2], stage[3], stage[4], stage[5], stage[6],
              stage[7], stage[8], stage[9]);
    }
    /* random costs, V and round-robin maps, P = 2 and 3: the split's estimate is the least of all splits', and
       never above the stage-optimal split's */
    int bad = 0;
    char why[256] = "";
    for (int trial = 0; trial < 600; trial++) {
        int P = 2 + trial % 2, vs = 2, k = P * vs, n = k + rng_int(0, 12 - k), m = rng_int(1, 16);
        int part_of[6], stage[12];
        bool vee = (trial / 2) % 2;
        for (int c = 0; c < k; c++) part_of[c] = vee ? (c < P ? c : 2 * P - 1 - c) : c % P;
        smp_call_cost calls[12];
        double cost[12], total = 0.0;
        memset(calls, 0, sizeof calls);
        for (int i = 0; i < n; i++) total += calls[i].time = draw_cost(trial % 5);
        for (int i = 0; i < n; i++) cost[i] = total > 0.0 ? calls[i].time / total : 0.0; /* smp's cost at w = 0 */
        smp_status st = smp_auto_partition(calls, n, k, 0.0, 2.0, stage, NULL);
        double was = st ? 0.0 : balance_estimate(cost, n, stage, part_of, P, m);
        if (!st) st = smp__part_balance_partitions(calls, n, k, part_of, P, m, 0.0, stage);
        double got = st ? 0.0 : balance_estimate(cost, n, stage, part_of, P, m);
        double want = balance_brute(cost, n, k, part_of, P, m);
        if (st || !valid_assignment(stage, n, k) || got != want || got > was) {
            if (!bad++)
                snprintf(why, sizeof why, "trial %d (n %d, P %d, %s, m %d): status %d, estimate %.17g, least %.17g, "
                         "stage-optimal %.17g", trial, n, P, vee ? "V" : "round robin", m, (int)st, got, want, was);
        }
    }
    CHECK(bad == 0, "autopart: several stages per partition: the least m x partition + (P-1) x stage of every split "
          "(600 vectors)", "%d bad; first: %s", bad, why);
    /* past the search's budget (2000 calls in a V of 16 stages): a valid split, no worse than the stage optimum */
    {
        enum { N = 2000, K = 16 };
        static smp_call_cost calls[N];
        static double cost[N];
        static int stage[N];
        int part_of[K];
        double total = 0.0;
        for (int c = 0; c < K; c++) part_of[c] = c < K / 2 ? c : K - 1 - c;
        for (int i = 0; i < N; i++) total += calls[i].time = draw_cost(1);
        for (int i = 0; i < N; i++) cost[i] = calls[i].time / total;
        smp_status st = smp_auto_partition(calls, N, K, 0.0, 2.0, stage, NULL);
        double was = st ? 0.0 : balance_estimate(cost, N, stage, part_of, K / 2, 8);
        if (!st) st = smp__part_balance_partitions(calls, N, K, part_of, K / 2, 8, 0.0, stage);
        double got = st ? 0.0 : balance_estimate(cost, N, stage, part_of, K / 2, 8);
        CHECK(st == SMP_OK && valid_assignment(stage, N, K) && got <= was,
              "autopart: several stages per partition, 2000 calls in 16 stages: valid, no worse than the stage optimum",
              "status %d, estimate %.17g against %.17g", (int)st, got, was);
    }
}

int main(void) {
    (void)test_skip; /* test.h's helpers this file does not need */
#ifdef MPI_VERSION
    (void)test_mpi_check;
#endif
    test_core_vs_brute();
    test_auto_vs_brute(0.0, "autopart: speed (w=0) equals brute force (1000 vectors)");
    test_auto_vs_brute(1.0, "autopart: memory (w=1) equals brute force (1000 vectors)");
    test_auto_vs_brute(0.5, "autopart: mixed (w=0.5) equals brute force (1000 vectors)");
    test_core_vs_dp();
    test_large();
    test_edges();
    test_errors();
    test_balance_partitions();
    return test_exit_code();
}
