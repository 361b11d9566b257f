/* fake_cuda.c - the CUDA runtime, NCCL and cuBLAS calls smp's CUDA programs
   make, run on the CPU. What it does and how to build with it: fake_cuda.h.

   One mutex guards everything. A device thread per process plays the GPU:
   it runs each stream's queue in order, moves NCCL data over MPI (so MPI
   runs with MPI_THREAD_MULTIPLE: MPI_Init is wrapped through the profiling
   interface), and answers communicator handshakes for the unique ids this
   process created. Host calls that wait sleep on a condition variable. */
#define _GNU_SOURCE
#include <mpi.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <cublas_api.h>

#include "fake_cuda.h"

#define DEV_BIT (1ull << 62) /* device addresses: host address | DEV_BIT, not canonical on x86-64 */
#define MAX_TWINS 256
#define MAX_ARGS 24

/* ---------------------------------------------------------------- state */
typedef struct alloc { uintptr_t base; size_t size; int device; bool pinned; } alloc;

typedef struct twin {
    const void *stub, *host_fn;
    int nargs;
    size_t sizes[MAX_ARGS];
    fake_cuda_run_fn run;
} twin;

typedef struct fstream fstream;
typedef struct op op;
struct CUstream_st { int unused; };

struct fstream {
    struct CUstream_st handle; /* what the program holds: &fs->handle */
    bool blocking, slow; /* slow: its kernels and copies run FAKE_CUDA_DELAY_US late */
    uint64_t enqueued, done;
    uint64_t last_h2d; /* the number of its latest host-to-device copy (0: none) */
    long h2d_waits;    /* cudaStreamWaitEvent calls of this stream on another's host-to-device copy */
    op *head, *tail;
    fstream *next;
};

struct CUevent_st {
    fstream *stream;
    uint64_t seq;
    bool after_h2d; /* recorded right after a host-to-device copy */
};

enum { NT_ALLREDUCE, NT_BROADCAST, NT_REDUCE, NT_ALLGATHER, NT_REDUCESCATTER, NT_SEND, NT_RECV };
typedef struct ncclComm ncomm;
typedef struct task {
    int kind;
    ncomm *comm;
    const char *send; /* host addresses */
    char *recv;
    size_t count, bytes; /* bytes of one rank's block */
    ncclDataType_t dt;
    ncclRedOp_t op;
    int root, peer;
    char *tmp;
} task;

enum { OP_KERNEL, OP_COPY, OP_SET, OP_WAIT, OP_NCCL, OP_FREE, OP_GEMM };
struct op {
    int kind;
    op *next;
    double ready_at;
    union {
        struct { const twin *tw; void *slots[MAX_ARGS]; unsigned char *argbuf; long long threads; int block; } k;
        struct { void *dst; const void *src; size_t n; void *owned; } c;
        struct { void *dst; int v; size_t n; } s;
        struct { fstream *on; uint64_t seq; } w;
        struct { task *tasks; int ntasks; bool started; MPI_Request *reqs; int nreqs; } nc;
        struct { void *dev; } f;
        struct {
            int ta, tb, m, n, k, lda, ldb, ldc;
            float alpha, beta;
            const void *a, *b;
            float *c;
            bool abf16, bbf16;
        } g; /* abf16, bbf16: A, B hold bf16 (cublasGemmEx) */
    } u;
};

enum { COMM_PENDING, COMM_READY, COMM_FAILED, COMM_ABORTED };
struct ncclComm {
    int nranks, rank, state, tag;
    int *world; /* world rank of each NCCL rank */
    int inflight;
    bool finalizing, blocking;
    ncclResult_t error;
    char last[256];
    int welcome[1 + 64];
    MPI_Request welcome_req;
    ncomm *next;
};

typedef struct hello { int serial, nranks, got; int world[64]; bool bad; } hello;
typedef struct outgoing { MPI_Request req; int *buf; struct outgoing *next; } outgoing;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t host_cv, dev_cv;
    pthread_t thread;
    bool thread_up, stop, mpi_up;
    MPI_Comm comm;
    int wrank;
    int ndevices, device, pools;
    double delay;
    bool slow_comm;
    int nccl_version; /* what ncclGetVersion reports: FAKE_NCCL_VERSION, default 22800 (2.28.0) */
    fstream legacy;
    fstream *streams; /* legacy first */
    alloc *allocs;
    int nallocs, cap_allocs;
    twin twins[MAX_TWINS];
    int ntwins;
    struct { const void *stub; const char *name; } names[MAX_TWINS];
    int nnames;
    ncomm *comms;
    outgoing *outbox; /* handshake messages in flight (MPI_Send to oneself may wait for the receive) */
    hello hellos[64];
    int nhellos, next_serial;
    cudaError_t last_error;
    char nccl_last[256];
    int group_depth;
    bool fail_next;
    long device_syncs; /* calls that wait for the whole device */
    const char *last_device_sync;
    long h2d_host_waits; /* host calls that returned only after a pending host-to-device copy finished */
    long long dev_bytes, dev_peak; /* device memory allocated now, and at most since the last reset */
    task *group;
    int ngroup, cap_group;
    cudaStream_t *group_streams;
} G = {.mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP,
       .host_cv = PTHREAD_COND_INITIALIZER,
       .dev_cv = PTHREAD_COND_INITIALIZER};

static void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fake CUDA (world rank %d): ", G.wrank);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    if (G.mpi_up) PMPI_Abort(MPI_COMM_WORLD, 3);
    abort();
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) fatal("out of host memory (%zu bytes)", n);
    return p;
}

static void setup_once(void) { /* under G.mu */
    static bool done = false;
    if (done) return;
    done = true;
    const char *e = getenv("FAKE_CUDA_DEVICES");
    G.ndevices = e && *e ? atoi(e) : 1;
    e = getenv("FAKE_CUDA_POOLS");
    G.pools = e && *e ? atoi(e) != 0 : 1;
    e = getenv("FAKE_CUDA_DELAY_US");
    G.delay = (e && *e ? atof(e) : 300.0) * 1e-6;
    e = getenv("FAKE_CUDA_SLOW");
    G.slow_comm = e && strcmp(e, "comm") == 0;
    e = getenv("FAKE_NCCL_VERSION");
    G.nccl_version = e && *e ? atoi(e) : 22800;
    G.legacy.blocking = true;
    G.legacy.slow = !G.slow_comm;
    G.streams = &G.legacy;
}

#define LOCK() (pthread_mutex_lock(&G.mu), setup_once())
#define UNLOCK() pthread_mutex_unlock(&G.mu)

static cudaError_t fail(cudaError_t e) { G.last_error = e; return e; }

/* ---------------------------------------------------------------- memory */
static alloc *find_alloc(uintptr_t host) {
    for (int i = 0; i < G.nallocs; i++) {
        alloc *a = &G.allocs[i];
        if (host >= a->base && (host < a->base + a->size || host == a->base)) return a;
    }
    return NULL;
}

static void add_alloc(uintptr_t base, size_t size, bool pinned) {
    if (G.nallocs == G.cap_allocs) {
        G.cap_allocs = G.cap_allocs ? 2 * G.cap_allocs : 256;
        G.allocs = (alloc *)realloc(G.allocs, sizeof(alloc) * (size_t)G.cap_allocs);
        if (!G.allocs) fatal("out of host memory");
    }
    G.allocs[G.nallocs++] = (alloc){base, size, G.device, pinned};
    if (!pinned && (G.dev_bytes += (long long)size) > G.dev_peak) G.dev_peak = G.dev_bytes;
}

static bool is_dev(const void *p) { return ((uintptr_t)p & DEV_BIT) != 0; }

/* The host bytes behind [p, p+n) of device memory; fatal when outside an allocation. */
static void *dev_range(const void *p, size_t n, const char *what) {
    uintptr_t h = (uintptr_t)p & ~DEV_BIT;
    alloc *a = find_alloc(h);
    if (!a || a->pinned) fatal("%s: %p is not device memory (freed, or never allocated)", what, p);
    if (h + n > a->base + a->size)
        fatal("%s: %zu bytes at offset %zu overrun the %zu-byte allocation", what, n, (size_t)(h - a->base), a->size);
    return (void *)h;
}

