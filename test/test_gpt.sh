#!/usr/bin/env bash
# The GPT example (examples/gpt.c) against itself in one process, on a tiny
# model so each run takes a second: for partitions 1, 2 and 4, every
# pipeline (zero_bubble_v, 2 stages per partition, at 1 and 2, and at 4 on
# a 4-layer model), with and without recomputed blocks, every step's loss, a
# checksum of every parameter after training, the validation loss, the
# logits after a fixed context (--logits) and the generated sample are
# bitwise equal to the one-process run; so with dropout (masks drawn from
# smp_call_seed) and recomputation. DDP 2x2 with deterministic reduction
# equals, bit for bit, one process that runs the two replicas' shards in
# turn and sums their gradients in replica order (--replicas 2), and 2
# replicas in one stage; with dropout, one process running the global batch
# in as many microbatches (the first step bitwise, then within 1e-6).
# --shard-optimizer equals the unsharded DDP runs bitwise and halves each
# rank's optimizer-state peak in the memory account gpt.c prints. The
# loss falls. Against independent references:
# test/gpt_ref.py (numpy, float64) loads the checkpoint with nanoGPT's
# strict names and recomputes the validation loss; test/gpt_torch_check.py
# loads it with load_state_dict(strict=True) into a PyTorch GPT of nanoGPT's
# layout (Debian's python3-torch, float64; SKIP without it) and matches the
# validation loss and the logits within 1e-4, and, from the weights and
# batch of the first step (--grads), its loss and the gradient of every
# parameter (autograd against gpt.c's backward, within 1e-5 of each one's
# largest entry). Bad input gives clear errors on every rank. Pipelined
# generation (--generate) from a checkpoint, 4 prompts at once: the same
# text and the same logits, bitwise, for 1, 2 and 4 partitions (and 2 in a
# V), greedy and sampled; with the KV cache the same text as re-running the whole context
# (--no-cache), and logits equal within 1e-5 of max(1, |logit|) (not
# bitwise: the cached attention sums q.k and p.v in its own loops over the
# cache, and its linear layers run one row where the whole-context run
# runs all of them through sgemm, so the float32 sums are rounded in other
# orders); a context longer than the model's is an error on every rank
# before anything runs. Tensor parallelism (--tp 2, Megatron's layout):
# at tp 2, 2 partitions under every schedule, recomputed blocks and DDP
# bitwise the tp 2 run on one partition; tp 2 and tp 2 x 2 partitions
# within 1e-5 of tp 1 after 20 steps; tp 2's first-step gradients against
# float64 autograd; tp 2's full checkpoint (c_attn [3C, C], as nanoGPT's)
# loads strictly into the numpy and PyTorch GPTs; a checkpoint with AdamW's
# state saved at tp 2 x 2 partitions (--save-at) continues at tp 2 bitwise
# as the run that never stopped (its log's loss average the resumed steps', saying from which: gpt_log_avg.py),
# and across tp (2 -> 1, 1 -> 2) within 1e-5;
# tp 2 x DDP 2 with ZeRO-1 (--shard-optimizer) is bitwise the unsharded run,
# and its partial and full checkpoints continue bitwise, sharded or not;
# generation at tp 2 (the KV cache split by heads) writes one process's text
# with logits within 1e-5, and tp 2 x 2 partitions tp 2's bitwise; heads or
# a vocabulary --tp does not divide are errors on every rank; with
# --no-prescaled-batch (each TP rank reads its own sequences, sharded by dp
# rank, joined by smp_step) tp 2 and tp 2 x DDP 2 are bitwise the prescaled
# runs, whose TP ranks read the joined batch. The overhead
# benchmark's plain loop (no smp) gives smp's losses at 1 microbatch,
# bitwise.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
bin="${SMP_EXAMPLES:-$top/build/examples}/gpt" # SMP_EXAMPLES: another build (make test: build/examples-asan)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[ -x "$bin" ] || { echo "FAIL: gpt/binary: $bin is not built (make examples)"; exit 1; }
[ -d /usr/share/games/fortunes ] || { echo "FAIL: gpt/corpus: /usr/share/games/fortunes is missing (make deps installs fortunes)"; exit 1; }
ctx="It was a dark" # --logits: the next-character logits after it
tiny="--layers 2 --dmodel 32 --heads 4 --context 16 --batch 8 --microbatches 4 --steps 8 --warmup 2 --lr 1e-2
      --val-batches 2 --sample-len 24 --print-losses --digest --log-every 1000 --save $tmp/ckpt.safetensors"
