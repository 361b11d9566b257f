/* bench/nccl.cu - smp's device path against raw NCCL, side by side in one run.

   1. all-reduce: smp_all_reduce of a 64 MiB f32 device tensor against
      ncclAllReduce of the same buffer on the communicator smp made
      (smp_nccl_comm(SMP_WORLD)), queued on the same engine stream.
   2. pipeline step (2 ranks, a GPU each): one training step of the CUDA
      example's model (examples/fmnist_cuda.h) split in 2 stages, batch B in
      M microbatches, 1F1B: smp_step against the same kernels with the
      activations and gradients moved by hand-written ncclSend/ncclRecv on
      the engine stream, paired the way Megatron-LM pairs them (send the
      next activation and receive the previous gradient in one NCCL group),
      in the same operation order as smp's schedule.

   Every timed run starts after a barrier and ends when the host sees the
   result (the engine stream synchronised; for smp also its own streams);
   a run's time is the slowest rank's. Warm-up runs first, then the median
   of N, smp and raw runs alternating so that drift hits both. Before
   timing, one step of each is checked against the other (loss and
   gradients). The last line is the worse of the two ratios:
       nccl smp/raw time ratio: X.XX

   Run:  make bench-nccl          (mpirun -n 2 with two GPUs or more, -n 1 with one)
         mpirun -n 2 build/bench/nccl [--iters N] [--warmup W] [--mib S] [--batch B] [--microbatches M]
   One GPU: NCCL refuses two ranks on one GPU (smp then moves device data
   through host memory, and raw NCCL cannot run at all), so run it with
   -n 1: the all-reduce runs on a one-rank communicator (what it measures
   is the per-call cost, not a link) and the pipeline part says it is
   skipped. Without a GPU it prints "skipped: no GPU" and exits 0.
*/
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_nccl.h"
#include "fmnist_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- errors */
static void fatal(const char *what, const char *detail) {
    fprintf(stderr, "bench/nccl: rank %d: %s: %s\n", smp_rank(), what, detail);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
}
#define SMP_CHECK(call)                                                                                     \
    do {                                                                                                    \
        if ((call) != SMP_OK) fatal(#call, smp_last_error());                                               \
    } while (0)
#define CUDA_CHECK(call)                                                                                    \
    do {                                                                                                    \
        cudaError_t e_ = (call);                                                                            \
        if (e_ != cudaSuccess) fatal(#call, cudaGetErrorString(e_));                                        \
    } while (0)

/* smp's communicators are nonblocking: a call may answer ncclInProgress
   until NCCL has really queued it. A raw caller on them has to wait the
   same way smp does. */
static void nccl_check(ncclComm_t comm, ncclResult_t r, const char *call) {
    while (r == ncclInProgress) {
        ncclResult_t state = ncclInProgress;
        ncclResult_t q = ncclCommGetAsyncError(comm, &state);
        r = q != ncclSuccess ? q : state;
    }
    if (r != ncclSuccess) {
        char detail[512];
        const char *last = ncclGetLastError(comm);
        snprintf(detail, sizeof detail, "%s%s%s", ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
        fatal(call, detail);
    }
}
#define NCCL_CHECK(comm, call) nccl_check((comm), (call), #call)

/* ---------------------------------------------------------------- timing */
typedef void (*run_fn)(void *ctx);

/* One run as the slowest rank saw it: from a common start until this
   rank's stream has finished the work. */
static double timed_run(run_fn run, void *ctx, cudaStream_t stream) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    run(ctx);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    double t = MPI_Wtime() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return t;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, by_value);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Median seconds of smp's runs and of the raw runs, interleaved. */
static void compare(run_fn smp_run, run_fn raw_run, void *ctx, cudaStream_t stream, int warmup, int iters,
                    double *smp_s, double *raw_s) {
    for (int i = 0; i < warmup; i++) {
        timed_run(smp_run, ctx, stream);
        timed_run(raw_run, ctx, stream);
    }
    double *s = (double *)malloc(sizeof(double) * (size_t)iters), *r = (double *)malloc(sizeof(double) * (size_t)iters);
    for (int i = 0; i < iters; i++) {
        if (i % 2) {
            s[i] = timed_run(smp_run, ctx, stream);
            r[i] = timed_run(raw_run, ctx, stream);
        } else {
            r[i] = timed_run(raw_run, ctx, stream);
            s[i] = timed_run(smp_run, ctx, stream);
        }
    }
    *smp_s = median(s, iters);
    *raw_s = median(r, iters);
    free(s);
    free(r);
}

/* ---------------------------------------------------------------- 1. all-reduce */
typedef struct allreduce_bench {
    float *buf;
    size_t count;
    ncclComm_t comm;
    cudaStream_t stream;
} allreduce_bench;

static void allreduce_smp(void *p) {
    allreduce_bench *b = (allreduce_bench *)p;
    smp_tensor t = device_tensor(smp_tensor_1d(b->buf, SMP_F32, (int64_t)b->count));
    SMP_CHECK(smp_all_reduce(&t, &t, SMP_AVG, SMP_WORLD));
}

static void allreduce_raw(void *p) {
    allreduce_bench *b = (allreduce_bench *)p;
    NCCL_CHECK(b->comm, ncclAllReduce(b->buf, b->buf, b->count, ncclFloat, ncclAvg, b->comm, b->stream));
}

/* ---------------------------------------------------------------- 2. pipeline step */
/* The model's calls in order: fc0 act0 fc1 act1 ... act3 fc4. */
enum { NCALLS = 2 * NLAYERS - 1 };
static smp_module *module_of_call(const mlp *net, int call) {
    return call % 2 ? net->act[call / 2] : net->fc[call / 2];
}
static int width_of_call(int call) { return widths[call / 2 + 1]; } /* a linear layer's and the ReLU after it alike */

typedef struct pipeline_bench {
    const gpu_engine *engine;
    mlp *net;
    smp_model *model;
    smp_tensor x_t, y_t;          /* the step's arguments: the batch on the device */
    int rows, microbatches;       /* rows per microbatch */
    double smp_loss, raw_loss;    /* of the last step (raw: on the last stage only) */
    /* the hand-written pipeline */
    ncclComm_t comm;
    int peer;                     /* the other stage's rank in comm */
    int first, last;              /* this rank's calls: first .. last - 1 */
    float *out[NCALLS];           /* [call] outputs of every microbatch, microbatch k at k * rows * width */
    float *boundary_in;           /* last stage: received activations, per microbatch */
    float *boundary_grad;         /* first stage: received gradients; last stage: gradients to send */
    float *scratch[2];            /* gradients between local calls, alternating so dy and dx never overlap */
    float *dlogits;
} pipeline_bench;

static float *mb_slice(float *base, int k, int rows, int width) { return base + (size_t)k * rows * width; }

/* The first local call's input for microbatch k. */
static const float *stage_input(pipeline_bench *b, int k) {
    if (b->first == 0) return (const float *)b->x_t.data + (size_t)k * b->rows * FM_PIXELS;
    return mb_slice(b->boundary_in, k, b->rows, width_of_call(b->first - 1));
}

static void raw_forward(pipeline_bench *b, int k) {
    const float *in = stage_input(b, k);
    for (int c = b->first; c < b->last; c++) {
        float *y = mb_slice(b->out[c], k, b->rows, width_of_call(c));
        if (c % 2 == 0) {
            const linear *l = &b->net->lin[c / 2];
            SMP_CHECK(
                gpu_linear_forward(b->engine, in, values_of(l->weight), values_of(l->bias), y, b->rows, l->in, l->out));
        } else {
            SMP_CHECK(gpu_relu_forward(b->engine, in, y, (int64_t)b->rows * width_of_call(c)));
        }
        in = y;
    }
}

/* dy: the gradient of the last local call's output for microbatch k. */
static void raw_backward(pipeline_bench *b, int k, const float *dy) {
    for (int c = b->last - 1; c >= b->first; c--) {
        const float *in = c == b->first ? stage_input(b, k) : mb_slice(b->out[c - 1], k, b->rows, width_of_call(c - 1));
        float *dx = c == 0 ? NULL /* images need no gradient */
                  : c == b->first ? mb_slice(b->boundary_grad, k, b->rows, width_of_call(c - 1))
                  : b->scratch[(b->last - 1 - c) % 2];
        if (c % 2 == 0) {
            const linear *l = &b->net->lin[c / 2];
            SMP_CHECK(gpu_linear_backward(b->engine, in, values_of(l->weight), dy, dx, grads_of(l->weight),
                                          grads_of(l->bias), b->rows, l->in, l->out));
        } else if (dx) {
            SMP_CHECK(gpu_relu_backward(b->engine, mb_slice(b->out[c], k, b->rows, width_of_call(c)), dy, dx,
                                        (int64_t)b->rows * width_of_call(c)));
        }
        dy = dx;
    }
}

/* The boundary tensors of one microbatch, in floats. */
static size_t boundary_count(const pipeline_bench *b) {
    return (size_t)b->rows * (size_t)width_of_call(b->first == 0 ? b->last - 1 : b->first - 1);
}

static void zero_local_grads(pipeline_bench *b) {
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(b->model, i, false)) != NULL; i++)
        CUDA_CHECK(
            cudaMemsetAsync(smp_param_grad(p)->data, 0, smp_tensor_nbytes(smp_param_grad(p)), b->engine->stream));
}

