/* test_port.c - what porting an existing engine onto smp relies on (issue 25,
   "friction from porting an existing engine"): a zero-initialised tensor is a
   host tensor in every call that takes one; the buffers smp.h promises zeroed
   (input gradients, the body's output gradient, parameter gradients after
   partitioning and smp_model_zero_grad) are zero when a kernel that
   accumulates gets them. Every allocation smp makes is filled with garbage
   first, so a buffer handed over unzeroed shows, whatever allocator smp has;
   a module set with smp_module_set_overwrites_grad_inputs gets its input
   gradients unzeroed and, writing them in full, the same bits;
   smp_init_copy loads an engine's contiguous weights, in tracing and after
   partitioning; the loss over the whole batch (every data-parallel replica's
   microbatches) comes out the same on every rank. */
#include <stdlib.h>
#include <string.h>
static void *poisoned_malloc(size_t n) {
    void *p = malloc(n);
    if (p) memset(p, 0xA5, n);
    return p;
}
#define SMP_MALLOC(n) poisoned_malloc(n)
#define SMP_FREE(p) free(p)
#define SMP_IMPLEMENTATION
#define SMP_TESTING
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"
#include <math.h>
#include <string.h>

enum { BATCH = 8, WIDTH = 4, LAYERS = 4, MICRO = 4 };

typedef struct layer { smp_module *m; smp_param *w; } layer;
static layer g_layer[LAYERS];

/* What the kernels found: buffers promised zero that were not, and how many they looked at. */
static struct { int nonzero, seen; char first[160]; bool param_grads_zero; } g_zero;
/* The layers' modules set with smp_module_set_overwrites_grad_inputs: fc_backward then writes every element of its
   input gradients (zeroing them itself first), counting those that arrived not zeroed, smp having skipped its pass. */
static struct { bool on; int unzeroed, seen; } g_overwrite;
static bool all_zero(const void *p, size_t bytes) {
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < bytes; i++)
        if (b[i]) return false;
    return true;
}
static void expect_zero(const void *p, size_t bytes, const char *what, int mb) {
    g_zero.seen++;
    if (all_zero(p, bytes)) return;
    if (!g_zero.nonzero++) snprintf(g_zero.first, sizeof g_zero.first, "%s (microbatch %d)", what, mb);
}

/* y = tanh(x W^T); the backward accumulates into every gradient it is given */
/* The engine's own weight buffer (layer l at element l * WIDTH * WIDTH), and
   how many traced calls saw their weights differ from it (NULL: not checked). */
static float g_weights[LAYERS * WIDTH * WIDTH];
static const float *g_traced_from;
static int g_traced_calls, g_traced_wrong;

static smp_status fc_forward(smp_call_ctx *c) {
    layer *l = (layer *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    const float *w = (const float *)smp_param_value(l->w)->data, *xs = (const float *)x->data;
    if (g_traced_from && smp_is_tracing()) {
        g_traced_calls++;
        g_traced_wrong += memcmp(w, g_traced_from + (l - g_layer) * WIDTH * WIDTH, sizeof(float) * WIDTH * WIDTH) != 0;
    }
    int64_t n = x->shape[0];
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, (int64_t[]){n, WIDTH});
    if (!y) return SMP_ERR_NOMEM;
    for (int64_t r = 0; r < n; r++)
        for (int o = 0; o < WIDTH; o++) {
            float z = 0;
            for (int i = 0; i < WIDTH; i++) z += xs[r * WIDTH + i] * w[o * WIDTH + i];
            ((float *)y->data)[r * WIDTH + o] = tanhf(z);
        }
    return SMP_OK;
}
static smp_status fc_backward(smp_call_ctx *c) {
    layer *l = (layer *)smp_module_user(smp_call_module(c));
    const float *x = (const float *)smp_call_input(c, 0)->data, *y = (const float *)smp_call_output_value(c, 0)->data;
    const float *gy = (const float *)smp_call_grad_output(c, 0)->data, *w = (const float *)smp_param_value(l->w)->data;
    float *gw = (float *)smp_param_grad(l->w)->data;
    smp_tensor *gx = smp_call_grad_input(c, 0);
    int64_t n = smp_call_input(c, 0)->shape[0];
    if (gx && g_overwrite.on) {
        g_overwrite.seen++;
        g_overwrite.unzeroed += !all_zero(gx->data, smp_tensor_nbytes(gx));
        memset(gx->data, 0, smp_tensor_nbytes(gx));
    } else if (gx) expect_zero(gx->data, smp_tensor_nbytes(gx), "an input gradient", smp_call_microbatch(c));
    if (g_zero.param_grads_zero && smp_call_microbatch(c) == 0 && !smp_is_tracing())
        expect_zero(gw, smp_tensor_nbytes(smp_param_grad(l->w)), "a parameter gradient", 0);
    for (int64_t r = 0; r < n; r++)
        for (int i = 0; i < WIDTH; i++)
            for (int o = 0; o < WIDTH; o++) {
                float dz = gy[r * WIDTH + o] * (1 - y[r * WIDTH + o] * y[r * WIDTH + o]);
                gw[o * WIDTH + i] += dz * x[r * WIDTH + i];
                if (gx) ((float *)gx->data)[r * WIDTH + i] += dz * w[o * WIDTH + i];
            }
    return SMP_OK;
}

