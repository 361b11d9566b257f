/* test_checkpoint.c - model checkpoints: smp_save / smp_load over MPI.

   The model is test_pipeline.c's (4 linears, 2 relus, a skip connection),
   with buffers of every width added (f64, i64, f16, u8, bool) so the file
   order and alignment matter, and optimizer state registered for every
   parameter (an f32 moment and an i64 scalar step) plus two tensors of the
   optimizer as a whole. Every tensor's value is a function of its name and
   a version number, so any rank of any partitioning knows what any tensor
   should hold.

   Checks, for every partition count P in {1, 2, 4} the world allows (the
   rest of the world as data-parallel replicas):
   - round trips, partial and full: save, perturb, load, compare bitwise;
     the metadata callback; smp_model_state_dict against the values;
   - resharding: save with P (partial and full), finalize, init with every Q,
     load, compare every tensor by name;
   - sharded optimizer state (shard_optimizer_state, net7 with momentum for
     each replica's owned range): saved partially and fully at 2 replicas,
     resumed at 1, 2 and 4 replicas, sharded or not, and at P=2; each load
     holds exactly the saved state and trains on bitwise like the same run
     given it by hand; a chain dp 2 -> dp 1 (saves) -> dp 4 sharded; a save
     whose replicas leave a gap, and a checkpoint missing one replica's
     piece, are errors on every rank;
   - Python's safetensors reads the full checkpoint and equals the model
     (test_checkpoint_python.py, against raw dumps this test writes);
   - partial saves commit through a manifest: a save leaves its manifest
     and P files only; consecutive saves, also at a smaller P, leave only
     the last generation's;
   - a save killed at every phase (separate 2-rank mpiruns; see "a killed
     save"): a full save mid-file, and a partial save at each phase on each
     rank, also over a checkpoint saved before manifests; each then loads
     as exactly the old or the new checkpoint, bitwise, and the next save
     clears what the killed one left;
   - corruption: a flipped byte (full and partial), a truncated file, a wrong
     dtype, a wrong shape, a missing and an unexpected tensor, missing
     optimizer state, files of two saves mixed (with and without a
     manifest), a damaged manifest, a committed file gone, shortened or
     edited: each a clear error naming the tensor or file, on every rank,
     with every tensor of the model unchanged;
   - a save failing on one rank, before its file is written or after every
     file is renamed, fails on all and leaves the previous files intact with
     no new or tmp files; a load without an optimizer skips its state;
     misuse (unpartitioned model, reserved metadata keys, wrong partial flag,
     bad optimizer registrations) is a clear error.

   Build and run from the repository root:
     mpicc -std=c11 -Wall -Wextra -Werror -g -I. -Itest test/test_checkpoint.c -o /tmp/tc -lm
     mpirun -n 4 /tmp/tc
*/
#define _POSIX_C_SOURCE 200809L /* mkdtemp, setenv, truncate for the test itself */
#define SMP_TESTING /* SMP_CKPT_FAULT, the killed-save tests */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_checkpoint.h"
#include "smp_pipeline.h"
#include "test.h"
#include "net7.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---------------------------------------------------------------- the model (test_pipeline.c's, with buffers) */
static smp_model *build_ckpt(net *n) {
    net_modules(n, NULL, &net_host_fns);
    /* buffers of every width: the file puts 8-byte dtypes first */
    int64_t s6[1] = {6}, s3[1] = {3}, s2[1] = {2};
    smp_buffer_new(n->lin[0], "num_batches", SMP_I64, 0, NULL, NULL, NULL);
    smp_buffer_new(n->lin[2], "running_mean", SMP_F64, 1, s6, NULL, NULL);
    smp_buffer_new(n->lin[3], "scale", SMP_F16, 1, s3, NULL, NULL);
    smp_buffer_new(n->lin[3], "mask", SMP_U8, 1, s3, NULL, NULL);
    smp_buffer_new(n->lin[1], "flags", SMP_BOOL, 1, s2, NULL, NULL);
    return net_model(n, false);
}

/* ---------------------------------------------------------------- values */
static uint64_t mix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* The bytes tensor `name` holds at `version` (0/1 for bool). */
static void fill(void *p, size_t n, smp_dtype dt, const char *name, int version) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *c = (const unsigned char *)name; *c; c++) h = (h ^ *c) * 0x100000001b3ull;
    h ^= (uint64_t)version * 0x51ed27ull;
    for (size_t k = 0; k < n; k++) {
        uint8_t b = (uint8_t)mix(&h);
        ((uint8_t *)p)[k] = dt == SMP_BOOL ? (b & 1) : b;
    }
}

/* The test's optimizer: per parameter an f32 moment shaped like it and an
   i64 scalar step; for the whole optimizer an f64 lr and an i64[1] count. */
typedef struct { int n; char full[40][96]; smp_tensor t[40]; smp_optimizer *reg; } opt_store;

static void opt_make(opt_store *o, smp_model *m) {
    memset(o, 0, sizeof *o);
    smp_optimizer_new(m, &o->reg);
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(m, i, false)); i++) {
        const smp_tensor *v = smp_param_value(p);
        o->t[o->n] = smp_tensor_make(malloc(smp_tensor_nbytes(v)), SMP_F32, v->ndim, v->shape);
        smp_optimizer_state_add(o->reg, smp_param_name(p), "exp_avg", &o->t[o->n]);
        snprintf(o->full[o->n++], 96, "optimizer.%s.exp_avg", smp_param_name(p));
        o->t[o->n] = smp_tensor_make(malloc(8), SMP_I64, 0, NULL);
        smp_optimizer_state_add(o->reg, smp_param_name(p), "step", &o->t[o->n]);
        snprintf(o->full[o->n++], 96, "optimizer.%s.step", smp_param_name(p));
    }
    int64_t one = 1;
    o->t[o->n] = smp_tensor_make(malloc(8), SMP_F64, 0, NULL);
    smp_optimizer_state_add(o->reg, NULL, "lr", &o->t[o->n]);
    snprintf(o->full[o->n++], 96, "optimizer.lr");
    o->t[o->n] = smp_tensor_make(malloc(8), SMP_I64, 1, &one);
    smp_optimizer_state_add(o->reg, NULL, "count", &o->t[o->n]);
    snprintf(o->full[o->n++], 96, "optimizer.count");
}
static void opt_free(opt_store *o) {
    for (int i = 0; i < o->n; i++) free(o->t[i].data);
    smp_optimizer_free(o->reg);
}

/* Sets every local tensor (parameters, buffers, optimizer state) to `version`. */
static void set_all(smp_model *m, opt_store *o, int version) {
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(m, i, true)); i++) {
        smp_tensor *v = smp_param_value(p);
        fill(v->data, smp_tensor_nbytes(v), v->dtype, smp_param_name(p), version);
    }
    for (int i = 0; o && i < o->n; i++)
        fill(o->t[i].data, smp_tensor_nbytes(&o->t[i]), o->t[i].dtype, o->full[i], version);
}

/* Whether every local tensor holds `version`; names the first that does not. */
static int check_all(smp_model *m, opt_store *o, int version, char *why, size_t cap) {
    smp_param *p;
    static uint8_t want[4096];
    for (int i = 0; (p = smp_model_local_param(m, i, true)); i++) {
        smp_tensor *v = smp_param_value(p);
        fill(want, smp_tensor_nbytes(v), v->dtype, smp_param_name(p), version);
        if (memcmp(want, v->data, smp_tensor_nbytes(v))) {
            snprintf(why, cap, "'%s' differs from version %d", smp_param_name(p), version);
            return 0;
        }
    }
    for (int i = 0; o && i < o->n; i++) {
        fill(want, smp_tensor_nbytes(&o->t[i]), o->t[i].dtype, o->full[i], version);
        if (memcmp(want, o->t[i].data, smp_tensor_nbytes(&o->t[i]))) {
            snprintf(why, cap, "'%s' differs from version %d", o->full[i], version);
            return 0;
        }
    }
    return 1;
}

/* A copy of every local tensor's bytes, to prove a failed load changed nothing. */
typedef struct { uint8_t *bytes; size_t n; } snapshot;
static snapshot snap_take(smp_model *m, opt_store *o) {
    snapshot s = {malloc(1 << 16), 0};
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(m, i, true)); i++) {
        size_t k = smp_tensor_nbytes(smp_param_value(p));
        memcpy(s.bytes + s.n, smp_param_value(p)->data, k);
        s.n += k;
    }
    for (int i = 0; o && i < o->n; i++) {
        size_t k = smp_tensor_nbytes(&o->t[i]);
        memcpy(s.bytes + s.n, o->t[i].data, k);
        s.n += k;
    }
    return s;
}
static int snap_same(snapshot *a, smp_model *m, opt_store *o) {
    snapshot b = snap_take(m, o);
    int same = a->n == b.n && !memcmp(a->bytes, b.bytes, a->n);
    free(b.bytes);
    free(a->bytes);
    a->bytes = NULL;
    return same;
}

/* ---------------------------------------------------------------- harness */
static int world, me;
static char dir[256];
static float g_x[B * D];

static int allowed(int P) { return P <= world && world % P == 0; }

static smp_model *start(int P, net *n) {
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.seed = 11;
    if (smp_init(&cfg) != SMP_OK) return NULL;
    smp_model *m = build_ckpt(n);
    smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D);
    if (!m || smp_model_trace(m, &x, 1) != SMP_OK) return NULL;
    return m;
}
static void stop(smp_model *m) {
    smp_model_free(m);
    smp_finalize();
}

