#!/usr/bin/env bash
# The GPT on CUDA (examples/gpt.cu) on test/fake_cuda.c's CPU device, built as
# build/fake/gpt from test/fake_gpt.cu (the program unchanged, host twins of
# gpt_cuda.h's kernels after it), on a tiny model (2 layers, width 32,
# context 16: a run takes a few seconds):
#  - every step's loss, a checksum of every parameter, the validation loss,
#    the logits after a fixed context and the sample of 2 partitions on 2
#    fake GPUs (NCCL) equal the one-process run bit for bit, under every
#    schedule (simple, interleaved, zero_bubble, zero_bubble_v), with
#    recomputed blocks, with 2 ranks sharing one GPU (host-staged) and with
#    4 partitions; so do they in --bf16;
#  - DDP: 2 partitions x 2 replicas (deterministic reduction) equal 2
#    replicas in one stage bitwise, and the host program's one process that
#    runs both replicas' shards in turn (gpt.c --replicas 2) within 1e-5;
#  - --shard-optimizer (AdamW's moments for each replica's owned range
#    only): 2 replicas at 1 and 2 partitions equal the unsharded runs bit
#    for bit, and every rank's optimizer-state peak in the memory account
#    ("memory peak rank R: ...") is about half the unsharded one;
#  - --offload (activations in host memory until their backward, horizon
#    1): 2 partitions under GPipe equal one process bitwise, the largest
#    device activation peak of a rank is lower and the account counts the
#    host copies;
#  - against the host program (examples/gpt.c, OpenBLAS) with the same
#    flags: after 10 steps every parameter within 1e-5 relative (the norm of
#    the difference over the norm of gpt.c's), and the losses within 1e-5.
#    The key bias (columns C..2C of c_attn.bias) is left out: its gradient
#    is zero in exact arithmetic (softmax ignores a constant added to every
#    score of a row), so it holds only rounding noise that Adam scales up to
#    steps of lr; both programs must leave it below 1e-4 in magnitude;
#  - checkpoints: gpt.cu's loads into gpt.c (--generate --load, the logits
#    after a context within 1e-5 of gpt.cu's) and gpt.c's into gpt.cu
#    (--load --steps 0: the same parameter checksums bit for bit, logits
#    within 1e-5);
#  - resuming training (--save-at 5 with AdamW's state, the moments copied from device memory; --load): bitwise
#    as the run that never stopped at 2 -> 2 and 2 -> 1 partitions, full and --partial (the log's loss average
#    over the resumed steps, saying from which: gpt_log_avg.py), DDP 2x2 with
#    --shard-optimizer sharded -> sharded and (1 stage, partial) -> unsharded 2x2, and in bf16; gpt.c's
#    checkpoint in gpt.cu, gpt.cu's in gpt.c and the sharded 2x2 one in gpt.c --replicas 2 within 1e-5; bf16 ->
#    f32 and f32 -> bf16 within 1e-3 (the file holds f32 in both: checked); another model's checkpoint and one
#    missing a moment are errors on every rank naming the fix;
#  - pipelined generation on the device (gpt.cu --generate, the KV cache in
#    device memory), 3 prompts x 8 characters: from gpt.c's checkpoint at 1
#    and 2 partitions and from gpt.cu's own at 2, the samples of gpt.c
#    --generate and every step's logits within 1e-5 of its; 2 partitions
#    equal 1 bit for bit; --no-cache agrees with the cache within 1e-5; a
#    context longer than the model's is an error on every rank;
#  - --bf16 (bf16 GEMM inputs, f32 accumulation and master weights): every
#    loss of 10 steps and the validation loss within 1e-3 relative of the
#    f32 run's, and not all equal to them (the bf16 path ran);
#  - tools/gpt_bench.sh (what tools/device_run.sh runs at GPT-2 124M's
#    shape on a lent GPU), at a tiny size: 1 rank and 2 ranks sharing a GPU
#    train and print their tokens/s, and generation from a checkpoint of
#    that shape (its vocabulary padded to 128 ids, of which it draws only the
#    corpus's; KV cache on the device) prints its tokens/s;
#  - the plain loop (--plain, the overhead benchmark's baseline) agrees
#    with smp's one process within 1e-6, and bench/gpt_cuda.sh runs;
#  - the loss falls; --dropout is refused with a message on every rank.
# usage: test/test_fake_gpt.sh [BUILD_DIR] (ignored: the binaries are build/fake/gpt and build/examples/gpt)
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
bin="$top/build/fake/gpt"
host="$top/build/examples/gpt"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0
pass() { echo "PASS: $1"; }
fail() { echo "FAIL: $1"; failed=1; }
[ -x "$bin" ] || { echo "FAIL: fake-gpt/binary: $bin is not built (test/fake_gpt.cu with test/fake_cuda.o, nvcc -cudart none)"; exit 1; }
[ -d /usr/share/games/fortunes ] || { echo "FAIL: fake-gpt/corpus: /usr/share/games/fortunes is missing (make deps installs fortunes)"; exit 1; }
start=$SECONDS
ctx="It was a dark"
tiny="--layers 2 --dmodel 32 --heads 4 --context 16 --batch 8 --microbatches 4 --steps 10 --warmup 2 --val-batches 2
      --sample-len 8 --print-losses --digest --log-every 1000"
