/* test_tied.c - a SHARED (tied) module: one module called first and last.

   The model, eight top-level calls on [rows, TD] activations:
       0 tied   a0 = x W^T + b          (the shared module, first call)
       1 fc1    a1 = a0 W1^T + b1
       2 act1   a2 = relu(a1)
       3 fc2    a3 = a2 W2^T + b2
       4 act2   a4 = relu(a3)
       5 skip   a5 = a4 + a0             (a0 feeds calls 1 and 5)
       6 fc3    a6 = a5 W3^T + b3
       7 tied   y  = a6 W^T + b          (the same module, last call)
   loss: MSE against a target, in the step body. `tied` is one leaf module
   with one weight and one bias; under auto partitioning (or called through
   composites placed there) calls 0 and 7 land on the first and the last
   partition, and both hold a copy.

   The reference is the same net in plain C with net7.h's kernels and the
   documented accumulation order: a non-shared parameter gets every
   microbatch's sum added in increasing order directly into its gradient; a
   value that feeds several calls gets their gradients summed latest
   consumer first; the shared W and b get, per call, a buffer that starts
   at zero and takes the microbatches in increasing order, then
   grad += call 0's buffer, grad += call 7's buffer. With data parallelism
   each replica computes its gradient so, and the replicas are summed in
   dp-rank order (deterministic_reduction), the loss gradient divided by
   microbatches x dp.

   Checks (each for every partition count P in {1, 2, 4} the world allows,
   the rest of the world as data-parallel replicas, each with its own shard
   of the global batch, summed with deterministic_reduction):
   - 3 SGD steps (the second one without smp_model_zero_grad when dp = 1,
     so gradients accumulate across steps): every microbatch's loss, the
     model's outputs, every local parameter's gradient and value bitwise
     equal to the reference, and an evaluation step's outputs after
     training; simple, interleaved and zero_bubble pipelines (zero_bubble
     also with every linear's backward split into B and W, the tied
     module's too: each call's W adds into that call's share of W and b);
     auto partitioning (also
     with the tied calls inside composites), interleaved virtual stages
     (virtual_stages = 2, P = 2 and 4), manual placement; and zero_bubble_v
     (2P stages in a V: calls 0 and 7 both on partition 0, one copy there),
     auto, through embed and head, and manual V placements. A wrong tied
     gradient is named: one call dropped, a call twice, the wrong order.
   - Manual placement puts a leaf call on its module's SMP_PARTITION
     context, else on the context of the composite call around it, else on
     default_partition. So the tied module created in no context and
     called through composites "embed" (first partition) and "head" (last)
     gets copies on both; created in partition k (top level, or through
     embed and head), both its calls run on k; created in no context at top
     level, on default_partition. Each placement is checked as such.
   - The tied module is local exactly on the partitions that run calls 0
     and 7 (the first and the last, wherever auto partitioning or
     embed/head put them), smp_module_partition is the partition of call 0,
     the model counts its parameters once, and every copy of W and b is
     identical on every rank after training.
   - DDP 2x2 (world 4, partitions 2, ddp, deterministic_reduction): the
     same, bitwise, against the one-process reference of the global batch
     (auto, manual 0,1,0,1 and 2 virtual stages).
   - Checkpoints: trained at the largest P (4), with an "exp_avg" of
     optimizer state registered for every local parameter (so on both
     copies of the tied ones), saved full and partial; the full file and
     the partial files together hold tied.weight and its optimizer state
     once; both load at P = 1, 2 and 4, where every rank holding a copy
     gets the saved parameters and optimizer state bitwise, and one more
     step equals the reference continued.
   - Float64: test/tied_ref.py (numpy) recomputes the first step's loss and
     gradients from the inputs, targets and initial parameters this test
     writes (whatever the bitwise check said), checks smp's to float32
     rounding, checks its own backward by finite differences, and checks
     that dropping either call's share of W (or b) would fail; a missing
     python3 or numpy is a SKIP.

   Build and run from the repository root:
     make build/gcc/test_tied && mpirun -n 4 build/gcc/test_tied */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, setenv (net7.h) */
#define SMP_TESTING /* the test hooks and test-only introspection */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h"
#include "test.h"
#include "net7.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

enum { TB = 24, TD = 8, MAXDP = 4, MAXM = 8, NP = 8, NCALLS = 8, STEPS = 3, WN = TD * TD };
static const char *pnames[NP] = {"tied.weight", "tied.bias", "fc1.weight", "fc1.bias",
                                 "fc2.weight",  "fc2.bias",  "fc3.weight", "fc3.bias"};
static int psize(int k) { return k % 2 == 0 ? WN : TD; }
static const float LR = 0.1f;

static int world, me;
static float g_x[MAXDP * TB * TD], g_t[MAXDP * TB * TD];
static char dir[256];

/* ---------------------------------------------------------------- the model on smp */
typedef struct {
    smp_module *root, *tied, *fc[3], *act[2], *skip;
    smp_module *embed, *head; /* NULL, or composites whose forward calls tied */
    lin_state st[4];          /* 0: tied, 1..3: fc1..fc3 */
} tnet;

/* embed and head: composites that only call the tied module */
static smp_status wrap_forward(smp_call_ctx *c) {
    tnet *n = (tnet *)smp_module_user(smp_call_module(c));
    smp_tensor y;
    SMP_TRY(smp_call(n->tied, smp_call_input(c, 0), 1, &y, 1));
    return smp_call_set_output(c, 0, &y);
}

static smp_status tnet_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m; (void)nin; (void)nout;
    tnet *n = (tnet *)user;
    smp_tensor a0, a1, a2, a3, a4, a5, a6, pair[2];
    SMP_TRY(smp_call(n->embed ? n->embed : n->tied, &in[0], 1, &a0, 1));
    SMP_TRY(smp_call(n->fc[0], &a0, 1, &a1, 1));
    SMP_TRY(smp_call(n->act[0], &a1, 1, &a2, 1));
    SMP_TRY(smp_call(n->fc[1], &a2, 1, &a3, 1));
    SMP_TRY(smp_call(n->act[1], &a3, 1, &a4, 1));
    pair[0] = a4;
    pair[1] = a0; /* the skip connection from the tied module's first call */
    SMP_TRY(smp_call(n->skip, pair, 2, &a5, 1));
    SMP_TRY(smp_call(n->fc[2], &a5, 1, &a6, 1));
    /* the same module again: tied output projection */
    SMP_TRY(smp_call(n->head ? n->head : n->tied, &a6, 1, &out[0], 1));
    return SMP_OK;
}

/* Where the modules go. Manual placement puts a leaf call on its module's
   SMP_PARTITION context, else on the context of the composite call around
   it, else on default_partition: a top-level tied module runs both calls
   on one partition; wrapped in composites created on the first and the
   last partition, and created in no context itself, it runs one call on
   each and has a copy on both. */
