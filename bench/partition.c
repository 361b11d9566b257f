/* bench/partition.c - how evenly smp's auto-partitioner splits a model,
   next to the two usual alternatives (DeepSpeed's `uniform` and
   `parameters` partition methods, reimplemented here).

   For each profile and partition count it prints the imbalance of each split:
   the largest stage's cost over the mean stage cost (1.00 is perfect; a
   pipeline's step time follows its slowest stage). Rows marked "speed" weigh
   time; the "memory" rows weigh parameters + gradients + optimizer state +
   activations. The last line is the worst ratio of smp's imbalance to the
   better of the two alternatives, over all rows; it can never exceed 1.00
   because smp's split is the exact optimum of the same objective.

   Build (from the repository root):
     mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. bench/partition.c -o bench/partition -lm
   Run: bench/partition          (or: make bench-partition) */
#define SMP_IMPLEMENTATION
#include "../smp.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CALLS 64
#define OPT_FACTOR 6.0 /* mixed-precision Adam: f32 master + two moments = 6 x the f16 weights */

typedef struct profile {
    const char *name;
    int n;
    const char *label[MAX_CALLS];
    int64_t params[MAX_CALLS];  /* parameter count, what the `parameters` method balances */
    smp_call_cost cost[MAX_CALLS];
} profile;

/* ------------------------------------------------------------ profiles */
/* (a) GPT-2 medium-like: h 1024, 24 blocks, 16 heads, vocabulary 50257,
   sequence 1024, microbatch 4, f16 weights, untied output head. Times come
   from the FLOPs of forward + backward (3 x 2 x tokens x weights, plus
   attention scores) at 100 TFLOP/s, and a bandwidth-bound guess for the
   embedding and norm. Activation bytes per microbatch without recompute
   (Korthikanti et al.: s*b*h*(34 + 5*a*s/h) per block). */
static void profile_gpt(profile *p) {
    const double h = 1024, V = 50257, s = 1024, b = 4, a = 16, tokens = s * b, rate = 100e12;
    const double block_w = 12 * h * h + 13 * h;
    const double block_t = (6 * tokens * block_w + 12 * tokens * s * h) / rate;
    const double head_t = 6 * tokens * V * h / rate + 0.3e-3; /* + softmax / loss */
    int n = 0;
    p->name = "gpt-24";
    p->label[n] = "embedding";
    p->params[n] = (int64_t)(V * h + s * h);
    p->cost[n] = (smp_call_cost){0.25e-3, 2.0 * (double)p->params[n], 3 * s * b * h};
    n++;
    for (int i = 0; i < 24; i++, n++) {
        p->label[n] = "block";
        p->params[n] = (int64_t)block_w;
        p->cost[n] = (smp_call_cost){block_t, 2.0 * block_w, s * b * h * (34 + 5 * a * s / h)};
    }
    p->label[n] = "final_norm";
    p->params[n] = (int64_t)(2 * h);
    p->cost[n] = (smp_call_cost){0.05e-3, 2.0 * 2 * h, 2 * s * b * h};
    n++;
    p->label[n] = "lm_head";
    p->params[n] = (int64_t)(V * h);
    p->cost[n] = (smp_call_cost){head_t, 2.0 * V * h, 2 * s * b * h + 6 * s * b * V};
    n++;
    p->n = n;
}

/* (b) 32 uneven blocks: times uniform in [1, 4] ms (a 4x spread), parameter
   counts uniform in [4M, 16M] and activations in [50, 200] MB, drawn
   independently from a fixed seed (compute and size need not agree, as in
   convolutional or mixture-of-experts stacks). */
