/* fake_engine_twins.h - host twins of examples/cuda_engine.h's kernels (bias
   rows, bias gradients, Adam) for test/fake_cuda.c's CPU device. Each twin
   does its kernel's float operations in the kernel's order. Included by the
   twins of each example's own kernels (fake_fmnist_twins.h, fake_gpt_twins.h). */
#ifndef FAKE_ENGINE_TWINS_H
#define FAKE_ENGINE_TWINS_H
#include "fake_twins.h"

#include <cfloat>
#include <cmath>

/* Grid-stride kernels reach every element whatever the launch, each element
   on its own: one pass in index order does the same arithmetic. */
static void twin_add_bias_rows(float *y, const float *b, int64_t rows, int out) {
    int64_t total = rows * out;
    for (int64_t i = 0; i < total; i++) y[i] += b[i % out];
}

/* One thread per column (those the launch has), rows in order. */
static void twin_bias_grad(const float *dy, float *db, int rows, int out) {
    for (long long j = 0; j < fake_threads() && j < out; j++) {
        float s = db[j];
        for (int i = 0; i < rows; i++) s += dy[(int64_t)i * out + j];
        db[j] = s;
    }
}

static void twin_adam(float *p, const float *g, float *m, float *v, int64_t n, float b1, float b2, float step,
                      float inv_sqrt_bc2, float eps, float decay) {
    for (int64_t i = 0; i < n; i++) {
        float mi = b1 * m[i] + (1.0f - b1) * g[i];
        float vi = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
        if (fabsf(mi) < FLT_MIN) mi = 0.0f;
        if (vi < FLT_MIN) vi = 0.0f;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * decay - step * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
    }
}

__attribute__((constructor)) static void fake_register_engine_twins(void) {
    fake_cuda_twin(add_bias_rows_kernel, twin_add_bias_rows);
    fake_cuda_twin(bias_grad_kernel, twin_bias_grad);
    fake_cuda_twin(adam_kernel, twin_adam);
}
#endif
