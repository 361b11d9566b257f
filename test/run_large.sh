#!/usr/bin/env bash
# Messages past 2 GiB (test_large.c): runs when the machine has the memory
# (about 11 GiB for the two ranks), and otherwise says why it skipped.
set -u
build=${1:-build/gcc}
need_kb=$((13 * 1024 * 1024))
avail_kb=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo 2>/dev/null || echo 0)
if [ "${avail_kb:-0}" -lt "$need_kb" ]; then
  echo "SKIP: large: skipped: $((avail_kb / 1048576)) GiB of memory available, test_large needs 13"
  exit 0
fi
[ -x "$build/test_large" ] || { echo "FAIL: large: $build/test_large is not built"; exit 1; }
mpirun -n 2 "$build/test_large"