# what must match: exact losses, parameter checksums, validation loss, the sample
run() { # out, np, args...
  local out=$1 np=$2; shift 2
  mpirun -n "$np" "$bin" $tiny --logits "$ctx" "$@" >"$tmp/$out.raw" 2>"$tmp/$out.err"
  echo "exit $?" >>"$tmp/$out.raw"
  grep -a -v -e 'tokens/s' -e '^placement:' -e '^gpt:' -e '^checkpoint:' -e '^gradients:' -e '^memory peak' \
    -e '^tensor-parallel collectives' "$tmp/$out.raw" >"$tmp/$out"
}
same() { # name, file a, file b
  if [ -s "$tmp/$2" ] && grep -q '^param ' "$tmp/$2" && grep -q '^logits ' "$tmp/$2" && grep -q 'exit 0' "$tmp/$2" && cmp -s "$tmp/$2" "$tmp/$3"; then echo "PASS: $1"
  else echo "FAIL: $1: $(diff "$tmp/$2" "$tmp/$3" | head -n 4 | tr '\n' ' ') $(head -c 300 "$tmp/$3.err")"; fi
}

# Debian's python3-torch is in Debian's python3, which need not be the first python3 on the PATH.
torch_py=python3
for py in python3 /usr/bin/python3; do
  if "$py" -c 'import torch' 2>/dev/null; then torch_py=$py; break; fi
done
run one 1 --partitions 1 --save "$tmp/one.safetensors" --grads "$tmp/grads.safetensors"
for p in 1 2 4; do
  for pipe in simple interleaved zero_bubble; do
    for rc in "" --recompute; do
      name="p${p}_${pipe}${rc:+_recompute}"
      run "$name" "$p" --partitions "$p" --pipeline "$pipe" $rc
      same "gpt/$p partitions, $pipe pipeline${rc:+, blocks recomputed}: losses, parameters, validation, logits and sample equal one process bitwise" one "$name"
    done
  done
done
for p in 1 2; do
  for rc in "" --recompute; do
    name="p${p}_zbv${rc:+_recompute}"
    run "$name" "$p" --partitions "$p" --pipeline zero_bubble_v $rc
    same "gpt/$p partitions, zero_bubble_v pipeline (2 stages each, in a V)${rc:+, blocks recomputed}: losses, parameters, validation and sample equal one process bitwise" one "$name"
  done
done
# 4 partitions in a V are 8 stages: the model's 8 top-level calls with 4 layers
run one_l4 1 --partitions 1 --layers 4
run p4_zbv 4 --partitions 4 --layers 4 --pipeline zero_bubble_v
same "gpt/4 partitions, zero_bubble_v pipeline (8 stages, one call each), 4 layers: equal one process bitwise" one_l4 p4_zbv
run virt 2 --partitions 2 --config '{"virtual_stages": 2}'
same "gpt/2 partitions x 2 virtual stages (interleaved 1F1B) equal one process bitwise" one virt

# dropout: the masks come from smp_call_seed, the same in any partitioning and in a recomputation
run drop1 1 --partitions 1 --dropout 0.1
run drop2 2 --partitions 2 --dropout 0.1 --recompute
run drop4 4 --partitions 4 --dropout 0.1 --pipeline simple
same "gpt/dropout 0.1: 2 partitions with recomputed blocks equal one process bitwise" drop1 drop2
same "gpt/dropout 0.1: 4 partitions equal one process bitwise" drop1 drop4
if ! cmp -s "$tmp/one" "$tmp/drop1"; then echo "PASS: gpt/dropout changes the run"; else echo "FAIL: gpt/dropout changes the run: same output as without"; fi

# data parallelism with deterministic reduction
run rep2 1 --partitions 1 --replicas 2
run dp2x2 4 --partitions 2 --ddp --deterministic
run dp1x2 2 --partitions 1 --ddp --deterministic
run dp2x2v 4 --partitions 2 --ddp --deterministic --pipeline zero_bubble_v
same "gpt/DDP 2x2 (deterministic) equals one process running both replicas' shards, bitwise" rep2 dp2x2
same "gpt/DDP 2x2 (deterministic), zero_bubble_v: equals one process running both replicas' shards, bitwise" rep2 dp2x2v
same "gpt/DDP 2x2 equals 2 replicas in one stage, bitwise" dp1x2 dp2x2
# --shard-optimizer: each replica keeps AdamW's moments for its owned range only; bitwise the unsharded run, and
# about half the optimizer state per rank in the memory account's peaks ("memory peak rank R")
run dp1x2_sh 2 --partitions 1 --ddp --deterministic --shard-optimizer
run dp2x2_sh 4 --partitions 2 --ddp --deterministic --shard-optimizer
same "gpt/--shard-optimizer: 2 replicas in one stage equal the unsharded run, bitwise" dp1x2 dp1x2_sh
same "gpt/--shard-optimizer: 2 partitions x 2 replicas equal the unsharded run, bitwise" dp2x2 dp2x2_sh
for pair in "dp1x2 dp1x2_sh 2 replicas" "dp2x2 dp2x2_sh 2 partitions x 2 replicas"; do
  read -r a b what <<<"$pair"
  name="gpt/--shard-optimizer: optimizer-state peak per parameter byte 0.45..0.55 of unsharded ($what)"
  if msg=$(python3 "$top/test/memory_peaks.py" "$tmp/$a.raw" "$tmp/$b.raw" optimizer/parameters 0.45 0.55 2>&1); then
    echo "PASS: $name: $msg"
  else echo "FAIL: $name: $(echo "$msg" | tail -n 1)"; fi