static void path_in(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", dir, name); }

typedef struct { char epoch[32], step[32], note[64]; int count; } meta_seen;
static void on_meta(const char *k, const char *v, void *user) {
    meta_seen *s = (meta_seen *)user;
    s->count++;
    if (!strcmp(k, "epoch")) snprintf(s->epoch, sizeof s->epoch, "%s", v);
    if (!strcmp(k, "step")) snprintf(s->step, sizeof s->step, "%s", v);
    if (!strcmp(k, "note")) snprintf(s->note, sizeof s->note, "%s", v);
}
static const char *mkeys[] = {"epoch", "step", "note"}, *mvals[] = {"3", "1200", "gr\u00f6\u00dfe \"q\""};

static smp_status save(smp_model *m, opt_store *o, const char *path, int partial, size_t chunk) {
    smp_save_desc d = {0};
    d.partial = partial ? SMP_ON : SMP_OFF;
    d.optimizer = o ? o->reg : NULL;
    d.meta_keys = mkeys;
    d.meta_values = mvals;
    d.nmeta = 3;
    d.chunk_bytes = chunk;
    return smp_save(m, path, &d);
}
static smp_status load(smp_model *m, opt_store *o, const char *path, int partial, meta_seen *seen) {
    smp_load_desc d = {0};
    d.partial = partial ? SMP_ON : SMP_OFF;
    d.optimizer = o ? o->reg : NULL;
    d.on_meta = seen ? on_meta : NULL;
    d.user = seen;
    return smp_load(m, path, &d);
}

/* ---------------------------------------------------------------- sharded optimizer state */
/* shard_optimizer_state: SGD with momentum whose state covers the range of
   each parameter this replica owns (smp_param_owned_range), registered as
   one dimension of that length. A run saves after ZSTEPS steps; the state
   it saved, gathered by hand (g_zw, g_zm: every parameter and its momentum
   whole, by declaration index), is what a run at another (P, dp, sharding)
   must hold after loading it, bitwise; that run then trains on and must be
   bitwise the run at its own configuration that took the same state by
   hand instead of from the checkpoint. */
#define ZSTEPS 2
#define ZP (NLIN * 2)
static float g_zw[ZP][H * H], g_zm[ZP][H * H];
static int g_zskip = -1; /* the dp rank that registers no state for the first range it owns (a gap); -1: none */

typedef struct { float *v[ZP]; int64_t first[ZP], count[ZP]; smp_param *p[ZP]; smp_optimizer *reg; } zopt;

static void zbatch(int s, float *x, float *t) {
    uint64_t st = 77 + (uint64_t)s * 131;
    for (int i = 0; i < B * D; i++) x[i] = (float)(smp_rng_uniform(&st) * 2 - 1);
    for (int i = 0; i < B * C; i++) t[i] = (float)(smp_rng_uniform(&st) * 2 - 1);
}

SMP_STEP_BODY(zmse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    return smp_mb_return_f32(
        mb, 0, mse((const float *)y->data, (const float *)t->data, (float *)g->data, (int)smp_tensor_numel(y)));
}

/* Every parameter and its momentum whole into w and mom, on every rank of comm: bits ORed over
   the ranks, each element from the one rank that holds it (dp rank 0 for a parameter, the owner for momentum). */
static void zgather(MPI_Comm comm, zopt *o, float w[ZP][H * H], float mom[ZP][H * H]) {
    memset(w, 0, sizeof(float) * ZP * H * H);
    memset(mom, 0, sizeof(float) * ZP * H * H);
    for (int i = 0; i < ZP; i++) {
        if (!o->p[i]) continue;
        if (smp_dp_rank() == 0)
            memcpy(w[i], smp_param_value(o->p[i])->data, smp_tensor_nbytes(smp_param_value(o->p[i])));
        memcpy(mom[i] + o->first[i], o->v[i], sizeof(float) * (size_t)o->count[i]);
    }
    MPI_Allreduce(MPI_IN_PLACE, w, ZP * H * H, MPI_UINT32_T, MPI_BOR, comm);
    MPI_Allreduce(MPI_IN_PLACE, mom, ZP * H * H, MPI_UINT32_T, MPI_BOR, comm);
}

/* A run inside comm at P partitions (the rest replicas; shard: shard_optimizer_state): loads `from` (or, with
   from NULL and inject, takes g_zw/g_zm by hand), checks what it holds against them, trains `steps` steps, saves
   partially to `to` (when given: g_zw/g_zm become what it saved) and leaves every parameter whole in out. */
static int zrun(MPI_Comm comm, int P, bool shard, const char *from, int partial, bool inject, int steps, const char *to,
                float out[ZP][H * H], char *why, size_t cap) {
    int size;
    MPI_Comm_size(comm, &size);
    smp_config cfg = {0};
    cfg.comm = comm;
    cfg.partitions = P;
    cfg.microbatches = 2;
    cfg.ddp = size > P ? SMP_ON : SMP_OFF;
    cfg.deterministic_reduction = SMP_ON;
    cfg.shard_optimizer_state = shard ? SMP_ON : SMP_OFF;
    cfg.seed = 7;
    if (smp_init(&cfg)) { snprintf(why, cap, "smp_init: %s", smp_last_error()); return 0; }
    net n;
    zopt o;
    memset(&o, 0, sizeof o);
    smp_model *m = build(&n, NULL);
    float x[B * D], t[B * C];
    zbatch(0, x, t);
    smp_tensor sample = smp_tensor_2d(x, SMP_F32, B / 2, D);
    int ok = m && smp_model_trace(m, &sample, 1) == SMP_OK && smp_optimizer_new(m, &o.reg) == SMP_OK;
    bool skipped = false;
    for (int i = 0; ok && i < ZP; i++) {
        smp_param *p = smp_model_global_param(m, i, false);
        if (!smp_module_is_local(smp_param_module(p))) continue;
        o.p[i] = p;
        ok = smp_param_owned_range(m, p, &o.first[i], &o.count[i]) == SMP_OK;
        o.v[i] = (float *)calloc((size_t)o.count[i] + 1, sizeof(float));
        smp_tensor s = smp_tensor_1d(o.v[i], SMP_F32, o.count[i]);
        if (smp_dp_rank() == g_zskip && !skipped && o.count[i] > 0)
            skipped = true; /* the gap: a range this replica owns, with no state registered */
        else
            ok = ok && smp_optimizer_state_add(o.reg, smp_param_name(p), "momentum", &s) == SMP_OK;
    }
    if (!ok) snprintf(why, cap, "set-up: %s", smp_last_error());
    if (ok && from) {
        smp_load_desc d = {0};
        d.partial = partial ? SMP_ON : SMP_OFF;
        d.optimizer = o.reg;
        if (smp_load(m, from, &d)) { ok = 0; snprintf(why, cap, "load: %s", smp_last_error()); }
    }
    for (int i = 0; ok && (from || inject) && i < ZP; i++) {
        if (!o.p[i]) continue;
        if (inject) {
            memcpy(smp_param_value(o.p[i])->data, g_zw[i], smp_tensor_nbytes(smp_param_value(o.p[i])));
            memcpy(o.v[i], g_zm[i] + o.first[i], sizeof(float) * (size_t)o.count[i]);
        }
        if (memcmp(smp_param_value(o.p[i])->data, g_zw[i], smp_tensor_nbytes(smp_param_value(o.p[i]))) ||
            memcmp(o.v[i], g_zm[i] + o.first[i], sizeof(float) * (size_t)o.count[i])) {
            ok = 0;
            snprintf(why, cap, "'%s' or its momentum (elements %lld..) is not what was saved", smp_param_name(o.p[i]),
                     (long long)o.first[i]);
        }
    }
    for (int s = 0; ok && s < steps; s++) {
        smp_step_output loss = {0};
        zbatch(s + 1, x, t);
        smp_tensor xt = smp_tensor_2d(x, SMP_F32, B, D), tt = smp_tensor_2d(t, SMP_F32, B, C);
        smp_model_zero_grad(m);
        if (SMP_TRAIN_STEP(m, zmse_body, NULL, &loss, 1, xt, tt)) {
            ok = 0;
            snprintf(why, cap, "step %d: %s", s, smp_last_error());
        }
        smp_step_output_free(&loss);
        for (int i = 0; ok && i < ZP; i++) {
            if (!o.p[i]) continue;
            float *w = (float *)smp_param_value(o.p[i])->data + o.first[i];
            const float *g = (const float *)smp_param_grad(o.p[i])->data + o.first[i];
            for (int64_t k = 0; k < o.count[i]; k++) {
                o.v[i][k] = 0.9f * o.v[i][k] + g[k];
                w[k] -= 0.05f * o.v[i][k];
            }
        }
    }
    if (ok && to) {
        smp_save_desc d = {0};
        d.optimizer = o.reg;
        d.partial = SMP_ON;
        if (smp_save(m, to, &d)) { ok = 0; snprintf(why, cap, "save: %s", smp_last_error()); }
        char full[300];
        snprintf(full, sizeof full, "%s_full", to);
        d.partial = SMP_OFF;
        if (ok && smp_save(m, full, &d)) { ok = 0; snprintf(why, cap, "full save: %s", smp_last_error()); }
        if (ok) zgather(comm, &o, g_zw, g_zm);
    }
    if (ok && smp_model_gather_params(m)) { ok = 0; snprintf(why, cap, "gather: %s", smp_last_error()); }
    static float unused[ZP][H * H];
    if (ok) zgather(comm, &o, out, unused);
    for (int i = 0; i < ZP; i++) free(o.v[i]);
    smp_optimizer_free(o.reg);
    smp_model_free(m);
    smp_finalize();
    return ok;
}

/* The first `size` ranks of the world, or MPI_COMM_NULL on the others. */
static MPI_Comm first_ranks(int size) {
    MPI_Comm c;
    MPI_Comm_split(MPI_COMM_WORLD, me < size ? 0 : MPI_UNDEFINED, me, &c);
    return c;
}

/* Loads `from` at (P, sharded or not) on the first `size` ranks and trains on, against the same run given the saved
   state by hand; with `to`, saves after the resumed run's steps (the next link of a chain). */
static void zresume(int size, int P, bool shard, const char *from, int partial, const char *to, const char *label) {
    static float a[ZP][H * H], b[ZP][H * H];
    char name[300], why[2200] = "", why2[2200] = "";
    int ok = 1;
    if (!allowed(size) || world < size) return;
    MPI_Comm c = first_ranks(size);
    if (c != MPI_COMM_NULL) {
        ok = zrun(c, P, shard, NULL, 0, true, ZSTEPS, NULL, b, why2, sizeof why2) &&
             zrun(c, P, shard, from, partial, false, ZSTEPS, to, a, why, sizeof why);
        if (!why[0]) snprintf(why, sizeof why, "%s", why2);
        if (ok && memcmp(a, b, sizeof a)) { ok = 0; snprintf(why, sizeof why, "the resumed run's parameters differ"); }
        MPI_Comm_free(&c);
    }
    MPI_Bcast(g_zw, ZP * H * H, MPI_FLOAT, 0, MPI_COMM_WORLD);
    MPI_Bcast(g_zm, ZP * H * H, MPI_FLOAT, 0, MPI_COMM_WORLD);
    snprintf(name, sizeof name,
             "checkpoint/sharded optimizer state: %s, at P=%d x %d replicas%s (%s): loads what was saved, "
             "trains on bitwise",
             label, P, size / P, shard ? " sharded" : "", partial ? "partial" : "full");
    MPI_CHECK(ok, name, "%s", why);
}

static void test_sharded(void) {
    if (world < 2) return;
    char a[300], af[320], b[300], name[200], why[2200] = "";
    static float out[ZP][H * H];
    path_in(a, sizeof a, "zero_a");
    path_in(b, sizeof b, "zero_b");
    snprintf(af, sizeof af, "%s_full", a);
    int ok = 1;
    MPI_Comm c = first_ranks(2);
    if (c != MPI_COMM_NULL) {
        ok = zrun(c, 1, true, NULL, 0, false, ZSTEPS, a, out, why, sizeof why);
        MPI_Comm_free(&c);
    }
    MPI_Bcast(g_zw, ZP * H * H, MPI_FLOAT, 0, MPI_COMM_WORLD);
    MPI_Bcast(g_zm, ZP * H * H, MPI_FLOAT, 0, MPI_COMM_WORLD);
    snprintf(name, sizeof name, "checkpoint/sharded optimizer state: 2 replicas sharded save partially and fully");
    MPI_CHECK(ok, name, "%s", why);
    zresume(2, 1, true, a, 1, NULL, "saved sharded by 2 replicas");
    zresume(2, 2, false, a, 1, NULL, "saved sharded by 2 replicas");
    zresume(2, 2, false, af, 0, NULL, "saved sharded by 2 replicas");
    zresume(4, 2, true, a, 1, NULL, "saved sharded by 2 replicas");
    zresume(4, 2, true, af, 0, NULL, "saved sharded by 2 replicas");
    /* a chain: sharded at dp 2 -> unsharded at dp 1, which saves -> sharded at dp 4 */
    zresume(1, 1, false, af, 0, NULL, "saved sharded by 2 replicas");
    zresume(1, 1, false, a, 1, b, "saved sharded by 2 replicas");
    zresume(2, 1, true, b, 1, NULL, "saved unsharded by 1 replica after a sharded resume");
    zresume(4, 1, true, b, 1, NULL, "saved unsharded by 1 replica after a sharded resume");
}

/* ---------------------------------------------------------------- files on disk */
/* Copies the file at `path` to `dst` through the file layer, keeping its
   metadata (but smp's checksums, which the writer recomputes, and the
   metadata key `drop_meta`): `drop` leaves a tensor out, `retype`/`reshape`
   changes one's header, `add` appends one. */
static int rewrite_to(const char *path, const char *dst, const char *drop_meta, const char *drop, const char *retype,
                      smp_dtype dt, const char *reshape, int ndim, const int64_t *shape, const char *add) {
    smp_ckpt_file *f;
    if (smp_ckpt_open(path, &f) != SMP_OK) return 0;
    int n = smp_ckpt_count(f), ne = 0, nm = 0;
    smp_ckpt_entry *e = calloc((size_t)n + 1, sizeof *e);
    void **data = calloc((size_t)n + 1, sizeof *data);
    const char **mk = calloc((size_t)smp_ckpt_meta_count(f) + 1, sizeof *mk),
               **mv = calloc((size_t)smp_ckpt_meta_count(f) + 1, sizeof *mv);
    static float extra[2] = {1, 2};
    for (int i = 0; i < n; i++) {
        const smp_ckpt_info *in = smp_ckpt_info_at(f, i);
        if (drop && !strcmp(in->name, drop)) continue;
        data[ne] = malloc(in->nbytes + 1);
        smp_ckpt_read(f, in, data[ne], in->nbytes);
        e[ne].name = in->name;
        e[ne].dtype = in->dtype;
        e[ne].ndim = in->ndim;
        memcpy(e[ne].shape, in->shape, sizeof e[ne].shape);
        e[ne].data = data[ne];
        if (retype && !strcmp(in->name, retype)) e[ne].dtype = dt;
        if (reshape && !strcmp(in->name, reshape)) {
            e[ne].ndim = ndim;
            memcpy(e[ne].shape, shape, sizeof(int64_t) * (size_t)ndim);
        }
        ne++;
    }
    if (add) {
        e[ne].name = add;
        e[ne].dtype = SMP_F32;
        e[ne].ndim = 1;
        e[ne].shape[0] = 2;
        e[ne].data = extra;
        ne++;
    }
    for (int i = 0; i < smp_ckpt_meta_count(f); i++) {
        smp_ckpt_meta_at(f, i, &mk[nm], &mv[nm]);
        if (strncmp(mk[nm], "smp.checksum.", 13) && !(drop_meta && !strcmp(mk[nm], drop_meta))) nm++;
    }
    int ok = smp_ckpt_write_file(dst, e, ne, mk, mv, nm) == SMP_OK;
    for (int i = 0; i < ne; i++) if (e[i].data != extra) free(data[i]);
    free(e); free(data); free(mk); free(mv);
    smp_ckpt_close(f);
    return ok;
}
static int rewrite(const char *path, const char *drop, const char *retype, smp_dtype dt, const char *reshape, int ndim,
                   const int64_t *shape, const char *add) {
    return rewrite_to(path, path, NULL, drop, retype, dt, reshape, ndim, shape, add);
}

static int same_bytes(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb, ca, cb;
    while (same) {
        ca = fgetc(fa);
        cb = fgetc(fb);
        if (ca != cb) same = 0;
        if (ca == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

/* The file of partition k of the partial checkpoint at `path` (its
   manifest's, or "<path>_<k>" for one saved before manifests). */
static int part_file(const char *path, int k, char *out, size_t cap) {
    return smp_ckpt_partial_file(path, k, out, cap, NULL) == SMP_OK;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The files of checkpoint `name` in the test's folder: the names that are
   `name` or continue it with '.' or '_' ("x", "x.manifest", "x.g3_0",
   "x_1", "x.g3_0.tmp.123"), sorted and joined by spaces into out. Returns
   how many. */
static int ckpt_files(const char *name, char *out, size_t cap) {
    DIR *d = opendir(dir);
    struct dirent *de;
    char *names[256];
    int n = 0;
    size_t len = strlen(name);
    out[0] = 0;
    if (!d) return -1;
    while ((de = readdir(d)) && n < 256)
        if (!strncmp(de->d_name, name, len) && (!de->d_name[len] || de->d_name[len] == '.' || de->d_name[len] == '_'))
            names[n++] = strdup(de->d_name);
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    for (int i = 0; i < n; i++) {
        snprintf(out + strlen(out), cap - strlen(out), "%s%s", i ? " " : "", names[i]);
        free(names[i]);
    }
    return n;
}

/* Whether checkpoint `name` consists of exactly its manifest and the P
   files it names, with no other file of its name around. */
static int only_committed(const char *name, int P, char *why, size_t cap) {
    char path[600], f[700], want[4096] = "", got[4096];
    path_in(path, sizeof path, name);
    char *names[64];
    int n = 0;
    snprintf(f, sizeof f, "%s.manifest", name);
    names[n++] = strdup(f);
    for (int k = 0; k < P; k++) {
        if (!part_file(path, k, f, sizeof f)) {
            snprintf(why, cap, "no file %d: %s", k, smp_last_error());
            for (int i = 0; i < n; i++) free(names[i]);
            return 0;
        }
        names[n++] = strdup(strrchr(f, '/') + 1);
    }
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    for (int i = 0; i < n; i++) {
        snprintf(want + strlen(want), sizeof want - strlen(want), "%s%s", i ? " " : "", names[i]);
        free(names[i]);
    }
    ckpt_files(name, got, sizeof got);
    if (strcmp(want, got)) {
        snprintf(why, cap, "the folder holds '%.1900s', expected '%.1900s'", got, want);
        return 0;
    }
    return 1;
}

/* Turns the partial checkpoint at `path` (P files) into the format before
   manifests: "<path>_<k>" files without smp.generation, no manifest. */
static int to_legacy(const char *path, int P) {
    char f[700], legacy[700], manifest[700];
    for (int k = 0; k < P; k++) {
        snprintf(legacy, sizeof legacy, "%s_%d", path, k);
        if (!part_file(path, k, f, sizeof f) ||
            !rewrite_to(f, legacy, "smp.generation", NULL, NULL, SMP_F32, NULL, 0, NULL, NULL) || remove(f) != 0)
            return 0;
    }
    snprintf(manifest, sizeof manifest, "%s.manifest", path);
    return remove(manifest) == 0;
}

/* ---------------------------------------------------------------- round trips */
static void test_roundtrip(int P, int partial, size_t chunk) {
    char name[160], path[512], why[4096] = "";
    snprintf(name, sizeof name, "checkpoint/round trip/P=%d/dp=%d/%s%s", P, world / P, partial ? "partial" : "full",
             chunk ? "/chunk 40 B" : "");
    net n;
    smp_model *m = start(P, &n);
    if (!m) { MPI_CHECK(0, name, "start: %s", smp_last_error()); smp_finalize(); return; }
    opt_store o;
    opt_make(&o, m);
    snprintf(path, sizeof path, "%s/rt_%d_%d_%zu", dir, P, partial, chunk);
    set_all(m, &o, 1);
    smp_status st = save(m, &o, path, partial, chunk);
    int ok = st == SMP_OK;
    if (!ok) snprintf(why, sizeof why, "save: %s", smp_last_error());
    set_all(m, &o, 2); /* perturb */
    meta_seen seen = {{0}, {0}, {0}, 0};
    if (ok && (st = load(m, &o, path, partial, &seen)) != SMP_OK) {
        ok = 0;
        snprintf(why, sizeof why, "load: %s", smp_last_error());
    }
    if (ok) ok = check_all(m, &o, 1, why, sizeof why);
    if (ok &&
        (strcmp(seen.epoch, "3") || strcmp(seen.step, "1200") || strcmp(seen.note, mvals[2]) || seen.count != 3)) {
        ok = 0;
        snprintf(why, sizeof why, "metadata callback saw %d entries, epoch '%s' step '%s' note '%s'", seen.count,
                 seen.epoch, seen.step, seen.note);
    }
    /* a partial save wrote its manifest and P files, a full one one file */
    if (ok && me == 0) {
        char got[4096], base[200];
        snprintf(base, sizeof base, "rt_%d_%d_%zu", P, partial, chunk);
        if (partial) ok = only_committed(base, P, why, sizeof why);
        else if (ckpt_files(base, got, sizeof got) != 1 || strcmp(got, base)) {
            ok = 0;
            snprintf(why, sizeof why, "the folder holds '%.1900s', expected '%s'", got, base);
        }
    }
    MPI_CHECK(ok, name, "%s", why);

    if (!partial && !chunk) { /* the gathered state dict, on the last rank */
        int root = world - 1;
        smp_state_dict sd;
        set_all(m, &o, 4);
        st = smp_model_state_dict(m, o.reg, root, &sd);
        ok = st == SMP_OK;
        snprintf(why, sizeof why, "%s", ok ? "" : smp_last_error());
        int nparams = smp_model_num_global_params(m, true),
            want = nparams + 2 * smp_model_num_global_params(m, false) + 2;
        if (ok && me == root) {
            if (sd.n != want || sd.partial) {
                ok = 0;
                snprintf(why, sizeof why, "%d entries, expected %d", sd.n, want);
            }
            for (int i = 0; i < sd.n && ok; i++) {
                static uint8_t buf[4096];
                size_t k = smp_tensor_nbytes(&sd.entries[i].tensor);
                fill(buf, k, sd.entries[i].tensor.dtype, sd.entries[i].name, 4);
                if (memcmp(buf, sd.entries[i].tensor.data, k)) {
                    ok = 0;
                    snprintf(why, sizeof why, "'%s' differs", sd.entries[i].name);
                }
            }
            if (ok && !smp_state_dict_find(&sd, "optimizer.head.weight.exp_avg")) {
                ok = 0;
                snprintf(why, sizeof why, "no optimizer.head.weight.exp_avg");
            }
        } else if (ok && sd.n != 0) { ok = 0; snprintf(why, sizeof why, "a non-root rank got %d entries", sd.n); }
        smp_state_dict_free(&sd);
        snprintf(name, sizeof name, "checkpoint/state dict gathered on rank %d/P=%d/dp=%d", root, P, world / P);
        MPI_CHECK(ok, name, "%s", why);

        smp_state_dict lsd;
        ok = smp_model_local_state_dict(m, o.reg, &lsd) == SMP_OK && lsd.partial;
        int local = 0;
        smp_param *p;
        for (int i = 0; (p = smp_model_local_param(m, i, true)); i++) local++;
        ok = ok && lsd.n == local + o.n && smp_state_dict_find(&lsd, "optimizer.lr") &&
             smp_state_dict_find(&lsd, "optimizer.lr")->data == o.t[o.n - 2].data;
        smp_state_dict_free(&lsd);
        snprintf(name, sizeof name, "checkpoint/local state dict holds views of this rank's tensors/P=%d", P);
        MPI_CHECK(ok, name, "%s", smp_last_error());
    }
    opt_free(&o);
    stop(m);
}

/* ---------------------------------------------------------------- resharding */
static void test_reshard(void) {
    static const int Ps[3] = {1, 2, 4};
    for (int a = 0; a < 3; a++) {
        int P = Ps[a];
        if (!allowed(P)) continue;
        for (int partial = 0; partial < 2; partial++) {
            char path[512], why[4096] = "", name[160];
            snprintf(path, sizeof path, "%s/reshard_%d_%d", dir, P, partial);
            net n;
            smp_model *m = start(P, &n);
            opt_store o;
            opt_make(&o, m);
            set_all(m, &o, 100 + P);
            smp_status st = save(m, &o, path, partial, partial ? 0 : 64);
            snprintf(name, sizeof name, "checkpoint/reshard/save P=%d %s", P, partial ? "partial" : "full");
            MPI_CHECK(st == SMP_OK, name, "%s", smp_last_error());
            opt_free(&o);
            stop(m);
            for (int b = 0; b < 3; b++) {
                int Q = Ps[b];
                if (!allowed(Q)) continue;
                m = start(Q, &n);
                opt_make(&o, m);
                set_all(m, &o, 7);
                meta_seen seen = {{0}, {0}, {0}, 0};
                st = load(m, &o, path, partial, &seen);
                int ok = st == SMP_OK;
                if (!ok) snprintf(why, sizeof why, "load: %s", smp_last_error());
                else ok = check_all(m, &o, 100 + P, why, sizeof why);
                snprintf(name, sizeof name, "checkpoint/reshard/%s P=%d -> Q=%d (dp %d -> %d)",
                         partial ? "partial" : "full", P, Q, world / P, world / Q);
                MPI_CHECK(ok, name, "%s", why);
                opt_free(&o);
                stop(m);
            }
        }
    }
}

/* ---------------------------------------------------------------- generations */
/* Consecutive partial saves to one path: each commits a new generation and
   leaves only its own files, also when the partition count shrinks (the
   files of partitions that no longer exist go too); the load follows the
   manifest to the latest. */
static void test_generations(void) {
    int Ps[2] = {allowed(4) ? 4 : 2, allowed(4) ? 2 : 1};
    if (world < 2) return;
    char path[512], why[4096] = "", name[200], f[700];
    path_in(path, sizeof path, "gens");
    for (int i = 0; i < 2; i++) {
        int P = Ps[i];
        net n;
        smp_model *m = start(P, &n);
        opt_store o;
        opt_make(&o, m);
        int ok = 1;
        for (int v = 0; v < 2 && ok; v++) {
            set_all(m, &o, 30 + 2 * i + v);
            smp_status st = save(m, &o, path, 1, 0);
            char want[64];
            snprintf(want, sizeof want, "gens.g%d_0", 2 * i + v + 1);
            if (st) { ok = 0; snprintf(why, sizeof why, "save: %s", smp_last_error()); }
            else if (me == 0 && !only_committed("gens", P, why, sizeof why)) ok = 0;
            else if (me == 0 && (!part_file(path, 0, f, sizeof f) || strcmp(strrchr(f, '/') + 1, want))) {
                ok = 0;
                snprintf(why, sizeof why, "file 0 is '%s', expected %s", f, want);
            }
        }
        set_all(m, &o, 0);
        if (ok && load(m, &o, path, 1, NULL) != SMP_OK) {
            ok = 0;
            snprintf(why, sizeof why, "load: %s", smp_last_error());
        }
        if (ok) ok = check_all(m, &o, 30 + 2 * i + 1, why, sizeof why);
        snprintf(name, sizeof name,
                 "checkpoint/generations: two partial saves at P=%d%s, each leaves only its own files, the load takes "
                 "the last",
                 P, i ? " after a save at a larger P" : "");
        MPI_CHECK(ok, name, "%s", why);
        opt_free(&o);
        stop(m);
    }
}

/* ---------------------------------------------------------------- Python */
static const char *script_path(const char *file) {
    static char path[1024];
    const char *slash = strrchr(__FILE__, '/');
    if (slash) snprintf(path, sizeof path, "%.*s/%s", (int)(slash - __FILE__), __FILE__, file);
    else snprintf(path, sizeof path, "%s", file);
    return path;
}

/* Raw dumps of every tensor (by the rank that saves it) for the script to
   compare the full checkpoint with. */
static void dump_one(FILE *man, const char *edir, const char *nm, const smp_tensor *t) {
    char path[700];
    snprintf(path, sizeof path, "%s/%s.bin", edir, nm);
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(t->data, 1, smp_tensor_nbytes(t), f);
        fclose(f);
    }
    fprintf(man, "%s %s %d", nm, smp_ckpt_dtype_string(t->dtype), t->ndim);
    for (int d = 0; d < t->ndim; d++) fprintf(man, " %lld", (long long)t->shape[d]);
    fprintf(man, "\n");
}
static void dump_expected(smp_model *m, opt_store *o, const char *edir) {
    if (smp_dp_rank() != 0) return;
    char path[700];
    snprintf(path, sizeof path, "%s/manifest_%d.txt", edir, me);
    FILE *man = fopen(path, "w");
    if (!man) return;
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(m, i, true)); i++)
        dump_one(man, edir, smp_param_name(p), smp_param_value(p));
    for (int k = 0; k < o->n; k++)
        if (k < o->n - 2 || me == 0) dump_one(man, edir, o->full[k], &o->t[k]); /* whole-optimizer state: rank 0's */
    fclose(man);
}

static void test_python(void) {
    int P = allowed(4) ? 4 : allowed(2) ? 2 : 1;
    char path[512], edir[512], cmd[4096];
    net n;
    smp_model *m = start(P, &n);
    opt_store o;
    opt_make(&o, m);
    set_all(m, &o, 42);
    path_in(path, sizeof path, "python.safetensors");
    path_in(edir, sizeof edir, "python_expected");
    if (me == 0) mkdir(edir, 0777);
    MPI_Barrier(MPI_COMM_WORLD);
    smp_status st = save(m, &o, path, 0, 0);
    MPI_CHECK(st == SMP_OK, "checkpoint/python: full save", "%s", smp_last_error());
    dump_expected(m, &o, edir);
    MPI_Barrier(MPI_COMM_WORLD);
    if (me == 0) {
        const char *script = script_path("test_checkpoint_python.py");
        if (access(script, R_OK) != 0) {
            test_skip("checkpoint/python", "test_checkpoint_python.py not found");
        } else {
            snprintf(cmd, sizeof cmd, "python3 '%s' '%s' '%s' %d", script, path, edir, P);
            fflush(stdout);
            int rc = system(cmd);
            rc = rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
            if (rc == 3) test__failed_total++; /* the script printed its FAIL lines */
            else if (rc != 0)
                CHECK(0, "checkpoint/python: test_checkpoint_python.py ran", "exit status %d (%s)", rc, cmd);
        }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    opt_free(&o);
    stop(m);
}

/* ---------------------------------------------------------------- a killed save */
/* Kills at every phase of a save, each in a separate 2-rank job (P = 2, so
   both ranks save a file) over a checkpoint of its own:
   - a full save with SMP_CKPT_FAULT=data (the writer dies mid-file);
   - a partial save of version 8 over a partial checkpoint of version 7,
     which the same job saved just before, with the fault set on one rank:
     the file layer's header (the rank's file not written yet), data, flush,
     rename (its file sealed, not renamed; paced so that every other rank's
     file is renamed first: the kill falls between the per-rank renames) and
     dirsync (renamed) on each rank; renamed (every file renamed, no
     manifest) on each rank; manifest (its tmp file complete, not renamed)
     and commit (renamed, the folder not yet flushed) on rank 0; cleanup
     (one old file removed) on each rank;
   - some of them again over a checkpoint saved before manifests
     ("<path>_<k>" files, which the new save's commit replaces).
   Then, in this job and its partitioning, each loads as exactly the old (7)
   or the new (8) checkpoint, bitwise, the one the phase implies: the new one
   once, and only once, its manifest is in place. A save to the same path
   then succeeds and leaves only its own files: what the killed save left
   (an uncommitted generation's files, the tmp files of dead writers, the old
   generation's remains) is gone. */
typedef struct { const char *phase; int rank, legacy, want_new; } kill_case;
static const kill_case kill_cases[] = {
    {"header", 0, 0, 0},   {"header", 1, 0, 0},   {"data", 0, 0, 0},    {"data", 1, 0, 0},
    {"flush", 0, 0, 0},    {"flush", 1, 0, 0},    {"rename", 0, 0, 0},  {"rename", 1, 0, 0},
    {"dirsync", 0, 0, 0},  {"dirsync", 1, 0, 0},  {"renamed", 0, 0, 0}, {"renamed", 1, 0, 0},
    {"manifest", 0, 0, 0}, {"commit", 0, 0, 1},   {"cleanup", 0, 0, 1}, {"cleanup", 1, 0, 1},
    {"header", 1, 1, 0},   {"rename", 1, 1, 0},   {"renamed", 0, 1, 0}, {"manifest", 0, 1, 0},
    {"commit", 0, 1, 1},   {"cleanup", 0, 1, 1},  {"cleanup", 1, 1, 1},
};
enum { NKILL = (int)(sizeof kill_cases / sizeof kill_cases[0]) };

static void kill_name(int i, char *out, size_t cap) {
    snprintf(out, cap, "kill%02d_%s_r%d%s", i, kill_cases[i].phase, kill_cases[i].rank,
             kill_cases[i].legacy ? "_legacy" : "");
}

/* The child side, a 2-rank job with P = 2:
     --child full DIR VERSION FAULT      full save of VERSION to DIR/fault_full
                                         (FAULT "-": none; else on every rank)
     --child part DIR NAME PHASE RANK LEGACY
                                         partial save of 7 to DIR/NAME (turned
                                         into the format before manifests with
                                         LEGACY 1), then of 8 with
                                         SMP_CKPT_FAULT=PHASE on world rank RANK */
static int child_main(int argc, char **argv) {
    net n;
    char path[600];
    const char *mode = argv[2];
    snprintf(dir, sizeof dir, "%s", argv[3]);
    smp_model *m = start(2, &n);
    if (!m) return 2;
    opt_store o;
    opt_make(&o, m);
    int rc = 0;
    if (!strcmp(mode, "full") && argc == 6) {
        set_all(m, &o, atoi(argv[4]));
        if (strcmp(argv[5], "-")) setenv("SMP_CKPT_FAULT", argv[5], 1);
        path_in(path, sizeof path, "fault_full");
        if (save(m, &o, path, 0, 64) != SMP_OK) rc = 3;
    } else if (!strcmp(mode, "part") && argc == 8) {
        path_in(path, sizeof path, argv[4]);
        set_all(m, &o, 7);
        if (save(m, &o, path, 1, 0) != SMP_OK) rc = 3;
        if (!rc && atoi(argv[7])) {
            int ok = me != 0 || to_legacy(path, 2), all;
            MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
            if (!all) rc = 3;
        }
        set_all(m, &o, 8);
        if (!rc && me == atoi(argv[6])) setenv("SMP_CKPT_FAULT", argv[5], 1);
        if (!rc && save(m, &o, path, 1, 0) != SMP_OK) rc = 3;
    } else {
        rc = 2;
    }
    unsetenv("SMP_CKPT_FAULT");
    opt_free(&o);
    stop(m);
    if (me == 0) printf("child finished, no fault fired (status %d): %s\n", rc, rc ? smp_last_error() : "saved");
    return rc; /* a fault that did not fire ends here */
}

/* Runs `mpirun -n 2 self --child ARGS` with its output in DIR/child_LOG.log;
   returns its exit status. */
static int run_child(const char *self, const char *args, const char *log) {
    char cmd[4096], env[1024] = "";
    const char *keep[] = {"PATH", "HOME", "LD_LIBRARY_PATH", "TMPDIR", "ASAN_OPTIONS", "UBSAN_OPTIONS"};
    for (int i = 0; i < 6; i++) {
        const char *v = getenv(keep[i]);
        if (v) snprintf(env + strlen(env), sizeof env - strlen(env), " %s='%s'", keep[i], v);
    }
    /* a clean environment: the inner mpirun must not see the outer job's */
    snprintf(cmd, sizeof cmd, "env -i%s mpirun -n 2 '%s' --child %s > '%s/child_%s.log' 2>&1", env, self, args, dir,
             log);
    fflush(stdout);
    int rc = system(cmd);
    return rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/* Whether the child's log shows the fault firing on world rank `rank` at
   `phase`, and the child not finishing. */
static int fault_fired(const char *log, const char *phase, int rank) {
    char path[600], line[128], buf[1 << 14];
    snprintf(path, sizeof path, "%s/child_%s.log", dir, log);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    snprintf(line, sizeof line, "smp[%d] error: SMP_CKPT_FAULT=%s: test fault injection", rank, phase);
    return strstr(buf, line) && !strstr(buf, "child finished");
}

/* The status of a job that a fault injection ended, as MPICH's mpirun
   (Hydra 4.0) reports it: the bitwise OR of the raw wait statuses that its
   proxy reports for the ranks (mpirun -print-all-exitcodes shows them).
   The rank at the fault _exit()s with 77 (raw 77 << 8); the proxy then
   SIGKILLs the others and reports 0 for them, so mpirun usually exits 77.
   Two races in the proxy change that: a rank it killed is reported with
   its SIGKILL status (raw 9), and the OR, now a signal status, reaches the
   shell as 9; or it reports 1 for the rank that exited 77, and mpirun,
   taking 1 for a raw status ("Hangup (signal 1)"), exits 1. (Traced: in
   such a run that rank called exit_group(77), the other was SIGKILLed, and
   no process exited with 1 or got a SIGHUP; 4 runs in 60 of "renamed" on
   rank 1, none in 30 of the full save's "data".) So 77, 9 and 1 all mean
   "a rank died and the job ended"; 2 and 3 are this program's own (no
   fault fired) and 0 is a finished child: never accepted. Which rank died
   where is checked in the child's log: the fault's own line, from the rank
   and phase asked for, and no line of the child finishing. */
#define KILLED(rc) ((rc) == 77 || (rc) == 9 || (rc) == 1)

/* MPI_Bcast from rank 0 that sleeps between polls: the other ranks wait
   while rank 0 runs child jobs, and a busy wait would take their cores. */
static void sleepy_bcast(int *buf, int n) {
    MPI_Request req;
    int done = 0;
    MPI_Ibcast(buf, n, MPI_INT, 0, MPI_COMM_WORLD, &req);
    while (MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done)
        nanosleep(&(struct timespec){0, 2000000}, NULL);
}

static void test_killed_save(const char *self) {
    int rcs[NKILL + 2], fired[NKILL], intact = 1;
    char why[4096] = "", name[400], args[900], log[200];
    memset(fired, 0, sizeof fired);
    if (me == 0) {
        char a[600], b[700], cmd[1400];
        rcs[0] = run_child(self, (snprintf(args, sizeof args, "full '%s' 7 -", dir), args), "full_save");
        path_in(a, sizeof a, "fault_full");
        snprintf(b, sizeof b, "%s.copy", a);
        snprintf(cmd, sizeof cmd, "cp '%s' '%s'", a, b);
        if (system(cmd) != 0) intact = 0;
        rcs[1] = run_child(self, (snprintf(args, sizeof args, "full '%s' 8 data", dir), args), "full_fault");
        if (intact && !same_bytes(a, b)) { intact = 0; snprintf(why, sizeof why, "fault_full changed"); }
        for (int i = 0; i < NKILL && rcs[0] != 127 && rcs[0] != -1; i++) {
            const kill_case *c = &kill_cases[i];
            kill_name(i, log, sizeof log);
            snprintf(args, sizeof args, "part '%s' %s %s %d %d", dir, log, c->phase, c->rank, c->legacy);
            rcs[2 + i] = run_child(self, args, log);
            fired[i] = fault_fired(log, c->phase, c->rank);
        }
    }
    sleepy_bcast(rcs, NKILL + 2);
    sleepy_bcast(fired, NKILL);
    sleepy_bcast(&intact, 1);
    if (rcs[0] == 127 || rcs[0] == -1) {
        if (me == 0) test_skip("checkpoint/killed save", "cannot run a nested mpirun here");
        return;
    }
    MPI_CHECK(rcs[0] == 0, "checkpoint/killed save: the previous full checkpoint is saved (2-rank child)",
              "child exit %d (see %s/child_full_save.log)", rcs[0], dir);
    MPI_CHECK(KILLED(rcs[1]), "checkpoint/killed save: SMP_CKPT_FAULT=data kills a full save",
              "exit %d (want 77, 9 or 1; see %s/child_full_fault.log)", rcs[1], dir);
    MPI_CHECK(intact, "checkpoint/killed save: the previous full file is bitwise intact", "%s", why);
    int P = allowed(2) ? 2 : 1;
    { /* the full checkpoint loads, here, with this world's partitioning */
        net n;
        smp_model *m = start(P, &n);
        opt_store o;
        opt_make(&o, m);
        set_all(m, &o, 0);
        char path[512];
        path_in(path, sizeof path, "fault_full");
        smp_status st = load(m, &o, path, 0, NULL);
        int ok = st == SMP_OK && check_all(m, &o, 7, why, sizeof why);
        snprintf(name, sizeof name, "checkpoint/killed save: the previous full checkpoint loads, bitwise (P=%d)", P);
        MPI_CHECK(ok, name, "%s", st ? smp_last_error() : why);
        opt_free(&o);
        stop(m);
    }
    for (int i = 0; i < NKILL; i++) {
        const kill_case *c = &kill_cases[i];
        char what[300], path[600];
        kill_name(i, log, sizeof log);
        snprintf(what, sizeof what, "checkpoint/killed save/partial, SMP_CKPT_FAULT=%s on rank %d%s", c->phase, c->rank,
                 c->legacy ? ", over a checkpoint saved before manifests" : "");
        snprintf(name, sizeof name, "%s: the fault fired there and ended the job", what);
        MPI_CHECK(fired[i] && KILLED(rcs[2 + i]), name, "exit %d, %s (see %s/child_%s.log)", rcs[2 + i],
                  fired[i] ? "fired" : "the log shows no such fault", dir, log);
        net n;
        smp_model *m = start(P, &n);
        opt_store o;
        opt_make(&o, m);
        set_all(m, &o, 0);
        path_in(path, sizeof path, log);
        smp_status st = load(m, &o, path, 1, NULL);
        int old = 0, new = 0;
        if (!st) {
            old = check_all(m, &o, 7, why, sizeof why);
            new = !old && check_all(m, &o, 8, why, sizeof why);
        }
        snprintf(name, sizeof name, "%s: loads as the %s checkpoint, bitwise, at P=%d", what,
                 c->want_new ? "new" : "old", P);
        MPI_CHECK(st == SMP_OK && (c->want_new ? new : old), name, "%s",
                  st    ? smp_last_error()
                  : old ? "loaded the old checkpoint"
                  : new ? "loaded the new checkpoint"
                        : "loaded neither: a mix");
        set_all(m, &o, 9);
        st = save(m, &o, path, 1, 0);
        int ok = st == SMP_OK && (me != 0 || only_committed(log, P, why, sizeof why));
        snprintf(name, sizeof name, "%s: the next save succeeds and leaves only its own files", what);
        MPI_CHECK(ok, name, "%s", st ? smp_last_error() : why);
        opt_free(&o);
        stop(m);
    }
}
#undef KILLED

/* ---------------------------------------------------------------- corruption */
/* Flips one byte in the middle of tensor `name`'s data. */
static int flip(const char *path, const char *name) {
    smp_ckpt_file *f;
    if (smp_ckpt_open(path, &f) != SMP_OK) return 0;
    const smp_ckpt_info *e = smp_ckpt_find(f, name);
    FILE *fp = fopen(path, "rb");
    uint8_t len8[8];
    uint64_t hlen = 0;
    int ok = e && fp && fread(len8, 1, 8, fp) == 8;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | len8[i];
    long at = ok ? (long)(8 + hlen + e->offset + e->nbytes / 2) : 0;
    if (fp) fclose(fp);
    smp_ckpt_close(f);
    if (!ok) return 0;
    fp = fopen(path, "r+b");
    if (!fp) return 0;
    fseek(fp, at, SEEK_SET);
    int c = fgetc(fp);
    fseek(fp, at, SEEK_SET);
    fputc(c ^ 0x10, fp);
    fclose(fp);
    return 1;
}

/* Bad input: replicas whose registered state leaves a gap in a parameter cannot save it; a partial checkpoint
   missing one replica's piece of a parameter's state (here: a checkpoint of the layout saved before manifests,
   one tensor dropped from the second replica's file) cannot be loaded. Both errors on every rank. */
static void test_sharded_gaps(void) {
    if (world < 2) return;
    char g[300], why[2200] = "", f1[700], victim[200] = "";
    static float out[ZP][H * H];
    path_in(g, sizeof g, "zero_gap");
    int ok = 0, good = 1;
    MPI_Comm c = first_ranks(2);
    if (c != MPI_COMM_NULL) {
        g_zskip = 1;
        ok = zrun(c, 1, true, NULL, 0, false, 1, g, out, why, sizeof why);
        g_zskip = -1;
        good = !ok && strstr(why, "do not cover the parameter");
    }
    MPI_CHECK(
        good,
        "checkpoint/sharded optimizer state: replicas whose state leaves a gap cannot save, an error on every rank",
        "%s", ok ? "saved" : why);
    if (c != MPI_COMM_NULL) ok = zrun(c, 1, true, NULL, 0, false, 1, g, out, why, sizeof why);
    if (me == 0 && ok) {
        smp_ckpt_file *f, *f0;
        char f0n[700];
        ok = to_legacy(g, 2);
        snprintf(f0n, sizeof f0n, "%s_0", g);
        snprintf(f1, sizeof f1, "%s_1", g);
        if (ok && smp_ckpt_open(f1, &f) == SMP_OK) { /* a tensor both replicas hold a range of */
            if (smp_ckpt_open(f0n, &f0) == SMP_OK) {
                for (int i = 0; i < smp_ckpt_count(f) && !victim[0]; i++)
                    if (!strncmp(smp_ckpt_info_at(f, i)->name, "optimizer.", 10) &&
                        smp_ckpt_find(f0, smp_ckpt_info_at(f, i)->name))
                        snprintf(victim, sizeof victim, "%s", smp_ckpt_info_at(f, i)->name);
                smp_ckpt_close(f0);
            }
            smp_ckpt_close(f);
        }
        ok = ok && victim[0] && rewrite(f1, victim, NULL, SMP_F32, NULL, 0, NULL, NULL);
    }
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Bcast(victim, sizeof victim, MPI_CHAR, 0, MPI_COMM_WORLD);
    good = 1;
    if (c != MPI_COMM_NULL) {
        why[0] = 0;
        good = ok && !zrun(c, 1, true, g, 1, false, 0, NULL, out, why, sizeof why) && strstr(why, victim) &&
               strstr(why, "does not cover");
        MPI_Comm_free(&c);
    }
    MPI_CHECK(good,
              "checkpoint/sharded optimizer state: a checkpoint missing a replica's piece is an error naming it on "
              "every rank",
              "%s (setting up: %d)", why, ok);
}

/* The tensor whose data ends the file. */
static void last_tensor(const char *path, char *out, size_t cap) {
    smp_ckpt_file *f;
    out[0] = 0;
    if (smp_ckpt_open(path, &f) != SMP_OK) return;
    uint64_t end = 0;
    for (int i = 0; i < smp_ckpt_count(f); i++) {
        const smp_ckpt_info *e = smp_ckpt_info_at(f, i);
        if (e->nbytes && e->offset + e->nbytes >= end) {
            end = e->offset + e->nbytes;
            snprintf(out, cap, "%s", e->name);
        }
    }
    smp_ckpt_close(f);
}

enum { C_FLIP, C_FLIP_PARTIAL, C_TRUNCATE, C_DTYPE, C_SHAPE, C_MISSING, C_UNEXPECTED, C_NO_OPTIM, C_MIXED,
       C_MIXED_LEGACY, C_MANIFEST, C_GEN_GONE, C_GEN_RESIZED, C_GEN_EDITED, C_COUNT };

static void test_corruption(int P) {
    static const char *labels[C_COUNT] = {"a flipped byte", "a flipped byte in a partial file", "a truncated file",
                                          "a wrong dtype", "a wrong shape", "a missing tensor", "an unexpected tensor",
                                          "missing optimizer state", "files of two saves mixed",
                                          "files of two saves mixed, saved before manifests", "a damaged manifest",
                                          "a file the manifest names is gone", "a committed file grew shorter",
                                          "a committed file's header was edited"};
    for (int c = 0; c < C_COUNT; c++) {
        int partial = c == C_FLIP_PARTIAL || c >= C_MIXED;
        if ((c == C_MIXED || c == C_MIXED_LEGACY) && P < 2) continue;
        char path[512], name[1000], tensor[720] = "", problem[64] = "";
        snprintf(path, sizeof path, "%s/corrupt_%d", dir, c);
        net n;
        smp_model *m = start(P, &n);
        opt_store o;
        opt_make(&o, m);
        set_all(m, &o, 5);
        smp_status st = save(m, c == C_NO_OPTIM ? NULL : &o, path, partial, 0);
        int ok = 1;
        char other[520], fa[700], fb[700];
        if (c == C_MIXED || c == C_MIXED_LEGACY) { /* a second save; its last file replaces the first's */
            snprintf(other, sizeof other, "%s_b", path);
            if (!st) st = save(m, &o, other, 1, 0);
            if (me == 0 && !st) {
                if (c == C_MIXED_LEGACY) ok = to_legacy(path, P) && to_legacy(other, P);
                ok = ok && part_file(other, P - 1, fa, sizeof fa) && part_file(path, P - 1, fb, sizeof fb) &&
                     rename(fa, fb) == 0;
            }
        }
        if (me == 0 && !st && ok) {
            char file[700];
            snprintf(file, sizeof file, "%s", path);
            if (partial) ok = part_file(path, c >= C_GEN_GONE ? 0 : P - 1, file, sizeof file);
            switch (c) {
            case C_FLIP: case C_FLIP_PARTIAL:
                snprintf(tensor, sizeof tensor, "head.weight"); /* on the last partition */
                snprintf(problem, sizeof problem, "checksum mismatch");
                ok = flip(file, tensor);
                break;
            case C_TRUNCATE:
                last_tensor(path, tensor, sizeof tensor);
                snprintf(problem, sizeof problem, "past the end");
                { struct stat sb; ok = stat(path, &sb) == 0 && truncate(path, sb.st_size - 1) == 0; }
                break;
            case C_DTYPE:
                snprintf(tensor, sizeof tensor, "fc1.bias");
                snprintf(problem, sizeof problem, "I32 [6] in the file but F32 [6]");
                ok = rewrite(path, NULL, tensor, SMP_I32, NULL, 0, NULL, NULL);
                break;
            case C_SHAPE: {
                int64_t s[2] = {3, 12};
                snprintf(tensor, sizeof tensor, "fc1.weight");
                snprintf(problem, sizeof problem, "F32 [3, 12] in the file but F32 [6, 6]");
                ok = rewrite(path, NULL, NULL, SMP_F32, tensor, 2, s, NULL);
                break;
            }
            case C_MISSING:
                snprintf(tensor, sizeof tensor, "fc2.bias");
                snprintf(problem, sizeof problem, "is missing");
                ok = rewrite(path, tensor, NULL, SMP_F32, NULL, 0, NULL, NULL);
                break;
            case C_UNEXPECTED:
                snprintf(tensor, sizeof tensor, "fc9.weight");
                snprintf(problem, sizeof problem, "unexpected");
                ok = rewrite(path, NULL, NULL, SMP_F32, NULL, 0, NULL, tensor);
                break;
            case C_NO_OPTIM:
                snprintf(tensor, sizeof tensor, "optimizer.");
                snprintf(problem, sizeof problem, "is missing");
                break;
            case C_MIXED:
                snprintf(tensor, sizeof tensor, "%s", fb);
                snprintf(problem, sizeof problem, "another save than the manifest");
                break;
            case C_MIXED_LEGACY:
                snprintf(tensor, sizeof tensor, "%s", fb);
                snprintf(problem, sizeof problem, "interrupted between files");
                break;
            case C_MANIFEST: {
                struct stat sb;
                snprintf(tensor, sizeof tensor, "%s.manifest", path);
                snprintf(problem, sizeof problem, "damaged or edited after the save");
                ok = ok && stat(tensor, &sb) == 0 && truncate(tensor, sb.st_size - 20) == 0;
                break;
            }
            case C_GEN_GONE:
                snprintf(tensor, sizeof tensor, "%s", file);
                snprintf(problem, sizeof problem, "must stay next to its manifest");
                ok = ok && remove(file) == 0;
                break;
            case C_GEN_RESIZED:
                snprintf(tensor, sizeof tensor, "%s", file);
                snprintf(problem, sizeof problem, "changed after the save committed it");
                ok = ok && rewrite_to(file, file, "note", NULL, NULL, SMP_F32, NULL, 0, NULL, NULL);
                break;
            case C_GEN_EDITED: { /* same size: an F32 tensor becomes I32 */
                char f32[200] = "";
                smp_ckpt_file *f;
                if (ok && smp_ckpt_open(file, &f) == SMP_OK) {
                    for (int i = 0; i < smp_ckpt_count(f) && !f32[0]; i++)
                        if (smp_ckpt_info_at(f, i)->dtype == SMP_F32)
                            snprintf(f32, sizeof f32, "%s", smp_ckpt_info_at(f, i)->name);
                    smp_ckpt_close(f);
                }
                snprintf(tensor, sizeof tensor, "%s", file);
                snprintf(problem, sizeof problem, "header's checksum");
                ok = ok && f32[0] && rewrite(file, NULL, f32, SMP_I32, NULL, 0, NULL, NULL);
                break;
            }
            }
        }
        MPI_Bcast(tensor, sizeof tensor, MPI_CHAR, 0, MPI_COMM_WORLD);
        MPI_Bcast(problem, sizeof problem, MPI_CHAR, 0, MPI_COMM_WORLD);
        snprintf(name, sizeof name,
                 "checkpoint/corruption/%s: an error naming '%s' on every rank, nothing changed (P=%d)", labels[c],
                 strrchr(tensor, '/') ? strrchr(tensor, '/') + 1 : tensor, P);
        if (st || !ok) { MPI_CHECK(0, name, "setting up: %s", smp_last_error()); opt_free(&o); stop(m); continue; }
        set_all(m, &o, 6);
        snapshot s = snap_take(m, &o);
        st = load(m, &o, path, partial, NULL);
        int good = st != SMP_OK && strstr(smp_last_error(), tensor) && strstr(smp_last_error(), problem);
        int same = snap_same(&s, m, &o);
        MPI_CHECK(good && same, name, "status %d, %s; message: %s", (int)st,
                  same ? "tensors unchanged" : "TENSORS CHANGED", smp_last_error());
        opt_free(&o);
        stop(m);
    }
}

/* ---------------------------------------------------------------- large tensors */
/* Tensors over the load's streaming-copy threshold (1 MiB), of a size that is
   no multiple of a cache line: they round-trip bitwise, and a flipped byte
   at the very end of the last one leaves every one of them unchanged. */
static smp_status big_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, x->dtype, x->ndim, x->shape);
    memcpy(y->data, x->data, smp_tensor_nbytes(x));
    return SMP_OK;
}
enum { NBIG = 4 };
typedef struct { smp_module *mods[NBIG]; } big_net;
static smp_status big_net_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m; (void)nin; (void)nout;
    big_net *n = (big_net *)user;
    smp_tensor a = in[0], b;
    for (int i = 0; i < NBIG; i++) {
        smp_status st = smp_call(n->mods[i], &a, 1, &b, 1);
        if (st) return st;
        a = b;
    }
    out[0] = a;
    return SMP_OK;
}
static void big_set(smp_model *m, int version) {
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(m, i, true)); i++)
        fill(smp_param_value(p)->data, smp_tensor_nbytes(smp_param_value(p)), SMP_F32, smp_param_name(p), version);
}
static int big_check(smp_model *m, int version, char *why, size_t cap) {
    smp_param *p;
    int ok = 1;
    for (int i = 0; (p = smp_model_local_param(m, i, true)) && ok; i++) {
        size_t k = smp_tensor_nbytes(smp_param_value(p));
        uint8_t *want = malloc(k);
        fill(want, k, SMP_F32, smp_param_name(p), version);
        if (memcmp(want, smp_param_value(p)->data, k)) {
            ok = 0;
            snprintf(why, cap, "'%s' differs from version %d", smp_param_name(p), version);
        }
        free(want);
    }
    return ok;
}

