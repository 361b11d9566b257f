/* bench/ddp.c - smp's data-parallel gradient sync against raw MPI, and how
   much of it overlapping_allreduce hides behind backward.

   Setup: 2 ranks, ddp on, partitions 1, microbatches 1, bucket_cap_mb 25.
   The model is a chain of 8 modules, each with one f32 parameter of 8 MiB
   (64 MiB of gradients in all), so smp lays the gradients out in buckets
   of 24, 24 and 16 MiB (three parameters fit under the 25 MiB cap). Forward
   copies a 1x8 input through; backward copies the gradient through and
   writes two elements of the parameter's gradient, so it costs nothing
   unless told to wait (part 2).

   Method. backward_passes_per_step = 2 makes smp skip the gradient sync on
   every other step and do it on the next, with nothing else different in
   the step: the executor, the tracing, the schedule and the backward
   callbacks are the same. Like a training loop, the benchmark zeroes the
   gradients (untimed) before each pair. So the sync costs
       sync = t(step that syncs) - t(step that does not)
   measured back to back, on the same model, in the same process. Every
   timed item starts after a 2 ms idle gap and a barrier, and a sample is
   the slower rank's time.

   (1) Per repetition: a no-sync step, a sync step and one raw
       MPI_Allreduce(MPI_IN_PLACE, 64 MiB f32, SUM) on a duplicate of
       MPI_COMM_WORLD; the raw call goes first on odd repetitions and last
       on even ones. For diagnosis the table also shows raw MPI with smp's
       bucket layout, three MPI_Iallreduce started together and waited
       for with MPI_Waitall, or started one after another as smp does
       (each waited for before the next starts); these two take turns,
       one per repetition, next to the 64 MiB call. The ratio is
       median(sync) / median(raw 64 MiB).
   (2) The same model with a backward of fixed length: every module's
       backward waits 10 ms (80 ms per step). overlapping_allreduce is a
       start-up setting, so the run alternates blocks (smp_init ...
       smp_finalize) with it on and off, flipping which comes first each
       round. In each block every backward variant runs no-sync/sync pairs:
         sleep        nanosleep: nobody drives MPI during backward;
         poll/call    sleep, then one MPI progress poke when the callback
                      ends (what the executor would do if it tested the
                      started buckets between calls);
         poll/1ms     sleep in 1 ms slices with a progress poke after each
                      (an engine that lets MPI progress inside long
                      kernels, or a progress thread).
       A poke is MPI_Iprobe on a private communicator, which runs MPICH's
       progress engine. For each variant
         exposed(x) = median(sync step, overlap x) - median(no-sync step)
         hidden     = (t_sync(off) - t_sync(on)) / exposed(off)
       exposed(off) is the sync measured as in (1) on this model.

   With MPIR_CVAR_ASYNC_PROGRESS=1 in the environment the benchmark asks
   for MPI_THREAD_MULTIPLE, which is what MPICH needs to start its progress
   thread; everything else is unchanged.

   Build: mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. -Itest bench/ddp.c -o build/bench/ddp -lm
   Run:   mpirun -n 2 build/bench/ddp [repetitions of (1), default 31] [rounds of (2), default 8; 0 skips it]

   The last line is always
       ddp sync smp/mpi time ratio: X.XX
*/
#define _POSIX_C_SOURCE 200809L
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { NMOD = 8, WIDTH = 8 };
#define PARAM_FLOATS ((int64_t)2 << 20) /* 8 MiB of f32 per module */
#define BWD_MS 10.0                      /* part 2: backward length per module */

/* ---------------------------------------------------------------- what backward does */
typedef enum { BWD_FREE, BWD_SLEEP, BWD_POLL_CALL, BWD_POLL_1MS, BWD_KINDS } bwd_kind;
static const char *bwd_name[BWD_KINDS] = {"free", "sleep", "poll/call", "poll/1ms"};
static bwd_kind g_bwd = BWD_FREE;
static MPI_Comm g_poke; /* private communicator: probing it only runs progress */
static long g_pokes;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_s(double s) {
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {}
}

static void poke_mpi(void) {
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, g_poke, &flag, MPI_STATUS_IGNORE);
    g_pokes++;
}