# name, fake GPUs per node, ranks, program, options...: $tmp/NAME holds what must match, NAME.raw everything
run() {
  local out=$1 gpus=$2 np=$3 prog=$4; shift 4
  SMP_TIMEOUT=120 FAKE_CUDA_DEVICES=$gpus OPENBLAS_NUM_THREADS=1 timeout 300 mpirun -n "$np" "$prog" $tiny --logits "$ctx" "$@" >"$tmp/$out.raw" 2>"$tmp/$out.err"
  echo "exit $?" >>"$tmp/$out.raw"
  grep -a -v -e 'tokens/s' -e '^placement:' -e '^gpt' -e '^checkpoint:' -e '^memory peak' "$tmp/$out.raw" >"$tmp/$out"
}
complete() { grep -q '^param ' "$tmp/$1" && grep -q '^logits ' "$tmp/$1" && grep -q '^validation ' "$tmp/$1" && grep -q 'exit 0' "$tmp/$1"; }
why() { echo "$(tail -n 1 "$tmp/$1.raw"); $(head -c 300 "$tmp/$1.err" | tr '\n' ' ')"; }
same() { # check, run a, run b [pattern b's header must hold]
  if ! complete "$2"; then fail "$1: $2 did not complete: $(why "$2")"
  elif ! complete "$3"; then fail "$1: $3 did not complete: $(why "$3")"
  elif [ -n "${4:-}" ] && ! grep -q -- "$4" "$tmp/$3.raw"; then fail "$1: $3 did not run on the path '$4': $(head -n 1 "$tmp/$3.raw")"
  elif cmp -s "$tmp/$2" "$tmp/$3"; then pass "$1"
  else fail "$1: first difference: $(diff "$tmp/$2" "$tmp/$3" | grep -m 2 '^[<>]' | cut -c 1-120 | tr '\n' ' ')"; fi
}
# the memory account's peaks of run b against run a's (test/memory_peaks.py)
peaks() { # check, run a, run b, category, low, high
  if msg=$(python3 "$top/test/memory_peaks.py" "$tmp/$2.raw" "$tmp/$3.raw" "$4" "$5" "$6" 2>&1); then pass "$1: $msg"
  else fail "$1: $(echo "$msg" | tail -n 1)"; fi
}

run one 1 1 "$bin" --partitions 1 --save "$tmp/one.safetensors"
# (two of them also save a checkpoint with AdamW's state after step 5 for the resuming checks below: --save-at
# changes nothing of the run that goes on)
save_at() { case $1 in simple) echo --save-at 5 --save "$tmp/ck_pp2.st";; interleaved) echo --save-at 5 --partial --save "$tmp/ck_pp2p";; esac; }
for pipe in simple interleaved zero_bubble zero_bubble_v; do
  run "pp2_$pipe" 2 2 "$bin" --partitions 2 --pipeline "$pipe" $(save_at "$pipe")
  same "fake-gpt/2 partitions on 2 fake GPUs (NCCL), $pipe pipeline: losses, parameters, validation, logits and sample equal one process bitwise" one "pp2_$pipe" "nccl:"
done
run pp2_recompute 2 2 "$bin" --partitions 2 --recompute
same "fake-gpt/2 partitions, blocks recomputed, equal one process bitwise" one pp2_recompute "nccl:"
# --offload: what each backward needs waits in host memory until activation_loading_horizon tasks before it
# (both runs split the model by memory alone: a split by traced time may differ between two runs)
run offload 2 2 "$bin" --partitions 2 --pipeline simple --offload \
  --config '{"activation_loading_horizon": 1, "optimize": "memory"}'
run no_offload 2 2 "$bin" --partitions 2 --pipeline simple --config '{"optimize": "memory"}'
same "fake-gpt/2 partitions, GPipe, activations offloaded to host memory (horizon 1), equal one process bitwise" \
  one offload "nccl:"
