/* test_schedule.c - pipeline schedules and the schedule simulator
   (smp_pipeline.h, section "schedules and simulator"), in one process.
   Schedules are pure functions: no MPI_Init, no MPI calls.

   Build and run:
     mpicc -std=c11 -Wall -Wextra -Werror -g test/test_schedule.c -o build/test_schedule -lm
     MPICH_CC=clang mpicc -std=c11 -Wall -Wextra -Werror -fsanitize=address,undefined \
           -g test/test_schedule.c -o build/test_schedule_asan -lm
     ./build/test_schedule
*/
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SMP_IMPLEMENTATION
#define SMP_TESTING /* smp_testing_fail: out of memory at each allocation */
#include "../smp.h"
#include "../smp_pipeline.h"
#include "../smp_pipeline.h" /* twice on purpose: the second inclusion must be harmless */
#include "test.h"

/* ------------------------------------------------------------ helpers */

static char why[512]; /* the first problem a check found */

static int fail(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
static int fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    return 0;
}

/* Keeps the first problem of a group of checks: clears *flag and writes
   buf (512 bytes) the first time. */
static void note(int *flag, char *buf, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static void note(int *flag, char *buf, const char *fmt, ...) {
    if (!*flag) return;
    *flag = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, 512, fmt, ap);
    va_end(ap);
}

static const char *kind_name(smp_pipeline_kind k) {
    return k == SMP_PIPELINE_SIMPLE          ? "simple"
           : k == SMP_PIPELINE_ZERO_BUBBLE   ? "zero_bubble"
           : k == SMP_PIPELINE_ZERO_BUBBLE_V ? "zero_bubble_v"
                                             : "interleaved";
}
static bool split_kind(smp_pipeline_kind k) { return k == SMP_PIPELINE_ZERO_BUBBLE || k == SMP_PIPELINE_ZERO_BUBBLE_V; }
static char op_letter(smp_sched_op_kind k) {
    return k == SMP_SCHED_FORWARD ? 'F' : k == SMP_SCHED_BACKWARD ? 'B' : 'W';
}

static unsigned long long rng_state = 0x9e3779b97f4a7c15ULL;
static unsigned rnd(void) { /* xorshift64*, fixed seed: the test is reproducible */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (unsigned)((rng_state * 2685821657736338717ULL) >> 33);
}
static double rnd_uniform(double lo, double hi) { return lo + (hi - lo) * (rnd() / 2147483648.0); }

/* Every (kind, stage, microbatch) exactly once, on stage_rank[stage], and on
   each stage forwards, backwards and (zero bubble) weight-gradient ops in
   increasing microbatch order; W ops only in zero-bubble training schedules,
   each after its own B (on the same rank: a stage's ops share it). */
static int check_valid(const smp_schedule *sc, const int *map) {
    int S = sc->nstages, m = sc->microbatches;
    bool zb = split_kind(sc->kind) && !sc->forward_only;
    int *next = (int *)calloc((size_t)(3 * S), sizeof(int));
    int ok = 1;
    for (int s = 0; s < S && ok; s++)
        if (sc->stage_rank[s] != map[s]) ok = fail("stage_rank[%d] = %d, expected %d", s, sc->stage_rank[s], map[s]);
    for (int r = 0; r < sc->nranks && ok; r++)
        for (int k = 0; k < sc->nops[r] && ok; k++) {
            smp_sched_op op = sc->ops[r][k];
            if (op.stage < 0 || op.stage >= S) {
                ok = fail("rank %d op %d: stage %d out of range", r, k, op.stage);
                break;
            }
            if (map[op.stage] != r) {
                ok = fail("rank %d op %d runs stage %d of rank %d", r, k, op.stage, map[op.stage]);
                break;
            }
            if (op.kind == SMP_SCHED_BACKWARD && sc->forward_only) {
                ok = fail("backward in a forward-only schedule");
                break;
            }
            if (op.kind != SMP_SCHED_FORWARD && op.kind != SMP_SCHED_BACKWARD && op.kind != SMP_SCHED_WEIGHT) {
                ok = fail("rank %d op %d: kind %d", r, k, (int)op.kind);
                break;
            }
            if (op.kind == SMP_SCHED_WEIGHT && !zb) {
                ok = fail("rank %d op %d: W op in a %s%s schedule", r, k, sc->forward_only ? "forward-only " : "",
                          kind_name(sc->kind));
                break;
            }
            int *nx = &next[(int)op.kind * S + op.stage];
            if (op.microbatch != *nx) {
                ok = fail("rank %d op %d: %c(stage %d) microbatch %d, expected %d (out of order or repeated)", r, k,
                          op_letter(op.kind), op.stage, op.microbatch, *nx);
                break;
            }
            if (op.kind == SMP_SCHED_WEIGHT && next[S + op.stage] <= op.microbatch) {
                ok = fail("rank %d op %d: W%d.%d before its B", r, k, op.stage, op.microbatch);
                break;
            }
            (*nx)++;
        }
    for (int s = 0; s < S && ok; s++) {
        if (next[s] != m) ok = fail("stage %d runs %d forwards of %d", s, next[s], m);
        else if (next[S + s] != (sc->forward_only ? 0 : m)) ok = fail("stage %d runs %d backwards", s, next[S + s]);
        else if (next[2 * S + s] != (zb ? m : 0)) ok = fail("stage %d runs %d weight-gradient ops", s, next[2 * S + s]);
    }
    free(next);
    return ok;
}

/* With one stage per rank, interleaved must be exactly 1F1B: min(m, S-s)
   forwards, then one backward one forward, then the remaining backwards. */
static int check_1f1b(const smp_schedule *sc) {
    int S = sc->nstages, m = sc->microbatches;
    for (int s = 0; s < S; s++) {
        int r = sc->stage_rank[s], w = m < S - s ? m : S - s, k = 0, nf = 0, nb = 0;
        smp_sched_op want[2 * 64];
        if (2 * m > 2 * 64) return fail("test limit");
        for (; nf < w; nf++) want[k++] = (smp_sched_op){SMP_SCHED_FORWARD, s, nf};
        while (nf < m) {
            want[k++] = (smp_sched_op){SMP_SCHED_BACKWARD, s, nb++};
            want[k++] = (smp_sched_op){SMP_SCHED_FORWARD, s, nf++};
        }
        while (nb < m) want[k++] = (smp_sched_op){SMP_SCHED_BACKWARD, s, nb++};
        if (sc->nops[r] != k) return fail("rank %d has %d ops, 1F1B has %d", r, sc->nops[r], k);
        for (int q = 0; q < k; q++) {
            smp_sched_op a = sc->ops[r][q], b = want[q];
            if (a.kind != b.kind || a.stage != b.stage || a.microbatch != b.microbatch)
                return fail("S=%d m=%d rank %d op %d is %c%d.%d, 1F1B has %c%d.%d", S, m, r, q,
                            a.kind ? 'B' : 'F', a.stage, a.microbatch, b.kind ? 'B' : 'F', b.stage, b.microbatch);
        }
    }
    return 1;
}

/* Zero bubble: on every rank, W(s, i) before W(s', i) for each of its
   stages s' < s. The executor frees what stage s' made for microbatch i
   after W(s', i), and a later stage of the rank may read it (a skip
   connection) until its own W. */
static int check_w_order(const smp_schedule *sc) {
    int S = sc->nstages, m = sc->microbatches;
    char *done = (char *)calloc((size_t)S * (size_t)m, 1);
    int ok = 1;
    for (int r = 0; r < sc->nranks && ok; r++)
        for (int k = 0; k < sc->nops[r] && ok; k++) {
            smp_sched_op op = sc->ops[r][k];
            if (op.kind != SMP_SCHED_WEIGHT) continue;
            for (int s2 = op.stage + 1; s2 < S && ok; s2++)
                if (sc->stage_rank[s2] == r && !done[(size_t)s2 * (size_t)m + (size_t)op.microbatch])
                    ok = fail("rank %d: W%d.%d before W%d.%d (a later stage of the rank)", r, op.stage, op.microbatch,
                              s2, op.microbatch);
            done[(size_t)op.stage * (size_t)m + (size_t)op.microbatch] = 1;
        }
    free(done);
    return ok;
}

static int same_schedule(const smp_schedule *a, const smp_schedule *b) {
    if (a->nranks != b->nranks || a->nstages != b->nstages) return 0;
    for (int r = 0; r < a->nranks; r++) {
        if (a->nops[r] != b->nops[r]) return 0;
        if (memcmp(a->ops[r], b->ops[r], (size_t)a->nops[r] * sizeof(smp_sched_op))) return 0;
    }
    return 1;
}

/* A random valid stage map: consecutive stages on different ranks, every
   rank used. */
static void random_map(int R, int S, int *map) {
    for (;;) {
        for (int s = 0; s < S; s++) {
            do map[s] = (int)(rnd() % (unsigned)R);
            while (s > 0 && map[s] == map[s - 1]);
        }
        int all = 1;
        for (int r = 0; r < R && all; r++) {
            int f = 0;
            for (int s = 0; s < S; s++) f |= map[s] == r;
            all = f;
        }
        if (all) return;
    }
}

/* ------------------------------------------------------------ tests */

static void test_gpipe_bubble(void) {
    int ok = 1;
    for (int p = 1; p <= 8 && ok; p++)
        for (int m = 1; m <= 32 && ok; m++) {
            double f[8], b[8];
            for (int s = 0; s < p; s++) { f[s] = 1.5; b[s] = 2.75; } /* equal over stages; f != b is fine */
            smp_schedule sc;
            smp_sim_result r;
            if (smp_schedule_build(SMP_PIPELINE_SIMPLE, p, p, NULL, m, false, &sc) != SMP_OK) {
                ok = fail("build p=%d m=%d: %s", p, m, smp_last_error());
                break;
            }
            if (smp_schedule_simulate(&sc, f, b, NULL, 0.0, &r) != SMP_OK) {
                ok = fail("simulate p=%d m=%d: %s", p, m, smp_last_error());
            } else {
                double want = (double)(p - 1) / (double)(m + p - 1);
                if (fabs(r.bubble_fraction - want) > 1e-12)
                    ok = fail("p=%d m=%d: bubble %.15f, want %.15f", p, m, r.bubble_fraction, want);
                else if (fabs(r.makespan - (m + p - 1) * (1.5 + 2.75)) > 1e-9)
                    ok = fail("p=%d m=%d: makespan %g", p, m, r.makespan);
                else if (fabs(r.ideal - m * (1.5 + 2.75)) > 1e-9)
                    ok = fail("p=%d m=%d: ideal %g", p, m, r.ideal);
                smp_sim_result_free(&r);
            }
            smp_schedule_free(&sc);
        }
    CHECK(ok, "gpipe bubble is (p-1)/(m+p-1) for equal stage costs", "%s", why);
}

