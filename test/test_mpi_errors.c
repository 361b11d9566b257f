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
   until the step runs clean), on net7.h's model, on it with fc2 tied to
   fc1 (a shared module on two partitions: its gradients' exchange between
   them fails at each of its calls) and with fc1 + skip a recomputed
   composite call: every failure must also leave no message queued for a
   later step, and the parameters at the end must equal, bit for bit, a
   clean run's that skipped the failed steps. A failed step run again without
   smp_model_zero_grad adds its gradients once, or, on top of an earlier
   step's, is refused until smp_model_zero_grad (retry_tests). The error handlers of the engine's
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

/* The models: net7.h's, with fc2 tied to fc1, with fc1 + skip one recomputed composite call. */
enum { NET_PLAIN, NET_TIED, NET_COMPOSITE };
static const char *const variant_name[] = {"net7", "tied", "composite"};

static smp_model *start_as(net *n, int P, bool ddp, int variant) {
    smp_config cfg = {0};
    cfg.comm = engine;
    cfg.partitions = P;
    cfg.microbatches = M;
    cfg.ddp = ddp ? SMP_ON : SMP_OFF;
    cfg.timeout = 60;
    /* by bytes, not measured times: runs compared bit for bit must place every module alike (the digests are of
       this rank's parameters) */
    cfg.optimize = SMP_OPTIMIZE_MEMORY;
    if (smp_init(&cfg)) return NULL;
    if (variant == NET_TIED) net_modules_tied(n, NULL);
    else net_modules(n, NULL, &net_host_fns);
    if (variant == NET_COMPOSITE) net_block(n, true);
    return net_model(n, false);
}
static smp_model *start(net *n, int P, bool ddp) { return start_as(n, P, ddp, NET_PLAIN); }

/* Step s's batch, forward and backward (gradients added into, no update). */
static smp_status backward_only(smp_model *model, int s) {
    static float x[B * D], t[B * C];
    batch(s, smp_dp_rank(), x, t);
    smp_tensor xt = smp_tensor_2d(x, SMP_F32, B, D), tt = smp_tensor_2d(t, SMP_F32, B, C);
    return SMP_TRAIN_STEP(model, mse_body, NULL, NULL, 0, xt, tt);
}
static smp_status train(smp_model *model, int s) {
    smp_model_zero_grad(model);
    smp_status st = backward_only(model, s);
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
    return st == SMP_ERR_MPI && strstr(e, "MPI_") && strstr(e, " failed ") && strstr(e, "Other MPI error") &&
           strstr(e, purpose);
}

/* Runs step s with the n-th counted MPI call of this step failing on `target`
   (n < 0: none). *fired: the injection happened on some rank; *left: the
   messages the step left queued on this rank, counted before the ranks
   next meet (so no peer can have started the next step's sends). */
static smp_status step_failing_at(smp_model *model, int s, smp_testing_fault kind, int target, long n, bool *fired,
                                  int *left) {
    long before = smp_testing_events(kind);
    if (n >= 0 && smp_rank() == target) smp_testing_fail(kind, n);
    smp_status st = train(model, s);
    smp_testing_fail(kind, -1);
    *left = pending_messages(model);
    *fired = all_ranks(n >= 0 && smp_rank() == target && smp_testing_events(kind) - before > n, MPI_MAX) != 0;
    return st;
}
static smp_status step_failing(smp_model *model, int s, int target, long n, bool *fired, int *left) {
    return step_failing_at(model, s, SMP_FAULT_MPI, target, n, fired, left);
}

/* The sweep: every counted call of a step, in turn, failing on `target`,
   on a pipeline over every rank, then the clean run of the same batches
   without the failed ones. */