void *fake_cuda_host_ptr(const void *p) {
    if (!p || !is_dev(p)) return (void *)p;
    pthread_mutex_lock(&G.mu);
    void *h = dev_range(p, 0, "a kernel's pointer argument");
    pthread_mutex_unlock(&G.mu);
    return h;
}

/* ---------------------------------------------------------------- streams */
static fstream *S(cudaStream_t s) {
    if (!s || s == cudaStreamLegacy || s == cudaStreamPerThread) return &G.legacy;
    return (fstream *)((char *)s - offsetof(fstream, handle));
}

static bool stream_idle(const fstream *s) { return s->done == s->enqueued; }

static void push(fstream *s, op *o) {
    o->next = NULL;
    if (s->tail) s->tail->next = o;
    else s->head = o;
    s->tail = o;
    s->enqueued++;
    pthread_cond_signal(&G.dev_cv);
}

static op *new_op(int kind) {
    op *o = (op *)calloc(1, sizeof *o);
    if (!o) fatal("out of host memory");
    o->kind = kind;
    return o;
}

static void push_wait(fstream *s, fstream *on, uint64_t seq) {
    op *w = new_op(OP_WAIT);
    w->u.w.on = on;
    w->u.w.seq = seq;
    push(s, w);
}

static void start_thread(void);

/* Enqueues work; the legacy stream and blocking streams order against each other. */
static void enqueue(fstream *s, op *o, bool delayed) {
    start_thread();
    if (s == &G.legacy) {
        for (fstream *t = G.streams; t; t = t->next)
            if (t != s && t->blocking && !stream_idle(t)) push_wait(s, t, t->enqueued);
    } else if (s->blocking && !stream_idle(&G.legacy)) {
        push_wait(s, &G.legacy, G.legacy.enqueued);
    }
    o->ready_at = delayed && s->slow ? now() + G.delay : 0;
    push(s, o);
}

/* Host waits, woken by the device thread as work completes. */
static void wait_until(bool (*done)(const void *), const void *arg) {
    start_thread();
    while (!done(arg)) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 2000000;
        if (t.tv_nsec >= 1000000000) { t.tv_sec++; t.tv_nsec -= 1000000000; }
        pthread_cond_timedwait(&G.host_cv, &G.mu, &t);
    }
}
static bool stream_done(const void *s) { return stream_idle((const fstream *)s); }
static bool device_done(const void *unused) {
    (void)unused;
    for (fstream *t = G.streams; t; t = t->next)
        if (!stream_idle(t)) return false;
    return true;
}
static bool event_done(const void *e) {
    const struct CUevent_st *ev = (const struct CUevent_st *)e;
    return !ev->stream || ev->stream->done >= ev->seq;
}

static bool h2d_pending(const fstream *s, uint64_t upto) { /* a host-to-device copy up to upto is not done */
    return s->last_h2d && s->last_h2d <= upto && s->done < s->last_h2d;
}

static void device_sync(const char *call) {
    G.device_syncs++;
    G.last_device_sync = call;
    for (fstream *t = G.streams; t; t = t->next)
        if (h2d_pending(t, t->enqueued)) { G.h2d_host_waits++; break; }
    wait_until(device_done, NULL);
}

