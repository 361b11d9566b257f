#!/usr/bin/env bash
# run_mpi_errors.sh - an MPI call that fails on one member of a collective
# the others wait in ends the job at once, with a non-zero status and the
# failing rank's message (the call, what it was for, MPI's text), not at
# SMP_TIMEOUT and never with status 0. See test/test_mpi_errors.c.
#
#   bash test/run_mpi_errors.sh [BUILD_DIR | path/to/test_mpi_errors]
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${1:-$ROOT/build}
if [ -d "$BIN" ]; then BIN=$BIN/test_mpi_errors; fi
if [ ! -x "$BIN" ]; then echo "FAIL: mpi_errors/build: $BIN is not built (make build-gcc)"; exit 1; fi
LOG=$(mktemp -d "${TMPDIR:-/tmp}/smp_mpi_errors.XXXXXX")
trap 'rm -rf "$LOG"' EXIT
failed=0

# mode, then fixed strings stderr must hold; the job must end non-zero well before SMP_TIMEOUT
check() {
    local mode=$1; shift
    local start=$SECONDS
    SMP_TIMEOUT=60 timeout 120 mpirun -n 2 "$BIN" "$mode" >"$LOG/$mode.out" 2>"$LOG/$mode.err" </dev/null
    local rc=$? why=""
    if grep -q 'runtime error: ' "$LOG/$mode.err"; then why="UBSan: $(grep -m1 'runtime error: ' "$LOG/$mode.err")" # asan builds
    elif [ "$rc" -eq 124 ]; then why="the job was still running after 120 s"
    elif [ "$rc" -eq 0 ]; then why="exit status 0: the job ended as if nothing had failed"
    elif [ $((SECONDS - start)) -ge 60 ]; then why="it took $((SECONDS - start)) s: the wait ran into SMP_TIMEOUT instead of hearing of the failure"
    else
        local s
        for s in "$@"; do
            grep -qF -- "$s" "$LOG/$mode.err" || { why="stderr does not say '$s'"; break; }
        done
    fi
    if [ -z "$why" ]; then echo "PASS: mpi_errors/$mode"
    else failed=1; echo "FAIL: mpi_errors/$mode: $why"; grep -v 'UCX  WARN' "$LOG/$mode.err" | sed 's/^/    stderr: /' | head -n 6; fi
}

check one_sided_collective "smp[0] error: world rank 1 failed the collective this rank waits in: MPI_" \
    "failed starting an all_reduce in world: Other MPI error; aborting the job"
check one_sided_bucket "smp[0] error: RDP_GROUP rank 1 (world rank 1) failed the collective this rank waits in: MPI_" \
    "data-parallel gradient bucket 0" "Other MPI error; aborting the job"
exit $failed
