#!/usr/bin/env bash
# Runs on a device machine, over what tools/device_pack.sh packed: the GPU
# suite at 1, 2 and 4 ranks (make test-gpu without rebuilding: NCCL with one
# rank, the host-staged path with 2 and 4 ranks on one GPU), the CUDA demo
# (one rank; then 2 partitions on one GPU, which moves activations through
# the host), bench/nccl, and the GPT on CUDA at GPT-2 124M's shape in bf16
# (tools/gpt_bench.sh: 1 rank, then 2 ranks sharing the GPU; tokens/s and
# MFU; then generation with the KV cache on the device, tokens/s;
# bench/gpt_cuda.sh: smp against the plain loop). Everything it prints also goes to $OUT/device.log
# when OUT is set (the device tool sets it).
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
[ -f .device/pack.tar.xz ] || { echo "device_run: .device/pack.tar.xz is missing: run tools/device_pack.sh first and carry .device"; exit 2; }
d=/tmp/smp_device
rm -rf "$d" && mkdir -p "$d" && tar -C "$d" -xJf .device/pack.tar.xz || exit 2
log=${OUT:+$OUT/device.log}
exec > >(tee ${log:+"$log"}) 2>&1
lib_on_machine() { find / \( -path /proc -o -path /sys -o -path /tmp \) -prune -o -name "$1" -print 2>/dev/null | head -n 1; }
nccl=$(lib_on_machine libnccl.so.2)
cublas=$(lib_on_machine libcublas.so.13)
export PATH=$d/bin:$PATH
export LD_LIBRARY_PATH=$d/lib${nccl:+:$(dirname "$nccl")}${cublas:+:$(dirname "$cublas")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$d/lib/ucx
echo "== $(nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'); NCCL: ${nccl:-not found}; cuBLAS: ${cublas:-not found}"
ldd "$d"/build/* "$d"/bin/* | grep 'not found' && echo "device_run: a library is missing (above)"
status=0
echo "== GPU suite (test-gpu)"
test/run.sh "$d/build" "" "test_gpu" "" "1 2 4" || status=1
echo "== CUDA demo, 1 rank"
timeout 300 mpirun -n 1 "$d/build/fmnist" --data "$d/fashion-mnist" --partitions 1 --epochs 2 --checkpoint /tmp/fmnist_cuda || status=1
echo "== CUDA demo, 2 partitions on one GPU"
timeout 300 mpirun -n 2 "$d/build/fmnist" --data "$d/fashion-mnist" --partitions 2 --epochs 1 --checkpoint /tmp/fmnist_cuda2 || status=1
echo "== bench/nccl"
timeout 300 mpirun -n 1 "$d/build/nccl" || status=1
echo "== gpt.cu at GPT-2 124M's shape, bf16"
bash tools/gpt_bench.sh "$d/build/gpt" "$d/fortunes" || status=1
echo "== gpt.cu through smp against the same kernels in a plain loop, GPT-2 124M's shape, bf16, 1 rank"
BIN="$d/build/gpt" bash bench/gpt_cuda.sh 3 --data "$d/fortunes" --bf16 --layers 12 --dmodel 768 --heads 12 --context 1024 \
  --vocab-multiple 128 --batch 8 --microbatches 2 || status=1
exit $status
