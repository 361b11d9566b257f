#!/usr/bin/env bash
# bench/gpt: training and generation throughput of examples/gpt.c (default
# model: 6 blocks, width 192, 6 heads, context 128) on this machine, every
# configuration taking turns in one run:
#   training tokens/s
#     single       1 process, 1 BLAS thread, M microbatches
#     pp2 <kind>   2 processes = 2 pipeline partitions, 1 BLAS thread each,
#                  M microbatches, for each schedule: interleaved (1F1B),
#                  zero_bubble (ZB-H1), simple (GPipe), zero_bubble_v (ZB-V:
#                  2 stages per partition in a V), interleaved_2vs (1F1B over
#                  2 virtual stages per partition, placed round robin)
#     1p2t m=K     1 process, 2 BLAS threads, K microbatches for K in
#                  GPT_BENCH_BEST_MB: the best one process does on 2 cores
#     dp2          2 processes = 2 data-parallel replicas (--ddp), 1 thread each
#     pp2 eager    pp2 1F1B again with UCX_RNDV_THRESH=inf (MPICH over UCX: every
#                  message eager), a diagnostic: were a rendezvous send to
#                  move only when its sender next calls MPI (none is called
#                  while an operation computes), this row would beat 1F1B's
#                  (RESULTS.md, issue 28: on MPICH over UCX a contiguous one
#                  does not wait); not a candidate for the best schedule
#   generation characters/s, 4 prompts (one per microbatch), KV cache, greedy,
#     from a checkpoint the first pp2 run saves: 1 process against 2 stages
# Each run trains GPT_BENCH_STEPS steps; its rate is taken from the progress
# lines of step 1 and of the last step, so the first step (page faults,
# first-touch of the activation heap) is left out. The configurations take
# turns round after round, so load from other jobs falls on all of them
# alike; each figure is the BEST of the rounds (other jobs only ever slow a
# run down), the median printed beside it. The pp2 runs record SMP_TIMELINE;
# each schedule's best round's is kept in GPT_BENCH_OUT (default build/bench)
# for the per-step breakdown (bench/timeline_steps.py) and, where matplotlib is
# found, a plot of one step. The best schedule's timeline also gives its bound:
# each stage's median forward, backward and W time in that run, through the
# schedule simulator (build/bench/simulate), plus the time between steps.
# Last lines: gpt tokens/s pp2 of simulated bound (the best schedule's measured
# rate against that bound), gpt tokens/s pp2/best-single, then gpt tokens/s
# pp2/single (the best schedule).
bench=gpt
# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh"
bin="$top/build/examples/gpt"
steps=${GPT_BENCH_STEPS:-20}
rounds=${GPT_BENCH_ROUNDS:-3}
batch=${GPT_BENCH_BATCH:-8}
mb=${GPT_BENCH_MB:-8}
best_mbs=${GPT_BENCH_BEST_MB:-1 2 4}
ddp_mb=${GPT_BENCH_DDP_MB:-1}
gen_tokens=${GPT_BENCH_TOKENS:-120}
prompts="The |A |Why |I "
out=${GPT_BENCH_OUT:-$top/build/bench}
kinds="interleaved zero_bubble simple zero_bubble_v interleaved_2vs"
# pipeline_args KIND: gpt's options for a schedule of the table
pipeline_args() {
  case $1 in
    *_2vs) echo "--pipeline ${1%_2vs} --config {\"virtual_stages\":2}" ;;
    *) echo "--pipeline $1" ;;
  esac
}
mkdir -p "$out"
for b in "$bin" "$top/build/bench/simulate"; do need "$b" "make bench-gpt builds it"; done
start=$(date +%s)
ckpt="$out/gpt_bench.safetensors"
common=(--batch "$batch" --steps "$steps" --log-every 1000000 --val-batches 0 --sample-len 0)

