/* smp_pipeline.h - pipelines for smp: schedules, the schedule simulator, and
   the executor that runs a step across the stages.

   SCHEDULES
     A schedule is data: for each rank, the ordered list of operations it
     runs in one step. An operation is the forward F(s, i) or the backward
     B(s, i) of global (virtual) stage s on microbatch i. Stages form a chain
     0..S-1; stage_rank[s] names the rank that runs stage s, and two
     consecutive stages never share a rank (0,1,0,1 gives two ranks two
     virtual stages each), except in ZB-V's V. F(s, i) needs F(s-1, i); B(s, i) needs B(s+1, i),
     and B(S-1, i) needs F(S-1, i) (the loss belongs to the last forward).
     On every stage, forwards and backwards run in increasing microbatch
     order, whatever the schedule, so gradients accumulate in one order.

       SMP_PIPELINE_SIMPLE       GPipe: all forwards, then all backwards
                                 (a rank with several stages runs forwards
                                 from its first stage, backwards from its
                                 last). m microbatches in flight on every
                                 stage.
       SMP_PIPELINE_INTERLEAVED  1F1B: at most min(m, S - s) microbatches in
                                 flight on stage s; with one stage per rank it
                                 is PipeDream-flush (warm-up forwards, one
                                 forward one backward, cool-down backwards).
                                 With several virtual stages per rank it is
                                 interleaved 1F1B: microbatches go through a
                                 rank's model chunks in groups of nranks, as
                                 in Megatron-LM, for any microbatch count.
       SMP_PIPELINE_ZERO_BUBBLE  ZB-H1 (Qi et al., "Zero Bubble Pipeline
                                 Parallelism", ICLR 2024): each backward is
                                 B(s, i), the input gradient the previous
                                 stage waits for, and W(s, i), the weight
                                 gradient, which needs B(s, i) only and runs
                                 where 1F1B would idle. The same rhythm as
                                 1F1B, with forwards also held back until
                                 fewer than S microbatches wait for their W
                                 on the stage, so memory stays at 1F1B's
                                 peak; with F = B = W and m >= S the step
                                 takes m(F+B+W) + (S-1)(F+B-W), a third of
                                 1F1B's bubble. Modules split their backward
                                 with smp_module_set_backward_split (a module
                                 without the split runs it whole as B). With
                                 several stages per rank, microbatches count
                                 against the rank's interleaved bound until
                                 their W: memory near interleaved 1F1B's, and
                                 little gain over it (ZB-V below is the
                                 zero-bubble way to two chunks per rank).
       SMP_PIPELINE_ZERO_BUBBLE_V
                                 ZB-V (the same paper; torch's
                                 ScheduleZBVZeroBubble): 2p stages on p
                                 ranks in a V, rank r running stage r and
                                 stage 2p-1-r, so rank p-1 runs the two
                                 middle stages back to back (handing
                                 activations and gradients over in memory)
                                 and the loss is back on rank 0. B and W
                                 apart as in ZB-H1. A rank holds at most
                                 2 min(m, p) microbatch-stages until W, each
                                 half of a 1F1B stage: 1F1B's peak memory.
                                 With F = B = W per stage and m >= 2p-1 the
                                 step takes 6m + p - 1 (unit ops), an idle
                                 time half ZB-H1's and a sixth of 1F1B's for
                                 the same model. The stage map must be the V
                                 (NULL gives it); with pipeline
                                 "zero_bubble_v" smp partitions the model so
                                 (auto: 2p stages; manual: a placement
                                 running over partitions 0..p-1..0).
       (SMP_PIPELINE_DEFAULT means INTERLEAVED.)

   ACTIVE MICROBATCHES
     active_microbatches = c (config key, SageMaker's; or
     smp_schedule_build_capped) bounds the microbatches in flight on every
     rank: a microbatch enters a rank with its first forward there and
     leaves after its last backward there (W in zero-bubble kinds), and
     counts once however many of the rank's stages hold it. Each stage
     still runs its microbatches in increasing order, so a cap changes
     when things run, never what is computed: results are bitwise those
     of the uncapped step. Every c >= 1 works for every kind:
       simple        GPipe in groups of c microbatches (all forwards of a
                     group, then its backwards): activations for c
                     microbatches instead of m, for a bubble of (S-1)/(c+S-1)
                     per group instead of (S-1)/(m+S-1) per step.
       interleaved,  the generator above holds back a forward that would
       zero_bubble   bring a new microbatch onto a full rank (the smallest
                     unfinished microbatch can always move on: it is
                     already on the rank, or the rank holds none).
       zero_bubble_v the V above when it fits under c; else the zero_bubble
                     generator on the V's stage map, under the cap.
     0 (the default) adds no cap: the schedules above, unchanged. A cap at
     or above what the schedule holds anyway changes nothing either.
     Evaluation steps keep nothing for a backward and are not capped.

         smp_schedule sc;
         if (smp_schedule_build(SMP_PIPELINE_INTERLEAVED, 4, 8, NULL, 16,
                                false, &sc) != SMP_OK)
             puts(smp_last_error());          // names the bad argument
         for (int k = 0; k < sc.nops[rank]; k++) {
             smp_sched_op op = sc.ops[rank][k];  // op.kind, .stage, .microbatch
         }
         smp_schedule_free(&sc);

   SIMULATOR
     smp_schedule_simulate() runs any schedule (built or hand-made) without
     computation: each rank runs its list in order, an operation starts when
     the rank is free and its dependency is done (plus comm_latency when the
     dependency ran on another rank; W(s, i) needs B(s, i)). It reports the makespan, the bubble
     (idle fraction), the ideal time, peak in-flight microbatches per stage
     and per rank, and a deadlock with the ranks that wait and what for.

         smp_sim_result r;
         smp_schedule_simulate(&sc, NULL, NULL, NULL, 0.0, &r);  // unit costs
         printf("makespan %g bubble %.3f\n", r.makespan, r.bubble_fraction);
         smp_sim_result_free(&r);

   These are pure functions: no MPI calls, same result on every rank.

   STEPS (the executor)
     A step runs the traced model over microbatches with the configured
     schedule; the body (loss and output gradient, the engine's code) runs
     once per microbatch on the rank that holds the model's outputs:

         SMP_STEP_BODY(train_body) {
             const smp_tensor *logits = smp_mb_output(mb, 0);
             const smp_tensor *labels = smp_mb_arg(mb, 1);
             float loss = my_xent(logits, labels, smp_mb_output_grad(mb, 0));
             return smp_mb_return_f32(mb, 0, loss);      // a StepOutput
         }
         ...
         smp_step_output loss_mb = {0};
         smp_model_zero_grad(model);                     // optimizer.zero_grad()
         SMP_TRAIN_STEP(model, train_body, NULL, &loss_mb, 1, data, labels);
         double loss = smp_step_output_reduce_mean_f64(&loss_mb);   // loss_mb.reduce_mean()
         my_optimizer_step(model);                       // optimizer.step()

   ON THE DEVICE
     A model built with on_device (smp.h) steps the same way on device
     tensors: smp_mb_output and smp_mb_output_grad are device tensors, step
     arguments may be host or device tensors, and values given to
     smp_mb_return are copied to the host (StepOutputs are host memory).
     Activations and gradients cross partitions through the device
     backend's point to point (smp_nccl.h: NCCL), or through host buffers
     over MPI when it has none or is itself host-staged; data-parallel
     buckets are reduced by the backend. smp_clip_grad_norm's
     norm and the grad scaler's overflow check read device gradients
     through host copies; scaling them stays on the device.

   ACTIVATION OFFLOADING
     offload_activations (config key, SageMaker's; on_device models only:
     on a host model it is an error) moves what a stage's backward will
     read - its calls' device stashes and outputs, the activations it
     received, the loss gradient of the body - to pinned host memory on the
     backend's side stream right after the forward (and the body), and
     frees the device blocks once copied. They come back on that stream
     when their backward is activation_loading_horizon (default 4) of this
     rank's operations ahead, and the engine's stream waits for them on the
     device before the backward: the host never waits for a copy. A
     microbatch whose backward is already that close stays on the device.
     The bytes are the same, so results are bitwise those without it; the
     memory account counts the host copies as "offloaded".
*/
#ifndef SMP_PIPELINE_H
#define SMP_PIPELINE_H

#include "smp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================
   schedules and simulator
   ====================================================================== */

/* BACKWARD is the whole backward, or in zero-bubble schedules its input
   half (B); WEIGHT is the weight half (W), zero-bubble schedules only. */
typedef enum smp_sched_op_kind {
    SMP_SCHED_FORWARD = 0,
    SMP_SCHED_BACKWARD = 1,
    SMP_SCHED_WEIGHT = 2
} smp_sched_op_kind;

typedef struct smp_sched_op {
    smp_sched_op_kind kind;
    int stage;      /* global (virtual) stage, 0..nstages-1 */
    int microbatch; /* 0..microbatches-1 */
} smp_sched_op;

typedef struct smp_schedule {
    smp_pipeline_kind kind; /* SIMPLE, INTERLEAVED, ZERO_BUBBLE or ZERO_BUBBLE_V (never DEFAULT) */
    int nranks, nstages, microbatches;
    bool forward_only;      /* evaluation step: forwards only */
    int active_microbatches; /* the cap it was built with (0: none; see ACTIVE MICROBATCHES) */
    int *stage_rank;        /* [nstages]: rank that runs each stage */
    int *nops;              /* [nranks]: length of each rank's list */
    smp_sched_op **ops;     /* [nranks][nops[r]]: each rank's operations in order */
} smp_schedule;

/* Builds the per-rank operation lists of one step. stage_rank may be NULL
   (round robin: stage s on rank s % nranks; ZERO_BUBBLE_V: the V). Fails
   with SMP_ERR_ARG on nranks < 1, nstages < nranks, microbatches < 1, a
   rank out of range or without a stage, or two consecutive stages on one
   rank; ZERO_BUBBLE_V on nstages != 2 nranks or a map other than the V;
   SMP_ERR_NOMEM without memory (smp's counted memory, SMP_MALLOC's, shown by
   smp_memory(): it may be called before smp_init). Release out with smp_schedule_free. */
SMPDEF smp_status smp_schedule_build(smp_pipeline_kind kind, int nranks, int nstages, const int *stage_rank,
                                     int microbatches, bool forward_only, smp_schedule *out);
/* The same with at most active_microbatches microbatches in flight on any
   rank (0: no cap beyond the kind's own; see ACTIVE MICROBATCHES). Fails
   with SMP_ERR_ARG on active_microbatches < 0. */
SMPDEF smp_status smp_schedule_build_capped(smp_pipeline_kind kind, int nranks, int nstages, const int *stage_rank,
                                            int microbatches, int active_microbatches, bool forward_only,
                                            smp_schedule *out);
/* Frees what smp_schedule_build allocated and zeroes *s. Safe on a zeroed
   schedule. */
SMPDEF void smp_schedule_free(smp_schedule *s);

typedef struct smp_sim_result {
    double makespan;        /* time the last operation finishes (after a
                               deadlock: the last one that ran) */
    double busy;            /* sum of the costs of the operations that ran */
    double ideal;           /* total work / nranks: no makespan is shorter */
    double bubble_fraction; /* 1 - busy / (nranks * makespan) */
    int *peak_inflight;     /* [nstages]: most microbatches whose forward on the stage
                               is done and backward is not (0 for forward-only) */
    int *rank_peak_inflight;/* [nranks]: the same, summed over the rank's stages */
    int *rank_peak_microbatches; /* [nranks]: most distinct microbatches in flight on the rank at once, a
                               microbatch counting once however many of the rank's stages hold it (what
                               active_microbatches caps) */
    bool deadlock;          /* no rank could progress while operations remained */
    char deadlock_reason[256]; /* which rank waits for which operation, as
                               "rank 0 at F2.0 waits for F1.0 (rank 1)"
                               (F or B, stage, microbatch) */
} smp_sim_result;

/* Runs schedule s without computation. fwd_cost, bwd_cost and wgt_cost are
   per stage: forward, backward input gradient (B) and weight gradient (W).
   In a zero-bubble schedule B and W are apart; in the others a backward op
   costs bwd + wgt. NULL: 1.0 each, except wgt_cost NULL outside zero-bubble
   schedules: 0 (bwd_cost is then the whole backward). comm_latency is added
   when an operation's dependency ran on another rank. A microbatch counts
   as in flight on a stage from its forward to its last op there (W in
   zero-bubble schedules: what the stage keeps for it until then).
   A deadlock is a result (out->deadlock), not an error;
   errors (SMP_ERR_ARG) are a malformed schedule (an operation out of range,
   on the wrong rank, repeated or missing) or a negative or non-finite cost,
   and SMP_ERR_NOMEM. Release out's arrays with smp_sim_result_free. */
SMPDEF smp_status smp_schedule_simulate(const smp_schedule *s, const double *fwd_cost, const double *bwd_cost,
                                        const double *wgt_cost, double comm_latency, smp_sim_result *out);
SMPDEF void smp_sim_result_free(smp_sim_result *r);

/* ======================================================================
   steps: microbatches, the executor, StepOutput
   ====================================================================== */

/* The body's view of one microbatch: it runs where the model's outputs
   live (the last stage), once per microbatch, after the forward. */
typedef struct smp_mb smp_mb;
typedef smp_status (*smp_step_body_fn)(smp_mb *mb);

#define SMP_MAX_STEP_ARGS 16

typedef struct smp_step_desc {
    smp_model *model;
    /* NULL: no body; output i of the step is then model output i (evaluation that only wants outputs) */
    smp_step_body_fn body;
    void *user;
    int nargs;
    /* the whole batch, identical on every rank of a replica; with prescaled_batch false at tp > 1 each rank's own
       examples, which smp_step joins over the TP group in tp-rank order (smp.h's smp_group) */
    smp_tensor args[SMP_MAX_STEP_ARGS];
    int split_axis[SMP_MAX_STEP_ARGS];    /* batch axis of each argument (input_split_axes); default 0 */
    bool non_split[SMP_MAX_STEP_ARGS];    /* passed whole to every microbatch (non_split_inputs) */
    int model_inputs[SMP_MAX_STEP_ARGS];  /* arguments that feed the model, in order */
    int nmodel_inputs;                    /* 0: arguments 0 .. ninputs-1 of the model desc */
    bool evaluate;                        /* forward only (an evaluation step) */
} smp_step_desc;

/* One value the body returns, per microbatch (a StepOutput). */
typedef struct smp_step_output {
    int microbatches;
    smp_tensor *values; /* [microbatches], memory owned by smp */
} smp_step_output;

/* Runs one step: slices the arguments into microbatches, runs the
   schedule, calls the body per microbatch, and gives every rank of the
   model replica the values the body returned, in outputs[0..noutputs-1]
   (outputs may be NULL when noutputs is 0). With body NULL the values are
   the model's outputs themselves: outputs[i] holds model output i of each
   microbatch (smp_step_output_concat gives the whole batch's), noutputs
   at most the model's. Gradients accumulate into the
   local parameters' gradients, averaged over microbatches unless
   average_grads_across_microbatches is off, and with ddp over the replicas
   and backward_passes_per_step. smp averages by scaling the loss gradient
   the body wrote (by 1/microbatches, and with ddp 1/(dp_size *
   backward_passes_per_step)), as Megatron-LM scales the loss: the sums
   then need no pass of their own. So a term that a module's backward adds
   to a gradient without the output gradient (weight decay) counts once per
   microbatch and replica; add such terms in the optimizer step.
   Collective over the world. */
SMPDEF smp_status smp_step(const smp_step_desc *desc, smp_step_output *outputs, int noutputs);

/* smp.step in one line: SMP_TRAIN_STEP(model, body, user, outs, nouts, data, target) */
#ifndef __cplusplus
#define SMP_TRAIN_STEP(MODEL, BODY, USER, OUTS, NOUTS, ...) \
    smp_step(&(smp_step_desc){.model = (MODEL), \
                              .body = (BODY), \
                              .user = (USER), \
                              .nargs = (int)(sizeof((smp_tensor[]){__VA_ARGS__}) / sizeof(smp_tensor)), \
                              .args = {__VA_ARGS__}}, \
             (OUTS), (NOUTS))
#define SMP_EVAL_STEP(MODEL, BODY, USER, OUTS, NOUTS, ...) \
    smp_step(&(smp_step_desc){.model = (MODEL), \
                              .body = (BODY), \
                              .user = (USER), \
                              .evaluate = true, \
                              .nargs = (int)(sizeof((smp_tensor[]){__VA_ARGS__}) / sizeof(smp_tensor)), \
                              .args = {__VA_ARGS__}}, \
             (OUTS), (NOUTS))
#else
/* C++ (nvcc compiles .cu files as C++) has no compound literals and takes
   designated initializers only in declaration order: build the descriptor
   in a lambda instead. */
#define SMP__STEP_CXX(MODEL, BODY, USER, EVAL, OUTS, NOUTS, ...)                                      \
    ([&]() -> smp_status {                                                                           \
        const smp_tensor smp__args[] = {__VA_ARGS__};                                                \
        static_assert(sizeof smp__args / sizeof smp__args[0] <= SMP_MAX_STEP_ARGS, "too many step arguments"); \
        smp_step_desc smp__d = smp_step_desc();                                                      \
        smp__d.model = (MODEL);                                                                      \
        smp__d.body = (BODY);                                                                        \
        smp__d.user = (USER);                                                                        \
        smp__d.evaluate = (EVAL);                                                                    \
        smp__d.nargs = (int)(sizeof smp__args / sizeof smp__args[0]);                                \
        for (int smp__i = 0; smp__i < smp__d.nargs; smp__i++) smp__d.args[smp__i] = smp__args[smp__i]; \
        return smp_step(&smp__d, (OUTS), (NOUTS));                                                   \
    }())
#define SMP_TRAIN_STEP(MODEL, BODY, USER, OUTS, NOUTS, ...) \
    SMP__STEP_CXX(MODEL, BODY, USER, false, OUTS, NOUTS, __VA_ARGS__)
#define SMP_EVAL_STEP(MODEL, BODY, USER, OUTS, NOUTS, ...) \
    SMP__STEP_CXX(MODEL, BODY, USER, true, OUTS, NOUTS, __VA_ARGS__)
#endif
/* Defines a body: SMP_STEP_BODY(train_body) { ... use mb ... return SMP_OK; } */
#define SMP_STEP_BODY(NAME) static smp_status NAME(smp_mb *mb)

SMPDEF const smp_tensor *smp_mb_output(smp_mb *mb, int i);   /* model output i */
SMPDEF const smp_tensor *smp_mb_arg(smp_mb *mb, int i);      /* this microbatch's slice of argument i */
SMPDEF smp_tensor *smp_mb_output_grad(smp_mb *mb, int i);    /* training: write d(loss)/d(output i) here */
SMPDEF smp_status smp_mb_return(smp_mb *mb, int i, const smp_tensor *value); /* copied into outputs[i] */
SMPDEF smp_status smp_mb_return_f32(smp_mb *mb, int i, float value);
SMPDEF int smp_mb_index(const smp_mb *mb);
SMPDEF void *smp_mb_user(const smp_mb *mb);
SMPDEF bool smp_mb_is_training(const smp_mb *mb);

/* StepOutput reductions over microbatches, in microbatch order. result is
   the caller's tensor: the shape of one value (mean, sum), microbatches x
   that (stack), or the values joined along axis 0 (concat). */
SMPDEF smp_status smp_step_output_reduce_mean(const smp_step_output *o, smp_tensor *result);
SMPDEF smp_status smp_step_output_reduce_sum(const smp_step_output *o, smp_tensor *result);
SMPDEF smp_status smp_step_output_concat(const smp_step_output *o, smp_tensor *result);
SMPDEF smp_status smp_step_output_stack(const smp_step_output *o, smp_tensor *result);
/* reduce_mean of element 0, as a double: the usual loss */
SMPDEF double smp_step_output_reduce_mean_f64(const smp_step_output *o);
/* The mean over the whole batch: reduce_mean is SageMaker's, per model
   replica (this replica's microbatches); these average every replica's
   over the DP_GROUP, in dp-rank order, so every rank gets the same bits
   (with ddp off, what reduce_mean gives). Collective over the DP_GROUP: every
   rank calls them, after every step whose loss it wants. The _f64 form is
   reduce_mean_f64's (NAN where some rank's StepOutput is empty). */
SMPDEF smp_status smp_step_output_reduce_mean_global(const smp_step_output *o, smp_tensor *result);
SMPDEF double smp_step_output_reduce_mean_global_f64(const smp_step_output *o);
SMPDEF void smp_step_output_free(smp_step_output *o);

/* What the last step did on this rank. */
typedef struct smp_step_stats {
    int local_stages;
    const int *peak_inflight;     /* [local_stages]: per stage of this rank, in stage order */
    const int *stage_index;       /* [local_stages]: the global stage each entry is */
    /* (both valid until the next step of the model or smp_model_free) */
    int64_t stash_peak_bytes;     /* activation memory held for backward, at its peak */
    int peak_active_microbatches; /* most distinct microbatches this rank held for a backward at once, counted as
                                     the step ran (what active_microbatches caps; 0 in an evaluation step) */
    double seconds; /* this rank's wall time in the smp_step call, to the agreement on its outputs; with
                       prescaled_batch false at tp > 1 the joining of the TP group's batches too */
} smp_step_stats;
SMPDEF smp_step_stats smp_last_step_stats(const smp_model *m);

/* The timeline (SMP_TIMELINE=path; smp.h, ENVIRONMENT VARIABLES):
   smp_model_free writes every rank's operations into one Chrome trace /
   Perfetto JSON file on rank 0, so with SMP_TIMELINE set smp_model_free is
   collective. */
/* ======================================================================
   data parallelism and training helpers
   ====================================================================== */
/* With "ddp" on, ranks holding the same parameters (the same partition and,
   with tensor_parallel_degree > 1, the same shard) form an RDP_GROUP (the
   DP_GROUP when tensor_parallel_degree is 1; smp.h's smp_group says how the
   groups relate). At the first step parameters (and buffers, with
   broadcast_buffers) are broadcast from rdp rank 0; every step then
   averages gradients over the RDP_GROUP.
   Gradients live in buckets of bucket_cap_mb, in the order backward
   finishes them; with overlapping_allreduce a bucket's all-reduce starts
   during the last microbatch's backward, once its last gradient is final
   and the bucket before it has finished (one bucket at a time, as NCCL
   runs a stream's collectives). With deterministic_reduction the sum is
   taken in dp-rank order after an all-gather, so results do not depend on
   MPI's algorithm. With shard_optimizer_state (smp.h, SHARDED OPTIMIZER
   STATE) each bucket is reduce-scattered instead (MPI_Ireduce_scatter_block;
   deterministic: an all-to-all of the pieces, summed in rank order), in the
   same order and overlap, so each replica gets the average of the piece it
   owns. The next step gathers the ranges the replicas' optimizers updated,
   overlapped with its forward: every bucket's all-gather starts as the step
   begins (MPI_Iallgather in RDP_GROUP; on a device model the backend's
   gather_start, NCCL's all-gather on smp's stream), and the step waits for a
   bucket only before the first forward call that reads one of its
   parameters (on the device the engine's stream waits, not the host), so
   the buckets of later calls arrive while earlier calls compute; the pass
   between calls moves host all-gathers on. They start in the order the
   forward first reads the buckets (laid out in backward order, the first
   calls' parameters are in the last ones), as one stream finishes its
   all-gathers in the order they were queued. Every
   all-gather is waited for before the body, a backward or the step's end,
   failed step or not: no step returns with one in flight, and a failed step
   leaves every parameter gathered. SMP_TIMELINE shows each as "AG b<n>",
   from its start until the step put the bucket's parameters in place. The
   global norm sums exact partial sums of squares, so it is the same bits
   sharded or not, partitioned or not. */

/* Scales gradients so that their global norm (over the whole model, every
   partition, every TP shard once and every whole parameter once) is at most max_norm; *total_norm gets the norm before
   clipping (may be NULL). The sum of squares is exact (then rounded), so
   it equals the one-process norm bit for bit. max_norm INFINITY only
   measures the norm. Collective over MP_GROUP (over the world with
   shard_optimizer_state: each replica reads the ranges it owns). */
SMPDEF smp_status smp_clip_grad_norm(smp_model *m, double max_norm, double *total_norm);

/* Lets the gradient all-reduce that overlapping_allreduce started move on,
   and the parameter all-gathers of shard_optimizer_state. MPI advances a
   collective only inside MPI calls (MPICH over shared memory: about 0.5 MiB
   per call), and a step makes none while a module's forward or backward
   runs. A long backward that calls smp_poll() every millisecond or so gets
   the early buckets' all-reduce done behind it, a long forward the next
   calls' parameters. Costs an MPI_Test per collective in flight (and starts
   the next bucket when one has finished); does nothing when none is. Call
   it from the thread that called smp_step. */
SMPDEF void smp_poll(void);

/* Dynamic loss scaling for f16/bf16 engines (zero fields mean defaults:
   scale 65536, growth 2, backoff 0.5, growth interval 2000 steps). Multiply
   the loss gradient by smp_grad_scaler_scale() in the body; after the step,
   smp_grad_scaler_unscale() checks every rank's gradients for inf/NaN: if
   any rank overflowed, *skip is true on every rank and the scale backs off;
   otherwise gradients are divided by the scale. Collective over the world. */
typedef struct smp_grad_scaler {
    double scale, growth_factor, backoff_factor;
    int growth_interval;
    int good_steps; /* steps since the last overflow */
} smp_grad_scaler;
SMPDEF double smp_grad_scaler_scale(smp_grad_scaler *s);
SMPDEF smp_status smp_grad_scaler_unscale(smp_model *m, smp_grad_scaler *s, bool *skip);

/* A distributed sampler: a permutation of the dataset by seed and epoch,
   cut into global batches of batch_size x rdp_size samples; each rdp rank
   takes its contiguous slice of every global batch, so data-parallel
   replicas see exactly the samples one process sees with the global batch
   (the ranks of a TP group take the same slice: smp.h's smp_group; with
   prescaled_batch false each dp rank takes its own, and batch_size is per
   dp rank, as smp_local_batch_size's result is). */
typedef struct smp_sampler_desc {
    int64_t dataset_size;
    int64_t batch_size;  /* per replica */
    uint64_t seed;
    bool shuffle;
    bool drop_last;      /* drop the tail that does not fill a whole global batch (else wrap around) */
} smp_sampler_desc;
/* indices: room for dataset_size / dp_size + batch_size entries. *count
   indices for this dp rank, in *batches batches of batch_size. */
SMPDEF smp_status smp_sampler_indices(const smp_sampler_desc *d, int epoch, int64_t *indices, int64_t *count,
                                      int64_t *batches);
/* The per-replica batch of a global batch (per dp rank with prescaled_batch false); an error when it does not
   divide. */
SMPDEF smp_status smp_local_batch_size(int64_t global_batch, int64_t *local);
/* Checks that every dp rank will run the same number of batches; an error
   naming both counts otherwise (instead of a hang at the end of an epoch). */
SMPDEF smp_status smp_agree_batches(int64_t batches);

#ifdef __cplusplus
}
#endif
#endif /* SMP_PIPELINE_H */

#ifdef SMP_IMPLEMENTATION
#ifndef SMP_PIPELINE_IMPLEMENTED
#define SMP_PIPELINE_IMPLEMENTED

/* (the system headers, SMP_MALLOC and the internal core come with smp.h's
   implementation) */

/* ======================================================================
   schedules and simulator: implementation
   ====================================================================== */

/* Whether a kind splits each backward into B and W ops. */
static bool smp__sched_split(smp_pipeline_kind k) {
    return k == SMP_PIPELINE_ZERO_BUBBLE || k == SMP_PIPELINE_ZERO_BUBBLE_V;
}

/* Checks the shape of a pipeline and its stage map; vee: ZB-V's, which
   must be the V (2 x nranks stages, stage s on rank s or 2 nranks - 1 - s). */
static smp_status smp__sched_check_map(int nranks, int nstages, const int *stage_rank, int microbatches, bool vee) {
    if (nranks < 1) return smp_error(SMP_ERR_ARG, "a pipeline needs at least 1 rank, got nranks = %d", nranks);
    if (nstages < nranks && !vee)
        return smp_error(SMP_ERR_ARG, "%d stages cannot occupy %d ranks: every rank needs at least one stage", nstages,
                         nranks);
    if (microbatches < 1)
        return smp_error(SMP_ERR_ARG, "a step needs at least 1 microbatch, got microbatches = %d", microbatches);
    if (vee) {
        if (nstages != 2 * nranks)
            return smp_error(SMP_ERR_ARG,
                             "zero_bubble_v runs 2 stages per rank in a V: %d rank%s need %d stages, got %d", nranks,
                             nranks == 1 ? "" : "s", 2 * nranks, nstages);
        for (int s = 0; s < nstages && stage_rank; s++)
            if (stage_rank[s] != smp__vee_partition(s, nranks))
                return smp_error(SMP_ERR_ARG,
                                 "stage %d is placed on rank %d, but zero_bubble_v's V puts it on rank %d (rank r runs "
                                 "stages r and %d - r)",
                                 s, stage_rank[s], smp__vee_partition(s, nranks), nstages - 1);
        return SMP_OK;
    }
    if (!stage_rank) {
        if (nranks == 1 && nstages > 1)
            return smp_error(SMP_ERR_ARG, "stages 0 and 1 both run on rank 0: consecutive stages must be on "
                                          "different ranks (1 rank cannot hold %d stages)", nstages);
        return SMP_OK;
    }
    for (int s = 0; s < nstages; s++) {
        if (stage_rank[s] < 0 || stage_rank[s] >= nranks)
            return smp_error(SMP_ERR_ARG, "stage %d is placed on rank %d, outside ranks 0..%d", s, stage_rank[s],
                             nranks - 1);
        if (s > 0 && stage_rank[s] == stage_rank[s - 1])
            return smp_error(SMP_ERR_ARG, "stages %d and %d both run on rank %d: consecutive stages must be on "
                                          "different ranks", s - 1, s, stage_rank[s]);
    }
    for (int r = 0; r < nranks; r++) {
        int found = 0;
        for (int s = 0; s < nstages && !found; s++) found = stage_rank[s] == r;
        if (!found) return smp_error(SMP_ERR_ARG, "rank %d runs no stage of the %d-stage pipeline", r, nstages);
    }
    return SMP_OK;
}

/* Allocates out's op counts and one op list per rank, sized for every op
   of the rank (out->stage_rank is set). */
static smp_status smp__sched_alloc(smp_schedule *out) {
    int R = out->nranks, S = out->nstages, m = out->microbatches;
    int per_stage = out->forward_only ? m : smp__sched_split(out->kind) ? 3 * m : 2 * m;
    smp_status st = SMP_OK;
    out->nops = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)R, SMP__ALLOC_OTHER, "a schedule");
    out->ops = (smp_sched_op **)smp__alloc_or(&st, sizeof(smp_sched_op *) * (size_t)R, SMP__ALLOC_OTHER, "a schedule");
    for (int r = 0; r < R && !st; r++) {
        int nst = 0;
        for (int s = 0; s < S; s++) nst += out->stage_rank[s] == r;
        out->ops[r] = (smp_sched_op *)smp__alloc_or(&st, sizeof(smp_sched_op) * (size_t)nst * (size_t)per_stage,
                                                    SMP__ALLOC_OTHER | SMP__UNINIT, "a schedule's operations");
    }
    return st;
}

static void smp__sched_push(smp_schedule *sc, int rank, smp_sched_op_kind kind, int stage, int mb) {
    smp_sched_op op = {kind, stage, mb};
    sc->ops[rank][sc->nops[rank]++] = op;
}

/* GPipe: on each rank, forwards stage by stage (stages ascending,
   microbatches ascending), then backwards (stages descending, microbatches
   ascending). Every rank's list is a subsequence of one global order in
   which each dependency comes first, so it cannot deadlock. */
static void smp__sched_simple(smp_schedule *sc) {
    int S = sc->nstages, m = sc->microbatches, cap = sc->active_microbatches;
    int group = cap > 0 && cap < m && !sc->forward_only ? cap : m; /* active_microbatches: GPipe group by group */
    for (int i0 = 0; i0 < m; i0 += group) {
        int i1 = i0 + group < m ? i0 + group : m;
        for (int s = 0; s < S; s++)
            for (int i = i0; i < i1; i++) smp__sched_push(sc, sc->stage_rank[s], SMP_SCHED_FORWARD, s, i);
        if (sc->forward_only) continue;
        for (int s = S - 1; s >= 0; s--)
            for (int i = i0; i < i1; i++) smp__sched_push(sc, sc->stage_rank[s], SMP_SCHED_BACKWARD, s, i);
    }
}

