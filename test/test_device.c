/* test_device.c - on_device models on a fake device, against the one-process
   host model.

   The fake device backend registered here has no GPU behind it. Its memory
   is host memory whose address carries bit 62: not a canonical address, so
   host code that dereferences a device pointer (a memcpy, MPI, a loop)
   faults where it would with a real GPU pointer. Device code - the
   backend's copy, add, scale, zero and transfers, and this test's module
   "kernels" - turns a pointer back into host memory only after checking
   that it lies inside a live allocation and that the tensor holding it
   says it is on the device (host tensors must hold host memory). Fresh
   blocks are filled with garbage and freed ones poisoned, as a GPU would
   leave them. Point to point pairs the k-th isend with the k-th irecv per
   (group, peer, direction) over MPI and insists the sizes match, as NCCL
   does; every request must be waited exactly once. Collectives run smp's
   own host collectives on the translated memory.

   The pipeline runs as in test_pipeline.c (partitions 1, 2, 4, simple and
   interleaved, manual placement 0,1,0,1, two virtual stages, the skip
   connection of net7.h), with the batch halving between steps, three ways:
   through the backend's point to point; with no point to point (the
   executor stages payloads through host buffers); and with point to point
   that says it goes through the host anyway (smp_nccl's staged mode); and
   with fc1 and the skip add as one recomputed composite call whose add is
   smp's built-in one (the backend's copy and add on device tensors); and
   under zero_bubble with the linears' backward split into B and W (the
   device kernels of W read the input and the output gradient B had, which
   smp keeps live on the device until W), with and without the recomputed
   composite, and with data parallelism.
   Losses, outputs and gradients must equal the one-process host model bit
   for bit, and so must data-parallel gradients with deterministic
   reduction, the gradient norm and clipping. A module failure must reach
   every rank and leave the next step correct: the failed step's transfers
   are drained, or they would land in the next step's buffers. */
#define _POSIX_C_SOURCE 200809L
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h"
#include "test.h"
#include "net7.h"

#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

static int world;

/* ================================================================ the fake device */
#define DEV_BIT ((uintptr_t)1 << 62)

static void device_fault(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void device_fault(const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    printf("FAIL: device/memory: %s\n", msg);
    fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 1);
    abort();
}

typedef struct { char *host; size_t bytes; } dev_block;
static dev_block *g_blocks;
static int g_nblocks, g_blocks_cap;

static void *fake_alloc(size_t bytes) {
    char *h = (char *)malloc(bytes ? bytes : 1);
    if (!h) return NULL;
    memset(h, 0xA5, bytes); /* what was there before: code that forgets to zero sees garbage */
    if (g_nblocks == g_blocks_cap) {
        g_blocks_cap = g_blocks_cap ? 2 * g_blocks_cap : 256;
        g_blocks = (dev_block *)realloc(g_blocks, sizeof(dev_block) * (size_t)g_blocks_cap);
    }
    g_blocks[g_nblocks].host = h;
    g_blocks[g_nblocks++].bytes = bytes;
    return (void *)((uintptr_t)h | DEV_BIT);
}

static void fake_dealloc(void *d) {
    if (!d) return;
    char *h = (char *)((uintptr_t)d & ~DEV_BIT);
    for (int i = 0; i < g_nblocks; i++)
        if (g_blocks[i].host == h && ((uintptr_t)d & DEV_BIT)) {
            memset(h, 0xDB, g_blocks[i].bytes);
            free(h);
            g_blocks[i] = g_blocks[--g_nblocks];
            return;
        }
    device_fault("dealloc(%p): not a block alloc returned (a host pointer, or freed twice)", d);
}

/* The host memory behind `bytes` of device memory at d. */
static void *dev_mem(const void *d, size_t bytes, const char *what) {
    if (!((uintptr_t)d & DEV_BIT)) device_fault("%s: %p is host memory where device memory belongs", what, d);
    const char *h = (const char *)((uintptr_t)d & ~DEV_BIT);
    for (int i = 0; i < g_nblocks; i++)
        if (h >= g_blocks[i].host && h + bytes <= g_blocks[i].host + g_blocks[i].bytes) return (void *)h;
    device_fault("%s: %p (%zu bytes) is not inside a live device allocation", what, d, bytes);
}

static void *host_mem(const void *h, const char *what) {
    if ((uintptr_t)h & DEV_BIT) device_fault("%s: %p is device memory where host memory belongs", what, h);
    return (void *)h;
}

/* A tensor's memory as a kernel reads it, checked against its device field. */
static float *mem_of(const smp_tensor *t, const char *what) {
    if (t->device == SMP_HOST) return (float *)host_mem(t->data, what);
    if (t->device != SMP_CUDA(0)) device_fault("%s is on device %d; the fake device is SMP_CUDA(0)", what, t->device);
    return (float *)dev_mem(t->data, smp_tensor_nbytes(t), what);
}
/* ... for tensors an on_device model must keep on the device */
static float *dev_of(const smp_tensor *t, const char *what) {
    if (t->device == SMP_HOST) device_fault("%s is a host tensor in an on_device model", what);
    return mem_of(t, what);
}

/* ---------------------------------------------------------------- the backend */
enum { VIA_P2P, VIA_NO_P2P, VIA_P2P_THROUGH_HOST };
static const char *VIA_NAME[] = {"p2p", "no p2p", "p2p through host"};

static MPI_Comm g_p2p_comm[SMP_GROUP_COUNT];
static bool *g_connected[SMP_GROUP_COUNT];
static int g_device = SMP_CUDA(0);
static long g_isends; /* whether the executor used point to point */

typedef struct fake_req { MPI_Request mpi; size_t bytes; int peer; bool recv, done; } fake_req;
static fake_req *g_reqs[4096];
static int g_nreqs;

static smp_tensor host_view(const smp_tensor *t, const char *what) {
    smp_tensor h = *t;
    if (t->device != SMP_HOST) h.data = dev_mem(t->data, smp_tensor_nbytes(t), what);
    h.device = SMP_HOST;
    return h;
}
static smp_status fake_all_reduce(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g) {
    smp_tensor a = host_view(in, "all_reduce in"), b = host_view(out, "all_reduce out");
    return smp_all_reduce(&a, &b, op, g);
}
/* Gradient buckets: the fake is synchronous, so ordering is trivially
   right; the counters show that the executor reduces every bucket through
   the hook and fences the engine once per step, after the last bucket. */
static int g_bucket_reductions, g_unfenced, g_fences, g_fenced_buckets;
static smp_status fake_bucket_all_reduce(void *data, smp_dtype dt, int64_t n, smp_group g) {
    smp_tensor t = smp_tensor_1d(data, dt, n);
    t.device = g_device;
    g_bucket_reductions++;
    g_unfenced++;
    return fake_all_reduce(&t, &t, SMP_SUM, g);
}
static smp_status fake_bucket_fence(void) {
    g_fences++;
    g_fenced_buckets = g_unfenced;
    g_unfenced = 0;
    return SMP_OK;
}
static smp_status fake_broadcast(smp_tensor *t, int root, smp_group g) {
    smp_tensor a = host_view(t, "broadcast");
    return smp_broadcast(&a, root, g);
}
static smp_status fake_reduce(const smp_tensor *in, smp_tensor *out, smp_op op, int root, smp_group g) {
    smp_tensor a = host_view(in, "reduce in"), b;
    if (out) b = host_view(out, "reduce out");
    return smp_reduce(&a, out ? &b : NULL, op, root, g);
}
static smp_status fake_all_gather(const smp_tensor *in, smp_tensor *out, smp_group g) {
    smp_tensor a = host_view(in, "all_gather in"), b = host_view(out, "all_gather out");
    return smp_all_gather(&a, &b, g);
}
static smp_status fake_reduce_scatter(const smp_tensor *in, smp_tensor *out, smp_op op, smp_group g) {
    smp_tensor a = host_view(in, "reduce_scatter in"), b = host_view(out, "reduce_scatter out");
    return smp_reduce_scatter(&a, &b, op, g);
}
static smp_status fake_all_to_all(const smp_tensor *in, smp_tensor *out, const int64_t *os, const int64_t *is,
                                  smp_group g) {
    smp_tensor a = host_view(in, "all_to_all in"), b = host_view(out, "all_to_all out");
    return smp_all_to_all_single(&a, &b, os, is, g);
}

