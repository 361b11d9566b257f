/* test_chaos.c - failures injected into training, and nothing lost.

   200 training steps of net7.h's model (2 partitions x 2 replicas on 4
   ranks; 2 partitions on 2; one process on 1), while a seeded injector
   makes one thing fail on one random rank in about 20% of the steps: a
   module's forward (at a random microbatch), an allocation smp makes (the
   n-th of the step, n at random), a pipeline send, or a pipeline message's
   header (corrupted after its check word, so the receiver's check fails).
   Every failed step must return an error on every rank and change no
   parameter; the run goes on with the next batch. At the end the
   parameters must equal, bit for bit, those of a clean run that skipped
   exactly the failed steps' batches. After every step, failed or not,
   nothing may wait unreceived on the pipeline's communicators: a message
   a failed step left behind would be matched by a later step's receive
   (and MPI over UCX warns about each at MPI_Finalize). Built with
   SMP_TESTING. */
#define _POSIX_C_SOURCE 200809L
#define SMP_TESTING
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"
#include "net7.h"
#include "net7_train.h"

enum { STEPS = 200, M = 4, KINDS = 4 };
enum { K_MODULE, K_ALLOC, K_SEND, K_MESSAGE };
static const char *const kind_name[KINDS] = {"module", "allocation", "send", "message"};

static smp_model *start(net *n, int P, int world) {
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = M;
    cfg.ddp = world / P > 1 ? SMP_ON : SMP_OFF;
    cfg.auto_partition = P > 1 ? SMP_OFF : SMP_ON;
    cfg.timeout = 60;
    static const int placement[7] = {0, 0, 0, 1, 1, 1, 1};
    if (smp_init(&cfg)) return NULL;
    return build(n, P > 1 ? placement : NULL);
}

