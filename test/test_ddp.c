/* test_ddp.c - data parallelism against the one-process model.
   Each replica trains on its own slice of a global batch; the reference
   runs every replica's microbatches in one process, accumulates each
   replica's gradient, and sums the replicas in dp-rank order. With
   deterministic_reduction the result must be bitwise equal; without it,
   within the bound of summing dp numbers in another order:
       |smp - ref| <= (dp - 1) * 2^-23 * sum_r |g_r|   (+ one ulp of the result)
   where g_r is replica r's gradient, already divided by dp (smp divides
   the loss gradient, not the sum). The zero_bubble schedule, with the
   linears' backward split into B and W ops, must give the same bits: a
   parameter's bucket may start its all-reduce only after the parameter's
   last W. So must zero_bubble_v (2 stages per partition in a V, at 1 and
   2 partitions: the 7-call model has too few calls for 8 stages). */
#define _POSIX_C_SOURCE 200809L /* setenv, getpid: net7.h's timeline_to */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"
#include "net7.h"
#include <float.h>

enum { MAXDP = 4 };
static float g_x[MAXDP * 2 * B * D], g_t[MAXDP * 2 * B * C];
static int world;

SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    float *scale = (float *)smp_mb_user(mb);
    float loss =
        mse((const float *)y->data, (const float *)t->data, g ? (float *)g->data : NULL, (int)smp_tensor_numel(y));
    if (g && scale) for (int64_t i = 0; i < smp_tensor_numel(g); i++) ((float *)g->data)[i] *= *scale;
    return smp_mb_return_f32(mb, 0, loss);
}

typedef struct { float gw[NLIN][H * H], gb[NLIN][H]; } grads_t;

/* The one-process reference: replica r's rows are r*rows .. (r+1)*rows of the global batch. */
static void reference(ref_t *base, int dp, int m, int rows, int steps, grads_t *sum, grads_t *absum,
                      float losses[MAXDP][8]) {
    grads_t acc[MAXDP];
    for (int r = 0; r < dp; r++) {
        ref_t rr = *base;
        ref_zero_grads(&rr);
        for (int s = 0; s < steps; s++) {
            ref_step_divided(&rr, g_x + ((size_t)r * steps + (size_t)s) * (size_t)rows * D,
                             g_t + ((size_t)r * steps + (size_t)s) * (size_t)rows * C, m, true, (double)m * dp * steps);
            if (losses) memcpy(losses[r], rr.loss, sizeof rr.loss);
        }
        memcpy(acc[r].gw, rr.gw, sizeof acc[r].gw);
        memcpy(acc[r].gb, rr.gb, sizeof acc[r].gb);
    }
    float *S = &sum->gw[0][0], *A = &absum->gw[0][0];
    int n = (int)(sizeof(grads_t) / sizeof(float));
    for (int i = 0; i < n; i++) {
        float s = ((float *)&acc[0])[i], a = fabsf(s);
        for (int r = 1; r < dp; r++) { s += ((float *)&acc[r])[i]; a += fabsf(((float *)&acc[r])[i]); }
        S[i] = s;
        A[i] = a;
    }
}

/* Largest violation of the bound over this rank's gradients; 0 means within. */
static double check_grads(smp_model *model, const grads_t *want, const grads_t *abs, int dp, bool bitwise, char *why,
                          size_t cap) {
    static const char *names[NLIN] = {"fc0", "fc1", "fc2", "head"};
    for (int l = 0; l < NLIN; l++)
        for (int wb = 0; wb < 2; wb++) {
            char nm[64];
            snprintf(nm, sizeof nm, "%s.%s", names[l], wb ? "bias" : "weight");
            smp_param *p = smp_model_find_param(model, nm);
            if (!smp_module_is_local(smp_param_module(p))) continue;
            const float *g = (const float *)smp_param_grad(p)->data, *w = wb ? want->gb[l] : want->gw[l],
                        *a = wb ? abs->gb[l] : abs->gw[l];
            int n = wb ? lin_out[l] : lin_out[l] * lin_in[l];
            for (int i = 0; i < n; i++) {
                double bound = bitwise ? 0 : (dp - 1) * FLT_EPSILON * a[i] + 2 * FLT_EPSILON * fabsf(w[i]) + FLT_MIN;
                if (bitwise ? memcmp(&g[i], &w[i], 4) != 0 : fabs((double)g[i] - w[i]) > bound) {
                    snprintf(why, cap, "%s[%d] = %.9g, reference %.9g (bound %.3g)", nm, i, g[i], w[i], bound);
                    return 1;
                }
            }
        }
    return 0;
}

