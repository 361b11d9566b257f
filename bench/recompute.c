/* bench/recompute.c - activation recomputation: peak stash and step time,
   with and without, side by side in one run (issue 15).

   Model: 12 composite blocks and a head, on 2 ranks (2 pipeline partitions,
   1F1B, manual placement: blocks 0-5 on partition 0, blocks 6-11 and the
   head on partition 1). Each block is the MLP half of a transformer block,
   twice (no norm, no attention):
       h = x + fc2(gelu(fc1(x)))        fc1: d -> 4d, fc2: 4d -> d
       y = h + fc4(gelu(fc3(h)))        fc3: d -> 4d, fc4: 4d -> d
   written as a composite ("blocks.k") of six leaf calls: fc1 and fc3 are
   linear + GELU in one leaf (output gelu(z), and z stashed with
   smp_call_stash for the backward), fc2 and fc4 plain linears (their
   backward reads their input, which stays alive anyway), and the two
   residual adds are smp_module_new_add. The head is a linear d -> 16 and
   the step body a softmax cross-entropy. Linears are OpenBLAS sgemm on one
   thread per rank.

   Per microbatch of r rows, one block holds for its backward
       outputs  fc1 4d + fc2 d + add1 d + fc3 4d + fc4 d + add2 d = 12d floats/row
       stashes  z of fc1 4d + z of fc3 4d                          =  8d floats/row
   without recomputation, and with it only its inputs and the outputs later
   calls read: the block's output add2, d floats/row (its input is the
   previous block's output, counted there). smp counts call outputs, stashes
   and the gradients it allocates in the backward as stash bytes.

   Two models are built side by side in one smp context: identical (same
   parameter names, hence the same initial weights) except that the second
   calls smp_module_set_recompute on every block. Both are traced, then run
   2 warm-up and 10 timed training steps, taking turns (plain first on even
   steps, recomputed first on odd ones), each step followed by the same SGD
   update on each model. A step's time is the slower rank's wall time of
   SMP_TRAIN_STEP (barrier before). Per model and rank: the largest
   smp_last_step_stats(model).stash_peak_bytes over the timed steps (it is
   the same on every step), gathered to rank 0. Every step's per-microbatch
   losses, and at the end every local parameter, must be bitwise equal
   between the two models; otherwise the bench prints an error and exits 1.

   Build: mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. -Itest bench/recompute.c -o build/bench/recompute -lopenblas -lm
   Run:   mpirun -n 2 build/bench/recompute          (make bench-recompute)
   Options: --d N (width, default 256; hidden 4N), --batch N (default 256),
            --microbatches N (default 8), --steps N (timed, default 10),
            --warmup N (default 2).

   The last two lines are always
       recompute step time ratio: X.XX     (median step with / without)
       recompute peak stash ratio: X.XX    (max over stages of with / without)
   The goal: peak stash ratio <= 0.5 at a step time ratio <= 1.4. */
#define _POSIX_C_SOURCE 200809L
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { NBLK = 12, CLS = 16, MAX_STEPS = 256 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "rank %d: %s: %s\n", smp_is_initialized() ? smp_rank() : -1, what, smp_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* ---------------------------------------------------------------- leaves */
typedef struct lin_state {
    int in, out;
    bool gelu; /* linear + GELU in one leaf: z stashed */
    smp_param *w, *b;
} lin_state;

static long g_lin_fwd; /* linear forwards run by the executor (not while tracing) */

static inline float gelu(float z) { /* tanh approximation */
    const float k = 0.7978845608f; /* sqrt(2 / pi) */
    return 0.5f * z * (1.0f + tanhf(k * (z + 0.044715f * z * z * z)));
}
static inline float gelu_grad(float z) {
    const float k = 0.7978845608f;
    float u = k * (z + 0.044715f * z * z * z), t = tanhf(u);
    return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * z * z);
}

