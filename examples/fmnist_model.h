/* fmnist_model.h - the Fashion-MNIST MLP as smp modules, shared by the
   training demo (fmnist.c) and pipelined inference (fmnist_infer.c).
   784 -> 512 -> 512 -> 512 -> 512 -> 10 with ReLU between the layers; the
   arithmetic is mlp_engine.h's. Hidden layers of one width, like a
   transformer's blocks, let the layers split into pipeline stages of equal
   work; with shrinking widths (512, 512, 256, 128) the best 2-stage split
   puts 62% of the work on one stage. Include after smp.h and smp_pipeline.h. */
#ifndef FMNIST_MODEL_H
#define FMNIST_MODEL_H
#include "mlp_engine.h"

/* ---------------------------------------------------------------- layers as smp modules */
enum { NLAYERS = 5 };
static const int widths[NLAYERS + 1] = {FM_PIXELS, 512, 512, 512, 512, FM_CLASSES};

typedef struct linear { smp_param *weight, *bias; int in, out; } linear;

static smp_status linear_forward(smp_call_ctx *c) {
    const linear *l = smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    int n = (int)x->shape[0];
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, (int64_t[]){n, l->out});
    if (!y) return SMP_ERR_NOMEM; /* smp's message says which bytes were missing; the step can be retried */
    mlp_linear_forward(x->data, smp_param_value(l->weight)->data, smp_param_value(l->bias)->data, y->data, n, l->in,
                       l->out);
    return SMP_OK;
}

/* The backward in two halves, so zero-bubble schedules can run the weight
   half (dW += dy^T x, db += column sums of dy) in a pipeline bubble; the
   input half (dx = dy W) is what the previous stage waits for. */
static smp_status linear_backward_input(smp_call_ctx *c) {
    const linear *l = smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0); /* NULL for the first layer: images need no gradient */
    if (dx)
        mlp_linear_backward(x->data, smp_param_value(l->weight)->data, dy->data, dx->data, NULL, NULL, (int)x->shape[0],
                            l->in, l->out);
    return SMP_OK;
}

static smp_status linear_backward_weight(smp_call_ctx *c) {
    const linear *l = smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    mlp_linear_backward(x->data, smp_param_value(l->weight)->data, dy->data, NULL, smp_param_grad(l->weight)->data,
                        smp_param_grad(l->bias)->data, (int)x->shape[0], l->in, l->out);
    return SMP_OK;
}

static smp_status relu_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    mlp_relu_forward(x->data, y->data, (size_t)smp_tensor_numel(x));
    return SMP_OK;
}

static smp_status relu_backward(smp_call_ctx *c) {
    const smp_tensor *y = smp_call_output_value(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    if (dx) mlp_relu_backward(y->data, dy->data, dx->data, (size_t)smp_tensor_numel(y));
    return SMP_OK;
}

/* Kaiming-uniform weights, zero biases; smp hands each parameter its own seed. */
static void init_weight(smp_tensor *w, uint64_t seed, void *user) {
    (void)user;
    mlp_init(w->data, (size_t)smp_tensor_numel(w), "weight", seed, mlp_kaiming_bound((int)w->shape[1]));
}

typedef struct mlp {
    smp_module *root, *fc[NLAYERS], *act[NLAYERS - 1];
    linear lin[NLAYERS];
} mlp;

static smp_status mlp_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m, (void)nin, (void)nout;
    mlp *net = user;
    smp_tensor h = in[0];
    for (int i = 0; i < NLAYERS; i++) {
        smp_status st = smp_call(net->fc[i], &h, 1, i == NLAYERS - 1 ? out : &h, 1);
        if (!st && i < NLAYERS - 1) st = smp_call(net->act[i], &h, 1, &h, 1);
        if (st) return st;
    }
    return SMP_OK;
}

