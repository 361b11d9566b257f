/* fuzz_config.c - libFuzzer harness for smp.h's config JSON reader.

   Each input is a config document as a user would put in SMP_CONFIG (the
   bytes up to the first NUL, which is where a C string ends). It goes
   through smp_config_from_json and the harness checks what smp.h promises:

   - the status is SMP_OK or SMP_ERR_CONFIG, and the result does not depend
     on what *cfg held before: the same status and the same message whether
     cfg starts zeroed or full of arbitrary bytes;
   - on error: "On any error *cfg is left untouched" (compared byte for byte,
     padding included); the message is non-empty, printable (control bytes
     escaped), valid UTF-8, and a syntax error's byte offset lies inside the
     input;
   - on success: every field whose key the document names is overwritten and
     every other field keeps its old value ("on top of what cfg already
     holds"); MPI_Comm is never touched;
   - a truncated document (cut anywhere before its closing '}') is a syntax
     error at or before the cut ("a truncated document reports the
     truncation"), and trailing whitespace changes nothing;
   - a parsed config written back as JSON (every set key, doubles with 17
     digits, keys in either order) parses to the same values, bitwise;
   - smp_config_resolve on a parsed config returns SMP_OK or SMP_ERR_CONFIG
     with a message, returns SMP_OK when every value is in its documented
     range, and a resolved config resolves to itself.

   Build and run from the repository root (clang 14 with libclang-rt-14-dev):
     mpicc -cc=clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined \
           -fno-sanitize-recover=all -I. test/fuzz_config.c -o /tmp/fuzz_config -lm
     python3 test/gen_config_corpus.py           # refreshes test/corpus/config
     mkdir -p /tmp/config_corpus && /tmp/fuzz_config -max_total_time=60 \
           -dict=test/corpus/config.dict /tmp/config_corpus test/corpus/config
   Reproduce a finding: /tmp/fuzz_config path/to/crash-file

   It also checks that integer keys hold exactly the number their token
   spells (smp.h once rounded 2.0-style tokens through a double; the seeds
   test/corpus/config/num_*.json are the cases that caught it).
*/
#define _POSIX_C_SOURCE 200809L
#define SMP_TESTING /* the test hooks and test-only introspection */
#define SMP_IMPLEMENTATION
#include "../smp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *cur_input = "";

