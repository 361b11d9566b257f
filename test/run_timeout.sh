#!/usr/bin/env bash
# run_timeout.sh - checks that a wait nobody answers ends the job (SMP_TIMEOUT).
#
# For each mode of test_timeout (rank 0 waits, rank 1 sleeps 30 s and never
# joins) it runs the job under SMP_TIMEOUT=2 with a wall-clock guard and
# checks: the job exits non-zero, in under 20 s, and rank 0's stderr names
# what it waited for and the group. Mode bad_args_world (rank 1 fails the
# collective with bad arguments) runs under SMP_TIMEOUT=120 and must end
# in under 20 s all the same, with rank 1's error in rank 0's message.
# Prints one PASS:/FAIL: line per mode, in test.h's format; exits 1 if any
# failed.
#
#   bash test/run_timeout.sh [BUILD_DIR | path/to/test_timeout]
# (test/run.sh passes its build directory.) Without an argument it uses
# build/test_timeout; a missing binary is built with mpicc.

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${1:-$ROOT/build}
if [ -d "$BIN" ]; then BIN=$BIN/test_timeout; fi
if [ ! -x "$BIN" ]; then
    mkdir -p "$(dirname "$BIN")"
    if ! mpicc -std=c11 -Wall -Wextra -Werror -O2 -I"$ROOT" -I"$ROOT/test" "$ROOT/test/test_timeout.c" -o "$BIN" -lm; then
        echo "FAIL: timeout/build: test_timeout.c did not compile"
        exit 1
    fi
fi

LOG=$(mktemp -d "${TMPDIR:-/tmp}/smp_timeout.XXXXXX")
trap 'rm -rf "$LOG"' EXIT
failed=0

# SMP_TIMEOUT, mode, the phrase that marks rank 0's message, then fixed
# strings that message must contain
check() {
    local timeout_s=$1 mode=$2 marker=$3; shift 3
    local err="$LOG/$mode.err" out="$LOG/$mode.out"
    local t0 t1 rc elapsed
    t0=$(date +%s.%N)
    SMP_TIMEOUT=$timeout_s timeout 60 mpirun -n 2 "$BIN" "$mode" >"$out" 2>"$err" </dev/null
    rc=$?
    t1=$(date +%s.%N)
    elapsed=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    local why=""
    if grep -q 'runtime error: ' "$err"; then # UBSan (asan builds): a job that fails anyway still must not hit one
        why="UBSan: $(grep -m1 'runtime error: ' "$err")"
    elif [ "$rc" -eq 124 ]; then
        why="the job was still running after 60 s (killed by the guard)"
    elif grep -q "the wait returned" "$err"; then
        why="the wait returned although rank 1 never joined"
    elif [ "$rc" -eq 0 ]; then
        why="the job exited with status 0"
    elif ! awk -v e="$elapsed" 'BEGIN { exit !(e < 20) }'; then
        why="the job took ${elapsed} s (want < 20 s)"
    else
        # the message comes from rank 0 and says why it gave up
        local line
        line=$(grep -F "smp[0] error:" "$err" | grep -F "$marker" | head -n 1)
        if [ -z "$line" ]; then
            why="no 'smp[0] error: ... $marker' line on stderr"
        else
            local want
            for want in "$@"; do
                if ! printf '%s' "$line" | grep -qF -- "$want"; then
                    why="rank 0's message does not contain '$want': $line"
                    break
                fi
            done
        fi
    fi
    if [ -z "$why" ]; then
        echo "PASS: timeout/$mode"
    else
        failed=1
        echo "FAIL: timeout/$mode: $why (exit status $rc, ${elapsed} s)"
        sed 's/^/    stderr: /' "$err" | head -n 8
    fi
}

check 2 all_reduce_world "timed out" "waiting for all_reduce" "in world" "SMP_TIMEOUT=2"
check 2 all_reduce_mp "timed out" "waiting for all_reduce" "in MP_GROUP"
check 2 barrier_world "timed out" "waiting for barrier" "in world"
check 2 recv_dp "timed out" "smp_recv_from" "from DP_GROUP rank 1" "world rank 1"
check 120 bad_args_world "failed the collective this rank waits in" "world rank 1" "out has 999 elements but in's count needs 1000"
exit $failed
