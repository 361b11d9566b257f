/* test_composite.c - composite modules, activation recomputation, per-call
   seeds and wide stage boundaries (issue 15), against a plain C model with
   the same kernels. Multi-process; passes under mpirun -n 1, -n 2 and -n 4
   (a configuration that needs more ranks than the world has prints SKIP).

   Every configuration runs on a group of exactly P ranks: the world is
   split into groups of P, each one smp job of its own (cfg.comm, data
   parallelism off), so every group's result must equal the one-process
   result bit for bit. The one-process result is a plain C implementation of
   the same network with the same kernels and the same microbatching
   (gradients of a parameter add microbatches in increasing order; a value
   feeding two calls gets the later consumer's gradient plus the earlier's),
   and also smp itself run with partitions = 1 on a group of one rank.

   What it covers:
     1. a residual MLP, a stem linear (12 -> 16), 6 blocks (fc1 16 -> 64 ->
        relu -> fc2 64 -> 16 -> smp_module_new_add(block input, fc2)) and a
        head (16 -> 4), MSE loss, a batch of 8: 26 leaf calls,
        written as 6 composite blocks and as 26 flat top-level calls with the
        same parameter names. Per-microbatch losses and every parameter after
        3 SGD steps equal the reference bit for bit, for partitions 1/2/4,
        simple, interleaved, zero_bubble (whose W ops run no callback
        here: every leaf has a whole backward, but a call's recomputed
        activations and its stage's memory go only after its W) and
        zero_bubble_v (2P stages in a V, the middle two on one rank),
        microbatches 1/2/4, auto and manual placement
        (block boundaries on partition boundaries; 0,1,0,1 virtual stages;
        auto with 2 virtual stages; the V 0,0,1,1,1,1,0,0 and
        0,1,2,3,3,2,1,0); every parameter changes and lives on
        exactly one rank of the group;
     2. two levels of nesting (the block's MLP a composite that ends in the
        built-in identity);
     3. recomputation: smp_module_set_recompute on every block, on the inner
        MLP, and the activation_checkpointing key: bitwise the same result,
        the recomputed leaves' forwards run twice, and the peak stash
        (smp_last_step_stats) is lower than without;
     4. dropout whose mask comes from smp_call_seed inside recomputed blocks:
        the same result for partitions 1/2/4 and recomputation on and off;
        the seed is the same in the recomputation and in every partitioning,
        and differs per call, microbatch and step;
     5. errors at trace time, on every rank, naming the call: an in-place
        edit of an smp_call output in the model forward (of one a later call
        reads, and of the model's output after its last call) and in a
        composite forward, a composite with a backward, a composite that
        allocates its own output, and a composite that passes a child a
        buffer no smp_call produced;
     6. 100 tensors crossing one stage boundary (manual placement) equal
        one process bit for bit;
     7. the gradients of one step against a float64 numpy reference
        (test/composite_ref.py), to float32 rounding.
   Build (from the repository root):
     make build/gcc/test_composite      Run: mpirun -n 2 build/gcc/test_composite */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* FF: the width inside a block (a transformer MLP's 4x), so that what
   recomputation frees outweighs the block boundaries by far */
enum { IN = 12, HID = 16, FF = 4 * HID, CLS = 4, BATCH = 8, NBLK = 6, MAXM = 4, STEPS = 3, NFAN = 100 };
enum { NPMAX = 4 * NBLK + 4, PMAXEL = NFAN * IN > FF * HID ? NFAN * IN : FF * HID, NLIN = 2 * NBLK + 2 };
static const float LR = 0.05f;

static int g_world, g_rank;
static float g_x[BATCH * IN], g_t[BATCH * CLS];

/* ---------------------------------------------------------------- kernels shared by smp's modules and the reference */
#include "linear_ref.h"
static float mse(const float *y, const float *t, float *g, int n) { /* mean over elements */
    float loss = 0;
    for (int i = 0; i < n; i++) {
        float d = y[i] - t[i];
        loss += d * d;
        if (g) g[i] = 2.0f * d / (float)n;
    }
    return loss / (float)n;
}
static void sgd(float *w, const float *g, int n) {
    for (int i = 0; i < n; i++) w[i] -= LR * g[i];
}

/* ---------------------------------------------------------------- parameter layouts */
typedef struct layout {
    int n;
    char name[NPMAX][48];
    int rows[NPMAX], cols[NPMAX]; /* cols 0: a vector of `rows` */
} layout;
static int numel_of(const layout *L, int k) { return L->rows[k] * (L->cols[k] ? L->cols[k] : 1); }
static void layout_add(layout *L, const char *name, int rows, int cols) {
    snprintf(L->name[L->n], sizeof L->name[0], "%s", name);
    L->rows[L->n] = rows;
    L->cols[L->n++] = cols;
}
static int layout_find(const layout *L, const char *name) {
    for (int k = 0; k < L->n; k++)
        if (!strcmp(L->name[k], name)) return k;
    return -1;
}
/* The residual net: 0,1 stem; 2+4k .. 5+4k block k's fc1 w,b (HID -> FF)
   and fc2 w,b (FF -> HID); 26,27 head. */
static void resnet_layout(layout *L, bool nested) {
    char nm[48];
    L->n = 0;
    layout_add(L, "stem.weight", HID, IN);
    layout_add(L, "stem.bias", HID, 0);
    for (int k = 0; k < NBLK; k++)
        for (int l = 1; l <= 2; l++) {
            snprintf(nm, sizeof nm, "blocks.%d.%sfc%d.weight", k, nested ? "mlp." : "", l);
            layout_add(L, nm, l == 1 ? FF : HID, l == 1 ? HID : FF);
            snprintf(nm, sizeof nm, "blocks.%d.%sfc%d.bias", k, nested ? "mlp." : "", l);
            layout_add(L, nm, l == 1 ? FF : HID, 0);
        }
    layout_add(L, "head.weight", CLS, HID);
    layout_add(L, "head.bias", CLS, 0);
}
static void fan_layout(layout *L) {
    L->n = 0;
    layout_add(L, "fan.weight", NFAN, IN);
    layout_add(L, "fan.bias", NFAN, 0);
    layout_add(L, "join.weight", CLS, NFAN);
    layout_add(L, "join.bias", CLS, 0);
}

/* ---------------------------------------------------------------- the reference: plain C, one process */
typedef struct ref_t {
    float v0[NPMAX][PMAXEL], v[NPMAX][PMAXEL], g[NPMAX][PMAXEL];
    float loss[STEPS][MAXM];
} ref_t;

/* One microbatch of the residual net; adds its gradients into R->g. */
static float ref_resnet_mb(ref_t *R, const float *xi, const float *ti, int n, int m) {
    float h[NBLK + 1][BATCH * HID], a1[NBLK][BATCH * FF], r[NBLK][BATCH * FF], o[BATCH * HID], y[BATCH * CLS],
        gy[BATCH * CLS];
    float gh[BATCH * HID], gr[BATCH * FF], ga[BATCH * FF], gx1[BATCH * HID];
    linear_fwd(xi, R->v[0], R->v[1], h[0], n, IN, HID);
    for (int k = 0; k < NBLK; k++) {
        linear_fwd(h[k], R->v[2 + 4 * k], R->v[3 + 4 * k], a1[k], n, HID, FF);
        for (int e = 0; e < n * FF; e++) r[k][e] = a1[k][e] > 0 ? a1[k][e] : 0;
        linear_fwd(r[k], R->v[4 + 4 * k], R->v[5 + 4 * k], o, n, FF, HID);
        for (int e = 0; e < n * HID; e++) h[k + 1][e] = h[k][e] + o[e];
    }
    linear_fwd(h[NBLK], R->v[4 * NBLK + 2], R->v[4 * NBLK + 3], y, n, HID, CLS);
    float loss = mse(y, ti, gy, n * CLS);
    if (m != 1)
        for (int e = 0; e < n * CLS; e++) gy[e] *= (float)(1.0 / m);
    linear_bwd(h[NBLK], R->v[4 * NBLK + 2], gy, gh, R->g[4 * NBLK + 2], R->g[4 * NBLK + 3], n, HID, CLS);
    for (int k = NBLK - 1; k >= 0; k--) {
        /* gh: the gradient of the block's output; the add hands it to both of its inputs */
        linear_bwd(r[k], R->v[4 + 4 * k], gh, gr, R->g[4 + 4 * k], R->g[5 + 4 * k], n, FF, HID);
        for (int e = 0; e < n * FF; e++) ga[e] = a1[k][e] > 0 ? gr[e] : 0;
        linear_bwd(h[k], R->v[2 + 4 * k], ga, gx1, R->g[2 + 4 * k], R->g[3 + 4 * k], n, HID, FF);
        /* the block input feeds fc1 and then the add: the later consumer's contribution first */
        for (int e = 0; e < n * HID; e++) gh[e] = gh[e] + gx1[e];
    }
    linear_bwd(xi, R->v[0], gh, NULL, R->g[0], R->g[1], n, IN, HID);
    return loss;
}

/* One microbatch of the fan net: x -> fan (IN -> NFAN) -> join (NFAN -> CLS). */
static float ref_fan_mb(ref_t *R, const float *xi, const float *ti, int n, int m) {
    float h[BATCH * NFAN], gh[BATCH * NFAN], y[BATCH * CLS], gy[BATCH * CLS];
    linear_fwd(xi, R->v[0], R->v[1], h, n, IN, NFAN);
    linear_fwd(h, R->v[2], R->v[3], y, n, NFAN, CLS);
    float loss = mse(y, ti, gy, n * CLS);
    if (m != 1)
        for (int e = 0; e < n * CLS; e++) gy[e] *= (float)(1.0 / m);
    linear_bwd(h, R->v[2], gy, gh, R->g[2], R->g[3], n, NFAN, CLS);
    linear_bwd(xi, R->v[0], gh, NULL, R->g[0], R->g[1], n, IN, NFAN);
    return loss;
}

/* Initial values by name (smp_param_seed needs the config's seed: call
   after smp_init), then `steps` steps of m microbatches, each followed by
   SGD when sgd is set (else the gradients of the one step stay in R->g). */
static void ref_run(ref_t *R, const layout *L, bool fan, int m, int steps, bool sgd_on) {
    memset(R, 0, sizeof *R);
    for (int k = 0; k < L->n; k++) {
        smp_tensor t = L->cols[k] ? smp_tensor_2d(R->v0[k], SMP_F32, L->rows[k], L->cols[k])
                                  : smp_tensor_1d(R->v0[k], SMP_F32, L->rows[k]);
        smp_init_uniform(&t, smp_param_seed(L->name[k]), NULL);
    }
    memcpy(R->v, R->v0, sizeof R->v);
    int n = BATCH / m;
    for (int s = 0; s < steps; s++) {
        memset(R->g, 0, sizeof R->g);
        for (int i = 0; i < m; i++) {
            const float *xi = g_x + i * n * IN, *ti = g_t + i * n * CLS;
            R->loss[s][i] = fan ? ref_fan_mb(R, xi, ti, n, m) : ref_resnet_mb(R, xi, ti, n, m);
        }
        if (sgd_on)
            for (int k = 0; k < L->n; k++) sgd(R->v[k], R->g[k], numel_of(L, k));
    }
}

/* ---------------------------------------------------------------- modules */
enum {
    ERR_NONE,
    ERR_EDIT_MODEL,
    ERR_EDIT_OUTPUT,
    ERR_EDIT_COMPOSITE,
    ERR_COMPOSITE_BACKWARD,
    ERR_OWN_OUTPUT,
    ERR_FOREIGN_INPUT
};
enum { ERR_BLOCK = 1, EDIT_BLOCK = 2 }; /* the block that misbehaves */
static int g_err;
static long g_lin_fwd; /* leaf linear forwards outside tracing */

typedef struct lin_state { smp_param *w, *b; int in, out; } lin_state;

static smp_status lin_forward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    if (!x || x->ndim != 2 || x->shape[1] != s->in)
        return smp_error(SMP_ERR_MODULE, "linear %s: wrong input", smp_module_name(smp_call_module(c)));
    int64_t n = x->shape[0], shape[2] = {n, s->out};
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, shape);
    if (!y) return smp_error(SMP_ERR_NOMEM, "linear: no output");
    linear_fwd((const float *)x->data, (const float *)smp_param_value(s->w)->data,
               (const float *)smp_param_value(s->b)->data, (float *)y->data, (int)n, s->in, s->out);
    if (!smp_is_tracing()) g_lin_fwd++;
    return SMP_OK;
}
static smp_status lin_backward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *gx = smp_call_grad_input(c, 0);
    linear_bwd((const float *)x->data, (const float *)smp_param_value(s->w)->data,
               (const float *)smp_call_grad_output(c, 0)->data, gx ? (float *)gx->data : NULL,
               (float *)smp_param_grad(s->w)->data, (float *)smp_param_grad(s->b)->data, (int)x->shape[0], s->in,
               s->out);
    return SMP_OK;
}
static smp_status relu_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    if (!y) return smp_error(SMP_ERR_NOMEM, "relu: no output");
    for (int64_t i = 0; i < smp_tensor_numel(x); i++)
        ((float *)y->data)[i] = ((const float *)x->data)[i] > 0 ? ((const float *)x->data)[i] : 0;
    return SMP_OK;
}
static smp_status relu_backward(smp_call_ctx *c) {
    const float *x = (const float *)smp_call_input(c, 0)->data, *gy = (const float *)smp_call_grad_output(c, 0)->data;
    smp_tensor *gx = smp_call_grad_input(c, 0);
    for (int64_t i = 0; gx && i < smp_tensor_numel(gx); i++) ((float *)gx->data)[i] = x[i] > 0 ? gy[i] : 0;
    return SMP_OK;
}
static const smp_module_desc relu_desc = {relu_forward, relu_backward, NULL};

