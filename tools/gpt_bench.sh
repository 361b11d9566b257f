#!/usr/bin/env bash
# gpt.cu at GPT-2 124M's shape (12 layers, width 768, 12 heads, context 1024,
# the byte-level vocabulary padded to a multiple of 128) in bf16: one rank
# with the whole model, then 2 ranks sharing the GPU as 2 pipeline stages
# (smp moves activations through host memory). Prints each run's
# throughput line (tokens/s, model FLOPs per token, MFU against the GPU's
# dense bf16 peak, which gpt.cu reads from the device name). Then
# generation: one training step saves a checkpoint of that shape (the
# padded vocabulary: --generate draws only the corpus's ids), which
# gpt.cu --generate continues, 4 prompts (one per microbatch) by
# GPT_BENCH_TOKENS characters each (default 256) with the KV cache on the
# device, one rank, bf16. Ends with
#   gpt.cu 124M bf16 tokens/s: N (1 rank), M (2 ranks, one GPU)
#   gpt.cu 124M bf16 MFU: X.XX (1 rank)
#   gpt.cu 124M bf16 generation tokens/s: G (1 rank, 4 prompts x K characters, KV cache)
# tools/device_run.sh runs it on a lent GPU; test/test_fake_gpt.sh runs the
# same script on the fake device with flags after DATA that shrink the model
# (later flags win), so neither the program nor this way of calling it rots.
# usage: tools/gpt_bench.sh GPT_BINARY CORPUS_DIR [gpt.cu flags...]
set -u
bin=$1 data=$2
shift 2
shape="--bf16 --layers 12 --dmodel 768 --heads 12 --context 1024 --vocab-multiple 128 --batch 8 --steps 12 --warmup 2
       --val-batches 0 --sample-len 0 --log-every 4 --data $data"
status=0
declare -A rate mfu
for np in 1 2; do
  echo "== gpt.cu 124M bf16, $np rank(s) on one GPU"
  out=$(timeout 300 mpirun -n "$np" "$bin" $shape --partitions "$np" --microbatches $((np == 1 ? 1 : 4)) --save "" "$@" 2>&1)
  rc=$?
  echo "$out"
  line=$(echo "$out" | grep '^throughput: ')
  if [ $rc -ne 0 ] || [ -z "$line" ]; then echo "gpt_bench: the $np-rank run failed (exit $rc)"; status=1; continue; fi
  rate[$np]=$(echo "$line" | awk '{print $2}')
  mfu[$np]=$(echo "$line" | sed -n 's/.*MFU \([0-9.]*\) .*/\1/p')
done

tokens=${GPT_BENCH_TOKENS:-256}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== gpt.cu 124M bf16 generation, 1 rank: 4 prompts x $tokens characters with the KV cache"
gen=failed
out=$(timeout 300 mpirun -n 1 "$bin" $shape --partitions 1 --microbatches 1 "$@" --steps 1 --batch 1 \
        --save "$tmp/gen.safetensors" 2>&1 &&
      timeout 300 mpirun -n 1 "$bin" --generate --load "$tmp/gen.safetensors" --bf16 --partitions 1 --prompts "The |A |Why |I " \
        --tokens "$tokens" --temperature 0 2>&1)
rc=$?
echo "$out" | grep -a -v '^--- prompt\|^step '
line=$(echo "$out" | grep -a '^generated ')
if [ $rc -eq 0 ] && [ -n "$line" ]; then gen=$(echo "$line" | sed -n 's/.*(\([0-9]*\) characters\/s)$/\1/p')
else echo "gpt_bench: the generation run failed (exit $rc)"; status=1; fi
echo "gpt.cu 124M bf16 tokens/s: ${rate[1]:-failed} (1 rank), ${rate[2]:-failed} (2 ranks, one GPU)"
echo "gpt.cu 124M bf16 MFU: ${mfu[1]:-n/a} (1 rank)"
echo "gpt.cu 124M bf16 generation tokens/s: ${gen:-failed} (1 rank, 4 prompts x $tokens characters, KV cache)"
exit $status
