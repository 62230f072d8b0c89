"""python -m aioengine.bench MODE ...: the same as `aioengine bench MODE ...`."""

from aioengine.bench import main

raise SystemExit(main())
