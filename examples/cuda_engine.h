/* cuda_engine.h - what the CUDA examples share: the engine (a stream and a
   cuBLAS handle), error handling that turns CUDA and cuBLAS failures into
   smp errors, linear layers on cuBLAS with their bias kernels, and Adam.
   fmnist_cuda.h (the Fashion-MNIST MLP) and gpt_cuda.h (the GPT) build
   their models on it.

   STREAMS
     All work is queued on the engine stream, which gpu_engine_init also
     hands to smp (smp_nccl_set_stream): smp then orders its transfers after
     the kernels that produce their data, and the kernels that consume
     received data after the transfers, without any host wait.

   NUMBERS
     cuBLAS runs sgemm in full f32 (its default math mode; no TF32 unless
     NVIDIA_TF32_OVERRIDE says so). Bias gradients add rows in order, so a
     run repeats itself on the same GPU.

   Include after smp.h, smp_pipeline.h and smp_nccl.h, from a .cu file.
   Link: -lcublas -lnccl
*/
#ifndef CUDA_ENGINE_H
#define CUDA_ENGINE_H
#define MLP_ENGINE_NO_BLAS /* the seeded init and Adam's settings; the arithmetic is below */
#include "mlp_engine.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#if CUDART_VERSION < 11050
#error "cuda_engine.h needs CUDA 11.5 or newer (cublasGetStatusString)"
#endif

/* ---------------------------------------------------------------- errors */
/* Engine failures become smp errors: inside a module callback smp adds the
   module's name and makes the error every rank's. */
static inline smp_status gpu_cuda_fail(cudaError_t e, const char *call) {
    (void)cudaGetLastError(); /* clear a non-sticky error so the next call is not blamed for it */
    return smp_error(SMP_ERR_DEVICE, "%s failed: %s (%s)", call, cudaGetErrorString(e), cudaGetErrorName(e));
}
#define GPU_CUDA(fn, args)                                                                                  \
    do {                                                                                                    \
        cudaError_t e_ = fn args;                                                                           \
        if (e_ != cudaSuccess) return gpu_cuda_fail(e_, #fn);                                               \
    } while (0)
#define GPU_CUBLAS(fn, args)                                                                                \
    do {                                                                                                    \
        cublasStatus_t s_ = fn args;                                                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                                    \
            return smp_error(SMP_ERR_DEVICE, "%s failed: %s (%s)", #fn, cublasGetStatusString(s_),         \
                             cublasGetStatusName(s_));                                                      \
    } while (0)
/* A launch reports a bad configuration at once; a fault in the kernel
   surfaces later, at the next call that waits for the stream. */
#define GPU_LAUNCHED(kernel)                                                                                \
    do {                                                                                                    \
        cudaError_t e_ = cudaGetLastError();                                                                \
        if (e_ != cudaSuccess) return gpu_cuda_fail(e_, "launching " #kernel);                              \
    } while (0)

/* smp agrees on the outcome of its own collective calls; the engine's
   calls between them are the engine's to agree on: a rank that failed alone
   would leave the others waiting for it in the next collective. */
static inline smp_status gpu_agree(smp_status st) {
    int failed = st != SMP_OK;
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_LOR, MPI_COMM_WORLD);
    return st ? st : failed ? smp_error(SMP_ERR_REMOTE, "another rank failed (its message is above)") : SMP_OK;
}

/* ---------------------------------------------------------------- the engine */
typedef struct gpu_engine {
    cudaStream_t stream;   /* every kernel, copy and cuBLAS call; smp's engine stream too */
    cublasHandle_t blas;
    float *stats;          /* device: a microbatch's few numbers (loss, correct count), read back together */
} gpu_engine;

/* After smp_init, which made this rank's GPU current. */
static inline smp_status gpu_engine_init(gpu_engine *e) {
    memset(e, 0, sizeof *e);
    /* non-blocking: no implicit ordering with the legacy default stream,
       which some libraries use behind our back */
    GPU_CUDA(cudaStreamCreateWithFlags, (&e->stream, cudaStreamNonBlocking));
    smp_nccl_set_stream(e->stream);
    GPU_CUBLAS(cublasCreate, (&e->blas));
    GPU_CUBLAS(cublasSetStream, (e->blas, e->stream));
    e->stats = (float *)smp_nccl_alloc(2 * sizeof(float));
    return e->stats ? SMP_OK : SMP_ERR_DEVICE; /* smp_nccl_alloc left the message */
}

/* Before smp_finalize (smp_nccl_free needs smp), after smp_model_free (the
   model's device memory is freed in order on this stream). */
static inline void gpu_engine_free(gpu_engine *e) {
    if (!e->stream) return;
    smp_nccl_free(e->stats);
    cudaError_t sync = cudaStreamSynchronize(e->stream);
    if (sync != cudaSuccess)
        fprintf(stderr, "cudaStreamSynchronize failed at shut-down: %s\n", cudaGetErrorString(sync));
    if (e->blas) {
        cublasStatus_t s = cublasDestroy(e->blas);
        if (s != CUBLAS_STATUS_SUCCESS) fprintf(stderr, "cublasDestroy failed: %s\n", cublasGetStatusString(s));
    }
    smp_nccl_set_stream(0); /* smp must not order anything after a destroyed stream */
    cudaError_t destroy = cudaStreamDestroy(e->stream);
    if (destroy != cudaSuccess) fprintf(stderr, "cudaStreamDestroy failed: %s\n", cudaGetErrorString(destroy));
    memset(e, 0, sizeof *e);
}

/* Host to device on the engine stream. From pageable memory the call
   returns once src has been copied out, so the caller may refill src at
   once; the kernels queued after it see the data. */
static inline smp_status gpu_upload(const gpu_engine *e, void *dst, const void *src, size_t bytes) {
    GPU_CUDA(cudaMemcpyAsync, (dst, src, bytes, cudaMemcpyHostToDevice, e->stream));
    return SMP_OK;
}

/* A view of device memory as an smp tensor. */
static inline smp_tensor device_tensor(smp_tensor t) {
    t.device = smp_nccl_device();
    return t;
}

/* ---------------------------------------------------------------- kernels */
enum { GPU_THREADS = 256 };

/* Grid-stride loops: enough blocks to fill the GPU, never more than a
   launch may have. */
static inline unsigned gpu_blocks(int64_t count) {
    int64_t b = (count + GPU_THREADS - 1) / GPU_THREADS;
    return (unsigned)(b < 4096 ? b : 4096);
}

__global__ void add_bias_rows_kernel(float *y, const float *b, int64_t rows, int out) {
    int64_t total = rows * out;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
        y[i] += b[i % out];
}

/* One thread per column, rows in order: the same float additions, in the
   same order, as mlp_linear_backward. */
__global__ void bias_grad_kernel(const float *dy, float *db, int rows, int out) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= out) return;
    float s = db[j];
    for (int i = 0; i < rows; i++) s += dy[(int64_t)i * out + j];
    db[j] = s;
}