typedef struct {
    const int *placement;      /* NULL: auto; else the partitions of fc1 act1 fc2 act2 skip fc3 */
    int tied_ctx;              /* the SMP_PARTITION context the tied module is created in; -1: none */
    /* >= 0 (or -2 under auto): calls 0 and 7 go through composites created in these contexts; -1: top-level calls */
    int embed_ctx, head_ctx;
    int dflt;                  /* default_partition; -1: none */
} layout;
static const layout AUTO = {NULL, -1, -1, -1, -1}, AUTO_WRAPPED = {NULL, -1, -2, -2, -1};
static bool g_split; /* the linears (tied included) with net7.h's split backward */

static smp_module *new_linear(tnet *n, const char *name, int l) {
    n->st[l].in = n->st[l].out = TD;
    n->st[l].seq_slot = l;
    smp_module_desc d = {lin_forward, g_split ? NULL : lin_backward, &n->st[l]};
    smp_module *m = smp_module_new(n->root, name, &d);
    if (g_split) smp_module_set_backward_split(m, lin_backward_input, lin_backward_weight);
    return m;
}

static smp_model *tnet_build(tnet *n, const layout *L) {
    memset(n, 0, sizeof *n);
    n->root = smp_module_new(NULL, "", NULL);
    int64_t ws[2] = {TD, TD}, bs[1] = {TD};
    const smp_module_desc relu = {relu_forward, relu_backward, NULL}, add = {add_forward, add_backward, NULL},
                          wrap = {wrap_forward, NULL, n};
    const int *placement = L->placement;
    int tied_ctx = L->tied_ctx;
    if (L->embed_ctx != -1) {
        if (L->embed_ctx >= 0) smp_partition_push(L->embed_ctx);
        n->embed = smp_module_new(n->root, "embed", &wrap);
        if (L->embed_ctx >= 0) smp_partition_pop();
    }
    if (placement && tied_ctx >= 0) smp_partition_push(tied_ctx);
    n->tied = new_linear(n, "tied", 0);
    n->st[0].w = smp_param_new(n->tied, "weight", SMP_F32, 2, ws, smp_init_uniform, NULL);
    n->st[0].b = smp_param_new(n->tied, "bias", SMP_F32, 1, bs, smp_init_uniform, NULL);
    if (placement && tied_ctx >= 0) smp_partition_pop();
    static const char *names[6] = {"fc1", "act1", "fc2", "act2", "skip", "fc3"};
    for (int k = 0; k < 6; k++) {
        if (placement) smp_partition_push(placement[k]);
        if (k == 1 || k == 3) n->act[k / 2] = smp_module_new(n->root, names[k], &relu);
        else if (k == 4) n->skip = smp_module_new(n->root, names[k], &add);
        else {
            int l = k == 0 ? 1 : k == 2 ? 2 : 3;
            n->fc[l - 1] = new_linear(n, names[k], l);
            n->st[l].w = smp_param_new(n->fc[l - 1], "weight", SMP_F32, 2, ws, smp_init_uniform, NULL);
            n->st[l].b = smp_param_new(n->fc[l - 1], "bias", SMP_F32, 1, bs, smp_init_uniform, NULL);
        }
        if (placement) smp_partition_pop();
    }
    if (L->head_ctx != -1) {
        if (L->head_ctx >= 0) smp_partition_push(L->head_ctx);
        n->head = smp_module_new(n->root, "head", &wrap);
        if (L->head_ctx >= 0) smp_partition_pop();
    }
    smp_model *m = NULL;
    smp_model_desc md = {tnet_forward, 1, 1, n, false};
    return smp_model_new(n->root, &md, &m) ? NULL : m;
}

SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    float loss =
        mse((const float *)y->data, (const float *)t->data, g ? (float *)g->data : NULL, (int)smp_tensor_numel(y));
    smp_status st = smp_mb_return_f32(mb, 0, loss);
    return st ? st : smp_mb_return(mb, 1, y);
}

static void sgd(float *w, const float *g, int n) {
    for (int i = 0; i < n; i++) w[i] -= LR * g[i];
}

/* ---------------------------------------------------------------- the reference */
typedef struct {
    float v[NP][WN], g[NP][WN];
    float loss[MAXDP][MAXM], out[MAXDP][TB * TD];
    float call_buf[2][2][WN]; /* last step, dp = 1: the tied weight's and bias's per-call buffers (diagnosis) */
} tref;

static void ref_init(tref *r) {
    memset(r, 0, sizeof *r);
    for (int k = 0; k < NP; k++) {
        int64_t ws[2] = {TD, TD}, bs[1] = {TD};
        smp_tensor t = k % 2 == 0 ? smp_tensor_make(r->v[k], SMP_F32, 2, ws) : smp_tensor_make(r->v[k], SMP_F32, 1, bs);
        smp_init_uniform(&t, smp_param_seed(pnames[k]), NULL);
    }
}

/* One replica's batch of `rows` in m microbatches; gradients added into g. */
static void ref_replica(float v[NP][WN], const float *x, const float *t, int rows, int m, bool train, double divisor,
                        float g[NP][WN], float *loss, float *out, float buf[2][2][WN]) {
    int n = rows / m;
    memset(buf, 0, sizeof(float) * 2 * 2 * WN);
    for (int i = 0; i < m; i++) {
        const float *xi = x + (size_t)i * n * TD, *ti = t + (size_t)i * n * TD;
        float a0[TB * TD], a1[TB * TD], a2[TB * TD], a3[TB * TD], a4[TB * TD], a5[TB * TD], a6[TB * TD], y[TB * TD],
            gy[TB * TD];
        linear_fwd(xi, v[0], v[1], a0, n, TD, TD);
        linear_fwd(a0, v[2], v[3], a1, n, TD, TD);
        for (int k = 0; k < n * TD; k++) a2[k] = a1[k] > 0 ? a1[k] : 0;
        linear_fwd(a2, v[4], v[5], a3, n, TD, TD);
        for (int k = 0; k < n * TD; k++) a4[k] = a3[k] > 0 ? a3[k] : 0;
        for (int k = 0; k < n * TD; k++) a5[k] = a4[k] + a0[k];
        linear_fwd(a5, v[6], v[7], a6, n, TD, TD);
        linear_fwd(a6, v[0], v[1], y, n, TD, TD);
        memcpy(out + (size_t)i * n * TD, y, sizeof(float) * (size_t)(n * TD));
        loss[i] = mse(y, ti, train ? gy : NULL, n * TD);
        if (!train) continue;
        if (divisor != 1) for (int k = 0; k < n * TD; k++) gy[k] *= (float)(1.0 / divisor);
        float g6[TB * TD], g5[TB * TD], g3[TB * TD], g2[TB * TD], g1[TB * TD], g0[TB * TD];
        linear_bwd(a6, v[0], gy, g6, buf[1][0], buf[1][1], n, TD, TD); /* call 7: the tied module's second call */
        linear_bwd(a5, v[6], g6, g5, g[6], g[7], n, TD, TD);            /* fc3 */
        /* skip: both inputs (a4, a0) get g5 */
        for (int k = 0; k < n * TD; k++) g3[k] = a3[k] > 0 ? g5[k] : 0; /* act2 */
        linear_bwd(a2, v[4], g3, g2, g[4], g[5], n, TD, TD);             /* fc2 */
        for (int k = 0; k < n * TD; k++) g1[k] = a1[k] > 0 ? g2[k] : 0; /* act1 */
        linear_bwd(a0, v[2], g1, g0, g[2], g[3], n, TD, TD);             /* fc1 */
        for (int k = 0; k < n * TD; k++) g0[k] = g5[k] + g0[k];         /* a0: latest consumer (skip) first, then fc1 */
        linear_bwd(xi, v[0], g0, NULL, buf[0][0], buf[0][1], n, TD, TD); /* call 0: the tied module's first call */
    }
    if (!train) return;
    for (int c = 0; c < 2; c++) /* the shared parameters: call 0's sum, then call 7's */
        for (int wb = 0; wb < 2; wb++)
            for (int k = 0; k < psize(wb); k++) g[wb][k] += buf[c][wb][k];
}

