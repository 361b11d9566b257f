/* gpt_cuda.h - gpt_model.h's GPT on a GPU: the leaves' callbacks
   (gpt_leaves) on device memory, for gpt.cu.

   The module tree, parameter names, shapes, initialisation and composites
   are gpt_model.h's (gpt_build_with), so a checkpoint of either program
   loads into the other. The arithmetic:
     GEMMs          cuBLAS: the linear layers and the tied output projection
                    (cuda_engine.h's sgemm, or cublasGemmEx on bf16 copies of
                    both inputs with f32 accumulation under --bf16), and the
                    attention's per-head products (cublasSgemmStridedBatched
                    over the heads, one call per sequence, f32)
     row kernels    layernorm, GELU, the causal softmax and its backward,
                    cross-entropy: one thread per row or element running
                    gpt_model.h's GPT_HD functions, the same arithmetic as
                    the host model's (the fake device's twins call them too)
     column sums    the embedding gradients (one thread per element of
                    wte, over the tokens in order), the position
                    embedding's (one per element, sequences in order), bias
                    and layernorm weight gradients (partial sums over
                    chunks of 32 rows, then the chunks in order): a run
                    repeats itself bit for bit (no atomics)
   Embedding ids and targets are checked on the host before they are
   uploaded (gpt.cu); ids a step takes on the host (generation) are checked
   and uploaded by transformer.wte.

   GENERATION (gpt.cu --generate, gpt_model.h's cached mode): the keys and
   values of each (block, microbatch) stay in device memory ([block_size,
   C] each, allocated on first use, in gpt_gpu); a step's new tokens append
   theirs at their positions (a kernel) and attend over the cache with the
   training attention's GEMMs and softmax kernel, their S queries against
   the p + S keys cached so far.

   PRECISION (--bf16): parameters, gradients, activations and Adam's state
   stay f32; each linear layer rounds its two GEMM inputs to bf16 (weights
   and activations forward, weights and output gradients for dx,
   activations and output gradients for dW) and accumulates in f32. The
   attention's products, layernorm, softmax and the loss stay f32.

   Not on the device (gpt.cu refuses them): dropout, --replicas, --grads.

   Include after smp.h, smp_pipeline.h, smp_nccl.h and smp_checkpoint.h,
   from a .cu file. Link: -lcublas -lnccl */
#ifndef GPT_CUDA_H
#define GPT_CUDA_H
#include "cuda_engine.h"
#include "gpt_model.h"

#include <cuda_bf16.h>

/* ---------------------------------------------------------------- the engine */
typedef struct gpt_gpu {
    gpu_engine e;
    bool bf16;
    void *scratch; /* device bytes for one call at a time (bf16 copies, attention scores), grown on the stream */
    size_t scratch_bytes;
    double *loss; /* device: one microbatch's mean loss */
    float *row_loss; /* device: its rows' losses, summed in order */
    size_t row_cap;
    float **kv_k, **kv_v; /* generation: [kv_slots] device keys and values of (block, microbatch), or NULL */
    size_t kv_slots;
} gpt_gpu;

static inline smp_status gpt_gpu_init(gpt_gpu *gg, bool bf16) {
    memset(gg, 0, sizeof *gg);
    gg->bf16 = bf16;
    SMP_TRY(gpu_engine_init(&gg->e));
    if (bf16) {
        int dev = 0;
        cudaDeviceProp prop;
        GPU_CUDA(cudaGetDevice, (&dev));
        GPU_CUDA(cudaGetDeviceProperties, (&prop, dev));
        if (prop.major < 8)
            return smp_error(SMP_ERR_DEVICE,
                             "--bf16: %s (compute capability %d.%d) has no bf16 GEMMs; they need 8.0 (A100) or newer: "
                             "run without --bf16",
                             prop.name, prop.major, prop.minor);
    }
    gg->loss = (double *)smp_nccl_alloc(sizeof(double));
    return gg->loss ? SMP_OK : SMP_ERR_DEVICE; /* smp_nccl_alloc left the message */
}

static inline void gpt__kv_release(gpt_gpu *gg) {
    for (size_t i = 0; i < gg->kv_slots; i++) {
        smp_nccl_free(gg->kv_k[i]);
        smp_nccl_free(gg->kv_v[i]);
    }
    free(gg->kv_k);
    free(gg->kv_v);
    gg->kv_k = gg->kv_v = NULL;
    gg->kv_slots = 0;
}

/* After smp_model_free. */
static inline void gpt_gpu_free(gpt_gpu *gg) {
    if (gg->e.stream) {
        gpt__kv_release(gg);
        smp_nccl_free(gg->scratch);
        smp_nccl_free(gg->row_loss);
        smp_nccl_free(gg->loss);
    }
    gpu_engine_free(&gg->e);
    memset(gg, 0, sizeof *gg);
}

/* Device memory of at least `bytes` (smp_nccl_alloc: stream-ordered, so the
   previous block is freed after the work queued before, which may still be
   using it). */
static inline smp_status gpt__grow(void **p, size_t *have, size_t bytes, const char *what) {
    if (bytes <= *have) return SMP_OK;
    smp_nccl_free(*p);
    *have = 0;
    if (!(*p = smp_nccl_alloc(bytes)))
        return smp_error(SMP_ERR_NOMEM, "out of device memory: %zu bytes for %s (%s)", bytes, what, smp_last_error());
    *have = bytes;
    return SMP_OK;
}

static inline smp_status gpt__scratch(gpt_gpu *gg, size_t bytes, void **out) {
    SMP_TRY(gpt__grow(&gg->scratch, &gg->scratch_bytes, bytes, "scratch"));
    *out = gg->scratch;
    return SMP_OK;
}

static inline gpt_gpu *gpt__gpu(const gpt *g) { return (gpt_gpu *)g->engine; }