static void test_1f1b_bubble(void) {
    int ok = 1;
    for (int p = 1; p <= 8 && ok; p++)
        for (int m = 1; m <= 32 && ok; m++) {
            smp_schedule sc;
            smp_sim_result r;
            if (smp_schedule_build(SMP_PIPELINE_INTERLEAVED, p, p, NULL, m, false, &sc) != SMP_OK) {
                ok = fail("build: %s", smp_last_error());
                break;
            }
            if (smp_schedule_simulate(&sc, NULL, NULL, NULL, 0.0, &r) != SMP_OK) {
                ok = fail("simulate: %s", smp_last_error());
            } else {
                double want = (double)(p - 1) / (double)(m + p - 1);
                if (fabs(r.bubble_fraction - want) > 1e-12)
                    ok = fail("p=%d m=%d: bubble %.15f, want %.15f", p, m, r.bubble_fraction, want);
                smp_sim_result_free(&r);
            }
            smp_schedule_free(&sc);
        }
    CHECK(ok, "1f1b bubble is (p-1)/(m+p-1) for unit costs", "%s", why);
}

/* ZB-H1 (Qi et al., ICLR 2024), one stage per rank, equal costs on every
   stage: when m >= p its makespan is m(F+B+W) + (p-1)(F+B-W), 3m + p - 1 at
   F = B = W = 1, against 1F1B's (m+p-1)(F+B+W) for the same work (1F1B's
   backward is B + W). At unit costs the idle time p * makespan - busy is
   then exactly a third of 1F1B's (p(p-1) against 3p(p-1)), so the bubble
   fraction is (p-1)/(3m+p-1) against 1F1B's (p-1)/(m+p-1). For every m
   (m < p too) zero_bubble is never slower than 1F1B. */
static void test_zb_h1_bubble(void) {
    /* W <= min(F, B): the formula's regime (with W > F the schedule made for
       F = B = W waits on W ops and the formula does not hold) */
    static const double costs[][3] = {{1, 1, 1}, {2.5, 2.5, 2.5}, {1, 1.5, 0.75}, {2, 1, 1}, {1, 2, 1}};
    int ok_formula = 1, ok_third = 1, ok_faster = 1, tried = 0;
    char w_formula[512] = "", w_third[512] = "", w_faster[512] = "";
#define NOTE(flag, buf, ...) note(&flag, buf, __VA_ARGS__)
    for (int p = 1; p <= 8; p++)
        for (int m = 1; m <= 32; m++) {
            smp_schedule zb, one;
            if (smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE, p, p, NULL, m, false, &zb) != SMP_OK ||
                smp_schedule_build(SMP_PIPELINE_INTERLEAVED, p, p, NULL, m, false, &one) != SMP_OK) {
                NOTE(ok_formula, w_formula, "build p=%d m=%d: %s", p, m, smp_last_error());
                smp_schedule_free(&zb);
                continue;
            }
            for (int c = 0; c < (int)(sizeof costs / sizeof costs[0]); c++) {
                double f[8], b[8], w[8], F = costs[c][0], Bc = costs[c][1], W = costs[c][2];
                for (int s = 0; s < p; s++) { f[s] = F; b[s] = Bc; w[s] = W; }
                smp_sim_result rz, r1;
                if (smp_schedule_simulate(&zb, f, b, w, 0.0, &rz) != SMP_OK) {
                    NOTE(ok_formula, w_formula, "simulate p=%d m=%d: %s", p, m, smp_last_error());
                    continue;
                }
                if (smp_schedule_simulate(&one, f, b, w, 0.0, &r1) != SMP_OK) {
                    NOTE(ok_formula, w_formula, "simulate 1F1B p=%d m=%d: %s", p, m, smp_last_error());
                    smp_sim_result_free(&rz);
                    continue;
                }
                tried++;
                double want = m * (F + Bc + W) + (p - 1) * (F + Bc - W);
                if (rz.deadlock || (m >= p && fabs(rz.makespan - want) > 1e-9))
                    NOTE(ok_formula, w_formula,
                         "p=%d m=%d F=%g B=%g W=%g: makespan %.12g, want m(F+B+W) + (p-1)(F+B-W) = %.12g%s", p, m, F,
                         Bc, W, rz.makespan, want, rz.deadlock ? " (deadlock)" : "");
                if (rz.makespan > r1.makespan + 1e-9 || fabs(rz.busy - r1.busy) > 1e-9)
                    NOTE(ok_faster, w_faster, "p=%d m=%d F=%g B=%g W=%g: zero_bubble %g (busy %g), 1F1B %g (busy %g)",
                         p, m, F, Bc, W, rz.makespan, rz.busy, r1.makespan, r1.busy);
                if (c == 0 && m >= p) {
                    double idle_z = p * rz.makespan - rz.busy, idle_1 = p * r1.makespan - r1.busy;
                    double bz = (double)(p - 1) / (3.0 * m + p - 1), b1 = (double)(p - 1) / (double)(m + p - 1);
                    if (fabs(3 * idle_z - idle_1) > 1e-9 || fabs(idle_z - p * (p - 1.0)) > 1e-9)
                        NOTE(ok_third, w_third,
                             "p=%d m=%d: idle time %g, 1F1B's %g (want p(p-1) = %d and a third of 1F1B's)", p, m,
                             idle_z, idle_1, p * (p - 1));
                    else if (fabs(rz.bubble_fraction - bz) > 1e-12 || fabs(r1.bubble_fraction - b1) > 1e-12)
                        NOTE(ok_third, w_third, "p=%d m=%d: bubble %.15f (want %.15f), 1F1B's %.15f (want %.15f)", p, m,
                             rz.bubble_fraction, bz, r1.bubble_fraction, b1);
                }
                smp_sim_result_free(&rz);
                smp_sim_result_free(&r1);
            }
            smp_schedule_free(&zb);
            smp_schedule_free(&one);
        }
    CHECK(
        ok_formula,
        "zero_bubble (ZB-H1) makespan is m(F+B+W) + (p-1)(F+B-W) for equal stage costs, m >= p (3m+p-1 at unit costs)",
        "%s", w_formula);
    CHECK(ok_third, "zero_bubble idle time is exactly a third of 1F1B's at F=B=W=1, m >= p: bubble (p-1)/(3m+p-1) "
          "against (p-1)/(m+p-1)", "%s", w_third);
    CHECK(ok_faster && tried == 8 * 32 * 5,
          "zero_bubble is never slower than 1F1B for the same work (p <= 8, m <= 32, m < p too)", "%s (%d simulations)",
          w_faster, tried);
#undef NOTE
}

/* For every nranks 1..8, virtual stages per rank 1..4 (round robin),
   microbatches 1..16, every kind (simple, interleaved, zero_bubble),
   training and evaluation. */
