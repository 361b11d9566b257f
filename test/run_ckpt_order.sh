#!/usr/bin/env bash
# What a checkpoint save asks of the disk, and in what order: a crash or a
# power cut at any point must leave the previous checkpoint loadable, which
# no test that only kills the process can see (the page cache survives a
# kill). test_ckpt_order saves net7.h's model full, then partial twice, on
# 2 ranks with test/fs_order_shim.c preloaded; the shim logs every open,
# write, fsync, close, rename and unlink under the save's folder, in the
# order they return. For every file of every save: the data is written to a
# tmp file and fsynced before the rename that puts it in place, and the
# rename is followed by an fsync of its folder by the same process; a
# partial save's manifest is renamed into place only after every data file
# of its generation is renamed and its folder fsynced, and the files it
# replaces are removed only after that. Runs on the build dir's
# test_ckpt_order (not under ASan: its link-order check refuses a preload).
# usage: test/run_ckpt_order.sh [BUILD_DIR]; prints PASS/FAIL lines.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build/gcc}
bin=$build/test_ckpt_order
[ -x "$bin" ] || { echo "FAIL: ckpt-order/binary: $bin is not built"; exit 1; }
tmp=$(realpath "$(mktemp -d)") # the shim compares absolute paths without links
trap 'rm -rf "$tmp"' EXIT
shim=$tmp/fs_order_shim.so
cc -shared -fPIC -O2 -Wall -Wextra -Werror "$root/test/fs_order_shim.c" -o "$shim" -ldl ||
    { echo "FAIL: ckpt-order/build: test/fs_order_shim.c did not compile"; exit 1; }
mkdir "$tmp/saves"
FS_ORDER_DIR=$tmp/saves FS_ORDER_LOG=$tmp/log timeout 120 mpirun -n 2 -genv LD_PRELOAD "$shim" "$bin" "$tmp/saves"
rc=$?
[ $rc -eq 0 ] || echo "FAIL: ckpt-order/the saves: test_ckpt_order exited with status $rc"
python3 - "$tmp/log" "$tmp/saves" <<'PY'
import os, re, sys
log, top = sys.argv[1], sys.argv[2]
lines = [l.split() for l in open(log)] if os.path.exists(log) else []
def check(ok, name, why=""):
    print(("PASS: ckpt-order/" + name) if ok else ("FAIL: ckpt-order/%s: %s" % (name, why)))
renames = [(i, l[0], l[2], l[3]) for i, l in enumerate(lines) if l[1] == "rename"]
bad = []
dir_synced = {}  # rename index -> index of the folder fsync after it
for i, pid, src, dst in renames:
    mine = [(j, l) for j, l in enumerate(lines[:i]) if l[0] == pid and l[2] == src]
    opened = [j for j, l in mine if l[1] == "open"]
    first = opened[-1] if opened else -1
    writes = [j for j, l in mine if l[1] == "write" and j > first]
    syncs = [j for j, l in mine if l[1] == "fsync" and writes and j > writes[-1]]
    if not writes: bad.append("%s was renamed over %s with nothing written to it" % (src, dst))
    elif not syncs: bad.append("%s was renamed over %s without an fsync after its last write" % (src, dst))
    folder = os.path.dirname(dst)
    later = [j for j, l in enumerate(lines)
             if j > i and l[0] == pid and (l[1] == "rename" or l[1] == "fsync" and l[2] == folder)]
    if not later or lines[later[0]][1] != "fsync":
        bad.append("%s: its folder was not fsynced after the rename (before the process's next rename)" % dst)
    else: dir_synced[i] = later[0]
names = [os.path.relpath(d, top) for _, _, _, d in renames]
want = ["full/ckpt", "part/ckpt.g1_0", "part/ckpt.g1_1", "part/ckpt.manifest",
        "part/ckpt.g2_0", "part/ckpt.g2_1", "part/ckpt.manifest"]
check(sorted(names) == sorted(want), "a full save puts 1 file in place, each partial save 2 and a manifest",
      "renamed into place: %s" % names)
check(renames and not bad, "every file of a full and a partial save: written, fsynced, renamed, its folder fsynced",
      "; ".join(bad[:4]) or "no rename logged")
# the manifest last: after every data file of its generation is in place on disk
order = []
for k, (i, pid, src, dst) in enumerate(renames):
    if dst.endswith(".manifest"):
        gen = len([r for r in renames[:k] if r[3].endswith(".manifest")]) + 1
        data = [r for r in renames if re.search(r"\.g%d_\d+$" % gen, r[3])]
        late = [r[3] for r in data if dir_synced.get(r[0], len(lines)) > i]
        if len(data) != 2 or late:
            order.append("manifest %d renamed at line %d before %s were in place with their folder fsynced"
                         % (gen, i, late or "its 2 data files"))
check(not order and any(d.endswith(".manifest") for *_, d in renames),
      "a partial save renames its manifest last, after its files are on disk",
      "; ".join(order) or "no manifest renamed")
# the files a generation replaces go only after the manifest that replaces them
unlinks = [(i, l[2]) for i, l in enumerate(lines) if l[1] == "unlink" and re.search(r"\.g\d+_\d+$", l[2])]
early = []
for i, path in unlinks:
    gen = int(re.search(r"\.g(\d+)_\d+$", path).group(1))
    committed = [r for r in renames if r[3].endswith(".manifest") and r[0] < i]
    if len(committed) <= gen:
        early.append("%s removed at line %d, before manifest %d was in place" % (path, i, gen + 1))
check(len(unlinks) == 2 and not early,
      "the second partial save removes the first's files after its manifest is in place",
      "; ".join(early) or "%d data files removed (expected the first generation's 2)" % len(unlinks))
PY