static void test_large(void) {
    int P = allowed(2) ? 2 : 1;
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.auto_partition = SMP_OFF;
    if (smp_init(&cfg) != SMP_OK) {
        MPI_CHECK(0, "checkpoint/large tensors", "smp_init: %s", smp_last_error());
        return;
    }
    big_net n;
    smp_module *root = smp_module_new(NULL, "", NULL);
    smp_module_desc d = {big_forward, NULL, NULL};
    for (int i = 0; i < NBIG; i++) {
        char nm[16];
        int64_t shape[2] = {257, 1021 + i}; /* 1,049,588 bytes and up */
        snprintf(nm, sizeof nm, "big%d", i);
        smp_partition_push(i * P / NBIG);
        n.mods[i] = smp_module_new(root, nm, &d);
        smp_param_new(n.mods[i], "weight", SMP_F32, 2, shape, NULL, NULL);
        smp_partition_pop();
    }
    smp_model *m = NULL;
    smp_model_desc md = {.forward = big_net_forward, .ninputs = 1, .noutputs = 1, .user = &n};
    float xin[4] = {1, 2, 3, 4};
    smp_tensor x = smp_tensor_2d(xin, SMP_F32, 1, 4);
    if (smp_model_new(root, &md, &m) != SMP_OK || smp_model_trace(m, &x, 1) != SMP_OK) {
        MPI_CHECK(0, "checkpoint/large tensors", "building the model: %s", smp_last_error());
        smp_finalize();
        return;
    }
    for (int partial = 0; partial < 2; partial++) {
        char path[512], name[200], why[256] = "";
        snprintf(path, sizeof path, "%s/large_%d", dir, partial);
        snprintf(name, sizeof name, "checkpoint/large tensors round-trip bitwise (%s, P=%d)",
                 partial ? "partial" : "full", P);
        big_set(m, 1);
        smp_status st = save(m, NULL, path, partial, 0);
        big_set(m, 2);
        if (!st) st = load(m, NULL, path, partial, NULL);
        int ok = !st && big_check(m, 1, why, sizeof why);
        MPI_CHECK(ok, name, "%s", st ? smp_last_error() : why);

        /* the last tensor of the last file, its last byte */
        snprintf(name, sizeof name, "checkpoint/large tensors: a flipped last byte changes none of them (%s, P=%d)",
                 partial ? "partial" : "full", P);
        char file[700], tensor[64] = "";
        snprintf(file, sizeof file, "%s", path);
        ok = 1;
        if (me == 0) {
            if (partial) ok = part_file(path, P - 1, file, sizeof file);
            last_tensor(file, tensor, sizeof tensor);
            struct stat sb;
            FILE *fp = fopen(file, "r+b");
            ok = ok && tensor[0] && fp && stat(file, &sb) == 0 && fseek(fp, (long)sb.st_size - 1, SEEK_SET) == 0;
            if (ok) {
                int c = fgetc(fp);
                ok = c != EOF && fseek(fp, (long)sb.st_size - 1, SEEK_SET) == 0 && fputc(c ^ 0x01, fp) != EOF;
            }
            if (fp) fclose(fp);
        }
        MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
        MPI_Bcast(tensor, sizeof tensor, MPI_CHAR, 0, MPI_COMM_WORLD);
        big_set(m, 3);
        st = ok ? load(m, NULL, path, partial, NULL) : SMP_ERR_IO;
        int good =
            ok && st != SMP_OK && strstr(smp_last_error(), "checksum mismatch") && strstr(smp_last_error(), tensor);
        int same = big_check(m, 3, why, sizeof why);
        MPI_CHECK(good && same, name, "status %d, %s; message: %s", (int)st, same ? "tensors unchanged" : why,
                  ok ? smp_last_error() : "could not flip the byte");
    }
    smp_model_free(m);
    smp_finalize();
}