static void test_exhaustive(void) {
    int ok_build = 1, ok_valid = 1, ok_sim = 1, ok_rand = 1, ok_1f1b = 1, ok_peak = 1, ok_rank_peak = 1,
        ok_megatron = 1, ok_pure = 1, ok_reject = 1, ok_fo = 1, ok_zb_peak = 1, ok_zb_fo = 1, ok_worder = 1;
    char w_build[512] = "", w_valid[512] = "", w_sim[512] = "", w_rand[512] = "", w_1f1b[512] = "",
         w_peak[512] = "", w_rank_peak[512] = "", w_megatron[512] = "", w_pure[512] = "", w_reject[512] = "",
         w_fo[512] = "", w_zb_peak[512] = "", w_zb_fo[512] = "", w_worder[512] = "";
    static const smp_pipeline_kind kinds[3] = {SMP_PIPELINE_INTERLEAVED, SMP_PIPELINE_SIMPLE, SMP_PIPELINE_ZERO_BUBBLE};
#define NOTE(flag, buf, ...) note(&flag, buf, __VA_ARGS__)
    int cases = 0;
    for (int R = 1; R <= 8; R++)
        for (int v = 1; v <= 4; v++)
            for (int m = 1; m <= 16; m++)
                for (int kk = 0; kk < 3; kk++)
                    for (int fo = 0; fo < 2; fo++) {
                        smp_pipeline_kind kind = kinds[kk];
                        bool zb = kind == SMP_PIPELINE_ZERO_BUBBLE && !fo;
                        int S = R * v, map[32];
                        for (int s = 0; s < S; s++) map[s] = s % R;
                        smp_schedule sc, again;
                        smp_status st = smp_schedule_build(kind, R, S, NULL, m, fo, &sc);
                        if (R == 1 && v > 1) { /* one rank cannot hold consecutive stages */
                            if (st != SMP_ERR_ARG || !strstr(smp_last_error(), "consecutive"))
                                NOTE(ok_reject, w_reject, "R=1 v=%d: status %d (%s)", v, (int)st, smp_last_error());
                            continue;
                        }
                        cases++;
                        if (st == SMP_OK && sc.kind != kind) {
                            NOTE(ok_build, w_build, "%s R=%d v=%d m=%d: built kind %d", kind_name(kind), R, v, m,
                                 (int)sc.kind);
                            smp_schedule_free(&sc);
                            continue;
                        }
                        if (st != SMP_OK) {
                            NOTE(ok_build, w_build, "%s R=%d v=%d m=%d fo=%d: %s", kind_name(kind), R, v, m, fo,
                                 smp_last_error());
                            continue;
                        }
                        const char *ctx_fmt = "%s R=%d v=%d m=%d fo=%d: %s";
                        if (!check_valid(&sc, map))
                            NOTE(ok_valid, w_valid, ctx_fmt, kind_name(kind), R, v, m, fo, why);
                        if (smp_schedule_build(kind, R, S, map, m, fo, &again) != SMP_OK || !same_schedule(&sc, &again))
                            NOTE(ok_pure, w_pure, "%s R=%d v=%d m=%d fo=%d: a second build (explicit map) differs",
                                 kind_name(kind), R, v, m, fo);
                        smp_schedule_free(&again);
                        if (kind == SMP_PIPELINE_INTERLEAVED && v == 1 && !fo && !check_1f1b(&sc))
                            NOTE(ok_1f1b, w_1f1b, "%s", why);
                        if (zb && !check_w_order(&sc)) NOTE(ok_worder, w_worder, "R=%d v=%d m=%d: %s", R, v, m, why);

                        smp_sim_result r;
                        if (smp_schedule_simulate(&sc, NULL, NULL, NULL, 0.0, &r) != SMP_OK) {
                            NOTE(ok_sim, w_sim, ctx_fmt, kind_name(kind), R, v, m, fo, smp_last_error());
                        } else {
                            if (r.deadlock)
                                NOTE(ok_sim, w_sim, ctx_fmt, kind_name(kind), R, v, m, fo, r.deadlock_reason);
                            if (!(r.bubble_fraction >= -1e-12 && r.bubble_fraction < 1) || r.makespan + 1e-9 < r.ideal)
                                NOTE(ok_sim, w_sim, "%s R=%d v=%d m=%d: bubble %g makespan %g ideal %g",
                                     kind_name(kind), R, v, m, r.bubble_fraction, r.makespan, r.ideal);
                            for (int s = 0; s < S && zb; s++) {
                                /* zero bubble: a microbatch stays in flight until its W; at most
                                   min(m, S) per stage (1F1B's bound for stage 0), whatever the map */
                                int bound = m < S ? m : S;
                                if (r.peak_inflight[s] > bound || r.peak_inflight[s] < 1)
                                    NOTE(ok_zb_peak, w_zb_peak,
                                         "R=%d v=%d m=%d: stage %d peak in-flight %d, want 1..%d", R, v, m, s,
                                         r.peak_inflight[s], bound);
                            }
                            if (zb && v == 1) {
                                /* ZB-H1 keeps 1F1B's memory: the most any rank holds is 1F1B's */
                                smp_schedule one;
                                smp_sim_result r1;
                                if (smp_schedule_build(SMP_PIPELINE_INTERLEAVED, R, S, NULL, m, false, &one) !=
                                        SMP_OK ||
                                    smp_schedule_simulate(&one, NULL, NULL, NULL, 0.0, &r1) != SMP_OK) {
                                    NOTE(ok_zb_peak, w_zb_peak, "1F1B R=%d m=%d: %s", R, m, smp_last_error());
                                } else {
                                    int pz = 0, p1 = 0;
                                    for (int q = 0; q < R; q++) {
                                        if (r.rank_peak_inflight[q] > pz) pz = r.rank_peak_inflight[q];
                                        if (r1.rank_peak_inflight[q] > p1) p1 = r1.rank_peak_inflight[q];
                                    }
                                    if (pz > p1)
                                        NOTE(ok_zb_peak, w_zb_peak,
                                             "R=%d m=%d: zero_bubble's busiest rank holds %d microbatches, 1F1B's %d",
                                             R, m, pz, p1);
                                    smp_sim_result_free(&r1);
                                }
                                smp_schedule_free(&one);
                            }
                            for (int s = 0; s < S && !zb; s++) {
                                int want = fo ? 0 : kind == SMP_PIPELINE_SIMPLE ? m : (m < S - s ? m : S - s);
                                int got = r.peak_inflight[s];
                                /* simple and 1F1B: exactly; interleaved 1F1B: at most the bound */
                                if (kind == SMP_PIPELINE_SIMPLE || v == 1 || fo ? got != want : got > want)
                                    NOTE(ok_peak, w_peak,
                                         "%s R=%d v=%d m=%d fo=%d: stage %d peak in-flight %d, want %s%d",
                                         kind_name(kind), R, v, m, fo, s, got,
                                         kind == SMP_PIPELINE_SIMPLE || v == 1 || fo ? "" : "<= ", want);
                            }
                            if (kind == SMP_PIPELINE_INTERLEAVED && v > 1 && !fo)
                                for (int q = 0; q < R; q++) {
                                    /* Megatron-LM's interleaved warm-up bound, plus the one in steady state */
                                    int bound = (v - 1) * (m < R ? m : R) + 2 * (R - 1 - q) + 1;
                                    if (bound > v * m) bound = v * m;
                                    if (r.rank_peak_inflight[q] > bound)
                                        NOTE(ok_rank_peak, w_rank_peak, "R=%d v=%d m=%d: rank %d holds %d, bound %d",
                                             R, v, m, q, r.rank_peak_inflight[q], bound);
                                }
                            smp_sim_result_free(&r);
                        }
                        if (fo) {
                            for (int q = 0; q < R; q++)
                                if (sc.nops[q] != v * m)
                                    NOTE(ok_fo, w_fo, "%s R=%d v=%d m=%d: rank %d has %d ops, want %d forwards",
                                         kind_name(kind), R, v, m, q, sc.nops[q], v * m);
                            /* an evaluation step has nothing to split: zero_bubble runs interleaved's forwards */
                            smp_schedule il;
                            if (kind == SMP_PIPELINE_ZERO_BUBBLE &&
                                (smp_schedule_build(SMP_PIPELINE_INTERLEAVED, R, S, NULL, m, true, &il) != SMP_OK ||
                                 !same_schedule(&sc, &il)))
                                NOTE(ok_zb_fo, w_zb_fo,
                                     "R=%d v=%d m=%d: forward-only zero_bubble differs from forward-only interleaved",
                                     R, v, m);
                            if (kind == SMP_PIPELINE_ZERO_BUBBLE) smp_schedule_free(&il);
                        }

                        /* interleaved 1F1B reaches Megatron-LM's bubble (p-1)/(v*m+p-1)
                           when m is a multiple of p and a backward costs two forwards */
                        if (kind == SMP_PIPELINE_INTERLEAVED && !fo && m % R == 0) {
                            double f[32], b[32];
                            for (int s = 0; s < S; s++) { f[s] = 1; b[s] = 2; }
                            if (smp_schedule_simulate(&sc, f, b, NULL, 0.0, &r) == SMP_OK) {
                                double want = (double)(R - 1) / (double)(v * m + R - 1);
                                if (fabs(r.bubble_fraction - want) > 1e-12)
                                    NOTE(ok_megatron, w_megatron, "R=%d v=%d m=%d: bubble %.6f, want %.6f", R, v, m,
                                         r.bubble_fraction, want);
                                smp_sim_result_free(&r);
                            } else {
                                NOTE(ok_megatron, w_megatron, "simulate: %s", smp_last_error());
                            }
                        }

                        /* random costs (W too: outside zero bubble a backward costs B + W) and
                           latency on a subset; every zero-bubble case, twice */
                        for (int draw = 0; draw < (zb ? 2 : (R + v + m) % 3 == 0); draw++) {
                            double f[32], b[32], w[32], lat = rnd_uniform(0, 0.5);
                            for (int s = 0; s < S; s++) {
                                f[s] = rnd_uniform(0.2, 3);
                                b[s] = rnd_uniform(0.2, 5);
                                w[s] = rnd_uniform(0, 3);
                            }
                            if (smp_schedule_simulate(&sc, f, b, w, lat, &r) != SMP_OK) {
                                NOTE(ok_rand, w_rand, "simulate: %s", smp_last_error());
                            } else {
                                double maxload = 0;
                                for (int q = 0; q < R; q++) {
                                    double load = 0;
                                    for (int k = 0; k < sc.nops[q]; k++) {
                                        smp_sched_op op = sc.ops[q][k];
                                        load += op.kind == SMP_SCHED_FORWARD  ? f[op.stage]
                                                : op.kind == SMP_SCHED_WEIGHT ? w[op.stage]
                                                : zb                          ? b[op.stage]
                                                                              : b[op.stage] + w[op.stage];
                                    }
                                    if (load > maxload) maxload = load;
                                }
                                if (r.deadlock)
                                    NOTE(ok_rand, w_rand, ctx_fmt, kind_name(kind), R, v, m, fo, r.deadlock_reason);
                                else if (r.makespan + 1e-9 < maxload)
                                    NOTE(ok_rand, w_rand, "%s R=%d v=%d m=%d: makespan %g below a rank's load %g",
                                         kind_name(kind), R, v, m, r.makespan, maxload);
                                smp_sim_result_free(&r);
                            }
                        }
                        smp_schedule_free(&sc);
                    }
    CHECK(ok_reject, "exhaustive: 1 rank with several stages is rejected", "%s", w_reject);
    CHECK(ok_build && cases == (7 * 4 * 16 + 16) * 3 * 2, "exhaustive: every schedule builds, of the kind asked for",
          "%s (%d cases)", w_build, cases);
    CHECK(ok_valid, "exhaustive: every op once, on its rank, microbatches in order per stage", "%s", w_valid);
    CHECK(ok_pure, "exhaustive: building is a pure function of the inputs", "%s", w_pure);
    CHECK(ok_1f1b, "exhaustive: interleaved with one stage per rank is exactly 1F1B", "%s", w_1f1b);
    CHECK(ok_sim, "exhaustive: simulator finds no deadlock (unit costs)", "%s", w_sim);
    CHECK(ok_rand, "exhaustive: no deadlock with random costs and latency", "%s", w_rand);
    CHECK(ok_peak, "exhaustive: peak in-flight simple = m, 1F1B = min(m, S-s), interleaved <= min(m, S-s)", "%s",
          w_peak);
    CHECK(ok_rank_peak, "exhaustive: interleaved 1F1B keeps Megatron-LM's in-flight bound per rank", "%s",
          w_rank_peak);
    CHECK(ok_megatron, "exhaustive: interleaved 1F1B bubble is (p-1)/(v*m+p-1) (m a multiple of p, b = 2f)", "%s",
          w_megatron);
    CHECK(ok_fo, "exhaustive: evaluation schedules hold only forwards", "%s", w_fo);
    CHECK(ok_zb_peak, "exhaustive: zero_bubble holds at most min(m, S) per stage until W; one stage per rank: "
          "its busiest rank holds no more than 1F1B's", "%s", w_zb_peak);
    CHECK(ok_zb_fo, "exhaustive: forward-only zero_bubble equals forward-only interleaved", "%s", w_zb_fo);
    CHECK(ok_worder,
          "exhaustive: zero_bubble runs a rank's later stage's W first for each microbatch (what an earlier stage "
          "made stays until then)",
          "%s", w_worder);
#undef NOTE
}

/* ZB-V's V: stage s of 2p on rank s, or 2p-1-s past the middle. */
static int vee(int s, int p) { return s < p ? s : 2 * p - 1 - s; }

/* ZB-V (zero_bubble_v), p ranks, 2p stages in a V, equal costs per chunk.
   At F = B = W = 1 the step takes max(6m + p - 1, 4(m + p) - 2), so for
   m >= 2p - 1 the idle time p * makespan - busy is p(p-1): half of ZB-H1's
   and a sixth of 1F1B's for the same work (their stages being two chunks,
   F = B = W = 2), and the bubble (p-1)/(6m+p-1). For every m it is never
   slower than either. Memory: a rank holds at most 2 min(m, p)
   microbatch-chunks from F to W, half a stage each: 1F1B's busiest rank
   (min(m, p) stages). */
