#!/usr/bin/env bash
# bench/fmnist: training samples/s of the demo on this machine, in one run:
# 2 processes as 2 pipeline partitions, as 2 data-parallel replicas, 1
# process with one BLAS thread, 1 process with two BLAS threads; and the
# pipeline's bubble from its timeline. Last line: fmnist samples/s pp2/single.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
bin="$top/build/examples/fmnist"
steps=${FMNIST_BENCH_STEPS:-150}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rounds=${FMNIST_BENCH_ROUNDS:-3}
rate() { # prints the samples/s of the second of two short epochs (the first warms up)
  "$@" --epochs 2 --epoch-steps "$steps" --checkpoint "$tmp/ck" 2>/dev/null | sed -n 's/.*loss [0-9.]*  *\([0-9]*\) samples\/s.*/\1/p' | tail -n1
}
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
export OPENBLAS_NUM_THREADS=1
# The configurations take turns, round after round, so that load from other
# jobs on the machine falls on all of them alike; each figure is a median.
s1=(); s2=(); p2=(); d2=()
for r in $(seq "$rounds"); do
  s1+=("$(rate mpirun -n 1 "$bin" --partitions 1)")
  s2+=("$(OPENBLAS_NUM_THREADS=2 rate mpirun -n 1 "$bin" --partitions 1 --threads 2)")
  p2+=("$(SMP_TIMELINE="$tmp/timeline.json" rate mpirun -n 2 "$bin" --partitions 2)")
  d2+=("$(rate mpirun -n 2 "$bin" --partitions 1 --ddp)")
done
single=$(median "${s1[@]}"); single2=$(median "${s2[@]}"); pp2=$(median "${p2[@]}"); dp2=$(median "${d2[@]}")
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
printf '%-44s %10s\n' "configuration (median of $rounds, $steps steps, batch 128)" "samples/s"
printf '%-44s %10s\n' "1 process, 1 BLAS thread (single)" "$single" "1 process, 2 BLAS threads" "$single2" \
  "2 processes: 2 pipeline partitions (pp2)" "$pp2" "2 processes: 2 data-parallel replicas" "$dp2"
echo "pipeline idle fraction (bubble + transfers) from the pp2 timeline: $bubble"
python3 -c "import sys; s,t,p,d=map(float,sys.argv[1:]); print('pp2/single %.2f  dp2/single %.2f  single-2-threads/single %.2f' % (p/s, d/s, t/s)); print('fmnist samples/s pp2/single: %.2f' % (p/s))" "$single" "$single2" "$pp2" "$dp2"
