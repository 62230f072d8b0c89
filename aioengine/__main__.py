"""`python -m aioengine ...`: the same command line as the `aioengine` script."""

from aioengine.cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
