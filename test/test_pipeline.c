/* test_pipeline.c - the executor against the same model run in one process.
   A 7-call model with a skip connection (call 0 feeds calls 1 and 3) runs
   for every partition count that fits the world, microbatches 1, 2, 3, 4, 8,
   both schedules, manual placement 0,1,0,1 and interleaving; the loss of
   each microbatch and every gradient must equal, bit for bit, a plain C
   implementation of the same model with the same kernels and microbatching. */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"
#include <stdlib.h>
#include <string.h>

enum { B = 24, D = 5, H = 6, C = 3, NLIN = 4 };
static const int lin_in[NLIN] = {D, H, H, H}, lin_out[NLIN] = {H, H, H, C};

/* ---------------------------------------------------------------- kernels shared by both sides */
static void linear_fwd(const float *x, const float *w, const float *b, float *y, int n, int in, int out) {
    for (int r = 0; r < n; r++)
        for (int o = 0; o < out; o++) {
            float acc = b[o];
            for (int i = 0; i < in; i++) acc += x[r * in + i] * w[o * in + i];
            y[r * out + o] = acc;
        }
}
static void linear_bwd(const float *x, const float *w, const float *gy, float *gx, float *gw, float *gb, int n, int in, int out) {
    if (gx)
        for (int r = 0; r < n; r++)
            for (int i = 0; i < in; i++) {
                float acc = 0;
                for (int o = 0; o < out; o++) acc += gy[r * out + o] * w[o * in + i];
                gx[r * in + i] = acc;
            }
    for (int o = 0; o < out; o++) {
        float sb = 0;
        for (int r = 0; r < n; r++) sb += gy[r * out + o];
        gb[o] += sb;
        for (int i = 0; i < in; i++) {
            float sw = 0;
            for (int r = 0; r < n; r++) sw += gy[r * out + o] * x[r * in + i];
            gw[o * in + i] += sw;
        }
    }
}
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
typedef struct { smp_param *w, *b; int in, out, fail_mp_rank; } lin_state;
static int g_fail = -1; /* mp rank whose linear fails (error test) */

static smp_status lin_forward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    if (g_fail >= 0 && smp_mp_rank() == g_fail) return smp_error(SMP_ERR_MODULE, "injected failure");
    int64_t n = x->shape[0], shape[2] = {n, s->out};
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, shape);
    linear_fwd((const float *)x->data, (const float *)smp_param_value(s->w)->data, (const float *)smp_param_value(s->b)->data,
               (float *)y->data, (int)n, s->in, s->out);
    return SMP_OK;
}
static smp_status lin_backward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *gx = smp_call_grad_input(c, 0);
    linear_bwd((const float *)x->data, (const float *)smp_param_value(s->w)->data, (const float *)smp_call_grad_output(c, 0)->data,
               gx ? (float *)gx->data : NULL, (float *)smp_param_grad(s->w)->data, (float *)smp_param_grad(s->b)->data, (int)x->shape[0], s->in, s->out);
    return SMP_OK;
}
static smp_status relu_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    for (int64_t i = 0; i < smp_tensor_numel(x); i++) ((float *)y->data)[i] = ((const float *)x->data)[i] > 0 ? ((const float *)x->data)[i] : 0;
    return SMP_OK;
}
static smp_status relu_backward(smp_call_ctx *c) {
    const float *x = (const float *)smp_call_input(c, 0)->data, *gy = (const float *)smp_call_grad_output(c, 0)->data;
    smp_tensor *gx = smp_call_grad_input(c, 0);
    for (int64_t i = 0; gx && i < smp_tensor_numel(gx); i++) ((float *)gx->data)[i] = x[i] > 0 ? gy[i] : 0;
    return SMP_OK;
}
static smp_status add_forward(smp_call_ctx *c) {
    const smp_tensor *a = smp_call_input(c, 0), *b = smp_call_input(c, 1);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, a->ndim, a->shape);
    for (int64_t i = 0; i < smp_tensor_numel(a); i++) ((float *)y->data)[i] = ((const float *)a->data)[i] + ((const float *)b->data)[i];
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

typedef struct { smp_module *root, *lin[NLIN], *relu1, *relu5, *add3; lin_state st[NLIN]; } net;

