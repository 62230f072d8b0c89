"""python -m aioengine.cli.bench MODE ...: the same as `aioengine bench MODE ...`."""

from aioengine.cli.bench import main

raise SystemExit(main())
