#!/usr/bin/env bash
# bench/tp: tensor parallelism in the GPT example (examples/gpt.c --tp 2)
# against one process, at the same batch on the same 2 cores. The model is
# wide enough (width TP_BENCH_WIDTH, default 384; 4 x 384 = 1536 in the
# MLP) that a block's GEMMs dominate its step. Each of the 2 TP ranks runs
# one OpenBLAS thread; one process runs with 1 (one core: the issue's
# figure, whose limit is 2.00) and with 2 (the best it does on 2 cores: its
# second BLAS thread already takes most of what a second core gives, so
# this ratio's limit is 2 x one core's rate over it, about 1.26 here). The
# runs take turns for TP_BENCH_ROUNDS rounds; the best round of each
# counts. Prints, one per line:
#   gpt tokens/s tp2/single: X.XX          (one process on one core; the limit is 2.00)
#   gpt tokens/s tp2/single with 2 BLAS threads: X.XX
#   gpt parameter bytes per rank tp2/single: X.XX   (the memory account's parameters: the
#                                            sharded matrices halve, layer norms, wpe and the
#                                            row-parallel biases stay whole)
#   gpt share of the tp2 step in TP collectives: X.XX   (smp_tp_seconds over the training
#                                            time on rank 0, waits for the other rank included)
# Timings need a quiet machine; the byte figures do not.
bench=tp
# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh"
bin="$top/build/examples/gpt"
steps=${TP_BENCH_STEPS:-10}
rounds=${TP_BENCH_ROUNDS:-3}
width=${TP_BENCH_WIDTH:-384}
need "$bin" "make build/examples/gpt"
common=(--partitions 1 --layers 2 --dmodel "$width" --heads 6 --context 128 --batch 8 --microbatches 2 --steps "$steps"
        --log-every 1000000 --val-batches 0 --sample-len 0 --save "")

rate() { sed -n 's/^trained [0-9]* steps in [0-9.]* s (\([0-9]*\) tokens\/s)$/\1/p' "$tmp/$1"; }

: >"$tmp/r_one"; : >"$tmp/r_one1"; : >"$tmp/r_tp"; : >"$tmp/share"
for r in $(seq "$rounds"); do
  run one1 1 --threads 1
  rate one1 >>"$tmp/r_one1"
  run one 1 --threads 2
  rate one >>"$tmp/r_one"
  run tp 2 --tp 2 --threads 1
  rate tp >>"$tmp/r_tp"
  sed -n 's/^tensor-parallel collectives: \([0-9.]*\) s of the \([0-9.]*\) s .*/\1 \2/p' "$tmp/tp" >>"$tmp/share"
done
one=$(most <"$tmp/r_one"); one1=$(most <"$tmp/r_one1"); tp=$(most <"$tmp/r_tp")
echo "gpt (2 layers, width $width, 6 heads, context 128, batch 8 in 2 microbatches, $steps steps," \
     "best of $rounds rounds): one process $one1 tokens/s (1 BLAS thread), $one (2 BLAS threads), tp 2 $tp tokens/s"
awk -v a="$tp" -v b="$one1" 'BEGIN { printf "gpt tokens/s tp2/single: %.2f\n", a / b }'
awk -v a="$tp" -v b="$one" 'BEGIN { printf "gpt tokens/s tp2/single with 2 BLAS threads: %.2f\n", a / b }'
awk -v a="$(peak tp parameters)" -v b="$(peak one parameters)" 'BEGIN { printf "gpt parameter bytes per rank tp2/single: %.2f\n", a / b }'
# the share in the round tp 2 ran fastest (its training time is the smallest)
sort -g -k2 "$tmp/share" | head -n 1 | awk '{ printf "gpt share of the tp2 step in TP collectives: %.2f\n", $1 / $2 }'
