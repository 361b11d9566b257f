#!/usr/bin/env bash
# run_exit.sh - a rank that leaves while smp is initialised ends the job
# with a non-zero status and a message naming the rank and where it was
# (smp's exit guard); a clean run still exits 0. See test/test_exit.c.
#
#   bash test/run_exit.sh [BUILD_DIR | path/to/test_exit]
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${1:-$ROOT/build}
if [ -d "$BIN" ]; then BIN=$BIN/test_exit; fi
if [ ! -x "$BIN" ]; then echo "FAIL: exit/build: $BIN is not built (make build-gcc)"; exit 1; fi
LOG=$(mktemp -d "${TMPDIR:-/tmp}/smp_exit.XXXXXX")
trap 'rm -rf "$LOG"' EXIT
failed=0

# mode, the status wanted (0 or "nonzero"), then fixed strings stderr must hold
check() {
    local mode=$1 want=$2; shift 2
    SMP_TIMEOUT=60 timeout 120 mpirun -n 2 "$BIN" "$mode" >"$LOG/$mode.out" 2>"$LOG/$mode.err" </dev/null
    local rc=$? why=""
    if grep -q 'runtime error: ' "$LOG/$mode.err"; then why="UBSan: $(grep -m1 'runtime error: ' "$LOG/$mode.err")" # asan builds
    elif [ "$rc" -eq 124 ]; then why="the job was still running after 120 s"
    elif [ "$want" = 0 ] && [ "$rc" -ne 0 ]; then why="exit status $rc, want 0"
    elif [ "$want" != 0 ] && [ "$rc" -eq 0 ]; then why="exit status 0: the job ended as if nothing was missing"
    else
        local s
        for s in "$@"; do
            grep -qF -- "$s" "$LOG/$mode.err" || { why="stderr does not say '$s'"; break; }
        done
        if [ "$want" = 0 ] && grep -q "error" "$LOG/$mode.err"; then why="a clean run printed an error"; fi
    fi
    if [ -z "$why" ]; then echo "PASS: exit/$mode"
    else failed=1; echo "FAIL: exit/$mode: $why"; sed 's/^/    stderr: /' "$LOG/$mode.err" | head -n 6; fi
}

check exit_in_step nonzero "smp[1] error: rank 1 (mp rank 1, dp rank 0) is exiting while smp is initialised" \
    "in step 4, during the forward of stage 1 on microbatch 1" "call smp_finalize"
check return_early nonzero "smp[0] error: rank 0 (mp rank 0, dp rank 0) is exiting while smp is initialised" "after 5 steps, outside a step"
check clean 0
exit $failed
