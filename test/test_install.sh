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

# The same program from a CMake project: find_package(smp) on the installed
# lib/cmake/smp, the version checked against smp.h's, the program linked to
# smp::smp only (MPI, threads and libm come with the target).
mkdir -p "$tmp/cmake-consumer"
cp "$tmp/prog.c" "$tmp/cmake-consumer/prog.c"
cat >"$tmp/cmake-consumer/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.17)
project(consumer LANGUAGES C)
find_package(smp $want EXACT REQUIRED)
add_executable(prog prog.c)
target_compile_options(prog PRIVATE -Wall -Wextra -Werror)
target_link_libraries(prog PRIVATE smp::smp)
if(TARGET smp::nccl)
  # the device side: a C file that includes smp_nccl.h, built against smp::nccl (compiled and linked, not run)
  file(WRITE \${CMAKE_BINARY_DIR}/dev.c "#define SMP_IMPLEMENTATION\n#include <smp_nccl.h>\nint main(void) { return smp_init(0) == SMP_OK ? (smp_finalize(), 0) : 1; }\n")
  add_executable(dev \${CMAKE_BINARY_DIR}/dev.c)
  target_compile_options(dev PRIVATE -Wall -Wextra -Werror)
  target_link_libraries(dev PRIVATE smp::nccl)
  file(WRITE \${CMAKE_BINARY_DIR}/has_nccl "yes")
endif()
CMAKE
if ! command -v cmake >/dev/null 2>&1; then
  echo "FAIL: install/cmake not found (tools/deps.sh installs it)"; exit 1
fi
cb="$tmp/cmake-consumer/build"
if ! cmake -S "$tmp/cmake-consumer" -B "$cb" -DCMAKE_PREFIX_PATH="$tmp/prefix" >"$tmp/cmake.log" 2>&1 ||
   ! cmake --build "$cb" >>"$tmp/cmake.log" 2>&1; then
  echo "FAIL: install/build with find_package(smp): $(grep -m 5 -E 'Error|error' "$tmp/cmake.log" | tr '\n' ' ')"; exit 1
fi
echo "PASS: install/build with CMake find_package(smp $want) and smp::smp"
out=$(mpirun -n 2 "$cb/prog" 2>&1)
[ "$out" = "sum 3" ] && echo "PASS: install/the CMake-built program runs on 2 ranks" || echo "FAIL: install/the CMake-built program printed: $out"
# smp::nccl exists exactly where CUDA and NCCL are: nvcc's toolkit with nccl.h
cuda_home=${CUDA_HOME:-/usr/local/cuda}
if [ -x "$cuda_home/bin/nvcc" ] && [ -f "$cuda_home/include/nccl.h" ]; then
  [ -f "$cb/has_nccl" ] && [ -x "$cb/dev" ] && echo "PASS: install/smp::nccl builds a program with smp_nccl.h" \
    || echo "FAIL: install/CUDA and NCCL are at $cuda_home but find_package(smp) made no smp::nccl, or its program did not build"
else
  [ ! -f "$cb/has_nccl" ] && echo "PASS: install/no CUDA+NCCL here, and no smp::nccl target" || echo "FAIL: install/smp::nccl defined without CUDA and NCCL"
fi
# a version smp.h does not carry is refused
sed -i "s/find_package(smp $want EXACT REQUIRED)/find_package(smp 99.0 REQUIRED)/" "$tmp/cmake-consumer/CMakeLists.txt"
if cmake -S "$tmp/cmake-consumer" -B "$tmp/cmake-consumer/build99" -DCMAKE_PREFIX_PATH="$tmp/prefix" >"$tmp/cmake99.log" 2>&1; then
  echo "FAIL: install/find_package(smp 99.0) accepted version $want"
else
  grep -q "$want" "$tmp/cmake99.log" && echo "PASS: install/find_package(smp 99.0) is refused, naming version $want" \
    || echo "FAIL: install/find_package(smp 99.0) failed without naming version $want: $(tail -n 3 "$tmp/cmake99.log" | tr '\n' ' ')"
fi