/* ---------------------------------------------------------------- reductions (NCCL) */
static size_t nccl_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else { /* subnormal */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static uint16_t f32_to_f16(float f) { /* round to nearest even */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, absx = x & 0x7fffffff;
    if (absx > 0x7f800000) return (uint16_t)(sign | 0x7e00);
    if (absx >= 0x477ff000) return (uint16_t)(sign | 0x7c00);
    if (absx < 0x38800000) { /* subnormal or zero */
        if (absx < 0x33000000) return (uint16_t)sign;
        uint32_t e = absx >> 23, m = (absx & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((absx >> 13) - (112u << 10)), rem = absx & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (uint16_t)(sign | r);
}
static float bf16_to_f32(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
static uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

#define RED(T)                                                                  \
    do {                                                                        \
        T *a = (T *)acc; const T *b = (const T *)in;                            \
        for (size_t i = 0; i < n; i++)                                          \
            switch (o) {                                                        \
            case ncclProd: a[i] = (T)(a[i] * b[i]); break;                      \
            case ncclMax: a[i] = a[i] > b[i] ? a[i] : b[i]; break;              \
            case ncclMin: a[i] = a[i] < b[i] ? a[i] : b[i]; break;              \
            default: a[i] = (T)(a[i] + b[i]); break;                            \
            }                                                                   \
    } while (0)
#define RED16(TO, FROM) \
    do { \
        uint16_t *a = (uint16_t *)acc; \
        const uint16_t *b = (const uint16_t *)in; \
        for (size_t i = 0; i < n; i++) { \
            float x = FROM(a[i]), y = FROM(b[i]); \
            a[i] = TO(o == ncclProd  ? x * y \
                      : o == ncclMax ? (x > y ? x : y) \
                      : o == ncclMin ? (x < y ? x : y) \
                                     : x + y); \
        } \
    } while (0)

static void reduce_into(void *acc, const void *in, size_t n, ncclDataType_t t, ncclRedOp_t o) {
    switch (t) {
    case ncclInt8: RED(int8_t); break;
    case ncclUint8: RED(uint8_t); break;
    case ncclInt32: RED(int32_t); break;
    case ncclUint32: RED(uint32_t); break;
    case ncclInt64: RED(int64_t); break;
    case ncclUint64: RED(uint64_t); break;
    case ncclFloat32: RED(float); break;
    case ncclFloat64: RED(double); break;
    case ncclFloat16: RED16(f32_to_f16, f16_to_f32); break;
    case ncclBfloat16: RED16(f32_to_bf16, bf16_to_f32); break;
    default: fatal("reduction of NCCL type %d is not supported", (int)t);
    }
}

#define DIV(T)                                                   \
    do { T *a = (T *)acc; for (size_t i = 0; i < n; i++) a[i] = (T)(a[i] / (T)k); } while (0)
static void average(void *acc, size_t n, ncclDataType_t t, int k) {
    switch (t) {
    case ncclInt8: DIV(int8_t); break;
    case ncclUint8: DIV(uint8_t); break;
    case ncclInt32: DIV(int32_t); break;
    case ncclUint32: DIV(uint32_t); break;
    case ncclInt64: DIV(int64_t); break;
    case ncclUint64: DIV(uint64_t); break;
    case ncclFloat32: DIV(float); break;
    case ncclFloat64: DIV(double); break;
    case ncclFloat16: {
        uint16_t *a = (uint16_t *)acc;
        for (size_t i = 0; i < n; i++) a[i] = f32_to_f16(f16_to_f32(a[i]) / (float)k);
    } break;
    case ncclBfloat16: {
        uint16_t *a = (uint16_t *)acc;
        for (size_t i = 0; i < n; i++) a[i] = f32_to_bf16(bf16_to_f32(a[i]) / (float)k);
    } break;
    default: break;
    }
}

/* NCCL 2.27 to 2.29.6 (its issue 1950, fixed in 2.29.7): an ncclAvg on a
   communicator of one rank runs a kernel whose 32 blocks each take
   count / 32 elements rounded down (then up to a 16-byte pack), so the
   last elements of a large count are never written: on an H100 with 2.28.3,
   262144 of 262147 written for f32 and f64, and counts of 1000 and less
   whole (hence the 2^18 below which the fake writes all); NCCL's issue shows
   bf16 on 2.27.5, and the fake does it for every type. How many of `count`
   those versions write; all of them when the reported version is another. */
static size_t one_rank_avg_written(size_t count, ncclDataType_t t) {
    int v = G.nccl_version;
    size_t blocks = 32, pack = 16 / nccl_size(t);
    if (v < 22700 || v >= 22907 || count < ((size_t)1 << 18)) return count;
    size_t per_block = (count / blocks + pack - 1) / pack * pack;
    return per_block * blocks < count ? per_block * blocks : count;
}

/* Rank order, so every rank ends with the same bits: blocks[r] is rank r's. */
static void combine(char *out, char *blocks, const task *t) {
    int n = t->comm->nranks;
    size_t count = t->bytes / nccl_size(t->dt);
    for (int r = 1; r < n; r++) reduce_into(blocks, blocks + (size_t)r * t->bytes, count, t->dt, t->op);
    if (t->op == ncclAvg) average(blocks, count, t->dt, n);
    size_t written = n == 1 && t->op == ncclAvg ? one_rank_avg_written(count, t->dt) : count;
    memmove(out, blocks, written * nccl_size(t->dt));
}

/* ---------------------------------------------------------------- NCCL tasks on the device thread */
static int peer_world(const task *t, int r) { return t->comm->world[r]; }

static void post(op *o, bool send, void *buf, size_t n, int world_rank, int tag) {
    if (n > (size_t)INT32_MAX) fatal("a transfer of %zu bytes is over MPI's int count", n);
    MPI_Request *r = &o->u.nc.reqs[o->u.nc.nreqs++];
    if (send) PMPI_Isend(buf, (int)n, MPI_BYTE, world_rank, tag, G.comm, r);
    else PMPI_Irecv(buf, (int)n, MPI_BYTE, world_rank, tag, G.comm, r);
}

static void start_task(op *o, task *t) {
    ncomm *c = t->comm;
    int n = c->nranks, me = c->rank;
    size_t b = t->bytes;
    switch (t->kind) {
    case NT_ALLREDUCE: case NT_REDUCESCATTER: case NT_REDUCE: {
        bool rooted = t->kind == NT_REDUCE, scatter = t->kind == NT_REDUCESCATTER;
        if (!rooted || me == t->root) {
            t->tmp = (char *)xmalloc(b * (size_t)n);
            for (int r = 0; r < n; r++)
                if (r != me) post(o, false, t->tmp + (size_t)r * b, b, peer_world(t, r), c->tag);
        }
        for (int r = 0; r < n; r++) {
            if (r == me || (rooted && r != t->root)) continue;
            post(o, true, (void *)(t->send + (scatter ? (size_t)r * b : 0)), b, peer_world(t, r), c->tag);
        }
        break;
    }
    case NT_BROADCAST:
        if (me == t->root) {
            for (int r = 0; r < n; r++)
                if (r != me) post(o, true, (void *)t->send, b, peer_world(t, r), c->tag);
        } else {
            post(o, false, t->recv, b, peer_world(t, t->root), c->tag);
        }
        break;
    case NT_ALLGATHER:
        for (int r = 0; r < n; r++) {
            if (r == me) continue;
            post(o, false, t->recv + (size_t)r * b, b, peer_world(t, r), c->tag);
            post(o, true, (void *)t->send, b, peer_world(t, r), c->tag);
        }
        break;
    case NT_SEND: post(o, true, (void *)t->send, b, peer_world(t, t->peer), c->tag); break;
    case NT_RECV: post(o, false, t->recv, b, peer_world(t, t->peer), c->tag); break;
    }
}

static void finish_task(task *t) {
    ncomm *c = t->comm;
    int me = c->rank;
    size_t b = t->bytes;
    switch (t->kind) {
    case NT_ALLREDUCE: memcpy(t->tmp + (size_t)me * b, t->send, b); combine(t->recv, t->tmp, t); break;
    case NT_REDUCESCATTER:
        memcpy(t->tmp + (size_t)me * b, t->send + (size_t)me * b, b);
        combine(t->recv, t->tmp, t);
        break;
    case NT_REDUCE:
        if (me == t->root) { memcpy(t->tmp + (size_t)me * b, t->send, b); combine(t->recv, t->tmp, t); }
        break;
    case NT_BROADCAST: if (me == t->root && t->recv != t->send) memmove(t->recv, t->send, b); break;
    case NT_ALLGATHER: if (t->recv + (size_t)me * b != t->send) memmove(t->recv + (size_t)me * b, t->send, b); break;
    default: break;
    }
    free(t->tmp);
    t->tmp = NULL;
}

static bool run_nccl(op *o) {
    bool aborted = false;
    for (int i = 0; i < o->u.nc.ntasks; i++) {
        ncomm *c = o->u.nc.tasks[i].comm;
        if (c->state == COMM_ABORTED) aborted = true;
        /* still connecting, or failed: hangs until aborted, as on a GPU */
        else if (c->state != COMM_READY) return false;
    }
    if (aborted) { /* an aborted communicator's work ends without its data */
        for (int i = 0; i < o->u.nc.nreqs; i++)
            if (o->u.nc.reqs[i] != MPI_REQUEST_NULL) {
                PMPI_Cancel(&o->u.nc.reqs[i]);
                PMPI_Request_free(&o->u.nc.reqs[i]);
            }
        return true;
    }
    if (!o->u.nc.started) {
        int most = 0;
        for (int i = 0; i < o->u.nc.ntasks; i++) most += 2 * o->u.nc.tasks[i].comm->nranks;
        o->u.nc.reqs = (MPI_Request *)xmalloc(sizeof(MPI_Request) * (size_t)most);
        for (int i = 0; i < o->u.nc.ntasks; i++) start_task(o, &o->u.nc.tasks[i]);
        o->u.nc.started = true;
    }
    for (int i = 0; i < o->u.nc.nreqs; i++) { /* (Testall with MPI_STATUSES_IGNORE trips gcc's -Wstringop-overflow) */
        int flag = 0;
        PMPI_Test(&o->u.nc.reqs[i], &flag, MPI_STATUS_IGNORE);
        if (!flag) return false;
    }
    for (int i = 0; i < o->u.nc.ntasks; i++) finish_task(&o->u.nc.tasks[i]);
    return true;
}

static float gemm_in(const void *p, size_t at, bool bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[at]) : ((const float *)p)[at];
}

static void gemm(op *o) {
    int m = o->u.g.m, n = o->u.g.n, k = o->u.g.k;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float s = 0;
            for (int l = 0; l < k; l++) {
                float a = gemm_in(o->u.g.a, o->u.g.ta ? l + (size_t)i * o->u.g.lda : i + (size_t)l * o->u.g.lda,
                                  o->u.g.abf16);
                float b = gemm_in(o->u.g.b, o->u.g.tb ? j + (size_t)l * o->u.g.ldb : l + (size_t)j * o->u.g.ldb,
                                  o->u.g.bbf16);
                s += a * b;
            }
            float *c = &o->u.g.c[i + (size_t)j * o->u.g.ldc];
            *c = o->u.g.beta == 0 ? o->u.g.alpha * s : o->u.g.alpha * s + o->u.g.beta * *c;
        }
}

static void free_op(op *o) {
    if (o->kind == OP_KERNEL) free(o->u.k.argbuf);
    if (o->kind == OP_COPY) free(o->u.c.owned);
    if (o->kind == OP_NCCL) {
        for (int i = 0; i < o->u.nc.ntasks; i++) o->u.nc.tasks[i].comm->inflight--;
        free(o->u.nc.tasks);
        free(o->u.nc.reqs);
    }
    free(o);
}

static void release_alloc(uintptr_t base);

static __thread long long running_threads; /* the launch a twin runs for */
static __thread int running_block;
void fake_cuda_launch_dims(long long *threads, int *block) {
    *threads = running_threads;
    *block = running_block;
}

/* Runs the head of s if it can; true when it finished. */
static bool step(fstream *s, double t, double *next) {
    op *o = s->head;
    if (o->ready_at > t) {
        if (o->ready_at < *next) *next = o->ready_at;
        return false;
    }
    switch (o->kind) {
    case OP_WAIT: if (o->u.w.on->done < o->u.w.seq) return false; break;
    case OP_KERNEL:
        running_threads = o->u.k.threads;
        running_block = o->u.k.block;
        o->u.k.tw->run(o->u.k.tw->host_fn, o->u.k.slots);
        break;
    case OP_COPY: memmove(o->u.c.dst, o->u.c.src, o->u.c.n); break;
    case OP_SET: memset(o->u.s.dst, o->u.s.v, o->u.s.n); break;
    case OP_NCCL: if (!run_nccl(o)) return false; break;
    case OP_FREE: release_alloc((uintptr_t)o->u.f.dev & ~DEV_BIT); break;
    case OP_GEMM: gemm(o); break;
    }
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    s->done++;
    free_op(o);
    return true;
}

static void send_ints(const int *v, int n, int to, int tag) {
    outgoing *o = (outgoing *)xmalloc(sizeof *o);
    o->buf = (int *)xmalloc(sizeof(int) * (size_t)n);
    memcpy(o->buf, v, sizeof(int) * (size_t)n);
    PMPI_Isend(o->buf, n, MPI_INT, to, tag, G.comm, &o->req);
    o->next = G.outbox;
    G.outbox = o;
}

static void drain_outbox(void) {
    for (outgoing **p = &G.outbox; *p;) {
        int flag = 0;
        PMPI_Test(&(*p)->req, &flag, MPI_STATUS_IGNORE);
        if (!flag) { p = &(*p)->next; continue; }
        outgoing *o = *p;
        *p = o->next;
        free(o->buf);
        free(o);
    }
}

/* Handshakes: members tell the id's creator who they are; it answers with the member list. */
enum { TAG_HELLO = 1, TAG_WELCOME = 1 << 24, TAG_DATA = 1 << 25 };

static void serve_hellos(void) {
    for (;;) {
        int flag = 0;
        MPI_Status st;
        PMPI_Iprobe(MPI_ANY_SOURCE, TAG_HELLO, G.comm, &flag, &st);
        if (!flag) return;
        int msg[3]; /* serial, nranks, rank */
        PMPI_Recv(msg, 3, MPI_INT, st.MPI_SOURCE, TAG_HELLO, G.comm, MPI_STATUS_IGNORE);
        hello *h = NULL;
        for (int i = 0; i < G.nhellos && !h; i++)
            if (G.hellos[i].serial == msg[0]) h = &G.hellos[i];
        if (!h) {
            if (G.nhellos == 64) fatal("more than 64 communicators connecting at once");
            h = &G.hellos[G.nhellos++];
            memset(h, 0, sizeof *h);
            h->serial = msg[0];
            h->nranks = msg[1];
            for (int i = 0; i < 64; i++) h->world[i] = -1;
        }
        if (msg[1] != h->nranks || msg[2] < 0 || msg[2] >= h->nranks || h->world[msg[2]] >= 0) h->bad = true;
        else h->world[msg[2]] = st.MPI_SOURCE;
        if (++h->got < h->nranks) continue;
        int reply[1 + 64];
        reply[0] = h->bad;
        memcpy(reply + 1, h->world, sizeof h->world);
        for (int r = 0; r < h->nranks; r++)
            if (h->world[r] >= 0) send_ints(reply, 1 + 64, h->world[r], TAG_WELCOME + h->serial);
        *h = G.hellos[--G.nhellos];
    }
}

static void advance_comms(void) {
    for (ncomm *c = G.comms; c; c = c->next) {
        if (c->state != COMM_PENDING || c->welcome_req == MPI_REQUEST_NULL) continue;
        int flag = 0;
        PMPI_Test(&c->welcome_req, &flag, MPI_STATUS_IGNORE);
        if (!flag) continue;
        if (c->welcome[0]) {
            c->state = COMM_FAILED;
            c->error = ncclInvalidUsage;
            snprintf(c->last, sizeof c->last, "the ranks of this communicator disagree on its size or repeat a rank");
            continue;
        }
        c->world = (int *)xmalloc(sizeof(int) * (size_t)c->nranks);
        memcpy(c->world, c->welcome + 1, sizeof(int) * (size_t)c->nranks);
        c->state = COMM_READY;
    }
}

static void *device_main(void *unused) {
    (void)unused;
    pthread_mutex_lock(&G.mu);
    while (!G.stop) {
        bool progressed = false, busy = false;
        double t = now(), next = t + 1e-3;
        serve_hellos();
        advance_comms();
        drain_outbox();
        busy |= G.outbox != NULL;
        for (ncomm *c = G.comms; c; c = c->next) busy |= c->state == COMM_PENDING;
        for (fstream *s = G.streams; s; s = s->next)
            while (s->head && step(s, t, &next)) progressed = true;
        for (fstream *s = G.streams; s; s = s->next) busy |= !stream_idle(s);
        if (progressed) { pthread_cond_broadcast(&G.host_cv); continue; }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        /* busy: poll MPI and delayed work every 20-200 us; idle: every 1 ms for handshakes that arrive unannounced */
        double wait = !busy ? 1e-3 : next - t < 2e-5 ? 2e-5 : next - t > 2e-4 ? 2e-4 : next - t;
        long ns = ts.tv_nsec + (long)(wait * 1e9);
        ts.tv_sec += ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        pthread_cond_timedwait(&G.dev_cv, &G.mu, &ts);
    }
    pthread_mutex_unlock(&G.mu);
    return NULL;
}

static void start_thread(void) {
    if (G.thread_up) return;
    if (!G.mpi_up) fatal("CUDA work before MPI_Init: the fake device runs NCCL over MPI, so it starts with MPI");
    if (pthread_create(&G.thread, NULL, device_main, NULL) != 0) fatal("cannot start the device thread");
    G.thread_up = true;
}

/* ---------------------------------------------------------------- MPI start and end */
static void after_init(int provided) {
    if (provided < MPI_THREAD_MULTIPLE)
        fatal("MPI gives thread level %d; the fake device needs MPI_THREAD_MULTIPLE", provided);
    PMPI_Comm_dup(MPI_COMM_WORLD, &G.comm);
    PMPI_Comm_rank(MPI_COMM_WORLD, &G.wrank);
    int *ub = NULL, flag = 0;
    PMPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    int tag_ub = flag ? *ub : 32767;
    if (tag_ub < (TAG_DATA | (1 << 24))) fatal("MPI_TAG_UB %d is too small for the fake device's tags", tag_ub);
    G.mpi_up = true;
}

int MPI_Init(int *argc, char ***argv) {
    int provided = 0, rc = PMPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    if (rc == MPI_SUCCESS) after_init(provided);
    return rc;
}

int MPI_Init_thread(int *argc, char ***argv, int required, int *provided) {
    (void)required;
    int rc = PMPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, provided);
    if (rc == MPI_SUCCESS) after_init(*provided);
    return rc;
}

int MPI_Finalize(void) {
    pthread_mutex_lock(&G.mu);
    bool up = G.thread_up;
    G.stop = true;
    pthread_cond_signal(&G.dev_cv);
    pthread_mutex_unlock(&G.mu);
    if (up) pthread_join(G.thread, NULL);
    G.thread_up = false;
    G.mpi_up = false;
    PMPI_Comm_free(&G.comm);
    return PMPI_Finalize();
}

/* ---------------------------------------------------------------- kernels */
void fake_cuda_register_twin(const void *stub, const void *host_fn, int nargs, const size_t *sizes,
                             fake_cuda_run_fn run) {
    if (G.ntwins == MAX_TWINS || nargs > MAX_ARGS) fatal("too many kernel twins or arguments");
    twin *t = &G.twins[G.ntwins++];
    t->stub = stub;
    t->host_fn = host_fn;
    t->nargs = nargs;
    memcpy(t->sizes, sizes, sizeof(size_t) * (size_t)nargs);
    t->run = run;
}

static const char *kernel_name(const void *stub) {
    for (int i = 0; i < G.nnames; i++)
        if (G.names[i].stub == stub) return G.names[i].name;
    return "(unknown)";
}

static __thread struct { dim3 grid, block; size_t shared; cudaStream_t stream; } launch_cfg;

unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shared, struct CUstream_st *stream) {
    launch_cfg.grid = grid;
    launch_cfg.block = block;
    launch_cfg.shared = shared;
    launch_cfg.stream = stream;
    return 0;
}
cudaError_t __cudaPopCallConfiguration(dim3 *grid, dim3 *block, size_t *shared, void *stream) {
    *grid = launch_cfg.grid;
    *block = launch_cfg.block;
    *shared = launch_cfg.shared;
    *(cudaStream_t *)stream = launch_cfg.stream;
    return cudaSuccess;
}
cudaError_t __cudaGetKernel(cudaKernel_t *k, const void *stub) { *k = (cudaKernel_t)stub; return cudaSuccess; }
void **__cudaRegisterFatBinary(void *fatbin) { static void *handle; handle = fatbin; return &handle; }
void __cudaRegisterFatBinaryEnd(void **h) { (void)h; }
void __cudaUnregisterFatBinary(void **h) { (void)h; }
void __cudaRegisterFunction(void **h, const char *stub, char *dev, const char *name, int limit, uint3 *tid, uint3 *bid,
                            dim3 *bdim, dim3 *gdim, int *wsize) {
    (void)h; (void)dev; (void)limit; (void)tid; (void)bid; (void)bdim; (void)gdim; (void)wsize;
    if (G.nnames < MAX_TWINS) { G.names[G.nnames].stub = stub; G.names[G.nnames++].name = name; }
}

