/* test_gpu.cu - the CUDA device backend (smp_nccl.h) against host references.

   Every device collective (all_reduce with sum/avg/min/max/prod, broadcast,
   reduce, all_gather, reduce_scatter, all_to_all_single with equal and
   unequal splits, in place and out of place) x dtype (f32 f64 f16 bf16 i32
   i64 u8) x group (world, MP_GROUP, DP_GROUP), then copies, ordering on an
   engine stream of the test's own, point-to-point transfers (a ring on the
   world, both directions at once between pipeline neighbours), the
   pipeline of an on_device model (net7.h with CUDA kernels, through NCCL
   or host-staged) bitwise against the host reference, the reuse of freed
   blocks on a GPU without memory pools, and argument errors. On the fake
   device (test/fake_test_gpu.cu) a training step must also make no call
   that waits for the whole device. The reference for each result is computed here from what every
   rank put in: the inputs are small integers, so sums, products, minima and
   maxima are exact in every dtype; means are compared with a tolerance.

   The suite runs on the path smp_init picks: NCCL when every rank has a GPU
   of its own, the host-staged path when ranks share one. After an NCCL run
   it starts smp again with SMP_NCCL=staged and runs the suite on the staged
   path too. With no GPU it prints exactly "SKIP: gpu: skipped: no GPU".

   Build: nvcc -ccbin mpicxx -O2 -I. -Itest -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror \
              test/test_gpu.cu -o build/gpu/test_gpu -lnccl
   Run:   mpirun -n 1 build/gpu/test_gpu; mpirun -n 2 ...; mpirun -n 4 ...
*/
#define SMP_TESTING /* the test hooks and test-only introspection */
#define SMP_NCCL_NO_AUTO_REGISTER /* main registers the backend itself: smp_nccl_register */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_nccl.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "net7.h"

/* what results are called: test/fake_test_gpu.cu runs this suite on a CPU stand-in as "fake-gpu" */
#ifndef GPU_LABEL
#define GPU_LABEL "gpu"
#endif

static int W_RANK, W_SIZE, PARTS;
static const char *MODE = "?";

#define NDT 7
static const smp_dtype DTS[NDT] = {SMP_F32, SMP_F64, SMP_F16, SMP_BF16, SMP_I32, SMP_I64, SMP_U8};
static const smp_group GROUPS[3] = {SMP_WORLD, SMP_MP_GROUP, SMP_DP_GROUP};
static const char *GNAMES[3] = {"world", "mp", "dp"};
static const int64_t SIZES[4] = {0, 1, 1000, 262147};

#define CK(call)                                                                                       \
    do {                                                                                               \
        cudaError_t e__ = (call);                                                                      \
        if (e__ != cudaSuccess) {                                                                      \
            fprintf(stderr, "test_gpu: %s failed: %s (line %d)\n", #call, cudaGetErrorString(e__), __LINE__); \
            MPI_Abort(MPI_COMM_WORLD, 2);                                                              \
        }                                                                                              \
    } while (0)

/* ---------------------------------------------------------------- helpers */
typedef struct result { bool ok; char why[600]; } result;

static void fail(result *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(result *r, const char *fmt, ...) {
    if (!r->ok) return; /* keep the first reason */
    r->ok = false;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->why, sizeof r->why, fmt, ap);
    va_end(ap);
}
static result ok_result(void) { result r; r.ok = true; r.why[0] = 0; return r; }

static void check(const char *what, const char *dtname, const char *group, result *r) {
    char name[200];
    snprintf(name, sizeof name, "%s %s %s %s %s", GPU_LABEL, MODE, what, dtname, group);
    MPI_CHECK(r->ok, name, "%s", r->why);
}

static void put(void *h, smp_dtype dt, int64_t i, double v) {
    switch (dt) {
    case SMP_F32: ((float *)h)[i] = (float)v; break;
    case SMP_F64: ((double *)h)[i] = v; break;
    case SMP_F16: ((uint16_t *)h)[i] = smp_f32_to_f16((float)v); break;
    case SMP_BF16: ((uint16_t *)h)[i] = smp_f32_to_bf16((float)v); break;
    case SMP_I32: ((int32_t *)h)[i] = (int32_t)v; break;
    case SMP_I64: ((int64_t *)h)[i] = (int64_t)v; break;
    default: ((uint8_t *)h)[i] = (uint8_t)v; break;
    }
}

static double get(const void *h, smp_dtype dt, int64_t i) {
    switch (dt) {
    case SMP_F32: return ((const float *)h)[i];
    case SMP_F64: return ((const double *)h)[i];
    case SMP_F16: return smp_f16_to_f32(((const uint16_t *)h)[i]);
    case SMP_BF16: return smp_bf16_to_f32(((const uint16_t *)h)[i]);
    case SMP_I32: return ((const int32_t *)h)[i];
    case SMP_I64: return (double)((const int64_t *)h)[i];
    default: return ((const uint8_t *)h)[i];
    }
}

/* v as the dtype stores it. */
static double rounded(smp_dtype dt, double v) {
    double buf[1];
    put(buf, dt, 0, v);
    return get(buf, dt, 0);
}

static bool is_float(smp_dtype dt) { return dt == SMP_F32 || dt == SMP_F64 || dt == SMP_F16 || dt == SMP_BF16; }

/* Equal, or for means within the dtype's precision. */
static bool close_to(smp_dtype dt, double got, double want, bool mean) {
    if (!mean) return got == want;
    double tol = dt == SMP_F64 ? 1e-12 : dt == SMP_F32 ? 1e-6 : dt == SMP_F16 ? 4e-3 : 3e-2;
    return fabs(got - want) <= tol * (fabs(want) > 1 ? fabs(want) : 1);
}

static void *dalloc(size_t n) {
    void *p = NULL;
    CK(cudaMalloc(&p, n ? n : 1));
    return p;
}
static void *halloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "test_gpu: out of memory\n"); MPI_Abort(MPI_COMM_WORLD, 2); }
    return p;
}
static void up(void *d, const void *h, size_t n) { if (n) CK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice)); }
static void down(void *h, const void *d, size_t n) { if (n) CK(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost)); }

static smp_tensor dev_tensor(void *d, smp_dtype dt, int64_t n) {
    smp_tensor t = smp_tensor_1d(d, dt, n);
    t.device = smp_nccl_device();
    return t;
}

/* Inputs: small integers, per op kind, from (group rank, element). */
static double in_val(smp_op op, int r, int64_t i) {
    switch (op) {
    case SMP_SUM: case SMP_AVG: return (double)(i % 5 + r % 3);
    case SMP_MIN: case SMP_MAX: return (double)((i * 7 + r * 3) % 11);
    default: return (i + r) % 5 == 0 ? 2.0 : 1.0; /* prod: at most two 2s among 8 ranks */
    }
}

static double fold(smp_op op, int n, int64_t i) {
    double a = in_val(op, 0, i);
    for (int r = 1; r < n; r++) {
        double b = in_val(op, r, i);
        if (op == SMP_SUM || op == SMP_AVG) a += b;
        else if (op == SMP_MIN) a = b < a ? b : a;
        else if (op == SMP_MAX) a = b > a ? b : a;
        else a *= b;
    }
    return op == SMP_AVG ? a / n : a;
}

static const smp_op OPS[5] = {SMP_SUM, SMP_AVG, SMP_MIN, SMP_MAX, SMP_PROD};
static const char *OPNAMES[5] = {"sum", "avg", "min", "max", "prod"};

/* ---------------------------------------------------------------- collectives */
/* persistent: through smp_all_reduce_init and smp_persistent_run (the device backend's path each run) */
static void test_all_reduce(smp_dtype dt, int gi, bool persistent) {
    smp_group g = GROUPS[gi];
    int gs = smp_group_size(g), gr = smp_group_rank(g);
    size_t es = smp_dtype_size(dt);
    result res = ok_result();
    for (int o = 0; o < 5; o++) {
        if (OPS[o] == SMP_AVG && !is_float(dt)) continue;
        for (int si = 0; si < 4; si++)
            for (int inplace = 0; inplace < 2; inplace++) {
                int64_t n = SIZES[si];
                void *h = halloc((size_t)n * es), *hr = halloc((size_t)n * es);
                for (int64_t i = 0; i < n; i++) put(h, dt, i, in_val(OPS[o], gr, i));
                void *din = dalloc((size_t)n * es), *dout = inplace ? din : dalloc((size_t)n * es);
                up(din, h, (size_t)n * es);
                smp_tensor tin = dev_tensor(din, dt, n), tout = dev_tensor(dout, dt, n);
                smp_persistent *handle = NULL;
                smp_status st = !persistent ? smp_all_reduce(&tin, &tout, OPS[o], g)
                                : smp_all_reduce_init(&tin, &tout, OPS[o], g, &handle);
                if (!st && persistent) st = smp_persistent_run(handle);
                smp_persistent_free(handle);
                if (st)
                    fail(&res, "%s n=%lld%s: %s", OPNAMES[o], (long long)n, inplace ? " in place" : "",
                         smp_last_error());
                down(hr, dout, (size_t)n * es);
                for (int64_t i = 0; i < n && res.ok && !st; i++) {
                    double want = rounded(dt, fold(OPS[o], gs, i)), got = get(hr, dt, i);
                    if (!close_to(dt, got, want, OPS[o] == SMP_AVG))
                        fail(&res, "%s n=%lld%s: element %lld is %g, expected %g", OPNAMES[o], (long long)n,
                             inplace ? " in place" : "", (long long)i, got, want);
                }
                CK(cudaFree(din));
                if (!inplace) CK(cudaFree(dout));
                free(h);
                free(hr);
            }
    }
    check(persistent ? "persistent_all_reduce" : "all_reduce", smp_dtype_name(dt), GNAMES[gi], &res);
}