/* 1F1B and interleaved 1F1B, generated by a deterministic list-scheduling
   run with fixed costs (forward 1, backward 2, no latency). The result
   depends on the inputs only, never on real timings.

   Whenever a rank is free it picks, among its ready operations, by
     1. the kind opposite to the one it ran last (forward first at the
        start), when one of that kind is ready: this gives the one forward,
        one backward rhythm of the steady state;
     2. within a kind, the smallest key: (microbatch / nranks, chunk) for
        forwards and (microbatch / nranks, last chunk - chunk) for
        backwards, where chunk is the stage's position among the rank's
        stages. Microbatches thus move through a rank's model chunks in
        groups of nranks, as in Megatron-LM's interleaved schedule.
   A backward is ready when its gradient input is done and it is its stage's
   next backward. A forward of stage s is ready when its input is done, it
   is the stage's next forward, and
     - fewer than S - s microbatches are in flight on stage s (the 1F1B
       bound; with one stage per rank it is the only bound), and
     - with round-robin placement and k > 1 stages per rank, fewer than
       (k-1) * min(m, nranks) + 2 * (nranks - 1 - r) + 1 microbatch-chunks
       are in flight on rank r: Megatron-LM's warm-up bound, which saves
       memory at no cost in bubble when costs are as assumed here. (For
       other stage maps it fits badly, so they keep the stage bound only.)
   Should the rank bound ever leave every rank idle, the ranks pick again
   without it.

   Why it never gets stuck with the stage bound alone: let b be the smallest
   microbatch whose backward is still to run on some stage, and s the last
   such stage. If s < S - 1, B(s+1, b) is done, so B(s, b) is ready. If
   s = S - 1, B(s, b) waits for F(S-1, b); the first stage that has not run
   F(., b) then can: its input is done, and it holds no microbatch (all
   before b have gone back). Why the lists never deadlock under other costs:
   every rank's order and every dependency point forward in the generation's
   time, so together they form no cycle. */
typedef struct smp__sched_gen {
    int R, S, m;
    bool fo;
    bool zb;              /* zero bubble: W ops apart, forwards bounded by what W has freed */
    long *fin_f, *fin_b;  /* [stage * m + mb]: finish time, -1 until started */
    int *next_f, *next_b, *next_w; /* [stage]: next microbatch to run */
    int *chunk;           /* [stage]: position among its rank's stages */
    int *local, *first;   /* stages of rank r: local[first[r] .. first[r+1]-1] */
    int *rank_cap;        /* [rank]: the rank bound, 0: none */
    int *rank_inflight;   /* [rank] */
    int *last_kind;       /* [rank] */
    long *free_at;        /* [rank] */
    int cap;              /* active_microbatches (0: none) */
    int *held;            /* [rank * m + mb]: the rank's stages holding mb (cap only) */
    int *active;          /* [rank]: microbatches the rank holds (cap only) */
} smp__sched_gen;

/* The operation rank r should start at time t, by the rules above: returns
   its stage and sets *kind, or -1 when none is ready. */
static int smp__sched_pick(const smp__sched_gen *g, int r, long t, bool use_rank_cap, smp_sched_op_kind *kind) {
    int R = g->R, S = g->S, m = g->m, k = g->first[r + 1] - g->first[r];
    int bf = -1, bb = -1;
    long kf0 = 0, kf1 = 0, kb0 = 0, kb1 = 0;
    bool rank_room = g->fo || !use_rank_cap || !g->rank_cap[r] || g->rank_inflight[r] < g->rank_cap[r];
    for (int q = g->first[r]; q < g->first[r + 1]; q++) {
        int s = g->local[q], c = g->chunk[s];
        int i = g->next_f[s];
        bool cap_room = !g->cap || g->held[(size_t)r * (size_t)m + (size_t)i] > 0 || g->active[r] < g->cap;
        if (i < m && rank_room && cap_room && (g->fo || i - g->next_b[s] < S - s) && (!g->zb || i - g->next_w[s] < S)) {
            long in = s == 0 ? 0 : g->fin_f[(size_t)(s - 1) * (size_t)m + (size_t)i];
            long k0 = i / R, k1 = c;
            if (in >= 0 && in <= t && (bf < 0 || k0 < kf0 || (k0 == kf0 && k1 < kf1))) {
                bf = s; kf0 = k0; kf1 = k1;
            }
        }
        i = g->next_b[s];
        if (!g->fo && i < g->next_f[s]) {
            long in = s == S - 1 ? g->fin_f[(size_t)s * (size_t)m + (size_t)i]
                                 : g->fin_b[(size_t)(s + 1) * (size_t)m + (size_t)i];
            long k0 = i / R, k1 = k - 1 - c;
            if (in >= 0 && in <= t && (bb < 0 || k0 < kb0 || (k0 == kb0 && k1 < kb1))) {
                bb = s; kb0 = k0; kb1 = k1;
            }
        }
    }
    if (bf >= 0 && (bb < 0 || g->last_kind[r] == SMP_SCHED_BACKWARD)) {
        *kind = SMP_SCHED_FORWARD;
        return bf;
    }
    *kind = SMP_SCHED_BACKWARD;
    if (bb >= 0 || !g->zb) return bb;
    /* nothing on the critical path is ready: a weight gradient fills the gap,
       the smallest microbatch first and, among the rank's stages at the same
       microbatch, the last stage first (<=: local[] is in stage order). So
       W(s, i) always runs before W(s', i) for s' < s on one rank: the
       executor frees what stage s' made for i after W(s', i), and a later
       stage of the rank may read it (a skip connection) until its own W. */
    int bw = -1;
    for (int q = g->first[r]; q < g->first[r + 1]; q++) {
        int s = g->local[q], i = g->next_w[s];
        if (i < g->next_b[s] && g->fin_b[(size_t)s * (size_t)m + (size_t)i] <= t && (bw < 0 || i <= g->next_w[bw]))
            bw = s;
    }
    *kind = SMP_SCHED_WEIGHT;
    return bw;
}

static smp_status smp__sched_interleaved(smp_schedule *sc) {
    int R = sc->nranks, S = sc->nstages, m = sc->microbatches;
    size_t n = (size_t)S * (size_t)m;
    smp_status st = SMP_OK;
    smp__sched_gen g;
    memset(&g, 0, sizeof g);
    g.R = R; g.S = S; g.m = m; g.fo = sc->forward_only;
    g.zb = smp__sched_split(sc->kind) && !g.fo; /* ZERO_BUBBLE_V comes here under a cap its V exceeds */
    g.cap = g.fo ? 0 : sc->active_microbatches;
    const long cost_f = 1, cost_b = g.zb ? 1 : 2, cost_w = 1; /* ZB-H1 assumes F = B = W */
    /* two zeroed blocks: the times (fin_f, fin_b, free_at), the counters */
    g.fin_f =
        (long *)smp__alloc_or(&st, sizeof(long) * (2 * n + (size_t)R), SMP__ALLOC_OTHER, "a schedule's generation");
    g.next_f = (int *)smp__alloc_or(&st, sizeof(int) * (5 * (size_t)S + 4 * (size_t)R + 1), SMP__ALLOC_OTHER,
                                    "a schedule's generation");
    if (g.cap) g.held = (int *)smp__alloc_or(&st, sizeof(int) * ((size_t)R * (size_t)m + (size_t)R), SMP__ALLOC_OTHER,
                                             "a schedule's generation");
    if (g.held) g.active = g.held + (size_t)R * (size_t)m;
    if (!st) {
        g.fin_b = g.fin_f + n;
        g.free_at = g.fin_b + n;
        int *at = g.next_f, **part[] = {&g.next_f,   &g.next_b,        &g.next_w,    &g.chunk, &g.local,
                                        &g.rank_cap, &g.rank_inflight, &g.last_kind, &g.first};
        for (int q = 0; q < 9; q++) {
            *part[q] = at;
            at += q < 5 ? S : R; /* 5 arrays per stage, then per rank (first: R + 1) */
        }
        for (size_t q = 0; q < n; q++) g.fin_f[q] = g.fin_b[q] = -1;
        /* chunk numbers and the stages of each rank (rank_inflight counts
           them for now) */
        for (int s = 0; s < S; s++) g.chunk[s] = g.rank_inflight[sc->stage_rank[s]]++;
        for (int r = 0; r < R; r++) g.first[r + 1] = g.first[r] + g.rank_inflight[r];
        for (int s = 0; s < S; s++) g.local[g.first[sc->stage_rank[s]] + g.chunk[s]] = s;
        bool round_robin = true;
        for (int s = 0; s < S; s++) round_robin = round_robin && sc->stage_rank[s] == s % R;
        for (int r = 0; r < R; r++) {
            int k = g.rank_inflight[r], last = g.local[g.first[r + 1] - 1];
            if (k > 1 && round_robin) g.rank_cap[r] = (k - 1) * (m < R ? m : R) + 2 * (S - 1 - last) + 1;
            g.rank_inflight[r] = 0;
            g.last_kind[r] = SMP_SCHED_BACKWARD; /* so the first pick prefers a forward */
        }

        long remaining = (long)n * (g.fo ? 1 : g.zb ? 3 : 2), t = 0;
        while (remaining > 0) {
            bool any_busy = false, started = false;
            for (int pass = 0; pass < 2 && !started && !any_busy; pass++) {
                /* pass 1 only when pass 0 left every rank idle: drop the rank bound */
                for (int r = 0; r < R; r++) {
                    if (g.free_at[r] > t) { any_busy = true; continue; }
                    smp_sched_op_kind kind;
                    int s = smp__sched_pick(&g, r, t, pass == 0, &kind);
                    if (s < 0) continue;
                    int i;
                    if (kind == SMP_SCHED_FORWARD) {
                        i = g.next_f[s]++;
                        g.free_at[r] = g.fin_f[(size_t)s * (size_t)m + (size_t)i] = t + cost_f;
                        g.rank_inflight[r]++;
                        if (g.cap && g.held[(size_t)r * (size_t)m + (size_t)i]++ == 0) g.active[r]++;
                    } else if (kind == SMP_SCHED_BACKWARD) {
                        i = g.next_b[s]++;
                        g.free_at[r] = g.fin_b[(size_t)s * (size_t)m + (size_t)i] = t + cost_b;
                        if (!g.zb) g.rank_inflight[r]--;
                    } else {
                        i = g.next_w[s]++;
                        g.free_at[r] = t + cost_w;
                        g.rank_inflight[r]--; /* zero bubble: the memory goes with the W */
                    }
                    smp__sched_push(sc, r, kind, s, i);
                    if (g.cap && kind == (g.zb ? SMP_SCHED_WEIGHT : SMP_SCHED_BACKWARD) &&
                        --g.held[(size_t)r * (size_t)m + (size_t)i] == 0)
                        g.active[r]--; /* the microbatch's last op on the rank: it leaves */
                    if (kind != SMP_SCHED_WEIGHT) g.last_kind[r] = (int)kind;
                    remaining--;
                    started = true;
                }
            }
            if (remaining == 0) break;
            /* on to the next time an operation finishes */
            long next = -1;
            for (int r = 0; r < R; r++)
                if (g.free_at[r] > t && (next < 0 || g.free_at[r] < next)) next = g.free_at[r];
            if (next < 0) {
                st = smp_error(SMP_ERR_STATE, "smp bug: the interleaved schedule generator got stuck "
                                              "(%d ranks, %d stages, %d microbatches)", R, S, m);
                break;
            }
            t = next;
        }
    }
    smp__free(g.fin_f); /* and the other times */
    smp__free(g.next_f); /* and the other counters */
    smp__free(g.held);
    return st;
}

/* ZB-V (Qi et al., ICLR 2024, section 6; torch.distributed.pipelining's
   ScheduleZBVZeroBubble): rank r runs chunk 0 = stage r and chunk 1 =
   stage 2p-1-r of 2p. With n = max(m, 2p-1) microbatches each rank runs
     warm-up    2(p-r)-1 F0; r times F1 F0; p-r times F1 B1 W1
     steady     F0 (while some remain) B0 W0 F1 B1 W1, until every F ran
     cool-down  r times B0 B1; p-r times B0 W0; the remaining W1, then W0
   and the ops of microbatches >= m are dropped (m < 2p-1). The rank holds
   at most 2p microbatch-chunks from F to W (2 min(m, p) for every m), half
   a stage each: 1F1B's peak, min(m, p) whole stages. With F = B = W = 1
   per chunk the step takes max(6m + p - 1, 4(m + p) - 2): for m >= 2p-1
   an idle time of p(p-1), half ZB-H1's and a sixth of 1F1B's for the same
   work, and never more than either for any m (test_schedule.c).
   Evaluation runs the same order's forwards. Every rank's list keeps the
   order of the full n-microbatch one, whose operations and dependencies
   form no cycle (the tests check every p <= 8, m <= 16), and dropping
   whole microbatches keeps it so. On rank r, W1(i) always comes before
   W0(i): the executor frees what chunk 0 made for i after W0(i), and chunk
   1 may read it (a skip connection across the V) until W1(i). */
static smp_status smp__sched_zbv(smp_schedule *sc) {
    int p = sc->nranks, S = sc->nstages, m = sc->microbatches, n = m > 2 * p - 1 ? m : 2 * p - 1;
    smp_status st = SMP_OK;
    smp_sched_op *tmp = (smp_sched_op *)smp__alloc_or(&st, sizeof(smp_sched_op) * 6 * (size_t)n,
                                                      SMP__ALLOC_OTHER | SMP__UNINIT, "a schedule's generation");
    if (st) return st;
    for (int r = 0; r < p; r++) {
        int c0 = r, c1 = S - 1 - r, k = 0, f0 = 0, f1 = 0, b0 = 0, b1 = 0, w0, w1;
#define SMP__ZBV(KIND, STAGE, MB) (tmp[k].kind = (KIND), tmp[k].stage = (STAGE), tmp[k].microbatch = (MB), k++)
        for (int q = 0; q < 2 * (p - r) - 1; q++) SMP__ZBV(SMP_SCHED_FORWARD, c0, f0++);
        for (int q = 0; q < r; q++) { SMP__ZBV(SMP_SCHED_FORWARD, c1, f1++); SMP__ZBV(SMP_SCHED_FORWARD, c0, f0++); }
        for (int q = 0; q < p - r; q++) {
            SMP__ZBV(SMP_SCHED_FORWARD, c1, f1++);
            SMP__ZBV(SMP_SCHED_BACKWARD, c1, b1);
            SMP__ZBV(SMP_SCHED_WEIGHT, c1, b1++);
        }
        while (f1 < f0 || f0 < n) {
            if (f0 < n) SMP__ZBV(SMP_SCHED_FORWARD, c0, f0++);
            SMP__ZBV(SMP_SCHED_BACKWARD, c0, b0);
            SMP__ZBV(SMP_SCHED_WEIGHT, c0, b0++);
            SMP__ZBV(SMP_SCHED_FORWARD, c1, f1++);
            SMP__ZBV(SMP_SCHED_BACKWARD, c1, b1);
            SMP__ZBV(SMP_SCHED_WEIGHT, c1, b1++);
        }
        w0 = b0;
        w1 = b1;
        for (int q = 0; q < r; q++) { SMP__ZBV(SMP_SCHED_BACKWARD, c0, b0++); SMP__ZBV(SMP_SCHED_BACKWARD, c1, b1++); }
        for (int q = 0; q < p - r; q++) {
            SMP__ZBV(SMP_SCHED_BACKWARD, c0, b0++);
            SMP__ZBV(SMP_SCHED_WEIGHT, c0, w0++);
        }
        while (w1 < b1) SMP__ZBV(SMP_SCHED_WEIGHT, c1, w1++);
        while (w0 < b0) SMP__ZBV(SMP_SCHED_WEIGHT, c0, w0++);
#undef SMP__ZBV
        if (k != 6 * n || f0 != n || f1 != n || b0 != n || b1 != n || w0 != n || w1 != n) {
            st = smp_error(SMP_ERR_STATE,
                           "smp bug: the zero_bubble_v schedule of rank %d has %d ops for %d microbatches", r, k, n);
            break;
        }
        for (int q = 0; q < k; q++)
            if (tmp[q].microbatch < m && (!sc->forward_only || tmp[q].kind == SMP_SCHED_FORWARD))
                sc->ops[r][sc->nops[r]++] = tmp[q];
    }
    smp__free(tmp);
    return st;
}

SMPDEF void smp_schedule_free(smp_schedule *s) {
    if (!s) return;
    for (int r = 0; r < s->nranks && s->ops; r++) smp__free(s->ops[r]);
    smp__free(s->ops);
    smp__free(s->nops);
    smp__free(s->stage_rank);
    memset(s, 0, sizeof *s);
}

/* The most distinct microbatches rank r of s holds at once (held: [m] zeroed, left zeroed only when its list is whole).
 */
static int smp__sched_rank_peak(const smp_schedule *s, int r, int *held) {
    smp_sched_op_kind last = smp__sched_split(s->kind) ? SMP_SCHED_WEIGHT : SMP_SCHED_BACKWARD;
    int active = 0, peak = 0;
    for (int k = 0; k < s->nops[r] && !s->forward_only; k++) {
        smp_sched_op op = s->ops[r][k];
        if (op.kind == SMP_SCHED_FORWARD && held[op.microbatch]++ == 0 && ++active > peak) peak = active;
        if (op.kind == last && --held[op.microbatch] == 0) active--;
    }
    return peak;
}

/* ZB-V under active_microbatches: its V when every rank fits under the cap,
   else the zero-bubble generator on the V's stage map with the cap. */
static smp_status smp__sched_zbv_capped(smp_schedule *sc) {
    smp_status st = smp__sched_zbv(sc);
    if (st || !sc->active_microbatches || sc->forward_only) return st;
    int *held =
        (int *)smp__alloc_or(&st, sizeof(int) * (size_t)sc->microbatches, SMP__ALLOC_OTHER, "a schedule's generation");
    bool fits = true;
    for (int r = 0; r < sc->nranks && fits && !st; r++)
        fits = smp__sched_rank_peak(sc, r, held) <= sc->active_microbatches;
    smp__free(held);
    if (st || fits) return st;
    for (int r = 0; r < sc->nranks; r++) sc->nops[r] = 0;
    return smp__sched_interleaved(sc);
}

SMPDEF smp_status smp_schedule_build(smp_pipeline_kind kind, int nranks, int nstages, const int *stage_rank,
                                     int microbatches, bool forward_only, smp_schedule *out) {
    return smp_schedule_build_capped(kind, nranks, nstages, stage_rank, microbatches, 0, forward_only, out);
}

SMPDEF smp_status smp_schedule_build_capped(smp_pipeline_kind kind, int nranks, int nstages, const int *stage_rank,
                                            int microbatches, int active_microbatches, bool forward_only,
                                            smp_schedule *out) {
    if (!out) return smp_error(SMP_ERR_ARG, "smp_schedule_build: out is NULL");
    memset(out, 0, sizeof *out);
    if (active_microbatches < 0)
        return smp_error(SMP_ERR_ARG, "active_microbatches must be at least 1, or 0 for no cap, got %d",
                         active_microbatches);
    if (kind == SMP_PIPELINE_DEFAULT) kind = SMP_PIPELINE_INTERLEAVED;
    if (kind != SMP_PIPELINE_INTERLEAVED && kind != SMP_PIPELINE_SIMPLE && kind != SMP_PIPELINE_ZERO_BUBBLE &&
        kind != SMP_PIPELINE_ZERO_BUBBLE_V)
        return smp_error(SMP_ERR_ARG,
                         "unknown pipeline kind %d (expected simple, interleaved, zero_bubble or zero_bubble_v)",
                         (int)kind);
    bool vee = kind == SMP_PIPELINE_ZERO_BUBBLE_V;
    smp_status st = smp__sched_check_map(nranks, nstages, stage_rank, microbatches, vee);
    if (st != SMP_OK) return st;
    if ((long long)nstages * microbatches * 3 > 0x7fffffffLL)
        return smp_error(SMP_ERR_ARG, "%d stages x %d microbatches is too many operations", nstages, microbatches);

    out->kind = kind;
    out->nranks = nranks;
    out->nstages = nstages;
    out->microbatches = microbatches;
    out->forward_only = forward_only;
    out->active_microbatches = active_microbatches;
    out->stage_rank = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)nstages, SMP__ALLOC_OTHER | SMP__UNINIT,
                                           "a schedule's stage map");
    for (int s = 0; s < nstages && !st; s++)
        out->stage_rank[s] = stage_rank ? stage_rank[s] : vee ? smp__vee_partition(s, nranks) : s % nranks;
    if (!st) st = smp__sched_alloc(out);
    if (!st && kind == SMP_PIPELINE_SIMPLE) smp__sched_simple(out);
    else if (!st) st = vee ? smp__sched_zbv_capped(out) : smp__sched_interleaved(out);
    if (st) smp_schedule_free(out);
    return st;
}

static char smp__sched_letter(smp_sched_op_kind k) { return "FBW"[k]; }

/* The operation op waits for: its stage (-1: none) and *kind. F(s) waits
   for F(s-1); B(S-1) for F(S-1); B(s) for B(s+1); W(s) for B(s). */
static int smp__sched_dep(smp_sched_op op, int S, smp_sched_op_kind *kind) {
    bool gradient = op.kind == SMP_SCHED_WEIGHT || (op.kind == SMP_SCHED_BACKWARD && op.stage < S - 1);
    *kind = gradient ? SMP_SCHED_BACKWARD : SMP_SCHED_FORWARD;
    if (op.kind == SMP_SCHED_FORWARD) return op.stage - 1;
    return op.kind == SMP_SCHED_BACKWARD && op.stage < S - 1 ? op.stage + 1 : op.stage;
}

/* Checks rank r's k-th operation (in range, on its stage's rank, of one of
   the schedule's `kinds`, listed once) and marks it in listed[kind][stage][mb]. */
static smp_status smp__sim_list(const smp_schedule *s, int r, int k, int kinds, char *listed) {
    smp_sched_op op = s->ops[r][k];
    int S = s->nstages, m = s->microbatches;
    if (op.kind != SMP_SCHED_FORWARD && op.kind != SMP_SCHED_BACKWARD && op.kind != SMP_SCHED_WEIGHT)
        return smp_error(SMP_ERR_ARG, "rank %d op %d has unknown kind %d", r, k, (int)op.kind);
    if (op.stage < 0 || op.stage >= S || op.microbatch < 0 || op.microbatch >= m)
        return smp_error(SMP_ERR_ARG,
                         "rank %d op %d is %c(stage %d, microbatch %d), outside %d stages x %d microbatches", r, k,
                         smp__sched_letter(op.kind), op.stage, op.microbatch, S, m);
    if (s->stage_rank[op.stage] != r)
        return smp_error(SMP_ERR_ARG, "rank %d op %d is %c(stage %d, microbatch %d), but stage %d runs on rank %d", r,
                         k, smp__sched_letter(op.kind), op.stage, op.microbatch, op.stage, s->stage_rank[op.stage]);
    if ((int)op.kind >= kinds)
        return smp_error(SMP_ERR_ARG, "rank %d op %d is a %s in a %s schedule", r, k,
                         op.kind == SMP_SCHED_WEIGHT ? "weight-gradient op" : "backward",
                         s->forward_only ? "forward-only" : "non-zero-bubble");
    char *at = &listed[((size_t)op.kind * (size_t)S + (size_t)op.stage) * (size_t)m + (size_t)op.microbatch];
    if (*at)
        return smp_error(SMP_ERR_ARG, "%c(stage %d, microbatch %d) appears twice in the schedule",
                         smp__sched_letter(op.kind), op.stage, op.microbatch);
    *at = 1;
    return SMP_OK;
}

SMPDEF void smp_sim_result_free(smp_sim_result *r) {
    if (!r) return;
    smp__free(r->peak_inflight);
    smp__free(r->rank_peak_inflight);
    smp__free(r->rank_peak_microbatches);
    memset(r, 0, sizeof *r);
}

/* smp_schedule_simulate once s has its stage map and op lists, in zeroed
   memory: fin (3 S m + 3 S + R doubles), done (3 S m), idx (2 R + S + R m + R ints). */
static smp_status smp__sim_run(const smp_schedule *s, const double *const given[3], double comm_latency, double *fin,
                               char *done, int *idx, smp_sim_result *out) {
    int R = s->nranks, S = s->nstages, m = s->microbatches;
    bool zb = smp__sched_split(s->kind) && !s->forward_only;
    int kinds = s->forward_only ? 1 : zb ? 3 : 2;
    size_t n = (size_t)S * (size_t)m;
    double *cost = fin + 3 * n, *clock = cost + 3 * S; /* fin: [kind][stage][mb]; cost: [kind][stage]; clock: [rank] */
    int *cnt = idx + R, *rcnt = cnt + S; /* microbatches in flight per stage and rank */
    /* [rank][mb]: its stages holding mb; [rank]: mbs held */
    int *held = rcnt + R, *ract = held + (size_t)R * (size_t)m;
    smp_status st = SMP_OK;
    static const char *const cost_name[3] = {"forward", "backward", "weight"};
    for (int q = 0; q < S && !st; q++)
        for (int kd = 0; kd < 3 && !st; kd++) {
            double v = given[kd] ? given[kd][q] : kd < 2 || zb ? 1.0 : 0.0; /* W: 0 outside zero bubble unless given */
            if (!(v >= 0) || !isfinite(v))
                st = smp_error(SMP_ERR_ARG, "%s cost of stage %d must be finite and >= 0, got %g", cost_name[kd], q, v);
            cost[kd * S + q] = v;
        }
    for (int q = 0; q < S && !zb; q++) cost[S + q] += cost[2 * S + q]; /* outside zero bubble a backward is B + W */

    /* validate: every op in range, on its stage's rank, exactly once */
    for (int r = 0; r < R && !st; r++) {
        if (s->nops[r] < 0 || (s->nops[r] > 0 && !s->ops[r]))
            st = smp_error(SMP_ERR_ARG, "rank %d has a bad op list (%d ops)", r, s->nops[r]);
        for (int k = 0; k < s->nops[r] && !st; k++) st = smp__sim_list(s, r, k, kinds, done);
    }
    for (int kd = 0; kd < kinds && st == SMP_OK; kd++)
        for (size_t at = 0; at < n; at++)
            if (!done[(size_t)kd * n + at]) {
                st = smp_error(SMP_ERR_ARG, "the schedule never runs %c(stage %d, microbatch %d)",
                               smp__sched_letter((smp_sched_op_kind)kd), (int)(at / (size_t)m),
                               (int)(at % (size_t)m));
                break;
            }
    if (st != SMP_OK) return st;

    /* run: sweep the ranks, advancing each as far as its next op's
       dependency is finished. An op's start depends only on its rank's
       previous op and its dependency, so sweep order does not matter.
       A microbatch holds the stage's memory from its F to its last op
       there (W in zero-bubble schedules, else B). */
    long total = 0, finished = 0;
    for (int r = 0; r < R; r++) total += s->nops[r];
    while (finished < total) {
        bool progressed = false;
        for (int r = 0; r < R; r++) {
            while (idx[r] < s->nops[r]) {
                smp_sched_op op = s->ops[r][idx[r]];
                size_t me = (size_t)op.kind * n + (size_t)op.stage * (size_t)m + (size_t)op.microbatch;
                smp_sched_op_kind dep_kind;
                int dep_stage = smp__sched_dep(op, S, &dep_kind);
                double start = clock[r];
                if (dep_stage >= 0) {
                    size_t dep = (size_t)dep_kind * n + (size_t)dep_stage * (size_t)m + (size_t)op.microbatch;
                    if (done[dep] != 2) break;
                    double ready = fin[dep] + (s->stage_rank[dep_stage] != r ? comm_latency : 0.0);
                    if (ready > start) start = ready;
                }
                double c = cost[(int)op.kind * S + op.stage];
                fin[me] = start + c;
                done[me] = 2;
                clock[r] = fin[me];
                out->busy += c;
                if (fin[me] > out->makespan) out->makespan = fin[me];
                if (!s->forward_only && op.kind != (zb ? SMP_SCHED_BACKWARD : SMP_SCHED_WEIGHT)) {
                    int d = op.kind == SMP_SCHED_FORWARD ? 1 : -1;
                    cnt[op.stage] += d;
                    rcnt[r] += d;
                    if (cnt[op.stage] > out->peak_inflight[op.stage]) out->peak_inflight[op.stage] = cnt[op.stage];
                    if (rcnt[r] > out->rank_peak_inflight[r]) out->rank_peak_inflight[r] = rcnt[r];
                    int *h = &held[(size_t)r * (size_t)m + (size_t)op.microbatch];
                    if (d > 0 ? (*h)++ == 0 : --*h == 0) ract[r] += d; /* the microbatch enters or leaves the rank */
                    if (ract[r] > out->rank_peak_microbatches[r]) out->rank_peak_microbatches[r] = ract[r];
                }
                idx[r]++;
                finished++;
                progressed = true;
            }
        }
        if (finished < total && !progressed) {
            smp__sbuf why;
            memset(&why, 0, sizeof why);
            out->deadlock = true;
            smp__sbuf_printf(&why, "deadlock after %ld of %ld ops:", finished, total);
            for (int r = 0; r < R; r++) {
                if (idx[r] >= s->nops[r]) continue;
                smp_sched_op op = s->ops[r][idx[r]];
                smp_sched_op_kind dk;
                int ds = smp__sched_dep(op, S, &dk);
                smp__sbuf_printf(&why, " rank %d at %c%d.%d waits for %c%d.%d (rank %d);", r,
                                 smp__sched_letter(op.kind), op.stage, op.microbatch, smp__sched_letter(dk), ds,
                                 op.microbatch, s->stage_rank[ds]);
            }
            /* as much as the result holds, "..." marking a cut */
            size_t cap = sizeof out->deadlock_reason;
            if (why.oom) st = smp__nomem(why.want, "the description of a deadlock");
            else snprintf(out->deadlock_reason, cap, "%s", why.p);
            if (why.len >= cap) memcpy(out->deadlock_reason + cap - 4, "...", 4);
            smp__free(why.p);
            break;
        }
    }
    double work = 0;
    for (int q = 0; q < S; q++)
        work += (double)m * (cost[q] + (s->forward_only ? 0.0 : zb ? cost[S + q] + cost[2 * S + q] : cost[S + q]));
    out->ideal = work / R;
    out->bubble_fraction = out->makespan > 0 ? 1.0 - out->busy / ((double)R * out->makespan) : 0.0;
    return st;
}

SMPDEF smp_status smp_schedule_simulate(const smp_schedule *s, const double *fwd_cost, const double *bwd_cost,
                                        const double *wgt_cost, double comm_latency, smp_sim_result *out) {
    if (!out) return smp_error(SMP_ERR_ARG, "smp_schedule_simulate: out is NULL");
    memset(out, 0, sizeof *out);
    if (!s) return smp_error(SMP_ERR_ARG, "smp_schedule_simulate: schedule is NULL");
    int R = s->nranks, S = s->nstages, m = s->microbatches;
    smp_status st = smp__sched_check_map(R, S, s->stage_rank, m, s->kind == SMP_PIPELINE_ZERO_BUBBLE_V);
    if (st != SMP_OK) return st;
    if (!s->stage_rank || !s->nops || !s->ops)
        return smp_error(SMP_ERR_ARG, "schedule has no stage map or no op lists");
    if (!(comm_latency >= 0) || !isfinite(comm_latency))
        return smp_error(SMP_ERR_ARG, "comm_latency must be finite and >= 0, got %g", comm_latency);
    size_t n = (size_t)S * (size_t)m;
    const char *what = "a schedule's simulation";
    const double *given[3] = {fwd_cost, bwd_cost, wgt_cost};
    double *fin =
        (double *)smp__alloc_or(&st, sizeof(double) * (3 * n + 3 * (size_t)S + (size_t)R), SMP__ALLOC_OTHER, what);
    char *done = (char *)smp__alloc_or(&st, 3 * n, SMP__ALLOC_OTHER, what);
    int *idx = (int *)smp__alloc_or(&st, sizeof(int) * (3 * (size_t)R + (size_t)S + (size_t)R * (size_t)m),
                                    SMP__ALLOC_OTHER, what);
    out->peak_inflight = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)S, SMP__ALLOC_OTHER, what);
    out->rank_peak_inflight = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)R, SMP__ALLOC_OTHER, what);
    out->rank_peak_microbatches = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)R, SMP__ALLOC_OTHER, what);
    if (!st) st = smp__sim_run(s, given, comm_latency, fin, done, idx, out);
    smp__free(fin);
    smp__free(done);
    smp__free(idx);
    if (st != SMP_OK) smp_sim_result_free(out);
    return st;
}

