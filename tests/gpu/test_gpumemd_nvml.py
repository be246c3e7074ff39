"""gpumemd on a real device: NVML's per-process bytes agree with the process's own view."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

MiB = 1 << 20

HOLDER = textwrap.dedent("""
    import sys, time
    import pyalloc
    pyalloc.install()
    import torch
    x = torch.empty(1024 * 1024 * 256, dtype=torch.float32, device="cuda")  # 1 GiB
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_nvml_used_bytes_cover_the_allocator_reserved_bytes() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        process = None
        for _ in range(200):  # the registry refreshes a few times a second
            out = subprocess.run([sys.executable, "-m", "pyalloc.gpumemd", "status", "--json"],
                                 capture_output=True, text=True, env=env, timeout=120)
            assert out.returncode == 0, out.stderr
            status = json.loads(out.stdout)
            mine = [p for p in status["processes"] if p["pid"] == holder.pid and p.get("allocator")]
            if mine and mine[0]["used_bytes"] is not None and mine[0]["allocator"]["reserved_bytes"] >= 1024 * MiB:
                process = mine[0]
                break
            time.sleep(0.1)
        assert process is not None, "the holder never appeared with NVML and allocator figures"
        reserved = process["allocator"]["reserved_bytes"]
        used = process["used_bytes"]
        # NVML counts the allocator's segments plus the CUDA context and
        # libraries' own memory: at least what pyalloc reserved, and not far more.
        assert reserved <= used <= reserved + 4096 * MiB
        assert process["device"].startswith("cuda:") or process["uuid"]
    finally:
        holder.kill()
        holder.wait()