/* mlp_adam_step, one thread per element; the host folds the bias
   corrections into step and inv_sqrt_bc2 once per tensor. */
__global__ void adam_kernel(float *p, const float *g, float *m, float *v, int64_t n, float b1, float b2, float step,
                            float inv_sqrt_bc2, float eps, float decay) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float mi = b1 * m[i] + (1.0f - b1) * g[i];
        float vi = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
        /* as on the CPU: moments of dead units decay into subnormals, which
           change nothing in p; keep them exact zeros */
        if (fabsf(mi) < FLT_MIN) mi = 0.0f;
        if (vi < FLT_MIN) vi = 0.0f;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * decay - step * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
    }
}

/* ---------------------------------------------------------------- layers */
/* Linear, W is out x in (PyTorch layout), all row-major:
   y (n x out) = x (n x in) * W^T + b. cuBLAS is column-major, where a
   row-major matrix reads as its transpose: y^T = W * x^T, i.e. op(W^T) = T
   on W's (in x out) column-major view. */
static inline smp_status gpu_linear_forward(const gpu_engine *e, const float *x, const float *W, const float *b,
                                            float *y, int n, int in, int out) {
    if (n <= 0 || out <= 0) return SMP_OK;
    const float one = 1.0f, zero = 0.0f;
    GPU_CUBLAS(cublasSgemm, (e->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, W, in, x, in, &zero, y, out));
    if (b) {
        add_bias_rows_kernel<<<gpu_blocks((int64_t)n * out), GPU_THREADS, 0, e->stream>>>(y, b, n, out);
        GPU_LAUNCHED(add_bias_rows_kernel);
    }
    return SMP_OK;
}

/* Given dy (n x out) and the forward's input x (n x in):
     dx  = dy * W            (overwritten; NULL: not wanted)   dx^T = W^T dy^T
     dW += dy^T * x          (accumulated)                      dW^T += x^T dy
     db += column sums of dy (accumulated, rows in order) */
static inline smp_status gpu_linear_backward(const gpu_engine *e, const float *x, const float *W, const float *dy,
                                             float *dx, float *dW, float *db, int n, int in, int out) {
    if (n <= 0 || in <= 0 || out <= 0) return SMP_OK;
    const float one = 1.0f, zero = 0.0f;
    if (dx)
        GPU_CUBLAS(cublasSgemm, (e->blas, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, &one, W, in, dy, out, &zero, dx, in));
    if (dW)
        GPU_CUBLAS(cublasSgemm, (e->blas, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, &one, x, in, dy, out, &one, dW, in));
    if (db) {
        bias_grad_kernel<<<(out + GPU_THREADS - 1) / GPU_THREADS, GPU_THREADS, 0, e->stream>>>(dy, db, n, out);
        GPU_LAUNCHED(bias_grad_kernel);
    }
    return SMP_OK;
}

