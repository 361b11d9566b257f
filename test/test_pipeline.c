/* test_pipeline.c - the executor against the same model run in one process.
   A 7-call model with a skip connection (call 0 feeds calls 1 and 3) runs
   for every partition count that fits the world, microbatches 1, 2, 3, 4, 8,
   every schedule (simple, interleaved, zero_bubble, zero_bubble_v), manual
   placement 0,1,0,1 and interleaving (zero_bubble_v: auto and manual V
   placements, two stages per rank, the middle two on one rank); the loss of each microbatch and every gradient
   must equal, bit for bit, a plain C implementation of the same model with
   the same kernels and microbatching. zero_bubble runs with the linears'
   backward split into B and W (beside the ReLUs' and the add's whole
   backward) and with every backward whole; the split linears also run
   under the other schedules, which run B and W back to back. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"

#include "net7.h"
#include <unistd.h>

static float g_x[B * D], g_t[B * C];
static float g_losses[8];
/* bodies that ran in training and in evaluation steps, and those that said
   one while having (or lacking) the output gradient of the other */
static int g_bodies_training, g_bodies_eval, g_bodies_confused;

SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    if (smp_mb_is_training(mb)) g_bodies_training++;
    else g_bodies_eval++;
    if (smp_mb_is_training(mb) != (g != NULL)) g_bodies_confused++;
    float loss =
        mse((const float *)y->data, (const float *)t->data, g ? (float *)g->data : NULL, (int)smp_tensor_numel(y));
    smp_status st = smp_mb_return_f32(mb, 0, loss);
    return st ? st : smp_mb_return(mb, 1, y);
}

/* Compares this rank's gradients (and the per-microbatch losses everyone got) with the reference. */
static int compare(smp_model *m, const ref_t *r, const smp_step_output *outs, int mbs, char *why, size_t cap) {
    static const char *names[NLIN] = {"fc0", "fc1", "fc2", "head"};
    for (int i = 0; i < mbs; i++) {
        float got = ((const float *)outs[0].values[i].data)[0];
        if (memcmp(&got, &r->loss[i], 4)) {
            snprintf(why, cap, "loss of microbatch %d: %.9g vs reference %.9g", i, got, r->loss[i]);
            return 0;
        }
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
        if (memcmp(smp_param_grad(pw)->data, r->gw[l], nw * 4) ||
            memcmp(smp_param_grad(pb)->data, r->gb[l], (size_t)lin_out[l] * 4)) {
            const float *g = (const float *)smp_param_grad(pw)->data;
            snprintf(why, cap, "gradient of %s differs (first element %.9g vs %.9g)", names[l], g[0], r->gw[l][0]);
            return 0;
        }
        if (memcmp(smp_param_value(pw)->data, r->w[l], nw * 4)) {
            snprintf(why, cap, "initial value of %s.weight differs", names[l]);
            return 0;
        }
    }
    return 1;
}

static int world;

static const char *kind_name(smp_pipeline_kind k) {
    return k == SMP_PIPELINE_SIMPLE          ? "simple"
           : k == SMP_PIPELINE_ZERO_BUBBLE   ? "zero_bubble"
           : k == SMP_PIPELINE_ZERO_BUBBLE_V ? "zero_bubble_v"
                                             : "interleaved";
}
static bool split_kind(smp_pipeline_kind k) { return k == SMP_PIPELINE_ZERO_BUBBLE || k == SMP_PIPELINE_ZERO_BUBBLE_V; }

/* The zero-bubble stats: each stage's peak in flight (F to W) equals what the
   simulator counts for the same schedule, is at most min(m, S), and with one
   stage per rank no stage holds more than 1F1B's busiest (min(m, S), stage 0).
   zero_bubble_v: the stages form the V, and the rank holds at most 2 min(m, P). */
static int check_zb_stats(smp_model *model, smp_pipeline_kind kind, int P, int m, char *why, size_t cap) {
    smp_step_stats ss = smp_last_step_stats(model);
    int S = smp_model_num_stages(model), map[16], ok = 1;
    for (int s = 0; s < S && s < 16; s++) map[s] = smp_model_stage_rank(model, s);
    smp_schedule sc;
    smp_sim_result r;
    if (kind == SMP_PIPELINE_ZERO_BUBBLE_V) {
        for (int s = 0; s < S && S == 2 * P; s++)
            if (map[s] != (s < P ? s : 2 * P - 1 - s)) S = -1;
        if (S != 2 * P) {
            snprintf(why, cap, "zero_bubble_v partitioned the model into %d stages, not the V of %d",
                     smp_model_num_stages(model), 2 * P);
            return 0;
        }
    }
    if (S > 16 || smp_schedule_build(kind, P, S, map, m, false, &sc) != SMP_OK) {
        snprintf(why, cap, "cannot build the schedule to compare with: %s", smp_last_error());
        return 0;
    }
    if (smp_schedule_simulate(&sc, NULL, NULL, NULL, 0.0, &r) != SMP_OK) {
        snprintf(why, cap, "cannot simulate the schedule: %s", smp_last_error());
        smp_schedule_free(&sc);
        return 0;
    }
    int bound = m < S ? m : S;
    int held = 0, me = smp_mp_rank();
    for (int k = 0; k < ss.local_stages && ok; k++) {
        int s = ss.stage_index[k], got = ss.peak_inflight[k];
        if (got != r.peak_inflight[s] || got > bound) {
            snprintf(why, cap,
                     "stage %d held %d microbatches at its peak (in flight until W); the simulator counts %d, bound "
                     "min(m, S) = %d",
                     s, got, r.peak_inflight[s], bound);
            ok = 0;
        }
        held += got;
    }
    if (ok && kind == SMP_PIPELINE_ZERO_BUBBLE_V &&
        (ss.local_stages != 2 || r.rank_peak_inflight[me] > 2 * (m < P ? m : P) || held < r.rank_peak_inflight[me])) {
        snprintf(why, cap,
                 "rank %d: %d stages, %d microbatch-stages in flight at the simulator's peak (bound 2 min(m, P) = %d)",
                 me, ss.local_stages, r.rank_peak_inflight[me], 2 * (m < P ? m : P));
        ok = 0;
    }
    smp_sim_result_free(&r);
    smp_schedule_free(&sc);
    return ok;
}