/* y (n x out) = x (n x in) W^T + b, W out x in */
static void linear(const float *x, const float *W, const float *b, float *y, int n, int in, int out) {
    for (int i = 0; i < n; i++) memcpy(y + (size_t)i * out, b, sizeof(float) * (size_t)out);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, W, in, 1.0f, y, out);
}

static smp_status lin_forward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    if (!x || x->ndim != 2 || x->shape[1] != s->in)
        return smp_error(SMP_ERR_MODULE, "%s: wrong input", smp_module_name(smp_call_module(c)));
    int n = (int)x->shape[0];
    int64_t shape[2] = {n, s->out};
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, shape);
    if (!y) return smp_error(SMP_ERR_NOMEM, "%s: no output", smp_module_name(smp_call_module(c)));
    if (!smp_is_tracing()) g_lin_fwd++;
    const float *W = (const float *)smp_param_value(s->w)->data, *b = (const float *)smp_param_value(s->b)->data;
    float *yd = (float *)y->data;
    if (!s->gelu) {
        linear((const float *)x->data, W, b, yd, n, s->in, s->out);
        return SMP_OK;
    }
    size_t ne = (size_t)n * (size_t)s->out;
    float *z = (float *)smp_call_stash(c, sizeof(float) * ne); /* the pre-activation, for the backward */
    if (!z) return smp_error(SMP_ERR_NOMEM, "%s: no stash", smp_module_name(smp_call_module(c)));
    linear((const float *)x->data, W, b, z, n, s->in, s->out);
    for (size_t i = 0; i < ne; i++) yd[i] = gelu(z[i]);
    return SMP_OK;
}

static smp_status lin_backward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    int n = (int)x->shape[0];
    const float *dy = (const float *)smp_call_grad_output(c, 0)->data;
    size_t ne = (size_t)n * (size_t)s->out;
    if (s->gelu) { /* dz = dy * gelu'(z), written over the stashed z */
        size_t bytes = 0;
        float *z = (float *)smp_call_stashed(c, &bytes);
        if (!z || bytes != sizeof(float) * ne)
            return smp_error(SMP_ERR_MODULE, "%s: stash missing in the backward", smp_module_name(smp_call_module(c)));
        for (size_t i = 0; i < ne; i++) z[i] = dy[i] * gelu_grad(z[i]);
        dy = z;
    }
    const float *W = (const float *)smp_param_value(s->w)->data;
    smp_tensor *gx = smp_call_grad_input(c, 0);
    if (gx)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, s->in, s->out, 1.0f, dy, s->out, W, s->in, 0.0f,
                    (float *)gx->data, s->in);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s->out, s->in, n, 1.0f, dy, s->out, (const float *)x->data,
                s->in, 1.0f, (float *)smp_param_grad(s->w)->data, s->in);
    float *db = (float *)smp_param_grad(s->b)->data;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < s->out; j++) db[j] += dy[(size_t)i * s->out + j];
    return SMP_OK;
}

/* ---------------------------------------------------------------- the model */
typedef struct block_t {
    smp_module *fc[4], *add[2];
    lin_state lin[4];
} block_t;

typedef struct net_t {
    smp_module *root, *blk[NBLK], *head;
    block_t b[NBLK];
    lin_state head_lin;
} net_t;

static float g_small_bound; /* init bound of the linears that write into the residual stream */

static smp_module *new_lin(smp_module *parent, const char *name, lin_state *s, int in, int out, bool gelu_on,
                           float *bound) {
    s->in = in;
    s->out = out;
    s->gelu = gelu_on;
    smp_module_desc d = {lin_forward, lin_backward, s};
    smp_module *m = smp_module_new(parent, name, &d);
    int64_t ws[2] = {out, in}, bs[1] = {out};
    s->w = smp_param_new(m, "weight", SMP_F32, 2, ws, smp_init_uniform, bound);
    s->b = smp_param_new(m, "bias", SMP_F32, 1, bs, smp_init_constant, NULL);
    return m;
}

