#!/usr/bin/env bash
# The GPU suite (test_gpu.cu) and the CUDA demo on test/fake_cuda.c's CPU
# stand-in for GPUs: smp_nccl.h's own logic - communicators, streams and
# events, the host-staged path, pipelines and DDP on device tensors - runs on
# every machine, GPU or not. It proves nothing about real GPUs or NCCL.
# The fake reports NCCL 2.28.0 and, like it, leaves the last elements of a
# large one-rank ncclAvg unwritten (test/fake_cuda.h): the 1-rank runs fail
# if smp_nccl.h stops asking for a sum there.
# usage: test/run_fake_cuda.sh [ignored build dir]; prints PASS/FAIL/SKIP lines.
set -u
bin=build/fake/test_gpu
if [ ! -x "$bin" ]; then echo "SKIP: fake-gpu: $bin not built (nvcc missing?)"; exit 0; fi
out=$(mktemp); trap 'rm -f "$out"' EXIT
status=0

# variant LABEL NP EXPECT ENV...: runs the suite, tags its lines with LABEL
variant() {
  local label=$1 np=$2; shift 2
  env SMP_TIMEOUT=120 "$@" timeout 600 mpirun -n "$np" "$bin" >"$out" 2>&1
  local rc=$?
  sed -n "s/^\(PASS\|FAIL\|SKIP\): /\1: [$label] /p" "$out"
  if [ $rc -ne 0 ] && ! grep -q '^FAIL: ' "$out"; then
    echo "FAIL: [$label] exited with status $rc; its last lines:"; tail -n 15 "$out" | sed 's/^/    /'
  fi
  [ $rc -eq 0 ] || status=1
}

# a GPU per rank: NCCL, then the same suite host-staged
for np in 1 2 4; do variant "$np ranks, $np GPUs" "$np" FAKE_CUDA_DEVICES="$np"; done
# two ranks on one GPU: host-staged, chosen by smp_init
variant "2 ranks, 1 GPU" 2 FAKE_CUDA_DEVICES=1
# smp's streams slow instead of the engine's: missing waits the other way round
variant "2 ranks, 2 GPUs, smp's streams slow" 2 FAKE_CUDA_DEVICES=2 FAKE_CUDA_SLOW=comm
# a GPU without memory pools: cudaMalloc/cudaFree instead of the stream-ordered calls
variant "2 ranks, 2 GPUs, no memory pools" 2 FAKE_CUDA_DEVICES=2 FAKE_CUDA_POOLS=0

# under AddressSanitizer + UBSan
asan=build/fake/test_gpu_asan
if [ -x "$asan" ]; then
  plain=$bin; bin=$asan
  # verify_asan_link_order=0: test/run.sh preloads its yield shim ahead of ASan's runtime
  variant "ASan+UBSan, 2 ranks, 2 GPUs" 2 FAKE_CUDA_DEVICES=2 ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  bin=$plain
else
  echo "FAIL: $asan is not built"; status=1
fi

# no GPU at all: the suite says so and counts nothing
FAKE_CUDA_DEVICES=0 timeout 120 mpirun -n 2 "$bin" >"$out" 2>&1
if [ $? -eq 0 ] && grep -qx 'SKIP: gpu: skipped: no GPU' "$out" && ! grep -q '^PASS' "$out"; then
  echo "PASS: fake-gpu without a GPU: test_gpu prints 'skipped: no GPU' and passes nothing"
else
  echo "FAIL: fake-gpu without a GPU: expected exactly 'SKIP: gpu: skipped: no GPU'; got:"; tail -n 5 "$out" | sed 's/^/    /'; status=1
fi

# SMP_NCCL=nccl on a shared GPU: smp_init fails on every rank, naming the problem
FAKE_CUDA_DEVICES=1 SMP_NCCL=nccl timeout 120 mpirun -n 2 "$bin" >"$out" 2>&1
n=$(grep -c "FAIL: fake-gpu init: rank [01]: .*drive the same GPU" "$out")
if [ "$n" -eq 2 ]; then
  echo "PASS: fake-gpu SMP_NCCL=nccl with 2 ranks on 1 GPU fails smp_init on both ranks, saying why"
else
  echo "FAIL: fake-gpu SMP_NCCL=nccl with 2 ranks on 1 GPU: expected smp_init to fail on both ranks; got:"; tail -n 5 "$out" | sed 's/^/    /'; status=1