static void test_broadcast(smp_dtype dt, int gi) {
    smp_group g = GROUPS[gi];
    int gs = smp_group_size(g), gr = smp_group_rank(g), root = gs - 1;
    size_t es = smp_dtype_size(dt);
    result res = ok_result();
    for (int si = 0; si < 4; si++) {
        int64_t n = SIZES[si];
        void *h = halloc((size_t)n * es);
        for (int64_t i = 0; i < n; i++) put(h, dt, i, gr == root ? (double)((i * 3 + 1) % 50) : 99.0);
        void *d = dalloc((size_t)n * es);
        up(d, h, (size_t)n * es);
        smp_tensor t = dev_tensor(d, dt, n);
        smp_status st = smp_broadcast(&t, root, g);
        if (st) fail(&res, "n=%lld: %s", (long long)n, smp_last_error());
        down(h, d, (size_t)n * es);
        for (int64_t i = 0; i < n && res.ok && !st; i++)
            if (get(h, dt, i) != (double)((i * 3 + 1) % 50))
                fail(&res, "n=%lld: element %lld is %g", (long long)n, (long long)i, get(h, dt, i));
        CK(cudaFree(d));
        free(h);
    }
    check("broadcast", smp_dtype_name(dt), GNAMES[gi], &res);
}

static void test_reduce(smp_dtype dt, int gi) {
    smp_group g = GROUPS[gi];
    int gs = smp_group_size(g), gr = smp_group_rank(g), root = gs - 1;
    size_t es = smp_dtype_size(dt);
    result res = ok_result();
    for (int o = 0; o < 5; o++) {
        if (OPS[o] == SMP_AVG && !is_float(dt)) continue;
        for (int si = 0; si < 4; si++)
            for (int inplace = 0; inplace < 2; inplace++) {
                int64_t n = SIZES[si];
                void *h = halloc((size_t)n * es), *hr = halloc((size_t)n * es);
                for (int64_t i = 0; i < n; i++) put(h, dt, i, in_val(OPS[o], gr, i));
                void *din = dalloc((size_t)n * es), *dout = inplace || gr != root ? din : dalloc((size_t)n * es);
                up(din, h, (size_t)n * es);
                smp_tensor tin = dev_tensor(din, dt, n), tout = dev_tensor(dout, dt, n);
                smp_status st = smp_reduce(&tin, gr == root ? &tout : NULL, OPS[o], root, g);
                if (st)
                    fail(&res, "%s n=%lld%s: %s", OPNAMES[o], (long long)n, inplace ? " in place" : "",
                         smp_last_error());
                if (gr == root && !st) {
                    down(hr, dout, (size_t)n * es);
                    for (int64_t i = 0; i < n && res.ok; i++) {
                        double want = rounded(dt, fold(OPS[o], gs, i));
                        if (!close_to(dt, get(hr, dt, i), want, OPS[o] == SMP_AVG))
                            fail(&res, "%s n=%lld: element %lld is %g, expected %g", OPNAMES[o], (long long)n,
                                 (long long)i, get(hr, dt, i), want);
                    }
                } else if (!st) {
                    down(hr, din, (size_t)n * es); /* a non-root's input is left alone */
                    if (n && memcmp(hr, h, (size_t)n * es) != 0)
                        fail(&res, "%s n=%lld: a non-root's input changed", OPNAMES[o], (long long)n);
                }
                CK(cudaFree(din));
                if (dout != din) CK(cudaFree(dout));
                free(h);
                free(hr);
            }
    }
    check("reduce", smp_dtype_name(dt), GNAMES[gi], &res);
}

static double gather_val(int r, int64_t i) { return (double)((r * 13 + i) % 50); }

static void test_all_gather(smp_dtype dt, int gi) {
    smp_group g = GROUPS[gi];
    int gs = smp_group_size(g), gr = smp_group_rank(g);
    size_t es = smp_dtype_size(dt);
    result res = ok_result();
    for (int si = 0; si < 4; si++)
        for (int inplace = 0; inplace < 2; inplace++) {
            int64_t n = SIZES[si];
            size_t block = (size_t)n * es, total = block * (size_t)gs;
            void *h = halloc(block), *hr = halloc(total);
            for (int64_t i = 0; i < n; i++) put(h, dt, i, gather_val(gr, i));
            void *dout = dalloc(total);
            void *din = inplace ? (void *)((char *)dout + block * (size_t)gr) : dalloc(block);
            up(din, h, block);
            smp_tensor tin = dev_tensor(din, dt, n), tout = dev_tensor(dout, dt, n * gs);
            smp_status st = smp_all_gather(&tin, &tout, g);
            if (st) fail(&res, "n=%lld%s: %s", (long long)n, inplace ? " in place" : "", smp_last_error());
            down(hr, dout, total);
            for (int r = 0; r < gs && !st; r++)
                for (int64_t i = 0; i < n && res.ok; i++)
                    if (get(hr, dt, r * n + i) != gather_val(r, i))
                        fail(&res, "n=%lld%s: block %d element %lld is %g, expected %g", (long long)n,
                             inplace ? " in place" : "", r, (long long)i, get(hr, dt, r * n + i), gather_val(r, i));
            if (!inplace) CK(cudaFree(din));
            CK(cudaFree(dout));
            free(h);
            free(hr);
        }
    check("all_gather", smp_dtype_name(dt), GNAMES[gi], &res);
}

static void test_reduce_scatter(smp_dtype dt, int gi) {
    smp_group g = GROUPS[gi];
    int gs = smp_group_size(g), gr = smp_group_rank(g);
    size_t es = smp_dtype_size(dt);
    result res = ok_result();
    for (int o = 0; o < 5; o++) {
        if (OPS[o] == SMP_AVG && !is_float(dt)) continue;
        if (OPS[o] == SMP_MIN || OPS[o] == SMP_PROD) continue; /* sum, avg, max cover the paths */
        for (int si = 0; si < 4; si++)
            for (int inplace = 0; inplace < 2; inplace++) {
                int64_t n = SIZES[si];
                size_t block = (size_t)n * es, total = block * (size_t)gs;
                void *h = halloc(total), *hr = halloc(block);
                for (int64_t j = 0; j < n * gs; j++) put(h, dt, j, in_val(OPS[o], gr, j));
                void *din = dalloc(total);
                void *dout = inplace ? (void *)((char *)din + block * (size_t)gr) : dalloc(block);
                up(din, h, total);
                smp_tensor tin = dev_tensor(din, dt, n * gs), tout = dev_tensor(dout, dt, n);
                smp_status st = smp_reduce_scatter(&tin, &tout, OPS[o], g);
                if (st)
                    fail(&res, "%s n=%lld%s: %s", OPNAMES[o], (long long)n, inplace ? " in place" : "",
                         smp_last_error());
                down(hr, dout, block);
                for (int64_t i = 0; i < n && res.ok && !st; i++) {
                    double want = rounded(dt, fold(OPS[o], gs, gr * n + i));
                    if (!close_to(dt, get(hr, dt, i), want, OPS[o] == SMP_AVG))
                        fail(&res, "%s n=%lld%s: element %lld is %g, expected %g", OPNAMES[o], (long long)n,
                             inplace ? " in place" : "", (long long)i, get(hr, dt, i), want);
                }
                CK(cudaFree(din));
                if (!inplace) CK(cudaFree(dout));
                free(h);
                free(hr);
            }
    }
    check("reduce_scatter", smp_dtype_name(dt), GNAMES[gi], &res);
}

