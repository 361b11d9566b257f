/* test_tp_chaos.c - failures injected into tensor-parallel training.

   tp_mlp.h's Megatron MLP at tp 2 (2 ranks; 2 stages of 2 shards on 4),
   deterministic_reduction on, 60 steps, while a seeded injector makes one
   thing fail on one random rank in about a third of the steps: a kernel
   (forward or backward, at a random call of the step) or an allocation smp
   makes (the n-th of the step, n at random), or the step body (at a random
   microbatch, before the sum over TP_GROUP it runs), so the failing rank
   stops before a TP module's collective, or the body's, that its TP peers
   go on to. Checks:
     - every injected failure fails the step on every rank, and no other
       step fails;
     - a failed step changes no parameter;
     - no rank waits for the failed one until SMP_TIMEOUT (60 s here):
       every failed step returns within 10 s (the TP handshake before each
       TP module's collective, and each collective over TP_GROUP in a step,
       carries the failure to the peers);
     - at the end the parameters equal, bit for bit, those of a clean run
       that skipped exactly the failed steps' batches;
     - a kernel failing while the first step traces the model fails that
       step on every rank within 10 s too, and the next one traces anew.
   Built with SMP_TESTING. Run: mpirun -n 2|4 build/gcc/test_tp_chaos */
#define _POSIX_C_SOURCE 200809L
#define SMP_TESTING
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"

#include <string.h>

#include "tp_mlp.h"

enum { CHAOS_STEPS = 60, KINDS = 3 };
enum { K_KERNEL, K_ALLOC, K_BODY };
static const char *const kind_name[KINDS] = {"kernel", "allocation", "step body"};
static int g_body_fail = -1; /* the microbatch whose step body fails on this rank (-1: none) */

/* tp_mlp.h's MSE, and the loss summed over the TP group (every rank has the same): a collective of the body. */
SMP_STEP_BODY(chaos_body) {
    if (smp_mb_index(mb) == g_body_fail)
        return smp_error(SMP_ERR_ARG, "a failure injected into the step body of microbatch %d on world rank %d",
                         g_body_fail, smp_rank());
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    float d = ((const float *)y->data)[0] - ((const float *)t->data)[0], sum = 0;
    smp_tensor a = smp_tensor_1d(&d, SMP_F32, 1), b = smp_tensor_1d(&sum, SMP_F32, 1);
    SMP_TRY(smp_all_reduce(&a, &b, SMP_SUM, SMP_TP_GROUP));
    if (sum != d * 2) return smp_error(SMP_ERR_STATE, "the TP ranks' outputs differ: %g, summed %g", d, sum);
    return mse_body(mb);
}

static int world, me;

static smp_model *start(net *n, int pp) {
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.partitions = pp;
    cfg.tensor_parallel_degree = 2;
    cfg.microbatches = MB;
    cfg.auto_partition = SMP_OFF;
    cfg.deterministic_reduction = SMP_ON;
    cfg.timeout = 60;
    if (smp_init(&cfg)) return NULL;
    build(n, pp > 1, false, F);
    if (smp_model_new(n->root, &(smp_model_desc){.forward = net_forward, .ninputs = 1, .user = n}, &n->model))
        return NULL;
    return n->model;
}

/* One training step of batch s: zero_grad, the step, SGD when it worked. */
static smp_status train(net *n, int s) {
    float x[BATCH * H], t[BATCH * H];
    batch_of(s, x, t);
    smp_model_zero_grad(n->model);
    smp_tensor xt = smp_tensor_2d(x, SMP_F32, BATCH, H), tt = smp_tensor_2d(t, SMP_F32, BATCH, H);
    smp_status st = SMP_TRAIN_STEP(n->model, chaos_body, NULL, NULL, 0, xt, tt);
    if (!st) sgd_step(n->model);
    return st;
}

