/* test_tp.c - tensor parallelism: sharded parameters, the TP modules, and a
   Megatron MLP trained at tp = world size against references.

   The model: two blocks, each tp_copy -> a column-parallel linear + ReLU
   (W1 [F, H] and b1 [F] sharded along axis 0) -> a row-parallel linear
   without bias (W2 [H, F] sharded along axis 1) -> tp_reduce -> a bias
   (b2 [H], whole). Every rank of a TP group gets the same batch.

   Checks:
     1. each rank's slice of a sharded parameter is the slice of the full
        tensor the init callback fills (shape, offset and full shape queries);
     2. tp = world, 20 SGD steps: losses and every parameter within 1e-5 of
        the largest entry of a plain float32 one-process reference; the first
        step's gradients within 1e-5 of a float64 reference;
     3. recomputation at the same tp: bitwise equal; pipelines: pp 2 x tp 2
        (4 ranks) and pp 2 x tp 1 (2 ranks) bitwise equal to pp 1 at the same
        tp on half the ranks (smp inside a sub-communicator);
     4. tp_scatter then tp_gather along axis 0 and 1, deterministic or not:
        the output and the gradient of a parameter before them exact;
     5. bad input: a shard axis tp does not divide, a TP module whose input
        shape differs across the TP group (an error on every rank naming both
        shapes), tp > 1 without a sharded parameter (a warning).

   Run: mpirun -n 1|2|4 build/gcc/test_tp */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tp_mlp.h"

typedef struct run_result {
    smp_status st;
    double loss[STEPS];
    float *value[BLOCKS * 4], *grad1[BLOCKS * 4]; /* after the last step; the first step's gradients */
    double norm1;                                 /* smp_clip_grad_norm's of the first step's gradients */
} run_result;


static void result_alloc(run_result *r, int wide) {
    memset(r, 0, sizeof *r);
    for (int k = 0; k < BLOCKS * 4; k++) {
        r->value[k] = (float *)calloc((size_t)numel_of(k, wide), sizeof(float));
        r->grad1[k] = (float *)calloc((size_t)numel_of(k, wide), sizeof(float));
    }
}
static void result_free(run_result *r) {
    for (int k = 0; k < BLOCKS * 4; k++) { free(r->value[k]); free(r->grad1[k]); }
}

/* Trains STEPS steps at (pp, tp) inside comm; every rank of comm gets the results. */
static void run(MPI_Comm comm, int pp, int tp, bool recompute, bool deterministic, run_result *r) {
    result_alloc(r, F);
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.comm = comm;
    cfg.partitions = pp;
    cfg.tensor_parallel_degree = tp;
    cfg.microbatches = MB;
    cfg.auto_partition = SMP_OFF;
    cfg.deterministic_reduction = deterministic ? SMP_ON : SMP_DEFAULT;
    int size;
    MPI_Comm_size(comm, &size);
    if (size > pp * tp) cfg.ddp = SMP_ON;
    if ((r->st = smp_init(&cfg))) return;
    net n;
    build(&n, pp > 1, recompute, F);
    r->st = smp_model_new(n.root, &(smp_model_desc){.forward = net_forward, .ninputs = 1, .user = &n}, &n.model);
    for (int s = 0; s < STEPS && !r->st; s++) {
        float x[BATCH * H], t[BATCH * H];
        batch_of(s, x, t);
        smp_tensor xt = smp_tensor_2d(x, SMP_F32, BATCH, H), tt = smp_tensor_2d(t, SMP_F32, BATCH, H);
        smp_step_output loss;
        memset(&loss, 0, sizeof loss);
        smp_model_zero_grad(n.model);
        r->st = SMP_TRAIN_STEP(n.model, mse_body, NULL, &loss, 1, xt, tt);
        if (r->st) break;
        r->loss[s] = smp_step_output_reduce_mean_f64(&loss);
        smp_step_output_free(&loss);
        if (s == 0) full_params(&n, true, r->grad1);
        if (s == 0 && !r->st) r->st = smp_clip_grad_norm(n.model, INFINITY, &r->norm1);
        sgd_step(n.model);
    }
    if (!r->st) full_params(&n, false, r->value);
    smp_model_free(n.model);
    smp_finalize();
}

