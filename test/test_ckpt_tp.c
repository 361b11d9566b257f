/* test_ckpt_tp.c - checkpoints of a tensor-parallel model (smp_checkpoint.h
   at tensor_parallel_degree > 1): test_tp.c's Megatron MLP (tp_mlp.h) with
   SGD-with-momentum state shaped as each parameter's local slice, and a
   step count for the optimizer as a whole.

   A run at (pp, tp) over the whole world trains K steps, saves partially
   (a file per TP slice with smp.shard.<name> entries) and fully (full
   tensors under the tp = 1 names), then trains M more steps: the run that
   never stopped. Checks, at every (pp', tp') the world allows after it:
     - each checkpoint loads: every rank's slice of every parameter and of
       its momentum is bitwise the slice of the full tensors the saving run
       held (gathered by hand over its MP_GROUP, not through smp);
     - the loaded run trains M steps bitwise equal to the same run at
       (pp', tp') given those full tensors by hand, and, at tp' = tp (any
       pp'), bitwise equal to the run that never stopped;
     - Python's safetensors opens the full checkpoint: full shapes, values
       bitwise (test_checkpoint_python.py with the tp argument).
   Saves at 2 ranks: pp1 x tp2 (resumed at tp1, pp2 x tp1, tp2) and pp2 x
   tp1 (resumed at tp2); at 4: pp2 x tp2, resumed at pp1 x tp1, pp1 x tp4,
   pp1 x tp2 and pp2 x tp2. Run: mpirun -n 1|2|4 build/gcc/test_ckpt_tp */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_checkpoint.h"
#include "smp_pipeline.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tp_mlp.h"

#define K 2
#define M 2
#define NT (BLOCKS * 4)

static int world, me;
static char dir[256];
static float *g_w[NT], *g_m[NT], *g_never[NT]; /* what the saving run held at its save, whole; its end */

typedef struct {
    net n;
    float *mom[NT];
    int64_t step;
    smp_optimizer *reg;
} tp_run_state;

/* Every parameter (or its momentum) whole into out, on every rank of the replica. */
static void gather_full(tp_run_state *r, bool momentum, float **out) {
    float *local[NT];
    for (int k = 0; k < NT; k++) local[k] = momentum ? r->mom[k] : (float *)smp_param_value(r->n.params[k])->data;
    full_of(&r->n, local, out);
}

static void full_alloc(float **a) {
    for (int k = 0; k < NT; k++) a[k] = (float *)calloc((size_t)numel_of(k, F), sizeof(float));
}
static void full_free(float **a) {
    for (int k = 0; k < NT; k++) free(a[k]);
}
static bool full_same(float **a, float **b) {
    for (int k = 0; k < NT; k++)
        if (memcmp(a[k], b[k], sizeof(float) * (size_t)numel_of(k, F))) return false;
    return true;
}

/* A run inside comm at (pp, tp): loads `from` (partial or full), or with `inject` takes g_w/g_m by hand, and then
   holds them (checked); trains `steps` steps from step `first`; with `to`, saves there partially and to "<to>_full"
   fully (g_w/g_m become what it saved) and trains `after` more steps. Leaves every parameter whole in out. */