cudaError_t __cudaLaunchKernel(cudaKernel_t k, dim3 grid, dim3 block, void **args, size_t shared, cudaStream_t stream) {
    (void)shared;
    LOCK();
    const twin *tw = NULL;
    for (int i = 0; i < G.ntwins && !tw; i++)
        if (G.twins[i].stub == (const void *)k) tw = &G.twins[i];
    if (!tw) fatal("kernel %s has no host twin (register one with fake_cuda_twin)", kernel_name(k));
    if (!grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z || block.x * block.y * block.z > 1024) {
        UNLOCK();
        return fail(cudaErrorInvalidConfiguration);
    }
    op *o = new_op(OP_KERNEL);
    o->u.k.tw = tw;
    o->u.k.block = (int)(block.x * block.y * block.z);
    o->u.k.threads = (long long)grid.x * grid.y * grid.z * o->u.k.block;
    size_t total = 0;
    for (int i = 0; i < tw->nargs; i++) total += (tw->sizes[i] + 15) & ~(size_t)15;
    o->u.k.argbuf = (unsigned char *)xmalloc(total);
    size_t at = 0;
    for (int i = 0; i < tw->nargs; i++) {
        memcpy(o->u.k.argbuf + at, args[i], tw->sizes[i]);
        o->u.k.slots[i] = o->u.k.argbuf + at;
        at += (tw->sizes[i] + 15) & ~(size_t)15;
    }
    enqueue(S(stream), o, true);
    UNLOCK();
    return cudaSuccess;
}

