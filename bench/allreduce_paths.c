/* bench/allreduce_paths.c - what one small all-reduce costs through each
   path MPI offers, to choose smp_all_reduce's (see bench/RESULTS.md):
   blocking MPI_Allreduce, MPI_Iallreduce polled with MPI_Test, a persistent
   request (MPI_Allreduce_init) reducing in place in a staging buffer that
   the caller's data is copied into and out of (what smp does up to
   SMP__PERSIST_MAX_BYTES), the same with separate send and receive staging
   buffers (MPI then copies send to receive itself), a persistent
   request bound to the caller's buffers (no copies), and smp_all_reduce
   itself (what its checks and wait add to the path it takes).
   Build: make build/bench/allreduce_paths
   Run:   mpirun -n 2 build/bench/allreduce_paths
   Each figure is the best of 5 runs of 20000 calls; ratios are to blocking. */
#define SMP_IMPLEMENTATION
#include "smp.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BLOCKING, NONBLOCKING, PERSISTENT_IN_PLACE, PERSISTENT_TWO_BUFFERS, PERSISTENT_BOUND, SMP, NPATHS };

static void poll_until_done(MPI_Request *r) {
    int done = 0;
    while (!done) MPI_Test(r, &done, MPI_STATUS_IGNORE);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    smp_config cfg = {0};
    cfg.ddp = SMP_ON; /* the world is data-parallel replicas of nothing */
    if (smp_init(&cfg) != SMP_OK) {
        fprintf(stderr, "smp_init: %s\n", smp_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    static const int sizes[] = {1 << 10, 4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10};
    if (rank == 0)
        printf("%8s %12s %18s %18s %18s %18s %18s\n", "bytes", "blocking us", "iallreduce", "persist in place",
               "persist 2 buffers", "persist bound", "smp_all_reduce");
    for (int si = 0; si < (int)(sizeof sizes / sizeof *sizes); si++) {
        size_t bytes = (size_t)sizes[si];
        int n = (int)(bytes / sizeof(float));
        float *in = malloc(bytes), *out = malloc(bytes), *stage_in = malloc(bytes), *stage_out = malloc(bytes);
        for (int i = 0; i < n; i++) in[i] = (float)i;
        MPI_Request in_place, staged, bound;
        MPI_Allreduce_init(MPI_IN_PLACE, stage_out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, MPI_INFO_NULL, &in_place);
        MPI_Allreduce_init(stage_in, stage_out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, MPI_INFO_NULL, &staged);
        MPI_Allreduce_init(in, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, MPI_INFO_NULL, &bound);
        double best[NPATHS];
        for (int p = 0; p < NPATHS; p++) best[p] = 1e30;
        const int calls = 20000;
        for (int rep = 0; rep < 5; rep++)
            for (int p = 0; p < NPATHS; p++) {
                MPI_Barrier(MPI_COMM_WORLD);
                double t = MPI_Wtime();
                for (int c = 0; c < calls; c++) {
                    MPI_Request r;
                    switch (p) {
                    case BLOCKING: MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
                    case NONBLOCKING:
                        MPI_Iallreduce(in, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r);
                        poll_until_done(&r);
                        break;
                    case PERSISTENT_IN_PLACE:
                        memcpy(stage_out, in, bytes);
                        MPI_Start(&in_place);
                        poll_until_done(&in_place);
                        memcpy(out, stage_out, bytes);
                        break;
                    case PERSISTENT_TWO_BUFFERS:
                        memcpy(stage_in, in, bytes);
                        MPI_Start(&staged);
                        poll_until_done(&staged);
                        memcpy(out, stage_out, bytes);
                        break;
                    case SMP: {
                        smp_tensor ti = smp_tensor_1d(in, SMP_F32, n), to = smp_tensor_1d(out, SMP_F32, n);
                        if (smp_all_reduce(&ti, &to, SMP_SUM, SMP_WORLD) != SMP_OK) {
                            fprintf(stderr, "smp_all_reduce: %s\n", smp_last_error());
                            MPI_Abort(MPI_COMM_WORLD, 1);
                        }
                        break;
                    }
                    default:
                        MPI_Start(&bound);
                        poll_until_done(&bound);
                    }
                }
                t = (MPI_Wtime() - t) / calls * 1e6;
                if (t < best[p]) best[p] = t;
            }
        if (rank == 0) {
            printf("%8zu %12.2f", bytes, best[0]);
            for (int p = 1; p < NPATHS; p++) printf(" %10.2f (x%.2f)", best[p], best[p] / best[0]);
            printf("\n");
        }
        MPI_Request_free(&in_place);
        MPI_Request_free(&staged);
        MPI_Request_free(&bound);
        free(in);
        free(out);
        free(stage_in);
        free(stage_out);
    }
    smp_finalize();
    MPI_Finalize();
    return 0;
}
