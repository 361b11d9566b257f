#!/usr/bin/env bash
# The demo (examples/fmnist.c) against itself in one process: the loss of
# every step of a pipeline run equals the one-process run bit for bit; a
# data-parallel run equals the same replicas without the pipeline bit for bit
# (deterministic reduction) and the one-process run with the same global
# batch and microbatch size: the first step bitwise (losses are summed
# exactly in double), the next four within a relative 1e-5. Later steps are
# not compared: the replicas' gradient sum rounds differently (test_ddp
# bounds that per step) and Adam amplifies such differences on near-zero
# gradients, so they grow chaotically. --shard-optimizer equals the
# unsharded run bitwise and halves each rank's optimizer-state peak in the
# memory account the demo prints. Bad input gives clear errors.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
ex=${SMP_EXAMPLES:-$top/build/examples} # SMP_EXAMPLES: another build of the examples (make test: build/examples-asan)
bin="$ex/fmnist"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[ -x "$bin" ] || { echo "FAIL: demo/binary: $bin is not built (make examples)"; exit 1; }
steps="--epochs 1 --max-steps 40 --print-losses"
run() { # out, np, args...: the step lines in $tmp/OUT, everything in OUT.log
  local out=$1 np=$2; shift 2
  mpirun -n "$np" "$bin" $steps "$@" 2>"$tmp/$out.err" | tee "$tmp/$out.log" | grep '^step' >"$tmp/$out"
}
same() { # name, file a, file b
  if [ -s "$tmp/$2" ] && cmp -s "$tmp/$2" "$tmp/$3"; then echo "PASS: $1"
  else echo "FAIL: $1: $(diff "$tmp/$2" "$tmp/$3" | head -n 3 | tr '\n' ' ') $(head -c 300 "$tmp/$3.err")"; fi
}
run one 1 --partitions 1 --microbatches 4
run pp2 2 --partitions 2 --microbatches 4
run pp2s 2 --partitions 2 --microbatches 4 --pipeline simple
run pp2m 2 --partitions 2 --microbatches 4 --manual
run pp2zb 2 --partitions 2 --microbatches 4 --pipeline zero_bubble
run pp2zbv 2 --partitions 2 --microbatches 4 --pipeline zero_bubble_v
run pp2zbvm 2 --partitions 2 --microbatches 4 --pipeline zero_bubble_v --manual
same "demo/2 partitions equal one process, every step bitwise" one pp2
same "demo/2 partitions, simple pipeline, equal one process bitwise" one pp2s
same "demo/2 partitions placed by SMP_PARTITION equal one process bitwise" one pp2m
same "demo/2 partitions, zero-bubble pipeline (split linear backward), equal one process bitwise" one pp2zb
same "demo/2 partitions, zero_bubble_v pipeline (4 stages in a V), equal one process bitwise" one pp2zbv
same "demo/2 partitions, zero_bubble_v, layers placed in a V by SMP_PARTITION, equal one process bitwise" one pp2zbvm
run dp_pp 4 --partitions 2 --ddp --deterministic --microbatches 4
run dp_one 2 --partitions 1 --ddp --deterministic --microbatches 4
same "demo/2 partitions x 2 replicas equal 2 replicas in one stage bitwise (deterministic)" dp_one dp_pp
# --shard-optimizer: each replica keeps Adam's moments for its owned range only (and checkpoints them so); bitwise
# the unsharded run, and about half the optimizer state per rank in the memory account's peaks ("memory peak rank R")
run dp_one_sh 2 --partitions 1 --ddp --deterministic --microbatches 4 --shard-optimizer
same "demo/--shard-optimizer: 2 replicas equal the unsharded run bitwise (deterministic)" dp_one dp_one_sh
name="demo/--shard-optimizer: optimizer-state peak per parameter byte 0.45..0.55 of unsharded (2 replicas)"
if msg=$(python3 "$top/test/memory_peaks.py" "$tmp/dp_one.log" "$tmp/dp_one_sh.log" optimizer/parameters 0.45 0.55 \
  2>&1); then
  echo "PASS: $name: $msg"
