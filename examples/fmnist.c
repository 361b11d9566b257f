/* fmnist.c - Fashion-MNIST trained split across processes with smp.

   An MLP (784 -> 256 -> 256 -> 128 -> 128 -> 10, ReLU) whose layers are
   smp modules; smp splits them into pipeline stages (partitions) and, with
   "ddp", trains several replicas on shards of the data. The loop follows
   SageMaker's reference training script line by line:

     reference (PyTorch + smp)                   this file (C + smp)
     smp.init()                                  smp_init(&cfg)
     torch.cuda.set_device(smp.local_rank())     (CPU: one BLAS thread per rank)
     dataset sharded by smp.dp_rank()            smp_sampler_indices(...)
     DataLoader(..., drop_last=True)             sampler.drop_last = true
     model = smp.DistributedModel(Net())         smp_model_new(root, ...)
     optimizer = smp.DistributedOptimizer(...)   Adam state per local parameter
     @smp.step def train_step(model, x, y)       SMP_STEP_BODY(train_body)
     optimizer.zero_grad()                       smp_model_zero_grad(model)
     _, loss_mb = train_step(model, x, y)        SMP_TRAIN_STEP(model, train_body, ...)
     loss = loss_mb.reduce_mean()                smp_step_output_mean(&loss_mb)
     optimizer.step()                            adam_step(&opt, model)
     if smp.dp_rank() == 0: smp.save(...)        smp_save(...) (only dp rank 0 writes)

   Build: mpicc -std=c11 -O2 -Iexamples -I. examples/fmnist.c -o fmnist -lopenblas -lz -lm
   Run:   mpirun -n 2 ./fmnist                      (2 partitions)
          mpirun -n 4 ./fmnist --partitions 2 --ddp (2 partitions x 2 replicas)
          ./fmnist --config '{"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "ddp": true}'
*/
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "mlp_engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------- options */
typedef struct options {
    int epochs, batch, seed, log_every;
    float lr, lr_decay;
    const char *data_dir, *config_json;
    smp_config cfg;
    long max_steps; /* stop after this many steps (tests); 0: no limit */
    bool print_losses; /* every step's loss, exactly (tests compare runs bit for bit) */
} options;

static void usage(const char *prog) {
    fprintf(stderr,
            "usage: %s [--epochs N] [--batch B] [--lr X] [--lr-decay X] [--seed S]\n"
            "          [--partitions P] [--microbatches M] [--pipeline simple|interleaved]\n"
            "          [--ddp] [--deterministic] [--manual] [--config JSON] [--data DIR]\n"
            "  --batch is the global batch: every replica gets batch / replicas rows\n"
            "  --manual places layers with SMP_PARTITION contexts instead of auto-partitioning\n",
            prog);
}

static int parse_options(int argc, char **argv, options *o) {
    memset(o, 0, sizeof *o);
    o->epochs = 6;
    o->batch = 128;
    o->lr = 1e-3f;
    o->lr_decay = 0.7f;
    o->seed = 1;
    o->cfg.partitions = 2;
    o->cfg.microbatches = 4;
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
        else if (OPT("--pipeline")) o->cfg.pipeline = !strcmp(v, "simple") ? SMP_PIPELINE_SIMPLE : SMP_PIPELINE_INTERLEAVED;
        else if (OPT("--config")) o->config_json = v;
        else if (OPT("--data")) o->data_dir = v;
        else if (OPT("--max-steps")) o->max_steps = atol(v);
        else if (!strcmp(a, "--print-losses")) o->print_losses = true;
        else if (!strcmp(a, "--ddp")) o->cfg.ddp = SMP_ON;
        else if (!strcmp(a, "--deterministic")) o->cfg.deterministic_reduction = SMP_ON;
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

/* ---------------------------------------------------------------- layers as smp modules */
enum { NLAYERS = 5 };
static const int widths[NLAYERS + 1] = {FM_PIXELS, 256, 256, 128, 128, FM_CLASSES};

typedef struct linear { smp_param *weight, *bias; int in, out; } linear;

static smp_status linear_forward(smp_call_ctx *c) {
    const linear *l = smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    int n = (int)x->shape[0];
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, (int64_t[]){n, l->out});
    mlp_linear_forward(x->data, smp_param_value(l->weight)->data, smp_param_value(l->bias)->data, y->data, n, l->in, l->out);
    return SMP_OK;
}

