/* test_ckpt_order.c - the saves test/run_ckpt_order.sh watches: net7.h's
   model after one training step (2 partitions on 2 ranks, one process on
   1), saved full to DIR/full/ckpt, then partial to DIR/part/ckpt twice (a
   second generation, which removes the first's files). The script preloads
   test/fs_order_shim.c and checks the order of the file-system calls; this
   program checks that the saves succeed and that each loads back.
   usage: mpirun -n 2 test_ckpt_order DIR */
#define _POSIX_C_SOURCE 200809L
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h"
#include "test.h"
#include "net7.h"
#include "net7_train.h"

#include <sys/stat.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int world = 1, me = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    if (argc != 2) {
        if (me == 0) fprintf(stderr, "usage: mpirun -n 2 %s DIR\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    char full[512], part[512];
    snprintf(full, sizeof full, "%s/full", argv[1]);
    snprintf(part, sizeof part, "%s/part", argv[1]);
    if (me == 0) {
        mkdir(full, 0777);
        mkdir(part, 0777);
    }
    strncat(full, "/ckpt", sizeof full - strlen(full) - 1);
    strncat(part, "/ckpt", sizeof part - strlen(part) - 1);
    MPI_Barrier(MPI_COMM_WORLD);

    smp_config cfg = {0};
    cfg.partitions = world >= 2 ? 2 : 1;
    cfg.ddp = world > cfg.partitions ? SMP_ON : SMP_OFF;
    cfg.microbatches = 2;
    cfg.auto_partition = cfg.partitions > 1 ? SMP_OFF : SMP_ON;
    static const int placement[7] = {0, 0, 0, 1, 1, 1, 1};
    net n;
    smp_model *model = smp_init(&cfg) ? NULL : build(&n, cfg.partitions > 1 ? placement : NULL);
    static float x[B * D], t[B * C];
    batch(0, smp_dp_rank(), x, t);
    smp_tensor xt = smp_tensor_2d(x, SMP_F32, B, D), tt = smp_tensor_2d(t, SMP_F32, B, C);
    smp_status st = model ? SMP_TRAIN_STEP(model, mse_body, NULL, NULL, 0, xt, tt) : SMP_ERR_STATE;
    MPI_CHECK(!st, "ckpt-order/a training step", "%s", smp_last_error());
    if (!st) sgd(model);
    uint64_t trained = model ? digest(model) : 0;

    smp_save_desc full_desc = {0};
    full_desc.partial = SMP_OFF;
    const char *paths[3] = {full, part, part};
    for (int i = 0; i < 3 && !st; i++) {
        st = smp_save(model, paths[i], i == 0 ? &full_desc : NULL);
        MPI_CHECK(!st,
                  i == 0   ? "ckpt-order/the full save"
                  : i == 1 ? "ckpt-order/the first partial save"
                           : "ckpt-order/the second partial save",
                  "%s", smp_last_error());
    }
    for (int i = 0; i < 2 && !st; i++) {
        smp_model_zero_grad(model); /* another step: parameters the load must put back */
        if (!SMP_TRAIN_STEP(model, mse_body, NULL, NULL, 0, xt, tt)) sgd(model);
        smp_load_desc ld = {0};
        ld.partial = i ? SMP_ON : SMP_OFF;
        st = smp_load(model, i ? part : full, &ld);
        MPI_CHECK(!st && digest(model) == trained,
                  i ? "ckpt-order/the partial save loads back" : "ckpt-order/the full save loads back", "%s",
                  st ? smp_last_error() : "other parameters");
    }
    smp_model_free(model);
    smp_finalize();
    MPI_Finalize();
    return test_exit_code();
}
