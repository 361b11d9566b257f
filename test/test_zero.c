/* test_zero.c - shard_optimizer_state (smp.h, SHARDED OPTIMIZER STATE)
   trained against the same run unsharded, deterministic reduction, with an
   engine optimizer (SGD with momentum) that keeps state for the owned
   ranges only. At 2 ranks 2 replicas; at 4, 4 replicas and 2 stages x 2:
     - the plain 7-call model (net7.h) with clipping and the grad scaler
       (an overflow of the average, where only its owner reads it, skips
       the step on every rank), the tied model, the composite model with
       recomputation, and the linears split under zero_bubble: parameters,
       norms, skips and momentum bitwise those of the unsharded run, with
       buckets small enough that parameters straddle the replicas' pieces;
     - the optimizer state the memory account counts is each replica's
       share: 1/dp of the unsharded figure within the buckets' padding, and
       the shares cover the partition;
     - chaos: a step that fails in a module's forward, and one that fails
       after its last message with the reduce-scatters in flight, change
       no parameter and no optimizer shard, and the run ends where a clean
       run without those steps ends.
   test_ddp checks the reduce-scattered gradients against the one-process
   reference (bitwise, and within the DDP bound without determinism). */
#define _POSIX_C_SOURCE 200809L
#define SMP_IMPLEMENTATION
#define SMP_TESTING /* smp_testing_fail */
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h" /* smp_optimizer: the state the memory account counts */
#include "test.h"

#include "net7.h"

enum { NP = 160, STEPS = 4, MAXDP = 4 };
static int g_world, g_rank;
static float g_x[MAXDP * 8 * B * D], g_t[MAXDP * 8 * B * C];

SMP_STEP_BODY(body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    const float *scale = (const float *)smp_mb_user(mb);
    float loss = mse((const float *)y->data, (const float *)t->data, g ? (float *)g->data : NULL,
                     (int)smp_tensor_numel(y));
    for (int64_t i = 0; g && scale && i < smp_tensor_numel(g); i++) ((float *)g->data)[i] *= *scale;
    return smp_mb_return_f32(mb, 0, loss);
}

enum { PLAIN, TIED, COMPOSITE, SPLIT };
static const char *model_name[] = {"plain", "tied", "composite, recomputed", "split linears, zero_bubble"};
enum { FAIL_NONE, FAIL_MODULE, FAIL_STEP_END, FAIL_ONE_MODULE };

typedef struct {
    float params[NP], mom[NP]; /* this rank's parameters (gathered), its momentum (NaN where it owns nothing) */
    double norms[8];
    int skipped[8];
    double scale;
    int64_t opt_bytes, owned, total;
    int nbuckets;
} result;

/* The engine's optimizer: momentum for the owned elements, registered so the memory account counts it. */
typedef struct { float *v[2 * NLIN]; int64_t first[2 * NLIN], count[2 * NLIN]; int n; smp_optimizer *reg; } sgdm;

static smp_status sgdm_init(sgdm *o, smp_model *model) {
    memset(o, 0, sizeof *o);
    smp_status st = smp_optimizer_new(model, &o->reg);
    smp_param *p;
    for (int i = 0; !st && (p = smp_model_local_param(model, i, false)); i++, o->n++) {
        st = smp_param_owned_range(model, p, &o->first[i], &o->count[i]);
        o->v[i] = (float *)calloc((size_t)o->count[i] + 1, sizeof(float));
        smp_tensor t = smp_tensor_1d(o->v[i], SMP_F32, o->count[i]);
        if (!st) st = smp_optimizer_state_add(o->reg, smp_param_name(p), "momentum", &t);
    }
    return st;
}

static void sgdm_step(sgdm *o, smp_model *model) {
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
        float *w = (float *)smp_param_value(p)->data + o->first[i];
        const float *g = (const float *)smp_param_grad(p)->data + o->first[i];
        for (int64_t k = 0; k < o->count[i]; k++) {
            o->v[i][k] = 0.9f * o->v[i][k] + g[k];
            w[k] -= 0.05f * o->v[i][k];
        }
    }
}

