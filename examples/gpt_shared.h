/* gpt_shared.h - what the GPT's host program (gpt.c) and device program
   (gpt.cu) share besides the model (gpt_model.h): options and usage, the
   fortunes corpus, the batches, the learning-rate schedule, the
   next-character logits and sampling, parameter digests, the checkpoint's
   metadata, pipelined generation from a checkpoint (--generate, on the
   model each program builds), the memory peaks printed at the end
   (memory_peaks.h). The same flags, data and loop in both, so the two
   compare step for step. Include after smp.h, smp_pipeline.h,
   smp_checkpoint.h and gpt_model.h (C, or C++ under nvcc). */
#ifndef GPT_SHARED_H
#define GPT_SHARED_H
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "memory_peaks.h" /* print_memory_peaks, the last lines of both programs */

#define GPT_DEFAULT_DATA "/usr/share/games/fortunes"

/* ---------------------------------------------------------------- options */
typedef struct options {
    gpt_config model;
    int steps, batch, seed, warmup, log_every, val_batches, sample_len, replicas, threads;
    float lr, min_lr, weight_decay, beta1, beta2, clip, temperature;
    const char *data, *save, *prompt, *config_json;
    const char *logits, *grads; /* --logits TEXT, --grads PATH (for tests) */
    const char *params;         /* --params PATH: every parameter's full tensor after training (gpt.c, for tests) */
    int save_at;                /* --save-at N: the checkpoint after N steps, with AdamW's state (0: at the end) */
    bool partial;               /* --partial: --save-at and --load use smp's partial checkpoints */
    bool recompute, print_losses, digest;
    bool bf16;          /* gpt.cu: bf16 GEMM inputs, f32 accumulation and master weights */
    int vocab_multiple; /* gpt.cu: the vocabulary padded to a multiple of this (0: the corpus's) */
    bool plain;         /* gpt.cu: the same step without smp (one rank), the overhead benchmark's baseline */
    /* --generate: pipelined generation from a checkpoint, one prompt per microbatch */
    bool generate, no_cache, print_logits;
    const char *load, *prompts;
    int tokens;
    smp_config cfg;
} options;

static void usage(const char *prog) {
    fprintf(stderr,
            "usage: %s [--steps N] [--batch B] [--lr X] [--min-lr X] [--warmup N] [--weight-decay X]\n"
            "          [--layers L] [--dmodel C] [--heads H] [--context T] [--dropout P]\n"
            "          [--partitions P] [--tp N] [--no-prescaled-batch] [--microbatches M]\n"
            "          [--pipeline simple|interleaved|zero_bubble|zero_bubble_v] [--ddp]\n"
            "          [--deterministic] [--recompute] [--shard-optimizer] [--config JSON] [--data DIR] [--save PATH]\n"
            "          [--val-batches N] [--prompt TEXT] [--sample-len N] [--temperature X] [--seed S]\n"
            "          [--threads N] [--log-every N] [--print-losses] [--digest] [--replicas R]\n"
            "          [--logits TEXT] [--grads PATH] [--params PATH] [--save-at N] [--load CKPT] [--partial]\n"
            "  --batch is the global batch in sequences of --context characters\n"
            "  --tp N splits every layer over N ranks (tensor_parallel_degree; gpt.c): heads, MLP, vocabulary\n"
            "  --no-prescaled-batch: each rank of a TP group reads its own sequences (sharded by dp rank), which\n"
            "   smp joins into the group's batch (prescaled_batch false; gpt.c); the same run as without it\n"
            "  --params PATH saves every parameter's full tensor after training (gpt.c, any --tp)\n"
            "  --save \"\" skips the checkpoint\n"
            "  --save-at N saves it after step N instead, with AdamW's state, and trains on\n"
            "  --load CKPT starts from a checkpoint: with AdamW's state (--save-at) it continues at its step\n"
            "   (the log's loss average then runs over this run's steps, \"avg from step N:\")\n"
            "  --partial: --save-at and --load use partial checkpoints (a file per partition and shard)\n"
            "  --offload (gpt.cu) keeps what each backward needs in host memory until activation_loading_horizon\n"
            "   pipeline tasks before it (offload_activations; --config '{\"activation_loading_horizon\": 2}')\n"
            "  --logits TEXT prints the logits of the character after TEXT once trained (hex floats)\n"
            "  --grads PATH saves the weights, gradients, batch and loss of the first step (one replica)\n"
            "   or: %s --generate --load CKPT --prompts \"A|B|...\" [--tokens N] [--temperature X] [--seed S]\n"
            "          [--partitions P] [--pipeline simple|interleaved|zero_bubble_v] [--no-cache] [--print-logits] "
            "[--threads N]\n"
            "  generates N characters after each prompt, one prompt per microbatch, with a KV cache\n"
            "  (--no-cache: by re-running the whole context each token); --temperature 0 is greedy;\n"
            "  --print-logits prints the logits each character was drawn from (hex floats)\n",
            prog, prog);
}

/* device: gpt.cu, which also takes --bf16, --vocab-multiple N, --plain, --offload, and --steps 0
   with --load (it then only evaluates the checkpoint's weights). */