/* all_to_all: member a sends rows(a, b) rows of ROW elements to member b. */
#define ROW 3
static int64_t a2a_rows(int a, int b, bool equal) { return equal ? 2 : (a + b) % 3 + 1; }
static double a2a_val(int from, int to, int64_t row, int e) {
    return (double)((from * 11 + to * 5 + row * 3 + e) % 60);
}

static void test_all_to_all(smp_dtype dt, int gi) {
    smp_group g = GROUPS[gi];
    int gs = smp_group_size(g), gr = smp_group_rank(g);
    size_t es = smp_dtype_size(dt);
    result res = ok_result();
    for (int variant = 0; variant < 3; variant++) { /* equal splits, unequal splits, equal in place */
        bool equal = variant != 1, inplace = variant == 2;
        int64_t *in_splits = (int64_t *)halloc(sizeof(int64_t) * (size_t)gs),
                *out_splits = (int64_t *)halloc(sizeof(int64_t) * (size_t)gs);
        int64_t in_rows = 0, out_rows = 0;
        for (int b = 0; b < gs; b++) {
            in_splits[b] = a2a_rows(gr, b, equal);
            out_splits[b] = a2a_rows(b, gr, equal);
            in_rows += in_splits[b];
            out_rows += out_splits[b];
        }
        void *h = halloc((size_t)(in_rows * ROW) * es), *hr = halloc((size_t)(out_rows * ROW) * es);
        int64_t at = 0;
        for (int b = 0; b < gs; b++)
            for (int64_t rr = 0; rr < in_splits[b]; rr++, at++)
                for (int e = 0; e < ROW; e++) put(h, dt, at * ROW + e, a2a_val(gr, b, rr, e));
        void *din = dalloc((size_t)(in_rows * ROW) * es);
        void *dout = inplace ? din : dalloc((size_t)(out_rows * ROW) * es);
        up(din, h, (size_t)(in_rows * ROW) * es);
        smp_tensor tin = smp_tensor_2d(din, dt, in_rows, ROW), tout = smp_tensor_2d(dout, dt, out_rows, ROW);
        tin.device = tout.device = smp_nccl_device();
        smp_status st = smp_all_to_all_single(&tin, &tout, equal ? NULL : out_splits, equal ? NULL : in_splits, g);
        const char *vname = variant == 0 ? "equal splits" : variant == 1 ? "unequal splits" : "equal splits in place";
        if (st) fail(&res, "%s: %s", vname, smp_last_error());
        down(hr, dout, (size_t)(out_rows * ROW) * es);
        at = 0;
        for (int a = 0; a < gs && !st; a++)
            for (int64_t rr = 0; rr < out_splits[a]; rr++, at++)
                for (int e = 0; e < ROW && res.ok; e++)
                    if (get(hr, dt, at * ROW + e) != a2a_val(a, gr, rr, e))
                        fail(&res, "%s: row %lld from member %d is %g, expected %g", vname, (long long)rr, a,
                             get(hr, dt, at * ROW + e), a2a_val(a, gr, rr, e));
        CK(cudaFree(din));
        if (!inplace) CK(cudaFree(dout));
        free(h);
        free(hr);
        free(in_splits);
        free(out_splits);
    }
    check("all_to_all_single", smp_dtype_name(dt), GNAMES[gi], &res);
}

/* ---------------------------------------------------------------- copies, streams */
static void test_copy(void) {
    result res = ok_result();
    const int n = 100000;
    float *h = (float *)halloc(sizeof(float) * n), *h2 = (float *)halloc(sizeof(float) * n);
    for (int i = 0; i < n; i++) { h[i] = (float)(i % 977) + 0.5f; h2[i] = -1; }
    float *a = (float *)dalloc(sizeof(float) * n), *b = (float *)dalloc(sizeof(float) * n);
    int dev = smp_nccl_device();
    smp_status st = smp_nccl_copy(a, dev, h, SMP_HOST, sizeof(float) * n);
    if (!st) st = smp_nccl_copy(b, dev, a, dev, sizeof(float) * n);
    if (!st) st = smp_nccl_copy(h2, SMP_HOST, b, dev, sizeof(float) * n); /* returns when h2 holds the data */
    if (st) fail(&res, "%s", smp_last_error());
    else if (memcmp(h, h2, sizeof(float) * n) != 0) fail(&res, "host -> device -> device -> host changed the data");
    st = smp_nccl_copy(h2, SMP_HOST, b, dev + 1, sizeof(float) * n);
    if (st == SMP_OK) fail(&res, "a copy from a device this rank does not drive was accepted");
    CK(cudaFree(a));
    CK(cudaFree(b));
    free(h);
    free(h2);
    check("copy", "bytes", "local", &res);
}

__global__ void k_fill(float *p, int n, float v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
__global__ void k_scale(float *p, int n, float a) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] *= a;
}

/* The engine computes on a stream of its own: kernels before a collective
   must be seen by it, kernels after it must see its result, without the
   test synchronising in between. */
static void test_engine_stream(void) {
    result res = ok_result();
    const int n = 1 << 22;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    smp_nccl_set_stream(s);
    float *d = (float *)dalloc(sizeof(float) * n), *h = (float *)halloc(sizeof(float) * n);
    int gs = smp_size();
    for (int it = 0; it < 4 && res.ok; it++) {
        k_fill<<<(n + 255) / 256, 256, 0, s>>>(d, n, (float)(smp_rank() + 1 + it));
        CK(cudaGetLastError());
        smp_tensor t = dev_tensor(d, SMP_F32, n);
        smp_status st = smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD);
        if (st) { fail(&res, "%s", smp_last_error()); break; }
        k_scale<<<(n + 255) / 256, 256, 0, s>>>(d, n, 2.0f);
        CK(cudaGetLastError());
        CK(cudaMemcpyAsync(h, d, sizeof(float) * n, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        float want = 2.0f * (float)(gs * (gs + 1) / 2 + gs * it);
        for (int i = 0; i < n && res.ok; i += 4093)
            if (h[i] != want) fail(&res, "iteration %d: element %d is %g, expected %g", it, i, h[i], want);
    }
    smp_status st = smp_nccl_synchronize();
    if (st) fail(&res, "smp_nccl_synchronize: %s", smp_last_error());
    smp_nccl_set_stream(0);
    CK(cudaFree(d));
    CK(cudaStreamDestroy(s));
    free(h);
    check("engine stream", "f32", "world", &res);
}

/* smp_nccl_alloc + smp_nccl_add: what an executor accumulating gradients on the device needs. */
static void test_alloc_add(void) {
    result res = ok_result();
    const int64_t n = 100003;
    for (int d = 0; d < NDT && res.ok; d++) {
        smp_dtype dt = DTS[d];
        size_t es = smp_dtype_size(dt);
        void *a = smp_nccl_alloc((size_t)n * es), *b = smp_nccl_alloc((size_t)n * es);
        if (!a || !b) { fail(&res, "smp_nccl_alloc: %s", smp_last_error()); break; }
        void *ha = halloc((size_t)n * es), *hb = halloc((size_t)n * es);
        for (int64_t i = 0; i < n; i++) { put(ha, dt, i, (double)(i % 50)); put(hb, dt, i, (double)(i % 7)); }
        /* the copies and the add are all ordered on the engine stream */
        smp_status st = smp_nccl_copy(a, smp_nccl_device(), ha, SMP_HOST, (size_t)n * es);
        if (!st) st = smp_nccl_copy(b, smp_nccl_device(), hb, SMP_HOST, (size_t)n * es);
        if (!st) st = smp_nccl_add(a, b, dt, n);
        if (!st) st = smp_nccl_add(a, b, dt, n);
        if (!st) st = smp_nccl_copy(ha, SMP_HOST, a, smp_nccl_device(), (size_t)n * es);
        if (st) fail(&res, "%s: %s", smp_dtype_name(dt), smp_last_error());
        for (int64_t i = 0; i < n && res.ok && !st; i++) {
            double want = rounded(dt, rounded(dt, (double)(i % 50) + (double)(i % 7)) + (double)(i % 7));
            if (get(ha, dt, i) != want)
                fail(&res, "%s: element %lld is %g, expected %g", smp_dtype_name(dt), (long long)i, get(ha, dt, i),
                     want);
        }
        smp_nccl_free(a);
        smp_nccl_free(b);
        free(ha);
        free(hb);
    }
    check("alloc + add", "all", "local", &res);
}

/* Without memory pools smp keeps freed blocks for reuse; one may come back
   only after the engine's work queued before its free. Here that work waits
   on a receive that world rank 1 sends only after rank 0 has looked. */
static void test_block_reuse(void) {
    int pools = 1;
    CK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, SMP_CUDA_ORDINAL(smp_nccl_device())));
    /* cudaMallocAsync orders reuse itself */
    if (pools || W_SIZE < 2 || smp_nccl_current_mode() != SMP_NCCL_MODE_NCCL) return;
    result res = ok_result();
    const size_t bytes = 4096 * sizeof(float);
    int peer = 1 - W_RANK;
    smp_status st = W_RANK < 2 ? smp_nccl_p2p_connect(SMP_WORLD, &peer, 1) : SMP_OK;
    float *x = (float *)dalloc(bytes);
    if (st) fail(&res, "smp_nccl_p2p_connect: %s", smp_last_error());
    if (W_RANK == 0 && !st) {
        smp_nccl_request *r = NULL;
        st = smp_nccl_irecv(x, bytes, 1, SMP_WORLD, &r);
        if (!st) st = smp_nccl_wait(r); /* the engine now waits for rank 1 */
        void *a = smp_nccl_alloc(bytes);
        CK(cudaMemcpyAsync(a, x, bytes, cudaMemcpyDeviceToDevice, smp_nccl_stream()));
        smp_nccl_free(a);
        void *b = smp_nccl_alloc(bytes);
        if (st || !a || !b) fail(&res, "%s", smp_last_error());
        else if (b == a)
            fail(&res, "a freed block came back while the engine work queued before its free still waited");
        MPI_Barrier(MPI_COMM_WORLD);
        if (smp_nccl_synchronize()) fail(&res, "smp_nccl_synchronize: %s", smp_last_error());
        CK(cudaStreamSynchronize(smp_nccl_stream()));
        smp_nccl_free(b);
    } else {
        MPI_Barrier(MPI_COMM_WORLD);
        smp_nccl_request *r = NULL;
        if (W_RANK == 1 && !st && (smp_nccl_isend(x, bytes, 0, SMP_WORLD, &r) || smp_nccl_wait(r)))
            fail(&res, "smp_nccl_isend + wait: %s", smp_last_error());
    }
    CK(cudaFree(x));
    check("a freed block is reused only after the work before its free", "f32", "world", &res);
}

