/* smp_nccl.h - the device backend of smp: CUDA tensors over NCCL.

   Tensors whose `device` is a CUDA ordinal move over NCCL on a stream the
   runtime owns; host tensors keep moving over MPI. Ranks that share a GPU
   (which NCCL refuses) move device memory through pinned host buffers with
   smp's MPI collectives instead, with the same semantics.

   USAGE
     Include it after smp.h in the file that defines SMP_IMPLEMENTATION.
     That registers the backend before main() runs (a constructor function),
     so smp_init starts it; nothing else is needed. Other files include it
     for the declarations. To register by hand instead, define
     SMP_NCCL_NO_AUTO_REGISTER and call smp_nccl_register() before smp_init.

   THE SMALLEST PROGRAM (prog.cu)
         #define SMP_IMPLEMENTATION
         #include "smp.h"
         #include "smp_nccl.h"
         int main(void) {
             smp_config cfg = {};                       // C: = {0}
             cfg.ddp = SMP_ON;                          // every rank a data-parallel replica
             if (smp_init(&cfg) != SMP_OK) return 1;    // picks the GPU, see DEVICES
             float h[4] = {1, 2, 3, 4}, *d;
             cudaMalloc((void **)&d, sizeof h);
             cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice);
             smp_tensor t = smp_tensor_1d(d, SMP_F32, 4);
             t.device = smp_nccl_device();
             smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD);  // on the default stream
             cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);  // the sums
             cudaFree(d);
             smp_finalize();
         }
     Build: nvcc -ccbin mpicxx -O2 prog.cu -o prog -lnccl
        or: nvcc -O2 prog.cu -o prog -DMPICH_SKIP_MPICXX -DOMPI_SKIP_MPICXX \
                 $(mpicc -show | tr ' ' '\n' | grep -E '^-[ILl]' | tr '\n' ' ') -lnccl
     A C engine whose kernels live elsewhere may include it from a .c file:
         mpicc -std=c11 prog.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcudart -lnccl
     Run: mpirun -n 2 ./prog

   DEVICES AND PATHS
     smp_init sets this rank's device to smp_local_rank() % (GPUs visible to
     the rank) - what the reference scripts do with set_device(local_rank) -
     and every rank then agrees on one path (smp_nccl_current_mode()):
       SMP_NCCL_MODE_NCCL    every rank has a GPU of its own: one NCCL
                             communicator per group (world, MP_GROUP,
                             DP_GROUP; a group with the world's ranks in the
                             world's order shares the world's).
       SMP_NCCL_MODE_STAGED  ranks of a node share a GPU (NCCL refuses two
                             ranks on one GPU; found by comparing the GPUs'
                             UUIDs and PCI addresses), or SMP_NCCL=staged:
                             device data is copied through pinned host
                             buffers and moved by smp's MPI collectives
                             (f16/bf16 reduce in f32 there, as on the host).
       SMP_NCCL_MODE_NONE    some rank has no CUDA device (no driver, none
                             visible): smp_init still succeeds and host
                             tensors work; a device tensor is an error
                             (SMP_ERR_DEVICE) saying "no CUDA device" and why.
     Environment: SMP_NCCL=auto|nccl|staged picks the path (nccl makes a
     shared GPU an error at smp_init, staged forces host staging),
     SMP_NCCL_SYNC makes every collective wait on the host, SMP_TIMEOUT is
     every wait's deadline: smp.h's ENVIRONMENT VARIABLES has them all.

   STREAMS: WHAT "DONE" MEANS
     The engine computes on one stream: the legacy default stream unless it
     calls smp_nccl_set_stream(s). A device collective (or smp_nccl_copy
     between device buffers):
       1. records an event on the engine stream and makes smp's own stream
          (non-blocking, high priority) wait on it, so it reads what the
          engine has queued so far;
       2. runs the NCCL operation on smp's stream;
       3. records an event there and makes the engine stream wait on it,
          then returns. No host or device-wide synchronisation: the result
          is ready for every kernel the engine queues afterwards on its
          stream. To read it on the host, synchronise the engine stream
          (cudaMemcpy on the default stream does) or call
          smp_nccl_synchronize(), which also polls NCCL for errors and
          applies the deadline.
     On the staged path the host waits for the device-to-host copy (so for
     the work queued before it), runs the MPI collective, and queues the
     host-to-device copy the same way. Copies that touch host memory return
     when the host memory is ready (or free to reuse).
     Other streams of the engine must be ordered against its main stream
     by the engine, as with any CUDA library.
     The pipeline executor's data-parallel gradient buckets skip step 3:
     the engine's backward kernels run on while a bucket reduces, and the
     engine stream waits for all the buckets once, before smp_step returns
     (so the optimizer sees the sums).

   POINT TO POINT (for pipelines)
     smp_nccl_p2p_connect(g, peers, n)      both ranks, once, all peers in one call
     smp_nccl_isend / smp_nccl_irecv        queue a transfer, get a request
     smp_nccl_test / smp_nccl_wait          poll it / order the engine after it
     Each direction between two ranks gets its own two-rank NCCL
     communicator and stream (a channel), so a queued send never waits
     behind a receive, or a receive behind a send: isends and irecvs posted
     in any order, then waited for, cannot deadlock. Waiting on a send
     orders the engine after it, so wait on a send before posting the
     receive it pairs with on both ranks of a pair, and the two deadlock
     once the message outgrows NCCL's buffers (as MPI_Send against MPI_Send
     can): post both, then wait. Within a direction, messages pair in
     order: the k-th isend from A to B fills the k-th irecv on B from A, and
     their sizes must match. An irecv may be queued long before the data is
     sent; its data reaches the engine stream only through smp_nccl_wait.
     On the staged path messages go over MPI through pinned host buffers
     (isend waits for the device-to-host copy; wait on an irecv queues the
     host-to-device copy); the same calls work unchanged.

   ERRORS
     Every CUDA and NCCL call is checked; the message names the call and
     the smp function ("smp_all_reduce: ncclAllReduce failed: ..."). NCCL
     asynchronous errors are polled while smp waits on the host; the
     communicator that reported one is aborted and later calls on it fail.
     A wait past the deadline aborts the NCCL communicators and the job
     (MPI_Abort) naming what it waited for.

   CAVEATS
     NCCL kernels wait on the GPU for their peers. While transfers are
     queued, avoid calls that wait for the whole device (cudaFree,
     cudaDeviceSynchronize): a receive queued for a peer that is itself
     waiting for this rank would never finish, and neither would the call.
     Allocate with cudaMallocAsync/cudaFreeAsync (or smp_nccl_alloc/free)
     and synchronise streams, not the device.
     Each channel and each group is an NCCL communicator of its own, with
     its own buffers on the GPU.
*/
#ifndef SMP_NCCL_H
#define SMP_NCCL_H

#include "smp.h"
#include <cuda_runtime_api.h>
#include <nccl.h>

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "smp_nccl.h needs NCCL 2.14 or newer (nonblocking communicators, ncclAvg, bf16)"
#endif
#if !defined(CUDART_VERSION) || CUDART_VERSION < 11020
#error "smp_nccl.h needs CUDA 11.2 or newer (stream-ordered allocation)"
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum smp_nccl_mode {
    SMP_NCCL_MODE_NONE = 0, /* no usable CUDA device: device tensors are an error */
    SMP_NCCL_MODE_NCCL,     /* one GPU per rank: NCCL */
    SMP_NCCL_MODE_STAGED    /* shared GPUs (or SMP_NCCL=staged): pinned host buffers + MPI */
} smp_nccl_mode;

/* Registers the backend (done for you unless SMP_NCCL_NO_AUTO_REGISTER). */
SMPDEF void smp_nccl_register(void);
/* The path smp_init chose; NONE before smp_init. */
SMPDEF smp_nccl_mode smp_nccl_current_mode(void);
SMPDEF const char *smp_nccl_mode_name(smp_nccl_mode m); /* "none", "nccl", "staged" */
/* One line for logs: the path, the device, NCCL's version; or why there is no device. */
SMPDEF const char *smp_nccl_describe(void);
/* The device of this rank's GPU (set current by smp_init) as a tensor's device
   field holds it, SMP_CUDA(ordinal); SMP_HOST (0) when none. CUDA's own calls
   take SMP_CUDA_ORDINAL(smp_nccl_device()). */
SMPDEF int smp_nccl_device(void);

/* The engine's compute stream (0, the default: the legacy default stream,
   or the per-thread one when this file is compiled with per-thread default
   streams). May be called before or after smp_init. */
SMPDEF void smp_nccl_set_stream(cudaStream_t engine_stream);
SMPDEF cudaStream_t smp_nccl_stream(void);
/* The NCCL communicator of a group (NULL unless the mode is NCCL). */
SMPDEF ncclComm_t smp_nccl_comm(smp_group g);
/* Waits on the host until all device work smp has queued (collectives,
   copies, transfers) is done; polls NCCL for errors; deadline as smp's. */
SMPDEF smp_status smp_nccl_synchronize(void);

/* Copies n bytes between host (SMP_HOST) and this rank's device, either
   way, ordered after the engine stream. Returns when host memory involved
   is ready or free to reuse; a device-to-device copy is only queued (the
   engine stream is ordered after it). */
SMPDEF smp_status smp_nccl_copy(void *dst, int dst_device, const void *src, int src_device, size_t n);

/* Device memory of this rank's GPU, ordered on the engine stream: stream-
   ordered cudaMallocAsync/cudaFreeAsync where the device supports memory
   pools; elsewhere cudaMalloc, and freed blocks are kept for reuse (by the
   same size, once the engine's work queued before the free is done) until
   smp_finalize, because cudaFree waits for the whole device. smp_nccl_alloc
   returns NULL and sets smp_last_error() on failure. Free a buffer a
   transfer used only after smp_nccl_wait on that transfer. */
SMPDEF void *smp_nccl_alloc(size_t bytes);
SMPDEF void smp_nccl_free(void *p);
/* dst += src elementwise on the engine stream (f16/bf16 added in f32 and
   rounded, as on the host). Needs the implementation compiled by nvcc (a
   .cu file); elsewhere it returns SMP_ERR_STATE. */
SMPDEF smp_status smp_nccl_add(void *dst, const void *src, smp_dtype dt, int64_t n);

/* ---------------------------------------------------------------- point to point */
typedef struct smp_nccl_request smp_nccl_request;

/* Opens the channels (one per direction) between this rank and each of
   peers[0..n) (ranks in group g), and connects them (one byte each way), so
   that later transfers never wait on the host for a peer. Each listed peer
   must call it with this rank in its list; it returns once they all have.
   List all of a rank's peers in one call (then no order matters), or make
   successive calls in an order every rank agrees on. Already connected
   peers are skipped. */
SMPDEF smp_status smp_nccl_p2p_connect(smp_group g, const int *peers, int npeers);
/* Queue `bytes` of device memory to / from `peer` (a rank in group g).
   isend reads buf after the work queued so far on the engine stream;
   irecv writes buf only after that work too (so buf may still be in use).
   *req must be passed to smp_nccl_wait exactly once. */
SMPDEF smp_status smp_nccl_isend(const void *buf, size_t bytes, int peer, smp_group g, smp_nccl_request **req);
SMPDEF smp_status smp_nccl_irecv(void *buf, size_t bytes, int peer, smp_group g, smp_nccl_request **req);
/* *done: the transfer has finished on the device (staged receive: the
   bytes have arrived on the host; wait still moves them to the device). */
SMPDEF smp_status smp_nccl_test(smp_nccl_request *req, bool *done);
/* Orders the engine stream after the transfer and frees req. It blocks the
   host only on the staged path (for the MPI message). After waiting on an
   isend, the engine may overwrite the buffer; after an irecv, read it. To
   free send buffers without holding up the engine, poll smp_nccl_test and
   wait once it says done. */
SMPDEF smp_status smp_nccl_wait(smp_nccl_request *req);

#ifdef __cplusplus
}
#endif
#endif /* SMP_NCCL_H */

/* ======================================================================
   IMPLEMENTATION
   ====================================================================== */
#if defined(SMP_IMPLEMENTATION) && !defined(SMP_NCCL_IMPLEMENTED)
#define SMP_NCCL_IMPLEMENTED

/* (the system headers it uses come with smp.h's implementation) */
#define SMP__NC_TAG_CONNECT 7301 /* unique ids of p2p channels, on the backend's own communicators */
#define SMP__NC_TAG_P2P 7302     /* staged point-to-point payloads */
#define SMP__NC_KEY 64           /* bytes identifying a GPU on a node: UUID (16) + PCI bus id */

typedef struct smp__nc_chan {
    ncclComm_t comm;     /* two ranks: the sending side is rank 0 */
    cudaStream_t stream;
    int peer;            /* the other side's rank in comm */
    bool dead;           /* aborted after an error */
} smp__nc_chan;

typedef struct smp__nc_pin {
    void *p;
    size_t cap;
    int state;           /* 0 free, 1 in use, 2 free once `ev` completes */
    cudaEvent_t ev;
} smp__nc_pin;

/* Devices without memory pools: a freed block waits here for reuse once the
   work queued before its free is done, because cudaFree would wait for the
   whole device - and for transfers that wait on peers. */
typedef struct smp__nc_block {
    void *p;
    size_t bytes;
    cudaEvent_t ev;      /* recorded at the free */
    bool cached;         /* freed, reusable once ev completes */
} smp__nc_block;

enum { SMP__NC_REQ_DONE, SMP__NC_REQ_NCCL, SMP__NC_REQ_STAGED_SEND, SMP__NC_REQ_STAGED_RECV };