/* FNV-1a over this rank's parameters' bytes. */
static uint64_t digest(smp_model *m) {
    uint64_t h = 0xcbf29ce484222325ull;
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(m, i, false)); i++) {
        const unsigned char *b = (const unsigned char *)smp_param_value(p)->data;
        for (size_t k = 0; k < smp_tensor_nbytes(smp_param_value(p)); k++) h = (h ^ b[k]) * 0x100000001b3ull;
    }
    return h;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    if (world != 2 && world != 4) {
        if (me == 0) test_skip("tp_chaos", "runs on 2 ranks (tp 2) or 4 (2 stages x tp 2)");
        MPI_Finalize();
        return 0;
    }
    int pp = world / 2;
    bool failed[CHAOS_STEPS] = {false};
    int injected[KINDS] = {0}, reported = 0, unchanged = 0, wrong = 0;
    double slowest = 0;
    net n;
    smp_model *model = start(&n, pp);
    MPI_CHECK(model != NULL, "tp_chaos/start", "%s", smp_last_error());
    if (model) { /* a kernel failing while the first step traces the model, on the last rank: its TP peer would
                    wait in the handshake of the next TP module until SMP_TIMEOUT unless the trace says it failed */
        if (me == world - 1) g_fail_at = g_kernel_calls;
        double t0 = MPI_Wtime();
        int bad = train(&n, 0) != SMP_OK, all_bad = 0;
        double took = MPI_Wtime() - t0, worst_trace = 0;
        g_fail_at = -1;
        MPI_Allreduce(&bad, &all_bad, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        MPI_Allreduce(&took, &worst_trace, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        MPI_CHECK(all_bad && worst_trace < 10,
                  "tp_chaos/a kernel failing in the first step's trace fails it on every rank within 10 s",
                  "this rank %s; the slowest rank took %.1f s", bad ? "failed" : "succeeded", worst_trace);
    }
    long per_step[KINDS] = {0};
    for (int s = 0; s < 2 && model; s++) { /* the trace again, which now works */ /* the trace, then a step to count what one calls and allocates */
        long k0 = g_kernel_calls, a0 = smp_testing_events(SMP_FAULT_ALLOC);
        smp_status st = train(&n, s);
        MPI_CHECK(st == SMP_OK, "tp_chaos/clean steps", "step %d: %s", s, smp_last_error());
        per_step[K_KERNEL] = g_kernel_calls - k0;
        per_step[K_ALLOC] = smp_testing_events(SMP_FAULT_ALLOC) - a0;
        per_step[K_BODY] = smp_pp_rank() == pp - 1 ? MB : 0; /* the body runs where the model's output is */
    }
    uint64_t rng = 0x7c0de;
    for (int s = 2; s < CHAOS_STEPS && model; s++) {
        bool inject = smp__splitmix(&rng) % 3 == 0;
        int kind = (int)(smp__splitmix(&rng) % KINDS), target = (int)(smp__splitmix(&rng) % (uint64_t)world);
        uint64_t pick = smp__splitmix(&rng);
        int armed = inject && me == target && per_step[kind] > 0, any = 0;
        if (armed && kind == K_KERNEL) g_fail_at = g_kernel_calls + (long)(pick % (uint64_t)per_step[kind]);
        if (armed && kind == K_ALLOC) smp_testing_fail(SMP_FAULT_ALLOC, (long)(pick % (uint64_t)per_step[kind]));
        if (armed && kind == K_BODY) g_body_fail = (int)(pick % (uint64_t)per_step[kind]);
        MPI_Allreduce(&armed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        uint64_t before = digest(model);
        double t0 = MPI_Wtime();
        smp_status st = train(&n, s);
        double took = MPI_Wtime() - t0;
        int bad = st != SMP_OK, all_bad = 0, some_bad = 0;
        MPI_Allreduce(&bad, &all_bad, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        MPI_Allreduce(&bad, &some_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        if (any) injected[kind]++;
        if (all_bad) {
            failed[s] = true;
            reported++;
            unchanged += digest(model) == before;
            slowest = took > slowest ? took : slowest;
        }
        if (any != all_bad || some_bad != all_bad) {
            wrong++;
            if (wrong <= 3)
                printf("tp_chaos: step %d (%s injected on rank %d: %s): rank %d %s: %s\n", s, kind_name[kind], target,
                       any ? "yes" : "no", me,
                       bad ? "failed" : "succeeded", bad ? smp_last_error() : "");
        }
        g_fail_at = g_body_fail = -1; /* disarm what did not fire */
        smp_testing_fail(SMP_FAULT_ALLOC, -1);
    }
    uint64_t chaos_digest = model ? digest(model) : 0;
    double worst = 0;
    MPI_Allreduce(&slowest, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (model) smp_model_free(model);
    smp_finalize();
    int total = injected[K_KERNEL] + injected[K_ALLOC] + injected[K_BODY];
    MPI_CHECK(wrong == 0, "tp_chaos/every injected failure fails the step on every rank, and no other step fails",
              "%d steps went otherwise", wrong);
    MPI_CHECK(reported == total && injected[K_KERNEL] >= 3 && injected[K_ALLOC] >= 3 && injected[K_BODY] >= 2,
              "tp_chaos/failures reported", "%d injected (kernel %d, allocation %d, body %d), %d reported", total,
              injected[K_KERNEL], injected[K_ALLOC], injected[K_BODY], reported);
    MPI_CHECK(unchanged == reported, "tp_chaos/a failed step changes no parameter",
              "%d of %d failed steps changed a parameter", reported - unchanged, reported);
    MPI_CHECK(worst < 10, "tp_chaos/no TP peer waits for a failed rank until SMP_TIMEOUT: every failed step ends within 10 s",
              "the slowest failed step took %.1f s", worst);

    /* the clean run: the same batches, the failed ones skipped */
    model = start(&n, pp);
    int clean_errors = 0;
    for (int s = 0; s < CHAOS_STEPS && model; s++)
        if (!failed[s]) clean_errors += train(&n, s) != SMP_OK;
    int same = model && clean_errors == 0 && digest(model) == chaos_digest, all_same = 0;
    MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_CHECK(all_same, "tp_chaos/the parameters equal a clean run that skipped the failed steps, bit for bit",
              "%d clean steps failed; digests %s here", clean_errors, same ? "equal" : "differ");
    if (me == 0)
        printf("tp_chaos: %d steps on %d ranks (pp %d x tp 2), failures injected: kernel %d, allocation %d, body %d; "
               "reported %d; slowest failed step %.3f s\n",
               CHAOS_STEPS, world, pp, injected[K_KERNEL], injected[K_ALLOC], injected[K_BODY], reported, worst);
    if (model) smp_model_free(model);
    smp_finalize();
    int rc = test_exit_code();
    MPI_Finalize();
    return rc;
}