/* Dropout with p = 1/2 (kept values doubled, exactly): the mask is drawn
   from smp_call_seed and stashed for the backward. What each forward saw
   is noted per step, block and microbatch. */
typedef struct drop_state { int block; } drop_state;
static int g_step;
static uint64_t g_seeds[STEPS][NBLK][MAXM];
static unsigned char g_seed_set[STEPS][NBLK][MAXM];
static int g_seed_mismatch;
static long g_drop_fwd, g_drop_zero, g_drop_kept;

static smp_status drop_forward(smp_call_ctx *c) {
    const drop_state *s = (const drop_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    int64_t n = smp_tensor_numel(x);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    unsigned char *mask = (unsigned char *)smp_call_stash(c, (size_t)n);
    if (!y || !mask) return smp_error(SMP_ERR_NOMEM, "dropout: no memory");
    uint64_t seed = smp_call_seed(c), state = seed;
    long zero = 0;
    for (int64_t i = 0; i < n; i++) {
        mask[i] = smp_rng_uniform(&state) >= 0.5;
        ((float *)y->data)[i] = mask[i] ? ((const float *)x->data)[i] * 2.0f : 0.0f;
        zero += !mask[i];
    }
    int mb = smp_call_microbatch(c);
    if (!smp_is_tracing() && g_step >= 0 && g_step < STEPS && mb >= 0 && mb < MAXM) {
        g_drop_fwd++;
        g_drop_zero += zero;
        g_drop_kept += n - zero;
        if (g_seed_set[g_step][s->block][mb] && g_seeds[g_step][s->block][mb] != seed) g_seed_mismatch++;
        g_seeds[g_step][s->block][mb] = seed;
        g_seed_set[g_step][s->block][mb] = 1;
    }
    return SMP_OK;
}
static smp_status drop_backward(smp_call_ctx *c) {
    size_t bytes = 0;
    const unsigned char *mask = (const unsigned char *)smp_call_stashed(c, &bytes);
    const float *gy = (const float *)smp_call_grad_output(c, 0)->data;
    smp_tensor *gx = smp_call_grad_input(c, 0);
    if (!gx) return SMP_OK;
    if (!mask || bytes != (size_t)smp_tensor_numel(gx))
        return smp_error(SMP_ERR_MODULE, "dropout: the stashed mask is missing (%zu bytes)", bytes);
    for (int64_t i = 0; i < smp_tensor_numel(gx); i++) ((float *)gx->data)[i] = mask[i] ? gy[i] * 2.0f : 0.0f;
    return SMP_OK;
}

/* A block: x -> fc1 -> relu (-> drop) -> fc2 -> add(x, .), or x -> mlp ->
   add(x, .) where mlp is itself a composite (fc1 -> relu -> fc2 -> identity). */
typedef struct block_t { int index; smp_module *fc1, *relu, *drop, *fc2, *ident, *mlp, *add; } block_t;

static smp_status mlp_forward(smp_call_ctx *c) {
    block_t *b = (block_t *)smp_module_user(smp_call_module(c));
    smp_tensor x = *smp_call_input(c, 0), a, r, o, y;
    SMP_TRY(smp_call(b->fc1, &x, 1, &a, 1));
    SMP_TRY(smp_call(b->relu, &a, 1, &r, 1));
    SMP_TRY(smp_call(b->fc2, &r, 1, &o, 1));
    SMP_TRY(smp_call(b->ident, &o, 1, &y, 1));
    return smp_call_set_output(c, 0, &y);
}

static smp_status block_forward(smp_call_ctx *c) {
    block_t *b = (block_t *)smp_module_user(smp_call_module(c));
    smp_tensor x = *smp_call_input(c, 0), a, r, d, o, y;
    if (b->mlp) SMP_TRY(smp_call(b->mlp, &x, 1, &o, 1));
    else {
        if (g_err == ERR_FOREIGN_INPUT && b->index == ERR_BLOCK) {
            /* a copy of the input made here, not by any smp_call */
            smp_tensor copy = x;
            copy.data = malloc(smp_tensor_nbytes(&x));
            if (!copy.data) return smp_error(SMP_ERR_NOMEM, "test: no memory");
            memcpy(copy.data, x.data, smp_tensor_nbytes(&x));
            smp_status st = smp_call(b->fc1, &copy, 1, &a, 1);
            free(copy.data);
            if (st) return st;
        } else
            SMP_TRY(smp_call(b->fc1, &x, 1, &a, 1));
        if (g_err == ERR_EDIT_COMPOSITE && b->index == EDIT_BLOCK)
            ((float *)a.data)[0] = ((float *)a.data)[0] * 2.0f + 1.0f;
        SMP_TRY(smp_call(b->relu, &a, 1, &r, 1));
        if (b->drop) {
            SMP_TRY(smp_call(b->drop, &r, 1, &d, 1));
            r = d;
        }
        SMP_TRY(smp_call(b->fc2, &r, 1, &o, 1));
    }
    smp_tensor pair[2] = {x, o};
    SMP_TRY(smp_call(b->add, pair, 2, &y, 1));
    if (g_err == ERR_OWN_OUTPUT && b->index == ERR_BLOCK) {
        /* arithmetic in a composite: an output of its own, computed here */
        smp_tensor *own = smp_call_output(c, 0, SMP_F32, y.ndim, y.shape);
        if (!own) return SMP_ERR_MODULE;
        for (int64_t i = 0; i < smp_tensor_numel(&y); i++) ((float *)own->data)[i] = ((const float *)y.data)[i] * 0.5f;
        return SMP_OK;
    }
    return smp_call_set_output(c, 0, &y);
}
static smp_status block_backward(smp_call_ctx *c) { /* a composite must not have one */
    for (int i = 0; i < smp_call_num_inputs(c); i++) {
        smp_tensor *g = smp_call_grad_input(c, i);
        if (g) memcpy(g->data, smp_call_grad_output(c, 0)->data, smp_tensor_nbytes(g));
    }
    return SMP_OK;
}

/* The 100-output fan (IN -> NFAN, one [n, 1] tensor per unit) and the
   100-input join (NFAN -> CLS): the same products as two linears. */
static smp_status fan_forward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    if (smp_call_num_outputs(c) != NFAN)
        return smp_error(SMP_ERR_MODULE, "fan: %d outputs, expected %d", smp_call_num_outputs(c), NFAN);
    int n = (int)x->shape[0];
    float tmp[BATCH * NFAN];
    linear_fwd((const float *)x->data, (const float *)smp_param_value(s->w)->data,
               (const float *)smp_param_value(s->b)->data, tmp, n, IN, NFAN);
    int64_t shape[2] = {n, 1};
    for (int j = 0; j < NFAN; j++) {
        smp_tensor *y = smp_call_output(c, j, SMP_F32, 2, shape);
        if (!y) return smp_error(SMP_ERR_NOMEM, "fan: no output %d", j);
        for (int r = 0; r < n; r++) ((float *)y->data)[r] = tmp[r * NFAN + j];
    }
    return SMP_OK;
}
static smp_status fan_backward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    int n = (int)x->shape[0];
    float gy[BATCH * NFAN];
    for (int j = 0; j < NFAN; j++)
        for (int r = 0; r < n; r++) gy[r * NFAN + j] = ((const float *)smp_call_grad_output(c, j)->data)[r];
    smp_tensor *gx = smp_call_grad_input(c, 0);
    linear_bwd((const float *)x->data, (const float *)smp_param_value(s->w)->data, gy, gx ? (float *)gx->data : NULL,
               (float *)smp_param_grad(s->w)->data, (float *)smp_param_grad(s->b)->data, n, IN, NFAN);
    return SMP_OK;
}
static void join_gather(smp_call_ctx *c, float *h, int n) {
    for (int j = 0; j < NFAN; j++)
        for (int r = 0; r < n; r++) h[r * NFAN + j] = ((const float *)smp_call_input(c, j)->data)[r];
}
static smp_status join_forward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    if (smp_call_num_inputs(c) != NFAN)
        return smp_error(SMP_ERR_MODULE, "join: %d inputs, expected %d", smp_call_num_inputs(c), NFAN);
    int n = (int)smp_call_input(c, 0)->shape[0];
    float h[BATCH * NFAN];
    join_gather(c, h, n);
    int64_t shape[2] = {n, CLS};
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, shape);
    if (!y) return smp_error(SMP_ERR_NOMEM, "join: no output");
    linear_fwd(h, (const float *)smp_param_value(s->w)->data, (const float *)smp_param_value(s->b)->data,
               (float *)y->data, n, NFAN, CLS);
    return SMP_OK;
}
static smp_status join_backward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    int n = (int)smp_call_input(c, 0)->shape[0];
    float h[BATCH * NFAN], gh[BATCH * NFAN];
    join_gather(c, h, n);
    linear_bwd(h, (const float *)smp_param_value(s->w)->data, (const float *)smp_call_grad_output(c, 0)->data, gh,
               (float *)smp_param_grad(s->w)->data, (float *)smp_param_grad(s->b)->data, n, NFAN, CLS);
    for (int j = 0; j < NFAN; j++) {
        smp_tensor *g = smp_call_grad_input(c, j);
        if (g)
            for (int r = 0; r < n; r++) ((float *)g->data)[r] = gh[r * NFAN + j];
    }
    return SMP_OK;
}

