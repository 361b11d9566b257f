/* gpt.cu - the character-level GPT of gpt.c, trained split across GPUs with smp.

   The same model (gpt_model.h: nanoGPT's layout and parameter names, the
   tied embedding called at both ends, composite blocks), the same
   initialisation, data, flags and loop (gpt_shared.h) as gpt.c, with the
   leaves' arithmetic on the GPU (gpt_cuda.h: cuBLAS and kernels of its
   own) and parameters, gradients, activations and AdamW's moments in device
   memory (smp_model_desc.on_device). smp moves activations and gradients
   between stages, sums the tied embedding's two gradients and averages
   gradients over replicas with NCCL (through host memory where ranks share
   a GPU). The loop is gpt.c's:

     smp.init()                                  smp_init(&cfg); gpt_gpu_init (the stream, cuBLAS)
     model = smp.DistributedModel(GPT(...))      gpt_gpu_build(...) -> smp_model_new, on_device
     data.to(device)                             cudaMemcpyAsync of each batch's ids and targets
     loss_mb = train_step(model, x, y)           SMP_TRAIN_STEP(model, gpt_gpu_loss_body, ...)
     clip_grad_norm_(model.parameters(), 1.0)    smp_clip_grad_norm(model, 1.0, NULL)
     optimizer.step()  (AdamW, cosine schedule)  adamw_step(...): cuda_engine.h's Adam kernel per local parameter
     smp.save(model.state_dict(), ...)           save_checkpoint -> smp_save (smp copies device tensors to the host)

   Checkpoints are gpt.c's (gpt_shared.h's save_checkpoint and
   load_training; one file format): --save PATH writes the parameters at
   the end under nanoGPT's names; --save-at N writes them after step N
   instead, with AdamW's state (per parameter "exp_avg" and "exp_avg_sq",
   which smp copies from device memory, joined from every replica's owned
   range under --shard-optimizer; and "step"), and trains on; --partial
   makes both partial checkpoints (a file per partition, and per replica
   when sharded). --load CKPT with AdamW's state continues at the step it
   was saved after (give the same --steps), bitwise as the run that never
   stopped on the same layout, at any --partitions and --ddp, sharded or
   not (the log's loss average runs over the resumed run's steps and says
   so: "avg from step N:"); without that state it starts AdamW afresh; --steps 0 only
   evaluates the loaded weights. A checkpoint of either program loads into
   the other (gpt.c resumes gpt.cu's and the other way round, within float
   rounding of the host's kernels). --load checks the file's vocabulary and
   model sizes first: another model's file, or one missing part of AdamW's
   state, is an error on every rank naming the fix, before any parameter
   changes. After training: "throughput: N tokens/s" over the steps
   after the first two, the model FLOPs per token (6 x the parameters
   besides the position embedding, + 12 x layers x width x context for the
   attention's products) and the MFU against the GPU's dense bf16 peak where
   gpt.cu knows the device's name.

   --bf16: the linear layers' GEMMs take bf16 copies of their inputs and
   accumulate in f32; master weights, gradients and AdamW's state stay f32
   (gpt_cuda.h). A checkpoint therefore holds f32 in either precision: a
   bf16 run's loads into an f32 run as it is, and an f32 run's into a bf16
   run, which rounds the f32 weights to bf16 (to nearest even) at each GEMM
   as it rounds its own. SageMaker's flags map so: "bf16": true (smp.DistributedModel
   in bf16, with f32 master weights in the optimizer) is this --bf16;
   "fp16": true is the same recipe in f16 with a loss scaler (smp_grad_scaler
   in smp_pipeline.h; not offered here: bf16 needs no scaler);
   "fp16_params": true (parameters created in f16 on the device) has no
   counterpart: parameters stay f32 and only GEMM inputs are rounded.
   --vocab-multiple N pads the vocabulary to a multiple of N ids (GPT-2's
   shapes: ids past the corpus's never occur).

   --plain runs each training step without smp (one rank, one partition):
   gpt_cuda.h's layer functions in order, for the overhead benchmark
   (bench/gpt_cuda.sh) and a test that both loops agree.

   --generate --load CKPT --prompts "A|B|..." --tokens N: gpt.c's pipelined
   generation (gpt_shared.h's generate_main, the same flags and output) on
   the device, from a checkpoint of either program: one prompt per
   microbatch flowing through the stages, the KV cache of each block and
   prompt in device memory (gpt_cuda.h), so each character after the prompt
   costs one position; --print-logits prints the logits each character was
   drawn from, --no-cache re-runs each whole context instead.

   Memory: --shard-optimizer (shard_optimizer_state, with --ddp) keeps each
   replica's AdamW moments on the device for its owned range only;
   --offload (offload_activations) keeps what each backward needs in host
   memory until activation_loading_horizon pipeline tasks before it. Both
   leave every result bitwise as without. At the end rank 0 prints the
   memory account's peaks of each rank ("memory peak rank R: ...").

   Not on the device: --dropout, --replicas, --grads, --tp, --params (gpt.c).

   Build: make build/cuda/gpt   (nvcc -ccbin mpicxx ... -lcublas -lnccl)
   Run:   mpirun -n 2 build/cuda/gpt                       2 stages, a GPU each (or sharing one)
          mpirun -n 4 build/cuda/gpt --partitions 2 --ddp  2 stages x 2 replicas
          mpirun -n 2 build/cuda/gpt --steps 700 --save-at 300 --save ck.safetensors   ... and later, from step 300:
          mpirun -n 2 build/cuda/gpt --steps 700 --load ck.safetensors
          mpirun -n 1 build/cuda/gpt --partitions 1 --bf16 --layers 12 --dmodel 768 --heads 12 --context 1024 \
                 --vocab-multiple 128 --batch 8 --microbatches 1      GPT-2 124M's shape */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h"
