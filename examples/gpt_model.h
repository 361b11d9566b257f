/* gpt_model.h - a GPT-2-shaped decoder-only transformer as smp modules, in
   plain C with OpenBLAS sgemm, f32, host memory. Shared by the training
   example (gpt.c) and its pipelined generation (gpt.c --generate).

   THE MODEL (nanoGPT's layout and parameter names, so a full checkpoint
   loads into nanoGPT's GPT with strict names)

     transformer.wte    token embedding, a LEAF called twice: on the i32
                        token ids it returns their rows (the embedding), on
                        f32 hidden states it returns h W^T (the output
                        projection, nanoGPT's lm_head). One module, one
                        weight: smp holds a copy on each partition that
                        calls it and sums the two calls' gradients.
     transformer.wpe    position embedding: x + wpe[t] (+ dropout)
     transformer.h.<i>  a COMPOSITE block, pre-norm:
                          ln_1 -> attn -> add_1(x, .) -> ln_2 -> mlp -> add_2(r, .)
                        attn is a composite: c_attn (linear C -> 3C),
                        sdpa (causal multi-head softmax attention, no
                        parameters), c_proj (linear C -> C) [, resid_dropout];
                        mlp is a composite: c_fc (linear C -> 4C), gelu
                        (tanh approximation), c_proj (linear 4C -> C)
                        [, dropout]; add_1 and add_2 are smp's built-in add.
     transformer.ln_f   final layernorm

   Parameters (nn.Linear layout: weight [out_features, in_features]):
     transformer.wte.weight [V, C]      transformer.wpe.weight [T, C]
     transformer.h.<i>.ln_1.weight/.bias [C]
     transformer.h.<i>.attn.c_attn.weight [3C, C], .bias [3C]
     transformer.h.<i>.attn.c_proj.weight [C, C], .bias [C]
     transformer.h.<i>.ln_2.weight/.bias [C]
     transformer.h.<i>.mlp.c_fc.weight [4C, C], .bias [4C]
     transformer.h.<i>.mlp.c_proj.weight [C, 4C], .bias [C]
     transformer.ln_f.weight/.bias [C]
   nanoGPT's lm_head.weight is transformer.wte.weight (stored once).
   Initialisation as GPT-2: weights N(0, 0.02), c_proj weights N(0,
   0.02 / sqrt(2 n_layer)), biases 0, layernorms 1 and 0; each parameter
   from its own seed (smp_param_seed: global seed + full name), so every
   partitioning starts from the same bits.

   Every leaf has a forward and a backward; backwards ADD parameter
   gradients (microbatches arrive in increasing order) and write input
   gradients in full (the host leaves tell smp so, which then does not zero
   them first: smp_module_set_overwrites_grad_inputs). Dropout (default 0) draws its mask from
   smp_call_seed(c) and regenerates it in the backward, so recomputation
   and any partitioning see the same mask; attention-probability dropout
   is not implemented.

   The step body: gpt_loss_body computes the mean cross-entropy over every
   token of the microbatch (step arguments: 0 token ids i32 [B, T],
   1 targets i32 [B, T]) and returns it as a StepOutput (f64).

   GENERATION WITH A KV CACHE: gpt_kv_start(g, M) puts the model in
   "cached" mode (see gpt_kv below): a step's input is then only each
   microbatch's new tokens, from position kv->pos[mb]; transformer.wpe
   offsets its positions and each block's sdpa keeps the keys and values of
   (block, smp_call_microbatch) in its cache and attends over it, so a
   token costs one position, not the whole context. Only evaluation steps
   run in cached mode; training never sets it and runs exactly the code
   above. A device engine keeps its caches in device memory of its own
   (gpt_cuda.h); gpt_kv holds the positions for both.

   TENSOR PARALLELISM (tensor_parallel_degree tp > 1, host model only):
   Megatron's layout. c_attn is column-parallel by heads ([3C, C] and
   [3C] as at tp 1, sharded in 3 blocks, smp_param_new_sharded_blocks:
   each rank the same heads of q, k and v, one after the other), sdpa runs
   this rank's H/tp heads,
   attn.c_proj and mlp.c_proj are row-parallel (weight sharded along the
   inputs, the bias whole and added by c_proj_bias after c_proj_tp_out, a
   tp_reduce), c_fc is column-parallel; c_attn and c_fc follow a tp_copy
   (c_proj_tp_in). wte is vocabulary-parallel: the lookup writes this
   rank's rows (zeros elsewhere) and wte_tp_out sums them; the tied head
   (after lm_head_tp_in, a tp_copy) gives this rank's V/tp logits, and
   gpt_loss_body's cross-entropy combines the row maxima and sums across
   the TP group (gpt_xent_tp). Parameter names and the full tensors' values
   are those of tp 1.

   HOST AND DEVICE: gpt_build_with takes the leaves' callbacks (gpt_leaves)
   and an engine; gpt_build gives it this file's host leaves (OpenBLAS).
   gpt_cuda.h gives it device leaves (gpt.cu), whose kernels call the
   GPT_HD row functions here, so the arithmetic has one copy. Included with
   MLP_ENGINE_NO_BLAS defined (cuda_engine.h does), only the structure, the
   row functions and gpt_xent remain.

   Include after smp.h and smp_pipeline.h; link with -lopenblas -lm. */
#ifndef GPT_MODEL_H
#define GPT_MODEL_H
#include "mlp_engine.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The row and element functions below run on the host (gpt.c), on the GPU
   (gpt_cuda.h's kernels call them per row or element) and in the fake
   device's kernel twins: one copy of the arithmetic for all three. */
#ifdef __CUDACC__
#define GPT_HD __host__ __device__
#else
#define GPT_HD
#endif

typedef struct gpt_config {
    int vocab;      /* V */
    int n_layer;
    int n_embd;     /* C */
    int n_head;
    int block_size; /* T: the longest context */
    float dropout;  /* 0: none */
} gpt_config;

/* ---------------------------------------------------------------- small kernels */
/* A uniform float in [0, 1) from (seed, index) alone: the dropout mask. */
static inline float gpt__hash_uniform(uint64_t seed, uint64_t i) {
    uint64_t z = mlp_mix64(seed ^ mlp_mix64(i + 1));
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

/* y = x * mask / (1 - p) with mask drawn from seed; dropout's forward and
   (on gradients) its backward. */
static inline void gpt__dropout(const float *x, float *y, size_t n, float p, uint64_t seed) {
    float scale = 1.0f / (1.0f - p);
    for (size_t i = 0; i < n; i++) y[i] = gpt__hash_uniform(seed, i) < p ? 0.0f : x[i] * scale;
}

/* Layernorm over rows of C: y = (x - mean) * rstd * w + b; mean and rstd
   per row saved for the backward. Sums in float, left to right. */
GPT_HD static inline void gpt__layernorm_forward(const float *x, const float *w, const float *b, float *y, float *mean,
                                          float *rstd, int n, int C) {
    const float eps = 1e-5f;
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * C;
        float *yr = y + (size_t)r * C;
        float m = 0;
        for (int i = 0; i < C; i++) m += xr[i];
        m /= (float)C;
        float v = 0;
        for (int i = 0; i < C; i++) { float d = xr[i] - m; v += d * d; }
        v /= (float)C;
        float s = 1.0f / sqrtf(v + eps);
        for (int i = 0; i < C; i++) yr[i] = (xr[i] - m) * s * w[i] + b[i];
        mean[r] = m;
        rstd[r] = s;
    }
}

/* One row's dx (overwritten) from dy and the forward's mean and rstd. */
GPT_HD static inline void gpt__layernorm_backward_row(const float *xr, const float *w, float m, float s,
                                                      const float *dyr, float *dxr, int C) {
    float a = 0, bsum = 0; /* mean of dy*w and of dy*w*xhat */
    for (int i = 0; i < C; i++) {
        float xh = (xr[i] - m) * s, g = dyr[i] * w[i];
        a += g;
        bsum += g * xh;
    }
    a /= (float)C;
    bsum /= (float)C;
    for (int i = 0; i < C; i++) {
        float xh = (xr[i] - m) * s;
        dxr[i] = (dyr[i] * w[i] - a - xh * bsum) * s;
    }
}

/* Column i of dw and db (accumulated), rows in order. */
GPT_HD static inline void gpt__layernorm_param_grads(const float *x, const float *mean, const float *rstd,
                                                     const float *dy, float *dw, float *db, int n, int C, int i) {
    for (int r = 0; r < n; r++) {
        float xh = (x[(size_t)r * C + i] - mean[r]) * rstd[r], d = dy[(size_t)r * C + i];
        dw[i] += d * xh;
        db[i] += d;
    }
}

/* dx (overwritten; NULL: not wanted), dw and db (accumulated, rows in order). */
static inline void gpt__layernorm_backward(const float *x, const float *w, const float *mean, const float *rstd,
                                           const float *dy, float *dx, float *dw, float *db, int n, int C) {
    for (int r = 0; dx && r < n; r++)
        gpt__layernorm_backward_row(x + (size_t)r * C, w, mean[r], rstd[r], dy + (size_t)r * C, dx + (size_t)r * C, C);
    for (int i = 0; i < C; i++) gpt__layernorm_param_grads(x, mean, rstd, dy, dw, db, n, C, i);
}

#define GPT__GELU_K 0.7978845608028654f /* sqrt(2 / pi) */
/* GELU, tanh approximation (nn.GELU(approximate='tanh')); t gets the tanh
   for the backward. */
GPT_HD static inline void gpt__gelu_forward(const float *x, float *y, float *t, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v = x[i], u = GPT__GELU_K * (v + 0.044715f * v * v * v);
        float th = 1.0f - 2.0f / (expf(2.0f * u) + 1.0f); /* tanh(u), a few times faster than tanhf */
        t[i] = th;
        y[i] = 0.5f * v * (1.0f + th);
    }
}

