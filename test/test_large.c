/* test_large.c - messages past MPI's 2 GiB int count (make test-large).

   Two partitions: "wide" on partition 0 turns a one-element input into an
   activation of 2.2 GB, "narrow" on partition 1 counts the elements that
   are not what wide wrote. Its backward sends an input gradient of 2.2 GB
   back, which wide checks element by element the same way. smp may hold
   two activation-sized buffers at once on each rank (the activation and
   its gradient; the trace's zero gradient), not more. Then an object of
   2.2 GB goes from rank 0 to rank 1 (smp_send / smp_recv_from), and an
   all-reduce runs over 2^31 + 1000 elements, past MPI's int count (u8:
   floats would need 17 GB a rank), every element checked. Needs about 6
   GiB per rank; run by test/run_large.sh, which checks the memory first.
   On one rank it reports skipped. With a count as argv[1] (another
   activation size, to measure smp's peak) the all-reduce is left out. */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "test.h"
#include <stdlib.h>

static int64_t N = 550000000; /* floats: 2.2 GB, past 2 GiB (argv[1]: another count) */

/* what element i holds, one pattern per direction (salt) */
static float pattern(int64_t i, int salt) { return (float)((i ^ salt) & 4095); }
static int64_t mismatches(const float *v, int64_t n, int salt) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += v[i] != pattern(i, salt);
    return bad;
}

static smp_param *g_flag; /* wide's one parameter: its gradient says how many gradient elements were wrong */

static smp_status wide_forward(smp_call_ctx *c) {
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 1, &N);
    if (!y) return SMP_ERR_NOMEM;
    for (int64_t i = 0; i < N; i++) ((float *)y->data)[i] = pattern(i, 251);
    return SMP_OK;
}
static smp_status wide_backward(smp_call_ctx *c) {
    const smp_tensor *g = smp_call_grad_output(c, 0);
    ((float *)smp_param_grad(g_flag)->data)[0] =
        (float)mismatches((const float *)g->data, smp_tensor_numel(g), 13) + (smp_tensor_numel(g) != N);
    return SMP_OK;
}
static smp_status narrow_forward(smp_call_ctx *c) {
    const smp_tensor *x = smp_call_input(c, 0);
    int64_t one = 1;
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 1, &one);
    if (!y) return SMP_ERR_NOMEM;
    ((float *)y->data)[0] =
        (float)mismatches((const float *)x->data, smp_tensor_numel(x), 251) + (smp_tensor_numel(x) != N);
    return SMP_OK;
}
static smp_status narrow_backward(smp_call_ctx *c) {
    smp_tensor *g = smp_call_grad_input(c, 0);
    for (int64_t i = 0; g && i < smp_tensor_numel(g); i++) ((float *)g->data)[i] = pattern(i, 13);
    return SMP_OK;
}