done
# with dropout each replica draws its own masks: the seed mixes in the
# sample's position (dp rank x microbatches + microbatch), so DDP 2x2 with
# one microbatch per replica draws the masks of one process running the
# global batch in 2 microbatches. (--replicas is no reference here: in one
# process every replica would draw dp rank 0's masks.) gpt.c adds each
# row's part of a gradient into it in turn, so the replicas' sum rounds
# otherwise than one process's: the first step's loss bitwise, the later
# ones within 1e-6 (1e-8 seen); masks alike across replicas miss at step 0.
run dropdp 4 --partitions 2 --ddp --deterministic --microbatches 1 --dropout 0.1
run drop_mb2 1 --partitions 1 --microbatches 2 --dropout 0.1
dropdp_name="gpt/dropout, DDP 2x2 (deterministic): each replica draws the masks of its samples, as one process running"
dropdp_name="$dropdp_name the global batch (step 0 bitwise, steps 1-7 within 1e-6)"
if python3 - "$tmp/dropdp" "$tmp/drop_mb2" 2>"$tmp/dropdp.check" <<'PY'
import sys
def losses(p):
    lines = open(p, errors='replace').read().splitlines()
    assert 'exit 0' in lines, (p, lines[-3:])
    return [float.fromhex(l.split()[3]) for l in lines if l.startswith('step ')]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert len(a) == len(b) == 8, (len(a), len(b))
assert a[0] == b[0], ("step 0", a[0].hex(), b[0].hex())
worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
assert worst < 1e-6, worst
PY
then echo "PASS: $dropdp_name"
else echo "FAIL: $dropdp_name: $(tail -n 1 "$tmp/dropdp.check") $(head -c 300 "$tmp/dropdp.err")"; fi

# tensor parallelism (--tp 2, Megatron's layout: c_attn column-parallel by heads, c_proj row-parallel, c_fc
# column-parallel, the MLP's c_proj row-parallel, wte vocabulary-parallel and tied, the cross-entropy
# vocabulary-parallel). At a fixed tp = 2: 2 partitions (4 ranks), every schedule, recomputed blocks, and DDP
# 2 x 2 (deterministic) against the two replicas in one TP group (--replicas 2): bitwise, as at tp 1.
run tp2 2 --partitions 1 --tp 2 --save "$tmp/tp2.safetensors"
for pipe in simple interleaved zero_bubble zero_bubble_v; do
  run "tp2_p2_$pipe" 4 --partitions 2 --tp 2 --pipeline "$pipe" --save ""
  same "gpt/tp 2, 2 partitions, $pipe pipeline: losses, parameters, validation, logits, sample bitwise as 1 partition" \
    tp2 "tp2_p2_$pipe"
done
run tp2_rc 2 --partitions 1 --tp 2 --recompute --save ""
same "gpt/tp 2, blocks recomputed (their TP collectives run again): equal tp 2 bitwise" tp2 tp2_rc
run tp2_rep2 2 --partitions 1 --tp 2 --replicas 2 --save ""
run tp2_dp2 4 --partitions 1 --tp 2 --ddp --deterministic --save ""
same "gpt/tp 2 x DDP 2 (deterministic) equals one TP group running both replicas' shards, bitwise" tp2_rep2 tp2_dp2
# prescaled_batch false (--no-prescaled-batch): each rank of a TP group reads its own sequences of the global batch
# (sharded by dp rank: 4 of the 8 at tp 2, 2 at tp 2 x DDP 2) and smp_step joins the group's in tp-rank order into
# the batch every rank of it reads in the prescaled runs (8, and 4 per replica): the same run, bitwise
run tp2_own 2 --partitions 1 --tp 2 --no-prescaled-batch --save ""
same "gpt/tp 2, --no-prescaled-batch: each TP rank's 4 sequences joined by smp_step are the prescaled run of 8, bitwise" \
  tp2 tp2_own
run tp2_dp2_own 4 --partitions 1 --tp 2 --ddp --deterministic --no-prescaled-batch --save ""
same "gpt/tp 2 x DDP 2, --no-prescaled-batch: each TP rank's 2 sequences joined are the prescaled run's 4, bitwise" \
  tp2_dp2 tp2_dp2_own
