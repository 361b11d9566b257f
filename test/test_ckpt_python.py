#!/usr/bin/env python3
"""Checks that Python's safetensors opens files written by smp_checkpoint.h.

Run by test_ckpt_file.c as `python3 test_ckpt_python.py DIR`, after it wrote
into DIR:
  py_numpy.safetensors   t0..t6: F32 F16 F64 I32 I64 U8 BOOL, shape [i+1, 3],
                         bytes from fill(); metadata smp.test, epoch
  py_all.safetensors     the 12 tensors of make_entries(0), every dtype
                         (BF16 included, so read with deserialize: numpy has
                         no bfloat16)
  py_values.safetensors  values.f32 = j*0.5-3 (2x5), values.i64 = j*1000003-7
and it writes DIR/from_python.safetensors with safetensors.numpy.save_file for
the C side to read back.

Prints PASS/FAIL/SKIP lines like test.h. Exit status: 0 all passed (or
skipped), 3 some check failed; anything else is a crash.
"""
import os
import sys

from safetensors_common import SIZES, check, crc32c, exit_status


def fill(n, i, dtype):
    """The bytes test_ckpt_file.c's fill() makes for tensor i."""
    if dtype == "BOOL":
        return bytes(1 if (i + k) % 3 == 0 else 0 for k in range(n))
    return bytes((i * 37 + k * 11 + (k >> 8) * 5 + 1) & 0xFF for k in range(n))


# make_entries() in test_ckpt_file.c, in the same order
ALL = [
    ("layers.0.weight", "F32", [3, 5]),
    ("layers.0.bias", "F16", [7]),
    ("emb.bf16", "BF16", [2, 3, 4]),
    ("f64 scalar", "F64", []),
    ("ints.i32", "I32", [9]),
    ("ints.i64", "I64", [4, 1]),
    ("bytes.u8", "U8", [13]),
    ("mask.bool", "BOOL", [3, 3]),
    ("empty.f32", "F32", [0]),
    ("empty.i64[3,0,2]", "I64", [3, 0, 2]),
    ("quote\"back\\slash/tab\tnewline\n\x01 end", "F32", [2]),
    ("unicod\u00e9.\u2603.\U0001F600", "U8", [3]),
]
ALL_META = {"epoch": "3", "step": "12000", "note \"q\" \\ \n": "multi\nline \"value\"", "\u00fcber": "gr\u00f6\u00dfe"}


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def main():
    if len(sys.argv) != 2:
        print("usage: test_ckpt_python.py DIR", file=sys.stderr)
        return 2
    d = sys.argv[1]
    try:
        import numpy as np
        from safetensors import deserialize, safe_open
        from safetensors.numpy import load_file, save_file
    except ImportError as e:
        print(f"SKIP: python safetensors interop: {e} (pip install safetensors numpy)")
        return 0

    # 1. load_file on the numpy dtypes: values bitwise, metadata
    path = os.path.join(d, "py_numpy.safetensors")
    np_types = ["F32", "F16", "F64", "I32", "I64", "U8", "BOOL"]
    np_dtypes = [np.float32, np.float16, np.float64, np.int32, np.int64, np.uint8, np.bool_]
    try:
        t = load_file(path)
        ok, why = set(t) == {f"t{i}" for i in range(7)}, f"names {sorted(t)}"
        for i, (st, nt) in enumerate(zip(np_types, np_dtypes)):
            a = t.get(f"t{i}")
            if not ok:
                break
            if a.dtype != nt or a.shape != (i + 1, 3):
                ok, why = False, f"t{i}: {a.dtype} {a.shape}"
            elif a.tobytes() != fill((i + 1) * 3 * SIZES[st], i, st):
                ok, why = False, f"t{i}: bytes differ"
        check(ok, "python: safetensors.numpy.load_file opens an smp file, every numpy dtype bitwise", why)
        with safe_open(path, framework="np") as f:
            meta = f.metadata()
        check(meta.get("smp.test") == "python interop" and meta.get("epoch") == "7",
              "python: metadata of an smp file reads back", repr(meta))
    except Exception as e:  # noqa: BLE001 - report, do not crash
        check(False, "python: safetensors.numpy.load_file opens an smp file", repr(e))

    # 2. every dtype (BF16 too) through deserialize, which validates the file
    path = os.path.join(d, "py_all.safetensors")
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        got = dict(deserialize(raw))
        ok, why = set(got) == {n for n, _, _ in ALL}, f"names {sorted(got)}"
        for i, (name, dt, shape) in enumerate(ALL):
            if not ok:
                break
            g = got[name]
            want = fill(numel(shape) * SIZES[dt], i, dt)
            if g["dtype"] != dt or list(g["shape"]) != shape or bytes(g["data"]) != want:
                ok, why = False, f"{name!r}: {g['dtype']} {g['shape']} or bytes differ"
        check(ok, "python: safetensors.deserialize reads every dtype incl. BF16, escaped names", why)
        with safe_open(path, framework="np") as f:
            meta = f.metadata()
        ok = all(meta.get(k) == v for k, v in ALL_META.items())
        check(ok, "python: escaped and non-ASCII metadata reads back", repr(meta))
        ok, why = True, ""
        for i, (name, dt, shape) in enumerate(ALL):
            want = "crc32c:%08x" % crc32c(fill(numel(shape) * SIZES[dt], i, dt))
            if meta.get("smp.checksum." + name) != want:
                ok, why = False, f"{name!r}: {meta.get('smp.checksum.' + name)} != {want}"
                break
        check(ok, "python: smp.checksum.* metadata equals an independent CRC-32C", why)
        hlen = int.from_bytes(raw[:8], "little")
        check(hlen % 8 == 0 and raw[8:9] == b"{", "python: header padded to 8 bytes", f"length {hlen}")
    except Exception as e:  # noqa: BLE001
        check(False, "python: safetensors.deserialize reads an smp file", repr(e))

    # 3. values with meaning
    path = os.path.join(d, "py_values.safetensors")
    try:
        t = load_file(path)
        f32 = (np.arange(10, dtype=np.float32) * np.float32(0.5) - np.float32(3)).reshape(2, 5)
        i64 = np.arange(6, dtype=np.int64) * 1000003 - 7
        check(np.array_equal(t["values.f32"], f32) and t["values.f32"].dtype == np.float32,
              "python: f32 values equal j*0.5-3", repr(t["values.f32"]))
        check(np.array_equal(t["values.i64"], i64) and t["values.i64"].dtype == np.int64,
              "python: i64 values equal j*1000003-7", repr(t["values.i64"]))
    except Exception as e:  # noqa: BLE001
        check(False, "python: values of an smp file", repr(e))

    # 4. a file for the C side to read
    try:
        save_file({
            "py.f32": (np.arange(12, dtype=np.float32) * np.float32(0.25)).reshape(3, 4),
            "py.i64": np.array([-5, 0, 7, 1 << 40], dtype=np.int64),
            "py.bool": np.array([True, False, True]),
            "py.empty": np.zeros((0, 3), dtype=np.float32),
        }, os.path.join(d, "from_python.safetensors"), metadata={"framework": "numpy"})
    except Exception as e:  # noqa: BLE001
        check(False, "python: save_file for the C side", repr(e))

    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