enum { MAX_SWEEP_STEPS = 4096 };
static void sweep(int world, int variant, int target) {
    static bool failed[MAX_SWEEP_STEPS];
    static uint64_t after[MAX_SWEEP_STEPS]; /* this rank's parameters after each step, to find the first that differs */
    static long failed_at[MAX_SWEEP_STEPS];
    memset(failed, 0, sizeof failed);
    const char *name = variant_name[variant];
    net n;
    smp_model *model = start_as(&n, world, false, variant);
    MPI_CHECK(model != NULL, "mpi_errors/start the sweep", "%s: %s", name, smp_last_error());
    if (!model) return;
    int s = 0, clean = 0;
    for (; s < 2; s++) { /* the trace and the pipeline's set-up */
        clean += train(model, s) == SMP_OK;
        after[s] = digest(model);
    }
    int shared = all_ranks(((smp__pipe *)model->pipeline)->plan.nshared, MPI_MAX);
    MPI_CHECK(clean == 2 && (variant != NET_TIED || world == 1 || shared > 0), "mpi_errors/sweep: the model trains",
              "%s: %d clean steps of 2, %d shared-module copies: %s", name, clean, shared, smp_last_error());
    int failures = 0, wrong = 0, recoveries = 0, left_total = 0;
    /* first each rank failing its step after the step's last message: its
       peers have received all it sent (the shared module's gradients too),
       and the clean-up must count every one of them */
    for (int r = 0; r < world; r++) {
        uint64_t before = digest(model);
        bool fired;
        int left;
        smp_status st = step_failing_at(model, s, SMP_FAULT_STEP_END, r, 0, &fired, &left);
        failed_at[s] = -1 - r;
        after[s] = digest(model);
        failed[s++] = true;
        bool good = fired && st == SMP_ERR_MPI && digest(model) == before && left == 0;
        if (!all_ranks(good, MPI_LAND) && wrong++ < 3)
            printf("sweep %s: a late failure on rank %d: %s: %s; %d messages left\n", name, r, smp_status_name(st),
                   smp_last_error(), left);
    }
    /* every call up to the 32nd, then every 2nd, ... (with 4 ranks sharing
       2 cores a step's waits poll hundreds of times, each poll a call) */
    long k = 0, tried = 0;
    for (; s < MAX_SWEEP_STEPS - 2; k += 1 + k / 32, tried++) {
        uint64_t before = digest(model);
        bool fired;
        int left;
        smp_status st = step_failing(model, s, target, k, &fired, &left);
        left_total += left;
        after[s] = digest(model);
        if (!fired) {
            wrong += st != SMP_OK;
            s++;
            break;
        }
        failed_at[s] = k;
        failed[s++] = true;
        failures++;
        bool good = st == SMP_ERR_MPI && strstr(smp_last_error(), " failed ") && digest(model) == before && left == 0;
        if (!all_ranks(good, MPI_LAND) && wrong++ < 3)
            printf("sweep %s: call %ld on rank %d: %s: %s; %d messages left\n", name, k, target, smp_status_name(st),
                   smp_last_error(), left);
        /* the step after a failure, every 8th time (the sweep's next step is another) */
        if (failures % 8 == 1) {
            recoveries += train(model, s) == SMP_OK;
            after[s++] = digest(model);
        }
    }
    uint64_t swept = digest(model);
    smp_model_free(model);
    smp_finalize();
    char what[320];
    snprintf(what, sizeof what,
             "mpi_errors/sweep %s, rank %d failing: each MPI call of a step failing in turn (the first 32, then "
             "spaced; and each "
             "rank failing after its last message) fails the step on every rank, leaves no message queued, and the "
             "next step succeeds",
             name, target);
    MPI_CHECK(wrong == 0 && failures == tried && failures > 0 && recoveries == (failures + 7) / 8 &&
                  all_ranks(left_total, MPI_MAX) == 0,
              what, "%d of %ld went otherwise, %d recovered, %d messages left queued here", wrong, tried + world,
              recoveries, left_total);
    model = start_as(&n, world, false, variant);
    int clean_errors = 0, first_differing = -1;
    for (int c = 0; c < s && model; c++) {
        if (failed[c]) continue;
        clean_errors += train(model, c) != SMP_OK;
        if (first_differing < 0 && digest(model) != after[c]) first_differing = c;
    }
    bool same = model && clean_errors == 0 && digest(model) == swept;
    if (first_differing >= 0) {
        int c = first_differing, f = c - 1;
        while (f >= 0 && !failed[f]) f--;
        printf(
            "sweep %s: rank %d's parameters first differ after step %d; the failed step before it, %d, failed %s %ld\n",
            name, smp_rank(), c, f, f >= 0 && failed_at[f] < 0 ? "after the last message on rank" : "at MPI call",
            f < 0              ? 0
            : failed_at[f] < 0 ? -1 - failed_at[f]
                               : failed_at[f]);
    }
    snprintf(what, sizeof what,
             "mpi_errors/sweep %s, rank %d failing: the parameters equal a clean run's that skipped the failed steps, "
             "bit for bit",
             name, target);
    MPI_CHECK(all_ranks(same, MPI_LAND), what, "%d clean steps failed; this rank's digests %s", clean_errors,
              same ? "equal" : "differ");
    if (smp_rank() == 0)
        printf("mpi_errors: sweep %s over %ld of the %ld MPI calls of a step on rank %d\n", name, tried, k, target);
    smp_model_free(model);
    smp_finalize();
}

