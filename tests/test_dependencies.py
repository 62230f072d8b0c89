"""Every third-party import in the package, the tests and the scripts is declared in pyproject.toml."""

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("aioengine", "tests", "scripts")
FIRST_PARTY = {"aioengine", "tests", "scripts"}
# Import names whose distribution is in an extra that the test venv does not install, so
# importlib.metadata cannot map them: their declared distribution is named here.
NOT_INSTALLED = {"cuda": "cuda-python", "ray": "ray"}
# Extras whose modules a test may skip on (pytest.importorskip) when they are not installed.
OPTIONAL_EXTRAS = {"gpu", "ray"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: Path) -> dict[str, set[str]]:
    """Normalized distribution name -> the extras declaring it ("" for the core dependencies)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    groups = {"": project.get("dependencies", []), **project.get("optional-dependencies", {})}
    out: dict[str, set[str]] = {}
    for extra, reqs in groups.items():
        for req in reqs:
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            assert m, f"unparsable requirement {req!r}"
            out.setdefault(_norm(m.group(1)), set()).add(extra)
    return out


def _imported_names(tree: ast.AST) -> set[str]:
    """Top-level names of absolute imports, `pytest.importorskip("x")` and `import_module("x")` included."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            attr = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if attr in ("importorskip", "import_module") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return {n.split(".")[0] for n in names if n}


def third_party_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Third-party top-level import name -> the files that import it."""
    found: dict[str, set[str]] = {}
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            for name in _imported_names(ast.parse(path.read_text(), str(path))):
                if name in sys.stdlib_module_names or name in FIRST_PARTY or name.startswith("_"):
                    continue
                found.setdefault(name, set()).add(str(path.relative_to(root)))
    return found


def undeclared(pyproject: Path, imports: dict[str, set[str]]) -> list[str]:
    """One line per import whose distribution pyproject.toml does not declare."""
    decl = declared(pyproject)
    dists_of = importlib.metadata.packages_distributions()
    problems = []
    for name, files in sorted(imports.items()):
        if name in dists_of:
            dists = {_norm(d) for d in dists_of[name]}
        elif name in NOT_INSTALLED:
            dists = {_norm(NOT_INSTALLED[name])}
        else:
            dists = {_norm(name)}
        if not dists & decl.keys():
            dist = "/".join(sorted(dists))
            problems.append(f"{name} (distribution {dist}) imported by {sorted(files)[:3]}")
    return problems


def test_every_third_party_import_is_declared():
    assert undeclared(ROOT / "pyproject.toml", third_party_imports()) == []


def test_removing_a_declared_dependency_is_caught(tmp_path):
    """The check is live: drop scipy (or any one requirement) from a copy of pyproject.toml and it fails."""
    text = (ROOT / "pyproject.toml").read_text()
    imports = third_party_imports()
    for dist in ("scipy", "jinja2", "numpy", "openai"):
        pattern = rf'^\s*"{dist}[^"]*",.*\n'
        assert re.search(pattern, text, re.M | re.I), f"{dist} is not declared on a line of its own"
        copy = tmp_path / f"pyproject-{dist}.toml"
        copy.write_text(re.sub(pattern, "", text, flags=re.M | re.I))
        missing = undeclared(copy, imports)
        assert any(line.startswith(f"{dist} ") for line in missing), (dist, missing)


def test_optional_extras_are_not_core():
    """Modules a test may skip on belong to an optional extra, never to the core dependencies."""
    decl = declared(ROOT / "pyproject.toml")
    for dist in NOT_INSTALLED.values():
        assert "" not in decl[_norm(dist)] and decl[_norm(dist)] & OPTIONAL_EXTRAS, dist


_IMPORT_ALL = r"""
import importlib, sys, traceback
import _pytest.outcomes
failed = []
for mod in sys.argv[1:]:
    try:
        importlib.import_module(mod)
    except _pytest.outcomes.Skipped as e:
        print("SKIPPED", mod, e.msg, flush=True)
    except BaseException:
        failed.append(mod)
        print("FAILED", mod, traceback.format_exc(limit=3), flush=True)
sys.exit(1 if failed else 0)
"""


def _module_names() -> list[str]:
    mods = []
    for top in ("aioengine", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if rel.name != "__main__":
                mods.append(".".join(parts))
    return mods


@pytest.mark.timeout(300)
def test_every_module_imports_in_this_environment():
    """Each module under aioengine/ and tests/ imports in a fresh interpreter of this venv.

    A skip at import is accepted only for an optional extra's module (ray, cuda) or a Debian package.
    """
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *_module_names()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for line in proc.stdout.splitlines():
        if line.startswith("SKIPPED"):
            optional = any(f"'{name}'" in line for name in NOT_INSTALLED)
            assert optional or "apt-get install" in line, line