/* ---------------------------------------------------------------- kernel bodies */
/* Each kernel is a grid-stride loop over items calling one of these; the
   fake device's twins (test/fake_gpt_twins.h) loop over every item calling
   the same function. */
#define GPT_GRID_LOOP(i, count)                                                                                        \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (count); i += (int64_t)gridDim.x * blockDim.x)

/* element i of n x C: the row of token i / C */
GPT_HD static inline void gpt_k_embed(int64_t i, const int32_t *ids, const float *W, float *y, int C) {
    y[i] = W[(size_t)ids[i / C] * C + i % C];
}
/* element k of dW [V, C]: the tokens with its id, in order (no atomics;
   each thread reads all n ids, which the cache holds) */
GPT_HD static inline void gpt_k_embed_grad(int64_t k, const int32_t *ids, const float *dy, float *dW, int64_t n,
                                           int C) {
    int64_t v = k / C, j = k % C;
    float s = dW[k];
    for (int64_t t = 0; t < n; t++)
        if (ids[t] == v) s += dy[t * C + j];
    dW[k] = s;
}
GPT_HD static inline void gpt_k_add_positions(int64_t i, const float *x, const float *P, float *y, int T, int C,
                                              int p0) {
    int64_t t = (i / C) % T;
    y[i] = x[i] + P[(size_t)(p0 + t) * C + i % C];
}
/* element k of dP [T, C]: the sequences in order */
GPT_HD static inline void gpt_k_position_grad(int64_t k, const float *dy, float *dP, int B, int T, int C) {
    for (int b = 0; b < B; b++) dP[k] += dy[(size_t)b * T * C + k];
}
GPT_HD static inline void gpt_k_layernorm(int64_t r, const float *x, const float *w, const float *b, float *y,
                                          float *mean, float *rstd, int C) {
    gpt__layernorm_forward(x + r * C, w, b, y + r * C, mean + r, rstd + r, 1, C);
}
GPT_HD static inline void gpt_k_layernorm_backward(int64_t r, const float *x, const float *w, const float *mean,
                                                   const float *rstd, const float *dy, float *dx, int C) {
    gpt__layernorm_backward_row(x + r * C, w, mean[r], rstd[r], dy + r * C, dx + r * C, C);
}
/* Column sums over many rows, in a fixed order: chunk c's rows
   [c R, c R + R) go into partial[c][j] (in row order), then each column
   adds the chunks' partials in chunk order. Enough threads for thousands
   of rows, and the same bits on every run. */
#define GPT_CHUNK_ROWS ((int64_t)32)
static inline int64_t gpt__chunks(int64_t n) { return (n + GPT_CHUNK_ROWS - 1) / GPT_CHUNK_ROWS; }
/* item k = (chunk c, column j): the chunk's sum of dy's column */
GPT_HD static inline void gpt_k_bias_partial(int64_t k, const float *dy, float *partial, int64_t n, int C) {
    int64_t c = k / C, j = k % C, end = (c + 1) * GPT_CHUNK_ROWS < n ? (c + 1) * GPT_CHUNK_ROWS : n;
    float s = 0;
    for (int64_t r = c * GPT_CHUNK_ROWS; r < end; r++) s += dy[r * C + j];
    partial[k] = s;
}
/* item k = (chunk c, column j): layernorm's dw and db over the chunk's rows */
GPT_HD static inline void gpt_k_layernorm_partial(int64_t k, const float *x, const float *mean, const float *rstd,
                                                  const float *dy, float *pw, float *pb, int64_t n, int C) {
    int64_t c = k / C, j = k % C, r0 = c * GPT_CHUNK_ROWS, rows = n - r0 < GPT_CHUNK_ROWS ? n - r0 : GPT_CHUNK_ROWS;
    pw[k] = pb[k] = 0;
    gpt__layernorm_param_grads(x + r0 * C, mean + r0, rstd + r0, dy + r0 * C, pw + c * C, pb + c * C, (int)rows, C,
                               (int)j);
}
/* column j: dst[j] += the chunks' partials, in chunk order */
GPT_HD static inline void gpt_k_add_partials(int64_t j, const float *partial, float *dst, int64_t chunks, int C) {
    float s = dst[j];
    for (int64_t c = 0; c < chunks; c++) s += partial[c * C + j];
    dst[j] = s;
}

/* row r of [rows, Tk] scores, S queries a head: query position p0 + r % S (training: S = Tk, p0 = 0) */
GPT_HD static inline void gpt_k_softmax(int64_t r, float *P, int S, int Tk, int p0) {
    gpt__causal_softmax_row(P + r * Tk, p0 + (int)(r % S), Tk);
}
GPT_HD static inline void gpt_k_softmax_backward(int64_t r, const float *P, float *dP, int T) {
    gpt__causal_softmax_backward_row(P + r * T, dP + r * T, (int)(r % T), T);
}
GPT_HD static inline void gpt_k_xent(int64_t r, const float *logits, const int32_t *target, int V, float *dlogits,
                                     float grad_scale, float *row_loss) {
    row_loss[r] = gpt__xent_row(logits + r * V, target[r], V, dlogits ? dlogits + r * V : NULL, grad_scale);
}
/* element i of S new tokens' keys and values [S, C] into the cache (K and V at their first position) */
GPT_HD static inline void gpt_k_kv_append(int64_t i, const float *qkv, float *K, float *V, int C) {
    int64_t t = i / C, j = i % C;
    K[i] = qkv[t * 3 * C + C + j];
    V[i] = qkv[t * 3 * C + 2 * C + j];
}
/* the mean of n row losses, added in row order in double: gpt_xent's sum */
GPT_HD static inline void gpt_k_mean_loss(const float *row_loss, int64_t n, double *out) {
    double s = 0;
    for (int64_t r = 0; r < n; r++) s += (double)row_loss[r];
    *out = n ? s / (double)n : 0;
}

