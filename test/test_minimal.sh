#!/usr/bin/env bash
# examples/minimal.c, the README's minimal program: the README shows it
# verbatim, smp.h's opening comment shows an excerpt of it, it builds clean
# with gcc and clang, it trains on 2 ranks, and a step that fails ends the
# program with that failure alone (smp_finalize on every rank, no exit guard).
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
src="$top/examples/minimal.c"
awk '/^## A minimal program/ {on = 1} on && /^```c$/ {grab = 1; next} grab && /^```$/ {exit} grab {print}' "$top/README.md" >"$tmp/readme.c"
if cmp -s "$tmp/readme.c" "$src"; then echo "PASS: minimal/the README's minimal program is examples/minimal.c verbatim"
else echo "FAIL: minimal/the README's minimal program differs from examples/minimal.c: $(diff "$tmp/readme.c" "$src" | head -n 4 | tr '\n' ' ')"; fi
# smp.h's excerpt: its code lines (indented 4 past the comment's 3) are the
# file's in order; consecutive lines are consecutive in the file (blank lines
# aside) and "..." stands for lines left out.
awk '/^   THE SMALLEST PROGRAM:/ {on = 1; next} on && /^   Build: / {exit} on && /^    / {print substr($0, 5)}' \
  "$top/smp.h" >"$tmp/excerpt.c"
why=$(awk -v src="$src" '
  BEGIN { while ((getline line < src) > 0) f[++n] = line; pos = 0; gap = 1 }
  { t = $0; gsub(/^ +| +$/, "", t) }
  t == "..." { gap = 1; next }
  { shown++
    if (gap) { for (j = pos + 1; j <= n && f[j] != $0; j++); }
    else { for (j = pos + 1; j <= n && f[j] == ""; j++); if (j <= n && f[j] != $0) j = n + 1 }
    if (j > n) { printf "excerpt line %d \"%s\" is not the file'"'"'s %s line %d", NR, $0, gap ? "after" : "next after", pos; bad = 1; exit }
    pos = j; gap = 0 }
  END { if (!bad && shown < 20) printf "only %d code lines found in smp.h'"'"'s THE SMALLEST PROGRAM", shown }' "$tmp/excerpt.c")
if [ -z "$why" ]; then echo "PASS: minimal/smp.h's smallest program is an excerpt of examples/minimal.c ($(grep -vc '^ *\.\.\.$' "$tmp/excerpt.c") lines)"
else echo "FAIL: minimal/smp.h's smallest program: $why"; fi
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
# A step that fails (SMP_CONFIG's 3 microbatches do not divide the batch of 32)
# is reported, and the program still calls smp_finalize, so the exit guard
# does not add a failure of its own ("exiting while smp is initialised").
out=$(SMP_CONFIG='{"microbatches": 3}' mpirun -n 2 "$tmp/minimal_gcc" 2>&1); rc=$?
if [ $rc -ne 0 ] && echo "$out" | grep -q 'does not divide into 3 microbatches' && ! echo "$out" | grep -q 'exiting while smp is initialised'; then
  echo "PASS: minimal/a failed step ends the program (status $rc) with its own message only"
else echo "FAIL: minimal/a failed step (status $rc): $(echo "$out" | head -n 4 | cut -c 1-200 | tr '\n' ' ')"; fi