/* ---------------------------------------------------------------- point to point */
static float p2p_val(int from, int k, int i) { return (float)(from * 100 + k * 10 + i % 7); }

static void test_p2p_ring(void) {
    result res = ok_result();
    int n = smp_size(), r = smp_rank();
    int next = (r + 1) % n, prev = (r + n - 1) % n;
    int peers[2] = {next, prev};
    smp_status st = smp_nccl_p2p_connect(SMP_WORLD, peers, 2);
    if (st) fail(&res, "connect: %s", smp_last_error());
    const int K = 3;
    float *dsend[3], *drecv[3];
    smp_nccl_request *rs[3] = {NULL, NULL, NULL}, *rr[3] = {NULL, NULL, NULL};
    for (int k = 0; k < K; k++) {
        int len = (k + 1) * 1000;
        float *h = (float *)halloc(sizeof(float) * (size_t)len);
        for (int i = 0; i < len; i++) h[i] = p2p_val(r, k, i);
        dsend[k] = (float *)dalloc(sizeof(float) * (size_t)len);
        drecv[k] = (float *)dalloc(sizeof(float) * (size_t)len);
        up(dsend[k], h, sizeof(float) * (size_t)len);
        free(h);
    }
    /* receives first, long before the data is sent */
    for (int k = 0; k < K && !st; k++)
        if ((st = smp_nccl_irecv(drecv[k], sizeof(float) * (size_t)((k + 1) * 1000), prev, SMP_WORLD, &rr[k])))
            fail(&res, "irecv: %s", smp_last_error());
    for (int k = 0; k < K && !st; k++)
        if ((st = smp_nccl_isend(dsend[k], sizeof(float) * (size_t)((k + 1) * 1000), next, SMP_WORLD, &rs[k])))
            fail(&res, "isend: %s", smp_last_error());
    if (!st) { /* poll one send until it is done, as an executor freeing buffers would */
        bool done = false;
        double t0 = MPI_Wtime();
        while (!done && !st && MPI_Wtime() - t0 < 60) st = smp_nccl_test(rs[0], &done);
        if (st) fail(&res, "test: %s", smp_last_error());
        else if (!done) fail(&res, "a send did not finish in 60 s");
    }
    for (int k = 0; k < K; k++) {
        if (rr[k] && smp_nccl_wait(rr[k])) fail(&res, "wait (receive %d): %s", k, smp_last_error());
        if (rs[k] && smp_nccl_wait(rs[k])) fail(&res, "wait (send %d): %s", k, smp_last_error());
    }
    for (int k = 0; k < K; k++) {
        int len = (k + 1) * 1000;
        float *h = (float *)halloc(sizeof(float) * (size_t)len);
        down(h, drecv[k], sizeof(float) * (size_t)len);
        for (int i = 0; i < len && res.ok && !st; i++)
            if (h[i] != p2p_val(prev, k, i))
                fail(&res, "message %d element %d is %g, expected %g", k, i, h[i], p2p_val(prev, k, i));
        free(h);
    }
    /* around the ring the other way, both posted before either is waited for */
    if (res.ok) {
        smp_nccl_request *s1 = NULL, *r1 = NULL;
        st = smp_nccl_isend(dsend[0], sizeof(float) * 1000, prev, SMP_WORLD, &s1);
        if (!st) st = smp_nccl_irecv(drecv[0], sizeof(float) * 1000, next, SMP_WORLD, &r1);
        smp_status w1 = r1 ? smp_nccl_wait(r1) : SMP_OK, w2 = s1 ? smp_nccl_wait(s1) : SMP_OK;
        if (!st) st = w1 ? w1 : w2;
        if (st) fail(&res, "isend + irecv the other way: %s", smp_last_error());
        float *h = (float *)halloc(sizeof(float) * 1000);
        down(h, drecv[0], sizeof(float) * 1000);
        for (int i = 0; i < 1000 && res.ok && !st; i++)
            if (h[i] != p2p_val(next, 0, i))
                fail(&res, "the other way: element %d is %g, expected %g", i, h[i], p2p_val(next, 0, i));
        free(h);
    }
    for (int k = 0; k < K; k++) { CK(cudaFree(dsend[k])); CK(cudaFree(drecv[k])); }
    check("p2p ring", "f32", "world", &res);
}

/* Pipeline neighbours: activations forward and gradients backward at once. */
static void test_p2p_pipeline(void) {
    result res = ok_result();
    int me = smp_mp_rank(), other = 1 - me;
    int peer[1] = {other};
    smp_status st = smp_nccl_p2p_connect(SMP_MP_GROUP, peer, 1);
    if (st) fail(&res, "connect: %s", smp_last_error());
    const int n = 1 << 18, M = 4;
    float *act = (float *)dalloc(sizeof(float) * n * M), *grad = (float *)dalloc(sizeof(float) * n * M);
    float *h = (float *)halloc(sizeof(float) * n * M);
    /* stage 0 owns act and receives grad; stage 1 the other way round */
    float *mine = me == 0 ? act : grad, *theirs = me == 0 ? grad : act;
    for (int i = 0; i < n * M; i++) h[i] = (float)(me * 1000 + i % 101);
    up(mine, h, sizeof(float) * n * M);
    smp_nccl_request *rq[8];
    int nr = 0;
    for (int m = 0; m < M && !st; m++) { /* stage 1 sends before it receives: both directions are in flight together */
        if (me == 1 && (st = smp_nccl_isend(mine + (size_t)m * n, sizeof(float) * n, other, SMP_MP_GROUP, &rq[nr])))
            break;
        if (me == 1) nr++;
        if ((st = smp_nccl_irecv(theirs + (size_t)m * n, sizeof(float) * n, other, SMP_MP_GROUP, &rq[nr]))) break;
        nr++;
        if (me == 0 && (st = smp_nccl_isend(mine + (size_t)m * n, sizeof(float) * n, other, SMP_MP_GROUP, &rq[nr])))
            break;
        if (me == 0) nr++;
    }
    if (st) fail(&res, "%s", smp_last_error());
    for (int i = 0; i < nr; i++)
        if (smp_nccl_wait(rq[i])) fail(&res, "wait: %s", smp_last_error());
    down(h, theirs, sizeof(float) * n * M);
    for (int i = 0; i < n * M && res.ok && !st; i++)
        if (h[i] != (float)(other * 1000 + i % 101))
            fail(&res, "element %d is %g, expected %g", i, h[i], (float)(other * 1000 + i % 101));
    CK(cudaFree(act));
    CK(cudaFree(grad));
    free(h);
    check("p2p both directions", "f32", "mp", &res);
}