/* A failed step's gradients, the step run again without smp_model_zero_grad
   (the engine's retry after freeing memory): begun on zeroed gradients, the
   retry must add the step's sums once (the failure zeroes them again);
   begun on an earlier step's sums (accumulation), the retry must be refused
   on every rank until smp_model_zero_grad, never count part of the failed
   step twice. Each failure comes after the last rank's last message, when
   every gradient has been added. A pipeline over the world, its tied and
   composite variants, and data parallelism. */
static void retry_tests(int world) {
    for (int c = 0; c < 4; c++) {
        int P = c == 2 ? 1 : world, variant = c == 1 ? NET_TIED : c == 3 ? NET_COMPOSITE : NET_PLAIN;
        bool ddp = c == 2;
        if (ddp && world == 1) continue;
        char name[64];
        snprintf(name, sizeof name, "%s, %d partitions%s", variant_name[variant], P, ddp ? ", ddp" : "");
        net n;
        smp_model *model = start_as(&n, P, ddp, variant);
        MPI_CHECK(model != NULL, "mpi_errors/retry: start", "%s: %s", name, smp_last_error());
        if (!model) return;
        smp_status first = train(model, 0);
        smp_model_zero_grad(model);
        if (smp_rank() == world - 1) smp_testing_fail(SMP_FAULT_STEP_END, 0);
        smp_status failed = backward_only(model, 1);
        smp_testing_fail(SMP_FAULT_STEP_END, -1);
        smp_status again = backward_only(model, 1);
        if (!again) sgd(model);
        uint64_t retried = digest(model);
        /* accumulation: step 2's sums kept, step 3 failing on top of them */
        smp_model_zero_grad(model);
        smp_status kept = backward_only(model, 2);
        if (smp_rank() == world - 1) smp_testing_fail(SMP_FAULT_STEP_END, 0);
        smp_status failed2 = backward_only(model, 3);
        smp_testing_fail(SMP_FAULT_STEP_END, -1);
        uint64_t before = digest(model);
        smp_status refused = backward_only(model, 3);
        char refusal[sizeof smp__errbuf];
        snprintf(refusal, sizeof refusal, "%s", smp_last_error());
        bool refused_well =
            refused == SMP_ERR_STATE && strstr(refusal, "smp_model_zero_grad") && digest(model) == before;
        smp_model_zero_grad(model);
        smp_status after = backward_only(model, 3);
        smp_model_free(model);
        smp_finalize();
        model = start_as(&n, P, ddp, variant);
        smp_status clean = model ? train(model, 0) : SMP_ERR_STATE;
        if (!clean) clean = train(model, 1);
        bool same = !clean && digest(model) == retried;
        char what[256];
        snprintf(what, sizeof what, "mpi_errors/retry %s: a step that failed on zeroed gradients, run again without "
                 "smp_model_zero_grad, equals one clean step bit for bit", name);
        MPI_CHECK(all_ranks(!first && failed == SMP_ERR_MPI && !again && same, MPI_LAND), what,
                  "first %s, failed %s, again %s, clean %s; this rank's parameters %s", smp_status_name(first),
                  smp_status_name(failed), smp_status_name(again), smp_status_name(clean), same ? "equal" : "differ");
        snprintf(what, sizeof what, "mpi_errors/retry %s: a step that failed on an earlier step's gradients is refused "
                 "on every rank until smp_model_zero_grad", name);
        MPI_CHECK(all_ranks(!kept && failed2 == SMP_ERR_MPI && refused_well && !after, MPI_LAND), what,
                  "kept %s, failed %s, refused %s (%.300s), after zero_grad %s", smp_status_name(kept),
                  smp_status_name(failed2), smp_status_name(refused), refusal, smp_status_name(after));
        if (model) smp_model_free(model);
        smp_finalize();
    }
}

