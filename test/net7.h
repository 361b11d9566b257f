/* net7.h - the test model of the pipeline and data-parallel tests: seven
   calls (fc0 act1 fc1 skip fc2 act2 head) with a skip connection from fc0 to
   skip, its modules on smp's API, and the same model written as plain C
   (the one-process reference) with the same kernels. The linears may split
   their backward (zero-bubble schedules: net_modules_split); the ReLUs and
   the skip add keep a whole one. */
#ifndef NET7_H
#define NET7_H
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { B = 24, D = 5, H = 6, C = 3, NLIN = 4 };
static const int lin_in[NLIN] = {D, H, H, H}, lin_out[NLIN] = {H, H, H, C};

/* ---------------------------------------------------------------- kernels shared by both sides */
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

/* ---------------------------------------------------------------- modules */
typedef struct { smp_param *w, *b; int in, out, fail_mp_rank, seq_slot; } lin_state;
static int g_fail = -1, g_fail_mb = -1; /* mp rank (and microbatch, -1: any) whose linear fails (error test) */
static int g_fail_w = -1;                /* mp rank whose split linears' W fails on microbatch 1 */
/* g_lin_seq numbers the linears' callbacks on this rank (split backward below) */
static long g_lin_seq, g_w_adjacent, g_w_deferred, g_b_calls, g_w_calls;
static long g_b_seq[NLIN * 8]; /* [linear * 8 + microbatch % 8]: when its B ran */

static smp_status lin_forward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    if (g_fail >= 0 && smp_mp_rank() == g_fail && (g_fail_mb < 0 || smp_call_microbatch(c) == g_fail_mb))
        return smp_error(SMP_ERR_MODULE, "injected failure");
    int64_t n = x->shape[0], shape[2] = {n, s->out};
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, shape);
    if (!y) return SMP_ERR_NOMEM; /* smp names what was missing */
    g_lin_seq++;
    linear_fwd((const float *)x->data, (const float *)smp_param_value(s->w)->data,
               (const float *)smp_param_value(s->b)->data, (float *)y->data, (int)n, s->in, s->out);
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
/* The split backward. W finds the input and output gradient B had (smp
   keeps them until W) and only adds into the parameter gradients. A test
   tells a W that ran right after its own B (schedules without W ops) from
   one the schedule put later, after other linears' work (g_w_adjacent,
   g_w_deferred). */
static smp_status lin_backward_input(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *gy = smp_call_grad_output(c, 0);
    smp_tensor *gx = smp_call_grad_input(c, 0);
    if (!gy) return smp_error(SMP_ERR_MODULE, "backward_input without an output gradient");
    if (gx)
        linear_bwd_input((const float *)smp_param_value(s->w)->data, (const float *)gy->data, (float *)gx->data,
                         (int)gy->shape[0], s->in, s->out);
    g_b_seq[s->seq_slot * 8 + smp_call_microbatch(c) % 8] = ++g_lin_seq;
    g_b_calls++;
    return SMP_OK;
}
static smp_status lin_backward_weight(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *gy = smp_call_grad_output(c, 0);
    if (!x || !x->data || !gy || !gy->data)
        return smp_error(SMP_ERR_MODULE, "backward_weight without its input or output gradient");
    if (g_fail_w >= 0 && smp_mp_rank() == g_fail_w && smp_call_microbatch(c) == 1)
        return smp_error(SMP_ERR_MODULE, "injected W failure");
    linear_bwd_weight((const float *)x->data, (const float *)gy->data, (float *)smp_param_grad(s->w)->data,
                      (float *)smp_param_grad(s->b)->data, (int)x->shape[0], s->in, s->out);
    if (g_b_seq[s->seq_slot * 8 + smp_call_microbatch(c) % 8] == g_lin_seq) g_w_adjacent++;
    else g_w_deferred++;
    ++g_lin_seq;
    g_w_calls++;
    return SMP_OK;
}
static smp_status relu_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    for (int64_t i = 0; i < smp_tensor_numel(x); i++)
        ((float *)y->data)[i] = ((const float *)x->data)[i] > 0 ? ((const float *)x->data)[i] : 0;
    return SMP_OK;
}
static void (*g_relu_backward_hook)(void); /* called from every ReLU backward (test_ddp: smp_poll) */
static smp_status relu_backward(smp_call_ctx *c) {
    if (g_relu_backward_hook) g_relu_backward_hook();
    const float *x = (const float *)smp_call_input(c, 0)->data, *gy = (const float *)smp_call_grad_output(c, 0)->data;
    smp_tensor *gx = smp_call_grad_input(c, 0);
    for (int64_t i = 0; gx && i < smp_tensor_numel(gx); i++) ((float *)gx->data)[i] = x[i] > 0 ? gy[i] : 0;
    return SMP_OK;
}
static smp_status add_forward(smp_call_ctx *c) {
    const smp_tensor *a = smp_call_input(c, 0), *b = smp_call_input(c, 1);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, a->ndim, a->shape);
    if (!y) return SMP_ERR_NOMEM;
    for (int64_t i = 0; i < smp_tensor_numel(a); i++)
        ((float *)y->data)[i] = ((const float *)a->data)[i] + ((const float *)b->data)[i];
    return SMP_OK;
}
static smp_status add_backward(smp_call_ctx *c) {
    const smp_tensor *gy = smp_call_grad_output(c, 0);
    for (int k = 0; k < 2; k++) {
        smp_tensor *g = smp_call_grad_input(c, k);
        if (g) memcpy(g->data, gy->data, smp_tensor_nbytes(gy));
    }
    return SMP_OK;
}

