/* test_memory.c - the memory account (smp_memory, smp_memory_report,
   smp_memory_format: smp.h) and what active_microbatches does to it.
   On the 7-call test model (net7.h), at 1, 2 and 4 ranks:
     - after partitioning, PARAMETERS and GRADIENTS hold exactly the local
       parameters' values and gradients;
     - OPTIMIZER counts the state registered with smp_optimizer_state_add
       (not in current_bytes) and gives it back with smp_optimizer_free;
     - a training step's ACTIVATIONS peak is the step's stash peak, and
       with the simple (GPipe) schedule on one stage per rank
       active_microbatches = c holds c microbatches' activations where
       uncapped GPipe holds m: on one rank c = 1 is below GPipe's peak, no
       c above it, the peak grows with c, never past c times c = 1's, and
       c = m is GPipe's (with several, arrivals' timing moves the peaks);
     - smp_memory_reset_peaks makes the peaks a step's;
     - smp_memory_report gives every rank every rank's account as each
       rank's smp_memory() reads it;
     - data-parallel deterministic buckets gather through COMMUNICATION
       memory. */
#define _POSIX_C_SOURCE 200809L
#define SMP_IMPLEMENTATION
#define SMP_TESTING /* smp_config_resolve */
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h"
#include "test.h"

#include "net7.h"

static float g_x[B * D], g_t[B * C];
static int g_world, g_rank;

SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    return smp_mb_return_f32(mb, 0, mse((const float *)y->data, (const float *)t->data, g ? (float *)g->data : NULL,
                                        (int)smp_tensor_numel(y)));
}

static smp_status init(int P, int m, smp_pipeline_kind kind, int active, bool deterministic) {
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = m;
    cfg.pipeline = kind;
    cfg.ddp = g_world > P ? SMP_ON : SMP_OFF;
    cfg.deterministic_reduction = deterministic ? SMP_ON : SMP_OFF;
    cfg.active_microbatches = active;
    cfg.seed = 7;
    return smp_init(&cfg);
}

/* One training step; *peak gets the step's activation peak from the account. */
static smp_status step(smp_model *model, int64_t *peak, int64_t *stash_peak) {
    smp_step_output out = {0};
    smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D), t = smp_tensor_2d(g_t, SMP_F32, B, C);
    smp_model_zero_grad(model);
    smp_memory_reset_peaks();
    smp_status st = SMP_TRAIN_STEP(model, mse_body, NULL, &out, 1, x, t);
    smp_step_output_free(&out);
    *peak = smp_memory().peak[SMP_MEMORY_ACTIVATIONS];
    *stash_peak = smp_last_step_stats(model).stash_peak_bytes;
    return st;
}

