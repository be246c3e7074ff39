"""`import pyalloc` stays light: tools like gpumemd must not pay for importing torch."""

from __future__ import annotations

import os
import subprocess
import sys


def test_importing_pyalloc_and_gpumemd_does_not_import_torch() -> None:
    code = "import sys, pyalloc, pyalloc.gpumemd.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         cwd=os.path.dirname(os.path.abspath(__file__)), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_offload_manager_is_still_reachable_from_the_package() -> None:
    import pyalloc

    assert callable(pyalloc.offload)
    # Importing the offload manager's modules must not replace the function with a module.
    import pyalloc.offloading.session  # noqa: F401

    assert callable(pyalloc.offload) and pyalloc.offload.__name__ == "offload"
