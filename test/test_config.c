/* test_config.c - smp_config_from_json and smp_config_resolve, in one process
   (no MPI_Init: the config code never talks to MPI).

   Build (from the repository root):
     mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. -Itest test/test_config.c -o build/test_config -lm
*/
#define _POSIX_C_SOURCE 200809L /* setenv, unsetenv */
#include <locale.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SMP_TESTING /* the test hooks and test-only introspection */
#define SMP_IMPLEMENTATION
#include "../smp.h"


#include "test.h"

/* ------------------------------------------------------------ helpers */
static int err_has(const char *needle) { return needle == NULL || strstr(smp_last_error(), needle) != NULL; }

/* Field by field (memcmp would compare padding, which copies need not keep). */
static int cfg_equal(const smp_config *a, const smp_config *b) {
    return a->partitions == b->partitions && a->pipeline_parallel_degree == b->pipeline_parallel_degree &&
           a->tensor_parallel_degree == b->tensor_parallel_degree && a->microbatches == b->microbatches &&
           a->pipeline == b->pipeline && a->optimize == b->optimize && a->auto_partition == b->auto_partition &&
           a->default_partition == b->default_partition && a->has_default_partition == b->has_default_partition &&
           a->ddp == b->ddp && a->placement_strategy == b->placement_strategy && a->memory_weight == b->memory_weight &&
           a->has_memory_weight == b->has_memory_weight && a->trace_device == b->trace_device &&
           a->trace_execution_times == b->trace_execution_times && a->trace_memory_usage == b->trace_memory_usage &&
           a->overlapping_allreduce == b->overlapping_allreduce &&
           a->backward_passes_per_step == b->backward_passes_per_step &&
           a->average_grads_across_microbatches == b->average_grads_across_microbatches &&
           a->bucket_cap_mb == b->bucket_cap_mb && a->broadcast_buffers == b->broadcast_buffers &&
           a->activation_checkpointing == b->activation_checkpointing && a->virtual_stages == b->virtual_stages &&
           a->deterministic_reduction == b->deterministic_reduction && a->timeout == b->timeout && a->seed == b->seed &&
           a->prescaled_batch == b->prescaled_batch && memcmp(&a->comm, &b->comm, sizeof a->comm) == 0;
}

/* A config with a non-default value in every field, to see what a failed
   call leaves untouched. */
static smp_config sample_config(void) {
    smp_config c;
    memset(&c, 0, sizeof c);
    c.partitions = 2;
    c.microbatches = 3;
    c.ddp = SMP_ON;
    c.seed = 77;
    c.memory_weight = 0.5;
    c.has_memory_weight = true;
    return c;
}

/* JSON that must fail with SMP_ERR_CONFIG, leave cfg untouched, and name
   every non-NULL needle in the message. */
static void expect_json_error(const char *name, const char *json, const char *n1, const char *n2, const char *n3) {
    smp_config c = sample_config(), before = c;
    smp_status st = smp_config_from_json(json, &c);
    int ok = st == SMP_ERR_CONFIG && err_has(n1) && err_has(n2) && err_has(n3) &&
             cfg_equal(&c, &before);
    CHECK(ok, name, "status %d, message '%s' (wanted '%s', '%s', '%s'), cfg %s", (int)st, smp_last_error(),
          n1 ? n1 : "", n2 ? n2 : "", n3 ? n3 : "", cfg_equal(&c, &before) ? "untouched" : "changed");
}

/* A struct that resolve must refuse, naming every needle. */
static void expect_resolve_error(const char *name, smp_config c, int world, const char *n1, const char *n2,
                                 const char *n3) {
    smp_config out = sample_config(), out_before = out;
    smp_status st = smp_config_resolve(&c, world, &out);
    int ok = st == SMP_ERR_CONFIG && err_has(n1) && err_has(n2) && err_has(n3) &&
             cfg_equal(&out, &out_before);
    CHECK(ok, name, "status %d, message '%s' (wanted '%s', '%s', '%s')", (int)st, smp_last_error(), n1 ? n1 : "",
          n2 ? n2 : "", n3 ? n3 : "");
}

static int resolved_is_concrete(const smp_config *r) {
    const smp_switch sw[] = {r->auto_partition, r->ddp, r->trace_execution_times, r->trace_memory_usage,
                             r->overlapping_allreduce, r->average_grads_across_microbatches, r->broadcast_buffers,
                             r->deterministic_reduction, r->activation_checkpointing};
    for (size_t i = 0; i < sizeof sw / sizeof sw[0]; i++)
        if (sw[i] != SMP_ON && sw[i] != SMP_OFF) return 0;
    return r->pipeline != SMP_PIPELINE_DEFAULT && r->optimize != SMP_OPTIMIZE_DEFAULT &&
           r->placement_strategy != SMP_PLACEMENT_DEFAULT && r->trace_device != SMP_TRACE_DEFAULT &&
           r->partitions >= 1 && r->microbatches >= 1 && r->backward_passes_per_step >= 1 && r->virtual_stages >= 1 &&
           r->bucket_cap_mb > 0 && r->timeout > 0;
}

/* ------------------------------------------------------------ tensor parallelism */
/* tensor_parallel_degree, pipeline_parallel_degree as partitions' other name,
   and the letter placements. */