#include "smp_nccl.h" /* registers the CUDA backend */
#include "gpt_cuda.h"
#include "gpt_shared.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- AdamW */
/* gpt.c's AdamW on the device: moments next to the parameters, over the
   elements this replica updates (all, or its owned range under
   --shard-optimizer: cuda_engine.h's gpu_moments), decay on matrices only.
   Registered as gpt.c registers its own (exp_avg, exp_avg_sq, step), so
   checkpoints of either program resume in the other. */
typedef struct adamw {
    gpu_moments mo;
    int64_t t;
    smp_optimizer *reg; /* the moments and t, registered: smp's memory account counts them, checkpoints carry them */
} adamw;

static smp_status adamw_init(adamw *o, smp_model *model, const gpt_gpu *gg) {
    memset(o, 0, sizeof *o);
    SMP_TRY(smp_optimizer_new(model, &o->reg));
    SMP_TRY(gpu_moments_init(&o->mo, model, &gg->e, o->reg));
    smp_tensor t = smp_tensor_make(&o->t, SMP_I64, 0, NULL); /* the bias corrections' step, so a load continues */
    return smp_optimizer_state_add(o->reg, NULL, "step", &t);
}

static smp_status adamw_step(adamw *o, smp_model *model, const options *opt, float lr, const gpt_gpu *gg) {
    o->t++;
    smp_param *p;
    smp_status st = SMP_OK;
    for (int i = 0; !st && (p = smp_model_local_param(model, i, false)); i++) {
        smp_tensor *w = smp_param_value(p);
        mlp_adam_cfg c = {lr, opt->beta1, opt->beta2, 1e-8f, w->ndim >= 2 ? opt->weight_decay : 0.0f};
        st = gpu_moments_step(&o->mo, i, p, &gg->e, o->t, &c);
    }
    return st;
}

static void adamw_free(adamw *o) {
    smp_optimizer_free(o->reg);
    gpu_moments_free(&o->mo);
}

/* ---------------------------------------------------------------- the plain loop (--plain) */
/* The same training step without smp: gpt_cuda.h's layer functions called
   in order on one rank, each microbatch's forward then its backward, the
   activations in buffers of this loop's own, the gradients added into the
   model's (so clipping and AdamW are the same calls). What the overhead
   benchmark measures smp against; its losses must agree with smp's run. */
typedef struct plain_block {
    float *x, *h1, *s1, *qkv, *P, *y, *r, *h2, *s2, *f, *g, *t;
} plain_block;
typedef struct plain {
    int L, N, B; /* blocks, rows (tokens) and sequences of a microbatch */
    plain_block *blk;
    float *out, *hf, *sf, *logits, *dlogits, *d, *d2, *dC, *d3, *d4; /* out: the last block's; d*: gradients */
    void **all;
    int nall;
} plain;