/* ---------------------------------------------------------------- the networks */
enum { V_FLAT, V_COMPOSITE, V_NESTED, V_DROPOUT, V_FAN };
static const char *const variant_name[] = {"flat", "composite", "nested", "dropout", "fan"};
enum { PL_AUTO, PL_CONTIG, PL_ALT, PL_VEE };
static const char *const place_name[] = {"auto", "manual", "manual alternating", "manual V"};
enum { RC_NONE, RC_BLOCKS, RC_INNER, RC_CONFIG };
static const char *const rc_name[] = {"", "/recompute every block", "/recompute the inner MLPs",
                                      "/activation_checkpointing on"};

typedef struct spec {
    int variant, P, m, vs, place, recompute, err;
    smp_pipeline_kind kind;
    int steps;
    bool sgd;
    bool trace_in_step; /* no smp_model_trace first: the first step traces */
} spec;

/* the usual case: one virtual stage, no recomputation, no planted error, STEPS steps of SGD, traced first */
static spec plain_spec(int variant, int P, int m, int place, smp_pipeline_kind kind) {
    return (spec){.variant = variant, .P = P, .m = m, .vs = 1, .place = place, .recompute = RC_NONE,
                  .err = ERR_NONE, .kind = kind, .steps = STEPS, .sgd = true};
}

typedef struct net_t {
    int variant;
    smp_module *root, *blocks, *stem, *head, *fan, *join;
    smp_module *blk[NBLK];
    block_t bt[NBLK];
    lin_state lin[NLIN]; /* stem, fc1 and fc2 of every block, head (fan, join: 0 and 1) */
    drop_state ds[NBLK];
} net_t;

/* Partition of top-level position q (0 the stem, 1..6 the blocks, 7 the head). */
static int place_of(int place, int P, int q) {
    static const int contig2[8] = {0, 0, 0, 0, 1, 1, 1, 1}, contig4[8] = {0, 0, 1, 2, 2, 3, 3, 3};
    static const int alt2[8] = {0, 0, 1, 1, 0, 0, 1, 1}, alt4[8] = {0, 1, 2, 3, 0, 1, 2, 3};
    static const int vee2[8] = {0, 0, 1, 1, 1, 1, 0, 0}, vee4[8] = {0, 1, 2, 3, 3, 2, 1, 0}; /* zero_bubble_v */
    if (P == 1) return 0;
    if (place == PL_ALT) return P == 2 ? alt2[q] : alt4[q];
    if (place == PL_VEE) return P == 2 ? vee2[q] : vee4[q];
    return P == 2 ? contig2[q] : contig4[q];
}
static void push(const spec *s, int q) {
    if (s->place != PL_AUTO)
        smp_partition_push(s->variant == V_FAN ? (q == 0 ? 0 : s->P - 1) : place_of(s->place, s->P, q));
}
static void pop(const spec *s) {
    if (s->place != PL_AUTO) smp_partition_pop();
}