/* ---------------------------------------------------------------- kernels */
__global__ void gpt_embed_kernel(const int32_t *ids, const float *W, float *y, int64_t count, int C) {
    GPT_GRID_LOOP(i, count) gpt_k_embed(i, ids, W, y, C);
}
__global__ void gpt_embed_grad_kernel(const int32_t *ids, const float *dy, float *dW, int64_t count, int64_t n, int C) {
    GPT_GRID_LOOP(k, count) gpt_k_embed_grad(k, ids, dy, dW, n, C);
}
__global__ void gpt_add_positions_kernel(const float *x, const float *P, float *y, int64_t count, int T, int C,
                                         int p0) {
    GPT_GRID_LOOP(i, count) gpt_k_add_positions(i, x, P, y, T, C, p0);
}
__global__ void gpt_position_grad_kernel(const float *dy, float *dP, int B, int T, int C) {
    GPT_GRID_LOOP(k, (int64_t)T * C) gpt_k_position_grad(k, dy, dP, B, T, C);
}
__global__ void gpt_layernorm_kernel(const float *x, const float *w, const float *b, float *y, float *mean, float *rstd,
                                     int64_t n, int C) {
    GPT_GRID_LOOP(r, n) gpt_k_layernorm(r, x, w, b, y, mean, rstd, C);
}
__global__ void gpt_layernorm_backward_kernel(const float *x, const float *w, const float *mean, const float *rstd,
                                              const float *dy, float *dx, int64_t n, int C) {
    GPT_GRID_LOOP(r, n) gpt_k_layernorm_backward(r, x, w, mean, rstd, dy, dx, C);
}
__global__ void gpt_bias_partial_kernel(const float *dy, float *partial, int64_t count, int64_t n, int C) {
    GPT_GRID_LOOP(k, count) gpt_k_bias_partial(k, dy, partial, n, C);
}
__global__ void gpt_layernorm_partial_kernel(const float *x, const float *mean, const float *rstd, const float *dy,
                                             float *pw, float *pb, int64_t count, int64_t n, int C) {
    GPT_GRID_LOOP(k, count) gpt_k_layernorm_partial(k, x, mean, rstd, dy, pw, pb, n, C);
}
__global__ void gpt_add_partials_kernel(const float *partial, float *dst, int64_t chunks, int C) {
    GPT_GRID_LOOP(j, C) gpt_k_add_partials(j, partial, dst, chunks, C);
}
__global__ void gpt_gelu_kernel(const float *x, float *y, float *t, int64_t count) {
    GPT_GRID_LOOP(i, count) gpt__gelu_forward(x + i, y + i, t + i, 1);
}
__global__ void gpt_gelu_backward_kernel(const float *x, const float *t, const float *dy, float *dx, int64_t count) {
    GPT_GRID_LOOP(i, count) gpt__gelu_backward(x + i, t + i, dy + i, dx + i, 1);
}
__global__ void gpt_softmax_kernel(float *P, int64_t rows, int S, int Tk, int p0) {
    GPT_GRID_LOOP(r, rows) gpt_k_softmax(r, P, S, Tk, p0);
}
__global__ void gpt_kv_append_kernel(const float *qkv, float *K, float *V, int64_t count, int C) {
    GPT_GRID_LOOP(i, count) gpt_k_kv_append(i, qkv, K, V, C);
}
__global__ void gpt_softmax_backward_kernel(const float *P, float *dP, int64_t rows, int T) {
    GPT_GRID_LOOP(r, rows) gpt_k_softmax_backward(r, P, dP, T);
}
__global__ void gpt_xent_kernel(const float *logits, const int32_t *target, int64_t n, int V, float *dlogits,
                                float grad_scale, float *row_loss) {
    GPT_GRID_LOOP(r, n) gpt_k_xent(r, logits, target, V, dlogits, grad_scale, row_loss);
}
/* one thread: the rows in order */
__global__ void gpt_mean_loss_kernel(const float *row_loss, int64_t n, double *out) {
    if (blockIdx.x == 0 && threadIdx.x == 0) gpt_k_mean_loss(row_loss, n, out);
}
/* y = a + b (y may be a or b): the plain loop's residuals */
__global__ void gpt_add_kernel(const float *a, const float *b, float *y, int64_t count) {
    GPT_GRID_LOOP(i, count) y[i] = a[i] + b[i];
}
__global__ void gpt_to_bf16_kernel(const float *x, __nv_bfloat16 *y, int64_t count) {
    GPT_GRID_LOOP(i, count) y[i] = __float2bfloat16_rn(x[i]);
}

#define GPT_LAUNCH(kernel, count, ...)                                                                                 \
    do {                                                                                                               \
        if ((count) > 0) {                                                                                             \
            kernel<<<gpu_blocks(count), GPU_THREADS, 0, gg->e.stream>>>(__VA_ARGS__);                                  \
            GPU_LAUNCHED(kernel);                                                                                      \
        }                                                                                                              \
    } while (0)

/* ---------------------------------------------------------------- GEMMs */
static inline smp_status gpt__to_bf16(gpt_gpu *gg, const float *x, __nv_bfloat16 *y, int64_t n) {
    GPT_LAUNCH(gpt_to_bf16_kernel, n, x, y, n);
    return SMP_OK;
}

/* C (m x n, column-major, f32) = alpha op(A) op(B) + beta C with A and B
   rounded to bf16 (the copies are in scratch, laid out as A and B are). */