static smp_status fake_copy(void *dst, int dst_device, const void *src, int src_device, size_t n) {
    void *d = dst_device == SMP_HOST ? host_mem(dst, "copy destination") : dev_mem(dst, n, "copy destination");
    const void *s = src_device == SMP_HOST ? host_mem(src, "copy source") : dev_mem(src, n, "copy source");
    if ((dst_device != SMP_HOST && dst_device != SMP_CUDA(0)) || (src_device != SMP_HOST && src_device != SMP_CUDA(0)))
        device_fault("copy between devices %d and %d; the fake device is SMP_CUDA(0)", dst_device, src_device);
    memmove(d, s, n);
    return SMP_OK;
}

static smp_status fake_add(void *dst, const void *src, smp_dtype dt, int64_t n) {
    size_t bytes = (size_t)n * smp_dtype_size(dt);
    void *a = dev_mem(dst, bytes, "add destination");
    const void *b = dev_mem(src, bytes, "add source");
    if (dt == SMP_F32) for (int64_t i = 0; i < n; i++) ((float *)a)[i] += ((const float *)b)[i];
    else if (dt == SMP_F64) for (int64_t i = 0; i < n; i++) ((double *)a)[i] += ((const double *)b)[i];
    else return smp_error(SMP_ERR_DEVICE, "fake add: %s is not implemented", smp_dtype_name(dt));
    return SMP_OK;
}

static smp_status fake_scale(void *data, smp_dtype dt, int64_t n, double by) {
    void *p = dev_mem(data, (size_t)n * smp_dtype_size(dt), "scale");
    if (dt == SMP_F32) for (int64_t i = 0; i < n; i++) ((float *)p)[i] *= (float)by;
    else if (dt == SMP_F64) for (int64_t i = 0; i < n; i++) ((double *)p)[i] *= by;
    return SMP_OK;
}

static smp_status fake_zero(void *p, size_t bytes) {
    memset(dev_mem(p, bytes, "zero"), 0, bytes);
    return SMP_OK;
}

static int fake_current_device(void) { return g_device; }
static bool fake_through_host(void) { return true; }
static smp_status fake_synchronize(void) { return SMP_OK; }

static smp_status fake_on_init(void) {
    for (int g = 0; g < SMP_GROUP_COUNT; g++) {
        MPI_Comm_dup(smp_group_comm((smp_group)g), &g_p2p_comm[g]);
        MPI_Comm_set_errhandler(g_p2p_comm[g], MPI_ERRORS_RETURN); /* a size mismatch is reported, not fatal */
        g_connected[g] = (bool *)calloc((size_t)smp_group_size((smp_group)g), sizeof(bool));
    }
    return SMP_OK;
}
static void fake_on_finalize(void) {
    for (int g = 0; g < SMP_GROUP_COUNT; g++) {
        MPI_Comm_free(&g_p2p_comm[g]);
        free(g_connected[g]);
        g_connected[g] = NULL;
    }
}

/* Both ranks must connect, as with NCCL: a byte each way. */
static smp_status fake_p2p_connect(smp_group g, const int *peers, int n) {
    MPI_Request reqs[128];
    int out = 1, in[64];
    if (n > 64) return smp_error(SMP_ERR_ARG, "fake connect: %d peers", n);
    for (int i = 0; i < n; i++) {
        MPI_Isend(&out, 1, MPI_INT, peers[i], 1, g_p2p_comm[g], &reqs[2 * i]);
        MPI_Irecv(&in[i], 1, MPI_INT, peers[i], 1, g_p2p_comm[g], &reqs[2 * i + 1]);
    }
    smp_wait_requests(2 * n, reqs, "fake connect", g, -1);
    for (int i = 0; i < n; i++) g_connected[g][peers[i]] = true;
    return SMP_OK;
}

static smp_status fake_p2p_start(void *buf, size_t bytes, int peer, smp_group g, void **req, bool recv) {
    if (!g_connected[g][peer])
        return smp_error(SMP_ERR_STATE, "fake %s: rank %d was never connected", recv ? "irecv" : "isend", peer);
    if (g_nreqs == (int)(sizeof g_reqs / sizeof g_reqs[0]))
        return smp_error(SMP_ERR_NOMEM, "fake point to point: too many requests");
    fake_req *r = (fake_req *)calloc(1, sizeof *r);
    r->bytes = bytes;
    r->peer = peer;
    r->recv = recv;
    void *h = dev_mem(buf, bytes, recv ? "irecv buffer" : "isend buffer");
    int rc = recv ? MPI_Irecv(h, (int)bytes, MPI_BYTE, peer, 0, g_p2p_comm[g], &r->mpi)
                  : MPI_Isend(h, (int)bytes, MPI_BYTE, peer, 0, g_p2p_comm[g], &r->mpi);
    if (rc != MPI_SUCCESS) { free(r); return smp_error(SMP_ERR_DEVICE, "fake point to point: MPI failed"); }
    g_isends += !recv;
    g_reqs[g_nreqs++] = r;
    *req = r;
    return SMP_OK;
}
static smp_status fake_isend(const void *buf, size_t bytes, int peer, smp_group g, void **req) {
    return fake_p2p_start((void *)buf, bytes, peer, g, req, false);
}
static smp_status fake_irecv(void *buf, size_t bytes, int peer, smp_group g, void **req) {
    return fake_p2p_start(buf, bytes, peer, g, req, true);
}

static int live_req(void *req) {
    for (int i = 0; i < g_nreqs; i++)
        if (g_reqs[i] == req) return i;
    device_fault("a point-to-point request %p that is not live (waited twice, or never made)", req);
}

/* The transfer ended: NCCL pairs transfers in order and needs equal sizes. */
static smp_status fake_finished(fake_req *r, int rc, MPI_Status *s) {
    r->done = true;
    int count = -1;
    if (rc == MPI_SUCCESS && r->recv) MPI_Get_count(s, MPI_BYTE, &count);
    if (rc != MPI_SUCCESS || (r->recv && (size_t)count != r->bytes))
        return smp_error(
            SMP_ERR_DEVICE,
            "fake point to point: a receive of %zu bytes from rank %d was paired with a send of another size", r->bytes,
            r->peer);
    return SMP_OK;
}

static smp_status fake_test(void *req, bool *done) {
    fake_req *r = g_reqs[live_req(req)];
    *done = r->done;
    if (r->done) return SMP_OK;
    int flag = 0;
    MPI_Status s;
    int rc = MPI_Test(&r->mpi, &flag, &s);
    if (!flag && rc == MPI_SUCCESS) return SMP_OK;
    *done = true;
    return fake_finished(r, rc, &s);
}

static smp_status fake_wait(void *req) {
    int i = live_req(req);
    fake_req *r = g_reqs[i];
    smp_status st = SMP_OK;
    double t0 = MPI_Wtime();
    while (!r->done) {
        int flag = 0;
        MPI_Status s;
        int rc = MPI_Test(&r->mpi, &flag, &s);
        if (flag || rc != MPI_SUCCESS) st = fake_finished(r, rc, &s);
        else if (MPI_Wtime() - t0 > 60) device_fault("a point-to-point transfer with rank %d never finished", r->peer);
        else sched_yield();
    }
    g_reqs[i] = g_reqs[--g_nreqs];
    memset(r, 0xDB, sizeof *r);
    free(r);
    return st;
}