/* ---------------------------------------------------------------- CUDA runtime: devices and errors */
cudaError_t cudaGetDeviceCount(int *n) {
    LOCK();
    *n = G.ndevices > 0 ? G.ndevices : 0;
    cudaError_t e = G.ndevices > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
    UNLOCK();
    return e;
}
cudaError_t cudaSetDevice(int d) {
    LOCK();
    cudaError_t e = d >= 0 && d < G.ndevices ? cudaSuccess : fail(cudaErrorInvalidDevice);
    if (!e) G.device = d;
    UNLOCK();
    return e;
}
cudaError_t cudaGetDevice(int *d) { LOCK(); *d = G.device; UNLOCK(); return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d) {
    LOCK();
    cudaError_t e = d >= 0 && d < G.ndevices ? cudaSuccess : fail(cudaErrorInvalidDevice);
    if (!e) {
        memset(p, 0, sizeof *p);
        snprintf(p->name, sizeof p->name, "fake CUDA device %d (CPU)", d);
        p->uuid.bytes[0] = (char)0xfa;
        p->uuid.bytes[1] = (char)0xce;
        p->uuid.bytes[15] = (char)d;
        p->totalGlobalMem = (size_t)16 << 30;
        p->warpSize = 32;
        p->maxThreadsPerBlock = 1024;
        p->multiProcessorCount = 4;
        p->major = 9;
    }
    UNLOCK();
    return e;
}
cudaError_t cudaDeviceGetPCIBusId(char *id, int len, int d) {
    if (d < 0 || d >= G.ndevices) return fail(cudaErrorInvalidDevice);
    snprintf(id, (size_t)len, "0000:%02x:00.0", 0x10 + d);
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int d) {
    LOCK();
    cudaError_t e = d >= 0 && d < G.ndevices ? cudaSuccess : fail(cudaErrorInvalidDevice);
    *v = a == cudaDevAttrMemoryPoolsSupported ? G.pools : 0;
    UNLOCK();
    return e;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    *least = 0;
    *greatest = -5;
    return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
    LOCK();
    cudaError_t e = G.last_error;
    G.last_error = cudaSuccess;
    UNLOCK();
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return G.last_error; }
const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    default: return "cudaError (fake)";
    }
}
const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    default: return "unknown error (fake CUDA)";
    }
}

/* ---------------------------------------------------------------- CUDA runtime: memory */
static cudaError_t dev_alloc(void **p, size_t n) {
    char *h = (char *)malloc(n ? n : 1);
    if (!h) return fail(cudaErrorMemoryAllocation);
    memset(h, 0xa5, n); /* not zero: code that forgets to initialise shows it */
    if (((uintptr_t)h & DEV_BIT) != 0) fatal("host address %p already has bit 62 set", (void *)h);
    add_alloc((uintptr_t)h, n, false);
    *p = (void *)((uintptr_t)h | DEV_BIT);
    return cudaSuccess;
}
static void release_alloc(uintptr_t base) {
    for (int i = 0; i < G.nallocs; i++)
        if (G.allocs[i].base == base) {
            if (!G.allocs[i].pinned) G.dev_bytes -= (long long)G.allocs[i].size;
            free((void *)base);
            G.allocs[i] = G.allocs[--G.nallocs];
            return;
        }
    fatal("freeing %p, which is not allocated", (void *)base);
}
static cudaError_t dev_free_check(void *p) {
    if (!p) return cudaSuccess;
    uintptr_t h = (uintptr_t)p & ~DEV_BIT;
    alloc *a = is_dev(p) ? find_alloc(h) : NULL;
    if (!a || a->pinned || a->base != h) return fail(cudaErrorInvalidValue);
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t n) { LOCK(); cudaError_t e = dev_alloc(p, n); UNLOCK(); return e; }
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t s) { (void)s; return cudaMalloc(p, n); }
cudaError_t cudaFree(void *p) {
    LOCK();
    cudaError_t e = dev_free_check(p);
    if (!e && p) {
        device_sync("cudaFree"); /* cudaFree waits for the whole device */
        release_alloc((uintptr_t)p & ~DEV_BIT);
    }
    UNLOCK();
    return e;
}
cudaError_t cudaFreeAsync(void *p, cudaStream_t s) {
    LOCK();
    cudaError_t e = dev_free_check(p);
    if (!e && p) {
        op *o = new_op(OP_FREE);
        o->u.f.dev = p;
        enqueue(S(s), o, false);
    }
    UNLOCK();
    return e;
}
cudaError_t cudaMallocHost(void **p, size_t n) {
    LOCK();
    device_sync("cudaMallocHost"); /* pinning pages may wait for the device */
    void *h = malloc(n ? n : 1);
    if (h) add_alloc((uintptr_t)h, n, true);
    *p = h;
    UNLOCK();
    return h ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}