# train NAME CMD...: runs CMD (a training run) and appends its tokens/s
# between the ends of step 1 and of the last step to $tmp/NAME. Each
# progress line gives tokens/s since the start, so step k ended at
# k * tokens_per_step / rate_k; tokens_per_step cancels out.
train() {
  local name=$1; shift
  "$@" "${common[@]}" > "$tmp/log" 2>&1 || failed log "$*"
  local r
  r=$(awk '/^step .* tokens\/s/ { split($2, a, "/"); for (i = 1; i <= NF; i++) if ($i == "tokens/s") r = $(i - 1)
            if (!n++) { k1 = a[1]; r1 = r } kN = a[1]; rN = r }
           END { if (kN > k1 && r1 > 0 && rN > 0) printf "%.0f\n", (kN - k1) / (kN / rN - k1 / r1) }' "$tmp/log")
  [ -n "$r" ] || failed log "$* (no progress lines)"
  echo "$r" >> "$tmp/$name"
}
# gen NAME NP PARTITIONS [THREADS]: pipelined generation from $ckpt; appends characters/s, keeps the text
gen() {
  local name=$1 np=$2 parts=$3 th=${4:-1}
  OPENBLAS_NUM_THREADS=$th mpirun -n "$np" "$bin" --generate --load "$ckpt" --partitions "$parts" --microbatches 4 \
    --prompts "$prompts" --tokens "$gen_tokens" --temperature 0 --threads "$th" > "$tmp/log" 2>&1 || failed log "generation ($name)"
  local r
  r=$(sed -n 's/^generated .* (\([0-9]*\) characters\/s)$/\1/p' "$tmp/log")
  [ -n "$r" ] || failed log "generation ($name): no rate"
  echo "$r" >> "$tmp/$name"
  sed -n '/^--- prompt/,$p' "$tmp/log" > "$tmp/$name.text"
}
# best NAME, middle NAME: the largest and the median of the rates appended to $tmp/NAME
best() { most <"$tmp/$1"; }
# shellcheck disable=SC2046 # a rate a line, a word each
middle() { median $(<"$tmp/$1"); }

for r in $(seq "$rounds"); do
  train single mpirun -n 1 "$bin" --partitions 1 --microbatches "$mb" --save ""
  for k in $kinds; do
    save=(--save "")
    [ "$r" = 1 ] && [ "$k" = interleaved ] && save=(--save "$ckpt") # the checkpoint generation loads
    # shellcheck disable=SC2046 # pipeline_args' words are options, one JSON word without spaces
    SMP_TIMELINE="$tmp/timeline_${k}_$r.json" train "pp2_$k" mpirun -n 2 "$bin" --partitions 2 --microbatches "$mb" \
      $(pipeline_args "$k") "${save[@]}"
  done
  for m in $best_mbs; do
    OPENBLAS_NUM_THREADS=2 train "t2_m$m" mpirun -n 1 "$bin" --partitions 1 --microbatches "$m" --threads 2 --save ""
  done
  train dp2 mpirun -n 2 "$bin" --partitions 1 --ddp --microbatches "$ddp_mb" --save ""
  UCX_RNDV_THRESH=inf train pp2_eager mpirun -n 2 "$bin" --partitions 2 --microbatches "$mb" --pipeline interleaved --save ""
  gen gen1 1 1
  gen gen2 2 2
  gen gen1t2 1 1 2
done

label() {
  case $1 in
    single) echo "1 process, 1 BLAS thread, $mb microbatches (single)" ;;
    pp2_interleaved) echo "2 pipeline partitions, 1F1B (interleaved), $mb mb" ;;
    pp2_zero_bubble) echo "2 pipeline partitions, zero_bubble (ZB-H1), $mb mb" ;;
    pp2_simple) echo "2 pipeline partitions, simple (GPipe), $mb mb" ;;
    pp2_zero_bubble_v) echo "2 pipeline partitions, zero_bubble_v (ZB-V), $mb mb" ;;
    pp2_interleaved_2vs) echo "2 partitions x 2 virtual stages, interleaved, $mb mb" ;;
    t2_m*) echo "1 process, 2 BLAS threads, ${1#t2_m} microbatches" ;;
    dp2) echo "2 data-parallel replicas (--ddp), $ddp_mb microbatch each" ;;
    pp2_eager) echo "(pp2 1F1B, all sends eager: UCX_RNDV_THRESH=inf)" ;;
  esac
}
printf 'gpt training tokens/s: 6 blocks x 192, context 128, batch %d sequences; %d steps a run, rate over steps 2-%d\n' "$batch" "$steps" "$steps"
printf '%-56s %8s %8s   %s\n' "configuration (best and median of $rounds rounds)" best median "all rounds"
names="single $(for k in $kinds; do printf 'pp2_%s ' "$k"; done)$(for m in $best_mbs; do printf 't2_m%s ' "$m"; done)dp2 pp2_eager"
for n in $names; do
  printf '%-56s %8s %8s   %s\n' "$(label "$n")" "$(best "$n")" "$(middle "$n")" "$(tr '\n' ' ' < "$tmp/$n")"
done