static void register_fake(int via) {
    smp_device_backend b;
    memset(&b, 0, sizeof b);
    b.name = "fake";
    b.all_reduce = fake_all_reduce;
    b.broadcast = fake_broadcast;
    b.reduce = fake_reduce;
    b.all_gather = fake_all_gather;
    b.reduce_scatter = fake_reduce_scatter;
    b.all_to_all_single = fake_all_to_all;
    b.copy = fake_copy;
    b.on_init = fake_on_init;
    b.on_finalize = fake_on_finalize;
    if (via != VIA_NO_P2P) {
        b.p2p_connect = fake_p2p_connect;
        b.isend = fake_isend;
        b.irecv = fake_irecv;
        b.test = fake_test;
        b.wait = fake_wait;
    }
    if (via == VIA_P2P_THROUGH_HOST) b.p2p_through_host = fake_through_host;
    b.alloc = fake_alloc;
    b.dealloc = fake_dealloc;
    b.add = fake_add;
    b.synchronize = fake_synchronize;
    b.current_device = fake_current_device;
    b.scale = fake_scale;
    b.zero = fake_zero;
    b.bucket_all_reduce = fake_bucket_all_reduce;
    b.bucket_fence = fake_bucket_fence;
    smp_register_device_backend(&b);
}

/* A device copy of host floats (the test's own upload). */
static smp_tensor upload(const float *h, int64_t rows, int64_t cols) {
    smp_tensor t = smp_tensor_2d(fake_alloc(sizeof(float) * (size_t)(rows * cols)), SMP_F32, rows, cols);
    memcpy(dev_mem(t.data, smp_tensor_nbytes(&t), "upload"), h, smp_tensor_nbytes(&t));
    t.device = SMP_CUDA(0);
    return t;
}

/* ================================================================ the model's device kernels */
/* net7.h's kernels, reading and writing device memory through the checks. */
static smp_status dev_lin_forward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    if (g_fail >= 0 && smp_mp_rank() == g_fail && (g_fail_mb < 0 || smp_call_microbatch(c) == g_fail_mb))
        return smp_error(SMP_ERR_MODULE, "injected failure");
    int64_t n = x->shape[0], shape[2] = {n, s->out};
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, shape);
    linear_fwd(mem_of(x, "linear input"), dev_of(smp_param_value(s->w), "weight"),
               dev_of(smp_param_value(s->b), "bias"), dev_of(y, "linear output"), (int)n, s->in, s->out);
    return SMP_OK;
}
static smp_status dev_lin_backward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *gx = smp_call_grad_input(c, 0);
    linear_bwd(mem_of(x, "linear input"), dev_of(smp_param_value(s->w), "weight"),
               dev_of(smp_call_grad_output(c, 0), "linear output gradient"),
               gx ? dev_of(gx, "linear input gradient") : NULL, dev_of(smp_param_grad(s->w), "weight gradient"),
               dev_of(smp_param_grad(s->b), "bias gradient"), (int)x->shape[0], s->in, s->out);
    return SMP_OK;
}
/* The split backward (zero_bubble): B writes the input gradient, W adds
   the weight and bias gradients, each reading only live device memory. */
static smp_status dev_lin_backward_input(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *gy = smp_call_grad_output(c, 0);
    smp_tensor *gx = smp_call_grad_input(c, 0);
    if (!gy) return smp_error(SMP_ERR_MODULE, "backward_input without an output gradient");
    if (gx)
        linear_bwd_input(dev_of(smp_param_value(s->w), "weight"), dev_of(gy, "linear output gradient (B)"),
                         dev_of(gx, "linear input gradient"), (int)gy->shape[0], s->in, s->out);
    return SMP_OK;
}
static smp_status dev_lin_backward_weight(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *gy = smp_call_grad_output(c, 0);
    if (!x || !gy) return smp_error(SMP_ERR_MODULE, "backward_weight without its input or output gradient");
    linear_bwd_weight(mem_of(x, "linear input (W)"), dev_of(gy, "linear output gradient (W)"),
                      dev_of(smp_param_grad(s->w), "weight gradient"), dev_of(smp_param_grad(s->b), "bias gradient"),
                      (int)x->shape[0], s->in, s->out);
    return SMP_OK;
}
static const net_split_fns DEV_SPLIT = {dev_lin_backward_input, dev_lin_backward_weight};
static bool g_split; /* pipeline_case and ddp_case: the linears' backward split */

/* ReLU keeps its mask in the device stash, as a CUDA engine would: the
   backward faults unless the stash is live device memory. */
static smp_status dev_relu_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    const float *xs = mem_of(x, "relu input");
    float *ys = dev_of(y, "relu output");
    size_t n = (size_t)smp_tensor_numel(x);
    unsigned char *mask = NULL;
    if (smp_call_is_training(c)) {
        void *d = smp_call_stash_device(c, n);
        if (!d) return SMP_ERR_NOMEM;
        mask = (unsigned char *)dev_mem(d, n, "relu mask (device stash)");
    }
    for (size_t i = 0; i < n; i++) {
        ys[i] = xs[i] > 0 ? xs[i] : 0;
        if (mask) mask[i] = xs[i] > 0;
    }
    return SMP_OK;
}
static smp_status dev_relu_backward(smp_call_ctx *c) {
    const float *gy = dev_of(smp_call_grad_output(c, 0), "relu output gradient");
    size_t n = 0;
    const void *d = smp_call_stashed_device(c, &n);
    const unsigned char *mask = (const unsigned char *)dev_mem(d, n, "relu mask (device stash)");
    smp_tensor *gx = smp_call_grad_input(c, 0);
    float *g = gx ? dev_of(gx, "relu input gradient") : NULL;
    if (g && (size_t)smp_tensor_numel(gx) != n)
        device_fault("relu mask: %zu bytes stashed for %lld elements", n, (long long)smp_tensor_numel(gx));
    for (size_t i = 0; g && i < n; i++) g[i] = mask[i] ? gy[i] : 0;
    return SMP_OK;
}
static smp_status dev_add_forward(smp_call_ctx *c) {
    const smp_tensor *a = smp_call_input(c, 0), *b = smp_call_input(c, 1);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, a->ndim, a->shape);
    const float *as = mem_of(a, "add input 0"), *bs = mem_of(b, "add input 1");
    float *ys = dev_of(y, "add output");
    for (int64_t i = 0; i < smp_tensor_numel(a); i++) ys[i] = as[i] + bs[i];
    return SMP_OK;
}
static smp_status dev_add_backward(smp_call_ctx *c) {
    const smp_tensor *gy = smp_call_grad_output(c, 0);
    for (int k = 0; k < 2; k++) {
        smp_tensor *g = smp_call_grad_input(c, k);
        if (g) memcpy(dev_of(g, "add input gradient"), dev_of(gy, "add output gradient"), smp_tensor_nbytes(gy));
    }
    return SMP_OK;
}
static const net_fns DEV_FNS = {dev_lin_forward,   dev_lin_backward, dev_relu_forward,
                                dev_relu_backward, dev_add_forward,  dev_add_backward};
/* smp's built-in add, on the device through the backend's copy and add */
static const net_fns DEV_FNS_BUILTIN_ADD = {
    dev_lin_forward, dev_lin_backward, dev_relu_forward, dev_relu_backward, NULL, NULL};
static bool g_block; /* pipeline_case: fc1 + the built-in skip add as one recomputed composite call */

/* Loss and output gradient on the device; the third argument, split along
   axis 1, must hold this microbatch's columns. */
SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1), *cols = smp_mb_arg(mb, 2);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    float loss = mse(dev_of(y, "model output"), mem_of(t, "target"), g ? dev_of(g, "output gradient") : NULL,
                     (int)smp_tensor_numel(y));
    if (cols) {
        const float *v = mem_of(cols, "argument 2");
        int64_t w = cols->shape[1];
        for (int64_t a = 0; a < 2; a++)
            for (int64_t j = 0; j < w; j++)
                if (v[a * w + j] != (float)(a * 1000 + smp_mb_index(mb) * w + j))
                    return smp_error(SMP_ERR_MODULE,
                                     "argument 2 (split along axis 1) holds %g at [%lld, %lld] of microbatch %d",
                                     v[a * w + j], (long long)a, (long long)j, smp_mb_index(mb));
    }
    smp_status st = smp_mb_return_f32(mb, 0, loss);
    return st ? st : smp_mb_return(mb, 1, y); /* a device value: StepOutputs hold host copies */
}