static void test_parallel_degrees(void) {
    smp_config c, r;
    memset(&c, 0, sizeof c);
    smp_status st =
        smp_config_from_json("{\"pipeline_parallel_degree\": 2, \"tensor_parallel_degree\": 2, \"ddp\": true}", &c);
    CHECK(st == SMP_OK && c.pipeline_parallel_degree == 2 && c.partitions == 0 && c.tensor_parallel_degree == 2,
          "degrees: json sets pipeline_parallel_degree and tensor_parallel_degree", "%s", smp_last_error());
    st = smp_config_resolve(&c, 8, &r);
    CHECK(st == SMP_OK && r.partitions == 2 && r.pipeline_parallel_degree == 2 && r.tensor_parallel_degree == 2,
          "degrees: pipeline_parallel_degree alone sets partitions", "%d: %s; %d %d %d", (int)st, smp_last_error(),
          r.partitions, r.pipeline_parallel_degree, r.tensor_parallel_degree);
    c.partitions = 2; /* both, agreeing */
    st = smp_config_resolve(&c, 8, &r);
    CHECK(st == SMP_OK && r.partitions == 2, "degrees: partitions and pipeline_parallel_degree may agree", "%s",
          smp_last_error());
    c.partitions = 4;
    expect_resolve_error("degrees: partitions 4 and pipeline_parallel_degree 2 disagree", c, 8, "\"partitions\" (4)",
                         "\"pipeline_parallel_degree\" (2)", "give one of them");
    memset(&c, 0, sizeof c);
    st = smp_config_from_json("{\"partitions\": 4, \"pipeline_parallel_degree\": 2}", &c);
    CHECK(st == SMP_OK, "degrees: json with both keys parses (resolve judges them)", "%s", smp_last_error());
    expect_resolve_error("degrees: json partitions and pipeline_parallel_degree disagree", c, 8, "\"partitions\"",
                         "\"pipeline_parallel_degree\"", "disagree");

    /* pp x tp against the world */
    memset(&c, 0, sizeof c);
    c.partitions = 2;
    c.tensor_parallel_degree = 3;
    c.ddp = SMP_ON;
    expect_resolve_error("degrees: pp 2 x tp 3 does not divide 8 ranks", c, 8, "tensor_parallel_degree = 3",
                         "does not divide the world size 8", "multiple of 6");
    expect_resolve_error("degrees: pp 2 x tp 3 needs more than 4 ranks", c, 4, "tensor_parallel_degree = 3",
                         "world size 4", NULL);
    c.tensor_parallel_degree = 2;
    c.ddp = SMP_DEFAULT;
    expect_resolve_error("degrees: pp 2 x tp 2 on 8 ranks needs ddp", c, 8, "tensor_parallel_degree = 2",
                         "makes 2 model replicas", "\"ddp\": true");
    st = smp_config_resolve(&c, 4, &r);
    CHECK(st == SMP_OK && r.tensor_parallel_degree == 2, "degrees: pp 2 x tp 2 fills 4 ranks without ddp", "%s",
          smp_last_error());
    c.prescaled_batch = SMP_OFF; /* each TP rank its own examples: smp_step joins them (test_tp_batch) */
    st = smp_config_resolve(&c, 4, &r);
    CHECK(st == SMP_OK && r.prescaled_batch == SMP_OFF, "degrees: prescaled_batch false at tp 2", "%s",
          smp_last_error());
    c.tensor_parallel_degree = 1;
    st = smp_config_resolve(&c, 2, &r);
    CHECK(st == SMP_OK && r.prescaled_batch == SMP_OFF, "degrees: prescaled_batch false at tp 1 (the same thing)", "%s",
          smp_last_error());
    c.prescaled_batch = SMP_DEFAULT;
    c.tensor_parallel_degree = -2;
    expect_resolve_error("degrees: negative tensor_parallel_degree", c, 4, "\"tensor_parallel_degree\"", "at least 1",
                         NULL);
    expect_json_error("degrees: tensor_parallel_degree 0 in json", "{\"tensor_parallel_degree\": 0}",
                      "\"tensor_parallel_degree\"", "at least 1", NULL);

    /* every letter form parses to its own value */
    static const char *const letters[] = {"DPT", "DTP", "PDT", "PTD", "TDP", "TPD"};
    for (int i = 0; i < 6; i++) {
        char json[64];
        snprintf(json, sizeof json, "{\"placement_strategy\": \"%s\"}", letters[i]);
        memset(&c, 0, sizeof c);
        st = smp_config_from_json(json, &c);
        CHECK(st == SMP_OK && c.placement_strategy == (smp_placement)(SMP_PLACEMENT_DPT + i),
              "degrees: placement letters parse", "%s: %d (%s)", letters[i], (int)c.placement_strategy,
              smp_last_error());
    }
    expect_json_error("degrees: lower-case letters are not a placement", "{\"placement_strategy\": \"dpt\"}",
                      "\"placement_strategy\"", "\"TPD\"", "\"dpt\"");
    memset(&c, 0, sizeof c);
    c.placement_strategy = (smp_placement)(SMP_PLACEMENT_TPD + 1);
    expect_resolve_error("degrees: placement past TPD", c, 1, "\"placement_strategy\"", "SMP_PLACEMENT_TPD", NULL);
}

