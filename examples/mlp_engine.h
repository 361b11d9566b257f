/* mlp_engine.h - a small CPU training engine for the smp examples.

   Everything a multilayer perceptron on Fashion-MNIST needs, and nothing
   about distribution: smp decides which process runs which layer on which
   microbatch, this file does the arithmetic.

     fm_*   Fashion-MNIST IDX files (gzip, read through zlib)
     mlp_*  layers, loss, optimizers, seeded init, RNG, BLAS threads

   USAGE
     #include "mlp_engine.h"        (every function is static inline; no
                                     implementation macro, no globals)
     Build: cc -std=c11 -O2 prog.c -lopenblas -lz -lm
     An engine with arithmetic of its own (a GPU one) that wants only the
     loader, the seeded init and the RNG defines MLP_ENGINE_NO_BLAS first:
     no cblas.h, no OpenBLAS, no mlp_linear_* or mlp_set_blas_threads.

   CONVENTIONS
     - Matrices are row-major float. A batch of n rows of width d is n*d
       floats. Every layer function takes raw pointers and sizes, so any
       slice of a batch (a microbatch) can be passed as it is.
     - Functions are pure: they read their inputs and parameters and write
       only the outputs named in their signature. The caller owns
       parameters, gradients, optimizer state and saved activations.
     - Gradients of parameters ACCUMULATE (+=); the caller zeroes them at
       the start of a step (mlp_zero). Gradients of activations (dx,
       dlogits) are OVERWRITTEN.

   A TRAINING STEP WITH MICROBATCHES (what the pipeline runtime does)
     zero all dW, db
     for each microbatch j of m_j rows (sum of m_j = B, the step's batch):
         forward every layer on the m_j rows, keeping each layer's output
         loss_j = mlp_xent_loss(logits, labels, m_j, K, dlogits, 1.0f / B)
         backward every layer, last to first (dW, db accumulate)
     optimizer step on the accumulated gradients
   With the gradient scale 1/B every microbatch's rows carry the same weight
   as in one big batch, so the accumulated gradient is the mean over the B
   rows whatever the split (exact in real arithmetic; in float it differs
   only by summation order). The step's loss is sum_j loss_j * m_j / B.
   When all microbatches have the same size m, this equals "scale 1/m per
   microbatch, then average the M gradients" (1/B = (1/m) * (1/M)).
   Under smp_step with average_grads_across_microbatches on (its default)
   smp itself multiplies the gradient a step body returns by 1/M, so the
   body passes grad_scale 1/m (the mean over its own rows); with it off,
   pass 1/B. Do not do both, or gradients come out M times too small.

   DETERMINISM
     mlp_init, mlp_rng_*, mlp_shuffle_u32 and the loader use only integer
     arithmetic and exactly rounded float operations: same inputs give the
     same bits on any machine. Reductions here (bias gradients, loss) run
     in a fixed order. sgemm results are bitwise repeatable for the same
     OpenBLAS kernel and thread count, not across CPU families.
*/
#ifndef MLP_ENGINE_H
#define MLP_ENGINE_H

#ifndef MLP_ENGINE_NO_BLAS
#include <cblas.h>
#endif
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

/* ======================================================================
   Fashion-MNIST loader
   ====================================================================== */

#define FM_DEFAULT_DIR "/usr/share/datasets/fashion-mnist"
#define FM_ROWS 28
#define FM_COLS 28
#define FM_PIXELS (FM_ROWS * FM_COLS)
#define FM_CLASSES 10

/* Same numbers as errno-free status codes; FM_OK is 0. */
typedef enum {
    FM_OK = 0,
    FM_ERR_OPEN,      /* file missing or unreadable */
    FM_ERR_FORMAT,    /* bad magic number, dimensions or label values */
    FM_ERR_TRUNCATED, /* fewer bytes than the header promises */
    FM_ERR_CORRUPT,   /* gzip stream damaged (bad deflate data, CRC) */
    FM_ERR_MISMATCH,  /* image and label files disagree on the count */
    FM_ERR_NOMEM
} fm_status;

typedef struct {
    float *images;   /* n x FM_PIXELS, row-major */
    uint8_t *labels; /* n values, each < FM_CLASSES */
    size_t n;
} fm_dataset;

