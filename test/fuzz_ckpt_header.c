/* fuzz_ckpt_header.c - libFuzzer harness for smp_checkpoint.h's readers.

   Each input is a whole file image (8-byte length, JSON header, data). It
   goes through smp__ckpt_open_memory, the validation smp_ckpt_open runs on
   a file, and through smp__ckpt_manifest_check, the parser of a partial
   checkpoint's manifest (which must accept or reject it with a message). Rejected inputs must be SMP_ERR_FORMAT with a
   message; accepted ones must satisfy what the reader promises (lookups, coverage of the data, checksums) and must
   survive a write + read round trip through the writer (names and metadata re-escaped, bytes identical).

   Build and run from the repository root (clang 14; the fuzzer runtime is
   Debian's libclang-rt-14-dev):
     mpicc -cc=clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined \
           -fno-sanitize-recover=all test/fuzz_ckpt_header.c -o /tmp/fuzz_ckpt_header -lm
     python3 test/gen_ckpt_corpus.py            # refreshes test/corpus/ckpt
     mkdir -p /tmp/ckpt_corpus && /tmp/fuzz_ckpt_header -max_total_time=60 \
           -dict=test/corpus/ckpt.dict /tmp/ckpt_corpus test/corpus/ckpt
   (new inputs go to the first folder, so the checked-in seeds stay small)
*/
#define _POSIX_C_SOURCE 200809L
#define SMP_TESTING /* smp__ckpt_open_memory, smp__ckpt_manifest_check */
#define SMP_IMPLEMENTATION
#include "../smp_checkpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FUZZ_ASSERT(c)                                                                                     \
    do {                                                                                                   \
        if (!(c)) {                                                                                        \
            fprintf(stderr, "fuzz_ckpt_header: %s:%d: %s failed (%s)\n", __FILE__, __LINE__, #c,           \
                    smp_last_error());                                                                     \
            abort();                                                                                       \
        }                                                                                                  \
    } while (0)

static char tmp_path[256];

static void round_trip(smp_ckpt_file *f, const uint8_t *image, uint64_t data_start) {
    int n = smp_ckpt_count(f), nm = smp_ckpt_meta_count(f), i, k, nk = 0;
    smp_ckpt_entry *ents;
    const char **keys, **vals;
    smp_ckpt_file *g;
    if (n > 64) return;
    for (i = 0; i < n; i++)
        if (!smp_ckpt_info_at(f, i)->name[0]) return; /* the writer refuses empty names */
    ents = (smp_ckpt_entry *)calloc((size_t)n + 1, sizeof *ents);
    keys = (const char **)calloc((size_t)nm + 1, sizeof *keys);
    vals = (const char **)calloc((size_t)nm + 1, sizeof *vals);
    for (i = 0; i < n; i++) {
        const smp_ckpt_info *e = smp_ckpt_info_at(f, i);
        ents[i].name = e->name;
        ents[i].dtype = e->dtype;
        ents[i].ndim = e->ndim;
        for (k = 0; k < e->ndim; k++) ents[i].shape[k] = e->shape[k];
        ents[i].data = image + data_start + e->offset;
    }
    for (i = 0; i < nm; i++) {
        smp_ckpt_meta_at(f, i, &keys[nk], &vals[nk]);
        if (strncmp(keys[nk], "smp.checksum.", 13) != 0) nk++; /* the writer makes its own */
    }
    FUZZ_ASSERT(smp_ckpt_write_file(tmp_path, ents, n, keys, vals, nk) == SMP_OK);
    FUZZ_ASSERT(smp_ckpt_open(tmp_path, &g) == SMP_OK);
    FUZZ_ASSERT(smp_ckpt_count(g) == n);
    for (i = 0; i < n; i++) {
        const smp_ckpt_info *a = smp_ckpt_info_at(f, i), *b = smp_ckpt_info_at(g, i);
        uint8_t *buf = (uint8_t *)malloc(b->nbytes + 1);
        FUZZ_ASSERT(!strcmp(a->name, b->name) && a->dtype == b->dtype && a->ndim == b->ndim && a->nbytes == b->nbytes);
        FUZZ_ASSERT(b->has_checksum);
        FUZZ_ASSERT(smp_ckpt_read(g, b, buf, b->nbytes) == SMP_OK);
        FUZZ_ASSERT(b->nbytes == 0 || !memcmp(buf, image + data_start + a->offset, b->nbytes));
        free(buf);
    }
    for (i = 0; i < nk; i++) FUZZ_ASSERT(smp_ckpt_meta(g, keys[i]) && !strcmp(smp_ckpt_meta(g, keys[i]), vals[i]));
    smp_ckpt_close(g);
    free(ents);
    free(keys);
    free(vals);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    smp_ckpt_file *f;
    smp_status st;
    uint64_t hlen = 0, data_start, data_len, covered = 0;
    int i, n;

    if (!tmp_path[0]) {
        const char *d = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(tmp_path, sizeof tmp_path, "%s/fuzz_ckpt_%ld.safetensors", d, (long)getpid());
    }
    smp_error(SMP_OK, "%s", "");
    /* every input is also a partial checkpoint's manifest to the manifest parser */
    st = smp__ckpt_manifest_check(data, size, "fuzz manifest");
    FUZZ_ASSERT(st == SMP_OK || (st == SMP_ERR_FORMAT && strstr(smp_last_error(), "fuzz manifest")));
    st = smp__ckpt_open_memory(&f, "fuzz", data, size);
    if (st != SMP_OK) {
        FUZZ_ASSERT(st == SMP_ERR_FORMAT && smp_last_error()[0] && strstr(smp_last_error(), "fuzz"));
        return 0;
    }
    FUZZ_ASSERT(size >= 8);
    for (i = 7; i >= 0; i--) hlen = (hlen << 8) | data[i];
    data_start = 8 + hlen;
    data_len = size - data_start;
    n = smp_ckpt_count(f);
    for (i = 0; i < n; i++) {
        const smp_ckpt_info *e = smp_ckpt_info_at(f, i);
        uint8_t *buf = (uint8_t *)malloc(e->nbytes + 1);
        FUZZ_ASSERT(smp_ckpt_find(f, e->name) == e);
        FUZZ_ASSERT(e->offset + e->nbytes <= data_len);
        covered += e->nbytes;
        st = smp_ckpt_read(f, e, buf, e->nbytes);
        if (e->has_checksum) {
            uint32_t crc = smp_ckpt_crc32c(0, data + data_start + e->offset, e->nbytes);
            FUZZ_ASSERT(st == (crc == e->checksum ? SMP_OK : SMP_ERR_FORMAT));
        } else {
            FUZZ_ASSERT(st == SMP_OK);
        }
        FUZZ_ASSERT(e->nbytes == 0 || !memcmp(buf, data + data_start + e->offset, e->nbytes));
        free(buf);
    }
    FUZZ_ASSERT(covered == data_len); /* no overlaps, no gaps */
    for (i = 0; i < smp_ckpt_meta_count(f); i++) {
        const char *k, *v;
        smp_ckpt_meta_at(f, i, &k, &v);
        FUZZ_ASSERT(smp_ckpt_meta(f, k) == v);
    }
    st = smp_ckpt_verify_all(f);
    FUZZ_ASSERT(st == SMP_OK || st == SMP_ERR_FORMAT);
    if (st == SMP_OK) round_trip(f, data, data_start);
    smp_ckpt_close(f);
    return 0;
}
