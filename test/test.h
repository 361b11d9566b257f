/* test.h - the reporting convention of smp's tests.
   Each check prints one line, "PASS: name" or "FAIL: name: why"; a check that
   cannot run here prints "SKIP: name: why" and counts as neither. test/run.sh
   adds the lines up into "N passed, N failed". Under mpirun, MPI_CHECK has
   the ranks agree first (a check fails if it failed on any rank) and one
   rank prints the line: world rank 0 a PASS, the lowest failing rank its
   FAIL with its reason. CHECK and test_skip print on the rank that calls
   them. */
#ifndef SMP_TEST_H
#define SMP_TEST_H
#include <stdio.h>
#include <stdarg.h>

static int test__failed_total;

static inline void test_report(int ok, const char *name, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static inline void test_report(int ok, const char *name, const char *fmt, ...) {
    if (ok) { printf("PASS: %s\n", name); fflush(stdout); return; }
    test__failed_total++;
    printf("FAIL: %s: ", name);
    va_list ap; va_start(ap, fmt); vprintf(fmt, ap); va_end(ap);
    printf("\n"); fflush(stdout);
}
static inline void test_skip(const char *name, const char *why) { printf("SKIP: %s: %s\n", name, why); fflush(stdout); }

/* CHECK(cond, name, fmt, ...) in a single process. */
#define CHECK(cond, name, ...) test_report(!!(cond), name, __VA_ARGS__)
static inline int test_exit_code(void) { return test__failed_total ? 1 : 0; }

#ifdef MPI_VERSION
/* A check that every rank evaluates: passes only if it passed on all ranks;
   rank 0 prints it. `why` is this rank's reason (printed from rank 0 only
   when rank 0 itself failed; other ranks' failures print their rank). */
static inline void test_mpi_check(int ok, const char *name, const char *why) {
    int rank, all_ok, first_bad = -1, bad;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    bad = ok ? 1 << 30 : rank;
    MPI_Allreduce(&bad, &first_bad, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_ok) test__failed_total++;
    if (first_bad == rank && !ok) {
        /* the first failing rank prints, so the reason is the real one */
        printf("FAIL: %s: rank %d: %s\n", name, rank, why ? why : "");
        fflush(stdout);
    }
    if (rank == 0 && all_ok) { printf("PASS: %s\n", name); fflush(stdout); }
    MPI_Barrier(MPI_COMM_WORLD);
}
#define MPI_CHECK(cond, name, ...) do { char why__[4096]; snprintf(why__, sizeof why__, __VA_ARGS__); \
    test_mpi_check(!!(cond), name, why__); } while (0)
#endif
#endif