static inline smp_status gpt__gemm_bf16(gpt_gpu *gg, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                        const float *A, int64_t a_elems, int lda, const float *B, int64_t b_elems,
                                        int ldb, float beta, float *C, int ldc) {
    void *s;
    SMP_TRY(gpt__scratch(gg, sizeof(__nv_bfloat16) * (size_t)(a_elems + b_elems), &s));
    __nv_bfloat16 *a16 = (__nv_bfloat16 *)s, *b16 = a16 + a_elems;
    SMP_TRY(gpt__to_bf16(gg, A, a16, a_elems));
    SMP_TRY(gpt__to_bf16(gg, B, b16, b_elems));
    const float one = 1.0f;
    GPU_CUBLAS(cublasGemmEx,
               (gg->e.blas, ta, tb, m, n, k, &one, a16, CUDA_R_16BF, lda, b16, CUDA_R_16BF, ldb, &beta, C, CUDA_R_32F,
                ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return SMP_OK;
}

/* y (n x out) = x (n x in) W^T + b, as cuda_engine.h's gpu_linear_forward (f32) or with bf16 inputs. */
static inline smp_status gpt__linear_forward(gpt_gpu *gg, const float *x, const float *W, const float *b, float *y,
                                             int n, int in, int out) {
    if (!gg->bf16) return gpu_linear_forward(&gg->e, x, W, b, y, n, in, out);
    if (n <= 0 || out <= 0) return SMP_OK;
    SMP_TRY(gpt__gemm_bf16(gg, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, W, (int64_t)out * in, in, x, (int64_t)n * in, in,
                           0.0f, y, out));
    if (b) GPT_LAUNCH(add_bias_rows_kernel, (int64_t)n * out, y, b, n, out);
    return SMP_OK;
}

/* dx = dy W (overwritten), dW += dy^T x, db += column sums of dy (in
   chunks of rows: one thread per column, as cuda_engine.h's bias kernel,
   would walk thousands of rows each); NULL skips one. */
static inline smp_status gpt__linear_backward(gpt_gpu *gg, const float *x, const float *W, const float *dy, float *dx,
                                              float *dW, float *db, int n, int in, int out) {
    if (n <= 0 || in <= 0 || out <= 0) return SMP_OK;
    if (!gg->bf16)
        SMP_TRY(gpu_linear_backward(&gg->e, x, W, dy, dx, dW, NULL, n, in, out));
    else {
        if (dx)
            SMP_TRY(gpt__gemm_bf16(gg, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, W, (int64_t)out * in, in, dy,
                                   (int64_t)n * out, out, 0.0f, dx, in));
        if (dW)
            SMP_TRY(gpt__gemm_bf16(gg, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, x, (int64_t)n * in, in, dy,
                                   (int64_t)n * out, out, 1.0f, dW, in));
    }
    if (!db) return SMP_OK;
    int64_t chunks = gpt__chunks(n), count = chunks * out;
    void *s;
    SMP_TRY(gpt__scratch(gg, sizeof(float) * (size_t)count, &s));
    GPT_LAUNCH(gpt_bias_partial_kernel, count, dy, (float *)s, count, (int64_t)n, out);
    GPT_LAUNCH(gpt_add_partials_kernel, (int64_t)out, (const float *)s, db, chunks, out);
    return SMP_OK;
}

/* ---------------------------------------------------------------- attention */
/* One sequence, the heads batched (head h at column h*hd of q, k, v): S
   queries (rows ldq apart) at positions p0 .. p0 + S - 1 against the Tk
   keys and values k, v (rows ldkv apart) at positions 0 .. Tk - 1: y [S, C],
   P [H, S, Tk] the probabilities. Row-major matrices read column-major are
   transposed, so scores = scale Q K^T is scores^T = scale K Q^T, and so on. */
static inline smp_status gpt__attend(gpt_gpu *gg, const float *q, int ldq, const float *k, const float *v, int ldkv,
                                     float *y, float *P, int S, int Tk, int p0, int C, int H) {
    int hd = C / H;
    float scale = 1.0f / sqrtf((float)hd), one = 1.0f, zero = 0.0f;
    long long ST = (long long)S * Tk;
    GPU_CUBLAS(cublasSgemmStridedBatched,
               (gg->e.blas, CUBLAS_OP_T, CUBLAS_OP_N, Tk, S, hd, &scale, k, ldkv, hd, q, ldq, hd, &zero, P, Tk, ST, H));
    GPT_LAUNCH(gpt_softmax_kernel, (int64_t)H * S, P, (int64_t)H * S, S, Tk, p0);
    GPU_CUBLAS(cublasSgemmStridedBatched,
               (gg->e.blas, CUBLAS_OP_N, CUBLAS_OP_N, hd, S, Tk, &one, v, ldkv, hd, P, Tk, ST, &zero, y, C, hd, H));
    return SMP_OK;
}

/* Causal attention over whole sequences: qkv [B, T, 3C] -> y [B, T, C], P [B, H, T, T]. */
static inline smp_status gpt__attention_forward(gpt_gpu *gg, const float *qkv, float *y, float *P, int B, int T, int C,
                                                int H) {
    int C3 = 3 * C;
    for (int b = 0; b < B; b++) {
        const float *q = qkv + (size_t)b * T * C3;
        SMP_TRY(gpt__attend(gg, q, C3, q + C, q + 2 * C, C3, y + (size_t)b * T * C, P + (size_t)b * H * T * T, T, T, 0,
                            C, H));
    }
    return SMP_OK;
}

/* dqkv [B, T, 3C] (overwritten) from dy [B, T, C]. */
static inline smp_status gpt__attention_backward(gpt_gpu *gg, const float *qkv, const float *P, const float *dy,
                                                 float *dqkv, int B, int T, int C, int H) {
    int hd = C / H, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hd), one = 1.0f, zero = 0.0f;
    long long TT = (long long)T * T;
    void *s;
    SMP_TRY(gpt__scratch(gg, sizeof(float) * (size_t)H * TT, &s));
    float *dP = (float *)s;
    for (int b = 0; b < B; b++) {
        size_t off = (size_t)b * T * C3;
        const float *q = qkv + off, *k = q + C, *v = q + 2 * C, *p = P + (size_t)b * H * TT,
                    *dyb = dy + (size_t)b * T * C;
        float *dq = dqkv + off, *dk = dq + C, *dv = dq + 2 * C;
        /* dV = P^T dY; dP = dY V^T */
        GPU_CUBLAS(cublasSgemmStridedBatched,
                   (gg->e.blas, CUBLAS_OP_N, CUBLAS_OP_T, hd, T, T, &one, dyb, C, hd, p, T, TT, &zero, dv, C3, hd, H));
        GPU_CUBLAS(cublasSgemmStridedBatched,
                   (gg->e.blas, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hd, &one, v, C3, hd, dyb, C, hd, &zero, dP, T, TT, H));
        GPT_LAUNCH(gpt_softmax_backward_kernel, (int64_t)H * T, p, dP, (int64_t)H * T, T);
        /* dQ = scale dS K; dK = scale dS^T Q */
        GPU_CUBLAS(
            cublasSgemmStridedBatched,
            (gg->e.blas, CUBLAS_OP_N, CUBLAS_OP_N, hd, T, T, &scale, k, C3, hd, dP, T, TT, &zero, dq, C3, hd, H));
        GPU_CUBLAS(
            cublasSgemmStridedBatched,
            (gg->e.blas, CUBLAS_OP_N, CUBLAS_OP_T, hd, T, T, &scale, q, C3, hd, dP, T, TT, &zero, dk, C3, hd, H));
    }
    return SMP_OK;
}

/* ---------------------------------------------------------------- layers on device pointers */
/* What the leaves below run, callable without smp too (gpt.cu's --plain
   loop, the overhead benchmark's baseline). */
static inline smp_status gpt_gpu_embed(gpt_gpu *gg, const int32_t *ids, const float *W, float *y, int64_t n, int C) {
    GPT_LAUNCH(gpt_embed_kernel, n * C, ids, W, y, n * C, C);
    return SMP_OK;
}
static inline smp_status gpt_gpu_embed_grad(gpt_gpu *gg, const int32_t *ids, const float *dy, float *dW, int64_t n,
                                            int V, int C) {
    int64_t count = (int64_t)V * C;
    GPT_LAUNCH(gpt_embed_grad_kernel, count, ids, dy, dW, count, n, C);
    return SMP_OK;
}
/* y = x + wpe[p0 + t] over [B, T, C] (y may be x) */
static inline smp_status gpt_gpu_positions(gpt_gpu *gg, const float *x, const float *P, float *y, int B, int T, int C,
                                           int p0) {
    int64_t count = (int64_t)B * T * C;
    GPT_LAUNCH(gpt_add_positions_kernel, count, x, P, y, count, T, C, p0);
    return SMP_OK;
}
static inline smp_status gpt_gpu_positions_grad(gpt_gpu *gg, const float *dy, float *dP, int B, int T, int C) {
    GPT_LAUNCH(gpt_position_grad_kernel, (int64_t)T * C, dy, dP, B, T, C);
    return SMP_OK;
}
/* stats: mean [n] then rstd [n] */
static inline smp_status gpt_gpu_layernorm(gpt_gpu *gg, const float *x, const float *w, const float *b, float *y,
                                           float *stats, int n, int C) {
    GPT_LAUNCH(gpt_layernorm_kernel, (int64_t)n, x, w, b, y, stats, stats + n, (int64_t)n, C);
    return SMP_OK;
}
static inline smp_status gpt_gpu_layernorm_grad(gpt_gpu *gg, const float *x, const float *w, const float *stats,
                                                const float *dy, float *dx, float *dw, float *db, int n, int C) {
    if (dx) GPT_LAUNCH(gpt_layernorm_backward_kernel, (int64_t)n, x, w, stats, stats + n, dy, dx, (int64_t)n, C);
    int64_t chunks = gpt__chunks(n), count = chunks * C;
    void *s;
    SMP_TRY(gpt__scratch(gg, 2 * sizeof(float) * (size_t)count, &s));
    float *pw = (float *)s, *pb = pw + count;
    GPT_LAUNCH(gpt_layernorm_partial_kernel, count, x, stats, stats + n, dy, pw, pb, count, (int64_t)n, C);
    GPT_LAUNCH(gpt_add_partials_kernel, (int64_t)C, pw, dw, chunks, C);
    GPT_LAUNCH(gpt_add_partials_kernel, (int64_t)C, pb, db, chunks, C);
    return SMP_OK;
}
static inline smp_status gpt_gpu_add(gpt_gpu *gg, const float *a, const float *b, float *y, int64_t n) {
    GPT_LAUNCH(gpt_add_kernel, n, a, b, y, n);
    return SMP_OK;
}
static inline smp_status gpt_gpu_gelu(gpt_gpu *gg, const float *x, float *y, float *t, int64_t n) {
    GPT_LAUNCH(gpt_gelu_kernel, n, x, y, t, n);
    return SMP_OK;
}
static inline smp_status gpt_gpu_gelu_grad(gpt_gpu *gg, const float *x, const float *t, const float *dy, float *dx,
                                           int64_t n) {
    GPT_LAUNCH(gpt_gelu_backward_kernel, n, x, t, dy, dx, n);
    return SMP_OK;
}
/* The mean loss of n rows into gg->loss (device); dlogits (may be NULL) gets grad_scale * (softmax - onehot). */
static inline smp_status gpt_gpu_xent(gpt_gpu *gg, const float *logits, const int32_t *target, int64_t n, int V,
                                      float *dlogits, float grad_scale) {
    SMP_TRY(gpt__grow((void **)&gg->row_loss, &gg->row_cap, sizeof(float) * (size_t)(n ? n : 1), "the rows' losses"));
    GPT_LAUNCH(gpt_xent_kernel, n, logits, target, n, V, dlogits, grad_scale, gg->row_loss);
    gpt_mean_loss_kernel<<<1, 1, 0, gg->e.stream>>>(gg->row_loss, n, gg->loss);
    GPU_LAUNCHED(gpt_mean_loss_kernel);
    return SMP_OK;
}

/* ---------------------------------------------------------------- the leaves */
static inline const float *gpt__cdata(const smp_tensor *t) { return (const float *)t->data; }

/* Token ids where a kernel can read them: device ids as they are; host ids
   (a step given host arguments: generation) checked and uploaded into
   scratch after `after` bytes. */
static inline smp_status gpt__device_ids(gpt_gpu *gg, const smp_tensor *x, int V, size_t after, const int32_t **out) {
    if (x->device != SMP_HOST) {
        *out = (const int32_t *)x->data;
        return SMP_OK;
    }
    const int32_t *id = (const int32_t *)x->data;
    int64_t n = smp_tensor_numel(x);
    for (int64_t i = 0; i < n; i++)
        if (id[i] < 0 || id[i] >= V)
            return smp_error(SMP_ERR_ARG, "token id %d at position %lld is outside the vocabulary of %d", (int)id[i],
                             (long long)i, V);
    void *s;
    SMP_TRY(gpt__scratch(gg, after + sizeof(int32_t) * (size_t)n, &s));
    int32_t *d = (int32_t *)((char *)s + after);
    GPU_CUDA(cudaMemcpyAsync, (d, id, sizeof(int32_t) * (size_t)n, cudaMemcpyHostToDevice, gg->e.stream));
    *out = d;
    return SMP_OK;
}

static smp_status gpt_gpu_wte_forward(smp_call_ctx *c) {
    const gpt *g = gpt__of(c);
    gpt_gpu *gg = gpt__gpu(g);
    const smp_tensor *x = smp_call_input(c, 0);
    int V = g->cfg.vocab, C = g->cfg.n_embd;
    const float *W = gpt__cdata(smp_param_value(g->wte_w));
    int64_t shape[SMP_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    if (x->dtype == SMP_I32) {
        shape[x->ndim] = C;
        smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim + 1, shape);
        if (!y) return SMP_ERR_NOMEM;
        const int32_t *ids = NULL;
        SMP_TRY(gpt__device_ids(gg, x, V, 0, &ids));
        return gpt_gpu_embed(gg, ids, W, (float *)y->data, smp_tensor_numel(x), C);
    }
    if (x->dtype != SMP_F32 || x->shape[x->ndim - 1] != C)
        return smp_error(SMP_ERR_ARG, "transformer.wte takes i32 token ids or f32 hidden states of width %d", C);
    shape[x->ndim - 1] = V;
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, shape);
    if (!y) return SMP_ERR_NOMEM;
    return gpt__linear_forward(gg, gpt__cdata(x), W, NULL, (float *)y->data, gpt__rows(x, C), C, V);
}

