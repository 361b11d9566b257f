#!/usr/bin/env bash
# bench/fmnist: training samples/s of the demo on this machine, in one run:
# 2 processes as 2 pipeline partitions under each schedule (1F1B, ZB-H1,
# ZB-V), as 2 data-parallel replicas, 1 process with one BLAS thread at the
# same microbatching (single: what the runtime's schedule is measured
# against), and 1 process with two BLAS threads at 1 and at 4 microbatches
# (the best a user could do in one process on these cores); and the 1F1B
# pipeline's bubble from its timeline. The line before the last:
# fmnist samples/s pp2/best-single (pp2's best schedule against the best
# one-process figure); the last: fmnist samples/s pp2/single, best schedule.
bench=fmnist
# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh"
bin="$top/build/examples/fmnist"
steps=${FMNIST_BENCH_STEPS:-150}
rounds=${FMNIST_BENCH_ROUNDS:-3}
rate() { # prints the samples/s of the second of two short epochs (the first warms up)
  "$@" --epochs 2 --epoch-steps "$steps" --checkpoint "$tmp/ck" 2>/dev/null | sed -n 's/.*loss [0-9.]*  *\([0-9]*\) samples\/s.*/\1/p' | tail -n1
}
# The configurations take turns, round after round, so that load from other
# jobs on the machine falls on all of them alike; each figure is a median.
s1=(); s2=(); s2m1=(); p2=(); zb=(); zbv=(); d2=()
for r in $(seq "$rounds"); do
  s1+=("$(rate mpirun -n 1 "$bin" --partitions 1)")
  s2+=("$(OPENBLAS_NUM_THREADS=2 rate mpirun -n 1 "$bin" --partitions 1 --threads 2)")
  s2m1+=("$(OPENBLAS_NUM_THREADS=2 rate mpirun -n 1 "$bin" --partitions 1 --threads 2 --microbatches 1)")
  p2+=("$(SMP_TIMELINE="$tmp/timeline.json" rate mpirun -n 2 "$bin" --partitions 2)")
  zb+=("$(rate mpirun -n 2 "$bin" --partitions 2 --pipeline zero_bubble)")
  zbv+=("$(rate mpirun -n 2 "$bin" --partitions 2 --pipeline zero_bubble_v)")
  d2+=("$(rate mpirun -n 2 "$bin" --partitions 1 --ddp)")
done
single=$(median "${s1[@]}"); single2=$(median "${s2[@]}"); single2m1=$(median "${s2m1[@]}")
pp2=$(median "${p2[@]}"); ppzb=$(median "${zb[@]}"); ppzbv=$(median "${zbv[@]}"); dp2=$(median "${d2[@]}")
bubble=$(python3 - "$tmp/timeline.json" <<'PY'
import json, sys, collections
ev = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X"]
busy = collections.defaultdict(float); span = {}
for e in ev:
    r = e["pid"]
    if e["cat"] in ("forward", "backward", "body"): busy[r] += e["dur"]
    lo, hi = span.get(r, (e["ts"], e["ts"] + e["dur"]))
    span[r] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
print("%.3f" % (1 - sum(busy.values()) / sum(hi - lo for lo, hi in span.values())))
PY
)
printf '%-52s %10s\n' "configuration (median of $rounds, $steps steps, batch 128)" "samples/s"
printf '%-52s %10s\n' "1 process, 1 BLAS thread, 4 microbatches (single)" "$single" "1 process, 2 BLAS threads, 4 microbatches" "$single2" \
  "1 process, 2 BLAS threads, 1 microbatch" "$single2m1" \
  "2 pipeline partitions, interleaved (1F1B)" "$pp2" "2 pipeline partitions, zero_bubble (ZB-H1)" "$ppzb" \
  "2 pipeline partitions, zero_bubble_v (ZB-V)" "$ppzbv" "2 data-parallel replicas" "$dp2"
echo "pipeline idle fraction (bubble + transfers) from the 1F1B timeline: $bubble"
python3 - "$single" "$single2" "$single2m1" "$pp2" "$ppzb" "$ppzbv" "$dp2" <<'PY'
import sys
s, t4, t1, p, zb, zbv, d = map(float, sys.argv[1:])
kinds = {"interleaved": p, "zero_bubble": zb, "zero_bubble_v": zbv}
best = max(kinds, key=kinds.get)
best_single = max(t4, t1)
print("pp2/single by schedule: " + "  ".join("%s %.2f" % (k, v / s) for k, v in kinds.items()) +
      "   dp2/single %.2f  single-2-threads/single %.2f (4 mb) %.2f (1 mb)" % (d / s, t4 / s, t1 / s))
print("fmnist samples/s pp2/best-single: %.2f (pp2 %s against 1 process, 2 BLAS threads, %d microbatch%s)"
      % (kinds[best] / best_single, best, 4 if t4 >= t1 else 1, "es" if t4 >= t1 else ""))
print("fmnist samples/s pp2/single: %.2f (%s)" % (kinds[best] / s, best))
PY
