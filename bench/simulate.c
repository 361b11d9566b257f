/* bench/simulate.c - one schedule through smp_schedule_simulate, from the command line: what a step of KIND costs
   with these per-stage operation times, without running it. bench/timeline_steps.py --bound feeds it the times a
   run's SMP_TIMELINE measured, so a benchmark can set its measured step against the schedule's own bound.

   Usage: build/bench/simulate KIND MICROBATCHES STAGE_RANKS COSTS
     KIND         simple | interleaved | zero_bubble | zero_bubble_v (the config's names)
     STAGE_RANKS  the rank of every stage, comma-separated: 0,1 (one stage per rank), 0,1,1,0 (a V), 0,1,0,1
     COSTS        forward/backward/weight seconds (or any unit) of one microbatch on each stage, stages separated by
                  commas: 0.008/0.012/0.004,0.009/0.013/0.005. Outside the zero-bubble kinds the backward is B + W.
   Prints "makespan X bubble Y ideal Z" (X and Z in COSTS' unit, Y the idle fraction); exit status 1 with a
   message on bad input or a deadlock.

   Build: mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. bench/simulate.c -o build/bench/simulate -lm
   (no MPI_Init: the schedules and the simulator are pure functions) */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_STAGES 64

static int fail(const char *what) {
    fprintf(stderr, "simulate: %s\n", what);
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 5)
        return fail("usage: simulate KIND MICROBATCHES STAGE_RANKS COSTS (bench/simulate.c says what each is)");
    static const struct { const char *name; smp_pipeline_kind kind; } kinds[] = {
        {"simple", SMP_PIPELINE_SIMPLE},
        {"interleaved", SMP_PIPELINE_INTERLEAVED},
        {"zero_bubble", SMP_PIPELINE_ZERO_BUBBLE},
        {"zero_bubble_v", SMP_PIPELINE_ZERO_BUBBLE_V},
    };
    int k = 0;
    while (k < 4 && strcmp(argv[1], kinds[k].name)) k++;
    if (k == 4) return fail("KIND is not simple, interleaved, zero_bubble or zero_bubble_v");
    int m = atoi(argv[2]), map[MAX_STAGES], S = 0, R = 0;
    double cost[3][MAX_STAGES];
    for (char *p = argv[3]; *p && S < MAX_STAGES; S++) {
        char *end;
        map[S] = (int)strtol(p, &end, 10);
        if (end == p || map[S] < 0) return fail("STAGE_RANKS: not a comma-separated list of ranks");
        R = map[S] + 1 > R ? map[S] + 1 : R;
        p = *end == ',' ? end + 1 : end;
    }
    int n = 0;
    for (char *p = argv[4]; *p && n < MAX_STAGES; n++)
        for (int h = 0; h < 3; h++) {
            char *end;
            cost[h][n] = strtod(p, &end);
            if (end == p || *end != (h < 2 ? '/' : *end == ',' ? ',' : '\0'))
                return fail("COSTS: not F/B/W per stage, stages separated by commas");
            p = *end ? end + 1 : end;
        }
    if (n != S) return fail("COSTS and STAGE_RANKS name different numbers of stages");
    smp_schedule sc;
    smp_sim_result r;
    if (smp_schedule_build(kinds[k].kind, R, S, map, m, false, &sc)) return fail(smp_last_error());
    smp_status st = smp_schedule_simulate(&sc, cost[0], cost[1], cost[2], 0.0, &r);
    smp_schedule_free(&sc);
    if (st) return fail(smp_last_error());
    if (r.deadlock) fprintf(stderr, "simulate: the schedule deadlocks: %s\n", r.deadlock_reason);
    else printf("makespan %.9g bubble %.4f ideal %.9g\n", r.makespan, r.bubble_fraction, r.ideal);
    bool deadlock = r.deadlock;
    smp_sim_result_free(&r);
    return deadlock ? 1 : 0;
}
