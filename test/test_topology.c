/* test_topology.c - where smp puts each rank, and what its groups are.

   For the world size it runs under (mpirun -n 1, 2, 4, ...), every number of
   partitions that divides it and both placements: smp_init, check every
   coordinate and group against a layout this file builds by enumeration,
   smp_finalize, and check that MPI (which the test started) is still up.
   Also: the pure smp_topology_of for worlds of 1..16 ranks, init/finalize
   cycles (no leaked communicators or memory), a config that cannot work,
   and smp running inside a communicator that is not MPI_COMM_WORLD.

   Build: mpicc -std=c11 -Wall -Wextra -Werror -O2 -I. -Itest test/test_topology.c -o build/test_topology -lm
   Run:   mpirun -n 4 build/test_topology
*/
#define _POSIX_C_SOURCE 200809L /* fork, execve, waitpid */
#define SMP_TESTING /* the test hooks and test-only introspection */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXR 64

/* The layout, built by walking the ranks in order rather than by formula:
   the placement's letters nest loops over the rdp (D), pp (P) and tp (T)
   coordinates, the right-most innermost. cluster is DPT: one model replica
   after another, its partitions side by side, a partition's shards side by
   side; spread is TPD: one partition's replicas after another. */
typedef struct layout {
    int pp[MAXR], tp[MAXR], rdp[MAXR];
} layout;

static const char *letters_of(smp_placement pl) {
    static const char *const l[] = {"DPT", "DPT", "TPD", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD"};
    return l[pl];
}

static void build_layout(int size, int parts, int tp, smp_placement pl, layout *L) {
    const char *x = letters_of(pl);
    int deg[3], c[3], r = 0; /* by position in the letters */
    for (int i = 0; i < 3; i++) deg[i] = x[i] == 'P' ? parts : x[i] == 'T' ? tp : size / (parts * tp);
    for (c[0] = 0; c[0] < deg[0]; c[0]++)
        for (c[1] = 0; c[1] < deg[1]; c[1]++)
            for (c[2] = 0; c[2] < deg[2]; c[2]++, r++)
                for (int i = 0; i < 3; i++) *(x[i] == 'P' ? &L->pp[r] : x[i] == 'T' ? &L->tp[r] : &L->rdp[r]) = c[i];
}

/* A rank's mp and dp coordinates, as smp.h documents them. */
static int mp_of(const layout *L, int tp, int r) { return L->pp[r] * tp + L->tp[r]; }
static int dp_of(const layout *L, int tp, int r) { return L->rdp[r] * tp + L->tp[r]; }

/* Whether s is in r's group g, and s's place there. */
static bool same_group(const layout *L, smp_group g, int r, int s) {
    bool pp = L->pp[s] == L->pp[r], t = L->tp[s] == L->tp[r], d = L->rdp[s] == L->rdp[r];
    return g == SMP_WORLD ? true : g == SMP_MP_GROUP ? d : g == SMP_DP_GROUP ? pp : g == SMP_PP_GROUP ? t && d
         : g == SMP_TP_GROUP ? pp && d : pp && t;
}
static int place_in(const layout *L, int tp, smp_group g, int s) {
    return g == SMP_WORLD ? s : g == SMP_MP_GROUP ? mp_of(L, tp, s) : g == SMP_DP_GROUP ? dp_of(L, tp, s)
         : g == SMP_PP_GROUP ? L->pp[s] : g == SMP_TP_GROUP ? L->tp[s] : L->rdp[s];
}

/* Members of rank r's group g, ordered by their place in it; returns the count. */
static int expected_members(const layout *L, int size, int tp, int r, smp_group g, int *out) {
    int n = 0;
    for (int want = 0; want < size; want++)
        for (int s = 0; s < size; s++)
            if (same_group(L, g, r, s) && place_in(L, tp, g, s) == want) out[n++] = s;
    return n;
}

static const char *placement_name(smp_placement p) {
    return p == SMP_PLACEMENT_SPREAD                                  ? "spread"
           : p == SMP_PLACEMENT_CLUSTER || p == SMP_PLACEMENT_DEFAULT ? "cluster"
                                                                      : letters_of(p);
}
static const char *group_name(smp_group g) {
    static const char *const n[] = {"world", "mp", "dp", "pp", "tp", "rdp"};
    return n[g];
}

static void list_str(const int *v, int n, char *buf, size_t cap) {
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < n && at < cap; i++) at += (size_t)snprintf(buf + at, cap - at, i ? ",%d" : "%d", v[i]);
}