/* ------------------------------------------------------------ defaults */
static void test_defaults(void) {
    smp_config z, r;
    memset(&z, 0, sizeof z);
    unsetenv("SMP_TIMEOUT");
    smp_status st = smp_config_resolve(&z, 1, &r);
    CHECK(st == SMP_OK, "defaults: zero struct resolves on 1 rank", "%s", smp_last_error());
    CHECK(r.partitions == 1 && r.microbatches == 1, "defaults: partitions 1, microbatches 1", "%d %d", r.partitions,
          r.microbatches);
    CHECK(r.pipeline == SMP_PIPELINE_INTERLEAVED, "defaults: pipeline interleaved", "%d", (int)r.pipeline);
    CHECK(r.optimize == SMP_OPTIMIZE_SPEED, "defaults: optimize speed", "%d", (int)r.optimize);
    CHECK(r.auto_partition == SMP_ON, "defaults: auto_partition on", "%d", (int)r.auto_partition);
    CHECK(!r.has_default_partition, "defaults: no default_partition", "set");
    CHECK(r.ddp == SMP_OFF, "defaults: ddp off", "%d", (int)r.ddp);
    CHECK(r.placement_strategy == SMP_PLACEMENT_CLUSTER, "defaults: placement cluster", "%d",
          (int)r.placement_strategy);
    CHECK(r.memory_weight == 0.0, "defaults: memory_weight 0 for speed", "%g", r.memory_weight);
    CHECK(r.trace_device == SMP_TRACE_CPU, "defaults: trace_device cpu", "%d", (int)r.trace_device);
    CHECK(r.trace_execution_times == SMP_OFF && r.trace_memory_usage == SMP_OFF, "defaults: tracing extras off",
          "%d %d", (int)r.trace_execution_times, (int)r.trace_memory_usage);
    CHECK(r.overlapping_allreduce == SMP_ON, "defaults: overlapping_allreduce on", "%d", (int)r.overlapping_allreduce);
    CHECK(r.backward_passes_per_step == 1, "defaults: backward_passes_per_step 1", "%d", r.backward_passes_per_step);
    CHECK(r.average_grads_across_microbatches == SMP_ON, "defaults: average_grads on", "%d",
          (int)r.average_grads_across_microbatches);
    CHECK(r.bucket_cap_mb == 25.0, "defaults: bucket_cap_mb 25", "%g", r.bucket_cap_mb);
    CHECK(r.broadcast_buffers == SMP_ON, "defaults: broadcast_buffers on", "%d", (int)r.broadcast_buffers);
    CHECK(r.virtual_stages == 1, "defaults: virtual_stages 1", "%d", r.virtual_stages);
    CHECK(r.active_microbatches == 0, "defaults: active_microbatches 0 (no cap)", "%d", r.active_microbatches);
    CHECK(r.shard_optimizer_state == SMP_OFF, "defaults: shard_optimizer_state off", "%d",
          (int)r.shard_optimizer_state);
    CHECK(r.offload_activations == SMP_OFF && r.activation_loading_horizon == 4,
          "defaults: offload_activations off, activation_loading_horizon 4", "%d %d", (int)r.offload_activations,
          r.activation_loading_horizon);
    CHECK(r.activation_checkpointing == SMP_OFF, "defaults: activation_checkpointing off", "%d",
          (int)r.activation_checkpointing);
    CHECK(r.deterministic_reduction == SMP_OFF, "defaults: deterministic_reduction off", "%d",
          (int)r.deterministic_reduction);
    CHECK(r.timeout == 600.0, "defaults: timeout 600 without SMP_TIMEOUT", "%g", r.timeout);
    CHECK(r.seed == 0, "defaults: seed 0", "%llu", (unsigned long long)r.seed);
    CHECK(r.prescaled_batch == SMP_ON, "defaults: prescaled_batch on", "%d", (int)r.prescaled_batch);
    CHECK(r.tensor_parallel_degree == 1 && r.pipeline_parallel_degree == 1, "defaults: tensor_parallel_degree 1, "
          "pipeline_parallel_degree = partitions", "%d %d", r.tensor_parallel_degree, r.pipeline_parallel_degree);
    CHECK(resolved_is_concrete(&r), "defaults: every enum and switch concrete", "not concrete");

    /* memory_weight follows optimize when 0, and is kept when set */
    z.optimize = SMP_OPTIMIZE_MEMORY;
    st = smp_config_resolve(&z, 1, &r);
    CHECK(st == SMP_OK && r.memory_weight == 1.0, "defaults: memory_weight 1 for optimize memory", "%d %g", (int)st,
          r.memory_weight);
    z.memory_weight = 0.3;
    z.has_memory_weight = true;
    st = smp_config_resolve(&z, 1, &r);
    CHECK(st == SMP_OK && r.memory_weight == 0.3, "defaults: explicit memory_weight kept", "%g", r.memory_weight);
    /* 0 is a weight like any other: pure speed, even with optimize memory */
    z.memory_weight = 0;
    st = smp_config_resolve(&z, 1, &r);
    CHECK(st == SMP_OK && r.memory_weight == 0.0, "defaults: explicit memory_weight 0 kept under optimize memory", "%g",
          r.memory_weight);
    smp_config j;
    memset(&j, 0, sizeof j);
    st = smp_config_from_json("{\"optimize\": \"memory\", \"memory_weight\": 0}", &j);
    if (!st) st = smp_config_resolve(&j, 1, &r);
    CHECK(st == SMP_OK && j.has_memory_weight && r.memory_weight == 0.0,
          "json: \"memory_weight\": 0 is kept under optimize memory", "%s, weight %g", st ? smp_last_error() : "ok",
          r.memory_weight);
    /* a value set without its flag is an error naming the flag, never dropped */
    z.has_memory_weight = false;
    z.memory_weight = 0.3;
    st = smp_config_resolve(&z, 1, &r);
    CHECK(st == SMP_ERR_CONFIG && err_has("has_memory_weight"),
          "config: memory_weight without has_memory_weight is an error", "%d %s", (int)st, smp_last_error());
    z.memory_weight = 0;
    z.partitions = 2;
    z.default_partition = 1;
    st = smp_config_resolve(&z, 2, &r);
    CHECK(st == SMP_ERR_CONFIG && err_has("has_default_partition"),
          "config: default_partition without has_default_partition is an error", "%d %s", (int)st, smp_last_error());
    z.has_default_partition = true;
    st = smp_config_resolve(&z, 2, &r);
    CHECK(st == SMP_OK && r.has_default_partition && r.default_partition == 1,
          "config: default_partition with its flag", "%d %s", (int)st, smp_last_error());

    /* hybrid: 2 partitions x 2 replicas */
    memset(&z, 0, sizeof z);
    z.partitions = 2;
    z.ddp = SMP_ON;
    st = smp_config_resolve(&z, 4, &r);
    CHECK(st == SMP_OK && r.partitions == 2 && r.ddp == SMP_ON, "resolve: 2 partitions x 2 replicas with ddp", "%s",
          smp_last_error());
    /* ddp on with a single replica is fine */
    st = smp_config_resolve(&z, 2, &r);
    CHECK(st == SMP_OK, "resolve: ddp on with one replica", "%s", smp_last_error());
    /* auto_partition off, partitions > 1, no default_partition: not an error here */
    z.auto_partition = SMP_OFF;
    st = smp_config_resolve(&z, 2, &r);
    CHECK(st == SMP_OK && r.auto_partition == SMP_OFF && !r.has_default_partition,
          "resolve: manual partitioning without default_partition is left to the module code", "%s", smp_last_error());

    /* in place, and idempotent */
    smp_config c = sample_config(), once, twice;
    st = smp_config_resolve(&c, 4, &once);
    smp_status st2 = smp_config_resolve(&once, 4, &twice);
    CHECK(st == SMP_OK && st2 == SMP_OK && cfg_equal(&once, &twice), "resolve: idempotent", "%s",
          smp_last_error());
    st = smp_config_resolve(&c, 4, &c);
    CHECK(st == SMP_OK && cfg_equal(&c, &once), "resolve: in == out", "%s", smp_last_error());
}