static int parse_options(int argc, char **argv, options *o, bool device) {
    memset(o, 0, sizeof *o);
    o->model.n_layer = 6;
    o->model.n_embd = 192;
    o->model.n_head = 6;
    o->model.block_size = 128;
    o->steps = 700; /* 700 x 8 x 128 characters: under 4 minutes on 2 idle cores, validation loss near 2.3 */
    o->batch = 8;
    o->seed = 1;
    o->warmup = 40;
    o->log_every = 50;
    o->val_batches = 8;
    o->sample_len = 240;
    o->replicas = 1;
    o->lr = 2e-3f;
    o->min_lr = -1;
    o->weight_decay = 0.1f;
    o->beta1 = 0.9f;
    o->beta2 = 0.99f;
    o->clip = 1.0f;
    o->temperature = 0.8f;
    o->data = GPT_DEFAULT_DATA;
    o->save = "build/gpt.safetensors";
    o->prompt = "The ";
    o->cfg.partitions = 2;
    o->cfg.microbatches = 4;
    o->cfg.trace_execution_times = SMP_ON; /* time each call a few times: blocks split evenly */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && v && ++i)
        if (OPT("--steps")) o->steps = atoi(v);
        else if (OPT("--batch")) o->batch = atoi(v);
        else if (OPT("--lr")) o->lr = strtof(v, NULL);
        else if (OPT("--min-lr")) o->min_lr = strtof(v, NULL);
        else if (OPT("--warmup")) o->warmup = atoi(v);
        else if (OPT("--weight-decay")) o->weight_decay = strtof(v, NULL);
        else if (OPT("--clip")) o->clip = strtof(v, NULL);
        else if (OPT("--layers")) o->model.n_layer = atoi(v);
        else if (OPT("--dmodel")) o->model.n_embd = atoi(v);
        else if (OPT("--heads")) o->model.n_head = atoi(v);
        else if (OPT("--context")) o->model.block_size = atoi(v);
        else if (OPT("--dropout")) o->model.dropout = strtof(v, NULL);
        else if (OPT("--seed")) o->seed = atoi(v);
        else if (OPT("--partitions")) o->cfg.partitions = atoi(v);
        else if (!device && OPT("--tp")) o->cfg.tensor_parallel_degree = atoi(v);
        else if (!device && OPT("--params")) o->params = v;
        else if (OPT("--save-at")) o->save_at = atoi(v);
        else if (OPT("--microbatches")) o->cfg.microbatches = atoi(v);
        else if (OPT("--pipeline")) {
            if (!strcmp(v, "simple")) o->cfg.pipeline = SMP_PIPELINE_SIMPLE;
            else if (!strcmp(v, "interleaved")) o->cfg.pipeline = SMP_PIPELINE_INTERLEAVED;
            else if (!strcmp(v, "zero_bubble")) o->cfg.pipeline = SMP_PIPELINE_ZERO_BUBBLE;
            else if (!strcmp(v, "zero_bubble_v")) o->cfg.pipeline = SMP_PIPELINE_ZERO_BUBBLE_V;
            else {
                fprintf(stderr, "--pipeline: \"%s\" is not simple, interleaved, zero_bubble or zero_bubble_v\n", v);
                return 1;
            }
        }
        else if (OPT("--config")) o->config_json = v;
        else if (OPT("--data")) o->data = v;
        else if (OPT("--save")) o->save = v;
        else if (OPT("--val-batches")) o->val_batches = atoi(v);
        else if (OPT("--prompt")) o->prompt = v;
        else if (OPT("--sample-len")) o->sample_len = atoi(v);
        else if (OPT("--temperature")) o->temperature = strtof(v, NULL);
        else if (OPT("--threads")) o->threads = atoi(v);
        else if (OPT("--log-every")) o->log_every = atoi(v);
        else if (OPT("--replicas")) o->replicas = atoi(v);
        else if (OPT("--load")) o->load = v;
        else if (OPT("--prompts")) o->prompts = v;
        else if (OPT("--tokens")) o->tokens = atoi(v);
        else if (OPT("--logits")) o->logits = v;
        else if (OPT("--grads")) o->grads = v;
        else if (device && OPT("--vocab-multiple")) o->vocab_multiple = atoi(v);
        else if (device && !strcmp(a, "--bf16")) o->bf16 = true;
        else if (device && !strcmp(a, "--plain")) o->plain = true;
        else if (device && !strcmp(a, "--offload")) o->cfg.offload_activations = SMP_ON;
        else if (!strcmp(a, "--generate")) o->generate = true;
        else if (!strcmp(a, "--partial")) o->partial = true;
        else if (!device && !strcmp(a, "--no-prescaled-batch")) o->cfg.prescaled_batch = SMP_OFF;
        else if (!strcmp(a, "--no-cache")) o->no_cache = true;
        else if (!strcmp(a, "--print-logits")) o->print_logits = true;
        else if (!strcmp(a, "--ddp")) o->cfg.ddp = SMP_ON;
        else if (!strcmp(a, "--deterministic")) o->cfg.deterministic_reduction = SMP_ON;
        /* each replica keeps 1/dp of AdamW's moments */
        else if (!strcmp(a, "--shard-optimizer")) o->cfg.shard_optimizer_state = SMP_ON;
        else if (!strcmp(a, "--recompute")) o->recompute = true;
        else if (!strcmp(a, "--print-losses")) o->print_losses = true;
        else if (!strcmp(a, "--digest")) o->digest = true;
        else { usage(argv[0]); return 1; }