static float *plain_alloc(plain *p, size_t floats) {
    float *f = (float *)smp_nccl_alloc(sizeof(float) * (floats ? floats : 1));
    if (f) p->all[p->nall++] = f;
    return f;
}

static smp_status plain_init(plain *p, const gpt_config *m, int rows, int T) {
    memset(p, 0, sizeof *p);
    size_t N = (size_t)rows * T, C = (size_t)m->n_embd, H = (size_t)m->n_head, V = (size_t)m->vocab;
    p->L = m->n_layer;
    p->N = (int)N;
    p->B = rows;
    p->blk = (plain_block *)calloc((size_t)p->L, sizeof *p->blk);
    p->all = (void **)calloc((size_t)p->L * 12 + 16, sizeof *p->all);
    if (!p->blk || !p->all) return smp_error(SMP_ERR_NOMEM, "out of memory for the plain loop");
    bool ok = true;
    for (int l = 0; l < p->L; l++) {
        plain_block *b = &p->blk[l];
        ok = ok && (b->x = plain_alloc(p, N * C)) && (b->h1 = plain_alloc(p, N * C)) &&
            (b->s1 = plain_alloc(p, 2 * N)) && (b->qkv = plain_alloc(p, 3 * N * C)) &&
            (b->P = plain_alloc(p, (size_t)rows * H * T * T)) && (b->y = plain_alloc(p, N * C)) &&
            (b->r = plain_alloc(p, N * C)) && (b->h2 = plain_alloc(p, N * C)) && (b->s2 = plain_alloc(p, 2 * N)) &&
            (b->f = plain_alloc(p, 4 * N * C)) && (b->g = plain_alloc(p, 4 * N * C)) &&
            (b->t = plain_alloc(p, 4 * N * C));
    }
    ok = ok && (p->out = plain_alloc(p, N * C)) && (p->hf = plain_alloc(p, N * C)) && (p->sf = plain_alloc(p, 2 * N)) &&
        (p->logits = plain_alloc(p, N * V)) && (p->dlogits = plain_alloc(p, N * V)) && (p->d = plain_alloc(p, N * C)) &&
        (p->d2 = plain_alloc(p, N * C)) && (p->dC = plain_alloc(p, N * C)) && (p->d3 = plain_alloc(p, 3 * N * C)) &&
        (p->d4 = plain_alloc(p, 4 * N * C));
    return ok ? SMP_OK : smp_error(SMP_ERR_NOMEM, "out of device memory for the plain loop: %s", smp_last_error());
}

static void plain_free(plain *p) {
    for (int i = 0; i < p->nall; i++) smp_nccl_free(p->all[i]);
    free(p->all);
    free(p->blk);
}

#define PV(prm) ((const float *)smp_param_value(prm)->data)
#define PG(prm) ((float *)smp_param_grad(prm)->data)

/* One training step's forward and backward over M microbatches of the
   batch on the device (ids xd, targets yd, [M * rows, T]); adds parameter
   gradients and returns the mean loss. */