# ... with ZeRO-1 (--shard-optimizer: each replica of a TP rank keeps and updates half of its slice's AdamW
# state): bitwise the unsharded run. Its checkpoints after step 4 (--save-at), partial (a file per TP slice and
# replica) and full, continue bitwise: loaded sharded at tp 2 x DDP 2, and unsharded into one TP group running
# both replicas (--replicas 2).
run tp2_dp2z 4 --partitions 1 --tp 2 --ddp --deterministic --shard-optimizer --save-at 4 --partial --save "$tmp/zp"
same "gpt/tp 2 x DDP 2 with sharded optimizer state (ZeRO-1, deterministic) equals the unsharded run bitwise" tp2_dp2 tp2_dp2z
run tp2_dp2zf 4 --partitions 1 --tp 2 --ddp --deterministic --shard-optimizer --save-at 4 --save "$tmp/zf.safetensors"
grep -a -v '^step [0-3] loss' "$tmp/tp2_dp2" >"$tmp/tp2_dp2_from4"
run res_zp 4 --partitions 1 --tp 2 --ddp --deterministic --shard-optimizer --partial --load "$tmp/zp" --save ""
same "gpt/tp 2 x DDP 2 ZeRO-1: its partial checkpoint loaded sharded continues bitwise" tp2_dp2_from4 res_zp
run res_zf 4 --partitions 1 --tp 2 --ddp --deterministic --shard-optimizer --load "$tmp/zf.safetensors" --save ""
same "gpt/tp 2 x DDP 2 ZeRO-1: its full checkpoint loaded sharded continues bitwise" tp2_dp2_from4 res_zf
run res_zp_rep 2 --partitions 1 --tp 2 --replicas 2 --partial --load "$tmp/zp" --save ""
same "gpt/tp 2 x DDP 2 ZeRO-1: its partial checkpoint loaded unsharded (one TP group, --replicas 2) continues bitwise" \
  tp2_dp2_from4 res_zp_rep
run res_zf_rep 2 --partitions 1 --tp 2 --replicas 2 --load "$tmp/zf.safetensors" --save ""
same "gpt/tp 2 x DDP 2 ZeRO-1: its full checkpoint loaded unsharded (one TP group, --replicas 2) continues bitwise" \
  tp2_dp2_from4 res_zf_rep
# Across tp: 20 steps at tp 2 (2 ranks) and tp 2 x pp 2 (4 ranks) against tp 1: every loss within 1e-5
# relative, every parameter within 1e-5 of its largest entry (--params: the whole tensors). Float32 sums
# the same terms in another order (the MLP's and attention's output over two halves, the softmax's sums
# over two halves of the vocabulary): measured 3e-7 (losses) and 7e-6 (parameters). At --lr 1e-3: at 1e-2
# this tiny model's AdamW turns rounding into chaos within 10 steps. The key bias (c_attn.bias[C:2C]) is
# left out: its gradient is 0 in exact arithmetic (softmax ignores a constant added to a row of scores),
# AdamW scales float32's leftover ~1e-12 up to steps of ~1e-7, so it holds noise; both runs must keep it
# below 1e-4.
long=(--steps 20 --lr 1e-3 --sample-len 0 --save "")
# tp_close NAME REF RUN: the losses RUN printed within 1e-5 relative of REF's at the same steps (RUN may
# start later: a run resumed from a checkpoint), and its --params file (RUN.st) within 1e-5 of each of
# REF.st's tensors' largest entry; the key bias as above
tp_close() {
  if PYTHONPATH="$top/test" python3 - "$tmp/$2" "$tmp/$3" "$tmp/$2.st" "$tmp/$3.st" >"$tmp/tp.check" 2>&1 <<'PY'
import sys
import numpy as np
from safetensors_common import read_numpy
def losses(p):
    lines = open(p, errors='replace').read().splitlines()
    assert 'exit 0' in lines, (p, lines[-3:])
    return {int(l.split()[1]): float.fromhex(l.split()[3]) for l in lines if l.startswith('step ') and ' loss 0x' in l}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert b and set(b) <= set(a) and max(a) == max(b), (sorted(a), sorted(b))
loss = max(abs(a[s] - b[s]) / abs(a[s]) for s in b)
pa, pb = read_numpy(sys.argv[3])[0], read_numpy(sys.argv[4])[0]
assert pa.keys() == pb.keys() and len(pa) == 28, (sorted(pa), sorted(pb))
worst, key = (0.0, ''), 0.0
for k in pa:
    x, y = pa[k], pb[k]
    assert x.shape == y.shape, (k, x.shape, y.shape)
    if k.endswith('attn.c_attn.bias'):
        C = x.shape[0] // 3
        key = max(key, float(abs(x[C:2 * C]).max()), float(abs(y[C:2 * C]).max()))
        x, y = np.concatenate([x[:C], x[2 * C:]]), np.concatenate([y[:C], y[2 * C:]])
    worst = max(worst, (float(abs(x - y).max() / abs(x).max()), k))
print(f"{len(b)} losses {loss:.1e}, parameters {worst[0]:.1e} ({worst[1]}), key biases within {key:.0e} of 0")
assert loss <= 1e-5 and worst[0] <= 1e-5 and key < 1e-4
PY
  then echo "PASS: $1 ($(tail -n 1 "$tmp/tp.check"))"
  else echo "FAIL: $1: $(tail -n 2 "$tmp/tp.check" | tr '\n' ' ') $(head -c 300 "$tmp/$3.err")"; fi
}
# (tp_ref and tp_2x2 also save a checkpoint after step 10 for the resuming checks below)
run tp_ref 1 --partitions 1 "${long[@]}" --params "$tmp/tp_ref.st" --save-at 10 --save "$tmp/ck_1.safetensors"
run tp_2 2 --partitions 1 --tp 2 "${long[@]}" --params "$tmp/tp_2.st"
run tp_2x2 4 --partitions 2 --tp 2 "${long[@]}" --params "$tmp/tp_2x2.st" --save-at 10 --save "$tmp/ck_22.safetensors"
for t in tp_2 tp_2x2; do
  what=$([ "$t" = tp_2 ] && echo "tp 2" || echo "tp 2 x 2 partitions")
  tp_close "gpt/$what against tp 1 after 20 steps: losses within 1e-5 relative, parameters within 1e-5 of each tensor's largest entry" tp_ref "$t"
