/* test_ckpt_threads.c - the checkpoint I/O thread, the one thread smp runs
   besides the caller's, built for ThreadSanitizer.

   A full smp_save hands the file's data to an I/O thread on the rank that
   writes it (world rank 0), while the main thread receives the other
   ranks' chunks; errors are per thread (smp_last_error), so a failure on
   the I/O thread must reach the main thread's message. Checks:
   - full saves in small chunks (thousands of hand-offs through the I/O
     thread's queue) load back bitwise;
   - a write that fails on the I/O thread (a file size limit on world rank
     0, so write() says EFBIG): smp_save fails on every rank, and world rank
     0's smp_last_error() on the main thread is the writer's own message
     from the I/O thread; the checkpoint saved before loads as it was.
   make test builds it with -fsanitize=thread (build/tsan) and runs it at 1
   and 2 ranks, where any data race is a sanitizer report and so a FAIL; the
   gcc and ASan suites run it too. UCX_MEM_EVENTS=no keeps UCX's madvise
   hook out of TSan's way when the I/O thread exits (it crashes there).

   Build and run from the repository root:
     mpicc -std=c11 -Wall -Wextra -Werror -g -O1 -fsanitize=thread -I. -Itest test/test_ckpt_threads.c -o /tmp/tt -lm
     UCX_MEM_EVENTS=no mpirun -n 2 /tmp/tt
*/
#define _POSIX_C_SOURCE 200809L /* mkdtemp, setrlimit, sigaction */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_checkpoint.h"
#include "test.h"
#include "net7.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define BIG ((size_t)3 << 20) /* floats of optimizer state: past the writer's 1 MiB buffer, so the I/O thread writes */

static float g_x[B * D];

static void fill(float *v, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) v[i] = (float)((i * 2654435761u + seed) % 1000003u) * 0.001f;
}

static int same(const float *v, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        if (v[i] != (float)((i * 2654435761u + seed) % 1000003u) * 0.001f) return 0;
    return 1;
}

static smp_status save(smp_model *m, smp_optimizer *o, const char *path, size_t chunk) {
    smp_save_desc d = {0};
    d.partial = SMP_OFF;
    d.optimizer = o;
    d.chunk_bytes = chunk;
    return smp_save(m, path, &d);
}

static smp_status load(smp_model *m, smp_optimizer *o, const char *path) {
    smp_load_desc d = {0};
    d.partial = SMP_OFF;
    d.optimizer = o;
    return smp_load(m, path, &d);
}

int main(int argc, char **argv) {
    int world = 1, me = 0;
    (void)argc;
    (void)argv;
    MPI_Init(NULL, NULL);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    char dir[256] = "/tmp/smp_ckpt_threads_XXXXXX";
    if (me == 0 && !mkdtemp(dir)) dir[0] = 0;
    MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (!dir[0]) {
        MPI_CHECK(0, "ckpt threads: a temporary folder", "mkdtemp failed");
        MPI_Finalize();
        return 1;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);

    smp_config cfg = {0};
    cfg.partitions = world >= 2 ? 2 : 1;
    cfg.ddp = world > cfg.partitions ? SMP_ON : SMP_OFF;
    cfg.seed = 5;
    smp_status st = smp_init(&cfg);
    net n;
    smp_model *m = NULL;
    if (!st) {
        net_modules(&n, NULL, &net_host_fns);
        m = net_model(&n, false);
        smp_tensor x = smp_tensor_2d(g_x, SMP_F32, B, D);
        st = m ? smp_model_trace(m, &x, 1) : SMP_ERR_STATE;
    }
    float *big = (float *)malloc(BIG * sizeof(float));
    smp_optimizer *o = NULL;
    if (!st) st = big ? smp_optimizer_new(m, &o) : SMP_ERR_NOMEM;
    if (!st) {
        fill(big, BIG, 1);
        smp_tensor t = smp_tensor_1d(big, SMP_F32, (int64_t)BIG);
        smp_param *p = smp_model_local_param(m, 0, false); /* a local one: every rank's data crosses to the writer */
        st = p ? smp_optimizer_state_add(o, smp_param_name(p), "moments", &t) : SMP_ERR_STATE;
    }
    MPI_CHECK(st == SMP_OK, "ckpt threads: a traced model with 12 MiB of optimizer state on every rank", "%s",
              smp_last_error());
    if (st) {
        MPI_Finalize();
        return 1;
    }

    /* small chunks: many hand-offs between the receiving main thread and the I/O thread */
    int ok = 1;
    char why[4096] = "";
    for (int round = 0; round < 3 && ok; round++) {
        fill(big, BIG, 10u + (unsigned)round);
        st = save(m, o, path, round == 0 ? 4096 : 0);
        if (st) {
            ok = 0;
            snprintf(why, sizeof why, "save %d: %s", round, smp_last_error());
            break;
        }
        memset(big, 0, BIG * sizeof(float));
        st = load(m, o, path);
        if (st || !same(big, BIG, 10u + (unsigned)round)) {
            ok = 0;
            snprintf(why, sizeof why, "load %d: %s", round, st ? smp_last_error() : "the optimizer state differs");
        }
    }
    MPI_CHECK(ok, "ckpt threads: full saves through the I/O thread load back bitwise", "%s", why);

    /* the I/O thread's write fails: its message must reach the main thread */
    fill(big, BIG, 99);
    struct rlimit old, lim;
    int limited = 0;
    if (me == 0 && getrlimit(RLIMIT_FSIZE, &old) == 0) {
        struct sigaction ign;
        memset(&ign, 0, sizeof ign);
        ign.sa_handler = SIG_IGN;
        sigaction(SIGXFSZ, &ign, NULL); /* write() then fails with EFBIG instead of killing the process */
        lim = old;
        lim.rlim_cur = (rlim_t)256 << 10;
        limited = setrlimit(RLIMIT_FSIZE, &lim) == 0;
    }
    st = save(m, o, path, 0);
    if (limited) setrlimit(RLIMIT_FSIZE, &old);
    const char *msg = smp_last_error();
    if (me == 0)
        ok =
            limited && st == SMP_ERR_IO && strstr(msg, "writing") && strstr(msg, "File too large") && strstr(msg, path);
    else
        ok = st != SMP_OK && strstr(msg, "File too large") != NULL;
    snprintf(why, sizeof why, "status %s (limit set: %d): %s", smp_status_name(st), limited, msg);
    MPI_CHECK(ok, "ckpt threads: a write that fails on the I/O thread fails the save with its message on every rank",
              "%s", why);

    memset(big, 0, BIG * sizeof(float));
    st = load(m, o, path);
    MPI_CHECK(st == SMP_OK && same(big, BIG, 12),
              "ckpt threads: the failed save left the previous checkpoint as it was", "%s",
              st ? smp_last_error() : "the optimizer state differs");

    smp_optimizer_free(o);
    smp_model_free(m);
    smp_finalize();
    free(big);
    if (me == 0) {
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    }
    MPI_Finalize();
    return test_exit_code();
}
