/* tp_mlp.h - test_tp.c's tensor-parallel model, shared with test_ckpt_tp.c:
   two blocks, each tp_copy -> a column-parallel linear + ReLU (W1 [F, H] and
   b1 [F] sharded along axis 0) -> a row-parallel linear without bias (W2
   [H, F] sharded along axis 1) -> tp_reduce -> a bias (b2 [H], whole); its
   kernels, an MSE step body, the batch of each step (the same on every
   rank), and the full tensors of a replica's parameters. Block 1 shards its
   F features in SPLITS blocks (smp_param_new_sharded_blocks: W1 and b1
   along axis 0, W2 along axis 1, so each rank's outputs of one are its
   inputs of the other), as a fused QKV or gate-and-up projection is: the
   same function at every tp, each rank a slice of every block. Include
   after smp_pipeline.h and test.h. */
#ifndef TP_MLP_H
#define TP_MLP_H
#define H 8
#define F 16
#define BATCH 4
#define MB 2
#define STEPS 20
#define BLOCKS 2
#define NP (BLOCKS * 3) /* W1, b1, W2 per block... and b2: see param_names */
#define LR 0.05f
#define SPLITS 2 /* blocks of block 1's sharded axis */

/* ------------------------------------------------------------ kernels */
/* Fault injection for test_tp_chaos.c: the kernels count their calls on this rank, and the one numbered
   g_fail_at (-1: none) fails. */
static long g_kernel_calls, g_fail_at = -1;
#define TP_MLP_MAYBE_FAIL()                                                                                     \
    do {                                                                                                        \
        if (g_kernel_calls++ == g_fail_at)                                                                      \
            return smp_error(SMP_ERR_MODULE, "a failure injected into kernel call %ld on world rank %d", g_fail_at, \
                             smp_rank());                                                                       \
    } while (0)
static smp_status col_forward(smp_call_ctx *c) { /* y = relu(x W^T + b), W [f, H] local */
    TP_MLP_MAYBE_FAIL();
    smp_module *m = smp_call_module(c);
    smp_param **p = (smp_param **)smp_module_user(m);
    const smp_tensor *x = smp_call_input(c, 0), *w = smp_param_value(p[0]), *b = smp_param_value(p[1]);
    int n = (int)x->shape[0], f = (int)w->shape[0];
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, (int64_t[]){n, f});
    if (!y) return SMP_ERR_NOMEM;
    const float *xs = (const float *)x->data, *ws = (const float *)w->data, *bs = (const float *)b->data;
    float *ys = (float *)y->data;
    for (int r = 0; r < n; r++)
        for (int o = 0; o < f; o++) {
            float acc = bs[o];
            for (int i = 0; i < H; i++) acc += xs[r * H + i] * ws[o * H + i];
            ys[r * f + o] = acc > 0 ? acc : 0;
        }
    return SMP_OK;
}
static smp_status col_backward(smp_call_ctx *c) {
    TP_MLP_MAYBE_FAIL();
    smp_param **p = (smp_param **)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *y = smp_call_output_value(c, 0), *gy = smp_call_grad_output(c, 0);
    const float *xs = (const float *)x->data, *ys = (const float *)y->data, *g = (const float *)gy->data;
    const float *ws = (const float *)smp_param_value(p[0])->data;
    float *gw = (float *)smp_param_grad(p[0])->data, *gb = (float *)smp_param_grad(p[1])->data;
    int n = (int)x->shape[0], f = (int)y->shape[1];
    smp_tensor *gx = smp_call_grad_input(c, 0);
    for (int r = 0; gx && r < n; r++)
        for (int i = 0; i < H; i++) {
            float acc = 0;
            for (int o = 0; o < f; o++) acc += (ys[r * f + o] > 0 ? g[r * f + o] : 0) * ws[o * H + i];
            ((float *)gx->data)[r * H + i] = acc;
        }
    for (int o = 0; o < f; o++) {
        float sb = 0;
        for (int r = 0; r < n; r++) sb += ys[r * f + o] > 0 ? g[r * f + o] : 0;
        gb[o] += sb;
        for (int i = 0; i < H; i++) {
            float sw = 0;
            for (int r = 0; r < n; r++) sw += (ys[r * f + o] > 0 ? g[r * f + o] : 0) * xs[r * H + i];
            gw[o * H + i] += sw;
        }
    }
    return SMP_OK;
}
static smp_status row_forward(smp_call_ctx *c) { /* y = x W^T, W [H, f] local: a partial sum */
    TP_MLP_MAYBE_FAIL();
    smp_param **p = (smp_param **)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *w = smp_param_value(p[0]);
    int n = (int)x->shape[0], f = (int)w->shape[1];
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, (int64_t[]){n, H});
    if (!y) return SMP_ERR_NOMEM;
    for (int r = 0; r < n; r++)
        for (int h = 0; h < H; h++) {
            float acc = 0;
            for (int i = 0; i < f; i++)
                acc += ((const float *)x->data)[r * f + i] * ((const float *)w->data)[h * f + i];
            ((float *)y->data)[r * H + h] = acc;
        }
    return SMP_OK;
}
static smp_status row_backward(smp_call_ctx *c) {
    TP_MLP_MAYBE_FAIL();
    smp_param **p = (smp_param **)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0), *gy = smp_call_grad_output(c, 0);
    const float *xs = (const float *)x->data, *g = (const float *)gy->data,
                *ws = (const float *)smp_param_value(p[0])->data;
    float *gw = (float *)smp_param_grad(p[0])->data;
    int n = (int)x->shape[0], f = (int)x->shape[1];
    smp_tensor *gx = smp_call_grad_input(c, 0);
    for (int r = 0; gx && r < n; r++)
        for (int i = 0; i < f; i++) {
            float acc = 0;
            for (int h = 0; h < H; h++) acc += g[r * H + h] * ws[h * f + i];
            ((float *)gx->data)[r * f + i] = acc;
        }
    for (int h = 0; h < H; h++)
        for (int i = 0; i < f; i++) {
            float s = 0;
            for (int r = 0; r < n; r++) s += g[r * H + h] * xs[r * f + i];
            gw[h * f + i] += s;
        }
    return SMP_OK;
}
static smp_status bias_forward(smp_call_ctx *c) {
    TP_MLP_MAYBE_FAIL();
    smp_param **p = (smp_param **)smp_module_user(smp_call_module(c));
    const smp_tensor *x = smp_call_input(c, 0);
    smp_tensor *y = smp_call_output(c, 0, SMP_F32, 2, x->shape);
    if (!y) return SMP_ERR_NOMEM;
    int n = (int)x->shape[0], k = (int)x->shape[1];
    for (int r = 0; r < n; r++)
        for (int h = 0; h < k; h++)
            ((float *)y->data)[r * k + h] =
                ((const float *)x->data)[r * k + h] + ((const float *)smp_param_value(p[0])->data)[h];
    return SMP_OK;
}
static smp_status bias_backward(smp_call_ctx *c) {
    TP_MLP_MAYBE_FAIL();
    smp_param **p = (smp_param **)smp_module_user(smp_call_module(c));
    const smp_tensor *gy = smp_call_grad_output(c, 0);
    int n = (int)gy->shape[0], k = (int)gy->shape[1];
    smp_tensor *gx = smp_call_grad_input(c, 0);
    if (gx) memcpy(gx->data, gy->data, smp_tensor_nbytes(gy));
    for (int h = 0; h < k; h++) {
        float s = 0;
        for (int r = 0; r < n; r++) s += ((const float *)gy->data)[r * k + h];
        ((float *)smp_param_grad(p[0])->data)[h] += s;
    }
    return SMP_OK;
}