/* active_microbatches of the cases run_case_split runs (0: none) */
static int g_active;

/* The microbatches this rank held at once, as the step counted them, equal
   what the simulator counts for the same (capped) schedule, and are at
   most the cap. */
static int check_active(smp_model *model, smp_pipeline_kind kind, int P, int m, int cap, char *why, size_t whycap) {
    smp_step_stats ss = smp_last_step_stats(model);
    int S = smp_model_num_stages(model), map[16], me = smp_mp_rank(), ok = 1;
    for (int s = 0; s < S && s < 16; s++) map[s] = smp_model_stage_rank(model, s);
    smp_schedule sc;
    smp_sim_result r;
    if (S > 16 || smp_schedule_build_capped(kind, P, S, map, m, cap, false, &sc) != SMP_OK) {
        snprintf(why, whycap, "cannot build the schedule to compare with: %s", smp_last_error());
        return 0;
    }
    if (smp_schedule_simulate(&sc, NULL, NULL, NULL, 0.0, &r) != SMP_OK) {
        snprintf(why, whycap, "cannot simulate the schedule: %s", smp_last_error());
        smp_schedule_free(&sc);
        return 0;
    }
    int got = ss.peak_active_microbatches;
    if (got != r.rank_peak_microbatches[me] || got < 1 || (cap && got > cap)) {
        snprintf(why, whycap, "rank %d held %d microbatches at once; the simulator counts %d, the cap is %d", me, got,
                 r.rank_peak_microbatches[me], cap);
        ok = 0;
    }
    smp_sim_result_free(&r);
    smp_schedule_free(&sc);
    return ok;
}

