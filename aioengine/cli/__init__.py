"""The `aioengine` command line (`serve`, `chat`, `bench`); kept light so that benches import no engine."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from aioengine.cli.commands import main as run

    return run(argv)
