/* test_ckpt_file.c - the file layer of smp_checkpoint.h, in one process.

   Round trips of every dtype, streamed writes in odd chunk sizes, crash
   safety by fault injection in forked children, every corruption the reader
   must name, and interoperability with Python's safetensors (through
   test_ckpt_python.py, found next to this file or at $SMP_CKPT_PY).

   Build and run from the repository root:
     mpicc -std=c11 -Wall -Wextra -Werror -g test/test_ckpt_file.c -o /tmp/test_ckpt_file && /tmp/test_ckpt_file
*/
/* With -DTEST_CKPT_NO_POSIX the translation unit stays strict C11, so
   smp_checkpoint.h takes its fallbacks (lseek + read/write, /proc). */
#ifndef TEST_CKPT_NO_POSIX
#define _POSIX_C_SOURCE 200809L /* fork, mkdtemp, setenv; smp_checkpoint.h needs none */
#endif
#define SMP_TESTING /* the test hooks (smp__ckpt_*) and SMP_CKPT_FAULT */
#define SMP_IMPLEMENTATION
#include "../smp_checkpoint.h"
#include "test.h"

#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef TEST_CKPT_NO_POSIX /* what strict C11 hides from this test itself */
int setenv(const char *name, const char *value, int overwrite);
int unsetenv(const char *name);
char *mkdtemp(char *tmpl);
#endif


static char dir[256];

static void path_in(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", dir, name); }

static int err_has(const char *s) { return strstr(smp_last_error(), s) != NULL; }

/* The deterministic bytes of tensor i: shared with test_ckpt_python.py. */
static void fill(uint8_t *p, size_t n, int i, smp_dtype dt) {
    size_t k;
    for (k = 0; k < n; k++)
        p[k] = dt == SMP_BOOL ? (uint8_t)((i + k) % 3 == 0) : (uint8_t)((i * 37 + k * 11 + (k >> 8) * 5 + 1) & 0xff);
}

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    uint8_t *b;
    long len;
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    len = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    b = (uint8_t *)malloc((size_t)len + 1);
    if (fread(b, 1, (size_t)len, fp) != (size_t)len) {
        free(b);
        b = NULL;
    }
    fclose(fp);
    *n = (size_t)len;
    return b;
}

static int spit(const char *path, const void *b, size_t n) {
    FILE *fp = fopen(path, "wb");
    int ok;
    if (!fp) return 0;
    ok = fwrite(b, 1, n, fp) == n;
    return fclose(fp) == 0 && ok;
}

static int same_file(const char *a, const char *b) {
    size_t na, nb;
    uint8_t *x = slurp(a, &na), *y = slurp(b, &nb);
    int same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return same;
}

/* Count of files in dir whose name starts with prefix. */
static int count_prefix(const char *prefix) {
    DIR *d = opendir(dir);
    struct dirent *de;
    int n = 0;
    while (d && (de = readdir(d)) != NULL)
        if (!strncmp(de->d_name, prefix, strlen(prefix))) n++;
    if (d) closedir(d);
    return n;
}

/* A hand-made file: prefix + json (padded to 8) + data. */
static void write_raw(const char *path, const char *json, const void *data, size_t dlen) {
    size_t jl = strlen(json), hl = (jl + 7) / 8 * 8, k;
    uint8_t *b = (uint8_t *)calloc(1, 8 + hl + dlen + 1);
    for (k = 0; k < 8; k++) b[k] = (uint8_t)(((uint64_t)hl >> (8 * k)) & 0xff);
    memcpy(b + 8, json, jl);
    memset(b + 8 + jl, ' ', hl - jl);
    if (dlen) memcpy(b + 8 + hl, data, dlen);
    spit(path, b, 8 + hl + dlen);
    free(b);
}

/* ------------------------------------------------------------ the tensors */
#define NT 12
static smp_ckpt_entry ents[NT];
static uint8_t *datas[NT];
static size_t sizes[NT];

static void make_entries(int salt) {
    static const struct {
        const char *name;
        smp_dtype dt;
        int ndim;
        int64_t shape[4];
    } spec[NT] = {
        {"layers.0.weight", SMP_F32, 2, {3, 5}},
        {"layers.0.bias", SMP_F16, 1, {7}},
        {"emb.bf16", SMP_BF16, 3, {2, 3, 4}},
        {"f64 scalar", SMP_F64, 0, {0}},
        {"ints.i32", SMP_I32, 1, {9}},
        {"ints.i64", SMP_I64, 2, {4, 1}},
        {"bytes.u8", SMP_U8, 1, {13}},
        {"mask.bool", SMP_BOOL, 2, {3, 3}},
        {"empty.f32", SMP_F32, 1, {0}},
        {"empty.i64[3,0,2]", SMP_I64, 3, {3, 0, 2}},
        {"quote\"back\\slash/tab\tnewline\n\x01 end", SMP_F32, 1, {2}},
        {"unicod\xc3\xa9.\xe2\x98\x83.\xf0\x9f\x98\x80", SMP_U8, 1, {3}},
    };
    int i, k;
    for (i = 0; i < NT; i++) {
        size_t n = 1, es[] = {0, 4, 2, 2, 8, 4, 8, 1, 1};
        memset(&ents[i], 0, sizeof ents[i]);
        ents[i].name = spec[i].name;
        ents[i].dtype = spec[i].dt;
        ents[i].ndim = spec[i].ndim;
        for (k = 0; k < spec[i].ndim; k++) {
            ents[i].shape[k] = spec[i].shape[k];
            n *= (size_t)spec[i].shape[k];
        }
        sizes[i] = n * es[spec[i].dt];
        free(datas[i]);
        datas[i] = (uint8_t *)malloc(sizes[i] ? sizes[i] : 1);
        fill(datas[i], sizes[i], i + salt, spec[i].dt);
        ents[i].data = datas[i];
    }
}