/* ------------------------------------------------------------ the references */
/* One process, whole tensors, in float (T = float) or double: the same math. */
#define REF(T, NAME) \
    static void NAME(double *loss, double **value, double **grad1) { \
        T w1[BLOCKS][F * H], b1[BLOCKS][F], w2[BLOCKS][H * F], b2[BLOCKS][H]; \
        T *ps[BLOCKS * 4]; \
        int64_t sizes[4] = {F * H, F, H * F, H}; \
        for (int b = 0; b < BLOCKS; b++) { \
            ps[b * 4] = w1[b]; \
            ps[b * 4 + 1] = b1[b]; \
            ps[b * 4 + 2] = w2[b]; \
            ps[b * 4 + 3] = b2[b]; \
        } \
        static const char *names[4] = {"b%d_fc.weight", "b%d_fc.bias", "b%d_proj.weight", "b%d_bias.bias"}; \
        for (int k = 0; k < BLOCKS * 4; k++) { \
            char nm[64]; \
            snprintf(nm, sizeof nm, names[k % 4], k / 4); \
            float tmp[F * H]; \
            smp_tensor tt = smp_tensor_1d(tmp, SMP_F32, sizes[k % 4]); \
            if (k % 4 != 3) { \
                tt.ndim = 2; \
                tt.shape[0] = k % 4 == 1 ? 1 : k % 4 == 0 ? F : H; \
                tt.shape[1] = k % 4 == 1 ? F : k % 4 == 0 ? H : F; \
            } \
            smp_init_uniform(&tt, smp_param_seed(nm), &g_bound); \
            for (int64_t e = 0; e < sizes[k % 4]; e++) ps[k][e] = (T)tmp[e]; \
        } \
        for (int s = 0; s < STEPS; s++) { \
            float xf[BATCH * H], tf[BATCH * H]; \
            batch_of(s, xf, tf); \
            T g[BLOCKS * 4][F * H]; \
            memset(g, 0, sizeof g); \
            double total = 0; \
            for (int m = 0; m < MB; m++) { \
                enum { R = BATCH / MB }; \
                T act[BLOCKS + 1][R * H], hid[BLOCKS][R * F], gh[R * H], gz[R * F]; \
                for (int i = 0; i < R * H; i++) act[0][i] = (T)xf[m * R * H + i]; \
                for (int b = 0; b < BLOCKS; b++) { \
                    for (int r = 0; r < R; r++) \
                        for (int o = 0; o < F; o++) { \
                            T acc = b1[b][o]; \
                            for (int i = 0; i < H; i++) acc += act[b][r * H + i] * w1[b][o * H + i]; \
                            hid[b][r * F + o] = acc > 0 ? acc : 0; \
                        } \
                    for (int r = 0; r < R; r++) \
                        for (int h = 0; h < H; h++) { \
                            T acc = 0; \
                            for (int i = 0; i < F; i++) acc += hid[b][r * F + i] * w2[b][h * F + i]; \
                            act[b + 1][r * H + h] = acc + b2[b][h]; \
                        } \
                } \
                T l = 0; \
                for (int i = 0; i < R * H; i++) { \
                    T d = act[BLOCKS][i] - (T)tf[m * R * H + i]; \
                    l += (T)0.5 * d * d; \
                    gh[i] = d; \
                } \
                total += (double)l; \
                for (int b = BLOCKS - 1; b >= 0; b--) { \
                    T *gw1 = g[b * 4], *gb1 = g[b * 4 + 1], *gw2 = g[b * 4 + 2], *gb2 = g[b * 4 + 3]; \
                    for (int h = 0; h < H; h++) { \
                        T sb = 0; \
                        for (int r = 0; r < R; r++) sb += gh[r * H + h]; \
                        gb2[h] += sb; \
                    } \
                    for (int h = 0; h < H; h++) \
                        for (int i = 0; i < F; i++) { \
                            T sw = 0; \
                            for (int r = 0; r < R; r++) sw += gh[r * H + h] * hid[b][r * F + i]; \
                            gw2[h * F + i] += sw; \
                        } \
                    for (int r = 0; r < R; r++) \
                        for (int i = 0; i < F; i++) { \
                            T acc = 0; \
                            for (int h = 0; h < H; h++) acc += gh[r * H + h] * w2[b][h * F + i]; \
                            gz[r * F + i] = hid[b][r * F + i] > 0 ? acc : 0; \
                        } \
                    for (int o = 0; o < F; o++) { \
                        T sb = 0; \
                        for (int r = 0; r < R; r++) sb += gz[r * F + o]; \
                        gb1[o] += sb; \
                        for (int i = 0; i < H; i++) { \
                            T sw = 0; \
                            for (int r = 0; r < R; r++) sw += gz[r * F + o] * act[b][r * H + i]; \
                            gw1[o * H + i] += sw; \
                        } \
                    } \
                    for (int r = 0; r < R; r++) \
                        for (int i = 0; i < H; i++) { \
                            T acc = 0; \
                            for (int o = 0; o < F; o++) acc += gz[r * F + o] * w1[b][o * H + i]; \
                            gh[r * H + i] = acc; \
                        } \
                } \
            } \
            loss[s] = total / MB; \
            for (int k = 0; k < BLOCKS * 4; k++) \
                for (int64_t e = 0; e < sizes[k % 4]; e++) { \
                    T ge = g[k][e] / (T)MB; \
                    if (s == 0) grad1[k][e] = (double)ge; \
                    ps[k][e] -= (T)LR * ge; \
                } \
        } \
        for (int k = 0; k < BLOCKS * 4; k++) \
            for (int64_t e = 0; e < sizes[k % 4]; e++) value[k][e] = (double)ps[k][e]; \
    }