/* ---------------------------------------------------------------- executor */
/* The executor replays the traced calls: per microbatch, each stage runs its
   calls in order; tensors that cross to a stage on another rank travel as
   one message per (producer stage, consumer stage, microbatch), a small
   header with the shapes, then the bytes (one buffer: several tensors are
   packed into it first). All receives of a step are
   posted before it starts and sends never block, so no order of operations
   between two ranks can deadlock; per (peer, tag) MPI keeps messages in
   order, and every schedule runs a stage's microbatches in increasing
   order, so the k-th message matches the k-th receive.

   On-device models: headers still go over MPI. The bytes go through the
   backend's point to point (one transfer per non-empty tensor, straight
   from and into device memory) when it has one that does not itself go
   through the host; otherwise they are staged through host buffers over
   the MPI path above. The backend pairs transfers between two ranks in
   order, whatever message they belong to, so every header carries the
   sequence number of its first transfer, and a receiver queues the
   transfers of arrived headers in that order (peers' per-direction
   counts, reset each step). A failed step drains every transfer that was
   sent before the ranks move on (smp__drain_device, then every MPI message
   of the step: smp__drain_messages), so the next step starts on clean
   communicators. */

/* (call, out) feeds input `input` of call `consumer` (ncalls: the body), which runs in stage `stage`; remote: on
 * another rank */
typedef struct smp__edge { int call, out, consumer, input, stage; bool remote; } smp__edge;

typedef struct smp__link {
    int from, to;        /* producer stage, consumer stage */
    int peer_from, peer_to; /* their mp ranks */
    int *tensors, ntensors; /* forward: producer tensors (call * maxout + out), in order */
    int *edges, nedges;     /* backward: one gradient per edge, in order */
} smp__link;

/* Where a transfer stands. A receive goes IDLE -> HEADER_POSTED -> HEADER_ARRIVED -> (device: DEVICE_WAITING ->)
   BYTES_POSTED -> ARRIVED; a send is SENDING until it completes. smp__xfer_free makes either IDLE again. */
typedef enum smp__xfer_state {
    SMP__XFER_IDLE,           /* not posted, or finished and let go */
    SMP__XFER_SENDING,        /* a send in flight (req[0] the header, req[1] the bytes; device transfers) */
    SMP__XFER_HEADER_POSTED,  /* the header's receive is posted (req[0]) */
    SMP__XFER_HEADER_ARRIVED, /* the header arrived, its bytes not asked for yet: a failed step may leave it so */
    SMP__XFER_DEVICE_WAITING, /* device payloads: the header arrived, its receives wait for their turn in the order
                                 the peer sent (smp__queue_device_recv) */
    SMP__XFER_BYTES_POSTED,   /* the bytes' receive is posted (req[1]), or the device receives are queued */
    SMP__XFER_ARRIVED         /* header and bytes have arrived */
} smp__xfer_state;

typedef struct smp__xfer {
    MPI_Request req[2];
    int64_t *hdr;            /* SMP__HDR_WORDS(ntensors): dtype, ndim, shape[8] per tensor, the first device
                                transfer's number, and a check of all that (smp__hdr_seal) */
    void *buf;               /* receive: the bytes; send: what to free once sent */
    size_t bytes;            /* receive: of buf */
    smp__xfer_state state;
    int peer, ntensors;
    void **dev_req;          /* the backend's transfers of this message, until waited */
    int ndev_req;
    int stage, mb;           /* send: the forward or backward that sent it */
    double t_post;           /* send: when it was posted (timeline) */
    bool backward;
    bool hdr_in_table;       /* send: hdr is the step's (send_hdrs), not a block of its own */
    bool wanted;             /* receive: an operation waits for it, so its bytes get memory now, pooled or not */
} smp__xfer;
#define SMP__HDR_WORDS(ntensors) (10 * (ntensors) + 2)

/* A timeline event's kind; the timeline's tables (smp__timeline_write) are in this order. */
typedef enum smp__event_kind {
    SMP__EVENT_FORWARD,
    SMP__EVENT_BACKWARD,  /* a stage's whole backward, or B of a zero-bubble schedule */
    SMP__EVENT_WAIT,      /* for a receive */
    SMP__EVENT_BODY,
    SMP__EVENT_ALLREDUCE, /* a gradient bucket's collective (mb: the bucket) */
    SMP__EVENT_SEND,      /* posted to completed */
    SMP__EVENT_WEIGHT,    /* W of a zero-bubble schedule */
    SMP__EVENT_GATHER     /* shard_optimizer_state: a bucket's parameter all-gather, from its start until the step
                             put its parameters in place (mb: the bucket) */
} smp__event_kind;
typedef struct smp__event { double t0, t1; smp__event_kind kind; int stage, mb; } smp__event;

typedef struct smp__mbstate { /* one block, from act */
    smp_tensor *act;       /* [ncalls * maxout]: this microbatch's tensors known here */
    smp_call_ctx *ctx;     /* [ncalls]: local calls */
    smp_tensor *contrib;   /* [nedges]: gradient contributions, owned */
    smp_tensor *out_grad;  /* [noutputs]: the body's output gradients */
    smp_tensor *args;      /* [nargs]: this microbatch's slice of each argument */
    void **arg_copies;     /* slices along axes other than 0 are copies */
    smp_tensor *returned;  /* [SMP_MAX_STEP_ARGS]: the body's values */
} smp__mbstate;

typedef struct smp__bucket {
    void *data;          /* the gradients of `count` parameters, back to back */
    size_t bytes;
    int64_t numel;
    smp_dtype dtype;
    int first, count;    /* its parameters: the model's grad_order[first .. first + count) */
    int final;           /* how many of them are final this step */
    bool ready;          /* may start: overlap on and all final, or the step's end */
    MPI_Request req;     /* host buckets; device collectives are the backend's to order */
    void *gather;        /* deterministic reduction: every replica's copy (of this replica's piece, reduce-scattered);
                            a device bucket reduce-scattered: its piece, summed */
    int pieces;          /* how many of them smp__ddp_finish sums, in rank order */
    double t_start;      /* when its collective started (timeline) */
    int device;          /* SMP_HOST or where data lives */
    /* shard_optimizer_state: the parameters of its gradients, every replica's piece gathered, from the step's start
       until the first forward that reads one of them (smp__params_wait) */
    void *params;
    MPI_Request params_req; /* host */
    void *params_handle;    /* device: the backend's gather_start handle (NULL: gathered already) */
    double t_params;        /* when the all-gather started (timeline) */
} smp__bucket;

/* The gradient one call of a shared module adds over a step (on the partition that runs the call). */
typedef struct smp__shared { int call, param, part; smp_tensor grad; } smp__shared;

/* What is fixed once the model is traced and partitioned: the executor's plan. smp__pipe_build makes its
   tables; the first step of each kind adds that kind's schedule, and the first data-parallel step lays out the
   buckets (smp__step_prepare); after that nothing in the plan changes. What its arrays point at is another
   matter: the buckets' bytes and the shared slots' gradients are rewritten by every step, and each bucket
   carries its step's progress (final, ready, req, gather), which smp__ddp_finish resets. */
typedef struct smp__plan {
    int maxout, nedges, nlinks;
    smp__edge *edges;       /* grouped by producer tensor, consumers in increasing order */
    int *first_edge;        /* [ncalls * maxout + 1]: edges of each producer tensor */
    int *edge_of_input;     /* [ncalls * maxin]: the edge feeding (call, input), or -1 */
    int maxin;
    smp__link *links;
    smp_schedule sched[2]; /* [evaluate] */
    /* activation recomputation */
    bool *internal;        /* [ncalls * maxout]: an output only its recomputed call reads (freed after the forward,
                              made again before the backward) */
    /* shared modules: the gradient each call of one adds, gathered and summed in call order at the step's end */
    smp__shared *shared;   /* in call order, then parameter order */
    int nshared;
    int *shared_first;     /* [ncalls + 1]: each call's slots */
    /* on-device models */
    bool on_device;
    bool dev_p2p;          /* payloads through the backend's point to point (else staged through host buffers) */
    /* data parallelism */
    smp__bucket *buckets;
    int nbuckets;
    bool scatter;          /* shard_optimizer_state: buckets are reduce-scattered, each replica gets its piece */
    /* shard_optimizer_state: reads[reads_first[k] .. reads_first[k + 1]) are the buckets holding parameters of
       local call k's module; at index ncalls, those of parameters no local call reads (waited for before the
       step's first forward) */
    int *reads_first, *reads;
    int *gather_order;     /* [nbuckets]: the buckets in the order this rank's forward first reads them */
} smp__plan;

/* One step's state: set by smp__step_begin and smp__step_post_receives, let go of by smp__release_step. */
typedef struct smp__step_state {
    int m;
    bool training;
    bool zb;               /* this step's schedule has W ops (zero bubble, training) */
    bool sync;             /* this step ends with the data-parallel gradient sync */
    bool grads_were_zero;  /* training: no step has added into the gradients since they were last zeroed */
    int model_outs;        /* body NULL: how many of the model's outputs become the step's outputs */
    const smp_step_desc *desc;
    const smp_schedule *sched;
    double t_start;
    int64_t stash_at_start; /* stash bytes when the step began (its peak is measured from there) */
    smp__mbstate *mb;
    smp__xfer *recv;       /* [(link * m + mb) * 2 + backward] */
    int *recv_front;       /* [link * 2 + backward]: its first microbatch whose receive is not finished (in recv's
                              block) */
    smp__xfer *sends;      /* kept from step to step, room made for every send as the step begins */
    int nsends, sends_cap;
    int64_t *send_hdrs;    /* [(link * m + mb) * 2 + backward]: the sends' headers, SMP__HDR_WORDS(most) words each */
    int send_hdr_words;
    bool failed_remote;    /* another rank's failure notice arrived */
    /* counters, zeroed as the step begins (their storage: the pipe's workspace) */
    int *inflight;         /* [nstages] */
    int *dev_sent, *dev_posted; /* [mp rank]: device transfers sent to it / receives queued from it */
    int *msgs_sent;        /* [mp rank * 2]: MPI messages sent to it on comm, and failure notices on err_comm */
    int *msgs_got;         /* [mp rank]: messages from it on comm received outside the receive slots (shared
                              gradients) */
    /* data parallelism */
    int next_bucket;       /* the first bucket not started */
    bool bucket_failed;    /* a host bucket's collective failed to start on this rank */
    bool fence_buckets;    /* device buckets reduce behind the engine: fence it before the step returns */
    int params_gathering;  /* shard_optimizer_state: buckets whose parameter all-gather is not waited for yet */
} smp__step_state;

/* The executor of one model (smp_model's pipeline): its plan, the step in progress, and what lasts from step
   to step. */
typedef struct smp__pipe {
    smp__plan plan;
    smp__step_state step;
    MPI_Comm comm, err_comm; /* the pipeline's messages; failure notices */
    MPI_Request err_req;     /* the receive of a failure notice, reposted after a failed step */
    int err_from;            /* the mp rank whose failure notice err_req received, or -1 */
    char err_msg[sizeof smp__errbuf + 8];
    bool dev_connected;      /* the backend's channels to the pipeline's neighbours are made */
    bool ddp_ready;          /* parameters broadcast, buckets laid out */
    long passes;             /* training steps so far (backward_passes_per_step) */
    bool averaged_grads_held;         /* the last sync's result may still be in the gradients */
    unsigned long zero_calls_at_sync; /* smp_model_zero_grad calls when it ran */
    /* A failed training step has added part of its sums into the gradients. Zeroed ones it zeroes again; sums
       of earlier steps (accumulation) cannot be told apart from its own, and the next training step refuses
       to add to them until smp_model_zero_grad. */
    bool grads_dirty;                  /* a training step added into the gradients ... */
    unsigned long zero_calls_at_train; /* ... and smp_model_zero_grad had been called so often when it ended */
    bool grads_partial;                /* a failed step left them so */
    /* workspace, made with the plan */
    const smp_tensor **scratch; /* [max tensors on a link]: what one message carries */
    smp__xfer **await;     /* [nlinks]: the receives one stage waits for */
    int *await_link;
    int *peak, *stage_index; /* [nstages]: step stats */
    smp_step_stats stats;  /* the last step's */
    smp__event *events;
    int nevents, events_cap;
    bool timeline;
    double t_origin;
    /* memory: microbatches held on this rank (active_microbatches) */
    int *mb_held;          /* [m]: this rank's stages holding each microbatch for its backward */
    int mb_held_cap, mb_active;
    /* [link * 2 + backward]: the received messages' bytes. A message is received as its header arrives only into a
       free block of its pool, and otherwise when an operation waits for it, so which blocks a step needs does not
       depend on when messages arrive, and a step of an unchanged model takes every one from the pools */
    smp__cache **recv_pool;
    /* offload_activations: this step's blocks in host memory and where the step points at them */
    bool offloading;
    struct smp__offload *off;
    int noff, off_cap;
    struct smp__off_slot *off_slots;
    int noff_slots, off_slots_cap;
    int *bwd_at;           /* [nstages * m]: where B(s, i) is in this rank's operations, -1 nowhere */
    int bwd_at_cap;
} smp__pipe;

static smp_status smp__timeline_write(smp__pipe *ps);
/* A timeline event (SMP_TIMELINE) from t0 to now. */
static void smp__event_add(smp__pipe *ps, smp__event_kind kind, int stage, int mb, double t0) {
    if (!ps->timeline) return;
    if (!smp__grow((void **)&ps->events, &ps->events_cap, ps->nevents + 1, sizeof(smp__event), NULL)) {
        /* a diagnostic, not the job's work: it stops, and says so */
        smp__log(SMP_LOG_WARN, "out of memory recording the timeline after %d events: SMP_TIMELINE records no more",
                 ps->nevents);
        ps->timeline = false;
        return;
    }
    smp__event *e = &ps->events[ps->nevents++];
    e->t0 = t0 - ps->t_origin;
    e->t1 = smp__now() - ps->t_origin;
    e->kind = kind;
    e->stage = stage;
    e->mb = mb;
}

/* Lets go of the plan's tables (the buckets' bytes too: parameters stop pointing there first). */
static void smp__plan_free(smp__plan *pl) {
    smp__free(pl->edges);
    smp__free(pl->first_edge);
    smp__free(pl->edge_of_input);
    smp__free(pl->internal);
    for (int q = 0; q < pl->nshared; q++) smp__free(pl->shared[q].grad.data);
    smp__free(pl->shared);
    smp__free(pl->shared_first);
    for (int i = 0; i < pl->nlinks; i++) { smp__free(pl->links[i].tensors); smp__free(pl->links[i].edges); }
    smp__free(pl->links);
    smp_schedule_free(&pl->sched[0]);
    smp_schedule_free(&pl->sched[1]);
    for (int b = 0; b < pl->nbuckets; b++) smp__free(pl->buckets[b].data);
    smp__free(pl->buckets);
    smp__free(pl->reads_first); /* reads lives in its block */
}

static void smp__pipe_free(void *p) {
    smp__pipe *ps = (smp__pipe *)p;
    if (!ps) return;
    /* collective, like smp_model_free's documentation says */
    if (ps->timeline && smp__ctx.initialized) smp__timeline_write(ps);
    smp__plan_free(&ps->plan);
    smp__free(ps->scratch);
    smp__free(ps->await);
    smp__free(ps->peak); /* and the other int arrays of its block */
    if (ps->err_req != MPI_REQUEST_NULL) { /* the receive of failure notices goes with the model */
        SMP__MPI_WARN(MPI_Cancel(&ps->err_req), "withdrawing the receive of pipeline failure notices");
        SMP__MPI_WARN(MPI_Wait(&ps->err_req, MPI_STATUS_IGNORE), "withdrawing the receive of pipeline failure notices");
    }
    if (smp__ctx.initialized && ps->comm != MPI_COMM_NULL) {
        SMP__MPI_WARN(MPI_Comm_free(&ps->comm), "releasing a pipeline's communicator");
        SMP__MPI_WARN(MPI_Comm_free(&ps->err_comm), "releasing a pipeline's failure communicator");
    }
    smp__free(ps->events);
    smp__free(ps->mb_held);
    smp__free(ps->step.sends);
    for (int i = 0; ps->recv_pool && i < 2 * ps->plan.nlinks; i++) smp__cache_free(ps->recv_pool[i]);
    smp__free(ps->recv_pool);
    smp__free(ps->off);
    smp__free(ps->off_slots);
    smp__free(ps->bwd_at);
    smp__free(ps);
}

/* The receive of another rank's failure notice, one per step. A rank
   without it would wait out SMP_TIMEOUT when a peer fails, and no
   agreement could follow: its failure aborts. */
static void smp__post_err(smp__pipe *ps) {
    ps->err_from = -1;
    SMP__MPI_FATAL(
        MPI_Irecv(ps->err_msg, (int)sizeof ps->err_msg, MPI_CHAR, MPI_ANY_SOURCE, 1, ps->err_comm, &ps->err_req),
        "posting the receive of pipeline failure notices (MP_GROUP)");
}

static bool smp__in_subtree(const smp_module *m, const smp_module *root) {
    for (; m; m = m->parent)
        if (m == root) return true;
    return false;
}

/* One slot per (leaf call of a shared module, parameter of the module's
   tree), every rank alike: the gradient that call adds up over the step. */
static smp_status smp__shared_build(smp__plan *pl, smp_model *md) {
    int n = md->ncalls, cap = 0;
    smp_status st = SMP_OK;
    const char *what = "the pipeline's shared modules";
    pl->shared_first = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(n + 1), SMP__ALLOC_OTHER, what);
    for (int k = 0; k < n && !st; k++) {
        pl->shared_first[k] = pl->nshared;
        smp_module *mod = md->calls[k].module;
        if (mod->uses < 2) continue;
        for (int i = 0; i < md->nparams; i++) {
            smp_param *p = md->params[i];
            if (p->is_buffer || !smp__in_subtree(p->module, mod)) continue;
            if (!smp__grow_or(&st, (void **)&pl->shared, &cap, pl->nshared + 1, sizeof *pl->shared, what)) return st;
            smp__shared *q = &pl->shared[pl->nshared++];
            q->call = k;
            q->param = i;
            q->part = md->stage_rank[md->calls[k].stage];
            q->grad = p->grad;
            q->grad.data = NULL;
        }
    }
    if (!st) pl->shared_first[n] = pl->nshared;
    return st;
}

/* The executor's tables for a traced, partitioned model; NULL with
   SMP_ERR_NOMEM when there is no memory for them. */
static smp__pipe *smp__pipe_build(smp_model *md) {
    smp_status st = SMP_OK;
    const char *what = "the pipeline's tables";
    smp__pipe *ps = (smp__pipe *)smp__alloc_or(&st, sizeof *ps, SMP__ALLOC_OTHER, what);
    if (!ps) return NULL;
    smp__plan *pl = &ps->plan;
    ps->comm = ps->err_comm = MPI_COMM_NULL;
    ps->err_req = MPI_REQUEST_NULL;
    int n = md->ncalls, S = md->nstages;
    for (int k = 0; k < n; k++) {
        if (md->calls[k].nout > pl->maxout) pl->maxout = md->calls[k].nout;
        if (md->calls[k].nin > pl->maxin) pl->maxin = md->calls[k].nin;
    }
    if (pl->maxin == 0) pl->maxin = 1;
    int T = n * pl->maxout;
    /* edges: every (producer tensor -> consumer input), consumers in call order, the body last */
    /* (declared before the first goto: C++ builds of this header reject a jump past an initialisation) */
    int *link_of = NULL, cap = 0, most = 1, P = smp__ctx.cfg.partitions;
    const smp_device_backend *b = &smp__ctx.device;
    int *count = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(T + 1), SMP__ALLOC_OTHER, what);
    pl->first_edge = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(T + 1), SMP__ALLOC_OTHER, what);
    pl->edge_of_input = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(n * pl->maxin), SMP__ALLOC_OTHER, what);
    if (st) goto fail;
    for (int c = 0; c < n; c++)
        for (int i = 0; i < md->calls[c].nin; i++)
            if (md->calls[c].in[i].call >= 0) count[md->calls[c].in[i].call * pl->maxout + md->calls[c].in[i].index]++;
    for (int o = 0; o < md->desc.noutputs; o++) count[md->outputs[o].call * pl->maxout + md->outputs[o].index]++;
    for (int t = 0; t < T; t++) pl->first_edge[t + 1] = pl->first_edge[t] + count[t];
    pl->nedges = pl->first_edge[T];
    pl->edges = (smp__edge *)smp__alloc_or(&st, sizeof(smp__edge) * (size_t)pl->nedges, SMP__ALLOC_OTHER, what);
    if (st) goto fail;
    for (int i = 0; i < n * pl->maxin; i++) pl->edge_of_input[i] = -1;
    memset(count, 0, sizeof(int) * (size_t)(T + 1));
    for (int c = 0; c <= n; c++) {
        int nin = c < n ? md->calls[c].nin : md->desc.noutputs;
        for (int i = 0; i < nin; i++) {
            smp__ref r = c < n ? md->calls[c].in[i] : md->outputs[i];
            if (r.call < 0) continue;
            int t = r.call * pl->maxout + r.index, e = pl->first_edge[t] + count[t]++;
            pl->edges[e].call = r.call;
            pl->edges[e].out = r.index;
            pl->edges[e].consumer = c;
            pl->edges[e].input = i;
            pl->edges[e].stage = c < n ? md->calls[c].stage : S - 1;
            pl->edges[e].remote = md->stage_rank[pl->edges[e].stage] != md->stage_rank[md->calls[r.call].stage];
            if (c < n) pl->edge_of_input[c * pl->maxin + i] = e;
        }
    }
    smp__free(count);
    count = NULL;
    /* links between stages on different ranks */
    link_of = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(S * S), SMP__ALLOC_OTHER, what);
    for (int i = 0; i < S * S && !st; i++) link_of[i] = -1;
    for (int e = 0; e < pl->nedges && !st; e++) {
        int from = md->calls[pl->edges[e].call].stage, to = pl->edges[e].stage;
        if (!pl->edges[e].remote) continue;
        int *L = &link_of[from * S + to];
        if (*L < 0) {
            if (!smp__grow_or(&st, (void **)&pl->links, &cap, pl->nlinks + 1, sizeof(smp__link), what)) break;
            *L = pl->nlinks++;
            smp__link *l = &pl->links[*L];
            memset(l, 0, sizeof *l);
            l->from = from;
            l->to = to;
            l->peer_from = md->stage_rank[from];
            l->peer_to = md->stage_rank[to];
            l->tensors = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)pl->nedges, SMP__ALLOC_OTHER, what);
            l->edges = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)pl->nedges, SMP__ALLOC_OTHER, what);
            if (st) break;
        }
        smp__link *l = &pl->links[*L];
        int t = pl->edges[e].call * pl->maxout + pl->edges[e].out;
        /* edges are grouped by tensor */
        if (l->ntensors == 0 || l->tensors[l->ntensors - 1] != t) l->tensors[l->ntensors++] = t;
        l->edges[l->nedges++] = e;
    }
    smp__free(link_of);
    if (st) goto fail;
    for (int l = 0; l < pl->nlinks; l++) {
        if (pl->links[l].ntensors > most) most = pl->links[l].ntensors;
        if (pl->links[l].nedges > most) most = pl->links[l].nedges;
    }
    ps->scratch = (const smp_tensor **)smp__alloc_or(&st, sizeof(smp_tensor *) * (size_t)most, SMP__ALLOC_OTHER, what);
    ps->await = (smp__xfer **)smp__alloc_or(&st, sizeof(smp__xfer *) * (size_t)(pl->nlinks + 1), SMP__ALLOC_OTHER,
                                            what);
    ps->peak = (int *)smp__alloc_or(&st, sizeof(int) * (3 * (size_t)S + 5 * (size_t)P + (size_t)pl->nlinks + 1),
                                    SMP__ALLOC_OTHER, what);
    pl->internal = (bool *)smp__alloc_or(&st, (size_t)T + 1, SMP__ALLOC_OTHER, what);
    if (st || (st = smp__shared_build(pl, md))) goto fail;
    ps->stage_index = ps->peak + S; /* the rest of peak's block */
    ps->step.inflight = ps->stage_index + S;
    ps->step.dev_sent = ps->step.inflight + S;
    ps->step.dev_posted = ps->step.dev_sent + P;
    ps->step.msgs_sent = ps->step.dev_sent + 2 * P;
    ps->step.msgs_got = ps->step.dev_sent + 4 * P;
    ps->await_link = ps->step.dev_sent + 5 * P;
    for (int k = 0; k < n; k++) {
        const smp__call_rec *c = &md->calls[k];
        for (int j = 0; j < c->nout && c->recompute_first >= 0; j++) {
            int t = k * pl->maxout + j;
            bool inside = true;
            for (int e = pl->first_edge[t]; e < pl->first_edge[t + 1]; e++)
                inside = inside && pl->edges[e].consumer >= c->recompute_first &&
                         pl->edges[e].consumer <= c->recompute_last;
            pl->internal[t] = inside;
        }
    }
    pl->on_device = md->desc.on_device;
    pl->dev_p2p = pl->on_device && b->p2p_connect && b->isend && b->irecv && b->test && b->wait &&
                  !(b->p2p_through_host && b->p2p_through_host());
    ps->timeline = getenv("SMP_TIMELINE") && *getenv("SMP_TIMELINE");
    ps->t_origin = smp__now();
    /* the pipeline's communicators (they inherit MPI_ERRORS_RETURN from
       MP_GROUP's). MPI_Comm_dup is a blocking collective of MP_GROUP: its failures abort */
    SMP__MPI_FATAL(MPI_Comm_dup(smp__ctx.groups[SMP_PP_GROUP].comm, &ps->comm),
                   "making a pipeline's communicator (MP_GROUP)");
    SMP__MPI_FATAL(MPI_Comm_dup(smp__ctx.groups[SMP_PP_GROUP].comm, &ps->err_comm),
                   "making a pipeline's failure communicator (MP_GROUP)");
    smp__post_err(ps);
    return ps;
fail:
    smp__free(count);
    smp__pipe_free(ps);
    return NULL;
}

/* t *= by for floating-point dtypes (others are left alone), on t's side. */
static smp_status smp__tensor_scale(const smp_tensor *t, double by) {
    if (t->device == SMP_HOST) { smp__scale(t->data, t->dtype, smp_tensor_numel(t), by); return SMP_OK; }
    return smp__ctx.device.scale(t->data, t->dtype, smp_tensor_numel(t), by);
}

/* Whether p has a gradient on this rank. */
static bool smp__local_grad(const smp_param *p) {
    return !p->is_buffer && p->grad.data && smp_module_is_local(p->module);
}

/* Multiplies every gradient this rank holds by `by`. */
static smp_status smp__scale_grads(smp_model *md, double by) {
    smp_status st = SMP_OK;
    for (int i = 0; i < md->nparams && !st; i++)
        if (smp__local_grad(md->params[i])) st = smp__tensor_scale(&md->params[i]->grad, by);
    return st;
}

/* ---------------------------------------------------------------- transport */
/* What a step's buffers count as: a training step's stay until the backward (the activation stash). */
static smp__alloc_kind smp__step_kind(const smp__pipe *ps) {
    return ps->step.training ? SMP__ALLOC_STASH : SMP__ALLOC_OTHER;
}
static int smp__tag(int link, bool backward) { return (link * 2 + (backward ? 1 : 0)) * 2; }

static smp__xfer *smp__recv_slot(smp__pipe *ps, int link, int mb, bool backward) {
    return &ps->step.recv[((size_t)link * (size_t)ps->step.m + (size_t)mb) * 2 + (backward ? 1 : 0)];
}

static smp_status smp__post_recv(smp__pipe *ps, int link, int mb, bool backward) {
    smp__link *l = &ps->plan.links[link];
    smp__xfer *x = smp__recv_slot(ps, link, mb, backward);
    smp_status st = SMP_OK;
    x->ntensors = backward ? l->nedges : l->ntensors;
    x->peer = backward ? l->peer_to : l->peer_from;
    x->hdr = (int64_t *)smp__alloc_or(&st, sizeof(int64_t) * (size_t)SMP__HDR_WORDS(x->ntensors), SMP__ALLOC_OTHER,
                                      "a pipeline message header");
    if (st) return st;
    x->req[0] = x->req[1] = MPI_REQUEST_NULL;
    SMP__MPI(MPI_Irecv(x->hdr, SMP__HDR_WORDS(x->ntensors), MPI_INT64_T, x->peer, smp__tag(link, backward), ps->comm,
                       &x->req[0]),
             "posting the receive of %s %d's header from mp rank %d",
             backward ? "a gradient for microbatch" : "an activation of microbatch", mb, x->peer);
    x->state = SMP__XFER_HEADER_POSTED;
    return SMP_OK;
}

static size_t smp__hdr_bytes(const int64_t *h) {
    smp_tensor t = smp_tensor_make(NULL, (smp_dtype)h[0], (int)h[1], h + 2);
    return smp_tensor_nbytes(&t);
}

static int64_t smp__hdr_hash(const int64_t *h, int nt) {
    uint64_t x = 0x736d702d68647221ull;
    for (int w = 0; w < 10 * nt + 1; w++) x = (x ^ (uint64_t)h[w]) * 0x100000001b3ull;
    return (int64_t)(x ^ (x >> 29));
}

/* The last word of a header checks the others: a header that does not match
   would make the receiver size and cut the bytes that follow wrongly. */
static void smp__hdr_seal(int64_t *h, int nt) {
    h[10 * nt + 1] = smp__hdr_hash(h, nt);
    if (smp__injected(SMP_FAULT_MESSAGE)) h[2]++; /* a test's corrupt header: after the seal */
}

/* SMP_OK, or why the header of a message from mp rank `peer` cannot be used. */
static smp_status smp__hdr_check(const int64_t *h, int nt, int peer, size_t *bytes) {
    bool sane = h[10 * nt + 1] == smp__hdr_hash(h, nt);
    *bytes = 0;
    for (int t = 0; t < nt && sane; t++) {
        const int64_t *d = h + 10 * t;
        sane = smp_dtype_size((smp_dtype)d[0]) > 0 && d[1] >= 0 && d[1] <= SMP_MAX_DIMS;
        for (int k = 0; k < d[1] && sane; k++) sane = d[2 + k] >= 0;
        if (sane) *bytes += smp__hdr_bytes(d);
    }
    return sane ? SMP_OK
                : smp_error(
                      SMP_ERR_FORMAT,
                      "a pipeline message from mp rank %d arrived with a corrupt header (its check does not match); "
                      "nothing was read from it",
                      peer);
}

/* The backend's point to point, for device payloads. A transfer it cannot
   queue or finish leaves the pairing of the two ranks' transfers unknown
   (every later one would land in the wrong buffer), so the job stops. */
static void smp__device_transfer_failed(const char *what, int peer) {
    smp__fatal("the device backend failed to %s a pipeline transfer with mp rank %d: %s", what, peer, smp__errbuf);
}

/* Whether every device transfer of x has finished. */
static bool smp__device_done(smp__xfer *x) {
    for (int i = 0; i < x->ndev_req; i++) {
        bool done = false;
        if (smp__ctx.device.test(x->dev_req[i], &done)) smp__device_transfer_failed("test", x->peer);
        if (!done) return false;
    }
    return true;
}

/* Finishes x's device transfers (for a receive: orders the engine's later
   work after them). */
static void smp__device_wait_all(smp__xfer *x) {
    for (int i = 0; i < x->ndev_req; i++)
        if (smp__ctx.device.wait(x->dev_req[i])) smp__device_transfer_failed("finish", x->peer);
    x->ndev_req = 0;
}

/* The device receives of an arrived header, into one device buffer. */
static smp_status smp__queue_device_recv(smp__pipe *ps, smp__xfer *x) {
    smp_status st = SMP_OK;
    smp_tensor whole = smp_tensor_1d(NULL, SMP_U8, (int64_t)x->bytes);
    /* from the pool of its link and direction, though at once: device receives are queued in the order sent */
    size_t slot = (size_t)(x - ps->step.recv), link = slot / (2 * (size_t)ps->step.m);
    smp__cache *was = smp__cache_use(ps->recv_pool[2 * link + slot % 2]);
    x->buf = smp__tensor_alloc_or(&st, &whole, true, smp__step_kind(ps), "a pipeline message received");
    smp__cache_use(was);
    x->dev_req = (void **)smp__alloc_or(&st, sizeof(void *) * (size_t)(x->ntensors + 1), SMP__ALLOC_OTHER,
                                        "a pipeline message received");
    if (st) return st;
    char *p = (char *)x->buf;
    for (int t = 0; t < x->ntensors; t++) {
        size_t bytes = smp__hdr_bytes(x->hdr + 10 * t);
        if (!bytes) continue;
        if (smp__ctx.device.irecv(p, bytes, x->peer, SMP_PP_GROUP, &x->dev_req[x->ndev_req]))
            smp__device_transfer_failed("queue", x->peer);
        x->ndev_req++;
        ps->step.dev_posted[x->peer]++;
        p += bytes;
    }
    x->state = SMP__XFER_BYTES_POSTED;
    return SMP_OK;
}

/* Lets go of a transfer's memory: a send once sent, a receive at the step's end. */
static void smp__xfer_free(smp__xfer *x) {
    if (!x->hdr_in_table) smp__free(x->hdr);
    smp__free(x->buf);
    smp__free(x->dev_req);
    x->hdr = NULL;
    x->buf = NULL;
    x->dev_req = NULL;
    x->state = SMP__XFER_IDLE;
}