peaks "fake-gpt/--offload: the largest activation peak of a rank below 0.8 of the run without (pp2, GPipe)" \
  no_offload offload max:activations 0 0.8
peaks "fake-gpt/--offload: the memory account counts the host copies (offloaded bytes on every rank)" \
  offload offload offloaded 1 1
run shared 1 2 "$bin" --partitions 2
same "fake-gpt/2 partitions sharing one fake GPU (host-staged) equal one process bitwise" one shared "host-staged"
run pp4 4 4 "$bin" --partitions 4 --pipeline simple
same "fake-gpt/4 partitions on 4 fake GPUs equal one process bitwise" one pp4 "nccl:"

# data parallelism
run dp_one 2 2 "$bin" --partitions 1 --ddp --deterministic
run dp_pp 4 4 "$bin" --partitions 2 --ddp --deterministic
same "fake-gpt/2 partitions x 2 replicas equal 2 replicas in one stage bitwise (deterministic)" dp_one dp_pp "nccl:"
# --shard-optimizer (ZeRO-1 on the device): each replica keeps AdamW's moments for its owned range only; bitwise the
# unsharded run, and about half the optimizer state per rank in the memory account's peaks ("memory peak rank R")
run dp_one_sh 2 2 "$bin" --partitions 1 --ddp --deterministic --shard-optimizer --save-at 5 --partial --save "$tmp/ck_dp1shp"
run dp_pp_sh 4 4 "$bin" --partitions 2 --ddp --deterministic --shard-optimizer --save-at 5 --save "$tmp/ck_dpsh.st"
same "fake-gpt/--shard-optimizer: 2 replicas (1 stage) equal the unsharded run bitwise (deterministic)" \
  dp_one dp_one_sh "nccl:"
same "fake-gpt/--shard-optimizer: 2 partitions x 2 replicas equal the unsharded run bitwise (deterministic)" \
  dp_pp dp_pp_sh "nccl:"
peaks "fake-gpt/--shard-optimizer: optimizer-state peak per parameter byte 0.45..0.55 of unsharded (2 replicas, 1 stage)" \
  dp_one dp_one_sh optimizer/parameters 0.45 0.55
peaks "fake-gpt/--shard-optimizer: optimizer-state peak per parameter byte 0.45..0.55 of unsharded (2 stages x 2 replicas)" \
  dp_pp dp_pp_sh optimizer/parameters 0.45 0.55

# within a tolerance of the host program's two replicas in one process
close() { # check, run a, run b, relative bound: every step's loss and the validation loss
  if ! complete "$2"; then fail "$1: $2 did not complete: $(why "$2")"
  elif ! complete "$3"; then fail "$1: $3 did not complete: $(why "$3")"
  elif msg=$(python3 - "$tmp/$2" "$tmp/$3" "$4" 2>&1 <<'PY'
import sys
def losses(p):
    return [float.fromhex(l.split()[-1]) for l in open(p, errors="replace") if (l.startswith("step ") and " loss 0x" in l) or l.startswith("validation 0x")]
a, b, bound = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
assert len(a) == len(b) == 11, ("losses", len(a), len(b))
worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
assert worst < bound, ("worst relative difference", worst)
print("worst %.1e" % worst)
PY
  ); then pass "$1: $msg"
  else fail "$1: $(echo "$msg" | tail -n 1)"; fi
}
if [ -x "$host" ]; then
  run host_dp 1 1 "$host" --partitions 1 --replicas 2
  close "fake-gpt/2x2 replicas equal the host program's 2 replicas in one process (gpt.c --replicas 2) within 1e-5" dp_pp host_dp 1e-5
else fail "fake-gpt/host: $host is not built (make build/examples/gpt)"; fi