/* One Adam step on n device parameters (mlp_adam_step's arithmetic); t
   counts from 1. */
static inline smp_status gpu_adam_step(const gpu_engine *e, float *p, const float *g, float *m, float *v, size_t n,
                                       int64_t t, const mlp_adam_cfg *c) {
    if (!n) return SMP_OK;
    float bc1 = (float)(1.0 - pow((double)c->beta1, (double)t));
    float bc2 = (float)(1.0 - pow((double)c->beta2, (double)t));
    adam_kernel<<<gpu_blocks((int64_t)n), GPU_THREADS, 0, e->stream>>>(p, g, m, v, (int64_t)n, c->beta1, c->beta2,
                                                                       c->lr / bc1, 1.0f / sqrtf(bc2), c->eps,
                                                                       1.0f - c->lr * c->weight_decay);
    GPU_LAUNCHED(adam_kernel);
    return SMP_OK;
}

static inline float *values_of(smp_param *p) { return (float *)smp_param_value(p)->data; }
static inline float *grads_of(smp_param *p) { return (float *)smp_param_grad(p)->data; }

#ifdef SMP_CHECKPOINT_H
/* ---------------------------------------------------------------- Adam's moments */
/* Adam's two moments for the local parameters of a partitioned model, on
   the device and zeroed, for the elements this replica updates: elements
   [first[i], first[i] + count[i]) of local parameter i, as
   smp_param_owned_range says (all of it, or under shard_optimizer_state
   the replica's owned range: full-size state is never allocated then).
   Registered with reg as "exp_avg" and "exp_avg_sq" (in the parameter's
   shape, or sharded 1-d over the range): smp's memory account counts them
   and checkpoints carry them. */
typedef struct gpu_moments {
    int n;
    int64_t *first, *count;
    float **m, **v;
} gpu_moments;

static inline void gpu_moments_free(gpu_moments *o) {
    for (int i = 0; i < o->n; i++) {
        if (o->m) smp_nccl_free(o->m[i]);
        if (o->v) smp_nccl_free(o->v[i]);
    }
    free(o->first);
    free(o->count);
    free(o->m);
    free(o->v);
    memset(o, 0, sizeof *o);
}

static inline smp_status gpu_moments_init(gpu_moments *o, smp_model *model, const gpu_engine *e, smp_optimizer *reg) {
    memset(o, 0, sizeof *o);
    int n = 0;
    while (smp_model_local_param(model, n, false)) n++;
    o->first = (int64_t *)calloc((size_t)n + 1, sizeof *o->first);
    o->count = (int64_t *)calloc((size_t)n + 1, sizeof *o->count);
    o->m = (float **)calloc((size_t)n + 1, sizeof *o->m);
    o->v = (float **)calloc((size_t)n + 1, sizeof *o->v);
    if (!o->first || !o->count || !o->m || !o->v) return smp_error(SMP_ERR_NOMEM, "out of memory for Adam's state");
    o->n = n;
    for (int i = 0; i < n; i++) {
        smp_param *p = smp_model_local_param(model, i, false);
        SMP_TRY(smp_param_owned_range(model, p, &o->first[i], &o->count[i]));
        size_t bytes = sizeof(float) * (size_t)(o->count[i] ? o->count[i] : 1);
        o->m[i] = (float *)smp_nccl_alloc(bytes);
        o->v[i] = (float *)smp_nccl_alloc(bytes);
        if (!o->m[i] || !o->v[i])
            return smp_error(SMP_ERR_NOMEM, "out of device memory for Adam's state of '%s' (%zu bytes): %s",
                             smp_param_name(p), bytes, smp_last_error());
        GPU_CUDA(cudaMemsetAsync, (o->m[i], 0, bytes, e->stream));
        GPU_CUDA(cudaMemsetAsync, (o->v[i], 0, bytes, e->stream));
        /* the parameter's shape unsharded (a checkpoint's state then has it), the range's length sharded */
        smp_tensor m = device_tensor(*smp_param_value(p)), v;
        if (smp_current_config()->shard_optimizer_state == SMP_ON)
            m = device_tensor(smp_tensor_1d(NULL, SMP_F32, o->count[i]));
        m.data = o->m[i];
        v = m;
        v.data = o->v[i];
        SMP_TRY(smp_optimizer_state_add(reg, smp_param_name(p), "exp_avg", &m));
        SMP_TRY(smp_optimizer_state_add(reg, smp_param_name(p), "exp_avg_sq", &v));
    }
    return SMP_OK;
}

/* One Adam step on the elements local parameter i's moments cover. */
static inline smp_status gpu_moments_step(const gpu_moments *o, int i, smp_param *p, const gpu_engine *e, int64_t t,
                                          const mlp_adam_cfg *c) {
    return gpu_adam_step(e, values_of(p) + o->first[i], grads_of(p) + o->first[i], o->m[i], o->v[i],
                         (size_t)o->count[i], t, c);
}
#endif
#endif