static const char *mkeys[] = {"epoch", "step", "note \"q\" \\ \n", "\303\274ber"};
static const char *mvals[] = {"3", "12000", "multi\nline \"value\"", "gr\303\266\303\237e"};
#define NMETA 4

/* Opens path and checks it holds ents/datas exactly. */
static int check_contents(const char *path, const char **why) {
    smp_ckpt_file *f;
    int i, k, ok = 1;
    *why = "";
    if (smp_ckpt_open(path, &f) != SMP_OK) {
        *why = smp_last_error();
        return 0;
    }
    if (smp_ckpt_count(f) != NT) ok = 0, *why = "count";
    for (i = 0; ok && i < NT; i++) {
        const smp_ckpt_info *e = smp_ckpt_find(f, ents[i].name);
        uint8_t *buf = (uint8_t *)malloc(sizes[i] + 1);
        if (!e) ok = 0, *why = "find";
        else if (e->dtype != ents[i].dtype || e->ndim != ents[i].ndim || e->nbytes != sizes[i] || !e->has_checksum)
            ok = 0, *why = "info";
        for (k = 0; ok && k < e->ndim; k++)
            if (e->shape[k] != ents[i].shape[k]) ok = 0, *why = "shape";
        if (ok && smp_ckpt_read(f, e, buf, sizes[i]) != SMP_OK) ok = 0, *why = smp_last_error();
        if (ok && sizes[i] && memcmp(buf, datas[i], sizes[i])) ok = 0, *why = "bytes differ";
        if (ok && e != smp_ckpt_info_at(f, i)) ok = 0, *why = "header order";
        free(buf);
    }
    for (i = 0; ok && i < NMETA; i++)
        if (!smp_ckpt_meta(f, mkeys[i]) || strcmp(smp_ckpt_meta(f, mkeys[i]), mvals[i])) ok = 0, *why = "metadata";
    if (ok && smp_ckpt_verify_all(f) != SMP_OK) ok = 0, *why = smp_last_error();
    smp_ckpt_close(f);
    return ok;
}

/* ------------------------------------------------------------ tests */
static void test_crc(void) {
    static uint8_t buf[4096 + 64];
    size_t i, n, off;
    int ok = 1;
    CHECK(smp_ckpt_crc32c(0, "123456789", 9) == 0xE3069283u, "crc32c check value",
          "got %08x", smp_ckpt_crc32c(0, "123456789", 9));
    CHECK(smp__ckpt_crc32c_sw(0, "123456789", 9) == 0xE3069283u, "crc32c table check value", "got %08x",
          smp__ckpt_crc32c_sw(0, "123456789", 9));
    for (i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)(i * 2654435761u >> 13);
    for (off = 0; off < 9 && ok; off++)
        for (n = 0; n < 300 && ok; n += 1 + n / 7) {
            uint32_t a = smp_ckpt_crc32c(0, buf + off, n), b = smp__ckpt_crc32c_sw(0, buf + off, n);
            uint32_t c = smp_ckpt_crc32c(smp_ckpt_crc32c(0, buf + off, n / 3), buf + off + n / 3, n - n / 3);
            if (a != b || a != c) ok = 0;
        }
    CHECK(ok, "crc32c fast == table == incremental at every alignment", "mismatch");
    { /* long buffers: the fast path's three-lane blocks and their joins */
        size_t big = 200000;
        uint8_t *b = (uint8_t *)malloc(big + 16);
        for (i = 0; i < big + 16; i++) b[i] = (uint8_t)((i * 2654435761u) >> 11);
        ok = 1;
        for (off = 0; off < 16 && ok; off += 5)
            for (n = 12290; n < big && ok; n = n * 2 + 7) { /* 12290, 24587, 49181, 98369, 196745 */
                uint32_t a = smp_ckpt_crc32c(0, b + off, n), s2 = smp__ckpt_crc32c_sw(0, b + off, n);
                uint32_t c = smp_ckpt_crc32c(smp_ckpt_crc32c(0, b + off, n - 12289), b + off + n - 12289, 12289);
                if (a != s2 || a != c) ok = 0;
            }
        CHECK(ok, "crc32c fast == table on long buffers (multi-lane blocks)", "mismatch");
        free(b);
    }
    { /* iSCSI's test vectors (RFC 3720, B.4) */
        uint8_t v[32];
        uint32_t got[4];
        memset(v, 0, 32);
        got[0] = smp_ckpt_crc32c(0, v, 32);
        memset(v, 0xff, 32);
        got[1] = smp_ckpt_crc32c(0, v, 32);
        for (i = 0; i < 32; i++) v[i] = (uint8_t)i;
        got[2] = smp_ckpt_crc32c(0, v, 32);
        for (i = 0; i < 32; i++) v[i] = (uint8_t)(31 - i);
        got[3] = smp_ckpt_crc32c(0, v, 32);
        CHECK(got[0] == 0x8a9136aau && got[1] == 0x62a8ab43u && got[2] == 0x46dd794eu && got[3] == 0x113fdb5cu,
              "crc32c RFC 3720 vectors", "got %08x %08x %08x %08x", (unsigned)got[0], (unsigned)got[1],
              (unsigned)got[2], (unsigned)got[3]);
    }
    { /* random lengths and alignments up to a few hundred KiB, where the fast
         path prefetches the next block or, in its last block, does not */
        size_t big = 400000;
        uint8_t *b = (uint8_t *)malloc(big + 64);
        uint64_t s = 99;
        char why[160] = "";
        int k;
        for (i = 0; i < big + 64; i++) b[i] = (uint8_t)(smp_rng_uniform(&s) * 256);
        ok = 1;
        for (k = 0; k < 300 && ok; k++) {
            size_t o = (size_t)(smp_rng_uniform(&s) * 64);
            size_t len = k < 9 ? (size_t)(6 * 4096 - 4 + k) : (size_t)(smp_rng_uniform(&s) * (double)big);
            uint32_t a = smp_ckpt_crc32c(0, b + o, len), t = smp__ckpt_crc32c_sw(0, b + o, len);
            if (a != t) {
                ok = 0;
                snprintf(why, sizeof why, "offset %zu length %zu: %08x, table %08x", o, len, (unsigned)a, (unsigned)t);
            }
        }
        CHECK(ok, "crc32c fast == table at random lengths and alignments", "%s", why);
        free(b);
    }
}