static smp_status gpt_gpu_wte_backward(smp_call_ctx *c) {
    const gpt *g = gpt__of(c);
    gpt_gpu *gg = gpt__gpu(g);
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    int V = g->cfg.vocab, C = g->cfg.n_embd;
    float *dW = (float *)smp_param_grad(g->wte_w)->data;
    if (x->dtype == SMP_I32) {
        const int32_t *ids = NULL;
        SMP_TRY(gpt__device_ids(gg, x, V, 0, &ids));
        return gpt_gpu_embed_grad(gg, ids, gpt__cdata(dy), dW, smp_tensor_numel(x), V, C);
    }
    smp_tensor *dx = smp_call_grad_input(c, 0);
    return gpt__linear_backward(gg, gpt__cdata(x), gpt__cdata(smp_param_value(g->wte_w)), gpt__cdata(dy),
                                dx ? (float *)dx->data : NULL, dW, NULL, gpt__rows(x, C), C, V);
}

static smp_status gpt_gpu_wpe_forward(smp_call_ctx *c) {
    const gpt *g = gpt__of(c);
    gpt_gpu *gg = gpt__gpu(g);
    const smp_tensor *x = smp_call_input(c, 0);
    int C = g->cfg.n_embd;
    if (x->ndim != 3 || x->shape[2] != C)
        return smp_error(SMP_ERR_ARG, "transformer.wpe takes [batch, time, %d] embeddings", C);
    int T = (int)x->shape[1], p = 0, mb;
    if (g->kv) SMP_TRY(gpt_kv_at(c, g, x, &mb, &p)); /* cached mode: the new tokens start at position pos[mb] */
    if (p + T > g->cfg.block_size)
        return smp_error(SMP_ERR_ARG, "a context of %d tokens is longer than the model's %d", p + T, g->cfg.block_size);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 3, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    return gpt_gpu_positions(gg, gpt__cdata(x), gpt__cdata(smp_param_value(g->wpe_w)), (float *)y->data,
                             (int)x->shape[0], T, C, p);
}