done

# Checkpoints at tp > 1: c_attn is [3C, C] at every tp (its q, k and v blocks each split by heads,
# smp_param_new_sharded_blocks), so a full checkpoint of tp 2 is nanoGPT's file: it loads strictly into
# the numpy and PyTorch GPTs, whose validation loss and logits match the tp 2 run's.
python3 "$top/test/gpt_ref.py" "$tmp/tp2.safetensors" /usr/share/games/fortunes \
  "$(sed -n 's/^validation \(0x[^ ]*\)$/\1/p' "$tmp/tp2")" 2 8 "tp 2"
"$torch_py" "$top/test/gpt_torch_check.py" --label "tp 2" "$tmp/tp2.safetensors" /usr/share/games/fortunes "$tmp/tp2" 2 8 "$ctx" \
  || { rc=$?; [ $rc -eq 3 ] || echo "FAIL: gpt/torch (tp 2): gpt_torch_check.py exited with status $rc"; }
# Resuming: a run that never stops saves after step 4 with AdamW's state (--save-at; tp 2 x 2 partitions
# on 4 ranks), which changes nothing of it; loaded at tp 2 (one partition) its checkpoint continues bitwise
# as the tp 2 run that never stopped (steps 0-3, which the resumed run skips, left out). Across tp, on
# the 20-step runs above (at --lr 1e-2 float32's reordered sums alone part tp 1 and tp 2 by 4e-5 within
# 8 steps), saved after step 10: tp 2 x 2's checkpoint loaded at tp 1 continues within 1e-5 of tp 1's
# run, tp 1's loaded at tp 2 within 1e-5 of tp 2 x 2's (tp_close, steps 10-19 and the parameters).
run ck_22 4 --partitions 2 --tp 2 --save-at 4 --save "$tmp/ck_22_4.safetensors"
same "gpt/--save-at 4 (AdamW's state saved after step 4) at tp 2 x 2 partitions changes nothing of the run" tp2 ck_22
grep -a -v '^step [0-3] loss' "$tmp/tp2" >"$tmp/tp2_from4"
run res_22_2 2 --partitions 1 --tp 2 --load "$tmp/ck_22_4.safetensors" --save ""
same "gpt/a tp 2 x 2 partitions checkpoint loaded at tp 2 continues bitwise as the run that never stopped" tp2_from4 res_22_2
# the log's loss average is the run's own steps' (test/gpt_log_avg.py), the resumed one's from step 5 and saying so
for r in tp2 res_22_2; do
  if msg=$(python3 "$top/test/gpt_log_avg.py" "$tmp/$r.raw" 2>&1); then echo "PASS: gpt/the log's loss average ($r): $msg"
  else echo "FAIL: gpt/the log's loss average ($r): $(echo "$msg" | tail -n 1)"; fi
done
run res_22_1 1 --partitions 1 "${long[@]}" --load "$tmp/ck_22.safetensors" --params "$tmp/res_22_1.st"
tp_close "gpt/a tp 2 x 2 partitions checkpoint loaded at tp 1 continues as tp 1's run (steps 10-19 within 1e-5)" tp_ref res_22_1
run res_1_2 2 --partitions 1 --tp 2 "${long[@]}" --load "$tmp/ck_1.safetensors" --params "$tmp/res_1_2.st"
tp_close "gpt/a tp 1 checkpoint loaded at tp 2 continues as tp 2's run (steps 10-19 within 1e-5)" tp_2x2 res_1_2