/* One step of dp replicas, replica r on rows r*TB .. (r+1)*TB of the global
   batch; zero: smp_model_zero_grad first (required with dp > 1). */
static void tref_step(tref *r, int dp, int m, bool zero) {
    float buf[2][2][WN];
    if (zero) memset(r->g, 0, sizeof r->g);
    if (dp == 1) {
        ref_replica(r->v, g_x, g_t, TB, m, true, m, r->g, r->loss[0], r->out[0], r->call_buf);
        return;
    }
    static float acc[MAXDP][NP][WN];
    memset(acc, 0, sizeof acc);
    for (int d = 0; d < dp; d++)
        ref_replica(r->v, g_x + (size_t)d * TB * TD, g_t + (size_t)d * TB * TD, TB, m, true, (double)m * dp, acc[d],
                    r->loss[d], r->out[d], buf);
    for (int k = 0; k < NP; k++)
        for (int i = 0; i < psize(k); i++) {
            float s = acc[0][k][i];
            for (int d = 1; d < dp; d++) s += acc[d][k][i];
            r->g[k][i] = s;
        }
}
static void ref_sgd(tref *r) {
    for (int k = 0; k < NP; k++) sgd(r->v[k], r->g[k], psize(k));
}

/* ---------------------------------------------------------------- comparisons */
static int pindex(const char *name) {
    for (int k = 0; k < NP; k++)
        if (!strcmp(name, pnames[k])) return k;
    return -1;
}

/* What a wrong tied.weight gradient looks like, from the last step's per-call buffers (dp = 1 only). */
static void diagnose_tied(const tref *r, const float *before, const float *got, char *why, size_t cap) {
    size_t len = strlen(why);
    const char *what = NULL;
    float c0[WN], c1[WN], swapped[WN], twice0[WN], twice1[WN];
    for (int i = 0; i < WN; i++) {
        c0[i] = before[i] + r->call_buf[0][0][i];
        c1[i] = before[i] + r->call_buf[1][0][i];
        swapped[i] = (before[i] + r->call_buf[1][0][i]) + r->call_buf[0][0][i];
        twice0[i] = (before[i] + r->call_buf[0][0][i]) + r->call_buf[0][0][i];
        twice1[i] = (before[i] + r->call_buf[1][0][i]) + r->call_buf[1][0][i];
    }
    if (!memcmp(got, c0, sizeof c0)) what = "only call 0's contribution (call 7's dropped)";
    else if (!memcmp(got, c1, sizeof c1)) what = "only call 7's contribution (call 0's dropped)";
    else if (!memcmp(got, swapped, sizeof swapped)) what = "both calls, summed in the wrong order (call 7 first)";
    else if (!memcmp(got, twice0, sizeof twice0)) what = "call 0's contribution twice";
    else if (!memcmp(got, twice1, sizeof twice1)) what = "call 7's contribution twice";
    if (what && len < cap) snprintf(why + len, cap - len, "; smp's gradient is %s", what);
}

/* This rank's losses, outputs, gradients and values against the reference
   (replica rep); before: the reference's gradients before this step. */
static int compare(smp_model *model, const tref *r, const float before[NP][WN], const smp_step_output *outs, int m,
                   int rep, const char *when, char *why, size_t cap) {
    for (int i = 0; outs && i < m; i++) {
        float got = ((const float *)outs[0].values[i].data)[0];
        if (memcmp(&got, &r->loss[rep][i], 4)) {
            snprintf(why, cap, "%s: loss of microbatch %d: %.9g vs reference %.9g", when, i, got, r->loss[rep][i]);
            return 0;
        }
    }
    if (outs && outs[1].microbatches == m) {
        float all[TB * TD];
        smp_tensor cat = smp_tensor_2d(all, SMP_F32, TB, TD);
        if (smp_step_output_concat(&outs[1], &cat) || memcmp(all, r->out[rep], sizeof all)) {
            snprintf(why, cap, "%s: concatenated outputs differ from the reference", when);
            return 0;
        }
    }
    int np = smp_model_num_global_params(model, false);
    if (np != NP) {
        snprintf(why, cap, "%s: the model counts %d parameters, expected %d (the shared ones once)", when, np, NP);
        return 0;
    }
    for (int i = 0; i < np; i++) {
        smp_param *p = smp_model_global_param(model, i, true);
        int k = p ? pindex(smp_param_name(p)) : -1;
        if (k < 0) {
            snprintf(why, cap, "%s: unexpected parameter %d '%s'", when, i, p ? smp_param_name(p) : "(null)");
            return 0;
        }
        if (!smp_module_is_local(smp_param_module(p))) continue;
        const float *g = (const float *)smp_param_grad(p)->data, *v = (const float *)smp_param_value(p)->data;
        if (!g || !v) { snprintf(why, cap, "%s: local parameter %s has no storage", when, pnames[k]); return 0; }
        if (memcmp(v, r->v[k], sizeof(float) * (size_t)psize(k))) {
            int e = 0;
            while (e < psize(k) - 1 && !memcmp(&v[e], &r->v[k][e], 4)) e++;
            snprintf(why, cap, "%s: %s (mp rank %d) differs: [%d] = %.9g, reference %.9g", when, pnames[k],
                     smp_mp_rank(), e, v[e], r->v[k][e]);
            return 0;
        }
        if (before && memcmp(g, r->g[k], sizeof(float) * (size_t)psize(k))) {
            int e = 0;
            while (e < psize(k) - 1 && !memcmp(&g[e], &r->g[k][e], 4)) e++;
            snprintf(why, cap, "%s: gradient of %s (mp rank %d) differs: [%d] = %.9g, reference %.9g", when, pnames[k],
                     smp_mp_rank(), e, g[e], r->g[k][e]);
            if (k == 0 && smp_dp_size() == 1) diagnose_tied(r, before[0], g, why, cap);
            return 0;
        }
    }
    /* the local iteration the optimizer uses visits local parameters only, each once */
    smp_param *p;
    int seen[NP] = {0};
    for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
        int k = pindex(smp_param_name(p));
        if (k < 0 || !smp_module_is_local(smp_param_module(p)) || seen[k]++) {
            snprintf(why, cap, "%s: smp_model_local_param(m, %d, false) gave '%s' (%s)", when, i, smp_param_name(p),
                     k < 0         ? "unknown"
                     : seen[k] > 1 ? "twice"
                                   : "not local");
            return 0;
        }
    }
    return 1;
}

