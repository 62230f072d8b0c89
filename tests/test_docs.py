"""docs/architecture.md and the design notes name only paths that exist, and the tour's functions are real."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "docs" / "architecture.md", *sorted((ROOT / "docs" / "design").glob("*.md"))]
_FILE = re.compile(r"^[\w./-]+\.(py|c|h|md|sh|json)$|^[\w./-]+/$")


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Backticked file or folder names that exist nowhere: a path with a slash is looked up from the repo
    root, from aioengine/ and from tests/; a bare file name anywhere under aioengine/, tests/ or docs/."""
    out = []
    for token in _backticked(text):
        if not _FILE.match(token) or token.startswith("../"):
            continue
        if "/" in token.rstrip("/"):
            if not any((base / token).exists() for base in (root, root / "aioengine", root / "tests")):
                out.append(token)
        elif not any(next(root.glob(f"{d}/**/{token}"), None) for d in ("aioengine", "tests", "docs")):
            out.append(token)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_path_exists(page):
    assert missing_paths(page.read_text()) == []


def test_a_stale_path_is_caught():
    text = "see `aioengine/engine.py` and `model_files.py`, not `sched/scheduler.py` or `handle.py`"
    assert missing_paths(text) == ["aioengine/engine.py", "model_files.py"]


def _defined(path: Path) -> set[str]:
    """Top-level names and Class.method names defined in a module."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
    return names


def tour_functions(text: str) -> list[tuple[str, str]]:
    """Each ``package/file.py`: `Name`` pair (a path from aioengine/): (file, name)."""
    return re.findall(r"`(\w+/[\w/]+\.py)`: `([\w.]+)", text)


def test_every_tour_stop_names_a_function_in_its_file():
    text = (ROOT / "docs" / "architecture.md").read_text()
    tour = text.split("## The tour, stop by stop", 1)[1].split("\n## ", 1)[0]
    stops = [line for line in tour.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(line.split("|")[1]) for line in stops] == list(range(1, 13)), "the tour has stops 1-12"
    pairs = tour_functions(text)
    assert len(pairs) >= 12
    wrong = [f"{f}: {name}" for f, name in pairs if name not in _defined(ROOT / "aioengine" / f)]
    assert wrong == []
