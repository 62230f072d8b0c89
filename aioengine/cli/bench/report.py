"""Writing a benchmark's report: --output-json / --save-result as indented JSON."""

from __future__ import annotations


def write_json(path: str | None, result: dict) -> None:
    """--output-json / --save-result: the report as indented JSON (nothing when path is None)."""
    if path:
        import orjson

        with open(path, "wb") as f:
            f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2))
