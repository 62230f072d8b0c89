"""The models a folder holds, by name: what ``aioengine serve --models-dir`` serves.

A ``.gguf`` file is named by its stem (a split file by its first part's, the name without ``-00001-of-N``);
a folder holding ``config.json`` (a Hugging Face checkpoint) by the folder's name. Hidden entries are skipped.
Nothing is opened or checked here: a bad file fails its own model's load, not the listing. Two entries of
one name (``x.gguf`` beside a folder ``x``) are refused, naming both.
"""

from __future__ import annotations

import re
from pathlib import Path

_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<parts>\d{5})$")


def scan_models_dir(folder: str | Path) -> dict[str, str]:
    """``{name: path}`` for the folder's models, sorted by name; ValueError when it is not a folder."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {folder}: not a folder")
    found: dict[str, str] = {}
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        name = None
        if entry.is_file() and entry.suffix == ".gguf":
            split = _SPLIT.match(entry.stem)
            if split is not None and int(split["part"]) != 1:
                continue  # the other parts load with the first
            name = split["stem"] if split is not None else entry.stem
        elif entry.is_dir() and (entry / "config.json").is_file():
            name = entry.name
        if name is None:
            continue
        if name in found:
            raise ValueError(f"--models-dir {folder}: {found[name]} and {entry} are both named {name!r}")
        found[name] = str(entry)
    return dict(sorted(found.items()))
