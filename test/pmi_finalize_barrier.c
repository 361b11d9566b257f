/* pmi_finalize_barrier.c - MPI_Finalize behind a PMI barrier, for MPICH
   before 4.2 with UCX over TCP (test/run_hosts.sh preloads it).

   MPICH 4.0's UCX netmod closes every endpoint in MPI_Finalize (a flush,
   which over UCX's TCP transport waits for the peer to acknowledge) and only
   then enters a PMI barrier, where it no longer drives UCX. A rank that
   finishes its closes early sits in that barrier while a later rank's flush
   waits for its acknowledgement forever: jobs across hosts hang in
   MPI_Finalize now and then (1 run in 6 here). MPICH 4.2 enters a PMI
   barrier before the closes (commit d6c7cd5b64, "ch4/ucx: add
   MPIR_pmi_barrier in finalize"); this shim does the same from outside:
   it intercepts MPI_Finalize, runs the PMI-1 barrier on the launcher's
   socket (PMI_FD, "cmd=barrier_in" / "cmd=barrier_out", the wire protocol
   of MPICH's simple PMI client) while no rank drives UCX, then calls
   PMPI_Finalize. Nothing of smp is involved; without PMI_FD (not started
   by hydra) it only calls PMPI_Finalize.

     mpicc -shared -fPIC -O2 test/pmi_finalize_barrier.c -o build/pmi_finalize_barrier.so
     LD_PRELOAD=$PWD/build/pmi_finalize_barrier.so mpiexec ... */
#include <mpi.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int write_all(int fd, const char *s, size_t n) {
    while (n > 0) {
        ssize_t k = write(fd, s, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        s += k;
        n -= (size_t)k;
    }
    return 0;
}

int MPI_Finalize(void) {
    const char *env = getenv("PMI_FD");
    if (env && *env) {
        int fd = atoi(env);
        static const char in[] = "cmd=barrier_in\n";
        char line[256];
        size_t n = 0;
        if (write_all(fd, in, sizeof in - 1) == 0) {
            char c;
            for (;;) {
                ssize_t k = read(fd, &c, 1);
                if (k < 0 && errno == EINTR) continue;
                if (k <= 0 || c == '\n') break;
                if (n < sizeof line - 1) line[n++] = c;
            }
        }
        line[n] = 0;
        if (!strstr(line, "cmd=barrier_out"))
            fprintf(stderr, "pmi_finalize_barrier: the PMI barrier before MPI_Finalize answered '%s'\n", line);
    }
    return PMPI_Finalize();
}