static void run_case_split(int P, int m, smp_pipeline_kind kind, const int *placement, int vstages, bool split,
                           const char *label) {
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = m;
    cfg.pipeline = kind;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.virtual_stages = vstages;
    cfg.seed = 7;
    cfg.active_microbatches = g_active;
    if (placement) { cfg.auto_partition = SMP_OFF; }
    char name[160], why[4096] = "", capped[48] = "";
    if (g_active) snprintf(capped, sizeof capped, "/active_microbatches %d", g_active);
    snprintf(name, sizeof name, "pipeline/%s/P=%d/m=%d/%s%s%s", label, P, m, kind_name(kind),
             split ? "/split linears" : "", capped);
    smp_status st = smp_init(&cfg);
    if (st) { MPI_CHECK(0, name, "smp_init: %s", smp_last_error()); return; }
    net n;
    smp_model *model = build_split(&n, placement, split);
    long b0 = 0, w0 = 0, deferred0 = 0, adjacent0 = 0;
    ref_t ref;
    ref_params(&ref);
    int ok = model != NULL;
    if (!ok) snprintf(why, sizeof why, "build: %s", smp_last_error());
    for (int step = 0; step < 2 && ok; step++) { /* two steps: gradients accumulate across them too */
        smp_step_output outs[2] = {{0}};
        /* (tracing ran step 0's calls once more) */
        if (step == 1) { b0 = g_b_calls; w0 = g_w_calls; deferred0 = g_w_deferred; adjacent0 = g_w_adjacent; }
        smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D), t = smp_tensor_2d(g_t, SMP_F32, B, C);
        st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 2, x, t);
        ref_step(&ref, g_x, g_t, m, true);
        if (st) { snprintf(why, sizeof why, "step %d: %s", step, smp_last_error()); ok = 0; }
        else ok = compare(model, &ref, outs, m, why, sizeof why);
        if (ok && outs[1].microbatches == m) { /* the outputs, concatenated, are the model's output on the batch */
            float all[B * C];
            smp_tensor cat = smp_tensor_2d(all, SMP_F32, B, C);
            if (smp_step_output_concat(&outs[1], &cat) || memcmp(all, ref.out, sizeof all)) {
                snprintf(why, sizeof why, "concatenated outputs differ");
                ok = 0;
            }
        }
        if (ok) ok = check_active(model, kind, P, m, g_active, why, sizeof why);
        if (ok && split_kind(kind) && !g_active) ok = check_zb_stats(model, kind, P, m, why, sizeof why);
        if (ok && !split_kind(kind) && !g_active) { /* stash peaks: simple holds every microbatch, 1F1B at most S - s */
            smp_step_stats ss = smp_last_step_stats(model);
            int S = smp_model_num_stages(model);
            for (int k = 0; k < ss.local_stages && ok; k++) {
                int s = ss.stage_index[k], want = kind == SMP_PIPELINE_SIMPLE ? m : (S - s < m ? S - s : m);
                bool one_per_rank = S == P;
                if (kind == SMP_PIPELINE_SIMPLE
                        ? ss.peak_inflight[k] != want
                        : (ss.peak_inflight[k] > want || (one_per_rank && ss.peak_inflight[k] != want))) {
                    snprintf(why, sizeof why, "stage %d held %d microbatches at its peak, expected %s%d", s,
                             ss.peak_inflight[k], kind == SMP_PIPELINE_SIMPLE || one_per_rank ? "" : "at most ", want);
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
    /* split linears, in the second step: one B and one W per local linear and microbatch;
       W right after its B unless the schedule has W ops, and then (all ranks
       together) at least one W put later once there are several microbatches */
    long nb = g_b_calls - b0, nw = g_w_calls - w0, deferred = g_w_deferred - deferred0,
         adjacent = g_w_adjacent - adjacent0, any_deferred;
    int local_lin = 0;
    for (int l = 0; model && l < NLIN; l++) local_lin += smp_module_is_local(n.lin[l]);
    MPI_Allreduce(&deferred, &any_deferred, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (ok && split && (nb != (long)m * local_lin || nw != nb)) {
        snprintf(why, sizeof why, "%ld B and %ld W calls of the linears, expected %d each", nb, nw, m * local_lin);
        ok = 0;
    } else if (ok && !split && (nb || nw)) {
        snprintf(why, sizeof why, "whole-backward linears ran %ld B and %ld W callbacks", nb, nw);
        ok = 0;
    } else if (ok && split && !split_kind(kind) && deferred) {
        snprintf(why, sizeof why, "%ld of %ld W calls did not follow their own B under %s", deferred, nw,
                 kind_name(kind));
        ok = 0;
    } else if (ok && split && split_kind(kind) && m > 1 && (kind == SMP_PIPELINE_ZERO_BUBBLE || m >= 2 * P - 1) &&
               g_active != 1 && !any_deferred) {
        /* (zero_bubble_v with fewer than 2P-1 microbatches may run each W right after its B; one microbatch at a time
           leaves nothing to put a W behind) */
        snprintf(why, sizeof why, "every W ran right after its own B (%ld here): %s deferred none", adjacent,
                 kind_name(kind));
        ok = 0;
    }
    MPI_CHECK(ok, name, "%s", why);
    smp_model_free(model);
    smp_finalize();
}
static void run_case(int P, int m, smp_pipeline_kind kind, const int *placement, int vstages, const char *label) {
    run_case_split(P, m, kind, placement, vstages, false, label);
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
    char name[160];
    snprintf(name, sizeof name, "pipeline/module error reaches every rank/P=%d", P);
    MPI_CHECK(st != SMP_OK && strstr(smp_last_error(), "injected failure") && strstr(smp_last_error(), "module"), name,
              "status %d, message: %s", st, smp_last_error());
    /* a failure that others are already waiting on: its message, not "another rank failed", reaches everyone */
    g_fail = P - 1;
    g_fail_mb = 2;
    st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x, t);
    g_fail = g_fail_mb = -1;
    snprintf(name, sizeof name, "pipeline/a failure on microbatch 2 of the last stage names its cause everywhere/P=%d",
             P);
    MPI_CHECK(st != SMP_OK && strstr(smp_last_error(), "injected failure") && strstr(smp_last_error(), "microbatch 2"),
              name, "status %d, message: %s", st, smp_last_error());
    st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x, t);
    snprintf(name, sizeof name, "pipeline/step after an error works/P=%d", P);
    MPI_CHECK(st == SMP_OK && outs[0].microbatches == 4, name, "%s", smp_last_error());
    /* a batch that does not divide into the microbatches */
    smp_tensor x5 = smp_tensor_2d(g_x, SMP_F32, 5, D), t5 = smp_tensor_2d(g_t, SMP_F32, 5, C);
    st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x5, t5);
    snprintf(name, sizeof name, "pipeline/indivisible batch is an error/P=%d", P);
    MPI_CHECK(st == SMP_ERR_ARG && strstr(smp_last_error(), "batch of 5") && strstr(smp_last_error(), "4 microbatches"),
              name, "%s", smp_last_error());
    /* evaluation: forward only, outputs equal the reference forward */
    ref_t ref;
    ref_params(&ref);
    ref_step(&ref, g_x, g_t, 4, false);
    smp_step_output eo[2] = {{0}, {0}};
    g_bodies_training = g_bodies_eval = g_bodies_confused = 0;
    st = SMP_EVAL_STEP(model, mse_body, NULL, eo, 2, x, t);
    snprintf(name, sizeof name,
             "pipeline/a body knows an evaluation step from a training step (smp_mb_is_training)/P=%d", P);
    int last = smp_mp_rank() == P - 1; /* where the model's output, and so the body, lives */
    MPI_CHECK(g_bodies_training == 0 && g_bodies_confused == 0 && g_bodies_eval == (last ? 4 : 0), name,
              "evaluation step: %d bodies said training, %d evaluating, %d disagreed with their output gradient",
              g_bodies_training, g_bodies_eval, g_bodies_confused);
    float all[B * C];
    smp_tensor cat = smp_tensor_2d(all, SMP_F32, B, C);
    snprintf(name, sizeof name, "pipeline/evaluation step outputs/P=%d", P);
    MPI_CHECK(st == SMP_OK && !smp_step_output_concat(&eo[1], &cat) && !memcmp(all, ref.out, sizeof all), name, "%s",
              st ? smp_last_error() : "outputs differ");
    float mean_ref = 0, sum;
    for (int i = 0; i < 4; i++) mean_ref += ref.loss[i];
    smp_tensor s1 = smp_tensor_make(&sum, SMP_F32, 0, NULL);
    snprintf(name, sizeof name, "pipeline/StepOutput reduce_sum and mean/P=%d", P);
    MPI_CHECK(!smp_step_output_reduce_sum(&eo[0], &s1) && fabsf(sum - mean_ref) <= 1e-6f * fabsf(mean_ref) &&
                  fabs(smp_step_output_reduce_mean_f64(&eo[0]) - mean_ref / 4) <= 1e-6 * fabs(mean_ref),
              name, "sum %g vs %g", sum, mean_ref);
    /* reduce_mean divides each element's sum by the microbatch count; stack
       lays the values out microbatch by microbatch */
    enum { MB_ROWS = B / 4 };
    float lmean, omean[MB_ROWS * C], stacked[B * C];
    smp_tensor lm = smp_tensor_make(&lmean, SMP_F32, 0, NULL), om = smp_tensor_2d(omean, SMP_F32, MB_ROWS, C);
    smp_tensor stk = smp_tensor_make(stacked, SMP_F32, 3, (const int64_t[]){4, MB_ROWS, C});
    int red_ok = !smp_step_output_reduce_mean(&eo[0], &lm) && !smp_step_output_reduce_mean(&eo[1], &om) &&
                 !smp_step_output_stack(&eo[1], &stk);
    double worst = 0;
    for (int k = 0; red_ok && k < MB_ROWS * C; k++) {
        double want = 0;
        for (int i = 0; i < 4; i++) want += ref.out[i * MB_ROWS * C + k];
        want /= 4;
        double err = fabs(omean[k] - want) / (fabs(want) > 1e-3 ? fabs(want) : 1e-3);
        if (err > worst) worst = err;
    }
    snprintf(name, sizeof name, "pipeline/StepOutput reduce_mean (loss and outputs) and stack/P=%d", P);
    MPI_CHECK(red_ok && worst <= 1e-6 && fabsf(lmean - mean_ref / 4) <= 1e-6f * fabsf(mean_ref) &&
                  !memcmp(stacked, ref.out, sizeof stacked),
              name, "%s: mean of the outputs off by %g (relative), loss mean %g vs %g",
              red_ok ? "values" : smp_last_error(), worst, lmean, mean_ref / 4);
    g_bodies_training = g_bodies_eval = g_bodies_confused = 0;
    st = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x, t);
    snprintf(name, sizeof name, "pipeline/a body knows a training step (smp_mb_is_training)/P=%d", P);
    MPI_CHECK(st == SMP_OK && g_bodies_eval == 0 && g_bodies_confused == 0 && g_bodies_training == (last ? 4 : 0), name,
              "%s: training step: %d bodies said training, %d evaluating, %d disagreed with their output gradient",
              st ? smp_last_error() : "counts", g_bodies_training, g_bodies_eval, g_bodies_confused);
    /* body NULL: the step's outputs are the model's outputs, on every rank
       (the header promises this for "evaluation that only wants outputs") */
    smp_step_output no = {0};
    memset(all, 0xff, sizeof all);
    st = SMP_EVAL_STEP(model, NULL, NULL, &no, 1, x);
    snprintf(name, sizeof name, "pipeline/evaluation step with body NULL returns the model's outputs/P=%d", P);
    MPI_CHECK(st == SMP_OK && no.microbatches == 4 && !smp_step_output_concat(&no, &cat) &&
                  !memcmp(all, ref.out, sizeof all),
              name, "%s",
              st                     ? smp_last_error()
              : no.microbatches != 4 ? "not one value per microbatch"
                                     : "outputs differ from the reference forward");
    smp_step_output_free(&no);
    smp_step_output two[2] = {{0}, {0}};
    st = SMP_EVAL_STEP(model, NULL, NULL, two, 2, x);
    snprintf(name, sizeof name,
             "pipeline/body NULL with more outputs than the model has is an error naming both counts/P=%d", P);
    MPI_CHECK(st == SMP_ERR_ARG && strstr(smp_last_error(), "body NULL") &&
                  strstr(smp_last_error(), "2 outputs requested") && strstr(smp_last_error(), "it has 1"),
              name, "status %d: %s", st, smp_last_error());
    smp_step_output_free(&outs[0]);
    smp_step_output_free(&eo[0]);
    smp_step_output_free(&eo[1]);
    smp_model_free(model);
    smp_finalize();
}