/* ================================================================ checks */
static float g_x[4 * B * D], g_t[4 * B * C];
static const char *LIN[NLIN] = {"fc0", "fc1", "fc2", "head"};

static int world_rank(void) {
    int r;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

static int agree(int ok) {
    int all;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    return all;
}

/* This rank's gradients and initial weights against the reference, read from the device. */
static int compare_params(smp_model *m, const float gw[NLIN][H * H], const float gb[NLIN][H], const ref_t *r, char *why,
                          size_t cap) {
    for (int l = 0; l < NLIN; l++) {
        char nm[64];
        snprintf(nm, sizeof nm, "%s.weight", LIN[l]);
        smp_param *pw = smp_model_find_param(m, nm);
        snprintf(nm, sizeof nm, "%s.bias", LIN[l]);
        smp_param *pb = smp_model_find_param(m, nm);
        if (!smp_module_is_local(smp_param_module(pw))) continue;
        size_t nw = (size_t)(lin_out[l] * lin_in[l]);
        const float *g = dev_of(smp_param_grad(pw), "weight gradient"),
                    *gbias = dev_of(smp_param_grad(pb), "bias gradient");
        if (memcmp(g, gw[l], nw * 4) || memcmp(gbias, gb[l], (size_t)lin_out[l] * 4)) {
            size_t i = 0;
            while (i + 1 < nw && g[i] == gw[l][i]) i++;
            snprintf(why, cap, "gradient of %s differs (weight element %zu: %.9g vs reference %.9g)", LIN[l], i, g[i],
                     gw[l][i]);
            return 0;
        }
        if (r && memcmp(dev_of(smp_param_value(pw), "weight"), r->w[l], nw * 4)) {
            snprintf(why, cap, "initial value of %s.weight differs", LIN[l]);
            return 0;
        }
    }
    return 1;
}

static int compare_losses(const smp_step_output *outs, const ref_t *r, int m, int rows, char *why, size_t cap) {
    for (int i = 0; i < m; i++) {
        float got = ((const float *)host_mem(outs[0].values[i].data, "a StepOutput"))[0];
        if (memcmp(&got, &r->loss[i], 4)) {
            snprintf(why, cap, "loss of microbatch %d: %.9g vs reference %.9g", i, got, r->loss[i]);
            return 0;
        }
    }
    float all[B * C];
    smp_tensor cat = smp_tensor_2d(all, SMP_F32, rows, C);
    if (smp_step_output_concat(&outs[1], &cat) || memcmp(all, r->out, sizeof(float) * (size_t)(rows * C))) {
        snprintf(why, cap, "the concatenated outputs differ from the reference");
        return 0;
    }
    return 1;
}

/* The arguments of a step on `rows` rows: x, t and a [2, rows] tensor split along axis 1. */
typedef struct { smp_tensor x, t, cols; float colbuf[2 * B]; } step_args;
static void make_args(step_args *a, const float *x, const float *t, int rows, bool on_device) {
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < rows; j++) a->colbuf[k * rows + j] = (float)(k * 1000 + j);
    if (on_device) {
        a->x = upload(x, rows, D);
        a->t = upload(t, rows, C);
        a->cols = upload(a->colbuf, 2, rows);
    } else {
        a->x = smp_tensor_2d((void *)x, SMP_F32, rows, D);
        a->t = smp_tensor_2d((void *)t, SMP_F32, rows, C);
        a->cols = smp_tensor_2d(a->colbuf, SMP_F32, 2, rows);
    }
}
static void free_args(step_args *a) {
    if (a->x.device == SMP_HOST) return;
    fake_dealloc(a->x.data);
    fake_dealloc(a->t.data);
    fake_dealloc(a->cols.data);
}
static smp_status train(smp_model *m, step_args *a, smp_step_output *outs, bool evaluate) {
    smp_step_desc d;
    memset(&d, 0, sizeof d);
    d.model = m;
    d.body = mse_body;
    d.nargs = 3;
    d.args[0] = a->x;
    d.args[1] = a->t;
    d.args[2] = a->cols;
    d.split_axis[2] = 1;
    d.evaluate = evaluate;
    return smp_step(&d, outs, 2);
}

static smp_config base_config(int P, int m) {
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.partitions = P;
    cfg.microbatches = m;
    cfg.ddp = world > P ? SMP_ON : SMP_OFF;
    cfg.deterministic_reduction = SMP_ON;
    cfg.seed = 7;
    return cfg;
}

/* Ends a case: nothing of the model may stay on the device or in flight. */
static int finish(smp_model *m, int ok, char *why, size_t cap) {
    smp_model_free(m);
    smp_finalize();
    if (ok && g_nblocks) {
        snprintf(why, cap, "%d device blocks are still allocated after smp_model_free", g_nblocks);
        ok = 0;
    }
    if (ok && g_nreqs) { snprintf(why, cap, "%d point-to-point requests were never waited", g_nreqs); ok = 0; }
    return ok;
}

/* ---------------------------------------------------------------- the pipeline */
static void pipeline_case(int P, int m, smp_pipeline_kind kind, const int *placement, int vstages, int via,
                          bool device_args, const char *label) {
    register_fake(via);
    smp_config cfg = base_config(P, m);
    cfg.pipeline = kind;
    cfg.virtual_stages = vstages;
    if (placement) cfg.auto_partition = SMP_OFF;
    char name[200], why[4096] = "";
    snprintf(name, sizeof name, "device/%s/%s%s/P=%d/m=%d/%s%s", VIA_NAME[via], label,
             device_args ? "" : ", host arguments", P, m,
             kind == SMP_PIPELINE_SIMPLE          ? "simple"
             : kind == SMP_PIPELINE_ZERO_BUBBLE   ? "zero_bubble"
             : kind == SMP_PIPELINE_ZERO_BUBBLE_V ? "zero_bubble_v"
                                                  : "interleaved",
             g_split ? "/split linears" : "");
    if (smp_init(&cfg)) { MPI_CHECK(0, name, "smp_init: %s", smp_last_error()); return; }
    net n;
    net_modules_split(&n, placement, g_block ? &DEV_FNS_BUILTIN_ADD : &DEV_FNS, g_split ? &DEV_SPLIT : NULL);
    if (g_block) net_block(&n, true);
    smp_model *model = net_model(&n, true);
    ref_t ref;
    ref_params(&ref);
    int ok = model != NULL;
    if (!ok) snprintf(why, sizeof why, "build: %s", smp_last_error());
    long isends0 = g_isends;
    for (int step = 0; step < 2 && ok; step++) { /* the batch halves: every shape changes */
        int rows = step ? B / 2 : B;
        step_args a;
        make_args(&a, g_x, g_t, rows, device_args);
        smp_step_output outs[2] = {{0, NULL}, {0, NULL}};
        smp_status st = train(model, &a, outs, false);
        ref_step_rows(&ref, g_x, g_t, rows, m, true);
        if (st) { snprintf(why, sizeof why, "step %d: %s", step, smp_last_error()); ok = 0; }
        if (ok)
            ok =
                compare_losses(outs, &ref, m, rows, why, sizeof why) &&
                compare_params(model, (const float(*)[H * H]) ref.gw, (const float(*)[H])ref.gb, &ref, why, sizeof why);
        if (ok && g_nreqs) {
            snprintf(why, sizeof why, "step %d left %d point-to-point requests unwaited", step, g_nreqs);
            ok = 0;
        }
        smp_step_output_free(&outs[0]);
        smp_step_output_free(&outs[1]);
        free_args(&a);
        if (!agree(ok) && ok) { ok = 0; snprintf(why, sizeof why, "another rank failed at step %d", step); }
    }
    if (ok && P > 1 && (g_isends > isends0) != (via == VIA_P2P)) { /* the path the executor chose */
        snprintf(why, sizeof why, "%ld point-to-point sends: payloads went the wrong way", g_isends - isends0);
        ok = 0;
    }
    ok = finish(model, ok, why, sizeof why);
    MPI_CHECK(ok, name, "%s", why);
}