GPT_HD static inline void gpt__gelu_backward(const float *x, const float *t, const float *dy, float *dx, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v = x[i], th = t[i];
        float d = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * GPT__GELU_K * (1.0f + 3.0f * 0.044715f * v * v);
        dx[i] = dy[i] * d;
    }
}

/* Row i of the causal softmax over T scores, in place: positions past i
   get 0. */
GPT_HD static inline void gpt__causal_softmax_row(float *row, int i, int T) {
    float mx = row[0];
    for (int j = 1; j <= i; j++) mx = row[j] > mx ? row[j] : mx;
    float sum = 0;
    for (int j = 0; j <= i; j++) { row[j] = expf(row[j] - mx); sum += row[j]; }
    float inv = 1.0f / sum;
    for (int j = 0; j <= i; j++) row[j] *= inv;
    for (int j = i + 1; j < T; j++) row[j] = 0.0f;
}

/* Its backward on row i: dr = pr * (dr - sum_j pr dr), zero past i. */
GPT_HD static inline void gpt__causal_softmax_backward_row(const float *pr, float *dr, int i, int T) {
    float dot = 0;
    for (int j = 0; j <= i; j++) dot += pr[j] * dr[j];
    for (int j = 0; j <= i; j++) dr[j] = pr[j] * (dr[j] - dot);
    for (int j = i + 1; j < T; j++) dr[j] = 0.0f;
}

/* One row of V logits: returns -log softmax(z)[target] (lse - z[target],
   in float); d (may be NULL) gets grad_scale * (softmax - onehot). */
GPT_HD static inline float gpt__xent_row(const float *z, int target, int V, float *d, float grad_scale) {
    float mx = z[0];
    for (int j = 1; j < V; j++) mx = z[j] > mx ? z[j] : mx;
    float s = 0;
    for (int j = 0; j < V; j++) s += expf(z[j] - mx);
    float lse = mx + logf(s);
    if (d) {
        float inv = 1.0f / s;
        for (int j = 0; j < V; j++) d[j] = expf(z[j] - mx) * inv * grad_scale;
        d[target] -= grad_scale;
    }
    return lse - z[target];
}

#ifndef MLP_ENGINE_NO_BLAS /* the host model's kernels and leaves (gpt.c); a device engine brings its own */
/* Causal multi-head attention on qkv [B, T, 3C] (q, k, v side by side, head
   h at columns h*hd of each): y [B, T, C]; P [B, H, T, T] gets the
   attention probabilities (zero above the diagonal). */
static inline void gpt__attention_forward(const float *qkv, float *y, float *P, int B, int T, int C, int H) {
    int hd = C / H, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hd);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const float *q = qkv + (size_t)b * T * C3 + (size_t)h * hd, *k = q + C, *v = q + 2 * C;
            float *p = P + ((size_t)b * H + h) * T * T, *yh = y + (size_t)b * T * C + (size_t)h * hd;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, scale, q, C3, k, C3, 0.0f, p, T);
            for (int i = 0; i < T; i++) gpt__causal_softmax_row(p + (size_t)i * T, i, T);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, v, C3, 0.0f, yh, C);
        }
}

/* dqkv [B, T, 3C] (overwritten) from dy [B, T, C]; dP is T x T scratch. */
static inline void gpt__attention_backward(const float *qkv, const float *P, const float *dy, float *dqkv, float *dP,
                                           int B, int T, int C, int H) {
    int hd = C / H, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hd);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            size_t off = (size_t)b * T * C3 + (size_t)h * hd;
            const float *q = qkv + off, *k = q + C, *v = q + 2 * C;
            float *dq = dqkv + off, *dk = dq + C, *dv = dq + 2 * C;
            const float *p = P + ((size_t)b * H + h) * T * T, *dyh = dy + (size_t)b * T * C + (size_t)h * hd;
            /* dV = P^T dY; dP = dY V^T */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, dyh, C, 0.0f, dv, C3);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, 1.0f, dyh, C, v, C3, 0.0f, dP, T);
            /* softmax backward: dS = P * (dP - sum_j P dP), zero above the diagonal */
            for (int i = 0; i < T; i++) gpt__causal_softmax_backward_row(p + (size_t)i * T, dP + (size_t)i * T, i, T);
            /* dQ = scale dS K; dK = scale dS^T Q */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, scale, dP, T, k, C3, 0.0f, dq, C3);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, scale, dP, T, q, C3, 0.0f, dk, C3);
        }
}

#endif /* MLP_ENGINE_NO_BLAS */

/* ---------------------------------------------------------------- the modules */
struct gpt;
/* split (tensor parallelism, gpt.tp > 1): GPT_SPLIT_COLUMN holds out / tp of the outputs (weight and bias sharded
   along the outputs); GPT_SPLIT_ROW holds in / tp of the inputs, and its forward leaves the bias out: a partial sum,
   which the block reduces over TP_GROUP before it adds the (whole) bias. in and out are this rank's. */
enum { GPT_SPLIT_NONE, GPT_SPLIT_COLUMN, GPT_SPLIT_ROW };
typedef struct gpt_linear { smp_param *weight, *bias; int in, out; const struct gpt *g; int split; } gpt_linear;
typedef struct gpt_norm { smp_param *weight, *bias; int C; const struct gpt *g; } gpt_norm;

typedef struct gpt_block {
    const struct gpt *g; /* the model, and this block's index in it (the KV cache's key) */
    int index;
    smp_module *mod, *ln_1, *attn, *c_attn, *sdpa, *attn_proj, *attn_drop, *add_1;
    smp_module *ln_2, *mlp, *c_fc, *gelu, *mlp_proj, *mlp_drop, *add_2;
    /* tp > 1: into and out of each tensor-parallel region, and the row-parallel c_proj's bias after the reduce */
    smp_module *attn_copy, *attn_reduce, *attn_bias, *mlp_copy, *mlp_reduce, *mlp_bias;
    gpt_norm n1, n2;
    gpt_linear l_attn, l_aproj, l_fc, l_mproj;
} gpt_block;