static smp_status forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m, (void)nin, (void)nout, (void)user;
    smp_tensor h = in[0];
    for (int l = 0; l < LAYERS; l++) SMP_TRY(smp_call(g_layer[l].m, &h, 1, l == LAYERS - 1 ? out : &h, 1));
    return SMP_OK;
}

/* The model; with `from`, layer l's weight is smp_init_copy's from[l]. */
static smp_model *build(smp_init_copy_desc *from) {
    smp_module *root = smp_module_new(NULL, "", NULL);
    for (int l = 0; l < LAYERS; l++) {
        char name[16];
        snprintf(name, sizeof name, "fc%d", l);
        g_layer[l].m = smp_module_new(root, name, &(smp_module_desc){fc_forward, fc_backward, &g_layer[l]});
        g_layer[l].w = smp_param_new(g_layer[l].m, "weight", SMP_F32, 2, (int64_t[]){WIDTH, WIDTH},
                                     from ? smp_init_copy : smp_init_uniform, from ? &from[l] : NULL);
        smp_module_set_overwrites_grad_inputs(g_layer[l].m, g_overwrite.on);
    }
    smp_model *model = NULL;
    if (smp_model_new(root, &(smp_model_desc){.forward = forward}, &model)) return NULL;
    return model;
}

static float g_x[BATCH * WIDTH], g_t[BATCH * WIDTH];
static void make_data(void) {
    for (int i = 0; i < BATCH * WIDTH; i++) {
        g_x[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
        g_t[i] = sinf(g_x[i]);
    }
}

/* The MSE loss and its gradient; output 0 through a tensor written as a
   zero-initialised compound literal (no device named), output 1 through
   smp_mb_return_f32. */
SMP_STEP_BODY(literal_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    int64_t n = smp_tensor_numel(y);
    float loss = 0;
    expect_zero(g->data, smp_tensor_nbytes(g), "the body's output gradient", smp_mb_index(mb));
    for (int64_t i = 0; i < n; i++) {
        float d = ((const float *)y->data)[i] - ((const float *)t->data)[i];
        loss += d * d / (float)n;
        ((float *)g->data)[i] += 2 * d / (float)n;
    }
    SMP_TRY(smp_mb_return(mb, 0, &(smp_tensor){.data = &loss, .dtype = SMP_F32, .ndim = 1, .shape = {1}}));
    return smp_mb_return_f32(mb, 1, loss);
}

/* smp_mb_return takes the literal as a host tensor, as every call does. */
static void test_zero_tensor_is_host(smp_model *model) {
    smp_tensor xs = smp_tensor_2d(g_x, SMP_F32, BATCH, WIDTH), ts = smp_tensor_2d(g_t, SMP_F32, BATCH, WIDTH);
    smp_step_output out[2] = {{0}, {0}};
    smp_model_zero_grad(model);
    smp_status st = SMP_TRAIN_STEP(model, literal_body, NULL, out, 2, xs, ts);
    float lit[MICRO] = {0}, f32[MICRO] = {0};
    smp_tensor lt = smp_tensor_2d(lit, SMP_F32, MICRO, 1), ft = smp_tensor_1d(f32, SMP_F32, MICRO);
    if (!st) st = smp_step_output_stack(&out[0], &lt);
    if (!st) st = smp_step_output_stack(&out[1], &ft);
    MPI_CHECK(!st && !memcmp(lit, f32, sizeof lit) && lit[0] > 0,
              "port/smp_mb_return takes a zero-initialised tensor as host memory", "%s: %s (losses %g and %g)",
              smp_status_name(st), smp_last_error(), (double)lit[0], (double)f32[0]);
    smp_step_output_free(&out[0]);
    smp_step_output_free(&out[1]);
}

/* Steps after partitioning, after smp_model_zero_grad, and without it (the
   parameter gradients then hold the last step's: nothing is promised). */
static void test_zeroed_buffers(smp_model *model) {
    smp_tensor xs = smp_tensor_2d(g_x, SMP_F32, BATCH, WIDTH), ts = smp_tensor_2d(g_t, SMP_F32, BATCH, WIDTH);
    smp_status st = SMP_OK;
    memset(&g_zero, 0, sizeof g_zero);
    for (int step = 0; step < 4 && !st; step++) {
        smp_step_output out[2] = {{0}, {0}};
        g_zero.param_grads_zero = step != 2; /* step 0: fresh from partitioning; step 2 skips zero_grad */
        if (step == 1 || step == 3) smp_model_zero_grad(model);
        st = SMP_TRAIN_STEP(model, literal_body, NULL, out, 2, xs, ts);
        smp_step_output_free(&out[0]);
        smp_step_output_free(&out[1]);
    }
    MPI_CHECK(!st && !g_zero.nonzero && g_zero.seen > 0,
              "port/input gradients, the body's output gradient and fresh parameter gradients arrive zeroed",
              "%s %s; %d of %d buffers not zero, the first %s", smp_status_name(st), st ? smp_last_error() : "",
              g_zero.nonzero, g_zero.seen, g_zero.first);
}

/* 3 steps of a fresh model: the losses and every parameter gradient after each, into out[]; their count. Each
   layer's gradient comes from the rank of this model replica (MP_GROUP) that holds it, so two runs compare whatever
   layers auto-partitioning, which goes by traced time, gave each rank. */
static int train_record(float *out, int cap, smp_status *st) {
    smp_model *model = build(NULL);
    smp_tensor xs = smp_tensor_2d(g_x, SMP_F32, BATCH, WIDTH), ts = smp_tensor_2d(g_t, SMP_F32, BATCH, WIDTH);
    int n = 0;
    *st = model ? SMP_OK : SMP_ERR_ARG;
    for (int step = 0; step < 3 && !*st; step++) {
        smp_step_output o[2] = {{0}, {0}};
        smp_model_zero_grad(model);
        *st = SMP_TRAIN_STEP(model, literal_body, NULL, o, 2, xs, ts);
        if (!*st && n < cap) out[n++] = (float)smp_step_output_reduce_mean_f64(&o[1]);
        float grads[LAYERS * WIDTH * WIDTH] = {0};
        for (int l = 0; l < LAYERS; l++)
            if (smp_module_is_local(g_layer[l].m))
                memcpy(grads + l * WIDTH * WIDTH, smp_param_grad(g_layer[l].w)->data, sizeof(float) * WIDTH * WIDTH);
        MPI_Allreduce(MPI_IN_PLACE, grads, LAYERS * WIDTH * WIDTH, MPI_FLOAT, MPI_SUM, smp_group_comm(SMP_MP_GROUP));
        for (int k = 0; !*st && k < LAYERS * WIDTH * WIDTH && n < cap; k++) out[n++] = grads[k];
        smp_step_output_free(&o[0]);
        smp_step_output_free(&o[1]);
    }
    smp_model_free(model);
    return n;
}

/* smp_module_set_overwrites_grad_inputs: the input gradients of such a module arrive as the allocator has them
   (poisoned or a reused block's old values: smp made no pass over them), and a backward that writes them in full
   gives the bits of the same model without it. */
static void test_overwrites_grad_inputs(void) {
    enum { CAP = 3 * (1 + LAYERS * WIDTH * WIDTH) };
    static float plain[CAP], set[CAP];
    smp_status st_plain, st_set;
    memset(&g_zero, 0, sizeof g_zero);
    int np = train_record(plain, CAP, &st_plain);
    g_overwrite.on = true;
    int ns = train_record(set, CAP, &st_set);
    g_overwrite.on = false;
    MPI_CHECK(!st_plain && !st_set && np == ns && np > 3 && !memcmp(plain, set, sizeof(float) * (size_t)np) &&
                  !g_zero.nonzero && g_overwrite.seen > 0 && g_overwrite.unzeroed == g_overwrite.seen,
              "port/smp_module_set_overwrites_grad_inputs: input gradients arrive unzeroed, the same bits result",
              "%s %s; %d and %d values, %s; %d of %d input gradients arrived unzeroed (want all), %d of %d zeroed "
              "ones not zero without it", smp_status_name(st_plain ? st_plain : st_set), smp_last_error(), np, ns,
              np == ns && !memcmp(plain, set, sizeof(float) * (size_t)np) ? "equal" : "DIFFERENT",
              g_overwrite.unzeroed, g_overwrite.seen, g_zero.nonzero, g_zero.seen);
}

/* Weights loaded from the engine's buffer: the traced calls already see
   them, and after partitioning every local parameter holds its slice. */
static void test_init_copy(void) {
    static smp_init_copy_desc from[LAYERS];
    for (int i = 0; i < LAYERS * WIDTH * WIDTH; i++) g_weights[i] = (float)((i * 7919) % 211) / 211.0f - 0.5f;
    for (int l = 0; l < LAYERS; l++) from[l] = (smp_init_copy_desc){g_weights, (int64_t)l * WIDTH * WIDTH};
    g_traced_from = g_weights;
    smp_model *model = build(from);
    smp_tensor xs = smp_tensor_2d(g_x, SMP_F32, BATCH / MICRO, WIDTH);
    smp_status st = model ? smp_model_trace(model, &xs, 1) : SMP_ERR_ARG;
    int wrong = 0, local = 0;
    for (int l = 0; l < LAYERS && !st; l++)
        if (smp_module_is_local(g_layer[l].m)) {
            local++;
            wrong += memcmp(smp_param_value(g_layer[l].w)->data, g_weights + l * WIDTH * WIDTH,
                            sizeof(float) * WIDTH * WIDTH) != 0;
        }
    MPI_CHECK(!st && g_traced_calls >= LAYERS && !g_traced_wrong && local > 0 && !wrong,
              "port/smp_init_copy loads the engine's weights, in tracing and after partitioning",
              "%s %s; traced calls %d, %d with other weights; %d of %d local parameters differ", smp_status_name(st),
              st ? smp_last_error() : "", g_traced_calls, g_traced_wrong, wrong, local);
    g_traced_from = NULL;
    smp_model_free(model);
    /* a copy with nowhere to copy from is an error smp_model_new reports */
    smp_init_copy_desc none = {NULL, 0};
    smp_module *root = smp_module_new(NULL, "", NULL),
               *m = smp_module_new(root, "fc", &(smp_module_desc){fc_forward, fc_backward, NULL});
    smp_param_new(m, "weight", SMP_F32, 1, (int64_t[]){4}, smp_init_copy, &none);
    model = NULL;
    st = smp_model_new(root, &(smp_model_desc){.forward = forward}, &model);
    MPI_CHECK(st == SMP_ERR_ARG && strstr(smp_last_error(), "fc.weight") && strstr(smp_last_error(), "smp_init_copy"),
              "port/smp_init_copy without data is an error naming the parameter", "%s: %s", smp_status_name(st),
              smp_last_error());
    smp_model_free(model);
}

/* With ddp, each replica on its own data: the global mean is the mean of
   every replica's microbatch losses, the same bits on every rank; with one
   replica it is reduce_mean's. A bad result on one rank fails every rank. */
static void test_global_mean(void) {
    smp_config cfg = {0};
    cfg.ddp = SMP_ON;
    cfg.microbatches = MICRO;
    if (smp_init(&cfg)) { MPI_CHECK(0, "port/init with ddp", "%s", smp_last_error()); return; }
    smp_model *model = build(NULL);
    static float x[BATCH * WIDTH];
    /* each replica its own batch */
    for (int i = 0; i < BATCH * WIDTH; i++) x[i] = g_x[i] + 0.25f * (float)smp_dp_rank();
    smp_tensor xs = smp_tensor_2d(x, SMP_F32, BATCH, WIDTH), ts = smp_tensor_2d(g_t, SMP_F32, BATCH, WIDTH);
    smp_step_output out[2] = {{0}, {0}};
    smp_status st = model ? SMP_TRAIN_STEP(model, literal_body, NULL, out, 2, xs, ts) : SMP_ERR_ARG;
    float mb[MICRO] = {0}, every[64 * MICRO], global32 = 0;
    smp_tensor mbt = smp_tensor_1d(mb, SMP_F32, MICRO), g32 = smp_tensor_1d(&global32, SMP_F32, 1);
    if (!st) st = smp_step_output_stack(&out[1], &mbt);
    double local = smp_step_output_reduce_mean_f64(&out[1]), global = smp_step_output_reduce_mean_global_f64(&out[1]);
    if (!st) st = smp_step_output_reduce_mean_global(&out[1], &g32);
    int dp = smp_dp_size();
    MPI_Allgather(mb, MICRO, MPI_FLOAT, every, MICRO, MPI_FLOAT, MPI_COMM_WORLD); /* partitions 1: world = DP_GROUP */
    double ref = 0, globals[64], locals[64];
    for (int i = 0; i < dp * MICRO; i++) ref += every[i];
    ref /= dp * MICRO;
    MPI_Allgather(&global, 1, MPI_DOUBLE, globals, 1, MPI_DOUBLE, MPI_COMM_WORLD);
    MPI_Allgather(&local, 1, MPI_DOUBLE, locals, 1, MPI_DOUBLE, MPI_COMM_WORLD);
    bool same = true, apart = dp == 1;
    for (int r = 0; r < dp; r++) {
        same = same && !memcmp(&globals[r], &global, sizeof global);
        apart = apart || locals[r] != locals[0];
    }
    MPI_CHECK(
        !st && fabs(global - ref) <= 1e-12 * fabs(ref) && same && apart && global32 == (float)global &&
            (dp > 1 || !memcmp(&global, &local, sizeof local)),
        "port/smp_step_output_reduce_mean_global: the mean over every replica's microbatches, the same on every rank",
        "%s %s; global %.17g (f32 %.9g), whole batch %.17g, this replica %.17g; same on all ranks %d, replicas apart "
        "%d",
        smp_status_name(st), st ? smp_last_error() : "", global, (double)global32, ref, local, same, apart);
    int bad = 0;
    smp_tensor wrong = smp_tensor_1d(&bad, SMP_I32, 1);
    st = smp_step_output_reduce_mean_global(&out[1], smp_rank() == dp - 1 ? &wrong : &g32);
    MPI_CHECK(st != SMP_OK && (smp_rank() != dp - 1 || strstr(smp_last_error(), "i32")),
              "port/smp_step_output_reduce_mean_global: a bad result on one rank is an error on every rank", "%s: %s",
              smp_status_name(st), smp_last_error());
    double again = smp_step_output_reduce_mean_global_f64(&out[1]); /* the ranks still pair their calls */
    MPI_CHECK(!memcmp(&again, &global, sizeof global),
              "port/smp_step_output_reduce_mean_global: the next call after the error", "%.17g, before %.17g", again,
              global);
    smp_step_output_free(&out[0]);
    smp_step_output_free(&out[1]);
    smp_model_free(model);
    smp_finalize();
}

int main(void) {
    smp_config cfg = {0};
    int size;
    MPI_Init(NULL, NULL);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    cfg.partitions = size >= 2 ? 2 : 1;
    cfg.ddp = size > cfg.partitions ? SMP_ON : SMP_OFF; /* more ranks than partitions make replicas: smp wants ddp */
    cfg.microbatches = MICRO;
    make_data();
    if (smp_init(&cfg)) {
        MPI_CHECK(0, "port/init", "%s", smp_last_error());
        MPI_Finalize();
        return 1;
    }
    smp_model *model = build(NULL);
    MPI_CHECK(model != NULL, "port/model", "%s", smp_last_error());
    if (model) test_zeroed_buffers(model); /* first: the first step finds the gradients as partitioning made them */
    if (model) test_zero_tensor_is_host(model);
    smp_model_free(model);
    test_overwrites_grad_inputs();
    test_init_copy();
    smp_finalize();
    test_global_mean();
    MPI_Finalize();
    return test_exit_code();
}