else echo "FAIL: $name: $(echo "$msg" | tail -n 1)"; fi
run one8 1 --partitions 1 --microbatches 8
if [ -s "$tmp/dp_pp" ] && python3 - "$tmp/dp_pp" "$tmp/one8" <<'PY'
import sys
a = [float.fromhex(l.split()[3]) for l in open(sys.argv[1])]
b = [float.fromhex(l.split()[3]) for l in open(sys.argv[2])]
assert len(a) == len(b) == 40, (len(a), len(b))
assert a[0] == b[0], ("first step", a[0], b[0])
worst = max(abs(x - y) / abs(y) for x, y in zip(a[:5], b[:5]))
assert worst < 1e-5, worst
PY
then echo "PASS: demo/2x2 replicas equal one process with the same global batch (step 0 bitwise, steps 1-4 within 1e-5)"
else echo "FAIL: demo/2x2 replicas equal one process with the same global batch (step 0 bitwise, steps 1-4 within 1e-5)"; fi

# bad input
expect_error() { # name, pattern, command...
  local name=$1 pat=$2; shift 2
  "$@" >"$tmp/out" 2>&1; local rc=$?
  if [ $rc -ne 0 ] && grep -q -- "$pat" "$tmp/out" && ! grep -q 'runtime error: ' "$tmp/out"; then echo "PASS: $name"
  else echo "FAIL: $name: exit $rc, output: $(head -c 300 "$tmp/out")"; fi
}
expect_error "demo/missing dataset names the file" "$tmp/none/train-images-idx3-ubyte.gz" mpirun -n 2 "$bin" --data "$tmp/none"
mkdir -p "$tmp/bad"
for f in /usr/share/datasets/fashion-mnist/*.gz; do cp "$f" "$tmp/bad/"; done
python3 - "$tmp/bad/train-images-idx3-ubyte.gz" <<'PY'
import sys
p = sys.argv[1]
d = bytearray(open(p, 'rb').read())
for i in range(1000, 1400): d[i] ^= 0x5a   # damage the deflate stream
open(p, 'wb').write(bytes(d))
PY
expect_error "demo/corrupt gzip is a clear error" "train-images-idx3-ubyte.gz" mpirun -n 2 "$bin" --data "$tmp/bad"
expect_error "demo/batch that does not divide into microbatches" "does not divide into 8 microbatches" mpirun -n 2 "$bin" --batch 100 --microbatches 8
expect_error "demo/bad --config names the key" "microbatch" mpirun -n 1 "$bin" --config '{"microbatch": 4}'

# checkpoints: resume equals the uninterrupted run; inference reshards; Python reads it
infer="$ex/fmnist_infer"
short="--epoch-steps 12 --print-losses"
for kind in full partial; do
  flag=$([ $kind = partial ] && echo --partial)
  mpirun -n 2 "$bin" --epochs 3 $short --checkpoint "$tmp/u_$kind" $flag 2>"$tmp/u.err" | grep '^step' >"$tmp/uninterrupted_$kind"
  mpirun -n 2 "$bin" --epochs 1 $short --checkpoint "$tmp/r_$kind" $flag 2>"$tmp/r.err" | grep '^step' >"$tmp/resumed_$kind"
  mpirun -n 2 "$bin" --epochs 3 $short --checkpoint "$tmp/r_$kind" $flag --resume 2>>"$tmp/r.err" | grep '^step' >>"$tmp/resumed_$kind"
  same "demo/resume from a $kind checkpoint equals the uninterrupted run" "uninterrupted_$kind" "resumed_$kind"
done
acc=$(mpirun -n 2 "$bin" --epochs 1 --epoch-steps 40 --checkpoint "$tmp/c.safetensors" 2>&1 | sed -n 's/^test accuracy: //p')
for p in 1 4; do
  got=$(mpirun -n $p "$infer" --checkpoint "$tmp/c.safetensors" --partitions $p 2>&1 | sed -n 's/.*test accuracy: \([0-9.]*\).*/\1/p')
  [ -n "$acc" ] && [ "$got" = "$acc" ] && echo "PASS: demo/inference on $p partitions from a 2-partition checkpoint: accuracy $got" \
    || echo "FAIL: demo/inference on $p partitions from a 2-partition checkpoint: got '$got', training printed '$acc'"
done
if [ -n "$acc" ]; then python3 "$top/test/test_fmnist_checkpoint.py" "$tmp/c.safetensors" "$acc"
else echo "FAIL: demo/python recomputes the checkpoint's test accuracy: training printed no accuracy"; fi
