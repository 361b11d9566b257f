#!/usr/bin/env python3
"""Draws one step of an smp timeline (SMP_TIMELINE=path, Chrome trace JSON).

One row per rank; forwards, backwards and weight-gradient halves as boxes
labelled with their microbatch (blue forward, orange backward - in
zero-bubble schedules its input-gradient half B -, green the weight half W
that zero-bubble schedules run apart; a rank's second and later model
chunks, i.e. virtual stages, in lighter shades), the step body as a thin
dark tick and the waits for a peer as a grey band under the row.

    python3 bench/plot_timeline.py /tmp/timeline.json out.png [--step K] [--align] [--title TEXT]

--step K   which step (0 = the first the file holds; default: the last).
           The executor appends every step to one file; the k-th forward of
           (stage, microbatch) belongs to step k.
--align    shift each rank's clock so that no operation starts before the
           one it depends on has finished on the other rank. Each rank
           times its events from its own origin; use this when the ranks'
           origins visibly disagree (operations that start before their
           input exists).

Needs matplotlib (pip install matplotlib).
"""
import argparse
import collections
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

FWD = ["#1f5fa8", "#6f9fd8", "#a9c6ea", "#d3e2f5"]
BWD = ["#d9731a", "#f0a25c", "#f6c597", "#fae2cb"]
WGT = ["#2e8b3a", "#74c17f", "#a8dcae", "#d4eed7"]
PALETTE = {"forward": FWD, "backward": BWD, "weight": WGT}
OPS = tuple(PALETTE)


def load(path):
    with open(path) as f:
        doc = json.load(f)
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    if not events:
        sys.exit(f"{path}: no events (was SMP_TIMELINE set for the run?)")
    return events


def pick_step(events, step):
    """The step's forward/backward/weight events keyed by (kind, stage, mb), and
    every event (waits and bodies included) inside its time window."""
    occ = collections.defaultdict(list)
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["cat"] in OPS:
            occ[(e["cat"], e["args"]["stage"], e["args"]["microbatch"])].append(e)
    nsteps = min(len(v) for v in occ.values())
    if step is None:
        step = nsteps - 1
    if not 0 <= step < nsteps:
        sys.exit(f"the file holds steps 0..{nsteps - 1}, not {step}")
    ops = {k: v[step] for k, v in occ.items()}
    lo = min(e["ts"] for e in ops.values())
    hi = max(e["ts"] + e["dur"] for e in ops.values())
    others = [e for e in events if e["cat"] in ("wait", "body") and e["ts"] < hi and e["ts"] + e["dur"] > lo]
    return step, nsteps, ops, others


def align(ops):
    """Per-rank clock shifts (rank 0 fixed) such that every operation starts
    no earlier than its cross-rank dependency ends: the smallest shifts that
    satisfy all such constraints (longest paths from rank 0)."""
    nst = max(k[1] for k in ops) + 1
    deps = []
    for (cat, s, i), e in ops.items():
        if cat == "forward":
            d = ("forward", s - 1, i) if s > 0 else None
        elif cat == "weight":
            d = None  # its B ran on the same rank
        else:
            d = ("backward", s + 1, i) if s < nst - 1 else ("forward", s, i)
        if d and ops[d]["pid"] != e["pid"]:
            deps.append((ops[d], e))
    ranks = sorted({e["pid"] for e in ops.values()})
    shift = {r: 0.0 for r in ranks}
    for _ in range(len(ranks) * 4):
        changed = False
        for p, c in deps:
            if c["pid"] == ranks[0]:
                continue
            need = p["ts"] + p["dur"] + shift[p["pid"]] - c["ts"]
            if need > shift[c["pid"]] + 1e-3:
                shift[c["pid"]] = need
                changed = True
        if not changed:
            break
    return shift


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("png")
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--align", action="store_true")
    ap.add_argument("--title", default=None)
    a = ap.parse_args()

    events = load(a.trace)
    step, nsteps, ops, others = pick_step(events, a.step)
    shift = align(ops) if a.align else collections.defaultdict(float)
    t0 = min(e["ts"] + shift[e["pid"]] for e in ops.values())

    ranks = sorted({e["pid"] for e in ops.values()})
    # chunk of a stage: its position among its rank's stages
    stages_of = collections.defaultdict(set)
    for (_, s, _), e in ops.items():
        stages_of[e["pid"]].add(s)
    chunk = {s: sorted(v).index(s) for v in stages_of.values() for s in v}
    mbs = max(k[2] for k in ops) + 1
    nchunks = max(chunk.values()) + 1

    span = max(e["ts"] + e["dur"] + shift[e["pid"]] for e in ops.values()) - t0
    fig, ax = plt.subplots(figsize=(11, 0.75 * len(ranks) + 1.4), dpi=90)
    for e in others:
        x = (e["ts"] + shift[e["pid"]] - t0) / 1e3
        w = e["dur"] / 1e3
        y = ranks.index(e["pid"])
        if e["cat"] == "wait":
            ax.broken_barh([(x, w)], (y + 0.33, 0.1), facecolors="#b8b8b8", edgecolor="none")
        else:
            ax.plot([x, x], [y - 0.4, y + 0.4], color="#222222", lw=0.8)
    for (cat, s, i), e in ops.items():
        x = (e["ts"] + shift[e["pid"]] - t0) / 1e3
        w = e["dur"] / 1e3
        y = ranks.index(e["pid"])
        pal = PALETTE[cat]
        c = chunk[s]
        ax.broken_barh([(x, w)], (y - 0.3, 0.6), facecolors=pal[min(c, len(pal) - 1)], edgecolor="white", linewidth=0.6)
        if w > span / 1e3 / 150:
            ax.text(x + w / 2, y, str(i), ha="center", va="center", fontsize=7,
                    color="white" if c == 0 else "black")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first operation")
    ax.set_xlim(0, span / 1e3 * 1.01)
    has_w = any(k[0] == "weight" for k in ops)
    legend = [Patch(color=FWD[0], label="forward"),
              Patch(color=BWD[0], label="backward, input half (B)" if has_w else "backward")]
    if has_w:
        legend.append(Patch(color=WGT[0], label="weight half (W)"))
    if nchunks > 1:
        legend += [Patch(color=FWD[1], label="forward, 2nd chunk"), Patch(color=BWD[1], label="B, 2nd chunk" if has_w else "backward, 2nd chunk")]
        if has_w:
            legend.append(Patch(color=WGT[1], label="W, 2nd chunk"))
    legend.append(Patch(color="#b8b8b8", label="waiting for a peer"))
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    title = a.title or f"{a.trace}: step {step} of {nsteps} ({len(ranks)} ranks, {mbs} microbatches)" + (
        ", clocks aligned" if a.align else "")
    ax.set_title(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(a.png)
    print(f"{a.png}: step {step} of {nsteps}, {len(ops)} operations on {len(ranks)} ranks, {span / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
