/* test_mpi_errors.c - MPI failures come back as errors, on every rank.

   The engine starts MPI itself, sets MPI_ERRORS_RETURN on its own
   communicator and hands that to smp_init. SMP_FAULT_MPI then makes the
   n-th MPI call whose failure smp returns as a status report MPI_ERR_OTHER
   (the call is skipped), during
     (a) a pipeline training step,
     (b) a host collective (smp_all_reduce; the same call fails on every
         rank: a failure on some members makes a member waiting for them
         abort, which test/run_mpi_errors.sh checks),
     (c) a data-parallel step's gradient all-reduce (every replica's bucket
         collective fails: one-sided, the others abort, run_mpi_errors.sh),
     (d) a checkpoint save,
   and each must return SMP_ERR_MPI on every rank with a message naming the
   MPI call and what it was for, change no parameter (the previous
   checkpoint still loads), and the next call must succeed. A sweep fails
   each such call of one training step in turn on one rank (n = 0, 1, ...
   until the step runs clean). The error handlers of the engine's
   communicator and of MPI_COMM_WORLD are the same after smp_init and
   smp_finalize as before.

   Modes for test/run_mpi_errors.sh (the job must abort with the message):
     one_sided_collective  rank 1's smp_all_reduce fails; rank 0 waits in it
     one_sided_bucket      rank 1's gradient bucket fails; rank 0 waits in it */
#define _POSIX_C_SOURCE 200809L
#define SMP_TESTING
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h"
#include "test.h"
#include "net7.h"
#include "net7_train.h"

enum { M = 4 };
static MPI_Comm engine; /* the engine's communicator, MPI_ERRORS_RETURN set by the engine */

static smp_model *start(net *n, int P, bool ddp) {
    smp_config cfg = {0};
    cfg.comm = engine;
    cfg.partitions = P;
    cfg.microbatches = M;
    cfg.ddp = ddp ? SMP_ON : SMP_OFF;
    cfg.timeout = 60;
    if (smp_init(&cfg)) return NULL;
    return build(n, NULL);
}

static smp_status train(smp_model *model, int s) {
    static float x[B * D], t[B * C];
    batch(s, smp_dp_rank(), x, t);
    smp_model_zero_grad(model);
    smp_tensor xt = smp_tensor_2d(x, SMP_F32, B, D), tt = smp_tensor_2d(t, SMP_F32, B, C);
    smp_status st = SMP_TRAIN_STEP(model, mse_body, NULL, NULL, 0, xt, tt);
    if (!st) sgd(model);
    return st;
}

static int all_ranks(int v, MPI_Op op) {
    int r = 0;
    MPI_Allreduce(&v, &r, 1, MPI_INT, op, MPI_COMM_WORLD);
    return r;
}

/* SMP_ERR_MPI naming an MPI call, MPI's text and `purpose` (a fixed string in the message). */
static bool mpi_error(smp_status st, const char *purpose) {
    const char *e = smp_last_error();
    return st == SMP_ERR_MPI && strstr(e, "MPI_") && strstr(e, " failed ") && strstr(e, "Other MPI error") && strstr(e, purpose);
}

/* Runs step s with the n-th counted MPI call of this step failing on `target`
   (n < 0: none). *fired: the injection happened on some rank. */
static smp_status step_failing(smp_model *model, int s, int target, long n, bool *fired) {
    long before = smp_testing_events(SMP_FAULT_MPI);
    if (n >= 0 && smp_rank() == target) smp_testing_fail(SMP_FAULT_MPI, n);
    smp_status st = train(model, s);
    smp_testing_fail(SMP_FAULT_MPI, -1);
    *fired = all_ranks(n >= 0 && smp_rank() == target && smp_testing_events(SMP_FAULT_MPI) - before > n, MPI_MAX) != 0;
    return st;
}

