/* fmnist.cu - Fashion-MNIST trained split across GPUs with smp.

   fmnist.c on the GPU: the same MLP (784 -> 512 -> 512 -> 512 -> 512 -> 10,
   ReLU), the same data, flags, initial weights and training loop, with the
   layers' arithmetic in fmnist_cuda.h (cuBLAS and small kernels) and the
   parameters, activations and gradients in device memory. smp moves
   activations and gradients between stages, and averages gradients over
   replicas, with NCCL. The loop follows SageMaker's reference script:

     reference (PyTorch + smp)                   this file (CUDA + smp)
     smp.init()                                  smp_init(&cfg)
     torch.cuda.set_device(smp.local_rank())     smp_init sets GPU smp_local_rank() % GPUs; gpu_engine_init(&engine)
     dataset sharded by smp.dp_rank()            smp_sampler_indices(...)
     DataLoader(..., drop_last=True)             sampler.drop_last = true
     model = smp.DistributedModel(Net())         smp_model_new(root, ...) with on_device
     optimizer = smp.DistributedOptimizer(...)   Adam moments on the device per local parameter
     @smp.step def train_step(model, x, y)       SMP_STEP_BODY(train_body)
     data.to(device)                             gpu_upload(...) of each batch
     optimizer.zero_grad()                       smp_model_zero_grad(model)
     _, loss_mb = train_step(model, x, y)        SMP_TRAIN_STEP(model, train_body, &engine, ...)
     loss = loss_mb.reduce_mean()                smp_step_output_reduce_mean_global_f64(&loss_mb)
       (per replica in SageMaker; smp's _global is the mean over every replica: the whole batch's loss)
     optimizer.step()                            adam_step(&opt, model)
     if smp.dp_rank() == 0: smp.save(...)        smp_save(...) (only dp rank 0 writes; smp copies device tensors out)

   Build: make cuda   (nvcc -ccbin mpicxx -O2 -Iexamples -I. examples/fmnist.cu -o build/cuda/fmnist
                       -lcublas -lnccl -lz)
   Run:   mpirun -n 2 build/cuda/fmnist                                  2 partitions, a GPU each
          mpirun -n 4 build/cuda/fmnist --partitions 2 --ddp             2 partitions x 2 replicas
          mpirun -n 4 build/cuda/fmnist --partitions 2 --ddp --shard-optimizer
                                                  each replica keeps Adam's moments for its owned range only
          mpirun -n 2 build/cuda/fmnist --pipeline simple --microbatches 8 --offload
                                                  activations wait in host memory until their backward
   At the end rank 0 prints the memory account's peaks of each rank ("memory peak rank R: ..."): what each setting
   saved. With one GPU per rank the data moves over NCCL; ranks that share a GPU work too (smp moves device data
   through host memory); without a GPU the program says so and exits.
*/
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h"
#include "smp_nccl.h" /* registers the CUDA backend */
#include "fmnist_cuda.h"
#include "fmnist_shared.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- the optimizer */
/* Adam over this rank's parameters (smp.DistributedOptimizer: each rank
   steps the parameters it owns), moments on the device next to them, over
   the elements this replica updates (all, or its owned range under
   --shard-optimizer: cuda_engine.h's gpu_moments). */
typedef struct adam {
    mlp_adam_cfg cfg;
    int64_t t;
    gpu_moments mo;
    smp_optimizer *state; /* what checkpoints save: exp_avg, exp_avg_sq per parameter, the step */
    const gpu_engine *engine;
} adam;

/* After partitioning: moments for the local parameters, registered as
   named optimizer state so smp_save / smp_load carry them (smp copies
   device tensors through host memory). */
static smp_status adam_init(adam *o, smp_model *model, float lr, const gpu_engine *engine) {
    memset(o, 0, sizeof *o);
    o->cfg = mlp_adam_defaults(lr);
    o->engine = engine;
    smp_status st = smp_optimizer_new(model, &o->state);
    smp_tensor step = smp_tensor_1d(&o->t, SMP_I64, 1); /* host: every rank holds the count */
    if (!st) st = smp_optimizer_state_add(o->state, NULL, "step", &step);
    if (!st) st = gpu_moments_init(&o->mo, model, engine, o->state);
    return st;
}