/* The parameters, gathered, and the momentum laid out like them. */
static void snapshot(smp_model *model, const sgdm *o, float *params, float *mom) {
    smp_param *p;
    int64_t at = 0;
    for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
        int64_t n = smp_tensor_numel(smp_param_value(p));
        memcpy(params + at, smp_param_value(p)->data, sizeof(float) * (size_t)n);
        for (int64_t k = 0; k < n; k++) mom[at + k] = NAN;
        memcpy(mom + at + o->first[i], o->v[i], sizeof(float) * (size_t)o->count[i]);
        at += n;
    }
}

/* The parameters every replica holds once the ranges are gathered: each element from the replica that owns it,
   through the test's own all-gather (not smp's). */
static void expected_params(smp_model *model, const sgdm *o, float *params) {
    static float mine[NP], all[MAXDP * NP];
    static char owns[NP], owners[MAXDP * NP];
    float mom[NP] = {0};
    int dp = smp_rdp_size();
    snapshot(model, o, mine, mom);
    for (int64_t k = 0; k < NP; k++) owns[k] = !isnan(mom[k]);
    MPI_Comm comm = smp_group_comm(SMP_RDP_GROUP);
    MPI_Allgather(mine, NP, MPI_FLOAT, all, NP, MPI_FLOAT, comm);
    MPI_Allgather(owns, NP, MPI_CHAR, owners, NP, MPI_CHAR, comm);
    for (int64_t k = 0; k < NP; k++)
        for (int r = dp - 1; r >= 0; r--)
            if (owners[r * NP + k]) params[k] = all[r * NP + k];
}

static smp_model *build_case(net *n, int P, int kind) {
    int placement[7];
    for (int k = 0; k < 7; k++) placement[k] = k * P / 7;
    const int *place = P > 1 ? placement : NULL;
    if (kind == TIED) net_modules_tied(n, place);
    else if (kind == SPLIT) net_modules_split(n, place, &net_host_fns, &net_host_split);
    else net_modules(n, kind == COMPOSITE ? NULL : place, &net_host_fns);
    if (kind == COMPOSITE) net_block(n, true);
    return net_model(n, false);
}

/* The gradient element the scaler test overflows: the first of the last replica's piece of bucket 0 (sharded
   runs pad that bucket to a multiple of the replicas), so that only the last replica reads the average there. */
static void overflow_element(smp_model *md, int dp, smp_param **p, int64_t *index) {
    int64_t n0 = 0;
    for (int q = md->bucket_first[0]; q < md->bucket_first[1]; q++)
        n0 += smp_tensor_numel(&md->params[md->grad_order[q]]->grad);
    int64_t at = (n0 + dp - 1) / dp * (dp - 1);
    *p = NULL;
    for (int q = md->bucket_first[0]; q < md->bucket_first[1]; q++) {
        int i = md->grad_order[q];
        if (at >= md->grad_at[i] && at < md->grad_at[i] + smp_tensor_numel(&md->params[i]->grad)) {
            *p = md->params[i];
            *index = at - md->grad_at[i];
        }
    }
}

/* Trains `steps` steps of case (P, kind); fails[s]: how step s fails. Data follow the steps that worked, so a
   run that skips failed steps sees what a clean run sees. Returns 0 with *why on a wrong result. */
