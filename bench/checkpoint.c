/* bench/checkpoint.c - smp_save / smp_load against plain write/fsync/read.

   A 256 MiB model (8 modules of one 32 MiB f32 weight, 4 on each of 2
   partitions) is saved and loaded, partial and full,
   and the same bytes are written and read with plain POSIX calls in the same
   run, interleaved, on the same disk:

     partial save   smp: each rank writes "<path>.g<N>_<mp>" (its 128 MiB),
                    rank 0 commits them with the manifest "<path>.manifest",
                    then each rank removes its file of the previous save,
                    raw: each rank write()s its 128 MiB to its own file, fsync
     full save      smp: rank 0 writes one 256 MiB file, half of it streamed
                    from rank 1 in 4 MiB chunks; raw: rank 0 write()s 256 MiB
                    from memory, fsync
     partial load   smp: each rank loads its partition from its file (header,
                    name/dtype/shape checks, checksums, copy);
                    raw: each rank read()s its 128 MiB file
     full load      smp: each rank loads its half from the 256 MiB file;
                    raw: each rank pread()s its 128 MiB half of a 256 MiB file

   Each figure is the best of REPS runs (the disk is shared with other
   work); a phase's time is the slowest rank's. Loads read files that were
   just written, from the page cache, on both sides, into memory that was
   touched before (the model's parameters; the raw side's buffer). The
   loads run once more "cold": every rank first drops the files from the
   page cache (posix_fadvise DONTNEED; the files were fsynced, so their
   pages are clean), so both sides read from the disk, as a job that
   restarts from a checkpoint does.

   Build and run: make bench-checkpoint  (mpirun -n 2 build/bench/checkpoint)
   Files go to $SMP_BENCH_DIR or /tmp. The last three lines are the worst
   ratio of smp's throughput to raw over the cold loads, over the loads from
   the page cache, then over the saves (the last line). A verified load reads every byte twice (checksum pass, then
   copy) where a plain read() copies once; see the notes in smp_checkpoint.h. */
#define _POSIX_C_SOURCE 200809L
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { NMOD = 8, REPS = 5 };
static const int64_t ROWS = 2048, COLS = 4096; /* 32 MiB of f32 per module */

static smp_status pass_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, x->dtype, x->ndim, x->shape);
    memcpy(y->data, x->data, smp_tensor_nbytes(x));
    return SMP_OK;
}

typedef struct { smp_module *mods[NMOD]; } net;

static smp_status net_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m; (void)nin; (void)nout;
    net *n = (net *)user;
    smp_tensor a = in[0], b;
    for (int i = 0; i < NMOD; i++) {
        smp_status st = smp_call(n->mods[i], &a, 1, &b, 1);
        if (st) return st;
        a = b;
    }
    out[0] = a;
    return SMP_OK;
}

static double now(void) { return MPI_Wtime(); }

/* Runs fn on every rank between barriers; returns the slowest rank's seconds. */
#define TIMED(secs, ...)                                                                  \
    do {                                                                                  \
        MPI_Barrier(MPI_COMM_WORLD);                                                      \
        double t0__ = now();                                                              \
        __VA_ARGS__;                                                                      \
        double t1__ = now() - t0__;                                                       \
        MPI_Allreduce(&t1__, &(secs), 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);            \
    } while (0)