static void check_handlers(const char *when) {
    MPI_Errhandler e, w;
    MPI_Comm_get_errhandler(engine, &e);
    MPI_Comm_get_errhandler(MPI_COMM_WORLD, &w);
    char name[128];
    snprintf(name, sizeof name, "mpi_errors/%s: the engine's communicator keeps MPI_ERRORS_RETURN, MPI_COMM_WORLD MPI_ERRORS_ARE_FATAL", when);
    MPI_CHECK(e == MPI_ERRORS_RETURN && w == MPI_ERRORS_ARE_FATAL, name, "engine %s, world %s", e == MPI_ERRORS_RETURN ? "kept" : "changed",
              w == MPI_ERRORS_ARE_FATAL ? "kept" : "changed");
    MPI_Errhandler_free(&e);
    MPI_Errhandler_free(&w);
}

/* (a) and the sweep: a pipeline over every rank (no data parallelism). */
static void pipeline_tests(int world) {
    net n;
    smp_model *model = start(&n, world, false);
    MPI_CHECK(model != NULL, "mpi_errors/start pipeline", "%s", smp_last_error());
    if (!model) return;
    MPI_Errhandler own;
    MPI_Comm_get_errhandler(smp_group_comm(SMP_WORLD), &own);
    MPI_CHECK(own == MPI_ERRORS_RETURN, "mpi_errors/smp's own communicators return errors (MPI_ERRORS_RETURN)", "another handler");
    MPI_Errhandler_free(&own);
    check_handlers("after smp_init");
    smp_status st = train(model, 0); /* the trace and the pipeline's set-up */
    long e0 = smp_testing_events(SMP_FAULT_MPI);
    if (!st) st = train(model, 1);
    long per_step = all_ranks((int)(smp_testing_events(SMP_FAULT_MPI) - e0), MPI_MIN);
    MPI_CHECK(st == SMP_OK, "mpi_errors/clean steps", "%s", smp_last_error());
    int s = 2;
    {
        /* (a): the first counted call of the last rank's step: a receive it
           posts, or in one process the poll for failure notices */
        uint64_t before = digest(model);
        bool fired;
        st = step_failing(model, s++, world - 1, 0, &fired);
        bool ok = fired && mpi_error(st, world > 1 ? "from mp rank" : "(MP_GROUP)") && digest(model) == before;
        MPI_CHECK(ok, "mpi_errors/(a) an MPI failure in a pipeline step: SMP_ERR_MPI on every rank, no parameter changed", "fired %d, %s: %s",
                  fired, smp_status_name(st), smp_last_error());
        st = train(model, s++);
        MPI_CHECK(st == SMP_OK, "mpi_errors/(a) the next step succeeds", "%s", smp_last_error());

        /* the sweep: every counted call of a step, in turn, on the last rank */
        int failures = 0, wrong = 0, recoveries = 0;
        long k = 0;
        for (;; k++) {
            before = digest(model);
            st = step_failing(model, s++, world - 1, k, &fired);
            if (!fired) {
                wrong += st != SMP_OK;
                break;
            }
            failures++;
            bool good = st == SMP_ERR_MPI && strstr(smp_last_error(), " failed ") && digest(model) == before;
            if (!all_ranks(good, MPI_LAND)) {
                if (wrong++ < 3) printf("sweep: call %ld: %s: %s\n", k, smp_status_name(st), smp_last_error());
            }
            /* the step after a failure, every 8th time (the sweep's next step is another) */
            if (failures % 8 == 1) recoveries += train(model, s++) == SMP_OK;
        }
        MPI_CHECK(wrong == 0 && failures == k && failures > 0 && recoveries == (failures + 7) / 8,
                  "mpi_errors/sweep: each MPI call of a pipeline step failing in turn fails the step on every rank, and the next succeeds",
                  "%d of %ld went otherwise, %d recovered", wrong, k, recoveries);
        if (smp_rank() == 0) printf("mpi_errors: sweep over %ld MPI calls of a step on rank %d (%ld counted in a clean step)\n", k, world - 1, per_step);
    }

    /* (d) a save: the first counted call of a save fails on the last rank */
    char path[256];
    snprintf(path, sizeof path, "%s/smp_mpi_errors_%ld", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (long)getpid());
    MPI_Bcast(path, (int)sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD);
    st = smp_save(model, path, NULL);
    MPI_CHECK(st == SMP_OK, "mpi_errors/(d) a clean save", "%s", smp_last_error());
    uint64_t saved = digest(model);
    st = train(model, s++);
    uint64_t trained = digest(model);
    bool fired;
    long before = smp_testing_events(SMP_FAULT_MPI);
    if (smp_rank() == world - 1) smp_testing_fail(SMP_FAULT_MPI, 0);
    st = smp_save(model, path, NULL);
    smp_testing_fail(SMP_FAULT_MPI, -1);
    fired = all_ranks(smp_rank() == world - 1 && smp_testing_events(SMP_FAULT_MPI) > before, MPI_MAX) != 0;
    MPI_CHECK(fired && mpi_error(st, "checkpoint") && digest(model) == trained,
              "mpi_errors/(d) an MPI failure in a save: SMP_ERR_MPI on every rank, no parameter changed", "fired %d, %s: %s", fired,
              smp_status_name(st), smp_last_error());
    st = smp_load(model, path, NULL);
    MPI_CHECK(st == SMP_OK && digest(model) == saved, "mpi_errors/(d) the previous checkpoint loads", "%s: %s", smp_status_name(st),
              st ? smp_last_error() : "parameters differ");
    st = smp_save(model, path, NULL);
    MPI_CHECK(st == SMP_OK, "mpi_errors/(d) the next save succeeds", "%s", smp_last_error());
    if (smp_rank() == 0) { /* the files of the partial checkpoint */
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -f '%s' '%s'.*", path, path);
        if (system(cmd) != 0) printf("could not remove %s*\n", path);
    }

    /* (b) a host collective whose MPI call fails on every rank */
    float in[8], out[8], old[8];
    for (int i = 0; i < 8; i++) { in[i] = (float)(smp_rank() + i); out[i] = old[i] = -1.0f; }
    smp_tensor ti = smp_tensor_1d(in, SMP_F32, 8), to = smp_tensor_1d(out, SMP_F32, 8);
    smp_testing_fail(SMP_FAULT_MPI, 0);
    st = smp_all_reduce(&ti, &to, SMP_SUM, SMP_WORLD);
    smp_testing_fail(SMP_FAULT_MPI, -1);
    MPI_CHECK(mpi_error(st, "all_reduce in world") && memcmp(out, old, sizeof out) == 0,
              "mpi_errors/(b) an MPI failure in smp_all_reduce: SMP_ERR_MPI on every rank, the output untouched", "%s: %s", smp_status_name(st),
              smp_last_error());
    st = smp_all_reduce(&ti, &to, SMP_SUM, SMP_WORLD);
    float want = (float)(world * (world - 1) / 2);
    MPI_CHECK(st == SMP_OK && out[0] == want && out[7] == want + 7.0f * (float)world, "mpi_errors/(b) the next all_reduce is right", "%s: %g",
              smp_last_error(), (double)out[0]);

    smp_model_free(model);
    smp_finalize();
    check_handlers("after smp_finalize");
}