cudaError_t cudaFreeHost(void *p) {
    LOCK();
    alloc *a = p ? find_alloc((uintptr_t)p) : NULL;
    cudaError_t e = !p                                          ? cudaSuccess
                    : a && a->pinned && a->base == (uintptr_t)p ? cudaSuccess
                                                                : fail(cudaErrorInvalidValue);
    if (!e && p) {
        device_sync("cudaFreeHost");
        release_alloc((uintptr_t)p);
    }
    UNLOCK();
    return e;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *at, const void *p) {
    LOCK();
    memset(at, 0, sizeof *at);
    at->device = -2;
    if (is_dev(p)) {
        alloc *a = find_alloc((uintptr_t)p & ~DEV_BIT);
        if (!a || a->pinned) { UNLOCK(); return fail(cudaErrorInvalidValue); }
        at->type = cudaMemoryTypeDevice;
        at->device = a->device;
        at->devicePointer = (void *)p;
    } else {
        alloc *a = p ? find_alloc((uintptr_t)p) : NULL;
        at->type = a && a->pinned ? cudaMemoryTypeHost : cudaMemoryTypeUnregistered;
        if (a) { at->device = a->device; at->hostPointer = (void *)p; at->devicePointer = (void *)p; }
    }
    UNLOCK();
    return cudaSuccess;
}

static bool pinned(const void *p) {
    alloc *a = find_alloc((uintptr_t)p);
    return a && a->pinned;
}

/* Enqueues a copy; `sync` waits for it as cudaMemcpy does. */
static cudaError_t copy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t stream,
                        bool sync) {
    LOCK();
    bool dd = is_dev(dst), sd = is_dev(src);
    bool ok = kind == cudaMemcpyDefault || (kind == cudaMemcpyHostToHost && !dd && !sd) ||
              (kind == cudaMemcpyHostToDevice && dd && !sd) || (kind == cudaMemcpyDeviceToHost && !dd && sd) ||
              (kind == cudaMemcpyDeviceToDevice && dd && sd);
    if (!ok) { UNLOCK(); return fail(cudaErrorInvalidValue); }
    if (!n) { UNLOCK(); return cudaSuccess; }
    op *o = new_op(OP_COPY);
    o->u.c.n = n;
    o->u.c.dst = dd ? dev_range(dst, n, "cudaMemcpy destination") : dst;
    o->u.c.src = sd ? dev_range(src, n, "cudaMemcpy source") : src;
    bool pageable_src = !sd && !pinned(src), pageable_dst = !dd && !pinned(dst);
    if (pageable_src) { /* the caller may reuse pageable memory at once: CUDA stages it */
        o->u.c.owned = xmalloc(n);
        memcpy(o->u.c.owned, src, n);
        o->u.c.src = o->u.c.owned;
    }
    fstream *s = S(stream);
    enqueue(s, o, !sync);
    if (dd && !sd) s->last_h2d = s->enqueued;
    if (sync && dd && !sd) G.h2d_host_waits++;
    if (sync || pageable_dst) { /* returns once a pageable destination holds the data */
        struct CUevent_st ev = {s, s->enqueued, false};
        wait_until(event_done, &ev);
    }
    UNLOCK();
    return cudaSuccess;
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
    return copy(dst, src, n, kind, NULL, true);
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s) {
    return copy(dst, src, n, kind, s, false);
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
    LOCK();
    if (!is_dev(p)) { UNLOCK(); return fail(cudaErrorInvalidValue); }
    op *o = new_op(OP_SET);
    o->u.s.dst = dev_range(p, n, "cudaMemsetAsync");
    o->u.s.v = v;
    o->u.s.n = n;
    enqueue(S(s), o, true);
    UNLOCK();
    return cudaSuccess;
}
cudaError_t cudaMemset(void *p, int v, size_t n) {
    cudaError_t e = cudaMemsetAsync(p, v, n, NULL);
    return e ? e : cudaStreamSynchronize(NULL);
}

/* ---------------------------------------------------------------- CUDA runtime: streams and events */
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *out, unsigned flags, int priority) {
    LOCK();
    fstream *s = (fstream *)calloc(1, sizeof *s);
    if (!s) fatal("out of host memory");
    s->blocking = !(flags & cudaStreamNonBlocking);
    s->slow = G.slow_comm ? priority < 0 : priority >= 0;
    fstream **p = &G.streams;
    while (*p) p = &(*p)->next;
    *p = s;
    *out = &s->handle;
    UNLOCK();
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    return cudaStreamCreateWithPriority(s, flags, 0);
}
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithPriority(s, 0, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    LOCK();
    if (!s || S(s) == &G.legacy) { UNLOCK(); return fail(cudaErrorInvalidResourceHandle); }
    /* kept: its queued work still runs, and events recorded on it may still be asked about */
    UNLOCK();
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    LOCK();
    if (h2d_pending(S(s), S(s)->enqueued)) G.h2d_host_waits++;
    wait_until(stream_done, S(s));
    UNLOCK();
    return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
    LOCK();
    bool idle = stream_idle(S(s));
    UNLOCK();
    return idle ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaDeviceSynchronize(void) { LOCK(); device_sync("cudaDeviceSynchronize"); UNLOCK(); return cudaSuccess; }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    (void)flags;
    *e = (cudaEvent_t)calloc(1, sizeof(struct CUevent_st));
    return *e ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) { free(e); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    LOCK();
    e->stream = S(s);
    e->seq = e->stream->enqueued; /* complete once everything queued so far is */
    e->after_h2d = e->seq && e->stream->last_h2d == e->seq;
    UNLOCK();
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
    LOCK();
    bool d = event_done(e);
    UNLOCK();
    return d ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    LOCK();
    if (e->stream && h2d_pending(e->stream, e->seq)) G.h2d_host_waits++;
    wait_until(event_done, e);
    UNLOCK();
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    (void)flags;
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    LOCK();
    if (e->stream && e->stream != S(s) && e->after_h2d) S(s)->h2d_waits++;
    if (e->stream && e->stream->done < e->seq) push_wait(S(s), e->stream, e->seq);
    UNLOCK();
    return cudaSuccess;
}

/* ---------------------------------------------------------------- NCCL */
ncclResult_t ncclGetVersion(int *v) { LOCK(); *v = G.nccl_version; UNLOCK(); return ncclSuccess; }
const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}
const char *ncclGetLastError(ncclComm_t c) { return c ? c->last : G.nccl_last; }

static ncclResult_t nccl_fail(ncclComm_t c, ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static ncclResult_t nccl_fail(ncclComm_t c, ncclResult_t r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c ? c->last : G.nccl_last, sizeof G.nccl_last, fmt, ap);
    va_end(ap);
    return r;
}