static void test_zbv_bubble(void) {
    int ok_formula = 1, ok_idle = 1, ok_faster = 1, ok_peak = 1, ok_scale = 1, tried = 0;
    char w_formula[512] = "", w_idle[512] = "", w_faster[512] = "", w_peak[512] = "", w_scale[512] = "";
#define NOTE(flag, buf, ...) note(&flag, buf, __VA_ARGS__)
    for (int p = 1; p <= 8; p++)
        for (int m = 1; m <= 32; m++) {
            smp_schedule v, h1, one;
            if (smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE_V, p, 2 * p, NULL, m, false, &v) != SMP_OK) {
                NOTE(ok_formula, w_formula, "build p=%d m=%d: %s", p, m, smp_last_error());
                continue;
            }
            if (smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE, p, p, NULL, m, false, &h1) != SMP_OK ||
                smp_schedule_build(SMP_PIPELINE_INTERLEAVED, p, p, NULL, m, false, &one) != SMP_OK) {
                NOTE(ok_formula, w_formula, "build ZB-H1/1F1B p=%d m=%d: %s", p, m, smp_last_error());
                smp_schedule_free(&v);
                continue;
            }
            double two[8], f5[16];
            for (int s = 0; s < 8; s++) two[s] = 2;
            for (int s = 0; s < 16; s++) f5[s] = 2.5;
            smp_sim_result rv, rh, r1, r5;
            if (smp_schedule_simulate(&v, NULL, NULL, NULL, 0.0, &rv) != SMP_OK ||
                smp_schedule_simulate(&h1, two, two, two, 0.0, &rh) != SMP_OK ||
                smp_schedule_simulate(&one, two, two, two, 0.0, &r1) != SMP_OK ||
                smp_schedule_simulate(&v, f5, f5, f5, 0.0, &r5) != SMP_OK) {
                NOTE(ok_formula, w_formula, "simulate p=%d m=%d: %s", p, m, smp_last_error());
            } else {
                tried++;
                double a = 6.0 * m + p - 1, b = 4.0 * (m + p) - 2, want = a > b ? a : b;
                if (rv.deadlock || fabs(rv.makespan - want) > 1e-9 || fabs(rv.busy - 6.0 * m * p) > 1e-9)
                    NOTE(ok_formula, w_formula, "p=%d m=%d: makespan %g (busy %g), want max(6m+p-1, 4(m+p)-2) = %g%s",
                         p, m, rv.makespan, rv.busy, want, rv.deadlock ? " (deadlock)" : "");
                if (fabs(r5.makespan - 2.5 * rv.makespan) > 1e-9)
                    NOTE(ok_scale, w_scale, "p=%d m=%d: F=B=W=2.5 makespan %g, want 2.5 x %g", p, m, r5.makespan,
                         rv.makespan);
                if (m >= 2 * p - 1) {
                    double iv = p * rv.makespan - rv.busy, ih = p * rh.makespan - rh.busy,
                           i1 = p * r1.makespan - r1.busy;
                    if (fabs(iv - p * (p - 1.0)) > 1e-9 || fabs(2 * iv - ih) > 1e-9 || fabs(6 * iv - i1) > 1e-9 ||
                        fabs(rv.bubble_fraction - (p - 1.0) / (6.0 * m + p - 1)) > 1e-12)
                        NOTE(ok_idle, w_idle,
                             "p=%d m=%d: idle %g (want p(p-1) = %d), ZB-H1's %g (want twice), 1F1B's %g (want 6x), "
                             "bubble %.15f",
                             p, m, iv, p * (p - 1), ih, i1, rv.bubble_fraction);
                }
                if (rv.makespan > rh.makespan + 1e-9 || rv.makespan > r1.makespan + 1e-9 ||
                    fabs(rv.busy - rh.busy) > 1e-9)
                    NOTE(ok_faster, w_faster, "p=%d m=%d: zero_bubble_v %g (busy %g), ZB-H1 %g (busy %g), 1F1B %g", p,
                         m, rv.makespan, rv.busy, rh.makespan, rh.busy, r1.makespan);
                int pv = 0, p1 = 0;
                for (int q = 0; q < p; q++) {
                    if (rv.rank_peak_inflight[q] > pv) pv = rv.rank_peak_inflight[q];
                    if (r1.rank_peak_inflight[q] > p1) p1 = r1.rank_peak_inflight[q];
                }
                if (pv != 2 * (m < p ? m : p) || pv > 2 * p1)
                    NOTE(ok_peak, w_peak,
                         "p=%d m=%d: zero_bubble_v's busiest rank holds %d chunks (want 2 min(m, p) = %d), 1F1B's %d "
                         "stages",
                         p, m, pv, 2 * (m < p ? m : p), p1);
                smp_sim_result_free(&rv);
                smp_sim_result_free(&rh);
                smp_sim_result_free(&r1);
                smp_sim_result_free(&r5);
            }
            smp_schedule_free(&v);
            smp_schedule_free(&h1);
            smp_schedule_free(&one);
        }
    CHECK(ok_formula && tried == 8 * 32,
          "zero_bubble_v makespan is max(6m+p-1, 4(m+p)-2) at F=B=W=1 per chunk (p <= 8, m <= 32)",
          "%s (%d simulations)", w_formula, tried);
    CHECK(ok_scale, "zero_bubble_v at F=B=W=2.5: the unit-cost step scaled", "%s", w_scale);
    CHECK(ok_idle,
          "zero_bubble_v idle time p(p-1) for m >= 2p-1: half ZB-H1's, a sixth of 1F1B's, bubble (p-1)/(6m+p-1)", "%s",
          w_idle);
    CHECK(ok_faster,
          "zero_bubble_v is never slower than ZB-H1 or 1F1B on the same work (their stage = two chunks), m < p too",
          "%s", w_faster);
    CHECK(ok_peak,
          "zero_bubble_v's busiest rank holds 2 min(m, p) chunks until W: 1F1B's peak (min(m, p) stages of twice the "
          "size)",
          "%s", w_peak);
#undef NOTE
}

/* zero_bubble_v for every p = 1..8 (2 to 16 stages), m = 1..16, training and
   evaluation: valid, pure, no deadlock at unit costs and at random costs
   with latency, W of chunk 1 before W of chunk 0 for each microbatch. */
static void test_zbv_exhaustive(void) {
    int ok_build = 1, ok_valid = 1, ok_pure = 1, ok_sim = 1, ok_rand = 1, ok_order = 1, ok_fo = 1, ok_peak = 1,
        cases = 0;
    char w_build[512] = "", w_valid[512] = "", w_pure[512] = "", w_sim[512] = "", w_rand[512] = "", w_order[512] = "",
         w_fo[512] = "", w_peak[512] = "";
#define NOTE(flag, buf, ...) note(&flag, buf, __VA_ARGS__)
    for (int p = 1; p <= 8; p++)
        for (int m = 1; m <= 16; m++)
            for (int fo = 0; fo < 2; fo++) {
                int S = 2 * p, map[16];
                for (int s = 0; s < S; s++) map[s] = vee(s, p);
                smp_schedule sc, again;
                if (smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE_V, p, S, NULL, m, fo, &sc) != SMP_OK ||
                    sc.kind != SMP_PIPELINE_ZERO_BUBBLE_V) {
                    NOTE(ok_build, w_build, "p=%d m=%d fo=%d: %s", p, m, fo, smp_last_error());
                    continue;
                }
                cases++;
                if (!check_valid(&sc, map)) NOTE(ok_valid, w_valid, "p=%d m=%d fo=%d: %s", p, m, fo, why);
                if (smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE_V, p, S, map, m, fo, &again) != SMP_OK ||
                    !same_schedule(&sc, &again))
                    NOTE(ok_pure, w_pure, "p=%d m=%d fo=%d: a second build (explicit map) differs", p, m, fo);
                smp_schedule_free(&again);
                for (int r = 0; r < p; r++)
                    if (sc.nops[r] != (fo ? 2 : 6) * m)
                        NOTE(ok_fo, w_fo, "p=%d m=%d fo=%d: rank %d has %d ops", p, m, fo, r, sc.nops[r]);
                /* W1(i) before W0(i): chunk 1 may read chunk 0's outputs until its W */
                if (!check_w_order(&sc)) NOTE(ok_order, w_order, "p=%d m=%d: %s", p, m, why);
                smp_sim_result r;
                if (smp_schedule_simulate(&sc, NULL, NULL, NULL, 0.0, &r) != SMP_OK) {
                    NOTE(ok_sim, w_sim, "p=%d m=%d fo=%d: %s", p, m, fo, smp_last_error());
                } else {
                    if (r.deadlock) NOTE(ok_sim, w_sim, "p=%d m=%d fo=%d: %s", p, m, fo, r.deadlock_reason);
                    for (int q = 0; q < p && !fo; q++)
                        if (r.rank_peak_inflight[q] > 2 * (m < p ? m : p) || r.peak_inflight[q] > (m < S ? m : S))
                            NOTE(ok_peak, w_peak, "p=%d m=%d: rank %d holds %d (bound 2 min(m, p)), stage %d %d", p, m,
                                 q, r.rank_peak_inflight[q], q, r.peak_inflight[q]);
                    smp_sim_result_free(&r);
                }
                for (int draw = 0; draw < 3; draw++) {
                    double f[16], b[16], w[16], lat = draw ? rnd_uniform(0, 0.5) : 0;
                    for (int s = 0; s < S; s++) {
                        f[s] = rnd_uniform(0.2, 3);
                        b[s] = rnd_uniform(0.2, 5);
                        w[s] = rnd_uniform(0, 3);
                    }
                    if (smp_schedule_simulate(&sc, f, b, w, lat, &r) != SMP_OK) {
                        NOTE(ok_rand, w_rand, "simulate: %s", smp_last_error());
                        continue;
                    }
                    double maxload = 0;
                    for (int q = 0; q < p; q++) {
                        double load = 0;
                        for (int k = 0; k < sc.nops[q]; k++) {
                            smp_sched_op op = sc.ops[q][k];
                            load += op.kind == SMP_SCHED_FORWARD  ? f[op.stage]
                                    : op.kind == SMP_SCHED_WEIGHT ? w[op.stage]
                                                                  : b[op.stage];
                        }
                        if (load > maxload) maxload = load;
                    }
                    if (r.deadlock) NOTE(ok_rand, w_rand, "p=%d m=%d fo=%d: %s", p, m, fo, r.deadlock_reason);
                    else if (r.makespan + 1e-9 < maxload)
                        NOTE(ok_rand, w_rand, "p=%d m=%d: makespan %g below a rank's load %g", p, m, r.makespan,
                             maxload);
                    smp_sim_result_free(&r);
                }
                smp_schedule_free(&sc);
            }
    CHECK(ok_build && cases == 8 * 16 * 2,
          "zero_bubble_v exhaustive (p <= 8, 2p stages, m <= 16, evaluation too): every schedule builds",
          "%s (%d cases)", w_build, cases);
    CHECK(ok_valid,
          "zero_bubble_v exhaustive: every op once, on its rank of the V, in microbatch order per stage, W after B",
          "%s", w_valid);
    CHECK(ok_pure, "zero_bubble_v exhaustive: building is a pure function (NULL map = the V)", "%s", w_pure);
    CHECK(ok_fo, "zero_bubble_v exhaustive: 6m ops per rank (training), 2m forwards (evaluation)", "%s", w_fo);
    CHECK(ok_sim, "zero_bubble_v exhaustive: no deadlock at unit costs", "%s", w_sim);
    CHECK(ok_rand, "zero_bubble_v exhaustive: no deadlock at random F/B/W costs, with and without latency", "%s",
          w_rand);
    CHECK(ok_peak, "zero_bubble_v exhaustive: a rank holds at most 2 min(m, p) chunks until W", "%s", w_peak);
    CHECK(ok_order, "zero_bubble_v exhaustive: on each rank W of chunk 1 runs before W of chunk 0 for a microbatch",
          "%s", w_order);
#undef NOTE
}