static smp_module *new_lin(smp_module *parent, const char *name, lin_state *st, int in, int out, smp_module_fn f,
                           smp_module_fn b) {
    st->in = in;
    st->out = out;
    smp_module_desc d = {f ? f : lin_forward, b ? b : lin_backward, st};
    smp_module *m = smp_module_new(parent, name, &d);
    int64_t ws[2] = {out, in}, bs[1] = {out};
    st->w = smp_param_new(m, "weight", SMP_F32, 2, ws, smp_init_uniform, NULL);
    st->b = smp_param_new(m, "bias", SMP_F32, 1, bs, smp_init_uniform, NULL);
    return m;
}

static void build(net_t *n, const spec *s) {
    memset(n, 0, sizeof *n);
    n->variant = s->variant;
    n->root = smp_module_new(NULL, "", NULL);
    if (s->variant == V_FAN) {
        push(s, 0);
        n->fan = new_lin(n->root, "fan", &n->lin[0], IN, NFAN, fan_forward, fan_backward);
        pop(s);
        push(s, 1);
        n->join = new_lin(n->root, "join", &n->lin[1], NFAN, CLS, join_forward, join_backward);
        pop(s);
        return;
    }
    push(s, 0);
    n->stem = new_lin(n->root, "stem", &n->lin[0], IN, HID, NULL, NULL);
    pop(s);
    n->blocks = smp_module_new(n->root, "blocks", NULL);
    for (int k = 0; k < NBLK; k++) {
        char nm[16];
        snprintf(nm, sizeof nm, "%d", k);
        block_t *b = &n->bt[k];
        b->index = k;
        push(s, k + 1);
        /* flat: "blocks.k" only names its children, which the model forward calls itself */
        smp_module_desc bd = {block_forward, s->err == ERR_COMPOSITE_BACKWARD && k == ERR_BLOCK ? block_backward : NULL,
                              b};
        smp_module *bm = n->blk[k] = smp_module_new(n->blocks, nm, s->variant == V_FLAT ? NULL : &bd), *host = bm;
        if (s->variant == V_NESTED) {
            smp_module_desc md = {mlp_forward, NULL, b};
            host = b->mlp = smp_module_new(bm, "mlp", &md);
        }
        b->fc1 = new_lin(host, "fc1", &n->lin[1 + 2 * k], HID, FF, NULL, NULL);
        b->relu = smp_module_new(host, "relu", &relu_desc);
        if (s->variant == V_DROPOUT) {
            n->ds[k].block = k;
            smp_module_desc dd = {drop_forward, drop_backward, &n->ds[k]};
            b->drop = smp_module_new(host, "drop", &dd);
        }
        b->fc2 = new_lin(host, "fc2", &n->lin[2 + 2 * k], FF, HID, NULL, NULL);
        if (s->variant == V_NESTED) b->ident = smp_module_new_identity(host, "out");
        b->add = smp_module_new_add(bm, "add");
        if (s->recompute == RC_BLOCKS) smp_module_set_recompute(bm, true);
        if (s->recompute == RC_INNER && b->mlp) smp_module_set_recompute(b->mlp, true);
        pop(s);
    }
    push(s, NBLK + 1);
    n->head = new_lin(n->root, "head", &n->lin[NLIN - 1], HID, CLS, NULL, NULL);
    pop(s);
}

static smp_status resnet_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m;
    (void)nin;
    (void)nout;
    net_t *n = (net_t *)user;
    smp_tensor h, a, r, o, y;
    SMP_TRY(smp_call(n->stem, &in[0], 1, &h, 1));
    if (g_err == ERR_EDIT_MODEL)
        ((float *)h.data)[0] = ((float *)h.data)[0] * 2.0f + 1.0f; /* an in-place edit of "stem"'s output */
    for (int k = 0; k < NBLK; k++) {
        if (n->variant == V_FLAT) {
            block_t *b = &n->bt[k];
            SMP_TRY(smp_call(b->fc1, &h, 1, &a, 1));
            SMP_TRY(smp_call(b->relu, &a, 1, &r, 1));
            SMP_TRY(smp_call(b->fc2, &r, 1, &o, 1));
            smp_tensor pair[2] = {h, o};
            SMP_TRY(smp_call(b->add, pair, 2, &y, 1));
        } else
            SMP_TRY(smp_call(n->blk[k], &h, 1, &y, 1));
        h = y;
    }
    SMP_TRY(smp_call(n->head, &h, 1, &out[0], 1));
    /* no call reads it: seen after the forward */
    if (g_err == ERR_EDIT_OUTPUT) ((float *)out[0].data)[0] = ((float *)out[0].data)[0] * 2.0f + 1.0f;
    return SMP_OK;
}
static smp_status fan_model_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout,
                                    void *user) {
    (void)m;
    (void)nin;
    (void)nout;
    net_t *n = (net_t *)user;
    smp_tensor mid[NFAN];
    SMP_TRY(smp_call(n->fan, &in[0], 1, mid, NFAN));
    return smp_call(n->join, mid, NFAN, &out[0], 1);
}

SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    float loss =
        mse((const float *)y->data, (const float *)t->data, g ? (float *)g->data : NULL, (int)smp_tensor_numel(y));
    return smp_mb_return_f32(mb, 0, loss);
}

/* ---------------------------------------------------------------- one run */
static ref_t g_R; /* the reference of the last run */

typedef struct result {
    int ok;
    char why[2048];
    smp_status st;     /* of the trace and steps */
    char err[2048];    /* smp_last_error() when st is not OK */
    float loss[STEPS][MAXM];
    bool local[NPMAX];
    float init[NPMAX][PMAXEL], fin[NPMAX][PMAXEL], grad[NPMAX][PMAXEL];
    int64_t stash_peak;
    int max_inflight; /* the most microbatches any stage of this rank held */
    long lin_fwd, drop_fwd;
    int local_block_lins, local_other_lins, local_drops, local_blocks;
    int part[NBLK + 2]; /* partition of the stem, the blocks and the head */
} result;

static void fail(result *r, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void fail(result *r, const char *fmt, ...) {
    if (!r->ok) return; /* keep the first reason */
    r->ok = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->why, sizeof r->why, fmt, ap);
    va_end(ap);
}

static void layout_for(const spec *s, layout *L) {
    if (s->variant == V_FAN) fan_layout(L);
    else resnet_layout(L, s->variant == V_NESTED);
}

/* Runs spec s on comm (exactly s->P ranks): trace, then s->steps steps on
   the whole batch with SGD after each (when s->sgd). */
