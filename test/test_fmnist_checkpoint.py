"""Recomputes the demo's MLP from its full checkpoint with numpy and checks
the test accuracy the C program printed.

usage: python3 test/test_fmnist_checkpoint.py CHECKPOINT PRINTED_ACCURACY [DATA_DIR]
The checkpoint is read with the safetensors package; layer names are the
module names (fc0.weight, ...), as a PyTorch nn.Linear stack would have."""
import gzip
import struct
import sys

import numpy as np
from safetensors import safe_open


def idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def main():
    path, printed = sys.argv[1], float(sys.argv[2])
    data = sys.argv[3] if len(sys.argv) > 3 else "/usr/share/datasets/fashion-mnist"
    with safe_open(path, framework="np") as f:
        meta = f.metadata()
        layers = []
        i = 0
        while f"fc{i}.weight" in f.keys():
            layers.append((f.get_tensor(f"fc{i}.weight"), f.get_tensor(f"fc{i}.bias")))
            i += 1
    mean, std = np.float32(meta["pixel_mean"]), np.float32(meta["pixel_std"])
    x = idx(f"{data}/t10k-images-idx3-ubyte.gz").reshape(-1, 784).astype(np.float32) / np.float32(255)
    y = idx(f"{data}/t10k-labels-idx1-ubyte.gz")
    h = (x - mean) * (np.float32(1) / std)
    for k, (w, b) in enumerate(layers):
        h = h @ w.T + b
        if k < len(layers) - 1:
            h = np.maximum(h, 0)
    acc = float((h.argmax(axis=1) == y).mean())
    # numpy's and OpenBLAS's float sums round differently; a near-tie may flip a few of 10000 images
    ok = len(layers) >= 5 and abs(acc - printed) <= 5e-4
    print(("PASS" if ok else "FAIL") + f": demo/python recomputes the checkpoint's test accuracy: numpy {acc:.4f}, C printed {printed:.4f}, {len(layers)} linear layers")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
