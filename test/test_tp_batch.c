/* test_tp_batch.c - prescaled_batch false: each rank of a TP group passes its
   own examples, and smp_step joins them along each split argument's batch
   axis, in tp-rank order, before it slices microbatches.

   The model is test_tp.c's Megatron MLP (tp_mlp.h). Each rank passes B = 4
   examples of its own, sharded by dp_rank: x and t [B, H] along axis 0, the
   examples' numbers as a [2, B] i32 argument (e and -e) along axis 1, and a
   non_split argument of tp_rank + 1 elements. The reference is the same
   training with prescaled_batch true, every rank of a TP group passing the
   group's joined tp x B examples (sharded by rdp_rank).

   Checks:
     1. tp 2 (2 ranks); pp 2 x tp 2 under 1F1B and zero_bubble, and tp 2 x
        rdp 2 with deterministic DDP (4 ranks): the losses, the StepOutput
        concat of the model's outputs, and every parameter after STEPS SGD
        steps are bitwise the reference's; the StepOutput concat of the
        axis-1 argument is the joined batch's numbers in order (this rank's
        own at tp_rank x B); the non_split argument is this rank's own; the
        reduce_mean of the loss is the reference's; smp_local_batch_size is
        the global batch over dp_size (over rdp_size in the reference), and
        smp_sampler_indices starts this rank at its own rows (the TP group's).
        When world rank 1 comes LATE_S late to the last step, every other
        rank's smp_last_step_stats seconds counts the wait in the join.
     2. bad input (before each own-batch run): a batch size, then a dtype,
        that differs across the TP group is an error on every rank naming
        both ranks and shapes and the fix; then a kernel that fails on the
        last rank after the join fails the step on every rank. The failed
        steps leave no memory behind and change nothing: the training after
        them is still bitwise the reference's (the kernel's after step 0).
     3. tp 2 (2 ranks) at 4 microbatches, 3 examples a rank: the error names
        this rank's batch of 3, joined into 6, and the fix, word for word.
   At 1 rank tp is 1 and the two modes are the same thing: checked too.

   Run: mpirun -n 1|2|4 build/gcc/test_tp_batch */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tp_mlp.h"

#define RUN_STEPS 6
#define OWN BATCH   /* examples each rank passes with prescaled_batch false */
#define MOST 16     /* the most examples a rank passes: tp x OWN, and one more for the bad batch */
#define LATE_S 0.3  /* how late world rank 1 comes to the last own-batch step */

static int g_rank, g_world;

/* Example e of step s, whoever passes it: its input, its target, its number (e, -e). */
static void examples(int s, int first, int count, float *x, float *t, int32_t *ids) {
    for (int e = 0; e < count; e++) {
        uint64_t st = 1234 + (uint64_t)s * 7919 + (uint64_t)(first + e) * 104729;
        for (int i = 0; i < H; i++) {
            x[e * H + i] = (float)(2 * smp_rng_uniform(&st) - 1);
            t[e * H + i] = (float)(2 * smp_rng_uniform(&st) - 1);
        }
        ids[e] = first + e;
        ids[count + e] = -(first + e);
    }
}

/* mse_body's loss and output gradient; returns the model's output (1), the axis-1 argument's slice (2) and the
   non_split argument's element count (3). */
SMP_STEP_BODY(joined_body) {
    SMP_TRY(mse_body(mb));
    SMP_TRY(smp_mb_return(mb, 1, smp_mb_output(mb, 0)));
    SMP_TRY(smp_mb_return(mb, 2, smp_mb_arg(mb, 2)));
    return smp_mb_return_f32(mb, 3, (float)smp_tensor_numel(smp_mb_arg(mb, 3)));
}

typedef struct run_result {
    smp_status st;
    char why[600]; /* the first check of this rank's own that failed */
    double loss[RUN_STEPS];
    float out[RUN_STEPS][MOST * H];
    float *value[BLOCKS * 4];
} run_result;

static void result_free(run_result *r) {
    for (int k = 0; k < BLOCKS * 4; k++) free(r->value[k]);
}