# against the host program, parameter by parameter; and the checkpoints both ways
if [ -x "$host" ]; then
  run host 1 1 "$host" --partitions 1 --save "$tmp/host.safetensors"
  close "fake-gpt/f32 losses equal the host program's (gpt.c) within 1e-5" one host 1e-5
  name="fake-gpt/after 10 steps every parameter is within 1e-5 (relative norm) of the host program's (the key bias, zero in exact arithmetic, below 1e-4)"
  if msg=$(python3 - "$tmp/one.safetensors" "$tmp/host.safetensors" 2>&1 <<'PY'
import sys
import numpy as np
from safetensors.numpy import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
assert sorted(a) == sorted(b) and len(a) == 28, ("names", len(a), len(b))
C, worst = 32, (0.0, "")
for k in b:
    x, y = a[k].astype(np.float64), b[k].astype(np.float64)
    if k.endswith("c_attn.bias"):
        assert max(np.abs(x[C:2 * C]).max(), np.abs(y[C:2 * C]).max()) < 1e-4, (k, "key bias", np.abs(x[C:2 * C]).max(), np.abs(y[C:2 * C]).max())
        x, y = np.concatenate([x[:C], x[2 * C:]]), np.concatenate([y[:C], y[2 * C:]])
    worst = max(worst, (np.linalg.norm(x - y) / np.linalg.norm(y), k))
assert worst[0] < 1e-5, worst
print("worst %.1e (%s)" % worst)
PY
  ); then pass "$name: $msg"; else fail "$name: $(echo "$msg" | tail -n 1)"; fi

  # gpt.c's checkpoint into gpt.cu: the same parameters bit for bit, and the same logits within 1e-5
  run loaded 2 2 "$bin" --partitions 2 --load "$tmp/host.safetensors" --steps 0 --sample-len 0 --val-batches 0
  name="fake-gpt/gpt.c's checkpoint loads into gpt.cu (2 partitions): every parameter's checksum equal"
  if grep -q 'exit 0' "$tmp/loaded" && grep -q '^param ' "$tmp/loaded" && cmp -s <(grep '^param ' "$tmp/host") <(grep '^param ' "$tmp/loaded"); then pass "$name"
  else fail "$name: $(diff <(grep '^param ' "$tmp/host") <(grep '^param ' "$tmp/loaded") | head -n 2 | tr '\n' ' ') $(why loaded)"; fi
  logits_close() { # check, file a (a "logits Z..." line), file b, pattern of b's line
    if msg=$(python3 - "$2" "$3" "$4" 2>&1 <<'PY'
import re, sys
a = [l for l in open(sys.argv[1], errors="replace") if l.startswith("logits ")]
b = [l for l in open(sys.argv[2], errors="replace") if re.match(sys.argv[3], l)]
assert a and b, ("no logits", len(a), len(b))
za, zb = [float.fromhex(v) for v in a[0].split()[1:]], [float.fromhex(v) for v in b[0].split()[-len(a[0].split()[1:]):]]
assert len(za) == len(zb) > 10, ("vocabulary", len(za), len(zb))
worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(za, zb))
assert worst < 1e-5, ("worst difference / max(1, |logit|)", worst)
print("worst %.1e" % worst)
PY
    ); then pass "$1: $msg"; else fail "$1: $(echo "$msg" | tail -n 1)"; fi
  }
  logits_close "fake-gpt/gpt.c's checkpoint loaded into gpt.cu gives gpt.c's logits after '$ctx' within 1e-5" "$tmp/loaded" "$tmp/host" '^logits '
  # gpt.cu's checkpoint into gpt.c (pipelined generation, one prompt, the whole context)
  SMP_TIMEOUT=120 OPENBLAS_NUM_THREADS=1 timeout 300 mpirun -n 1 "$host" --partitions 1 --generate --load "$tmp/one.safetensors" \
    --prompts "$ctx" --tokens 1 --no-cache --print-logits >"$tmp/gen.raw" 2>"$tmp/gen.err"
  logits_close "fake-gpt/gpt.cu's checkpoint loads into gpt.c (--generate): its logits after '$ctx' within 1e-5 of gpt.cu's" "$tmp/one" "$tmp/gen.raw" '^logits 0 0 '

  # --generate on the device (the KV cache in device memory), 3 prompts of different lengths, against gpt.c's
  gen() { # name, fake GPUs, ranks, program, options...: $tmp/NAME holds the samples and every step's logits
    local out=$1 gpus=$2 np=$3 prog=$4; shift 4
    SMP_TIMEOUT=120 FAKE_CUDA_DEVICES=$gpus OPENBLAS_NUM_THREADS=1 timeout 300 mpirun -n "$np" "$prog" --generate \
      --prompts "The |It was a|Why" --tokens 8 --print-logits "$@" >"$tmp/$out.raw" 2>"$tmp/$out.err"
    echo "exit $?" >>"$tmp/$out.raw"
    grep -a -v -e '^generated ' -e '^placement:' -e '^gpt' "$tmp/$out.raw" >"$tmp/$out"
  }
  gen_close() { # check, run a, run b: both complete, the same samples, every step's logits within 1e-5
    if msg=$(python3 - "$tmp/$2" "$tmp/$3" 2>&1 <<'PY'
import sys
def parse(p):
    lines = open(p, errors="replace").read().split("\n")
    assert "exit 0" in lines, (p, "did not complete", lines[-3:])
    logits = {tuple(l.split()[1:3]): [float.fromhex(v) for v in l.split()[3:]] for l in lines if l.startswith("logits ")}
    samples = "\n".join(lines[lines.index("--- prompt 0:"):lines.index("exit 0")]) if "--- prompt 0:" in lines else ""
    return logits, samples
(la, sa), (lb, sb) = parse(sys.argv[1]), parse(sys.argv[2])
assert len(la) == len(lb) == 24 and sorted(la) == sorted(lb), ("logits lines (3 prompts x 8 steps)", len(la), len(lb))
assert sa.count("--- prompt") == 3 and sa == sb, ("the samples differ", sa[:200], sb[:200])
worst = max(abs(x - y) / max(1.0, abs(y)) for k in la for x, y in zip(la[k], lb[k]))
assert worst < 1e-5, ("worst logit difference / max(1, |logit|)", worst)
print("worst %.1e" % worst)
PY
    ); then pass "$1: $msg"; else fail "$1: $(echo "$msg" | tail -n 1) $(head -c 300 "$tmp/$3.err" | tr '\n' ' ')"; fi
  }
  gen gen_host 1 1 "$host" --partitions 1 --load "$tmp/host.safetensors"
  gen gen_dev1 1 1 "$bin" --partitions 1 --load "$tmp/host.safetensors"
  gen gen_dev2 2 2 "$bin" --partitions 2 --load "$tmp/host.safetensors"
  gen_close "fake-gpt/gpt.cu --generate (KV cache on the device) from gpt.c's checkpoint: gpt.c --generate's samples, logits within 1e-5" gen_host gen_dev1
  gen_close "fake-gpt/gpt.cu --generate on 2 partitions (2 fake GPUs) from gpt.c's checkpoint: gpt.c --generate's samples, logits within 1e-5" gen_host gen_dev2
  name="fake-gpt/gpt.cu --generate: 2 partitions equal 1 bitwise (samples and every step's logits)"
  if grep -q '^logits ' "$tmp/gen_dev1" && grep -q 'exit 0' "$tmp/gen_dev1" && grep -q ' | 1:' "$tmp/gen_dev2.raw" &&
     cmp -s "$tmp/gen_dev1" "$tmp/gen_dev2"; then pass "$name"
  else fail "$name: $(diff "$tmp/gen_dev1" "$tmp/gen_dev2" | grep -a -m 2 '^[<>]' | cut -c 1-120 | tr '\n' ' ')"; fi
  gen gen_nocache 1 1 "$bin" --partitions 1 --load "$tmp/host.safetensors" --no-cache
  gen_close "fake-gpt/gpt.cu --generate --no-cache (whole contexts) agrees with its KV cache: samples, logits within 1e-5" gen_nocache gen_dev1
  gen gen_own_host 1 1 "$host" --partitions 1 --load "$tmp/one.safetensors"
  gen gen_own_dev 2 2 "$bin" --partitions 2 --load "$tmp/one.safetensors"
  gen_close "fake-gpt/gpt.cu --generate on 2 partitions from gpt.cu's own checkpoint: gpt.c --generate's samples, logits within 1e-5" gen_own_host gen_own_dev
  SMP_TIMEOUT=60 FAKE_CUDA_DEVICES=2 timeout 120 mpirun -n 2 "$bin" --generate --load "$tmp/one.safetensors" --partitions 2 \
    --prompts "The|It was a dark" --tokens 8 >"$tmp/gen_long.out" 2>&1
  rc=$?
  name="fake-gpt/gpt.cu --generate: a prompt + tokens longer than the model's context is an error on every rank"
  if [ $rc -ne 0 ] && [ "$(grep -c 'prompt 1: a context of 21 characters (13 of prompt + 8 tokens) is longer than the model.s 16' "$tmp/gen_long.out")" -eq 2 ]; then pass "$name"
  else fail "$name: exit $rc; $(head -c 300 "$tmp/gen_long.out")"; fi