typedef struct { smp_module *root, *lin[NLIN], *relu1, *relu5, *add3, *block; lin_state st[NLIN]; } net;

/* The same model with fc1 and the skip add in one composite call:
   block(a1, a0) = skip(fc1(a1), a0). Same modules, same parameters. */
static smp_status block_forward(smp_call_ctx *c) {
    net *n = (net *)smp_module_user(smp_call_module(c));
    smp_tensor pair[2], y;
    SMP_TRY(smp_call(n->lin[1], smp_call_input(c, 0), 1, &pair[0], 1));
    pair[1] = *smp_call_input(c, 1);
    SMP_TRY(smp_call(n->add3, pair, 2, &y, 1));
    return smp_call_set_output(c, 0, &y);
}

static smp_status net_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m; (void)nin; (void)nout;
    net *n = (net *)user;
    smp_tensor a0, a1, a2, a3, a4, a5, pair[2];
    smp_status st;
    if ((st = smp_call(n->lin[0], &in[0], 1, &a0, 1)) || (st = smp_call(n->relu1, &a0, 1, &a1, 1))) return st;
    if (n->block) {
        pair[0] = a1;
        pair[1] = a0;
        st = smp_call(n->block, pair, 2, &a3, 1);
    } else {
        st = smp_call(n->lin[1], &a1, 1, &a2, 1);
        pair[0] = a2;
        pair[1] = a0; /* the skip connection */
        if (!st) st = smp_call(n->add3, pair, 2, &a3, 1);
    }
    smp_module *fc2 = n->lin[2] ? n->lin[2] : n->lin[1]; /* net_modules_tied: fc1 called again */
    if (st || (st = smp_call(fc2, &a3, 1, &a4, 1)) || (st = smp_call(n->relu5, &a4, 1, &a5, 1)) ||
        (st = smp_call(n->lin[3], &a5, 1, &out[0], 1)))
        return st;
    return SMP_OK;
}

/* The module callbacks of the three kinds of module: the host ones above,
   or an engine's device versions of the same kernels (test_device.c);
   add_f NULL: smp's built-in add. */
typedef struct { smp_module_fn lin_f, lin_b, relu_f, relu_b, add_f, add_b; } net_fns;
/* A split backward for the linears, in place of lin_b (ReLU and add keep
   theirs: modules with a whole backward beside split ones). */
typedef struct { smp_module_fn lin_bi, lin_bw; } net_split_fns;
static const net_split_fns net_host_split = {lin_backward_input, lin_backward_weight};

/* The modules and parameters; placement[k]: partition of call k's module
   (manual); NULL: auto; split NULL: the linears' backward whole. A test may
   add buffers before net_model. */