static void check_handlers(const char *when) {
    MPI_Errhandler e, w;
    MPI_Comm_get_errhandler(engine, &e);
    MPI_Comm_get_errhandler(MPI_COMM_WORLD, &w);
    char name[128];
    snprintf(name, sizeof name,
             "mpi_errors/%s: the engine's communicator keeps MPI_ERRORS_RETURN, MPI_COMM_WORLD MPI_ERRORS_ARE_FATAL",
             when);
    MPI_CHECK(e == MPI_ERRORS_RETURN && w == MPI_ERRORS_ARE_FATAL, name, "engine %s, world %s",
              e == MPI_ERRORS_RETURN ? "kept" : "changed", w == MPI_ERRORS_ARE_FATAL ? "kept" : "changed");
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
    MPI_CHECK(own == MPI_ERRORS_RETURN, "mpi_errors/smp's own communicators return errors (MPI_ERRORS_RETURN)",
              "another handler");
    MPI_Errhandler_free(&own);
    check_handlers("after smp_init");
    smp_status st = train(model, 0); /* the trace and the pipeline's set-up */
    if (!st) st = train(model, 1);
    MPI_CHECK(st == SMP_OK, "mpi_errors/clean steps", "%s", smp_last_error());
    int s = 2;
    {
        /* (a): the first counted call of the last rank's step: a receive it
           posts, or in one process the poll for failure notices */
        uint64_t before = digest(model);
        bool fired;
        int left;
        st = step_failing(model, s++, world - 1, 0, &fired, &left);
        bool ok =
            fired && mpi_error(st, world > 1 ? "from mp rank" : "(MP_GROUP)") && digest(model) == before && left == 0;
        MPI_CHECK(ok,
                  "mpi_errors/(a) an MPI failure in a pipeline step: SMP_ERR_MPI on every rank, no parameter changed",
                  "fired %d, %s: %s", fired, smp_status_name(st), smp_last_error());
        st = train(model, s++);
        MPI_CHECK(st == SMP_OK, "mpi_errors/(a) the next step succeeds", "%s", smp_last_error());

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
              "mpi_errors/(d) an MPI failure in a save: SMP_ERR_MPI on every rank, no parameter changed",
              "fired %d, %s: %s", fired, smp_status_name(st), smp_last_error());
    st = smp_load(model, path, NULL);
    MPI_CHECK(st == SMP_OK && digest(model) == saved, "mpi_errors/(d) the previous checkpoint loads", "%s: %s",
              smp_status_name(st), st ? smp_last_error() : "parameters differ");
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
              "mpi_errors/(b) an MPI failure in smp_all_reduce: SMP_ERR_MPI on every rank, the output untouched",
              "%s: %s", smp_status_name(st), smp_last_error());
    st = smp_all_reduce(&ti, &to, SMP_SUM, SMP_WORLD);
    float want = (float)(world * (world - 1) / 2);
    MPI_CHECK(st == SMP_OK && out[0] == want && out[7] == want + 7.0f * (float)world,
              "mpi_errors/(b) the next all_reduce is right", "%s: %g", smp_last_error(), (double)out[0]);

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
        /* no more calls: the step ran clean */
        if (all_ranks(smp_testing_events(SMP_FAULT_MPI) - e > k, MPI_MIN) == 0) return -1;
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
              "mpi_errors/(c) every replica makes the same number of counted MPI calls in a step", "%s; %ld here",
              smp_last_error(), counted);
    int s = 2;
    smp_status st_bucket;
    long k = find_bucket_call(model, &s, &st_bucket);
    st = st_bucket;
    bool bucket = k >= 0, wrong = k == -2;
    MPI_CHECK(
        bucket && !wrong,
        "mpi_errors/(c) an MPI failure in the gradient all-reduce: SMP_ERR_MPI on every rank, no parameter changed",
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
        if (st)
            fprintf(stderr, "rank %d: smp_all_reduce returned %s: %s\n", smp_rank(), smp_status_name(st),
                    smp_last_error());
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
        if (st)
            fprintf(stderr, "rank %d: the step returned %s: %s\n", smp_rank(), smp_status_name(st), smp_last_error());
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
    sweep(world, NET_PLAIN, world - 1);
    /* the shared module's copies exchange gradients: a failure on either side of it */
    sweep(world, NET_TIED, world - 1);
    if (world > 1) sweep(world, NET_TIED, 0);
    sweep(world, NET_COMPOSITE, world - 1);
    ddp_tests(world);
    retry_tests(world);
    check_handlers("at the end");
    MPI_Comm_free(&engine);
    MPI_Finalize();
    return test_exit_code();
}