/* ------------------------------------------------------------ every key */
static void test_every_key(void) {
    const char *json =
        "{\n"
        "  \"partitions\": 4,\n"
        "  \"pipeline_parallel_degree\": 4,\n"
        "  \"tensor_parallel_degree\": 2,\n"
        "  \"prescaled_batch\": true,\n"
        "  \"microbatches\": 8,\n"
        "  \"pipeline\": \"simple\",\n"
        "  \"optimize\": \"memory\",\n"
        "  \"auto_partition\": false,\n"
        "  \"default_partition\": 3,\n"
        "  \"ddp\": true,\n"
        "  \"placement_strategy\": \"spread\",\n"
        "  \"memory_weight\": 0.25,\n"
        "  \"trace_device\": \"gpu\",\n"
        "  \"trace_execution_times\": true,\n"
        "  \"trace_memory_usage\": true,\n"
        "  \"overlapping_allreduce\": false,\n"
        "  \"average_grads_across_microbatches\": false,\n"
        "  \"broadcast_buffers\": false,\n"
        "  \"activation_checkpointing\": true,\n"
        "  \"deterministic_reduction\": true,\n"
        "  \"backward_passes_per_step\": 2,\n"
        "  \"bucket_cap_mb\": 12.5,\n"
        "  \"virtual_stages\": 3,\n"
        "  \"timeout\": 90.5,\n"
        "  \"seed\": 18446744073709551615\n"
        "}\n";
    smp_config c;
    memset(&c, 0, sizeof c);
    smp_status st = smp_config_from_json(json, &c);
    CHECK(st == SMP_OK, "json: all 25 keys parse", "%s", smp_last_error());
    CHECK(c.prescaled_batch == SMP_ON, "json: prescaled_batch true", "%d", (int)c.prescaled_batch);
    CHECK(c.partitions == 4, "json: partitions", "%d", c.partitions);
    CHECK(c.pipeline_parallel_degree == 4, "json: pipeline_parallel_degree", "%d", c.pipeline_parallel_degree);
    CHECK(c.tensor_parallel_degree == 2, "json: tensor_parallel_degree", "%d", c.tensor_parallel_degree);
    CHECK(c.microbatches == 8, "json: microbatches", "%d", c.microbatches);
    CHECK(c.pipeline == SMP_PIPELINE_SIMPLE, "json: pipeline simple", "%d", (int)c.pipeline);
    CHECK(c.optimize == SMP_OPTIMIZE_MEMORY, "json: optimize memory", "%d", (int)c.optimize);
    CHECK(c.auto_partition == SMP_OFF, "json: auto_partition false", "%d", (int)c.auto_partition);
    CHECK(c.default_partition == 3 && c.has_default_partition, "json: default_partition sets has_default_partition",
          "%d %d", c.default_partition, (int)c.has_default_partition);
    CHECK(c.ddp == SMP_ON, "json: ddp true", "%d", (int)c.ddp);
    CHECK(c.placement_strategy == SMP_PLACEMENT_SPREAD, "json: placement_strategy spread", "%d",
          (int)c.placement_strategy);
    CHECK(c.memory_weight == 0.25, "json: memory_weight", "%g", c.memory_weight);
    CHECK(c.trace_device == SMP_TRACE_GPU, "json: trace_device gpu", "%d", (int)c.trace_device);
    CHECK(c.trace_execution_times == SMP_ON, "json: trace_execution_times", "%d", (int)c.trace_execution_times);
    CHECK(c.trace_memory_usage == SMP_ON, "json: trace_memory_usage", "%d", (int)c.trace_memory_usage);
    CHECK(c.overlapping_allreduce == SMP_OFF, "json: overlapping_allreduce false", "%d", (int)c.overlapping_allreduce);
    CHECK(c.average_grads_across_microbatches == SMP_OFF, "json: average_grads_across_microbatches false", "%d",
          (int)c.average_grads_across_microbatches);
    CHECK(c.broadcast_buffers == SMP_OFF, "json: broadcast_buffers false", "%d", (int)c.broadcast_buffers);
    CHECK(c.deterministic_reduction == SMP_ON, "json: deterministic_reduction", "%d", (int)c.deterministic_reduction);
    CHECK(c.activation_checkpointing == SMP_ON, "json: activation_checkpointing", "%d",
          (int)c.activation_checkpointing);
    CHECK(c.backward_passes_per_step == 2, "json: backward_passes_per_step", "%d", c.backward_passes_per_step);
    CHECK(c.bucket_cap_mb == 12.5, "json: bucket_cap_mb", "%g", c.bucket_cap_mb);
    CHECK(c.virtual_stages == 3, "json: virtual_stages", "%d", c.virtual_stages);
    CHECK(c.timeout == 90.5, "json: timeout", "%g", c.timeout);
    CHECK(c.seed == UINT64_MAX, "json: seed up to 2^64-1", "%llu", (unsigned long long)c.seed);

    smp_config r;
    st = smp_config_resolve(&c, 16, &r);
    CHECK(st == SMP_OK && r.memory_weight == 0.25 && r.timeout == 90.5 && r.pipeline == SMP_PIPELINE_SIMPLE &&
              resolved_is_concrete(&r),
          "json: all keys then resolve on 16 ranks", "%s", smp_last_error());

    /* the other enum spellings, and bools the other way */
    memset(&c, 0, sizeof c);
    st = smp_config_from_json("{\"pipeline\":\"interleaved\",\"optimize\":\"speed\",\"placement_strategy\":\"cluster\","
                              "\"trace_device\":\"cpu\",\"auto_partition\":true,\"ddp\":false}",
                              &c);
    CHECK(st == SMP_OK && c.pipeline == SMP_PIPELINE_INTERLEAVED && c.optimize == SMP_OPTIMIZE_SPEED &&
              c.placement_strategy == SMP_PLACEMENT_CLUSTER && c.trace_device == SMP_TRACE_CPU &&
              c.auto_partition == SMP_ON && c.ddp == SMP_OFF,
          "json: remaining enum values and bools", "%s", smp_last_error());
    for (int v = 1; v <= 2; v++) { /* zero_bubble_v runs 2 stages per partition: virtual_stages 1 or 2 */
        char text[96];
        snprintf(text, sizeof text, "{\"pipeline\": \"zero_bubble_v\", \"virtual_stages\": %d}", v);
        memset(&c, 0, sizeof c);
        st = smp_config_from_json(text, &c);
        smp_config r2;
        smp_status rs = st ? st : smp_config_resolve(&c, 1, &r2);
        CHECK(st == SMP_OK && rs == SMP_OK && c.pipeline == SMP_PIPELINE_ZERO_BUBBLE_V &&
                  r2.pipeline == SMP_PIPELINE_ZERO_BUBBLE_V && r2.virtual_stages == v,
              v == 1 ? "json: pipeline zero_bubble_v" : "json: pipeline zero_bubble_v with virtual_stages 2", "%s",
              smp_last_error());
    }

    /* number forms */
    memset(&c, 0, sizeof c);
    st = smp_config_from_json("{\"partitions\": 2.0, \"microbatches\": 1e1, \"seed\": 1.5E3, \"default_partition\": -0,"
                              "\"timeout\": 1e-1, \"bucket_cap_mb\": 3}",
                              &c);
    CHECK(st == SMP_OK && c.partitions == 2 && c.microbatches == 10 && c.seed == 1500 && c.default_partition == 0 &&
              c.has_default_partition && c.timeout == 0.1 && c.bucket_cap_mb == 3.0,
          "json: integral numbers in any form", "%s", smp_last_error());
    st = smp_config_from_json("{\"partitions\": 2147483647, \"default_partition\": -2147483648}", &c);
    CHECK(st == SMP_OK && c.partitions == 2147483647 && c.default_partition == -2147483648,
          "json: int range edges", "%s", smp_last_error());

    /* escapes and whitespace: a key spelled with \u escapes still matches */
    memset(&c, 0, sizeof c);
    st = smp_config_from_json(" \t\r\n{ \"p\\u0061rtitions\" :\n 2 , \"pipeline\": \"\\u0073imple\" }\n ", &c);
    CHECK(st == SMP_OK && c.partitions == 2 && c.pipeline == SMP_PIPELINE_SIMPLE, "json: escapes in keys and values",
          "%s", smp_last_error());
    st = smp_config_from_json("{}", &c);
    CHECK(st == SMP_OK, "json: empty object", "%s", smp_last_error());
}