static void run(const spec *s, MPI_Comm comm, result *r) {
    layout L;
    layout_for(s, &L);
    memset(r, 0, sizeof *r);
    r->ok = 1;
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.partitions = s->P;
    cfg.microbatches = s->m;
    cfg.pipeline = s->kind;
    cfg.ddp = SMP_OFF;
    cfg.virtual_stages = s->vs;
    cfg.seed = 2025;
    cfg.comm = comm;
    cfg.timeout = 120;
    cfg.auto_partition = s->place == PL_AUTO ? SMP_ON : SMP_OFF;
    if (s->recompute == RC_CONFIG) cfg.activation_checkpointing = SMP_ON;
    g_err = s->err;
    g_lin_fwd = g_drop_fwd = g_drop_zero = g_drop_kept = 0;
    g_seed_mismatch = 0;
    g_step = -1;
    memset(g_seed_set, 0, sizeof g_seed_set);
    smp_status st = smp_init(&cfg);
    if (st) {
        r->st = st;
        snprintf(r->err, sizeof r->err, "%s", smp_last_error());
        fail(r, "smp_init: %s", smp_last_error());
        g_err = ERR_NONE;
        return;
    }
    /* the reference, while smp_param_seed knows the config's seed */
    if (s->variant != V_DROPOUT) ref_run(&g_R, &L, s->variant == V_FAN, s->m, s->steps, s->sgd);
    net_t *n = (net_t *)calloc(1, sizeof *n);
    build(n, s);
    smp_model_desc md = {s->variant == V_FAN ? fan_model_forward : resnet_forward, 1, 1, n, false};
    smp_model *model = NULL;
    st = smp_model_new(n->root, &md, &model);
    int rows = BATCH / s->m;
    if (!st && !s->trace_in_step) {
        smp_tensor xs = smp_tensor_2d(g_x, SMP_F32, rows, IN);
        st = smp_model_trace(model, &xs, 1);
    }
    smp_param *p;
    if (!st && !s->trace_in_step) {
        for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
            int k = layout_find(&L, smp_param_name(p));
            if (k < 0) { fail(r, "unexpected local parameter \"%s\"", smp_param_name(p)); continue; }
            if (r->local[k]) fail(r, "parameter \"%s\" listed twice", L.name[k]);
            if (smp_tensor_numel(smp_param_value(p)) != numel_of(&L, k) || !smp_param_value(p)->data ||
                !smp_param_grad(p)->data) {
                fail(r, "parameter \"%s\" has %lld elements (expected %d) or no storage", L.name[k],
                     (long long)smp_tensor_numel(smp_param_value(p)), numel_of(&L, k));
                continue;
            }
            r->local[k] = true;
            memcpy(r->init[k], smp_param_value(p)->data, sizeof(float) * (size_t)numel_of(&L, k));
        }
        if (s->variant != V_FAN) {
            for (int l = 0; l < NLIN; l++) {
                smp_module *lm = l == 0          ? n->stem
                                 : l == NLIN - 1 ? n->head
                                 : l % 2         ? n->bt[(l - 1) / 2].fc1
                                                 : n->bt[(l - 1) / 2].fc2;
                if (!smp_module_is_local(lm)) continue;
                if (l == 0 || l == NLIN - 1) r->local_other_lins++;
                else r->local_block_lins++;
            }
            for (int k = 0; k < NBLK; k++) {
                r->local_drops += n->bt[k].drop && smp_module_is_local(n->bt[k].drop);
                r->local_blocks += smp_module_is_local(n->bt[k].fc1);
                r->part[k + 1] = smp_module_partition(n->bt[k].fc1);
            }
            r->part[0] = smp_module_partition(n->stem);
            r->part[NBLK + 1] = smp_module_partition(n->head);
        }
    }
    for (int step = 0; step < s->steps && !st; step++) {
        smp_step_output outs[1];
        memset(outs, 0, sizeof outs);
        smp_tensor x = smp_tensor_2d(g_x, SMP_F32, BATCH, IN), t = smp_tensor_2d(g_t, SMP_F32, BATCH, CLS);
        g_step = step;
        st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x, t);
        g_step = -1;
        if (!st) {
            if (outs[0].microbatches != s->m)
                fail(r, "step %d returned %d losses, expected %d", step, outs[0].microbatches, s->m);
            for (int i = 0; i < s->m && i < outs[0].microbatches; i++)
                r->loss[step][i] = ((const float *)outs[0].values[i].data)[0];
            smp_step_stats ss = smp_last_step_stats(model);
            if (ss.stash_peak_bytes > r->stash_peak) r->stash_peak = ss.stash_peak_bytes;
            for (int k = 0; k < ss.local_stages; k++)
                if (ss.peak_inflight[k] > r->max_inflight) r->max_inflight = ss.peak_inflight[k];
        }
        smp_step_output_free(&outs[0]);
        if (!st && s->sgd) {
            for (int i = 0; (p = smp_model_local_param(model, i, false)); i++)
                sgd((float *)smp_param_value(p)->data, (const float *)smp_param_grad(p)->data,
                    (int)smp_tensor_numel(smp_param_value(p)));
            smp_model_zero_grad(model);
        }
    }
    if (!st)
        for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
            int k = layout_find(&L, smp_param_name(p));
            if (k < 0 || !r->local[k]) continue;
            memcpy(r->fin[k], smp_param_value(p)->data, sizeof(float) * (size_t)numel_of(&L, k));
            memcpy(r->grad[k], smp_param_grad(p)->data, sizeof(float) * (size_t)numel_of(&L, k));
        }
    r->st = st;
    if (st) {
        snprintf(r->err, sizeof r->err, "%s", smp_last_error());
        fail(r, "%s", smp_last_error());
    }
    r->lin_fwd = g_lin_fwd;
    r->drop_fwd = g_drop_fwd;
    smp_model_free(model);
    smp_finalize();
    free(n);
    g_err = ERR_NONE;
}

/* ---------------------------------------------------------------- checks */
static MPI_Comm g_group[5];
static bool g_in_group[5];

static bool fits(int P) { return P <= g_world && g_world % P == 0; }

/* One SKIP line per kind of check and partition count the world cannot run. */
static void skip_once(const char *what, int P) {
    static char seen[32][96];
    static int nseen;
    char key[96], why[96];
    snprintf(key, sizeof key, "%s/P=%d", what, P);
    for (int i = 0; i < nseen; i++)
        if (!strcmp(seen[i], key)) return;
    if (nseen < 32) snprintf(seen[nseen++], sizeof seen[0], "%s", key);
    snprintf(why, sizeof why, "needs a world of a multiple of %d ranks (this one has %d)", P, g_world);
    if (g_rank == 0) test_skip(key, why);
}

static const char *kind_name(smp_pipeline_kind k) {
    return k == SMP_PIPELINE_SIMPLE          ? "simple"
           : k == SMP_PIPELINE_ZERO_BUBBLE   ? "zero_bubble"
           : k == SMP_PIPELINE_ZERO_BUBBLE_V ? "zero_bubble_v"
                                             : "interleaved";
}

static void spec_name(const spec *s, char *out, size_t cap, const char *what) {
    char vs[32] = "";
    if (s->vs > 1) snprintf(vs, sizeof vs, "/%d virtual stages", s->vs);
    snprintf(out, cap, "%s/P=%d/%s/m=%d/%s%s%s: %s", variant_name[s->variant], s->P, kind_name(s->kind), s->m,
             place_name[s->place], vs, rc_name[s->recompute], what);
}

/* Every parameter on exactly one rank of the group (a collective over the group). */
static void check_coverage(const layout *L, result *r, MPI_Comm comm) {
    int mine[NPMAX], all[NPMAX];
    for (int k = 0; k < L->n; k++) mine[k] = r->local[k];
    MPI_Allreduce(mine, all, L->n, MPI_INT, MPI_SUM, comm);
    int all_ok = 0;
    MPI_Allreduce(&r->ok, &all_ok, 1, MPI_INT, MPI_LAND, comm);
    if (!all_ok) return; /* a run that failed already says why */
    for (int k = 0; k < L->n; k++)
        if (all[k] != 1) {
            fail(r, "parameter \"%s\" is local on %d ranks of the group, expected 1", L->name[k], all[k]);
            return;
        }
}

static int first_diff(const float *a, const float *b, int n) {
    for (int i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4)) return i;
    return -1;
}

/* Losses, initial values and the parameters after training (or the
   gradients of the one step, without SGD) against the reference; every
   parameter moved. */
static void check_ref(const spec *s, const layout *L, result *r, const ref_t *R) {
    if (!r->ok) return;
    for (int step = 0; step < s->steps; step++)
        for (int i = 0; i < s->m; i++)
            if (memcmp(&r->loss[step][i], &R->loss[step][i], 4)) {
                fail(r, "step %d, microbatch %d: loss %.9g, reference %.9g", step, i, r->loss[step][i],
                     R->loss[step][i]);
                return;
            }
    for (int k = 0; k < L->n; k++) {
        if (!r->local[k]) continue;
        int ne = numel_of(L, k), d;
        if ((d = first_diff(r->init[k], R->v0[k], ne)) >= 0) {
            fail(r, "initial %s[%d] = %.9g, but smp_init_uniform seeded by its name gives %.9g", L->name[k], d,
                 r->init[k][d], R->v0[k][d]);
            return;
        }
        if (s->sgd) {
            if ((d = first_diff(r->fin[k], R->v[k], ne)) >= 0) {
                fail(r, "%s[%d] = %.9g after %d steps, reference %.9g (initially %.9g)", L->name[k], d, r->fin[k][d],
                     s->steps, R->v[k][d], R->v0[k][d]);
                return;
            }
            if (first_diff(r->fin[k], r->init[k], ne) < 0) {
                fail(r, "%s did not change in %d steps: its gradient was dropped", L->name[k], s->steps);
                return;
            }
        } else if ((d = first_diff(r->grad[k], R->g[k], ne)) >= 0) {
            fail(r, "gradient of %s[%d] = %.9g, reference %.9g", L->name[k], d, r->grad[k][d], R->g[k][d]);
            return;
        }
    }
}

/* How often the leaf linears ran outside tracing: once per microbatch and
   step, twice where their call is recomputed. */
