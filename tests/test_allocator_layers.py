"""The allocator's folders are layers (allocator/src/README.md): includes only run down.

Every quoted ``#include`` in allocator/src and cuda/ is read and checked against the
table below, which is the README's table; a new folder, or an include that reaches
into a layer above its own, fails here with the file and line that does it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SRC = REPO_ROOT / "allocator" / "src"
SOURCE_SUFFIXES = (".hpp", ".cpp", ".h")
MAX_SOURCE_LINES = 600

# Each layer and the layers it may include, besides itself. The public headers
# (allocator/include/pyalloc/*.h: the C ABI and the registry record) depend on
# nothing and may be included anywhere.
MAY_INCLUDE: dict[str, frozenset[str]] = {
    "ground": frozenset(),
    "backends": frozenset({"ground"}),
    "blocks": frozenset({"ground", "backends"}),
    "observe": frozenset({"ground", "backends", "blocks"}),
    "policy": frozenset({"ground", "backends", "blocks"}),
    "device": frozenset({"ground", "backends", "blocks", "observe", "policy"}),
    "node": frozenset({"ground"}),
    "abi": frozenset({"ground", "backends", "blocks", "observe", "policy", "device", "node"}),
    "replay": frozenset({"ground", "backends", "blocks", "observe", "device", "abi"}),
    # cuda/ holds the cuda backend: a backend, reached only through backends/backend.hpp;
    # cuda/torch/, the torch-facing layer, reaches the allocator through the C ABI alone.
    "cuda": frozenset({"ground", "backends"}),
}

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def _layer_of(path: Path) -> str:
    if path.is_relative_to(SRC):
        return path.relative_to(SRC).parts[0]
    return path.relative_to(REPO_ROOT).parts[0]


def _sources() -> list[Path]:
    files = [p for p in SRC.rglob("*") if p.suffix in SOURCE_SUFFIXES]
    files += [p for p in (REPO_ROOT / "cuda").rglob("*") if p.suffix in SOURCE_SUFFIXES]
    return sorted(files)


def include_violations(files: list[Path]) -> list[str]:
    """Each include that runs up or sideways, as 'file:line: layer includes target'."""
    problems = []
    for path in files:
        layer = _layer_of(path)
        allowed = MAY_INCLUDE.get(layer)
        if allowed is None:
            problems.append(f"{path.relative_to(REPO_ROOT)}: folder {layer!r} is not a layer in the table")
            continue
        text = path.read_text()
        for match in _INCLUDE.finditer(text):
            target = match.group(1)
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(REPO_ROOT)}:{line}"
            if target.startswith("pyalloc/"):
                continue  # the public headers
            if layer == "cuda" and "/" not in target:
                continue  # cuda/'s own headers, beside it
            if "/" not in target:
                problems.append(f"{where}: include \"{target}\" names no layer (write \"<layer>/{target}\")")
                continue
            target_layer = target.split("/", 1)[0]
            if not (SRC / target).is_file():
                problems.append(f"{where}: include \"{target}\" is not a file under allocator/src")
            elif target_layer != layer and target_layer not in allowed:
                problems.append(f"{where}: {layer} includes {target}, a layer it may not use")
    return problems


def test_every_include_runs_down_the_layers() -> None:
    problems = include_violations(_sources())
    assert not problems, "\n".join(problems)


def test_the_check_finds_an_include_that_runs_up(tmp_path: Path) -> None:
    # The checker itself must be able to fail: a blocks/ file that includes the device allocator.
    fake = SRC / "blocks" / "_layer_probe_do_not_commit.hpp"
    fake.write_text('#pragma once\n#include "device/device_allocator.hpp"\n')
    try:
        problems = include_violations([fake])
    finally:
        fake.unlink()
    assert len(problems) == 1 and "blocks includes device/device_allocator.hpp" in problems[0]


@pytest.mark.parametrize("folder", sorted(MAY_INCLUDE))
def test_each_layer_folder_says_what_lives_there(folder: str) -> None:
    path = REPO_ROOT / folder if folder == "cuda" else SRC / folder
    assert path.is_dir(), f"{path} is in the layer table but does not exist"
    readme = path / "README.md"
    assert readme.is_file(), f"{path.relative_to(REPO_ROOT)} has no README.md"
    text = readme.read_text().lower()
    # What lives here, what it may use, what must never come here.
    for phrase in ("may use", "never"):
        assert phrase in text, f"{readme.relative_to(REPO_ROOT)} does not say what it {phrase}"


def test_no_layer_folder_is_missing_from_the_table() -> None:
    folders = {p.name for p in SRC.iterdir() if p.is_dir()}
    assert folders <= set(MAY_INCLUDE), f"folders with no rule: {sorted(folders - set(MAY_INCLUDE))}"
    assert not [p for p in SRC.iterdir() if p.is_file() and p.suffix in SOURCE_SUFFIXES], (
        "a source file at the top of allocator/src belongs to no layer")


def test_no_allocator_source_file_is_longer_than_a_concept() -> None:
    long_files = []
    for path in _sources() + sorted((REPO_ROOT / "allocator" / "include").rglob("*.h")):
        n = path.read_text().count("\n")
        if n > MAX_SOURCE_LINES:
            long_files.append(f"{path.relative_to(REPO_ROOT)}: {n} lines")
    assert not long_files, f"split by concept (at most {MAX_SOURCE_LINES} lines): {long_files}"


_VIRTUAL = re.compile(r"^\s*virtual\s+[^;{(]*?\b(\w+)\s*\(", re.M)
_OVERRIDE = re.compile(r"^\s*[\w:<>*&, ]+?\b(\w+)\s*\([^;{]*\)\s*(?:const\s*)?override\b", re.M)


def test_the_metered_backend_forwards_every_method_of_the_seam() -> None:
    """Note [Backend time]: a Backend method the MeteredBackend does not override would run
    Backend's default in its place, not the real backend's (for the methods with a default body:
    vmm_supported, map_range, unmap_range, the sharing calls), silently."""
    seam = set(_VIRTUAL.findall((SRC / "backends" / "backend.hpp").read_text())) - {"Backend"}
    metered = set(_OVERRIDE.findall((SRC / "backends" / "metered.hpp").read_text()))
    assert len(seam) >= 20, sorted(seam)  # the parse found the seam
    assert seam <= metered, f"Backend methods MeteredBackend does not forward: {sorted(seam - metered)}"