static smp_status plain_step(plain *p, const gpt *net, gpt_gpu *gg, const int32_t *xd, const int32_t *yd, int M, int T,
                             double *loss) {
    const gpt_config *m = &net->cfg;
    int C = m->n_embd, H = m->n_head, V = m->vocab, N = p->N, B = p->B, L = p->L;
    *loss = 0;
    for (int mb = 0; mb < M; mb++) {
        const int32_t *ids = xd + (size_t)mb * N, *tg = yd + (size_t)mb * N;
        /* forward */
        float *x0 = L ? p->blk[0].x : p->out;
        SMP_TRY(gpt_gpu_embed(gg, ids, PV(net->wte_w), x0, N, C));
        SMP_TRY(gpt_gpu_positions(gg, x0, PV(net->wpe_w), x0, B, T, C, 0));
        for (int l = 0; l < L; l++) {
            const gpt_block *k = &net->blocks[l];
            plain_block *b = &p->blk[l];
            float *next = l + 1 < L ? p->blk[l + 1].x : p->out;
            SMP_TRY(gpt_gpu_layernorm(gg, b->x, PV(k->n1.weight), PV(k->n1.bias), b->h1, b->s1, N, C));
            SMP_TRY(gpt__linear_forward(gg, b->h1, PV(k->l_attn.weight), PV(k->l_attn.bias), b->qkv, N, C, 3 * C));
            SMP_TRY(gpt__attention_forward(gg, b->qkv, b->y, b->P, B, T, C, H));
            SMP_TRY(gpt__linear_forward(gg, b->y, PV(k->l_aproj.weight), PV(k->l_aproj.bias), b->r, N, C, C));
            SMP_TRY(gpt_gpu_add(gg, b->x, b->r, b->r, (int64_t)N * C));
            SMP_TRY(gpt_gpu_layernorm(gg, b->r, PV(k->n2.weight), PV(k->n2.bias), b->h2, b->s2, N, C));
            SMP_TRY(gpt__linear_forward(gg, b->h2, PV(k->l_fc.weight), PV(k->l_fc.bias), b->f, N, C, 4 * C));
            SMP_TRY(gpt_gpu_gelu(gg, b->f, b->g, b->t, (int64_t)N * 4 * C));
            SMP_TRY(gpt__linear_forward(gg, b->g, PV(k->l_mproj.weight), PV(k->l_mproj.bias), next, N, 4 * C, C));
            SMP_TRY(gpt_gpu_add(gg, b->r, next, next, (int64_t)N * C));
        }
        SMP_TRY(gpt_gpu_layernorm(gg, p->out, PV(net->nf.weight), PV(net->nf.bias), p->hf, p->sf, N, C));
        SMP_TRY(gpt__linear_forward(gg, p->hf, PV(net->wte_w), NULL, p->logits, N, C, V));
        SMP_TRY(gpt_gpu_xent(gg, p->logits, tg, N, V, p->dlogits, 1.0f / (float)N / (float)M));
        double l = 0;
        GPU_CUDA(cudaMemcpyAsync, (&l, gg->loss, sizeof l, cudaMemcpyDeviceToHost, gg->e.stream));
        GPU_CUDA(cudaStreamSynchronize, (gg->e.stream));
        *loss += l / M;
        /* backward: d is the gradient flowing down the residual stream */
        SMP_TRY(gpt__linear_backward(gg, p->hf, PV(net->wte_w), p->dlogits, p->d2, PG(net->wte_w), NULL, N, C, V));
        SMP_TRY(gpt_gpu_layernorm_grad(gg, p->out, PV(net->nf.weight), p->sf, p->d2, p->d, PG(net->nf.weight),
                                       PG(net->nf.bias), N, C));
        for (int l = L - 1; l >= 0; l--) {
            const gpt_block *k = &net->blocks[l];
            plain_block *b = &p->blk[l];
            SMP_TRY(gpt__linear_backward(gg, b->g, PV(k->l_mproj.weight), p->d, p->d4, PG(k->l_mproj.weight),
                                         PG(k->l_mproj.bias), N, 4 * C, C));
            SMP_TRY(gpt_gpu_gelu_grad(gg, b->f, b->t, p->d4, p->d4, (int64_t)N * 4 * C));
            SMP_TRY(gpt__linear_backward(gg, b->h2, PV(k->l_fc.weight), p->d4, p->d2, PG(k->l_fc.weight),
                                         PG(k->l_fc.bias), N, C, 4 * C));
            SMP_TRY(gpt_gpu_layernorm_grad(gg, b->r, PV(k->n2.weight), b->s2, p->d2, p->dC, PG(k->n2.weight),
                                           PG(k->n2.bias), N, C));
            SMP_TRY(gpt_gpu_add(gg, p->d, p->dC, p->d, (int64_t)N * C));
            SMP_TRY(gpt__linear_backward(gg, b->y, PV(k->l_aproj.weight), p->d, p->d2, PG(k->l_aproj.weight),
                                         PG(k->l_aproj.bias), N, C, C));
            SMP_TRY(gpt__attention_backward(gg, b->qkv, b->P, p->d2, p->d3, B, T, C, H));
            SMP_TRY(gpt__linear_backward(gg, b->h1, PV(k->l_attn.weight), p->d3, p->d2, PG(k->l_attn.weight),
                                         PG(k->l_attn.bias), N, C, 3 * C));
            SMP_TRY(gpt_gpu_layernorm_grad(gg, b->x, PV(k->n1.weight), b->s1, p->d2, p->dC, PG(k->n1.weight),
                                           PG(k->n1.bias), N, C));
            SMP_TRY(gpt_gpu_add(gg, p->d, p->dC, p->d, (int64_t)N * C));
        }
        SMP_TRY(gpt_gpu_positions_grad(gg, p->d, PG(net->wpe_w), B, T, C));
        SMP_TRY(gpt_gpu_embed_grad(gg, ids, p->d, PG(net->wte_w), N, V, C));
    }
    return SMP_OK;
}