static int tp_run(MPI_Comm comm, int pp, int tp, const char *from, int partial, bool inject, int first, int steps,
                  const char *to, int after, float **out, char *why, size_t cap) {
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.comm = comm;
    cfg.partitions = pp;
    cfg.tensor_parallel_degree = tp;
    cfg.microbatches = MB;
    cfg.auto_partition = SMP_OFF;
    cfg.deterministic_reduction = SMP_ON;
    if (smp_init(&cfg)) {
        snprintf(why, cap, "smp_init: %s", smp_last_error());
        return 0;
    }
    tp_run_state r;
    memset(&r, 0, sizeof r);
    build(&r.n, pp > 1, false, F);
    float x[BATCH * H], t[BATCH * H];
    batch_of(0, x, t);
    smp_tensor sample = smp_tensor_2d(x, SMP_F32, BATCH / MB, H);
    int ok = smp_model_new(r.n.root, &(smp_model_desc){.forward = net_forward, .ninputs = 1, .user = &r.n},
                           &r.n.model) == SMP_OK &&
             smp_model_trace(r.n.model, &sample, 1) == SMP_OK && smp_optimizer_new(r.n.model, &r.reg) == SMP_OK;
    for (int k = 0; ok && k < NT; k++) {
        smp_param *p = r.n.params[k];
        if (!smp_module_is_local(smp_param_module(p))) continue;
        const smp_tensor *v = smp_param_value(p);
        r.mom[k] = (float *)calloc((size_t)smp_tensor_numel(v) + 1, sizeof(float));
        smp_tensor s = smp_tensor_make(r.mom[k], SMP_F32, v->ndim, v->shape);
        ok = smp_optimizer_state_add(r.reg, smp_param_name(p), "momentum", &s) == SMP_OK;
    }
    smp_tensor step = smp_tensor_make(&r.step, SMP_I64, 0, NULL);
    ok = ok && smp_optimizer_state_add(r.reg, NULL, "step", &step) == SMP_OK;
    if (!ok) snprintf(why, cap, "set-up: %s", smp_last_error());
    if (ok && from) {
        smp_load_desc d;
        memset(&d, 0, sizeof d);
        d.partial = partial ? SMP_ON : SMP_OFF;
        d.optimizer = r.reg;
        if (smp_load(r.n.model, from, &d)) {
            ok = 0;
            snprintf(why, cap, "load: %s", smp_last_error());
        }
    }
    float *w[NT], *m[NT];
    full_alloc(w);
    full_alloc(m);
    for (int k = 0; ok && inject && k < NT; k++) {
        smp_param *p = r.n.params[k];
        if (!smp_module_is_local(smp_param_module(p))) continue;
        slice_io(p, (float *)smp_param_value(p)->data, g_w[k], false);
        slice_io(p, r.mom[k], g_m[k], false);
        r.step = K;
    }
    if (ok && (from || inject)) {
        gather_full(&r, false, w);
        gather_full(&r, true, m);
        if (!full_same(w, g_w) || !full_same(m, g_m) || r.step != K) {
            ok = 0;
            snprintf(why, cap,
                     "after the load the parameters%s, their momentum%s or the step count (%lld) differ from the saved "
                     "state",
                     full_same(w, g_w) ? " (same)" : "", full_same(m, g_m) ? " (same)" : "", (long long)r.step);
        }
    }
    for (int s = 0; ok && s < steps + after; s++) {
        batch_of(first + s, x, t);
        smp_tensor xt = smp_tensor_2d(x, SMP_F32, BATCH, H), tt = smp_tensor_2d(t, SMP_F32, BATCH, H);
        smp_step_output loss;
        memset(&loss, 0, sizeof loss);
        smp_model_zero_grad(r.n.model);
        if (SMP_TRAIN_STEP(r.n.model, mse_body, NULL, &loss, 1, xt, tt)) {
            ok = 0;
            snprintf(why, cap, "step: %s", smp_last_error());
        }
        smp_step_output_free(&loss);
        smp_param *p;
        for (int k = 0; ok && k < NT; k++) {
            if (!smp_module_is_local(smp_param_module(p = r.n.params[k]))) continue;
            float *v = (float *)smp_param_value(p)->data, *g = (float *)smp_param_grad(p)->data;
            for (int64_t e = 0; e < smp_tensor_numel(smp_param_value(p)); e++) {
                r.mom[k][e] = 0.9f * r.mom[k][e] + g[e];
                v[e] -= LR * r.mom[k][e];
            }
        }
        r.step++;
        if (ok && to && s == steps - 1) {
            char full[300];
            smp_save_desc d;
            memset(&d, 0, sizeof d);
            d.optimizer = r.reg;
            d.partial = SMP_ON;
            if (smp_save(r.n.model, to, &d)) {
                ok = 0;
                snprintf(why, cap, "save: %s", smp_last_error());
            }
            snprintf(full, sizeof full, "%s_full", to);
            d.partial = SMP_OFF;
            if (ok && smp_save(r.n.model, full, &d)) {
                ok = 0;
                snprintf(why, cap, "full save: %s", smp_last_error());
            }
            gather_full(&r, false, g_w);
            gather_full(&r, true, g_m);
        }
    }
    if (ok) gather_full(&r, false, out);
    full_free(w);
    full_free(m);
    for (int k = 0; k < NT; k++) free(r.mom[k]);
    smp_optimizer_free(r.reg);
    smp_model_free(r.n.model);
    smp_finalize();
    return ok;
}