/* ---------------------------------------------------------------- failed saves */
static int count_tmp(const char *prefix) {
    char cmd[900];
    snprintf(cmd, sizeof cmd, "ls -a '%s' | grep -c '^%s.*\\.tmp\\.' > '%s/count.txt'", dir, prefix, dir);
    if (system(cmd) == -1) return -1;
    snprintf(cmd, sizeof cmd, "%s/count.txt", dir);
    FILE *f = fopen(cmd, "r");
    int n = -1;
    if (f) {
        if (fscanf(f, "%d", &n) != 1) n = -1;
        fclose(f);
    }
    return n;
}

/* A save that fails on one rank fails on every rank, and leaves the
   previous checkpoint's files bitwise as they were, with no tmp files. */
static void test_failed_saves(void) {
    int P = allowed(2) ? 2 : 1;
    char path[512], why[4096] = "", name[200];
    net n;
    smp_model *m = start(P, &n);
    opt_store o;
    opt_make(&o, m);
    set_all(m, &o, 21);
    path_in(path, sizeof path, "saverr");
    smp_status st = save(m, &o, path, 1, 0);
    int ok = st == SMP_OK;
    char before[4096] = "", after[4096] = "";
    if (me == 0 && ok) {
        for (int k = -1; k < P; k++) {
            char f[700], cmd[1600];
            if (k < 0) snprintf(f, sizeof f, "%s.manifest", path);
            else if (!part_file(path, k, f, sizeof f)) ok = 0;
            snprintf(cmd, sizeof cmd, "cp '%s' '%s.copy'", f, f);
            if (system(cmd) != 0) ok = 0;
        }
        ckpt_files("saverr", before, sizeof before);
    }
    set_all(m, &o, 22);
    for (int phase = 0; phase < 2; phase++) {
        /* a saver that cannot open its file, then one that fails after
           every file is renamed into place: the manifest cannot be written */
        char mtmp[700];
        snprintf(mtmp, sizeof mtmp, "%s.manifest.tmp.%ld", path, (long)getpid());
        if (phase == 0 && smp_mp_rank() == P - 1 && smp_dp_rank() == 0) setenv("SMP_CKPT_FAULT", "bogus", 1);
        if (phase == 1 && me == 0) mkdir(mtmp, 0777); /* in the way of the manifest's tmp file */
        st = save(m, &o, path, 1, 0);
        unsetenv("SMP_CKPT_FAULT");
        if (phase == 1 && me == 0) rmdir(mtmp);
        int good =
            st != SMP_OK && strstr(smp_last_error(), phase ? "cannot create its manifest" : "SMP_CKPT_FAULT") != NULL;
        if (me == 0) {
            for (int k = -1; k < P && ok; k++) {
                char a[700], b[800];
                if (k < 0) snprintf(a, sizeof a, "%s.manifest", path);
                else if (!part_file(path, k, a, sizeof a)) {
                    ok = 0;
                    snprintf(why, sizeof why, "%s", smp_last_error());
                    break;
                }
                snprintf(b, sizeof b, "%s.copy", a);
                if (!same_bytes(a, b)) { ok = 0; snprintf(why, sizeof why, "%s changed", a); }
            }
            ckpt_files("saverr", after, sizeof after);
            if (ok && strcmp(before, after)) {
                ok = 0;
                snprintf(why, sizeof why, "the folder held '%.1900s', now '%.1900s'", before, after);
            }
        }
        snprintf(
            name, sizeof name,
            "checkpoint/a save failing on one rank %s fails on all, previous files intact, no new or tmp files (P=%d)",
            phase ? "after its files are renamed" : "before its file is written", P);
        MPI_CHECK(good && ok, name, "status %d (%.1500s); %.1500s", (int)st, smp_last_error(), why);
    }

    smp_load_desc ld = {0}; /* no optimizer: its state in the files is skipped */
    set_all(m, &o, 23);
    st = smp_load(m, path, &ld);
    ok = st == SMP_OK;
    if (ok) { /* parameters are back at 21, optimizer state untouched at 23 */
        opt_store none = o;
        none.n = 0;
        ok = check_all(m, &none, 21, why, sizeof why) && check_all(m, NULL, 21, why, sizeof why);
        for (int i = 0; i < o.n && ok; i++) {
            static uint8_t want[4096];
            fill(want, smp_tensor_nbytes(&o.t[i]), o.t[i].dtype, o.full[i], 23);
            if (memcmp(want, o.t[i].data, smp_tensor_nbytes(&o.t[i]))) {
                ok = 0;
                snprintf(why, sizeof why, "%s changed", o.full[i]);
            }
        }
    } else snprintf(why, sizeof why, "%s", smp_last_error());
    MPI_CHECK(ok, "checkpoint/a load without an optimizer skips the optimizer state", "%s", why);

    char dpath[512];
    path_in(dpath, sizeof dpath, "a_folder");
    if (me == 0) mkdir(dpath, 0777);
    MPI_Barrier(MPI_COMM_WORLD);
    st = save(m, &o, dpath, 0, 0);
    int good = st == SMP_ERR_IO && strstr(smp_last_error(), "a_folder") != NULL;
    ok = me != 0 || count_tmp("a_folder") == 0;
    MPI_CHECK(good && ok, "checkpoint/a full save onto a folder fails on every rank, no tmp file left", "status %d: %s",
              (int)st, smp_last_error());
    opt_free(&o);
    stop(m);
}

