/* fmnist_cuda.h - the Fashion-MNIST MLP of fmnist_model.h on a GPU, shared
   by the CUDA demo (fmnist.cu) and the NCCL benchmark (bench/nccl.cu).

   The same modules, parameter names (fc0.weight, ...), shapes and initial
   weights as the CPU model, so a checkpoint of either loads into the other
   (and into fmnist_infer). The arithmetic is the GPU's: cuda_engine.h's
   engine, linear layers (cuBLAS sgemm) and Adam, and kernels of this file
   for ReLU, softmax cross-entropy and accuracy.

     gpu_*           layers, loss, optimizer: device pointers and sizes, as
                     mlp_engine.h's mlp_* take host pointers and sizes
     linear, relu    the layers as smp modules; build_model, train_body,
                     evaluate as in fmnist_model.h

   The one host wait is in gpu_xent_loss: smp takes a step's return values
   on the host.

   DEVICE MODELS
     build_model sets smp_model_desc.on_device: smp keeps parameters,
     gradients, activations and their gradients in device memory, and step
     arguments may be device tensors. Init callbacks still fill a host
     tensor, which smp copies to the device; so the weights start as the CPU
     demo's, bit for bit.

   NUMBERS
     Loss sums and bias gradients add in a fixed order, so a run repeats
     itself on the same GPU; results differ from the CPU demo's in the last
     bits (different sgemm summation, fused multiply-adds), not in accuracy.

   Include after smp.h, smp_pipeline.h and smp_nccl.h, from a .cu file.
   Link: -lcublas -lnccl -lz
*/
#ifndef FMNIST_CUDA_H
#define FMNIST_CUDA_H
#include "cuda_engine.h" /* the engine, linear layers and Adam */

/* ---------------------------------------------------------------- kernels */
__global__ void relu_forward_kernel(const float *x, float *y, int64_t count) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = x[i] < 0.0f ? 0.0f : x[i]; /* NaN passes through, as on the CPU */
}

__global__ void relu_backward_kernel(const float *y, const float *dy, float *dx, int64_t count) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

/* Softmax cross-entropy over a microbatch in one block: each thread takes
   rows tid, tid + blockDim, ... and thread 0 adds the threads' sums in
   order, so the loss is the same bits on every run. A microbatch is at
   most a few thousand rows of 10 classes: one block is plenty.
   stats[0] = mean loss, stats[1] = rows whose arg-max (first on ties)
   is the label. dlogits (may be NULL) = grad_scale * (softmax - onehot). */
/* One row of k logits z: adds its loss and whether its arg-max is the label;
   g (may be NULL) gets the row's gradient. Host code can call it too (the
   tests' CPU stand-in for this kernel does). */
__host__ __device__ inline void xent_row(const float *z, int label, int k, float *g, float grad_scale, double *loss,
                                         int *correct) {
    int best = 0;
    float m = z[0];
    for (int j = 1; j < k; j++) {
        if (z[j] > m) m = z[j];
        if (z[j] > z[best]) best = j;
    }
    double s = 0.0;
    for (int j = 0; j < k; j++) s += exp((double)z[j] - m);
    double lse = m + log(s);
    *loss += lse - z[label];
    *correct += best == label;
    if (g)
        for (int j = 0; j < k; j++) g[j] = (float)(exp((double)z[j] - lse) - (j == label)) * grad_scale;
}

__global__ void xent_kernel(const float *logits, const uint8_t *labels, int rows, int k, float *dlogits,
                            float grad_scale, float *stats) {
    __shared__ double loss_part[GPU_THREADS];
    __shared__ int correct_part[GPU_THREADS];
    double loss = 0.0;
    int correct = 0;
    for (int i = threadIdx.x; i < rows; i += blockDim.x)
        xent_row(logits + (int64_t)i * k, labels[i], k, dlogits ? dlogits + (int64_t)i * k : NULL, grad_scale, &loss,
                 &correct);
    loss_part[threadIdx.x] = loss;
    correct_part[threadIdx.x] = correct;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        int hits = 0;
        for (unsigned t = 0; t < blockDim.x; t++) {
            total += loss_part[t];
            hits += correct_part[t];
        }
        stats[0] = rows > 0 ? (float)(total / rows) : 0.0f;
        stats[1] = (float)hits;
    }
}

static inline smp_status gpu_relu_forward(const gpu_engine *e, const float *x, float *y, int64_t count) {
    if (count <= 0) return SMP_OK;
    relu_forward_kernel<<<gpu_blocks(count), GPU_THREADS, 0, e->stream>>>(x, y, count);
    GPU_LAUNCHED(relu_forward_kernel);
    return SMP_OK;
}