typedef struct { smp_module *wide, *narrow; } net;
static smp_status forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *user) {
    (void)m; (void)nin; (void)nout;
    net *n = (net *)user;
    smp_tensor a;
    SMP_TRY(smp_call(n->wide, &in[0], 1, &a, 1));
    return smp_call(n->narrow, &a, 1, &out[0], 1);
}
SMP_STEP_BODY(body) {
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    if (g) ((float *)g->data)[0] = 1;
    return smp_mb_return(mb, 0, smp_mb_output(mb, 0));
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    if (argc > 1) N = atoll(argv[1]);
    int world;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (world != 2) {
        test_skip("large", "needs 2 ranks");
        MPI_Finalize();
        return 0;
    }
    smp_config cfg = {0};
    cfg.partitions = 2;
    cfg.auto_partition = SMP_OFF;
    MPI_CHECK(smp_init(&cfg) == SMP_OK, "large/init", "%s", smp_last_error());
    net n;
    smp_module *root = smp_module_new(NULL, "", NULL);
    SMP_PARTITION(0) {
        const smp_module_desc d = {wide_forward, wide_backward, NULL};
        n.wide = smp_module_new(root, "wide", &d);
        int64_t one = 1;
        g_flag = smp_param_new(n.wide, "flag", SMP_F32, 1, &one, NULL, NULL);
    }
    SMP_PARTITION(1) {
        const smp_module_desc d = {narrow_forward, narrow_backward, NULL};
        n.narrow = smp_module_new(root, "narrow", &d);
    }
    smp_model *model = NULL;
    smp_model_desc md = {forward, 1, 1, &n, false};
    MPI_CHECK(smp_model_new(root, &md, &model) == SMP_OK, "large/model", "%s", smp_last_error());
    float x = 0;
    smp_tensor xt = smp_tensor_make(&x, SMP_F32, 1, (int64_t[]){1});
    smp_step_output out = {0};
    smp_model_zero_grad(model);
    smp_status st = SMP_TRAIN_STEP(model, body, NULL, &out, 1, xt);
    MPI_CHECK(st == SMP_OK, "large/a training step moves a 2.2 GB activation and its gradient between stages", "%s",
              smp_last_error());
    float wrong_fwd = st ? -1 : ((float *)out.values[0].data)[0];
    MPI_CHECK(wrong_fwd == 0, "large/the 2.2 GB activation arrives intact", "%g elements differ", wrong_fwd);
    int wrong_bwd = 0;
    if (smp_mp_rank() == 0) wrong_bwd = st ? -1 : (int)((float *)smp_param_grad(g_flag)->data)[0];
    MPI_CHECK(wrong_bwd == 0, "large/the 2.2 GB gradient arrives intact", "%d elements differ", wrong_bwd);
    /* smp's peak over the trace and the step, in activations: the figure that says whether it holds needless copies */
    double act = (double)N * sizeof(float);
    double peak = (double)smp_memory().peak_bytes;
    printf("large: rank %d: smp's peak %.0f MB, %.2f x the activation (%.0f MB)\n", smp_rank(), peak / 1e6, peak / act,
           act / 1e6);
    fflush(stdout);
    /* the caching allocator hands out a block of the activation's size class, at most a quarter larger, and counts
       the rounding (SMP_MEMORY_CACHED): two blocks, 2.5 activations at most; a third copy would be 3 or more */
    MPI_CHECK(peak <= 2 * 1.25 * act + (64 << 20),
              "large/smp holds at most two activation-sized buffers (no copy of the gradient)",
              "peak %.0f MB, %.2f activations", peak / 1e6, peak / act);
    smp_step_output_free(&out);
    smp_model_free(model);

    /* an object of 2.2 GB: smp_send / smp_recv_from */
    size_t bytes = (size_t)N * sizeof(float);
    int64_t bad = -1;
    if (smp_rank() == 0) {
        float *buf = (float *)malloc(bytes);
        for (int64_t i = 0; buf && i < N; i++) buf[i] = pattern(i, 97);
        st = buf ? smp_send(buf, bytes, 1, SMP_WORLD) : SMP_ERR_NOMEM;
        free(buf);
        bad = 0;
    } else {
        void *buf = NULL;
        size_t len = 0;
        st = smp_recv_from(0, SMP_WORLD, &buf, &len);
        bad = st ? -1 : len != bytes ? -2 : mismatches((const float *)buf, N, 97);
        smp_free(buf);
    }
    MPI_CHECK(st == SMP_OK && bad == 0, "large/smp_send of a 2.2 GB object arrives intact", "%s (%lld)",
              st ? smp_last_error() : "wrong bytes", (long long)bad);

    /* a host all-reduce of 2^31 + 1000 elements, in place: MPI calls of at
       most INT_MAX elements. Each rank's values stay below 128, so the sum
       of the two fits a u8 and every element has one right answer. */
    if (argc <= 1) {
        const int64_t n = ((int64_t)1 << 31) + 1000;
        uint8_t *v = (uint8_t *)malloc((size_t)n);
        for (int64_t i = 0; v && i < n; i++) v[i] = (uint8_t)((i * 7 + smp_rank()) & 127);
        smp_tensor vt = smp_tensor_1d(v, SMP_U8, n);
        st = v ? smp_all_reduce(&vt, &vt, SMP_SUM, SMP_WORLD) : SMP_ERR_NOMEM;
        bad = st ? -1 : 0;
        for (int64_t i = 0; !st && i < n; i++) bad += v[i] != (uint8_t)(((i * 7) & 127) + ((i * 7 + 1) & 127));
        free(v);
        MPI_CHECK(st == SMP_OK && bad == 0, "large/an all-reduce over 2^31 + 1000 elements is right in every element",
                  "%s (%lld wrong)", st ? smp_last_error() : "wrong values", (long long)bad);
    }
    smp_finalize();
    MPI_Finalize();
    return test_exit_code();
}