fi

# bf16: bitwise across partitions, and close to f32
run bf16 1 1 "$bin" --partitions 1 --bf16 --save-at 5 --save "$tmp/ck_bf16.st"
run bf16_pp2 2 2 "$bin" --partitions 2 --bf16 --pipeline zero_bubble
same "fake-gpt/--bf16: 2 partitions (zero_bubble) equal one process bitwise" bf16 bf16_pp2 "bf16 GEMMs"
close "fake-gpt/--bf16 (bf16 GEMM inputs, f32 accumulation) within 1e-3 of f32: every step's loss and the validation loss" bf16 one 1e-3
name="fake-gpt/--bf16 changes the losses (the bf16 GEMMs ran)"
if complete bf16 && ! cmp -s <(grep '^step' "$tmp/bf16") <(grep '^step' "$tmp/one"); then pass "$name"; else fail "$name: $(why bf16)"; fi

# Resuming training: the checkpoints saved above after step 5 with AdamW's state (--save-at: the moments in
# device memory, of each replica's owned range under --shard-optimizer, and the step count) continue as the run
# that never stopped, bit for bit (its steps 0-4 left out): full and partial, 2 -> 1 and 2 -> 2 partitions,
# DDP 2x2 sharded -> sharded, sharded (1 stage, partial) -> unsharded (2 stages); in bf16. Across programs and dp
# sizes within 1e-5 (host and device kernels sum in other orders): gpt.c's checkpoint in gpt.cu, gpt.cu's in
# gpt.c, the sharded DDP 2x2 checkpoint in gpt.c's one process running both replicas (--replicas 2). Across
# precisions (the file holds f32 master weights and moments in both; bf16 rounds copies of them inside its
# GEMMs only): the bf16 checkpoint continues in f32 and the f32 one in bf16, within 1e-3 of the run that saved it.
from5() { grep -a -v '^step [0-4] loss' "$tmp/$1" >"$tmp/$1_from5"; }
for r in one dp_pp bf16; do from5 "$r"; done
resumed() { # check, run that never stopped, resumed run, relative bound, [differ]: steps 5-9 and the validation loss
  if ! grep -q '^gpt: starting from .*, with AdamW.s state, at step 5$' "$tmp/$3.raw"; then
    fail "$1: $3 did not resume at step 5 with AdamW's state: $(why "$3")"
  elif msg=$(python3 - "$tmp/$2" "$tmp/$3" "$4" "${5:-}" 2>&1 <<'PY'
import sys
def losses(p):
    lines = open(p, errors="replace").read().split("\n")
    assert "exit 0" in lines, (p, "did not complete", lines[-3:])
    out = {int(l.split()[1]): float.fromhex(l.split()[3]) for l in lines if l.startswith("step ") and " loss 0x" in l}
    out.update({"val": float.fromhex(l.split()[1]) for l in lines if l.startswith("validation 0x")})
    return out
a, b, bound = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
assert sorted(b, key=str) == [5, 6, 7, 8, 9, "val"] and set(b) <= set(a), ("steps", sorted(a, key=str), sorted(b, key=str))
worst = max(abs(a[k] - b[k]) / abs(a[k]) for k in b)
assert worst < bound, ("worst relative difference", worst)
assert not sys.argv[4] or any(a[k] != b[k] for k in b), "equal bit for bit: the other precision did not run"
print("worst %.1e" % worst)
PY
  ); then pass "$1: $msg"
  else fail "$1: $(echo "$msg" | tail -n 1)"; fi
}
run res_pp2 2 2 "$bin" --partitions 2 --load "$tmp/ck_pp2.st" --save ""
same "fake-gpt/--save-at 5 (2 partitions, full) resumed at 2 partitions continues bitwise as the run that never stopped" \
  one_from5 res_pp2 "with AdamW's state, at step 5"