static void note(run_result *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(run_result *r, const char *fmt, ...) {
    if (r->why[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->why, sizeof r->why, fmt, ap);
    va_end(ap);
}

/* Bad steps first to last of: rank 1 passes one example more, then targets of another dtype (before the
   training): each must fail on every rank naming the ranks, both shapes and the fix; a kernel fails on the last
   rank in a step whose batches joined (after the first step; test_tp_chaos fails one in the first step's
   trace): the step fails everywhere. Each gives back the memory it took. */
static void bad_steps(net *n, int first, int last, run_result *r) {
    static const char *what[3] = {"(batch size)", "(dtype)", "(a kernel failed after the join)"};
    float x[MOST * H], t[MOST * H], nonsplit[2] = {0, 0};
    int32_t ids[2 * MOST];
    int rows = OWN + (smp_tp_rank() == 1);
    examples(0, 0, rows, x, t, ids);
    for (int k = first; k <= last && !r->st; k++) {
        int nr = k == 0 ? rows : OWN;
        smp_tensor xt = smp_tensor_2d(x, SMP_F32, nr, H), tt = smp_tensor_2d(t, SMP_F32, nr, H);
        smp_tensor it = smp_tensor_2d(ids, SMP_I32, 2, nr), ns = smp_tensor_1d(nonsplit, SMP_F32, smp_tp_rank() + 1);
        if (k == 1 && smp_tp_rank() == 1) tt.dtype = SMP_I32; /* the same bytes */
        if (k == 2 && smp_rank() == smp_size() - 1) g_fail_at = g_kernel_calls;
        smp_step_desc d;
        memset(&d, 0, sizeof d);
        d.model = n->model;
        d.body = joined_body;
        d.nargs = 4;
        d.args[0] = xt, d.args[1] = tt, d.args[2] = it, d.args[3] = ns;
        d.split_axis[2] = 1;
        d.non_split[3] = true;
        smp_step_output outs[4];
        memset(outs, 0, sizeof outs);
        int64_t comm_before = smp_memory().bytes[SMP_MEMORY_COMMUNICATION];
        smp_status st = smp_step(&d, outs, 4);
        int64_t comm_after = smp_memory().bytes[SMP_MEMORY_COMMUNICATION];
        g_fail_at = -1;
        const char *e = smp_last_error();
        const char *want[3][2] = {{"f32[4, 8]", "f32[5, 8]"}, {"f32[4, 8]", "i32[4, 8]"}, {"", ""}};
        if (k == 2 ? st == SMP_OK || !strstr(e, "a failure injected into kernel call")
                   : st != SMP_ERR_ARG || !strstr(e, "tp rank 0 (world rank 0)") ||
                         !strstr(e, "tp rank 1 (world rank 1)") || !strstr(e, want[k][0]) ||
                         !strstr(e, want[k][1]) || !strstr(e, "smp_dp_rank"))
            note(r, "bad step %s: status %d: %.400s", what[k], (int)st, e);
        if (comm_after != comm_before)
            note(r, "bad step %s: communication bytes %lld before, %lld after", what[k], (long long)comm_before,
                 (long long)comm_after);
        for (int o = 0; o < 4; o++) smp_step_output_free(&outs[o]);
    }
}

/* RUN_STEPS steps at pp x tp on the world, each rank passing its own examples (own) or its TP group's joined
   ones; every rank gets the results. */
static void run(int pp, int tp, smp_pipeline_kind kind, bool own, run_result *r) {
    memset(r, 0, sizeof *r);
    for (int k = 0; k < BLOCKS * 4; k++) r->value[k] = (float *)calloc((size_t)numel_of(k, F), sizeof(float));
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.partitions = pp;
    cfg.tensor_parallel_degree = tp;
    cfg.microbatches = MB;
    cfg.pipeline = kind;
    cfg.auto_partition = SMP_OFF;
    cfg.prescaled_batch = own ? SMP_OFF : SMP_ON;
    cfg.deterministic_reduction = SMP_ON;
    if (g_world > pp * tp) cfg.ddp = SMP_ON;
    if ((r->st = smp_init(&cfg))) return;
    net n;
    build(&n, pp > 1, false, F);
    r->st = smp_model_new(n.root, &(smp_model_desc){.forward = net_forward, .ninputs = 1, .user = &n}, &n.model);
    int64_t global = OWN * (int64_t)smp_dp_size(), local = 0;
    if (!r->st) r->st = smp_local_batch_size(global, &local);
    int64_t want_local = own ? OWN : OWN * (int64_t)smp_tp_size();
    if (!r->st && local != want_local)
        note(r, "smp_local_batch_size: %lld rows, expected %lld", (long long)local, (long long)want_local);
    int first = (own ? smp_dp_rank() : smp_rdp_rank()) * (int)local;
    /* the sampler shards as smp_local_batch_size does: the same rows on a TP group's ranks, or each rank its own */
    smp_sampler_desc sd = {.dataset_size = 64, .batch_size = local, .shuffle = false, .drop_last = true};
    int64_t idx[64 + MOST], count = 0, batches = 0;
    if (!r->st) r->st = smp_sampler_indices(&sd, 0, idx, &count, &batches);
    if (!r->st && idx[0] != first)
        note(r, "smp_sampler_indices: this rank's first sample is %lld, expected %d", (long long)idx[0], first);
    if (!r->st) r->st = smp_agree_batches(batches);
    int joined = OWN * smp_tp_size(), joined_first = smp_rdp_rank() * joined, per = joined / MB;
    if (!r->st && own && smp_tp_size() > 1) bad_steps(&n, 0, 1, r);
    for (int s = 0; s < RUN_STEPS && !r->st; s++) {
        if (s == 1 && own && smp_tp_size() > 1) {
            smp_model_zero_grad(n.model);
            bad_steps(&n, 2, 2, r);
        }
        float x[MOST * H], t[MOST * H], nonsplit[4] = {0};
        int32_t ids[2 * MOST];
        examples(s, first, (int)local, x, t, ids);
        smp_step_desc d;
        memset(&d, 0, sizeof d);
        d.model = n.model;
        d.body = joined_body;
        d.nargs = 4;
        d.args[0] = smp_tensor_2d(x, SMP_F32, local, H);
        d.args[1] = smp_tensor_2d(t, SMP_F32, local, H);
        d.args[2] = smp_tensor_2d(ids, SMP_I32, 2, local);
        d.args[3] = smp_tensor_1d(nonsplit, SMP_F32, smp_tp_rank() + 1);
        d.split_axis[2] = 1;
        d.non_split[3] = true;
        smp_step_output outs[4];
        memset(outs, 0, sizeof outs);
        smp_model_zero_grad(n.model);
        bool late = own && smp_tp_size() > 1 && s == RUN_STEPS - 1; /* world rank 1 comes LATE_S late to the step */
        if (late && smp_rank() == 1) nanosleep(&(struct timespec){0, (long)(LATE_S * 1e9)}, NULL);
        if ((r->st = smp_step(&d, outs, 4))) break;
        /* every other rank waited for it in the join, which is part of the call the statistics time */
        double took = smp_last_step_stats(n.model).seconds;
        if (late && smp_rank() != 1 && !(took >= LATE_S))
            note(r, "step %d: smp_last_step_stats' seconds %.3f, but the call waited %.3f s for a late rank", s, took,
                 LATE_S);
        r->loss[s] = smp_step_output_reduce_mean_f64(&outs[0]);
        smp_tensor cat = smp_tensor_2d(r->out[s], SMP_F32, joined, H);
        if ((r->st = smp_step_output_concat(&outs[1], &cat))) break;
        int32_t got[2 * MOST];
        smp_tensor gids = smp_tensor_2d(got, SMP_I32, 2 * MB, per);
        if ((r->st = smp_step_output_concat(&outs[2], &gids))) break;
        for (int m = 0; m < MB; m++) /* microbatch m's [2, per] slice: examples joined_first + m x per + j */
            for (int j = 0; j < per; j++)
                if (got[2 * m * per + j] != joined_first + m * per + j ||
                    got[(2 * m + 1) * per + j] != -(joined_first + m * per + j))
                    note(r, "step %d: the body saw example %d where example %d belongs (concat of argument 2)", s,
                         (int)got[2 * m * per + j], joined_first + m * per + j);
        float count = 0;
        smp_tensor cnt = smp_tensor_make(&count, SMP_F32, 0, NULL);
        if (pp == 1 && (smp_step_output_reduce_mean(&outs[3], &cnt) || count != (float)(smp_tp_rank() + 1)))
            note(r, "the non_split argument has %g elements in the body, this rank passed %d", (double)count,
                 smp_tp_rank() + 1);
        for (int o = 0; o < 4; o++) smp_step_output_free(&outs[o]);
        sgd_step(n.model);
    }
    if (!r->st) full_params(&n, false, r->value);
    smp_model_free(n.model);
    smp_finalize();
}

/* tp 2 at 4 microbatches, each rank passing 3 examples: the joined 6 do not divide, and the error on every rank
   names the batch this rank passed, the join and the fix. */
static void indivisible_join(void) {
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.tensor_parallel_degree = 2;
    cfg.microbatches = 4;
    cfg.prescaled_batch = SMP_OFF;
    smp_status st = smp_init(&cfg);
    net n;
    memset(&n, 0, sizeof n);
    if (!st) build(&n, false, false, F);
    if (!st) st = smp_model_new(n.root, &(smp_model_desc){.forward = net_forward, .ninputs = 1, .user = &n}, &n.model);
    char why[700] = "";
    if (st) snprintf(why, sizeof why, "set-up: status %d: %.400s", (int)st, smp_last_error());
    float x[3 * H], t[3 * H];
    int32_t ids[2 * 3];
    examples(0, 3 * smp_tp_rank(), 3, x, t, ids);
    smp_step_desc d;
    memset(&d, 0, sizeof d);
    d.model = n.model;
    d.body = mse_body;
    d.nargs = 2;
    d.args[0] = smp_tensor_2d(x, SMP_F32, 3, H), d.args[1] = smp_tensor_2d(t, SMP_F32, 3, H);
    int64_t comm_before = st ? 0 : smp_memory().bytes[SMP_MEMORY_COMMUNICATION];
    if (!st) st = smp_step(&d, NULL, 0);
    static const char text[] = "smp_step: this rank's batch of 3 (argument 0, axis 0), joined over the TP group of 2 "
                               "ranks into 6 (prescaled_batch false), does not divide into 4 microbatches: pass each "
                               "rank a batch that is a multiple of 2, or set microbatches to a divisor of 6";
    const char *e = smp_last_error(), *mine = g_rank == 0 ? e : strncmp(e, "rank 0: ", 8) ? "" : e + 8;
    if (!why[0] && (st != SMP_ERR_ARG || strcmp(mine, text)))
        snprintf(why, sizeof why, "status %d, message: %.400s", (int)st, e);
    else if (!why[0] && smp_memory().bytes[SMP_MEMORY_COMMUNICATION] != comm_before)
        snprintf(why, sizeof why, "communication bytes %lld before, %lld after", (long long)comm_before,
                 (long long)smp_memory().bytes[SMP_MEMORY_COMMUNICATION]);
    smp_model_free(n.model);
    smp_finalize();
    MPI_CHECK(!why[0], "prescaled_batch false: a joined batch that does not divide into microbatches is an error "
              "naming this rank's batch, the join and the fix", "%s", why);
}

/* prescaled_batch false against true at pp x tp on the world: bitwise. */
static void compare(const char *label, int pp, int tp, smp_pipeline_kind kind) {
    static run_result own, ref;
    run(pp, tp, kind, true, &own);
    char why[1200] = "", name[200];
    run(pp, tp, kind, false, &ref);
    if (own.st || ref.st)
        snprintf(why, sizeof why, "status %d (own batches), %d (joined): %.400s", (int)own.st, (int)ref.st,
                 smp_last_error());
    else if (own.why[0] || ref.why[0])
        snprintf(why, sizeof why, "%s%s", own.why[0] ? "own batches: " : "joined: ", own.why[0] ? own.why : ref.why);
    for (int s = 0; s < RUN_STEPS && !why[0]; s++) {
        if (memcmp(&own.loss[s], &ref.loss[s], sizeof(double)))
            snprintf(why, sizeof why, "step %d: loss %a with own batches, %a joined", s, own.loss[s], ref.loss[s]);
        else if (memcmp(own.out[s], ref.out[s], sizeof own.out[s]))
            snprintf(why, sizeof why, "step %d: the model's outputs (StepOutput concat) differ", s);
    }
    for (int k = 0; k < BLOCKS * 4 && !why[0]; k++)
        if (memcmp(own.value[k], ref.value[k], sizeof(float) * (size_t)numel_of(k, F)))
            snprintf(why, sizeof why, "parameter %d differs after %d steps", k, RUN_STEPS);
    snprintf(name, sizeof name, "prescaled_batch false, %s: bitwise the joined batch with prescaled_batch true%s", label,
             own.st == SMP_OK && tp > 1
                 ? " (its failed steps failed everywhere, leaving nothing; its statistics timed the join)"
                 : "");
    MPI_CHECK(!why[0], name, "%s", why);
    result_free(&own);
    result_free(&ref);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    (void)batch_of; /* test_tp's batches: these are per example */
    if (g_world == 1) compare("tp 1 (the same thing)", 1, 1, SMP_PIPELINE_INTERLEAVED);
    if (g_world == 2) {
        compare("tp 2", 1, 2, SMP_PIPELINE_INTERLEAVED);
        indivisible_join();
    }
    if (g_world == 4) {
        compare("pp 2 x tp 2, 1F1B", 2, 2, SMP_PIPELINE_INTERLEAVED);
        compare("pp 2 x tp 2, zero_bubble", 2, 2, SMP_PIPELINE_ZERO_BUBBLE);
        compare("tp 2 x rdp 2, deterministic DDP", 1, 2, SMP_PIPELINE_INTERLEAVED);
    }
    if (g_world == 3 || g_world > 4) test_skip("tp_batch", "runs at 1, 2 and 4 ranks");
    MPI_Finalize();
    return test_exit_code();
}