/* ---------------------------------------------------------------- helpers */
/* Dense bf16 peak FLOP/s by device name (0: not known). */
static double peak_bf16(const char *name) {
    if (strstr(name, "H200")) return 989e12;
    if (strstr(name, "H100"))
        return strstr(name, "PCIe") ? 756e12 : strstr(name, "NVL") ? 835e12 : 989e12; /* SXM: 989 */
    if (strstr(name, "A100")) return 312e12;
    return 0;
}

/* ids and targets of the batch: checked against the vocabulary (so the
   kernels need not), then copied to the device. */
static smp_status upload_batch(const gpt_gpu *gg, const int32_t *x, const int32_t *y, size_t n, int V, int32_t *xd,
                               int32_t *yd) {
    for (size_t i = 0; i < n; i++)
        if (x[i] < 0 || x[i] >= V || y[i] < 0 || y[i] >= V)
            return smp_error(SMP_ERR_ARG, "token %d or target %d at position %zu is outside the vocabulary of %d", x[i],
                             y[i], i, V);
    SMP_TRY(gpu_upload(&gg->e, xd, x, sizeof(int32_t) * n));
    return gpu_upload(&gg->e, yd, y, sizeof(int32_t) * n);
}

/* --generate's model (gpt_shared.h's generate_main): the device's, on the engine in user. */
static smp_status build_for_generation(gpt *net, const gpt_config *mc, void *user, smp_model **model) {
    return gpt_gpu_build(net, mc, false, (gpt_gpu *)user, model);
}

