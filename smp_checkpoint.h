/* smp_checkpoint.h - checkpoint files for smp: named tensors in safetensors.

   This part is the file layer: it writes and reads one safetensors file of
   named tensors, crash-safely and with a checksum per tensor. The model-level
   save/load (partial and full checkpoints over MPI, resharding) is built on
   top of it further down this header.

   USAGE
     In exactly one C file:
         #define SMP_IMPLEMENTATION
         #include "smp_checkpoint.h"      // includes smp.h
     Everywhere else include "smp_checkpoint.h" for the declarations only.
     Build: mpicc -std=c11 -O2 prog.c -o prog -lm   (POSIX + libc, no zlib)

   WRITING (the whole file at once)
         float w[6] = {0, 1, 2, 3, 4, 5};
         smp_ckpt_entry e = {0};
         e.name = "fc1.weight"; e.dtype = SMP_F32; e.ndim = 2;
         e.shape[0] = 2; e.shape[1] = 3; e.data = w;
         const char *keys[] = {"epoch"}, *vals[] = {"3"};
         if (smp_ckpt_write_file("model.safetensors", &e, 1, keys, vals, 1) != SMP_OK)
             fprintf(stderr, "%s\n", smp_last_error());

   WRITING (streamed: never holds more than one chunk)
         smp_ckpt_writer *w;
         smp_ckpt_writer_open(&w, path, entries, n, keys, vals, nmeta);
         while (more) smp_ckpt_writer_write(w, chunk, chunk_bytes);  // entry order
         smp_ckpt_writer_commit(w);     // or smp_ckpt_writer_abort(w)
     The bytes are the tensors' data back to back in entry order, in any chunk
     sizes. commit() and abort() always free the writer; after a failed write()
     call either of them (commit then returns the earlier error).

   READING
         smp_ckpt_file *f;
         if (smp_ckpt_open(&f, "model.safetensors") != SMP_OK) ...  // whole header checked
         const smp_ckpt_info *e = smp_ckpt_find(f, "fc1.weight");   // NULL: not there
         smp_ckpt_read(f, e, w, sizeof w);                         // checksum checked
         const char *epoch = smp_ckpt_meta(f, "epoch");             // NULL: not there
         smp_ckpt_close(f);

   FILE FORMAT (safetensors, opens in Python's `safetensors`): an 8-byte
   little-endian header length N; N bytes of JSON
       {"__metadata__": {"key": "value", ...},
        "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...}
   padded with spaces to a multiple of 8; then the raw little-endian data,
   offsets relative to its start. dtype strings: F32 F16 BF16 F64 I32 I64 U8
   BOOL. The writer adds one metadata entry per tensor,
       "smp.checksum.<name>": "crc32c:xxxxxxxx"   (CRC-32C, lowercase hex)
   and the reader checks it whenever a tensor is read in full. Files without
   these entries (written by other tools) read fine, unchecked.

   CRASH SAFETY: the writer writes `<path>.tmp.<pid>` in the same folder,
   fsyncs it, renames it over `path` and fsyncs the folder. A process killed
   at any point leaves `path` as it was (old file) or complete (new file),
   never half-written. A killed writer leaves its tmp file behind; the reader
   never looks at it, and the next writer of the same `path` deletes any
   `<path>.tmp.<pid>` whose process no longer runs on this host.

   CHECKS ON OPEN (each an SMP_ERR_FORMAT naming the file, the tensor and the
   problem): file shorter than 8 bytes, header length beyond the file or over
   100 MB, malformed JSON (strict: no trailing commas, no comments, no
   duplicate keys, valid UTF-8, no \u0000), unknown dtype or key, more than
   SMP_MAX_DIMS dimensions, shape bytes not equal to the offsets' span,
   offsets out of bounds, overlapping, or leaving bytes of the data section
   uncovered, duplicate tensor names, non-string metadata, malformed or
   orphaned smp checksums.

   TEST-ONLY FAULT INJECTION: with SMP_CKPT_FAULT set to one of
       header   after the header is in the tmp file, before any data
       data     after the first write() call's bytes are in the tmp file
                (or at commit when there is no data)
       flush    after all data and checksums are written, before fsync
       rename   after the tmp file is fsynced and closed, before the rename
       dirsync  after the rename, before the folder is fsynced
   the writer calls _exit(77) at that point. Never set it outside tests.

   ALIGNMENT: offsets follow entry order and the data section starts at a
   multiple of 8. safetensors' own writer puts the widest dtypes first so
   every tensor sits at a multiple of its element size; order entries the
   same way (8-byte dtypes, then 4, 2, 1) when readers map the file.

   THREADS: use one writer or open file from one thread at a time.
   The host must be little-endian (the data is written as it lies in memory).
*/
#ifndef SMP_CHECKPOINT_H
#define SMP_CHECKPOINT_H

#include "smp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- file layer */

/* One tensor to write: its name (UTF-8, unique, not "__metadata__"), dtype
   and shape; `data` is read only by smp_ckpt_write_file. */
typedef struct smp_ckpt_entry {
    const char *name;
    smp_dtype dtype;
    int ndim;
    int64_t shape[SMP_MAX_DIMS];
    const void *data;
} smp_ckpt_entry;

/* An entry for a host tensor (name is not copied). */
SMPDEF smp_ckpt_entry smp_ckpt_entry_of(const char *name, const smp_tensor *t);

typedef struct smp_ckpt_writer smp_ckpt_writer;

/* Creates the tmp file and writes the header. The entries and metadata are
   copied; metadata keys must not start with "smp.checksum.". */
SMPDEF smp_status smp_ckpt_writer_open(smp_ckpt_writer **w, const char *path, const smp_ckpt_entry *entries,
                                       int n, const char *const *meta_keys, const char *const *meta_values,
                                       int nmeta);
/* Appends data in entry order; any chunk size. More bytes than the entries
   declare is an error. */
SMPDEF smp_status smp_ckpt_writer_write(smp_ckpt_writer *w, const void *bytes, size_t n);
/* Bytes still expected before commit. */
SMPDEF uint64_t smp_ckpt_writer_remaining(const smp_ckpt_writer *w);
/* Patches the checksums, fsyncs, renames over the path, fsyncs the folder;
   frees w. Fewer bytes than declared is an error (and nothing is saved). */
SMPDEF smp_status smp_ckpt_writer_commit(smp_ckpt_writer *w);
/* Deletes the tmp file and frees w; `path` stays as it was. */
SMPDEF void smp_ckpt_writer_abort(smp_ckpt_writer *w);
/* Open, write every entry's data, commit. */
SMPDEF smp_status smp_ckpt_write_file(const char *path, const smp_ckpt_entry *entries, int n,
                                      const char *const *meta_keys, const char *const *meta_values, int nmeta);

/* One tensor of an open file. Strings live as long as the file. */
typedef struct smp_ckpt_info {
    const char *name;
    smp_dtype dtype;
    int ndim;
    int64_t shape[SMP_MAX_DIMS];
    int64_t numel;
    uint64_t offset;   /* from the start of the data section */
    uint64_t nbytes;
    bool has_checksum; /* the file records a CRC-32C for it */
    uint32_t checksum;
} smp_ckpt_info;

typedef struct smp_ckpt_file smp_ckpt_file;

/* Opens and validates the whole header (not the data: see verify_all). */
SMPDEF smp_status smp_ckpt_open(smp_ckpt_file **f, const char *path);
SMPDEF void smp_ckpt_close(smp_ckpt_file *f);
SMPDEF const char *smp_ckpt_path(const smp_ckpt_file *f);
/* Tensors in header order. */
SMPDEF int smp_ckpt_count(const smp_ckpt_file *f);
SMPDEF const smp_ckpt_info *smp_ckpt_info_at(const smp_ckpt_file *f, int i);
/* NULL when absent, with smp_last_error() naming the file and the tensor. */
SMPDEF const smp_ckpt_info *smp_ckpt_find(const smp_ckpt_file *f, const char *name);
/* Metadata in header order (smp's checksum entries included). */
SMPDEF int smp_ckpt_meta_count(const smp_ckpt_file *f);
SMPDEF void smp_ckpt_meta_at(const smp_ckpt_file *f, int i, const char **key, const char **value);
/* NULL when absent (no error recorded: metadata keys are often optional). */
SMPDEF const char *smp_ckpt_meta(const smp_ckpt_file *f, const char *key);
/* Reads the whole tensor into dst (cap >= nbytes) and checks its checksum;
   on a mismatch (SMP_ERR_FORMAT) dst holds the corrupt bytes. */
SMPDEF smp_status smp_ckpt_read(smp_ckpt_file *f, const smp_ckpt_info *e, void *dst, size_t cap);
/* Reads bytes [offset, offset + n) of the tensor's data, unchecked: use
   verify_all first, or smp_ckpt_crc32c over all chunks. */
SMPDEF smp_status smp_ckpt_read_range(smp_ckpt_file *f, const smp_ckpt_info *e, uint64_t offset, void *dst,
                                      size_t n);
/* Checks every recorded checksum, streaming the data in 1 MiB pieces. */
SMPDEF smp_status smp_ckpt_verify_all(smp_ckpt_file *f);

/* CRC-32C (Castagnoli), continuing from `crc` (0 to start):
   smp_ckpt_crc32c(smp_ckpt_crc32c(0, a, n), b, m) == crc of a then b. */
SMPDEF uint32_t smp_ckpt_crc32c(uint32_t crc, const void *data, size_t n);
/* "F32", "BF16", ... (safetensors spelling); NULL for an invalid dtype. */
SMPDEF const char *smp_ckpt_dtype_string(smp_dtype dt);

/* Internal, for tests and fuzzing: validates an in-memory file image
   (length prefix + header + data) exactly as smp_ckpt_open validates a file;
   reads are then served from `bytes`, which must outlive *f. `label` names
   it in messages. */
