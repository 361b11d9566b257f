#!/usr/bin/env bash
# bench/memory: what shard_optimizer_state and active_microbatches save,
# from the memory account examples/gpt.c prints at the end ("memory peak
# rank R: parameters X MiB, ..."), on the default GPT model:
#   - 2 data-parallel replicas (--ddp --deterministic), with and without
#     --shard-optimizer, taking turns for MEM_BENCH_ROUNDS rounds: the
#     optimizer state bytes per rank and the step time (the best round of
#     each), and the training state bytes per parameter per rank (parameters,
#     gradients, optimizer state) beside Megatron's formula for fp32
#     parameters, gradients and Adam state over d replicas: 8 + 8/d;
#   - 2 pipeline partitions with the simple (GPipe) schedule and
#     MEM_BENCH_MB microbatches under active_microbatches 1..m: the largest
#     activation peak of a rank.
# Timings need a quiet machine; the byte figures do not.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
bin="$top/build/examples/gpt"
steps=${MEM_BENCH_STEPS:-10}
rounds=${MEM_BENCH_ROUNDS:-3}
mb=${MEM_BENCH_MB:-4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[ -x "$bin" ] || { echo "bench/memory: $bin is missing (make build/examples/gpt)" >&2; exit 1; }
export OPENBLAS_NUM_THREADS=1
common=(--steps "$steps" --log-every 1000000 --val-batches 0 --sample-len 0 --save "")

run() { # NAME NP ARGS...: the run's output in $tmp/NAME
  local name=$1 np=$2; shift 2
  mpirun -n "$np" "$bin" "${common[@]}" "$@" >"$tmp/$name" 2>&1 || { echo "bench/memory: $name failed:" >&2; tail -n 20 "$tmp/$name" >&2; exit 1; }
}
# the largest figure of category CAT over the ranks, in MiB
peak() { sed -n "s/^memory peak rank [0-9]*: .*$2 \([0-9.]*\) MiB.*/\1/p" "$tmp/$1" | sort -g | tail -n 1; }
secs() { sed -n 's/^trained [0-9]* steps in \([0-9.]*\) s.*/\1/p' "$tmp/$1"; }
best() { sort -g | head -n 1; }

: >"$tmp/t_un"; : >"$tmp/t_sh"
for r in $(seq "$rounds"); do
  run un 2 --partitions 1 --ddp --deterministic --microbatches 1
  secs un >>"$tmp/t_un"
  run sh 2 --partitions 1 --ddp --deterministic --microbatches 1 --shard-optimizer
  secs sh >>"$tmp/t_sh"
done
ou=$(peak un optimizer); os=$(peak sh optimizer)
tu=$(best <"$tmp/t_un"); ts=$(best <"$tmp/t_sh")
state=$(awk -v p="$(peak sh parameters)" -v g="$(peak sh gradients)" -v o="$os" 'BEGIN { printf "%.1f", (p + g + o) * 4 / p }')
echo "optimizer state MiB per rank: unsharded $ou, sharded $os (2 replicas)"
awk -v s="$os" -v u="$ou" 'BEGIN { printf "optimizer state bytes per rank sharded/unsharded: %.2f\n", s / u }'
awk -v s="$ts" -v u="$tu" 'BEGIN { printf "step time sharded/unsharded: %.2f (best of %d rounds, %s s and %s s)\n", s / u, '"$rounds"', s, u }'
echo "training state bytes per parameter per rank: $state (Megatron's formula, fp32 parameters, gradients and Adam state, d = 2: 8 + 8/d = 12.0)"
line="peak activation MiB per rank, GPipe over 2 partitions, $mb microbatches, active_microbatches 1..$mb:"
for c in $(seq "$mb"); do
  run cap$c 2 --partitions 2 --pipeline simple --microbatches "$mb" --config "{\"active_microbatches\": $c}"
  line="$line $(peak cap$c activations)"
done
run cap0 2 --partitions 2 --pipeline simple --microbatches "$mb"
echo "$line (uncapped: $(peak cap0 activations))"