REF(float, ref_f32)
REF(double, ref_f64)

/* Largest |a - b| over a tensor, against its largest |b|. */
static double rel_err(const float *a, const double *b, int64_t n) {
    double worst = 0, big = 0;
    for (int64_t e = 0; e < n; e++) {
        worst = fmax(worst, fabs((double)a[e] - b[e]));
        big = fmax(big, fabs(b[e]));
    }
    return big > 0 ? worst / big : worst;
}

static bool same_bits(const run_result *a, const run_result *b, char *why, size_t cap) {
    if (memcmp(a->loss, b->loss, sizeof a->loss)) {
        snprintf(why, cap, "losses differ: %.9g vs %.9g", a->loss[0], b->loss[0]);
        return false;
    }
    for (int k = 0; k < BLOCKS * 4; k++)
        if (memcmp(a->value[k], b->value[k], sizeof(float) * (size_t)numel_of(k, F)) ||
            memcmp(a->grad1[k], b->grad1[k], sizeof(float) * (size_t)numel_of(k, F))) {
            snprintf(why, cap, "parameter %d (or its first gradient) differs", k);
            return false;
        }
    return true;
}

/* ------------------------------------------------------------ checks */
static void test_against_references(int world) {
    run_result r;
    run(MPI_COMM_WORLD, 1, world, false, false, &r);
    char name[96];
    snprintf(name, sizeof name, "tp/mlp/tp=%d/trains", world);
    MPI_CHECK(r.st == SMP_OK, name, "%s", smp_last_error());
    if (r.st) { result_free(&r); return; }
    double loss32[STEPS], loss64[STEPS], *v32[BLOCKS * 4], *g32[BLOCKS * 4], *v64[BLOCKS * 4], *g64[BLOCKS * 4];
    for (int k = 0; k < BLOCKS * 4; k++) {
        v32[k] = (double *)calloc((size_t)numel_of(k, F), sizeof(double));
        g32[k] = (double *)calloc((size_t)numel_of(k, F), sizeof(double));
        v64[k] = (double *)calloc((size_t)numel_of(k, F), sizeof(double));
        g64[k] = (double *)calloc((size_t)numel_of(k, F), sizeof(double));
    }
    ref_f32(loss32, v32, g32);
    ref_f64(loss64, v64, g64);
    double worst_loss = 0, worst_value = 0, worst_grad = 0;
    for (int s = 0; s < STEPS; s++) worst_loss = fmax(worst_loss, fabs(r.loss[s] - loss32[s]) / fabs(loss32[s]));
    for (int k = 0; k < BLOCKS * 4; k++) {
        worst_value = fmax(worst_value, rel_err(r.value[k], v32[k], numel_of(k, F)));
        worst_grad = fmax(worst_grad, rel_err(r.grad1[k], g64[k], numel_of(k, F)));
    }
    snprintf(name, sizeof name, "tp/mlp/tp=%d/20_steps_match_float32_reference", world);
    MPI_CHECK(worst_loss < 1e-5 && worst_value < 1e-5, name, "loss off by %.3g, parameters by %.3g (relative)",
              worst_loss, worst_value);
    double sq = 0;
    for (int k = 0; k < BLOCKS * 4; k++)
        for (int64_t e = 0; e < numel_of(k, F); e++) sq += (double)r.grad1[k][e] * r.grad1[k][e];
    snprintf(name, sizeof name, "tp/mlp/tp=%d/gradient_norm_counts_each_shard_once", world);
    MPI_CHECK(fabs(r.norm1 - sqrt(sq)) <= 1e-12 * sqrt(sq), name,
              "smp_clip_grad_norm gave %.17g, the full gradients' norm is %.17g", r.norm1, sqrt(sq));
    snprintf(name, sizeof name, "tp/mlp/tp=%d/gradients_match_float64_reference", world);
    MPI_CHECK(worst_grad < 1e-5, name, "first step's gradients off by %.3g of each tensor's largest entry", worst_grad);
    for (int k = 0; k < BLOCKS * 4; k++) { free(v32[k]); free(g32[k]); free(v64[k]); free(g64[k]); }

    run_result rc;
    run(MPI_COMM_WORLD, 1, world, true, false, &rc);
    char why[256] = "";
    snprintf(name, sizeof name, "tp/mlp/tp=%d/recompute_bitwise", world);
    MPI_CHECK(rc.st == SMP_OK && same_bits(&r, &rc, why, sizeof why), name, "%s %s", smp_last_error(), why);
    result_free(&rc);
    result_free(&r);
}

