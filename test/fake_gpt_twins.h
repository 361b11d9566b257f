/* fake_gpt_twins.h - host twins of examples/gpt_cuda.h's kernels for
   test/fake_cuda.c's CPU device. Every kernel there is a grid-stride loop
   over items calling a GPT_HD function (one row, element or column); its
   twin calls the same function for every item, so the fake device does the
   kernel's arithmetic exactly. Include after the program (fake_gpt.cu). */
#ifndef FAKE_GPT_TWINS_H
#define FAKE_GPT_TWINS_H
#include "fake_engine_twins.h" /* the engine's kernels: bias, bias gradient, Adam */

#define TWIN_LOOP(i, count) for (int64_t i = 0; i < (count); i++)

static void twin_gpt_embed(const int32_t *ids, const float *W, float *y, int64_t count, int C) {
    TWIN_LOOP(i, count) gpt_k_embed(i, ids, W, y, C);
}
static void twin_gpt_embed_grad(const int32_t *ids, const float *dy, float *dW, int64_t count, int64_t n, int C) {
    TWIN_LOOP(k, count) gpt_k_embed_grad(k, ids, dy, dW, n, C);
}
static void twin_gpt_add_positions(const float *x, const float *P, float *y, int64_t count, int T, int C, int p0) {
    TWIN_LOOP(i, count) gpt_k_add_positions(i, x, P, y, T, C, p0);
}
static void twin_gpt_position_grad(const float *dy, float *dP, int B, int T, int C) {
    TWIN_LOOP(k, (int64_t)T * C) gpt_k_position_grad(k, dy, dP, B, T, C);
}
static void twin_gpt_layernorm(const float *x, const float *w, const float *b, float *y, float *mean, float *rstd,
                               int64_t n, int C) {
    TWIN_LOOP(r, n) gpt_k_layernorm(r, x, w, b, y, mean, rstd, C);
}
static void twin_gpt_layernorm_backward(const float *x, const float *w, const float *mean, const float *rstd,
                                        const float *dy, float *dx, int64_t n, int C) {
    TWIN_LOOP(r, n) gpt_k_layernorm_backward(r, x, w, mean, rstd, dy, dx, C);
}
static void twin_gpt_bias_partial(const float *dy, float *partial, int64_t count, int64_t n, int C) {
    TWIN_LOOP(k, count) gpt_k_bias_partial(k, dy, partial, n, C);
}
static void twin_gpt_layernorm_partial(const float *x, const float *mean, const float *rstd, const float *dy, float *pw,
                                       float *pb, int64_t count, int64_t n, int C) {
    TWIN_LOOP(k, count) gpt_k_layernorm_partial(k, x, mean, rstd, dy, pw, pb, n, C);
}
static void twin_gpt_add_partials(const float *partial, float *dst, int64_t chunks, int C) {
    TWIN_LOOP(j, C) gpt_k_add_partials(j, partial, dst, chunks, C);
}
static void twin_gpt_gelu(const float *x, float *y, float *t, int64_t count) {
    TWIN_LOOP(i, count) gpt__gelu_forward(x + i, y + i, t + i, 1);
}
static void twin_gpt_gelu_backward(const float *x, const float *t, const float *dy, float *dx, int64_t count) {
    TWIN_LOOP(i, count) gpt__gelu_backward(x + i, t + i, dy + i, dx + i, 1);
}
static void twin_gpt_softmax(float *P, int64_t rows, int S, int Tk, int p0) {
    TWIN_LOOP(r, rows) gpt_k_softmax(r, P, S, Tk, p0);
}
static void twin_gpt_kv_append(const float *qkv, float *K, float *V, int64_t count, int C) {
    TWIN_LOOP(i, count) gpt_k_kv_append(i, qkv, K, V, C);
}
static void twin_gpt_softmax_backward(const float *P, float *dP, int64_t rows, int T) {
    TWIN_LOOP(r, rows) gpt_k_softmax_backward(r, P, dP, T);
}
static void twin_gpt_xent(const float *logits, const int32_t *target, int64_t n, int V, float *dlogits,
                          float grad_scale, float *row_loss) {
    TWIN_LOOP(r, n) gpt_k_xent(r, logits, target, V, dlogits, grad_scale, row_loss);
}
static void twin_gpt_mean_loss(const float *row_loss, int64_t n, double *out) { gpt_k_mean_loss(row_loss, n, out); }
static void twin_gpt_add(const float *a, const float *b, float *y, int64_t count) {
    TWIN_LOOP(i, count) y[i] = a[i] + b[i];
}
static void twin_gpt_to_bf16(const float *x, __nv_bfloat16 *y, int64_t count) {
    TWIN_LOOP(i, count) y[i] = __float2bfloat16_rn(x[i]);
}

__attribute__((constructor)) static void fake_register_gpt_twins(void) {
    fake_cuda_twin(gpt_embed_kernel, twin_gpt_embed);
    fake_cuda_twin(gpt_embed_grad_kernel, twin_gpt_embed_grad);
    fake_cuda_twin(gpt_add_positions_kernel, twin_gpt_add_positions);
    fake_cuda_twin(gpt_position_grad_kernel, twin_gpt_position_grad);
    fake_cuda_twin(gpt_layernorm_kernel, twin_gpt_layernorm);
    fake_cuda_twin(gpt_layernorm_backward_kernel, twin_gpt_layernorm_backward);
    fake_cuda_twin(gpt_bias_partial_kernel, twin_gpt_bias_partial);
    fake_cuda_twin(gpt_layernorm_partial_kernel, twin_gpt_layernorm_partial);
    fake_cuda_twin(gpt_add_partials_kernel, twin_gpt_add_partials);
    fake_cuda_twin(gpt_gelu_kernel, twin_gpt_gelu);
    fake_cuda_twin(gpt_gelu_backward_kernel, twin_gpt_gelu_backward);
    fake_cuda_twin(gpt_softmax_kernel, twin_gpt_softmax);
    fake_cuda_twin(gpt_softmax_backward_kernel, twin_gpt_softmax_backward);
    fake_cuda_twin(gpt_kv_append_kernel, twin_gpt_kv_append);
    fake_cuda_twin(gpt_xent_kernel, twin_gpt_xent);
    fake_cuda_twin(gpt_mean_loss_kernel, twin_gpt_mean_loss);
    fake_cuda_twin(gpt_add_kernel, twin_gpt_add);
    fake_cuda_twin(gpt_to_bf16_kernel, twin_gpt_to_bf16);
}
#endif