/* ---------------------------------------------------------------- misuse */
static void test_misuse(void) {
    net n;
    smp_config cfg = {0};
    cfg.ddp = world > 1 ? SMP_ON : SMP_OFF;
    smp_init(&cfg);
    smp_model *m = build_ckpt(&n);
    char path[512];
    path_in(path, sizeof path, "misuse");
    smp_status st = smp_save(m, path, NULL);
    MPI_CHECK(st == SMP_ERR_STATE && strstr(smp_last_error(), "not partitioned"),
              "checkpoint/saving an unpartitioned model is an error", "%d %s", st, smp_last_error());
    smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D);
    smp_model_trace(m, &x, 1);
    const char *k[] = {"smp.epoch"}, *v[] = {"1"};
    smp_save_desc d = {0};
    d.meta_keys = k;
    d.meta_values = v;
    d.nmeta = 1;
    st = smp_save(m, path, &d);
    MPI_CHECK(st == SMP_ERR_ARG && strstr(smp_last_error(), "smp.epoch"),
              "checkpoint/reserved metadata keys are an error", "%s", smp_last_error());
    st = smp_save(m, path, NULL); /* partial, the default */
    smp_load_desc ld = {0};
    ld.partial = SMP_OFF;
    st = st ? st : smp_load(m, path, &ld);
    MPI_CHECK(st != SMP_OK && strstr(smp_last_error(), "partial = SMP_ON"),
              "checkpoint/loading a partial checkpoint as full hints at partial", "%s", smp_last_error());
    char f0[700] = "";
    st = part_file(path, 0, f0, sizeof f0) ? smp_load(m, f0, &ld) : SMP_ERR_IO;
    MPI_CHECK(st == SMP_ERR_FORMAT && strstr(smp_last_error(), "partial = SMP_ON and the path without the \".g1_0\""),
              "checkpoint/loading one file of a partial checkpoint as full names the path to load", "%s",
              smp_last_error());
    ld.partial = SMP_ON;
    char nowhere[600];
    path_in(nowhere, sizeof nowhere, "no_such_checkpoint");
    st = smp_load(m, nowhere, &ld);
    MPI_CHECK(st == SMP_ERR_IO && strstr(smp_last_error(), "neither its manifest") &&
                  strstr(smp_last_error(), "no_such_checkpoint_0"),
              "checkpoint/loading a partial checkpoint that does not exist names both layouts it looked for", "%s",
              smp_last_error());
    ld.partial = SMP_OFF;
    smp_optimizer *o;
    smp_optimizer_new(m, &o);
    float z[36];
    smp_tensor t = smp_tensor_2d(z, SMP_F32, 6, 6);
    st = smp_optimizer_state_add(o, "nope.weight", "exp_avg", &t);
    int ok = st == SMP_ERR_ARG && strstr(smp_last_error(), "nope.weight");
    st = smp_optimizer_state_add(o, NULL, "a.b", &t);
    ok = ok && st == SMP_ERR_ARG && smp_optimizer_state_count(o) == 0;
    MPI_CHECK(ok, "checkpoint/optimizer registry rejects unknown parameters and dotted names, and counts none of them",
              "%s (%d registered)", smp_last_error(), smp_optimizer_state_count(o));
    st = smp_optimizer_state_add(o, NULL, "lr", &t);
    if (!st) st = smp_optimizer_state_add(o, NULL, "beta", &t);
    MPI_CHECK(st == SMP_OK && smp_optimizer_state_count(o) == 2, "checkpoint/optimizer registry counts what it holds",
              "%s, %d registered", st ? smp_last_error() : "ok", smp_optimizer_state_count(o));
    smp_optimizer_free(o);
    smp_model_free(m);
    smp_finalize();
}