/* dx = dy where the forward's output y > 0, else 0; dx may equal dy. */
static inline smp_status gpu_relu_backward(const gpu_engine *e, const float *y, const float *dy, float *dx,
                                           int64_t count) {
    if (count <= 0) return SMP_OK;
    relu_backward_kernel<<<gpu_blocks(count), GPU_THREADS, 0, e->stream>>>(y, dy, dx, count);
    GPU_LAUNCHED(relu_backward_kernel);
    return SMP_OK;
}

/* mlp_xent_loss and mlp_count_correct in one pass: *loss (mean over the n
   rows) and *correct come back to the host, which waits for the stream -
   for this microbatch's forward, which has to be done anyway. */
static inline smp_status gpu_xent_loss(const gpu_engine *e, const float *logits, const uint8_t *labels, int n, int k,
                                       float *dlogits, float grad_scale, float *loss, float *correct) {
    float host[2] = {0.0f, 0.0f};
    if (n > 0) {
        xent_kernel<<<1, GPU_THREADS, 0, e->stream>>>(logits, labels, n, k, dlogits, grad_scale, e->stats);
        GPU_LAUNCHED(xent_kernel);
        GPU_CUDA(cudaMemcpyAsync, (host, e->stats, sizeof host, cudaMemcpyDeviceToHost, e->stream));
        GPU_CUDA(cudaStreamSynchronize, (e->stream));
    }
    *loss = host[0];
    *correct = host[1];
    return SMP_OK;
}

/* ---------------------------------------------------------------- layers as smp modules */
enum { NLAYERS = 5 };
static const int widths[NLAYERS + 1] = {FM_PIXELS, 512, 512, 512, 512, FM_CLASSES};

typedef struct linear { smp_param *weight, *bias; int in, out; const gpu_engine *engine; } linear;


static inline smp_status linear_forward(smp_call_ctx *c) {
    const linear *l = (const linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    int n = (int)x->shape[0];
    const int64_t shape[2] = {n, l->out};
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, shape);
    if (!y) return SMP_ERR_NOMEM; /* smp's message says which bytes were missing; the step can be retried */
    return gpu_linear_forward(l->engine, (const float *)x->data, values_of(l->weight), values_of(l->bias),
                              (float *)y->data, n, l->in, l->out);
}

/* The backward in two halves, as in fmnist_model.h: the input half (dx =
   dy W) is what the previous stage waits for; zero-bubble schedules run the
   weight half (dW, db) in a pipeline bubble. */
static inline smp_status linear_backward_input(smp_call_ctx *c) {
    const linear *l = (const linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0); /* NULL for the first layer: images need no gradient */
    if (!dx) return SMP_OK;
    return gpu_linear_backward(l->engine, (const float *)x->data, values_of(l->weight), (const float *)dy->data,
                               (float *)dx->data, NULL, NULL, (int)x->shape[0], l->in, l->out);
}

static inline smp_status linear_backward_weight(smp_call_ctx *c) {
    const linear *l = (const linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    return gpu_linear_backward(l->engine, (const float *)x->data, values_of(l->weight), (const float *)dy->data, NULL,
                               grads_of(l->weight), grads_of(l->bias), (int)x->shape[0], l->in, l->out);
}

static inline smp_status relu_forward(smp_call_ctx *c) {
    const gpu_engine *engine = (const gpu_engine *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    return gpu_relu_forward(engine, (const float *)x->data, (float *)y->data, smp_tensor_numel(x));
}

static inline smp_status relu_backward(smp_call_ctx *c) {
    const gpu_engine *engine = (const gpu_engine *)smp_module_user(smp_call_module(c));
    const smp_tensor *y = smp_call_output_value(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    if (!dx) return SMP_OK;
    return gpu_relu_backward(engine, (const float *)y->data, (const float *)dy->data, (float *)dx->data,
                             smp_tensor_numel(y));
}

/* Kaiming-uniform weights, zero biases, on the host: smp copies them to the
   device. The same values as the CPU demo's. */
static inline void init_weight(smp_tensor *w, uint64_t seed, void *user) {
    (void)user;
    mlp_init((float *)w->data, (size_t)smp_tensor_numel(w), "weight", seed, mlp_kaiming_bound((int)w->shape[1]));
}

typedef struct mlp {
    smp_module *root, *fc[NLAYERS], *act[NLAYERS - 1];
    linear lin[NLAYERS];
} mlp;

static inline smp_status mlp_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout,
                                     void *user) {
    (void)m, (void)nin, (void)nout;
    mlp *net = (mlp *)user;
    smp_tensor h = in[0];
    for (int i = 0; i < NLAYERS; i++) {
        smp_status st = smp_call(net->fc[i], &h, 1, i == NLAYERS - 1 ? out : &h, 1);
        if (!st && i < NLAYERS - 1) st = smp_call(net->act[i], &h, 1, &h, 1);
        if (st) return st;
    }
    return SMP_OK;
}

/* Builds the model on the device. With --manual the layers go to partitions
   by SMP_PARTITION contexts, as in the reference's manual-partitioning
   script (in a V under zero_bubble_v, as fmnist_model.h places them);
   otherwise smp splits the traced calls itself. */
static inline smp_status build_model(mlp *net, const gpu_engine *engine, int partitions, smp_model **model) {
    static const smp_module_desc fc = {linear_forward, NULL, NULL};
    smp_module_desc relu = {relu_forward, relu_backward, (void *)engine};
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
            net->lin[i].engine = engine;
            net->fc[i] = smp_module_new(net->root, name, &d);
            smp_module_set_backward_split(net->fc[i], linear_backward_input, linear_backward_weight);
            const int64_t weight_shape[2] = {widths[i + 1], widths[i]}, bias_shape[1] = {widths[i + 1]};
            net->lin[i].weight = smp_param_new(net->fc[i], "weight", SMP_F32, 2, weight_shape, init_weight, NULL);
            net->lin[i].bias = smp_param_new(net->fc[i], "bias", SMP_F32, 1, bias_shape, smp_init_constant, NULL);
            if (i < NLAYERS - 1) {
                snprintf(name, sizeof name, "act%d", i);
                net->act[i] = smp_module_new(net->root, name, &relu);
            }
        }
    }
    smp_model_desc desc = {};
    desc.forward = mlp_forward;
    desc.user = net;
    desc.on_device = true;
    return smp_model_new(net->root, &desc, model);
}