int main(int argc, char **argv) {
    options opt;
    MPI_Init(&argc, &argv);
    if (parse_options(argc, argv, &opt, true)) {
        MPI_Finalize();
        return 2;
    }
    if (opt.replicas > 1 || opt.grads || opt.model.dropout > 0) {
        fprintf(stderr, "gpt.cu: --replicas, --grads and --dropout are gpt.c's (build/examples/gpt); the device program "
                        "trains, evaluates, prints logits and samples, generates, and saves and loads checkpoints\n");
        MPI_Finalize();
        return 2;
    }
    if (smp_init(&opt.cfg)) { /* smp.init() */
        fprintf(stderr, "smp_init: %s\n", smp_last_error());
        MPI_Finalize();
        return 1;
    }
    if (smp_nccl_current_mode() == SMP_NCCL_MODE_NONE) {
        if (smp_rank() == 0)
            printf("gpt (CUDA): %s: this program needs a GPU on every rank (the CPU program is build/examples/gpt)\n",
                   smp_nccl_describe());
        smp_finalize();
        MPI_Finalize();
        return 0;
    }
    if (opt.generate) { /* pipelined generation from a checkpoint, the KV cache on the device */
        gpt_gpu gen_gpu;
        int gen_rc = fail_all(gpt_gpu_init(&gen_gpu, opt.bf16), "the GPU")
                         ? 1
                         : generate_main(&opt, build_for_generation, &gen_gpu);
        gpt_gpu_free(&gen_gpu); /* after generate_main freed the model */
        smp_finalize();
        MPI_Finalize();
        return gen_rc;
    }
    const smp_config *cfg = smp_current_config();
    int T = opt.model.block_size, M = cfg->microbatches;
    bool root = smp_rank() == 0;
    int rc = 1;

    gpt_gpu gg;
    corpus text;
    memset(&text, 0, sizeof text);
    int32_t *train_ids = NULL, *val_ids = NULL, *x = NULL, *y = NULL, *xd = NULL, *yd = NULL;
    smp_model *model = NULL;
    gpt net;
    memset(&net, 0, sizeof net);
    adamw opt_state;
    memset(&opt_state, 0, sizeof opt_state);
    plain pl;
    memset(&pl, 0, sizeof pl);
    smp_status st = gpt_gpu_init(&gg, opt.bf16);
    if (fail_all(st, "the GPU")) goto done;
    st = corpus_load(&text, opt.data);
    int64_t local_batch;
    local_batch = 0;
    if (!st) st = smp_local_batch_size(opt.batch, &local_batch);
    if (!st && local_batch % M)
        st = smp_error(SMP_ERR_CONFIG, "batch of %lld per replica does not divide into %d microbatches",
                       (long long)local_batch, M);
    if (!st && (text.ntrain < (size_t)T + 2 || text.nval < (size_t)T + 2))
        st = smp_error(SMP_ERR_ARG, "the corpus is shorter than a context of %d characters", T);
    for (size_t i = 0; !st && opt.sample_len > 0 && opt.prompt[i]; i++)
        if (text.id_of[(unsigned char)opt.prompt[i]] < 0)
            st = smp_error(SMP_ERR_ARG, "the prompt's character %zu (byte 0x%02x) is not in the vocabulary", i,
                           (unsigned char)opt.prompt[i]);
    if (!st && opt.logits && (!*opt.logits || strlen(opt.logits) > (size_t)T))
        st = smp_error(SMP_ERR_ARG, "--logits: a context of %zu characters; the model takes 1 to %d",
                       strlen(opt.logits), T);
    for (size_t i = 0; !st && opt.logits && opt.logits[i]; i++)
        if (text.id_of[(unsigned char)opt.logits[i]] < 0)
            st = smp_error(SMP_ERR_ARG, "--logits: character %zu (byte 0x%02x) is not in the vocabulary", i,
                           (unsigned char)opt.logits[i]);
    if (!st) st = check_save_at(&opt);
    if (fail_all(st, "input")) goto done;
    train_ids = encode(&text, text.train, text.ntrain);
    val_ids = encode(&text, text.val, text.nval);
    x = (int32_t *)malloc(sizeof(int32_t) * (size_t)local_batch * T);
    y = (int32_t *)malloc(sizeof(int32_t) * (size_t)local_batch * T);
    xd = (int32_t *)smp_nccl_alloc(sizeof(int32_t) * (size_t)local_batch * T);
    yd = (int32_t *)smp_nccl_alloc(sizeof(int32_t) * (size_t)local_batch * T);
    if (!train_ids || !val_ids || !x || !y || !xd || !yd) st = smp_error(SMP_ERR_NOMEM, "out of memory for the batch");
    if (fail_all(st, "data")) goto done;
    {
        double baseline = unigram_entropy(&text);
        int V = opt.vocab_multiple > 0 ? (text.vocab + opt.vocab_multiple - 1) / opt.vocab_multiple * opt.vocab_multiple
                                       : text.vocab;
        opt.model.vocab = V;
        if (V != text.vocab && (opt.logits || opt.sample_len > 0))
            st = smp_error(
                SMP_ERR_ARG,
                "--vocab-multiple pads the vocabulary from %d to %d ids: logits and samples take the corpus's; "
                "run it with --sample-len 0 and without --logits",
                text.vocab, V);
        if (fail_all(st, "input")) goto done;
        st = gpt_gpu_build(&net, &opt.model, opt.recompute, &gg, &model); /* smp.DistributedModel */
        if (fail_all(st, "model")) goto done;
        /* partition now, so the optimizer knows its parameters */
        int64_t rows = local_batch, mrows = rows / M;
        fill_batch(train_ids, text.ntrain, T, (uint64_t)opt.seed, 0, opt.batch, 0, (int)mrows, x, y);
        st = upload_batch(&gg, x, y, (size_t)mrows * T, V, xd, yd);
        smp_tensor sample = device_tensor(smp_tensor_2d(xd, SMP_I32, mrows, T));
        if (!(st = gpu_agree(st))) st = smp_model_trace(model, &sample, 1);
        if (!st) st = gpu_agree(adamw_init(&opt_state, model, &gg));
        if (!st && opt.plain && (smp_size() != 1 || cfg->partitions != 1))
            st = smp_error(SMP_ERR_CONFIG,
                           "--plain runs the step without smp on one rank: run 1 process with --partitions 1");
        if (!st && opt.plain) st = plain_init(&pl, &opt.model, (int)mrows, T);
        if (fail_all(st, "partitioning")) goto done;
        int start = 0; /* --load with AdamW's state: the step it continues at */
        if (opt.load && fail_all(load_training(model, &opt, &text, opt_state.reg, &start), "loading the checkpoint"))
            goto done;
        long nparams = 0;
        for (int i = 0; i < smp_model_num_global_params(model, false); i++)
            nparams += (long)smp_tensor_numel(smp_param_value(smp_model_global_param(model, i, false)));
        int dev = 0;
        cudaDeviceProp prop;
        if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess)
            snprintf(prop.name, sizeof prop.name, "?");
        if (root) {
            printf("gpt (CUDA, %s, %s): %d layers, width %d, %d heads, context %d, vocabulary %d, %.2fM parameters%s\n",
                   smp_nccl_describe(), prop.name, opt.model.n_layer, opt.model.n_embd, opt.model.n_head, T, V,
                   (double)nparams / 1e6, opt.bf16 ? ", bf16 GEMMs (f32 accumulation and master weights)" : ", f32");
            printf("gpt: %zu training and %zu validation characters from %s\n", text.ntrain, text.nval, opt.data);
            printf("gpt: %d processes, %d partitions x %d replicas, batch %d x %d characters (%lld per replica) in %d "
                   "microbatches, %s pipeline%s\n",
                   smp_size(), cfg->partitions, smp_dp_size(), opt.batch, T, (long long)local_batch, M,
                   cfg->pipeline == SMP_PIPELINE_SIMPLE              ? "simple"
                       : cfg->pipeline == SMP_PIPELINE_ZERO_BUBBLE   ? "zero_bubble"
                       : cfg->pipeline == SMP_PIPELINE_ZERO_BUBBLE_V ? "zero_bubble_v"
                                                                     : "interleaved",
                   opt.recompute ? ", blocks recomputed" : "");
            fflush(stdout);
        }
        print_placement(model, &net);

        /* ---------------------------------------------------------------- training */
        double t0 = now(), loss_avg = 0, timed_from = t0;
        long tokens = 0, timed_tokens = 0;
        for (int step = start; step < opt.steps && !st; step++) {
            float lr = lr_at(&opt, step);
            fill_batch(train_ids, text.ntrain, T, (uint64_t)opt.seed, step, opt.batch, smp_dp_rank() * (int)local_batch,
                       (int)rows, x, y);
            if ((st = upload_batch(&gg, x, y, (size_t)rows * T, V, xd, yd))) break; /* data.to(device) */
            smp_tensor xt = device_tensor(smp_tensor_2d(xd, SMP_I32, rows, T)),
                       yt = device_tensor(smp_tensor_2d(yd, SMP_I32, rows, T));
            smp_step_output loss_mb;
            memset(&loss_mb, 0, sizeof loss_mb);
            smp_model_zero_grad(model); /* optimizer.zero_grad() */
            double loss = 0;
            if (opt.plain) {
                if ((st = plain_step(&pl, &net, &gg, xd, yd, M, T, &loss))) break;
            } else {
                if ((st = SMP_TRAIN_STEP(model, gpt_gpu_loss_body, &gg, &loss_mb, 1, xt, yt))) break;
                loss = smp_step_output_reduce_mean_global_f64(&loss_mb); /* the global batch's loss */
                smp_step_output_free(&loss_mb);
            }
            if (opt.clip > 0 && (st = smp_clip_grad_norm(model, opt.clip, NULL))) break;
            if ((st = adamw_step(&opt_state, model, &opt, lr, &gg))) break; /* optimizer.step() */
            if (step == start) smp_memory_reset_peaks(); /* the peaks printed at the end: of the steps after set-up */
            tokens += (long)opt.batch * T;
            if (step == start + 1) { /* the first two steps trace, allocate and warm up: throughput is timed after */
                if ((st = cudaStreamSynchronize(gg.e.stream) ? smp_error(SMP_ERR_DEVICE, "cudaStreamSynchronize failed")
                                                             : SMP_OK))
                    break;
                timed_from = now();
            }
            if (step >= start + 2) timed_tokens += (long)opt.batch * T;
            loss_avg = loss_average(loss_avg, loss, step, start);
            if (opt.print_losses && root) printf("step %d loss %a\n", step, loss);
            if (step + 1 == opt.save_at &&
                fail_all(save_checkpoint(model, &opt, &text, opt_state.reg, step + 1), "checkpoint"))
                goto done;
            if (root && (step % opt.log_every == 0 || step + 1 == opt.steps))
                print_progress(&opt, step, start, loss, loss_avg, lr, tokens, t0);
        }
        /* --shard-optimizer: each replica updated its own range; the next step would gather them, the digest reads
           them now */
        if (!st) st = smp_model_gather_params(model);
        if (!st && cudaStreamSynchronize(gg.e.stream) != cudaSuccess)
            st = smp_error(SMP_ERR_DEVICE, "cudaStreamSynchronize failed");
        if (fail_all(st, "training")) goto done;
        if (root && opt.steps > 0) {
            double secs = now() - t0, tsecs = now() - timed_from,
                   rate = timed_tokens > 0 ? (double)timed_tokens / tsecs : (double)tokens / secs;
            double wpe = (double)T * opt.model.n_embd;
            double flops = 6.0 * ((double)nparams - wpe) + 12.0 * opt.model.n_layer * opt.model.n_embd * T,
                   peak = peak_bf16(prop.name);
            printf("trained %d steps in %.1f s (%.0f tokens/s)\n", opt.steps, secs, (double)tokens / secs);
            printf("throughput: %.0f tokens/s (%s), %.3g model FLOPs per token, ", rate,
                   timed_tokens > 0 ? "steps 3 on" : "all steps", flops);
            if (peak > 0)
                printf("MFU %.3f of %s's dense bf16 peak %.0f TFLOP/s\n", rate * flops / peak, prop.name, peak / 1e12);
            else
                printf("MFU n/a (no bf16 peak known for \"%s\")\n", prop.name);
            fflush(stdout);
        }
        if (opt.digest && fail_all(print_digest(model), "digest")) goto done;

        /* ---------------------------------------------------------------- validation */
        if (opt.val_batches > 0) {
            double val = 0;
            int nw = opt.val_batches * opt.batch;
            for (int b = 0; b < opt.val_batches && !st; b++) {
                fill_val(val_ids, text.nval, T, nw, b * opt.batch + smp_dp_rank() * (int)local_batch, (int)rows, x, y);
                if ((st = upload_batch(&gg, x, y, (size_t)rows * T, V, xd, yd))) break;
                smp_tensor xt = device_tensor(smp_tensor_2d(xd, SMP_I32, rows, T)),
                           yt = device_tensor(smp_tensor_2d(yd, SMP_I32, rows, T));
                smp_step_output loss_mb;
                memset(&loss_mb, 0, sizeof loss_mb);
                if ((st = SMP_EVAL_STEP(model, gpt_gpu_loss_body, &gg, &loss_mb, 1, xt, yt))) break;
                val += smp_step_output_reduce_mean_global_f64(&loss_mb);
                smp_step_output_free(&loss_mb);
            }
            if (fail_all(st, "validation")) goto done;
            val /= opt.val_batches;
            if (root) {
                if (opt.print_losses) printf("validation %a\n", val);
                printf("validation loss: %.3f (unigram baseline: %.3f)\n", val, baseline);
                fflush(stdout);
            }
        }

        if (opt.logits && fail_all(print_context_logits(model, &text, opt.logits, M), "--logits")) goto done;

        /* ---------------------------------------------------------------- a sample */
        if (opt.sample_len > 0) {
            char *sample_text = NULL;
            st = generate(model, &text, &opt, M, &sample_text);
            if (fail_all(st, "generation")) goto done;
            if (root) printf("sample (temperature %.2f, seed %d):\n%s\n", opt.temperature, opt.seed, sample_text);
            free(sample_text);
        }

        /* ---------------------------------------------------------------- the checkpoint */
        if (opt.save && *opt.save && !opt.save_at &&
            fail_all(save_checkpoint(model, &opt, &text, NULL, 0), "checkpoint"))
            goto done;
        if (fail_all(print_memory_peaks("gpt"), "the memory account")) goto done;
        rc = 0;
    }

done:
    plain_free(&pl);
    adamw_free(&opt_state);
    if (model) smp_model_free(model);
    gpt_free(&net);
    smp_nccl_free(xd);
    smp_nccl_free(yd);
    gpt_gpu_free(&gg);
    free(train_ids);
    free(val_ids);
    free(x);
    free(y);
    free(text.train);
    free(text.val);
    smp_finalize();
    MPI_Finalize();
    return rc;
}