#undef OPT
    }
    o->cfg.seed = (uint64_t)o->seed;
    if (o->generate) { /* one prompt per microbatch */
        if (!o->load || !o->prompts || o->tokens < 1) {
            fprintf(stderr, "--generate needs --load CKPT, --prompts \"A|B|...\" and --tokens N >= 1\n");
            return 1;
        }
        int n = 1;
        for (const char *q = o->prompts; *q; q++) n += *q == '|';
        o->cfg.microbatches = n;
    }
    if (o->config_json && smp_config_from_json(o->config_json, &o->cfg)) {
        fprintf(stderr, "--config: %s\n", smp_last_error());
        return 1;
    }
    if (o->min_lr < 0) o->min_lr = o->lr / 10;
    if (o->steps < (device && o->load && !o->generate ? 0 : 1) || o->batch < 1 || o->vocab_multiple < 0 ||
        o->replicas < 1 || o->save_at < 0 || o->val_batches < 0 || o->sample_len < 0 || o->model.dropout < 0 || o->model.dropout >= 1) {
        usage(argv[0]);
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the corpus */
/* Every fortune of the package's text files (sorted by name; the .dat
   indexes and .u8 links skipped), fortunes separated by lines "%". Every
   tenth fortune is validation text, the rest training text; a fortune
   keeps its "%" line, so the model learns where fortunes end. */
typedef struct corpus {
    char *train, *val;
    size_t ntrain, nval;
    int vocab;
    unsigned char chars[256]; /* id -> byte */
    int id_of[256];           /* byte -> id, -1: not in the text */
} corpus;

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

static bool append(char **buf, size_t *len, size_t *cap, const char *s, size_t n) {
    if (*len + n > *cap) {
        size_t nc = *cap ? *cap : 1 << 20;
        while (nc < *len + n) nc *= 2;
        char *p = (char *)realloc(*buf, nc);
        if (!p) return false;
        *buf = p;
        *cap = nc;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    return true;
}

static smp_status corpus_load(corpus *c, const char *dir) {
    memset(c, 0, sizeof *c);
    DIR *d = opendir(dir);
    if (!d)
        return smp_error(SMP_ERR_IO, "%s: cannot open the corpus folder: %s (Debian's fortunes package: make deps)",
                         dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.' || ends_with(e->d_name, ".dat") || ends_with(e->d_name, ".u8")) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **p = (char **)realloc(names, cap * sizeof *names);
            if (!p) break;
            names = p;
        }
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof *names, cmp_str);
    smp_status st = SMP_OK;
    size_t tcap = 0, vcap = 0, fortune = 0, files = 0;
    char path[4096];
    for (size_t i = 0; i < n && !st; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        struct stat sb;
        if (lstat(path, &sb) || !S_ISREG(sb.st_mode)) continue; /* links and folders */
        FILE *f = fopen(path, "rb");
        if (!f) { st = smp_error(SMP_ERR_IO, "%s: cannot open: %s", path, strerror(errno)); break; }
        char *text = (char *)malloc((size_t)sb.st_size + 2);
        size_t len = text ? fread(text, 1, (size_t)sb.st_size, f) : 0;
        fclose(f);
        if (!text) { st = smp_error(SMP_ERR_NOMEM, "out of memory reading %s", path); break; }
        if (len && text[len - 1] != '\n') text[len++] = '\n';
        files++;
        /* fortunes: runs of lines up to and including a line "%" */
        size_t at = 0;
        while (at < len) {
            size_t end = at;
            for (;;) {
                char *nl = (char *)memchr(text + end, '\n', len - end);
                size_t line_end = nl ? (size_t)(nl - text) + 1 : len;
                bool sep = line_end - end == 2 && text[end] == '%';
                end = line_end;
                if (sep || end >= len) break;
            }
            bool val = fortune++ % 10 == 9;
            if (!(val ? append(&c->val, &c->nval, &vcap, text + at, end - at)
                      : append(&c->train, &c->ntrain, &tcap, text + at, end - at)))
                st = smp_error(SMP_ERR_NOMEM, "out of memory reading the corpus");
            at = end;
        }
        free(text);
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    if (!st && !files) st = smp_error(SMP_ERR_IO, "%s holds no fortune text files", dir);
    if (st) return st;
    bool seen[256] = {false};
    for (size_t i = 0; i < c->ntrain; i++) seen[(unsigned char)c->train[i]] = true;
    for (size_t i = 0; i < c->nval; i++) seen[(unsigned char)c->val[i]] = true;
    for (int b = 0; b < 256; b++) {
        c->id_of[b] = seen[b] ? c->vocab : -1;
        if (seen[b]) c->chars[c->vocab++] = (unsigned char)b;
    }
    return SMP_OK;
}

static int32_t *encode(const corpus *c, const char *text, size_t n) {
    int32_t *ids = (int32_t *)malloc((n ? n : 1) * sizeof *ids);
    for (size_t i = 0; ids && i < n; i++) ids[i] = c->id_of[(unsigned char)text[i]];
    return ids;
}

/* Entropy in nats of the training text's byte distribution. */
static double unigram_entropy(const corpus *c) {
    double count[256] = {0}, h = 0;
    for (size_t i = 0; i < c->ntrain; i++) count[(unsigned char)c->train[i]]++;
    for (int b = 0; b < 256; b++)
        if (count[b] > 0) {
            double p = count[b] / (double)c->ntrain;
            h -= p * log(p);
        }
    return h;
}

/* ---------------------------------------------------------------- batches */
/* Global batch `step`: `batch` windows at offsets drawn from (seed, step);
   rows [first, first + rows) of it go to x (inputs) and y (next characters). */
static void fill_batch(const int32_t *ids, size_t n, int T, uint64_t seed, long step, int batch, int first, int rows,
                       int32_t *x, int32_t *y) {
    mlp_rng r = mlp_rng_seed(mlp_mix64(seed) ^ mlp_mix64((uint64_t)step + 1));
    for (int k = 0; k < batch; k++) {
        size_t at = (size_t)mlp_rng_below(&r, (uint64_t)(n - (size_t)T - 1));
        if (k < first || k >= first + rows) continue;
        memcpy(x + (size_t)(k - first) * T, ids + at, sizeof(int32_t) * (size_t)T);
        memcpy(y + (size_t)(k - first) * T, ids + at + 1, sizeof(int32_t) * (size_t)T);
    }
}

/* Validation window w of nw, evenly spread over the validation text. */
static void fill_val(const int32_t *ids, size_t n, int T, int nw, int first, int rows, int32_t *x, int32_t *y) {
    size_t span = n - (size_t)T - 1;
    for (int k = 0; k < rows; k++) {
        size_t at = nw > 1 ? (size_t)((double)(first + k) * (double)span / (double)(nw - 1)) : 0;
        memcpy(x + (size_t)k * T, ids + at, sizeof(int32_t) * (size_t)T);
        memcpy(y + (size_t)k * T, ids + at + 1, sizeof(int32_t) * (size_t)T);
    }
}

/* Warm-up from lr/warmup to lr, then a cosine down to min_lr at the last step. */
static float lr_at(const options *o, int step) {
    if (step < o->warmup) return o->lr * (float)(step + 1) / (float)o->warmup;
    int span = o->steps - o->warmup;
    double frac = span > 1 ? (double)(step - o->warmup) / (double)(span - 1) : 1.0;
    return (float)(o->min_lr + 0.5 * (1.0 + cos(3.141592653589793 * frac)) * (o->lr - o->min_lr));
}

/* ---------------------------------------------------------------- helpers */
static double now(void) { return MPI_Wtime(); }

static void fmt_time(double s, char *buf, size_t cap) {
    long t = (long)(s + 0.5);
    if (t >= 60) snprintf(buf, cap, "%ldm%02lds", t / 60, t % 60);
    else snprintf(buf, cap, "%lds", t);
}

/* The training log's loss average: a moving average (0.9) of the losses of the steps this run made, from its
   first step's (start, where --load resumed: the checkpoint holds the weights and AdamW's state, not the log). */
static double loss_average(double avg, double loss, int step, int start) {
    return step == start ? loss : 0.9 * avg + 0.1 * loss;
}

/* The log line after step (from 0) of a run that began at start, t0 (now()) seconds ago, tokens trained since; a
   resumed run's says from which step its average runs. */
static void print_progress(const options *o, int step, int start, double loss, double avg, float lr, long tokens,
                           double t0) {
    double secs = now() - t0, eta = secs / (step + 1 - start) * (o->steps - step - 1);
    char e[32], s[32], from[32] = "";
    fmt_time(eta, e, sizeof e);
    fmt_time(secs, s, sizeof s);
    if (start) snprintf(from, sizeof from, " from step %d:", start + 1);
    printf("step %4d/%d  loss %.4f (avg%s %.4f)  lr %.2e  %6.0f tokens/s  %s elapsed, ETA %s\n", step + 1, o->steps,
           loss, from, avg, lr, (double)tokens / secs, s, e);
    fflush(stdout);
}

/* Where the top-level calls run: "0: wte wpe h.0-2 | 1: h.3-5 ln_f lm_head(wte)". */
static void print_placement(smp_model *model, const gpt *g) {
    if (smp_rank() != 0) return;
    int P = smp_current_config()->partitions, L = g->cfg.n_layer;
    int head = smp_model_stage_rank(model, smp_model_num_stages(model) - 1); /* the last call is in the last stage */
    printf("placement:");
    for (int k = 0; k < P; k++) {
        printf("%s %d:", k ? " |" : "", k);
        if (smp_module_partition(g->wte) == k) printf(" wte");
        if (smp_module_partition(g->wpe) == k) printf(" wpe");
        int first = -1;
        for (int i = 0; i <= L; i++) {
            bool here = i < L && smp_module_partition(g->blocks[i].mod) == k;
            if (here && first < 0) first = i;
            if (!here && first >= 0) {
                if (i - 1 == first) printf(" h.%d", first);
                else printf(" h.%d-%d", first, i - 1);
                first = -1;
            }
        }
        if (smp_module_partition(g->ln_f) == k) printf(" ln_f");
        if (head == k) printf(" lm_head(=wte)");
    }
    printf("\n");
}

/* The step body of generation: the logits at position *pos of each row.
   One row per microbatch (what context_logits runs) is returned as a view,
   so the logits may be on the device (smp copies them to the host). */
SMP_STEP_BODY(next_logits_body) {
    const smp_tensor *logits = smp_mb_output(mb, 0);
    int pos = *(const int *)smp_mb_user(mb), rows = (int)logits->shape[0], T = (int)logits->shape[1],
        V = (int)logits->shape[2];
    int tp = smp_tp_size();
    if (tp > 1) { /* this rank's columns of each row's logits: the rows joined from the TP group (host: gpt.c) */
        size_t bytes = sizeof(float) * (size_t)rows * V;
        float *mine = (float *)malloc(bytes), *all = (float *)malloc(bytes * tp), *out = (float *)malloc(bytes * tp);
        smp_status st = mine && all && out ? SMP_OK : smp_error(SMP_ERR_NOMEM, "out of memory");
        for (int r = 0; r < rows && !st; r++)
            memcpy(mine + (size_t)r * V, (const float *)logits->data + ((size_t)r * T + pos) * V,
                   sizeof(float) * (size_t)V);
        smp_tensor a = smp_tensor_1d(mine, SMP_F32, (int64_t)rows * V);
        smp_tensor b = smp_tensor_1d(all, SMP_F32, (int64_t)rows * V * tp);
        if (!st) st = smp_all_gather(&a, &b, SMP_TP_GROUP); /* [tp rank][row][column] */
        for (int q = 0; q < tp && !st; q++)
            for (int r = 0; r < rows; r++)
                memcpy(out + ((size_t)r * tp + q) * V, all + ((size_t)q * rows + r) * V, sizeof(float) * (size_t)V);
        smp_tensor t = smp_tensor_2d(out, SMP_F32, rows, (int64_t)V * tp);
        if (!st) st = smp_mb_return(mb, 0, &t);
        free(mine); free(all); free(out);
        return st;
    }
    if (rows == 1) {
        smp_tensor t = smp_tensor_2d((float *)logits->data + (size_t)pos * V, SMP_F32, 1, V);
        t.device = logits->device;
        return smp_mb_return(mb, 0, &t);
    }
    if (logits->device != SMP_HOST)
        return smp_error(SMP_ERR_ARG, "next_logits_body: device logits take one row per microbatch");
    float *out = (float *)malloc(sizeof(float) * (size_t)rows * V);
    if (!out) return smp_error(SMP_ERR_NOMEM, "out of memory");
    for (int r = 0; r < rows; r++)
        memcpy(out + (size_t)r * V, (const float *)logits->data + ((size_t)r * T + pos) * V, sizeof(float) * (size_t)V);
    smp_tensor t = smp_tensor_2d(out, SMP_F32, rows, V);
    smp_status st = smp_mb_return(mb, 0, &t);
    free(out);
    return st;
}

/* The logits of the character after ctx[0 .. len), on every rank: `rows`
   copies of the context (a batch must fill the microbatches), padded with
   id 0 to S >= len characters (the attention is causal: what comes after
   position len - 1 does not change it), through an evaluation step;
   logits gets the first row's V (every row's are the same; with
   prescaled_batch false the step ran the TP group's rows joined), x is
   scratch of rows x S ids. */
static smp_status context_logits(smp_model *model, const int32_t *ctx, int len, int S, int rows, int V, int32_t *x,
                                 float *logits) {
    int pos = len - 1;
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < S; t++) x[(size_t)r * S + t] = t < len ? ctx[t] : 0;
    smp_tensor xt = smp_tensor_2d(x, SMP_I32, rows, S);
    smp_step_output lo;
    memset(&lo, 0, sizeof lo);
    smp_status st = SMP_EVAL_STEP(model, next_logits_body, &pos, &lo, 1, xt, xt);
    if (!st && smp_tensor_numel(&lo.values[0]) < V)
        st = smp_error(SMP_ERR_STATE, "context_logits: the first microbatch returned %lld logits, fewer than %d",
                       (long long)smp_tensor_numel(&lo.values[0]), V);
    if (!st) memcpy(logits, lo.values[0].data, sizeof(float) * (size_t)V);
    smp_step_output_free(&lo);
    return st;
}

/* --logits TEXT: "logits Z0 Z1 ..." on rank 0, the logits of the character
   after TEXT (the whole text, unpadded, as one sequence per microbatch), in
   %a: what a test compares bit for bit across partitionings and against
   PyTorch. */
static smp_status print_context_logits(smp_model *model, const corpus *c, const char *text, int rows) {
    int len = (int)strlen(text), V = c->vocab;
    int32_t *ctx = encode(c, text, (size_t)len), *x = (int32_t *)malloc(sizeof(int32_t) * (size_t)rows * len);
    float *logits = (float *)malloc(sizeof(float) * (size_t)rows * V);
    smp_status st = ctx && x && logits ? context_logits(model, ctx, len, len, rows, V, x, logits)
                                       : smp_error(SMP_ERR_NOMEM, "out of memory");
    if (!st && smp_rank() == 0) {
        printf("logits");
        for (int j = 0; j < V; j++) printf(" %a", logits[j]);
        printf("\n");
        fflush(stdout);
    }
    free(ctx); free(x); free(logits);
    return st;
}

/* Generates n characters after the prompt: every step runs the last T
   characters (padded after the end) through an evaluation step. Every row
   of the batch carries the same context. Every rank of the replica samples
   from the same logits with the same generator, so all agree on each
   character. */
static smp_status generate(smp_model *model, const corpus *c, const options *o, int rows, char **text) {
    int T = o->model.block_size, V = c->vocab;
    size_t plen = strlen(o->prompt), cap = plen + (size_t)o->sample_len + 1;
    int32_t *ctx = (int32_t *)malloc(sizeof(int32_t) * cap), *x = (int32_t *)malloc(sizeof(int32_t) * (size_t)rows * T);
    float *logits = (float *)malloc(sizeof(float) * (size_t)rows * V);
    char *out = (char *)malloc(cap);
    smp_status st = ctx && x && logits && out ? SMP_OK : smp_error(SMP_ERR_NOMEM, "out of memory");
    if (!st && !plen) st = smp_error(SMP_ERR_ARG, "the prompt is empty");
    for (size_t i = 0; i < plen && !st; i++) {
        int id = c->id_of[(unsigned char)o->prompt[i]];
        if (id < 0)
            st = smp_error(SMP_ERR_ARG, "the prompt's character %zu (byte 0x%02x) is not in the vocabulary", i,
                           (unsigned char)o->prompt[i]);
        ctx[i] = id;
    }
    size_t n = plen;
    mlp_rng rng = mlp_rng_seed((uint64_t)o->seed * 7919u + 17u);
    for (int k = 0; k < o->sample_len && !st; k++) {
        size_t start = n > (size_t)T ? n - (size_t)T : 0;
        if ((st = context_logits(model, ctx + start, (int)(n - start), T, rows, V, x, logits))) break;
        /* row 0: sample at the temperature (0: greedy) */
        int best = 0;
        for (int j = 1; j < V; j++) best = logits[j] > logits[best] ? j : best;
        int next = best;
        if (o->temperature > 0) {
            double sum = 0, p[256];
            for (int j = 0; j < V; j++) sum += p[j] = exp((double)(logits[j] - logits[best]) / o->temperature);
            double u = (double)(mlp_rng_next(&rng) >> 11) * (1.0 / 9007199254740992.0) * sum, acc = 0;
            for (next = 0; next < V - 1; next++) if ((acc += p[next]) > u) break;
        }
        ctx[n++] = next;
    }
    for (size_t i = 0; i < n && !st; i++) out[i] = (char)c->chars[ctx[i]];
    if (!st) { out[n] = 0; *text = out; }
    else free(out);
    free(ctx); free(x); free(logits);
    return st;
}

/* "param NAME HASH": a 64-bit FNV-1a of a host tensor's bytes. */
static void print_param_digest(const char *name, const smp_tensor *t) {
    const unsigned char *b = (const unsigned char *)t->data;
    size_t nb = smp_tensor_nbytes(t);
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t k = 0; k < nb; k++) h = (h ^ b[k]) * 0x100000001b3ull;
    printf("param %s %016llx\n", name, (unsigned long long)h);
}