/* Fails the k-th counted MPI call of a step on every rank, k = 0, 1, ...,
   until the failure is a gradient bucket's collective: that k (every rank
   the same: one partition, so every replica makes the same calls), -1 when
   no call was one, -2 when a step went otherwise than failing on every
   rank with SMP_ERR_MPI and changing no parameter, or the step after it
   failed. *st: the status of the last failed step. */
static long find_bucket_call(smp_model *model, int *s, smp_status *st) {
    for (long k = 0;; k++) {
        uint64_t before = digest(model);
        smp_testing_fail(SMP_FAULT_MPI, k);
        long e = smp_testing_events(SMP_FAULT_MPI);
        smp_status r = train(model, (*s)++);
        smp_testing_fail(SMP_FAULT_MPI, -1);
        if (all_ranks(smp_testing_events(SMP_FAULT_MPI) - e > k, MPI_MIN) == 0) return -1; /* no more calls: the step ran clean */
        *st = r;
        int bucket = all_ranks(mpi_error(r, "data-parallel gradient bucket"), MPI_LAND);
        int wrong = !all_ranks(r == SMP_ERR_MPI && digest(model) == before, MPI_LAND);
        if (train(model, (*s)++)) wrong = 1;
        if (wrong) return -2;
        if (bucket) return k;
    }
}

