"""The README stays true: its configuration table and its set-up commands."""

from __future__ import annotations

import re
from pathlib import Path

import pyalloc

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_configuration_table_lists_exactly_the_librarys_keys() -> None:
    section = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    assert sorted(documented) == sorted(pyalloc.config())


def test_ci_runs_the_readmes_test_command() -> None:
    test_command = 'pip install ".[test]" && pytest -q'
    assert test_command in README
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_ci_installs_as_the_readmes_set_up_does() -> None:
    # the training side is the torch extra (the base install is gpumemd's, issue 23)
    assert 'pip install torch==2.13.0 ".[torch]"' in README
    assert re.search(r'pip install (--quiet )?torch==2\.13\.0 "\.\[torch\]"', (ROOT / ".ci" / "run").read_text())