typedef struct {
    int P, m, bpps;
    bool deterministic, overlap;
    double bucket_mb;
    bool perturb;
    smp_pipeline_kind kind;
    bool split, vee, shard;
} ddp_case;
/* shard: shard_optimizer_state, gradients reduce-scattered (its replicas then hold the rest of the average) */
/* vee: zero_bubble_v's placement whatever the kind (interleaved runs it as 3 stages on partitions 0, 1, 0) */
/* the case under zero_bubble, with the linears' backward split */
static void zb_split(ddp_case *c) { c->kind = SMP_PIPELINE_ZERO_BUBBLE; c->split = true; }
/* the case under zero_bubble_v, with the linears' backward split */
static void zbv_split(ddp_case *c) { c->kind = SMP_PIPELINE_ZERO_BUBBLE_V; c->split = true; }
static const char *zb_suffix(const ddp_case *c) {
    return c->kind == SMP_PIPELINE_ZERO_BUBBLE_V ? "/zero_bubble_v/split linears"
           : c->kind == SMP_PIPELINE_ZERO_BUBBLE ? "/zero_bubble/split linears"
                                                 : "";
}

static smp_model *start(const ddp_case *c, net *n) {
    smp_config cfg = {0};
    cfg.partitions = c->P;
    cfg.microbatches = c->m;
    cfg.ddp = SMP_ON;
    cfg.seed = 11;
    cfg.backward_passes_per_step = c->bpps;
    cfg.deterministic_reduction = c->deterministic ? SMP_ON : SMP_OFF;
    cfg.overlapping_allreduce = c->overlap ? SMP_ON : SMP_OFF;
    cfg.bucket_cap_mb = c->bucket_mb;
    cfg.pipeline = c->kind;
    cfg.shard_optimizer_state = c->shard ? SMP_ON : SMP_OFF;
    /* manual placement: traced times must not move calls between the runs compared */
    int placement[7];
    for (int k = 0; k < 7; k++) placement[k] = k * c->P / 7;
    if (c->kind == SMP_PIPELINE_ZERO_BUBBLE_V || c->vee) /* a V: 0,1,...,P-1,...,1,0 (P <= 2) */
        for (int k = 0; k < 7; k++) placement[k] = c->P == 2 && k >= 2 && k <= 4;
    if (c->P > 1) cfg.auto_partition = SMP_OFF;
    if (smp_init(&cfg)) return NULL;
    return build_split(n, c->P > 1 ? placement : NULL, c->split);
}

/* Under shard_optimizer_state: each replica's gradients hold the average in the ranges it owns and zeros
   elsewhere; checks the zeros and sums the replicas' gradients (x + 0 is exact), so every replica holds the
   whole average as without sharding. Collective over RDP_GROUP. */
static int gather_owned(smp_model *model, char *why, size_t cap) {
    int ok = 1;
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
        int64_t first = 0, count = 0, n = smp_tensor_numel(smp_param_grad(p));
        smp_param_owned_range(model, p, &first, &count);
        const float *g = (const float *)smp_param_grad(p)->data;
        for (int64_t k = 0; k < n && ok; k++)
            if ((k < first || k >= first + count) && g[k] != 0) {
                snprintf(why, cap, "'%s'[%lld] = %g outside the range this replica owns [%lld, %lld)",
                         smp_param_name(p), (long long)k, g[k], (long long)first, (long long)(first + count));
                ok = 0;
            }
        if (smp_all_reduce(smp_param_grad(p), smp_param_grad(p), SMP_SUM, SMP_RDP_GROUP) && ok) {
            snprintf(why, cap, "summing the replicas' ranges: %s", smp_last_error());
            ok = 0;
        }
    }
    return ok;
}

/* Runs `steps` training steps; returns this rank's gradients flattened by name order into out (for cross-config
 * comparison). */
