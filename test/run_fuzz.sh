#!/usr/bin/env bash
# Builds the libFuzzer harness of the checkpoint header parser and runs it
# for a bounded time (FUZZ_SECONDS, default 20) on the seed corpus; any crash,
# leak or sanitizer report fails. `make fuzz` runs it longer.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
secs=${FUZZ_SECONDS:-20}
out="$top/build/fuzz"
mkdir -p "$out/corpus"
if ! MPICH_CC=clang mpicc -std=c11 -Wall -Wextra -Werror -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
     -I"$top" -I"$top/test" "$top/test/fuzz_ckpt_header.c" -o "$out/fuzz_ckpt_header" -lm >"$out/build.log" 2>&1; then
  echo "FAIL: fuzz/build the header-parser fuzzer: $(head -c 300 "$out/build.log")"; exit 1
fi
if "$out/fuzz_ckpt_header" -max_total_time="$secs" -print_final_stats=1 -dict="$top/test/corpus/ckpt.dict" "$out/corpus" "$top/test/corpus/ckpt" >"$out/run.log" 2>&1; then
  echo "PASS: fuzz/checkpoint header parser, ${secs} s, $(grep -o 'stat::number_of_executed_units: [0-9]*' "$out/run.log" | awk '{print $2}') inputs, no finding"
else
  echo "FAIL: fuzz/checkpoint header parser found a problem: $(grep -m1 -E 'ERROR|SUMMARY' "$out/run.log")"; exit 1
fi