/* The KV cache of generation ("cached" mode): while gpt.kv is set, a step
   input holds only the new tokens of each microbatch (one sequence per
   microbatch), starting at position pos[mb]; transformer.wpe adds the
   position embeddings from there, and each block's attention appends the
   new keys and values to its cache for (block, microbatch) at positions
   pos[mb].. and attends over the cache up to each new token. Keys at
   positions >= pos[mb] are overwritten, so a step may restart a sequence
   from an earlier position (a prompt padded on the right continues from
   its real end). Caches are allocated on first use: only for the blocks
   this rank holds, and at tp > 1 only for this rank's heads ([block_size,
   C / tp] each: the cache is split by heads, as the attention is). Training
   never sets kv. */
typedef struct gpt_kv {
    int M, L;   /* microbatches, blocks */
    int *pos;   /* [M]: the position of each microbatch's first new token; set by the caller before each step */
    float **k, **v; /* the host leaves' caches, [n_layer * M]: [block_size, C / tp] each (this rank's heads), or NULL */
} gpt_kv;

/* The leaves' callbacks: the host's below (gpt_build), a device engine's
   (gpt_cuda.h) otherwise; the module tree, names, parameters and the
   composites' forwards are the same. Module users: wte, wpe, dropout and
   gelu get the gpt, linears their gpt_linear, layernorms their gpt_norm,
   sdpa its gpt_block; each leads back to the gpt and its engine. */
typedef struct gpt_leaves {
    smp_module_fn wte_forward, wte_backward, wpe_forward, wpe_backward;
    smp_module_fn linear_forward, linear_backward_input, linear_backward_weight;
    smp_module_fn layernorm_forward, layernorm_backward, gelu_forward, gelu_backward;
    smp_module_fn sdpa_forward, sdpa_backward, dropout_forward, dropout_backward;
    bool on_device; /* the model's tensors live on the device (smp_model_desc.on_device) */
} gpt_leaves;

typedef struct gpt {
    gpt_config cfg;
    const gpt_leaves *leaves;
    void *engine; /* the device engine the leaves run on (NULL on the host) */
    gpt_kv *kv; /* NULL: the ordinary forward over whole sequences (training, evaluation) */
    smp_module *root, *transformer, *wte, *wpe, *h, *ln_f, *drop;
    int tp;                            /* tensor_parallel_degree: wte, heads and MLP width split tp ways */
    smp_module *wte_reduce, *head_copy; /* tp > 1: the lookup's partial rows summed; the tied head's input gradient */
    smp_param *wte_w, *wpe_w;
    gpt_norm nf;
    gpt_block *blocks; /* [n_layer] */
} gpt;

static const gpt *gpt__of(smp_call_ctx *c) { return (const gpt *)smp_module_user(smp_call_module(c)); }

/* rows of the last dimension d in a tensor */
static int gpt__rows(const smp_tensor *t, int d) { return (int)(smp_tensor_numel(t) / d); }

/* Cached mode: the microbatch of call c and the position of its first new
   token (kv->pos), checked: x [1, S, ...] holds one sequence of S new
   tokens, and they end within the model's context. The host's leaves and a
   device engine's (gpt_cuda.h) both ask it. */
static smp_status gpt_kv_at(smp_call_ctx *c, const gpt *g, const smp_tensor *x, int *mb, int *first) {
    const char *name = smp_module_name(smp_call_module(c));
    int S = (int)x->shape[1];
    *mb = smp_call_microbatch(c);
    if (x->shape[0] != 1)
        return smp_error(SMP_ERR_ARG, "%s: cached mode takes one sequence per microbatch, not %d", name,
                         (int)x->shape[0]);
    if (*mb < 0 || *mb >= g->kv->M)
        return smp_error(SMP_ERR_ARG, "%s: microbatch %d has no KV cache (of %d)", name, *mb, g->kv->M);
    *first = g->kv->pos[*mb];
    if (*first < 0 || *first + S > g->cfg.block_size)
        return smp_error(SMP_ERR_ARG, "a context of %d tokens is longer than the model's %d", *first + S,
                         g->cfg.block_size);
    return SMP_OK;
}

#ifndef MLP_ENGINE_NO_BLAS

/* transformer.wte: i32 ids [B, T] -> f32 [B, T, C]; f32 h [B, T, C] -> logits [B, T, V]. */
static smp_status gpt_wte_forward(smp_call_ctx *c) {
    const gpt *g = gpt__of(c);
    const smp_tensor *x = smp_call_input(c, 0);
    int V = g->cfg.vocab, C = g->cfg.n_embd;
    const float *W = (const float *)smp_param_value(g->wte_w)->data;
    /* vocabulary-parallel: this rank holds rows [first, first + Vl) (all of them at tp 1) */
    int Vl = (int)smp_param_value(g->wte_w)->shape[0], first = (int)smp_param_shard_offset(g->wte_w);
    if (x->dtype == SMP_I32) {
        int64_t shape[SMP_MAX_DIMS];
        memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
        shape[x->ndim] = C;
        smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim + 1, shape);
        if (!y) return SMP_ERR_NOMEM; /* smp names the bytes; the step can be retried */
        const int32_t *id = (const int32_t *)x->data;
        int64_t n = smp_tensor_numel(x);
        for (int64_t i = 0; i < n; i++) {
            if (id[i] < 0 || id[i] >= V)
                return smp_error(SMP_ERR_ARG, "token id %d at position %lld is outside the vocabulary of %d",
                                 (int)id[i], (long long)i, V);
            float *row = (float *)y->data + i * C;
            if (id[i] >= first && id[i] < first + Vl)
                memcpy(row, W + (size_t)(id[i] - first) * C, sizeof(float) * (size_t)C);
            else memset(row, 0, sizeof(float) * (size_t)C); /* another rank's row: the tp_reduce after adds it */
        }
        return SMP_OK;
    }
    if (x->dtype != SMP_F32 || x->shape[x->ndim - 1] != C)
        return smp_error(SMP_ERR_ARG, "transformer.wte takes i32 token ids or f32 hidden states of width %d", C);
    int64_t shape[SMP_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    shape[x->ndim - 1] = Vl; /* this rank's part of the logits */
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, shape);
    if (!y) return SMP_ERR_NOMEM;
    mlp_linear_forward((const float *)x->data, W, NULL, (float *)y->data, gpt__rows(x, C), C, Vl);
    return SMP_OK;
}

static smp_status gpt_wte_backward(smp_call_ctx *c) {
    const gpt *g = gpt__of(c);
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    int C = g->cfg.n_embd;
    int Vl = (int)smp_param_value(g->wte_w)->shape[0], first = (int)smp_param_shard_offset(g->wte_w);
    float *dW = (float *)smp_param_grad(g->wte_w)->data;
    if (x->dtype == SMP_I32) { /* rows of the ids, in order; this rank's rows only */
        const int32_t *id = (const int32_t *)x->data;
        const float *d = (const float *)dy->data;
        int64_t n = smp_tensor_numel(x);
        for (int64_t i = 0; i < n; i++) {
            if (id[i] < first || id[i] >= first + Vl) continue;
            float *row = dW + (size_t)(id[i] - first) * C;
            for (int j = 0; j < C; j++) row[j] += d[i * C + j];
        }
        return SMP_OK;
    }
    smp_tensor *dx = smp_call_grad_input(c, 0);
    mlp_linear_backward((const float *)x->data, (const float *)smp_param_value(g->wte_w)->data, (const float *)dy->data,
                        dx ? (float *)dx->data : NULL, dW, NULL, gpt__rows(x, C), C, Vl);
    return SMP_OK;
}

