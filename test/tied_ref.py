#!/usr/bin/env python3
"""The float64 reference of test_tied.c's model: a tied (shared) module
called first and last.

    a0 = x W^T + b          (call 0: the tied module)
    a1 = a0 W1^T + b1,  a2 = relu(a1)
    a3 = a2 W2^T + b2,  a4 = relu(a3)
    a5 = a4 + a0            (skip)
    a6 = a5 W3^T + b3
    y  = a6 W^T + b         (call 7: the tied module again)
    loss = mean((y - t)^2) per microbatch

Run by test_tied.c as
    python3 tied_ref.py DIR LABEL
after it wrote into DIR: meta.txt ("rows_per_replica dp microbatches D"),
x.bin and t.bin (float32, [dp * rows, D], replica r's rows r*rows ..
(r+1)*rows), param_<name>.bin (the initial parameters) and grad_<name>.bin
(smp's gradients after the first step, float32), loss_<r>.bin (replica r's
per-microbatch losses). smp averages over microbatches and replicas: the
gradient is (1 / (m * dp)) * the sum over every microbatch of every
replica of d(loss)/d(parameter).

Checks, each a PASS/FAIL/SKIP line as test.h prints them:
  - this script's backward against central finite differences of its own
    float64 forward (so the reference itself is right);
  - every loss and every gradient smp computed in float32 against the
    float64 values: max |smp - ref| <= 1e-5 * (1 + max |ref|);
  - the check is sharp for the tied parameters: each call's share of
    tied.weight and tied.bias alone exceeds that tolerance, so a gradient
    missing either call's contribution fails.
Exit status: 0 all passed (or skipped), 3 some check failed, else a crash.
"""
import os
import sys

from safetensors_common import check, exit_status