SMPDEF smp_status smp__ckpt_open_memory(smp_ckpt_file **f, const char *label, const void *bytes, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* SMP_CHECKPOINT_H */

/* ======================================================================== */
#if defined(SMP_IMPLEMENTATION) && !defined(SMP_CHECKPOINT_IMPLEMENTATION_DONE)
#define SMP_CHECKPOINT_IMPLEMENTATION_DONE

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* pread, pwrite, kill, O_CLOEXEC and O_DIRECTORY are POSIX.1-2008, hidden by
   glibc in a strict -std=c11 translation unit that defined no feature macro
   before its first #include. Without them: lseek + read/write, /proc for
   "is this process alive", and no close-on-exec. */
#if defined(__GLIBC__)
#if defined(__USE_XOPEN2K8)
#define SMP__CKPT_POSIX2008 1
#endif
#elif defined(__unix__) || defined(__APPLE__)
#define SMP__CKPT_POSIX2008 1
#endif
#ifdef O_CLOEXEC
#define SMP__CKPT_O_CLOEXEC O_CLOEXEC
#else
#define SMP__CKPT_O_CLOEXEC 0
#endif
#ifdef O_DIRECTORY
#define SMP__CKPT_O_DIRECTORY O_DIRECTORY
#else
#define SMP__CKPT_O_DIRECTORY 0
#endif
#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "smp_checkpoint.h writes tensor data as it lies in memory, and safetensors is little-endian"
#endif

#ifndef SMP_MALLOC
#define SMP_MALLOC(n) malloc(n)
#endif
#ifndef SMP_FREE
#define SMP_FREE(p) free(p)
#endif

#if defined(__GNUC__)
#define SMP__CKPT_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define SMP__CKPT_PRINTF(a, b)
#endif

#define SMP__CKPT_MAX_HEADER 100000000ull /* the limit the safetensors reference uses */
#define SMP__CKPT_IO_CHUNK ((size_t)1 << 20)
#define SMP__CKPT_CRC_PREFIX "crc32c:"
#define SMP__CKPT_CRC_KEY "smp.checksum."

#ifdef __cplusplus
extern "C" {
#endif

typedef unsigned long long smp__ckpt_ull; /* for printf */

/* ---------------------------------------------------------------- dtypes */
static const char *const smp__ckpt_dtype_names[SMP_DTYPE_COUNT] = {
    /* order of smp_dtype */
    NULL, "F32", "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL"};
static const size_t smp__ckpt_dtype_sizes[SMP_DTYPE_COUNT] = {0, 4, 2, 2, 8, 4, 8, 1, 1};

SMPDEF const char *smp_ckpt_dtype_string(smp_dtype dt) {
    if ((int)dt <= (int)SMP_DTYPE_INVALID || (int)dt >= (int)SMP_DTYPE_COUNT) return NULL;
    return smp__ckpt_dtype_names[dt];
}

/* ---------------------------------------------------------------- messages */
/* Records "<label>: tensor '<tensor>': <message>" (the tensor part when
   tensor is non-NULL) as the last error and returns st. */
static smp_status smp__ckpt_fail(smp_status st, const char *label, const char *tensor, const char *fmt, ...)
    SMP__CKPT_PRINTF(4, 5);
static smp_status smp__ckpt_fail(smp_status st, const char *label, const char *tensor, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (tensor) return smp_error(st, "%s: tensor '%s': %s", label, tensor, msg);
    return smp_error(st, "%s: %s", label, msg);
}

static const char *smp__ckpt_shape_str(const int64_t *shape, int ndim, char *buf, size_t cap) {
    size_t len = 0;
    int i;
    buf[0] = 0;
    len += (size_t)snprintf(buf, cap, "[");
    for (i = 0; i < ndim && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (len < cap) snprintf(buf + len, cap - len, "]");
    return buf;
}

/* ---------------------------------------------------------------- CRC-32C */
static uint32_t smp__ckpt_crc_table[8][256];
static pthread_once_t smp__ckpt_crc_once = PTHREAD_ONCE_INIT;

/* x86-64 has a CRC-32C instruction (SSE4.2), used when the CPU has it;
   SMP_CKPT_NO_HW_CRC keeps to the table. One chain of crc32 instructions
   waits on each result, so blocks of 3 x LANE bytes run as three
   independent chains, joined through CRC linearity: feeding bytes X to a
   register r gives shift_|X|(r) ^ crc_raw(0, X), where shift_L (L zero bytes)
   is a fixed linear map, applied through four 256-entry tables. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SMP_CKPT_NO_HW_CRC)
#define SMP__CKPT_HW_CRC 1
#define SMP__CKPT_CRC_LANE 4096
static int smp__ckpt_crc_has_hw;
static uint32_t smp__ckpt_crc_shift[4][256]; /* shift_LANE, by byte of the register */

static uint32_t smp__ckpt_crc_shift_lane(uint32_t r) {
    return smp__ckpt_crc_shift[0][r & 0xff] ^ smp__ckpt_crc_shift[1][(r >> 8) & 0xff] ^
           smp__ckpt_crc_shift[2][(r >> 16) & 0xff] ^ smp__ckpt_crc_shift[3][r >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t smp__ckpt_crc32c_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = (uint32_t)~crc;
    while (n && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    while (n >= 3 * SMP__CKPT_CRC_LANE) {
        uint64_t a = c, b = 0, d = 0, va, vb, vd;
        size_t i;
        for (i = 0; i < SMP__CKPT_CRC_LANE; i += 8) {
            memcpy(&va, p + i, 8);
            memcpy(&vb, p + SMP__CKPT_CRC_LANE + i, 8);
            memcpy(&vd, p + 2 * SMP__CKPT_CRC_LANE + i, 8);
            a = __builtin_ia32_crc32di(a, va);
            b = __builtin_ia32_crc32di(b, vb);
            d = __builtin_ia32_crc32di(d, vd);
        }
        c = smp__ckpt_crc_shift_lane(smp__ckpt_crc_shift_lane((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)d;
        p += 3 * SMP__CKPT_CRC_LANE;
        n -= 3 * SMP__CKPT_CRC_LANE;
    }
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    while (n--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return ~(uint32_t)c;
}
#endif

static void smp__ckpt_crc_init(void) {
    uint32_t i, k, c;
    for (i = 0; i < 256; i++) {
        c = i;
        for (k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        smp__ckpt_crc_table[0][i] = c;
    }
    for (i = 0; i < 256; i++)
        for (k = 1; k < 8; k++)
            smp__ckpt_crc_table[k][i] =
                (smp__ckpt_crc_table[k - 1][i] >> 8) ^ smp__ckpt_crc_table[0][smp__ckpt_crc_table[k - 1][i] & 0xff];
#ifdef SMP__CKPT_HW_CRC
    {
        uint32_t basis[32];
        int bit, byte, v;
        for (bit = 0; bit < 32; bit++) { /* shift_LANE of each single-bit register */
            c = 1u << bit;
            for (k = 0; k < SMP__CKPT_CRC_LANE; k++) c = smp__ckpt_crc_table[0][c & 0xff] ^ (c >> 8);
            basis[bit] = c;
        }
        for (byte = 0; byte < 4; byte++)
            for (v = 0; v < 256; v++) {
                c = 0;
                for (bit = 0; bit < 8; bit++)
                    if (v & (1 << bit)) c ^= basis[8 * byte + bit];
                smp__ckpt_crc_shift[byte][v] = c;
            }
    }
    smp__ckpt_crc_has_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
}

/* The table version (slicing by 8), used where the CPU has no CRC-32C
   instruction; internal, exposed for tests. */
SMPDEF uint32_t smp__ckpt_crc32c_sw(uint32_t crc, const void *data, size_t n);
SMPDEF uint32_t smp__ckpt_crc32c_sw(uint32_t crc, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    uint32_t (*t)[256] = smp__ckpt_crc_table;
    pthread_once(&smp__ckpt_crc_once, smp__ckpt_crc_init);
    crc = ~crc;
    while (n && ((uintptr_t)p & 7)) {
        crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
              t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

SMPDEF uint32_t smp_ckpt_crc32c(uint32_t crc, const void *data, size_t n) {
    pthread_once(&smp__ckpt_crc_once, smp__ckpt_crc_init);
#ifdef SMP__CKPT_HW_CRC
    if (smp__ckpt_crc_has_hw) return smp__ckpt_crc32c_hw(crc, (const uint8_t *)data, n);
#endif
    return smp__ckpt_crc32c_sw(crc, data, n);
}

/* ---------------------------------------------------------------- small helpers */
static char *smp__ckpt_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = (char *)SMP_MALLOC(n);
    if (p) memcpy(p, s, n);
    return p;
}

static void smp__ckpt_free(void *p) {
    if (p) SMP_FREE(p);
}

/* Grows *p (elements of `elem` bytes, *cap of them) to hold `need`. */
static int smp__ckpt_grow(void **p, int *cap, int need, size_t elem) {
    int ncap;
    void *q;
    if (need <= *cap) return 1;
    ncap = *cap ? *cap : 16;
    while (ncap < need) {
        if (ncap > (1 << 29)) return 0;
        ncap *= 2;
    }
    q = SMP_MALLOC((size_t)ncap * elem);
    if (!q) return 0;
    if (*cap) memcpy(q, *p, (size_t)*cap * elem);
    smp__ckpt_free(*p);
    *p = q;
    *cap = ncap;
    return 1;
}

/* Length of the valid UTF-8 sequence at s (n bytes left), 0 if invalid:
   no overlong forms, no surrogates, nothing past U+10FFFF. */
static size_t smp__ckpt_utf8_len(const uint8_t *s, size_t n) {
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    if (c < 0xC2) return 0;
    if (c < 0xE0) return (n >= 2 && (s[1] & 0xC0) == 0x80) ? 2 : 0;
    if (c < 0xF0) {
        if (n < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && s[1] < 0xA0) return 0;
        if (c == 0xED && s[1] >= 0xA0) return 0;
        return 3;
    }
    if (c < 0xF5) {
        if (n < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80) return 0;
        if (c == 0xF0 && s[1] < 0x90) return 0;
        if (c == 0xF4 && s[1] >= 0x90) return 0;
        return 4;
    }
    return 0;
}

static int smp__ckpt_utf8_valid(const char *s) {
    const uint8_t *p = (const uint8_t *)s;
    size_t n = strlen(s), i = 0, k;
    while (i < n) {
        k = smp__ckpt_utf8_len(p + i, n - i);
        if (!k) return 0;
        i += k;
    }
    return 1;
}

/* Bytes of a tensor; 0 on overflow of int64/uint64 (reported by callers). */
static int smp__ckpt_tensor_bytes(smp_dtype dt, int ndim, const int64_t *shape, int64_t *numel, uint64_t *bytes) {
    int64_t ne = 1;
    size_t es = smp__ckpt_dtype_sizes[dt];
    int i;
    for (i = 0; i < ndim; i++) {
        if (shape[i] < 0) return 0;
        if (shape[i] != 0 && ne > INT64_MAX / shape[i]) return 0;
        ne *= shape[i];
    }
    if ((uint64_t)ne > UINT64_MAX / es) return 0;
    *numel = ne;
    *bytes = (uint64_t)ne * es;
    return 1;
}

/* Growable text buffer for the header. */
typedef struct smp__ckpt_sbuf {
    char *p;
    size_t len, cap;
    int oom;
} smp__ckpt_sbuf;

static void smp__ckpt_put(smp__ckpt_sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        char *q;
        while (cap < b->len + n + 1) {
            if (cap > ((size_t)-1) / 4) {
                b->oom = 1;
                return;
            }
            cap *= 2;
        }
        q = (char *)SMP_MALLOC(cap);
        if (!q) {
            b->oom = 1;
            return;
        }
        if (b->len) memcpy(q, b->p, b->len);
        smp__ckpt_free(b->p);
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void smp__ckpt_puts(smp__ckpt_sbuf *b, const char *s) { smp__ckpt_put(b, s, strlen(s)); }

static void smp__ckpt_put_escaped(smp__ckpt_sbuf *b, const char *s) {
    const char *run = s;
    char esc[8];
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        smp__ckpt_put(b, run, (size_t)(s - run));
        switch (c) {
        case '"': smp__ckpt_puts(b, "\\\""); break;
        case '\\': smp__ckpt_puts(b, "\\\\"); break;
        case '\n': smp__ckpt_puts(b, "\\n"); break;
        case '\r': smp__ckpt_puts(b, "\\r"); break;
        case '\t': smp__ckpt_puts(b, "\\t"); break;
        case '\b': smp__ckpt_puts(b, "\\b"); break;
        case '\f': smp__ckpt_puts(b, "\\f"); break;
        default:
            snprintf(esc, sizeof esc, "\\u%04x", c);
            smp__ckpt_puts(b, esc);
        }
        run = s + 1;
    }
    smp__ckpt_put(b, run, (size_t)(s - run));
}

/* "prefix+s" as a JSON string. */
static void smp__ckpt_put_jstr(smp__ckpt_sbuf *b, const char *prefix, const char *s) {
    smp__ckpt_puts(b, "\"");
    if (prefix) smp__ckpt_put_escaped(b, prefix);
    smp__ckpt_put_escaped(b, s);
    smp__ckpt_puts(b, "\"");
}

static int smp__ckpt_strcmp_p(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int smp__ckpt_starts(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

/* Folder and file name of a path ("x" -> "." and "x"). dir is malloc'd. */
static char *smp__ckpt_dirname(const char *path, const char **base) {
    const char *slash = strrchr(path, '/');
    char *dir;
    size_t n;
    if (!slash) {
        *base = path;
        return smp__ckpt_strdup(".");
    }
    *base = slash + 1;
    n = slash == path ? 1 : (size_t)(slash - path);
    dir = (char *)SMP_MALLOC(n + 1);
    if (!dir) return NULL;
    memcpy(dir, path, n);
    dir[n] = 0;
    return dir;
}

static int smp__ckpt_write_all(int fd, const void *buf, size_t n) {
    const char *p = (const char *)buf;
    while (n) {
        ssize_t k = write(fd, p, n);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int smp__ckpt_pwrite_all(int fd, const void *buf, size_t n, uint64_t off) {
#ifdef SMP__CKPT_POSIX2008
    const char *p = (const char *)buf;
    while (n) {
        ssize_t k = pwrite(fd, p, n, (off_t)off);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
#else
    if (lseek(fd, (off_t)off, SEEK_SET) < 0) return -1;
    return smp__ckpt_write_all(fd, buf, n);
#endif
}

/* Whether process `pid` may still be running on this host. */
static int smp__ckpt_pid_alive(long pid) {
#ifdef SMP__CKPT_POSIX2008
    return kill((pid_t)pid, 0) == 0 || errno != ESRCH; /* EPERM: alive, not ours */
#else
    char proc[64];
    struct stat sb;
    if (stat("/proc/self", &sb) != 0) return 1; /* cannot tell: keep its file */
    snprintf(proc, sizeof proc, "/proc/%ld", pid);
    return stat(proc, &sb) == 0;
#endif
}

/* ---------------------------------------------------------------- writer */
enum { SMP__CKPT_FAULT_NONE, SMP__CKPT_FAULT_HEADER, SMP__CKPT_FAULT_DATA, SMP__CKPT_FAULT_FLUSH,
       SMP__CKPT_FAULT_RENAME, SMP__CKPT_FAULT_DIRSYNC };

struct smp_ckpt_writer {
    char *path, *tmp, *dir; /* dir: for the folder fsync */
    int fd;
    int fault;
    int n, cur;             /* entries; the one being filled */
    uint64_t *sizes;        /* bytes per entry */
    uint32_t *crcs;         /* running CRC-32C per entry */
    size_t *crc_pos;        /* where each entry's 8 hex digits sit in `header` */
    char *names;            /* n NUL-terminated names back to back */
    char **name_of;         /* pointers into names */
    uint64_t done;          /* bytes of entry `cur` written */
    uint64_t total, written;
    char *header;           /* length prefix + JSON + padding */
    size_t header_len;
    uint8_t *buf;           /* output buffer */
    size_t buf_len, buf_cap;
    smp_status failed;      /* first error; later calls repeat it */
    char *failed_msg;
    int sealed;             /* the tmp file is complete and closed, not yet renamed */
};

static int smp__ckpt_fault_from_env(int *fault) {
    const char *s = getenv("SMP_CKPT_FAULT");
    *fault = SMP__CKPT_FAULT_NONE;
    if (!s || !*s) return 1;
    if (!strcmp(s, "header")) *fault = SMP__CKPT_FAULT_HEADER;
    else if (!strcmp(s, "data")) *fault = SMP__CKPT_FAULT_DATA;
    else if (!strcmp(s, "flush")) *fault = SMP__CKPT_FAULT_FLUSH;
    else if (!strcmp(s, "rename")) *fault = SMP__CKPT_FAULT_RENAME;
    else if (!strcmp(s, "dirsync")) *fault = SMP__CKPT_FAULT_DIRSYNC;
    else return 0;
    return 1;
}

static void smp__ckpt_fault(const smp_ckpt_writer *w, int phase) {
    if (w->fault == phase) _exit(77);
}

static void smp__ckpt_writer_free(smp_ckpt_writer *w) {
    if (!w) return;
    if (w->fd >= 0) {
        close(w->fd);
        if (w->tmp) unlink(w->tmp);
    } else if (w->sealed && w->tmp) {
        unlink(w->tmp);
    }
    smp__ckpt_free(w->path);
    smp__ckpt_free(w->tmp);
    smp__ckpt_free(w->dir);
    smp__ckpt_free(w->sizes);
    smp__ckpt_free(w->crcs);
    smp__ckpt_free(w->crc_pos);
    smp__ckpt_free(w->names);
    smp__ckpt_free(w->name_of);
    smp__ckpt_free(w->header);
    smp__ckpt_free(w->buf);
    smp__ckpt_free(w->failed_msg);
    SMP_FREE(w);
}

/* Remembers the error just recorded so later calls on w can repeat it. */
static smp_status smp__ckpt_writer_failed(smp_ckpt_writer *w, smp_status st) {
    if (!w->failed) {
        w->failed = st;
        w->failed_msg = smp__ckpt_strdup(smp_last_error());
    }
    return st;
}

static smp_status smp__ckpt_writer_repeat(const smp_ckpt_writer *w) {
    return smp_error(w->failed, "%s", w->failed_msg ? w->failed_msg : "an earlier checkpoint write failed");
}

/* Deletes `<base>.tmp.<pid>` files in dir whose process is gone from this
   host (left by killed writers). Best effort: errors are ignored. */
static void smp__ckpt_remove_stale(const char *dir, const char *base) {
    DIR *d = opendir(dir);
    struct dirent *de;
    size_t blen = strlen(base);
    if (!d) return;
    while ((de = readdir(d)) != NULL) {
        const char *nm = de->d_name, *digits;
        long long pid = 0;
        int nd = 0;
        if (strncmp(nm, base, blen) != 0 || strncmp(nm + blen, ".tmp.", 5) != 0) continue;
        digits = nm + blen + 5;
        while (digits[nd] >= '0' && digits[nd] <= '9' && nd < 10) pid = pid * 10 + (digits[nd++] - '0');
        if (nd == 0 || digits[nd] != 0 || pid <= 0 || pid > 0x7fffffff) continue;
        if ((pid_t)pid == getpid()) continue;
        if (smp__ckpt_pid_alive((long)pid)) continue;
        {
            size_t dl = strlen(dir), nl = strlen(nm);
            char *full = (char *)SMP_MALLOC(dl + nl + 2);
            if (!full) continue;
            memcpy(full, dir, dl);
            full[dl] = '/';
            memcpy(full + dl + 1, nm, nl + 1);
            unlink(full);
            SMP_FREE(full);
        }
    }
    closedir(d);
}

static smp_status smp__ckpt_check_entries(const char *label, const smp_ckpt_entry *entries, int n,
                                          const char *const *mk, const char *const *mv, int nmeta,
                                          uint64_t *total) {
    int i, k;
    const char **sorted;
    smp_status st = SMP_OK;
    *total = 0;
    if (n < 0 || nmeta < 0) return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "negative entry or metadata count");
    if (n > 0 && !entries) return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "%d entries but entries is NULL", n);
    if (nmeta > 0 && (!mk || !mv))
        return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "%d metadata entries but keys or values is NULL", nmeta);
    for (i = 0; i < n; i++) {
        const smp_ckpt_entry *e = &entries[i];
        int64_t numel;
        uint64_t bytes;
        if (!e->name || !*e->name)
            return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "entry %d has no name", i);
        if (!smp__ckpt_utf8_valid(e->name))
            return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "the name is not valid UTF-8");
        if (!strcmp(e->name, "__metadata__"))
            return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "that name is reserved by safetensors");
        if ((int)e->dtype <= (int)SMP_DTYPE_INVALID || (int)e->dtype >= (int)SMP_DTYPE_COUNT)
            return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "invalid dtype %d", (int)e->dtype);
        if (e->ndim < 0 || e->ndim > SMP_MAX_DIMS)
            return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "ndim %d is outside 0..%d", e->ndim, SMP_MAX_DIMS);
        for (k = 0; k < e->ndim; k++)
            if (e->shape[k] < 0)
                return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "dimension %d is negative (%lld)", k,
                                      (long long)e->shape[k]);
        if (!smp__ckpt_tensor_bytes(e->dtype, e->ndim, e->shape, &numel, &bytes) || bytes > UINT64_MAX - *total)
            return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "its size overflows 64 bits");
        *total += bytes;
    }
    for (i = 0; i < nmeta; i++) {
        if (!mk[i] || !mv[i])
            return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "metadata entry %d has a NULL key or value", i);
        if (!smp__ckpt_utf8_valid(mk[i]) || !smp__ckpt_utf8_valid(mv[i]))
            return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "metadata entry '%s' is not valid UTF-8", mk[i]);
        if (smp__ckpt_starts(mk[i], SMP__CKPT_CRC_KEY))
            return smp__ckpt_fail(SMP_ERR_ARG, label, NULL,
                                  "metadata key '%s' is reserved for smp's checksums (" SMP__CKPT_CRC_KEY "*)", mk[i]);
    }
    /* duplicates: names, then metadata keys */
    k = n > nmeta ? n : nmeta;
    if (k < 2) return SMP_OK;
    sorted = (const char **)SMP_MALLOC((size_t)k * sizeof *sorted);
    if (!sorted) return smp__ckpt_fail(SMP_ERR_NOMEM, label, NULL, "out of memory");
    for (i = 0; i < n; i++) sorted[i] = entries[i].name;
    qsort(sorted, (size_t)n, sizeof *sorted, smp__ckpt_strcmp_p);
    for (i = 1; i < n && !st; i++)
        if (!strcmp(sorted[i - 1], sorted[i]))
            st = smp__ckpt_fail(SMP_ERR_ARG, label, sorted[i], "two entries have this name");
    if (!st) {
        for (i = 0; i < nmeta; i++) sorted[i] = mk[i];
        qsort(sorted, (size_t)nmeta, sizeof *sorted, smp__ckpt_strcmp_p);
        for (i = 1; i < nmeta && !st; i++)
            if (!strcmp(sorted[i - 1], sorted[i]))
                st = smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "metadata key '%s' appears twice", sorted[i]);
    }
    SMP_FREE(sorted);
    return st;
}

/* Builds the length prefix + JSON header with zero checksums, recording where
   each checksum's hex digits go. */
static smp_status smp__ckpt_build_header(smp_ckpt_writer *w, const char *label, const smp_ckpt_entry *entries,
                                         const char *const *mk, const char *const *mv, int nmeta) {
    smp__ckpt_sbuf b;
    int i, k, first = 1;
    uint64_t off = 0, hlen;
    char num[64];
    memset(&b, 0, sizeof b);
    smp__ckpt_put(&b, "\0\0\0\0\0\0\0\0", 8); /* length, patched below */
    smp__ckpt_puts(&b, "{");
    if (w->n > 0 || nmeta > 0) {
        smp__ckpt_puts(&b, "\"__metadata__\":{");
        for (i = 0; i < nmeta; i++) {
            if (i) smp__ckpt_puts(&b, ",");
            smp__ckpt_put_jstr(&b, NULL, mk[i]);
            smp__ckpt_puts(&b, ":");
            smp__ckpt_put_jstr(&b, NULL, mv[i]);
        }
        for (i = 0; i < w->n; i++) {
            if (i || nmeta) smp__ckpt_puts(&b, ",");
            smp__ckpt_put_jstr(&b, SMP__CKPT_CRC_KEY, entries[i].name);
            smp__ckpt_puts(&b, ":\"" SMP__CKPT_CRC_PREFIX);
            w->crc_pos[i] = b.len;
            smp__ckpt_puts(&b, "00000000\"");
        }
        smp__ckpt_puts(&b, "}");
        first = 0;
    }
    for (i = 0; i < w->n; i++) {
        const smp_ckpt_entry *e = &entries[i];
        if (!first) smp__ckpt_puts(&b, ",");
        first = 0;
        smp__ckpt_put_jstr(&b, NULL, e->name);
        smp__ckpt_puts(&b, ":{\"dtype\":\"");
        smp__ckpt_puts(&b, smp__ckpt_dtype_names[e->dtype]);
        smp__ckpt_puts(&b, "\",\"shape\":[");
        for (k = 0; k < e->ndim; k++) {
            snprintf(num, sizeof num, "%s%lld", k ? "," : "", (long long)e->shape[k]);
            smp__ckpt_puts(&b, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (smp__ckpt_ull)off,
                 (smp__ckpt_ull)(off + w->sizes[i]));
        smp__ckpt_puts(&b, num);
        off += w->sizes[i];
    }
    smp__ckpt_puts(&b, "}");
    while (!b.oom && b.len % 8) smp__ckpt_puts(&b, " ");
    if (b.oom) {
        smp__ckpt_free(b.p);
        return smp__ckpt_fail(SMP_ERR_NOMEM, label, NULL, "out of memory building the header");
    }
    hlen = b.len - 8;
    if (hlen > SMP__CKPT_MAX_HEADER) {
        SMP_FREE(b.p);
        return smp__ckpt_fail(SMP_ERR_ARG, label, NULL,
                              "the header would be %llu bytes, over the %llu-byte limit of safetensors readers",
                              (smp__ckpt_ull)hlen, (smp__ckpt_ull)SMP__CKPT_MAX_HEADER);
    }
    for (i = 0; i < 8; i++) b.p[i] = (char)((hlen >> (8 * i)) & 0xff);
    w->header = b.p;
    w->header_len = b.len;
    return SMP_OK;
}

SMPDEF smp_status smp_ckpt_writer_open(smp_ckpt_writer **out, const char *path, const smp_ckpt_entry *entries,
                                       int n, const char *const *mk, const char *const *mv, int nmeta) {
    smp_ckpt_writer *w;
    char label[512];
    const char *base;
    uint64_t total;
    size_t names_len = 0, pos;
    int i, fd;
    smp_status st;

    if (!out) return smp_error(SMP_ERR_ARG, "smp_ckpt_writer_open: out is NULL");
    *out = NULL;
    if (!path || !*path) return smp_error(SMP_ERR_ARG, "smp_ckpt_writer_open: no path");
    snprintf(label, sizeof label, "checkpoint '%s'", path);
    if (path[strlen(path) - 1] == '/') return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "the path names a folder");
    st = smp__ckpt_check_entries(label, entries, n, mk, mv, nmeta, &total);
    if (st) return st;

    w = (smp_ckpt_writer *)SMP_MALLOC(sizeof *w);
    if (!w) return smp__ckpt_fail(SMP_ERR_NOMEM, label, NULL, "out of memory");
    memset(w, 0, sizeof *w);
    w->fd = -1;
    w->n = n;
    w->total = total;
    if (!smp__ckpt_fault_from_env(&w->fault)) {
        smp__ckpt_writer_free(w);
        return smp__ckpt_fail(SMP_ERR_ARG, label, NULL,
                              "SMP_CKPT_FAULT='%s' is not one of header, data, flush, rename, dirsync",
                              getenv("SMP_CKPT_FAULT"));
    }
    for (i = 0; i < n; i++) names_len += strlen(entries[i].name) + 1;
    w->path = smp__ckpt_strdup(path);
    w->tmp = (char *)SMP_MALLOC(strlen(path) + 32);
    w->dir = smp__ckpt_dirname(path, &base);
    w->sizes = (uint64_t *)SMP_MALLOC(sizeof(uint64_t) * (size_t)(n ? n : 1));
    w->crcs = (uint32_t *)SMP_MALLOC(sizeof(uint32_t) * (size_t)(n ? n : 1));
    w->crc_pos = (size_t *)SMP_MALLOC(sizeof(size_t) * (size_t)(n ? n : 1));
    w->name_of = (char **)SMP_MALLOC(sizeof(char *) * (size_t)(n ? n : 1));
    w->names = (char *)SMP_MALLOC(names_len ? names_len : 1);
    w->buf_cap = total < SMP__CKPT_IO_CHUNK ? (size_t)total : SMP__CKPT_IO_CHUNK;
    w->buf = (uint8_t *)SMP_MALLOC(w->buf_cap ? w->buf_cap : 1);
    if (!w->path || !w->tmp || !w->dir || !w->sizes || !w->crcs || !w->crc_pos || !w->name_of || !w->names ||
        !w->buf) {
        smp__ckpt_writer_free(w);
        return smp__ckpt_fail(SMP_ERR_NOMEM, label, NULL, "out of memory");
    }
    pos = 0;
    for (i = 0; i < n; i++) {
        int64_t numel;
        size_t len = strlen(entries[i].name) + 1;
        smp__ckpt_tensor_bytes(entries[i].dtype, entries[i].ndim, entries[i].shape, &numel, &w->sizes[i]);
        w->crcs[i] = 0;
        w->name_of[i] = w->names + pos;
        memcpy(w->names + pos, entries[i].name, len);
        pos += len;
    }
    st = smp__ckpt_build_header(w, label, entries, mk, mv, nmeta);
    if (st) {
        smp__ckpt_writer_free(w);
        return st;
    }

    smp__ckpt_remove_stale(w->dir, base);
    snprintf(w->tmp, strlen(path) + 32, "%s.tmp.%ld", path, (long)getpid());
    fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL | SMP__CKPT_O_CLOEXEC, 0666);
    if (fd < 0 && errno == EEXIST) { /* ours from an earlier, killed process with our pid */
        unlink(w->tmp);
        fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL | SMP__CKPT_O_CLOEXEC, 0666);
    }
    if (fd < 0) {
        st = smp__ckpt_fail(SMP_ERR_IO, label, NULL, "cannot create '%s': %s", w->tmp, strerror(errno));
        smp__ckpt_free(w->tmp);
        w->tmp = NULL; /* not ours to delete */
        smp__ckpt_writer_free(w);
        return st;
    }
    w->fd = fd;
    if (smp__ckpt_write_all(fd, w->header, w->header_len) != 0) {
        st = smp__ckpt_fail(SMP_ERR_IO, label, NULL, "writing '%s' failed: %s", w->tmp, strerror(errno));
        smp__ckpt_writer_free(w);
        return st;
    }
    smp__ckpt_fault(w, SMP__CKPT_FAULT_HEADER);
    *out = w;
    return SMP_OK;
}