static smp_status linear_backward(smp_call_ctx *c) {
    const linear *l = smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0); /* NULL for the first layer: images need no gradient */
    mlp_linear_backward(x->data, smp_param_value(l->weight)->data, dy->data, dx ? dx->data : NULL,
                        smp_param_grad(l->weight)->data, smp_param_grad(l->bias)->data, (int)x->shape[0], l->in, l->out);
    return SMP_OK;
}

static smp_status relu_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    mlp_relu_forward(x->data, y->data, (size_t)smp_tensor_numel(x));
    return SMP_OK;
}

static smp_status relu_backward(smp_call_ctx *c) {
    const smp_tensor *y = smp_call_output_value(c, 0), *dy = smp_call_grad_output(c, 0);
    smp_tensor *dx = smp_call_grad_input(c, 0);
    if (dx) mlp_relu_backward(y->data, dy->data, dx->data, (size_t)smp_tensor_numel(y));
    return SMP_OK;
}

/* Kaiming-uniform weights, zero biases; smp hands each parameter its own seed. */
static void init_weight(smp_tensor *w, uint64_t seed, void *user) {
    (void)user;
    mlp_init(w->data, (size_t)smp_tensor_numel(w), "weight", seed, mlp_kaiming_bound((int)w->shape[1]));
}

typedef struct mlp {
    smp_module *root, *fc[NLAYERS], *act[NLAYERS - 1];
    linear lin[NLAYERS];
} mlp;

static smp_status mlp_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m, (void)nin, (void)nout;
    mlp *net = user;
    smp_tensor h = in[0];
    for (int i = 0; i < NLAYERS; i++) {
        smp_status st = smp_call(net->fc[i], &h, 1, i == NLAYERS - 1 ? out : &h, 1);
        if (!st && i < NLAYERS - 1) st = smp_call(net->act[i], &h, 1, &h, 1);
        if (st) return st;
    }
    return SMP_OK;
}

/* Builds the model. With --manual the layers go to partitions by
   SMP_PARTITION contexts, as in the reference's manual-partitioning script;
   otherwise smp splits the traced calls itself. */
static smp_status build_model(mlp *net, int partitions, smp_model **model) {
    static const smp_module_desc fc = {linear_forward, linear_backward, NULL}, relu = {relu_forward, relu_backward, NULL};
    net->root = smp_module_new(NULL, "", NULL);
    for (int i = 0; i < NLAYERS; i++) {
        char name[16];
        SMP_PARTITION(i * partitions / NLAYERS) {
            snprintf(name, sizeof name, "fc%d", i);
            smp_module_desc d = fc;
            d.user = &net->lin[i];
            net->lin[i].in = widths[i];
            net->lin[i].out = widths[i + 1];
            net->fc[i] = smp_module_new(net->root, name, &d);
            net->lin[i].weight = smp_param_new(net->fc[i], "weight", SMP_F32, 2, (int64_t[]){widths[i + 1], widths[i]}, init_weight, NULL);
            net->lin[i].bias = smp_param_new(net->fc[i], "bias", SMP_F32, 1, (int64_t[]){widths[i + 1]}, smp_init_constant, NULL);
            if (i < NLAYERS - 1) {
                snprintf(name, sizeof name, "act%d", i);
                net->act[i] = smp_module_new(net->root, name, &relu);
            }
        }
    }
    return smp_model_new(net->root, &(smp_model_desc){.forward = mlp_forward, .user = net}, model);
}

/* ---------------------------------------------------------------- the step */
/* Runs once per microbatch where the logits live: loss and its gradient. */
SMP_STEP_BODY(train_body) {
    const smp_tensor *logits = smp_mb_output(mb, 0), *labels = smp_mb_arg(mb, 1);
    smp_tensor *dlogits = smp_mb_output_grad(mb, 0); /* NULL in evaluation */
    int n = (int)logits->shape[0];
    float loss = mlp_xent_loss(logits->data, labels->data, n, FM_CLASSES, dlogits ? dlogits->data : NULL, 1.0f / (float)n);
    float correct = (float)mlp_count_correct(logits->data, labels->data, n, FM_CLASSES);
    smp_status st = smp_mb_return_f32(mb, 0, loss);
    return st ? st : smp_mb_return_f32(mb, 1, correct);
}

