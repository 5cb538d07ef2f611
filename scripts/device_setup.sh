#!/usr/bin/env bash
# Device-machine setup for every session, then run the given command:
#   bash scripts/device_setup.sh python3 -m pytest tests/gpu -q -n 3 --dist loadgroup
# Needs the zrs wheel carried in .whl/ (here: `maturin build --release -o .whl`, then
# `run(..., carry=[".whl"])`). Installs it to /tmp/site, keeps NVLink multicast off, prebuilds
# the CUDA copy kernels (cached in the torch extensions folder), then execs "$@" from the repo
# root, so tests import the installed zrs (with its compiled _core), not the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."

# NVLink multicast stays off on these machines (it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

# The device's Python sets PYTHONDONTWRITEBYTECODE=1 and ships torch without bytecode, so every
# process compiled each module it imported from source: 4.5-10.8 s of a warm 1b first step at
# two ranks (12.6 and 18.9 s against 8.1 s with the bytecode cached; session 27). A normal
# install has the bytecode: keep it under /tmp, compiled once per machine.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/zrs_pycache

shopt -s nullglob
zrs_wheels=(.whl/zrs-*.whl)
if [ ${#zrs_wheels[@]} -eq 0 ]; then
  echo "device_setup: no .whl/zrs-*.whl; build one with 'maturin build --release -o .whl' and" \
    "pass carry=[\".whl\"]" >&2
  exit 2
fi
wheel=$(ls -t "${zrs_wheels[@]}" | head -n 1)  # the newest, if several were carried
others=()
for w in .whl/*.whl; do
  case "$w" in .whl/zrs-*) ;; *) others+=("$w") ;; esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  "$wheel" ${others[@]+"${others[@]}"}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

# A wheel carried again may keep a file's size and (zip) time with new contents: its bytecode,
# and that of anything else installed under /tmp, is never reused from an earlier call.
# Then compile it, as pip does at install: a first-step number must not include compiling zrs's
# (or DeepSpeed's) modules from source, which a user's install never pays.
rm -rf "$PYTHONPYCACHEPREFIX/tmp"
python3 -m compileall -q -j 0 /tmp/site >/dev/null 2>&1 || true
if [ ! -e "$PYTHONPYCACHEPREFIX/.complete" ]; then
  purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  t0=$(date +%s)
  for d in torch sympy triton transformers numpy networkx jinja2; do
    if [ -d "$purelib/$d" ]; then
      timeout 300 python3 -m compileall -q -j 0 "$purelib/$d" >/dev/null 2>&1 || true
    fi
  done
  mkdir -p "$PYTHONPYCACHEPREFIX" && touch "$PYTHONPYCACHEPREFIX/.complete"
  echo "device_setup: bytecode compiled into $PYTHONPYCACHEPREFIX in $(($(date +%s) - t0)) s"
fi
echo "device_setup: $(basename "$wheel"); $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
# (-W: runpy notes that the package already imported zrs.runtime.kernels; harmless here)
# ZRS_SKIP_PREBUILD=1 skips the kernel build (runs that do not use the kernels, short budgets).
if [ -z "${ZRS_SKIP_PREBUILD:-}" ] && ! python3 -W "ignore::RuntimeWarning:runpy" -m zrs.runtime.kernels --build; then
  echo "device_setup: kernel prebuild FAILED; zrs falls back to torch ops (with a warning)" >&2
fi

if [ $# -gt 0 ]; then
  exec "$@"
fi