static smp_status smp__ckpt_writer_flush(smp_ckpt_writer *w) {
    if (!w->buf_len) return SMP_OK;
    if (smp__ckpt_write_all(w->fd, w->buf, w->buf_len) != 0)
        return smp__ckpt_writer_failed(
            w, smp_error(SMP_ERR_IO, "checkpoint '%s': writing '%s' failed: %s", w->path, w->tmp, strerror(errno)));
    w->buf_len = 0;
    return SMP_OK;
}

static smp_status smp__ckpt_writer_out(smp_ckpt_writer *w, const uint8_t *p, size_t n) {
    smp_status st;
    if (w->buf_len + n <= w->buf_cap) {
        memcpy(w->buf + w->buf_len, p, n);
        w->buf_len += n;
        return SMP_OK;
    }
    if ((st = smp__ckpt_writer_flush(w)) != SMP_OK) return st;
    if (n >= w->buf_cap) {
        if (smp__ckpt_write_all(w->fd, p, n) != 0)
            return smp__ckpt_writer_failed(w, smp_error(SMP_ERR_IO, "checkpoint '%s': writing '%s' failed: %s",
                                                        w->path, w->tmp, strerror(errno)));
        return SMP_OK;
    }
    memcpy(w->buf, p, n);
    w->buf_len = n;
    return SMP_OK;
}