/* pp 2 x tp (world / 2) against pp 1 x tp on each half of the world. */
static void test_pipelined(int world) {
    if (world < 2 || world % 2) return;
    int rank, tp = world / 2;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm half;
    MPI_Comm_split(MPI_COMM_WORLD, rank / tp, rank, &half);
    run_result a, b;
    run(half, 1, tp, false, true, &a);
    run(MPI_COMM_WORLD, 2, tp, false, true, &b);
    MPI_Comm_free(&half);
    char name[96], why[256] = "";
    snprintf(name, sizeof name, "tp/mlp/pp=2_tp=%d_equals_pp=1_bitwise", tp);
    MPI_CHECK(a.st == SMP_OK && b.st == SMP_OK && same_bits(&a, &b, why, sizeof why), name, "%s %s", smp_last_error(),
              why);
    result_free(&a);
    result_free(&b);
}

/* ------------------------------------------------------------ sharded init */
static void test_sharded_init(int world) {
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.tensor_parallel_degree = world;
    cfg.seed = 5;
    if (smp_init(&cfg)) { MPI_CHECK(0, "tp/sharded_init/init", "%s", smp_last_error()); return; }
    net n;
    build(&n, false, false, F);
    smp_status st = smp_model_new(n.root, &(smp_model_desc){.forward = net_forward, .user = &n}, &n.model);
    float x[BATCH * H] = {0};
    smp_tensor xt = smp_tensor_2d(x, SMP_F32, BATCH, H);
    if (!st) st = smp_model_trace(n.model, &xt, 1);
    char why[256] = "";
    bool ok = st == SMP_OK;
    for (int k = 0; ok && k < BLOCKS * 4; k++) {
        smp_param *p = n.params[k];
        int64_t shape[SMP_MAX_DIMS];
        int nd = smp_param_full_shape(p, shape), axis = smp_param_shard_axis(p);
        int nb = axis < 0 ? 1 : k / 4 == 1 ? SPLITS : 1; /* block 1 is sharded in SPLITS blocks */
        float full[F * H];
        smp_tensor ft = smp_tensor_make(full, SMP_F32, nd, shape);
        smp_init_uniform(&ft, smp_param_seed(smp_param_name(p)), &g_bound);
        const smp_tensor *v = smp_param_value(p);
        int64_t want_off = axis < 0 ? 0 : shape[axis] / nb / world * smp_tp_rank();
        ok = smp_param_shard_offset(p) == want_off && (axis < 0 || smp_param_shard_blocks(p) == nb) &&
             (axis < 0 ? v->shape[0] == shape[0] : v->shape[axis] * world == shape[axis]);
        if (!ok) {
            snprintf(why, sizeof why, "%s: offset %lld, %d blocks, local dim %lld", smp_param_name(p),
                     (long long)smp_param_shard_offset(p), smp_param_shard_blocks(p),
                     (long long)v->shape[axis < 0 ? 0 : axis]);
            break;
        }
        /* each local element against its full one: block j of the axis holds local rows j x per .. of it */
        int a = axis < 0 ? 0 : axis;
        int64_t per = v->shape[a] / nb, span = shape[a] / nb, idx[SMP_MAX_DIMS] = {0};
        for (int64_t e = 0; ok && e < smp_tensor_numel(v); e++) {
            int64_t rest = e, at = 0;
            for (int d = nd - 1; d >= 0; d--) {
                idx[d] = rest % v->shape[d];
                rest /= v->shape[d];
            }
            idx[a] = idx[a] / per * span + want_off + idx[a] % per; /* the full tensor's index along the axis */
            for (int d = 0; d < nd; d++) at = at * shape[d] + idx[d];
            ok = ((const float *)v->data)[e] == full[at];
        }
        if (!ok) snprintf(why, sizeof why, "%s: the slice differs from the full tensor's", smp_param_name(p));
    }
    MPI_CHECK(ok, "tp/sharded_init/slices_of_the_full_tensor", "%s %s", st ? smp_last_error() : "", why);
    smp_model_free(n.model);
    smp_finalize();
}