static smp_status net_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m; (void)nin; (void)nout;
    net *n = (net *)user;
    smp_tensor a0, a1, a2, a3, a4, a5, pair[2];
    smp_status st;
    if ((st = smp_call(n->lin[0], &in[0], 1, &a0, 1)) || (st = smp_call(n->relu1, &a0, 1, &a1, 1)) || (st = smp_call(n->lin[1], &a1, 1, &a2, 1)))
        return st;
    pair[0] = a2;
    pair[1] = a0; /* the skip connection */
    if ((st = smp_call(n->add3, pair, 2, &a3, 1)) || (st = smp_call(n->lin[2], &a3, 1, &a4, 1)) || (st = smp_call(n->relu5, &a4, 1, &a5, 1)) ||
        (st = smp_call(n->lin[3], &a5, 1, &out[0], 1)))
        return st;
    return SMP_OK;
}

/* placement[k]: partition of call k's module (manual); NULL: auto */
static smp_model *build(net *n, const int *placement) {
    static const smp_module_desc relu = {relu_forward, relu_backward, NULL}, add = {add_forward, add_backward, NULL};
    memset(n, 0, sizeof *n);
    n->root = smp_module_new(NULL, "", NULL);
    /* call order: lin0 relu1 lin1 add3 lin2 relu5 lin3 */
    const char *names[7] = {"fc0", "act1", "fc1", "skip", "fc2", "act2", "head"};
    int lin_of_call[7] = {0, -1, 1, -1, 2, -1, 3};
    for (int k = 0; k < 7; k++) {
        if (placement) smp_partition_push(placement[k]);
        int l = lin_of_call[k];
        if (l >= 0) {
            n->st[l].in = lin_in[l];
            n->st[l].out = lin_out[l];
            smp_module_desc d = {lin_forward, lin_backward, &n->st[l]};
            n->lin[l] = smp_module_new(n->root, names[k], &d);
            int64_t ws[2] = {lin_out[l], lin_in[l]}, bs[1] = {lin_out[l]};
            n->st[l].w = smp_param_new(n->lin[l], "weight", SMP_F32, 2, ws, smp_init_uniform, NULL);
            n->st[l].b = smp_param_new(n->lin[l], "bias", SMP_F32, 1, bs, smp_init_uniform, NULL);
        } else if (k == 3) n->add3 = smp_module_new(n->root, names[k], &add);
        else if (k == 1) n->relu1 = smp_module_new(n->root, names[k], &relu);
        else n->relu5 = smp_module_new(n->root, names[k], &relu);
        if (placement) smp_partition_pop();
    }
    smp_model *m = NULL;
    smp_model_desc md = {net_forward, 1, 1, n};
    smp_status st = smp_model_new(n->root, &md, &m);
    return st ? NULL : m;
}

/* ---------------------------------------------------------------- the reference */
typedef struct { float w[NLIN][H * H], b[NLIN][H], gw[NLIN][H * H], gb[NLIN][H]; float loss[8]; float out[B * C]; } ref_t;

