/* test_timeout.c - a wait that can never finish must end the job.

   Rank 0 starts a collective (or waits for a message) that rank 1 never
   joins: rank 1 sleeps 30 s and leaves. With SMP_TIMEOUT=2 rank 0 must give
   up after about 2 s, say on stderr what it waited for and in which group,
   and abort the whole job (rank 1 included) with a non-zero status.

   Mode bad_args_world: rank 1 does call smp_all_reduce, but with an output
   tensor of the wrong size, so it returns an error there and then sleeps.
   Rank 0 must not wait for SMP_TIMEOUT: it learns of rank 1's failure and
   aborts the job with rank 1's message.

   This program does not judge itself: run it through test/run_timeout.sh,
   which times the job and reads its stderr.

     mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. -Itest test/test_timeout.c -o build/test_timeout -lm
     SMP_TIMEOUT=2 mpirun -n 2 build/test_timeout all_reduce_world
     modes: all_reduce_world   all_reduce on SMP_WORLD
            all_reduce_mp      all_reduce on SMP_MP_GROUP (partitions = 2)
            recv_dp            smp_recv_from DP_GROUP rank 1 (ddp, partitions = 1)
            barrier_world      smp_barrier on SMP_WORLD
            bad_args_world     rank 1 fails all_reduce on SMP_WORLD (bad out)
*/
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#define SMP_IMPLEMENTATION
#include "smp.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "all_reduce_world";
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != 2) {
        if (rank == 0) fprintf(stderr, "test_timeout: run with mpirun -n 2\n");
        MPI_Finalize();
        return 2;
    }
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.partitions = strcmp(mode, "all_reduce_mp") == 0 ? 2 : 1;
    if (cfg.partitions == 1) cfg.ddp = SMP_ON;
    if (smp_init(&cfg) != SMP_OK) {
        fprintf(stderr, "test_timeout: smp_init: %s\n", smp_last_error());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (rank == 0) fprintf(stderr, "test_timeout: mode %s, timeout %g s\n", mode, smp_timeout());

    float x[1000];
    for (int i = 0; i < 1000; i++) x[i] = (float)i;
    smp_tensor t = smp_tensor_1d(x, SMP_F32, 1000);
    if (rank == 1 && strcmp(mode, "bad_args_world") == 0) {
        smp_tensor short_out = smp_tensor_1d(x, SMP_F32, 999);
        smp_status st = smp_all_reduce(&t, &short_out, SMP_SUM, SMP_WORLD);
        fprintf(stderr, "test_timeout: rank 1's all_reduce returned %s: %s\n", smp_status_name(st), smp_last_error());
        if (st != SMP_ERR_ARG) MPI_Abort(MPI_COMM_WORLD, 0); /* status 0: the script reports it */
    }
    if (rank == 1) {
        /* never joins; the job should be gone long before this ends */
        struct timespec ts = {30, 0};
        nanosleep(&ts, NULL);
        smp_finalize();
        MPI_Finalize();
        return 0;
    }
    smp_status st = SMP_OK;
    if (strcmp(mode, "all_reduce_world") == 0 || strcmp(mode, "bad_args_world") == 0)
        st = smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD);
    else if (strcmp(mode, "all_reduce_mp") == 0) st = smp_all_reduce(&t, &t, SMP_SUM, SMP_MP_GROUP);
    else if (strcmp(mode, "barrier_world") == 0) st = smp_barrier(SMP_WORLD);
    else if (strcmp(mode, "recv_dp") == 0) {
        void *buf = NULL;
        size_t len = 0;
        st = smp_recv_from(1, SMP_DP_GROUP, &buf, &len);
    } else {
        fprintf(stderr, "test_timeout: unknown mode %s\n", mode);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    /* reaching this line means the wait returned although rank 1 never came */
    fprintf(stderr, "test_timeout: the wait returned (%s: %s) instead of timing out\n", smp_status_name(st),
            smp_last_error());
    MPI_Abort(MPI_COMM_WORLD, 0); /* exit status 0 on purpose: the script reports it */
    return 0;
}