struct smp_nccl_request {
    int kind;
    smp_group g;
    int peer;
    cudaEvent_t ev;       /* NCCL: completion on the channel's stream */
    smp__nc_chan *chan;
    MPI_Request mpi;      /* staged */
    int pin;              /* staged: pinned buffer index */
    void *dst;            /* staged receive: device destination */
    size_t bytes;
};

static struct {
    bool started;                      /* on_init got far enough to need on_finalize's cleanup */
    bool up;                           /* on_init finished */
    smp_nccl_mode mode;
    char why[512];                     /* mode NONE: why */
    char desc[1024];
    int device;
    char device_name[256];
    cudaStream_t stream;               /* smp's */
    cudaStream_t offload_stream;       /* activation offloading's copies, made at its first use */
    cudaEvent_t ev_engine, ev_done, ev_sync;
    bool have_mpi;
    MPI_Comm mpi[SMP_GROUP_COUNT];     /* private duplicates of the groups' communicators */
    ncclComm_t comm[SMP_GROUP_COUNT];
    int alias[SMP_GROUP_COUNT];        /* the group whose communicator this one uses */
    bool comm_dead[SMP_GROUP_COUNT];
    smp__nc_chan **chans[SMP_GROUP_COUNT]; /* [peer * 2]: to peer, [peer * 2 + 1]: from peer */
    int nchans[SMP_GROUP_COUNT];
    smp__nc_pin *pins;
    int npins, pins_cap;
    smp__nc_block *blocks;             /* no memory pools: device blocks smp handed out or keeps for reuse */
    int nblocks, blocks_cap;
    cudaEvent_t *events;               /* free events for requests */
    int nevents, events_cap;
    size_t *a2a;                       /* all_to_all_single's counts and offsets (smp__nc_a2a_plan) */
    int a2a_cap;
    unsigned char *dummy;              /* 256 device bytes: the channels' warm-up transfers */
    bool pools;                        /* cudaMallocAsync works on this device */
    bool sync_each;                    /* SMP_NCCL_SYNC */
    const char *op;                    /* the call in progress, for messages */
} smp__nc;

static cudaStream_t smp__nc_engine; /* survives smp_finalize: the engine's choice */

/* ---------------------------------------------------------------- errors, waiting */
static const char *smp__nc_opname(void) { return smp__nc.op ? smp__nc.op : "smp_nccl"; }

static smp_status smp__nc_cuda_fail(cudaError_t e, const char *call) {
    (void)cudaGetLastError(); /* clear a non-sticky error so the next call is not blamed for it */
    return smp_error(SMP_ERR_DEVICE, "%s: %s failed: %s (%s)", smp__nc_opname(), call, cudaGetErrorString(e),
                     cudaGetErrorName(e));
}

/* NCCL's own detail on its last error, or "". */
static const char *smp__nc_last(ncclComm_t comm) {
    const char *last = ncclGetLastError(comm);
    return last ? last : "";
}

static smp_status smp__nc_nccl_fail(ncclResult_t r, const char *call, ncclComm_t comm) {
    const char *last = smp__nc_last(comm);
    return smp_error(SMP_ERR_DEVICE, "%s: %s failed: %s%s%s", smp__nc_opname(), call, ncclGetErrorString(r),
                     *last ? ": " : "", last);
}