/* ------------------------------------------------------------ overrides */
static void test_override(void) {
    smp_config c;
    memset(&c, 0, sizeof c);
    c.partitions = 4;
    c.microbatches = 8;
    c.ddp = SMP_ON;
    c.seed = 5;
    c.overlapping_allreduce = SMP_ON;
    smp_config before = c;
    smp_status st = smp_config_from_json("{\"microbatches\": 2, \"overlapping_allreduce\": false}", &c);
    CHECK(st == SMP_OK && c.microbatches == 2 && c.overlapping_allreduce == SMP_OFF, "override: keys set replace",
          "%s", smp_last_error());
    CHECK(c.partitions == 4 && c.ddp == SMP_ON && c.seed == 5 && !c.has_default_partition,
          "override: keys absent keep the struct's values", "partitions %d ddp %d seed %llu", c.partitions,
          (int)c.ddp, (unsigned long long)c.seed);
    c = before;
    st = smp_config_from_json("{ }", &c);
    CHECK(st == SMP_OK && cfg_equal(&c, &before), "override: empty object changes nothing", "%s",
          smp_last_error());
    /* a later JSON overrides an earlier one (struct, then file, then SMP_CONFIG) */
    st = smp_config_from_json("{\"partitions\": 2}", &c);
    st = st == SMP_OK ? smp_config_from_json("{\"partitions\": 1, \"seed\": 9}", &c) : st;
    CHECK(st == SMP_OK && c.partitions == 1 && c.seed == 9 && c.microbatches == 8, "override: layered JSON", "%s",
          smp_last_error());
    /* a failing JSON leaves everything as it was, even keys before the bad one */
    c = before;
    st = smp_config_from_json("{\"microbatches\": 4, \"partitions\": \"x\"}", &c);
    CHECK(st == SMP_ERR_CONFIG && cfg_equal(&c, &before), "override: nothing applied on error",
          "status %d microbatches %d", (int)st, c.microbatches);
    /* NULL arguments */
    st = smp_config_from_json(NULL, &c);
    CHECK(st == SMP_ERR_ARG && err_has("json"), "json: NULL text is an argument error", "%d %s", (int)st,
          smp_last_error());
    st = smp_config_from_json("{}", NULL);
    CHECK(st == SMP_ERR_ARG && err_has("cfg"), "json: NULL cfg is an argument error", "%d %s", (int)st,
          smp_last_error());
    st = smp_config_resolve(&c, 0, &c);
    CHECK(st == SMP_ERR_ARG && err_has("world size 0"), "resolve: world size 0 is an argument error", "%d %s",
          (int)st, smp_last_error());
}

/* ------------------------------------------------------------ SMP_TIMEOUT */
static void test_timeout_env(void) {
    smp_config z, r;
    memset(&z, 0, sizeof z);
    setenv("SMP_TIMEOUT", "42.5", 1);
    smp_status st = smp_config_resolve(&z, 1, &r);
    CHECK(st == SMP_OK && r.timeout == 42.5, "timeout: SMP_TIMEOUT fills an unset timeout", "%s %g", smp_last_error(),
          r.timeout);
    z.timeout = 7;
    st = smp_config_resolve(&z, 1, &r);
    CHECK(st == SMP_OK && r.timeout == 7, "timeout: the config's timeout beats SMP_TIMEOUT", "%g", r.timeout);
    z.timeout = 0;
    setenv("SMP_TIMEOUT", "", 1);
    st = smp_config_resolve(&z, 1, &r);
    CHECK(st == SMP_OK && r.timeout == 600, "timeout: empty SMP_TIMEOUT counts as unset", "%s %g", smp_last_error(),
          r.timeout);
    setenv("SMP_TIMEOUT", "abc", 1);
    expect_resolve_error("timeout: SMP_TIMEOUT=abc names the variable and value", z, 1, "SMP_TIMEOUT", "\"abc\"",
                         NULL);
    setenv("SMP_TIMEOUT", "-3", 1);
    expect_resolve_error("timeout: SMP_TIMEOUT=-3 is not positive", z, 1, "SMP_TIMEOUT", "\"-3\"", "positive");
    setenv("SMP_TIMEOUT", "0", 1);
    expect_resolve_error("timeout: SMP_TIMEOUT=0 is not positive", z, 1, "SMP_TIMEOUT", "\"0\"", NULL);
    setenv("SMP_TIMEOUT", "30s", 1);
    expect_resolve_error("timeout: SMP_TIMEOUT=30s has trailing text", z, 1, "SMP_TIMEOUT", "\"30s\"", NULL);
    setenv("SMP_TIMEOUT", "inf", 1);
    expect_resolve_error("timeout: SMP_TIMEOUT=inf is refused", z, 1, "SMP_TIMEOUT", "\"inf\"", NULL);
    unsetenv("SMP_TIMEOUT");
}