static void check_forwards(const spec *s, result *r) {
    if (!r->ok || s->variant == V_FAN || s->variant == V_DROPOUT) return;
    long per = (long)s->m * s->steps, lo, hi;
    long blk = r->local_block_lins, oth = r->local_other_lins;
    switch (s->recompute) {
    case RC_BLOCKS: case RC_INNER: lo = hi = (2 * blk + oth) * per; break;
    case RC_CONFIG: /* every top-level call recomputes: a leaf may run once or twice */
        lo = s->variant == V_FLAT ? (blk + oth) * per : (2 * blk + oth) * per;
        hi = 2 * (blk + oth) * per;
        break;
    default: lo = hi = (blk + oth) * per;
    }
    if (r->lin_fwd < lo || r->lin_fwd > hi)
        fail(r, "the %ld local linears ran their forward %ld times in %d steps of %d microbatches, expected %s%ld%s%ld",
             blk + oth, r->lin_fwd, s->steps, s->m, lo == hi ? "" : "between ", lo, lo == hi ? "" : " and ",
             lo == hi ? lo : hi);
}

/* Runs s on its groups and checks it against the reference; returns this
   rank's result (the caller frees it) or NULL when the world cannot run it.
   report: print the check (else the caller reports r->ok). */
static result *run_checked_as(const spec *s, bool report) {
    char name[512];
    spec_name(s, name, sizeof name,
              s->sgd ? "losses and parameters after the steps equal one process, every parameter changed"
                     : "losses and gradients equal one process");
    if (!fits(s->P)) {
        char what[64];
        snprintf(what, sizeof what, "%s%s", variant_name[s->variant], s->recompute ? "/recompute" : "");
        if (report) skip_once(what, s->P);
        return NULL;
    }
    layout L;
    layout_for(s, &L);
    result *r = (result *)calloc(1, sizeof *r);
    if (g_in_group[s->P]) {
        run(s, g_group[s->P], r);
        check_coverage(&L, r, g_group[s->P]);
        if (s->variant != V_DROPOUT) check_ref(s, &L, r, &g_R);
        check_forwards(s, r);
    } else
        r->ok = 1;
    if (report) MPI_CHECK(r->ok, name, "%s", r->why);
    return r;
}
static result *run_checked(const spec *s) { return run_checked_as(s, true); }

/* ---------------------------------------------------------------- 1, 2: the residual net, composite, flat and nested
 */
static const smp_pipeline_kind kinds[2] = {SMP_PIPELINE_SIMPLE, SMP_PIPELINE_INTERLEAVED};

static void test_equivalence(void) {
    static const int Ps[3] = {1, 2, 4}, ms[3] = {1, 2, 4};
    for (int a = 0; a < 3; a++)
        for (int v = 0; v < 2; v++)
            for (int kk = 0; kk < 2; kk++)
                for (int b = 0; b < 3; b++)
                    for (int pl = PL_AUTO; pl <= (Ps[a] > 1 ? PL_CONTIG : PL_AUTO); pl++) {
                        spec s = plain_spec(v == 0 ? V_COMPOSITE : V_FLAT, Ps[a], ms[b], pl, kinds[kk]);
                        free(run_checked(&s));
                    }
    /* virtual stages: manual 0,1,0,1 (P=2) and 0,1,2,3,0,1,2,3 (P=4), and auto with 2 per rank */
    for (int v = 0; v < 2; v++)
        for (int kk = 0; kk < 2; kk++) {
            for (int b = 1; b < 3; b++) {
                spec s = plain_spec(v == 0 ? V_COMPOSITE : V_FLAT, 2, ms[b], PL_ALT, kinds[kk]);
                free(run_checked(&s));
            }
            spec s4 = plain_spec(v == 0 ? V_COMPOSITE : V_FLAT, 4, 4, PL_ALT, kinds[kk]);
            free(run_checked(&s4));
        }
    for (int v = 0; v < 2; v++)
        for (int a = 1; a < 3; a++) {
            spec s = plain_spec(v == 0 ? V_COMPOSITE : V_FLAT, Ps[a], 4, PL_AUTO, SMP_PIPELINE_INTERLEAVED);
            s.vs = 2;
            free(run_checked(&s));
        }
    /* zero_bubble: manual placement (auto with one partition), then 0,1,0,1 and
       0,1,2,3,0,1,2,3 virtual stages */
    for (int a = 0; a < 3; a++)
        for (int v = 0; v < 2; v++)
            for (int b = 0; b < 3; b++) {
                spec s = plain_spec(v == 0 ? V_COMPOSITE : V_FLAT, Ps[a], ms[b], Ps[a] > 1 ? PL_CONTIG : PL_AUTO,
                                    SMP_PIPELINE_ZERO_BUBBLE);
                free(run_checked(&s));
            }
    for (int a = 1; a < 3; a++) {
        spec s = plain_spec(V_COMPOSITE, Ps[a], 4, PL_ALT, SMP_PIPELINE_ZERO_BUBBLE);
        free(run_checked(&s));
    }
    /* zero_bubble_v: 2P stages in a V, auto and manual (P = 1: one run cut in two) */
    for (int a = 0; a < 3; a++)
        for (int v = 0; v < 2; v++)
            for (int b = 0; b < 3; b++)
                for (int pl = 0; pl < 2; pl++) {
                    spec s = plain_spec(v == 0 ? V_COMPOSITE : V_FLAT, Ps[a], ms[b], pl ? PL_VEE : PL_AUTO,
                                        SMP_PIPELINE_ZERO_BUBBLE_V);
                    free(run_checked(&s));
                }
}

static void test_nested(void) {
    static const int Ps[3] = {1, 2, 4}, ms[2] = {1, 4};
    for (int a = 0; a < 3; a++)
        for (int kk = 0; kk < 2; kk++)
            for (int b = 0; b < 2; b++)
                for (int pl = PL_AUTO; pl <= (Ps[a] > 1 ? PL_CONTIG : PL_AUTO); pl++) {
                    spec s = plain_spec(V_NESTED, Ps[a], ms[b], pl, kinds[kk]);
                    free(run_checked(&s));
                }
    for (int a = 1; a < 3; a++) {
        spec s = plain_spec(V_NESTED, Ps[a], 4, PL_CONTIG, SMP_PIPELINE_ZERO_BUBBLE);
        free(run_checked(&s));
    }
    for (int a = 0; a < 3; a++) {
        spec s = plain_spec(V_NESTED, Ps[a], 4, PL_VEE, SMP_PIPELINE_ZERO_BUBBLE_V);
        free(run_checked(&s));
    }
}

/* ---------------------------------------------------------------- 3: recomputation */
/* Runs the same configuration without and with recomputation: both equal
   the reference, and the peak stash drops: in the whole group, and on every
   rank that holds two recomputed blocks, or one with two microbatches in
   flight (one block of one microbatch is made again in full before its
   backward: nothing to save), when both runs placed the calls alike
   (always with manual placement; auto placement follows traced times).
   The blocks' inner width (FF) makes what recomputation frees several
   times what arrives early from other stages, whose timing varies. */
static void recompute_pair(spec s, int rc) {
    spec plain = s;
    plain.recompute = RC_NONE;
    s.recompute = rc;
    result *a = run_checked_as(&plain, false); /* the same run as in test_equivalence: checked there */
    result *b = run_checked(&s);
    if (!a || !b) { free(a); free(b); return; }
    char name[512];
    spec_name(&s, name, sizeof name, "peak stash lower than without recomputation");
    int ok = 1;
    char why[512] = "";
    if (g_in_group[s.P]) {
        int64_t mine[2] = {a->stash_peak, b->stash_peak}, sum[2];
        MPI_Allreduce(mine, sum, 2, MPI_INT64_T, MPI_SUM, g_group[s.P]);
        bool same_placement = !memcmp(a->part, b->part, sizeof a->part);
        if (!a->ok || !b->ok) { ok = 0; snprintf(why, sizeof why, "%.480s", !a->ok ? a->why : b->why);
        } else if (same_placement && (b->local_blocks > 1 || (b->local_blocks == 1 && b->max_inflight > 1)) &&
                   !(b->stash_peak < a->stash_peak)) {
            ok = 0;
            snprintf(why, sizeof why,
                     "this rank's peak stash (%d of the blocks, up to %d microbatches in flight) is %lld bytes with "
                     "recomputation, %lld without",
                     b->local_blocks, b->max_inflight, (long long)b->stash_peak, (long long)a->stash_peak);
        } else if (!(sum[1] < sum[0])) {
            ok = 0;
            snprintf(why, sizeof why, "the group's peak stash is %lld bytes with recomputation, %lld without",
                     (long long)sum[1], (long long)sum[0]);
        }
    }
    MPI_CHECK(ok, name, "%s", why);
    free(a);
    free(b);
}