static void ref_params(ref_t *r) {
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

static void ref_step(ref_t *r, const float *x, const float *t, int m, bool train) {
    int n = B / m;
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
        if (m > 1) for (int k = 0; k < n * C; k++) gy[k] *= (float)(1.0 / m);
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

static float g_x[B * D], g_t[B * C];
static float g_losses[8];

SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    float loss = mse((const float *)y->data, (const float *)t->data, g ? (float *)g->data : NULL, (int)smp_tensor_numel(y));
    smp_status st = smp_mb_return_f32(mb, 0, loss);
    return st ? st : smp_mb_return(mb, 1, y);
}

/* Compares this rank's gradients (and the per-microbatch losses everyone got) with the reference. */
static int compare(smp_model *m, const ref_t *r, const smp_step_output *outs, int mbs, char *why, size_t cap) {
    static const char *names[NLIN] = {"fc0", "fc1", "fc2", "head"};
    for (int i = 0; i < mbs; i++) {
        float got = ((const float *)outs[0].values[i].data)[0];
        if (memcmp(&got, &r->loss[i], 4)) { snprintf(why, cap, "loss of microbatch %d: %.9g vs reference %.9g", i, got, r->loss[i]); return 0; }
    }
    for (int l = 0; l < NLIN; l++) {
        char nm[64];
        snprintf(nm, sizeof nm, "%s.weight", names[l]);
        smp_param *pw = smp_model_find_param(m, nm);
        snprintf(nm, sizeof nm, "%s.bias", names[l]);
        smp_param *pb = smp_model_find_param(m, nm);
        if (!pw || !pb) { snprintf(why, cap, "parameter %s missing", names[l]); return 0; }
        if (!smp_module_is_local(smp_param_module(pw))) continue;
        size_t nw = (size_t)(lin_out[l] * lin_in[l]);
        if (memcmp(smp_param_grad(pw)->data, r->gw[l], nw * 4) || memcmp(smp_param_grad(pb)->data, r->gb[l], (size_t)lin_out[l] * 4)) {
            const float *g = (const float *)smp_param_grad(pw)->data;
            snprintf(why, cap, "gradient of %s differs (first element %.9g vs %.9g)", names[l], g[0], r->gw[l][0]);
            return 0;
        }
        if (memcmp(smp_param_value(pw)->data, r->w[l], nw * 4)) { snprintf(why, cap, "initial value of %s.weight differs", names[l]); return 0; }
    }
    return 1;
}

static int world;

static void run_case(int P, int m, smp_pipeline_kind kind, const int *placement, int vstages, const char *label) {
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = m;
    cfg.pipeline = kind;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.virtual_stages = vstages;
    cfg.seed = 7;
    if (placement) { cfg.auto_partition = SMP_OFF; }
    char name[160], why[4096] = "";
    snprintf(name, sizeof name, "pipeline/%s/P=%d/m=%d/%s", label, P, m, kind == SMP_PIPELINE_SIMPLE ? "simple" : "interleaved");
    smp_status st = smp_init(&cfg);
    if (st) { MPI_CHECK(0, name, "smp_init: %s", smp_last_error()); return; }
    net n;
    smp_model *model = build(&n, placement);
    ref_t ref;
    ref_params(&ref);
    int ok = model != NULL;
    if (!ok) snprintf(why, sizeof why, "build: %s", smp_last_error());
    for (int step = 0; step < 2 && ok; step++) { /* two steps: gradients accumulate across them too */
        smp_step_output outs[2] = {{0}};
        smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D), t = smp_tensor_2d(g_t, SMP_F32, B, C);
        st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 2, x, t);
        ref_step(&ref, g_x, g_t, m, true);
        if (st) { snprintf(why, sizeof why, "step %d: %s", step, smp_last_error()); ok = 0; }
        else ok = compare(model, &ref, outs, m, why, sizeof why);
        if (ok && outs[1].microbatches == m) { /* the outputs, concatenated, are the model's output on the batch */
            float all[B * C];
            smp_tensor cat = smp_tensor_2d(all, SMP_F32, B, C);
            if (smp_step_output_concat(&outs[1], &cat) || memcmp(all, ref.out, sizeof all)) { snprintf(why, sizeof why, "concatenated outputs differ"); ok = 0; }
        }
        if (ok) { /* stash peaks: simple holds every microbatch, 1F1B at most S - s */
            smp_step_stats ss = smp_last_step_stats(model);
            int S = smp_model_num_stages(model);
            for (int k = 0; k < ss.local_stages && ok; k++) {
                int s = ss.stage_index[k], want = kind == SMP_PIPELINE_SIMPLE ? m : (S - s < m ? S - s : m);
                bool one_per_rank = S == P;
                if (kind == SMP_PIPELINE_SIMPLE ? ss.peak_inflight[k] != want : (ss.peak_inflight[k] > want || (one_per_rank && ss.peak_inflight[k] != want))) {
                    snprintf(why, sizeof why, "stage %d held %d microbatches at its peak, expected %s%d", s, ss.peak_inflight[k], kind == SMP_PIPELINE_SIMPLE || one_per_rank ? "" : "at most ", want);
                    ok = 0;
                }
            }
        }
        smp_step_output_free(&outs[0]);
        smp_step_output_free(&outs[1]);
        int all_ok;
        MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD); /* every rank takes the same path */
        if (!all_ok && ok) { ok = 0; snprintf(why, sizeof why, "another rank failed at step %d", step); }
    }
    MPI_CHECK(ok, name, "%s", why);
    smp_model_free(model);
    smp_finalize();
}

