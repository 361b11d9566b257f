/* fmnist.c - Fashion-MNIST trained split across processes with smp.

   An MLP (784 -> 512 -> 512 -> 512 -> 512 -> 10, ReLU) whose layers are
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
     loss = loss_mb.reduce_mean()                smp_step_output_reduce_mean_global_f64(&loss_mb)
       (per replica in SageMaker; smp's _global is the mean over every replica: the whole batch's loss)
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
#include "smp_checkpoint.h"
#include "fmnist_model.h"
#include "fmnist_shared.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- the optimizer */
/* Adam over this rank's parameters (smp.DistributedOptimizer: each rank
   steps the parameters it owns). */
typedef struct adam {
    mlp_adam_cfg cfg;
    int64_t t;
    float **m, **v;
    /* the elements of each parameter this replica updates (all, unless shard_optimizer_state) */
    int64_t *first, *count;
    int nparams;
    smp_optimizer *state; /* what checkpoints save: exp_avg, exp_avg_sq per parameter, the step */
} adam;

/* After partitioning: moments for the local parameters, registered as
   named optimizer state so smp_save / smp_load carry them. */
static smp_status adam_init(adam *o, smp_model *model, float lr) {
    memset(o, 0, sizeof *o);
    o->cfg = mlp_adam_defaults(lr);
    while (smp_model_local_param(model, o->nparams, false)) o->nparams++;
    o->m = calloc((size_t)o->nparams, sizeof *o->m);
    o->v = calloc((size_t)o->nparams, sizeof *o->v);
    o->first = calloc((size_t)o->nparams, sizeof *o->first);
    o->count = calloc((size_t)o->nparams, sizeof *o->count);
    smp_status st = smp_optimizer_new(model, &o->state);
    smp_tensor step = smp_tensor_1d(&o->t, SMP_I64, 1);
    if (!st) st = smp_optimizer_state_add(o->state, NULL, "step", &step);
    for (int i = 0; i < o->nparams && !st; i++) {
        smp_param *p = smp_model_local_param(model, i, false);
        st = smp_param_owned_range(model, p, &o->first[i], &o->count[i]);
        smp_tensor m = *smp_param_value(p), v = m;
        if (smp_current_config()->shard_optimizer_state == SMP_ON) m = v = smp_tensor_1d(NULL, SMP_F32, o->count[i]);
        size_t n = (size_t)o->count[i] + 1;
        m.data = o->m[i] = calloc(n, sizeof(float));
        v.data = o->v[i] = calloc(n, sizeof(float));
        if (!st) st = smp_optimizer_state_add(o->state, smp_param_name(p), "exp_avg", &m);
        if (!st) st = smp_optimizer_state_add(o->state, smp_param_name(p), "exp_avg_sq", &v);
    }
    return st;
}

static void adam_step(adam *o, smp_model *model) {
    o->t++;
    for (int i = 0; i < o->nparams; i++) {
        smp_param *p = smp_model_local_param(model, i, false);
        mlp_adam_step((float *)smp_param_value(p)->data + o->first[i], (float *)smp_param_grad(p)->data + o->first[i],
                      o->m[i], o->v[i], (size_t)o->count[i], o->t, &o->cfg);
    }
}

static void adam_free(adam *o) {
    smp_optimizer_free(o->state);
    for (int i = 0; i < o->nparams; i++) { free(o->m[i]); free(o->v[i]); }
    free(o->m);
    free(o->v);
    free(o->first);
    free(o->count);
}

