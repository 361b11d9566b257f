/* gpt_overhead.c - what smp costs at one process (issue 28, make bench-overhead).

   The GPT example's model (examples/gpt_model.h) trained two ways on the
   same synthetic batches: a plain loop written by hand, with no smp in the
   step (gpt_model.h's kernels called in order: forward, loss, backward,
   then AdamW), and the same model through smp_step at one process, at 1 and
   at 4 microbatches. Both loops do the same arithmetic in the same order,
   so at 1 microbatch their losses are equal bit for bit (--check verifies
   that and exits 1 otherwise; test_gpt.sh runs it). Prints

     gpt overhead smp/plain tokens/s: X.XX                 (1 microbatch)
     gpt overhead smp/plain tokens/s at 4 microbatches: X.XX
     allocations per step after the first: N               (smp's system allocations, SMP_MALLOC)
     gpt start-up: tracing X ms, first step Y ms, steady step Z ms          (1 microbatch; then at 4)

   (tracing: smp_model_trace; first step: the first smp_step, which builds the plan and fills the cache; steady:
   the mean smp step after it). After a first untimed step each, the two loops take turns step by step, 2 x (S - 1)
   rounds, and each rate is its fastest step's: other jobs on the machine only ever slow a step down, and taking
   turns step by step puts what load there is on both alike.

   Run: make bench-overhead, or build/examples/gpt_overhead [--layers L] [--dmodel C] [--heads H]
        [--context T] [--batch B] [--vocab V] [--steps S] [--microbatches 1|4] [--only plain|smp] [--check]
   --only runs one loop (its first step and S - 1 more; no timing printed) for counting tools (cachegrind, perf
   stat, strace) that measure the whole process; --microbatches runs only that of the two configurations. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
static long g_mallocs; /* the system allocations smp made */
static void *bench_malloc(size_t n) {
    g_mallocs++;
    return malloc(n);
}
#define SMP_MALLOC(n) bench_malloc(n)
#define SMP_FREE(p) free(p)
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "gpt_model.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---------------------------------------------------------------- AdamW, the same for both loops */
typedef struct adamw { int n; float **m, **v; int64_t t; } adamw;

static void adamw_update(adamw *o, smp_model *model) {
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    o->t++;
    float c1 = 1.0f - powf(b1, (float)o->t), c2 = 1.0f - powf(b2, (float)o->t);
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(model, i, false)); i++) {
        float *w = (float *)smp_param_value(p)->data, *g = (float *)smp_param_grad(p)->data;
        int64_t n = smp_tensor_numel(smp_param_value(p));
        float decay = smp_param_value(p)->ndim >= 2 ? wd : 0.0f;
        for (int64_t j = 0; j < n; j++) {
            o->m[i][j] = b1 * o->m[i][j] + (1.0f - b1) * g[j];
            o->v[i][j] = b2 * o->v[i][j] + (1.0f - b2) * g[j] * g[j];
            w[j] -= lr * ((o->m[i][j] / c1) / (sqrtf(o->v[i][j] / c2) + eps) + decay * w[j]);
        }
    }
}

static void adamw_init(adamw *o, smp_model *model) {
    memset(o, 0, sizeof *o);
    while (smp_model_local_param(model, o->n, false)) o->n++;
    o->m = (float **)calloc((size_t)o->n, sizeof(float *));
    o->v = (float **)calloc((size_t)o->n, sizeof(float *));
    for (int i = 0; i < o->n; i++) {
        size_t n = (size_t)smp_tensor_numel(smp_param_value(smp_model_local_param(model, i, false)));
        o->m[i] = (float *)calloc(n, sizeof(float));
        o->v[i] = (float *)calloc(n, sizeof(float));
    }
}

static void adamw_free(adamw *o) {
    for (int i = 0; i < o->n; i++) { free(o->m[i]); free(o->v[i]); }
    free(o->m);
    free(o->v);
}

