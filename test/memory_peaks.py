#!/usr/bin/env python3
"""Compares the memory account's per-rank peaks that the examples print at the end
("memory peak rank R: parameters X MiB, gradients Y MiB, ..., total Z MiB") between two runs.

usage: memory_peaks.py RUN_A RUN_B CATEGORY LOW HIGH
Every rank of RUN_B must hold a CATEGORY peak of LOW..HIGH times RUN_A's rank of the same number (both runs print a
line for every rank, the same ranks); with CATEGORY "max:NAME" the comparison is of the largest figure over the ranks.
CATEGORY "NAME/BY" compares each rank's NAME peak divided by its own BY peak: the auto-partitioner places layers
by their traced time, so two runs may give a rank different layers, and "optimizer/parameters" (2 for Adam's two
moments unsharded) still compares like with like. Prints the figures; exits 1 with the reason otherwise (a missing
line included)."""
import re
import sys


def peaks(path, category):
    out = {}
    for line in open(path, errors="replace"):
        m = re.match(r"memory peak rank (\d+): (.*)$", line)
        if m:
            fig = dict((k, float(v)) for v, k in ((f.split()[-2], " ".join(f.split()[:-2])) for f in m.group(2).split(", ")))
            if category not in fig:
                sys.exit("%s: rank %s's line names no '%s': %s" % (path, m.group(1), category, line.strip()))
            out[int(m.group(1))] = fig[category]
    if not out:
        sys.exit("%s: no 'memory peak rank' line" % path)
    return out


a_path, b_path, category, low, high = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
largest = category.startswith("max:")
name = category[4:] if largest else category
if "/" in name:
    name, by = name.split("/")
    a, b = peaks(a_path, name), peaks(b_path, name)
    a_by, b_by = peaks(a_path, by), peaks(b_path, by)
    if 0 in a_by.values() or 0 in b_by.values():
        sys.exit("a rank has no %s bytes to divide by" % by)
    a = dict((r, v / a_by[r]) for r, v in a.items() if r in a_by)
    b = dict((r, v / b_by[r]) for r, v in b.items() if r in b_by)
    name = name + "/" + by
else:
    a, b = peaks(a_path, name), peaks(b_path, name)
if sorted(a) != sorted(b) or sorted(a) != list(range(len(a))):
    sys.exit("the runs print different ranks: %s and %s" % (sorted(a), sorted(b)))
pairs = [(max(a.values()), max(b.values()), "largest")] if largest else [(a[r], b[r], "rank %d" % r) for r in sorted(a)]
for x, y, who in pairs:
    if x <= 0 or not low <= y / x <= high:
        sys.exit("%s %s peak %.3f against %.3f: ratio %s, not within %g..%g"
                 % (who, name, y, x, "%.3f" % (y / x) if x > 0 else "n/a", low, high))
unit = "" if "/" in name else " MiB"
print(", ".join("%s %s %.3f%s against %.3f%s" % (who, name, y, unit, x, unit) for x, y, who in pairs))