SMPDEF smp_status smp_ckpt_writer_write(smp_ckpt_writer *w, const void *bytes, size_t n) {
    const uint8_t *p = (const uint8_t *)bytes;
    smp_status st;
    if (!w) return smp_error(SMP_ERR_ARG, "smp_ckpt_writer_write: writer is NULL");
    if (w->failed) return smp__ckpt_writer_repeat(w);
    if (n && !bytes)
        return smp__ckpt_writer_failed(
            w, smp_error(SMP_ERR_ARG, "checkpoint '%s': write of %zu bytes from a NULL pointer", w->path, n));
    while (n) {
        uint64_t room;
        size_t take;
        while (w->cur < w->n && w->done == w->sizes[w->cur]) {
            w->cur++;
            w->done = 0;
        }
        if (w->cur == w->n)
            return smp__ckpt_writer_failed(
                w, smp_error(SMP_ERR_ARG,
                             "checkpoint '%s': got %zu bytes more than the entries declare (%llu bytes in all)",
                             w->path, n, (smp__ckpt_ull)w->total));
        room = w->sizes[w->cur] - w->done;
        take = (uint64_t)n < room ? n : (size_t)room;
        w->crcs[w->cur] = smp_ckpt_crc32c(w->crcs[w->cur], p, take);
        if ((st = smp__ckpt_writer_out(w, p, take)) != SMP_OK) return st;
        w->done += take;
        w->written += take;
        p += take;
        n -= take;
    }
    if (w->fault == SMP__CKPT_FAULT_DATA) {
        smp__ckpt_writer_flush(w);
        _exit(77);
    }
    return SMP_OK;
}