static void zero_grads(smp_model *model) {
    smp_param *p;
    for (int i = 0; (p = smp_model_local_param(model, i, false)); i++)
        memset(smp_param_grad(p)->data, 0, smp_tensor_nbytes(smp_param_grad(p)));
}

/* ---------------------------------------------------------------- the plain loop */
typedef struct plain_block { float *x, *h1, *s1, *qkv, *P, *y, *o, *r, *h2, *s2, *f, *g, *t, *m; } plain_block;
typedef struct plain {
    int L, R, T, N, C, H, V; /* blocks; rows, positions and tokens of a microbatch; width, heads, vocabulary */
    plain_block *blk;
    float *emb, *out, *hf, *sf, *logits, *dlogits, *dhf, *dx, *dr, *d1, *d2, *dqkv, *df, *dP, *s_lookup, *s_logits;
} plain;

static float *plain_buf(size_t floats) { return (float *)malloc(sizeof(float) * (floats ? floats : 1)); }

static void plain_init(plain *p, const gpt_config *m, int rows) {
    memset(p, 0, sizeof *p);
    p->L = m->n_layer, p->R = rows, p->T = m->block_size, p->N = rows * m->block_size;
    p->C = m->n_embd, p->H = m->n_head, p->V = m->vocab;
    size_t N = (size_t)p->N, C = (size_t)p->C;
    p->blk = (plain_block *)calloc((size_t)p->L + 1, sizeof *p->blk);
    for (int l = 0; l <= p->L; l++) { /* blk[L].x: the last block's output */
        plain_block *b = &p->blk[l];
        b->x = plain_buf(N * C);
        if (l == p->L) break;
        b->h1 = plain_buf(N * C), b->s1 = plain_buf(2 * N), b->qkv = plain_buf(3 * N * C);
        b->P = plain_buf((size_t)rows * p->H * p->T * p->T), b->y = plain_buf(N * C), b->o = plain_buf(N * C);
        b->r = plain_buf(N * C), b->h2 = plain_buf(N * C), b->s2 = plain_buf(2 * N), b->f = plain_buf(4 * N * C);
        b->g = plain_buf(4 * N * C), b->t = plain_buf(4 * N * C), b->m = plain_buf(N * C);
    }
    p->emb = plain_buf(N * C), p->hf = plain_buf(N * C), p->sf = plain_buf(2 * N);
    p->logits = plain_buf(N * (size_t)p->V), p->dlogits = plain_buf(N * (size_t)p->V), p->dhf = plain_buf(N * C);
    p->dx = plain_buf(N * C), p->dr = plain_buf(N * C), p->d1 = plain_buf(N * C), p->d2 = plain_buf(N * C);
    p->dqkv = plain_buf(3 * N * C), p->df = plain_buf(4 * N * C), p->dP = plain_buf((size_t)p->T * p->T);
    size_t wte = (size_t)p->V * C;
    p->s_lookup = plain_buf(wte), p->s_logits = plain_buf(wte);
}

