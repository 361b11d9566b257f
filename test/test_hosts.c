/* test_hosts.c - where smp puts each rank when the ranks run on several hosts.

   smp_init with the configuration in SMP_CONFIG (test/run_hosts.sh passes
   partitions 2, ddp, and placement cluster or spread), then every rank
   gathers the host names (MPI_Get_processor_name) of its MP_GROUP and of its
   DP_GROUP through smp_all_gather_bytes, and rank 0 prints one line per rank,
   in rank order:

     rank 0 host host-a local_rank 0/2 mp 0 dp 0 mp_hosts host-a,host-a dp_hosts host-a,host-b

   mp_hosts and dp_hosts list the group's members in group-rank order.

   With the argument "exchange" it then trades a message with its MP_GROUP
   partner (partitions 2), round after round, 10 ms apart, for 60 s; rank 0
   prints "exchanged 3 rounds" after the third. run_hosts.sh cuts a host off
   meanwhile: the ranks left must time out waiting for their partner.

   This program does not judge itself: run_hosts.sh compares the lines with
   the layout the placement must give on its two simulated hosts. Exits
   non-zero only when smp fails.

     mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. -Itest test/test_hosts.c -o build/test_hosts -lm
     SMP_CONFIG='{"partitions": 2, "ddp": true, "placement_strategy": "spread"}' mpirun -n 4 build/test_hosts [exchange]
*/
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#define SMP_IMPLEMENTATION
#include "smp.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

/* The group's host names, comma-separated, in group-rank order. */
static smp_status group_hosts(const char *me, smp_group g, char *out, size_t cap) {
    int n = smp_group_size(g);
    size_t lens[64];
    void *all = NULL;
    if (n > 64) return smp_error(SMP_ERR_ARG, "test_hosts: a group of %d ranks (at most 64 here)", n);
    smp_status st = smp_all_gather_bytes(me, strlen(me) + 1, g, &all, lens);
    if (st) return st;
    size_t at = 0, from = 0;
    out[0] = 0;
    for (int i = 0; i < n; i++) {
        at += (size_t)snprintf(out + at, at < cap ? cap - at : 0, "%s%s", i ? "," : "", (const char *)all + from);
        from += lens[i];
    }
    smp_free(all);
    return SMP_OK;
}

/* Messages to and from the MP_GROUP partner (mp rank 0 sends first, so
   the pair never waits on each other), until 60 s have passed. */
static smp_status exchange(void) {
    if (smp_mp_size() != 2)
        return smp_error(SMP_ERR_CONFIG, "test_hosts exchange: needs partitions 2, not %d", smp_mp_size());
    int partner = 1 - smp_mp_rank();
    struct timespec pause = {0, 10 * 1000 * 1000};
    double start = MPI_Wtime();
    for (int round = 1; MPI_Wtime() - start < 60; round++) {
        int mine = smp_rank() * 1000 + round;
        void *got = NULL;
        size_t len = 0;
        smp_status st = SMP_OK;
        if (smp_mp_rank() == 0) st = smp_send(&mine, sizeof mine, partner, SMP_MP_GROUP);
        if (!st) st = smp_recv_from(partner, SMP_MP_GROUP, &got, &len);
        if (!st && smp_mp_rank() == 1) st = smp_send(&mine, sizeof mine, partner, SMP_MP_GROUP);
        if (got) smp_free(got);
        if (st) return st;
        if (round == 3 && smp_rank() == 0) {
            printf("exchanged 3 rounds\n");
            fflush(stdout);
        }
        nanosleep(&pause, NULL);
    }
    return SMP_OK;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    smp_config cfg = {0}; /* SMP_CONFIG fills it */
    smp_status st = smp_init(&cfg);
    if (st) {
        fprintf(stderr, "test_hosts: smp_init: %s\n", smp_last_error());
        MPI_Finalize();
        return 1;
    }
    char host[MPI_MAX_PROCESSOR_NAME + 1];
    int len = 0;
    memset(host, 0, sizeof host);
    MPI_Get_processor_name(host, &len);

    char mp_hosts[1024], dp_hosts[1024], line[2560];
    if (!st) st = group_hosts(host, SMP_MP_GROUP, mp_hosts, sizeof mp_hosts);
    if (!st) st = group_hosts(host, SMP_DP_GROUP, dp_hosts, sizeof dp_hosts);
    if (!st) {
        snprintf(line, sizeof line, "rank %d host %s local_rank %d/%d mp %d dp %d mp_hosts %s dp_hosts %s", smp_rank(),
                 host, smp_local_rank(), smp_local_size(), smp_mp_rank(), smp_dp_rank(), mp_hosts, dp_hosts);
        void *all = NULL;
        size_t lens[64];
        if (smp_size() > 64) st = smp_error(SMP_ERR_ARG, "test_hosts: %d ranks (at most 64 here)", smp_size());
        if (!st) st = smp_all_gather_bytes(line, strlen(line) + 1, SMP_WORLD, &all, lens);
        if (!st && smp_rank() == 0) {
            size_t from = 0;
            for (int r = 0; r < smp_size(); r++) {
                printf("%s\n", (const char *)all + from);
                from += lens[r];
            }
            fflush(stdout);
        }
        if (all) smp_free(all);
    }
    if (!st && argc > 1 && !strcmp(argv[1], "exchange")) st = exchange();
    if (st) fprintf(stderr, "test_hosts: rank %d: %s\n", smp_rank(), smp_last_error());
    smp_finalize();
    MPI_Finalize();
    return st ? 1 : 0;
}
