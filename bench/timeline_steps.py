#!/usr/bin/env python3
"""Per-step times of a pipeline run, from its SMP_TIMELINE file: for each
rank, the medians over training steps of the step period, the time from a
step's first operation to its last, the compute in it (forward, backward,
body), the waits for neighbours in it, and the gap until the next step
(the optimizer, the next batch). Steps 0-9 are skipped as warm-up.

    SMP_TIMELINE=/tmp/tl.json mpirun -n 2 build/examples/fmnist --partitions 2 --epochs 1 --epoch-steps 100
    python3 bench/timeline_steps.py /tmp/tl.json
"""
import json
import statistics
import sys


def main():
    events = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X"]
    for rank in sorted({e["pid"] for e in events}):
        ops = sorted((e for e in events if e["pid"] == rank and e["cat"] in ("forward", "backward", "weight", "body", "wait")), key=lambda e: e["ts"])
        steps, current = [], []
        for e in ops:  # a step starts with the forward of microbatch 0
            if e["cat"] == "forward" and e["args"]["microbatch"] == 0 and any(x["cat"] == "forward" for x in current):
                steps.append(current)
                current = []
            current.append(e)
        steps.append(current)
        train = [s for s in steps if any(x["cat"] == "backward" for x in s)][10:-10]
        if len(train) < 2:
            print(f"rank {rank}: too few training steps")
            continue
        start = [min(x["ts"] for x in s) for s in train]
        end = [max(x["ts"] + x["dur"] for x in s) for s in train]
        med = statistics.median
        period = med(b - a for a, b in zip(start, start[1:]))
        span = med(b - a for a, b in zip(start, end))
        compute = med(sum(x["dur"] for x in s if x["cat"] != "wait") for s in train)
        wait = med(sum(x["dur"] for x in s if x["cat"] == "wait") for s in train)
        gap = med(b - a for a, b in zip(end, start[1:]))
        print(f"rank {rank}: {len(train)} steps, period {period:.0f} us, in step {span:.0f} (compute {compute:.0f}, waits {wait:.0f}), between steps {gap:.0f}")


if __name__ == "__main__":
    main()