/* The digest of every parameter, gathered on rank 0. */
static smp_status print_digest(smp_model *model) {
    smp_state_dict sd;
    memset(&sd, 0, sizeof sd);
    smp_status st = smp_model_state_dict(model, NULL, 0, &sd);
    if (st) return st;
    for (int i = 0; i < sd.n; i++) print_param_digest(sd.entries[i].name, &sd.entries[i].tensor);
    smp_state_dict_free(&sd);
    return SMP_OK;
}

/* Every rank returns together: the first failure's message, on rank 0 and on the rank that failed. */
static int fail_all(smp_status st, const char *what) {
    int bad = st != SMP_OK, any = bad;
    MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_LOR, MPI_COMM_WORLD);
    if (bad) fprintf(stderr, "gpt: rank %d: %s: %s\n", smp_rank(), what, smp_last_error());
    return any;
}

/* The metadata of gpt.c's files: the vocabulary (its bytes in id order, in
   hex) and the model's sizes, which --generate and the Python checks read. */
typedef struct ckpt_meta {
    char hex[2 * 256 + 1], v[16], L[16], H[16], C[16], T[16], steps[16], loss[40];
    const char *keys[8], *vals[8];
    int n;
} ckpt_meta;

static void ckpt_meta_init(ckpt_meta *m, const corpus *text, const options *o) {
    for (int i = 0; i < text->vocab; i++) snprintf(m->hex + 2 * i, 3, "%02x", text->chars[i]);
    snprintf(m->v, sizeof m->v, "%d", text->vocab);
    snprintf(m->L, sizeof m->L, "%d", o->model.n_layer);
    snprintf(m->H, sizeof m->H, "%d", o->model.n_head);
    snprintf(m->C, sizeof m->C, "%d", o->model.n_embd);
    snprintf(m->T, sizeof m->T, "%d", o->model.block_size);
    snprintf(m->steps, sizeof m->steps, "%d", o->steps);
    const char *keys[] = {"vocab_bytes", "vocab_size", "n_layer", "n_head", "n_embd", "block_size", "step"};
    const char *vals[] = {m->hex, m->v, m->L, m->H, m->C, m->T, m->steps};
    m->n = 7;
    memcpy(m->keys, keys, sizeof keys);
    memcpy(m->vals, vals, sizeof vals);
}