/* transformer.wpe: x [B, T, C] -> x + wpe[t] (then embedding dropout). */
static smp_status gpt_wpe_forward(smp_call_ctx *c) {
    const gpt *g = gpt__of(c);
    const smp_tensor *x = smp_call_input(c, 0);
    int C = g->cfg.n_embd;
    if (x->ndim != 3 || x->shape[2] != C)
        return smp_error(SMP_ERR_ARG, "transformer.wpe takes [batch, time, %d] embeddings", C);
    int B = (int)x->shape[0], T = (int)x->shape[1], p = 0, mb;
    if (g->kv) SMP_TRY(gpt_kv_at(c, g, x, &mb, &p)); /* cached mode: the new tokens start at position pos[mb] */
    if (p + T > g->cfg.block_size)
        return smp_error(SMP_ERR_ARG, "a context of %d tokens is longer than the model's %d", p + T, g->cfg.block_size);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 3, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    const float *P = (const float *)smp_param_value(g->wpe_w)->data, *xs = (const float *)x->data;
    float *ys = (float *)y->data;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < C; j++) {
                size_t i = ((size_t)b * T + t) * C + j;
                ys[i] = xs[i] + P[(size_t)(p + t) * C + j];
            }
    if (g->cfg.dropout > 0 && smp_call_is_training(c))
        gpt__dropout(ys, ys, (size_t)smp_tensor_numel(y), g->cfg.dropout, smp_call_seed(c));
    return SMP_OK;
}

static smp_status gpt_wpe_backward(smp_call_ctx *c) {
    const gpt *g = gpt__of(c);
    const smp_tensor *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    int C = g->cfg.n_embd, B = (int)dy->shape[0], T = (int)dy->shape[1];
    size_t n = (size_t)smp_tensor_numel(dy);
    const float *d = (const float *)dy->data;
    float *tmp = NULL;
    if (g->cfg.dropout > 0) { /* the same mask again, from the same seed */
        tmp = (float *)malloc(n * sizeof(float));
        if (!tmp) return smp_error(SMP_ERR_NOMEM, "transformer.wpe: out of memory");
        gpt__dropout(d, tmp, n, g->cfg.dropout, smp_call_seed(c));
        d = tmp;
    }
    float *dP = (float *)smp_param_grad(g->wpe_w)->data;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < C; j++) dP[(size_t)t * C + j] += d[((size_t)b * T + t) * C + j];
    if (dx) memcpy(dx->data, d, n * sizeof(float));
    free(tmp);
    return SMP_OK;
}