static void die(const char *what) {
    fprintf(stderr, "bench/checkpoint: %s: %s\n", what, smp_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static void raw_write(const char *path, const void *buf, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const char *p = (const char *)buf;
    if (fd < 0) die("raw open");
    while (n) {
        ssize_t k = write(fd, p, n);
        if (k <= 0) die("raw write");
        p += k;
        n -= (size_t)k;
    }
    if (fsync(fd) != 0) die("raw fsync");
    close(fd);
}

/* The file leaves the page cache, so the next read comes from the disk. */
static void drop_cached(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) die("open to drop from the page cache");
    if (posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) die("posix_fadvise");
    close(fd);
}

static void raw_read(const char *path, void *buf, size_t n, off_t off) {
    int fd = open(path, O_RDONLY);
    char *p = (char *)buf;
    if (fd < 0) die("raw open for reading");
    while (n) {
        ssize_t k = pread(fd, p, n, off);
        if (k <= 0) die("raw read");
        p += k;
        n -= (size_t)k;
        off += k;
    }
    close(fd);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    smp_config cfg = {0};
    int world;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    cfg.partitions = world >= 2 ? 2 : 1;
    cfg.ddp = world > cfg.partitions ? SMP_ON : SMP_OFF;
    cfg.auto_partition = SMP_OFF; /* an exact half per partition: modules 0-3 and 4-7 */
    if (smp_init(&cfg) != SMP_OK) die("smp_init");
    int me = smp_rank();

    net n;
    smp_module *root = smp_module_new(NULL, "", NULL);
    smp_module_desc d = {pass_forward, NULL, NULL};
    for (int i = 0; i < NMOD; i++) {
        char name[16];
        int64_t shape[2] = {ROWS, COLS};
        snprintf(name, sizeof name, "layer%d", i);
        smp_partition_push(i * cfg.partitions / NMOD);
        n.mods[i] = smp_module_new(root, name, &d);
        smp_param_new(n.mods[i], "weight", SMP_F32, 2, shape, NULL, NULL);
        smp_partition_pop();
    }
    smp_model *model;
    smp_model_desc md = {net_forward, 1, 1, &n, false};
    if (smp_model_new(root, &md, &model) != SMP_OK) die("smp_model_new");
    float xin[4] = {1, 2, 3, 4};
    smp_tensor x = smp_tensor_2d(xin, SMP_F32, 1, 4);
    if (smp_model_trace(model, &x, 1) != SMP_OK) die("smp_model_trace");

    /* fill the local weights; the raw side writes the same bytes */
    size_t local = 0;
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
        smp_tensor *v = smp_param_value(p);
        uint64_t s = 1234 + (uint64_t)i * 7 + (uint64_t)me;
        float *f = (float *)v->data;
        for (int64_t k = 0; k < smp_tensor_numel(v); k++) f[k] = (float)smp_rng_uniform(&s);
        local += smp_tensor_nbytes(v);
    }
    size_t total = (size_t)NMOD * (size_t)(ROWS * COLS) * 4;
    char *mine = (char *)malloc(local), *big = me == 0 ? (char *)malloc(total) : NULL, *rbuf = (char *)malloc(local);
    if (!mine || (me == 0 && !big) || !rbuf) die("out of memory");
    /* the parameters are touched; so is the raw read's buffer, or the first
       raw read would also pay for faulting in fresh pages */
    memset(rbuf, 0, local);
    {
        size_t at = 0;
        for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
            memcpy(mine + at, smp_param_value(p)->data, smp_tensor_nbytes(smp_param_value(p)));
            at += smp_tensor_nbytes(smp_param_value(p));
        }
        if (me == 0)
            for (size_t k = 0; k < total; k++) big[k] = mine[k % local];
    }

    char base[512], smp_path[600], raw_mine[600], raw_full[600];
    const char *bdir = getenv("SMP_BENCH_DIR") ? getenv("SMP_BENCH_DIR") : "/tmp";
    snprintf(base, sizeof base, "%s/smp_bench_ckpt_%d", bdir, (int)getppid());
    snprintf(smp_path, sizeof smp_path, "%s_model", base);
    snprintf(raw_mine, sizeof raw_mine, "%s_raw_%d", base, me);
    snprintf(raw_full, sizeof raw_full, "%s_raw_full", base);

    /* best of REPS, raw and smp interleaved */
    enum { NOPS = 6 };
    double best[NOPS][2];
    for (int k = 0; k < NOPS; k++) best[k][0] = best[k][1] = 1e30;
    char smp_mine[800];
    smp_save_desc sd = {0};
    smp_load_desc ld = {0};
    for (int r = 0; r < REPS; r++) {
        double t;
        /* partial save */
        TIMED(t, raw_write(raw_mine, mine, local));
        if (t < best[0][0]) best[0][0] = t;
        sd.partial = SMP_ON;
        TIMED(t, if (smp_save(model, smp_path, &sd) != SMP_OK) die("partial save"));
        if (t < best[0][1]) best[0][1] = t;
        /* full save */
        TIMED(t, if (me == 0) raw_write(raw_full, big, total));
        if (t < best[1][0]) best[1][0] = t;
        sd.partial = SMP_OFF;
        TIMED(t, if (smp_save(model, smp_path, &sd) != SMP_OK) die("full save"));
        if (t < best[1][1]) best[1][1] = t;
        /* partial load */
        TIMED(t, raw_read(raw_mine, rbuf, local, 0));
        if (t < best[2][0]) best[2][0] = t;
        ld.partial = SMP_ON;
        TIMED(t, if (smp_load(model, smp_path, &ld) != SMP_OK) die("partial load"));
        if (t < best[2][1]) best[2][1] = t;
        /* full load */
        TIMED(t, raw_read(raw_full, rbuf, local, (off_t)(smp_mp_rank() * local)));
        if (t < best[3][0]) best[3][0] = t;
        ld.partial = SMP_OFF;
        TIMED(t, if (smp_load(model, smp_path, &ld) != SMP_OK) die("full load"));
        if (t < best[3][1]) best[3][1] = t;
        /* the same loads from the disk */
        drop_cached(raw_mine);
        TIMED(t, raw_read(raw_mine, rbuf, local, 0));
        if (t < best[4][0]) best[4][0] = t;
        if (smp_ckpt_partial_file(smp_path, smp_mp_rank(), smp_mine, sizeof smp_mine, NULL) != SMP_OK)
            die("naming this rank's partial file");
        drop_cached(smp_mine);
        ld.partial = SMP_ON;
        TIMED(t, if (smp_load(model, smp_path, &ld) != SMP_OK) die("partial load from disk"));
        if (t < best[4][1]) best[4][1] = t;
        drop_cached(raw_full);
        TIMED(t, raw_read(raw_full, rbuf, local, (off_t)(smp_mp_rank() * local)));
        if (t < best[5][0]) best[5][0] = t;
        drop_cached(smp_path);
        ld.partial = SMP_OFF;
        TIMED(t, if (smp_load(model, smp_path, &ld) != SMP_OK) die("full load from disk"));
        if (t < best[5][1]) best[5][1] = t;
    }
    /* the model still holds its bytes after all those loads */
    {
        size_t at = 0;
        int ok = 1, all;
        for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
            ok &= !memcmp(mine + at, smp_param_value(p)->data, smp_tensor_nbytes(smp_param_value(p)));
            at += smp_tensor_nbytes(smp_param_value(p));
        }
        MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
        if (!all) die("the loaded model differs from the saved one");
    }

    if (me == 0) {
        static const char *ops[NOPS] = {"partial save", "full save",    "partial load",
                                        "full load",    "partial cold", "full cold"};
        double worst[3] = {1e30, 1e30, 1e30}, mib = (double)total / (1 << 20); /* saves, loads, cold loads */
        printf("checkpoint of a %.0f MiB model, %d ranks, %d partitions, best of %d, files in %s\n", mib, world,
               cfg.partitions, REPS, bdir);
        printf("| operation    | raw (s) | raw MiB/s | smp (s) | smp MiB/s | smp/raw |\n");
        printf("|--------------|--------:|----------:|--------:|----------:|--------:|\n");
        for (int k = 0; k < NOPS; k++) {
            double ratio = best[k][0] / best[k][1];
            if (ratio < worst[k / 2]) worst[k / 2] = ratio;
            printf("| %-12s | %7.3f | %9.0f | %7.3f | %9.0f | %7.2f |\n", ops[k], best[k][0], mib / best[k][0],
                   best[k][1], mib / best[k][1], ratio);
        }
        printf("checkpoint cold load/raw throughput (worst): %.2f\n", worst[2]);
        printf("checkpoint load/raw throughput (worst): %.2f\n", worst[1]);
        printf("checkpoint save/raw throughput (worst): %.2f\n", worst[0]);
        fflush(stdout);
    }
    /* clean up */
    unlink(raw_mine);
    if (me == 0) {
        char f[700];
        unlink(raw_full);
        unlink(smp_path);
        for (int k = 0; k < cfg.partitions; k++)
            if (smp_ckpt_partial_file(smp_path, k, f, sizeof f, NULL) == SMP_OK) unlink(f);
        snprintf(f, sizeof f, "%s.manifest", smp_path);
        unlink(f);
    }
    free(mine);
    free(big);
    free(rbuf);
    smp_model_free(model);
    smp_finalize();
    MPI_Finalize();
    return 0;
}
