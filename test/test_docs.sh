#!/usr/bin/env bash
# The documentation names what the code reads: every config key of smp.h's
# key table (smp__cfg_keys) and every environment variable the headers
# getenv() appear in docs/REFERENCE.md's tables and in smp.h's opening
# comment, and those tables name nothing the code does not read.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
ref="$top/docs/REFERENCE.md"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# what the code reads
awk '/smp__cfg_keys\[\] = \{/ {on = 1; next} on && /^\};/ {exit} on && match($0, /^ *\{"[a-z_]+"/) {
  s = substr($0, RSTART, RLENGTH); sub(/^ *\{"/, "", s); sub(/"$/, "", s); print s }' "$top/smp.h" | sort -u >"$tmp/keys_code"
grep -oh 'getenv("SMP_[A-Z0-9_]*")' "$top"/smp.h "$top"/smp_pipeline.h "$top"/smp_nccl.h "$top"/smp_checkpoint.h |
  sed 's/getenv("\(.*\)")/\1/' | sort -u >"$tmp/env_code"
# what docs/REFERENCE.md's tables name: the first column of each row of a section
table() { # section heading
  awk -v h="$1" '$0 == h {on = 1; next} on && /^## / {exit} on && /^\| `[^`]+` \|/ {
    s = $0; sub(/^\| `/, "", s); sub(/`.*/, "", s); print s }' "$ref" | sort -u
}
table "## Config keys" >"$tmp/keys_doc"
table "## Environment variables" >"$tmp/env_doc"
# what smp.h's opening comment names
awk '/^   CONFIG KEYS / {on = 1} /^   ENVIRONMENT VARIABLES/ {exit} on' "$top/smp.h" >"$tmp/keys_comment"
awk '/^   ENVIRONMENT VARIABLES/ {on = 1; next} /^   THREADING MODEL/ {exit} on && /^     SMP_/ {print $1}' "$top/smp.h" |
  sort -u >"$tmp/env_comment"

compare() { # name, code list, documented list, where
  local name=$1 code=$2 doc=$3 where=$4 missing extra
  if [ ! -s "$code" ]; then echo "FAIL: docs/$name: found none in the code (has the code's layout changed?)"; return; fi
  missing=$(comm -23 "$code" "$doc" | tr '\n' ' '); extra=$(comm -13 "$code" "$doc" | tr '\n' ' ')
  if [ -z "$missing$extra" ]; then echo "PASS: docs/$name: $where lists the $(wc -l <"$code") the code reads"
  else echo "FAIL: docs/$name: $where${missing:+ lacks: $missing}${extra:+ names what the code does not read: $extra}"; fi
}
compare "config keys" "$tmp/keys_code" "$tmp/keys_doc" "docs/REFERENCE.md's Config keys table"
compare "environment variables" "$tmp/env_code" "$tmp/env_doc" "docs/REFERENCE.md's Environment variables table"
compare "environment variables in smp.h" "$tmp/env_code" "$tmp/env_comment" "smp.h's ENVIRONMENT VARIABLES"
missing=""
while read -r k; do grep -qw "$k" "$tmp/keys_comment" || missing="$missing $k"; done <"$tmp/keys_code"
if [ -z "$missing" ]; then echo "PASS: docs/config keys in smp.h: its CONFIG KEYS names every key of the key table"
else echo "FAIL: docs/config keys in smp.h: its CONFIG KEYS lacks:$missing"; fi
