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
#     activation peak of a rank;
#   - offload_activations on the fake CUDA device (build/fake/fmnist, and
#     build/fake/gpt: gpt.cu): the largest activation peak of a rank with
#     and without --offload.
# Timings need a quiet machine; the byte figures do not.
bench=memory
# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh"
bin="$top/build/examples/gpt"
steps=${MEM_BENCH_STEPS:-10}
rounds=${MEM_BENCH_ROUNDS:-3}
mb=${MEM_BENCH_MB:-4}
need "$bin" "make build/examples/gpt"
common=(--steps "$steps" --log-every 1000000 --val-batches 0 --sample-len 0 --save "")

secs() { sed -n 's/^trained [0-9]* steps in \([0-9.]*\) s.*/\1/p' "$tmp/$1"; }

: >"$tmp/t_un"; : >"$tmp/t_sh"
for r in $(seq "$rounds"); do
  run un 2 --partitions 1 --ddp --deterministic --microbatches 1
  secs un >>"$tmp/t_un"
  run sh 2 --partitions 1 --ddp --deterministic --microbatches 1 --shard-optimizer
  secs sh >>"$tmp/t_sh"
done
ou=$(peak un optimizer); os=$(peak sh optimizer)
tu=$(least <"$tmp/t_un"); ts=$(least <"$tmp/t_sh")
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

# offload_activations on the fake CUDA device (test/fake_cuda.c): the CUDA Fashion-MNIST example, 2 partitions
# placed by hand (the same stages both runs), GPipe over 8 microbatches, with and without --offload at
# activation_loading_horizon 2: the largest activation peak of a rank from the memory account (the device bytes
# smp holds for backwards; parameters, gradients and optimizer state are the same in both runs).
fake="$top/build/fake/fmnist"
if [ ! -x "$fake" ]; then
  echo "offload peak device bytes with/without: not measured ($fake is missing: make build/fake/fmnist)"
else
  data=$tmp/fmnist
  # (the test of the copy's status comes after the here-document: a line after `<<'PY' ||` would be read as its first)
  if ! python3 - /usr/share/datasets/fashion-mnist "$data" <<'PY'
import gzip, os, struct, sys
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
for split, n in (("train", 2048), ("t10k", 1000)):
    im = gzip.open(f"{src}/{split}-images-idx3-ubyte.gz").read()
    lb = gzip.open(f"{src}/{split}-labels-idx1-ubyte.gz").read()
    with gzip.open(f"{dst}/{split}-images-idx3-ubyte.gz", "wb", compresslevel=1) as f:
        f.write(im[:4] + struct.pack(">III", n, 28, 28) + im[16:16 + n * 784])
    with gzip.open(f"{dst}/{split}-labels-idx1-ubyte.gz", "wb", compresslevel=1) as f:
        f.write(lb[:4] + struct.pack(">I", n) + lb[8:8 + n])
PY
  then echo "bench/memory: cannot copy Fashion-MNIST" >&2; exit 1; fi
  fm=(--data "$data" --batch 256 --epochs 1 --max-steps 3 --print-losses --checkpoint "$tmp/fm.ckpt" --manual
      --partitions 2 --pipeline simple --microbatches 8)
  fmrun() { launch "$1" env SMP_TIMEOUT=300 FAKE_CUDA_DEVICES=2 mpirun -n 2 "$fake" "${fm[@]}" "${@:2}"; } # NAME ARGS...
  fmrun fm_keep
  fmrun fm_off --offload --config '{"activation_loading_horizon": 2}'
  if ! cmp -s <(grep -E '^(step|test accuracy)' "$tmp/fm_keep") <(grep -E '^(step|test accuracy)' "$tmp/fm_off"); then
    echo "bench/memory: the losses with --offload differ from those without" >&2; exit 1
  fi
  echo "offload: activation peak MiB per rank (largest), CUDA Fashion-MNIST on the fake device, 2 partitions, GPipe," \
       "8 microbatches: without $(peak fm_keep activations), with $(peak fm_off activations) (horizon 2;" \
       "host copies at their peak $(peak fm_off offloaded)); losses bitwise equal"
  awk -v w="$(peak fm_off activations)" -v k="$(peak fm_keep activations)" \
    'BEGIN { printf "offload peak device bytes with/without: %.2f\n", w / k }'
fi
# The same for the CUDA GPT (examples/gpt.cu on the fake device): 2 partitions split by memory alone (the same
# stages both runs), GPipe over 8 microbatches, horizon 2.
fgpt="$top/build/fake/gpt"
if [ ! -x "$fgpt" ]; then
  echo "offload (CUDA GPT) peak device bytes with/without: not measured ($fgpt is missing: make build/fake/gpt)"
else
  g=(--layers 4 --dmodel 64 --heads 4 --context 64 --batch 16 --microbatches 8 --steps 3 --warmup 1 --print-losses
     --val-batches 0 --sample-len 0 --save "" --partitions 2 --pipeline simple)
  grun() { launch "$1" env SMP_TIMEOUT=300 FAKE_CUDA_DEVICES=2 mpirun -n 2 "$fgpt" "${g[@]}" "${@:2}"; } # NAME ARGS...
  grun g_keep --config '{"optimize": "memory"}'
  grun g_off --offload --config '{"optimize": "memory", "activation_loading_horizon": 2}'
  if ! cmp -s <(grep -a '^step [0-9]* loss' "$tmp/g_keep") <(grep -a '^step [0-9]* loss' "$tmp/g_off"); then
    echo "bench/memory: the GPT's losses with --offload differ from those without" >&2; exit 1
  fi
  awk -v w="$(peak g_off activations)" -v k="$(peak g_keep activations)" \
    'BEGIN { printf "offload (CUDA GPT) peak device bytes with/without: %.2f (activations %s/%s MiB)\n", w / k, w, k }'
fi