/* Formats an error into err (which may be NULL) and returns code. */
__attribute__((format(printf, 4, 5))) static inline fm_status
fm__fail(char *err, size_t errlen, fm_status code, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* zlib's message for the last error, without the "path: " prefix that
   gzerror puts in front (our messages name the file themselves). */
static inline const char *fm__zmsg(gzFile f, const char *path, int *zerr) {
    const char *msg = gzerror(f, zerr);
    size_t n = strlen(path);
    if (strncmp(msg, path, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ')
        msg += n + 2;
    return msg;
}

/* Reads exactly want bytes. gzread takes an unsigned count, so large
   payloads go in chunks. On a short read tells truncation (zlib saw the
   input end: Z_BUF_ERROR, or nothing for a plain file) from corruption
   (any other zlib error: bad deflate data, bad CRC, ...). */
static inline fm_status fm__read(gzFile f, void *dst, size_t want,
                                 const char *path, const char *what,
                                 char *err, size_t errlen) {
    unsigned char *p = (unsigned char *)dst;
    size_t got = 0;
    while (got < want) {
        size_t chunk = want - got;
        if (chunk > (1u << 30)) chunk = 1u << 30;
        int r = gzread(f, p + got, (unsigned)chunk);
        if (r <= 0) break;
        got += (size_t)r;
    }
    if (got < want) {
        int zerr = Z_OK;
        const char *msg = fm__zmsg(f, path, &zerr);
        if (zerr == Z_ERRNO)
            return fm__fail(err, errlen, FM_ERR_OPEN,
                            "%s: read error while reading %s: %s", path, what,
                            strerror(errno));
        if (zerr != Z_OK && zerr != Z_BUF_ERROR)
            return fm__fail(err, errlen, FM_ERR_CORRUPT,
                            "%s: corrupt gzip data: %s (found while reading "
                            "%s)",
                            path, msg, what);
        return fm__fail(err, errlen, FM_ERR_TRUNCATED,
                        "%s: truncated while reading %s: expected %zu "
                        "bytes, the data ends after %zu",
                        path, what, want, got);
    }
    return FM_OK;
}

/* After the payload the file must end cleanly. Reading one more byte
   also makes zlib check the gzip trailer (CRC-32 and length), which it
   only does when the stream end is reached. */
static inline fm_status fm__expect_end(gzFile f, const char *path,
                                       size_t items, char *err,
                                       size_t errlen) {
    unsigned char extra;
    int r = gzread(f, &extra, 1);
    int zerr = 0;
    const char *msg = fm__zmsg(f, path, &zerr);
    if (r < 0 || (zerr != Z_OK && zerr != Z_BUF_ERROR))
        return fm__fail(err, errlen, FM_ERR_CORRUPT,
                        "%s: corrupt gzip data: %s (found at the end of the "
                        "file, where gzip checks CRC and length)",
                        path, msg);
    if (zerr == Z_BUF_ERROR)
        return fm__fail(err, errlen, FM_ERR_TRUNCATED,
                        "%s: truncated: gzip trailer missing (%s)", path, msg);
    if (r > 0)
        return fm__fail(err, errlen, FM_ERR_FORMAT,
                        "%s: unexpected data after the %zu items the header "
                        "announces",
                        path, items);
    return FM_OK;
}

static inline uint32_t fm__be32(const unsigned char *b) {
    return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 |
           (uint32_t)b[3];
}

/* Opens path and checks the IDX header: magic 0x0000080<ndim> (unsigned
   byte data) followed by ndim big-endian u32 dimensions. */
static inline fm_status fm__open_idx(const char *path, int ndim, gzFile *out,
                                     uint32_t *dims, char *err,
                                     size_t errlen) {
    errno = 0;
    gzFile f = gzopen(path, "rb");
    if (!f)
        return fm__fail(err, errlen, FM_ERR_OPEN, "%s: cannot open: %s", path,
                        errno ? strerror(errno) : "out of memory");
    gzbuffer(f, 1u << 17);
    unsigned char hdr[4 * 3];
    fm_status s = fm__read(f, hdr, 4, path, "the magic number", err, errlen);
    if (s != FM_OK) {
        gzclose(f);
        return s;
    }
    uint32_t magic = fm__be32(hdr), want = 0x800u | (uint32_t)ndim;
    if (magic != want) {
        const char *hint = "";
        if (magic == 0x801u) hint = " (that is a label file)";
        else if (magic == 0x803u) hint = " (that is an image file)";
        else if ((magic >> 16) == 0x1f8bu) hint = " (gzip inside gzip?)";
        gzclose(f);
        return fm__fail(err, errlen, FM_ERR_FORMAT,
                        "%s: bad magic number 0x%08x, expected 0x%08x for "
                        "%d-dimensional unsigned byte data%s",
                        path, (unsigned)magic, (unsigned)want, ndim, hint);
    }
    s = fm__read(f, hdr, 4 * (size_t)ndim, path, "the IDX dimensions", err,
                 errlen);
    if (s != FM_OK) {
        gzclose(f);
        return s;
    }
    for (int i = 0; i < ndim; i++) dims[i] = fm__be32(hdr + 4 * i);
    *out = f;
    return FM_OK;
}

/* Images: *out gets count x 784 floats in [0,1] (pixel / 255), malloc'd. */
static inline fm_status fm_load_images(const char *path, float **out,
                                       size_t *count, char *err,
                                       size_t errlen) {
    gzFile f = NULL;
    uint32_t d[3] = {0, 0, 0};
    *out = NULL;
    *count = 0;
    fm_status s = fm__open_idx(path, 3, &f, d, err, errlen);
    if (s != FM_OK) return s;
    if (d[1] != FM_ROWS || d[2] != FM_COLS || d[0] == 0) {
        gzclose(f);
        return fm__fail(err, errlen, FM_ERR_FORMAT,
                        "%s: images are %ux%u (count %u), expected %dx%d and "
                        "at least one image",
                        path, (unsigned)d[1], (unsigned)d[2], (unsigned)d[0],
                        FM_ROWS, FM_COLS);
    }
    size_t n = d[0], bytes = n * FM_PIXELS;
    unsigned char *raw = (unsigned char *)malloc(bytes);
    if (!raw) {
        gzclose(f);
        return fm__fail(err, errlen, FM_ERR_NOMEM,
                        "%s: out of memory for %zu images", path, n);
    }
    char what[64];
    snprintf(what, sizeof what, "%zu images", n);
    s = fm__read(f, raw, bytes, path, what, err, errlen);
    if (s == FM_OK) s = fm__expect_end(f, path, n, err, errlen);
    gzclose(f);
    /* the float copy only once the file proved good */
    float *x = s == FM_OK ? (float *)malloc(bytes * sizeof(float)) : NULL;
    if (s == FM_OK && !x)
        s = fm__fail(err, errlen, FM_ERR_NOMEM,
                     "%s: out of memory for %zu images", path, n);
    if (s != FM_OK) {
        free(raw);
        return s;
    }
    for (size_t i = 0; i < bytes; i++) x[i] = (float)raw[i] / 255.0f;
    free(raw);
    *out = x;
    *count = n;
    return FM_OK;
}

/* Labels: *out gets count bytes, each checked to be < 10, malloc'd. */
static inline fm_status fm_load_labels(const char *path, uint8_t **out,
                                       size_t *count, char *err,
                                       size_t errlen) {
    gzFile f = NULL;
    uint32_t d[1] = {0};
    *out = NULL;
    *count = 0;
    fm_status s = fm__open_idx(path, 1, &f, d, err, errlen);
    if (s != FM_OK) return s;
    if (d[0] == 0) {
        gzclose(f);
        return fm__fail(err, errlen, FM_ERR_FORMAT, "%s: holds no labels",
                        path);
    }
    size_t n = d[0];
    uint8_t *y = (uint8_t *)malloc(n);
    if (!y) {
        gzclose(f);
        return fm__fail(err, errlen, FM_ERR_NOMEM,
                        "%s: out of memory for %zu labels", path, n);
    }
    char what[64];
    snprintf(what, sizeof what, "%zu labels", n);
    s = fm__read(f, y, n, path, what, err, errlen);
    if (s == FM_OK) s = fm__expect_end(f, path, n, err, errlen);
    gzclose(f);
    for (size_t i = 0; s == FM_OK && i < n; i++)
        if (y[i] >= FM_CLASSES)
            s = fm__fail(err, errlen, FM_ERR_FORMAT,
                         "%s: label %zu is %u, expected 0..%d", path, i,
                         (unsigned)y[i], FM_CLASSES - 1);
    if (s != FM_OK) {
        free(y);
        return s;
    }
    *out = y;
    *count = n;
    return FM_OK;
}

static inline void fm_free(fm_dataset *ds) {
    free(ds->images);
    free(ds->labels);
    memset(ds, 0, sizeof *ds);
}

/* Loads an image file and its label file; the counts must agree. */
static inline fm_status fm_load(fm_dataset *ds, const char *images_path,
                                const char *labels_path, char *err,
                                size_t errlen) {
    size_t ni = 0, nl = 0;
    memset(ds, 0, sizeof *ds);
    fm_status s = fm_load_images(images_path, &ds->images, &ni, err, errlen);
    if (s != FM_OK) return s;
    s = fm_load_labels(labels_path, &ds->labels, &nl, err, errlen);
    if (s != FM_OK) {
        fm_free(ds);
        return s;
    }
    if (ni != nl) {
        fm_free(ds);
        return fm__fail(err, errlen, FM_ERR_MISMATCH,
                        "%s holds %zu images but %s holds %zu labels",
                        images_path, ni, labels_path, nl);
    }
    ds->n = ni;
    return FM_OK;
}

/* Loads "<dir>/<split>-images-idx3-ubyte.gz" and the matching labels;
   split is "train" (60000) or "t10k" (10000); dir NULL means
   FM_DEFAULT_DIR. */
static inline fm_status fm_load_split(fm_dataset *ds, const char *dir,
                                      const char *split, char *err,
                                      size_t errlen) {
    char ip[4096], lp[4096];
    if (!dir) dir = FM_DEFAULT_DIR;
    int a = snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte.gz", dir, split);
    int b = snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    if (a < 0 || b < 0 || (size_t)a >= sizeof ip || (size_t)b >= sizeof lp) {
        memset(ds, 0, sizeof *ds);
        return fm__fail(err, errlen, FM_ERR_OPEN, "%s: path too long", dir);
    }
    return fm_load(ds, ip, lp, err, errlen);
}

/* Mean and standard deviation over all pixels (fixed order, double). */
static inline void fm_pixel_stats(const fm_dataset *ds, float *mean,
                                  float *stdev) {
    size_t total = ds->n * FM_PIXELS;
    double s = 0, ss = 0;
    for (size_t i = 0; i < total; i++) {
        double v = ds->images[i];
        s += v;
        ss += v * v;
    }
    double m = total ? s / (double)total : 0.0;
    double var = total ? ss / (double)total - m * m : 0.0;
    *mean = (float)m;
    *stdev = (float)sqrt(var > 0 ? var : 0.0);
}

/* x = (x - mean) / stdev for every pixel. Use the training set's stats
   for both splits. */
static inline void fm_standardize(fm_dataset *ds, float mean, float stdev) {
    size_t total = ds->n * FM_PIXELS;
    float inv = stdev > 0 ? 1.0f / stdev : 1.0f;
    for (size_t i = 0; i < total; i++)
        ds->images[i] = (ds->images[i] - mean) * inv;
}

/* Copies the rows idx[0..count) into x (count x 784) and y (count). */
static inline void fm_gather(const fm_dataset *ds, const uint32_t *idx,
                             size_t count, float *x, uint8_t *y) {
    for (size_t i = 0; i < count; i++) {
        memcpy(x + i * FM_PIXELS, ds->images + (size_t)idx[i] * FM_PIXELS,
               FM_PIXELS * sizeof(float));
        if (y) y[i] = ds->labels[idx[i]];
    }
}

/* ======================================================================
   Layers
   ====================================================================== */

static inline void mlp_zero(float *p, size_t n) {
    if (n) memset(p, 0, n * sizeof(float));
}

#ifndef MLP_ENGINE_NO_BLAS
/* Linear, W is out x in (PyTorch layout), b has out entries (NULL: none).
   y (n x out) = x (n x in) * W^T + b.  Save x for the backward pass. */
static inline void mlp_linear_forward(const float *x, const float *W,
                                      const float *b, float *y, int n, int in,
                                      int out) {
    if (n <= 0 || out <= 0) return;
    float beta = 0.0f;
    if (b) {
        for (int i = 0; i < n; i++)
            memcpy(y + (size_t)i * out, b, (size_t)out * sizeof(float));
        beta = 1.0f;
    }
    if (in <= 0) { /* no inputs: y is just the bias */
        if (!b) mlp_zero(y, (size_t)n * out);
        return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x,
                in, W, in, beta, y, out);
}

/* Given dy = dL/dy (n x out) and the saved input x (n x in):
     dx  = dy * W           (overwritten; pass NULL when not needed, e.g.
                             for the first layer)
     dW += dy^T * x         (accumulated; NULL skips it)
     db += column sums of dy (accumulated, rows in order; NULL skips it)
   dx must not overlap dy or x. */
static inline void mlp_linear_backward(const float *x, const float *W,
                                       const float *dy, float *dx, float *dW,
                                       float *db, int n, int in, int out) {
    if (n <= 0 || in <= 0) return;
    if (out <= 0) { /* nothing flows back */
        if (dx) mlp_zero(dx, (size_t)n * in);
        return;
    }
    if (dx)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in, out,
                    1.0f, dy, out, W, in, 0.0f, dx, in);
    if (dW)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, n, 1.0f,
                    dy, out, x, in, 1.0f, dW, in);
    if (db)
        for (int i = 0; i < n; i++) {
            const float *r = dy + (size_t)i * out;
            for (int j = 0; j < out; j++) db[j] += r[j];
        }
}
#endif /* MLP_ENGINE_NO_BLAS */

/* ReLU over n floats; y may equal x (in place). NaN passes through.
   Save y: the backward pass needs the output, not the input. */
static inline void mlp_relu_forward(const float *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

/* dx = dy where the saved output y > 0, else 0; dx may equal dy. */
static inline void mlp_relu_backward(const float *y, const float *dy,
                                     float *dx, size_t n) {
    for (size_t i = 0; i < n; i++) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

/* ======================================================================
   Softmax cross-entropy
   ====================================================================== */

/* Mean over the n rows of -log softmax(logits)[label] (logits n x k,
   labels < k). If dlogits is not NULL it receives
   grad_scale * (softmax(logits) - onehot(label)), overwritten. For the
   gradient of the mean over the rows given, grad_scale = 1/n; for rows
   that are part of a larger batch of B, grad_scale = 1/B. */
static inline float mlp_xent_loss(const float *logits, const uint8_t *labels,
                                  int n, int k, float *dlogits,
                                  float grad_scale) {
    double total = 0.0;
    for (int i = 0; i < n; i++) {
        const float *z = logits + (size_t)i * k;
        float m = z[0];
        for (int j = 1; j < k; j++)
            if (z[j] > m) m = z[j];
        double s = 0.0;
        for (int j = 0; j < k; j++) s += exp((double)z[j] - m);
        double lse = m + log(s);
        total += lse - z[labels[i]];
        if (dlogits) {
            float *g = dlogits + (size_t)i * k;
            for (int j = 0; j < k; j++) {
                double p = exp((double)z[j] - lse);
                g[j] = (float)(p - (j == labels[i])) * grad_scale;
            }
        }
    }
    return n > 0 ? (float)(total / n) : 0.0f;
}

/* Rows whose arg-max (first one on ties) equals the label. */
static inline int mlp_count_correct(const float *logits,
                                    const uint8_t *labels, int n, int k) {
    int correct = 0;
    for (int i = 0; i < n; i++) {
        const float *z = logits + (size_t)i * k;
        int best = 0;
        for (int j = 1; j < k; j++)
            if (z[j] > z[best]) best = j;
        correct += best == labels[i];
    }
    return correct;
}

/* ======================================================================
   Optimizers (state arrays owned by the caller, same length as params)
   ====================================================================== */

typedef struct {
    float lr, beta1, beta2, eps;
    float weight_decay; /* decoupled (AdamW): p -= lr * wd * p */
} mlp_adam_cfg;

static inline mlp_adam_cfg mlp_adam_defaults(float lr) {
    mlp_adam_cfg c = {lr, 0.9f, 0.999f, 1e-8f, 0.0f};
    return c;
}

/* One Adam step on n parameters. m, v start at zero; t is the step number
   counting from 1 (keep it with m and v in a checkpoint). */
static inline void mlp_adam_step(float *p, const float *g, float *m, float *v,
                                 size_t n, int64_t t, const mlp_adam_cfg *c) {
    float b1 = c->beta1, b2 = c->beta2;
    float bc1 = (float)(1.0 - pow((double)b1, (double)t));
    float bc2 = (float)(1.0 - pow((double)b2, (double)t));
    float step = c->lr / bc1, inv_sqrt_bc2 = 1.0f / sqrtf(bc2);
    float decay = 1.0f - c->lr * c->weight_decay;
    for (size_t i = 0; i < n; i++) {
        float mi = b1 * m[i] + (1.0f - b1) * g[i];
        float vi = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
        /* Where the gradient stays 0 (a dead ReLU unit) m decays by beta1
           every step and soon reaches the subnormal range, where x86
           arithmetic is many times slower: flush it (and v) to 0. The
           update such a value would make is far below p's precision. */
        if (fabsf(mi) < FLT_MIN) mi = 0.0f;
        if (vi < FLT_MIN) vi = 0.0f;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) * inv_sqrt_bc2 + c->eps;
        p[i] = p[i] * decay - step * mi / denom;
    }
}

/* SGD with momentum (PyTorch's form): g' = g + wd * p;
   buf = momentum * buf + g'; p -= lr * buf. buf may be NULL when
   momentum is 0; it starts at zero. */
static inline void mlp_sgd_step(float *p, const float *g, float *buf,
                                size_t n, float lr, float momentum,
                                float weight_decay) {
    for (size_t i = 0; i < n; i++) {
        float d = g[i] + weight_decay * p[i];
        if (buf) {
            buf[i] = momentum * buf[i] + d;
            d = buf[i];
        }
        p[i] -= lr * d;
    }
}

/* ======================================================================
   Seeded randomness: init, RNG, shuffling
   ====================================================================== */

/* The splitmix64 output function (Steele, Lea, Flood). */
static inline uint64_t mlp_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#define MLP_GOLDEN 0x9e3779b97f4a7c15ull

/* 64-bit FNV-1a of a NUL-terminated name. */
static inline uint64_t mlp_hash_name(const char *name) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *s = (const unsigned char *)name; *s; s++) {
        h ^= *s;
        h *= 0x100000001b3ull;
    }
    return h;
}

