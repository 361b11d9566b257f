#!/usr/bin/env bash
# Runs smp's tests and adds up their PASS/FAIL lines (see test/test.h).
# usage: test/run.sh BUILD_DIR "unit tests" "mpi tests" "script tests" [rank counts]
# Ends with the line "N passed, N failed" and exits non-zero if anything failed.
# With SMP_SANITIZER_LOGS=1 (sanitizer builds) a sanitizer report anywhere is
# a FAIL that quotes its first lines, even where the test expects the job to
# fail (the timeout and exit scripts): AddressSanitizer writes its reports to
# files (log_path), which catches every process; UBSan under gcc ignores
# log_path (libubsan is a runtime of its own), so its "runtime error:" lines
# are looked for in what the test printed (scripts check their own captures).
set -u
build=$1; unit=$2; mpi=$3; scripts=$4; nps=${5:-"1 2 4"}
passed=0; failed=0; skipped=0
log=$(mktemp)
san=""
san_re='runtime error: |==[0-9]+==ERROR: [A-Za-z]*Sanitizer|[A-Za-z]*Sanitizer:DEADLYSIGNAL|WARNING: ThreadSanitizer: '
if [ -n "${SMP_SANITIZER_LOGS:-}" ]; then
  san=$(mktemp -d)
  export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}log_path=$san/asan"
fi
# The CPU seconds (user + system) of this shell's finished children so far
# (`times` in this shell, not in a $(...) subshell, whose counts start at 0):
# a test's CPU time is the difference across it, its ranks' included (mpirun
# waits for them).
# Oversubscribed ranks take turns in MPICH's waits (test/mpi_yield_shim.c;
# make test builds it; SMP_NO_YIELD_SHIM=1 leaves it out). Every process
# the tests start inherits it; ASan's check that its runtime comes first in
# the library list would refuse the preload, so it is off.
yield_shim="$(cd "$(dirname "$0")/.." && pwd)/build/shim/mpi_yield.so"
if [ -z "${SMP_NO_YIELD_SHIM:-}" ] && [ -f "$yield_shim" ]; then
  export LD_PRELOAD="$yield_shim${LD_PRELOAD:+ $LD_PRELOAD}"
  export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0"
fi
cpu=$(mktemp)
child_cpu() { # variable to set
  times >"$cpu"
  local secs
  secs=$(awk 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] } printf "%.1f", t }' "$cpu")
  printf -v "$1" '%s' "$secs"
}
run() { # label, command...
  local label=$1; shift
  local start=$SECONDS cpu0 cpu1
  child_cpu cpu0
  timeout "${SMP_TEST_TIMEOUT:-900}" "$@" >"$log" 2>&1
  local rc=$?
  child_cpu cpu1
  local p f s
  p=$(grep -c '^PASS: ' "$log"); f=$(grep -c '^FAIL: ' "$log"); s=$(grep -c '^SKIP: ' "$log")
  sed -n 's/^\(FAIL: .*\)/  \1/p; s/^\(SKIP: .*\)/  \1/p' "$log"
  if [ -n "$san" ] && { [ -n "$(ls -A "$san")" ] || grep -q -E "$san_re" "$log"; }; then
    local r
    r=$(ls "$san"/* 2>/dev/null | head -n 1)
    echo "  FAIL: $label: sanitizer report${r:+ ($(ls "$san" | wc -l) AddressSanitizer log(s), the first from pid ${r##*.})}:"
    grep -h -m1 -A6 -E "$san_re" ${r:+"$r"} "$log" | head -n 7 | cut -c 1-200 | sed 's/^/    /'
    rm -f "$san"/*
    f=$((f + 1))
  elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "  FAIL: $label exited with status $rc and reported no failure; its last lines:"
    tail -n 15 "$log" | sed 's/^/    /'
    f=1
  fi
  printf '%-44s %4d passed %3d failed %3d skipped  (%ds, cpu %.0fs)\n' "$label" "$p" "$f" "$s" $((SECONDS - start)) \
    "$(awk -v a="$cpu0" -v b="$cpu1" 'BEGIN { print b - a }')"
  passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
}
for t in $unit; do run "$t" "$build/$t"; done
for t in $mpi; do
  for np in $nps; do run "$t (mpirun -n $np)" mpirun -n "$np" "$build/$t"; done
done
for s in $scripts; do run "$s" bash "$s" "$build"; done
rm -f "$log" "$cpu"; [ -z "$san" ] || rm -rf "$san"
echo
if [ "$skipped" -gt 0 ]; then echo "$passed passed, $failed failed, $skipped skipped"; else echo "$passed passed, $failed failed"; fi
[ "$failed" -eq 0 ]