/* Sends what the forward (activations) or backward (gradient
   contributions) of stage `stage` on microbatch `mb` has for a link: one
   host tensor without copying it, several packed into one host buffer,
   device tensors through the backend or a host staging buffer (see the
   executor's comment). */
static smp_status smp__send(smp__pipe *ps, int link, bool backward, int stage, int mb) {
    smp__link *l = &ps->plan.links[link];
    const smp_tensor **ts = ps->scratch;
    int nt = backward ? l->nedges : l->ntensors;
    smp__mbstate *mbs = &ps->step.mb[mb];
    for (int t = 0; t < nt; t++) ts[t] = backward ? &mbs->contrib[l->edges[t]] : &mbs->act[l->tensors[t]];
    smp_status st = SMP_OK;
    const char *what = "a pipeline message";
    if (smp__injected(SMP_FAULT_SEND))
        return smp_error(SMP_ERR_MPI, "MPI_Isend to mp rank %d failed: injected by smp_testing_fail",
                         backward ? l->peer_from : l->peer_to);
    if (!smp__grow_or(&st, (void **)&ps->step.sends, &ps->step.sends_cap, ps->step.nsends + 1, sizeof(smp__xfer), what))
        return st;
    smp__xfer *x = &ps->step.sends[ps->step.nsends];
    memset(x, 0, sizeof *x);
    x->peer = backward ? l->peer_from : l->peer_to;
    x->stage = stage;
    x->mb = mb;
    x->backward = backward;
    x->t_post = smp__now();
    x->req[0] = x->req[1] = MPI_REQUEST_NULL;
    size_t slot = ((size_t)link * (size_t)ps->step.m + (size_t)mb) * 2 + (backward ? 1 : 0); /* smp__recv_slot's */
    x->hdr = ps->step.send_hdrs + slot * (size_t)ps->step.send_hdr_words;
    x->hdr_in_table = true;
    if (ps->plan.dev_p2p)
        x->dev_req = (void **)smp__alloc_or(&st, sizeof(void *) * (size_t)(nt + 1), SMP__ALLOC_OTHER, what);
    size_t total = 0;
    for (int i = 0; i < nt; i++) total += smp_tensor_nbytes(ts[i]);
    /* staged device tensors: the bytes go to the host, then as one MPI message. Several host tensors are packed
       into one buffer too: sent as they lie (a datatype of their addresses), a message past the rendezvous size
       moves only when this rank next enters MPI (MPICH over UCX packs such a datatype on the sender's side; a
       contiguous one the receiver fetches alone), which is after the next operation, while the peer waits */
    bool staged = ps->plan.on_device ? !ps->plan.dev_p2p : nt > 1;
    char *staging = staged ? (char *)smp__alloc_or(&st, total, SMP__ALLOC_COMM | SMP__UNINIT,
                                                   "a pipeline message staged on the host")
                           : NULL;
    size_t at = 0;
    for (int i = 0; i < nt && staging && !st; i++) {
        smp_tensor h = *ts[i];
        h.data = staging + at;
        h.device = SMP_HOST;
        st = smp__tensor_copy(&h, ts[i]);
        at += smp_tensor_nbytes(ts[i]);
    }
    x->buf = staging;
    if (st) { /* nothing went out: the step fails like any other error */
        smp__xfer_free(x);
        return st;
    }
    ps->step.nsends++;
    x->state = SMP__XFER_SENDING;
    for (int i = 0; i < nt; i++) {
        int64_t *h = x->hdr + 10 * i;
        h[0] = ts[i]->dtype;
        h[1] = ts[i]->ndim;
        for (int d = 0; d < ts[i]->ndim; d++) h[2 + d] = ts[i]->shape[d];
        SMP_ASSERT((ts[i]->device != SMP_HOST) == ps->plan.on_device);
    }
    x->hdr[10 * nt] = ps->step.dev_sent[x->peer];
    smp__hdr_seal(x->hdr, nt);
    int tag = smp__tag(link, backward);
    if (ps->plan.dev_p2p) {
        /* the transfers first: the peer queues its receives when the header arrives */
        for (int i = 0; i < nt; i++) {
            size_t bytes = smp_tensor_nbytes(ts[i]);
            if (!bytes) continue;
            if (smp__ctx.device.isend(ts[i]->data, bytes, x->peer, SMP_PP_GROUP, &x->dev_req[x->ndev_req]))
                smp__device_transfer_failed("queue", x->peer);
            x->ndev_req++;
            ps->step.dev_sent[x->peer]++;
        }
    }
    /* A failed MPI call leaves its request null: the send then completes as
       done and is freed like any other, and the step fails (the peer hears
       of it through the failure notice, not the message) */
    const char *kind = backward ? "gradients" : "activations";
    st =
        SMP__MPI_CHECK(MPI_Isend(x->hdr, SMP__HDR_WORDS(nt), MPI_INT64_T, x->peer, tag, ps->comm, &x->req[0]),
                       "sending the header of stage %d's %s for microbatch %d to mp rank %d", stage, kind, mb, x->peer);
    if (!st) ps->step.msgs_sent[2 * x->peer]++;
    if (ps->plan.dev_p2p || st) return st;
    /* the bytes as one contiguous message (one host tensor as it lies, else the staging buffer), any size
       (smp__bytes_type) */
    MPI_Datatype type;
    int count;
    const void *from = staging ? staging : nt ? ts[0]->data : NULL;
    SMP_TRY(smp__bytes_type(total, &count, &type));
    st = SMP__MPI_CHECK(MPI_Isend(from, count, type, x->peer, tag + 1, ps->comm, &x->req[1]),
                        "sending stage %d's %s for microbatch %d to mp rank %d", stage, kind, mb, x->peer);
    if (!st) ps->step.msgs_sent[2 * x->peer]++;
    /* MPI keeps it for the send in flight */
    if (type != MPI_BYTE) SMP__MPI_WARN(MPI_Type_free(&type), "releasing a pipeline message datatype");
    return st;
}

/* Moves every transfer forward once; an error when an arrived header is
   corrupt or there is no memory for the bytes that follow it. */
static smp_status smp__progress_transfers(smp__pipe *ps) {
    smp_status err = SMP_OK;
    int flag = 0;
    MPI_Status st;
    /* Data receives share one tag per (link, direction), so they must be
       posted in microbatch order: MPI may complete the headers of several
       microbatches inside one MPI_Test, and posting the data receive of a
       later one first would hand it an earlier microbatch's bytes. Walk
       each (link, direction) in order and stop at the first header that has
       not arrived. */
    for (int l = 0; l < ps->plan.nlinks && !err && ps->step.recv_front; l++) /* (none: no step runs) */
        for (int dir = 0; dir < 2 && !err; dir++)
            for (int *front = &ps->step.recv_front[2 * l + dir], mb = *front; mb < ps->step.m; mb++) {
                smp__xfer *x = smp__recv_slot(ps, l, mb, dir);
                /* every receive was posted as the step began, so a finished one (arrived, or never posted) stays
                   so: each poll (a wait polls thousands of times) starts past the finished ones in front */
                if (mb == *front && (x->state == SMP__XFER_ARRIVED || x->state == SMP__XFER_IDLE)) {
                    ++*front;
                    continue;
                }
                if (x->state == SMP__XFER_HEADER_POSTED) {
                    if ((err = SMP__MPI_CHECK(
                             MPI_Test(&x->req[0], &flag, &st), "receiving the header of %s %d from mp rank %d",
                             dir ? "a gradient for microbatch" : "an activation of microbatch", mb, x->peer)))
                        break;
                    if (!flag) break;
                    x->state = SMP__XFER_HEADER_ARRIVED;
                    if ((err = smp__hdr_check(x->hdr, x->ntensors, x->peer, &x->bytes))) break;
                    if (ps->plan.dev_p2p) {
                        x->state = SMP__XFER_DEVICE_WAITING; /* queued below, in the order the peer sent */
                        continue;
                    }
                }
                if (x->state == SMP__XFER_HEADER_ARRIVED) {
                    smp__cache *pool = ps->recv_pool[2 * l + dir];
                    if (!x->wanted && !smp__cache_has(pool, x->bytes, false)) break; /* until it is waited for */
                    MPI_Datatype type;
                    int count;
                    smp__cache *was = smp__cache_use(pool);
                    x->buf =
                        smp__alloc_or(&err, x->bytes, smp__step_kind(ps) | SMP__UNINIT, "a pipeline message received");
                    smp__cache_use(was);
                    if (err || (err = smp__bytes_type(x->bytes, &count, &type))) break;
                    int tag = smp__tag(l, dir) + 1;
                    err = SMP__MPI_CHECK(MPI_Irecv(x->buf, count, type, x->peer, tag, ps->comm, &x->req[1]),
                                         "posting the receive of %s %d from mp rank %d",
                                         dir ? "the gradients for microbatch" : "the activations of microbatch", mb,
                                         x->peer);
                    if (type != MPI_BYTE) SMP__MPI_WARN(MPI_Type_free(&type), "releasing a pipeline message datatype");
                    if (err) break;
                    x->state = SMP__XFER_BYTES_POSTED;
                }
                if (x->state == SMP__XFER_BYTES_POSTED) {
                    if (ps->plan.dev_p2p) flag = smp__device_done(x);
                    else if ((err = SMP__MPI_CHECK(
                                  MPI_Test(&x->req[1], &flag, MPI_STATUS_IGNORE), "receiving %s %d from mp rank %d",
                                  dir ? "the gradients for microbatch" : "the activations of microbatch", mb, x->peer)))
                        break;
                    if (flag) x->state = SMP__XFER_ARRIVED;
                }
            }
    if (ps->plan.dev_p2p && !err) {
        size_t nrecv = (size_t)ps->plan.nlinks * (size_t)ps->step.m * 2;
        for (bool queued = true; queued;) {
            queued = false;
            for (size_t i = 0; i < nrecv; i++) {
                smp__xfer *x = &ps->step.recv[i];
                if (x->state == SMP__XFER_DEVICE_WAITING && x->hdr[10 * x->ntensors] == ps->step.dev_posted[x->peer]) {
                    if ((err = smp__queue_device_recv(ps, x))) break;
                    queued = true;
                }
            }
        }
    }
    for (int i = 0; i < ps->step.nsends; i++) {
        smp__xfer *x = &ps->step.sends[i];
        if (x->state != SMP__XFER_SENDING) continue;
        int done = 0;
        MPI_Status sts[2];
        smp_status ts =
            SMP__MPI_CHECK(MPI_Testall(2, x->req, &done, sts), "sending stage %d's %s for microbatch %d to mp rank %d",
                           x->stage, x->backward ? "gradients" : "activations", x->mb, x->peer);
        if (ts) {
            if (!err) err = ts;
            continue; /* the step fails; its sends are dropped with it */
        }
        if (done && smp__device_done(x)) {
            smp__device_wait_all(x);
            /* not a failed step's shared gradients */
            if (x->hdr) smp__event_add(ps, SMP__EVENT_SEND, x->stage, x->mb, x->t_post);
            smp__xfer_free(x);
        }
    }
    /* drop finished sends from the front so the list stays short */
    int k = 0;
    while (k < ps->step.nsends && ps->step.sends[k].state == SMP__XFER_IDLE) k++;
    if (k) {
        memmove(ps->step.sends, ps->step.sends + k, sizeof(smp__xfer) * (size_t)(ps->step.nsends - k));
        ps->step.nsends -= k;
    }
    return err;
}

static void smp__ddp_poll(smp__pipe *ps);
static void smp__params_poll(smp__pipe *ps);

/* Between two calls of a stage. A send over MPI's rendezvous size moves
   only while its sender is inside MPI, and a stage computes for
   milliseconds without entering it, so the peer waiting for that gradient
   or activation would wait for the whole stage; one pass over the
   transfers between calls lets it finish meanwhile (and started DDP
   buckets move on). */
static smp_status smp__between_calls(smp__pipe *ps) {
    smp_status err = smp__progress_transfers(ps);
    if (!err && ps->step.sync) smp__ddp_poll(ps);
    if (!err && ps->step.params_gathering) smp__params_poll(ps);
    return err;
}

/* The same while this rank waits (the next gradient bucket starts
   meanwhile); SMP_ERR_REMOTE when another rank reported an error. */
static smp_status smp__progress(smp__pipe *ps) {
    int flag = 0;
    MPI_Status st;
    SMP_TRY(SMP__MPI_CHECK(MPI_Test(&ps->err_req, &flag, &st), "looking for pipeline failure notices (MP_GROUP)"));
    if (flag && ps->err_from < 0) ps->err_from = st.MPI_SOURCE;
    if (flag) { ps->step.failed_remote = true; return smp_error(SMP_ERR_REMOTE, "another rank failed"); }
    return smp__between_calls(ps);
}

/* A failed step may leave device transfers in flight that no receive has
   matched yet, and the backend pairs transfers in order: they would fill
   the next step's receives. So each rank learns how many transfers every
   peer sent it, queues receives for all of them (the header of each sent
   message arrives: every receive was posted when the step began), and
   waits for them and for its own sends. */
static void smp__drain_device(smp__pipe *ps) {
    int P = smp__ctx.cfg.partitions;
    int *sent_to_me = (int *)smp__alloc(sizeof(int) * (size_t)P, SMP__ALLOC_OTHER);
    if (!sent_to_me || !ps->step.recv) smp__fatal("out of memory cleaning up the device transfers of a failed step");
    MPI_Request req;
    SMP__MPI_FATAL(MPI_Ialltoall(ps->step.dev_sent, 1, MPI_INT, sent_to_me, 1, MPI_INT, ps->comm, &req),
                   "exchanging the device transfer counts of a failed step (MP_GROUP)");
    smp_wait_requests(1, &req, "the device transfer counts of a failed step", SMP_PP_GROUP, -1);
    size_t nrecv = (size_t)ps->plan.nlinks * (size_t)ps->step.m * 2;
    smp__backoff b = smp__backoff_start();
    for (;;) {
        (void)smp__progress_transfers(ps); /* the step failed already */
        bool pending = false;
        for (int i = 0; i < ps->step.nsends; i++) /* not shared gradients (no header): smp__drain_messages */
            pending = pending || (ps->step.sends[i].state == SMP__XFER_SENDING && ps->step.sends[i].hdr);
        for (int p = 0; p < P; p++) pending = pending || ps->step.dev_posted[p] < sent_to_me[p];
        for (size_t i = 0; i < nrecv; i++) pending = pending || ps->step.recv[i].state == SMP__XFER_BYTES_POSTED;
        if (!pending) break;
        if (!smp__backoff_pause(&b))
            smp__timeout_abort("the device transfers of a failed step", SMP_PP_GROUP, -1, smp__now() - b.start);
    }
    for (size_t i = 0; i < nrecv; i++) smp__device_wait_all(&ps->step.recv[i]);
    smp__free(sent_to_me);
}

/* Takes back a receive of a failed step: true when it had not matched;
   else *source (when not NULL) names the sender. Its failures abort: the
   drain's count of what arrived would be wrong. */
static bool smp__withdraw(MPI_Request *req, int *source) {
    MPI_Status cs;
    int cancelled = 0;
    SMP__MPI_FATAL(MPI_Cancel(req), "withdrawing a receive of a failed step");
    SMP__MPI_FATAL(MPI_Wait(req, &cs), "withdrawing a receive of a failed step");
    SMP__MPI_FATAL(MPI_Test_cancelled(&cs, &cancelled), "withdrawing a receive of a failed step");
    if (!cancelled && source) *source = cs.MPI_SOURCE;
    return cancelled;
}

/* A failed step must leave no message behind: one nobody receives sits in
   MPI's queues until the process ends (UCX warns about each at
   MPI_Finalize), and the next step on the same communicator and tag would
   receive it in place of its own. Every rank learns how many messages each
   peer sent it this step (pipeline headers and bytes, shared gradients,
   failure notices), takes back its receives that have not matched
   (MPI_Cancel), counts those that have, and receives and drops the rest
   (MPI_Improbe / MPI_Mrecv); then every send it made has a receiver and
   completes. The step's communicators are clean again and serve the next
   step. Called by every rank of the replica after they agreed the step
   failed, before the step's buffers go (host sends read the activations
   in place). */
static void smp__drain_messages(smp__pipe *ps) {
    int P = smp__ctx.cfg.partitions;
    smp_status st = SMP_OK;
    int *left =
        (int *)smp__alloc_or(&st, sizeof(int) * 4 * (size_t)P, SMP__ALLOC_OTHER, "the message counts of a failed step");
    if (st) smp__fatal("out of memory cleaning up the messages of a failed step: %s", smp_last_error());
    int *sent_to_me = left + 2 * P;
    MPI_Request req;
    SMP__MPI_FATAL(MPI_Ialltoall(ps->step.msgs_sent, 2, MPI_INT, sent_to_me, 2, MPI_INT, ps->comm, &req),
                   "exchanging the message counts of a failed step (MP_GROUP)");
    for (int p = 0; p < P; p++) left[2 * p] = -ps->step.msgs_got[p];
    size_t nrecv = ps->step.recv ? (size_t)ps->plan.nlinks * (size_t)ps->step.m * 2 : 0;
    for (size_t i = 0; i < nrecv; i++) {
        smp__xfer *x = &ps->step.recv[i];
        if (x->state == SMP__XFER_IDLE) continue; /* never posted */
        /* MPI messages: the header, then (host payloads) the bytes */
        bool bytes_over_mpi = !ps->plan.dev_p2p, header_pending = x->state == SMP__XFER_HEADER_POSTED;
        bool pending = header_pending || (x->state == SMP__XFER_BYTES_POSTED && bytes_over_mpi);
        int got = header_pending ? 0 : 1 + (x->state == SMP__XFER_ARRIVED && bytes_over_mpi);
        if (pending) {
            bool cancelled = smp__withdraw(&x->req[header_pending ? 0 : 1], NULL);
            got += !cancelled;
            x->state = cancelled ? SMP__XFER_IDLE : header_pending ? SMP__XFER_HEADER_ARRIVED : SMP__XFER_ARRIVED;
        }
        left[2 * x->peer] -= got;
    }
    int from = ps->err_from;
    if (ps->err_req != MPI_REQUEST_NULL) smp__withdraw(&ps->err_req, &from); /* one that matched names its sender */
    if (from >= 0) left[2 * from + 1]--;
    smp_wait_requests(1, &req, "the message counts of a failed step", SMP_PP_GROUP, -1);
    for (int k = 0; k < 2 * P; k++) {
        left[k] += sent_to_me[k];
        if (left[k] < 0)
            smp__fatal(
                "mp rank %d sent %d %s in a failed step, but %d arrived here: a message of another step was received",
                k / 2, sent_to_me[k], k % 2 ? "failure notices" : "pipeline messages", sent_to_me[k] - left[k]);
    }
    smp__backoff b = smp__backoff_start();
    for (;;) {
        bool pending = false;
        for (int k = 0; k < 2 * P; k++)
            while (left[k] > 0) {
                int flag = 0, count;
                MPI_Message msg;
                MPI_Status ms;
                MPI_Datatype type;
                MPI_Count n = 0;
                SMP__MPI_FATAL(MPI_Improbe(k / 2, MPI_ANY_TAG, k % 2 ? ps->err_comm : ps->comm, &flag, &msg, &ms),
                               "looking for messages of a failed step from mp rank %d", k / 2);
                if (!flag) { pending = true; break; }
                SMP__MPI_FATAL(MPI_Get_elements_x(&ms, MPI_BYTE, &n),
                               "sizing a message of a failed step from mp rank %d", k / 2);
                void *drop = smp__alloc_or(&st, (size_t)n, SMP__ALLOC_COMM | SMP__UNINIT,
                                           "a message of a failed step, received to be dropped");
                if (st || (st = smp__bytes_type((size_t)n, &count, &type)))
                    smp__fatal("cleaning up the messages of a failed step: %s", smp_last_error());
                SMP__MPI_FATAL(MPI_Mrecv(drop, count, type, &msg, MPI_STATUS_IGNORE),
                               "receiving a message of a failed step from mp rank %d", k / 2);
                if (type != MPI_BYTE) SMP__MPI_WARN(MPI_Type_free(&type), "releasing a message datatype");
                smp__free(drop);
                left[k]--;
                b = smp__backoff_start(); /* the deadline counts from the last message */
            }
        for (int i = 0; i < ps->step.nsends; i++) {
            smp__xfer *x = &ps->step.sends[i];
            int done = 0;
            MPI_Status sts[2];
            if (x->state == SMP__XFER_SENDING)
                SMP__MPI_FATAL(MPI_Testall(2, x->req, &done, sts), "completing a send of a failed step to mp rank %d",
                               x->peer);
            if (done && smp__device_done(x)) {
                smp__device_wait_all(x);
                smp__xfer_free(x);
            }
            pending = pending || x->state == SMP__XFER_SENDING;
        }
        if (!pending) break;
        if (!smp__backoff_pause(&b))
            smp__timeout_abort("the messages of a failed step", SMP_PP_GROUP, -1, smp__now() - b.start);
    }
    ps->step.nsends = 0;
    smp__free(left);
    smp__post_err(ps);
}

/* Waits until the given receives have arrived. SMP_ERR_REMOTE when another
   rank failed meanwhile. */
static smp_status smp__await(smp__pipe *ps, smp__xfer **xs, int n, const char *what, int stage, int mb) {
    double t0 = smp__now();
    smp__backoff b = smp__backoff_start();
    for (;;) {
        SMP_TRY(smp__progress(ps));
        int ready = 0;
        for (int i = 0; i < n; i++) ready += xs[i]->state == SMP__XFER_ARRIVED;
        if (ready == n) break;
        if (!smp__backoff_pause(&b)) {
            int peer = -1;
            for (int i = 0; i < n; i++)
                if (xs[i]->state != SMP__XFER_ARRIVED) peer = xs[i]->peer;
            char buf[160];
            snprintf(buf, sizeof buf, "%s of microbatch %d for stage %d", what, mb, stage);
            smp__timeout_abort(buf, SMP_PP_GROUP, peer, smp__now() - b.start);
        }
    }
    if (n) smp__event_add(ps, SMP__EVENT_WAIT, stage, mb, t0);
    return SMP_OK;
}

/* ---------------------------------------------------------------- microbatches */
struct smp_mb {
    smp__pipe *ps;
    smp_model *model;
    int index;
    smp__mbstate *st;
};

SMPDEF const smp_tensor *smp_mb_output(smp_mb *mb, int i) {
    smp_model *md = mb->model;
    if (i < 0 || i >= md->desc.noutputs) return NULL;
    return &mb->st->act[md->outputs[i].call * mb->ps->plan.maxout + md->outputs[i].index];
}
SMPDEF const smp_tensor *smp_mb_arg(smp_mb *mb, int i) {
    return i >= 0 && i < mb->ps->step.desc->nargs ? &mb->st->args[i] : NULL;
}
SMPDEF smp_tensor *smp_mb_output_grad(smp_mb *mb, int i) {
    if (!mb->ps->step.training || i < 0 || i >= mb->model->desc.noutputs) return NULL;
    return &mb->st->out_grad[i];
}
SMPDEF int smp_mb_index(const smp_mb *mb) { return mb->index; }
SMPDEF void *smp_mb_user(const smp_mb *mb) { return mb->ps->step.desc->user; }
SMPDEF bool smp_mb_is_training(const smp_mb *mb) { return mb->ps->step.training; }
SMPDEF smp_status smp_mb_return(smp_mb *mb, int i, const smp_tensor *v) {
    if (i < 0 || i >= SMP_MAX_STEP_ARGS)
        return smp_error(SMP_ERR_ARG, "smp_mb_return: index %d is outside 0..%d", i, SMP_MAX_STEP_ARGS - 1);
    SMP_TRY(smp__check_tensor(v, "smp_mb_return", "value"));
    smp_status st = SMP_OK;
    smp_tensor *r = &mb->st->returned[i];
    smp__free(r->data);
    *r = *v; /* StepOutputs live on the host: a device value is copied down */
    if (!smp__tensor_alloc_or(&st, r, false, SMP__ALLOC_OTHER, "a value the step body returned")) return st;
    return smp__tensor_copy(r, v);
}
SMPDEF smp_status smp_mb_return_f32(smp_mb *mb, int i, float value) {
    smp_tensor t = smp_tensor_make(&value, SMP_F32, 0, NULL);
    return smp_mb_return(mb, i, &t);
}

/* Slices argument `a` for microbatch `i`: a view along axis 0, a copy along
   others (on the argument's side, host or device). */
static smp_status smp__slice(const smp_tensor *t, int axis, int m, int i, smp_tensor *out, void **copy,
                             smp__alloc_kind kind) {
    smp_tensor s = *t;
    smp_status st = SMP_OK;
    int64_t part = t->shape[axis] / m, outer = 1, inner = 1;
    s.shape[axis] = part;
    for (int d = 0; d < axis; d++) outer *= t->shape[d];
    for (int d = axis + 1; d < t->ndim; d++) inner *= t->shape[d];
    size_t es = smp_dtype_size(t->dtype), run = (size_t)(part * inner) * es;
    *copy = NULL;
    if (outer == 1) { s.data = (char *)t->data + (size_t)i * run; *out = s; return SMP_OK; }
    if (!smp__tensor_alloc_or(&st, &s, t->device != SMP_HOST, kind, "a microbatch's slice of a step argument"))
        return st;
    *copy = s.data;
    for (int64_t o = 0; o < outer && !st; o++) {
        smp_tensor from = smp_tensor_1d(
            (char *)t->data +
                ((size_t)o * (size_t)t->shape[axis] * (size_t)inner + (size_t)i * (size_t)part * (size_t)inner) * es,
            SMP_U8, (int64_t)run);
        smp_tensor to = smp_tensor_1d((char *)s.data + (size_t)o * run, SMP_U8, (int64_t)run);
        from.device = t->device;
        to.device = s.device;
        st = smp__tensor_copy(&to, &from);
    }
    *out = s;
    return st;
}

static smp_status smp__check_step(const smp_step_desc *d, const smp_model *md, int m) {
    if (d->nargs < 1 || d->nargs > SMP_MAX_STEP_ARGS)
        return smp_error(SMP_ERR_ARG, "smp_step: %d arguments (1..%d)", d->nargs, SMP_MAX_STEP_ARGS);
    int nmi = d->nmodel_inputs ? d->nmodel_inputs : md->desc.ninputs;
    if (nmi != md->desc.ninputs)
        return smp_error(SMP_ERR_ARG, "smp_step: %d model inputs named, the model takes %d", nmi, md->desc.ninputs);
    for (int i = 0; i < nmi; i++) {
        int a = d->nmodel_inputs ? d->model_inputs[i] : i;
        if (a < 0 || a >= d->nargs)
            return smp_error(SMP_ERR_ARG, "smp_step: model input %d is argument %d, but there are %d arguments", i, a,
                             d->nargs);
    }
    for (int a = 0; a < d->nargs; a++) {
        const smp_tensor *t = &d->args[a];
        char name[32];
        snprintf(name, sizeof name, "argument %d", a);
        SMP_TRY(smp__check_tensor(t, "smp_step", name));
        if (d->non_split[a]) continue;
        int ax = d->split_axis[a];
        if (ax < 0 || ax >= t->ndim)
            return smp_error(SMP_ERR_ARG,
                             "smp_step: argument %d has %d dimensions, so it cannot be split along axis %d", a, t->ndim,
                             ax);
        if (t->shape[ax] % m)
            return smp_error(SMP_ERR_ARG,
                             "smp_step: batch of %lld (argument %d, axis %d) does not divide into %d microbatches",
                             (long long)t->shape[ax], a, ax, m);
    }
    return SMP_OK;
}

/* ---------------------------------------------------------------- data parallel: buckets */
/* Broadcasts parameters (and buffers) from dp rank 0, and makes the buckets of the model's gradient layout
   (smp__grad_layout), moving every local gradient into its place. */
static smp_status smp__ddp_setup(smp__pipe *ps, smp_model *md) {
    const smp_config *cfg = &smp__ctx.cfg;
    bool sharded = cfg->shard_optimizer_state == SMP_ON && smp_rdp_size() > 1;
    for (int i = 0; i < md->nparams; i++) {
        smp_param *p = md->params[i];
        if (!smp_module_is_local(p->module) || (p->is_buffer && cfg->broadcast_buffers != SMP_ON)) continue;
        SMP_TRY(smp_broadcast(&p->value, 0, SMP_RDP_GROUP));
    }
    smp_status st = SMP_OK;
    if (!ps->plan.buckets)
        ps->plan.buckets = (smp__bucket *)smp__alloc_or(&st, sizeof(smp__bucket) * (size_t)(md->nbuckets + 1),
                                                        SMP__ALLOC_OTHER, "the data-parallel buckets");
    if (st) return st;
    ps->plan.scatter = sharded;
    while (ps->plan.nbuckets < md->nbuckets) {
        int j = ps->plan.nbuckets;
        smp__bucket *b = &ps->plan.buckets[j];
        memset(b, 0, sizeof *b);
        b->dtype = md->params[md->grad_order[md->bucket_first[j]]]->grad.dtype;
        b->first = md->bucket_first[j];
        b->count = md->bucket_first[j + 1] - b->first;
        b->numel = md->bucket_numel[j];
        b->bytes = (size_t)b->numel * smp_dtype_size(b->dtype);
        smp_tensor whole = smp_tensor_1d(NULL, b->dtype, b->numel);
        if (!smp__tensor_alloc_or(&st, &whole, ps->plan.on_device, SMP__ALLOC_GRAD, "a data-parallel gradient bucket"))
            return st;
        b->data = whole.data;
        b->device = whole.device;
        ps->plan.nbuckets++; /* freed with the model from here on */
        if ((st = smp__tensor_zero(&whole))) return st; /* the padding stays zero */
        for (int q = b->first; q < b->first + b->count; q++) {
            smp_param *p = md->params[md->grad_order[q]];
            smp_tensor place = p->grad;
            place.data = (char *)b->data + (size_t)md->grad_at[md->grad_order[q]] * smp_dtype_size(b->dtype);
            if ((st = smp__tensor_copy(&place, &p->grad))) return st;
            if (!p->grad_in_bucket) smp__free(p->grad.data);
            p->grad.data = place.data;
            p->grad_in_bucket = true;
        }
    }
    return SMP_OK;
}

static smp__pipe *smp__ddp_inflight; /* the step whose buckets are in flight, for smp_poll */

/* One of the out-of-memory aborts smp.h's OUT OF MEMORY lists: the other replicas are in this
   bucket's collective already, or will be, and a replica cannot take part
   without the memory to gather into. */
static void smp__bucket_nomem(size_t bytes) {
    smp__fatal("out of memory: %zu bytes to gather a gradient bucket for deterministic_reduction on rank %d; the other "
               "replicas are in "
               "its collective, so the job stops (free memory, or lower bucket_cap_mb)",
               bytes, smp__ctx.rank);
}