/* The first `size` ranks of the world, or MPI_COMM_NULL on the others. */
static MPI_Comm first_ranks(int size) {
    MPI_Comm c;
    MPI_Comm_split(MPI_COMM_WORLD, me < size ? 0 : MPI_UNDEFINED, me, &c);
    return c;
}

static void share_saved(void) {
    for (int k = 0; k < NT; k++) {
        MPI_Bcast(g_w[k], (int)numel_of(k, F), MPI_FLOAT, 0, MPI_COMM_WORLD);
        MPI_Bcast(g_m[k], (int)numel_of(k, F), MPI_FLOAT, 0, MPI_COMM_WORLD);
        MPI_Bcast(g_never[k], (int)numel_of(k, F), MPI_FLOAT, 0, MPI_COMM_WORLD);
    }
}

/* Loads the checkpoint saved at tp `saved_tp` at (pp, tp) on the first pp x tp ranks, partial and full. */
static void resume(const char *path, int saved_tp, int pp, int tp, const char *label) {
    if (pp * tp > world) return;
    MPI_Comm c = first_ranks(pp * tp);
    for (int partial = 1; partial >= 0; partial--) {
        char name[300], why[2200] = "", why2[2200] = "", full[320];
        float *a[NT], *b[NT];
        full_alloc(a);
        full_alloc(b);
        snprintf(full, sizeof full, "%s_full", path);
        int ok = 1;
        if (c != MPI_COMM_NULL) {
            ok = tp_run(c, pp, tp, NULL, 0, true, K, M, NULL, 0, b, why2, sizeof why2) &&
                 tp_run(c, pp, tp, partial ? path : full, partial, false, K, M, NULL, 0, a, why, sizeof why);
            if (!why[0]) snprintf(why, sizeof why, "%s", why2);
            if (ok && !full_same(a, b)) {
                ok = 0;
                snprintf(why, sizeof why, "the resumed run differs from the one given the state by hand");
            }
            if (ok && tp == saved_tp && !full_same(a, g_never)) {
                ok = 0;
                snprintf(why, sizeof why, "the resumed run differs from the one that never stopped");
            }
        }
        snprintf(name, sizeof name,
                 "ckpt_tp/%s, %s, resumed at pp%d x tp%d: holds the saved slices, trains on bitwise%s", label,
                 partial ? "partial" : "full", pp, tp, tp == saved_tp ? " (= the run that never stopped)" : "");
        MPI_CHECK(ok, name, "%s", why);
        full_free(a);
        full_free(b);
    }
    if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
}

/* Saves at (pp, tp) over the whole world after K steps; the run goes on M steps (the one that never stopped). */
static int save_at(int pp, int tp, const char *path) {
    char why[2200] = "", name[200];
    int ok = tp_run(MPI_COMM_WORLD, pp, tp, NULL, 0, false, 0, K, path, M, g_never, why, sizeof why);
    snprintf(name, sizeof name, "ckpt_tp/save at pp%d x tp%d, partial and full", pp, tp);
    MPI_CHECK(ok, name, "%s", why);
    share_saved();
    return ok;
}