static uint64_t bench_rng = 20240611u;
static double bench_unit(void) { /* xorshift64* */
    bench_rng ^= bench_rng >> 12;
    bench_rng ^= bench_rng << 25;
    bench_rng ^= bench_rng >> 27;
    return (double)((bench_rng * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
}
static void profile_uneven(profile *p) {
    p->name = "uneven-32";
    p->n = 32;
    for (int i = 0; i < p->n; i++) {
        double t = 1e-3 * (1.0 + 3.0 * bench_unit());
        double w = 4e6 + 12e6 * bench_unit();
        double act = 50e6 + 150e6 * bench_unit();
        p->label[i] = "block";
        p->params[i] = (int64_t)w;
        p->cost[i] = (smp_call_cost){t, 2.0 * (double)p->params[i], act};
    }
}

/* ------------------------------------------------------------ the alternatives */
/* `uniform`: equal call counts; the first n % k stages take one more. */
static void split_uniform(int n, int k, int *stage) {
    int base = n / k, extra = n % k, i = 0;
    for (int s = 0; s < k; s++)
        for (int c = 0; c < base + (s < extra); c++) stage[i++] = s;
}

/* Stages needed when no stage may hold more than `cap` parameters. */
static int param_stages(const int64_t *w, int n, int64_t cap) {
    int stages = 0;
    for (int i = 0; i < n;) {
        int64_t sum = 0;
        if (w[i] > cap) return n + 1;
        while (i < n && sum + w[i] <= cap) sum += w[i++];
        stages++;
    }
    return stages;
}

/* `parameters`: the split whose largest stage holds the fewest parameters
   (exact, in integers), stages filled from the left as far as that bound and
   the need to leave one call per later stage allow. */
static void split_params(const int64_t *w, int n, int k, int *stage) {
    int64_t lo = 0, hi = 0;
    int i = 0;
    for (int j = 0; j < n; j++) hi += w[j];
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (param_stages(w, n, mid) <= k) hi = mid;
        else lo = mid + 1;
    }
    for (int s = 0; s < k; s++) {
        int64_t sum = 0;
        int first = i;
        while (i < n - (k - s - 1) && (i == first || sum + w[i] <= hi)) sum += w[i], stage[i++] = s;
        if (s == k - 1)
            while (i < n) stage[i++] = s;
    }
}

/* ------------------------------------------------------------ measuring */
static double call_memory(const smp_call_cost *c) { return c->param_bytes * (2.0 + OPT_FACTOR) + c->activation_bytes; }

/* Largest stage over mean stage, for time (memory == 0) or memory. */
static double imbalance(const profile *p, const int *stage, int k, int memory) {
    double per[MAX_CALLS] = {0}, total = 0.0, worst = 0.0;
    for (int i = 0; i < p->n; i++) {
        double v = memory ? call_memory(&p->cost[i]) : p->cost[i].time;
        per[stage[i]] += v;
        total += v;
    }
    for (int s = 0; s < k; s++)
        if (per[s] > worst) worst = per[s];
    return worst / (total / k);
}

static void stage_sizes(const int *stage, int n, int k, char *buf, size_t cap) {
    int count[MAX_CALLS] = {0};
    size_t used = 0;
    for (int i = 0; i < n; i++) count[stage[i]]++;
    buf[0] = 0;
    for (int s = 0; s < k && used + 4 < cap; s++)
        used += (size_t)snprintf(buf + used, cap - used, s ? "+%d" : "%d", count[s]);
}

int main(void) {
    static profile profiles[2];
    static const int parts[3] = {2, 4, 8};
    double worst_ratio = 0.0;
    int failures = 0;
    profile_gpt(&profiles[0]);
    profile_uneven(&profiles[1]);

    printf("pipeline partition imbalance: largest stage / mean stage (1.00 = perfect)\n");
    printf("memory = params x (2 + %.0f) + activations; speed = traced time\n\n", OPT_FACTOR);
    printf("| profile   | objective | partitions | uniform | parameters |  smp | smp / best other | smp calls per "
           "stage |\n");
    printf("|-----------|-----------|-----------:|--------:|-----------:|-----:|-----------------:|--------------------"
           "-|\n");
    for (int pi = 0; pi < 2; pi++) {
        const profile *p = &profiles[pi];
        for (int memory = 0; memory <= (pi == 0); memory++) {
            for (int ki = 0; ki < 3; ki++) {
                int k = parts[ki], su[MAX_CALLS], sp[MAX_CALLS], ss[MAX_CALLS];
                double iu, ip, is, best, ratio;
                char sizes[128];
                split_uniform(p->n, k, su);
                split_params(p->params, p->n, k, sp);
                if (smp_auto_partition(p->cost, p->n, k, memory ? 1.0 : 0.0, OPT_FACTOR, ss, NULL) != SMP_OK) {
                    fprintf(stderr, "smp_auto_partition failed for %s, %d partitions\n", p->name, k);
                    failures++;
                    continue;
                }
                iu = imbalance(p, su, k, memory);
                ip = imbalance(p, sp, k, memory);
                is = imbalance(p, ss, k, memory);
                best = iu < ip ? iu : ip;
                ratio = is / best;
                if (ratio > worst_ratio) worst_ratio = ratio;
                stage_sizes(ss, p->n, k, sizes, sizeof sizes);
                printf("| %-9s | %-9s | %10d | %7.2f | %10.2f | %4.2f | %16.2f | %-19s |\n", p->name,
                       memory ? "memory" : "speed", k, iu, ip, is, ratio, sizes);
            }
        }
    }
    printf("\n");
    printf("partition imbalance smp/best-other (worst case): %.2f\n", worst_ratio);
    return failures ? 1 : 0;
}