/* ---------------------------------------------------------------- checkpoints for training */
/* --save-at N: the checkpoint after step N of --steps, with AdamW's state, needs a --save path and a step that
   leaves training to do. */
static smp_status check_save_at(const options *o) {
    if (!o->save_at || (o->save_at < o->steps && o->save && *o->save)) return SMP_OK;
    return smp_error(SMP_ERR_ARG,
                     "--save-at %d: the checkpoint after step %d of %d needs a --save path and a step before the "
                     "last: give --save PATH and --save-at 1 to %d",
                     o->save_at, o->save_at, o->steps, o->steps - 1);
}

/* The full checkpoint o->save (--partial with `state`: a partial one): the
   parameters under nanoGPT's names at any tp (c_attn's q, k and v blocks
   joined), and with `state` (--save-at, after `step` steps) AdamW's
   registered state as "optimizer.*" tensors, which --load continues from.
   Both programs register it alike, so each resumes the other's: per
   parameter "exp_avg" and "exp_avg_sq" over the elements its replica
   updates (smp stores them in the parameter's full shape, joined from the
   replicas' owned ranges under --shard-optimizer), and "step", AdamW's
   count of updates (i64). All f32 (gpt.cu --bf16 too: its master weights
   and moments are f32; bf16 copies exist only inside its GEMMs).
   Collective. */