/* ---------------------------------------------------------------- a failure, then a clean step */
static void failure_case(int P, int via) {
    register_fake(via);
    smp_config cfg = base_config(P, 4);
    char name[200], why[4096] = "";
    net n;
    smp_model *model = smp_init(&cfg) ? NULL : build_with(&n, NULL, &DEV_FNS, true);
    if (!model) { MPI_CHECK(0, "device/failure case set-up", "%s", smp_last_error()); return; }
    step_args a;
    make_args(&a, g_x, g_t, B, true);
    smp_step_output outs[2] = {{0, NULL}, {0, NULL}};
    smp_model_trace(model, &a.x, 1); /* trace first, so the failures hit steps */
    for (int round = 0; round < 2; round++) {
        g_fail = P - 1;
        g_fail_mb = round ? 2 : -1; /* round 1: the others are already waiting on the failing stage */
        smp_status st = train(model, &a, outs, false);
        g_fail = g_fail_mb = -1;
        snprintf(name, sizeof name,
                 "device/%s/a module failure%s reaches every rank and its transfers are drained/P=%d", VIA_NAME[via],
                 round ? " on microbatch 2" : "", P);
        MPI_CHECK(st != SMP_OK && strstr(smp_last_error(), "injected failure") && g_nreqs == 0, name,
                  "status %d, %d requests unwaited, message: %s", (int)st, g_nreqs, smp_last_error());
    }
    ref_t ref;
    ref_params(&ref);
    ref_step_rows(&ref, g_x, g_t, B, 4, false);
    smp_status st = train(model, &a, outs, false);
    int ok = st == SMP_OK;
    if (!ok) snprintf(why, sizeof why, "%s", smp_last_error());
    if (ok) ok = compare_losses(outs, &ref, 4, B, why, sizeof why);
    ok = agree(ok);
    st = train(model, &a, outs, true); /* evaluation: forward only */
    if (ok && st) { ok = 0; snprintf(why, sizeof why, "evaluation: %s", smp_last_error()); }
    if (ok) ok = compare_losses(outs, &ref, 4, B, why, sizeof why);
    smp_step_output_free(&outs[0]);
    smp_step_output_free(&outs[1]);
    free_args(&a);
    ok = finish(model, agree(ok), why, sizeof why);
    snprintf(name, sizeof name, "device/%s/the steps after failures equal the reference (training and evaluation)/P=%d",
             VIA_NAME[via], P);
    MPI_CHECK(ok, name, "%s", why);
}

/* The gradients a DDP step of dp replicas must leave: the one-process reference's, each replica's shard of g_x and
   g_t (4 microbatches) divided by 4 x dp, summed in replica order. */
static void ddp_reference_grads(int dp, float gw[NLIN][H * H], float gb[NLIN][H]) {
    ref_t base, rep;
    ref_params(&base);
    for (int q = 0; q < dp; q++) {
        rep = base;
        ref_step_divided(&rep, g_x + (size_t)q * B * D, g_t + (size_t)q * B * C, 4, true, 4.0 * dp);
        for (int l = 0; l < NLIN; l++) {
            for (int i = 0; i < H * H; i++) gw[l][i] = q ? gw[l][i] + rep.gw[l][i] : rep.gw[l][i];
            for (int i = 0; i < H; i++) gb[l][i] = q ? gb[l][i] + rep.gb[l][i] : rep.gb[l][i];
        }
    }
}

/* ---------------------------------------------------------------- data parallelism */
/* dp replicas on their own rows, one step of 4 microbatches; the reference
   divides each loss gradient by 4 x dp and sums the replicas' gradients in
   dp-rank order. */
static void ddp_case(int P, bool deterministic) {
    int dp = world / P;
    register_fake(VIA_P2P);
    smp_config cfg = base_config(P, 4);
    cfg.ddp = SMP_ON;
    cfg.deterministic_reduction = deterministic ? SMP_ON : SMP_OFF;
    cfg.bucket_cap_mb = 1e-4; /* about 100 bytes: several buckets */
    if (!deterministic) { /* split by bytes, not by traced time, which can leave a rank only the head: one bucket */
        cfg.memory_weight = 1;
        cfg.has_memory_weight = true;
    }
    if (g_split) cfg.pipeline = SMP_PIPELINE_ZERO_BUBBLE;
    const char *sfx = g_split ? "/zero_bubble/split linears" : "";
    char name[200], why[4096] = "";
    snprintf(name, sizeof name, "device/ddp/%dx%d/%s bitwise equal to one process%s", P, dp,
             deterministic ? "deterministic reduction," : "two replicas,", sfx);
    net n;
    smp_model *model = NULL;
    if (!smp_init(&cfg)) {
        net_modules_split(&n, NULL, &DEV_FNS, g_split ? &DEV_SPLIT : NULL);
        model = net_model(&n, true);
    }
    if (!model) { MPI_CHECK(0, name, "set-up: %s", smp_last_error()); return; }
    int r = smp_dp_rank();
    step_args a;
    make_args(&a, g_x + (size_t)r * B * D, g_t + (size_t)r * B * C, B, true);
    smp_step_output outs[2] = {{0, NULL}, {0, NULL}};
    g_bucket_reductions = g_unfenced = g_fences = g_fenced_buckets = 0;
    smp_status st = train(model, &a, outs, false);
    if (!deterministic) {
        snprintf(name, sizeof name, "device/ddp/%dx%d/buckets reduce behind the engine, fenced once after the last", P,
                 dp);
        MPI_CHECK(st == SMP_OK && g_bucket_reductions >= 2 && g_fences == 1 &&
                      g_fenced_buckets == g_bucket_reductions && g_unfenced == 0,
                  name, "%d bucket reductions, %d fences (the last after %d of them), %d unfenced", g_bucket_reductions,
                  g_fences, g_fenced_buckets, g_unfenced);
        snprintf(name, sizeof name, "device/ddp/%dx%d/%s bitwise equal to one process%s", P, dp, "two replicas,", sfx);
    }
    float gw[NLIN][H * H], gb[NLIN][H];
    ddp_reference_grads(dp, gw, gb);
    int ok = st == SMP_OK;
    if (!ok) snprintf(why, sizeof why, "step: %s", smp_last_error());
    if (ok) ok = compare_params(model, (const float (*)[H * H])gw, (const float (*)[H])gb, NULL, why, sizeof why);
    MPI_CHECK(ok, name, "%s", why);
    if (deterministic) {
        /* the norm of the averaged gradients, per parameter in model order, then clipping to a quarter of it */
        double sq[2 * NLIN] = {0}, total = 0, got = -1;
        for (int l = 0; l < NLIN; l++) {
            for (int i = 0; i < lin_out[l] * lin_in[l]; i++) sq[2 * l] += (double)gw[l][i] * gw[l][i];
            for (int i = 0; i < lin_out[l]; i++) sq[2 * l + 1] += (double)gb[l][i] * gb[l][i];
        }
        for (int i = 0; i < 2 * NLIN; i++) total += sq[i];
        double norm = sqrt(total);
        float coef = (float)(norm / 4 / (norm + 1e-6));
        for (int l = 0; l < NLIN; l++) {
            for (int i = 0; i < lin_out[l] * lin_in[l]; i++) gw[l][i] *= coef;
            for (int i = 0; i < lin_out[l]; i++) gb[l][i] *= coef;
        }
        st = ok ? smp_clip_grad_norm(model, norm / 4, &got) : SMP_ERR_STATE;
        ok = st == SMP_OK && memcmp(&got, &norm, sizeof norm) == 0;
        if (!ok)
            snprintf(why, sizeof why, "status %d (%s), norm %.17g vs %.17g", (int)st, st ? smp_last_error() : "", got,
                     norm);
        if (ok) ok = compare_params(model, (const float (*)[H * H])gw, (const float (*)[H])gb, NULL, why, sizeof why);
        snprintf(name, sizeof name,
                 "device/ddp/%dx%d/gradient norm and clipping of device gradients equal one process%s", P, dp, sfx);
        MPI_CHECK(ok, name, "%s", why);
        /* the scaler: an overflow in the last rank's device gradients skips the step everywhere */
        smp_grad_scaler scaler;
        memset(&scaler, 0, sizeof scaler);
        double s0 = smp_grad_scaler_scale(&scaler);
        smp_param *p0 = smp_model_local_param(model, 0, false);
        if (smp_rank() == world - 1 && p0) dev_of(smp_param_grad(p0), "gradient")[0] = INFINITY;
        bool skip = false;
        st = smp_grad_scaler_unscale(model, &scaler, &skip);
        snprintf(name, sizeof name, "device/ddp/%dx%d/the scaler finds an overflow in device gradients on one rank%s",
                 P, dp, sfx);
        MPI_CHECK(!st && skip && scaler.scale == s0 * 0.5, name, "status %d, skip %d, scale %g (was %g)", (int)st, skip,
                  scaler.scale, s0);
    }
    smp_step_output_free(&outs[0]);
    smp_step_output_free(&outs[1]);
    free_args(&a);
    ok = finish(model, 1, why, sizeof why);
    snprintf(name, sizeof name, "device/ddp/%dx%d/%s: no device memory left behind%s", P, dp,
             deterministic ? "deterministic" : "all-reduce", sfx);
    MPI_CHECK(ok, name, "%s", why);
}

