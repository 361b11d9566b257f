#!/usr/bin/env bash
# Installs what smp's build, tests and demo need, and nothing when all is there.
# Debian packages by apt-get; Python test tools by pip.
set -euo pipefail
debs=(mpich libmpich-dev cmake libdlpack-dev zlib1g-dev dataset-fashion-mnist fortunes libopenblas-dev clang libclang-rt-14-dev
      python3-torch) # python3-torch: test-only (test/gpt_torch_check.py, run by Debian's /usr/bin/python3)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  cmd="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "smp needs: ${missing[*]}"
    echo "run as root:  $cmd"
    exit 1
  fi
  echo "deps: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
py=(safetensors numpy)
pymissing=()
for m in "${py[@]}"; do python3 -c "import $m" 2>/dev/null || pymissing+=("$m"); done
if [ ${#pymissing[@]} -gt 0 ]; then
  echo "deps: pip installing ${pymissing[*]}"
  python3 -m pip install -q "${pymissing[@]}" 2>/dev/null || python3 -m pip install -q --break-system-packages "${pymissing[@]}"
fi
exit 0