/* (c): one partition, data parallelism over every rank: a step's only
   counted MPI calls are its gradient buckets' collectives, the same on
   every replica, so failing the n-th on every rank fails the same bucket. */
static void ddp_tests(int world) {
    if (world == 1) {
        test_skip("mpi_errors/(c) data-parallel gradients", "one process has no replica to all-reduce with");
        return;
    }
    net n;
    smp_model *model = start(&n, 1, true);
    MPI_CHECK(model != NULL, "mpi_errors/start data parallel", "%s", smp_last_error());
    if (!model) return;
    smp_status st = train(model, 0);
    MPI_CHECK(st == SMP_OK, "mpi_errors/(c) a clean step", "%s", smp_last_error());
    long e0 = smp_testing_events(SMP_FAULT_MPI);
    st = train(model, 1);
    long counted = smp_testing_events(SMP_FAULT_MPI) - e0;
    MPI_CHECK(st == SMP_OK && all_ranks((int)counted, MPI_MIN) == all_ranks((int)counted, MPI_MAX) && counted > 0,
              "mpi_errors/(c) every replica makes the same number of counted MPI calls in a step", "%s; %ld here", smp_last_error(), counted);
    int s = 2;
    smp_status st_bucket;
    long k = find_bucket_call(model, &s, &st_bucket);
    st = st_bucket;
    bool bucket = k >= 0, wrong = k == -2;
    MPI_CHECK(bucket && !wrong, "mpi_errors/(c) an MPI failure in the gradient all-reduce: SMP_ERR_MPI on every rank, no parameter changed",
              "%s: %s", smp_status_name(st), smp_last_error());
    st = train(model, s);
    MPI_CHECK(st == SMP_OK, "mpi_errors/(c) the next step succeeds", "%s", smp_last_error());
    smp_model_free(model);
    smp_finalize();
}

/* For run_mpi_errors.sh: a failure on rank 1 only, in a collective rank 0 waits in. */
static int one_sided(const char *mode) {
    int rc = 1;
    if (!strcmp(mode, "one_sided_collective")) {
        smp_config cfg = {0};
        cfg.comm = engine;
        cfg.ddp = SMP_ON;
        cfg.timeout = 60;
        if (smp_init(&cfg)) {
            fprintf(stderr, "smp_init: %s\n", smp_last_error());
            return 1;
        }
        float v[4] = {1, 2, 3, 4};
        smp_tensor t = smp_tensor_1d(v, SMP_F32, 4);
        if (smp_rank() == 1) smp_testing_fail(SMP_FAULT_MPI, 0);
        smp_status st = smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD);
        if (st) fprintf(stderr, "rank %d: smp_all_reduce returned %s: %s\n", smp_rank(), smp_status_name(st), smp_last_error());
        /* rank 0 never gets here: it aborts the job with rank 1's message */
        smp_finalize();
        rc = 0;
    } else if (!strcmp(mode, "one_sided_bucket")) {
        net n;
        smp_model *model = start(&n, 1, true);
        int s = 0;
        if (!model || train(model, s++)) return 1;
        smp_status st;
        long k = find_bucket_call(model, &s, &st);
        if (k < 0) {
            fprintf(stderr, "no gradient bucket's MPI call found (%ld)\n", k);
            return 1;
        }
        if (smp_rank() == 1) smp_testing_fail(SMP_FAULT_MPI, k);
        st = train(model, s);
        if (st) fprintf(stderr, "rank %d: the step returned %s: %s\n", smp_rank(), smp_status_name(st), smp_last_error());
        smp_model_free(model);
        smp_finalize();
        rc = 0;
    }
    return rc;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_dup(MPI_COMM_WORLD, &engine);
    MPI_Comm_set_errhandler(engine, MPI_ERRORS_RETURN);
    int world;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc > 1) {
        int rc = one_sided(argv[1]);
        MPI_Comm_free(&engine);
        MPI_Finalize();
        return rc;
    }
    check_handlers("before smp_init");
    pipeline_tests(world);
    ddp_tests(world);
    check_handlers("at the end");
    MPI_Comm_free(&engine);
    MPI_Finalize();
    return test_exit_code();
}