/* 1F1B on two stages, as smp schedules it: the first stage runs F0, then
   F(k) B(k-1) pairs, then the last B; the last stage runs F(k) B(k) per
   microbatch. Each direction's messages pair up in order; grouping "send
   mine, receive theirs" keeps the two streams from waiting on each other. */
static void pipeline_raw(void *p) {
    pipeline_bench *b = (pipeline_bench *)p;
    cudaStream_t s = b->engine->stream;
    size_t n = boundary_count(b);
    int M = b->microbatches;
    zero_local_grads(b);
    if (b->first == 0) {
        float *act = b->out[b->last - 1];
        raw_forward(b, 0);
        NCCL_CHECK(b->comm,
                   ncclSend(mb_slice(act, 0, b->rows, width_of_call(b->last - 1)), n, ncclFloat, b->peer, b->comm, s));
        for (int k = 1; k < M; k++) {
            raw_forward(b, k);
            NCCL_CHECK(b->comm, ncclGroupStart());
            NCCL_CHECK(b->comm, ncclSend(act + k * n, n, ncclFloat, b->peer, b->comm, s));
            NCCL_CHECK(b->comm, ncclRecv(b->boundary_grad + (k - 1) * n, n, ncclFloat, b->peer, b->comm, s));
            NCCL_CHECK(b->comm, ncclGroupEnd());
            raw_backward(b, k - 1, b->boundary_grad + (k - 1) * n);
        }
        NCCL_CHECK(b->comm, ncclRecv(b->boundary_grad + (M - 1) * n, n, ncclFloat, b->peer, b->comm, s));
        raw_backward(b, M - 1, b->boundary_grad + (M - 1) * n);
    } else {
        double loss_sum = 0;
        NCCL_CHECK(b->comm, ncclRecv(b->boundary_in, n, ncclFloat, b->peer, b->comm, s));
        for (int k = 0; k < M; k++) {
            raw_forward(b, k);
            float loss = 0.0f, correct = 0.0f;
            const float *logits = mb_slice(b->out[NCALLS - 1], k, b->rows, FM_CLASSES);
            /* 1/B: smp scales the body's 1/rows by 1/M itself (average_grads_across_microbatches) */
            SMP_CHECK(gpu_xent_loss(b->engine, logits, (const uint8_t *)b->y_t.data + (size_t)k * b->rows, b->rows,
                                    FM_CLASSES, b->dlogits, 1.0f / (float)(b->rows * M), &loss, &correct));
            loss_sum += loss;
            raw_backward(b, k, b->dlogits);
            if (k + 1 < M) {
                NCCL_CHECK(b->comm, ncclGroupStart());
                NCCL_CHECK(b->comm, ncclSend(b->boundary_grad + k * n, n, ncclFloat, b->peer, b->comm, s));
                NCCL_CHECK(b->comm, ncclRecv(b->boundary_in + (k + 1) * n, n, ncclFloat, b->peer, b->comm, s));
                NCCL_CHECK(b->comm, ncclGroupEnd());
            } else {
                NCCL_CHECK(b->comm, ncclSend(b->boundary_grad + k * n, n, ncclFloat, b->peer, b->comm, s));
            }
        }
        b->raw_loss = loss_sum / M;
    }
}

