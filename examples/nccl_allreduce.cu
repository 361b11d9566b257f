/* nccl_allreduce.cu - smp's CUDA backend in a small program: the device
   chosen from the local rank, a data-parallel gradient average on the GPU,
   and a two-stage pipeline that passes activations forward and gradients
   backward between GPUs, then averages the stage's gradient over its
   replicas.

   Build: nvcc -ccbin mpicxx -O2 -I. examples/nccl_allreduce.cu -o build/examples/nccl_allreduce -lnccl
   Run:   mpirun -n 2 build/examples/nccl_allreduce      (or -n 4: 2 stages x 2 replicas)

   With one GPU per rank the data moves over NCCL; when ranks share a GPU
   smp moves it through pinned host memory over MPI instead; without a GPU
   the program says so and exits. Nothing below depends on which.
*/
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_nccl.h" /* registers the CUDA backend */

#include <stdio.h>

#define CUDA_OK(call)                                                                                  \
    do {                                                                                               \
        cudaError_t e_ = (call);                                                                       \
        if (e_ != cudaSuccess) {                                                                       \
            fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_));                         \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                              \
        }                                                                                              \
    } while (0)

#define SMP_OK_OR_DIE(call)                                                                            \
    do {                                                                                               \
        if ((call) != SMP_OK) {                                                                        \
            fprintf(stderr, "rank %d: %s failed: %s\n", smp_rank(), #call, smp_last_error());          \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                              \
        }                                                                                              \
    } while (0)

__global__ void fill(float *x, int n, float v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
/* y = a * x + b */
__global__ void affine(float *y, const float *x, int n, float a, float b) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
__global__ void add_into(float *acc, const float *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += x[i];
}
static int blocks(int n) { return (n + 255) / 256; }

static float first_value(const float *d) {
    float h = 0;
    CUDA_OK(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost)); /* default stream: after smp's work */
    return h;
}

int main(void) {
    int world = 1;
    MPI_Init(NULL, NULL);
    MPI_Comm_size(MPI_COMM_WORLD, &world);

    smp_config cfg = {};
    cfg.partitions = world % 2 == 0 ? 2 : 1; /* two pipeline stages when the ranks pair up */
    if (world / cfg.partitions > 1) cfg.ddp = SMP_ON;
    SMP_OK_OR_DIE(smp_init(&cfg));
    if (smp_nccl_current_mode() == SMP_NCCL_MODE_NONE) {
        if (smp_rank() == 0) printf("%s: this example needs a GPU\n", smp_nccl_describe());
        smp_finalize();
        MPI_Finalize();
        return 0;
    }
    /* smp_init made device smp_local_rank() % (GPUs on the node) current */
    if (smp_rank() == 0) printf("%s; %d rank(s), %d stage(s)\n", smp_nccl_describe(), world, smp_mp_size());

    /* 1. data parallel: every rank holds a gradient; average it over the world */
    const int n = 1 << 20;
    float *grad;
    CUDA_OK(cudaMalloc((void **)&grad, sizeof(float) * n));
    fill<<<blocks(n), 256>>>(grad, n, (float)(smp_rank() + 1));
    smp_tensor g = smp_tensor_1d(grad, SMP_F32, n);
    g.device = smp_nccl_device();
    SMP_OK_OR_DIE(smp_all_reduce(&g, &g, SMP_AVG, SMP_WORLD)); /* queued after fill, before anything later */
    if (smp_rank() == 0) printf("all_reduce avg: %g (expected %g)\n", first_value(grad), (world + 1) / 2.0);

    /* 2. a two-stage pipeline over MP_GROUP: stage 0 computes act = 2x + 1 per
       microbatch and sends it on; stage 1 sends back d(loss)/d(act) = 2 act;
       stage 0 accumulates those gradients, then averages them over its
       data-parallel replicas. Receives are queued before the data exists. */
    if (smp_mp_size() == 2) {
        const int M = 4, m = 1 << 16;
        int stage = smp_mp_rank(), peer = 1 - stage;
        SMP_OK_OR_DIE(smp_nccl_p2p_connect(SMP_MP_GROUP, &peer, 1));
        float *act, *dact, *x, *acc;
        CUDA_OK(cudaMalloc((void **)&act, sizeof(float) * m * M));
        CUDA_OK(cudaMalloc((void **)&dact, sizeof(float) * m * M));
        CUDA_OK(cudaMalloc((void **)&x, sizeof(float) * m));
        CUDA_OK(cudaMalloc((void **)&acc, sizeof(float) * m));
        smp_nccl_request *req[2 * 4];
        int nreq = 0;
        if (stage == 0) {
            for (int k = 0; k < M; k++) /* gradients come back later */
                SMP_OK_OR_DIE(
                    smp_nccl_irecv(dact + (size_t)k * m, sizeof(float) * m, peer, SMP_MP_GROUP, &req[nreq++]));
            for (int k = 0; k < M; k++) {
                fill<<<blocks(m), 256>>>(x, m, (float)(k + 1));                 /* microbatch k */
                affine<<<blocks(m), 256>>>(act + (size_t)k * m, x, m, 2.0f, 1.0f); /* forward */
                SMP_OK_OR_DIE(smp_nccl_isend(act + (size_t)k * m, sizeof(float) * m, peer, SMP_MP_GROUP, &req[nreq++]));
            }
            fill<<<blocks(m), 256>>>(acc, m, 0.0f);
            for (int k = 0; k < M; k++) {
                /* the gradient of microbatch k is here */
                SMP_OK_OR_DIE(smp_nccl_wait(req[k]));
                add_into<<<blocks(m), 256>>>(acc, dact + (size_t)k * m, m);     /* backward: accumulate */
            }
            for (int k = M; k < nreq; k++) SMP_OK_OR_DIE(smp_nccl_wait(req[k]));
            smp_tensor a = smp_tensor_1d(acc, SMP_F32, m);
            a.device = smp_nccl_device();
            SMP_OK_OR_DIE(smp_all_reduce(&a, &a, SMP_AVG, SMP_DP_GROUP));      /* data parallel over replicas */
            float want = 0;
            for (int k = 0; k < M; k++) want += 2.0f * (2.0f * (k + 1) + 1.0f);
            if (smp_dp_rank() == 0) printf("stage 0: accumulated gradient %g (expected %g)\n", first_value(acc), want);
        } else {
            for (int k = 0; k < M; k++)
                SMP_OK_OR_DIE(smp_nccl_irecv(act + (size_t)k * m, sizeof(float) * m, peer, SMP_MP_GROUP, &req[nreq++]));
            for (int k = 0; k < M; k++) {
                SMP_OK_OR_DIE(smp_nccl_wait(req[k]));                                            /* activations of k */
                /* loss = sum act^2 */
                affine<<<blocks(m), 256>>>(dact + (size_t)k * m, act + (size_t)k * m, m, 2.0f, 0.0f);
                SMP_OK_OR_DIE(
                    smp_nccl_isend(dact + (size_t)k * m, sizeof(float) * m, peer, SMP_MP_GROUP, &req[nreq++]));
            }
            for (int k = M; k < nreq; k++) SMP_OK_OR_DIE(smp_nccl_wait(req[k]));
            if (smp_dp_rank() == 0)
                printf("stage 1: last activation %g (expected %g)\n", first_value(act + (size_t)(M - 1) * m),
                       2.0 * M + 1);
        }
        SMP_OK_OR_DIE(smp_nccl_synchronize()); /* everything queued is done (with a deadline) */
        CUDA_OK(cudaFree(act));
        CUDA_OK(cudaFree(dact));
        CUDA_OK(cudaFree(x));
        CUDA_OK(cudaFree(acc));
    }
    CUDA_OK(cudaFree(grad));
    smp_finalize();
    MPI_Finalize();
    return 0;
}
