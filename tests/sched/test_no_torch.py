"""sched/ is pure Python: importing it (and the package root) never loads torch."""

import subprocess
import sys


def test_sched_never_imports_torch():
    code = (
        "import sys; import aioengine.sched.scheduler, aioengine.cli.bench.scheduler; "
        "assert 'torch' not in sys.modules, 'sched imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
