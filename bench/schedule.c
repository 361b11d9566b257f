/* bench/schedule.c - the pipeline executor against its own simulator.

   A chain of N identical modules whose forward sleeps F ms and whose
   backward sleeps 2F ms per microbatch (per-microbatch times are FIXED: a
   step with more microbatches does proportionally more work). Sleeping,
   not computing, makes the result independent of how many cores the ranks
   share. The chain is placed by hand (auto_partition off) so every stage
   costs the same:
       simple, interleaved   one stage per rank       (0,0,0,0,1,1,1,1 on 2 ranks)
       interleaved, 2 vs     two virtual stages/rank  (0,0,1,1,0,0,1,1 on 2 ranks,
                                                       0,1,2,3,0,1,2,3 on 4)
       zero_bubble           one stage per rank, ZB-H1   (as 1F1B's placement)
       zero_bubble, 2 vs     two virtual stages/rank     (as interleaved 2 vs)
       zero_bubble_v         two stages/rank in a V, ZB-V (0,0,1,1,1,1,0,0 on 2
                                                       ranks, 0,1,2,3,3,2,1,0 on 4)
   for m = 4, 8, 16 microbatches. N = 8 on 2 and 4 ranks (2R * ceil(8/2R)
   in general). In the zero_bubble configurations (both kinds) every module's backward
   is split (smp_module_set_backward_split): its input half (B) sleeps F ms
   and passes the gradient on, its weight half (W) sleeps F ms, the same
   2F ms as the whole backward the other kinds run; so F = B = W, ZB-H1's
   case.

   Per configuration it reports
     measured   median over the timed steps of one smp_step (barrier before;
                the slowest rank's time), after warm-up steps;
     simulated  smp_schedule_simulate's makespan for the schedule the executor
                runs (same builder, same stage map), each stage's forward,
                backward (B: the whole backward outside zero_bubble) and
                weight half (W, zero_bubble) costing the median of what its
                module callbacks measured (a sleep overshoots its nominal
                time by ~0.1 ms, more on a loaded machine; the simulator
                gets what the modules really took), with the transport's
                latency (the best MPI half round trip of one activation
                message);
     ideal      total work / ranks (no bubble);
     sim/meas   simulated / measured: 1.00 means the executor runs the
                schedule as fast as the simulator says it can; the issue's
                target is >= 0.95 everywhere;
     bubble     the simulator's idle fraction;
     replayed   the same schedule replayed with every operation's own measured
                duration (a noisy neighbour that stretches one sleep is in
                it), by the simulator's rules; it equals smp_schedule_simulate
                when all operations of a stage cost the same (checked every
                run); rep/meas is the median over steps of replayed / measured
                per step: the executor's own overhead, machine noise removed.

   Build: mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. -Itest bench/schedule.c -o build/bench/schedule -lm
   Run:   mpirun -n 2 build/bench/schedule      mpirun -n 4 build/bench/schedule
          (make bench-schedule runs both)
   Options: --f-ms X (forward sleep per module, default 5), --steps N (timed
            steps, default 7), --warmup N (default 2), --only TEXT (run the
            configurations whose name contains TEXT, e.g. "interleaved 2vs m=8"),
            --timeline PREFIX (each configuration writes its timeline to
            PREFIX<name>.json, spaces and '=' as '_', e.g.
            PREFIXinterleaved_m_8.json), --table (print the bubble table
            below; on by default with 2 ranks and no --only).
   Timeline: SMP_TIMELINE=/tmp/timeline.json mpirun -n 2 build/bench/schedule --only "2vs m=8"
            writes the Chrome trace of the last configuration run, all its
            steps (smp_model_free writes it); bench/plot_timeline.py draws
            one step of it. --timeline writes one per configuration.

   Bubble table (--table; the 2-rank run of make bench-schedule prints it):
   the simulator alone, no execution: the bubble fraction of simple,
   interleaved (1F1B) and zero_bubble (ZB-H1) for p = 2, 4, 8 stages (one
   per rank) and m = 4, 8, 16 microbatches at F = B = W = 1 (the other
   kinds' backward costs B + W = 2) and no latency, with ZB-H1's makespan
   beside the paper's m(F+B+W) + (p-1)(F+B-W) (which assumes m >= p); and
   zero_bubble_v (ZB-V) on the same work cut in 2p stages in a V, each
   chunk's F = B = W = 1/2, with its makespan beside
   max(6m + p - 1, 4(m + p) - 2) / 2 (test_schedule.c).

   Before the last two lines, the worst sim/meas of each kind:
       measured/simulated by kind (worst config): simple X.XX, interleaved X.XX, ...
   The last two lines are always
       replay efficiency replayed/measured (worst config): X.XX
       schedule efficiency measured/simulated (worst config): X.XX
   where X.XX is the smallest rep/meas, resp. sim/meas (simulated / measured,
   whatever the label says), over the configurations (zero_bubble's
   included): <= 1 up to noise, 1.00 when the executor matches the
   simulator. */