/* ---------------------------------------------------------------- the step */
/* Runs once per microbatch where the logits live: loss and its gradient,
   computed on the device; the two numbers smp collects come back to the
   host. The step's user pointer is the engine. */
SMP_STEP_BODY(train_body) {
    const gpu_engine *engine = (const gpu_engine *)smp_mb_user(mb);
    const smp_tensor *logits = smp_mb_output(mb, 0), *labels = smp_mb_arg(mb, 1);
    smp_tensor *dlogits = smp_mb_output_grad(mb, 0); /* NULL in evaluation */
    int n = (int)logits->shape[0];
    float loss = 0.0f, correct = 0.0f;
    smp_status st = gpu_xent_loss(engine, (const float *)logits->data, (const uint8_t *)labels->data, n, FM_CLASSES,
                                  dlogits ? (float *)dlogits->data : NULL, 1.0f / (float)n, &loss, &correct);
    if (!st) st = smp_mb_return_f32(mb, 0, loss);
    return st ? st : smp_mb_return_f32(mb, 1, correct);
}

/* Pipelined evaluation over a host dataset, a batch at a time through the
   device: returns accuracy. */
static inline smp_status evaluate(smp_model *model, const gpu_engine *engine, const fm_dataset *ds, int batch,
                                  double *accuracy) {
    int64_t n = (int64_t)ds->n / batch * batch, correct = 0;
    float *images = (float *)smp_nccl_alloc(sizeof(float) * (size_t)batch * FM_PIXELS);
    uint8_t *labels = (uint8_t *)smp_nccl_alloc((size_t)batch);
    smp_status st = gpu_agree(images && labels ? SMP_OK : SMP_ERR_DEVICE); /* smp_nccl_alloc left the message */
    for (int64_t at = 0; at < n && !st; at += batch) {
        st = gpu_upload(engine, images, ds->images + at * FM_PIXELS, sizeof(float) * (size_t)batch * FM_PIXELS);
        if (!st) st = gpu_upload(engine, labels, ds->labels + at, (size_t)batch);
        if ((st = gpu_agree(st))) break;
        smp_tensor x = device_tensor(smp_tensor_2d(images, SMP_F32, batch, FM_PIXELS));
        smp_tensor y = device_tensor(smp_tensor_1d(labels, SMP_U8, batch));
        smp_step_output out[2] = {{0, NULL}, {0, NULL}};
        if ((st = SMP_EVAL_STEP(model, train_body, (void *)engine, out, 2, x, y))) break;
        float sum;
        smp_tensor sum_t = smp_tensor_make(&sum, SMP_F32, 0, NULL);
        st = smp_step_output_reduce_sum(&out[1], &sum_t);
        correct += (int64_t)sum;
        smp_step_output_free(&out[0]);
        smp_step_output_free(&out[1]);
    }
    smp_nccl_free(images);
    smp_nccl_free(labels);
    *accuracy = n ? (double)correct / (double)n : 0;
    return st;
}

#endif