static void test_zbv_order(void) {
    /* ZB-V, 2 ranks (stages 0 and 3 on rank 0, 1 and 2 on rank 1) x 4
       microbatches, and 3 ranks x 2 microbatches (m < p: the 5-microbatch
       order with microbatches 2..4 left out): torch.distributed.pipelining's
       ScheduleZBVZeroBubble, op for op */
    static const char *want2[2] = {"F0.0 F0.1 F0.2 F3.0 B3.0 W3.0 F3.1 B3.1 W3.1 F0.3 B0.0 W0.0 F3.2 B3.2 W3.2 B0.1 "
                                   "W0.1 F3.3 B3.3 W3.3 B0.2 W0.2 B0.3 W0.3 ",
                                   "F1.0 F2.0 F1.1 F2.1 B2.0 W2.0 F1.2 B1.0 W1.0 F2.2 B2.1 W2.1 F1.3 B1.1 W1.1 F2.3 "
                                   "B2.2 W2.2 B1.2 B2.3 B1.3 W1.2 W2.3 W1.3 "};
    static const char *want3[3] = {"F0.0 F0.1 F5.0 B5.0 W5.0 F5.1 B5.1 W5.1 B0.0 W0.0 B0.1 W0.1 ",
                                   "F1.0 F1.1 F4.0 F4.1 B4.0 W4.0 B4.1 W4.1 B1.0 W1.0 B1.1 W1.1 ",
                                   "F2.0 F3.0 F2.1 F3.1 B3.0 W3.0 B2.0 W2.0 B3.1 W3.1 B2.1 W2.1 "};
    for (int c = 0; c < 2; c++) {
        int p = c ? 3 : 2, m = c ? 2 : 4;
        const char *const *want = c ? want3 : want2;
        smp_schedule sc;
        int ok = smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE_V, p, 2 * p, NULL, m, false, &sc) == SMP_OK, bad = -1;
        char got[3][256] = {"", "", ""};
        for (int r = 0; ok && r < p; r++) {
            size_t len = 0;
            for (int k = 0; k < sc.nops[r] && len < sizeof got[r]; k++)
                len += (size_t)snprintf(got[r] + len, sizeof got[r] - len, "%c%d.%d ", op_letter(sc.ops[r][k].kind),
                                        sc.ops[r][k].stage, sc.ops[r][k].microbatch);
            if (strcmp(got[r], want[r])) { ok = 0; bad = r; }
        }
        CHECK(ok, c ? "zero_bubble_v with 3 ranks, 2 microbatches (m < p): ZB-V's order, later microbatches left out"
                    : "zero_bubble_v with 2 ranks, 4 microbatches: ZB-V's order (torch's ScheduleZBVZeroBubble)",
              "rank %d: %s| want %s", bad, bad >= 0 ? got[bad] : smp_last_error(), bad >= 0 ? want[bad] : "");
        smp_schedule_free(&sc);
    }
    /* the middle hand-off is local: no latency. p = 2, m = 1, latency L:
       F0 [0,1] F1 [1+L,2+L] F2 [2+L,3+L] F3 B3 W3 [3+2L,6+2L] B2 W2 B1 W1
       [6+3L,10+3L]... B0 W0 [8+4L,10+4L] (B1 ends at 8+3L) */
    smp_schedule sc;
    smp_sim_result r;
    int ok = smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE_V, 2, 4, NULL, 1, false, &sc) == SMP_OK &&
             smp_schedule_simulate(&sc, NULL, NULL, NULL, 0.5, &r) == SMP_OK;
    CHECK(ok && fabs(r.makespan - 12) < 1e-12 && !r.deadlock,
          "zero_bubble_v: the middle hand-off (stage 1 to 2, one rank) costs no latency",
          "makespan %g, want 10 + 4 x 0.5 = 12 (four hops between ranks)", ok ? r.makespan : -1);
    if (ok) smp_sim_result_free(&r);
    smp_schedule_free(&sc);
    ok = smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE_V, 1, 2, NULL, 3, false, &sc) == SMP_OK &&
         smp_schedule_simulate(&sc, NULL, NULL, NULL, 7, &r) == SMP_OK;
    CHECK(ok && fabs(r.makespan - 18) < 1e-12 && r.bubble_fraction == 0 && r.rank_peak_inflight[0] == 2,
          "zero_bubble_v with one rank: both stages local, no bubble, 2 chunks in flight",
          "makespan %g bubble %g peak %d", ok ? r.makespan : -1, ok ? r.bubble_fraction : -1,
          ok ? r.rank_peak_inflight[0] : -1);
    if (ok) smp_sim_result_free(&r);
    smp_schedule_free(&sc);
}

/* The most distinct microbatches rank r holds at once, counted apart from
   the simulator: microbatch i is held from the position of its first
   forward on r up to its last op there (W in zero-bubble kinds, else B). */
static int held_peak(const smp_schedule *sc, int r) {
    int m = sc->microbatches, n = sc->nops[r], peak = 0;
    int *first = (int *)malloc(sizeof(int) * (size_t)m), *last = (int *)malloc(sizeof(int) * (size_t)m);
    for (int i = 0; i < m; i++) first[i] = last[i] = -1;
    for (int k = 0; k < n; k++) {
        smp_sched_op op = sc->ops[r][k];
        if (op.kind == SMP_SCHED_FORWARD && first[op.microbatch] < 0) first[op.microbatch] = k;
        if (op.kind != SMP_SCHED_FORWARD) last[op.microbatch] = k;
    }
    for (int k = 0; k < n; k++) {
        int at = 0;
        for (int i = 0; i < m; i++) at += first[i] >= 0 && first[i] <= k && last[i] > k;
        if (at > peak) peak = at;
    }
    free(first);
    free(last);
    return peak;
}

/* active_microbatches = c for every kind, stage count and microbatch count
   in range, c from 1 to m + 1: the schedule stays valid (each op once, in
   microbatch order per stage, W order), never deadlocks (unit and random
   costs, latency), no rank ever holds more than c microbatches (the
   simulator and an independent count agree), c at or above what the
   uncapped schedule holds changes nothing, and simple is GPipe in groups
   of c. */
static void test_active_microbatches(void) {
    int ok_build = 1, ok_valid = 1, ok_sim = 1, ok_cap = 1, ok_count = 1, ok_same = 1, ok_gpipe = 1, cases = 0;
    char w_build[512] = "", w_valid[512] = "", w_sim[512] = "", w_cap[512] = "", w_count[512] = "", w_same[512] = "",
         w_gpipe[512] = "";
    static const smp_pipeline_kind kinds[4] = {SMP_PIPELINE_SIMPLE, SMP_PIPELINE_INTERLEAVED, SMP_PIPELINE_ZERO_BUBBLE,
                                               SMP_PIPELINE_ZERO_BUBBLE_V};
#define NOTE(flag, buf, ...) note(&flag, buf, __VA_ARGS__)
    for (int kk = 0; kk < 4; kk++)
        for (int R = 1; R <= 6; R++)
            for (int v = 1; v <= 3; v++)
                for (int m = 1; m <= 10; m++) {
                    smp_pipeline_kind kind = kinds[kk];
                    bool vk = kind == SMP_PIPELINE_ZERO_BUBBLE_V;
                    if ((R == 1 && v > 1 && !vk) || (vk && v != 2)) continue;
                    int S = R * v, map[32];
                    for (int s = 0; s < S; s++) map[s] = vk ? vee(s, R) : s % R;
                    smp_schedule free_sc;
                    smp_sim_result fr;
                    if (smp_schedule_build(kind, R, S, NULL, m, false, &free_sc) != SMP_OK ||
                        smp_schedule_simulate(&free_sc, NULL, NULL, NULL, 0.0, &fr) != SMP_OK) {
                        NOTE(ok_build, w_build, "%s R=%d v=%d m=%d uncapped: %s", kind_name(kind), R, v, m,
                             smp_last_error());
                        smp_schedule_free(&free_sc);
                        continue;
                    }
                    int natural = 0;
                    for (int r = 0; r < R; r++)
                        natural = fr.rank_peak_microbatches[r] > natural ? fr.rank_peak_microbatches[r] : natural;
                    smp_sim_result_free(&fr);
                    for (int c = 0; c <= m + 1; c++) {
                        smp_schedule sc;
                        const char *ctx = kind_name(kind);
                        if (smp_schedule_build_capped(kind, R, S, NULL, m, c, false, &sc) != SMP_OK) {
                            NOTE(ok_build, w_build, "%s R=%d v=%d m=%d c=%d: %s", ctx, R, v, m, c, smp_last_error());
                            continue;
                        }
                        cases++;
                        if (sc.active_microbatches != c || sc.kind != kind)
                            NOTE(ok_build, w_build, "%s R=%d v=%d m=%d c=%d: built with cap %d, kind %d", ctx, R, v, m,
                                 c, sc.active_microbatches, (int)sc.kind);
                        if (!check_valid(&sc, map) || (split_kind(kind) && !check_w_order(&sc)))
                            NOTE(ok_valid, w_valid, "%s R=%d v=%d m=%d c=%d: %s", ctx, R, v, m, c, why);
                        if ((c == 0 || c >= natural) && !same_schedule(&sc, &free_sc))
                            NOTE(ok_same, w_same, "%s R=%d v=%d m=%d c=%d (uncapped holds %d): the schedule changed",
                                 ctx, R, v, m, c, natural);
                        for (int draw = 0; draw < 2; draw++) {
                            double f[32], b[32], w[32], lat = draw ? rnd_uniform(0, 0.5) : 0;
                            for (int s = 0; s < S; s++) {
                                f[s] = draw ? rnd_uniform(0.2, 3) : 1;
                                b[s] = draw ? rnd_uniform(0.2, 5) : 1;
                                w[s] = draw ? rnd_uniform(0, 3) : 1;
                            }
                            smp_sim_result r;
                            if (smp_schedule_simulate(&sc, f, b, w, lat, &r) != SMP_OK) {
                                NOTE(ok_sim, w_sim, "%s R=%d v=%d m=%d c=%d: %s", ctx, R, v, m, c, smp_last_error());
                                continue;
                            }
                            if (r.deadlock)
                                NOTE(ok_sim, w_sim, "%s R=%d v=%d m=%d c=%d: %s", ctx, R, v, m, c, r.deadlock_reason);
                            for (int q = 0; q < R; q++) {
                                int got = r.rank_peak_microbatches[q], counted = held_peak(&sc, q);
                                if (got < 1 || (c && got > c))
                                    NOTE(ok_cap, w_cap, "%s R=%d v=%d m=%d c=%d: rank %d holds %d microbatches", ctx, R,
                                         v, m, c, q, got);
                                if (got != counted)
                                    NOTE(ok_count, w_count,
                                         "%s R=%d v=%d m=%d c=%d: rank %d: simulator says %d, counted %d", ctx, R, v, m,
                                         c, q, got, counted);
                                if (kind == SMP_PIPELINE_SIMPLE && got != (c && c < m ? c : m))
                                    NOTE(ok_gpipe, w_gpipe, "R=%d v=%d m=%d c=%d: rank %d holds %d", R, v, m, c, q,
                                         got);
                            }
                            smp_sim_result_free(&r);
                        }
                        smp_schedule_free(&sc);
                    }
                    smp_schedule_free(&free_sc);
                }
    CHECK(ok_build && cases > 1000, "active_microbatches: every kind builds under every cap 0..m+1", "%s (%d cases)",
          w_build, cases);
    CHECK(ok_valid, "active_microbatches: capped schedules are valid (each op once, microbatch order, W order)", "%s",
          w_valid);
    CHECK(ok_sim, "active_microbatches: capped schedules never deadlock (unit and random costs, latency)", "%s", w_sim);
    CHECK(ok_cap, "active_microbatches: no rank ever holds more than the cap", "%s", w_cap);
    CHECK(ok_count, "active_microbatches: the simulator's peak microbatches per rank matches an independent count",
          "%s", w_count);
    CHECK(ok_same, "active_microbatches: 0, or a cap the schedule never reaches, leaves it unchanged", "%s", w_same);
    CHECK(ok_gpipe, "active_microbatches: simple holds exactly min(c, m) microbatches per rank (GPipe in groups of c)",
          "%s", w_gpipe);
    smp_schedule sc;
    smp_status st = smp_schedule_build_capped(SMP_PIPELINE_INTERLEAVED, 2, 2, NULL, 4, -1, false, &sc);
    CHECK(st == SMP_ERR_ARG && strstr(smp_last_error(), "active_microbatches") && strstr(smp_last_error(), "-1"),
          "active_microbatches: a negative cap is an error naming the key", "status %d: %s", (int)st, smp_last_error());
    /* GPipe in groups: 2 stages, 4 microbatches, cap 2, unit costs: two GPipe steps of 2, each (2 + 1) x 2 long */
    smp_sim_result r;
    int ok = smp_schedule_build_capped(SMP_PIPELINE_SIMPLE, 2, 2, NULL, 4, 2, false, &sc) == SMP_OK &&
             smp_schedule_simulate(&sc, NULL, NULL, NULL, 0.0, &r) == SMP_OK;
    CHECK(ok && fabs(r.makespan - 12) < 1e-12 && r.rank_peak_microbatches[0] == 2 && r.rank_peak_microbatches[1] == 2,
          "active_microbatches: simple with cap 2 of 4 runs two GPipe groups (makespan 12, 2 held)",
          "makespan %g held %d %d", ok ? r.makespan : -1, ok ? r.rank_peak_microbatches[0] : -1,
          ok ? r.rank_peak_microbatches[1] : -1);
    if (ok) smp_sim_result_free(&r);
    smp_schedule_free(&sc);
#undef NOTE
}

