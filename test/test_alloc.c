/* test_alloc.c - the caching allocator (issue 28): once a model has run one
   training step, a step of the unchanged model makes no call to the system
   allocator (SMP_FAULT_SYSTEM_ALLOC's events count every one smp makes,
   host and device), for the GPT example's model (examples/gpt_model.h) and
   the Fashion-MNIST MLP (examples/fmnist_model.h), in a pipeline of 2
   partitions (1F1B and zero bubble, at 2 ranks; 1 partition at 1 rank), with
   every top-level call recomputed, with DDP over every rank, and (the GPT at
   2 ranks) at tp 2 with prescaled_batch false, the step joining the TP
   group's batches. Out of
   memory with a warm cache: a system allocation that fails in a step makes
   the caches give their free blocks back and is tried once more, and the
   step's loss is the one a run without the failure gets, bit for bit; one
   that fails again is SMP_ERR_NOMEM on every rank, and the next step works.
   The cache's bytes show in smp_memory() as "cached" and go with the
   model. */
#include <stdlib.h>
#include <string.h>
/* the system allocator as smp sees it: refuses blocks over g_refuse_over bytes (0: none), the next
   g_refuse_once of them only once each */
static size_t g_refuse_over;
static int g_refuse_once;
static long g_refused;
static void *test_malloc(size_t n) {
    if (g_refuse_over && n > g_refuse_over && (g_refuse_once < 0 || (g_refuse_once > 0 && g_refuse_once--))) {
        g_refused++;
        return NULL;
    }
    return malloc(n);
}
#define SMP_MALLOC(n) test_malloc(n)
#define SMP_FREE(p) free(p)
#define SMP_IMPLEMENTATION
#define SMP_TESTING
#include "smp.h"
#include "smp_pipeline.h"
#include "examples/gpt_model.h"
#include "examples/fmnist_model.h"
#include "test.h"

static int g_rank, g_world;

typedef struct scenario { const char *name; int partitions; smp_pipeline_kind pipeline; bool ddp, recompute; } scenario;
static int g_joined_tp = 1; /* > 1: that tp, with prescaled_batch false (the step joins the TP group's batches) */

static smp_config config_of(const scenario *s, int microbatches) {
    smp_config cfg = {0};
    cfg.partitions = s->partitions;
    cfg.microbatches = microbatches;
    cfg.pipeline = s->pipeline;
    cfg.ddp = s->ddp || g_world > s->partitions * g_joined_tp ? SMP_ON : SMP_OFF; /* replicas need ddp (4 ranks) */
    cfg.activation_checkpointing = s->recompute ? SMP_ON : SMP_OFF;
    cfg.tensor_parallel_degree = g_joined_tp;
    if (g_joined_tp > 1) cfg.prescaled_batch = SMP_OFF;
    return cfg;
}

/* ---------------------------------------------------------------- the two models */
enum { GPT_B = 4, GPT_T = 8, GPT_V = 16, FM_B = 8 };
static const gpt_config g_gpt_cfg = {GPT_V, 2, 16, 2, GPT_T, 0.0f};
static int32_t g_ids[4 * GPT_B * GPT_T], g_targets[4 * GPT_B * GPT_T];
static float g_images[FM_B * FM_PIXELS];
static int32_t g_labels[FM_B];

static void make_data(void) {
    for (int i = 0; i < 4 * GPT_B * GPT_T; i++) { g_ids[i] = (i * 7 + 3) % GPT_V; g_targets[i] = (i * 5 + 1) % GPT_V; }
    for (int i = 0; i < FM_B * FM_PIXELS; i++) g_images[i] = (float)((i * 37) % 101) / 101.0f;
    for (int i = 0; i < FM_B; i++) g_labels[i] = i % FM_CLASSES;
}