static smp_status smp__bucket_start(smp__pipe *ps, smp__bucket *b) {
    bool deterministic = smp__ctx.cfg.deterministic_reduction == SMP_ON;
    if (b->device != SMP_HOST) {
        /* the backend queues the collective (NCCL: on its stream, ordered after the backward's kernels) */
        b->req = MPI_REQUEST_NULL;
        smp_tensor t = smp_tensor_1d(b->data, b->dtype, b->numel),
                   all = smp_tensor_1d(NULL, b->dtype, b->numel * smp_rdp_size());
        t.device = b->device;
        if (ps->plan.scatter) {
            /* the backend's reduce-scatter (NCCL: its own) into a piece apart, or every replica's copy of this
               replica's piece; smp__ddp_finish puts the sum in place */
            int dp = smp_rdp_size();
            smp_tensor got = smp_tensor_1d(NULL, b->dtype, deterministic ? b->numel : b->numel / dp);
            smp_status st = SMP_OK; /* the job stops without it (smp__bucket_nomem) */
            if (!smp__tensor_alloc_or(&st, &got, true, SMP__ALLOC_COMM, "a gradient bucket's piece"))
                smp__bucket_nomem(smp_tensor_nbytes(&got));
            b->gather = got.data;
            b->pieces = deterministic ? dp : 1;
            return deterministic ? smp_all_to_all_single(&t, &got, NULL, NULL, SMP_RDP_GROUP)
                                 : smp_reduce_scatter(&t, &got, SMP_SUM, SMP_RDP_GROUP);
        }
        if (!deterministic && smp__ctx.device.bucket_all_reduce && smp__ctx.device.bucket_fence) {
            ps->step.fence_buckets = true;
            return smp__ctx.device.bucket_all_reduce(b->data, b->dtype, b->numel, SMP_RDP_GROUP);
        }
        if (!deterministic) return smp_all_reduce(&t, &t, SMP_SUM, SMP_RDP_GROUP);
        smp_status st = SMP_OK; /* the job stops without it (smp__bucket_nomem) */
        if (!smp__tensor_alloc_or(&st, &all, true, SMP__ALLOC_OTHER, "a gradient bucket's replicas"))
            smp__bucket_nomem(b->bytes * (size_t)smp_rdp_size());
        b->gather = all.data;
        b->pieces = smp_rdp_size();
        return smp_all_gather(&t, &all, SMP_RDP_GROUP);
    }
    smp__ddp_inflight = ps;
    b->t_start = smp__now();
    b->req = MPI_REQUEST_NULL;
    MPI_Comm comm = smp__ctx.groups[SMP_RDP_GROUP].comm;
    int n = (int)b->numel, index = (int)(b - ps->plan.buckets);
    /* A host bucket's collective counts as one of DP_GROUP's (one at a time,
       see smp__ddp_advance): a replica whose call fails tells the others
       (smp__coll_exit), a replica waiting in that collective aborts with
       its message (smp__ddp_complete), and where every replica failed it
       the step fails everywhere */
    smp__group_info *gi = smp__coll_enter(SMP_RDP_GROUP);
    smp_status st = SMP_OK;
    int dp = smp_rdp_size(), piece = n / dp;
    if (ps->plan.scatter && deterministic) {
        /* every replica's copy of this replica's piece, summed in rank order by smp__ddp_finish */
        if (!b->gather) b->gather = smp__alloc(b->bytes + 1, SMP__ALLOC_COMM); /* taken as the step began */
        if (!b->gather) smp__bucket_nomem(b->bytes);
        b->pieces = dp;
        st = SMP__MPI_CHECK(MPI_Ialltoall(b->data, piece, smp__mpi_type(b->dtype), b->gather, piece,
                                          smp__mpi_type(b->dtype), comm, &b->req),
                            "sending data-parallel gradient bucket %d's pieces (%zu bytes) in RDP_GROUP", index,
                            b->bytes);
    } else if (ps->plan.scatter) {
        /* in place: the sum of this replica's piece lands at the bucket's start (smp__ddp_finish moves it) */
        MPI_Op op;
        st = smp__mpi_op(SMP_SUM, b->dtype, "data-parallel gradients", &op);
        if (!st)
            st = SMP__MPI_CHECK(MPI_Ireduce_scatter_block(MPI_IN_PLACE, b->data, piece, smp__mpi_type(b->dtype), op,
                                                          comm, &b->req),
                                "reduce-scattering data-parallel gradient bucket %d (%zu bytes) in RDP_GROUP", index,
                                b->bytes);
    } else if (deterministic) {
        /* every replica's gradient, summed below in dp-rank order */
        if (!b->gather) b->gather = smp__alloc(b->bytes * (size_t)dp + 1, SMP__ALLOC_COMM); /* as the step began */
        if (!b->gather) smp__bucket_nomem(b->bytes * (size_t)dp);
        b->pieces = dp;
        st = SMP__MPI_CHECK(
            MPI_Iallgather(b->data, n, smp__mpi_type(b->dtype), b->gather, n, smp__mpi_type(b->dtype), comm, &b->req),
            "gathering data-parallel gradient bucket %d (%zu bytes) in DP_GROUP", index, b->bytes);
    } else {
        MPI_Op op;
        st = smp__mpi_op(SMP_SUM, b->dtype, "data-parallel gradients", &op);
        if (!st)
            st = SMP__MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, b->data, n, smp__mpi_type(b->dtype), op, comm, &b->req),
                                "all-reducing data-parallel gradient bucket %d (%zu bytes) in DP_GROUP", index,
                                b->bytes);
    }
    if (st) {
        b->req = MPI_REQUEST_NULL;
        ps->step.bucket_failed = true; /* no later bucket starts: the replicas would pair the wrong ones */
        return smp__coll_exit(gi, SMP_RDP_GROUP, st);
    }
    return SMP_OK;
}

/* Whether bucket b's host collective has finished; its timeline event when it just did. */
static bool smp__bucket_test(smp__pipe *ps, int b) {
    smp__bucket *k = &ps->plan.buckets[b];
    if (k->req == MPI_REQUEST_NULL) return true;
    int done = 0;
    /* the other replicas are in this collective: a rank that loses track of it cannot tell them */
    SMP__MPI_FATAL(MPI_Test(&k->req, &done, MPI_STATUS_IGNORE),
                   "completing data-parallel gradient bucket %d (%zu bytes) in DP_GROUP", b, k->bytes);
    if (done) {
        smp__event_add(ps, SMP__EVENT_ALLREDUCE, -1, b, k->t_start);
        if (smp__ctx.initialized) smp__ctx.groups[SMP_RDP_GROUP].in_coll = false;
    }
    return done;
}

/* Starts ready buckets in index order (the order every replica uses), a
   host bucket only once the one before it has finished: started together,
   MPICH's all-reduces compete for memory bandwidth and cache, and three
   24 MiB buckets take 10% longer side by side than one after another
   (bench/RESULTS.md). The test of the bucket before runs MPI's whole
   progress engine, so it also moves the bucket in flight. A device
   backend orders its collectives on its stream and starts each at once. */
static smp_status smp__ddp_advance(smp__pipe *ps) {
    smp_status st = SMP_OK;
    while (ps->step.next_bucket < ps->plan.nbuckets) {
        smp__bucket *b = &ps->plan.buckets[ps->step.next_bucket];
        bool after = b->device == SMP_HOST && ps->step.next_bucket > 0; /* a host bucket after another */
        if (!b->ready || (after && !smp__bucket_test(ps, ps->step.next_bucket - 1))) break;
        smp_status bs = SMP_OK;
        if (ps->step.bucket_failed && b->device == SMP_HOST)
            b->req = MPI_REQUEST_NULL; /* not started: see smp__bucket_start */
        else bs = smp__bucket_start(ps, b);
        if (!st) st = bs;
        ps->step.next_bucket++;
    }
    return st;
}

/* Between calls: the bucket in flight moves on, and the next starts once it is done. */
static void smp__ddp_poll(smp__pipe *ps) {
    if (ps->step.next_bucket > 0 && ps->step.next_bucket < ps->plan.nbuckets) smp__ddp_advance(ps);
    else if (ps->step.next_bucket > 0) smp__bucket_test(ps, ps->plan.nbuckets - 1);
}

static smp__pipe *smp__params_inflight; /* the step whose parameter all-gathers are in flight, for smp_poll */

SMPDEF void smp_poll(void) {
    if (smp__ddp_inflight) smp__ddp_poll(smp__ddp_inflight);
    if (smp__params_inflight) smp__params_poll(smp__params_inflight);
}

/* Call k's parameters are final: start the buckets that became complete. */
static smp_status smp__ddp_call_final(smp__pipe *ps, smp_model *md, int k) {
    smp_status st = SMP_OK;
    for (int i = 0; i < md->nparams && !st; i++) {
        smp_param *p = md->params[i];
        int b = md->grad_bucket[i];
        if (b < 0 || smp__final_call(p) != k) continue;
        if (++ps->plan.buckets[b].final == ps->plan.buckets[b].count && smp__ctx.cfg.overlapping_allreduce == SMP_ON) {
            ps->plan.buckets[b].ready = true;
            st = smp__ddp_advance(ps);
        }
    }
    return st;
}

/* Starts every bucket not started yet and waits for all of them. The wait
   polls without sleeping: MPI moves a large collective only inside MPI
   calls, a fixed amount per call (MPICH 4.0 over shared memory: about
   0.5 MiB, so a 24 MiB bucket takes some 50 calls however far apart), and
   the back-off's sleeps between polls (up to 1 ms) slow the sync down.
   The replicas arrive together, so the spin is short; sched_yield lets a
   rank that shares the core run. The timeout still applies. */
static smp_status smp__ddp_complete(smp__pipe *ps) {
    smp_status st = SMP_OK;
    for (int b = 0; b < ps->plan.nbuckets; b++) ps->plan.buckets[b].ready = true;
    double start = smp__now(), deadline = start + smp_timeout();
    unsigned polls = 0;
    for (;;) {
        /* every bucket, even after an error: the replicas expect each collective */
        smp_status bs = smp__ddp_advance(ps);
        if (!st) st = bs;
        bool done = ps->step.next_bucket == ps->plan.nbuckets;
        for (int b = 0; b < ps->plan.nbuckets && done; b++) done = smp__bucket_test(ps, b);
        if (done) break;
        double now = smp__now();
        if (now > deadline) smp__timeout_abort("data-parallel gradient all-reduce", SMP_RDP_GROUP, -1, now - start);
        /* a replica whose bucket collective failed to start says so (smp__bucket_start) */
        smp__group_info *gi = &smp__ctx.groups[SMP_RDP_GROUP];
        if (gi->in_coll && ++polls % 64 == 0) smp__check_member_failed(gi, SMP_RDP_GROUP);
        sched_yield();
    }
    if (ps->step.fence_buckets) {
        smp_status fs = smp__ctx.device.bucket_fence();
        if (!st) st = fs;
        ps->step.fence_buckets = false;
    }
    smp__ddp_inflight = NULL;
    return st;
}

/* Finishes the step's gradient sync once smp__ddp_complete has run: every
   bucket summed (the loss gradient was already divided, see smp_step).
   After a failed step the collectives have still completed, and the result
   is dropped. */
static smp_status smp__ddp_finish(smp__pipe *ps, bool failed) {
    int dp = smp_rdp_size(), me = smp_rdp_rank();
    smp_status st = SMP_OK;
    for (int b = 0; b < ps->plan.nbuckets; b++) {
        smp__bucket *k = &ps->plan.buckets[b];
        size_t es = smp_dtype_size(k->dtype);
        /* reduce-scattered: this replica's piece is what it sums, or what arrived summed */
        int64_t n = ps->plan.scatter ? k->numel / dp : k->numel;
        char *mine = (char *)k->data + (ps->plan.scatter ? (size_t)(n * me) * es : 0);
        smp_tensor acc = smp_tensor_1d(mine, k->dtype, n);
        acc.device = k->device;
        if (!failed && ps->plan.scatter) {
            if (!k->gather && me > 0) /* host, in place: see smp__bucket_start */
                memmove(mine, k->data, (size_t)n * es);
            /* the rest holds this replica's own addends: zeros, so that nothing reads them as the average, and a
               gradient kept to the next sync (no smp_model_zero_grad) adds its average there once */
            smp_tensor before = smp_tensor_1d(k->data, k->dtype, n * me);
            smp_tensor after = smp_tensor_1d(mine + (size_t)n * es, k->dtype, n * (dp - me - 1));
            before.device = after.device = k->device;
            if (me > 0) st = smp__tensor_zero(&before);
            if (!st && me < dp - 1) st = smp__tensor_zero(&after);
        }
        if (!failed && !st && k->gather) {
            for (int r = 0; r < k->pieces && !st; r++) {
                smp_tensor t = smp_tensor_1d((char *)k->gather + (size_t)(r * n) * es, k->dtype, n);
                t.device = k->device;
                st = r == 0 ? smp__tensor_copy(&acc, &t) : smp__add_into(&acc, &t);
            }
        }
        smp__free(k->gather);
        k->gather = NULL;
        k->pieces = 0;
        k->ready = false;
        k->final = 0;
    }
    ps->step.next_bucket = 0;
    ps->step.bucket_failed = false;
    return st;
}

/* ---------------------------------------------------------------- shard_optimizer_state: the parameter all-gather
   After a step each replica's optimizer updates the ranges it owns; the next step gathers the replicas' ranges
   bucket by bucket (the gradient buckets' layout, so a replica's range of a bucket is one piece of it). Every
   bucket's all-gather starts as the step begins (smp__step_gather_start: MPI_Iallgather, or the device backend's
   gather_start on its stream), and the step waits for a bucket only before the first forward call that reads one
   of its parameters (smp__params_ready), so the buckets the first calls do not read arrive while they compute. A
   host all-gather moves only inside MPI calls: the pass between calls tests them (smp__params_poll). Every
   all-gather is waited for before the body, a backward or the step's end, failed step or not
   (smp__params_complete): no step returns with one in flight or a parameter half gathered. */

/* Whether local call k reads parameter i (k == ncalls: whether no local call does), i in a bucket. */
static bool smp__call_reads(const smp_model *md, int k, int i, const bool *unread) {
    if (md->grad_bucket[i] < 0) return false;
    if (k == md->ncalls) return unread[i];
    return md->stage_rank[md->calls[k].stage] == smp__ctx.pp_rank && md->params[i]->module == md->calls[k].module;
}

/* Appends x to list[0 .. n) unless it is there; the new length. */
static int smp__list_once(int *list, int n, int x) {
    for (int i = 0; i < n; i++)
        if (list[i] == x) return n;
    list[n] = x;
    return n + 1;
}

/* Which buckets each local call reads (smp__plan's reads), and the order they start in, made by the first gather. */
static smp_status smp__params_plan(smp__pipe *ps, smp_model *md) {
    int n = md->ncalls, most = ps->plan.nbuckets, at = 0;
    smp_status st = SMP_OK;
    bool *unread = (bool *)smp__alloc_or(&st, (size_t)md->nparams + 1, SMP__ALLOC_OTHER | SMP__UNINIT,
                                         "the parameters' gather plan");
    if (st) return st;
    for (int i = 0; i < md->nparams; i++) unread[i] = md->grad_bucket[i] >= 0;
    for (int k = 0; k < n; k++)
        for (int i = 0; i < md->nparams; i++)
            if (smp__call_reads(md, k, i, unread)) most++, unread[i] = false;
    int nb = ps->plan.nbuckets, *first = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(n + 2 + most + nb),
                                                              SMP__ALLOC_OTHER, "the parameters' gather plan");
    for (int k = 0; k <= n && !st; k++) {
        first[k] = at;
        for (int i = 0; i < md->nparams; i++)
            if (smp__call_reads(md, k, i, unread))
                at = first[k] + smp__list_once(first + n + 2 + first[k], at - first[k], md->grad_bucket[i]);
    }
    if (!st) {
        first[n + 1] = at;
        ps->plan.reads_first = first;
        ps->plan.reads = first + n + 2;
        /* what the first forward waits for first (the buckets no call reads, then call by call), so that one
           stream's all-gathers, which finish in the order they were queued, arrive in the order they are needed */
        int *order = ps->plan.gather_order = ps->plan.reads + most, listed = 0;
        for (int j = 0; j <= n; j++) {
            int k = j ? j - 1 : n;
            for (int q = first[k]; q < first[k + 1]; q++) listed = smp__list_once(order, listed, ps->plan.reads[q]);
        }
        for (int b = 0; b < nb; b++) listed = smp__list_once(order, listed, b); /* none left: each holds a parameter */
    }
    smp__free(unread);
    return st;
}

/* count elements from element `first` of the bucket's q-th parameter (grad_order[q]), in a buffer at base laid out
   like the bucket. */
static smp_tensor smp__params_view(const smp_model *md, const smp__bucket *k, int q, void *base, int64_t first,
                                   int64_t count) {
    smp_tensor t = smp_tensor_1d((char *)base + (size_t)(md->grad_at[md->grad_order[q]] + first) *
                                     smp_dtype_size(k->dtype), k->dtype, count);
    t.device = k->device;
    return t;
}

/* Bucket b's buffer, with this replica's piece of its parameters in place. */
static smp_status smp__params_pack(smp_model *md, smp__bucket *k) {
    smp_status st = SMP_OK;
    int dp = smp_rdp_size(), me = smp_rdp_rank();
    int64_t piece = k->numel / dp, first, count;
    smp_tensor all = smp_tensor_1d(NULL, k->dtype, k->numel);
    if (!smp__tensor_alloc_or(&st, &all, k->device != SMP_HOST, SMP__ALLOC_COMM,
                              "the replicas' parameters (shard_optimizer_state)"))
        return st;
    k->params = all.data;
    smp_tensor mine = smp_tensor_1d((char *)all.data + (size_t)(piece * me) * smp_dtype_size(k->dtype), k->dtype, piece);
    mine.device = all.device;
    st = smp__tensor_zero(&mine); /* the padding */
    for (int q = k->first; q < k->first + k->count && !st; q++) {
        smp_param *p = md->params[md->grad_order[q]];
        if (p->value.dtype != k->dtype)
            return smp_error(SMP_ERR_STATE, "shard_optimizer_state gathers parameters in their gradients' dtype, and "
                             "'%s' holds %s values with %s gradients: leave shard_optimizer_state off", p->full_name,
                             smp_dtype_name(p->value.dtype), smp_dtype_name(k->dtype));
        smp__owned_range(md, p, me, &first, &count);
        smp_tensor from = smp_tensor_1d((char *)p->value.data + (size_t)first * smp_dtype_size(k->dtype), k->dtype,
                                        count);
        from.device = p->value.device;
        smp_tensor to = smp__params_view(md, k, q, k->params, first, count);
        if (count) st = smp__tensor_copy(&to, &from);
    }
    return st;
}

/* Starts bucket b's all-gather; every replica starts every bucket's, in the same order (the plan's gather_order).
   A backend without gather_start gathers at once. */
static smp_status smp__params_start(smp__pipe *ps, int b) {
    smp__bucket *k = &ps->plan.buckets[b];
    int dp = smp_rdp_size(), piece = (int)(k->numel / dp);
    k->t_params = smp__now();
    k->params_req = MPI_REQUEST_NULL;
    k->params_handle = NULL;
    if (k->device == SMP_HOST) {
        /* the other replicas are in it: a rank that cannot start it cannot tell them */
        SMP__MPI_FATAL(MPI_Iallgather(MPI_IN_PLACE, piece, smp__mpi_type(k->dtype), k->params, piece,
                                      smp__mpi_type(k->dtype), smp__ctx.groups[SMP_RDP_GROUP].comm, &k->params_req),
                       "gathering bucket %d's parameters (%zu bytes, shard_optimizer_state) in RDP_GROUP", b, k->bytes);
        return SMP_OK;
    }
    if (smp__ctx.device.gather_start)
        return smp__ctx.device.gather_start(k->params, k->dtype, k->numel, SMP_RDP_GROUP, &k->params_handle);
    smp_tensor all = smp_tensor_1d(k->params, k->dtype, k->numel),
               mine = smp_tensor_1d((char *)k->params + (size_t)(piece * smp_rdp_rank()) * smp_dtype_size(k->dtype),
                                    k->dtype, piece);
    all.device = mine.device = k->device;
    return smp_all_gather(&mine, &all, SMP_RDP_GROUP);
}

/* The step's first phase when the replicas updated their ranges: every bucket's buffer taken and packed, which
   every rank agrees it could (a failure leaves the parameters stale, nothing to undo, and the next step gathers
   them), then every all-gather started. */
static smp_status smp__step_gather_start(smp__pipe *ps, smp_model *md) {
    if (!md->params_stale) return SMP_OK;
    smp_status st = ps->plan.reads ? SMP_OK : smp__params_plan(ps, md);
    for (int b = 0; b < ps->plan.nbuckets && !st; b++) st = smp__params_pack(md, &ps->plan.buckets[b]);
    st = smp__agree_on(smp__ctx.world, st, "gathering the updated parameters (shard_optimizer_state)");
    for (int b = 0; b < ps->plan.nbuckets && st; b++) {
        smp__free(ps->plan.buckets[b].params);
        ps->plan.buckets[b].params = NULL;
    }
    if (st) return st;
    for (int o = 0; o < ps->plan.nbuckets; o++) {
        int b = ps->plan.gather_order[o];
        if ((st = smp__params_start(ps, b))) /* the replicas are in it, or will be, and would wait for this rank */
            smp__fatal("rank %d cannot start the all-gather of bucket %d's parameters (shard_optimizer_state), which "
                       "the other replicas wait in: %s", smp__ctx.rank, b, smp_last_error());
    }
    ps->step.params_gathering = ps->plan.nbuckets;
    if (!ps->plan.nbuckets) md->params_stale = false;
    else smp__params_inflight = ps;
    return SMP_OK;
}

/* Whether bucket b's host all-gather has finished. */
static bool smp__params_test(smp__pipe *ps, int b) {
    smp__bucket *k = &ps->plan.buckets[b];
    if (k->params_req == MPI_REQUEST_NULL) return true;
    int done = 0;
    SMP__MPI_FATAL(MPI_Test(&k->params_req, &done, MPI_STATUS_IGNORE),
                   "gathering bucket %d's parameters (%zu bytes, shard_optimizer_state) in RDP_GROUP", b, k->bytes);
    return done;
}

/* Between calls: the host all-gathers in flight move on. One test runs MPI's whole progress engine: that of the
   next bucket the forward will wait for. */
static void smp__params_poll(smp__pipe *ps) {
    for (int o = 0; o < ps->plan.nbuckets; o++)
        if (ps->plan.buckets[ps->plan.gather_order[o]].params) {
            (void)smp__params_test(ps, ps->plan.gather_order[o]);
            return;
        }
}

/* Waits for bucket b's all-gather and copies its parameters into place: on the host now; on the device in the
   engine's stream after the all-gather, the host not waiting. The polls spin: a waiting replica moves the
   collective only inside MPI calls, and a back-off's sleeps would slow it (see smp__ddp_complete). */
static smp_status smp__params_wait(smp__pipe *ps, smp_model *md, int b) {
    smp__bucket *k = &ps->plan.buckets[b];
    if (!k->params) return SMP_OK;
    double start = smp__now();
    while (!smp__params_test(ps, b)) {
        if (smp__now() - start > smp_timeout())
            smp__timeout_abort("the parameters' all-gather (shard_optimizer_state)", SMP_RDP_GROUP, -1,
                               smp__now() - start);
        sched_yield();
    }
    smp_status st = SMP_OK;
    for (int q = k->first; q < k->first + k->count && !st; q++) {
        smp_param *p = md->params[md->grad_order[q]];
        smp_tensor from = smp__params_view(md, k, q, k->params, 0, smp_tensor_numel(&p->value));
        if (k->params_handle)
            st = smp__ctx.device.gather_copy(k->params_handle, p->value.data, from.data, smp_tensor_nbytes(&from));
        else st = smp__tensor_copy(&p->value, &from);
    }
    if (k->params_handle) {
        smp_status end = smp__ctx.device.gather_end(k->params_handle); /* before the buffer goes */
        if (!st) st = end;
    }
    smp__event_add(ps, SMP__EVENT_GATHER, -1, b, k->t_params);
    smp__free(k->params);
    k->params = k->params_handle = NULL;
    if (--ps->step.params_gathering == 0) {
        md->params_stale = false;
        smp__params_inflight = NULL;
    }
    return st;
}

/* Before local call k's forward (k == ncalls: before the step's first): the buckets it reads. */
static smp_status smp__params_ready(smp__pipe *ps, smp_model *md, int k) {
    smp_status st = SMP_OK;
    for (int q = ps->plan.reads_first[k]; q < ps->plan.reads_first[k + 1] && ps->step.params_gathering; q++) {
        smp_status bs = smp__params_wait(ps, md, ps->plan.reads[q]);
        if (!st) st = bs;
    }
    return st;
}

/* Every all-gather still in flight, waited for and put in place, even after a failure. */
static smp_status smp__params_complete(smp__pipe *ps, smp_model *md) {
    smp_status st = SMP_OK;
    for (int b = 0; b < ps->plan.nbuckets && ps->step.params_gathering; b++) {
        smp_status bs = smp__params_wait(ps, md, b);
        if (!st) st = bs;
    }
    return st;
}

/* ---------------------------------------------------------------- gradient norm, clipping */
/* Element x of a floating-point gradient, as a double (other dtypes: 0). */
static double smp__grad_at(const smp_tensor *g, int64_t x) {
    switch (g->dtype) {
    case SMP_F32: return (double)((const float *)g->data)[x];
    case SMP_F64: return ((const double *)g->data)[x];
    case SMP_F16: return (double)smp_f16_to_f32(((const uint16_t *)g->data)[x]);
    case SMP_BF16: return (double)smp_bf16_to_f32(((const uint16_t *)g->data)[x]);
    default: return 0.0;
    }
}

/* The sum of squares behind the gradient norm, kept exactly: 32-bit digits in int64s (room for 2^29 terms
   between carries), the lowest worth 2^-1074, so any double adds without rounding. An exact sum does not
   depend on the order of its terms, so replicas that each hold a piece of a gradient (shard_optimizer_state)
   add up, bit for bit, to what one rank holding all of it gets, and so does any partitioning. Digits past the
   last carry hold inf (a square that overflowed) and NaN counts. */
enum { SMP__SQ_DIGITS = 72, SMP__SQ_INF = SMP__SQ_DIGITS, SMP__SQ_NAN, SMP__SQ_LEN };
typedef struct smp__sqsum { int64_t d[SMP__SQ_LEN]; int64_t terms; } smp__sqsum;

static void smp__sq_carry(smp__sqsum *a) {
    int64_t carry = 0;
    for (int k = 0; k < SMP__SQ_DIGITS; k++) {
        int64_t v = a->d[k] + carry, low = (int64_t)((uint64_t)v & 0xffffffffu);
        a->d[k] = low;
        carry = (v - low) / 4294967296; /* exact: v - low is a multiple of 2^32 */
    }
    a->terms = 0;
}

static void smp__sq_add(smp__sqsum *a, double x) {
    if (!isfinite(x)) { a->d[isnan(x) ? SMP__SQ_NAN : SMP__SQ_INF]++; return; }
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    int ex = (int)(bits >> 52 & 0x7ff);
    uint64_t mant = (bits & ((UINT64_C(1) << 52) - 1)) | (ex ? UINT64_C(1) << 52 : 0); /* x = +-mant 2^(pos - 1074) */
    int pos = ex ? ex - 1 : 0, k = pos / 32, sh = pos % 32;
    uint64_t lo = (mant & 0xffffffffu) << sh, hi = (mant >> 32) << sh;
    int64_t sign = bits >> 63 ? -1 : 1;
    a->d[k] += sign * (int64_t)(lo & 0xffffffffu);
    a->d[k + 1] += sign * (int64_t)((lo >> 32) + (hi & 0xffffffffu));
    a->d[k + 2] += sign * (int64_t)(hi >> 32);
    if (++a->terms == INT64_C(1) << 29) smp__sq_carry(a);
}

/* The sum as a double: the same function of the exact sum everywhere. */
static double smp__sq_value(smp__sqsum *a) {
    if (a->d[SMP__SQ_NAN]) return (double)NAN;
    if (a->d[SMP__SQ_INF]) return (double)INFINITY;
    smp__sq_carry(a);
    double v = 0;
    for (int k = SMP__SQ_DIGITS - 1; k >= 0; k--) v += ldexp((double)a->d[k], 32 * k - 1074);
    return v;
}

/* Reads elements [first, first + count) of p's gradient on the host: adds their squares to *sq and sets *bad on
   an inf or NaN. The norm and the scaler's overflow check read a device gradient through a host copy: one pass
   over the gradients per step. */
static smp_status smp__grad_scan(const smp_param *p, int64_t first, int64_t count, smp__sqsum *sq, int *bad) {
    smp_tensor g = p->grad;
    smp_status st = SMP_OK;
    void *copy = g.device == SMP_HOST
                     ? NULL
                     : smp__tensor_alloc_or(&st, &g, false, SMP__ALLOC_OTHER, "a host copy of a gradient");
    if (copy) st = smp__tensor_copy(&g, &p->grad);
    int64_t end = st ? first : first + count;
    for (int64_t x = first; x < end; x++) {
        double v = smp__grad_at(&g, x), v2 = v * v;
        if (sq) smp__sq_add(sq, v2);
        if (sq && g.dtype == SMP_F64 && isfinite(v2)) smp__sq_add(sq, fma(v, v, -v2)); /* exact: v2 and the rest */
        *bad |= !isfinite(v);
    }
    smp__free(copy);
    return st;
}

/* The part of p's gradient this rank reads for the norm and the overflow check: what it owns under
   shard_optimizer_state (its replicas hold the rest), all of it otherwise. */
static void smp__grad_range(smp_model *m, const smp_param *p, int64_t *first, int64_t *count) {
    smp__pipe *ps = (smp__pipe *)m->pipeline;
    if (ps && ps->plan.scatter) smp__owned_range(m, p, smp_rdp_rank(), first, count);
    else *first = 0, *count = smp_tensor_numel(&p->grad);
}

static smp_status smp__grad_norm(smp_model *m, double *total_norm) {
    SMP_TRY(smp__require_init("smp_clip_grad_norm"));
    smp_status st = SMP_OK;
    /* every element counted on exactly one rank: a shared module's copies hold one gradient, which its first
       partition counts; a whole parameter counts on tp rank 0 only, a sharded one on each of its TP ranks; a
       reduce-scattered one on the replica that owns each piece. The exact sums then add up to the one-process
       sum whatever holds which part. */
    smp__sqsum sq;
    memset(&sq, 0, sizeof sq);
    int bad = 0;
    for (int i = 0; i < m->nparams; i++) {
        smp_param *p = m->params[i];
        if (!smp__local_grad(p) || p->module->partition != smp__ctx.pp_rank || (p->shard_axis < 0 && smp__ctx.tp_rank))
            continue;
        int64_t first, count;
        smp__grad_range(m, p, &first, &count);
        smp_status cs = smp__grad_scan(p, first, count, &sq, &bad);
        if (cs && !st) st = cs;
    }
    smp__sq_carry(&sq);
    smp__pipe *ps = (smp__pipe *)m->pipeline;
    smp_tensor t = smp_tensor_1d(sq.d, SMP_I64, SMP__SQ_LEN);
    /* even after a local error: the others wait for it */
    smp_status rs = smp_all_reduce(&t, &t, SMP_SUM, ps && ps->plan.scatter ? SMP_WORLD : SMP_MP_GROUP);
    if (!st) st = rs;
    if (total_norm) *total_norm = sqrt(smp__sq_value(&sq));
    return st;
}

SMPDEF smp_status smp_clip_grad_norm(smp_model *m, double max_norm, double *total_norm) {
    if (!(max_norm > 0))
        return smp_error(SMP_ERR_ARG, "smp_clip_grad_norm: max_norm must be positive, got %g", max_norm);
    double norm;
    SMP_TRY(smp__grad_norm(m, &norm));
    if (total_norm) *total_norm = norm;
    double coef = max_norm / (norm + 1e-6);
    if (coef >= 1.0) return SMP_OK;
    return smp__scale_grads(m, coef);
}

/* ---------------------------------------------------------------- loss scaling */
static void smp__scaler_defaults(smp_grad_scaler *s) {
    if (!(s->scale > 0)) s->scale = 65536.0;
    if (!(s->growth_factor > 0)) s->growth_factor = 2.0;
    if (!(s->backoff_factor > 0)) s->backoff_factor = 0.5;
    if (s->growth_interval <= 0) s->growth_interval = 2000;
}
SMPDEF double smp_grad_scaler_scale(smp_grad_scaler *s) { smp__scaler_defaults(s); return s->scale; }

SMPDEF smp_status smp_grad_scaler_unscale(smp_model *m, smp_grad_scaler *s, bool *skip) {
    smp__scaler_defaults(s);
    int bad = 0;
    smp_status st = SMP_OK;
    int64_t first, count;
    for (int i = 0; i < m->nparams && !bad && !st; i++) {
        if (!smp__local_grad(m->params[i])) continue;
        smp__grad_range(m, m->params[i], &first, &count); /* the replicas check the other pieces */
        st = smp__grad_scan(m->params[i], first, count, NULL, &bad);
    }
    if (st) bad = 1; /* unreadable gradients: skip the step everywhere, and say why here */
    smp_tensor t = smp_tensor_1d(&bad, SMP_I32, 1);
    smp_status rs = smp_all_reduce(&t, &t, SMP_MAX, SMP_WORLD); /* one rank's overflow is everyone's */
    *skip = bad != 0;
    if (st || rs) return st ? st : rs;
    if (bad) {
        s->scale *= s->backoff_factor;
        s->good_steps = 0;
        return SMP_OK;
    }
    if ((st = smp__scale_grads(m, 1.0 / s->scale))) return st;
    if (++s->good_steps >= s->growth_interval) { s->scale *= s->growth_factor; s->good_steps = 0; }
    return SMP_OK;
}

/* ---------------------------------------------------------------- data helpers */
/* The ranks the data is sharded over: the replicas, or with prescaled_batch false each rank of a TP group too. */
static smp_group smp__data_group(void) {
    return smp__ctx.cfg.prescaled_batch == SMP_OFF ? SMP_DP_GROUP : SMP_RDP_GROUP;
}