static smp_status adam_step(adam *o, smp_model *model) {
    o->t++;
    smp_status st = SMP_OK;
    for (int i = 0; i < o->mo.n && !st; i++)
        st = gpu_moments_step(&o->mo, i, smp_model_local_param(model, i, false), o->engine, o->t, &o->cfg);
    return st;
}

static void adam_free(adam *o) {
    smp_optimizer_free(o->state);
    gpu_moments_free(&o->mo);
}


/* A CUDA error between steps: most leave the device unusable, and the
   other ranks are already on their way into the next step. Stop the job. */
static void die(const char *what) {
    fprintf(stderr, "fmnist: rank %d: %s: %s\n", smp_rank(), what, smp_last_error());
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
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
    if (smp_nccl_current_mode() == SMP_NCCL_MODE_NONE) {
        if (smp_rank() == 0)
            printf(
                "fmnist (CUDA): %s: this example needs a GPU on every rank (the CPU demo is build/examples/fmnist)\n",
                smp_nccl_describe());
        smp_finalize();
        MPI_Finalize();
        return 0;
    }
    /* smp_init made GPU smp_local_rank() % (GPUs on the node) current: set_device(local_rank()) */
    gpu_engine engine;
    smp_status st = gpu_agree(gpu_engine_init(&engine));
    if (st) {
        fprintf(stderr, "fmnist: rank %d: %s\n", smp_rank(), smp_last_error());
        gpu_engine_free(&engine);
        smp_finalize(); MPI_Finalize(); return 1;
    }
    const smp_config *cfg = smp_current_config();

    /* the data: every rank reads it; each replica trains on its dp shard */
    char err[512] = "";
    fm_dataset train, test;
    int bad = fm_load_split(&train, opt.data_dir, "train", err, sizeof err) != FM_OK ||
              fm_load_split(&test, opt.data_dir, "t10k", err, sizeof err) != FM_OK;
    st = smp_error(bad ? SMP_ERR_IO : SMP_OK, "%s", err);
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
    if (any_bad) { gpu_engine_free(&engine); smp_finalize(); MPI_Finalize(); return 1; }
    float mean, stdev;
    fm_pixel_stats(&train, &mean, &stdev);
    fm_standardize(&train, mean, stdev);
    fm_standardize(&test, mean, stdev);

    mlp net;
    memset(&net, 0, sizeof net);
    smp_model *model;
    if ((st = build_model(&net, &engine, cfg->partitions, &model))) {  /* smp.DistributedModel */
        fprintf(stderr, "model: %s\n", smp_last_error());
        gpu_engine_free(&engine); smp_finalize(); MPI_Finalize(); return 1;
    }
    smp_sampler_desc sampler = {(int64_t)train.n, local_batch, (uint64_t)opt.seed, true, true};
    int64_t *idx = (int64_t *)malloc(sizeof(int64_t) * (train.n / (size_t)smp_dp_size() + (size_t)local_batch));
    float *xb = (float *)malloc(sizeof(float) * (size_t)local_batch * FM_PIXELS);
    uint8_t *yb = (uint8_t *)malloc((size_t)local_batch);
    /* the batch on the device: refilled before every step (data.to(device)) */
    float *xd = (float *)smp_nccl_alloc(sizeof(float) * (size_t)local_batch * FM_PIXELS);
    uint8_t *yd = (uint8_t *)smp_nccl_alloc((size_t)local_batch);
    if (!xd || !yd) st = SMP_ERR_DEVICE; /* smp_nccl_alloc left the message */

    /* partition now (the reference does it at the first step) so the
       optimizer knows its parameters and a checkpoint can be loaded */
    int64_t sample_rows = local_batch / cfg->microbatches;
    if (!st) st = gpu_upload(&engine, xd, train.images, sizeof(float) * (size_t)sample_rows * FM_PIXELS);
    smp_tensor sample = device_tensor(smp_tensor_2d(xd, SMP_F32, sample_rows, FM_PIXELS));
    adam opt_state;
    memset(&opt_state, 0, sizeof opt_state);
    if (!(st = gpu_agree(st)) && !(st = smp_model_trace(model, &sample, 1)))
        st = gpu_agree(adam_init(&opt_state, model, opt.lr, &engine));
    resume_state resumed = {0, 0};
    if (!st && opt.resume) {
        smp_load_desc load = {};
        load.partial = opt.partial ? SMP_ON : SMP_OFF;
        load.optimizer = opt_state.state;
        load.on_meta = on_meta;
        load.user = &resumed;
        st = smp_load(model, opt.checkpoint, &load);
        if (!st && smp_rank() == 0)
            printf("resumed from %s after epoch %d (step %ld)\n", opt.checkpoint, resumed.epoch, resumed.steps);
    }
    if (st) {
        fprintf(stderr, "fmnist: rank %d: %s\n", smp_rank(), smp_last_error());
        adam_free(&opt_state); smp_nccl_free(xd); smp_nccl_free(yd); smp_model_free(model);
        gpu_engine_free(&engine); smp_finalize(); MPI_Finalize(); return 1;
    }
    long steps = resumed.steps;
    /* the peaks printed at the end: of training, not of the set-up (tracing holds each layer's parameters
       while it runs it, on every rank, so a rank owning small layers would show the largest one's) */
    smp_memory_reset_peaks();

    if (smp_rank() == 0)
        printf("fmnist (CUDA, %s): %d processes, %d partitions x %d replicas, batch %d (%lld per replica) in %d "
               "microbatches, %s pipeline\n",
               smp_nccl_describe(), smp_size(), cfg->partitions, smp_dp_size(), opt.batch, (long long)local_batch,
               cfg->microbatches, pipeline_name(cfg->pipeline));

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
            if (gpu_upload(&engine, xd, xb, sizeof(float) * (size_t)local_batch * FM_PIXELS) ||   /* data.to(device) */
                gpu_upload(&engine, yd, yb, (size_t)local_batch))
                die("copying the batch to the GPU");
            smp_tensor x = device_tensor(smp_tensor_2d(xd, SMP_F32, local_batch, FM_PIXELS));
            smp_tensor y = device_tensor(smp_tensor_1d(yd, SMP_U8, local_batch));
            smp_step_output loss_mb = {0, NULL};
            smp_model_zero_grad(model);                               /* optimizer.zero_grad() */
            if ((st = SMP_TRAIN_STEP(model, train_body, &engine, &loss_mb, 1, x, y))) break;
            double loss = smp_step_output_reduce_mean_global_f64(&loss_mb);      /* the global batch's loss */
            smp_step_output_free(&loss_mb);
            if (opt.print_losses && smp_rank() == 0) printf("step %ld loss %a\n", steps, loss);
            opt_state.cfg.lr = opt.lr * powf(opt.lr_decay, (float)epoch);
            if (adam_step(&opt_state, model)) die("the optimizer step"); /* optimizer.step() */
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
    if (!st) st = evaluate(model, &engine, &test, 1000, &accuracy);
    if (st) fprintf(stderr, "fmnist: rank %d: %s\n", smp_rank(), smp_last_error());
    else if (smp_rank() == 0) printf("test accuracy: %.4f\n", accuracy);
    if (!st) st = print_memory_peaks("fmnist"); /* per rank: what each setting saved */

    adam_free(&opt_state);
    smp_nccl_free(xd);
    smp_nccl_free(yd);
    free(idx); free(xb); free(yb);
    fm_free(&train);
    fm_free(&test);
    smp_model_free(model);
    gpu_engine_free(&engine);
    smp_finalize();
    MPI_Finalize();
    return st ? 1 : 0;
}