/* ---------------------------------------------------------------- a pipeline on the device */
/* net7.h's model (test_pipeline.c's) as an on_device model: CUDA kernels that
   do the host kernels' arithmetic in the same order, one thread per result,
   with explicitly rounded operations (no fused multiply-add), so losses,
   outputs and gradients must equal the host reference bit for bit. */
__global__ void k_net_linear(const float *x, const float *w, const float *b, float *y, int n, int in, int out) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n * out) return;
    int r = k / out, o = k % out;
    float acc = b[o];
    for (int i = 0; i < in; i++) acc = __fadd_rn(acc, __fmul_rn(x[r * in + i], w[o * in + i]));
    y[k] = acc;
}
__global__ void k_net_linear_gx(const float *w, const float *gy, float *gx, int n, int in, int out) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n * in) return;
    int r = k / in, i = k % in;
    float acc = 0;
    for (int o = 0; o < out; o++) acc = __fadd_rn(acc, __fmul_rn(gy[r * out + o], w[o * in + i]));
    gx[k] = acc;
}
__global__ void k_net_linear_gw(const float *x, const float *gy, float *gw, float *gb, int n, int in, int out) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= out * (in + 1)) return;
    int o = k / (in + 1), i = k % (in + 1) - 1; /* i == -1: the bias */
    float acc = 0;
    for (int r = 0; r < n; r++)
        acc = __fadd_rn(acc, i < 0 ? gy[r * out + o] : __fmul_rn(gy[r * out + o], x[r * in + i]));
    if (i < 0) gb[o] = __fadd_rn(gb[o], acc);
    else gw[o * in + i] = __fadd_rn(gw[o * in + i], acc);
}
__global__ void k_net_relu(const float *x, const float *gy, float *y, long long n) { /* gy NULL: forward */
    long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (k < n) y[k] = x[k] > 0 ? (gy ? gy[k] : x[k]) : 0;
}
__global__ void k_net_add(const float *a, const float *b, float *y, long long n) {
    long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (k < n) y[k] = __fadd_rn(a[k], b[k]);
}
/* one thread: the host's order */
__global__ void k_net_mse(const float *y, const float *t, float *g, float *loss, int n) {
    float acc = 0;
    for (int i = 0; i < n; i++) {
        float d = __fsub_rn(y[i], t[i]);
        acc = __fadd_rn(acc, __fmul_rn(d, d));
        if (g) g[i] = __fdiv_rn(__fmul_rn(2.0f, d), (float)n);
    }
    *loss = __fdiv_rn(acc, (float)n);
}

static unsigned net_blocks(long long n) { return (unsigned)((n + 127) / 128); }
static smp_status net_launched(void) {
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? SMP_OK : smp_error(SMP_ERR_DEVICE, "a kernel launch failed: %s", cudaGetErrorString(e));
}
static float *F(const smp_tensor *t) { return (float *)t->data; }

static smp_status gpu_lin_forward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    int64_t n = x->shape[0], shape[2] = {n, s->out};
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, shape);
    k_net_linear<<<net_blocks(n * s->out), 128, 0, smp_nccl_stream()>>>(
        F(x), F(smp_param_value(s->w)), F(smp_param_value(s->b)), F(y), (int)n, s->in, s->out);
    return net_launched();
}
static smp_status gpu_lin_backward(smp_call_ctx *c) {
    lin_state *s = (lin_state *)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *gy = smp_call_grad_output(c, 0);
    smp_tensor *gx = smp_call_grad_input(c, 0);
    int n = (int)x->shape[0];
    if (gx)
        k_net_linear_gx<<<net_blocks((long long)n * s->in), 128, 0, smp_nccl_stream()>>>(
            F(smp_param_value(s->w)), F(gy), F(gx), n, s->in, s->out);
    k_net_linear_gw<<<net_blocks((long long)s->out * (s->in + 1)), 128, 0, smp_nccl_stream()>>>(
        F(x), F(gy), F(smp_param_grad(s->w)), F(smp_param_grad(s->b)), n, s->in, s->out);
    return net_launched();
}
static smp_status gpu_relu_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, x->ndim, x->shape);
    k_net_relu<<<net_blocks(smp_tensor_numel(x)), 128, 0, smp_nccl_stream()>>>(F(x), NULL, F(y), smp_tensor_numel(x));
    return net_launched();
}
static smp_status gpu_relu_backward(smp_call_ctx *c) {
    smp_tensor *gx = smp_call_grad_input(c, 0);
    if (gx)
        k_net_relu<<<net_blocks(smp_tensor_numel(gx)), 128, 0, smp_nccl_stream()>>>(
            F(smp_call_input(c, 0)), F(smp_call_grad_output(c, 0)), F(gx), smp_tensor_numel(gx));
    return net_launched();
}
static smp_status gpu_add_forward(smp_call_ctx *c) {
    const smp_tensor *a = smp_call_input(c, 0), *b = smp_call_input(c, 1);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, a->ndim, a->shape);
    k_net_add<<<net_blocks(smp_tensor_numel(a)), 128, 0, smp_nccl_stream()>>>(F(a), F(b), F(y), smp_tensor_numel(a));
    return net_launched();
}
static smp_status gpu_add_backward(smp_call_ctx *c) {
    const smp_tensor *gy = smp_call_grad_output(c, 0);
    for (int k = 0; k < 2; k++) {
        smp_tensor *g = smp_call_grad_input(c, k);
        cudaError_t e =
            g ? cudaMemcpyAsync(g->data, gy->data, smp_tensor_nbytes(gy), cudaMemcpyDeviceToDevice, smp_nccl_stream())
              : cudaSuccess;
        if (e != cudaSuccess)
            return smp_error(SMP_ERR_DEVICE, "cudaMemcpyAsync of the add's gradient failed: %s", cudaGetErrorString(e));
    }
    return SMP_OK;
}
static const net_fns GPU_NET = {gpu_lin_forward,   gpu_lin_backward, gpu_relu_forward,
                                gpu_relu_backward, gpu_add_forward,  gpu_add_backward};

static float *g_net_loss; /* device: one loss per microbatch */

/* test/fake_cuda.c counts calls that wait for the whole device; a GPU build
   has no such counter, and these stay NULL */
extern "C" __attribute__((weak)) long fake_cuda_device_syncs(void);
extern "C" __attribute__((weak)) const char *fake_cuda_last_device_sync(void);
extern "C" __attribute__((weak)) long fake_cuda_h2d_device_waits(cudaStream_t s);
extern "C" __attribute__((weak)) long fake_cuda_h2d_host_waits(void);
extern "C" __attribute__((weak)) long long fake_cuda_device_bytes(int reset_peak);

/* What the steady-state step (the second) of test_pipeline_on_device held and waited for. */
typedef struct step_memory {
    long long device_peak;   /* the fake device's most device bytes during the step (-1: not on the fake) */
    int64_t stash_peak;      /* smp_last_step_stats' activation peak */
    int64_t offloaded_peak, offloaded_after; /* the memory account's offloaded bytes: peak in the step, and after it */
    long h2d_engine_waits, h2d_host_waits;   /* the fake's counts of host-to-device copies waited for in the step */
} step_memory;

/* The loss stays on the device until smp_mb_return copies it to the host. */
SMP_STEP_BODY(gpu_mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    float *loss = g_net_loss + smp_mb_index(mb);
    k_net_mse<<<1, 1, 0, smp_nccl_stream()>>>(F(y), F(t), g ? F(g) : NULL, loss, (int)smp_tensor_numel(y));
    smp_status st = net_launched();
    smp_tensor l = smp_tensor_make(loss, SMP_F32, 0, NULL);
    l.device = smp_nccl_device();
    if (!st) st = smp_mb_return(mb, 0, &l);
    return st ? st : smp_mb_return(mb, 1, y);
}

/* A batch of B rows drawn from seed: inputs hx [B, D] and targets ht [B, C] on the host, copied to device memory
   (*dx, *dt). */
static void random_batch(uint64_t seed, float *hx, float *ht, float **dx, float **dt) {
    for (int i = 0; i < B * D; i++) hx[i] = (float)(smp_rng_uniform(&seed) * 2 - 1);
    for (int i = 0; i < B * C; i++) ht[i] = (float)(smp_rng_uniform(&seed) * 2 - 1);
    *dx = (float *)dalloc(sizeof(float) * B * D);
    *dt = (float *)dalloc(sizeof(float) * B * C);
    up(*dx, hx, sizeof(float) * B * D);
    up(*dt, ht, sizeof(float) * B * C);
}