/* zero_bubble with split linears: a failing forward or W reaches every rank
   (what W ops keep for later is let go), and the next step equals the
   reference bit for bit. */
static void run_zb_error_case(int P, smp_pipeline_kind kind) {
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = 4;
    cfg.pipeline = kind;
    const char *kn = kind_name(kind);
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.seed = 7;
    char name[160], why[4096] = "";
    int ok = smp_init(&cfg) == SMP_OK;
    net n;
    smp_model *model = ok ? build_split(&n, NULL, true) : NULL;
    smp_step_output outs[2] = {{0}};
    smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D), t = smp_tensor_2d(g_t, SMP_F32, B, C);
    if (model) smp_model_trace(model, &x, 1);
    g_fail = P - 1;
    g_fail_mb = 2;
    smp_status st = model ? SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x, t) : SMP_ERR_STATE;
    g_fail = g_fail_mb = -1;
    snprintf(name, sizeof name, "pipeline/%s: a failing forward (microbatch 2, rank %d) reaches every rank/P=%d", kn,
             P - 1, P);
    MPI_CHECK(st != SMP_OK && strstr(smp_last_error(), "injected failure") && strstr(smp_last_error(), "microbatch 2"),
              name, "status %d, message: %s", st, smp_last_error());
    g_fail_w = 0; /* mp rank 0 holds fc0 whatever P is */
    st = model ? SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x, t) : SMP_ERR_STATE;
    g_fail_w = -1;
    snprintf(name, sizeof name, "pipeline/%s: a failing W reaches every rank, naming backward_weight/P=%d", kn, P);
    MPI_CHECK(st != SMP_OK && strstr(smp_last_error(), "injected W failure") &&
                  strstr(smp_last_error(), "backward_weight"),
              name, "status %d, message: %s", st, smp_last_error());
    ref_t ref;
    ref_params(&ref);
    ref_step(&ref, g_x, g_t, 4, true);
    if (model) smp_model_zero_grad(model);
    st = model ? SMP_TRAIN_STEP(model, mse_body, NULL, outs, 2, x, t) : SMP_ERR_STATE;
    ok = st == SMP_OK;
    if (!ok) snprintf(why, sizeof why, "%s", smp_last_error());
    else ok = compare(model, &ref, outs, 4, why, sizeof why);
    snprintf(name, sizeof name, "pipeline/%s: the step after the failures equals the reference/P=%d", kn, P);
    MPI_CHECK(ok, name, "%s", why);
    /* evaluation: forward only (no W ops), outputs equal the reference forward */
    smp_step_output eo[2] = {{0}, {0}};
    ref_step(&ref, g_x, g_t, 4, false);
    st = model ? SMP_EVAL_STEP(model, mse_body, NULL, eo, 2, x, t) : SMP_ERR_STATE;
    float all[B * C];
    smp_tensor cat = smp_tensor_2d(all, SMP_F32, B, C);
    snprintf(name, sizeof name, "pipeline/%s: evaluation step outputs/P=%d", kn, P);
    MPI_CHECK(st == SMP_OK && !smp_step_output_concat(&eo[1], &cat) && !memcmp(all, ref.out, sizeof all), name, "%s",
              st ? smp_last_error() : "outputs differ");
    smp_step_output_free(&eo[0]);
    smp_step_output_free(&eo[1]);
    smp_step_output_free(&outs[0]);
    smp_step_output_free(&outs[1]);
    smp_model_free(model);
    smp_finalize();
}

