/* smp.h - split one model across many processes (pipeline + data parallel).

   CONTENTS (this comment, in order)
     USAGE                  one C file defines SMP_IMPLEMENTATION
     THE SMALLEST PROGRAM   a 2-stage pipeline that trains (examples/minimal.c)
     CONFIG KEYS            smp_config fields and their JSON names
     ENVIRONMENT VARIABLES  every variable the four headers read
     THREADING MODEL        which thread calls what; the MPI thread level
     HOOKS                  SMP_MALLOC, SMP_FREE, SMP_ASSERT, SMPDEF, logging
     ERRORS                 smp_status and smp_last_error
     OUT OF MEMORY          one policy
     STEP MEMORY            the models' caches: no system allocation in a steady step
     VERSION AND LICENCE
     TESTING                SMP_TESTING's fault injection
   Then: smp_pipeline.h (schedules, steps, StepOutput, DDP, the timeline),
   smp_checkpoint.h (saves and loads), smp_nccl.h (the CUDA/NCCL backend),
   each opening with a comment of the same kind; README.md (the tutorial)
   and docs/REFERENCE.md (config keys, the environment, failures, hosts).

   The core of smp: context and config, topology and groups, tensors, the
   module tree, partition contexts, tracing, the auto-partitioner, object
   messaging and host-memory collectives over MPI. Pipelines live in
   smp_pipeline.h, the CUDA/NCCL backend in smp_nccl.h, checkpoints in
   smp_checkpoint.h.

   USAGE
     In exactly one C file:
         #define SMP_IMPLEMENTATION
         #include "smp.h"
     Everywhere else include "smp.h" for the declarations only.

   THE SMALLEST PROGRAM: four layers in two pipeline stages, trained with
   SGD on 4 microbatches a step. The lines below are examples/minimal.c's,
   in order, with "..." where lines are left out (the kernels' loops, the
   comments); make test checks that they are, and builds and runs the file.
    #define SMP_IMPLEMENTATION
    #include "smp.h"
    #include "smp_pipeline.h"
    ...
    static smp_status fc_forward(smp_call_ctx *c) {
        const smp_tensor *x = smp_call_input(c, 0);
        const float *w = smp_param_value(*(smp_param **)smp_module_user(smp_call_module(c)))->data, *xs = x->data;
        int64_t n = x->shape[0];
        smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, (int64_t[]){n, WIDTH});
        if (!y) return SMP_ERR_NOMEM;
    ...
    static smp_status fc_backward(smp_call_ctx *c) {
        smp_param *p = *(smp_param **)smp_module_user(smp_call_module(c));
    ...
    static smp_status forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
        (void)m, (void)nin, (void)nout, (void)user;
        smp_tensor h = in[0];
        for (int l = 0; l < LAYERS; l++) SMP_TRY(smp_call(layer[l], &h, 1, l == LAYERS - 1 ? out : &h, 1));
        return SMP_OK;
    }
    ...
    SMP_STEP_BODY(mse_body) {
        const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
        smp_tensor *g = smp_mb_output_grad(mb, 0);
        ...
        return smp_mb_return_f32(mb, 0, loss);
    }
    ...
    int main(void) {
        smp_config cfg = {0}; // zero means defaults
        cfg.partitions = 2;
        cfg.microbatches = 4;
        if (smp_init(&cfg)) { fprintf(stderr, "%s\n", smp_last_error()); return 1; }
        smp_module *root = smp_module_new(NULL, "", NULL);
        for (int l = 0; l < LAYERS; l++) {
            char name[16];
            snprintf(name, sizeof name, "fc%d", l);
            layer[l] = smp_module_new(root, name, &(smp_module_desc){fc_forward, fc_backward, &weight[l]});
            weight[l] = smp_param_new(layer[l], "weight", SMP_F32, 2, (int64_t[]){WIDTH, WIDTH},
                                      smp_init_uniform, NULL);
        }
        smp_model *model = NULL;
        smp_status st = smp_model_new(root, &(smp_model_desc){.forward = forward}, &model);
        if (st) fprintf(stderr, "%s\n", smp_last_error());
        static float x[BATCH * WIDTH], t[BATCH * WIDTH]; // learn t = sin(x), elementwise
        for (int i = 0; i < BATCH * WIDTH; i++) { x[i] = (float)((i * 37) % 101) / 50.0f - 1.0f; t[i] = sinf(x[i]); }
        smp_tensor xs = smp_tensor_2d(x, SMP_F32, BATCH, WIDTH), ts = smp_tensor_2d(t, SMP_F32, BATCH, WIDTH);
        for (int step = 0; step < STEPS && !st; step++) {
            smp_step_output loss = {0};
            smp_model_zero_grad(model);
            st = SMP_TRAIN_STEP(model, mse_body, NULL, &loss, 1, xs, ts);
            if (st) { fprintf(stderr, "step %d: %s\n", step, smp_last_error()); break; }
            smp_param *p;
            for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) // SGD on this rank's layers
                for (int64_t k = 0; k < smp_tensor_numel(smp_param_value(p)); k++)
                    ((float *)smp_param_value(p)->data)[k] -= 0.5f * ((float *)smp_param_grad(p)->data)[k];
            if (smp_rank() == 0 && step % 10 == 0)
                printf("step %d loss %.5f\n", step, smp_step_output_reduce_mean_f64(&loss));
            smp_step_output_free(&loss);
        }
        smp_model_free(model);
        smp_finalize(); // after a failure too: leaving main without it makes the exit guard abort the job
        return st ? 1 : 0;
    }
   Build: mpicc -std=c11 -O2 -I. examples/minimal.c -o minimal -lm
   Run:   mpirun -n 2 ./minimal    (-std=c99 works as well, with gcc or clang)

   CONFIG KEYS (smp_config fields, or the same keys as JSON in SMP_CONFIG /
   smp_config_from_json, as in SageMaker's "modelparallel" parameters):
     partitions (1)            microbatches (1)
     pipeline (interleaved|simple|zero_bubble|zero_bubble_v)
     optimize (speed|memory)   auto_partition (true)   default_partition (none)
     ddp (false)               placement_strategy (cluster|spread|DPT|PTD|...: smp_placement)
     pipeline_parallel_degree (= partitions)           tensor_parallel_degree (1)
     memory_weight (speed: 0, memory: 1)               trace_device (cpu|gpu)
     trace_execution_times (false)  trace_memory_usage (false)
     overlapping_allreduce (true)   backward_passes_per_step (1)
     average_grads_across_microbatches (true)  bucket_cap_mb (25)
     broadcast_buffers (true)   prescaled_batch (true: a TP group's ranks read the same batch; false: their own,
       joined by smp_step: smp_group below)
   smp's own keys: virtual_stages (1), deterministic_reduction (false),
     activation_checkpointing (false: recompute every top-level call),
     active_microbatches (0: no cap beyond the schedule's; smp_pipeline.h, ACTIVE MICROBATCHES),
     shard_optimizer_state (false; needs ddp and 2 or more replicas: SHARDED OPTIMIZER STATE below),
     offload_activations (false; on_device models: smp_pipeline.h, ACTIVATION OFFLOADING),
     activation_loading_horizon (4: pipeline tasks ahead of a backward that its activations come back),
     timeout (seconds, also SMP_TIMEOUT; 600), seed (0).

   ENVIRONMENT VARIABLES: all that the four headers read, in one table.
   Give each the same value on every rank (mpirun -x / -genv), except
   SMP_CKPT_FAULT. The other headers point here.
     variable        header            read by            effect
     SMP_CONFIG      smp.h             smp_init           JSON of the CONFIG KEYS above,
                                                          '{"partitions": 2, "microbatches": 8}';
                                                          overrides the smp_config passed; a
                                                          bad key or value fails smp_init
     SMP_TIMEOUT     smp.h             smp_init (and      seconds any one wait may take
                                       waits before it)   (> 0, default 600; a nonzero config
                                                          timeout wins); past it the rank says
                                                          what it waited for and from whom,
                                                          and the job aborts
     SMP_VERBOSE     smp.h,            the default        set: INFO messages go to stderr too:
                     smp_pipeline.h    logger             the partition report and, at the
                                                          first step, what each schedule would
                                                          make of the model (rank 0)
     SMP_TIMELINE    smp_pipeline.h    a model's first    a path: every rank records its
                                       step               operations; smp_model_free has
                                                          rank 0 write them into one Chrome
                                                          trace / Perfetto file
     SMP_NCCL        smp_nccl.h        smp_init           auto (default) | nccl | staged: the
                                                          device path (smp_nccl.h, DEVICES AND
                                                          PATHS); nccl refuses GPUs shared by
                                                          ranks, staged forces host staging
     SMP_NCCL_SYNC   smp_nccl.h        smp_init           set and not 0: each device collective
                                                          also waits on the host, under the
                                                          deadline (a hang becomes a message)
     SMP_CKPT_FAULT  smp_checkpoint.h  each checkpoint    TESTS ONLY, on one rank: a phase
                                       write              (header, data, flush, rename, dirsync,
                                                          renamed, manifest, commit, cleanup;
                                                          smp_checkpoint.h says where each is)
                                                          where the writer _exit(77)s, to test
                                                          crash safety; an unknown name fails
                                                          the save. Read only in SMP_TESTING
                                                          builds (TESTING below)
   Nothing else in the environment changes what smp does (MPI's, UCX's and
   NCCL's own variables aside).

   THREADING MODEL
     smp is called from one thread per process: the thread that called
     smp_init (the "main" thread) makes every smp call, and module
     callbacks, step bodies, init callbacks, post-partition hooks and the
     logger run on it, inside the smp call that runs them. Calls are not
     reentrant: a callback may call what its header says it may (smp_call
     and smp_call_* in module callbacks, smp_mb_* in a body), not a step,
     a collective or a save. All MPI calls smp makes are on the main thread,
     so smp needs MPI_THREAD_FUNNELED: smp_init asks MPI_Init_thread for it
     when it initialises MPI; an engine that initialises MPI itself must ask
     for FUNNELED or more (SERIALIZED, MULTIPLE) and make its own MPI calls
     on other communicators, never inside an smp call's callbacks while
     smp waits on the same communicator.
     The one thread smp starts is the checkpoint I/O thread
     (smp_checkpoint.h): a full save's writer (world rank 0) checksums and
     writes file chunks on it while the main thread receives the next ones;
     it lives only inside that save call, makes no MPI call and shares only
     its queue with the main thread (under a lock); the only engine code it
     can reach is the logger, for SMP_CKPT_FAULT's last words (SMP_TESTING
     builds). make test runs it under ThreadSanitizer (test_ckpt_threads).
     smp_last_error() is per thread (thread-local): the message of the last
     call that failed on the calling thread, so the I/O thread never writes
     over (or tears) the one the main thread reads; an error it meets is
     handed to the main thread when the save joins it, and the save returns
     it there with its message. smp_nccl.h starts none; device work is queued on the
     engine's stream from the main thread. The engine's own threads (a data
     loader, OpenMP or BLAS threads inside kernels) may run freely, but may
     not call smp.

   HOOKS: define before including, in the implementation file:
     SMP_MALLOC(n) / SMP_FREE(p)   allocation (default malloc/free)
     SMP_ASSERT(c)                 broken invariants (default: log + MPI_Abort)
     SMPDEF                        linkage of the API (SMP_STATIC: static)
   Logging goes through smp_set_logger(); smp never prints otherwise.

   ERRORS: calls that can fail on user input return smp_status (SMP_OK is 0)
   and smp_last_error() says what went wrong in the caller's terms (per
   thread: THREADING MODEL). An error found on one rank while others wait
   becomes an error on every rank.

   OUT OF MEMORY (one policy): an allocation smp needs that fails, host or
   device, in a step, a collective, a save or a load, makes that call return
   SMP_ERR_NOMEM naming the bytes and what they were for. Calls that agree
   (a step, saves, loads, smp_init) return it on every rank, the others'
   message naming the rank; a step then changes no parameter, does not count
   as a training step, and the engine may free memory and run it again. In
   a collective called on its own, a rank waiting for the one that failed
   aborts the job with its message, as for any collective that fails on one
   member. The calls that hand memory to the engine's callbacks
   (smp_call_output, smp_call_stash) return NULL, and the step fails with
   SMP_ERR_NOMEM even if the callback goes on. smp aborts the job only on
   broken invariants, on waits past their deadline, and at these places,
   where out of memory leaves no way back: the other ranks are in, or about
   to enter, a collective this rank cannot take part in without the memory,
   or a failed step's clean-up must finish before anything else can run
   (each abort's message says what the memory was for):
     smp.h             a persistent all-reduce's staging buffer (host
                       all-reduces of at most 16 KiB); the host copy of a
                       device tensor that tracing checksums
     smp_pipeline.h    the gather buffer of a device gradient bucket under
                       deterministic_reduction (bucket_cap_mb x replicas; a
                       host bucket's is taken as the step begins);
                       smp_clip_grad_norm's partial sums (one double per
                       parameter); the timeline's lengths (smp_model_free
                       with SMP_TIMELINE); after a failed step, the counts of
                       its transfers and messages, a message received to be
                       dropped, and a send kept until its peer receives it
     smp_nccl.h        smp_init's device backend start-up (comparing the
                       GPUs of the ranks on a node)

   STEP MEMORY: what a step hands kernels and keeps for itself (outputs,
   stashes, gradients of calls, received messages, the step's tables)
   comes from its model's cache: size classes (64 bytes, then four per
   power of two, so a block is at most a quarter larger than asked for),
   host and device (the backend's alloc), reused by the next microbatch and
   the next step, so after the first step a training step of an unchanged
   model makes no call to SMP_MALLOC or to the device's allocator
   (test_alloc counts them). Parameters and their gradients are allocated
   once, outside it. The memory account counts a block in use at the bytes
   asked for, in its category, and the rest of what the caches hold (free
   blocks, the rounding of blocks in use) as SMP_MEMORY_CACHED ("cached").
   smp_model_free gives a model's cache back to the system (a step's
   outputs the engine still holds go when it frees them). A system
   allocation that fails in a step first makes every model's cache give
   back its free blocks and is tried once more; only then does the step
   fail with SMP_ERR_NOMEM. The buffers smp hands out zeroed ("Which
   buffers arrive zeroed", with the modules below) are zeroed again every
   time a block is reused; the others are not zeroed at all.

   MPI ERRORS (one policy): smp sets MPI_ERRORS_RETURN on the communicators
   it owns (it duplicates the engine's communicator, or MPI_COMM_WORLD, at
   smp_init and derives every other from that copy) and never changes the
   error handler of a communicator the engine holds. Every MPI call in the
   four headers is checked. A failed call becomes SMP_ERR_MPI, its message
   naming the call, its purpose, the peer or group, and MPI's own text.
   In a step (pipeline messages, the shared-gradient exchange) and before
   a save's or load's first agreement, the error reaches every rank through
   the agreement that ends the call: SMP_ERR_MPI everywhere, no parameter
   changed (a step does not count, the previous checkpoint stays) and the
   next call may succeed. A collective called on its own (smp_all_reduce,
   ...) and a step's data-parallel gradient bucket, whose MPI call fails on
   some members, return the error there while a member waiting for them
   aborts the job with their message (as for out of memory); a failure on
   every member returns on every member. Where no agreement can follow -
   inside the agreement itself, blocking collectives (smp_init's
   communicators), a wait on a request others are in (a bucket in flight),
   a checkpoint's collectives and data stream, the device backend's
   start-up, a failure notice that cannot be sent - the job aborts with the
   message. Releasing what no result depends on (MPI_Type_free,
   MPI_Comm_free) logs a failure.

   VERSION AND LICENCE: SMP_VERSION_MAJOR/MINOR/PATCH and SMP_VERSION_STRING
   below; MIT (the LICENSE file next to the headers).

   TESTING: with SMP_TESTING defined, smp_testing_fail() makes the n-th
   allocation, pipeline send, pipeline message check or MPI call whose
   failure returns a status (SMP_FAULT_MPI; not those that abort) from now
   fail, or the n-th pipeline step after its last message (SMP_FAULT_STEP_END:
   what a failed step's clean-up must undo is then all of it), so tests can
   inject failures where they happen in real jobs. Test
   builds also see the introspection only tests use. One rule for every
   header's test hooks: declared at the top of its implementation under
   SMP_TESTING, outside the API, and static in every build (no program links
   against them); smp.h's fault injection is smp_testing_*, the other
   functions keep the names they have inside (smp_checkpoint.h's
   smp__ckpt_open_memory, ...). smp_checkpoint.h also obeys SMP_CKPT_FAULT
   (a crash at a chosen point of a save) in SMP_TESTING builds only.
*/
#ifndef SMP_H
#define SMP_H

/* The version of the four headers, which ship together (MIT licence: LICENSE). */
#define SMP_VERSION_MAJOR 0
#define SMP_VERSION_MINOR 4
#define SMP_VERSION_PATCH 0
#define SMP_VERSION_STRING "0.4.0"

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifndef SMPDEF
#ifdef SMP_STATIC
#if defined(__GNUC__)
#define SMPDEF static __attribute__((unused)) /* a program need not call every function */
#else
#define SMPDEF static
#endif
#else
#define SMPDEF extern
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status */
typedef enum smp_status {
    SMP_OK = 0,
    SMP_ERR_CONFIG,   /* a configuration key or value is wrong */
    SMP_ERR_ARG,      /* a call got an argument it cannot use */
    SMP_ERR_STATE,    /* a call made at the wrong time (before init, ...) */
    SMP_ERR_MPI,      /* MPI returned an error */
    SMP_ERR_DEVICE,   /* CUDA or NCCL returned an error */
    SMP_ERR_NOMEM,    /* an allocation failed */
    SMP_ERR_IO,       /* a file could not be read or written */
    SMP_ERR_FORMAT,   /* a file's content is malformed or corrupt */
    SMP_ERR_MODULE,   /* the engine's module or step body reported failure */
    SMP_ERR_REMOTE    /* another rank failed; smp_last_error() says which */
} smp_status;

/* The printf-format check every header's printf-style function carries. */
#if defined(__GNUC__)
#define SMP__PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define SMP__PRINTF(fmt, args)
#endif

SMPDEF const char *smp_last_error(void);
/* Returns from the enclosing function when expr fails (module callbacks, forwards). */
#define SMP_TRY(expr) \
    do { \
        smp_status smp_try_status_ = (expr); \
        if (smp_try_status_ != SMP_OK) return smp_try_status_; \
    } while (0)
SMPDEF const char *smp_status_name(smp_status s);
/* Records an error message (printf-style) and returns `s`; engine code may
   use it from module callbacks so its message reaches every rank. */
SMPDEF smp_status smp_error(smp_status s, const char *fmt, ...) SMP__PRINTF(2, 3);

typedef enum smp_log_level { SMP_LOG_DEBUG, SMP_LOG_INFO, SMP_LOG_WARN, SMP_LOG_ERROR } smp_log_level;
typedef void (*smp_log_fn)(smp_log_level level, const char *msg, void *user);
/* NULL restores the default, which writes WARN and ERROR (and INFO when
   SMP_VERBOSE is set) to stderr prefixed with the rank. */
SMPDEF void smp_set_logger(smp_log_fn fn, void *user);

/* ---------------------------------------------------------------- tensors */
typedef enum smp_dtype {
    SMP_DTYPE_INVALID = 0,
    SMP_F32, SMP_F16, SMP_BF16, SMP_F64, SMP_I32, SMP_I64, SMP_U8, SMP_BOOL,
    SMP_DTYPE_COUNT
} smp_dtype;

#define SMP_MAX_DIMS 8
/* A tensor's device: zero, the value of a zero-initialised tensor, is host
   memory; CUDA device n is SMP_CUDA(n) (smp_nccl_device() gives this rank's). */
#define SMP_HOST 0
#define SMP_CUDA(ordinal) ((ordinal) + 1)
#define SMP_CUDA_ORDINAL(device) ((device) - 1) /* the CUDA ordinal of a device that is not SMP_HOST */

/* A contiguous, row-major view of memory smp does not own. */
typedef struct smp_tensor {
    void *data;
    smp_dtype dtype;
    int ndim;
    int64_t shape[SMP_MAX_DIMS];
    int device; /* SMP_HOST (0) or SMP_CUDA(ordinal) */
} smp_tensor;

SMPDEF size_t smp_dtype_size(smp_dtype dt);
SMPDEF const char *smp_dtype_name(smp_dtype dt); /* "f32", "bf16", ... */
SMPDEF smp_tensor smp_tensor_make(void *data, smp_dtype dt, int ndim, const int64_t *shape);
SMPDEF smp_tensor smp_tensor_1d(void *data, smp_dtype dt, int64_t n);
SMPDEF smp_tensor smp_tensor_2d(void *data, smp_dtype dt, int64_t rows, int64_t cols);
SMPDEF int64_t smp_tensor_numel(const smp_tensor *t);
SMPDEF size_t smp_tensor_nbytes(const smp_tensor *t);


/* DLPack interop, without copying. Available when <dlpack/dlpack.h> is
   included before smp.h (or SMP_DLPACK is defined). */
#if defined(DLPACK_VERSION) || defined(DLPACK_MAJOR_VERSION) || defined(SMP_DLPACK)
#include <dlpack/dlpack.h>
SMPDEF smp_status smp_tensor_from_dlpack(const DLTensor *dl, smp_tensor *out);
/* `shape_storage` must live as long as the DLTensor (DLTensor holds a
   pointer to its shape). */
SMPDEF DLTensor smp_tensor_to_dlpack(const smp_tensor *t, int64_t shape_storage[SMP_MAX_DIMS]);
#endif

/* ---------------------------------------------------------------- config */
typedef enum smp_switch { SMP_DEFAULT = 0, SMP_ON = 1, SMP_OFF = -1 } smp_switch;
/* interleaved: 1F1B; simple: GPipe; zero_bubble: ZB-H1 (1F1B's memory, each
   backward split into input-gradient B and weight-gradient W ops, the Ws
   filling 1F1B's bubbles); zero_bubble_v: ZB-V (the model in 2 x partitions
   stages placed in a V, partition r running stages r and 2P-1-r, the loss
   back on partition 0; a near-zero bubble at 1F1B's peak memory; see
   smp_pipeline.h) */
typedef enum smp_pipeline_kind {
    SMP_PIPELINE_DEFAULT = 0,
    SMP_PIPELINE_INTERLEAVED,
    SMP_PIPELINE_SIMPLE,
    SMP_PIPELINE_ZERO_BUBBLE,
    SMP_PIPELINE_ZERO_BUBBLE_V
} smp_pipeline_kind;
typedef enum smp_optimize { SMP_OPTIMIZE_DEFAULT = 0, SMP_OPTIMIZE_SPEED, SMP_OPTIMIZE_MEMORY } smp_optimize;
/* Where the coordinates go over the world's ranks. The letter forms are
   SageMaker's: D (reduced data parallel, rdp), P (pipeline, pp) and T
   (tensor parallel, tp), the right-most letter varying fastest over
   consecutive world ranks. cluster is DPT (a replica's ranks side by side,
   a TP group's ranks closest), spread is TPD (an RDP group's ranks side by
   side). */
typedef enum smp_placement {
    SMP_PLACEMENT_DEFAULT = 0, SMP_PLACEMENT_CLUSTER, SMP_PLACEMENT_SPREAD,
    SMP_PLACEMENT_DPT, SMP_PLACEMENT_DTP, SMP_PLACEMENT_PDT, SMP_PLACEMENT_PTD, SMP_PLACEMENT_TDP, SMP_PLACEMENT_TPD
} smp_placement;
typedef enum smp_trace_device { SMP_TRACE_DEFAULT = 0, SMP_TRACE_CPU, SMP_TRACE_GPU } smp_trace_device;

/* Zero is the default in every field (smp_config cfg = {0}): a number's 0
   means its default below; an enum's 0 member is its DEFAULT (smp_switch:
   DEFAULT, ON, OFF); the two values for which 0 means something of its own
   (partition 0, a weight of 0) count only where their has_ flag is true. */
typedef struct smp_config {
    int partitions;                 /* pipeline stages per model replica; 0: 1 */
    int pipeline_parallel_degree;   /* SageMaker's PyTorch name for partitions; 0: unset (set both: they must agree) */
    int tensor_parallel_degree;     /* ranks that share each sharded layer (TP_GROUP); 0: 1 */
    int microbatches;               /* per step; 0: 1 */
    smp_pipeline_kind pipeline;     /* default: interleaved (1F1B) */
    smp_optimize optimize;          /* auto-partition objective; default: speed */
    smp_switch auto_partition;      /* default: on */
    int default_partition;          /* used only when has_default_partition; default none */
    bool has_default_partition;
    smp_switch ddp;                 /* data parallel over partitions x replicas; default off */
    smp_placement placement_strategy; /* default: cluster (= DPT) */
    double memory_weight;           /* used only when has_memory_weight; default from optimize (speed 0, memory 1) */
    bool has_memory_weight;
    smp_trace_device trace_device;  /* default: gpu when a device backend is present, else cpu */
    /* after a warm-up run, each call is timed 3 times; default off: their median; on: their best */
    smp_switch trace_execution_times;
    smp_switch trace_memory_usage;     /* default off */
    smp_switch overlapping_allreduce;  /* default on */
    int backward_passes_per_step;      /* 0: 1 */
    smp_switch average_grads_across_microbatches; /* default on */
    double bucket_cap_mb;              /* 0: 25 */
    smp_switch broadcast_buffers;      /* default on */
    /* default off; on: every top-level call recomputes (smp_module_set_recompute) */
    smp_switch activation_checkpointing;
    int active_microbatches;        /* most microbatches in flight on a rank (smp_pipeline.h); 0: the schedule's own */
    /* each replica updates its 1/dp of the parameters (smp_param_owned_range); default off */
    smp_switch shard_optimizer_state;
    /* SageMaker's key; default on: a TP group's ranks read the same batch (sharded by rdp_rank); off: each its own
       (sharded by dp_rank), joined by smp_step (smp_group below) */
    smp_switch prescaled_batch;
    smp_switch offload_activations; /* on_device models: what a backward needs waits in host memory; default off */
    int activation_loading_horizon; /* offload_activations: tasks before the backward that it comes back; 0: 4 */
    /* smp's own keys */
    int virtual_stages;             /* interleaving factor for auto partitioning; 0: 1 */
    smp_switch deterministic_reduction; /* fixed-order DP sums; default off */
    double timeout;                 /* seconds any wait may take; 0: SMP_TIMEOUT or 600 */
    uint64_t seed;                  /* global seed of parameter initialisation */
    MPI_Comm comm;                  /* all-zero bytes: MPI_COMM_WORLD */
} smp_config;

/* Parses SageMaker-style JSON ({"partitions": 2, ...}) into *cfg, on top of
   what cfg already holds. Unknown keys and wrong types name the key. */
SMPDEF smp_status smp_config_from_json(const char *json, smp_config *cfg);

/* ---------------------------------------------------------------- context */
/* Initialises MPI if the host has not, reads SMP_CONFIG (its keys override
   cfg's), validates, and builds the groups. Collective over the communicator.
   On error every rank returns the same status. cfg may be NULL. */
SMPDEF smp_status smp_init(const smp_config *cfg);
/* Frees smp's state; finalizes MPI only if smp_init initialised it.
   Models and modules still alive are freed too (smp_model_free on each, in
   creation order: collective where that is, so every rank must hold the
   same models); pointers to them are dangling afterwards. */
SMPDEF void smp_finalize(void);
SMPDEF bool smp_is_initialized(void);
SMPDEF const smp_config *smp_current_config(void); /* resolved values */

/* Groups, as SageMaker defines them. world = pp x tp x rdp, where pp is
   partitions (pipeline_parallel_degree), tp tensor_parallel_degree and rdp
   the replicas left (rdp = world / (pp x tp)). Each rank has a coordinate
   (pp_rank, tp_rank, rdp_rank), placed by placement_strategy, and:
     PP_GROUP   same tp_rank and rdp_rank: one pipeline, pp ranks, ordered
                by pp_rank (its stages run on it);
     TP_GROUP   same pp_rank and rdp_rank: the ranks sharing each sharded
                layer of one partition, tp ranks, ordered by tp_rank;
     RDP_GROUP  same pp_rank and tp_rank: the ranks holding the same
                parameters (reduced data parallel), rdp ranks; data-parallel
                gradients are summed over it;
     MP_GROUP   same rdp_rank: one whole model replica, pp x tp ranks,
                mp_rank = pp_rank x tp + tp_rank;
     DP_GROUP   same pp_rank: every rank holding a piece of the same
                partition, tp x rdp ranks, dp_rank = rdp_rank x tp + tp_rank.
   So dp = tp x rdp and mp = pp x tp; with tp = 1, TP_GROUP is the rank
   alone, PP_GROUP is MP_GROUP (pp_rank = mp_rank) and RDP_GROUP is DP_GROUP
   (rdp_rank = dp_rank), the groups smp had before tensor parallelism.
   smp's tensor-parallel modules expect every rank of a TP group to see the
   same batch. SageMaker's prescaled_batch says who makes it so. On (the
   default), the engine: shard data by rdp_rank and rdp_size and pass every
   rank of a TP group the same batch. Off, smp: shard data by dp_rank and
   dp_size as without TP, each rank passing its own B examples; smp_step
   then gathers its split arguments over TP_GROUP along their batch axes, in
   tp-rank order, before it slices microbatches (non_split arguments stay
   each rank's own), so the step is exactly the prescaled one on the group's
   joined batch of tp x B examples: its StepOutputs hold the joined batch on
   every rank of the group, this rank's own examples at tp_rank x B. The
   cost: the layers outside the sharded ones compute the whole joined batch
   on every TP rank, as with prescaled_batch on (SageMaker's own modules
   gather only inside the distributed ones), and each step all-gathers
   every split argument over TP_GROUP. Ranks whose batch sizes, shapes or
   dtypes differ in a TP group get an error naming both.
   Pipelines run in PP_GROUP, so an activation
   crosses a stage boundary from tp rank t to tp rank t of the next stage:
   a tensor that crosses is the whole one (after a tp_reduce) or each
   rank's own slice, as the modules on both sides expect. A step that fails
   on one rank of a TP group fails on the others at their next TP module or
   collective over TP_GROUP (each starts with a handshake that carries the
   failure: smp_module_new_tp_copy below), so every rank returns the error
   and no parameter changes; none waits for the failed rank until
   SMP_TIMEOUT. */
typedef enum smp_group {
    SMP_WORLD = 0, SMP_MP_GROUP, SMP_DP_GROUP, SMP_PP_GROUP, SMP_TP_GROUP, SMP_RDP_GROUP, SMP_GROUP_COUNT
} smp_group;

SMPDEF int smp_rank(void);
SMPDEF int smp_size(void);
SMPDEF int smp_local_rank(void);
SMPDEF int smp_local_size(void);
SMPDEF int smp_mp_rank(void);
SMPDEF int smp_mp_size(void);
SMPDEF int smp_dp_rank(void);
SMPDEF int smp_dp_size(void);
SMPDEF int smp_pp_rank(void);
SMPDEF int smp_pp_size(void);
SMPDEF int smp_tp_rank(void);
SMPDEF int smp_tp_size(void);
SMPDEF int smp_rdp_rank(void);
SMPDEF int smp_rdp_size(void);
SMPDEF int smp_group_rank(smp_group g);
SMPDEF int smp_group_size(smp_group g);
SMPDEF MPI_Comm smp_group_comm(smp_group g);
/* Where a world of `size` ranks puts world rank `rank`, without MPI (before
   smp_init, or for another rank): pp partitions, tensor-parallel degree tp
   (pp x tp must divide size). smp_init places this rank so. */
typedef struct smp_coords { int pp_rank, tp_rank, rdp_rank, mp_rank, dp_rank; } smp_coords;
SMPDEF smp_coords smp_topology_of(int rank, int size, int pp, int tp, smp_placement placement);

/* ---------------------------------------------------------------- waiting */
/* Seconds any single wait may take before the job aborts (SMP_TIMEOUT). */
SMPDEF double smp_timeout(void);
/* Waits for MPI requests, polling with back-off; past the deadline logs
   `what` with the peer and aborts the job. */
SMPDEF void smp_wait_requests(int n, MPI_Request *reqs, const char *what, smp_group g, int peer);

/* ---------------------------------------------------------------- objects */
/* Byte messages, like the reference common API's send / recv_from /
   broadcast / allgather. Received buffers come from SMP_MALLOC; free them
   with smp_free. A send that fails on its arguments tells the receiver:
   the matching smp_recv_from returns SMP_ERR_REMOTE with the sender's
   error, and later messages pair as before. Messages travel on a
   communicator of smp's own, apart from smp_group_comm's. */
SMPDEF smp_status smp_send(const void *buf, size_t len, int dest, smp_group group);
SMPDEF smp_status smp_recv_from(int src, smp_group group, void **buf, size_t *len);
SMPDEF smp_status smp_broadcast_bytes(void **buf, size_t *len, int root, smp_group g);
/* Gathers one buffer from each member: *out holds them back to back, lens[i]
   (caller-sized: group size) their sizes in group-rank order. */
SMPDEF smp_status smp_all_gather_bytes(const void *buf, size_t len, smp_group g, void **out, size_t *lens);
SMPDEF smp_status smp_barrier(smp_group g);
SMPDEF void smp_free(void *p);

/* ---------------------------------------------------------------- collectives */
typedef enum smp_op { SMP_SUM = 0, SMP_AVG, SMP_MIN, SMP_MAX, SMP_PROD } smp_op;

/* In place when in->data == out->data. Host tensors move over MPI; device
   tensors over the registered device backend (smp_nccl.h). f16 and bf16 are
   reduced in f32 precision per combining step.
   A call that fails on some members only (say, one rank passes a tensor of
   the wrong size) returns the error there; a member waiting for it in that
   collective (host tensors, and the byte and barrier calls above) aborts
   the job with that error instead of waiting for SMP_TIMEOUT. */
SMPDEF smp_status smp_all_reduce(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g);
SMPDEF smp_status smp_broadcast(smp_tensor *t, int root, smp_group g);
/* out is used on root only (may be NULL elsewhere). */
SMPDEF smp_status smp_reduce(const smp_tensor *in, smp_tensor *out, smp_op op, int root, smp_group g);
/* out has group_size x in's elements; dim 0 is stacked. */
SMPDEF smp_status smp_all_gather(const smp_tensor *in, smp_tensor *out, smp_group g);
/* in has group_size x out's elements; each member keeps its reduced block. */
SMPDEF smp_status smp_reduce_scatter(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g);
/* Splits along dim 0: in_splits[i] rows go to member i, out_splits[i] rows
   come from member i. NULL splits mean equal parts. */
SMPDEF smp_status smp_all_to_all_single(const smp_tensor *in, smp_tensor *out, const int64_t *out_splits,
                                        const int64_t *in_splits, smp_group g);

/* A persistent all-reduce, as MPI 4's MPI_Allreduce_init and MPI_Start: for
   buffers the engine keeps and reduces again and again (a flat gradient
   buffer, a loss accumulator). smp_all_reduce_init binds in and out (data,
   dtype, count, device; the structs themselves need not live on) and is a
   collective: every member of g makes its handles in the same order with the
   same element count, dtype and op, and an error on one member (bad or
   mismatched arguments, no memory) is that error on every member, *p NULL.
   Each smp_persistent_run reduces what in holds then into out, as
   smp_all_reduce(in, out, op, g) would, under the same failure rules; every
   member runs a handle as often as the others. For host tensors a run skips
   smp_all_reduce's per-call work (a staging copy up to 16 KiB, MPI building
   its nonblocking schedule above): 5-10% of a call at 16-64 KiB
   (bench/RESULTS.md). Device tensors take the device backend's path each
   run. smp_persistent_free is local and takes NULL; smp_finalize releases
   the MPI side of handles still alive (a run then is SMP_ERR_STATE; free
   them as before). */
typedef struct smp_persistent smp_persistent;
SMPDEF smp_status smp_all_reduce_init(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g,
                                      smp_persistent **p);
SMPDEF smp_status smp_persistent_run(smp_persistent *p);
SMPDEF void smp_persistent_free(smp_persistent *p);

/* ---------------------------------------------------------------- modules */
/* A module is a node of the engine's model with a dotted name
   ("layers.3.fc1"), parameters and buffers that are declared, not allocated:
   storage exists only on the rank that owns the module, after partitioning.
   Its callbacks run one call on one microbatch:
     forward:  read inputs, allocate outputs with smp_call_output, save what
               backward needs with smp_call_stash (inputs stay alive anyway);
     backward: read smp_call_grad_output, write (or add into) every
               non-NULL smp_call_grad_input, and ADD parameter gradients into
               smp_param_grad(p) (microbatches arrive in increasing order).
   Which buffers arrive zeroed, so that kernels which accumulate (+=) may
   rely on it (test_port checks it whatever allocator smp uses):
     zero      every smp_call_grad_input, in every backward (tracing's too),
               unless smp_module_set_overwrites_grad_inputs says otherwise;
               smp_mb_output_grad in a step body; parameter gradients when
               the model is partitioned and after smp_model_zero_grad, and
               only then: they accumulate over microbatches and steps until
               the next smp_model_zero_grad (ddp replaces them with the
               average over replicas as a step ends). A training step
               that fails takes its sums back where the gradients were
               zero as it began; on top of earlier steps' sums it cannot,
               and the next training step fails (SMP_ERR_STATE) until
               smp_model_zero_grad or smp_model_grads_restored. A shared module's
               backward may add into a slot of smp's, zeroed every step, that
               smp sums into the gradient: add, never assign.
     not zero  smp_call_output, smp_call_stash, smp_call_stash_device, and
               the smp_call_grad_input of a module set with
               smp_module_set_overwrites_grad_inputs: write every element.
     read only the inputs, smp_call_output_value, smp_call_grad_output.
   In a model built with on_device (smp_model_desc), outputs, gradients and
   parameters are device tensors and the callbacks launch device work.

   A module is a LEAF (the callbacks above) or a COMPOSITE: a forward that
   only calls children through smp_call, under the rules of the model's
   forward, and names its outputs with smp_call_set_output; no backward of
   its own and no parameters (they belong to its children). smp records the
   nested calls when it traces the model and from then on runs the leaves:
   their backwards in reverse order, gradients summed where one value feeds
   several calls (a residual), at any depth. A transformer block:

     static smp_status block_forward(smp_call_ctx *c) {
         block *b = smp_module_user(smp_call_module(c));
         smp_tensor x = *smp_call_input(c, 0), h, a, r[2], m;
         SMP_TRY(smp_call(b->ln1, &x, 1, &h, 1));
         SMP_TRY(smp_call(b->attn, &h, 1, &a, 1));
         smp_tensor res1[2] = {x, a};
         SMP_TRY(smp_call(b->add1, res1, 2, &r[0], 1));    // smp_module_new_add
         SMP_TRY(smp_call(b->ln2, &r[0], 1, &h, 1));
         SMP_TRY(smp_call(b->mlp, &h, 1, &m, 1));          // itself a composite
         smp_tensor res2[2] = {r[0], m};
         SMP_TRY(smp_call(b->add2, res2, 2, &r[1], 1));
         return smp_call_set_output(c, 0, &r[1]);
     }

   Inside a model or composite forward: no arithmetic on tensors (put it in
   a leaf module; an input that no smp_call produced is an error), no edits
   of what smp_call returned (tracing checksums every output and names the
   call whose output changed), the same calls for any input. A module
   called at several positions is SHARED (tied embeddings): every partition
   that calls it holds a copy, and its gradient is the sum over its calls,
   each call's microbatches in order, then the calls in call order, in
   every partitioning and in one process. Manual placement puts a call
   where its module's SMP_PARTITION context says, else where its composite
   caller's does, else on default_partition: to split a tied embedding,
   create it outside every context and call it from composites created in
   the first and last partitions' contexts (an "embed" and a "head").
   What sharing costs: every partition that calls a shared module holds all
   of its parameters, their gradients and their optimizer state, and their
   gradients are summed across the holders each step, whatever each call
   reads. So share only what every call uses: an embedding module holding
   wte and wpe, called again as the output projection that reads only wte,
   puts wpe on the last partition too; make wte a module of its own, shared
   (called by the embedding composite and by the head), and wpe a module
   only the embedding calls. */
typedef struct smp_module smp_module;
typedef struct smp_param smp_param;
typedef struct smp_model smp_model;
typedef struct smp_call_ctx smp_call_ctx; /* one call of a module on one microbatch */

typedef smp_status (*smp_module_fn)(smp_call_ctx *c);
/* Fills a parameter deterministically; `seed` is derived from the global
   seed and the parameter's full name, so every partitioning sees the same.
   It runs on the host, into a host tensor (an on_device model's parameter
   starts as a copy of it), and more than once: while smp traces the model
   (on every rank, for each module as its call runs: its parameters exist
   for that call only) and when the model is partitioned (on the rank that
   owns the module), so it must fill the same values each time, and what
   `user` points to must live until the model is partitioned (after
   smp_model_trace or the first step). */
typedef void (*smp_init_fn)(smp_tensor *value, uint64_t seed, void *user);

typedef struct smp_module_desc {
    smp_module_fn forward;
    smp_module_fn backward; /* NULL: the module has nothing to learn and passes no gradient; NULL for a composite */
    void *user;             /* the engine's per-module state, smp_module_user() */
} smp_module_desc;

/* parent NULL makes a root. With auto_partition off, a module created
   inside SMP_PARTITION(k) { ... } goes to partition k (innermost context
   wins); auto_partition (the default) ignores contexts (smp_partition_push). */
SMPDEF smp_module *smp_module_new(smp_module *parent, const char *name, const smp_module_desc *desc);
SMPDEF smp_param *smp_param_new(smp_module *m, const char *name, smp_dtype dt, int ndim, const int64_t *shape,
                                smp_init_fn init, void *init_user);
SMPDEF smp_param *smp_buffer_new(smp_module *m, const char *name, smp_dtype dt, int ndim, const int64_t *shape,
                                 smp_init_fn init, void *init_user);
/* A parameter split along shard_axis over the ranks of TP_GROUP (tensor
   parallelism): `shape` is the FULL shape, and each TP rank holds the slice
   [offset, offset + shape[shard_axis] / tp) of that axis, offset being
   tp_rank x shape[shard_axis] / tp; tensor_parallel_degree must divide
   shape[shard_axis] (smp_model_new says so otherwise). The init callback
   fills the full tensor (a host copy of it, for a moment, on every TP rank)
   and each rank keeps its slice, so any tp degree, 1 included, starts from
   the same values. From smp_model_new on, smp_param_value and
   smp_param_grad are the local slice. Megatron's column-parallel linear
   (y = x W^T, W [out, in]) shards W and its bias along axis 0, the row-
   parallel one W along axis 1 and keeps its bias whole.
   smp_param_new_sharded_blocks shards a tensor that is `blocks` tensors
   joined along the shard axis (Megatron's fused QKV: W [3C, C] is q, k and
   v, each [C, C]): the axis is `blocks` equal blocks, each split over the
   TP group, and a rank holds its slice of every block, in block order (its
   heads of q, then of k, then of v). tp x blocks must divide the axis; the
   offset is then where the slice starts within each block. Initialisation,
   full checkpoints (the full tensor, as at tp 1) and resharding to any tp
   honour the blocks; blocks 1 is smp_param_new_sharded.
   Parameters declared with smp_param_new stay whole on every TP rank: their
   gradients are the same on every TP rank when the model feeds them the
   same values there (what the TP modules below arrange: a layer norm after
   a tp_reduce, the bias of a row-parallel linear added after it), and smp
   does not sum them across the TP group. */
SMPDEF smp_param *smp_param_new_sharded(smp_module *m, const char *name, smp_dtype dt, int ndim, const int64_t *shape,
                                        int shard_axis, smp_init_fn init, void *init_user);
SMPDEF smp_param *smp_param_new_sharded_blocks(smp_module *m, const char *name, smp_dtype dt, int ndim,
                                               const int64_t *shape, int shard_axis, int blocks, smp_init_fn init,
                                               void *init_user);
SMPDEF int smp_param_shard_axis(const smp_param *p);       /* -1: whole on every TP rank */
SMPDEF int smp_param_shard_blocks(const smp_param *p);     /* 1 unless declared with smp_param_new_sharded_blocks */
/* where this rank's slice starts along the axis (within each block; 0 if whole) */
SMPDEF int64_t smp_param_shard_offset(const smp_param *p);
SMPDEF int smp_param_full_shape(const smp_param *p, int64_t shape[SMP_MAX_DIMS]); /* the declared shape; returns ndim */
SMPDEF const char *smp_module_name(const smp_module *m); /* full dotted name */
SMPDEF void *smp_module_user(const smp_module *m);
SMPDEF int smp_module_partition(const smp_module *m);   /* -1 before partitioning */
SMPDEF bool smp_module_is_local(const smp_module *m);
SMPDEF const char *smp_param_name(const smp_param *p);   /* full dotted name */
SMPDEF smp_tensor *smp_param_value(smp_param *p);        /* data NULL where not local */
SMPDEF smp_tensor *smp_param_grad(smp_param *p);         /* NULL for buffers */
SMPDEF bool smp_param_is_buffer(const smp_param *p);
SMPDEF smp_module *smp_param_module(const smp_param *p);

/* Built-in leaf modules every engine otherwise writes by hand, for host
   and device tensors of any floating-point dtype:
     add       y = x0 + x1 + ... + x(n-1), elementwise, left to right (n >= 1
               inputs of one dtype and element count; y has x0's shape): the
               residual connection; every input gets the output gradient;
     identity  y = a copy of x0 (a composite that must return its input). */
SMPDEF smp_module *smp_module_new_add(smp_module *parent, const char *name);
SMPDEF smp_module *smp_module_new_identity(smp_module *parent, const char *name);
/* Tensor parallelism's communication, as built-in leaf modules over
   TP_GROUP (one input, one output; host tensors over MPI, device tensors
   over the device backend's collectives), each with its backward:
     tp_copy     forward y = x; backward: the input gradient is the sum of
                 the TP ranks' output gradients. Enters a tensor-parallel
                 region (before a column-parallel linear);
     tp_reduce   forward y = the sum of the TP ranks' x; backward passes
                 the output gradient. Leaves it (after a row-parallel linear);
     tp_gather   forward y = the TP ranks' x joined along `axis` in tp-rank
                 order (y's axis tp times x's); backward: the sum of the
                 ranks' output gradients, each rank keeping its own slice
                 (a reduce-scatter): right where what follows computes a
                 different part on each rank, as in sequence parallelism;
     tp_scatter  its dual: forward y = this rank's slice along `axis` of the
                 sum of the ranks' x (a reduce-scatter; tp must divide that
                 axis); backward joins the ranks' output gradients (an
                 all-gather).
   Megatron's MLP is tp_copy, a column-parallel linear (its weight and bias
   sharded along axis 0), the activation, a row-parallel linear without its
   bias (weight sharded along axis 1), tp_reduce, then the bias (whole).
   Every call starts with a handshake over TP_GROUP: each rank sends every
   other its status and the dtype and shape it passes, point to point (a
   few hundred bytes), before any data moves. Every rank of the TP group
   must pass the same dtype and shape (a mismatch is an error on each of
   them); a rank whose step failed before the call (a module, an
   allocation, a pipeline peer's failure) has sent its error instead, and
   every rank fails the call with it; the call's output and scratch are
   taken before the handshake, so running out of memory is an error on
   every rank too. A collective the engine calls over SMP_TP_GROUP in a
   step (a step body's sums) starts with the same handshake. With
   deterministic_reduction every sum is taken in tp-rank order, from an
   all-gather, so every rank holds the same bits; otherwise MPI's (NCCL's)
   all-reduce sums. With tensor_parallel_degree 1 each is a copy. */
SMPDEF smp_module *smp_module_new_tp_copy(smp_module *parent, const char *name);
SMPDEF smp_module *smp_module_new_tp_reduce(smp_module *parent, const char *name);
SMPDEF smp_module *smp_module_new_tp_gather(smp_module *parent, const char *name, int axis);
SMPDEF smp_module *smp_module_new_tp_scatter(smp_module *parent, const char *name, int axis);
/* Wall-clock seconds this process has spent inside the TP modules' calls
   (their collectives, waits for the group included) since it started: what
   a benchmark divides by the step time. */
SMPDEF double smp_tp_seconds(void);
/* Activation recomputation (SageMaker's smp.set_activation_checkpointing):
   after a call of m, only the call's inputs are kept; the outputs of the
   calls nested inside it (its own outputs, which later calls read, stay)
   and their stashes are freed, and its forward runs again just before its
   backward. Calls must then be deterministic given smp_call_seed. The
   config key activation_checkpointing does this for every top-level call. */
SMPDEF void smp_module_set_recompute(smp_module *m, bool on);
/* Splits a leaf's backward for zero-bubble schedules (pipeline
   "zero_bubble"), in place of desc.backward, which must be NULL:
   backward_input writes the input gradients (the B op, on the critical
   path); backward_weight later ADDS the parameter gradients (the W op,
   which fills pipeline bubbles). W may read what B may (inputs, outputs,
   stash, smp_call_grad_output: smp keeps them until W has run) and writes
   no input gradient. Other schedules run the two back to back; a module
   with only backward runs it whole as B and has no W. */
SMPDEF void smp_module_set_backward_split(smp_module *m, smp_module_fn backward_input, smp_module_fn backward_weight);
/* Says that m's backward (its input half, when split) writes every element
   of each smp_call_grad_input it is given (dx = dy W, not dx += dy W), so
   smp hands them out unzeroed: one pass less over each, per call and
   microbatch. Off by default (they arrive zeroed); the built-in add and
   identity have it on. */
SMPDEF void smp_module_set_overwrites_grad_inputs(smp_module *m, bool on);

/* Built-in initialisers (f32): uniform in [-bound, bound] (user points to a
   float bound; NULL: 1/sqrt(fan_in) with fan_in the last dimension), and
   constant (user points to a float; NULL: 0). */
SMPDEF void smp_init_uniform(smp_tensor *value, uint64_t seed, void *user);
SMPDEF void smp_init_constant(smp_tensor *value, uint64_t seed, void *user);
/* Loads existing weights: copies the parameter's elements (any dtype, the
   parameter's) from the engine's own buffer, starting `offset` elements into
   `data`; user points to an smp_init_copy_desc, which (with the buffer) must
   live until the model is partitioned (smp_init_fn). For an engine that keeps
   all its weights in one contiguous buffer:
       static smp_init_copy_desc wte_src = {weights, 0};   // wte: elements 0..V*C-1
       smp_param_new(m, "wte", SMP_F32, 2, (int64_t[]){V, C}, smp_init_copy, &wte_src);
   A NULL user or data is an error smp_model_new reports. */
typedef struct smp_init_copy_desc {
    const void *data; /* host memory holding elements of the parameter's dtype */
    int64_t offset;   /* in elements, where the parameter's first one is */
} smp_init_copy_desc;
SMPDEF void smp_init_copy(smp_tensor *value, uint64_t seed, void *user);
/* The seed smp gives the parameter called full_name. */
SMPDEF uint64_t smp_param_seed(const char *full_name);
/* A deterministic generator for init callbacks: uniform in [0, 1). */
SMPDEF double smp_rng_uniform(uint64_t *state);

/* ---------------------------------------------------------------- partition contexts */
/* Modules created between push and pop go to `partition`, when
   auto_partition is off. With auto_partition on (the default) the
   partitioner places every module itself and contexts are ignored, as
   SageMaker's smp.partition is; smp warns once per model on rank 0, naming
   a module created in a context, so the placement is not silently lost. */
SMPDEF void smp_partition_push(int partition);
SMPDEF void smp_partition_pop(void);
/* SMP_PARTITION(1) { child = smp_module_new(root, "child", &d); }
   Leave the block at its end: a break, return or goto out of it skips the
   pop, and smp_model_new then fails naming the file and line of the
   context left open. */
#define SMP_PARTITION(k) \
    for (int smp__pctx_once = (smp__partition_push_at((k), __FILE__, __LINE__), 1); smp__pctx_once; \
         smp__pctx_once = (smp_partition_pop(), 0))
/* smp_partition_push that remembers where the context was opened (for SMP_PARTITION). */
SMPDEF void smp__partition_push_at(int partition, const char *file, int line);

/* ---------------------------------------------------------------- the model */
/* The engine's forward: calls modules through smp_call and sets outputs[i]
   to tensors that smp_call returned. It runs once, when smp traces the model;
   afterwards smp replays the recorded calls, so the function must call the
   same modules in the same order for any input (no data-dependent branches). */
typedef smp_status (*smp_model_forward_fn)(smp_model *m, const smp_tensor *inputs, int ninputs, smp_tensor *outputs,
                                           int noutputs, void *user);
typedef void (*smp_post_partition_fn)(smp_model *m, void *user);

/* on_device puts the model on the device of the registered backend
   (smp_nccl.h: this rank's GPU); smp_model_new fails, naming the problem,
   when there is no backend or it has no usable device. Then these are
   device tensors (device SMP_CUDA(n), memory from the backend's alloc):
     parameter values and gradients (init callbacks still fill a host
       tensor; smp copies it to the device),
     smp_call_output, smp_call_grad_input and smp_call_grad_output,
     activations and gradients received from other partitions,
     smp_mb_output and smp_mb_output_grad in a step body.
   What stays in host memory: smp_call_stash (the engine's own bytes;
   smp_call_stash_device keeps device data until the backward), step
   arguments given on the host (a step takes host or device arguments and
   slices either), and StepOutputs (smp_mb_return copies a device value to
   the host). Module inputs that are model inputs are the step arguments'
   slices, so they are where the arguments are. */
typedef struct smp_model_desc {
    smp_model_forward_fn forward;
    int ninputs;   /* tensors the forward takes (step arguments that feed the model); 0: 1 */
    int noutputs;  /* tensors it returns; 0: 1 */
    void *user;
    bool on_device; /* false: host memory */
} smp_model_desc;

/* Wraps the module tree (smp.DistributedModel). Reports errors made while
   building it (bad partition contexts, duplicate names). */
SMPDEF smp_status smp_model_new(smp_module *root, const smp_model_desc *desc, smp_model **out);
SMPDEF void smp_model_free(smp_model *m); /* collective when SMP_TIMELINE is set (writes the timeline) */
/* Runs module m on inputs; outputs receive tensors owned by smp. From the
   model's forward or a composite's forward, while smp traces the model:
   afterwards smp replays the recorded leaf calls. */
SMPDEF smp_status smp_call(smp_module *m, const smp_tensor *inputs, int ninputs, smp_tensor *outputs, int noutputs);
/* Traces the model on one sample microbatch (the first step does it if not
   done) and partitions it. Collective over the world. */
SMPDEF smp_status smp_model_trace(smp_model *m, const smp_tensor *sample_inputs, int ninputs);
SMPDEF bool smp_is_tracing(void);
SMPDEF bool smp_model_is_partitioned(const smp_model *m);
SMPDEF void smp_model_on_partitioned(smp_model *m, smp_post_partition_fn fn, void *user);
SMPDEF void smp_model_zero_grad(smp_model *m);
/* After a training step failed on top of earlier steps' gradients (which
   smp cannot put back), the engine that saved them and put them back
   says so here, and the next step may add to them; or it calls
   smp_model_zero_grad. */
SMPDEF void smp_model_grads_restored(smp_model *m);
/* Local parameters (and buffers) in declaration order; iterate with
   for (i = 0; (p = smp_model_local_param(m, i, false)); i++). */
SMPDEF smp_param *smp_model_local_param(smp_model *m, int index, bool include_buffers);
SMPDEF smp_param *smp_model_find_param(smp_model *m, const char *full_name); /* any rank's */
/* SHARDED OPTIMIZER STATE (shard_optimizer_state, ZeRO stage 1). Each
   data-parallel gradient bucket (smp_pipeline.h: the local gradients in
   backward order, bucket_cap_mb each) is padded to a multiple of the
   replicas (rdp_size) and cut into that many equal pieces; rdp rank j owns
   the j-th piece of every bucket, so each replica owns 1/rdp of its
   partition's elements, give or take the padding (under rdp elements per
   bucket). The engine's optimizer keeps state for, and updates, only what
   this rank owns: elements [*first, *first + *count) of p (count may be
   0; one range, as a parameter lies in one bucket), as
   smp_param_owned_range says (without sharding: all of p). Each bucket is
   reduce-scattered instead of all-reduced, in the backward as before:
   after the step a replica's gradients hold the average over the replicas
   in its owned ranges and zeros elsewhere. smp_clip_grad_norm and the
   grad scaler read the owned ranges (each element once across the
   replicas). Before parameters are next read (the next step, overlapped
   with its forward bucket by bucket (smp_pipeline.h), smp_save, or
   smp_model_gather_params) smp gathers every replica's updated range, so
   all replicas hold the same values; with deterministic_reduction a
   sharded run is bitwise the unsharded one. Optimizer state registered
   with smp_optimizer_state_add must cover the owned range only. On a
   device model the buckets go through the device backend's reduce-scatter
   (NCCL's), and parameters must hold their gradients' dtype. p must be
   local; after partitioning. */
SMPDEF smp_status smp_param_owned_range(smp_model *m, const smp_param *p, int64_t *first, int64_t *count);
/* Gathers the ranges the replicas updated (nothing to do without sharding
   or when nothing changed since the last gather). Collective over the world. */
SMPDEF smp_status smp_model_gather_params(smp_model *m);
SMPDEF int smp_model_num_global_params(const smp_model *m, bool include_buffers);   /* all ranks' */
/* Every rank's parameters (and buffers), local or not, in declaration
   order: index < smp_model_num_global_params(m, include_buffers). */
SMPDEF smp_param *smp_model_global_param(smp_model *m, int index, bool include_buffers);
SMPDEF int smp_model_num_stages(const smp_model *m);
SMPDEF int smp_model_stage_rank(const smp_model *m, int stage);            /* mp rank running a stage */

/* ---------------------------------------------------------------- inside module callbacks */
SMPDEF int smp_call_num_inputs(const smp_call_ctx *c);
SMPDEF int smp_call_num_outputs(const smp_call_ctx *c);
SMPDEF const smp_tensor *smp_call_input(const smp_call_ctx *c, int i);
SMPDEF smp_tensor *smp_call_output(smp_call_ctx *c, int i, smp_dtype dt, int ndim, const int64_t *shape); /* forward */
SMPDEF const smp_tensor *smp_call_output_value(const smp_call_ctx *c, int i);  /* backward: what forward produced */
SMPDEF const smp_tensor *smp_call_grad_output(const smp_call_ctx *c, int i);  /* backward */
SMPDEF smp_tensor *smp_call_grad_input(smp_call_ctx *c, int i);               /* backward; NULL: no gradient wanted */
SMPDEF void *smp_call_stash(smp_call_ctx *c, size_t bytes);                   /* forward: memory kept until backward */
SMPDEF void *smp_call_stashed(const smp_call_ctx *c, size_t *bytes);          /* backward */
/* The same on the model's device (host memory for a host model): what a
   device kernel saves for the backward, such as a dropout mask. NULL when
   the device is out of memory. */
SMPDEF void *smp_call_stash_device(smp_call_ctx *c, size_t bytes);
SMPDEF void *smp_call_stashed_device(const smp_call_ctx *c, size_t *bytes);
SMPDEF smp_module *smp_call_module(const smp_call_ctx *c);
SMPDEF int smp_call_microbatch(const smp_call_ctx *c);
SMPDEF bool smp_call_is_training(const smp_call_ctx *c); /* false in evaluation steps: no backward will follow */
/* A seed for this call's randomness (dropout): the same for a call and a
   sample position in every partitioning, in a recomputation and in one
   process; different for every call, microbatch, data-parallel replica and
   training step. */
SMPDEF uint64_t smp_call_seed(const smp_call_ctx *c);
/* In a composite's forward: output i of this call is t, a tensor that a
   nested smp_call returned (or one of this call's inputs). */
SMPDEF smp_status smp_call_set_output(smp_call_ctx *c, int i, const smp_tensor *t);

/* ---------------------------------------------------------------- auto-partitioner
   Splits the traced top-level calls, in execution order, into `nstages`
   contiguous, non-empty stages so that the costliest stage is as cheap as it
   can be. The answer is the exact optimum, not a greedy guess:

   - A stage's cost is the sum of its calls' costs added left to right in
     double precision. No split into nstages stages has a smaller largest
     stage under that definition, and the reported maximum is the cost of one
     real stage of the returned split, bit for bit.
   - Ties: of all optimal splits, the one whose boundary vector is
     lexicographically smallest, i.e. each stage ends as early as it can
     given the stages before it, so the first stages are the lightest. Under
     1F1B stage s keeps (stages - s) microbatches in flight, so the early
     stages stash the most activations; lightening them costs no step time.
   - Costs must be finite and non-negative; nstages must lie in 1..n.
   - Work: a binary search over the doubles (at most 64 greedy passes of
     O(n)) finds the optimum; the tie-break costs O(nstages * n * log n).

   Virtual stages: to interleave, pass nstages = partitions * virtual_stages
   and give chunk c to mp rank c % partitions; the algorithm only ever
   splits into contiguous chunks. A model's auto partitioning with several
   stages per partition (virtual_stages, zero_bubble_v) then moves those
   cuts to balance the partitions' sums as well: of all contiguous splits,
   the least microbatches x the costliest partition + (partitions - 1) x
   the costliest stage (a step's steady state and ramp). */

/* What tracing measured for one top-level call. */
typedef struct smp_call_cost {
    double time;             /* seconds (forward + backward, as traced) */
    double param_bytes;      /* bytes of the call's parameters */
    double activation_bytes; /* bytes the call keeps for its backward, per microbatch */
} smp_call_cost;

/* Splits calls[0..n) into nstages stages on a combined cost per call:
       memory   = param_bytes * (2 + optimizer_state_factor) + activation_bytes
                  (parameters, their gradients, optimizer state, activations)
       combined = (1 - w) * time / total_time + w * memory / total_memory
   with w = memory_weight in [0, 1] (0: speed, 1: memory); a total of 0
   contributes 0. optimizer_state_factor counts optimizer state in units of
   the parameters' bytes (2 for Adam on f32 parameters; 6 for mixed-precision
   Adam with f16 parameters: f32 master copy + two moments).
   On success stage_of_call[i] (n entries) holds the stage of call i,
   non-decreasing from 0 to nstages - 1, and *max_stage_cost (when not NULL)
   the combined cost of the costliest stage, a fraction of the whole model.
   On error (SMP_ERR_ARG, SMP_ERR_NOMEM) the outputs are left untouched. */
SMPDEF smp_status smp_auto_partition(const smp_call_cost *calls, int n, int nstages, double memory_weight,
                                     double optimizer_state_factor, int *stage_of_call, double *max_stage_cost);

/* ---------------------------------------------------------------- memory stats */
/* The memory account of this rank, per category, current and peak. Device
   memory of on_device models counts with host memory. Every category but
   OPTIMIZER is memory smp allocated; OPTIMIZER is the engine's state as
   registered through smp (smp_optimizer_state_add, smp_checkpoint.h),
   counted while registered, and is not part of current_bytes. */
typedef enum smp_memory_kind {
    SMP_MEMORY_OTHER = 0,     /* smp's tables, step outputs, schedules, ... */
    SMP_MEMORY_PARAMETERS,    /* parameter and buffer values */
    SMP_MEMORY_GRADIENTS,     /* parameter gradients (data-parallel buckets hold them) */
    SMP_MEMORY_OPTIMIZER,     /* optimizer state registered through smp */
    SMP_MEMORY_ACTIVATIONS,   /* what calls keep for their backward, received activations and gradients */
    SMP_MEMORY_COMMUNICATION, /* staging and gather buffers of messages and collectives */
    SMP_MEMORY_OFFLOADED,     /* host copies of device activations (offload_activations) */
    SMP_MEMORY_CACHED,        /* the models' caches beyond what is in use: free blocks, rounding (STEP MEMORY) */
    SMP_MEMORY_KINDS
} smp_memory_kind;
typedef struct smp_memory_stats {
    int64_t current_bytes, peak_bytes;     /* everything allocated through smp */
    int64_t param_bytes, param_peak_bytes; /* parameters + gradients */
    int64_t stash_bytes, stash_peak_bytes; /* activation stash (= ACTIVATIONS) */
    int64_t bytes[SMP_MEMORY_KINDS];       /* per category, now */
    int64_t peak[SMP_MEMORY_KINDS];        /* per category, at its peak since smp_init or smp_memory_reset_peaks */
} smp_memory_stats;
SMPDEF smp_memory_stats smp_memory(void);
/* Sets every peak to the current figure: reset before a step, read after it,
   and the peaks are that step's. */
SMPDEF void smp_memory_reset_peaks(void);
/* The category's name ("parameters", "gradients", "optimizer", "activations",
   "communication", "offloaded", "cached", "other"). */
SMPDEF const char *smp_memory_kind_name(smp_memory_kind k);
/* One line of the account into buf (cap bytes; snprintf's return): each
   category then the total, in MiB, the current figures or (peak) the peaks:
   "parameters 1.500 MiB, gradients 1.500 MiB, ..., total 4.250 MiB". */
SMPDEF int smp_memory_format(const smp_memory_stats *s, bool peak, char *buf, size_t cap);
/* Gathers every rank's account: all (NULL or smp_size() entries) gets them in
   world-rank order on every rank, and rank 0 logs each rank's peaks (INFO)
   headed by `title`. Collective over the world. */
SMPDEF smp_status smp_memory_report(const char *title, smp_memory_stats *all);

/* ---------------------------------------------------------------- device backend */
/* Registered by smp_nccl.h; collectives on tensors whose device is not SMP_HOST go here. Every
   device argument below is a tensor's device (SMP_HOST or SMP_CUDA(ordinal)). */
typedef struct smp_device_backend {
    const char *name;
    smp_status (*all_reduce)(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g);
    smp_status (*broadcast)(smp_tensor *t, int root, smp_group g);
    smp_status (*reduce)(const smp_tensor *in, smp_tensor *out, smp_op op, int root, smp_group g);
    smp_status (*all_gather)(const smp_tensor *in, smp_tensor *out, smp_group g);
    smp_status (*reduce_scatter)(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g);
    smp_status (*all_to_all_single)(const smp_tensor *in, smp_tensor *out, const int64_t *out_splits,
                                    const int64_t *in_splits, smp_group g);
    smp_status (*copy)(void *dst, int dst_device, const void *src, int src_device, size_t n);
    smp_status (*on_init)(void);
    void (*on_finalize)(void);
    /* For the pipeline executor (NULL when the backend has none). Point to
       point between members of a group: connect once per peer (both ranks
       call it); the k-th isend from A to B fills the k-th irecv on B from A;
       requests are the backend's, finished by wait exactly once. */
    smp_status (*p2p_connect)(smp_group g, const int *peers, int npeers);
    smp_status (*isend)(const void *buf, size_t bytes, int peer, smp_group g, void **req);
    smp_status (*irecv)(void *buf, size_t bytes, int peer, smp_group g, void **req);
    smp_status (*test)(void *req, bool *done);
    smp_status (*wait)(void *req);
    /* Device memory ordered on the engine's stream; dst += src elementwise. */
    void *(*alloc)(size_t bytes);
    void (*dealloc)(void *p);
    smp_status (*add)(void *dst, const void *src, smp_dtype dt, int64_t n);
    /* Waits for all device work the backend queued, with the deadline. */
    smp_status (*synchronize)(void);
    /* For on_device models. The device alloc's memory lives on, SMP_CUDA(ordinal)
       (SMP_HOST: no usable device on this rank); data *= by for f32, f64, f16 and bf16
       (halves through f32, as smp does on the host; other dtypes are left
       alone); zero bytes at p. Ordered on the engine's stream like add. */
    int (*current_device)(void);
    smp_status (*scale)(void *data, smp_dtype dt, int64_t n, double by);
    smp_status (*zero)(void *p, size_t bytes);
    /* true when point to point moves through host memory anyway (NULL:
       false); the executor then stages device payloads over its own MPI
       path instead, as it does when the p2p entries are NULL. */
    bool (*p2p_through_host)(void);
    /* Data-parallel gradient buckets (NULL: all_reduce, SMP_SUM). Sums n
       elements at data over g in place as all_reduce does, but leaves the
       engine's stream free to run on meanwhile, so the backward keeps
       computing while buckets reduce; bucket_fence, called once the step
       has started every bucket, orders the engine's stream after them all.
       A backend sets both or neither. */
    smp_status (*bucket_all_reduce)(void *data, smp_dtype dt, int64_t n, smp_group g);
    smp_status (*bucket_fence)(void);
    /* Activation offloading (offload_activations; NULL: the backend has none; a backend sets all five or none).
       offload queues a copy of n device bytes at src into pinned host memory on a side stream, after the
       engine's work queued so far, and hands back the copy's handle; offload_done: that copy has finished (src
       may be freed). reload queues the copy back into n device bytes at dst on the side stream, after the
       engine's work so far (dst may be newly allocated). offload_wait orders the engine stream after the last
       copy queued for the handle, on the device: the host never waits. offload_drop does the same and lets go
       of the handle (after its reload, or when it never comes back). */
    smp_status (*offload)(const void *src, size_t n, void **copy);
    smp_status (*offload_done)(void *copy, bool *done);
    smp_status (*reload)(void *copy, void *dst);
    smp_status (*offload_wait)(void *copy);
    smp_status (*offload_drop)(void *copy);
    /* shard_optimizer_state's parameter all-gather (NULL: all_gather, and no overlap; a backend sets all three or
       none). gather_start queues the all-gather of n elements at data over g in place (this rank's block, n / size
       elements at rank * n / size, holds its part) after the engine's work so far, leaving the engine's stream free,
       and hands back its handle; gather_copy queues a copy of bytes from src (inside data) to dst on the engine's
       stream, after that all-gather, the host not waiting; gather_end orders the engine's stream after it too and
       lets go of the handle (data may then be freed on the engine's stream). */
    smp_status (*gather_start)(void *data, smp_dtype dt, int64_t n, smp_group g, void **h);
    smp_status (*gather_copy)(void *h, void *dst, const void *src, size_t bytes);
    smp_status (*gather_end)(void *h);
} smp_device_backend;
#define SMP_DEVICE_BACKEND_P2P 1 /* the fields above exist (smp_nccl.h fills them) */
SMPDEF void smp_register_device_backend(const smp_device_backend *b);

#ifdef __cplusplus
}
#endif
#endif /* SMP_H */

/* ======================================================================
   IMPLEMENTATION
   ====================================================================== */
#ifdef SMP_IMPLEMENTATION
#ifndef SMP_H_IMPLEMENTED
#define SMP_H_IMPLEMENTED

#if defined(__GNUC__)
#define SMP__NORETURN __attribute__((noreturn))
#define SMP__CORE static __attribute__((unused)) /* core helpers some programs' headers do not call */
#else
#define SMP__NORETURN
#define SMP__CORE static
#endif
/* Test hooks and the introspection only tests use: not part of the API (and
   not counted in it), declared for the test builds, which define SMP_TESTING,
   and static in every build, so that no program links against them. The
   other headers' test hooks follow the same rule. */
#ifdef SMP_TESTING
/* Fault injection for tests (see TESTING above): after `skip` more events of
   the kind on this rank, the next one fails (skip < 0: never). Each kind
   fails once per call; smp_testing_events counts the kind's events so far. */
typedef enum smp_testing_fault {
    SMP_FAULT_ALLOC,   /* an allocation through smp returns NULL */
    SMP_FAULT_SEND,    /* a pipeline send reports an MPI failure */
    SMP_FAULT_MESSAGE, /* a pipeline message arrives with a corrupt header */
    SMP_FAULT_MPI,     /* a checked MPI call is skipped and reports MPI_ERR_OTHER (see MPI ERRORS) */
    SMP_FAULT_STEP_END, /* a pipeline step fails on this rank after its last message, as the ranks agree on it */
    SMP_FAULT_SYSTEM_ALLOC, /* the system's allocator (SMP_MALLOC, the backend's device alloc) returns NULL; its events
                               count every system allocation smp makes */
    SMP_FAULT_COUNT
} smp_testing_fault;
SMP__CORE void smp_testing_fail(smp_testing_fault kind, long skip);
SMP__CORE long smp_testing_events(smp_testing_fault kind);
SMP__CORE bool smp_tensor_same_shape(const smp_tensor *a, const smp_tensor *b);
/* f16 / bf16 <-> f32, round to nearest even. */
SMP__CORE float smp_f16_to_f32(uint16_t h);
SMP__CORE uint16_t smp_f32_to_f16(float f);
SMP__CORE float smp_bf16_to_f32(uint16_t h);
SMP__CORE uint16_t smp_f32_to_bf16(float f);
/* Fills defaults and checks values against a world of `world_size` ranks. */
SMP__CORE smp_status smp_config_resolve(const smp_config *in, int world_size, smp_config *out);
/* World ranks of this rank's group, in group-rank order; returns the count. */
SMP__CORE int smp_group_ranks(smp_group g, int *world_ranks, int cap);
/* World rank of member `group_rank` of this rank's group g. */
SMP__CORE int smp_group_world_rank(smp_group g, int group_rank);
/* leaf calls (composites count their leaves) */
SMP__CORE int smp_model_num_calls(const smp_model *m);
SMP__CORE int smp_model_call_stage(const smp_model *m, int call);
/* The core on plain costs: the same contract, cost[i] >= 0 being call i's. */
SMP__CORE smp_status smp_partition_min_max(const double *cost, int n, int nstages, int *stage_of_call,
                                        double *max_stage_cost);
#endif

#include <errno.h>
#include <limits.h>
#include <locale.h>
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if !defined(_POSIX_C_SOURCE) && !defined(__cplusplus)
#include <threads.h>
#endif

#ifndef SMP_MALLOC
#define SMP_MALLOC(n) malloc(n)
#define SMP_FREE(p) free(p)
#endif
#ifndef SMP_ASSERT
#define SMP_ASSERT(c) do { if (!(c)) smp__fatal("internal error: %s (%s:%d)", #c, __FILE__, __LINE__); } while (0)
#endif

/* Small all-reduces run on persistent requests: MPICH starts a persistent
   collective about as fast as a blocking call, while each MPI_Iallreduce
   pays to build its schedule (up to 15% at 4 KiB). A request binds its
   buffer, so it reduces in place in a staging copy (in place saves MPI's own
   send-to-receive copy, which is what makes 16 KiB pay); it is keyed by what
   MPI already requires to match on every rank (count, type, op), so every
   rank hits and misses the same slots in the same order. */
#define SMP__PERSIST_SLOTS 8
#define SMP__PERSIST_MAX_BYTES ((size_t)16 << 10) /* above it the staging copies cost more than the request saves */
typedef struct smp__persist {
    MPI_Request req;
    /* staging == NULL: an empty slot */
    MPI_Datatype type;
    MPI_Op op;
    int count;
    char *staging;
    unsigned long long last_use;
} smp__persist;

typedef struct smp__group_info {
    MPI_Comm comm;
    MPI_Comm objects, notices; /* private: object messages; failed-collective notices */
    int rank, size;
    int *world_ranks; /* group rank -> world rank */
    smp__persist persist[SMP__PERSIST_SLOTS];
    unsigned long long persist_clock;
    /* public collectives called on the group, the one running included; a
       member that fails one tells the others which (smp__coll_exit) */
    unsigned long long coll_seq;
    bool in_coll;
    unsigned long long failed_ahead; /* a member failed this one before this rank got there (0: none) */
    int failed_ahead_rank;
    char *failed_ahead_msg;
} smp__group_info;

/* what a block is, for the memory account: its category */
typedef enum smp__alloc_kind {
    SMP__ALLOC_OTHER = SMP_MEMORY_OTHER,
    SMP__ALLOC_PARAM = SMP_MEMORY_PARAMETERS,
    SMP__ALLOC_GRAD = SMP_MEMORY_GRADIENTS,
    SMP__ALLOC_STASH = SMP_MEMORY_ACTIVATIONS,
    SMP__ALLOC_COMM = SMP_MEMORY_COMMUNICATION,
    SMP__ALLOC_OFFLOAD = SMP_MEMORY_OFFLOADED,
    SMP__ALLOC_CACHED = SMP_MEMORY_CACHED
} smp__alloc_kind;

static struct {
    bool initialized, owns_mpi;
    smp_config cfg;
    MPI_Comm world;          /* smp's duplicate of the host communicator */
    int rank, size, local_rank, local_size;
    int pp_rank, tp_rank, rdp_rank, mp_rank, dp_rank; /* smp_group's comment says what each is */
    char *hosts;             /* every world rank's host name, back to back */
    int *host_at;            /* world rank -> offset of its name in hosts */
    smp__group_info groups[SMP_GROUP_COUNT];
    smp_persistent *persistent; /* the live handles, whose requests smp_finalize releases */
    MPI_Op half_ops[2][5];   /* [f16, bf16][smp_op] (AVG unused) */
    MPI_Datatype half_type;
    smp_memory_stats mem;
    smp_device_backend device;
    bool has_device;
    /* where this rank is, for the exit guard: steps begun, and in a step the
       operation running ('F', 'B', 'W' or the body 'L'; 0: between operations) */
    struct { long steps; char op; int stage, microbatch; bool in_step; } at;
} smp__ctx;

/* Each thread's last error: the checkpoint I/O thread's failures never
   overwrite (or tear) the message the main thread is reading; the I/O
   thread hands its message over when it is joined. */
#if defined(__cplusplus)
#define SMP__THREAD_LOCAL thread_local
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#define SMP__THREAD_LOCAL _Thread_local
#elif defined(__GNUC__)
#define SMP__THREAD_LOCAL __thread /* C99 under gcc and clang */
#else
#error "smp needs thread-local storage: compile as C11 (-std=c11) or with gcc or clang"
#endif
static SMP__THREAD_LOCAL char smp__errbuf[2048];
static smp_log_fn smp__logger;
static void *smp__logger_user;

/* ---------------------------------------------------------------- errors, logging */
SMPDEF const char *smp_last_error(void) { return smp__errbuf; }

SMPDEF const char *smp_status_name(smp_status s) {
    static const char *names[] = {"ok", "config error", "bad argument", "wrong state", "MPI error", "device error",
                                  "out of memory", "I/O error", "format error", "module error", "remote error"};
    return (unsigned)s < sizeof names / sizeof names[0] ? names[s] : "unknown status";
}

SMPDEF smp_status smp_error(smp_status s, const char *fmt, ...) {
    char msg[sizeof smp__errbuf]; /* the arguments may include smp_last_error() itself */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(smp__errbuf, msg, sizeof msg);
    return s;
}

SMPDEF void smp_set_logger(smp_log_fn fn, void *user) { smp__logger = fn; smp__logger_user = user; }

static void smp__vlog(smp_log_level level, const char *fmt, va_list ap) {
    char msg[4096];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (smp__logger) { smp__logger(level, msg, smp__logger_user); return; }
    if (level == SMP_LOG_DEBUG || (level == SMP_LOG_INFO && !getenv("SMP_VERBOSE"))) return;
    static const char *tags[] = {"debug", "info", "warning", "error"};
    fprintf(stderr, "smp[%d] %s: %s\n", smp__ctx.initialized ? smp__ctx.rank : 0, tags[level], msg);
    fflush(stderr);
}

/* The library's own messages, through the logger set by smp_set_logger. */
static void smp__log(smp_log_level level, const char *fmt, ...) SMP__PRINTF(2, 3);
static void smp__log(smp_log_level level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    smp__vlog(level, fmt, ap);
    va_end(ap);
}

static void smp__sleep_ns(long ns);

/* A broken invariant or a wait past its deadline, in any of the headers:
   the whole job stops, and the message reaches stderr first. */
static void smp__fatal(const char *fmt, ...) SMP__PRINTF(1, 2) SMP__NORETURN;
static bool smp__aborting; /* the exit guard stands down: the job is going anyway */
static void smp__fatal(const char *fmt, ...) {
    smp__aborting = true;
    va_list ap;
    va_start(ap, fmt);
    smp__vlog(SMP_LOG_ERROR, fmt, ap);
    va_end(ap);
    int up = 0;
    if (MPI_Initialized(&up) != MPI_SUCCESS) up = 0; /* then abort() alone ends this process */
    /* the launcher forwards stderr asynchronously: give the message time to
       leave before MPI_Abort tears every process down */
    smp__sleep_ns(200000000L);
    if (up) MPI_Abort(MPI_COMM_WORLD, 3);
    abort();
}

/* MPI calls, under the MPI ERRORS policy above. Each checked call names its
   purpose (printf-style, with the peer or group); a failure reads
   "MPI_Isend failed sending <purpose>: <MPI_Error_string's text>".
     SMP__MPI_CHECK(call, ...)  an smp_status: SMP_OK, or SMP_ERR_MPI with that message
     SMP__MPI(call, ...)        the same, returned from the enclosing function on failure
     SMP__MPI_FATAL(call, ...)  a failure aborts the job with the message (where no
                                agreement is possible: inside the collective that agrees,
                                a blocking collective, a request other ranks are in)
     SMP__MPI_WARN(call, ...)   a failure is logged (releasing what no result depends on)
   Under SMP_TESTING, SMP_FAULT_MPI counts the calls of SMP__MPI_CHECK and
   SMP__MPI: an injected failure skips the call and returns MPI_ERR_OTHER. */
#ifdef SMP_TESTING
static bool smp__mpi_injected(void);
#define SMP__MPI_RUN(call) (smp__mpi_injected() ? MPI_ERR_OTHER : (call))
#else
#define SMP__MPI_RUN(call) (call)
#endif
static void smp__mpi_vtext(char *out, size_t cap, int rc, const char *call, const char *fmt, va_list ap) {
    char text[MPI_MAX_ERROR_STRING], purpose[512];
    int len = 0, name = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "MPI error code %d", rc);
    vsnprintf(purpose, sizeof purpose, fmt, ap);
    while (call[name] && call[name] != '(') name++; /* the function's name, not its arguments */
    snprintf(out, cap, "%.*s failed %s: %s", name, call, purpose, text);
}
/* What a failed MPI call becomes under the policy: an SMP_ERR_MPI status
   (the caller's agreement spreads it), an abort where no agreement can
   follow, or a warning where no result depends on the call. */
enum { SMP__MPI_STATUS, SMP__MPI_ABORT, SMP__MPI_LOG };
static smp_status smp__mpi_failed(int how, int rc, const char *call, const char *fmt, ...) SMP__PRINTF(4, 5);
static smp_status smp__mpi_failed(int how, int rc, const char *call, const char *fmt, ...) {
    if (rc == MPI_SUCCESS) return SMP_OK;
    char msg[sizeof smp__errbuf];
    va_list ap;
    va_start(ap, fmt);
    smp__mpi_vtext(msg, sizeof msg, rc, call, fmt, ap);
    va_end(ap);
    if (how == SMP__MPI_ABORT) smp__fatal("%s; the other ranks cannot learn of it otherwise, so the job aborts", msg);
    if (how == SMP__MPI_LOG) {
        smp__log(SMP_LOG_WARN, "%s", msg);
        return SMP_OK;
    }
    return smp_error(SMP_ERR_MPI, "%s", msg);
}
#define SMP__MPI_CHECK(call, ...) smp__mpi_failed(SMP__MPI_STATUS, SMP__MPI_RUN(call), #call, __VA_ARGS__)
#define SMP__MPI(call, ...) \
    do { \
        smp_status smp_mpi_st_ = SMP__MPI_CHECK(call, __VA_ARGS__); \
        if (smp_mpi_st_) return smp_mpi_st_; \
    } while (0)
#define SMP__MPI_FATAL(call, ...) (void)smp__mpi_failed(SMP__MPI_ABORT, (call), #call, __VA_ARGS__)
#define SMP__MPI_WARN(call, ...) (void)smp__mpi_failed(SMP__MPI_LOG, (call), #call, __VA_ARGS__)

/* MPI counts are int. n bytes as one (count, datatype): MPI_BYTE up to
   INT_MAX bytes, beyond that a derived type of 1 GiB blocks and the rest
   (count 1), which the caller frees (MPI_Type_free) once the transfer is
   posted. So a message of any size is one message, in every MPI. */
static smp_status smp__bytes_type(size_t n, int *count, MPI_Datatype *type) {
    *type = MPI_BYTE;
    *count = (int)n;
    if (n <= (size_t)INT_MAX) return SMP_OK;
    const size_t block = (size_t)1 << 30;
    MPI_Datatype gib, blocks = MPI_DATATYPE_NULL;
    int lens[2] = {1, (int)(n % block)};
    MPI_Aint at[2] = {0, (MPI_Aint)(n - n % block)};
    MPI_Datatype parts[2];
    SMP__MPI(MPI_Type_contiguous((int)block, MPI_BYTE, &gib), "making the datatype of a %zu-byte message", n);
    smp_status st = SMP__MPI_CHECK(MPI_Type_contiguous((int)(n / block), gib, &blocks),
                                   "making the datatype of a %zu-byte message", n);
    parts[0] = blocks;
    parts[1] = MPI_BYTE;
    if (!st)
        st = SMP__MPI_CHECK(MPI_Type_create_struct(lens[1] ? 2 : 1, lens, at, parts, type),
                            "making the datatype of a %zu-byte message", n);
    if (!st && (st = SMP__MPI_CHECK(MPI_Type_commit(type), "committing the datatype of a %zu-byte message", n)))
        SMP__MPI_WARN(MPI_Type_free(type), "releasing an uncommitted message datatype");
    SMP__MPI_WARN(MPI_Type_free(&gib), "releasing a part of a message datatype");
    if (blocks != MPI_DATATYPE_NULL) SMP__MPI_WARN(MPI_Type_free(&blocks), "releasing a part of a message datatype");
    if (st) { *type = MPI_BYTE; return st; }
    *count = 1;
    return SMP_OK;
}

static smp_status smp__require_init(const char *fn) {
    if (!smp__ctx.initialized) return smp_error(SMP_ERR_STATE, "%s called before smp_init", fn);
    return SMP_OK;
}

/* ---------------------------------------------------------------- memory
   Every block smp holds comes from one of these, counted in smp_memory() in
   its category (smp__alloc_kind), and goes back through smp__free:
     smp__alloc(n, kind)               NULL when there is none, the last error
                                       untouched: for callers that report it their own way
     smp__alloc_or(st, n, kind, what)  the out-of-memory policy: NULL and SMP_ERR_NOMEM in
                                       *st naming what; zeroed unless kind | SMP__UNINIT
     smp__grow_or(st, &arr, &cap, need, elem, what)  a growable array under the policy
                                       (smp__grow: without a message, for callers that report later)
     smp__tensor_alloc_or(st, t, on_device, kind, what)  a tensor's data, host or device
   While a step runs they come from its model's cache (the caching allocator
   below). A host block carries its size and kind in a 64-byte header, so
   frees can be counted without a lookup and the payload stays 64-byte
   aligned. */
#define SMP__HDR 64

/* A category's bytes change by delta (the registered optimizer state's too, which current_bytes leaves out). */
static void smp__count_kind(smp_memory_kind kind, int64_t delta) {
    smp_memory_stats *m = &smp__ctx.mem;
    m->bytes[kind] += delta;
    if (m->bytes[kind] > m->peak[kind]) m->peak[kind] = m->bytes[kind];
}

static void smp__count(smp__alloc_kind kind, int64_t delta) {
    smp_memory_stats *m = &smp__ctx.mem;
    m->current_bytes += delta;
    if (m->current_bytes > m->peak_bytes) m->peak_bytes = m->current_bytes;
    smp__count_kind((smp_memory_kind)kind, delta);
    if (kind == SMP__ALLOC_PARAM || kind == SMP__ALLOC_GRAD) {
        m->param_bytes += delta;
        if (m->param_bytes > m->param_peak_bytes) m->param_peak_bytes = m->param_bytes;
    } else if (kind == SMP__ALLOC_STASH) {
        m->stash_bytes += delta;
        if (m->stash_bytes > m->stash_peak_bytes) m->stash_peak_bytes = m->stash_bytes;
    }
}

/* What smp knows of a block it handed out: the bytes asked for and their
   category (the account) and, for a block of a model's cache (below), the
   cache, the size class and, while the block is free, the next free block of
   its class. Host blocks carry it in their header; device blocks, whose
   memory the CPU cannot read, in smp__devmem. */
typedef struct smp__cache smp__cache;
typedef struct smp__block_info {
    size_t bytes;
    smp__alloc_kind kind;
    int cls;
    smp__cache *cache;
    void *next;
} smp__block_info;
typedef struct smp__host_hdr { smp__block_info info; size_t pad; } smp__host_hdr; /* ends where the payload starts */

/* Blocks of device memory smp allocated through the backend, keyed by
   address. A device pointer has no header smp could read, so what smp knows
   of each block lives here: the statistics count device bytes like host
   bytes, and smp__free tells a device block from a host one. Open
   addressing with linear probing; deletion shifts the run back, so there
   are no tombstones. */
typedef struct smp__dev_block { void *p; smp__block_info info; } smp__dev_block;
static struct { smp__dev_block *slot; size_t cap, used; } smp__devmem;

static size_t smp__dev_home(const void *p) {
    return (size_t)(((uint64_t)(uintptr_t)p * 0x9e3779b97f4a7c15ull) >> 32) & (smp__devmem.cap - 1);
}

static smp__dev_block *smp__dev_find(const void *p) {
    if (!smp__devmem.used || !p) return NULL;
    for (size_t i = smp__dev_home(p);; i = (i + 1) & (smp__devmem.cap - 1)) {
        if (smp__devmem.slot[i].p == p) return &smp__devmem.slot[i];
        if (!smp__devmem.slot[i].p) return NULL;
    }
}

#ifdef SMP_TESTING
static struct {
    long events[SMP_FAULT_COUNT], fail_at[SMP_FAULT_COUNT];
} smp__testing = {{0}, {-1, -1, -1, -1, -1, -1}};
SMP__CORE void smp_testing_fail(smp_testing_fault kind, long skip) {
    smp__testing.fail_at[kind] = skip < 0 ? -1 : smp__testing.events[kind] + skip;
}
SMP__CORE long smp_testing_events(smp_testing_fault kind) { return smp__testing.events[kind]; }
/* Counts an event of the kind; true when it is the one to fail. */
static bool smp__injected(smp_testing_fault kind) {
    if (smp__testing.events[kind]++ != smp__testing.fail_at[kind]) return false;
    smp__testing.fail_at[kind] = -1;
    return true;
}
static bool smp__mpi_injected(void) { return smp__injected(SMP_FAULT_MPI); }
#else
#define smp__injected(kind) false
#endif

/* The system's allocators, the only places smp calls them (SMP_FAULT_SYSTEM_ALLOC counts the calls). */
static void *smp__system_malloc(size_t n) { return smp__injected(SMP_FAULT_SYSTEM_ALLOC) ? NULL : SMP_MALLOC(n); }
static void *smp__system_dev_alloc(size_t n) {
    if (!smp__injected(SMP_FAULT_SYSTEM_ALLOC)) return smp__ctx.device.alloc(n ? n : 1);
    smp_error(SMP_ERR_NOMEM, "an injected failure of the device's allocator");
    return NULL;
}

static bool smp__dev_track(void *p, const smp__block_info *info) {
    if (2 * (smp__devmem.used + 1) > smp__devmem.cap) { /* at most half full */
        size_t old_cap = smp__devmem.cap, cap = old_cap ? 2 * old_cap : 64;
        smp__dev_block *old = smp__devmem.slot, *slot = (smp__dev_block *)smp__system_malloc(cap * sizeof *slot);
        if (!slot) return false;
        memset(slot, 0, cap * sizeof *slot);
        smp__devmem.slot = slot;
        smp__devmem.cap = cap;
        smp__devmem.used = 0;
        for (size_t i = 0; i < old_cap; i++)
            if (old[i].p) smp__dev_track(old[i].p, &old[i].info);
        SMP_FREE(old);
    }
    size_t i = smp__dev_home(p);
    while (smp__devmem.slot[i].p) i = (i + 1) & (smp__devmem.cap - 1);
    smp__devmem.slot[i].p = p;
    smp__devmem.slot[i].info = *info;
    smp__devmem.used++;
    return true;
}

static void smp__dev_untrack(smp__dev_block *b) {
    size_t mask = smp__devmem.cap - 1, hole = (size_t)(b - smp__devmem.slot);
    for (size_t j = (hole + 1) & mask; smp__devmem.slot[j].p; j = (j + 1) & mask) {
        size_t home = smp__dev_home(smp__devmem.slot[j].p);
        /* from home without crossing the hole */
        bool reachable = hole < j ? home > hole && home <= j : home > hole || home <= j;
        if (!reachable) { smp__devmem.slot[hole] = smp__devmem.slot[j]; hole = j; }
    }
    smp__devmem.slot[hole].p = NULL;
    if (--smp__devmem.used == 0) { /* no device model left: nothing to keep */
        SMP_FREE(smp__devmem.slot);
        memset(&smp__devmem, 0, sizeof smp__devmem);
    }
}

static smp__block_info *smp__info_of(void *p, bool device) {
    if (device) return &smp__dev_find(p)->info;
    return &((smp__host_hdr *)(void *)((unsigned char *)p - sizeof(smp__host_hdr)))->info;
}

/* n bytes from the system, host (behind a header, the payload 64-byte
   aligned even when malloc only gives 16) or device; NULL when it has none. */
static void *smp__system_block(size_t n, bool device) {
    if (device) return smp__system_dev_alloc(n);
    unsigned char *p = (unsigned char *)smp__system_malloc(n + SMP__HDR);
    if (!p) return NULL;
    size_t pad = (SMP__HDR - ((uintptr_t)p + SMP__HDR) % SMP__HDR) % SMP__HDR;
    if (pad) {
        SMP_FREE(p);
        p = (unsigned char *)smp__system_malloc(n + 2 * SMP__HDR);
        if (!p) return NULL;
        pad = (SMP__HDR - ((uintptr_t)p + SMP__HDR) % SMP__HDR) % SMP__HDR;
    }
    unsigned char *user = p + pad + SMP__HDR;
    ((smp__host_hdr *)(void *)(user - sizeof(smp__host_hdr)))->pad = pad;
    return user;
}

static void smp__system_release(void *p, smp__dev_block *dev) {
    if (dev) {
        smp__dev_untrack(dev);
        smp__ctx.device.dealloc(p);
        return;
    }
    unsigned char *user = (unsigned char *)p;
    SMP_FREE(user - SMP__HDR - ((smp__host_hdr *)(void *)(user - sizeof(smp__host_hdr)))->pad);
}

/* ---------------------------------------------------------------- the caching allocator
   While a step runs, every block it asks for (call outputs and stashes,
   gradients of calls, received messages, the step's tables) comes from its
   model's cache (smp__cache_now, set on the thread that runs the step), and
   a freed block goes back to the free list of its size class, host or
   device, where the next microbatch or step finds it: a step of an
   unchanged model makes no system allocation once the first has run.
   Parameters and their gradients, which live as long as the model, are the
   system's. A size class is 64 bytes, then four per power of two, so a
   block is at most a quarter larger than asked for. The account counts a
   block in use at the bytes asked for, in its category; the rest of what a
   cache holds (free blocks, the rounding of blocks in use) counts as
   SMP_MEMORY_CACHED. Free blocks go back to the system when the model is
   freed, and, every model's, when a system allocation in a step fails,
   which is then tried once more. Device blocks are reused in the order of
   the engine's stream, as the backend's stream-ordered frees are. */
#define SMP__CACHE_CLASSES 225 /* sizes up to 2^62 */
struct smp__cache {
    void *free_list[2][SMP__CACHE_CLASSES]; /* [device][class]: the first free block */
    long out;                               /* its blocks in use */
    bool orphaned;                          /* its model is gone: blocks in use go to the system when freed */
    smp__cache *next;                       /* every live model's cache */
};
static smp__cache *smp__caches;
static SMP__THREAD_LOCAL smp__cache *smp__cache_now;

/* n's class and its size in *bytes; -1 past the largest class. */
static int smp__size_class(size_t n, size_t *bytes) {
    if (n <= 64) { *bytes = 64; return 0; }
    if (n > (size_t)1 << 62) return -1;
    /* 2^e < n <= 2^(e+1): the highest bit of n - 1 (every allocation of a step comes here) */
#if defined(__GNUC__) || defined(__clang__)
    int e = 63 - __builtin_clzll((unsigned long long)(n - 1));
#else
    int e = 6;
    while (((size_t)1 << (e + 1)) < n) e++;
#endif
    size_t quarter = (size_t)1 << (e - 2), steps = (n + quarter - 1) / quarter; /* 5 to 8 */
    *bytes = steps * quarter;
    return 1 + 4 * (e - 6) + (int)(steps - 5);
}
static size_t smp__class_bytes(int cls) { return cls ? (size_t)(5 + (cls - 1) % 4) << (4 + (cls - 1) / 4) : 64; }

/* Gives c's free blocks back to the system; the bytes they held. */
static size_t smp__cache_trim(smp__cache *c) {
    size_t released = 0;
    for (int device = 0; device < 2; device++)
        for (int cls = 0; cls < SMP__CACHE_CLASSES; cls++)
            while (c->free_list[device][cls]) {
                void *p = c->free_list[device][cls];
                c->free_list[device][cls] = smp__info_of(p, device)->next;
                smp__count(SMP__ALLOC_CACHED, -(int64_t)smp__class_bytes(cls));
                released += smp__class_bytes(cls);
                smp__system_release(p, device ? smp__dev_find(p) : NULL);
            }
    return released;
}

/* A block of n bytes for kind, host or device: from the step's cache when
   one is set (a free block of n's class, else a new one of the class's
   size), else the system's; NULL when the system has no memory even after
   every cache gave back its free blocks. */
static void *smp__block(size_t n, smp__alloc_kind kind, bool device) {
    smp__cache *c = kind == SMP__ALLOC_PARAM || kind == SMP__ALLOC_GRAD ? NULL : smp__cache_now;
    size_t bytes = n;
    int cls = c ? smp__size_class(n, &bytes) : -1;
    if (cls < 0) { c = NULL; bytes = n; }
    void *p = c ? c->free_list[device][cls] : NULL;
    if (p) {
        c->free_list[device][cls] = smp__info_of(p, device)->next;
        smp__count(SMP__ALLOC_CACHED, -(int64_t)n);
    } else {
        p = smp__system_block(bytes, device);
        if (!p && smp__cache_now) { /* the out-of-memory policy's one retry */
            size_t released = 0;
            for (smp__cache *k = smp__caches; k; k = k->next) released += smp__cache_trim(k);
            if (released) p = smp__system_block(bytes, device);
        }
        if (!p) return NULL;
        smp__block_info info;
        memset(&info, 0, sizeof info);
        if (device && !smp__dev_track(p, &info)) {
            smp__ctx.device.dealloc(p);
            smp_error(SMP_ERR_NOMEM, "out of host memory tracking %zu bytes of device memory", n);
            return NULL;
        }
        if (c) smp__count(SMP__ALLOC_CACHED, (int64_t)(bytes - n));
    }
    smp__block_info *info = smp__info_of(p, device);
    info->bytes = n;
    info->kind = kind;
    info->cls = cls;
    info->cache = c;
    info->next = NULL;
    if (c) c->out++;
    smp__count(kind, (int64_t)n);
    return p;
}

static void *smp__alloc(size_t n, smp__alloc_kind kind) {
    if (smp__injected(SMP_FAULT_ALLOC)) return NULL;
    return smp__block(n, kind, false);
}

static void smp__free(void *ptr) {
    if (!ptr) return;
    smp__dev_block *dev = smp__dev_find(ptr);
    smp__block_info *info = smp__info_of(ptr, dev != NULL);
    smp__cache *c = info->cache;
    smp__count(info->kind, -(int64_t)info->bytes);
    if (c && !c->orphaned) {
        smp__count(SMP__ALLOC_CACHED, (int64_t)info->bytes);
        info->next = c->free_list[dev != NULL][info->cls];
        c->free_list[dev != NULL][info->cls] = ptr;
        c->out--;
        return;
    }
    if (c) smp__count(SMP__ALLOC_CACHED, -(int64_t)(smp__class_bytes(info->cls) - info->bytes));
    smp__system_release(ptr, dev);
    if (c && --c->out == 0) smp__free(c); /* the last block of a freed model's cache */
}

/* Whether c holds a free block for n bytes, host or device. */
SMP__CORE bool smp__cache_has(const smp__cache *c, size_t n, bool device) {
    size_t bytes;
    int cls = smp__size_class(n, &bytes);
    return cls >= 0 && c->free_list[device][cls];
}

/* Makes c the cache allocations on this thread come from (NULL: the system); the one it replaces. */
static smp__cache *smp__cache_use(smp__cache *c) {
    smp__cache *was = smp__cache_now;
    smp__cache_now = c;
    return was;
}

/* A new cache, empty (a model's, or a pool of its executor's); NULL without memory. */
static smp__cache *smp__cache_new(void) {
    smp__cache *was = smp__cache_use(NULL); /* the cache itself is the system's */
    smp__cache *c = (smp__cache *)smp__alloc(sizeof *c, SMP__ALLOC_OTHER);
    smp__cache_use(was);
    if (!c) return NULL;
    memset(c, 0, sizeof *c);
    c->next = smp__caches;
    smp__caches = c;
    return c;
}

/* The model is gone: its cache's free blocks go back to the system, and the
   cache with them once no block of it is in use (a step's outputs the
   engine still holds go when it frees them). */
static void smp__cache_free(smp__cache *c) {
    if (!c) return;
    smp__cache_trim(c);
    for (smp__cache **at = &smp__caches; *at; at = &(*at)->next)
        if (*at == c) { *at = c->next; break; }
    if (smp__cache_now == c) smp__cache_now = NULL;
    if (c->out) c->orphaned = true;
    else smp__free(c);
}

/* The out-of-memory policy's message: what could not be had and for what. */
static smp_status smp__nomem(size_t bytes, const char *what) {
    return smp_error(SMP_ERR_NOMEM, "out of memory: %zu bytes for %s on rank %d; free memory%s and run it again", bytes,
                     what, smp__ctx.rank,
                     smp__ctx.at.in_step ? " (or use fewer or smaller microbatches, or activation_checkpointing)" : "");
}

/* Memory for a call that reports errors, zeroed (tables): NULL and
   SMP_ERR_NOMEM in *st naming `what` when there is none, and nothing at all
   once *st holds an error, so a run of allocations needs one check at its
   end. kind | SMP__UNINIT leaves it uninitialised: for payloads that are
   written whole (messages), where zeroing would be a second pass. */
#define SMP__UNINIT 0x100u
static void *smp__alloc_or(smp_status *st, size_t n, unsigned kind, const char *what) {
    if (*st) return NULL;
    void *p = smp__alloc(n ? n : 1, (smp__alloc_kind)(kind & ~SMP__UNINIT));
    if (!p) *st = smp__nomem(n, what);
    else if (!(kind & SMP__UNINIT)) memset(p, 0, n);
    return p;
}

/* ---------------------------------------------------------------- the core every header uses
   Growable arrays and text, counted in smp_memory() like every block smp
   holds. */

/* Grows *arr (elements of elem bytes, *cap of them) to hold need; false
   when there is no memory (or the count would pass INT_MAX), *arr intact
   and *want (when not NULL) the bytes it asked for. */
static bool smp__grow(void **arr, int *cap, int need, size_t elem, size_t *want) {
    if (need <= *cap) return true;
    int nc = *cap ? *cap : 8;
    while (nc < need) {
        if (nc > INT_MAX / 2) { if (want) *want = SIZE_MAX; return false; }
        nc *= 2;
    }
    void *p = smp__alloc((size_t)nc * elem, SMP__ALLOC_OTHER);
    if (!p) { if (want) *want = (size_t)nc * elem; return false; }
    if (*arr) { memcpy(p, *arr, (size_t)*cap * elem); smp__free(*arr); }
    *arr = p;
    *cap = nc;
    return true;
}
/* The same for a call that reports errors: the out-of-memory policy's
   error names `what`; nothing at all once *st holds an error. */
SMP__CORE bool smp__grow_or(smp_status *st, void **arr, int *cap, int need, size_t elem, const char *what) {
    size_t want = 0;
    if (*st) return false;
    if (smp__grow(arr, cap, need, elem, &want)) return true;
    *st = smp__nomem(want, what);
    return false;
}

/* Growable text, always NUL-terminated. Once an append fails, `oom` is set,
   `want` holds the bytes it asked for and the rest are dropped, so a run of
   appends needs one check at its end (the caller names the purpose). */
typedef struct smp__sbuf {
    char *p;
    size_t len, cap;
    bool oom;
    size_t want;
} smp__sbuf;

SMP__CORE bool smp__sbuf_reserve(smp__sbuf *b, size_t n) {
    if (b->oom) return false;
    if (b->len + n + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 1024;
    while (cap < b->len + n + 1) {
        if (cap > SIZE_MAX / 4) { b->oom = true; b->want = SIZE_MAX; return false; }
        cap *= 2;
    }
    char *q = (char *)smp__alloc(cap, SMP__ALLOC_OTHER);
    if (!q) { b->oom = true; b->want = cap; return false; }
    if (b->len) memcpy(q, b->p, b->len);
    smp__free(b->p);
    b->p = q;
    b->cap = cap;
    return true;
}
SMP__CORE void smp__sbuf_put(smp__sbuf *b, const char *s, size_t n) {
    if (!smp__sbuf_reserve(b, n)) return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}
SMP__CORE void smp__sbuf_puts(smp__sbuf *b, const char *s) { smp__sbuf_put(b, s, strlen(s)); }
SMP__CORE void smp__sbuf_printf(smp__sbuf *b, const char *fmt, ...) SMP__PRINTF(2, 3);
SMP__CORE void smp__sbuf_printf(smp__sbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !smp__sbuf_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}
/* s with JSON's escapes, without quotes (UTF-8 passes through). */
SMP__CORE void smp__sbuf_escaped(smp__sbuf *b, const char *s) {
    const char *run = s;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        smp__sbuf_put(b, run, (size_t)(s - run));
        switch (c) {
        case '"': smp__sbuf_puts(b, "\\\""); break;
        case '\\': smp__sbuf_puts(b, "\\\\"); break;
        case '\n': smp__sbuf_puts(b, "\\n"); break;
        case '\r': smp__sbuf_puts(b, "\\r"); break;
        case '\t': smp__sbuf_puts(b, "\\t"); break;
        case '\b': smp__sbuf_puts(b, "\\b"); break;
        case '\f': smp__sbuf_puts(b, "\\f"); break;
        default: smp__sbuf_printf(b, "\\u%04x", c);
        }
        run = s + 1;
    }
    smp__sbuf_put(b, run, (size_t)(s - run));
}
/* prefix + s as one JSON string (prefix may be NULL). */
SMP__CORE void smp__sbuf_jstr(smp__sbuf *b, const char *prefix, const char *s) {
    smp__sbuf_puts(b, "\"");
    if (prefix) smp__sbuf_escaped(b, prefix);
    smp__sbuf_escaped(b, s);
    smp__sbuf_puts(b, "\"");
}

/* JSON reading, for every reader in the headers (smp.h's config,
   smp_checkpoint.h's header and manifest): strict RFC 8259 pieces over text
   s[0..n) with s[n] == 0. Errors give a message and the byte offset. */

/* Where whitespace after i ends. */
static size_t smp__json_skip_ws(const char *s, size_t n, size_t i) {
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
    return i;
}

/* Names the byte at `at` for a syntax error: 'x', byte 0x.., or the end of
   the `doc` ("input", "header"). */
static const char *smp__json_found(const char *s, size_t n, size_t at, const char *doc, char *buf, size_t cap) {
    unsigned char c = at < n ? (unsigned char)s[at] : 0;
    if (at >= n) snprintf(buf, cap, "the end of the %s", doc);
    else if (c >= 0x20 && c < 0x7f) snprintf(buf, cap, "'%c'", c);
    else snprintf(buf, cap, "byte 0x%02x", c);
    return buf;
}

/* Length of the well-formed UTF-8 sequence at s (n bytes left), 0 if there
   is none: no overlong forms, no surrogates, nothing past U+10FFFF. */
static size_t smp__utf8_len(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    if (c < 0xC2) return 0;
    if (c < 0xE0) return (n >= 2 && (s[1] & 0xC0) == 0x80) ? 2 : 0;
    if (c < 0xF0) {
        if (n < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && s[1] < 0xA0) return 0;
        if (c == 0xED && s[1] >= 0xA0) return 0;
        return 3;
    }
    if (c < 0xF5) {
        if (n < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80) return 0;
        if (c == 0xF0 && s[1] < 0x90) return 0;
        if (c == 0xF4 && s[1] >= 0x90) return 0;
        return 4;
    }
    return 0;
}

/* The number of hex digits at s, up to 4; *out their value when 4. */
static int smp__json_hex4(const char *s, size_t left, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = (size_t)i < left ? s[i] : 0;
        unsigned d;
        if (c >= '0' && c <= '9') d = (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') d = (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') d = (unsigned)(c - 'A' + 10);
        else return i; /* offset of the bad digit */
        v = v * 16 + d;
    }
    *out = v;
    return 4;
}

/* Where a string's decoded text goes: out (cap bytes, whole characters
   only; `more` once one did not fit), or nowhere when out is NULL. out may
   point into the input behind the read position (decoding in place), since
   decoded text never outruns its source. */
typedef struct smp__jstr {
    char *out;
    size_t cap, len;
    bool more;
    bool no_nul; /* \u0000 is an error (the text becomes a C string) */
} smp__jstr;

static void smp__jstr_put(smp__jstr *d, const char *b, size_t k) {
    if (!d->out) return;
    if (d->more || d->len + k > d->cap) { d->more = true; return; }
    memmove(d->out + d->len, b, k);
    d->len += k;
}

/* Decodes the string whose opening quote is at s[*pos]. On success *pos is
   past the closing quote. On failure false, with the reason in why and
   *pos at the byte it is about. */
static bool smp__json_string_at(const char *s, size_t n, size_t *pos, smp__jstr *d, char *why, size_t why_cap) {
    const unsigned char *u = (const unsigned char *)s;
    size_t start = *pos, i = start + 1;
    for (;;) {
        if (i >= n) {
            snprintf(why, why_cap, "unterminated string (the input ends at byte %zu)", n);
            *pos = start;
            return false;
        }
        unsigned c = u[i];
        char b[4];
        *pos = i;
        if (c == '"') { *pos = i + 1; return true; }
        if (c < 0x20) {
            snprintf(why, why_cap, "raw control character 0x%02x inside a string (escape it)", c);
            return false;
        }
        if (c >= 0x80) {
            size_t k = smp__utf8_len(u + i, n - i);
            if (!k) {
                if (c < 0xC2 || c > 0xF4) snprintf(why, why_cap, "invalid UTF-8 byte 0x%02x in a string", c);
                else snprintf(why, why_cap, "invalid UTF-8 sequence in a string");
                return false;
            }
            smp__jstr_put(d, s + i, k);
            i += k;
            continue;
        }
        if (c != '\\') { b[0] = (char)c; smp__jstr_put(d, b, 1); i++; continue; }
        unsigned cp;
        unsigned char e = i + 1 < n ? u[i + 1] : 0;
        switch (e) {
        case '"': cp = '"'; break;
        case '\\': cp = '\\'; break;
        case '/': cp = '/'; break;
        case 'b': cp = '\b'; break;
        case 'f': cp = '\f'; break;
        case 'n': cp = '\n'; break;
        case 'r': cp = '\r'; break;
        case 't': cp = '\t'; break;
        case 'u': {
            int ok = smp__json_hex4(s + i + 2, n - i - 2, &cp);
            if (ok < 4) {
                *pos = i + 2 + (size_t)ok;
                snprintf(why, why_cap, "\\u must be followed by 4 hex digits");
                return false;
            }
            if (cp >= 0xDC00 && cp <= 0xDFFF) {
                snprintf(why, why_cap, "\\u%04X is a low surrogate without a high surrogate before it", cp);
                return false;
            }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo = 0;
                if (i + 7 >= n || u[i + 6] != '\\' || u[i + 7] != 'u' ||
                    smp__json_hex4(s + i + 8, n - i - 8, &lo) < 4 || lo < 0xDC00 || lo > 0xDFFF) {
                    snprintf(why, why_cap, "\\u%04X is a high surrogate not followed by a \\u low surrogate", cp);
                    return false;
                }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                i += 6;
            }
            if (cp == 0 && d->no_nul) {
                snprintf(why, why_cap, "\\u0000 in a string (names and values cannot hold NUL)");
                return false;
            }
            i += 4;
            break;
        }
        default:
            if (i + 1 >= n) {
                snprintf(why, why_cap, "unterminated string (the input ends at byte %zu)", n);
                *pos = start;
                return false;
            }
            if (e >= 0x20 && e < 0x7f) snprintf(why, why_cap, "invalid escape '\\%c' in a string", e);
            else snprintf(why, why_cap, "invalid escape (a backslash before byte 0x%02x) in a string", e);
            return false;
        }
        i += 2;
        size_t k = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
        if (k == 1) b[0] = (char)cp;
        else if (k == 2) {
            b[0] = (char)(0xC0 | (cp >> 6));
            b[1] = (char)(0x80 | (cp & 0x3F));
        } else if (k == 3) {
            b[0] = (char)(0xE0 | (cp >> 12));
            b[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
            b[2] = (char)(0x80 | (cp & 0x3F));
        } else {
            b[0] = (char)(0xF0 | (cp >> 18)); b[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
            b[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); b[3] = (char)(0x80 | (cp & 0x3F));
        }
        smp__jstr_put(d, b, k);
    }
}

/* Scans a number in JSON's grammar at s. Returns its length, or 0 with *why
   and *bad (offset from s) set when it is malformed. */
static size_t smp__json_scan_number(const char *s, const char **why, size_t *bad) {
    size_t i = 0;
    if (s[i] == '-') i++;
    if (s[i] == '0') {
        i++;
        if (s[i] >= '0' && s[i] <= '9') { *why = "a number may not have leading zeros"; *bad = i; return 0; }
    } else if (s[i] >= '1' && s[i] <= '9') {
        while (s[i] >= '0' && s[i] <= '9') i++;
    } else {
        *why = "'-' must be followed by a digit"; *bad = i; return 0;
    }
    if (s[i] == '.') {
        i++;
        if (!(s[i] >= '0' && s[i] <= '9')) { *why = "a digit must follow the decimal point"; *bad = i; return 0; }
        while (s[i] >= '0' && s[i] <= '9') i++;
    }
    if (s[i] == 'e' || s[i] == 'E') {
        i++;
        if (s[i] == '+' || s[i] == '-') i++;
        if (!(s[i] >= '0' && s[i] <= '9')) { *why = "a digit must follow the exponent"; *bad = i; return 0; }
        while (s[i] >= '0' && s[i] <= '9') i++;
    }
    return i;
}

/* The integer a number token spells, exactly, from its digits (the token
   is already in JSON's grammar): 0 with |value| in *mag and the sign in
   *neg; 1 when it is not an integer (1.5, 1e-400, 1.9999999999999999);
   2 when |value| is 2^64 or more. No double is involved, so 2.0, 2e0 and
   20e-1 are 2 and 12345678901234567890.0 keeps every digit. */
static int smp__json_exact_int(const char *tok, size_t len, bool *neg, uint64_t *mag) {
    size_t i = 0;
    uint64_t m = 0;
    bool big = false, nonzero = false;
    long long nfrac = 0, zeros = 0, e = 0; /* value = m * 10^(zeros + e - nfrac) */
    *neg = tok[0] == '-';
    if (*neg) i++;
    for (bool frac = false; i < len && tok[i] != 'e' && tok[i] != 'E'; i++) {
        if (tok[i] == '.') { frac = true; continue; }
        unsigned d = (unsigned)(tok[i] - '0');
        if (frac) nfrac++;
        if (d == 0) { if (nonzero) zeros++; continue; } /* trailing zeros wait: they may be a fraction's */
        nonzero = true;
        for (; zeros >= 0 && !big; zeros--) { /* m = m * 10^zeros * 10 + d */
            if (m > (UINT64_MAX - (zeros ? 0 : d)) / 10) big = true;
            else m = m * 10 + (zeros ? 0 : d);
        }
        zeros = 0;
    }
    if (i < len) { /* the exponent, saturated: past 10^6 only its sign matters */
        bool eneg = tok[++i] == '-';
        if (tok[i] == '-' || tok[i] == '+') i++;
        for (; i < len; i++) if (e < 1000000) e = e * 10 + (tok[i] - '0');
        if (eneg) e = -e;
    }
    if (!nonzero) { *mag = 0; return 0; } /* 0, -0.0, 0e7 */
    long long k = zeros + e - nfrac;
    if (k < 0) return 1; /* the last digit that is not 0 lies after the point */
    if (big) return 2;
    for (; k > 0; k--) {
        if (m > UINT64_MAX / 10) return 2;
        m *= 10;
    }
    *mag = m;
    return 0;
}

SMPDEF void smp_free(void *p) { smp__free(p); }
SMPDEF smp_memory_stats smp_memory(void) { return smp__ctx.mem; }
SMPDEF void smp_memory_reset_peaks(void) {
    smp_memory_stats *m = &smp__ctx.mem;
    m->peak_bytes = m->current_bytes;
    m->param_peak_bytes = m->param_bytes;
    m->stash_peak_bytes = m->stash_bytes;
    memcpy(m->peak, m->bytes, sizeof m->peak);
}

SMPDEF const char *smp_memory_kind_name(smp_memory_kind k) {
    static const char *const names[SMP_MEMORY_KINDS] = {"other", "parameters", "gradients", "optimizer", "activations",
                                                        "communication", "offloaded", "cached"};
    return (int)k >= 0 && k < SMP_MEMORY_KINDS ? names[k] : "unknown";
}

/* ---------------------------------------------------------------- dtypes, tensors */
/* Every dtype's name, its safetensors name and its size, in smp_dtype order:
   the one table the headers read. */
static const struct { const char *name, *file_name; size_t size; } smp__dtypes[SMP_DTYPE_COUNT] = {
    {"invalid", NULL, 0}, {"f32", "F32", 4}, {"f16", "F16", 2}, {"bf16", "BF16", 2}, {"f64", "F64", 8},
    {"i32", "I32", 4}, {"i64", "I64", 8}, {"u8", "U8", 1}, {"bool", "BOOL", 1}};

SMPDEF size_t smp_dtype_size(smp_dtype dt) { return (unsigned)dt < SMP_DTYPE_COUNT ? smp__dtypes[dt].size : 0; }
SMPDEF const char *smp_dtype_name(smp_dtype dt) { return smp__dtypes[(unsigned)dt < SMP_DTYPE_COUNT ? dt : 0].name; }

/* "[2, 3]" into buf, cut to cap; returns buf. */
static const char *smp__shape_text(const int64_t *shape, int ndim, char *buf, size_t cap) {
    size_t at = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (at < cap) snprintf(buf + at, cap - at, "]");
    return buf;
}

SMPDEF smp_tensor smp_tensor_make(void *data, smp_dtype dt, int ndim, const int64_t *shape) {
    smp_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dt;
    t.ndim = ndim;
    t.device = SMP_HOST;
    for (int i = 0; i < ndim && i < SMP_MAX_DIMS; i++) t.shape[i] = shape[i];
    return t;
}
SMPDEF smp_tensor smp_tensor_1d(void *data, smp_dtype dt, int64_t n) { return smp_tensor_make(data, dt, 1, &n); }
SMPDEF smp_tensor smp_tensor_2d(void *data, smp_dtype dt, int64_t rows, int64_t cols) {
    int64_t s[2] = {rows, cols};
    return smp_tensor_make(data, dt, 2, s);
}
SMPDEF int64_t smp_tensor_numel(const smp_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}
SMPDEF size_t smp_tensor_nbytes(const smp_tensor *t) { return (size_t)smp_tensor_numel(t) * smp_dtype_size(t->dtype); }
/* Whether two shapes are one (the checkpoint header's entries are shapes without tensors). */
SMP__CORE bool smp__same_shape(int na, const int64_t *a, int nb, const int64_t *b) {
    if (na != nb) return false;
    for (int i = 0; i < na; i++)
        if (a[i] != b[i]) return false;
    return true;
}
SMP__CORE bool smp_tensor_same_shape(const smp_tensor *a, const smp_tensor *b) {
    return smp__same_shape(a->ndim, a->shape, b->ndim, b->shape);
}
/* "f32[64, 784]" into buf; returns buf. */
static const char *smp__tensor_describe(const smp_tensor *t, char *buf, size_t cap) {
    size_t at = (size_t)snprintf(buf, cap, "%s", smp_dtype_name(t->dtype));
    if (at < cap) smp__shape_text(t->shape, t->ndim, buf + at, cap - at);
    return buf;
}

/* Checks a tensor argument; `what` names it in the message. */
/* The one check of a tensor's device that every call taking a tensor makes. */
static smp_status smp__check_device(const smp_tensor *t, const char *fn, const char *what) {
    if (t->device < 0)
        return smp_error(SMP_ERR_ARG,
                         "%s: %s has device %d; a device is SMP_HOST (0, host memory) or SMP_CUDA(ordinal)", fn, what,
                         t->device);
    if (t->device != SMP_HOST && !smp__ctx.has_device)
        return smp_error(SMP_ERR_ARG,
                         "%s: %s is on CUDA device %d but no device backend is registered (include smp_nccl.h in "
                         "the file that defines SMP_IMPLEMENTATION; a host tensor's device is SMP_HOST, 0)",
                         fn, what, SMP_CUDA_ORDINAL(t->device));
    return SMP_OK;
}

static smp_status smp__check_tensor(const smp_tensor *t, const char *fn, const char *what) {
    if (!t) return smp_error(SMP_ERR_ARG, "%s: %s is NULL", fn, what);
    if (smp_dtype_size(t->dtype) == 0)
        return smp_error(SMP_ERR_ARG, "%s: %s has an invalid dtype (%d)", fn, what, (int)t->dtype);
    if (t->ndim < 0 || t->ndim > SMP_MAX_DIMS)
        return smp_error(SMP_ERR_ARG, "%s: %s has ndim %d (0..%d)", fn, what, t->ndim, SMP_MAX_DIMS);
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] < 0)
            return smp_error(SMP_ERR_ARG, "%s: %s has negative dimension %d (%lld)", fn, what, i,
                             (long long)t->shape[i]);
    if (!t->data && smp_tensor_numel(t) > 0) return smp_error(SMP_ERR_ARG, "%s: %s has no data", fn, what);
    return smp__check_device(t, fn, what);
}

static uint32_t smp__f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float smp__bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

SMP__CORE float smp_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return smp__bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, nan */
    if (exp == 0) { /* zero or subnormal: exact in f32 */
        float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return smp__bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

SMP__CORE uint16_t smp_f32_to_f16(float f) {
    uint32_t u = smp__f32_bits(f), sign = (u >> 16) & 0x8000;
    uint32_t absu = u & 0x7fffffffu;
    if (absu >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (absu > 0x7f800000u ? 0x200 : 0));
    if (absu >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past 65504: inf */
    if (absu < 0x38800000u) { /* f16 subnormal or zero: scale into integer range and round */
        float a = smp__bits_f32(absu) * 16777216.0f; /* units of 2^-24 */
        float r = nearbyintf(a);                      /* default mode: nearest even */
        return (uint16_t)(sign | (uint32_t)r);
    }
    uint32_t exp = (absu >> 23) - 112, man = absu & 0x7fffff;
    uint32_t half = (exp << 10) | (man >> 13), rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++; /* carries into the exponent correctly */
    return (uint16_t)(sign | half);
}

SMP__CORE float smp_bf16_to_f32(uint16_t h) { return smp__bits_f32((uint32_t)h << 16); }
SMP__CORE uint16_t smp_f32_to_bf16(float f) {
    uint32_t u = smp__f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet nan */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

#if defined(DLPACK_VERSION) || defined(DLPACK_MAJOR_VERSION) || defined(SMP_DLPACK)
#if defined(DLPACK_MAJOR_VERSION) || (defined(DLPACK_VERSION) && DLPACK_VERSION >= 80) /* kDLBool: 0.8 and 1.x */
#define SMP__DL_BOOL kDLBool
#else
#define SMP__DL_BOOL kDLUInt /* DLPack before 0.8 has no bool code: bool travels as u8 */
#endif
/* Each dtype's DLPack code and bits, in smp_dtype order: both directions read it. */
static const struct { uint8_t code, bits; } smp__dl_types[SMP_DTYPE_COUNT] = {
    {0, 0}, {kDLFloat, 32}, {kDLFloat, 16}, {kDLBfloat, 16}, {kDLFloat, 64},
    {kDLInt, 32}, {kDLInt, 64}, {kDLUInt, 8}, {SMP__DL_BOOL, 8}};

SMPDEF smp_status smp_tensor_from_dlpack(const DLTensor *dl, smp_tensor *out) {
    if (!dl || !out) return smp_error(SMP_ERR_ARG, "smp_tensor_from_dlpack: NULL argument");
    if (dl->ndim < 0 || dl->ndim > SMP_MAX_DIMS)
        return smp_error(SMP_ERR_ARG, "DLPack tensor has %d dimensions; smp supports up to %d", dl->ndim, SMP_MAX_DIMS);
    if (dl->dtype.lanes != 1)
        return smp_error(SMP_ERR_ARG, "DLPack tensor has %d lanes; smp supports 1", dl->dtype.lanes);
    smp_dtype dt = SMP_DTYPE_INVALID;
    for (int k = 1; k < SMP_DTYPE_COUNT && !dt; k++) /* u8 before bool: old DLPack spells both kDLUInt 8 */
        if (dl->dtype.code == smp__dl_types[k].code && dl->dtype.bits == smp__dl_types[k].bits) dt = (smp_dtype)k;
    if (dt == SMP_DTYPE_INVALID)
        return smp_error(SMP_ERR_ARG, "DLPack dtype code %d with %d bits has no smp dtype", dl->dtype.code,
                         dl->dtype.bits);
    int device;
    if (dl->device.device_type == kDLCPU || dl->device.device_type == kDLCUDAHost) device = SMP_HOST;
    else if (dl->device.device_type == kDLCUDA) device = SMP_CUDA(dl->device.device_id);
    else return smp_error(SMP_ERR_ARG, "DLPack device type %d is neither CPU nor CUDA", (int)dl->device.device_type);
    if (dl->strides) { /* smp tensors are contiguous: accept strides only when they say so */
        int64_t expect = 1;
        for (int i = dl->ndim - 1; i >= 0; i--) {
            if (dl->shape[i] != 1 && dl->strides[i] != expect)
                return smp_error(SMP_ERR_ARG,
                                 "DLPack tensor is not contiguous (dimension %d has stride %lld, expected %lld)", i,
                                 (long long)dl->strides[i], (long long)expect);
            expect *= dl->shape[i];
        }
    }
    *out = smp_tensor_make((char *)dl->data + dl->byte_offset, dt, dl->ndim, dl->shape);
    out->device = device;
    return SMP_OK;
}

SMPDEF DLTensor smp_tensor_to_dlpack(const smp_tensor *t, int64_t shape_storage[SMP_MAX_DIMS]) {
    DLTensor dl;
    memset(&dl, 0, sizeof dl);
    for (int i = 0; i < t->ndim; i++) shape_storage[i] = t->shape[i];
    dl.data = t->data;
    dl.device.device_type = t->device == SMP_HOST ? kDLCPU : kDLCUDA;
    dl.device.device_id = t->device == SMP_HOST ? 0 : SMP_CUDA_ORDINAL(t->device);
    dl.ndim = t->ndim;
    unsigned k = (unsigned)t->dtype < SMP_DTYPE_COUNT ? (unsigned)t->dtype : 0;
    dl.dtype.code = smp__dl_types[k].code;
    dl.dtype.bits = smp__dl_types[k].bits;
    dl.dtype.lanes = 1;
    dl.shape = shape_storage;
    dl.strides = NULL; /* compact row-major */
    dl.byte_offset = 0;
    return dl;
}
#endif

/* ---------------------------------------------------------------- config */
/* ===================================================================== config
   smp_config_from_json and smp_config_resolve.

   The JSON reader is strict RFC 8259: one top-level object; strings with
   every escape (\uXXXX surrogate pairs included) and valid UTF-8; numbers in
   JSON's grammar (no leading zeros, no NaN/Infinity, no hex); true, false,
   null; nesting at most SMP__JSON_MAX_DEPTH deep. Syntax errors give the
   byte offset. A syntax error anywhere wins over a key error, so a truncated
   document reports the truncation. On any error *cfg is left untouched.
   Nothing is allocated. Numbers are converted with strtod; if the host has
   set a locale whose decimal point is not '.', the conversion adapts.
*/
#define SMP__JSON_MAX_DEPTH 32   /* objects/arrays nested deeper are refused */
#define SMP__JSON_STR_CAP 96     /* bytes of a decoded string kept; longer ones are marked truncated */
#define SMP__JSON_NUM_CAP 512    /* longest number token converted */
#define SMP__CFG_MSG_CAP 1024    /* longest message built here */
#define SMP__CFG_MAX_BUCKET_MB 1e6
#define SMP__CFG_MAX_TIMEOUT 1e9 /* seconds (~31 years); keeps deadlines finite when converted */
#define SMP__CFG_DEFAULT_TIMEOUT 600.0
#define SMP__CFG_DEFAULT_BUCKET_MB 25.0

/* ------------------------------------------------------------ key table */
typedef enum smp__cfg_kind {
    SMP__CFG_KIND_COUNT,    /* integer >= 1 (0 in the struct means 1) */
    SMP__CFG_KIND_LIMIT,    /* integer >= 0, 0: no limit */
    SMP__CFG_KIND_INDEX,    /* default_partition: any int, range checked by resolve; sets has_default_partition */
    SMP__CFG_KIND_SEED,     /* non-negative integer, 64 bits */
    SMP__CFG_KIND_BOOL,     /* an smp_switch */
    SMP__CFG_KIND_WEIGHT,   /* memory_weight: a finite number; sets has_memory_weight */
    SMP__CFG_KIND_POSITIVE, /* a finite number > 0 (0 in the struct means its default) */
    SMP__CFG_KIND_ENUM      /* one of a list of strings */
} smp__cfg_kind;

/* Enum strings: the value of names[i] is i + 1 (0 is each enum's DEFAULT). */
static const char *const smp__cfg_pipeline_names[] = {"interleaved", "simple", "zero_bubble", "zero_bubble_v", NULL};
static const char *const smp__cfg_optimize_names[] = {"speed", "memory", NULL};
static const char *const smp__cfg_placement_names[] = {"cluster", "spread", "DPT", "DTP", "PDT",
                                                       "PTD",     "TDP",    "TPD", NULL};
static const char *const smp__cfg_trace_names[] = {"cpu", "gpu", NULL};

/* A row a key, naming the smp_config field it sets. Every field but the
   numbers and the seed is an int or an enum, and smp's enums are int-sized
   (checked below), so one int accessor serves them all. */
#define SMP__CFG_FIELD(f) offsetof(smp_config, f)
static const struct smp__cfg_key {
    const char *name;
    smp__cfg_kind kind;
    size_t field;
    int dflt;                  /* BOOL and ENUM: what their DEFAULT (0) resolves to */
    const char *const *values; /* ENUM: the JSON strings */
    const char *spelled;       /* ENUM: the C names, for resolve's message */
} smp__cfg_keys[] = {
    {"partitions", SMP__CFG_KIND_COUNT, SMP__CFG_FIELD(partitions), 0, NULL, NULL},
    {"pipeline_parallel_degree", SMP__CFG_KIND_COUNT, SMP__CFG_FIELD(pipeline_parallel_degree), 0, NULL, NULL},
    {"tensor_parallel_degree", SMP__CFG_KIND_COUNT, SMP__CFG_FIELD(tensor_parallel_degree), 0, NULL, NULL},
    {"microbatches", SMP__CFG_KIND_COUNT, SMP__CFG_FIELD(microbatches), 0, NULL, NULL},
    {"pipeline", SMP__CFG_KIND_ENUM, SMP__CFG_FIELD(pipeline), SMP_PIPELINE_INTERLEAVED, smp__cfg_pipeline_names,
     "SMP_PIPELINE_INTERLEAVED (1), SMP_PIPELINE_SIMPLE (2), SMP_PIPELINE_ZERO_BUBBLE (3) or "
     "SMP_PIPELINE_ZERO_BUBBLE_V (4)"},
    {"optimize", SMP__CFG_KIND_ENUM, SMP__CFG_FIELD(optimize), SMP_OPTIMIZE_SPEED, smp__cfg_optimize_names,
     "SMP_OPTIMIZE_SPEED (1) or SMP_OPTIMIZE_MEMORY (2)"},
    {"auto_partition", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(auto_partition), SMP_ON, NULL, NULL},
    {"default_partition", SMP__CFG_KIND_INDEX, SMP__CFG_FIELD(default_partition), 0, NULL, NULL},
    {"ddp", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(ddp), SMP_OFF, NULL, NULL},
    {"placement_strategy", SMP__CFG_KIND_ENUM, SMP__CFG_FIELD(placement_strategy), SMP_PLACEMENT_CLUSTER,
     smp__cfg_placement_names,
     "SMP_PLACEMENT_CLUSTER (1), SMP_PLACEMENT_SPREAD (2) or a letter form SMP_PLACEMENT_DPT (3) "
     "to SMP_PLACEMENT_TPD (8)"},
    {"memory_weight", SMP__CFG_KIND_WEIGHT, SMP__CFG_FIELD(memory_weight), 0, NULL, NULL},
    {"trace_device", SMP__CFG_KIND_ENUM, SMP__CFG_FIELD(trace_device), SMP_TRACE_CPU, smp__cfg_trace_names,
     "SMP_TRACE_CPU (1) or SMP_TRACE_GPU (2)"},
    {"trace_execution_times", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(trace_execution_times), SMP_OFF, NULL, NULL},
    {"trace_memory_usage", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(trace_memory_usage), SMP_OFF, NULL, NULL},
    {"overlapping_allreduce", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(overlapping_allreduce), SMP_ON, NULL, NULL},
    {"backward_passes_per_step", SMP__CFG_KIND_COUNT, SMP__CFG_FIELD(backward_passes_per_step), 0, NULL, NULL},
    {"average_grads_across_microbatches", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(average_grads_across_microbatches), SMP_ON,
     NULL, NULL},
    {"bucket_cap_mb", SMP__CFG_KIND_POSITIVE, SMP__CFG_FIELD(bucket_cap_mb), 0, NULL, NULL},
    {"broadcast_buffers", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(broadcast_buffers), SMP_ON, NULL, NULL},
    {"activation_checkpointing", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(activation_checkpointing), SMP_OFF, NULL, NULL},
    {"active_microbatches", SMP__CFG_KIND_LIMIT, SMP__CFG_FIELD(active_microbatches), 0, NULL, NULL},
    {"shard_optimizer_state", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(shard_optimizer_state), SMP_OFF, NULL, NULL},
    {"prescaled_batch", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(prescaled_batch), SMP_ON, NULL, NULL},
    {"offload_activations", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(offload_activations), SMP_OFF, NULL, NULL},
    {"activation_loading_horizon", SMP__CFG_KIND_COUNT, SMP__CFG_FIELD(activation_loading_horizon), 4, NULL, NULL},
    {"virtual_stages", SMP__CFG_KIND_COUNT, SMP__CFG_FIELD(virtual_stages), 0, NULL, NULL},
    {"deterministic_reduction", SMP__CFG_KIND_BOOL, SMP__CFG_FIELD(deterministic_reduction), SMP_OFF, NULL, NULL},
    {"timeout", SMP__CFG_KIND_POSITIVE, SMP__CFG_FIELD(timeout), 0, NULL, NULL},
    {"seed", SMP__CFG_KIND_SEED, SMP__CFG_FIELD(seed), 0, NULL, NULL},
};
#define SMP__CFG_NKEYS ((int)(sizeof smp__cfg_keys / sizeof smp__cfg_keys[0]))
typedef char smp__cfg_enums_are_ints[sizeof(smp_switch) == sizeof(int) && sizeof(smp_pipeline_kind) == sizeof(int) &&
                                     sizeof(smp_optimize) == sizeof(int) && sizeof(smp_placement) == sizeof(int) &&
                                     sizeof(smp_trace_device) == sizeof(int) ? 1 : -1];
typedef char smp__cfg_keys_fit_seen[SMP__CFG_NKEYS <= 32 ? 1 : -1]; /* smp__cfg_build.seen has a bit a key */

static int smp__cfg_int(const smp_config *c, const struct smp__cfg_key *key) {
    int v;
    memcpy(&v, (const char *)c + key->field, sizeof v);
    return v;
}
static void smp__cfg_set_int(smp_config *c, const struct smp__cfg_key *key, int v) {
    memcpy((char *)c + key->field, &v, sizeof v);
}

/* ------------------------------------------------------------ small text helpers */
static void smp__cfg_appendf(char *buf, size_t cap, const char *fmt, ...) SMP__PRINTF(3, 4);
static void smp__cfg_appendf(char *buf, size_t cap, const char *fmt, ...) {
    size_t n = strlen(buf);
    if (n + 1 >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, cap - n, fmt, ap);
    va_end(ap);
}

/* Writes s (len bytes) as a double-quoted, escaped string for a message,
   shortened to about 60 bytes; `more` adds "..." (the value was longer). */
static void smp__cfg_quote(char *buf, size_t cap, const char *s, size_t len, bool more) {
    const size_t show = 60;
    size_t o = 0, i = 0;
    if (cap < 8) { if (cap) buf[0] = 0; return; }
    buf[o++] = '"';
    while (i < len) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        size_t k;
        if (i >= show) { more = true; break; }
        if (c == '"' || c == '\\') { esc[0] = '\\'; esc[1] = (char)c; esc[2] = 0; k = 1; }
        else if (c == '\n') { memcpy(esc, "\\n", 3); k = 1; }
        else if (c == '\t') { memcpy(esc, "\\t", 3); k = 1; }
        else if (c == '\r') { memcpy(esc, "\\r", 3); k = 1; }
        else if (c < 0x20 || c == 0x7f) { snprintf(esc, sizeof esc, "\\u%04x", c); k = 1; }
        else {
            k = smp__utf8_len((const unsigned char *)s + i, len - i);
            if (!k) k = 1;
            if (i + k > len) k = len - i;
            if (o + k + 5 > cap) { more = true; break; }
            memcpy(buf + o, s + i, k);
            o += k; i += k;
            continue;
        }
        size_t el = strlen(esc);
        if (o + el + 5 > cap) { more = true; break; }
        memcpy(buf + o, esc, el);
        o += el; i += k;
    }
    if (more && o + 5 <= cap) { memcpy(buf + o, "...", 3); o += 3; }
    buf[o++] = '"';
    buf[o] = 0;
}

/* strtod on s[0..len) that ignores the C library's locale: if the host set a
   locale whose decimal point is not '.', the '.' is swapped for it. */
static bool smp__cfg_strtod(const char *s, size_t len, double *out) {
    char buf[SMP__JSON_NUM_CAP + 8];
    char *end;
    if (len == 0 || len > SMP__JSON_NUM_CAP) return false;
    memcpy(buf, s, len);
    buf[len] = 0;
    *out = strtod(buf, &end);
    if (end == buf + len) return true;
    const char *dot = strchr(buf, '.');
    const struct lconv *lc = localeconv();
    if (!dot || !lc || !lc->decimal_point || !lc->decimal_point[0]) return false;
    size_t dl = strlen(lc->decimal_point), pre = (size_t)(dot - buf);
    if (len - 1 + dl > SMP__JSON_NUM_CAP) return false;
    char alt[SMP__JSON_NUM_CAP + 16];
    memcpy(alt, buf, pre);
    memcpy(alt + pre, lc->decimal_point, dl);
    memcpy(alt + pre + dl, buf + pre + 1, len - pre); /* includes the NUL */
    *out = strtod(alt, &end);
    return *end == 0;
}

/* ------------------------------------------------------------ JSON reader */
typedef enum smp__jtype {
    SMP__J_NULL, SMP__J_FALSE, SMP__J_TRUE, SMP__J_NUMBER, SMP__J_STRING, SMP__J_OBJECT, SMP__J_ARRAY
} smp__jtype;

typedef struct smp__jvalue {
    smp__jtype type;
    const char *num;  /* SMP__J_NUMBER: the token in the input */
    size_t num_len;
    char str[SMP__JSON_STR_CAP + 1]; /* SMP__J_STRING: decoded, NUL-terminated */
    size_t str_len;
    bool str_more;    /* the string was longer than SMP__JSON_STR_CAP */
} smp__jvalue;

typedef struct smp__json {
    const char *src;
    size_t n, pos;
    int depth;
    char msg[SMP__CFG_MSG_CAP]; /* the syntax error, once one is found */
} smp__json;

static bool smp__json_fail(smp__json *j, size_t at, const char *fmt, ...) SMP__PRINTF(3, 4);
static bool smp__json_fail(smp__json *j, size_t at, const char *fmt, ...) {
    int n = snprintf(j->msg, sizeof j->msg, "invalid config JSON at byte %zu: ", at);
    if (n > 0 && (size_t)n < sizeof j->msg) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(j->msg + n, sizeof j->msg - (size_t)n, fmt, ap);
        va_end(ap);
    }
    return false;
}

static const char *smp__cfg_found(const smp__json *j, size_t at, char *buf, size_t cap) {
    return smp__json_found(j->src, j->n, at, "input", buf, cap);
}

static void smp__cfg_ws(smp__json *j) { j->pos = smp__json_skip_ws(j->src, j->n, j->pos); }

/* Reads the string at j->pos (a '"'), decoding it into v (v may be NULL). */
static bool smp__cfg_string(smp__json *j, smp__jvalue *v) {
    smp__jstr d;
    memset(&d, 0, sizeof d);
    char why[160];
    if (v) { v->type = SMP__J_STRING; d.out = v->str; d.cap = SMP__JSON_STR_CAP; }
    bool ok = smp__json_string_at(j->src, j->n, &j->pos, &d, why, sizeof why);
    if (v) { v->str_len = d.len; v->str[d.len] = 0; v->str_more = d.more; }
    return ok ? true : smp__json_fail(j, j->pos, "%s", why);
}

static bool smp__json_value(smp__json *j, smp__jvalue *v);

/* Reads an object or array at j->pos. Nested values are checked, not kept;
   `member` (may be NULL) sees each key and value of this object itself. */
typedef void (*smp__json_member_fn)(const smp__jvalue *key, const smp__jvalue *value, void *ctx);
static bool smp__json_container(smp__json *j, bool object, smp__json_member_fn member, void *ctx) {
    char close = object ? '}' : ']', f[32];
    size_t open = j->pos;
    if (++j->depth > SMP__JSON_MAX_DEPTH)
        return smp__json_fail(j, open, "objects and arrays nested deeper than %d levels", SMP__JSON_MAX_DEPTH);
    j->pos++;
    smp__cfg_ws(j);
    if (j->src[j->pos] == close) { j->pos++; j->depth--; return true; }
    for (;;) {
        smp__jvalue key, value;
        if (object) {
            if (j->src[j->pos] != '"')
                return smp__json_fail(j, j->pos, "expected a key in double quotes, found %s%s",
                                      smp__cfg_found(j, j->pos, f, sizeof f),
                                      j->src[j->pos] == '\'' ? " (JSON strings take double quotes)" : "");
            if (!smp__cfg_string(j, &key)) return false;
            smp__cfg_ws(j);
            if (j->src[j->pos] != ':') {
                char q[128];
                smp__cfg_quote(q, sizeof q, key.str, key.str_len, key.str_more);
                return smp__json_fail(j, j->pos, "expected ':' after the key %s, found %s", q,
                                      smp__cfg_found(j, j->pos, f, sizeof f));
            }
            j->pos++;
            smp__cfg_ws(j);
        }
        if (!smp__json_value(j, member ? &value : NULL)) return false;
        if (member) member(&key, &value, ctx);
        smp__cfg_ws(j);
        if (j->src[j->pos] == ',') {
            size_t comma = j->pos++;
            smp__cfg_ws(j);
            if (j->src[j->pos] == close)
                return smp__json_fail(j, comma, "trailing comma before '%c'", close);
            continue;
        }
        if (j->src[j->pos] == close) { j->pos++; j->depth--; return true; }
        return smp__json_fail(j, j->pos, "expected ',' or '%c' in the %s opened at byte %zu, found %s", close,
                              object ? "object" : "array", open, smp__cfg_found(j, j->pos, f, sizeof f));
    }
}

/* Reads any value at j->pos; v (may be NULL) gets its type and contents. */
static bool smp__json_value(smp__json *j, smp__jvalue *v) {
    const char *p = j->src + j->pos;
    smp__jvalue scratch;
    char f[32];
    if (!v) v = &scratch;
    switch (*p) {
    case '"': return smp__cfg_string(j, v == &scratch ? NULL : v);
    case '{': v->type = SMP__J_OBJECT; return smp__json_container(j, true, NULL, NULL);
    case '[': v->type = SMP__J_ARRAY; return smp__json_container(j, false, NULL, NULL);
    case 't': if (strncmp(p, "true", 4) == 0) { v->type = SMP__J_TRUE; j->pos += 4; return true; } break;
    case 'f': if (strncmp(p, "false", 5) == 0) { v->type = SMP__J_FALSE; j->pos += 5; return true; } break;
    case 'n': if (strncmp(p, "null", 4) == 0) { v->type = SMP__J_NULL; j->pos += 4; return true; } break;
    default:
        if (*p == '-' || (*p >= '0' && *p <= '9')) {
            const char *why = NULL;
            size_t bad = 0, n = smp__json_scan_number(p, &why, &bad);
            if (n == 0) return smp__json_fail(j, j->pos + bad, "%s", why);
            v->type = SMP__J_NUMBER;
            v->num = p;
            v->num_len = n;
            j->pos += n;
            return true;
        }
        break;
    }
    const char *hint = "";
    if (strncmp(p, "True", 4) == 0 || strncmp(p, "False", 5) == 0 || strncmp(p, "None", 4) == 0)
        hint = " (JSON spells these true, false and null)";
    else if (*p == '\'')
        hint = " (JSON strings take double quotes)";
    return smp__json_fail(j, j->pos,
                          "expected a value (string, number, object, array, true, false or null), found %s%s",
                          smp__cfg_found(j, j->pos, f, sizeof f), hint);
}

/* "string \"2\"", "number 2.5", "true", "an object", ... for type errors. */
static const char *smp__jvalue_describe(const smp__jvalue *v, char *buf, size_t cap) {
    char q[128];
    switch (v->type) {
    case SMP__J_NULL: snprintf(buf, cap, "null"); break;
    case SMP__J_FALSE: snprintf(buf, cap, "false"); break;
    case SMP__J_TRUE: snprintf(buf, cap, "true"); break;
    case SMP__J_OBJECT: snprintf(buf, cap, "an object"); break;
    case SMP__J_ARRAY: snprintf(buf, cap, "an array"); break;
    case SMP__J_STRING:
        smp__cfg_quote(q, sizeof q, v->str, v->str_len, v->str_more);
        snprintf(buf, cap, "string %s", q);
        break;
    case SMP__J_NUMBER:
        if (v->num_len > 40) snprintf(buf, cap, "number %.40s...", v->num);
        else snprintf(buf, cap, "number %.*s", (int)v->num_len, v->num);
        break;
    }
    return buf;
}

/* Integer value of a number token within [lo, hi]. Returns 0 on success,
   1 when not integral, 2 when outside the range. */
static int smp__json_to_int(const char *tok, size_t len, long long lo, long long hi, long long *out) {
    bool neg;
    uint64_t mag;
    int r = smp__json_exact_int(tok, len, &neg, &mag);
    if (r) return r;
    if (mag > (uint64_t)LLONG_MAX) return 2; /* plenty for int */
    long long x = neg ? -(long long)mag : (long long)mag;
    if (x < lo || x > hi) return 2;
    *out = x;
    return 0;
}

/* Same for the 64-bit seed: 0 ok, 1 not integral, 2 out of range, 3 negative. */
static int smp__json_to_u64(const char *tok, size_t len, uint64_t *out) {
    bool neg;
    uint64_t mag;
    int r = smp__json_exact_int(tok, len, &neg, &mag);
    if (r == 1) return 1;
    if (neg && (r == 2 || mag != 0)) return 3;
    if (r == 2) return 2;
    *out = mag;
    return 0;
}

/* ------------------------------------------------------------ key lookup */
static int smp__cfg_find_key(const char *k, size_t len, bool more) {
    if (more) return -1;
    for (int i = 0; i < SMP__CFG_NKEYS; i++)
        if (strlen(smp__cfg_keys[i].name) == len && memcmp(smp__cfg_keys[i].name, k, len) == 0) return i;
    return -1;
}

static char smp__cfg_lower(char c) { return (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c; }

/* Edit distance (insert, delete, substitute, swap of neighbours), ignoring
   case, between a (any length) and b (a key name, shorter than 64). */
static int smp__cfg_distance(const char *a, size_t na, const char *b) {
    int rows[3][64];
    size_t nb = strlen(b);
    if (nb >= 64) return INT_MAX;
    int *pp = rows[0], *prev = rows[1], *cur = rows[2];
    for (size_t x = 0; x <= nb; x++) prev[x] = (int)x;
    for (size_t y = 1; y <= na; y++) {
        cur[0] = (int)y;
        for (size_t x = 1; x <= nb; x++) {
            int cost = smp__cfg_lower(a[y - 1]) != smp__cfg_lower(b[x - 1]);
            int best = prev[x] + 1;
            if (cur[x - 1] + 1 < best) best = cur[x - 1] + 1;
            if (prev[x - 1] + cost < best) best = prev[x - 1] + cost;
            if (y > 1 && x > 1 && smp__cfg_lower(a[y - 1]) == smp__cfg_lower(b[x - 2]) &&
                smp__cfg_lower(a[y - 2]) == smp__cfg_lower(b[x - 1]) && pp[x - 2] + 1 < best)
                best = pp[x - 2] + 1;
            cur[x] = best;
        }
        int *t = pp; pp = prev; prev = cur; cur = t;
    }
    return prev[nb];
}

/* The valid key nearest to an unknown one, or -1 when none is close: within
   1 + len/4 edits, or else the unknown key is a prefix of a valid one. */
static int smp__cfg_suggest(const char *k, size_t len) {
    int best = -1, best_d = INT_MAX;
    for (int i = 0; i < SMP__CFG_NKEYS; i++) {
        int d = smp__cfg_distance(k, len, smp__cfg_keys[i].name);
        if (d < best_d) { best_d = d; best = i; }
    }
    size_t nbest = best >= 0 ? strlen(smp__cfg_keys[best].name) : 0;
    size_t longer = len > nbest ? len : nbest;
    if (best >= 0 && (size_t)best_d <= 1 + longer / 4) return best;
    if (len >= 3)
        for (int i = 0; i < SMP__CFG_NKEYS; i++) {
            const char *name = smp__cfg_keys[i].name;
            size_t x = 0;
            while (x < len && name[x] && smp__cfg_lower(k[x]) == name[x]) x++;
            if (x == len) return i;
        }
    return -1;
}

static void smp__cfg_unknown_key(const smp__jvalue *key, char *msg, size_t cap) {
    char q[128];
    smp__cfg_quote(q, sizeof q, key->str, key->str_len, key->str_more);
    snprintf(msg, cap, "unknown config key %s", q);
    /* names SageMaker users may bring along */
    if (!key->str_more && (strcmp(key->str, "parameters") == 0 || strcmp(key->str, "enabled") == 0 ||
                           strcmp(key->str, "modelparallel") == 0)) {
        smp__cfg_appendf(msg, cap, " (give smp the contents of SageMaker's \"parameters\" object, "
                                   "e.g. {\"partitions\": 2, \"microbatches\": 4})");
        return;
    }
    int s = key->str_more ? -1 : smp__cfg_suggest(key->str, key->str_len);
    if (s >= 0) {
        smp__cfg_appendf(msg, cap, " (did you mean \"%s\"?)", smp__cfg_keys[s].name);
        return;
    }
    smp__cfg_appendf(msg, cap, " (the keys are");
    for (int i = 0; i < SMP__CFG_NKEYS; i++) smp__cfg_appendf(msg, cap, "%s %s", i ? "," : ":", smp__cfg_keys[i].name);
    smp__cfg_appendf(msg, cap, ")");
}

/* '"interleaved" or "simple"' */
static void smp__cfg_enum_list(const char *const *names, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = 0;
    while (names[n]) n++;
    for (size_t i = 0; i < n; i++)
        smp__cfg_appendf(buf, cap, "%s\"%s\"", i == 0 ? "" : i + 1 == n ? (n > 2 ? ", or " : " or ") : ", ", names[i]);
}

/* Stores one member's value into cfg. On a wrong value writes msg and
   returns false. */
static bool smp__cfg_apply(int id, const smp__jvalue *v, smp_config *cfg, char *msg, size_t cap) {
    const struct smp__cfg_key *key = &smp__cfg_keys[id];
    const char *name = key->name;
    char got[160], list[160];
    smp__jvalue_describe(v, got, sizeof got);
    switch (key->kind) {
    case SMP__CFG_KIND_BOOL:
        if (v->type != SMP__J_TRUE && v->type != SMP__J_FALSE) {
            snprintf(msg, cap, "config key \"%s\" must be true or false, got %s", name, got);
            return false;
        }
        smp__cfg_set_int(cfg, key, v->type == SMP__J_TRUE ? SMP_ON : SMP_OFF);
        return true;
    case SMP__CFG_KIND_ENUM: {
        smp__cfg_enum_list(key->values, list, sizeof list);
        if (v->type != SMP__J_STRING) {
            snprintf(msg, cap, "config key \"%s\" must be the string %s, got %s", name, list, got);
            return false;
        }
        int value = 0;
        for (int i = 0; key->values[i]; i++)
            if (!v->str_more && strlen(key->values[i]) == v->str_len && memcmp(key->values[i], v->str, v->str_len) == 0)
                value = i + 1;
        if (value == 0) {
            char q[128];
            smp__cfg_quote(q, sizeof q, v->str, v->str_len, v->str_more);
            snprintf(msg, cap, "config key \"%s\" must be %s, got %s", name, list, q);
            return false;
        }
        smp__cfg_set_int(cfg, key, value);
        return true;
    }
    case SMP__CFG_KIND_COUNT:
    case SMP__CFG_KIND_LIMIT:
    case SMP__CFG_KIND_INDEX: {
        long long x = 0;
        int r = v->type == SMP__J_NUMBER ? smp__json_to_int(v->num, v->num_len, INT_MIN, INT_MAX, &x) : 1;
        if (r) {
            snprintf(msg, cap, "config key \"%s\" must be an integer%s, got %s", name,
                     r == 2 ? " within int range" : "", got);
            return false;
        }
        if (key->kind == SMP__CFG_KIND_COUNT && x < 1) {
            snprintf(msg, cap, "config key \"%s\" must be at least 1, got %lld", name, x);
            return false;
        }
        if (key->kind == SMP__CFG_KIND_LIMIT && x < 0) {
            snprintf(msg, cap, "config key \"%s\" must be at least 1, or 0 for no limit, got %lld", name, x);
            return false;
        }
        smp__cfg_set_int(cfg, key, (int)x);
        if (key->kind == SMP__CFG_KIND_INDEX) cfg->has_default_partition = true;
        return true;
    }
    case SMP__CFG_KIND_SEED: {
        uint64_t x = 0;
        int r = v->type == SMP__J_NUMBER ? smp__json_to_u64(v->num, v->num_len, &x) : 1;
        if (r != 0) {
            snprintf(msg, cap, "config key \"%s\" must be a non-negative integer%s, got %s", name,
                     r == 2 ? " below 2^64" : "", got);
            return false;
        }
        cfg->seed = x;
        return true;
    }
    case SMP__CFG_KIND_WEIGHT:
    case SMP__CFG_KIND_POSITIVE: {
        double d = 0;
        if (v->type != SMP__J_NUMBER) {
            snprintf(msg, cap, "config key \"%s\" must be a number, got %s", name, got);
            return false;
        }
        if (v->num_len > SMP__JSON_NUM_CAP) {
            snprintf(msg, cap, "config key \"%s\" takes numbers of at most %d characters, got one of %zu", name,
                     SMP__JSON_NUM_CAP, v->num_len);
            return false;
        }
        if (!smp__cfg_strtod(v->num, v->num_len, &d) || !isfinite(d)) {
            snprintf(msg, cap, "config key \"%s\" must be a finite number, got %s", name, got);
            return false;
        }
        /* 0 means "default" in the struct, so JSON cannot ask for it */
        if (key->kind == SMP__CFG_KIND_POSITIVE && !(d > 0)) {
            snprintf(msg, cap, "config key \"%s\" must be a positive number, got %s", name, got);
            return false;
        }
        memcpy((char *)cfg + key->field, &d, sizeof d);
        if (key->kind == SMP__CFG_KIND_WEIGHT) cfg->has_memory_weight = true;
        return true;
    }
    }
    return true;
}

/* Applies one top-level member to the config being built; after the first
   key error the rest are only read (a syntax error later still wins). */
typedef struct smp__cfg_build {
    smp_config cfg;
    uint32_t seen;              /* keys given, by index */
    char sem[SMP__CFG_MSG_CAP]; /* the first key error */
} smp__cfg_build;

static void smp__cfg_member(const smp__jvalue *key, const smp__jvalue *val, void *ctx) {
    smp__cfg_build *b = (smp__cfg_build *)ctx;
    if (b->sem[0]) return;
    int id = smp__cfg_find_key(key->str, key->str_len, key->str_more);
    if (id < 0) {
        smp__cfg_unknown_key(key, b->sem, sizeof b->sem);
    } else if (b->seen & (1u << id)) {
        char got[160];
        snprintf(b->sem, sizeof b->sem, "config key \"%s\" appears twice (the second time with %s)",
                 smp__cfg_keys[id].name, smp__jvalue_describe(val, got, sizeof got));
    } else {
        b->seen |= 1u << id;
        smp__cfg_apply(id, val, &b->cfg, b->sem, sizeof b->sem);
    }
}

SMPDEF smp_status smp_config_from_json(const char *json, smp_config *cfg) {
    if (!json || !cfg) return smp_error(SMP_ERR_ARG, "smp_config_from_json: %s is NULL", json ? "cfg" : "json");
    smp__json j;
    memset(&j, 0, sizeof j);
    j.src = json;
    j.n = strlen(json);
    smp__cfg_build b;
    memset(&b, 0, sizeof b);
    b.cfg = *cfg;
    char f[32];

    smp__cfg_ws(&j);
    if (json[j.pos] != '{') {
        smp__json_fail(&j, j.pos, "the top level must be an object ({\"partitions\": 2, ...}), found %s",
                       json[j.pos] == '[' ? "an array" : smp__cfg_found(&j, j.pos, f, sizeof f));
        return smp_error(SMP_ERR_CONFIG, "%s", j.msg);
    }
    if (!smp__json_container(&j, true, smp__cfg_member, &b)) return smp_error(SMP_ERR_CONFIG, "%s", j.msg);
    smp__cfg_ws(&j);
    if (json[j.pos] != 0) {
        smp__json_fail(&j, j.pos, "unexpected %s after the top-level object", smp__cfg_found(&j, j.pos, f, sizeof f));
        return smp_error(SMP_ERR_CONFIG, "%s", j.msg);
    }
    if (b.sem[0]) return smp_error(SMP_ERR_CONFIG, "%s", b.sem);
    *cfg = b.cfg;
    return SMP_OK;
}

/* ------------------------------------------------------------ resolve */
/* An enum or switch field: a value it names, or 0 for its default. The
   counts: 0 means 1. */
static smp_status smp__cfg_resolve_key(smp_config *c, const struct smp__cfg_key *key) {
    int v = smp__cfg_int(c, key);
    switch (key->kind) {
    case SMP__CFG_KIND_ENUM: {
        int count = 0;
        while (key->values[count]) count++;
        if (v < 0 || v > count)
            return smp_error(SMP_ERR_CONFIG, "config key \"%s\" has invalid value %d (use %s, or 0 for the default)",
                             key->name, v, key->spelled);
        break;
    }
    case SMP__CFG_KIND_BOOL:
        if (v != SMP_DEFAULT && v != SMP_ON && v != SMP_OFF)
            return smp_error(SMP_ERR_CONFIG,
                             "config key \"%s\" has invalid value %d (use SMP_ON, SMP_OFF, or SMP_DEFAULT (0))",
                             key->name, v);
        break;
    case SMP__CFG_KIND_COUNT:
        if (v < 0) return smp_error(SMP_ERR_CONFIG, "config key \"%s\" must be at least 1, got %d", key->name, v);
        smp__cfg_set_int(c, key, v == 0 ? (key->dflt ? key->dflt : 1) : v); /* 1 unless its row says */
        return SMP_OK;
    case SMP__CFG_KIND_LIMIT:
        if (v < 0)
            return smp_error(SMP_ERR_CONFIG, "config key \"%s\" must be at least 1, or 0 for no limit, got %d",
                             key->name, v);
        return SMP_OK;
    default:
        return SMP_OK;
    }
    if (v == 0) smp__cfg_set_int(c, key, key->dflt);
    return SMP_OK;
}

/* Reads SMP_TIMEOUT: a plain decimal number of seconds, > 0. *found is false when unset or empty. */
static smp_status smp__cfg_env_timeout(double *out, bool *found) {
    const char *e = getenv("SMP_TIMEOUT");
    *found = false;
    if (!e || !e[0]) return SMP_OK;
    char q[128];
    const char *s = e, *why = NULL;
    size_t bad = 0, n;
    double d = 0;
    while (*s == ' ' || *s == '\t') s++;
    n = *s ? smp__json_scan_number(s, &why, &bad) : 0;
    const char *rest = s + n;
    while (n && (*rest == ' ' || *rest == '\t')) rest++;
    if (n == 0 || *rest != 0 || !smp__cfg_strtod(s, n, &d) || !isfinite(d) || !(d > 0) || d > SMP__CFG_MAX_TIMEOUT) {
        smp__cfg_quote(q, sizeof q, e, strlen(e), false);
        return smp_error(SMP_ERR_CONFIG, "SMP_TIMEOUT = %s is not a positive number of seconds (at most %g)", q,
                         SMP__CFG_MAX_TIMEOUT);
    }
    *out = d;
    *found = true;
    return SMP_OK;
}

SMP__CORE smp_status smp_config_resolve(const smp_config *in, int world_size, smp_config *out) {
    if (!in || !out) return smp_error(SMP_ERR_ARG, "smp_config_resolve: %s is NULL", in ? "out" : "in");
    if (world_size < 1) return smp_error(SMP_ERR_ARG, "smp_config_resolve: world size %d is not positive", world_size);
    smp_config c = *in;

    /* one setting under two names: SageMaker's PyTorch name wins where only it is set */
    if (c.partitions > 0 && c.pipeline_parallel_degree > 0 && c.partitions != c.pipeline_parallel_degree)
        return smp_error(
            SMP_ERR_CONFIG,
            "config keys \"partitions\" (%d) and \"pipeline_parallel_degree\" (%d) disagree: they are "
            "one setting (SageMaker's PyTorch name for partitions); give one of them, or the same value to both",
            c.partitions, c.pipeline_parallel_degree);
    if (c.partitions == 0) c.partitions = c.pipeline_parallel_degree;

    /* enums, switches and counts first: everything below reads them */
    for (int i = 0; i < SMP__CFG_NKEYS; i++) SMP_TRY(smp__cfg_resolve_key(&c, &smp__cfg_keys[i]));
    c.pipeline_parallel_degree = c.partitions;

    /* partitions x tensor_parallel_degree against the world */
    int tp = c.tensor_parallel_degree;
    long long mp = (long long)c.partitions * tp;
    if (tp == 1 && c.partitions > world_size)
        return smp_error(SMP_ERR_CONFIG, "partitions = %d needs at least %d ranks, but the world size is %d",
                         c.partitions, c.partitions, world_size);
    if (tp == 1 && world_size % c.partitions != 0)
        return smp_error(SMP_ERR_CONFIG, "partitions = %d does not divide the world size %d", c.partitions, world_size);
    if (tp > 1 && (mp > world_size || world_size % mp != 0))
        return smp_error(
            SMP_ERR_CONFIG,
            "partitions (pipeline_parallel_degree) = %d x tensor_parallel_degree = %d makes %lld ranks "
            "a model replica, which does not divide the world size %d: run a multiple of %lld ranks, or change "
            "the degrees",
            c.partitions, tp, mp, world_size, mp);
    char times_tp[48] = "";
    if (tp > 1) snprintf(times_tp, sizeof times_tp, " x tensor_parallel_degree = %d", tp);
    if (world_size > mp && c.ddp != SMP_ON)
        return smp_error(SMP_ERR_CONFIG,
                         "a world of %d ranks with partitions = %d%s makes %lld model replicas, which needs data "
                         "parallelism: set \"ddp\": true (ddp is off)",
                         world_size, c.partitions, times_tp, world_size / mp);

    /* a value set without its flag would be dropped without a word */
    if (!c.has_default_partition && c.default_partition != 0)
        return smp_error(SMP_ERR_CONFIG,
                         "default_partition = %d is set but has_default_partition is false: set "
                         "has_default_partition = true (0 is a partition, so smp cannot tell it from unset)",
                         c.default_partition);
    if (!c.has_memory_weight && c.memory_weight != 0)
        return smp_error(SMP_ERR_CONFIG,
                         "memory_weight = %g is set but has_memory_weight is false: set has_memory_weight = "
                         "true (0 is a weight, so smp cannot tell it from unset)",
                         c.memory_weight);
    if (c.has_default_partition && (c.default_partition < 0 || c.default_partition >= c.partitions))
        return smp_error(SMP_ERR_CONFIG,
                         "config key \"default_partition\" = %d is not a partition (partitions = %d: use 0 to %d)",
                         c.default_partition, c.partitions, c.partitions - 1);

    if (isnan(c.memory_weight) || c.memory_weight < 0 || c.memory_weight > 1)
        return smp_error(SMP_ERR_CONFIG, "config key \"memory_weight\" must be between 0 and 1, got %g",
                         c.memory_weight);
    if (!c.has_memory_weight) c.memory_weight = c.optimize == SMP_OPTIMIZE_MEMORY ? 1.0 : 0.0;
    c.has_memory_weight = true;

    if (isnan(c.bucket_cap_mb) || c.bucket_cap_mb < 0 || c.bucket_cap_mb > SMP__CFG_MAX_BUCKET_MB)
        return smp_error(SMP_ERR_CONFIG,
                         "config key \"bucket_cap_mb\" must be a positive number of MB up to %g, got %g",
                         SMP__CFG_MAX_BUCKET_MB, c.bucket_cap_mb);
    if (c.bucket_cap_mb == 0) c.bucket_cap_mb = SMP__CFG_DEFAULT_BUCKET_MB;

    /* a replica is partitions x tp ranks: the TP ranks of one replica hold different shards, not copies */
    if (c.shard_optimizer_state == SMP_ON && (c.ddp != SMP_ON || world_size / mp < 2))
        return smp_error(
            SMP_ERR_CONFIG,
            "config key \"shard_optimizer_state\" shards the optimizer state across data-parallel replicas, "
            "but %s: set \"ddp\": true and run on at least %lld ranks (2 replicas of %d partition%s%s), or leave "
            "shard_optimizer_state off",
            c.ddp != SMP_ON ? "ddp is off" : "there is one replica", 2 * mp, c.partitions,
            c.partitions == 1 ? "" : "s", times_tp);
    if (c.pipeline == SMP_PIPELINE_ZERO_BUBBLE_V && c.virtual_stages > 2)
        return smp_error(SMP_ERR_CONFIG,
                         "config key \"virtual_stages\" is %d, but pipeline \"zero_bubble_v\" runs exactly 2 stages "
                         "per partition (its V): leave virtual_stages at 1 or 2",
                         c.virtual_stages);

    if (!isfinite(c.timeout) || c.timeout < 0 || c.timeout > SMP__CFG_MAX_TIMEOUT)
        return smp_error(SMP_ERR_CONFIG, "config key \"timeout\" must be a positive number of seconds up to %g, got %g",
                         SMP__CFG_MAX_TIMEOUT, c.timeout);
    if (c.timeout == 0) {
        bool found = false;
        SMP_TRY(smp__cfg_env_timeout(&c.timeout, &found));
        if (!found) c.timeout = SMP__CFG_DEFAULT_TIMEOUT;
    }

    *out = c;
    return SMP_OK;
}

/* ---------------------------------------------------------------- waiting */
SMPDEF double smp_timeout(void) {
    if (smp__ctx.initialized) return smp__ctx.cfg.timeout;
    double t = 600; /* before init: SMP_TIMEOUT when it is valid (smp_init reports it when not) */
    bool found;
    char saved[sizeof smp__errbuf];
    memcpy(saved, smp__errbuf, sizeof saved);
    if (smp__cfg_env_timeout(&t, &found) != SMP_OK) t = 600;
    memcpy(smp__errbuf, saved, sizeof saved);
    return t;
}

static double smp__now(void) { return MPI_Wtime(); }

/* Sleeping is POSIX; a strict -std=c11 build gets C11's thrd_sleep instead. */
static void smp__sleep_ns(long ns) {
    struct timespec ts = {0, ns};
#if defined(_POSIX_C_SOURCE) || defined(__cplusplus)
    nanosleep(&ts, NULL);
#else
    thrd_sleep(&ts, NULL);
#endif
}

/* Polling with back-off: spin briefly (latency), then yield (ranks sharing a
   core get their turn), then sleep in growing steps up to a millisecond.
   MPI moves data only inside MPI calls (MPICH runs no progress thread), so
   a rank asleep stalls its transfer and its peers': a large all_reduce is a
   few hundred steps, each a poll that copies or reduces a chunk, and a sleep
   between steps adds straight to the time. A poll that itself took long
   (SMP__BUSY_POLL) did such work, so it starts the back-off over: a rank
   sleeps only once nothing has moved for 2 ms. */
#define SMP__BUSY_POLL 5e-6
typedef struct smp__backoff { double start, deadline, quiet_since, last; unsigned polls; long sleep_ns; } smp__backoff;

static smp__backoff smp__backoff_start(void) {
    smp__backoff b;
    b.start = b.quiet_since = b.last = smp__now();
    b.deadline = b.start + smp_timeout();
    b.polls = 0;
    b.sleep_ns = 1000;
    return b;
}

/* Called after each poll; returns false once the deadline has passed. */
static bool smp__backoff_pause(smp__backoff *b) {
    b->polls++;
    if (b->polls < 64) return true;
    double now = smp__now();
    if (now > b->deadline) return false;
    if (b->polls > 64 && now - b->last > SMP__BUSY_POLL) { /* the poll since the last pause moved data */
        b->quiet_since = now;
        b->sleep_ns = 1000;
    }
    double quiet = now - b->quiet_since;
    if (quiet < 2e-3) sched_yield();
    else {
        /* a sleep delays noticing the message by up to its length: keep that
           within 2% of the time already waited (a pipeline's critical path
           is a chain of such waits), between 50 us and 1 ms */
        long cap = (long)(quiet * 0.01 * 1e9);
        cap = cap < 20000 ? 20000 : cap > 1000000 ? 1000000 : cap;
        b->sleep_ns = b->sleep_ns * 2 < cap ? b->sleep_ns * 2 : cap;
        smp__sleep_ns(b->sleep_ns);
    }
    b->last = smp__now();
    return true;
}

SMP__CORE int smp_group_world_rank(smp_group g, int group_rank); /* a test hook (SMP_TESTING) the waits use */

static const char *smp__group_name(smp_group g) {
    static const char *const names[SMP_GROUP_COUNT] = {"world",    "MP_GROUP", "DP_GROUP",
                                                       "PP_GROUP", "TP_GROUP", "RDP_GROUP"};
    return (unsigned)g < SMP_GROUP_COUNT ? names[g] : "?";
}

static const char *smp__rank_host(int rank);
static void smp__timeout_abort(const char *what, smp_group g, int peer, double waited) {
    if (peer >= 0) {
        int w = smp_group_world_rank(g, peer);
        smp__fatal("timed out after %.1f s waiting for %s from %s rank %d (world rank %d on host %s); aborting the job "
                   "(SMP_TIMEOUT=%g)",
                   waited, what, smp__group_name(g), peer, w, smp__rank_host(w), smp_timeout());
    }
    /* MPI cannot say which member of a collective has not arrived: name the
       others and their hosts (the first 8) */
    char others[640] = "";
    size_t at = 0;
    int n = smp_group_size(g), named = 0;
    for (int i = 0; i < n && at < sizeof others; i++) {
        int w = smp_group_world_rank(g, i);
        if (w == smp__ctx.rank) continue;
        if (named == 8) {
            at += (size_t)snprintf(others + at, sizeof others - at, ", and %d more", n - 1 - named);
            break;
        }
        at += (size_t)snprintf(others + at, sizeof others - at, "%s%d on %s", named ? ", " : "", w, smp__rank_host(w));
        named++;
    }
    smp__fatal("timed out after %.1f s waiting for %s in %s (with world rank%s %s); aborting the job (SMP_TIMEOUT=%g)",
               waited, what, smp__group_name(g), named == 1 ? "" : "s", others, smp_timeout());
}

/* A collective that fails on one member (bad arguments, out of memory)
   would leave the others waiting until SMP_TIMEOUT. So the failing member
   sends each other member the collective's number in the group and its
   error, and a member that waits in that collective aborts the job with
   the message at once. Where every member fails the same call, nobody
   waits and the messages are dropped as stale. */
#define SMP__TAG_FAILED 7002
typedef struct smp__failure_send { MPI_Request req; char *buf; } smp__failure_send;
static struct { smp__failure_send *sends; int n, cap; } smp__failures; /* in flight */

static smp__group_info *smp__group(smp_group g);
static char *smp__strdup(const char *s);

static void smp__member_failed(smp_group g, int rank, const char *error) {
    if (g == SMP_WORLD)
        smp__fatal("world rank %d failed the collective this rank waits in: %s; aborting the job", rank, error);
    smp__fatal("%s rank %d (world rank %d) failed the collective this rank waits in: %s; aborting the job",
               smp__group_name(g), rank, smp_group_world_rank(g, rank), error);
}

static void smp__check_member_failed(smp__group_info *gi, smp_group g) {
    if (gi->failed_ahead && gi->failed_ahead < gi->coll_seq) { /* that one failed here too, or passed */
        smp__free(gi->failed_ahead_msg);
        gi->failed_ahead_msg = NULL;
        gi->failed_ahead = 0;
    }
    for (;;) {
        int found = 0;
        MPI_Status status;
        SMP__MPI_FATAL(MPI_Iprobe(MPI_ANY_SOURCE, SMP__TAG_FAILED, gi->notices, &found, &status),
                       "looking for failure notices in %s", smp__group_name(g));
        if (!found) break;
        int len;
        SMP__MPI_FATAL(MPI_Get_count(&status, MPI_BYTE, &len), "sizing a failure notice in %s", smp__group_name(g));
        char msg[8 + sizeof smp__errbuf];
        if (len < 8 || len > (int)sizeof msg - 1)
            smp__fatal("a malformed failure message (%d bytes) in %s", len, smp__group_name(g));
        SMP__MPI_FATAL(MPI_Recv(msg, len, MPI_BYTE, status.MPI_SOURCE, SMP__TAG_FAILED, gi->notices, MPI_STATUS_IGNORE),
                       "receiving a failure notice from %s rank %d", smp__group_name(g), status.MPI_SOURCE);
        msg[len] = 0;
        unsigned long long seq;
        memcpy(&seq, msg, 8);
        if (seq == gi->coll_seq && gi->in_coll) smp__member_failed(g, status.MPI_SOURCE, msg + 8);
        if (seq > gi->coll_seq && !gi->failed_ahead) { /* this rank gets there later */
            gi->failed_ahead = seq;
            gi->failed_ahead_rank = status.MPI_SOURCE;
            gi->failed_ahead_msg = smp__strdup(msg + 8);
        }
    }
    if (gi->in_coll && gi->failed_ahead == gi->coll_seq)
        smp__member_failed(g, gi->failed_ahead_rank, gi->failed_ahead_msg);
}

static smp__group_info *smp__coll_enter(smp_group g) {
    smp__group_info *gi = smp__ctx.initialized ? smp__group(g) : NULL;
    if (gi) {
        gi->coll_seq++;
        gi->in_coll = true;
    }
    return gi;
}

/* Completes the failure messages in flight (cancel: those nobody received). */
static void smp__failures_reap(bool cancel) {
    int kept = 0;
    for (int i = 0; i < smp__failures.n; i++) {
        smp__failure_send *f = &smp__failures.sends[i];
        int done = 0;
        SMP__MPI_FATAL(MPI_Test(&f->req, &done, MPI_STATUS_IGNORE), "completing a failure notice sent to a peer");
        if (!done && cancel) {
            SMP__MPI_WARN(MPI_Cancel(&f->req), "withdrawing a failure notice nobody received");
            SMP__MPI_WARN(MPI_Wait(&f->req, MPI_STATUS_IGNORE), "withdrawing a failure notice nobody received");
        }
        if (done || cancel) smp__free(f->buf);
        else smp__failures.sends[kept++] = *f;
    }
    smp__failures.n = kept;
}

/* Sends dest `head` followed by this rank's error message, tracked until
   it completes; false when out of memory (dest then falls back on the
   timeout). */
static bool smp__send_failure(const void *head, size_t head_len, int dest, int tag, MPI_Comm comm) {
    size_t len = strlen(smp__errbuf);
    char *buf = (char *)smp__alloc(head_len + len + 1, SMP__ALLOC_OTHER);
    if (!buf || !smp__grow((void **)&smp__failures.sends, &smp__failures.cap, smp__failures.n + 1,
                           sizeof(smp__failure_send), NULL)) {
        smp__free(buf);
        return false;
    }
    if (head_len) memcpy(buf, head, head_len);
    memcpy(buf + head_len, smp__errbuf, len);
    smp__failure_send *f = &smp__failures.sends[smp__failures.n++];
    f->buf = buf;
    /* the peer would wait for what this rank cannot do until SMP_TIMEOUT: stop the job now instead */
    SMP__MPI_FATAL(MPI_Isend(buf, (int)(head_len + len), MPI_BYTE, dest, tag, comm, &f->req),
                   "sending rank %d the failure \"%s\"", dest, smp__errbuf);
    return true;
}

static smp_status smp__coll_exit(smp__group_info *gi, smp_group g, smp_status st) {
    if (!gi) return st;
    gi->in_coll = false;
    if (!st) return st;
    smp__check_member_failed(gi, g); /* drops the messages of failures this rank shared */
    smp__failures_reap(false);
    for (int r = 0; r < gi->size; r++)
        if (r != gi->rank && !smp__send_failure(&gi->coll_seq, 8, r, SMP__TAG_FAILED, gi->notices)) break;
    return st;
}
/* A host collective's public entry: `call` runs between smp__coll_enter
   and smp__coll_exit, so a failure on this rank reaches the other members.
   Over TP_GROUP in a step it starts with the TP handshake (smp__tp_handshake
   below), so a TP peer whose step failed before it fails it here too. */
static smp_status smp__tp_coll_handshake(smp_group g);
#define SMP__COLLECTIVE(g, call) \
    SMP_TRY(smp__tp_coll_handshake(g)); \
    smp__group_info *smp_member_ = smp__coll_enter(g); \
    return smp__coll_exit(smp_member_, (g), (call))

SMPDEF void smp_wait_requests(int n, MPI_Request *reqs, const char *what, smp_group g, int peer) {
    smp__backoff b = smp__backoff_start();
    smp__group_info *gi = smp__ctx.initialized ? smp__group(g) : NULL;
    for (;;) {
        int all = 1;
        for (int i = 0; i < n && all; i += 16) { /* real status arrays: gcc flags MPI_STATUSES_IGNORE */
            MPI_Status statuses[16];
            int k = n - i < 16 ? n - i : 16;
            /* MPI_Test for one: MPICH 4.0's MPI_Testall fails on a started persistent collective */
            int rc = k == 1 ? MPI_Test(reqs + i, &all, statuses) : MPI_Testall(k, reqs + i, &all, statuses);
            if (rc != MPI_SUCCESS) /* (a variadic call per poll costs more than the poll's own work) */
                (void)smp__mpi_failed(SMP__MPI_ABORT, rc, k == 1 ? "MPI_Test" : "MPI_Testall", "waiting for %s", what);
        }
        if (all) return;
        /* past the spin: has a member failed the collective this rank waits in? */
        if (gi && gi->in_coll && b.polls >= 64 && b.polls % 16 == 0) smp__check_member_failed(gi, g);
        if (!smp__backoff_pause(&b)) smp__timeout_abort(what, g, peer, smp__now() - b.start);
    }
}

/* The least and greatest over comm of each of n values, to see whether every
   rank passed the same. The others wait in it: a rank that fails here stops
   the job. */
static void smp__min_max(MPI_Comm comm, const uint64_t *v, int n, uint64_t *lo, uint64_t *hi, const char *what,
                         smp_group g) {
    MPI_Request r[2];
    SMP__MPI_FATAL(MPI_Iallreduce(v, lo, n, MPI_UINT64_T, MPI_MIN, comm, &r[0]), "comparing %s", what);
    SMP__MPI_FATAL(MPI_Iallreduce(v, hi, n, MPI_UINT64_T, MPI_MAX, comm, &r[1]), "comparing %s", what);
    smp_wait_requests(2, r, what, g, -1);
}

/* ---------------------------------------------------------------- topology */
/* Each placement's letters, left to right; the right-most varies fastest over the world's ranks. */
static const char *smp__placement_letters(smp_placement p) {
    static const char *const letters[] = {"DPT", "DPT", "TPD", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD"};
    return (unsigned)p < sizeof letters / sizeof letters[0] ? letters[p] : "DPT";
}

SMPDEF smp_coords smp_topology_of(int rank, int size, int pp, int tp, smp_placement placement) {
    int rdp = size / (pp * tp), coord[3] = {0, 0, 0}; /* D, P, T */
    const char *letters = smp__placement_letters(placement);
    for (int i = 2; i >= 0; i--) {
        int which = letters[i] == 'D' ? 0 : letters[i] == 'P' ? 1 : 2, degree = which == 0 ? rdp : which == 1 ? pp : tp;
        coord[which] = rank % degree;
        rank /= degree;
    }
    smp_coords c;
    c.rdp_rank = coord[0];
    c.pp_rank = coord[1];
    c.tp_rank = coord[2];
    c.mp_rank = c.pp_rank * tp + c.tp_rank;
    c.dp_rank = c.rdp_rank * tp + c.tp_rank;
    return c;
}

SMPDEF int smp_rank(void) { return smp__ctx.rank; }
SMPDEF int smp_size(void) { return smp__ctx.size; }
SMPDEF int smp_local_rank(void) { return smp__ctx.local_rank; }
SMPDEF int smp_local_size(void) { return smp__ctx.local_size; }
SMPDEF int smp_mp_rank(void) { return smp__ctx.mp_rank; }
SMPDEF int smp_mp_size(void) {
    return smp__ctx.initialized ? smp__ctx.cfg.partitions * smp__ctx.cfg.tensor_parallel_degree : 1;
}
SMPDEF int smp_dp_rank(void) { return smp__ctx.dp_rank; }
SMPDEF int smp_dp_size(void) { return smp__ctx.initialized ? smp__ctx.size / smp__ctx.cfg.partitions : 1; }
SMPDEF int smp_pp_rank(void) { return smp__ctx.pp_rank; }
SMPDEF int smp_pp_size(void) { return smp__ctx.initialized ? smp__ctx.cfg.partitions : 1; }
SMPDEF int smp_tp_rank(void) { return smp__ctx.tp_rank; }
SMPDEF int smp_tp_size(void) { return smp__ctx.initialized ? smp__ctx.cfg.tensor_parallel_degree : 1; }
SMPDEF int smp_rdp_rank(void) { return smp__ctx.rdp_rank; }
SMPDEF int smp_rdp_size(void) { return smp__ctx.initialized ? smp_dp_size() / smp__ctx.cfg.tensor_parallel_degree : 1; }
SMPDEF bool smp_is_initialized(void) { return smp__ctx.initialized; }
SMPDEF const smp_config *smp_current_config(void) { return &smp__ctx.cfg; }

static smp__group_info *smp__group(smp_group g) {
    if ((unsigned)g >= SMP_GROUP_COUNT || !smp__ctx.initialized) return NULL;
    return &smp__ctx.groups[g];
}
SMPDEF int smp_group_rank(smp_group g) { smp__group_info *gi = smp__group(g); return gi ? gi->rank : -1; }
SMPDEF int smp_group_size(smp_group g) { smp__group_info *gi = smp__group(g); return gi ? gi->size : 0; }
SMPDEF MPI_Comm smp_group_comm(smp_group g) {
    smp__group_info *gi = smp__group(g);
    return gi ? gi->comm : MPI_COMM_NULL;
}
SMP__CORE int smp_group_ranks(smp_group g, int *world_ranks, int cap) {
    smp__group_info *gi = smp__group(g);
    if (!gi) return 0;
    for (int i = 0; i < gi->size && i < cap; i++) world_ranks[i] = gi->world_ranks[i];
    return gi->size;
}
SMP__CORE int smp_group_world_rank(smp_group g, int group_rank) {
    smp__group_info *gi = smp__group(g);
    return gi && group_rank >= 0 && group_rank < gi->size ? gi->world_ranks[group_rank] : -1;
}
/* The host world rank `rank` runs on (MPI_Get_processor_name, gathered at
   smp_init); "" before smp_init or for a rank outside the world. */
static const char *smp__rank_host(int rank) {
    if (!smp__ctx.initialized || !smp__ctx.hosts || rank < 0 || rank >= smp__ctx.size) return "";
    return smp__ctx.hosts + smp__ctx.host_at[rank];
}

/* Every rank's host name, gathered once at init, so that a message about a
   peer can say where it runs (the peer may be gone by then). */
static void smp__gather_hosts(void) {
    char name[MPI_MAX_PROCESSOR_NAME + 1];
    int len = 0, n = smp__ctx.size;
    memset(name, 0, sizeof name);
    SMP__MPI_FATAL(MPI_Get_processor_name(name, &len), "naming this rank's host at smp_init");
    len++; /* the NUL */
    int *lens = (int *)smp__alloc(sizeof(int) * 2 * (size_t)n, SMP__ALLOC_OTHER);
    int ok = lens != NULL, all_ok = 0;
    SMP__MPI_FATAL(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_LAND, smp__ctx.world),
                   "agreeing on memory for host names at smp_init (world)");
    if (!all_ok) { smp__free(lens); return; } /* messages then name no host */
    SMP__MPI_FATAL(MPI_Allgather(&len, 1, MPI_INT, lens, 1, MPI_INT, smp__ctx.world),
                   "gathering host name lengths at smp_init (world)");
    int *at = lens + n;
    size_t total = 0;
    for (int i = 0; i < n; i++) { at[i] = (int)total; total += (size_t)lens[i]; }
    char *hosts = (char *)smp__alloc(total, SMP__ALLOC_OTHER);
    ok = hosts != NULL;
    SMP__MPI_FATAL(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_LAND, smp__ctx.world),
                   "agreeing on memory for host names at smp_init (world)");
    if (!all_ok) { smp__free(hosts); smp__free(lens); return; }
    SMP__MPI_FATAL(MPI_Allgatherv(name, len, MPI_CHAR, hosts, lens, at, MPI_CHAR, smp__ctx.world),
                   "gathering host names at smp_init (world)");
    /* lens is no longer needed, at is: keep the block, offsets in its second half */
    memmove(lens, at, sizeof(int) * (size_t)n);
    smp__ctx.hosts = hosts;
    smp__ctx.host_at = lens;
}

/* gi->world_ranks is allocated already (smp_init agrees on that memory). */
static void smp__make_group(smp__group_info *gi, MPI_Comm comm) {
    gi->comm = comm;
    SMP__MPI_FATAL(MPI_Comm_dup(comm, &gi->objects), "making a group's object communicator at smp_init");
    SMP__MPI_FATAL(MPI_Comm_dup(comm, &gi->notices), "making a group's failure-notice communicator at smp_init");
    /* the others go on into the group's MPI_Allgather, a blocking collective */
    SMP__MPI_FATAL(MPI_Comm_rank(comm, &gi->rank), "asking this rank's place in a group at smp_init");
    SMP__MPI_FATAL(MPI_Comm_size(comm, &gi->size), "asking a group's size at smp_init");
    SMP__MPI_FATAL(MPI_Allgather(&smp__ctx.rank, 1, MPI_INT, gi->world_ranks, 1, MPI_INT, comm),
                   "gathering a group's world ranks at smp_init");
}

/* ---------------------------------------------------------------- agreement */
/* Makes one rank's failure everyone's: if any rank of `comm` has a non-OK
   status, every rank returns the status and message of the lowest failing
   rank (prefixed with its rank when it is not this one). Ranks that failed
   only because they heard of another's failure (SMP_ERR_REMOTE) come after
   every rank with a failure of its own, so the message names the cause. */
static smp_status smp__agree_on(MPI_Comm comm, smp_status local, const char *what) {
    int me, n;
    SMP__MPI_FATAL(MPI_Comm_rank(comm, &me), "agreeing on %s", what);
    SMP__MPI_FATAL(MPI_Comm_size(comm, &n), "agreeing on %s", what);
    int mine = local == SMP_OK ? 2 * n : local == SMP_ERR_REMOTE ? n + me : me, first = 2 * n;
    MPI_Request req;
    /* this is the agreement: a rank that cannot take part can tell nobody */
    SMP__MPI_FATAL(MPI_Iallreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm, &req), "agreeing on %s (%s)", what,
                   local ? smp__errbuf : "no error here");
    smp_wait_requests(1, &req, what, SMP_WORLD, -1);
    if (first == 2 * n) return SMP_OK;
    first %= n;
    struct { int status; char msg[sizeof smp__errbuf]; } pkt;
    pkt.status = (int)local;
    memcpy(pkt.msg, smp__errbuf, sizeof pkt.msg);
    pkt.msg[sizeof pkt.msg - 1] = 0;
    SMP__MPI_FATAL(MPI_Ibcast(&pkt, (int)sizeof pkt, MPI_BYTE, first, comm, &req), "sharing the error of rank %d in %s",
                   first, what);
    smp_wait_requests(1, &req, what, SMP_WORLD, first);
    if (first != me) {
        int world_rank = first;
        if (smp__ctx.initialized) {
            MPI_Group a, b;
            if (SMP__MPI_CHECK(MPI_Comm_group(comm, &a), "naming the failed rank of %s", what) == SMP_OK) {
                if (SMP__MPI_CHECK(MPI_Comm_group(smp__ctx.world, &b), "naming the failed rank of %s", what) ==
                    SMP_OK) {
                    if (SMP__MPI_CHECK(MPI_Group_translate_ranks(a, 1, &first, b, &world_rank),
                                       "naming the failed rank of %s", what))
                        world_rank = first; /* the message then names the rank in `comm` */
                    SMP__MPI_WARN(MPI_Group_free(&b), "releasing a group");
                }
                SMP__MPI_WARN(MPI_Group_free(&a), "releasing a group");
            }
        }
        return smp_error((smp_status)pkt.status, "rank %d: %s", world_rank, pkt.msg);
    }
    return (smp_status)pkt.status;
}

/* ---------------------------------------------------------------- init */
static void smp__half_op_fns(void);

/* Runs at exit(): a rank that leaves while smp is initialised (exit() in a
   module, a return from main without smp_finalize) would leave the others
   waiting for it, and the launcher reports status 0 once they time out or
   finish what they can. It aborts the whole job instead, saying where it was. */
static void smp__exit_guard(void) {
    int down = 0;
    if (MPI_Finalized(&down) != MPI_SUCCESS) return; /* at exit, with nothing to report it to */
    if (!smp__ctx.initialized || down || smp__aborting) return;
    char where[160];
    if (smp__ctx.at.in_step && smp__ctx.at.op) {
        static const char *const what[] = {"F", "forward", "B", "backward", "W", "weight gradients", "L", "step body"};
        const char *op = "operation";
        for (int i = 0; i < 8; i += 2)
            if (smp__ctx.at.op == what[i][0]) op = what[i + 1];
        snprintf(where, sizeof where, "in step %ld, during the %s of stage %d on microbatch %d", smp__ctx.at.steps, op,
                 smp__ctx.at.stage, smp__ctx.at.microbatch);
    } else if (smp__ctx.at.in_step) snprintf(where, sizeof where, "in step %ld", smp__ctx.at.steps);
    else snprintf(where, sizeof where, "after %ld steps, outside a step", smp__ctx.at.steps);
    smp__fatal("rank %d (mp rank %d, dp rank %d) is exiting while smp is initialised (exit() or a return from main "
               "before smp_finalize), "
               "%s: the other ranks would wait for it, so the whole job aborts; call smp_finalize on every rank before "
               "leaving main",
               smp__ctx.rank, smp__ctx.pp_rank, smp__ctx.rdp_rank, where);
}

SMPDEF smp_status smp_init(const smp_config *user_cfg) {
    if (smp__ctx.initialized) return smp_error(SMP_ERR_STATE, "smp_init called twice");
    int up = 0, down = 0;
    SMP__MPI_FATAL(MPI_Finalized(&down), "asking whether MPI was finalized (smp_init)");
    if (down) /* MPI cannot start twice in one process */
        return smp_error(SMP_ERR_STATE,
                         "smp_init after MPI was finalized: MPI cannot start again in this process "
                         "(to init smp several times, call MPI_Init yourself before the first smp_init)");
    SMP__MPI_FATAL(MPI_Initialized(&up), "asking whether MPI is initialized (smp_init)");
    bool owns = false;
    if (!up) {
        int provided;
        SMP__MPI(MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided), "starting MPI (smp_init)");
        owns = true;
    }
    smp_config cfg;
    if (user_cfg) cfg = *user_cfg;
    else memset(&cfg, 0, sizeof cfg);
    MPI_Comm zero_comm; /* MPI_Comm is an int in MPICH and a pointer in Open MPI: compare bytes */
    memset(&zero_comm, 0, sizeof zero_comm);
    MPI_Comm host = memcmp(&cfg.comm, &zero_comm, sizeof zero_comm) == 0 ? MPI_COMM_WORLD : cfg.comm;

    int size, rank;
    /* smp's own copy of the engine's communicator, with MPI_ERRORS_RETURN:
       the engine's keeps its error handler. Until the agreement below, a
       rank that fails and returns would leave the others inside
       MPI_Comm_dup, a blocking collective: these failures abort */
    SMP__MPI_FATAL(MPI_Comm_size(host, &size), "asking the size of the engine's communicator (smp_init)");
    SMP__MPI_FATAL(MPI_Comm_rank(host, &rank), "asking this rank in the engine's communicator (smp_init)");
    smp_status st = SMP_OK;
    SMP__MPI_FATAL(MPI_Comm_dup(host, &smp__ctx.world), "copying the engine's communicator (smp_init)");
    SMP__MPI_FATAL(MPI_Comm_set_errhandler(smp__ctx.world, MPI_ERRORS_RETURN),
                   "setting MPI_ERRORS_RETURN on smp's communicator (smp_init)");
    const char *env = getenv("SMP_CONFIG");
    if (env && *env) {
        st = smp_config_from_json(env, &cfg);
        if (st) smp_error(st, "SMP_CONFIG: %s", smp__errbuf);
    }
    if (!st) st = smp_config_resolve(&cfg, size, &smp__ctx.cfg);
    /* the groups' lists of ranks: out of memory is agreed with the configuration, before the groups' collectives */
    int pp = st ? 1 : smp__ctx.cfg.partitions, tp = st ? 1 : smp__ctx.cfg.tensor_parallel_degree;
    int group_size[SMP_GROUP_COUNT] = {size, pp * tp, size / pp, pp, tp, size / (pp * tp)};
    for (int g = 0; g < SMP_GROUP_COUNT; g++)
        smp__ctx.groups[g].world_ranks =
            (int *)smp__alloc_or(&st, sizeof(int) * (size_t)group_size[g], SMP__ALLOC_OTHER, "a group's ranks");
    smp__ctx.rank = rank;
    st = smp__agree_on(smp__ctx.world, st, "configuration agreement");
    if (st) {
        for (int g = 0; g < SMP_GROUP_COUNT; g++) smp__free(smp__ctx.groups[g].world_ranks);
        memset(smp__ctx.groups, 0, sizeof smp__ctx.groups);
        SMP__MPI_WARN(MPI_Comm_free(&smp__ctx.world), "releasing smp's communicator after a failed smp_init");
        if (owns) SMP__MPI_WARN(MPI_Finalize(), "finalizing MPI after a failed smp_init");
        return st;
    }
    smp__ctx.cfg.comm = host;
    smp__ctx.owns_mpi = owns;
    smp__ctx.size = size;
    smp__gather_hosts();

    MPI_Comm local;
    SMP__MPI_FATAL(MPI_Comm_split_type(smp__ctx.world, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local),
                   "finding the ranks on this host (smp_init)");
    SMP__MPI_FATAL(MPI_Comm_rank(local, &smp__ctx.local_rank), "asking this rank's place on its host (smp_init)");
    SMP__MPI_FATAL(MPI_Comm_size(local, &smp__ctx.local_size), "asking how many ranks share this host (smp_init)");
    SMP__MPI_WARN(MPI_Comm_free(&local), "releasing the host communicator");

    pp = smp__ctx.cfg.partitions;
    tp = smp__ctx.cfg.tensor_parallel_degree;
    smp_coords at = smp_topology_of(rank, size, pp, tp, smp__ctx.cfg.placement_strategy);
    smp__ctx.pp_rank = at.pp_rank;
    smp__ctx.tp_rank = at.tp_rank;
    smp__ctx.rdp_rank = at.rdp_rank;
    smp__ctx.mp_rank = at.mp_rank;
    smp__ctx.dp_rank = at.dp_rank;
    /* each group: the ranks that share a colour, in the order of their key */
    int colour[SMP_GROUP_COUNT] = {
        0, at.rdp_rank, at.pp_rank, at.rdp_rank * tp + at.tp_rank, at.rdp_rank * pp + at.pp_rank, at.mp_rank};
    int key[SMP_GROUP_COUNT] = {rank, at.mp_rank, at.dp_rank, at.pp_rank, at.tp_rank, at.rdp_rank};
    MPI_Comm comm[SMP_GROUP_COUNT];
    for (int g = 0; g < SMP_GROUP_COUNT; g++)
        SMP__MPI_FATAL(MPI_Comm_split(smp__ctx.world, colour[g], key[g], &comm[g]), "making %s (smp_init)",
                       smp__group_name((smp_group)g));
    smp__ctx.initialized = true; /* the group builders below use the context */
    for (int g = 0; g < SMP_GROUP_COUNT; g++) smp__make_group(&smp__ctx.groups[g], comm[g]);
    smp__half_op_fns();
    static bool guarded;
    if (!guarded) guarded = atexit(smp__exit_guard) == 0;
    if (smp__ctx.has_device && smp__ctx.device.on_init) {
        st = smp__agree_on(smp__ctx.world, smp__ctx.device.on_init(), "device backend start-up");
        if (st) { smp_finalize(); return st; }
    }
    return SMP_OK;
}

static void smp__persist_free(smp__persist *p) {
    if (!p->staging) return; /* empty */
    SMP__MPI_WARN(MPI_Request_free(&p->req), "releasing a persistent all-reduce");
    smp__free(p->staging);
    memset(p, 0, sizeof *p);
}

/* Notices of a collective that failed on every member are never asked for:
   take them in before the communicator goes, so MPI ends with nothing
   unmatched (UCX warns of each at exit). */
static void smp__drop_notices(MPI_Comm c) {
    for (;;) {
        int found = 0;
        MPI_Message m;
        MPI_Status st;
        if (SMP__MPI_CHECK(MPI_Improbe(MPI_ANY_SOURCE, SMP__TAG_FAILED, c, &found, &m, &st),
                           "taking in stale failure notices (smp_finalize)"))
            smp__log(SMP_LOG_WARN, "%s", smp_last_error());
        if (!found) return;
        char msg[8 + sizeof smp__errbuf];
        int len = 0;
        SMP__MPI_WARN(MPI_Get_count(&st, MPI_BYTE, &len), "sizing a stale failure notice (smp_finalize)");
        if (len < 0 || len > (int)sizeof msg) len = (int)sizeof msg;
        SMP__MPI_WARN(MPI_Mrecv(msg, len, MPI_BYTE, &m, MPI_STATUS_IGNORE),
                      "taking in a stale failure notice (smp_finalize)");
    }
}

static void smp__free_forgotten(void);
static void smp__tp_hs_free(void);
static void smp__persistent_release(smp_persistent *p);
SMPDEF void smp_finalize(void) {
    if (!smp__ctx.initialized) return;
    smp__free_forgotten(); /* first: a model's pipeline state holds communicators and device memory */
    if (smp__ctx.has_device && smp__ctx.device.on_finalize) smp__ctx.device.on_finalize();
    smp__failures_reap(true);
    smp__free(smp__failures.sends);
    memset(&smp__failures, 0, sizeof smp__failures);
    smp__tp_hs_free();
    while (smp__ctx.persistent) smp__persistent_release(smp__ctx.persistent); /* before their communicators go */
    for (int g = 0; g < SMP_GROUP_COUNT; g++) {
        smp__free(smp__ctx.groups[g].failed_ahead_msg);
        for (int i = 0; i < SMP__PERSIST_SLOTS; i++) smp__persist_free(&smp__ctx.groups[g].persist[i]);
        SMP__MPI_WARN(MPI_Comm_free(&smp__ctx.groups[g].comm), "releasing %s (smp_finalize)",
                      smp__group_name((smp_group)g));
        SMP__MPI_WARN(MPI_Comm_free(&smp__ctx.groups[g].objects), "releasing %s's object communicator (smp_finalize)",
                      smp__group_name((smp_group)g));
        smp__drop_notices(smp__ctx.groups[g].notices);
        SMP__MPI_WARN(MPI_Comm_free(&smp__ctx.groups[g].notices), "releasing %s's notice communicator (smp_finalize)",
                      smp__group_name((smp_group)g));
        smp__free(smp__ctx.groups[g].world_ranks);
    }
    smp__free(smp__ctx.hosts);
    smp__free(smp__ctx.host_at);
    smp__ctx.hosts = NULL;
    smp__ctx.host_at = NULL;
    for (int d = 0; d < 2; d++)
        for (int o = 0; o < 5; o++)
            if (smp__ctx.half_ops[d][o] != MPI_OP_NULL)
                SMP__MPI_WARN(MPI_Op_free(&smp__ctx.half_ops[d][o]), "releasing a half-precision reduction");
    SMP__MPI_WARN(MPI_Type_free(&smp__ctx.half_type), "releasing the half-precision datatype");
    SMP__MPI_WARN(MPI_Comm_free(&smp__ctx.world), "releasing smp's copy of the engine's communicator (smp_finalize)");
    bool owns = smp__ctx.owns_mpi;
    smp_memory_stats mem = smp__ctx.mem;
    smp_device_backend dev = smp__ctx.device;
    bool has_dev = smp__ctx.has_device;
    memset(&smp__ctx, 0, sizeof smp__ctx);
    smp__ctx.mem = mem;
    smp__ctx.device = dev;
    smp__ctx.has_device = has_dev;
    if (owns) SMP__MPI_WARN(MPI_Finalize(), "finalizing MPI (smp_finalize)");
}

SMPDEF void smp_register_device_backend(const smp_device_backend *b) {
    if (b) { smp__ctx.device = *b; smp__ctx.has_device = true; }
    else smp__ctx.has_device = false;
}

/* ---------------------------------------------------------------- object messaging */
/* On a group's private objects communicator, in the order sent: a
   message, or the notice that a send to this rank failed. */
#define SMP__TAG_OBJECT 7001
#define SMP__TAG_SEND_FAILED 7003

static smp_status smp__group_arg(smp_group g, const char *fn, smp__group_info **gi) {
    SMP_TRY(smp__require_init(fn));
    *gi = smp__group(g);
    if (!*gi)
        return smp_error(
            SMP_ERR_ARG,
            "%s: unknown group %d (SMP_WORLD, SMP_MP_GROUP, SMP_DP_GROUP, SMP_PP_GROUP, SMP_TP_GROUP or SMP_RDP_GROUP)",
            fn, (int)g);
    return SMP_OK;
}

static smp_status smp__peer_arg(int peer, smp_group g, const char *fn, smp__group_info **gi) {
    SMP_TRY(smp__group_arg(g, fn, gi));
    if (peer < 0 || peer >= (*gi)->size)
        return smp_error(SMP_ERR_ARG, "%s: rank %d is outside the %s (size %d)", fn, peer, smp__group_name(g),
                         (*gi)->size);
    if (peer == (*gi)->rank) return smp_error(SMP_ERR_ARG, "%s: rank %d is this rank", fn, peer);
    return SMP_OK;
}

SMPDEF smp_status smp_send(const void *buf, size_t len, int dest, smp_group g) {
    smp__group_info *gi;
    SMP_TRY(smp__peer_arg(dest, g, "smp_send", &gi));
    MPI_Datatype type = MPI_BYTE;
    int count = 0;
    MPI_Request req;
    smp_status st =
        len && !buf ? smp_error(SMP_ERR_ARG, "smp_send: buffer is NULL") : smp__bytes_type(len, &count, &type);
    if (!st) {
        st = SMP__MPI_CHECK(MPI_Isend(buf, count, type, dest, SMP__TAG_OBJECT, gi->objects, &req),
                            "sending an object (smp_send) to %s rank %d", smp__group_name(g), dest);
        if (type != MPI_BYTE) SMP__MPI_WARN(MPI_Type_free(&type), "releasing an object's datatype");
    }
    if (st) { /* the receiver learns instead of waiting for SMP_TIMEOUT */
        smp__failures_reap(false);
        smp__send_failure(NULL, 0, dest, SMP__TAG_SEND_FAILED, gi->objects);
        return st;
    }
    smp_wait_requests(1, &req, "smp_send to be received", g, dest);
    return SMP_OK;
}

SMPDEF smp_status smp_recv_from(int src, smp_group g, void **buf, size_t *len) {
    smp__group_info *gi;
    SMP_TRY(smp__peer_arg(src, g, "smp_recv_from", &gi));
    if (!buf || !len) return smp_error(SMP_ERR_ARG, "smp_recv_from: buf and len must not be NULL");
    MPI_Comm comm = gi->objects;
    MPI_Message msg;
    MPI_Status status;
    int found = 0;
    smp__backoff b = smp__backoff_start();
    for (;;) {
        SMP__MPI(MPI_Improbe(src, MPI_ANY_TAG, comm, &found, &msg, &status),
                 "looking for an object (smp_recv_from) from %s rank %d", smp__group_name(g), src);
        if (found) break;
        if (!smp__backoff_pause(&b)) smp__timeout_abort("an object (smp_recv_from)", g, src, smp__now() - b.start);
    }
    MPI_Count bytes;
    /* MPI_Get_count's int stops at 2 GiB; the message is matched to this rank: a failure loses it */
    SMP__MPI_FATAL(MPI_Get_elements_x(&status, MPI_BYTE, &bytes), "sizing an object from %s rank %d",
                   smp__group_name(g), src);
    if (status.MPI_TAG == SMP__TAG_SEND_FAILED) {
        char why[sizeof smp__errbuf];
        if (bytes < 0 || bytes > (MPI_Count)sizeof why - 1)
            smp__fatal("a malformed send-failure notice (%lld bytes)", (long long)bytes);
        SMP__MPI(MPI_Mrecv(why, (int)bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE),
                 "receiving a send-failure notice from %s rank %d", smp__group_name(g), src);
        why[bytes] = 0;
        return smp_error(SMP_ERR_REMOTE,
                         "smp_recv_from: %s rank %d (world rank %d) failed its smp_send to this rank: %s",
                         smp__group_name(g), src, smp_group_world_rank(g, src), why);
    }
    size_t n = (size_t)bytes;
    MPI_Datatype type;
    int count;
    smp_status st = SMP_OK;
    char *p = (char *)smp__alloc_or(&st, n + 1, SMP__ALLOC_OTHER | SMP__UNINIT, "an object smp_recv_from receives");
    if (!st) st = smp__bytes_type(n, &count, &type);
    if (st) { /* MPI matched the message to this probe: no other receive can have it */
        smp__free(p);
        return smp_error(st, "smp_recv_from: the object from %s rank %d is lost: %s", smp__group_name(g), src,
                         smp_last_error());
    }
    MPI_Request req;
    st = SMP__MPI_CHECK(MPI_Imrecv(p, count, type, &msg, &req), "receiving an object (smp_recv_from) from %s rank %d",
                        smp__group_name(g), src);
    if (type != MPI_BYTE) SMP__MPI_WARN(MPI_Type_free(&type), "releasing an object's datatype");
    if (st) { smp__free(p); return st; }
    smp_wait_requests(1, &req, "an object's bytes", g, src);
    p[n] = 0; /* convenient for strings */
    *buf = p;
    *len = n;
    return SMP_OK;
}


static smp_status smp__broadcast_bytes(void **buf, size_t *len, int root, smp_group g) {
    smp__group_info *gi;
    smp_status st = smp__group_arg(g, "smp_broadcast_bytes", &gi);
    if (st) return st;
    if (root < 0 || root >= gi->size)
        return smp_error(SMP_ERR_ARG, "smp_broadcast_bytes: root %d is outside the %s (size %d)", root,
                         smp__group_name(g), gi->size);
    uint64_t n = gi->rank == root ? (uint64_t)*len : 0;
    MPI_Request req;
    SMP__MPI(MPI_Ibcast(&n, 1, MPI_UINT64_T, root, gi->comm, &req),
             "broadcasting a length (smp_broadcast_bytes) from %s rank %d", smp__group_name(g), root);
    smp_wait_requests(1, &req, "broadcast length", g, root);
    char *into = gi->rank == root
                     ? (char *)*buf
                     : (char *)smp__alloc_or(&st, (size_t)n + 1, SMP__ALLOC_OTHER | SMP__UNINIT, "a broadcast's bytes");
    /* in pieces of `spare`'s size, so a member without the memory for the
       whole still takes part (into spare, which is touched only then) and
       returns SMP_ERR_NOMEM instead of leaving the others waiting */
    static char spare[1 << 20];
    smp_status st2;
    for (uint64_t at = 0; at < n; at += sizeof spare) {
        int piece = (int)(n - at < sizeof spare ? n - at : sizeof spare);
        st2 = SMP__MPI_CHECK(MPI_Ibcast(into ? into + at : spare, piece, MPI_BYTE, root, gi->comm, &req),
                             "broadcasting bytes (smp_broadcast_bytes) from %s rank %d", smp__group_name(g), root);
        if (st2) {
            if (gi->rank != root) smp__free(into);
            return st2;
        }
        smp_wait_requests(1, &req, "broadcast bytes", g, root);
    }
    if (st || gi->rank == root) return st;
    into[n] = 0;
    *buf = into;
    *len = (size_t)n;
    return SMP_OK;
}

SMPDEF smp_status smp_broadcast_bytes(void **buf, size_t *len, int root, smp_group g) {
    SMP__COLLECTIVE(g, smp__broadcast_bytes(buf, len, root, g));
}

static smp_status smp__allgather_bytes(const void *buf, size_t len, smp_group g, void **out, size_t *lens) {
    smp__group_info *gi;
    smp_status st = smp__group_arg(g, "smp_all_gather_bytes", &gi);
    if (st) return st;
    if (len > (size_t)INT32_MAX)
        return smp_error(SMP_ERR_ARG, "smp_all_gather_bytes: %zu bytes is more than one message carries", len);
    int n = gi->size, mine = (int)len;
    int *counts =
        (int *)smp__alloc_or(&st, sizeof(int) * 2 * (size_t)n, SMP__ALLOC_OTHER, "smp_all_gather_bytes's lengths");
    if (st) return st;
    int *displs = counts + n;
    MPI_Request req;
    if ((st = SMP__MPI_CHECK(MPI_Iallgather(&mine, 1, MPI_INT, counts, 1, MPI_INT, gi->comm, &req),
                             "gathering lengths (smp_all_gather_bytes) in %s", smp__group_name(g)))) {
        smp__free(counts);
        return st;
    }
    smp_wait_requests(1, &req, "allgather lengths", g, -1);
    int64_t total = 0;
    for (int i = 0; i < n; i++) { displs[i] = (int)total; total += counts[i]; lens[i] = (size_t)counts[i]; }
    if (total > INT32_MAX) {
        smp__free(counts);
        return smp_error(SMP_ERR_ARG, "smp_all_gather_bytes: %lld bytes in all is more than one gather carries",
                         (long long)total);
    }
    char *all = (char *)smp__alloc_or(&st, (size_t)total + 1, SMP__ALLOC_OTHER, "smp_all_gather_bytes's result");
    if (st) { smp__free(counts); return st; }
    if ((st = SMP__MPI_CHECK(MPI_Iallgatherv(buf, mine, MPI_BYTE, all, counts, displs, MPI_BYTE, gi->comm, &req),
                             "gathering bytes (smp_all_gather_bytes) in %s", smp__group_name(g)))) {
        smp__free(all);
        smp__free(counts);
        return st;
    }
    smp_wait_requests(1, &req, "allgather bytes", g, -1);
    all[total] = 0;
    smp__free(counts);
    *out = all;
    return SMP_OK;
}

SMPDEF smp_status smp_all_gather_bytes(const void *buf, size_t len, smp_group g, void **out, size_t *lens) {
    SMP__COLLECTIVE(g, smp__allgather_bytes(buf, len, g, out, lens));
}

static smp_status smp__barrier(smp_group g) {
    smp__group_info *gi;
    smp_status st = smp__group_arg(g, "smp_barrier", &gi);
    if (st) return st;
    MPI_Request req;
    SMP__MPI(MPI_Ibarrier(gi->comm, &req), "entering a barrier in %s", smp__group_name(g));
    smp_wait_requests(1, &req, "barrier", g, -1);
    return SMP_OK;
}

SMPDEF smp_status smp_barrier(smp_group g) {
    SMP__COLLECTIVE(g, smp__barrier(g));
}

/* ---------------------------------------------------------------- collectives */
/* f16 and bf16 travel as 2-byte elements and combine in f32 through
   user-defined operations, one per (format, op). */
#define SMP__HALF_OP(NAME, TO, FROM, EXPR)                                                   \
    static void NAME(void *in, void *inout, int *len, MPI_Datatype *dt) {                   \
        (void)dt;                                                                            \
        const uint16_t *a = (const uint16_t *)in;                                            \
        uint16_t *b = (uint16_t *)inout;                                                     \
        for (int i = 0; i < *len; i++) { float x = TO(a[i]), y = TO(b[i]); b[i] = FROM(EXPR); } \
    }
SMP__HALF_OP(smp__f16_sum, smp_f16_to_f32, smp_f32_to_f16, x + y)
SMP__HALF_OP(smp__f16_prod, smp_f16_to_f32, smp_f32_to_f16, x * y)
SMP__HALF_OP(smp__f16_min, smp_f16_to_f32, smp_f32_to_f16, y < x || y != y ? y : x)
SMP__HALF_OP(smp__f16_max, smp_f16_to_f32, smp_f32_to_f16, y > x || y != y ? y : x)
SMP__HALF_OP(smp__bf16_sum, smp_bf16_to_f32, smp_f32_to_bf16, x + y)
SMP__HALF_OP(smp__bf16_prod, smp_bf16_to_f32, smp_f32_to_bf16, x * y)
SMP__HALF_OP(smp__bf16_min, smp_bf16_to_f32, smp_f32_to_bf16, y < x || y != y ? y : x)
SMP__HALF_OP(smp__bf16_max, smp_bf16_to_f32, smp_f32_to_bf16, y > x || y != y ? y : x)

static void smp__half_op_fns(void) {
    MPI_User_function *fns[2][5] = {{smp__f16_sum, smp__f16_sum, smp__f16_min, smp__f16_max, smp__f16_prod},
                                    {smp__bf16_sum, smp__bf16_sum, smp__bf16_min, smp__bf16_max, smp__bf16_prod}};
    for (int d = 0; d < 2; d++)
        for (int o = 0; o < 5; o++)
            SMP__MPI_FATAL(MPI_Op_create(fns[d][o], 1, &smp__ctx.half_ops[d][o]),
                           "making a half-precision reduction (smp_init)");
    SMP__MPI_FATAL(MPI_Type_contiguous(2, MPI_BYTE, &smp__ctx.half_type),
                   "making the half-precision datatype (smp_init)");
    SMP__MPI_FATAL(MPI_Type_commit(&smp__ctx.half_type), "making the half-precision datatype (smp_init)");
}

static MPI_Datatype smp__mpi_type(smp_dtype dt) {
    switch (dt) {
    case SMP_F32: return MPI_FLOAT;
    case SMP_F64: return MPI_DOUBLE;
    case SMP_I32: return MPI_INT32_T;
    case SMP_I64: return MPI_INT64_T;
    case SMP_U8: case SMP_BOOL: return MPI_UINT8_T;
    case SMP_F16: case SMP_BF16: return smp__ctx.half_type;
    default: return MPI_DATATYPE_NULL;
    }
}

static const char *smp__op_name(smp_op op) {
    static const char *n[] = {"sum", "avg", "min", "max", "prod"};
    return (unsigned)op < 5 ? n[op] : "unknown op";
}

static smp_status smp__mpi_op(smp_op op, smp_dtype dt, const char *fn, MPI_Op *out) {
    if ((unsigned)op > SMP_PROD) return smp_error(SMP_ERR_ARG, "%s: unknown op %d", fn, (int)op);
    if (dt == SMP_BOOL && op != SMP_MIN && op != SMP_MAX)
        return smp_error(SMP_ERR_ARG, "%s: bool tensors reduce with min (and) or max (or), not %s", fn,
                         smp__op_name(op));
    if (op == SMP_AVG && dt != SMP_F32 && dt != SMP_F64 && dt != SMP_F16 && dt != SMP_BF16)
        return smp_error(SMP_ERR_ARG, "%s: avg needs a floating-point tensor, got %s (use sum)", fn,
                         smp_dtype_name(dt));
    if (dt == SMP_F16 || dt == SMP_BF16) { *out = smp__ctx.half_ops[dt == SMP_BF16][op]; return SMP_OK; }
    static const MPI_Op builtin[] = {MPI_SUM, MPI_SUM, MPI_MIN, MPI_MAX, MPI_PROD};
    *out = builtin[op];
    return SMP_OK;
}

static void smp__scale(void *data, smp_dtype dt, int64_t n, double by) {
    switch (dt) {
    case SMP_F32: { float *p = (float *)data, s = (float)by; for (int64_t i = 0; i < n; i++) p[i] *= s; } break;
    case SMP_F64: { double *p = (double *)data; for (int64_t i = 0; i < n; i++) p[i] *= by; } break;
    case SMP_F16: {
        uint16_t *p = (uint16_t *)data;
        for (int64_t i = 0; i < n; i++) p[i] = smp_f32_to_f16(smp_f16_to_f32(p[i]) * (float)by);
    } break;
    case SMP_BF16: {
        uint16_t *p = (uint16_t *)data;
        for (int64_t i = 0; i < n; i++) p[i] = smp_f32_to_bf16(smp_bf16_to_f32(p[i]) * (float)by);
    } break;
    default: break;
    }
}

/* ---------------------------------------------------------------- tensors on either side */
/* Allocates t's data (its dtype and shape set), uninitialised, on the
   backend's device or on the host, and sets t->device: smp__alloc_or for a
   tensor, its message saying which memory ran out. A device block is counted
   like a host one (the backend sets its message when it has no room). */
static void *smp__tensor_alloc_or(smp_status *st, smp_tensor *t, bool on_device, smp__alloc_kind kind,
                                  const char *what) {
    if (*st) return NULL;
    size_t bytes = smp_tensor_nbytes(t);
    t->device = on_device ? smp__ctx.device.current_device() : SMP_HOST;
    t->data = on_device ? smp__block(bytes, kind, true) : smp__alloc(bytes ? bytes : 1, kind);
    if (t->data) return t->data;
    char why[256];
    snprintf(why, sizeof why, "%s (%s memory: %.150s)", what, on_device ? "device" : "host",
             on_device ? smp__errbuf : "malloc failed");
    *st = smp__nomem(smp_tensor_nbytes(t), why);
    return NULL;
}

static smp_status smp__tensor_zero(const smp_tensor *t) {
    size_t bytes = smp_tensor_nbytes(t);
    if (t->device == SMP_HOST) { memset(t->data, 0, bytes); return SMP_OK; }
    return bytes ? smp__ctx.device.zero(t->data, bytes) : SMP_OK;
}

/* dst's bytes = src's, host or device on either side. */
static smp_status smp__tensor_copy(const smp_tensor *dst, const smp_tensor *src) {
    size_t bytes = smp_tensor_nbytes(src);
    if (dst->device == SMP_HOST && src->device == SMP_HOST) { memcpy(dst->data, src->data, bytes); return SMP_OK; }
    if (!smp__ctx.has_device) /* the calls that take tensors have checked them: smp__check_device */
        return smp_error(SMP_ERR_ARG, "a tensor is on CUDA device %d but no device backend is registered",
                         SMP_CUDA_ORDINAL(dst->device == SMP_HOST ? src->device : dst->device));
    return bytes ? smp__ctx.device.copy(dst->data, dst->device, src->data, src->device, bytes) : SMP_OK;
}

/* y = a + b, elementwise, in the tensors' dtype (halves through f32); y may be a. One pass on the host, where a
   copy of a and then += b would read and write y twice for the same values; on the device the backend's add does
   the same arithmetic. */
static smp_status smp__add(smp_tensor *y, const smp_tensor *a, const smp_tensor *b) {
    int64_t n = smp_tensor_numel(y);
    if (y->device != SMP_HOST) {
        smp_status st = y->data == a->data ? SMP_OK : smp__tensor_copy(y, a);
        return st || !n ? st : smp__ctx.device.add(y->data, b->data, y->dtype, n);
    }
#define SMP__ADD_AS(T, SUM)                                                                                          \
    {                                                                                                                \
        T *out = (T *)y->data;                                                                                       \
        const T *l = (const T *)a->data, *r = (const T *)b->data;                                                    \
        for (int64_t x = 0; x < n; x++) out[x] = (T)(SUM);                                                           \
    }                                                                                                                \
    break
    switch (y->dtype) {
        case SMP_F32: SMP__ADD_AS(float, l[x] + r[x]);
        case SMP_F64: SMP__ADD_AS(double, l[x] + r[x]);
        case SMP_F16: SMP__ADD_AS(uint16_t, smp_f32_to_f16(smp_f16_to_f32(l[x]) + smp_f16_to_f32(r[x])));
        case SMP_BF16: SMP__ADD_AS(uint16_t, smp_f32_to_bf16(smp_bf16_to_f32(l[x]) + smp_bf16_to_f32(r[x])));
        case SMP_I32: SMP__ADD_AS(int32_t, l[x] + r[x]);
        case SMP_I64: SMP__ADD_AS(int64_t, l[x] + r[x]);
        default: SMP__ADD_AS(uint8_t, l[x] + r[x]);
    }
#undef SMP__ADD_AS
    return SMP_OK;
}

/* acc += t (smp__add's arithmetic) */
static smp_status smp__add_into(smp_tensor *acc, const smp_tensor *t) { return smp__add(acc, acc, t); }

/* Shared argument checks; *gi is the group; device tells which backend. */
static smp_status smp__coll_args(const char *fn, smp_group g, smp__group_info **gi, const smp_tensor *a, const char *an,
                                 const smp_tensor *b, const char *bn) {
    smp_status st = smp__group_arg(g, fn, gi);
    if (st || (st = smp__check_tensor(a, fn, an))) return st;
    if (bn) { /* a second tensor is expected (bn NULL: none) */
        if ((st = smp__check_tensor(b, fn, bn))) return st;
        if (a->dtype != b->dtype)
            return smp_error(SMP_ERR_ARG, "%s: %s is %s but %s is %s", fn, an, smp_dtype_name(a->dtype), bn,
                             smp_dtype_name(b->dtype));
        if ((a->device == SMP_HOST) != (b->device == SMP_HOST))
            return smp_error(SMP_ERR_ARG, "%s: %s and %s are on different devices", fn, an, bn);
    }
    /* host collectives go in pieces (smp__coll_chunk); the device backend's take one count */
    if (a->device != SMP_HOST && (smp_tensor_numel(a) > INT32_MAX || (bn && smp_tensor_numel(b) > INT32_MAX)))
        return smp_error(SMP_ERR_ARG, "%s: more than 2^31-1 elements in one call on a device; split the tensor", fn);
    return SMP_OK;
}

/* MPI counts are int. A host collective over more elements than this runs
   as one MPI call per piece of at most this many elements, in order: every
   one of them works element by element, so the pieces give what one call
   would. (A variable, not a constant, so that a test can make the pieces
   small.) */
static int64_t smp__coll_chunk = INT_MAX;

/* The size of the piece of n elements that starts at element at. */
static int smp__piece(int64_t n, int64_t at) { return (int)(n - at < smp__coll_chunk ? n - at : smp__coll_chunk); }

static smp_status smp__elements_match(const char *fn, const smp_tensor *a, const char *an, int64_t want,
                                      const char *why) {
    if (smp_tensor_numel(a) != want)
        return smp_error(SMP_ERR_ARG, "%s: %s has %lld elements but %s needs %lld", fn, an,
                         (long long)smp_tensor_numel(a), why, (long long)want);
    return SMP_OK;
}

/* The persistent all-reduce for (count, type, op) on a group, made on first
   use in place of the least recently used; NULL where MPI predates MPI 4. */
static smp__persist *smp__persist_slot(smp__group_info *gi, int count, MPI_Datatype type, MPI_Op op) {
#if MPI_VERSION >= 4
    smp__persist *p = NULL;
    for (int i = 0; i < SMP__PERSIST_SLOTS && !p; i++) {
        smp__persist *q = &gi->persist[i];
        if (q->staging && q->count == count && q->type == type && q->op == op) p = q;
    }
    if (!p) {
        p = &gi->persist[0];
        for (int i = 1; i < SMP__PERSIST_SLOTS; i++)
            if (gi->persist[i].last_use < p->last_use) p = &gi->persist[i];
        smp__persist_free(p);
        int size;
        SMP__MPI_FATAL(MPI_Type_size(type, &size), "sizing a persistent all-reduce's elements");
        size_t bytes = (size_t)count * (size_t)size;
        p->staging = (char *)smp__alloc(bytes, SMP__ALLOC_COMM);
        if (!p->staging) /* the others make the persistent collective now: this rank cannot stay out */
            smp__fatal("out of memory: %zu bytes for a persistent all-reduce's buffer on rank %d, which the group's "
                       "other ranks are "
                       "setting up; the job stops (free memory and run it again)",
                       bytes, smp__ctx.rank);
        SMP__MPI_FATAL(MPI_Allreduce_init(MPI_IN_PLACE, p->staging, count, type, op, gi->comm, MPI_INFO_NULL, &p->req),
                       "setting up a persistent all-reduce, which the group's other ranks are setting up too");
        p->count = count;
        p->type = type;
        p->op = op;
    }
    p->last_use = ++gi->persist_clock;
    return p;
#else
    (void)gi, (void)count, (void)type, (void)op;
    return NULL;
#endif
}

static smp_status smp__all_reduce(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g) {
    smp__group_info *gi;
    MPI_Op mop;
    smp_status st = smp__coll_args("smp_all_reduce", g, &gi, in, "in", out, "out");
    if (st || (st = smp__elements_match("smp_all_reduce", out, "out", smp_tensor_numel(in), "in's count")) ||
        (st = smp__mpi_op(op, in->dtype, "smp_all_reduce", &mop)))
        return st;
    if (in->device != SMP_HOST) return smp__ctx.device.all_reduce(in, out, op, g);
    int64_t n = smp_tensor_numel(in);
    size_t bytes = smp_tensor_nbytes(in), es = smp_dtype_size(in->dtype);
    smp__persist *p = bytes && bytes <= SMP__PERSIST_MAX_BYTES && n <= smp__coll_chunk
                          ? smp__persist_slot(gi, (int)n, smp__mpi_type(in->dtype), mop)
                          : NULL;
    if (p) {
        memcpy(p->staging, in->data, bytes);
        SMP__MPI(MPI_Start(&p->req), "starting an all_reduce in %s", smp__group_name(g));
        smp_wait_requests(1, &p->req, "all_reduce", g, -1);
        memcpy(out->data, p->staging, bytes);
    } else {
        int64_t at = 0;
        do { /* an empty tensor is still one call */
            MPI_Request req;
            const char *from = (const char *)in->data + (size_t)at * es;
            char *to = (char *)out->data + (size_t)at * es;
            SMP__MPI(MPI_Iallreduce(in->data == out->data ? MPI_IN_PLACE : from, to, smp__piece(n, at),
                                    smp__mpi_type(in->dtype), mop, gi->comm, &req),
                     "starting an all_reduce in %s", smp__group_name(g));
            smp_wait_requests(1, &req, "all_reduce", g, -1);
            at += smp__piece(n, at);
        } while (at < n);
    }
    if (op == SMP_AVG) smp__scale(out->data, out->dtype, n, 1.0 / gi->size);
    return SMP_OK;
}

SMPDEF smp_status smp_all_reduce(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g) {
    SMP__COLLECTIVE(g, smp__all_reduce(in, out, op, g));
}

struct smp_persistent {
    smp_tensor in, out;
    smp_op op;
    smp_group g;
    /* one request per piece of at most smp__coll_chunk elements, run in
       order; NULL where a run takes smp_all_reduce's path (device tensors,
       MPI before 4) or smp_finalize released them */
    MPI_Request *reqs;
    int pieces;
    bool released;
    smp_persistent *prev, *next; /* smp__ctx.persistent */
};

/* What every member must pass alike: a mismatch would pair pieces of
   different sizes, a wrong result or a hang. */
static smp_status smp__persistent_same(smp__group_info *gi, smp_group g, const smp_tensor *in, smp_op op) {
    uint64_t mine[3] = {(uint64_t)smp_tensor_numel(in), (uint64_t)in->dtype, (uint64_t)op}, lo[3], hi[3];
    smp__min_max(gi->comm, mine, 3, lo, hi, "smp_all_reduce_init's arguments", g);
    if (lo[0] != hi[0])
        return smp_error(SMP_ERR_ARG, "smp_all_reduce_init: the members of %s pass from %llu to %llu elements; every "
                         "member must pass the same count", smp__group_name(g), (unsigned long long)lo[0],
                         (unsigned long long)hi[0]);
    if (lo[1] != hi[1])
        return smp_error(SMP_ERR_ARG, "smp_all_reduce_init: the members of %s pass different dtypes (%s and %s); "
                         "every member must pass the same dtype", smp__group_name(g), smp_dtype_name((smp_dtype)lo[1]),
                         smp_dtype_name((smp_dtype)hi[1]));
    if (lo[2] != hi[2])
        return smp_error(SMP_ERR_ARG, "smp_all_reduce_init: the members of %s pass different ops (%s and %s); "
                         "every member must pass the same op", smp__group_name(g), smp__op_name((smp_op)lo[2]),
                         smp__op_name((smp_op)hi[2]));
    return SMP_OK;
}

static smp_status smp__all_reduce_init(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g,
                                       smp_persistent **pp) {
    smp__group_info *gi = NULL;
    MPI_Op mop = MPI_OP_NULL;
    smp_status st = smp__coll_args("smp_all_reduce_init", g, &gi, in, "in", out, "out");
    if (!gi) return st; /* not initialised, or no such group: nobody to tell */
    if (!st && !(st = smp__elements_match("smp_all_reduce_init", out, "out", smp_tensor_numel(in), "in's count")))
        st = smp__mpi_op(op, in->dtype, "smp_all_reduce_init", &mop);
    int64_t n = st ? 0 : smp_tensor_numel(in);
    bool bind = !st && in->device == SMP_HOST && MPI_VERSION >= 4;
    int pieces = 1;
    for (int64_t at = smp__piece(n, 0); bind && at < n; at += smp__piece(n, at)) pieces++;
    smp_persistent *p = (smp_persistent *)smp__alloc_or(&st, sizeof *p, SMP__ALLOC_OTHER, "a persistent all-reduce");
    MPI_Request *reqs = bind ? (MPI_Request *)smp__alloc_or(&st, sizeof *reqs * (size_t)pieces, SMP__ALLOC_COMM,
                                                            "a persistent all-reduce's requests")
                             : NULL;
    st = smp__agree_on(gi->comm, st, "making a persistent all-reduce (smp_all_reduce_init)");
    if (!st) st = smp__persistent_same(gi, g, in, op);
    if (st) {
        smp__free(reqs);
        smp__free(p);
        return st;
    }
    p->in = *in;
    p->out = *out;
    p->op = op;
    p->g = g;
    p->reqs = reqs;
    p->pieces = bind ? pieces : 0;
#if MPI_VERSION >= 4
    size_t es = smp_dtype_size(in->dtype);
    int64_t at = 0;
    for (int i = 0; i < p->pieces; i++, at += smp__piece(n, at)) {
        const void *from = in->data == out->data ? MPI_IN_PLACE : (const char *)in->data + (size_t)at * es;
        SMP__MPI_FATAL(MPI_Allreduce_init(from, (char *)out->data + (size_t)at * es, smp__piece(n, at),
                                          smp__mpi_type(in->dtype), mop, gi->comm, MPI_INFO_NULL, &reqs[i]),
                       "setting up a persistent all-reduce, which the other members of %s are setting up too",
                       smp__group_name(g));
    }
#endif
    p->next = smp__ctx.persistent;
    if (p->next) p->next->prev = p;
    smp__ctx.persistent = p;
    *pp = p;
    return SMP_OK;
}

SMPDEF smp_status smp_all_reduce_init(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g,
                                      smp_persistent **p) {
    if (!p) return smp_error(SMP_ERR_ARG, "smp_all_reduce_init: p is NULL; pass the address of a smp_persistent *");
    *p = NULL;
    /* every failure is agreed on inside (so not SMP__COLLECTIVE: its notices would reach members still agreeing) */
    SMP_TRY(smp__tp_coll_handshake(g));
    return smp__all_reduce_init(in, out, op, g, p);
}

static smp_status smp__persistent_run(smp_persistent *p) {
    if (!p->reqs) return smp__all_reduce(&p->in, &p->out, p->op, p->g);
    for (int i = 0; i < p->pieces; i++) {
        SMP__MPI(MPI_Start(&p->reqs[i]), "starting a persistent all_reduce in %s", smp__group_name(p->g));
        smp_wait_requests(1, &p->reqs[i], "all_reduce", p->g, -1);
    }
    if (p->op == SMP_AVG) smp__scale(p->out.data, p->out.dtype, smp_tensor_numel(&p->out), 1.0 / smp_group_size(p->g));
    return SMP_OK;
}

SMPDEF smp_status smp_persistent_run(smp_persistent *p) {
    if (!p) return smp_error(SMP_ERR_ARG, "smp_persistent_run: the handle is NULL (smp_all_reduce_init failed or "
                                          "was not called); make it with smp_all_reduce_init");
    if (p->released)
        return smp_error(SMP_ERR_STATE, "smp_persistent_run: smp_finalize released this handle; make it again with "
                                        "smp_all_reduce_init after smp_init");
    SMP__COLLECTIVE(p->g, smp__persistent_run(p));
}

/* The MPI side of a handle; the struct stays the caller's until smp_persistent_free. */
static void smp__persistent_release(smp_persistent *p) {
    if (p->released) return;
    for (int i = 0; i < p->pieces; i++)
        SMP__MPI_WARN(MPI_Request_free(&p->reqs[i]), "releasing a persistent all-reduce");
    smp__free(p->reqs);
    p->reqs = NULL;
    p->pieces = 0;
    p->released = true;
    if (p->prev) p->prev->next = p->next;
    else smp__ctx.persistent = p->next;
    if (p->next) p->next->prev = p->prev;
    p->prev = p->next = NULL;
}

SMPDEF void smp_persistent_free(smp_persistent *p) {
    if (!p) return;
    smp__persistent_release(p);
    smp__free(p);
}

static smp_status smp__broadcast(smp_tensor *t, int root, smp_group g) {
    smp__group_info *gi;
    smp_status st = smp__coll_args("smp_broadcast", g, &gi, t, "tensor", NULL, NULL);
    if (st) return st;
    if (root < 0 || root >= gi->size)
        return smp_error(SMP_ERR_ARG, "smp_broadcast: root %d is outside the %s (size %d)", root, smp__group_name(g),
                         gi->size);
    if (t->device != SMP_HOST) return smp__ctx.device.broadcast(t, root, g);
    int64_t n = smp_tensor_numel(t), at = 0;
    do {
        MPI_Request req;
        SMP__MPI(MPI_Ibcast((char *)t->data + (size_t)at * smp_dtype_size(t->dtype), smp__piece(n, at),
                            smp__mpi_type(t->dtype), root, gi->comm, &req),
                 "starting a broadcast from %s rank %d", smp__group_name(g), root);
        smp_wait_requests(1, &req, "broadcast", g, root);
        at += smp__piece(n, at);
    } while (at < n);
    return SMP_OK;
}

SMPDEF smp_status smp_broadcast(smp_tensor *t, int root, smp_group g) {
    SMP__COLLECTIVE(g, smp__broadcast(t, root, g));
}

static smp_status smp__reduce(const smp_tensor *in, smp_tensor *out, smp_op op, int root, smp_group g) {
    smp__group_info *gi;
    MPI_Op mop;
    smp_status st = smp__group_arg(g, "smp_reduce", &gi);
    if (st) return st;
    if (root < 0 || root >= gi->size)
        return smp_error(SMP_ERR_ARG, "smp_reduce: root %d is outside the %s (size %d)", root, smp__group_name(g),
                         gi->size);
    bool is_root = gi->rank == root;
    if ((st = smp__coll_args("smp_reduce", g, &gi, in, "in", out, is_root ? "out" : NULL)) ||
        (is_root && (st = smp__elements_match("smp_reduce", out, "out", smp_tensor_numel(in), "in's count"))) ||
        (st = smp__mpi_op(op, in->dtype, "smp_reduce", &mop)))
        return st;
    if (in->device != SMP_HOST) return smp__ctx.device.reduce(in, out, op, root, g);
    int64_t n = smp_tensor_numel(in), at = 0;
    size_t es = smp_dtype_size(in->dtype);
    do {
        const void *send = is_root && in->data == out->data ? MPI_IN_PLACE : (const char *)in->data + (size_t)at * es;
        MPI_Request req;
        SMP__MPI(MPI_Ireduce(send, is_root ? (char *)out->data + (size_t)at * es : NULL, smp__piece(n, at),
                             smp__mpi_type(in->dtype), mop, root, gi->comm, &req),
                 "starting a reduce to %s rank %d", smp__group_name(g), root);
        smp_wait_requests(1, &req, "reduce", g, root);
        at += smp__piece(n, at);
    } while (at < n);
    if (is_root && op == SMP_AVG) smp__scale(out->data, out->dtype, n, 1.0 / gi->size);
    return SMP_OK;
}

SMPDEF smp_status smp_reduce(const smp_tensor *in, smp_tensor *out, smp_op op, int root, smp_group g) {
    SMP__COLLECTIVE(g, smp__reduce(in, out, op, root, g));
}

static smp_status smp__all_gather(const smp_tensor *in, smp_tensor *out, smp_group g) {
    smp__group_info *gi;
    smp_status st = smp__coll_args("smp_all_gather", g, &gi, in, "in", out, "out");
    if (st) return st;
    int64_t n = smp_tensor_numel(in);
    if ((st = smp__elements_match("smp_all_gather", out, "out", n * gi->size, "group size x in's count"))) return st;
    if (in->device != SMP_HOST) return smp__ctx.device.all_gather(in, out, g);
    size_t block = (size_t)n * smp_dtype_size(in->dtype);
    /* in place when `in` is this member's block of `out` */
    const void *send =
        (const char *)out->data + block * (size_t)gi->rank == (const char *)in->data ? MPI_IN_PLACE : in->data;
    MPI_Request req;
    MPI_Datatype t = smp__mpi_type(in->dtype);
    if (n <= smp__coll_chunk) {
        SMP__MPI(MPI_Iallgather(send, (int)n, t, out->data, (int)n, t, gi->comm, &req), "starting an all_gather in %s",
                 smp__group_name(g));
        smp_wait_requests(1, &req, "all_gather", g, -1);
        return SMP_OK;
    }
    /* piece [at, at + c) of every member's block: one element of a type c
       long whose extent is the whole block, so member r's lands at block r */
    size_t es = smp_dtype_size(in->dtype);
    for (int64_t at = 0; at < n; at += smp__piece(n, at)) {
        MPI_Datatype piece, spread;
        SMP__MPI(MPI_Type_contiguous(smp__piece(n, at), t, &piece), "describing a piece of an all_gather in %s",
                 smp__group_name(g));
        st = SMP__MPI_CHECK(MPI_Type_create_resized(piece, 0, (MPI_Aint)block, &spread),
                            "describing a piece of an all_gather in %s", smp__group_name(g));
        SMP__MPI_WARN(MPI_Type_free(&piece), "freeing an all_gather piece's type");
        if (st) return st;
        SMP__MPI(MPI_Type_commit(&spread), "describing a piece of an all_gather in %s", smp__group_name(g));
        st = SMP__MPI_CHECK(
            MPI_Iallgather(send == MPI_IN_PLACE ? MPI_IN_PLACE : (const char *)in->data + (size_t)at * es,
                           smp__piece(n, at), t, (char *)out->data + (size_t)at * es, 1, spread, gi->comm, &req),
            "starting an all_gather in %s", smp__group_name(g));
        /* MPI keeps it for the collective in flight */
        SMP__MPI_WARN(MPI_Type_free(&spread), "freeing an all_gather piece's type");
        if (st) return st;
        smp_wait_requests(1, &req, "all_gather", g, -1);
    }
    return SMP_OK;
}

SMPDEF smp_status smp_all_gather(const smp_tensor *in, smp_tensor *out, smp_group g) {
    SMP__COLLECTIVE(g, smp__all_gather(in, out, g));
}

SMPDEF int smp_memory_format(const smp_memory_stats *s, bool peak, char *buf, size_t cap) {
    const double mib = 1024.0 * 1024.0;
    int at = 0;
    if (cap) buf[0] = 0;
    for (int k = 1; k <= SMP_MEMORY_KINDS; k++) { /* "other" only inside the total, last */
        bool total = k == SMP_MEMORY_KINDS;
        double v =
            (double)(total ? (peak ? s->peak_bytes : s->current_bytes) : (peak ? s->peak[k] : s->bytes[k])) / mib;
        int w = snprintf(at < (int)cap ? buf + at : NULL, at < (int)cap ? cap - (size_t)at : 0, "%s%s %.3f MiB",
                         k > 1 ? ", " : "", total ? "total" : smp_memory_kind_name((smp_memory_kind)k), v);
        at += w > 0 ? w : 0;
    }
    return at;
}

SMPDEF smp_status smp_memory_report(const char *title, smp_memory_stats *all) {
    smp_status st = smp__require_init("smp_memory_report");
    if (st) return st;
    int n = smp__ctx.size;
    smp_memory_stats mine = smp__ctx.mem; /* before the gather's own blocks */
    smp_memory_stats *got =
        all ? all
            : (smp_memory_stats *)smp__alloc_or(&st, sizeof mine * (size_t)n, SMP__ALLOC_OTHER, "the memory report");
    st = smp__agree_on(smp__ctx.world, st, "the memory report");
    if (st) return st;
    smp_tensor in = smp_tensor_1d(&mine, SMP_U8, (int64_t)sizeof mine);
    smp_tensor out = smp_tensor_1d(got, SMP_U8, (int64_t)(sizeof mine * (size_t)n));
    st = smp_all_gather(&in, &out, SMP_WORLD);
    if (!st && smp__ctx.rank == 0) {
        smp__log(SMP_LOG_INFO, "%s: memory per rank at its peak (optimizer: the state registered, outside the total)",
                 title && *title ? title : "memory account");
        for (int r = 0; r < n; r++) {
            char line[512];
            smp_memory_format(&got[r], true, line, sizeof line);
            smp__log(SMP_LOG_INFO, "  rank %d: %s", r, line);
        }
    }
    if (!all) smp__free(got);
    return st;
}

static smp_status smp__reduce_scatter(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g) {
    smp__group_info *gi;
    MPI_Op mop;
    smp_status st = smp__coll_args("smp_reduce_scatter", g, &gi, in, "in", out, "out");
    if (st) return st;
    int64_t n = smp_tensor_numel(out);
    if ((st = smp__elements_match("smp_reduce_scatter", in, "in", n * gi->size, "group size x out's count")) ||
        (st = smp__mpi_op(op, in->dtype, "smp_reduce_scatter", &mop)))
        return st;
    if (in->device != SMP_HOST) return smp__ctx.device.reduce_scatter(in, out, op, g);
    size_t bytes = (size_t)n * smp_dtype_size(in->dtype);
    /* in place when `out` is this member's block of `in`: reduce into a
       scratch block first, since MPI reads all of `in` */
    bool overlap = (const char *)out->data >= (const char *)in->data &&
                   (const char *)out->data < (const char *)in->data + bytes * (size_t)gi->size;
    void *dst = overlap ? smp__alloc_or(&st, bytes, SMP__ALLOC_COMM, "smp_reduce_scatter's scratch block") : out->data;
    if (st) return st;
    MPI_Request req;
    if (n <= smp__coll_chunk) {
        st = SMP__MPI_CHECK(
            MPI_Ireduce_scatter_block(in->data, dst, (int)n, smp__mpi_type(in->dtype), mop, gi->comm, &req),
            "starting a reduce_scatter in %s", smp__group_name(g));
        if (!st) smp_wait_requests(1, &req, "reduce_scatter", g, -1);
    }
    /* more than one piece: each member's block piece by piece, a reduce to that member each */
    size_t es = smp_dtype_size(in->dtype);
    for (int64_t at = 0; n > smp__coll_chunk && at < n && !st; at += smp__piece(n, at))
        for (int r = 0; r < gi->size && !st; r++) {
            st = SMP__MPI_CHECK(MPI_Ireduce((const char *)in->data + ((size_t)r * (size_t)n + (size_t)at) * es,
                                            r == gi->rank ? (char *)dst + (size_t)at * es : NULL, smp__piece(n, at),
                                            smp__mpi_type(in->dtype), mop, r, gi->comm, &req),
                                "starting a piece of a reduce_scatter in %s", smp__group_name(g));
            if (!st) smp_wait_requests(1, &req, "reduce_scatter", g, r);
        }
    if (st) {
        if (overlap) smp__free(dst);
        return st;
    }
    if (overlap) { memcpy(out->data, dst, bytes); smp__free(dst); }
    if (op == SMP_AVG) smp__scale(out->data, out->dtype, n, 1.0 / gi->size);
    return SMP_OK;
}

SMPDEF smp_status smp_reduce_scatter(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g) {
    SMP__COLLECTIVE(g, smp__reduce_scatter(in, out, op, g));
}

static smp_status smp__all_to_all_single(const smp_tensor *in, smp_tensor *out, const int64_t *out_splits,
                                         const int64_t *in_splits, smp_group g) {
    const char *fn = "smp_all_to_all_single";
    smp__group_info *gi;
    smp_status st = smp__coll_args(fn, g, &gi, in, "in", out, "out");
    if (st) return st;
    /* MPI_Alltoallv's displacements are int */
    if (smp_tensor_numel(in) > INT32_MAX || smp_tensor_numel(out) > INT32_MAX)
        return smp_error(SMP_ERR_ARG, "%s: more than 2^31-1 elements in one call; split the tensor", fn);
    int n = gi->size;
    int64_t in_rows = in->ndim ? in->shape[0] : 1, out_rows = out->ndim ? out->shape[0] : 1;
    int64_t in_row = in_rows ? smp_tensor_numel(in) / in_rows : 0,
            out_row = out_rows ? smp_tensor_numel(out) / out_rows : 0;
    if (in_rows && out_rows && in_row != out_row)
        return smp_error(SMP_ERR_ARG, "%s: in's rows have %lld elements but out's have %lld", fn, (long long)in_row,
                         (long long)out_row);
    int64_t row = in_rows ? in_row : out_row;
    if (in->device != SMP_HOST) return smp__ctx.device.all_to_all_single(in, out, out_splits, in_splits, g);
    int *buf = (int *)smp__alloc_or(&st, sizeof(int) * 4 * (size_t)n, SMP__ALLOC_OTHER, "all_to_all_single's counts");
    if (st) return st;
    int *scount = buf, *sdispl = buf + n, *rcount = buf + 2 * n, *rdispl = buf + 3 * n;
    int64_t sat = 0, rat = 0;
    for (int i = 0; i < n; i++) {
        int64_t s = in_splits ? in_splits[i] : (in_rows % n ? -1 : in_rows / n);
        int64_t r = out_splits ? out_splits[i] : (out_rows % n ? -1 : out_rows / n);
        if (s < 0 || r < 0) {
            smp__free(buf);
            return smp_error(SMP_ERR_ARG, "%s: %s", fn,
                             s < 0 ? (in_splits ? "in_splits has a negative entry"
                                                : "in's dim 0 does not divide by the group size; pass in_splits")
                                   : (out_splits ? "out_splits has a negative entry"
                                                 : "out's dim 0 does not divide by the group size; pass out_splits"));
        }
        scount[i] = (int)(s * row); sdispl[i] = (int)(sat * row); sat += s;
        rcount[i] = (int)(r * row); rdispl[i] = (int)(rat * row); rat += r;
    }
    if (sat != in_rows || rat != out_rows) {
        smp__free(buf);
        return smp_error(SMP_ERR_ARG,
                         "%s: splits add up to %lld rows in and %lld out, but the tensors have %lld and %lld", fn,
                         (long long)sat, (long long)rat, (long long)in_rows, (long long)out_rows);
    }
    void *send = in->data;
    if (in->data == out->data && smp_tensor_nbytes(in)) { /* in place: MPI needs separate buffers */
        if (!(send = smp__alloc_or(&st, smp_tensor_nbytes(in), SMP__ALLOC_COMM, "all_to_all_single's copy of in"))) {
            smp__free(buf);
            return st;
        }
        memcpy(send, in->data, smp_tensor_nbytes(in));
    }
    MPI_Request req;
    MPI_Datatype t = smp__mpi_type(in->dtype);
    st = SMP__MPI_CHECK(MPI_Ialltoallv(send, scount, sdispl, t, out->data, rcount, rdispl, t, gi->comm, &req),
                        "starting an all_to_all_single in %s", smp__group_name(g));
    if (!st) smp_wait_requests(1, &req, "all_to_all_single", g, -1);
    if (send != in->data) smp__free(send);
    smp__free(buf);
    return st;
}

SMPDEF smp_status smp_all_to_all_single(const smp_tensor *in, smp_tensor *out, const int64_t *out_splits,
                                        const int64_t *in_splits, smp_group g) {
    SMP__COLLECTIVE(g, smp__all_to_all_single(in, out, out_splits, in_splits, g));
}

/* ---------------------------------------------------------------- modules */
struct smp_param {
    smp_module *module;
    char *name, *full_name;
    smp_tensor value, grad; /* data NULL until materialised on the owning rank */
    bool is_buffer;
    bool grad_in_bucket; /* grad.data points into a data-parallel bucket, which owns it */
    smp_init_fn init;
    void *init_user;
    int shard_axis;      /* -1: whole on every TP rank; else split along it over TP_GROUP */
    int shard_blocks;    /* the axis is this many blocks, each split over TP_GROUP (fused QKV: 3) */
    /* the declared shape; where this rank's slice starts along the axis */
    int64_t full_shape[SMP_MAX_DIMS], shard_offset;
};

struct smp_module {
    char *name, *full_name;
    smp_module *parent;
    smp_module **children;
    int nchildren;
    smp_param **params;
    int nparams;
    smp_module_desc desc;
    int context_partition; /* innermost SMP_PARTITION at creation; -1: none */
    int partition;         /* after partitioning: the first partition holding it */
    bool local;            /* after partitioning: this rank holds it (or a copy) */
    int owner_call;        /* first leaf call that reads its parameters (tracing); -1: none */
    int uses;              /* leaf calls that read its parameters: more than 1 makes it shared */
    bool composite;        /* its forward called children when traced */
    bool recompute;        /* smp_module_set_recompute */
    bool overwrites_grad_inputs; /* smp_module_set_overwrites_grad_inputs */
    smp_module_fn backward_input, backward_weight; /* smp_module_set_backward_split */
    int materialised;      /* nesting count while tracing */
    smp_model *model;
};

/* Where a tensor of the graph comes from: a model input or a call's output. */
typedef struct smp__ref { int call; /* -1: model input */ int index; } smp__ref;

/* A leaf call: what the executor runs. Composites leave only their leaves. */
typedef struct smp__call_rec {
    smp_module *module;
    int nin, nout;
    smp__ref *in;
    smp_tensor *in_meta;  /* each input's dtype and shape as the call saw it */
    smp_tensor *out_meta; /* each output's dtype and shape as traced */
    double time, activation_bytes, param_bytes; /* time: forward + backward */
    double cost[3];       /* seconds of its forward, backward input (B) and backward weight (W) phases */
    int stage;
    int unit;             /* the top-level call it belongs to */
    int context;          /* its SMP_PARTITION context (its own, else its callers'); -1: none */
    int recompute_first, recompute_last; /* the recomputed call it is part of, as leaf calls; -1: none */
} smp__call_rec;

/* A top-level call of the model's forward: the unit auto-partitioning places. */
typedef struct smp__unit {
    smp_module *module;
    int first, last;      /* its leaf calls */
    double time, activation_bytes, param_bytes;
} smp__unit;

typedef struct smp__hook { smp_post_partition_fn fn; void *user; } smp__hook;

struct smp_model {
    smp_module *root;
    smp_model_desc desc;
    smp_module **modules; /* the tree, creation order */
    int nmodules;
    smp_param **params;   /* every parameter and buffer, declaration order */
    int nparams;
    smp__call_rec *calls; /* leaf calls, in execution order */
    int ncalls;
    smp__unit *units;     /* top-level calls */
    int nunits;
    smp__ref *outputs;    /* the forward's outputs */
    bool traced, partitioned;
    int nstages;
    int *stage_rank, *stage_first, *stage_last; /* per stage: mp rank, first and last call */
    smp__hook *hooks;
    int nhooks, hooks_cap;
    size_t hooks_lost;    /* bytes a registration could not have: partitioning fails with SMP_ERR_NOMEM */
    void *pipeline;       /* smp_pipeline.h's per-model state */
    void (*pipeline_free)(void *);
    unsigned long zero_grad_calls; /* tells the pipeline whether gradients it averaged were zeroed since */
    bool grads_restored;           /* smp_model_grads_restored since a failed step left them partial */
    bool params_stale;    /* shard_optimizer_state: replicas may have updated their own ranges since the last gather */
    /* Where each local gradient lives in the data-parallel buckets (smp__grad_layout, made at partitioning, so
       smp_param_owned_range answers before the first step): backward order, cut at bucket_cap_mb and where the
       dtype changes. Under shard_optimizer_state each bucket is padded to a multiple of the replicas and
       replica r owns the r-th of its equal pieces, so a bucket's reduce-scatter hands every replica its range. */
    int *grad_order;       /* local parameters in backward order */
    int *grad_bucket;      /* [nparams]: the bucket of each parameter's gradient, -1: none */
    int64_t *grad_at;      /* [nparams]: where in it the gradient starts (elements) */
    int *bucket_first;     /* [nbuckets + 1]: each bucket's parameters, as positions in grad_order */
    int64_t *bucket_numel; /* [nbuckets]: elements, padding included */
    int nbuckets;
    smp__cache *cache;    /* what its steps allocate (the caching allocator) */
};

struct smp_call_ctx {
    smp_module *module;
    int microbatch;
    bool training;
    int nin, nout;
    const smp_tensor *inputs;
    smp_tensor *outputs;
    const smp_tensor *grad_outputs;
    smp_tensor *grad_inputs; /* data NULL: no gradient wanted for that input */
    void *stash, *device_stash;
    size_t stash_bytes, device_stash_bytes;
    smp__alloc_kind kind;    /* outputs and stash: counted as stash when training */
    bool in_backward;
    int call;                /* the leaf call's index (-1: not yet a leaf, while tracing) */
    smp_call_ctx *caller;    /* while tracing: the composite call that made this one */
    uint64_t seed;           /* smp_call_seed */
    /* memory the call asked smp for and did not get: the call fails with it */
    size_t nomem_bytes;
    const char *nomem_what;
    /* while tracing */
    bool made_calls, made_output; /* the forward called smp_call / smp_call_output */
    bool *output_set;        /* smp_call_set_output, per output */
    int context;             /* SMP_PARTITION context of the nearest caller that has one */
};

static struct {
    smp_module **all; /* every module ever created, for cleanup */
    int nall, cap;
    int stack[64];
    /* where each open context began (file NULL: smp_partition_push) */
    struct { const char *file; int line; } opened[64];
    int depth;
    bool stray_pop;          /* smp_partition_pop with no context open */
    smp_model **models;      /* every live model, freed by smp_finalize if the engine did not */
    int nmodels, models_cap;
    smp_status build_status; /* the first error made while building modules */
    char build_msg[sizeof smp__errbuf];
    bool tracing;
    smp_model *trace_model;
    /* trace: every tensor handed out so far, with a checksum of its bytes */
    struct { smp_tensor t; smp__ref ref; uint64_t sum; bool owned; } *table;
    int ntable, table_cap;
    smp_call_ctx *current; /* the call whose callback is running */
} smp__mod;

static char *smp__strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = (char *)smp__alloc(n, SMP__ALLOC_OTHER);
    if (d) memcpy(d, s, n);
    return d;
}


/* Errors while building the tree are remembered and reported by
   smp_model_new, so engine code can build without checking each call. */
static void smp__build_error(smp_status st, const char *fmt, ...) SMP__PRINTF(2, 3);
static void smp__build_error(smp_status st, const char *fmt, ...) {
    char msg[sizeof smp__errbuf];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(smp__errbuf, msg, sizeof msg);
    if (!smp__mod.build_status) {
        smp__mod.build_status = st;
        memcpy(smp__mod.build_msg, smp__errbuf, sizeof smp__errbuf);
    }
}

/* Out of memory while building the tree: remembered like any build error. */
static void smp__build_nomem(const char *what, const char *name) {
    smp__build_error(SMP_ERR_NOMEM,
                     "out of memory creating %s \"%s\" on rank %d; free memory and build the model again", what, name,
                     smp__ctx.rank);
}

/* "prefix.name", or name alone under the root's empty prefix; NULL when out of memory. */
static char *smp__dotted(const char *prefix, const char *name) {
    size_t n = strlen(prefix) + strlen(name) + 2;
    char *s = (char *)smp__alloc(n, SMP__ALLOC_OTHER);
    if (s) snprintf(s, n, "%s%s%s", prefix, *prefix && *name ? "." : "", name);
    return s;
}

SMPDEF void smp__partition_push_at(int partition, const char *file, int line) {
    if (smp__mod.depth >= 64) {
        /* 64 deep is in practice contexts left by break/return/goto: say where the first began */
        if (smp__mod.opened[0].file)
            smp__build_error(
                SMP_ERR_ARG,
                "SMP_PARTITION contexts nested more than 64 deep (the first opened at %s:%d); a break, return or goto "
                "out of an SMP_PARTITION block leaves its context open",
                smp__mod.opened[0].file, smp__mod.opened[0].line);
        else
            smp__build_error(
                SMP_ERR_ARG,
                "SMP_PARTITION contexts nested more than 64 deep (smp_partition_push without smp_partition_pop?)");
        return;
    }
    if (partition < 0 || (smp__ctx.initialized && partition >= smp__ctx.cfg.partitions))
        smp__build_error(SMP_ERR_CONFIG, "SMP_PARTITION(%d): partition must be in 0..%d (partitions = %d)", partition,
                         smp__ctx.cfg.partitions - 1, smp__ctx.cfg.partitions);
    smp__mod.opened[smp__mod.depth].file = file;
    smp__mod.opened[smp__mod.depth].line = line;
    smp__mod.stack[smp__mod.depth++] = partition;
}
SMPDEF void smp_partition_push(int partition) { smp__partition_push_at(partition, NULL, 0); }
SMPDEF void smp_partition_pop(void) {
    if (smp__mod.depth > 0) smp__mod.depth--;
    else smp__mod.stray_pop = true;
}

/* A context still open (or a pop without a push) when a model is made:
   the engine left an SMP_PARTITION block early, and every module created
   since went to that partition without anyone asking. The error names the
   outermost open context; the stack is emptied so the next build starts
   clean. */
static smp_status smp__check_contexts_closed(void) {
    smp_status st = SMP_OK;
    if (smp__mod.depth > 0) {
        int d = 0; /* the outermost: the first left open */
        if (smp__mod.opened[d].file)
            st = smp_error(SMP_ERR_STATE,
                           "smp_model_new: the SMP_PARTITION(%d) context opened at %s:%d is still open (%d context%s "
                           "open): a break, "
                           "return or goto out of an SMP_PARTITION block skips closing it, and every module created "
                           "since went to partition %d. "
                           "Leave the block at its end (or call smp_partition_pop for every smp_partition_push)",
                           smp__mod.stack[d], smp__mod.opened[d].file, smp__mod.opened[d].line, smp__mod.depth,
                           smp__mod.depth == 1 ? "" : "s", smp__mod.stack[smp__mod.depth - 1]);
        else
            st = smp_error(
                SMP_ERR_STATE,
                "smp_model_new: smp_partition_push(%d) has no matching smp_partition_pop (%d context%s open): "
                "call smp_partition_pop once the modules of that partition are created",
                smp__mod.stack[d], smp__mod.depth, smp__mod.depth == 1 ? "" : "s");
    } else if (smp__mod.stray_pop) {
        st = smp_error(SMP_ERR_STATE, "smp_model_new: smp_partition_pop was called with no SMP_PARTITION context open "
                       "(one pop too many: pair each smp_partition_push with one pop)");
    }
    smp__mod.depth = 0;
    smp__mod.stray_pop = false;
    return st;
}

SMPDEF smp_module *smp_module_new(smp_module *parent, const char *name, const smp_module_desc *desc) {
    if (!name || (parent && !*name) || strchr(name, '.')) {
        smp__build_error(SMP_ERR_ARG,
                         "module name \"%s\" must be non-empty and contain no '.' (the dots come from the tree)",
                         name ? name : "(null)");
        return NULL;
    }
    if (parent)
        for (int i = 0; i < parent->nchildren; i++)
            if (!strcmp(parent->children[i]->name, name)) {
                smp__build_error(SMP_ERR_ARG, "module \"%s\" already has a child called \"%s\"", parent->full_name,
                                 name);
                return NULL;
            }
    smp_module *m = (smp_module *)smp__alloc(sizeof *m, SMP__ALLOC_OTHER);
    char *own = smp__strdup(name), *full = smp__dotted(parent ? parent->full_name : "", parent ? name : "");
    int cap = parent ? parent->nchildren : 0; /* grows by one each time: trees are built once */
    if (!m || !own || !full ||
        (parent && !smp__grow((void **)&parent->children, &cap, cap + 1, sizeof(smp_module *), NULL)) ||
        !smp__grow((void **)&smp__mod.all, &smp__mod.cap, smp__mod.nall + 1, sizeof(smp_module *), NULL)) {
        smp__free(m);
        smp__free(own);
        smp__free(full);
        smp__build_nomem("module", name);
        return NULL;
    }
    memset(m, 0, sizeof *m);
    m->name = own;
    m->full_name = full;
    m->parent = parent;
    if (desc) m->desc = *desc;
    m->context_partition = smp__mod.depth ? smp__mod.stack[smp__mod.depth - 1] : -1;
    m->partition = -1;
    m->owner_call = -1;
    if (parent) parent->children[parent->nchildren++] = m;
    smp__mod.all[smp__mod.nall++] = m;
    return m;
}

static smp_param *smp__declare(smp_module *m, const char *name, smp_dtype dt, int ndim, const int64_t *shape,
                               smp_init_fn init, void *user, bool buffer) {
    const char *what = buffer ? "buffer" : "parameter";
    if (!m) {
        smp__build_error(SMP_ERR_ARG, "%s \"%s\" declared on a NULL module", what, name ? name : "(null)");
        return NULL;
    }
    if (!name || !*name || strchr(name, '.')) {
        smp__build_error(SMP_ERR_ARG, "%s name \"%s\" of module \"%s\" must be non-empty without '.'", what,
                         name ? name : "(null)", m->full_name);
        return NULL;
    }
    if (smp_dtype_size(dt) == 0 || ndim < 0 || ndim > SMP_MAX_DIMS) {
        smp__build_error(SMP_ERR_ARG, "%s \"%s.%s\": bad dtype or ndim", what, m->full_name, name);
        return NULL;
    }
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0) {
            smp__build_error(SMP_ERR_ARG, "%s \"%s.%s\": dimension %d is negative", what, m->full_name, name, i);
            return NULL;
        }
    for (int i = 0; i < m->nparams; i++)
        if (!strcmp(m->params[i]->name, name)) {
            smp__build_error(SMP_ERR_ARG, "module \"%s\" already has a parameter or buffer \"%s\"", m->full_name, name);
            return NULL;
        }
    const smp_init_copy_desc *copy = init == smp_init_copy ? (const smp_init_copy_desc *)user : NULL;
    if (init == smp_init_copy && (!copy || !copy->data || copy->offset < 0)) {
        smp__build_error(SMP_ERR_ARG,
                         "%s \"%s.%s\": smp_init_copy needs an smp_init_copy_desc with data and an offset >= 0 "
                         "as its user pointer",
                         what, m->full_name, name);
        return NULL;
    }
    smp_param *p = (smp_param *)smp__alloc(sizeof *p, SMP__ALLOC_OTHER);
    char *own = smp__strdup(name), *full = smp__dotted(m->full_name, name);
    int cap = m->nparams;
    if (!p || !own || !full || !smp__grow((void **)&m->params, &cap, cap + 1, sizeof(smp_param *), NULL)) {
        smp__free(p);
        smp__free(own);
        smp__free(full);
        smp__build_nomem(what, name);
        return NULL;
    }
    memset(p, 0, sizeof *p);
    p->module = m;
    p->name = own;
    p->full_name = full;
    p->value = smp_tensor_make(NULL, dt, ndim, shape);
    p->grad = p->value;
    p->is_buffer = buffer;
    p->init = init;
    p->init_user = user;
    p->shard_axis = -1;
    p->shard_blocks = 1;
    memcpy(p->full_shape, p->value.shape, sizeof p->full_shape);
    m->params[m->nparams++] = p;
    return p;
}

SMPDEF smp_param *smp_param_new(smp_module *m, const char *name, smp_dtype dt, int ndim, const int64_t *shape,
                                smp_init_fn init, void *user) {
    return smp__declare(m, name, dt, ndim, shape, init, user, false);
}
SMPDEF smp_param *smp_buffer_new(smp_module *m, const char *name, smp_dtype dt, int ndim, const int64_t *shape,
                                 smp_init_fn init, void *user) {
    return smp__declare(m, name, dt, ndim, shape, init, user, true);
}
SMPDEF smp_param *smp_param_new_sharded_blocks(smp_module *m, const char *name, smp_dtype dt, int ndim,
                                               const int64_t *shape, int shard_axis, int blocks, smp_init_fn init,
                                               void *init_user) {
    if (ndim >= 0 && (shard_axis < 0 || shard_axis >= ndim)) {
        smp__build_error(SMP_ERR_ARG,
                         "parameter \"%s\" of module \"%s\": shard axis %d is not one of its %d axes (0 to %d)",
                         name ? name : "(null)", m ? m->full_name : "(null)", shard_axis, ndim, ndim - 1);
        return NULL;
    }
    if (blocks < 1 || (ndim > 0 && shape && shape[shard_axis] % blocks)) {
        smp__build_error(SMP_ERR_ARG,
                         "parameter \"%s\" of module \"%s\": %d blocks do not split its shard axis %d of size %lld: "
                         "give a number of blocks (1 or more) that divides it",
                         name ? name : "(null)", m ? m->full_name : "(null)", blocks, shard_axis,
                         (long long)(ndim > 0 && shape ? shape[shard_axis] : 0));
        return NULL;
    }
    smp_param *p = smp__declare(m, name, dt, ndim, shape, init, init_user, false);
    if (p) {
        p->shard_axis = shard_axis;
        p->shard_blocks = blocks;
    }
    return p;
}
SMPDEF smp_param *smp_param_new_sharded(smp_module *m, const char *name, smp_dtype dt, int ndim, const int64_t *shape,
                                        int shard_axis, smp_init_fn init, void *init_user) {
    return smp_param_new_sharded_blocks(m, name, dt, ndim, shape, shard_axis, 1, init, init_user);
}
SMPDEF int smp_param_shard_axis(const smp_param *p) { return p->shard_axis; }
SMPDEF int smp_param_shard_blocks(const smp_param *p) { return p->shard_blocks; }
SMPDEF int64_t smp_param_shard_offset(const smp_param *p) { return p->shard_offset; }
SMPDEF int smp_param_full_shape(const smp_param *p, int64_t shape[SMP_MAX_DIMS]) {
    memcpy(shape, p->full_shape, sizeof p->full_shape);
    return p->value.ndim;
}

/* Cuts each sharded parameter's local shape out of its full one: the tp
   degree is known only once smp_init has run. Every rank finds the same. */
static smp_status smp__shard_params(smp_model *m) {
    int tp = smp_tp_size(), sharded = 0;
    for (int i = 0; i < m->nparams; i++) {
        smp_param *p = m->params[i];
        if (p->shard_axis < 0) continue;
        int64_t full = p->full_shape[p->shard_axis], nb = p->shard_blocks;
        if (full % (tp * nb) && nb == 1)
            return smp_error(
                SMP_ERR_CONFIG,
                "parameter \"%s\" is sharded along axis %d of size %lld, which tensor_parallel_degree = %d "
                "does not divide: make that dimension a multiple of %d, or change tensor_parallel_degree",
                p->full_name, p->shard_axis, (long long)full, tp, tp);
        if (full % (tp * nb))
            return smp_error(SMP_ERR_CONFIG,
                             "parameter \"%s\" is sharded along axis %d of size %lld in %lld blocks of %lld, which "
                             "tensor_parallel_degree = %d does not divide: make each block a multiple of %d, or change "
                             "tensor_parallel_degree",
                             p->full_name, p->shard_axis, (long long)full, (long long)nb, (long long)(full / nb), tp,
                             tp);
        p->value.shape[p->shard_axis] = p->grad.shape[p->shard_axis] = full / tp;
        p->shard_offset = full / nb / tp * smp_tp_rank();
        sharded++;
    }
    if (tp > 1 && !sharded && smp__ctx.rank == 0)
        smp__log(SMP_LOG_WARN,
                 "tensor_parallel_degree is %d, but the model declares no sharded parameter (smp_param_new_sharded): "
                 "the %d ranks of each TP group would compute the same thing",
                 tp, tp);
    return SMP_OK;
}
SMPDEF const char *smp_module_name(const smp_module *m) { return m->full_name; }
SMPDEF void *smp_module_user(const smp_module *m) { return m->desc.user; }
SMPDEF int smp_module_partition(const smp_module *m) { return m->partition; }
SMPDEF bool smp_module_is_local(const smp_module *m) { return m->local; }
SMPDEF void smp_module_set_recompute(smp_module *m, bool on) { if (m) m->recompute = on; }
SMPDEF void smp_module_set_overwrites_grad_inputs(smp_module *m, bool on) { if (m) m->overwrites_grad_inputs = on; }
SMPDEF void smp_module_set_backward_split(smp_module *m, smp_module_fn backward_input, smp_module_fn backward_weight) {
    if (!m || !backward_input || !backward_weight || m->desc.backward) {
        smp__build_error(SMP_ERR_ARG,
                         "smp_module_set_backward_split(\"%s\"): needs a module without a backward and both functions "
                         "(backward_input writes input gradients, backward_weight adds parameter gradients)",
                         m ? m->full_name : "(null)");
        return;
    }
    m->backward_input = backward_input;
    m->backward_weight = backward_weight;
}
SMPDEF const char *smp_param_name(const smp_param *p) { return p->full_name; }
SMPDEF smp_tensor *smp_param_value(smp_param *p) { return &p->value; }
SMPDEF smp_tensor *smp_param_grad(smp_param *p) { return p->is_buffer ? NULL : &p->grad; }
SMPDEF bool smp_param_is_buffer(const smp_param *p) { return p->is_buffer; }
SMPDEF smp_module *smp_param_module(const smp_param *p) { return p->module; }

/* FNV-1a over the name, mixed with the global seed by splitmix64. */
static uint64_t smp__splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
SMPDEF uint64_t smp_param_seed(const char *full_name) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *c = (const unsigned char *)full_name; *c; c++) h = (h ^ *c) * 0x100000001b3ull;
    uint64_t s = h ^ smp__ctx.cfg.seed;
    return smp__splitmix(&s);
}
SMPDEF double smp_rng_uniform(uint64_t *state) {
    return (double)(smp__splitmix(state) >> 11) * (1.0 / 9007199254740992.0);
}

SMPDEF void smp_init_uniform(smp_tensor *v, uint64_t seed, void *user) {
    int64_t n = smp_tensor_numel(v), fan_in = v->ndim ? v->shape[v->ndim - 1] : 1;
    float bound = user ? *(const float *)user : (float)(1.0 / sqrt((double)(fan_in > 0 ? fan_in : 1)));
    float *p = (float *)v->data;
    for (int64_t i = 0; i < n; i++) p[i] = (float)((2.0 * smp_rng_uniform(&seed) - 1.0) * (double)bound);
}
SMPDEF void smp_init_constant(smp_tensor *v, uint64_t seed, void *user) {
    (void)seed;
    float c = user ? *(const float *)user : 0.0f, *p = (float *)v->data;
    for (int64_t i = 0, n = smp_tensor_numel(v); i < n; i++) p[i] = c;
}
SMPDEF void smp_init_copy(smp_tensor *v, uint64_t seed, void *user) {
    (void)seed;
    const smp_init_copy_desc *d = (const smp_init_copy_desc *)user; /* not NULL: smp__declare checked */
    memcpy(v->data, (const char *)d->data + (size_t)d->offset * smp_dtype_size(v->dtype), smp_tensor_nbytes(v));
}

static bool smp__model_on_device(const smp_model *m);

/* dst = the slice of src that starts at `offset` along `axis` and is as long
   as dst there (host memory; dst and src alike in every other axis); with
   `blocks` > 1, the axis is that many blocks and dst holds the slice of
   each, the offset counted within a block. */
static void smp__slice_copy(smp_tensor *dst, const smp_tensor *src, int axis, int blocks, int64_t offset) {
    size_t es = smp_dtype_size(src->dtype), inner = es;
    int64_t outer = blocks;
    for (int d = 0; d < axis; d++) outer *= src->shape[d];
    for (int d = axis + 1; d < src->ndim; d++) inner *= (size_t)src->shape[d];
    size_t row = inner * (size_t)(dst->shape[axis] / blocks), src_row = inner * (size_t)(src->shape[axis] / blocks);
    for (int64_t o = 0; o < outer; o++)
        memcpy((char *)dst->data + (size_t)o * row,
               (const char *)src->data + (size_t)o * src_row + inner * (size_t)offset, row);
}

static void smp__release_param(smp_param *p) {
    smp__free(p->value.data);
    if (!p->grad_in_bucket) smp__free(p->grad.data);
    p->grad_in_bucket = false;
    p->value.data = p->grad.data = NULL;
}
/* A parameter's storage, initialised, and its gradient, zeroed; out of
   memory leaves the parameter as it was and names it. */
static smp_status smp__materialise_param(smp_param *p) {
    bool on_device = smp__model_on_device(p->module->model);
    char what[320];
    snprintf(what, sizeof what, "parameter %s", p->full_name);
    smp_status st = SMP_OK;
    smp_tensor init = p->value; /* init callbacks write host memory: a device parameter starts as a copy of it */
    init.device = SMP_HOST;
    init.data = smp__alloc_or(&st, smp_tensor_nbytes(&p->value), on_device ? SMP__ALLOC_OTHER : SMP__ALLOC_PARAM, what);
    if (st) return st;
    if (p->init && p->shard_axis >= 0 && p->full_shape[p->shard_axis] != p->value.shape[p->shard_axis]) {
        /* the values are those of the full tensor, so every tp degree starts from the same weights */
        smp_tensor full = smp_tensor_make(NULL, p->value.dtype, p->value.ndim, p->full_shape);
        char why[360];
        snprintf(why, sizeof why, "the full tensor of sharded parameter %s, to initialise its slice", p->full_name);
        full.data = smp__alloc_or(&st, smp_tensor_nbytes(&full), SMP__ALLOC_OTHER, why);
        if (st) { smp__free(init.data); return st; }
        p->init(&full, smp_param_seed(p->full_name), p->init_user);
        smp__slice_copy(&init, &full, p->shard_axis, p->shard_blocks, p->shard_offset);
        smp__free(full.data);
    } else if (p->init) p->init(&init, smp_param_seed(p->full_name), p->init_user);
    if (!on_device) p->value = init;
    else {
        if (smp__tensor_alloc_or(&st, &p->value, true, SMP__ALLOC_PARAM, what)) st = smp__tensor_copy(&p->value, &init);
        smp__free(init.data);
    }
    snprintf(what, sizeof what, "the gradient of parameter %s", p->full_name);
    if (!st && !p->is_buffer && smp__tensor_alloc_or(&st, &p->grad, on_device, SMP__ALLOC_GRAD, what))
        st = smp__tensor_zero(&p->grad);
    if (st) smp__release_param(p);
    return st;
}
/* While tracing, a module's parameters (and its children's) exist only for
   the duration of its call: tracing needs memory for the largest module.
   After a failure (*st) the counts still move, so the -1 that follows
   balances them, but nothing more is allocated. */
static void smp__materialise_tree(smp_module *m, int delta, smp_status *st) {
    m->materialised += delta;
    if ((delta > 0 && m->materialised == 1) || (delta < 0 && m->materialised == 0)) {
        for (int i = 0; i < m->nparams; i++) {
            if (delta < 0) smp__release_param(m->params[i]);
            else if (!*st) *st = smp__materialise_param(m->params[i]);
        }
    }
    for (int i = 0; i < m->nchildren; i++) smp__materialise_tree(m->children[i], delta, st);
}

/* Bytes of a module's parameters and its descendants': what its call holds. */
static double smp__tree_param_bytes(const smp_module *m) {
    double bytes = 0;
    for (int i = 0; i < m->nparams; i++) bytes += (double)smp_tensor_nbytes(&m->params[i]->value);
    for (int i = 0; i < m->nchildren; i++) bytes += smp__tree_param_bytes(m->children[i]);
    return bytes;
}

/* ---------------------------------------------------------------- the model */
static bool smp__model_on_device(const smp_model *m) { return m && m->desc.on_device; }

/* What an on_device model needs of the backend, checked when it is made. */
static smp_status smp__check_device_backend(void) {
    const smp_device_backend *b = &smp__ctx.device;
    if (!smp__ctx.has_device)
        return smp_error(
            SMP_ERR_ARG,
            "smp_model_new: the model is on_device, but no device backend is registered (include smp_nccl.h "
            "in the file that defines SMP_IMPLEMENTATION, or call smp_register_device_backend before smp_init)");
    const char *name = b->name ? b->name : "(unnamed)";
    const char *missing = !b->alloc            ? "alloc"
                          : !b->dealloc        ? "dealloc"
                          : !b->copy           ? "copy"
                          : !b->add            ? "add"
                          : !b->scale          ? "scale"
                          : !b->zero           ? "zero"
                          : !b->current_device ? "current_device"
                                               : NULL;
    if (missing)
        return smp_error(SMP_ERR_ARG,
                         "smp_model_new: the model is on_device, but the device backend \"%s\" has no %s function",
                         name, missing);
    if (b->current_device() <= SMP_HOST)
        return smp_error(
            SMP_ERR_DEVICE,
            "smp_model_new: the model is on_device, but the device backend \"%s\" has no usable device on this rank",
            name);
    return SMP_OK;
}

static void smp__collect(smp_status *st, smp_model *md, smp_module *m, int *mcap, int *pcap) {
    if (!smp__grow_or(st, (void **)&md->modules, mcap, md->nmodules + 1, sizeof(smp_module *),
                      "a model's list of modules"))
        return;
    md->modules[md->nmodules++] = m;
    for (int i = 0; i < m->nparams; i++) {
        if (!smp__grow_or(st, (void **)&md->params, pcap, md->nparams + 1, sizeof(smp_param *),
                          "a model's list of parameters"))
            return;
        md->params[md->nparams++] = m->params[i];
    }
    for (int i = 0; i < m->nchildren; i++) smp__collect(st, md, m->children[i], mcap, pcap);
}

/* The first module of a tree created inside an SMP_PARTITION context past
   the last partition (contexts opened before smp_init could not be checked
   when they were opened). */
static const smp_module *smp__bad_context(const smp_module *m, int partitions) {
    if (m->context_partition >= partitions) return m;
    for (int i = 0; i < m->nchildren; i++) {
        const smp_module *bad = smp__bad_context(m->children[i], partitions);
        if (bad) return bad;
    }
    return NULL;
}

SMPDEF smp_status smp_model_new(smp_module *root, const smp_model_desc *desc, smp_model **out) {
    smp_status st = smp__require_init("smp_model_new");
    if (!st && smp__mod.build_status) {
        st = smp_error(smp__mod.build_status, "%s", smp__mod.build_msg);
        smp__mod.build_status = SMP_OK;
    }
    if (!st) st = smp__check_contexts_closed();
    else smp__mod.depth = 0, smp__mod.stray_pop = false;
    if (!st && (!root || !desc || !desc->forward))
        st = smp_error(SMP_ERR_ARG, "smp_model_new needs a root module and a desc with a forward function");
    if (!st && root->parent) st = smp_error(SMP_ERR_ARG, "smp_model_new: module \"%s\" is not a root", root->full_name);
    if (!st && desc->on_device) st = smp__check_device_backend();
    if (!st) {
        const smp_module *bad = smp__bad_context(root, smp__ctx.cfg.partitions);
        if (bad)
            st = smp_error(
                SMP_ERR_CONFIG,
                "module \"%s\" was created inside SMP_PARTITION(%d): partition must be in 0..%d (partitions = %d)",
                bad->full_name, bad->context_partition, smp__ctx.cfg.partitions - 1, smp__ctx.cfg.partitions);
    }
    /* the registry smp_finalize frees forgotten models from */
    smp__grow_or(&st, (void **)&smp__mod.models, &smp__mod.models_cap, smp__mod.nmodels + 1, sizeof(smp_model *),
                 "the list of live models");
    if (st) { *out = NULL; return smp__agree_on(smp__ctx.world, st, "model construction"); }
    smp_model *m = (smp_model *)smp__alloc_or(&st, sizeof *m, SMP__ALLOC_OTHER, "a model");
    if (!st && !(m->cache = smp__cache_new())) st = smp__nomem(sizeof(smp__cache), "a model's cache of step memory");
    int mcap = 0, pcap = 0;
    if (!st) smp__collect(&st, m, root, &mcap, &pcap);
    if (!st) st = smp__shard_params(m);
    /* every rank must have its model before any keeps it (out of memory
       may strike one); until then the modules stay the engine's */
    st = smp__agree_on(smp__ctx.world, st, "model construction");
    if (st) {
        if (m) { smp__free(m->modules); smp__free(m->params); smp__cache_free(m->cache); }
        smp__free(m);
        *out = NULL;
        return st;
    }
    for (int i = 0; i < m->nmodules; i++) m->modules[i]->model = m;
    m->root = root;
    m->desc = *desc;
    if (m->desc.ninputs <= 0) m->desc.ninputs = 1;
    if (m->desc.noutputs <= 0) m->desc.noutputs = 1;
    smp__mod.models[smp__mod.nmodels++] = m; /* room made above */
    *out = m;
    return SMP_OK;
}

static void smp__free_calls(smp_model *m) {
    for (int i = 0; i < m->ncalls; i++) {
        smp__free(m->calls[i].in);
        smp__free(m->calls[i].in_meta);
        smp__free(m->calls[i].out_meta);
    }
    smp__free(m->calls);
    m->calls = NULL;
    m->ncalls = 0;
    smp__free(m->units);
    m->units = NULL;
    m->nunits = 0;
}

static void smp__free_module(smp_module *m) {
    for (int i = 0; i < m->nparams; i++) {
        smp__release_param(m->params[i]);
        smp__free(m->params[i]->name);
        smp__free(m->params[i]->full_name);
        smp__free(m->params[i]);
    }
    smp__free(m->params);
    smp__free(m->children);
    smp__free(m->name);
    smp__free(m->full_name);
    smp__free(m);
}

SMPDEF void smp_model_free(smp_model *m) {
    if (!m) return;
    for (int j = 0; j < smp__mod.nmodels; j++)
        if (smp__mod.models[j] == m) {
            memmove(smp__mod.models + j, smp__mod.models + j + 1,
                    sizeof(smp_model *) * (size_t)(smp__mod.nmodels - j - 1));
            smp__mod.nmodels--;
            break;
        }
    if (m->pipeline_free) m->pipeline_free(m->pipeline);
    for (int i = 0; i < m->nmodules; i++) {
        /* forget it in the registry, then free it */
        for (int j = 0; j < smp__mod.nall; j++)
            if (smp__mod.all[j] == m->modules[i]) { smp__mod.all[j] = smp__mod.all[--smp__mod.nall]; break; }
        smp__free_module(m->modules[i]);
    }
    smp__free(m->modules);
    smp__free(m->params);
    smp__free_calls(m);
    smp__free(m->outputs);
    smp__free(m->stage_rank); /* stage_first and stage_last share its block */
    smp__free(m->hooks);
    smp__free(m->grad_at); /* the gradient layout's block (smp__grad_layout) */
    smp__cache_free(m->cache); /* after everything its steps left */
    smp__free(m);
}

/* smp_finalize frees what the engine did not: models (with their modules,
   parameters and pipeline state: each smp_model_free, collective as that
   is, in creation order, the same on every rank) and modules never wrapped
   in a model. Without it every rank leaks them, which LeakSanitizer and
   UCX's exit checks report against the engine. Said only at INFO: freeing
   at shutdown is the finalizer's job, not the engine's mistake. */
static void smp__free_forgotten(void) {
    int nmodels = smp__mod.nmodels, nloose = 0;
    while (smp__mod.nmodels > 0) smp_model_free(smp__mod.models[0]);
    for (int j = 0; j < smp__mod.nall; j++, nloose++) smp__free_module(smp__mod.all[j]);
    if (nmodels || nloose)
        smp__log(SMP_LOG_INFO, "smp_finalize freed %d model%s and %d module%s the program had not freed", nmodels,
                 nmodels == 1 ? "" : "s", nloose, nloose == 1 ? "" : "s");
    smp__free(smp__mod.all);
    smp__free(smp__mod.models);
    smp__mod.all = NULL;
    smp__mod.models = NULL;
    smp__mod.nall = smp__mod.cap = smp__mod.nmodels = smp__mod.models_cap = 0;
    smp__mod.depth = 0;
    smp__mod.stray_pop = false;
}

SMPDEF bool smp_is_tracing(void) { return smp__mod.tracing; }
SMPDEF bool smp_model_is_partitioned(const smp_model *m) { return m->partitioned; }
SMP__CORE int smp_model_num_calls(const smp_model *m) { return m->ncalls; }
SMPDEF int smp_model_num_stages(const smp_model *m) { return m->nstages; }
SMPDEF int smp_model_stage_rank(const smp_model *m, int s) { return s >= 0 && s < m->nstages ? m->stage_rank[s] : -1; }
SMP__CORE int smp_model_call_stage(const smp_model *m, int c) {
    return c >= 0 && c < m->ncalls ? m->calls[c].stage : -1;
}
SMPDEF smp_param *smp_model_global_param(smp_model *m, int index, bool buffers) {
    if (index < 0) return NULL;
    if (buffers) return index < m->nparams ? m->params[index] : NULL; /* the checkpoint's loops: O(1) */
    for (int i = 0; i < m->nparams; i++)
        if (!m->params[i]->is_buffer && index-- == 0) return m->params[i];
    return NULL;
}
SMPDEF int smp_model_num_global_params(const smp_model *m, bool buffers) {
    int n = 0;
    for (int i = 0; i < m->nparams; i++) n += buffers || !m->params[i]->is_buffer;
    return n;
}
/* The leaf call whose last backward makes a parameter's gradient final:
   the first call that reads it (backwards run in reverse); -1 for a shared
   module's, final once the pipeline has summed its copies, and for one no call reads. */
static int smp__final_call(const smp_param *p) { return p->module->uses > 1 ? -1 : p->module->owner_call; }

static void smp__grad_layout_free(smp_model *m) {
    smp__free(m->grad_at); /* one block: the other arrays live in it */
    m->grad_at = m->bucket_numel = NULL;
    m->grad_order = m->grad_bucket = m->bucket_first = NULL;
    m->nbuckets = 0;
}

/* Lays the local gradients out in buckets (smp_model's grad_order and what follows it). */
static smp_status smp__grad_layout(smp_model *m) {
    smp__grad_layout_free(m);
    const smp_config *cfg = &smp__ctx.cfg;
    size_t np = (size_t)m->nparams + 1;
    smp_status st = SMP_OK;
    int64_t *block = (int64_t *)smp__alloc_or(&st, (2 * sizeof(int64_t) + 3 * sizeof(int)) * np + sizeof(int),
                                              SMP__ALLOC_OTHER, "the data-parallel buckets' layout");
    if (st) return st;
    m->grad_at = block;
    m->bucket_numel = block + np;
    m->grad_order = (int *)(void *)(block + 2 * np);
    m->grad_bucket = m->grad_order + np;
    m->bucket_first = m->grad_bucket + np;
    int n = 0, dp = smp_rdp_size();
    int64_t align = cfg->shard_optimizer_state == SMP_ON && dp > 1 ? dp : 1;
    for (int k = m->ncalls - 1; k >= -1; k--) /* those final only at the step's end go last */
        for (int i = m->nparams - 1; i >= 0; i--) {
            smp_param *p = m->params[i];
            if (!p->is_buffer && smp_module_is_local(p->module) && smp__final_call(p) == k) m->grad_order[n++] = i;
        }
    for (int i = 0; i < m->nparams; i++) m->grad_bucket[i] = -1;
    double cap = cfg->bucket_cap_mb * 1048576.0;
    for (int j = 0; j < n;) { /* a bucket: consecutive parameters of one dtype up to the cap */
        smp_dtype dt = m->params[m->grad_order[j]]->grad.dtype;
        size_t es = smp_dtype_size(dt), bytes = 0;
        int k = j;
        for (; k < n && m->params[m->grad_order[k]]->grad.dtype == dt; k++) {
            size_t more = bytes + smp_tensor_nbytes(&m->params[m->grad_order[k]]->grad);
            /* MPI counts are int */
            if (k > j && ((double)more > cap || more / es > (size_t)INT32_MAX - (size_t)align)) break;
            m->grad_bucket[m->grad_order[k]] = m->nbuckets;
            m->grad_at[m->grad_order[k]] = (int64_t)(bytes / es);
            bytes = more;
        }
        int64_t numel = (int64_t)(bytes / es);
        m->bucket_first[m->nbuckets] = j;
        m->bucket_numel[m->nbuckets++] = (numel + align - 1) / align * align;
        j = k;
    }
    m->bucket_first[m->nbuckets] = n;
    return SMP_OK;
}

/* Elements [*first, *first + *count) of local parameter p that rdp rank r owns under shard_optimizer_state (the
   whole of p without it): its share of r's piece of p's bucket. */
static void smp__owned_range(const smp_model *m, const smp_param *p, int r, int64_t *first, int64_t *count) {
    int64_t n = smp_tensor_numel(&p->value);
    int b = -1, dp = smp_rdp_size();
    int64_t at = 0;
    for (int i = 0; i < m->nparams && m->grad_bucket; i++)
        if (m->params[i] == p) { b = m->grad_bucket[i]; at = m->grad_at[i]; break; }
    *first = 0;
    *count = n;
    if (smp__ctx.cfg.shard_optimizer_state != SMP_ON || dp < 2 || p->is_buffer || b < 0) return;
    int64_t piece = m->bucket_numel[b] / dp, lo = piece * r, hi = lo + piece;
    int64_t a = lo > at ? lo : at, e = hi < at + n ? hi : at + n;
    *first = e > a ? a - at : 0;
    *count = e > a ? e - a : 0;
}

SMPDEF smp_status smp_param_owned_range(smp_model *m, const smp_param *p, int64_t *first, int64_t *count) {
    if (!m || !p || !first || !count)
        return smp_error(SMP_ERR_ARG, "smp_param_owned_range: model, parameter and outputs must not be NULL");
    if (!m->partitioned)
        return smp_error(SMP_ERR_STATE,
                         "smp_param_owned_range: the model is not partitioned yet (smp_model_trace or a first step)");
    if (!smp_module_is_local(p->module))
        return smp_error(SMP_ERR_ARG, "smp_param_owned_range: parameter '%s' does not live on this rank", p->full_name);
    smp__owned_range(m, p, smp_rdp_rank(), first, count);
    return SMP_OK;
}

/* smp_model_gather_params's work on a device model: per bucket, this replica's piece of the parameters laid out
   as the bucket lays out their gradients, the replicas' pieces gathered (the backend's all-gather), and each
   parameter copied back whole. A value's dtype must be its gradient's. */
static smp_status smp__gather_params_device(smp_model *m) {
    int dp = smp_rdp_size(), me = smp_rdp_rank();
    smp_status st = SMP_OK;
    for (int b = 0; b < m->nbuckets && !st; b++) {
        smp_dtype dt = m->params[m->grad_order[m->bucket_first[b]]]->grad.dtype;
        size_t es = smp_dtype_size(dt);
        int64_t piece = m->bucket_numel[b] / dp, first, count;
        smp_tensor mine = smp_tensor_1d(NULL, dt, piece), all = smp_tensor_1d(NULL, dt, m->bucket_numel[b]);
        smp__tensor_alloc_or(&st, &mine, true, SMP__ALLOC_COMM,
                             "the parameters a replica updated (shard_optimizer_state)");
        smp__tensor_alloc_or(&st, &all, true, SMP__ALLOC_COMM, "the replicas' parameters (shard_optimizer_state)");
        if (!st) st = smp__tensor_zero(&mine); /* the padding */
        for (int q = m->bucket_first[b]; q < m->bucket_first[b + 1] && !st; q++) {
            const smp_param *p = m->params[m->grad_order[q]];
            if (p->value.dtype != dt) {
                st = smp_error(SMP_ERR_STATE, "shard_optimizer_state on a device model gathers parameters in their "
                               "gradients' dtype, and '%s' holds %s values with %s gradients: leave "
                               "shard_optimizer_state off", p->full_name, smp_dtype_name(p->value.dtype),
                               smp_dtype_name(dt));
                break;
            }
            smp__owned_range(m, p, me, &first, &count);
            smp_tensor from = smp_tensor_1d((char *)p->value.data + (size_t)first * es, dt, count);
            int64_t at = m->grad_at[m->grad_order[q]] + first - piece * me; /* in this replica's piece */
            smp_tensor to = smp_tensor_1d((char *)mine.data + (size_t)at * es, dt, count);
            from.device = p->value.device;
            to.device = mine.device;
            if (count) st = smp__tensor_copy(&to, &from);
        }
        /* the replicas hold the same buckets; other partitions hold others (agreed with below, once) */
        st = smp__agree_on(smp__ctx.groups[SMP_RDP_GROUP].comm, st,
                           "gathering the replicas' parameter ranges (shard_optimizer_state)");
        if (!st) st = smp_all_gather(&mine, &all, SMP_RDP_GROUP);
        for (int q = m->bucket_first[b]; q < m->bucket_first[b + 1] && !st; q++) {
            smp_param *p = m->params[m->grad_order[q]];
            smp_tensor from = smp_tensor_1d((char *)all.data + (size_t)m->grad_at[m->grad_order[q]] * es, dt,
                                            smp_tensor_numel(&p->value));
            from.device = all.device;
            st = smp__tensor_copy(&p->value, &from);
        }
        smp__free(mine.data);
        smp__free(all.data);
    }
    return smp__agree_on(smp__ctx.world, st, "gathering the replicas' parameter ranges (shard_optimizer_state)");
}

/* smp_model_gather_params's work: every replica's owned range of every
   local parameter, packed in parameter order, gathered in RDP_GROUP. */
static smp_status smp__gather_params(smp_model *m) {
    int dp = smp_rdp_size(), me = smp_rdp_rank();
    size_t mine = 0, at = 0;
    int64_t first, count;
    for (int i = 0; i < m->nparams; i++) {
        smp_param *p = m->params[i];
        if (p->is_buffer || !smp_module_is_local(p->module)) continue;
        if (p->value.device != SMP_HOST) return smp__gather_params_device(m);
        smp__owned_range(m, p, me, &first, &count);
        mine += (size_t)count * smp_dtype_size(p->value.dtype);
    }
    smp_status st = SMP_OK;
    char *pack = (char *)smp__alloc_or(&st, mine + 1, SMP__ALLOC_COMM | SMP__UNINIT,
                                       "the parameters a replica updated (shard_optimizer_state)");
    size_t *lens = (size_t *)smp__alloc_or(&st, sizeof(size_t) * (size_t)dp, SMP__ALLOC_COMM | SMP__UNINIT,
                                           "the parameters' ranges");
    void *all = NULL;
    for (int i = 0; i < m->nparams && !st; i++) {
        smp_param *p = m->params[i];
        if (p->is_buffer || !smp_module_is_local(p->module)) continue;
        size_t es = smp_dtype_size(p->value.dtype);
        smp__owned_range(m, p, me, &first, &count);
        memcpy(pack + at, (const char *)p->value.data + (size_t)first * es, (size_t)count * es);
        at += (size_t)count * es;
    }
    st = smp__agree_on(smp__ctx.world, st, "gathering the replicas' parameter ranges (shard_optimizer_state)");
    if (!st) st = smp_all_gather_bytes(pack, mine, SMP_RDP_GROUP, &all, lens);
    at = 0;
    for (int r = 0; r < dp && !st; r++)
        for (int i = 0; i < m->nparams; i++) {
            smp_param *p = m->params[i];
            if (p->is_buffer || !smp_module_is_local(p->module)) continue;
            size_t es = smp_dtype_size(p->value.dtype);
            smp__owned_range(m, p, r, &first, &count);
            if (r != me) memcpy((char *)p->value.data + (size_t)first * es, (const char *)all + at, (size_t)count * es);
            at += (size_t)count * es;
        }
    smp__free(all);
    smp__free(pack);
    smp__free(lens);
    return st;
}

SMPDEF smp_status smp_model_gather_params(smp_model *m) {
    smp_status st = smp__require_init("smp_model_gather_params");
    if (st) return st;
    if (!m) return smp_error(SMP_ERR_ARG, "smp_model_gather_params: model is NULL");
    if (!m->params_stale) return SMP_OK; /* the same on every rank: set by the same steps */
    st = smp__gather_params(m);
    if (!st) m->params_stale = false;
    return st;
}

SMPDEF smp_param *smp_model_local_param(smp_model *m, int index, bool buffers) {
    for (int i = 0; i < m->nparams; i++) {
        smp_param *p = m->params[i];
        if ((!buffers && p->is_buffer) || !smp_module_is_local(p->module)) continue;
        if (index-- == 0) return p;
    }
    return NULL;
}
SMPDEF smp_param *smp_model_find_param(smp_model *m, const char *name) {
    for (int i = 0; i < m->nparams; i++)
        if (!strcmp(m->params[i]->full_name, name)) return m->params[i];
    return NULL;
}
SMPDEF void smp_model_on_partitioned(smp_model *m, smp_post_partition_fn fn, void *user) {
    if (m->partitioned) { fn(m, user); return; }
    size_t want = 0;
    if (!smp__grow((void **)&m->hooks, &m->hooks_cap, m->nhooks + 1, sizeof(smp__hook), &want)) {
        m->hooks_lost = want;
        return;
    }
    m->hooks[m->nhooks].fn = fn;
    m->hooks[m->nhooks++].user = user;
}
SMPDEF void smp_model_grads_restored(smp_model *m) { m->grads_restored = true; }
SMPDEF void smp_model_zero_grad(smp_model *m) {
    m->zero_grad_calls++;
    for (int i = 0; i < m->nparams; i++)
        if (m->params[i]->grad.data && !m->params[i]->is_buffer && smp__tensor_zero(&m->params[i]->grad))
            /* the device failed: gradients would silently accumulate */
            smp__fatal("smp_model_zero_grad: %s", smp__errbuf);
}

/* ---------------------------------------------------------------- module callbacks */
SMPDEF int smp_call_num_inputs(const smp_call_ctx *c) { return c->nin; }
SMPDEF int smp_call_num_outputs(const smp_call_ctx *c) { return c->nout; }
SMPDEF const smp_tensor *smp_call_input(const smp_call_ctx *c, int i) {
    return i >= 0 && i < c->nin ? &c->inputs[i] : NULL;
}
SMPDEF const smp_tensor *smp_call_output_value(const smp_call_ctx *c, int i) {
    return i >= 0 && i < c->nout ? &c->outputs[i] : NULL;
}
SMPDEF const smp_tensor *smp_call_grad_output(const smp_call_ctx *c, int i) {
    return c->in_backward && c->grad_outputs && i >= 0 && i < c->nout ? &c->grad_outputs[i] : NULL;
}
SMPDEF smp_tensor *smp_call_grad_input(smp_call_ctx *c, int i) {
    return c->in_backward && c->grad_inputs && i >= 0 && i < c->nin && c->grad_inputs[i].data ? &c->grad_inputs[i]
                                                                                              : NULL;
}
SMPDEF smp_module *smp_call_module(const smp_call_ctx *c) { return c->module; }
SMPDEF int smp_call_microbatch(const smp_call_ctx *c) { return c->microbatch; }
SMPDEF bool smp_call_is_training(const smp_call_ctx *c) { return c->training; }
SMPDEF uint64_t smp_call_seed(const smp_call_ctx *c) { return c->seed; }

/* Whether memory a callback asked for came; when not, the call fails with
   SMP_ERR_NOMEM whatever the callback returns (the out-of-memory policy). */
static bool smp__call_got(smp_call_ctx *c, const void *p, size_t bytes, const char *what) {
    if (!p && !c->nomem_what) { c->nomem_bytes = bytes; c->nomem_what = what; }
    return p != NULL;
}

SMPDEF smp_tensor *smp_call_output(smp_call_ctx *c, int i, smp_dtype dt, int ndim, const int64_t *shape) {
    if (c->in_backward || i < 0 || i >= c->nout || smp_dtype_size(dt) == 0 || ndim < 0 || ndim > SMP_MAX_DIMS)
        return NULL;
    c->made_output = true;
    smp_tensor *t = &c->outputs[i];
    if (t->data) smp__free(t->data); /* asked twice: the last one counts */
    *t = smp_tensor_make(NULL, dt, ndim, shape);
    smp_status st = SMP_OK; /* the call reports it (smp__call_got) */
    return smp__call_got(c, smp__tensor_alloc_or(&st, t, smp__model_on_device(c->module->model), c->kind, "an output"),
                         smp_tensor_nbytes(t), "an output")
               ? t
               : NULL;
}

SMPDEF void *smp_call_stash(smp_call_ctx *c, size_t bytes) {
    if (c->in_backward) return NULL;
    smp__free(c->stash);
    c->stash = smp__alloc(bytes ? bytes : 1, c->kind);
    c->stash_bytes = c->stash ? bytes : 0;
    return smp__call_got(c, c->stash, bytes, "a stash") ? c->stash : NULL;
}
SMPDEF void *smp_call_stash_device(smp_call_ctx *c, size_t bytes) {
    if (c->in_backward) return NULL;
    smp__free(c->device_stash);
    smp_tensor t = smp_tensor_1d(NULL, SMP_U8, (int64_t)bytes);
    smp_status st = SMP_OK; /* the call reports it (smp__call_got) */
    c->device_stash = smp__tensor_alloc_or(&st, &t, smp__model_on_device(c->module->model), c->kind, "a device stash");
    c->device_stash_bytes = c->device_stash ? bytes : 0;
    return smp__call_got(c, c->device_stash, bytes, "a device stash") ? c->device_stash : NULL;
}
SMPDEF void *smp_call_stashed_device(const smp_call_ctx *c, size_t *bytes) {
    if (bytes) *bytes = c->device_stash_bytes;
    return c->device_stash;
}
SMPDEF void *smp_call_stashed(const smp_call_ctx *c, size_t *bytes) {
    if (bytes) *bytes = c->stash_bytes;
    return c->stash;
}

/* ---------------------------------------------------------------- built-in modules */
static smp_status smp__add_forward(smp_call_ctx *c) {
    const smp_tensor *x0 = smp_call_input(c, 0);
    if (!x0) return smp_error(SMP_ERR_ARG, "add module \"%s\" needs at least one input", c->module->full_name);
    for (int j = 1; j < c->nin; j++) {
        const smp_tensor *x = smp_call_input(c, j);
        if (x->dtype != x0->dtype || smp_tensor_numel(x) != smp_tensor_numel(x0)) {
            char a[96], b[96];
            return smp_error(
                SMP_ERR_ARG,
                "add module \"%s\": input %d is %s but input 0 is %s (inputs must match in dtype and size)",
                c->module->full_name, j, smp__tensor_describe(x, a, sizeof a), smp__tensor_describe(x0, b, sizeof b));
        }
    }
    smp_tensor *y = smp_call_output(c, 0, x0->dtype, x0->ndim, x0->shape);
    if (!y)
        return smp_error(SMP_ERR_ARG, "add module \"%s\" is called with %d outputs; it has one", c->module->full_name,
                         c->nout);
    /* y = x0 + x1 in one pass (the sum a copy of x0 and then += x1 gave), then += the others */
    smp_status st = c->nin > 1 ? smp__add(y, x0, smp_call_input(c, 1)) : smp__tensor_copy(y, x0);
    for (int j = 2; j < c->nin && !st; j++) st = smp__add_into(y, smp_call_input(c, j));
    return st;
}
/* Sum and identity pass the output gradient to every input unchanged: a copy into each wanted input gradient but
   the first, which trades buffers with the output gradient instead (both are smp's blocks of the same bytes, on the
   same side, and the output gradient is not read after this backward), a pass less per call. */
static smp_status smp__pass_backward(smp_call_ctx *c) {
    smp_tensor *dy = (smp_tensor *)(uintptr_t)smp_call_grad_output(c, 0), *first = NULL;
    smp_status st = SMP_OK;
    for (int j = 0; j < c->nin && !st; j++) {
        smp_tensor *g = smp_call_grad_input(c, j);
        if (g && !first) first = g;
        else if (g) st = smp__tensor_copy(g, dy);
    }
    if (!st && first) {
        void *mine = first->data;
        first->data = dy->data;
        dy->data = mine;
    }
    return st;
}
static smp_status smp__identity_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    if (c->nin != 1 || c->nout != 1)
        return smp_error(SMP_ERR_ARG, "identity module \"%s\" takes one input and one output, got %d and %d",
                         c->module->full_name, c->nin, c->nout);
    smp_tensor *y = smp_call_output(c, 0, x->dtype, x->ndim, x->shape);
    return y ? smp__tensor_copy(y, x) : SMP_ERR_NOMEM; /* smp__run_callback says what was missing */
}
SMPDEF smp_module *smp_module_new_add(smp_module *parent, const char *name) {
    smp_module_desc d = {smp__add_forward, smp__pass_backward, NULL};
    smp_module *m = smp_module_new(parent, name, &d);
    smp_module_set_overwrites_grad_inputs(m, true); /* a copy each, or the output gradient's own buffer */
    return m;
}
SMPDEF smp_module *smp_module_new_identity(smp_module *parent, const char *name) {
    smp_module_desc d = {smp__identity_forward, smp__pass_backward, NULL};
    smp_module *m = smp_module_new(parent, name, &d);
    smp_module_set_overwrites_grad_inputs(m, true);
    return m;
}

/* ---------------------------------------------------------------- tensor-parallel modules */
/* Each runs its collective over TP_GROUP. The ranks of a TP group run the
   same calls in the same order (they hold the same partition of the same
   replica), so the collectives pair up; each first agrees on the shapes,
   so a mismatch is an error on every rank of the group rather than a
   collective on buffers of different sizes. */
typedef enum smp__tp_kind { SMP__TP_COPY, SMP__TP_REDUCE, SMP__TP_GATHER, SMP__TP_SCATTER } smp__tp_kind;
typedef struct smp__tp_module { smp__tp_kind kind; int axis; } smp__tp_module;
/* what a TP module's user pointer points to: copy, reduce, then gather and scatter along each axis */
static smp__tp_module smp__tp_table[2 + 2 * SMP_MAX_DIMS];

static const char *smp__tp_name(smp__tp_kind k) {
    return k == SMP__TP_COPY     ? "tp_copy"
           : k == SMP__TP_REDUCE ? "tp_reduce"
           : k == SMP__TP_GATHER ? "tp_gather"
                                 : "tp_scatter";
}

/* The TP handshake. Every TP module call starts with one over TP_GROUP:
   each rank sends every other its status and the signature (dtype, shape)
   of what it passes, point to point, and waits for theirs before any data
   moves. A rank whose step failed elsewhere (a module, an allocation, a
   pipeline peer's notice) sends its peers, once, a failed status in place
   of its next handshake (smp__tp_step_stopped): a peer waiting in that
   handshake, or reaching it, fails its call with the error, so the step
   fails on every rank of the group at once, with no TP collective started
   that a rank would not join. Every rank of the group sends the same
   number of handshakes in a step: a rank's next one after a failed status
   is the failed status itself; after a failed step every rank takes in
   what its peers sent (smp__tp_step_settle), so the next step starts with
   nothing in flight. Messages go on TP_GROUP's notice communicator. */
#define SMP__TAG_TP_HANDSHAKE 7004
typedef struct smp__tp_note {
    uint64_t seq;
    int64_t status, sig[2 + SMP_MAX_DIMS];
    char text[256];
} smp__tp_note;
static struct {
    uint64_t sent, *got;      /* handshakes sent to each peer; received from each (this rank's entry unused) */
    smp__tp_note *in, out;    /* [tp]: the peers' latest; this rank's, in flight while its sends are */
    MPI_Request *reqs;        /* [2 tp]: receives, then sends */
    int tp;
    bool by_peer, stopped;    /* this step: a peer's failed status arrived; this rank sent its own */
    bool in_module;           /* a TP module's collectives, after its handshake */
} smp__tph;

static void smp__tp_hs_free(void) {
    smp__free(smp__tph.got);
    smp__free(smp__tph.in);
    smp__free(smp__tph.reqs);
    memset(&smp__tph, 0, sizeof smp__tph);
}
static bool smp__tp_hs_ready(void) {
    int tp = smp_tp_size();
    if (smp__tph.tp == tp) return true;
    smp__tp_hs_free();
    smp__tph.got = (uint64_t *)smp__alloc(sizeof(uint64_t) * (size_t)tp, SMP__ALLOC_OTHER);
    smp__tph.in = (smp__tp_note *)smp__alloc(sizeof(smp__tp_note) * (size_t)tp, SMP__ALLOC_OTHER);
    smp__tph.reqs = (MPI_Request *)smp__alloc(sizeof(MPI_Request) * 2 * (size_t)tp, SMP__ALLOC_OTHER);
    if (!smp__tph.got || !smp__tph.in || !smp__tph.reqs) {
        smp__tp_hs_free();
        return false;
    }
    memset(smp__tph.got, 0, sizeof(uint64_t) * (size_t)tp);
    smp__tph.tp = tp;
    return true;
}

static void smp__tp_note_error(smp__tp_note *o) { /* this rank's error, as much as fits */
    size_t k = strlen(smp__errbuf);
    k = k < sizeof o->text - 1 ? k : sizeof o->text - 1;
    memcpy(o->text, smp__errbuf, k);
    o->text[k] = 0;
}

/* Sends this rank's next handshake (smp__tph.out, seq set here) to every peer and, with `receive`, takes in
   theirs of the same number; waits for both. */
static void smp__tp_hs_exchange(bool receive, const char *what) {
    smp__group_info *gi = smp__group(SMP_TP_GROUP);
    int tp = smp__tph.tp, n = 0;
    smp__tph.out.seq = ++smp__tph.sent;
    for (int r = 0; r < tp; r++) {
        if (r == gi->rank) continue;
        if (receive)
            SMP__MPI_FATAL(MPI_Irecv(&smp__tph.in[r], (int)sizeof(smp__tp_note), MPI_BYTE, r, SMP__TAG_TP_HANDSHAKE,
                                     gi->notices, &smp__tph.reqs[n++]),
                           "posting the receive of tp rank %d's handshake (%s)", r, what);
        SMP__MPI_FATAL(MPI_Isend(&smp__tph.out, (int)sizeof(smp__tp_note), MPI_BYTE, r, SMP__TAG_TP_HANDSHAKE,
                                 gi->notices, &smp__tph.reqs[n++]),
                       "sending tp rank %d this rank's handshake (%s)", r, what);
    }
    smp_wait_requests(n, smp__tph.reqs, what, SMP_TP_GROUP, -1);
    for (int r = 0; receive && r < tp; r++)
        if (r != gi->rank) smp__tph.got[r]++;
}

/* The handshake before a TP module's collective (tp > 1): `local` is this rank's status so far (an allocation
   that failed); every rank returns the same verdict: a rank's failure (its message), or shapes that differ. */
static smp_status smp__tp_handshake(const smp_call_ctx *c, const smp_tensor *t, const char *what, smp_status local) {
    const char *kind = smp__tp_name(((const smp__tp_module *)c->module->desc.user)->kind), *name = c->module->full_name;
    if (!smp__tp_hs_ready()) return smp__nomem(sizeof(smp__tp_note) * 4, "the TP group's handshake");
    int tp = smp__tph.tp, me = smp_tp_rank();
    smp__tp_note *o = &smp__tph.out;
    memset(o, 0, sizeof *o);
    o->status = local;
    o->sig[0] = t->dtype;
    o->sig[1] = t->ndim;
    for (int d = 0; d < t->ndim; d++) o->sig[2 + d] = t->shape[d];
    if (local) smp__tp_note_error(o);
    smp__tp_hs_exchange(true, "the TP group's handshake before a TP module's collective");
    smp__tph.in[me] = *o;
    if (local) { smp__tph.stopped = true; return local; }
    for (int r = 0; r < tp; r++)
        if (smp__tph.in[r].status) {
            smp__tph.by_peer = true;
            return smp_error(SMP_ERR_REMOTE, "%s module \"%s\": tp rank %d (world rank %d) failed this step: %s", kind,
                             name, r, smp_group_world_rank(SMP_TP_GROUP, r), smp__tph.in[r].text);
        }
    for (int r = 1; r < tp; r++) {
        if (!memcmp(smp__tph.in[0].sig, smp__tph.in[r].sig, sizeof o->sig)) continue;
        const int64_t *a = smp__tph.in[0].sig, *b = smp__tph.in[r].sig;
        smp_tensor t0 = smp_tensor_make(NULL, (smp_dtype)a[0], (int)a[1], a + 2);
        smp_tensor tr = smp_tensor_make(NULL, (smp_dtype)b[0], (int)b[1], b + 2);
        char d0[96], dr[96];
        return smp_error(SMP_ERR_ARG,
                         "%s module \"%s\": %s is %s on tp rank 0 but %s on tp rank %d: every rank of a TP group "
                         "must pass the same dtype and shape",
                         kind, name, what, smp__tensor_describe(&t0, d0, sizeof d0),
                         smp__tensor_describe(&tr, dr, sizeof dr), r);
    }
    return SMP_OK;
}

/* The handshake before a collective the engine runs over TP_GROUP in a
   step (a vocabulary-parallel loss's sums in the step body): the status
   alone, the collective checks its own arguments. */
static smp_status smp__tp_coll_handshake(smp_group g) {
    if (g != SMP_TP_GROUP || !smp__ctx.initialized || !smp__ctx.at.in_step || smp_tp_size() < 2 || smp__tph.in_module)
        return SMP_OK;
    if (!smp__tp_hs_ready()) return smp__nomem(sizeof(smp__tp_note) * 4, "the TP group's handshake");
    memset(&smp__tph.out, 0, sizeof smp__tph.out);
    smp__tp_hs_exchange(true, "the TP group's handshake before a collective over TP_GROUP");
    for (int r = 0; r < smp__tph.tp; r++)
        if (r != smp_tp_rank() && smp__tph.in[r].status) {
            smp__tph.by_peer = true;
            return smp_error(SMP_ERR_REMOTE, "a collective over TP_GROUP: tp rank %d (world rank %d) failed this step: %s",
                             r, smp_group_world_rank(SMP_TP_GROUP, r), smp__tph.in[r].text);
        }
    return SMP_OK;
}

/* A step that failed on this rank (st) stops here: its TP peers hear of it
   at their next handshake, unless it failed in one (they know then). */
SMP__CORE void smp__tp_step_stopped(smp_status st) {
    if (smp_tp_size() < 2 || smp__tph.by_peer || smp__tph.stopped || !smp__tp_hs_ready()) return;
    memset(&smp__tph.out, 0, sizeof smp__tph.out);
    smp__tph.out.status = st;
    smp__tp_note_error(&smp__tph.out);
    smp__tp_hs_exchange(false, "this rank's failure to its TP peers");
    smp__tph.stopped = true;
}

/* After a step every rank agreed failed: every rank of the TP group has sent
   as many handshakes as the one that sent most (a rank that finished its
   schedule sends its failed status now), and takes in every one its peers
   sent, so none is left for the next step's handshakes. */
SMP__CORE void smp__tp_step_settle(void) {
    if (smp_tp_size() < 2 || !smp__tp_hs_ready()) return;
    smp__group_info *gi = smp__group(SMP_TP_GROUP);
    unsigned long long most = smp__tph.sent;
    MPI_Request req;
    SMP__MPI_FATAL(MPI_Iallreduce(MPI_IN_PLACE, &most, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, gi->notices, &req),
                   "agreeing on the TP handshakes of a failed step");
    smp_wait_requests(1, &req, "the TP handshakes of a failed step", SMP_TP_GROUP, -1);
    if (smp__tph.sent < most) {
        memset(&smp__tph.out, 0, sizeof smp__tph.out);
        smp__tph.out.status = SMP_ERR_REMOTE;
        smp__tp_hs_exchange(false, "this rank's failure to its TP peers");
    }
    for (int r = 0; r < smp__tph.tp; r++)
        while (r != gi->rank && smp__tph.got[r] < most) {
            smp__tp_note drop;
            SMP__MPI_FATAL(MPI_Irecv(&drop, (int)sizeof drop, MPI_BYTE, r, SMP__TAG_TP_HANDSHAKE, gi->notices, &req),
                           "taking in tp rank %d's handshake of a failed step", r);
            smp_wait_requests(1, &req, "a TP handshake of a failed step", SMP_TP_GROUP, r);
            smp__tph.got[r]++;
        }
    smp__tph.by_peer = smp__tph.stopped = false;
}
SMP__CORE void smp__tp_step_begin(void) { smp__tph.by_peer = smp__tph.stopped = false; }

/* outer x (axis length) x inner of t around axis, in elements; rows are (axis length x inner). */
static void smp__around_axis(const smp_tensor *t, int axis, int64_t *outer, int64_t *inner) {
    *outer = *inner = 1;
    for (int d = 0; d < axis; d++) *outer *= t->shape[d];
    for (int d = axis + 1; d < t->ndim; d++) *inner *= t->shape[d];
}

/* Moves `outer` x `parts` blocks of `block` bytes between layouts: to_parts
   true reads [outer][parts] and writes [parts][outer], false the reverse. */
static smp_status smp__tp_regroup(void *dst, const void *src, int device, int64_t outer, int parts, size_t block,
                                  bool to_parts) {
    smp_status st = SMP_OK;
    for (int64_t o = 0; o < outer && !st; o++)
        for (int r = 0; r < parts && !st; r++) {
            size_t a = ((size_t)o * (size_t)parts + (size_t)r) * block,
                   b = ((size_t)r * (size_t)outer + (size_t)o) * block;
            char *d = (char *)dst + (to_parts ? b : a);
            const char *x = (const char *)src + (to_parts ? a : b);
            if (device == SMP_HOST) memcpy(d, x, block);
            else st = smp__ctx.device.copy(d, device, x, device, block);
        }
    return st;
}

/* out = the sum over the TP group of each rank's `in` (out may be in); in
   deterministic_reduction mode summed in tp-rank order on every rank, so
   every rank holds the same bits, from `all` (scratch of tp x in's
   elements). `scatter`: in holds tp blocks, and out gets the sum of block
   tp_rank (a reduce-scatter). */
static smp_status smp__tp_sum(const smp_tensor *in, smp_tensor *out, bool scatter, void *all_data) {
    int tp = smp_tp_size();
    if (smp__ctx.cfg.deterministic_reduction != SMP_ON)
        return scatter ? smp_reduce_scatter(in, out, SMP_SUM, SMP_TP_GROUP)
                       : smp_all_reduce(in, out, SMP_SUM, SMP_TP_GROUP);
    int64_t n = smp_tensor_numel(in), block = smp_tensor_numel(out);
    smp_tensor all = smp_tensor_1d(all_data, in->dtype, n * tp);
    all.device = in->device;
    smp_status st = smp_all_gather(in, &all, SMP_TP_GROUP);
    size_t es = smp_dtype_size(in->dtype), skip = scatter ? (size_t)block * (size_t)smp_tp_rank() * es : 0;
    smp_tensor part = smp_tensor_1d(NULL, in->dtype, block);
    part.device = all.device;
    for (int r = 0; r < tp && !st; r++) {
        part.data = (char *)all.data + (size_t)r * (size_t)n * es + skip;
        st = r == 0 ? smp__tensor_copy(out, &part) : smp__add_into(out, &part);
    }
    return st;
}

/* All-gather along axis: out is in with that axis tp times longer, rank r's
   slice at r x in's length; `all`: scratch of out's elements (axis > 0). */
static smp_status smp__tp_gather(const smp_tensor *in, smp_tensor *out, int axis, void *all_data) {
    int64_t outer, inner;
    smp__around_axis(in, axis, &outer, &inner);
    if (outer == 1) { /* the ranks' blocks are the output as it lies */
        smp_tensor flat = smp_tensor_1d(out->data, out->dtype, smp_tensor_numel(out));
        flat.device = out->device;
        return smp_all_gather(in, &flat, SMP_TP_GROUP);
    }
    smp_tensor all = smp_tensor_1d(all_data, in->dtype, smp_tensor_numel(out));
    all.device = in->device;
    smp_status st = smp_all_gather(in, &all, SMP_TP_GROUP);
    size_t row = (size_t)(in->shape[axis] * inner) * smp_dtype_size(in->dtype);
    if (!st) st = smp__tp_regroup(out->data, all.data, out->device, outer, smp_tp_size(), row, false);
    return st;
}

/* Reduce-scatter along axis: out is in with that axis tp times shorter,
   the sum over the group of every rank's slice tp_rank. Scratch: in's
   elements (axis > 0), then smp__tp_sum's. */
static smp_status smp__tp_scatter(const smp_tensor *in, smp_tensor *out, int axis, void *scratch) {
    int64_t outer, inner;
    smp__around_axis(in, axis, &outer, &inner);
    smp_tensor flat = smp_tensor_1d(in->data, in->dtype, smp_tensor_numel(in)),
               part = smp_tensor_1d(out->data, out->dtype, smp_tensor_numel(out));
    flat.device = in->device;
    part.device = out->device;
    if (outer == 1) return smp__tp_sum(&flat, &part, true, scratch);
    flat.data = scratch;
    size_t row = (size_t)(out->shape[axis] * inner) * smp_dtype_size(in->dtype);
    smp_status st = smp__tp_regroup(flat.data, in->data, in->device, outer, smp_tp_size(), row, true);
    if (!st) st = smp__tp_sum(&flat, &part, true, (char *)scratch + smp_tensor_nbytes(in));
    return st;
}

/* The scratch a TP module's collective needs, in elements of x's dtype, taken before the handshake so that
   running out of memory fails the call on every rank of the group, not half of a collective. */
static int64_t smp__tp_scratch_elements(const smp_tensor *x, const smp_tensor *y, bool along, bool grows, bool sums,
                                        int axis) {
    int64_t outer = 1, inner, n = smp_tensor_numel(x), tp = smp_tp_size();
    bool det = smp__ctx.cfg.deterministic_reduction == SMP_ON;
    if (along) smp__around_axis(x, axis, &outer, &inner);
    if (along && grows) return outer == 1 ? 0 : smp_tensor_numel(y);
    if (along) return (outer == 1 ? 0 : n) + (det ? n * tp : 0);
    return sums && det ? n * tp : 0;
}

/* One collective of a TP module, forward (x: the input) or backward (x: the
   output gradient); y is allocated here in the forward, given in the
   backward. At tp > 1 the TP handshake comes first (smp__tp_handshake). */
static smp_status smp__tp_run(smp_call_ctx *c, bool forward) {
    const smp__tp_module *tm = (const smp__tp_module *)c->module->desc.user;
    const char *name = smp__tp_name(tm->kind);
    if (c->nin != 1 || c->nout != 1)
        return smp_error(SMP_ERR_ARG, "%s module \"%s\" takes one input and one output, got %d and %d", name,
                         c->module->full_name, c->nin, c->nout);
    const smp_tensor *x = forward ? smp_call_input(c, 0) : smp_call_grad_output(c, 0);
    smp_tensor *y = forward ? NULL : smp_call_grad_input(c, 0);
    if (!forward && !y) return SMP_OK; /* no gradient wanted: the same on every TP rank, which run the same graph */
    bool sums = forward ? tm->kind == SMP__TP_REDUCE || tm->kind == SMP__TP_SCATTER
                        : tm->kind == SMP__TP_COPY || tm->kind == SMP__TP_GATHER;
    /* gather <-> scatter; copy, reduce keep the shape */
    bool along = tm->kind == SMP__TP_GATHER || tm->kind == SMP__TP_SCATTER;
    bool grows = along && (tm->kind == SMP__TP_GATHER) == forward;
    int tp = smp_tp_size();
    if (along && (tm->axis < 0 || tm->axis >= x->ndim))
        return smp_error(SMP_ERR_ARG, "%s module \"%s\" works along axis %d, but its %s has %d axes", name,
                         c->module->full_name, tm->axis, forward ? "input" : "output gradient", x->ndim);
    /* what fails here fails on this rank alone: the handshake tells the others */
    smp_status local = SMP_OK;
    if (along && !grows && x->shape[tm->axis] % tp)
        local = smp_error(
            SMP_ERR_ARG,
            "%s module \"%s\": axis %d of its %s has length %lld, which tensor_parallel_degree = %d does not "
            "divide",
            name, c->module->full_name, tm->axis, forward ? "input" : "output gradient", (long long)x->shape[tm->axis],
            tp);
    if (!local && forward) {
        int64_t shape[SMP_MAX_DIMS];
        memcpy(shape, x->shape, sizeof shape);
        if (along) shape[tm->axis] = grows ? shape[tm->axis] * tp : shape[tm->axis] / tp;
        if (!(y = smp_call_output(c, 0, x->dtype, x->ndim, shape)))
            local = smp_error(SMP_ERR_NOMEM, "%s module \"%s\": out of memory for its output of %s", name,
                              c->module->full_name, smp_dtype_name(x->dtype));
    }
    smp_tensor scratch = smp_tensor_1d(NULL, x->dtype, 0);
    if (!local && tp > 1) {
        scratch.shape[0] = smp__tp_scratch_elements(x, y, along, grows, sums, tm->axis);
        if (scratch.shape[0])
            smp__tensor_alloc_or(&local, &scratch, x->device != SMP_HOST, SMP__ALLOC_OTHER,
                                 "a TP collective's scratch (every rank's part, or the blocks regrouped)");
    }
    if (tp > 1) local = smp__tp_handshake(c, x, forward ? "the input" : "the output gradient", local);
    smp_status st = local;
    smp__tph.in_module = true; /* its collectives follow its own handshake */
    if (!st && (tp == 1 || (!along && !sums))) st = smp__tensor_copy(y, x);
    else if (!st && !along) st = smp__tp_sum(x, y, false, scratch.data);
    else if (!st) st = grows ? smp__tp_gather(x, y, tm->axis, scratch.data) : smp__tp_scatter(x, y, tm->axis, scratch.data);
    smp__tph.in_module = false;
    smp__free(scratch.data);
    return st;
}
static double smp__tp_seconds_total; /* smp_tp_seconds */
static smp_status smp__tp_timed(smp_call_ctx *c, bool forward) {
    double t0 = MPI_Wtime();
    smp_status st = smp__tp_run(c, forward);
    smp__tp_seconds_total += MPI_Wtime() - t0;
    return st;
}
static smp_status smp__tp_forward(smp_call_ctx *c) { return smp__tp_timed(c, true); }
static smp_status smp__tp_backward(smp_call_ctx *c) { return smp__tp_timed(c, false); }
SMPDEF double smp_tp_seconds(void) { return smp__tp_seconds_total; }

static smp_module *smp__tp_module_new(smp_module *parent, const char *name, smp__tp_kind kind, int axis) {
    if ((kind == SMP__TP_GATHER || kind == SMP__TP_SCATTER) && (axis < 0 || axis >= SMP_MAX_DIMS)) {
        smp__build_error(SMP_ERR_ARG, "%s module \"%s\": axis %d is not an axis of any tensor (0 to %d)",
                         smp__tp_name(kind), name ? name : "(null)", axis, SMP_MAX_DIMS - 1);
        return NULL;
    }
    int at = kind == SMP__TP_COPY     ? 0
             : kind == SMP__TP_REDUCE ? 1
                                      : 2 + (kind == SMP__TP_SCATTER) * SMP_MAX_DIMS + axis;
    smp__tp_table[at].kind = kind;
    smp__tp_table[at].axis = axis;
    smp_module_desc d = {smp__tp_forward, smp__tp_backward, &smp__tp_table[at]};
    return smp_module_new(parent, name, &d);
}
SMPDEF smp_module *smp_module_new_tp_copy(smp_module *parent, const char *name) {
    return smp__tp_module_new(parent, name, SMP__TP_COPY, 0);
}
SMPDEF smp_module *smp_module_new_tp_reduce(smp_module *parent, const char *name) {
    return smp__tp_module_new(parent, name, SMP__TP_REDUCE, 0);
}
SMPDEF smp_module *smp_module_new_tp_gather(smp_module *parent, const char *name, int axis) {
    return smp__tp_module_new(parent, name, SMP__TP_GATHER, axis);
}
SMPDEF smp_module *smp_module_new_tp_scatter(smp_module *parent, const char *name, int axis) {
    return smp__tp_module_new(parent, name, SMP__TP_SCATTER, axis);
}

/* What a callback run does: the forward, the whole backward, or its two
   halves (a module without the split runs its backward whole as B, and
   has no W). */
typedef enum smp__phase { SMP__FORWARD, SMP__BACKWARD, SMP__BACKWARD_INPUT, SMP__BACKWARD_WEIGHT } smp__phase;
static bool smp__split_backward(const smp_module *m) { return m->backward_input != NULL; }

/* Runs one phase of a module's callbacks with `c` as the current call. */
static smp_status smp__run_callback(smp_call_ctx *c, smp__phase phase) {
    const smp_module_desc *d = &c->module->desc;
    bool split = smp__split_backward(c->module);
    if (phase == SMP__BACKWARD && split) {
        smp_status st = smp__run_callback(c, SMP__BACKWARD_INPUT);
        return st ? st : smp__run_callback(c, SMP__BACKWARD_WEIGHT);
    }
    smp_module_fn fn = phase == SMP__FORWARD ? d->forward : phase == SMP__BACKWARD_WEIGHT ? c->module->backward_weight
                       : split ? c->module->backward_input : d->backward;
    if (!fn)
        return phase != SMP__FORWARD ? SMP_OK
                                     : smp_error(SMP_ERR_MODULE, "module \"%s\" has no forward", c->module->full_name);
    smp_call_ctx *saved = smp__mod.current;
    smp__mod.current = c;
    c->in_backward = phase != SMP__FORWARD;
    smp__errbuf[0] = 0;
    smp_status st = fn(c);
    smp__mod.current = saved;
    if (c->nomem_what) {
        static const char *const what[] = {"forward", "backward", "backward_input", "backward_weight"};
        char msg[256];
        snprintf(msg, sizeof msg, "%s of the %s of module \"%s\" (microbatch %d)", c->nomem_what, what[phase],
                 c->module->full_name, c->microbatch);
        c->nomem_what = NULL;
        return smp__nomem(c->nomem_bytes, msg);
    }
    if (st) {
        static const char *const what[] = {"forward", "backward", "backward_input", "backward_weight"};
        char msg[sizeof smp__errbuf];
        snprintf(msg, sizeof msg, "%s", smp__errbuf);
        return smp_error(st == SMP_ERR_NOMEM ? st : SMP_ERR_MODULE, "%s of module \"%s\" failed (microbatch %d): %s",
                         what[phase], c->module->full_name, c->microbatch, *msg ? msg : smp_status_name(st));
    }
    if (phase == SMP__FORWARD && !c->made_calls) /* a composite's outputs: smp__check_composite */
        for (int i = 0; i < c->nout; i++)
            if (!c->outputs[i].data)
                return smp_error(SMP_ERR_MODULE,
                                 "forward of module \"%s\" did not allocate output %d (smp_call_output)",
                                 c->module->full_name, i);
    return SMP_OK;
}

/* Frees what a call holds: outputs (unless kept) and stash. */
static void smp__call_release(smp_call_ctx *c, bool outputs) {
    for (int i = 0; i < c->nout && outputs && c->outputs; i++) {
        smp__free(c->outputs[i].data);
        c->outputs[i].data = NULL;
    }
    smp__free(c->stash);
    smp__free(c->device_stash);
    c->stash = c->device_stash = NULL;
    c->stash_bytes = c->device_stash_bytes = 0;
}

/* The trace's table: every tensor the forward has been handed (model
   inputs, leaf outputs) and a checksum of its bytes, so that an edit made
   after smp_call returned (which replaying the calls would silently drop)
   is caught where the tensor is next read. */
static uint64_t smp__checksum(const smp_tensor *t) {
    size_t n = smp_tensor_nbytes(t);
    const unsigned char *b = (const unsigned char *)t->data;
    void *copy = NULL;
    if (t->device != SMP_HOST && n) { /* tracing only: a host copy is affordable */
        smp_tensor h = *t;
        h.device = SMP_HOST;
        h.data = copy = smp__alloc(n, SMP__ALLOC_OTHER);
        if (!copy || smp__tensor_copy(&h, t))
            smp__fatal("cannot copy a traced tensor to the host to checksum it: %s", smp__errbuf);
        b = (const unsigned char *)copy;
    }
    uint64_t h = 0xcbf29ce484222325ull ^ n, w;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) { memcpy(&w, b + i, 8); h = (h ^ w) * 0x100000001b3ull; h ^= h >> 29; }
    for (; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    smp__free(copy);
    return h;
}
static int smp__trace_find(const void *data) {
    for (int i = smp__mod.ntable - 1; i >= 0; i--)
        if (smp__mod.table[i].t.data == data) return i;
    return -1;
}
/* Room for n more entries; adding then cannot fail. */
static bool smp__trace_reserve(smp_status *st, int n) {
    return smp__grow_or(st, (void **)&smp__mod.table, &smp__mod.table_cap, smp__mod.ntable + n, sizeof *smp__mod.table,
                        "the trace's table of tensors");
}
static void smp__trace_add(const smp_tensor *t, int call, int index, bool owned) {
    SMP_ASSERT(smp__mod.ntable < smp__mod.table_cap);
    smp__mod.table[smp__mod.ntable].t = *t;
    smp__mod.table[smp__mod.ntable].ref.call = call;
    smp__mod.table[smp__mod.ntable].ref.index = index;
    smp__mod.table[smp__mod.ntable].sum = smp__checksum(t);
    smp__mod.table[smp__mod.ntable++].owned = owned;
}
/* Entry e must be as it was handed out; `where` says who reads it now. */
static smp_status smp__trace_check(int e, const char *where) {
    if (smp__checksum(&smp__mod.table[e].t) == smp__mod.table[e].sum) return SMP_OK;
    smp__ref r = smp__mod.table[e].ref;
    const char *how =
        "outputs are read-only in the model's and composites' forwards: put the computation in a leaf module "
        "(smp_module_new_add for a residual), which writes a new output";
    if (r.call < 0)
        return smp_error(SMP_ERR_ARG, "model input %d was changed in place during the model's forward (seen %s); %s",
                         r.index, where, how);
    return smp_error(SMP_ERR_ARG,
                     "output %d of call %d (module \"%s\") was changed in place after smp_call returned it (seen %s); "
                     "the model's forward, a composite's forward or a later module's forward wrote into it; %s",
                     r.index, r.call, smp__mod.trace_model->calls[r.call].module->full_name, where, how);
}

/* Swaps the gradients of a module tree's parameters with zeroed scratch
   (restore false) or gives the first `swapped` originals back (restore
   true): the trace's backward must not add into a gradient that exists
   beyond the trace. */
static smp_status smp__trace_scratch_grads(smp_module *m, bool on_device, bool restore, smp_tensor **saved, int *n,
                                           int *cap, int swapped) {
    smp_status st = SMP_OK;
    for (int i = 0; i < m->nparams && !st; i++) {
        smp_param *p = m->params[i];
        if (p->is_buffer || !p->grad.data || (restore && *n == swapped)) continue;
        if (restore) {
            smp__free(p->grad.data);
            p->grad = (*saved)[(*n)++];
            continue;
        }
        if (!smp__grow((void **)saved, cap, *n + 1, sizeof(smp_tensor), NULL))
            return smp__nomem(sizeof(smp_tensor) * (size_t)(*n + 1), "tracing");
        smp_tensor scratch = p->grad;
        if (!smp__tensor_alloc_or(&st, &scratch, on_device, SMP__ALLOC_OTHER, "a scratch gradient while tracing"))
            break;
        (*saved)[(*n)++] = p->grad;
        p->grad = scratch;
        st = smp__tensor_zero(&p->grad);
    }
    for (int i = 0; i < m->nchildren && !st; i++)
        st = smp__trace_scratch_grads(m->children[i], on_device, restore, saved, n, cap, swapped);
    return st;
}

/* Runs a traced call's backward once on zero output gradients and adds its
   time to *time: a stage's cost is its forward and its backward, and the two
   differ per call (the first layer computes no input gradient, for one), so
   timing forwards alone misplaces the balance point. */
/* The clock tracing times calls by. A host call's cost is the processor
   time the process spends in it, not the wall time: on a machine whose
   cores are shared (CI, a developer's laptop, ranks sharing cores) wall
   times measure the neighbours, and partitioning on them moved modules from
   run to run. Process time counts every thread, so a multithreaded kernel
   weighs its whole work. Device work is asynchronous and waited for, so a
   device call's cost is wall time up to the synchronisation. */
static double smp__trace_now(bool device) { return device ? smp__now() : (double)clock() / CLOCKS_PER_SEC; }

/* time[0]: B, time[1]: W */
static smp_status smp__trace_backward(smp_call_ctx *c, const smp__call_rec *rec, double *time) {
    if (!c->module->desc.backward && !smp__split_backward(c->module)) return SMP_OK;
    bool dev = smp__model_on_device(c->module->model);
    smp_status st = SMP_OK;
    smp_tensor *gout =
        (smp_tensor *)smp__alloc_or(&st, sizeof(smp_tensor) * (size_t)c->nout, SMP__ALLOC_OTHER, "tracing");
    smp_tensor *gin =
        (smp_tensor *)smp__alloc_or(&st, sizeof(smp_tensor) * (size_t)(c->nin + 1), SMP__ALLOC_OTHER, "tracing");
    if (st) { smp__free(gout); return st; }
    smp_tensor *saved = NULL;
    int nsaved = 0, cap = 0;
    for (int j = 0; j < c->nout && !st; j++) {
        gout[j] = c->outputs[j];
        if (smp__tensor_alloc_or(&st, &gout[j], dev, SMP__ALLOC_OTHER, "an output gradient while tracing"))
            st = smp__tensor_zero(&gout[j]);
    }
    for (int j = 0; j < c->nin && !st; j++) {
        gin[j] = c->inputs[j];
        gin[j].data = NULL;
        if (rec->in[j].call < 0) continue; /* as in a step: model inputs take no gradient */
        if (smp__tensor_alloc_or(&st, &gin[j], dev, SMP__ALLOC_OTHER, "an input gradient while tracing") &&
            !c->module->overwrites_grad_inputs)
            st = smp__tensor_zero(&gin[j]);
    }
    if (!st) st = smp__trace_scratch_grads(c->module, dev, false, &saved, &nsaved, &cap, 0);
    if (!st) {
        c->grad_outputs = gout;
        c->grad_inputs = gin;
        smp_status (*sync)(void) = dev ? smp__ctx.device.synchronize : NULL;
        for (int half = 0; half < 2 && !st; half++) {
            double t0 = smp__trace_now(dev);
            st = smp__run_callback(c, half ? SMP__BACKWARD_WEIGHT : SMP__BACKWARD_INPUT);
            if (!st && sync) st = sync();
            time[half] += smp__trace_now(dev) - t0;
        }
        c->in_backward = false;
        c->grad_outputs = NULL;
        c->grad_inputs = NULL;
    }
    int swapped = nsaved;
    nsaved = 0;
    smp__trace_scratch_grads(c->module, dev, true, &saved, &nsaved, &cap, swapped);
    smp__free(saved);
    for (int j = 0; j < c->nout; j++) smp__free(gout[j].data);
    for (int j = 0; j < c->nin; j++) smp__free(gin[j].data);
    smp__free(gout);
    smp__free(gin);
    return st;
}

/* Per-call seeds: splitmix over the global seed, the leaf call, the sample
   position (data-parallel rank x microbatches + microbatch, which names
   the same samples in any partitioning) and the training step. */
static uint64_t smp__call_seed(int call, int position, long step) {
    uint64_t s = smp__ctx.cfg.seed ^ 0x5eedca11u;
    s ^= smp__splitmix(&s) + (uint64_t)call;
    s ^= smp__splitmix(&s) + (uint64_t)position;
    s ^= smp__splitmix(&s) + (uint64_t)step;
    return smp__splitmix(&s);
}

SMPDEF smp_status smp_call_set_output(smp_call_ctx *c, int i, const smp_tensor *t) {
    if (!c || !t) return smp_error(SMP_ERR_ARG, "smp_call_set_output: call and tensor are required");
    const char *name = c->module->full_name;
    if (!smp__mod.tracing || !c->output_set || c->in_backward)
        return smp_error(SMP_ERR_STATE,
                         "smp_call_set_output(\"%s\"): only a composite's forward names its outputs, and it runs only "
                         "while smp traces the model",
                         name);
    if (i < 0 || i >= c->nout)
        return smp_error(SMP_ERR_ARG, "smp_call_set_output(\"%s\"): output %d of %d", name, i, c->nout);
    int e = smp__trace_find(t->data);
    if (e < 0)
        return smp_error(
            SMP_ERR_ARG,
            "smp_call_set_output(\"%s\"): output %d is not a tensor that an smp_call returned or an input of the call "
            "(compute it in a leaf module)",
            name, i);
    char where[160];
    snprintf(where, sizeof where, "when composite \"%s\" named it output %d", name, i);
    smp_status st = smp__trace_check(e, where);
    if (st) return st;
    c->outputs[i] = *t;
    c->output_set[i] = true;
    return SMP_OK;
}

/* What a composite's forward did wrong (see "A module is a LEAF"); before
   it has returned only what it can no longer put right. */
static smp_status smp__check_composite(const smp_call_ctx *c, bool returned) {
    const smp_module *m = c->module;
    if (m->desc.backward || smp__split_backward(m))
        return smp_error(
            SMP_ERR_MODULE,
            "module \"%s\" calls other modules through smp_call, which makes it a composite, but it has a backward: "
            "smp differentiates a composite through its children; remove the backward (or make it a leaf that calls no "
            "module)",
            m->full_name);
    if (c->made_output)
        return smp_error(
            SMP_ERR_MODULE,
            "composite module \"%s\" calls other modules and also makes an output of its own with smp_call_output: "
            "a composite may not compute; move the arithmetic into a leaf module (smp_module_new_add for a residual) "
            "and name its result with smp_call_set_output",
            m->full_name);
    if (m->nparams)
        return smp_error(
            SMP_ERR_MODULE,
            "composite module \"%s\" declares %s \"%s\", which no backward would update: declare it on a leaf child",
            m->full_name, m->params[0]->is_buffer ? "buffer" : "parameter", m->params[0]->name);
    if (!returned) return SMP_OK;
    if (!c->made_calls)
        return smp_error(
            SMP_ERR_MODULE,
            "module \"%s\" names its outputs with smp_call_set_output but calls no module: a composite passes "
            "work to its children (smp_module_new_identity returns its input)",
            m->full_name);
    for (int i = 0; i < c->nout; i++)
        if (!c->output_set[i])
            return smp_error(SMP_ERR_MODULE, "composite module \"%s\" did not name output %d (smp_call_set_output)",
                             m->full_name, i);
    return SMP_OK;
}

/* Timed runs of each leaf call after its warm-up run, when tracing. */
#define SMP__TRACE_RUNS 3

/* Whether a traced call's time can change anything: the auto-partitioner's
   split (unless memory alone decides, memory_weight 1), the cut of a
   manually placed V's bottom, or what SMP_VERBOSE's reports print. Where it
   cannot (one partition, manual placement), tracing runs each leaf's
   forward once, for its outputs and memory, and neither times nor repeats
   it nor runs its backward: a quarter of the work or less. */
static bool smp__trace_times_matter(void) {
    const smp_config *cfg = &smp__ctx.cfg;
    bool vee = cfg->pipeline == SMP_PIPELINE_ZERO_BUBBLE_V;
    if (getenv("SMP_VERBOSE")) return true;
    if (cfg->auto_partition == SMP_ON) return (cfg->partitions > 1 || vee) && cfg->memory_weight < 1.0;
    return vee;
}

/* The run whose total time is the median of n (ties: the earliest), or
   with best the fastest. Whole runs, not per-phase medians, so a call's
   forward, B and W costs come from one run and add up to its time. */
static int smp__trace_pick(double (*runs)[3], int n, bool best) {
    int pick = 0;
    for (int i = 0; i < n; i++) {
        double ti = runs[i][0] + runs[i][1] + runs[i][2];
        if (best) {
            if (ti < runs[pick][0] + runs[pick][1] + runs[pick][2]) pick = i;
            continue;
        }
        int below = 0, same_before = 0;
        for (int j = 0; j < n; j++) {
            double tj = runs[j][0] + runs[j][1] + runs[j][2];
            below += tj < ti;
            same_before += tj == ti && j < i;
        }
        if (below + same_before == (n - 1) / 2) pick = i; /* its rank in the sorted order is the middle one */
    }
    return pick;
}

/* Records leaf call `c` as the next call of the traced model: its inputs'
   sources, shapes, costs; its outputs join the table. */
static smp_status smp__record_leaf(smp_model *md, smp_call_ctx *c, smp__ref *in, smp_tensor *in_meta,
                                   const double cost[3], double act_bytes, double param_bytes, bool top) {
    smp__call_rec rec;
    memset(&rec, 0, sizeof rec);
    rec.module = c->module;
    rec.nin = c->nin;
    rec.nout = c->nout;
    rec.in = in;
    rec.in_meta = in_meta;
    smp_status st = SMP_OK;
    rec.out_meta = (smp_tensor *)smp__alloc_or(&st, sizeof(smp_tensor) * (size_t)c->nout, SMP__ALLOC_OTHER,
                                               "the trace's record of a call");
    int cap = md->ncalls;
    smp__grow_or(&st, (void **)&md->calls, &cap, md->ncalls + 1, sizeof(smp__call_rec), "the trace's list of calls");
    smp__trace_reserve(&st, c->nout);
    if (st) { /* the call's outputs go too: no table entry will own them */
        for (int i = 0; i < c->nout; i++) smp__free(c->outputs[i].data);
        memset(c->outputs, 0, sizeof(smp_tensor) * (size_t)c->nout);
        smp__free(rec.out_meta);
        smp__free(in);
        smp__free(in_meta);
        return st;
    }
    memcpy(rec.cost, cost, sizeof rec.cost);
    rec.time = cost[0] + cost[1] + cost[2];
    rec.activation_bytes = act_bytes;
    rec.param_bytes = param_bytes;
    rec.unit = md->nunits;
    rec.context = c->context;
    bool recompute = c->module->recompute || (top && smp__ctx.cfg.activation_checkpointing == SMP_ON);
    rec.recompute_first = rec.recompute_last = recompute ? md->ncalls : -1;
    int k = md->ncalls;
    for (int i = 0; i < c->nout; i++) {
        rec.out_meta[i] = c->outputs[i];
        rec.out_meta[i].data = NULL;
        smp__trace_add(&c->outputs[i], k, i, true);
    }
    md->calls[md->ncalls++] = rec;
    c->module->uses++;
    if (c->module->owner_call < 0) c->module->owner_call = k;
    return SMP_OK;
}

/* A top-level call costs what its leaf calls cost. */
static void smp__unit_costs(const smp_model *md, smp__unit *u) {
    u->time = u->activation_bytes = u->param_bytes = 0;
    for (int k = u->first; k <= u->last; k++) {
        u->time += md->calls[k].time;
        u->activation_bytes += md->calls[k].activation_bytes;
        u->param_bytes += md->calls[k].param_bytes;
    }
}

static smp_status smp__add_unit(smp_model *md, smp_module *m, int first) {
    int cap = md->nunits;
    smp_status st = SMP_OK;
    if (!smp__grow_or(&st, (void **)&md->units, &cap, md->nunits + 1, sizeof(smp__unit),
                      "the trace's list of top-level calls"))
        return st;
    smp__unit *u = &md->units[md->nunits++];
    memset(u, 0, sizeof *u);
    u->module = m;
    u->first = first;
    u->last = md->ncalls - 1;
    smp__unit_costs(md, u);
    return SMP_OK;
}

SMPDEF smp_status smp_call(smp_module *m, const smp_tensor *inputs, int nin, smp_tensor *outputs, int nout) {
    if (!m) return smp_error(SMP_ERR_ARG, "smp_call: module is NULL");
    if (nin < 0 || nout < 1 || (nin && !inputs) || !outputs)
        return smp_error(SMP_ERR_ARG, "smp_call(\"%s\"): needs inputs and at least one output", m->full_name);
    for (int i = 0; i < nin; i++) {
        smp_status st = smp__check_tensor(&inputs[i], "smp_call", "an input");
        if (st) return smp_error(st, "smp_call(\"%s\"), input %d: %s", m->full_name, i, smp_last_error());
    }
    smp_call_ctx *parent = smp__mod.current;
    smp_model *md = smp__mod.trace_model;
    if (!smp__mod.tracing)
        return parent ? smp_error(SMP_ERR_STATE,
                                  "smp_call(\"%s\") from the %s of module \"%s\" after tracing: only a composite's "
                                  "forward calls "
                                  "modules, and it must do so when smp traces the model (it runs only then)",
                                  m->full_name, parent->in_backward ? "backward" : "forward", parent->module->full_name)
                      : smp_error(SMP_ERR_STATE,
                                  "smp_call(\"%s\") outside tracing and outside a module: the model's forward runs "
                                  "only when smp traces it",
                                  m->full_name);
    if (m->model != md)
        return smp_error(SMP_ERR_ARG, "smp_call: module \"%s\" is not part of the model being traced", m->full_name);
    if (parent) {
        if (parent->in_backward)
            return smp_error(SMP_ERR_MODULE, "smp_call(\"%s\") from the backward of \"%s\": backwards call no modules",
                             m->full_name, parent->module->full_name);
        parent->made_calls = true;
        SMP_TRY(smp__check_composite(parent, false));
        for (const smp_call_ctx *a = parent; a; a = a->caller)
            if (a->module == m)
                return smp_error(SMP_ERR_MODULE,
                                 "module \"%s\" calls itself (through \"%s\"): a model is a finite graph of calls",
                                 m->full_name, parent->module->full_name);
    }

    /* where each input comes from, and that it is as it was handed out */
    smp_status st = SMP_OK;
    smp__ref *in =
        (smp__ref *)smp__alloc_or(&st, sizeof(smp__ref) * (size_t)nin, SMP__ALLOC_OTHER, "a traced call's inputs");
    smp_tensor *in_meta =
        (smp_tensor *)smp__alloc_or(&st, sizeof(smp_tensor) * (size_t)nin, SMP__ALLOC_OTHER, "a traced call's inputs");
    char where[200];
    for (int i = 0; i < nin && !st; i++) {
        int e = smp__trace_find(inputs[i].data);
        if (e < 0) {
            st = smp_error(SMP_ERR_ARG,
                           "smp_call(\"%s\"): input %d is neither a model input nor an output of an earlier smp_call "
                           "(compute it inside a module so smp can move it between partitions)",
                           m->full_name, i);
            break;
        }
        snprintf(where, sizeof where, "when it was passed as input %d to module \"%s\"", i, m->full_name);
        st = smp__trace_check(e, where);
        const smp_tensor *src = &smp__mod.table[e].t;
        if (!st && smp_tensor_numel(src) != smp_tensor_numel(&inputs[i]))
            st = smp_error(SMP_ERR_ARG, "smp_call(\"%s\"): input %d has %lld elements but the tensor it views has %lld",
                           m->full_name, i, (long long)smp_tensor_numel(&inputs[i]), (long long)smp_tensor_numel(src));
        in[i] = smp__mod.table[e].ref;
        in_meta[i] = inputs[i];
        in_meta[i].data = NULL;
    }
    if (st) { smp__free(in); smp__free(in_meta); return st; }

    smp_call_ctx c;
    memset(&c, 0, sizeof c);
    c.module = m;
    c.caller = parent;
    c.call = -1;
    c.seed = smp__call_seed(md->ncalls, 0, 0);
    c.training = true; /* so the forward stashes what its backward reads */
    c.kind = SMP__ALLOC_OTHER;
    c.nin = nin;
    c.nout = nout;
    c.inputs = inputs;
    c.context = m->context_partition >= 0 ? m->context_partition : parent ? parent->context : -1;
    c.outputs = (smp_tensor *)smp__alloc_or(&st, sizeof(smp_tensor) * (size_t)nout, SMP__ALLOC_OTHER,
                                            "a traced call's outputs");
    c.output_set = (bool *)smp__alloc_or(&st, (size_t)nout, SMP__ALLOC_OTHER, "a traced call's outputs");
    if (st) {
        smp__free(c.outputs);
        smp__free(c.output_set);
        smp__free(in);
        smp__free(in_meta);
        return st;
    }
    int first = md->ncalls;
    smp__materialise_tree(m, +1, &st);
    double param_bytes = smp__tree_param_bytes(m);
    int64_t before = smp__ctx.mem.current_bytes;
    /* device work is asynchronous: the time of a call is until the device has done it */
    bool on_dev = smp__model_on_device(md);
    smp_status (*sync)(void) = on_dev ? smp__ctx.device.synchronize : NULL;
    if (!st && sync) st = sync();
    double t0 = smp__trace_now(on_dev);
    if (!st) st = smp__run_callback(&c, SMP__FORWARD);
    if (!st && sync) st = sync();
    double cost[3] = {smp__trace_now(on_dev) - t0, 0, 0};
    bool composite = c.made_calls;
    for (int i = 0; i < nout && !composite; i++) composite = c.output_set[i];
    if (composite) {
        if (!st) st = smp__check_composite(&c, true);
        smp__free(in);
        smp__free(in_meta);
        for (int i = 0; i < nout; i++) {
            if (!c.output_set[i]) smp__free(c.outputs[i].data); /* made with smp_call_output: an error above */
            if (c.output_set[i]) outputs[i] = c.outputs[i];
            else memset(&outputs[i], 0, sizeof outputs[i]);
        }
        if (!st) {
            m->composite = true;
            if (m->owner_call < 0) m->owner_call = first;
            if (m->recompute || (!parent && smp__ctx.cfg.activation_checkpointing == SMP_ON))
                for (int k = first; k < md->ncalls; k++) { /* the outermost recomputed call wins */
                    md->calls[k].recompute_first = first;
                    md->calls[k].recompute_last = md->ncalls - 1;
                }
            if (!st && !parent) st = smp__add_unit(md, m, first);
        }
    } else {
        smp__call_rec probe; /* what trace_backward reads: which inputs are model inputs */
        probe.in = in;
        bool timed = smp__trace_times_matter();
        if (!st && timed) st = smp__trace_backward(&c, &probe, cost + 1);
        /* The run above is cold: caches, first-touched pages and the
           engine's own first-call work (autotuning, lazy set-up) make it
           slower by amounts that differ from call to call and run to run,
           and partitioning on it split models unevenly and differently
           each time. So it only warms up; the cost is taken from
           SMP__TRACE_RUNS more: by default their median (one disturbed
           run, a preemption, moves nothing), with trace_execution_times
           their best (the steady cost, for a quiet machine). */
        double runs[SMP__TRACE_RUNS][3];
        int nruns = 0;
        for (int r = 0; r < SMP__TRACE_RUNS && !st && timed; r++) {
            t0 = smp__trace_now(on_dev);
            st = smp__run_callback(&c, SMP__FORWARD);
            if (!st && sync) st = sync();
            double *t = runs[nruns];
            t[0] = smp__trace_now(on_dev) - t0;
            t[1] = t[2] = 0;
            if (!st) st = smp__trace_backward(&c, &probe, t + 1);
            if (!st) nruns++;
        }
        if (!st && nruns)
            memcpy(cost, runs[smp__trace_pick(runs, nruns, smp__ctx.cfg.trace_execution_times == SMP_ON)], sizeof cost);
        if (st) {
            for (int i = 0; i < nout; i++) smp__free(c.outputs[i].data);
            smp__free(in);
            smp__free(in_meta);
        } else {
            st = smp__record_leaf(md, &c, in, in_meta, cost, (double)(smp__ctx.mem.current_bytes - before), param_bytes,
                                  !parent);
            for (int i = 0; i < nout; i++) outputs[i] = c.outputs[i];
            if (!st && !parent) st = smp__add_unit(md, m, first);
        }
    }
    smp_status released = SMP_OK;
    smp__materialise_tree(m, -1, &released);
    smp__call_release(&c, false); /* the outputs stay in the table until the trace ends */
    smp__free(c.outputs);
    smp__free(c.output_set);
    return st;
}

/* ---------------------------------------------------------------- auto-partitioner */

/* The stages [begin, n) needs when no stage may cost more than cap, each
   stage taking calls while its running left-to-right sum stays within cap
   (the fewest possible, since a stage's cost never drops when it gains a
   call on either side). Gives up, returning limit + 1, once more than `limit`
   stages would be needed or a single call exceeds cap. */
static int smp__part_stages_needed(const double *cost, int begin, int n, double cap, int limit) {
    int stages = 0, i = begin;
    while (i < n) {
        double sum = 0.0;
        int first = i;
        if (stages == limit) return limit + 1;
        while (i < n) {
            double next = sum + cost[i];
            if (next > cap) break;
            sum = next;
            i++;
        }
        if (i == first) return limit + 1; /* call i alone exceeds cap */
        stages++;
    }
    return stages;
}

static uint64_t smp__part_bits(double x) {
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static double smp__part_double(uint64_t u) {
    double x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* The core, on validated input. For non-negative doubles the order of the
   bit patterns read as integers is the order of the values, so a binary
   search over the patterns between 0 and the whole model's cost finds the
   smallest double the greedy pass accepts as a cap. The pass's verdict
   changes only where the cap crosses some stage's cost, so that smallest
   cap is the cost of a real stage: the exact optimum. */
static void smp__part_solve(const double *cost, int n, int nstages, int *stage_of_call, double *max_stage_cost) {
    double total = 0.0, cap, worst = 0.0;
    uint64_t lo = 0, hi;
    int begin = 0;
    for (int i = 0; i < n; i++) total += cost[i];
    hi = total > 0.0 ? smp__part_bits(total) : 0; /* total may be -0.0 */
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (smp__part_stages_needed(cost, 0, n, smp__part_double(mid), nstages) <= nstages)
            hi = mid;
        else
            lo = mid + 1;
    }
    cap = smp__part_double(hi);

    /* Place the stages from the left, each ending as early as it can while
       the rest [end, n) still splits into the remaining stages within cap.
       The valid ends of a stage form a range: the farther it reaches, the
       shorter the rest, which never needs more stages. */
    for (int k = 0; k < nstages; k++) {
        int after = nstages - k - 1; /* stages still to place after this one */
        int end;
        if (after == 0) {
            end = n;
        } else {
            /* farthest end within cap that leaves every later stage a call */
            double sum = 0.0 + cost[begin];
            int far = begin + 1, near = begin + 1;
            while (far < n - after) {
                double next = sum + cost[far];
                if (next > cap) break;
                sum = next;
                far++;
            }
            /* the rest after `far` splits within cap; find the nearest end
               that still allows it */
            while (near < far) {
                int mid = near + (far - near) / 2;
                if (smp__part_stages_needed(cost, mid, n, cap, after) <= after)
                    far = mid;
                else
                    near = mid + 1;
            }
            end = near;
        }
        {
            double sum = 0.0;
            for (int i = begin; i < end; i++) {
                sum += cost[i];
                stage_of_call[i] = k;
            }
            if (sum > worst) worst = sum;
        }
        begin = end;
    }
    /* worst == cap: no stage exceeds cap, and no split does better */
    if (max_stage_cost) *max_stage_cost = worst;
}

static int smp__part_bad(double x) { return !(x >= 0.0) || isinf(x); }

static smp_status smp__part_check_shape(int n, int nstages, const void *costs, const int *stage_of_call) {
    if (n < 1)
        return smp_error(SMP_ERR_ARG, "auto-partition: there are %d traced calls to split; at least one is needed", n);
    if (nstages < 1)
        return smp_error(SMP_ERR_ARG, "auto-partition: %d stages requested; at least one is needed", nstages);
    if (nstages > n)
        return smp_error(SMP_ERR_ARG,
                         "auto-partition: cannot split %d traced call%s into %d stages; every stage needs at least "
                         "one call (use fewer partitions or virtual stages)",
                         n, n == 1 ? "" : "s", nstages);
    if (!costs || !stage_of_call)
        return smp_error(SMP_ERR_ARG, "auto-partition: %s is NULL", !costs ? "the cost array" : "stage_of_call");
    return SMP_OK;
}

SMP__CORE smp_status smp_partition_min_max(const double *cost, int n, int nstages, int *stage_of_call,
                                        double *max_stage_cost) {
    SMP_TRY(smp__part_check_shape(n, nstages, cost, stage_of_call));
    for (int i = 0; i < n; i++)
        if (smp__part_bad(cost[i]))
            return smp_error(SMP_ERR_ARG, "auto-partition: call %d of %d has cost %g; costs must be finite and >= 0", i,
                             n, cost[i]);
    smp__part_solve(cost, n, nstages, stage_of_call, max_stage_cost);
    return SMP_OK;
}

/* The combined cost of every call (smp_auto_partition's formula) in a new array, NULL without memory; calls are
   validated. */
static double *smp__part_costs(const smp_call_cost *calls, int n, double w, double optimizer_state_factor) {
    double total_time = 0.0, total_memory = 0.0;
    for (int i = 0; i < n; i++) {
        total_time += calls[i].time;
        total_memory += calls[i].param_bytes * (2.0 + optimizer_state_factor) + calls[i].activation_bytes;
    }
    double *cost = (double *)smp__alloc((size_t)n * sizeof *cost, SMP__ALLOC_OTHER);
    for (int i = 0; cost && i < n; i++) {
        const smp_call_cost *c = &calls[i];
        double memory = c->param_bytes * (2.0 + optimizer_state_factor) + c->activation_bytes;
        double t = total_time > 0.0 ? c->time / total_time : 0.0;
        double m = total_memory > 0.0 ? memory / total_memory : 0.0;
        cost[i] = (1.0 - w) * t + w * m;
    }
    return cost;
}

SMPDEF smp_status smp_auto_partition(const smp_call_cost *calls, int n, int nstages, double memory_weight,
                                     double optimizer_state_factor, int *stage_of_call, double *max_stage_cost) {
    double total_time = 0.0, total_memory = 0.0, w = memory_weight;
    SMP_TRY(smp__part_check_shape(n, nstages, calls, stage_of_call));
    if (!(w >= 0.0 && w <= 1.0))
        return smp_error(SMP_ERR_ARG, "auto-partition: memory_weight is %g; it must lie in [0, 1]", w);
    if (smp__part_bad(optimizer_state_factor))
        return smp_error(SMP_ERR_ARG, "auto-partition: optimizer_state_factor is %g; it must be finite and >= 0",
                         optimizer_state_factor);
    for (int i = 0; i < n; i++) {
        const smp_call_cost *c = &calls[i];
        const double field[3] = {c->time, c->param_bytes, c->activation_bytes};
        static const char *const field_name[3] = {"time", "param_bytes", "activation_bytes"};
        for (int f = 0; f < 3; f++)
            if (smp__part_bad(field[f]))
                return smp_error(SMP_ERR_ARG, "auto-partition: call %d of %d has %s = %g; it must be finite and >= 0",
                                 i, n, field_name[f], field[f]);
        total_time += c->time;
        total_memory += c->param_bytes * (2.0 + optimizer_state_factor) + c->activation_bytes;
    }
    if (isinf(total_time) || isinf(total_memory))
        return smp_error(SMP_ERR_ARG, "auto-partition: the calls' total %s overflows a double",
                         isinf(total_time) ? "time" : "memory");
    double *cost = smp__part_costs(calls, n, w, optimizer_state_factor);
    if (!cost) return smp__nomem((size_t)n * sizeof *cost, "the auto-partitioner's call costs");
    smp__part_solve(cost, n, nstages, stage_of_call, max_stage_cost);
    smp__free(cost);
    return SMP_OK;
}

/* Memory per parameter byte beyond value and gradient: Adam's two moments. */
#define SMP__OPTIMIZER_STATE_FACTOR 2.0

/* With more stages than partitions (virtual stages, zero_bubble_v's V) a partition runs several stages, and a
   step costs it their sum: the split smp_auto_partition finds (the cheapest costliest stage) can leave one
   partition twice another's work (6 equal blocks cut 2,1,1,2 and placed in a V: 4 blocks on partition 0, 2 on
   partition 1), and a split that only balances the partitions can leave one stage long (3,1,2,0 in the V), which
   the schedule's ramp pays. A step of m microbatches on P partitions takes about m x the costliest partition's sum
   (the steady state) + (P - 1) x the costliest stage (the ramp), so of the contiguous splits into `chunks` stages,
   chunk c on partition part_of[c], this keeps the one where that is least: a depth-first search over stage ends in
   increasing order, pruned where the estimate passes the best found. It starts from stage_of_call's split and
   replaces it only by a strictly better one, so a split already balanced stays as it is; past a budget of visits
   (large models cut in many stages) it keeps the best it found. Every rank computes the same. */
typedef struct smp__part_balance {
    const double *cost;
    const int *part_of; /* [chunks] */
    int n, chunks, nparts;
    double m, ramp;      /* the estimate's weights: microbatches, partitions - 1 */
    double *load;        /* [nparts]: the sums of the stages placed so far */
    int *end, *best_end; /* [chunks]: where each stage ends, in this branch and in the best split */
    double best;
    long budget;         /* stage ends still to try */
} smp__part_balance;

static void smp__part_balance_visit(smp__part_balance *b, int k, int begin, double stage_max, double load_max) {
    int p = b->part_of[k], last = k == b->chunks - 1 ? b->n : b->n - (b->chunks - 1 - k);
    double sum = 0.0;
    for (int end = begin + 1; end <= last && b->budget-- > 0; end++) {
        sum += b->cost[end - 1];
        double smax = sum > stage_max ? sum : stage_max;
        double lmax = b->load[p] + sum > load_max ? b->load[p] + sum : load_max;
        double estimate = b->m * lmax + b->ramp * smax;
        if (estimate >= b->best) break; /* costs are >= 0: a longer stage only adds */
        if (end < last && k == b->chunks - 1) continue;
        double was = b->load[p]; /* restored as it was: (x + s) - s need not be x */
        b->load[p] += sum;
        b->end[k] = end;
        if (k < b->chunks - 1) smp__part_balance_visit(b, k + 1, end, smax, lmax);
        else {
            b->best = estimate;
            memcpy(b->best_end, b->end, sizeof(int) * (size_t)b->chunks);
        }
        b->load[p] = was;
    }
}

static smp_status smp__part_balance_partitions(const smp_call_cost *calls, int n, int chunks, const int *part_of,
                                               int nparts, int microbatches, double memory_weight,
                                               int *stage_of_call) {
    smp_status st = SMP_OK;
    double *cost = smp__part_costs(calls, n, memory_weight, SMP__OPTIMIZER_STATE_FACTOR);
    if (!cost) return smp__nomem((size_t)n * sizeof *cost, "the auto-partitioner's call costs");
    double *load = (double *)smp__alloc_or(&st, sizeof(double) * (size_t)nparts, SMP__ALLOC_OTHER, "the partitioner");
    int *ends = (int *)smp__alloc_or(&st, sizeof(int) * 2 * (size_t)chunks, SMP__ALLOC_OTHER, "the partitioner");
    if (!st) {
        smp__part_balance b = {cost, part_of, n, chunks, nparts, (double)(microbatches > 1 ? microbatches : 1),
                               nparts - 1.0, load, ends, ends + chunks, 0.0, 1L << 22};
        double sum = 0.0, smax = 0.0, lmax = 0.0;
        for (int q = 0; q < nparts; q++) load[q] = 0.0;
        for (int i = 0; i < n; i++) { /* the split given: its estimate */
            sum += cost[i];
            if (i + 1 == n || stage_of_call[i + 1] != stage_of_call[i]) {
                int c = stage_of_call[i];
                load[part_of[c]] += sum;
                smax = sum > smax ? sum : smax;
                b.best_end[c] = i + 1;
                sum = 0.0;
            }
        }
        for (int q = 0; q < nparts; q++) lmax = load[q] > lmax ? load[q] : lmax;
        b.best = b.m * lmax + b.ramp * smax;
        for (int q = 0; q < nparts; q++) load[q] = 0.0;
        smp__part_balance_visit(&b, 0, 0, 0.0, 0.0);
        for (int c = 0, i = 0; c < chunks; c++)
            for (; i < b.best_end[c]; i++) stage_of_call[i] = c;
    }
    smp__free(cost);
    smp__free(load);
    smp__free(ends);
    return st;
}

/* ---------------------------------------------------------------- partitioning */

/* Pipeline zero_bubble_v's V: stage k of 2P on partition k, or 2P-1-k past the middle. */
static int smp__vee_partition(int k, int P) { return k < P ? k : 2 * P - 1 - k; }

/* auto_partition places every module itself and ignores SMP_PARTITION
   contexts, as SageMaker's smp.partition is ignored under auto_partition.
   An engine that wrote contexts meant a placement, so losing it silently
   is the surprise: rank 0 says so once per model, naming a module and the
   fix. A warning, not an error: a model written for manual placement
   should still run when auto_partition is tried on it. */
static void smp__warn_ignored_contexts(const smp_model *m) {
    if (smp__ctx.rank != 0) return;
    const smp_module *first = NULL;
    int n = 0;
    for (int i = 0; i < m->nmodules; i++)
        if (m->modules[i]->context_partition >= 0) { n++; if (!first) first = m->modules[i]; }
    if (!first) return;
    char others[48] = "";
    if (n > 1) snprintf(others, sizeof others, " (and %d other module%s)", n - 1, n == 2 ? "" : "s");
    smp__log(
        SMP_LOG_WARN,
        "module \"%s\"%s was created inside SMP_PARTITION(%d), but auto_partition is on, so SMP_PARTITION contexts are "
        "ignored and the partitioner places every module: to place modules by their contexts, turn auto_partition off "
        "(cfg.auto_partition = SMP_OFF, or \"auto_partition\": false in SMP_CONFIG) and set default_partition for "
        "modules outside them",
        *first->full_name ? first->full_name : "(root)", others, first->context_partition);
}

/* The partition of every leaf call: auto partitioning places top-level
   calls (a composite block moves whole), manual placement each leaf by its
   SMP_PARTITION context (its own, else the nearest composite caller's).
   Under zero_bubble_v auto partitioning cuts 2P stages and places them in
   a V; *vee_cut is then the first call of stage P (the second of the two
   the middle partition runs back to back), else -1. */
static smp_status smp__assign_partitions(smp_model *m, int *call_part, int *vee_cut) {
    const smp_config *cfg = &smp__ctx.cfg;
    int P = cfg->partitions, n = m->ncalls, nu = m->nunits;
    bool vee = cfg->pipeline == SMP_PIPELINE_ZERO_BUBBLE_V;
    *vee_cut = -1;
    if (cfg->auto_partition == SMP_ON && (P > 1 || vee)) {
        int chunks = vee ? 2 * P : P * cfg->virtual_stages;
        if (chunks > nu && vee)
            return smp_error(SMP_ERR_CONFIG,
                             "the model makes %d top-level call%s, too few for pipeline \"zero_bubble_v\", which cuts "
                             "it in 2 stages "
                             "per partition (%d for %d partitions): use fewer partitions or another pipeline",
                             nu, nu == 1 ? "" : "s", chunks, P);
        if (chunks > nu)
            return smp_error(SMP_ERR_CONFIG,
                             "the model makes %d top-level calls, too few for %d partitions x %d virtual stages", nu, P,
                             cfg->virtual_stages);
        smp_status st = SMP_OK;
        smp_call_cost *costs = (smp_call_cost *)smp__alloc_or(&st, sizeof(smp_call_cost) * (size_t)nu, SMP__ALLOC_OTHER,
                                                              "the auto-partitioner's costs");
        int *unit_part =
            (int *)smp__alloc_or(&st, sizeof(int) * (size_t)nu, SMP__ALLOC_OTHER, "the auto-partitioner's placement");
        for (int u = 0; u < nu && !st; u++) {
            costs[u].time = m->units[u].time;
            costs[u].param_bytes = m->units[u].param_bytes;
            costs[u].activation_bytes = m->units[u].activation_bytes;
        }
        int *part_of = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)chunks, SMP__ALLOC_OTHER,
                                            "the auto-partitioner's placement");
        for (int c = 0; c < chunks && !st; c++) part_of[c] = vee ? smp__vee_partition(c, P) : c % P;
        if (!st)
            st =
                smp_auto_partition(costs, nu, chunks, cfg->memory_weight, SMP__OPTIMIZER_STATE_FACTOR, unit_part, NULL);
        if (!st && chunks > P && P > 1)
            st = smp__part_balance_partitions(costs, nu, chunks, part_of, P, cfg->microbatches, cfg->memory_weight,
                                              unit_part);
        smp__warn_ignored_contexts(m);
        for (int k = 0; k < n && !st; k++) {
            int c = unit_part[m->calls[k].unit];
            call_part[k] = part_of[c];
            if (vee && c == P && *vee_cut < 0) *vee_cut = k;
        }
        smp__free(costs);
        smp__free(unit_part);
        smp__free(part_of);
        return st;
    }
    for (int i = 0; i < n; i++) {
        int p = P == 1 ? 0 : m->calls[i].context;
        if (p < 0) {
            if (!cfg->has_default_partition)
                return smp_error(
                    SMP_ERR_CONFIG,
                    "module \"%s\" was created outside every SMP_PARTITION context and no default_partition is set "
                    "(auto_partition is off)",
                    m->calls[i].module->full_name);
            p = cfg->default_partition;
        }
        call_part[i] = p;
    }
    return SMP_OK;
}

static void smp__report(smp_model *m) {
    if (smp__ctx.rank != 0) return;
    int S = m->nstages;
    double *t = (double *)smp__alloc(sizeof(double) * 2 * (size_t)S, SMP__ALLOC_OTHER);
    if (!t) { smp__log(SMP_LOG_WARN, "no partition report: out of memory for %d stages' sums", S); return; }
    double *mem = t + S;
    char line[256];
    smp__log(SMP_LOG_INFO, "partition report: %d top-level calls (%d leaf calls), %d stages over %d partitions",
             m->nunits, m->ncalls, S, smp__ctx.cfg.partitions);
    smp__log(SMP_LOG_INFO, "  %-5s %-28s %5s %5s %12s %10s %12s", "call", "module", "part", "stage", "params(B)",
             "time(ms)", "activ.(B)");
    for (int u = 0; u < m->nunits; u++) {
        smp__unit *c = &m->units[u];
        int s0 = m->calls[c->first].stage, s1 = m->calls[c->last].stage;
        char stages[24];
        snprintf(stages, sizeof stages, s0 == s1 ? "%d" : "%d-%d", s0, s1);
        snprintf(line, sizeof line, "  %-5d %-28s %5d %5s %12.0f %10.3f %12.0f%s", u,
                 *c->module->full_name ? c->module->full_name : "(root)", m->stage_rank[s0], stages, c->param_bytes,
                 c->time * 1e3, c->activation_bytes,
                 c->last > c->first                        ? " (composite)"
                 : m->calls[c->first].recompute_first >= 0 ? " (recomputed)"
                                                           : "");
        smp__log(SMP_LOG_INFO, "%s", line);
    }
    memset(t, 0, sizeof(double) * 2 * (size_t)S);
    for (int i = 0; i < m->ncalls; i++) {
        t[m->calls[i].stage] += m->calls[i].time;
        mem[m->calls[i].stage] +=
            m->calls[i].param_bytes * (2 + SMP__OPTIMIZER_STATE_FACTOR) + m->calls[i].activation_bytes;
    }
    double tmax = 0, tsum = 0, mmax = 0, msum = 0;
    for (int s = 0; s < S; s++) {
        smp__log(SMP_LOG_INFO, "  stage %d (partition %d): leaf calls %d..%d, time %.3f ms, memory %.0f B", s,
                 m->stage_rank[s], m->stage_first[s], m->stage_last[s], t[s] * 1e3, mem[s]);
        tmax = t[s] > tmax ? t[s] : tmax; tsum += t[s];
        mmax = mem[s] > mmax ? mem[s] : mmax; msum += mem[s];
    }
    smp__log(SMP_LOG_INFO, "  imbalance (largest / mean stage): time %.2f, memory %.2f",
             tsum > 0 ? tmax * S / tsum : 1.0, msum > 0 ? mmax * S / msum : 1.0);
    for (int i = 0; i < m->nmodules; i++) { /* shared modules: where their copies live */
        smp_module *mod = m->modules[i];
        if (mod->uses < 2 ||
            (mod->parent && mod->parent->uses == mod->uses && mod->parent->owner_call == mod->owner_call))
            continue;
        int at =
            snprintf(line, sizeof line, "  shared: \"%s\", %d calls, copies on partitions", mod->full_name, mod->uses);
        for (int p = 0, last = -1; p < smp__ctx.cfg.partitions && at < (int)sizeof line - 8; p++)
            for (int k = 0; k < m->ncalls; k++)
                if (m->calls[k].module == mod && m->stage_rank[m->calls[k].stage] == p && p != last) {
                    at += snprintf(line + at, sizeof line - (size_t)at, " %d", p);
                    last = p;
                }
        smp__log(SMP_LOG_INFO, "%s", line);
    }
    smp__free(t);
}

/* Where a module lives once its calls are placed: with its leaf calls (on
   every partition that calls it: copies of a shared module), a composite
   with its first leaf, a module no call reads with its parent (whose
   forward reads it), else by its context or default_partition. */
static void smp__place_modules(smp_model *m, const int *part) {
    int me = smp__ctx.pp_rank;
    for (int i = 0; i < m->nmodules; i++) { m->modules[i]->partition = -1; m->modules[i]->local = false; }
    for (int k = 0; k < m->ncalls; k++) {
        smp_module *mod = m->calls[k].module;
        if (mod->partition < 0) mod->partition = part[k];
        if (part[k] == me) mod->local = true;
    }
    for (int i = 0; i < m->nmodules; i++) { /* creation order: parents first */
        smp_module *mod = m->modules[i];
        if (mod->uses > 0) continue;
        if (mod->composite) mod->partition = part[mod->owner_call];
        else if (mod->parent && mod->parent->owner_call >= 0) {
            mod->owner_call = mod->parent->owner_call;
            mod->uses = mod->parent->uses;
            mod->partition = mod->parent->partition;
            mod->local = mod->parent->local;
            continue;
        } else if (mod->context_partition >= 0 && smp__ctx.cfg.auto_partition != SMP_ON)
            mod->partition = mod->context_partition;
        else mod->partition = smp__ctx.cfg.has_default_partition ? smp__ctx.cfg.default_partition : 0;
        mod->local = mod->partition == me;
    }
}

/* Pipeline zero_bubble_v: the placement must run over the partitions in a
   V, 0, 1, ..., P-1, ..., 1, 0 along the calls; the middle partition's run
   becomes two stages (P-1 and P). Auto partitioning cut them already
   (*cut >= 0); a manual placement is cut here, at the start of the top-level
   call that balances the two halves' traced time best. */
static smp_status smp__vee_stages(const smp_model *m, const int *part, int *cut) {
    int n = m->ncalls, P = smp__ctx.cfg.partitions, runs = 0, bad = -1, first = -1, last = -1;
    char seen[160];
    int at = 0;
    seen[0] = 0;
    for (int i = 0; i < n; i++) {
        if (i > 0 && part[i] == part[i - 1]) continue;
        /* the middle two stages make one run */
        if (bad < 0 && (runs >= 2 * P - 1 || part[i] != (runs < P ? runs : 2 * P - 2 - runs))) bad = runs;
        if (at >= 0 && at < (int)sizeof seen - 24)
            at += snprintf(seen + at, sizeof seen - (size_t)at, runs ? ", %d" : "%d", part[i]);
        else if (at >= 0) { snprintf(seen + at, sizeof seen - (size_t)at, ", ..."); at = -1; }
        if (runs == P - 1) first = i;
        runs++;
    }
    if (bad < 0 && runs != 2 * P - 1) bad = runs;
    if (bad >= 0)
        return smp_error(SMP_ERR_CONFIG,
                         "pipeline \"zero_bubble_v\" needs the model placed in a V: partitions 0, 1, ..., %d, ..., 1, "
                         "0 along its calls "
                         "(partition r runs stages r and %d-r, partition %d its two middle stages back to back); this "
                         "placement runs over "
                         "partitions %s. Place the modules so with SMP_PARTITION, or turn auto_partition on (it cuts "
                         "and places the V itself)",
                         P - 1, 2 * P - 1, P - 1, seen);
    for (last = first; last + 1 < n && part[last + 1] == part[first]; last++) {}
    if (*cut >= 0) return SMP_OK;
    double total = 0, left = 0, best = -1;
    for (int i = first; i <= last; i++) total += m->calls[i].time > 0 ? m->calls[i].time : 0;
    for (int c = first + 1; c <= last; c++) {
        left += m->calls[c - 1].time > 0 ? m->calls[c - 1].time : 0;
        const smp__call_rec *r = &m->calls[c];
        /* inside a top-level call */
        if (m->units[r->unit].first != c || (r->recompute_first >= 0 && r->recompute_first != c)) continue;
        double worse = left > total - left ? left : total - left;
        if (best < 0 || worse < best) { best = worse; *cut = c; }
    }
    if (*cut < 0)
        return smp_error(
            SMP_ERR_CONFIG,
            "pipeline \"zero_bubble_v\" cuts partition %d's part of the model (the bottom of the V) in two stages, "
            "but it is one top-level call (\"%s\"): place at least two top-level calls on partition %d, or turn "
            "auto_partition on",
            P - 1, m->units[m->calls[first].unit].module->full_name, P - 1);
    return SMP_OK;
}

static smp_status smp__partition(smp_model *m) {
    int n = m->ncalls, P = smp__ctx.cfg.partitions, vee_cut = -1;
    smp_status st =
        m->hooks_lost ? smp__nomem(m->hooks_lost, "a post-partition hook (smp_model_on_partitioned)") : SMP_OK;
    int *part =
        (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(n ? n : 1), SMP__ALLOC_OTHER, "the partition of each call");
    if (!st)
        st = n ? smp__assign_partitions(m, part, &vee_cut)
               : smp_error(SMP_ERR_ARG, "the model's forward made no smp_call");
    if (!st && smp__ctx.cfg.pipeline == SMP_PIPELINE_ZERO_BUBBLE_V) st = smp__vee_stages(m, part, &vee_cut);
    for (int k = 0; k < n && !st; k++) {
        const smp__call_rec *c = &m->calls[k];
        if (c->recompute_first >= 0 && part[c->recompute_first] != part[k])
            st = smp_error(SMP_ERR_CONFIG,
                           "module \"%s\" is recomputed, but its calls fall on partitions %d (\"%s\") and %d (\"%s\"): "
                           "a recomputed call "
                           "runs again within one stage; place all of it on one partition, or do not recompute it",
                           m->calls[c->recompute_first].module->full_name, part[c->recompute_first],
                           m->calls[c->recompute_first].module->full_name, part[k], c->module->full_name);
    }
    if (st) { smp__free(part); return st; }
    int S = 0;
    for (int i = 0; i < n; i++) S += i == 0 || part[i] != part[i - 1] || i == vee_cut;
    bool *used = (bool *)smp__alloc_or(&st, (size_t)P, SMP__ALLOC_OTHER, "the partitions' list of stages");
    m->stage_rank = (int *)smp__alloc_or(&st, sizeof(int) * 3 * (size_t)S, SMP__ALLOC_OTHER, "the stages of the model");
    if (st) { smp__free(used); smp__free(part); return st; }
    m->nstages = S;
    m->stage_first = m->stage_rank + S;
    m->stage_last = m->stage_rank + 2 * S;
    for (int i = 0, s = -1; i < n; i++) {
        if (i == 0 || part[i] != part[i - 1] || i == vee_cut) {
            s++;
            m->stage_rank[s] = part[i];
            m->stage_first[s] = i;
        }
        m->stage_last[s] = i;
        m->calls[i].stage = s;
    }
    for (int s = 0; s < S; s++) used[m->stage_rank[s]] = true;
    for (int p = 0; p < P && !st; p++)
        if (!used[p])
            st = smp_error(SMP_ERR_CONFIG,
                           "partition %d has no module calls; every partition needs work (partitions = %d)", p, P);
    smp__free(used);
    if (!st) smp__place_modules(m, part);
    smp__free(part);
    if (st) return st;
    for (int i = 0; i < m->nparams; i++)
        if (!st && smp_module_is_local(m->params[i]->module)) st = smp__materialise_param(m->params[i]);
    if (st) {
        for (int i = 0; i < m->nparams; i++) smp__release_param(m->params[i]);
        return st;
    }
    if ((st = smp__grad_layout(m))) {
        for (int i = 0; i < m->nparams; i++) smp__release_param(m->params[i]);
        return st;
    }
    m->partitioned = true;
    smp__report(m);
    for (int i = 0; i < m->nhooks; i++) m->hooks[i].fn(m, m->hooks[i].user);
    return SMP_OK;
}

/* Costs must be the same everywhere for every rank to choose the same
   split: world rank 0's measurements are the ones used. */
static smp_status smp__share_trace(smp_model *m) {
    int n = m->ncalls;
    uint64_t sig[2] = {(uint64_t)n, 1469598103934665603ull};
    for (int i = 0; i < n; i++) {
        const smp__call_rec *c = &m->calls[i];
        uint64_t v = (uint64_t)c->nin * 31 + (uint64_t)c->nout + (uint64_t)c->unit * 7919 +
                     (uint64_t)(c->recompute_first + 2) * 104729;
        for (const char *ch = c->module->full_name; *ch; ch++) v = v * 131 + (unsigned char)*ch;
        for (int j = 0; j < c->nin; j++)
            v = v * 1000003 + (uint64_t)(c->in[j].call + 7) * 17 + (uint64_t)c->in[j].index;
        sig[1] = (sig[1] ^ v) * 1099511628211ull;
    }
    uint64_t lo[2], hi[2];
    smp__min_max(smp__ctx.world, sig, 2, lo, hi, "the traced models", SMP_WORLD);
    if (lo[0] != hi[0] || lo[1] != hi[1])
        return smp_error(SMP_ERR_STATE,
                         "ranks traced different models (call counts %llu..%llu): the forward must make the same calls "
                         "on every rank",
                         (unsigned long long)lo[0], (unsigned long long)hi[0]);
    smp_status st = SMP_OK;
    double *costs = (double *)smp__alloc_or(&st, sizeof(double) * 5 * (size_t)n, SMP__ALLOC_OTHER | SMP__UNINIT,
                                            "the traced costs");
    st = smp__agree_on(smp__ctx.world, st, "memory for the traced costs"); /* every rank must be in the broadcast */
    if (st) { smp__free(costs); return st; }
    for (int i = 0; i < n; i++) {
        memcpy(costs + 5 * i, m->calls[i].cost, sizeof m->calls[i].cost);
        costs[5 * i + 3] = m->calls[i].param_bytes;
        costs[5 * i + 4] = m->calls[i].activation_bytes;
    }
    MPI_Request r;
    SMP__MPI_FATAL(MPI_Ibcast(costs, 5 * n, MPI_DOUBLE, 0, smp__ctx.world, &r), "sharing traced costs from world rank 0");
    smp_wait_requests(1, &r, "trace costs from rank 0", SMP_WORLD, 0);
    for (int i = 0; i < n; i++) {
        memcpy(m->calls[i].cost, costs + 5 * i, sizeof m->calls[i].cost);
        m->calls[i].time = costs[5 * i] + costs[5 * i + 1] + costs[5 * i + 2];
        m->calls[i].param_bytes = costs[5 * i + 3];
        m->calls[i].activation_bytes = costs[5 * i + 4];
    }
    smp__free(costs);
    for (int u = 0; u < m->nunits; u++) smp__unit_costs(m, &m->units[u]);
    return SMP_OK;
}

SMPDEF smp_status smp_model_trace(smp_model *m, const smp_tensor *inputs, int ninputs) {
    smp_status st = smp__require_init("smp_model_trace");
    if (st) return st;
    if (m->traced) return SMP_OK;
    smp__tp_step_begin();
    if (ninputs != m->desc.ninputs)
        st = smp_error(SMP_ERR_ARG, "smp_model_trace: the model takes %d inputs, got %d", m->desc.ninputs, ninputs);
    smp_tensor *outs = (smp_tensor *)smp__alloc_or(&st, sizeof(smp_tensor) * (size_t)m->desc.noutputs, SMP__ALLOC_OTHER,
                                                   "the model's outputs");
    if (!st) {
        smp__mod.tracing = true;
        smp__mod.trace_model = m;
        smp__mod.ntable = 0;
        if (smp__trace_reserve(&st, ninputs))
            for (int i = 0; i < ninputs; i++) smp__trace_add(&inputs[i], -1, i, false);
        if (!st) st = m->desc.forward(m, inputs, ninputs, outs, m->desc.noutputs, m->desc.user);
        if (st && !strstr(smp__errbuf, "module"))
            smp_error(st, "the model's forward failed while tracing: %s", smp__errbuf);
        m->outputs = (smp__ref *)smp__alloc_or(&st, sizeof(smp__ref) * (size_t)m->desc.noutputs, SMP__ALLOC_OTHER,
                                               "the model's outputs");
        for (int i = 0; i < m->desc.noutputs && !st; i++) {
            int e = outs[i].data ? smp__trace_find(outs[i].data) : -1;
            if (e < 0 || smp__mod.table[e].ref.call < 0)
                st = smp_error(
                    SMP_ERR_ARG,
                    "model output %d is not an output of an smp_call (set outputs[%d] to a tensor smp_call returned)",
                    i, i);
            else m->outputs[i] = smp__mod.table[e].ref;
        }
        for (int e = 0; e < smp__mod.ntable && !st; e++) st = smp__trace_check(e, "when the model's forward returned");
        /* the trace's activations are no longer needed */
        for (int i = 0; i < smp__mod.ntable; i++)
            if (smp__mod.table[i].owned) smp__free(smp__mod.table[i].t.data);
        smp__free(smp__mod.table);
        smp__mod.table = NULL;
        smp__mod.ntable = smp__mod.table_cap = 0;
        smp__mod.tracing = false;
        smp__mod.trace_model = NULL;
    }
    smp__free(outs);
    if (st) smp__tp_step_stopped(st); /* its TP peers may wait in a TP module's handshake of the trace */
    st = smp__agree_on(smp__ctx.world, st, "tracing");
    if (st) smp__tp_step_settle(); /* every rank agrees it failed: take in the handshakes still in flight */
    if (!st) st = smp__agree_on(smp__ctx.world, smp__share_trace(m), "trace agreement");
    if (!st) st = smp__agree_on(smp__ctx.world, smp__partition(m), "partitioning");
    /* the partition report's memory account, per rank (a collective: SMP_VERBOSE is the same on every rank) */
    if (!st && getenv("SMP_VERBOSE")) (void)smp_memory_report("partition report", NULL);
    if (st) {
        smp__free_calls(m);
        smp__free(m->outputs);
        m->outputs = NULL;
        for (int i = 0; i < m->nmodules; i++) {
            m->modules[i]->uses = 0;
            m->modules[i]->owner_call = -1;
            m->modules[i]->composite = false;
        }
        return st;
    }
    m->traced = true;
    return SMP_OK;
}

#endif /* SMP_H_IMPLEMENTED */
#endif /* SMP_IMPLEMENTATION */