#define _POSIX_C_SOURCE 200809L
#define SMP_TESTING /* smp_model_call_stage: the call-to-stage map is test-only introspection */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { ROWS = 2, WIDTH = 64, MAX_CALLS = 64, MAX_STEPS = 32, MAX_MB = 16 };

/* ---------------------------------------------------------------- time */
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Sleeps until an absolute deadline, so an interrupted sleep resumes. */
static void sleep_s(double seconds) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long ns = (long long)ts.tv_nsec + (long long)(seconds * 1e9);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of v[0..n), n <= MAX_STEPS * MAX_MB; v is left as it was. */
static double median(const double *v, int n) {
    static double s[MAX_STEPS * MAX_MB];
    memcpy(s, v, sizeof(double) * (size_t)n);
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

/* ---------------------------------------------------------------- the model */
static double g_fwd_s;  /* forward sleep per module and microbatch */
static int g_step = -1; /* timed step being run, -1: warm-up (not recorded) */
/* how long each callback took: [timed step][0 forward, 1 backward (whole, or
   the input half B), 2 weight half W][call][microbatch]; a call runs on one
   rank, the others keep zeros */
enum { KINDS = 3 };
static double g_op[MAX_STEPS][KINDS][MAX_CALLS][MAX_MB];

typedef struct { int call; } sleeper;

static smp_status sleep_forward(smp_call_ctx *c) {
    double t0 = now_s();
    const sleeper *s = (const sleeper *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, x->dtype, x->ndim, x->shape);
    memcpy(y->data, x->data, smp_tensor_nbytes(x));
    sleep_s(g_fwd_s);
    if (g_step >= 0 && !smp_is_tracing()) g_op[g_step][0][s->call][smp_call_microbatch(c)] = now_s() - t0;
    return SMP_OK;
}

static smp_status sleep_backward(smp_call_ctx *c) {
    double t0 = now_s();
    const sleeper *s = (const sleeper *)smp_module_user(smp_call_module(c));
    const smp_tensor *gy = smp_call_grad_output(c, 0);
    smp_tensor *gx = smp_call_grad_input(c, 0);
    if (gx) memcpy(gx->data, gy->data, smp_tensor_nbytes(gy));
    sleep_s(2.0 * g_fwd_s);
    if (g_step >= 0) g_op[g_step][1][s->call][smp_call_microbatch(c)] = now_s() - t0;
    return SMP_OK;
}

/* The split backward (zero_bubble): B passes the gradient on and sleeps F,
   W sleeps F (it would add x^T dy into the weight gradient). */
static smp_status sleep_backward_input(smp_call_ctx *c) {
    double t0 = now_s();
    const sleeper *s = (const sleeper *)smp_module_user(smp_call_module(c));
    const smp_tensor *gy = smp_call_grad_output(c, 0);
    smp_tensor *gx = smp_call_grad_input(c, 0);
    if (gx) memcpy(gx->data, gy->data, smp_tensor_nbytes(gy));
    sleep_s(g_fwd_s);
    if (g_step >= 0) g_op[g_step][1][s->call][smp_call_microbatch(c)] = now_s() - t0;
    return SMP_OK;
}

static smp_status sleep_backward_weight(smp_call_ctx *c) {
    double t0 = now_s();
    const sleeper *s = (const sleeper *)smp_module_user(smp_call_module(c));
    if (!smp_call_grad_output(c, 0)) return SMP_ERR_STATE; /* smp keeps it until W ran */
    sleep_s(g_fwd_s);
    if (g_step >= 0) g_op[g_step][2][s->call][smp_call_microbatch(c)] = now_s() - t0;
    return SMP_OK;
}

typedef struct { int ncalls; smp_module *root, *mod[MAX_CALLS]; sleeper st[MAX_CALLS]; } chain;

static smp_status chain_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m; (void)nin; (void)nout;
    chain *ch = (chain *)user;
    smp_tensor cur = in[0], next;
    for (int k = 0; k < ch->ncalls; k++) {
        smp_status st = smp_call(ch->mod[k], &cur, 1, &next, 1);
        if (st) return st;
        cur = next;
    }
    out[0] = cur;
    return SMP_OK;
}