typedef struct { char magic[4]; int creator, serial; } fake_id;

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    LOCK();
    if (!G.mpi_up) {
        UNLOCK();
        return nccl_fail(NULL, ncclInvalidUsage, "ncclGetUniqueId before MPI_Init (the fake NCCL runs over MPI)");
    }
    fake_id f = {{'F', 'K', 'N', 'C'}, G.wrank, G.next_serial++};
    if (G.next_serial >= (1 << 16)) fatal("more than 65536 NCCL unique ids");
    memset(id, 0, sizeof *id);
    memcpy(id->internal, &f, sizeof f);
    UNLOCK();
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *out, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
    fake_id f;
    memcpy(&f, id.internal, sizeof f);
    if (memcmp(f.magic, "FKNC", 4) != 0)
        return nccl_fail(NULL, ncclInvalidArgument, "the unique id did not come from ncclGetUniqueId");
    if (nranks < 1 || nranks > 64 || rank < 0 || rank >= nranks)
        return nccl_fail(NULL, ncclInvalidArgument, "rank %d of %d is invalid", rank, nranks);
    LOCK();
    start_thread();
    ncomm *c = (ncomm *)calloc(1, sizeof *c);
    if (!c) fatal("out of host memory");
    c->nranks = nranks;
    c->rank = rank;
    c->tag = TAG_DATA | (f.creator << 16) | f.serial;
    c->blocking = !config || config->blocking != 0;
    c->state = COMM_PENDING;
    c->welcome_req = MPI_REQUEST_NULL;
    int hello[3] = {f.serial, nranks, rank};
    send_ints(hello, 3, f.creator, TAG_HELLO);
    PMPI_Irecv(c->welcome, 1 + 64, MPI_INT, f.creator, TAG_WELCOME + f.serial, G.comm, &c->welcome_req);
    c->next = G.comms;
    G.comms = c;
    *out = c;
    pthread_cond_signal(&G.dev_cv);
    ncclResult_t r = ncclInProgress;
    if (c->blocking) {
        while (c->state == COMM_PENDING) { UNLOCK(); sched_yield(); LOCK(); }
        r = c->state == COMM_READY ? ncclSuccess : c->error;
    }
    UNLOCK();
    return r;
}
ncclResult_t ncclCommInitRank(ncclComm_t *c, int nranks, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(c, nranks, id, rank, NULL);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *state) {
    if (!c) return ncclInvalidArgument;
    LOCK();
    *state = c->state == COMM_PENDING ? ncclInProgress
           : c->state == COMM_FAILED ? c->error
           : c->state == COMM_ABORTED ? ncclInvalidUsage
           : c->finalizing && c->inflight ? ncclInProgress : ncclSuccess;
    UNLOCK();
    return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t c, int *rank) {
    if (!c) return ncclInvalidArgument;
    *rank = c->rank;
    return ncclSuccess;
}
ncclResult_t ncclCommCount(const ncclComm_t c, int *n) {
    if (!c) return ncclInvalidArgument;
    *n = c->nranks;
    return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t c) {
    if (!c) return ncclInvalidArgument;
    LOCK();
    c->finalizing = true;
    bool wait = c->blocking;
    while (wait && c->inflight && c->state == COMM_READY) { UNLOCK(); sched_yield(); LOCK(); }
    ncclResult_t r = !c->blocking && c->inflight ? ncclInProgress : ncclSuccess;
    UNLOCK();
    return r;
}
static void unlink_comm(ncclComm_t c) {
    for (ncomm **p = &G.comms; *p; p = &(*p)->next)
        if (*p == c) { *p = c->next; break; }
    /* kept allocated if work still names it: an aborted communicator's queued work ends on the device thread */
    if (!c->inflight) { free(c->world); free(c); }
}
ncclResult_t ncclCommDestroy(ncclComm_t c) {
    if (!c) return ncclInvalidArgument;
    LOCK();
    if (c->inflight && c->state == COMM_READY) {
        UNLOCK();
        return nccl_fail(c, ncclInvalidUsage,
                         "ncclCommDestroy with work in flight (call ncclCommFinalize and wait first)");
    }
    if (c->welcome_req != MPI_REQUEST_NULL && c->state == COMM_PENDING) {
        PMPI_Cancel(&c->welcome_req);
        PMPI_Request_free(&c->welcome_req);
    }
    unlink_comm(c);
    UNLOCK();
    return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t c) {
    if (!c) return ncclSuccess;
    LOCK();
    if (c->state == COMM_PENDING && c->welcome_req != MPI_REQUEST_NULL) {
        PMPI_Cancel(&c->welcome_req);
        PMPI_Request_free(&c->welcome_req);
    }
    c->state = COMM_ABORTED;
    pthread_cond_signal(&G.dev_cv);
    unlink_comm(c);
    UNLOCK();
    return ncclSuccess;
}

/* One task: checked now, queued now or at ncclGroupEnd. */
static ncclResult_t submit(task t, const char *call, cudaStream_t stream) {
    ncomm *c = t.comm;
    if (!c) return nccl_fail(NULL, ncclInvalidArgument, "%s: NULL communicator", call);
    size_t es = nccl_size(t.dt);
    if (!es) return nccl_fail(c, ncclInvalidArgument, "%s: invalid datatype %d", call, (int)t.dt);
    if ((int)t.op < 0 || (int)t.op > ncclAvg)
        return nccl_fail(c, ncclInvalidArgument, "%s: invalid reduction %d", call, (int)t.op);
    if ((t.kind == NT_SEND || t.kind == NT_RECV) && (t.peer < 0 || t.peer >= c->nranks || t.peer == c->rank))
        return nccl_fail(c, ncclInvalidArgument, "%s: peer %d is invalid for rank %d of %d", call, t.peer, c->rank,
                         c->nranks);
    if ((t.kind == NT_BROADCAST || t.kind == NT_REDUCE) && (t.root < 0 || t.root >= c->nranks))
        return nccl_fail(c, ncclInvalidArgument, "%s: root %d is outside the communicator of %d", call, t.root,
                         c->nranks);
    if (c->state == COMM_ABORTED || c->state == COMM_FAILED)
        return nccl_fail(c, ncclInvalidUsage, "%s: the communicator was aborted or failed", call);
    t.bytes = t.count * es;
    size_t n = (size_t)c->nranks;
    bool sends = t.kind != NT_RECV, recvs = t.kind != NT_SEND;
    size_t send_bytes = t.kind == NT_REDUCESCATTER ? t.bytes * n : t.bytes;
    size_t recv_bytes = t.kind == NT_ALLGATHER ? t.bytes * n : t.bytes;
    if (t.kind == NT_REDUCE && c->rank != t.root) recvs = false;
    if (t.kind == NT_BROADCAST && c->rank != t.root) sends = false;
    if (t.count) {
        if (sends && !is_dev(t.send))
            return nccl_fail(c, ncclInvalidArgument, "%s: sendbuff %p is not device memory", call,
                             (const void *)t.send);
        if (recvs && !is_dev(t.recv))
            return nccl_fail(c, ncclInvalidArgument, "%s: recvbuff %p is not device memory", call, (void *)t.recv);
        t.send = sends ? (const char *)dev_range(t.send, send_bytes, call) : NULL;
        t.recv = recvs ? (char *)dev_range(t.recv, recv_bytes, call) : NULL;
    }
    c->inflight++;
    if (G.fail_next) { /* its peers never hear from it; ncclCommGetAsyncError says why */
        G.fail_next = false;
        c->state = COMM_FAILED;
        c->error = ncclRemoteError;
        snprintf(c->last, sizeof c->last, "fake NCCL: injected failure (fake_nccl_fail_next)");
    }
    if (G.group_depth > 0) {
        if (G.ngroup == G.cap_group) {
            G.cap_group = G.cap_group ? 2 * G.cap_group : 16;
            G.group = (task *)realloc(G.group, sizeof(task) * (size_t)G.cap_group);
            G.group_streams = (cudaStream_t *)realloc(G.group_streams, sizeof(cudaStream_t) * (size_t)G.cap_group);
            if (!G.group || !G.group_streams) fatal("out of host memory");
        }
        G.group_streams[G.ngroup] = stream;
        G.group[G.ngroup++] = t;
        return ncclSuccess;
    }
    op *o = new_op(OP_NCCL);
    o->u.nc.tasks = (task *)xmalloc(sizeof(task));
    o->u.nc.tasks[0] = t;
    o->u.nc.ntasks = 1;
    enqueue(S(stream), o, false);
    return ncclSuccess;
}

#define SUBMIT(call, stream, ...)                                   \
    do {                                                            \
        task t__ = {__VA_ARGS__};                                   \
        LOCK();                                                     \
        ncclResult_t r__ = submit(t__, call, stream);               \
        UNLOCK();                                                   \
        return r__;                                                 \
    } while (0)

ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t c,
                           cudaStream_t st) {
    SUBMIT("ncclAllReduce", st, .kind = NT_ALLREDUCE, .comm = c, .send = (const char *)s, .recv = (char *)r, .count = n,
           .dt = dt, .op = op);
}
ncclResult_t ncclReduce(const void *s, void *r, size_t n, ncclDataType_t dt, ncclRedOp_t op, int root, ncclComm_t c,
                        cudaStream_t st) {
    SUBMIT("ncclReduce", st, .kind = NT_REDUCE, .comm = c, .send = (const char *)s, .recv = (char *)r, .count = n,
           .dt = dt, .op = op, .root = root);
}
ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, ncclDataType_t dt, int root, ncclComm_t c,
                           cudaStream_t st) {
    SUBMIT("ncclBroadcast", st, .kind = NT_BROADCAST, .comm = c, .send = (const char *)s, .recv = (char *)r, .count = n,
           .dt = dt, .root = root);
}
ncclResult_t ncclAllGather(const void *s, void *r, size_t n, ncclDataType_t dt, ncclComm_t c, cudaStream_t st) {
    SUBMIT("ncclAllGather", st, .kind = NT_ALLGATHER, .comm = c, .send = (const char *)s, .recv = (char *)r, .count = n,
           .dt = dt);
}
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t c,
                               cudaStream_t st) {
    SUBMIT("ncclReduceScatter", st, .kind = NT_REDUCESCATTER, .comm = c, .send = (const char *)s, .recv = (char *)r,
           .count = n, .dt = dt, .op = op);
}
ncclResult_t ncclSend(const void *s, size_t n, ncclDataType_t dt, int peer, ncclComm_t c, cudaStream_t st) {
    SUBMIT("ncclSend", st, .kind = NT_SEND, .comm = c, .send = (const char *)s, .count = n, .dt = dt, .peer = peer);
}
ncclResult_t ncclRecv(void *r, size_t n, ncclDataType_t dt, int peer, ncclComm_t c, cudaStream_t st) {
    SUBMIT("ncclRecv", st, .kind = NT_RECV, .comm = c, .recv = (char *)r, .count = n, .dt = dt, .peer = peer);
}