int main(int argc, char **argv) {
    if (argc >= 4 && !strcmp(argv[1], "--child")) {
        MPI_Init(&argc, &argv);
        MPI_Comm_size(MPI_COMM_WORLD, &world);
        MPI_Comm_rank(MPI_COMM_WORLD, &me);
        uint64_t s = 99;
        for (int i = 0; i < B * D; i++) g_x[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
        int rc = child_main(argc, argv);
        MPI_Finalize();
        return rc;
    }
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    uint64_t s = 99;
    for (int i = 0; i < B * D; i++) g_x[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    if (me == 0) {
        snprintf(dir, sizeof dir, "%s/smp_ckpt_model.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
        if (!mkdtemp(dir)) dir[0] = 0;
    }
    MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (!dir[0]) {
        if (me == 0) printf("FAIL: test_checkpoint: cannot create a temporary folder\n");
        MPI_Finalize();
        return 1;
    }
    static const int Ps[3] = {1, 2, 4};
    for (int a = 0; a < 3; a++) {
        if (!allowed(Ps[a])) continue;
        test_roundtrip(Ps[a], 1, 0);
        test_roundtrip(Ps[a], 0, 0);
        test_roundtrip(Ps[a], 0, 40);
    }
    test_reshard();
    test_sharded();
    test_sharded_gaps();
    test_generations();
    test_python();
    test_killed_save(argv[0]);
    test_corruption(allowed(4) ? 4 : allowed(2) ? 2 : 1);
    if (world > 1) test_corruption(1); /* every rank a replica of one partition */
    test_failed_saves();
    test_misuse();
    test_large();
    int failed = test__failed_total, any;
    MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (me == 0) {
        char cmd[400];
        if (!any) {
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
            if (system(cmd) != 0) printf("(could not remove %s)\n", dir);
        } else {
            printf("(files kept in %s)\n", dir);
        }
    }
    int rc = test_exit_code();
    MPI_Finalize();
    return rc;
}
