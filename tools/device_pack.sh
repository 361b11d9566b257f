#!/usr/bin/env bash
# Packs what the GPU checks need onto a machine that has CUDA, cuBLAS and
# NCCL but no MPICH (the device machines lent to some sessions): the CUDA
# binaries built here (as CI builds them), MPICH's launcher and every shared
# library they load that is neither glibc's, the compiler's nor CUDA's,
# UCX's transport modules, the Fashion-MNIST files and the fortunes corpus
# (gpt.cu's text). All of it goes into
# one archive, .device/pack.tar.xz (git ignores .device; about 45 MiB, so it
# fits the 64 MiB a device call carries); tools/device_run.sh unpacks it.
#
#   bash tools/device_pack.sh
#   then, with the device tool: run  command "bash tools/device_run.sh"
#                                    carry   [".device"]
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
make --no-print-directory cuda
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mkdir -p "$out/lib" "$out/bin" "$out/fashion-mnist" "$out/fortunes" "$out/build"
bins=(build/cuda/test_gpu build/cuda/fmnist build/cuda/gpt build/cuda/nccl_allreduce build/bench/nccl)
launcher=(/usr/bin/mpiexec.hydra /usr/bin/hydra_pmi_proxy)
# ldd lists the whole closure; the device brings its own C and C++ runtimes, CUDA, cuBLAS and NCCL
ldd "${bins[@]}" "${launcher[@]}" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -vE '/lib(c|m|dl|rt|pthread|resolv|gcc_s|stdc\+\+|nccl|cublas|cublasLt|cudart)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
mkdir "$out/lib/ucx"
cp -L /usr/lib/x86_64-linux-gnu/ucx/*.so.0 "$out/lib/ucx/"
strip --strip-unneeded "$out"/lib/*.so* "$out"/lib/ucx/*.so*
cp "${launcher[@]}" "$out/bin/"
ln -s mpiexec.hydra "$out/bin/mpirun"
cp /usr/share/datasets/fashion-mnist/*.gz "$out/fashion-mnist/"
find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp {} "$out/fortunes/" \;
cp "${bins[@]}" "$out/build/"
mkdir -p .device
rm -f .device/pack.tar.xz
tar -C "$out" -cJf .device/pack.tar.xz .
echo "packed $(du -sh .device/pack.tar.xz | cut -f1) into .device/pack.tar.xz: $(ls "$out/lib" | grep -c '\.so') libraries, the launcher, ${#bins[@]} CUDA programs, the datasets"