/* The load's copy into host tensors (streaming stores for large ones): every
   byte at any alignment, and nothing outside the destination. */
static void test_copy_in(void) {
    size_t cap = ((size_t)1 << 20) + 4096, i;
    uint8_t *src = (uint8_t *)malloc(cap + 128), *dst = (uint8_t *)malloc(cap + 256);
    static const size_t lens[] = {0, 1, 63, 64, 4097, ((size_t)1 << 20) - 1, (size_t)1 << 20, ((size_t)1 << 20) + 1,
                                  ((size_t)1 << 20) + 63, ((size_t)1 << 20) + 4095};
    size_t so, d, li;
    char why[160] = "";
    int ok = 1;
    for (i = 0; i < cap + 128; i++) src[i] = (uint8_t)(i * 2654435761u >> 9);
    for (li = 0; li < sizeof lens / sizeof lens[0] && ok; li++)
        for (so = 0; so < 3 && ok; so++)
            for (d = 0; d < 70 && ok; d += 13) {
                size_t n = lens[li];
                memset(dst, 0xa5, cap + 256);
                smp__ckpt_copy_in_host(dst + 64 + d, src + so * 17, n);
                if (memcmp(dst + 64 + d, src + so * 17, n)) ok = 0;
                for (i = 0; i < 64 + d && ok; i++) ok = dst[i] == 0xa5;
                for (i = 64 + d + n; i < cap + 256 && ok; i++) ok = dst[i] == 0xa5;
                if (!ok) snprintf(why, sizeof why, "length %zu, dst +%zu, src +%zu", n, d, so * 17);
            }
    CHECK(ok, "load copy: every byte at every alignment, nothing outside", "%s", why);
    free(src);
    free(dst);
}

static void test_roundtrip(void) {
    char p[512], p2[512];
    const char *why;
    smp_ckpt_file *f;
    size_t total = 0, n2, i, off, c;
    uint8_t *all, *img;
    static const size_t chunks[] = {1, 3, 7, 4093, 2, 65537, 5, 11};
    smp_ckpt_writer *w;
    int ci, ok;

    make_entries(0);
    path_in(p, sizeof p, "rt.safetensors");
    CHECK(smp_ckpt_write_file(p, ents, NT, mkeys, mvals, NMETA) == SMP_OK, "write_file every dtype", "%s",
          smp_last_error());
    CHECK(check_contents(p, &why), "round trip bitwise: every dtype, scalar, empty, escaped names, metadata", "%s",
          why);
    CHECK(count_prefix("rt.safetensors.tmp.") == 0, "no tmp file after a save", "stray tmp");

    /* the same tensors streamed in odd chunks give the same file */
    for (i = 0; i < NT; i++) total += sizes[i];
    all = (uint8_t *)malloc(total);
    for (off = 0, i = 0; i < NT; i++) {
        memcpy(all + off, datas[i], sizes[i]);
        off += sizes[i];
    }
    path_in(p2, sizeof p2, "rt2.safetensors");
    ok = smp_ckpt_writer_open(p2, ents, NT, mkeys, mvals, NMETA, &w) == SMP_OK;
    for (off = 0, ci = 0; ok && off < total; off += c, ci++) {
        c = chunks[ci % 8];
        if (c > total - off) c = total - off;
        ok = smp_ckpt_writer_write(w, all + off, c) == SMP_OK;
    }
    ok = ok && smp_ckpt_writer_remaining(w) == 0 && smp_ckpt_writer_commit(w) == SMP_OK;
    CHECK(ok && same_file(p, p2), "streamed writes of odd chunk sizes give the identical file", "%s",
          ok ? "files differ" : smp_last_error());
    free(all);

    /* big tensor through the writer's buffer, chunks straddling it */
    {
        smp_ckpt_entry big[2];
        size_t nb = (3u << 20) + 13, got;
        uint8_t *d = (uint8_t *)malloc(nb), *r = (uint8_t *)malloc(nb);
        uint32_t crc = 0;
        const smp_ckpt_info *e;
        memset(big, 0, sizeof big);
        big[0].name = "big";
        big[0].dtype = SMP_U8;
        big[0].ndim = 1;
        big[0].shape[0] = (int64_t)nb;
        big[1].name = "tail";
        big[1].dtype = SMP_I64;
        big[1].ndim = 1;
        big[1].shape[0] = 3;
        fill(d, nb, 5, SMP_U8);
        path_in(p2, sizeof p2, "big.safetensors");
        ok = smp_ckpt_writer_open(p2, big, 2, NULL, NULL, 0, &w) == SMP_OK;
        for (off = 0, ci = 0; ok && off < nb; off += c, ci++) {
            c = ci % 2 ? (1u << 20) + 7 : 333333;
            if (c > nb - off) c = nb - off;
            ok = smp_ckpt_writer_write(w, d + off, c) == SMP_OK;
        }
        ok = ok && smp_ckpt_writer_write(w, d, 24) == SMP_OK && smp_ckpt_writer_commit(w) == SMP_OK;
        ok = ok && smp_ckpt_open(p2, &f) == SMP_OK;
        if (ok) {
            e = smp_ckpt_find(f, "big");
            for (got = 0; ok && e && got < nb; got += c) {
                c = nb - got < 100003 ? nb - got : 100003;
                ok = smp_ckpt_read_range(f, e, got, r + got, c) == SMP_OK;
                crc = smp_ckpt_crc32c(crc, r + got, c);
            }
            ok = ok && e && crc == e->checksum && memcmp(d, r, nb) == 0 && smp_ckpt_verify_all(f) == SMP_OK;
            smp_ckpt_close(f);
        }
        CHECK(ok, "3 MiB tensor streamed in 1 MiB+7 chunks, read back in ranges", "%s", smp_last_error());
        free(d);
        free(r);
    }

    /* an in-memory image validates and reads the same */
    img = slurp(p, &n2);
    ok = img && smp__ckpt_open_memory(&f, "image", img, n2) == SMP_OK;
    if (ok) {
        ok = smp_ckpt_count(f) == NT && smp_ckpt_verify_all(f) == SMP_OK;
        smp_ckpt_close(f);
    }
    CHECK(ok, "memory image of a file validates", "%s", smp_last_error());
    free(img);

    /* no tensors, no metadata */
    path_in(p2, sizeof p2, "empty.safetensors");
    ok = smp_ckpt_write_file(p2, NULL, 0, NULL, NULL, 0) == SMP_OK && smp_ckpt_open(p2, &f) == SMP_OK;
    if (ok) {
        ok = smp_ckpt_count(f) == 0 && smp_ckpt_meta_count(f) == 0;
        smp_ckpt_close(f);
    }
    CHECK(ok, "a file with no tensors", "%s", smp_last_error());

    /* an entry made from a tensor describes it and writes its bytes; the open
       file knows its path */
    double vals[6] = {1.5, -2, 3.25, 0, 1e300, -0.0};
    smp_tensor t = smp_tensor_2d(vals, SMP_F64, 2, 3);
    smp_ckpt_entry e = smp_ckpt_entry_of("block.w", &t);
    ok = !strcmp(e.name, "block.w") && e.dtype == SMP_F64 && e.ndim == 2 && e.shape[0] == 2 && e.shape[1] == 3 &&
         e.data == vals;
    path_in(p2, sizeof p2, "entry_of.safetensors");
    ok = ok && smp_ckpt_write_file(p2, &e, 1, NULL, NULL, 0) == SMP_OK && smp_ckpt_open(p2, &f) == SMP_OK;
    if (ok) {
        const smp_ckpt_info *in = smp_ckpt_find(f, "block.w");
        double back[6];
        ok = !strcmp(smp_ckpt_path(f), p2) && in && in->dtype == SMP_F64 && in->ndim == 2 && in->shape[0] == 2 &&
             in->shape[1] == 3 && smp_ckpt_read(f, in, back, sizeof back) == SMP_OK && !memcmp(back, vals, sizeof vals);
        smp_ckpt_close(f);
    }
    CHECK(ok, "smp_ckpt_entry_of: a tensor's name, dtype, shape and bytes round trip; smp_ckpt_path names the file",
          "%s", smp_last_error());
}