static void pipeline_smp(void *p) {
    pipeline_bench *b = (pipeline_bench *)p;
    smp_step_output loss_mb = {0, NULL};
    smp_model_zero_grad(b->model);
    SMP_CHECK(SMP_TRAIN_STEP(b->model, train_body, (void *)b->engine, &loss_mb, 1, b->x_t, b->y_t));
    b->smp_loss = smp_step_output_reduce_mean_f64(&loss_mb);
    smp_step_output_free(&loss_mb);
    SMP_CHECK(smp_nccl_synchronize()); /* its transfers too, as the raw step's are on the engine stream */
}

/* This rank's gradients, in parameter order, on the host. */
static float *local_grads(pipeline_bench *b, size_t *count) {
    smp_param *p;
    size_t n = 0;
    for (int i = 0; (p = smp_model_local_param(b->model, i, false)) != NULL; i++)
        n += (size_t)smp_tensor_numel(smp_param_grad(p));
    float *h = (float *)malloc(sizeof(float) * (n ? n : 1));
    size_t at = 0;
    for (int i = 0; (p = smp_model_local_param(b->model, i, false)) != NULL; i++) {
        const smp_tensor *g = smp_param_grad(p);
        CUDA_CHECK(cudaMemcpyAsync(h + at, g->data, smp_tensor_nbytes(g), cudaMemcpyDeviceToHost, b->engine->stream));
        at += (size_t)smp_tensor_numel(g);
    }
    CUDA_CHECK(cudaStreamSynchronize(b->engine->stream));
    *count = n;
    return h;
}