static smp_status save_checkpoint(smp_model *model, const options *opt, const corpus *text, smp_optimizer *state,
                                  int step) {
    ckpt_meta m;
    ckpt_meta_init(&m, text, opt);
    if (state) snprintf(m.steps, sizeof m.steps, "%d", step);
    smp_save_desc sd;
    memset(&sd, 0, sizeof sd);
    sd.partial = state && opt->partial ? SMP_ON : SMP_OFF; /* --partial: the --save-at checkpoint */
    sd.optimizer = state;
    sd.meta_keys = m.keys;
    sd.meta_values = m.vals;
    sd.nmeta = m.n;
    smp_status st = smp_save(model, opt->save, &sd);
    if (!st && smp_rank() == 0) {
        if (state)
            printf("checkpoint: %s after step %d, with AdamW's state%s\n", opt->save, step,
                   sd.partial == SMP_ON ? " (partial)" : "");
        else
            printf("checkpoint: %s (nanoGPT's parameter names; lm_head.weight is transformer.wte.weight)\n",
                   opt->save);
        fflush(stdout);
    }
    return st;
}

/* What load_training checks in the file before smp_load touches anything:
   a checkpoint of gpt.c or gpt.cu on this corpus, of this run's model, and
   with AdamW's state one that leaves steps to train. */
static smp_status check_training_checkpoint(smp_ckpt_file *f, const options *opt, const corpus *text,
                                            bool with_state, int *start) {
    ckpt_meta m;
    ckpt_meta_init(&m, text, opt);
    const char *hex = smp_ckpt_meta(f, "vocab_bytes"), *step = smp_ckpt_meta(f, "step");
    const char *L = smp_ckpt_meta(f, "n_layer"), *H = smp_ckpt_meta(f, "n_head"), *C = smp_ckpt_meta(f, "n_embd"),
               *T = smp_ckpt_meta(f, "block_size");
    const smp_ckpt_info *wte = opt->partial ? NULL : smp_ckpt_find(f, "transformer.wte.weight");
    if (!hex || strcmp(hex, m.hex))
        return smp_error(SMP_ERR_ARG, "--load %s: %s: load a checkpoint of gpt.c or gpt.cu trained on this --data",
                         opt->load, hex ? "its vocabulary is not this corpus's" : "its metadata has no vocabulary");
    if (!L || !H || !C || !T || strcmp(L, m.L) || strcmp(H, m.H) || strcmp(C, m.C) || strcmp(T, m.T) ||
        (wte && wte->ndim == 2 && wte->shape[0] != opt->model.vocab))
        return smp_error(SMP_ERR_ARG,
                         "--load %s: it holds a model of %s layers, width %s, %s heads, context %s and %lld token "
                         "ids, this run builds %d, %d, %d, %d and %d: give the --layers, --dmodel, --heads, "
                         "--context (and gpt.cu's --vocab-multiple) of the run that saved it",
                         opt->load, L ? L : "?", C ? C : "?", H ? H : "?", T ? T : "?",
                         wte && wte->ndim == 2 ? (long long)wte->shape[0] : -1LL, opt->model.n_layer,
                         opt->model.n_embd, opt->model.n_head, opt->model.block_size, opt->model.vocab);
    if (with_state && (!step || (*start = atoi(step)) < 1 || *start >= opt->steps))
        return smp_error(SMP_ERR_ARG,
                         "--load %s: it was saved after step %s, which leaves nothing of --steps %d to train: give "
                         "the --steps of the run that saved it",
                         opt->load, step ? step : "(none)", opt->steps);
    return SMP_OK;
}

/* --load for training: the checkpoint's weights, into any (pp, tp, dp);
   with AdamW's state in it (--save-at) that state too, and *start becomes
   the step it was saved after, so the run goes on as the one that saved it
   would have (the same batches and learning rates: give the same --steps);
   without, AdamW starts afresh at step 0 (gpt.cu --steps 0, which only
   evaluates, loads the weights alone). Its vocabulary and sizes must be
   this run's, and state, where it has any, all of AdamW's: an error on
   every rank otherwise, before any parameter changes. --partial: a partial
   checkpoint (its metadata from the file of partition 0). Collective. */
static smp_status load_training(smp_model *model, const options *opt, const corpus *text, smp_optimizer *state,
                                int *start) {
    smp_ckpt_file *f = NULL;
    char first[4096];
    smp_status st = opt->partial ? smp_ckpt_partial_file(opt->load, 0, first, sizeof first, NULL) : SMP_OK;
    if (!st) st = smp_ckpt_open(opt->partial ? first : opt->load, &f);
    bool with_state = false;
    *start = 0;
    if (!st) {
        for (int i = 0; i < smp_ckpt_count(f); i++)
            with_state |= !strncmp(smp_ckpt_info_at(f, i)->name, SMP_CKPT_OPTIMIZER_PREFIX,
                                   strlen(SMP_CKPT_OPTIMIZER_PREFIX));
        with_state &= opt->steps > 0;
        st = check_training_checkpoint(f, opt, text, with_state, start);
        smp_ckpt_close(f);
    }
    int bad = st != SMP_OK; /* smp_load is collective: every rank goes on, or none */
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_LOR, MPI_COMM_WORLD);
    if (bad && !st)
        st = smp_error(SMP_ERR_STATE, "--load %s: another rank could not use it (its message says why)", opt->load);
    if (!st) {
        smp_load_desc ld;
        memset(&ld, 0, sizeof ld);
        ld.partial = opt->partial ? SMP_ON : SMP_OFF;
        ld.optimizer = with_state ? state : NULL;
        st = smp_load(model, opt->load, &ld);
        if (st && with_state) { /* smp names the tensor; say what to do about it */
            char why[2048];
            snprintf(why, sizeof why, "%s", smp_last_error());
            st = smp_error(st,
                           "%s: it holds AdamW's state, but not all of it that this run's optimizer registers: resume "
                           "from a --save-at checkpoint of the same model, whole, or start AdamW afresh from one "
                           "without optimizer state (--save at the end of a run)",
                           why);
        }
    }
    if (!st && smp_rank() == 0) {
        printf("gpt: starting from %s%s", opt->load, with_state ? ", with AdamW's state, at step " : "\n");
        if (with_state) printf("%d\n", *start);
        fflush(stdout);
    }
    return st;
}