/* Local rank and size from host names, the way a launcher would count. */
static void expected_local(MPI_Comm comm, int *lrank, int *lsize) {
    char name[MPI_MAX_PROCESSOR_NAME];
    int len = 0, me, n;
    memset(name, 0, sizeof name);
    MPI_Get_processor_name(name, &len);
    MPI_Comm_rank(comm, &me);
    MPI_Comm_size(comm, &n);
    char *all = (char *)calloc((size_t)n, MPI_MAX_PROCESSOR_NAME);
    MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm);
    *lrank = 0;
    *lsize = 0;
    for (int s = 0; s < n; s++) {
        if (strcmp(all + (size_t)s * MPI_MAX_PROCESSOR_NAME, name) != 0) continue;
        (*lsize)++;
        if (s < me) (*lrank)++;
    }
    free(all);
}

/* --------------------------------------------------------------- pure */
static void test_topology_of(void) {
    char why[256] = "";
    int ok = 1;
    for (int size = 1; size <= 16 && ok; size++)
        for (int parts = 1; parts <= size && ok; parts++)
            for (int tp = 1; parts * tp <= size && ok; tp++) {
                if (size % (parts * tp)) continue;
                for (int pl = SMP_PLACEMENT_CLUSTER; pl <= SMP_PLACEMENT_TPD && ok; pl++) {
                    layout L;
                    build_layout(size, parts, tp, (smp_placement)pl, &L);
                    int seen[16][16][16];
                    memset(seen, 0, sizeof seen);
                    for (int r = 0; r < size && ok; r++) {
                        smp_coords c = smp_topology_of(r, size, parts, tp, (smp_placement)pl);
                        snprintf(why, sizeof why,
                                 "size %d pp %d tp %d %s rank %d: got (pp %d, tp %d, rdp %d, mp %d, dp %d), "
                                 "want (pp %d, tp %d, rdp %d, mp %d, dp %d)",
                                 size, parts, tp, placement_name((smp_placement)pl), r, c.pp_rank, c.tp_rank,
                                 c.rdp_rank, c.mp_rank, c.dp_rank, L.pp[r], L.tp[r], L.rdp[r], mp_of(&L, tp, r),
                                 dp_of(&L, tp, r));
                        ok = c.pp_rank == L.pp[r] && c.tp_rank == L.tp[r] && c.rdp_rank == L.rdp[r] &&
                             c.mp_rank == mp_of(&L, tp, r) && c.dp_rank == dp_of(&L, tp, r) &&
                             !seen[c.pp_rank][c.tp_rank][c.rdp_rank]++;
                    }
                    /* the named placements are their letter forms */
                    smp_placement same = pl == SMP_PLACEMENT_CLUSTER  ? SMP_PLACEMENT_DPT
                                         : pl == SMP_PLACEMENT_SPREAD ? SMP_PLACEMENT_TPD
                                                                      : (smp_placement)pl;
                    for (int r = 0; r < size && ok; r++) {
                        smp_coords a = smp_topology_of(r, size, parts, tp, (smp_placement)pl),
                                   b = smp_topology_of(r, size, parts, tp, same);
                        ok = !memcmp(&a, &b, sizeof a);
                        snprintf(why, sizeof why, "size %d pp %d tp %d: %s differs from %s at rank %d", size, parts, tp,
                                 placement_name((smp_placement)pl), letters_of(same), r);
                    }
                }
            }
    MPI_CHECK(ok, "topology/topology_of/sizes_1..16", "%.400s", why);

    /* SageMaker's two tables for 8 ranks with tp = pp = rdp = 2: rank -> (rdp_rank, pp_rank, tp_rank) */
    static const int dpt[8][3] = {{0, 0, 0}, {0, 0, 1}, {0, 1, 0}, {0, 1, 1},
                                  {1, 0, 0}, {1, 0, 1}, {1, 1, 0}, {1, 1, 1}};
    static const int ptd[8][3] = {{0, 0, 0}, {1, 0, 0}, {0, 0, 1}, {1, 0, 1},
                                  {0, 1, 0}, {1, 1, 0}, {0, 1, 1}, {1, 1, 1}};
    for (int t = 0; t < 4; t++) {
        smp_placement pl = t == 0   ? SMP_PLACEMENT_DPT
                           : t == 1 ? SMP_PLACEMENT_CLUSTER
                           : t == 2 ? SMP_PLACEMENT_PTD
                                    : SMP_PLACEMENT_DEFAULT;
        const int (*want)[3] = t < 2 || t == 3 ? dpt : ptd;
        ok = 1;
        for (int r = 0; r < 8 && ok; r++) {
            smp_coords c = smp_topology_of(r, 8, 2, 2, pl);
            ok = c.rdp_rank == want[r][0] && c.pp_rank == want[r][1] && c.tp_rank == want[r][2];
            snprintf(why, sizeof why, "rank %d: rdp %d pp %d tp %d, the table says %d %d %d", r, c.rdp_rank, c.pp_rank,
                     c.tp_rank, want[r][0], want[r][1], want[r][2]);
        }
        char name[96];
        snprintf(name, sizeof name, "topology/sagemaker_table/%s", t == 3 ? "default" : placement_name(pl));
        MPI_CHECK(ok, name, "%.400s", why);
    }
}