/* ------------------------------------------------------------ bad JSON values */
static void test_bad_json_values(void) {
    expect_json_error("bad json: misspelt key suggests the nearest", "{\"microbatch\": 4}",
                      "unknown config key \"microbatch\" (did you mean \"microbatches\"?)", NULL, NULL);
    expect_json_error("bad json: transposed letters suggest the key", "{\"partitoins\": 2}", "\"partitoins\"",
                      "did you mean \"partitions\"", NULL);
    expect_json_error("bad json: wrong case suggests the key", "{\"DDP\": true}", "\"DDP\"", "did you mean \"ddp\"",
                      NULL);
    expect_json_error("bad json: prefix suggests the key", "{\"placement\": \"spread\"}", "\"placement\"",
                      "did you mean \"placement_strategy\"", NULL);
    expect_json_error("bad json: far-off key lists the keys", "{\"learning_rate\": 0.1}",
                      "unknown config key \"learning_rate\"", "the keys are: partitions, pipeline_parallel_degree",
                      "seed");
    expect_json_error("bad json: the SageMaker wrapper object", "{\"enabled\": true, \"parameters\": {}}",
                      "\"enabled\"", "\"parameters\"", NULL);
    expect_json_error("bad json: integer given as a string", "{\"partitions\": \"2\"}",
                      "config key \"partitions\" must be an integer, got string \"2\"", NULL, NULL);
    expect_json_error("bad json: fractional integer", "{\"microbatches\": 2.5}", "\"microbatches\"", "integer",
                      "number 2.5");
    expect_json_error("bad json: integer beyond int range", "{\"partitions\": 3000000000}", "\"partitions\"",
                      "int range", "3000000000");
    expect_json_error("bad json: huge integer", "{\"virtual_stages\": 99999999999999999999999}", "\"virtual_stages\"",
                      "int range", "99999999999999999999999");
    {
        smp_config a = {0};
        smp_status st = smp_config_from_json("{\"active_microbatches\": 3}", &a);
        CHECK(st == SMP_OK && a.active_microbatches == 3, "json: active_microbatches", "status %d, %d: %s", (int)st,
              a.active_microbatches, smp_last_error());
        st = smp_config_from_json("{\"active_microbatches\": 0}", &a);
        CHECK(st == SMP_OK && a.active_microbatches == 0, "json: active_microbatches 0 (no cap)", "status %d, %d: %s",
              (int)st, a.active_microbatches, smp_last_error());
    }
    expect_json_error("bad json: negative active_microbatches", "{\"active_microbatches\": -1}",
                      "\"active_microbatches\"", "at least 1, or 0 for no limit", "-1");
    {
        smp_config a = {0}, r = {0};
        smp_status st = smp_config_from_json("{\"offload_activations\": true, \"activation_loading_horizon\": 2}", &a);
        if (!st) st = smp_config_resolve(&a, 1, &r);
        CHECK(st == SMP_OK && r.offload_activations == SMP_ON && r.activation_loading_horizon == 2,
              "json: offload_activations and activation_loading_horizon", "status %d, %d %d: %s", (int)st,
              (int)r.offload_activations, r.activation_loading_horizon, smp_last_error());
    }
    expect_json_error("bad json: activation_loading_horizon 0", "{\"activation_loading_horizon\": 0}",
                      "\"activation_loading_horizon\"", "at least 1", "got 0");
    expect_json_error("bad json: offload_activations not a boolean", "{\"offload_activations\": 1}",
                      "\"offload_activations\"", "true or false", "1");
    expect_json_error("bad json: zero partitions", "{\"partitions\": 0}", "\"partitions\"", "at least 1", "got 0");
    expect_json_error("bad json: negative backward_passes_per_step", "{\"backward_passes_per_step\": -2}",
                      "\"backward_passes_per_step\"", "at least 1", "-2");
    expect_json_error("bad json: bool given as a string", "{\"ddp\": \"true\"}", "config key \"ddp\"",
                      "true or false", "string \"true\"");
    expect_json_error("bad json: bool given as a number", "{\"auto_partition\": 1}", "\"auto_partition\"",
                      "true or false", "number 1");
    expect_json_error("bad json: unknown pipeline", "{\"pipeline\": \"gpipe\"}", "config key \"pipeline\"",
                      "\"interleaved\", \"simple\", \"zero_bubble\", or \"zero_bubble_v\"", "\"gpipe\"");
    expect_json_error("bad json: pipeline as a number", "{\"pipeline\": 1}", "\"pipeline\"", "string", "number 1");
    expect_json_error("bad json: enum is case-sensitive", "{\"optimize\": \"Speed\"}", "\"optimize\"",
                      "\"speed\" or \"memory\"", "\"Speed\"");
    expect_json_error("bad json: unknown placement", "{\"placement_strategy\": \"random\"}",
                      "\"placement_strategy\"", "\"cluster\", \"spread\", \"DPT\"", "\"random\"");
    expect_json_error("bad json: unknown trace_device", "{\"trace_device\": \"tpu\"}", "\"trace_device\"",
                      "\"cpu\" or \"gpu\"", "\"tpu\"");
    expect_json_error("bad json: number given as a string", "{\"memory_weight\": \"high\"}", "\"memory_weight\"",
                      "number", "string \"high\"");
    expect_json_error("bad json: zero timeout", "{\"timeout\": 0}", "\"timeout\"", "positive", "number 0");
    expect_json_error("bad json: negative bucket_cap_mb", "{\"bucket_cap_mb\": -1}", "\"bucket_cap_mb\"", "positive",
                      "number -1");
    expect_json_error("bad json: overflowing number", "{\"timeout\": 1e999}", "\"timeout\"", "finite", "1e999");
    expect_json_error("bad json: negative seed", "{\"seed\": -1}", "\"seed\"", "non-negative", "number -1");
    expect_json_error("bad json: seed beyond 64 bits", "{\"seed\": 18446744073709551616}", "\"seed\"", "2^64",
                      "18446744073709551616");
    expect_json_error("bad json: fractional seed", "{\"seed\": 0.5}", "\"seed\"", "integer", "number 0.5");
    expect_json_error("bad json: null value", "{\"microbatches\": null}", "\"microbatches\"", "integer", "got null");
    expect_json_error("bad json: object value", "{\"partitions\": {\"a\": [1, {\"b\": null}]}}", "\"partitions\"",
                      "integer", "got an object");
    expect_json_error("bad json: array value", "{\"ddp\": [true]}", "\"ddp\"", "true or false", "got an array");
    expect_json_error("bad json: duplicate key", "{\"partitions\": 2, \"ddp\": true, \"partitions\": 4}",
                      "\"partitions\" appears twice", "number 4", NULL);
    expect_json_error("bad json: unknown key with non-ASCII text", "{\"\\u00e9poch\\ud83d\\ude00\": 1}",
                      "unknown config key \"\xc3\xa9poch\xf0\x9f\x98\x80\"", NULL, NULL);
    expect_json_error("bad json: unknown key with a control character", "{\"a\\nb\": 1}",
                      "unknown config key \"a\\nb\"", NULL, NULL);
    expect_json_error("bad json: first key error wins", "{\"microbatch\": 1, \"partitions\": \"2\"}", "\"microbatch\"",
                      NULL, NULL);
}