/* Builds the model. With --manual the layers go to partitions by
   SMP_PARTITION contexts, as in the reference's manual-partitioning script
   (under pipeline zero_bubble_v in a V: layer i in stage i * 2P / NLAYERS
   of 2P, stage k on partition k, or 2P-1-k past the middle); otherwise smp
   splits the traced calls itself. */
static smp_status build_model(mlp *net, int partitions, smp_model **model) {
    static const smp_module_desc fc = {linear_forward, NULL, NULL}, relu = {relu_forward, relu_backward, NULL};
    net->root = smp_module_new(NULL, "", NULL);
    for (int i = 0; i < NLAYERS; i++) {
        char name[16];
        int stage = i * 2 * partitions / NLAYERS;
        bool vee = smp_current_config()->pipeline == SMP_PIPELINE_ZERO_BUBBLE_V;
        SMP_PARTITION(vee ? (stage < partitions ? stage : 2 * partitions - 1 - stage) : i * partitions / NLAYERS) {
            snprintf(name, sizeof name, "fc%d", i);
            smp_module_desc d = fc;
            d.user = &net->lin[i];
            net->lin[i].in = widths[i];
            net->lin[i].out = widths[i + 1];
            net->fc[i] = smp_module_new(net->root, name, &d);
            smp_module_set_backward_split(net->fc[i], linear_backward_input, linear_backward_weight);
            net->lin[i].weight = smp_param_new(net->fc[i], "weight", SMP_F32, 2, (int64_t[]){widths[i + 1], widths[i]},
                                               init_weight, NULL);
            net->lin[i].bias =
                smp_param_new(net->fc[i], "bias", SMP_F32, 1, (int64_t[]){widths[i + 1]}, smp_init_constant, NULL);
            if (i < NLAYERS - 1) {
                snprintf(name, sizeof name, "act%d", i);
                net->act[i] = smp_module_new(net->root, name, &relu);
            }
        }
    }
    return smp_model_new(net->root, &(smp_model_desc){.forward = mlp_forward, .user = net}, model);
}

/* ---------------------------------------------------------------- the step */
/* Runs once per microbatch where the logits live: loss and its gradient. */
SMP_STEP_BODY(train_body) {
    const smp_tensor *logits = smp_mb_output(mb, 0), *labels = smp_mb_arg(mb, 1);
    smp_tensor *dlogits = smp_mb_output_grad(mb, 0); /* NULL in evaluation */
    int n = (int)logits->shape[0];
    float loss =
        mlp_xent_loss(logits->data, labels->data, n, FM_CLASSES, dlogits ? dlogits->data : NULL, 1.0f / (float)n);
    float correct = (float)mlp_count_correct(logits->data, labels->data, n, FM_CLASSES);
    smp_status st = smp_mb_return_f32(mb, 0, loss);
    return st ? st : smp_mb_return_f32(mb, 1, correct);
}

/* Pipelined evaluation over a dataset: returns accuracy. */
static smp_status evaluate(smp_model *model, const fm_dataset *ds, int batch, double *accuracy) {
    int64_t n = (int64_t)ds->n / batch * batch, correct = 0;
    for (int64_t at = 0; at < n; at += batch) {
        smp_tensor x = smp_tensor_2d(ds->images + at * FM_PIXELS, SMP_F32, batch, FM_PIXELS);
        smp_tensor y = smp_tensor_1d(ds->labels + at, SMP_U8, batch);
        smp_step_output out[2] = {{0}, {0}};
        smp_status st = SMP_EVAL_STEP(model, train_body, NULL, out, 2, x, y);
        if (st) return st;
        float sum;
        smp_step_output_reduce_sum(&out[1], &(smp_tensor){.data = &sum, .dtype = SMP_F32});
        correct += (int64_t)sum;
        smp_step_output_free(&out[0]);
        smp_step_output_free(&out[1]);
    }
    *accuracy = n ? (double)correct / (double)n : 0;
    return SMP_OK;
}

#endif
