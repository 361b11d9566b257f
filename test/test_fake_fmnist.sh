#!/usr/bin/env bash
# The CUDA demo (examples/fmnist.cu) on test/fake_cuda.c's CPU device, built
# as build/fake/fmnist from test/fake_fmnist.cu (the program unchanged, host
# twins of its kernels after it). test_demo.sh's comparisons, on the GPU code:
#  - the loss of every step of a 2-partition run over NCCL equals the
#    one-process run bit for bit, and so does a run of 2 ranks sharing one
#    GPU (smp's host-staged path), and one on GPUs without memory pools
#    (smp keeps freed blocks for reuse instead of cudaFree);
#  - 2 partitions with their activations offloaded to host memory until
#    their backward (--offload) equal the one-process run bit for bit;
#  - 2 partitions x 2 replicas (deterministic reduction) equal 2 replicas in
#    one stage bit for bit, and so do they with NCCL's bucketed all-reduce
#    (two replicas' sum is the same bits in either order) and NCCL slowed
#    instead of the kernels (FAKE_CUDA_SLOW=comm: a missing wait between
#    smp's streams and the engine's shows whichever side runs late);
#  - 2x2 equal the one-process run with the same global batch and
#    microbatch size: step 0 bitwise, steps 1-4 within a relative 1e-5 (see
#    test_demo.sh for why not later steps);
#  - --shard-optimizer (each replica keeps Adam's moments for its owned
#    range only): 2 replicas, 1 and 2 partitions, equal the unsharded run
#    bit for bit, and every rank's optimizer-state peak in the memory
#    account ("memory peak rank R: ...") is about half the unsharded one;
#  - the loss falls and the test accuracy beats chance: training trains.
# Bitwise comparisons include the test accuracy the runs print.
#
# The fake's sgemm is a plain triple loop, so the runs are short: batch 32,
# 10 steps, on 10000 training images, and an evaluation batch of 1000 test
# images (fmnist.cu evaluates in batches of 1000: fewer images skip it).
# usage: test/test_fake_fmnist.sh [BUILD_DIR] (ignored: the binary is build/fake/fmnist)
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
bin="$top/build/fake/fmnist"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0
pass() { echo "PASS: $1"; }
fail() { echo "FAIL: $1"; failed=1; }
[ -x "$bin" ] || { echo "FAIL: fake-fmnist/binary: $bin is not built (test/fake_fmnist.cu with test/fake_cuda.o, nvcc -cudart none)"; exit 1; }

# a small copy of the data set: the first 10000 training and 1000 test images
if ! python3 - /usr/share/datasets/fashion-mnist "$tmp/data" <<'PY'
import gzip, os, struct, sys
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
for split, n in (("train", 10000), ("t10k", 1000)):
    im = gzip.open(f"{src}/{split}-images-idx3-ubyte.gz").read()
    lb = gzip.open(f"{src}/{split}-labels-idx1-ubyte.gz").read()
    assert struct.unpack(">I", im[4:8])[0] >= n and struct.unpack(">I", lb[4:8])[0] >= n
    with gzip.open(f"{dst}/{split}-images-idx3-ubyte.gz", "wb", compresslevel=1) as f:
        f.write(im[:4] + struct.pack(">III", n, 28, 28) + im[16:16 + n * 784])
    with gzip.open(f"{dst}/{split}-labels-idx1-ubyte.gz", "wb", compresslevel=1) as f:
        f.write(lb[:4] + struct.pack(">I", n) + lb[8:8 + n])
PY
then echo "FAIL: fake-fmnist/data: cannot make a small copy of /usr/share/datasets/fashion-mnist"; exit 1; fi