/* ------------------------------------------------------------ gather and scatter */
static char g_log[1024];
static void capture_log(smp_log_level level, const char *msg, void *user) {
    (void)user;
    if (level == SMP_LOG_WARN && !g_log[0]) snprintf(g_log, sizeof g_log, "%s", msg);
}

static smp_status scale_forward(smp_call_ctx *c) { /* y = x * w, w [H] along the last axis */
    smp_param **p = (smp_param **)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    for (int64_t e = 0; e < smp_tensor_numel(x); e++)
        ((float *)y->data)[e] = ((const float *)x->data)[e] * ((const float *)smp_param_value(p[0])->data)[e % H];
    return SMP_OK;
}
static smp_status scale_backward(smp_call_ctx *c) {
    smp_param **p = (smp_param **)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *g = smp_call_grad_output(c, 0);
    for (int64_t e = 0; e < smp_tensor_numel(x); e++)
        ((float *)smp_param_grad(p[0])->data)[e % H] += ((const float *)x->data)[e] * ((const float *)g->data)[e];
    return SMP_OK;
}
static smp_module *g_chain[4];
static int g_nchain;
static smp_status chain_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *u) {
    (void)m; (void)nin; (void)nout; (void)u;
    smp_tensor h = in[0];
    for (int k = 0; k < g_nchain; k++) SMP_TRY(smp_call(g_chain[k], &h, 1, k == g_nchain - 1 ? out : &h, 1));
    return SMP_OK;
}
/* A weight for each position, so that a result in the wrong place changes the loss and the gradients. */
static float place_weight(int64_t e) { return (float)(e % 7 + 1); }
SMP_STEP_BODY(sum_body) { /* loss = the weighted sum of the output */
    const smp_tensor *y = smp_mb_output(mb, 0);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    float loss = 0;
    for (int64_t e = 0; e < smp_tensor_numel(y); e++) {
        loss += ((const float *)y->data)[e] * place_weight(e);
        ((float *)g->data)[e] = place_weight(e);
    }
    return smp_mb_return_f32(mb, 0, loss);
}

/* scale -> tp_scatter(axis) -> tp_gather(axis): y = tp x (x w) on every rank; w's gradient tp x the column sums of x,
   each entry weighted by the gradient the loss gives its place. */