/* shard_optimizer_state on device buckets (the backend's reduce-scatter, or its all-to-all summed in rank order):
   after one step each replica's device gradients hold the one-process average where it owns them and zeros
   elsewhere; SGD on the owned ranges, then smp_model_gather_params (deterministic: the next step, an evaluation),
   leaves every replica with the one-process update of every parameter. */
static void shard_case(int P, bool deterministic) {
    int dp = world / P;
    register_fake(VIA_P2P);
    smp_config cfg = base_config(P, 4);
    cfg.ddp = SMP_ON;
    cfg.deterministic_reduction = deterministic ? SMP_ON : SMP_OFF;
    cfg.shard_optimizer_state = SMP_ON;
    cfg.bucket_cap_mb = 1e-4; /* about 100 bytes: several buckets, parameters across the pieces */
    char name[200], why[4096] = "";
    snprintf(name, sizeof name, "device/ddp/%dx%d/shard_optimizer_state%s: reduce-scattered device gradients and the "
             "gathered update equal one process", P, dp, deterministic ? ", deterministic" : "");
    net n;
    smp_model *model = NULL;
    if (!smp_init(&cfg)) {
        net_modules(&n, NULL, &DEV_FNS);
        model = net_model(&n, true);
    }
    if (!model) { MPI_CHECK(0, name, "set-up: %s", smp_last_error()); return; }
    int r = smp_dp_rank();
    step_args a;
    make_args(&a, g_x + (size_t)r * B * D, g_t + (size_t)r * B * C, B, true);
    smp_step_output outs[2] = {{0, NULL}, {0, NULL}};
    smp_status st = train(model, &a, outs, false);
    float gw[NLIN][H * H], gb[NLIN][H];
    ddp_reference_grads(dp, gw, gb);
    ref_t base;
    ref_params(&base);
    int ok = st == SMP_OK;
    if (!ok) snprintf(why, sizeof why, "step: %s", smp_last_error());
    static const char *names[NLIN] = {"fc0", "fc1", "fc2", "head"};
    for (int l = 0; l < NLIN && ok; l++)
        for (int wb = 0; wb < 2 && ok; wb++) {
            char nm[64];
            snprintf(nm, sizeof nm, "%s.%s", names[l], wb ? "bias" : "weight");
            smp_param *p = smp_model_find_param(model, nm);
            if (!smp_module_is_local(smp_param_module(p))) continue;
            int64_t first = 0, count = 0, numel = smp_tensor_numel(smp_param_grad(p));
            smp_param_owned_range(model, p, &first, &count);
            float *g = dev_of(smp_param_grad(p), "gradient"), *w = dev_of(smp_param_value(p), "weight");
            const float *want = wb ? gb[l] : gw[l];
            for (int64_t k = 0; k < numel && ok; k++) {
                float expect = k >= first && k < first + count ? want[k] : 0.0f;
                if (memcmp(&g[k], &expect, sizeof expect)) {
                    snprintf(why, sizeof why, "%s gradient [%lld] = %.9g, want %.9g (owned [%lld, %lld))", nm,
                             (long long)k, g[k], expect, (long long)first, (long long)(first + count));
                    ok = 0;
                }
            }
            for (int64_t k = first; k < first + count; k++) w[k] -= 0.05f * g[k];
        }
    ok = agree(ok);
    if (deterministic) { /* the next step gathers, here an evaluation (this backend has no gather_start) */
        smp_step_output more[2] = {{0, NULL}, {0, NULL}};
        st = ok ? train(model, &a, more, true) : SMP_ERR_STATE;
        smp_step_output_free(&more[0]);
        smp_step_output_free(&more[1]);
    } else st = ok ? smp_model_gather_params(model) : SMP_ERR_STATE;
    if (ok && st) { ok = 0; snprintf(why, sizeof why, "gather: %s", smp_last_error()); }
    for (int l = 0; l < NLIN && ok; l++)
        for (int wb = 0; wb < 2 && ok; wb++) {
            char nm[64];
            snprintf(nm, sizeof nm, "%s.%s", names[l], wb ? "bias" : "weight");
            smp_param *p = smp_model_find_param(model, nm);
            if (!smp_module_is_local(smp_param_module(p))) continue;
            const float *w = dev_of(smp_param_value(p), "weight"), *w0 = wb ? base.b[l] : base.w[l];
            const float *g = wb ? gb[l] : gw[l];
            for (int64_t k = 0; k < smp_tensor_numel(smp_param_value(p)) && ok; k++) {
                float expect = w0[k] - 0.05f * g[k];
                if (memcmp(&w[k], &expect, sizeof expect)) {
                    snprintf(why, sizeof why, "%s [%lld] after the gather = %.9g, want %.9g", nm, (long long)k, w[k],
                             expect);
                    ok = 0;
                }
            }
        }
    smp_step_output_free(&outs[0]);
    smp_step_output_free(&outs[1]);
    free_args(&a);
    ok = finish(model, agree(ok), why, sizeof why);
    MPI_CHECK(ok, name, "%s", why);
}

/* ---------------------------------------------------------------- checkpoints */
/* An on_device model saved (partial and full) and loaded into a fresh one
   whose weights were cleared: every parameter comes back. */