fi
# the CUDA example: each printed value equals the one it expects
for v in "2 2" "4 4" "4 1"; do
  set -- $v # ranks, GPUs
  FAKE_CUDA_DEVICES=$2 timeout 120 mpirun -n "$1" build/fake/nccl_allreduce >"$out" 2>&1; rc=$?
  lines=$(grep -c '(expected' "$out")
  bad=$(grep '(expected' "$out" | awk '{ got = $(NF - 2); want = $NF; sub(/\)$/, "", want); if (got + 0 != want + 0) print }')
  if [ $rc -eq 0 ] && [ "$lines" -eq 3 ] && [ -z "$bad" ]; then
    echo "PASS: fake-gpu examples/nccl_allreduce.cu on $1 ranks, $2 GPU(s): all-reduce, pipeline and gradient as expected"
  else
    echo "FAIL: fake-gpu examples/nccl_allreduce.cu on $1 ranks, $2 GPU(s) (exit $rc):"; grep -v UCX "$out" | tail -n 6 | sed 's/^/    /'; status=1
  fi
done

# smp_nccl.h compiled as C (gcc and clang builds)
for b in build/fake/c_engine build/fake/c_engine.clang; do
  FAKE_CUDA_DEVICES=2 timeout 120 mpirun -n 2 "$b" >"$out" 2>&1; rc=$?
  grep -E '^(PASS|FAIL): ' "$out" | sed "s|^\(PASS\|FAIL\): |&[$(basename "$b")] |"
  if [ $rc -ne 0 ]; then echo "FAIL: $b exited with status $rc"; grep -v UCX "$out" | tail -n 5 | sed 's/^/    /'; status=1; fi
done

# bench/nccl: its timings mean nothing here, but its raw-NCCL pipeline must compute smp's step exactly
bench=build/fake/bench_nccl
FAKE_CUDA_DEVICES=2 timeout 120 mpirun -n 2 "$bench" --iters 1 --warmup 0 --mib 1 --batch 64 --microbatches 4 >"$out" 2>&1; rc=$?
check=$(grep '^check: ' "$out")
if [ $rc -eq 0 ] && echo "$check" | grep -q 'gradients differ by 0.0e+00' && echo "$check" | awk '{ exit !($4 ";" == $6) }' \
   && grep -q '^nccl smp/raw time ratio: ' "$out" && ! grep -q WARNING "$out"; then
  echo "PASS: fake-gpu bench/nccl runs, and its hand-written NCCL pipeline computes smp's step bit for bit ($check)"
else
  echo "FAIL: fake-gpu bench/nccl (exit $rc):"; grep -v UCX "$out" | tail -n 6 | sed 's/^/    /'; status=1
fi

# NCCL failing: an asynchronous error is reported, not waited out (SMP_TIMEOUT=60 would show as a FAIL on time)
faults=build/fake/fake_faults
for mode in async p2p; do
  start=$SECONDS
  FAKE_CUDA_DEVICES=2 SMP_TIMEOUT=60 timeout 120 mpirun -n 2 "$faults" $mode >"$out" 2>&1; rc=$?
  grep -E '^(PASS|FAIL): ' "$out"
  if [ $rc -ne 0 ] || [ $((SECONDS - start)) -ge 30 ]; then
    echo "FAIL: fake-gpu faults: $mode run exited $rc after $((SECONDS - start)) s; its last lines:"; tail -n 8 "$out" | sed 's/^/    /'; status=1
  fi
done
# a peer that never comes: the wait's deadline aborts the communicators and the job, naming what it waited for
for v in "timeout|waiting for smp's device work" "p2p-timeout|waiting for point-to-point receives (smp_nccl_synchronize) with world rank 1"; do
  mode=${v%%|*}; expect=${v#*|}
  start=$SECONDS
  FAKE_CUDA_DEVICES=2 SMP_TIMEOUT=3 timeout 120 mpirun -n 2 "$faults" $mode >"$out" 2>&1; rc=$?
  took=$((SECONDS - start))
  if [ $rc -ne 0 ] && [ $took -lt 30 ] && grep -qF "smp_nccl_synchronize: timed out after 3.0 s $expect" "$out" \
     && grep -q 'aborting the NCCL communicators and the job' "$out" && ! grep -q '^FAIL' "$out"; then
    echo "PASS: fake-gpu faults: $mode: a device wait past SMP_TIMEOUT aborts the NCCL communicators and the job, saying '$expect' (${took} s)"
  else
    echo "FAIL: fake-gpu faults: $mode run exited $rc after $took s, expected '$expect'; its last lines:"; tail -n 8 "$out" | sed 's/^/    /'; status=1
  fi
done
exit $status