static void test_writer_misuse(void) {
    char p[512];
    smp_ckpt_writer *w;
    smp_status st;
    smp_ckpt_entry two[2];
    static const char *bad_key[] = {"smp.checksum.x"}, *v[] = {"1"};
    static const char *dup_key[] = {"a", "a"}, *dup_val[] = {"1", "2"};
    uint8_t b[64] = {0};

    make_entries(0);
    path_in(p, sizeof p, "misuse.safetensors");
    smp_ckpt_write_file(p, ents, NT, mkeys, mvals, NMETA);

    memset(two, 0, sizeof two);
    two[0].name = two[1].name = "same";
    two[0].dtype = two[1].dtype = SMP_F32;
    st = smp_ckpt_writer_open(p, two, 2, NULL, NULL, 0, &w);
    CHECK(st == SMP_ERR_ARG && err_has("'same'") && err_has("two entries"), "writer rejects duplicate names", "%d %s",
          st, smp_last_error());
    two[1].name = "other";
    two[1].dtype = SMP_DTYPE_INVALID;
    st = smp_ckpt_writer_open(p, two, 2, NULL, NULL, 0, &w);
    CHECK(st == SMP_ERR_ARG && err_has("invalid dtype"), "writer rejects an invalid dtype", "%s", smp_last_error());
    two[1].dtype = SMP_F32;
    two[1].ndim = 1;
    two[1].shape[0] = -2;
    st = smp_ckpt_writer_open(p, two, 2, NULL, NULL, 0, &w);
    CHECK(st == SMP_ERR_ARG && err_has("negative"), "writer rejects a negative dimension", "%s", smp_last_error());
    st = smp_ckpt_writer_open(p, ents, 1, bad_key, v, 1, &w);
    CHECK(st == SMP_ERR_ARG && err_has("reserved"), "writer rejects reserved metadata keys", "%s", smp_last_error());
    st = smp_ckpt_writer_open(p, ents, 1, dup_key, dup_val, 2, &w);
    CHECK(st == SMP_ERR_ARG && err_has("'a' appears twice"), "writer rejects duplicate metadata keys", "%s",
          smp_last_error());
    two[1].name = "bad\xff utf8";
    two[1].shape[0] = 1;
    st = smp_ckpt_writer_open(p, two, 2, NULL, NULL, 0, &w);
    CHECK(st == SMP_ERR_ARG && err_has("UTF-8"), "writer rejects names that are not UTF-8", "%s", smp_last_error());
    setenv("SMP_CKPT_FAULT", "sometimes", 1);
    st = smp_ckpt_writer_open(p, ents, 1, NULL, NULL, 0, &w);
    unsetenv("SMP_CKPT_FAULT");
    CHECK(st == SMP_ERR_ARG && err_has("SMP_CKPT_FAULT"), "an unknown SMP_CKPT_FAULT is an error", "%s",
          smp_last_error());

    /* too many bytes; then commit repeats the error and saves nothing */
    st = smp_ckpt_writer_open(p, ents, 1, NULL, NULL, 0, &w); /* 60 bytes */
    if (st == SMP_OK) {
        smp_ckpt_writer_write(w, b, 40);
        st = smp_ckpt_writer_write(w, b, 40);
        CHECK(st == SMP_ERR_ARG && err_has("more than the entries declare"), "writing too many bytes is an error",
              "%s", smp_last_error());
        st = smp_ckpt_writer_commit(w);
        CHECK(st == SMP_ERR_ARG && err_has("more than"), "commit after a failed write repeats its error", "%s",
              smp_last_error());
    }
    /* too few bytes */
    st = smp_ckpt_writer_open(p, ents, 3, NULL, NULL, 0, &w);
    if (st == SMP_OK) {
        smp_ckpt_writer_write(w, datas[0], sizes[0]);
        smp_ckpt_writer_write(w, datas[1], 3);
        st = smp_ckpt_writer_commit(w);
        CHECK(st == SMP_ERR_ARG && err_has("'layers.0.bias' has 3 of its 14 bytes"),
              "commit with missing bytes names the tensor", "%s", smp_last_error());
    }
    /* abort */
    st = smp_ckpt_writer_open(p, ents, 1, NULL, NULL, 0, &w);
    if (st == SMP_OK) {
        smp_ckpt_writer_write(w, b, 10);
        smp_ckpt_writer_abort(w);
    }
    {
        const char *why;
        CHECK(check_contents(p, &why) && count_prefix("misuse.safetensors.tmp.") == 0,
              "failed and aborted saves leave the old file and no tmp file", "%s", why);
    }
}