/* The mean of the model output is the loss; its gradient is uniform. */
SMP_STEP_BODY(mean_body) {
    const smp_tensor *y = smp_mb_output(mb, 0);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    int64_t n = smp_tensor_numel(y);
    double acc = 0;
    for (int64_t i = 0; i < n; i++) acc += ((const float *)y->data)[i];
    if (g)
        for (int64_t i = 0; i < n; i++) ((float *)g->data)[i] = 1.0f / (float)n;
    return smp_mb_return_f32(mb, 0, (float)(acc / (double)n));
}

/* placement[k]: partition of call k; split: every module's backward in halves */
static smp_model *chain_build(chain *ch, int ncalls, const int *placement, bool split) {
    memset(ch, 0, sizeof *ch);
    ch->ncalls = ncalls;
    ch->root = smp_module_new(NULL, "", NULL);
    for (int k = 0; k < ncalls; k++) {
        char name[32];
        snprintf(name, sizeof name, "layer%d", k);
        ch->st[k].call = k;
        smp_module_desc d = {sleep_forward, split ? NULL : sleep_backward, &ch->st[k]};
        SMP_PARTITION(placement[k]) { ch->mod[k] = smp_module_new(ch->root, name, &d); }
        if (split) smp_module_set_backward_split(ch->mod[k], sleep_backward_input, sleep_backward_weight);
    }
    smp_model *m = NULL;
    smp_model_desc md = {chain_forward, 1, 1, ch, false};
    return smp_model_new(ch->root, &md, &m) ? NULL : m;
}

/* ---------------------------------------------------------------- replay */
/* The makespan of schedule sc when operation (kind, stage, microbatch)
   costs cost[(kind * S + stage) * m + microbatch] (kind 0 F, 1 B, 2 W): the
   simulator's rules (each rank runs its list in order; an operation starts
   when its rank is free and its dependency has finished, plus latency
   across ranks; W(s, i) follows B(s, i)) with a cost per operation instead
   of per stage. */
