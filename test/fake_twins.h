/* fake_twins.h - host twins of smp_nccl.h's kernels, for programs built
   against test/fake_cuda.c (see fake_cuda.h). Include after smp_nccl.h in
   the file that defines SMP_IMPLEMENTATION. Each twin does its kernel's
   arithmetic for every thread the launch has: a launch that is too small
   leaves elements undone here as on a GPU. */
#ifndef FAKE_TWINS_H
#define FAKE_TWINS_H
#include "fake_cuda.h"

static long long fake_threads(void) {
    long long threads;
    int per_block;
    fake_cuda_launch_dims(&threads, &per_block);
    return threads;
}

/* grid-stride loops over n: thread t takes t, t + threads, ... - all of them, in any order */
template <typename T> static void twin_nc_add(T *d, const T *s, long long n) {
    long long th = fake_threads();
    for (long long t = 0; t < th; t++)
        for (long long i = t; i < n; i += th) d[i] = (T)(d[i] + s[i]);
}
static void twin_nc_add_f16(__half *d, const __half *s, long long n) {
    for (long long i = 0; i < n; i++) d[i] = __float2half_rn(__half2float(d[i]) + __half2float(s[i]));
}
static void twin_nc_add_bf16(__nv_bfloat16 *d, const __nv_bfloat16 *s, long long n) {
    for (long long i = 0; i < n; i++) d[i] = __float2bfloat16_rn(__bfloat162float(d[i]) + __bfloat162float(s[i]));
}
template <typename T> static void twin_nc_scale(T *d, T by, long long n) {
    for (long long i = 0; i < n; i++) d[i] = d[i] * by;
}
static void twin_nc_scale_f16(__half *d, float by, long long n) {
    for (long long i = 0; i < n; i++) d[i] = __float2half_rn(__half2float(d[i]) * by);
}
static void twin_nc_scale_bf16(__nv_bfloat16 *d, float by, long long n) {
    for (long long i = 0; i < n; i++) d[i] = __float2bfloat16_rn(__bfloat162float(d[i]) * by);
}

__attribute__((constructor)) static void fake_register_smp_twins(void) {
    fake_cuda_twin(smp__nc_add_kernel<float>, twin_nc_add<float>);
    fake_cuda_twin(smp__nc_add_kernel<double>, twin_nc_add<double>);
    fake_cuda_twin(smp__nc_add_kernel<int32_t>, twin_nc_add<int32_t>);
    fake_cuda_twin(smp__nc_add_kernel<int64_t>, twin_nc_add<int64_t>);
    fake_cuda_twin(smp__nc_add_kernel<uint8_t>, twin_nc_add<uint8_t>);
    fake_cuda_twin(smp__nc_add_f16, twin_nc_add_f16);
    fake_cuda_twin(smp__nc_add_bf16, twin_nc_add_bf16);
    fake_cuda_twin(smp__nc_scale_kernel<float>, twin_nc_scale<float>);
    fake_cuda_twin(smp__nc_scale_kernel<double>, twin_nc_scale<double>);
    fake_cuda_twin(smp__nc_scale_f16, twin_nc_scale_f16);
    fake_cuda_twin(smp__nc_scale_bf16, twin_nc_scale_bf16);
}
#endif
