/* test_ckpt_nomem.c - out of memory anywhere in a checkpoint save or load.

   The program replaces smp's allocator hooks (SMP_MALLOC / SMP_FREE, which
   every allocation of smp.h and smp_checkpoint.h goes through) with one that
   counts allocations and makes the k-th one, on one chosen rank, return
   NULL. For each operation (a partial save, a full save, a partial load, a
   full load, all with optimizer state registered, one state with a name long
   enough to take the load's long-key path) and each rank in turn, it sweeps
   k over every allocation that call makes on that rank (the sweep ends at
   the first k the call does not reach) and checks, for every k:
   - the call returns an error on every rank: SMP_ERR_NOMEM on the failing
     rank with a message naming the bytes and what they were for ("out of
     memory: N bytes for WHAT on rank R"), credited to no other rank, and
     SMP_ERR_NOMEM or SMP_ERR_REMOTE on the others with that message after
     "rank R: " (once);
   - no crash and no hang (smp's timeout is 60 s here, so a hang aborts);
   - every block the call allocated is freed (the hook counts live blocks);
   - a save leaves the folder as it was: the previous checkpoint's files
     byte for byte, no new generation, no tmp file under its name; and the
     previous checkpoint loads, bitwise (an actual load after every 8th);
   - a load changes no parameter, buffer or optimizer state on any rank.
   The one exception is an allocation of a partial save after its commit (the
   removal of the generation it replaced, which is best effort): the save
   has succeeded, so it returns SMP_OK on every rank with one warning on the
   failing one, the new checkpoint loads bitwise, and the next save leaves
   only the manifest and its files. The hook tells the two apart by whether
   the manifest had been replaced when the allocation failed. The last call
   of a sweep, which no failure reaches, must succeed and do its work. A k
   that goes wrong is counted and the sweep goes on from a fresh copy of the
   previous checkpoint; the check prints the count and the first reason. It
   prints how many allocation points each sweep covered.

   Partitions: 1 at one rank, 2 at two ranks, 2 x 2 data-parallel replicas at
   four ranks.

   Build and run from the repository root:
     mpicc -std=c11 -Wall -Wextra -Werror -g -I. -Itest test/test_ckpt_nomem.c -o /tmp/tn -lm
     mpirun -n 4 /tmp/tn
*/
#define _POSIX_C_SOURCE 200809L /* mkdtemp, posix_memalign */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---------------------------------------------------------------- the failing allocator */
static atomic_long g_count;       /* allocations since the hook was armed */
static atomic_long g_live;        /* blocks allocated and not yet freed */
static long g_fail_at = -1;       /* the allocation that fails; -1: none */
static int g_fired;               /* it did */
static char g_watch[700];         /* the file whose replacement commits the save */
static ino_t g_watch_ino;         /* its inode before the call (0: absent) */
static int g_fired_committed;     /* the watched file had been replaced when the allocation failed */

static ino_t inode_of(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 ? sb.st_ino : 0;
}

/* Blocks are 64-byte aligned, so smp's own aligning allocator takes exactly
   one block per allocation and the count does not depend on where malloc
   happens to put things. */
static void *test_malloc(size_t n) {
    long k = atomic_fetch_add(&g_count, 1);
    void *p;
    if (k == g_fail_at) {
        g_fired = 1;
        g_fired_committed = g_watch[0] && inode_of(g_watch) != g_watch_ino;
        return NULL;
    }
    if (posix_memalign(&p, 64, n + 64) != 0) return NULL;
    atomic_fetch_add(&g_live, 1);
    return (char *)p + 64;
}
static void test_free(void *p) {
    if (!p) return;
    atomic_fetch_sub(&g_live, 1);
    free((char *)p - 64);
}
#define SMP_MALLOC(n) test_malloc(n)
#define SMP_FREE(p) test_free(p)

#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_checkpoint.h"
#include "test.h"
#include "net7.h"

#include <dirent.h>

static int world, me;
static char dir[256];
static int g_warnings; /* smp's warnings since the last call */
static void logger(smp_log_level level, const char *msg, void *user) {
    (void)user;
    if (level == SMP_LOG_WARN) g_warnings++;
    if (level >= SMP_LOG_ERROR) fprintf(stderr, "smp: %s\n", msg);
}
static float g_x[B * D];

