/* test_gpu.cu, unchanged, on test/fake_cuda.c's CPU device: the kernels'
   host twins follow the suite. */
#define GPU_LABEL "fake-gpu"
#include "test_gpu.cu"
#include "fake_twins.h"

static void twin_fill(float *p, int n, float v) {
    for (long long i = 0; i < fake_threads() && i < n; i++) p[i] = v;
}
static void twin_scale(float *p, int n, float a) {
    for (long long i = 0; i < fake_threads() && i < n; i++) p[i] *= a;
}
/* the same rounded operations as the kernels, one result at a time */
static void twin_net_linear(const float *x, const float *w, const float *b, float *y, int n, int in, int out) {
    for (long long k = 0; k < fake_threads() && k < (long long)n * out; k++) {
        int r = (int)(k / out), o = (int)(k % out);
        float acc = b[o];
        for (int i = 0; i < in; i++) acc = acc + x[r * in + i] * w[o * in + i];
        y[k] = acc;
    }
}
static void twin_net_linear_gx(const float *w, const float *gy, float *gx, int n, int in, int out) {
    for (long long k = 0; k < fake_threads() && k < (long long)n * in; k++) {
        int r = (int)(k / in), i = (int)(k % in);
        float acc = 0;
        for (int o = 0; o < out; o++) acc = acc + gy[r * out + o] * w[o * in + i];
        gx[k] = acc;
    }
}
static void twin_net_linear_gw(const float *x, const float *gy, float *gw, float *gb, int n, int in, int out) {
    for (long long k = 0; k < fake_threads() && k < (long long)out * (in + 1); k++) {
        int o = (int)(k / (in + 1)), i = (int)(k % (in + 1)) - 1;
        float acc = 0;
        for (int r = 0; r < n; r++) acc = acc + (i < 0 ? gy[r * out + o] : gy[r * out + o] * x[r * in + i]);
        if (i < 0) gb[o] = gb[o] + acc;
        else gw[o * in + i] = gw[o * in + i] + acc;
    }
}
static void twin_net_relu(const float *x, const float *gy, float *y, long long n) {
    for (long long k = 0; k < fake_threads() && k < n; k++) y[k] = x[k] > 0 ? (gy ? gy[k] : x[k]) : 0;
}
static void twin_net_add(const float *a, const float *b, float *y, long long n) {
    for (long long k = 0; k < fake_threads() && k < n; k++) y[k] = a[k] + b[k];
}
static void twin_net_mse(const float *y, const float *t, float *g, float *loss, int n) {
    float acc = 0;
    for (int i = 0; i < n; i++) {
        float d = y[i] - t[i];
        acc = acc + d * d;
        if (g) g[i] = 2.0f * d / (float)n;
    }
    *loss = acc / (float)n;
}

__attribute__((constructor)) static void fake_register_test_twins(void) {
    fake_cuda_twin(k_fill, twin_fill);
    fake_cuda_twin(k_scale, twin_scale);
    fake_cuda_twin(k_net_linear, twin_net_linear);
    fake_cuda_twin(k_net_linear_gx, twin_net_linear_gx);
    fake_cuda_twin(k_net_linear_gw, twin_net_linear_gw);
    fake_cuda_twin(k_net_relu, twin_net_relu);
    fake_cuda_twin(k_net_add, twin_net_add);
    fake_cuda_twin(k_net_mse, twin_net_mse);
}