/* Checks a CUDA call: SMP__CU(cudaEventRecord, (ev, stream)); */
#define SMP__CU(fn, args)                                                   \
    do {                                                                    \
        cudaError_t e__ = fn args;                                          \
        if (e__ != cudaSuccess) return smp__nc_cuda_fail(e__, #fn);         \
    } while (0)
static void smp__nc_abort_all(void) {
    for (int g = 0; g < SMP_GROUP_COUNT; g++)
        if (smp__nc.comm[g] && !smp__nc.comm_dead[g]) {
            (void)ncclCommAbort(smp__nc.comm[g]);
            smp__nc.comm_dead[g] = true;
        }
    for (int g = 0; g < SMP_GROUP_COUNT; g++)
        for (int i = 0; i < smp__nc.nchans[g]; i++) {
            smp__nc_chan *c = smp__nc.chans[g][i];
            if (c && c->comm && !c->dead) { (void)ncclCommAbort(c->comm); c->dead = true; }
        }
}

static void smp__nc_timeout(const char *what, smp_group g, int peer, double waited) {
    smp__nc_abort_all();
    if (peer >= 0)
        smp__fatal("%s: timed out after %.1f s waiting for %s with %s rank %d (world rank %d) on CUDA device %d; "
                   "aborting the NCCL communicators and the job (SMP_TIMEOUT=%g)",
                   smp__nc_opname(), waited, what, smp__group_name(g), peer, smp_group_world_rank(g, peer),
                   smp__nc.device, smp_timeout());
    smp__fatal("%s: timed out after %.1f s waiting for %s in the %s on CUDA device %d; aborting the NCCL communicators "
                  "and the job (SMP_TIMEOUT=%g)",
                  smp__nc_opname(), waited, what, smp__group_name(g), smp__nc.device, smp_timeout());
}

/* A nonblocking communicator may answer ncclInProgress: poll until the call
   has really been issued (or failed). */
static ncclResult_t smp__nc_settle(ncclComm_t comm, ncclResult_t r, const char *call, smp_group g) {
    if (r != ncclInProgress) return r;
    smp__backoff b = smp__backoff_start();
    for (;;) {
        ncclResult_t state = ncclInProgress;
        ncclResult_t q = ncclCommGetAsyncError(comm, &state);
        if (q != ncclSuccess) return q;
        if (state != ncclInProgress) return state;
        if (!smp__backoff_pause(&b)) smp__nc_timeout(call, g, -1, MPI_Wtime() - b.start);
    }
}

/* Checks an NCCL call on a communicator: SMP__NC(comm, group, ncclAllReduce, (...)); */
#define SMP__NC(comm, g, fn, args)                                                   \
    do {                                                                             \
        ncclResult_t r__ = smp__nc_settle((comm), fn args, #fn, (g));                \
        if (r__ != ncclSuccess) return smp__nc_nccl_fail(r__, #fn, (comm));          \
    } while (0)

/* The same, leaving the status in st (for paths that must clean up first). */
#define SMP__NC_ST(st, comm, g, fn, args)                                             \
    do {                                                                             \
        ncclResult_t r__ = smp__nc_settle((comm), fn args, #fn, (g));                \
        (st) = r__ == ncclSuccess ? SMP_OK : smp__nc_nccl_fail(r__, #fn, (comm));   \
    } while (0)

/* Asks NCCL whether a communicator failed in the background; aborts it if so. */
static smp_status smp__nc_check_comm(ncclComm_t comm, bool *dead, const char *name, const char *what) {
    if (!comm || *dead) return SMP_OK;
    ncclResult_t state = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q == ncclSuccess && (state == ncclSuccess || state == ncclInProgress)) return SMP_OK;
    ncclResult_t bad = q != ncclSuccess ? q : state;
    smp_status st = smp_error(
        SMP_ERR_DEVICE, "%s: NCCL reported an error on the %s communicator while waiting for %s: %s%s%s",
        smp__nc_opname(), name, what, ncclGetErrorString(bad), *smp__nc_last(comm) ? ": " : "", smp__nc_last(comm));
    (void)ncclCommAbort(comm);
    *dead = true;
    return st;
}

static smp_status smp__nc_poll_async(const char *what) {
    for (int g = 0; g < SMP_GROUP_COUNT; g++)
        if (smp__nc.alias[g] == g)
            SMP_TRY(smp__nc_check_comm(smp__nc.comm[g], &smp__nc.comm_dead[g], smp__group_name((smp_group)g), what));
    for (int g = 0; g < SMP_GROUP_COUNT; g++)
        for (int i = 0; i < smp__nc.nchans[g]; i++) {
            smp__nc_chan *c = smp__nc.chans[g][i];
            if (c) SMP_TRY(smp__nc_check_comm(c->comm, &c->dead, "point-to-point", what));
        }
    return SMP_OK;
}

/* Waits on the host until `ev` has completed, watching NCCL for errors. */
static smp_status smp__nc_wait_event(cudaEvent_t ev, const char *what, smp_group g, int peer) {
    smp__backoff b = smp__backoff_start();
    for (;;) {
        cudaError_t e = cudaEventQuery(ev);
        if (e == cudaSuccess) return SMP_OK;
        if (e != cudaErrorNotReady) return smp__nc_cuda_fail(e, "cudaEventQuery");
        if (smp__nc.mode == SMP_NCCL_MODE_NCCL) SMP_TRY(smp__nc_poll_async(what));
        if (!smp__backoff_pause(&b)) smp__nc_timeout(what, g, peer, MPI_Wtime() - b.start);
    }
}

/* ---------------------------------------------------------------- stream ordering */
/* Makes stream s wait for what the engine has queued so far. */
static smp_status smp__nc_after_engine(cudaStream_t s) {
    SMP__CU(cudaEventRecord, (smp__nc.ev_engine, smp__nc_engine));
    SMP__CU(cudaStreamWaitEvent, (s, smp__nc.ev_engine, 0));
    return SMP_OK;
}

/* Makes the engine stream wait for what s has queued so far. */
static smp_status smp__nc_engine_after(cudaStream_t s) {
    SMP__CU(cudaEventRecord, (smp__nc.ev_done, s));
    SMP__CU(cudaStreamWaitEvent, (smp__nc_engine, smp__nc.ev_done, 0));
    return SMP_OK;
}

/* The end of a collective: the engine waits for smp's stream; with
   SMP_NCCL_SYNC the host too. */
static smp_status smp__nc_finish(const char *what, smp_group g) {
    SMP_TRY(smp__nc_engine_after(smp__nc.stream));
    if (smp__nc.sync_each) return smp__nc_wait_event(smp__nc.ev_done, what, g, -1);
    return SMP_OK;
}

/* Waits on the host for stream s; g and peer name whom it waits for (peer -1: the group). */
static smp_status smp__nc_stream_idle(cudaStream_t s, const char *what, smp_group g, int peer) {
    SMP__CU(cudaEventRecord, (smp__nc.ev_sync, s));
    return smp__nc_wait_event(smp__nc.ev_sync, what, g, peer);
}

/* ---------------------------------------------------------------- memory */
/* Device memory ordered on stream s: cudaMallocAsync/cudaFreeAsync with
   memory pools, else the block cache above (exact sizes: a step's shapes
   repeat). */
static smp_status smp__nc_dev_alloc(void **p, size_t n, cudaStream_t s) {
    *p = NULL;
    if (!n) n = 1;
    if (smp__nc.pools) {
        SMP__CU(cudaMallocAsync, (p, n, s));
        return SMP_OK;
    }
    for (int i = 0; i < smp__nc.nblocks; i++) {
        smp__nc_block *b = &smp__nc.blocks[i];
        if (!b->cached || b->bytes != n) continue;
        cudaError_t q = cudaEventQuery(b->ev);
        if (q == cudaErrorNotReady) continue;
        if (q != cudaSuccess) return smp__nc_cuda_fail(q, "cudaEventQuery");
        b->cached = false;
        *p = b->p;
        return SMP_OK;
    }
    if (!smp__grow((void **)&smp__nc.blocks, &smp__nc.blocks_cap, smp__nc.nblocks + 1, sizeof *smp__nc.blocks, NULL))
        return smp_error(SMP_ERR_NOMEM, "%s: out of memory for device block records", smp__nc_opname());
    smp__nc_block b;
    memset(&b, 0, sizeof b);
    b.bytes = n;
    SMP__CU(cudaEventCreateWithFlags, (&b.ev, cudaEventDisableTiming));
    cudaError_t e = cudaMalloc(&b.p, n);
    if (e != cudaSuccess) {
        (void)cudaEventDestroy(b.ev);
        return smp__nc_cuda_fail(e, "cudaMalloc");
    }
    smp__nc.blocks[smp__nc.nblocks++] = b;
    *p = b.p;
    return SMP_OK;
}

static smp_status smp__nc_dev_free(void *p, cudaStream_t s) {
    if (!p) return SMP_OK;
    if (smp__nc.pools) {
        SMP__CU(cudaFreeAsync, (p, s));
        return SMP_OK;
    }
    for (int i = 0; i < smp__nc.nblocks; i++) {
        smp__nc_block *b = &smp__nc.blocks[i];
        if (b->p != p || b->cached) continue;
        SMP__CU(cudaEventRecord, (b->ev, s));
        b->cached = true;
        return SMP_OK;
    }
    SMP__CU(cudaFree, (p)); /* not smp's (from before this smp_init): the slow way */
    return SMP_OK;
}

/* A scratch copy of n device bytes at src, queued on smp's stream. */
static smp_status smp__nc_tmp_copy(void **tmp, const void *src, size_t n) {
    SMP_TRY(smp__nc_dev_alloc(tmp, n, smp__nc.stream));
    cudaError_t e = cudaMemcpyAsync(*tmp, src, n, cudaMemcpyDeviceToDevice, smp__nc.stream);
    if (e != cudaSuccess) {
        smp_status st = smp__nc_cuda_fail(e, "cudaMemcpyAsync");
        (void)smp__nc_dev_free(*tmp, smp__nc.stream);
        *tmp = NULL;
        return st;
    }
    return SMP_OK;
}

/* Pinned host buffers for the staged path, reused. */
static smp_status smp__nc_pin_get(size_t n, int *idx) {
    int best = -1;
    *idx = -1;
    if (n == 0) n = 1;
    for (int i = 0; i < smp__nc.npins; i++) {
        smp__nc_pin *e = &smp__nc.pins[i];
        if (e->state == 2) {
            cudaError_t q = cudaEventQuery(e->ev);
            if (q == cudaSuccess) e->state = 0;
            else if (q != cudaErrorNotReady) return smp__nc_cuda_fail(q, "cudaEventQuery");
        }
        if (e->state == 0 && e->cap >= n && (best < 0 || e->cap < smp__nc.pins[best].cap)) best = i;
    }
    if (best < 0) {
        if (!smp__grow((void **)&smp__nc.pins, &smp__nc.pins_cap, smp__nc.npins + 1, sizeof *smp__nc.pins, NULL))
            return smp_error(SMP_ERR_NOMEM, "%s: out of memory for pinned buffer records", smp__nc_opname());
        size_t cap = (size_t)64 << 10;
        while (cap < n && cap < ((size_t)64 << 20)) cap *= 2;
        if (cap < n) cap = (n + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1);
        smp__nc_pin e;
        memset(&e, 0, sizeof e);
        SMP__CU(cudaEventCreateWithFlags, (&e.ev, cudaEventDisableTiming));
        cudaError_t r = cudaMallocHost(&e.p, cap);
        if (r != cudaSuccess) {
            (void)cudaEventDestroy(e.ev);
            return smp__nc_cuda_fail(r, "cudaMallocHost");
        }
        e.cap = cap;
        best = smp__nc.npins++;
        smp__nc.pins[best] = e;
    }
    smp__nc.pins[best].state = 1;
    *idx = best;
    return SMP_OK;
}

static void smp__nc_pin_put(int idx) {
    if (idx >= 0) smp__nc.pins[idx].state = 0;
}

/* Frees the buffer once what stream s has queued so far (a copy from it) is done. */
static smp_status smp__nc_pin_put_after(int idx, cudaStream_t s) {
    if (idx < 0) return SMP_OK;
    cudaError_t e = cudaEventRecord(smp__nc.pins[idx].ev, s);
    if (e != cudaSuccess) {
        /* cannot tell when the copy ends: keep the buffer out of use for good */
        return smp__nc_cuda_fail(e, "cudaEventRecord");
    }
    smp__nc.pins[idx].state = 2;
    return SMP_OK;
}

static smp_status smp__nc_event_get(cudaEvent_t *ev) {
    if (smp__nc.nevents) { *ev = smp__nc.events[--smp__nc.nevents]; return SMP_OK; }
    SMP__CU(cudaEventCreateWithFlags, (ev, cudaEventDisableTiming));
    return SMP_OK;
}

static void smp__nc_event_put(cudaEvent_t ev) {
    if (!smp__grow((void **)&smp__nc.events, &smp__nc.events_cap, smp__nc.nevents + 1, sizeof *smp__nc.events, NULL)) {
        (void)cudaEventDestroy(ev);
        return;
    }
    smp__nc.events[smp__nc.nevents++] = ev;
}

/* ---------------------------------------------------------------- argument checks */
static smp_status smp__nc_ready(const char *fn) {
    smp__nc.op = fn;
    if (!smp__nc.up)
        return smp_error(SMP_ERR_STATE, "%s: the CUDA device backend is not started (call smp_init first)", fn);
    if (smp__nc.mode == SMP_NCCL_MODE_NONE) return smp_error(SMP_ERR_DEVICE, "%s: no CUDA device: %s", fn, smp__nc.why);
    return SMP_OK;
}

static bool smp__nc_overlap(const void *a, size_t an, const void *b, size_t bn) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return an && bn && x < y + bn && y < x + an;
}

/* `what` (device `device`, `bytes` long) must be memory of this rank's GPU. */
static smp_status smp__nc_check_ptr(const char *what, const void *p, int device, size_t bytes) {
    const char *fn = smp__nc_opname();
    if (device != SMP_CUDA(smp__nc.device))
        return smp_error(SMP_ERR_ARG, "%s: %s is on CUDA device %d but this rank drives device %d (smp_nccl_device())",
                         fn, what, SMP_CUDA_ORDINAL(device), smp__nc.device);
    if (!bytes) return SMP_OK;
    if (!p) return smp_error(SMP_ERR_ARG, "%s: %s has no data", fn, what);
    struct cudaPointerAttributes a;
    memset(&a, 0, sizeof a);
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return smp_error(SMP_ERR_ARG, "%s: %s (%p) is not CUDA memory: cudaPointerGetAttributes: %s", fn, what, p,
                         cudaGetErrorString(e));
    }
    if (a.type == cudaMemoryTypeManaged) return SMP_OK;
    if (a.type != cudaMemoryTypeDevice)
        return smp_error(SMP_ERR_ARG, "%s: %s is marked as CUDA device %d but its data (%p) is %s memory", fn, what,
                         smp__nc.device, p, a.type == cudaMemoryTypeHost ? "pinned host" : "host");
    if (a.device != smp__nc.device)
        return smp_error(SMP_ERR_ARG, "%s: %s is marked as CUDA device %d but its data lives on device %d", fn, what,
                         smp__nc.device, a.device);
    return SMP_OK;
}

static smp_status smp__nc_check_tensor(const char *what, const smp_tensor *t) {
    return smp__nc_check_ptr(what, t->data, t->device, smp_tensor_nbytes(t));
}

/* NCCL's types for dtype dt and op (SMP_SUM for the collectives that do not reduce). */
static smp_status smp__nc_types(smp_dtype dt, smp_op op, ncclDataType_t *t, ncclRedOp_t *r) {
    switch (dt) {
    case SMP_F32: *t = ncclFloat32; break;
    case SMP_F64: *t = ncclFloat64; break;
    case SMP_F16: *t = ncclFloat16; break;
    case SMP_BF16: *t = ncclBfloat16; break;
    case SMP_I32: *t = ncclInt32; break;
    case SMP_I64: *t = ncclInt64; break;
    case SMP_U8: case SMP_BOOL: *t = ncclUint8; break;
    default: return smp_error(SMP_ERR_ARG, "%s: dtype %s has no NCCL equivalent", smp__nc_opname(), smp_dtype_name(dt));
    }
    switch (op) {
    case SMP_SUM: *r = ncclSum; return SMP_OK;
    case SMP_AVG: *r = ncclAvg; return SMP_OK;
    case SMP_MIN: *r = ncclMin; return SMP_OK;
    case SMP_MAX: *r = ncclMax; return SMP_OK;
    case SMP_PROD: *r = ncclProd; return SMP_OK;
    default: return smp_error(SMP_ERR_ARG, "%s: unknown op %d", smp__nc_opname(), (int)op);
    }
}

static smp_status smp__nc_group_comm(smp_group g, ncclComm_t *c) {
    *c = NULL;
    if ((unsigned)g >= SMP_GROUP_COUNT) return smp_error(SMP_ERR_ARG, "%s: unknown group %d", smp__nc_opname(), (int)g);
    int a = smp__nc.alias[g];
    if (smp__nc.comm_dead[a])
        return smp_error(SMP_ERR_DEVICE, "%s: the NCCL communicator of the %s was aborted after an earlier error",
                         smp__nc_opname(), smp__group_name(g));
    *c = smp__nc.comm[a];
    if (!*c)
        return smp_error(SMP_ERR_STATE, "%s: the %s has no NCCL communicator", smp__nc_opname(), smp__group_name(g));
    return SMP_OK;
}

/* ---------------------------------------------------------------- host staging */
/* Copies n device bytes at src, after the engine's work, into a pinned
   buffer (*pin) and waits on the host for the copy. On failure the buffer
   is released once the copy, which may still be queued, is done. */
static smp_status smp__nc_to_host(const void *src, size_t n, int *pin, const char *what, smp_group g, int peer) {
    SMP_TRY(smp__nc_pin_get(n, pin));
    smp_status st = smp__nc_after_engine(smp__nc.stream);
    cudaError_t e = cudaSuccess;
    if (!st &&
        (e = cudaMemcpyAsync(smp__nc.pins[*pin].p, src, n, cudaMemcpyDeviceToHost, smp__nc.stream)) != cudaSuccess)
        st = smp__nc_cuda_fail(e, "cudaMemcpyAsync");
    if (!st && (e = cudaEventRecord(smp__nc.ev_done, smp__nc.stream)) != cudaSuccess)
        st = smp__nc_cuda_fail(e, "cudaEventRecord");
    if (!st) st = smp__nc_wait_event(smp__nc.ev_done, what, g, peer);
    if (st) {
        if (smp__nc_pin_put_after(*pin, smp__nc.stream) != SMP_OK) { /* then it stays out of use */ }
        *pin = -1;
    }
    return st;
}

/* Queues pinned buffer pin's n bytes to device memory at dst, orders the
   engine after the copy (smp__nc_finish), and releases the buffer behind it. */
static smp_status smp__nc_from_host(void *dst, int pin, size_t n, const char *what, smp_group g) {
    cudaError_t e = cudaMemcpyAsync(dst, smp__nc.pins[pin].p, n, cudaMemcpyHostToDevice, smp__nc.stream);
    smp_status st = e != cudaSuccess ? smp__nc_cuda_fail(e, "cudaMemcpyAsync") : smp__nc_finish(what, g);
    smp_status st2 = smp__nc_pin_put_after(pin, smp__nc.stream);
    return st ? st : st2;
}

/* t's shape over pinned buffer pin (NULL data where no bytes move). */
static smp_tensor smp__nc_host_view(const smp_tensor *t, int pin) {
    smp_tensor h = *t;
    h.data = pin >= 0 ? smp__nc.pins[pin].p : NULL;
    h.device = SMP_HOST;
    return h;
}

/* ---------------------------------------------------------------- collectives */
/* all_to_all_single's counts and offsets, in elements, from the splits
   (NULL: equal blocks of rows) into smp__nc.a2a: [send count, send offset,
   receive count, receive offset] x group size. */
static smp_status smp__nc_a2a_plan(const smp_tensor *in, const smp_tensor *out, const int64_t *out_splits,
                                   const int64_t *in_splits, smp_group g) {
    const char *fn = "smp_all_to_all_single";
    int n = smp_group_size(g), me = smp_group_rank(g);
    int64_t in_rows = in->ndim ? in->shape[0] : 1, out_rows = out->ndim ? out->shape[0] : 1;
    int64_t in_row = in_rows ? smp_tensor_numel(in) / in_rows : 0,
            out_row = out_rows ? smp_tensor_numel(out) / out_rows : 0;
    if (in_rows && out_rows && in_row != out_row)
        return smp_error(SMP_ERR_ARG, "%s: in's rows have %lld elements but out's have %lld", fn, (long long)in_row,
                         (long long)out_row);
    smp_status st = SMP_OK;
    if (!smp__grow_or(&st, (void **)&smp__nc.a2a, &smp__nc.a2a_cap, 4 * n, sizeof *smp__nc.a2a,
                      "all_to_all_single's counts"))
        return st;
    size_t row = (size_t)(in_rows ? in_row : out_row);
    size_t *sc = smp__nc.a2a, *sd = sc + n, *rc = sc + 2 * (size_t)n, *rd = sc + 3 * (size_t)n;
    int64_t sat = 0, rat = 0;
    for (int i = 0; i < n; i++) {
        int64_t s = in_splits ? in_splits[i] : (in_rows % n ? -1 : in_rows / n);
        int64_t r = out_splits ? out_splits[i] : (out_rows % n ? -1 : out_rows / n);
        if (s < 0 || r < 0)
            return smp_error(SMP_ERR_ARG, "%s: %s", fn,
                             s < 0 ? (in_splits ? "in_splits has a negative entry"
                                                : "in's dim 0 does not divide by the group size; pass in_splits")
                                   : (out_splits ? "out_splits has a negative entry"
                                                 : "out's dim 0 does not divide by the group size; pass out_splits"));
        sc[i] = (size_t)s * row; sd[i] = (size_t)sat * row; sat += s;
        rc[i] = (size_t)r * row; rd[i] = (size_t)rat * row; rat += r;
    }
    if (sat != in_rows || rat != out_rows)
        return smp_error(SMP_ERR_ARG,
                         "%s: splits add up to %lld rows in and %lld out, but the tensors have %lld and %lld", fn,
                         (long long)sat, (long long)rat, (long long)in_rows, (long long)out_rows);
    if (sc[me] != rc[me])
        return smp_error(SMP_ERR_ARG, "%s: this rank sends itself %zu elements but expects %zu from itself", fn, sc[me],
                         rc[me]);
    return SMP_OK;
}

/* Queues all_to_all_single as smp__nc_a2a_plan counted it: this rank's own
   block is a copy, the others' blocks one NCCL group of sends and receives. */
static smp_status smp__nc_a2a_queue(const char *src, char *dst, size_t esize, ncclDataType_t t, ncclComm_t c,
                                    smp_group g) {
    int n = smp_group_size(g), me = smp_group_rank(g);
    const size_t *sc = smp__nc.a2a, *sd = sc + n, *rc = sc + 2 * (size_t)n, *rd = sc + 3 * (size_t)n;
    if (rc[me])
        SMP__CU(cudaMemcpyAsync,
                (dst + rd[me] * esize, src + sd[me] * esize, rc[me] * esize, cudaMemcpyDeviceToDevice, smp__nc.stream));
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return smp__nc_nccl_fail(r, "ncclGroupStart", c);
    const char *failed = NULL;
    for (int i = 0; i < n && !failed; i++) {
        if (i == me) continue;
        if (sc[i] && (r = ncclSend(src + sd[i] * esize, sc[i], t, i, c, smp__nc.stream)) != ncclSuccess &&
            r != ncclInProgress)
            failed = "ncclSend";
        if (!failed && rc[i] && (r = ncclRecv(dst + rd[i] * esize, rc[i], t, i, c, smp__nc.stream)) != ncclSuccess &&
            r != ncclInProgress)
            failed = "ncclRecv";
    }
    /* the group is closed even after a failure */
    ncclResult_t re = smp__nc_settle(c, ncclGroupEnd(), "ncclGroupEnd", g);
    if (failed) return smp__nc_nccl_fail(r, failed, c);
    return re == ncclSuccess ? SMP_OK : smp__nc_nccl_fail(re, "ncclGroupEnd", c);
}

enum {
    SMP__NC_ALL_REDUCE,
    SMP__NC_BROADCAST,
    SMP__NC_REDUCE,
    SMP__NC_ALL_GATHER,
    SMP__NC_REDUCE_SCATTER,
    SMP__NC_ALL_TO_ALL
};

/* Every device collective, by kind: in to out (a broadcast's in and out are
   its one tensor; out NULL: a reduce's non-root), op where the kind reduces
   (SMP_SUM elsewhere), the splits for all_to_all_single. smp.h has checked
   the arguments as for the host; here the tensors must be this GPU's. The
   staged path runs smp's host collective of the same name on pinned copies.
   order_engine false: the engine's stream runs on while NCCL reduces (the
   executor's gradient buckets; smp__nc_bucket_fence orders it later). */
static smp_status smp__nc_collective(int kind, const smp_tensor *in, smp_tensor *out, smp_op op, int root, smp_group g,
                                     const int64_t *out_splits, const int64_t *in_splits, bool order_engine) {
    static const char *const fns[] = {"smp_all_reduce", "smp_broadcast",      "smp_reduce",
                                      "smp_all_gather", "smp_reduce_scatter", "smp_all_to_all_single"};
    const char *name = fns[kind] + 4; /* without "smp_": what the waits name */
    ncclDataType_t t = ncclUint8; /* (set by smp__nc_types; initialised for gcc's flow analysis) */
    ncclRedOp_t r = ncclSum;
    SMP_TRY(smp__nc_ready(fns[kind]));
    SMP_TRY(smp__nc_types(in->dtype, op, &t, &r));
    /* NCCL 2.28.3's ncclAvg in a group of one left f32 and f64 elements past
       2^18 unwritten (zeros; test_gpu on an H100): there the sum is the average */
    if (r == ncclAvg && smp_group_size(g) == 1) r = ncclSum;
    SMP_TRY(smp__nc_check_tensor(kind == SMP__NC_BROADCAST ? "tensor" : "in", in));
    if (out && kind != SMP__NC_BROADCAST) SMP_TRY(smp__nc_check_tensor("out", out));
    int rank = smp_group_rank(g);
    size_t in_bytes = smp_tensor_nbytes(in), out_bytes = out ? smp_tensor_nbytes(out) : 0;
    /* NCCL's count: one rank's block. All ranks meet in all_to_all_single even when this one moves nothing. */
    size_t n = (size_t)smp_tensor_numel(kind == SMP__NC_REDUCE_SCATTER ? out : in);
    if (!n && kind != SMP__NC_ALL_TO_ALL) return SMP_OK;
    if (smp__nc.mode == SMP_NCCL_MODE_STAGED) {
        bool bcast = kind == SMP__NC_BROADCAST; /* its root only sends, the other ranks only receive */
        size_t send = bcast && rank != root ? 0 : in_bytes, recv = bcast && rank == root ? 0 : out_bytes;
        char what[48];
        snprintf(what, sizeof what, "%s input", name);
        int pin_in = -1, pin_out = -1;
        smp_status st =
            send ? smp__nc_to_host(in->data, send, &pin_in, what, g, -1) : smp__nc_after_engine(smp__nc.stream);
        if (!st && recv) st = smp__nc_pin_get(recv, &pin_out);
        if (!st) {
            smp_tensor hi = smp__nc_host_view(in, pin_in), ho = smp__nc_host_view(out ? out : in, pin_out);
            switch (kind) {
            case SMP__NC_ALL_REDUCE: st = smp_all_reduce(&hi, &ho, op, g); break;
            case SMP__NC_BROADCAST: st = smp_broadcast(send ? &hi : &ho, root, g); break;
            case SMP__NC_REDUCE: st = smp_reduce(&hi, out ? &ho : NULL, op, root, g); break;
            case SMP__NC_ALL_GATHER: st = smp_all_gather(&hi, &ho, g); break;
            case SMP__NC_REDUCE_SCATTER: st = smp_reduce_scatter(&hi, &ho, op, g); break;
            default: st = smp_all_to_all_single(&hi, &ho, out_splits, in_splits, g); break;
            }
        }
        smp__nc_pin_put(pin_in); /* its copy is done: smp__nc_to_host waited for it */
        if (st || !recv) {
            smp__nc_pin_put(pin_out);
            return st;
        }
        return smp__nc_from_host(out->data, pin_out, recv, name, g);
    }
    if (kind == SMP__NC_ALL_TO_ALL) SMP_TRY(smp__nc_a2a_plan(in, out, out_splits, in_splits, g));
    ncclComm_t c;
    SMP_TRY(smp__nc_group_comm(g, &c));
    SMP_TRY(smp__nc_after_engine(smp__nc.stream));
    const char *src = (const char *)in->data;
    char *dst = (char *)(out ? out->data : in->data); /* a reduce's non-root: NCCL writes nothing there */
    /* NCCL takes identical or disjoint buffers (or in as this rank's block
       of out, out as this rank's block of in): others send from a copy */
    bool in_place = kind == SMP__NC_ALL_GATHER ? dst + in_bytes * (size_t)rank == src
                    : kind == SMP__NC_REDUCE_SCATTER ? src + out_bytes * (size_t)rank == dst
                    : kind != SMP__NC_ALL_TO_ALL && src == dst;
    void *tmp = NULL;
    if (!in_place && smp__nc_overlap(src, in_bytes, dst, out_bytes)) {
        SMP_TRY(smp__nc_tmp_copy(&tmp, src, in_bytes));
        src = (const char *)tmp;
    }
    smp_status st;
    cudaStream_t s = smp__nc.stream;
    switch (kind) {
    case SMP__NC_ALL_REDUCE: SMP__NC_ST(st, c, g, ncclAllReduce, (src, dst, n, t, r, c, s)); break;
    case SMP__NC_BROADCAST: SMP__NC_ST(st, c, g, ncclBroadcast, (src, dst, n, t, root, c, s)); break;
    case SMP__NC_REDUCE: SMP__NC_ST(st, c, g, ncclReduce, (src, dst, n, t, r, root, c, s)); break;
    case SMP__NC_ALL_GATHER: SMP__NC_ST(st, c, g, ncclAllGather, (src, dst, n, t, c, s)); break;
    case SMP__NC_REDUCE_SCATTER: SMP__NC_ST(st, c, g, ncclReduceScatter, (src, dst, n, t, r, c, s)); break;
    default: st = smp__nc_a2a_queue(src, dst, smp_dtype_size(in->dtype), t, c, g); break;
    }
    smp_status st2 = smp__nc_dev_free(tmp, s);
    if (st || st2) return st ? st : st2;
    return order_engine ? smp__nc_finish(name, g) : SMP_OK;
}

static smp_status smp__nc_all_reduce(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g) {
    return smp__nc_collective(SMP__NC_ALL_REDUCE, in, out, op, 0, g, NULL, NULL, true);
}

static smp_status smp__nc_bucket_all_reduce(void *data, smp_dtype dt, int64_t n, smp_group g) {
    smp_tensor t = smp_tensor_1d(data, dt, n);
    t.device = SMP_CUDA(smp__nc.device);
    return smp__nc_collective(SMP__NC_ALL_REDUCE, &t, &t, SMP_SUM, 0, g, NULL, NULL, false);
}

static smp_status smp__nc_bucket_fence(void) { return smp__nc_finish("gradient buckets", SMP_RDP_GROUP); }

static smp_status smp__nc_broadcast(smp_tensor *x, int root, smp_group g) {
    return smp__nc_collective(SMP__NC_BROADCAST, x, x, SMP_SUM, root, g, NULL, NULL, true);
}

static smp_status smp__nc_reduce(const smp_tensor *in, smp_tensor *out, smp_op op, int root, smp_group g) {
    return smp__nc_collective(SMP__NC_REDUCE, in, smp_group_rank(g) == root ? out : NULL, op, root, g, NULL, NULL,
                              true);
}

static smp_status smp__nc_all_gather(const smp_tensor *in, smp_tensor *out, smp_group g) {
    return smp__nc_collective(SMP__NC_ALL_GATHER, in, out, SMP_SUM, 0, g, NULL, NULL, true);
}

static smp_status smp__nc_reduce_scatter(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g) {
    return smp__nc_collective(SMP__NC_REDUCE_SCATTER, in, out, op, 0, g, NULL, NULL, true);
}

static smp_status smp__nc_all_to_all_single(const smp_tensor *in, smp_tensor *out, const int64_t *out_splits,
                                            const int64_t *in_splits, smp_group g) {
    return smp__nc_collective(SMP__NC_ALL_TO_ALL, in, out, SMP_SUM, 0, g, out_splits, in_splits, true);
}

static smp_status smp__nc_copy(void *dst, int dst_device, const void *src, int src_device, size_t n) {
    SMP_TRY(smp__nc_ready("smp_nccl_copy"));
    if (!n) return SMP_OK;
    if (!dst || !src) return smp_error(SMP_ERR_ARG, "smp_nccl_copy: %s is NULL", dst ? "src" : "dst");
    if (dst_device == SMP_HOST && src_device == SMP_HOST) {
        memmove(dst, src, n);
        return SMP_OK;
    }
    if (dst_device != SMP_HOST) SMP_TRY(smp__nc_check_ptr("the destination", dst, dst_device, n));
    if (src_device != SMP_HOST) SMP_TRY(smp__nc_check_ptr("the source", src, src_device, n));
    SMP_TRY(smp__nc_after_engine(smp__nc.stream));
    SMP__CU(cudaMemcpyAsync, (dst, src, n, cudaMemcpyDefault, smp__nc.stream));
    if (dst_device == SMP_HOST || src_device == SMP_HOST) { /* host memory: done means done */
        SMP__CU(cudaEventRecord, (smp__nc.ev_done, smp__nc.stream));
        return smp__nc_wait_event(smp__nc.ev_done, "a copy between host and device", SMP_WORLD, -1);
    }
    return smp__nc_finish("a device copy", SMP_WORLD);
}

/* ---------------------------------------------------------------- start-up */
static void smp__nc_reset(void) {
    memset(&smp__nc, 0, sizeof smp__nc);
    smp__nc.device = -1;
    for (int g = 0; g < SMP_GROUP_COUNT; g++) {
        smp__nc.alias[g] = g;
        smp__nc.mpi[g] = MPI_COMM_NULL;
    }
}

/* Agreement among all ranks: element-wise maximum, in place. */
static smp_status smp__nc_agree(int *v, int n, const char *what) {
    MPI_Request req;
    /* the agreement itself: a rank that cannot take part can tell nobody */
    SMP__MPI_FATAL(MPI_Iallreduce(MPI_IN_PLACE, v, n, MPI_INT, MPI_MAX, smp__nc.mpi[SMP_WORLD], &req),
                   "agreeing on %s (device backend start-up)", what);
    smp_wait_requests(1, &req, what, SMP_WORLD, -1);
    return SMP_OK;
}

static smp_status smp__nc_make_stream(cudaStream_t *s) {
    int least = 0, greatest = 0;
    SMP__CU(cudaDeviceGetStreamPriorityRange, (&least, &greatest));
    SMP__CU(cudaStreamCreateWithPriority, (s, cudaStreamNonBlocking, greatest));
    return SMP_OK;
}

/* ---------------------------------------------------------------- activation offloading */
/* One offloaded block (the backend table's offload entries, smp.h): its pinned buffer, its bytes, and the event
   of the last copy queued to or from it on the offload stream. */
typedef struct smp__nc_away { int pin; size_t n; cudaEvent_t ev; } smp__nc_away;

static smp_status smp__nc_offload_begin(void) {
    SMP_TRY(smp__nc_ready("offload_activations"));
    if (!smp__nc.offload_stream) SMP_TRY(smp__nc_make_stream(&smp__nc.offload_stream));
    return smp__nc_after_engine(smp__nc.offload_stream); /* what the copy reads or writes was the engine's */
}

static smp_status smp__nc_offload(const void *src, size_t n, void **copy) {
    *copy = NULL;
    SMP_TRY(smp__nc_offload_begin());
    SMP_TRY(smp__nc_check_ptr("an offloaded activation", src, SMP_CUDA(smp__nc.device), n));
    smp_status st = SMP_OK;
    smp__nc_away *o = (smp__nc_away *)smp__alloc_or(&st, sizeof *o, SMP__ALLOC_OTHER, "an offloaded block's record");
    if (st) return st;
    o->n = n;
    o->ev = NULL;
    st = smp__nc_pin_get(n, &o->pin);
    if (!st) st = smp__nc_event_get(&o->ev);
    cudaError_t e = st ? cudaSuccess : cudaMemcpyAsync(smp__nc.pins[o->pin].p, src, n, cudaMemcpyDeviceToHost,
                                                       smp__nc.offload_stream);
    if (!st && e != cudaSuccess) st = smp__nc_cuda_fail(e, "cudaMemcpyAsync");
    if (!st && (e = cudaEventRecord(o->ev, smp__nc.offload_stream)) != cudaSuccess)
        st = smp__nc_cuda_fail(e, "cudaEventRecord");
    if (st) {
        if (o->ev) smp__nc_event_put(o->ev);
        if (o->pin >= 0) (void)smp__nc_pin_put_after(o->pin, smp__nc.offload_stream); /* once a queued copy is done */
        smp__free(o);
        return st;
    }
    *copy = o;
    return SMP_OK;
}

static smp_status smp__nc_offload_done(void *copy, bool *done) {
    cudaError_t q = cudaEventQuery(((smp__nc_away *)copy)->ev);
    *done = q == cudaSuccess;
    return q == cudaSuccess || q == cudaErrorNotReady ? SMP_OK : smp__nc_cuda_fail(q, "cudaEventQuery");
}

static smp_status smp__nc_reload(void *copy, void *dst) {
    smp__nc_away *o = (smp__nc_away *)copy;
    SMP_TRY(smp__nc_offload_begin()); /* dst was allocated on the engine stream */
    SMP_TRY(smp__nc_check_ptr("a reloaded activation", dst, SMP_CUDA(smp__nc.device), o->n));
    SMP__CU(cudaMemcpyAsync, (dst, smp__nc.pins[o->pin].p, o->n, cudaMemcpyHostToDevice, smp__nc.offload_stream));
    SMP__CU(cudaEventRecord, (o->ev, smp__nc.offload_stream));
    return SMP_OK;
}

static smp_status smp__nc_offload_wait(void *copy) {
    SMP_TRY(smp__nc_ready("offload_activations"));
    SMP__CU(cudaStreamWaitEvent, (smp__nc_engine, ((smp__nc_away *)copy)->ev, 0));
    return SMP_OK;
}
static smp_status smp__nc_offload_drop(void *copy) {
    smp__nc_away *o = (smp__nc_away *)copy;
    smp_status st = smp__nc_offload_wait(o);
    smp_status put = smp__nc_pin_put_after(o->pin, smp__nc.offload_stream); /* reusable once its copies are done */
    smp__nc_event_put(o->ev);
    smp__free(o);
    return st ? st : put;
}

/* ---------------------------------------------------------------- shard_optimizer_state's parameter all-gather */
/* The handle is the event recorded after the all-gather on smp's stream: the engine's stream waits for that one
   bucket, not for the buckets queued after it (smp__nc_finish would wait for them all). */
static smp_status smp__nc_gather_start(void *data, smp_dtype dt, int64_t n, smp_group g, void **h) {
    *h = NULL;
    int size = smp_group_size(g), rank = smp_group_rank(g);
    int64_t piece = n / size;
    smp_tensor all = smp_tensor_1d(data, dt, n),
               mine = smp_tensor_1d((char *)data + (size_t)(piece * rank) * smp_dtype_size(dt), dt, piece);
    all.device = mine.device = SMP_CUDA(smp__nc.device);
    cudaEvent_t ev = NULL;
    SMP_TRY(smp__nc_event_get(&ev));
    smp_status st = smp__nc_collective(SMP__NC_ALL_GATHER, &mine, &all, SMP_SUM, 0, g, NULL, NULL, false);
    cudaError_t e = st ? cudaSuccess : cudaEventRecord(ev, smp__nc.stream);
    if (!st && e != cudaSuccess) st = smp__nc_cuda_fail(e, "cudaEventRecord");
    if (st) {
        smp__nc_event_put(ev);
        return st;
    }
    *h = (void *)ev;
    return SMP_OK;
}

static smp_status smp__nc_gather_copy(void *h, void *dst, const void *src, size_t bytes) {
    SMP__CU(cudaStreamWaitEvent, (smp__nc_engine, (cudaEvent_t)h, 0));
    SMP__CU(cudaMemcpyAsync, (dst, src, bytes, cudaMemcpyDeviceToDevice, smp__nc_engine));
    return SMP_OK;
}

static smp_status smp__nc_gather_end(void *h) {
    cudaError_t e = cudaStreamWaitEvent(smp__nc_engine, (cudaEvent_t)h, 0);
    smp__nc_event_put((cudaEvent_t)h);
    return e == cudaSuccess ? SMP_OK : smp__nc_cuda_fail(e, "cudaStreamWaitEvent");
}

/* The GPU this rank drives, as bytes comparable across the node's ranks. */
static smp_status smp__nc_probe(int count, unsigned char key[SMP__NC_KEY]) {
    smp__nc.device = smp_local_rank() % count;
    SMP__CU(cudaSetDevice, (smp__nc.device));
    struct cudaDeviceProp prop;
    memset(&prop, 0, sizeof prop);
    SMP__CU(cudaGetDeviceProperties, (&prop, smp__nc.device));
    snprintf(smp__nc.device_name, sizeof smp__nc.device_name, "%s", prop.name);
    memcpy(key, prop.uuid.bytes, 16);
    SMP__CU(cudaDeviceGetPCIBusId, ((char *)key + 16, SMP__NC_KEY - 17, smp__nc.device));
    int pools = 0;
    SMP__CU(cudaDeviceGetAttribute, (&pools, cudaDevAttrMemoryPoolsSupported, smp__nc.device));
    smp__nc.pools = pools != 0;
    SMP_TRY(smp__nc_make_stream(&smp__nc.stream));
    SMP__CU(cudaMalloc, ((void **)&smp__nc.dummy, 256));
    SMP__CU(cudaEventCreateWithFlags, (&smp__nc.ev_engine, cudaEventDisableTiming));
    SMP__CU(cudaEventCreateWithFlags, (&smp__nc.ev_done, cudaEventDisableTiming));
    SMP__CU(cudaEventCreateWithFlags, (&smp__nc.ev_sync, cudaEventDisableTiming));
    return SMP_OK;
}

/* Which local rank (other than this one) drives the same GPU; -1: none. */
static int smp__nc_shared_with(const unsigned char key[SMP__NC_KEY], int *node_size) {
    MPI_Comm node;
    int me = 0, n = 1, other = -1;
    *node_size = 1;
    /* start-up collectives the other ranks are in: their failures abort (MPI ERRORS in smp.h) */
    SMP__MPI_FATAL(MPI_Comm_split_type(smp__nc.mpi[SMP_WORLD], MPI_COMM_TYPE_SHARED, smp_rank(), MPI_INFO_NULL, &node),
                   "finding the ranks on this node (device backend start-up)");
    SMP__MPI_FATAL(MPI_Comm_rank(node, &me), "asking this rank's place on its node (device backend start-up)");
    SMP__MPI_FATAL(MPI_Comm_size(node, &n), "asking how many ranks share this node (device backend start-up)");
    *node_size = n;
    unsigned char *all = (unsigned char *)smp__alloc((size_t)n * SMP__NC_KEY, SMP__ALLOC_OTHER);
    /* the others wait in the gather */
    if (!all) smp__fatal("device backend start-up: out of memory comparing the GPUs of %d local ranks", n);
    {
        MPI_Request req;
        SMP__MPI_FATAL(MPI_Iallgather(key, SMP__NC_KEY, MPI_BYTE, all, SMP__NC_KEY, MPI_BYTE, node, &req),
                       "comparing the GPUs of this node's ranks");
        smp_wait_requests(1, &req, "the GPUs of this node's ranks", SMP_WORLD, -1);
        for (int j = 0; j < n && other < 0; j++) {
            if (j == me) continue;
            const unsigned char *k = all + (size_t)j * SMP__NC_KEY;
            bool same_uuid = memcmp(k, key, 16) == 0;
            bool same_bus = key[16] && strncmp((const char *)k + 16, (const char *)key + 16, SMP__NC_KEY - 16) == 0;
            if (same_uuid || same_bus) other = j;
        }
        smp_free(all);
    }
    SMP__MPI_WARN(MPI_Comm_free(&node), "releasing the node communicator (device backend start-up)");
    return other;
}

/* One NCCL communicator per distinct group, all started at once (nonblocking
   communicators), so the order in which groups come up cannot deadlock. */
static smp_status smp__nc_init_comms(void) {
    struct { int ok; ncclUniqueId id; } pkt[SMP_GROUP_COUNT];
    smp_status local = SMP_OK;
    int wsize = smp_group_size(SMP_WORLD);
    memset(pkt, 0, sizeof pkt);
    /* a group with the members of an earlier one, in its order, shares its communicator (with tensor_parallel_degree 1,
       PP_GROUP is MP_GROUP and RDP_GROUP is DP_GROUP); every member of the group decides alike */
    int *members = (int *)smp__alloc(sizeof(int) * 2 * (size_t)wsize, SMP__ALLOC_OTHER);
    if (!members) return smp_error(SMP_ERR_NOMEM, "device backend start-up: out of memory");
    for (int g = 1; g < SMP_GROUP_COUNT; g++)
        for (int h = 0; h < g && smp__nc.alias[g] == g; h++) {
            int n = smp_group_size((smp_group)g);
            if (smp__nc.alias[h] != h || smp_group_size((smp_group)h) != n) continue;
            smp_group_ranks((smp_group)g, members, n);
            smp_group_ranks((smp_group)h, members + wsize, n);
            if (!memcmp(members, members + wsize, sizeof(int) * (size_t)n)) smp__nc.alias[g] = h;
        }
    smp_free(members);
    for (int g = 0; g < SMP_GROUP_COUNT; g++) {
        if (smp__nc.alias[g] != g) continue;
        if (smp_group_rank((smp_group)g) == 0) {
            ncclResult_t r = ncclGetUniqueId(&pkt[g].id);
            pkt[g].ok = r == ncclSuccess;
            if (r != ncclSuccess && !local) local = smp__nc_nccl_fail(r, "ncclGetUniqueId", NULL);
        }
        MPI_Request req;
        SMP__MPI_FATAL(MPI_Ibcast(&pkt[g], (int)sizeof pkt[g], MPI_BYTE, 0, smp__nc.mpi[g], &req),
                       "sharing the NCCL unique id of the %s from its rank 0", smp__group_name((smp_group)g));
        smp_wait_requests(1, &req, "the NCCL unique id", (smp_group)g, 0);
    }
    int f = local != SMP_OK;
    SMP_TRY(smp__nc_agree(&f, 1, "NCCL unique ids"));
    if (f) return local; /* the rank that failed tells everyone, through smp_init */
    for (int g = 0; g < SMP_GROUP_COUNT && !local; g++) {
        if (smp__nc.alias[g] != g) continue;
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking = 0;
        ncclComm_t c = NULL;
        ncclResult_t r =
            ncclCommInitRankConfig(&c, smp_group_size((smp_group)g), pkt[g].id, smp_group_rank((smp_group)g), &cfg);
        if (r == ncclSuccess || r == ncclInProgress) smp__nc.comm[g] = c;
        else local = smp__nc_nccl_fail(r, "ncclCommInitRankConfig", NULL);
    }
    f = local != SMP_OK;
    SMP_TRY(smp__nc_agree(&f, 1, "NCCL communicator start-up"));
    if (f) { smp__nc_abort_all(); return local; } /* abort what started: nobody will finish it */
    smp__backoff b = smp__backoff_start();
    for (;;) {
        int pending = 0;
        for (int g = 0; g < SMP_GROUP_COUNT && !local; g++) {
            if (smp__nc.alias[g] != g || !smp__nc.comm[g]) continue;
            ncclResult_t state = ncclInProgress;
            ncclResult_t q = ncclCommGetAsyncError(smp__nc.comm[g], &state);
            if (q != ncclSuccess) state = q;
            if (state == ncclInProgress) pending++;
            else if (state != ncclSuccess)
                local = smp_error(SMP_ERR_DEVICE,
                                  "device backend start-up: the NCCL communicator of the %s failed to start: %s%s%s",
                                  smp__group_name((smp_group)g), ncclGetErrorString(state),
                                  *smp__nc_last(smp__nc.comm[g]) ? ": " : "", smp__nc_last(smp__nc.comm[g]));
        }
        if (local || !pending) break;
        if (!smp__backoff_pause(&b))
            smp__nc_timeout("the NCCL communicators to start (ncclCommInitRankConfig)", SMP_WORLD, -1,
                            MPI_Wtime() - b.start);
    }
    f = local != SMP_OK;
    SMP_TRY(smp__nc_agree(&f, 1, "NCCL communicators"));
    if (f) smp__nc_abort_all();
    return local;
}

static smp_status smp__nc_on_init(void) {
    smp__nc_reset();
    smp__nc.op = "device backend start-up";
    smp__nc.started = true;
    for (int g = 0; g < SMP_GROUP_COUNT; g++) /* same order on every rank: collective over each group */
        SMP__MPI_FATAL(MPI_Comm_dup(smp_group_comm((smp_group)g), &smp__nc.mpi[g]),
                       "copying the %s's communicator (device backend start-up)", smp__group_name((smp_group)g));
    smp__nc.have_mpi = true;
    int wsize = smp_size(), wrank = smp_rank();

    /* 1. this rank: the wanted path, its GPU */
    smp_status local = SMP_OK;
    int want = 0; /* 0 auto, 1 nccl, 2 staged */
    const char *env = getenv("SMP_NCCL");
    if (env && *env && strcmp(env, "auto") != 0) {
        if (strcmp(env, "nccl") == 0) want = 1;
        else if (strcmp(env, "staged") == 0) want = 2;
        else local = smp_error(SMP_ERR_CONFIG, "SMP_NCCL=%s: expected auto, nccl or staged", env);
    }
    const char *sync = getenv("SMP_NCCL_SYNC");
    smp__nc.sync_each = sync && *sync && strcmp(sync, "0") != 0;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        count = 0;
        snprintf(smp__nc.why, sizeof smp__nc.why, "cudaGetDeviceCount failed on world rank %d: %s", wrank,
                 cudaGetErrorString(e));
    } else if (count <= 0) {
        count = 0;
        snprintf(smp__nc.why, sizeof smp__nc.why, "world rank %d sees no CUDA device (cudaGetDeviceCount: 0)", wrank);
    }
    unsigned char key[SMP__NC_KEY];
    memset(key, 0, sizeof key);
    if (!local && count > 0) local = smp__nc_probe(count, key);
    int v[4] = {local != SMP_OK, count == 0 ? wsize - wrank : 0, want == 2, want == 1};
    SMP_TRY(smp__nc_agree(v, 4, "the device backend's start-up"));
    if (v[0]) return local;
    if (v[1]) { /* some rank has no GPU: host-only, on every rank */
        if (count > 0)
            snprintf(smp__nc.why, sizeof smp__nc.why,
                     "world rank %d has no CUDA device, and device tensors need one on every rank", wsize - v[1]);
        smp__nc.mode = SMP_NCCL_MODE_NONE;
        smp__nc.up = true;
        snprintf(smp__nc.desc, sizeof smp__nc.desc, "none: no CUDA device (%s)", smp__nc.why);
        if (wrank == 0) smp__log(SMP_LOG_INFO, "device backend: %s", smp__nc.desc);
        return SMP_OK;
    }

    /* 2. ranks of a node sharing a GPU cannot use NCCL */
    int node_size = 1;
    int other = smp__nc_shared_with(key, &node_size);
    if (other >= 0 && v[3])
        local = smp_error(
            SMP_ERR_DEVICE,
            "SMP_NCCL=nccl, but this rank and local rank %d drive the same GPU (device %d, %s): NCCL needs "
            "one GPU per rank, and this node runs %d ranks on %d GPU(s); unset SMP_NCCL to move device tensors "
            "through host memory instead",
            other, smp__nc.device, (const char *)key + 16, node_size, count);
    int w[2] = {local != SMP_OK, other >= 0};
    SMP_TRY(smp__nc_agree(w, 2, "whether GPUs are shared"));
    if (w[0]) return local;
    smp__nc.mode = v[2] || w[1] ? SMP_NCCL_MODE_STAGED : SMP_NCCL_MODE_NCCL;
    if (smp__nc.mode == SMP_NCCL_MODE_NCCL) SMP_TRY(smp__nc_init_comms());

    int version = 0;
    (void)ncclGetVersion(&version);
    snprintf(smp__nc.desc, sizeof smp__nc.desc, "%s: CUDA device %d (%s), NCCL %d.%d.%d%s",
             smp_nccl_mode_name(smp__nc.mode), smp__nc.device, smp__nc.device_name, version / 10000,
             version / 100 % 100, version % 100,
             smp__nc.mode == SMP_NCCL_MODE_STAGED
                 ? (v[2] ? ", host-staged by SMP_NCCL=staged" : ", host-staged: ranks share GPUs")
                 : "");
    if (wrank == 0) {
        if (smp__nc.mode == SMP_NCCL_MODE_STAGED && !v[2])
            smp__log(SMP_LOG_WARN, "device backend: local ranks share GPUs (NCCL needs one GPU per rank); device "
                                   "tensors move through pinned host memory over MPI");
        smp__log(SMP_LOG_INFO, "device backend: %s", smp__nc.desc);
    }
    smp__nc.up = true;
    return SMP_OK;
}

/* Closes every live communicator: ncclCommFinalize on all of them first,
   then waits for all (finalizing may wait for the peers, so closing one at
   a time could deadlock on the order), then ncclCommDestroy. Communicators
   that fail are aborted. */
static void smp__nc_close_all(void) {
    int n = 0;
    for (int g = 0; g < SMP_GROUP_COUNT; g++) {
        if (smp__nc.alias[g] == g && smp__nc.comm[g] && !smp__nc.comm_dead[g]) n++;
        for (int i = 0; i < smp__nc.nchans[g]; i++)
            if (smp__nc.chans[g][i] && smp__nc.chans[g][i]->comm && !smp__nc.chans[g][i]->dead) n++;
    }
    if (!n) return;
    ncclComm_t *c = (ncclComm_t *)smp__alloc(sizeof(ncclComm_t) * (size_t)n, SMP__ALLOC_OTHER);
    /* 0 finalizing, 1 finalized, 2 aborted */
    int *state = (int *)smp__alloc(sizeof(int) * (size_t)n, SMP__ALLOC_OTHER);
    if (!c || !state) {
        smp_free(c);
        smp_free(state);
        smp__log(SMP_LOG_WARN, "device backend shut-down: out of memory; aborting the NCCL communicators");
        smp__nc_abort_all();
        return;
    }
    int k = 0;
    for (int g = 0; g < SMP_GROUP_COUNT; g++) {
        if (smp__nc.alias[g] == g && smp__nc.comm[g] && !smp__nc.comm_dead[g]) c[k++] = smp__nc.comm[g];
        for (int i = 0; i < smp__nc.nchans[g]; i++)
            if (smp__nc.chans[g][i] && smp__nc.chans[g][i]->comm && !smp__nc.chans[g][i]->dead)
                c[k++] = smp__nc.chans[g][i]->comm;
    }
    for (int i = 0; i < n; i++) {
        ncclResult_t r = ncclCommFinalize(c[i]);
        state[i] = r == ncclSuccess || r == ncclInProgress ? 0 : 2;
        if (state[i] == 2) {
            smp__log(SMP_LOG_WARN, "device backend shut-down: ncclCommFinalize failed (%s); aborting the communicator",
                     ncclGetErrorString(r));
            (void)ncclCommAbort(c[i]);
        }
    }
    smp__backoff b = smp__backoff_start();
    for (;;) {
        int pending = 0;
        for (int i = 0; i < n; i++) {
            if (state[i] != 0) continue;
            ncclResult_t s = ncclInProgress;
            ncclResult_t q = ncclCommGetAsyncError(c[i], &s);
            if (q != ncclSuccess) s = q;
            if (s == ncclInProgress) pending++;
            else if (s == ncclSuccess) state[i] = 1;
            else {
                smp__log(SMP_LOG_WARN,
                         "device backend shut-down: finalizing an NCCL communicator failed (%s); aborting it",
                         ncclGetErrorString(s));
                (void)ncclCommAbort(c[i]);
                state[i] = 2;
            }
        }
        if (!pending) break;
        if (!smp__backoff_pause(&b))
            smp__nc_timeout("the NCCL communicators to finalize (every rank must call smp_finalize)", SMP_WORLD, -1,
                            MPI_Wtime() - b.start);
    }
    for (int i = 0; i < n; i++) {
        if (state[i] != 1) continue;
        ncclResult_t r = ncclCommDestroy(c[i]);
        if (r != ncclSuccess) {
            smp__log(SMP_LOG_WARN, "device backend shut-down: ncclCommDestroy failed (%s); aborting the communicator",
                     ncclGetErrorString(r));
            (void)ncclCommAbort(c[i]);
        }
    }
    smp_free(c);
    smp_free(state);
}

static void smp__nc_on_finalize(void) {
    if (!smp__nc.started) return;
    smp__nc.op = "smp_finalize";
    if (smp__nc.up && smp__nc.mode != SMP_NCCL_MODE_NONE && smp__nc.stream) {
        if (smp__nc_stream_idle(smp__nc.stream, "smp's device work to finish", SMP_WORLD, -1) != SMP_OK)
            smp__log(SMP_LOG_WARN, "device backend shut-down: %s", smp_last_error());
        if (smp__nc.offload_stream &&
            smp__nc_stream_idle(smp__nc.offload_stream, "activation offloading's copies to finish", SMP_WORLD, -1))
            smp__log(SMP_LOG_WARN, "device backend shut-down: %s", smp_last_error());
        for (int g = 0; g < SMP_GROUP_COUNT; g++)
            for (int i = 0; i < smp__nc.nchans[g]; i++) {
                smp__nc_chan *c = smp__nc.chans[g][i];
                if (c && !c->dead &&
                    smp__nc_stream_idle(c->stream,
                                        i % 2 ? "point-to-point receives to finish" : "point-to-point sends to finish",
                                        (smp_group)g, i / 2) != SMP_OK)
                    smp__log(SMP_LOG_WARN, "device backend shut-down: %s", smp_last_error());
            }
    }
    smp__nc_close_all();
    for (int g = 0; g < SMP_GROUP_COUNT; g++) {
        for (int i = 0; i < smp__nc.nchans[g]; i++) {
            smp__nc_chan *c = smp__nc.chans[g][i];
            if (!c) continue;
            if (c->stream) (void)cudaStreamDestroy(c->stream);
            smp_free(c);
        }
        smp_free(smp__nc.chans[g]);
    }
    for (int i = 0; i < smp__nc.npins; i++) {
        (void)cudaFreeHost(smp__nc.pins[i].p);
        (void)cudaEventDestroy(smp__nc.pins[i].ev);
    }
    smp_free(smp__nc.pins);
    for (int i = 0; i < smp__nc.nblocks; i++) { /* blocks still handed out stay the engine's */
        if (smp__nc.blocks[i].cached) (void)cudaFree(smp__nc.blocks[i].p);
        (void)cudaEventDestroy(smp__nc.blocks[i].ev);
    }
    smp_free(smp__nc.blocks);
    for (int i = 0; i < smp__nc.nevents; i++) (void)cudaEventDestroy(smp__nc.events[i]);
    smp_free(smp__nc.events);
    smp_free(smp__nc.a2a);
    if (smp__nc.ev_engine) (void)cudaEventDestroy(smp__nc.ev_engine);
    if (smp__nc.ev_done) (void)cudaEventDestroy(smp__nc.ev_done);
    if (smp__nc.ev_sync) (void)cudaEventDestroy(smp__nc.ev_sync);
    if (smp__nc.stream) (void)cudaStreamDestroy(smp__nc.stream);
    if (smp__nc.offload_stream) (void)cudaStreamDestroy(smp__nc.offload_stream);
    if (smp__nc.dummy) (void)cudaFree(smp__nc.dummy);
    for (int g = 0; g < SMP_GROUP_COUNT; g++)
        if (smp__nc.mpi[g] != MPI_COMM_NULL)
            SMP__MPI_WARN(MPI_Comm_free(&smp__nc.mpi[g]), "releasing the device backend's copy of the %s",
                          smp__group_name((smp_group)g));
    smp__nc_reset();
}

/* ---------------------------------------------------------------- point to point */
static smp_status smp__nc_peer_arg(smp_group g, int peer) {
    if ((unsigned)g >= SMP_GROUP_COUNT) return smp_error(SMP_ERR_ARG, "%s: unknown group %d", smp__nc_opname(), (int)g);
    int n = smp_group_size(g);
    if (peer < 0 || peer >= n)
        return smp_error(SMP_ERR_ARG, "%s: rank %d is outside the %s (size %d)", smp__nc_opname(), peer,
                         smp__group_name(g), n);
    if (peer == smp_group_rank(g)) return smp_error(SMP_ERR_ARG, "%s: rank %d is this rank", smp__nc_opname(), peer);
    return SMP_OK;
}

static smp_nccl_request *smp__nc_req_new(smp_group g, int peer, int kind) {
    smp_nccl_request *r = (smp_nccl_request *)smp__alloc(sizeof *r, SMP__ALLOC_OTHER);
    if (!r) return NULL;
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->g = g;
    r->peer = peer;
    r->mpi = MPI_REQUEST_NULL;
    r->pin = -1;
    return r;
}

/* Polls the channels to todo[0..nt) of group g until none is in progress
   (`doing`: "start" for their communicators, "connect" for their first
   transfer), under the deadline. */
static smp_status smp__nc_chans_wait(smp_group g, const int *todo, int nt, const char *doing) {
    smp__backoff b = smp__backoff_start();
    for (;;) {
        int pending = 0;
        for (int k = 0; k < nt; k++)
            for (int dir = 0; dir < 2; dir++) {
                smp__nc_chan *c = smp__nc.chans[g][2 * todo[k] + dir];
                ncclResult_t state = ncclInProgress;
                ncclResult_t q = ncclCommGetAsyncError(c->comm, &state);
                if (q != ncclSuccess) state = q;
                if (state == ncclInProgress) pending++;
                else if (state != ncclSuccess)
                    return smp_error(
                        SMP_ERR_DEVICE, "smp_nccl_p2p_connect: the channel %s %s rank %d failed to %s: %s%s%s",
                        dir == 0 ? "to" : "from", smp__group_name(g), todo[k], doing, ncclGetErrorString(state),
                        *smp__nc_last(c->comm) ? ": " : "", smp__nc_last(c->comm));
            }
        if (!pending) return SMP_OK;
        if (!smp__backoff_pause(&b)) {
            char what[128];
            snprintf(what, sizeof what, "point-to-point channels to %s (the peer must call smp_nccl_p2p_connect too)",
                     doing);
            smp__nc_timeout(what, g, todo[0], MPI_Wtime() - b.start);
        }
    }
}

/* NCCL connects the two ranks of a channel lazily, at their first send and
   receive, and on a nonblocking communicator that first call stays "in
   progress" until the peer has made its own. Left to the first real
   transfer, a receive queued early would hold this rank's host until the
   peer's first send - and a ring of such receives would wait forever. So
   every new channel carries one byte here, all channels at once, and later
   transfers never wait on the host for a peer. */
static smp_status smp__nc_warm_up(smp_group g, const int *todo, int nt) {
    smp_status st = SMP_OK;
    for (int k = 0; k < nt && !st; k++)
        for (int dir = 0; dir < 2 && !st; dir++) {
            smp__nc_chan *c = smp__nc.chans[g][2 * todo[k] + dir];
            ncclResult_t r =
                dir == 0 ? ncclSend(smp__nc.dummy, 1, ncclUint8, c->peer, c->comm, c->stream)
                         : ncclRecv(smp__nc.dummy + 1 + (2 * k + dir) % 255, 1, ncclUint8, c->peer, c->comm, c->stream);
            if (r != ncclSuccess && r != ncclInProgress)
                st = smp__nc_nccl_fail(r, dir == 0 ? "ncclSend" : "ncclRecv", c->comm);
        }
    return st ? st : smp__nc_chans_wait(g, todo, nt, "connect");
}

SMPDEF smp_status smp_nccl_p2p_connect(smp_group g, const int *peers, int npeers) {
    SMP_TRY(smp__nc_ready("smp_nccl_p2p_connect"));
    if (npeers < 0 || (npeers && !peers)) return smp_error(SMP_ERR_ARG, "smp_nccl_p2p_connect: no peer list");
    for (int i = 0; i < npeers; i++) SMP_TRY(smp__nc_peer_arg(g, peers[i]));
    if (smp__nc.mode == SMP_NCCL_MODE_STAGED) return SMP_OK; /* MPI needs nothing */
    int n = smp_group_size(g);
    if (!smp__nc.chans[g]) {
        smp__nc.chans[g] = (smp__nc_chan **)smp__alloc(sizeof(smp__nc_chan *) * 2 * (size_t)n, SMP__ALLOC_OTHER);
        if (!smp__nc.chans[g]) return smp_error(SMP_ERR_NOMEM, "smp_nccl_p2p_connect: out of memory");
        memset(smp__nc.chans[g], 0, sizeof(smp__nc_chan *) * 2 * (size_t)n);
        smp__nc.nchans[g] = 2 * n;
    }
    /* the peers not connected yet, each once */
    int *todo = (int *)smp__alloc(sizeof(int) * (size_t)(npeers ? npeers : 1), SMP__ALLOC_OTHER);
    typedef struct { int ok; ncclUniqueId id; } idpkt;
    idpkt *mine = (idpkt *)smp__alloc(sizeof(idpkt) * 2 * (size_t)(npeers ? npeers : 1), SMP__ALLOC_OTHER);
    MPI_Request *reqs =
        (MPI_Request *)smp__alloc(sizeof(MPI_Request) * 2 * (size_t)(npeers ? npeers : 1), SMP__ALLOC_OTHER);
    smp_status st = SMP_OK;
    int nt = 0;
    if (!todo || !mine || !reqs) { st = smp_error(SMP_ERR_NOMEM, "smp_nccl_p2p_connect: out of memory"); goto done; }
    for (int i = 0; i < npeers; i++) {
        int p = peers[i];
        bool seen = smp__nc.chans[g][2 * p] != NULL;
        for (int j = 0; j < nt && !seen; j++) seen = todo[j] == p;
        if (!seen) todo[nt++] = p;
    }
    if (!nt) goto done;
    /* ids: this rank creates the id of each channel it sends on */
    memset(mine, 0, sizeof(idpkt) * 2 * (size_t)nt);
    for (int k = 0; k < nt; k++) {
        ncclResult_t r = ncclGetUniqueId(&mine[2 * k].id);
        mine[2 * k].ok = r == ncclSuccess;
        if (r != ncclSuccess && !st) st = smp__nc_nccl_fail(r, "ncclGetUniqueId", NULL);
        /* the peer waits for this id: a failure here cannot reach it */
        SMP__MPI_FATAL(MPI_Isend(&mine[2 * k], (int)sizeof(idpkt), MPI_BYTE, todo[k], SMP__NC_TAG_CONNECT,
                                 smp__nc.mpi[g], &reqs[2 * k]),
                       "sending a channel's NCCL id to %s rank %d", smp__group_name(g), todo[k]);
        SMP__MPI_FATAL(MPI_Irecv(&mine[2 * k + 1], (int)sizeof(idpkt), MPI_BYTE, todo[k], SMP__NC_TAG_CONNECT,
                                 smp__nc.mpi[g], &reqs[2 * k + 1]),
                       "receiving a channel's NCCL id from %s rank %d", smp__group_name(g), todo[k]);
    }
    smp_wait_requests(2 * nt, reqs, "point-to-point channel set-up (NCCL ids)", g, -1);
    if (st) goto done;
    for (int k = 0; k < nt; k++)
        if (!mine[2 * k + 1].ok) {
            st = smp_error(SMP_ERR_DEVICE, "smp_nccl_p2p_connect: %s rank %d could not create an NCCL id",
                           smp__group_name(g), todo[k]);
            goto done;
        }
    /* start every channel, then wait for all: no order between peers matters */
    for (int k = 0; k < nt && !st; k++) {
        for (int dir = 0; dir < 2 && !st; dir++) {
            smp__nc_chan *c = (smp__nc_chan *)smp__alloc(sizeof *c, SMP__ALLOC_OTHER);
            if (!c) { st = smp_error(SMP_ERR_NOMEM, "smp_nccl_p2p_connect: out of memory"); break; }
            memset(c, 0, sizeof *c);
            c->peer = dir == 0 ? 1 : 0; /* the sending side is rank 0 of the channel */
            smp__nc.chans[g][2 * todo[k] + dir] = c;
            if ((st = smp__nc_make_stream(&c->stream))) break;
            ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
            cfg.blocking = 0;
            ncclResult_t r = ncclCommInitRankConfig(&c->comm, 2, mine[2 * k + dir].id, dir == 0 ? 0 : 1, &cfg);
            if (r != ncclSuccess && r != ncclInProgress) {
                c->comm = NULL;
                st = smp__nc_nccl_fail(r, "ncclCommInitRankConfig", NULL);
            }
        }
    }
    if (!st) st = smp__nc_chans_wait(g, todo, nt, "start");
    if (!st) st = smp__nc_warm_up(g, todo, nt);
    if (st) { /* undo this call's channels */
        for (int k = 0; k < nt; k++)
            for (int dir = 0; dir < 2; dir++) {
                smp__nc_chan *c = smp__nc.chans[g][2 * todo[k] + dir];
                if (!c) continue;
                if (c->comm) (void)ncclCommAbort(c->comm);
                if (c->stream) (void)cudaStreamDestroy(c->stream);
                smp_free(c);
                smp__nc.chans[g][2 * todo[k] + dir] = NULL;
            }
    }
done:
    smp_free(todo);
    smp_free(mine);
    smp_free(reqs);
    return st;
}

static smp_status smp__nc_chan_of(smp_group g, int peer, int dir, smp__nc_chan **out) {
    smp__nc_chan *c = smp__nc.chans[g] ? smp__nc.chans[g][2 * peer + dir] : NULL;
    *out = c;
    if (!c)
        return smp_error(SMP_ERR_STATE, "%s: no channel %s %s rank %d: call smp_nccl_p2p_connect on both ranks first",
                         smp__nc_opname(), dir == 0 ? "to" : "from", smp__group_name(g), peer);
    if (c->dead)
        return smp_error(SMP_ERR_DEVICE, "%s: the channel %s %s rank %d was aborted after an earlier error",
                         smp__nc_opname(), dir == 0 ? "to" : "from", smp__group_name(g), peer);
    return SMP_OK;
}

/* NCCL: queue on the channel's stream after the engine; record completion. */
static smp_status smp__nc_p2p_nccl(smp_nccl_request *r, void *buf, size_t bytes, int dir) {
    smp__nc_chan *c;
    SMP_TRY(smp__nc_chan_of(r->g, r->peer, dir, &c));
    SMP_TRY(smp__nc_after_engine(c->stream));
    if (dir == 0) SMP__NC(c->comm, r->g, ncclSend, (buf, bytes, ncclUint8, c->peer, c->comm, c->stream));
    else SMP__NC(c->comm, r->g, ncclRecv, (buf, bytes, ncclUint8, c->peer, c->comm, c->stream));
    SMP_TRY(smp__nc_event_get(&r->ev));
    cudaError_t e = cudaEventRecord(r->ev, c->stream);
    if (e != cudaSuccess) { smp__nc_event_put(r->ev); r->ev = NULL; return smp__nc_cuda_fail(e, "cudaEventRecord"); }
    r->chan = c;
    r->kind = SMP__NC_REQ_NCCL;
    return SMP_OK;
}

/* smp_nccl_isend (dir 0) and smp_nccl_irecv (dir 1). */
static smp_status smp__nc_p2p_start(const char *fn, void *buf, size_t bytes, int peer, smp_group g,
                                    smp_nccl_request **req, int dir) {
    if (!req) return smp_error(SMP_ERR_ARG, "%s: req is NULL", fn);
    *req = NULL;
    SMP_TRY(smp__nc_ready(fn));
    SMP_TRY(smp__nc_peer_arg(g, peer));
    SMP_TRY(smp__nc_check_ptr("the buffer", buf, SMP_CUDA(smp__nc.device), bytes));
    smp_nccl_request *r = smp__nc_req_new(g, peer, SMP__NC_REQ_DONE);
    if (!r) return smp_error(SMP_ERR_NOMEM, "%s: out of memory", fn);
    r->dst = buf;
    r->bytes = bytes;
    smp_status st = SMP_OK;
    if (bytes && smp__nc.mode == SMP_NCCL_MODE_NCCL) {
        st = smp__nc_p2p_nccl(r, buf, bytes, dir);
    } else if (bytes > (size_t)INT_MAX) { /* staged: one MPI message from or to a pinned buffer */
        st = smp_error(SMP_ERR_ARG, "%s: %zu bytes is more than one host-staged message carries (2 GiB)", fn, bytes);
    } else if (bytes && dir == 0) {
        st = smp__nc_to_host(buf, bytes, &r->pin, "a device buffer to reach the host", g, peer);
        if (!st)
            st = SMP__MPI_CHECK(
                MPI_Isend(smp__nc.pins[r->pin].p, (int)bytes, MPI_BYTE, peer, SMP__NC_TAG_P2P, smp__nc.mpi[g], &r->mpi),
                "sending a host-staged device buffer (%s) to %s rank %d", fn, smp__group_name(g), peer);
        r->kind = SMP__NC_REQ_STAGED_SEND;
    } else if (bytes && !(st = smp__nc_pin_get(bytes, &r->pin))) {
        st = SMP__MPI_CHECK(
            MPI_Irecv(smp__nc.pins[r->pin].p, (int)bytes, MPI_BYTE, peer, SMP__NC_TAG_P2P, smp__nc.mpi[g], &r->mpi),
            "receiving a host-staged device buffer (%s) from %s rank %d", fn, smp__group_name(g), peer);
        r->kind = SMP__NC_REQ_STAGED_RECV;
    }
    if (st) {
        smp__nc_pin_put(r->pin); /* no copy from it is queued: smp__nc_to_host waited for its own */
        smp_free(r);
        return st;
    }
    *req = r;
    return SMP_OK;
}

SMPDEF smp_status smp_nccl_isend(const void *buf, size_t bytes, int peer, smp_group g, smp_nccl_request **req) {
    /* a send only reads buf */
    return smp__nc_p2p_start("smp_nccl_isend", (void *)(uintptr_t)buf, bytes, peer, g, req, 0);
}

SMPDEF smp_status smp_nccl_irecv(void *buf, size_t bytes, int peer, smp_group g, smp_nccl_request **req) {
    return smp__nc_p2p_start("smp_nccl_irecv", buf, bytes, peer, g, req, 1);
}

SMPDEF smp_status smp_nccl_test(smp_nccl_request *r, bool *done) {
    SMP_TRY(smp__nc_ready("smp_nccl_test"));
    if (!r || !done) return smp_error(SMP_ERR_ARG, "smp_nccl_test: %s is NULL", r ? "done" : "the request");
    *done = false;
    switch (r->kind) {
    case SMP__NC_REQ_NCCL: {
        cudaError_t e = cudaEventQuery(r->ev);
        if (e == cudaSuccess) { *done = true; return SMP_OK; }
        if (e != cudaErrorNotReady) return smp__nc_cuda_fail(e, "cudaEventQuery");
        return smp__nc_check_comm(r->chan->comm, &r->chan->dead, "point-to-point", "a transfer (smp_nccl_test)");
    }
    case SMP__NC_REQ_STAGED_SEND:
    case SMP__NC_REQ_STAGED_RECV: {
        int flag = 0;
        if (r->mpi == MPI_REQUEST_NULL) { *done = true; return SMP_OK; }
        MPI_Status s;
        SMP__MPI(MPI_Test(&r->mpi, &flag, &s), "completing a host-staged device %s with %s rank %d (smp_nccl_test)",
                 r->kind == SMP__NC_REQ_STAGED_SEND ? "send" : "receive", smp__group_name(r->g), r->peer);
        *done = flag != 0;
        return SMP_OK;
    }
    default: *done = true; return SMP_OK;
    }
}

SMPDEF smp_status smp_nccl_wait(smp_nccl_request *r) {
    SMP_TRY(smp__nc_ready("smp_nccl_wait"));
    if (!r) return smp_error(SMP_ERR_ARG, "smp_nccl_wait: the request is NULL");
    smp_status st = SMP_OK;
    if (r->kind == SMP__NC_REQ_NCCL) {
        cudaError_t e = cudaStreamWaitEvent(smp__nc_engine, r->ev, 0);
        if (e != cudaSuccess) st = smp__nc_cuda_fail(e, "cudaStreamWaitEvent");
        else if (smp__nc.sync_each) st = smp__nc_wait_event(r->ev, "a point-to-point transfer", r->g, r->peer);
        smp__nc_event_put(r->ev);
    } else if (r->kind == SMP__NC_REQ_STAGED_SEND || r->kind == SMP__NC_REQ_STAGED_RECV) {
        bool recv = r->kind == SMP__NC_REQ_STAGED_RECV;
        smp_wait_requests(1, &r->mpi,
                          recv ? "a device buffer (host-staged receive)"
                               : "a device buffer to be received (host-staged send)",
                          r->g, r->peer);
        if (recv && !(st = smp__nc_after_engine(smp__nc.stream)))
            st = smp__nc_from_host(r->dst, r->pin, r->bytes, "a host-staged receive", r->g);
        else
            smp__nc_pin_put(r->pin); /* a send's message has left it; no copy from it is queued */
    }
    smp_free(r);
    return st;
}

/* ---------------------------------------------------------------- device memory, add */
SMPDEF void *smp_nccl_alloc(size_t bytes) {
    if (smp__nc_ready("smp_nccl_alloc")) return NULL;
    void *p = NULL;
    return smp__nc_dev_alloc(&p, bytes, smp__nc_engine) == SMP_OK ? p : NULL;
}

SMPDEF void smp_nccl_free(void *p) {
    if (!p || smp__nc_ready("smp_nccl_free")) return;
    if (smp__nc_dev_free(p, smp__nc_engine) != SMP_OK) smp__log(SMP_LOG_WARN, "smp_nccl_free: %s", smp_last_error());
}

#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_bf16.h>
/* Grid-stride loops; halves go through f32 like smp's host arithmetic. */
template <typename T> __global__ void smp__nc_add_kernel(T *d, const T *s, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        d[i] = (T)(d[i] + s[i]);
}
__global__ void smp__nc_add_f16(__half *d, const __half *s, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        d[i] = __float2half_rn(__half2float(d[i]) + __half2float(s[i]));
}
__global__ void smp__nc_add_bf16(__nv_bfloat16 *d, const __nv_bfloat16 *s, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        d[i] = __float2bfloat16_rn(__bfloat162float(d[i]) + __bfloat162float(s[i]));
}
/* f32 multiplies by the f32 factor and f64 by the f64 one, as smp does on the host */
template <typename T> __global__ void smp__nc_scale_kernel(T *d, T by, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        d[i] = d[i] * by;
}
__global__ void smp__nc_scale_f16(__half *d, float by, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        d[i] = __float2half_rn(__fmul_rn(__half2float(d[i]), by));
}
__global__ void smp__nc_scale_bf16(__nv_bfloat16 *d, float by, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        d[i] = __float2bfloat16_rn(__fmul_rn(__bfloat162float(d[i]), by));
}
#endif

SMPDEF smp_status smp_nccl_add(void *dst, const void *src, smp_dtype dt, int64_t n) {
    SMP_TRY(smp__nc_ready("smp_nccl_add"));
    if (n < 0) return smp_error(SMP_ERR_ARG, "smp_nccl_add: negative count %lld", (long long)n);
    size_t bytes = (size_t)n * smp_dtype_size(dt);
    if (!smp_dtype_size(dt)) return smp_error(SMP_ERR_ARG, "smp_nccl_add: invalid dtype %d", (int)dt);
    if (!n) return SMP_OK;
    SMP_TRY(smp__nc_check_ptr("dst", dst, SMP_CUDA(smp__nc.device), bytes));
    SMP_TRY(smp__nc_check_ptr("src", src, SMP_CUDA(smp__nc.device), bytes));
#ifdef __CUDACC__
    long long nn = (long long)n;
    unsigned grid = (unsigned)((nn + 255) / 256 < 4096 ? (nn + 255) / 256 : 4096);
    cudaStream_t s = smp__nc_engine;
    switch (dt) {
    case SMP_F32: smp__nc_add_kernel<float><<<grid, 256, 0, s>>>((float *)dst, (const float *)src, nn); break;
    case SMP_F64: smp__nc_add_kernel<double><<<grid, 256, 0, s>>>((double *)dst, (const double *)src, nn); break;
    case SMP_I32: smp__nc_add_kernel<int32_t><<<grid, 256, 0, s>>>((int32_t *)dst, (const int32_t *)src, nn); break;
    case SMP_I64: smp__nc_add_kernel<int64_t><<<grid, 256, 0, s>>>((int64_t *)dst, (const int64_t *)src, nn); break;
    case SMP_F16: smp__nc_add_f16<<<grid, 256, 0, s>>>((__half *)dst, (const __half *)src, nn); break;
    case SMP_BF16: smp__nc_add_bf16<<<grid, 256, 0, s>>>((__nv_bfloat16 *)dst, (const __nv_bfloat16 *)src, nn); break;
    default: smp__nc_add_kernel<uint8_t><<<grid, 256, 0, s>>>((uint8_t *)dst, (const uint8_t *)src, nn); break;
    }
    SMP__CU(cudaGetLastError, ());
    return SMP_OK;
#else
    return smp_error(
        SMP_ERR_STATE,
        "smp_nccl_add: needs smp_nccl.h's implementation compiled by nvcc (define SMP_IMPLEMENTATION in a .cu file)");
#endif
}

/* The backend's scale and zero (smp_device_backend): data *= by for f32,
   f64, f16 and bf16 (halves through f32; other dtypes are left alone), and
   bytes cleared, on the engine stream. */
static smp_status smp__nc_scale(void *data, smp_dtype dt, int64_t n, double by) {
    SMP_TRY(smp__nc_ready("smp__nc_scale"));
    if (n < 0) return smp_error(SMP_ERR_ARG, "smp__nc_scale: negative count %lld", (long long)n);
    if (!smp_dtype_size(dt)) return smp_error(SMP_ERR_ARG, "smp__nc_scale: invalid dtype %d", (int)dt);
    if (!n || (dt != SMP_F32 && dt != SMP_F64 && dt != SMP_F16 && dt != SMP_BF16)) return SMP_OK;
    SMP_TRY(smp__nc_check_ptr("data", data, SMP_CUDA(smp__nc.device), (size_t)n * smp_dtype_size(dt)));
#ifdef __CUDACC__
    long long nn = (long long)n;
    unsigned grid = (unsigned)((nn + 255) / 256 < 4096 ? (nn + 255) / 256 : 4096);
    cudaStream_t s = smp__nc_engine;
    switch (dt) {
    case SMP_F32: smp__nc_scale_kernel<float><<<grid, 256, 0, s>>>((float *)data, (float)by, nn); break;
    case SMP_F64: smp__nc_scale_kernel<double><<<grid, 256, 0, s>>>((double *)data, by, nn); break;
    case SMP_F16: smp__nc_scale_f16<<<grid, 256, 0, s>>>((__half *)data, (float)by, nn); break;
    default: smp__nc_scale_bf16<<<grid, 256, 0, s>>>((__nv_bfloat16 *)data, (float)by, nn); break;
    }
    SMP__CU(cudaGetLastError, ());
    return SMP_OK;
#else
    (void)by;
    return smp_error(
        SMP_ERR_STATE,
        "smp__nc_scale: needs smp_nccl.h's implementation compiled by nvcc (define SMP_IMPLEMENTATION in a .cu file)");
#endif
}

static smp_status smp__nc_zero(void *p, size_t bytes) {
    SMP_TRY(smp__nc_ready("smp__nc_zero"));
    if (!bytes) return SMP_OK;
    SMP_TRY(smp__nc_check_ptr("the buffer", p, SMP_CUDA(smp__nc.device), bytes));
    SMP__CU(cudaMemsetAsync, (p, 0, bytes, smp__nc_engine));
    return SMP_OK;
}

/* ---------------------------------------------------------------- public helpers */
SMPDEF smp_status smp_nccl_copy(void *dst, int dst_device, const void *src, int src_device, size_t n) {
    return smp__nc_copy(dst, dst_device, src, src_device, n);
}

SMPDEF smp_status smp_nccl_synchronize(void) {
    SMP_TRY(smp__nc_ready("smp_nccl_synchronize"));
    SMP_TRY(smp__nc_stream_idle(smp__nc.stream, "smp's device work (smp_nccl_synchronize)", SMP_WORLD, -1));
    for (int g = 0; g < SMP_GROUP_COUNT; g++)
        for (int i = 0; i < smp__nc.nchans[g]; i++) {
            smp__nc_chan *c = smp__nc.chans[g][i];
            if (c && !c->dead)
                SMP_TRY(smp__nc_stream_idle(c->stream,
                                            i % 2 ? "point-to-point receives (smp_nccl_synchronize)"
                                                  : "point-to-point sends (smp_nccl_synchronize)",
                                            (smp_group)g, i / 2));
        }
    return smp__nc.mode == SMP_NCCL_MODE_NCCL ? smp__nc_poll_async("smp_nccl_synchronize") : SMP_OK;
}

SMPDEF smp_nccl_mode smp_nccl_current_mode(void) { return smp__nc.up ? smp__nc.mode : SMP_NCCL_MODE_NONE; }
SMPDEF const char *smp_nccl_mode_name(smp_nccl_mode m) {
    return m == SMP_NCCL_MODE_NCCL ? "nccl" : m == SMP_NCCL_MODE_STAGED ? "staged" : "none";
}
SMPDEF const char *smp_nccl_describe(void) { return smp__nc.up ? smp__nc.desc : "none: smp_init has not run"; }
SMPDEF int smp_nccl_device(void) {
    return smp__nc.up && smp__nc.mode != SMP_NCCL_MODE_NONE ? SMP_CUDA(smp__nc.device) : SMP_HOST;
}
SMPDEF void smp_nccl_set_stream(cudaStream_t s) { smp__nc_engine = s; }
SMPDEF cudaStream_t smp_nccl_stream(void) { return smp__nc_engine; }
SMPDEF ncclComm_t smp_nccl_comm(smp_group g) {
    if (!smp__nc.up || smp__nc.mode != SMP_NCCL_MODE_NCCL || (unsigned)g >= SMP_GROUP_COUNT) return NULL;
    return smp__nc.comm[smp__nc.alias[g]];
}

#ifdef SMP_DEVICE_BACKEND_P2P
/* The backend table's point-to-point entries (see smp.h), with opaque requests. */
static smp_status smp__nc_b_isend(const void *buf, size_t bytes, int peer, smp_group g, void **req) {
    smp_nccl_request *r = NULL;
    smp_status st = smp_nccl_isend(buf, bytes, peer, g, &r);
    *req = r;
    return st;
}
static smp_status smp__nc_b_irecv(void *buf, size_t bytes, int peer, smp_group g, void **req) {
    smp_nccl_request *r = NULL;
    smp_status st = smp_nccl_irecv(buf, bytes, peer, g, &r);
    *req = r;
    return st;
}
static smp_status smp__nc_b_test(void *req, bool *done) { return smp_nccl_test((smp_nccl_request *)req, done); }
static smp_status smp__nc_b_wait(void *req) { return smp_nccl_wait((smp_nccl_request *)req); }
/* On the staged path point to point copies through pinned buffers and MPI anyway: the executor's own staging does the
 * same. */
static bool smp__nc_b_through_host(void) { return smp__nc.mode != SMP_NCCL_MODE_NCCL; }
#endif

SMPDEF void smp_nccl_register(void) {
    smp_device_backend b;
    memset(&b, 0, sizeof b);
    b.name = "nccl";
    b.all_reduce = smp__nc_all_reduce;
    b.broadcast = smp__nc_broadcast;
    b.reduce = smp__nc_reduce;
    b.all_gather = smp__nc_all_gather;
    b.reduce_scatter = smp__nc_reduce_scatter;
    b.all_to_all_single = smp__nc_all_to_all_single;
    b.copy = smp__nc_copy;
    b.on_init = smp__nc_on_init;
    b.on_finalize = smp__nc_on_finalize;
#ifdef SMP_DEVICE_BACKEND_P2P
    b.p2p_connect = smp_nccl_p2p_connect;
    b.isend = smp__nc_b_isend;
    b.irecv = smp__nc_b_irecv;
    b.test = smp__nc_b_test;
    b.wait = smp__nc_b_wait;
    b.alloc = smp_nccl_alloc;
    b.dealloc = smp_nccl_free;
    b.add = smp_nccl_add;
    b.synchronize = smp_nccl_synchronize;
    b.current_device = smp_nccl_device;
    b.scale = smp__nc_scale;
    b.zero = smp__nc_zero;
    b.p2p_through_host = smp__nc_b_through_host;
    b.bucket_all_reduce = smp__nc_bucket_all_reduce;
    b.bucket_fence = smp__nc_bucket_fence;
    b.offload = smp__nc_offload;
    b.offload_done = smp__nc_offload_done;
    b.reload = smp__nc_reload;
    b.offload_wait = smp__nc_offload_wait;
    b.offload_drop = smp__nc_offload_drop;
    b.gather_start = smp__nc_gather_start;
    b.gather_copy = smp__nc_gather_copy;
    b.gather_end = smp__nc_gather_end;
#endif
    smp_register_device_backend(&b);
}

#ifndef SMP_NCCL_NO_AUTO_REGISTER
#if defined(__GNUC__) || defined(__clang__)
/* Runs before main: including this file is all it takes. */
__attribute__((constructor)) static void smp__nc_auto_register(void) { smp_nccl_register(); }
#else
/* smp_nccl.h registers itself with a constructor function (GCC/Clang) */
#error "no constructor functions here: define SMP_NCCL_NO_AUTO_REGISTER and call smp_nccl_register() before smp_init"
#endif
#endif

#undef SMP__CU
#undef SMP__NC
#undef SMP__NC_ST
#endif /* SMP_IMPLEMENTATION */