static void checkpoint_case(int P) {
    register_fake(VIA_P2P);
    smp_config cfg = base_config(P, 2);
    int placement[7]; /* manual: traced times must not split the two models differently */
    for (int k = 0; k < 7; k++) placement[k] = k * P / 7;
    if (P > 1) cfg.auto_partition = SMP_OFF;
    char path[64], name[160], why[4096] = "";
    snprintf(path, sizeof path, "build/test_device_ckpt_%d", world);
    net a, b;
    smp_model *ma = smp_init(&cfg) ? NULL : build_with(&a, P > 1 ? placement : NULL, &DEV_FNS, true);
    if (!ma) { MPI_CHECK(0, "device/checkpoint set-up", "%s", smp_last_error()); return; }
    step_args args;
    make_args(&args, g_x, g_t, B, true);
    smp_step_output outs[2] = {{0, NULL}, {0, NULL}};
    smp_status st = train(ma, &args, outs, false);
    for (int full = 0; full < 2 && !st; full++) {
        smp_save_desc sd;
        memset(&sd, 0, sizeof sd);
        sd.partial = full ? SMP_OFF : SMP_ON;
        st = smp_save(ma, path, &sd);
        smp_model *mb = NULL;
        if (!st) {
            mb = build_with(&b, P > 1 ? placement : NULL, &DEV_FNS, true);
            if (!mb) st = SMP_ERR_STATE;
        }
        if (!st) st = smp_model_trace(mb, &args.x, 1);
        for (int i = 0; !st && smp_model_local_param(mb, i, true); i++) { /* other weights than the saved ones */
            const smp_tensor *v = smp_param_value(smp_model_local_param(mb, i, true));
            memset(dev_of(v, "parameter"), 0, smp_tensor_nbytes(v));
        }
        smp_load_desc ld;
        memset(&ld, 0, sizeof ld);
        ld.partial = sd.partial;
        if (!st) st = smp_load(mb, path, &ld);
        if (st) snprintf(why, sizeof why, "%s: %s", full ? "full" : "partial", smp_last_error());
        for (int i = 0; !st && smp_model_local_param(ma, i, true); i++) {
            smp_param *pa = smp_model_local_param(ma, i, true), *pb = smp_model_local_param(mb, i, true);
            const smp_tensor *va = smp_param_value(pa), *vb = smp_param_value(pb);
            if (memcmp(dev_of(va, "saved parameter"), dev_of(vb, "loaded parameter"), smp_tensor_nbytes(va))) {
                snprintf(why, sizeof why, "%s: %s did not come back", full ? "full" : "partial", smp_param_name(pa));
                st = SMP_ERR_FORMAT;
            }
        }
        smp_model_free(mb);
    }
    smp_step_output_free(&outs[0]);
    smp_step_output_free(&outs[1]);
    free_args(&args);
    int ok = finish(ma, agree(st == SMP_OK), why, sizeof why);
    snprintf(name, sizeof name,
             "device/checkpoints of an on_device model: partial and full save, load into cleared weights/P=%d", P);
    MPI_CHECK(ok, name, "%s", why);
    if (world_rank() == 0) { /* the partial save's files are named by its manifest: read them before it goes */
        char file[160];
        for (int k = 0; k < P; k++)
            if (smp_ckpt_partial_file(path, k, file, sizeof file, NULL) == SMP_OK) remove(file);
        snprintf(file, sizeof file, "%s.manifest", path);
        remove(file);
        remove(path);
    }
}

/* ---------------------------------------------------------------- what on_device needs */
static int g_no_device(void) { return SMP_HOST; }
/* ---------------------------------------------------------------- tensor parallelism */
/* The TP modules on device tensors against the same model on host tensors,
   bitwise: x -> scale (w, whole) -> tp_scatter(1) -> tp_gather(1) ->
   tp_scatter(0) -> tp_gather(0) -> tp_copy -> tp_reduce, one kernel for both
   (mem_of reads host or device memory). */
#define TP_ROWS 4
#define TP_COLS 8
static smp_status tp_scale_forward(smp_call_ctx *c) {
    smp_param **w = (smp_param **)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    const float *xs = mem_of(x, "tp scale input"), *ws = mem_of(smp_param_value(w[0]), "tp scale weight");
    float *ys = mem_of(y, "tp scale output");
    for (int64_t e = 0; e < smp_tensor_numel(x); e++) ys[e] = xs[e] * ws[e % TP_COLS];
    return SMP_OK;
}
static smp_status tp_scale_backward(smp_call_ctx *c) {
    smp_param **w = (smp_param **)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *g = smp_call_grad_output(c, 0);
    const float *xs = mem_of(x, "tp scale input"), *gs = mem_of(g, "tp scale output gradient");
    float *gw = mem_of(smp_param_grad(w[0]), "tp scale weight gradient");
    for (int64_t e = 0; e < smp_tensor_numel(x); e++) gw[e % TP_COLS] += xs[e] * gs[e];
    return SMP_OK;
}
/* nothing is sharded here: smp warns */
static void tp_quiet(smp_log_level level, const char *msg, void *user) { (void)level; (void)msg; (void)user; }
static smp_status tp_chain_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *u) {
    (void)m; (void)nin; (void)nout;
    smp_module **chain = (smp_module **)u;
    smp_tensor h = in[0];
    for (int k = 0; k < 7; k++) SMP_TRY(smp_call(chain[k], &h, 1, k == 6 ? out : &h, 1));
    return SMP_OK;
}
SMP_STEP_BODY(tp_body) { /* loss: a weighted sum of the output, so a value in the wrong place shows */
    const smp_tensor *y = smp_mb_output(mb, 0);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    const float *ys = mem_of(y, "model output");
    float *gs = mem_of(g, "output gradient"), loss = 0;
    for (int64_t e = 0; e < smp_tensor_numel(y); e++) {
        loss += ys[e] * (float)(e % 5 + 1);
        gs[e] = (float)(e % 5 + 1);
    }
    return smp_mb_return_f32(mb, 0, loss);
}
static void tp_case(bool deterministic) {
    register_fake(VIA_P2P);
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.tensor_parallel_degree = world;
    cfg.deterministic_reduction = deterministic ? SMP_ON : SMP_OFF;
    char name[128], why[256] = "";
    snprintf(name, sizeof name, "device/tp/modules_equal_host%s", deterministic ? "/deterministic" : "");
    if (smp_init(&cfg)) { MPI_CHECK(0, name, "smp_init: %s", smp_last_error()); return; }
    smp_set_logger(tp_quiet, NULL);
    float loss[2] = {0, 0}, grad[2][TP_COLS];
    smp_status st = SMP_OK;
    smp_model *models[2] = {NULL, NULL};
    smp_module *chains[2][7];
    smp_param *w[2][1];
    for (int d = 0; d < 2 && !st; d++) {
        smp_module *root = smp_module_new(NULL, "", NULL);
        chains[d][0] = smp_module_new(root, "scale", &(smp_module_desc){tp_scale_forward, tp_scale_backward, w[d]});
        w[d][0] = smp_param_new(chains[d][0], "w", SMP_F32, 1, (int64_t[]){TP_COLS}, smp_init_uniform, NULL);
        chains[d][1] = smp_module_new_tp_scatter(root, "scatter1", 1);
        chains[d][2] = smp_module_new_tp_gather(root, "gather1", 1);
        chains[d][3] = smp_module_new_tp_scatter(root, "scatter0", 0);
        chains[d][4] = smp_module_new_tp_gather(root, "gather0", 0);
        chains[d][5] = smp_module_new_tp_copy(root, "copy");
        chains[d][6] = smp_module_new_tp_reduce(root, "reduce");
        st = smp_model_new(root, &(smp_model_desc){.forward = tp_chain_forward, .user = chains[d], .on_device = d == 1},
                           &models[d]);
        float x[TP_ROWS * TP_COLS];
        for (int e = 0; e < TP_ROWS * TP_COLS; e++) x[e] = g_x[e];
        smp_tensor xt = d ? upload(x, TP_ROWS, TP_COLS) : smp_tensor_2d(x, SMP_F32, TP_ROWS, TP_COLS);
        smp_step_output out;
        memset(&out, 0, sizeof out);
        if (!st) st = SMP_TRAIN_STEP(models[d], tp_body, NULL, &out, 1, xt);
        if (!st) {
            loss[d] = (float)smp_step_output_reduce_mean_f64(&out);
            memcpy(grad[d], mem_of(smp_param_grad(w[d][0]), "w's gradient"), sizeof grad[d]);
        }
        smp_step_output_free(&out);
        if (d) fake_dealloc(xt.data);
    }
    if (!st && (memcmp(&loss[0], &loss[1], sizeof loss[0]) || memcmp(grad[0], grad[1], sizeof grad[0])))
        snprintf(why, sizeof why, "device loss %.9g, host %.9g; w's gradients %s", loss[1], loss[0],
                 memcmp(grad[0], grad[1], sizeof grad[0]) ? "differ" : "agree");
    smp_set_logger(NULL, NULL);
    smp_model_free(models[0]);
    int ok = finish(models[1], !st && !why[0], why, sizeof why);
    MPI_CHECK(ok, name, "%s %s", st ? smp_last_error() : "", why);
}