for r in one res_pp2; do # the log's loss average is the run's own steps', the resumed one's from step 6, saying so
  if msg=$(python3 "$top/test/gpt_log_avg.py" "$tmp/$r.raw" 2>&1); then pass "fake-gpt/the log's loss average ($r): $msg"
  else fail "fake-gpt/the log's loss average ($r): $(echo "$msg" | tail -n 1)"; fi
done
run res_pp2p 1 1 "$bin" --partitions 1 --partial --load "$tmp/ck_pp2p" --save ""
same "fake-gpt/--save-at 5 --partial (2 partitions, a file each) resumed at 1 partition continues bitwise" \
  one_from5 res_pp2p "with AdamW's state, at step 5"
run res_dpsh 4 4 "$bin" --partitions 2 --ddp --deterministic --shard-optimizer --load "$tmp/ck_dpsh.st" --save ""
same "fake-gpt/--shard-optimizer 2x2: its checkpoint (each replica's moments joined) resumed sharded continues bitwise" \
  dp_pp_from5 res_dpsh "with AdamW's state, at step 5"
run res_dp1shp 4 4 "$bin" --partitions 2 --ddp --deterministic --partial --load "$tmp/ck_dp1shp" --save ""
same "fake-gpt/--shard-optimizer 1 stage x 2 replicas, partial checkpoint, resumed unsharded at 2x2 continues bitwise" \
  dp_pp_from5 res_dp1shp "with AdamW's state, at step 5"