/* Occurrences of needle in hay. */
static int count_of(const char *hay, const char *needle) {
    int n = 0;
    for (const char *at = strstr(hay, needle); at; at = strstr(at + 1, needle)) n++;
    return n;
}

/* SMP_TIMELINE: one file with every rank's forwards, backwards and (ddp)
   bucket all-reduces, written when the model is freed; zero_bubble adds a
   "weight" event per W op. */
static void run_timeline_case(int P, smp_pipeline_kind kind) {
    int m = 4, steps = 2, me;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    char path[64], name[192], why[2600] = "";
    timeline_to("timeline", path, sizeof path);
    bool zb = split_kind(kind);
    snprintf(name, sizeof name, "pipeline/SMP_TIMELINE has every rank's forwards, backwards, %ssends%s/P=%d%s%s",
             zb ? "weight gradients, " : "", world > P ? " and all-reduces" : "", P, zb ? "/split linears/" : "",
             zb ? kind_name(kind) : "");
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = m;
    cfg.pipeline = kind;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.seed = 7;
    int ok = smp_init(&cfg) == SMP_OK;
    net n;
    smp_model *model = ok ? build_split(&n, NULL, zb) : NULL;
    for (int step = 0; step < steps && model && ok; step++) {
        smp_step_output outs[2] = {{0}};
        smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D), t = smp_tensor_2d(g_t, SMP_F32, B, C);
        ok = SMP_TRAIN_STEP(model, mse_body, NULL, outs, 2, x, t) == SMP_OK;
        smp_step_output_free(&outs[0]);
        smp_step_output_free(&outs[1]);
    }
    /* boundaries between ranks (the V's middle one is not) */
    int stages = model ? smp_model_num_stages(model) : 0, cross = 0;
    for (int s = 1; s < stages; s++) cross += smp_model_stage_rank(model, s) != smp_model_stage_rank(model, s - 1);
    if (!ok) snprintf(why, sizeof why, "step: %s", smp_last_error());
    smp_model_free(model); /* writes the file */
    smp_finalize();
    unsetenv("SMP_TIMELINE");
    if (ok && me == 0) {
        long len = 0;
        char *text = read_text(path, &len);
        ok = text != NULL;
        if (!ok) snprintf(why, sizeof why, "cannot read %s", path);
        int want = (world / P) * stages * m * steps; /* every replica's stages, every microbatch and step */
        int fwd = ok ? count_of(text, "\"cat\":\"forward\"") : 0, bwd = ok ? count_of(text, "\"cat\":\"backward\"") : 0;
        int ar = ok ? count_of(text, "\"cat\":\"allreduce\"") : 0, open = ok ? count_of(text, "{") : 0,
            close = ok ? count_of(text, "}") : 0;
        int wgt = ok ? count_of(text, "\"cat\":\"weight\"") : 0;
        /* each boundary, both ways */
        int sends = ok ? count_of(text, "\"cat\":\"send\"") : 0, min_sends = 2 * (world / P) * cross * m * steps;
        if (ok && (strncmp(text, "{\"displayTimeUnit\"", 18) || open != close || strcmp(text + len - 3, "]}\n"))) {
            snprintf(why, sizeof why, "not one JSON object (%d '{' against %d '}')", open, close);
            ok = 0;
        } else if (ok && (fwd != want || bwd != want || wgt != (zb ? want : 0))) {
            snprintf(why, sizeof why, "%d forward, %d backward and %d weight events, expected %d, %d and %d", fwd, bwd,
                     wgt, want, want, zb ? want : 0);
            ok = 0;
        } else if (ok && (P > 1 ? sends < min_sends : sends != 0)) {
            snprintf(why, sizeof why, "%d send events, expected %s%d", sends, P > 1 ? "at least " : "", min_sends);
            ok = 0;
        } else if (ok && (world > P ? ar < world * steps : ar != 0)) {
            snprintf(why, sizeof why, "%d all-reduce events for %d ranks over %d steps (ddp %s)", ar, world, steps,
                     world > P ? "on" : "off");
            ok = 0;
        }
        for (int r = 0; ok && r < world; r++) {
            char pid[32];
            snprintf(pid, sizeof pid, "\"pid\":%d,\"tid\":0", r);
            if (!strstr(text, pid)) { snprintf(why, sizeof why, "no operation of rank %d", r); ok = 0; }
        }
        free(text);
        remove(path);
    }
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_CHECK(ok, name, "%s", why);
}