static void test_other_maps(void) {
    static const int maps[][8] = {
        {0, 1, 2, 0, 1, 2}, {1, 0},          {0, 1, 0, 2},    {2, 1, 0, 1, 2},
        {0, 1, 2, 1, 0},    {0, 2, 1, 0, 2, 1}, {3, 0, 1, 2, 0, 3, 1, 2}, {0, 1, 0, 1, 0, 2},
    };
    static const int nr[] = {3, 2, 3, 3, 3, 3, 4, 3}, ns[] = {6, 2, 4, 5, 5, 6, 8, 6};
    int ok = 1, tried = 0;
    for (int q = 0; q < (int)(sizeof nr / sizeof nr[0]) + 300 && ok; q++) {
        int R, S, map[16];
        if (q < (int)(sizeof nr / sizeof nr[0])) {
            R = nr[q]; S = ns[q];
            memcpy(map, maps[q], sizeof(int) * (size_t)S);
        } else { /* random maps */
            R = 2 + (int)(rnd() % 5);
            S = R + (int)(rnd() % 9);
            random_map(R, S, map);
        }
        for (int m = 1; m <= 13 && ok; m += 3)
            for (int kk = 0; kk < 3 && ok; kk++)
                for (int fo = 0; fo < 2 && ok; fo++) {
                    smp_pipeline_kind kind = kk == 2 ? SMP_PIPELINE_ZERO_BUBBLE
                                             : kk    ? SMP_PIPELINE_SIMPLE
                                                     : SMP_PIPELINE_INTERLEAVED;
                    bool zb = kind == SMP_PIPELINE_ZERO_BUBBLE && !fo;
                    smp_schedule sc;
                    smp_sim_result r;
                    tried++;
                    if (smp_schedule_build(kind, R, S, map, m, fo, &sc) != SMP_OK) {
                        ok = fail("map %d (R=%d S=%d) m=%d: %s", q, R, S, m, smp_last_error());
                        break;
                    }
                    if (!check_valid(&sc, map) || (zb && !check_w_order(&sc))) {
                        char w[512];
                        snprintf(w, sizeof w, "%s", why);
                        ok = fail("map %d %s m=%d: %s", q, kind_name(kind), m, w);
                    }
                    double f[16], b[16], w[16];
                    for (int s = 0; s < S; s++) {
                        f[s] = rnd_uniform(0.2, 3);
                        b[s] = rnd_uniform(0.2, 5);
                        w[s] = rnd_uniform(0, 3);
                    }
                    if (ok && smp_schedule_simulate(&sc, f, b, w, rnd_uniform(0, 1), &r) == SMP_OK) {
                        if (r.deadlock) ok = fail("map %d %s m=%d: %s", q, kind_name(kind), m, r.deadlock_reason);
                        for (int s = 0; s < S && ok && !fo; s++) {
                            /* zero bubble: in flight until W, at most min(m, S) */
                            int bound = kind == SMP_PIPELINE_SIMPLE ? m
                                        : zb                        ? (m < S ? m : S)
                                                                    : (m < S - s ? m : S - s);
                            if (kind == SMP_PIPELINE_SIMPLE ? r.peak_inflight[s] != bound : r.peak_inflight[s] > bound)
                                ok = fail("map %d %s m=%d: stage %d peak %d, bound %d", q, kind_name(kind), m, s,
                                          r.peak_inflight[s], bound);
                        }
                        smp_sim_result_free(&r);
                    } else if (ok) {
                        ok = fail("simulate: %s", smp_last_error());
                    }
                    smp_schedule_free(&sc);
                }
    }
    CHECK(ok,
          "other stage maps (fixed and 300 random), every kind: valid, no deadlock (random F/B/W costs and latency), "
          "in-flight bounds, zero_bubble's later stages' W first",
          "%s (%d schedules)", why, tried);
}

static void test_simple_order(void) {
    /* GPipe with two stages per rank: stage-major forwards, then backwards
       from the last stage back, microbatches ascending within each stage */
    smp_schedule sc;
    int ok = smp_schedule_build(SMP_PIPELINE_SIMPLE, 2, 4, NULL, 2, false, &sc) == SMP_OK;
    static const char *want[2] = {"F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1 ",
                                  "F1.0 F1.1 F3.0 F3.1 B3.0 B3.1 B1.0 B1.1 "};
    char got[2][128] = {"", ""};
    for (int r = 0; ok && r < 2; r++) {
        size_t len = 0;
        for (int k = 0; k < sc.nops[r]; k++)
            len += (size_t)snprintf(got[r] + len, sizeof got[r] - len, "%c%d.%d ", sc.ops[r][k].kind ? 'B' : 'F',
                                    sc.ops[r][k].stage, sc.ops[r][k].microbatch);
        ok = strcmp(got[r], want[r]) == 0;
    }
    CHECK(ok, "simple with 2 stages per rank: stage-major forwards, reverse backwards", "rank 0: %s| rank 1: %s",
          got[0], got[1]);
    smp_schedule_free(&sc);
}

static void test_interleaved_order(void) {
    /* 2 ranks x 2 virtual stages, 4 microbatches: microbatches go through a
       rank's chunks in groups of 2 (F0.0 F0.1 then F2.0 F2.1 on rank 0) */
    smp_schedule sc;
    int ok = smp_schedule_build(SMP_PIPELINE_DEFAULT, 2, 4, NULL, 4, false, &sc) == SMP_OK;
    ok = ok && sc.kind == SMP_PIPELINE_INTERLEAVED;
    int prefix = ok && sc.nops[0] >= 4 && sc.ops[0][0].stage == 0 && sc.ops[0][1].stage == 0 &&
                 sc.ops[0][2].stage == 2 && sc.ops[0][2].microbatch == 0 && sc.ops[0][3].stage == 2;
    CHECK(prefix, "interleaved: default kind is interleaved, microbatches grouped by nranks per chunk", "%s",
          ok ? "rank 0 does not start F0.0 F0.1 F2.0 F2.1" : smp_last_error());
    smp_schedule_free(&sc);
}

static void test_zero_bubble_order(void) {
    /* ZB-H1 with 4 stages and 6 microbatches: 1F1B's warm-up (S - s
       forwards), then each B as soon as it can run, and the W ops where
       1F1B would idle: stage s delays its first W by s slots (the last
       stage runs its first W after 4 F/B pairs) and runs the leftover
       Ws at the end, where 1F1B's cool-down bubble was */
    static const char *want[4] = {
        "F0.0 F0.1 F0.2 F0.3 B0.0 W0.0 F0.4 B0.1 W0.1 F0.5 B0.2 W0.2 B0.3 W0.3 B0.4 W0.4 B0.5 W0.5 ",
        "F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 W1.0 F1.4 B1.2 W1.1 F1.5 B1.3 W1.2 B1.4 W1.3 B1.5 W1.4 W1.5 ",
        "F2.0 F2.1 B2.0 F2.2 B2.1 F2.3 B2.2 W2.0 F2.4 B2.3 W2.1 F2.5 B2.4 W2.2 B2.5 W2.3 W2.4 W2.5 ",
        "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 W3.0 F3.4 B3.4 W3.1 F3.5 B3.5 W3.2 W3.3 W3.4 W3.5 "};
    smp_schedule sc;
    int ok = smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE, 4, 4, NULL, 6, false, &sc) == SMP_OK &&
             sc.kind == SMP_PIPELINE_ZERO_BUBBLE;
    char got[4][256] = {"", "", "", ""};
    int bad = -1;
    for (int r = 0; ok && r < 4; r++) {
        size_t len = 0;
        for (int k = 0; k < sc.nops[r] && len < sizeof got[r]; k++)
            len += (size_t)snprintf(got[r] + len, sizeof got[r] - len, "%c%d.%d ", op_letter(sc.ops[r][k].kind),
                                    sc.ops[r][k].stage, sc.ops[r][k].microbatch);
        if (strcmp(got[r], want[r])) { ok = 0; bad = r; }
    }
    CHECK(ok, "zero_bubble with 4 stages, 6 microbatches: ZB-H1's order (W ops in 1F1B's bubbles)",
          "rank %d: %s| want %s", bad, bad >= 0 ? got[bad] : smp_last_error(), bad >= 0 ? want[bad] : "");
    smp_schedule_free(&sc);
}

