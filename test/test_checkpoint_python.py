#!/usr/bin/env python3
"""Checks that Python's safetensors reads a full model checkpoint written by
smp_save (smp_checkpoint.h) and that its values equal the model's.

Run by test_checkpoint.c as
    python3 test_checkpoint_python.py CHECKPOINT EXPECTED_DIR PARTITIONS
and by test_ckpt_tp.c, for a checkpoint its model saved at
tensor_parallel_degree TP (the expected tensors are whole: the checkpoint
must hold each with its full shape, not a rank's slice), as
    python3 test_checkpoint_python.py CHECKPOINT EXPECTED_DIR PARTITIONS TP
after it saved CHECKPOINT (partial = SMP_OFF) and every saving rank dumped
its tensors' raw bytes into EXPECTED_DIR/<name>.bin, listed in
EXPECTED_DIR/manifest_<rank>.txt as lines "name DTYPE ndim dim...".

Prints PASS/FAIL/SKIP lines like test.h. Exit status: 0 all passed (or
skipped), 3 some check failed; anything else is a crash.
"""
import glob
import os
import sys

from safetensors_common import SIZES, check, exit_status


def main():
    if len(sys.argv) not in (4, 5):
        print("usage: test_checkpoint_python.py CHECKPOINT EXPECTED_DIR PARTITIONS [TP]", file=sys.stderr)
        return 2
    path, edir, parts = sys.argv[1], sys.argv[2], sys.argv[3]
    tp = sys.argv[4] if len(sys.argv) == 5 else None
    label = f"ckpt_tp/python tp={tp}" if tp else "checkpoint/python"
    try:
        import numpy as np
        from safetensors import safe_open
        from safetensors.numpy import load_file
    except ImportError as e:
        print(f"SKIP: {label}: {e} (pip install safetensors numpy)")
        return 0

    expected = {}
    for man in sorted(glob.glob(os.path.join(edir, "manifest_*.txt"))):
        with open(man) as fh:
            for line in fh:
                f = line.split()
                name, dtype, ndim = f[0], f[1], int(f[2])
                shape = [int(x) for x in f[3:3 + ndim]]
                with open(os.path.join(edir, name + ".bin"), "rb") as b:
                    expected[name] = (dtype, shape, b.read())

    try:
        tensors = load_file(path)
    except Exception as e:  # noqa: BLE001 - report, do not crash
        check(False, f"{label}: safetensors.numpy.load_file opens the full checkpoint", repr(e))
        return 3
    check(True, f"{label}: safetensors.numpy.load_file opens the full checkpoint")

    names_ok = set(tensors) == set(expected)
    check(names_ok, f"{label}: the file holds exactly the model's tensors and optimizer state",
          f"only in file {sorted(set(tensors) - set(expected))}, only in model {sorted(set(expected) - set(tensors))}")
    bad = []
    for name, (dtype, shape, raw) in expected.items():
        a = tensors.get(name)
        if a is None:
            continue
        if list(a.shape) != shape or a.dtype.itemsize != SIZES[dtype] or a.tobytes() != raw:
            bad.append(f"{name}: {a.dtype}{list(a.shape)} vs {dtype}{shape}")
    check(not bad and len(expected) > 0, f"{label}: every tensor equals the model's, bitwise", "; ".join(bad[:5]))
    if tp:
        with safe_open(path, framework="np") as f:
            meta = f.metadata() or {}
        check(meta.get("smp.kind") == "full" and meta.get("smp.partitions") == parts
              and all(list(tensors[n].shape) == shape for n, (_, shape, _) in expected.items() if n in tensors),
              f"{label}: a full checkpoint saved at tp={tp}: every tensor with its full shape, partitions {parts}",
              repr({k: v for k, v in meta.items() if k in ("smp.kind", "smp.partitions")}))
        return exit_status()
    w = tensors.get("fc0.weight")
    check(w is not None and w.dtype == np.float32 and w.shape == (6, 5),
          f"{label}: fc0.weight reads as float32 (6, 5), ready for torch's load_state_dict names",
          repr(None if w is None else (w.dtype, w.shape)))

    with safe_open(path, framework="np") as f:
        meta = f.metadata() or {}
    check(meta.get("epoch") == "3" and meta.get("step") == "1200" and meta.get("smp.kind") == "full"
          and meta.get("smp.partitions") == parts and meta.get("smp.partition.head.weight") == str(int(parts) - 1),
          f"{label}: user metadata and smp's partition map read back", repr({k: v for k, v in meta.items()
                                                                                   if not k.startswith("smp.checksum")}))

    # widest dtypes first: every tensor at a multiple of its element size
    import json
    import struct
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    starts = 8 + n
    misaligned = [k for k, v in header.items() if (starts + v["data_offsets"][0]) % SIZES[v["dtype"]]]
    order = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    widths = [SIZES[v["dtype"]] for _, v in order if v["data_offsets"][1] > v["data_offsets"][0]]
    check(not misaligned and widths == sorted(widths, reverse=True),
          f"{label}: tensors ordered widest dtype first, each aligned to its element size",
          f"misaligned {misaligned}, widths in file order {widths}")
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