/* Every rank agrees on ok; all get the reason of the lowest failing rank. */
static int agree(int ok, char *why, size_t cap, const char *when) {
    (void)when;
    int bad = ok ? 1 << 30 : me, first;
    MPI_Allreduce(&bad, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (first == 1 << 30) return 1;
    char msg[4096];
    snprintf(msg, sizeof msg, "world rank %d: %s", me, why);
    MPI_Bcast(msg, sizeof msg, MPI_CHAR, first, MPI_COMM_WORLD);
    snprintf(why, cap, "%s", msg);
    return 0;
}

/* The mp ranks that run calls 0 and 7 hold the tied module, no other rank
   does; with want_first >= 0 they are want_first and want_last;
   smp_module_partition is the partition of call 0 (the first holder). */
static int check_placement(smp_model *model, tnet *n, int want_first, int want_last, char *why, size_t cap) {
    int S = smp_model_num_stages(model), nc = smp_model_num_calls(model);
    if (nc != NCALLS) { snprintf(why, cap, "%d leaf calls traced, expected %d", nc, NCALLS); return 0; }
    int first = smp_model_stage_rank(model, smp_model_call_stage(model, 0)),
        last = smp_model_stage_rank(model, smp_model_call_stage(model, NCALLS - 1));
    if (want_first >= 0 && (first != want_first || last != want_last)) {
        snprintf(why, cap, "the tied module's calls run on mp ranks %d and %d, expected %d and %d (%d stages)", first,
                 last, want_first, want_last, S);
        return 0;
    }
    bool calls_here = false;
    for (int c = 0; c < NCALLS; c++) {
        int rk = smp_model_stage_rank(model, smp_model_call_stage(model, c));
        if ((c == 0 || c == NCALLS - 1) && rk == smp_mp_rank()) calls_here = true;
    }
    if (smp_module_is_local(n->tied) != calls_here) {
        snprintf(why, cap, "smp_module_is_local(tied) is %d on mp rank %d, which %s it", smp_module_is_local(n->tied),
                 smp_mp_rank(), calls_here ? "calls" : "does not call");
        return 0;
    }
    if (smp_module_partition(n->tied) != first) {
        snprintf(why, cap, "smp_module_partition(tied) = %d, expected %d (the partition of its first call)",
                 smp_module_partition(n->tied), first);
        return 0;
    }
    smp_param *w = smp_model_find_param(model, "tied.weight");
    if (!w || smp_param_module(w) != n->tied || (smp_param_value(w)->data != NULL) != calls_here) {
        snprintf(why, cap, "tied.weight: %s",
                 !w                               ? "not found"
                 : smp_param_module(w) != n->tied ? "module is not tied"
                                                  : "storage where the module is not local, or none where it is");
        return 0;
    }
    return 1;
}

/* Every rank's copy of the tied weight and bias is the same bytes. */
static int check_copies(smp_model *model, char *why, size_t cap) {
    struct { int local; float w[WN], b[TD]; } mine, all[64];
    memset(&mine, 0, sizeof mine);
    smp_param *w = smp_model_find_param(model, "tied.weight"), *b = smp_model_find_param(model, "tied.bias");
    mine.local = w && smp_module_is_local(smp_param_module(w));
    if (mine.local) {
        memcpy(mine.w, smp_param_value(w)->data, sizeof mine.w);
        memcpy(mine.b, smp_param_value(b)->data, sizeof mine.b);
    }
    if (world > 64) return 1;
    MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, MPI_COMM_WORLD);
    int first = -1, holders = 0;
    for (int r = 0; r < world; r++) {
        if (!all[r].local) continue;
        holders++;
        if (first < 0) first = r;
        else if (memcmp(all[r].w, all[first].w, sizeof mine.w) || memcmp(all[r].b, all[first].b, sizeof mine.b)) {
            snprintf(why, cap, "the tied copies on world ranks %d and %d differ", first, r);
            return 0;
        }
    }
    int r0 = smp_model_stage_rank(model, smp_model_call_stage(model, 0)),
        r7 = smp_model_stage_rank(model, smp_model_call_stage(model, NCALLS - 1));
    int want = world / smp_mp_size() * (r0 != r7 ? 2 : 1); /* the partitions of calls 0 and 7, in every replica */
    if (holders != want) { snprintf(why, cap, "%d ranks hold the tied module, expected %d", holders, want); return 0; }
    return 1;
}

/* ---------------------------------------------------------------- files for the float64 reference */
static void write_floats(const char *name, const float *p, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(p, sizeof(float), n, f);
        fclose(f);
    }
}

/* The first step's inputs, targets, initial parameters, losses and
   gradients, each written by one rank: parameters by dp rank 0 of the
   first partition holding them, losses by mp rank 0 of each replica. */
