"""The tree keeps its rules: only a backend names a device, and only env.py reads the environment."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "aioengine"
# Where device names belong: the backends (and the one place that picks between them) and the kernels.
DEVICE_OWNERS = ("gpu/backend.py", "gpu/backends.py", "gpu/cpu/", "gpu/cuda/", "kernels/")
# The one exception: the names a user may give --device, a vocabulary rather than a device check.
DEVICE_VOCABULARY = {("config.py", "DEVICE_CHOICES")}
_DEVICE_STRING = re.compile(r"^cuda(:\d+)?$|nccl", re.I)


def _sources(skip: tuple[str, ...] = ()) -> list[tuple[str, ast.AST]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(skip):
            out.append((rel, ast.parse(path.read_text(), rel)))
    return out


def device_mentions(rel: str, tree: ast.AST) -> list[str]:
    """Code (not comments or docstrings) that names a device: torch.cuda, .is_cuda, device.type, NCCL, or
    the string "cuda"."""
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if any((rel, n) in DEVICE_VOCABULARY for n in names):
                allowed.update(id(n) for n in ast.walk(node.value))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            allowed.add(id(node.value))  # a docstring (or a bare string): prose, not code
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute):
            base = node.value
            if node.attr == "is_cuda" or "nccl" in node.attr.lower():
                found.append(f"{where} .{node.attr}")
            elif node.attr == "cuda" and isinstance(base, ast.Name) and base.id == "torch":
                found.append(f"{where} torch.cuda")
            elif node.attr == "type" and (
                (isinstance(base, ast.Name) and base.id == "device")
                or (isinstance(base, ast.Attribute) and base.attr == "device")
            ):
                found.append(f"{where} device.type")
        elif isinstance(node, ast.Name) and "nccl" in node.id.lower():
            found.append(f"{where} {node.id}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in allowed
            and _DEVICE_STRING.search(node.value)
        ):
            found.append(f"{where} {node.value!r}")
    return found


def test_only_a_backend_names_a_device():
    found = [m for rel, tree in _sources(skip=DEVICE_OWNERS) for m in device_mentions(rel, tree)]
    assert found == [], (
        "device names outside gpu/backend*.py, gpu/cpu/, gpu/cuda/ and kernels/:\n" + "\n".join(found)
    )


def test_the_device_check_is_live():
    """Each kind of device test is caught, and the same text in a comment or docstring is not."""
    src = '''
"""Runs on cuda or nccl, says the docstring."""
import torch
DEVICE_CHOICES = ("auto", "cuda")
def f(x, device):
    # torch.cuda in a comment is fine
    a = torch.cuda.is_available()
    b = x.is_cuda
    c = device.type == "cpu"
    d = x.device.type
    e = "cuda:1"
    g = dist.ProcessGroupNCCL
'''
    found = device_mentions("config.py", ast.parse(src))
    kinds = sorted(m.split(" ", 1)[1] for m in found)
    assert kinds == ["'cuda:1'", ".ProcessGroupNCCL", ".is_cuda", "device.type", "device.type", "torch.cuda"]
    assert any("'cuda'" in m for m in device_mentions("other.py", ast.parse(src)))  # the exception is narrow


def _environment_reads(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "putenv", "unsetenv")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            lines.append(node.lineno)
    return lines


def test_only_env_py_reads_the_environment():
    found = [
        f"{rel}:{line}" for rel, tree in _sources() if rel != "env.py" for line in _environment_reads(tree)
    ]
    assert found == []
