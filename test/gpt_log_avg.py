#!/usr/bin/env python3
"""The loss average gpt.c and gpt.cu log ("step 8/8  loss X (avg Y)"), against the run's own exact losses
(--print-losses, "step N loss 0x..."): a moving average (0.9) from the run's first step, which a resumed run
(--load) names ("avg from step N:"), so it neither restarts from zero nor claims steps the run did not make.
usage: gpt_log_avg.py RUN_OUTPUT   (prints what it checked; exit 1 with the reason otherwise)"""
import re
import sys

text = open(sys.argv[1], errors="replace").read()
loss = {int(m[1]): float.fromhex(m[2]) for m in re.finditer(r"^step (\d+) loss (0x\S+)$", text, re.M)}
logs = re.findall(r"^step +(\d+)/\d+  loss (\S+) \(avg( from step (\d+):)? (\S+)\)", text, re.M)
if not loss or not logs:
    sys.exit("no exact losses (--print-losses) or no log lines in %s" % sys.argv[1])
first = min(loss)
avg, want = None, {}
for s in sorted(loss):
    avg = loss[s] if s == first else 0.9 * avg + 0.1 * loss[s]
    want[s] = avg
for shown, l, label, frm, a in logs:
    s = int(shown) - 1
    if first and frm != str(first + 1):
        sys.exit("step %s's log line says %r, but the run began at step %d" % (shown, label or "avg", first + 1))
    if not first and label:
        sys.exit("step %s's log line says %r in a run from the start" % (shown, label))
    if abs(float(a) - want[s]) > 6e-5 or abs(float(l) - loss[s]) > 6e-5:
        sys.exit("step %s: logged loss %s (avg %s), its losses give %.4f (avg %.4f)" % (shown, l, a, loss[s], want[s]))
print("%d log lines from step %d, the last avg %s" % (len(logs), first + 1, logs[-1][4]))