static void test_categories(int P) {
    char name[128], why[4096] = "";
    snprintf(name, sizeof name, "memory account/P=%d: parameters, gradients, optimizer, report", P);
    smp_status st = init(P, 2, SMP_PIPELINE_INTERLEAVED, 0, false);
    if (st) { MPI_CHECK(0, name, "smp_init: %s", smp_last_error()); return; }
    smp_memory_stats m0 = smp_memory();
    net n;
    smp_model *model = build(&n, NULL);
    smp_tensor sample = smp_tensor_2d(g_x, SMP_F32, B / 2, D);
    int ok = model && smp_model_trace(model, &sample, 1) == SMP_OK;
    if (!ok) snprintf(why, sizeof why, "build or trace: %s", smp_last_error());
    int64_t values = 0, grads = 0;
    smp_param *p;
    for (int i = 0; ok && (p = smp_model_local_param(model, i, true)); i++) {
        values += (int64_t)smp_tensor_nbytes(smp_param_value(p));
        if (smp_param_grad(p)->data) grads += (int64_t)smp_tensor_nbytes(smp_param_grad(p));
    }
    smp_memory_stats m1 = smp_memory();
    if (ok && (m1.bytes[SMP_MEMORY_PARAMETERS] - m0.bytes[SMP_MEMORY_PARAMETERS] != values ||
               m1.bytes[SMP_MEMORY_GRADIENTS] - m0.bytes[SMP_MEMORY_GRADIENTS] != grads || values == 0 || grads == 0)) {
        ok = 0;
        snprintf(why, sizeof why,
                 "parameters %lld and gradients %lld bytes accounted, the local ones hold %lld and %lld",
                 (long long)(m1.bytes[SMP_MEMORY_PARAMETERS] - m0.bytes[SMP_MEMORY_PARAMETERS]),
                 (long long)(m1.bytes[SMP_MEMORY_GRADIENTS] - m0.bytes[SMP_MEMORY_GRADIENTS]), (long long)values,
                 (long long)grads);
    }
    if (ok && m1.param_bytes - m0.param_bytes != values + grads) {
        ok = 0;
        snprintf(why, sizeof why, "param_bytes grew by %lld, not values + gradients %lld",
                 (long long)(m1.param_bytes - m0.param_bytes), (long long)(values + grads));
    }
    /* optimizer state: two moments per local parameter, the engine's memory */
    smp_optimizer *opt = NULL;
    float *moments = NULL;
    if (ok) ok = smp_optimizer_new(model, &opt) == SMP_OK;
    int64_t reg = 0;
    if (ok) moments = (float *)calloc((size_t)(2 * values) / sizeof(float) + 1, sizeof(float));
    float *at = moments;
    for (int i = 0; ok && moments && (p = smp_model_local_param(model, i, false)); i++) {
        smp_tensor s = *smp_param_value(p);
        const char *names[2] = {"exp_avg", "exp_avg_sq"};
        for (int k = 0; k < 2 && ok; k++) {
            s.data = at;
            at += smp_tensor_numel(&s);
            reg += (int64_t)smp_tensor_nbytes(&s);
            ok = smp_optimizer_state_add(opt, smp_param_name(p), names[k], &s) == SMP_OK;
        }
    }
    smp_memory_stats m2 = smp_memory();
    int64_t grew = m2.bytes[SMP_MEMORY_OPTIMIZER] - m1.bytes[SMP_MEMORY_OPTIMIZER];
    if (ok && (grew != reg || reg == 0 || m2.peak[SMP_MEMORY_OPTIMIZER] < m2.bytes[SMP_MEMORY_OPTIMIZER])) {
        ok = 0;
        snprintf(why, sizeof why, "optimizer state: %lld bytes accounted, %lld registered", (long long)grew,
                 (long long)reg);
    }
    /* every rank's account, as that rank reads it */
    smp_memory_stats *all = (smp_memory_stats *)calloc((size_t)g_world, sizeof *all),
                     *raw = (smp_memory_stats *)calloc((size_t)g_world, sizeof *raw);
    smp_memory_stats mine = smp_memory();
    st = smp_memory_report("test", all);
    MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, raw, (int)sizeof mine, MPI_BYTE, MPI_COMM_WORLD);
    if (ok && (st || memcmp(all, raw, sizeof *all * (size_t)g_world))) {
        ok = 0;
        snprintf(why, sizeof why,
                 "smp_memory_report: status %d (%s), or its figures differ from each rank's smp_memory()", (int)st,
                 smp_last_error());
    }
    char line[512], want[64];
    smp_memory_format(&mine, false, line, sizeof line);
    snprintf(want, sizeof want, "optimizer %.3f MiB", (double)mine.bytes[SMP_MEMORY_OPTIMIZER] / 1048576.0);
    if (ok && (!strstr(line, "parameters ") || !strstr(line, want) || !strstr(line, ", total "))) {
        ok = 0;
        snprintf(why, sizeof why, "smp_memory_format: '%s' (wanted '%s')", line, want);
    }
    free(all);
    free(raw);
    smp_optimizer_free(opt);
    if (ok && smp_memory().bytes[SMP_MEMORY_OPTIMIZER] != m1.bytes[SMP_MEMORY_OPTIMIZER]) {
        ok = 0;
        snprintf(why, sizeof why, "smp_optimizer_free left %lld optimizer bytes accounted",
                 (long long)(smp_memory().bytes[SMP_MEMORY_OPTIMIZER] - m1.bytes[SMP_MEMORY_OPTIMIZER]));
    }
    free(moments);
    smp_model_free(model);
    if (ok && (smp_memory().bytes[SMP_MEMORY_PARAMETERS] != m0.bytes[SMP_MEMORY_PARAMETERS] ||
               smp_memory().bytes[SMP_MEMORY_GRADIENTS] != m0.bytes[SMP_MEMORY_GRADIENTS])) {
        ok = 0;
        snprintf(why, sizeof why, "freeing the model left parameters or gradients accounted");
    }
    MPI_CHECK(ok, name, "%s", why);
    smp_finalize();
}

/* GPipe on one stage per rank: uncapped it holds all m microbatches'
   activations, under active_microbatches = c only c of them. */