/* ------------------------------------------------------------ malformed JSON */
static void test_malformed_json(void) {
    expect_json_error("malformed: trailing comma", "{\"partitions\": 2,}", "at byte 16", "trailing comma", NULL);
    expect_json_error("malformed: trailing comma in a nested array", "{\"partitions\": [1, 2, ]}", "at byte 20",
                      "trailing comma", NULL);
    expect_json_error("malformed: unterminated string", "{\"partitions", "at byte 1", "unterminated string",
                      "ends at byte 12");
    expect_json_error("malformed: unterminated value string", "{\"pipeline\": \"simple}", "at byte 13",
                      "unterminated string", NULL);
    expect_json_error("malformed: missing closing brace", "{\"partitions\": 2", "at byte 16", "'}'",
                      "the end of the input");
    expect_json_error("malformed: missing comma", "{\"partitions\": 2 \"ddp\": true}", "at byte 17",
                      "expected ',' or '}'", "'\"'");
    expect_json_error("malformed: missing colon", "{\"partitions\" 2}", "at byte 14", "':'", NULL);
    expect_json_error("malformed: top-level array", "[{\"partitions\": 2}]", "at byte 0", "must be an object",
                      "array");
    expect_json_error("malformed: top-level number", "  42", "at byte 2", "must be an object", "'4'");
    expect_json_error("malformed: empty input", "", "at byte 0", "the end of the input", NULL);
    expect_json_error("malformed: text after the object", "{} x", "at byte 3", "after the top-level object", NULL);
    expect_json_error("malformed: two objects", "{}{}", "at byte 2", "after the top-level object", NULL);
    expect_json_error("malformed: single quotes", "{'partitions': 2}", "at byte 1", "double quotes", NULL);
    expect_json_error("malformed: Python True", "{\"ddp\": True}", "at byte 8", "true, false and null", NULL);
    expect_json_error("malformed: leading zero", "{\"partitions\": 02}", "at byte 16", "leading zeros", NULL);
    expect_json_error("malformed: bare minus", "{\"partitions\": -}", "at byte 16", "digit", NULL);
    expect_json_error("malformed: dangling decimal point", "{\"timeout\": 1.}", "at byte 14", "decimal point", NULL);
    expect_json_error("malformed: dangling exponent", "{\"timeout\": 1e}", "at byte 14", "exponent", NULL);
    expect_json_error("malformed: NaN", "{\"timeout\": NaN}", "at byte 12", "expected a value", NULL);
    expect_json_error("malformed: plus sign", "{\"timeout\": +1}", "at byte 12", "expected a value", NULL);
    expect_json_error("malformed: invalid escape", "{\"a\\x\": 1}", "at byte 3", "invalid escape '\\x'", NULL);
    expect_json_error("malformed: short \\u escape", "{\"\\u12\": 1}", "at byte 6", "4 hex digits", NULL);
    expect_json_error("malformed: lone low surrogate", "{\"\\udc00\": 1}", "at byte 2", "low surrogate", NULL);
    expect_json_error("malformed: unpaired high surrogate", "{\"\\ud800x\": 1}", "at byte 2", "high surrogate", NULL);
    expect_json_error("malformed: raw newline in a string", "{\"a\nb\": 1}", "at byte 3", "control character", NULL);
    expect_json_error("malformed: invalid UTF-8", "{\"a\xff\": 1}", "at byte 3", "UTF-8", NULL);
    expect_json_error("malformed: overlong UTF-8", "{\"\xc0\xaf\": 1}", "at byte 2", "UTF-8", NULL);
    expect_json_error("malformed: UTF-8 surrogate", "{\"\xed\xa0\x80\": 1}", "at byte 2", "UTF-8", NULL);
    expect_json_error("malformed: truncated UTF-8", "{\"\xe2\x82\": 1}", "at byte 2", "UTF-8", NULL);
    expect_json_error("malformed: syntax error beats an earlier key error", "{\"foo\": 1, ", "at byte 11", NULL,
                      NULL);
    CHECK(strstr(smp_last_error(), "foo") == NULL, "malformed: the key error is not reported over it", "%s",
          smp_last_error());

    /* nesting: the top object is level 1, so the 32nd [ (byte 6 + 31) is level 33 */
    char deep[256];
    strcpy(deep, "{\"a\": ");
    size_t n = strlen(deep);
    for (int i = 0; i < 40; i++) deep[n++] = '[';
    for (int i = 0; i < 40; i++) deep[n++] = ']';
    deep[n++] = '}';
    deep[n] = 0;
    expect_json_error("malformed: nesting too deep", deep, "at byte 37", "nested deeper than 32", NULL);
    /* 31 levels below the top object are fine (then the key is unknown) */
    strcpy(deep, "{\"a\": ");
    n = strlen(deep);
    for (int i = 0; i < 31; i++) deep[n++] = '[';
    for (int i = 0; i < 31; i++) deep[n++] = ']';
    deep[n++] = '}';
    deep[n] = 0;
    expect_json_error("malformed: 32 levels are allowed", deep, "unknown config key \"a\"", NULL, NULL);
}

