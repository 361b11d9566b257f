#!/usr/bin/env bash
# Builds the libFuzzer harnesses and runs each on its seed corpus for a
# bounded time; any crash, leak, sanitizer report or broken invariant fails.
#   fuzz_ckpt_header.c  the checkpoint (safetensors) header parser, test/corpus/ckpt
#   fuzz_config.c       the config JSON reader, test/corpus/config
# FUZZ_SECONDS (default 20) is the budget for all of them together, split
# evenly; FUZZ_TARGETS="config" (or "ckpt") runs one. `make fuzz` runs
# them longer. A finding is kept as build/fuzz/<target>-crash-*; the FAIL
# line gives the command that reproduces it.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
targets=${FUZZ_TARGETS:-"ckpt config"}
ntargets=$(echo $targets | wc -w)
secs=$(( ${FUZZ_SECONDS:-20} / ntargets )); [ "$secs" -ge 1 ] || secs=1
out="$top/build/fuzz"
mkdir -p "$out"
declare -A src=([ckpt]=fuzz_ckpt_header [config]=fuzz_config)
declare -A what=([ckpt]="checkpoint header parser" [config]="config JSON reader")

# build them side by side (2 cores), then run one after the other
pids=()
for t in $targets; do
  [ -n "${src[$t]:-}" ] || { echo "FAIL: fuzz/$t: unknown target (ckpt, config)"; exit 1; }
  MPICH_CC=clang mpicc -std=c11 -Wall -Wextra -Werror -g1 -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
    -I"$top" -I"$top/test" "$top/test/${src[$t]}.c" -o "$out/${src[$t]}" -lm >"$out/build-$t.log" 2>&1 &
  pids+=($!)
done
failed=0; i=0
for t in $targets; do
  if ! wait "${pids[$i]}"; then
    echo "FAIL: fuzz/build the ${what[$t]} fuzzer: $(head -c 300 "$out/build-$t.log")"; failed=1
  fi
  i=$((i + 1))
done
[ "$failed" -eq 0 ] || exit 1

for t in $targets; do
  bin="$out/${src[$t]}"; log="$out/run-$t.log"
  mkdir -p "$out/corpus-$t"
  rm -f "$out/$t"-crash-* "$out/$t"-leak-* "$out/$t"-timeout-* "$out/$t"-oom-*
  if "$bin" -max_total_time="$secs" -timeout=10 -print_final_stats=1 -artifact_prefix="$out/$t-" \
       -dict="$top/test/corpus/$t.dict" "$out/corpus-$t" "$top/test/corpus/$t" >"$log" 2>&1; then
    echo "PASS: fuzz/${what[$t]}, ${secs} s, $(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | awk '{print $2}') inputs, no finding"
  else
    art=$(ls "$out/$t"-* 2>/dev/null | grep -E -- '-(crash|leak|timeout|oom)-' | head -n 1)
    echo "FAIL: fuzz/${what[$t]} found a problem: $(grep -m1 -E 'fuzz_config: |fuzz_ckpt_header: |ERROR|SUMMARY' "$log")"
    echo "  reproduce: $bin ${art:-<no artifact; see $log>}   (log: $log)"
    grep -m3 -A2 -E '^(SUMMARY|==[0-9]+==ERROR)|runtime error' "$log" | head -n 8 | sed 's/^/  /'
    failed=1
  fi
done
exit "$failed"
