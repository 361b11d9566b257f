#!/usr/bin/env bash
# examples/minimal.c, the README's minimal program: the README shows it
# verbatim, it builds clean with gcc and clang, and it trains on 2 ranks.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
src="$top/examples/minimal.c"
awk '/^## A minimal program/ {on = 1} on && /^```c$/ {grab = 1; next} grab && /^```$/ {exit} grab {print}' "$top/README.md" >"$tmp/readme.c"
if cmp -s "$tmp/readme.c" "$src"; then echo "PASS: minimal/the README's minimal program is examples/minimal.c verbatim"
else echo "FAIL: minimal/the README's minimal program differs from examples/minimal.c: $(diff "$tmp/readme.c" "$src" | head -n 4 | tr '\n' ' ')"; fi
for cc in gcc clang; do
  if MPICH_CC=$cc mpicc -std=c11 -Wall -Wextra -Werror -O2 -I"$top" "$src" -o "$tmp/minimal_$cc" -lm >"$tmp/$cc.log" 2>&1; then
    echo "PASS: minimal/builds with $cc -Wall -Wextra -Werror"
  else echo "FAIL: minimal/build with $cc: $(head -n 5 "$tmp/$cc.log" | tr '\n' ' ')"; fi
done
[ -x "$tmp/minimal_gcc" ] || exit 1
out=$(mpirun -n 2 "$tmp/minimal_gcc" 2>&1); rc=$?
first=$(echo "$out" | awk '/^step 0 loss/ {print $4}'); last=$(echo "$out" | awk '/^step [0-9]+ loss/ {v = $4} END {print v}')
if [ $rc -eq 0 ] && [ -n "$first" ] && awk -v a="$first" -v b="$last" 'BEGIN {exit !(b < a / 2)}'; then
  echo "PASS: minimal/trains on 2 pipeline stages: loss $first -> $last"
else echo "FAIL: minimal/run on 2 ranks (status $rc): $(echo "$out" | tail -n 3 | tr '\n' ' ')"; fi