static double replay(const smp_schedule *sc, const double *cost, double latency) {
    int R = sc->nranks, S = sc->nstages, m = sc->microbatches;
    static double fin[KINDS * MAX_CALLS * MAX_MB];
    static char done[KINDS * MAX_CALLS * MAX_MB];
    int idx[MAX_CALLS] = {0};
    double clock[MAX_CALLS] = {0}, makespan = 0;
    memset(done, 0, sizeof done);
    for (bool moved = true; moved;) {
        moved = false;
        for (int r = 0; r < R; r++)
            for (; idx[r] < sc->nops[r]; idx[r]++) {
                smp_sched_op op = sc->ops[r][idx[r]];
                int k = op.kind == SMP_SCHED_FORWARD    ? 0
                        : op.kind == SMP_SCHED_BACKWARD ? 1
                                                        : 2,
                    s = op.stage, i = op.microbatch;
                int dk = k, ds = k == 0 ? s - 1 : s + 1;
                if (k == 1 && s == S - 1) { dk = 0; ds = s; } /* the loss follows the last forward */
                if (k == 2) { dk = 1; ds = s; }               /* W follows its B */
                double start = clock[r];
                if (ds >= 0 && ds < S) {
                    int d = (dk * S + ds) * m + i;
                    if (!done[d]) break;
                    double ready = fin[d] + (sc->stage_rank[ds] != r ? latency : 0.0);
                    if (ready > start) start = ready;
                }
                int me = (k * S + s) * m + i;
                fin[me] = clock[r] = start + cost[me];
                done[me] = 1;
                if (fin[me] > makespan) makespan = fin[me];
                moved = true;
            }
    }
    for (int r = 0; r < R; r++)
        if (idx[r] < sc->nops[r]) {
            fprintf(stderr, "bench/schedule: the replay got stuck on rank %d\n", r);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    return makespan;
}

/* ---------------------------------------------------------------- one configuration */
typedef struct {
    char name[64];
    double measured, lo, hi, simulated, ideal, bubble, ratio, replayed, replay_ratio;
    double fwd_call, bwd_call, wgt_call; /* median callback durations (s); bwd: B only in zero_bubble */
    smp_pipeline_kind kind;
    int vstages, m;
    int peak; /* the simulator's most microbatches in flight on one rank (summed over its stages) */
} result;

static const char *kind_name(smp_pipeline_kind kind) {
    return kind == SMP_PIPELINE_SIMPLE          ? "simple"
           : kind == SMP_PIPELINE_ZERO_BUBBLE   ? "zero_bubble"
           : kind == SMP_PIPELINE_ZERO_BUBBLE_V ? "zero_bubble_v"
                                                : "interleaved";
}
static bool split_kind(smp_pipeline_kind kind) {
    return kind == SMP_PIPELINE_ZERO_BUBBLE || kind == SMP_PIPELINE_ZERO_BUBBLE_V;
}

static void die(const char *what) {
    fprintf(stderr, "bench/schedule: %s: %s\n", what, smp_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static bool run_config(int R, int m, smp_pipeline_kind kind, int vstages, int warmup, int steps, double latency,
                       const char *only, const char *timeline, result *res) {
    int per = 2 * R, ncalls = per * ((8 + per - 1) / per);
    bool zb = kind == SMP_PIPELINE_ZERO_BUBBLE || kind == SMP_PIPELINE_ZERO_BUBBLE_V,
         vee = kind == SMP_PIPELINE_ZERO_BUBBLE_V;
    if (vee) vstages = 2; /* ZB-V: two stages per rank, always */
    snprintf(res->name, sizeof res->name, "%s%s m=%d", kind_name(kind), vstages > 1 && !vee ? " 2vs" : "", m);
    if (only && !strstr(res->name, only)) return false;
    res->kind = kind;
    res->vstages = vstages;
    res->m = m;
    if (timeline) { /* read when the executor is built and when smp_model_free writes it */
        char path[4096];
        int n = snprintf(path, sizeof path, "%s%s.json", timeline, res->name);
        for (char *p = path + strlen(timeline); p < path + n; p++)
            if (*p == ' ' || *p == '=') *p = '_';
        setenv("SMP_TIMELINE", path, 1);
    }

    /* equal stages: ncalls / (R * vstages) consecutive calls each, stage q on rank q % R (ZB-V: in a V) */
    int placement[MAX_CALLS], nst = R * vstages, run = ncalls / nst;
    for (int k = 0; k < ncalls; k++) {
        int q = k / run;
        placement[k] = vee ? (q < R ? q : 2 * R - 1 - q) : q % R;
    }

    smp_config cfg = {0};
    cfg.partitions = R;
    cfg.microbatches = m;
    cfg.pipeline = kind;
    cfg.auto_partition = SMP_OFF;
    cfg.ddp = SMP_OFF;
    if (smp_init(&cfg)) die("smp_init");
    chain ch;
    smp_model *model = chain_build(&ch, ncalls, placement, zb);
    if (!model) die("building the chain");

    static float x[MAX_MB * ROWS * WIDTH];
    int64_t batch = (int64_t)m * ROWS;
    for (int64_t i = 0; i < batch * WIDTH; i++) x[i] = (float)(i % 7) * 0.25f;
    smp_tensor xt = smp_tensor_2d(x, SMP_F32, batch, WIDTH);

    /* Trace first, then line the ranks up: the first step builds the
       executor, and with SMP_TIMELINE every rank's event clock starts there. */
    if (smp_model_trace(model, &xt, 1)) die("tracing");
    MPI_Barrier(MPI_COMM_WORLD);

    memset(g_op, 0, sizeof g_op);
    double t[MAX_STEPS];
    for (int it = 0; it < warmup + steps; it++) {
        smp_step_output loss = {0};
        g_step = it >= warmup ? it - warmup : -1;
        smp_model_zero_grad(model);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now_s();
        smp_status st = SMP_TRAIN_STEP(model, mean_body, NULL, &loss, 1, xt);
        double dt = now_s() - t0;
        if (st) die("smp_step");
        smp_step_output_free(&loss);
        double slowest;
        MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (it >= warmup) t[it - warmup] = slowest;
    }
    g_step = -1;
    static double all[MAX_STEPS][KINDS][MAX_CALLS][MAX_MB];
    MPI_Allreduce(g_op, all, steps * KINDS * MAX_CALLS * MAX_MB, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);

    /* the executor's stage map and schedule */
    int S = smp_model_num_stages(model), stage_rank[MAX_CALLS];
    if (S != nst) {
        fprintf(stderr, "bench/schedule: expected %d stages, the model has %d\n", nst, S);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int s = 0; s < S; s++) stage_rank[s] = smp_model_stage_rank(model, s);
    smp_schedule sc;
    if (smp_schedule_build(kind, R, S, stage_rank, m, false, &sc)) die("smp_schedule_build");

    /* what each operation of each timed step took: its stage's calls summed */
    static double opcost[MAX_STEPS][KINDS * MAX_CALLS * MAX_MB];
    memset(opcost, 0, sizeof opcost);
    for (int k = 0; k < steps; k++)
        for (int d = 0; d < KINDS; d++)
            for (int c = 0; c < ncalls; c++)
                for (int i = 0; i < m; i++)
                    opcost[k][(d * S + smp_model_call_stage(model, c)) * m + i] += all[k][d][c][i];

    /* the simulator, on each stage's median forward, backward (B) and weight half (W; 0 outside zero_bubble) */
    static double v[MAX_STEPS * MAX_MB];
    double cost[KINDS][MAX_CALLS];
    static double flat[KINDS * MAX_CALLS * MAX_MB];
    for (int d = 0; d < KINDS; d++)
        for (int s = 0; s < S; s++) {
            for (int k = 0; k < steps; k++)
                for (int i = 0; i < m; i++) v[k * m + i] = opcost[k][(d * S + s) * m + i];
            double med = median(v, steps * m);
            cost[d][s] = med;
            for (int i = 0; i < m; i++) flat[(d * S + s) * m + i] = med;
        }
    for (int d = 0; d < KINDS; d++)
        for (int c = 0; c < ncalls; c++) {
            for (int k = 0; k < steps; k++)
                for (int i = 0; i < m; i++) v[k * m + i] = all[k][d][c][i];
            double med = median(v, steps * m) / ncalls;
            *(d == 0 ? &res->fwd_call : d == 1 ? &res->bwd_call : &res->wgt_call) += med;
        }
    smp_sim_result sim;
    if (smp_schedule_simulate(&sc, cost[0], cost[1], cost[2], latency, &sim)) die("smp_schedule_simulate");
    if (sim.deadlock) {
        fprintf(stderr, "bench/schedule: simulator deadlock: %s\n", sim.deadlock_reason);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    /* the replay must agree with the simulator where costs are per stage */
    double check = replay(&sc, flat, latency);
    if (fabs(check - sim.makespan) > 1e-9 * sim.makespan) {
        fprintf(stderr, "bench/schedule: replay %.9f s and simulator %.9f s disagree\n", check, sim.makespan);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    double rep[MAX_STEPS], rr[MAX_STEPS];
    for (int k = 0; k < steps; k++) {
        rep[k] = replay(&sc, opcost[k], latency);
        rr[k] = rep[k] / t[k];
    }
    res->measured = median(t, steps);
    res->lo = res->hi = t[0];
    for (int i = 1; i < steps; i++) { if (t[i] < res->lo) res->lo = t[i]; if (t[i] > res->hi) res->hi = t[i]; }
    for (int r = 0; r < R; r++)
        if (sim.rank_peak_inflight[r] > res->peak) res->peak = sim.rank_peak_inflight[r];
    res->simulated = sim.makespan;
    res->ideal = sim.ideal;
    res->bubble = sim.bubble_fraction;
    res->ratio = sim.makespan / res->measured;
    res->replayed = median(rep, steps);
    res->replay_ratio = median(rr, steps);
    smp_sim_result_free(&sim);
    smp_schedule_free(&sc);

    smp_model_free(model); /* with SMP_TIMELINE set, this writes the timeline (collective) */
    smp_finalize();
    return true;
}

/* Each rank sleeps alone (no MPI): what a module's sleep costs here and now. */
static void calibrate(double *fwd, double *bwd) {
    double f[15], b[15], mine[2], sum[2];
    for (int i = 0; i < 15; i++) {
        double t0 = now_s();
        sleep_s(g_fwd_s);
        f[i] = now_s() - t0;
        t0 = now_s();
        sleep_s(2 * g_fwd_s);
        b[i] = now_s() - t0;
    }
    mine[0] = median(f, 15);
    mine[1] = median(b, 15);
    int n;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    MPI_Allreduce(mine, sum, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    *fwd = sum[0] / n;
    *bwd = sum[1] / n;
}

/* Half the round trip of one activation message (header + data, as the
   executor sends them) between ranks 0 and 1: the shortest of many, i.e.
   the transport's own latency without scheduling delays (on a loaded
   machine with fewer cores than ranks the median is mostly the time the
   peer waits for a core). The other ranks wait asleep meanwhile. */
static double measure_latency(void) {
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    int64_t hdr[10] = {0};
    float data[ROWS * WIDTH] = {0};
    enum { N = 301 };
    double rt[N];
    if (rank == 0) {
        for (int i = 0; i < N; i++) {
            double t0 = now_s();
            MPI_Send(hdr, 10, MPI_INT64_T, 1, 0, MPI_COMM_WORLD);
            MPI_Send(data, ROWS * WIDTH, MPI_FLOAT, 1, 1, MPI_COMM_WORLD);
            MPI_Recv(hdr, 10, MPI_INT64_T, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Recv(data, ROWS * WIDTH, MPI_FLOAT, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            rt[i] = (now_s() - t0) / 2;
        }
    } else if (rank == 1) {
        for (int i = 0; i < N; i++) {
            MPI_Recv(hdr, 10, MPI_INT64_T, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Recv(data, ROWS * WIDTH, MPI_FLOAT, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Send(hdr, 10, MPI_INT64_T, 0, 0, MPI_COMM_WORLD);
            MPI_Send(data, ROWS * WIDTH, MPI_FLOAT, 0, 1, MPI_COMM_WORLD);
        }
    }
    MPI_Request req;
    MPI_Ibarrier(MPI_COMM_WORLD, &req);
    for (int done = 0; !done;) {
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (!done) sleep_s(2e-4);
    }
    double half = 0;
    if (rank == 0) {
        qsort(rt, (size_t)N, sizeof *rt, cmp_double);
        half = rt[0];
    }
    MPI_Bcast(&half, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    return half;
}

/* The simulator alone: bubble fraction of each kind at F = B = W = 1, one
   stage per rank, no latency (the other kinds' backward costs B + W = 2);
   ZB-V on the same work in 2p half-size stages (F = B = W = 1/2 each). */
static void bubble_table(void) {
    static const int ps[3] = {2, 4, 8}, ms[3] = {4, 8, 16};
    static const smp_pipeline_kind kinds[4] = {SMP_PIPELINE_SIMPLE, SMP_PIPELINE_INTERLEAVED, SMP_PIPELINE_ZERO_BUBBLE,
                                               SMP_PIPELINE_ZERO_BUBBLE_V};
    double one[16], half[16];
    for (int s = 0; s < 16; s++) { one[s] = 1.0; half[s] = 0.5; }
    printf("simulated bubble fraction per kind, F = B = W = 1 (simple and interleaved run B + W = 2 as one backward),\n"
           "p stages on p ranks, no latency; ZB-H1 formula m(F+B+W) + (p-1)(F+B-W) = 3m + p - 1 (paper: m >= p); "
           "zero_bubble_v\n"
           "(ZB-V) on the same work in 2p stages of half the size placed in a V (F = B = W = 1/2 each), formula\n"
           "max(6m + p - 1, 4(m + p) - 2) / 2; idle = p x makespan - work, against 1F1B's; peak = the most "
           "microbatches in flight\n"
           "on a rank, in whole stages' activations (ZB-V: its half-size chunks / 2)\n\n"
           "| p |  m | simple | 1F1B  | ZB-H1 | ZB-V  | 1F1B makespan | ZB-H1 makespan | ZB-H1 formula | ZB-V makespan "
           "| ZB-V formula | idle ZB-H1/1F1B | idle ZB-V/1F1B | peak 1F1B / H1 / V |\n"
           "|--:|---:|-------:|------:|------:|------:|--------------:|---------------:|--------------:|--------------:"
           "|-------------:|----------------:|---------------:|-------------------:|\n");
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            int p = ps[a], m = ms[b];
            smp_sim_result r[4];
            for (int k = 0; k < 4; k++) {
                smp_schedule sc;
                bool vee = kinds[k] == SMP_PIPELINE_ZERO_BUBBLE_V;
                if (smp_schedule_build(kinds[k], p, vee ? 2 * p : p, NULL, m, false, &sc)) die("smp_schedule_build");
                if (smp_schedule_simulate(&sc, vee ? half : one, vee ? half : one, vee ? half : one, 0.0, &r[k]))
                    die("smp_schedule_simulate");
                if (r[k].deadlock) {
                    fprintf(stderr, "bench/schedule: simulator deadlock: %s\n", r[k].deadlock_reason);
                    MPI_Abort(MPI_COMM_WORLD, 1);
                }
                smp_schedule_free(&sc);
            }
            double formula = 3.0 * m + (p - 1), fv1 = 6.0 * m + p - 1, fv2 = 4.0 * (m + p) - 2,
                   fv = (fv1 > fv2 ? fv1 : fv2) / 2;
            double idle1 = p * r[1].makespan - r[1].busy, idlez = p * r[2].makespan - r[2].busy,
                   idlev = p * r[3].makespan - r[3].busy;
            int pk[4] = {0, 0, 0, 0};
            for (int k = 1; k < 4; k++)
                for (int q = 0; q < p; q++)
                    if (r[k].rank_peak_inflight[q] > pk[k]) pk[k] = r[k].rank_peak_inflight[q];
            char fs[32], pks[32];
            snprintf(fs, sizeof fs, "%s%.0f", m < p ? "(m < p) " : "", formula);
            snprintf(pks, sizeof pks, "%d / %d / %g", pk[1], pk[2], pk[3] / 2.0);
            printf("| %d | %2d | %6.3f | %5.3f | %5.3f | %5.3f | %13.0f | %14.0f | %13s | %13.1f | %12.1f | %15.3f | "
                   "%14.3f | %18s |\n",
                   p, m, r[0].bubble_fraction, r[1].bubble_fraction, r[2].bubble_fraction, r[3].bubble_fraction,
                   r[1].makespan, r[2].makespan, fs, r[3].makespan, fv, idle1 > 0 ? idlez / idle1 : 0.0,
                   idle1 > 0 ? idlev / idle1 : 0.0, pks);
            for (int k = 0; k < 4; k++) smp_sim_result_free(&r[k]);
        }
    printf("\n");
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, R;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &R);
    double f_ms = 5.0;
    int steps = 7, warmup = 2;
    const char *only = NULL, *timeline = NULL;
    bool table = false;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--f-ms") && a + 1 < argc) f_ms = atof(argv[++a]);
        else if (!strcmp(argv[a], "--steps") && a + 1 < argc) steps = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--warmup") && a + 1 < argc) warmup = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--only") && a + 1 < argc) only = argv[++a];
        else if (!strcmp(argv[a], "--timeline") && a + 1 < argc) timeline = argv[++a];
        else if (!strcmp(argv[a], "--table")) table = true;
        else {
            if (rank == 0)
                fprintf(stderr,
                        "usage: %s [--f-ms X] [--steps N] [--warmup N] [--only TEXT] [--timeline PREFIX] [--table]\n",
                        argv[0]);
            MPI_Finalize();
            return 2;
        }
    }
    if (R < 2 || 2 * R > MAX_CALLS || f_ms <= 0 || steps < 1 || steps > MAX_STEPS || warmup < 0) {
        if (rank == 0)
            fprintf(stderr, "bench/schedule: needs 2..%d ranks, --f-ms > 0, 1..%d steps, warmup >= 0\n", MAX_CALLS / 2,
                    MAX_STEPS);
        MPI_Finalize();
        return 2;
    }
    g_fwd_s = f_ms * 1e-3;
    double latency = measure_latency(), cal_f, cal_b;
    calibrate(&cal_f, &cal_b);
    int per = 2 * R, ncalls = per * ((8 + per - 1) / per);

    if (R == 2 && !only) table = true;
    if (table && rank == 0) bubble_table();

    enum { NKINDS = 6 };
    static const int ms[3] = {4, 8, 16};
    static const struct { smp_pipeline_kind kind; int vs; } kinds[NKINDS] = {
        {SMP_PIPELINE_SIMPLE, 1}, {SMP_PIPELINE_INTERLEAVED, 1}, {SMP_PIPELINE_INTERLEAVED, 2},
        {SMP_PIPELINE_ZERO_BUBBLE, 1}, {SMP_PIPELINE_ZERO_BUBBLE, 2}, {SMP_PIPELINE_ZERO_BUBBLE_V, 2}};
    result res[NKINDS * 3];
    memset(res, 0, sizeof res);
    int nres = 0;
    for (int k = 0; k < NKINDS; k++)
        for (int j = 0; j < 3; j++)
            if (run_config(R, ms[j], kinds[k].kind, kinds[k].vs, warmup, steps, latency, only, timeline, &res[nres]))
                nres++;

    if (rank == 0) {
        double worst = 1e300, worst_replay = 1e300, fcall = 0, bcall = 0, bcall_zb = 0, wcall_zb = 0;
        int nwhole = 0, nsplit = 0;
        for (int i = 0; i < nres; i++) {
            if (split_kind(res[i].kind)) nsplit++;
            else nwhole++;
        }
        printf("pipeline schedules, %d ranks: a chain of %d modules sleeping %.3g ms forward, %.3g ms backward per "
               "microbatch\n"
               "(fixed per microbatch; zero_bubble, zero_bubble_v: B %.3g ms + W %.3g ms), placed by hand in equal "
               "stages; comm latency %.1f us\n"
               "(best MPI half round trip)\n\n",
               R, ncalls, f_ms, 2 * f_ms, f_ms, f_ms, latency * 1e6);
        printf(
            "measured   median of %d steps after %d warm-up (time of the slowest rank; min-max beside it)\n"
            "simulated  smp_schedule_simulate, each stage's forward, backward (zero_bubble*: B and W apart) costing\n"
            "           the median of what its modules measured (all timed steps and microbatches)\n"
            "ideal      total work / ranks (no bubble); bubble: the simulator's idle fraction\n"
            "sim/meas   simulated / measured (1.00: the executor runs as fast as the simulator says it can)\n"
            "replayed   the same schedule replayed with every operation's own measured duration (machine noise\n"
            "           included), median over steps; rep/meas: median of replayed / measured per step\n\n",
            steps, warmup);
        printf("| ranks | config                  | measured ms | min-max ms    | simulated ms | ideal ms | sim/meas | "
               "bubble | replayed ms | rep/meas |\n");
        printf("|------:|-------------------------|------------:|---------------|-------------:|---------:|---------:|-"
               "------:|------------:|---------:|\n");
        for (int i = 0; i < nres; i++) {
            result *r = &res[i];
            char range[32];
            snprintf(range, sizeof range, "%.1f-%.1f", r->lo * 1e3, r->hi * 1e3);
            printf("| %5d | %-23s | %11.1f | %-13s | %12.1f | %8.1f | %8.3f | %6.3f | %11.1f | %8.3f |\n", R, r->name,
                   r->measured * 1e3, range, r->simulated * 1e3, r->ideal * 1e3, r->ratio, r->bubble, r->replayed * 1e3,
                   r->replay_ratio);
            if (r->ratio < worst) worst = r->ratio;
            if (r->replay_ratio < worst_replay) worst_replay = r->replay_ratio;
            fcall += r->fwd_call / nres;
            if (split_kind(r->kind)) {
                bcall_zb += r->bwd_call / nsplit;
                wcall_zb += r->wgt_call / nsplit;
            } else {
                bcall += r->bwd_call / nwhole;
            }
        }
        /* zero_bubble against 1F1B on the same stage map and microbatches; zero_bubble_v against 1F1B with one stage
         * per rank */
        bool head = false;
        for (int i = 0; i < nres; i++) {
            const result *z = &res[i], *o = NULL;
            if (!split_kind(z->kind)) continue;
            int vs = z->kind == SMP_PIPELINE_ZERO_BUBBLE_V ? 1 : z->vstages;
            for (int j = 0; j < nres; j++)
                if (res[j].kind == SMP_PIPELINE_INTERLEAVED && res[j].vstages == vs && res[j].m == z->m) o = &res[j];
            if (!o) continue;
            if (!head) {
                printf("\nzero_bubble against interleaved (1F1B) on the same stages and microbatches (zero_bubble_v: "
                       "against 1F1B with\n"
                       "one stage per rank, the same modules): step time (measured), bubble (simulated) and the most "
                       "microbatch-stages\n"
                       "in flight on one rank (simulated; a zero_bubble_v stage holds half of a 1F1B stage's "
                       "activations)\n\n"
                       "| ranks | config                  | 1F1B ms | ZB ms   | ZB/1F1B measured | ZB/1F1B simulated | "
                       "1F1B bubble | ZB bubble | in flight 1F1B / ZB |\n"
                       "|------:|-------------------------|--------:|--------:|-----------------:|------------------:|-"
                       "-----------:|----------:|--------------------:|\n");
                head = true;
            }
            char pk[32];
            snprintf(pk, sizeof pk, "%d / %d", o->peak, z->peak);
            printf("| %5d | %-23s | %7.1f | %7.1f | %16.3f | %17.3f | %11.3f | %9.3f | %19s |\n", R, z->name,
                   o->measured * 1e3, z->measured * 1e3, z->measured / o->measured, z->simulated / o->simulated,
                   o->bubble, z->bubble, pk);
        }
        printf("\nmodule sleeps: %.3f ms forward, %.3f ms backward (median in the steps); %.3f, %.3f alone (nominal "
               "%.3g, %.3g)\n",
               fcall * 1e3, bcall * 1e3, cal_f * 1e3, cal_b * 1e3, f_ms, 2 * f_ms);
        if (nsplit)
            printf("zero_bubble's and zero_bubble_v's split backward: %.3f ms B + %.3f ms W (median in the steps; "
                   "nominal %.3g + %.3g)\n",
                   bcall_zb * 1e3, wcall_zb * 1e3, f_ms, f_ms);
        /* the worst sim/meas of each kind */
        printf("measured/simulated by kind (worst config):");
        bool firstk = true;
        for (int k = 0; k < NKINDS; k++) {
            double w = 1e300;
            for (int i = 0; i < nres; i++)
                if (res[i].kind == kinds[k].kind && res[i].vstages == kinds[k].vs && res[i].ratio < w) w = res[i].ratio;
            if (w > 1e299) continue;
            printf("%s %s%s %.2f", firstk ? "" : ",", kind_name(kinds[k].kind),
                   kinds[k].vs > 1 && kinds[k].kind != SMP_PIPELINE_ZERO_BUBBLE_V ? " 2vs" : "", w);
            firstk = false;
        }
        printf("\n");
        printf("replay efficiency replayed/measured (worst config): %.2f\n", nres ? worst_replay : 0.0);
        printf("schedule efficiency measured/simulated (worst config): %.2f\n", nres ? worst : 0.0);
    }
    MPI_Finalize();
    return 0;
}