NAMES = ["tied.weight", "tied.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]


def main():
    if len(sys.argv) != 3:
        print("usage: tied_ref.py DIR LABEL", file=sys.stderr)
        return 2
    d, label = sys.argv[1], sys.argv[2]
    try:
        import numpy as np
    except ImportError as e:
        print(f"SKIP: {label}: {e} (apt-get install python3-numpy)")
        return 0

    with open(os.path.join(d, "meta.txt")) as fh:
        rows, dp, m, D = (int(v) for v in fh.read().split())

    def load(name, shape):
        a = np.fromfile(os.path.join(d, name), dtype="<f4")
        if a.size != int(np.prod(shape)):
            raise ValueError(f"{name}: {a.size} floats, expected {shape}")
        return a.reshape(shape).astype(np.float64)

    shapes = {n: ((D, D) if n.endswith("weight") else (D,)) for n in NAMES}
    x = load("x.bin", (dp * rows, D))
    t = load("t.bin", (dp * rows, D))
    p0 = {n: load(f"param_{n}.bin", shapes[n]) for n in NAMES}
    got = {n: load(f"grad_{n}.bin", shapes[n]) for n in NAMES}
    losses = [load(f"loss_{r}.bin", (m,)) for r in range(dp)]
    n_mb = rows // m
    scale = 1.0 / (m * dp)

    def forward(p, xi):
        a0 = xi @ p["tied.weight"].T + p["tied.bias"]
        a1 = a0 @ p["fc1.weight"].T + p["fc1.bias"]
        a2 = np.maximum(a1, 0)
        a3 = a2 @ p["fc2.weight"].T + p["fc2.bias"]
        a4 = np.maximum(a3, 0)
        a5 = a4 + a0
        a6 = a5 @ p["fc3.weight"].T + p["fc3.bias"]
        y = a6 @ p["tied.weight"].T + p["tied.bias"]
        return a0, a1, a2, a3, a4, a5, a6, y

    def batches():
        for r in range(dp):
            for i in range(m):
                lo = r * rows + i * n_mb
                yield r, i, x[lo:lo + n_mb], t[lo:lo + n_mb]

    def objective(p):
        """What smp's gradient is the gradient of: the mean over microbatches and replicas."""
        total = 0.0
        for _, _, xi, ti in batches():
            y = forward(p, xi)[-1]
            total += np.mean((y - ti) ** 2) * scale
        return total

    def backward(p):
        """Gradients, the tied parameters' split per call; per-microbatch losses."""
        g = {n: np.zeros(shapes[n]) for n in NAMES}
        call = [{"w": np.zeros((D, D)), "b": np.zeros(D)} for _ in range(2)]
        loss = np.zeros((dp, m))
        for r, i, xi, ti in batches():
            a0, a1, a2, a3, a4, a5, a6, y = forward(p, xi)
            loss[r, i] = np.mean((y - ti) ** 2)
            gy = 2.0 * (y - ti) / y.size * scale
            call[1]["w"] += gy.T @ a6
            call[1]["b"] += gy.sum(0)
            g6 = gy @ p["tied.weight"]
            g["fc3.weight"] += g6.T @ a5
            g["fc3.bias"] += g6.sum(0)
            g5 = g6 @ p["fc3.weight"]
            g3 = g5 * (a3 > 0)
            g["fc2.weight"] += g3.T @ a2
            g["fc2.bias"] += g3.sum(0)
            g2 = g3 @ p["fc2.weight"]
            g1 = g2 * (a1 > 0)
            g["fc1.weight"] += g1.T @ a0
            g["fc1.bias"] += g1.sum(0)
            g0 = g1 @ p["fc1.weight"] + g5  # a0 feeds fc1 and the skip
            call[0]["w"] += g0.T @ xi
            call[0]["b"] += g0.sum(0)
        g["tied.weight"] = call[0]["w"] + call[1]["w"]
        g["tied.bias"] = call[0]["b"] + call[1]["b"]
        return g, call, loss

    ref, calls, ref_loss = backward(p0)

    # the reference's backward against finite differences of its forward
    h, worst, where = 1e-6, 0.0, ""
    for n in NAMES:
        flat = p0[n].reshape(-1)
        for k in range(flat.size):
            q = {a: b.copy() for a, b in p0.items()}
            q[n].reshape(-1)[k] += h
            up = objective(q)
            q[n].reshape(-1)[k] -= 2 * h
            down = objective(q)
            fd = (up - down) / (2 * h)
            err = abs(fd - ref[n].reshape(-1)[k]) / (1 + np.abs(ref[n]).max())
            if err > worst:
                worst, where = err, f"{n}[{k}]: backward {ref[n].reshape(-1)[k]:.12g}, finite difference {fd:.12g}"
    check(worst <= 1e-6, f"{label}: the float64 backward equals finite differences", f"relative error {worst:.3g} at {where}")

    # smp's float32 losses and gradients against float64
    lbad = [(r, i, float(losses[r][i]), ref_loss[r, i]) for r in range(dp) for i in range(m)
            if abs(losses[r][i] - ref_loss[r, i]) > 1e-5 * (1 + abs(ref_loss[r, i]))]
    check(not lbad, f"{label}: every microbatch's loss to float32 rounding",
          "; ".join(f"replica {r} microbatch {i}: {a:.9g} vs {b:.12g}" for r, i, a, b in lbad[:4]))
    for n in NAMES:
        diff = np.abs(got[n] - ref[n]).max()
        tol = 1e-5 * (1 + np.abs(ref[n]).max())
        check(diff <= tol, f"{label}: gradient of {n} to float32 rounding",
              f"max |smp - float64| = {diff:.3g} > {tol:.3g} (max |grad| {np.abs(ref[n]).max():.3g})")

    # sharpness: dropping either call's share of a tied parameter fails the check above
    for n, key in (("tied.weight", "w"), ("tied.bias", "b")):
        tol = 1e-5 * (1 + np.abs(ref[n]).max())
        shares = [np.abs(calls[c][key]).max() for c in range(2)]
        check(min(shares) > 10 * tol, f"{label}: each call's share of {n} is far above the tolerance (a dropped call would fail)",
              f"largest element of call 0's share {shares[0]:.3g}, of call 7's {shares[1]:.3g}, tolerance {tol:.3g}")
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