static void backend_requirements(void) {
    smp_config cfg = base_config(1, 1);
    net n;
    struct { const char *label, *want; smp_status status; int how; } cases[] = {
        {"without a backend", "no device backend is registered", SMP_ERR_ARG, 0},
        {"with a backend lacking scale", "has no scale function", SMP_ERR_ARG, 1},
        {"with a backend that has no device", "has no usable device", SMP_ERR_DEVICE, 2},
    };
    for (int k = 0; k < 3; k++) {
        register_fake(VIA_P2P);
        if (cases[k].how == 0) smp_register_device_backend(NULL);
        if (cases[k].how > 0) {
            smp_device_backend b;
            memset(&b, 0, sizeof b);
            b.name = "partial";
            b.alloc = fake_alloc;
            b.dealloc = fake_dealloc;
            b.copy = fake_copy;
            b.add = fake_add;
            b.zero = fake_zero;
            b.current_device = fake_current_device;
            if (cases[k].how == 2) { b.scale = fake_scale; b.current_device = g_no_device; }
            smp_register_device_backend(&b);
        }
        smp_status st = smp_init(&cfg);
        smp_model *m = st ? NULL : build_with(&n, NULL, &DEV_FNS, true);
        char name[160];
        snprintf(name, sizeof name, "device/an on_device model %s is an error that says so", cases[k].label);
        MPI_CHECK(!m && strstr(smp_last_error(), cases[k].want), name, "model %p, message: %s", (void *)m,
                  smp_last_error());
        smp_model_free(m);
        smp_finalize();
    }
}

#ifndef UNDER_ASAN
/* A real GPU pointer dereferenced on the host crashes; so does a fake one.
   Say what that most likely means before the process goes. */
static void on_fault(int sig) {
    static const char msg[] =
        "FAIL: device/memory: the process crashed (signal) - most likely host code dereferenced a device pointer\n";
    (void)sig;
    if (write(1, msg, sizeof msg - 1) < 0) _exit(2);
    _exit(1);
}
#endif

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
#ifndef UNDER_ASAN
    signal(SIGSEGV, on_fault);
    signal(SIGBUS, on_fault);
#endif
    uint64_t s = 99;
    for (size_t i = 0; i < sizeof g_x / sizeof g_x[0]; i++) g_x[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    for (size_t i = 0; i < sizeof g_t / sizeof g_t[0]; i++) g_t[i] = (float)(smp_rng_uniform(&s) * 2 - 1);
    static const int manual[7] = {0, 0, 1, 1, 0, 0, 1}; /* stages on ranks 0,1,0,1 */
    static const int ms[] = {1, 2, 3, 4};
    for (int P = 1; P <= world && P <= 4; P *= 2) {
        if (world % P) continue;
        for (int k = 0; k < 4; k++)
            for (int kind = 0; kind < 2; kind++)
                pipeline_case(P, ms[k], kind ? SMP_PIPELINE_SIMPLE : SMP_PIPELINE_INTERLEAVED, NULL, 1, VIA_P2P, true,
                              "auto");
        if (P == 1) continue;
        for (int k = 0; k < 4; k += 3)
            for (int kind = 0; kind < 2; kind++)
                pipeline_case(P, ms[k], kind ? SMP_PIPELINE_SIMPLE : SMP_PIPELINE_INTERLEAVED, NULL, 1, VIA_NO_P2P,
                              true, "auto");
        pipeline_case(P, 4, SMP_PIPELINE_INTERLEAVED, NULL, 1, VIA_P2P_THROUGH_HOST, true, "auto");
        pipeline_case(P, 3, SMP_PIPELINE_INTERLEAVED, NULL, 1, VIA_P2P, false, "auto");
    }
    pipeline_case(1, 2, SMP_PIPELINE_INTERLEAVED, NULL, 1, VIA_P2P, false, "auto");
    if (world % 2 == 0) {
        for (int k = 0; k < 4; k++) {
            pipeline_case(2, ms[k], SMP_PIPELINE_INTERLEAVED, manual, 1, VIA_P2P, true, "manual 0,1,0,1");
            pipeline_case(2, ms[k], SMP_PIPELINE_SIMPLE, manual, 1, VIA_P2P, true, "manual 0,1,0,1");
            pipeline_case(2, ms[k], SMP_PIPELINE_INTERLEAVED, NULL, 2, VIA_P2P, true, "auto, 2 virtual stages");
        }
        pipeline_case(2, 4, SMP_PIPELINE_INTERLEAVED, manual, 1, VIA_NO_P2P, true, "manual 0,1,0,1");
    }
    g_block = true; /* a composite call, recomputed, with smp's add on the device */
    for (int P = 1; P <= world && P <= 4; P *= 2)
        if (world % P == 0)
            for (int kind = 0; kind < 2; kind++)
                pipeline_case(P, 4, kind ? SMP_PIPELINE_SIMPLE : SMP_PIPELINE_INTERLEAVED, NULL, 1,
                              P > 1 ? VIA_NO_P2P : VIA_P2P, true, "composite fc1 + built-in add, recomputed");
    g_block = false;
    /* zero_bubble with the linears split: every partition count, the recomputed
       composite beside them, and data parallelism (buckets after the last W) */
    g_split = true;
    for (int P = 1; P <= world && P <= 4; P *= 2)
        if (world % P == 0) pipeline_case(P, 4, SMP_PIPELINE_ZERO_BUBBLE, NULL, 1, VIA_P2P, true, "auto");
    if (world % 2 == 0) pipeline_case(2, 3, SMP_PIPELINE_ZERO_BUBBLE, manual, 1, VIA_NO_P2P, true, "manual 0,1,0,1");
    g_block = true;
    pipeline_case(world >= 2 ? 2 : 1, 4, SMP_PIPELINE_ZERO_BUBBLE, NULL, 1, VIA_P2P, true,
                  "composite fc1 + built-in add, recomputed");
    g_block = false;
    /* zero_bubble_v: 2 stages per partition in a V, the middle hand-off in device memory */
    for (int P = 1; P <= world && P <= 2; P *= 2)
        if (world % P == 0)
            pipeline_case(P, 4, SMP_PIPELINE_ZERO_BUBBLE_V, NULL, 1, P > 1 ? VIA_NO_P2P : VIA_P2P, true, "auto");
    if (world % 2 == 0) pipeline_case(2, 3, SMP_PIPELINE_ZERO_BUBBLE_V, NULL, 1, VIA_P2P, true, "auto");
    if (world > 1) ddp_case(world / 2, true);
    g_split = false;
    for (int P = 1; P <= world && P <= 4; P *= 2) {
        if (world % P) continue;
        failure_case(P, VIA_P2P);
        if (P > 1) failure_case(P, VIA_NO_P2P);
        if (world / P > 1) {
            ddp_case(P, true);
            if (world / P == 2) ddp_case(P, false);
            shard_case(P, true);
            if (world / P == 2) shard_case(P, false);
        }
    }
    for (int P = 1; P <= world && P <= 4; P *= 2)
        if (world % P == 0) checkpoint_case(P);
    if (world > 1 && TP_ROWS % world == 0) {
        tp_case(false);
        tp_case(true);
    }
    backend_requirements();
    int rc = test_exit_code();
    MPI_Finalize();
    return rc;
}