static smp_status gpt_gpu_wpe_backward(smp_call_ctx *c) {
    const gpt *g = gpt__of(c);
    gpt_gpu *gg = gpt__gpu(g);
    const smp_tensor *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    int C = g->cfg.n_embd, B = (int)dy->shape[0], T = (int)dy->shape[1];
    SMP_TRY(gpt_gpu_positions_grad(gg, gpt__cdata(dy), (float *)smp_param_grad(g->wpe_w)->data, B, T, C));
    if (dx)
        GPU_CUDA(cudaMemcpyAsync, (dx->data, dy->data, smp_tensor_nbytes(dy), cudaMemcpyDeviceToDevice, gg->e.stream));
    return SMP_OK;
}

static smp_status gpt_gpu_linear_forward(smp_call_ctx *c) {
    const gpt_linear *l = (const gpt_linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    if (x->dtype != SMP_F32 || x->shape[x->ndim - 1] != l->in)
        return smp_error(SMP_ERR_ARG, "%s takes f32 inputs of width %d", smp_module_name(smp_call_module(c)), l->in);
    int64_t shape[SMP_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    shape[x->ndim - 1] = l->out;
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, shape);
    if (!y) return SMP_ERR_NOMEM;
    return gpt__linear_forward(gpt__gpu(l->g), gpt__cdata(x), gpt__cdata(smp_param_value(l->weight)),
                               gpt__cdata(smp_param_value(l->bias)), (float *)y->data, gpt__rows(x, l->in), l->in,
                               l->out);
}

/* The two halves of the backward, as the host's (zero-bubble schedules run
   the weight half in a bubble). */
static smp_status gpt_gpu_linear_backward_input(smp_call_ctx *c) {
    const gpt_linear *l = (const gpt_linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    if (!dx) return SMP_OK;
    return gpt__linear_backward(gpt__gpu(l->g), gpt__cdata(x), gpt__cdata(smp_param_value(l->weight)), gpt__cdata(dy),
                                (float *)dx->data, NULL, NULL, gpt__rows(x, l->in), l->in, l->out);
}

static smp_status gpt_gpu_linear_backward_weight(smp_call_ctx *c) {
    const gpt_linear *l = (const gpt_linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    return gpt__linear_backward(gpt__gpu(l->g), gpt__cdata(x), gpt__cdata(smp_param_value(l->weight)), gpt__cdata(dy),
                                NULL, (float *)smp_param_grad(l->weight)->data, (float *)smp_param_grad(l->bias)->data,
                                gpt__rows(x, l->in), l->in, l->out);
}

/* The device stash holds mean and rstd per row. */
static smp_status gpt_gpu_layernorm_forward(smp_call_ctx *c) {
    const gpt_norm *l = (const gpt_norm *)smp_module_user(smp_call_module(c));
    gpt_gpu *gg = gpt__gpu(l->g);
    const smp_tensor *x = smp_call_input(c, 0);
    if (x->dtype != SMP_F32 || x->shape[x->ndim - 1] != l->C)
        return smp_error(SMP_ERR_ARG, "%s takes f32 inputs of width %d", smp_module_name(smp_call_module(c)), l->C);
    int n = gpt__rows(x, l->C);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    float *stats = (float *)smp_call_stash_device(c, sizeof(float) * 2 * (size_t)n);
    if (!stats) return SMP_ERR_NOMEM;
    return gpt_gpu_layernorm(gg, gpt__cdata(x), gpt__cdata(smp_param_value(l->weight)),
                             gpt__cdata(smp_param_value(l->bias)), (float *)y->data, stats, n, l->C);
}

static smp_status gpt_gpu_layernorm_backward(smp_call_ctx *c) {
    const gpt_norm *l = (const gpt_norm *)smp_module_user(smp_call_module(c));
    gpt_gpu *gg = gpt__gpu(l->g);
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    int n = gpt__rows(x, l->C);
    return gpt_gpu_layernorm_grad(gg, gpt__cdata(x), gpt__cdata(smp_param_value(l->weight)),
                                  (const float *)smp_call_stashed_device(c, NULL), gpt__cdata(dy),
                                  dx ? (float *)dx->data : NULL, (float *)smp_param_grad(l->weight)->data,
                                  (float *)smp_param_grad(l->bias)->data, n, l->C);
}

/* The device stash holds tanh of every element (scratch in evaluation). */
static smp_status gpt_gpu_gelu_forward(smp_call_ctx *c) {
    gpt_gpu *gg = gpt__gpu(gpt__of(c));
    const smp_tensor *x = smp_call_input(c, 0);
    int64_t n = smp_tensor_numel(x);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    void *t = NULL;
    if (smp_call_is_training(c)) {
        if (!(t = smp_call_stash_device(c, sizeof(float) * (size_t)n))) return SMP_ERR_NOMEM;
    } else
        SMP_TRY(gpt__scratch(gg, sizeof(float) * (size_t)n, &t));
    return gpt_gpu_gelu(gg, gpt__cdata(x), (float *)y->data, (float *)t, n);
}

static smp_status gpt_gpu_gelu_backward(smp_call_ctx *c) {
    gpt_gpu *gg = gpt__gpu(gpt__of(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    int64_t n = smp_tensor_numel(x);
    return dx ? gpt_gpu_gelu_grad(gg, gpt__cdata(x), (const float *)smp_call_stashed_device(c, NULL), gpt__cdata(dy),
                                  (float *)dx->data, n)
              : SMP_OK;
}

/* Cached mode (generation): qkv [1, S, 3C] of S new tokens at positions p ..
   p + S - 1; their keys and values join the cache of (this block, this
   microbatch), and each attends over the cache up to its own position. */
static smp_status gpt__sdpa_cached_gpu(smp_call_ctx *c, const gpt_block *blk, const smp_tensor *x) {
    const gpt *g = blk->g;
    gpt_gpu *gg = gpt__gpu(g);
    int C = g->cfg.n_embd, H = g->cfg.n_head, S = (int)x->shape[1], mb, p;
    SMP_TRY(gpt_kv_at(c, g, x, &mb, &p));
    size_t slots = (size_t)g->kv->M * (size_t)g->kv->L, slot = (size_t)blk->index * (size_t)g->kv->M + (size_t)mb,
           bytes = sizeof(float) * (size_t)g->cfg.block_size * (size_t)C;
    if (gg->kv_slots != slots) { /* a new gpt_kv_start's shape */
        gpt__kv_release(gg);
        gg->kv_k = (float **)calloc(slots, sizeof *gg->kv_k);
        gg->kv_v = (float **)calloc(slots, sizeof *gg->kv_v);
        if (!gg->kv_k || !gg->kv_v) {
            gpt__kv_release(gg);
            return smp_error(SMP_ERR_NOMEM, "out of memory for the KV cache's table");
        }
        gg->kv_slots = slots;
    }
    float **K = &gg->kv_k[slot], **V = &gg->kv_v[slot];
    if (!*K) *K = (float *)smp_nccl_alloc(bytes);
    if (!*V) *V = (float *)smp_nccl_alloc(bytes);
    if (!*K || !*V)
        return smp_error(SMP_ERR_NOMEM, "%s: out of device memory for the KV cache (%zu bytes): %s",
                         smp_module_name(smp_call_module(c)), 2 * bytes, smp_last_error());
    const int64_t shape[3] = {1, S, C};
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 3, shape);
    if (!y) return SMP_ERR_NOMEM;
    void *P = NULL;
    SMP_TRY(gpt__scratch(gg, sizeof(float) * (size_t)H * S * (p + S), &P));
    const float *qkv = gpt__cdata(x);
    GPT_LAUNCH(gpt_kv_append_kernel, (int64_t)S * C, qkv, *K + (size_t)p * C, *V + (size_t)p * C, (int64_t)S * C, C);
    return gpt__attend(gg, qkv, 3 * C, *K, *V, C, (float *)y->data, (float *)P, S, p + S, p, C, H);
}

/* The device stash holds the probabilities [B, H, T, T] (scratch in evaluation). */
static smp_status gpt_gpu_sdpa_forward(smp_call_ctx *c) {
    const gpt *g = ((const gpt_block *)smp_module_user(smp_call_module(c)))->g;
    gpt_gpu *gg = gpt__gpu(g);
    const smp_tensor *x = smp_call_input(c, 0);
    int C = g->cfg.n_embd, H = g->cfg.n_head;
    if (x->ndim != 3 || x->shape[2] != 3 * C)
        return smp_error(SMP_ERR_ARG, "attention takes qkv of shape [batch, time, %d]", 3 * C);
    if (g->kv) return gpt__sdpa_cached_gpu(c, (const gpt_block *)smp_module_user(smp_call_module(c)), x);
    int B = (int)x->shape[0], T = (int)x->shape[1];
    const int64_t shape[3] = {B, T, C};
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 3, shape);
    if (!y) return SMP_ERR_NOMEM;
    size_t pbytes = sizeof(float) * (size_t)B * H * T * T;
    void *P = NULL;
    if (smp_call_is_training(c)) {
        if (!(P = smp_call_stash_device(c, pbytes))) return SMP_ERR_NOMEM;
    } else
        SMP_TRY(gpt__scratch(gg, pbytes, &P));
    return gpt__attention_forward(gg, gpt__cdata(x), (float *)y->data, (float *)P, B, T, C, H);
}

static smp_status gpt_gpu_sdpa_backward(smp_call_ctx *c) {
    const gpt *g = ((const gpt_block *)smp_module_user(smp_call_module(c)))->g;
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    if (!dx) return SMP_OK;
    return gpt__attention_backward(gpt__gpu(g), gpt__cdata(x), (const float *)smp_call_stashed_device(c, NULL),
                                   gpt__cdata(dy), (float *)dx->data, (int)x->shape[0], (int)x->shape[1], g->cfg.n_embd,
                                   g->cfg.n_head);
}

static const gpt_leaves gpt_gpu_leaves = {gpt_gpu_wte_forward,
                                          gpt_gpu_wte_backward,
                                          gpt_gpu_wpe_forward,
                                          gpt_gpu_wpe_backward,
                                          gpt_gpu_linear_forward,
                                          gpt_gpu_linear_backward_input,
                                          gpt_gpu_linear_backward_weight,
                                          gpt_gpu_layernorm_forward,
                                          gpt_gpu_layernorm_backward,
                                          gpt_gpu_gelu_forward,
                                          gpt_gpu_gelu_backward,
                                          gpt_gpu_sdpa_forward,
                                          gpt_gpu_sdpa_backward,
                                          NULL,
                                          NULL,
                                          true};

/* The device model: gpt_model.h's tree with the leaves above on gg. */
static inline smp_status gpt_gpu_build(gpt *g, const gpt_config *cfg, bool recompute, gpt_gpu *gg, smp_model **model) {
    if (cfg->dropout > 0)
        return smp_error(SMP_ERR_ARG,
                         "--dropout: gpt.cu has no dropout on the device; run without it (or the host program, gpt.c)");
    return gpt_build_with(g, cfg, recompute, &gpt_gpu_leaves, gg, model);
}

/* ---------------------------------------------------------------- the loss */
/* gpt_loss_body on the device: arguments 0 ids, 1 targets (i32, device,
   checked before they were uploaded); the step's user is the gpt_gpu. */
SMP_STEP_BODY(gpt_gpu_loss_body) {
    gpt_gpu *gg = (gpt_gpu *)smp_mb_user(mb);
    const smp_tensor *logits = smp_mb_output(mb, 0), *target = smp_mb_arg(mb, 1);
    smp_tensor *dlogits = smp_mb_output_grad(mb, 0);
    int V = (int)logits->shape[logits->ndim - 1];
    int64_t n = smp_tensor_numel(target);
    if (target->device == SMP_HOST)
        return smp_error(SMP_ERR_ARG, "gpt_gpu_loss_body: the targets must be on the device");
    SMP_TRY(gpt_gpu_xent(gg, gpt__cdata(logits), (const int32_t *)target->data, n, V,
                         dlogits ? (float *)dlogits->data : NULL, 1.0f / (float)n));
    smp_tensor lt = smp_tensor_1d(gg->loss, SMP_F64, 1);
    lt.device = logits->device;
    return smp_mb_return(mb, 0, &lt); /* smp copies it to the host (a wait for this microbatch's work) */
}

#endif