/* A skip connection into a later stage of the same rank, read by a split
   module's W: x -> A -> a; a -> B -> b; b -> C -> c; a -> E -> e; c + e.
   A, C and E are split scalar linears (y = w x; W adds sum(dy x) into the
   weight's gradient), B copies. zero_bubble on stages 0,1,0,1 (A | B | C E
   | add) and zero_bubble_v on its V (A | B | C | E add, 2 ranks): E's W
   reads a, which stage 0 made on the same rank, so stage 0 must keep it
   until E's W has run (the schedules run a rank's later stage's W first;
   AddressSanitizer would see the read of freed memory otherwise).
   Gradients against the same sums in plain C, to 1e-5. */
enum { SK_ROWS = 8, SK_W = 3 };
typedef struct { smp_param *w; } sk_lin;
static smp_status sk_fwd(smp_call_ctx *c) {
    float w = *(const float *)smp_param_value(((sk_lin *)smp_module_user(smp_call_module(c)))->w)->data;
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, x->shape);
    for (int64_t i = 0; i < smp_tensor_numel(x); i++) ((float *)y->data)[i] = w * ((const float *)x->data)[i];
    return SMP_OK;
}
static smp_status sk_bwd_input(smp_call_ctx *c) {
    float w = *(const float *)smp_param_value(((sk_lin *)smp_module_user(smp_call_module(c)))->w)->data;
    const smp_tensor *gy = smp_call_grad_output(c, 0);
    smp_tensor *gx = smp_call_grad_input(c, 0);
    for (int64_t i = 0; gx && i < smp_tensor_numel(gy); i++) ((float *)gx->data)[i] = w * ((const float *)gy->data)[i];
    return SMP_OK;
}
static smp_status sk_bwd_weight(smp_call_ctx *c) {
    float *g = (float *)smp_param_grad(((sk_lin *)smp_module_user(smp_call_module(c)))->w)->data;
    const smp_tensor *gy = smp_call_grad_output(c, 0), *x = smp_call_input(c, 0);
    for (int64_t i = 0; i < smp_tensor_numel(gy); i++)
        g[0] += ((const float *)gy->data)[i] * ((const float *)x->data)[i];
    return SMP_OK;
}
static smp_status sk_copy_fwd(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, x->shape);
    memcpy(y->data, x->data, smp_tensor_nbytes(x));
    return SMP_OK;
}
static smp_status sk_copy_bwd(smp_call_ctx *c) {
    smp_tensor *gx = smp_call_grad_input(c, 0);
    if (gx) memcpy(gx->data, smp_call_grad_output(c, 0)->data, smp_tensor_nbytes(gx));
    return SMP_OK;
}
typedef struct { smp_module *A, *B, *C, *E, *add; sk_lin l[3]; } sk_net;
static smp_status sk_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m; (void)nin; (void)nout;
    sk_net *n = (sk_net *)user;
    smp_tensor a, b, c, e, pair[2];
    SMP_TRY(smp_call(n->A, &in[0], 1, &a, 1));
    SMP_TRY(smp_call(n->B, &a, 1, &b, 1));
    SMP_TRY(smp_call(n->C, &b, 1, &c, 1));
    SMP_TRY(smp_call(n->E, &a, 1, &e, 1));
    pair[0] = c;
    pair[1] = e;
    return smp_call(n->add, pair, 2, &out[0], 1);
}
SMP_STEP_BODY(sk_body) {
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    for (int64_t i = 0; g && i < smp_tensor_numel(g); i++) ((float *)g->data)[i] = 1.0f;
    return smp_mb_return_f32(mb, 0, 0.0f);
}
static void run_skip_case(smp_pipeline_kind kind, int m) {
    const int P = 2;
    static const int zb_place[5] = {0, 1, 0, 0, 1}, v_place[5] = {0, 1, 1, 0, 0}; /* A B C E add */
    const int *place = kind == SMP_PIPELINE_ZERO_BUBBLE_V ? v_place : zb_place;
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = m;
    cfg.pipeline = kind;
    cfg.auto_partition = SMP_OFF;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.seed = 3;
    char name[200], why[4096] = "";
    snprintf(
        name, sizeof name,
        "pipeline/%s: a split module's W reads an earlier stage's output on its own rank (skip connection)/P=2/m=%d",
        kind_name(kind), m);
    if (smp_init(&cfg)) { MPI_CHECK(0, name, "smp_init: %s", smp_last_error()); return; }
    static sk_net n;
    memset(&n, 0, sizeof n);
    smp_module *root = smp_module_new(NULL, "", NULL);
    smp_module **mods[5] = {&n.A, &n.B, &n.C, &n.E, &n.add};
    static const char *names[5] = {"A", "B", "C", "E", "add"};
    for (int k = 0; k < 5; k++) {
        smp_partition_push(place[k]);
        int l = k == 0 ? 0 : k == 2 ? 1 : k == 3 ? 2 : -1;
        if (k == 4) *mods[k] = smp_module_new_add(root, names[k]);
        else {
            smp_module_desc d = {l >= 0 ? sk_fwd : sk_copy_fwd, l >= 0 ? NULL : sk_copy_bwd, l >= 0 ? &n.l[l] : NULL};
            *mods[k] = smp_module_new(root, names[k], &d);
        }
        if (l >= 0) {
            smp_module_set_backward_split(*mods[k], sk_bwd_input, sk_bwd_weight);
            static float bound = 0.9f; /* read when the parameter is made, after partitioning */
            n.l[l].w = smp_param_new(*mods[k], "w", SMP_F32, 1, (int64_t[]){1}, smp_init_uniform, &bound);
        }
        smp_partition_pop();
    }
    smp_model *model = NULL;
    smp_model_desc md = {sk_forward, 1, 1, &n, false};
    int ok = smp_model_new(root, &md, &model) == SMP_OK;
    float x[SK_ROWS * SK_W];
    for (int i = 0; i < SK_ROWS * SK_W; i++) x[i] = 0.25f * (float)(i % 7) - 0.5f;
    smp_step_output o = {0};
    int dp = world / P, stages = 0;
    if (ok) {
        smp_model_zero_grad(model);
        smp_tensor xt = smp_tensor_2d(x, SMP_F32, SK_ROWS, SK_W);
        ok = SMP_TRAIN_STEP(model, sk_body, NULL, &o, 1, xt) == SMP_OK;
        stages = smp_model_num_stages(model);
    }
    if (!ok) snprintf(why, sizeof why, "%s", smp_last_error());
    else if (stages != 4) { snprintf(why, sizeof why, "%d stages, expected 4", stages); ok = 0; }
    /* the reference: every replica runs the same batch, so the average over replicas is one replica's */
    float w[3];
    for (int l = 0; l < 3 && ok; l++) {
        char nm[8];
        snprintf(nm, sizeof nm, "%s.w", l == 0 ? "A" : l == 1 ? "C" : "E");
        smp_tensor t = smp_tensor_1d(&w[l], SMP_F32, 1);
        smp_init_uniform(&t, smp_param_seed(nm), (float[]){0.9f});
    }
    double want[3] = {0, 0, 0};
    int rows = SK_ROWS / m;
    for (int i = 0; i < m && ok; i++)
        for (int r = 0; r < rows * SK_W; r++) {
            double xv = x[i * rows * SK_W + r], a = w[0] * xv, gy = 1.0 / m;
            want[1] += gy * a;                        /* C: dy x, its input b = a */
            want[2] += gy * a;                        /* E */
            want[0] += (gy * w[2] + gy * w[1]) * xv;  /* A: da = E's + C's through B */
        }
    for (int l = 0; l < 3 && ok; l++) {
        smp_module *mod = l == 0 ? n.A : l == 1 ? n.C : n.E;
        if (!smp_module_is_local(mod)) continue;
        float got = *(const float *)smp_param_grad(n.l[l].w)->data;
        if (fabs(got - want[l]) > 1e-5 * (fabs(want[l]) + 1)) {
            snprintf(why, sizeof why, "gradient of %s.w %.9g, reference %.9g (dp %d)",
                     l == 0   ? "A"
                     : l == 1 ? "C"
                              : "E",
                     got, want[l], dp);
            ok = 0;
        }
    }
    smp_step_output_free(&o);
    smp_model_free(model);
    smp_finalize();
    MPI_CHECK(ok, name, "%s", why);
}