run res_bf16 1 1 "$bin" --partitions 1 --bf16 --load "$tmp/ck_bf16.st" --save ""
same "fake-gpt/--bf16: its --save-at checkpoint resumed in bf16 continues bitwise" bf16_from5 res_bf16 "bf16 GEMMs"
run res_bf16_f32 2 2 "$bin" --partitions 2 --load "$tmp/ck_bf16.st" --save ""
resumed "fake-gpt/--bf16's checkpoint resumed in f32 continues within 1e-3 of the bf16 run" bf16 res_bf16_f32 1e-3 differ
run res_f32_bf16 2 2 "$bin" --partitions 2 --bf16 --load "$tmp/ck_pp2.st" --save ""
resumed "fake-gpt/an f32 checkpoint resumed in --bf16 continues within 1e-3 of the f32 run" one res_f32_bf16 1e-3 differ
name="fake-gpt/a --bf16 checkpoint holds f32 master weights and moments (every tensor f32 but the step count)"
if msg=$(python3 - "$tmp/ck_bf16.st" 2>&1 <<'PY'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
head = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
dt = {k: v["dtype"] for k, v in head.items() if k != "__metadata__"}
assert len(dt) == 28 * 3 + 1 and dt.pop("optimizer.step") == "I64", ("tensors", len(dt))
assert set(dt.values()) == {"F32"}, sorted(set(dt.values()))
print("%d f32 tensors" % len(dt))
PY
); then pass "$name: $msg"; else fail "$name: $(echo "$msg" | tail -n 1)"; fi
if [ -x "$host" ]; then
  run host_ck 1 1 "$host" --partitions 1 --save-at 5 --save "$tmp/host_ck.st"
  run res_host_dev 2 2 "$bin" --partitions 2 --load "$tmp/host_ck.st" --save ""
  resumed "fake-gpt/gpt.c's --save-at checkpoint resumed in gpt.cu (2 partitions) continues within 1e-5 of gpt.c's run" \
    host res_host_dev 1e-5
  run res_dev_host 1 1 "$host" --partitions 1 --load "$tmp/ck_pp2.st" --save ""
  resumed "fake-gpt/gpt.cu's --save-at checkpoint resumed in gpt.c continues within 1e-5 of gpt.cu's run" \
    one res_dev_host 1e-5
  run res_dpsh_host 1 1 "$host" --partitions 1 --replicas 2 --load "$tmp/ck_dpsh.st" --save ""
  resumed "fake-gpt/gpt.cu's sharded 2x2 checkpoint resumed unsharded in gpt.c's one process (--replicas 2) within 1e-5" \
    dp_pp res_dpsh_host 1e-5
fi
# bad input: another model's checkpoint, and one whose AdamW state lacks a tensor: refused on every rank, naming the fix
expect_error() { # check, pattern, ranks, options...
  local name=$1 pat=$2 np=$3; shift 3
  SMP_TIMEOUT=60 FAKE_CUDA_DEVICES=2 timeout 120 mpirun -n "$np" "$bin" $tiny "$@" >"$tmp/bad.out" 2>&1
  local rc=$? n; n=$(grep -a -c -- "$pat" "$tmp/bad.out")
  if [ $rc -ne 0 ] && [ "$n" -eq "$np" ]; then pass "$name"
  else fail "$name: exit $rc, $n of $np ranks said '$pat': $(head -c 400 "$tmp/bad.out")"; fi
}
expect_error "fake-gpt/--load of a 2-layer checkpoint into 3 layers names the fix on every rank" \
  "give the --layers, --dmodel, --heads, --context (and gpt.cu's --vocab-multiple) of the run that saved it" \
  2 --partitions 2 --layers 3 --load "$tmp/ck_pp2.st" --save ""
python3 - "$tmp/ck_pp2.st" "$tmp/ck_nov.st" <<'PY'
import sys
from safetensors import safe_open
from safetensors.numpy import save_file
gone = "optimizer.transformer.h.1.mlp.c_fc.weight.exp_avg_sq"
with safe_open(sys.argv[1], "numpy") as f:
    meta = {k: v for k, v in f.metadata().items() if not k.endswith("." + gone)}
    save_file({k: f.get_tensor(k) for k in f.keys() if k != gone}, sys.argv[2], metadata=meta)
