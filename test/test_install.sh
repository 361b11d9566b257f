#!/usr/bin/env bash
# make install: the headers and smp.pc are enough to build and run a program
# with a plain C compiler (no mpicc).
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! make -s -C "$top" install PREFIX="$tmp/prefix" >"$tmp/install.log" 2>&1; then
  echo "FAIL: install/make install: $(tail -n 3 "$tmp/install.log" | tr '\n' ' ')"; exit 1
fi
cat >"$tmp/prog.c" <<'C'
#define SMP_IMPLEMENTATION
#include <smp.h>
#include <smp_pipeline.h>
#include <smp_checkpoint.h>
#include <stdio.h>
int main(void) {
    smp_config cfg = {0};
    cfg.partitions = 2;
    if (smp_init(&cfg)) { fprintf(stderr, "%s\n", smp_last_error()); return 1; }
    float x = 1.0f + (float)smp_rank();
    smp_tensor t = smp_tensor_1d(&x, SMP_F32, 1);
    smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD);
    if (smp_rank() == 0) printf("sum %g\n", x);
    smp_finalize();
    return 0;
}
C
export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig"
if ! cc -std=c11 -Wall -Wextra -Werror "$tmp/prog.c" -o "$tmp/prog" $(pkg-config --cflags --libs smp) >"$tmp/cc.log" 2>&1; then
  echo "FAIL: install/build with pkg-config smp: $(head -n 5 "$tmp/cc.log" | tr '\n' ' ')"; exit 1
fi
echo "PASS: install/build with pkg-config smp"
out=$(mpirun -n 2 "$tmp/prog" 2>&1)
[ "$out" = "sum 3" ] && echo "PASS: install/installed program runs on 2 ranks" || echo "FAIL: install/installed program printed: $out"
pkg-config --cflags smp-nccl >/dev/null 2>&1 && echo "PASS: install/smp-nccl.pc is readable" || echo "FAIL: install/smp-nccl.pc is not readable"
want=$(sed -n 's/^#define SMP_VERSION_STRING "\(.*\)"/\1/p' "$tmp/prefix/include/smp.h")
got=$(pkg-config --modversion smp 2>/dev/null)
[ -n "$want" ] && [ "$got" = "$want" ] && echo "PASS: install/smp.pc's version is smp.h's ($got)" || echo "FAIL: install/smp.pc says version '$got', smp.h says '$want'"