SMPDEF uint64_t smp_ckpt_writer_remaining(const smp_ckpt_writer *w) { return w ? w->total - w->written : 0; }

SMPDEF void smp_ckpt_writer_abort(smp_ckpt_writer *w) { smp__ckpt_writer_free(w); }

/* The first half of commit: the data is complete, the checksums are in the
   header, the tmp file is fsynced and closed, but `path` is untouched. On
   error w is freed (and its tmp file deleted); on success w waits for
   smp__ckpt_writer_publish or smp_ckpt_writer_abort (which deletes the tmp
   file). Model checkpoints seal every file of a save before renaming any. */
static smp_status smp__ckpt_writer_seal(smp_ckpt_writer *w) {
    smp_status st;
    int i;
    if (!w) return smp_error(SMP_ERR_ARG, "smp_ckpt_writer_commit: writer is NULL");
    if (w->failed) {
        st = smp__ckpt_writer_repeat(w);
        smp__ckpt_writer_free(w);
        return st;
    }
    if (w->written != w->total) {
        int cur = w->cur;
        uint64_t done = w->done;
        while (cur < w->n && done == w->sizes[cur]) { /* skip finished and empty entries */
            cur++;
            done = 0;
        }
        st = smp_error(SMP_ERR_ARG,
                       "checkpoint '%s': commit after %llu of %llu bytes: tensor '%s' has %llu of its %llu bytes; "
                       "nothing was saved",
                       w->path, (smp__ckpt_ull)w->written, (smp__ckpt_ull)w->total,
                       cur < w->n ? w->name_of[cur] : "?", (smp__ckpt_ull)done,
                       (smp__ckpt_ull)(cur < w->n ? w->sizes[cur] : 0));
        smp__ckpt_writer_free(w);
        return st;
    }
    smp__ckpt_fault(w, SMP__CKPT_FAULT_DATA); /* no data was written: die here */
    if ((st = smp__ckpt_writer_flush(w)) != SMP_OK) {
        smp__ckpt_writer_free(w);
        return st;
    }
    if (w->n > 0) {
        size_t lo = w->crc_pos[0], hi = w->crc_pos[w->n - 1] + 8;
        char hex[16];
        for (i = 0; i < w->n; i++) {
            snprintf(hex, sizeof hex, "%08x", (unsigned)w->crcs[i]);
            memcpy(w->header + w->crc_pos[i], hex, 8);
        }
        if (smp__ckpt_pwrite_all(w->fd, w->header + lo, hi - lo, lo) != 0) {
            st = smp_error(SMP_ERR_IO, "checkpoint '%s': writing '%s' failed: %s", w->path, w->tmp, strerror(errno));
            smp__ckpt_writer_free(w);
            return st;
        }
    }
    smp__ckpt_fault(w, SMP__CKPT_FAULT_FLUSH);
    if (fsync(w->fd) != 0) {
        st = smp_error(SMP_ERR_IO, "checkpoint '%s': fsync of '%s' failed: %s", w->path, w->tmp, strerror(errno));
        smp__ckpt_writer_free(w);
        return st;
    }
    i = close(w->fd);
    w->fd = -1;
    w->sealed = 1; /* from here on, freeing w deletes the tmp file */
    if (i != 0) {
        st = smp_error(SMP_ERR_IO, "checkpoint '%s': closing '%s' failed: %s", w->path, w->tmp, strerror(errno));
        smp__ckpt_writer_free(w);
        return st;
    }
    return SMP_OK;
}

/* The second half: renames the sealed tmp file over `path` and fsyncs the
   folder. Always frees w. */
static smp_status smp__ckpt_writer_publish(smp_ckpt_writer *w) {
    smp_status st;
    int dfd;
    smp__ckpt_fault(w, SMP__CKPT_FAULT_RENAME);
    if (rename(w->tmp, w->path) != 0) {
        st = smp_error(SMP_ERR_IO, "checkpoint '%s': renaming '%s' over it failed: %s", w->path, w->tmp,
                       strerror(errno));
        smp__ckpt_writer_free(w);
        return st;
    }
    w->sealed = 0; /* the tmp name is gone */
    smp__ckpt_fault(w, SMP__CKPT_FAULT_DIRSYNC);
    st = SMP_OK;
    dfd = open(w->dir, O_RDONLY | SMP__CKPT_O_DIRECTORY | SMP__CKPT_O_CLOEXEC);
    if (dfd < 0 || (fsync(dfd) != 0 && errno != EINVAL && errno != ENOTSUP && errno != EOPNOTSUPP))
        st = smp_error(SMP_ERR_IO, "checkpoint '%s' is in place, but flushing its folder '%s' failed: %s", w->path,
                       w->dir, strerror(errno));
    if (dfd >= 0) close(dfd);
    smp__ckpt_writer_free(w);
    return st;
}

SMPDEF smp_status smp_ckpt_writer_commit(smp_ckpt_writer *w) {
    smp_status st = smp__ckpt_writer_seal(w);
    return st ? st : smp__ckpt_writer_publish(w);
}

SMPDEF smp_status smp_ckpt_write_file(const char *path, const smp_ckpt_entry *entries, int n,
                                      const char *const *mk, const char *const *mv, int nmeta) {
    smp_ckpt_writer *w;
    smp_status st = smp_ckpt_writer_open(&w, path, entries, n, mk, mv, nmeta);
    int i;
    if (st) return st;
    for (i = 0; i < n; i++) {
        uint64_t bytes = w->sizes[i];
        if (bytes && !entries[i].data) {
            smp_ckpt_writer_abort(w);
            return smp_error(SMP_ERR_ARG, "checkpoint '%s': tensor '%s': data is NULL", path, entries[i].name);
        }
        if (bytes && (st = smp_ckpt_writer_write(w, entries[i].data, (size_t)bytes)) != SMP_OK) {
            smp_ckpt_writer_abort(w);
            return st;
        }
    }
    return smp_ckpt_writer_commit(w);
}

SMPDEF smp_ckpt_entry smp_ckpt_entry_of(const char *name, const smp_tensor *t) {
    smp_ckpt_entry e;
    int i;
    memset(&e, 0, sizeof e);
    e.name = name;
    if (!t) return e;
    e.dtype = t->dtype;
    e.ndim = t->ndim;
    for (i = 0; i < t->ndim && i < SMP_MAX_DIMS; i++) e.shape[i] = t->shape[i];
    e.data = t->data;
    return e;
}

/* ---------------------------------------------------------------- reader */
typedef struct smp__ckpt_meta {
    const char *key, *value;
} smp__ckpt_meta;

struct smp_ckpt_file {
    char *path;
    char *label;             /* "checkpoint '<path>'" */
    int fd;                  /* -1 for a memory image */
    const uint8_t *mem;      /* memory image, or NULL */
    uint64_t size, data_start, data_len;
    uint8_t *header;         /* JSON, strings decoded in place */
    size_t header_len;
    int n, cap;
    smp_ckpt_info *info;     /* header order */
    smp_ckpt_info **by_name; /* sorted by name */
    int nmeta, meta_cap;
    smp__ckpt_meta *meta;    /* header order */
    smp__ckpt_meta *meta_sorted;
    const uint8_t *map;      /* the whole file mapped read-only (model loads), or NULL */
    int map_tried;
};

/* The header parser. Strict JSON for exactly the safetensors schema, so it
   never nests deeper than object > object > array and needs no recursion.
   Strings are decoded in place (escapes only shrink) and NUL-terminated. */
typedef struct smp__ckpt_jp {
    uint8_t *s;
    size_t n, i;
    const char *label;
    const char *tensor; /* for messages */
} smp__ckpt_jp;

static smp_status smp__ckpt_jerr(smp__ckpt_jp *jp, const char *fmt, ...) SMP__CKPT_PRINTF(2, 3);
static smp_status smp__ckpt_jerr(smp__ckpt_jp *jp, const char *fmt, ...) {
    char msg[512], found[32];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (jp->i >= jp->n) snprintf(found, sizeof found, "the end of the header");
    else if (jp->s[jp->i] >= 0x20 && jp->s[jp->i] < 0x7f) snprintf(found, sizeof found, "'%c'", jp->s[jp->i]);
    else snprintf(found, sizeof found, "byte 0x%02x", jp->s[jp->i]);
    return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor, "malformed JSON header at byte %llu: %s, found %s",
                          (smp__ckpt_ull)jp->i, msg, found);
}

static void smp__ckpt_ws(smp__ckpt_jp *jp) {
    while (jp->i < jp->n &&
           (jp->s[jp->i] == ' ' || jp->s[jp->i] == '\t' || jp->s[jp->i] == '\n' || jp->s[jp->i] == '\r'))
        jp->i++;
}

/* Skips whitespace, then eats c if it is next. */
static int smp__ckpt_eat(smp__ckpt_jp *jp, char c) {
    smp__ckpt_ws(jp);
    if (jp->i < jp->n && jp->s[jp->i] == (uint8_t)c) {
        jp->i++;
        return 1;
    }
    return 0;
}

