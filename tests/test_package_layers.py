"""The Python package's subpackages are layers (pyalloc/__init__.py): imports only run down.

Every ``import`` and ``from ... import`` in pyalloc/, at module level or inside a function,
relative or absolute, is read with ``ast`` and checked against the table below, which is what
the subpackages' docstrings say. So are the module names the package imports by string
(``importlib.import_module``, the CLI's ``COMMAND_MODULES``): each must exist.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pyalloc"

# Layer of each module (by dotted-name prefix, longest first) and the layers it may import.
CORE = "core binding"
LAYER_OF: dict[str, str] = {
    "pyalloc._lib": CORE,
    "pyalloc._deps": CORE,
    "pyalloc.core": CORE,
    "pyalloc.command": "command contract",
    "pyalloc.cupy_allocator": "cupy",
    "pyalloc.cli": "cli",
    "pyalloc.pytorch": "pytorch",
    "pyalloc.offloading": "offloading",
    "pyalloc.traces": "traces",
    "pyalloc.gpumemd": "gpumemd",
    "pyalloc.gpucheck": "gpucheck",
    "pyalloc.sizes": "sizes",
    "pyalloc._finalizers": "finalizers",
    "pyalloc.diagnosis": "diagnosis",
    "pyalloc": "facade",
}
# The size syntax (pyalloc.sizes) and the finalizers' Ctrl-C keeper (pyalloc._finalizers) import
# nothing of pyalloc's, and every layer may use them.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "sizes": frozenset(),
    "finalizers": frozenset(),
    CORE: frozenset({CORE}),
    "command contract": frozenset(),
    "cupy": frozenset({CORE}),
    "cli": frozenset({CORE, "command contract"}),  # the commands of subpackages: by name only
    "pytorch": frozenset({CORE, "command contract", "pytorch"}),
    "offloading": frozenset({CORE, "pytorch", "offloading"}),
    "traces": frozenset({CORE, "command contract", "pytorch", "traces"}),
    "gpumemd": frozenset({"gpumemd"}),
    "gpucheck": frozenset({CORE, "command contract", "pytorch", "traces", "offloading", "gpucheck"}),
    "diagnosis": frozenset({CORE, "command contract", "pytorch", "gpumemd", "diagnosis"}),
    "facade": frozenset({CORE, "cupy", "pytorch", "offloading", "diagnosis"}),
}
UTILITIES = frozenset({"sizes", "finalizers"})
MAY_IMPORT = {layer: allowed | UTILITIES if layer not in UTILITIES else allowed for layer, allowed in MAY_IMPORT.items()}
# Third-party packages a layer must never import, anywhere in its code.
NEVER: dict[str, frozenset[str]] = {
    "gpumemd": frozenset({"torch", "cupy"}),
    CORE: frozenset({"torch"}),
    "command contract": frozenset({"torch"}),
    "cli": frozenset({"torch"}),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(name: str) -> str:
    for prefix in sorted(LAYER_OF, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return LAYER_OF[prefix]
    raise KeyError(name)


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import mod` imports a module when `mod` is one.
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                out.append((node.lineno, candidate if _is_module(candidate) else target))
    return out


def _is_module(name: str) -> bool:
    if not name.startswith("pyalloc"):
        return False
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def package_modules() -> list[Path]:
    # _bootstrap/sitecustomize.py is loaded as a top-level module by `site`, not as part of the
    # package: it imports pyalloc only by name, checked below.
    return sorted(p for p in PACKAGE.rglob("*.py") if "_bootstrap" not in p.parts)


def layer_violations(files: list[Path]) -> list[str]:
    problems = []
    for path in files:
        name = module_name(path)
        layer = layer_of(name)
        for line, target in imported_names(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            top = target.split(".")[0]
            if top in NEVER.get(layer, frozenset()):
                problems.append(f"{where}: {layer} imports {target}, which it must never use")
            if top != "pyalloc":
                continue
            if not _is_module(target):
                problems.append(f"{where}: {target} is not a module of the package")
                continue
            target_layer = layer_of(target)
            if target_layer != layer and target_layer not in MAY_IMPORT[layer]:
                problems.append(f"{where}: {layer} ({name}) imports {target} ({target_layer})")
    return problems


def test_every_import_runs_down_the_layers() -> None:
    problems = layer_violations(package_modules())
    assert not problems, "\n".join(problems)


def test_the_check_finds_an_import_that_runs_up() -> None:
    probe = PACKAGE / "gpumemd" / "_layer_probe_do_not_commit.py"
    probe.write_text("def f():\n    import torch\n    from ..core import malloc\n    from .. import traces\n")
    try:
        problems = layer_violations([probe])
    finally:
        probe.unlink()
    assert len(problems) == 3, problems
    assert any("imports torch" in p for p in problems)
    assert any("pyalloc.core" in p for p in problems)
    assert any("pyalloc.traces" in p for p in problems)


def string_module_names() -> list[tuple[Path, str]]:
    """Module names the package imports by string: importlib.import_module("..."), COMMAND_MODULES."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((path, arg.value))
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "COMMAND_MODULES":
                found += [(path, elt.value) for elt in node.value.elts]  # type: ignore[union-attr]
    return found


def test_modules_named_by_string_exist() -> None:
    names = string_module_names()
    assert any(name == "pyalloc.traces.stress" for _, name in names)  # the table was read
    missing = [f"{p.relative_to(ROOT)}: {name}" for p, name in names
               if name.startswith("pyalloc") and importlib.util.find_spec(name) is None]
    assert not missing, missing


@pytest.mark.parametrize("package", ["pyalloc", "pyalloc.pytorch", "pyalloc.offloading", "pyalloc.traces",
                                     "pyalloc.gpumemd", "pyalloc.diagnosis"])
def test_each_layer_says_what_lives_there(package: str) -> None:
    init = ROOT.joinpath(*package.split(".")) / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert doc, f"{init.relative_to(ROOT)} has no docstring"
    if package != "pyalloc":
        for phrase in ("What lives here", "May import", "Must never come here"):
            assert phrase in doc, f"{init.relative_to(ROOT)}: its docstring does not say {phrase!r}"


def test_no_module_is_left_at_an_old_path() -> None:
    # No shims: the modules that moved into subpackages are gone from the top.
    old = ["torch_compat", "training_state", "offload_manager", "offload_process", "registry", "trace",
           "record", "replay", "stress", "generators", "models", "selftest"]
    left = [name for name in old if (PACKAGE / f"{name}.py").exists()]
    assert not left and not (PACKAGE / "workloads").exists() and not (PACKAGE / "_bootstrap").exists(), left