/* One step each from the same weights and batch: the hand-written pipeline
   must compute what smp computes, or the comparison means nothing. */
static void check_same_step(pipeline_bench *b) {
    size_t n, n2;
    timed_run(pipeline_smp, b, b->engine->stream);
    float *want = local_grads(b, &n);
    timed_run(pipeline_raw, b, b->engine->stream);
    float *got = local_grads(b, &n2);
    double diff = 0, scale = 0;
    for (size_t i = 0; i < n && n == n2; i++) {
        double d = fabs((double)want[i] - got[i]), a = fabs((double)want[i]);
        if (d > diff) diff = d;
        if (a > scale) scale = a;
    }
    double rel = scale > 0 ? diff / scale : diff, raw_loss = b->last == NCALLS ? b->raw_loss : 0;
    MPI_Allreduce(MPI_IN_PLACE, &rel, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &raw_loss, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    if (smp_rank() == 0) {
        printf("check: loss smp %.6f raw %.6f; gradients differ by %.1e of the largest\n", b->smp_loss, raw_loss, rel);
        if (rel > 1e-4 || fabs(b->smp_loss - raw_loss) > 1e-4 * fabs(raw_loss))
            printf("WARNING: the hand-written pipeline does not compute smp's step; its timing is not comparable\n");
    }
    free(want);
    free(got);
}

/* Where smp put the layers decides what the hand-written pipeline runs. */
static void plan_raw_pipeline(pipeline_bench *b) {
    b->first = -1;
    b->last = -1;
    for (int c = 0; c < NCALLS; c++)
        if (smp_module_is_local(module_of_call(b->net, c))) {
            if (b->first < 0) b->first = c;
            b->last = c + 1;
        }
    for (int c = b->first; c >= 0 && c < b->last; c++)
        if (!smp_module_is_local(module_of_call(b->net, c)))
            fatal("planning the hand-written pipeline", "this rank's layers are not one contiguous stage");
    if (b->first < 0 || (b->first == 0) == (b->last == NCALLS))
        fatal("planning the hand-written pipeline", "expected the model in two stages, one on each rank");
    b->comm = smp_nccl_comm(SMP_MP_GROUP);
    if (!b->comm) fatal("smp_nccl_comm(SMP_MP_GROUP)", "no NCCL communicator");
    int me = 0;
    NCCL_CHECK(b->comm, ncclCommUserRank(b->comm, &me));
    b->peer = 1 - me;
    size_t M = (size_t)b->microbatches, rows = (size_t)b->rows;
    for (int c = b->first; c < b->last; c++)
        CUDA_CHECK(cudaMalloc((void **)&b->out[c], sizeof(float) * M * rows * (size_t)width_of_call(c)));
    size_t boundary = boundary_count(b);
    CUDA_CHECK(cudaMalloc((void **)&b->boundary_grad, sizeof(float) * M * boundary));
    if (b->first > 0) CUDA_CHECK(cudaMalloc((void **)&b->boundary_in, sizeof(float) * M * boundary));
    int widest = 0;
    for (int c = b->first; c < b->last; c++) widest = width_of_call(c) > widest ? width_of_call(c) : widest;
    for (int i = 0; i < 2; i++) CUDA_CHECK(cudaMalloc((void **)&b->scratch[i], sizeof(float) * rows * (size_t)widest));
    CUDA_CHECK(cudaMalloc((void **)&b->dlogits, sizeof(float) * rows * FM_CLASSES));
}

static void free_raw_pipeline(pipeline_bench *b) {
    for (int c = 0; c < NCALLS; c++) CUDA_CHECK(cudaFree(b->out[c]));
    CUDA_CHECK(cudaFree(b->boundary_in));
    CUDA_CHECK(cudaFree(b->boundary_grad));
    for (int i = 0; i < 2; i++) CUDA_CHECK(cudaFree(b->scratch[i]));
    CUDA_CHECK(cudaFree(b->dlogits));
}

/* ---------------------------------------------------------------- main */
typedef struct bench_options { int iters, warmup, batch, microbatches; double mib; } bench_options;

static int parse(int argc, char **argv, bench_options *o) {
    o->iters = 20;
    o->warmup = 5;
    o->batch = 128; /* the CUDA example's defaults */
    o->microbatches = 4;
    o->mib = 64;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && v && ++i)
        if (OPT("--iters")) o->iters = atoi(v);
        else if (OPT("--warmup")) o->warmup = atoi(v);
        else if (OPT("--batch")) o->batch = atoi(v);
        else if (OPT("--microbatches")) o->microbatches = atoi(v);
        else if (OPT("--mib")) o->mib = atof(v);
        else return 1;
#undef OPT
    }
    return o->iters < 1 || o->warmup < 0 || o->microbatches < 1 || o->batch < o->microbatches ||
           o->batch % o->microbatches || o->mib <= 0;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int world = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    bench_options opt;
    if (parse(argc, argv, &opt)) {
        fprintf(stderr, "usage: %s [--iters N] [--warmup W] [--mib S] [--batch B] [--microbatches M (dividing B)]\n",
                argv[0]);
        MPI_Finalize();
        return 2;
    }
    smp_config cfg = {};
    cfg.partitions = world == 2 ? 2 : 1; /* the pipeline part: 2 stages on 2 ranks */
    if (world / cfg.partitions > 1) cfg.ddp = SMP_ON;
    cfg.microbatches = opt.microbatches;
    cfg.pipeline = SMP_PIPELINE_INTERLEAVED;
    if (smp_init(&cfg)) {
        fprintf(stderr, "smp_init: %s\n", smp_last_error());
        MPI_Finalize();
        return 1;
    }
    smp_nccl_mode mode = smp_nccl_current_mode();
    if (mode != SMP_NCCL_MODE_NCCL) {
        if (smp_rank() == 0) {
            if (mode == SMP_NCCL_MODE_NONE) printf("skipped: no GPU (%s)\n", smp_nccl_describe());
            else
                printf("skipped: these %d ranks share a GPU, so smp moves device data through host memory and raw NCCL "
                       "cannot run "
                       "(NCCL wants one GPU per rank); on a one-GPU machine run with mpirun -n 1\n",
                       world);
        }
        smp_finalize();
        MPI_Finalize();
        return 0;
    }
    gpu_engine engine;
    SMP_CHECK(gpu_agree(gpu_engine_init(&engine)));
    if (smp_rank() == 0)
        printf("nccl bench: %d rank(s), %s; median of %d runs after %d warm-up\n", world, smp_nccl_describe(),
               opt.iters, opt.warmup);

    /* 1. all-reduce */
    allreduce_bench ar;
    ar.count = (size_t)(opt.mib * 1024 * 1024) / sizeof(float);
    ar.comm = smp_nccl_comm(SMP_WORLD);
    if (!ar.comm) fatal("smp_nccl_comm(SMP_WORLD)", "no NCCL communicator");
    ar.stream = engine.stream;
    CUDA_CHECK(cudaMalloc((void **)&ar.buf, sizeof(float) * ar.count));
    CUDA_CHECK(cudaMemsetAsync(ar.buf, 0, sizeof(float) * ar.count, engine.stream));
    double ar_smp, ar_raw;
    compare(allreduce_smp, allreduce_raw, &ar, engine.stream, opt.warmup, opt.iters, &ar_smp, &ar_raw);
    CUDA_CHECK(cudaFree(ar.buf)); /* nothing in flight: every run ended synchronised */
    double worst = ar_smp / ar_raw;
    if (smp_rank() == 0) {
        /* ring all-reduce traffic per byte */
        double bytes = (double)ar.count * sizeof(float), bus = world > 1 ? 2.0 * (world - 1) / world : 0;
        printf("all_reduce %.0f MiB f32 avg over %d rank(s): smp %.3f ms, raw %.3f ms", opt.mib, world, 1e3 * ar_smp,
               1e3 * ar_raw);
        if (bus > 0) printf(" (bus %.1f / %.1f GB/s)", bytes * bus / ar_smp / 1e9, bytes * bus / ar_raw / 1e9);
        printf("; smp/raw %.2f\n", ar_smp / ar_raw);
    }

    /* 2. pipeline step */
    if (world == 2) {
        mlp net;
        memset(&net, 0, sizeof net);
        pipeline_bench pb;
        memset(&pb, 0, sizeof pb);
        pb.engine = &engine;
        pb.net = &net;
        pb.rows = opt.batch / opt.microbatches;
        pb.microbatches = opt.microbatches;
        SMP_CHECK(build_model(&net, &engine, 2, &pb.model));
        /* a synthetic batch: the timing does not depend on the pixels */
        float *xh = (float *)malloc(sizeof(float) * (size_t)opt.batch * FM_PIXELS);
        uint8_t *yh = (uint8_t *)malloc((size_t)opt.batch);
        mlp_rng rng = mlp_rng_seed(1);
        for (size_t i = 0; i < (size_t)opt.batch * FM_PIXELS; i++) xh[i] = 2.0f * mlp_rng_float(&rng) - 1.0f;
        for (int i = 0; i < opt.batch; i++) yh[i] = (uint8_t)mlp_rng_below(&rng, FM_CLASSES);
        float *xd;
        uint8_t *yd;
        CUDA_CHECK(cudaMalloc((void **)&xd, sizeof(float) * (size_t)opt.batch * FM_PIXELS));
        CUDA_CHECK(cudaMalloc((void **)&yd, (size_t)opt.batch));
        SMP_CHECK(gpu_upload(&engine, xd, xh, sizeof(float) * (size_t)opt.batch * FM_PIXELS));
        SMP_CHECK(gpu_upload(&engine, yd, yh, (size_t)opt.batch));
        pb.x_t = device_tensor(smp_tensor_2d(xd, SMP_F32, opt.batch, FM_PIXELS));
        pb.y_t = device_tensor(smp_tensor_1d(yd, SMP_U8, opt.batch));
        smp_tensor sample = device_tensor(smp_tensor_2d(xd, SMP_F32, pb.rows, FM_PIXELS));
        SMP_CHECK(smp_model_trace(pb.model, &sample, 1));
        plan_raw_pipeline(&pb);
        check_same_step(&pb);
        double st_smp, st_raw;
        compare(pipeline_smp, pipeline_raw, &pb, engine.stream, opt.warmup, opt.iters, &st_smp, &st_raw);
        if (st_smp / st_raw > worst) worst = st_smp / st_raw;
        int cut = pb.first == 0 ? pb.last : pb.first; /* the first call of the second stage, the same on both ranks */
        if (smp_rank() == 0)
            printf("pipeline step, batch %d in %d microbatches (1F1B), stages %s..%s | %s..fc%d: smp %.3f ms, raw %.3f "
                   "ms; smp/raw %.2f\n",
                   opt.batch, opt.microbatches, smp_module_name(module_of_call(&net, 0)),
                   smp_module_name(module_of_call(&net, cut - 1)), smp_module_name(module_of_call(&net, cut)),
                   NLAYERS - 1, 1e3 * st_smp, 1e3 * st_raw, st_smp / st_raw);
        CUDA_CHECK(cudaStreamSynchronize(engine.stream));
        free_raw_pipeline(&pb);
        CUDA_CHECK(cudaFree(xd));
        CUDA_CHECK(cudaFree(yd));
        free(xh);
        free(yh);
        smp_model_free(pb.model);
    } else if (smp_rank() == 0) {
        printf("pipeline step: skipped (it needs 2 ranks with a GPU each; this run has %d)\n", world);
    }
    if (smp_rank() == 0) printf("nccl smp/raw time ratio: %.2f\n", worst);
    gpu_engine_free(&engine);
    smp_finalize();
    MPI_Finalize();
    return 0;
}