static int smp__ckpt_hex4(const uint8_t *p, uint32_t *v) {
    int k;
    *v = 0;
    for (k = 0; k < 4; k++) {
        uint8_t c = p[k];
        uint32_t d;
        if (c >= '0' && c <= '9') d = (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') d = (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') d = (uint32_t)(c - 'A' + 10);
        else return 0;
        *v = *v * 16 + d;
    }
    return 1;
}

/* Parses a string at jp->i (after whitespace); *out points into the buffer. */
static smp_status smp__ckpt_jstring(smp__ckpt_jp *jp, const char **out, const char *what) {
    size_t o;
    smp__ckpt_ws(jp);
    if (jp->i >= jp->n || jp->s[jp->i] != '"') return smp__ckpt_jerr(jp, "expected %s in double quotes", what);
    o = ++jp->i;
    *out = (const char *)jp->s + o;
    for (;;) {
        uint8_t c;
        if (jp->i >= jp->n) return smp__ckpt_jerr(jp, "unterminated string");
        c = jp->s[jp->i];
        if (c == '"') {
            jp->s[o] = 0; /* o <= jp->i: at most overwrites the closing quote */
            jp->i++;
            return SMP_OK;
        }
        if (c < 0x20) return smp__ckpt_jerr(jp, "control character inside a string (must be escaped)");
        if (c == '\\') {
            uint32_t cp, lo;
            if (jp->i + 1 >= jp->n) {
                jp->i++;
                return smp__ckpt_jerr(jp, "unterminated escape");
            }
            c = jp->s[jp->i + 1];
            switch (c) {
            case '"': case '\\': case '/': jp->s[o++] = c; jp->i += 2; continue;
            case 'b': jp->s[o++] = '\b'; jp->i += 2; continue;
            case 'f': jp->s[o++] = '\f'; jp->i += 2; continue;
            case 'n': jp->s[o++] = '\n'; jp->i += 2; continue;
            case 'r': jp->s[o++] = '\r'; jp->i += 2; continue;
            case 't': jp->s[o++] = '\t'; jp->i += 2; continue;
            case 'u': break;
            default: jp->i++; return smp__ckpt_jerr(jp, "unknown escape");
            }
            if (jp->n - jp->i < 6 || !smp__ckpt_hex4(jp->s + jp->i + 2, &cp))
                return smp__ckpt_jerr(jp, "\\u needs four hex digits");
            if (cp >= 0xDC00 && cp <= 0xDFFF) return smp__ckpt_jerr(jp, "lone low surrogate in \\u escape");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (jp->n - jp->i < 12 || jp->s[jp->i + 6] != '\\' || jp->s[jp->i + 7] != 'u' ||
                    !smp__ckpt_hex4(jp->s + jp->i + 8, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                    return smp__ckpt_jerr(jp, "high surrogate in \\u escape without its low half");
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                jp->i += 12;
            } else {
                jp->i += 6;
            }
            if (cp == 0) {
                jp->i -= 6;
                return smp__ckpt_jerr(jp, "\\u0000 in a string (names and values cannot hold NUL)");
            }
            if (cp < 0x80) {
                jp->s[o++] = (uint8_t)cp;
            } else if (cp < 0x800) {
                jp->s[o++] = (uint8_t)(0xC0 | (cp >> 6));
                jp->s[o++] = (uint8_t)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                jp->s[o++] = (uint8_t)(0xE0 | (cp >> 12));
                jp->s[o++] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
                jp->s[o++] = (uint8_t)(0x80 | (cp & 0x3F));
            } else {
                jp->s[o++] = (uint8_t)(0xF0 | (cp >> 18));
                jp->s[o++] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
                jp->s[o++] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
                jp->s[o++] = (uint8_t)(0x80 | (cp & 0x3F));
            }
            continue;
        }
        if (c >= 0x80) {
            size_t k = smp__ckpt_utf8_len(jp->s + jp->i, jp->n - jp->i);
            if (!k) return smp__ckpt_jerr(jp, "invalid UTF-8 in a string");
            while (k--) jp->s[o++] = jp->s[jp->i++];
            continue;
        }
        jp->s[o++] = c;
        jp->i++;
    }
}

/* A JSON integer >= 0 that fits in 63 bits (no sign, fraction or exponent). */
static smp_status smp__ckpt_juint(smp__ckpt_jp *jp, uint64_t *out, const char *what) {
    uint64_t v = 0;
    size_t start;
    smp__ckpt_ws(jp);
    start = jp->i;
    if (jp->i < jp->n && jp->s[jp->i] == '-') return smp__ckpt_jerr(jp, "%s must not be negative", what);
    while (jp->i < jp->n && jp->s[jp->i] >= '0' && jp->s[jp->i] <= '9') {
        uint64_t d = (uint64_t)(jp->s[jp->i] - '0');
        if (v > ((uint64_t)INT64_MAX - d) / 10) return smp__ckpt_jerr(jp, "%s does not fit in 63 bits", what);
        v = v * 10 + d;
        jp->i++;
    }
    if (jp->i == start) return smp__ckpt_jerr(jp, "expected %s (an integer)", what);
    if (jp->i - start > 1 && jp->s[start] == '0') {
        jp->i = start;
        return smp__ckpt_jerr(jp, "%s has a leading zero", what);
    }
    if (jp->i < jp->n && (jp->s[jp->i] == '.' || jp->s[jp->i] == 'e' || jp->s[jp->i] == 'E'))
        return smp__ckpt_jerr(jp, "%s must be an integer", what);
    *out = v;
    return SMP_OK;
}

static smp_status smp__ckpt_parse_meta(smp__ckpt_jp *jp, smp_ckpt_file *f) {
    smp_status st;
    if (!smp__ckpt_eat(jp, '{')) return smp__ckpt_jerr(jp, "__metadata__ must be an object of strings");
    if (smp__ckpt_eat(jp, '}')) return SMP_OK;
    for (;;) {
        const char *k, *v;
        if ((st = smp__ckpt_jstring(jp, &k, "a metadata key")) != SMP_OK) return st;
        if (!smp__ckpt_eat(jp, ':')) return smp__ckpt_jerr(jp, "expected ':' after metadata key '%s'", k);
        smp__ckpt_ws(jp);
        if (jp->i >= jp->n || jp->s[jp->i] != '"')
            return smp__ckpt_jerr(jp, "the value of metadata key '%s' is not a string (metadata holds strings only)",
                                  k);
        if ((st = smp__ckpt_jstring(jp, &v, "a metadata value")) != SMP_OK) return st;
        if (!smp__ckpt_grow((void **)&f->meta, &f->meta_cap, f->nmeta + 1, sizeof *f->meta))
            return smp__ckpt_fail(SMP_ERR_NOMEM, jp->label, NULL, "out of memory reading the header");
        f->meta[f->nmeta].key = k;
        f->meta[f->nmeta].value = v;
        f->nmeta++;
        if (smp__ckpt_eat(jp, ',')) continue;
        if (smp__ckpt_eat(jp, '}')) return SMP_OK;
        return smp__ckpt_jerr(jp, "expected ',' or '}' after metadata key '%s'", k);
    }
}

static smp_status smp__ckpt_parse_tensor(smp__ckpt_jp *jp, smp_ckpt_info *e) {
    int have_dtype = 0, have_shape = 0, have_offsets = 0, d;
    uint64_t v, begin = 0, end = 0;
    smp_status st;
    if (!smp__ckpt_eat(jp, '{')) return smp__ckpt_jerr(jp, "expected '{' holding dtype, shape and data_offsets");
    if (!smp__ckpt_eat(jp, '}')) {
        for (;;) {
            const char *k, *dt;
            if ((st = smp__ckpt_jstring(jp, &k, "a key")) != SMP_OK) return st;
            if (!smp__ckpt_eat(jp, ':')) return smp__ckpt_jerr(jp, "expected ':' after key '%s'", k);
            if (!strcmp(k, "dtype")) {
                if (have_dtype++) return smp__ckpt_jerr(jp, "dtype appears twice");
                if ((st = smp__ckpt_jstring(jp, &dt, "the dtype")) != SMP_OK) return st;
                for (d = 1; d < SMP_DTYPE_COUNT; d++)
                    if (!strcmp(dt, smp__ckpt_dtype_names[d])) break;
                if (d == SMP_DTYPE_COUNT)
                    return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor,
                                          "dtype \"%s\" is not one smp reads (F32 F16 BF16 F64 I32 I64 U8 BOOL)", dt);
                e->dtype = (smp_dtype)d;
            } else if (!strcmp(k, "shape")) {
                if (have_shape++) return smp__ckpt_jerr(jp, "shape appears twice");
                if (!smp__ckpt_eat(jp, '[')) return smp__ckpt_jerr(jp, "shape must be an array of integers");
                if (!smp__ckpt_eat(jp, ']')) {
                    for (;;) {
                        if (e->ndim == SMP_MAX_DIMS)
                            return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor,
                                                  "shape has more than %d dimensions", SMP_MAX_DIMS);
                        if ((st = smp__ckpt_juint(jp, &v, "a dimension")) != SMP_OK) return st;
                        e->shape[e->ndim++] = (int64_t)v;
                        if (smp__ckpt_eat(jp, ',')) continue;
                        if (smp__ckpt_eat(jp, ']')) break;
                        return smp__ckpt_jerr(jp, "expected ',' or ']' in shape");
                    }
                }
            } else if (!strcmp(k, "data_offsets")) {
                if (have_offsets++) return smp__ckpt_jerr(jp, "data_offsets appears twice");
                if (!smp__ckpt_eat(jp, '[')) return smp__ckpt_jerr(jp, "data_offsets must be [begin, end]");
                if ((st = smp__ckpt_juint(jp, &begin, "the begin offset")) != SMP_OK) return st;
                if (!smp__ckpt_eat(jp, ',')) return smp__ckpt_jerr(jp, "data_offsets must be [begin, end]");
                if ((st = smp__ckpt_juint(jp, &end, "the end offset")) != SMP_OK) return st;
                if (!smp__ckpt_eat(jp, ']')) return smp__ckpt_jerr(jp, "data_offsets must be [begin, end]");
            } else {
                return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor,
                                      "unknown key \"%s\" (a tensor has dtype, shape and data_offsets)", k);
            }
            if (smp__ckpt_eat(jp, ',')) continue;
            if (smp__ckpt_eat(jp, '}')) break;
            return smp__ckpt_jerr(jp, "expected ',' or '}' after key '%s'", k);
        }
    }
    if (!have_dtype || !have_shape || !have_offsets)
        return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor, "has no \"%s\"",
                              !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
    if (end < begin)
        return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor, "data_offsets [%llu, %llu] run backwards",
                              (smp__ckpt_ull)begin, (smp__ckpt_ull)end);
    e->offset = begin;
    e->nbytes = end - begin;
    return SMP_OK;
}