SMPDEF smp_status smp_sampler_indices(const smp_sampler_desc *d, int epoch, int64_t *indices, int64_t *count,
                                      int64_t *batches) {
    if (!d || !indices || !count) return smp_error(SMP_ERR_ARG, "smp_sampler_indices: NULL argument");
    if (d->dataset_size < 0 || d->batch_size < 1)
        return smp_error(SMP_ERR_ARG, "smp_sampler_indices: dataset size %lld and batch size %lld (>= 1)",
                         (long long)d->dataset_size, (long long)d->batch_size);
    int dp = smp__ctx.initialized ? smp_group_size(smp__data_group()) : 1,
        r = smp__ctx.initialized ? smp_group_rank(smp__data_group()) : 0;
    int64_t n = d->dataset_size, L = d->batch_size, G = L * dp;
    int64_t nb = d->drop_last ? n / G : (n + G - 1) / G;
    if (nb == 0)
        return smp_error(SMP_ERR_ARG,
                         "smp_sampler_indices: %lld samples do not fill one global batch of %lld (%d replicas x %lld)",
                         (long long)n, (long long)G, dp, (long long)L);
    smp_status st = SMP_OK;
    int64_t *perm = (int64_t *)smp__alloc_or(&st, sizeof(int64_t) * (size_t)n, SMP__ALLOC_OTHER | SMP__UNINIT,
                                             "the sampler's permutation");
    if (st) return st;
    for (int64_t i = 0; i < n; i++) perm[i] = i;
    if (d->shuffle) {
        uint64_t state = d->seed * UINT64_C(0x9e3779b97f4a7c15) + (uint64_t)epoch;
        for (int64_t i = n - 1; i > 0; i--) {
            int64_t j = (int64_t)(smp__splitmix(&state) % (uint64_t)(i + 1));
            int64_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
        }
    }
    /* global batch b is perm[b*G .. (b+1)*G); replica r takes its r-th slice of
       L samples, so dp replicas see exactly the samples one process would see
       with a batch of G (wrapping around to fill the last batch without drop_last) */
    for (int64_t b = 0; b < nb; b++)
        for (int64_t i = 0; i < L; i++) indices[b * L + i] = perm[(b * G + r * L + i) % n];
    smp__free(perm);
    *count = nb * L;
    if (batches) *batches = nb;
    return SMP_OK;
}

SMPDEF smp_status smp_local_batch_size(int64_t global, int64_t *local) {
    int dp = smp_group_size(smp__data_group());
    if (global < 1 || global % dp)
        return smp_error(SMP_ERR_ARG, "global batch of %lld does not divide among %d data-parallel replicas",
                         (long long)global, dp);
    *local = global / dp;
    return SMP_OK;
}

SMPDEF smp_status smp_agree_batches(int64_t batches) {
    SMP_TRY(smp__require_init("smp_agree_batches"));
    int64_t v[2] = {batches, -batches};
    smp_tensor t = smp_tensor_1d(v, SMP_I64, 2);
    SMP_TRY(smp_all_reduce(&t, &t, SMP_MIN, smp__data_group()));
    if (v[0] != -v[1])
        return smp_error(SMP_ERR_ARG,
                         "data-parallel replicas have different numbers of batches (%lld to %lld): shard the data "
                         "evenly (drop_last)",
                         (long long)v[0], (long long)-v[1]);
    return SMP_OK;
}

/* Waits for everything other ranks send stage s for microbatch i and points
   the microbatch's tensors at it: activations into act (forward), gradient
   contributions into contrib (backward). The tensors are views into the
   receive buffers, which the step frees. */
static smp_status smp__receive(smp__pipe *ps, int s, int i, bool backward) {
    smp__xfer **wait = ps->await;
    int nw = 0, *lk = ps->await_link;
    for (int l = 0; l < ps->plan.nlinks; l++)
        if ((backward ? ps->plan.links[l].from : ps->plan.links[l].to) == s) {
            lk[nw] = l;
            wait[nw] = smp__recv_slot(ps, l, i, backward);
            wait[nw++]->wanted = true;
        }
    smp_status rc = smp__await(ps, wait, nw, backward ? "gradients" : "activations", s, i);
    for (int w = 0; w < nw && !rc; w++) {
        smp__xfer *x = wait[w];
        if (ps->plan.dev_p2p) smp__device_wait_all(x); /* the engine's work from here on comes after the transfers */
        else if (ps->plan.on_device) { /* staged: the bytes arrived on the host */
            smp_tensor host = smp_tensor_1d(x->buf, SMP_U8, (int64_t)x->bytes), dev = host;
            if (!smp__tensor_alloc_or(&rc, &dev, true, smp__step_kind(ps), "a pipeline message moved to the device"))
                return rc;
            rc = smp__tensor_copy(&dev, &host);
            smp__free(x->buf);
            x->buf = dev.data;
        }
        const smp__link *l = &ps->plan.links[lk[w]];
        char *p = (char *)x->buf;
        int n = backward ? l->nedges : l->ntensors;
        for (int t = 0; t < n; t++) {
            const int64_t *h = x->hdr + 10 * t;
            smp_tensor *dst = backward ? &ps->step.mb[i].contrib[l->edges[t]] : &ps->step.mb[i].act[l->tensors[t]];
            *dst = smp_tensor_make(p, (smp_dtype)h[0], (int)h[1], h + 2);
            if (ps->plan.on_device) dst->device = smp__ctx.device.current_device();
            p += smp_tensor_nbytes(dst);
        }
    }
    return rc;
}

/* ---------------------------------------------------------------- shared modules */
/* Swaps the gradients of call k's shared slots with their parameters': around call k's backward, so that it adds
   into its own slots. */
static void smp__swap_shared(smp__pipe *ps, smp_model *md, int k) {
    for (int q = ps->plan.shared_first[k]; q < ps->plan.shared_first[k + 1]; q++) {
        smp_param *p = md->params[ps->plan.shared[q].param];
        void *d = p->grad.data;
        p->grad.data = ps->plan.shared[q].grad.data;
        ps->plan.shared[q].grad.data = d;
    }
}

/* Whether partition `part` holds a copy of parameter `param`. */
static bool smp__shared_held(const smp__pipe *ps, int param, int part) {
    for (int q = 0; q < ps->plan.nshared; q++)
        if (ps->plan.shared[q].param == param && ps->plan.shared[q].part == part) return true;
    return false;
}

/* Each step starts its calls' slots from zero. */
static smp_status smp__shared_start(smp__pipe *ps) {
    smp_status st = SMP_OK;
    for (int q = 0; q < ps->plan.nshared && !st; q++) {
        smp__shared *s = &ps->plan.shared[q];
        if (s->part != smp__ctx.pp_rank) continue;
        if (!s->grad.data)
            smp__tensor_alloc_or(&st, &s->grad, ps->plan.on_device, SMP__ALLOC_GRAD,
                                 "the gradient of a shared parameter");
        if (!st) st = smp__tensor_zero(&s->grad);
    }
    return st;
}

/* The slots that travel between this rank and peer one way (send: those
   this rank ran for a copy there; receive: those peer ran for a parameter
   here), back to back in host memory: copied into buf (send) or out of it,
   and their bytes returned (buf NULL: only counted). */
static size_t smp__shared_pack(smp__pipe *ps, smp_model *md, bool send, int peer, char *buf, smp_status *st) {
    size_t at = 0;
    for (int q = 0; q < ps->plan.nshared && !*st; q++) {
        smp__shared *s = &ps->plan.shared[q];
        if (send ? s->part != smp__ctx.pp_rank || !smp__shared_held(ps, s->param, peer)
                 : s->part != peer || !md->params[s->param]->module->local)
            continue;
        smp_tensor h = s->grad;
        h.device = SMP_HOST;
        h.data = buf ? buf + at : NULL;
        if (buf && !send && !s->grad.data)
            smp__tensor_alloc_or(st, &s->grad, ps->plan.on_device, SMP__ALLOC_GRAD,
                                 "the gradient of a shared parameter");
        if (buf && !*st) *st = send ? smp__tensor_copy(&h, &s->grad) : smp__tensor_copy(&s->grad, &h);
        at += smp_tensor_nbytes(&h);
    }
    return at;
}

/* The end of a training step for shared modules: every partition holding a
   copy gets the slots of the calls other partitions ran (one message per
   pair of partitions, host memory), then adds every call's slot into the
   gradient in call order. Every copy and one process add the same numbers
   in the same order, so all are bitwise equal. */
static smp_status smp__shared_finish(smp__pipe *ps, smp_model *md) {
    int P = smp__ctx.cfg.partitions, me = smp__ctx.pp_rank, nreq = 0;
    smp_status st = SMP_OK;
    const char *what = "the gradients of shared modules";
    char **buf = (char **)smp__alloc_or(&st, sizeof(char *) * 2 * (size_t)P, SMP__ALLOC_OTHER, what);
    MPI_Request *req = (MPI_Request *)smp__alloc_or(&st, sizeof(MPI_Request) * 2 * (size_t)P, SMP__ALLOC_OTHER, what);
    /* [request]: pass * P + peer */
    int *slot = (int *)smp__alloc_or(&st, sizeof(int) * 2 * (size_t)P, SMP__ALLOC_OTHER, what);
    if (st) { smp__free(buf); smp__free(req); return st; }
    /* pass 0: receive what peer ran for parameters here; pass 1: send what this rank ran for parameters there */
    for (int pass = 0; pass < 2; pass++)
        for (int peer = 0; peer < P && !st; peer++) {
            size_t bytes = peer == me ? 0 : smp__shared_pack(ps, md, pass, peer, NULL, &st);
            if (!bytes) continue;
            char *b = buf[pass * P + peer] = (char *)smp__alloc_or(&st, bytes, SMP__ALLOC_COMM, what);
            if (b && pass) smp__shared_pack(ps, md, true, peer, b, &st);
            int tag = smp__tag(ps->plan.nlinks, false), count; /* past every link's */
            MPI_Datatype type;
            if (st || (st = smp__bytes_type(bytes, &count, &type))) break;
            slot[nreq] = pass * P + peer;
            req[nreq] = MPI_REQUEST_NULL;
            if (pass)
                st = SMP__MPI_CHECK(MPI_Isend(b, count, type, peer, tag, ps->comm, &req[nreq]),
                                    "sending shared modules' gradients to mp rank %d", peer);
            else
                st = SMP__MPI_CHECK(MPI_Irecv(b, count, type, peer, tag, ps->comm, &req[nreq]),
                                    "receiving shared modules' gradients from mp rank %d", peer);
            /* only a posted request joins the list: below, a null one is a
               completed receive, counted as a message that arrived */
            if (!st) {
                if (pass) ps->step.msgs_sent[2 * peer]++;
                nreq++;
            }
            if (type != MPI_BYTE) SMP__MPI_WARN(MPI_Type_free(&type), "releasing a shared gradients' datatype");
        }
    smp__backoff wait = smp__backoff_start();
    for (bool done = false; !done && !st;) {
        done = true;
        for (int r = 0; r < nreq; r++) {
            int flag = 0;
            if ((st = SMP__MPI_CHECK(MPI_Test(&req[r], &flag, MPI_STATUS_IGNORE),
                                     "exchanging shared modules' gradients (MP_GROUP)")))
                break;
            done = done && flag;
        }
        if (done || st) break;
        st = smp__progress(ps);
        if (!st && !smp__backoff_pause(&wait))
            smp__timeout_abort("gradients of shared modules", SMP_PP_GROUP, -1, smp__now() - wait.start);
    }
    for (int r = 0; r < nreq; r++) {
        int peer = slot[r] % P;
        if (slot[r] >= P) { /* a send: still in flight only after a failure, when the step's drain finishes it */
            if (req[r] == MPI_REQUEST_NULL) continue;
            if (!smp__grow((void **)&ps->step.sends, &ps->step.sends_cap, ps->step.nsends + 1, sizeof(smp__xfer), NULL))
                smp__fatal("out of memory keeping a send of a failed step until it is received");
            smp__xfer *x = &ps->step.sends[ps->step.nsends++];
            memset(x, 0, sizeof *x);
            x->req[0] = req[r];
            x->req[1] = MPI_REQUEST_NULL;
            x->peer = peer;
            x->buf = buf[slot[r]]; /* freed once sent */
            buf[slot[r]] = NULL;
            x->state = SMP__XFER_SENDING;
            continue;
        }
        /* a receive: a failed step takes back one that has not matched; the
           step's drain (smp__drain_messages) counts the others */
        if (req[r] == MPI_REQUEST_NULL || !smp__withdraw(&req[r], NULL)) ps->step.msgs_got[peer]++;
    }
    for (int peer = 0; peer < P && !st; peer++)
        if (buf[peer]) smp__shared_pack(ps, md, false, peer, buf[peer], &st); /* unpack what arrived */
    for (int q = 0; q < ps->plan.nshared && !st; q++) { /* in call order: the sum every copy computes */
        smp_param *p = md->params[ps->plan.shared[q].param];
        if (p->module->local) st = smp__add_into(&p->grad, &ps->plan.shared[q].grad);
    }
    for (int r = 0; r < 2 * P; r++) smp__free(buf[r]);
    smp__free(buf);
    smp__free(req);
    smp__free(slot);
    return st;
}

/* ---------------------------------------------------------------- forward and backward of one stage */
/* Points call k's inputs at this microbatch's tensors. */
static void smp__call_inputs(smp__pipe *ps, smp_model *md, int k, int i, smp_tensor *in) {
    const smp__call_rec *rec = &md->calls[k];
    smp__mbstate *st = &ps->step.mb[i];
    for (int j = 0; j < rec->nin; j++) {
        smp__ref r = rec->in[j];
        const smp_step_desc *d = ps->step.desc;
        const smp_tensor *src = r.call < 0 ? &st->args[d->nmodel_inputs ? d->model_inputs[r.index] : r.index]
                                           : &st->act[r.call * ps->plan.maxout + r.index];
        in[j] = *src;
        if (r.call >= 0 && smp_tensor_numel(src) == smp_tensor_numel(&rec->in_meta[j]) && rec->in_meta[j].ndim) {
            /* the call viewed its input with another shape at trace time (a reshape) */
            in[j].ndim = rec->in_meta[j].ndim;
            memcpy(in[j].shape, rec->in_meta[j].shape, sizeof in[j].shape);
        }
    }
}

/* Runs the forward of call k on microbatch i; a recomputation (again)
   keeps the outputs others read and makes only the internal ones anew. */
static smp_status smp__call_forward(smp__pipe *ps, smp_model *md, int k, int i, bool again) {
    smp__call_rec *rec = &md->calls[k];
    smp__mbstate *st = &ps->step.mb[i];
    smp_call_ctx *c = &st->ctx[k];
    int mo = ps->plan.maxout;
    if (!again) {
        memset(c, 0, sizeof *c);
        c->module = rec->module;
        c->microbatch = i;
        c->training = ps->step.training;
        c->kind = ps->step.training ? SMP__ALLOC_STASH : SMP__ALLOC_OTHER;
        c->nin = rec->nin;
        c->nout = rec->nout;
        c->call = k;
        c->seed = smp__call_seed(k, smp__ctx.rdp_rank * ps->step.m + i, ps->passes);
    }
    smp_status rc = SMP_OK;
    if (!c->inputs)
        c->inputs = (smp_tensor *)smp__alloc_or(&rc, sizeof(smp_tensor) * (size_t)(rec->nin + 1), SMP__ALLOC_OTHER,
                                                "a call's inputs");
    if (!c->outputs)
        c->outputs = (smp_tensor *)smp__alloc_or(&rc, sizeof(smp_tensor) * (size_t)rec->nout, SMP__ALLOC_OTHER,
                                                 "a call's outputs");
    smp_tensor *kept = again ? (smp_tensor *)smp__alloc_or(&rc, sizeof(smp_tensor) * (size_t)rec->nout,
                                                           SMP__ALLOC_OTHER | SMP__UNINIT, "a recomputation")
                             : NULL;
    if (rc) return rc;
    /* the context shows the engine const inputs; smp allocated them just above
       and owns them, hence the cast through uintptr_t (-Wcast-qual) */
    smp__call_inputs(ps, md, k, i, (smp_tensor *)(uintptr_t)c->inputs); /* again: the internal ones moved */
    for (int j = 0; j < rec->nout && kept; j++) {
        kept[j] = c->outputs[j];
        c->outputs[j].data = NULL;
    }
    rc = smp__run_callback(c, SMP__FORWARD);
    for (int j = 0; j < rec->nout; j++) {
        if (kept && !ps->plan.internal[k * mo + j]) { /* the same bytes: keep the tensor later calls already read */
            smp__free(c->outputs[j].data);
            c->outputs[j] = kept[j];
        }
        st->act[k * mo + j] = c->outputs[j];
    }
    smp__free(kept);
    return rc;
}

/* What a recomputed call keeps between its forward and its backward, and
   after its backward: its inputs (and the outputs later calls read). The
   outputs only its own calls read and every stash go. */
static void smp__recompute_drop(smp__pipe *ps, int i, int first, int last) {
    smp__mbstate *st = &ps->step.mb[i];
    for (int k = first; k <= last; k++) {
        smp_call_ctx *c = &st->ctx[k];
        smp__call_release(c, false);
        for (int j = 0; j < c->nout; j++)
            if (ps->plan.internal[k * ps->plan.maxout + j]) {
                smp__free(c->outputs[j].data);
                c->outputs[j].data = st->act[k * ps->plan.maxout + j].data = NULL;
            }
    }
}

static smp_status smp__stage_forward(smp__pipe *ps, smp_model *md, int s, int i) {
    SMP_TRY(smp__receive(ps, s, i, false));
    smp_status rc = SMP_OK;
    double t0 = smp__now();
    for (int k = md->stage_first[s]; k <= md->stage_last[s] && !rc; k++) {
        if (ps->step.params_gathering) rc = smp__params_ready(ps, md, k); /* the buckets holding its parameters */
        if (!rc) rc = smp__call_forward(ps, md, k, i, false);
        const smp__call_rec *rec = &md->calls[k];
        if (!rc && ps->step.training && rec->recompute_last == k) smp__recompute_drop(ps, i, rec->recompute_first, k);
        if (!rc && k < md->stage_last[s]) rc = smp__between_calls(ps);
    }
    if (rc) return rc;
    smp__event_add(ps, SMP__EVENT_FORWARD, s, i, t0);
    ps->step.inflight[s]++;
    for (int l = 0; l < ps->plan.nlinks && !rc; l++)
        if (ps->plan.links[l].from == s) rc = smp__send(ps, l, false, s, i);
    return rc;
}

static smp_status smp__run_body(smp__pipe *ps, smp_model *md, int i) {
    smp__mbstate *st = &ps->step.mb[i];
    smp_mb mb = {ps, md, i, st};
    smp_status rc = SMP_OK;
    for (int o = 0; o < md->desc.noutputs && ps->step.training && !rc; o++) {
        smp_tensor *g = &st->out_grad[o];
        *g = *smp_mb_output(&mb, o);
        if (smp__tensor_alloc_or(&rc, g, ps->plan.on_device, SMP__ALLOC_STASH, "the gradient of a model output"))
            rc = smp__tensor_zero(g);
    }
    /* no body: the model's outputs are what the step returns (model_outs is 0 with a body) */
    for (int o = 0; o < ps->step.model_outs && !rc; o++) rc = smp_mb_return(&mb, o, smp_mb_output(&mb, o));
    if (rc || !ps->step.desc->body) return rc;
    double t0 = smp__now();
    smp__errbuf[0] = 0;
    rc = ps->step.desc->body(&mb);
    smp__event_add(ps, SMP__EVENT_BODY, md->nstages - 1, i, t0);
    if (rc) {
        char msg[sizeof smp__errbuf];
        memcpy(msg, smp__errbuf, sizeof msg);
        return smp_error(rc == SMP_ERR_NOMEM ? rc : SMP_ERR_MODULE, "the step body failed on microbatch %d: %s", i,
                         *msg ? msg : smp_status_name(rc));
    }
    const smp_config *cfg = &smp__ctx.cfg;
    double divisor = cfg->average_grads_across_microbatches == SMP_ON ? ps->step.m : 1;
    if (cfg->ddp == SMP_ON) divisor *= (double)smp_rdp_size() * cfg->backward_passes_per_step;
    for (int o = 0; o < md->desc.noutputs && ps->step.training && !rc; o++) {
        if (divisor != 1) rc = smp__tensor_scale(&st->out_grad[o], 1.0 / divisor);
        /* the output gradient is the body's contribution to model output o */
        int t = md->outputs[o].call * ps->plan.maxout + md->outputs[o].index;
        for (int e = ps->plan.first_edge[t]; e < ps->plan.first_edge[t + 1]; e++)
            if (ps->plan.edges[e].consumer == md->ncalls && ps->plan.edges[e].input == o) {
                st->contrib[e] = st->out_grad[o];
                st->out_grad[o].data = NULL; /* owned by the contribution now */
            }
    }
    return rc;
}

/* Frees the output gradients a backward made (or kept for its W). */
static void smp__drop_grad_outputs(smp_call_ctx *c) {
    for (int j = 0; j < c->nout && c->grad_outputs; j++) smp__free(c->grad_outputs[j].data);
    smp__free((void *)(uintptr_t)c->grad_outputs); /* smp's own, const only to the engine */
    c->grad_outputs = NULL;
}

/* Whether the recomputed call that starts at leaf k holds a split module,
   whose W still reads what the recomputation made. */
static bool smp__recompute_waits_for_w(const smp_model *md, int k) {
    for (int q = k; q <= md->calls[k].recompute_last; q++)
        if (smp__split_backward(md->calls[q].module)) return true;
    return false;
}

/* Call k has no more backward work on microbatch i: a recomputed call lets
   go of what it made again, and after the last microbatch its gradients
   are final for the data-parallel buckets. */
static smp_status smp__backward_done(smp__pipe *ps, smp_model *md, int k, int i) {
    const smp__call_rec *rec = &md->calls[k];
    if (rec->recompute_first == k && (!ps->step.zb || smp__recompute_waits_for_w(md, k)))
        smp__recompute_drop(ps, i, k, rec->recompute_last);
    return ps->step.sync && i == ps->step.m - 1 ? smp__ddp_call_final(ps, md, k) : SMP_OK;
}

/* An output's gradient when one consumer made it: the contribution's own
   buffer, not a copy (a copy would hold an activation-sized gradient twice
   at the backward's peak). A contribution made on this rank is owned; a
   received one can be taken when its message carried nothing else, and
   its receive slot lets go of the buffer. */
static bool smp__adopt_contrib(smp__pipe *ps, int s, int i, int e, smp_tensor *gout) {
    smp_tensor *c = &ps->step.mb[i].contrib[e];
    if (!c->data || c->dtype != gout->dtype || smp_tensor_nbytes(c) != smp_tensor_nbytes(gout)) return false;
    if (ps->plan.edges[e].remote) {
        smp__xfer *x = NULL;
        for (int l = 0; l < ps->plan.nlinks && !x; l++) {
            const smp__link *k = &ps->plan.links[l];
            if (k->to == ps->plan.edges[e].stage && k->from == s && k->nedges == 1 && k->edges[0] == e)
                x = smp__recv_slot(ps, l, i, true);
        }
        if (!x || x->buf != c->data) return false;
        x->buf = NULL;
    }
    gout->data = c->data;
    gout->device = c->device;
    c->data = NULL;
    return true;
}

static smp_status smp__stage_backward(smp__pipe *ps, smp_model *md, int s, int i) {
    smp__mbstate *st = &ps->step.mb[i];
    int mo = ps->plan.maxout;
    SMP_TRY(smp__receive(ps, s, i, true));
    smp_status rc = SMP_OK;
    double t0 = smp__now();
    for (int k = md->stage_last[s]; k >= md->stage_first[s]; k--) {
        smp__call_rec *rec = &md->calls[k];
        smp_call_ctx *c = &st->ctx[k];
        if (rec->recompute_last == k) /* the last call of a recomputed one: run its forward again */
            for (int q = rec->recompute_first; q <= k && !rc; q++) rc = smp__call_forward(ps, md, q, i, true);
        /* gradient of each output: its consumers' contributions, latest consumer first */
        smp_tensor *gout = (smp_tensor *)smp__alloc_or(&rc, sizeof(smp_tensor) * (size_t)rec->nout, SMP__ALLOC_OTHER,
                                                       "a call's output gradients");
        smp_tensor *gin = (smp_tensor *)smp__alloc_or(&rc, sizeof(smp_tensor) * (size_t)(rec->nin + 1),
                                                      SMP__ALLOC_OTHER | SMP__UNINIT, "a call's input gradients");
        if (rc) { smp__free(gout); return rc; }
        for (int j = 0; j < rec->nout && !rc; j++) {
            gout[j] = c->outputs[j];
            int t = k * mo + j, first = ps->plan.first_edge[t], last = ps->plan.first_edge[t + 1] - 1;
            /* the latest contribution's own buffer, the others added into it (in the order a copy of it took
               them: the same sums), saves a buffer and a pass over it per microbatch */
            if (last >= first && smp__adopt_contrib(ps, s, i, last, &gout[j])) {
                if (first == last) continue;
            } else {
                if (!smp__tensor_alloc_or(&rc, &gout[j], ps->plan.on_device, SMP__ALLOC_STASH, "an output gradient"))
                    break;
                if (last < first) { rc = smp__tensor_zero(&gout[j]); continue; }
                rc = smp__tensor_copy(&gout[j], &st->contrib[last]);
            }
            for (int e = last - 1; e >= first && !rc; e--) rc = smp__add_into(&gout[j], &st->contrib[e]);
            /* summed: the ones made here go now (received ones are views) */
            for (int e = first; e <= last && !rc; e++) {
                if (!ps->plan.edges[e].remote) smp__free(st->contrib[e].data);
                st->contrib[e].data = NULL;
            }
        }
        for (int j = 0; j < rec->nin; j++) {
            gin[j] = c->inputs[j];
            gin[j].data = NULL;
            if (rec->in[j].call < 0 || rc) continue; /* model inputs take no gradient */
            if (smp__tensor_alloc_or(&rc, &gin[j], ps->plan.on_device, SMP__ALLOC_STASH, "an input gradient") &&
                !rec->module->overwrites_grad_inputs)
                rc = smp__tensor_zero(&gin[j]);
        }
        c->grad_outputs = gout;
        c->grad_inputs = gin;
        /* a shared module's call adds into its own slot (see smp__shared_finish) */
        smp__swap_shared(ps, md, k);
        /* zero bubble: a split module's weight half waits for the W op, and so does its output gradient */
        bool later = ps->step.zb && smp__split_backward(rec->module);
        if (!rc) rc = smp__run_callback(c, later ? SMP__BACKWARD_INPUT : SMP__BACKWARD);
        smp__swap_shared(ps, md, k);
        if (!later || rc) smp__drop_grad_outputs(c);
        for (int j = 0; j < rec->nin; j++) {
            int e = ps->plan.edge_of_input[k * ps->plan.maxin + j];
            if (e >= 0) { st->contrib[e] = gin[j]; st->contrib[e].shape[0] = gin[j].shape[0]; }
        }
        smp__free(gin);
        c->grad_inputs = NULL;
        if (!rc && !ps->step.zb) rc = smp__backward_done(ps, md, k, i);
        else if (!rc && rec->recompute_first == k && !smp__recompute_waits_for_w(md, k)) /* no W will read it */
            smp__recompute_drop(ps, i, k, rec->recompute_last);
        if (!rc) rc = smp__between_calls(ps);
        if (rc) return rc;
    }
    smp__event_add(ps, SMP__EVENT_BACKWARD, s, i, t0);
    for (int l = 0; l < ps->plan.nlinks && !rc; l++) /* gradients for producers on other ranks */
        if (ps->plan.links[l].to == s) rc = smp__send(ps, l, true, s, i);
    if (!rc && !ps->step.zb) ps->step.inflight[s]--;
    return rc;
}

/* The W op of a zero-bubble schedule: the weight halves of stage s's split
   modules on microbatch i, in backward order, each with the output gradient
   its B kept. Gradients are then final for this microbatch. */
static smp_status smp__stage_weight(smp__pipe *ps, smp_model *md, int s, int i) {
    smp__mbstate *st = &ps->step.mb[i];
    smp_status rc = SMP_OK;
    double t0 = smp__now();
    for (int k = md->stage_last[s]; k >= md->stage_first[s] && !rc; k--) {
        smp_call_ctx *c = &st->ctx[k];
        if (smp__split_backward(md->calls[k].module)) {
            smp__swap_shared(ps, md, k);
            rc = smp__run_callback(c, SMP__BACKWARD_WEIGHT);
            smp__swap_shared(ps, md, k);
            smp__drop_grad_outputs(c);
        }
        if (!rc) rc = smp__backward_done(ps, md, k, i);
        if (!rc) rc = smp__between_calls(ps);
    }
    smp__event_add(ps, SMP__EVENT_WEIGHT, s, i, t0);
    ps->step.inflight[s]--;
    return rc;
}

/* Frees what stage s holds for microbatch i once nothing needs it. The
   contributions a stage sent stay until the send completes (freed at step end). */
static void smp__stage_release(smp__pipe *ps, smp_model *md, int s, int i) {
    smp__mbstate *st = &ps->step.mb[i];
    /* F(s, i)'s device sends read its activations until done (received by now) */
    for (int k = 0; k < ps->step.nsends && ps->plan.dev_p2p; k++) {
        smp__xfer *x = &ps->step.sends[k];
        if (x->state == SMP__XFER_SENDING && !x->backward && x->stage == s && x->mb == i) smp__device_wait_all(x);
    }
    for (int k = md->stage_first[s]; k <= md->stage_last[s]; k++) {
        smp_call_ctx *c = &st->ctx[k];
        if (!c->module) continue;
        smp__call_release(c, true);
        smp__drop_grad_outputs(c); /* kept for a W that a failed step never ran */
        smp__free((void *)(uintptr_t)c->inputs);
        smp__free(c->outputs);
        memset(c, 0, sizeof *c);
        /* contributions to this call's outputs were consumed by its backward */
        for (int j = 0; j < md->calls[k].nout; j++) {
            int t = k * ps->plan.maxout + j;
            for (int e = ps->plan.first_edge[t]; e < ps->plan.first_edge[t + 1]; e++) {
                if (!ps->plan.edges[e].remote) smp__free(st->contrib[e].data); /* remote: views into a receive buffer */
                st->contrib[e].data = NULL;
            }
        }
    }
}

/* ---------------------------------------------------------------- activation offloading */
/* One device block that stage `stage` holds for microbatch `mb`'s backward, sent to pinned host memory
   (ACTIVATION OFFLOADING). The places in the step's state that pointed into it (its slots) hold NULL while it is
   away, and the block it comes back into, at the same offsets, after. */
typedef enum smp__off_state {
    SMP__OFF_COPYING, /* the copy out is queued; dev is still the block (and the step's sends may read it) */
    SMP__OFF_AWAY,    /* dev freed: the bytes are on the host only */
    SMP__OFF_LOADING, /* dev is the new block, the copy back queued */
    SMP__OFF_BACK     /* the engine waits for it; the record is done */
} smp__off_state;
typedef struct smp__offload {
    void *copy;           /* the backend's handle */
    void *dev;
    size_t bytes;
    int stage, mb, op;    /* op: the operation after which it left */
    int first_slot, nslots;
    smp__off_state state;
} smp__offload;
typedef struct smp__off_slot { void **at; size_t offset; } smp__off_slot;

/* A step offloads when it trains a device model with offload_activations on. B(s, i)'s place in this rank's
   operations decides when what it needs comes back. */
static smp_status smp__offload_begin(smp__pipe *ps, smp_model *md) {
    ps->noff = ps->noff_slots = 0;
    ps->offloading = ps->step.training && ps->plan.on_device && smp__ctx.cfg.offload_activations == SMP_ON;
    if (!ps->offloading) return SMP_OK;
    smp_status st = SMP_OK;
    int n = md->nstages * ps->step.m, me = smp__ctx.pp_rank;
    if (!smp__grow_or(&st, (void **)&ps->bwd_at, &ps->bwd_at_cap, n, sizeof(int), "the step's offloading plan"))
        return st;
    for (int k = 0; k < n; k++) ps->bwd_at[k] = -1;
    for (int o = 0; o < ps->step.sched->nops[me]; o++) {
        smp_sched_op op = ps->step.sched->ops[me][o];
        if (op.kind == SMP_SCHED_BACKWARD) ps->bwd_at[op.stage * ps->step.m + op.microbatch] = o;
    }
    return SMP_OK;
}

/* Notes *at as a slot of the block [base, base + bytes) when it points there. */
static smp_status smp__offload_slot(smp__pipe *ps, void **at, const char *base, size_t bytes) {
    const char *p = (const char *)*at;
    if (!p || p < base || p >= base + bytes) return SMP_OK;
    smp_status st = SMP_OK;
    if (!smp__grow_or(&st, (void **)&ps->off_slots, &ps->off_slots_cap, ps->noff_slots + 1, sizeof(smp__off_slot),
                      "an offloaded activation's references"))
        return st;
    ps->off_slots[ps->noff_slots].at = at;
    ps->off_slots[ps->noff_slots++].offset = (size_t)(p - base);
    return SMP_OK;
}

/* Every place of microbatch i's state that points into a block: its tensors, its calls' inputs, outputs and
   device stashes, its gradient contributions and receive buffers. */