/* ------------------------------------------------------------ the model */
typedef struct net {
    smp_module *root, *mods[BLOCKS][5]; /* copy, col, row, reduce, bias */
    smp_param *col_p[BLOCKS][2], *row_p[BLOCKS][1], *bias_p[BLOCKS][1];
    smp_param *params[BLOCKS * 4]; /* W1, b1, W2, b2 per block */
    smp_model *model;
} net;

static smp_status net_forward(smp_model *m, const smp_tensor *in, int nin, smp_tensor *out, int nout, void *u) {
    (void)m; (void)nin; (void)nout;
    net *n = (net *)u;
    smp_tensor h = in[0];
    for (int b = 0; b < BLOCKS; b++)
        for (int k = 0; k < 5; k++) SMP_TRY(smp_call(n->mods[b][k], &h, 1, b == BLOCKS - 1 && k == 4 ? out : &h, 1));
    return SMP_OK;
}

static float g_bound = 0.4f;
static void build(net *n, bool pipelined, bool recompute, int wide) {
    memset(n, 0, sizeof *n);
    n->root = smp_module_new(NULL, "", NULL);
    for (int b = 0; b < BLOCKS; b++) {
        char name[32];
        if (pipelined) smp_partition_push(b);
        snprintf(name, sizeof name, "b%d_in", b);
        n->mods[b][0] = smp_module_new_tp_copy(n->root, name);
        snprintf(name, sizeof name, "b%d_fc", b);
        n->mods[b][1] = smp_module_new(n->root, name, &(smp_module_desc){col_forward, col_backward, n->col_p[b]});
        int nb = b == 1 ? SPLITS : 1;
        n->col_p[b][0] = smp_param_new_sharded_blocks(n->mods[b][1], "weight", SMP_F32, 2, (int64_t[]){wide, H}, 0, nb,
                                                      smp_init_uniform, &g_bound);
        n->col_p[b][1] = smp_param_new_sharded_blocks(n->mods[b][1], "bias", SMP_F32, 1, (int64_t[]){wide}, 0, nb,
                                                      smp_init_uniform, &g_bound);
        snprintf(name, sizeof name, "b%d_proj", b);
        n->mods[b][2] = smp_module_new(n->root, name, &(smp_module_desc){row_forward, row_backward, n->row_p[b]});
        n->row_p[b][0] = smp_param_new_sharded_blocks(n->mods[b][2], "weight", SMP_F32, 2, (int64_t[]){H, wide}, 1, nb,
                                                      smp_init_uniform, &g_bound);
        snprintf(name, sizeof name, "b%d_out", b);
        n->mods[b][3] = smp_module_new_tp_reduce(n->root, name);
        snprintf(name, sizeof name, "b%d_bias", b);
        n->mods[b][4] = smp_module_new(n->root, name, &(smp_module_desc){bias_forward, bias_backward, n->bias_p[b]});
        n->bias_p[b][0] = smp_param_new(n->mods[b][4], "bias", SMP_F32, 1, (int64_t[]){H}, smp_init_uniform, &g_bound);
        if (recompute) smp_module_set_recompute(n->mods[b][1], true);
        if (pipelined) smp_partition_pop();
        n->params[b * 4] = n->col_p[b][0];
        n->params[b * 4 + 1] = n->col_p[b][1];
        n->params[b * 4 + 2] = n->row_p[b][0];
        n->params[b * 4 + 3] = n->bias_p[b][0];
    }
}