/* One training step of batch s: zero_grad, the step, SGD when it worked. */
static smp_status train(smp_model *model, int s) {
    static float x[B * D], t[B * C];
    batch(s, smp_dp_rank(), x, t);
    smp_model_zero_grad(model);
    smp_tensor xt = smp_tensor_2d(x, SMP_F32, B, D), tt = smp_tensor_2d(t, SMP_F32, B, C);
    smp_status st = SMP_TRAIN_STEP(model, mse_body, NULL, NULL, 0, xt, tt);
    if (!st) sgd(model);
    return st;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int world, me;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    int P = world >= 2 ? 2 : 1;
    if (world != 1 && world != 2 && world != 4) {
        test_skip("chaos", "runs on 1, 2 or 4 ranks");
        MPI_Finalize();
        return 0;
    }
    bool failed[STEPS] = {false};
    int injected[KINDS] = {0}, reported = 0, unchanged = 0, wrong = 0, left_behind = 0, steps_leaving = 0, moved = 0;
    uint64_t chaos_digest = 0;
    net n;
    smp_model *model = start(&n, P, world);
    MPI_CHECK(model != NULL, "chaos/start", "%s", smp_last_error());
    /* two clean steps: the trace, then one to count what a step allocates and sends on this rank */
    long per_step[KINDS] = {0};
    for (int s = 0; s < 2 && model; s++) {
        long a0 = smp_testing_events(SMP_FAULT_ALLOC), s0 = smp_testing_events(SMP_FAULT_SEND);
        smp_status st = train(model, s);
        MPI_CHECK(st == SMP_OK, "chaos/clean steps", "step %d: %s", s, smp_last_error());
        per_step[K_ALLOC] = smp_testing_events(SMP_FAULT_ALLOC) - a0;
        per_step[K_SEND] = per_step[K_MESSAGE] = smp_testing_events(SMP_FAULT_SEND) - s0;
    }
    uint64_t rng = 0x5eed;
    for (int s = 2; s < STEPS && model; s++) {
        bool inject = smp__splitmix(&rng) % 5 == 0;
        int kind = (int)(smp__splitmix(&rng) % KINDS), target = (int)(smp__splitmix(&rng) % (uint64_t)world);
        uint64_t pick = smp__splitmix(&rng);
        if (P == 1 && (kind == K_SEND || kind == K_MESSAGE)) kind = K_ALLOC; /* one partition sends nothing */
        g_fail = g_fail_mb = -1;
        if (inject && me == target) {
            if (kind == K_MODULE) { g_fail = smp_mp_rank(); g_fail_mb = (int)(pick % M);
            } else if (per_step[kind] > 0)
                smp_testing_fail(kind == K_ALLOC  ? SMP_FAULT_ALLOC
                                 : kind == K_SEND ? SMP_FAULT_SEND
                                                  : SMP_FAULT_MESSAGE,
                                 (long)(pick % (uint64_t)per_step[kind]));
        }
        /* a target without sends (the last stage sends only gradients back, so every rank sends) would inject nothing:
         * say so */
        int armed = inject && me == target && (kind == K_MODULE || per_step[kind] > 0), any = 0;
        MPI_Allreduce(&armed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        uint64_t before = digest(model);
        MPI_Comm comm = ((smp__pipe *)model->pipeline)->comm;
        smp_status st = train(model, s);
        moved += ((smp__pipe *)model->pipeline)->comm != comm; /* probing a fresh one would prove nothing */
        int left = pending_messages(model);
        left_behind += left;
        steps_leaving += left > 0;
        int bad = st != SMP_OK, all_bad = 0, some_bad = 0;
        MPI_Allreduce(&bad, &all_bad, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        MPI_Allreduce(&bad, &some_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        if (any) injected[kind]++;
        if (all_bad) { failed[s] = true; reported++; unchanged += digest(model) == before; }
        if (any != all_bad || some_bad != all_bad) {
            wrong++;
            if (wrong <= 3)
                printf("chaos: step %d (%s injected on rank %d: %s): this rank %s: %s\n", s, kind_name[kind], target,
                       any ? "yes" : "no", bad ? "failed" : "succeeded", bad ? smp_last_error() : "");
        }
        smp_testing_fail(SMP_FAULT_ALLOC, -1); /* disarm what did not fire */
        smp_testing_fail(SMP_FAULT_SEND, -1);
        smp_testing_fail(SMP_FAULT_MESSAGE, -1);
    }
    if (model) chaos_digest = digest(model);
    smp_model_free(model);
    smp_finalize();
    int total = injected[0] + injected[1] + injected[2] + injected[3];
    MPI_CHECK(wrong == 0, "chaos/every injected failure fails the step on every rank, and no other step fails",
              "%d steps went otherwise", wrong);
    MPI_CHECK(reported == total && total >= STEPS / 10, "chaos/failures reported", "%d injected, %d reported", total,
              reported);
    MPI_CHECK(unchanged == reported, "chaos/a failed step changes no parameter",
              "%d of %d failed steps changed a parameter", reported - unchanged, reported);
    MPI_CHECK(left_behind == 0 && moved == 0, "chaos/no step leaves a message unreceived",
              "%d messages were waiting after %d steps; %d steps replaced the communicator", left_behind, steps_leaving,
              moved);

    /* the clean run: the same batches, the failed ones skipped */
    g_fail = g_fail_mb = -1;
    model = start(&n, P, world);
    int clean_errors = 0;
    for (int s = 0; s < STEPS && model; s++)
        if (!failed[s]) clean_errors += train(model, s) != SMP_OK;
    bool same = model && clean_errors == 0 && digest(model) == chaos_digest;
    int nparams = 0;
    while (model && smp_model_local_param(model, nparams, false)) nparams++;
    MPI_CHECK(same, "chaos/the parameters equal a clean run that skipped the failed steps, bit for bit",
              "%d clean steps failed; digests %s", clean_errors, same ? "equal" : "differ");
    if (me == 0)
        printf("chaos: %d steps on %d ranks, failures injected: module %d, allocation %d, send %d, message %d; "
               "reported %d; %d parameters compared per rank\n",
               STEPS, world, injected[K_MODULE], injected[K_ALLOC], injected[K_SEND], injected[K_MESSAGE], reported,
               nparams);
    smp_model_free(model);
    smp_finalize();
    MPI_Finalize();
    return test_exit_code();
}
