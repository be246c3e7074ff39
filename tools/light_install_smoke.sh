#!/usr/bin/env bash
# The light install (issue 23): gpumemd and the pyalloc command, installed as an operator would
# install them on a monitoring node, without torch, matplotlib or tqdm. A fresh venv gets the
# package's wheel and the dependencies its metadata declares (no extra), then:
#   the three packages are absent;  gpumemd --version;  gpumemd --no-nvml status --json;
#   gpumemd serve on a free loopback port, scraped over HTTP (/metrics and /v1/status);
#   pyalloc --version;  pyalloc stress --help;  a command that needs torch says in one line what
#   to install, with no traceback;  the size of what the install added to site-packages.
#
#   tools/light_install_smoke.sh [WHEEL]     (without WHEEL, the wheel is built here first)
#
# .ci/run runs it; tests/test_light_install.py runs it under `pytest -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "light-install: $*"; }
fail() { echo "light-install: FAILED: $*" >&2; exit 1; }

work=$(mktemp -d /tmp/pyalloc-light.XXXXXX)
serve_pid=
cleanup() {
  if [ -n "$serve_pid" ]; then kill "$serve_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

if [ $# -ge 1 ]; then
  wheel=$1
  [ -f "$wheel" ] || fail "no wheel at $wheel"
else
  say "building the wheel"
  python3 -m pip wheel --quiet --no-deps . -w "$work/wheel" >"$work/wheel.txt" 2>&1 ||
    { cat "$work/wheel.txt" >&2; fail "building the wheel"; }
  wheel=$(ls "$work"/wheel/pyalloc-*.whl)
fi

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
before=$(du -sk "$site" | cut -f1)
started=$SECONDS
"$py" -m pip install --quiet "$wheel" >"$work/pip.txt" 2>&1 || { cat "$work/pip.txt" >&2; fail "pip install $wheel"; }
after=$(du -sk "$site" | cut -f1)
say "installed $(basename "$wheel") and its dependencies in $((SECONDS - started)) s: site-packages grew by $(( (after - before) / 1024 )) MiB ($(( after / 1024 )) MiB in all, pip's own included)"
say "installed: $("$py" -m pip list --format=freeze 2>/dev/null | grep -v -E '^(pip|setuptools)==' | tr '\n' ' ')"

# Run outside the checkout, so that the installed package is the one imported.
cd "$work"
"$py" - <<'EOF' || fail "torch, matplotlib or tqdm came with the light install"
import importlib.util, sys
present = [m for m in ("torch", "matplotlib", "tqdm") if importlib.util.find_spec(m) is not None]
sys.exit(f"present: {present}" if present else 0)
EOF
bin="$work/venv/bin"
say "$("$bin/gpumemd" --version)"
"$bin/gpumemd" --no-nvml status --json >status.json || fail "gpumemd --no-nvml status --json"
"$py" -c "import json; d = json.load(open('status.json')); assert 'processes' in d, sorted(d)" ||
  fail "gpumemd status --json is not the status JSON"
say "gpumemd --no-nvml status --json: $(wc -c <status.json) bytes of JSON"

"$bin/gpumemd" --no-nvml serve --listen 127.0.0.1:0 --socket none --interval 200ms >serve.log 2>serve.err &
serve_pid=$!
"$py" - <<'EOF' || { cat serve.err >&2; fail "scraping gpumemd serve"; }
import json, time, urllib.request
deadline = time.monotonic() + 30
url = None
while url is None and time.monotonic() < deadline:
    for line in open("serve.log"):
        event = json.loads(line)
        if event.get("event") == "listening":
            url = event["metrics"]
    time.sleep(0.1)
assert url, "gpumemd serve never said where it listens"
metrics = urllib.request.urlopen(url, timeout=10).read().decode()
families = sorted({l.split()[2] for l in metrics.splitlines() if l.startswith("# TYPE gpumemd_")})
assert families, metrics[:500]
status = json.loads(urllib.request.urlopen(url.replace("/metrics", "/v1/status"), timeout=10).read())
print(f"light-install: scraped {url}: {len(metrics)} bytes, {len(families)} gpumemd metric families; "
      f"/v1/status has {len(status.get('processes', []))} processes")
EOF
kill "$serve_pid" && wait "$serve_pid" 2>/dev/null || true
serve_pid=

say "$("$bin/pyalloc" --version)"
"$bin/pyalloc" stress --help >/dev/null || fail "pyalloc stress --help"
say "pyalloc stress --help: ok"
set +e
"$bin/pyalloc" record mlp --tiny -o record.json >record.out 2>record.err
status=$?
set -e
[ "$status" = 1 ] || fail "pyalloc record without torch exited $status, not 1"
[ "$(wc -l <record.err)" = 1 ] && grep -q 'pip install "pyalloc\[torch\]"' record.err && ! grep -q Traceback record.err ||
  { cat record.err >&2; fail "pyalloc record without torch did not say in one line what to install"; }
say "pyalloc record without torch: $(cat record.err)"
say "passed in $SECONDS s"