/* nn.Linear on the last dimension. */
static smp_status gpt_linear_forward(smp_call_ctx *c) {
    const gpt_linear *l = (const gpt_linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    if (x->dtype != SMP_F32 || x->shape[x->ndim - 1] != l->in)
        return smp_error(SMP_ERR_ARG, "%s takes f32 inputs of width %d", smp_module_name(smp_call_module(c)), l->in);
    int64_t shape[SMP_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    shape[x->ndim - 1] = l->out;
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, shape);
    if (!y) return SMP_ERR_NOMEM;
    /* a row-parallel linear's bias is added after the reduce */
    const float *bias = l->split == GPT_SPLIT_ROW ? NULL : (const float *)smp_param_value(l->bias)->data;
    mlp_linear_forward((const float *)x->data, (const float *)smp_param_value(l->weight)->data, bias, (float *)y->data,
                       gpt__rows(x, l->in), l->in, l->out);
    return SMP_OK;
}

/* The backward in two halves (smp_module_set_backward_split): the input
   gradient dx = dy W, which the block before waits for, and the weight
   gradients dW += dy^T x, db += column sums of dy, which a zero-bubble
   schedule runs in a pipeline bubble. */
static smp_status gpt_linear_backward_input(smp_call_ctx *c) {
    const gpt_linear *l = (const gpt_linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    if (dx)
        mlp_linear_backward((const float *)x->data, (const float *)smp_param_value(l->weight)->data,
                            (const float *)dy->data, (float *)dx->data, NULL, NULL, gpt__rows(x, l->in), l->in, l->out);
    return SMP_OK;
}

static smp_status gpt_linear_backward_weight(smp_call_ctx *c) {
    const gpt_linear *l = (const gpt_linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    float *db = l->split == GPT_SPLIT_ROW ? NULL : (float *)smp_param_grad(l->bias)->data; /* the bias module's */
    mlp_linear_backward((const float *)x->data, (const float *)smp_param_value(l->weight)->data,
                        (const float *)dy->data, NULL, (float *)smp_param_grad(l->weight)->data, db,
                        gpt__rows(x, l->in), l->in, l->out);
    return SMP_OK;
}

/* nn.LayerNorm(C) with bias; the stash holds mean and rstd per row. */
static smp_status gpt_layernorm_forward(smp_call_ctx *c) {
    const gpt_norm *l = (const gpt_norm *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    if (x->dtype != SMP_F32 || x->shape[x->ndim - 1] != l->C)
        return smp_error(SMP_ERR_ARG, "%s takes f32 inputs of width %d", smp_module_name(smp_call_module(c)), l->C);
    int n = gpt__rows(x, l->C);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    float *stats = (float *)smp_call_stash(c, sizeof(float) * 2 * (size_t)n);
    if (!stats) return smp_error(SMP_ERR_NOMEM, "%s: out of memory", smp_module_name(smp_call_module(c)));
    gpt__layernorm_forward((const float *)x->data, (const float *)smp_param_value(l->weight)->data,
                           (const float *)smp_param_value(l->bias)->data, (float *)y->data, stats, stats + n, n, l->C);
    return SMP_OK;
}

static smp_status gpt_layernorm_backward(smp_call_ctx *c) {
    const gpt_norm *l = (const gpt_norm *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    int n = gpt__rows(x, l->C);
    const float *stats = (const float *)smp_call_stashed(c, NULL);
    gpt__layernorm_backward((const float *)x->data, (const float *)smp_param_value(l->weight)->data, stats, stats + n,
                            (const float *)dy->data, dx ? (float *)dx->data : NULL,
                            (float *)smp_param_grad(l->weight)->data, (float *)smp_param_grad(l->bias)->data, n, l->C);
    return SMP_OK;
}

/* GELU; the stash holds tanh of every element. */
static smp_status gpt_gelu_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    size_t n = (size_t)smp_tensor_numel(x);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    float *t =
        smp_call_is_training(c) ? (float *)smp_call_stash(c, n * sizeof(float)) : (float *)malloc(n * sizeof(float));
    if (!t) return smp_error(SMP_ERR_NOMEM, "%s: out of memory", smp_module_name(smp_call_module(c)));
    gpt__gelu_forward((const float *)x->data, (float *)y->data, t, n);
    if (!smp_call_is_training(c)) free(t);
    return SMP_OK;
}

static smp_status gpt_gelu_backward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    if (dx)
        gpt__gelu_backward((const float *)x->data, (const float *)smp_call_stashed(c, NULL), (const float *)dy->data,
                           (float *)dx->data, (size_t)smp_tensor_numel(x));
    return SMP_OK;
}

/* Causal self-attention on qkv [B, T, 3C] -> [B, T, C]; the stash holds the
   probabilities [B, H, T, T]. */
/* Cached mode (gpt.kv set): qkv [1, S, 3C] of S new tokens at positions
   p = kv->pos[mb] .. p + S - 1 (C: this rank's C / tp, its heads). Their
   keys and values go into the cache of (this block, this microbatch) at
   those positions; each new token attends over the cached positions 0 ..
   its own. */
static smp_status gpt__sdpa_cached(smp_call_ctx *c, const gpt_block *b, const smp_tensor *x) {
    const gpt *g = b->g;
    gpt_kv *kv = g->kv;
    int C = g->cfg.n_embd / g->tp, H = g->cfg.n_head / g->tp, hd = C / H, Tmax = g->cfg.block_size, C3 = 3 * C;
    int S = (int)x->shape[1], mb, p;
    const char *name = smp_module_name(smp_call_module(c));
    SMP_TRY(gpt_kv_at(c, g, x, &mb, &p));
    size_t slot = (size_t)b->index * (size_t)kv->M + (size_t)mb;
    if (!kv->k[slot]) kv->k[slot] = (float *)calloc((size_t)Tmax * C, sizeof(float));
    if (!kv->v[slot]) kv->v[slot] = (float *)calloc((size_t)Tmax * C, sizeof(float));
    float *K = kv->k[slot], *Vc = kv->v[slot], *s = (float *)malloc(sizeof(float) * (size_t)Tmax);
    if (!K || !Vc || !s) { free(s); return smp_error(SMP_ERR_NOMEM, "%s: out of memory for the KV cache", name); }
    const float *qkv = (const float *)x->data;
    for (int t = 0; t < S; t++) {
        memcpy(K + (size_t)(p + t) * C, qkv + (size_t)t * C3 + C, sizeof(float) * (size_t)C);
        memcpy(Vc + (size_t)(p + t) * C, qkv + (size_t)t * C3 + 2 * C, sizeof(float) * (size_t)C);
    }
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 3, (int64_t[]){1, S, C});
    if (!y) return SMP_ERR_NOMEM;
    float *ys = (float *)y->data, scale = 1.0f / sqrtf((float)hd);
    for (int t = 0; t < S; t++) {
        int n = p + t + 1; /* keys 0 .. p + t */
        for (int h = 0; h < H; h++) {
            const float *q = qkv + (size_t)t * C3 + (size_t)h * hd;
            float mx = -INFINITY;
            for (int j = 0; j < n; j++) {
                const float *k = K + (size_t)j * C + (size_t)h * hd;
                float d = 0;
                for (int e = 0; e < hd; e++) d += q[e] * k[e];
                s[j] = d * scale;
                mx = s[j] > mx ? s[j] : mx;
            }
            float sum = 0;
            for (int j = 0; j < n; j++) { s[j] = expf(s[j] - mx); sum += s[j]; }
            float inv = 1.0f / sum, *yh = ys + (size_t)t * C + (size_t)h * hd;
            for (int e = 0; e < hd; e++) yh[e] = 0.0f;
            for (int j = 0; j < n; j++) {
                const float *v = Vc + (size_t)j * C + (size_t)h * hd;
                float w = s[j] * inv;
                for (int e = 0; e < hd; e++) yh[e] += w * v[e];
            }
        }
    }
    free(s);
    return SMP_OK;
}

static smp_status gpt_sdpa_forward(smp_call_ctx *c) {
    const gpt_block *blk = (const gpt_block *)smp_module_user(smp_call_module(c));
    const gpt *g = blk->g;
    const smp_tensor *x = smp_call_input(c, 0);
    int C = g->cfg.n_embd / g->tp, H = g->cfg.n_head / g->tp; /* this rank's heads */
    if (x->ndim != 3 || x->shape[2] != 3 * C)
        return smp_error(SMP_ERR_ARG, "attention takes qkv of shape [batch, time, %d]", 3 * C);
    if (g->kv) return gpt__sdpa_cached(c, blk, x);
    int B = (int)x->shape[0], T = (int)x->shape[1];
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 3, (int64_t[]){B, T, C});
    if (!y) return SMP_ERR_NOMEM;
    size_t pbytes = sizeof(float) * (size_t)B * H * T * T;
    float *P = smp_call_is_training(c) ? (float *)smp_call_stash(c, pbytes) : (float *)malloc(pbytes);
    if (!P)
        return smp_error(SMP_ERR_NOMEM, "%s: out of memory for %zu bytes of attention",
                         smp_module_name(smp_call_module(c)), pbytes);
    gpt__attention_forward((const float *)x->data, (float *)y->data, P, B, T, C, H);
    if (!smp_call_is_training(c)) free(P);
    return SMP_OK;
}

static smp_status gpt_sdpa_backward(smp_call_ctx *c) {
    const gpt *g = ((const gpt_block *)smp_module_user(smp_call_module(c)))->g;
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    if (!dx) return SMP_OK;
    int C = g->cfg.n_embd / g->tp, H = g->cfg.n_head / g->tp, B = (int)x->shape[0], T = (int)x->shape[1];
    float *dP = (float *)malloc(sizeof(float) * (size_t)T * T);
    if (!dP) return smp_error(SMP_ERR_NOMEM, "%s: out of memory", smp_module_name(smp_call_module(c)));
    gpt__attention_backward((const float *)x->data, (const float *)smp_call_stashed(c, NULL), (const float *)dy->data,
                            (float *)dx->data, dP, B, T, C, H);
    free(dP);
    return SMP_OK;
}

/* Dropout with p = cfg.dropout; the mask comes again from the call's seed. */
static smp_status gpt_dropout_forward(smp_call_ctx *c) {
    const gpt *g = gpt__of(c);
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    size_t n = (size_t)smp_tensor_numel(x);
    if (smp_call_is_training(c))
        gpt__dropout((const float *)x->data, (float *)y->data, n, g->cfg.dropout, smp_call_seed(c));
    else memcpy(y->data, x->data, n * sizeof(float));
    return SMP_OK;
}

static smp_status gpt_dropout_backward(smp_call_ctx *c) {
    const gpt *g = gpt__of(c);
    const smp_tensor *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    if (dx)
        gpt__dropout((const float *)dy->data, (float *)dx->data, (size_t)smp_tensor_numel(dy), g->cfg.dropout,
                     smp_call_seed(c));
    return SMP_OK;
}

#endif /* MLP_ENGINE_NO_BLAS */

/* ---------------------------------------------------------------- tensor parallelism */
/* The bias of a row-parallel linear (its gpt_linear is the module's user),
   added once the TP ranks' partial sums are reduced: y = x + b; the
   gradient is c_proj's bias's (db += column sums of dy, rows in order),
   the same on every TP rank. Host loops: only a host model splits. */
static smp_status gpt_bias_forward(smp_call_ctx *c) {
    const gpt_linear *l = (const gpt_linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    const float *xs = (const float *)x->data, *b = (const float *)smp_param_value(l->bias)->data;
    float *ys = (float *)y->data;
    for (int r = 0, n = gpt__rows(x, l->out); r < n; r++)
        for (int j = 0; j < l->out; j++) ys[(size_t)r * l->out + j] = xs[(size_t)r * l->out + j] + b[j];
    return SMP_OK;
}

static smp_status gpt_bias_backward(smp_call_ctx *c) {
    const gpt_linear *l = (const gpt_linear *)smp_module_user(smp_call_module(c));
    const smp_tensor *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    const float *d = (const float *)dy->data;
    float *db = (float *)smp_param_grad(l->bias)->data;
    for (int r = 0, n = gpt__rows(dy, l->out); r < n; r++)
        for (int j = 0; j < l->out; j++) db[j] += d[(size_t)r * l->out + j];
    if (dx) memcpy(dx->data, dy->data, smp_tensor_nbytes(dy));
    return SMP_OK;
}

/* A linear and, when it is row-parallel, the reduce over TP_GROUP and its
   bias; `into`, when set, enters the tensor-parallel region first. */
static smp_status gpt__tp_linear(smp_module *into, smp_module *lin, smp_module *reduce, smp_module *bias, smp_tensor *x,
                                 smp_tensor *y) {
    if (into) SMP_TRY(smp_call(into, x, 1, x, 1));
    SMP_TRY(smp_call(lin, x, 1, y, 1));
    if (reduce) SMP_TRY(smp_call(reduce, y, 1, y, 1));
    if (bias) SMP_TRY(smp_call(bias, y, 1, y, 1));
    return SMP_OK;
}

/* ---------------------------------------------------------------- composites */
/* With tp > 1 each is Megatron's: tp_copy, the column-parallel linear (this
   rank's heads, or its 1/tp of the MLP's width), what runs on that part
   alone, the row-parallel linear, tp_reduce, its bias. */
static smp_status gpt_attn_forward(smp_call_ctx *c) {
    const gpt_block *b = (const gpt_block *)smp_module_user(smp_call_module(c));
    smp_tensor x = *smp_call_input(c, 0), qkv, y, o;
    SMP_TRY(gpt__tp_linear(b->attn_copy, b->c_attn, NULL, NULL, &x, &qkv));
    SMP_TRY(smp_call(b->sdpa, &qkv, 1, &y, 1));
    SMP_TRY(gpt__tp_linear(NULL, b->attn_proj, b->attn_reduce, b->attn_bias, &y, &o));
    if (b->attn_drop) SMP_TRY(smp_call(b->attn_drop, &o, 1, &o, 1));
    return smp_call_set_output(c, 0, &o);
}

static smp_status gpt_mlp_forward(smp_call_ctx *c) {
    const gpt_block *b = (const gpt_block *)smp_module_user(smp_call_module(c));
    smp_tensor x = *smp_call_input(c, 0), h, a, o;
    SMP_TRY(gpt__tp_linear(b->mlp_copy, b->c_fc, NULL, NULL, &x, &h));
    SMP_TRY(smp_call(b->gelu, &h, 1, &a, 1));
    SMP_TRY(gpt__tp_linear(NULL, b->mlp_proj, b->mlp_reduce, b->mlp_bias, &a, &o));
    if (b->mlp_drop) SMP_TRY(smp_call(b->mlp_drop, &o, 1, &o, 1));
    return smp_call_set_output(c, 0, &o);
}

/* transformer.h.<i>: x + attn(ln_1(x)), then r + mlp(ln_2(r)). */
static smp_status gpt_block_forward(smp_call_ctx *c) {
    const gpt_block *b = (const gpt_block *)smp_module_user(smp_call_module(c));
    smp_tensor x = *smp_call_input(c, 0), h, a, r, m, y;
    SMP_TRY(smp_call(b->ln_1, &x, 1, &h, 1));
    SMP_TRY(smp_call(b->attn, &h, 1, &a, 1));
    smp_tensor xa[2] = {x, a};
    SMP_TRY(smp_call(b->add_1, xa, 2, &r, 1));
    SMP_TRY(smp_call(b->ln_2, &r, 1, &h, 1));
    SMP_TRY(smp_call(b->mlp, &h, 1, &m, 1));
    smp_tensor rm[2] = {r, m};
    SMP_TRY(smp_call(b->add_2, rm, 2, &y, 1));
    return smp_call_set_output(c, 0, &y);
}

/* The model's forward: ids [B, T] -> logits [B, T, V]. */
static smp_status gpt_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m, (void)nin, (void)nout;
    const gpt *g = (const gpt *)user;
    smp_tensor x;
    SMP_TRY(smp_call(g->wte, &in[0], 1, &x, 1));          /* embedding lookup */
    if (g->wte_reduce) SMP_TRY(smp_call(g->wte_reduce, &x, 1, &x, 1)); /* tp > 1: each rank looked up its rows */
    SMP_TRY(smp_call(g->wpe, &x, 1, &x, 1));
    for (int i = 0; i < g->cfg.n_layer; i++) SMP_TRY(smp_call(g->blocks[i].mod, &x, 1, &x, 1));
    SMP_TRY(smp_call(g->ln_f, &x, 1, &x, 1));
    if (g->head_copy) SMP_TRY(smp_call(g->head_copy, &x, 1, &x, 1));
    return smp_call(g->wte, &x, 1, &out[0], 1); /* the same module: the tied head (tp > 1: this rank's logits) */
}

/* ---------------------------------------------------------------- building it */
/* N(0, std) by Box-Muller from the parameter's seed; user points to std. */
static void gpt_init_normal(smp_tensor *w, uint64_t seed, void *user) {
    float std = *(const float *)user;
    mlp_rng r = mlp_rng_seed(seed);
    float *p = (float *)w->data;
    int64_t n = smp_tensor_numel(w);
    for (int64_t i = 0; i < n; i += 2) {
        double u1 = ((double)(mlp_rng_next(&r) >> 11) + 1.0) * (1.0 / 9007199254740992.0); /* (0, 1] */
        double u2 = (double)(mlp_rng_next(&r) >> 11) * (1.0 / 9007199254740992.0);
        double rad = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;
        p[i] = (float)(std * rad * cos(th));
        if (i + 1 < n) p[i + 1] = (float)(std * rad * sin(th));
    }
}

static const float gpt__std = 0.02f, gpt__one = 1.0f;

/* nn.Linear(in, out) named `name`. With g->tp > 1, split as `split` says:
   a column-parallel one's weight and bias sharded along the outputs (in
   `blocks` blocks, each split tp ways: c_attn's q, k and v, so that a rank
   holds the same heads of each, as smp_param_new_sharded_blocks does; the
   shape stays [out, in], nanoGPT's), a row-parallel one's weight along the
   inputs, its bias whole. */
static void gpt__linear(gpt_linear *l, const gpt *g, smp_module *parent, const char *name, int in, int out,
                        const float *std, int split, int blocks, smp_module **mod) {
    smp_module_desc d = {g->leaves->linear_forward, NULL, l};
    int tp = g->tp;
    l->split = tp > 1 ? split : GPT_SPLIT_NONE;
    l->in = l->split == GPT_SPLIT_ROW ? in / tp : in;
    l->out = l->split == GPT_SPLIT_COLUMN ? out / tp : out;
    l->g = g;
    *mod = smp_module_new(parent, name, &d);
    smp_module_set_backward_split(*mod, g->leaves->linear_backward_input, g->leaves->linear_backward_weight);
    smp_module_set_overwrites_grad_inputs(*mod, !g->leaves->on_device);
    const int64_t wshape[2] = {out, in}, bshape[1] = {out};
    if (l->split == GPT_SPLIT_COLUMN) {
        l->weight =
            smp_param_new_sharded_blocks(*mod, "weight", SMP_F32, 2, wshape, 0, blocks, gpt_init_normal, (void *)std);
        l->bias = smp_param_new_sharded_blocks(*mod, "bias", SMP_F32, 1, bshape, 0, blocks, smp_init_constant, NULL);
    } else {
        void *u = (void *)std;
        l->weight = l->split == GPT_SPLIT_ROW
                        ? smp_param_new_sharded(*mod, "weight", SMP_F32, 2, wshape, 1, gpt_init_normal, u)
                        : smp_param_new(*mod, "weight", SMP_F32, 2, wshape, gpt_init_normal, u);
        l->bias = smp_param_new(*mod, "bias", SMP_F32, 1, bshape, smp_init_constant, NULL);
    }
}

/* The modules around a row-parallel linear `lin` (named `name`): tp_copy
   before the column-parallel one, tp_reduce and the bias after `lin`. */
static void gpt__tp_region(const gpt *g, smp_module *parent, const char *name, gpt_linear *lin, smp_module **into,
                           smp_module **reduce, smp_module **bias) {
    if (g->tp == 1) return;
    char n[64];
    const smp_module_desc d = {gpt_bias_forward, gpt_bias_backward, lin};
    snprintf(n, sizeof n, "%s_tp_in", name);
    *into = smp_module_new_tp_copy(parent, n);
    snprintf(n, sizeof n, "%s_tp_out", name);
    *reduce = smp_module_new_tp_reduce(parent, n);
    snprintf(n, sizeof n, "%s_bias", name);
    *bias = smp_module_new(parent, n, &d);
    smp_module_set_overwrites_grad_inputs(*bias, true); /* host only */
}

static smp_module *gpt__norm(gpt_norm *l, const gpt *g, smp_module *parent, const char *name, int C) {
    smp_module_desc d = {g->leaves->layernorm_forward, g->leaves->layernorm_backward, l};
    l->C = C;
    l->g = g;
    smp_module *m = smp_module_new(parent, name, &d);
    smp_module_set_overwrites_grad_inputs(m, !g->leaves->on_device);
    const int64_t shape[1] = {C};
    l->weight = smp_param_new(m, "weight", SMP_F32, 1, shape, smp_init_constant, (void *)&gpt__one);
    l->bias = smp_param_new(m, "bias", SMP_F32, 1, shape, smp_init_constant, NULL);
    return m;
}

/* Declares the modules (nothing is allocated until smp partitions the
   model) with the leaves' callbacks and engine, and wraps them in an smp
   model. recompute: every block is recomputed in its backward (activation
   checkpointing). */
static smp_status gpt_build_with(gpt *g, const gpt_config *cfg, bool recompute, const gpt_leaves *leaves, void *engine,
                                 smp_model **model) {
    memset(g, 0, sizeof *g);
    g->cfg = *cfg;
    g->leaves = leaves;
    g->engine = engine;
    const gpt_leaves *L = leaves;
    int C = cfg->n_embd, nl = cfg->n_layer;
    if (cfg->vocab < 1 || nl < 1 || C < 1 || cfg->n_head < 1 || C % cfg->n_head || cfg->block_size < 1)
        return smp_error(SMP_ERR_ARG,
                         "bad model size: vocab %d, %d layers, width %d, %d heads (must divide the width), context %d",
                         cfg->vocab, nl, C, cfg->n_head, cfg->block_size);
    int tp = g->tp = smp_tp_size();
    if (tp > 1 && leaves->on_device)
        return smp_error(SMP_ERR_CONFIG, "tensor_parallel_degree = %d: the device GPT (gpt.cu) does not split layers; "
                         "run it with tensor_parallel_degree 1, or gpt.c with --tp", tp);
    if (cfg->n_head % tp)
        return smp_error(SMP_ERR_CONFIG, "%d heads do not split over tensor_parallel_degree = %d: make --heads a "
                         "multiple of %d, or choose a --tp that divides %d", cfg->n_head, tp, tp, cfg->n_head);
    if ((4 * C) % tp)
        return smp_error(SMP_ERR_CONFIG, "the MLP's width 4 x %d does not split over tensor_parallel_degree = %d: "
                         "choose a --tp that divides %d", C, tp, 4 * C);
    if (cfg->vocab % tp)
        return smp_error(SMP_ERR_CONFIG, "the vocabulary of %d does not split over tensor_parallel_degree = %d: "
                         "choose a --tp that divides %d", cfg->vocab, tp, cfg->vocab);
    static float proj_std;
    proj_std = gpt__std / sqrtf(2.0f * (float)nl);
    g->blocks = (gpt_block *)calloc((size_t)nl, sizeof(gpt_block));
    if (!g->blocks) return smp_error(SMP_ERR_NOMEM, "out of memory");
    const smp_module_desc wte = {L->wte_forward, L->wte_backward, g}, wpe = {L->wpe_forward, L->wpe_backward, g};
    const smp_module_desc drop = {L->dropout_forward, L->dropout_backward, g},
                          gelu = {L->gelu_forward, L->gelu_backward, g};
    const int64_t wte_shape[2] = {cfg->vocab, C}, wpe_shape[2] = {cfg->block_size, C};
    g->root = smp_module_new(NULL, "", NULL);
    g->transformer = smp_module_new(g->root, "transformer", NULL);
    g->wte = smp_module_new(g->transformer, "wte", &wte);
    void *std = (void *)&gpt__std;
    g->wte_w = tp > 1 ? smp_param_new_sharded(g->wte, "weight", SMP_F32, 2, wte_shape, 0, gpt_init_normal, std)
                      : smp_param_new(g->wte, "weight", SMP_F32, 2, wte_shape, gpt_init_normal, std);
    if (tp > 1) g->wte_reduce = smp_module_new_tp_reduce(g->transformer, "wte_tp_out"); /* vocabulary-parallel */
    g->wpe = smp_module_new(g->transformer, "wpe", &wpe);
    g->wpe_w = smp_param_new(g->wpe, "weight", SMP_F32, 2, wpe_shape, gpt_init_normal, (void *)&gpt__std);
    g->h = smp_module_new(g->transformer, "h", NULL);
    for (int i = 0; i < nl; i++) {
        gpt_block *b = &g->blocks[i];
        char name[16];
        snprintf(name, sizeof name, "%d", i);
        const smp_module_desc block = {gpt_block_forward, NULL, b}, attn = {gpt_attn_forward, NULL, b};
        const smp_module_desc mlp = {gpt_mlp_forward, NULL, b}, sdpa = {L->sdpa_forward, L->sdpa_backward, b};
        b->g = g;
        b->index = i;
        b->mod = smp_module_new(g->h, name, &block);
        b->ln_1 = gpt__norm(&b->n1, g, b->mod, "ln_1", C);
        b->attn = smp_module_new(b->mod, "attn", &attn);
        gpt__linear(&b->l_attn, g, b->attn, "c_attn", C, 3 * C, &gpt__std, GPT_SPLIT_COLUMN, 3, &b->c_attn);
        b->sdpa = smp_module_new(b->attn, "sdpa", &sdpa);
        gpt__linear(&b->l_aproj, g, b->attn, "c_proj", C, C, &proj_std, GPT_SPLIT_ROW, 1, &b->attn_proj);
        gpt__tp_region(g, b->attn, "c_proj", &b->l_aproj, &b->attn_copy, &b->attn_reduce, &b->attn_bias);
        if (cfg->dropout > 0) b->attn_drop = smp_module_new(b->attn, "resid_dropout", &drop);
        b->add_1 = smp_module_new_add(b->mod, "add_1");
        b->ln_2 = gpt__norm(&b->n2, g, b->mod, "ln_2", C);
        b->mlp = smp_module_new(b->mod, "mlp", &mlp);
        gpt__linear(&b->l_fc, g, b->mlp, "c_fc", C, 4 * C, &gpt__std, GPT_SPLIT_COLUMN, 1, &b->c_fc);
        b->gelu = smp_module_new(b->mlp, "gelu", &gelu);
        gpt__linear(&b->l_mproj, g, b->mlp, "c_proj", 4 * C, C, &proj_std, GPT_SPLIT_ROW, 1, &b->mlp_proj);
        gpt__tp_region(g, b->mlp, "c_proj", &b->l_mproj, &b->mlp_copy, &b->mlp_reduce, &b->mlp_bias);
        if (cfg->dropout > 0) b->mlp_drop = smp_module_new(b->mlp, "dropout", &drop);
        b->add_2 = smp_module_new_add(b->mod, "add_2");
        if (recompute) smp_module_set_recompute(b->mod, true);
        smp_module *leaves_here[] = {b->sdpa, b->gelu, b->attn_drop, b->mlp_drop};
        for (size_t k = 0; k < sizeof leaves_here / sizeof leaves_here[0]; k++)
            smp_module_set_overwrites_grad_inputs(leaves_here[k], !leaves->on_device);
    }
    smp_module_set_overwrites_grad_inputs(g->wte, !leaves->on_device);
    smp_module_set_overwrites_grad_inputs(g->wpe, !leaves->on_device);
    g->ln_f = gpt__norm(&g->nf, g, g->transformer, "ln_f", C);
    if (tp > 1) g->head_copy = smp_module_new_tp_copy(g->transformer, "lm_head_tp_in"); /* dx: summed over V */
    smp_model_desc md;
    memset(&md, 0, sizeof md);
    md.forward = gpt_forward;
    md.user = g;
    md.on_device = leaves->on_device;
    return smp_model_new(g->root, &md, model);
}

#ifndef MLP_ENGINE_NO_BLAS
static const gpt_leaves gpt_host_leaves = {gpt_wte_forward,
                                           gpt_wte_backward,
                                           gpt_wpe_forward,
                                           gpt_wpe_backward,
                                           gpt_linear_forward,
                                           gpt_linear_backward_input,
                                           gpt_linear_backward_weight,
                                           gpt_layernorm_forward,
                                           gpt_layernorm_backward,
                                           gpt_gelu_forward,
                                           gpt_gelu_backward,
                                           gpt_sdpa_forward,
                                           gpt_sdpa_backward,
                                           gpt_dropout_forward,
                                           gpt_dropout_backward,
                                           false};

/* The host model (gpt.c): OpenBLAS and the functions above. */
static smp_status gpt_build(gpt *g, const gpt_config *cfg, bool recompute, smp_model **model) {
    return gpt_build_with(g, cfg, recompute, &gpt_host_leaves, NULL, model);
}
#endif

static void gpt_kv_free(gpt_kv *kv) {
    if (!kv) return;
    for (int i = 0; kv->k && kv->v && i < kv->M * kv->L; i++) { free(kv->k[i]); free(kv->v[i]); }
    free(kv->k);
    free(kv->v);
    free(kv->pos);
    free(kv);
}

/* Switches g to cached mode with empty caches for M microbatches. */
static smp_status gpt_kv_start(gpt *g, int M) {
    gpt_kv *kv = (gpt_kv *)calloc(1, sizeof *kv);
    if (kv) {
        kv->M = M;
        kv->L = g->cfg.n_layer;
        kv->pos = (int *)calloc((size_t)M, sizeof(int));
        kv->k = (float **)calloc((size_t)M * (size_t)kv->L, sizeof(float *));
        kv->v = (float **)calloc((size_t)M * (size_t)kv->L, sizeof(float *));
    }
    if (!kv || !kv->pos || !kv->k || !kv->v) {
        gpt_kv_free(kv);
        return smp_error(SMP_ERR_NOMEM, "out of memory for the KV cache");
    }
    gpt_kv_free(g->kv);
    g->kv = kv;
    return SMP_OK;
}

static void gpt_free(gpt *g) {
    gpt_kv_free(g->kv);
    g->kv = NULL;
    free(g->blocks);
    g->blocks = NULL;
}

/* ---------------------------------------------------------------- the loss */
/* Mean over the n rows of -log softmax(logits)[target] (logits n x V, in
   double, rows in order). dlogits (may be NULL) gets grad_scale *
   (softmax - onehot), overwritten. */
static double gpt_xent(const float *logits, const int32_t *target, int n, int V, float *dlogits, float grad_scale) {
    double sum = 0;
    for (int r = 0; r < n; r++)
        sum += (double)gpt__xent_row(logits + (size_t)r * V, target[r], V, dlogits ? dlogits + (size_t)r * V : NULL,
                                     grad_scale);
    return n ? sum / n : 0;
}

#ifndef MLP_ENGINE_NO_BLAS
/* Sums over TP_GROUP of n values per rank, added in tp-rank order (from an
   all-gather) so that every rank holds the same bits; max: the largest
   instead. all is scratch of tp x n. */
static smp_status gpt__tp_combine(float *v, float *all, int n, bool max) {
    int tp = smp_tp_size();
    smp_tensor in = smp_tensor_1d(v, SMP_F32, n), out = smp_tensor_1d(all, SMP_F32, (int64_t)n * tp);
    SMP_TRY(smp_all_gather(&in, &out, SMP_TP_GROUP));
    for (int i = 0; i < n; i++) {
        float a = all[i];
        for (int r = 1; r < tp; r++) a = max ? fmaxf(a, all[(size_t)r * n + i]) : a + all[(size_t)r * n + i];
        v[i] = a;
    }
    return SMP_OK;
}

/* gpt_xent with the vocabulary split over TP_GROUP (tp > 1): logits holds
   this rank's Vl columns of each row, vocabulary ids [first, first + Vl).
   The row maxima, then the sums of exp(z - max) and the targets' logits
   are combined across the group (gpt__tp_combine), so no rank ever holds a
   whole row; every rank returns the same loss, and dlogits gets its
   columns of grad_scale * (softmax - onehot). Collective over TP_GROUP. */
static smp_status gpt_xent_tp(const float *logits, const int32_t *target, int n, int Vl, int first, float *dlogits,
                              float grad_scale, double *loss) {
    int tp = smp_tp_size();
    float *v = (float *)malloc(sizeof(float) * 3 * (size_t)n);
    float *all = (float *)malloc(sizeof(float) * 2 * (size_t)n * tp);
    smp_status st = v && all ? SMP_OK : smp_error(SMP_ERR_NOMEM, "out of memory for the cross-entropy's sums");
    float *mx = v, *sum = v + n, *tz = v + 2 * (size_t)n; /* sum and tz travel together */
    for (int r = 0; r < n && !st; r++) {
        const float *z = logits + (size_t)r * Vl;
        float m = z[0];
        for (int j = 1; j < Vl; j++) m = z[j] > m ? z[j] : m;
        mx[r] = m;
    }
    if (!st) st = gpt__tp_combine(mx, all, n, true);
    for (int r = 0; r < n && !st; r++) {
        const float *z = logits + (size_t)r * Vl;
        float s = 0;
        for (int j = 0; j < Vl; j++) s += expf(z[j] - mx[r]);
        sum[r] = s;
        int t = target[r] - first;
        tz[r] = t >= 0 && t < Vl ? z[t] : 0.0f; /* on the one rank that holds it */
    }
    if (!st) st = gpt__tp_combine(sum, all, 2 * n, false);
    double total = 0;
    for (int r = 0; r < n && !st; r++) {
        total += (double)(mx[r] + logf(sum[r]) - tz[r]);
        if (!dlogits) continue;
        const float *z = logits + (size_t)r * Vl;
        float *d = dlogits + (size_t)r * Vl, inv = 1.0f / sum[r];
        for (int j = 0; j < Vl; j++) d[j] = expf(z[j] - mx[r]) * inv * grad_scale;
        int t = target[r] - first;
        if (t >= 0 && t < Vl) d[t] -= grad_scale;
    }
    *loss = n ? total / n : 0;
    free(v);
    free(all);
    return st;
}

/* The step body: arguments 0 ids [B, T], 1 targets [B, T] (i32). Returns
   the microbatch's mean loss over its tokens (f64) as StepOutput 0, and
   writes its gradient where training (smp scales it by 1/microbatches). */
SMP_STEP_BODY(gpt_loss_body) {
    const smp_tensor *logits = smp_mb_output(mb, 0), *target = smp_mb_arg(mb, 1);
    smp_tensor *dlogits = smp_mb_output_grad(mb, 0); /* NULL in evaluation */
    int Vl = (int)logits->shape[logits->ndim - 1], V = Vl * smp_tp_size(); /* tp > 1: this rank's Vl of V */
    int n = (int)smp_tensor_numel(target);
    const int32_t *t = (const int32_t *)target->data;
    for (int i = 0; i < n; i++)
        if (t[i] < 0 || t[i] >= V)
            return smp_error(SMP_ERR_ARG, "target %d at position %d is outside the vocabulary of %d", t[i], i, V);
    double loss;
    float *d = dlogits ? (float *)dlogits->data : NULL;
    if (V == Vl) loss = gpt_xent((const float *)logits->data, t, n, V, d, 1.0f / (float)n);
    else SMP_TRY(gpt_xent_tp((const float *)logits->data, t, n, Vl, Vl * smp_tp_rank(), d, 1.0f / (float)n, &loss));
    smp_tensor lt = smp_tensor_1d(&loss, SMP_F64, 1);
    return smp_mb_return(mb, 0, &lt);
}
#endif

#endif