static void test_gpipe_cap(int P) {
    enum { M = 4 };
    char name[160], why[4096] = "";
    snprintf(name, sizeof name,
             "memory account/P=%d: simple with active_microbatches c = 1..%d: the activation peak grows with c, at "
             "most c x one's",
             P, M);
    int64_t peak[M + 1] = {0}, stash[M + 1] = {0};
    int ok = 1;
    for (int c = 0; c <= M && ok; c++) {
        smp_status st = init(P, M, SMP_PIPELINE_SIMPLE, c, false);
        if (st) { ok = 0; snprintf(why, sizeof why, "smp_init: %s", smp_last_error()); break; }
        net n;
        smp_model *model = build(&n, NULL);
        st = model ? step(model, &peak[c], &stash[c]) : SMP_ERR_NOMEM; /* the first step traces */
        if (!st) st = step(model, &peak[c], &stash[c]);
        if (st) { ok = 0; snprintf(why, sizeof why, "c=%d: step: %s", c, smp_last_error());
        } else if (smp_model_num_stages(model) != P) {
            ok = 0;
            snprintf(why, sizeof why, "%d stages, not %d", smp_model_num_stages(model), P);
        }
        smp_model_free(model);
        smp_finalize();
    }
    /* a cap saves memory, more microbatches held never cost less, c of
       them never more than c times one, and a cap at m is GPipe itself */
    for (int c = 1; c <= M && ok; c++) {
        /* with several ranks, activations that arrive early count from their arrival, so a capped step may hold
           more than an uncapped one where its peer ran ahead: timing, not the cap (test_pipeline checks the
           microbatches in flight against the cap at any rank count) */
        bool alone = P == 1;
        if (peak[c] != stash[c] || peak[c] <= 0 ||
            (alone && (peak[c] > peak[0] || (c == 1 && peak[1] >= peak[0]) || (c > 1 && peak[c] < peak[c - 1]) ||
                       peak[c] > c * peak[1] || (c == M && peak[c] != peak[0]))))
            ok = 0, snprintf(why, sizeof why,
                             "c=%d: activation peak %lld bytes (step stats: %lld), c-1: %lld, c=1: %lld, uncapped %lld",
                             c, (long long)peak[c], (long long)stash[c], (long long)peak[c - 1], (long long)peak[1],
                             (long long)peak[0]);
    }
    if (ok && g_rank == 0)
        printf("  P=%d, rank 0: activation peak for active_microbatches 1..%d: %lld %lld %lld %lld bytes (GPipe "
               "uncapped %lld)\n",
               P, M, (long long)peak[1], (long long)peak[2], (long long)peak[3], (long long)peak[4],
               (long long)peak[0]);
    MPI_CHECK(ok, name, "%s", why);
}

/* Deterministic data-parallel buckets gather every replica's copy in
   communication memory, for the step only. */
static void test_ddp_comm(void) {
    const char *name = "memory account/2 replicas, deterministic reduction: the gathers are communication memory";
    if (g_world < 2) { test_skip(name, "needs 2 ranks"); return; }
    smp_status st = init(g_world == 4 ? 2 : 1, 2, SMP_PIPELINE_INTERLEAVED, 0, true);
    if (st) { MPI_CHECK(0, name, "smp_init: %s", smp_last_error()); return; }
    net n;
    smp_model *model = build(&n, NULL);
    int64_t peak = 0, stash = 0;
    int64_t before = smp_memory().bytes[SMP_MEMORY_COMMUNICATION];
    st = model ? step(model, &peak, &stash) : SMP_ERR_NOMEM;
    if (!st) st = step(model, &peak, &stash);
    smp_memory_stats m = smp_memory();
    MPI_CHECK(!st && m.peak[SMP_MEMORY_COMMUNICATION] > before && m.bytes[SMP_MEMORY_COMMUNICATION] >= before, name,
              "status %d (%s): communication bytes before %lld, now %lld, peak %lld", (int)st, smp_last_error(),
              (long long)before, (long long)m.bytes[SMP_MEMORY_COMMUNICATION],
              (long long)m.peak[SMP_MEMORY_COMMUNICATION]);
    smp_model_free(model);
    smp_finalize();
}

/* offload_activations on a host model: every rank's step fails, saying there is nothing to offload, and changes
   nothing (test_gpu.cu offloads a device model). */
static void test_offload_host(void) {
    const char *name = "offload_activations on a host model: an error on every rank: nothing to offload";
    smp_config cfg = {0};
    cfg.partitions = g_world >= 2 ? 2 : 1;
    cfg.ddp = g_world > cfg.partitions ? SMP_ON : SMP_OFF;
    cfg.microbatches = 2;
    cfg.offload_activations = SMP_ON;
    smp_status st = smp_init(&cfg);
    if (st) { MPI_CHECK(0, name, "smp_init: %s", smp_last_error()); return; }
    net n;
    smp_model *model = build(&n, NULL);
    int64_t peak, stash;
    st = model ? step(model, &peak, &stash) : SMP_ERR_NOMEM;
    MPI_CHECK(st == SMP_ERR_CONFIG && strstr(smp_last_error(), "nothing to offload") &&
              strstr(smp_last_error(), "leave offload_activations off"), name, "status %d: %s", (int)st,
              smp_last_error());
    smp_model_free(model);
    smp_finalize();
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    uint64_t s = 5;
    for (int i = 0; i < B * D; i++) g_x[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    for (int i = 0; i < B * C; i++) g_t[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    for (int P = 1; P <= g_world && P <= 2; P *= 2) {
        if (g_world % P) continue;
        test_categories(P);
        /* one rank only: with several, a microbatch's activations count from when its message arrives, which timing
         * decides */
        if (P == 1) test_gpipe_cap(P);
    }
    test_ddp_comm(); /* shard_optimizer_state's account: test_zero */
    test_offload_host();
    int rc = test_exit_code();
    MPI_Finalize();
    return rc;
}