int main(int argc, char **argv) {
    options opt;
    MPI_Init(&argc, &argv);
    if (parse_options(argc, argv, &opt)) { MPI_Finalize(); return 2; }
    if (smp_init(&opt.cfg)) {                                   /* smp.init() */
        fprintf(stderr, "smp_init: %s\n", smp_last_error());
        MPI_Finalize();
        return 1;
    }
    mlp_set_blas_threads(opt.threads); /* one core per rank by default: the CPU analogue of set_device(local_rank()) */
    const smp_config *cfg = smp_current_config();

    /* the data: every rank reads it; each replica trains on its dp shard */
    char err[512] = "";
    fm_dataset train, test;
    int bad = fm_load_split(&train, opt.data_dir, "train", err, sizeof err) != FM_OK ||
              fm_load_split(&test, opt.data_dir, "t10k", err, sizeof err) != FM_OK;
    smp_status st = smp_error(bad ? SMP_ERR_IO : SMP_OK, "%s", err);
    int64_t local_batch = 0;
    if (!st) st = smp_local_batch_size(opt.batch, &local_batch);
    if (!st && local_batch % cfg->microbatches)
        st = smp_error(SMP_ERR_CONFIG, "batch of %lld per replica does not divide into %d microbatches",
                       (long long)local_batch, cfg->microbatches);
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
    int64_t *idx = malloc(sizeof(int64_t) * (train.n / (size_t)smp_dp_size() + (size_t)local_batch));
    float *xb = malloc(sizeof(float) * (size_t)local_batch * FM_PIXELS);
    uint8_t *yb = malloc((size_t)local_batch);

    /* partition now (the reference does it at the first step) so the
       optimizer knows its parameters and a checkpoint can be loaded */
    smp_tensor sample = smp_tensor_2d(train.images, SMP_F32, local_batch / cfg->microbatches, FM_PIXELS);
    adam opt_state;
    if (!(st = smp_model_trace(model, &sample, 1))) st = adam_init(&opt_state, model, opt.lr);
    resume_state resumed = {0, 0};
    if (!st && opt.resume) {
        st = smp_load(model, opt.checkpoint,
                      &(smp_load_desc){.partial = opt.partial ? SMP_ON : SMP_OFF,
                                       .optimizer = opt_state.state,
                                       .on_meta = on_meta,
                                       .user = &resumed});
        if (!st && smp_rank() == 0)
            printf("resumed from %s after epoch %d (step %ld)\n", opt.checkpoint, resumed.epoch, resumed.steps);
    }
    if (st) {
        fprintf(stderr, "fmnist: rank %d: %s\n", smp_rank(), smp_last_error());
        smp_finalize();
        MPI_Finalize();
        return 1;
    }
    long steps = resumed.steps;
    /* the peaks printed at the end: of training, not of the set-up (tracing holds each layer's parameters
       while it runs it, on every rank, so a rank owning small layers would show the largest one's) */
    smp_memory_reset_peaks();

    if (smp_rank() == 0)
        printf("fmnist: %d processes, %d partitions x %d replicas, batch %d (%lld per replica) in %d microbatches, %s "
               "pipeline\n",
               smp_size(), cfg->partitions, smp_dp_size(), opt.batch, (long long)local_batch, cfg->microbatches,
               pipeline_name(cfg->pipeline));

    for (int epoch = resumed.epoch; epoch < opt.epochs && (!opt.max_steps || steps < opt.max_steps); epoch++) {
        int64_t count, batches;
        smp_sampler_indices(&sampler, epoch, idx, &count, &batches);
        if (opt.epoch_steps && batches > opt.epoch_steps) batches = opt.epoch_steps;
        if ((st = smp_agree_batches(batches))) break;
        double t0 = now(), loss_sum = 0;
        int64_t b = 0;
        for (; b < batches && (!opt.max_steps || steps < opt.max_steps); b++, steps++) {
            for (int64_t i = 0; i < local_batch; i++) {
                int64_t k = idx[b * local_batch + i];
                memcpy(xb + i * FM_PIXELS, train.images + k * FM_PIXELS, sizeof(float) * FM_PIXELS);
                yb[i] = train.labels[k];
            }
            smp_tensor x = smp_tensor_2d(xb, SMP_F32, local_batch, FM_PIXELS),
                       y = smp_tensor_1d(yb, SMP_U8, local_batch);
            smp_step_output loss_mb = {0};
            smp_model_zero_grad(model);                               /* optimizer.zero_grad() */
            if ((st = SMP_TRAIN_STEP(model, train_body, NULL, &loss_mb, 1, x, y))) break;
            double loss = smp_step_output_reduce_mean_global_f64(&loss_mb);      /* the global batch's loss */
            smp_step_output_free(&loss_mb);
            if (opt.print_losses && smp_rank() == 0) printf("step %ld loss %a\n", steps, loss);
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
        if ((st = save_epoch(model, &opt, opt_state.state, epoch + 1, steps, mean, stdev))) break;
    }
    double accuracy = 0;
    if (!st) st = evaluate(model, &test, 1000, &accuracy);
    if (st) fprintf(stderr, "fmnist: rank %d: %s\n", smp_rank(), smp_last_error());
    else if (smp_rank() == 0) printf("test accuracy: %.4f\n", accuracy);
    if (!st) st = print_memory_peaks("fmnist"); /* per rank: what each setting saved */

    adam_free(&opt_state);
    free(idx); free(xb); free(yb);
    fm_free(&train);
    fm_free(&test);
    smp_model_free(model);
    smp_finalize();
    MPI_Finalize();
    return st ? 1 : 0;
}
