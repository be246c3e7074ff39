"""Packaging (issue 23): the light base install and the torch extra as pyproject.toml declares
them, and the gpumemd image's Containerfile against the repository and the DaemonSet that runs
it. Building the image needs a container engine; where none runs (this machine has the docker
client and no daemon) the build test is skipped and the file's inputs are checked instead.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILE = ROOT / "docs" / "gpumemd.Containerfile"
TRAINING = {"torch", "matplotlib", "tqdm"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, the rest of its line) of the Containerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_base_install_is_light_and_the_torch_extra_has_the_training_side() -> None:
    project = _project()
    assert not _names(project["dependencies"]) & TRAINING
    extras = project["optional-dependencies"]
    assert _names(extras["torch"]) == TRAINING
    assert extras["gpumemd"] == []


def test_every_input_the_containerfile_copies_exists_in_the_repository() -> None:
    copies = [shlex.split(rest) for word, rest in _instructions() if word == "COPY" and not rest.startswith("--from")]
    assert copies
    for args in copies:
        for source in args[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    copied = {Path(s).parts[0] for args in copies for s in args[:-1]}
    # what building the wheel reads: pyproject's build, CMake's sources, the readme in the metadata
    assert {"pyproject.toml", "CMakeLists.txt", "README.md", "allocator", "cuda", "pyalloc"} <= copied


def test_the_image_installs_only_the_light_daemon_and_runs_gpumemd() -> None:
    steps = _instructions()
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    installs = re.findall(r"pip install[^&]*", runs)
    assert installs and all("[" not in i and "torch" not in i for i in installs), installs
    assert [rest for word, rest in steps if word == "ENTRYPOINT"] == ['["gpumemd"]']


def test_the_image_tag_is_the_daemonsets_and_the_package_version() -> None:
    version = _project()["version"]
    daemonset = (ROOT / "docs" / "gpumemd-daemonset.yaml").read_text()
    image = re.search(r"image:\s*(\S+)", daemonset)
    assert image is not None
    assert image.group(1) == f"pyalloc/gpumemd:{version}"
    assert f"-t {image.group(1)} " in CONTAINERFILE.read_text()
    # the DaemonSet's args are a gpumemd subcommand: the image's entrypoint is gpumemd
    assert re.search(r'args:\s*\["serve"', daemonset)


def _engine() -> str | None:
    for engine in ("docker", "podman"):
        if shutil.which(engine) and subprocess.run([engine, "info"], capture_output=True).returncode == 0:
            return engine
    return None


@pytest.mark.slow
def test_the_image_builds_and_gpumemd_runs_in_it() -> None:
    engine = _engine()
    if engine is None:
        pytest.skip("no container engine running here (docker info fails)")
    tag = f"pyalloc/gpumemd:{_project()['version']}"
    subprocess.run([engine, "build", "-f", str(CONTAINERFILE), "-t", tag, str(ROOT)], check=True, timeout=1800)
    done = subprocess.run([engine, "run", "--rm", tag, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("gpumemd "), done.stderr