# training works: the loss falls well within a few steps
if python3 - "$tmp/one" <<'PY'
import sys
loss = [float.fromhex(l.split()[3]) for l in open(sys.argv[1], errors='replace') if l.startswith('step ')]
assert len(loss) == 8, loss
assert loss[-1] < loss[0] - 0.5, (loss[0], loss[-1])
val = [l for l in open(sys.argv[1], errors='replace') if l.startswith('validation loss: ')]
assert val and float(val[0].split()[2]) < loss[0] - 0.5, val
PY
then echo "PASS: gpt/the loss falls (first step $(sed -n 's/^step 0 loss //p' "$tmp/one" | python3 -c 'print(round(float.fromhex(input()), 3))'), then $(sed -n 's/^validation loss: \([0-9.]*\).*/\1/p' "$tmp/one") on validation text)"
else echo "FAIL: gpt/the loss falls: $(grep '^step\|^validation loss' "$tmp/one" | tr '\n' ' ')"; fi
# the checkpoint in an independent forward pass (numpy, float64, nanoGPT's layout and strict names)
python3 "$top/test/gpt_ref.py" "$tmp/one.safetensors" /usr/share/games/fortunes "$(sed -n 's/^validation \(0x[^ ]*\)$/\1/p' "$tmp/one")" 2 8
# ... and in PyTorch (float64): strict load, validation loss, logits, the first step's loss and gradients.
"$torch_py" "$top/test/gpt_torch_check.py" "$tmp/one.safetensors" /usr/share/games/fortunes "$tmp/one" 2 8 "$ctx" "$tmp/grads.safetensors" \
  || { rc=$?; [ $rc -eq 3 ] || echo "FAIL: gpt/torch: gpt_torch_check.py exited with status $rc"; } # 3: it reported a FAIL
# ... and the first step's gradients at tp 2 (whole tensors gathered from the shards, c_attn as [3C, C])
mpirun -n 2 "$bin" $tiny --partitions 1 --tp 2 --steps 1 --val-batches 0 --sample-len 0 --save "" \
  --grads "$tmp/grads_tp2.safetensors" >"$tmp/grads_tp2.out" 2>&1 \
  || echo "FAIL: gpt/torch (tp 2): --grads at tp 2: $(tail -c 300 "$tmp/grads_tp2.out")"
"$torch_py" "$top/test/gpt_torch_check.py" --grads-only "$tmp/grads_tp2.safetensors" "tp 2" \
  || { rc=$?; [ $rc -eq 3 ] || echo "FAIL: gpt/torch (tp 2): gpt_torch_check.py exited with status $rc"; }
# the first step's gradients gathered from 2 partitions (the tied weight's summed over both copies): the same file
mpirun -n 2 "$bin" $tiny --partitions 2 --steps 1 --val-batches 0 --sample-len 0 --save "" --grads "$tmp/grads2.safetensors" \
  >"$tmp/grads2.out" 2>&1
if cmp -s "$tmp/grads.safetensors" "$tmp/grads2.safetensors"; then echo "PASS: gpt/--grads at 2 partitions writes the file of one process, byte for byte"
else echo "FAIL: gpt/--grads at 2 partitions writes the file of one process, byte for byte: $(tail -c 300 "$tmp/grads2.out")"; fi

# bad input
expect_error() { # name, pattern, np, args...
  local name=$1 pat=$2 np=$3; shift 3
  mpirun -n "$np" "$bin" $tiny "$@" >"$tmp/out" 2>&1; local rc=$?
  local n; n=$(grep -c -- "$pat" "$tmp/out")
  if [ $rc -ne 0 ] && [ "$n" -ge "$np" ] && ! grep -q 'runtime error: ' "$tmp/out"; then echo "PASS: $name"
  else echo "FAIL: $name: exit $rc, $n of $np ranks said '$pat': $(head -c 300 "$tmp/out")"; fi
}
expect_error "gpt/a missing corpus folder is an error on every rank" "$tmp/none: cannot open" 2 --partitions 2 --data "$tmp/none"
expect_error "gpt/a prompt character outside the vocabulary is an error on every rank" "not in the vocabulary" 2 --partitions 2 --prompt "$(printf 'A\001')"
expect_error "gpt/a batch that does not divide into microbatches" "does not divide into 3 microbatches" 2 --partitions 2 --microbatches 3
expect_error "gpt/--tp 2 with 3 heads names the fix on every rank" \
  "3 heads do not split over tensor_parallel_degree = 2: make --heads a multiple of 2" \
  2 --partitions 1 --tp 2 --dmodel 36 --heads 3 --save ""
expect_error "gpt/--tp 4 with a vocabulary of 114 names the fix on every rank" \
  "the vocabulary of 114 does not split over tensor_parallel_degree = 4" 4 --partitions 1 --tp 4 --save ""
