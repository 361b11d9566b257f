/* fake_fmnist_twins.h - host twins of examples/fmnist_cuda.h's kernels (ReLU,
   cross-entropy; the engine's are fake_engine_twins.h's) for
   test/fake_cuda.c's CPU device. Each twin does its kernel's float and
   double operations in the kernel's order, so runs compare bit for bit as
   they would on one GPU. Include after the program (fake_fmnist.cu runs the
   demo, fake_bench_nccl.cu the benchmark). */
#ifndef FAKE_FMNIST_TWINS_H
#define FAKE_FMNIST_TWINS_H
#include "fake_engine_twins.h" /* the engine's kernels: bias, bias gradient, Adam */

#include <cfloat>
#include <cmath>

static void twin_relu_forward(const float *x, float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

static void twin_relu_backward(const float *y, const float *dy, float *dx, int64_t count) {
    for (int64_t i = 0; i < count; i++) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

/* One block's work (every block of a larger grid would do the same): thread
   t sums rows t, t + blockDim, ... in double; thread 0 adds the threads'
   sums in thread order. */
static void twin_xent(const float *logits, const uint8_t *labels, int rows, int k, float *dlogits, float grad_scale,
                      float *stats) {
    long long threads;
    int block;
    fake_cuda_launch_dims(&threads, &block);
    double total = 0.0;
    int hits = 0;
    for (int t = 0; t < block; t++) {
        double loss = 0.0;
        int correct = 0;
        for (int i = t; i < rows; i += block)
            xent_row(logits + (int64_t)i * k, labels[i], k, dlogits ? dlogits + (int64_t)i * k : NULL, grad_scale,
                     &loss, &correct);
        total += loss;
        hits += correct;
    }
    stats[0] = rows > 0 ? (float)(total / rows) : 0.0f;
    stats[1] = (float)hits;
}

__attribute__((constructor)) static void fake_register_fmnist_twins(void) {
    fake_cuda_twin(relu_forward_kernel, twin_relu_forward);
    fake_cuda_twin(relu_backward_kernel, twin_relu_backward);
    fake_cuda_twin(xent_kernel, twin_xent);
}
#endif
