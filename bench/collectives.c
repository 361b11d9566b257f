/* bench/collectives.c - smp_all_reduce against a raw MPI_Allreduce.

   Two ranks all-reduce the same f32 buffer (sum) through smp (SMP_WORLD,
   which is MPI_Iallreduce polled by smp_wait_requests) and through a plain
   MPI_Allreduce on a duplicate of MPI_COMM_WORLD. The two alternate inside
   every repetition, and which one goes first flips each repetition, so slow
   drift (frequency, page cache, a noisy neighbour) lands on both equally.
   Each sample is the slower rank's time for one call; a size reports the
   median of its samples.

   Build: mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. bench/collectives.c -o build/bench_collectives -lm
   Run:   mpirun -n 2 build/bench_collectives [seconds per size, default 4]

   The last line is always
       allreduce smp/mpi time ratio (worst size): X.XX
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
        printf("%10s %8s %14s %14s %8s\n", "size", "samples", "smp (us)", "mpi (us)", "smp/mpi");
    }
    double worst = 0;
    for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
        int n = (int)(bytes / sizeof(float));
        smp_tensor ti = smp_tensor_1d(in, SMP_F32, n), to = smp_tensor_1d(out, SMP_F32, n);

        /* warm-up (first touches, connection set-up), then a rough time per
           pair of calls to size the repetitions */
        double t0 = 0;
        for (int w = 0; w < 6; w++) {
            if (w == 3) t0 = MPI_Wtime();
            if (smp_all_reduce(&ti, &to, SMP_SUM, SMP_WORLD) != SMP_OK) {
                fprintf(stderr, "smp_all_reduce: %s\n", smp_last_error());
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
            MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, raw);
        }
        double per_pair = (MPI_Wtime() - t0) / 3;
        MPI_Allreduce(MPI_IN_PLACE, &per_pair, 1, MPI_DOUBLE, MPI_MAX, raw);
        int reps = (int)(budget / (per_pair > 1e-7 ? per_pair : 1e-7));
        if (reps < 15) reps = 15;
        if (reps > 4001) reps = 4001;

        double *ts = (double *)malloc(sizeof(double) * 2 * (size_t)reps), *tm = ts + reps;
        for (int r = 0; r < reps; r++) {
            for (int k = 0; k < 2; k++) {
                int use_smp = (r + k) % 2 == 0; /* even reps: smp first; odd: mpi first */
                MPI_Barrier(raw);
                double a = MPI_Wtime();
                if (use_smp) smp_all_reduce(&ti, &to, SMP_SUM, SMP_WORLD);
                else MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, raw);
                double d = MPI_Wtime() - a;
                if (use_smp) ts[r] = d; else tm[r] = d;
            }
        }
        /* one sample is the slower rank's time */
        MPI_Allreduce(MPI_IN_PLACE, ts, 2 * reps, MPI_DOUBLE, MPI_MAX, raw);
        double ms = median(ts, reps), mm = median(tm, reps);
        double ratio = ms / mm;
        if (ratio > worst) worst = ratio;
        if (rank == 0) {
            char hb[32];
            human(bytes, hb, sizeof hb);
            printf("%10s %8d %14.1f %14.1f %8.3f\n", hb, reps, ms * 1e6, mm * 1e6, ratio);
            fflush(stdout);
        }
        free(ts);
    }
    if (rank == 0) printf("allreduce smp/mpi time ratio (worst size): %.2f\n", worst);
    free(in);
    free(out);
    MPI_Comm_free(&raw);
    smp_finalize();
    MPI_Finalize();
    return 0;
}