static int smp__ckpt_cmp_name(const void *a, const void *b) {
    return strcmp((*(smp_ckpt_info *const *)a)->name, (*(smp_ckpt_info *const *)b)->name);
}

static int smp__ckpt_cmp_offset(const void *a, const void *b) {
    const smp_ckpt_info *x = *(smp_ckpt_info *const *)a, *y = *(smp_ckpt_info *const *)b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return 0;
}

static int smp__ckpt_cmp_meta(const void *a, const void *b) {
    return strcmp(((const smp__ckpt_meta *)a)->key, ((const smp__ckpt_meta *)b)->key);
}

static smp_ckpt_info *smp__ckpt_lookup(const smp_ckpt_file *f, const char *name) {
    int lo = 0, hi = f->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(f->by_name[mid]->name, name);
        if (!c) return f->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

/* Everything after the JSON: sizes, bounds, coverage, names, checksums. */
static smp_status smp__ckpt_validate(smp_ckpt_file *f) {
    smp_ckpt_info **by_off;
    uint64_t pos = 0;
    int i;
    char shp[160];
    smp_status st = SMP_OK;
    for (i = 0; i < f->n; i++) {
        smp_ckpt_info *e = &f->info[i];
        uint64_t need;
        if (e->offset + e->nbytes > f->data_len)
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, e->name,
                                  "data_offsets [%llu, %llu] run past the end of the data section (%llu bytes)",
                                  (smp__ckpt_ull)e->offset, (smp__ckpt_ull)(e->offset + e->nbytes),
                                  (smp__ckpt_ull)f->data_len);
        if (!smp__ckpt_tensor_bytes(e->dtype, e->ndim, e->shape, &e->numel, &need))
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, e->name, "shape %s overflows 64 bits",
                                  smp__ckpt_shape_str(e->shape, e->ndim, shp, sizeof shp));
        if (need != e->nbytes)
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, e->name,
                                  "shape %s of %s is %llu bytes, but data_offsets [%llu, %llu] span %llu",
                                  smp__ckpt_shape_str(e->shape, e->ndim, shp, sizeof shp),
                                  smp__ckpt_dtype_names[e->dtype], (smp__ckpt_ull)need, (smp__ckpt_ull)e->offset,
                                  (smp__ckpt_ull)(e->offset + e->nbytes), (smp__ckpt_ull)e->nbytes);
    }
    /* names */
    f->by_name = (smp_ckpt_info **)SMP_MALLOC(sizeof(smp_ckpt_info *) * (size_t)(f->n ? f->n : 1));
    by_off = (smp_ckpt_info **)SMP_MALLOC(sizeof(smp_ckpt_info *) * (size_t)(f->n ? f->n : 1));
    f->meta_sorted = (smp__ckpt_meta *)SMP_MALLOC(sizeof(smp__ckpt_meta) * (size_t)(f->nmeta ? f->nmeta : 1));
    if (!f->by_name || !by_off || !f->meta_sorted) {
        smp__ckpt_free(by_off);
        return smp__ckpt_fail(SMP_ERR_NOMEM, f->label, NULL, "out of memory");
    }
    for (i = 0; i < f->n; i++) f->by_name[i] = by_off[i] = &f->info[i];
    qsort(f->by_name, (size_t)f->n, sizeof *f->by_name, smp__ckpt_cmp_name);
    for (i = 1; i < f->n && !st; i++)
        if (!strcmp(f->by_name[i - 1]->name, f->by_name[i]->name))
            st = smp__ckpt_fail(SMP_ERR_FORMAT, f->label, f->by_name[i]->name, "the name appears twice in the header");
    /* coverage: sorted by offset, each tensor starts where the last ended */
    if (!st) {
        qsort(by_off, (size_t)f->n, sizeof *by_off, smp__ckpt_cmp_offset);
        for (i = 0; i < f->n && !st; i++) {
            smp_ckpt_info *e = by_off[i];
            if (e->offset < pos)
                st = smp__ckpt_fail(SMP_ERR_FORMAT, f->label, e->name,
                                    "data_offsets [%llu, %llu] overlap tensor '%s' [%llu, %llu]",
                                    (smp__ckpt_ull)e->offset, (smp__ckpt_ull)(e->offset + e->nbytes),
                                    by_off[i - 1]->name, (smp__ckpt_ull)by_off[i - 1]->offset,
                                    (smp__ckpt_ull)(by_off[i - 1]->offset + by_off[i - 1]->nbytes));
            else if (e->offset > pos)
                st = smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL,
                                    "bytes [%llu, %llu) of the data section belong to no tensor (next is '%s')",
                                    (smp__ckpt_ull)pos, (smp__ckpt_ull)e->offset, e->name);
            pos = e->offset + e->nbytes;
        }
        if (!st && pos != f->data_len)
            st = smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL,
                                "the data section is %llu bytes but the tensors cover only the first %llu",
                                (smp__ckpt_ull)f->data_len, (smp__ckpt_ull)pos);
    }
    SMP_FREE(by_off);
    if (st) return st;
    /* metadata: unique keys, checksums of existing tensors */
    if (f->nmeta) memcpy(f->meta_sorted, f->meta, sizeof(smp__ckpt_meta) * (size_t)f->nmeta);
    qsort(f->meta_sorted, (size_t)f->nmeta, sizeof *f->meta_sorted, smp__ckpt_cmp_meta);
    for (i = 1; i < f->nmeta; i++)
        if (!strcmp(f->meta_sorted[i - 1].key, f->meta_sorted[i].key))
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL, "metadata key '%s' appears twice",
                                  f->meta_sorted[i].key);
    for (i = 0; i < f->nmeta; i++) {
        const char *k = f->meta[i].key, *v = f->meta[i].value, *name;
        size_t plen = strlen(SMP__CKPT_CRC_PREFIX);
        smp_ckpt_info *e;
        uint32_t hi, lo;
        int j;
        if (!smp__ckpt_starts(k, SMP__CKPT_CRC_KEY)) continue;
        name = k + strlen(SMP__CKPT_CRC_KEY);
        e = smp__ckpt_lookup(f, name);
        if (!e)
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, name,
                                  "metadata holds a checksum for it, but the header has no such tensor");
        if (strlen(v) != plen + 8 || strncmp(v, SMP__CKPT_CRC_PREFIX, plen) != 0)
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, name,
                                  "checksum \"%s\" is not \"" SMP__CKPT_CRC_PREFIX "\" and 8 hex digits", v);
        for (j = 0; j < 8; j++) {
            char c = v[plen + j];
            if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
                return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, name,
                                      "checksum \"%s\" is not \"" SMP__CKPT_CRC_PREFIX "\" and 8 lowercase hex digits",
                                      v);
        }
        smp__ckpt_hex4((const uint8_t *)v + plen, &hi);
        smp__ckpt_hex4((const uint8_t *)v + plen + 4, &lo);
        e->has_checksum = true;
        e->checksum = (hi << 16) | lo;
    }
    return SMP_OK;
}

static smp_status smp__ckpt_parse(smp_ckpt_file *f) {
    smp__ckpt_jp jp;
    smp_status st;
    int have_meta = 0;
    memset(&jp, 0, sizeof jp);
    jp.s = f->header;
    jp.n = f->header_len;
    jp.label = f->label;
    if (jp.n == 0 || jp.s[0] != '{') return smp__ckpt_jerr(&jp, "the header must start with '{'");
    jp.i = 1;
    if (!smp__ckpt_eat(&jp, '}')) {
        for (;;) {
            const char *name;
            jp.tensor = NULL;
            if ((st = smp__ckpt_jstring(&jp, &name, "a tensor name")) != SMP_OK) return st;
            if (!smp__ckpt_eat(&jp, ':')) return smp__ckpt_jerr(&jp, "expected ':' after name '%s'", name);
            if (!strcmp(name, "__metadata__")) {
                if (have_meta++) return smp__ckpt_jerr(&jp, "__metadata__ appears twice");
                if ((st = smp__ckpt_parse_meta(&jp, f)) != SMP_OK) return st;
            } else {
                smp_ckpt_info *e;
                if (!smp__ckpt_grow((void **)&f->info, &f->cap, f->n + 1, sizeof *f->info))
                    return smp__ckpt_fail(SMP_ERR_NOMEM, f->label, NULL, "out of memory reading the header");
                e = &f->info[f->n++];
                memset(e, 0, sizeof *e);
                e->name = name;
                jp.tensor = name;
                if ((st = smp__ckpt_parse_tensor(&jp, e)) != SMP_OK) return st;
                jp.tensor = NULL;
            }
            if (smp__ckpt_eat(&jp, ',')) continue;
            if (smp__ckpt_eat(&jp, '}')) break;
            return smp__ckpt_jerr(&jp, "expected ',' or '}' after '%s'", name);
        }
    }
    smp__ckpt_ws(&jp);
    if (jp.i != jp.n) return smp__ckpt_jerr(&jp, "only spaces may follow the header's closing '}'");
    return smp__ckpt_validate(f);
}

