/* mpi_yield_shim.c - make test preloads this into every process it starts
   (test/run.sh), so that ranks oversubscribing the cores take turns.

   Why: MPICH's ch4:ucx device waits in a blocking MPI call (MPI_Comm_split,
   MPI_Allreduce, MPI_Barrier, ...) by calling ucp_worker_progress in a loop
   that never gives up the core. With 4 ranks on 2 cores a waiting rank
   spins through its whole time slice while the rank it waits for is not
   running, and every blocking call costs milliseconds: smp_init at 4 ranks
   took 300 ms here against under 1 ms at 2 (test_topology: 18 s against
   0.2 s; test_composite: 38 s against 3.4 s with this shim). smp's own
   waits back off (smp__backoff_pause, smp.h); MPICH's do not, and
   MPIR_CVAR_POLLS_BEFORE_YIELD does not reach ch4.

   What: a poll that moved nothing 16 times in a row yields the core.
   Nothing else changes: MPI's semantics, message order and every result
   are the same, only who runs while a rank waits. Processes without UCX
   never call it. Benchmarks do not load it: their timings are MPICH's own.
   Set SMP_NO_YIELD_SHIM=1 to run the tests without it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct ucp_worker *ucp_worker_h; /* UCX's opaque handle; only passed through */
unsigned ucp_worker_progress(ucp_worker_h worker);

unsigned ucp_worker_progress(ucp_worker_h worker) {
    static unsigned (*next)(ucp_worker_h);
    static unsigned idle_polls;
    if (!next) {
        next = (unsigned (*)(ucp_worker_h))dlsym(RTLD_NEXT, "ucp_worker_progress");
        if (!next) {
            fprintf(stderr, "mpi_yield_shim: no ucp_worker_progress after this library (%s)\n", dlerror());
            abort();
        }
    }
    unsigned events = next(worker);
    if (events) idle_polls = 0;
    else if (++idle_polls >= 16) {
        idle_polls = 0;
        sched_yield();
    }
    return events;
}