PY
expect_error "fake-gpt/--load of a checkpoint missing one of AdamW's moments names the tensor and the fix on every rank" \
  "h.1.mlp.c_fc.weight.exp_avg_sq' is missing.*resume from a --save-at checkpoint of the same model, whole" \
  2 --partitions 2 --load "$tmp/ck_nov.st" --save ""

name="fake-gpt/the loss falls (at the default learning rate, mean of the last 3 of 10 steps below 0.96 x the first 3's)"
if complete one && msg=$(python3 - "$tmp/one" 2>&1 <<'PY'
import math, sys
a = [float.fromhex(l.split()[3]) for l in open(sys.argv[1], errors="replace") if l.startswith("step ") and " loss 0x" in l]
first, last = sum(a[:3]) / 3, sum(a[-3:]) / 3
assert all(math.isfinite(x) for x in a) and last < 0.96 * first, ("first 3 average %.4f, last 3 %.4f" % (first, last))
print("first 3 average %.4f, last 3 %.4f" % (first, last))
PY
); then pass "$name: $msg"; else fail "$name: ${msg:-$(why one)}"; fi

# tools/device_run.sh's GPT-2 124M runs (tools/gpt_bench.sh), at a tiny size (later flags win)
SMP_TIMEOUT=120 FAKE_CUDA_DEVICES=1 GPT_BENCH_TOKENS=16 bash "$top/tools/gpt_bench.sh" "$bin" /usr/share/games/fortunes \
  --layers 2 --dmodel 64 --heads 4 --context 32 --batch 4 --steps 4 --warmup 1 >"$tmp/bench" 2>&1
rc=$?
name="fake-gpt/tools/gpt_bench.sh (device_run.sh's 124M runs) at a tiny size: 1 rank and 2 ranks on one GPU train in bf16 with the padded vocabulary and print tokens/s; generation with the KV cache prints its tokens/s"
if [ $rc -eq 0 ] && [ "$(grep -a -c 'vocabulary 128, .*bf16 GEMMs' "$tmp/bench")" -eq 3 ] && grep -a -q 'host-staged' "$tmp/bench" &&
   grep -a -q '^gpt.cu 124M bf16 tokens/s: [0-9]* (1 rank), [0-9]* (2 ranks, one GPU)$' "$tmp/bench" &&
   grep -a -q '^gpt.cu 124M bf16 MFU: ' "$tmp/bench" && grep -a -q '^generated 4 x 16 characters' "$tmp/bench" &&
   grep -a -q '^gpt.cu 124M bf16 generation tokens/s: [0-9][0-9]* (1 rank, 4 prompts x 16 characters, KV cache)$' "$tmp/bench"; then
  pass "$name"
else fail "$name: exit $rc; $(tail -n 4 "$tmp/bench" | tr '\n' ' ')"; fi

# the plain loop (gpt.cu --plain: the same kernels without smp) against smp's one process, and the overhead benchmark
run plain 1 1 "$bin" --partitions 1 --plain
close "fake-gpt/the plain loop (--plain: the same kernels called in order, no smp) agrees with smp's one process within 1e-6" plain one 1e-6
SMP_TIMEOUT=120 bash "$top/bench/gpt_cuda.sh" 1 --dmodel 32 --context 16 --steps 4 >"$tmp/overhead" 2>&1
name="fake-gpt/bench/gpt_cuda.sh (smp against the plain loop) runs and prints its figure"
if grep -q '^gpt.cu overhead smp/plain (fake device): [0-9.]*$' "$tmp/overhead"; then pass "$name: $(tail -n 1 "$tmp/overhead")"
else fail "$name: $(tail -n 2 "$tmp/overhead" | tr '\n' ' ')"; fi

# bad input: refused on every rank, with the reason
SMP_TIMEOUT=60 FAKE_CUDA_DEVICES=2 timeout 120 mpirun -n 2 "$bin" $tiny --dropout 0.1 >"$tmp/drop.out" 2>&1
rc=$?
name="fake-gpt/--dropout is refused (exit 2) with a message naming it and gpt.c, on every rank"
if [ $rc -eq 2 ] && [ "$(grep -c -- '--dropout are gpt.c' "$tmp/drop.out")" -eq 2 ]; then pass "$name"
else fail "$name: exit $rc; $(head -c 300 "$tmp/drop.out")"; fi

echo "fake-gpt: the runs took $((SECONDS - start)) s"
exit $failed
