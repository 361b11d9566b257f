/* bench/checkpoint_saves.c - the time of one partial smp_save, repeated.

   bench/checkpoint compares each operation with raw POSIX I/O, best of 5;
   this one times REPS consecutive partial saves of the same model to the
   same path (each replacing the one before, as a training job's periodic
   checkpoint does) and prints the median, min and max of the slowest
   rank's time. With a small model it measures the fixed costs of a save:
   the agreements, the renames, the fsyncs of files and folder, and, since
   partial saves commit through a manifest, the manifest's write, fsync and
   rename and the removal of the replaced generation.

   The model is bench/checkpoint's: 8 modules of one ROWS x 4096 f32
   weight, 4 on each of 2 partitions (ROWS 2048: 128 MiB per rank; 16:
   1 MiB). It uses only smp_save, so the same source builds against any
   version of smp_checkpoint.h, to compare two:
     mpicc -std=c11 -O2 -I. bench/checkpoint_saves.c -o /tmp/saves -lm
     mpirun -n 2 /tmp/saves ROWS REPS [label]
   Files go to $SMP_BENCH_DIR or /tmp and are removed afterwards. */
#define _POSIX_C_SOURCE 200809L
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_checkpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { NMOD = 8 };

static smp_status pass_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, x->dtype, x->ndim, x->shape);
    memcpy(y->data, x->data, smp_tensor_nbytes(x));
    return SMP_OK;
}

typedef struct { smp_module *mods[NMOD]; } net;

static smp_status net_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m; (void)nin; (void)nout;
    net *n = (net *)user;
    smp_tensor a = in[0], b;
    for (int i = 0; i < NMOD; i++) {
        smp_status st = smp_call(n->mods[i], &a, 1, &b, 1);
        if (st) return st;
        a = b;
    }
    out[0] = a;
    return SMP_OK;
}

static void die(const char *what) {
    fprintf(stderr, "bench/checkpoint_saves: %s: %s\n", what, smp_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int64_t rows = argc > 1 ? atol(argv[1]) : 16;
    int reps = argc > 2 ? atoi(argv[2]) : 50;
    if (rows < 1 || reps < 1) {
        fprintf(stderr, "usage: %s [ROWS [REPS [label]]]\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    smp_config cfg = {0};
    int world;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    cfg.partitions = world >= 2 ? 2 : 1;
    cfg.ddp = world > cfg.partitions ? SMP_ON : SMP_OFF;
    cfg.auto_partition = SMP_OFF;
    if (smp_init(&cfg) != SMP_OK) die("smp_init");
    net n;
    smp_module *root = smp_module_new(NULL, "", NULL);
    smp_module_desc d = {pass_forward, NULL, NULL};
    for (int i = 0; i < NMOD; i++) {
        char name[16];
        int64_t shape[2] = {rows, 4096};
        snprintf(name, sizeof name, "layer%d", i);
        smp_partition_push(i * cfg.partitions / NMOD);
        n.mods[i] = smp_module_new(root, name, &d);
        smp_param_new(n.mods[i], "weight", SMP_F32, 2, shape, NULL, NULL);
        smp_partition_pop();
    }
    smp_model *model;
    smp_model_desc md = {net_forward, 1, 1, &n, false};
    if (smp_model_new(root, &md, &model) != SMP_OK) die("smp_model_new");
    float xin[4] = {1, 2, 3, 4};
    smp_tensor x = smp_tensor_2d(xin, SMP_F32, 1, 4);
    if (smp_model_trace(model, &x, 1) != SMP_OK) die("smp_model_trace");
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
        float *f = (float *)smp_param_value(p)->data;
        for (int64_t k = 0; k < smp_tensor_numel(smp_param_value(p)); k++) f[k] = (float)(k % 1000);
    }

    char path[600];
    const char *bdir = getenv("SMP_BENCH_DIR") ? getenv("SMP_BENCH_DIR") : "/tmp";
    snprintf(path, sizeof path, "%s/smp_bench_saves_%d", bdir, (int)getppid());
    double *t = (double *)malloc(sizeof(double) * (size_t)reps);
    smp_save_desc sd = {0}; /* partial */
    if (!t) die("out of memory");
    if (smp_save(model, path, &sd) != SMP_OK) die("the first save"); /* each timed save replaces one */
    for (int r = 0; r < reps; r++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        if (smp_save(model, path, &sd) != SMP_OK) die("partial save");
        double dt = MPI_Wtime() - t0;
        MPI_Allreduce(&dt, &t[r], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    if (smp_rank() == 0) {
        printf(
            "%s%spartial save, %.1f MiB per partition, %d partitions, %d saves: median %.2f ms, min %.2f, max %.2f\n",
            argc > 3 ? argv[3] : "", argc > 3 ? ": " : "",
            (double)rows * 4096 * 4 * (NMOD / cfg.partitions) / (1 << 20), cfg.partitions, reps, t[reps / 2] * 1e3,
            t[0] * 1e3, t[reps - 1] * 1e3);
        /* both layouts: "<path>_<k>" before manifests, "<path>.g<N>_<k>" + manifest after */
        char cmd[4096];
        snprintf(cmd, sizeof cmd, "rm -f '%s'_[0-9]* '%s'.g[0-9]*_[0-9]* '%s.manifest'", path, path, path);
        if (system(cmd) != 0) fprintf(stderr, "bench/checkpoint_saves: could not remove %s*\n", path);
    }
    free(t);
    smp_model_free(model);
    smp_finalize();
    MPI_Finalize();
    return 0;
}