static void test_recompute(void) {
    static const int Ps[3] = {1, 2, 4};
    for (int a = 0; a < 3; a++)
        for (int kk = 0; kk < 2; kk++)
            for (int pl = PL_AUTO; pl <= (Ps[a] > 1 ? PL_CONTIG : PL_AUTO); pl++)
                for (int c = 0; c < 2; c++) {
                    spec s = plain_spec(V_COMPOSITE, Ps[a], 4, pl, kinds[kk]);
                    recompute_pair(s, c ? RC_CONFIG : RC_BLOCKS);
                }
    /* fewer microbatches, virtual stages: bitwise only */
    for (int a = 0; a < 3; a++)
        for (int m = 1; m <= 2; m++) {
            spec s = plain_spec(V_COMPOSITE, Ps[a], m, Ps[a] > 1 ? PL_CONTIG : PL_AUTO, SMP_PIPELINE_INTERLEAVED);
            s.recompute = RC_BLOCKS;
            free(run_checked(&s));
        }
    for (int a = 1; a < 3; a++) {
        spec s = plain_spec(V_COMPOSITE, Ps[a], 4, PL_ALT, SMP_PIPELINE_INTERLEAVED);
        s.recompute = RC_BLOCKS;
        free(run_checked(&s));
    }
    /* zero_bubble: a recomputed call lets go of what it made again only after its W */
    for (int a = 0; a < 3; a++) {
        spec s = plain_spec(V_COMPOSITE, Ps[a], 4, Ps[a] > 1 ? PL_CONTIG : PL_AUTO, SMP_PIPELINE_ZERO_BUBBLE);
        recompute_pair(s, RC_BLOCKS);
    }
    for (int a = 1; a < 3; a++) {
        spec s = plain_spec(V_COMPOSITE, Ps[a], 4, PL_ALT, SMP_PIPELINE_ZERO_BUBBLE);
        s.recompute = RC_BLOCKS;
        free(run_checked(&s));
    }
    /* zero_bubble_v: the same, two stages per rank in a V */
    for (int a = 0; a < 3; a++) {
        spec s = plain_spec(V_COMPOSITE, Ps[a], 4, PL_VEE, SMP_PIPELINE_ZERO_BUBBLE_V);
        recompute_pair(s, RC_BLOCKS);
    }
    /* two levels: recompute the block (around a composite) or only the inner composite */
    for (int a = 0; a < 3; a++)
        for (int rc = RC_BLOCKS; rc <= RC_INNER; rc++) {
            spec s = plain_spec(V_NESTED, Ps[a], 4, Ps[a] > 1 ? PL_CONTIG : PL_AUTO, SMP_PIPELINE_INTERLEAVED);
            recompute_pair(s, rc);
        }
    /* the config key on a flat model: every leaf recomputes, nothing changes */
    for (int a = 0; a < 3; a++) {
        spec s = plain_spec(V_FLAT, Ps[a], 2, PL_AUTO, SMP_PIPELINE_INTERLEAVED);
        s.recompute = RC_CONFIG;
        free(run_checked(&s));
    }
}

/* ---------------------------------------------------------------- 4: dropout through smp_call_seed */
static void test_dropout(void) {
    static uint64_t base_seeds[STEPS][NBLK][MAXM];
    const int m = 4;
    /* the baseline: one process, no recomputation, on every rank */
    spec b = plain_spec(V_DROPOUT, 1, m, PL_AUTO, SMP_PIPELINE_SIMPLE);
    result *base = run_checked(&b);
    if (!base) return;
    memcpy(base_seeds, g_seeds, sizeof base_seeds);
    int ok = base->ok, distinct = 1;
    char why[512] = "";
    for (int s = 0; s < STEPS; s++)
        for (int k = 0; k < NBLK; k++)
            for (int i = 0; i < m; i++) {
                if (!g_seed_set[s][k][i]) {
                    ok = 0;
                    snprintf(why, sizeof why, "dropout of block %d did not run on microbatch %d of step %d", k, i, s);
                }
                for (int s2 = 0; s2 < STEPS; s2++)
                    for (int k2 = 0; k2 < NBLK; k2++)
                        for (int i2 = 0; i2 < m; i2++)
                            if ((s2 != s || k2 != k || i2 != i) && base_seeds[s][k][i] == base_seeds[s2][k2][i2])
                                distinct = 0;
            }
    if (ok && !distinct) {
        ok = 0;
        snprintf(why, sizeof why, "two (step, call, microbatch) triples got the same smp_call_seed");
    }
    if (ok && (g_drop_zero == 0 || g_drop_kept == 0)) {
        ok = 0;
        snprintf(why, sizeof why, "the masks dropped %ld and kept %ld values", g_drop_zero, g_drop_kept);
    }
    if (!base->ok) snprintf(why, sizeof why, "%.480s", base->why);
    MPI_CHECK(ok,
              "dropout/P=1: smp_call_seed differs for every call, microbatch and step, and the masks drop about half",
              "%s", why);

    struct { int P, place, rc; smp_pipeline_kind kind;
    } cases[] = {
        {1, PL_AUTO, RC_BLOCKS, SMP_PIPELINE_SIMPLE},        {1, PL_AUTO, RC_BLOCKS, SMP_PIPELINE_INTERLEAVED},
        {1, PL_AUTO, RC_CONFIG, SMP_PIPELINE_INTERLEAVED},   {2, PL_AUTO, RC_NONE, SMP_PIPELINE_INTERLEAVED},
        {2, PL_AUTO, RC_BLOCKS, SMP_PIPELINE_INTERLEAVED},   {2, PL_CONTIG, RC_NONE, SMP_PIPELINE_SIMPLE},
        {2, PL_CONTIG, RC_BLOCKS, SMP_PIPELINE_SIMPLE},      {2, PL_ALT, RC_BLOCKS, SMP_PIPELINE_INTERLEAVED},
        {4, PL_AUTO, RC_BLOCKS, SMP_PIPELINE_INTERLEAVED},   {4, PL_CONTIG, RC_NONE, SMP_PIPELINE_SIMPLE},
        {4, PL_CONTIG, RC_BLOCKS, SMP_PIPELINE_INTERLEAVED}, {4, PL_ALT, RC_BLOCKS, SMP_PIPELINE_SIMPLE},
        {2, PL_CONTIG, RC_BLOCKS, SMP_PIPELINE_ZERO_BUBBLE}, {4, PL_ALT, RC_BLOCKS, SMP_PIPELINE_ZERO_BUBBLE},
        {1, PL_AUTO, RC_BLOCKS, SMP_PIPELINE_ZERO_BUBBLE_V}, {2, PL_VEE, RC_BLOCKS, SMP_PIPELINE_ZERO_BUBBLE_V},
        {4, PL_AUTO, RC_BLOCKS, SMP_PIPELINE_ZERO_BUBBLE_V},
    };
    layout L;
    resnet_layout(&L, false);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        spec s = plain_spec(V_DROPOUT, cases[c].P, m, cases[c].place, cases[c].kind);
        s.recompute = cases[c].rc;
        char name[512];
        spec_name(&s, name, sizeof name, "dropout result and seeds equal one process without recomputation");
        if (!fits(s.P)) {
            skip_once("dropout", s.P);
            continue;
        }
        result *r = (result *)calloc(1, sizeof *r);
        r->ok = 1;
        if (g_in_group[s.P]) {
            run(&s, g_group[s.P], r);
            check_coverage(&L, r, g_group[s.P]);
            for (int st = 0; st < STEPS && r->ok; st++)
                for (int i = 0; i < m; i++)
                    if (memcmp(&r->loss[st][i], &base->loss[st][i], 4)) {
                        fail(r, "step %d microbatch %d: loss %.9g, one process %.9g", st, i, r->loss[st][i],
                             base->loss[st][i]);
                        break;
                    }
            for (int k = 0; k < L.n && r->ok; k++) {
                int d;
                if (r->local[k] && (d = first_diff(r->fin[k], base->fin[k], numel_of(&L, k))) >= 0)
                    fail(r, "%s[%d] = %.9g after %d steps, one process %.9g", L.name[k], d, r->fin[k][d], STEPS,
                         base->fin[k][d]);
            }
            for (int st = 0; st < STEPS && r->ok; st++)
                for (int k = 0; k < NBLK; k++)
                    for (int i = 0; i < m; i++)
                        if (g_seed_set[st][k][i] && g_seeds[st][k][i] != base_seeds[st][k][i]) {
                            fail(r, "step %d block %d microbatch %d: smp_call_seed %llx, one process %llx", st, k, i,
                                 (unsigned long long)g_seeds[st][k][i], (unsigned long long)base_seeds[st][k][i]);
                        }
            if (r->ok && g_seed_mismatch)
                fail(r, "the recomputation drew a different smp_call_seed than the forward (%d times)",
                     g_seed_mismatch);
            long want = (long)(s.recompute != RC_NONE ? 2 : 1) * r->local_drops * m * STEPS;
            if (r->ok && r->drop_fwd != want)
                fail(r, "the %d local dropouts ran their forward %ld times, expected %ld (%s)", r->local_drops,
                     r->drop_fwd, want, s.recompute != RC_NONE ? "forward and recomputation" : "no recomputation");
        }
        MPI_CHECK(r->ok, name, "%s", r->why);
        free(r);
    }
    free(base);
}