static int run(const ddp_case *c, int steps, int rows, grads_t *got, char *why, size_t cap, float losses[8]) {
    net n;
    smp_model *model = start(c, &n);
    if (!model) { snprintf(why, cap, "start: %s", smp_last_error()); return 0; }
    int r = smp_dp_rank();
    smp_tensor x0 = smp_tensor_2d(g_x, SMP_F32, rows / c->m, D);
    smp_model_trace(model, &x0, 1);
    if (c->perturb && r != 0) /* replicas that start apart must be equal after the first step */
        for (int i = 0; smp_model_local_param(model, i, false); i++)
            ((float *)smp_param_value(smp_model_local_param(model, i, false))->data)[0] += 0.5f;
    smp_model_zero_grad(model);
    int ok = 1;
    for (int s = 0; s < steps && ok; s++) {
        smp_step_output out = {0};
        /* replica r's rows for step s: the same rows whatever the step count */
        smp_tensor x = smp_tensor_2d(g_x + ((size_t)r * steps + (size_t)s) * (size_t)rows * D, SMP_F32, rows, D);
        smp_tensor t = smp_tensor_2d(g_t + ((size_t)r * steps + (size_t)s) * (size_t)rows * C, SMP_F32, rows, C);
        if (SMP_TRAIN_STEP(model, mse_body, NULL, &out, 1, x, t)) {
            snprintf(why, cap, "step: %s", smp_last_error());
            ok = 0;
        }
        for (int i = 0; ok && losses && i < c->m; i++) losses[i] = ((float *)out.values[i].data)[0];
        smp_step_output_free(&out);
    }
    if (c->shard && !gather_owned(model, why, cap)) ok = 0;
    memset(got, 0, sizeof *got);
    static const char *names[NLIN] = {"fc0", "fc1", "fc2", "head"};
    for (int l = 0; l < NLIN && ok; l++) {
        char nm[64];
        snprintf(nm, sizeof nm, "%s.weight", names[l]);
        smp_param *pw = smp_model_find_param(model, nm);
        snprintf(nm, sizeof nm, "%s.bias", names[l]);
        smp_param *pb = smp_model_find_param(model, nm);
        if (!smp_module_is_local(smp_param_module(pw))) continue;
        memcpy(got->gw[l], smp_param_grad(pw)->data, smp_tensor_nbytes(smp_param_grad(pw)));
        memcpy(got->gb[l], smp_param_grad(pb)->data, smp_tensor_nbytes(smp_param_grad(pb)));
    }
    smp_model_free(model);
    smp_finalize();
    return ok;
}

static void equivalence(int P, bool deterministic, smp_pipeline_kind kind, bool shard) {
    ddp_case c = {P, 4, 1, deterministic, true, shard ? 0.0002 : 25, false, SMP_PIPELINE_DEFAULT, false, false, shard};
    if (kind == SMP_PIPELINE_ZERO_BUBBLE) zb_split(&c);
    if (kind == SMP_PIPELINE_ZERO_BUBBLE_V) zbv_split(&c);
    int dp = world / P, rows = B;
    char name[160], why[4096] = "";
    snprintf(name, sizeof name, "ddp/%dx%d/%s%s%s", P, dp, deterministic ? "deterministic, bitwise" : "within bound",
             zb_suffix(&c), shard ? "/shard_optimizer_state: reduce-scattered, several buckets" : "");
    grads_t got, want, abs;
    float losses[8];
    int ok = run(&c, 1, rows, &got, why, sizeof why, losses);
    smp_model *model = NULL;
    net n;
    model = start(&c, &n); /* same placement as the run: to know which parameters are local here */
    ref_t base;
    ref_params(&base);
    float ref_losses[MAXDP][8];
    reference(&base, dp, 4, rows, 1, &want, &abs, ref_losses);
    int r = smp_dp_rank();
    smp_tensor x0 = smp_tensor_2d(g_x, SMP_F32, rows / 4, D);
    smp_model_trace(model, &x0, 1);
    if (ok) {
        /* put the gradients we got into the model's grads to reuse check_grads */
        static const char *names[NLIN] = {"fc0", "fc1", "fc2", "head"};
        for (int l = 0; l < NLIN; l++) {
            char nm[64];
            snprintf(nm, sizeof nm, "%s.weight", names[l]);
            smp_param *pw = smp_model_find_param(model, nm);
            snprintf(nm, sizeof nm, "%s.bias", names[l]);
            smp_param *pb = smp_model_find_param(model, nm);
            if (!smp_module_is_local(smp_param_module(pw))) continue;
            memcpy(smp_param_grad(pw)->data, got.gw[l], smp_tensor_nbytes(smp_param_grad(pw)));
            memcpy(smp_param_grad(pb)->data, got.gb[l], smp_tensor_nbytes(smp_param_grad(pb)));
        }
        ok = check_grads(model, &want, &abs, dp, deterministic, why, sizeof why) == 0;
        for (int i = 0; ok && i < 4; i++)
            if (memcmp(&losses[i], &ref_losses[r][i], 4)) {
                snprintf(why, sizeof why, "loss of microbatch %d on dp rank %d: %.9g vs %.9g", i, r, losses[i],
                         ref_losses[r][i]);
                ok = 0;
            }
    }
    smp_model_free(model);
    smp_finalize();
    MPI_CHECK(ok, name, "%s", why);
}