expect_error "gpt/--save-at at or after the last step names the fix on every rank" \
  "give --save PATH and --save-at 1 to 7" 2 --partitions 1 --tp 2 --save-at 8

# pipelined generation (--generate): a checkpoint of a tiny model trained a little longer, loaded into 1, 2 and 4
# partitions, 4 prompts of different lengths (one per microbatch), an evaluation step per character
mpirun -n 1 "$bin" --partitions 1 --layers 2 --dmodel 32 --heads 4 --context 32 --batch 16 --microbatches 1 --steps 200 \
  --warmup 10 --lr 1e-2 --val-batches 0 --sample-len 0 --log-every 1000 --save "$tmp/gen.safetensors" >"$tmp/gen_train" 2>&1 \
  || echo "FAIL: gpt/generation: training its checkpoint: $(tail -c 300 "$tmp/gen_train")"
gen() { # out, np, args...: $out has the text and every step's logits (--print-logits), $out.text the text alone
  local out=$1 np=$2; shift 2
  mpirun -n "$np" "$bin" --generate --load "$tmp/gen.safetensors" --prompts "The|A m|Why |I" --tokens 24 --print-logits "$@" \
    >"$tmp/$out.raw" 2>"$tmp/$out.err"
  echo "exit $?" >>"$tmp/$out.raw"
  grep -a -v -e '^gpt:' -e '^placement:' -e '^generated ' "$tmp/$out.raw" >"$tmp/$out"
  grep -a -v '^logits ' "$tmp/$out" >"$tmp/$out.text"
}
gen_same() { # name, file a, file b
  if grep -q '^--- prompt 3:' "$tmp/$2" && grep -q 'exit 0' "$tmp/$2" && cmp -s "$tmp/$2" "$tmp/$3"; then echo "PASS: $1"
  else echo "FAIL: $1: $(diff "$tmp/$2" "$tmp/$3" | head -n 6 | cut -c 1-200 | tr '\n' ' ') $(head -c 300 "$tmp/${3%.text}.err")"; fi
}
# Every step's logits of the KV cache (file b) against re-running the whole context (file a): the same
# steps and prompts, each logit within 1e-5 of max(1, |logit|). Float32 rounds to u = 6e-8; the two runs
# sum the same products in other orders (attention over up to 32 positions, linear layers over up to
# 4C = 128 inputs, two blocks): as a random walk about sqrt(128) * 10 * u = 7e-6; measured: 7e-7. A
# wrong position, a stale or missing cache entry moves logits by 0.1 and more.
gen_close() { # name, file a, file b
  if python3 - "$tmp/$2" "$tmp/$3" >"$tmp/close" 2>&1 <<'PY'
import sys
def logits(path):
    return {tuple(l.split()[1:3]): [float.fromhex(v) for v in l.split()[3:]] for l in open(path, errors='replace') if l.startswith('logits ')}
a, b = logits(sys.argv[1]), logits(sys.argv[2])
assert a and a.keys() == b.keys(), (len(a), len(b))
worst = max(abs(x - y) / max(1.0, abs(x)) for k in a for x, y in zip(a[k], b[k], strict=True))
same = sum(a[k] == b[k] for k in a)
print(f"{len(a)} steps x prompts, largest difference {worst:.1e} of max(1, |logit|), {same} bitwise equal")
assert worst <= 1e-5, worst
PY
  then echo "PASS: $1 ($(cat "$tmp/close"))"
  else echo "FAIL: $1: $(tail -c 300 "$tmp/close")"; fi
}
for temp in 0 0.8; do
  what=$([ "$temp" = 0 ] && echo greedy || echo "sampled at temperature $temp, seed 3")
  gen "g1_$temp" 1 --partitions 1 --temperature "$temp" --seed 3
  gen "g2_$temp" 2 --partitions 2 --temperature "$temp" --seed 3
  gen "g4_$temp" 4 --partitions 4 --pipeline simple --temperature "$temp" --seed 3
  gen "v2_$temp" 2 --partitions 2 --pipeline zero_bubble_v --temperature "$temp" --seed 3
  gen "n1_$temp" 1 --partitions 1 --temperature "$temp" --seed 3 --no-cache
  gen "n2_$temp" 2 --partitions 2 --temperature "$temp" --seed 3 --no-cache
  gen_same "gpt/generation ($what): 2 partitions with the KV cache write the text and logits of one process, bitwise" "g1_$temp" "g2_$temp"
  gen_same "gpt/generation ($what): 4 partitions with the KV cache write the text and logits of one process, bitwise" "g1_$temp" "g4_$temp"
  gen_same "gpt/generation ($what): 2 partitions in a V (zero_bubble_v) write the text and logits of one process, bitwise" "g1_$temp" "v2_$temp"
  gen_same "gpt/generation ($what): re-running the whole context, 2 partitions write the text and logits of one process, bitwise" "n1_$temp" "n2_$temp"
  gen_same "gpt/generation ($what): the KV cache writes the text of re-running the whole context, one process" "n1_$temp.text" "g1_$temp.text"
  gen_same "gpt/generation ($what): the KV cache writes the text of re-running the whole context, 2 partitions" "n2_$temp.text" "g2_$temp.text"
  gen_close "gpt/generation ($what): the KV cache's logits equal re-running the whole context's within 1e-5" "n1_$temp" "g1_$temp"
  # tensor parallelism: each TP rank caches its heads' keys and values, the head's V / tp logits are joined
  gen "t2_$temp" 2 --partitions 1 --tp 2 --temperature "$temp" --seed 3
  gen "t22_$temp" 4 --partitions 2 --tp 2 --pipeline simple --temperature "$temp" --seed 3
  gen "nt2_$temp" 2 --partitions 1 --tp 2 --temperature "$temp" --seed 3 --no-cache
  gen_same "gpt/generation ($what): tp 2 (KV cache split by heads) writes the text of one process" "g1_$temp.text" "t2_$temp.text"
  gen_close "gpt/generation ($what): tp 2's logits equal one process's within 1e-5" "g1_$temp" "t2_$temp"
  gen_same "gpt/generation ($what): tp 2 x 2 partitions write the text and logits of tp 2, bitwise" "t2_$temp" "t22_$temp"
  gen_same "gpt/generation ($what): at tp 2 the KV cache writes the text of re-running the whole context" "nt2_$temp.text" "t2_$temp.text"
  gen_close "gpt/generation ($what): at tp 2 the KV cache's logits equal re-running the whole context's within 1e-5" "nt2_$temp" "t2_$temp"