/* --------------------------------------------------------------- one configuration */
/* Checks coordinates, groups and communicators of the running smp against
   the layout of `parts` partitions x tensor-parallel degree tp placed by
   `pl` over `host`. */
static void check_running(MPI_Comm host, int parts, int tp, smp_placement pl, const char *tag) {
    int hrank, hsize;
    MPI_Comm_rank(host, &hrank);
    MPI_Comm_size(host, &hsize);
    layout L;
    build_layout(hsize, parts, tp, pl, &L);
    char name[160], why[1200];
    int ok;

    int lrank, lsize;
    expected_local(host, &lrank, &lsize);
    snprintf(name, sizeof name, "%s/coords", tag);
    ok = 1;
    why[0] = 0;
#define COORD(got, want)                                                                          \
    if (ok && (got) != (want)) {                                                                  \
        ok = 0;                                                                                   \
        snprintf(why, sizeof why, "%s = %d, want %d (rank %d)", #got, (int)(got), (int)(want), hrank); \
    }
    COORD(smp_rank(), hrank);
    COORD(smp_size(), hsize);
    COORD(smp_local_rank(), lrank);
    COORD(smp_local_size(), lsize);
    COORD(smp_mp_rank(), mp_of(&L, tp, hrank));
    COORD(smp_mp_size(), parts * tp);
    COORD(smp_dp_rank(), dp_of(&L, tp, hrank));
    COORD(smp_dp_size(), hsize / parts);
    COORD(smp_pp_rank(), L.pp[hrank]);
    COORD(smp_pp_size(), parts);
    COORD(smp_tp_rank(), L.tp[hrank]);
    COORD(smp_tp_size(), tp);
    COORD(smp_rdp_rank(), L.rdp[hrank]);
    COORD(smp_rdp_size(), hsize / (parts * tp));
    COORD(smp_group_rank(SMP_WORLD), hrank);
    COORD(smp_group_size(SMP_WORLD), hsize);
    COORD(smp_group_rank(SMP_MP_GROUP), mp_of(&L, tp, hrank));
    COORD(smp_group_size(SMP_MP_GROUP), parts * tp);
    COORD(smp_group_rank(SMP_DP_GROUP), dp_of(&L, tp, hrank));
    COORD(smp_group_size(SMP_DP_GROUP), hsize / parts);
    COORD(smp_group_rank(SMP_PP_GROUP), L.pp[hrank]);
    COORD(smp_group_size(SMP_PP_GROUP), parts);
    COORD(smp_group_rank(SMP_TP_GROUP), L.tp[hrank]);
    COORD(smp_group_size(SMP_TP_GROUP), tp);
    COORD(smp_group_rank(SMP_RDP_GROUP), L.rdp[hrank]);
    COORD(smp_group_size(SMP_RDP_GROUP), hsize / (parts * tp));
    COORD(smp_current_config()->partitions, parts);
    COORD(smp_current_config()->pipeline_parallel_degree, parts);
    COORD(smp_current_config()->tensor_parallel_degree, tp);
    COORD(smp_current_config()->placement_strategy, pl);
#undef COORD
    MPI_CHECK(ok, name, "%.400s", why);

    for (int g = SMP_WORLD; g < SMP_GROUP_COUNT; g++) {
        int want[MAXR], got[MAXR + 1];
        int nwant = expected_members(&L, hsize, tp, hrank, (smp_group)g, want);
        for (int i = 0; i <= MAXR; i++) got[i] = -7;
        int ngot = smp_group_ranks((smp_group)g, got, MAXR);
        ok = ngot == nwant && memcmp(got, want, sizeof(int) * (size_t)nwant) == 0 && got[ngot] == -7;
        char a[256], b[256];
        list_str(got, ngot, a, sizeof a);
        list_str(want, nwant, b, sizeof b);
        snprintf(why, sizeof why, "rank %d: smp_group_ranks gave [%s], want [%s]", hrank, a, b);
        /* the same list member by member */
        for (int i = 0; ok && i < nwant; i++)
            if (smp_group_world_rank((smp_group)g, i) != want[i]) {
                ok = 0;
                snprintf(why, sizeof why, "smp_group_world_rank(%s, %d) = %d, want %d", group_name((smp_group)g), i,
                         smp_group_world_rank((smp_group)g, i), want[i]);
            }
        if (ok && (smp_group_world_rank((smp_group)g, -1) != -1 || smp_group_world_rank((smp_group)g, nwant) != -1)) {
            ok = 0;
            snprintf(why, sizeof why, "smp_group_world_rank outside the group did not give -1");
        }
        /* a short cap writes only cap entries but still returns the count */
        if (ok && nwant > 1) {
            int few[2] = {-7, -7};
            int cnt = smp_group_ranks((smp_group)g, few, 1);
            if (cnt != nwant || few[0] != want[0] || few[1] != -7) {
                ok = 0;
                snprintf(why, sizeof why, "smp_group_ranks with cap 1 returned %d and wrote [%d,%d]", cnt, few[0],
                         few[1]);
            }
        }
        snprintf(name, sizeof name, "%s/%s_group_ranks", tag, group_name((smp_group)g));
        MPI_CHECK(ok, name, "%.400s", why);

        /* the communicator: right size and rank, its own context (a duplicate,
           not the host's communicator), and the members really are those */
        MPI_Comm c = smp_group_comm((smp_group)g);
        ok = c != MPI_COMM_NULL;
        snprintf(why, sizeof why, "smp_group_comm gave MPI_COMM_NULL");
        if (ok) {
            int cs, cr, cmp, hostcmp;
            MPI_Comm_size(c, &cs);
            MPI_Comm_rank(c, &cr);
            MPI_Comm_compare(c, host, &hostcmp);
            MPI_Comm_compare(c, MPI_COMM_WORLD, &cmp);
            int members[MAXR];
            MPI_Allgather(&hrank, 1, MPI_INT, members, 1, MPI_INT, c);
            if (cs != nwant || cr != smp_group_rank((smp_group)g)) {
                ok = 0;
                snprintf(why, sizeof why, "communicator has size %d rank %d, want %d and %d", cs, cr, nwant,
                         smp_group_rank((smp_group)g));
            } else if (hostcmp == MPI_IDENT || cmp == MPI_IDENT) {
                ok = 0;
                snprintf(why, sizeof why, "the group communicator is the host's own communicator, not a duplicate");
            } else if (g == SMP_WORLD && hostcmp != MPI_CONGRUENT) {
                ok = 0;
                snprintf(why, sizeof why, "the world communicator is not congruent with the host communicator (%d)",
                         hostcmp);
            } else if (memcmp(members, want, sizeof(int) * (size_t)nwant) != 0) {
                ok = 0;
                list_str(members, nwant, a, sizeof a);
                snprintf(why, sizeof why, "ranks found by talking over the communicator: [%s], want [%s]", a, b);
            }
        }
        snprintf(name, sizeof name, "%s/%s_comm", tag, group_name((smp_group)g));
        MPI_CHECK(ok, name, "%.400s", why);
    }
}

static void test_configuration(int parts, int tp, smp_placement pl, bool name_default) {
    int wsize;
    MPI_Comm_size(MPI_COMM_WORLD, &wsize);
    char tag[96], name[160];
    snprintf(tag, sizeof tag, "topology/n=%d/p=%d/tp=%d/%s", wsize, parts, tp,
             name_default ? "default_placement" : placement_name(pl));
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.partitions = parts;
    cfg.tensor_parallel_degree = tp == 1 ? 0 : tp;
    cfg.placement_strategy = name_default ? SMP_PLACEMENT_DEFAULT : pl;
    if (wsize / (parts * tp) > 1) cfg.ddp = SMP_ON;
    smp_status st = smp_init(&cfg);
    snprintf(name, sizeof name, "%s/init", tag);
    MPI_CHECK(st == SMP_OK && smp_is_initialized(), name, "smp_init: %s (%.300s)", smp_status_name(st),
              smp_last_error());
    if (st != SMP_OK) return;
    check_running(MPI_COMM_WORLD, parts, tp, name_default ? SMP_PLACEMENT_CLUSTER : pl, tag);

    smp_status twice = smp_init(&cfg);
    snprintf(name, sizeof name, "%s/init_twice", tag);
    MPI_CHECK(twice == SMP_ERR_STATE && strstr(smp_last_error(), "twice"), name, "second smp_init gave %s (%.300s)",
              smp_status_name(twice), smp_last_error());

    smp_finalize();
    int up = 0, down = 1;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    snprintf(name, sizeof name, "%s/finalize_keeps_mpi", tag);
    MPI_CHECK(up && !down && !smp_is_initialized(), name,
              "after smp_finalize: MPI initialized %d, finalized %d, smp initialized %d", up, down,
              (int)smp_is_initialized());
}

/* --------------------------------------------------------------- other communicators */
static void test_inside(MPI_Comm host, const char *tag) {
    int hrank, hsize, wrank;
    MPI_Comm_rank(host, &hrank);
    MPI_Comm_size(host, &hsize);
    MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
    int parts = hsize % 2 == 0 ? 2 : 1;
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.partitions = parts;
    cfg.comm = host;
    if (hsize / parts > 1) cfg.ddp = SMP_ON;
    char name[160];
    smp_status st = smp_init(&cfg);
    snprintf(name, sizeof name, "%s/init", tag);
    MPI_CHECK(st == SMP_OK, name, "smp_init: %s (%.300s)", smp_status_name(st), smp_last_error());
    if (st != SMP_OK) return;
    check_running(host, parts, 1, SMP_PLACEMENT_CLUSTER, tag);
    /* a sum over smp's world adds up only the ranks of this communicator */
    int64_t mine = wrank + 1, got = -1, want = 0;
    int64_t *all = (int64_t *)calloc((size_t)hsize, sizeof *all);
    MPI_Allgather(&mine, 1, MPI_INT64_T, all, 1, MPI_INT64_T, host);
    for (int i = 0; i < hsize; i++) want += all[i];
    free(all);
    smp_tensor a = smp_tensor_1d(&mine, SMP_I64, 1), b = smp_tensor_1d(&got, SMP_I64, 1);
    st = smp_all_reduce(&a, &b, SMP_SUM, SMP_WORLD);
    snprintf(name, sizeof name, "%s/all_reduce_stays_inside", tag);
    MPI_CHECK(st == SMP_OK && got == want, name, "sum of world ranks + 1 over smp's world: %lld (%.300s), want %lld",
              (long long)got, smp_last_error(), (long long)want);
    smp_finalize();
}

/* --------------------------------------------------------------- smp owning MPI */
/* Run as its own singleton process (no launcher): smp_init starts MPI,
   smp_finalize ends it, and MPI cannot start twice, so a second smp_init must
   be refused with SMP_ERR_STATE rather than call into a finalized MPI.
   Exit status: 0 good, 10+ the step that went wrong. */
static int owned_mpi_child(void) {
    int up = 0, down = 0;
    if (smp_init(NULL) != SMP_OK) return 10;
    MPI_Initialized(&up);
    if (!up) return 11;
    smp_finalize();
    MPI_Finalized(&down);
    if (!down) return 12; /* smp started MPI, so smp_finalize must end it */
    smp_status st = smp_init(NULL);
    if (st == SMP_OK) return 13;
    if (st != SMP_ERR_STATE) return 14;
    return 0;
}

extern char **environ;

/* Starts this program again as `prog --owned-mpi` without the launcher's
   variables (so MPI_Init makes a singleton) and returns its exit status,
   or 128 + signal. Called before MPI_Init. */
static int run_owned_mpi_child(const char *prog) {
    static char *env[256];
    int ne = 0;
    for (char **e = environ; *e && ne < 255; e++)
        if (strncmp(*e, "PMI", 3) && strncmp(*e, "HYD", 3) && strncmp(*e, "MPI_LOCAL", 9)) env[ne++] = *e;
    env[ne] = NULL;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        char *args[] = {(char *)prog, (char *)"--owned-mpi", NULL};
        execve("/proc/self/exe", args, env);
        _exit(127);
    }
    if (pid < 0) return 126;
    int ws = 0;
    waitpid(pid, &ws, 0);
    if (WIFSIGNALED(ws)) return 128 + WTERMSIG(ws);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 125;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--owned-mpi") == 0) return owned_mpi_child();
    /* only the launcher's rank 0 starts the child, before MPI is up */
    const char *pmi_rank = getenv("PMI_RANK");
    int owned_rc = !pmi_rank || strcmp(pmi_rank, "0") == 0 ? run_owned_mpi_child(argv[0]) : 0;
    MPI_Init(&argc, &argv);
    int wrank, wsize;
    MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
    MPI_Comm_size(MPI_COMM_WORLD, &wsize);
    if (wsize > MAXR) {
        if (wrank == 0) test_skip("topology", "more than 64 ranks");
        MPI_Finalize();
        return 0;
    }

    (void)test_report; /* test.h's single-process helper; unused here */
    test_topology_of();

    MPI_Bcast(&owned_rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_CHECK(owned_rc == 0, "topology/owned_mpi/init_again_after_finalize_refused",
              "a singleton that let smp start MPI: %s (exit status %d)",
              owned_rc == 10   ? "first smp_init failed"
              : owned_rc == 11 ? "smp_init did not start MPI"
              : owned_rc == 12 ? "smp_finalize did not finalize the MPI it started"
              : owned_rc == 13 ? "second smp_init claimed success"
              : owned_rc == 14 ? "second smp_init failed with a status other than SMP_ERR_STATE"
                               : "the second smp_init called into the finalized MPI, which ended the process",
              owned_rc);

    /* before smp_init, the queries say "nothing" rather than crash */
    MPI_CHECK(!smp_is_initialized() && smp_group_comm(SMP_WORLD) == MPI_COMM_NULL &&
                  smp_group_size(SMP_DP_GROUP) == 0 && smp_group_rank(SMP_MP_GROUP) == -1 &&
                  smp_group_ranks(SMP_WORLD, NULL, 0) == 0,
              "topology/before_init", "queries before smp_init returned values of a running smp");

    for (int parts = 1; parts <= wsize; parts++) {
        if (wsize % parts) continue;
        test_configuration(parts, 1, SMP_PLACEMENT_CLUSTER, false);
        test_configuration(parts, 1, SMP_PLACEMENT_SPREAD, false);
    }
    test_configuration(wsize % 2 == 0 ? 2 : 1, 1, SMP_PLACEMENT_CLUSTER, true); /* zero placement means cluster */
    /* tensor parallelism: the whole world one TP group, and at 4 ranks pp 2 x tp 2 and tp 2 x rdp 2 under letter forms
     */
    if (wsize > 1) test_configuration(1, wsize, SMP_PLACEMENT_CLUSTER, false);
    if (wsize % 4 == 0) {
        test_configuration(2, 2, SMP_PLACEMENT_PTD, false);
        test_configuration(1, 2, SMP_PLACEMENT_TDP, false);
        test_configuration(2, 2, SMP_PLACEMENT_SPREAD, false);
    }

    /* pp x tp that does not divide the world fails on every rank, naming both degrees */
    if (wsize > 1) {
        smp_config bad;
        memset(&bad, 0, sizeof bad);
        bad.partitions = wsize;
        bad.tensor_parallel_degree = 2;
        smp_status st = smp_init(&bad);
        MPI_CHECK(st == SMP_ERR_CONFIG && strstr(smp_last_error(), "tensor_parallel_degree = 2") &&
                      strstr(smp_last_error(), "does not divide the world size") && !smp_is_initialized(),
                  "topology/bad_pp_times_tp", "partitions %d x tensor_parallel_degree 2 on %d ranks gave %s (%.300s)",
                  wsize, wsize, smp_status_name(st), smp_last_error());
    }

    /* a partition count that does not divide the world fails on every rank,
       names the problem, and leaves smp ready for a correct init */
    {
        smp_config bad;
        memset(&bad, 0, sizeof bad);
        bad.partitions = wsize + 1;
        bad.ddp = SMP_ON;
        smp_status st = smp_init(&bad);
        MPI_CHECK(st == SMP_ERR_CONFIG && strstr(smp_last_error(), "partitions") && !smp_is_initialized(),
                  "topology/bad_partitions", "partitions = %d on %d ranks gave %s (%.300s)", wsize + 1, wsize,
                  smp_status_name(st), smp_last_error());
        int up = 0, down = 1;
        MPI_Initialized(&up);
        MPI_Finalized(&down);
        MPI_CHECK(up && !down, "topology/bad_partitions/keeps_mpi",
                  "MPI initialized %d finalized %d after a failed smp_init", up, down);
    }

    /* many cycles: communicators, datatypes and memory must all be given back
       (MPICH runs out of communicator contexts after ~2000 leaked ones, which
       500 cycles of 4+ communicators would reach). Oversubscribed (-n 4 on 2
       cores) a cycle's blocking MPI calls take tens of ms, so fewer there. */
    {
        int64_t before = smp_memory().current_bytes;
        int ok = 1, cycles = wsize <= 2 ? 500 : 40;
        char why[256] = "";
        for (int i = 0; i < cycles && ok; i++) {
            smp_config cfg;
            memset(&cfg, 0, sizeof cfg);
            cfg.partitions = (i % 2 && wsize % 2 == 0) ? 2 : 1;
            if (wsize / cfg.partitions > 1) cfg.ddp = SMP_ON;
            smp_status st = smp_init(&cfg);
            if (st != SMP_OK) {
                ok = 0;
                snprintf(why, sizeof why, "cycle %d: smp_init: %.200s", i, smp_last_error());
                break;
            }
            smp_finalize();
            if (smp_memory().current_bytes != before) {
                ok = 0;
                snprintf(why, sizeof why, "cycle %d: %lld bytes still allocated after smp_finalize", i,
                         (long long)(smp_memory().current_bytes - before));
            }
        }
        MPI_CHECK(ok, "topology/init_finalize_cycles", "%.400s", why);
    }

    /* smp inside a communicator that is not the world */
    if (wsize >= 2) {
        MPI_Comm half;
        MPI_Comm_split(MPI_COMM_WORLD, wrank < wsize / 2 ? 0 : 1, wrank, &half);
        test_inside(half, "topology/inside_half_of_world");
        MPI_Comm_free(&half);
    }
    /* reversed: smp's rank 0 is the last world rank */
    {
        MPI_Comm rev;
        MPI_Comm_split(MPI_COMM_WORLD, 0, wsize - 1 - wrank, &rev);
        test_inside(rev, "topology/inside_reversed_world");
        MPI_Comm_free(&rev);
    }
    test_inside(MPI_COMM_SELF, "topology/inside_comm_self");

    int up = 0;
    MPI_Initialized(&up);
    MPI_CHECK(up, "topology/mpi_still_up", "MPI is not initialized at the end");
    int failed = test_exit_code();
    MPI_Finalize();
    return failed;
}