#define FUZZ_ASSERT(c, ...)                                                                                 \
    do {                                                                                                    \
        if (!(c)) {                                                                                         \
            fprintf(stderr, "fuzz_config: %s:%d: %s failed: ", __FILE__, __LINE__, #c);                   \
            fprintf(stderr, __VA_ARGS__);                                                                   \
            fprintf(stderr, "\n  last error: %s\n  input: %.300s\n", smp_last_error(), cur_input);         \
            abort();                                                                                        \
        }                                                                                                   \
    } while (0)

/* ------------------------------------------------------------ helpers */
static uint64_t fnv1a(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static uint64_t next_rand(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int same_double(double a, double b) { return memcmp(&a, &b, sizeof a) == 0; }

/* Field by field, doubles bitwise (padding is not a field: copies need not keep it). */
static int cfg_equal(const smp_config *a, const smp_config *b) {
    return a->partitions == b->partitions && a->pipeline_parallel_degree == b->pipeline_parallel_degree &&
           a->tensor_parallel_degree == b->tensor_parallel_degree && a->microbatches == b->microbatches &&
           a->pipeline == b->pipeline && a->optimize == b->optimize && a->auto_partition == b->auto_partition &&
           a->default_partition == b->default_partition && a->has_default_partition == b->has_default_partition &&
           a->ddp == b->ddp && a->placement_strategy == b->placement_strategy &&
           same_double(a->memory_weight, b->memory_weight) && a->has_memory_weight == b->has_memory_weight &&
           a->trace_device == b->trace_device && a->trace_execution_times == b->trace_execution_times &&
           a->trace_memory_usage == b->trace_memory_usage && a->overlapping_allreduce == b->overlapping_allreduce &&
           a->backward_passes_per_step == b->backward_passes_per_step &&
           a->average_grads_across_microbatches == b->average_grads_across_microbatches &&
           same_double(a->bucket_cap_mb, b->bucket_cap_mb) && a->broadcast_buffers == b->broadcast_buffers &&
           a->activation_checkpointing == b->activation_checkpointing && a->virtual_stages == b->virtual_stages &&
           a->active_microbatches == b->active_microbatches && a->shard_optimizer_state == b->shard_optimizer_state &&
           a->deterministic_reduction == b->deterministic_reduction && same_double(a->timeout, b->timeout) &&
           a->seed == b->seed && memcmp(&a->comm, &b->comm, sizeof a->comm) == 0;
}

/* Arbitrary bytes everywhere (padding too), but a valid bool. */
static void fill_arbitrary(smp_config *c, uint64_t seed) {
    unsigned char *p = (unsigned char *)c;
    for (size_t i = 0; i < sizeof *c; i++) p[i] = (unsigned char)next_rand(&seed);
    c->has_default_partition = (next_rand(&seed) & 1) != 0;
    c->has_memory_weight = (next_rand(&seed) & 1) != 0;
}

/* A well-formed message: non-empty, no control bytes, valid UTF-8, not cut off. */
static void check_message(const char *what) {
    const unsigned char *m = (const unsigned char *)smp_last_error();
    size_t n = strlen((const char *)m), i = 0;
    FUZZ_ASSERT(n > 0, "%s: empty error message", what);
    FUZZ_ASSERT(n < 2047, "%s: error message fills the whole buffer (%zu bytes): cut off?", what, n);
    while (i < n) {
        unsigned c = m[i];
        size_t k;
        FUZZ_ASSERT(c >= 0x20 && c != 0x7f, "%s: raw control byte 0x%02x at %zu of the message", what, c, i);
        if (c < 0x80) { i++; continue; }
        k = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
        FUZZ_ASSERT(k && i + k <= n, "%s: invalid UTF-8 lead byte 0x%02x at %zu of the message", what, c, i);
        for (size_t x = 1; x < k; x++)
            FUZZ_ASSERT((m[i + x] & 0xC0) == 0x80, "%s: invalid UTF-8 at %zu of the message", what, i + x);
        i += k;
    }
}

/* The byte offset of a syntax error, or -1 when the message is not one. */
static long syntax_offset(void) {
    const char *m = smp_last_error(), *pre = "invalid config JSON at byte ";
    if (strncmp(m, pre, strlen(pre)) != 0) return -1;
    return strtol(m + strlen(pre), NULL, 10);
}

/* Writes every key a parse from zero set (as read by the parser: the values
   are valid JSON values), in forward or reverse order. */
static size_t write_json(const smp_config *c, bool reverse, char *out, size_t cap) {
    static const char *pipe[] = {"", "interleaved", "simple", "zero_bubble", "zero_bubble_v"},
                      *opt[] = {"", "speed", "memory"},
                      *place[] = {"", "cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD"},
                      *trace[] = {"", "cpu", "gpu"};
    char item[32][128];
    int n = 0;
#define PUT(...) snprintf(item[n++], sizeof item[0], __VA_ARGS__)
#define SW(key, v) if ((v) != SMP_DEFAULT) PUT("\"%s\": %s", key, (v) == SMP_ON ? "true" : "false")
    if (c->partitions) PUT("\"partitions\": %d", c->partitions);
    if (c->pipeline_parallel_degree) PUT("\"pipeline_parallel_degree\": %d", c->pipeline_parallel_degree);
    if (c->tensor_parallel_degree) PUT("\"tensor_parallel_degree\": %d", c->tensor_parallel_degree);
    if (c->microbatches) PUT("\"microbatches\": %d", c->microbatches);
    if (c->pipeline) PUT("\"pipeline\": \"%s\"", pipe[c->pipeline]);
    if (c->optimize) PUT("\"optimize\": \"%s\"", opt[c->optimize]);
    SW("auto_partition", c->auto_partition);
    if (c->has_default_partition) PUT("\"default_partition\": %d", c->default_partition);
    SW("ddp", c->ddp);
    if (c->placement_strategy) PUT("\"placement_strategy\": \"%s\"", place[c->placement_strategy]);
    if (c->has_memory_weight) PUT("\"memory_weight\": %.17g", c->memory_weight);
    if (c->trace_device) PUT("\"trace_device\": \"%s\"", trace[c->trace_device]);
    SW("trace_execution_times", c->trace_execution_times);
    SW("trace_memory_usage", c->trace_memory_usage);
    SW("overlapping_allreduce", c->overlapping_allreduce);
    if (c->backward_passes_per_step) PUT("\"backward_passes_per_step\": %d", c->backward_passes_per_step);
    SW("average_grads_across_microbatches", c->average_grads_across_microbatches);
    if (c->bucket_cap_mb != 0) PUT("\"bucket_cap_mb\": %.17g", c->bucket_cap_mb);
    SW("broadcast_buffers", c->broadcast_buffers);
    SW("activation_checkpointing", c->activation_checkpointing);
    if (c->virtual_stages) PUT("\"virtual_stages\": %d", c->virtual_stages);
    if (c->active_microbatches) PUT("\"active_microbatches\": %d", c->active_microbatches);
    SW("shard_optimizer_state", c->shard_optimizer_state);
    SW("deterministic_reduction", c->deterministic_reduction);
    if (c->timeout != 0) PUT("\"timeout\": %.17g", c->timeout);
    if (c->seed) PUT("\"seed\": %llu", (unsigned long long)c->seed);
#undef SW
#undef PUT
    size_t o = (size_t)snprintf(out, cap, "{");
    for (int i = 0; i < n; i++)
        o += (size_t)snprintf(out + o, cap - o, "%s%s", i ? ",\n " : "", item[reverse ? n - 1 - i : i]);
    o += (size_t)snprintf(out + o, cap - o, "}");
    return o;
}

/* Parses s onto a zeroed config and onto arbitrary bytes; checks both agree. */
static smp_status parse_both(const char *s, uint64_t seed, smp_config *zero_out) {
    smp_config z, a, a_before;
    smp_status sz, sa;
    char msg[2048];
    memset(&z, 0, sizeof z);
    fill_arbitrary(&a, seed);
    memcpy(&a_before, &a, sizeof a);

    smp_error(SMP_OK, "%s", "");
    sa = smp_config_from_json(s, &a);
    snprintf(msg, sizeof msg, "%s", smp_last_error());
    smp_error(SMP_OK, "%s", "");
    sz = smp_config_from_json(s, &z);
    FUZZ_ASSERT(sz == SMP_OK || sz == SMP_ERR_CONFIG, "status %d", (int)sz);
    FUZZ_ASSERT(sz == sa, "status %d from a zeroed config but %d from one with other contents", (int)sz, (int)sa);
    if (sz != SMP_OK) {
        FUZZ_ASSERT(strcmp(msg, smp_last_error()) == 0, "the message depends on what cfg held: '%s'", msg);
        FUZZ_ASSERT(memcmp(&a, &a_before, sizeof a) == 0, "on error *cfg was changed");
        check_message("smp_config_from_json");
        long at = syntax_offset();
        FUZZ_ASSERT(at <= (long)strlen(s), "a syntax error at byte %ld of a %zu-byte input", at, strlen(s));
        FUZZ_ASSERT(at >= 0 || strstr(smp_last_error(), "config key"), "neither a syntax error nor a key error");
        return sz;
    }
    /* on success: keys named overwrite, the rest keep their old value */
#define KEEP(f) FUZZ_ASSERT(z.f == 0 ? a.f == a_before.f : a.f == z.f, "field " #f " not merged")
#define KEEPD(f) FUZZ_ASSERT(z.f == 0 ? same_double(a.f, a_before.f) : same_double(a.f, z.f), "field " #f " not merged")
    KEEP(partitions);
    KEEP(pipeline_parallel_degree);
    KEEP(tensor_parallel_degree);
    KEEP(microbatches);
    KEEP(pipeline);
    KEEP(optimize);
    KEEP(auto_partition);
    KEEP(ddp);
    KEEP(placement_strategy); KEEP(trace_device); KEEP(trace_execution_times); KEEP(trace_memory_usage);
    KEEP(overlapping_allreduce); KEEP(backward_passes_per_step); KEEP(average_grads_across_microbatches);
    KEEP(broadcast_buffers); KEEP(activation_checkpointing); KEEP(virtual_stages); KEEP(deterministic_reduction);
    KEEPD(bucket_cap_mb); KEEPD(timeout);
#undef KEEP
#undef KEEPD
    /* 0 is a value these keys can take, so a zero result says nothing */
    FUZZ_ASSERT(z.has_memory_weight ? a.has_memory_weight && same_double(a.memory_weight, z.memory_weight)
                                    : a.has_memory_weight == a_before.has_memory_weight &&
                                          same_double(a.memory_weight, a_before.memory_weight),
                "field memory_weight not merged");
    FUZZ_ASSERT(a.seed == z.seed || (z.seed == 0 && a.seed == a_before.seed), "field seed not merged");
    FUZZ_ASSERT(z.has_default_partition ? a.has_default_partition && a.default_partition == z.default_partition
                                        : a.has_default_partition == a_before.has_default_partition &&
                                              a.default_partition == a_before.default_partition,
                "field default_partition not merged");
    FUZZ_ASSERT(memcmp(&a.comm, &a_before.comm, sizeof a.comm) == 0, "comm was changed");
    *zero_out = z;
    return sz;
}

static int in_range(const smp_config *c, int world) {
    int pp = c->partitions ? c->partitions : c->pipeline_parallel_degree ? c->pipeline_parallel_degree : 1;
    /* one setting, two values */
    if (c->partitions && c->pipeline_parallel_degree && c->partitions != c->pipeline_parallel_degree) return 0;
    return (long long)pp * (c->tensor_parallel_degree ? c->tensor_parallel_degree : 1) <= world &&
           (!c->has_default_partition || (c->default_partition >= 0 && c->default_partition < pp)) &&
           (c->has_default_partition || c->default_partition == 0) && (c->has_memory_weight || c->memory_weight == 0) &&
           c->memory_weight >= 0 && c->memory_weight <= 1 && c->bucket_cap_mb <= 1e6 && c->timeout <= 1e9 &&
           (c->pipeline != SMP_PIPELINE_ZERO_BUBBLE_V || c->virtual_stages <= 2) && /* its V: 2 stages per partition */
           (c->shard_optimizer_state != SMP_ON ||
            (c->ddp == SMP_ON && world / (c->partitions ? c->partitions : 1) >= 2));
}

static void check_resolve(const smp_config *z) {
    smp_config r, r2;
    long long mp = (long long)(z->partitions                 ? z->partitions
                               : z->pipeline_parallel_degree ? z->pipeline_parallel_degree
                                                             : 1) *
                   (z->tensor_parallel_degree ? z->tensor_parallel_degree : 1);
    int world = mp > INT_MAX ? 1 : (int)mp; /* a replica too big for any world fails below, and in_range says so */
    smp_status st;
    smp_error(SMP_OK, "%s", "");
    st = smp_config_resolve(z, world, &r);
    FUZZ_ASSERT(st == SMP_OK || st == SMP_ERR_CONFIG, "smp_config_resolve returned %d", (int)st);
    if (st != SMP_OK) {
        check_message("smp_config_resolve");
        FUZZ_ASSERT(!in_range(z, world), "a parsed config with every value in range does not resolve");
        return;
    }
    FUZZ_ASSERT(r.partitions >= 1 && r.microbatches >= 1 && r.backward_passes_per_step >= 1 && r.virtual_stages >= 1 &&
                    r.pipeline != 0 && r.optimize != 0 && r.placement_strategy != 0 && r.trace_device != 0 &&
                    r.ddp != 0 && r.auto_partition != 0 && r.overlapping_allreduce != 0 && r.timeout > 0 &&
                    r.bucket_cap_mb > 0 && r.memory_weight >= 0 && r.memory_weight <= 1,
                "a resolved config keeps a default or an out-of-range value");
    st = smp_config_resolve(&r, world, &r2);
    FUZZ_ASSERT(st == SMP_OK && cfg_equal(&r, &r2), "resolving a resolved config changes it (status %d)", (int)st);
}

/* Integer keys hold the number their token spells, exactly: 2.0 and 2e0 are
   2, 1.9999999999999999 is not an integer, 12345678901234567890.0 is not
   12345678901234567168. Only top-level members whose key has no escape are
   looked at. */
static const char *skip_string(const char *p) {
    for (p++; *p != '"'; p++)
        if (*p == '\\') p++;
    return p + 1;
}
static const char *skip_value(const char *p) {
    if (*p == '"') return skip_string(p);
    if (*p == '{' || *p == '[') {
        int d = 0;
        do {
            if (*p == '"') { p = skip_string(p); continue; }
            if (*p == '{' || *p == '[') d++;
            else if (*p == '}' || *p == ']') d--;
            p++;
        } while (d > 0);
        return p;
    }
    while (*p && !strchr(",}] \t\r\n", *p)) p++;
    return p;
}
/* The integer a number token spells, as decimal digits with a sign ("0" for
   zero); returns 1 when it is not an integer, 2 when it has more than 30
   digits, 3 when the token is too long to look at here. */
static int exact_integer(const char *t, size_t len, char *out, size_t cap) {
    char d[1200];
    size_t nd = 0, i = 0;
    long point = 0, e = 0;
    bool neg = t[0] == '-', eneg = false;
    if (len >= sizeof d) return 3;
    if (neg) i++;
    for (; i < len && t[i] >= '0' && t[i] <= '9'; i++) { if (nd || t[i] != '0') d[nd++] = t[i]; if (nd) point++; }
    if (i < len && t[i] == '.')
        for (i++; i < len && t[i] >= '0' && t[i] <= '9'; i++) { if (nd || t[i] != '0') d[nd++] = t[i]; else point--; }
    if (i < len && (t[i] == 'e' || t[i] == 'E')) {
        i++;
        if (t[i] == '+' || t[i] == '-') eneg = t[i++] == '-';
        for (; i < len; i++) if (e < 100000) e = e * 10 + (t[i] - '0');
    }
    while (nd && d[nd - 1] == '0') nd--; /* trailing zeros of the mantissa change nothing */
    if (nd == 0) { snprintf(out, cap, "0"); return 0; }
    point += eneg ? -e : e; /* the value is 0.d[0]d[1]... x 10^point */
    if (point < (long)nd) return 1;
    if (point > 30) return 2;
    size_t o = (size_t)snprintf(out, cap, "%s%.*s", neg ? "-" : "", (int)nd, d);
    for (long z = (long)nd; z < point && o + 1 < cap; z++) out[o++] = '0';
    out[o] = 0;
    return 0;
}
static void check_exact_integers(const char *doc, const smp_config *z) {
    const char *p = doc;
    while (*p != '{') p++;
    p++;
    for (;;) {
        while (strchr(" \t\r\n,", *p) && *p) p++;
        if (*p != '"') return;
        const char *k = p + 1, *ke = skip_string(p) - 1;
        p = ke + 1;
        while (*p != ':') p++;
        p++;
        while (strchr(" \t\r\n", *p) && *p) p++;
        const char *v = p;
        p = skip_value(p);
        if (memchr(k, '\\', (size_t)(ke - k)) || !(*v == '-' || (*v >= '0' && *v <= '9'))) continue;
        char key[64], want[64], got[64];
        snprintf(key, sizeof key, "%.*s", (int)(ke - k), k);
        if (!strcmp(key, "partitions")) snprintf(got, sizeof got, "%d", z->partitions);
        else if (!strcmp(key, "microbatches")) snprintf(got, sizeof got, "%d", z->microbatches);
        else if (!strcmp(key, "default_partition")) snprintf(got, sizeof got, "%d", z->default_partition);
        else if (!strcmp(key, "backward_passes_per_step")) snprintf(got, sizeof got, "%d", z->backward_passes_per_step);
        else if (!strcmp(key, "virtual_stages")) snprintf(got, sizeof got, "%d", z->virtual_stages);
        else if (!strcmp(key, "active_microbatches")) snprintf(got, sizeof got, "%d", z->active_microbatches);
        else if (!strcmp(key, "seed")) snprintf(got, sizeof got, "%llu", (unsigned long long)z->seed);
        else continue;
        int r = exact_integer(v, (size_t)(p - v), want, sizeof want);
        if (r == 3) continue;
        if (!strcmp(want, "-0")) snprintf(want, sizeof want, "0");
        FUZZ_ASSERT(r == 0 && !strcmp(want, got), "\"%s\": %.*s is %s, but smp_config_from_json accepted it as %s", key,
                    (int)(p - v), v, r == 1 ? "not an integer" : r == 2 ? "out of range" : want, got);
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    unsetenv("SMP_TIMEOUT"); /* resolve reads it; keep runs reproducible */
    return 0;
}

/* A C string of exactly len bytes + NUL in its own allocation, so that a read
   past the terminator is an ASan report. */
static char *cstr(const void *p, size_t len, const char *tail) {
    size_t t = strlen(tail);
    char *s = (char *)malloc(len + t + 1);
    memcpy(s, p, len);
    memcpy(s + len, tail, t + 1);
    return s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char out[4096];
    uint64_t seed = fnv1a(data, size);
    smp_config z, z2;
    smp_status st;
    size_t n, last;
    char *buf, *back;

    n = strnlen((const char *)data, size);
    buf = cstr(data, n, "");
    cur_input = buf;

    memset(&z, 0, sizeof z);
    st = parse_both(buf, seed, &z);
    int syntax_error = st != SMP_OK && syntax_offset() >= 0;

    /* trailing whitespace changes nothing */
    {
        smp_config w;
        char before[2048];
        snprintf(before, sizeof before, "%s", smp_last_error());
        back = cstr(buf, n, " \n\t\r");
        memset(&w, 0, sizeof w);
        smp_status sw = smp_config_from_json(back, &w);
        free(back);
        FUZZ_ASSERT(sw == st, "appending whitespace changes the status from %d to %d", (int)st, (int)sw);
        if (st == SMP_OK) FUZZ_ASSERT(cfg_equal(&w, &z), "appending whitespace changes the config");
        else if (!syntax_error)
            FUZZ_ASSERT(strcmp(before, smp_last_error()) == 0, "appending whitespace changes the key error");
    }

    if (!syntax_error) {
        /* the document is one object: a cut before its closing '}' is a syntax error at or before the cut */
        last = n;
        while (last > 0 &&
               (buf[last - 1] == ' ' || buf[last - 1] == '\t' || buf[last - 1] == '\n' || buf[last - 1] == '\r'))
            last--;
        FUZZ_ASSERT(last > 0 && buf[last - 1] == '}', "a document that parses does not end in '}'");
        size_t cuts[2] = {last - 1, (size_t)(next_rand(&seed) % last)};
        for (int i = 0; i < 2; i++) {
            smp_config t, t_before;
            back = cstr(buf, cuts[i], "");
            fill_arbitrary(&t, seed + (uint64_t)i);
            memcpy(&t_before, &t, sizeof t);
            smp_status sc = smp_config_from_json(back, &t);
            free(back);
            long at = syntax_offset();
            FUZZ_ASSERT(sc == SMP_ERR_CONFIG && at >= 0 && at <= (long)cuts[i],
                        "cut at byte %zu: status %d, not a syntax error at or before the cut", cuts[i], (int)sc);
            FUZZ_ASSERT(memcmp(&t, &t_before, sizeof t) == 0, "on error (a cut document) *cfg was changed");
            check_message("cut document");
        }
    }
    if (st != SMP_OK) { free(buf); return 0; }

    /* round trip: written back as JSON, it parses to the same values */
    back = cstr(out, write_json(&z, seed & 1, out, sizeof out), "");
    cur_input = back;
    memset(&z2, 0, sizeof z2);
    st = smp_config_from_json(back, &z2);
    FUZZ_ASSERT(st == SMP_OK, "the config written back does not parse");
    FUZZ_ASSERT(cfg_equal(&z, &z2), "the config written back parses to other values");
    cur_input = buf;
    free(back);

    check_resolve(&z);
    check_exact_integers(buf, &z);
    free(buf);
    return 0;
}
