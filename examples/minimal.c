/* minimal.c - the smallest complete smp program: four tanh layers split
   into two pipeline stages, trained with SGD on 4 microbatches a step.
   Build: mpicc -std=c11 -O2 -I. examples/minimal.c -o minimal -lm
   Run:   mpirun -n 2 ./minimal                                          */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include <math.h>
#include <stdio.h>

enum { BATCH = 32, WIDTH = 16, LAYERS = 4, STEPS = 60 };
static smp_param *weight[LAYERS];
static smp_module *layer[LAYERS];

/* The engine's kernels: y = tanh(x W^T) and its backward. smp hands them
   their inputs, output memory and gradients; they never see a pipeline. */
static smp_status fc_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    const float *w = smp_param_value(*(smp_param **)smp_module_user(smp_call_module(c)))->data, *xs = x->data;
    int64_t n = x->shape[0];
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, (int64_t[]){n, WIDTH});
    if (!y) return SMP_ERR_NOMEM;
    for (int64_t r = 0; r < n; r++)
        for (int o = 0; o < WIDTH; o++) {
            float z = 0;
            for (int i = 0; i < WIDTH; i++) z += xs[r * WIDTH + i] * w[o * WIDTH + i];
            ((float *)y->data)[r * WIDTH + o] = tanhf(z);
        }
    return SMP_OK;
}
static smp_status fc_backward(smp_call_ctx *c) {
    smp_param *p = *(smp_param **)smp_module_user(smp_call_module(c));
    const float *x = smp_call_input(c, 0)->data, *y = smp_call_output_value(c, 0)->data, *gy = smp_call_grad_output(c, 0)->data;
    const float *w = smp_param_value(p)->data;
    float *gw = smp_param_grad(p)->data;
    smp_tensor *gx = smp_call_grad_input(c, 0); /* NULL for the first layer: the data takes no gradient */
    int64_t n = smp_call_input(c, 0)->shape[0];
    for (int64_t r = 0; r < n; r++)
        for (int i = 0; i < WIDTH; i++) {
            float acc = 0;
            for (int o = 0; o < WIDTH; o++) {
                float dz = gy[r * WIDTH + o] * (1 - y[r * WIDTH + o] * y[r * WIDTH + o]);
                gw[o * WIDTH + i] += dz * x[r * WIDTH + i];
                acc += dz * w[o * WIDTH + i];
            }
            if (gx) ((float *)gx->data)[r * WIDTH + i] = acc;
        }
    return SMP_OK;
}

/* The model's forward: which modules run in which order. smp traces it once. */
static smp_status forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m, (void)nin, (void)nout, (void)user;
    smp_tensor h = in[0];
    for (int l = 0; l < LAYERS; l++) SMP_TRY(smp_call(layer[l], &h, 1, l == LAYERS - 1 ? out : &h, 1));
    return SMP_OK;
}

/* The loss, once per microbatch where the model's output lives. */
SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    int64_t n = smp_tensor_numel(y);
    float loss = 0;
    for (int64_t i = 0; i < n; i++) {
        float d = ((const float *)y->data)[i] - ((const float *)t->data)[i];
        loss += d * d / (float)n;
        ((float *)g->data)[i] = 2 * d / (float)n;
    }
    return smp_mb_return_f32(mb, 0, loss);
}

int main(void) {
    smp_config cfg = {0}; // zero means defaults
    cfg.partitions = 2;
    cfg.microbatches = 4;
    if (smp_init(&cfg)) { fprintf(stderr, "%s\n", smp_last_error()); return 1; }
    smp_module *root = smp_module_new(NULL, "", NULL);
    for (int l = 0; l < LAYERS; l++) {
        char name[16];
        snprintf(name, sizeof name, "fc%d", l);
        layer[l] = smp_module_new(root, name, &(smp_module_desc){fc_forward, fc_backward, &weight[l]});
        weight[l] = smp_param_new(layer[l], "weight", SMP_F32, 2, (int64_t[]){WIDTH, WIDTH},
                                  smp_init_uniform, NULL);
    }
    smp_model *model = NULL;
    smp_status st = smp_model_new(root, &(smp_model_desc){.forward = forward}, &model);
    if (st) fprintf(stderr, "%s\n", smp_last_error());
    static float x[BATCH * WIDTH], t[BATCH * WIDTH]; // learn t = sin(x), elementwise
    for (int i = 0; i < BATCH * WIDTH; i++) { x[i] = (float)((i * 37) % 101) / 50.0f - 1.0f; t[i] = sinf(x[i]); }
    smp_tensor xs = smp_tensor_2d(x, SMP_F32, BATCH, WIDTH), ts = smp_tensor_2d(t, SMP_F32, BATCH, WIDTH);
    for (int step = 0; step < STEPS && !st; step++) {
        smp_step_output loss = {0};
        smp_model_zero_grad(model);
        st = SMP_TRAIN_STEP(model, mse_body, NULL, &loss, 1, xs, ts);
        if (st) { fprintf(stderr, "step %d: %s\n", step, smp_last_error()); break; }
        smp_param *p;
        for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) // SGD on this rank's layers
            for (int64_t k = 0; k < smp_tensor_numel(smp_param_value(p)); k++)
                ((float *)smp_param_value(p)->data)[k] -= 0.5f * ((float *)smp_param_grad(p)->data)[k];
        if (smp_rank() == 0 && step % 10 == 0)
            printf("step %d loss %.5f\n", step, smp_step_output_reduce_mean_f64(&loss));
        smp_step_output_free(&loss);
    }
    smp_model_free(model);
    smp_finalize(); // after a failure too: leaving main without it makes the exit guard abort the job
    return st ? 1 : 0;
}