static smp_status smp__offload_find_slots(smp__pipe *ps, smp_model *md, int i, const char *base, size_t bytes) {
    smp__mbstate *st = &ps->step.mb[i];
    smp_status rc = SMP_OK;
    for (int t = 0; t < md->ncalls * ps->plan.maxout && !rc; t++)
        rc = smp__offload_slot(ps, &st->act[t].data, base, bytes);
    for (int k = 0; k < md->ncalls && !rc; k++) {
        smp_call_ctx *c = &st->ctx[k];
        if (!c->module) continue;
        smp_tensor *in = (smp_tensor *)(uintptr_t)c->inputs; /* smp's own, const only to the engine */
        for (int j = 0; j < c->nin && in && !rc; j++) rc = smp__offload_slot(ps, &in[j].data, base, bytes);
        for (int j = 0; j < c->nout && c->outputs && !rc; j++)
            rc = smp__offload_slot(ps, &c->outputs[j].data, base, bytes);
        if (!rc) rc = smp__offload_slot(ps, &c->device_stash, base, bytes);
    }
    for (int e = 0; e < ps->plan.nedges && !rc; e++) rc = smp__offload_slot(ps, &st->contrib[e].data, base, bytes);
    for (int o = 0; o < md->desc.noutputs && !rc; o++) rc = smp__offload_slot(ps, &st->out_grad[o].data, base, bytes);
    for (int l = 0; l < ps->plan.nlinks && !rc; l++)
        for (int b = 0; b < 2 && !rc; b++)
            rc = smp__offload_slot(ps, &smp__recv_slot(ps, l, i, b != 0)->buf, base, bytes);
    return rc;
}

/* Points a record's slots at p (NULL: away), each that still holds what the record left there. */
static void smp__offload_point(smp__pipe *ps, const smp__offload *r, char *p) {
    for (int q = r->first_slot; q < r->first_slot + r->nslots; q++) {
        smp__off_slot *sl = &ps->off_slots[q];
        if (!p) *sl->at = NULL;
        else if (!*sl->at) *sl->at = p + sl->offset; /* a slot rewritten meanwhile (a receive) is no longer ours */
    }
}

/* Sends one block of stage s's microbatch i to the host, after the op-th operation. */
static smp_status smp__offload_block(smp__pipe *ps, smp_model *md, int s, int i, int op, void *p, size_t bytes) {
    if (!p || !bytes) return SMP_OK;
    for (int r = 0; r < ps->noff; r++)
        if (ps->off[r].dev == p && ps->off[r].state == SMP__OFF_COPYING) return SMP_OK; /* named twice */
    smp_status st = SMP_OK;
    if (!smp__grow_or(&st, (void **)&ps->off, &ps->off_cap, ps->noff + 1, sizeof(smp__offload),
                      "an offloaded activation"))
        return st;
    smp__offload *r = &ps->off[ps->noff];
    memset(r, 0, sizeof *r);
    r->dev = p;
    r->bytes = bytes;
    r->stage = s;
    r->mb = i;
    r->op = op;
    r->first_slot = ps->noff_slots;
    st = smp__offload_find_slots(ps, md, i, (const char *)p, bytes);
    if (!st) st = smp__ctx.device.offload(p, bytes, &r->copy);
    if (st) { ps->noff_slots = r->first_slot; return st; }
    r->nslots = ps->noff_slots - r->first_slot;
    r->state = SMP__OFF_COPYING;
    ps->noff++;
    smp__offload_point(ps, r, NULL);
    smp__count(SMP__ALLOC_OFFLOAD, (int64_t)bytes);
    return SMP_OK;
}

/* After F(s, i) (and the body) ran as the op-th operation: what B(s, i) reads goes to the host, unless B comes
   back within the horizon anyway. */
static smp_status smp__offload_stage(smp__pipe *ps, smp_model *md, int s, int i, int op) {
    if (!ps->offloading) return SMP_OK;
    int b = ps->bwd_at[s * ps->step.m + i];
    if (b < 0 || b <= op + 1 + smp__ctx.cfg.activation_loading_horizon) return SMP_OK;
    smp__mbstate *st = &ps->step.mb[i];
    smp_status rc = SMP_OK;
    for (int k = md->stage_first[s]; k <= md->stage_last[s] && !rc; k++) {
        smp_call_ctx *c = &st->ctx[k];
        rc = smp__offload_block(ps, md, s, i, op, c->device_stash, c->device_stash_bytes);
        for (int j = 0; j < c->nout && !rc; j++)
            rc = smp__offload_block(ps, md, s, i, op, c->outputs[j].data, smp_tensor_nbytes(&c->outputs[j]));
        for (int j = 0; j < c->nout && !rc; j++) { /* the body's loss gradients for this stage's outputs */
            int t = k * ps->plan.maxout + j;
            for (int e = ps->plan.first_edge[t]; e < ps->plan.first_edge[t + 1] && !rc; e++)
                if (ps->plan.edges[e].consumer == md->ncalls && !ps->plan.edges[e].remote)
                    rc = smp__offload_block(ps, md, s, i, op, st->contrib[e].data, smp_tensor_nbytes(&st->contrib[e]));
        }
    }
    for (int l = 0; l < ps->plan.nlinks && !rc; l++)
        if (ps->plan.links[l].to == s) {
            smp__xfer *x = smp__recv_slot(ps, l, i, false);
            rc = smp__offload_block(ps, md, s, i, op, x->buf, x->bytes);
        }
    return rc;
}

/* Whether F(s, i)'s device sends have read their buffers; those that have are finished (smp__stage_release
   would otherwise). */
static bool smp__offload_sent(smp__pipe *ps, int s, int i, bool finish) {
    for (int k = 0; k < ps->step.nsends; k++) {
        smp__xfer *x = &ps->step.sends[k];
        if (x->state != SMP__XFER_SENDING || x->backward || x->stage != s || x->mb != i || !x->ndev_req) continue;
        if (!finish && !smp__device_done(x)) return false;
        smp__device_wait_all(x); /* orders the engine's stream after the transfers; the host waits only when staged */
    }
    return true;
}

/* A block's copy out is done: its device memory goes. Forced (force), it goes in the engine stream's order after
   the copy and F(s, i)'s sends, on the device. */
static smp_status smp__offload_free(smp__pipe *ps, smp__offload *r, bool force) {
    bool done = false;
    smp_status st = smp__ctx.device.offload_done(r->copy, &done);
    if (!st && !done && force) st = smp__ctx.device.offload_wait(r->copy);
    if (st || !(done || force) || !smp__offload_sent(ps, r->stage, r->mb, force)) return st;
    smp__free(r->dev);
    r->dev = NULL;
    r->state = SMP__OFF_AWAY;
    return SMP_OK;
}

/* A record comes back: into a new block when its device memory went, else where it still is. */
static smp_status smp__offload_return(smp__pipe *ps, smp__offload *r) {
    smp_status st = SMP_OK;
    if (r->state == SMP__OFF_COPYING) { /* never freed: the step points at it again */
        smp__offload_point(ps, r, (char *)r->dev);
        r->dev = NULL;
        r->state = SMP__OFF_LOADING;
        return SMP_OK;
    }
    if (r->state != SMP__OFF_AWAY) return SMP_OK;
    smp_tensor block = smp_tensor_1d(NULL, SMP_U8, (int64_t)r->bytes);
    if (!smp__tensor_alloc_or(&st, &block, true, smp__step_kind(ps), "an offloaded activation back on the device"))
        return st;
    st = smp__ctx.device.reload(r->copy, block.data);
    if (st) { smp__free(block.data); return st; }
    smp__offload_point(ps, r, (char *)block.data);
    r->state = SMP__OFF_LOADING;
    return SMP_OK;
}

/* Before the op-th operation: the device memory of blocks copied out after earlier operations goes, in the
   engine stream's order after their copies (the engine waits on the device for a copy still running; the host
   never does), and what a backward within the horizon reads starts back. */
static smp_status smp__offload_progress(smp__pipe *ps, int op) {
    smp_status st = SMP_OK;
    for (int q = 0; q < ps->noff && !st; q++) {
        smp__offload *r = &ps->off[q];
        if (r->state == SMP__OFF_COPYING) st = smp__offload_free(ps, r, r->op < op);
        if (!st && ps->bwd_at[r->stage * ps->step.m + r->mb] <= op + smp__ctx.cfg.activation_loading_horizon)
            st = smp__offload_return(ps, r);
    }
    return st;
}

/* Before B(s, i): everything it reads is back, the engine's stream ordered after the copies. */
static smp_status smp__offload_ready(smp__pipe *ps, int s, int i) {
    smp_status st = SMP_OK;
    for (int q = 0; q < ps->noff && ps->offloading && !st; q++) {
        smp__offload *r = &ps->off[q];
        if (r->stage != s || r->mb != i || r->state == SMP__OFF_BACK) continue;
        st = smp__offload_return(ps, r);
        if (!st) st = smp__ctx.device.offload_drop(r->copy);
        r->state = SMP__OFF_BACK;
        smp__count(SMP__ALLOC_OFFLOAD, -(int64_t)r->bytes);
    }
    return st;
}

/* A failed step's records: what is on the host is let go, and the step points at what is still on the device
   (its owners free it). */
static void smp__offload_release(smp__pipe *ps) {
    for (int q = 0; q < ps->noff; q++) {
        smp__offload *r = &ps->off[q];
        if (r->state == SMP__OFF_BACK) continue;
        if (r->state == SMP__OFF_COPYING) smp__offload_point(ps, r, (char *)r->dev);
        if (smp__ctx.device.offload_drop(r->copy))
            smp__log(SMP_LOG_WARN, "a failed step letting go of an offloaded activation: %s", smp__errbuf);
        smp__count(SMP__ALLOC_OFFLOAD, -(int64_t)r->bytes);
    }
    ps->noff = ps->noff_slots = 0;
}

/* offload_activations needs a device model and a backend that can offload. */
static smp_status smp__offload_check(const smp_model *md) {
    if (smp__ctx.cfg.offload_activations != SMP_ON) return SMP_OK;
    if (!md->desc.on_device)
        return smp_error(SMP_ERR_CONFIG, "config key \"offload_activations\" moves a device model's activations "
                         "to host memory, but this model's tensors live on the host (smp_model_desc.on_device is "
                         "false): there is nothing to offload; leave offload_activations off");
    const smp_device_backend *b = &smp__ctx.device;
    if (!b->offload || !b->offload_done || !b->reload || !b->offload_wait || !b->offload_drop)
        return smp_error(SMP_ERR_CONFIG, "config key \"offload_activations\" is on, but the device backend \"%s\" "
                         "cannot offload (its offload entries are NULL): use smp_nccl.h's backend, or leave "
                         "offload_activations off", b->name ? b->name : "?");
    return SMP_OK;
}

/* ---------------------------------------------------------------- the step */
/* Frees what the step made. Every transfer has finished: the step ran to
   its end, or a failed step was drained (smp__drain_messages). */
static void smp__release_step(smp__pipe *ps, smp_model *md) {
    smp__offload_release(ps); /* before the receive buffers go: a record may point one back at its bytes */
    size_t nrecv = ps->step.recv ? (size_t)ps->plan.nlinks * (size_t)ps->step.m * 2 : 0;
    for (size_t i = 0; i < nrecv; i++) {
        smp__xfer *x = &ps->step.recv[i];
        SMP_ASSERT(x->state != SMP__XFER_HEADER_POSTED && (x->state != SMP__XFER_BYTES_POSTED || ps->plan.dev_p2p));
        smp__xfer_free(x);
    }
    smp__free(ps->step.recv);
    ps->step.recv = NULL;
    ps->step.recv_front = NULL;
    for (int i = 0; i < ps->step.nsends; i++) SMP_ASSERT(ps->step.sends[i].state != SMP__XFER_SENDING);
    ps->step.nsends = 0;
    smp__free(ps->step.send_hdrs);
    ps->step.send_hdrs = NULL;
    for (int i = 0; i < ps->step.m && ps->step.mb; i++) {
        smp__mbstate *st = &ps->step.mb[i];
        bool whole = st->act != NULL;
        for (int s = 0; s < md->nstages && whole; s++)
            if (md->stage_rank[s] == smp__ctx.pp_rank) smp__stage_release(ps, md, s, i);
        for (int e = 0; e < ps->plan.nedges && whole; e++) {
            /* whatever is left: contributions produced here for remote producers */
            const smp__edge *x = &ps->plan.edges[e];
            if (x->remote && md->stage_rank[x->stage] == smp__ctx.pp_rank) smp__free(st->contrib[e].data);
        }
        for (int o = 0; o < md->desc.noutputs && whole; o++) smp__free(st->out_grad[o].data);
        for (int a = 0; a < ps->step.desc->nargs && whole; a++) smp__free(st->arg_copies[a]);
        for (int r = 0; r < SMP_MAX_STEP_ARGS && whole; r++) smp__free(st->returned[r].data);
        smp__free(st->act); /* and the rest of the microbatch's block */
    }
    smp__free(ps->step.mb);
    ps->step.mb = NULL;
}

/* The body's values, from the body's rank to every rank of the replica. */
static smp_status smp__share_outputs(smp__pipe *ps, smp_model *md, smp_step_output *outs, int nouts) {
    int root = md->stage_rank[md->nstages - 1];
    bool mine = smp__ctx.pp_rank == root;
    /* layout: per (output, microbatch): dtype, ndim, shape[8], then the bytes */
    size_t len = 0;
    char *buf = NULL;
    if (mine) {
        for (int pass = 0; pass < 2; pass++) {
            size_t at = 0;
            for (int o = 0; o < nouts; o++)
                for (int i = 0; i < ps->step.m; i++) {
                    const smp_tensor *v = &ps->step.mb[i].returned[o];
                    int64_t h[10] = {v->data ? v->dtype : 0, v->ndim};
                    for (int d = 0; d < v->ndim; d++) h[2 + d] = v->shape[d];
                    size_t b = v->data ? smp_tensor_nbytes(v) : 0;
                    if (pass) { memcpy(buf + at, h, sizeof h); if (b) memcpy(buf + at + sizeof h, v->data, b); }
                    at += sizeof h + b;
                }
            if (!pass) { len = at; buf = (char *)smp__alloc(len + 1, SMP__ALLOC_OTHER); }
            if (!buf) break;
        }
    }
    smp_status st = mine && !buf ? smp__nomem(len, "the step's outputs") : SMP_OK;
    void *p = buf;
    static char failed[1]; /* one byte, shorter than any real layout: the body's rank ran out of memory */
    if (st) { p = failed; len = 1; }
    smp_status sent = smp_broadcast_bytes(&p, &len, root, SMP_PP_GROUP);
    if (st || sent) { smp__free(buf); return st ? st : sent; }
    buf = (char *)p;
    if (len == 1) {
        smp__free(buf);
        return smp_error(SMP_ERR_REMOTE, "mp rank %d had no memory for the step's outputs", root);
    }
    size_t at = 0;
    for (int o = 0; o < nouts; o++) smp_step_output_free(&outs[o]);
    for (int o = 0; o < nouts && !st; o++) {
        outs[o].values = (smp_tensor *)smp__alloc_or(&st, sizeof(smp_tensor) * (size_t)ps->step.m, SMP__ALLOC_OTHER,
                                                     "the step's outputs");
        outs[o].microbatches = st ? 0 : ps->step.m;
        for (int i = 0; i < ps->step.m && !st; i++) {
            int64_t h[10];
            memcpy(h, buf + at, sizeof h);
            at += sizeof h;
            smp_tensor *v = &outs[o].values[i];
            *v = smp_tensor_make(NULL, (smp_dtype)h[0], (int)h[1], h + 2);
            if (!h[0]) { v->ndim = 0; continue; } /* the body returned nothing here */
            size_t b = smp_tensor_nbytes(v);
            if (!(v->data = smp__alloc_or(&st, b, SMP__ALLOC_OTHER | SMP__UNINIT, "the step's outputs"))) break;
            memcpy(v->data, buf + at, b);
            at += b;
        }
    }
    smp__free(buf);
    if (st) {
        for (int o = 0; o < nouts; o++) smp_step_output_free(&outs[o]);
        return st;
    }
    for (int o = 0; o < nouts; o++)
        for (int i = 0; i < ps->step.m; i++)
            if (!outs[o].values[i].data)
                return smp_error(SMP_ERR_ARG, "the step body returned no value %d on microbatch %d (smp_mb_return)", o,
                                 i);
    return SMP_OK;
}

static void smp__notify_failure(smp__pipe *ps) {
    int me = smp__ctx.pp_rank, n = smp__ctx.cfg.partitions;
    for (int r = 0; r < n; r++) {
        if (r == me) continue;
        MPI_Request req;
        /* a peer not told would wait out SMP_TIMEOUT for this rank's messages */
        SMP__MPI_FATAL(MPI_Isend(smp__errbuf, (int)strlen(smp__errbuf) + 1, MPI_CHAR, r, 1, ps->err_comm, &req),
                       "telling mp rank %d the step failed here", r);
        /* small: MPI delivers it eagerly, and the step's drain receives it (smp__drain_messages) */
        SMP__MPI_WARN(MPI_Request_free(&req), "releasing a pipeline failure notice");
        ps->step.msgs_sent[2 * r + 1]++;
    }
}

/* The partition report's last part (rank 0, SMP_VERBOSE=1): what each
   schedule would make of this model, simulated with the traced forward,
   backward-input and backward-weight times of every stage. The stages
   stay as partitioned; a kind that cannot run on their placement runs on
   the nearest it can: zero_bubble_v on the same stages in a V (when there
   are 2 per partition), the others on a V model's stages round robin. */
/* Starts counting the microbatches this rank holds (what active_microbatches caps) for a step of m. */
static smp_status smp__active_begin(smp__pipe *ps, int m) {
    smp_status st = SMP_OK;
    ps->mb_active = 0;
    if (m > ps->mb_held_cap) {
        int *held = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)m, SMP__ALLOC_OTHER | SMP__UNINIT,
                                         "the step's microbatch counts");
        if (st) return st;
        smp__free(ps->mb_held);
        ps->mb_held = held;
        ps->mb_held_cap = m;
    }
    memset(ps->mb_held, 0, sizeof(int) * (size_t)m);
    return st;
}

/* After op ran: a forward brings its microbatch onto the rank, the last op
   a stage runs for it (B, or W in zero-bubble schedules) takes it off. */
static void smp__active_note(smp__pipe *ps, smp_sched_op op) {
    if (!ps->step.training) return;
    int *h = &ps->mb_held[op.microbatch];
    if (op.kind == SMP_SCHED_FORWARD && (*h)++ == 0 && ++ps->mb_active > ps->stats.peak_active_microbatches)
        ps->stats.peak_active_microbatches = ps->mb_active;
    if (op.kind == (ps->step.zb ? SMP_SCHED_WEIGHT : SMP_SCHED_BACKWARD) && --*h == 0) ps->mb_active--;
}

static void smp__schedule_report(const smp_model *md) {
    if (smp__ctx.rank != 0 || !getenv("SMP_VERBOSE")) return;
    int S = md->nstages, m = smp__ctx.cfg.microbatches, P = smp__ctx.cfg.partitions;
    smp_status st = SMP_OK;
    double *cost =
        (double *)smp__alloc_or(&st, sizeof(double) * 3 * (size_t)S, SMP__ALLOC_OTHER, "the schedule report");
    int *map = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)S, SMP__ALLOC_OTHER, "the schedule report");
    if (st) { smp__free(cost); return; } /* a report, not the job's work */
    for (int k = 0; k < md->ncalls; k++)
        for (int h = 0; h < 3; h++) cost[h * S + md->calls[k].stage] += md->calls[k].cost[h];
    bool model_vee = smp__ctx.cfg.pipeline == SMP_PIPELINE_ZERO_BUBBLE_V;
    smp__log(SMP_LOG_INFO,
             "schedules for this model, %d stages x %d microbatches, simulated with the traced per-stage times "
             "(a module without smp_module_set_backward_split has no W: its whole backward is B):",
             S, m);
    static const smp_pipeline_kind kinds[] = {SMP_PIPELINE_SIMPLE, SMP_PIPELINE_INTERLEAVED, SMP_PIPELINE_ZERO_BUBBLE,
                                              SMP_PIPELINE_ZERO_BUBBLE_V};
    for (int q = 0; q < 4; q++) {
        /* the config's names, in smp_pipeline_kind order from 1 */
        const char *name = smp__cfg_pipeline_names[kinds[q] - 1];
        bool vee = kinds[q] == SMP_PIPELINE_ZERO_BUBBLE_V;
        const char *placed = "";
        if (vee == model_vee) memcpy(map, md->stage_rank, sizeof(int) * (size_t)S);
        else if (vee) {
            if (S != 2 * P) {
                smp__log(SMP_LOG_INFO,
                         "  %-13s not simulated: it cuts the model in 2 stages per partition (pipeline zero_bubble_v "
                         "partitions so)",
                         name);
                continue;
            }
            for (int s = 0; s < S; s++) map[s] = smp__vee_partition(s, P);
            placed = "  (these stages in a V)";
        } else {
            for (int s = 0; s < S; s++) map[s] = s % P;
            placed = "  (these stages round robin)";
        }
        smp_schedule sc;
        smp_sim_result r;
        if (smp_schedule_build_capped(kinds[q], P, S, map, m, smp__ctx.cfg.active_microbatches, false, &sc)) {
            smp__log(SMP_LOG_INFO, "  %-13s not simulated: %s", name, smp_last_error());
            continue;
        }
        if (!smp_schedule_simulate(&sc, cost, cost + S, cost + 2 * S, 0.0, &r)) {
            int peak = 0, mbs = 0;
            for (int p = 0; p < sc.nranks; p++) peak = r.rank_peak_inflight[p] > peak ? r.rank_peak_inflight[p] : peak;
            for (int p = 0; p < sc.nranks; p++)
                mbs = r.rank_peak_microbatches[p] > mbs ? r.rank_peak_microbatches[p] : mbs;
            smp__log(SMP_LOG_INFO,
                     "  %-13s step %9.3f ms  bubble %5.1f%%  peak in flight on a rank: %d microbatch-stages, "
                     "%d microbatches%s%s",
                     name, r.makespan * 1e3, 100.0 * r.bubble_fraction, peak, mbs,
                     kinds[q] == smp__ctx.cfg.pipeline ? "  (this run)" : "", placed);
            smp_sim_result_free(&r);
        }
        smp_schedule_free(&sc);
    }
    smp__free(cost);
    smp__free(map);
}

/* ---------------------------------------------------------------- the step's phases
   smp__step reads top to bottom: prepare (nothing to undo when it fails), start gathering the parameters the
   replicas updated (shard_optimizer_state; the forward waits for each bucket before its first reader), begin (the
   step counts), post the receives, run the schedule's operations, drain the sends, finish the shared gradients,
   complete the parameter all-gathers and the buckets, agree, then finish or undo. */

/* The step's arguments, agreed by every rank. */
static smp_status smp__step_check_args(const smp_step_desc *d, const smp_step_output *outs, int nouts) {
    smp_model *md = d->model;
    smp_status st = smp__check_step(d, md, smp__ctx.cfg.microbatches);
    if (!st && (nouts < 0 || nouts > SMP_MAX_STEP_ARGS || (nouts && !outs)))
        st = smp_error(SMP_ERR_ARG, "smp_step: %d outputs requested (0..%d, with an array)", nouts, SMP_MAX_STEP_ARGS);
    if (!st && !d->body && nouts > md->desc.noutputs)
        st = smp_error(SMP_ERR_ARG, "smp_step: %d outputs requested, but with body NULL the step's outputs are the "
                       "model's, and it has %d (ask for at most %d, or give a body that returns more with "
                       "smp_mb_return)", nouts, md->desc.noutputs, md->desc.noutputs);
    return smp__agree_on(smp__ctx.world, st, "step arguments");
}

/* The first step traces the model on its first microbatch. */
static smp_status smp__step_trace(const smp_step_desc *d) {
    smp_model *md = d->model;
    if (md->traced) return SMP_OK;
    smp_status st = SMP_OK;
    smp_tensor sample[SMP_MAX_STEP_ARGS];
    void *copies[SMP_MAX_STEP_ARGS] = {0};
    for (int i = 0; i < md->desc.ninputs; i++) {
        int a = d->nmodel_inputs ? d->model_inputs[i] : i, m = smp__ctx.cfg.microbatches;
        if (d->non_split[a]) sample[i] = d->args[a];
        else if (!st) st = smp__slice(&d->args[a], d->split_axis[a], m, 0, &sample[i], &copies[i], SMP__ALLOC_OTHER);
    }
    st = smp__agree_on(smp__ctx.world, st, "the tracing sample");
    if (!st) st = smp_model_trace(md, sample, md->desc.ninputs);
    for (int i = 0; i < md->desc.ninputs; i++) smp__free(copies[i]);
    return st;
}

/* The first step builds the plan (smp__pipe_build), every rank agreeing it could. */
static smp_status smp__step_plan(smp_model *md) {
    if (md->pipeline) return SMP_OK;
    smp__pipe *built = smp__pipe_build(md);
    smp_status st = smp__agree_on(smp__ctx.world, built ? SMP_OK : SMP_ERR_NOMEM, "the pipeline's set-up");
    if (st) {
        smp__pipe_free(built);
        return st;
    }
    md->pipeline = built;
    md->pipeline_free = smp__pipe_free;
    smp__schedule_report(md);
    return SMP_OK;
}

/* The backend's channels to every pipeline neighbour, made once. */
static smp_status smp__step_connect(smp__pipe *ps) {
    if (!ps->plan.dev_p2p || ps->dev_connected) return SMP_OK;
    smp_status st = SMP_OK;
    int me = smp__ctx.pp_rank, np = 0;
    int *peers = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(ps->plan.nlinks + 1), SMP__ALLOC_OTHER | SMP__UNINIT,
                                      "the pipeline's neighbours");
    for (int l = 0; l < ps->plan.nlinks && !st; l++) {
        const smp__link *k = &ps->plan.links[l];
        int other = k->peer_from == me ? k->peer_to : k->peer_to == me ? k->peer_from : -1;
        bool seen = other < 0;
        for (int q = 0; q < np && !seen; q++) seen = peers[q] == other;
        if (!seen) peers[np++] = other;
    }
    if (!st && np) st = smp__ctx.device.p2p_connect(SMP_PP_GROUP, peers, np);
    smp__free(peers);
    SMP_TRY(smp__agree_on(smp__ctx.world, st, "device point-to-point set-up"));
    ps->dev_connected = true;
    return SMP_OK;
}

/* The first data-parallel step broadcasts the parameters and lays out the buckets. */
static smp_status smp__step_ddp_setup(smp__pipe *ps, smp_model *md) {
    if (smp__ctx.cfg.ddp != SMP_ON || ps->ddp_ready) return SMP_OK;
    SMP_TRY(smp__agree_on(smp__ctx.world, smp__ddp_setup(ps, md), "data-parallel set-up"));
    ps->ddp_ready = true;
    return SMP_OK;
}

/* The schedule of this kind of step, built at the first step of its kind: the same inputs everywhere, but memory
   may fail on one rank. */
static smp_status smp__step_schedule(smp__pipe *ps, smp_model *md, bool training) {
    smp_schedule *sc = &ps->plan.sched[training ? 0 : 1];
    if (sc->ops) return SMP_OK;
    const smp_config *cfg = &smp__ctx.cfg;
    smp_status st =
        smp_schedule_build_capped(cfg->pipeline, cfg->partitions, md->nstages, md->stage_rank, cfg->microbatches,
                                  training ? cfg->active_microbatches : 0, !training, sc);
    st = smp__agree_on(smp__ctx.world, st, "the step's schedule");
    if (st) smp_schedule_free(sc);
    return st;
}

/* Gradients that accumulate on top of the last sync's average (no smp_model_zero_grad since) would be summed dp
   times by the next sync, the loss gradient being the only part divided: a training step divides them first.
   Reduce-scattered gradients need not: each replica holds the average of its piece only, zeros elsewhere. */
static smp_status smp__step_held_grads(smp__pipe *ps, smp_model *md, bool training) {
    if (!training || !ps->averaged_grads_held) return SMP_OK;
    ps->averaged_grads_held = false;
    smp_status st = SMP_OK;
    if (md->zero_grad_calls == ps->zero_calls_at_sync && !ps->plan.scatter)
        st = smp__scale_grads(md, 1.0 / smp_rdp_size());
    return st ? smp__agree_on(smp__ctx.world, st, "gradients kept from the last step") : SMP_OK;
}

/* The gradients a failed step left on top of earlier steps' sums: adding another step's would count part of the
   failed one twice, silently. */
static smp_status smp__step_partial_grads(smp__pipe *ps, smp_model *md, bool training) {
    if (!training || !ps->grads_partial) return SMP_OK;
    if (md->zero_grad_calls != ps->zero_calls_at_train || md->grads_restored) {
        ps->grads_partial = md->grads_restored = false;
        return SMP_OK;
    }
    return smp__agree_on(smp__ctx.world, smp_error(SMP_ERR_STATE,
        "smp_step: the last training step failed after adding part of its gradients to those of the steps before it "
        "(no smp_model_zero_grad in between), and smp cannot take them back: call smp_model_zero_grad and run the "
        "steps whose gradients accumulated again, or put back the gradients saved before the failed step and call "
        "smp_model_grads_restored"), "gradients a failed step left");
}

/* What a step needs before it counts, each piece made once and agreed by every rank: its arguments checked, the
   model traced, the plan built, the device's channels made, the data-parallel buckets laid out, this kind of
   step's schedule built, gradients kept from the last sync divided. A failure here leaves nothing to undo. */
static smp_status smp__step_prepare(const smp_step_desc *d, const smp_step_output *outs, int nouts) {
    if (!d || !d->model) return smp_error(SMP_ERR_ARG, "smp_step: desc and desc->model are required");
    smp_model *md = d->model;
    SMP_TRY(smp__step_check_args(d, outs, nouts));
    SMP_TRY(smp__step_trace(d));
    SMP_TRY(smp__step_plan(md));
    smp__pipe *ps = (smp__pipe *)md->pipeline;
    SMP_TRY(smp__step_connect(ps));
    SMP_TRY(smp__step_ddp_setup(ps, md));
    SMP_TRY(smp__step_schedule(ps, md, !d->evaluate));
    SMP_TRY(smp__step_partial_grads(ps, md, !d->evaluate));
    SMP_TRY(smp__offload_check(md));
    return smp__step_held_grads(ps, md, !d->evaluate);
}

/* The step counts from here (smp__step_undo takes a failed one back): its state, and each microbatch's slice of
   the arguments. */
static smp_status smp__step_begin(smp__pipe *ps, smp_model *md, const smp_step_desc *d, int nouts, double t_start) {
    const smp_config *cfg = &smp__ctx.cfg;
    smp__step_state *now = &ps->step;
    bool training = !d->evaluate;
    int m = cfg->microbatches, n = md->ncalls;
    now->sync = cfg->ddp == SMP_ON && training && (ps->passes + 1) % cfg->backward_passes_per_step == 0;
    if (training) ps->passes++;
    now->grads_were_zero = !ps->grads_dirty || md->zero_grad_calls != ps->zero_calls_at_train;
    now->m = m;
    now->training = training;
    now->sched = &ps->plan.sched[training ? 0 : 1];
    now->zb = training && smp__sched_split(now->sched->kind);
    now->desc = d;
    now->model_outs = d->body ? 0 : nouts;
    now->failed_remote = false;
    now->t_start = t_start;
    /* and stage_index, inflight, the transfer counts */
    memset(ps->peak, 0, sizeof(int) * (size_t)(3 * md->nstages + 5 * cfg->partitions));
    memset(&ps->stats, 0, sizeof ps->stats);
    now->stash_at_start = smp__ctx.mem.stash_bytes;
    smp__ctx.mem.stash_peak_bytes = smp__ctx.mem.stash_bytes;
    smp_status st = SMP_OK;
    const char *what = "the step's microbatch state";
    now->mb = (smp__mbstate *)smp__alloc_or(&st, sizeof(smp__mbstate) * (size_t)m, SMP__ALLOC_OTHER, what);
    size_t nt = (size_t)n * (size_t)ps->plan.maxout, ne = (size_t)ps->plan.nedges;
    size_t no = (size_t)md->desc.noutputs, na = (size_t)d->nargs;
    for (int i = 0; i < m && !st; i++) {
        smp__mbstate *s = &now->mb[i];
        s->act = (smp_tensor *)smp__alloc_or(&st, sizeof(smp_tensor) * (nt + ne + no + na + SMP_MAX_STEP_ARGS) +
                                             sizeof(smp_call_ctx) * (size_t)n + sizeof(void *) * na,
                                             SMP__ALLOC_OTHER, what);
        if (st) break;
        s->contrib = s->act + nt;
        s->out_grad = s->contrib + ne;
        s->args = s->out_grad + no;
        s->returned = s->args + na;
        s->ctx = (smp_call_ctx *)(void *)(s->returned + SMP_MAX_STEP_ARGS);
        s->arg_copies = (void **)(void *)(s->ctx + n);
        for (int a = 0; a < d->nargs && !st; a++)
            if (d->non_split[a]) s->args[a] = d->args[a];
            else st = smp__slice(&d->args[a], d->split_axis[a], m, i, &s->args[a], &s->arg_copies[a], SMP__ALLOC_OTHER);
    }
    /* deterministic_reduction: what each host bucket gathers, taken now, where a failure fails the step on every
       rank; once the bucket's collective has started, the other replicas are in it and a failure aborts */
    bool gathers = now->sync && cfg->deterministic_reduction == SMP_ON && smp_rdp_size() > 1;
    for (int b = 0; gathers && b < ps->plan.nbuckets && !st; b++) {
        smp__bucket *k = &ps->plan.buckets[b];
        if (k->device != SMP_HOST) continue;
        size_t bytes = ps->plan.scatter ? k->bytes : k->bytes * (size_t)smp_rdp_size();
        k->gather =
            smp__alloc_or(&st, bytes + 1, SMP__ALLOC_COMM | SMP__UNINIT, "gathering a data-parallel gradient bucket");
    }
    return st;
}