/* One rank's module fails: every rank gets the error, and the next step works. */
static void run_error_case(int P) {
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = 4;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    smp_init(&cfg);
    net n;
    smp_model *model = build(&n, NULL);
    smp_step_output outs[1] = {{0}};
    smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D), t = smp_tensor_2d(g_t, SMP_F32, B, C);
    g_fail = P - 1;
    smp_model_trace(model, &x, 1); /* trace before failing, so the failure hits the step */
    smp_status st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x, t);
    g_fail = -1;
    char name[64];
    snprintf(name, sizeof name, "pipeline/module error reaches every rank/P=%d", P);
    MPI_CHECK(st != SMP_OK && strstr(smp_last_error(), "injected failure") && strstr(smp_last_error(), "module"), name, "status %d, message: %s", st, smp_last_error());
    st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x, t);
    snprintf(name, sizeof name, "pipeline/step after an error works/P=%d", P);
    MPI_CHECK(st == SMP_OK && outs[0].microbatches == 4, name, "%s", smp_last_error());
    /* a batch that does not divide into the microbatches */
    smp_tensor x5 = smp_tensor_2d(g_x, SMP_F32, 5, D), t5 = smp_tensor_2d(g_t, SMP_F32, 5, C);
    st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x5, t5);
    snprintf(name, sizeof name, "pipeline/indivisible batch is an error/P=%d", P);
    MPI_CHECK(st == SMP_ERR_ARG && strstr(smp_last_error(), "batch of 5") && strstr(smp_last_error(), "4 microbatches"), name, "%s", smp_last_error());
    /* evaluation: forward only, outputs equal the reference forward */
    ref_t ref;
    ref_params(&ref);
    ref_step(&ref, g_x, g_t, 4, false);
    smp_step_output eo[2] = {{0}, {0}};
    st = SMP_EVAL_STEP(model, mse_body, NULL, eo, 2, x, t);
    float all[B * C];
    smp_tensor cat = smp_tensor_2d(all, SMP_F32, B, C);
    snprintf(name, sizeof name, "pipeline/evaluation step outputs/P=%d", P);
    MPI_CHECK(st == SMP_OK && !smp_step_output_concat(&eo[1], &cat) && !memcmp(all, ref.out, sizeof all), name, "%s", st ? smp_last_error() : "outputs differ");
    float mean_ref = 0, sum;
    for (int i = 0; i < 4; i++) mean_ref += ref.loss[i];
    smp_tensor s1 = smp_tensor_make(&sum, SMP_F32, 0, NULL);
    snprintf(name, sizeof name, "pipeline/StepOutput reduce_sum and mean/P=%d", P);
    MPI_CHECK(!smp_step_output_reduce_sum(&eo[0], &s1) && fabsf(sum - mean_ref) <= 1e-6f * fabsf(mean_ref) &&
              fabs(smp_step_output_mean(&eo[0]) - mean_ref / 4) <= 1e-6 * fabs(mean_ref), name, "sum %g vs %g", sum, mean_ref);
    smp_step_output_free(&outs[0]);
    smp_step_output_free(&eo[0]);
    smp_step_output_free(&eo[1]);
    smp_model_free(model);
    smp_finalize();
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    uint64_t s = 99;
    for (int i = 0; i < B * D; i++) g_x[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    for (int i = 0; i < B * C; i++) g_t[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    static const int ms[] = {1, 2, 3, 4, 8};
    for (int P = 1; P <= world && P <= 4; P *= 2) {
        if (world % P) continue;
        for (int k = 0; k < 5; k++) {
            run_case(P, ms[k], SMP_PIPELINE_SIMPLE, NULL, 1, "auto");
            run_case(P, ms[k], SMP_PIPELINE_INTERLEAVED, NULL, 1, "auto");
        }
    }
    if (world % 2 == 0) {
        static const int manual[7] = {0, 0, 1, 1, 0, 0, 1}; /* stages on ranks 0,1,0,1 */
        for (int k = 0; k < 5; k++) {
            run_case(2, ms[k], SMP_PIPELINE_INTERLEAVED, manual, 1, "manual 0,1,0,1");
            run_case(2, ms[k], SMP_PIPELINE_SIMPLE, manual, 1, "manual 0,1,0,1");
            run_case(2, ms[k], SMP_PIPELINE_INTERLEAVED, NULL, 2, "auto, 2 virtual stages");
        }
    }
    for (int P = 1; P <= world && P <= 4; P *= 2)
        if (world % P == 0) run_error_case(P);
    (void)g_losses;
    int rc = test_exit_code();
    MPI_Finalize();
    return rc;
}