static smp_status block_forward(smp_call_ctx *c) {
    block_t *b = (block_t *)smp_module_user(smp_call_module(c));
    smp_tensor x = *smp_call_input(c, 0), a, o, h, y;
    SMP_TRY(smp_call(b->fc[0], &x, 1, &a, 1));
    SMP_TRY(smp_call(b->fc[1], &a, 1, &o, 1));
    smp_tensor r1[2] = {x, o};
    SMP_TRY(smp_call(b->add[0], r1, 2, &h, 1));
    SMP_TRY(smp_call(b->fc[2], &h, 1, &a, 1));
    SMP_TRY(smp_call(b->fc[3], &a, 1, &o, 1));
    smp_tensor r2[2] = {h, o};
    SMP_TRY(smp_call(b->add[1], r2, 2, &y, 1));
    return smp_call_set_output(c, 0, &y);
}

static void build(net_t *n, int d, bool recompute) {
    memset(n, 0, sizeof *n);
    n->root = smp_module_new(NULL, "", NULL);
    smp_module *blocks = smp_module_new(n->root, "blocks", NULL);
    for (int k = 0; k < NBLK; k++) {
        char nm[16];
        snprintf(nm, sizeof nm, "%d", k);
        block_t *b = &n->b[k];
        smp_partition_push(k < NBLK / 2 ? 0 : 1);
        smp_module_desc bd = {block_forward, NULL, b};
        smp_module *bm = n->blk[k] = smp_module_new(blocks, nm, &bd);
        b->fc[0] = new_lin(bm, "fc1", &b->lin[0], d, 4 * d, true, NULL);
        b->fc[1] = new_lin(bm, "fc2", &b->lin[1], 4 * d, d, false, &g_small_bound);
        b->add[0] = smp_module_new_add(bm, "add1");
        b->fc[2] = new_lin(bm, "fc3", &b->lin[2], d, 4 * d, true, NULL);
        b->fc[3] = new_lin(bm, "fc4", &b->lin[3], 4 * d, d, false, &g_small_bound);
        b->add[1] = smp_module_new_add(bm, "add2");
        if (recompute) smp_module_set_recompute(bm, true);
        smp_partition_pop();
    }
    smp_partition_push(1);
    n->head = new_lin(n->root, "head", &n->head_lin, d, CLS, false, NULL);
    smp_partition_pop();
}

static smp_status net_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m;
    (void)nin;
    (void)nout;
    net_t *n = (net_t *)user;
    smp_tensor h = in[0], y;
    for (int k = 0; k < NBLK; k++) {
        SMP_TRY(smp_call(n->blk[k], &h, 1, &y, 1));
        h = y;
    }
    return smp_call(n->head, &h, 1, &out[0], 1);
}

/* softmax cross-entropy, mean over the microbatch's rows */
SMP_STEP_BODY(xent_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    int rows = (int)y->shape[0];
    const float *yd = (const float *)y->data;
    const int32_t *lab = (const int32_t *)t->data;
    double loss = 0;
    for (int i = 0; i < rows; i++) {
        const float *r = yd + (size_t)i * CLS;
        float mx = r[0];
        for (int j = 1; j < CLS; j++) mx = r[j] > mx ? r[j] : mx;
        double sum = 0;
        for (int j = 0; j < CLS; j++) sum += exp((double)(r[j] - mx));
        loss += log(sum) - (double)(r[lab[i]] - mx);
        if (g)
            for (int j = 0; j < CLS; j++)
                ((float *)g->data)[(size_t)i * CLS + j] =
                    (float)((exp((double)(r[j] - mx)) / sum - (j == lab[i] ? 1.0 : 0.0)) / rows);
    }
    return smp_mb_return_f32(mb, 0, (float)(loss / rows));
}