/* smp_poll from inside the backward (every ReLU's), while small buckets'
   all-reduces are in flight, moves them on without changing a bit of the
   gradients. */
static void polled(int P) {
    ddp_case c = {P, 4, 1, true, true, 0.0005, false, SMP_PIPELINE_DEFAULT, false, false, false};
    grads_t ga, gb;
    char why[4096] = "";
    int ok = run(&c, 2, B, &ga, why, sizeof why, NULL);
    g_relu_backward_hook = smp_poll;
    ok = ok && run(&c, 2, B, &gb, why, sizeof why, NULL);
    g_relu_backward_hook = NULL;
    if (ok && memcmp(&ga, &gb, sizeof ga)) {
        snprintf(why, sizeof why, "the gradients differ with smp_poll in the backward");
        ok = 0;
    }
    char name[128];
    snprintf(name, sizeof name, "ddp/smp_poll in module backwards leaves the gradients bitwise equal/P=%d", P);
    MPI_CHECK(ok, name, "%s", why);
}

/* Two configurations must give bitwise equal gradients. */
static void same(const char *label, ddp_case a, ddp_case b, int steps_a, int rows_a, int steps_b, int rows_b) {
    grads_t ga, gb;
    char why[4096] = "";
    int ok =
        run(&a, steps_a, rows_a, &ga, why, sizeof why, NULL) && run(&b, steps_b, rows_b, &gb, why, sizeof why, NULL);
    if (ok && memcmp(&ga, &gb, sizeof ga)) {
        float *x = (float *)&ga, *y = (float *)&gb;
        int i = 0;
        while (x[i] == y[i]) i++;
        snprintf(why, sizeof why, "gradient element %d: %.9g vs %.9g", i, x[i], y[i]);
        ok = 0;
    }
    MPI_CHECK(ok, label, "%s", why);
}

