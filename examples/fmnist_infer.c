/* fmnist_infer.c - pipelined inference from a checkpoint of fmnist.c.

   Loads the checkpoint that training saved (full by default, --partial for
   the per-partition files) into however many partitions this run has (smp
   reshards by name), then runs evaluation steps over the test set: each
   batch is cut into microbatches that flow through the stages like a
   training step without the backward.

   Build: mpicc -std=c11 -O2 -Iexamples -I. examples/fmnist_infer.c -o fmnist_infer -lopenblas -lz -lm
   Run:   mpirun -n 4 ./fmnist_infer --checkpoint fmnist.safetensors --partitions 4
*/
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h"
#include "fmnist_model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct pixel_norm { float mean, stdev; } pixel_norm;
static void on_meta(const char *key, const char *value, void *user) {
    pixel_norm *n = user;
    if (!strcmp(key, "pixel_mean")) n->mean = strtof(value, NULL);
    else if (!strcmp(key, "pixel_std")) n->stdev = strtof(value, NULL);
}

int main(int argc, char **argv) {
    const char *path = "fmnist.safetensors", *data = NULL;
    int batch = 1000;
    bool partial = false;
    smp_config cfg = {0};
    cfg.partitions = 2;
    cfg.microbatches = 4;
    MPI_Init(&argc, &argv);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--checkpoint") && v) path = argv[++i];
        else if (!strcmp(a, "--data") && v) data = argv[++i];
        else if (!strcmp(a, "--batch") && v) batch = atoi(argv[++i]);
        else if (!strcmp(a, "--partitions") && v) cfg.partitions = atoi(argv[++i]);
        else if (!strcmp(a, "--microbatches") && v) cfg.microbatches = atoi(argv[++i]);
        else if (!strcmp(a, "--partial")) partial = true;
        else if (!strcmp(a, "--ddp")) cfg.ddp = SMP_ON;
        else {
            fprintf(stderr,
                    "usage: %s [--checkpoint PATH] [--partial] [--partitions P] [--microbatches M] [--batch B] [--data "
                    "DIR] [--ddp]\n",
                    argv[0]);
            MPI_Finalize();
            return 2;
        }
    }
    if (smp_init(&cfg)) { fprintf(stderr, "smp_init: %s\n", smp_last_error()); MPI_Finalize(); return 1; }
    mlp_set_blas_threads(1);

    char err[512] = "";
    fm_dataset test;
    int bad = fm_load_split(&test, data, "t10k", err, sizeof err) != FM_OK;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_LOR, MPI_COMM_WORLD);
    if (bad) { if (*err) fprintf(stderr, "fmnist_infer: %s\n", err); smp_finalize(); MPI_Finalize(); return 1; }

    mlp net;
    memset(&net, 0, sizeof net);
    smp_model *model;
    pixel_norm norm = {0, 0};
    smp_tensor sample = smp_tensor_2d(test.images, SMP_F32, batch / smp_current_config()->microbatches, FM_PIXELS);
    smp_status st = build_model(&net, smp_current_config()->partitions, &model);
    if (!st) st = smp_model_trace(model, &sample, 1);
    if (!st)
        st = smp_load(model, path,
                      &(smp_load_desc){.partial = partial ? SMP_ON : SMP_OFF, .on_meta = on_meta, .user = &norm});
    if (!st && !(norm.stdev > 0))
        st = smp_error(SMP_ERR_FORMAT, "%s has no pixel_mean / pixel_std metadata (was it saved by fmnist.c?)", path);
    double accuracy = 0, t0 = MPI_Wtime();
    if (!st) {
        fm_standardize(&test, norm.mean, norm.stdev); /* the training set's statistics */
        st = evaluate(model, &test, batch, &accuracy);
    }
    double secs = MPI_Wtime() - t0;
    if (st) fprintf(stderr, "fmnist_infer: rank %d: %s\n", smp_rank(), smp_last_error());
    else if (smp_rank() == 0)
        printf("%d partitions: test accuracy: %.4f  (%.0f images/s)\n", smp_current_config()->partitions, accuracy,
               (double)(test.n / (size_t)batch * (size_t)batch) / secs);
    fm_free(&test);
    smp_model_free(model);
    smp_finalize();
    MPI_Finalize();
    return st ? 1 : 0;
}
