#!/usr/bin/env python3
"""Per-step times of a pipeline run, from its SMP_TIMELINE file.

    timeline_steps.py TIMELINE
        for each rank, the medians over training steps of the step period, the time from a step's first operation
        to its last, the compute in it (forward, backward, weight, body), the waits for neighbours in it, and the
        gap until the next step (the optimizer, the next batch). Steps 0-9 and the last 10 are skipped (--skip N).
    timeline_steps.py --summary NAME TIMELINE
        one line (bench/gpt.sh's): "pp2 NAME timeline, median step: period ...; rank r: compute, waits, idle"
    timeline_steps.py --bound KIND SIMULATE TOKENS_PER_S TOKENS_PER_STEP TIMELINE
        the schedule's bound for this run: every stage's median forward (with the loss body where it runs),
        backward (B) and weight (W) time per microbatch, fed to SIMULATE (build/bench/simulate) with the run's
        stage map and microbatches; the bound is its makespan plus the time outside the schedule (the median gap
        between steps on the rank where it is least: the optimizer, the next batch), and the last line
        "of simulated bound: X.XX" is TOKENS_PER_S against TOKENS_PER_STEP / that.

    SMP_TIMELINE=/tmp/tl.json mpirun -n 2 build/examples/fmnist --partitions 2 --epochs 1 --epoch-steps 100
    python3 bench/timeline_steps.py /tmp/tl.json
"""
import json
import statistics
import subprocess
import sys

COMPUTE = ("forward", "backward", "weight", "body")


def load(path):
    return [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]


def rank_steps(events, rank):
    """The rank's operations and waits, step by step. A step starts with microbatch 0 on the rank's first stage (a
    rank with several stages runs microbatch 0 on each): its forward, or the wait for its activations before it
    (once the step before has run that microbatch's backward there, or its forward in an evaluation step)."""
    ops = sorted((e for e in events if e["pid"] == rank and e["cat"] in COMPUTE + ("wait",)), key=lambda e: e["ts"])
    first = min(e["args"]["stage"] for e in ops if e["cat"] == "forward")
    head = lambda e, cats: e["cat"] in cats and e["args"]["stage"] == first and e["args"]["microbatch"] == 0
    steps, current = [], []
    for e in ops:
        if head(e, ("wait", "forward")) and any(head(x, ("backward",)) or (e["cat"] == "forward" and
                                                                           head(x, ("forward",))) for x in current):
            steps.append(current)
            current = []
        current.append(e)
    steps.append(current)
    return [s for s in steps if any(x["cat"] == "backward" for x in s)]  # training steps


def step_times(steps):
    """Medians in ms: period, span of the operations, compute, waits, gap to the next step."""
    med = statistics.median
    start = [min(x["ts"] for x in s) for s in steps]
    end = [max(x["ts"] + x["dur"] for x in s) for s in steps]
    return (med(b - a for a, b in zip(start, start[1:])) / 1e3, med(b - a for a, b in zip(start, end)) / 1e3,
            med(sum(x["dur"] for x in s if x["cat"] != "wait") for s in steps) / 1e3,
            med(sum(x["dur"] for x in s if x["cat"] == "wait") for s in steps) / 1e3,
            med(b - a for a, b in zip(end, start[1:])) / 1e3)


def trimmed(events, skip):
    """Every rank's training steps without the first `skip` and the last; None if too few remain."""
    out = {}
    for rank in sorted({e["pid"] for e in events}):
        steps = rank_steps(events, rank)
        steps = steps[skip:-1]
        if len(steps) < 2:
            return None
        out[rank] = steps
    return out


def bound(events, kind, simulate, rate, tokens, skip):
    ranks = trimmed(events, skip)
    if ranks is None:
        return "too few steps in the timeline for a bound"
    rank_of, times = {}, {}
    for rank, steps in ranks.items():
        for s in steps:
            for x in s:
                if x["cat"] != "wait":
                    rank_of[x["args"]["stage"]] = rank
                    times.setdefault((x["cat"], x["args"]["stage"]), []).append(x["dur"] / 1e6)
    stages = sorted(rank_of)
    microbatches = 1 + max(x["args"]["microbatch"] for s in ranks[0] for x in s)
    med = lambda k: statistics.median(times[k]) if k in times else 0.0
    cost = ",".join(f"{med(('forward', s)) + med(('body', s)):.9f}/{med(('backward', s)):.9f}/{med(('weight', s)):.9f}"
                    for s in stages)
    sim = subprocess.run([simulate, kind, str(microbatches), ",".join(str(rank_of[s]) for s in stages), cost],
                         capture_output=True, text=True)
    if sim.returncode:
        return "no bound: " + sim.stderr.strip()
    makespan = float(sim.stdout.split()[1]) * 1e3
    outside = min(step_times(steps)[4] for steps in ranks.values())
    period = tokens / rate * 1e3
    per_stage = "; ".join(f"s{s} (rank {rank_of[s]}) F {med(('forward', s)) * 1e3:.2f} "
                          f"B {med(('backward', s)) * 1e3:.2f} W {med(('weight', s)) * 1e3:.2f}" for s in stages)
    return (f"{kind} bound: medians per microbatch (ms) {per_stage}; simulated step {makespan:.1f} ms "
            f"(bubble {float(sim.stdout.split()[3]):.1%}) + outside the schedule {outside:.1f} ms = "
            f"{makespan + outside:.1f} ms; measured step {period:.1f} ms\n"
            f"of simulated bound: {(makespan + outside) / period:.2f}")


def main(argv):
    skip = 10
    if "--skip" in argv:
        i = argv.index("--skip")
        skip = int(argv[i + 1])
        del argv[i:i + 2]
    if argv[:1] == ["--bound"] and len(argv) == 6:
        print(bound(load(argv[5]), argv[1], argv[2], float(argv[3]), float(argv[4]), skip))
        return
    if argv[:1] == ["--summary"] and len(argv) == 3:
        ranks = trimmed(load(argv[2]), skip)
        if ranks is None:
            print(f"pp2 {argv[1]}: too few steps in the timeline")
            return
        parts = [(r, *step_times(s)) for r, s in ranks.items()]
        print(f"pp2 {argv[1]:<12} timeline, median step: period {parts[0][1]:.1f} ms; " +
              "; ".join(f"rank {r}: compute {c:.1f} ms, waits {w:.1f} ms, idle {1 - c / p:.0%}"
                        for r, p, _, c, w, _ in parts))
        return
    if len(argv) != 1:
        sys.exit(__doc__)
    events = load(argv[0])
    for rank in sorted({e["pid"] for e in events}):
        train = rank_steps(events, rank)[skip:-skip]
        if len(train) < 2:
            print(f"rank {rank}: too few training steps")
            continue
        period, span, compute, wait, gap = (t * 1e3 for t in step_times(train))
        print(f"rank {rank}: {len(train)} steps, period {period:.0f} us, in step {span:.0f} (compute {compute:.0f}, "
              f"waits {wait:.0f}), between steps {gap:.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