/* The batch of step s (the same on every rank). */
static void batch_of(int s, float *x, float *t) {
    uint64_t st = 1234 + (uint64_t)s * 7919;
    for (int i = 0; i < BATCH * H; i++) {
        x[i] = (float)(2 * smp_rng_uniform(&st) - 1);
        t[i] = (float)(2 * smp_rng_uniform(&st) - 1);
    }
}

SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    int n = (int)smp_tensor_numel(y);
    float loss = 0;
    for (int i = 0; i < n; i++) {
        float d = ((const float *)y->data)[i] - ((const float *)t->data)[i];
        loss += 0.5f * d * d;
        ((float *)g->data)[i] = d;
    }
    return smp_mb_return_f32(mb, 0, loss);
}

/* Copies between a parameter's local slice and its full tensor: along the
   shard axis, local index i is block i / (loc / blocks), at offset + i %
   (loc / blocks) within that block. */
static inline void slice_io(smp_param *p, float *local, float *full, bool to_full) {
    int64_t shape[SMP_MAX_DIMS], outer = 1, inner = 1, off = smp_param_shard_offset(p);
    int nd = smp_param_full_shape(p, shape), axis = smp_param_shard_axis(p), nb = smp_param_shard_blocks(p);
    if (axis < 0) { axis = 0; off = 0; nb = 1; }
    for (int d = 0; d < axis; d++) outer *= shape[d];
    for (int d = axis + 1; d < nd; d++) inner *= shape[d];
    int64_t loc = smp_param_value(p)->shape[axis], per = loc / nb, span = shape[axis] / nb;
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < loc; i++) {
            float *f = full + (o * shape[axis] + i / per * span + off + i % per) * inner, *l = local + (o * loc + i) * inner;
            memcpy(to_full ? f : l, to_full ? l : f, sizeof(float) * (size_t)inner);
        }
}

/* The full tensors of local[k] (a local parameter's slice of something shaped as it: its value, gradient,
   optimizer state) on every rank of the replica: bits ORed over MP_GROUP, each element from the one rank that holds
   it (a whole parameter from tp rank 0), so every bit (-0 included) arrives as it was. */
static inline void full_of(net *n, float *const *local, float **out) {
    for (int k = 0; k < BLOCKS * 4; k++) {
        smp_param *p = n->params[k];
        int64_t shape[SMP_MAX_DIMS];
        int nd = smp_param_full_shape(p, shape);
        smp_tensor full = smp_tensor_make(out[k], SMP_F32, nd, shape);
        memset(full.data, 0, smp_tensor_nbytes(&full));
        if (smp_module_is_local(smp_param_module(p)) && (smp_param_shard_axis(p) >= 0 || smp_tp_rank() == 0))
            slice_io(p, local[k], out[k], true);
        MPI_Allreduce(MPI_IN_PLACE, out[k], (int)smp_tensor_numel(&full), MPI_UINT32_T, MPI_BOR,
                      smp_group_comm(SMP_MP_GROUP));
    }
}

/* SGD with LR on this rank's parameters: the tests' optimizer step. */
static inline void sgd_step(smp_model *model) {
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(model, i, false)) != NULL; i++) {
        float *v = (float *)smp_param_value(p)->data, *g = (float *)smp_param_grad(p)->data;
        for (int64_t e = 0; e < smp_tensor_numel(smp_param_value(p)); e++) v[e] -= LR * g[e];
    }
}

/* The full tensors of the replica's parameters (values or gradients), on every rank of it. */
static inline void full_params(net *n, bool grads, float **out) {
    float *local[BLOCKS * 4];
    for (int k = 0; k < BLOCKS * 4; k++) {
        smp_param *p = n->params[k];
        local[k] = !smp_module_is_local(smp_param_module(p))
                       ? NULL
                       : (float *)(grads ? smp_param_grad(p) : smp_param_value(p))->data;
    }
    full_of(n, local, out);
}

/* The elements of parameter k of a model of width `wide`. */
static inline int64_t numel_of(int k, int wide) {
    return k % 4 == 0 || k % 4 == 2 ? (int64_t)wide * H : k % 4 == 1 ? wide : H;
}

#endif