static inline void net_modules_as(net *n, const int *placement, const net_fns *f, const net_split_fns *split,
                                  bool tied) {
    const smp_module_desc relu = {f->relu_f, f->relu_b, NULL}, add = {f->add_f, f->add_b, NULL};
    memset(n, 0, sizeof *n);
    n->root = smp_module_new(NULL, "", NULL);
    /* call order: lin0 relu1 lin1 add3 lin2 relu5 lin3 */
    const char *names[7] = {"fc0", "act1", "fc1", "skip", "fc2", "act2", "head"};
    int lin_of_call[7] = {0, -1, 1, -1, 2, -1, 3};
    for (int k = 0; k < 7; k++) {
        if (placement) smp_partition_push(placement[k]);
        int l = lin_of_call[k];
        if (l == 2 && tied) {
            if (placement) smp_partition_pop();
            continue;
        }
        if (l >= 0) {
            n->st[l].in = lin_in[l];
            n->st[l].out = lin_out[l];
            n->st[l].seq_slot = l;
            smp_module_desc d = {f->lin_f, split ? NULL : f->lin_b, &n->st[l]};
            n->lin[l] = smp_module_new(n->root, names[k], &d);
            if (split) smp_module_set_backward_split(n->lin[l], split->lin_bi, split->lin_bw);
            int64_t ws[2] = {lin_out[l], lin_in[l]}, bs[1] = {lin_out[l]};
            n->st[l].w = smp_param_new(n->lin[l], "weight", SMP_F32, 2, ws, smp_init_uniform, NULL);
            n->st[l].b = smp_param_new(n->lin[l], "bias", SMP_F32, 1, bs, smp_init_uniform, NULL);
        } else if (k == 3)
            n->add3 = f->add_f ? smp_module_new(n->root, names[k], &add) : smp_module_new_add(n->root, names[k]);
        else if (k == 1) n->relu1 = smp_module_new(n->root, names[k], &relu);
        else n->relu5 = smp_module_new(n->root, names[k], &relu);
        if (placement) smp_partition_pop();
    }
}
static inline void net_modules_split(net *n, const int *placement, const net_fns *f, const net_split_fns *split) {
    net_modules_as(n, placement, f, split, false);
}
static inline void net_modules(net *n, const int *placement, const net_fns *f) {
    net_modules_split(n, placement, f, NULL);
}
/* Turns fc1 + skip into the composite call above (auto placement keeps it whole). */
static inline void net_block(net *n, bool recompute) {
    const smp_module_desc d = {block_forward, NULL, n};
    n->block = smp_module_new(n->root, "block", &d);
    smp_module_set_recompute(n->block, recompute);
}
static inline smp_model *net_model(net *n, bool on_device) {
    smp_model *m = NULL;
    smp_model_desc md = {net_forward, 1, 1, n, on_device};
    smp_status st = smp_model_new(n->root, &md, &m);
    return st ? NULL : m;
}
static inline smp_model *build_with(net *n, const int *placement, const net_fns *f, bool on_device) {
    net_modules(n, placement, f);
    return net_model(n, on_device);
}
static const net_fns net_host_fns = {lin_forward, lin_backward, relu_forward, relu_backward, add_forward, add_backward};
/* The same model with fc2 tied to fc1 (one module, called at calls 2 and 4:
   a shared module, held by both partitions when they differ). Not the
   one-process reference's model: tests compare it with itself. */
static inline void net_modules_tied(net *n, const int *placement) {
    net_modules_as(n, placement, &net_host_fns, NULL, true);
}
static inline smp_model *build(net *n, const int *placement) { return build_with(n, placement, &net_host_fns, false); }
/* build, with the linears' backward split (split false: build) */
static inline smp_model *build_split(net *n, const int *placement, bool split) {
    net_modules_split(n, placement, &net_host_fns, split ? &net_host_split : NULL);
    return net_model(n, false);
}

/* ---------------------------------------------------------------- the reference */
typedef struct {
    float w[NLIN][H * H], b[NLIN][H], gw[NLIN][H * H], gb[NLIN][H];
    float loss[8];
    float out[B * C];
} ref_t;

static inline void ref_params(ref_t *r) {
    static const char *names[NLIN] = {"fc0", "fc1", "fc2", "head"};
    memset(r, 0, sizeof *r);
    for (int l = 0; l < NLIN; l++) {
        char nm[64];
        int64_t ws[2] = {lin_out[l], lin_in[l]}, bs[1] = {lin_out[l]};
        smp_tensor w = smp_tensor_make(r->w[l], SMP_F32, 2, ws), b = smp_tensor_make(r->b[l], SMP_F32, 1, bs);
        snprintf(nm, sizeof nm, "%s.weight", names[l]);
        smp_init_uniform(&w, smp_param_seed(nm), NULL);
        snprintf(nm, sizeof nm, "%s.bias", names[l]);
        smp_init_uniform(&b, smp_param_seed(nm), NULL);
    }
}

/* One step on a batch of `rows` (at most B) in m microbatches, the loss
   gradients divided by grad_divisor (the microbatch count, times dp *
   backward_passes_per_step with ddp), as smp_step does. */
