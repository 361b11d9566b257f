"""What the Python checks of smp's safetensors files share: test.h-style
PASS/FAIL lines, element sizes per dtype, and CRC-32C (the checksum
smp_checkpoint.h records per tensor)."""
import sys

SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1}

failures = 0


def check(ok, name, why=""):
    global failures
    if ok:
        print(f"PASS: {name}")
    else:
        failures += 1
        print(f"FAIL: {name}: {why}")
    sys.stdout.flush()


def exit_status():
    """0 when every check passed, 3 when one failed (test.h's convention)."""
    return 3 if failures else 0


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


NUMPY_DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I32": "<i4", "I64": "<i8", "U8": "u1", "BOOL": "?"}


def read_numpy(path):
    """A safetensors file as ({name: numpy array}, {metadata}), read with numpy
    alone (no safetensors package: Debian's python3-torch brings numpy but not
    it). Copies every tensor; for small test files."""
    import json
    import struct

    import numpy as np

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        tensors[name] = np.frombuffer(data[begin:end], dtype=NUMPY_DTYPES[e["dtype"]]).reshape(e["shape"]).copy()
    return tensors, meta