static void test_pipeline_on_device(const char *what, step_memory *mem) {
    result res = ok_result();
    static const char *names[NLIN] = {"fc0", "fc1", "fc2", "head"};
    int m = smp_current_config()->microbatches;
    net n;
    smp_model *model = build_with(&n, NULL, &GPU_NET, true);
    if (!model) fail(&res, "build: %s", smp_last_error());
    ref_t ref;
    ref_params(&ref);
    float hx[B * D], ht[B * C], *dx, *dt;
    random_batch(99, hx, ht, &dx, &dt);
    g_net_loss = (float *)smp_nccl_alloc(sizeof(float) * 8);
    for (int step = 0; step < 2 && res.ok; step++) { /* the batch halves: every shape changes */
        int rows = step ? B / 2 : B;
        smp_tensor x = smp_tensor_2d(dx, SMP_F32, rows, D), t = smp_tensor_2d(dt, SMP_F32, rows, C);
        x.device = t.device = smp_nccl_device();
        smp_step_output outs[2];
        memset(outs, 0, sizeof outs);
        long syncs = fake_cuda_device_syncs ? fake_cuda_device_syncs() : 0;
        long h2d_engine = fake_cuda_h2d_device_waits ? fake_cuda_h2d_device_waits(smp_nccl_stream()) : 0;
        long h2d_host = fake_cuda_h2d_host_waits ? fake_cuda_h2d_host_waits() : 0;
        if (fake_cuda_device_bytes) fake_cuda_device_bytes(1);
        smp_memory_reset_peaks();
        smp_status st = SMP_TRAIN_STEP(model, gpu_mse_body, NULL, outs, 2, x, t);
        if (mem && step == 1) {
            mem->stash_peak = smp_last_step_stats(model).stash_peak_bytes;
            mem->offloaded_peak = smp_memory().peak[SMP_MEMORY_OFFLOADED];
            mem->offloaded_after = smp_memory().bytes[SMP_MEMORY_OFFLOADED];
            mem->h2d_engine_waits =
                fake_cuda_h2d_device_waits ? fake_cuda_h2d_device_waits(smp_nccl_stream()) - h2d_engine : 0;
            mem->h2d_host_waits = fake_cuda_h2d_host_waits ? fake_cuda_h2d_host_waits() - h2d_host : 0;
        }
        if (fake_cuda_device_syncs && step == 1) { /* the first step allocates: the second is the steady state */
            long n_syncs = fake_cuda_device_syncs() - syncs;
            result hot = ok_result();
            if (n_syncs)
                fail(&hot, "%ld call(s) waited for the whole device during a step, the last %s", n_syncs,
                     fake_cuda_last_device_sync());
            check("a training step waits for no whole-device synchronisation", "f32", "mp", &hot);
        }
        if (mem && step == 1) {
            CK(cudaDeviceSynchronize()); /* the step's device work and frees are done */
            mem->device_peak = fake_cuda_device_bytes ? fake_cuda_device_bytes(0) : -1;
        }
        ref_step_rows(&ref, hx, ht, rows, m, true);
        if (st) fail(&res, "step %d: %s", step, smp_last_error());
        for (int i = 0; i < m && res.ok; i++)
            if (memcmp(outs[0].values[i].data, &ref.loss[i], 4))
                fail(&res, "step %d: loss of microbatch %d is %.9g, reference %.9g", step, i,
                     *(const float *)outs[0].values[i].data, ref.loss[i]);
        float all[B * C];
        smp_tensor cat = smp_tensor_2d(all, SMP_F32, rows, C);
        if (res.ok &&
            (smp_step_output_concat(&outs[1], &cat) || memcmp(all, ref.out, sizeof(float) * (size_t)(rows * C))))
            fail(&res, "step %d: the outputs differ from the reference", step);
        for (int l = 0; l < NLIN && res.ok; l++) {
            char nm[64];
            snprintf(nm, sizeof nm, "%s.weight", names[l]);
            smp_param *pw = smp_model_find_param(model, nm);
            snprintf(nm, sizeof nm, "%s.bias", names[l]);
            smp_param *pb = smp_model_find_param(model, nm);
            if (!smp_module_is_local(smp_param_module(pw))) continue;
            float gw[H * H], gb[H];
            down(gw, smp_param_grad(pw)->data, smp_tensor_nbytes(smp_param_grad(pw)));
            down(gb, smp_param_grad(pb)->data, smp_tensor_nbytes(smp_param_grad(pb)));
            if (memcmp(gw, ref.gw[l], smp_tensor_nbytes(smp_param_grad(pw))) ||
                memcmp(gb, ref.gb[l], smp_tensor_nbytes(smp_param_grad(pb))))
                fail(&res, "step %d: the gradient of %s differs (first weight element %.9g, reference %.9g)", step,
                     names[l], gw[0], ref.gw[l][0]);
        }
        smp_step_output_free(&outs[0]);
        smp_step_output_free(&outs[1]);
    }
    smp_model_free(model);
    smp_nccl_free(g_net_loss);
    CK(cudaFree(dx));
    CK(cudaFree(dt));
    check(what, "f32", "mp", &res);
}

static smp_status start(smp_config *cfg);

/* offload_activations (smp_pipeline.h, ACTIVATION OFFLOADING) on the same model and steps under GPipe, against the
   same run without it: the results equal the host reference bitwise either way (test_pipeline_on_device), the
   steady-state step holds fewer device bytes, the engine's stream waits for the copies back on the device, and
   the host waits for none of them. smp is started anew for each (the keys are smp_init's). */
static void test_offload(const smp_config *base) {
    step_memory mem[2];
    memset(mem, 0, sizeof mem);
    for (int on = 0; on < 2; on++) {
        smp_config c = *base;
        c.pipeline = SMP_PIPELINE_SIMPLE; /* every forward before any backward: what offloading is for */
        c.microbatches = 6;
        c.memory_weight = 1; /* partitioned by bytes, not by timings: the same stages with and without */
        c.has_memory_weight = true;
        if (on) {
            c.offload_activations = SMP_ON;
            c.activation_loading_horizon = 1;
        }
        smp_finalize();
        smp_status st = start(&c);
        MPI_CHECK(st == SMP_OK, GPU_LABEL " offload init", "smp_init: %.300s", smp_last_error());
        if (st) return;
        test_pipeline_on_device(on ? "offload_activations: pipeline of an on_device model equals the host reference"
                                   : "GPipe: pipeline of an on_device model equals the host reference", &mem[on]);
    }
    result res = ok_result();
    const step_memory *off = &mem[0], *on = &mem[1];
    /* staged, the activations that arrive early wait in host buffers counted as activations too, as many as
       timing has it: the peaks compare only where they go straight to the device. The fake device's own peak is
       printed, not compared: it allocates when the host asks and frees when its stream gets there, so a host
       that runs ahead of the device shows more than stream-ordered allocation holds. */
    bool direct = smp_nccl_current_mode() == SMP_NCCL_MODE_NCCL;
    if (direct && !(on->stash_peak < off->stash_peak))
        fail(&res, "the activation peak is %lld bytes offloaded and %lld without", (long long)on->stash_peak,
             (long long)off->stash_peak);
    if (!(on->offloaded_peak > 0) || on->offloaded_after != 0 || off->offloaded_peak != 0)
        fail(&res, "the memory account's offloaded bytes: peak %lld, %lld after the step (without: peak %lld)",
             (long long)on->offloaded_peak, (long long)on->offloaded_after, (long long)off->offloaded_peak);
    if (fake_cuda_h2d_device_waits && !(on->h2d_engine_waits > 0))
        fail(&res, "the engine's stream never waited on the device for a copy back");
    if (fake_cuda_h2d_host_waits && direct && on->h2d_host_waits != 0)
        fail(&res, "the host waited for %ld host-to-device copies during the step", on->h2d_host_waits);
    if (res.ok)
        printf("# rank %d offload_activations: device peak %lld -> %lld bytes, activations %lld -> %lld, "
               "offloaded peak %lld\n", W_RANK,
               off->device_peak, on->device_peak, (long long)off->stash_peak, (long long)on->stash_peak,
               (long long)on->offloaded_peak);
    check(direct ? "offload_activations holds fewer activation bytes on the device and the host waits for no copy back"
                 : "offload_activations moves activations to the host and the engine waits for them on the device",
          "f32", "mp", &res);
}

/* shard_optimizer_state on the device: two steps of 2 replicas with an SGD update of each replica's owned ranges
   between them, the second step gathering the replicas' ranges itself (the backend's gather_start on smp's
   stream, the engine's stream waiting for each bucket before the first call that reads it), against the same run
   unsharded: the second step's losses and the parameters it gathered are bitwise the same, and the sharded step
   waits for no whole-device synchronisation. */
/* SGD (lr 0.05) on the device parameters of this rank: each over the range this replica owns
   (smp_param_owned_range: all of it unless shard_optimizer_state), through host copies. */