/* A splitmix64 generator; any state is valid. */
typedef struct {
    uint64_t s;
} mlp_rng;

static inline mlp_rng mlp_rng_seed(uint64_t seed) {
    mlp_rng r = {mlp_mix64(seed ^ MLP_GOLDEN)};
    return r;
}

static inline uint64_t mlp_rng_next(mlp_rng *r) {
    r->s += MLP_GOLDEN;
    return mlp_mix64(r->s);
}

/* Uniform in [0, bound), bound > 0, without modulo bias. */
static inline uint64_t mlp_rng_below(mlp_rng *r, uint64_t bound) {
    uint64_t threshold = (0 - bound) % bound; /* 2^64 mod bound */
    for (;;) {
        uint64_t x = mlp_rng_next(r);
        if (x >= threshold) return x % bound;
    }
}

/* 24 random bits as a float in [0, 1), exact. */
static inline float mlp_rng_float(mlp_rng *r) {
    return (float)(mlp_rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

/* Fisher-Yates shuffle of a[0..n). */
static inline void mlp_shuffle_u32(uint32_t *a, size_t n, mlp_rng *r) {
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)mlp_rng_below(r, i);
        uint32_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

/* Element `first + i` of the init stream for (name, seed) goes to p[i]:
   uniform in [-scale, scale), computed from (name, seed, index) alone,
   so a process holding a slice of a tensor can initialise just that
   slice. Each value is (k - 2^23) / 2^23 * scale with k a 24-bit integer:
   one rounded float multiply, identical on every IEEE machine. scale 0
   gives zeros. */
static inline void mlp_init_slice(float *p, size_t n, size_t first,
                                  const char *name, uint64_t seed,
                                  float scale) {
    uint64_t key = mlp_mix64(mlp_hash_name(name) ^ mlp_mix64(seed));
    for (size_t i = 0; i < n; i++) {
        uint64_t z = mlp_mix64(key + (uint64_t)(first + i + 1) * MLP_GOLDEN);
        int32_t k = (int32_t)(z >> 40) - (1 << 23);
        p[i] = (float)k * (1.0f / 8388608.0f) * scale;
    }
}

static inline void mlp_init(float *p, size_t n, const char *name,
                            uint64_t seed, float scale) {
    mlp_init_slice(p, n, 0, name, seed, scale);
}

/* Kaiming/He uniform bound for a weight feeding a ReLU: sqrt(6 / fan_in). */
static inline float mlp_kaiming_bound(int fan_in) {
    return fan_in > 0 ? sqrtf(6.0f / (float)fan_in) : 0.0f;
}

#ifndef MLP_ENGINE_NO_BLAS
/* ======================================================================
   BLAS threads
   ====================================================================== */

/* Each process should drive one core: the parallelism comes from smp's
   processes, and OpenBLAS's own threads would compete with them. Call
   once at start-up; n <= 0 means 1. (Setting OPENBLAS_NUM_THREADS=1 in
   the environment also stops OpenBLAS creating its idle threads.) */
static inline void mlp_set_blas_threads(int n) {
    openblas_set_num_threads(n > 0 ? n : 1);
}
#endif /* MLP_ENGINE_NO_BLAS */

#endif /* MLP_ENGINE_H */