/* ---------------------------------------------------------------- the model, its optimizer state and values */
static smp_model *build_model(net *n) {
    net_modules(n, NULL, &net_host_fns);
    int64_t s6[1] = {6}, s3[1] = {3};
    smp_buffer_new(n->lin[0], "num_batches", SMP_I64, 0, NULL, NULL, NULL);
    smp_buffer_new(n->lin[2], "running_mean", SMP_F64, 1, s6, NULL, NULL);
    smp_buffer_new(n->lin[3], "mask", SMP_U8, 1, s3, NULL, NULL);
    return net_model(n, false);
}

static uint64_t mix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static void fill(void *p, size_t n, const char *name, int version) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *c = (const unsigned char *)name; *c; c++) h = (h ^ *c) * 0x100000001b3ull;
    h ^= (uint64_t)version * 0x51ed27ull;
    for (size_t k = 0; k < n; k++) ((uint8_t *)p)[k] = (uint8_t)mix(&h);
}

/* An exp_avg per local parameter, and for the optimizer as a whole a step
   count and a state whose file key "smp.partition.optimizer.<name>" is
   longer than the load's stack buffer for it. */
#define LONG_STATE "a_state_name_long_enough_that_its_partition_key_needs_the_heap"
typedef struct { int n; char full[24][128]; smp_tensor t[24]; smp_optimizer *reg; } opt_store;

static void opt_make(opt_store *o, smp_model *m) {
    memset(o, 0, sizeof *o);
    smp_optimizer_new(m, &o->reg);
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(m, i, false)); i++) {
        const smp_tensor *v = smp_param_value(p);
        o->t[o->n] = smp_tensor_make(malloc(smp_tensor_nbytes(v)), SMP_F32, v->ndim, v->shape);
        smp_optimizer_state_add(o->reg, smp_param_name(p), "exp_avg", &o->t[o->n]);
        snprintf(o->full[o->n++], 128, "optimizer.%s.exp_avg", smp_param_name(p));
    }
    o->t[o->n] = smp_tensor_make(malloc(8), SMP_I64, 0, NULL);
    smp_optimizer_state_add(o->reg, NULL, "step", &o->t[o->n]);
    snprintf(o->full[o->n++], 128, "optimizer.step");
    int64_t two = 2;
    o->t[o->n] = smp_tensor_make(malloc(8), SMP_F32, 1, &two);
    smp_optimizer_state_add(o->reg, NULL, LONG_STATE, &o->t[o->n]);
    snprintf(o->full[o->n++], 128, "optimizer." LONG_STATE);
}
static void opt_free(opt_store *o) {
    for (int i = 0; i < o->n; i++) free(o->t[i].data);
    smp_optimizer_free(o->reg);
}

static void set_all(smp_model *m, opt_store *o, int version) {
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(m, i, true)); i++) {
        smp_tensor *v = smp_param_value(p);
        fill(v->data, smp_tensor_nbytes(v), smp_param_name(p), version);
    }
    for (int i = 0; i < o->n; i++) fill(o->t[i].data, smp_tensor_nbytes(&o->t[i]), o->full[i], version);
}
static int check_all(smp_model *m, opt_store *o, int version, char *why, size_t cap) {
    static uint8_t want[4096];
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(m, i, true)); i++) {
        smp_tensor *v = smp_param_value(p);
        fill(want, smp_tensor_nbytes(v), smp_param_name(p), version);
        if (memcmp(want, v->data, smp_tensor_nbytes(v))) {
            snprintf(why, cap, "'%s' differs from version %d", smp_param_name(p), version);
            return 0;
        }
    }
    for (int i = 0; i < o->n; i++) {
        fill(want, smp_tensor_nbytes(&o->t[i]), o->full[i], version);
        if (memcmp(want, o->t[i].data, smp_tensor_nbytes(&o->t[i]))) {
            snprintf(why, cap, "'%s' differs from version %d", o->full[i], version);
            return 0;
        }
    }
    return 1;
}

/* ---------------------------------------------------------------- the checkpoint's files */
/* Every file of checkpoint `name` in the folder (the name itself, or the
   name continued by '.' or '_'), with its bytes. */