/* ---------------------------------------------------------------- helpers */
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(const double *v, int n) {
    double *s = (double *)malloc(sizeof(double) * (size_t)n);
    memcpy(s, v, sizeof(double) * (size_t)n);
    qsort(s, (size_t)n, sizeof(double), cmp_double);
    double m = n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
    free(s);
    return m;
}

static void sgd(smp_model *m, float lr) {
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(m, i, false)); i++) {
        float *w = (float *)smp_param_value(p)->data;
        const float *g = (const float *)smp_param_grad(p)->data;
        int64_t n = smp_tensor_numel(smp_param_value(p));
        for (int64_t j = 0; j < n; j++) w[j] -= lr * g[j];
    }
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static double rng_uniform(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) * (1.0 / 9007199254740992.0);
}

static double fmt_mib(int64_t b) { return (double)b / (1024.0 * 1024.0); }

int main(int argc, char **argv) {
    int d = 256, batch = 256, micro = 8, steps = 10, warmup = 2;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--d")) d = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--batch")) batch = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--microbatches")) micro = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--steps")) steps = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--warmup")) warmup = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--d N] [--batch N] [--microbatches N] [--steps N] [--warmup N]\n", argv[0]);
            return 2;
        }
    }
    if (d < 1 || micro < 1 || batch < micro || batch % micro || micro > 64 || steps < 1 || warmup < 0 ||
        warmup + steps > MAX_STEPS) {
        fprintf(stderr, "bad options: d %d, batch %d, microbatches %d, steps %d, warmup %d\n", d, batch, micro, steps,
                warmup);
        return 2;
    }
    openblas_set_num_threads(1); /* one core per rank: the parallelism is smp's processes */
    double t_wall = now_s();
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.partitions = 2;
    cfg.microbatches = micro;
    cfg.pipeline = SMP_PIPELINE_INTERLEAVED;
    cfg.auto_partition = SMP_OFF;
    cfg.ddp = SMP_OFF;
    cfg.seed = 15;
    if (smp_init(&cfg) != SMP_OK) die("smp_init");
    int me = smp_rank(), world = smp_size();
    if (world != 2) {
        if (me == 0) fprintf(stderr, "bench/recompute runs on 2 ranks (mpirun -n 2), not %d\n", world);
        smp_finalize();
        return 2;
    }
    g_small_bound = 0.5f / sqrtf((float)(4 * d));

    /* two models: [0] plain, [1] every block recomputed */
    net_t *net[2];
    smp_model *model[2];
    float *x = (float *)malloc(sizeof(float) * (size_t)batch * (size_t)d);
    int32_t *lab = (int32_t *)malloc(sizeof(int32_t) * (size_t)batch);
    for (int64_t i = 0; i < (int64_t)batch * d; i++) x[i] = (float)(2.0 * rng_uniform() - 1.0);
    for (int i = 0; i < batch; i++) lab[i] = (int32_t)(rng_uniform() * CLS);
    for (int v = 0; v < 2; v++) {
        net[v] = (net_t *)calloc(1, sizeof(net_t));
        build(net[v], d, v == 1);
        smp_model_desc md = {net_forward, 1, 1, net[v], false};
        if (smp_model_new(net[v]->root, &md, &model[v]) != SMP_OK) die("smp_model_new");
        smp_tensor xs = smp_tensor_2d(x, SMP_F32, batch / micro, d);
        if (smp_model_trace(model[v], &xs, 1) != SMP_OK) die("smp_model_trace");
    }

    int total = warmup + steps;
    double t[2][MAX_STEPS];
    int64_t stash[2] = {0, 0}, stash_min[2] = {INT64_MAX, INT64_MAX};
    int inflight[2] = {0, 0}, stage = -1;
    long fwd[2] = {0, 0}; /* linear forwards in the last step */
    int mismatches = 0;
    for (int step = 0; step < total; step++) {
        /* this step's batch: the same for both models */
        for (int64_t i = 0; i < (int64_t)batch * d; i++) x[i] = (float)(2.0 * rng_uniform() - 1.0);
        for (int i = 0; i < batch; i++) lab[i] = (int32_t)(rng_uniform() * CLS);
        float loss[2][64];
        int nloss[2] = {0, 0};
        for (int o = 0; o < 2; o++) {
            int v = step % 2 ? 1 - o : o;
            smp_step_output out = {0};
            smp_model_zero_grad(model[v]);
            smp_tensor xt = smp_tensor_2d(x, SMP_F32, batch, d);
            smp_tensor lt = smp_tensor_1d(lab, SMP_I32, batch);
            MPI_Barrier(MPI_COMM_WORLD);
            long f0 = g_lin_fwd;
            double t0 = now_s();
            smp_status st = SMP_TRAIN_STEP(model[v], xent_body, NULL, &out, 1, xt, lt);
            double dt = now_s() - t0;
            if (st) die("training step");
            fwd[v] = g_lin_fwd - f0;
            MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            t[v][step] = dt;
            nloss[v] = out.microbatches < 64 ? out.microbatches : 64;
            for (int i = 0; i < nloss[v]; i++) loss[v][i] = ((const float *)out.values[i].data)[0];
            smp_step_output_free(&out);
            smp_step_stats ss = smp_last_step_stats(model[v]);
            if (step >= warmup) {
                if (ss.stash_peak_bytes > stash[v]) stash[v] = ss.stash_peak_bytes;
                if (ss.stash_peak_bytes < stash_min[v]) stash_min[v] = ss.stash_peak_bytes;
            }
            if (ss.local_stages >= 1) {
                stage = ss.stage_index[0];
                inflight[v] = ss.peak_inflight[0];
            }
            sgd(model[v], 0.05f);
        }
        if (nloss[0] != nloss[1] || memcmp(loss[0], loss[1], sizeof(float) * (size_t)nloss[0])) {
            mismatches++;
            if (me == 0)
                for (int i = 0; i < nloss[0] && i < nloss[1]; i++)
                    if (memcmp(&loss[0][i], &loss[1][i], sizeof(float)))
                        fprintf(stderr, "ERROR: step %d microbatch %d: loss %.9g without recomputation, %.9g with\n",
                                step, i, loss[0][i], loss[1][i]);
        }
        if (me == 0 && step == total - 1) {
            double mean = 0;
            for (int i = 0; i < nloss[0]; i++) mean += loss[0][i];
            printf("last step: mean loss %.6f\n", mean / (nloss[0] ? nloss[0] : 1));
        }
    }
    /* every local parameter after the last update */
    int pmis = 0;
    smp_param *p, *q;
    for (int i = 0; (p = smp_model_local_param(model[0], i, false)); i++) {
        q = smp_model_local_param(model[1], i, false);
        if (!q || strcmp(smp_param_name(p), smp_param_name(q)) ||
            memcmp(smp_param_value(p)->data, smp_param_value(q)->data, smp_tensor_nbytes(smp_param_value(p)))) {
            if (pmis++ < 3)
                fprintf(stderr, "ERROR: rank %d: parameter %s differs with recomputation\n", me, smp_param_name(p));
        }
    }
    int bad = mismatches + pmis;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);

    /* gather per-rank figures: stage, peak stash plain/recomputed (max and min over timed steps), peak in flight */
    int64_t mine[9] = {stage, stash[0], stash[1], stash_min[0], stash_min[1], inflight[0], inflight[1], fwd[0], fwd[1]},
            all[2][9];
    MPI_Gather(mine, 9, MPI_INT64_T, all, 9, MPI_INT64_T, 0, MPI_COMM_WORLD);
    if (me == 0) {
        int rows = batch / micro;
        double blk_plain = 20.0 * d * rows * 4, blk_rc = 1.0 * d * rows * 4;
        printf("activation recomputation: %d composite blocks (2 residual MLPs d=%d -> %d -> %d each; 6 leaf calls), "
               "head %d -> %d\n",
               NBLK, d, 4 * d, d, d, CLS);
        printf(
            "2 ranks, 2 partitions (blocks 0-%d | blocks %d-%d + head), 1F1B, batch %d in %d microbatches of %d rows, "
            "OpenBLAS sgemm on 1 thread per rank\n",
            NBLK / 2 - 1, NBLK / 2, NBLK - 1, batch, micro, rows);
        printf("held per block and microbatch for its backward: %.0f KiB without recomputation (outputs 12d + stashes "
               "8d per row), "
               "%.0f KiB with (its output, d per row)\n",
               blk_plain / 1024, blk_rc / 1024);
        printf("%d warm-up + %d timed steps per model, taking turns; step = slower rank's SMP_TRAIN_STEP; peak stash = "
               "smp_last_step_stats(model).stash_peak_bytes, max over the timed steps\n"
               "in flight, linear forwards: peak microbatches in flight and linear forwards in one step, without, "
               "with\n\n",
               warmup, steps);
        printf("| stage | rank | in flight | linear forwards | peak stash without (MiB) | peak stash with (MiB) | "
               "with/without |\n");
        printf("|------:|-----:|----------:|----------------:|-------------------------:|----------------------:|------"
               "-------:|\n");
        double worst = 0;
        for (int r = 0; r < 2; r++) {
            double ratio = all[r][1] ? (double)all[r][2] / (double)all[r][1] : 0;
            if (ratio > worst) worst = ratio;
            char nf[32];
            snprintf(nf, sizeof nf, "%lld, %lld", (long long)all[r][7], (long long)all[r][8]);
            printf("| %5lld | %4d | %4lld, %-3lld | %15s | %24.3f | %21.3f | %12.3f |\n", (long long)all[r][0], r,
                   (long long)all[r][5], (long long)all[r][6], nf, fmt_mib(all[r][1]), fmt_mib(all[r][2]), ratio);
            if (all[r][1] != all[r][3] || all[r][2] != all[r][4])
                printf("  (rank %d: peak stash moved between timed steps: without %lld-%lld, with %lld-%lld bytes)\n",
                       r, (long long)all[r][3], (long long)all[r][1], (long long)all[r][4], (long long)all[r][2]);
        }
        double med[2], lo[2], hi[2];
        for (int v = 0; v < 2; v++) {
            med[v] = median(t[v] + warmup, steps);
            lo[v] = hi[v] = t[v][warmup];
            for (int s = warmup; s < total; s++) {
                if (t[v][s] < lo[v]) lo[v] = t[v][s];
                if (t[v][s] > hi[v]) hi[v] = t[v][s];
            }
        }
        printf("\n| step time (ms)          |  median | min-max         |\n");
        printf("|-------------------------|--------:|-----------------|\n");
        printf("| without recomputation   | %7.1f | %6.1f-%-7.1f |\n", 1e3 * med[0], 1e3 * lo[0], 1e3 * hi[0]);
        printf("| with recomputation      | %7.1f | %6.1f-%-7.1f |\n", 1e3 * med[1], 1e3 * lo[1], 1e3 * hi[1]);
        printf("\nlosses and parameters with and without recomputation: %s (%d steps)\n",
               bad ? "DIFFER" : "bitwise equal", total);
        printf("wall time %.1f s\n", now_s() - t_wall);
        if (bad) fprintf(stderr, "ERROR: recomputation changed the result (%d mismatches); see above\n", bad);
        printf("recompute step time ratio: %.2f\n", med[1] / med[0]);
        printf("recompute peak stash ratio: %.2f\n", worst);
    }
    for (int v = 0; v < 2; v++) {
        smp_model_free(model[v]);
        free(net[v]);
    }
    free(x);
    free(lab);
    smp_finalize();
    return bad ? 1 : 0;
}