/* Python's safetensors opens the full checkpoint saved at tp: every tensor whole, bitwise the saved state. */
static void python_check(const char *path, int pp, int tp) {
    char edir[300], full[320], cmd[1200], mpath[400];
    snprintf(edir, sizeof edir, "%s_expected", path);
    snprintf(full, sizeof full, "%s_full", path);
    if (me == 0) {
        mkdir(edir, 0700);
        snprintf(mpath, sizeof mpath, "%s/manifest_0.txt", edir);
        FILE *man = fopen(mpath, "w");
        for (int k = 0; man && k < NT * 2 + 1; k++) {
            char nm[200], bin[600];
            int64_t shape[SMP_MAX_DIMS] = {0}, step = K;
            int nd = 0;
            if (k < NT * 2) {
                static const char *const names[4] = {"fc.weight", "fc.bias", "proj.weight", "bias.bias"};
                snprintf(nm, sizeof nm, "%sb%d_%s", k >= NT ? "optimizer." : "", k % NT / 4, names[k % 4]);
                if (k >= NT) snprintf(nm + strlen(nm), sizeof nm - strlen(nm), ".momentum");
                nd = k % 4 == 0 || k % 4 == 2 ? 2 : 1;
                shape[0] = k % 4 == 0 ? F : k % 4 == 1 ? F : H;
                shape[1] = k % 4 == 0 ? H : F;
            } else {
                snprintf(nm, sizeof nm, "optimizer.step");
            }
            snprintf(bin, sizeof bin, "%s/%s.bin", edir, nm);
            FILE *f = fopen(bin, "wb");
            if (f) {
                if (k < NT * 2)
                    fwrite(k < NT ? g_w[k] : g_m[k - NT], sizeof(float), (size_t)numel_of(k % NT, F), f);
                else
                    fwrite(&step, sizeof step, 1, f);
                fclose(f);
            }
            fprintf(man, "%s %s %d", nm, k < NT * 2 ? "F32" : "I64", nd);
            for (int d = 0; d < nd; d++) fprintf(man, " %lld", (long long)shape[d]);
            fprintf(man, "\n");
        }
        if (man) fclose(man);
        const char *slash = strrchr(__FILE__, '/');
        snprintf(cmd, sizeof cmd, "python3 '%.*stest_checkpoint_python.py' '%s' '%s' %d %d",
                 slash ? (int)(slash - __FILE__ + 1) : 0, __FILE__, full, edir, pp, tp);
        int rc = system(cmd);
        CHECK(rc == 0, "ckpt_tp/python: test_checkpoint_python.py ran on the full checkpoint saved at tp > 1",
              "exit status %d (%s)", rc, cmd);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    full_alloc(g_w);
    full_alloc(g_m);
    full_alloc(g_never);
    if (me == 0) {
        snprintf(dir, sizeof dir, "%s/smp_ckpt_tp.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
        if (!mkdtemp(dir)) dir[0] = 0;
    }
    MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
    char a[300], b[300];
    snprintf(a, sizeof a, "%s/a", dir);
    snprintf(b, sizeof b, "%s/b", dir);
    if (world == 2) {
        if (save_at(1, 2, a)) {
            python_check(a, 1, 2);
            resume(a, 2, 1, 1, "saved at pp1 x tp2");
            resume(a, 2, 2, 1, "saved at pp1 x tp2");
            resume(a, 2, 1, 2, "saved at pp1 x tp2");
        }
        if (save_at(2, 1, b)) resume(b, 1, 1, 2, "saved at pp2 x tp1");
    } else if (world == 4) {
        if (save_at(2, 2, a)) {
            python_check(a, 2, 2);
            resume(a, 2, 1, 1, "saved at pp2 x tp2");
            resume(a, 2, 1, 4, "saved at pp2 x tp2");
            resume(a, 2, 1, 2, "saved at pp2 x tp2");
            resume(a, 2, 2, 2, "saved at pp2 x tp2");
        }
    } else if (me == 0) {
        test_skip("ckpt_tp", "needs 2 or 4 ranks");
    }
    if (me == 0 && dir[0]) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) printf("note: could not remove %s\n", dir);
    }
    full_free(g_w);
    full_free(g_m);
    full_free(g_never);
    int failed = test_exit_code();
    MPI_Finalize();
    return failed;
}
