# shellcheck shell=bash disable=SC2034,SC2154 # top is the sourcing script's; bench, bin and common come from it
# bench/lib.sh: what the bench scripts share, sourced after they name themselves in `bench` (their messages say
# "bench/$bench: ..."): top (the checkout), tmp (a folder removed at exit), one BLAS thread per process unless a
# run says otherwise, and the helpers below. Messages go to stderr; what a script prints on stdout is its figures.
set -u
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OPENBLAS_NUM_THREADS=1

# need PROGRAM HOW: stops, saying HOW to build PROGRAM, when it is not there
need() { [ -x "$1" ] || { echo "bench/$bench: $1 is missing ($2)" >&2; exit 1; }; }
# failed NAME WHAT: stops, saying WHAT failed, with the last lines of its output ($tmp/NAME)
failed() { echo "bench/$bench: $2 failed:" >&2; tail -n 20 "$tmp/$1" >&2; exit 1; }
# launch NAME COMMAND...: runs COMMAND, its output in $tmp/NAME; stops when it fails
launch() { local name=$1; shift; "$@" >"$tmp/$name" 2>&1 || failed "$name" "$name"; }
# run NAME NP ARGS...: $bin on NP ranks with the script's common options and ARGS, through launch
run() { local name=$1 np=$2; shift 2; launch "$name" mpirun -n "$np" "$bin" "${common[@]}" "$@"; }
# peak NAME CATEGORY: the largest figure of CATEGORY over the ranks in run NAME's memory account
# ("memory peak rank R: ... CATEGORY X MiB ..."), in MiB
peak() { sed -n "s/^memory peak rank [0-9]*: .*$2 \([0-9.]*\) MiB.*/\1/p" "$tmp/$1" | sort -g | tail -n 1; }
# least, most: the smallest and the largest of the numbers on stdin, one a line
least() { sort -g | head -n 1; }
most() { sort -g | tail -n 1; }
# median V...: the median of the values (of an even count, the mean of the middle two)
median() {
  printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