static void clipping_and_scaler(int P, smp_pipeline_kind kind, bool shard) {
    ddp_case c = {P, 4, 1, true, true, shard ? 0.0002 : 25, false, SMP_PIPELINE_DEFAULT, false, false, shard};
    if (kind == SMP_PIPELINE_ZERO_BUBBLE) zb_split(&c);
    if (kind == SMP_PIPELINE_ZERO_BUBBLE_V) zbv_split(&c);
    char sfx[64];
    snprintf(sfx, sizeof sfx, "%s%s", zb_suffix(&c), shard ? "/shard_optimizer_state" : "");
    net n;
    smp_model *model = start(&c, &n);
    int dp = smp_dp_size(), r = smp_dp_rank();
    smp_tensor x = smp_tensor_2d(g_x + (size_t)r * B * D, SMP_F32, B, D),
               t = smp_tensor_2d(g_t + (size_t)r * B * C, SMP_F32, B, C);
    smp_step_output out = {0};
    smp_model_zero_grad(model);
    smp_status st = SMP_TRAIN_STEP(model, mse_body, NULL, &out, 1, x, t);
    ref_t base;
    ref_params(&base);
    grads_t want, abs;
    reference(&base, dp, 4, B, 1, &want, &abs, NULL);
    /* the reference's norm: per parameter in model order, then summed in that order */
    double sq[2 * NLIN] = {0}, total = 0;
    for (int l = 0; l < NLIN; l++) {
        for (int i = 0; i < lin_out[l] * lin_in[l]; i++) sq[2 * l] += (double)want.gw[l][i] * want.gw[l][i];
        for (int i = 0; i < lin_out[l]; i++) sq[2 * l + 1] += (double)want.gb[l][i] * want.gb[l][i];
    }
    for (int i = 0; i < 2 * NLIN; i++) total += sq[i];
    double norm = sqrt(total), got_norm = -1, max_norm = norm / 4;
    float coef = (float)(max_norm / (norm + 1e-6));
    for (int l = 0; l < NLIN; l++) {
        for (int i = 0; i < lin_out[l] * lin_in[l]; i++) want.gw[l][i] *= coef;
        for (int i = 0; i < lin_out[l]; i++) want.gb[l][i] *= coef;
    }
    if (!st) st = smp_clip_grad_norm(model, max_norm, &got_norm);
    char why[4096] = "", name[256];
    int ok = !st && memcmp(&got_norm, &norm, sizeof norm) == 0;
    if (shard && !gather_owned(model, why, sizeof why)) ok = 0;
    ok = ok && check_grads(model, &want, &abs, dp, true, why, sizeof why) == 0;
    if (!ok && !*why)
        snprintf(why, sizeof why, "status %d (%s), norm %.17g vs %.17g", st, st ? smp_last_error() : "", got_norm,
                 norm);
    snprintf(name, sizeof name, "ddp/clipping equals the one-process model/P=%d%s", P, sfx);
    MPI_CHECK(ok, name, "%s", why);
    /* the scaler: an overflow on the last rank skips the step everywhere (sharded: in a range the rank owns, the
       one part of the gradients its check reads) */
    smp_grad_scaler scaler = {0};
    double s0 = smp_grad_scaler_scale(&scaler);
    smp_param *p0 = smp_model_local_param(model, 0, false), *pinf = NULL;
    int64_t first = 0, count = 0;
    for (int i = 0; !pinf && (pinf = smp_model_local_param(model, i, false)); i++)
        if (smp_param_owned_range(model, pinf, &first, &count) || !count) pinf = NULL;
    if (smp_rank() == world - 1 && pinf) ((float *)smp_param_grad(pinf)->data)[first] = INFINITY;
    bool skip = false;
    st = smp_grad_scaler_unscale(model, &scaler, &skip);
    snprintf(name, sizeof name, "ddp/scaler skips the same step everywhere/P=%d%s", P, sfx);
    MPI_CHECK(!st && skip && scaler.scale == s0 * 0.5, name, "skip %d, scale %g (was %g)", skip, scaler.scale, s0);
    smp_model_zero_grad(model);
    st = SMP_TRAIN_STEP(model, mse_body, NULL, &out, 1, x, t);
    float before = p0 ? ((float *)smp_param_grad(p0)->data)[0] : 0;
    if (!st) st = smp_grad_scaler_unscale(model, &scaler, &skip);
    float after = p0 ? ((float *)smp_param_grad(p0)->data)[0] : 0;
    snprintf(name, sizeof name, "ddp/scaler unscales a clean step/P=%d%s", P, sfx);
    MPI_CHECK(!st && !skip && (!p0 || after == before / (float)scaler.scale), name, "skip %d, %g -> %g", skip, before,
              after);
    smp_step_output_free(&out);
    smp_model_free(model);
    smp_finalize();
}