/* ---------------------------------------------------------------- pipelined generation (--generate) */
/* The step body of pipelined generation: the logits at position pick[mb]
   of the microbatch's one sequence (a view: on the device, smp copies them
   to the host). */
SMP_STEP_BODY(pick_logits_body) {
    const smp_tensor *logits = smp_mb_output(mb, 0);
    const int *pick = (const int *)smp_mb_user(mb);
    int S = (int)logits->shape[1], V = (int)logits->shape[2], at = pick[smp_mb_index(mb)], tp = smp_tp_size();
    if (logits->shape[0] != 1 || at < 0 || at >= S)
        return smp_error(SMP_ERR_ARG, "generation: position %d of a [%d, %d] microbatch", at, (int)logits->shape[0], S);
    smp_tensor t = smp_tensor_2d((float *)logits->data + (size_t)at * V, SMP_F32, 1, V);
    t.device = logits->device;
    if (tp == 1) return smp_mb_return(mb, 0, &t);
    float *all = (float *)malloc(sizeof(float) * (size_t)V * tp); /* tp > 1: gpt.c's host model */
    if (!all) return smp_error(SMP_ERR_NOMEM, "generation: out of memory for a row of %d logits", V * tp);
    smp_tensor row = smp_tensor_2d(all, SMP_F32, 1, (int64_t)V * tp);
    smp_status st = smp_all_gather(&t, &row, SMP_TP_GROUP);
    if (!st) st = smp_mb_return(mb, 0, &row);
    free(all);
    return st;
}

/* The next token from one row of logits: greedy at temperature 0, else
   drawn from softmax(logits / temperature) with the prompt's generator. */
static int sample_token(const float *logits, int V, float temperature, mlp_rng *rng) {
    int best = 0;
    for (int j = 1; j < V; j++) best = logits[j] > logits[best] ? j : best;
    if (temperature <= 0) return best;
    double sum = 0, p[256];
    for (int j = 0; j < V; j++) sum += p[j] = exp((double)(logits[j] - logits[best]) / temperature);
    double u = (double)(mlp_rng_next(rng) >> 11) * (1.0 / 9007199254740992.0) * sum, acc = 0;
    int next;
    for (next = 0; next < V - 1; next++)
        if ((acc += p[next]) > u) break;
    return next;
}

/* Builds the model of a checkpoint's sizes in this run's partitioning:
   gpt.c's host model, or gpt.cu's on the device (user: its engine). */
typedef smp_status (*gen_build_fn)(gpt *net, const gpt_config *mc, void *user, smp_model **model);

typedef struct gen_state {
    gpt_config mc; /* the checkpoint's sizes and vocabulary (its embedding's rows: gpt.cu may pad them) */
    int nchars;    /* the corpus's ids, 0 .. nchars - 1: the only ones printed and drawn */
    unsigned char chars[256];
    int id_of[256];
    int M, N;       /* prompts (one per microbatch), characters to generate */
    int32_t **ctx;  /* [M]: each prompt's context so far, len[i] ids */
    int *len, *pick;
    int32_t *x;     /* a step's input, [M, S] */
    float *logits;  /* a step's [M, V] */
    mlp_rng *rng;
    gpt net;
    smp_model *model;
} gen_state;

static void gen_free(gen_state *s) {
    if (s->model) smp_model_free(s->model);
    gpt_free(&s->net);
    for (int i = 0; s->ctx && i < s->M; i++) free(s->ctx[i]);
    free(s->ctx); free(s->len); free(s->pick); free(s->rng); free(s->x); free(s->logits);
    memset(s, 0, sizeof *s);
}

/* The model's sizes and vocabulary, from the checkpoint's metadata. */
static smp_status gen_read_checkpoint(gen_state *s, const char *path) {
    smp_ckpt_file *f = NULL;
    SMP_TRY(smp_ckpt_open(path, &f));
    const char *hex = smp_ckpt_meta(f, "vocab_bytes"), *L = smp_ckpt_meta(f, "n_layer"), *H = smp_ckpt_meta(f, "n_head"),
               *C = smp_ckpt_meta(f, "n_embd"), *Tb = smp_ckpt_meta(f, "block_size");
    smp_status st = SMP_OK;
    if (!hex || !L || !H || !C || !Tb || strlen(hex) % 2 || strlen(hex) > 512)
        st = smp_error(SMP_ERR_FORMAT,
                       "%s: not a checkpoint of gpt.c or gpt.cu (its metadata lacks the vocabulary or the sizes)", path);
    else {
        const smp_ckpt_info *wte = smp_ckpt_find(f, "transformer.wte.weight");
        s->nchars = (int)strlen(hex) / 2;
        /* gpt.cu --vocab-multiple: rows past the corpus's ids, which no token ever is */
        s->mc.vocab = wte && wte->ndim == 2 && wte->shape[0] > s->nchars ? (int)wte->shape[0] : s->nchars;
        s->mc.n_layer = atoi(L);
        s->mc.n_head = atoi(H);
        s->mc.n_embd = atoi(C);
        s->mc.block_size = atoi(Tb);
        for (int i = 0; i < s->nchars; i++) {
            unsigned v = 0;
            sscanf(hex + 2 * i, "%2x", &v);
            s->chars[i] = (unsigned char)v;
            s->id_of[v] = i;
        }
    }
    smp_ckpt_close(f);
    return st;
}

/* The prompts ("A|B|C", one per microbatch): in the vocabulary, and each
   context within the model's. */
static smp_status gen_read_prompts(gen_state *s, const options *o) {
    const char *q = o->prompts;
    for (int i = 0; i < s->M; i++) {
        const char *end = strchr(q, '|');
        s->len[i] = end ? (int)(end - q) : (int)strlen(q);
        if (s->len[i] < 1) return smp_error(SMP_ERR_ARG, "prompt %d is empty", i);
        if (s->len[i] + s->N > s->mc.block_size)
            return smp_error(SMP_ERR_ARG,
                             "prompt %d: a context of %d characters (%d of prompt + %d tokens) is longer than the "
                             "model's %d",
                             i, s->len[i] + s->N, s->len[i], s->N, s->mc.block_size);
        if (!(s->ctx[i] = (int32_t *)malloc(sizeof(int32_t) * (size_t)s->mc.block_size)))
            return smp_error(SMP_ERR_NOMEM, "out of memory");
        for (int t = 0; t < s->len[i]; t++) {
            int id = s->id_of[(unsigned char)q[t]];
            if (id < 0)
                return smp_error(SMP_ERR_ARG, "prompt %d's character %d (byte 0x%02x) is not in the vocabulary", i, t,
                                 (unsigned char)q[t]);
            s->ctx[i][t] = id;
        }
        s->rng[i] = mlp_rng_seed(mlp_mix64((uint64_t)o->seed * 7919u + 17u) ^ mlp_mix64((uint64_t)i + 1));
        q = end ? end + 1 : q + s->len[i];
    }
    return SMP_OK;
}