static smp_status sgd_step_on_device(smp_model *model) {
    smp_status st = SMP_OK;
    smp_param *p;
    for (int i = 0; !st && (p = smp_model_local_param(model, i, false)); i++) {
        int64_t first = 0, count = 0, numel = smp_tensor_numel(smp_param_value(p));
        static float v[4096], g[4096];
        st = smp_param_owned_range(model, p, &first, &count);
        if (st || numel > 4096) break;
        CK(cudaDeviceSynchronize());
        down(v, smp_param_value(p)->data, sizeof(float) * (size_t)numel);
        down(g, smp_param_grad(p)->data, sizeof(float) * (size_t)numel);
        for (int64_t k = first; k < first + count; k++) v[k] -= 0.05f * g[k];
        up(smp_param_value(p)->data, v, sizeof(float) * (size_t)numel);
    }
    return st;
}

/* This rank's parameters, one after another, into params[4096] (*n: how many). */
static void params_to_host(smp_model *model, float *params, int64_t *n) {
    CK(cudaDeviceSynchronize());
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(model, i, false)) != NULL; i++) {
        int64_t numel = smp_tensor_numel(smp_param_value(p));
        if (*n + numel > 4096) break;
        down(params + *n, smp_param_value(p)->data, sizeof(float) * (size_t)numel);
        *n += numel;
    }
}

/* A run of GPU_NET's steps under its own config (shard_run's and joined_run's): smp started afresh with it, the
   model, each replica's own random batch on the device, the loss buffer gpu_mse_body writes. */
typedef struct device_run { net n; smp_model *model; float *dx, *dt; } device_run;

static smp_status device_run_begin(smp_config *c, device_run *r) {
    smp_finalize();
    SMP_TRY(start(c));
    r->model = build_with(&r->n, NULL, &GPU_NET, true);
    if (!r->model) return SMP_ERR_STATE;
    float hx[B * D], ht[B * C];
    random_batch(99 + (uint64_t)smp_rdp_rank(), hx, ht, &r->dx, &r->dt); /* each replica its own batch */
    g_net_loss = (float *)smp_nccl_alloc(sizeof(float) * 8);
    return SMP_OK;
}

/* The run's outcome st: its error into res under the run's name, or its parameters into params (*n of them); then
   it frees what device_run_begin made. */
static smp_status device_run_end(device_run *r, smp_status st, const char *name, result *res, float *params,
                                 int64_t *n) {
    if (st) fail(res, "%s: %s", name, smp_last_error());
    else params_to_host(r->model, params, n);
    smp_model_free(r->model);
    smp_nccl_free(g_net_loss);
    CK(cudaFree(r->dx));
    CK(cudaFree(r->dt));
    return st;
}

typedef struct shard_run_out { float loss[8], params[4096]; int64_t n; long syncs; } shard_run_out;

static smp_status shard_run(const smp_config *base, bool shard, shard_run_out *o, result *res) {
    smp_config c = *base;
    c.partitions = 1;
    c.ddp = SMP_ON;
    c.deterministic_reduction = SMP_ON;
    c.shard_optimizer_state = shard ? SMP_ON : SMP_OFF;
    c.bucket_cap_mb = 1e-4; /* about 100 bytes: several buckets, parameters across the pieces */
    c.microbatches = 2;
    memset(o, 0, sizeof *o);
    device_run r;
    smp_status st = device_run_begin(&c, &r);
    if (st) return st;
    smp_model *model = r.model;
    for (int step = 0; step < 2 && !st; step++) {
        smp_tensor x = smp_tensor_2d(r.dx, SMP_F32, B, D), t = smp_tensor_2d(r.dt, SMP_F32, B, C);
        x.device = t.device = smp_nccl_device();
        smp_step_output outs[2];
        memset(outs, 0, sizeof outs);
        smp_model_zero_grad(model);
        long syncs = fake_cuda_device_syncs ? fake_cuda_device_syncs() : 0;
        st = SMP_TRAIN_STEP(model, gpu_mse_body, NULL, outs, 2, x, t);
        if (fake_cuda_device_syncs) o->syncs = fake_cuda_device_syncs() - syncs;
        for (int i = 0; !st && step == 1 && i < outs[0].microbatches && i < 8; i++)
            memcpy(&o->loss[i], outs[0].values[i].data, sizeof(float));
        smp_step_output_free(&outs[0]);
        smp_step_output_free(&outs[1]);
        if (!st && step == 0) st = sgd_step_on_device(model);
    }
    return device_run_end(&r, st, shard ? "sharded" : "unsharded", res, o->params, &o->n);
}

static void test_shard(const smp_config *base) {
    result res = ok_result();
    static shard_run_out full, sharded;
    if (!shard_run(base, false, &full, &res) && !shard_run(base, true, &sharded, &res)) {
        if (memcmp(full.loss, sharded.loss, sizeof full.loss))
            fail(&res, "the second step's loss is %.9g sharded, %.9g unsharded", sharded.loss[0], full.loss[0]);
        else if (full.n != sharded.n || !full.n || memcmp(full.params, sharded.params, sizeof(float) * (size_t)full.n))
            fail(&res, "the parameters the second step gathered differ from the unsharded update");
        else if (sharded.syncs)
            fail(&res, "the sharded step waited for the whole device %ld time(s), the last %s", sharded.syncs,
                 fake_cuda_last_device_sync());
    }
    check("shard_optimizer_state: the next step gathers the parameters, bitwise the unsharded run", "f32", "dp", &res);
}

/* prescaled_batch false on the device: at tp 2 each rank of a TP group passes its half of its replica's batch on
   the device (x and t along axis 0, the examples' numbers [2, rows] along axis 1), and smp_step joins them through
   the backend's all-gather (and its copies, along axis 1); two steps with an SGD update between them, against
   every rank passing the whole batch with prescaled_batch true: the losses, the model's outputs and the parameters
   bitwise the same, and the body saw the examples in order. net7.h's model has no sharded parameter: smp warns
   that its TP ranks compute the same thing, which is all this needs. */
typedef struct joined_run_out { float loss[2][8], out[2][B * C], params[4096]; int64_t n; int ids_bad; } joined_run_out;

SMP_STEP_BODY(gpu_joined_body) {
    SMP_TRY(gpu_mse_body(mb));
    return smp_mb_return(mb, 2, smp_mb_arg(mb, 2));
}

static smp_status joined_run(const smp_config *base, bool own, joined_run_out *o, result *res) {
    smp_config c = *base;
    c.partitions = 1;
    c.tensor_parallel_degree = 2;
    c.prescaled_batch = own ? SMP_OFF : SMP_ON;
    c.deterministic_reduction = SMP_ON;
    c.microbatches = 2;
    c.ddp = W_SIZE > 2 ? SMP_ON : SMP_OFF;
    memset(o, 0, sizeof *o);
    device_run r;
    smp_status st = device_run_begin(&c, &r);
    if (st) return st;
    smp_model *model = r.model;
    int rows = own ? B / 2 : B, first = own ? smp_tp_rank() * rows : 0;
    int32_t hids[2 * B];
    for (int j = 0; j < rows; j++) hids[j] = first + j, hids[rows + j] = -(first + j);
    int32_t *dids = (int32_t *)dalloc(sizeof hids);
    up(dids, hids, sizeof(int32_t) * 2 * (size_t)rows);
    for (int step = 0; step < 2 && !st; step++) {
        smp_step_desc d;
        memset(&d, 0, sizeof d);
        d.model = model;
        d.body = gpu_joined_body;
        d.nargs = 3;
        d.args[0] = smp_tensor_2d(r.dx + (size_t)first * D, SMP_F32, rows, D);
        d.args[1] = smp_tensor_2d(r.dt + (size_t)first * C, SMP_F32, rows, C);
        d.args[2] = smp_tensor_2d(dids, SMP_I32, 2, rows);
        d.split_axis[2] = 1;
        for (int a = 0; a < 3; a++) d.args[a].device = smp_nccl_device();
        smp_step_output outs[3];
        memset(outs, 0, sizeof outs);
        smp_model_zero_grad(model);
        st = smp_step(&d, outs, 3);
        for (int i = 0; !st && i < outs[0].microbatches && i < 8; i++)
            memcpy(&o->loss[step][i], outs[0].values[i].data, sizeof(float));
        smp_tensor cat = smp_tensor_2d(o->out[step], SMP_F32, B, C);
        int32_t got[2 * B];
        smp_tensor ids = smp_tensor_2d(got, SMP_I32, 4, B / 2);
        if (!st) st = smp_step_output_concat(&outs[1], &cat);
        if (!st) st = smp_step_output_concat(&outs[2], &ids);
        for (int m = 0; !st && m < 2; m++) /* microbatch m: examples m x B/2 .. of the joined batch */
            for (int j = 0; j < B / 2; j++)
                o->ids_bad += got[2 * m * (B / 2) + j] != m * (B / 2) + j ||
                              got[(2 * m + 1) * (B / 2) + j] != -(m * (B / 2) + j);
        for (int k = 0; k < 3; k++) smp_step_output_free(&outs[k]);
        if (!st && step == 0) st = sgd_step_on_device(model);
    }
    CK(cudaFree(dids));
    return device_run_end(&r, st, own ? "own batches" : "joined batches", res, o->params, &o->n);
}