/* ---------------------------------------------------------------- 5: errors at trace time */
static void test_errors(void) {
    /* expect: the module the message must name; also: a word it must contain */
    struct { int err; const char *expect, *also, *label; bool in_step;
    } cases[] = {
        {ERR_EDIT_MODEL, "stem", "changed",
         "an in-place edit of an smp_call output in the model forward names the call", true},
        {ERR_EDIT_MODEL, "stem", "changed",
         "an in-place edit of an smp_call output in the model forward names the call (smp_model_trace)", false},
        {ERR_EDIT_OUTPUT, "head", "changed",
         "an in-place edit of the model's output after its last call names the call", false},
        {ERR_EDIT_COMPOSITE, "blocks.2.fc1", "changed",
         "an in-place edit of a nested call's output in a composite forward names the call", true},
        {ERR_COMPOSITE_BACKWARD, "blocks.1", "backward", "a composite with a backward of its own is an error naming it",
         false},
        {ERR_OWN_OUTPUT, "blocks.1", "output",
         "a composite that allocates and computes its own output is an error naming it", true},
        {ERR_FOREIGN_INPUT, "blocks.1", "input",
         "a composite passing a child a buffer no smp_call produced is an error naming it", false},
    };
    int Pmax = fits(4) ? 4 : fits(2) ? 2 : 1, Ps[2] = {1, Pmax};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int a = 0; a < (Pmax > 1 ? 2 : 1); a++) {
            int P = Ps[a];
            spec s = plain_spec(V_COMPOSITE, P, 2, PL_AUTO, SMP_PIPELINE_INTERLEAVED);
            s.err = cases[c].err;
            s.steps = 1;
            s.trace_in_step = cases[c].in_step;
            char name[512];
            snprintf(name, sizeof name, "errors/P=%d: %s, on every rank", P, cases[c].label);
            result *r = (result *)calloc(1, sizeof *r);
            int ok = 1;
            if (g_in_group[P]) {
                run(&s, g_group[P], r);
                ok =
                    r->st != SMP_OK && strstr(r->err, cases[c].expect) != NULL && strstr(r->err, cases[c].also) != NULL;
            }
            MPI_CHECK(ok, name, "status %s, message \"%s\" (expected an error naming \"%s\" and saying \"%s\")",
                      smp_status_name(r->st), r->err, cases[c].expect, cases[c].also);
            free(r);
        }
}

/* ---------------------------------------------------------------- 6: 100 tensors across one boundary */
static void test_fan(void) {
    static const int ms[3] = {1, 2, 4};
    for (int b = 0; b < 3; b++) {
        spec one = plain_spec(V_FAN, 1, ms[b], PL_AUTO, SMP_PIPELINE_INTERLEAVED);
        free(run_checked(&one));
        /* zero_bubble_v on one rank: the 100 tensors cross between its two stages in memory */
        spec vee = plain_spec(V_FAN, 1, ms[b], PL_AUTO, SMP_PIPELINE_ZERO_BUBBLE_V);
        free(run_checked(&vee));
        for (int kk = 0; kk < 3; kk++) {
            spec s = plain_spec(V_FAN, 2, ms[b], PL_CONTIG, kk < 2 ? kinds[kk] : SMP_PIPELINE_ZERO_BUBBLE);
            free(run_checked(&s));
        }
    }
}

/* ---------------------------------------------------------------- 7: float64 reference */
static const char *script_path(const char *file) {
    static char path[1024];
    const char *slash = strrchr(__FILE__, '/');
    if (slash) snprintf(path, sizeof path, "%.*s/%s", (int)(slash - __FILE__), __FILE__, file);
    else snprintf(path, sizeof path, "%s", file);
    return path;
}
static int write_bin(const char *dir, const char *name, const char *suffix, const float *v, int n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s%s", dir, name, suffix);
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fwrite(v, sizeof(float), (size_t)n, f) == (size_t)n;
    return fclose(f) == 0 && ok;
}

static void test_float64(void) {
    int P = fits(4) ? 4 : fits(2) ? 2 : 1, m = 2;
    spec s = plain_spec(V_COMPOSITE, P, m, P > 1 ? PL_CONTIG : PL_AUTO, SMP_PIPELINE_INTERLEAVED);
    s.steps = 1;
    s.sgd = false;
    result *r = run_checked(&s); /* one step, no SGD: the gradients equal the plain C reference bitwise */
    if (!r) return;
    char dir[512] = "";
    if (g_rank == 0) {
        snprintf(dir, sizeof dir, "%s/smp_composite.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
        if (!mkdtemp(dir)) dir[0] = 0;
    }
    MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
    layout L;
    resnet_layout(&L, false);
    int ok = dir[0] != 0;
    char why[1200] = "cannot create a temporary folder";
    /* each rank of the first group writes its parameters: initial values and gradients */
    if (ok && g_in_group[P] && g_rank < P) {
        char path[1024];
        snprintf(path, sizeof path, "%s/manifest_%d.txt", dir, g_rank);
        FILE *man = fopen(path, "w");
        ok = man != NULL && r->ok;
        for (int k = 0; k < L.n && ok; k++)
            if (r->local[k]) {
                ok = write_bin(dir, L.name[k], ".init.bin", r->init[k], numel_of(&L, k)) &&
                     write_bin(dir, L.name[k], ".grad.bin", r->grad[k], numel_of(&L, k));
                fprintf(man, "%s %d %d\n", L.name[k], L.rows[k], L.cols[k]);
            }
        if (man) fclose(man);
        if (ok && g_rank == 0) {
            snprintf(path, sizeof path, "%s/meta.txt", dir);
            FILE *meta = fopen(path, "w");
            ok = meta != NULL;
            if (meta) {
                fprintf(meta, "%d %d %d %d %d %d %d\n", IN, HID, FF, CLS, BATCH, NBLK, m);
                fclose(meta);
            }
            ok = ok && write_bin(dir, "x", ".bin", g_x, BATCH * IN) && write_bin(dir, "t", ".bin", g_t, BATCH * CLS) &&
                 write_bin(dir, "loss", ".bin", r->loss[0], m);
        }
        if (!ok) snprintf(why, sizeof why, "%.1100s", r->ok ? "cannot write the files for the script" : r->why);
    }
    MPI_CHECK(
        ok,
        "composite/float64: inputs, targets, initial parameters and gradients of one step written for the numpy script",
        "%s", why);
    MPI_Barrier(MPI_COMM_WORLD);
    if (g_rank == 0 && ok) {
        const char *script = script_path("composite_ref.py");
        char cmd[2048];
        if (access(script, R_OK) != 0) test_skip("composite/float64 reference", "test/composite_ref.py not found");
        else if (system("command -v python3 > /dev/null 2>&1") != 0)
            test_skip("composite/float64 reference", "python3 not found");
        else {
            snprintf(cmd, sizeof cmd, "python3 '%s' '%s'", script, dir);
            fflush(stdout);
            int rc = system(cmd);
            rc = rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
            if (rc == 3) test__failed_total++; /* the script printed its FAIL lines */
            else if (rc != 0)
                CHECK(0, "composite/float64 reference: composite_ref.py ran", "exit status %d (%s)", rc, cmd);
        }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (g_rank == 0 && dir[0]) {
        char cmd[1200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) printf("(could not remove %s)\n", dir);
    }
    free(r);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    uint64_t seed = 15;
    for (int i = 0; i < BATCH * IN; i++) g_x[i] = (float)(smp_rng_uniform(&seed) * 2 - 1);
    for (int i = 0; i < BATCH * CLS; i++) g_t[i] = (float)(smp_rng_uniform(&seed) * 2 - 1);
    /* the world in groups of P ranks, one smp job each */
    for (int P = 1; P <= 4; P *= 2) {
        g_in_group[P] = false;
        if (!fits(P)) continue;
        MPI_Comm_split(MPI_COMM_WORLD, g_rank / P, g_rank, &g_group[P]);
        g_in_group[P] = true;
    }
    test_equivalence();
    test_nested();
    test_recompute();
    test_dropout();
    test_errors();
    test_fan();
    test_float64();
    for (int P = 1; P <= 4; P *= 2)
        if (g_in_group[P]) MPI_Comm_free(&g_group[P]);
    int rc = test_exit_code();
    MPI_Finalize();
    return rc;
}