/* Waits `ms` milliseconds of wall time, the way the current variant does. */
static void backward_work(double ms) {
    double end = now_s() + ms * 1e-3;
    switch (g_bwd) {
    case BWD_FREE: return;
    case BWD_SLEEP: sleep_s(end - now_s()); return;
    case BWD_POLL_CALL: sleep_s(end - now_s()); poke_mpi(); return;
    case BWD_POLL_1MS:
        for (double left; (left = end - now_s()) > 0;) {
            sleep_s(left < 1e-3 ? left : 1e-3);
            poke_mpi();
        }
        return;
    default: return;
    }
}

/* ---------------------------------------------------------------- the model */
typedef struct { smp_param *w; } mod_state;
typedef struct { smp_module *root, *mods[NMOD]; mod_state st[NMOD]; } net;

static smp_status pass_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    memcpy(y->data, x->data, smp_tensor_nbytes(x));
    return SMP_OK;
}

static smp_status pass_backward(smp_call_ctx *c) {
    mod_state *s = (mod_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *gy = smp_call_grad_output(c, 0);
    smp_tensor *gx = smp_call_grad_input(c, 0);
    if (gx) memcpy(gx->data, gy->data, smp_tensor_nbytes(gy));
    smp_tensor *g = smp_param_grad(s->w);
    float *gd = (float *)g->data, v = ((const float *)gy->data)[0] * 1e-6f;
    gd[0] += v; /* the gradient is written: its first and last element */
    gd[smp_tensor_numel(g) - 1] += v;
    backward_work(BWD_MS);
    return SMP_OK;
}

static smp_status net_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m; (void)nin; (void)nout;
    net *n = (net *)user;
    smp_tensor a = in[0], b;
    for (int k = 0; k < NMOD; k++) {
        smp_status st = smp_call(n->mods[k], &a, 1, &b, 1);
        if (st) return st;
        a = b;
    }
    out[0] = a;
    return SMP_OK;
}

SMP_STEP_BODY(sum_body) {
    const smp_tensor *y = smp_mb_output(mb, 0);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    float loss = 0;
    for (int64_t i = 0; i < smp_tensor_numel(y); i++) {
        loss += ((const float *)y->data)[i];
        if (g) ((float *)g->data)[i] = 1.0f;
    }
    return smp_mb_return_f32(mb, 0, loss);
}