static void test_joined_batch(const smp_config *base) {
    result res = ok_result();
    static joined_run_out own, ref;
    if (!joined_run(base, true, &own, &res) && !joined_run(base, false, &ref, &res)) {
        if (own.ids_bad || ref.ids_bad)
            fail(&res, "the body saw %d example numbers out of place with own batches (%d joined by the caller)",
                 own.ids_bad, ref.ids_bad);
        else if (memcmp(own.loss, ref.loss, sizeof own.loss))
            fail(&res, "a loss is %.9g with own batches, %.9g joined by the caller", own.loss[1][0], ref.loss[1][0]);
        else if (memcmp(own.out, ref.out, sizeof own.out))
            fail(&res, "the model's outputs (StepOutput concat) differ");
        else if (own.n != ref.n || !own.n || memcmp(own.params, ref.params, sizeof(float) * (size_t)own.n))
            fail(&res, "the parameters after an update differ");
    }
    check("prescaled_batch false at tp 2: device batches joined by smp_step, bitwise the joined batch passed whole",
          "f32", "tp", &res);
}

/* ---------------------------------------------------------------- errors */
static void test_errors(void) {
    result res = ok_result();
    float *d = (float *)dalloc(sizeof(float) * 16), hostbuf[16] = {0};
    smp_tensor t = dev_tensor(d, SMP_F32, 16);
    t.device = smp_nccl_device() + 1;
    smp_status st = smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD);
    if (st == SMP_OK || !strstr(smp_last_error(), "drives device"))
        fail(&res, "a tensor on another device: status %d, \"%s\"", (int)st, smp_last_error());
    smp_tensor hbad = dev_tensor(hostbuf, SMP_F32, 16);
    st = smp_broadcast(&hbad, 0, SMP_WORLD);
    if (st == SMP_OK || !strstr(smp_last_error(), "host memory"))
        fail(&res, "host memory marked as a device tensor: status %d, \"%s\"", (int)st, smp_last_error());
    smp_tensor empty = dev_tensor(NULL, SMP_F32, 0);
    st = smp_all_reduce(&empty, &empty, SMP_SUM, SMP_WORLD);
    if (st) fail(&res, "an empty device tensor: %s", smp_last_error());
    if (smp_size() > 1) {
        smp_nccl_request *r = NULL;
        st = smp_nccl_isend(d, 64, smp_rank(), SMP_WORLD, &r);
        if (!st && r) smp_nccl_wait(r);
        if (st == SMP_OK || !strstr(smp_last_error(), "this rank"))
            fail(&res, "a send to itself: status %d, \"%s\"", (int)st, smp_last_error());
    }
    CK(cudaFree(d));
    check("errors", "f32", "world", &res);
}

/* Each group's NCCL communicator spans that group, with this rank at its
   group rank; on the staged path there is none. */
static void test_comms(void) {
    static const smp_group gs[3] = {SMP_WORLD, SMP_MP_GROUP, SMP_DP_GROUP};
    static const char *gn[3] = {"world", "mp", "dp"};
    for (int k = 0; k < 3; k++) {
        result res = ok_result();
        ncclComm_t c = smp_nccl_comm(gs[k]);
        int n = -1, r = -1;
        if (smp_nccl_current_mode() != SMP_NCCL_MODE_NCCL) {
            if (c) fail(&res, "a communicator on the %s path", MODE);
        } else if (!c) fail(&res, "no communicator");
        else if (ncclCommCount(c, &n) != ncclSuccess || ncclCommUserRank(c, &r) != ncclSuccess)
            fail(&res, "NCCL does not know the communicator");
        else if (n != smp_group_size(gs[k]) || r != smp_group_rank(gs[k]))
            fail(&res, "rank %d of %d, the group has this rank at %d of %d", r, n, smp_group_rank(gs[k]),
                 smp_group_size(gs[k]));
        check("smp_nccl_comm", "-", gn[k], &res);
    }
}

static void run_suite(void) {
    for (int gi = 0; gi < 3; gi++)
        for (int d = 0; d < NDT; d++) {
            test_all_reduce(DTS[d], gi, false);
            test_all_reduce(DTS[d], gi, true);
            test_broadcast(DTS[d], gi);
            test_reduce(DTS[d], gi);
            test_all_gather(DTS[d], gi);
            test_reduce_scatter(DTS[d], gi);
            test_all_to_all(DTS[d], gi);
        }
    test_copy();
    test_alloc_add();
    test_block_reuse();
    test_engine_stream();
    char name[64];
    if (W_SIZE > 1) test_p2p_ring();
    else if (W_RANK == 0) {
        snprintf(name, sizeof name, "%s %s p2p", GPU_LABEL, MODE);
        test_skip(name, "needs 2 ranks or more");
    }
    if (PARTS == 2) test_p2p_pipeline();
    test_pipeline_on_device("pipeline of an on_device model equals the host reference", NULL);
    test_errors();
    test_comms();
    smp_status st = smp_nccl_synchronize();
    snprintf(name, sizeof name, "%s %s synchronize", GPU_LABEL, MODE);
    MPI_CHECK(st == SMP_OK, name, "%s", smp_last_error());
}

static smp_status start(smp_config *cfg) {
    smp_status st = smp_init(cfg);
    MODE = smp_nccl_mode_name(smp_nccl_current_mode());
    return st;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &W_RANK);
    MPI_Comm_size(MPI_COMM_WORLD, &W_SIZE);
    (void)test_report;
    PARTS = W_SIZE % 2 == 0 ? 2 : 1;
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.partitions = PARTS;
    cfg.microbatches = 4; /* for the pipeline test; the collectives ignore it */
    if (W_SIZE / PARTS > 1) cfg.ddp = SMP_ON;
    if (!getenv("SMP_TIMEOUT")) cfg.timeout = 120; /* a hang ends the test with a message */
    smp_nccl_register(); /* without it smp_init finds no device backend, and every device test fails */
    smp_status st = start(&cfg);
    if (st != SMP_OK) {
        /* every rank: each says why */
        printf("FAIL: " GPU_LABEL " init: rank %d: smp_init: %.300s\n", W_RANK, smp_last_error());
        MPI_Finalize();
        return 1;
    }
    if (smp_nccl_current_mode() == SMP_NCCL_MODE_NONE) {
        /* a machine with NVIDIA's device files has a GPU: CUDA failing there
           (a driver too old for this CUDA, say) is a failure, not a skip */
        if (access("/dev/nvidiactl", F_OK) == 0) {
            MPI_CHECK(false, GPU_LABEL " init",
                      "this machine has /dev/nvidiactl but CUDA finds no usable device: %.300s", smp_nccl_describe());
            smp_finalize();
            MPI_Finalize();
            return 1;
        }
        if (W_RANK == 0) test_skip("gpu", "skipped: no GPU");
        smp_finalize();
        MPI_Finalize();
        return 0;
    }
    if (W_RANK == 0) { printf("# %s, %d rank(s)\n", smp_nccl_describe(), W_SIZE); fflush(stdout); }
    bool was_nccl = smp_nccl_current_mode() == SMP_NCCL_MODE_NCCL;
    run_suite();
    test_offload(&cfg);
    if (W_SIZE > 1) test_shard(&cfg);
    if (W_SIZE % 2 == 0) test_joined_batch(&cfg);
    smp_finalize();
    if (was_nccl) { /* and once more through host memory */
        setenv("SMP_NCCL", "staged", 1);
        st = start(&cfg);
        MPI_CHECK(st == SMP_OK && smp_nccl_current_mode() == SMP_NCCL_MODE_STAGED, GPU_LABEL " staged init",
                  "smp_init: %.300s (mode %s)", smp_last_error(), MODE);
        if (st == SMP_OK) {
            run_suite();
            test_offload(&cfg);
            if (W_SIZE > 1) test_shard(&cfg);
            if (W_SIZE % 2 == 0) test_joined_batch(&cfg);
            smp_finalize();
        }
    }
    MPI_Finalize();
    return test_exit_code();
}