ncclResult_t ncclGroupStart(void) { LOCK(); G.group_depth++; UNLOCK(); return ncclSuccess; }
ncclResult_t ncclGroupEnd(void) {
    LOCK();
    if (G.group_depth == 0) {
        UNLOCK();
        return nccl_fail(NULL, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    }
    if (--G.group_depth == 0 && G.ngroup) {
        /* one fused operation per stream: its transfers start together */
        bool *taken = (bool *)calloc((size_t)G.ngroup, 1);
        for (int i = 0; i < G.ngroup; i++) {
            if (taken[i]) continue;
            op *o = new_op(OP_NCCL);
            o->u.nc.tasks = (task *)xmalloc(sizeof(task) * (size_t)G.ngroup);
            for (int j = i; j < G.ngroup; j++)
                if (!taken[j] && S(G.group_streams[j]) == S(G.group_streams[i])) {
                    o->u.nc.tasks[o->u.nc.ntasks++] = G.group[j];
                    taken[j] = true;
                }
            enqueue(S(G.group_streams[i]), o, false);
        }
        free(taken);
        G.ngroup = 0;
    }
    UNLOCK();
    return ncclSuccess;
}

void fake_nccl_fail_next(void) { LOCK(); G.fail_next = true; UNLOCK(); }
long fake_cuda_device_syncs(void) { return G.device_syncs; }
const char *fake_cuda_last_device_sync(void) { return G.last_device_sync ? G.last_device_sync : "none"; }
long fake_cuda_h2d_device_waits(cudaStream_t s) { LOCK(); long n = S(s)->h2d_waits; UNLOCK(); return n; }
long fake_cuda_h2d_host_waits(void) { LOCK(); long n = G.h2d_host_waits; UNLOCK(); return n; }
long long fake_cuda_device_bytes(int reset_peak) {
    LOCK();
    long long peak = G.dev_peak;
    if (reset_peak) G.dev_peak = G.dev_bytes;
    UNLOCK();
    return peak;
}

/* ---------------------------------------------------------------- cuBLAS */
struct cublasContext { cudaStream_t stream; };
cublasStatus_t cublasCreate_v2(cublasHandle_t *h) {
    *h = (cublasHandle_t)calloc(1, sizeof(struct cublasContext));
    return *h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) { free(h); return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) { h->stream = s; return CUBLAS_STATUS_SUCCESS; }
const char *cublasGetStatusName(cublasStatus_t s) {
    return s == CUBLAS_STATUS_SUCCESS      ? "CUBLAS_STATUS_SUCCESS"
        : s == CUBLAS_STATUS_NOT_SUPPORTED ? "CUBLAS_STATUS_NOT_SUPPORTED"
                                           : "CUBLAS_STATUS_INVALID_VALUE";
}
const char *cublasGetStatusString(cublasStatus_t s) {
    return s == CUBLAS_STATUS_SUCCESS      ? "success"
        : s == CUBLAS_STATUS_NOT_SUPPORTED ? "the functionality requested is not supported"
                                           : "an invalid value was used as an argument";
}
/* One GEMM on the handle's stream: C (f32) = alpha op(A) op(B) + beta C, A
   and B f32 or bf16 (elem: their element size), summed in f32 in k order. */
static cublasStatus_t enqueue_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   float alpha, const void *a, size_t aelem, int lda, const void *b, size_t belem,
                                   int ldb, float beta, float *c, int ldc, const char *call) {
    if (!h || m < 0 || n < 0 || k < 0 || lda < (ta ? k : m) || lda < 1 || ldb < (tb ? n : k) || ldb < 1 || ldc < m ||
        ldc < 1)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (!m || !n) return CUBLAS_STATUS_SUCCESS;
    LOCK();
    op *o = new_op(OP_GEMM);
    o->u.g.ta = ta != CUBLAS_OP_N;
    o->u.g.tb = tb != CUBLAS_OP_N;
    o->u.g.m = m;
    o->u.g.n = n;
    o->u.g.k = k;
    o->u.g.lda = lda;
    o->u.g.ldb = ldb;
    o->u.g.ldc = ldc;
    o->u.g.alpha = alpha;
    o->u.g.beta = beta;
    o->u.g.abf16 = aelem == 2;
    o->u.g.bbf16 = belem == 2;
    size_t acols = (size_t)(ta ? m : k), bcols = (size_t)(tb ? k : n);
    char what[64];
    snprintf(what, sizeof what, "%s A", call);
    o->u.g.a = k ? dev_range(a, aelem * ((acols - 1) * (size_t)lda + (size_t)(ta ? k : m)), what) : NULL;
    snprintf(what, sizeof what, "%s B", call);
    o->u.g.b = k ? dev_range(b, belem * ((bcols - 1) * (size_t)ldb + (size_t)(tb ? n : k)), what) : NULL;
    snprintf(what, sizeof what, "%s C", call);
    o->u.g.c = (float *)dev_range(c, sizeof(float) * (((size_t)n - 1) * (size_t)ldc + (size_t)m), what);
    enqueue(S(h->stream), o, true);
    UNLOCK();
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                              const float *alpha, const float *a, int lda, const float *b, int ldb, const float *beta,
                              float *c, int ldc) {
    /* host pointer mode */
    return enqueue_gemm(h, ta, tb, m, n, k, *alpha, a, sizeof(float), lda, b, sizeof(float), ldb, *beta, c, ldc,
                        "cublasSgemm");
}

/* batch GEMMs one after another, each as cublasSgemm */
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                         int k, const float *alpha, const float *a, int lda, long long sa,
                                         const float *b, int ldb, long long sb, const float *beta, float *c, int ldc,
                                         long long sc, int batch) {
    if (batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
    cublasStatus_t r = CUBLAS_STATUS_SUCCESS;
    for (int i = 0; i < batch && r == CUBLAS_STATUS_SUCCESS; i++)
        r = enqueue_gemm(h, ta, tb, m, n, k, *alpha, a + i * sa, sizeof(float), lda, b + i * sb, sizeof(float), ldb,
                         *beta, c + i * sc, ldc, "cublasSgemmStridedBatched");
    return r;
}

/* A and B f32 or bf16, C f32, f32 accumulation: what the examples ask for */
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *a, cudaDataType at, int lda, const void *b, cudaDataType bt,
                            int ldb, const void *beta, void *c, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
    (void)algo;
    bool ok_a = at == CUDA_R_32F || at == CUDA_R_16BF, ok_b = bt == CUDA_R_32F || bt == CUDA_R_16BF;
    if (!ok_a || !ok_b || ct != CUDA_R_32F || (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_PEDANTIC))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    return enqueue_gemm(h, ta, tb, m, n, k, *(const float *)alpha, a, at == CUDA_R_16BF ? 2 : 4, lda, b,
                        bt == CUDA_R_16BF ? 2 : 4, ldb, *(const float *)beta, (float *)c, ldc, "cublasGemmEx");
}