/* The child's log: where the fault says that it fired. */
static void child_logger(smp_log_level level, const char *msg, void *user) {
    FILE *f = fopen((const char *)user, "a");
    (void)level;
    if (f) {
        fprintf(f, "%s\n", msg);
        fclose(f);
    }
}

/* Whether file `path` holds `needle`. */
static int file_has(const char *path, const char *needle) {
    size_t n;
    uint8_t *b = slurp(path, &n);
    int found = b && strstr((const char *)b, needle) != NULL;
    free(b);
    return found;
}

/* Saves a new checkpoint over `p` in a child that dies at `phase`; its
   log goes to `log`. */
static int child_save(const char *p, const char *phase, const char *log, pid_t *pid_out) {
    pid_t pid;
    int status;
    fflush(stdout);
    remove(log);
    pid = fork();
    if (pid == 0) {
        smp_ckpt_writer *w;
        int i;
        smp_set_logger(child_logger, (void *)log);
        setenv("SMP_CKPT_FAULT", phase, 1);
        make_entries(1); /* different bytes */
        if (smp_ckpt_writer_open(p, ents, NT, mkeys, mvals, NMETA, &w) != SMP_OK) _exit(2);
        for (i = 0; i < NT; i++)
            if (smp_ckpt_writer_write(w, datas[i], sizes[i]) != SMP_OK) _exit(3);
        if (smp_ckpt_writer_commit(w) != SMP_OK) _exit(4);
        _exit(0); /* the fault did not fire */
    }
    *pid_out = pid;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_faults(void) {
    static const char *phases[] = {"header", "data", "flush", "rename", "dirsync"};
    /* the phases of a partial model save (smp_save) never fire in a file write */
    static const char *model_phases[] = {"renamed", "manifest", "commit", "cleanup"};
    char p[512], old_copy[512], name[128], tmp[640], log[512], line[128];
    int i;
    path_in(log, sizeof log, "fault_child.log");
    for (i = 0; i < 5; i++) {
        const char *why = "";
        pid_t pid = 0;
        int rc, ok, tmp_left, want_new = !strcmp(phases[i], "dirsync");
        struct stat sb;
        snprintf(name, sizeof name, "fault_%s.safetensors", phases[i]);
        path_in(p, sizeof p, name);
        path_in(old_copy, sizeof old_copy, "fault_old_copy");
        make_entries(0);
        smp_ckpt_write_file(p, ents, NT, mkeys, mvals, NMETA);
        smp_ckpt_write_file(old_copy, ents, NT, mkeys, mvals, NMETA);
        rc = child_save(p, phases[i], log, &pid);
        snprintf(name, sizeof name, "fault %s: the child dies with 77, saying so", phases[i]);
        snprintf(line, sizeof line, "SMP_CKPT_FAULT=%s: test fault injection", phases[i]);
        CHECK(rc == 77 && file_has(log, line), name, "exit status %d, %s", rc,
              file_has(log, line) ? "logged" : "no log line");

        make_entries(want_new ? 1 : 0);
        ok = check_contents(p, &why);
        snprintf(name, sizeof name, "fault %s: the file is loadable and holds the %s checkpoint bitwise", phases[i],
                 want_new ? "new" : "old");
        CHECK(ok && (want_new || same_file(p, old_copy)), name, "%s", why);

        snprintf(tmp, sizeof tmp, "%s.tmp.%ld", p, (long)pid);
        tmp_left = stat(tmp, &sb) == 0;
        snprintf(name, sizeof name, "fault %s: only the child's tmp file is left over", phases[i]);
        snprintf(tmp, sizeof tmp, "fault_%s.safetensors", phases[i]);
        CHECK(count_prefix(tmp) == 1 + tmp_left && tmp_left == !want_new, name, "%d files, tmp %s", count_prefix(tmp),
              tmp_left ? "present" : "absent");

        /* the next save cleans up after the dead child */
        make_entries(2);
        ok = smp_ckpt_write_file(p, ents, NT, mkeys, mvals, NMETA) == SMP_OK && check_contents(p, &why);
        snprintf(name, sizeof name, "fault %s: the next save succeeds and removes the stale tmp file", phases[i]);
        CHECK(ok && count_prefix(tmp) == 1, name, "%s; %d files", why, count_prefix(tmp));
    }
    for (i = 0; i < 4; i++) {
        const char *why = "";
        pid_t pid = 0;
        int rc;
        path_in(p, sizeof p, "fault_model_phase.safetensors");
        make_entries(0);
        smp_ckpt_write_file(p, ents, NT, mkeys, mvals, NMETA);
        rc = child_save(p, model_phases[i], log, &pid);
        make_entries(1);
        snprintf(name, sizeof name, "fault %s (a phase of partial model saves) does not fire in a file write",
                 model_phases[i]);
        CHECK(rc == 0 && check_contents(p, &why) && count_prefix("fault_model_phase.safetensors") == 1, name,
              "exit status %d; %s; %d files", rc, why, count_prefix("fault_model_phase.safetensors"));
    }
}

/* Expects opening `path` to fail with SMP_ERR_FORMAT and a message holding
   every one of the (NULL-terminated) needles and the path. */
static void expect_format(const char *test, const char *path, ...) {
    smp_ckpt_file *f = NULL;
    smp_status st = smp_ckpt_open(path, &f);
    va_list ap;
    const char *needle, *missing = NULL;
    va_start(ap, path);
    while ((needle = va_arg(ap, const char *)) != NULL)
        if (!missing && !err_has(needle)) missing = needle;
    va_end(ap);
    if (!missing && !err_has(path)) missing = path;
    CHECK(st == SMP_ERR_FORMAT && !missing && !f, test, "status %d, message \"%s\" lacks \"%s\"", (int)st,
          smp_last_error(), missing ? missing : "");
    if (f) smp_ckpt_close(f);
}

static void test_corruption(void) {
    char p[512], q[512];
    uint8_t *img, d[64];
    size_t n, hl;
    smp_ckpt_file *f;
    const smp_ckpt_info *e;
    uint8_t buf[256];
    smp_status st;
    int k;

    make_entries(0);
    path_in(p, sizeof p, "good.safetensors");
    smp_ckpt_write_file(p, ents, NT, mkeys, mvals, NMETA);
    img = slurp(p, &n);
    for (hl = 0, k = 7; k >= 0; k--) hl = (hl << 8) | img[k];
    path_in(q, sizeof q, "bad.safetensors");

    /* a flipped byte in the data of ints.i32 */
    {
        uint64_t at = 0;
        if (smp_ckpt_open(p, &f) == SMP_OK) {
            at = 8 + hl + smp_ckpt_find(f, "ints.i32")->offset + 5;
            smp_ckpt_close(f);
        }
        img[at] ^= 0x10;
        spit(q, img, n);
        img[at] ^= 0x10;
    }
    st = smp_ckpt_open(q, &f);
    CHECK(st == SMP_OK, "a flipped data byte still opens (header intact)", "%s", smp_last_error());
    if (st == SMP_OK) {
        e = smp_ckpt_find(f, "ints.i32");
        st = smp_ckpt_read(f, e, buf, sizeof buf);
        CHECK(st == SMP_ERR_FORMAT && err_has("tensor 'ints.i32'") && err_has("checksum mismatch") && err_has(q),
              "flipped data byte: read names the tensor and the checksum", "%s", smp_last_error());
        st = smp_ckpt_verify_all(f);
        CHECK(st == SMP_ERR_FORMAT && err_has("tensor 'ints.i32'") && err_has("checksum mismatch"),
              "flipped data byte: verify_all finds it", "%s", smp_last_error());
        e = smp_ckpt_find(f, "bytes.u8");
        CHECK(smp_ckpt_read(f, e, buf, sizeof buf) == SMP_OK, "flipped data byte: other tensors still read", "%s",
              smp_last_error());
        st = smp_ckpt_read(f, e, buf, 4);
        CHECK(st == SMP_ERR_ARG && err_has("cannot hold"), "read into a too-small buffer is an error", "%s",
              smp_last_error());
        st = smp_ckpt_read_range(f, e, 10, buf, 4);
        CHECK(st == SMP_ERR_ARG && err_has("outside"), "read_range past the tensor is an error", "%s",
              smp_last_error());
        e = smp_ckpt_find(f, "no.such.tensor");
        CHECK(!e && err_has("tensor 'no.such.tensor'") && err_has("no tensor of that name") && err_has(q),
              "looking up a missing tensor names it", "%s", smp_last_error());
        smp_ckpt_close(f);
    }

    /* truncations */
    spit(q, img, n - 5);
    expect_format("truncated data: the last tensor runs past the end", q, "run past the end of the data section",
                  "tensor '", NULL);
    spit(q, img, 5);
    expect_format("file shorter than 8 bytes", q, "5 bytes, shorter than the 8-byte", NULL);
    spit(q, img, 8 + hl / 2);
    expect_format("truncated header: header length larger than the file", q, "is larger than the file", NULL);
    img[6] = 0x01; /* header length + 2^48 */
    spit(q, img, n);
    img[6] = 0;
    expect_format("header length larger than the file", q, "header length 281474976", "larger than the file", NULL);
    {
        static const char *keys[] = {"k"}, *vals[] = {"v"};
        smp_status s2 = smp_ckpt_write_file(q, NULL, 0, keys, vals, 1);
        CHECK(s2 == SMP_OK && smp_ckpt_open(q, &f) == SMP_OK, "sanity: metadata-only file", "%s", smp_last_error());
        if (s2 == SMP_OK && f) smp_ckpt_close(f);
    }

    memset(d, 0xab, sizeof d);
    /* hand-made headers */
    write_raw(q, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,80]}}", d, 8);
    expect_format("offsets out of bounds", q, "tensor 'a'", "data_offsets [0, 80] run past the end", NULL);
    write_raw(q, "{\"w\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", d, 8);
    expect_format("wrong dtype string", q, "tensor 'w'", "dtype \"F33\" is not one smp reads", NULL);
    write_raw(q, "{\"w\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[0,2]}}", d, 2);
    expect_format("valid safetensors dtype smp does not read", q, "dtype \"I8\"", NULL);
    write_raw(q, "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", d, 8);
    expect_format("shape that does not match the bytes", q, "tensor 'w'",
                  "shape [3] of F32 is 12 bytes, but data_offsets [0, 8] span 8", NULL);
    write_raw(q, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", d, 8);
    expect_format("offsets running backwards", q, "tensor 'w'", "run backwards", NULL);
    write_raw(q,
              "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
              "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
              d, 12);
    expect_format("overlapping offsets", q, "tensor 'b'", "overlap tensor 'a' [0, 8]", NULL);
    write_raw(q,
              "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
              "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
              d, 12);
    expect_format("a gap between tensors", q, "bytes [4, 8) of the data section belong to no tensor", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", d, 12);
    expect_format("data past the last tensor", q, "data section is 12 bytes but the tensors cover only the first 4",
                  NULL);
    write_raw(q,
              "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
              "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
              d, 8);
    expect_format("duplicate tensor names", q, "tensor 'a'", "appears twice", NULL);
    write_raw(q, "{\"__metadata__\":{\"epoch\":3}}", d, 0);
    expect_format("non-string metadata", q, "metadata key 'epoch' is not a string", NULL);
    write_raw(q, "{\"__metadata__\":{\"a\":\"1\",\"a\":\"2\"}}", d, 0);
    expect_format("duplicate metadata keys", q, "metadata key 'a' appears twice", NULL);
    write_raw(q, "{\"__metadata__\":{\"smp.checksum.b\":\"crc32c:00000000\"},"
                 "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("checksum of a tensor that is not there", q, "tensor 'b'", "no such tensor", NULL);
    write_raw(q, "{\"__metadata__\":{\"smp.checksum.a\":\"crc32c:0000XYZ0\"},"
                 "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("malformed checksum", q, "tensor 'a'", "8 lowercase hex digits", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("more than SMP_MAX_DIMS dimensions", q, "tensor 'a'", "more than 8 dimensions", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"extra\":1}}", d, 1);
    expect_format("unknown key in a tensor", q, "tensor 'a'", "unknown key \"extra\"", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", d, 1);
    expect_format("missing data_offsets", q, "tensor 'a'", "has no \"data_offsets\"", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[99999999999999999999],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("dimension too large", q, "tensor 'a'", "does not fit in 63 bits", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("shape whose element count overflows", q, "tensor 'a'", "overflows", NULL);

    /* bad JSON */
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},}", d, 1);
    expect_format("bad JSON: trailing comma", q, "malformed JSON header", "expected a tensor name", NULL);
    write_raw(q, "{\"a\" {\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("bad JSON: missing colon", q, "malformed JSON header", "expected ':' after name 'a'", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}", d, 1);
    expect_format("bad JSON: unclosed object", q, "malformed JSON header", "expected ',' or '}'", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[01],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("bad JSON: leading zero", q, "leading zero", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("bad JSON: negative dimension", q, "must not be negative", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1.0],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("bad JSON: fractional dimension", q, "must be an integer", NULL);
    write_raw(q, "{\"a\":{\"dtype\":{\"x\":[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]}}}", d, 0);
    expect_format("bad JSON: nesting where a string belongs", q, "expected the dtype in double quotes", NULL);
    write_raw(q, "{\"a\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("bad JSON: invalid UTF-8", q, "invalid UTF-8", NULL);
    write_raw(q, "{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("bad JSON: \\u0000 in a name", q, "\\u0000", NULL);
    write_raw(q, "{\"a\\ud800\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", d, 1);
    expect_format("bad JSON: lone surrogate", q, "surrogate", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}} x", d, 1);
    expect_format("bad JSON: text after the object", q, "only spaces may follow", NULL);
    write_raw(q, " {}", d, 0);
    expect_format("bad JSON: header not starting with '{'", q, "must start with '{'", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}, \"b\": \"x\"}", d, 1);
    expect_format("bad JSON: a tensor that is not an object", q, "tensor 'b'", "expected '{'", NULL);
    write_raw(q, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}, \"b\": nul", d, 1);
    expect_format("bad JSON: truncated literal", q, "malformed JSON", NULL);
    write_raw(q, "{\"a\\tb\\u00e9\\ud83d\\ude00\\\"\\/\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}\n\t ",
              d, 1);
    st = smp_ckpt_open(q, &f);
    CHECK(st == SMP_OK && smp_ckpt_find(f, "a\tb\xc3\xa9\xf0\x9f\x98\x80\"/") != NULL,
          "escapes in names decode (\\t, \\u00e9, surrogate pair, \\\", \\/)", "%s", smp_last_error());
    if (st == SMP_OK) smp_ckpt_close(f);

    st = smp_ckpt_open("/nonexistent/dir/x.safetensors", &f);
    CHECK(st == SMP_ERR_IO && err_has("/nonexistent/dir/x.safetensors"), "a missing file is an IO error", "%s",
          smp_last_error());
    free(img);
}

/* The script beside this file (or $SMP_CKPT_PY). */
static const char *python_script(void) {
    static char path[1024];
    const char *env = getenv("SMP_CKPT_PY"), *slash;
    if (env) return env;
    slash = strrchr(__FILE__, '/');
    if (slash) snprintf(path, sizeof path, "%.*s/test_ckpt_python.py", (int)(slash - __FILE__), __FILE__);
    else snprintf(path, sizeof path, "test_ckpt_python.py");
    return path;
}

static void test_python(void) {
    char np_path[512], all_path[512], py_path[512], cmd[4096];
    const char *script = python_script();
    smp_ckpt_entry e[8];
    static const smp_dtype np_types[] = {SMP_F32, SMP_F16, SMP_F64, SMP_I32, SMP_I64, SMP_U8, SMP_BOOL};
    static const char *keys[] = {"smp.test", "epoch"}, *vals[] = {"python interop", "7"};
    static uint8_t bufs[8][256];
    float vf[10];
    int64_t vi[6];
    int i, rc;
    smp_ckpt_file *f;

    if (access(script, R_OK) != 0) {
        test_skip("python safetensors interop", "test_ckpt_python.py not found (set SMP_CKPT_PY)");
        return;
    }
    /* numpy dtypes: t<i> with shape [i+1, 3] filled by fill(); plus values */
    memset(e, 0, sizeof e);
    for (i = 0; i < 7; i++) {
        static char names[7][16];
        snprintf(names[i], sizeof names[i], "t%d", i);
        e[i].name = names[i];
        e[i].dtype = np_types[i];
        e[i].ndim = 2;
        e[i].shape[0] = i + 1;
        e[i].shape[1] = 3;
        fill(bufs[i], (size_t)(i + 1) * 3 * (np_types[i] == SMP_F64 || np_types[i] == SMP_I64 ? 8
                                              : np_types[i] == SMP_F32 || np_types[i] == SMP_I32 ? 4
                                              : np_types[i] == SMP_F16                            ? 2
                                                                                                  : 1),
             i, np_types[i]);
        e[i].data = bufs[i];
    }
    path_in(np_path, sizeof np_path, "py_numpy.safetensors");
    CHECK(smp_ckpt_write_file(np_path, e, 7, keys, vals, 2) == SMP_OK, "python: write numpy-dtype file", "%s",
          smp_last_error());
    /* every dtype incl. BF16 (numpy has none; checked through deserialize) */
    make_entries(0);
    path_in(all_path, sizeof all_path, "py_all.safetensors");
    CHECK(smp_ckpt_write_file(all_path, ents, NT, mkeys, mvals, NMETA) == SMP_OK, "python: write every-dtype file",
          "%s", smp_last_error());
    /* values with meaning: f32 j*0.5-3, i64 j*1000003-7 */
    {
        smp_ckpt_entry v[2];
        char vpath[512];
        for (i = 0; i < 10; i++) vf[i] = (float)i * 0.5f - 3.0f;
        for (i = 0; i < 6; i++) vi[i] = (int64_t)i * 1000003 - 7;
        memset(v, 0, sizeof v);
        v[0].name = "values.f32";
        v[0].dtype = SMP_F32;
        v[0].ndim = 2;
        v[0].shape[0] = 2;
        v[0].shape[1] = 5;
        v[0].data = vf;
        v[1].name = "values.i64";
        v[1].dtype = SMP_I64;
        v[1].ndim = 1;
        v[1].shape[0] = 6;
        v[1].data = vi;
        path_in(vpath, sizeof vpath, "py_values.safetensors");
        smp_ckpt_write_file(vpath, v, 2, NULL, NULL, 0);
    }
    path_in(py_path, sizeof py_path, "from_python.safetensors");
    snprintf(cmd, sizeof cmd, "python3 '%s' '%s'", script, dir);
    fflush(stdout);
    rc = system(cmd);
    rc = rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    if (rc == 3) test__failed_total++; /* the script printed its FAIL lines */
    else if (rc != 0) CHECK(0, "python: test_ckpt_python.py ran", "exit status %d (%s)", rc, cmd);

    /* read what Python's safetensors wrote (no smp checksums) */
    if (access(py_path, R_OK) != 0) {
        test_skip("python: smp reads a file written by safetensors", "the script wrote no file");
        return;
    }
    rc = smp_ckpt_open(py_path, &f) == SMP_OK;
    if (rc) {
        const smp_ckpt_info *a = smp_ckpt_find(f, "py.f32"), *b = smp_ckpt_find(f, "py.i64"),
                            *c = smp_ckpt_find(f, "py.bool"), *z = smp_ckpt_find(f, "py.empty");
        float fa[12];
        int64_t ib[4];
        uint8_t bc[3];
        rc = a && b && c && z && !a->has_checksum && a->ndim == 2 && a->shape[0] == 3 && a->shape[1] == 4 &&
             z->nbytes == 0 && z->shape[0] == 0 && smp_ckpt_read(f, a, fa, sizeof fa) == SMP_OK &&
             smp_ckpt_read(f, b, ib, sizeof ib) == SMP_OK && smp_ckpt_read(f, c, bc, sizeof bc) == SMP_OK &&
             smp_ckpt_verify_all(f) == SMP_OK && smp_ckpt_meta(f, "framework") &&
             !strcmp(smp_ckpt_meta(f, "framework"), "numpy");
        for (i = 0; rc && i < 12; i++) rc = fa[i] == (float)i * 0.25f;
        rc = rc && ib[0] == -5 && ib[1] == 0 && ib[2] == 7 && ib[3] == ((int64_t)1 << 40);
        rc = rc && bc[0] == 1 && bc[1] == 0 && bc[2] == 1;
        smp_ckpt_close(f);
    }
    CHECK(rc, "python: smp reads a file written by safetensors.numpy.save_file", "%s", smp_last_error());
}

int main(void) {
    snprintf(dir, sizeof dir, "%s/smp_ckpt_test.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(dir)) {
        printf("FAIL: test_ckpt_file: cannot create a temporary folder: %s\n", strerror(errno));
        return 1;
    }
    test_crc();
    test_copy_in();
    test_roundtrip();
    test_writer_misuse();
    test_faults();
    test_corruption();
    test_python();
    if (!test__failed_total) {
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) printf("(could not remove %s)\n", dir);
    } else {
        printf("(files kept in %s)\n", dir);
    }
    for (int i = 0; i < NT; i++) free(datas[i]);
    (void)test_mpi_check; /* test.h's MPI helper; this test is single-process */
    return test_exit_code();
}