static void die(const char *what) {
    fprintf(stderr, "rank %d: %s: %s\n", smp_rank(), what, smp_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static float g_x[WIDTH];

/* smp_init with the benchmark's config, the model built and traced, and one
   warm-up pair of steps (the first step broadcasts parameters and lays out
   the buckets). */
static smp_model *start(net *n, bool overlap) {
    smp_config cfg = {0};
    cfg.partitions = 1;
    cfg.microbatches = 1;
    cfg.ddp = SMP_ON;
    cfg.bucket_cap_mb = 25;
    cfg.backward_passes_per_step = 2;
    cfg.overlapping_allreduce = overlap ? SMP_ON : SMP_OFF;
    if (smp_init(&cfg) != SMP_OK) die("smp_init");
    memset(n, 0, sizeof *n);
    n->root = smp_module_new(NULL, "", NULL);
    for (int k = 0; k < NMOD; k++) {
        char name[16];
        snprintf(name, sizeof name, "m%d", k);
        smp_module_desc d = {pass_forward, pass_backward, &n->st[k]};
        n->mods[k] = smp_module_new(n->root, name, &d);
        int64_t shape[1] = {PARAM_FLOATS};
        n->st[k].w = smp_param_new(n->mods[k], "w", SMP_F32, 1, shape, smp_init_constant, NULL);
    }
    smp_model *m = NULL;
    smp_model_desc md = {net_forward, 1, 1, n, false};
    if (smp_model_new(n->root, &md, &m) != SMP_OK) die("smp_model_new");
    smp_tensor x = smp_tensor_2d(g_x, SMP_F32, 1, WIDTH);
    if (smp_model_trace(m, &x, 1) != SMP_OK) die("smp_model_trace");
    bwd_kind keep = g_bwd;
    g_bwd = BWD_FREE;
    smp_step_output out = {0};
    for (int w = 0; w < 2; w++)
        if (SMP_TRAIN_STEP(m, sum_body, NULL, &out, 1, x) != SMP_OK) die("warm-up step");
    smp_step_output_free(&out);
    g_bwd = keep;
    return m;
}

static void stop(smp_model *m) {
    smp_model_free(m);
    smp_finalize();
}

/* Every timed item starts the same way: a short idle gap, then a barrier.
   On a shared machine the scheduler hands the core to other processes
   right after a rank has been busy for a while (a sync step, a raw
   all-reduce), which would land on whatever runs next; the gap makes every
   item start rested. */
static void settle(MPI_Comm comm) {
    sleep_s(2e-3);
    MPI_Barrier(comm);
}

/* One training step; this rank's seconds. */
static double timed_step(smp_model *m) {
    smp_tensor x = smp_tensor_2d(g_x, SMP_F32, 1, WIDTH);
    smp_step_output out = {0};
    settle(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    if (SMP_TRAIN_STEP(m, sum_body, NULL, &out, 1, x) != SMP_OK) die("step");
    double d = MPI_Wtime() - t0;
    smp_step_output_free(&out);
    return d;
}

/* ---------------------------------------------------------------- statistics */
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(const double *v, int n) {
    double *c = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
    memcpy(c, v, sizeof(double) * (size_t)n);
    qsort(c, (size_t)n, sizeof *c, cmp_double);
    double r = n == 0 ? 0 : n % 2 ? c[n / 2] : 0.5 * (c[n / 2 - 1] + c[n / 2]);
    free(c);
    return r;
}

/* A sample is the slower rank's time. */
static void slower_rank(double *v, int n) { MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD); }

/* ---------------------------------------------------------------- (1) sync against raw MPI */
enum { RAW_ONE, RAW_BUCKETS, RAW_BUCKETS_IN_TURN, RAW_KINDS };

static void raw_sync(int kind, float *buf, int64_t n, MPI_Comm comm) {
    if (kind == RAW_ONE) {
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, comm);
        return;
    }
    /* smp's layout: three parameters per bucket, in backward order */
    MPI_Request req[NMOD];
    int nb = 0;
    int64_t per = PARAM_FLOATS * 3;
    MPI_Status stats[NMOD]; /* a real array: gcc flags MPI_STATUSES_IGNORE */
    for (int64_t at = 0; at < n; at += per, nb++) {
        MPI_Iallreduce(MPI_IN_PLACE, buf + at, (int)(n - at < per ? n - at : per), MPI_FLOAT, MPI_SUM, comm, &req[nb]);
        if (kind == RAW_BUCKETS_IN_TURN) MPI_Wait(&req[nb], stats);
    }
    MPI_Waitall(nb, req, stats);
}

static double part1(int reps, double *sync_out, int rank) {
    net n;
    g_bwd = BWD_FREE;
    smp_model *m = start(&n, true);
    MPI_Comm raw;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    int64_t nf = PARAM_FLOATS * NMOD;
    float *buf = (float *)malloc(sizeof(float) * (size_t)nf);
    if (!buf) die("malloc");
    for (int64_t i = 0; i < nf; i++) buf[i] = (float)((i + rank) % 13) * 0.25f;
    for (int k = 0; k < RAW_KINDS; k++) raw_sync(k, buf, nf, raw); /* warm-up */

    double *nosync = (double *)calloc((size_t)reps * (3 + RAW_KINDS), sizeof(double));
    double *sync = nosync + reps, *diff = sync + reps, *rawt = diff + reps; /* rawt[k * reps + r] */
    for (int r = 0; r < reps; r++) {
        int kind = r % RAW_KINDS; /* the diagnostic layouts take turns; one-buffer runs every repetition */
        for (int pass = 0; pass < 2; pass++) {
            bool raw_now = (pass == 0) == (r % 2 == 1); /* odd: raw first; even: raw last */
            if (raw_now) {
                for (int k = 0; k < 2; k++) {
                    int which = k == 0 ? RAW_ONE : kind == RAW_ONE ? RAW_BUCKETS : kind;
                    settle(raw);
                    double t0 = MPI_Wtime();
                    raw_sync(which, buf, nf, raw);
                    double d = MPI_Wtime() - t0;
                    if (which == RAW_ONE) rawt[RAW_ONE * reps + r] = d;
                    else rawt[which * reps + r] = d;
                }
            } else {
                smp_model_zero_grad(m);    /* a training loop's optimizer.zero_grad(), not timed */
                nosync[r] = timed_step(m); /* passes 1, 3, ...: gradients accumulate, no sync */
                sync[r] = timed_step(m);   /* passes 2, 4, ...: the buckets are all-reduced */
            }
        }
    }
    slower_rank(nosync, reps * (3 + RAW_KINDS));
    for (int r = 0; r < reps; r++) diff[r] = sync[r] - nosync[r];
    /* the diagnostic layouts: only the repetitions that ran them */
    double bk[RAW_KINDS][256];
    int nbk[RAW_KINDS] = {0};
    for (int r = 0; r < reps; r++) {
        int kind = r % RAW_KINDS == RAW_ONE ? RAW_BUCKETS : r % RAW_KINDS;
        if (nbk[kind] < 256) bk[kind][nbk[kind]++] = rawt[kind * reps + r];
    }
    double t_nosync = median(nosync, reps), t_sync = median(sync, reps), t_diff = median(diff, reps);
    double t_raw = median(rawt + RAW_ONE * reps, reps);
    double t_bk = median(bk[RAW_BUCKETS], nbk[RAW_BUCKETS]),
           t_turn = median(bk[RAW_BUCKETS_IN_TURN], nbk[RAW_BUCKETS_IN_TURN]);
    double sync_t = t_sync - t_nosync;
    if (rank == 0) {
        printf("(1) gradient sync of %d MiB f32, %d ranks, buckets of at most 25 MiB (24+24+16), %d repetitions, "
               "medians\n",
               (int)(nf * 4 >> 20), smp_dp_size(), reps);
        printf("| %-52s | %10s |\n", "measure", "ms");
        printf("|%s|%s|\n", "------------------------------------------------------", "-----------:");
        printf("| %-52s | %10.2f |\n", "smp step without sync (backward_passes_per_step 2)", t_nosync * 1e3);
        printf("| %-52s | %10.2f |\n", "smp step with sync", t_sync * 1e3);
        printf("| %-52s | %10.2f |\n", "smp sync = with - without", sync_t * 1e3);
        printf("| %-52s | %10.2f |\n", "  (median of per-repetition differences)", t_diff * 1e3);
        printf("| %-52s | %10.2f |\n", "raw MPI_Allreduce, one 64 MiB buffer", t_raw * 1e3);
        printf("| %-52s | %10.2f |\n", "raw MPI, smp's 3 buckets started together", t_bk * 1e3);
        printf("| %-52s | %10.2f |\n", "raw MPI, smp's 3 buckets one after another", t_turn * 1e3);
        printf("| %-52s | %10.3f |\n", "ratio smp sync / raw 64 MiB", sync_t / t_raw);
        printf("| %-52s | %10.3f |\n", "ratio smp sync / raw 3 buckets one after another", sync_t / t_turn);
        printf("\n");
        fflush(stdout);
    }
    free(nosync);
    free(buf);
    MPI_Comm_free(&raw);
    stop(m);
    *sync_out = sync_t;
    return sync_t / t_raw;
}

/* ---------------------------------------------------------------- (2) overlap */
enum { PAIRS = 2 };

static void part2(int rounds, double sync1, int rank) {
    static const bwd_kind kinds[] = {BWD_SLEEP, BWD_POLL_CALL, BWD_POLL_1MS};
    enum { NK = (int)(sizeof kinds / sizeof kinds[0]) };
    int per = rounds * PAIRS; /* samples per (variant, overlap, sync) */
    double *t = (double *)calloc((size_t)NK * 2 * 2 * (size_t)per, sizeof(double)); /* [kind][overlap][sync][sample] */
#define T(k, o, s, i) t[(((size_t)(k) * 2 + (size_t)(o)) * 2 + (size_t)(s)) * (size_t)per + (size_t)(i)]
    long pokes[NK] = {0};
    for (int r = 0; r < rounds; r++)
        for (int b = 0; b < 2; b++) {
            int overlap = (b + r) % 2; /* which setting goes first flips every round */
            net n;
            smp_model *m = start(&n, overlap == 1);
            for (int k = 0; k < NK; k++) {
                g_bwd = kinds[k];
                long p0 = g_pokes;
                for (int p = 0; p < PAIRS; p++) {
                    smp_model_zero_grad(m);
                    T(k, overlap, 0, r * PAIRS + p) = timed_step(m);
                    T(k, overlap, 1, r * PAIRS + p) = timed_step(m);
                }
                pokes[k] += g_pokes - p0;
                g_bwd = BWD_FREE;
            }
            stop(m);
        }
    slower_rank(t, NK * 2 * 2 * per);
    if (rank == 0) {
        printf("(2) backward of %d x %.0f ms, overlapping_allreduce on vs off, %d samples each, medians (ms)\n", NMOD,
               BWD_MS, per);
        printf("| %-10s | %9s | %9s | %9s | %12s | %12s | %8s | %10s |\n", "backward", "no sync", "sync off", "sync on",
               "exposed off", "exposed on", "hidden", "pokes/step");
        printf("|------------|----------:|----------:|----------:|-------------:|-------------:|---------:|-----------:"
               "|\n");
        for (int k = 0; k < NK; k++) {
            double ns[2 * 256];
            int nn = 0;
            for (int o = 0; o < 2; o++)
                for (int i = 0; i < per && nn < 512; i++) ns[nn++] = T(k, o, 0, i);
            double t_ns = median(ns, nn), t_off = median(&T(k, 0, 1, 0), per), t_on = median(&T(k, 1, 1, 0), per);
            double exp_off = t_off - t_ns, exp_on = t_on - t_ns, hidden = (t_off - t_on) / exp_off;
            printf("| %-10s | %9.2f | %9.2f | %9.2f | %12.2f | %12.2f | %7.0f%% | %10.1f |\n", bwd_name[kinds[k]],
                   t_ns * 1e3, t_off * 1e3, t_on * 1e3, exp_off * 1e3, exp_on * 1e3, hidden * 100,
                   (double)pokes[k] / (2.0 * rounds * 2 * PAIRS));
        }
        printf(
            "hidden = (sync off - sync on) / exposed off; exposed = sync step - no-sync step; sync from (1): %.2f ms\n",
            sync1 * 1e3);
        printf(
            "best possible here: the last bucket (16 of 64 MiB) starts when backward ends, so about 75%% can hide\n\n");
        fflush(stdout);
    }
#undef T
    free(t);
}

int main(int argc, char **argv) {
    const char *ap = getenv("MPIR_CVAR_ASYNC_PROGRESS");
    bool async = ap && atoi(ap) != 0;
    int provided = 0;
    MPI_Init_thread(&argc, &argv, async ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED, &provided);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_dup(MPI_COMM_WORLD, &g_poke);
    int reps = argc > 1 ? atoi(argv[1]) : 31, rounds = argc > 2 ? atoi(argv[2]) : 8;
    if (reps < 3) reps = 3;
    if (reps > 255) reps = 255;
    if (rounds < 0) rounds = 0; /* 0: part (1) only */
    if (rounds > 128) rounds = 128;
    for (int i = 0; i < WIDTH; i++) g_x[i] = 0.125f * (float)(i + 1);
    if (rank == 0) {
        printf("bench/ddp: %d ranks, ddp on, partitions 1, microbatches 1, %d modules x %d MiB f32 parameters", size,
               NMOD, (int)(PARAM_FLOATS * 4 >> 20));
        printf("%s\n\n", async ? (provided == MPI_THREAD_MULTIPLE ? ", MPICH async progress thread"
                                                                  : ", async progress asked, thread level too low")
                               : "");
        if (size != 2) printf("note: meant for 2 ranks\n");
        fflush(stdout);
    }
    double t0 = MPI_Wtime(), sync1 = 0;
    double ratio = part1(reps, &sync1, rank);
    if (rounds) part2(rounds, sync1, rank);
    if (rank == 0) {
        printf("wall time %.1f s\n", MPI_Wtime() - t0);
        printf("ddp sync smp/mpi time ratio: %.2f\n", ratio);
    }
    MPI_Comm_free(&g_poke);
    MPI_Finalize();
    return 0;
}