typedef struct { int n; char name[64][256]; uint8_t *bytes[64]; size_t len[64]; } folder;

static void folder_free(folder *f) {
    for (int i = 0; i < f->n; i++) free(f->bytes[i]);
    f->n = 0;
}
static int cmp_name(const void *a, const void *b) { return strcmp((const char *)a, (const char *)b); }
static void folder_read(folder *f, const char *name) {
    DIR *d = opendir(dir);
    struct dirent *de;
    size_t len = strlen(name);
    f->n = 0;
    while (d && (de = readdir(d)) && f->n < 64)
        if (!strncmp(de->d_name, name, len) && (!de->d_name[len] || de->d_name[len] == '.' || de->d_name[len] == '_'))
            snprintf(f->name[f->n++], sizeof f->name[0], "%s", de->d_name);
    if (d) closedir(d);
    qsort(f->name, (size_t)f->n, sizeof f->name[0], cmp_name);
    for (int i = 0; i < f->n; i++) {
        char path[600];
        snprintf(path, sizeof path, "%s/%s", dir, f->name[i]);
        FILE *fp = fopen(path, "rb");
        f->bytes[i] = NULL;
        f->len[i] = 0;
        if (!fp) continue;
        fseek(fp, 0, SEEK_END);
        long sz = ftell(fp);
        fseek(fp, 0, SEEK_SET);
        f->bytes[i] = malloc(sz > 0 ? (size_t)sz : 1);
        f->len[i] = fread(f->bytes[i], 1, sz > 0 ? (size_t)sz : 0, fp);
        fclose(fp);
    }
}
/* Whether the folder holds exactly `was`, byte for byte; says what differs. */
static int folder_same(const folder *was, const char *name, char *why, size_t cap) {
    folder now;
    int same = 1;
    folder_read(&now, name);
    if (now.n != was->n) same = 0;
    for (int i = 0; i < now.n && same; i++)
        if (strcmp(now.name[i], was->name[i]) || now.len[i] != was->len[i] ||
            memcmp(now.bytes[i], was->bytes[i], now.len[i]))
            same = 0;
    if (!same) {
        size_t at = (size_t)snprintf(why, cap, "the folder held");
        for (int i = 0; i < was->n && at < cap; i++) at += (size_t)snprintf(why + at, cap - at, " %s", was->name[i]);
        if (at < cap) at += (size_t)snprintf(why + at, cap - at, "; now (some changed)");
        for (int i = 0; i < now.n && at < cap; i++) at += (size_t)snprintf(why + at, cap - at, " %s", now.name[i]);
    }
    folder_free(&now);
    return same;
}
static int folder_has_tmp(const char *name) {
    folder now;
    int tmp = 0;
    folder_read(&now, name);
    for (int i = 0; i < now.n; i++)
        if (strstr(now.name[i], ".tmp.")) tmp = 1;
    folder_free(&now);
    return tmp;
}

/* ---------------------------------------------------------------- messages */
/* Whether msg holds "out of memory: <digits> bytes for <what> on rank <rank>". */
static int names_bytes_and_purpose(const char *msg, int rank) {
    const char *p = strstr(msg, "out of memory: ");
    if (!p) return 0;
    p += strlen("out of memory: ");
    if (*p < '0' || *p > '9') return 0;
    while (*p >= '0' && *p <= '9') p++;
    if (strncmp(p, " bytes for ", 11)) return 0;
    p += 11;
    char tail[32];
    snprintf(tail, sizeof tail, " on rank %d", rank);
    const char *q = strstr(p, tail);
    return q && q - p >= 4; /* a purpose of a few words */
}

/* ---------------------------------------------------------------- the sweep */
enum { OP_SAVE_PARTIAL, OP_SAVE_FULL, OP_LOAD_PARTIAL, OP_LOAD_FULL, OP_COUNT };
static const char *const op_names[OP_COUNT] = {"partial save", "full save", "partial load", "full load"};