/* Step k: one character more for every prompt. With the KV cache the first
   step runs the prompts (padded on the right to the longest) and every
   later step only the last character of each, at its position; without
   it, each step runs the whole contexts. */
static smp_status gen_step(gen_state *s, const options *o, int k) {
    int M = s->M, V = s->mc.vocab, S = 0;
    gpt_kv *kv = s->net.kv;
    if (!kv || k == 0) { /* whole contexts (k == 0: the prompts), padded on the right */
        for (int i = 0; i < M; i++) S = s->len[i] > S ? s->len[i] : S;
        for (int i = 0; i < M; i++) {
            for (int t = 0; t < S; t++) s->x[(size_t)i * S + t] = t < s->len[i] ? s->ctx[i][t] : 0;
            s->pick[i] = s->len[i] - 1;
            if (kv) kv->pos[i] = 0;
        }
    } else { /* the last character of each, at its position */
        S = 1;
        for (int i = 0; i < M; i++) {
            s->x[i] = s->ctx[i][s->len[i] - 1];
            s->pick[i] = 0;
            kv->pos[i] = s->len[i] - 1;
        }
    }
    smp_tensor xt = smp_tensor_2d(s->x, SMP_I32, M, S);
    smp_step_output lo;
    memset(&lo, 0, sizeof lo);
    SMP_TRY(SMP_EVAL_STEP(s->model, pick_logits_body, s->pick, &lo, 1, xt));
    smp_tensor all = smp_tensor_2d(s->logits, SMP_F32, M, V);
    smp_status st = smp_step_output_concat(&lo, &all);
    smp_step_output_free(&lo);
    for (int i = 0; i < M && !st && o->print_logits && smp_rank() == 0; i++) { /* "logits STEP PROMPT Z0 Z1 ...", %a */
        printf("logits %d %d", k, i);
        for (int j = 0; j < s->nchars; j++) printf(" %a", s->logits[(size_t)i * V + j]);
        printf("\n");
    }
    for (int i = 0; i < M && !st; i++)
        s->ctx[i][s->len[i]++] = sample_token(s->logits + (size_t)i * V, s->nchars, o->temperature, &s->rng[i]);
    return st;
}

static int gen_run(gen_state *s, const options *o, gen_build_fn build, void *user) {
    const smp_config *cfg = smp_current_config();
    bool root = smp_rank() == 0;
    s->M = cfg->microbatches;
    s->N = o->tokens;
    for (int b = 0; b < 256; b++) s->id_of[b] = -1;
    s->ctx = (int32_t **)calloc((size_t)s->M, sizeof *s->ctx);
    s->len = (int *)calloc((size_t)s->M, sizeof *s->len);
    s->pick = (int *)calloc((size_t)s->M, sizeof *s->pick);
    s->rng = (mlp_rng *)calloc((size_t)s->M, sizeof *s->rng);
    smp_status st = s->ctx && s->len && s->pick && s->rng ? SMP_OK : smp_error(SMP_ERR_NOMEM, "out of memory");
    if (!st && smp_rdp_size() != 1)
        st = smp_error(SMP_ERR_CONFIG,
                       "--generate runs without data parallelism: run as many processes as --partitions x --tp");
    if (!st) st = gen_read_checkpoint(s, o->load);
    if (!st) st = gen_read_prompts(s, o);
    if (fail_all(st, "input")) return 1;

    /* the model in this partitioning, then the checkpoint into it */
    st = build(&s->net, &s->mc, user, &s->model);
    if (!st) {
        s->x = (int32_t *)calloc((size_t)s->M * s->mc.block_size, sizeof *s->x);
        s->logits = (float *)malloc(sizeof(float) * (size_t)s->M * s->mc.vocab);
        if (!s->x || !s->logits) st = smp_error(SMP_ERR_NOMEM, "out of memory");
    }
    if (!st) {
        smp_tensor sample = smp_tensor_2d(s->x, SMP_I32, 1, s->mc.block_size);
        st = smp_model_trace(s->model, &sample, 1);
    }
    if (!st) {
        smp_load_desc ld;
        memset(&ld, 0, sizeof ld);
        ld.partial = SMP_OFF;
        st = smp_load(s->model, o->load, &ld);
    }
    if (fail_all(st, "loading the checkpoint")) return 1;
    if (root) {
        printf("gpt: generating %d characters for %d prompts (one per microbatch) on %d partitions x %d "
               "tensor-parallel, %s, temperature %.2f, seed %d\n",
               s->N, s->M, cfg->partitions, smp_tp_size(),
               o->no_cache ? "re-running the whole context" : "KV cache (split by heads)", o->temperature, o->seed);
        fflush(stdout);
    }
    print_placement(s->model, &s->net);
    if (!o->no_cache && fail_all(gpt_kv_start(&s->net, s->M), "KV cache")) return 1;

    double t0 = now();
    for (int k = 0; k < s->N && !st; k++) st = gen_step(s, o, k);
    if (fail_all(st, "generation")) return 1;
    double secs = now() - t0;
    if (root) {
        printf("generated %d x %d characters in %.3f s (%.0f characters/s)\n", s->M, s->N, secs,
               (double)s->M * s->N / secs);
        for (int i = 0; i < s->M; i++) {
            printf("--- prompt %d:\n", i);
            for (int t = 0; t < s->len[i]; t++) putchar(s->chars[s->ctx[i][t]]);
            putchar('\n');
        }
        fflush(stdout);
    }
    return 0;
}

/* --generate: loads the full checkpoint o->load (its sizes and vocabulary
   from its metadata) into this run's partitioning and continues every
   prompt of o->prompts ("A|B|C|D", one per microbatch) by o->tokens
   characters, one evaluation step per character for all prompts at once,
   so the prompts flow through the stages one behind the other; the KV
   cache (default; --no-cache re-runs each whole context) makes each
   character after the prompt cost one position. Every rank checks the
   input before anything runs, and samples the same characters from the
   same logits. Returns the exit code. Collective. */
static int generate_main(const options *o, gen_build_fn build, void *user) {
    gen_state s;
    memset(&s, 0, sizeof s);
    int rc = gen_run(&s, o, build, user);
    gen_free(&s);
    return rc;
}

#endif