static void test_simulator_by_hand(void) {
    /* 2 stages, 1 microbatch, GPipe: F0 [0,1], F1 [1.5,3.5], B1 [3.5,7.5], B0 [8,11] */
    smp_schedule sc;
    smp_sim_result r;
    double f[2] = {1, 2}, b[2] = {3, 4};
    int ok = smp_schedule_build(SMP_PIPELINE_SIMPLE, 2, 2, NULL, 1, false, &sc) == SMP_OK &&
             smp_schedule_simulate(&sc, f, b, NULL, 0.5, &r) == SMP_OK;
    if (ok) {
        ok = fabs(r.makespan - 11) < 1e-12 && fabs(r.busy - 10) < 1e-12 && fabs(r.ideal - 5) < 1e-12 &&
             fabs(r.bubble_fraction - (1 - 10.0 / 22)) < 1e-12 && !r.deadlock && r.peak_inflight[0] == 1 &&
             r.peak_inflight[1] == 1 && r.rank_peak_inflight[0] == 1;
        CHECK(ok, "simulator: makespan, busy, ideal and bubble of a 2-stage step by hand",
              "makespan %g busy %g ideal %g bubble %g", r.makespan, r.busy, r.ideal, r.bubble_fraction);
        smp_sim_result_free(&r);
    } else {
        CHECK(0, "simulator: makespan, busy, ideal and bubble of a 2-stage step by hand", "%s", smp_last_error());
    }
    smp_schedule_free(&sc);

    /* the same step with W costs: zero bubble runs W apart (F0 [0,1], F1 [1.5,3.5],
       B1 [3.5,7.5], W1 [7.5,8.5], B0 [8,11], W0 [11,11.5]); GPipe's backward
       costs B + W (B1 [3.5,8.5], B0 [9,12.5]) */
    double w[2] = {0.5, 1};
    ok = smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE, 2, 2, NULL, 1, false, &sc) == SMP_OK &&
         smp_schedule_simulate(&sc, f, b, w, 0.5, &r) == SMP_OK;
    if (ok) {
        ok = fabs(r.makespan - 11.5) < 1e-12 && fabs(r.busy - 11.5) < 1e-12 && fabs(r.ideal - 5.75) < 1e-12 &&
             fabs(r.bubble_fraction - 0.5) < 1e-12 && !r.deadlock && r.peak_inflight[0] == 1 && r.peak_inflight[1] == 1;
        CHECK(ok, "simulator: zero_bubble 2-stage step by hand (B and W apart)",
              "makespan %g busy %g ideal %g bubble %g", r.makespan, r.busy, r.ideal, r.bubble_fraction);
        smp_sim_result_free(&r);
    } else {
        CHECK(0, "simulator: zero_bubble 2-stage step by hand (B and W apart)", "%s", smp_last_error());
    }
    smp_schedule_free(&sc);
    ok = smp_schedule_build(SMP_PIPELINE_SIMPLE, 2, 2, NULL, 1, false, &sc) == SMP_OK &&
         smp_schedule_simulate(&sc, f, b, w, 0.5, &r) == SMP_OK;
    if (ok) {
        ok = fabs(r.makespan - 12.5) < 1e-12 && fabs(r.busy - 11.5) < 1e-12 && fabs(r.ideal - 5.75) < 1e-12 &&
             !r.deadlock;
        CHECK(ok, "simulator: outside zero bubble a backward costs B + W", "makespan %g busy %g ideal %g", r.makespan,
              r.busy, r.ideal);
        smp_sim_result_free(&r);
    } else {
        CHECK(0, "simulator: outside zero bubble a backward costs B + W", "%s", smp_last_error());
    }
    smp_schedule_free(&sc);
    /* default costs: W 1 in zero bubble, 0 elsewhere (the backward cost is then the whole backward) */
    double mz = -1, mi = -1;
    if (smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE, 1, 1, NULL, 1, false, &sc) == SMP_OK &&
        smp_schedule_simulate(&sc, NULL, NULL, NULL, 0, &r) == SMP_OK) {
        mz = r.makespan;
        smp_sim_result_free(&r);
    }
    smp_schedule_free(&sc);
    if (smp_schedule_build(SMP_PIPELINE_INTERLEAVED, 1, 1, NULL, 1, false, &sc) == SMP_OK &&
        smp_schedule_simulate(&sc, NULL, NULL, NULL, 0, &r) == SMP_OK) {
        mi = r.makespan;
        smp_sim_result_free(&r);
    }
    smp_schedule_free(&sc);
    CHECK(mz == 3 && mi == 2, "simulator: NULL costs are 1, and W's is 0 outside zero bubble",
          "zero_bubble %g (want 3), interleaved %g (want 2)", mz, mi);

    /* forward-only: nothing stays in flight; ideal counts forwards only */
    ok = smp_schedule_build(SMP_PIPELINE_INTERLEAVED, 2, 4, NULL, 3, true, &sc) == SMP_OK &&
         smp_schedule_simulate(&sc, NULL, NULL, NULL, 0, &r) == SMP_OK;
    if (ok) {
        int zero = 1;
        for (int s = 0; s < 4; s++) zero = zero && r.peak_inflight[s] == 0;
        CHECK(zero && fabs(r.ideal - 6) < 1e-12 && !r.deadlock, "simulator: forward-only step",
              "ideal %g deadlock %d", r.ideal, (int)r.deadlock);
        smp_sim_result_free(&r);
    } else {
        CHECK(0, "simulator: forward-only step", "%s", smp_last_error());
    }
    smp_schedule_free(&sc);
}

/* A schedule made by hand, with room for 8 ops per rank. */
typedef struct hand {
    smp_schedule sc;
    int map[4], nops[4];
    smp_sched_op ops[4][8], *rows[4];
} hand;
static void hand_init(hand *h, int R, int S, const int *map, int m, bool fo) {
    memset(h, 0, sizeof *h);
    h->sc.kind = SMP_PIPELINE_INTERLEAVED;
    h->sc.nranks = R; h->sc.nstages = S; h->sc.microbatches = m; h->sc.forward_only = fo;
    memcpy(h->map, map, sizeof(int) * (size_t)S);
    for (int r = 0; r < 4; r++) h->rows[r] = h->ops[r];
    h->sc.stage_rank = h->map; h->sc.nops = h->nops; h->sc.ops = h->rows;
}
static void hand_op(hand *h, int r, smp_sched_op_kind k, int s, int i) {
    h->ops[r][h->nops[r]++] = (smp_sched_op){k, s, i};
}

static void test_deadlock(void) {
    const smp_sched_op_kind F = SMP_SCHED_FORWARD, B = SMP_SCHED_BACKWARD;
    hand h;
    smp_sim_result r;
    /* stages 0,1,2 on ranks 0,1,0; rank 0 starts with stage 2, which needs
       rank 1's stage 1, which needs rank 0's stage 0: each waits on the other */
    static const int map[] = {0, 1, 0};
    hand_init(&h, 2, 3, map, 1, false);
    hand_op(&h, 0, F, 2, 0); hand_op(&h, 0, F, 0, 0); hand_op(&h, 0, B, 2, 0); hand_op(&h, 0, B, 0, 0);
    hand_op(&h, 1, F, 1, 0); hand_op(&h, 1, B, 1, 0);
    smp_status st = smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r);
    CHECK(st == SMP_OK && r.deadlock && strstr(r.deadlock_reason, "rank 0 at F2.0 waits for F1.0 (rank 1)") &&
              strstr(r.deadlock_reason, "rank 1 at F1.0 waits for F0.0 (rank 0)"),
          "simulator: two ranks waiting on each other is a deadlock, with who waits for what", "status %d, %s: %s",
          (int)st, r.deadlock ? "deadlock" : "no deadlock", r.deadlock_reason);
    smp_sim_result_free(&r);

    /* the same ops in a good order run */
    hand_init(&h, 2, 3, map, 1, false);
    hand_op(&h, 0, F, 0, 0); hand_op(&h, 0, F, 2, 0); hand_op(&h, 0, B, 2, 0); hand_op(&h, 0, B, 0, 0);
    hand_op(&h, 1, F, 1, 0); hand_op(&h, 1, B, 1, 0);
    st = smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r);
    CHECK(st == SMP_OK && !r.deadlock && fabs(r.makespan - 6) < 1e-12, "simulator: a hand-made good order runs",
          "status %d deadlock %d makespan %g", (int)st, (int)r.deadlock, r.makespan);
    smp_sim_result_free(&r);

    /* a rank that puts a backward before its own forward waits forever */
    static const int map2[] = {0, 1};
    hand_init(&h, 2, 2, map2, 2, false);
    hand_op(&h, 0, F, 0, 0); hand_op(&h, 0, F, 0, 1); hand_op(&h, 0, B, 0, 0); hand_op(&h, 0, B, 0, 1);
    hand_op(&h, 1, B, 1, 0); hand_op(&h, 1, F, 1, 0); hand_op(&h, 1, F, 1, 1); hand_op(&h, 1, B, 1, 1);
    st = smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r);
    CHECK(st == SMP_OK && r.deadlock && strstr(r.deadlock_reason, "rank 1 at B1.0 waits for F1.0 (rank 1)") &&
              strstr(r.deadlock_reason, "rank 0 at B0.0 waits for B1.0 (rank 1)"),
          "simulator: a backward before its own forward is a deadlock", "%s", r.deadlock_reason);
    smp_sim_result_free(&r);

    /* zero bubble: a W before its own B waits forever */
    const smp_sched_op_kind W = SMP_SCHED_WEIGHT;
    hand_init(&h, 2, 2, map2, 1, false);
    h.sc.kind = SMP_PIPELINE_ZERO_BUBBLE;
    hand_op(&h, 0, F, 0, 0); hand_op(&h, 0, W, 0, 0); hand_op(&h, 0, B, 0, 0);
    hand_op(&h, 1, F, 1, 0); hand_op(&h, 1, B, 1, 0); hand_op(&h, 1, W, 1, 0);
    st = smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r);
    CHECK(st == SMP_OK && r.deadlock && strstr(r.deadlock_reason, "rank 0 at W0.0 waits for B0.0 (rank 0)"),
          "simulator: a W before its own B is a deadlock", "status %d: %s", (int)st, r.deadlock_reason);
    smp_sim_result_free(&r);

    /* zero bubble: a microbatch stays in flight until its W, not its B */
    static const int map1[] = {0};
    int peak[2] = {-1, -1};
    for (int late = 0; late < 2; late++) {
        hand_init(&h, 1, 1, map1, 2, false);
        h.sc.kind = SMP_PIPELINE_ZERO_BUBBLE;
        hand_op(&h, 0, F, 0, 0); hand_op(&h, 0, B, 0, 0);
        if (!late) hand_op(&h, 0, W, 0, 0);
        hand_op(&h, 0, F, 0, 1);
        if (late) hand_op(&h, 0, W, 0, 0);
        hand_op(&h, 0, B, 0, 1); hand_op(&h, 0, W, 0, 1);
        if (smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r) == SMP_OK) {
            peak[late] = r.deadlock ? -2 : r.peak_inflight[0] * 10 + r.rank_peak_inflight[0];
            smp_sim_result_free(&r);
        }
    }
    CHECK(peak[0] == 11 && peak[1] == 22, "simulator: zero bubble counts a microbatch in flight until its W",
          "F B W F B W: %d, F B F W B W: %d (stage peak * 10 + rank peak; want 11 and 22)", peak[0], peak[1]);
}

static void check_error(smp_status st, const char *phrase, const char *name) {
    CHECK(st == SMP_ERR_ARG && strstr(smp_last_error(), phrase), name, "status %d, message \"%s\" (want \"%s\")",
          (int)st, smp_last_error(), phrase);
}