nsteps=10
steps="--data $tmp/data --batch 32 --epochs 1 --max-steps $nsteps --print-losses"
# name, fake GPUs per node, ranks, options...: $tmp/NAME holds the step lines, NAME.acc the accuracy
run() {
  local out=$1 gpus=$2 np=$3; shift 3
  SMP_TIMEOUT=120 FAKE_CUDA_DEVICES=$gpus timeout 300 mpirun -n "$np" "${prog:-$bin}" $steps --checkpoint "$tmp/$out.ckpt" "$@" >"$tmp/$out.log" 2>"$tmp/$out.err"
  echo $? >"$tmp/$out.rc"
  grep '^step' "$tmp/$out.log" >"$tmp/$out"
  grep '^test accuracy' "$tmp/$out.log" >"$tmp/$out.acc"
}
# a run finished, printed every step and the accuracy, and (if given) ran on the path its header names
complete() { # name [pattern the header must hold]
  [ "$(cat "$tmp/$1.rc")" = 0 ] && [ "$(wc -l <"$tmp/$1")" -eq $nsteps ] && [ -s "$tmp/$1.acc" ] &&
    { [ $# -lt 2 ] || head -n 1 "$tmp/$1.log" | grep -q -- "$2"; }
}
why() { # name: what the run left
  echo "exit $(cat "$tmp/$1.rc"); $(head -n 1 "$tmp/$1.log" | cut -c 1-160); $(head -c 300 "$tmp/$1.err" | tr '\n' ' ')"
}
first_diff() { # run a, run b, side (< or >): the first line of a side of the difference, steps then accuracy
  cat "$tmp/$1" "$tmp/$1.acc" >"$tmp/$1.all"; cat "$tmp/$2" "$tmp/$2.acc" >"$tmp/$2.all"
  diff "$tmp/$1.all" "$tmp/$2.all" | grep -m 1 "^$3" | cut -c 3-
}
same() { # check, run a, run b [pattern b's header must hold]
  if ! complete "$2"; then fail "$1: $2 did not complete: $(why "$2")"
  elif ! complete "$3" "${4:-}"; then fail "$1: $3 did not complete${4:+ on the path '$4'}: $(why "$3")"
  elif cmp -s "$tmp/$2" "$tmp/$3" && cmp -s "$tmp/$2.acc" "$tmp/$3.acc"; then pass "$1"
  else fail "$1: first difference: $2: $(first_diff "$2" "$3" '<') / $3: $(first_diff "$2" "$3" '>')"; fi
}
# the memory account's peaks of run b against run a's (test/memory_peaks.py)
peaks() { # check, run a, run b, category, low, high
  if msg=$(python3 "$top/test/memory_peaks.py" "$tmp/$2.log" "$tmp/$3.log" "$4" "$5" "$6" 2>&1); then pass "$1: $msg"
  else fail "$1: $(echo "$msg" | tail -n 1)"; fi
}

start=$SECONDS
run one 1 1 --partitions 1 --microbatches 4
run pp2 2 2 --partitions 2 --microbatches 4
same "fake-fmnist/2 partitions on 2 fake GPUs (NCCL) equal one process, every step and the accuracy bitwise" one pp2 "(CUDA, nccl:"
FAKE_CUDA_POOLS=0 run nopools 2 2 --partitions 2 --microbatches 4
same "fake-fmnist/2 partitions on fake GPUs without memory pools (cudaMalloc, smp's cache of freed blocks) equal one process bitwise" one nopools "(CUDA, nccl:"
run zb 2 2 --partitions 2 --microbatches 4 --pipeline zero_bubble
same "fake-fmnist/2 partitions, zero-bubble pipeline (split linear backward on the device), equal one process bitwise" one zb "(CUDA, nccl:"
run zbv 2 2 --partitions 2 --microbatches 4 --pipeline zero_bubble_v
same "fake-fmnist/2 partitions, zero_bubble_v pipeline (4 stages in a V, the middle hand-off in device memory), equal one process bitwise" one zbv "(CUDA, nccl:"
run offload 2 2 --partitions 2 --microbatches 4 --pipeline simple --offload --config '{"activation_loading_horizon": 1}'
same "fake-fmnist/2 partitions, GPipe, activations offloaded to host memory (horizon 1), equal one process bitwise" \
  one offload "(CUDA, nccl:"
acct=$(grep '^memory peak rank 0' "$tmp/offload.log")
if ! echo "$acct" | grep -q 'offloaded 0\.[0-9]*[1-9]'; then
  fail "fake-fmnist/--offload: the memory account shows no offloaded bytes on rank 0: $acct"
else pass "fake-fmnist/--offload: the account counts the host copies ($(echo "$acct" | grep -o 'offloaded [0-9.]* MiB'))"; fi
run shared 1 2 --partitions 2 --microbatches 4
same "fake-fmnist/2 partitions sharing one fake GPU (host-staged) equal one process bitwise" one shared "host-staged: ranks share GPUs"

run dp_pp 4 4 --partitions 2 --ddp --deterministic --microbatches 4
run dp_one 2 2 --partitions 1 --ddp --deterministic --microbatches 4
same "fake-fmnist/2 partitions x 2 replicas equal 2 replicas in one stage bitwise (deterministic)" dp_one dp_pp "(CUDA, nccl:"
# NCCL's bucketed all-reduce instead of the all-gather, and NCCL slowed instead of the kernels: a + b is b + a, so 2 replicas still match bitwise
FAKE_CUDA_SLOW=comm run dp_slow 4 4 --partitions 2 --ddp --microbatches 4
same "fake-fmnist/2x2 with NCCL's all-reduce (not deterministic) and NCCL slowed instead of the kernels (FAKE_CUDA_SLOW=comm) equal 2 replicas in one stage bitwise" dp_one dp_slow "(CUDA, nccl:"

# --shard-optimizer (ZeRO-1 on the device): Adam's moments for each replica's owned range only (the checkpoint of
# every epoch saves the sharded state); bitwise the unsharded run, and about half the optimizer state per rank in the
# memory account's peaks ("memory peak rank R")
run dp_one_sh 2 2 --partitions 1 --ddp --deterministic --microbatches 4 --shard-optimizer
run dp_pp_sh 4 4 --partitions 2 --ddp --deterministic --microbatches 4 --shard-optimizer
same "fake-fmnist/--shard-optimizer: 2 replicas (1 stage) equal the unsharded run bitwise (deterministic)" \
  dp_one dp_one_sh "(CUDA, nccl:"
same "fake-fmnist/--shard-optimizer: 2 partitions x 2 replicas equal the unsharded run bitwise (deterministic)" \
  dp_one dp_pp_sh "(CUDA, nccl:"
peaks "fake-fmnist/--shard-optimizer: optimizer-state peak per parameter byte 0.45..0.55 of unsharded (2 replicas, 1 stage)" \
  dp_one dp_one_sh optimizer/parameters 0.45 0.55
peaks "fake-fmnist/--shard-optimizer: optimizer-state peak per parameter byte 0.45..0.55 of unsharded (2 stages x 2 replicas)" \
  dp_pp dp_pp_sh optimizer/parameters 0.45 0.55

run one8 1 1 --partitions 1 --microbatches 8
name="fake-fmnist/2x2 replicas equal one process with the same global batch (step 0 bitwise, steps 1-4 within 1e-5)"
if ! complete dp_pp; then fail "$name: dp_pp did not complete: $(why dp_pp)"
elif ! complete one8; then fail "$name: one8 did not complete: $(why one8)"
elif msg=$(python3 - "$tmp/dp_pp" "$tmp/one8" 2>&1 <<'PY'
import sys
a = [float.fromhex(l.split()[3]) for l in open(sys.argv[1])]
b = [float.fromhex(l.split()[3]) for l in open(sys.argv[2])]
assert a[0] == b[0], ("first step", a[0], b[0])
worst = max(abs(x - y) / abs(y) for x, y in zip(a[:5], b[:5]))
assert worst < 1e-5, ("worst relative difference in steps 1-4", worst)
PY
); then pass "$name"
else fail "$name: $(echo "$msg" | tail -n 1)"; fi

name="fake-fmnist/the loss falls (mean of the last 3 steps below 0.7 x the first 3's and below ln 10) and the accuracy beats 0.3"
if ! complete one; then fail "$name: one did not complete: $(why one)"
elif msg=$(python3 - "$tmp/one" "$tmp/one.acc" 2>&1 <<'PY'
import math, sys
a = [float.fromhex(l.split()[3]) for l in open(sys.argv[1])]
acc = float(open(sys.argv[2]).read().split()[-1])
first, last = sum(a[:3]) / 3, sum(a[-3:]) / 3
assert all(math.isfinite(x) for x in a), ("not finite", a)
assert last < 0.7 * first and last < math.log(10), ("first 3 average %.4f, last 3 %.4f" % (first, last))
assert acc > 0.3, ("test accuracy", acc)
print("first 3 average %.4f, last 3 %.4f, accuracy %.4f" % (first, last, acc))
PY
); then pass "$name: $msg"
else fail "$name: $(echo "$msg" | tail -n 1)"; fi

# The twins and the fake's sgemm against the CPU demo's engine (OpenBLAS):
# the same weights and batches, arithmetic that differs only in rounding
# (sgemm's summation order), so the first steps agree closely; a twin that
# does not do its kernel's arithmetic does not. Measured: steps 0-2 within
# 2.2e-6 of each other; with the loss gradient 4x too large (which Adam all
# but hides: it divides by the gradient's own scale) 4.5e-5. Later steps
# drift apart as in test_demo.sh.
cpu="$top/build/examples/fmnist"
name="fake-fmnist/the fake GPU run agrees with the CPU demo (examples/fmnist.c): steps 0-2 within a relative 1e-5"
if [ ! -x "$cpu" ]; then echo "SKIP: $name: $cpu is not built (make examples)"
else
  OPENBLAS_NUM_THREADS=1 prog=$cpu run cpu 1 1 --partitions 1 --microbatches 4
  if ! complete one; then fail "$name: one did not complete: $(why one)"
  elif ! complete cpu; then fail "$name: the CPU demo did not complete: $(why cpu)"
  elif msg=$(python3 - "$tmp/one" "$tmp/cpu" 2>&1 <<'PY'
import sys
a = [float.fromhex(l.split()[3]) for l in open(sys.argv[1])]
b = [float.fromhex(l.split()[3]) for l in open(sys.argv[2])]
worst = max(abs(x - y) / abs(y) for x, y in zip(a[:3], b[:3]))
assert worst < 1e-5, ("worst relative difference in steps 0-2", worst, a[:3], b[:3])
print("worst %.1e" % worst)
PY
  ); then pass "$name: $msg"
  else fail "$name: $(echo "$msg" | tail -n 1)"; fi
fi

echo "fake-fmnist: the runs took $((SECONDS - start)) s"
exit $failed