static void data_helpers(void) {
    smp_config cfg = {0};
    cfg.ddp = SMP_ON;
    smp_init(&cfg);
    int dp = smp_dp_size(), r = smp_dp_rank();
    enum { N = 103 };
    int64_t idx[N + 1], count = 0, batches = 0, all[MAXDP * (N + 1)];
    smp_sampler_desc d = {N, 8, 5, true, true};
    smp_status st = smp_sampler_indices(&d, 3, idx, &count, &batches);
    int ok = !st && batches == N / (8 * dp) && count == batches * 8;
    /* the shards are disjoint and a permutation's prefix */
    smp_tensor mine = smp_tensor_1d(idx, SMP_I64, count), gathered = smp_tensor_1d(all, SMP_I64, count * dp);
    if (ok) ok = !smp_all_gather(&mine, &gathered, SMP_DP_GROUP);
    char seen[N] = {0};
    for (int64_t i = 0; ok && i < count * dp; i++) {
        if (all[i] < 0 || all[i] >= N || seen[all[i]])
            ok = 0;
        else
            seen[all[i]] = 1;
    }
    int64_t other[N + 1], oc;
    smp_sampler_indices(&d, 4, other, &oc, NULL);
    ok = ok && memcmp(other, idx, sizeof(int64_t) * (size_t)count) != 0; /* another epoch, another order */
    MPI_CHECK(ok, "ddp/sampler shards each global batch of a seeded permutation by dp rank", "count %lld batches %lld",
              (long long)count, (long long)batches);
    int64_t local = 0;
    st = smp_local_batch_size(64, &local);
    MPI_CHECK(!st && local == 64 / dp, "ddp/per-replica batch size", "%lld", (long long)local);
    if (dp > 1) {
        st = smp_local_batch_size(63, &local);
        MPI_CHECK(st == SMP_ERR_ARG && strstr(smp_last_error(), "63"), "ddp/indivisible global batch is an error", "%s",
                  smp_last_error());
        st = smp_agree_batches(r == 0 ? 10 : 9);
        MPI_CHECK(st == SMP_ERR_ARG && strstr(smp_last_error(), "different numbers of batches"),
                  "ddp/replicas with different batch counts get an error", "%s", smp_last_error());
    }
    MPI_CHECK(smp_agree_batches(7) == SMP_OK, "ddp/replicas with equal batch counts agree", "%s", smp_last_error());
    smp_finalize();
}

/* From the timeline of two steps with several buckets: on every rank the
   buckets all-reduce one at a time in index order, each starting after the
   one before it has finished; with overlapping_allreduce the first starts
   during the last microbatch's backward, without it once that has ended.
   Under zero_bubble (split linears) the gradients are final only after the
   last microbatch's W op: the first bucket starts during it (overlap) or
   after it (without), never before it began. With several stages on a rank
   (zero_bubble_v) that is the W of the rank's last stage, which holds the
   first bucket's parameters (the model's last calls). */