done
if grep -q '^--- prompt 3:' "$tmp/g1_0.8" && ! cmp -s "$tmp/g1_0" "$tmp/g1_0.8" && [ "$(grep -c '^--- prompt' "$tmp/g1_0.8")" = 4 ] \
   && [ "$(grep -a -A1 '^--- prompt 0:' "$tmp/g1_0.8" | tail -n 1 | head -c 3)" = "The" ]; then
  echo "PASS: gpt/generation: 4 prompts continued; sampling differs from greedy"
else echo "FAIL: gpt/generation: 4 prompts continued; sampling differs from greedy: $(head -c 300 "$tmp/g1_0.8")"; fi
gen_err() { # name, pattern, np, args...
  local name=$1 pat=$2 np=$3; shift 3
  mpirun -n "$np" "$bin" --generate --load "$tmp/gen.safetensors" "$@" >"$tmp/out" 2>&1; local rc=$?
  local n; n=$(grep -c -- "$pat" "$tmp/out")
  if [ $rc -ne 0 ] && [ "$n" -ge "$np" ] && ! grep -q 'runtime error: ' "$tmp/out"; then echo "PASS: $name"
  else echo "FAIL: $name: exit $rc, $n of $np ranks said '$pat': $(head -c 300 "$tmp/out")"; fi
}
gen_err "gpt/generation: prompt + tokens longer than the model's context is an error on every rank" \
  "prompt 1: a context of 33 characters (4 of prompt + 29 tokens) is longer than the model's 32" 2 --partitions 2 --prompts "The|Why |I" --tokens 29
gen_err "gpt/generation: data parallelism is refused on every rank" \
  "--generate runs without data parallelism: run as many processes as --partitions x --tp" 4 --partitions 1 --tp 2 --ddp \
  --prompts "The|A" --tokens 4
gen_err "gpt/generation: --tp 3 with 4 heads names the fix on every rank" \
  "4 heads do not split over tensor_parallel_degree = 3" 3 --partitions 1 --tp 3 --prompts "The|A" --tokens 4
gen_err "gpt/generation: a prompt character outside the vocabulary is an error on every rank" \
  "not in the vocabulary" 2 --partitions 2 --prompts "$(printf 'The|A\001')" --tokens 4

# the overhead benchmark's plain loop (bench/gpt_overhead.c: gpt_model.h's kernels in order, no smp) and the same
# model through smp at 1 microbatch: the same losses, bit for bit, over 3 steps of AdamW
over="$(dirname "$bin")/gpt_overhead"
mpirun -n 1 "$over" --check --layers 2 --dmodel 32 --heads 4 --context 16 --batch 8 >"$tmp/over" 2>&1; over_rc=$?
if [ $over_rc -eq 0 ] && grep -q ': bitwise equal$' "$tmp/over" && ! grep -q 'runtime error: ' "$tmp/over"; then
  echo "PASS: gpt/overhead benchmark: the plain loop's losses equal smp's at 1 microbatch, bitwise"
else echo "FAIL: gpt/overhead benchmark: the plain loop's losses equal smp's at 1 microbatch, bitwise: exit $over_rc: $(head -c 300 "$tmp/over")"; fi