/* ---------------------------------------------------------------- the optimizer */
/* Adam over this rank's parameters (smp.DistributedOptimizer: each rank
   steps the parameters it owns). */
typedef struct adam {
    mlp_adam_cfg cfg;
    int64_t t;
    float **m, **v;
    int nparams;
} adam;

static void adam_init(adam *o, smp_model *model, float lr) {
    memset(o, 0, sizeof *o);
    o->cfg = mlp_adam_defaults(lr);
    while (smp_model_param(model, o->nparams, false)) o->nparams++;
    o->m = calloc((size_t)o->nparams, sizeof *o->m);
    o->v = calloc((size_t)o->nparams, sizeof *o->v);
    for (int i = 0; i < o->nparams; i++) {
        size_t n = (size_t)smp_tensor_numel(smp_param_value(smp_model_param(model, i, false)));
        o->m[i] = calloc(n, sizeof(float));
        o->v[i] = calloc(n, sizeof(float));
    }
}

static void adam_step(adam *o, smp_model *model) {
    o->t++;
    for (int i = 0; i < o->nparams; i++) {
        smp_param *p = smp_model_param(model, i, false);
        mlp_adam_step(smp_param_value(p)->data, smp_param_grad(p)->data, o->m[i], o->v[i],
                      (size_t)smp_tensor_numel(smp_param_value(p)), o->t, &o->cfg);
    }
}