/* One training step of the GPT on `rows` rows of the data; its mean loss in *loss. */
static smp_status gpt_train(smp_model *m, int rows, double *loss) {
    smp_tensor ids = smp_tensor_2d(g_ids, SMP_I32, rows, GPT_T);
    smp_tensor targets = smp_tensor_2d(g_targets, SMP_I32, rows, GPT_T);
    smp_step_output out = {0};
    smp_model_zero_grad(m);
    smp_status st = SMP_TRAIN_STEP(m, gpt_loss_body, NULL, &out, 1, ids, targets);
    if (!st && loss) *loss = smp_step_output_reduce_mean_global_f64(&out);
    smp_step_output_free(&out);
    return st;
}

static smp_status fm_train(smp_model *m) {
    smp_tensor x = smp_tensor_2d(g_images, SMP_F32, FM_B, FM_PIXELS), y = smp_tensor_1d(g_labels, SMP_I32, FM_B);
    smp_step_output out[2] = {{0}, {0}};
    smp_model_zero_grad(m);
    smp_status st = SMP_TRAIN_STEP(m, train_body, NULL, out, 2, x, y);
    smp_step_output_free(&out[0]);
    smp_step_output_free(&out[1]);
    return st;
}

/* Steps of one model after its first: the system allocations each made (the most over the ranks, in `most`). */
static void count_steps(const char *model, const scenario *s) {
    char name[160], why[512] = "";
    snprintf(name, sizeof name, "steady state/%s, %s: no system allocation in a step after the first", model, s->name);
    smp_config cfg = config_of(s, 2);
    bool is_gpt = !strcmp(model, "gpt");
    if (!is_gpt) cfg.auto_partition = SMP_OFF; /* fmnist_model.h places its layers itself */
    smp_status st = smp_init(&cfg);
    gpt g;
    mlp net;
    smp_model *m = NULL;
    if (!st) st = is_gpt ? gpt_build(&g, &g_gpt_cfg, false, &m) : build_model(&net, s->partitions, &m);
    long made[4] = {0, 0, 0, 0};
    for (int k = 0; k < 4 && !st; k++) {
        long before = smp_testing_events(SMP_FAULT_SYSTEM_ALLOC);
        if (getenv("DBGALLOC")) fprintf(stderr, "MARK r%d %s %s step %d\n", g_rank, model, s->name, k);
        st = is_gpt ? gpt_train(m, GPT_B, NULL) : fm_train(m);
        made[k] = smp_testing_events(SMP_FAULT_SYSTEM_ALLOC) - before;
    }
    long most = made[1] > made[2] ? made[1] : made[2];
    most = made[3] > most ? made[3] : most;
    smp_memory_stats mem = smp_memory();
    if (st) snprintf(why, sizeof why, "status %d: %.400s", (int)st, smp_last_error());
    else snprintf(why, sizeof why, "system allocations in steps 1-4: %ld, %ld, %ld, %ld (cached %lld bytes)", made[0],
                  made[1], made[2], made[3], (long long)mem.bytes[SMP_MEMORY_CACHED]);
    /* the first step allocates what the others reuse, and the cache holds it beyond the step */
    MPI_CHECK(!st && made[0] > 0 && most == 0 && mem.bytes[SMP_MEMORY_CACHED] > 0, name, "%s", why);
    if (is_gpt && m) gpt_free(&g);
    smp_model_free(m);
    smp_memory_stats after = smp_memory();
    snprintf(name, sizeof name, "steady state/%s, %s: the model's cache goes with it", model, s->name);
    MPI_CHECK(after.bytes[SMP_MEMORY_CACHED] == 0, name, "%lld cached bytes left",
              (long long)after.bytes[SMP_MEMORY_CACHED]);
    smp_finalize();
}

/* Out of memory with a warm cache. Two models of the same weights take the same steps; a larger batch then needs
   blocks no cache holds, and the system refuses the first of them on the last rank: the caches give back their
   free blocks, the allocation is tried again, and the loss is the other model's, bit for bit. Refused twice
   (the allocation and its retry), the step is SMP_ERR_NOMEM on every rank; the next step works. */