static int train(int P, int kind, bool shard, bool clip, bool scaler, int steps, const int *fails, result *r, char *why,
                 size_t cap) {
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = 2;
    cfg.ddp = SMP_ON;
    cfg.deterministic_reduction = SMP_ON;
    cfg.shard_optimizer_state = shard ? SMP_ON : SMP_OFF;
    cfg.bucket_cap_mb = 0.0002; /* 52 floats: several buckets, parameters across the pieces */
    cfg.pipeline = kind == SPLIT ? SMP_PIPELINE_ZERO_BUBBLE : SMP_PIPELINE_INTERLEAVED;
    if (P > 1 && kind != COMPOSITE) cfg.auto_partition = SMP_OFF;
    if (kind == COMPOSITE) { /* split by bytes, not by traced timings: the same stages in the runs compared */
        cfg.memory_weight = 1;
        cfg.has_memory_weight = true;
    }
    cfg.seed = 7;
    memset(r, 0, sizeof *r);
    if (smp_init(&cfg)) { snprintf(why, cap, "smp_init: %s", smp_last_error()); return 0; }
    int64_t opt0 = smp_memory().bytes[SMP_MEMORY_OPTIMIZER];
    net n;
    smp_model *model = build_case(&n, P, kind);
    smp_tensor sample = smp_tensor_2d(g_x, SMP_F32, B / 2, D);
    sgdm o;
    memset(&o, 0, sizeof o);
    int ok = model && smp_model_trace(model, &sample, 1) == SMP_OK && sgdm_init(&o, model) == SMP_OK;
    if (!ok) snprintf(why, cap, "set-up: %s", smp_last_error());
    r->opt_bytes = smp_memory().bytes[SMP_MEMORY_OPTIMIZER] - opt0;
    for (int i = 0; ok && i < o.n; i++) {
        r->owned += o.count[i];
        r->total += smp_tensor_numel(smp_param_value(smp_model_local_param(model, i, false)));
    }
    if (ok && r->total > NP) {
        ok = 0;
        snprintf(why, cap, "%lld local elements, room for %d", (long long)r->total, NP);
    }
    r->nbuckets = ok ? model->nbuckets : 0;
    smp_grad_scaler gs = {0};
    float before[NP], mom_before[NP], after[NP], mom_after[NP];
    if (ok) snapshot(model, &o, before, mom_before);
    if (ok && model->params_stale) { ok = 0; snprintf(why, cap, "parameters stale before the first step"); }
    int dp = smp_rdp_size(), worked = 0;
    for (int s = 0; ok && s < steps; s++) {
        int fail = fails ? fails[s] : FAIL_NONE;
        size_t rows = (size_t)B, at = ((size_t)smp_rdp_rank() * 8 + (size_t)worked) * rows;
        smp_tensor x = smp_tensor_2d(g_x + at * D, SMP_F32, B, D), t = smp_tensor_2d(g_t + at * C, SMP_F32, B, C);
        smp_step_output loss = {0};
        smp_model_zero_grad(model);
        if (fail == FAIL_MODULE) g_fail = 0;
        if (fail == FAIL_ONE_MODULE && g_rank == g_world - 1) g_fail = smp_mp_rank(); /* this rank alone */
        if (fail == FAIL_STEP_END && g_rank == g_world - 1) smp_testing_fail(SMP_FAULT_STEP_END, 0);
        float scale = scaler ? (float)smp_grad_scaler_scale(&gs) : 1.0f;
        smp_status st = SMP_TRAIN_STEP(model, body, scaler ? &scale : NULL, &loss, 1, x, t);
        g_fail = -1;
        smp_testing_fail(SMP_FAULT_STEP_END, -1);
        smp_step_output_free(&loss);
        if (st == SMP_OK && fail) { ok = 0; snprintf(why, cap, "step %d should have failed", s); break; }
        if (st && !fail) { ok = 0; snprintf(why, cap, "step %d: %s", s, smp_last_error()); break; }
        /* the step gathered the ranges the last update changed, all of them, failed or not (no all-gather left in
           flight, no parameter half gathered), and a failed one changed nothing else */
        snapshot(model, &o, after, mom_after);
        bool stale = fail && model->params_stale; /* a step that worked marks them for the engine's update */
        if (stale || memcmp(before, after, sizeof(float) * (size_t)r->total) ||
            memcmp(mom_before, mom_after, sizeof(float) * (size_t)r->total)) {
            ok = 0;
            snprintf(why, cap, "step %d%s left parameters%s other than the replicas' last update", s,
                     fail ? " (failed)" : "", stale ? " stale, or" : "");
        }
        if (fail) continue;
        bool skip = false;
        if (scaler) {
            if (worked == 1) { /* the average overflows in one element: where the last replica reads it, sharded */
                smp_param *p;
                int64_t e;
                overflow_element(model, dp, &p, &e);
                if (p && smp_module_is_local(p->module) && (!shard || smp_rdp_rank() == dp - 1))
                    ((float *)p->grad.data)[e] = INFINITY;
            }
            if (smp_grad_scaler_unscale(model, &gs, &skip)) {
                ok = 0;
                snprintf(why, cap, "unscale: %s", smp_last_error());
            }
        }
        if (worked < 8) r->skipped[worked] = skip;
        if (ok && clip && !skip && smp_clip_grad_norm(model, 0.02, worked < 8 ? &r->norms[worked] : NULL)) {
            ok = 0;
            snprintf(why, cap, "clip: %s", smp_last_error());
        }
        if (ok && !skip) sgdm_step(&o, model);
        worked++;
        if (ok) { /* the next step gathers what the replicas updated, overlapped with its forward */
            snapshot(model, &o, after, mom_before);
            expected_params(model, &o, before);
        }
    }
    r->scale = gs.scale;
    memcpy(r->params, before, sizeof before);
    memcpy(r->mom, mom_before, sizeof mom_before);
    for (int i = 0; i < o.n; i++) free(o.v[i]);
    smp_optimizer_free(o.reg);
    smp_model_free(model);
    smp_finalize();
    return ok;
}

