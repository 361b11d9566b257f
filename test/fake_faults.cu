/* fake_faults.cu - smp_nccl.h when NCCL fails, on test/fake_cuda.c's CPU
   device (a real GPU cannot fail on demand). Two ranks, a GPU each.

     fake_faults async    NCCL reports an asynchronous error on the world
                          communicator of every rank: smp_nccl_synchronize
                          returns it on every rank instead of waiting, the
                          communicator is aborted, later device collectives
                          fail with a message, and smp_finalize returns.
     fake_faults p2p      the same for point-to-point: both ranks' channels
                          fail; smp_nccl_test reports it on both.
     fake_faults timeout  rank 1 never joins rank 0's all-reduce: rank 0's
                          wait passes SMP_TIMEOUT, and the job is aborted
                          with a message naming what it waited for
                          (test/run_fake_cuda.sh checks the message and the
                          time).
     fake_faults p2p-timeout  rank 1 never sends what rank 0 receives: the
                          message names rank 1. */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_nccl.h"
#include "test.h"
#include "fake_twins.h"

#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    (void)test_report;
    const char *mode = argc > 1 ? argv[1] : "async";
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.ddp = SMP_ON;
    smp_status st = smp_init(&cfg);
    MPI_CHECK(st == SMP_OK && smp_nccl_current_mode() == SMP_NCCL_MODE_NCCL, "fake-gpu faults: init on the NCCL path",
              "%s (mode %s)", st ? smp_last_error() : "", smp_nccl_mode_name(smp_nccl_current_mode()));
    if (st) { MPI_Finalize(); return 1; }
    enum { N = 1000 };
    float h[N];
    for (int i = 0; i < N; i++) h[i] = (float)i;
    float *d = (float *)smp_nccl_alloc(sizeof h);
    cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice);
    smp_tensor t = smp_tensor_1d(d, SMP_F32, N);
    t.device = smp_nccl_device();

    if (strcmp(mode, "timeout") == 0) {
        if (smp_rank() == 0) {
            smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD);
            smp_nccl_synchronize(); /* must not return: the deadline aborts the job */
            printf("FAIL: fake-gpu faults: timeout: smp_nccl_synchronize returned (%s)\n", smp_last_error());
            fflush(stdout);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        MPI_Finalize();
        return 1;
    }

    if (strcmp(mode, "p2p") == 0 || strcmp(mode, "p2p-timeout") == 0) {
        int peer = 1 - smp_rank();
        st = smp_nccl_p2p_connect(SMP_WORLD, &peer, 1);
        MPI_CHECK(st == SMP_OK, "fake-gpu faults: p2p connect", "%s", smp_last_error());
        if (strcmp(mode, "p2p-timeout") == 0) {
            if (smp_rank() == 0) {
                smp_nccl_request *r = NULL;
                smp_nccl_irecv(d, sizeof h, 1, SMP_WORLD, &r);
                smp_nccl_synchronize(); /* must not return */
                printf("FAIL: fake-gpu faults: p2p-timeout: smp_nccl_synchronize returned (%s)\n", smp_last_error());
                fflush(stdout);
            }
            MPI_Barrier(MPI_COMM_WORLD);
            MPI_Finalize();
            return 1;
        }
        fake_nccl_fail_next(); /* this rank's channel fails */
        smp_nccl_request *r = NULL;
        st = smp_rank() == 0 ? smp_nccl_isend(d, sizeof h, 1, SMP_WORLD, &r)
                             : smp_nccl_irecv(d, sizeof h, 0, SMP_WORLD, &r);
        bool done = false;
        double t0 = MPI_Wtime();
        while (!st && !done && MPI_Wtime() - t0 < 30) st = smp_nccl_test(r, &done);
        const char *why = smp_last_error();
        MPI_CHECK(st == SMP_ERR_DEVICE && strstr(why, "point-to-point communicator") && strstr(why, "injected failure"),
                  "fake-gpu faults: smp_nccl_test reports a failed channel on both ends",
                  "status %d, done %d after %.1f s: %s", (int)st, (int)done, MPI_Wtime() - t0, why);
        smp_nccl_free(d);
        smp_finalize();
        MPI_CHECK(true, "fake-gpu faults: smp_finalize returns after a failed channel", "%s", "");
        MPI_Finalize();
        return test_exit_code();
    }

    fake_nccl_fail_next(); /* the all-reduce's communicator fails on every rank */
    smp_status queued = smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD);
    MPI_CHECK(queued == SMP_OK, "fake-gpu faults: a collective on a failing communicator is still queued", "%s",
              smp_last_error());
    double t0 = MPI_Wtime();
    st = smp_nccl_synchronize();
    const char *why = smp_last_error();
    MPI_CHECK(st == SMP_ERR_DEVICE && strstr(why, "NCCL reported an error on the world communicator") &&
                  strstr(why, "injected failure"),
              "fake-gpu faults: smp_nccl_synchronize reports NCCL's asynchronous error on every rank",
              "status %d after %.1f s: %s", (int)st, MPI_Wtime() - t0, why);
    st = smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD);
    MPI_CHECK(st != SMP_OK && strstr(smp_last_error(), "smp_all_reduce"),
              "fake-gpu faults: a collective after the communicator was aborted fails with a message", "status %d: %s",
              (int)st, smp_last_error());
    smp_nccl_free(d);
    smp_finalize();
    MPI_CHECK(true, "fake-gpu faults: smp_finalize returns after a failed communicator", "%s", "");
    MPI_Finalize();
    return test_exit_code();
}
