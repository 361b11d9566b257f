/* examples/nccl_allreduce.cu, unchanged, on test/fake_cuda.c's CPU device. */
#include "nccl_allreduce.cu"
#include "fake_twins.h"

static void twin_fill(float *x, int n, float v) {
    for (long long i = 0; i < fake_threads() && i < n; i++) x[i] = v;
}
static void twin_affine(float *y, const float *x, int n, float a, float b) {
    for (long long i = 0; i < fake_threads() && i < n; i++) y[i] = a * x[i] + b;
}
static void twin_add_into(float *acc, const float *x, int n) {
    for (long long i = 0; i < fake_threads() && i < n; i++) acc[i] += x[i];
}

__attribute__((constructor)) static void fake_register_example_twins(void) {
    fake_cuda_twin(fill, twin_fill);
    fake_cuda_twin(affine, twin_affine);
    fake_cuda_twin(add_into, twin_add_into);
}
