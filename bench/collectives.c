/* bench/collectives.c - smp_all_reduce against a raw MPI_Allreduce.

   Two ranks all-reduce the same f32 buffer (sum) three ways: through
   smp_all_reduce (SMP_WORLD: a cached persistent request on a staging copy
   up to 16 KiB, MPI_Iallreduce above, polled by smp_wait_requests), through
   a persistent handle bound to the buffers (smp_all_reduce_init once per
   size, then smp_persistent_run), and through a plain MPI_Allreduce on a
   duplicate of MPI_COMM_WORLD. The three take turns inside every
   repetition, and which goes first rotates each repetition, so slow drift
   (frequency, page cache, a noisy neighbour) lands on all equally. Each
   sample is the slower rank's time for one call; a size reports the median
   of its samples.

   Build: mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. bench/collectives.c -o build/bench_collectives -lm
   Run:   mpirun -n 2 build/bench_collectives [seconds per size, default 4]

   The last two lines are always
       allreduce smp/mpi time ratio (worst size): X.XX
       allreduce smp persistent/mpi time ratio (worst size): X.XX
*/
#define SMP_IMPLEMENTATION
#include "smp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void human(size_t bytes, char *buf, size_t cap) {
    if (bytes >= (1u << 20)) snprintf(buf, cap, "%zu MiB", bytes >> 20);
    else snprintf(buf, cap, "%zu KiB", bytes >> 10);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    double budget = argc > 1 ? atof(argv[1]) : 4.0; /* seconds of timed calls per size */
    if (budget <= 0) budget = 4.0;

    smp_config cfg = {0};
    if (size > 1) cfg.ddp = SMP_ON; /* two replicas of a one-partition model */
    if (smp_init(&cfg) != SMP_OK) {
        fprintf(stderr, "smp_init: %s\n", smp_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (size != 2 && rank == 0) fprintf(stderr, "note: this benchmark is meant for 2 ranks (running on %d)\n", size);

    MPI_Comm raw;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);

    const size_t min_bytes = 4u << 10, max_bytes = 64u << 20;
    const size_t max_n = max_bytes / sizeof(float);
    float *in = (float *)malloc(max_bytes), *out = (float *)malloc(max_bytes);
    if (!in || !out) MPI_Abort(MPI_COMM_WORLD, 1);
    for (size_t i = 0; i < max_n; i++) { in[i] = (float)((i + (size_t)rank) % 17); out[i] = 0; }

    if (rank == 0) {
        /* smp's waits yield the core; with other jobs on the machine each
           yield can cost a time slice, so the ratio means something only on
           an otherwise idle machine: say how busy it was */
        double load = -1;
        FILE *f = fopen("/proc/loadavg", "r");
        if (f) {
            if (fscanf(f, "%lf", &load) != 1) load = -1;
            fclose(f);
        }
        if (load >= 0)
            printf("load average at start: %.2f (run on an idle machine; other jobs distort the ratio)\n", load);
        printf("smp_all_reduce vs MPI_Allreduce, f32 sum, %d ranks, median of interleaved samples\n", size);
        printf("%10s %8s %14s %16s %14s %8s %15s\n", "size", "samples", "smp (us)", "persistent (us)", "mpi (us)",
               "smp/mpi", "persistent/mpi");
    }
    double worst = 0, worst_persistent = 0;
    for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
        int n = (int)(bytes / sizeof(float));
        smp_tensor ti = smp_tensor_1d(in, SMP_F32, n), to = smp_tensor_1d(out, SMP_F32, n);
        smp_persistent *handle = NULL;
        if (smp_all_reduce_init(&ti, &to, SMP_SUM, SMP_WORLD, &handle) != SMP_OK) {
            fprintf(stderr, "smp_all_reduce_init: %s\n", smp_last_error());
            MPI_Abort(MPI_COMM_WORLD, 1);
        }

        /* warm-up (first touches, connection set-up), then a rough time per
           round of the three to size the repetitions */
        double t0 = 0;
        for (int w = 0; w < 6; w++) {
            if (w == 3) t0 = MPI_Wtime();
            if (smp_all_reduce(&ti, &to, SMP_SUM, SMP_WORLD) != SMP_OK || smp_persistent_run(handle) != SMP_OK) {
                fprintf(stderr, "smp: %s\n", smp_last_error());
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
            MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, raw);
        }
        double per_round = (MPI_Wtime() - t0) / 3;
        MPI_Allreduce(MPI_IN_PLACE, &per_round, 1, MPI_DOUBLE, MPI_MAX, raw);
        int reps = (int)(budget / (per_round > 1e-7 ? per_round : 1e-7));
        if (reps < 15) reps = 15;
        if (reps > 4001) reps = 4001;

        enum { SMP, PERSISTENT, MPI, PATHS };
        double *t[PATHS];
        t[0] = (double *)malloc(sizeof(double) * PATHS * (size_t)reps);
        for (int p = 1; p < PATHS; p++) t[p] = t[0] + p * reps;
        for (int r = 0; r < reps; r++) {
            for (int k = 0; k < PATHS; k++) {
                int path = (r + k) % PATHS; /* each path goes first, second and third in turn */
                MPI_Barrier(raw);
                double a = MPI_Wtime();
                if (path == SMP) smp_all_reduce(&ti, &to, SMP_SUM, SMP_WORLD);
                else if (path == PERSISTENT) smp_persistent_run(handle);
                else MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, raw);
                t[path][r] = MPI_Wtime() - a;
            }
        }
        /* one sample is the slower rank's time */
        MPI_Allreduce(MPI_IN_PLACE, t[0], PATHS * reps, MPI_DOUBLE, MPI_MAX, raw);
        double ms = median(t[SMP], reps), mp = median(t[PERSISTENT], reps), mm = median(t[MPI], reps);
        if (ms / mm > worst) worst = ms / mm;
        if (mp / mm > worst_persistent) worst_persistent = mp / mm;
        if (rank == 0) {
            char hb[32];
            human(bytes, hb, sizeof hb);
            printf("%10s %8d %14.1f %16.1f %14.1f %8.3f %15.3f\n", hb, reps, ms * 1e6, mp * 1e6, mm * 1e6, ms / mm,
                   mp / mm);
            fflush(stdout);
        }
        free(t[0]);
        smp_persistent_free(handle);
    }
    if (rank == 0) {
        printf("allreduce smp/mpi time ratio (worst size): %.2f\n", worst);
        printf("allreduce smp persistent/mpi time ratio (worst size): %.2f\n", worst_persistent);
    }
    free(in);
    free(out);
    MPI_Comm_free(&raw);
    smp_finalize();
    MPI_Finalize();
    return 0;
}
