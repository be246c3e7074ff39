#!/usr/bin/env bash
# The smoke test on other Python versions (issue 21): for each version given (pyenv's
# version names, e.g. 3.10.13 3.13.0: the oldest and newest the package declares), a fresh
# venv gets the package's wheel and its declared dependencies (the torch extra's too), then runs
#   gpumemd --no-nvml status;  pyalloc stress --quick;  the gpumemd tests.
# torch is left out of the venvs: neither gpumemd, the stress suite without a GPU, nor the
# gpumemd tests import it, and its wheels for every version are on PyPI (a CUDA build of
# about a gigabyte each). The wheel is built once: it holds a native library and no CPython
# extension (py3-none), so the same file installs on every version.
# Fails with one line naming the missing interpreter if a version is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
[ $# -ge 1 ] || { echo "usage: tools/python_versions_smoke.sh VERSION..." >&2; exit 2; }
pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
for v in "$@"; do
  [ -x "$pyenv_root/versions/$v/bin/python3" ] || {
    echo "python-smoke: Python $v is not installed ($pyenv_root/versions/$v/bin/python3 missing; pyenv install $v)" >&2
    exit 1
  }
done

work=$(mktemp -d /tmp/pyalloc-smoke.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "python-smoke: building the wheel once"
python3 -m pip wheel --quiet --no-deps . -w "$work/wheel" 2>"$work/wheel.txt" ||
  { cat "$work/wheel.txt" >&2; echo "python-smoke: building the wheel failed" >&2; exit 1; }
wheel=$(ls "$work"/wheel/pyalloc-*.whl)

for v in "$@"; do
  started=$SECONDS
  py="$pyenv_root/versions/$v/bin/python3"
  venv="$work/venv-$v"
  "$py" -m venv "$venv"
  # The wheel without its dependencies, then every declared dependency but torch, as the
  # wheel's own metadata states them: the base ones with their markers (tomli on 3.10 only) and
  # the torch extra's (matplotlib and tqdm, for the stress plot and bar), its marker dropped.
  "$venv/bin/python" -m pip install --quiet --no-deps "$wheel"
  deps=$("$venv/bin/python" - <<'EOF'
from importlib.metadata import requires
base = [r for r in requires("pyalloc") if "extra ==" not in r]
extra = [r.split(";")[0].strip() for r in requires("pyalloc") if 'extra == "torch"' in r]
print("\n".join(r for r in base + extra if not r.startswith("torch")))
EOF
)
  mapfile -t dep_list <<<"$deps"
  # pip reports the missing torch as a "dependency conflict" on stderr: kept in a file, shown on failure.
  "$venv/bin/python" -m pip install --quiet "${dep_list[@]}" "pytest>=7" 2>"$work/pip-$v.txt" ||
    { cat "$work/pip-$v.txt" >&2; echo "python-smoke: Python $v: installing the dependencies failed" >&2; exit 1; }
  (cd "$work" && "$venv/bin/gpumemd" --no-nvml status >/dev/null)
  (cd "$work" && "$venv/bin/pyalloc" stress --quick >"$work/stress-$v.txt" 2>"$work/stress-$v.err") ||
    { tail -5 "$work/stress-$v.err" >&2; echo "python-smoke: Python $v: pyalloc stress --quick failed" >&2; exit 1; }
  lib=$(cd "$work" && "$venv/bin/python" -c "from pyalloc._lib import library_path; print(library_path())")
  PYALLOC_LIBRARY="$lib" "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/gpumemd
  echo "python-smoke: Python $v passed (install, gpumemd status, pyalloc stress --quick, gpumemd tests) in $((SECONDS - started)) s"
done