static smp_status do_save(smp_model *m, opt_store *o, const char *path, int partial) {
    static const char *keys[] = {"epoch"}, *vals[] = {"3"};
    smp_save_desc d = {0};
    d.partial = partial ? SMP_ON : SMP_OFF;
    d.optimizer = o->reg;
    d.meta_keys = keys;
    d.meta_values = vals;
    d.nmeta = 1;
    d.chunk_bytes = 64; /* several chunks per tensor in a full save */
    return smp_save(m, path, &d);
}
static smp_status do_load(smp_model *m, opt_store *o, const char *path, int partial) {
    smp_load_desc d = {0};
    d.partial = partial ? SMP_ON : SMP_OFF;
    d.optimizer = o->reg;
    return smp_load(m, path, &d);
}

/* A copy of every local tensor's bytes. */
typedef struct { uint8_t bytes[1 << 14]; size_t n; } snapshot;
static void snap_take(snapshot *s, smp_model *m, opt_store *o) {
    smp_param *p;
    s->n = 0;
    for (int i = 0; (p = smp_model_local_param(m, i, true)); i++) {
        size_t k = smp_tensor_nbytes(smp_param_value(p));
        memcpy(s->bytes + s->n, smp_param_value(p)->data, k);
        s->n += k;
    }
    for (int i = 0; i < o->n; i++) {
        size_t k = smp_tensor_nbytes(&o->t[i]);
        memcpy(s->bytes + s->n, o->t[i].data, k);
        s->n += k;
    }
}

enum { V_OLD = 1, V_NEW = 2, V_LOAD = 3 };

/* Sweeps the allocations of operation `op` on rank `r`; returns how many
   the call makes there (the allocation points covered). */
