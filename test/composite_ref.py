#!/usr/bin/env python3
"""The float64 reference of test_composite.c: recomputes one training step of
the residual MLP in float64 with numpy and checks smp's float32 gradients
against it, to float32 rounding.

The network (test_composite.c): a stem linear (IN -> HID), NBLK blocks of
    h = h + fc2(relu(fc1(h)))       (fc1: HID -> FF, fc2: FF -> HID)
and a head linear (HID -> CLS); loss per microbatch: mean((y - t)^2) over its
elements; the batch of BATCH rows is cut into M microbatches of BATCH / M
rows, and the gradient is the mean of the microbatches' gradients (smp
scales each microbatch's loss gradient by 1 / M).

Run by test_composite.c as
    python3 composite_ref.py DIR
after the ranks wrote into DIR:
    meta.txt                 "IN HID FF CLS BATCH NBLK M"
    x.bin, t.bin, loss.bin   inputs [BATCH, IN], targets [BATCH, CLS], the M losses (float32)
    manifest_<rank>.txt      lines "name rows cols" (cols 0: a vector) of that rank's parameters
    <name>.init.bin          a parameter's value before the step (float32)
    <name>.grad.bin          its gradient after the step (float32)

Prints PASS/FAIL/SKIP lines like test.h. Exit status: 0 all passed (or
skipped), 3 some check failed; anything else is a crash.
"""
import glob
import os
import sys

from safetensors_common import check, exit_status


def main():
    if len(sys.argv) != 2:
        print("usage: composite_ref.py DIR", file=sys.stderr)
        return 2
    d = sys.argv[1]
    try:
        import numpy as np
    except ImportError as e:
        print(f"SKIP: composite/float64 reference: {e} (apt-get install python3-numpy)")
        return 0

    with open(os.path.join(d, "meta.txt")) as fh:
        IN, HID, FF, CLS, BATCH, NBLK, M = (int(v) for v in fh.read().split())

    def load(name, shape):
        a = np.fromfile(os.path.join(d, name), dtype="<f4")
        if a.size != int(np.prod(shape)):
            raise ValueError(f"{name}: {a.size} values, expected {shape}")
        return a.reshape(shape)

    x = load("x.bin", (BATCH, IN)).astype(np.float64)
    t = load("t.bin", (BATCH, CLS)).astype(np.float64)
    losses = load("loss.bin", (M,)).astype(np.float64)

    # the parameters smp declares, by name, with their shapes
    expected = {"stem.weight": (HID, IN), "stem.bias": (HID,), "head.weight": (CLS, HID), "head.bias": (CLS,)}
    for k in range(NBLK):
        expected[f"blocks.{k}.fc1.weight"] = (FF, HID)
        expected[f"blocks.{k}.fc1.bias"] = (FF,)
        expected[f"blocks.{k}.fc2.weight"] = (HID, FF)
        expected[f"blocks.{k}.fc2.bias"] = (HID,)

    init, grad, problems = {}, {}, []
    for man in sorted(glob.glob(os.path.join(d, "manifest_*.txt"))):
        with open(man) as fh:
            for line in fh:
                f = line.split()
                if not f:
                    continue
                name, rows, cols = f[0], int(f[1]), int(f[2])
                shape = (rows, cols) if cols else (rows,)
                if name in init:
                    problems.append(f"{name} written by two ranks")
                if expected.get(name) != shape:
                    problems.append(f"{name}{list(shape)} is not a parameter of the net (or has the wrong shape)")
                    continue
                init[name] = load(name + ".init.bin", shape).astype(np.float64)
                grad[name] = load(name + ".grad.bin", shape).astype(np.float64)
    missing = sorted(set(expected) - set(init))
    if missing:
        problems.append(f"no rank wrote {', '.join(missing)}")
    check(not problems, f"composite/float64 reference: every one of the {len(expected)} parameters written once", "; ".join(problems))
    if problems:
        return 3

    # forward and backward in float64
    W = init
    G = {name: np.zeros_like(v) for name, v in W.items()}
    n = BATCH // M
    ref_losses = []
    for i in range(M):
        xi, ti = x[i * n:(i + 1) * n], t[i * n:(i + 1) * n]
        h = [xi @ W["stem.weight"].T + W["stem.bias"]]
        a1, r = [], []
        for k in range(NBLK):
            p = f"blocks.{k}."
            a = h[k] @ W[p + "fc1.weight"].T + W[p + "fc1.bias"]
            rr = np.maximum(a, 0.0)
            o = rr @ W[p + "fc2.weight"].T + W[p + "fc2.bias"]
            a1.append(a)
            r.append(rr)
            h.append(h[k] + o)
        y = h[NBLK] @ W["head.weight"].T + W["head.bias"]
        ref_losses.append(np.mean((y - ti) ** 2))
        gy = 2.0 * (y - ti) / y.size / M
        G["head.weight"] += gy.T @ h[NBLK]
        G["head.bias"] += gy.sum(axis=0)
        gh = gy @ W["head.weight"]
        for k in reversed(range(NBLK)):
            p = f"blocks.{k}."
            G[p + "fc2.weight"] += gh.T @ r[k]
            G[p + "fc2.bias"] += gh.sum(axis=0)
            ga = (gh @ W[p + "fc2.weight"]) * (a1[k] > 0)
            G[p + "fc1.weight"] += ga.T @ h[k]
            G[p + "fc1.bias"] += ga.sum(axis=0)
            gh = gh + ga @ W[p + "fc1.weight"]
        G["stem.weight"] += gh.T @ xi
        G["stem.bias"] += gh.sum(axis=0)

    ref_losses = np.array(ref_losses)
    tol = 1e-5 * (1 + np.abs(ref_losses))
    check(bool(np.all(np.abs(losses - ref_losses) <= tol)), "composite/float64 reference: the losses of the microbatches agree to float32 rounding",
          f"smp {losses.tolist()}, float64 {ref_losses.tolist()}")

    # every gradient within float32 rounding; each far enough from zero that
    # a dropped gradient (all zeros) could not pass
    bad, small = [], []
    for name in expected:
        g, ref = grad[name], G[name]
        scale = float(np.max(np.abs(ref)))
        bound = 1e-5 * (1 + scale)
        diff = float(np.max(np.abs(g - ref)))
        if not diff <= bound:
            bad.append(f"{name}: max |smp - float64| = {diff:.3g} > {bound:.3g} (max |float64| = {scale:.3g}, max |smp| = {float(np.max(np.abs(g))):.3g})")
        if not scale > 10 * bound:
            small.append(f"{name}: max |gradient| = {scale:.3g}")
    check(not bad, f"composite/float64 reference: all {len(expected)} gradients agree with float64 to float32 rounding "
          "(max |diff| <= 1e-5 * (1 + max |g|))", "; ".join(bad))
    check(not small, "composite/float64 reference: every reference gradient is far from zero, so a dropped one fails", "; ".join(small))
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