/* ------------------------------------------------------------ bad structs */
static void test_bad_structs(void) {
    smp_config c;
    memset(&c, 0, sizeof c);

    c.partitions = -1;
    expect_resolve_error("bad struct: negative partitions", c, 4, "\"partitions\"", "got -1", NULL);
    c.partitions = 3;
    c.ddp = SMP_ON;
    expect_resolve_error("bad struct: partitions not dividing the world", c, 4,
                         "partitions = 3 does not divide the world size 4", NULL, NULL);
    c.partitions = 8;
    expect_resolve_error("bad struct: more partitions than ranks", c, 4, "partitions = 8", "world size is 4", NULL);
    c.partitions = 2;
    c.ddp = SMP_DEFAULT;
    expect_resolve_error("bad struct: replicas without ddp", c, 4, "\"ddp\": true", "partitions = 2", "4 ranks");
    c.ddp = SMP_OFF;
    expect_resolve_error("bad struct: replicas with ddp off", c, 8, "\"ddp\": true", "4 model replicas", NULL);
    c.ddp = SMP_ON;

    smp_config b = c;
    b.microbatches = -2;
    expect_resolve_error("bad struct: negative microbatches", b, 4, "\"microbatches\"", "-2", NULL);
    b = c;
    b.has_default_partition = true;
    b.default_partition = 2;
    expect_resolve_error("bad struct: default_partition past the last partition", b, 4, "\"default_partition\"",
                         "= 2", "partitions = 2");
    b.default_partition = -1;
    expect_resolve_error("bad struct: negative default_partition", b, 4, "\"default_partition\"", "-1", NULL);
    b = c;
    b.has_memory_weight = true;
    b.memory_weight = 1.5;
    expect_resolve_error("bad struct: memory_weight above 1", b, 4, "\"memory_weight\"", "1.5", NULL);
    b.memory_weight = -0.25;
    expect_resolve_error("bad struct: negative memory_weight", b, 4, "\"memory_weight\"", "-0.25", NULL);
    b.memory_weight = NAN;
    expect_resolve_error("bad struct: NaN memory_weight", b, 4, "\"memory_weight\"", "nan", NULL);
    b = c;
    b.backward_passes_per_step = -1;
    expect_resolve_error("bad struct: negative backward_passes_per_step", b, 4, "\"backward_passes_per_step\"", "-1",
                         NULL);
    b = c;
    b.bucket_cap_mb = -5;
    expect_resolve_error("bad struct: negative bucket_cap_mb", b, 4, "\"bucket_cap_mb\"", "-5", NULL);
    b.bucket_cap_mb = 2e6;
    expect_resolve_error("bad struct: enormous bucket_cap_mb", b, 4, "\"bucket_cap_mb\"", "2e+06", NULL);
    b = c;
    b.activation_loading_horizon = -1;
    expect_resolve_error("bad struct: negative activation_loading_horizon", b, 4, "\"activation_loading_horizon\"",
                         "-1", "at least 1");
    b = c;
    b.active_microbatches = -2;
    expect_resolve_error("bad struct: negative active_microbatches", b, 4, "\"active_microbatches\"", "-2",
                         "0 for no limit");
    b = c;
    b.virtual_stages = -3;
    expect_resolve_error("bad struct: negative virtual_stages", b, 4, "\"virtual_stages\"", "-3", NULL);
    b = c;
    b.timeout = -1;
    expect_resolve_error("bad struct: negative timeout", b, 4, "\"timeout\"", "-1", NULL);
    b.timeout = INFINITY;
    expect_resolve_error("bad struct: infinite timeout", b, 4, "\"timeout\"", "inf", NULL);
    b = c;
    b.pipeline = SMP_PIPELINE_ZERO_BUBBLE_V;
    b.virtual_stages = 3;
    expect_resolve_error("bad struct: zero_bubble_v with virtual_stages 3", b, 4, "\"virtual_stages\" is 3",
                         "zero_bubble_v", "leave virtual_stages at 1 or 2");
    b = c;
    b.pipeline = (smp_pipeline_kind)5;
    expect_resolve_error("bad struct: pipeline = 5", b, 4, "\"pipeline\"", "5", "SMP_PIPELINE_ZERO_BUBBLE_V (4)");
    b = c;
    b.pipeline = (smp_pipeline_kind)7;
    expect_resolve_error("bad struct: pipeline = 7", b, 4, "\"pipeline\"", "7", "SMP_PIPELINE_SIMPLE");
    b = c;
    b.optimize = (smp_optimize)9;
    expect_resolve_error("bad struct: optimize = 9", b, 4, "\"optimize\"", "9", "SMP_OPTIMIZE_MEMORY");
    b = c;
    b.placement_strategy = (smp_placement)-1;
    expect_resolve_error("bad struct: placement_strategy = -1", b, 4, "\"placement_strategy\"", "-1", NULL);
    b = c;
    b.trace_device = (smp_trace_device)3;
    expect_resolve_error("bad struct: trace_device = 3", b, 4, "\"trace_device\"", "3", "SMP_TRACE_GPU");
    b = c;
    b.ddp = (smp_switch)5;
    expect_resolve_error("bad struct: ddp switch = 5", b, 4, "\"ddp\"", "5", "SMP_ON");
    b = c;
    b.deterministic_reduction = (smp_switch)2;
    expect_resolve_error("bad struct: deterministic_reduction switch = 2", b, 4, "\"deterministic_reduction\"", "2",
                         NULL);

    /* bad JSON that parses but fails at resolve */
    smp_config j;
    memset(&j, 0, sizeof j);
    smp_status st = smp_config_from_json("{\"partitions\": 2, \"ddp\": true, \"memory_weight\": 1.25}", &j);
    CHECK(st == SMP_OK, "bad struct: out-of-range memory_weight parses", "%s", smp_last_error());
    expect_resolve_error("bad struct: memory_weight from JSON checked by resolve", j, 2, "\"memory_weight\"", "1.25",
                         NULL);
    memset(&j, 0, sizeof j);
    st = smp_config_from_json("{\"partitions\": 2, \"default_partition\": 5}", &j);
    expect_resolve_error("bad struct: default_partition from JSON checked by resolve", j, 2, "\"default_partition\"",
                         "5", NULL);
}

/* ------------------------------------------------------------ locale */
static void test_locale(void) {
    const char *names[] = {"de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8", "fr_FR.utf8", NULL};
    const char *got = NULL;
    for (int i = 0; names[i] && !got; i++) got = setlocale(LC_NUMERIC, names[i]);
    if (!got || strcmp(localeconv()->decimal_point, ".") == 0) {
        test_skip("locale: decimal comma", "no locale with a decimal comma is installed");
        setlocale(LC_NUMERIC, "C");
        return;
    }
    smp_config c;
    memset(&c, 0, sizeof c);
    smp_status st = smp_config_from_json("{\"memory_weight\": 0.25, \"timeout\": 1.5e1}", &c);
    CHECK(st == SMP_OK && c.memory_weight == 0.25 && c.timeout == 15.0,
          "locale: '.' numbers under a decimal-comma locale", "%s %g %g", smp_last_error(), c.memory_weight, c.timeout);
    setlocale(LC_NUMERIC, "C");
}

int main(void) {
#ifdef MPI_VERSION
    (void)test_mpi_check;
#endif
    test_defaults();
    test_every_key();
    test_parallel_degrees();
    test_override();
    test_timeout_env();
    test_bad_json_values();
    test_malformed_json();
    test_bad_structs();
    test_locale();
    return test_exit_code();
}