static smp_status smp__ckpt_pread_all(smp_ckpt_file *f, void *dst, size_t n, uint64_t off) {
    char *p = (char *)dst;
    if (f->mem) {
        if (off > f->size || n > f->size - off)
            return smp__ckpt_fail(SMP_ERR_IO, f->label, NULL, "read past the end of the image");
        memcpy(dst, f->mem + off, n);
        return SMP_OK;
    }
#ifndef SMP__CKPT_POSIX2008
    if (lseek(f->fd, (off_t)off, SEEK_SET) < 0)
        return smp__ckpt_fail(SMP_ERR_IO, f->label, NULL, "seek failed: %s", strerror(errno));
#endif
    while (n) {
#ifdef SMP__CKPT_POSIX2008
        ssize_t k = pread(f->fd, p, n, (off_t)off);
#else
        ssize_t k = read(f->fd, p, n);
#endif
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return smp__ckpt_fail(SMP_ERR_IO, f->label, NULL, "read failed: %s", strerror(errno));
        if (k == 0)
            return smp__ckpt_fail(SMP_ERR_IO, f->label, NULL,
                                  "the file ends at byte %llu, before its data does (was it truncated while open?)",
                                  (smp__ckpt_ull)off);
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return SMP_OK;
}

/* Reads the length prefix and the header of an opened f and validates it. */
static smp_status smp__ckpt_load(smp_ckpt_file *f) {
    uint8_t pre[8];
    uint64_t hlen = 0;
    smp_status st;
    int i;
    if (f->size < 8)
        return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL,
                              "the file is %llu bytes, shorter than the 8-byte header length it must start with",
                              (smp__ckpt_ull)f->size);
    if ((st = smp__ckpt_pread_all(f, pre, 8, 0)) != SMP_OK) return st;
    for (i = 7; i >= 0; i--) hlen = (hlen << 8) | pre[i];
    if (hlen > f->size - 8)
        return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL,
                              "the header length %llu is larger than the file (%llu bytes after the length)",
                              (smp__ckpt_ull)hlen, (smp__ckpt_ull)(f->size - 8));
    if (hlen > SMP__CKPT_MAX_HEADER)
        return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL, "the header length %llu is over the %llu-byte limit",
                              (smp__ckpt_ull)hlen, (smp__ckpt_ull)SMP__CKPT_MAX_HEADER);
    f->header_len = (size_t)hlen;
    f->data_start = 8 + hlen;
    f->data_len = f->size - f->data_start;
    f->header = (uint8_t *)SMP_MALLOC(f->header_len + 1);
    if (!f->header) return smp__ckpt_fail(SMP_ERR_NOMEM, f->label, NULL, "out of memory for a %llu-byte header",
                                          (smp__ckpt_ull)hlen);
    if ((st = smp__ckpt_pread_all(f, f->header, f->header_len, 8)) != SMP_OK) return st;
    f->header[f->header_len] = 0;
    return smp__ckpt_parse(f);
}

static smp_ckpt_file *smp__ckpt_file_new(const char *path) {
    smp_ckpt_file *f = (smp_ckpt_file *)SMP_MALLOC(sizeof *f);
    size_t n;
    if (!f) return NULL;
    memset(f, 0, sizeof *f);
    f->fd = -1;
    n = strlen(path) + 16;
    f->path = smp__ckpt_strdup(path);
    f->label = (char *)SMP_MALLOC(n);
    if (!f->path || !f->label) {
        smp_ckpt_close(f);
        return NULL;
    }
    snprintf(f->label, n, "checkpoint '%s'", path);
    return f;
}

SMPDEF smp_status smp_ckpt_open(smp_ckpt_file **out, const char *path) {
    smp_ckpt_file *f;
    struct stat sb;
    smp_status st;
    if (!out) return smp_error(SMP_ERR_ARG, "smp_ckpt_open: out is NULL");
    *out = NULL;
    if (!path) return smp_error(SMP_ERR_ARG, "smp_ckpt_open: path is NULL");
    f = smp__ckpt_file_new(path);
    if (!f) return smp_error(SMP_ERR_NOMEM, "checkpoint '%s': out of memory", path);
    f->fd = open(path, O_RDONLY | SMP__CKPT_O_CLOEXEC);
    if (f->fd < 0) {
        st = smp_error(SMP_ERR_IO, "cannot open checkpoint '%s': %s", path, strerror(errno));
        smp_ckpt_close(f);
        return st;
    }
    if (fstat(f->fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        st = smp_error(SMP_ERR_IO, "checkpoint '%s' is not a regular file", path);
        smp_ckpt_close(f);
        return st;
    }
    f->size = (uint64_t)sb.st_size;
    if ((st = smp__ckpt_load(f)) != SMP_OK) {
        smp_ckpt_close(f);
        return st;
    }
    *out = f;
    return SMP_OK;
}

SMPDEF smp_status smp__ckpt_open_memory(smp_ckpt_file **out, const char *label, const void *bytes, size_t n) {
    smp_ckpt_file *f;
    smp_status st;
    if (!out) return smp_error(SMP_ERR_ARG, "smp__ckpt_open_memory: out is NULL");
    *out = NULL;
    if (!bytes && n) return smp_error(SMP_ERR_ARG, "smp__ckpt_open_memory: bytes is NULL");
    f = smp__ckpt_file_new(label ? label : "<memory>");
    if (!f) return smp_error(SMP_ERR_NOMEM, "out of memory");
    f->mem = (const uint8_t *)(bytes ? bytes : "");
    f->size = n;
    if ((st = smp__ckpt_load(f)) != SMP_OK) {
        smp_ckpt_close(f);
        return st;
    }
    *out = f;
    return SMP_OK;
}

SMPDEF void smp_ckpt_close(smp_ckpt_file *f) {
    if (!f) return;
    if (f->map && !f->mem) munmap((void *)(uintptr_t)f->map, (size_t)f->size);
    if (f->fd >= 0) close(f->fd);
    smp__ckpt_free(f->path);
    smp__ckpt_free(f->label);
    smp__ckpt_free(f->header);
    smp__ckpt_free(f->info);
    smp__ckpt_free(f->by_name);
    smp__ckpt_free(f->meta);
    smp__ckpt_free(f->meta_sorted);
    SMP_FREE(f);
}

SMPDEF const char *smp_ckpt_path(const smp_ckpt_file *f) { return f ? f->path : NULL; }
SMPDEF int smp_ckpt_count(const smp_ckpt_file *f) { return f ? f->n : 0; }

SMPDEF const smp_ckpt_info *smp_ckpt_info_at(const smp_ckpt_file *f, int i) {
    return (f && i >= 0 && i < f->n) ? &f->info[i] : NULL;
}

SMPDEF const smp_ckpt_info *smp_ckpt_find(const smp_ckpt_file *f, const char *name) {
    const smp_ckpt_info *e;
    if (!f || !name) {
        smp_error(SMP_ERR_ARG, "smp_ckpt_find: file or name is NULL");
        return NULL;
    }
    e = smp__ckpt_lookup(f, name);
    if (!e) smp__ckpt_fail(SMP_ERR_ARG, f->label, name, "no tensor of that name in the file (%d tensors)", f->n);
    return e;
}

SMPDEF int smp_ckpt_meta_count(const smp_ckpt_file *f) { return f ? f->nmeta : 0; }

SMPDEF void smp_ckpt_meta_at(const smp_ckpt_file *f, int i, const char **key, const char **value) {
    int ok = f && i >= 0 && i < f->nmeta;
    if (key) *key = ok ? f->meta[i].key : NULL;
    if (value) *value = ok ? f->meta[i].value : NULL;
}

SMPDEF const char *smp_ckpt_meta(const smp_ckpt_file *f, const char *key) {
    int lo = 0, hi;
    if (!f || !key) return NULL;
    hi = f->nmeta - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(f->meta_sorted[mid].key, key);
        if (!c) return f->meta_sorted[mid].value;
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

static smp_status smp__ckpt_check_entry(const smp_ckpt_file *f, const smp_ckpt_info *e, const char *fn) {
    uintptr_t p = (uintptr_t)e, lo, hi;
    if (!f || !e) return smp_error(SMP_ERR_ARG, "%s: file or entry is NULL", fn);
    lo = (uintptr_t)f->info;
    hi = (uintptr_t)(f->info + f->n);
    if (p < lo || p >= hi || (p - lo) % sizeof *e)
        return smp__ckpt_fail(SMP_ERR_ARG, f->label, NULL, "%s: the entry does not belong to this file", fn);
    return SMP_OK;
}

SMPDEF smp_status smp_ckpt_read_range(smp_ckpt_file *f, const smp_ckpt_info *e, uint64_t offset, void *dst,
                                      size_t n) {
    smp_status st = smp__ckpt_check_entry(f, e, "smp_ckpt_read_range");
    if (st) return st;
    if (offset > e->nbytes || n > e->nbytes - offset)
        return smp__ckpt_fail(SMP_ERR_ARG, f->label, e->name, "bytes [%llu, %llu) are outside its %llu bytes",
                              (smp__ckpt_ull)offset, (smp__ckpt_ull)offset + (smp__ckpt_ull)n,
                              (smp__ckpt_ull)e->nbytes);
    if (n && !dst) return smp__ckpt_fail(SMP_ERR_ARG, f->label, e->name, "destination is NULL");
    if (!n) return SMP_OK;
    return smp__ckpt_pread_all(f, dst, n, f->data_start + e->offset + offset);
}

static smp_status smp__ckpt_mismatch(const smp_ckpt_file *f, const smp_ckpt_info *e, uint32_t got) {
    return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, e->name,
                          "checksum mismatch: the header records " SMP__CKPT_CRC_PREFIX "%08x but the data gives "
                          SMP__CKPT_CRC_PREFIX "%08x (the data is corrupt)",
                          (unsigned)e->checksum, (unsigned)got);
}

SMPDEF smp_status smp_ckpt_read(smp_ckpt_file *f, const smp_ckpt_info *e, void *dst, size_t cap) {
    smp_status st = smp__ckpt_check_entry(f, e, "smp_ckpt_read");
    uint32_t got;
    if (st) return st;
    if (cap < e->nbytes)
        return smp__ckpt_fail(SMP_ERR_ARG, f->label, e->name, "a buffer of %zu bytes cannot hold its %llu bytes", cap,
                              (smp__ckpt_ull)e->nbytes);
    if ((st = smp_ckpt_read_range(f, e, 0, dst, (size_t)e->nbytes)) != SMP_OK) return st;
    if (!e->has_checksum) return SMP_OK;
    got = smp_ckpt_crc32c(0, dst, (size_t)e->nbytes);
    return got == e->checksum ? SMP_OK : smp__ckpt_mismatch(f, e, got);
}

SMPDEF smp_status smp_ckpt_verify_all(smp_ckpt_file *f) {
    uint8_t *buf;
    size_t cap = SMP__CKPT_IO_CHUNK;
    smp_status st = SMP_OK;
    int i;
    if (!f) return smp_error(SMP_ERR_ARG, "smp_ckpt_verify_all: file is NULL");
    if (f->data_len < cap) cap = f->data_len ? (size_t)f->data_len : 1;
    buf = (uint8_t *)SMP_MALLOC(cap);
    if (!buf) return smp__ckpt_fail(SMP_ERR_NOMEM, f->label, NULL, "out of memory");
    for (i = 0; i < f->n && !st; i++) {
        const smp_ckpt_info *e = &f->info[i];
        uint64_t off = 0;
        uint32_t crc = 0;
        if (!e->has_checksum) continue;
        while (off < e->nbytes && !st) {
            size_t k = e->nbytes - off < cap ? (size_t)(e->nbytes - off) : cap;
            st = smp_ckpt_read_range(f, e, off, buf, k);
            crc = smp_ckpt_crc32c(crc, buf, k);
            off += k;
        }
        if (!st && crc != e->checksum) st = smp__ckpt_mismatch(f, e, crc);
    }
    SMP_FREE(buf);
    return st;
}

#ifdef __cplusplus
}
#endif
#endif /* SMP_IMPLEMENTATION */