static inline void ref_step_core(ref_t *r, const float *x, const float *t, int rows, int m, bool train,
                                 double grad_divisor) {
    int n = rows / m;
    for (int i = 0; i < m; i++) {
        const float *xi = x + i * n * D, *ti = t + i * n * C;
        float a0[B * H], a1[B * H], a2[B * H], a3[B * H], a4[B * H], a5[B * H], y[B * C], gy[B * C];
        linear_fwd(xi, r->w[0], r->b[0], a0, n, D, H);
        for (int k = 0; k < n * H; k++) a1[k] = a0[k] > 0 ? a0[k] : 0;
        linear_fwd(a1, r->w[1], r->b[1], a2, n, H, H);
        for (int k = 0; k < n * H; k++) a3[k] = a2[k] + a0[k];
        linear_fwd(a3, r->w[2], r->b[2], a4, n, H, H);
        for (int k = 0; k < n * H; k++) a5[k] = a4[k] > 0 ? a4[k] : 0;
        linear_fwd(a5, r->w[3], r->b[3], y, n, H, C);
        memcpy(r->out + i * n * C, y, sizeof(float) * (size_t)(n * C));
        r->loss[i] = mse(y, ti, train ? gy : NULL, n * C);
        if (!train) continue;
        if (grad_divisor != 1) for (int k = 0; k < n * C; k++) gy[k] *= (float)(1.0 / grad_divisor);
        float g5[B * H], g4[B * H], g3[B * H], g2[B * H], g1[B * H], g0[B * H], g0b[B * H];
        linear_bwd(a5, r->w[3], gy, g5, r->gw[3], r->gb[3], n, H, C);
        for (int k = 0; k < n * H; k++) g4[k] = a4[k] > 0 ? g5[k] : 0;
        linear_bwd(a3, r->w[2], g4, g3, r->gw[2], r->gb[2], n, H, H);
        memcpy(g2, g3, sizeof(float) * (size_t)(n * H));  /* add: both inputs get g3 */
        memcpy(g0b, g3, sizeof(float) * (size_t)(n * H));
        linear_bwd(a1, r->w[1], g2, g1, r->gw[1], r->gb[1], n, H, H);
        for (int k = 0; k < n * H; k++) g0[k] = a0[k] > 0 ? g1[k] : 0;
        for (int k = 0; k < n * H; k++) g0[k] = g0b[k] + g0[k]; /* latest consumer first */
        linear_bwd(xi, r->w[0], g0, NULL, r->gw[0], r->gb[0], n, D, H);
    }
}
static inline void ref_step_rows(ref_t *r, const float *x, const float *t, int rows, int m, bool train) {
    ref_step_core(r, x, t, rows, m, train, m);
}
static inline void ref_step(ref_t *r, const float *x, const float *t, int m, bool train) {
    ref_step_core(r, x, t, B, m, train, m);
}
static inline void ref_step_divided(ref_t *r, const float *x, const float *t, int m, bool train, double grad_divisor) {
    ref_step_core(r, x, t, B, m, train, grad_divisor);
}

/* ---------------------------------------------------------------- timelines */
/* Points SMP_TIMELINE at one file for the whole job (named by rank 0's
   pid); smp writes it when the model is freed. */
static inline void timeline_to(const char *stem, char *path, size_t cap) {
    int tag = (int)getpid();
    MPI_Bcast(&tag, 1, MPI_INT, 0, MPI_COMM_WORLD);
    snprintf(path, cap, "/tmp/smp_test_%s_%d.json", stem, tag);
    setenv("SMP_TIMELINE", path, 1);
}

/* A file's text, NUL-terminated (free it); NULL if it cannot be read. */
static inline char *read_text(const char *path, long *len) {
    FILE *f = fopen(path, "rb");
    char *text = NULL;
    if (f && !fseek(f, 0, SEEK_END) && (*len = ftell(f)) > 0 && !fseek(f, 0, SEEK_SET) &&
        (text = (char *)calloc(1, (size_t)*len + 1)) && fread(text, 1, (size_t)*len, f) != (size_t)*len) {
        free(text);
        text = NULL;
    }
    if (f) fclose(f);
    return text;
}

/* One event of a timeline file: its category, start and length (us), rank, and bucket for all-reduces and
   all-gathers. */
typedef struct { char cat[16]; double ts, dur; int pid, bucket, stage; } tl_event;

static inline int read_timeline(const char *path, tl_event *ev, int cap) {
    long len;
    char *text = read_text(path, &len);
    if (!text) return -1;
    int n = 0;
    for (const char *at = strstr(text, "{\"name\":\""); at && n < cap; at = strstr(at + 1, "{\"name\":\"")) {
        tl_event e = {{0}, 0, 0, -1, -1, -1};
        const char *cat = strstr(at, "\"cat\":\"");
        if (!cat || sscanf(cat, "\"cat\":\"%15[^\"]\",\"ph\":\"X\",\"ts\":%lf,\"dur\":%lf,\"pid\":%d", e.cat, &e.ts,
                           &e.dur, &e.pid) != 4)
            continue;
        sscanf(at, "{\"name\":\"A%*c b%d\"", &e.bucket); /* AR: an all-reduce, AG: an all-gather */
        const char *stage = strstr(at, "\"args\":{\"stage\":");
        if (stage) sscanf(stage, "\"args\":{\"stage\":%d", &e.stage);
        ev[n++] = e;
    }
    free(text);
    return n;
}

/* Per-microbatch losses and the gradients of one replica's batch. */
static inline void ref_zero_grads(ref_t *r) { memset(r->gw, 0, sizeof r->gw); memset(r->gb, 0, sizeof r->gb); }
#endif