static void test_gather_scatter(int world) {
    for (int v = 0; v < 4; v++) {
        int axis = v % 2;
        bool deterministic = v >= 2;
        smp_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.tensor_parallel_degree = world;
        cfg.deterministic_reduction = deterministic ? SMP_ON : SMP_DEFAULT;
        char name[128];
        snprintf(name, sizeof name, "tp/scatter_gather/axis=%d%s", axis, deterministic ? "/deterministic" : "");
        if (smp_init(&cfg)) { MPI_CHECK(0, name, "%s", smp_last_error()); continue; }
        smp_set_logger(capture_log, NULL); /* nothing is sharded here: smp warns */
        smp_module *root = smp_module_new(NULL, "", NULL);
        smp_param *w[1];
        g_chain[0] = smp_module_new(root, "scale", &(smp_module_desc){scale_forward, scale_backward, w});
        w[0] = smp_param_new(g_chain[0], "w", SMP_F32, 1, (int64_t[]){H}, smp_init_uniform, &g_bound);
        g_chain[1] = smp_module_new_tp_scatter(root, "scatter", axis);
        g_chain[2] = smp_module_new_tp_gather(root, "gather", axis);
        g_nchain = 3;
        smp_model *m = NULL;
        smp_status st = smp_model_new(root, &(smp_model_desc){.forward = chain_forward}, &m);
        smp_set_logger(NULL, NULL);
        float x[BATCH * H], t[BATCH * H];
        batch_of(3, x, t);
        smp_tensor xt = smp_tensor_2d(x, SMP_F32, BATCH, H);
        smp_step_output loss;
        memset(&loss, 0, sizeof loss);
        if (!st) st = SMP_TRAIN_STEP(m, sum_body, NULL, &loss, 1, xt);
        double want_loss = 0, got = st ? 0 : smp_step_output_reduce_mean_f64(&loss), worst = 0;
        const float *wv = st ? NULL : (const float *)smp_param_value(w[0])->data,
                    *gw = st ? NULL : (const float *)smp_param_grad(w[0])->data;
        for (int j = 0; !st && j < H; j++) {
            double col = 0;
            for (int r = 0; r < BATCH; r++) {
                col += x[r * H + j] * place_weight(r * H + j);
                want_loss += (double)world * x[r * H + j] * wv[j] * place_weight(r * H + j);
            }
            worst = fmax(worst, fabs(gw[j] - world * col) / (world * fabs(col) + 1e-3));
        }
        bool ok = !st && fabs(got - want_loss) <= 1e-5 * fabs(want_loss) + 1e-6 && worst < 1e-5;
        MPI_CHECK(ok, name, "%s: sum of the output %.9g, want %.9g; w's gradient off by %.3g",
                  st ? smp_last_error() : "ok", got, want_loss, worst);
        smp_step_output_free(&loss);
        smp_model_free(m);
        smp_finalize();
    }
}

/* ------------------------------------------------------------ bad input */
/* a shape that depends on the tp rank: a bug the TP modules must catch */
static smp_status uneven_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, (int64_t[]){x->shape[0], H + smp_tp_rank()});
    if (!y) return SMP_ERR_NOMEM;
    memset(y->data, 0, smp_tensor_nbytes(y));
    return SMP_OK;
}