/* Every receive of the step, posted up front in the order of this rank's operations. */
static smp_status smp__step_post_receives(smp__pipe *ps) {
    smp__step_state *now = &ps->step;
    int me = smp__ctx.pp_rank;
    smp_status st = SMP_OK;
    size_t nrecv = (size_t)ps->plan.nlinks * (size_t)now->m * 2;
    const char *what = "the step's microbatch state";
    now->recv = (smp__xfer *)smp__alloc_or(&st, sizeof(smp__xfer) * nrecv + sizeof(int) * 2 * (size_t)ps->plan.nlinks,
                                           SMP__ALLOC_OTHER, what);
    now->recv_front = now->recv ? (int *)(void *)(now->recv + nrecv) : NULL;
    /* the sends' headers, and room for every send of the step, the shared gradients' too: neither depends on when
       sends complete */
    int most = 0;
    for (int l = 0; l < ps->plan.nlinks; l++) {
        if (ps->plan.links[l].ntensors > most) most = ps->plan.links[l].ntensors;
        if (ps->plan.links[l].nedges > most) most = ps->plan.links[l].nedges;
    }
    now->send_hdr_words = SMP__HDR_WORDS(most);
    now->send_hdrs = (int64_t *)smp__alloc_or(&st, sizeof(int64_t) * nrecv * (size_t)now->send_hdr_words + 1,
                                              SMP__ALLOC_OTHER | SMP__UNINIT, what);
    int most_sends = (int)nrecv + 2 * smp__ctx.cfg.partitions;
    smp__grow_or(&st, (void **)&now->sends, &now->sends_cap, most_sends, sizeof(smp__xfer), what);
    if (!ps->recv_pool) /* made by the first step */
        ps->recv_pool = (smp__cache **)smp__alloc_or(&st, sizeof(smp__cache *) * (size_t)(2 * ps->plan.nlinks + 1),
                                                     SMP__ALLOC_OTHER, what);
    for (int i = 0; i < 2 * ps->plan.nlinks && !st; i++)
        if (!ps->recv_pool[i] && !(ps->recv_pool[i] = smp__cache_new()))
            st = smp__nomem(sizeof(smp__cache), "a pool of received messages");
    const smp_sched_op *ops = now->sched->ops[me];
    for (int o = 0; o < now->sched->nops[me] && !st; o++) {
        if (ops[o].kind == SMP_SCHED_WEIGHT) continue; /* receives nothing */
        bool bwd = ops[o].kind == SMP_SCHED_BACKWARD;
        for (int l = 0; l < ps->plan.nlinks && !st; l++) {
            const smp__link *k = &ps->plan.links[l];
            if ((bwd ? k->from : k->to) == ops[o].stage) st = smp__post_recv(ps, l, ops[o].microbatch, bwd);
        }
    }
    return st;
}

/* This rank's operations of the step's schedule, in order. */
static smp_status smp__step_run_ops(smp__pipe *ps, smp_model *md) {
    const smp_schedule *sc = ps->step.sched;
    int me = smp__ctx.pp_rank, *peak = ps->peak;
    const smp_sched_op *ops = sc->ops[me];
    smp_status st = SMP_OK;
    for (int o = 0; o < sc->nops[me] && !st; o++) {
        int s = ops[o].stage, i = ops[o].microbatch;
        smp__ctx.at.op = "FBW"[ops[o].kind];
        smp__ctx.at.stage = s;
        smp__ctx.at.microbatch = i;
        if (ps->offloading && (st = smp__offload_progress(ps, o))) break;
        /* shard_optimizer_state: the forward waits per call; the buckets no local call reads before the first
           forward; all of them before a backward */
        if (ps->step.params_gathering)
            st = ops[o].kind == SMP_SCHED_FORWARD ? smp__params_ready(ps, md, md->ncalls) : smp__params_complete(ps, md);
        if (st) break;
        if (ops[o].kind == SMP_SCHED_FORWARD) {
            st = smp__stage_forward(ps, md, s, i);
            if (!st && s == md->nstages - 1) { /* the body's stage: the model's outputs */
                smp__ctx.at.op = 'L';
                if (ps->step.params_gathering) st = smp__params_complete(ps, md); /* the body is the engine's code */
                if (!st) st = smp__run_body(ps, md, i);
            }
            if (!st) st = smp__offload_stage(ps, md, s, i, o);
            if (ps->step.inflight[s] > peak[s]) peak[s] = ps->step.inflight[s];
        } else if (ops[o].kind == SMP_SCHED_BACKWARD) {
            st = smp__offload_ready(ps, s, i);
            if (!st) st = smp__stage_backward(ps, md, s, i);
            if (!st && !ps->step.zb) smp__stage_release(ps, md, s, i);
        } else {
            st = smp__stage_weight(ps, md, s, i);
            if (!st) smp__stage_release(ps, md, s, i);
        }
        if (!st) smp__active_note(ps, ops[o]);
    }
    smp__ctx.at.op = 0;
    return st;
}

/* The last sends must land before their buffers go. */
static smp_status smp__step_drain_sends(smp__pipe *ps) {
    smp_status st = SMP_OK;
    smp__backoff b = smp__backoff_start();
    while (ps->step.nsends && !st) {
        st = smp__progress(ps);
        if (!st && ps->step.nsends && !smp__backoff_pause(&b))
            smp__timeout_abort("pipeline sends to be received", SMP_PP_GROUP, ps->step.sends[0].peer,
                               smp__now() - b.start);
    }
    return st;
}

/* The step's statistics (smp_last_step_stats), before its state goes. */
static void smp__step_stats(smp__pipe *ps, smp_model *md) {
    int *peak = ps->peak;
    ps->stats.local_stages = 0;
    for (int s = 0; s < md->nstages; s++)
        if (md->stage_rank[s] == smp__ctx.pp_rank) {
            ps->stage_index[ps->stats.local_stages] = s;
            peak[ps->stats.local_stages++] = peak[s]; /* in place: the entry written never lies ahead of the one read */
        }
    ps->stats.peak_inflight = peak;
    ps->stats.stage_index = ps->stage_index;
    ps->stats.stash_peak_bytes = smp__ctx.mem.stash_peak_bytes - ps->step.stash_at_start;
}

/* A step every rank agreed worked: the data-parallel sums, the body's values to every rank of the replica, the
   statistics. */
static smp_status smp__step_finish(smp__pipe *ps, smp_model *md, smp_step_output *outs, int nouts) {
    smp_status finished = ps->step.sync ? smp__ddp_finish(ps, false) : SMP_OK;
    /* the engine updates its range next */
    if (ps->step.training && smp__ctx.cfg.shard_optimizer_state == SMP_ON) md->params_stale = true;
    smp_status st = nouts ? smp__share_outputs(ps, md, outs, nouts) : SMP_OK;
    if (!st) st = finished;
    if (ps->step.sync && smp_rdp_size() > 1) {
        ps->averaged_grads_held = true;
        ps->zero_calls_at_sync = md->zero_grad_calls;
    }
    if (ps->step.training) {
        ps->grads_dirty = true;
        ps->zero_calls_at_train = md->zero_grad_calls;
    }
    smp__step_stats(ps, md);
    smp__release_step(ps, md);
    st = smp__agree_on(smp__ctx.world, st, "step outputs");
    ps->stats.seconds = smp__now() - ps->step.t_start;
    return st;
}

/* Takes back a step every rank agreed failed; the one place that does. The bucket collectives have completed:
   their result is dropped. The step does not count: run again, it draws the same seeds. Every transfer it
   started finishes and every message it sent is received, so the next step runs on the same communicators.
   What it made goes. Gradients it added into are zeroed again where they were zero; otherwise they hold part of
   its sums on top of earlier steps', and the next training step refuses them (smp__step_partial_grads). */
static smp_status smp__step_undo(smp__pipe *ps, smp_model *md, smp_status agreed) {
    if (ps->step.sync) (void)smp__ddp_finish(ps, true);
    smp__tp_step_settle();
    bool training = ps->step.training, were_zero = ps->step.grads_were_zero;
    if (training) ps->passes--;
    if (ps->plan.dev_p2p) smp__drain_device(ps);
    smp__drain_messages(ps);
    smp__release_step(ps, md);
    if (training && were_zero) { /* last: the clean-up above may still complete a backward's sums */
        smp_model_zero_grad(md);
        ps->grads_dirty = false;
    } else if (training) {
        ps->grads_partial = true;
        md->grads_restored = false;
        ps->zero_calls_at_train = md->zero_grad_calls;
    }
    return agreed;
}

static smp_status smp__step(const smp_step_desc *d, smp_step_output *outs, int nouts, double t_start);

/* ---------------------------------------------------------------- prescaled_batch false
   Each rank of a TP group passed its own examples: the step runs on the group's batches joined along each split
   argument's batch axis in tp-rank order, exactly the step every rank would run with prescaled_batch true had it
   passed the joined batch. What a rank's step looks like to its peers, compared before any data moves: the count
   of arguments, then per argument its batch axis (-1: not split, and nothing more), whether it is on a device
   (each rank drives its own), its dtype, ndim and shape. */
enum { SMP__JOIN_ARG_WORDS = 4 + SMP_MAX_DIMS, SMP__JOIN_WORDS = 1 + SMP_MAX_STEP_ARGS * SMP__JOIN_ARG_WORDS };

static void smp__join_describe(const smp_step_desc *d, int64_t *w) {
    memset(w, 0, sizeof(int64_t) * SMP__JOIN_WORDS);
    w[0] = d->nargs;
    for (int a = 0; a < d->nargs; a++) {
        int64_t *x = w + 1 + a * SMP__JOIN_ARG_WORDS;
        const smp_tensor *t = &d->args[a];
        x[0] = d->non_split[a] ? -1 : d->split_axis[a];
        if (d->non_split[a]) continue;
        x[1] = t->device != SMP_HOST;
        x[2] = t->dtype;
        x[3] = t->ndim;
        memcpy(x + 4, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    }
}

/* "split along axis 0 on the host" or "not split" into buf; returns buf. */
static const char *smp__join_arg_text(const int64_t *x, char *buf, size_t cap) {
    if (x[0] < 0) snprintf(buf, cap, "not split (non_split)");
    else snprintf(buf, cap, "split along axis %lld %s", (long long)x[0], x[1] ? "on a CUDA device" : "on the host");
    return buf;
}

/* The verdict on the TP group's descriptions (`all`, tp of them), the same on each of its ranks. */
static smp_status smp__join_compare(const int64_t *all, int tp) {
    static const char fix[] = "with prescaled_batch false every rank of a TP group passes the same number of examples "
                              "with the same shape and dtype, and smp joins them in tp-rank order: shard the data "
                              "evenly by smp_dp_rank over smp_dp_size (drop_last), or set \"prescaled_batch\": true "
                              "and give every rank of the group the same batch";
    int w0 = smp_group_world_rank(SMP_TP_GROUP, 0);
    for (int r = 1; r < tp; r++) {
        const int64_t *b = all + (size_t)r * SMP__JOIN_WORDS;
        int wr = smp_group_world_rank(SMP_TP_GROUP, r);
        if (all[0] != b[0])
            return smp_error(SMP_ERR_ARG,
                             "smp_step: tp rank 0 (world rank %d) passes %lld arguments, tp rank %d (world rank %d) "
                             "%lld: %s", w0, (long long)all[0], r, wr, (long long)b[0], fix);
        for (int a = 0; a < all[0]; a++) {
            const int64_t *x = all + 1 + a * SMP__JOIN_ARG_WORDS, *y = b + 1 + a * SMP__JOIN_ARG_WORDS;
            if (!memcmp(x, y, sizeof(int64_t) * SMP__JOIN_ARG_WORDS)) continue;
            char t0[96], tr[96];
            if (x[0] != y[0] || x[1] != y[1])
                return smp_error(SMP_ERR_ARG, "smp_step: argument %d is %s on tp rank 0 (world rank %d) but %s on "
                                 "tp rank %d (world rank %d): %s", a, smp__join_arg_text(x, t0, sizeof t0), w0,
                                 smp__join_arg_text(y, tr, sizeof tr), r, wr, fix);
            smp_tensor s0 = smp_tensor_make(NULL, (smp_dtype)x[2], (int)x[3], x + 4);
            smp_tensor sr = smp_tensor_make(NULL, (smp_dtype)y[2], (int)y[3], y + 4);
            return smp_error(SMP_ERR_ARG, "smp_step: argument %d (batch axis %lld) is %s on tp rank 0 (world rank "
                             "%d) but %s on tp rank %d (world rank %d): %s", a, (long long)x[0],
                             smp__tensor_describe(&s0, t0, sizeof t0), w0, smp__tensor_describe(&sr, tr, sizeof tr),
                             r, wr, fix);
        }
    }
    return SMP_OK;
}

/* Whether the joined batch divides into microbatches, asked of the batch this rank passed (the group's ranks
   pass the same shapes, smp__join_compare says): the user chose that batch, not the joined one. */
static smp_status smp__join_divides(const smp_step_desc *d, int tp) {
    int m = smp__ctx.cfg.microbatches;
    for (int a = 0; a < d->nargs; a++) {
        if (d->non_split[a]) continue;
        int64_t n = d->args[a].shape[d->split_axis[a]];
        if (n * tp % m == 0) continue;
        int step = 1; /* the least batch per rank whose join divides: its multiples are the ones that do */
        while (step * tp % m) step++;
        return smp_error(SMP_ERR_ARG, "smp_step: this rank's batch of %lld (argument %d, axis %d), joined over the "
                         "TP group of %d ranks into %lld (prescaled_batch false), does not divide into %d "
                         "microbatches: pass each rank a batch that is a multiple of %d, or set microbatches to a "
                         "divisor of %lld", (long long)n, a, d->split_axis[a], tp, (long long)(n * tp), m, step,
                         (long long)(n * tp));
    }
    return SMP_OK;
}

/* `joined`: d with each split argument replaced by the TP group's joined batch, from the model's cache. Every
   rank agrees before data moves (its own arguments, the memory) and after (the group's descriptions, the
   gathers). Whatever the outcome, the caller frees what joined holds that d does not. */
static smp_status smp__step_join(const smp_step_desc *d, smp_step_desc *joined) {
    smp_model *md = d->model;
    int tp = smp_tp_size();
    *joined = *d;
    smp__cache *was = smp__cache_use(md->cache);
    /* what a rank checks alone; whether the joined batch divides into microbatches waits for the group's shapes */
    smp_status st = smp__check_step(d, md, 1);
    int64_t *all = st ? NULL
                      : (int64_t *)smp__alloc_or(&st, sizeof(int64_t) * SMP__JOIN_WORDS * (size_t)(tp + 1),
                                                 SMP__ALLOC_COMM | SMP__UNINIT, "comparing the TP group's batches");
    void *scratch[SMP_MAX_STEP_ARGS] = {0};
    const char *what = "the TP group's joined batch (prescaled_batch false)";
    for (int a = 0; a < d->nargs && !st; a++) {
        if (d->non_split[a]) continue;
        smp_tensor *t = &joined->args[a];
        int drives = t->device != SMP_HOST ? smp__ctx.device.current_device() : SMP_HOST;
        if (t->device != drives) /* the joined batch is on this rank's device; a gather would fail here alone */
            st = smp_error(SMP_ERR_ARG, "smp_step: argument %d is on CUDA device %d, but this rank drives device %d",
                           a, SMP_CUDA_ORDINAL(t->device), SMP_CUDA_ORDINAL(drives));
        int64_t outer, inner;
        smp__around_axis(t, d->split_axis[a], &outer, &inner);
        t->shape[d->split_axis[a]] *= tp;
        smp__tensor_alloc_or(&st, t, t->device != SMP_HOST, SMP__ALLOC_COMM, what);
        if (outer > 1) { /* smp__tp_gather's: the ranks' blocks as they arrive */
            smp_tensor s = *t;
            scratch[a] = smp__tensor_alloc_or(&st, &s, t->device != SMP_HOST, SMP__ALLOC_COMM, what);
        }
    }
    st = smp__agree_on(smp__ctx.world, st, "the TP group's batches (prescaled_batch false)");
    if (!st) {
        smp__join_describe(d, all + (size_t)tp * SMP__JOIN_WORDS);
        smp_tensor mine = smp_tensor_1d(all + (size_t)tp * SMP__JOIN_WORDS, SMP_I64, SMP__JOIN_WORDS),
                   every = smp_tensor_1d(all, SMP_I64, (int64_t)tp * SMP__JOIN_WORDS);
        smp__tph.in_module = true; /* the agreement above stands for the TP handshake of each collective */
        st = smp_all_gather(&mine, &every, SMP_TP_GROUP);
        if (!st) st = smp__join_compare(all, tp); /* so each rank of the group gathers, or none */
        if (!st) st = smp__join_divides(d, tp);
        for (int a = 0; a < d->nargs && !st; a++)
            if (!d->non_split[a]) st = smp__tp_gather(&d->args[a], &joined->args[a], d->split_axis[a], scratch[a]);
        smp__tph.in_module = false;
        st = smp__agree_on(smp__ctx.world, st, "the TP group's batches (prescaled_batch false)");
    }
    for (int a = 0; a < SMP_MAX_STEP_ARGS; a++) smp__free(scratch[a]);
    smp__free(all);
    smp__cache_use(was);
    return st;
}

/* The step on the joined batch; its memory goes back to the model's cache after it, failed or not. */
static smp_status smp__step_joined(const smp_step_desc *d, smp_step_output *outs, int nouts, double t_start) {
    smp_step_desc joined;
    smp_status st = smp__step_join(d, &joined);
    if (!st) st = smp__step(&joined, outs, nouts, t_start);
    for (int a = 0; a < d->nargs && a < SMP_MAX_STEP_ARGS; a++)
        if (joined.args[a].data != d->args[a].data) smp__free(joined.args[a].data);
    return st;
}

SMPDEF smp_status smp_step(const smp_step_desc *d, smp_step_output *outs, int nouts) {
    smp__ctx.at.steps++; /* where this rank is, should it exit (smp__exit_guard) */
    smp__ctx.at.in_step = true;
    smp__tp_step_begin();
    bool join = smp__ctx.initialized && d && d->model && smp__ctx.cfg.prescaled_batch == SMP_OFF && smp_tp_size() > 1;
    double t_start = smp__ctx.initialized ? smp__now() : 0; /* the statistics' time is the whole call's, join too */
    smp_status st = join ? smp__step_joined(d, outs, nouts, t_start) : smp__step(d, outs, nouts, t_start);
    smp__cache_now = NULL;
    smp__ctx.at.in_step = false;
    smp__ctx.at.op = 0;
    return st;
}

static smp_status smp__step(const smp_step_desc *d, smp_step_output *outs, int nouts, double t_start) {
    SMP_TRY(smp__require_init("smp_step"));
    SMP_TRY(smp__step_prepare(d, outs, nouts));
    smp_model *md = d->model;
    smp__pipe *ps = (smp__pipe *)md->pipeline;
    smp__cache_now = md->cache; /* what the step allocates from here is the model's to reuse */
    SMP_TRY(smp__step_gather_start(ps, md));
    smp_status st = smp__step_begin(ps, md, d, nouts, t_start);
    if (!st) st = smp__step_post_receives(ps);
    if (!st) st = smp__active_begin(ps, ps->step.m);
    if (!st) st = smp__offload_begin(ps, md);
    if (!st && ps->step.training && ps->plan.nshared) st = smp__shared_start(ps);
    if (!st) st = smp__step_run_ops(ps, md);
    if (!st) st = smp__step_drain_sends(ps);
    if (!st && ps->step.training && ps->plan.nshared) st = smp__shared_finish(ps, md); /* before the buckets */
    if (!st && smp__injected(SMP_FAULT_STEP_END))
        st = smp_error(SMP_ERR_MPI, "a failure injected after the step's last message");
    if (st && !ps->step.failed_remote) smp__notify_failure(ps);
    if (st) smp__tp_step_stopped(st); /* its TP peers may wait in a TP module's handshake */
    /* every replica completes the parameter all-gathers and runs the bucket collectives, failed step or not; they
       complete before the agreement, whose wait backs off into sleeps and would stall the collectives in flight */
    smp_status gathered = smp__params_complete(ps, md);
    if (!st) st = gathered;
    smp_status buckets = ps->step.sync ? smp__ddp_complete(ps) : SMP_OK;
    if (!st) st = buckets;
    smp_status agreed = smp__agree_on(smp__ctx.world, st, "the step");
    return agreed ? smp__step_undo(ps, md, agreed) : smp__step_finish(ps, md, outs, nouts);
}

SMPDEF smp_step_stats smp_last_step_stats(const smp_model *m) {
    smp_step_stats z;
    memset(&z, 0, sizeof z);
    return m->pipeline ? ((smp__pipe *)m->pipeline)->stats : z;
}

/* ---------------------------------------------------------------- StepOutput */
static smp_status smp__reduce_check(const smp_step_output *o, const smp_tensor *r, const char *fn, int64_t want) {
    if (!o || !o->values || o->microbatches < 1) return smp_error(SMP_ERR_ARG, "%s: the StepOutput is empty", fn);
    SMP_TRY(smp__check_tensor(r, fn, "result"));
    if (r->device != SMP_HOST)
        return smp_error(SMP_ERR_ARG, "%s: result is on a CUDA device; StepOutputs are host memory", fn);
    for (int i = 0; i < o->microbatches; i++) {
        if (o->values[i].dtype != r->dtype)
            return smp_error(SMP_ERR_ARG, "%s: microbatch %d's value is %s, the result is %s", fn, i,
                             smp_dtype_name(o->values[i].dtype), smp_dtype_name(r->dtype));
        if (want >= 0 && smp_tensor_numel(&o->values[i]) != want)
            return smp_error(SMP_ERR_ARG, "%s: microbatch %d's value has %lld elements, the result %lld", fn, i,
                             (long long)smp_tensor_numel(&o->values[i]), (long long)want);
    }
    return SMP_OK;
}

static smp_status smp__reduce_out(const smp_step_output *o, smp_tensor *r, bool mean, const char *fn) {
    SMP_TRY(smp__reduce_check(o, r, fn, r ? smp_tensor_numel(r) : 0));
    if (r->dtype != SMP_F32 && r->dtype != SMP_F64)
        return smp_error(SMP_ERR_ARG, "%s: reduces f32 and f64 values, not %s", fn, smp_dtype_name(r->dtype));
    int64_t n = smp_tensor_numel(r);
    for (int64_t x = 0; x < n; x++) {
        double acc = 0;
        for (int i = 0; i < o->microbatches; i++)
            acc += r->dtype == SMP_F32 ? (double)((const float *)o->values[i].data)[x]
                                       : ((const double *)o->values[i].data)[x];
        if (mean) acc /= o->microbatches;
        if (r->dtype == SMP_F32) ((float *)r->data)[x] = (float)acc;
        else ((double *)r->data)[x] = acc;
    }
    return SMP_OK;
}
SMPDEF smp_status smp_step_output_reduce_mean(const smp_step_output *o, smp_tensor *r) {
    return smp__reduce_out(o, r, true, "smp_step_output_reduce_mean");
}
SMPDEF smp_status smp_step_output_reduce_sum(const smp_step_output *o, smp_tensor *r) {
    return smp__reduce_out(o, r, false, "smp_step_output_reduce_sum");
}

static smp_status smp__join_out(const smp_step_output *o, smp_tensor *r, bool stack, const char *fn) {
    SMP_TRY(smp__reduce_check(o, r, fn, -1));
    int64_t total = 0;
    for (int i = 0; i < o->microbatches; i++) total += smp_tensor_numel(&o->values[i]);
    if (total != smp_tensor_numel(r))
        return smp_error(SMP_ERR_ARG, "%s: the microbatches hold %lld elements, the result has room for %lld", fn,
                         (long long)total, (long long)smp_tensor_numel(r));
    if (!stack && o->values[0].ndim == 0)
        return smp_error(SMP_ERR_ARG, "%s: scalars have no axis to concatenate along; use stack", fn);
    char *dst = (char *)r->data;
    for (int i = 0; i < o->microbatches; i++) {
        size_t b = smp_tensor_nbytes(&o->values[i]);
        memcpy(dst, o->values[i].data, b);
        dst += b;
    }
    return SMP_OK;
}
SMPDEF smp_status smp_step_output_concat(const smp_step_output *o, smp_tensor *r) {
    return smp__join_out(o, r, false, "smp_step_output_concat");
}
SMPDEF smp_status smp_step_output_stack(const smp_step_output *o, smp_tensor *r) {
    return smp__join_out(o, r, true, "smp_step_output_stack");
}
SMPDEF double smp_step_output_reduce_mean_f64(const smp_step_output *o) {
    if (!o || o->microbatches < 1) return (double)NAN;
    double acc = 0;
    for (int i = 0; i < o->microbatches; i++) {
        const smp_tensor *v = &o->values[i];
        acc += v->dtype == SMP_F64   ? ((const double *)v->data)[0]
               : v->dtype == SMP_F32 ? (double)((const float *)v->data)[0]
                                     : (double)NAN;
    }
    return acc / o->microbatches;
}
/* Each member's n doubles mine[0..n) averaged over the DP_GROUP into out, in dp-rank order. */
static smp_status smp__dp_mean(const double *mine, int64_t n, double *out, const char *fn) {
    int dp = smp_rdp_size();
    smp_status st = SMP_OK;
    double *all = (double *)smp__alloc_or(&st, sizeof(double) * (size_t)(n * dp), SMP__ALLOC_OTHER | SMP__UNINIT, fn);
    st = smp__agree_on(smp__ctx.groups[SMP_RDP_GROUP].comm, st, fn);
    smp_tensor in = smp_tensor_1d((void *)(uintptr_t)mine, SMP_F64, n), every = smp_tensor_1d(all, SMP_F64, n * dp);
    if (!st) st = smp_all_gather(&in, &every, SMP_RDP_GROUP);
    for (int64_t x = 0; x < n && !st; x++) {
        double acc = all[x];
        for (int r = 1; r < dp; r++) acc += all[(int64_t)r * n + x];
        out[x] = acc / dp;
    }
    smp__free(all);
    return st;
}
SMPDEF smp_status smp_step_output_reduce_mean_global(const smp_step_output *o, smp_tensor *r) {
    const char *fn = "smp_step_output_reduce_mean_global";
    SMP_TRY(smp__require_init(fn));
    int64_t n = r ? smp_tensor_numel(r) : 0;
    smp_status st = smp__reduce_check(o, r, fn, n);
    if (!st && r->dtype != SMP_F32 && r->dtype != SMP_F64)
        st = smp_error(SMP_ERR_ARG, "%s: reduces f32 and f64 values, not %s", fn, smp_dtype_name(r->dtype));
    double *mean = (double *)smp__alloc_or(&st, sizeof(double) * (size_t)(2 * n), SMP__ALLOC_OTHER | SMP__UNINIT, fn);
    for (int64_t x = 0; x < n && !st; x++) {
        double acc = 0;
        for (int i = 0; i < o->microbatches; i++)
            acc += r->dtype == SMP_F32 ? (double)((const float *)o->values[i].data)[x]
                                       : ((const double *)o->values[i].data)[x];
        mean[x] = acc / o->microbatches;
    }
    st = smp__agree_on(smp__ctx.groups[SMP_RDP_GROUP].comm, st, fn); /* so that no member waits for one that failed */
    if (!st) st = smp__dp_mean(mean, n, mean + n, fn);
    for (int64_t x = 0; x < n && !st; x++) {
        if (r->dtype == SMP_F32) ((float *)r->data)[x] = (float)mean[n + x];
        else ((double *)r->data)[x] = mean[n + x];
    }
    smp__free(mean);
    return st;
}
SMPDEF double smp_step_output_reduce_mean_global_f64(const smp_step_output *o) {
    double mine = smp_step_output_reduce_mean_f64(o), mean = (double)NAN;
    if (smp__require_init("smp_step_output_reduce_mean_global_f64")) return mean;
    return smp__dp_mean(&mine, 1, &mean, "smp_step_output_reduce_mean_global_f64") ? (double)NAN : mean;
}
SMPDEF void smp_step_output_free(smp_step_output *o) {
    if (!o || !o->values) return;
    for (int i = 0; i < o->microbatches; i++) smp__free(o->values[i].data);
    smp__free(o->values);
    memset(o, 0, sizeof *o);
}

/* ---------------------------------------------------------------- timeline */
static smp_status smp__timeline_write(smp__pipe *ps) {
    const char *path = getenv("SMP_TIMELINE");
    if (!path || !*path) return SMP_OK;
    smp__sbuf mine;
    memset(&mine, 0, sizeof mine);
    static const char *names[] = {"forward", "backward", "wait", "body", "allreduce", "send", "weight", "allgather"};
    static const int track[] = {0, 0, 1, 0, 2, 3, 0, 4}; /* waits, bucket collectives and sends overlap the compute */
    for (int e = 0; ps && e < ps->nevents; e++) {
        smp__event *ev = &ps->events[e];
        if (ev->kind == SMP__EVENT_ALLREDUCE || ev->kind == SMP__EVENT_GATHER) { /* on tracks of their own */
            smp__sbuf_printf(&mine,
                             "%s{\"name\":\"%s "
                             "b%d\",\"cat\":\"%s\",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":%d,\"tid\":%d,"
                             "\"args\":{\"bucket\":%d,\"bytes\":%zu}}",
                             mine.len ? "," : "", ev->kind == SMP__EVENT_GATHER ? "AG" : "AR", ev->mb, names[ev->kind],
                             ev->t0 * 1e6, (ev->t1 - ev->t0) * 1e6, smp__ctx.rank, track[ev->kind], ev->mb,
                             ps->plan.buckets[ev->mb].bytes);
            continue;
        }
        smp__sbuf_printf(&mine,
                         "%s{\"name\":\"%c%d "
                         "s%d\",\"cat\":\"%s\",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":%d,\"tid\":%d,\"args\":{"
                         "\"stage\":%d,\"microbatch\":%d}}",
                         mine.len ? "," : "", "FBRL SW"[ev->kind], ev -> mb, ev -> stage, names[ev->kind],
                         ev -> t0 * 1e6, (ev->t1 - ev->t0) * 1e6, smp__ctx.rank, track[ev->kind], ev->stage, ev->mb);
    }
    int n = smp__ctx.size;
    /* a rank out of memory still takes part in the gather, with nothing */
    smp_status st = mine.oom ? smp__nomem(mine.want, "the timeline's events") : SMP_OK;
    size_t *lens = (size_t *)smp__alloc(sizeof(size_t) * (size_t)n, SMP__ALLOC_OTHER);
    if (!lens)
        smp__fatal("out of memory: %zu bytes for the timeline's lengths on rank %d, which the other ranks wait on",
                   sizeof(size_t) * (size_t)n, smp__ctx.rank);
    void *all = NULL;
    smp_status gst = smp_all_gather_bytes(st ? NULL : mine.p, st ? 0 : mine.len, SMP_WORLD, &all, lens);
    if (!st) st = gst;
    smp__free(mine.p);
    if (!st && smp__ctx.rank == 0) {
        FILE *f = fopen(path, "w");
        if (!f) st = smp_error(SMP_ERR_IO, "SMP_TIMELINE: cannot write %s: %s", path, strerror(errno));
        else {
            fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[", f);
            size_t at = 0;
            bool first = true;
            for (int r = 0; r < n; r++) {
                if (lens[r]) { if (!first) fputc(',', f); fwrite((char *)all + at, 1, lens[r], f); first = false; }
                at += lens[r];
            }
            for (int r = 0; r < n; r++)
                fprintf(f, "%s{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}",
                        first && r == 0 ? "" : ",", r, r);
            fputs("]}\n", f);
            if (fclose(f)) st = smp_error(SMP_ERR_IO, "SMP_TIMELINE: writing %s failed", path);
        }
    }
    smp__free(all);
    smp__free(lens);
    return smp__agree_on(smp__ctx.world, st, "timeline");
}

#endif /* SMP_PIPELINE_IMPLEMENTED */
#endif /* SMP_IMPLEMENTATION */