static void adam_free(adam *o) {
    for (int i = 0; i < o->nparams; i++) { free(o->m[i]); free(o->v[i]); }
    free(o->m);
    free(o->v);
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

/* Pipelined evaluation over a dataset: returns accuracy. */
static smp_status evaluate(smp_model *model, const fm_dataset *ds, int batch, double *accuracy) {
    int64_t n = (int64_t)ds->n / batch * batch, correct = 0;
    for (int64_t at = 0; at < n; at += batch) {
        smp_tensor x = smp_tensor_2d(ds->images + at * FM_PIXELS, SMP_F32, batch, FM_PIXELS);
        smp_tensor y = smp_tensor_1d(ds->labels + at, SMP_U8, batch);
        smp_step_output out[2] = {{0}, {0}};
        smp_status st = SMP_EVAL_STEP(model, train_body, NULL, out, 2, x, y);
        if (st) return st;
        float sum;
        smp_step_output_reduce_sum(&out[1], &(smp_tensor){.data = &sum, .dtype = SMP_F32});
        correct += (int64_t)sum;
        smp_step_output_free(&out[0]);
        smp_step_output_free(&out[1]);
    }
    *accuracy = n ? (double)correct / (double)n : 0;
    return SMP_OK;
}

static double now(void) { return MPI_Wtime(); }

int main(int argc, char **argv) {
    options opt;
    MPI_Init(&argc, &argv);
    if (parse_options(argc, argv, &opt)) { MPI_Finalize(); return 2; }
    if (smp_init(&opt.cfg)) {                                   /* smp.init() */
        fprintf(stderr, "smp_init: %s\n", smp_last_error());
        MPI_Finalize();
        return 1;
    }
    mlp_set_blas_threads(1); /* a core per rank; the CPU analogue of set_device(local_rank()) */
    const smp_config *cfg = smp_get_config();

    /* the data: every rank reads it; each replica trains on its dp shard */
    char err[512] = "";
    fm_dataset train, test;
    int bad = fm_load_split(&train, opt.data_dir, "train", err, sizeof err) != FM_OK ||
              fm_load_split(&test, opt.data_dir, "t10k", err, sizeof err) != FM_OK;
    smp_status st = smp_error(bad ? SMP_ERR_IO : SMP_OK, "%s", err);
    int64_t local_batch = 0;
    if (!st) st = smp_local_batch_size(opt.batch, &local_batch);
    if (!st && local_batch % cfg->microbatches)
        st = smp_error(SMP_ERR_CONFIG, "batch of %lld per replica does not divide into %d microbatches", (long long)local_batch, cfg->microbatches);
    if (smp_rank() == 0 || bad) {
        if (st) fprintf(stderr, "fmnist: %s\n", smp_last_error());
    }
    int any_bad = st != SMP_OK;
    MPI_Allreduce(MPI_IN_PLACE, &any_bad, 1, MPI_INT, MPI_LOR, MPI_COMM_WORLD);
    if (any_bad) { smp_finalize(); MPI_Finalize(); return 1; }
    float mean, stdev;
    fm_pixel_stats(&train, &mean, &stdev);
    fm_standardize(&train, mean, stdev);
    fm_standardize(&test, mean, stdev);

    mlp net;
    memset(&net, 0, sizeof net);
    smp_model *model;
    if ((st = build_model(&net, cfg->partitions, &model))) {           /* smp.DistributedModel */
        fprintf(stderr, "model: %s\n", smp_last_error());
        smp_finalize(); MPI_Finalize(); return 1;
    }
    smp_sampler_desc sampler = {(int64_t)train.n, local_batch, (uint64_t)opt.seed, true, true};
    int64_t *idx = malloc(sizeof(int64_t) * (train.n / (size_t)smp_dp_size() + 1));
    float *xb = malloc(sizeof(float) * (size_t)local_batch * FM_PIXELS);
    uint8_t *yb = malloc((size_t)local_batch);
    adam opt_state = {0};
    bool optimizer_ready = false;
    long steps = 0;

    if (smp_rank() == 0)
        printf("fmnist: %d processes, %d partitions x %d replicas, batch %d (%lld per replica) in %d microbatches, %s pipeline\n",
               smp_size(), cfg->partitions, smp_dp_size(), opt.batch, (long long)local_batch, cfg->microbatches,
               cfg->pipeline == SMP_PIPELINE_SIMPLE ? "simple" : "interleaved");

    for (int epoch = 0; epoch < opt.epochs && (!opt.max_steps || steps < opt.max_steps); epoch++) {
        int64_t count, batches;
        smp_sampler_indices(&sampler, epoch, idx, &count, &batches);
        if ((st = smp_agree_batches(batches))) break;
        double t0 = now(), loss_sum = 0;
        int64_t b = 0;
        for (; b < batches && (!opt.max_steps || steps < opt.max_steps); b++, steps++) {
            for (int64_t i = 0; i < local_batch; i++) {
                int64_t k = idx[b * local_batch + i];
                memcpy(xb + i * FM_PIXELS, train.images + k * FM_PIXELS, sizeof(float) * FM_PIXELS);
                yb[i] = train.labels[k];
            }
            smp_tensor x = smp_tensor_2d(xb, SMP_F32, local_batch, FM_PIXELS), y = smp_tensor_1d(yb, SMP_U8, local_batch);
            smp_step_output loss_mb = {0};
            smp_model_zero_grad(model);                               /* optimizer.zero_grad() */
            if ((st = SMP_TRAIN_STEP(model, train_body, NULL, &loss_mb, 1, x, y))) break;
            double loss = smp_step_output_mean(&loss_mb);             /* loss_mb.reduce_mean() */
            smp_step_output_free(&loss_mb);
            smp_tensor loss_t = smp_tensor_1d(&loss, SMP_F64, 1);
            smp_all_reduce(&loss_t, &loss_t, SMP_AVG, SMP_DP_GROUP);    /* the global batch's loss */
            if (opt.print_losses && smp_rank() == 0) printf("step %ld loss %a\n", steps, loss);
            if (!optimizer_ready) { adam_init(&opt_state, model, opt.lr); optimizer_ready = true; }
            opt_state.cfg.lr = opt.lr * powf(opt.lr_decay, (float)epoch);
            adam_step(&opt_state, model);                             /* optimizer.step() */
            loss_sum += loss;
            double secs = now() - t0;
            if (b % 20 == 0 || b + 1 == batches)
                progress(epoch + 1, opt.epochs, b + 1, batches, loss_sum / (double)(b + 1),
                         (double)(b + 1) * opt.batch / (secs > 0 ? secs : 1), false);
        }
        if (st) break;
        double secs = now() - t0;
        progress(epoch + 1, opt.epochs, b, batches, loss_sum / (double)b, (double)b * opt.batch / secs, true);
    }
    double accuracy = 0;
    if (!st) st = evaluate(model, &test, 1000, &accuracy);
    if (st) fprintf(stderr, "fmnist: rank %d: %s\n", smp_rank(), smp_last_error());
    else if (smp_rank() == 0) printf("test accuracy: %.4f\n", accuracy);

    if (optimizer_ready) adam_free(&opt_state);
    free(idx); free(xb); free(yb);
    fm_free(&train);
    fm_free(&test);
    smp_model_free(model);
    smp_finalize();
    MPI_Finalize();
    return st ? 1 : 0;
}