static void dump_for_python(smp_model *model, const smp_step_output *outs, int m, const char *sub) {
    char name[300];
    if (me == 0) {
        snprintf(name, sizeof name, "%s/%s", dir, sub);
        mkdir(name, 0777);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    int dp = smp_dp_size();
    if (me == 0) {
        snprintf(name, sizeof name, "%s/x.bin", sub);
        write_floats(name, g_x, (size_t)dp * TB * TD);
        snprintf(name, sizeof name, "%s/t.bin", sub);
        write_floats(name, g_t, (size_t)dp * TB * TD);
        char path[512];
        snprintf(path, sizeof path, "%s/%s/meta.txt", dir, sub);
        FILE *f = fopen(path, "w");
        if (f) {
            fprintf(f, "%d %d %d %d\n", TB, dp, m, TD);
            fclose(f);
        }
    }
    smp_param *p;
    for (int i = 0; smp_dp_rank() == 0 && (p = smp_model_local_param(model, i, false)); i++) {
        if (smp_module_partition(smp_param_module(p)) != smp_mp_rank()) continue;
        snprintf(name, sizeof name, "%s/param_%s.bin", sub, smp_param_name(p));
        write_floats(name, (const float *)smp_param_value(p)->data, (size_t)smp_tensor_numel(smp_param_value(p)));
        snprintf(name, sizeof name, "%s/grad_%s.bin", sub, smp_param_name(p));
        write_floats(name, (const float *)smp_param_grad(p)->data, (size_t)smp_tensor_numel(smp_param_grad(p)));
    }
    if (smp_mp_rank() == 0) {
        float l[MAXM];
        for (int i = 0; i < m; i++) l[i] = ((const float *)outs[0].values[i].data)[0];
        snprintf(name, sizeof name, "%s/loss_%d.bin", sub, smp_dp_rank());
        write_floats(name, l, (size_t)m);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

static const char *script_path(const char *file) {
    static char path[1024];
    const char *slash = strrchr(__FILE__, '/');
    if (slash) snprintf(path, sizeof path, "%.*s/%s", (int)(slash - __FILE__), __FILE__, file);
    else snprintf(path, sizeof path, "%s", file);
    return path;
}

/* Rank 0 runs test/tied_ref.py on dir/sub; its PASS/FAIL/SKIP lines count. */
static void run_python(const char *sub, const char *label) {
    if (me == 0) {
        char cmd[2048];
        const char *script = script_path("tied_ref.py");
        fflush(stdout);
        if (system("command -v python3 > /dev/null 2>&1") != 0) test_skip(label, "python3 not found");
        else if (access(script, R_OK) != 0)
            test_skip(label, "test/tied_ref.py not found (run from the repository root)");
        else {
            snprintf(cmd, sizeof cmd, "python3 '%s' '%s/%s' '%s'", script, dir, sub, label);
            int rc = system(cmd);
            rc = rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
            if (rc == 3) test__failed_total++; /* the script printed its FAIL lines */
            else if (rc != 0) CHECK(0, label, "tied_ref.py exited with status %d (%s)", rc, cmd);
        }
        fflush(stdout);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

/* ---------------------------------------------------------------- optimizer state */
/* An "exp_avg" per local parameter, as an Adam registers it: on both
   copies of the tied parameters. It holds the parameter's gradient (the
   same on every copy), or `fill` where fill is not NaN. */
typedef struct { smp_optimizer *reg; int n, k[NP]; smp_tensor t[NP]; } topt;

static smp_status topt_make(topt *o, smp_model *m, float fill) {
    memset(o, 0, sizeof *o);
    smp_status st = smp_optimizer_new(m, &o->reg);
    smp_param *p;
    for (int i = 0; !st && (p = smp_model_local_param(m, i, false)); i++) {
        const smp_tensor *g = smp_param_grad(p);
        o->k[o->n] = pindex(smp_param_name(p));
        o->t[o->n] = smp_tensor_make(malloc(smp_tensor_nbytes(g)), SMP_F32, g->ndim, g->shape);
        if (!isnan(fill)) for (int64_t e = 0; e < smp_tensor_numel(g); e++) ((float *)o->t[o->n].data)[e] = fill;
        else memcpy(o->t[o->n].data, g->data, smp_tensor_nbytes(g));
        st = smp_optimizer_state_add(o->reg, smp_param_name(p), "exp_avg", &o->t[o->n]);
        o->n++;
    }
    return st;
}
static void topt_free(topt *o) {
    for (int i = 0; i < o->n; i++) free(o->t[i].data);
    if (o->reg) smp_optimizer_free(o->reg);
    memset(o, 0, sizeof *o);
}
/* Whether every registered exp_avg holds the reference's gradient. */
static int topt_check(const topt *o, const tref *r, char *why, size_t cap) {
    for (int i = 0; i < o->n; i++)
        if (o->k[i] < 0 || memcmp(o->t[i].data, r->g[o->k[i]], sizeof(float) * (size_t)psize(o->k[i]))) {
            snprintf(why, cap, "optimizer.%s.exp_avg (mp rank %d) differs from the saved one: [0] = %.9g, saved %.9g",
                     o->k[i] < 0 ? "?" : pnames[o->k[i]], smp_mp_rank(), ((const float *)o->t[i].data)[0],
                     o->k[i] < 0 ? 0.0 : r->g[o->k[i]][0]);
            return 0;
        }
    return 1;
}

/* ---------------------------------------------------------------- one training configuration */
typedef struct {
    int P, m, vstages;
    smp_pipeline_kind kind;
    const layout *L;
    int want_first, want_last; /* the partitions of calls 0 and 7; -1: not checked */
    const char *label;
    const char *python;   /* sub-folder for the float64 check of the first step, or NULL */
    const char *save;     /* checkpoint path stem after training, or NULL */
    tref *final_ref;      /* receives the reference after training, or NULL */
} tcase;

static smp_model *start(int P, int m, smp_pipeline_kind kind, int vstages, const layout *L, tnet *n) {
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = m;
    cfg.pipeline = kind;
    cfg.virtual_stages = vstages;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.deterministic_reduction = world > P ? SMP_ON : SMP_OFF;
    cfg.seed = 5;
    if (L->placement) cfg.auto_partition = SMP_OFF;
    if (L->dflt >= 0) {
        cfg.has_default_partition = true;
        cfg.default_partition = L->dflt;
    }
    if (smp_init(&cfg) != SMP_OK) return NULL;
    return tnet_build(n, L);
}

static int run_case(const tcase *c) {
    char name[256], why[4096] = "", pname[400];
    int dpw = world / c->P;
    snprintf(name, sizeof name, "tied/%s/P=%d/dp=%d/m=%d/%s%s", c->label, c->P, dpw, c->m,
             c->kind == SMP_PIPELINE_SIMPLE          ? "simple"
             : c->kind == SMP_PIPELINE_ZERO_BUBBLE   ? "zero_bubble"
             : c->kind == SMP_PIPELINE_ZERO_BUBBLE_V ? "zero_bubble_v"
                                                     : "interleaved",
             g_split ? "/split linears" : "");
    tnet n;
    smp_model *model = start(c->P, c->m, c->kind, c->vstages, c->L, &n);
    int ok = model != NULL;
    if (!ok) snprintf(why, sizeof why, "start: %s", smp_last_error());
    static tref ref;
    static float before[NP][WN];
    ref_init(&ref);
    int dp = ok ? smp_dp_size() : 1, rep = ok ? smp_dp_rank() : 0;
    smp_tensor x = smp_tensor_2d(g_x + (size_t)rep * TB * TD, SMP_F32, TB, TD),
               t = smp_tensor_2d(g_t + (size_t)rep * TB * TD, SMP_F32, TB, TD);
    bool dumped = false;
    for (int s = 0; s < STEPS && ok; s++) {
        bool zero = dp > 1 || s != 1; /* dp = 1: the second step accumulates on top of the first */
        if (zero) smp_model_zero_grad(model);
        smp_step_output outs[2] = {{0}, {0}};
        smp_status st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 2, x, t);
        memcpy(before, ref.g, sizeof before);
        if (zero) memset(before, 0, sizeof before);
        tref_step(&ref, dp, c->m, zero);
        char when[32];
        snprintf(when, sizeof when, "step %d", s);
        int ran = st == SMP_OK, all_ran;
        MPI_Allreduce(&ran, &all_ran, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
        /* the float64 check judges smp's gradients whatever the bitwise one says */
        if (s == 0 && c->python && all_ran) {
            dump_for_python(model, outs, c->m, c->python);
            dumped = true;
        }
        if (st) { snprintf(why, sizeof why, "%s: %s", when, smp_last_error()); ok = 0; }
        if (ok) ok = compare(model, &ref, before, outs, c->m, rep, when, why, sizeof why);
        ok = agree(ok, why, sizeof why, when);
        smp_step_output_free(&outs[0]);
        smp_step_output_free(&outs[1]);
        smp_param *p;
        for (int i = 0; ok && (p = smp_model_local_param(model, i, false)); i++)
            sgd((float *)smp_param_value(p)->data, (const float *)smp_param_grad(p)->data,
                (int)smp_tensor_numel(smp_param_value(p)));
        ref_sgd(&ref);
    }
    if (ok) { /* the trained values, and an evaluation step's outputs and losses */
        ok = compare(model, &ref, NULL, NULL, c->m, rep, "after training", why, sizeof why);
        smp_step_output eo[2] = {{0}, {0}};
        smp_status st = ok ? SMP_EVAL_STEP(model, mse_body, NULL, eo, 2, x, t) : SMP_OK;
        if (ok && st) { snprintf(why, sizeof why, "evaluation step: %s", smp_last_error()); ok = 0; }
        if (ok) {
            tref er = ref;
            float dummy[NP][WN], buf[2][2][WN];
            ref_replica(er.v, g_x + (size_t)rep * TB * TD, g_t + (size_t)rep * TB * TD, TB, c->m, false, 1, dummy,
                        er.loss[rep], er.out[rep], buf);
            ok = compare(model, &er, NULL, eo, c->m, rep, "evaluation step", why, sizeof why);
        }
        smp_step_output_free(&eo[0]);
        smp_step_output_free(&eo[1]);
        ok = agree(ok, why, sizeof why, "after training");
    }
    MPI_CHECK(ok, name, "%s", why);
    int trained = ok;
    if (model && smp_model_is_partitioned(model)) {
        if (c->want_first >= 0)
            snprintf(pname, sizeof pname, "%s: tied copies on partitions %d and %d only", name, c->want_first,
                     c->want_last);
        else snprintf(pname, sizeof pname, "%s: tied copies where its calls run only", name);
        ok = check_placement(model, &n, c->want_first, c->want_last, why, sizeof why);
        MPI_CHECK(ok, pname, "%s", why);
        snprintf(pname, sizeof pname, "%s: every copy of W and b identical after training", name);
        ok = check_copies(model, why, sizeof why);
        MPI_CHECK(ok, pname, "%s", why);
    }
    if (c->final_ref) *c->final_ref = ref;
    if (c->save && trained) { /* the files must hold what the reference holds */
        char path[600];
        topt o;
        smp_status st = topt_make(&o, model, NAN);
        snprintf(pname, sizeof pname, "tied/checkpoint/optimizer state registered on every copy/P=%d", c->P);
        MPI_CHECK(st == SMP_OK, pname, "%s", smp_last_error());
        smp_save_desc sd = {0};
        sd.optimizer = o.reg;
        sd.partial = SMP_OFF;
        snprintf(path, sizeof path, "%s/%s_full", dir, c->save);
        st = smp_save(model, path, &sd);
        snprintf(pname, sizeof pname, "tied/checkpoint/full save after training/P=%d", c->P);
        MPI_CHECK(st == SMP_OK, pname, "%s", smp_last_error());
        sd.partial = SMP_ON;
        snprintf(path, sizeof path, "%s/%s_part", dir, c->save);
        st = smp_save(model, path, &sd);
        snprintf(pname, sizeof pname, "tied/checkpoint/partial save after training/P=%d", c->P);
        MPI_CHECK(st == SMP_OK, pname, "%s", smp_last_error());
        topt_free(&o);
    }
    smp_model_free(model);
    if (smp_is_initialized()) smp_finalize();
    int d = dumped;
    MPI_Bcast(&d, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (c->python) {
        snprintf(pname, sizeof pname, "tied/float64 reference/%s/P=%d/dp=%d/m=%d", c->label, c->P, dpw, c->m);
        if (d) run_python(c->python, pname);
        else if (me == 0) test_skip(pname, "the first step failed: nothing to check");
    }
    return trained;
}

/* ---------------------------------------------------------------- checkpoints */
/* Occurrences of `needle` in the JSON header of a safetensors file; -1 if unreadable. */
static int header_count(const char *path, const char *needle) {
    FILE *f = fopen(path, "rb");
    unsigned char len8[8];
    if (!f) return -1;
    int count = -1;
    if (fread(len8, 1, 8, f) == 8) {
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--) n = n << 8 | len8[i];
        char *h = n < (1u << 26) ? (char *)calloc(1, (size_t)n + 1) : NULL;
        if (h && fread(h, 1, (size_t)n, f) == (size_t)n) {
            count = 0;
            for (const char *at = strstr(h, needle); at; at = strstr(at + 1, needle)) count++;
        }
        free(h);
    }
    fclose(f);
    return count;
}

static int allowed(int P) { return P <= world && world % P == 0; }

static void checkpoint_section(void) {
    int Psave = allowed(4) ? 4 : allowed(2) ? 2 : 1;
    if (Psave < 4 && me == 0)
        test_skip("tied/checkpoint/save at P=4", "needs 4 ranks; saving at the largest P the world allows");
    static tref saved;
    tcase c = {Psave, 4,      1,         SMP_PIPELINE_INTERLEAVED,
               &AUTO, 0,      Psave - 1, "checkpoint: trained before the save",
               NULL,  "ckpt", &saved};
    if (!run_case(&c)) {
        if (me == 0) test_skip("tied/checkpoint", "training before the save failed");
        return;
    }
    /* the files hold each tensor once, the tied weight and bias included */
    int ok = 1;
    char why[4096] = "", path[600], name[256];
    if (me == 0) {
        snprintf(path, sizeof path, "%s/ckpt_full", dir);
        int nw = header_count(path, "\"tied.weight\""), nb = header_count(path, "\"tied.bias\""),
            nf = header_count(path, "\"fc3.weight\"");
        int no = header_count(path, "\"optimizer.tied.weight.exp_avg\"");
        smp_ckpt_file *f = NULL;
        int tensors = smp_ckpt_open(path, &f) == SMP_OK ? smp_ckpt_count(f) : -1;
        if (f) smp_ckpt_close(f);
        if (nw != 1 || nb != 1 || nf != 1 || no != 1 || tensors != 2 * NP) {
            ok = 0;
            snprintf(why, sizeof why,
                     "%s: \"tied.weight\" %d times, \"tied.bias\" %d, \"fc3.weight\" %d, "
                     "\"optimizer.tied.weight.exp_avg\" %d, %d tensors (expected 1, 1, 1, 1, %d)",
                     path, nw, nb, nf, no, tensors, 2 * NP);
        }
    }
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    snprintf(name, sizeof name, "tied/checkpoint/the full file stores the tied parameters once/P=%d", Psave);
    MPI_CHECK(ok, name, "%s", why);
    if (me == 0) {
        int nw = 0, nb = 0, no = 0, bad = 0;
        for (int k = 0; k < Psave; k++) {
            char base[sizeof path];
            snprintf(base, sizeof base, "%s/ckpt_part", dir);
            /* the file its manifest names */
            if (smp_ckpt_partial_file(base, k, path, sizeof path, NULL) != SMP_OK) path[0] = 0;
            int a = header_count(path, "\"tied.weight\""), b = header_count(path, "\"tied.bias\""),
                e = header_count(path, "\"optimizer.tied.weight.exp_avg\"");
            if (a < 0 || b < 0 || e < 0) bad = 1;
            nw += a;
            nb += b;
            no += e;
        }
        ok = !bad && nw == 1 && nb == 1 && no == 1;
        if (!ok)
            snprintf(why, sizeof why,
                     "%sthe %d partial files hold \"tied.weight\" %d times, \"tied.bias\" %d times, "
                     "\"optimizer.tied.weight.exp_avg\" %d times",
                     bad ? "a file is unreadable; " : "", Psave, nw, nb, no);
    }
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    snprintf(name, sizeof name, "tied/checkpoint/the partial files store the tied parameters once/P=%d", Psave);
    MPI_CHECK(ok, name, "%s", why);

    static const int Qs[3] = {1, 2, 4};
    for (int q = 0; q < 3; q++) {
        int Q = Qs[q];
        if (!allowed(Q)) continue;
        for (int partial = 0; partial < 2; partial++) {
            snprintf(name, sizeof name,
                     "tied/checkpoint/%s save at P=%d loads at Q=%d (dp %d): parameters and optimizer state bitwise on "
                     "every copy, one more step equals the reference",
                     partial ? "partial" : "full", Psave, Q, world / Q);
            tnet n;
            int m = 4;
            smp_model *model = start(Q, m, SMP_PIPELINE_INTERLEAVED, 1, &AUTO, &n);
            ok = model != NULL;
            if (!ok) snprintf(why, sizeof why, "start: %s", smp_last_error());
            smp_tensor x0 = smp_tensor_2d(g_x, SMP_F32, TB / m, TD);
            if (ok && smp_model_trace(model, &x0, 1) != SMP_OK) {
                ok = 0;
                snprintf(why, sizeof why, "trace: %s", smp_last_error());
            }
            ok = agree(ok, why, sizeof why, "start");
            smp_param *p;
            /* garbage that the load must replace */
            for (int i = 0; ok && (p = smp_model_local_param(model, i, false)); i++)
                for (int64_t e = 0; e < smp_tensor_numel(smp_param_value(p)); e++)
                    ((float *)smp_param_value(p)->data)[e] = 1234.5f;
            topt o = {0};
            if (ok && topt_make(&o, model, 777.0f) != SMP_OK) {
                ok = 0;
                snprintf(why, sizeof why, "optimizer: %s", smp_last_error());
            }
            ok = agree(ok, why, sizeof why, "optimizer");
            smp_load_desc ld = {0};
            ld.optimizer = o.reg;
            ld.partial = partial ? SMP_ON : SMP_OFF;
            snprintf(path, sizeof path, "%s/ckpt_%s", dir, partial ? "part" : "full");
            if (ok && smp_load(model, path, &ld) != SMP_OK) {
                ok = 0;
                snprintf(why, sizeof why, "load: %s", smp_last_error());
            }
            if (ok) ok = compare(model, &saved, NULL, NULL, m, 0, "after the load", why, sizeof why);
            if (ok) ok = topt_check(&o, &saved, why, sizeof why);
            if (ok) ok = check_placement(model, &n, 0, Q - 1, why, sizeof why);
            ok = agree(ok, why, sizeof why, "load");
            if (ok) ok = check_copies(model, why, sizeof why);
            if (ok) { /* training goes on from the loaded values as the reference does */
                tref r = saved;
                int dp = smp_dp_size(), rep = smp_dp_rank();
                smp_tensor x = smp_tensor_2d(g_x + (size_t)rep * TB * TD, SMP_F32, TB, TD),
                           t = smp_tensor_2d(g_t + (size_t)rep * TB * TD, SMP_F32, TB, TD);
                smp_step_output outs[2] = {{0}, {0}};
                smp_model_zero_grad(model);
                smp_status st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 2, x, t);
                tref_step(&r, dp, m, true);
                static float zero[NP][WN];
                if (st) { ok = 0; snprintf(why, sizeof why, "step after the load: %s", smp_last_error()); }
                else ok = compare(model, &r, zero, outs, m, rep, "step after the load", why, sizeof why);
                smp_step_output_free(&outs[0]);
                smp_step_output_free(&outs[1]);
                ok = agree(ok, why, sizeof why, "step after the load");
            }
            MPI_CHECK(ok, name, "%s", why);
            topt_free(&o);
            smp_model_free(model);
            if (smp_is_initialized()) smp_finalize();
        }
    }
}

/* ---------------------------------------------------------------- main */
int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    uint64_t s = 2024;
    for (size_t i = 0; i < sizeof g_x / sizeof g_x[0]; i++) g_x[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    for (size_t i = 0; i < sizeof g_t / sizeof g_t[0]; i++) g_t[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    if (me == 0) {
        snprintf(dir, sizeof dir, "%s/smp_tied.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
        if (!mkdtemp(dir)) dir[0] = 0;
    }
    MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (!dir[0]) {
        if (me == 0) printf("FAIL: test_tied: cannot create a temporary folder\n");
        MPI_Finalize();
        return 1;
    }
    static const smp_pipeline_kind kinds[2] = {SMP_PIPELINE_SIMPLE, SMP_PIPELINE_INTERLEAVED};
    static const int ms[3] = {1, 3, 4};
    for (int P = 1; P <= 4; P *= 2) {
        if (!allowed(P)) continue;
        for (int k = 0; k < 2; k++) {
            for (int i = 0; i < 3; i++) {
                tcase c = {P, ms[i], 1, kinds[k], &AUTO, 0, P - 1, "auto", NULL, NULL, NULL};
                run_case(&c);
            }
            if (P > 1) { /* interleaved virtual stages: 2P stages of the 8 calls */
                for (int i = 1; i < 3; i++) {
                    tcase c = {P, ms[i], 2, kinds[k], &AUTO, 0, P - 1, "auto, 2 virtual stages", NULL, NULL, NULL};
                    run_case(&c);
                }
                tcase c = {P,
                           4,
                           1,
                           kinds[k],
                           &AUTO_WRAPPED,
                           0,
                           P - 1,
                           "auto, tied called by composites embed and head",
                           NULL,
                           NULL,
                           NULL};
                run_case(&c);
            }
        }
    }
    /* manual placement of fc1 act1 fc2 act2 skip fc3, the tied module created in various contexts:
       {placement, tied_ctx, embed_ctx, head_ctx, default_partition} */
    static const int p2[6] = {0, 0, 0, 1, 1, 1}, p2alt[6] = {0, 0, 1, 1, 0, 1}, p4[6] = {0, 1, 1, 2, 2, 3};
    static const layout m2[6] = {{p2, -1, 0, 1, -1},  {p2alt, -1, 0, 1, -1}, {p2, 1, 0, 1, -1},
                                 {p2, 0, -1, -1, -1}, {p2, 1, -1, -1, -1},   {p2, -1, -1, -1, 1}};
    static const int m2_want[6][2] = {{0, 1}, {0, 1}, {1, 1}, {0, 0}, {1, 1}, {1, 1}};
    static const char *m2_label[6] = {
        "manual 0,0,0,1,1,1, tied created in no context, called by composites embed (partition 0) and head (partition "
        "1)",
        "manual stages on ranks 0,1,0,1, tied created in no context, called by embed (partition 0) and head (partition "
        "1)",
        "manual 0,0,0,1,1,1, tied created in partition 1, called by embed (partition 0) and head (partition 1)",
        "manual 0,0,0,1,1,1, tied created in partition 0, top-level calls",
        "manual 0,0,0,1,1,1, tied created in partition 1, top-level calls",
        "manual 0,0,0,1,1,1, tied created in no context, default_partition 1, top-level calls"};
    static const layout m4[4] = {{p4, -1, 0, 3, -1}, {p4, 2, 0, 3, -1}, {p4, 0, -1, -1, -1}, {p4, 3, -1, -1, -1}};
    static const int m4_want[4][2] = {{0, 3}, {2, 2}, {0, 0}, {3, 3}};
    static const char *m4_label[4] = {
        "manual 0,1,1,2,2,3, tied created in no context, called by composites embed (partition 0) and head (part 3)",
        "manual 0,1,1,2,2,3, tied created in partition 2, called by embed (partition 0) and head (partition 3)",
        "manual 0,1,1,2,2,3, tied created in partition 0, top-level calls",
        "manual 0,1,1,2,2,3, tied created in partition 3, top-level calls"};
    for (int k = 0; k < 2; k++) {
        for (int j = 0; j < 6 && allowed(2); j++) {
            tcase c = {2,           j == 1 ? 3 : 4, 1,    kinds[k], &m2[j], m2_want[j][0], m2_want[j][1],
                       m2_label[j], NULL,           NULL, NULL};
            run_case(&c);
        }
        for (int j = 0; j < 4 && allowed(4); j++) {
            tcase c = {4, 4, 1, kinds[k], &m4[j], m4_want[j][0], m4_want[j][1], m4_label[j], NULL, NULL, NULL};
            run_case(&c);
        }
    }
    /* DDP 2x2: a world of 4, 2 partitions, deterministic reduction */
    if (world == 4)
        for (int k = 0; k < 2; k++) {
            tcase a = {2, 4, 1, kinds[k], &AUTO, 0, 1, "ddp 2x2, deterministic, auto", k ? "ddp" : NULL, NULL, NULL};
            run_case(&a);
            tcase b = {2,      4,
                       1,      kinds[k],
                       &m2[1], 0,
                       1,      "ddp 2x2, deterministic, manual stages on ranks 0,1,0,1, tied called by embed and head",
                       NULL,   NULL,
                       NULL};
            run_case(&b);
            tcase v = {2,    4,    2,   kinds[k], &AUTO, 0, 1, "ddp 2x2, deterministic, auto, 2 virtual stages",
                       NULL, NULL, NULL};
            run_case(&v);
        }
    else if (me == 0) test_skip("tied/ddp 2x2", "needs a world of 4 ranks");
    /* zero_bubble: the linears whole (W ops with nothing to run, the tied
       copies' gradients finished after them) and split (each tied call's W
       adds into its own share). With a world of 4, P = 2 is DDP 2x2. */
    const smp_pipeline_kind ZB = SMP_PIPELINE_ZERO_BUBBLE;
    for (int P = 1; P <= 4; P *= 2) {
        if (!allowed(P)) continue;
        for (int sp = 0; sp < 2; sp++) {
            g_split = sp;
            if (sp || P > 1) {
                tcase c = {P, sp ? 3 : 4, 1, ZB, &AUTO, 0, P - 1, "auto", NULL, NULL, NULL};
                run_case(&c);
            }
            if (P > 1) {
                tcase w = {
                    P,    4,    1,   ZB, &AUTO_WRAPPED, 0, P - 1, "auto, tied called by composites embed and head",
                    NULL, NULL, NULL};
                run_case(&w);
            }
            if (sp && P == 2) {
                tcase v = {P, 4, 2, ZB, &AUTO, 0, P - 1, "auto, 2 virtual stages", NULL, NULL, NULL};
                run_case(&v);
            }
        }
        g_split = false;
    }
    g_split = true;
    if (allowed(2)) {
        tcase c = {2, 3, 1, ZB, &m2[1], m2_want[1][0], m2_want[1][1], m2_label[1], NULL, NULL, NULL};
        run_case(&c);
    }
    if (allowed(4)) {
        tcase c = {4, 4, 1, ZB, &m4[0], m4_want[0][0], m4_want[0][1], m4_label[0], NULL, NULL, NULL};
        run_case(&c);
    }
    g_split = false;
    /* zero_bubble_v: 2P stages in a V, so the tied module's first and last
       calls both run on partition 0 (one copy, both calls' shares summed
       there); the linears whole and split; at a world of 4, P = 2 is DDP 2x2 */
    const smp_pipeline_kind ZBV = SMP_PIPELINE_ZERO_BUBBLE_V;
    static const int v2[6] = {0, 1, 1, 1, 1, 0}, v4[6] = {1, 2, 3, 3, 2, 1};
    static const layout mv2[2] = {{v2, 0, -1, -1, -1}, {v2, -1, 0, 0, -1}}, mv4 = {v4, 0, -1, -1, -1};
    for (int P = 1; P <= 4; P *= 2) {
        if (!allowed(P)) continue;
        for (int sp = 0; sp < 2; sp++) {
            g_split = sp;
            tcase c = {P, sp ? 3 : 4, 1, ZBV, &AUTO, 0, 0, "auto", NULL, NULL, NULL};
            run_case(&c);
            if (sp && P > 1) {
                tcase w = {P,    4,    1,   ZBV, &AUTO_WRAPPED, 0, 0, "auto, tied called by composites embed and head",
                           NULL, NULL, NULL};
                run_case(&w);
            }
        }
        g_split = true;
        if (P == 2) {
            tcase a = {2, 4, 1, ZBV, &mv2[0], 0, 0, "manual V 0,1,1,1,1,0 after tied in partition 0", NULL, NULL, NULL};
            run_case(&a);
            tcase b = {2,       2,    1,   ZBV,
                       &mv2[1], 0,    0,   "manual V 0,1,1,1,1,0, tied called by embed and head (both partition 0)",
                       NULL,    NULL, NULL};
            run_case(&b);
        }
        if (P == 4) {
            tcase c = {4, 4, 1, ZBV, &mv4, 0, 0, "manual V 1,2,3,3,2,1 after tied in partition 0", NULL, NULL, NULL};
            run_case(&c);
        }
        g_split = false;
    }
    /* the float64 reference on the largest partitioning */
    {
        int P = allowed(4) ? 4 : allowed(2) ? 2 : 1;
        tcase c = {P, 4, 1, SMP_PIPELINE_INTERLEAVED, &AUTO, 0, P - 1, "auto", "largest", NULL, NULL};
        run_case(&c);
    }
    checkpoint_section();
    int failed = test__failed_total, any;
    MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (me == 0) {
        char cmd[400];
        if (!any) {
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
            if (system(cmd) != 0) printf("(could not remove %s)\n", dir);
        } else printf("(files kept in %s)\n", dir);
    }
    int rc = test_exit_code();
    MPI_Finalize();
    return rc;
}
