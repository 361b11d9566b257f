/* fmnist_shared.h - what the CPU (fmnist.c) and CUDA (fmnist.cu) demos
   share outside their training loops: the command line, the progress
   output, the resume metadata and the memory peaks printed at the end
   (memory_peaks.h). Include after smp.h. */
#ifndef FMNIST_SHARED_H
#define FMNIST_SHARED_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "memory_peaks.h" /* print_memory_peaks, the last lines of both demos */

/* ---------------------------------------------------------------- options */
typedef struct options {
    int epochs, batch, seed, log_every;
    float lr, lr_decay;
    const char *data_dir, *config_json;
    smp_config cfg;
    long max_steps; /* stop after this many steps (tests); 0: no limit */
    long epoch_steps; /* steps per epoch (tests); 0: the whole training set */
    const char *checkpoint; /* saved after every epoch */
    bool partial, resume;
    int threads; /* BLAS threads per rank (CPU build); 0: 1 */
    bool print_losses; /* every step's loss, exactly (tests compare runs bit for bit) */
} options;

static void usage(const char *prog) {
    fprintf(stderr,
            "usage: %s [--epochs N] [--batch B] [--lr X] [--lr-decay X] [--seed S]\n"
            "          [--partitions P] [--microbatches M] [--pipeline simple|interleaved|zero_bubble|zero_bubble_v]\n"
            "          [--ddp] [--deterministic] [--shard-optimizer] [--offload] [--manual] [--config JSON]\n"
            "          [--data DIR] [--checkpoint PATH] [--partial] [--resume]\n"
            "  --batch is the global batch: every replica gets batch / replicas rows\n"
            "  --manual places layers with SMP_PARTITION contexts instead of auto-partitioning\n"
            "  --offload keeps activations in host memory until their backward (offload_activations: the CUDA build)\n",
            prog);
}

static int parse_options(int argc, char **argv, options *o) {
    memset(o, 0, sizeof *o);
    o->epochs = 5;
    o->batch = 128;
    o->lr = 1e-3f;
    o->lr_decay = 0.5f;
    o->seed = 1;
    o->checkpoint = "fmnist.safetensors";
    o->cfg.partitions = 2;
    o->cfg.microbatches = 4;
    o->cfg.trace_execution_times = SMP_ON; /* time each layer's forward and backward a few times: a balanced split */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && v && ++i)
        if (OPT("--epochs")) o->epochs = atoi(v);
        else if (OPT("--batch")) o->batch = atoi(v);
        else if (OPT("--lr")) o->lr = strtof(v, NULL);
        else if (OPT("--lr-decay")) o->lr_decay = strtof(v, NULL);
        else if (OPT("--seed")) o->seed = atoi(v);
        else if (OPT("--partitions")) o->cfg.partitions = atoi(v);
        else if (OPT("--microbatches")) o->cfg.microbatches = atoi(v);
        else if (OPT("--pipeline"))
            o->cfg.pipeline = !strcmp(v, "simple")          ? SMP_PIPELINE_SIMPLE
                              : !strcmp(v, "zero_bubble")   ? SMP_PIPELINE_ZERO_BUBBLE
                              : !strcmp(v, "zero_bubble_v") ? SMP_PIPELINE_ZERO_BUBBLE_V
                                                            : SMP_PIPELINE_INTERLEAVED;
        else if (OPT("--config")) o->config_json = v;
        else if (OPT("--data")) o->data_dir = v;
        else if (OPT("--max-steps")) o->max_steps = atol(v);
        else if (OPT("--epoch-steps")) o->epoch_steps = atol(v);
        else if (OPT("--threads")) o->threads = atoi(v);
        else if (OPT("--checkpoint")) o->checkpoint = v;
        else if (!strcmp(a, "--partial")) o->partial = true;
        else if (!strcmp(a, "--resume")) o->resume = true;
        else if (!strcmp(a, "--print-losses")) o->print_losses = true;
        else if (!strcmp(a, "--ddp")) o->cfg.ddp = SMP_ON;
        else if (!strcmp(a, "--deterministic")) o->cfg.deterministic_reduction = SMP_ON;
        else if (!strcmp(a, "--shard-optimizer")) o->cfg.shard_optimizer_state = SMP_ON;
        else if (!strcmp(a, "--offload")) o->cfg.offload_activations = SMP_ON;
        else if (!strcmp(a, "--manual")) o->cfg.auto_partition = SMP_OFF;
        else { usage(argv[0]); return 1; }
#undef OPT
    }
    o->cfg.seed = (uint64_t)o->seed;
    if (o->config_json && smp_config_from_json(o->config_json, &o->cfg)) {
        fprintf(stderr, "--config: %s\n", smp_last_error());
        return 1;
    }
    if (o->epochs < 1 || o->batch < 1) { usage(argv[0]); return 1; }
    return 0;
}

/* ---------------------------------------------------------------- progress */
static void progress(int epoch, int epochs, long done, long total, double loss, double rate, bool final) {
    if (smp_rank() != 0) return;
    if (isatty(STDOUT_FILENO)) {
        int width = 30, filled = total ? (int)(width * done / total) : width;
        printf("\repoch %d/%d [%.*s%*s] %5.1f%%  loss %.4f  %6.0f samples/s", epoch, epochs, filled,
               "##############################", width - filled, "", 100.0 * (double)done / (double)total, loss, rate);
        if (final) printf("\n");
        fflush(stdout);
    } else if (final) {
        printf("epoch %d/%d  loss %.4f  %.0f samples/s\n", epoch, epochs, loss, rate);
        fflush(stdout);
    }
}

static double now(void) { return MPI_Wtime(); }

/* What a checkpoint's metadata says about where training stopped. */
typedef struct resume_state { int epoch; long steps; } resume_state;
static void on_meta(const char *key, const char *value, void *user) {
    resume_state *r = (resume_state *)user;
    if (!strcmp(key, "epoch")) r->epoch = atoi(value);
    else if (!strcmp(key, "step")) r->steps = atol(value);
}

/* The checkpoint at the end of an epoch, with the metadata a resumed run
   reads back (on_meta above) and the pixel statistics fmnist_infer
   normalises with; smp writes it from dp rank 0 of each partition. */
static smp_status save_epoch(smp_model *model, const options *o, smp_optimizer *state, int epoch, long steps,
                             float mean, float stdev) {
    char e[32], n[32], mean_s[32], std_s[32];
    snprintf(e, sizeof e, "%d", epoch);
    snprintf(n, sizeof n, "%ld", steps);
    snprintf(mean_s, sizeof mean_s, "%.9g", mean);
    snprintf(std_s, sizeof std_s, "%.9g", stdev);
    const char *keys[] = {"epoch", "step", "pixel_mean", "pixel_std"}, *values[] = {e, n, mean_s, std_s};
    smp_save_desc save;
    memset(&save, 0, sizeof save); /* the C and CUDA (C++) programs both include this */
    save.partial = o->partial ? SMP_ON : SMP_OFF;
    save.optimizer = state; /* sharded: each replica's range */
    save.meta_keys = keys;
    save.meta_values = values;
    save.nmeta = 4;
    return smp_save(model, o->checkpoint, &save);
}

/* The name of a pipeline kind, as --pipeline spells it. */
static inline const char *pipeline_name(smp_pipeline_kind k) {
    return k == SMP_PIPELINE_SIMPLE          ? "simple"
           : k == SMP_PIPELINE_ZERO_BUBBLE   ? "zero_bubble"
           : k == SMP_PIPELINE_ZERO_BUBBLE_V ? "zero_bubble_v"
                                             : "interleaved";
}
#endif