static void bucket_order(bool overlap, smp_pipeline_kind kind) {
    bool zb = kind != SMP_PIPELINE_DEFAULT;
    int steps = 2, m = 4, me;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    char path[64], name[128], why[2600] = "";
    timeline_to("buckets", path, sizeof path);
    snprintf(name, sizeof name, "ddp/buckets all-reduce in order, one at a time, %s%s",
             overlap ? (zb ? "the first during the last W" : "the first during the last backward")
                     : (zb ? "after the last W" : "after the backward"),
             kind == SMP_PIPELINE_ZERO_BUBBLE_V ? "/zero_bubble_v/split linears"
             : zb                               ? "/zero_bubble/split linears"
                                                : "");
    ddp_case c = {1, m, 1, false, overlap, 1e-4, false, SMP_PIPELINE_DEFAULT, false, false, false};
    if (kind == SMP_PIPELINE_ZERO_BUBBLE) zb_split(&c);
    if (kind == SMP_PIPELINE_ZERO_BUBBLE_V) zbv_split(&c);
    net n;
    smp_model *model = start(&c, &n);
    int ok = model != NULL;
    for (int st = 0; st < steps && ok; st++) {
        smp_step_output out = {0};
        smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D), t = smp_tensor_2d(g_t, SMP_F32, B, C);
        ok = SMP_TRAIN_STEP(model, mse_body, NULL, &out, 1, x, t) == SMP_OK;
        smp_step_output_free(&out);
    }
    if (!ok) snprintf(why, sizeof why, "step: %s", smp_last_error());
    smp_model_free(model); /* writes the file */
    smp_finalize();
    unsetenv("SMP_TIMELINE");
    static tl_event ev[4096];
    int nev = ok && me == 0 ? read_timeline(path, ev, 4096) : 0;
    if (ok && me == 0 && nev <= 0) { snprintf(why, sizeof why, "cannot read %s", path); ok = 0; }
    for (int r = 0; ok && me == 0 && r < world; r++) {
        tl_event bwd[64], ar[256];
        int nb = 0, na = 0;
        const char *last_kind = zb ? "weight" : "backward"; /* the op that makes gradients final */
        int top = -1; /* the rank's last stage */
        for (int i = 0; i < nev; i++)
            if (ev[i].pid == r && !strcmp(ev[i].cat, last_kind) && ev[i].stage > top) top = ev[i].stage;
        for (int i = 0; i < nev; i++) {
            if (ev[i].pid != r) continue;
            if (!strcmp(ev[i].cat, last_kind) && ev[i].stage == top && nb < 64) bwd[nb++] = ev[i];
            if (!strcmp(ev[i].cat, "allreduce") && na < 256) ar[na++] = ev[i];
        }
        int per = na / steps; /* buckets per step */
        if (nb != m * steps || per < 2 || na != per * steps) {
            snprintf(why, sizeof why,
                     "rank %d: %d %s and %d all-reduce events (want %d, and at least 2 buckets a step)", r, nb,
                     last_kind, na, m * steps);
            ok = 0;
        }
        for (int s = 0; ok && s < steps; s++) {
            const tl_event *a = ar + s * per, *last = &bwd[s * m + m - 1];
            double backward_end = last->ts + last->dur;
            for (int k = 0; ok && k < per; k++) {
                if (a[k].bucket != k) {
                    snprintf(why, sizeof why, "rank %d step %d: all-reduce %d is bucket %d", r, s, k, a[k].bucket);
                    ok = 0;
                } else if (k && a[k].ts < a[k - 1].ts + a[k - 1].dur - 0.002) {
                    snprintf(why, sizeof why,
                             "rank %d step %d: bucket %d started at %.3f us, before bucket %d finished (%.3f)", r, s, k,
                             a[k].ts, k - 1, a[k - 1].ts + a[k - 1].dur);
                    ok = 0;
                }
            }
            if (ok && (overlap != (a[0].ts < backward_end - 0.002) || a[0].ts < last->ts - 0.002)) {
                snprintf(why, sizeof why,
                         "rank %d step %d: bucket 0 started at %.3f us, the last %s ran from %.3f to %.3f", r, s,
                         a[0].ts, last_kind, last->ts, backward_end);
                ok = 0;
            }
        }
    }
    if (me == 0) remove(path);
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_CHECK(ok, name, "%s", why);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    uint64_t s = 1234;
    for (size_t i = 0; i < sizeof g_x / sizeof g_x[0]; i++) g_x[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    for (size_t i = 0; i < sizeof g_t / sizeof g_t[0]; i++) g_t[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    for (int P = 1; P <= world; P *= 2) {
        if (world % P) continue;
        equivalence(P, true, SMP_PIPELINE_DEFAULT, false);
        polled(P);
        equivalence(P, false, SMP_PIPELINE_DEFAULT, false);
        equivalence(P, true, SMP_PIPELINE_ZERO_BUBBLE, false);
        if (P <= 2) equivalence(P, true, SMP_PIPELINE_ZERO_BUBBLE_V, false);
        if (world / P >= 2) { /* shard_optimizer_state needs 2 replicas */
            equivalence(P, true, SMP_PIPELINE_DEFAULT, true);
            equivalence(P, false, SMP_PIPELINE_DEFAULT, true);
            equivalence(P, true, SMP_PIPELINE_ZERO_BUBBLE, true);
            clipping_and_scaler(P, SMP_PIPELINE_DEFAULT, true);
        }
        char name[128];
        ddp_case base = {P, 4, 1, true, true, 25, false, SMP_PIPELINE_DEFAULT, false, false, false};
        ddp_case no_overlap = base, tiny = base, perturbed = base, bp2 = base, m8 = base;
        no_overlap.overlap = false;
        tiny.bucket_mb = 1e-4; /* about 100 bytes: a bucket per parameter */
        perturbed.perturb = true;
        snprintf(name, sizeof name, "ddp/overlapping and non-overlapping all-reduce agree/P=%d", P);
        same(name, base, no_overlap, 1, B, 1, B);
        snprintf(name, sizeof name, "ddp/bucket sizes agree/P=%d", P);
        same(name, base, tiny, 1, B, 1, B);
        ddp_case nd = base, nd_tiny = tiny, nd_no = no_overlap;
        nd.deterministic = nd_tiny.deterministic = nd_no.deterministic = false;
        snprintf(name, sizeof name, "ddp/non-deterministic: overlap and bucket sizes agree/P=%d", P);
        same(name, nd, nd_tiny, 1, B, 1, B);
        same(name, nd, nd_no, 1, B, 1, B);
        snprintf(name, sizeof name, "ddp/replicas starting apart are identical after one step/P=%d", P);
        same(name, base, perturbed, 1, B, 1, B);
        bp2.bpps = 2;
        bp2.m = 2;
        m8.m = 4;
        snprintf(name, sizeof name, "ddp/backward_passes_per_step 2 equals one step of twice the microbatches/P=%d", P);
        same(name, bp2, m8, 2, B / 2, 1, B);
        clipping_and_scaler(P, SMP_PIPELINE_DEFAULT, false);
        /* zero_bubble, linears split: bucket per parameter or one bucket, overlapping or
           not, the bits of interleaved 1F1B with whole backwards */
        ddp_case zb = base, zb_tiny = tiny, zb_no = no_overlap;
        zb_split(&zb);
        zb_split(&zb_tiny);
        zb_split(&zb_no);
        snprintf(name, sizeof name, "ddp/zero_bubble with split linears equals interleaved/P=%d", P);
        same(name, base, zb, 1, B, 1, B);
        snprintf(
            name, sizeof name,
            "ddp/zero_bubble: overlapping all-reduce with a bucket per parameter equals all-reduce at the end/P=%d", P);
        same(name, zb_tiny, zb_no, 1, B, 1, B);
        ddp_case zb_bp2 = bp2, zb_m8 = m8;
        zb_split(&zb_bp2);
        zb_split(&zb_m8);
        snprintf(name, sizeof name,
                 "ddp/zero_bubble: backward_passes_per_step 2 equals one step of twice the microbatches/P=%d", P);
        same(name, zb_bp2, zb_m8, 2, B / 2, 1, B);
        clipping_and_scaler(P, SMP_PIPELINE_ZERO_BUBBLE, false);
        if (P > 2) continue;
        /* zero_bubble_v: the same, on 2 stages per partition in a V */
        ddp_case v = base, v_tiny = tiny, v_no = no_overlap, v_bp2 = bp2, v_m8 = m8;
        zbv_split(&v);
        zbv_split(&v_tiny);
        zbv_split(&v_no);
        zbv_split(&v_bp2);
        zbv_split(&v_m8);
        ddp_case base_v = base; /* the same modules on each partition */
        base_v.vee = true;
        snprintf(name, sizeof name, "ddp/zero_bubble_v with split linears equals interleaved/P=%d", P);
        same(name, base_v, v, 1, B, 1, B);
        snprintf(
            name, sizeof name,
            "ddp/zero_bubble_v: overlapping all-reduce with a bucket per parameter equals all-reduce at the end/P=%d",
            P);
        same(name, v_tiny, v_no, 1, B, 1, B);
        snprintf(name, sizeof name,
                 "ddp/zero_bubble_v: backward_passes_per_step 2 equals one step of twice the microbatches/P=%d", P);
        same(name, v_bp2, v_m8, 2, B / 2, 1, B);
        clipping_and_scaler(P, SMP_PIPELINE_ZERO_BUBBLE_V, false);
    }
    if (world > 1) {
        bucket_order(true, SMP_PIPELINE_DEFAULT);
        bucket_order(false, SMP_PIPELINE_DEFAULT);
        bucket_order(true, SMP_PIPELINE_ZERO_BUBBLE);
        bucket_order(false, SMP_PIPELINE_ZERO_BUBBLE);
        bucket_order(true, SMP_PIPELINE_ZERO_BUBBLE_V);
        bucket_order(false, SMP_PIPELINE_ZERO_BUBBLE_V);
    }
    data_helpers();
    int rc = test_exit_code();
    MPI_Finalize();
    return rc;
}