static void warm_nomem(void) {
    scenario s = {"", g_world >= 2 ? 2 : 1, SMP_PIPELINE_INTERLEAVED, false, false};
    smp_config cfg = config_of(&s, 2);
    /* Split by memory alone: a split by traced time may give the last rank other layers of a than of b, and then
       other blocks to refuse and other caches to give back. */
    cfg.optimize = SMP_OPTIMIZE_MEMORY;
    smp_status st = smp_init(&cfg);
    gpt ga, gb;
    smp_model *a = NULL, *b = NULL;
    if (!st) st = gpt_build(&ga, &g_gpt_cfg, false, &a);
    if (!st) st = gpt_build(&gb, &g_gpt_cfg, false, &b);
    for (int k = 0; k < 2 && !st; k++) {
        st = gpt_train(a, GPT_B, NULL);
        if (!st) st = gpt_train(b, GPT_B, NULL);
    }
    double loss_a = 0, loss_b = 1;
    int64_t cached_before = smp_memory().bytes[SMP_MEMORY_CACHED];
    if (!st && g_rank == g_world - 1) { g_refuse_over = 4096; g_refuse_once = 1; g_refused = 0; }
    smp_status got = st ? st : gpt_train(a, 2 * GPT_B, &loss_a);
    long refused = g_refused;
    int64_t cached_after = smp_memory().bytes[SMP_MEMORY_CACHED];
    g_refuse_over = 0;
    if (!st) st = gpt_train(b, 2 * GPT_B, &loss_b);
    bool last = g_rank == g_world - 1;
    MPI_CHECK(!st && !got && loss_a == loss_b && (!last || (refused == 1 && cached_after < cached_before)),
              "out of memory/warm cache: the caches give back their free blocks, the allocation is tried again, "
              "the step is the one without the failure",
              "status %d, %d (%s); losses %a and %a; %ld refused; cached bytes %lld before, %lld after", (int)st,
              (int)got, smp_last_error(), loss_a, loss_b, refused, (long long)cached_before, (long long)cached_after);
    if (!st && last) { g_refuse_over = 4096; g_refuse_once = 2; g_refused = 0; } /* the allocation and its retry */
    got = st ? st : gpt_train(a, 4 * GPT_B, NULL);
    refused = g_refused;
    g_refuse_over = 0;
    smp_status again = st ? st : gpt_train(a, 4 * GPT_B, &loss_a);
    if (!st) st = gpt_train(b, 4 * GPT_B, &loss_b);
    MPI_CHECK(!st && got == SMP_ERR_NOMEM && (!last || refused == 2) && !again && loss_a == loss_b,
              "out of memory/still failing after the retry: SMP_ERR_NOMEM on every rank, then the step works",
              "status %d; the step %d (%s), %ld refused; then %d, losses %a and %a", (int)st, (int)got,
              smp_last_error(), refused, (int)again, loss_a, loss_b);
    if (a) gpt_free(&ga);
    if (b) gpt_free(&gb);
    smp_model_free(a);
    smp_model_free(b);
    smp_finalize();
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    mlp_set_blas_threads(1);
    make_data();
    int P = g_world >= 2 ? 2 : 1;
    const scenario scenarios[] = {
        {P > 1 ? "2 partitions, 1F1B" : "1 partition, 1F1B", P, SMP_PIPELINE_INTERLEAVED, false, false},
        {P > 1 ? "2 partitions, zero bubble" : "1 partition, zero bubble", P, SMP_PIPELINE_ZERO_BUBBLE, false, false},
        {P > 1 ? "2 partitions, recomputed" : "1 partition, recomputed", P, SMP_PIPELINE_INTERLEAVED, false, true},
        {"ddp over every rank", 1, SMP_PIPELINE_INTERLEAVED, true, false},
    };
    for (int i = 0; i < (int)(sizeof scenarios / sizeof scenarios[0]); i++) {
        count_steps("gpt", &scenarios[i]);
        count_steps("fmnist", &scenarios[i]);
    }
    if (g_world == 2) {
        const scenario joined = {"tp 2, prescaled_batch false", 1, SMP_PIPELINE_INTERLEAVED, false, false};
        g_joined_tp = 2;
        count_steps("gpt", &joined);
        g_joined_tp = 1;
    }
    warm_nomem();
    (void)evaluate, (void)gpt_kv_start; /* the examples' own, unused here */
    MPI_Finalize();
    return test_exit_code();
}
