#!/usr/bin/env bash
# Builds libpyalloc.so and the torch-facing layer from this checkout, then runs `pyalloc gpu-check`
# with every log and report in one folder: the one command a borrowed GPU machine runs (it has
# torch, CMake, ninja and a compiler, but pyalloc is not installed there).
#
#   tools/gpu_check_from_checkout.sh OUT_DIR [gpu-check options...]
#
# OUT_DIR gets build.log (with the seconds each build took), vmm_calls.json and .log (the driver's
# virtual-memory calls priced on this GPU: tools/bench/vmm_calls.py, a few seconds), gpu-check.log
# (the progress lines and the targets), and gpu-check's own files: gpu-check.json, gpu-check.md,
# tests-gpu.log and tests-gpu-results.log. Exits with gpu-check's status, or 1 when the build fails (its log's tail is
# printed).
#
# A GPU session (15 minutes of device time) does not fit every check in one command: the first run's last line
# names what the budget left unfinished; run that next on the same warm machine (the build and the torch layer
# are kept, so it starts at once), e.g.
#   tools/gpu_check_from_checkout.sh OUT_DIR-rest --only resnet50,tests/gpu --budget 280
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUT_DIR [gpu-check options...]" >&2
  exit 2
fi
out=$1
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

start=$SECONDS
if ! { cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build build; } >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
echo "libpyalloc.so built in $((SECONDS - start)) s" | tee -a "$out/build.log"
export PYALLOC_LIBRARY=$PWD/build/libpyalloc.so

# Each gpu-check child installs pyalloc and would otherwise build the layer itself on first use.
start=$SECONDS
python3 -c "from pyalloc.pytorch import layer; print(layer.build('cuda')); print(layer.build('ops'))" \
  >>"$out/build.log" 2>&1 || echo "the torch layer did not build (see $out/build.log); gpu-check goes on" >&2
echo "torch layer built in $((SECONDS - start)) s" | tee -a "$out/build.log"

timeout 60 python3 tools/bench/vmm_calls.py --gib 8 --json "$out/vmm_calls.json" >"$out/vmm_calls.log" 2>&1 ||
  echo "vmm_calls.py failed (see $out/vmm_calls.log); gpu-check goes on" >&2

python3 -c "import sys; from pyalloc.cli import main; sys.exit(main())" gpu-check --out "$out" "$@" 2>&1 \
  | tee "$out/gpu-check.log"
exit "${PIPESTATUS[0]}"
