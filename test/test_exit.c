/* test_exit.c - a rank that leaves early must not end the job with status 0.

   Two ranks run a 2-partition pipeline (net7.h) for 5 steps. Depending on
   the mode one rank leaves early; smp's exit guard must then abort the
   whole job with a message that names the rank and where it was:
     exit_in_step   rank 1 calls exit(0) inside a module's forward (step 4,
                    microbatch 1)
     return_early   rank 0 returns from main after the steps without
                    smp_model_free / smp_finalize
     clean          nobody leaves early: status 0, no message

   This program does not judge itself: test/run_exit.sh runs it and reads
   the status and stderr.
     mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. -Itest test/test_exit.c -o build/test_exit -lm
     mpirun -n 2 build/test_exit exit_in_step */
#define _POSIX_C_SOURCE 200809L /* setenv in net7.h */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"
#include "net7.h"

#include <stdlib.h>
#include <string.h>

static int g_step;
static const char *g_mode = "clean";

static smp_status leaving_relu(smp_call_ctx *c) {
    if (!strcmp(g_mode, "exit_in_step") && smp_rank() == 1 && g_step == 3 && smp_call_microbatch(c) == 1) exit(0);
    return relu_forward(c);
}

SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    return smp_mb_return_f32(
        mb, 0,
        mse((const float *)y->data, (const float *)t->data, g ? (float *)g->data : NULL, (int)smp_tensor_numel(y)));
}

int main(int argc, char **argv) {
    if (argc > 1) g_mode = argv[1];
    smp_config cfg = {0};
    cfg.partitions = 2;
    cfg.microbatches = 4;
    cfg.auto_partition = SMP_OFF; /* act2, whose forward rank 1 leaves in, on partition 1 whatever the timings */
    static const int placement[7] = {0, 0, 0, 0, 1, 1, 1};
    if (smp_init(&cfg)) return 1;
    net n;
    net_fns f = net_host_fns;
    f.relu_f = leaving_relu;
    smp_model *m = build_with(&n, placement, &f, false);
    static float x[B * D], t[B * C];
    for (int i = 0; i < B * D; i++) x[i] = (float)(i % 7) / 7;
    for (g_step = 0; g_step < 5 && m; g_step++) {
        smp_step_output out = {0};
        smp_tensor xt = smp_tensor_2d(x, SMP_F32, B, D), tt = smp_tensor_2d(t, SMP_F32, B, C);
        if (SMP_TRAIN_STEP(m, mse_body, NULL, &out, 1, xt, tt))
            fprintf(stderr, "step %d: %s\n", g_step, smp_last_error());
        smp_step_output_free(&out);
    }
    if (!strcmp(g_mode, "return_early") && smp_rank() == 0) return 0;
    smp_model_free(m);
    smp_finalize();
    return 0;
}