static void test_errors(void) {
    smp_schedule sc;
    static const int no_rank1[] = {0, 2, 0, 2}, consecutive[] = {0, 1, 1, 0}, out_of_range[] = {0, 5};
    check_error(smp_schedule_build(SMP_PIPELINE_SIMPLE, 0, 1, NULL, 1, false, &sc), "nranks = 0",
                "error: nranks < 1");
    check_error(smp_schedule_build(SMP_PIPELINE_SIMPLE, 3, 2, NULL, 1, false, &sc), "2 stages cannot occupy 3 ranks",
                "error: fewer stages than ranks");
    check_error(smp_schedule_build(SMP_PIPELINE_INTERLEAVED, 2, 2, NULL, 0, false, &sc), "microbatches = 0",
                "error: microbatches < 1");
    check_error(smp_schedule_build(SMP_PIPELINE_INTERLEAVED, 3, 4, no_rank1, 4, false, &sc), "rank 1 runs no stage",
                "error: a rank with no stage");
    check_error(smp_schedule_build(SMP_PIPELINE_INTERLEAVED, 2, 4, consecutive, 4, false, &sc),
                "stages 1 and 2 both run on rank 1", "error: consecutive stages on one rank (0,1,1,0)");
    check_error(smp_schedule_build(SMP_PIPELINE_INTERLEAVED, 1, 2, NULL, 4, false, &sc), "consecutive",
                "error: one rank, two stages");
    check_error(smp_schedule_build(SMP_PIPELINE_SIMPLE, 2, 2, out_of_range, 1, false, &sc),
                "stage 1 is placed on rank 5", "error: rank out of range");
    check_error(smp_schedule_build((smp_pipeline_kind)42, 2, 2, NULL, 1, false, &sc), "unknown pipeline kind 42",
                "error: unknown kind");
    check_error(smp_schedule_build((smp_pipeline_kind)42, 2, 2, NULL, 1, false, &sc), "zero_bubble or zero_bubble_v",
                "error: unknown kind lists zero_bubble and zero_bubble_v among the kinds");
    static const int alternating[] = {0, 1, 0, 1}, vee3[] = {0, 1, 2, 2, 1, 0};
    check_error(smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE_V, 2, 3, NULL, 4, false, &sc),
                "2 ranks need 4 stages, got 3", "error: zero_bubble_v needs 2 stages per rank");
    check_error(smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE_V, 2, 4, alternating, 4, false, &sc),
                "stage 2 is placed on rank 0, but zero_bubble_v's V puts it on rank 1",
                "error: zero_bubble_v on 0,1,0,1 names the V");
    check_error(smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE_V, 2, 4, NULL, 0, false, &sc), "microbatches = 0",
                "error: zero_bubble_v with no microbatch");
    check_error(smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE, 3, 6, vee3, 4, false, &sc),
                "stages 2 and 3 both run on rank 2", "error: the V's consecutive stages only under zero_bubble_v");
    CHECK(smp_schedule_build(SMP_PIPELINE_ZERO_BUBBLE_V, 3, 6, vee3, 4, false, &sc) == SMP_OK,
          "zero_bubble_v accepts the V 0,1,2,2,1,0", "%s", smp_last_error());
    smp_schedule_free(&sc);
    check_error(smp_schedule_build(SMP_PIPELINE_SIMPLE, 2, 2, NULL, 1, false, NULL), "out is NULL", "error: no output");
    /* a failed build leaves a zeroed schedule that free accepts */
    smp_schedule_build(SMP_PIPELINE_SIMPLE, 0, 1, NULL, 1, false, &sc);
    CHECK(sc.ops == NULL && sc.nops == NULL && sc.stage_rank == NULL, "error: failed build leaves a zeroed schedule",
          "arrays left behind");
    smp_schedule_free(&sc);

    /* the simulator rejects malformed schedules */
    const smp_sched_op_kind F = SMP_SCHED_FORWARD, B = SMP_SCHED_BACKWARD;
    static const int map[] = {0, 1};
    hand h;
    smp_sim_result r;
    hand_init(&h, 2, 2, map, 1, false);
    hand_op(&h, 0, F, 0, 0); hand_op(&h, 0, B, 0, 0); hand_op(&h, 1, F, 1, 0); hand_op(&h, 1, F, 1, 0);
    hand_op(&h, 1, B, 1, 0);
    check_error(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r), "F(stage 1, microbatch 0) appears twice",
                "simulator error: repeated op");
    hand_init(&h, 2, 2, map, 1, false);
    hand_op(&h, 0, F, 0, 0); hand_op(&h, 1, F, 1, 0); hand_op(&h, 1, B, 1, 0);
    check_error(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r), "never runs B(stage 0, microbatch 0)",
                "simulator error: missing op");
    hand_init(&h, 2, 2, map, 1, false);
    hand_op(&h, 0, F, 0, 0); hand_op(&h, 0, F, 1, 0);
    check_error(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r), "stage 1 runs on rank 1",
                "simulator error: op on the wrong rank");
    hand_init(&h, 2, 2, map, 1, false);
    hand_op(&h, 0, F, 0, 3);
    check_error(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r), "outside 2 stages x 1 microbatches",
                "simulator error: op out of range");
    /* W ops: only in zero-bubble training schedules, each once */
    const smp_sched_op_kind W = SMP_SCHED_WEIGHT;
    for (int k = 0; k < 2; k++) {
        hand_init(&h, 2, 2, map, 1, false);
        h.sc.kind = k ? SMP_PIPELINE_SIMPLE : SMP_PIPELINE_INTERLEAVED;
        hand_op(&h, 0, F, 0, 0);
        hand_op(&h, 0, B, 0, 0);
        hand_op(&h, 0, W, 0, 0);
        hand_op(&h, 1, F, 1, 0);
        hand_op(&h, 1, B, 1, 0);
        check_error(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r),
                    "rank 0 op 2 is a weight-gradient op in a non-zero-bubble schedule",
                    k ? "simulator error: W op in a simple schedule"
                      : "simulator error: W op in an interleaved schedule");
    }
    hand_init(&h, 2, 2, map, 1, true);
    h.sc.kind = SMP_PIPELINE_ZERO_BUBBLE;
    hand_op(&h, 0, F, 0, 0); hand_op(&h, 0, W, 0, 0); hand_op(&h, 1, F, 1, 0);
    check_error(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r), "weight-gradient op in a forward-only schedule",
                "simulator error: W op in a forward-only zero_bubble schedule");
    hand_init(&h, 2, 2, map, 1, false);
    h.sc.kind = SMP_PIPELINE_ZERO_BUBBLE;
    hand_op(&h, 0, F, 0, 0);
    hand_op(&h, 0, B, 0, 0);
    hand_op(&h, 0, W, 0, 0);
    hand_op(&h, 1, F, 1, 0);
    hand_op(&h, 1, B, 1, 0);
    check_error(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r), "never runs W(stage 1, microbatch 0)",
                "simulator error: zero_bubble schedule missing a W op");
    hand_op(&h, 1, W, 1, 0); hand_op(&h, 1, W, 1, 0);
    check_error(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r), "W(stage 1, microbatch 0) appears twice",
                "simulator error: repeated W op");
    /* a zero_bubble_v schedule off its V, and the V under another kind */
    static const int map4[] = {0, 1, 0, 1}, vee2[] = {0, 1, 1, 0};
    hand_init(&h, 2, 4, map4, 1, true);
    h.sc.kind = SMP_PIPELINE_ZERO_BUBBLE_V;
    hand_op(&h, 0, F, 0, 0); hand_op(&h, 1, F, 1, 0); hand_op(&h, 0, F, 2, 0); hand_op(&h, 1, F, 3, 0);
    check_error(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r), "zero_bubble_v's V puts it on rank 1",
                "simulator error: zero_bubble_v off its V");
    hand_init(&h, 2, 4, vee2, 1, true);
    hand_op(&h, 0, F, 0, 0); hand_op(&h, 1, F, 1, 0); hand_op(&h, 1, F, 2, 0); hand_op(&h, 0, F, 3, 0);
    check_error(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r), "stages 1 and 2 both run on rank 1",
                "simulator error: the V in an interleaved schedule");
    h.sc.kind = SMP_PIPELINE_ZERO_BUBBLE_V;
    CHECK(smp_schedule_simulate(&h.sc, NULL, NULL, NULL, 0, &r) == SMP_OK && !r.deadlock && r.makespan == 4,
          "simulator: a hand-made zero_bubble_v evaluation runs", "%s", smp_last_error());
    smp_sim_result_free(&r);
    smp_schedule_build(SMP_PIPELINE_SIMPLE, 2, 2, NULL, 1, false, &sc);
    double neg[2] = {1, -1}, nan2[2] = {NAN, 1};
    check_error(smp_schedule_simulate(&sc, neg, NULL, NULL, 0, &r), "forward cost of stage 1",
                "simulator error: negative cost");
    check_error(smp_schedule_simulate(&sc, NULL, nan2, NULL, 0, &r), "backward cost of stage 0",
                "simulator error: NaN cost");
    check_error(smp_schedule_simulate(&sc, NULL, NULL, neg, 0, &r), "weight cost of stage 1",
                "simulator error: negative W cost");
    check_error(smp_schedule_simulate(&sc, NULL, NULL, NULL, -1, &r), "comm_latency",
                "simulator error: negative latency");
    CHECK(r.peak_inflight == NULL && r.rank_peak_inflight == NULL, "simulator error: leaves no arrays", "arrays left");
    smp_schedule_free(&sc);
    smp_schedule_free(&sc); /* twice: harmless */
}

/* Out of memory at each allocation of a build and a simulation in turn
   (before smp_init: schedules need none): SMP_ERR_NOMEM with the policy's
   message, nothing left allocated, and a schedule once memory suffices. */
static void test_nomem(void) {
    static const smp_pipeline_kind kinds[] = {SMP_PIPELINE_SIMPLE, SMP_PIPELINE_INTERLEAVED, SMP_PIPELINE_ZERO_BUBBLE,
                                              SMP_PIPELINE_ZERO_BUBBLE_V};
    int failed = 0, wrong = 0, ran = 0;
    for (int q = 0; q < 4; q++)
        for (long skip = 0; skip < 64; skip++) {
            smp_schedule sc;
            smp_sim_result r;
            int64_t before = smp_memory().current_bytes;
            smp_testing_fail(SMP_FAULT_ALLOC, skip);
            smp_status st = smp_schedule_build(kinds[q], 2, 4, NULL, 4, false, &sc);
            if (st) wrong += sc.ops != NULL;
            else if ((st = smp_schedule_simulate(&sc, NULL, NULL, NULL, 0.0, &r))) wrong += r.peak_inflight != NULL;
            smp_testing_fail(SMP_FAULT_ALLOC, -1);
            if (!st) smp_sim_result_free(&r);
            smp_schedule_free(&sc);
            wrong += smp_memory().current_bytes != before;
            if (!st) { ran++; break; } /* past the last allocation */
            failed++;
            wrong += st != SMP_ERR_NOMEM || !strstr(smp_last_error(), "out of memory: ");
        }
    CHECK(ran == 4 && failed >= 4 * 4 && !wrong,
          "out of memory in smp_schedule_build and smp_schedule_simulate: SMP_ERR_NOMEM, nothing kept",
          "%d of 4 kinds ran, %d allocations failed, %d wrong (last: %s)", ran, failed, wrong, smp_last_error());
}

int main(void) {
    (void)test_skip; /* test.h's helpers this file does not need */
    (void)test_mpi_check;
    test_gpipe_bubble();
    test_1f1b_bubble();
    test_zb_h1_bubble();
    test_exhaustive();
    test_other_maps();
    test_simple_order();
    test_interleaved_order();
    test_zero_bubble_order();
    test_zbv_bubble();
    test_zbv_exhaustive();
    test_zbv_order();
    test_active_microbatches();
    test_simulator_by_hand();
    test_deadlock();
    test_errors();
    test_nomem();
    return test_exit_code();
}