# each schedule's timeline from its best round (the one the table quotes)
for k in $kinds; do
  r=$(awk '{ if (NR == 1 || $1 > b) { b = $1; n = NR } } END { print n }' "$tmp/pp2_$k")
  cp "$tmp/timeline_${k}_$r.json" "$out/gpt_timeline_$k.json"
done
# one step of each schedule, from those timelines: medians over steps 3 to the
# second last and, per rank, compute and waits
for k in $kinds; do
  python3 "$top/bench/timeline_steps.py" --skip 2 --summary "$k" "$out/gpt_timeline_$k.json"
done

g1=$(best gen1); g2=$(best gen2); g1t2=$(best gen1t2)
printf 'gpt generation characters/s: 4 prompts x %d characters, KV cache, greedy (best and median of %d rounds)\n' "$gen_tokens" "$rounds"
printf '%-56s %8s %8s   %s\n' "1 process, 1 BLAS thread" "$g1" "$(middle gen1)" "$(tr '\n' ' ' < "$tmp/gen1")" \
  "2 pipeline stages, 4 prompts in flight" "$g2" "$(middle gen2)" "$(tr '\n' ' ' < "$tmp/gen2")" \
  "1 process, 2 BLAS threads" "$g1t2" "$(middle gen1t2)" "$(tr '\n' ' ' < "$tmp/gen1t2")"
if cmp -s "$tmp/gen1.text" "$tmp/gen2.text" && cmp -s "$tmp/gen1.text" "$tmp/gen1t2.text"; then same=yes; else same=NO; fi
echo "generated text equal for 1 process and 2 stages: $same"

# the best pipeline schedule, the best single-process configuration on 2 cores
bestk=$(for k in $kinds; do echo "$(best "pp2_$k") $k"; done | sort -n | tail -n1 | cut -d' ' -f2)
bestm=$(for m in $best_mbs; do echo "$(best "t2_m$m") $m"; done | sort -n | tail -n1 | cut -d' ' -f2)
plot=""
for py in python3 /usr/bin/python3; do
  if "$py" -c 'import matplotlib' 2>/dev/null; then
    "$py" "$top/bench/plot_timeline.py" "$out/gpt_timeline_$bestk.json" "$out/gpt_timeline_$bestk.png" \
      --step $((steps / 2)) --title "gpt, 2 partitions, $bestk, $mb microbatches: one training step" > /dev/null && plot="$out/gpt_timeline_$bestk.png"
    break
  fi
done
echo "timelines: $out/gpt_timeline_{$(echo $kinds | tr ' ' ',')}.json${plot:+, one step of $bestk drawn in $plot}"
echo "elapsed: $(($(date +%s) - start)) s"
# the best schedule against its own bound: its timeline's per-stage times through the simulator
bound=$(python3 "$top/bench/timeline_steps.py" --skip 2 --bound "${bestk%_2vs}" "$top/build/bench/simulate" \
  "$(best "pp2_$bestk")" $((batch * 128)) "$out/gpt_timeline_$bestk.json")
echo "$bound" | sed '$d'
of=$(echo "$bound" | sed -n '$s/^of simulated bound: //p')
echo "gpt tokens/s pp2 of simulated bound: ${of:-none} ($bestk${of:+, measured/(simulated + outside the schedule)})"
python3 - "$(best single)" "$(best "t2_m$bestm")" "$bestm" "$(best dp2)" "$g1" "$g2" "$(best pp2_eager)" "$bestk" \
  $(for k in $kinds; do echo "$k $(best "pp2_$k")"; done) <<'PY'
import sys
single, best1, bestm, dp2, g1, g2, eager = (float(v) for v in sys.argv[1:8])
bestk, rest = sys.argv[8], sys.argv[9:]
pp = {rest[i]: float(rest[i + 1]) for i in range(0, len(rest), 2)}
print("pp2/single per schedule: " + ", ".join(f"{k} {v / single:.2f}" for k, v in pp.items()) + f" (1F1B with eager sends {eager / single:.2f})")
print(f"best single process on 2 cores: 2 BLAS threads, {bestm:.0f} microbatches, {best1:.0f} tokens/s")
print(f"against it: pp2 ({bestk}) {pp[bestk] / best1:.2f}, dp2 {dp2 / best1:.2f}; 2 threads/1 thread in one process {best1 / single:.2f}")
print(f"gpt generation chars/s 2 stages/1 process: {g2 / g1:.2f}")
print(f"gpt tokens/s pp2/best-single: {pp[bestk] / best1:.2f}")
print(f"gpt tokens/s pp2/single: {pp[bestk] / single:.2f}")
PY