static long sweep(smp_model *m, opt_store *o, int P, int op, int r, long *committed_points) {
    int partial = op == OP_SAVE_PARTIAL || op == OP_LOAD_PARTIAL, saving = op <= OP_SAVE_FULL;
    char name[64], path[512], why[4096] = "", msg[2048];
    static snapshot before, after;
    folder base;
    int ok = 1, nbad = 0;
    long k, points = -1;
    static char first_bad[4096];
    first_bad[0] = 0;
    snprintf(name, sizeof name, "%s_%s", partial ? "part" : "full", saving ? "save" : "load");
    snprintf(path, sizeof path, "%s/%s", dir, name);
    /* the previous checkpoint */
    set_all(m, o, V_OLD);
    if (do_save(m, o, path, partial) != SMP_OK) {
        MPI_CHECK(0, "ckpt_nomem/baseline save", "%s", smp_last_error());
        return 0;
    }
    if (me == 0) folder_read(&base, name);
    *committed_points = 0;
    for (k = 0; k < 100000 && ok; k++) {
        set_all(m, o, saving ? V_NEW : V_LOAD);
        snap_take(&before, m, o);
        if (partial) snprintf(g_watch, sizeof g_watch, "%s.manifest", path);
        else snprintf(g_watch, sizeof g_watch, "%s", path);
        g_watch_ino = inode_of(g_watch);
        long live0 = atomic_load(&g_live);
        g_fired = g_fired_committed = g_warnings = 0;
        atomic_store(&g_count, 0);
        g_fail_at = me == r ? k : -1;
        smp_status st = saving ? do_save(m, o, path, partial) : do_load(m, o, path, partial);
        g_fail_at = -1;
        long made = atomic_load(&g_count);
        int fired[2] = {g_fired, g_fired_committed};
        snprintf(msg, sizeof msg, "%s", smp_last_error());
        MPI_Bcast(fired, 2, MPI_INT, r, MPI_COMM_WORLD);
        int good = 1;
        char mine[4096] = "";
        if (atomic_load(&g_live) != live0) {
            good = 0;
            snprintf(mine, sizeof mine, "allocation %ld failing on rank %d: %ld blocks allocated during the call are "
                     "not freed here", k, r, atomic_load(&g_live) - live0);
        }
        if (!fired[0]) { /* past the last allocation: a plain successful call */
            if (good && st != SMP_OK) {
                good = 0;
                snprintf(mine, sizeof mine, "with no allocation failing, status %d: %.1800s", (int)st, msg);
            }
            if (me == r) points = made;
        } else if (fired[1]) { /* after the commit: the save stands, with a warning */
            if (good && st != SMP_OK) {
                good = 0;
                snprintf(mine, sizeof mine, "allocation %ld fails after the commit: status %d (%.1800s), not SMP_OK", k,
                         (int)st, msg);
            } else if (good && me == r && g_warnings != 1) {
                good = 0;
                snprintf(mine, sizeof mine, "allocation %ld fails after the commit: %d warnings, not 1", k, g_warnings);
            }
        } else if (good) {
            if (me == r && (st != SMP_ERR_NOMEM || !names_bytes_and_purpose(msg, r) || !strncmp(msg, "rank ", 5))) {
                good = 0;
                snprintf(mine, sizeof mine,
                         "allocation %ld fails here: status %d, message '%.1800s' (want SMP_ERR_NOMEM naming the bytes "
                         "and their purpose, credited to no other rank)", k, (int)st, msg);
            } else if (me != r) {
                char prefix[32];
                snprintf(prefix, sizeof prefix, "rank %d: ", r);
                if ((st != SMP_ERR_NOMEM && st != SMP_ERR_REMOTE) || strncmp(msg, prefix, strlen(prefix)) ||
                    !strncmp(msg + strlen(prefix), "rank ", 5) || !names_bytes_and_purpose(msg, r)) {
                    good = 0;
                    snprintf(mine, sizeof mine,
                             "allocation %ld fails on rank %d: here status %d, message '%.1800s' (want SMP_ERR_NOMEM "
                             "or SMP_ERR_REMOTE, '%s' once and rank %d's message)", k, r, (int)st, msg, prefix, r);
                }
            }
        }
        /* a load changes nothing unless it succeeds; a save never does */
        snap_take(&after, m, o);
        int unchanged = before.n == after.n && !memcmp(before.bytes, after.bytes, before.n);
        if (good && st != SMP_OK && !unchanged) {
            good = 0;
            snprintf(mine, sizeof mine, "allocation %ld fails on rank %d: the failed %s changed this rank's tensors", k,
                     r, op_names[op]);
        }
        if (good && st == SMP_OK && !saving && !check_all(m, o, V_OLD, why, sizeof why)) {
            good = 0;
            snprintf(mine, sizeof mine, "the load succeeded but %.1800s", why);
        }
        /* the folder: as it was after a failure; after a commit, the new
           checkpoint, no tmp file, and a clean save restores the old one */
        if (good && me == 0 && saving) {
            if (st != SMP_OK && !folder_same(&base, name, why, sizeof why)) {
                good = 0;
                snprintf(mine, sizeof mine, "allocation %ld fails on rank %d: %.3000s", k, r, why);
            } else if (st == SMP_OK && folder_has_tmp(name)) {
                good = 0;
                snprintf(mine, sizeof mine, "allocation %ld fails on rank %d: a tmp file is left", k, r);
            }
        }
        /* a failed save: the previous checkpoint still loads, bitwise (its
           files are the same bytes after every failure, checked above; an
           actual load every 8th) */
        if (fired[0] && !fired[1] && saving && k % 8 == 0) {
            set_all(m, o, V_LOAD);
            smp_status ls = do_load(m, o, path, partial);
            if (good && (ls != SMP_OK || !check_all(m, o, V_OLD, why, sizeof why))) {
                good = 0;
                snprintf(mine, sizeof mine, "allocation %ld failed on rank %d, then the previous checkpoint: %.1800s",
                         k, r, ls ? smp_last_error() : why);
            }
        }
        int all_good;
        MPI_Allreduce(&good, &all_good, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
        if (!all_good) { /* count it, keep the first reason, start again from the previous checkpoint */
            nbad++;
            if (!good && !first_bad[0]) snprintf(first_bad, sizeof first_bad, "%s", mine);
            set_all(m, o, V_OLD);
            int bok = do_save(m, o, path, partial) == SMP_OK, all;
            MPI_Allreduce(&bok, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
            if (!all) {
                ok = 0;
                MPI_CHECK(bok, "ckpt_nomem/a clean save after a failure", "%s", smp_last_error());
                break;
            }
            if (me == 0) {
                folder_free(&base);
                folder_read(&base, name);
            }
            if (!fired[0]) break;
            continue;
        }
        if (!fired[0]) break;
        if (st == SMP_OK && saving) { /* committed: check it, then put the old one back */
            (*committed_points)++;
            set_all(m, o, V_LOAD);
            int lok = do_load(m, o, path, partial) == SMP_OK && check_all(m, o, V_NEW, why, sizeof why);
            set_all(m, o, V_OLD);
            lok = do_save(m, o, path, partial) == SMP_OK && lok;
            int all;
            MPI_Allreduce(&lok, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
            if (!all) {
                ok = 0;
                MPI_CHECK(lok, "ckpt_nomem/a save whose allocation after the commit fails stands", "%s: %s",
                          op_names[op], smp_last_error());
                break;
            }
            if (me == 0) {
                folder_free(&base);
                folder_read(&base, name);
                int want = partial ? P + 1 : 1; /* the manifest and P files, or the one file */
                if (base.n != want) {
                    ok = 0;
                    snprintf(why, sizeof why, "after the next save the folder holds %d files, not %d", base.n, want);
                }
            }
            MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
            if (!ok) {
                MPI_CHECK(0, "ckpt_nomem/the next save removes what a save failing after its commit left", "%s", why);
                break;
            }
        }
    }
    MPI_Bcast(&points, 1, MPI_LONG, r, MPI_COMM_WORLD);
    if (ok) { /* the last call, which no failure reached, did its work */
        set_all(m, o, V_LOAD);
        smp_status st = do_load(m, o, path, partial);
        int lok = st == SMP_OK && check_all(m, o, saving ? V_NEW : V_OLD, why, sizeof why);
        char nm[200];
        snprintf(nm, sizeof nm,
                 "ckpt_nomem/%s (P=%d): each of its %ld allocations on rank %d failing is an error on every rank, "
                 "nothing leaks or changes, the previous checkpoint loads bitwise",
                 op_names[op], P, points, r);
        if (nbad) {
            MPI_CHECK(!first_bad[0], nm, "%d of the allocations go wrong; the first here: %.3900s", nbad, first_bad);
        } else {
            MPI_CHECK(lok && points > 0, nm, "%s", st ? smp_last_error() : lok ? "no allocation counted" : why);
        }
    }
    if (me == 0) folder_free(&base);
    g_watch[0] = 0;
    return ok ? points : -1;
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    uint64_t s = 99;
    for (int i = 0; i < B * D; i++) g_x[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    if (me == 0) {
        snprintf(dir, sizeof dir, "%s/smp_ckpt_nomem.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
        if (!mkdtemp(dir)) dir[0] = 0;
    }
    MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (!dir[0]) {
        if (me == 0) printf("FAIL: test_ckpt_nomem: cannot create a temporary folder\n");
        MPI_Finalize();
        return 1;
    }
    int P = world >= 2 ? 2 : 1;
    smp_config cfg = {0};
    cfg.partitions = P;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.seed = 11;
    cfg.timeout = 60; /* a hang ends the job within a minute */
    net n;
    smp_model *m = NULL;
    smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D);
    smp_set_logger(logger, NULL);
    if (smp_init(&cfg) != SMP_OK || !(m = build_model(&n)) || smp_model_trace(m, &x, 1) != SMP_OK) {
        if (me == 0) printf("FAIL: test_ckpt_nomem: set-up: %s\n", smp_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    opt_store o;
    opt_make(&o, m);
    long total = 0, committed_total = 0;
    char counts[1024] = "";
    for (int op = 0; op < OP_COUNT; op++) {
        size_t at = strlen(counts);
        snprintf(counts + at, sizeof counts - at, "%s%s:", op ? "; " : "", op_names[op]);
        for (int r = 0; r < world; r++) {
            long committed = 0, points = sweep(m, &o, P, op, r, &committed);
            at = strlen(counts);
            snprintf(counts + at, sizeof counts - at, " %ld", points);
            if (committed) {
                at = strlen(counts);
                snprintf(counts + at, sizeof counts - at, " (%ld after the commit)", committed);
            }
            if (points > 0) total += points;
            committed_total += committed;
        }
    }
    if (me == 0)
        printf("allocation points swept at %d ranks (per operation, per rank): %s; %ld in all, %ld of them after a "
               "commit\n", world, counts, total, committed_total);
    opt_free(&o);
    smp_model_free(m);
    smp_finalize();
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