static void test_bad_input(int world) {
    if (world < 2) return;
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.tensor_parallel_degree = world;
    float x[BATCH * H] = {0};
    smp_tensor xt = smp_tensor_2d(x, SMP_F32, BATCH, H);

    /* a shard axis tp does not divide */
    if (smp_init(&cfg)) return;
    smp_module *root = smp_module_new(NULL, "", NULL);
    smp_module *lin = smp_module_new(root, "odd", &(smp_module_desc){col_forward, col_backward, NULL});
    smp_param_new_sharded(lin, "weight", SMP_F32, 2, (int64_t[]){world + 1, H}, 0, smp_init_uniform, NULL);
    smp_model *m = NULL;
    smp_status st = smp_model_new(root, &(smp_model_desc){.forward = net_forward}, &m);
    char name[96];
    snprintf(name, sizeof name, "tp/bad/shard_axis_not_divisible");
    MPI_CHECK(st == SMP_ERR_CONFIG && strstr(smp_last_error(), "\"odd.weight\"") &&
                  strstr(smp_last_error(), "does not divide") && !m,
              name, "%s: %s", smp_status_name(st), smp_last_error());
    smp_finalize();

    /* blocks of a shard axis that tp does not split: the block named, on every rank */
    if (smp_init(&cfg)) return;
    root = smp_module_new(NULL, "", NULL);
    lin = smp_module_new(root, "fused", &(smp_module_desc){col_forward, col_backward, NULL});
    smp_param_new_sharded_blocks(lin, "weight", SMP_F32, 2, (int64_t[]){3 * (world + 1), H}, 0, 3, smp_init_uniform,
                                 NULL);
    m = NULL;
    st = smp_model_new(root, &(smp_model_desc){.forward = net_forward}, &m);
    char want_blocks[96];
    snprintf(want_blocks, sizeof want_blocks, "in 3 blocks of %d, which tensor_parallel_degree = %d does not divide",
             world + 1, world);
    MPI_CHECK(st == SMP_ERR_CONFIG && strstr(smp_last_error(), "\"fused.weight\"") &&
                  strstr(smp_last_error(), want_blocks) && strstr(smp_last_error(), "make each block a multiple") && !m,
              "tp/bad/shard_blocks_not_divisible", "%s: %s", smp_status_name(st), smp_last_error());
    smp_finalize();

    /* blocks that do not divide the axis itself: an error as the model is declared */
    if (smp_init(&cfg)) return;
    root = smp_module_new(NULL, "", NULL);
    lin = smp_module_new(root, "fused", &(smp_module_desc){col_forward, col_backward, NULL});
    smp_param *bp = smp_param_new_sharded_blocks(lin, "weight", SMP_F32, 2, (int64_t[]){10, H}, 0, 3, smp_init_uniform,
                                                 NULL);
    m = NULL;
    st = smp_model_new(root, &(smp_model_desc){.forward = net_forward}, &m);
    MPI_CHECK(!bp && st == SMP_ERR_ARG && strstr(smp_last_error(), "3 blocks do not split its shard axis 0 of size 10") &&
                  !m,
              "tp/bad/blocks_do_not_split_the_axis", "%s: %s", smp_status_name(st), smp_last_error());
    smp_finalize();

    /* shapes that differ across the TP group: an error on every rank, naming both */
    if (smp_init(&cfg)) return;
    root = smp_module_new(NULL, "", NULL);
    g_chain[0] = smp_module_new(root, "uneven", &(smp_module_desc){uneven_forward, NULL, NULL});
    g_chain[1] = smp_module_new_tp_reduce(root, "reduce");
    g_nchain = 2;
    smp_set_logger(capture_log, NULL); /* nothing is sharded here: smp warns */
    st = smp_model_new(root, &(smp_model_desc){.forward = chain_forward}, &m);
    smp_set_logger(NULL, NULL);
    if (!st) st = smp_model_trace(m, &xt, 1);
    char want[64];
    snprintf(want, sizeof want, "f32[4, %d] on tp rank 1", H + 1);
    MPI_CHECK(st != SMP_OK && strstr(smp_last_error(), "\"reduce\"") && strstr(smp_last_error(), want) &&
                  strstr(smp_last_error(), "on tp rank 0"),
              "tp/bad/shapes_differ_across_the_tp_group", "%s: %s", smp_status_name(st), smp_last_error());
    smp_model_free(m);
    smp_finalize();

    /* tp > 1 and nothing sharded: a warning on rank 0 */
    if (smp_init(&cfg)) return;
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    g_log[0] = 0;
    smp_set_logger(capture_log, NULL);
    root = smp_module_new(NULL, "", NULL);
    g_chain[0] = smp_module_new_tp_copy(root, "copy");
    g_nchain = 1;
    st = smp_model_new(root, &(smp_model_desc){.forward = chain_forward}, &m);
    smp_set_logger(NULL, NULL);
    MPI_CHECK(st == SMP_OK && (rank != 0 || strstr(g_log, "declares no sharded parameter")),
              "tp/bad/nothing_sharded_warns", "%s; rank 0 logged '%s'", smp_last_error(), g_log);
    smp_model_free(m);
    smp_finalize();
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int world;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    test_sharded_init(world);
    test_against_references(world);
    test_pipelined(world);
    test_gather_scatter(world);
    test_bad_input(world);
    int failed = test_exit_code();
    MPI_Finalize();
    return failed;
}