/* zero_bubble_v placements that are not a V: errors on every rank that name
   the fix. 2 partitions: manual 0,1,0,1 and a middle partition with one
   top-level call; 4 partitions: too few calls for 8 stages, and an
   interleaving factor other than 2. */
static void vee_error(int P, const int *placement, int vstages, const char *phrase, const char *label) {
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.microbatches = 2;
    cfg.pipeline = SMP_PIPELINE_ZERO_BUBBLE_V;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.virtual_stages = vstages;
    if (placement) cfg.auto_partition = SMP_OFF;
    char name[160];
    snprintf(name, sizeof name, "pipeline/zero_bubble_v: %s is an error naming the fix/P=%d", label, P);
    smp_status st = smp_init(&cfg);
    if (st) {
        MPI_CHECK(strstr(smp_last_error(), phrase) != NULL, name, "smp_init: %s", smp_last_error());
        return;
    }
    net n;
    smp_model *model = build_split(&n, placement, true);
    smp_step_output outs[1] = {{0}};
    smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D), t = smp_tensor_2d(g_t, SMP_F32, B, C);
    st = model ? SMP_TRAIN_STEP(model, mse_body, NULL, outs, 1, x, t) : SMP_ERR_STATE;
    MPI_CHECK(st != SMP_OK && strstr(smp_last_error(), phrase), name, "status %d: %s", (int)st, smp_last_error());
    smp_step_output_free(&outs[0]);
    smp_model_free(model);
    smp_finalize();
}
static void run_vee_errors(void) {
    static const int alt[7] = {0, 0, 1, 1, 0, 0, 1}, one_call[7] = {0, 0, 0, 1, 0, 0, 0};
    vee_error(1, NULL, 3, "leave virtual_stages at 1 or 2", "virtual_stages 3");
    if (world % 2) return;
    vee_error(2, alt, 1, "partitions 0, 1, 0, 1. Place the modules so with SMP_PARTITION, or turn auto_partition on",
              "manual 0,1,0,1");
    vee_error(2, one_call, 1, "place at least two top-level calls on partition 1", "one call on the middle partition");
    if (world % 4) return;
    vee_error(4, NULL, 1,
              "too few for pipeline \"zero_bubble_v\", which cuts it in 2 stages per partition (8 for 4 partitions)",
              "7 calls on 4 partitions");
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
            run_case(P, ms[k], SMP_PIPELINE_ZERO_BUBBLE, NULL, 1, "auto");
            run_case_split(P, ms[k], SMP_PIPELINE_ZERO_BUBBLE, NULL, 1, true, "auto");
        }
        /* the split linears under schedules without W ops: B and W back to back */
        run_case_split(P, 4, SMP_PIPELINE_INTERLEAVED, NULL, 1, true, "auto");
        run_case_split(P, 3, SMP_PIPELINE_SIMPLE, NULL, 1, true, "auto");
    }
    /* zero_bubble_v: 2P stages in a V (7 calls: P = 1 and 2; P = 4 wants 8 stages) */
    for (int P = 1; P <= world && P <= 2; P *= 2) {
        if (world % P) continue;
        for (int k = 0; k < 5; k++) {
            run_case(P, ms[k], SMP_PIPELINE_ZERO_BUBBLE_V, NULL, 1, "auto");
            run_case_split(P, ms[k], SMP_PIPELINE_ZERO_BUBBLE_V, NULL, 1, true, "auto");
        }
        static const int vee1[7] = {0, 0, 0, 0, 0, 0, 0}, vee2[7] = {0, 0, 1, 1, 1, 0, 0};
        run_case_split(P, 4, SMP_PIPELINE_ZERO_BUBBLE_V, P == 1 ? vee1 : vee2, 1, true,
                       P == 1 ? "manual, cut in two" : "manual V 0,1,0");
        run_case_split(P, 3, SMP_PIPELINE_ZERO_BUBBLE_V, NULL, 2, true, "auto, virtual_stages 2");
    }
    /* active_microbatches 1..m: the same bits, under the cap, every kind */
    for (int P = 1; P <= world && P <= 2; P *= 2) {
        if (world % P) continue;
        for (g_active = 1; g_active <= 4; g_active++) {
            run_case(P, 4, SMP_PIPELINE_SIMPLE, NULL, 1, "auto");
            run_case(P, 4, SMP_PIPELINE_INTERLEAVED, NULL, 1, "auto");
            run_case_split(P, 4, SMP_PIPELINE_ZERO_BUBBLE, NULL, 1, true, "auto");
            run_case_split(P, 4, SMP_PIPELINE_ZERO_BUBBLE_V, NULL, 1, true, "auto");
            if (P == 2) {
                static const int manual[7] = {0, 0, 1, 1, 0, 0, 1}; /* stages on ranks 0,1,0,1 */
                run_case(2, 4, SMP_PIPELINE_SIMPLE, manual, 1, "manual 0,1,0,1");
                run_case(2, 4, SMP_PIPELINE_INTERLEAVED, NULL, 2, "auto, 2 virtual stages");
                run_case_split(2, 4, SMP_PIPELINE_ZERO_BUBBLE, manual, 1, true, "manual 0,1,0,1");
            }
        }
        g_active = 0;
    }
    run_vee_errors();
    for (int k = 0; k < 3 && world % 2 == 0; k++) {
        static const int skm[3] = {2, 4, 8};
        run_skip_case(SMP_PIPELINE_ZERO_BUBBLE, skm[k]);
        run_skip_case(SMP_PIPELINE_ZERO_BUBBLE_V, skm[k]);
    }
    if (world % 2 == 0) {
        static const int manual[7] = {0, 0, 1, 1, 0, 0, 1}; /* stages on ranks 0,1,0,1 */
        for (int k = 0; k < 5; k++) {
            run_case(2, ms[k], SMP_PIPELINE_INTERLEAVED, manual, 1, "manual 0,1,0,1");
            run_case(2, ms[k], SMP_PIPELINE_SIMPLE, manual, 1, "manual 0,1,0,1");
            run_case(2, ms[k], SMP_PIPELINE_INTERLEAVED, NULL, 2, "auto, 2 virtual stages");
            run_case(2, ms[k], SMP_PIPELINE_ZERO_BUBBLE, manual, 1, "manual 0,1,0,1");
            run_case_split(2, ms[k], SMP_PIPELINE_ZERO_BUBBLE, manual, 1, true, "manual 0,1,0,1");
            run_case_split(2, ms[k], SMP_PIPELINE_ZERO_BUBBLE, NULL, 2, true, "auto, 2 virtual stages");
        }
    }
    for (int P = 1; P <= world && P <= 4; P *= 2)
        if (world % P == 0) run_error_case(P);
    for (int P = 1; P <= world && P <= 4; P *= 2)
        if (world % P == 0) run_zb_error_case(P, SMP_PIPELINE_ZERO_BUBBLE);
    for (int P = 1; P <= world && P <= 2; P *= 2)
        if (world % P == 0) run_zb_error_case(P, SMP_PIPELINE_ZERO_BUBBLE_V);
    for (int P = 1; P <= world && P <= 4; P *= 2)
        if (world % P == 0) {
            run_timeline_case(P, SMP_PIPELINE_INTERLEAVED);
            run_timeline_case(P, SMP_PIPELINE_ZERO_BUBBLE);
            if (P <= 2) run_timeline_case(P, SMP_PIPELINE_ZERO_BUBBLE_V);
        }
    (void)g_losses;
    int rc = test_exit_code();
    MPI_Finalize();
    return rc;
}
