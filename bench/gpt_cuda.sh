#!/usr/bin/env bash
# gpt.cu's training step through smp against the same kernels in a plain
# loop (gpt.cu --plain: gpt_cuda.h's layer functions called in order, no
# smp_step), one rank, one partition, the same model, batch and
# microbatches. Runs alternate (smp, plain, smp, ...) so drift hits both;
# each run's figure is gpt.cu's "throughput:" line (tokens/s over the steps
# after the first two), the result the ratio of the medians' times:
#   gpt.cu overhead smp/plain (fake device): X.XX
# (1.00: smp costs nothing; above: smp's step is slower). On the fake
# device (build/fake/gpt, the default) the kernels are host loops and
# every stream operation waits FAKE_CUDA_DELAY_US, so the figure says how
# smp's host work compares with a loop's on that device, nothing about a
# GPU; BIN=build/cuda/gpt on a GPU gives the GPU's figure. Timings on a
# loaded machine are noise.
# usage: bench/gpt_cuda.sh [runs per side (default 5)] [gpt.cu flags...]
bench=gpt_cuda
# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh"
bin=${BIN:-$top/build/fake/gpt}
runs=${1:-5}
shift $(($# > 0 ? 1 : 0))
need "$bin" "make cuda"
case "$bin" in *fake*) where="fake device";; *) where="GPU";; esac
model="--layers 2 --dmodel 64 --heads 4 --context 32 --batch 8 --microbatches 4 --steps 12 --warmup 2 --val-batches 0
       --sample-len 0 --log-every 1000 --partitions 1 --save"
declare -a smp plain
for ((i = 0; i < runs; i++)); do
  for side in smp plain; do
    flag=$([ $side = plain ] && echo --plain)
    r=$(SMP_TIMEOUT=120 timeout 300 mpirun -n 1 "$bin" $model "" $flag "$@" 2>&1 | sed -n 's/^throughput: \([0-9]*\) tokens\/s.*/\1/p')
    [ -n "$r" ] || { echo "bench/gpt_cuda.sh: the $side run printed no throughput"; exit 1; }
    eval "$side+=($r)"
  done
done
ms=$(median "${smp[@]}") mp=$(median "${plain[@]}")
echo "tokens/s: smp ${smp[*]} (median $ms); plain ${plain[*]} (median $mp)"
awk -v s="$ms" -v p="$mp" -v w="$where" 'BEGIN {printf "gpt.cu overhead smp/plain (%s): %.2f\n", w, p / s}'