static void plain_free(plain *p) {
    for (int l = 0; l <= p->L; l++) {
        plain_block *b = &p->blk[l];
        float *all[] = {b->x, b->h1, b->s1, b->qkv, b->P, b->y, b->o, b->r, b->h2, b->s2, b->f, b->g, b->t, b->m};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
    }
    free(p->blk);
    float *all[] = {p->emb, p->hf, p->sf, p->logits, p->dlogits, p->dhf, p->dx, p->dr,
                    p->d1, p->d2, p->dqkv, p->df, p->dP, p->s_lookup, p->s_logits};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

#define PV(prm) ((const float *)smp_param_value(prm)->data)
#define PG(prm) ((float *)smp_param_grad(prm)->data)

static void add(const float *a, const float *b, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

/* One training step's forward and backward over M microbatches of rows p->R: the mean loss; gradients added into
   the (zeroed) parameter gradients, the tied embedding's two uses summed as smp sums a shared module's calls. */
static double plain_step(plain *p, const gpt *g, const int32_t *ids_all, const int32_t *tgt_all, int M) {
    int N = p->N, C = p->C, V = p->V, L = p->L, T = p->T;
    size_t NC = (size_t)N * C;
    double loss = 0;
    memset(p->s_lookup, 0, sizeof(float) * (size_t)V * C);
    memset(p->s_logits, 0, sizeof(float) * (size_t)V * C);
    for (int mb = 0; mb < M; mb++) {
        const int32_t *ids = ids_all + (size_t)mb * N, *tgt = tgt_all + (size_t)mb * N;
        const float *W = PV(g->wte_w), *wpe = PV(g->wpe_w);
        for (int i = 0; i < N; i++) memcpy(p->emb + (size_t)i * C, W + (size_t)ids[i] * C, sizeof(float) * (size_t)C);
        float *x0 = p->blk[0].x;
        for (int r = 0; r < p->R; r++)
            for (int t = 0; t < T; t++)
                for (int j = 0; j < C; j++) {
                    size_t i = ((size_t)r * T + t) * C + j;
                    x0[i] = p->emb[i] + wpe[(size_t)t * C + j];
                }
        for (int l = 0; l < L; l++) {
            const gpt_block *k = &g->blocks[l];
            plain_block *b = &p->blk[l];
            gpt__layernorm_forward(b->x, PV(k->n1.weight), PV(k->n1.bias), b->h1, b->s1, b->s1 + N, N, C);
            mlp_linear_forward(b->h1, PV(k->l_attn.weight), PV(k->l_attn.bias), b->qkv, N, C, 3 * C);
            gpt__attention_forward(b->qkv, b->y, b->P, p->R, T, C, p->H);
            mlp_linear_forward(b->y, PV(k->l_aproj.weight), PV(k->l_aproj.bias), b->o, N, C, C);
            add(b->x, b->o, b->r, NC);
            gpt__layernorm_forward(b->r, PV(k->n2.weight), PV(k->n2.bias), b->h2, b->s2, b->s2 + N, N, C);
            mlp_linear_forward(b->h2, PV(k->l_fc.weight), PV(k->l_fc.bias), b->f, N, C, 4 * C);
            gpt__gelu_forward(b->f, b->g, b->t, 4 * NC);
            mlp_linear_forward(b->g, PV(k->l_mproj.weight), PV(k->l_mproj.bias), b->m, N, 4 * C, C);
            add(b->r, b->m, p->blk[l + 1].x, NC);
        }
        float *out = p->blk[L].x;
        gpt__layernorm_forward(out, PV(g->nf.weight), PV(g->nf.bias), p->hf, p->sf, p->sf + N, N, C);
        mlp_linear_forward(p->hf, W, NULL, p->logits, N, C, V);
        loss += gpt_xent(p->logits, tgt, N, V, p->dlogits, 1.0f / (float)N);
        if (M > 1) { /* smp averages over microbatches: the output gradient times 1/M */
            float s = (float)(1.0 / M);
            for (size_t i = 0; i < (size_t)N * V; i++) p->dlogits[i] *= s;
        }
        /* backward; dx is the gradient of the residual stream */
        mlp_linear_backward(p->hf, W, p->dlogits, p->dhf, p->s_logits, NULL, N, C, V);
        gpt__layernorm_backward(out, PV(g->nf.weight), p->sf, p->sf + N, p->dhf, p->dx, PG(g->nf.weight),
                                PG(g->nf.bias), N, C);
        for (int l = L - 1; l >= 0; l--) {
            const gpt_block *k = &g->blocks[l];
            plain_block *b = &p->blk[l];
            /* y = r + m: dr and dm are dx */
            mlp_linear_backward(b->g, PV(k->l_mproj.weight), p->dx, p->df, NULL, NULL, N, 4 * C, C);
            mlp_linear_backward(b->g, PV(k->l_mproj.weight), p->dx, NULL, PG(k->l_mproj.weight), PG(k->l_mproj.bias), N,
                                4 * C, C);
            gpt__gelu_backward(b->f, b->t, p->df, p->df, 4 * NC);
            mlp_linear_backward(b->h2, PV(k->l_fc.weight), p->df, p->d1, NULL, NULL, N, C, 4 * C);
            mlp_linear_backward(b->h2, PV(k->l_fc.weight), p->df, NULL, PG(k->l_fc.weight), PG(k->l_fc.bias), N, C,
                                4 * C);
            gpt__layernorm_backward(b->r, PV(k->n2.weight), b->s2, b->s2 + N, p->d1, p->d2, PG(k->n2.weight),
                                    PG(k->n2.bias), N, C);
            add(p->dx, p->d2, p->dr, NC); /* r feeds add_2 and ln_2 */
            /* r = x + o: dx and do are dr */
            mlp_linear_backward(b->y, PV(k->l_aproj.weight), p->dr, p->d1, NULL, NULL, N, C, C);
            mlp_linear_backward(b->y, PV(k->l_aproj.weight), p->dr, NULL, PG(k->l_aproj.weight), PG(k->l_aproj.bias),
                                N, C, C);
            gpt__attention_backward(b->qkv, b->P, p->d1, p->dqkv, p->dP, p->R, T, C, p->H);
            mlp_linear_backward(b->h1, PV(k->l_attn.weight), p->dqkv, p->d1, NULL, NULL, N, C, 3 * C);
            mlp_linear_backward(b->h1, PV(k->l_attn.weight), p->dqkv, NULL, PG(k->l_attn.weight), PG(k->l_attn.bias),
                                N, C, 3 * C);
            gpt__layernorm_backward(b->x, PV(k->n1.weight), b->s1, b->s1 + N, p->d1, p->d2, PG(k->n1.weight),
                                    PG(k->n1.bias), N, C);
            add(p->dr, p->d2, p->dx, NC); /* x feeds add_1 and ln_1 */
        }
        float *dP = PG(g->wpe_w);
        for (int r = 0; r < p->R; r++)
            for (int t = 0; t < T; t++)
                for (int j = 0; j < C; j++) dP[(size_t)t * C + j] += p->dx[((size_t)r * T + t) * C + j];
        for (int i = 0; i < N; i++) {
            float *row = p->s_lookup + (size_t)ids[i] * C;
            for (int j = 0; j < C; j++) row[j] += p->dx[(size_t)i * C + j];
        }
    }
    float *gw = PG(g->wte_w); /* the calls in order: the lookup's, then the output projection's */
    for (size_t i = 0; i < (size_t)V * C; i++) gw[i] += p->s_lookup[i];
    for (size_t i = 0; i < (size_t)V * C; i++) gw[i] += p->s_logits[i];
    return loss / M;
}

/* ---------------------------------------------------------------- the two loops, timed */
typedef struct run {
    gpt g;
    smp_model *model;
    adamw opt;
} run;

/* *trace_s: the seconds smp_model_trace took */
static smp_status run_new(run *r, const gpt_config *cfg, const int32_t *ids, int rows, double *trace_s) {
    smp_status st = gpt_build(&r->g, cfg, false, &r->model);
    smp_tensor x = smp_tensor_2d((void *)(uintptr_t)ids, SMP_I32, rows, cfg->block_size);
    double t0 = now();
    if (!st) st = smp_model_trace(r->model, &x, 1);
    *trace_s = now() - t0;
    if (!st) adamw_init(&r->opt, r->model);
    return st;
}

static void run_free(run *r) {
    adamw_free(&r->opt);
    smp_model_free(r->model);
    gpt_free(&r->g);
}

static smp_status smp_train(run *r, int32_t *ids, int32_t *tgt, int rows, int T, double *loss) {
    smp_tensor x = smp_tensor_2d(ids, SMP_I32, rows, T), y = smp_tensor_2d(tgt, SMP_I32, rows, T);
    smp_step_output out = {0};
    smp_model_zero_grad(r->model);
    smp_status st = SMP_TRAIN_STEP(r->model, gpt_loss_body, NULL, &out, 1, x, y);
    if (!st) *loss = smp_step_output_reduce_mean_f64(&out);
    smp_step_output_free(&out);
    if (!st) adamw_update(&r->opt, r->model);
    return st;
}

static double plain_train(run *r, plain *p, const int32_t *ids, const int32_t *tgt, int M) {
    zero_grads(r->model);
    double loss = plain_step(p, &r->g, ids, tgt, M);
    adamw_update(&r->opt, r->model);
    return loss;
}

int main(int argc, char **argv) {
    gpt_config cfg = {96, 4, 256, 4, 128, 0.0f};
    int batch = 8, steps = 10;
    int only = 0, only_mb = 0; /* --only plain: 1, smp: 2; --microbatches: 1 or 4 (0: both) */
    bool check = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--only") && i + 1 < argc && (!strcmp(argv[i + 1], "plain") || !strcmp(argv[i + 1], "smp"))) {
            only = !strcmp(argv[++i], "plain") ? 1 : 2;
            continue;
        }
        if (!strcmp(a, "--microbatches") && i + 1 < argc && (atoi(argv[i + 1]) == 1 || atoi(argv[i + 1]) == 4)) {
            only_mb = atoi(argv[++i]);
            continue;
        }
        int *dst = !strcmp(a, "--layers") ? &cfg.n_layer : !strcmp(a, "--dmodel") ? &cfg.n_embd
                 : !strcmp(a, "--heads") ? &cfg.n_head : !strcmp(a, "--context") ? &cfg.block_size
                 : !strcmp(a, "--vocab") ? &cfg.vocab : !strcmp(a, "--batch") ? &batch
                 : !strcmp(a, "--steps") ? &steps : NULL;
        if (!strcmp(a, "--check")) check = true;
        else if (dst && i + 1 < argc && atoi(argv[i + 1]) > 0) *dst = atoi(argv[++i]);
        else {
            fprintf(stderr, "gpt_overhead: unknown or bad option %s (see bench/gpt_overhead.c's opening comment)\n", a);
            return 2;
        }
    }
    if (batch % 4) { fprintf(stderr, "gpt_overhead: --batch %d must divide into 4 microbatches\n", batch); return 2; }
    MPI_Init(&argc, &argv);
    mlp_set_blas_threads(1);
    int T = cfg.block_size;
    size_t n = (size_t)batch * T;
    int32_t *ids = (int32_t *)malloc(sizeof(int32_t) * n * 2), *tgt = ids + n;
    uint64_t s = 42;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((s >> 33) % (uint64_t)cfg.vocab);
    }
    for (size_t i = 0; i < n; i++) tgt[i] = ids[(i + 1) % n];
    int rc = 0;
    double rate[2][2] = {{0, 0}, {0, 0}}; /* [4 microbatches][smp] */
    double startup[2][3] = {{0, 0, 0}, {0, 0, 0}}; /* [4 microbatches][tracing, first step, steady step] (s) */
    long allocs = -1;
    for (int k = 0; k < 2 && !rc; k++) {
        int M = k ? 4 : 1, S = check ? 3 : steps;
        if (only_mb && M != only_mb) continue;
        smp_config sc = {0};
        sc.partitions = 1;
        sc.microbatches = M;
        run a, b;
        plain p;
        double unused;
        if (smp_init(&sc) || run_new(&a, &cfg, ids, batch / M, &startup[k][0]) ||
            run_new(&b, &cfg, ids, batch / M, &unused)) {
            fprintf(stderr, "gpt_overhead: %s\n", smp_last_error());
            rc = 1;
            break;
        }
        plain_init(&p, &cfg, batch / M);
        double lp[3] = {0, 0, 0}, ls[3] = {0, 0, 0}, l = 0;
        /* a first step each, untimed (smp's first step builds its plan and fills its cache) */
        if (only != 2) lp[0] = plain_train(&b, &p, ids, tgt, M);
        double f0 = now();
        if (only != 1 && smp_train(&a, ids, tgt, batch, T, &ls[0])) {
            fprintf(stderr, "gpt_overhead: %s\n", smp_last_error());
            rc = 1;
        }
        startup[k][1] = now() - f0;
        /* 2 x (S - 1) rounds of one plain and one smp step, taking turns in which goes first; each loop's rate is
           its fastest step's (other jobs on the machine only ever slow a step down), smp's steady step its mean */
        int rounds = only ? S - 1 : 2 * (S - 1);
        double fastest[2] = {0, 0}, smp_total = 0;
        long m0 = g_mallocs;
        for (int i = 1; i <= rounds && !rc; i++) {
            for (int turn = 0; turn < 2 && !rc; turn++) {
                int is_smp = turn ^ (i & 1);
                if (only == (is_smp ? 1 : 2)) continue;
                double t0 = now();
                if (!is_smp) l = plain_train(&b, &p, ids, tgt, M);
                else if (smp_train(&a, ids, tgt, batch, T, &l)) {
                    fprintf(stderr, "gpt_overhead: %s\n", smp_last_error());
                    rc = 1;
                }
                double t = now() - t0;
                if (i < 3) (is_smp ? ls : lp)[i] = l;
                if (!fastest[is_smp] || t < fastest[is_smp]) fastest[is_smp] = t;
                if (is_smp) smp_total += t;
            }
            if (!k && i == S - 1) allocs = (g_mallocs - m0) / (S - 1); /* the first S - 1 smp steps after the first */
        }
        for (int side = 0; side < 2; side++) rate[k][side] = fastest[side] > 0 ? (double)n / fastest[side] : 0;
        startup[k][2] = rounds > 0 ? smp_total / rounds : 0;
        if (check && !rc && M == 1) {
            bool same = !memcmp(lp, ls, sizeof lp);
            printf("plain and smp losses at 1 microbatch, 3 steps: %a %a %a | %a %a %a: %s\n", lp[0], lp[1], lp[2],
                   ls[0], ls[1], ls[2], same ? "bitwise equal" : "DIFFERENT");
            if (!same) rc = 1;
        }
        plain_free(&p);
        run_free(&a);
        run_free(&b);
        smp_finalize();
        if (check) break;
    }
    if (!rc && only)
        printf("gpt_overhead: only the %s loop, %d steps\n", only == 1 ? "plain" : "smp", steps);
    if (!rc && !check && !only && !only_mb) {
        printf("gpt %d layers, width %d, %d heads, context %d, batch %d, %d steps (one process)\n", cfg.n_layer,
               cfg.n_embd, cfg.n_head, T, batch, steps);
        printf("plain tokens/s: %.0f (1 microbatch), %.0f (4); smp tokens/s: %.0f, %.0f\n", rate[0][0], rate[1][0],
               rate[0][1], rate[1][1]);
        printf("gpt overhead smp/plain tokens/s: %.2f\n", rate[0][1] / rate[0][0]);
        printf("gpt overhead smp/plain tokens/s at 4 microbatches: %.2f\n", rate[1][1] / rate[1][0]);
        printf("allocations per step after the first: %ld\n", allocs);
        for (int k = 0; k < 2; k++) /* smp_model_trace; the first smp step (plan, cache); the mean steady step */
            printf("gpt start-up%s: tracing %.1f ms, first step %.1f ms, steady step %.1f ms\n",
                   k ? " at 4 microbatches" : "", 1e3 * startup[k][0], 1e3 * startup[k][1], 1e3 * startup[k][2]);
    }
    free(ids);
    (void)gpt_kv_start; /* generation's, unused here */
    MPI_Finalize();
    return rc;
}