/* Momentum of the sharded run against the unsharded run's, where the sharded run owns it. */
static bool same_momentum(const result *sharded, const result *full) {
    for (int64_t k = 0; k < sharded->total; k++)
        if (!isnan(sharded->mom[k]) && memcmp(&sharded->mom[k], &full->mom[k], sizeof(float))) return false;
    return true;
}

static void sharded_equals_unsharded(int P, int kind, bool clip, bool scaler) {
    char name[256], why[4096] = "";
    int dp = g_world / P;
    snprintf(name, sizeof name, "shard_optimizer_state/%dx%d/%s%s%s: bitwise the unsharded run, 1/dp of the optimizer "
             "state", P, dp, model_name[kind], clip ? ", clipped" : "", scaler ? ", grad scaler with an overflow" : "");
    static result a, b;
    int ok = train(P, kind, false, clip, scaler, STEPS, NULL, &a, why, sizeof why) &&
             train(P, kind, true, clip, scaler, STEPS, NULL, &b, why, sizeof why);
    if (ok && (a.total != b.total || memcmp(a.params, b.params, sizeof(float) * (size_t)a.total))) {
        ok = 0;
        snprintf(why, sizeof why, "parameters differ from the unsharded run's");
    }
    if (ok && !same_momentum(&b, &a)) {
        ok = 0;
        snprintf(why, sizeof why, "momentum differs where this replica owns it");
    }
    if (ok && (memcmp(a.norms, b.norms, sizeof a.norms) || memcmp(a.skipped, b.skipped, sizeof a.skipped) ||
               a.scale != b.scale)) {
        ok = 0;
        snprintf(why, sizeof why, "norms %.17g/%.17g, skipped %d%d%d%d/%d%d%d%d, scale %g/%g", a.norms[0], b.norms[0],
                 a.skipped[0], a.skipped[1], a.skipped[2], a.skipped[3], b.skipped[0], b.skipped[1], b.skipped[2],
                 b.skipped[3], a.scale, b.scale);
    }
    if (ok && scaler && !(a.skipped[1] && !a.skipped[0] && !a.skipped[2])) {
        ok = 0;
        snprintf(why, sizeof why, "the overflow at step 1 did not skip that step alone (%d%d%d)", a.skipped[0],
                 a.skipped[1], a.skipped[2]);
    }
    if (ok && clip && !(a.norms[0] > 0.02)) {
        ok = 0;
        snprintf(why, sizeof why, "norm %g: nothing clipped", a.norms[0]);
    }
    /* the account: 4 bytes per owned element; 1/dp of the unsharded state within the padding of each bucket */
    int64_t slack = (int64_t)b.nbuckets * (dp - 1) * 4;
    int most = 0; /* some rank has parameters across several buckets (a small partition may have one) */
    MPI_Allreduce(&b.nbuckets, &most, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (ok && (a.opt_bytes != 4 * a.total || b.opt_bytes != 4 * b.owned || most < 2 ||
               llabs(b.opt_bytes * dp - a.opt_bytes) > slack * dp)) {
        ok = 0;
        snprintf(why, sizeof why, "optimizer bytes unsharded %lld for %lld elements, sharded %lld for %lld owned, "
                 "%d buckets (1/%d, within %lld bytes)", (long long)a.opt_bytes, (long long)a.total,
                 (long long)b.opt_bytes, (long long)b.owned, b.nbuckets, dp, (long long)slack);
    }
    int64_t owned = 0, total = 0; /* the replicas' shares cover the partition */
    MPI_Allreduce(&b.owned, &owned, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&b.total, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    if (ok && owned * dp != total) {
        ok = 0;
        snprintf(why, sizeof why, "owned elements sum to %lld over the world, want %lld", (long long)owned,
                 (long long)(total / dp));
    }
    MPI_CHECK(ok, name, "%s", why);
}

/* Steps 1, 3 and 4 of 6 fail (a module's forward on every rank; after the last message, with the reduce-scatters
   started; the first forward call of one replica, with the parameter all-gathers of the buckets it does not read
   in flight): each changes nothing, and the run equals 3 clean steps. */
static void chaos(int P) {
    char name[200], why[4096] = "";
    snprintf(name, sizeof name, "shard_optimizer_state/%dx%d/chaos: failed steps change no parameter and no optimizer "
             "shard; the run equals a clean one without them", P, g_world / P);
    static result a, b;
    const int fails[6] = {FAIL_NONE, FAIL_MODULE, FAIL_NONE, FAIL_STEP_END, FAIL_ONE_MODULE, FAIL_NONE};
    int ok = train(P, PLAIN, true, true, false, 6, fails, &a, why, sizeof why) &&
             train(P, PLAIN, true, true, false, 3, NULL, &b, why, sizeof why);
    if (ok && (memcmp(a.params, b.params, sizeof(float) * (size_t)a.total) || !same_momentum(&a, &b) ||
               memcmp(a.norms, b.norms, sizeof a.norms))) {
        ok = 0;
        snprintf(why, sizeof why, "the run with failed steps ended elsewhere than the clean run without them");
    }
    MPI_CHECK(ok, name, "%s", why);
}

/* SMP_TIMELINE of 3 sharded steps on one stage: in each step after an update, every bucket's parameter all-gather
   starts before the step's first forward, and the step puts the bucket's parameters in place only after that
   forward began (before the first call that reads one of them, so the buckets of later calls gather while the
   first calls compute) and before the step's first backward; the all-gathers start in the order the forward reads
   them, the first call's bucket first; the step before any update gathers nothing. */
static void overlap(void) {
    char name[200], why[4096] = "", path[64];
    snprintf(name, sizeof name, "shard_optimizer_state/1x%d/overlap: the parameter all-gathers start as the step "
             "begins and the first forward waits for each bucket only before a call reads it (SMP_TIMELINE)", g_world);
    static result a;
    timeline_to("zero_overlap", path, sizeof path);
    int ok = train(1, PLAIN, true, false, false, 3, NULL, &a, why, sizeof why);
    unsetenv("SMP_TIMELINE");
    static tl_event ev[4096];
    int nev = ok && g_rank == 0 ? read_timeline(path, ev, 4096) : 0;
    if (ok && g_rank == 0 && nev <= 0) { ok = 0; snprintf(why, sizeof why, "cannot read %s", path); }
    for (int r = 0; ok && g_rank == 0 && r < g_world; r++) {
        tl_event fwd[16], bwd[16], ag[256];
        int nf = 0, nb = 0, na = 0, per_step[3] = {0, 0, 0}, first_started[3] = {-1, -1, -1};
        double first_ts[3] = {0, 0, 0};
        for (int i = 0; i < nev; i++) {
            if (ev[i].pid != r) continue;
            if (!strcmp(ev[i].cat, "forward") && nf < 16) fwd[nf++] = ev[i];
            if (!strcmp(ev[i].cat, "backward") && nb < 16) bwd[nb++] = ev[i];
            if (!strcmp(ev[i].cat, "allgather") && na < 256) ag[na++] = ev[i];
        }
        if (nf != 6 || nb != 6) { ok = 0; snprintf(why, sizeof why, "rank %d: %d forwards, %d backwards", r, nf, nb); }
        for (int g = 0; ok && g < na; g++) {
            int s = 0; /* its step: the first whose first forward begins after it started */
            while (s < 3 && fwd[2 * s].ts < ag[g].ts) s++;
            double end = ag[g].ts + ag[g].dur;
            if (s == 0 || s == 3 || !(end > fwd[2 * s].ts) || end > bwd[2 * s].ts + 0.002) {
                ok = 0;
                snprintf(why, sizeof why, "rank %d: bucket %d's all-gather ran from %.3f to %.3f us, step %d's first "
                         "forward began at %.3f, its first backward at %.3f", r, ag[g].bucket, ag[g].ts, end, s,
                         s < 3 ? fwd[2 * s].ts : -1.0, s < 3 ? bwd[2 * s].ts : -1.0);
            } else per_step[s]++;
            if (ok && (first_started[s] < 0 || ag[g].ts < first_ts[s])) {
                first_started[s] = ag[g].bucket;
                first_ts[s] = ag[g].ts;
            }
        }
        /* in the order the forward reads them: the first call's parameters are in the last bucket (backward order) */
        for (int s = 1; ok && s < 3; s++)
            if (first_started[s] != a.nbuckets - 1) {
                ok = 0;
                snprintf(why, sizeof why, "rank %d step %d: bucket %d's all-gather started first, not bucket %d (the "
                         "first call's)", r, s, first_started[s], a.nbuckets - 1);
            }
        if (ok && (per_step[1] < 2 || per_step[1] != per_step[2] || per_step[1] != a.nbuckets)) {
            ok = 0;
            snprintf(why, sizeof why, "rank %d: %d and %d all-gathers in steps 1 and 2, for %d buckets", r,
                     per_step[1], per_step[2], a.nbuckets);
        }
    }
    if (g_rank == 0) remove(path);
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_CHECK(ok, name, "%s", why);
}

static void errors(void) {
    smp_config cfg = {0}, out;
    cfg.shard_optimizer_state = SMP_ON;
    smp_status st = smp_config_from_json("{\"shard_optimizer_state\": true}", &cfg);
    CHECK(st == SMP_OK && cfg.shard_optimizer_state == SMP_ON, "shard_optimizer_state: the JSON key", "%s",
          smp_last_error());
    st = smp_config_resolve(&cfg, 2, &out);
    CHECK(st == SMP_ERR_CONFIG && strstr(smp_last_error(), "ddp is off") && strstr(smp_last_error(), "\"ddp\": true"),
          "shard_optimizer_state: without ddp, an error naming the fix", "%s", smp_last_error());
    cfg.ddp = SMP_ON;
    cfg.partitions = 2;
    st = smp_config_resolve(&cfg, 2, &out);
    CHECK(st == SMP_ERR_CONFIG && strstr(smp_last_error(), "one replica") &&
              strstr(smp_last_error(), "at least 4 ranks"),
          "shard_optimizer_state: one replica, an error naming the fix", "%s", smp_last_error());
    /* 2 ranks as 1 partition x 2 shards: still one replica (its TP ranks hold shards, not copies) */
    cfg.partitions = 1;
    cfg.tensor_parallel_degree = 2;
    st = smp_config_resolve(&cfg, 2, &out);
    CHECK(st == SMP_ERR_CONFIG && strstr(smp_last_error(), "one replica") &&
              strstr(smp_last_error(), "at least 4 ranks") && strstr(smp_last_error(), "tensor_parallel_degree = 2"),
          "shard_optimizer_state: one replica of 2 TP shards, an error naming the fix", "%s", smp_last_error());
    st = smp_config_resolve(&cfg, 4, &out);
    CHECK(st == SMP_OK, "shard_optimizer_state: 2 replicas of 2 TP shards resolve", "%s", smp_last_error());
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    uint64_t s = 5;
    for (size_t i = 0; i < sizeof g_x / sizeof g_x[0]; i++) g_x[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    for (size_t i = 0; i < sizeof g_t / sizeof g_t[0]; i++) g_t[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    if (g_rank == 0) errors();
    if (g_world >= 2) overlap();
    for (int P = 1; P <= 2; P++) {
        if (g_world % P || g_world / P < 2) continue;
        sharded_equals_unsharded(P, PLAIN, true, true);
        sharded_equals_unsharded(P, TIED, false, false);
        sharded_equals_unsharded(P, COMPOSITE, false, false);
        sharded_equals_unsharded(P, SPLIT, true, false);
        chaos(P);
    }
    int rc = test_exit_code();
    MPI_Finalize();
    return rc;
}
